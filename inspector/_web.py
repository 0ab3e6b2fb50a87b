"""The live view: a store's sessions in a browser, updated as runs proceed (extra ``web``).

:func:`create_app` is a Starlette application over an open store; it only
reads. :func:`serve` opens a store by URL read-only and serves the app with
uvicorn (what ``stepmachine serve`` runs). The routes:

- ``GET /``: the sessions (id, revision, status, last activity), linked;
- ``GET /sessions/{id}``: the session's timeline (``render_page``), with a
  small inline script that follows ``/sessions/{id}/events``;
- ``GET /sessions/{id}/events``: the resumable event stream
  (``text/event-stream``, see :mod:`._sse` for the events and the resume
  rules);
- ``GET /api/sessions``: ``[{"id", "revision", "status", "last_activity"}]``;
- ``GET /api/sessions/{id}``: the :func:`~stepmachine.inspector.session_view`.

Every route only reads. Requests are answered only when addressed to loopback
(``Host``: ``localhost``, ``127.0.0.0/8``, ``[::1]``) or to a host the app
was given (``allowed_hosts``), so a DNS-rebinding page cannot read them (421
otherwise: :mod:`._hosts`); :func:`serve` also bounds how long a connection
may take to send a request and how many are open (:mod:`._connections`).

An unknown session is a 404 and an id no store accepts a 400; stored data
that does not decode is a 500 whose page (or JSON) says why; the messages are
escaped and no traceback is shown. The pages load nothing from the network.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Iterable
from types import FrameType
from typing import Any, Final

import anyio

from stepmachine import (
    Codec,
    InvalidSessionIdError,
    SessionNotFoundError,
    Store,
    StoredDataError,
)

from ._heads import SharedHeads
from ._live_page import live_script
from ._open import list_entries, open_store
from ._sse import LiveSource, parse_cursor, session_events
from ._status import session_status
from ._view import load_view
from ._web_extra import web_extra_message

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.routing import Route
    from starlette.types import Receive, Scope, Send
except ImportError as exc:  # pragma: no cover - the extra is installed where tests run
    raise ImportError(web_extra_message(exc)) from exc

from ._connections import DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_CONNECTIONS, guarded_protocol
from ._hosts import HostGuard, normalise_allowed
from ._html import page_policy, render_batch, render_head, render_page
from ._html_parts import esc

__all__ = ["Streams", "create_app", "serve"]

_STYLE = (
    "body{font:15px/1.45 system-ui,sans-serif;margin:2rem;color:#222}"
    "table{border-collapse:collapse}td,th{padding:.3rem .8rem;text-align:left;"
    "border-bottom:1px solid #ddd}code{font-size:90%}"
)


class Streams:
    """The app's open event streams; :meth:`close` ends them all at their next poll.

    ``create_app`` puts one in ``app.state.streams``; :func:`serve` closes it
    when uvicorn starts shutting down, so open streams do not hold it up.
    """

    def __init__(self) -> None:
        self.closing = False

    def close(self) -> None:
        """Ask every stream to end (within one poll interval)."""
        self.closing = True


class _EventStream(StreamingResponse):
    """A streaming response that ends quietly when the client goes away.

    Whatever the server's ASGI version, it listens for ``http.disconnect``
    (so a gone client's stream stops at once, not at its next keepalive) and
    takes a failed send (``OSError``) as a disconnect too. The event
    generator is closed (``aclose``) before the call returns, whichever way
    the stream ended, so nothing is left for the garbage collector.
    """

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-send
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()


_PAGE_HEADERS: Final = {
    # The list and error pages have no script and fetch nothing.
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def _page(title: str, body: str, status_code: int = 200) -> HTMLResponse:
    document = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(title)}</title><style>{_STYLE}</style></head>"
        f"<body>{body}</body></html>"
    )
    return HTMLResponse(document, status_code=status_code, headers=_PAGE_HEADERS)


def _error(request: Request, status_code: int, title: str, message: str) -> Response:
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": title, "message": message}, status_code=status_code)
    return _page(
        title,
        f'<h1>{esc(title)}</h1><p>{esc(message)}</p><p><a href="/">all sessions</a></p>',
        status_code,
    )


def _when(timestamp: float | None) -> str:
    if timestamp is None:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(timestamp))


def create_app(
    store: Store,
    *,
    poll_interval: float = 0.25,
    keepalive: float = 15.0,
    retry_ms: int = 1000,
    live: LiveSource | None = None,
    allowed_hosts: Iterable[str] = (),
) -> Starlette:
    """The live view of ``store`` as an ASGI application (see the module docstring).

    Args:
        store: an open store; the app only reads it and never closes it (the
            caller owns it: close it after the server stops).
        poll_interval: seconds between two reads of a watched session (stores
            do not notify).
        keepalive: seconds of silence after which a stream sends a comment.
        retry_ms: the reconnection delay the streams ask browsers to use.
        live: a :class:`~stepmachine.inspector.LiveHub` fed by runs in this
            process, for ``live`` events; without it the streams carry what
            the store holds.
        allowed_hosts: host names (or addresses) requests may be addressed to
            besides loopback; any other ``Host`` is refused with 421 (so a
            DNS-rebinding page cannot read the sessions), and an ``Origin``
            of another host with 403.

    Returns:
        A Starlette app; ``app.state.streams`` is its :class:`Streams`.

    Raises:
        ValueError: ``poll_interval`` is not > 0, or an ``allowed_hosts``
            entry is not a host name.
    """
    if not poll_interval > 0:
        raise ValueError(f"poll_interval must be a number of seconds > 0, not {poll_interval}")
    allowed = normalise_allowed(allowed_hosts)
    streams = Streams()
    heads = SharedHeads(store, poll_interval)  # one head read per session per poll

    async def summary(session_id: str) -> dict[str, Any]:
        session = await store.load(session_id)
        last = []
        if session.revision:
            last = await store.batches(session_id, after=session.revision - 1)
        return {
            "id": session_id,
            "revision": session.revision,
            "status": session_status(session),
            "last_activity": last[-1].timestamp if last else None,
        }

    async def summaries() -> list[dict[str, Any]]:
        rows = []
        for session_id, damage in await list_entries(store):
            error = damage
            if damage is None:
                try:
                    rows.append(await summary(session_id))
                    continue
                except SessionNotFoundError:
                    continue  # deleted meanwhile
                except StoredDataError as exc:
                    error = str(exc)
            rows.append({"id": session_id, "revision": None, "status": None,
                         "last_activity": None, "error": error})  # fmt: skip
        return rows

    async def index(request: Request) -> Response:
        rows = []
        for row in await summaries():
            quoted = esc(row["id"])
            status = row["status"] if row["status"] is not None else f"unreadable: {row['error']}"
            rows.append(
                f'<tr><td><a href="/sessions/{quoted}"><code>{quoted}</code></a></td>'
                f"<td>{'' if row['revision'] is None else row['revision']}</td>"
                f"<td>{esc(status)}</td><td>{_when(row['last_activity'])}</td></tr>"
            )
        table = (
            "<table><thead><tr><th>session</th><th>revision</th><th>status</th>"
            f"<th>last activity</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
            if rows
            else "<p>No sessions in this store.</p>"
        )
        return _page("stepmachine sessions", f"<h1>Sessions</h1>{table}")

    async def view_of(session_id: str) -> dict[str, Any]:
        return await load_view(store, session_id)

    async def session_page(request: Request) -> Response:
        session_id = request.path_params["session_id"]
        view = await view_of(session_id)
        script = live_script(f"/sessions/{session_id}/events", view["revision"])
        # The page's meta policy, sent as a header as well (a header is not lost
        # to markup before the meta element, and tools that read headers see it).
        headers = {**_PAGE_HEADERS, "Content-Security-Policy": page_policy(script)}
        return HTMLResponse(render_page(view, live_script=script), headers=headers)

    async def events(request: Request) -> Response:
        session_id = request.path_params["session_id"]
        try:
            cursor = parse_cursor(
                request.headers.get("last-event-id"),
                request.query_params.get("after"),
                request.query_params.get("seq"),
            )
        except ValueError as exc:
            return _error(request, 400, "Bad request", str(exc))
        await store.load(session_id)  # 404 / 400 now, not inside the stream

        stream = session_events(
            store,
            session_id,
            cursor,
            render_batch=render_batch,
            poll_interval=poll_interval,
            keepalive=keepalive,
            retry_ms=retry_ms,
            live=live,
            closing=lambda: streams.closing,
            load=heads.load,
            render_head=render_head,
        )
        return _EventStream(stream)

    async def api_sessions(request: Request) -> Response:
        return JSONResponse(await summaries())

    async def api_session(request: Request) -> Response:
        return JSONResponse(await view_of(request.path_params["session_id"]))

    def handler(status_code: int, title: str) -> Callable[[Request, Exception], Response]:
        def handle(request: Request, exc: Exception) -> Response:
            return _error(request, status_code, title, str(exc))

        return handle

    def not_found(request: Request, exc: Exception) -> Response:
        detail = exc.detail if isinstance(exc, HTTPException) else str(exc)
        code = exc.status_code if isinstance(exc, HTTPException) else 404
        response = _error(request, code, "Not found" if code == 404 else "Error", str(detail))
        if isinstance(exc, HTTPException) and exc.headers:
            response.headers.update(exc.headers)  # a 405's Allow
        return response

    app = Starlette(
        routes=[
            Route("/", index),
            Route("/sessions/{session_id}", session_page),
            Route("/sessions/{session_id}/events", events),
            Route("/api/sessions", api_sessions),
            Route("/api/sessions/{session_id}", api_session),
        ],
        middleware=[Middleware(HostGuard, allowed=allowed)],
        exception_handlers={
            SessionNotFoundError: handler(404, "No such session"),
            InvalidSessionIdError: handler(400, "Not a session id"),
            StoredDataError: handler(500, "Stored data cannot be read"),
            HTTPException: not_found,
        },
    )
    app.state.streams = streams
    return app


class _Server(uvicorn.Server):
    """uvicorn's server, ending the app's event streams as soon as it is asked to stop.

    uvicorn waits for open responses before it stops; an event stream never
    ends by itself.
    """

    def __init__(self, config: uvicorn.Config, streams: Streams) -> None:
        super().__init__(config)
        self._streams = streams

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._streams.close()
        super().handle_exit(sig, frame)


def serve(
    store_url: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    codec: Codec[Any] | None = None,
    poll_interval: float = 0.25,
    log_level: str = "info",
    allowed_hosts: Iterable[str] = (),
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> None:
    """Serve the live view of the store ``store_url`` names until interrupted.

    Returns after Ctrl-C (SIGINT), once the server has stopped; on SIGTERM
    the process ends with that signal once the server has stopped (uvicorn's
    behaviour).

    Opens the store read-only (:func:`~stepmachine.inspector.open_store`),
    runs uvicorn on ``host:port`` (loopback by default: the view shows every
    session's content to whoever can connect) on asyncio, and closes the
    store when uvicorn has stopped. Open event streams end within one poll
    interval of the shutdown.

    Requests addressed to another host than loopback or one of
    ``allowed_hosts`` are refused (421). A connection has ``header_timeout``
    seconds, from when it opens or from its last response, to send a
    request's headers (a trickle of bytes does not extend it), and at most
    ``max_connections`` are open at once: the one waiting longest for a
    request is closed to make room, so idle connections never keep a real
    request out.

    Raises:
        UsageError, StoreNotFoundError, StoredDataError: from opening the store.
        ValueError: a limit or an allowed host is not valid (before anything opens).
    """
    allowed = normalise_allowed(allowed_hosts)
    protocol = guarded_protocol(header_timeout=header_timeout, max_connections=max_connections)

    async def main() -> None:
        store = await open_store(store_url, codec=codec)
        try:
            app = create_app(store, poll_interval=poll_interval, allowed_hosts=allowed)
            config = uvicorn.Config(
                app,
                host=host,
                port=port,
                log_level=log_level,
                lifespan="off",
                http=protocol,
                # asyncio accepts up to `backlog` connections before the protocol
                # sees any: with the cap, at most twice max_connections are open.
                backlog=max_connections,
            )
            await _Server(config, app.state.streams).serve()
        finally:
            await store.aclose()

    try:
        anyio.run(main, backend="asyncio")
    except KeyboardInterrupt:
        return  # uvicorn stopped cleanly and re-raised the Ctrl-C it handled
