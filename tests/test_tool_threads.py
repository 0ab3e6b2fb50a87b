"""Plain-function tools' worker threads and the stores' threads, side by side.

A sync tool runs in one of anyio's worker threads, borrowing a token of anyio's default
thread limiter; the stores hop to threads of their own (on asyncio, the pool of
``stepmachine._threads``; on trio, anyio's threads under a limiter of the stores' own).
What each test holds to: in a tool, ``anyio.from_thread`` reaches the loop without a
token; tools holding every token of anyio's default limiter never keep a store's write
waiting; the interpreter's exit waits for a tool call its caller left.
"""

from __future__ import annotations

import contextvars
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

from stepmachine import AppendMessage, Message, Runtime, ToolContext, tool
from stepmachine.extend import Batch
from stepmachine.stores import SQLiteStore

WHO: contextvars.ContextVar[str] = contextvars.ContextVar("tool_threads_who", default="nobody")


def context() -> ToolContext:
    return ToolContext(Runtime(), "s", "c", "k")


async def test_a_sync_tool_runs_in_a_worker_thread_that_reaches_the_loop_without_a_token() -> None:
    """``anyio.from_thread.run_sync`` and ``run`` work in the tool without a token, and
    the tool sees the caller's context variables."""
    loop_thread = threading.get_ident()
    seen: dict[str, Any] = {}

    async def on_the_loop() -> int:
        await anyio.lowlevel.checkpoint()
        return threading.get_ident()

    @tool
    def probe() -> str:
        """Where does it run?"""
        seen["thread"] = threading.get_ident()
        seen["who"] = WHO.get()
        seen["sync"] = anyio.from_thread.run_sync(threading.get_ident)
        seen["async"] = anyio.from_thread.run(on_the_loop)
        return "ok"

    WHO.set("the caller")
    assert await probe.call({}, context()) == "ok"
    assert seen["thread"] != loop_thread
    assert seen["who"] == "the caller"
    assert seen["sync"] == seen["async"] == loop_thread


async def test_tools_holding_every_thread_token_never_keep_a_store_write_waiting(
    tmp_path: Path,
) -> None:
    """As many sync tools blocked in their threads as anyio's default limiter allows (40),
    then a store write: it runs at once, on the stores' own threads (asyncio) or under
    the stores' own limiter (trio)."""
    limiter = anyio.to_thread.current_default_thread_limiter()
    release = threading.Event()

    @tool
    def block() -> str:
        """Block until released."""
        release.wait(30)
        return "released"

    store = await SQLiteStore.open(tmp_path / "db.sqlite3")
    try:
        await store.create("s")
        async with anyio.create_task_group() as group:
            for _ in range(int(limiter.total_tokens)):
                group.start_soon(block.call, {}, context())
            while limiter.available_tokens:  # noqa: ASYNC110 - until every tool runs
                await anyio.sleep(0.01)
            batch = Batch(
                session_id="s",
                revision=1,
                step="test",
                cycle=0,
                timestamp=0.0,
                effects=(AppendMessage(Message.user("hi", id="m1")),),
            )
            with anyio.fail_after(10):  # a bound on a hang, not a timing
                session = await store.apply(batch)
            assert session.revision == 1
            release.set()
    finally:
        release.set()
        await store.aclose()


def test_the_interpreter_exit_waits_for_a_tool_call_its_caller_left(tmp_path: Path) -> None:
    """A call times out while its sync tool still runs; ``asyncio.run`` returns and the
    script ends: the process exits only once the tool has written its side effect."""
    mark = tmp_path / "charged"
    script = textwrap.dedent(
        f"""
        import asyncio, time
        import anyio
        from stepmachine import Runtime, ToolContext, tool

        @tool
        def charge() -> str:
            \"\"\"Charge the card.\"\"\"
            time.sleep(0.5)
            open({str(mark)!r}, "w").write("once")
            return "charged"

        async def main():
            with anyio.move_on_after(0.05):
                await charge.call({{}}, ToolContext(Runtime(), "s", "c", "k"))
            print("left", flush=True)

        asyncio.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "left"
    assert mark.read_text() == "once"
