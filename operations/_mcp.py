"""``McpTools``: the tools of MCP servers, governed like any other tool.

Needs the ``mcp`` extra (``pip install 'stepmachine[mcp]'``: the official MCP
SDK). ``McpTools`` is a :class:`~stepmachine.Tools` step whose tools come from
the servers' ``tools/list``; everything else is the ``Tools`` step's: every
call goes through the journal (an intent before a non-idempotent call, a
result per call, no blind re-run after a crash), ``check_call`` vetting
(approval, budgets), invalid-call answers, per-call timeouts, concurrency.
See ``_mcp_tool`` for side-effect classes and results, ``_mcp_link`` for
connections and restarts.

Opening and closing. The servers are connected for the duration of each
``run()`` (:meth:`McpTools.open_for_run`): started, initialized and listed
before the first cycle, closed (stdio servers stopped) when it returns. An
application that runs many sessions shares one set of connections instead::

    async with McpTools([McpStdio(command="my-server")]) as mcp_tools:
        machine = StateMachine([Approval(...), mcp_tools, ModelInference(model)])
        await machine.run(runtime, session_id)   # uses the open connections

A server that does not start is not a crashed run: its tools are missing
from the list (a warning is logged) and it is tried again at the start of
every cycle; a call of one of its tools is an error result until it runs.

The tool list within a cycle (a design choice): the list advertised at the
start of a cycle is the list that cycle's calls are routed by. A server that
says its list changed (``notifications/tools/list_changed``, or the
``subscriptions/listen`` event of protocol 2026-07-28) is listed again in the
background; the new list applies from the next cycle. A call of a tool that
is no longer listed is answered "unknown tool".
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Self

import anyio

from stepmachine import (
    ConfigurationError,
    Runtime,
    Session,
    SideEffects,
    StepContext,
    ToolDefinition,
    Tools,
    _log,
)
from stepmachine.extend import ToolLike

from ._mcp_link import Link
from ._mcp_servers import McpHttp, McpServer, McpStdio
from ._mcp_tool import McpTool, redacted_schema, side_effects_of

__all__ = ["McpTools"]

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
"""Characters some provider refuses in a tool name."""


def _left_out(problem: str) -> None:
    _log.event(_log.WARNING, "mcp_catalog", problem=problem)


EXTRA_HINT = "McpTools needs the mcp extra: pip install 'stepmachine[mcp]'"


@dataclass(frozen=True, slots=True)
class _Catalog:
    """The tools of every server as one list, built from listings of known versions."""

    key: tuple[int, ...]
    definitions: tuple[ToolDefinition, ...]
    tools: Mapping[str, McpTool]


class _Connections:
    """The links of one opening, hosted by a task group of the task that opened them.

    An async context manager entered and exited by one task. Its task group
    is entered and left by hand, so an exception from the body passes through
    unchanged (not wrapped in an exception group): the hosts never raise.
    """

    def __init__(self, owner: McpTools) -> None:
        self._owner = owner
        self.links: tuple[Link, ...] = ()
        self._catalog: _Catalog | None = None
        self._group: Any = None
        self.opening: frozenset[str] = frozenset()
        """The names advertised when the servers were opened (a clash of one of
        them with another step's tool is a configuration error)."""
        self.noted: set[tuple[str, str, tuple[int, ...]]] = set()
        """Clashes with another step's tool already logged, by catalog."""

    async def __aenter__(self) -> Self:
        bound = self._owner.max_message_bytes
        self.links = tuple(Link(server, bound) for server in self._owner.servers)
        group = anyio.create_task_group()
        await group.__aenter__()
        self._group = group
        try:
            for link in self.links:
                group.start_soon(link.host)
            for link in self.links:
                await link.settled()
            # A clash of tool names stops the run before any model call.
            self.opening = frozenset(self.catalog(strict=True).tools)
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close()

    async def _close(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.cancel_scope.cancel()
            await group.__aexit__(None, None, None)

    def catalog(self, *, strict: bool = False) -> _Catalog:
        """The current catalog, rebuilt when a server has a new listing.

        Raises:
            ConfigurationError: with ``strict`` (when opening), two servers
                give one tool name.
        """
        key = tuple(link.version for link in self.links)
        if self._catalog is None or self._catalog.key != key:
            self._catalog = self._owner._build_catalog(self.links, key, strict=strict)
        return self._catalog


@dataclass(slots=True)
class _RunView:
    """What one run sees: its connections, and the catalog advertised this cycle."""

    connections: _Connections
    catalog: _Catalog | None = field(default=None)
    yielded: set[str] = field(default_factory=set)
    """Names of this cycle's catalog left to another step's tool (see ``yields_tool``)."""


class McpTools(Tools):
    """Advertises and runs the tools of MCP servers (see the module docs).

    Args:
        servers: :class:`~stepmachine.operations.McpStdio` and
            :class:`~stepmachine.operations.McpHttp` configurations, with
            distinct names.
        name: the step name.
        namespace: prefix each tool with its server's name and ``"__"``
            (``files__read``) unless the server has a ``prefix`` of its own.
        max_concurrency: calls run at once (across servers).
        timeout: seconds per call for servers without their own (default 60;
            waiting for a crashed server to start again counts).
        on_unknown_outcome: ``"error"`` or ``"yield"``, as ``Tools``.
        max_result_chars: a result longer than this is an error result (the
            server's text is not stored).
        max_message_bytes: the bytes one message of a stdio server may take
            as it is read (a result with its images and documents, base64;
            default 32 MiB). A longer one is not read further (memory stays
            bounded: the rest is dropped as it comes) and the call is an error
            result naming the bound.

    Raises:
        ConfigurationError: the ``mcp`` extra is not installed, no servers, a
            server that is not an ``McpStdio``/``McpHttp``, two servers with
            one name, or an argument ``Tools`` refuses.

    Cancellation: cancelling ``run()`` closes the connections it opened (the
    SDK stops stdio servers, shielded and bounded); a call under way is
    cancelled at the server, and its journal entry stays for the next run.
    """

    def __init__(
        self,
        servers: Sequence[McpServer],
        *,
        name: str = "mcp",
        namespace: bool = False,
        max_concurrency: int = 8,
        timeout: float | None = 60.0,
        on_unknown_outcome: Literal["error", "yield"] = "error",
        max_result_chars: int = 100_000,
        max_message_bytes: int = 32 * 1024 * 1024,
    ) -> None:
        if importlib.util.find_spec("mcp") is None:
            raise ConfigurationError(EXTRA_HINT)
        super().__init__(
            (),
            name=name,
            max_concurrency=max_concurrency,
            timeout=timeout,
            on_unknown_outcome=on_unknown_outcome,
        )
        servers = tuple(servers)
        if not servers:
            raise ConfigurationError(f"{name!r}: McpTools needs at least one server")
        for server in servers:
            if not isinstance(server, McpStdio | McpHttp):
                raise ConfigurationError(
                    f"{name!r}: a server is an McpStdio or an McpHttp, got {server!r}"
                )
        names = [s.name for s in servers]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ConfigurationError(
                f"{name!r}: server names must be unique (give each a name=), repeated: {repeated}"
            )
        if not isinstance(namespace, bool):
            raise ConfigurationError(f"{name!r}: namespace must be a bool")
        if (
            isinstance(max_result_chars, bool)
            or not isinstance(max_result_chars, int)
            or max_result_chars < 1
        ):
            raise ConfigurationError(
                f"{name!r}: max_result_chars must be an int >= 1, got {max_result_chars!r}"
            )
        self.servers: tuple[McpServer, ...] = servers
        self.namespace = namespace
        self.max_result_chars = max_result_chars
        if (
            isinstance(max_message_bytes, bool)
            or not isinstance(max_message_bytes, int)
            or max_message_bytes < 1024
        ):
            raise ConfigurationError(
                f"{name!r}: max_message_bytes must be an int >= 1024, got {max_message_bytes!r}"
            )
        self.max_message_bytes = max_message_bytes
        self._shared: _Connections | None = None
        self._opening = False
        self._view: ContextVar[_RunView | None] = ContextVar(
            f"stepmachine.mcp.{name}", default=None
        )

    def __repr__(self) -> str:
        return f"McpTools(name={self.name!r}, servers={[s.name for s in self.servers]!r})"

    # -- opening -------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        """Connect every server, for every run until the block ends (shared connections).

        Returns when each server is listed or has failed (each within its
        ``connect_timeout``).

        Raises:
            ConfigurationError: already open (or being opened by another
                task), or two servers give one tool name.
        """
        if self._shared is not None or self._opening:
            raise ConfigurationError(f"{self.name!r} is already open")
        self._opening = True
        try:
            connections = _Connections(self)
            await connections.__aenter__()
            self._shared = connections
        finally:
            self._opening = False
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the shared connections (stdio servers are stopped)."""
        connections, self._shared = self._shared, None
        if connections is not None:
            await connections.__aexit__(exc_type, exc, tb)

    @asynccontextmanager
    async def open_for_run(self, runtime: Runtime) -> AsyncIterator[None]:
        """Connect for one run, unless open already (shared, or an outer run scope).

        Raises:
            ConfigurationError: two servers give one tool name.
        """
        if self._view.get() is not None:
            yield
            return
        if self._shared is not None:
            token = self._view.set(_RunView(self._shared))
            try:
                yield
            finally:
                self._view.reset(token)
            return
        async with _Connections(self) as connections:
            token = self._view.set(_RunView(connections))
            try:
                yield
            finally:
                self._view.reset(token)

    def _connections(self) -> _Connections:
        view = self._view.get()
        if view is not None:
            return view.connections
        if self._shared is not None:
            return self._shared
        raise ConfigurationError(
            f"{self.name!r} is not open: run the machine with run(), or enter "
            "`async with machine.opened(runtime)` (or `async with mcp_tools`) to drive "
            "steps by hand"
        )

    # -- the catalog -----------------------------------------------------------------

    def _build_catalog(
        self, links: Sequence[Link], key: tuple[int, ...], *, strict: bool
    ) -> _Catalog:
        """The tools of ``links`` under their advertised names.

        A name is the server's ``prefix`` (or ``"<server>__"`` with
        ``namespace=True``) plus the tool's own name with every character
        outside ``A-Z a-z 0-9 _ -`` made ``_``, cut to 64 characters: what
        every provider takes (the call still goes to the server under its own
        name). A tool whose name is empty is left out; so is the second of two
        tools of one server that end with one name, and one whose input schema
        nests deeper than ``MAX_SCHEMA_DEPTH``. Each is logged (WARNING, event
        ``mcp_catalog``). The server's configured secrets are replaced by
        ``[redacted]`` in each tool's name, description and every string of its
        input schema (``McpServer.redact``), so no secret reaches a model
        request.

        Raises:
            ConfigurationError: with ``strict`` (when the tools are opened),
                two servers give one name. Later (a server's list changed, or
                a server started late), the tool listed first keeps the name
                and the other is left out and logged: a server cannot stop a
                running agent by adding a tool.
        """
        tools: dict[str, McpTool] = {}
        for link in links:
            server = link.server
            prefix = server.prefix or (f"{server.name}__" if self.namespace else "")
            for remote in link.listing or ():
                shown_name = server.redact(remote.name)
                advertised = (prefix + _UNSAFE.sub("_", shown_name))[:64]
                if not remote.name:
                    _left_out(f"{server.describe()} lists a tool with an empty name")
                    continue
                try:
                    parameters = redacted_schema(dict(remote.input_schema), server)
                except ValueError as exc:
                    _left_out(f"{server.describe()} lists tool {shown_name!r}, but {exc}; left out")
                    continue
                if advertised in tools:
                    holder = tools[advertised]
                    if holder.link is link:
                        _left_out(
                            f"{server.describe()} lists tools "
                            f"{server.redact(holder.remote_name)!r} and {shown_name!r}, both "
                            f"advertised as {advertised!r}; the first is kept"
                        )
                        continue
                    clash = (
                        f"tool name {advertised!r} is given by both "
                        f"{holder.link.server.describe()} and {server.describe()}; "
                        "McpTools(namespace=True) or a server prefix= tells them apart"
                    )
                    if strict:
                        raise ConfigurationError(clash)
                    _left_out(f"{clash}; the first is kept")
                    continue
                definition = ToolDefinition(
                    name=advertised,
                    description=server.redact(remote.description or ""),
                    parameters=parameters,
                )
                tools[advertised] = McpTool(
                    name=advertised,
                    remote_name=remote.name,
                    definition=definition,
                    side_effects=side_effects_of(remote, server),
                    timeout=server.timeout,
                    link=link,
                    max_result_chars=self.max_result_chars,
                )
        definitions = tuple(t.definition for t in tools.values())
        return _Catalog(key=key, definitions=definitions, tools=tools)

    def tools(self, session: Session[Any]) -> Sequence[ToolDefinition]:
        """The servers' tools as of the start of this cycle (a server that is down is
        asked to start again; its last listing stays advertised).

        Raises:
            ConfigurationError: not open, or two servers give one tool name.
        """
        connections = self._connections()
        for link in connections.links:
            link.poke()
        catalog = connections.catalog()
        view = self._view.get()
        if view is not None:
            view.catalog = catalog
            view.yielded = set()
        return catalog.definitions

    def yields_tool(self, tool: str, other: str) -> bool:
        """Whether the server tool ``tool`` gives way to step ``other``'s tool of that name.

        Asked by the machine when it collects the tools of every step. A name
        the servers listed when they were opened does not (``False``: the
        clash is a configuration error, raised before any model call, as for
        two servers). A name that came later -- a server's list changed, or a
        server started late -- does: the other step's tool keeps the name,
        the server's is left out of this cycle's list and its calls, and the
        clash is logged once per listing (WARNING, event ``mcp_catalog``). A
        server cannot stop a running agent by adding a tool.
        """
        connections = self._connections()
        if tool in connections.opening:
            return False
        catalog = connections.catalog()
        found = catalog.tools.get(tool)
        if found is None:
            return False
        view = self._view.get()
        if view is not None:
            view.yielded.add(tool)
        noted = (tool, other, catalog.key)
        if noted not in connections.noted:
            connections.noted.add(noted)
            _left_out(
                f"tool name {tool!r} of {found.link.server.describe()} is advertised by step "
                f"{other!r} too; {other!r} keeps it and the server's tool is left out"
            )
        return True

    def _own_tools(self, ctx: StepContext[Any]) -> Mapping[str, ToolLike]:
        """The tools advertised at the start of this cycle (in this run), less those left
        to another step's tool of the same name."""
        view = self._view.get()
        if view is not None and view.catalog is not None:
            if not view.yielded:
                return view.catalog.tools
            return {n: t for n, t in view.catalog.tools.items() if n not in view.yielded}
        return self._connections().catalog().tools

    def status(self) -> dict[str, str]:
        """Each server's state by name: ``"up"``, ``"connecting"``, or ``"down: <why>"``.

        A server that does not start stops no run (its tools are missing from
        the list, and a warning is logged); this says why, for a health check
        or a start-up message.

        Raises:
            ConfigurationError: not open.
        """
        return {
            link.server.name: (
                f"down: {link.problem or 'stopped'}" if link.state == "down" else link.state
            )
            for link in self._connections().links
        }

    def listed(self) -> dict[str, SideEffects]:
        """The tools of the open servers as they would be advertised now, with their
        side-effect classes (for logs, dashboards, and approval policies).

        Raises:
            ConfigurationError: not open, or two servers give one tool name.
        """
        return {name: t.side_effects for name, t in self._connections().catalog().tools.items()}

    def side_effects(self, tool: str) -> SideEffects | None:
        """The side-effect class of the advertised tool ``tool``, or ``None`` if unknown.

        For approval policies (``Approval(lambda call: mcp.side_effects(call.name)
        == "non_idempotent")``). Reads the catalog this run (or the shared
        connections) advertised last.
        """
        view = self._view.get()
        if view is not None and view.catalog is not None:
            found = None if tool in view.yielded else view.catalog.tools.get(tool)
        elif self._shared is not None:
            found = self._shared.catalog().tools.get(tool)
        else:
            found = None
        return None if found is None else found.side_effects
