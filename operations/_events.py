"""External events: wait for the outside world, and consume what it sends exactly once.

An application hands events to a session with :func:`submit_event` (a
webhook arrived, the user sent a steering message, a job finished). Each
event is persisted at once, from outside any machine, as one kernel effect:
an appended message hidden from the model and the user (role ``system``,
id ``"<namespace>:<event id>"``) whose notes hold the event, a typed record
(:class:`EventRecord`)::

    {"<namespace>": {"event": EventRecord}}

Submitting an ``event_id`` that the session already holds is ignored (the
message id is derived from it, and ``AppendMessage`` refuses a repeated id,
so even racing submitters store it once).

:class:`ExternalEvents` consumes them. When offered a cycle and events are
pending (not yet consumed, oldest first by position in the conversation,
which is submission order) and no tool call is open, it returns ``Continue``
with ONE batch that, per event in order, marks the event message consumed
(an :class:`EventConsumed` record filling the namespace beside ``"event"``)
and appends what the model should see (by default a user message
``[event <kind>] <payload>``; see ``render`` and :meth:`ExternalEvents.event_effects`).
Marking and delivering are one atomic compare-and-set batch, so a crash or a
concurrent machine can never consume an event twice, and a fresh machine
decides the same (state is the session).

Waiting. The session waits when a wait marker is set and not yet satisfied
(:func:`wait_for` builds the ``Annotate`` that sets one, a :class:`WaitMarker`
record, for any step or the application to apply; consuming an event of a
matching kind satisfies it),
or when ``wait_when(session)`` is true. Waiting with nothing pending, the
step yields with reason ``awaiting_event`` (``data``: the marker's message id
and kinds), with no effects. Otherwise it refuses.

Placement: first in the step list (before Budget, Tools and inference), so
pending events are delivered before the model is called and a waiting
session yields before anything else runs. Events are held back while tool
calls are open (a user message must not split calls from their results).

Compaction must hide consumed event messages rather than delete them: a
deleted one cannot be recognised as a duplicate if submitted again.

Cost per cycle: independent of the history and of the events consumed so
far. Each consumption batch also leaves a cursor (an :class:`EventCursor`,
key ``"cursor"`` of the last event it consumed) listing the wait markers it
left unsatisfied; the step reads the messages with notes in its namespace
(:meth:`stepmachine.HistoryIndex.noted`) newest first down to that cursor --
what was submitted, delivered or marked since -- and the markers it lists.
The index lists a message holding an unsatisfied wait marker first, whatever
its age: when the marker was set (on the latest message or on an earlier
one, before or after the last consumption), live or after the session was
loaded from a store, which keeps no order of notes. So every marker waiting
is seen, and a loaded session decides as the live one did (state is the
session). A session without a cursor is read whole once (every message with
notes in the namespace), as before.

Cancellation: consumption is a single batch; nothing to finalize.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from stepmachine import (
    Annotate,
    AppendMessage,
    ConflictError,
    Continue,
    Effect,
    EffectError,
    Message,
    Operation,
    Outcome,
    Refuse,
    Session,
    StepContext,
    Store,
    TextPart,
    Yield,
    submit,
)
from stepmachine.extend import YieldReason, note_value, read_record

from ._records import EventConsumed, EventCursor, EventDelivery, EventRecord, WaitMarker

__all__ = [
    "EventConsumed",
    "EventCursor",
    "EventDelivery",
    "EventReceipt",
    "EventRecord",
    "ExternalEvent",
    "ExternalEvents",
    "WaitMarker",
    "consumed_events",
    "pending_events",
    "submit_event",
    "wait_for",
]


class ExternalEvent(msgspec.Struct, frozen=True):
    """One event, as stored in the session.

    Attributes:
        id: the event id (the application's, or generated).
        kind: what happened (``"webhook"``, ``"message"``, ``"job_done"``...).
        payload: JSON builtins.
        submitted_at: the submitter's clock.
        message_id: the id of the hidden message that records it.
    """

    id: str
    kind: str
    payload: Any
    submitted_at: float
    message_id: str


class EventReceipt(msgspec.Struct, frozen=True):
    """What :func:`submit_event` did.

    Attributes:
        event_id: the event's id.
        accepted: ``False`` when the session already held this event id.
        revision: the session revision afterwards (or when found).
    """

    event_id: str
    accepted: bool
    revision: int


def _where(session: Session[Any], message: Message) -> str:
    return f"session {session.id!r}, message {message.id!r}"


def _events(session: Session[Any], namespace: str) -> list[tuple[ExternalEvent, bool]]:
    """Every event with whether it was consumed, in submission order.

    Reads the messages with notes in ``namespace`` only (the history index), all of them.
    """
    conversation = session.conversation
    found: list[tuple[int, ExternalEvent, bool]] = []
    for position, call_id in session.history.noted(namespace):
        if call_id is not None:
            continue
        message = conversation[position]
        where = _where(session, message)
        record = read_record(message.notes, namespace, EventRecord, key="event", where=where)
        if record is None:
            continue  # a marker or a delivered message
        consumed = read_record(message.notes, namespace, EventConsumed, where=where)
        found.append(
            (position, _event(record, message), consumed is not None and consumed.consumed)
        )
    found.sort(key=lambda item: item[0])
    return [(event, consumed) for _, event, consumed in found]


class _Recent(msgspec.Struct, frozen=True):
    """What :func:`_recent` found: the pending events and the unsatisfied wait markers."""

    pending: list[ExternalEvent]
    markers: list[tuple[str, list[str]]]  # (message id, kinds), oldest first


def _marker(session: Session[Any], message: Message, namespace: str) -> WaitMarker | None:
    """The unsatisfied wait marker on ``message``, if it holds one."""
    note = message.notes.get(namespace)
    if isinstance(note, dict) and "awaiting" not in note:
        return None  # an event or a delivered message
    marker = read_record(message.notes, namespace, WaitMarker, where=_where(session, message))
    return marker if marker is not None and not marker.satisfied_by else None


def _recent(session: Session[Any], namespace: str) -> _Recent:
    """The pending events and unsatisfied wait markers, oldest first.

    Reads the messages with notes in ``namespace`` (the history index), newest
    first, down to the latest :class:`EventCursor` (the last event the latest
    consumption consumed: every event before it is consumed), then the markers
    that cursor lists as waiting: O(what was noted since the latest
    consumption + markers waiting). A session without a cursor (never
    consumed, or stored by an earlier version) is read whole.
    """
    conversation = session.conversation
    pending: list[tuple[int, ExternalEvent]] = []
    markers: dict[str, tuple[int, list[str]]] = {}
    seen: set[str] = set()
    cursor: EventCursor | None = None
    cursor_at = -1
    for position, call_id in session.history.noted(namespace):
        if call_id is not None:
            continue
        message = conversation[position]
        if message.id in seen:
            continue  # listed again (an open wait annotated since)
        seen.add(message.id)
        where = _where(session, message)
        marker = _marker(session, message, namespace)
        if marker is not None:
            markers[message.id] = (position, marker.awaiting)
        record = read_record(message.notes, namespace, EventRecord, key="event", where=where)
        if record is None:
            continue
        consumed = read_record(message.notes, namespace, EventConsumed, where=where)
        if consumed is None or not consumed.consumed:
            pending.append((position, _event(record, message)))
        found = read_record(message.notes, namespace, EventCursor, key="cursor", where=where)
        if found is not None and position > cursor_at:
            cursor, cursor_at = found, position
        if found is not None and marker is None:
            # The latest consumption's cursor: messages with an open wait are listed
            # first whatever their age (HistoryIndex.noted), so an older cursor on one
            # of them is not where the reading stops.
            break
    if cursor is not None:
        for message_id in cursor.waiting:
            at = session.history.message_position(message_id)
            if message_id in seen or at is None:
                continue
            marker = _marker(session, conversation[at], namespace)
            if marker is not None:
                markers[message_id] = (at, marker.awaiting)
    pending.sort(key=lambda item: item[0])
    ordered = sorted(markers.items(), key=lambda item: item[1][0])
    return _Recent(
        [event for _, event in pending], [(message_id, kinds) for message_id, (_, kinds) in ordered]
    )


def _event(record: EventRecord, message: Message) -> ExternalEvent:
    return ExternalEvent(
        id=record.id,
        kind=record.kind,
        payload=record.payload,
        submitted_at=record.submitted_at,
        message_id=message.id,
    )


def pending_events(session: Session[Any], namespace: str = "events") -> list[ExternalEvent]:
    """Events submitted and not yet consumed, in submission order.

    Reads what was noted since the latest consumption (see :class:`ExternalEvents`).
    """
    return _recent(session, namespace).pending


def consumed_events(session: Session[Any], namespace: str = "events") -> list[ExternalEvent]:
    """Events already consumed, in submission order (reads every event: a query, not a
    step's per-cycle work)."""
    return [event for event, consumed in _events(session, namespace) if consumed]


def wait_for(message_id: str, *kinds: str, namespace: str = "events") -> Annotate:
    """The effect that makes the session wait for an event (of one of ``kinds``, or any).

    Apply it from a step (with its other effects) or with
    :func:`stepmachine.submit`. The marker sits on message ``message_id``;
    consuming a matching event satisfies it.
    """
    return Annotate(message_id, namespace, note_value(WaitMarker(awaiting=list(kinds))))


async def submit_event(
    store: Store,
    session_id: str,
    kind: str,
    payload: Any = None,
    *,
    event_id: str | None = None,
    namespace: str = "events",
    clock: Callable[[], float] = time.time,
    max_attempts: int = 16,
) -> EventReceipt:
    """Persist an event for the session; the next ``run()`` consumes it.

    The event is one batch (step name ``"<namespace>.submit"``), retried on
    conflicts. An ``event_id`` the session already holds is not stored again:
    the receipt says ``accepted=False``.

    Raises:
        SessionNotFoundError: no such session.
        ConflictError: still conflicting after ``max_attempts``.
        TypeError: ``payload`` is not convertible to JSON builtins.

    Cancellation: the event is stored entirely or not at all; if the
    cancellation lands after the store applied it, a retry with the same
    ``event_id`` is ignored as a duplicate.
    """
    event_id = event_id if event_id is not None else uuid.uuid4().hex
    message_id = f"{namespace}:{event_id}"
    record = EventRecord(
        id=event_id, kind=kind, payload=msgspec.to_builtins(payload), submitted_at=clock()
    )
    message = Message(
        id=message_id,
        role="system",
        parts=(TextPart(f"event {kind} {event_id}"),),
        notes={namespace: {"event": note_value(record)}},
        visible_to_model=False,
        visible_to_user=False,
    )
    for attempt in range(max_attempts):
        session = await store.load(session_id)
        if session.message(message_id) is not None:
            return EventReceipt(event_id, False, session.revision)
        try:
            after = await submit(
                store,
                session_id,
                [AppendMessage(message)],
                step=f"{namespace}.submit",
                clock=clock,
                max_attempts=1,
            )
        except (ConflictError, EffectError):
            # Someone wrote first (maybe this very event): look again.
            if attempt == max_attempts - 1:
                raise
            continue
        return EventReceipt(event_id, True, after.revision)
    raise AssertionError("unreachable")  # pragma: no cover


class ExternalEvents(Operation[Any]):
    """Delivers pending events in order, exactly once; yields while waiting.

    Args:
        wait_when: an extra predicate: the session also waits while it is true.
        render: what the model sees for an event: a string (sent as a user
            message), a full ``Message``, or ``None`` (consume silently).
            Default: ``"[event <kind>] <payload>"`` (a string payload as is,
            anything else as JSON).
        name: the step name, and the notes namespace events are submitted
            under (pass the same to :func:`submit_event`).

    Override :meth:`event_effects` for more (for example ``UpdateData``).
    """

    def __init__(
        self,
        *,
        wait_when: Callable[[Session[Any]], bool] | None = None,
        render: Callable[[ExternalEvent], str | Message | None] | None = None,
        name: str = "events",
    ) -> None:
        self._wait_when = wait_when
        self._render = render or _default_render
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def event_effects(self, ctx: StepContext[Any], event: ExternalEvent) -> list[Effect]:
        """The effects that consume ``event``: mark it, deliver it.

        The marking ``Annotate`` must stay in the list; it is what makes
        consumption exactly-once.
        """
        rendered = self._render(event)
        delivered: Message | None
        if rendered is None:
            delivered = None
        elif isinstance(rendered, Message):
            delivered = rendered
        else:
            delivered = Message(
                id=ctx.new_id(),
                role="user",
                parts=(TextPart(rendered),),
                notes={self._name: note_value(EventDelivery(event_id=event.id, kind=event.kind))},
            )
        effects: list[Effect] = [
            Annotate(
                event.message_id,
                self._name,
                note_value(
                    EventConsumed(
                        consumed=True,
                        consumed_at=ctx.runtime.clock(),
                        delivered_as=delivered.id if delivered is not None else None,
                    )
                ),
            )
        ]
        if delivered is not None:
            effects.append(AppendMessage(delivered))
        return effects

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        session = ctx.session
        recent = _recent(session, self._name)
        pending, markers = recent.pending, list(recent.markers)
        if pending and not session.history.has_open_calls:
            effects: list[Effect] = []
            for event in pending:
                effects.extend(self.event_effects(ctx, event))
                for marker in list(markers):
                    if not marker[1] or event.kind in marker[1]:
                        satisfied = WaitMarker(awaiting=marker[1], satisfied_by=event.id)
                        effects.append(Annotate(marker[0], self._name, note_value(satisfied)))
                        markers.remove(marker)
            cursor = EventCursor(waiting=[message_id for message_id, _ in markers])
            effects.append(
                Annotate(pending[-1].message_id, self._name, {"cursor": note_value(cursor)})
            )
            return Continue(effects)
        if markers:
            message_id, kinds = markers[-1]
            return Yield(
                [],
                YieldReason(
                    YieldReason.AWAITING_EVENT,
                    "waiting for an external event"
                    + (f" of kind {', '.join(kinds)}" if kinds else ""),
                    {"message_id": message_id, "kinds": kinds, "pending": len(pending)},
                ),
            )
        if self._wait_when is not None and self._wait_when(session):
            return Yield(
                [],
                YieldReason(
                    YieldReason.AWAITING_EVENT,
                    "waiting for an external event",
                    {"pending": len(pending)},
                ),
            )
        return Refuse("no pending events and not waiting")


def _default_render(event: ExternalEvent) -> str:
    payload = event.payload
    text = payload if isinstance(payload, str) else msgspec.json.encode(payload).decode()
    return f"[event {event.kind}] {text}"
