"""What one cycle decides, and what a run reports: the values :mod:`._cycle` passes on.

:func:`~stepmachine._cycle.decide` returns a :class:`Decision` (the step that
applies, its outcome, the refusals before it), :class:`Idle` (every step
refused) or :class:`Interrupted` (the machine's token fired while a step ran);
a run returns a :class:`RunReport`. Plain frozen values: no I/O, no behaviour
beyond reading what they hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

import msgspec

from ._capabilities import Step
from ._codec import Refusal
from ._session import Session
from ._staged import Recorder, Staged
from ._steps import Continue, StepContext, StepResult, Yield, YieldReason

__all__ = ["Decision", "Idle", "Interrupted", "RunReport"]

D = TypeVar("D", bound=msgspec.Struct)


@dataclass(frozen=True, slots=True)
class Decision(Generic[D]):
    """The step that applied in one cycle, with its outcome.

    Attributes:
        step: the step that applied.
        outcome: its ``Continue``, ``Yield`` or ``Staged``.
        ctx: the context it ran with.
        refusals: the steps that refused before it, with why, in order.
        held: the records of its staged work that exist and are not yet
            written (filled while :func:`apply` runs; finalize writes them).
    """

    step: Step[D]
    outcome: Continue | Yield | Staged
    ctx: StepContext[D]
    refusals: tuple[Refusal, ...] = ()
    held: list[Recorder] = field(default_factory=list)

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
    """The step a cancellation landed in, its ctx, and the records held for it."""

    step: Step[D]
    ctx: StepContext[D]
    held: tuple[Recorder, ...] = ()


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

    @property
    def text(self) -> str | None:
        """The answer: the text of the last message when the model wrote it, else ``None``.

        ``None`` when the last message is not the assistant's, or asks for tool
        calls (the run waits, for an approval say). O(1): reads the last message only.
        """
        conversation = self.session.conversation
        if not conversation:
            return None
        last = conversation[-1]
        if last.role != "assistant" or last.tool_calls:
            return None
        return last.text
