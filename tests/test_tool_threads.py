"""Plain-function tools' worker threads (``stepmachine._async.run_abandoning``): anyio's
``to_thread.run_sync(abandon_on_cancel=True)`` contract, on asyncio through the tools'
own pool (``stepmachine._threads.TOOLS``), elsewhere through anyio's.

What each test holds to: the tool runs in a worker thread with the caller's context
variables; ``anyio.from_thread`` works in it without a token, and ``check_cancelled``
sees the caller's cancellation; a cancelled caller stops waiting at once (on asyncio it
gives its limiter token back then, as anyio does there) while the thread runs on; a
call cancelled before it started never runs; blocked tools never keep a store's write
waiting; the interpreter's exit waits for a tool call its caller left.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import pytest
import sniffio
from hypothesis import given, settings
from hypothesis import strategies as st

from stepmachine import AppendMessage, Message, Runtime, ToolContext, tool
from stepmachine._async import run_abandoning
from stepmachine._threads import POOL, TOOLS
from stepmachine.extend import Batch
from stepmachine.stores import SQLiteStore

WHO: contextvars.ContextVar[str] = contextvars.ContextVar("tool_threads_who", default="nobody")

asyncio_only = pytest.mark.parametrize("anyio_backend", ["asyncio"])


def on_asyncio() -> bool:
    return sniffio.current_async_library() == "asyncio"


def context() -> ToolContext:
    return ToolContext(Runtime(), "s", "c", "k")


async def test_a_sync_tool_runs_in_a_worker_thread_that_reaches_the_loop_without_a_token() -> None:
    """``anyio.from_thread.run_sync`` and ``run`` work in the tool as in anyio's own
    worker threads, and the tool sees the caller's context variables."""
    loop_thread = threading.get_ident()
    seen: dict[str, Any] = {}

    async def on_the_loop() -> int:
        await anyio.lowlevel.checkpoint()
        return threading.get_ident()

    @tool
    def probe() -> str:
        """Where does it run?"""
        seen["thread"] = threading.current_thread()
        seen["who"] = WHO.get()
        seen["sync"] = anyio.from_thread.run_sync(threading.get_ident)
        seen["async"] = anyio.from_thread.run(on_the_loop)
        return "ok"

    WHO.set("the caller")
    assert await probe.call({}, context()) == "ok"
    assert seen["thread"].ident != loop_thread
    assert seen["who"] == "the caller"
    assert seen["sync"] == seen["async"] == loop_thread
    if on_asyncio():
        assert seen["thread"].name == "stepmachine tool worker"
        assert getattr(seen["thread"], "pool", None) is TOOLS


async def test_check_cancelled_in_the_thread_sees_the_callers_cancellation() -> None:
    """The caller's scope is cancelled while the function runs: the wait stops at once,
    the token goes back, and the thread's ``from_thread.check_cancelled`` raises."""
    limiter = anyio.CapacityLimiter(1)
    entered, release = threading.Event(), threading.Event()
    checked: list[str] = []

    def work() -> str:
        anyio.from_thread.check_cancelled()  # not cancelled yet: returns
        entered.set()
        release.wait(10)
        try:
            anyio.from_thread.check_cancelled()
        except BaseException as exc:  # asyncio's CancelledError, trio's Cancelled
            checked.append(type(exc).__name__)
            raise
        checked.append("not cancelled")
        return "done"

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:

            async def cancel_once_entered() -> None:
                await anyio.to_thread.run_sync(entered.wait, 10)
                scope.cancel()

            group.start_soon(cancel_once_entered)
            await run_abandoning(work, limiter)
            pytest.fail("the call returned although its scope was cancelled")
    assert scope.cancelled_caught
    # Given back although the thread still runs (anyio on asyncio); trio keeps it until
    # the thread ends.
    assert limiter.borrowed_tokens == (0 if on_asyncio() else 1)
    assert checked == []
    release.set()
    with anyio.fail_after(10):  # a bound on a hang, not a timing
        while not checked or limiter.borrowed_tokens:  # noqa: ASYNC110 - set by the thread
            await anyio.sleep(0.01)
    assert checked in (["CancelledError"], ["Cancelled"])


async def test_a_call_cancelled_before_it_started_never_runs() -> None:
    """With the limiter's only token taken, the call waits for it; cancelled there, the
    function never runs (anyio's contract: nothing done)."""
    limiter = anyio.CapacityLimiter(1)
    ran: list[int] = []
    holder = object()
    limiter.acquire_on_behalf_of_nowait(holder)
    try:
        with anyio.move_on_after(0.05) as scope:
            await run_abandoning(lambda: ran.append(1), limiter)
        assert scope.cancelled_caught
    finally:
        limiter.release_on_behalf_of(holder)
    await run_abandoning(lambda: ran.append(2), limiter)
    assert ran == [2]


@asyncio_only
async def test_a_call_cancelled_after_its_hand_off_but_before_a_thread_took_it_never_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The call is handed to the pool, its caller is cancelled, and only then does a
    thread take it (held back here): the function does not run, and its token is back."""
    import stepmachine._async as hop

    held: list[Any] = []

    class HeldBack:
        def submit(self, call: Any) -> bool:
            held.append(call)
            return True

    monkeypatch.setattr(hop, "TOOLS", HeldBack())
    limiter = anyio.CapacityLimiter(1)
    ran: list[int] = []
    task = asyncio.ensure_future(run_abandoning(lambda: ran.append(1), limiter))
    while not held:  # noqa: ASYNC110 - until the task handed its call over
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert limiter.borrowed_tokens == 0
    (call,) = held
    monkeypatch.undo()
    TOOLS.submit(call)  # a thread takes it now
    loop = asyncio.get_running_loop()
    with anyio.fail_after(10):  # a bound on a hang, not a timing
        while loop in TOOLS._loops:  # noqa: ASYNC110 - until the pool saw the call end
            await asyncio.sleep(0.001)
    assert ran == []


@asyncio_only
async def test_a_native_cancel_leaves_the_thread_running_and_gives_the_token_back() -> None:
    """asyncio's ``task.cancel()`` while the function runs: the task ends cancelled at
    once, the token is free, and the function still ends (once), its result dropped."""
    limiter = anyio.CapacityLimiter(1)
    entered, release, ended = threading.Event(), threading.Event(), threading.Event()

    def work() -> int:
        entered.set()
        release.wait(10)
        ended.set()
        return 1

    task = asyncio.ensure_future(run_abandoning(work, limiter))
    await anyio.to_thread.run_sync(entered.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert limiter.borrowed_tokens == 0
    assert not ended.is_set()
    release.set()
    await anyio.to_thread.run_sync(ended.wait, 10)
    assert ended.is_set()


@asyncio_only
async def test_blocked_tools_never_keep_a_store_write_waiting(tmp_path: Path) -> None:
    """As many sync tools blocked in their threads as anyio's default limiter allows
    (40), then a store write: it runs at once on the stores' own threads."""
    limiter = anyio.to_thread.current_default_thread_limiter()
    release = threading.Event()
    store = await SQLiteStore.open(tmp_path / "db.sqlite3")
    try:
        await store.create("s")
        async with anyio.create_task_group() as group:
            for _ in range(int(limiter.total_tokens)):
                group.start_soon(run_abandoning, lambda: release.wait(30), limiter)
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
            assert POOL is not TOOLS
            release.set()
    finally:
        release.set()
        await store.aclose()


@settings(max_examples=30, deadline=None)
@given(
    plan=st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from(["wait", "cancel_soon", "cancel_now"])),
        min_size=1,
        max_size=12,
    )
)
def test_every_call_runs_at_most_once_and_an_awaited_one_gives_its_result(
    plan: list[tuple[int, str]],
) -> None:
    """Concurrent calls, some cancelled at once, some soon after they start: each function
    runs at most once; every call awaited to its end returns its own result; and
    afterwards no call of this loop is left in the tools' pool."""

    async def main() -> None:
        limiter = anyio.CapacityLimiter(4)
        runs: dict[int, int] = {}
        lock = threading.Lock()
        results: dict[int, int] = {}

        def work(index: int, millis: int) -> int:
            with lock:
                runs[index] = runs.get(index, 0) + 1
            time.sleep(millis / 1000)
            return index * 7

        async def one(index: int, millis: int, how: str) -> None:
            if how == "cancel_now":
                with anyio.CancelScope() as scope:
                    scope.cancel()
                    await run_abandoning(lambda: work(index, millis), limiter)
                return
            with anyio.move_on_after(0.001 if how == "cancel_soon" else 30):
                results[index] = await run_abandoning(lambda: work(index, millis), limiter)

        async with anyio.create_task_group() as group:
            for index, (millis, how) in enumerate(plan):
                group.start_soon(one, index, millis, how)
        await anyio.sleep(0.05)  # the abandoned ones end (at most 3 ms each)
        assert all(count == 1 for count in runs.values()), runs
        for index, (_, how) in enumerate(plan):
            if how == "wait":
                assert results[index] == index * 7
            if how == "cancel_now":
                assert index not in runs
        assert limiter.borrowed_tokens == 0

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while TOOLS._loops:  # a loop closed meanwhile is forgotten once its calls ended
        assert time.monotonic() < deadline, TOOLS._loops
        time.sleep(0.01)


def test_the_interpreter_exit_waits_for_a_tool_call_its_caller_left(tmp_path: Path) -> None:
    """A run times out while its sync tool still runs; ``asyncio.run`` returns and the
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
