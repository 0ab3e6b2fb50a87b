"""Where MCP tools come from: a local command over stdio, or a streamable-HTTP URL.

:class:`McpStdio` and :class:`McpHttp` are plain configuration (no connection,
no import of the ``mcp`` SDK); :class:`~stepmachine.operations.McpTools` opens
them. What they hold that may be secret -- an HTTP server's headers (a bearer
token), a stdio server's environment -- is left out of their ``repr`` and
replaced by ``[redacted]`` in every error, log record, stored result and
stderr line of the server (values of at least 8 characters; see
``redact``); so is any user:password in a URL.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from stepmachine import ConfigurationError, SideEffects
from stepmachine._tools import check_timeout

__all__ = ["MIN_SECRET_CHARS", "McpHttp", "McpServer", "McpStdio", "redact_url"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

MIN_SECRET_CHARS = 8
"""Configured values shorter than this are not redacted (see ``redact``)."""
_SIDE_EFFECTS = ("pure", "idempotent", "non_idempotent")


def redact_url(url: str) -> str:
    """``url`` for errors and logs: scheme, host, port and path only.

    No user or password, and no query or fragment (hosted servers take keys
    as ``?api_key=...``): a query is shown as ``?...``.
    """
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "<invalid URL>"
    if port is not None:
        host = f"{host}:{port}"
    shown = urlunsplit((parts.scheme, host, parts.path, "", ""))
    return shown + ("?..." if parts.query else "")


@dataclass(frozen=True, kw_only=True)
class _Common:
    """What every MCP server configuration has (see :class:`McpStdio`)."""

    name: str = ""
    prefix: str = ""
    side_effects: SideEffects | Mapping[str, SideEffects] | None = None
    trust_annotations: bool = False
    timeout: float | None = None
    connect_timeout: float = 30.0

    def _check_common(self, kind: str) -> None:
        if not _NAME.match(self.name):
            raise ConfigurationError(
                f"{kind}: name must be 1-64 letters, digits, '_' or '-' (it names the server "
                f"in errors and, with namespace=True, prefixes its tools), got {self.name!r}"
            )
        if not isinstance(self.prefix, str):
            raise ConfigurationError(f"{kind} {self.name!r}: prefix must be a str")
        configured = self.side_effects
        values = (
            list(configured.values())
            if isinstance(configured, Mapping)
            else ([] if configured is None else [configured])
        )
        for value in values:
            if value not in _SIDE_EFFECTS:
                raise ConfigurationError(
                    f"{kind} {self.name!r}: side_effects must be 'pure', 'idempotent' or "
                    f"'non_idempotent' (or a mapping of tool name to one), got {value!r}"
                )
        if not isinstance(self.trust_annotations, bool):
            raise ConfigurationError(f"{kind} {self.name!r}: trust_annotations must be a bool")
        check_timeout(f"{kind} {self.name!r}", self.timeout)
        timeout = self.connect_timeout
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout <= sys.float_info.max  # finite (an int too big for a float too)
        ):
            raise ConfigurationError(
                f"{kind} {self.name!r}: connect_timeout must be a finite number of seconds > 0, "
                f"got {timeout!r}"
            )

    def _secrets(self) -> list[str]:
        return []

    def redact(self, text: str) -> str:
        """``text`` with this server's secrets replaced by ``[redacted]``.

        The secrets: every value of a stdio server's ``env=``, every header
        value of an HTTP server (and the token of ``"Bearer <token>"``), the
        user, password and query values of its URL. A value shorter than
        :data:`MIN_SECRET_CHARS` (8) is not replaced: ``"1"`` or ``"debug"``
        would blank out ordinary words and digits everywhere (a secret that
        short is no secret). Applied to every result the server returns (its
        text and text documents), every error and log record that quotes it,
        and every line of its stderr before it is logged.
        """
        if not text:
            return text
        for secret in self._redacted():
            if secret in text:
                text = text.replace(secret, "[redacted]")
        return text

    def _redacted(self) -> tuple[str, ...]:
        """The secrets :meth:`redact` replaces, longest first (computed once)."""
        found = self.__dict__.get("_secrets_cache")
        if found is None:
            long_enough = {s for s in self._secrets() if len(s) >= MIN_SECRET_CHARS}
            found = tuple(sorted(long_enough, key=len, reverse=True))
            object.__setattr__(self, "_secrets_cache", found)
        return found

    def longest_secret(self) -> int:
        """The length of the longest secret :meth:`redact` replaces (0 if none)."""
        found = self._redacted()
        return len(found[0]) if found else 0

    def configured_side_effects(self, tool: str) -> SideEffects | None:
        """The side-effect class configured for ``tool`` (the server's own name), if any."""
        configured = self.side_effects
        if isinstance(configured, Mapping):
            return configured.get(tool)
        return configured


@dataclass(frozen=True, kw_only=True)
class McpStdio(_Common):
    """An MCP server started as a local process, spoken to over its stdin and stdout.

    The process is started when the tools are opened (by ``run()``, or by
    ``async with McpTools(...)``), stopped when they are closed, and started
    again, on the next cycle or call, after it exited or crashed.

    Attributes:
        command: the executable (``sys.executable`` for a Python server).
        args: its arguments.
        env: extra environment variables (over the SDK's safe default set:
            ``PATH``, ``HOME``, ...); kept out of ``repr``.
        cwd: the working directory, or ``None`` for the current one.
        name: names the server in errors, logs and (with ``namespace=True``)
            tool names; default: the command's file name without suffix.
        prefix: put before each of its tool names (``"files_"``); overrides the
            namespace ``McpTools`` would give.
        side_effects: the side-effect class of its tools: one class for
            all, or a mapping of tool name (the server's) to class; unlisted
            tools are ``"non_idempotent"`` (never re-run after a crash). With
            ``trust_annotations=True``, only for tools whose annotations say
            nothing.
        trust_annotations: ``True`` says this server is trusted: its
            ``readOnlyHint`` / ``idempotentHint`` / ``destructiveHint`` set
            the side-effect class. Default ``False``: MCP calls annotations
            untrusted hints, and a server that falsely says ``readOnlyHint``
            would have a call re-run after a crash (charged twice for one
            idempotency key), so only your configuration counts.
        timeout: seconds per call of its tools (else ``McpTools``' timeout).
        connect_timeout: seconds to start, connect and list its tools.
        stop_grace: seconds the process gets to exit when it is stopped, once
            after its stdin is closed and once more after SIGTERM to its
            process group, before SIGKILL (default 2, the SDK's). A process
            that exits sooner is not waited for; a server that exits when
            its stdin closes ends the stop there, and a child it left
            running is not signalled (as with the SDK).

    Raises:
        ConfigurationError: an empty command, or a field of the wrong kind.
    """

    command: str
    args: Sequence[str] = ()
    env: Mapping[str, str] | None = field(default=None, repr=False)
    cwd: str | Path | None = None
    stop_grace: float = 2.0

    def __post_init__(self) -> None:
        if not isinstance(self.command, str) or not self.command.strip():
            raise ConfigurationError(
                f"McpStdio: command must be a non-empty str, got {self.command!r}"
            )
        if isinstance(self.args, str) or not all(isinstance(a, str) for a in self.args):
            raise ConfigurationError("McpStdio: args must be a sequence of str (not one str)")
        object.__setattr__(self, "args", tuple(self.args))
        if self.env is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()
        ):
            raise ConfigurationError("McpStdio: env must map str to str")
        if not self.name:
            stem = Path(self.command).stem
            fallback = re.sub(r"[^A-Za-z0-9_-]", "_", stem)[:64] or "server"
            object.__setattr__(self, "name", fallback)
        self._check_common("McpStdio")
        grace = self.stop_grace
        if (
            isinstance(grace, bool)
            or not isinstance(grace, int | float)
            or not 0 <= grace <= sys.float_info.max  # finite (an int too big for a float too)
        ):
            raise ConfigurationError(
                f"McpStdio {self.name!r}: stop_grace must be a finite number of seconds >= 0, "
                f"got {grace!r}"
            )

    def _secrets(self) -> list[str]:
        return list((self.env or {}).values())

    def describe(self) -> str:
        """How errors and logs name it (no environment)."""
        return f"MCP server {self.name!r} (stdio: {os.path.basename(self.command)})"


@dataclass(frozen=True, kw_only=True)
class McpHttp(_Common):
    """An MCP server at a streamable-HTTP URL.

    Attributes:
        url: the endpoint, ``http://`` or ``https://`` (e.g.
            ``"http://127.0.0.1:8000/mcp"``).
        headers: sent with every request (``{"Authorization": "Bearer ..."}``);
            kept out of ``repr``, errors and logs.
        name: names the server; default: the URL's host (and port).

    The other fields are :class:`McpStdio`'s.

    Raises:
        ConfigurationError: a URL that is not http(s), headers that are not
            str to str, or a field of the wrong kind.
    """

    url: str
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise ConfigurationError(f"McpHttp: url must be a str, got {type(self.url).__name__}")
        try:
            parts = urlsplit(self.url)
            host = parts.hostname
            port = parts.port
        except ValueError:
            raise ConfigurationError(
                f"McpHttp: not a valid URL: {redact_url(self.url)!r}"
            ) from None
        if parts.scheme not in ("http", "https") or not host:
            raise ConfigurationError(
                f"McpHttp: url must be http:// or https:// with a host, got "
                f"{redact_url(self.url)!r}"
            )
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.headers.items()):
            raise ConfigurationError("McpHttp: headers must map str to str")
        if not self.name:
            fallback = host if port is None else f"{host}_{port}"
            object.__setattr__(self, "name", re.sub(r"[^A-Za-z0-9_-]", "_", fallback)[:64])
        self._check_common("McpHttp")

    def __repr__(self) -> str:
        return f"McpHttp(name={self.name!r}, url={redact_url(self.url)!r})"

    def _secrets(self) -> list[str]:
        found = list(self.headers.values())
        for value in self.headers.values():  # "Bearer <token>": the token alone, too
            found.extend(value.split()[1:])
        parts = urlsplit(self.url)
        found.extend(x for x in (parts.password, parts.username) if x)
        found.extend(value for _, value in parse_qsl(parts.query) if value)
        if parts.query:
            found.append(parts.query)
        return found

    def describe(self) -> str:
        """How errors and logs name it (no headers, no credentials)."""
        return f"MCP server {self.name!r} ({redact_url(self.url)})"


McpServer: TypeAlias = McpStdio | McpHttp
"""An MCP server configuration."""
