"""The live view against hostile clients: a DNS-rebinding page, and idle or half-open connections.

Host names: only requests addressed to loopback (``localhost``,
``127.0.0.0/8``, ``[::1]``, any port) or to a host given with
``allowed_hosts`` (``--allow-host``) are answered; the others get 421 and a
short text saying how to allow the host; an ``Origin`` of another host gets
403. Checked on the app (every route) and on a real server with real
requests.

Connections: a real server on loopback, in a child process whose open-file
limit is low, is sent many connections that never complete a request (some
silent, some with half a request's headers); it still answers a real
request, and closes the idle ones by itself. Loop counts are bounded and
every wait has a hang guard (not a timing threshold).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest
from _web_sessions import HANG, SESSION, Server, free_port, record
from hypothesis import given
from hypothesis import strategies as st

from stepmachine.inspector._web import create_app
from stepmachine.stores import MemoryStore

ROUTES = ("/", "/api/sessions", "/api/sessions/s", "/sessions/s", "/nowhere")


async def _app(**options: object) -> object:
    store = MemoryStore()
    await store.create("s")
    return create_app(store, **options)  # type: ignore[arg-type]


async def _get(app: object, path: str, host: str | None, **headers: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        request = http.build_request("GET", path, headers=headers)
        if host is None:
            del request.headers["host"]
        else:
            request.headers["host"] = host
        return await http.send(request)


@pytest.mark.parametrize(
    "host",
    ["localhost", "localhost:8000", "LOCALHOST.", "127.0.0.1", "127.3.4.5:80", "[::1]", "[::1]:9"],
)
async def test_loopback_hosts_are_answered(host: str) -> None:
    app = await _app()
    response = await _get(app, "/api/sessions", host)
    assert response.status_code == 200, response.text
    assert response.json()[0]["id"] == "s"


@pytest.mark.parametrize(
    "host",
    [
        "attacker.example:8000",
        "attacker.example",
        "localhost.attacker.example",
        "127.0.0.1.nip.io",
        "0.0.0.0:8000",
        "192.168.1.5",
        "[::ffff:7f00:1]x",
        "localhost:80x",
        "",
        None,
    ],
)
async def test_other_hosts_are_refused_on_every_route(host: str | None) -> None:
    """Found: no Host check; ``curl -H 'Host: attacker.example:8000' .../api/sessions`` answered."""
    app = await _app()
    for path in ROUTES:
        response = await _get(app, path, host)
        assert response.status_code == 421, (path, response.text)
        assert "--allow-host" in response.text
        assert '"s"' not in response.text


async def test_an_allowed_host_is_answered_and_the_refusal_says_how() -> None:
    refused = await _get(await _app(), "/api/sessions", "view.internal:8000")
    assert "stepmachine serve --allow-host view.internal" in refused.text
    app = await _app(allowed_hosts=["View.Internal", "10.0.0.7:8000"])
    for host in ("view.internal", "view.internal:8000", "10.0.0.7", "localhost"):
        response = await _get(app, "/api/sessions", host)
        assert response.status_code == 200, host
    assert (await _get(app, "/api/sessions", "other.internal")).status_code == 421
    with pytest.raises(ValueError, match="--allow-host"):
        create_app(MemoryStore(), allowed_hosts=["bad:port:x"])


async def test_a_request_from_another_origin_is_refused() -> None:
    app = await _app(allowed_hosts=["view.internal"])
    for origin in ("http://attacker.example", "null", "file://", "http://127.0.0.1.nip.io:8000"):
        response = await _get(app, "/api/sessions", "127.0.0.1:8000", origin=origin)
        assert response.status_code == 403, origin
        assert "--allow-host" in response.text
    for origin in ("http://127.0.0.1:8000", "http://localhost:1", "https://view.internal"):
        response = await _get(app, "/api/sessions", "127.0.0.1:8000", origin=origin)
        assert response.status_code == 200, origin


async def test_the_refusal_shows_a_hostile_host_escaped() -> None:
    response = await _get(await _app(), "/", "a\u202eb.example")
    assert response.status_code == 421
    assert "\u202e" not in response.text
    assert "\\u202e" in response.text


@given(
    st.from_regex(r"\A[a-z0-9-]{0,10}[a-z][a-z0-9-]{0,10}(\.[a-z0-9-]{1,10}){0,3}\Z"),
    st.sampled_from(["", ":80", ":8000", "."]),
)
def test_a_dns_name_other_than_localhost_is_never_loopback(name: str, suffix: str) -> None:
    from stepmachine.inspector._hosts import host_name, is_loopback

    parsed = host_name(name + suffix)
    assert parsed == name
    assert is_loopback(parsed) == (name == "localhost")
    assert not is_loopback(host_name(f"127.0.0.1.{name}{suffix}") or "")


# -- a real server ------------------------------------------------------------------------------


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "agent.sqlite3"
    anyio.run(record, path)
    return path


@contextlib.contextmanager
def serving(db: Path, tmp_path: Path, **kwargs: object) -> Iterator[Server]:
    running = Server(db, free_port(), tmp_path / "server.log", **kwargs)  # type: ignore[arg-type]
    try:
        yield running
    finally:
        running.stop()


def raw_get(port: int, host: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=HANG) as sock:
        sock.sendall(f"GET /api/sessions HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
        return reply


def test_a_real_server_refuses_a_rebinding_host(db: Path, tmp_path: Path) -> None:
    with serving(db, tmp_path, options=", allowed_hosts=['view.internal']") as running:
        refused = raw_get(running.port, f"attacker.example:{running.port}")
        assert refused.startswith(b"HTTP/1.1 421 "), refused
        for host in (f"127.0.0.1:{running.port}", f"localhost:{running.port}", "view.internal"):
            assert raw_get(running.port, host).startswith(b"HTTP/1.1 200 "), host


IDLE = 200
"""Connections that never complete a request: more than the child may keep open (128 files)."""


def test_idle_and_half_open_connections_neither_starve_the_server_nor_stay_open(
    db: Path, tmp_path: Path
) -> None:
    """Found: 1,124 idle connections left the server answering nothing (no header or idle
    timeout, no cap). Now each has a deadline for its request's headers, and at most
    ``max_connections`` are open: the one waiting longest is closed to make room."""
    options = ", header_timeout=1.0, max_connections=8"
    with serving(db, tmp_path, options=options, nofile=128) as running:
        idle: list[socket.socket] = []
        try:
            for n in range(IDLE):
                sock = socket.create_connection(("127.0.0.1", running.port), timeout=HANG)
                if n % 2:  # half a request: headers that never end
                    sock.sendall(b"GET /api/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: ")
                idle.append(sock)
            # A real request is answered while they are open.
            with httpx.Client(base_url=running.url, timeout=HANG) as http:
                response = http.get(f"/api/sessions/{SESSION}")
            assert response.status_code == 200
            assert response.json()["id"] == SESSION
            # Every idle connection is closed by the server (EOF or reset), none answered.
            deadline = time.monotonic() + HANG
            for sock in idle:
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                with contextlib.suppress(ConnectionResetError):
                    assert sock.recv(1024) == b""
        finally:
            for sock in idle:
                sock.close()
        # And the server still answers afterwards.
        with httpx.Client(base_url=running.url, timeout=HANG) as http:
            assert http.get("/api/sessions").status_code == 200


def test_a_connection_sending_its_headers_a_byte_at_a_time_is_closed(
    db: Path, tmp_path: Path
) -> None:
    with serving(db, tmp_path, options=", header_timeout=0.5") as running:
        request = b"GET /api/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 400
        closed = False
        with socket.create_connection(("127.0.0.1", running.port), timeout=HANG) as sock:
            for byte in request:  # bounded: at most len(request) sends
                try:
                    sock.sendall(bytes([byte]))
                    sock.settimeout(0.05)
                    if sock.recv(1024) == b"":
                        closed = True
                        break
                except TimeoutError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
        assert closed, "the server kept a connection whose headers never ended"
