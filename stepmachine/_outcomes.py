"""What a step returns, and what the machine reports for a cycle.

A step returns exactly one :data:`Outcome`:

* :class:`Refuse` -- not applicable now; the machine offers the next step;
* :class:`Continue` -- apply these effects, then start a new cycle from the top;
* :class:`Yield` -- apply these effects, then return control to the caller,
  with a :class:`YieldReason` the caller reads;
* :class:`Staged` -- staged work the machine carries out: intents first, then
  each :class:`Task`, each result written as it lands (see ``_staged``).

The machine reports each cycle as a :class:`StepResult`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeAlias

import msgspec

from ._effects import Effect
from ._errors import ConfigurationError
from ._session import Session

__all__ = [
    "Continue",
    "Outcome",
    "Recorder",
    "Refuse",
    "Staged",
    "StepResult",
    "Task",
    "Yield",
    "YieldReason",
]


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
    """Apply ``effects``, then start the next cycle from the top of the list.

    ``effects`` must be :class:`~stepmachine.Effect` values: the machine checks
    the outcome a step returns and raises :class:`~stepmachine.StepContractError`
    (naming the step and the value) for anything else, before writing.
    """

    effects: tuple[Effect, ...]

    def __init__(self, effects: Sequence[Effect]) -> None:
        object.__setattr__(self, "effects", tuple(effects))


@dataclass(frozen=True, slots=True)
class Yield:
    """Apply ``effects`` (possibly none), then return control to the caller.

    ``reason`` is a non-empty string (the :attr:`YieldReason.kind`) or a
    :class:`YieldReason`. The machine checks the outcome a step returns and
    raises :class:`~stepmachine.StepContractError` (naming the step and the
    value) for a reason that is neither, or effects that are not
    :class:`~stepmachine.Effect` values, before writing.
    """

    effects: tuple[Effect, ...]
    reason: YieldReason

    def __init__(self, effects: Sequence[Effect], reason: YieldReason | str) -> None:
        object.__setattr__(self, "effects", tuple(effects))
        object.__setattr__(
            self, "reason", YieldReason(reason) if isinstance(reason, str) else reason
        )


Recorder: TypeAlias = Callable[[Session[Any]], Sequence[Effect]]
"""How a finished task is recorded: the effects, computed from the session as stored.

Called when the machine writes the task's batch, again after a conflict, and
by finalize after a cancellation; return no effects when there is nothing
left to record (another writer recorded it).
"""


def constant_record(*effects: Effect) -> Recorder:
    """A :data:`Recorder` that records ``effects`` whatever the stored session (for a
    task whose result nobody else can record: the run holds the session)."""

    def record(stored: Session[Any]) -> Sequence[Effect]:
        return effects

    return record


@dataclass(frozen=True, slots=True)
class Task:
    """One piece of staged work.

    Attributes:
        name: what the task is, for logs and errors (a tool call's id).
        run: the work; returns how to record its result. An exception from
            it propagates (the step decides what is an error result: catch
            it and return a record of it).
        guarded: a start that must not happen twice (a ``non_idempotent``
            tool, a payment): the machine confirms with the store that the run
            still holds the session right before it starts the task.
        landed: awaited once the machine holds the task's record, before it is
            written (a "finished" event); an interrupt there loses nothing.
        keep: what to record if the task is cancelled while it runs (what it
            already has); ``None``: nothing.
        refused: a replacement record when the store refuses the record's
            effects (:class:`~stepmachine.EffectError`), or ``None``. Asked
            once per task: a replacement the store refuses too raises its error.
    """

    name: str
    run: Callable[[], Awaitable[Recorder]]
    guarded: bool = False
    landed: Callable[[], Awaitable[None]] | None = None
    keep: Recorder | None = None
    refused: Callable[[Exception], Recorder | None] | None = None


@dataclass(frozen=True, slots=True)
class Staged:
    """Write ``intents``, run ``tasks`` and record each as it lands; then ``then()``.

    See the module docs of ``_staged`` for the order, for cancellation and for
    errors: a task that raises cancels its siblings, and the error propagates
    once the machine has written what it holds (the record of every task that
    returned, the ``keep`` of every task that did not).

    Attributes:
        intents: effects written as one batch before any task starts.
        tasks: the work, in order.
        max_concurrency: tasks run at once (1: one after another, in order).
        then: how the cycle ends once every task is recorded (default
            ``Continue(())``): returns ``Continue`` or ``Yield`` (anything
            else is a ``StepContractError``); may raise.

    Raises:
        ConfigurationError: ``max_concurrency`` is not an int >= 1, or there is
            neither an intent nor a task (the session would not change).
    """

    intents: tuple[Effect, ...]
    tasks: tuple[Task, ...]
    max_concurrency: int
    then: Callable[[], Continue | Yield] | None

    def __init__(
        self,
        intents: Sequence[Effect] = (),
        tasks: Sequence[Task] = (),
        *,
        max_concurrency: int = 1,
        then: Callable[[], Continue | Yield] | None = None,
    ) -> None:
        if (
            isinstance(max_concurrency, bool)
            or not isinstance(max_concurrency, int)
            or max_concurrency < 1
        ):
            raise ConfigurationError(
                f"Staged: max_concurrency must be an int >= 1, got {max_concurrency!r}"
            )
        if not intents and not tasks:
            raise ConfigurationError(
                "Staged with no intents and no tasks changes nothing; return Refuse(why) "
                "when the step has nothing to do"
            )
        object.__setattr__(self, "intents", tuple(intents))
        object.__setattr__(self, "tasks", tuple(tasks))
        object.__setattr__(self, "max_concurrency", max_concurrency)
        object.__setattr__(self, "then", then)

    @property
    def effects(self) -> tuple[Effect, ...]:
        """The intents (what the outcome writes before any work; ``Continue.effects``'s peer)."""
        return self.intents


Outcome: TypeAlias = Refuse | Continue | Yield | Staged


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
