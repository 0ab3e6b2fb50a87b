"""What a step returns, and what the machine reports for a cycle.

A step returns exactly one :data:`Outcome`:

* :class:`Refuse` -- not applicable now; the machine offers the next step;
* :class:`Continue` -- apply these effects, then start a new cycle from the top;
* :class:`Yield` -- apply these effects, then return control to the caller,
  with a :class:`YieldReason` the caller reads.

The machine reports each cycle as a :class:`StepResult`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeAlias

import msgspec

from ._effects import Effect

__all__ = ["Continue", "Outcome", "Refuse", "StepResult", "Yield", "YieldReason"]


class YieldReason(msgspec.Struct, frozen=True):
    """Why a run returned control to the caller.

    ``kind`` is one of the constants below or an application's own string;
    ``message`` is for people; ``data`` carries details (for example the ids of
    the calls awaiting approval).
    """

    kind: str
    message: str = ""
    data: dict[str, Any] = msgspec.field(default_factory=dict)

    DONE: ClassVar[str] = "done"
    AWAITING_APPROVAL: ClassVar[str] = "awaiting_approval"
    AWAITING_EVENT: ClassVar[str] = "awaiting_event"
    BUDGET_EXHAUSTED: ClassVar[str] = "budget_exhausted"
    IDLE: ClassVar[str] = "idle"
    """No step applied: there is nothing to do until the session changes."""
    CANCELLED: ClassVar[str] = "cancelled"
    """The run was cancelled and finalized."""
    CALL_HELD: ClassVar[str] = "call_held"
    """No step applied and open tool calls are held back by a step's ``check_call``.

    ``message`` names the first objecting step, call id and tool; ``data["calls"]``
    lists every held call as ``{"call_id", "tool", "step", "objection"}`` (the
    first objecting step, in step order). Nothing runs the calls until the
    session changes (a decision recorded, an error result appended) and
    ``run()`` is called again.
    """
    QUEUED: ClassVar[str] = "queued"
    """Another runner held the session's lease; the turn was queued for it.

    Returned by a ``run()`` with ``LeasePolicy(busy="queue")``: it wrote nothing.
    The holder runs the turn before it releases the session (or, if it dies,
    whoever claims the session next: a worker's ``claim_next``).
    """
    CYCLE_LIMIT: ClassVar[str] = "cycle_limit"
    """The run reached the machine's ``max_cycles``; ``run()`` again continues.

    ``data`` holds ``{"max_cycles": n}``.
    """


@dataclass(frozen=True, slots=True)
class Refuse:
    """The step does not apply now."""

    why: str = ""


@dataclass(frozen=True, slots=True)
class Continue:
    """Apply ``effects``, then start the next cycle from the top of the list."""

    effects: tuple[Effect, ...]

    def __init__(self, effects: Sequence[Effect]) -> None:
        object.__setattr__(self, "effects", tuple(effects))


@dataclass(frozen=True, slots=True)
class Yield:
    """Apply ``effects`` (possibly none), then return control to the caller."""

    effects: tuple[Effect, ...]
    reason: YieldReason

    def __init__(self, effects: Sequence[Effect], reason: YieldReason | str) -> None:
        object.__setattr__(self, "effects", tuple(effects))
        object.__setattr__(
            self, "reason", YieldReason(reason) if isinstance(reason, str) else reason
        )


Outcome: TypeAlias = Refuse | Continue | Yield


@dataclass(frozen=True, slots=True)
class StepResult:
    """The report of one cycle.

    Attributes:
        step: the name of the step that applied.
        effects: the effects it returned (applied, unless ``status`` is
            ``"cancelled"`` and the step was interrupted before returning).
        status: ``"continue"``, ``"yielded"`` or ``"cancelled"``.
        revision: the session revision after the cycle.
        reason: the yield reason, for ``"yielded"`` and ``"cancelled"``.
    """

    step: str
    effects: tuple[Effect, ...]
    status: Literal["continue", "yielded", "cancelled"]
    revision: int
    reason: YieldReason | None = None
