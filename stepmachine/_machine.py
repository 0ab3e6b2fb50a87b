"""The machine loop: the one module that owns transitions.

A cycle:

1. collect tool definitions and prompt parts from every step (a tool name
   advertised twice raises :class:`ConfigurationError`, before any model call);
2. offer the steps, in order, the session; the first that does not refuse wins;
3. apply its effects as one batch: a compare-and-set on the revision it read;
4. ``Continue`` starts the next cycle from the top; ``Yield``, or no step
   applying, returns to the caller.

When no step applies the run returns ``idle``, unless open tool calls are held
back by a step's ``check_call``: then it returns ``call_held``, naming the
objecting step, the call and the tool, so a held call is never silent.

A run applies at most ``max_cycles`` cycles (default
:data:`DEFAULT_MAX_CYCLES`), then returns ``cycle_limit``; calling ``run()``
again continues with a fresh count. This bounds a model that keeps calling
tools when no ``Budget`` is configured; ``max_cycles=None`` removes the cap.

State is the session (invariant 1): the machine keeps nothing between cycles
that affects a decision. After a successful apply the next cycle starts from
the session the effect handler returns (the stored view, decoded from what it
wrote), or, for a handler that returns ``None``, from the batch applied
locally -- the same value: the compare-and-set proved that nobody wrote in
between, and applying effects is pure. On a conflict the machine reloads and re-steps (at most
``max_conflicts`` times per run) and never overwrites.

Cancellation. When the machine's :class:`CancelToken` fires, the running step
is cancelled; then :meth:`StateMachine.finalize` runs shielded: the
interrupted step, then every other step, may return effects that keep what
was already received, and every tool call still without a result is answered
with an "interrupted" error result. A tool call whose tool ran to completion
keeps its real result, whatever instant the cancellation landed at (while its
"tool finished" event was emitted, or its result committed): "interrupted"
only ever answers a call that has no result. The run then returns with reason
``cancelled``. When the caller cancels ``run()`` from outside, the same
finalize runs shielded for at most ``finalize_timeout`` seconds, and the
cancellation propagates.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
import msgspec
import structlog

from ._codec import Batch
from ._effects import AppendMessage, Effect, apply_batch
from ._emitter import Emitter, EventSink, NullEmitter, StepApplied, Yielded
from ._errors import ConfigurationError, ConflictError, StepmachineError
from ._history import open_tool_calls
from ._messages import Message, ToolResultPart
from ._model import PromptPart, ToolDefinition
from ._runtime import Runtime
from ._session import Session
from ._steps import (
    CancelToken,
    Continue,
    Operation,
    Outcome,
    Refuse,
    StepContext,
    StepResult,
    Yield,
    YieldReason,
)
from ._store import EffectHandler, SessionLoader

__all__ = [
    "DEFAULT_MAX_CYCLES",
    "FINALIZE_STEP",
    "INTERRUPTED",
    "Decision",
    "RunReport",
    "StateMachine",
]

D = TypeVar("D", bound=msgspec.Struct)

FINALIZE_STEP = "stepmachine.finalize"
"""The step name recorded for the batch that answers interrupted tool calls."""

INTERRUPTED = "interrupted: the run was cancelled before this tool call finished"
"""The content of the error result given to tool calls left open by a cancellation."""

DEFAULT_MAX_CYCLES = 100
"""Cycles one ``run()`` applies at most before it yields ``cycle_limit``.

A model turn with tool calls takes two cycles (inference, then tools), plus one
for each policy step that acts (approval, compaction, a repair). 100 cycles is
some 40-50 model calls in one run: far more than an interactive turn needs, and
a bound on a model that never stops calling tools when no ``Budget`` is
configured (without one, such a run spins as fast as the model answers). A run
that hits it loses nothing: ``run()`` again continues from the stored session.
"""

_stdlib_logger = logging.getLogger("stepmachine")
_log = structlog.wrap_logger(
    _stdlib_logger,
    wrapper_class=structlog.stdlib.BoundLogger,
    processors=[structlog.processors.KeyValueRenderer(key_order=["event"])],
)


@dataclass(frozen=True, slots=True)
class Decision(Generic[D]):
    """The step that applied in one cycle, with its outcome.

    Attributes:
        step: the step that applied.
        outcome: its ``Continue`` or ``Yield``.
        ctx: the context it ran with (its ``scratch`` included).
        refused: the names of the steps that refused before it.
    """

    step: Operation[D]
    outcome: Continue | Yield
    ctx: StepContext[D]
    refused: tuple[str, ...] = ()


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
class _Running(Generic[D]):
    """The step currently offered the session, for finalize after a cancellation."""

    step: Operation[D] | None = None
    ctx: StepContext[D] | None = None
    start_revision: int = 0


@dataclass(slots=True)
class _Offer(Generic[D]):
    decision: Decision[D] | None = None
    refused: list[str] = field(default_factory=list)


class StateMachine(Generic[D]):
    """Loops over an ordered list of steps; see the module docs for the cycle.

    Args:
        steps: the steps, in priority order. Names must be unique.
        cancel: a token that stops the run (then it is finalized).
        max_conflicts: conflicts tolerated per run before ``ConflictError``
            propagates.
        finalize_timeout: seconds finalize may take after an outside
            cancellation of ``run()``.
        max_cycles: cycles one ``run()`` applies at most before it returns
            with reason ``cycle_limit`` (see :data:`DEFAULT_MAX_CYCLES`);
            ``None`` for no cap. A later ``run()`` continues with a fresh count.

    Raises:
        ConfigurationError: no steps, two steps share a name, or
            ``max_cycles`` is not ``None`` or a positive integer.
    """

    def __init__(
        self,
        steps: Sequence[Operation[D]],
        *,
        cancel: CancelToken | None = None,
        max_conflicts: int = 16,
        finalize_timeout: float = 10.0,
        max_cycles: int | None = DEFAULT_MAX_CYCLES,
    ) -> None:
        self.steps: tuple[Operation[D], ...] = tuple(steps)
        if not self.steps:
            raise ConfigurationError("a StateMachine needs at least one step")
        names = [s.name for s in self.steps]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigurationError(f"step names must be unique; repeated: {duplicates!r}")
        self.cancel = cancel
        self.max_conflicts = max_conflicts
        self.finalize_timeout = finalize_timeout
        if max_cycles is not None and (
            isinstance(max_cycles, bool) or not isinstance(max_cycles, int) or max_cycles < 1
        ):
            raise ConfigurationError(
                f"max_cycles must be None or a positive integer, got {max_cycles!r}"
            )
        self.max_cycles = max_cycles

    # -- one cycle ----------------------------------------------------------------

    def collect(
        self, session: Session[D]
    ) -> tuple[tuple[ToolDefinition, ...], tuple[PromptPart, ...]]:
        """Tool definitions and prompt parts from every step, in step order.

        Raises:
            ConfigurationError: two steps (or one step twice) advertise a tool name.
        """
        tools: list[ToolDefinition] = []
        owner: dict[str, str] = {}
        parts: list[PromptPart] = []
        for step in self.steps:
            for definition in step.tools(session):
                if definition.name in owner:
                    raise ConfigurationError(
                        f"tool name {definition.name!r} is advertised by both "
                        f"{owner[definition.name]!r} and {step.name!r}"
                    )
                owner[definition.name] = step.name
                tools.append(definition)
            parts.extend(step.prompt_parts(session))
        return tuple(tools), tuple(parts)

    async def step(
        self,
        runtime: Runtime,
        session: Session[D],
        emitter: Emitter | None = None,
        *,
        cycle: int = 0,
        run_start_revision: int | None = None,
    ) -> Decision[D] | None:
        """Offer ``session`` to the steps in order; return the first that applies.

        Nothing is persisted (unless a step commits batches of its own with
        ``ctx.commit``): pass the decision to :meth:`apply`. Returns ``None``
        when every step refuses. ``run_start_revision`` is the revision at which
        the caller's "run" began (default: ``session.revision``); callers that
        drive cycles themselves pass the revision they started at on every
        call, or per-run budgets start afresh each cycle.

        Raises:
            ConfigurationError: duplicate tool names (before any step runs).
            Exception: whatever a step raises.

        Cancellation: the running step is interrupted. Before the cancellation
        propagates, what it already has is kept: its ``finalize(interrupted=True)``
        effects (tool results that exist, partial text) are committed, shielded,
        for at most ``finalize_timeout`` seconds. The caller then calls
        :meth:`finalize` to answer the calls still open.
        """
        sink = EventSink(emitter or NullEmitter(), session.id, session.revision)
        running: _Running[D] = _Running(
            start_revision=session.revision if run_start_revision is None else run_start_revision
        )
        try:
            offer = await self._offer(runtime, session, sink, cycle, running)
        except anyio.get_cancelled_exc_class():
            with anyio.move_on_after(self.finalize_timeout, shield=True):
                try:
                    loader = runtime.session_loader()
                    current: Session[D] = await loader.load(session.id)
                    await self._keep_interrupted(runtime, loader, current, running, cycle)
                except Exception:  # noqa: BLE001 - the cancellation must still propagate
                    _log.exception("keeping an interrupted step failed", session_id=session.id)
            raise
        return offer.decision

    async def apply(
        self, runtime: Runtime, session: Session[D], decision: Decision[D], *, cycle: int = 0
    ) -> tuple[Session[D], StepResult]:
        """Persist a decision's effects as one batch, compare-and-set on ``session.revision``.

        Returns:
            The new session and the cycle's :class:`StepResult`. A ``Yield``
            with no effects writes nothing and returns ``session`` unchanged.

        Raises:
            ConflictError: the stored session moved on; nothing was written.
            EffectError: an effect does not apply; nothing was written.
        """
        outcome = decision.outcome
        if decision.ctx.session.revision > session.revision:
            session = decision.ctx.session  # the step committed batches of its own
        after = session
        if outcome.effects:
            after = await self._commit(runtime, session, decision.step.name, cycle, outcome.effects)
        if isinstance(outcome, Yield):
            result = StepResult(
                decision.step.name, outcome.effects, "yielded", after.revision, outcome.reason
            )
        else:
            result = StepResult(decision.step.name, outcome.effects, "continue", after.revision)
        return after, result

    # -- the loop -------------------------------------------------------------------

    async def run(
        self, runtime: Runtime, session_id: str, emitter: Emitter | None = None
    ) -> Session[D]:
        """Run cycles until a step yields or none applies; return the session.

        Equivalent to ``(await run_report(...)).session``. Calling ``run`` again
        later continues where the stored session left off. The run also returns
        after ``max_cycles`` applied cycles (reason ``cycle_limit``), and with
        reason ``call_held`` when no step applies while a step's ``check_call``
        holds open tool calls back.

        Raises:
            SessionNotFoundError: no such session.
            ConfigurationError: duplicate tool names, missing model or store.
            ConflictError: more than ``max_conflicts`` conflicts in this run.
            Exception: whatever a step raises; effects applied before stay.

        Cancellation: see the module docs. From outside, finalize runs
        shielded for at most ``finalize_timeout`` seconds, then the
        cancellation propagates.
        """
        return (await self.run_report(runtime, session_id, emitter)).session

    async def run_report(
        self, runtime: Runtime, session_id: str, emitter: Emitter | None = None
    ) -> RunReport[D]:
        """Like :meth:`run`, and also say why the run returned and what each cycle did."""
        loader = runtime.session_loader()
        session: Session[D] = await loader.load(session_id)
        sink = EventSink(emitter or NullEmitter(), session_id, session.revision)
        results: list[StepResult] = []
        running: _Running[D] = _Running(start_revision=session.revision)
        conflicts = 0
        cycle = 0
        try:
            while True:
                if self.cancel is not None and self.cancel.cancelled:
                    return await self._cancelled(runtime, sink, session, results, None, cycle)
                if self.max_cycles is not None and len(results) >= self.max_cycles:
                    self._log_cycle(session, cycle, None, [], YieldReason.CYCLE_LIMIT)
                    reason = YieldReason(
                        YieldReason.CYCLE_LIMIT,
                        f"this run applied {len(results)} cycles, the machine's max_cycles; "
                        "run() again continues",
                        {"max_cycles": self.max_cycles},
                    )
                    await sink.emit(Yielded(reason.kind, reason.message))
                    return RunReport(session, reason, tuple(results))
                cycle += 1
                try:
                    offer = await self._offer_cancellable(runtime, session, sink, cycle, running)
                except ConflictError:
                    # A step's own commit lost the race: reload and decide again.
                    conflicts += 1
                    step_name = running.step.name if running.step is not None else None
                    self._log_cycle(session, cycle, step_name, [], "conflict")
                    if conflicts > self.max_conflicts:
                        raise
                    running.step = running.ctx = None
                    session = await loader.load(session_id)
                    sink.follow(session.revision)
                    continue
                if offer is None:
                    return await self._cancelled(runtime, sink, session, results, running, cycle)
                decision = offer.decision
                if decision is None:
                    reason = self._idle_reason(runtime, session, sink, cycle, running)
                    self._log_cycle(session, cycle, None, offer.refused, reason.kind)
                    await sink.emit(Yielded(reason.kind, reason.message))
                    return RunReport(session, reason, tuple(results))
                if (
                    isinstance(decision.outcome, Continue)
                    and not decision.outcome.effects
                    and decision.ctx.session.revision == session.revision
                ):
                    raise StepmachineError(
                        f"step {decision.step.name!r} returned Continue with no effects; the "
                        "session would not change and the next cycle would decide the same"
                    )
                try:
                    session, result = await self.apply(runtime, session, decision, cycle=cycle)
                except ConflictError:
                    conflicts += 1
                    self._log_cycle(session, cycle, decision.step.name, offer.refused, "conflict")
                    if conflicts > self.max_conflicts:
                        raise
                    session = await loader.load(session_id)
                    sink.follow(session.revision)
                    continue
                running.step = running.ctx = None
                results.append(result)
                self._log_cycle(session, cycle, decision.step.name, offer.refused, result.status)
                if decision.outcome.effects:
                    await sink.emit(
                        StepApplied(
                            decision.step.name,
                            session.revision,
                            result.status,
                            len(decision.outcome.effects),
                        )
                    )
                    sink.follow(session.revision)
                if isinstance(decision.outcome, Yield):
                    reason = decision.outcome.reason
                    await sink.emit(Yielded(reason.kind, reason.message))
                    return RunReport(session, reason, tuple(results))
        except anyio.get_cancelled_exc_class():
            with anyio.move_on_after(self.finalize_timeout, shield=True):
                try:
                    await self._finalize(runtime, session_id, sink, running, cycle)
                except Exception:  # noqa: BLE001 - the cancellation must still propagate
                    _log.exception(
                        "finalize failed after outside cancellation", session_id=session_id
                    )
            raise

    async def finalize(
        self,
        runtime: Runtime,
        session_id: str,
        emitter: Emitter | None = None,
        *,
        interrupted: Decision[D] | StepContext[D] | None = None,
        interrupted_step: Operation[D] | None = None,
    ) -> Session[D]:
        """Make a cancelled session whole again; callers driving ``step``/``apply`` call it.

        Runs shielded. First the interrupted step (given as ``interrupted_step``
        with its ``interrupted`` ctx) returns effects that keep what it had
        received; then every other step's ``finalize(interrupted=False)``; then
        every tool call still without a result is answered with an
        ``interrupted`` error result (step name ``stepmachine.finalize``).
        Each of these is its own batch, retried on conflict.

        Returns:
            The session afterwards.
        """
        sink = EventSink(emitter or NullEmitter(), session_id, 0)
        running: _Running[D] = _Running()
        if isinstance(interrupted, Decision):
            running.step, running.ctx = interrupted.step, interrupted.ctx
        elif interrupted is not None:
            running.step, running.ctx = interrupted_step, interrupted
        with anyio.CancelScope(shield=True):
            return await self._finalize(runtime, session_id, sink, running, 0)
        raise AssertionError("unreachable: a shielded scope is never cancelled")  # pragma: no cover

    # -- internals -------------------------------------------------------------------

    async def _offer(
        self,
        runtime: Runtime,
        session: Session[D],
        sink: EventSink,
        cycle: int,
        running: _Running[D],
    ) -> _Offer[D]:
        tools, parts = self.collect(session)
        offer: _Offer[D] = _Offer()
        for step in self.steps:
            ctx = StepContext(
                session=session,
                runtime=runtime,
                events=sink,
                cycle=cycle,
                tools=tools,
                prompt_parts=parts,
                steps=self.steps,
                run_start_revision=running.start_revision,
                committer=self._committer(runtime, step.name, cycle, sink),
            )
            running.step, running.ctx = step, ctx
            outcome: Outcome = await step.run(ctx)
            if isinstance(outcome, Refuse) and ctx.session.revision != session.revision:
                # It committed batches of its own and then refused: the session moved,
                # so the next cycle must start from the top with the new session.
                outcome = Continue(())
            if isinstance(outcome, Refuse):
                offer.refused.append(step.name)
                continue
            if not isinstance(outcome, Continue | Yield):
                raise StepmachineError(
                    f"step {step.name!r} returned {outcome!r}; a step returns Refuse, "
                    "Continue or Yield"
                )
            offer.decision = Decision(step, outcome, ctx, tuple(offer.refused))
            return offer
        running.step = running.ctx = None
        return offer

    def _idle_reason(
        self,
        runtime: Runtime,
        session: Session[D],
        sink: EventSink,
        cycle: int,
        running: _Running[D],
    ) -> YieldReason:
        """Why no step applied: ``call_held`` if some step holds open calls back, else ``idle``."""
        calls = open_tool_calls(session)
        if not calls:
            return YieldReason(YieldReason.IDLE, "no step applies")
        tools, parts = self.collect(session)
        ctx: StepContext[D] = StepContext(
            session=session,
            runtime=runtime,
            events=sink,
            cycle=cycle,
            tools=tools,
            prompt_parts=parts,
            steps=self.steps,
            run_start_revision=running.start_revision,
        )
        held: list[dict[str, str]] = []
        for call in calls:
            for step in self.steps:
                objection = step.check_call(ctx, call)
                if objection is not None:
                    held.append(
                        {
                            "call_id": call.call_id,
                            "tool": call.name,
                            "step": step.name,
                            "objection": objection,
                        }
                    )
                    break
        if not held:
            return YieldReason(YieldReason.IDLE, "no step applies")
        first = held[0]
        more = f" (and {len(held) - 1} more held call(s))" if len(held) > 1 else ""
        return YieldReason(
            YieldReason.CALL_HELD,
            f"step {first['step']!r} holds back tool call {first['call_id']!r} "
            f"({first['tool']}): {first['objection']}{more}; no step applies until the "
            "session changes",
            {"calls": held},
        )

    async def _offer_cancellable(
        self,
        runtime: Runtime,
        session: Session[D],
        sink: EventSink,
        cycle: int,
        running: _Running[D],
    ) -> _Offer[D] | None:
        """Offer under the cancel token; ``None`` means the token interrupted it."""
        token = self.cancel
        if token is None:
            return await self._offer(runtime, session, sink, cycle, running)
        offer: _Offer[D] | None = None
        with anyio.CancelScope() as scope:
            token.bind(scope)
            try:
                offer = await self._offer(runtime, session, sink, cycle, running)
            finally:
                token.unbind(scope)
        return offer

    async def _cancelled(
        self,
        runtime: Runtime,
        sink: EventSink,
        session: Session[D],
        results: list[StepResult],
        running: _Running[D] | None,
        cycle: int,
    ) -> RunReport[D]:
        name = running.step.name if running is not None and running.step is not None else ""
        with anyio.move_on_after(self.finalize_timeout, shield=True):
            session = await self._finalize(runtime, session.id, sink, running or _Running(), cycle)
        reason = YieldReason(
            YieldReason.CANCELLED, self.cancel.reason if self.cancel is not None else ""
        )
        results.append(StepResult(name, (), "cancelled", session.revision, reason))
        self._log_cycle(session, cycle, name or None, [], "cancelled")
        await sink.emit(Yielded(reason.kind, reason.message))
        return RunReport(session, reason, tuple(results))

    async def _finalize(
        self,
        runtime: Runtime,
        session_id: str,
        sink: EventSink,
        running: _Running[D],
        cycle: int,
    ) -> Session[D]:
        loader = runtime.session_loader()
        session: Session[D] = await loader.load(session_id)
        sink.follow(session.revision)
        interrupted_step = running.step
        session = await self._keep_interrupted(runtime, loader, session, running, cycle)
        for step in self.steps:
            if step is interrupted_step:
                continue

            async def finalize_step(
                current: Session[D], step: Operation[D] = step
            ) -> Sequence[Effect]:
                tools, parts = self.collect(current)
                ctx = StepContext(
                    session=current,
                    runtime=runtime,
                    events=sink,
                    cycle=cycle,
                    tools=tools,
                    prompt_parts=parts,
                    steps=self.steps,
                    run_start_revision=running.start_revision,
                )
                return await step.finalize(ctx, interrupted=False)

            session = await self._commit_fresh(
                runtime, loader, session, step.name, cycle, finalize_step
            )

        async def answer_open_calls(current: Session[D]) -> Sequence[Effect]:
            return [
                AppendMessage(
                    Message.tool_result(
                        ToolResultPart.for_call(call, INTERRUPTED, is_error=True), id=runtime.ids()
                    )
                )
                for call in open_tool_calls(current)
            ]

        session = await self._commit_fresh(
            runtime, loader, session, FINALIZE_STEP, cycle, answer_open_calls
        )
        sink.follow(session.revision)
        return session

    async def _keep_interrupted(
        self,
        runtime: Runtime,
        loader: SessionLoader,
        session: Session[D],
        running: _Running[D],
        cycle: int,
    ) -> Session[D]:
        """Commit the interrupted step's ``finalize(interrupted=True)`` effects, if any."""
        interrupted_step, step_ctx = running.step, running.ctx
        if interrupted_step is None or step_ctx is None:
            return session

        async def keep(current: Session[D]) -> Sequence[Effect]:
            # The interrupted step sees the session as stored now (its own batch
            # may have been committed just before the cancellation) together
            # with the scratch of the cycle it was running in.
            return await interrupted_step.finalize(
                dataclasses.replace(step_ctx, session=current), interrupted=True
            )

        return await self._commit_fresh(
            runtime, loader, session, interrupted_step.name, cycle, keep
        )

    async def _commit_fresh(
        self,
        runtime: Runtime,
        loader: SessionLoader,
        session: Session[D],
        step_name: str,
        cycle: int,
        compute: Callable[[Session[D]], Awaitable[Sequence[Effect]]],
    ) -> Session[D]:
        """Compute effects from ``session`` and commit them; on conflict reload and recompute."""
        for attempt in range(self.max_conflicts + 1):
            effects = tuple(await compute(session))
            if not effects:
                return session
            try:
                return await self._commit(runtime, session, step_name, cycle, effects)
            except ConflictError:
                if attempt == self.max_conflicts:
                    raise
                session = await loader.load(session.id)
        raise AssertionError("unreachable")  # pragma: no cover

    def _committer(
        self, runtime: Runtime, step_name: str, cycle: int, sink: EventSink
    ) -> Callable[[Session[D], Sequence[Effect]], Awaitable[Session[D]]]:
        """What ``StepContext.commit`` calls: one batch now, under the step's name."""

        async def commit(current: Session[D], effects: Sequence[Effect]) -> Session[D]:
            after = await self._commit(runtime, current, step_name, cycle, effects)
            await sink.emit(StepApplied(step_name, after.revision, "committed", len(effects)))
            return after

        return commit

    async def _commit(
        self,
        runtime: Runtime,
        session: Session[D],
        step_name: str,
        cycle: int,
        effects: Sequence[Effect],
    ) -> Session[D]:
        # Applied here first whatever the handler: an effect that does not apply
        # fails before anything is written, and a handler returning None needs it.
        after = apply_batch(session, effects)
        handler: EffectHandler = runtime.effect_handler()
        stored = await handler.apply(
            Batch(
                session_id=session.id,
                revision=after.revision,
                step=step_name,
                cycle=cycle,
                timestamp=runtime.clock(),
                effects=tuple(effects),
            )
        )
        return after if stored is None else stored

    def _log_cycle(
        self,
        session: Session[Any],
        cycle: int,
        applied: str | None,
        refused: Sequence[str],
        status: str,
    ) -> None:
        if _stdlib_logger.isEnabledFor(logging.DEBUG):
            _log.debug(
                "cycle",
                session_id=session.id,
                revision=session.revision,
                cycle=cycle,
                applied=applied,
                refused=list(refused),
                status=status,
            )
