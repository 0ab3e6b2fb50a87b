"""Which requests the live view answers: those addressed to loopback, or to a host it was told.

The live view shows every session's content to whoever can read its answers.
Binding to loopback keeps other machines out, but not a web page in the
user's own browser: a page on ``attacker.example`` whose name is made to
resolve to 127.0.0.1 (DNS rebinding) is then same-origin with the view and
reads ``/api/sessions``. Its requests still say ``Host: attacker.example``.
So :class:`HostGuard` answers only requests whose ``Host`` is loopback
(``localhost``, ``127.0.0.0/8``, ``[::1]``, any port) or a name the server
was given (``stepmachine serve --allow-host NAME``, for serving behind a
name: a reverse proxy, a LAN address), and refuses the others with ``421
Misdirected Request`` and a short text saying how to allow the host. A
request without ``Host`` is refused too (HTTP/1.1 requires one).

A request that carries ``Origin`` (a browser's cross-origin request, or any
request that would act) must come from a page of an allowed host as well,
else ``403``. Every route of the view only reads (``GET``); nothing acts, so
there is no other check to make.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ._visible import visible

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["HostGuard", "host_name", "is_loopback", "normalise_allowed"]

_SHOWN: int = 100


def host_name(host: str) -> str | None:
    """The name in a ``Host`` value (``name``, ``name:port``, ``[v6]:port``), lowercased.

    Returns ``None`` for a value that is not a host (empty, a bad port, an
    unclosed bracket). A trailing dot is dropped (``localhost.`` is ``localhost``).
    """
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        if end < 0:
            return None
        name, rest = host[1:end], host[end + 1 :]
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return None
        return name or None
    name, colon, port = host.partition(":")
    if colon and not (port.isascii() and port.isdigit()):
        return None
    name = name.removesuffix(".")
    return name or None


def is_loopback(name: str) -> bool:
    """Whether ``name`` (from :func:`host_name`) is ``localhost``, 127.0.0.0/8 or ::1."""
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def normalise_allowed(hosts: Iterable[str]) -> frozenset[str]:
    """The allow-list as names (``host_name`` of each; a port given is ignored).

    Raises:
        ValueError: an entry is not a host name (it says which).
    """
    names = set()
    for host in hosts:
        name = host_name(host)
        if name is None:
            raise ValueError(f"--allow-host takes a host name or address, not {host!r}")
        names.add(name)
    return frozenset(names)


class HostGuard:
    """ASGI middleware: answer only requests addressed to loopback or to an allowed host.

    See the module docstring. ``allowed`` is :func:`normalise_allowed`'s
    result. Lifespan messages pass through.
    """

    def __init__(self, app: ASGIApp, allowed: frozenset[str] = frozenset()) -> None:
        self._app = app
        self._allowed = allowed

    def allows(self, name: str | None) -> bool:
        """Whether a request to host ``name`` is answered."""
        return name is not None and (is_loopback(name) or name in self._allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan; no route takes a websocket
            await self._app(scope, receive, send)
            return
        headers = {key.lower(): value for key, value in scope.get("headers") or []}
        host = headers.get(b"host", b"").decode("utf-8", "replace")
        if not self.allows(host_name(host)):
            shown = visible(host[:_SHOWN]) if host else "no Host header"
            await _refuse(
                send,
                421,
                f"This stepmachine live view answers requests addressed to loopback "
                f"(localhost, 127.0.0.1, [::1]) only; this one was addressed to {shown!r}. "
                "To serve it under that name, start it with "
                f"'stepmachine serve --allow-host {visible(host_name(host) or 'NAME')[:_SHOWN]}'.",
            )
            return
        origin = headers.get(b"origin")
        if origin is not None:
            text = origin.decode("utf-8", "replace")
            parsed = urllib.parse.urlsplit(text)
            name = host_name(parsed.netloc) if parsed.scheme in ("http", "https") else None
            if not self.allows(name):
                await _refuse(
                    send,
                    403,
                    f"This stepmachine live view answers pages it serves only; this request "
                    f"came from {visible(text[:_SHOWN])!r}. To allow a page served under "
                    "another name, start it with 'stepmachine serve --allow-host NAME'.",
                )
                return
        await self._app(scope, receive, send)


async def _refuse(send: Send, status: int, text: str) -> None:
    body = (text + "\n").encode("utf-8")
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode("ascii")),
                (b"x-content-type-options", b"nosniff"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
