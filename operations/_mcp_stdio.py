"""The stdio transport of ``McpTools``: the SDK's, with each message bounded while it is read.

The SDK's stdio transport reads a server's stdout a line (one JSON-RPC
message) at a time, and a line is read whole before it is parsed: a 50 MB
result peaked at ten times its size in memory and took more than a minute
(benchmarks/mcp_big_result.py), only to be refused by ``max_result_chars``.
This transport is the SDK's
(its process start, its shutdown: stdin closed, SIGTERM, SIGKILL of the
process tree, each bounded; the waits are the server's ``stop_grace``) with
another reader: a line longer than
``max_line_bytes`` (``McpTools(max_message_bytes=)``) is not kept -- its
first bytes name the request it answers, the rest is read and dropped as
it comes (the server never blocks on a full pipe) -- and that request gets
an error response naming the bound (code ``-32603``), which the call turns
into an error result. A line
whose request cannot be told from its first bytes is dropped and logged
(the call then ends at its timeout).

Memory while reading is bounded by ``max_line_bytes`` plus one read; each
line is joined once (no quadratic re-joining of a long line).
"""

from __future__ import annotations

import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TextIO

import anyio
import anyio.lowlevel

from stepmachine import _log

__all__ = ["TOO_LONG_CODE", "bounded_stdio_client", "split_lines", "stop_process"]

TOO_LONG_CODE = -32603
"""The JSON-RPC code of the error answered for a message over the bound."""

_HEAD = 4_096
"""Bytes of a long line kept to find the id of the request it answers."""

_ID = re.compile(rb'"id"\s*:\s*(-?\d+|"(?:[^"\\]|\\.){0,200}")')

_REAP_GRACE = 10.0
"""Seconds to wait, after the SDK's own stop, for a killed server to be reaped."""


class _Lines:
    """Splits bytes into lines, keeping at most ``limit`` bytes of the line being read."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._parts: list[bytes] = []
        self._size = 0
        self._head = b""
        self._over = False

    @property
    def held(self) -> int:
        """The bytes held of the line being read (never more than ``limit`` + one read)."""
        return self._size

    def feed(self, chunk: bytes) -> list[tuple[bytes, bool]]:
        """The lines ``chunk`` completes: ``(line, False)``, or ``(first bytes, True)``
        for a line over the limit."""
        done: list[tuple[bytes, bool]] = []
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            self._add(piece)
            if end < 0:
                return done
            if self._over:
                done.append((self._head, True))
            else:
                done.append((b"".join(self._parts), False))
            self._parts, self._size, self._head, self._over = [], 0, b"", False
            start = end + 1

    def _add(self, piece: bytes) -> None:
        if self._over or not piece:
            return
        self._parts.append(piece)
        self._size += len(piece)
        if self._size > self.limit:
            self._head = b"".join(self._parts)[:_HEAD]
            self._parts, self._size, self._over = [], 0, True


def split_lines(limit: int) -> _Lines:
    """A line splitter that keeps at most ``limit`` bytes of a line (for tests)."""
    return _Lines(limit)


def _too_long(head: bytes, limit: int, server: str) -> Any:
    """The error response for the request a too-long line answers, or ``None``."""
    import mcp_types as types  # noqa: PLC0415 - the extra is imported only when used
    from mcp.shared.message import SessionMessage  # noqa: PLC0415

    found = _ID.search(head)
    if found is None or b'"method"' in head[: found.start()]:
        _log.event(
            _log.WARNING,
            "mcp_server",
            server=server,
            problem=f"it sent a message longer than {limit:,} bytes; dropped",
        )
        return None
    raw = found.group(1)
    ident: int | str = int(raw) if raw[:1] != b'"' else raw[1:-1].decode(errors="replace")
    error = types.ErrorData(
        code=TOO_LONG_CODE,
        message=(f"its answer is longer than {limit:,} bytes (max_message_bytes); it was not read"),
    )
    return SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=ident, error=error))


async def stop_process(process: Any, grace: float, server: str = "") -> None:
    """Stop a server as the SDK does, with ``grace`` seconds for each of its two waits.

    Its stdin is closed and it gets ``grace`` seconds to exit; then its process
    group gets SIGTERM and ``grace`` seconds more; then SIGKILL. Each wait ends
    as soon as the process has exited (the SDK's waits are 2 s each).
    """
    from mcp.client import stdio as sdk  # noqa: PLC0415 - the extra is imported only when used
    from mcp.os.posix.utilities import terminate_posix_process_tree  # noqa: PLC0415
    from mcp.os.win32.utilities import (  # noqa: PLC0415
        close_process_job,
        terminate_windows_process_tree,
    )

    await sdk._close_pipe(process.stdin)
    if not await sdk._wait_for_process_exit(process, grace):
        if sys.platform == "win32":  # pragma: no cover - a hard kill there
            await terminate_windows_process_tree(process)
        else:
            await terminate_posix_process_tree(process, grace)
        if not await sdk._wait_for_process_exit(process, sdk._KILL_REAP_TIMEOUT):
            _log.event(
                _log.WARNING,
                "mcp_server",
                server=server,
                problem=f"its process {process.pid} is still alive after SIGKILL of its group",
            )
    close_process_job(process)  # Windows: its job's other members; else nothing
    await sdk._close_pipe(process.stdout)
    sdk._close_subprocess_transport(process)


@asynccontextmanager
async def bounded_stdio_client(
    parameters: Any,
    errlog: TextIO,
    max_line_bytes: int,
    server: str,
    stop_grace: float = 2.0,
) -> AsyncIterator[Any]:
    """The SDK's ``stdio_client`` with a bounded reader (see the module docs).

    ``stop_grace``: the seconds of each wait when the server is stopped
    (:func:`stop_process`).

    Yields the transport's (read stream, write stream).

    Raises:
        OSError, ValueError: the process cannot be started (as the SDK).

    Cancellation: the server is stopped, shielded and bounded (as the SDK).
    """
    import mcp_types as types  # noqa: PLC0415
    from mcp.client import stdio as sdk  # noqa: PLC0415
    from mcp.shared.message import SessionMessage  # noqa: PLC0415

    command = await sdk._get_executable_command(parameters.command)
    process = await sdk._create_platform_compatible_process(
        command=command,
        args=parameters.args,
        env=sdk.get_default_environment() | (parameters.env or {}),
        errlog=errlog,
        cwd=parameters.cwd,
    )
    read_writer, read_stream = anyio.create_memory_object_stream[Any](0)
    write_stream, write_reader = anyio.create_memory_object_stream[SessionMessage](0)
    writer_done = anyio.Event()

    async def stdout_reader() -> None:
        assert process.stdout is not None  # spawned with pipes
        lines = _Lines(max_line_bytes)
        try:
            async with read_writer:
                try:
                    while True:
                        try:
                            chunk = await process.stdout.receive()
                        except anyio.EndOfStream:
                            return
                        for line, over in lines.feed(chunk):
                            if over:
                                message = _too_long(line, max_line_bytes, server)
                                if message is None:
                                    continue
                            else:
                                text = line.decode(parameters.encoding, errors="replace")
                                message = sdk._parse_line(text)
                            try:
                                await read_writer.send(message)
                            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                                return
                finally:
                    await sdk._drain_stdout(process)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, ConnectionError):
            pass  # our own shutdown, or the server went away: the session sees the close

    async def stdin_writer() -> None:
        assert process.stdin is not None
        try:
            async with write_reader:
                async for session_message in write_reader:
                    json = session_message.message.model_dump_json(
                        by_alias=True, exclude_unset=True
                    )
                    await process.stdin.send((json + "\n").encode(parameters.encoding))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            await read_writer.aclose()
        finally:
            writer_done.set()

    async def shutdown() -> None:
        read_stream.close()
        write_stream.close()
        with anyio.move_on_after(sdk._WRITER_FLUSH_TIMEOUT):
            await writer_done.wait()
        await stop_process(process, stop_grace, server)
        # The SDK gives a killed server 2 s to be reaped; on a loaded machine that can be
        # too short, and a process never reaped stays a zombie. Wait a while longer,
        # bounded (the kill was sent: the process is going).
        with anyio.move_on_after(_REAP_GRACE):
            while process.returncode is None:  # noqa: ASYNC110 - returncode is polled, as the SDK does
                await anyio.sleep(0.02)
        await sdk._aclose_all(read_stream, write_stream, read_writer, write_reader)
        await anyio.lowlevel.checkpoint()

    _ = types  # imported for the SDK's message types the reader returns
    async with anyio.create_task_group() as tg:
        tg.start_soon(stdout_reader)
        tg.start_soon(stdin_writer)
        try:
            yield read_stream, write_stream
        finally:
            with anyio.CancelScope(shield=True):
                await shutdown()
            tg.cancel_scope.cancel()
