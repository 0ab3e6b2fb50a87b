"""One MCP server's connection: started, listed, watched, restarted, called.

A :class:`Link` is hosted by one task (:meth:`Link.host`) in the task group of
whoever opened the tools (``run()``, or the application's ``async with``):
the MCP SDK's client is an async context manager whose tasks must be entered
and left by one task, so the host enters it, and callers in other tasks only
send requests through it. The host never raises; it ends when its task group
is cancelled, which closes the connection (a stdio server is stopped as the
SDK does: stdin closed, then SIGTERM, then SIGKILL, each wait bounded by its
``stop_grace``).

States, owned by the host, read by callers::

    connecting --listed--> up --lost / closed--> down --restart asked--> connecting
    connecting --failed / connect_timeout--> down

A call finding the link ``down`` asks for a restart and waits for that
attempt (within the call's own timeout, which the ``Tools`` step applies);
if that attempt fails too, the call fails with :class:`McpUnavailableError`
(an error result), so one crashed server costs each call at most one
attempt. ``McpTools.tools()`` asks for a restart of a ``down`` link at the
start of every cycle, so a server that crashed is running again by the next
cycle's calls.

A stdio server is spoken to through ``_mcp_stdio`` (each message bounded
while it is read: ``max_message_bytes``), its stderr logged through
``_mcp_stderr`` (redacted, bounded), never written to the agent's own. An
error response with code ``-32000`` is a closed connection only when a
probe finds the connection closed; from a live server it is the server's
own error (an error result with its message; no restart).

The tool listing is kept across restarts: the last good listing stays what
is advertised while a server is down, and each new listing (after a start,
or after the server said its list changed) gets a new ``version``; the
catalog is rebuilt from it at the start of the next cycle.
"""

from __future__ import annotations

import math
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any, Literal, cast

import anyio
import anyio.abc
import anyio.lowlevel

from stepmachine import __version__, _log

from ._mcp_servers import McpHttp, McpServer
from ._mcp_stderr import StderrPipe
from ._mcp_stdio import bounded_stdio_client

if TYPE_CHECKING:
    from mcp import Client
    from mcp.client.session import IncomingMessage
    from mcp.types import CallToolResult, Tool
    from mcp_types import RequestParamsMeta

__all__ = ["Link", "McpUnavailableError", "describe_error"]

_MAX_PAGES = 100
"""Pages of ``tools/list`` read at most: a server that pages for ever cannot hang a start."""


class McpUnavailableError(Exception):
    """The server could not be reached for a call (it is down and did not start again)."""


def describe_error(exc: BaseException) -> str:
    """A one-line description of ``exc`` (the first leaf of an exception group)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = " ".join(str(exc).split())
    if len(text) > 500:
        text = text[:500] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_PROBE_TIMEOUT = 5.0
"""Seconds a probe may take to show a connection that reported ``-32000`` is alive."""


def _says_closed(exc: BaseException) -> bool:
    """Whether ``exc`` carries the code the SDK uses for a closed connection (``-32000``)."""
    from mcp import MCPError  # noqa: PLC0415 - the extra is imported only when used
    from mcp_types import CONNECTION_CLOSED  # noqa: PLC0415

    return isinstance(exc, MCPError) and exc.code == CONNECTION_CLOSED


async def _connection_closed(client: Client, exc: BaseException) -> bool:
    """Whether ``exc`` means the connection to the server is gone.

    The SDK reports a closed connection as an error with code ``-32000``, the
    first code JSON-RPC leaves to servers, so a live server may answer with it
    too (``"quota exceeded"``). A probe tells them apart: a ``tools/list``
    request (every protocol version has it; ``ping`` is gone from
    2026-07-28) fails at once on a closed connection, with the same code,
    without being sent; a live server answers it (or errs otherwise, or is
    slow to: alive all the same), and then the error is the server's own,
    message and all. A server that answers the probe with ``-32000`` too is
    taken as closed: the cautious reading (the call's outcome is unknown).
    """
    if not _says_closed(exc):
        return False
    try:
        with anyio.move_on_after(_PROBE_TIMEOUT):
            await client.list_tools()
    except Exception as probe_error:  # noqa: BLE001 - only a closed connection counts
        return _says_closed(probe_error)
    return False


class Link:
    """One server's connection; see the module docs.

    Attributes:
        server: its configuration.
        state: ``"connecting"``, ``"up"`` or ``"down"``.
        listing: the last good list of its tools, or ``None`` before the first.
        version: bumped with every new listing.
        problem: why it is down (or why its last listing failed), for errors.
    """

    def __init__(self, server: McpServer, max_message_bytes: int = 32 * 1024 * 1024) -> None:
        self.server = server
        self.max_message_bytes = max_message_bytes
        self.state: Literal["connecting", "up", "down"] = "connecting"
        self.listing: tuple[Tool, ...] | None = None
        self.version = 0
        self.attempts = 0
        self.problem = ""
        self._client: Client | None = None
        self._lost: anyio.Event | None = None
        self._dirty = anyio.Event()
        self._changed = anyio.Event()
        self._restart = anyio.Event()
        self._readers: anyio.abc.TaskGroup | None = None

    # -- the host ------------------------------------------------------------------

    async def host(self) -> None:
        """Connect, serve until the connection is lost, wait for a restart; for ever.

        Cancellation: ends the connection (shielded and bounded by the SDK).
        """
        # The stderr readers of its connections run here, outside each connection's
        # try: an error while connecting is then never mixed with their cancellation.
        async with anyio.create_task_group() as readers:
            self._readers = readers
            while True:
                await self._serve_once()
                await self._restart.wait()
                self._restart = anyio.Event()

    async def _serve_once(self) -> None:
        """One connection: start, list, then watch until it is lost. Never raises."""
        self.attempts += 1
        self.state = "connecting"
        self._notify()
        lost = anyio.Event()
        problem = ""
        timeout = self.server.connect_timeout
        try:
            with anyio.CancelScope(deadline=anyio.current_time() + timeout) as scope:
                async with AsyncExitStack() as stack:
                    client = await self._open(stack)
                    self._publish(await self._list(client))
                    scope.deadline = math.inf  # connected: no deadline on serving
                    self._client = client
                    self._lost = lost
                    self.state = "up"
                    self._notify()
                    _log.event(_log.INFO, "mcp_server", server=self.server.name, state="up")
                    await self._watch(client, lost)
            if scope.cancelled_caught:
                problem = f"it did not start and list its tools within {timeout} s"
        except Exception as exc:  # noqa: BLE001 - a server's failure is this link's state
            problem = self.server.redact(f"it failed: {describe_error(exc)}")
        finally:
            self._client = None
            self._lost = None
            if problem:
                self.problem = problem
            self.state = "down"
            self._notify()
        level = _log.WARNING if problem else _log.INFO
        _log.event(level, "mcp_server", server=self.server.name, state="down", problem=self.problem)

    async def _open(self, stack: AsyncExitStack) -> Client:
        """Start the transport and the MCP session (entered on ``stack``)."""
        from mcp import Client, StdioServerParameters  # noqa: PLC0415
        from mcp.types import Implementation  # noqa: PLC0415

        server = self.server
        target: Any
        if isinstance(server, McpHttp):
            import httpx2  # noqa: PLC0415 - a dependency of the mcp SDK
            from mcp.client.streamable_http import streamable_http_client  # noqa: PLC0415

            http = await stack.enter_async_context(
                httpx2.AsyncClient(
                    headers=dict(server.headers), timeout=httpx2.Timeout(30.0, read=300.0)
                )
            )
            target = streamable_http_client(server.url, http_client=http)
        else:
            parameters = StdioServerParameters(
                command=server.command,
                args=list(server.args),
                env=None if server.env is None else dict(server.env),
                cwd=server.cwd,
            )
            # Its stderr goes to the log, redacted and bounded, not to ours.
            pipe = StderrPipe(server)
            stack.callback(pipe.stop)  # after the client closed (the process stopped)
            stack.callback(pipe.close_writer)
            assert self._readers is not None  # set by host(), which runs every connection
            self._readers.start_soon(pipe.forward)
            target = bounded_stdio_client(
                parameters, pipe.writer, self.max_message_bytes, server.name, server.stop_grace
            )
        client = Client(
            target,
            message_handler=self._on_message,
            client_info=Implementation(name="stepmachine", version=__version__),
            cache=None,
        )
        entered = await stack.enter_async_context(client)
        if not isinstance(server, McpHttp):
            pipe.close_writer()  # the process holds its own copy
        return entered

    async def _list(self, client: Client) -> tuple[Tool, ...]:
        """Every tool the server lists, page by page."""
        tools: list[Tool] = []
        cursor: str | None = None
        for _ in range(_MAX_PAGES):
            page = await client.list_tools(cursor=cursor)
            tools.extend(page.tools)
            cursor = page.next_cursor
            if cursor is None:
                return tuple(tools)
        raise ValueError(f"its tool list has more than {_MAX_PAGES} pages")

    async def _watch(self, client: Client, lost: anyio.Event) -> None:
        """Until ``lost``: re-list when the server says its tools changed."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._relist_when_dirty, client, lost)
            capabilities = client.server_capabilities.tools
            if capabilities is not None and capabilities.list_changed:
                tg.start_soon(self._listen, client, lost)
            await lost.wait()
            tg.cancel_scope.cancel()

    async def _listen(self, client: Client, lost: anyio.Event) -> None:
        """Subscribe to list changes (protocol 2026-07-28); older ones notify unasked."""
        from mcp.client.subscriptions import (  # noqa: PLC0415
            ListenNotSupportedError,
            SubscriptionLost,
        )

        try:
            async with client.listen(tools_list_changed=True) as events:
                async for _ in events:
                    self._dirty.set()
        except ListenNotSupportedError:
            return  # an older protocol: notifications/tools/list_changed come unasked
        except SubscriptionLost:
            lost.set()  # the stream dropped: so did the connection
        except Exception as exc:  # noqa: BLE001 - watching is best effort
            if await _connection_closed(client, exc):
                lost.set()
            listen = self.server.redact(describe_error(exc))
            _log.event(_log.INFO, "mcp_server", server=self.server.name, listen=listen)

    async def _relist_when_dirty(self, client: Client, lost: anyio.Event) -> None:
        while True:
            await self._dirty.wait()
            self._dirty = anyio.Event()
            try:
                with anyio.fail_after(self.server.connect_timeout):
                    self._publish(await self._list(client))
            except Exception as exc:  # noqa: BLE001 - the last good listing stays
                if await _connection_closed(client, exc):
                    lost.set()
                    return
                self.problem = self.server.redact(
                    f"listing its tools again failed: {describe_error(exc)}"
                )
                _log.event(
                    _log.WARNING, "mcp_server", server=self.server.name, problem=self.problem
                )

    async def _on_message(self, message: IncomingMessage) -> None:
        """Server notifications (list changes, before 2026-07-28) and transport faults."""
        from mcp.types import ToolListChangedNotification  # noqa: PLC0415

        if isinstance(message, ToolListChangedNotification):
            self._dirty.set()
        elif isinstance(message, Exception):
            _log.event(
                _log.WARNING,
                "mcp_server",
                server=self.server.name,
                fault=self.server.redact(describe_error(message)),
            )
        await anyio.lowlevel.checkpoint()

    def _publish(self, tools: tuple[Tool, ...]) -> None:
        self.listing = tools
        self.version += 1

    def _notify(self) -> None:
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    # -- callers -------------------------------------------------------------------

    async def settled(self) -> None:
        """Wait until the attempt under way (if any) has connected or failed."""
        while self.state == "connecting":
            await self._changed.wait()

    def poke(self) -> None:
        """Ask for a restart if the server is down (returns at once)."""
        if self.state == "down":
            self._restart.set()

    async def ready(self) -> Client:
        """The connected client, starting the server again if it is down.

        Waits for a connection being made; a ``down`` server gets one new
        attempt, awaited.

        Raises:
            McpUnavailableError: that attempt failed too.

        Cancellation: only the wait is abandoned; an attempt under way goes on.
        """
        mine = self.attempts + (1 if self.state == "down" else 0)
        while True:
            if self.state == "up" and self._client is not None:
                return self._client
            if self.state == "down":
                if self.attempts >= mine:
                    raise McpUnavailableError(
                        f"{self.server.describe()} is unavailable: {self.problem or 'it stopped'}"
                    )
                self._restart.set()
            await self._changed.wait()

    def lose(self, client: Client, why: str) -> None:
        """Mark the connection of ``client`` as gone; the next call or cycle starts it again."""
        if self._client is client:
            self._client = None
            self.problem = why
            self.state = "down"
            if self._lost is not None:
                self._lost.set()
            self._notify()

    async def call(
        self, name: str, arguments: dict[str, Any], meta: dict[str, Any]
    ) -> CallToolResult:
        """Call the server's tool ``name``.

        Raises:
            McpUnavailableError: the server is down and did not start again, or
                the connection closed during the call (it may have crashed;
                the call's outcome is unknown).
            Exception: what the SDK raises (an error response, a result that
                is not valid MCP). An error response with code ``-32000`` is the
                server's own when the connection is still alive (a probe
                is answered), not a closed connection.

        Cancellation: the SDK tells the server the request is cancelled.
        """
        client = await self.ready()
        try:
            return await client.call_tool(name, arguments, meta=cast("RequestParamsMeta", meta))
        except Exception as exc:
            if not await _connection_closed(client, exc):
                raise  # the server's own error (a -32000 from a live server included)
            why = "it closed the connection during a call (it may have crashed)"
            self.lose(client, why)
            raise McpUnavailableError(
                f"{self.server.describe()} closed the connection during the call (it may have "
                "crashed); the call's outcome is unknown"
            ) from None
