"""Live display events for clients, while work happens.

Events are never persisted and never change state; effects do. Every
:class:`Event` carries the session id, the revision it follows and a sequence
number that restarts at 0 after every applied batch, so ``(revision, seq)``
orders the events of a session and a client that reconnects can tell what it
missed (then read the session itself for what was applied).

Emitters: :class:`NullEmitter` drops everything; :class:`StreamEmitter` is a
bounded in-memory stream (anyio memory object streams). Any object with an
``async emit(event)`` method is an :class:`Emitter`.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, TypeAlias

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

_logger = logging.getLogger("stepmachine")

__all__ = [
    "Emitter",
    "Event",
    "EventData",
    "NullEmitter",
    "ReasoningDelta",
    "RecordingEmitter",
    "StepApplied",
    "StreamEmitter",
    "TextDelta",
    "ToolArgumentsDelta",
    "ToolFinished",
    "ToolStarted",
    "Yielded",
]


class TextDelta(msgspec.Struct, frozen=True, tag_field="kind", tag="text_delta"):
    """Assistant text arrived."""

    text: str


class ReasoningDelta(msgspec.Struct, frozen=True, tag_field="kind", tag="reasoning_delta"):
    """Reasoning text arrived."""

    text: str


class ToolArgumentsDelta(msgspec.Struct, frozen=True, tag_field="kind", tag="tool_arguments_delta"):
    """Part of a tool call's argument string arrived."""

    index: int
    call_id: str | None
    name: str | None
    delta: str


class ToolStarted(msgspec.Struct, frozen=True, tag_field="kind", tag="tool_started"):
    """A tool began running."""

    call_id: str
    name: str


class ToolFinished(msgspec.Struct, frozen=True, tag_field="kind", tag="tool_finished"):
    """A tool finished (``is_error`` when it failed)."""

    call_id: str
    name: str
    is_error: bool


class StepApplied(msgspec.Struct, frozen=True, tag_field="kind", tag="step_applied"):
    """A step's batch was applied, producing ``new_revision``.

    ``status`` says what the batch was to its cycle: ``"continue"`` or
    ``"yielded"`` on the cycle's last batch (how it ended), ``"committed"`` on
    a batch of staged work after which more of the cycle may follow (a tool
    call's intent or an earlier result, a model request's reservation).
    ``effects`` is how many effects the batch held.
    """

    step: str
    new_revision: int
    status: str
    effects: int


class Yielded(msgspec.Struct, frozen=True, tag_field="kind", tag="yielded"):
    """The run returned control to the caller."""

    reason: str
    message: str = ""


EventData: TypeAlias = (
    TextDelta
    | ReasoningDelta
    | ToolArgumentsDelta
    | ToolStarted
    | ToolFinished
    | StepApplied
    | Yielded
)


class Event(msgspec.Struct, frozen=True):
    """One display event.

    Attributes:
        session_id: the session the event is about.
        revision: the session revision the event follows.
        seq: position among the events following that revision, from 0.
        data: what happened.
    """

    session_id: str
    revision: int
    seq: int
    data: EventData


class Emitter(Protocol):
    """Receives display events. Must not raise for a slow or gone client."""

    async def emit(self, event: Event) -> None:
        """Deliver ``event``; may wait (backpressure). Cancellation abandons it."""
        ...


class NullEmitter:
    """Drops every event."""

    async def emit(self, event: Event) -> None:
        """Do nothing."""


class RecordingEmitter:
    """Keeps every event in ``events``; for tests and debugging."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    async def emit(self, event: Event) -> None:
        """Append ``event`` to ``events``."""
        self.events.append(event)

    def of_type(self, kind: type[Any]) -> list[Any]:
        """The ``data`` of every recorded event of this type, in order."""
        return [e.data for e in self.events if isinstance(e.data, kind)]


class StreamEmitter:
    """A bounded in-memory stream of events.

    ``emit`` waits while the buffer is full (backpressure: a slow client slows
    the run rather than losing events). Once the receiving side is closed,
    events are dropped silently: a gone client never fails a run.

    Use ``receive`` (an anyio ``MemoryObjectReceiveStream``) to read events, and
    ``aclose`` when the producer is done so readers see the end of the stream.
    """

    def __init__(self, max_buffer: int = 256) -> None:
        send, receive = anyio.create_memory_object_stream[Event](max_buffer)
        self._send: MemoryObjectSendStream[Event] = send
        self.receive: MemoryObjectReceiveStream[Event] = receive

    async def emit(self, event: Event) -> None:
        """Send ``event``, waiting for room; drop it if the reader is gone."""
        try:
            await self._send.send(event)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return

    async def aclose(self) -> None:
        """Close the sending side; readers finish after the buffered events."""
        await self._send.aclose()


class EventSink:
    """Stamps events for one session: session id, revision, sequence number.

    The machine owns one per run and moves its revision forward after every
    applied batch; steps call :meth:`emit` with bare event data.
    """

    def __init__(self, emitter: Emitter, session_id: str, revision: int) -> None:
        self._emitter = emitter
        self._drops = type(emitter) is NullEmitter  # nobody sees the events: build none
        self.session_id = session_id
        self.revision = revision
        self._seq = 0
        self._warned = False

    @property
    def drops(self) -> bool:
        """Whether nobody sees the events (a :class:`NullEmitter`): a caller may call
        :meth:`skip` instead of building one for :meth:`emit`."""
        return self._drops

    def skip(self) -> None:
        """What :meth:`emit` does with an event when :attr:`drops`: the sequence advances."""
        self._seq += 1

    def follow(self, revision: int) -> None:
        """Events from now on follow ``revision``; the sequence restarts at 0."""
        if revision != self.revision:
            self.revision = revision
            self._seq = 0

    async def emit(self, data: EventData) -> None:
        """Wrap ``data`` in an :class:`Event` and deliver it.

        An emitter that raises is logged (once per sink) and ignored: events are
        for display, and a broken client must never fail or change a run.
        Cancellation propagates. With a :class:`NullEmitter` no event is built
        (the sequence number still advances).
        """
        if self._drops:
            self._seq += 1
            return
        event = Event(session_id=self.session_id, revision=self.revision, seq=self._seq, data=data)
        self._seq += 1
        try:
            await self._emitter.emit(event)
        except Exception:
            if not self._warned:
                self._warned = True
                _logger.warning(
                    "emitter %r raised; its events for session %r are dropped",
                    self._emitter,
                    self.session_id,
                    exc_info=True,
                )
