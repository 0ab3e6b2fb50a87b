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

Cost per cycle: the step reads only the messages with notes in its namespace
(:meth:`stepmachine.HistoryIndex.noted`: events, markers, delivered messages),
never the whole history.

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
    YieldReason,
    note_value,
    open_tool_calls,
    read_record,
    submit,
)

from ._records import EventConsumed, EventDelivery, EventRecord, WaitMarker

__all__ = [
    "EventConsumed",
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

    Reads the messages with notes in ``namespace`` only (the history index).
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
        event = ExternalEvent(
            id=record.id,
            kind=record.kind,
            payload=record.payload,
            submitted_at=record.submitted_at,
            message_id=message.id,
        )
        found.append((position, event, consumed is not None and consumed.consumed))
    found.sort(key=lambda item: item[0])
    return [(event, consumed) for _, event, consumed in found]


def pending_events(session: Session[Any], namespace: str = "events") -> list[ExternalEvent]:
    """Events submitted and not yet consumed, in submission order."""
    return [event for event, consumed in _events(session, namespace) if not consumed]


def consumed_events(session: Session[Any], namespace: str = "events") -> list[ExternalEvent]:
    """Events already consumed, in submission order."""
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

    def _markers(self, session: Session[Any]) -> list[tuple[str, list[str]]]:
        """Unsatisfied wait markers: (message id, kinds), oldest first.

        Reads the messages with notes in this step's namespace only.
        """
        conversation = session.conversation
        markers: list[tuple[int, str, list[str]]] = []
        for position, call_id in session.history.noted(self._name):
            if call_id is not None:
                continue
            message = conversation[position]
            note = message.notes[self._name]
            if isinstance(note, dict) and "awaiting" not in note:
                continue  # an event or a delivered message
            where = _where(session, message)
            marker = read_record(message.notes, self._name, WaitMarker, where=where)
            if marker is not None and not marker.satisfied_by:
                markers.append((position, message.id, marker.awaiting))
        markers.sort(key=lambda item: item[0])
        return [(message_id, kinds) for _, message_id, kinds in markers]

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
        pending = pending_events(session, self._name)
        markers = self._markers(session)
        if pending and not open_tool_calls(session):
            effects: list[Effect] = []
            for event in pending:
                effects.extend(self.event_effects(ctx, event))
                for marker in list(markers):
                    if not marker[1] or event.kind in marker[1]:
                        satisfied = WaitMarker(awaiting=marker[1], satisfied_by=event.id)
                        effects.append(Annotate(marker[0], self._name, note_value(satisfied)))
                        markers.remove(marker)
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
