"""One cycle: collect what steps contribute, offer the session to the steps, commit a batch.

The pieces :class:`~stepmachine.StateMachine` composes into its loop (see
``_machine``), each a function of its arguments: nothing here keeps state
between calls. Cancellation of a running step is answered where the step is
known: :func:`offer` hands the interrupted step and its ctx to the caller's
``on_cancel`` (which keeps what the step already has) before the
cancellation propagates, or, when the machine's :class:`CancelToken` fired,
returns them as an :class:`Interrupted`.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import anyio
import msgspec

from . import _log, _tracing
from ._capabilities import Capabilities, Step
from ._codec import Refusal, refusal
from ._effects import Effect
from ._emitter import EventSink, StepApplied
from ._errors import StepContractError
from ._history import open_tool_calls
from ._model import PromptPart, ToolDefinition
from ._runtime import Runtime
from ._session import Session
from ._steps import (
    CancelToken,
    Continue,
    Outcome,
    Refuse,
    StepContext,
    Yield,
    YieldReason,
)
from ._store import EffectHandler, store_batch

__all__ = [
    "Decision",
    "Idle",
    "Interrupted",
    "check_outcome",
    "check_pending",
    "check_progress",
    "commit",
    "context",
    "idle_reason",
    "log_cycle",
    "offer",
]

D = TypeVar("D", bound=msgspec.Struct)


@dataclass(frozen=True, slots=True)
class Decision(Generic[D]):
    """The step that applied in one cycle, with its outcome.

    Attributes:
        step: the step that applied.
        outcome: its ``Continue`` or ``Yield``.
        ctx: the context it ran with (its ``scratch`` included).
        refusals: the steps that refused before it, with why, in order.
    """

    step: Step[D]
    outcome: Continue | Yield
    ctx: StepContext[D]
    refusals: tuple[Refusal, ...] = ()

    @property
    def refused(self) -> tuple[str, ...]:
        """The names of the steps that refused before it."""
        return tuple(r.step for r in self.refusals)


@dataclass(frozen=True, slots=True)
class Idle:
    """Every step refused: why each one did, in step order."""

    refusals: tuple[Refusal, ...]


@dataclass(frozen=True, slots=True)
class Interrupted(Generic[D]):
    """The step a cancellation landed in (running, or having its decision applied), and its ctx."""

    step: Step[D]
    ctx: StepContext[D]


OnCancel = Callable[[Interrupted[D]], Awaitable[object]]
Committer = Callable[[Session[D], Sequence[Effect]], Awaitable[Session[D]]]


def context(
    capabilities: Capabilities[D],
    runtime: Runtime,
    session: Session[D],
    sink: EventSink,
    cycle: int,
    run_start_revision: int,
    committer: Committer[D] | None = None,
    collected: tuple[tuple[ToolDefinition, ...], tuple[PromptPart, ...]] | None = None,
) -> StepContext[D]:
    """A fresh ctx for ``session``, whose cross-step questions ``capabilities`` answers.

    ``collected`` is ``capabilities.collect(session)``, if known.
    """
    tools, parts = capabilities.collect(session) if collected is None else collected
    return StepContext(
        session=session,
        runtime=runtime,
        events=sink,
        cycle=cycle,
        tools=tools,
        prompt_parts=parts,
        steps=capabilities.steps,
        run_start_revision=run_start_revision,
        committer=committer,
        capabilities=capabilities,
    )


async def offer(
    capabilities: Capabilities[D],
    runtime: Runtime,
    session: Session[D],
    sink: EventSink,
    cycle: int,
    run_start_revision: int,
    *,
    token: CancelToken | None,
    on_cancel: OnCancel[D],
) -> Decision[D] | Interrupted[D] | Idle:
    """Offer ``session`` to ``capabilities.steps`` in order; the first that does not refuse decides.

    Returns:
        The :class:`Decision`; :class:`Idle` when every step refused; the
        :class:`Interrupted` step when ``token`` fired while it ran.

    A step that committed batches of its own and then refused counts as
    ``Continue(())``: the session moved, so the next cycle starts from the top.

    Raises:
        ConfigurationError: duplicate tool names (before any step runs).
        StepContractError: a step's ``run`` is not async (:func:`check_pending`),
            or it returned something other than an outcome.
        Exception: whatever a step raises.

    Cancellation: when ``token`` fires while a step runs, the step is cancelled
    and returned as :class:`Interrupted`. A cancellation from outside
    awaits ``on_cancel(Interrupted(step, ctx))`` (the callee shields itself),
    then propagates.
    """
    collected = capabilities.collect(session)
    refused: list[Refusal] = []
    for step in capabilities.steps:
        ctx = context(
            capabilities,
            runtime,
            session,
            sink,
            cycle,
            run_start_revision,
            _committer(runtime, step.name, cycle, sink, tuple(refused)),
            collected,
        )
        try:
            if token is None:
                returned: object = await check_pending(step.name, step.run(ctx))
            else:
                returned = await _run_under(token, step, ctx)
        except BaseException as exc:
            if not stops_the_run(exc):
                raise
            await on_cancel(Interrupted(step, ctx))
            raise
        if returned is _CANCELLED:
            return Interrupted(step, ctx)
        outcome = check_outcome(step.name, returned)
        if isinstance(outcome, Refuse) and ctx.session.revision != session.revision:
            outcome = Continue(())
        if isinstance(outcome, Refuse):
            refused.append(refusal(step.name, outcome.why))
            continue
        return Decision(step, outcome, ctx, tuple(refused))
    return Idle(tuple(refused))


_CANCELLED = object()
"""What :func:`_run_under` returns when the token cancelled the step (``None`` is a
step's own wrong return value: a contract error, see :func:`check_outcome`)."""


async def _run_under(token: CancelToken, step: Step[D], ctx: StepContext[D]) -> object:
    """What ``step.run(ctx)`` returned, run in a scope ``token`` cancels; :data:`_CANCELLED`
    when it did."""
    returned: object = _CANCELLED
    with anyio.CancelScope() as scope:
        token.bind(scope)
        try:
            returned = await check_pending(step.name, step.run(ctx))
        finally:
            token.unbind(scope)
    return returned


def check_pending(step_name: str, pending: object) -> Awaitable[object]:
    """``pending``, what calling a step's ``run(ctx)`` returned, when it can be awaited.

    Checked before awaiting, so a plain ``def run`` is named as what it is
    rather than failing inside the ``await``. A generator returned instead
    (``run`` written with ``yield``) is closed first; an async generator that
    never started needs no closing.

    Raises:
        StepContractError: ``pending`` is not awaitable (``run`` is a plain
            ``def``, or an async generator), naming the step, the value seen
            and the fix (make ``run`` an ``async def`` that returns its
            outcome). Nothing was written for the cycle.
    """
    if inspect.isawaitable(pending):
        return pending
    if inspect.isgenerator(pending):
        pending.close()
    shown = repr(pending)
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    raise StepContractError(
        f"step {step_name!r} has a run() that is not async: calling it returned {shown} "
        f"(a {type(pending).__name__}), which cannot be awaited; make run an "
        "`async def run(self, ctx)` that returns Refuse(why), Continue(effects) or "
        "Yield(effects, reason); nothing was written for this cycle"
    )


def check_outcome(step_name: str, returned: object) -> Outcome:
    """``returned`` when it is a step outcome (``Refuse``, ``Continue`` or ``Yield``).

    Raises:
        StepContractError: anything else, ``None`` included (a ``run`` that fell
            off its end without a ``return``), naming the step, the value seen
            and the fix. Nothing was written for the cycle.
    """
    if isinstance(returned, Refuse | Continue | Yield):
        return returned
    if returned is None:
        seen = "returned None (is a `return` missing at the end of its run()?)"
    else:
        shown = repr(returned)
        shown = shown if len(shown) <= 200 else shown[:200] + "..."
        seen = f"returned {shown} (a {type(returned).__name__})"
    raise StepContractError(
        f"step {step_name!r} {seen}; a step's run() returns Refuse(why) when it does not "
        "apply, Continue(effects) or Yield(effects, reason); nothing was written for this cycle"
    )


def check_progress(decision: Decision[D], session: Session[D]) -> None:
    """Raise unless applying ``decision`` changes the session (else the loop never ends).

    Raises:
        StepContractError: ``Continue`` with no effects from a step that committed nothing.
    """
    outcome = decision.outcome
    if (
        isinstance(outcome, Continue)
        and not outcome.effects
        and decision.ctx.session.revision == session.revision
    ):
        raise StepContractError(
            f"step {decision.step.name!r} returned Continue with no effects; the "
            "session would not change and the next cycle would decide the same, forever. "
            "Return Refuse(why) when the step has nothing to do, or Yield(effects, reason) "
            "to hand control back"
        )


def idle_reason(
    capabilities: Capabilities[D],
    runtime: Runtime,
    session: Session[D],
    sink: EventSink,
    cycle: int,
    run_start_revision: int,
) -> YieldReason:
    """Why no step applied: ``call_held`` if some step holds open calls back, else ``idle``."""
    calls = open_tool_calls(session)
    if not calls:
        return YieldReason(YieldReason.IDLE, "no step applies")
    ctx = context(capabilities, runtime, session, sink, cycle, run_start_revision)
    held: list[dict[str, str]] = []
    for call in calls:
        objection = ctx.vet_call(call)
        if objection is not None:
            held.append(
                {
                    "call_id": call.call_id,
                    "tool": call.name,
                    "step": objection.step,
                    "objection": objection.reason,
                }
            )
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


async def commit(
    runtime: Runtime,
    session: Session[D],
    step_name: str,
    cycle: int,
    effects: Sequence[Effect],
    refused: tuple[Refusal, ...] = (),
) -> Session[D]:
    """Persist ``effects`` as one batch, compare-and-set on ``session.revision``.

    The batch is applied once (by the store, or here: see
    :func:`~stepmachine._store.store_batch`). It records ``refused`` (the
    steps that refused before ``step_name`` in this cycle) and the current
    span's ``traceparent`` when the run is traced.

    Raises:
        ConflictError: the stored session moved on; nothing was written.
        EffectError: an effect does not apply; nothing was written.
    """
    handler: EffectHandler = runtime.effect_handler()
    return await store_batch(
        handler,
        session,
        step_name,
        cycle,
        runtime.clock(),
        tuple(effects),
        refused=refused,
        trace=_tracing.traceparent(),
    )


def _committer(
    runtime: Runtime, step_name: str, cycle: int, sink: EventSink, refused: tuple[Refusal, ...]
) -> Committer[Any]:
    """What ``StepContext.commit`` calls: one batch now, under the step's name."""

    async def commit_now(current: Session[Any], effects: Sequence[Effect]) -> Session[Any]:
        after = await commit(runtime, current, step_name, cycle, effects, refused)
        await sink.emit(StepApplied(step_name, after.revision, "committed", len(effects)))
        return after

    return commit_now


def log_cycle(
    session: Session[Any],
    cycle: int,
    step: str | None,
    refusals: Sequence[Refusal],
    outcome: str,
    *,
    effects: int = 0,
    started: float | None = None,
    span: Any = None,
) -> None:
    """Report one cycle: the ``cycle`` event (logger ``stepmachine``) and its span's attributes.

    ``session`` is the session after the cycle; ``started`` its
    ``time.perf_counter()`` at the start; ``span`` the cycle's span (``None``
    when the run is not traced).
    """
    if span is not None:
        span.update_name(f"cycle {step}" if step else "cycle")
        _tracing.set_attributes(
            span,
            {
                "stepmachine.step": step,
                "stepmachine.refused": [r.step for r in refusals],
                "stepmachine.outcome": outcome,
                "stepmachine.revision": session.revision,
                "stepmachine.effects": effects,
            },
        )
    if _log.enabled(_log.DEBUG):
        duration = None if started is None else round((time.perf_counter() - started) * 1000, 3)
        _log.event(
            _log.DEBUG,
            "cycle",
            session_id=session.id,
            revision=session.revision,
            cycle=cycle,
            step=step,
            refused=[{"step": r.step, "why": r.why} for r in refusals],
            outcome=outcome,
            effects=effects,
            duration_ms=duration,
        )


def stops_the_run(exc: BaseException) -> bool:
    """Whether ``exc`` stops a run from outside, so finalize runs before it propagates.

    A cancellation, or ``KeyboardInterrupt`` / ``SystemExit``, bare or inside an
    exception group (under trio, Ctrl-C raises ``KeyboardInterrupt`` at the next
    checkpoint, which can be inside the tool step's task group, right after a
    tool returned: its result must still be recorded).
    """
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        return True
    interrupts = (KeyboardInterrupt, SystemExit)
    if isinstance(exc, interrupts):
        return True
    return isinstance(exc, BaseExceptionGroup) and exc.subgroup(interrupts) is not None
