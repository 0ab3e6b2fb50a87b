"""Carry out a step's staged work against a hand-built ctx, as the machine does.

For tests that build a :class:`~stepmachine.StepContext` by hand (a committer
that watches or blocks writes) and call ``step.run(ctx)`` themselves: a
``Staged`` outcome is executed by the machine's own code
(``stepmachine._staged.execute``), writing through ``ctx.committer``.
"""

from __future__ import annotations

from typing import Any

from stepmachine import Outcome, Session, Step, StepContext
from stepmachine._staged import Recorder, Staged, Task, execute


async def carry_out(
    step: Step[Any], ctx: StepContext[Any], held: list[Recorder] | None = None
) -> Outcome:
    """``step.run(ctx)``; staged work carried out through ``ctx.committer``; its ending."""
    outcome = await step.run(ctx)
    if not isinstance(outcome, Staged):
        return outcome
    committer = ctx.committer
    assert committer is not None

    async def write(current: Session[Any], effects: Any, status: str) -> Session[Any]:
        ctx.session = await committer(current, effects)
        return ctx.session

    async def reload(session_id: str) -> Session[Any]:
        return ctx.session

    async def confirm(task: Task) -> None:
        return None

    kept = held if held is not None else []
    ctx.session, _, ending = await execute(outcome, ctx.session, write, reload, confirm, kept)
    return ending
