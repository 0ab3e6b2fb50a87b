"""The live view in a real headless chromium, against a real uvicorn server.

The server is ``stepmachine.inspector``'s ``serve`` in a child process,
reading an SQLite store read-only on a free loopback port, while this process
writes to the store (a batch at a time with ``stepmachine.submit``, and a
machine run with a scripted model), as an agent would. Checked: new entries
appear as they land; after the server is stopped and started again on the
same port (the browser's ``EventSource`` reconnects by itself, sending
``Last-Event-ID``) and after a reconnect forced by the page's own code, the
page catches up on what was written meanwhile: every revision's entry once,
in order. The server shuts down cleanly with a stream open.

Waits use selectors, not ``wait_for_function``: the page's
Content-Security-Policy forbids evaluating strings, which that needs.

Writes run in a worker thread (``anyio.run`` there): Playwright's sync API
keeps its own event loop in this thread.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import uvicorn
from _web_sessions import SESSION, STARTUP_LIMIT, Server, add_user_message, free_port, record
from browser import browser, page  # noqa: F401 - the shared fixtures

from stepmachine import ModelInference, Runtime, StateMachine, ToolCallPart, Tools, tool
from stepmachine.inspector._live import LiveHub
from stepmachine.inspector._web import create_app
from stepmachine.stores import SQLiteStore
from stepmachine.testing import ScriptedModel, call


def in_thread(function: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
    """``anyio.run(function, *args)`` in a worker thread; its result."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(anyio.run, function, *args).result()


async def append(path: Path, text: str) -> int:
    async with await SQLiteStore.open(path) as store:
        return await add_user_message(store, text)


async def answer(path: Path, text: str) -> int:
    """Run the agent once: the model answers the last user message with ``text``."""
    async with await SQLiteStore.open(path) as store:
        machine = StateMachine([ModelInference(instructions="Be brief.")])
        session = await machine.run(Runtime(store=store, model=ScriptedModel([text])), SESSION)
        return session.revision


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "agent.sqlite3"
    in_thread(record, path)
    return path


@pytest.fixture
def server(db: Path, tmp_path: Path) -> Iterator[Callable[[], Server]]:
    """Starts servers on one port (``start()`` again after ``stop()``); stops what is left."""
    port = free_port()
    started: list[Server] = []

    def start() -> Server:
        started.append(Server(db, port, tmp_path / "server.log"))
        return started[-1]

    yield start
    for each in started:
        if each._process.poll() is None:
            each.stop()


def entries(tab: Any) -> list[str]:
    """The ids of the timeline's entries, in page order."""
    ids: list[str] = tab.eval_on_selector_all("#timeline section.batch", "es => es.map(e => e.id)")
    return ids


def wait_for_state(tab: Any, state: str) -> None:
    tab.wait_for_selector(f'#live-indicator[data-state="{state}"]')


def test_the_page_follows_a_run_and_catches_up_after_reconnects(
    page: Any,  # noqa: F811 - the fixture
    db: Path,
    server: Callable[[], Server],
) -> None:
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"script error: {error}"))
    page.on(
        "console",
        lambda message: (
            problems.append(message.text) if "Content Security Policy" in message.text else None
        ),
    )
    running = server()
    page.goto(f"{running.url}/sessions/{SESSION}")
    recorded = len(entries(page))
    assert entries(page) == [f"rev-{n}" for n in range(1, recorded + 1)]
    assert page.text_content("#session-status") == "done"
    wait_for_state(page, "live")

    # Batches land while the page watches.
    first = in_thread(append, db, "And <b>tomorrow</b>?")
    page.wait_for_selector(f"#rev-{first}")
    page.wait_for_selector("#session-status:text-is('idle')")
    assert page.text_content(f"#rev-{first}") is not None
    assert "<b>tomorrow</b>" in (page.text_content(f"#rev-{first}") or "")  # text, not markup
    reply = in_thread(answer, db, "Rain tomorrow.")
    page.wait_for_selector(f"#rev-{reply}")
    page.wait_for_selector("#session-status:text-is('done')")

    # The server goes away; the agent goes on; the server comes back on the same port.
    running.stop()
    wait_for_state(page, "reconnecting")
    missed = [in_thread(append, db, f"while down {n}") for n in range(2)]
    missed.append(in_thread(answer, db, "Still rain."))
    running = server()
    page.wait_for_selector(f"#rev-{missed[-1]}")
    wait_for_state(page, "live")
    assert entries(page) == [f"rev-{n}" for n in range(1, missed[-1] + 1)]

    # A reconnect by the page's own code, with a batch written around it.
    page.evaluate("window.stepmachineLive.reconnect()")
    late = in_thread(append, db, "one more")
    page.wait_for_selector(f"#rev-{late}")
    wait_for_state(page, "live")
    final = in_thread(append, db, "and the last")
    page.wait_for_selector(f"#rev-{final}")
    assert entries(page) == [f"rev-{n}" for n in range(1, final + 1)]
    assert page.text_content("#session-revision") == str(final)
    assert page.evaluate("window.stepmachineLive.position()") == {"revision": final, "seq": 0}
    # The page's scripts ran without an error, and the page's policy blocked none of them.
    assert problems == []
    running.stop()  # with the page's stream still open


class InProcess:
    """An application serving the live view in the process (a thread here) where its agent runs.

    The agent's run passes a :class:`LiveHub` as its emitter and the app reads
    the same hub, so the page gets ``live`` events (a tool running) between
    batches. ``start_run`` starts the run, ``tool_may_finish`` lets its slow
    tool return, ``stop`` ends the server.
    """

    def __init__(self, db: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.start_run = threading.Event()
        self.tool_may_finish = threading.Event()
        self.stop = threading.Event()
        self.final_revision: int | None = None
        self._db = db
        self._port = port
        self._thread = threading.Thread(target=anyio.run, args=(self._main,), daemon=True)
        self._thread.start()

    async def _main(self) -> None:
        hub = LiveHub()

        @tool()
        def slow_forecast(city: str) -> str:
            """Tomorrow's weather, slowly (it waits for the test)."""
            assert self.tool_may_finish.wait(STARTUP_LIMIT)
            return f"hail in {city}"

        async with (
            await SQLiteStore.open(self._db) as writer,
            await SQLiteStore.open(self._db, read_only=True) as reader,
        ):
            await add_user_message(writer, "And in Lyon?")
            app = create_app(reader, poll_interval=0.05, live=hub)
            config = uvicorn.Config(
                app, host="127.0.0.1", port=self._port, log_level="warning", lifespan="off"
            )
            server = uvicorn.Server(config)
            async with anyio.create_task_group() as group:
                group.start_soon(server.serve)
                await anyio.to_thread.run_sync(self.start_run.wait)
                machine = StateMachine(
                    [Tools([slow_forecast]), ModelInference(instructions="Be brief.")]
                )
                asked = ToolCallPart(
                    call_id="lyon-1",  # the recorded run used the scripted model's ids
                    name="slow_forecast",
                    arguments={"city": "Lyon"},
                    raw_arguments='{"city": "Lyon"}',
                )
                model = ScriptedModel([call(asked, text="Checking."), "Hail."])
                runtime = Runtime(store=writer, model=model)
                session = await machine.run(runtime, SESSION, emitter=hub)
                self.final_revision = session.revision
                await anyio.to_thread.run_sync(self.stop.wait)
                app.state.streams.close()
                server.should_exit = True

    def join(self) -> None:
        self.tool_may_finish.set()
        self.start_run.set()
        self.stop.set()
        self._thread.join(STARTUP_LIMIT)
        assert not self._thread.is_alive()


def test_an_app_running_its_agent_in_process_streams_live_events(
    page: Any,  # noqa: F811 - the fixture
    db: Path,
) -> None:
    served = InProcess(db, free_port())
    try:
        deadline = time.monotonic() + STARTUP_LIMIT
        while True:
            try:
                httpx.get(served.url + "/api/sessions", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the server never answered"
                time.sleep(0.05)
        page.goto(f"{served.url}/sessions/{SESSION}")
        wait_for_state(page, "live")
        served.start_run.set()
        # While the tool runs, no batch lands: only the live event says so.
        page.wait_for_selector("#live-deltas:has-text('[slow_forecast running]')")
        assert page.is_visible("#live-deltas")
        # Its intent is stored and its run holds the lease: running, not an outcome unknown.
        page.wait_for_selector("#session-status:text-is('running')")
        assert "Lyon" in (page.text_content("#conversation") or "")  # the call, live
        served.tool_may_finish.set()
        page.wait_for_selector("#session-status:text-is('done')")
    finally:
        served.join()
    final = served.final_revision
    assert final is not None
    page.wait_for_selector(f"#rev-{final}")
    assert entries(page) == [f"rev-{n}" for n in range(1, final + 1)]
    assert not page.is_visible("#live-deltas")  # a batch clears the live text


def fact(tab: Any, label: str) -> str:
    return (tab.text_content(f"#fact-{label}") or "").strip()


def test_the_header_counters_and_the_conversation_follow_the_session(
    page: Any,  # noqa: F811 - the fixture
    db: Path,
    server: Callable[[], Server],
) -> None:
    """Found: model replies, tokens, batches, messages and the conversation kept their
    page-load values while the timeline grew."""
    running = server()
    page.goto(f"{running.url}/sessions/{SESSION}")
    wait_for_state(page, "live")
    batches, messages = int(fact(page, "batches")), int(fact(page, "messages"))
    replies = int(fact(page, "model-replies"))
    tokens = fact(page, "tokens")
    asked = in_thread(append, db, "And on <i>Sunday</i>?")
    reply = in_thread(answer, db, "Snow on Sunday.")
    page.wait_for_selector(f"#rev-{reply}")
    page.wait_for_selector(f"#fact-batches:text-is('{reply}')")
    assert reply > asked > batches
    assert int(fact(page, "messages")) == messages + 2
    assert int(fact(page, "model-replies")) == replies + 1
    totals = httpx.get(f"{running.url}/api/sessions/{SESSION}", timeout=30).json()["totals"]
    assert totals["model_replies"] == replies + 1
    shown_tokens = f"{totals['input_tokens']} in / {totals['output_tokens']} out"
    assert fact(page, "tokens") == shown_tokens
    assert tokens != shown_tokens or totals["input_tokens"] == 0
    conversation = page.text_content("#conversation") or ""
    assert "And on <i>Sunday</i>?" in conversation  # as text
    assert "Snow on Sunday." in conversation
    assert page.locator("#conversation i").count() == 0
    assert page.text_content("#session-status") == "done"
    # The search still covers the conversation the stream brought.
    page.fill("#search-box", "snow on sunday")
    assert f"1 of {messages + 2} messages match" in (page.text_content("#search-count") or "")
    running.stop()
