"""After a cancellation: keep what was already received, answer every call left open.

:func:`finalize` makes a cancelled session whole again, in three kinds of
batches, each computed from the session as stored now and retried on
conflict: what the machine held for the interrupted step (the records of its
staged work that existed and were not yet written: a finished tool's result,
streamed text) and its own ``finalize(interrupted=True)`` (with the ctx of the
cycle it was running in), every other finalizing step's
``finalize(interrupted=False)``, then an "interrupted" error result
(:data:`INTERRUPTED`, step :data:`FINALIZE_STEP`) for every tool call still
without a result. A tool call whose tool ran to completion keeps its real
result: "interrupted" only ever answers a call that has no result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import anyio
import msgspec

from . import _log
from ._capabilities import Capabilities, Finalizes, step_name
from ._capabilities import cycle_context as context
from ._effects import AppendMessage, Effect
from ._emitter import EventSink
from ._history import open_tool_calls
from ._messages import Message, ToolResultPart
from ._retry import retry_conflicts
from ._runtime import Runtime
from ._session import Session
from ._staged import write_held
from ._store import commit

if TYPE_CHECKING:
    from ._decision import Interrupted

__all__ = [
    "FINALIZE_STEP",
    "INTERRUPTED",
    "finalize",
    "keep_interrupted",
    "keep_records",
    "shielded",
    "stops_the_run",
]

D = TypeVar("D", bound=msgspec.Struct)

FINALIZE_STEP = "stepmachine.finalize"
"""The step name recorded for the batch that answers interrupted tool calls."""

INTERRUPTED = "interrupted: the run was cancelled before this tool call finished"
"""The content of the error result given to tool calls left open by a cancellation."""


async def finalize(
    capabilities: Capabilities[D],
    runtime: Runtime,
    session_id: str,
    sink: EventSink,
    interrupted: Interrupted[D] | None,
    *,
    cycle: int,
    run_start_revision: int,
    max_conflicts: int,
) -> Session[D]:
    """Keep the interrupted step's results, finalize the others, answer open calls.

    Returns:
        The session afterwards.

    Raises:
        ConflictError: one batch conflicted more than ``max_conflicts`` times.
        Exception: whatever a step's ``finalize`` raises.

    Cancellation: not shielded here; callers shield (see :func:`shielded`).
    """
    loader = runtime.session_loader()
    session: Session[D] = await loader.load(session_id)
    before = session.revision
    sink.follow(session.revision)
    session = await keep_interrupted(runtime, session, interrupted, cycle, max_conflicts)
    kept: object = None if interrupted is None else interrupted.step  # finalized above
    for step in capabilities.finalizers:
        if step is kept:
            continue

        async def finalize_step(current: Session[D], step: Finalizes[D] = step) -> Sequence[Effect]:
            ctx = context(capabilities, runtime, current, sink, cycle, run_start_revision)
            return await step.finalize(ctx, interrupted=False)

        name = step_name(step)
        session = await _commit_fresh(runtime, session, name, cycle, finalize_step, max_conflicts)

    async def answer_open_calls(current: Session[D]) -> Sequence[Effect]:
        return [
            AppendMessage(
                Message.tool_result(
                    ToolResultPart.for_call(call, INTERRUPTED, is_error=True), id=runtime.ids()
                )
            )
            for call in open_tool_calls(current)
        ]

    answered = len(open_tool_calls(session))
    session = await _commit_fresh(
        runtime, session, FINALIZE_STEP, cycle, answer_open_calls, max_conflicts
    )
    sink.follow(session.revision)
    _log.event(
        _log.INFO,
        "finalize",
        session_id=session_id,
        revision=session.revision,
        interrupted=None if interrupted is None else interrupted.step.name,
        batches=session.revision - before,
        answered=answered,
    )
    return session


async def keep_interrupted(
    runtime: Runtime,
    session: Session[D],
    interrupted: Interrupted[D] | None,
    cycle: int,
    max_conflicts: int,
) -> Session[D]:
    """Write what the machine held for the interrupted step, then its own
    ``finalize(interrupted=True)`` effects, if any.

    Each held record sees the session as stored now (its batch may have been
    written just before the cancellation: then it records nothing), and so
    does the step, with the ctx of its cycle.
    """
    if interrupted is None:
        return session
    session = await keep_records(runtime, session, interrupted, cycle, max_conflicts)
    step, step_ctx = interrupted.step, interrupted.ctx
    if not step_ctx.capabilities.finalizes(step):
        return session
    finalizer = cast("Finalizes[D]", step)

    async def keep(current: Session[D]) -> Sequence[Effect]:
        return await finalizer.finalize(
            dataclasses.replace(step_ctx, session=current), interrupted=True
        )

    return await _commit_fresh(runtime, session, step.name, cycle, keep, max_conflicts)


async def keep_records(
    runtime: Runtime,
    session: Session[D],
    interrupted: Interrupted[D],
    cycle: int,
    max_conflicts: int,
) -> Session[D]:
    """Write the records the machine held for the interrupted step, each its own batch.

    Each sees the session as stored now (its batch may have been written just
    before the cancellation: then it records nothing).
    """
    loader, handler = runtime.session_loader(), runtime.effect_handler()
    name = interrupted.step.name

    async def write(current: Session[D], effects: Sequence[Effect]) -> Session[D]:
        return await commit(handler, runtime.clock, name, cycle, (), None, current, effects)

    written = await write_held(list(interrupted.held), session, write, loader.load, name)
    return cast("Session[D]", written)


async def shielded(seconds: float, session_id: str, work: Callable[[], Awaitable[Any]]) -> None:
    """Run ``work()`` shielded for at most ``seconds``, while a cancellation is pending.

    An exception from ``work`` is logged, not raised: the pending cancellation
    must still propagate.
    """
    with anyio.move_on_after(seconds, shield=True):
        try:
            await work()
        except Exception:  # noqa: BLE001 - the cancellation must still propagate
            _log.failure("finalize failed after a cancellation", session_id=session_id)


async def _commit_fresh(
    runtime: Runtime,
    session: Session[D],
    step_name: str,
    cycle: int,
    compute: Callable[[Session[D]], Awaitable[Sequence[Effect]]],
    max_conflicts: int,
) -> Session[D]:
    """Compute effects from ``session`` and commit them; on conflict reload and recompute."""

    async def attempt(current: Session[D]) -> Session[D]:
        effects = tuple(await compute(current))
        if not effects:
            return current
        handler = runtime.effect_handler()
        return await commit(handler, runtime.clock, step_name, cycle, (), None, current, effects)

    loader = runtime.session_loader()
    return await retry_conflicts(session, attempt, loader.load, attempts=max_conflicts + 1)


def stops_the_run(exc: BaseException) -> bool:
    """Whether ``exc`` stops a run from outside, so finalize runs before it propagates.

    A cancellation, or ``KeyboardInterrupt`` / ``SystemExit``, bare or inside an
    exception group (under trio, Ctrl-C raises ``KeyboardInterrupt`` at the next
    checkpoint, which can be inside staged work's task group, right after a
    tool returned: its result must still be recorded).
    """
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        return True
    interrupts = (KeyboardInterrupt, SystemExit)
    if isinstance(exc, interrupts):
        return True
    return isinstance(exc, BaseExceptionGroup) and exc.subgroup(interrupts) is not None
