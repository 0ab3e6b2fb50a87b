"""The records the built-in operations write in notes (see :mod:`stepmachine._records`).

One place for what the operations persist: each is a registered, tagged
:class:`~stepmachine.Record` under the rules of the kernel's records (explicit
tags, new fields only with defaults). The operation that writes each one says
where it goes (namespace, key, message or call).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from stepmachine import Usage
from stepmachine.extend import Ledger, Record

__all__ = [
    "ApprovalDecision",
    "ApprovalRequest",
    "BudgetRefusal",
    "CompactionMark",
    "CompactionReceipt",
    "EventConsumed",
    "EventCursor",
    "EventDelivery",
    "EventRecord",
    "InvalidCallsDecision",
    "InvalidCallsFeedback",
    "InvalidCallsRepair",
    "InvalidCallsSkipped",
    "OutputAnswer",
    "OutputError",
    "OutputFeedback",
    "OutputValue",
    "WaitMarker",
]


# -- approval ---------------------------------------------------------------------------------


class ApprovalRequest(Record, frozen=True, tag="stepmachine.approval.request"):
    """A call was reported as awaiting approval (key ``"request"``).

    Attributes:
        fingerprint: the fingerprint it was reported with.
        requested_at: the runtime clock then.
    """

    fingerprint: str
    requested_at: float = 0.0


class ApprovalDecision(Record, frozen=True, tag="stepmachine.approval.decision"):
    """A human decision on one call (key ``"decision"``).

    Written by :func:`~stepmachine.operations.approve` and
    :func:`~stepmachine.operations.deny`.

    Attributes:
        outcome: ``"approved"`` or ``"denied"``.
        fingerprint: the fingerprint the decision is bound to (approval cannot be bypassed).
        tool: the tool name of the call.
        by: who decided.
        reason: for the audit log.
        message: what the model is told of a denial.
        decided_at: the clock when recorded.
        expires_at: an approval no longer counts from then on (``None``: never).
        always: an approval that also covers every later call of ``tool``.
        edited: the approval is bound to arguments the reviewer edited.
    """

    outcome: Literal["approved", "denied"]
    fingerprint: str
    tool: str = ""
    by: str = ""
    reason: str = ""
    message: str = ""
    decided_at: float = 0.0
    expires_at: float | None = None
    always: bool = False
    edited: bool = False


# -- budget -----------------------------------------------------------------------------------


class BudgetRefusal(Record, frozen=True, tag="stepmachine.budget.refusal"):
    """A call the budget refused: on the call (``refused`` is the reason) and on its
    error result (``refused`` is the call id)."""

    refused: str


# -- compaction -------------------------------------------------------------------------------


class CompactionReceipt(Record, frozen=True, tag="stepmachine.compaction.summary"):
    """The notes of a summary message, under the step's name.

    Attributes:
        kind: always ``"summary"`` (how a summary is recognised, also in
            records written before they were typed).
        summarised: the ids of the messages the summary replaces.
        tokens_before, tokens_after: the estimate of the visible conversation.
        model: the summariser.
        trigger: ``"threshold"`` or ``"context_length_exceeded"``.
        cut: ``"turns"`` or ``"rounds"``.
        usage: the summariser's token counts.
        revision: the session revision it summarised.
        attempts: the summariser's model calls (budgets count them).
        summarised_into: set when a later summary summarised this one.
        ledger: the model-call totals including this call (also on the mark
            of the last message, where readers of running totals look first).
    """

    summarised: list[str]
    tokens_before: int
    tokens_after: int
    trigger: str
    cut: str
    revision: int
    attempts: int
    kind: str = "summary"
    model: str | None = None
    usage: Usage = msgspec.field(default_factory=Usage)
    summarised_into: str | None = None
    ledger: Ledger | None = None


class CompactionMark(Record, frozen=True, tag="stepmachine.compaction.mark"):
    """The notes compaction leaves on other messages, under the step's name.

    Attributes:
        summarised_into: the id of the summary that replaced this hidden message.
        stuck: why the summary made nothing smaller (on the last visible
            message), so it is not asked again until a new message arrives.
        attempts, revision, usage: that summariser call (budgets count it).
        ledger: the model-call totals including the latest summariser call
            (:class:`stepmachine.Ledger`), on the last visible message.
        reserved: of ``attempts``, the calls reserved for a summary request
            under way (see :class:`stepmachine.ModelInference`, which reserves
            the same way); left by a crash, they stay counted.
    """

    summarised_into: str | None = None
    stuck: str | None = None
    attempts: int | None = None
    revision: int | None = None
    usage: Usage | None = None
    ledger: Ledger | None = None
    reserved: int = 0


# -- events -----------------------------------------------------------------------------------


class EventRecord(Record, frozen=True, tag="stepmachine.events.event"):
    """An event as submitted: key ``"event"`` of the hidden event message's notes.

    Attributes:
        id: the event id.
        kind: what happened.
        payload: JSON builtins.
        submitted_at: the submitter's clock.
    """

    id: str
    kind: str
    payload: Any = None
    submitted_at: float = 0.0


class EventConsumed(Record, frozen=True, tag="stepmachine.events.consumed"):
    """The consumption of an event: the namespace of the event message, beside ``"event"``.

    Attributes:
        consumed: the event was delivered (exactly once).
        consumed_at: the runtime clock then.
        delivered_as: the id of the message the model saw, or ``None``.
    """

    consumed: bool = False
    consumed_at: float | None = None
    delivered_as: str | None = None


class WaitMarker(Record, frozen=True, tag="stepmachine.events.wait"):
    """A wait for an event: the namespace of any message.

    Built by :func:`~stepmachine.operations.wait_for`.

    Attributes:
        awaiting: the kinds that satisfy it (empty: any).
        satisfied_by: the id of the event that did.
    """

    awaiting: list[str]
    satisfied_by: str | None = None


class EventCursor(Record, frozen=True, tag="stepmachine.events.cursor"):
    """How far consumption got: key ``"cursor"`` of the namespace of the last event
    message a batch of :class:`~stepmachine.operations.ExternalEvents` consumed.

    Every event submitted before that batch was consumed by it (or earlier), so
    the step reads only the messages noted after this one, plus the markers
    listed here.

    Attributes:
        waiting: the ids of the messages whose wait markers that batch left
            unsatisfied.
    """

    waiting: list[str] = msgspec.field(default_factory=list)


class EventDelivery(Record, frozen=True, tag="stepmachine.events.delivery"):
    """The notes of the user message an event was delivered as."""

    event_id: str
    kind: str


# -- invalid_calls ----------------------------------------------------------------------------


class InvalidCallsDecision(Record, frozen=True, tag="stepmachine.invalid_calls.decision"):
    """What the step decided about a message with invalid calls.

    Attributes:
        action: ``"retry"``, ``"repair"``, ``"skip"`` or ``"stop"``.
        problems: each problem found
            (:meth:`~stepmachine.operations.CallProblem.as_note`).
        replaced_by: the id of the corrected copy (repair, or skip with new ids).
    """

    action: str
    problems: list[dict[str, str]] = msgspec.field(default_factory=list)
    replaced_by: str | None = None


class InvalidCallsRepair(Record, frozen=True, tag="stepmachine.invalid_calls.repair"):
    """The notes of a corrected copy: which message it replaces and the repairs made."""

    repaired_from: str
    repairs: list[dict[str, str]] = msgspec.field(default_factory=list)


class InvalidCallsFeedback(Record, frozen=True, tag="stepmachine.invalid_calls.feedback"):
    """The notes of the feedback message of a retry."""

    feedback_for: str
    problems: list[dict[str, str]] = msgspec.field(default_factory=list)


class InvalidCallsSkipped(Record, frozen=True, tag="stepmachine.invalid_calls.skipped"):
    """The notes of a "not executed" result: the call it answers."""

    skipped: str


# -- output -----------------------------------------------------------------------------------


class OutputValue(Record, frozen=True, tag="stepmachine.output.value"):
    """A validated output, on the final message.

    Attributes:
        output: the value as JSON builtins.
        mode: the mode it was given in.
        call_id: the output call (tool mode).
    """

    output: Any
    mode: str
    call_id: str | None = None


class OutputError(Record, frozen=True, tag="stepmachine.output.error"):
    """Why an output was invalid: on the final message, or on the error result of the
    output call (then with ``call_id``)."""

    error: str
    call_id: str | None = None


class OutputAnswer(Record, frozen=True, tag="stepmachine.output.answer"):
    """The notes of a result this step gave: the accepted output call, or a skipped sibling."""

    accepted: str | None = None
    skipped: bool = False


class OutputFeedback(Record, frozen=True, tag="stepmachine.output.feedback"):
    """The notes of the feedback message asking for a valid output."""

    feedback_for: str
