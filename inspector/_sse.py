"""A session's audit log as a resumable stream of server-sent events.

:func:`session_events` yields the text of an ``text/event-stream`` response
(no web framework needed; :mod:`._web` serves it). It opens with
``retry: 1000`` (the reconnection delay a browser should use), then:

- ``batch``: one applied batch, ``id: <revision>.0``; ``data`` is the
  :func:`~stepmachine.inspector.batch_view` of the batch plus ``"html"``, its
  timeline entry (``render_batch``, escaped there);
- ``status``: ``data: {"revision", "status"}``, the session's
  :func:`~stepmachine.inspector.session_status` at ``revision``; sent once
  after the catch-up, after every poll that found new batches, and when the
  calls the live source says are running change (``running``: a tool of an
  open call with an intent is running in this process, not an outcome
  unknown). It carries no ``id`` (so it never moves a client's position);
- ``head`` (with ``render_head``): ``data: {"revision", "header",
  "conversation"}``, the page's header (counters included) and conversation
  at ``revision`` as HTML (escaped there), sent after the ``status`` of every
  poll that sent batches (not per batch: a catch-up of many batches sends one);
  no ``id`` either. It costs one rendering of the conversation per such poll;
- ``live`` (only with a :class:`~stepmachine.inspector.LiveHub`): a display
  event of a run in this process, ``id: <revision>.<seq + 1>`` where
  ``revision`` and ``seq`` are the :class:`~stepmachine.Event`'s (seq 0 of
  the stream's ids is the batch); ``data`` is the event's data as JSON (its
  ``"kind"``: ``text_delta``, ``tool_started``, ...) plus ``"revision"`` and
  ``"seq"``;
- ``reset``: ``data: {"revision"}``, sent (after ``status``) when the
  client's cursor is beyond the session's revision: the session it showed is
  gone (deleted and recreated, or the store restored from a backup), so it
  must start over from revision 0; the stream ends after it (the page reloads);
- ``failure``: ``data: {"message"}``, stored data that does not decode; the
  stream ends after it (not ``error``: a browser's ``EventSource`` would take
  that for a lost connection and reconnect to the same records);
- a ``: keepalive`` comment after ``keepalive`` seconds without an event.

Resuming: a client says where it is with a cursor ``(revision, seq)`` (the
last ``id`` it saw). The stream sends every batch with a revision above the
cursor's, read from the store, in order, then polls the store every
``poll_interval`` seconds and sends new batches as they land. So after a
reconnect nothing is missed and nothing is sent twice. Live events are sent
only for the revision the client has reached (after that revision's batch),
only those after its ``seq``, and before the next batch when the stream
still has them; a client that has moved past their revision does not get
them (the batch they led to holds the truth).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, Final, Protocol

import anyio
import msgspec

from stepmachine import (
    Effect,
    Event,
    Message,
    Session,
    SessionNotFoundError,
    Store,
    StoreClosedError,
    StoredDataError,
)
from stepmachine.extend import Batch

from ._status import session_status
from ._view import History, batch_view, head_view

__all__ = ["Cursor", "LiveSource", "parse_cursor", "session_events", "sse"]

Cursor = tuple[int, int]
"""A client's position: ``(revision, seq)``; seq 0 is the batch of that revision."""

_MAX_CURSOR: Final = 40


class LiveSource(Protocol):
    """Where live display events come from (:class:`~stepmachine.inspector.LiveHub`)."""

    def events_after(self, session_id: str, cursor: Cursor) -> list[Event]:
        """The buffered events of ``session_id`` following ``cursor[0]`` with ids after it."""
        ...

    async def wait(self, session_id: str) -> None:
        """Return when a new event of ``session_id`` arrives (cancel to stop waiting)."""
        ...


def parse_cursor(last_event_id: str | None, after: str | None, seq: str | None) -> Cursor:
    """The cursor a request names: ``Last-Event-ID`` first, then ``?after=REV&seq=N``.

    ``Last-Event-ID`` is ``REV.SEQ`` (or ``REV``); a browser's ``EventSource``
    sends it on every reconnect, with the URL it first opened, so it wins over
    the query. With neither, the cursor is ``(0, 0)``: every batch.

    Raises:
        ValueError: a value is not a non-negative integer (or ``REV.SEQ``).
    """

    def number(text: str, what: str) -> int:
        if len(text) > _MAX_CURSOR or not text.isascii() or not text.isdigit():
            raise ValueError(f"{what} must be a non-negative integer, not {text[:_MAX_CURSOR]!r}")
        return int(text)

    if last_event_id:
        revision, _, position = last_event_id.partition(".")
        return number(revision, "Last-Event-ID"), number(position or "0", "Last-Event-ID")
    return number(after or "0", "after"), number(seq or "0", "seq")


def sse(
    *,
    event: str | None = None,
    data: Any = None,
    event_id: str | None = None,
    comment: str | None = None,
) -> str:
    """One server-sent event (``data`` as one line of JSON), or a comment line."""
    if comment is not None:
        return f": {comment}\n\n"
    lines = [f"id: {event_id}"] if event_id is not None else []
    if event is not None:
        lines.append(f"event: {event}")
    lines.append("data: " + json.dumps(data, separators=(",", ":")))
    return "\n".join(lines) + "\n\n"


class _Views:
    """Batch views in log order, with what ``batch_view`` needs from the batches before."""

    def __init__(self, created: Sequence[Message]) -> None:
        self.revision = 0
        self._previous: float | None = None
        self._history = History(created)

    @property
    def history(self) -> History:
        """What the batches viewed so far did (for :func:`~._view.head_view`)."""
        return self._history

    def view(self, batch: Batch[Effect]) -> dict[str, Any]:
        view = batch_view(batch, previous=self._previous, history=self._history)
        self._previous = batch.timestamp
        self.revision = batch.revision
        return view


async def session_events(
    store: Store,
    session_id: str,
    cursor: Cursor,
    *,
    render_batch: Callable[[dict[str, Any]], str],
    poll_interval: float = 0.25,
    keepalive: float = 15.0,
    retry_ms: int | None = 1000,
    live: LiveSource | None = None,
    closing: Callable[[], bool] = lambda: False,
    load: Callable[[str], Awaitable[Session[Any]]] | None = None,
    render_head: Callable[[dict[str, Any]], dict[str, str]] | None = None,
) -> AsyncGenerator[str, None]:
    """The event stream of ``session_id`` for a client at ``cursor`` (see the module docstring).

    Runs until the client goes away (the caller cancels it), ``closing()``
    turns true (checked every poll), the session is deleted, or the store is
    closed. Only reads the store. The first chunk (``retry: retry_ms``) is
    yielded at once; close the generator (``aclose``) when done with it.

    Raises:
        SessionNotFoundError, InvalidSessionIdError: before the first chunk;
            the caller answers 404/400 instead of a stream.

    Cancellation: stops at the next await; a store read in progress finishes
    first (the stores shield their transactions).

    Reading costs: the catch-up reads the whole log once (like the timeline
    page); every poll after that reads the session's head, through ``load``
    when given (the live view passes :class:`~._heads.SharedHeads`, so every
    stream of one session shares one read per poll), and the new batches when
    there are any.
    """
    poll = store.load if load is None else load
    session = await store.load(session_id)
    views = _Views((await store.load_at(session_id, 0)).conversation)
    after, position = cursor
    yield f"retry: {retry_ms}\n\n" if retry_ms is not None else ": open\n\n"
    quiet_since = anyio.current_time()
    first = True
    shown: tuple[int, str] | None = None  # the (revision, status) last sent

    def status_now() -> str:
        running = getattr(live, "running_calls", None)
        return session_status(session, running=running(session_id) if running else ())

    try:
        while True:
            sent = False
            if live is not None and after == views.revision:
                # The deltas that led to the next batch go before it.
                for chunk, reached in _live_events(live, session_id, after, position):
                    yield chunk
                    position = reached
                    sent = True
            if first or session.revision > views.revision:
                first = False
                batches_sent = False
                for batch in await store.batches(session_id, after=views.revision):
                    if batch.revision > session.revision:
                        break
                    view = views.view(batch)
                    if batch.revision > after:
                        after, position = batch.revision, 0
                        payload = {**view, "html": render_batch(view)}
                        yield sse(event="batch", event_id=f"{after}.0", data=payload)
                        sent = batches_sent = True
                status_text = status_now()
                shown = (session.revision, status_text)
                status = {"revision": session.revision, "status": status_text}
                yield sse(event="status", data=status)
                sent = True
                if batches_sent and render_head is not None and after <= session.revision:
                    head = head_view(session, views.history, status=status_text)
                    parts = render_head(head)
                    yield sse(event="head", data={"revision": session.revision, **parts})
                if after > session.revision:
                    # The client saw revisions this session does not have (it was
                    # recreated, or the store restored from a backup): what it shows
                    # is not this session's history. Say so and end; it starts over.
                    yield sse(event="reset", data={"revision": session.revision})
                    return
            if live is not None and after == views.revision:
                for chunk, reached in _live_events(live, session_id, after, position):
                    yield chunk
                    position = reached
                    sent = True
                status_text = status_now()
                if (
                    shown is not None
                    and shown != (session.revision, status_text)
                    and (await store.load(session_id)).revision == session.revision
                ):
                    # A tool started (running is not an outcome unknown), or the run
                    # yielded; when the session moved on, its batches and status come next.
                    shown = (session.revision, status_text)
                    status = {"revision": session.revision, "status": status_text}
                    yield sse(event="status", data=status)
                    sent = True
            now = anyio.current_time()
            if sent:
                quiet_since = now
            elif now - quiet_since >= keepalive:
                yield sse(comment="keepalive")
                quiet_since = now
            if closing():
                return
            if live is None:
                await anyio.sleep(poll_interval)
            else:
                with anyio.move_on_after(poll_interval):
                    await live.wait(session_id)
            session = await poll(session_id)
    except SessionNotFoundError:
        return  # deleted while watched: the reconnect gets a 404
    except StoreClosedError:
        return  # the application closed its store: it is shutting down
    except StoredDataError as exc:
        # Not "error": EventSource also fires its onerror (a lost connection) for that name.
        yield sse(event="failure", data={"message": str(exc)})


def _live_events(
    live: LiveSource, session_id: str, revision: int, position: int
) -> list[tuple[str, int]]:
    """The ``live`` events after ``(revision, position)``, each with the position it reaches."""
    chunks = []
    for event in live.events_after(session_id, (revision, position)):
        position = event.seq + 1
        payload = {"revision": event.revision, "seq": event.seq, **_builtins(event.data)}
        chunk = sse(event="live", event_id=f"{revision}.{position}", data=payload)
        chunks.append((chunk, position))
    return chunks


def _builtins(value: Any) -> dict[str, Any]:
    data = msgspec.to_builtins(value)
    return data if isinstance(data, dict) else {"value": data}
