"""One store read per session per poll, however many clients watch it.

Every open event stream polls its session's head (``store.load``) every
``poll_interval``; with many clients on one session that was one load per
client per poll. :class:`SharedHeads` serves them all from one load: a load
younger than ``interval`` is handed out again, and callers that arrive while
a load is in flight wait for it instead of starting their own.

A stream may so see a session up to ``interval`` older than a load of its own
would have given; it only reads the head to know whether new batches exist
(the batches themselves come from the store, in order), so a batch arrives at
most one interval later, and none is missed or repeated.
"""

from __future__ import annotations

from typing import Any, Final

import anyio

from stepmachine import Session, Store

__all__ = ["SharedHeads"]

_KEEP: Final = 256
"""Cached heads kept at most (the oldest are dropped first)."""


class SharedHeads:
    """Session heads loaded from ``store`` at most once per ``interval`` seconds each.

    Args:
        store: the store to read.
        interval: how long a loaded head is handed out again (the streams'
            poll interval).
    """

    def __init__(self, store: Store, interval: float) -> None:
        self._store = store
        self._interval = interval
        self._fresh: dict[str, tuple[float, Session[Any]]] = {}
        self._loading: dict[str, anyio.Event] = {}

    async def load(self, session_id: str) -> Session[Any]:
        """The head of ``session_id``: shared if loaded less than ``interval`` ago.

        Raises:
            Whatever ``store.load`` raises (each caller gets its own error: a
            failed load is not shared, the next caller tries again).

        Cancellation: a caller cancelled while waiting for another's load just
        stops waiting; one cancelled while loading lets the waiters retry.
        """
        while True:
            cached = self._fresh.get(session_id)
            if cached is not None and anyio.current_time() - cached[0] < self._interval:
                return cached[1]
            pending = self._loading.get(session_id)
            if pending is None:
                break
            await pending.wait()
        done = anyio.Event()
        self._loading[session_id] = done
        try:
            session = await self._store.load(session_id)
            self._fresh.pop(session_id, None)
            self._fresh[session_id] = (anyio.current_time(), session)
            while len(self._fresh) > _KEEP:
                del self._fresh[next(iter(self._fresh))]
            return session
        finally:
            del self._loading[session_id]
            done.set()
