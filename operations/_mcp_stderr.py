"""A stdio MCP server's stderr, read from a pipe and logged: redacted, bounded.

A server started by the SDK would write its stderr straight to the agent's
own, where the secrets of its ``env=`` (a server logging its configuration)
could not be redacted. :class:`StderrPipe` gives the server a pipe instead;
:meth:`StderrPipe.forward` reads it and logs each line (INFO, event
``mcp_stderr``, fields ``server`` and ``line``), with the server's
configured secrets replaced by ``[redacted]`` (see ``McpServer.redact``).

Bounds (a design choice): a line is cut at :data:`LINE_CHARS` characters
(``...`` marks the cut; the rest of the line is read and dropped, so memory
stays bounded whatever the server writes); at most :data:`MAX_LINES` lines
are logged per connection (a server started again starts a new count),
then one record says further lines are dropped, and the pipe is still read
so the server never blocks on a full pipe.
"""

from __future__ import annotations

import contextlib
import os
from typing import TextIO, cast

import anyio

from stepmachine import _log

from ._mcp_servers import McpServer

__all__ = ["LINE_CHARS", "MAX_LINES", "StderrPipe"]

LINE_CHARS = 2_000
"""Characters of one stderr line logged at most."""

MAX_LINES = 1_000
"""Lines of stderr logged per connection at most."""

_READ = 65_536


class StderrPipe:
    """A pipe for a server's stderr: the write end for the process, the read end to log.

    Attributes:
        writer: the write end, a file the SDK hands the process as its stderr;
            close it (:meth:`close_writer`) once the process started, so the
            read end sees the end when the process (and its children) exit.
    """

    def __init__(self, server: McpServer) -> None:
        self._server = server
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        self._read_fd: int | None = read_fd
        self.writer = cast("TextIO", os.fdopen(write_fd, "w", encoding="utf-8"))
        self._logged = 0
        self._scope = anyio.CancelScope()

    def close_writer(self) -> None:
        """Close this process's copy of the write end (idempotent)."""
        self.writer.close()

    def stop(self) -> None:
        """Stop :meth:`forward` (at once, or as soon as it starts); returns at once."""
        self._scope.cancel()

    async def forward(self) -> None:
        """Log every line until the pipe ends; never raises.

        Cancellation (or :meth:`stop`): stops reading (what is unread is
        dropped); the read end is closed either way.
        """
        fd = self._read_fd
        if fd is None:
            return
        with self._scope:
            await self._read(fd)

    async def _read(self, fd: int) -> None:
        keep = (LINE_CHARS + self._server.longest_secret()) * 4  # bytes: 1-4 a character
        pending = b""
        skipping = False  # inside a line already logged cut short
        try:
            while True:
                await anyio.wait_readable(fd)
                try:
                    chunk = os.read(fd, _READ)
                except BlockingIOError:
                    continue
                if not chunk:
                    break
                pending += chunk
                while True:
                    end = pending.find(b"\n")
                    if end < 0:
                        if len(pending) > keep:
                            if not skipping:
                                self._log(pending[:keep], cut=True)
                                skipping = True
                            pending = b""
                        break
                    line, pending = pending[:end], pending[end + 1 :]
                    if skipping:
                        skipping = False
                    else:
                        self._log(line, cut=False)
            if pending and not skipping:
                self._log(pending, cut=False)
        except OSError:
            pass  # the pipe broke: nothing more to read
        finally:
            self._read_fd = None
            with contextlib.suppress(OSError):
                os.close(fd)

    def _log(self, raw: bytes, *, cut: bool) -> None:
        if self._logged > MAX_LINES:
            return
        self._logged += 1
        server = self._server.name
        if self._logged > MAX_LINES:
            _log.event(
                _log.INFO,
                "mcp_stderr",
                server=server,
                line=f"[more than {MAX_LINES:,} lines of stderr; further lines are dropped]",
            )
            return
        text = self._server.redact(raw.decode("utf-8", errors="replace").rstrip("\r"))
        if cut or len(text) > LINE_CHARS:
            text = text[:LINE_CHARS] + "..."
        _log.event(_log.INFO, "mcp_stderr", server=server, line=text)
