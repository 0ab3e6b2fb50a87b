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

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import anyio
import msgspec
import structlog

from ._capabilities import Capabilities, Step
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
    "Interrupted",
    "check_progress",
    "commit",
    "context",
    "idle_reason",
    "log_cycle",
    "log_failure",
    "offer",
]

D = TypeVar("D", bound=msgspec.Struct)

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

    step: Step[D]
    outcome: Continue | Yield
    ctx: StepContext[D]
    refused: tuple[str, ...] = ()


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
) -> Decision[D] | Interrupted[D] | None:
    """Offer ``session`` to ``capabilities.steps`` in order; the first that does not refuse decides.

    Returns:
        The :class:`Decision`; ``None`` when every step refused; the
        :class:`Interrupted` step when ``token`` fired while it ran.

    A step that committed batches of its own and then refused counts as
    ``Continue(())``: the session moved, so the next cycle starts from the top.

    Raises:
        ConfigurationError: duplicate tool names (before any step runs).
        StepContractError: a step returned something other than an outcome.
        Exception: whatever a step raises.

    Cancellation: when ``token`` fires while a step runs, the step is cancelled
    and returned as :class:`Interrupted`. A cancellation from outside
    awaits ``on_cancel(Interrupted(step, ctx))`` (the callee shields itself),
    then propagates.
    """
    collected = capabilities.collect(session)
    refused: list[str] = []
    for step in capabilities.steps:
        ctx = context(
            capabilities,
            runtime,
            session,
            sink,
            cycle,
            run_start_revision,
            _committer(runtime, step.name, cycle, sink),
            collected,
        )
        try:
            if token is None:
                outcome: Outcome | None = await step.run(ctx)
            else:
                outcome = await _run_under(token, step, ctx)
        except BaseException as exc:
            if not stops_the_run(exc):
                raise
            await on_cancel(Interrupted(step, ctx))
            raise
        if outcome is None:
            return Interrupted(step, ctx)
        if isinstance(outcome, Refuse) and ctx.session.revision != session.revision:
            outcome = Continue(())
        if isinstance(outcome, Refuse):
            refused.append(step.name)
            continue
        if not isinstance(outcome, Continue | Yield):
            raise StepContractError(
                f"step {step.name!r} returned {outcome!r}; a step returns Refuse, Continue or Yield"
            )
        return Decision(step, outcome, ctx, tuple(refused))
    return None


async def _run_under(token: CancelToken, step: Step[D], ctx: StepContext[D]) -> Outcome | None:
    """``step.run(ctx)`` in a scope ``token`` cancels; ``None`` when it did."""
    outcome: Outcome | None = None
    with anyio.CancelScope() as scope:
        token.bind(scope)
        try:
            outcome = await step.run(ctx)
        finally:
            token.unbind(scope)
    return outcome


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
            "session would not change and the next cycle would decide the same"
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
    runtime: Runtime, session: Session[D], step_name: str, cycle: int, effects: Sequence[Effect]
) -> Session[D]:
    """Persist ``effects`` as one batch, compare-and-set on ``session.revision``.

    The batch is applied once (by the store, or here: see
    :func:`~stepmachine._store.store_batch`).

    Raises:
        ConflictError: the stored session moved on; nothing was written.
        EffectError: an effect does not apply; nothing was written.
    """
    handler: EffectHandler = runtime.effect_handler()
    return await store_batch(handler, session, step_name, cycle, runtime.clock(), tuple(effects))


def _committer(runtime: Runtime, step_name: str, cycle: int, sink: EventSink) -> Committer[Any]:
    """What ``StepContext.commit`` calls: one batch now, under the step's name."""

    async def commit_now(current: Session[Any], effects: Sequence[Effect]) -> Session[Any]:
        after = await commit(runtime, current, step_name, cycle, effects)
        await sink.emit(StepApplied(step_name, after.revision, "committed", len(effects)))
        return after

    return commit_now


def log_cycle(
    session: Session[Any], cycle: int, applied: str | None, refused: Sequence[str], status: str
) -> None:
    """One debug line per cycle (logger ``stepmachine``), when debug logging is on."""
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


def log_failure(message: str, session_id: str) -> None:
    """Log the exception being handled (logger ``stepmachine``), for a session."""
    _log.exception(message, session_id=session_id)


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
