"""What a step's ``run`` must give the machine, checked where the cycle awaits it.

A step's ``run(ctx)`` is an ``async def`` returning one outcome: ``Refuse``,
``Continue``, ``Yield`` or ``Staged``. :func:`check_pending` checks what
calling it returned (something to await), :func:`check_outcome` what awaiting
that gave, and :func:`check_continues` that a ``Continue`` changes the
session. Each failure is a :class:`~stepmachine.StepContractError` naming the
step, the value seen and the fix; nothing of the cycle was written. The cycle
(``stepmachine._cycle``) and the one-step harness (``stepmachine.testing``)
use them.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable

from ._errors import StepContractError
from ._staged import Staged
from ._steps import Continue, Outcome, Refuse, Yield

__all__ = ["check_continues", "check_outcome", "check_pending"]


def check_pending(step_name: str, pending: object) -> Awaitable[object]:
    """``pending``, what calling a step's ``run(ctx)`` returned, when it can be awaited.

    Raises:
        StepContractError: it cannot be awaited (``run`` is a plain ``def``, or
            an async generator), naming the step, the value seen and the fix.
    """
    if inspect.isawaitable(pending):
        return pending
    if inspect.isgenerator(pending):
        pending.close()
    raise StepContractError(
        f"step {step_name!r} has a run() that is not async: calling it returned "
        f"{_shown(pending)} (a {type(pending).__name__}), which cannot be awaited; make run an "
        "`async def run(self, ctx)` that returns Refuse(why), Continue(effects), "
        "Yield(effects, reason) or Staged(...); nothing was written for this cycle"
    )


def check_outcome(step_name: str, returned: object) -> Outcome:
    """``returned`` when it is a step outcome (``Refuse``, ``Continue``, ``Yield``, ``Staged``).

    Raises:
        StepContractError: anything else, ``None`` included (a ``run`` that fell
            off its end without a ``return``), naming the step, the value seen
            and the fix. Nothing was written for the cycle.
    """
    if isinstance(returned, Refuse | Continue | Yield | Staged):
        return returned
    if returned is None:
        seen = "returned None (is a `return` missing at the end of its run()?)"
    else:
        seen = f"returned {_shown(returned)} (a {type(returned).__name__})"
    raise StepContractError(
        f"step {step_name!r} {seen}; a step's run() returns Refuse(why) when it does not "
        "apply, Continue(effects), Yield(effects, reason) or Staged(...); nothing was written "
        "for this cycle"
    )


def check_continues(step_name: str, outcome: Outcome) -> None:
    """Raise :class:`StepContractError` when ``outcome`` is a ``Continue`` with no effects
    (the session would not change and the next cycle would decide the same, forever)."""
    if isinstance(outcome, Continue) and not outcome.effects:
        raise StepContractError(
            f"step {step_name!r} returned Continue with no effects; the session would not "
            "change and the next cycle would decide the same, forever. Return Refuse(why) "
            "when the step has nothing to do, or Yield(effects, reason) to hand control back"
        )


def _shown(value: object) -> str:
    shown = repr(value)
    return shown if len(shown) <= 200 else shown[:200] + "..."
