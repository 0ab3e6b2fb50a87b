"""One ``run_report()``: its cycles, their results, and where a cancellation lands.

A :class:`Run` is made per call of :meth:`StateMachine.run_report` and is
dropped when it returns; it holds the run's cycle count and results, nothing
a later run reads (state is the session, state is the session). :meth:`Run.cycle` is
one pass of the loop; the loop itself, with its conflict budget, is in
``StateMachine.run_report``.

Cancellation is handled where the interrupted step is known, without state
passed on the side: a step cancelled while running is named by
:func:`~stepmachine._cycle.offer` (to ``on_cancel``, or in its return value
when the machine's token fired); a step whose decision was being applied is
the decision local to ``Run._settle``. Either way :func:`finalize` runs
shielded for at most ``finalize_timeout`` seconds with that step as the
interrupted one.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

import anyio
import msgspec

from . import _log, _tracing
from ._codec import Refusal
from ._cycle import (
    Decision,
    Idle,
    Interrupted,
    check_progress,
    idle_reason,
    log_cycle,
    offer,
    stops_the_run,
)
from ._emitter import EventSink, StepApplied, Yielded
from ._errors import ConflictError
from ._finalize import finalize, shielded
from ._runtime import Runtime
from ._session import Session
from ._steps import StepResult, Yield, YieldReason

if TYPE_CHECKING:
    from ._machine import StateMachine

__all__ = ["Run", "RunReport"]

D = TypeVar("D", bound=msgspec.Struct)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RunReport(Generic[D]):
    """What a run did.

    Attributes:
        session: the session when the run returned.
        reason: why it returned (``done``, ``idle``, ``call_held``, ``cycle_limit``,
            ``cancelled``, ...).
        results: one :class:`StepResult` per cycle that applied, in order.
    """

    session: Session[D]
    reason: YieldReason
    results: tuple[StepResult, ...] = ()


@dataclass(slots=True)
class Run(Generic[D]):
    """The cycles of one ``run_report()`` call; see the module docs."""

    machine: StateMachine[D]
    runtime: Runtime
    sink: EventSink
    start_revision: int
    cycles: int = 0
    results: list[StepResult] = field(default_factory=list)
    cut_step: str | None = None  # the step a cancellation from outside interrupted (for the log)

    async def cycle(self, session: Session[D]) -> tuple[Session[D], RunReport[D] | None]:
        """One cycle from ``session``: the session after it, and the report if the run ends.

        Raises:
            ConflictError: a commit lost the race; nothing of the cycle's decision was written.
            StepContractError: a step returned something ``run`` may not return.
            Exception: whatever a step raises.
        """
        machine = self.machine
        if machine.cancel is not None and machine.cancel.cancelled:
            return session, await self._cancelled(session, None)
        if machine.max_cycles is not None and len(self.results) >= machine.max_cycles:
            reason = YieldReason(
                YieldReason.CYCLE_LIMIT,
                f"this run applied {len(self.results)} cycles, the machine's max_cycles; "
                "run() again continues",
                {"max_cycles": machine.max_cycles},
            )
            log_cycle(session, self.cycles, None, (), reason.kind)
            return session, await self._guarded(self._yielded(session, reason), None)
        self.cycles += 1
        started = time.perf_counter()
        traced = _tracing.NO_SPAN  # a plain ``with``: no extra coroutine on every resume
        if _tracing.active():
            attributes = {
                "stepmachine.cycle": self.cycles,
                "stepmachine.revision": session.revision,
            }
            traced = _tracing.span(self.runtime.telemetry, "cycle", attributes)
        with traced as span:
            try:
                try:
                    offered = await offer(
                        machine.capabilities,
                        self.runtime,
                        session,
                        self.sink,
                        self.cycles,
                        self.start_revision,
                        token=machine.cancel,
                        on_cancel=self._finalize_cancelled,
                    )
                except ConflictError:  # a step's own commit lost the race
                    self._conflict(session, None, (), started, span)
                    raise
                if isinstance(offered, Interrupted):
                    return session, await self._cancelled(session, offered, started, span)
                if isinstance(offered, Idle):
                    idle = self._idle(session, offered.refusals, started, span)
                    return session, await self._guarded(idle, None)
                return await self._settle(session, offered, started, span)
            except BaseException as exc:
                if stops_the_run(exc):  # cancelled from outside: reported like the token's
                    cut = self.cut_step
                    log_cycle(
                        session, self.cycles, cut, (), "cancelled", started=started, span=span
                    )
                raise

    async def _settle(
        self, session: Session[D], decision: Decision[D], started: float, span: object
    ) -> tuple[Session[D], RunReport[D] | None]:
        """Apply what the steps decided.

        Cancellation from outside finalizes first; while the decision's batch is
        being applied, with the deciding step as the interrupted one.
        """
        applying: Decision[D] | None = decision
        try:
            check_progress(decision, session)
            name = decision.step.name
            try:
                after, result = await self.machine.apply(
                    self.runtime, session, decision, cycle=self.cycles
                )
            except ConflictError:
                self._conflict(session, name, decision.refusals, started, span)
                raise
            applying = None
            self.results.append(result)
            outcome = decision.outcome
            count = len(outcome.effects)
            log_cycle(
                after,
                self.cycles,
                name,
                decision.refusals,
                result.status,
                effects=count,
                started=started,
                span=span,
            )
            if count:
                await self.sink.emit(StepApplied(name, after.revision, result.status, count))
                self.sink.follow(after.revision)
            report = (
                await self._yielded(after, outcome.reason) if isinstance(outcome, Yield) else None
            )
        except BaseException as exc:
            if not stops_the_run(exc):
                raise
            interrupted = None if applying is None else Interrupted(applying.step, applying.ctx)
            await self._finalize_cancelled(interrupted)
            raise
        return after, report

    def _conflict(
        self,
        session: Session[D],
        step: str | None,
        refusals: tuple[Refusal, ...],
        started: float,
        span: object,
    ) -> None:
        """Report a commit that lost the compare-and-set race (the run reloads and re-steps)."""
        log_cycle(session, self.cycles, step, refusals, "conflict", started=started, span=span)
        _log.event(
            _log.INFO,
            "conflict",
            session_id=session.id,
            revision=session.revision,
            step=step,
            cycle=self.cycles,
        )

    async def _idle(
        self, session: Session[D], refusals: tuple[Refusal, ...], started: float, span: object
    ) -> RunReport[D]:
        """No step applied: yield ``call_held`` or ``idle`` (see :func:`idle_reason`)."""
        machine = self.machine
        reason = idle_reason(
            machine.capabilities, self.runtime, session, self.sink, self.cycles, self.start_revision
        )
        log_cycle(session, self.cycles, None, refusals, reason.kind, started=started, span=span)
        return await self._yielded(session, reason)

    async def reload(self, session_id: str) -> Session[D]:
        """The stored session, after a conflict; the event sink follows its revision."""
        session: Session[D] = await self._guarded(
            self.runtime.session_loader().load(session_id), None
        )
        self.sink.follow(session.revision)
        _log.event(_log.DEBUG, "reload", session_id=session_id, revision=session.revision)
        return session

    async def _yielded(self, session: Session[D], reason: YieldReason) -> RunReport[D]:
        if _log.enabled(_log.INFO):
            _log.event(
                _log.INFO,
                "yield",
                session_id=session.id,
                revision=session.revision,
                kind=reason.kind,
                message=_loggable_message(reason, self.runtime),
                cycles=len(self.results),
            )
        await self.sink.emit(Yielded(reason.kind, reason.message))
        return RunReport(session, reason, tuple(self.results))

    async def _cancelled(
        self,
        session: Session[D],
        interrupted: Interrupted[D] | None,
        started: float | None = None,
        span: object = None,
    ) -> RunReport[D]:
        """The machine's token fired: finalize (shielded, bounded), then return ``cancelled``."""
        machine = self.machine
        name = interrupted.step.name if interrupted is not None else ""
        with anyio.move_on_after(machine.finalize_timeout, shield=True):
            session = await self._finalize(session.id, interrupted)
        token = machine.cancel
        reason = YieldReason(YieldReason.CANCELLED, token.reason if token is not None else "")
        self.results.append(StepResult(name, (), "cancelled", session.revision, reason))
        log_cycle(session, self.cycles, name or None, (), "cancelled", started=started, span=span)
        return await self._yielded(session, reason)

    async def _guarded(self, work: Awaitable[T], interrupted: Interrupted[D] | None) -> T:
        """``await work``; if the run is cancelled from outside meanwhile, finalize first."""
        try:
            return await work
        except BaseException as exc:
            if not stops_the_run(exc):
                raise
            await self._finalize_cancelled(interrupted)
            raise

    async def _finalize_cancelled(self, interrupted: Interrupted[D] | None) -> None:
        """Finalize, shielded and bounded, while an outside cancellation is pending."""
        if interrupted is not None:
            self.cut_step = interrupted.step.name
        session_id = self.sink.session_id
        await shielded(
            self.machine.finalize_timeout,
            session_id,
            lambda: self._finalize(session_id, interrupted),
        )

    def _finalize(
        self, session_id: str, interrupted: Interrupted[D] | None
    ) -> Awaitable[Session[D]]:
        return finalize(
            self.machine.capabilities,
            self.runtime,
            session_id,
            self.sink,
            interrupted,
            cycle=self.cycles,
            run_start_revision=self.start_revision,
            max_conflicts=self.machine.max_conflicts,
        )


_CONTENT_KINDS = frozenset({"tool_failed"})
"""Yield kinds whose message quotes a tool's error (``ToolAbortError``'s text: tool content)."""


def _loggable_message(reason: YieldReason, runtime: Runtime) -> str:
    """``reason.message`` for the ``yield`` event; a ``tool_failed`` message (the tool's
    error text) only with content capture on, else a placeholder."""
    if reason.kind in _CONTENT_KINDS and not runtime.telemetry.captures_content:
        return "(the tool's error; content capture is off)"
    return reason.message
