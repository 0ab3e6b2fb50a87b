"""Attack 38: a plain-function tool's worker thread held to anyio's
``to_thread.run_sync(abandon_on_cancel=True)`` contract, on both backends.

(Written against a pool of stepmachine's own that tools ran in for a while on asyncio;
they run in anyio's threads again, and the contract is the same.) Every test runs real
threads through ``Tool.call`` (what the ``Tools`` step calls); a ``fail_after`` is only
a bound on a hang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import pytest
import sniffio

from stepmachine import Runtime, ToolContext, tool

asyncio_only = pytest.mark.parametrize("anyio_backend", ["asyncio"])
VAR: contextvars.ContextVar[str] = contextvars.ContextVar("attack38_var", default="unset")


def context() -> ToolContext:
    return ToolContext(Runtime(), "s", "c", "k")


def on_asyncio() -> bool:
    return sniffio.current_async_library() == "asyncio"


class Boom(BaseException):
    """A BaseException that is neither an interrupt nor a cancellation."""


def _raiser(error: BaseException) -> Any:
    @tool
    def raises() -> str:
        """Raise."""
        raise error

    return raises


@pytest.mark.parametrize(
    "error",
    [ValueError("v"), StopAsyncIteration(), Boom("b")],
    ids=lambda error: type(error).__name__,
)
async def test_what_a_sync_tool_raises_comes_out_of_the_call_as_itself(
    error: BaseException,
) -> None:
    with pytest.raises(type(error)) as caught:
        await _raiser(error).call({}, context())
    assert type(caught.value) is type(error)
    assert caught.value.args == error.args


async def test_a_stop_iteration_comes_out_as_a_runtime_error_caused_by_it() -> None:
    """A future (and a coroutine) cannot carry StopIteration: as anyio, a RuntimeError
    whose cause is the StopIteration."""
    error = StopIteration(3)
    with pytest.raises(RuntimeError) as caught:
        await _raiser(error).call({}, context())
    assert caught.value.__cause__ is error


async def test_the_limiter_token_is_back_after_every_kind_of_ending() -> None:
    """Return, exception, BaseException, StopIteration, cancellation before and while
    running: afterwards the default limiter lends nothing."""
    limiter = anyio.to_thread.current_default_thread_limiter()
    before = limiter.borrowed_tokens
    assert await _ok.call({}, context()) == "ok"
    assert limiter.borrowed_tokens == before
    for error, kind in (
        (ValueError("v"), ValueError),
        (Boom("b"), Boom),
        (StopIteration(1), RuntimeError),
    ):
        with pytest.raises(kind):
            await _raiser(error).call({}, context())
        assert limiter.borrowed_tokens == before
    with anyio.CancelScope() as scope:
        scope.cancel()
        await _ok.call({}, context())
    assert limiter.borrowed_tokens == before
    release = threading.Event()
    entered = threading.Event()

    @tool
    def blocked() -> str:
        """Block."""
        entered.set()
        release.wait(10)
        return "late"

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:

            async def cancel_once_entered() -> None:
                await anyio.to_thread.run_sync(entered.wait, 10)
                scope.cancel()

            group.start_soon(cancel_once_entered)
            await blocked.call({}, context())
    release.set()
    with anyio.fail_after(10):  # a bound on a hang
        while limiter.borrowed_tokens != before:  # noqa: ASYNC110 - trio: once the thread ends
            await anyio.sleep(0.01)


@tool
def _ok() -> str:
    """Fine."""
    return "ok"


async def test_a_limiter_of_one_runs_sixty_concurrent_tools_one_at_a_time() -> None:
    """anyio's default thread limiter set to 1 on this loop: 60 concurrent sync tools
    (some cancelled at once) never overlap, each runs at most once, and every token is
    back at the end."""
    limiter = anyio.to_thread.current_default_thread_limiter()
    old = limiter.total_tokens
    limiter.total_tokens = 1
    lock = threading.Lock()
    running = [0]
    most = [0]
    runs: dict[int, int] = {}

    @tool
    def one(index: int) -> int:
        """One of many."""
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            runs[index] = runs.get(index, 0) + 1
        try:
            return index
        finally:
            with lock:
                running[0] -= 1

    results: dict[int, Any] = {}

    async def call_one(index: int) -> None:
        if index % 7 == 0:
            with anyio.CancelScope() as scope:
                scope.cancel()
                results[index] = await one.call({"index": index}, context())
            return
        results[index] = await one.call({"index": index}, context())

    try:
        with anyio.fail_after(30):  # a bound on a hang
            async with anyio.create_task_group() as group:
                for index in range(60):
                    group.start_soon(call_one, index)
    finally:
        limiter.total_tokens = old
    assert most[0] == 1
    assert all(count == 1 for count in runs.values())
    assert not any(index % 7 == 0 for index in runs)
    assert results == {index: str(index) for index in range(60) if index % 7}
    assert limiter.borrowed_tokens == 0


async def test_context_variables_go_in_and_changes_made_in_the_thread_stay_there() -> None:
    seen: list[str] = []

    @tool
    def reads_and_sets() -> str:
        """Read then set a context variable."""
        seen.append(VAR.get())
        VAR.set("set in the tool")
        return VAR.get()

    VAR.set("the caller's")
    assert await reads_and_sets.call({}, context()) == "set in the tool"
    assert VAR.get() == "the caller's"
    VAR.set("the caller's, later")
    assert await reads_and_sets.call({}, context()) == "set in the tool"
    assert seen == ["the caller's", "the caller's, later"]


@asyncio_only
async def test_from_thread_run_of_a_coroutine_cancelled_with_the_caller() -> None:
    """The tool waits in ``anyio.from_thread.run`` on a coroutine that sleeps; the caller's
    scope is cancelled: the coroutine is cancelled with it (as in anyio's worker threads
    on asyncio; trio's leave it running), the tool sees the cancellation, and the caller
    stops waiting."""
    in_coroutine = anyio.Event()
    outcome: list[str] = []
    tool_ended = threading.Event()

    async def sleeps() -> str:
        in_coroutine.set()
        await anyio.sleep(30)
        return "slept"

    @tool
    def waits_on_the_loop() -> str:
        """Wait on the loop."""
        try:
            return anyio.from_thread.run(sleeps)
        except BaseException as exc:
            outcome.append(type(exc).__name__)
            raise
        finally:
            tool_ended.set()

    with anyio.fail_after(20):  # a bound on a hang
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:

                async def cancel_once_in() -> None:
                    await in_coroutine.wait()
                    scope.cancel()

                group.start_soon(cancel_once_in)
                await waits_on_the_loop.call({}, context())
        assert scope.cancelled_caught
        await anyio.to_thread.run_sync(tool_ended.wait, 10)
    assert outcome in (["CancelledError"], ["Cancelled"])


async def test_tool_thread_to_loop_to_another_thread_and_back() -> None:
    """A tool reaches the loop with ``from_thread.run``; the coroutine hops to another
    worker thread (anyio's) and to another sync tool; everything comes back."""

    @tool
    def leaf(value: int) -> int:
        """The inner tool."""
        return value * 2

    async def on_the_loop(value: int) -> str:
        doubled = await anyio.to_thread.run_sync(lambda: value * 2)
        inner = await leaf.call({"value": doubled}, context())
        return f"{doubled}/{inner}"

    @tool
    def outer(value: int) -> str:
        """The outer tool."""
        return anyio.from_thread.run(on_the_loop, value)

    with anyio.fail_after(20):  # a bound on a hang
        assert await outer.call({"value": 5}, context()) == "10/20"


async def test_check_cancelled_follows_a_timeout_scope_around_the_call() -> None:
    """``anyio.fail_after`` around the call (what ``tool(timeout=...)`` uses): once it
    fires, ``from_thread.check_cancelled`` in the tool raises; the caller gets
    TimeoutError at once."""
    entered, release, checked = threading.Event(), threading.Event(), []

    @tool
    def slow() -> str:
        """Slow."""
        entered.set()
        release.wait(10)
        try:
            anyio.from_thread.check_cancelled()
        except BaseException as exc:
            checked.append(type(exc).__name__)
            raise
        checked.append("not cancelled")
        return "done"

    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.2):
            await slow.call({}, context())
    release.set()
    with anyio.fail_after(10):
        while not checked:  # noqa: ASYNC110 - set by the thread
            await anyio.sleep(0.01)
    assert checked in (["CancelledError"], ["Cancelled"])


def test_loop_after_loop_a_tool_reaches_the_loop_that_called_it() -> None:
    """``asyncio.run`` five times in a row: each time the tool's ``from_thread.run_sync``
    reaches the loop that called it."""

    @tool
    def where() -> str:
        """Which loop?"""
        loop_id = anyio.from_thread.run_sync(lambda: id(asyncio.get_running_loop()))
        return f"{threading.get_ident()} {loop_id}"

    async def main() -> tuple[int, int]:
        ident, loop_id = (await where.call({}, context())).split()
        assert int(loop_id) == id(asyncio.get_running_loop())
        return int(ident), int(loop_id)

    seen = [asyncio.run(main()) for _ in range(5)]
    assert len(seen) == 5


def test_two_loops_in_two_threads_at_once_each_reach_their_own() -> None:
    """Two event loops in two threads, each with 20 concurrent sync tools calling back
    with ``from_thread.run`` and ``run_sync``: every call lands on its own loop."""
    barrier = threading.Barrier(2)

    @tool
    def back(tag: str) -> str:
        """Call back the loop."""

        async def on_loop() -> str:
            await anyio.lowlevel.checkpoint()
            return LOOPS[id(asyncio.get_running_loop())]

        via_run = anyio.from_thread.run(on_loop)
        via_sync = anyio.from_thread.run_sync(lambda: LOOPS[id(asyncio.get_running_loop())])
        return f"{tag} {via_run} {via_sync}"

    async def main(tag: str) -> list[str]:
        LOOPS[id(asyncio.get_running_loop())] = tag
        await anyio.to_thread.run_sync(barrier.wait, 10)
        results: list[str] = []

        async def one() -> None:
            results.append(await back.call({"tag": tag}, context()))

        async with anyio.create_task_group() as group:
            for _ in range(20):
                group.start_soon(one)
        return results

    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        runs = {tag: executor.submit(asyncio.run, main(tag)) for tag in ("A", "B")}
        answers = {tag: run.result(timeout=60) for tag, run in runs.items()}
    for tag, results in answers.items():
        assert results == [f"{tag} {tag} {tag}"] * 20


LOOPS: dict[int, str] = {}  # a running loop's id -> the tag of the thread running it
