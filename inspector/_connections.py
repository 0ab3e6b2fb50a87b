"""The live view's connections: a deadline for each request's headers, a cap on their number.

uvicorn's HTTP/1.1 protocol (h11) closes a kept-alive connection that stays
silent after a response, but a connection that never completes a request
(opened and left, or sending its headers a byte at a time) is kept for ever:
enough of them use up the process's file descriptors and the server answers
nothing. :func:`guarded_protocol` makes a uvicorn protocol class that

- gives every connection ``header_timeout`` seconds, from when it opens or
  from the end of its last response, to complete the headers of its next
  request, and closes it when they run out (a trickle of bytes does not
  extend the deadline);
- keeps at most ``max_connections`` open: when a new connection goes over,
  the connection that has waited longest for a request (idle or half-open)
  is closed to make room, and when every open connection is busy (a request
  being answered, an event stream) the new one is closed at once. So idle
  connections never keep a real request out, and the file descriptors in
  use stay bounded.

An open event stream is a request being answered: neither rule ends it
(its client going away does, and the server's shutdown).
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["DEFAULT_HEADER_TIMEOUT", "DEFAULT_MAX_CONNECTIONS", "guarded_protocol"]

DEFAULT_HEADER_TIMEOUT = 10.0
"""Seconds a connection has to send a request's headers."""
DEFAULT_MAX_CONNECTIONS = 100
"""Connections open at once, at most."""


class _GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection cap (module docstring)."""

    header_timeout: ClassVar[float] = DEFAULT_HEADER_TIMEOUT
    max_connections: ClassVar[int] = DEFAULT_MAX_CONNECTIONS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_since: float | None = None
        self._waited_cycle: object = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()
        if len(self.connections) > self.max_connections:
            self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._waiting_since is not None and self.cycle is not self._waited_cycle:
            self._disarm()  # a request's headers are complete: it is being answered

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            self._arm()  # waiting for the next request (none pipelined)

    def _arm(self) -> None:
        self._disarm()
        self._waiting_since = self.loop.time()
        self._waited_cycle = self.cycle
        self._deadline = self.loop.call_later(self.header_timeout, self._close)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._waiting_since = None

    def _close(self) -> None:
        self._deadline = None
        self._waiting_since = None
        if not self.transport.is_closing():
            self.transport.close()

    def _make_room(self) -> None:
        waiting = [
            other
            for other in self.connections
            if isinstance(other, _GuardedH11Protocol)
            and other is not self
            and other._waiting_since is not None
        ]
        if not waiting:
            self._close()  # everyone open is being answered: refuse the newcomer
            return
        oldest = min(waiting, key=lambda other: other._waiting_since or 0.0)
        oldest._close()


def guarded_protocol(
    *,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> type[H11Protocol]:
    """A uvicorn ``http`` protocol class with these limits (see the module docstring).

    Raises:
        ValueError: ``header_timeout`` is not a number of seconds > 0, or
            ``max_connections`` is below 1.
        TypeError: ``max_connections`` is not an integer.
    """
    if not header_timeout > 0:
        raise ValueError(f"header_timeout must be a number of seconds > 0, not {header_timeout}")
    if isinstance(max_connections, bool) or not isinstance(max_connections, int):
        raise TypeError(f"max_connections must be an integer >= 1, not {max_connections!r}")
    if max_connections < 1:
        raise ValueError(f"max_connections must be an integer >= 1, not {max_connections}")
    return type(
        "GuardedH11Protocol",
        (_GuardedH11Protocol,),
        {"header_timeout": float(header_timeout), "max_connections": max_connections},
    )
