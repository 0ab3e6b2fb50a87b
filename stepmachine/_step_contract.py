"""What a step's ``run`` must give the machine, checked where the cycle awaits it.

A step's ``run(ctx)`` is an ``async def`` returning one outcome: ``Refuse``,
``Continue``, ``Yield`` or ``Staged``. :func:`check_pending` checks what
calling it returned (something to await), :func:`check_outcome` what awaiting
that gave (an outcome, whose effects are effects and whose yield reason is a
reason), and :func:`check_continues` that a ``Continue`` changes the
session. Each failure is a :class:`~stepmachine.StepContractError` naming the
step, the value seen and the fix; nothing of the cycle was written. The cycle
(``stepmachine._cycle``) and the one-step harness (``stepmachine.testing``)
use them.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable

from ._effects import Effect
from ._errors import StepContractError
from ._staged import Staged
from ._steps import Continue, Outcome, Refuse, Yield, YieldReason

__all__ = ["check_continues", "check_outcome", "check_pending", "shown"]


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
        f"{shown(pending)} (a {type(pending).__name__}), which cannot be awaited; make run an "
        "`async def run(self, ctx)` that returns Refuse(why), Continue(effects), "
        "Yield(effects, reason) or Staged(...); nothing was written for this cycle"
    )


_WITH_EFFECTS = (Continue, Yield, Staged)


def check_outcome(step_name: str, returned: object) -> Outcome:
    """``returned`` when it is a step outcome (``Refuse``, ``Continue``, ``Yield``, ``Staged``).

    The effects of a ``Continue``, ``Yield`` or ``Staged`` must be
    :class:`~stepmachine.Effect` values, and a ``Yield``'s reason a non-empty
    string or a :class:`~stepmachine.YieldReason` whose ``kind`` is one (what a
    caller reads to know why the run returned).

    Raises:
        StepContractError: anything else, ``None`` included (a ``run`` that fell
            off its end without a ``return``), or an outcome holding something
            that is not an effect or a reason, naming the step, the value seen
            and the fix. Nothing was written for the cycle.
    """
    kind = type(returned)
    if kind is Refuse:
        return returned  # type: ignore[return-value]
    if kind is Continue or kind is Yield or isinstance(returned, _WITH_EFFECTS):
        outcome: Continue | Yield | Staged = returned  # type: ignore[assignment]
        for effect in outcome.effects:
            if not isinstance(effect, Effect):
                raise StepContractError(_not_an_effect(step_name, outcome, effect))
        if isinstance(outcome, Yield):
            reason = outcome.reason
            if type(reason) is not YieldReason or type(reason.kind) is not str or not reason.kind:
                _check_reason(step_name, reason)
        return outcome
    if isinstance(returned, Refuse):
        return returned
    if returned is None:
        seen = "returned None (is a `return` missing at the end of its run()?)"
    else:
        seen = f"returned {shown(returned)} (a {type(returned).__name__})"
    raise StepContractError(
        f"step {step_name!r} {seen}; a step's run() returns Refuse(why) when it does not "
        "apply, Continue(effects), Yield(effects, reason) or Staged(...); nothing was written "
        "for this cycle"
    )


def _not_an_effect(step_name: str, outcome: Outcome, value: object) -> str:
    kind = type(outcome).__name__
    return (
        f"step {step_name!r} returned a {kind} whose effects hold {shown(value)} (of type "
        f"{type(value).__name__}), which is not an effect; give {kind} Effect values "
        "(AppendMessage(message), UpdateData(data), ...; to add a message: "
        "AppendMessage(Message.assistant(...))); nothing was written for this cycle"
    )


def _check_reason(step_name: str, reason: object) -> None:
    """Raise :class:`StepContractError` unless ``reason`` is a ``YieldReason`` with a kind."""
    if isinstance(reason, YieldReason) and isinstance(reason.kind, str) and reason.kind:
        return
    if isinstance(reason, YieldReason):
        seen = f"a YieldReason whose kind is {shown(reason.kind)}"
    else:
        seen = f"{shown(reason)} (of type {type(reason).__name__})"
    raise StepContractError(
        f"step {step_name!r} returned a Yield whose reason is {seen}; the reason tells the caller "
        "why the run returned: give a non-empty string (Yield(effects, 'done')) or a "
        "YieldReason('kind', message=..., data=...); nothing was written for this cycle"
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


def shown(value: object) -> str:
    """``repr(value)``, cut to 200 characters (for an error message)."""
    shown = repr(value)
    return shown if len(shown) <= 200 else shown[:200] + "..."
