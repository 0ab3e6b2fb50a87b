"""The cycle: one module, read top to bottom.

A session goes through one cycle like this (``Driver.cycle``)::

    session (as stored) ──► decide ──► Decision ──► apply ──► session (as stored)
                             │                       │
                             ├─ Idle: yield idle/call_held
                             └─ Interrupted: finalize, yield cancelled

1. **decide** (:func:`decide`): collect tool definitions and prompt parts from
   the steps that contribute them, then offer the session to the steps in
   order; the first whose ``run`` does not refuse wins. Nothing is written:
   the result is a :class:`Decision` (the step, its outcome, the refusals
   before it), :class:`Idle` (every step refused) or :class:`Interrupted`
   (the machine's token fired while a step ran); these values, and the
   :class:`RunReport` a run returns, are in ``_decision``.
2. **apply** (:func:`apply`): the machine, and only the machine, writes.
   ``Continue`` / ``Yield``: their effects as one batch, a compare-and-set on
   the revision the step read. ``Staged``: the intents, then each task's
   record as it lands, then the ending (see ``_staged``).
3. ``Continue`` (or staged work that continues) starts the next cycle from the
   session the store returned; ``Yield``, or no step applying, ends the run.

:class:`Driver` runs a whole run: ``Driver.run`` claims the session's lease,
opens the steps, loads the session and runs cycles until one yields, in
rounds while a turn was requested meanwhile, then lets the lease go. Every
batch of a cycle is written by ``_store.commit``; from ``run()`` to the store::

    StateMachine.run -> Driver.run -> Driver.cycle -> apply -> commit -> handler.apply

(``handler``: the lease's fence, or the store). Staged work (a model call, a
tool batch) is carried out by ``_staged.execute`` between ``apply`` and
``commit``: ``apply -> execute -> one -> retry_while_moving -> attempt -> commit``
(a task's record is never dropped for losing the race). ``Driver.cycle`` is
the one place where conflicts are retried (a write that lost the
compare-and-set race wrote nothing: reload, decide again, at most
``max_conflicts`` times per round) and where cancellation is handled: the
machine's token firing, a cancellation from outside,
``KeyboardInterrupt``/``SystemExit`` -- each finalizes, shielded for at most
``finalize_timeout`` seconds, with the step it landed in as the interrupted
one (and the records the machine held for it: a finished tool's result is
never lost), then reports ``cancelled`` or lets the exception propagate.
``run()``/``run_report()`` and ``serve`` run ``Driver.run``; the durable
worker runs ``Driver.cycle`` once per step; ``step()``/``apply()``/``finalize()``,
replay and the testing kit use ``decide``, ``apply`` and ``finalize``.

What is not the cycle itself lives beside it: the step contract checks
(``_step_contract``), the ``cycle`` and ``yield`` log events and why a run
idles (``_cycle_report``), the lease check before a guarded task starts
(``_hold.confirm_lease``) and what stops a run from outside
(``_finalize.stops_the_run``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import anyio
import msgspec

from . import _log, _staged, _tracing
from ._capabilities import Capabilities
from ._capabilities import cycle_context as context
from ._codec import Refusal, refusal
from ._cycle_report import idle_reason, link_to_previous, log_cycle, log_yield
from ._decision import Decision, Idle, Interrupted, RunReport
from ._effects import Effect
from ._emitter import Emitter, EventSink, NullEmitter, Yielded
from ._errors import ConflictError
from ._finalize import finalize, shielded, stops_the_run
from ._hold import QUEUED, Turns, claim_for_run, confirm_lease
from ._lease import Lease, LeasePolicy
from ._runtime import Runtime
from ._session import Session
from ._staged import RecordConflictError, Staged
from ._step_contract import check_continues, check_outcome, check_pending
from ._steps import CancelToken, Continue, Refuse, StepResult, Yield, YieldReason
from ._store import StepCommitter, commit

if TYPE_CHECKING:
    from ._machine import StateMachine

__all__ = ["Driver", "apply", "context", "decide"]

D = TypeVar("D", bound=msgspec.Struct)
T = TypeVar("T")


# -- decide ---------------------------------------------------------------------------


async def decide(
    capabilities: Capabilities[D],
    runtime: Runtime,
    session: Session[D],
    sink: EventSink,
    cycle: int,
    run_start_revision: int,
    token: CancelToken | None = None,
    on_cancel: Callable[[Interrupted[D]], Awaitable[None]] | None = None,
) -> Decision[D] | Interrupted[D] | Idle:
    """Offer ``session`` to the steps in order; the first that does not refuse decides.

    Writes nothing (a step written for an older release that still commits
    through the deprecated ``ctx.commit`` is the one exception; see
    :meth:`StepContext.commit`).

    Raises:
        ConfigurationError: duplicate tool names (before any step runs).
        StepContractError: a step's ``run`` is not async, or returned no outcome.
        Exception: whatever a step raises. A cancellation from outside
            propagates as it is (nothing was written: the caller finalizes).

    When ``token`` fires while a step runs, the step is cancelled and returned
    as :class:`Interrupted`. A cancellation from outside (or ``KeyboardInterrupt``)
    while a step runs awaits ``on_cancel(Interrupted(step, ctx))`` (the callee
    shields itself), then propagates.
    """
    collected = capabilities.collect(session)
    refused: list[Refusal] = []
    for step in capabilities.steps:
        ctx = context(capabilities, runtime, session, sink, cycle, run_start_revision, collected)
        ctx.committer = StepCommitter(runtime, step.name, cycle, sink, refused, len(refused))
        try:
            pending = check_pending(step.name, step.run(ctx))
            returned = await pending if token is None else await _under(token, pending)
        except BaseException as exc:
            if on_cancel is not None and stops_the_run(exc):
                await on_cancel(Interrupted(step, ctx))
            raise
        if returned is _CANCELLED:
            return Interrupted(step, ctx)
        outcome = check_outcome(step.name, returned)
        if isinstance(outcome, Refuse):
            if ctx.session.revision == session.revision:
                refused.append(refusal(step.name, outcome.why))
                continue
            outcome = Continue(())  # it wrote through the deprecated ctx.commit
        return Decision(step, outcome, ctx, tuple(refused))
    return Idle(tuple(refused))


_CANCELLED: Any = object()
"""What :func:`_under` returns when the token cancelled the work."""


async def _under(token: CancelToken | None, work: Awaitable[T]) -> T:
    """``await work`` in a scope ``token`` cancels; :data:`_CANCELLED` when it did."""
    if token is None:
        return await work
    returned: Any = _CANCELLED
    with anyio.CancelScope() as scope:
        token.bind(scope)
        try:
            returned = await work
        finally:
            token.unbind(scope)
    return returned  # type: ignore[no-any-return]


# -- apply ------------------------------------------------------------------------------


async def apply(
    runtime: Runtime,
    session: Session[D],
    decision: Decision[D],
    cycle: int,
    token: CancelToken | None = None,
    keep_for: float = 10.0,
) -> tuple[Session[D], StepResult] | None:
    """Write what ``decision`` says, from ``session``; the session after it and the result.

    ``keep_for``: the machine's ``finalize_timeout``, the bound on writing what
    staged work holds after a task's error (see ``_staged.execute``).

    ``None`` when ``token`` fired during staged work (the records already
    written stay; ``decision.held`` holds what finalize must still write).

    Raises:
        ConflictError: the first batch lost the race; nothing of the cycle was written.
        StepContractError: ``Continue`` with no effects (the loop would never end).
        LeaseLostError: the run's lease is gone; nothing more was started or written.
        EffectError: an effect does not apply; nothing of that batch was written.
    """
    name, outcome = decision.step.name, decision.outcome
    if decision.ctx.session.revision > session.revision:
        session = decision.ctx.session  # the deprecated ctx.commit wrote batches already
    else:
        check_continues(name, outcome)
    written: tuple[Effect, ...] = ()
    sink, handler, clock = decision.ctx.events, runtime.effect_handler(), runtime.clock
    refusals = decision.refusals
    if isinstance(outcome, Staged):
        write = partial(commit, handler, clock, name, cycle, refusals, sink)
        confirm = partial(confirm_lease, runtime)
        loader = runtime.session_loader()
        held = decision.held
        staged = _staged.execute(outcome, session, write, loader.load, confirm, held, keep_for)
        done = await staged if token is None else await _under(token, staged)
        if done is _CANCELLED:
            return None
        session, written, outcome = done
    after = session
    status: Literal["continue", "yielded"] = "yielded" if isinstance(outcome, Yield) else "continue"
    if outcome.effects:
        effects = outcome.effects
        after = await commit(handler, clock, name, cycle, refusals, sink, session, effects, status)
    reason = outcome.reason if isinstance(outcome, Yield) else None
    return after, StepResult(name, written + outcome.effects, status, after.revision, reason)


# -- the driver ---------------------------------------------------------------------------


@dataclass(slots=True)
class Driver(Generic[D]):
    """The cycles of one run: see the module docs. Made per run, dropped when it returns.

    :meth:`run` is a whole run (``run()``, ``run_report()`` and ``serve`` use
    it); :meth:`cycle` is one cycle (the durable worker runs one per step).
    ``sink``, ``start_revision``, ``cycles``, ``results`` and ``conflicts``
    describe the current round: :meth:`run` sets them as each round starts.
    ``finalize_on_reload``: a cancellation from outside while :meth:`cycle`
    reloads after a conflict finalizes first (a run); the durable worker
    turns it off, so that the reload is like its cycle's first load (the
    cancellation propagates, nothing is written).
    """

    machine: StateMachine[D]
    runtime: Runtime
    sink: EventSink = field(default_factory=lambda: EventSink(NullEmitter(), "", 0))
    start_revision: int = 0
    cycles: int = 0
    results: list[StepResult] = field(default_factory=list)
    conflicts: int = 0  # conflicts retried in this round (at most the machine's max_conflicts)
    report: RunReport[D] | None = None  # how the last round ended, once it has
    finalize_on_reload: bool = True

    async def run(
        self,
        session_id: str,
        emitter: Emitter | None = None,
        lease: LeasePolicy | Lease | EllipsisType | None = ...,
        *,
        max_rounds: int | None = None,
        keep: Callable[[Exception], bool] | None = None,
    ) -> RunReport[D]:
        """Run the session: claim its lease, then rounds of cycles until one yields.

        The path of a batch: ``run`` -> :meth:`cycle` -> :func:`apply` ->
        ``commit`` -> the effect handler's ``apply`` (the lease's fence, or
        the store). The lease (:class:`~stepmachine._hold.Turns`), the steps'
        ``open_for_run``, the run's span and the loaded session are context
        managers around the cycles, not calls on that path. A run that holds
        a lease runs another round when a turn was requested while it held it
        (``max_rounds``, ``keep``: see ``Turns``); its report covers every round.

        Raises:
            SessionBusyError, ConfigurationError: the claim (see
                :func:`~stepmachine._hold.claim_for_run`); nothing was written.
            ConflictError: more than the machine's ``max_conflicts`` conflicts in a round.
            LeaseLostError: the lease was lost; nothing after the loss was stored.
            Exception: whatever a step or the store raises; batches before stay.
        """
        held = await claim_for_run(self.runtime, session_id, lease, self.machine.lease)
        if held is QUEUED:
            session: Session[D] = await self.runtime.session_loader().load(session_id)
            reason = YieldReason(
                YieldReason.QUEUED,
                "another runner holds the session; it runs the queued turn before it lets go",
            )
            return RunReport(session, reason)
        turns = None if held is None else Turns(*held, max_rounds=max_rounds, keep=keep)
        results: list[StepResult] = []
        async with nullcontext(self.runtime) if turns is None else turns.held(self.runtime) as rt:
            while True:
                async with self._round(rt, session_id, emitter) as loaded:
                    current, report = await self.cycle(loaded)
                    while report is None:
                        current, report = await self.cycle(current)
                    self.report = report
                results.extend(report.results)
                cancelled = report.reason.kind == YieldReason.CANCELLED
                if turns is None or not await turns.another(cancelled):
                    return RunReport(report.session, report.reason, tuple(results))
        raise AssertionError("unreachable: the rounds return or raise")  # pragma: no cover

    @asynccontextmanager
    async def _round(
        self, runtime: Runtime, session_id: str, emitter: Emitter | None
    ) -> AsyncIterator[Session[D]]:
        """One round: the steps opened, the run's span, the session loaded (yielded), and
        this driver reset for it."""
        attributes = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": _tracing.AGENT_NAME,
            "gen_ai.conversation.id": session_id,
        }
        name = f"invoke_agent {_tracing.AGENT_NAME}"
        async with AsyncExitStack() as stack:
            if self.machine.capabilities.openers:
                await stack.enter_async_context(self.machine.opened(runtime))
            stack.enter_context(_log.session(session_id))
            span = stack.enter_context(_tracing.run_span(runtime.telemetry, name, attributes))
            session: Session[D] = await runtime.session_loader().load(session_id)
            if span is not None:
                await link_to_previous(runtime, session, span)
            self.runtime = runtime
            self.sink = EventSink(emitter or NullEmitter(), session_id, session.revision)
            self.start_revision, self.cycles, self.conflicts = session.revision, 0, 0
            self.results, self.report = [], None
            yield session
            if self.report is not None and span is not None:
                _tracing.set_attributes(
                    span,
                    {
                        "stepmachine.revision.start": self.start_revision,
                        "stepmachine.revision.end": self.report.session.revision,
                        "stepmachine.yield.kind": self.report.reason.kind,
                        "stepmachine.cycles": self.cycles,
                    },
                )

    async def cycle(self, session: Session[D]) -> tuple[Session[D], RunReport[D] | None]:
        """One cycle from ``session``: the session after it, and the report if the run ends.

        A conflict (the first write lost the compare-and-set race; nothing of the
        cycle was written) returns the session reloaded from the store and no
        report, and counts in :attr:`conflicts`; past the machine's
        ``max_conflicts`` in a round it raises :class:`ConflictError`.
        """
        machine = self.machine
        token = machine.cancel
        if token is not None and token.cancelled:
            try:
                return session, await self._cancelled(session, None, None, None)
            except ConflictError:  # finalize lost the race past its own retries: as below
                if self.conflicts >= machine.max_conflicts:
                    raise
                self.conflicts += 1
            return await self._reload(session)
        if machine.max_cycles is not None and len(self.results) >= machine.max_cycles:
            reason = YieldReason(
                YieldReason.CYCLE_LIMIT,
                f"this run applied {len(self.results)} cycles, the machine's max_cycles; "
                "run() again continues",
                {"max_cycles": machine.max_cycles},
            )
            log_cycle(session, self.cycles, None, (), reason.kind)
            return session, await self._guarded(self._yielded(session, reason))
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
            caps, cycle = machine.capabilities, self.cycles
            applying: Decision[D] | None = None
            decided: Decision[D] | Interrupted[D] | Idle | None = None
            cut: list[Interrupted[D]] = []  # the step a cancellation from outside cut in decide
            try:
                decided = await decide(
                    caps,
                    self.runtime,
                    session,
                    self.sink,
                    cycle,
                    self.start_revision,
                    token,
                    self._cut(cut),
                )
                if isinstance(decided, Interrupted):
                    return session, await self._cancelled(session, decided, started, span)
                if isinstance(decided, Idle):
                    ctx = context(
                        caps, self.runtime, session, self.sink, cycle, self.start_revision
                    )
                    reason = idle_reason(caps, ctx)
                    log_cycle(session, cycle, None, decided.refusals, reason.kind, started, span)
                    return session, await self._guarded(self._yielded(session, reason))
                applying = decided
                keep_for = machine.finalize_timeout
                applied = await apply(self.runtime, session, decided, cycle, token, keep_for)
                if applied is None:
                    return session, await self._cancelled(session, decided, started, span)
                applying = None
                after, result = applied
                self.results.append(result)
                count = len(result.effects)
                log_cycle(
                    after, cycle, result.step, decided.refusals, result.status, started, span, count
                )
                if result.reason is None:
                    return after, None
                return after, await self._yielded(after, result.reason)
            except ConflictError as exc:
                step = decided.step.name if isinstance(decided, Decision) else None
                refusals = decided.refusals if isinstance(decided, Decision) else ()
                log_cycle(session, cycle, step, refusals, "conflict", started, span)
                _log.event(
                    _log.INFO,
                    "conflict",
                    session_id=session.id,
                    revision=session.revision,
                    step=step,
                    cycle=cycle,
                )
                if self.conflicts >= machine.max_conflicts or isinstance(exc, RecordConflictError):
                    raise  # (a record's: the cycle wrote its intents; deciding again drops it)
                if span is not None:  # retried, yet the cycle's span still ended in the conflict
                    _tracing.mark_error(span, exc, self.runtime.telemetry)
                self.conflicts += 1
            except BaseException as exc:
                if not stops_the_run(exc):
                    raise
                if cut:  # cut while a step decided: decide finalized already
                    log_cycle(session, cycle, cut[0].step.name, (), "cancelled", started, span)
                    raise
                interrupted = _interrupted(applying)
                name = None if interrupted is None else interrupted.step.name
                log_cycle(session, cycle, name, (), "cancelled", started, span)
                await self._finalize_shielded(interrupted)
                raise
        return await self._reload(session)

    async def _reload(self, session: Session[D]) -> tuple[Session[D], None]:
        """After a conflict (counted): ``session`` as stored now, events following it."""
        load = self.runtime.session_loader().load(session.id)
        reloaded = await (self._guarded(load) if self.finalize_on_reload else load)
        self.sink.follow(reloaded.revision)
        _log.event(_log.DEBUG, "reload", session_id=reloaded.id, revision=reloaded.revision)
        return reloaded, None

    def _cut(self, cut: list[Interrupted[D]]) -> Callable[[Interrupted[D]], Awaitable[None]]:
        """``decide``'s ``on_cancel``: note the step in ``cut``, then finalize with it."""

        async def finalize_cut(interrupted: Interrupted[D]) -> None:
            cut.append(interrupted)
            await self._finalize_shielded(interrupted)

        return finalize_cut

    async def _yielded(self, session: Session[D], reason: YieldReason) -> RunReport[D]:
        log_yield(session, reason, self.runtime, len(self.results))
        await self.sink.emit(Yielded(reason.kind, reason.message))
        return RunReport(session, reason, tuple(self.results))

    async def _cancelled(
        self,
        session: Session[D],
        interrupted: Decision[D] | Interrupted[D] | None,
        started: float | None,
        span: object,
    ) -> RunReport[D]:
        """The machine's token fired: finalize (shielded, bounded), then return ``cancelled``."""
        machine = self.machine
        cut = _interrupted(interrupted)
        name = cut.step.name if cut is not None else ""
        with anyio.move_on_after(machine.finalize_timeout, shield=True):
            session = await self._finalize(cut)
        token = machine.cancel
        reason = YieldReason(YieldReason.CANCELLED, token.reason if token is not None else "")
        self.results.append(StepResult(name, (), "cancelled", session.revision, reason))
        log_cycle(session, self.cycles, name or None, (), "cancelled", started, span)
        return await self._yielded(session, reason)

    async def _guarded(self, work: Awaitable[T]) -> T:
        """``await work``; if the run is cancelled from outside meanwhile, finalize first."""
        try:
            return await work
        except BaseException as exc:
            if stops_the_run(exc):
                await self._finalize_shielded(None)
            raise

    async def _finalize_shielded(self, interrupted: Interrupted[D] | None) -> None:
        """Finalize, shielded and bounded, while an outside cancellation is pending."""
        session_id = self.sink.session_id
        await shielded(
            self.machine.finalize_timeout, session_id, lambda: self._finalize(interrupted)
        )

    def _finalize(self, interrupted: Interrupted[D] | None) -> Awaitable[Session[D]]:
        return finalize(
            self.machine.capabilities,
            self.runtime,
            self.sink.session_id,
            self.sink,
            interrupted,
            cycle=self.cycles,
            run_start_revision=self.start_revision,
            max_conflicts=self.machine.max_conflicts,
        )


def _interrupted(cut: Decision[D] | Interrupted[D] | None) -> Interrupted[D] | None:
    """The interrupted step of a decision being applied (with its held records), or ``cut``."""
    if isinstance(cut, Decision):
        return Interrupted(cut.step, cut.ctx, tuple(cut.held))
    return cut
