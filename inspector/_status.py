"""What a stored session is waiting for, read from the session alone.

:func:`session_status` looks only at the stored session (no step list, no
configuration), at what the built-in operations record, in this order:

1. ``awaiting approval``: an open tool call carries an approval request and
   no decision (the :class:`~stepmachine.operations.Approval` step noted it
   when it yielded);
2. ``outcome unknown``: an open call has a journal intent and no result (a
   crash while it ran, or a run in progress right now), and no operator has
   allowed that attempt to run again; an operator decides with
   ``resolve-unknown`` (``--rerun`` leaves the call open for the next run, and the
   session reads ``idle``). When the caller knows which calls are running right
   now (``running``: the live view learns it from a run in its process, whose
   lease is held, through :class:`~stepmachine.inspector.LiveHub`), a session
   whose every such call is running reads ``running`` instead: a fresh intent
   under a held lease is work in progress, not an outcome to decide;
3. ``budget exhausted``: the last message the model sees carries the
   budget's record of a refusal (tool calls refused, or a model call it did not
   make);
4. ``awaiting event``: a wait marker is set and not satisfied, and no event
   it waits for has been submitted;
5. ``done``: the last message the model sees is the assistant's, with no
   tool call left open, and no submitted event is waiting for delivery;
6. ``idle``: anything else (a user message, tool results or a submitted event
   waiting for the next ``run()``, an empty session).

It is a reading for people, not a decision: the machine decides from its
steps. An approval policy that needed no request, for instance, leaves
nothing to read, and such a session reads ``idle``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Final

from stepmachine import Session
from stepmachine.extend import TAG_FIELD

from ._records import BUDGET, CONSUMED, DECISION, EVENT, JOURNAL, REQUEST, WAIT, find, records_in

__all__ = ["RUNNING", "STATUSES", "outcome_unknown", "session_status"]

AWAITING_APPROVAL: Final = "awaiting approval"
OUTCOME_UNKNOWN: Final = "outcome unknown"
BUDGET_EXHAUSTED: Final = "budget exhausted"
AWAITING_EVENT: Final = "awaiting event"
DONE: Final = "done"
IDLE: Final = "idle"
STATUSES: Final = (AWAITING_APPROVAL, OUTCOME_UNKNOWN, BUDGET_EXHAUSTED, AWAITING_EVENT, DONE, IDLE)
"""Every status :func:`session_status` reads from a stored session alone, in the order it
checks them."""
RUNNING: Final = "running"
"""The status of a session whose open intents are all running now (only with ``running``)."""


def outcome_unknown(journal: dict[str, Any] | None) -> bool:
    """Whether a call's journal record (as stored) leaves its outcome for an operator:
    an intent, and no re-run allowed for that attempt."""
    if journal is None or not journal.get("intent"):
        return False
    rerun = journal.get("rerun_approved") and journal.get("rerun_attempt") == journal.get("attempt")
    return not rerun


def _awaits_approval(notes: dict[str, Any]) -> bool:
    return find(notes, REQUEST) is not None and find(notes, DECISION) is None


def session_status(session: Session[Any], *, running: Collection[str] = ()) -> str:
    """The status of ``session``: one of :data:`STATUSES` (see the module docstring), or
    :data:`RUNNING` when every open call with an intent is in ``running`` (call ids
    known to be running now)."""
    open_calls = session.history.open_calls()
    if any(_awaits_approval(call.notes) for call in open_calls):
        return AWAITING_APPROVAL
    unknown = [c for c in open_calls if outcome_unknown(find(c.notes, JOURNAL))]
    if unknown:
        if all(call.call_id in running for call in unknown):
            return RUNNING
        return OUTCOME_UNKNOWN
    last = next((m for m in reversed(session.conversation) if m.visible_to_model), None)
    if last is not None and find(last.notes, BUDGET) is not None:
        return BUDGET_EXHAUSTED
    pending = _pending_event_kinds(session)
    for message in session.conversation:
        for _, _, record in records_in(message.notes):
            if record.get("record") == WAIT and not record.get("satisfied_by"):
                awaiting = {str(kind) for kind in record.get("awaiting") or []}
                if pending and (not awaiting or awaiting & pending):
                    return IDLE  # the next run delivers it
                return AWAITING_EVENT
    if last is not None and last.role == "assistant" and not open_calls and not pending:
        return DONE
    return IDLE


def _pending_event_kinds(session: Session[Any]) -> set[str]:
    """The kinds of the events submitted (``submit-event``) and not yet delivered.

    An event is stored as ``notes[namespace]["event"]``; its delivery marks the
    namespace itself with a ``consumed`` record.
    """
    kinds: set[str] = set()
    for message in session.conversation:
        for value in message.notes.values():
            if not isinstance(value, dict):
                continue
            event = value.get("event")
            if not isinstance(event, dict) or event.get(TAG_FIELD) != EVENT:
                continue
            if not (value.get(TAG_FIELD) == CONSUMED and value.get("consumed")):
                kinds.add(str(event.get("kind")))
    return kinds
