"""The live view (stepmachine.inspector create_app): pages, JSON, errors, the resumable stream.

The app reads an SQLite store opened read-only while a second connection
writes to it, as ``stepmachine serve`` does while an agent runs. Pages and
JSON go through httpx's ``ASGITransport``; the event stream through
:func:`_web_sessions.open_events` (an ASGI driver: ``ASGITransport`` waits for
a whole response, and an event stream never ends). Everything runs on asyncio
and trio.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest
from _web_sessions import (
    HANG,
    ROOT,
    SESSION,
    Server,
    add_user_message,
    free_port,
    open_events,
    parse_event,
    record,
)
from browser import browser, page  # noqa: F401 - the shared fixtures
from hypothesis import given
from hypothesis import strategies as st

from stepmachine import (
    AppendMessage,
    Codec,
    ConfigurationError,
    Event,
    Message,
    ReplaceConversation,
    Store,
    TextDelta,
    ToolStarted,
    submit,
)
from stepmachine.inspector import inspection_codec, session_view
from stepmachine.inspector._html import render_html
from stepmachine.inspector._live import LiveHub
from stepmachine.inspector._open import open_store
from stepmachine.inspector._sse import parse_cursor
from stepmachine.inspector._view import load_view
from stepmachine.inspector._web import create_app
from stepmachine.inspector._web_extra import require_web
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore


class Stores(msgspec.Struct):
    """A writer and a read-only reader on one database, and the recorded revision."""

    writer: SQLiteStore
    reader: SQLiteStore
    revision: int


@pytest.fixture
async def stores(tmp_path: Path) -> AsyncIterator[Stores]:
    path = tmp_path / "agent.sqlite3"
    revision = await record(path)
    writer = await SQLiteStore.open(path)
    reader = await SQLiteStore.open(path, inspection_codec(), read_only=True)
    try:
        yield Stores(writer, reader, revision)
    finally:
        await reader.aclose()
        await writer.aclose()


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")


# -- pages and JSON ----------------------------------------------------------------


async def test_the_list_page_links_every_session_with_its_status(stores: Stores) -> None:
    await stores.writer.create("empty")
    async with client(create_app(stores.reader)) as http:
        page = await http.get("/")
        listed = (await http.get("/api/sessions")).json()
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"].startswith("default-src 'none'")
    assert f'href="/sessions/{SESSION}"' in page.text
    assert 'href="/sessions/empty"' in page.text
    assert "done" in page.text
    assert [row["id"] for row in listed] == ["empty", SESSION]
    empty, weather = listed
    assert empty == {"id": "empty", "revision": 0, "status": "idle", "last_activity": None}
    assert weather["revision"] == stores.revision
    assert weather["status"] == "done"
    (last,) = await stores.reader.batches(SESSION, after=stores.revision - 1)
    assert weather["last_activity"] == last.timestamp


async def test_the_session_page_is_the_timeline_with_the_live_script(stores: Stores) -> None:
    async with client(create_app(stores.reader)) as http:
        page = await http.get(f"/sessions/{SESSION}")
    assert page.status_code == 200
    for revision in range(1, stores.revision + 1):
        assert f'id="rev-{revision}"' in page.text
    assert 'id="timeline"' in page.text
    assert "new EventSource(" in page.text
    assert f'({{"events":"/sessions/{SESSION}/events","revision":{stores.revision}}})' in page.text
    assert "Weather in <Paris>" not in page.text  # escaped by the renderer


async def test_the_json_view_is_the_session_view(stores: Stores) -> None:
    async with client(create_app(stores.reader)) as http:
        got = (await http.get(f"/api/sessions/{SESSION}")).json()
    session = await stores.reader.load(SESSION)
    expected = session_view(session, await stores.reader.batches(SESSION))
    assert got == msgspec.json.decode(msgspec.json.encode(expected))


@pytest.mark.parametrize("prefix", ["/sessions/", "/api/sessions/"])
async def test_an_unknown_session_is_a_404_page(stores: Stores, prefix: str) -> None:
    async with client(create_app(stores.reader)) as http:
        page = await http.get(prefix + "nobody")
        events = await http.get("/sessions/nobody/events")
    assert page.status_code == 404
    assert events.status_code == 404
    assert "Traceback" not in page.text
    assert "nobody" in page.text


HOSTILE = [
    "%2e%2e",  # ..
    "..%2F..%2Fetc%2Fpasswd",
    "a" * 5000,
    "%C3%A9t%C3%A9",  # été
    "%E2%80%AEevil",  # right-to-left override
    "%00nul",
    "%3Cscript%3Ealert(1)%3C%2Fscript%3E",
    "CON",
]


@pytest.mark.parametrize("raw", HOSTILE, ids=range(len(HOSTILE)))
@pytest.mark.parametrize("suffix", ["", "/events"])
async def test_a_hostile_session_id_is_a_clean_400_or_404(
    stores: Stores, raw: str, suffix: str
) -> None:
    async with client(create_app(stores.reader)) as http:
        for prefix in ("/sessions/", "/api/sessions/"):
            if prefix.startswith("/api") and suffix:
                continue
            response = await http.get(prefix + raw + suffix)
            assert response.status_code in (400, 404), (prefix, raw, response.text[:200])
            assert "Traceback" not in response.text
            assert "<script>" not in response.text


async def test_undecodable_stored_data_is_a_500_page_with_the_message_escaped(
    stores: Stores,
) -> None:
    class AppData(msgspec.Struct, frozen=True):
        note: str = ""

    path = stores.writer._path
    async with await SQLiteStore.open(path, Codec(AppData)) as app_store:
        await app_store.create("app", AppData(note="<script>alert(1)</script>"))
    async with client(create_app(stores.reader)) as http:
        page = await http.get("/sessions/app")
        api = await http.get("/api/sessions/app")
        listed = await http.get("/")
    assert page.status_code == 500
    assert "Stored data cannot be read" in page.text
    assert "<script>alert" not in page.text
    assert api.status_code == 500
    assert api.json()["message"]
    assert listed.status_code == 200  # the other sessions are still listed
    assert "unreadable" in listed.text


# -- the event stream ----------------------------------------------------------------


async def read_batches(reader: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The ``batch`` events up to the next ``status`` event, and that status."""
    batches = []
    while True:
        event = await reader.next_of("batch", "status")
        assert event is not None
        if event["event"] == "status":
            return batches, event
        batches.append(event)


async def test_the_stream_sends_every_batch_in_order_then_the_status(stores: Stores) -> None:
    app = create_app(stores.reader)
    view = session_view(await stores.reader.load(SESSION), await stores.reader.batches(SESSION))
    async with open_events(app, f"/sessions/{SESSION}/events") as reader:
        assert reader.status == 200
        assert reader.headers["content-type"].startswith("text/event-stream")
        assert reader.headers["cache-control"] == "no-cache"
        first = await reader.next()
        assert first is not None
        assert first["retry"] == "1000"
        batches, status = await read_batches(reader)
    assert [event["id"] for event in batches] == [f"{n}.0" for n in range(1, stores.revision + 1)]
    for event, expected in zip(batches, view["batches"], strict=True):
        data = dict(event["data"])
        html = data.pop("html")
        assert f'id="rev-{expected["revision"]}"' in html
        assert data == msgspec.json.decode(msgspec.json.encode(expected))
    assert status["id"] is None  # a status never moves the client's position
    assert status["data"] == {"revision": stores.revision, "status": "done"}


@pytest.mark.parametrize("how", ["last-event-id", "query", "both"])
async def test_a_resumed_stream_sends_exactly_the_missing_batches(stores: Stores, how: str) -> None:
    app = create_app(stores.reader)
    for seen in range(stores.revision + 1):
        headers = {"Last-Event-ID": f"{seen}.0"} if how != "query" else {}
        # With both, the header wins: a browser reconnects with its first URL.
        query = f"after={seen}&seq=0" if how == "query" else "after=0" if how == "both" else ""
        async with open_events(app, f"/sessions/{SESSION}/events", query, headers) as reader:
            batches, status = await read_batches(reader)
        revisions = [event["data"]["revision"] for event in batches]
        assert revisions == list(range(seen + 1, stores.revision + 1)), seen
        assert status["data"]["revision"] == stores.revision


async def test_batches_written_while_the_stream_is_open_arrive_once_in_order(
    stores: Stores,
) -> None:
    app = create_app(stores.reader, poll_interval=0.01)
    path = f"/sessions/{SESSION}/events"
    async with open_events(app, path, f"after={stores.revision}") as reader:
        caught_up, status = await read_batches(reader)
        assert caught_up == []
        assert status["data"] == {"revision": stores.revision, "status": "done"}
        written = [await add_user_message(stores.writer, f"more <{n}>") for n in range(3)]
        arrived = []
        while len(arrived) < len(written):
            event = await reader.next_of("batch", "status")
            assert event is not None
            if event["event"] == "batch":
                arrived.append(event)
            else:
                assert event["data"]["status"] == "idle"  # a user message waits for a run
    assert [event["id"] for event in arrived] == [f"{n}.0" for n in written]
    texts = [event["data"]["effects"][0]["message"]["parts"][0]["text"] for event in arrived]
    assert texts == ["more <0>", "more <1>", "more <2>"]
    assert all("more &lt;" in event["data"]["html"] for event in arrived)
    # The last id a client saw brings back nothing already seen, and what came after.
    late = await add_user_message(stores.writer, "after the disconnect")
    headers = {"Last-Event-ID": arrived[-1]["id"]}
    async with open_events(app, path, headers=headers) as reader:
        batches, _ = await read_batches(reader)
    assert [event["id"] for event in batches] == [f"{late}.0"]


async def test_a_quiet_stream_sends_keepalive_comments(stores: Stores) -> None:
    app = create_app(stores.reader, poll_interval=0.01, keepalive=0.05)
    async with open_events(app, f"/sessions/{SESSION}/events") as reader:
        await read_batches(reader)
        event = await reader.next()
        if event is not None and event["event"] == "head":  # after the batches' status
            event = await reader.next()
    assert event is not None
    assert event["comments"] == ["keepalive"]
    assert event["event"] is None


async def test_closing_the_app_ends_its_streams(stores: Stores) -> None:
    app = create_app(stores.reader, poll_interval=0.01)
    async with open_events(app, f"/sessions/{SESSION}/events") as reader:
        await read_batches(reader)
        app.state.streams.close()
        while (event := await reader.next()) is not None:
            assert event["event"] != "batch"
        assert reader.ended


async def test_a_client_that_goes_away_ends_its_stream_quietly(
    stores: Stores, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(stores.reader, poll_interval=0.01)
    with caplog.at_level(logging.DEBUG):
        for _ in range(3):
            async with open_events(app, f"/sessions/{SESSION}/events") as reader:
                await reader.next()  # leaving the block disconnects, mid-stream
    # open_events waits for the app's call to end: reaching here means it did.
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert (await stores.reader.load(SESSION)).revision == stores.revision


@pytest.mark.parametrize(
    ("headers", "query"),
    [
        ({"Last-Event-ID": "x.0"}, ""),
        ({"Last-Event-ID": "-1.0"}, ""),
        ({"Last-Event-ID": "1.2.3"}, ""),
        ({}, "after=-3"),
        ({}, "after=1&seq=z"),
        ({}, "after=" + "9" * 100),
    ],
)
async def test_a_malformed_position_is_a_400(
    stores: Stores, headers: dict[str, str], query: str
) -> None:
    async with client(create_app(stores.reader)) as http:
        response = await http.get(f"/sessions/{SESSION}/events?{query}", headers=headers)
    assert response.status_code == 400


@given(revision=st.integers(0, 10**30), seq=st.integers(0, 10**30))
def test_an_event_id_reads_back_as_its_position(revision: int, seq: int) -> None:
    assert parse_cursor(f"{revision}.{seq}", "7", "7") == (revision, seq)
    assert parse_cursor(None, str(revision), str(seq)) == (revision, seq)
    assert parse_cursor("", str(revision), None) == (revision, 0)


# -- in-process live deltas ------------------------------------------------------------


async def test_live_events_follow_the_batch_of_their_revision(stores: Stores) -> None:
    hub = LiveHub()
    app = create_app(stores.reader, poll_interval=0.01, live=hub)
    path = f"/sessions/{SESSION}/events"
    now = stores.revision
    async with open_events(app, path, f"after={now}") as reader:
        await read_batches(reader)
        await hub.emit(Event(SESSION, now, 0, TextDelta("Hel")))
        await hub.emit(Event(SESSION, now - 1, 5, TextDelta("stale")))  # dropped
        await hub.emit(Event(SESSION, now, 1, TextDelta("lo")))
        first = await reader.next_of("live")
        second = await reader.next_of("live")
    assert first is not None
    assert second is not None
    assert (first["id"], first["data"]) == (
        f"{now}.1",
        {"revision": now, "seq": 0, "kind": "text_delta", "text": "Hel"},
    )
    assert (second["id"], second["data"]["text"]) == (f"{now}.2", "lo")

    # Resuming after the first delta sends the second only.
    async with open_events(app, path, headers={"Last-Event-ID": f"{now}.1"}) as reader:
        await read_batches(reader)
        resumed = await reader.next_of("live")
    assert resumed is not None
    assert resumed["id"] == f"{now}.2"

    # A delta of the next revision waits for that revision's batch.
    async with open_events(app, path, f"after={now}&seq=2") as reader:
        await read_batches(reader)
        await hub.emit(Event(SESSION, now + 1, 0, ToolStarted("c1", "forecast")))
        written = await add_user_message(stores.writer, "go on")
        batch = await reader.next_of("batch", "live")
        live = await reader.next_of("batch", "live")
    assert written == now + 1
    assert batch is not None
    assert live is not None
    assert (batch["event"], batch["id"]) == ("batch", f"{written}.0")
    assert (live["event"], live["id"], live["data"]["kind"]) == (
        "live",
        f"{written}.1",
        "tool_started",
    )


async def test_a_hub_fed_by_a_real_run_streams_its_text(stores: Stores) -> None:
    from stepmachine import ModelInference, Runtime, StateMachine
    from stepmachine.testing import ScriptedModel

    hub = LiveHub()
    app = create_app(stores.reader, poll_interval=0.01, live=hub)
    await add_user_message(stores.writer, "And on Sunday?")
    machine = StateMachine([ModelInference(instructions="Be brief.")])
    model = ScriptedModel(["Rain on Sunday, take an umbrella."], chunk_size=4)
    before = (await stores.reader.load(SESSION)).revision
    async with open_events(app, f"/sessions/{SESSION}/events", f"after={before}") as reader:
        await read_batches(reader)
        await machine.run(Runtime(store=stores.writer, model=model), SESSION, emitter=hub)
        text = ""
        while True:
            event = await reader.next_of("live", "batch")
            assert event is not None
            if event["event"] == "batch":
                break
            if event["data"]["kind"] == "text_delta":
                text += event["data"]["text"]
    # The deltas came before the batch they led to (they follow the revision before it).
    assert text == "Rain on Sunday, take an umbrella."
    assert event["data"]["revision"] == before + 1
    message: Message = (await stores.reader.load(SESSION)).conversation[-1]
    assert message.text == text


# -- serve(): uvicorn in a child process, over real HTTP -------------------------------


def sse_blocks(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The events of a streaming httpx response, parsed as they arrive."""
    lines: list[str] = []
    for line in response.iter_lines():
        if line:
            lines.append(line)
        elif lines:
            yield parse_event("\n".join(lines))
            lines = []


def test_serve_streams_over_http_and_stops_cleanly_with_a_stream_open(tmp_path: Path) -> None:
    db = tmp_path / "agent.sqlite3"
    revision = anyio.run(record, db)
    server = Server(db, free_port(), tmp_path / "server.log")
    stopped = False
    try:
        with httpx.Client(base_url=server.url, timeout=HANG) as http:
            assert http.get("/").status_code == 200
            assert http.get("/sessions/nobody").status_code == 404
            headers = {"Last-Event-ID": f"{revision - 1}.0"}
            with http.stream("GET", f"/sessions/{SESSION}/events", headers=headers) as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                events = sse_blocks(response)
                got = list(itertools.takewhile(lambda e: e["event"] != "status", events))
                assert [e["id"] for e in got if e["event"] == "batch"] == [f"{revision}.0"]
                written = anyio.run(append_one, db)
                batch = next(e for e in events if e["event"] == "batch")
                assert batch["id"] == f"{written}.0"
                server.stop()  # returns once the process exited cleanly (code 0, no error)
                stopped = True
                ended = [e["event"] for e in events]
                assert ended in ([], ["status"], ["status", "head"])  # then the stream ended
    finally:
        if not stopped:
            server.stop()


async def append_one(db: Path) -> int:
    async with await SQLiteStore.open(db) as store:
        return await add_user_message(store, "over real HTTP")


# -- without the web extra --------------------------------------------------------------


def test_without_the_extra_require_web_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "uvicorn" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ConfigurationError, match=r"install stepmachine\[web\].*uvicorn"):
        require_web()


def test_importing_the_live_view_without_the_extra_says_what_to_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['starlette'] = None  # as if not installed\n"
        "try:\n"
        "    import stepmachine.inspector._web\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert "install stepmachine[web]" in done.stdout
    require_web()  # here the extra is installed


async def test_stored_data_that_stops_decoding_is_a_failure_event_not_an_error(
    tmp_path: Path,
) -> None:
    """``event: error`` would read as a lost connection to a browser's EventSource (its
    onerror fires for that name) and the page would reconnect to the same records forever:
    the stream names it ``failure`` and ends."""
    from stepmachine import Effect

    class Flag(Effect, frozen=True, tag="myapp.flag"):
        raised: bool = True

        def apply(self, session: Any) -> Any:
            return session

    path = tmp_path / "agent.sqlite3"
    await record(path)
    async with await SQLiteStore.open(path, inspection_codec(), read_only=True) as reader:
        app = create_app(reader, poll_interval=0.01, keepalive=60.0)
        async with open_events(app, f"/sessions/{SESSION}/events") as events:
            assert await events.next_of("status") is not None
            async with await SQLiteStore.open(path, Codec(effects=[Flag])) as writer:
                await submit(writer, SESSION, [Flag()])
            failure = await events.next_of("failure", "error")
            assert failure is not None
            assert failure["event"] == "failure"
            assert "myapp.flag" in failure["data"]["message"]
            assert await events.next() is None  # the stream ended


async def test_the_stream_sends_the_pages_head_after_new_batches(stores: Stores) -> None:
    """Found: the header's counters and the conversation kept their page-load values."""
    app = create_app(stores.reader, poll_interval=0.01)
    path = f"/sessions/{SESSION}/events"
    async with open_events(app, path, f"after={stores.revision}") as reader:
        await read_batches(reader)
        written = await add_user_message(stores.writer, "more <b>")
        with anyio.fail_after(HANG):  # keepalives would keep next_of waiting for ever
            head = await reader.next_of("head")
    assert head is not None
    assert head["id"] is None
    assert head["data"]["revision"] == written
    header, conversation = head["data"]["header"], head["data"]["conversation"]
    count = len((await stores.reader.load(SESSION)).conversation)
    assert f'<dd id="fact-messages">{count}</dd>' in header
    assert f'<dd id="fact-batches">{written}</dd>' in header
    assert conversation.startswith('<section id="conversation">')
    assert "more &lt;b&gt;" in conversation


async def test_a_tool_running_in_process_reads_running_not_outcome_unknown() -> None:
    """Found: a tool that was simply running read ``outcome unknown`` in the live view."""
    from stepmachine import ModelInference, Runtime, StateMachine, Tools, tool
    from stepmachine.stores import MemoryStore
    from stepmachine.testing import ScriptedModel, call

    may_finish = anyio.Event()

    @tool()
    async def slow(city: str) -> str:
        """Waits for the test."""
        await may_finish.wait()
        return f"hail in {city}"

    store, hub = MemoryStore(), LiveHub()
    await store.create("s", conversation=[Message.user("weather?", id="u1")])
    app = create_app(store, poll_interval=0.01, live=hub)
    machine = StateMachine([Tools([slow]), ModelInference(instructions="Be brief.")])
    model = ScriptedModel([call(("slow", {"city": "Lyon"})), "Hail."])
    seen: list[str] = []
    async with anyio.create_task_group() as group:
        group.start_soon(lambda: machine.run(Runtime(store=store, model=model), "s", emitter=hub))
        async with open_events(app, "/sessions/s/events") as reader:
            with anyio.move_on_after(HANG):  # keepalives would keep next_of waiting for ever
                while "running" not in seen:
                    event = await reader.next_of("status")
                    assert event is not None
                    seen.append(event["data"]["status"])
            may_finish.set()
            assert seen[-1:] == ["running"], seen
            while seen[-1] != "done":
                event = await reader.next_of("status")
                assert event is not None
                seen.append(event["data"]["status"])
    assert "outcome unknown" not in seen


BREAKS = "a\r\nevent: pwn\r\nid: 999.0\rdata: {}\r\n\r\nretry: 1\n\n\u2028\u2029\u0085: x\rb"


PWN = (
    "<script>window.__pwned = 1</script>"
    '<img src="http://198.51.100.1/x.png" onerror="window.__pwned = 2">'
    '<svg onload="window.__pwned = 3"></svg>'
    "</section></div><script>window.__pwned = 4</script><!--"
    '<iframe srcdoc="&lt;script&gt;parent.__pwned = 5&lt;/script&gt;"></iframe>'
    "<style>@import url(http://198.51.100.1/a.css);</style>"
    '<meta http-equiv="refresh" content="0;url=http://198.51.100.1/">'
    "\u2028</script>"
)


@pytest.mark.anyio
async def test_a_rewritten_message_shows_in_its_replacement() -> None:
    """A redaction (same id, new text) is what the replacement did: the entry shows it."""
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hello", id="u1")])
    said = Message.assistant("my card is 4111-SECRET", id="a1")
    await submit(store, "s", [AppendMessage(said)])
    session = await store.load("s")
    redacted = Message.assistant("my card is [REDACTED-XYZ]", id="a1")
    await submit(store, "s", [ReplaceConversation((session.conversation[0], redacted))])
    html = render_html(await load_view(store, "s"))
    start = html.index('id="rev-2"')
    entry = html[start : html.index("</section>", start)]
    assert "[REDACTED-XYZ]" in entry
    assert "1 rewritten" in entry
    assert "hello" not in entry  # the kept message is not repeated


# -- the event stream --------------------------------------------------------------


def spec_events(raw: str) -> list[dict[str, str]]:
    """Events as the SSE spec's parser reads them: lines end at CRLF, LF or CR."""
    events: list[dict[str, str]] = []
    fields: dict[str, str] = {}
    for line in re.split(r"\r\n|\r|\n", raw):
        if line == "":
            if fields:
                events.append(fields)
            fields = {}
            continue
        name, _, value = line.partition(":")
        if name:
            fields[name] = fields.get(name, "") + value.removeprefix(" ")
    return events


@pytest.mark.anyio
async def test_line_breaks_in_stored_text_cannot_split_or_forge_events(tmp_path: Path) -> None:
    path = tmp_path / "agent.sqlite3"
    revision = await record(path)
    async with await SQLiteStore.open(path) as writer:
        bad = Message.user(BREAKS, id="x\r\nid: 7")
        await submit(writer, SESSION, [AppendMessage(bad)], step="s\r\nevent: pwn")
    async with await SQLiteStore.open(path, inspection_codec(), read_only=True) as reader:
        app = create_app(reader, poll_interval=0.01)
        raw = ""
        async with open_events(app, f"/sessions/{SESSION}/events", f"after={revision}") as events:
            while "event: status" not in raw:
                with anyio.fail_after(30):
                    message = await events._messages.receive()
                raw += message.get("body", b"").decode()
    parsed = spec_events(raw)
    assert [e.get("event") for e in parsed] == [None, "batch", "status"]
    assert parsed[1]["id"] == f"{revision + 1}.0"
    batch = json.loads(parsed[1]["data"])
    (effect,) = batch["effects"]
    assert effect["message"]["id"] == "x\r\nid: 7"
    assert effect["message"]["parts"][0]["text"] == BREAKS
    assert batch["step"] == "s\r\nevent: pwn"


# -- the pages ---------------------------------------------------------------------


@pytest.fixture
async def served(tmp_path: Path) -> Any:
    path = tmp_path / "agent.sqlite3"
    await record(path)
    async with await SQLiteStore.open(path, inspection_codec(), read_only=True) as reader:
        yield create_app(reader, poll_interval=0.01)


@pytest.mark.anyio
async def test_the_session_page_sends_its_policy_as_a_header_too(served: Any) -> None:
    async with client(served) as http:
        response = await http.get(f"/sessions/{SESSION}")
    assert response.status_code == 200
    meta = re.search(r'http-equiv="Content-Security-Policy" content="([^"]*)"', response.text)
    assert meta is not None
    assert response.headers.get("content-security-policy") == meta.group(1).replace("&#x27;", "'")
    assert response.headers.get("x-content-type-options") == "nosniff"
    assert response.headers.get("referrer-policy") == "no-referrer"


@pytest.mark.anyio
@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
async def test_other_methods_are_a_405_that_says_what_is_allowed(served: Any, method: str) -> None:
    async with client(served) as http:
        for path in ("/", f"/sessions/{SESSION}", f"/sessions/{SESSION}/events", "/api/sessions"):
            response = await http.request(method, path)
            assert response.status_code == 405
            assert set(response.headers.get("allow", "").split(", ")) == {"GET", "HEAD"}


@pytest.mark.anyio
@pytest.mark.parametrize(
    "path",
    [
        "/sessions/..%2F..%2Fetc%2Fpasswd",
        "/sessions/%2e%2e",
        "/sessions/%252e%252e",
        "/sessions/" + "a" * 5000,
        "/sessions/caf%C3%A9",
        "/api/sessions/%00",
        "/api/sessions/CON",
        "/sessions/weather%3Cscript%3E/events",
    ],
)
async def test_hostile_paths_are_clean_errors(served: Any, path: str) -> None:
    async with client(served) as http:
        response = await http.get(path)
    assert response.status_code in (400, 404)
    assert "<script>" not in response.text
    assert "Traceback" not in response.text


def _snapshot(folder: Path) -> dict[str, str]:
    return {
        str(file.relative_to(folder)): hashlib.sha256(file.read_bytes()).hexdigest()
        for file in sorted(folder.rglob("*"))
        if file.is_file()
    }


async def _browse_and_stream(store: Store) -> None:
    app = create_app(store, poll_interval=0.01, keepalive=0.0)
    async with client(app) as http:
        for path in ("/", f"/sessions/{SESSION}", "/api/sessions", f"/api/sessions/{SESSION}"):
            assert (await http.get(path)).status_code == 200
        assert (await http.get("/sessions/nope")).status_code == 404
    async with open_events(app, f"/sessions/{SESSION}/events") as events:
        assert await events.next_of("status") is not None
        for _ in range(3):  # a keepalive comment after each quiet poll
            assert await events.next() is not None


@pytest.mark.anyio
async def test_browsing_and_streaming_never_write_an_sqlite_file(tmp_path: Path) -> None:
    await record(tmp_path / "agent.sqlite3")
    before = _snapshot(tmp_path)
    async with await open_store(f"sqlite:///{tmp_path / 'agent.sqlite3'}") as reader:  # as serve
        await _browse_and_stream(reader)
    after = _snapshot(tmp_path)
    # The reader, closing last, removes the -wal and -shm files SQLite made while it
    # read (as a writer's close does): the folder is as it was.
    assert after == before


@pytest.mark.anyio
async def test_browsing_and_streaming_never_write_a_file_store(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    async with await FileStore.open(folder) as writer:
        await writer.create(SESSION, conversation=[Message.user("hi <b>", id="u1")])
        for n in range(3):
            await submit(writer, SESSION, [AppendMessage(Message.user(f"more {n}", id=f"m{n}"))])
    before = _snapshot(folder)
    async with await open_store(f"file://{folder}") as reader:  # as serve opens it
        await _browse_and_stream(reader)
    assert _snapshot(folder) == before


@pytest.mark.anyio
async def test_a_client_ahead_of_the_session_is_told(tmp_path: Path) -> None:
    path = tmp_path / "agent.sqlite3"
    revision = await record(path)
    async with await SQLiteStore.open(path, inspection_codec(), read_only=True) as reader:
        app = create_app(reader, poll_interval=0.01, keepalive=0.0)
        query = f"after={revision + 10}"
        async with open_events(app, f"/sessions/{SESSION}/events", query) as events:
            status = await events.next_of("status")
            assert status is not None
            following = await events.next()
            # a keepalive comment means the stream went quiet with the client ahead
            assert following is None or following["event"] not in (None, "status")


# -- in the browser: hostile batches arriving live ---------------------------------


@pytest.fixture
def hostile_server(tmp_path: Path) -> Iterator[tuple[Server, Path]]:
    path = tmp_path / "agent.sqlite3"
    _in_worker(record, path)
    running = Server(path, free_port(), tmp_path / "server.log")
    try:
        yield running, path
    finally:
        running.stop()


async def _append_hostile(path: Path, count: int) -> int:
    async with await SQLiteStore.open(path) as store:
        session = await store.load(SESSION)
        revision = session.revision
        for n in range(count):
            message = Message.user(f"{n} {PWN}", id=f"p{n}")
            revision = (await submit(store, SESSION, [AppendMessage(message)], step=PWN)).revision
        return revision


def test_hostile_batches_arriving_live_run_nothing_and_fetch_nothing(
    page: Any,  # noqa: F811 - the fixture
    hostile_server: tuple[Server, Path],
) -> None:
    running, path = hostile_server
    requests: list[str] = []
    errors: list[str] = []
    dialogs: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.goto(f"{running.url}/sessions/{SESSION}")
    page.wait_for_selector('#live-indicator[data-state="live"]')
    last = _in_worker(_append_hostile, path, 3)
    page.wait_for_selector(f"#rev-{last}", state="attached")
    page.locator("details").evaluate_all("all => all.forEach(d => { d.open = true; })")
    assert page.evaluate("() => window.__pwned") is None
    assert page.evaluate("() => window.parent.__pwned") is None
    markup = "#timeline img, #timeline svg, #timeline iframe, #timeline meta"
    assert page.locator(markup).count() == 0
    assert page.locator("script").count() == 2  # the page's own and the live script
    timeline = page.inner_text("#timeline")
    assert timeline.count("window.__pwned = 1") == 6  # 3 step names, 3 texts
    assert dialogs == []
    assert errors == []
    assert all(url.startswith(running.url) for url in requests), requests


def _in_worker(function: Callable[..., Any], *args: Any) -> Any:
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(anyio.run, function, *args).result()
