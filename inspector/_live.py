"""In-process live deltas for the live view: an emitter the web app reads from.

The store only learns of a run's work when a batch is applied; text deltas,
tool starts and finishes exist only as display events
(:class:`~stepmachine.Event`). An application that serves the live view in
the process where its machine runs can pass a :class:`LiveHub` as the run's
emitter and the same hub to :func:`~stepmachine.inspector.create_app`: the
event stream then also carries ``live`` events.

The hub never waits and never raises: it keeps, per session, the events
following the newest two revisions it has seen (so a stream still sending
the deltas that led to a batch gets them all; up to ``max_events``, oldest
dropped first) and wakes the streams waiting on that session. Display
events are for display: a client that misses some (a full buffer, a
reconnect after the next batch) still gets every batch from the store.
"""

from __future__ import annotations

from collections import deque

import anyio

from stepmachine import Event, ToolStarted, Yielded

from ._sse import Cursor

__all__ = ["LiveHub"]


class _Buffer:
    def __init__(self, max_events: int) -> None:
        self.revision = -1
        self.events: deque[Event] = deque(maxlen=max_events)
        self.arrived = anyio.Event()
        self.started: dict[str, None] = {}  # call ids, oldest first (ordered, bounded)


class LiveHub:
    """An :class:`~stepmachine.Emitter` that buffers a run's display events for the live view.

    Use one hub per process, for every run whose events should stream:
    ``await machine.run(runtime, session_id, emitter=hub)``, and
    ``create_app(store, live=hub)``. Works on asyncio and trio (the hub and
    the app must run in the same event loop).
    """

    def __init__(self, max_events: int = 10_000) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be at least 1, got {max_events}")
        self._max_events = max_events
        self._buffers: dict[str, _Buffer] = {}

    def _buffer(self, session_id: str) -> _Buffer:
        buffer = self._buffers.get(session_id)
        if buffer is None:
            buffer = self._buffers[session_id] = _Buffer(self._max_events)
        return buffer

    async def emit(self, event: Event) -> None:
        """Keep ``event`` and wake the streams of its session; never waits, never raises.

        An event following a newer revision drops the buffered events older
        than the revision before it; an event that old is dropped itself.
        """
        buffer = self._buffer(event.session_id)
        if isinstance(event.data, ToolStarted):
            buffer.started[event.data.call_id] = None
            if len(buffer.started) > self._max_events:
                del buffer.started[next(iter(buffer.started))]
        elif isinstance(event.data, Yielded):
            buffer.started.clear()  # the run returned: nothing of it runs any more
        if event.revision < buffer.revision - 1:
            return
        if event.revision > buffer.revision:
            buffer.revision = event.revision
            kept = [e for e in buffer.events if e.revision >= event.revision - 1]
            buffer.events.clear()
            buffer.events.extend(kept)
        buffer.events.append(event)
        arrived, buffer.arrived = buffer.arrived, anyio.Event()
        arrived.set()

    def events_after(self, session_id: str, cursor: Cursor) -> list[Event]:
        """The buffered events following revision ``cursor[0]`` whose stream id is after ``cursor``.

        An event's stream id is ``(revision, seq + 1)``: seq 0 is the batch.
        """
        buffer = self._buffers.get(session_id)
        if buffer is None:
            return []
        revision, position = cursor
        return [e for e in buffer.events if e.revision == revision and e.seq + 1 > position]

    def running_calls(self, session_id: str) -> frozenset[str]:
        """The call ids of ``session_id`` whose tool a run in this process has started.

        Kept from each ``tool_started`` event until the run yields (``yielded``),
        whatever the event buffer drops (at most ``max_events`` ids). A run in
        this process holds the session's lease and writes each started call's
        result itself (a finished tool's result lands with the next batch; a
        cancelled run's finalize answers "interrupted"), so while such a call is
        open it is running, not an outcome for an operator. A run that ends with
        an exception emits no ``yielded``: its calls read running until the next
        run in this process yields.
        """
        buffer = self._buffers.get(session_id)
        return frozenset() if buffer is None else frozenset(buffer.started)

    async def wait(self, session_id: str) -> None:
        """Return at the next event of ``session_id``. Cancellation just stops the wait."""
        await self._buffer(session_id).arrived.wait()
