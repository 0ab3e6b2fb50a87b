"""An outside review of the HTML timeline and the live view: attacks and edge cases.

Covered: a replacement that rewrites an earlier message (a redaction) shows
the rewritten text; the event stream's framing survives every line break a
stored text can hold (read with a parser that follows the SSE spec's line
endings); the session page sends its Content-Security-Policy as a header too;
a 405 says which methods are allowed; browsing and streaming never write to
an SQLite file or a FileStore folder; a client whose cursor is beyond the
session's head is told; and, in a real chromium against a real server,
hostile batches that arrive over the stream are appended as text and run
nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from _web_sessions import SESSION, Server, free_port, open_events, record
from browser import browser, page  # noqa: F401 - the shared fixtures

from stepmachine import AppendMessage, Message, ReplaceConversation, Store, submit
from stepmachine.inspector import inspection_codec
from stepmachine.inspector._html import render_html
from stepmachine.inspector._open import open_store
from stepmachine.inspector._view import load_view
from stepmachine.inspector._web import create_app
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore

BREAKS = "a\r\nevent: pwn\r\nid: 999.0\rdata: {}\r\n\r\nretry: 1\n\n\u2028\u2029\u0085: x\rb"
"""Every line ending SSE knows (CR, LF, CRLF), fake fields, and Unicode line separators."""

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
"""Markup that would set ``window.__pwned`` or fetch from the network if it ever ran."""


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")


# -- the timeline ------------------------------------------------------------------


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
