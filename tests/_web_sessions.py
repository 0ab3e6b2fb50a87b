"""Recorded sessions and an ASGI event-stream reader for the live view's tests.

:func:`record` writes, through the public API, a session ``weather`` (a
user question, a tool call, its result, the answer: four batches) into an
SQLite file. :func:`add_user_message` appends one more batch from outside a
machine, as an application does between runs.

:class:`Server` runs ``serve`` (uvicorn) in a child process on a free port.

:func:`open_events` drives an ASGI app directly (scope, receive, send), so a
never-ending ``text/event-stream`` response can be read event by event on
asyncio and trio alike (httpx's ``ASGITransport`` buffers a whole response
before returning it), and leaving the block is a real client disconnect.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
from anyio.streams.memory import MemoryObjectReceiveStream

from stepmachine import (
    AppendMessage,
    Message,
    ModelInference,
    Runtime,
    StateMachine,
    Tools,
    submit,
    tool,
)
from stepmachine.stores import SQLiteStore
from stepmachine.testing import ScriptedModel, call, reply

SESSION = "weather"
HANG = 30.0  # seconds: a stream silent this long is stuck (not a timing threshold)
STARTUP_LIMIT = 60.0  # seconds before a server that never answers fails the test
ROOT = Path(__file__).resolve().parent.parent


@tool(thread=False)
def forecast(city: str) -> str:
    """Tomorrow's weather in ``city``."""
    return f"sunny in {city} <b>tomorrow</b>"


async def record(path: Path) -> int:
    """Write the ``weather`` session into a new SQLite store at ``path``; its revision."""
    async with await SQLiteStore.open(path) as store:
        await store.create(SESSION, conversation=[Message.user("Weather in <Paris>?", id="u1")])
        machine = StateMachine([Tools([forecast]), ModelInference(instructions="Be brief.")])
        model = ScriptedModel([call(("forecast", {"city": "Paris"})), reply("Sunny & warm.")])
        session = await machine.run(Runtime(store=store, model=model), SESSION)
        return session.revision


async def add_user_message(store: SQLiteStore, text: str) -> int:
    """Append a user message to ``weather`` as one batch; the new revision."""
    count = len((await store.load(SESSION)).conversation)
    message = Message.user(text, id=f"extra-{count}")
    return (await submit(store, SESSION, [AppendMessage(message)])).revision


def parse_event(block: str) -> dict[str, Any]:
    """One event block as ``{"id", "event", "data", "retry", "comments"}`` (``data`` decoded)."""
    event: dict[str, Any] = {"id": None, "event": None, "data": None, "retry": None, "comments": []}
    for line in block.split("\n"):
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "":
            event["comments"].append(value)
        elif field == "data":
            event["data"] = json.loads(value)
        else:
            event[field] = value
    return event


class EventReader:
    """Reads a streaming ASGI response one server-sent event at a time."""

    def __init__(self, messages: MemoryObjectReceiveStream[dict[str, Any]]) -> None:
        self._messages = messages
        self._buffer = ""
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.ended = False

    async def start(self) -> None:
        """Wait for the response's start (status and headers)."""
        message = await self._messages.receive()
        assert message["type"] == "http.response.start", message
        self.status = message["status"]
        self.headers = {k.decode(): v.decode() for k, v in message["headers"]}

    async def next(self) -> dict[str, Any] | None:
        """The next event block, or ``None`` when the response ended.

        Raises:
            TimeoutError: nothing came for :data:`HANG` seconds (a hang guard,
                so a stream that never sends fails its test instead of stalling it).
        """
        while "\n\n" not in self._buffer:
            if self.ended:
                return None
            with anyio.fail_after(HANG):
                message = await self._messages.receive()
            self._buffer += message.get("body", b"").decode()
            self.ended = not message.get("more_body", False)
        block, self._buffer = self._buffer.split("\n\n", 1)
        return parse_event(block)

    async def next_of(self, *kinds: str) -> dict[str, Any] | None:
        """The next event whose ``event`` is one of ``kinds`` (others skipped), or ``None``."""
        while True:
            event = await self.next()
            if event is None or event["event"] in kinds:
                return event


@contextlib.asynccontextmanager
async def open_events(
    app: Any, path: str, query: str = "", headers: dict[str, str] | None = None
) -> AsyncIterator[EventReader]:
    """A GET of ``path`` on ``app``, read as an event stream; leaving disconnects.

    On leaving, the client disconnects and the app's call must end by itself
    (the block waits for it, so a stream that ignores the disconnect hangs
    the test instead of passing).
    """
    sender, receiver = anyio.create_memory_object_stream[dict[str, Any]](1000)
    disconnected = anyio.Event()
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await sender.send(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [
            (k.lower().encode(), v.encode())
            for k, v in {"host": "127.0.0.1", **(headers or {})}.items()
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }
    async with anyio.create_task_group() as group, receiver, sender:
        group.start_soon(app, scope, receive, send)
        reader = EventReader(receiver)
        await reader.start()
        try:
            yield reader
        finally:
            disconnected.set()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Server:
    """``serve(store_url, port=...)`` in a child process; :meth:`stop` interrupts it."""

    def __init__(
        self, db: Path, port: int, log: Path, *, options: str = "", nofile: int | None = None
    ) -> None:
        """Start it; ``options`` are more ``serve`` keyword arguments (Python source,
        ``", max_connections=5"``); ``nofile`` limits the child's open files."""
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self._log = log
        code = (
            "import resource\n"
            f"limit = {nofile!r}\n"
            "if limit is not None:\n"
            "    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))\n"
            "from stepmachine.inspector._web import serve\n"
            f"serve({f'sqlite:///{db}'!r}, port={port}, poll_interval=0.05, "
            f"log_level='warning'{options})\n"
        )
        paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        with log.open("ab") as sink:
            self._process = subprocess.Popen(
                [sys.executable, "-c", code], stdout=sink, stderr=sink, env=env, cwd=ROOT
            )
        self._wait_until_up()

    def _wait_until_up(self) -> None:
        deadline = time.monotonic() + STARTUP_LIMIT
        while True:
            assert self._process.poll() is None, self._log.read_text()
            try:
                if httpx.get(self.url + "/api/sessions", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server never answered"
            time.sleep(0.05)

    def stop(self) -> None:
        """Ctrl-C the server and wait for it to exit; it must exit cleanly."""
        self._process.send_signal(signal.SIGINT)
        returncode = self._process.wait(timeout=STARTUP_LIMIT)
        log = self._log.read_text()
        assert returncode == 0, log
        assert "Traceback" not in log, log
        assert "ERROR" not in log, log
