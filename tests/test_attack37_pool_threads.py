"""Attack 37: the pool of ``stepmachine._threads`` itself: BaseException subclasses
through ``run_in_thread`` (bare and from a real store's hook), threads leaving when idle
(no leak, the count right, under a leave/submit race), and what an idle thread keeps of
the last call it ran."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import random
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import anyio
import pytest
from _pool_calls import call_in, workers_of

from stepmachine import AppendMessage, Message, submit
from stepmachine._async import run_in_thread
from stepmachine._threads import POOL, Pool
from stepmachine.stores import FileStore, SQLiteStore

asyncio_only = pytest.mark.parametrize("anyio_backend", ["asyncio"])


async def wait_until_gone(pool: Pool) -> None:
    deadline = time.monotonic() + 5
    while workers_of(pool) or pool._threads:
        assert time.monotonic() < deadline, (len(workers_of(pool)), pool._threads)
        await asyncio.sleep(0.01)


class Custom(BaseException):
    pass


BASE_ERRORS = [SystemExit(3), KeyboardInterrupt(), StopAsyncIteration(), Custom()]
# GeneratorExit: under anyio.run (this suite's runner) any awaited future that raises it
# (a plain asyncio future too, and anyio's own to_thread) ends the test with "coroutine
# ignored GeneratorExit"; the pool is checked with it under asyncio.run below.


@pytest.mark.anyio
@pytest.mark.parametrize("error", BASE_ERRORS, ids=lambda e: type(e).__name__)
async def test_a_base_exception_comes_back_to_the_caller_as_raised(error: BaseException) -> None:
    """SystemExit, KeyboardInterrupt, GeneratorExit, StopAsyncIteration and a custom
    BaseException raised in the worker come back to the caller, the same object; the
    thread survives it and the next call runs."""

    def raises() -> None:
        raise error

    with pytest.raises(type(error)) as caught:
        await run_in_thread(raises)
    assert caught.value is error
    assert await run_in_thread(int, "5") == 5


def test_generator_exit_comes_back_under_asyncio_run() -> None:
    """GeneratorExit raised in the worker comes back to an asyncio.run caller as raised;
    a plain asyncio future behaves the same."""

    def raises() -> None:
        raise GeneratorExit("from the worker")

    async def main() -> str:
        with pytest.raises(GeneratorExit, match="from the worker"):
            await run_in_thread(raises)
        return str(await run_in_thread(int, "4"))

    out: list[str] = []
    thread = threading.Thread(target=lambda: out.append(asyncio.run(main())))
    thread.start()
    thread.join(10)
    assert out == ["4"]


@asyncio_only
@pytest.mark.parametrize("error", [*BASE_ERRORS, GeneratorExit()], ids=lambda e: type(e).__name__)
async def test_a_base_exception_leaves_the_worker_thread_alive(error: BaseException) -> None:
    pool = Pool(max_per_loop=1, idle_seconds=5)
    first = await call_in(pool, threading.get_ident)

    def raises() -> None:
        raise error

    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    pool.submit((loop, future, contextvars.copy_context(), raises, ()))
    await asyncio.wait([future])  # not awaited itself (see GeneratorExit above)
    assert future.exception() is error
    assert await call_in(pool, threading.get_ident) == first  # the same thread goes on
    assert pool._threads == 1
    assert len(workers_of(pool)) == 1


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["sqlite", "file"])
@pytest.mark.parametrize(
    "error", [KeyboardInterrupt(), SystemExit(1), Custom()], ids=lambda e: type(e).__name__
)
async def test_a_base_exception_from_a_store_hook_writes_nothing_and_the_store_goes_on(
    tmp_path: Path, kind: str, error: BaseException
) -> None:
    """A hook raising a BaseException in the worker thread before the write (SQLite: in
    the transaction, rows inserted; FileStore: the log locked, nothing written): the
    caller gets it, nothing is stored, and the same store writes again afterwards."""
    armed = [True]
    boundary = "apply.inserted" if kind == "sqlite" else "apply.locked"

    def hook(name: str) -> None:
        if name == boundary and armed[0]:
            armed[0] = False
            raise error

    store: Any = (
        await SQLiteStore.open(tmp_path / "db.sqlite3", boundary_hook=hook)
        if kind == "sqlite"
        else await FileStore.open(tmp_path / "files", fsync="never", boundary_hook=hook)
    )
    try:
        await store.create("s")
        with pytest.raises(type(error)):
            await submit(store, "s", [AppendMessage(Message.user("x", id="u1"))])
        assert (await store.load("s")).revision == 0
        after = await submit(store, "s", [AppendMessage(Message.user("x", id="u1"))])
        assert [m.id for m in after.conversation] == ["u1"]
    finally:
        await store.aclose()


async def burst_of_forty(pool: Pool) -> None:
    """40 calls at once, each held until all 40 run (every thread of the pool)."""
    gate = threading.Event()
    started: list[int] = []

    def wait(k: int) -> int:
        started.append(k)
        gate.wait(5)
        return k

    calls = asyncio.gather(*(call_in(pool, wait, k) for k in range(40)))
    deadline = time.monotonic() + 5
    while len(started) < 40:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)
    assert len(workers_of(pool)) == 40
    gate.set()
    assert await calls == list(range(40))


@asyncio_only
async def test_a_burst_of_forty_leaves_no_thread_behind() -> None:
    """Three bursts of 40 concurrent calls (every thread of a pool) with a short idle
    time: after each, every thread leaves and the pool's count is back to zero."""
    pool = Pool(max_per_loop=40, idle_seconds=0.05)
    for _ in range(3):
        await burst_of_forty(pool)
        await wait_until_gone(pool)
    assert not pool._idle
    assert not pool._loops


@asyncio_only
async def test_threads_leaving_while_calls_arrive_lose_no_call() -> None:
    """A tiny idle time (threads leave between calls all the time) and 600 calls of
    mixed lengths arriving in waves, at most 3 threads: every call runs exactly once,
    with its own result; the count of threads stays right; all leave at the end."""
    pool = Pool(max_per_loop=3, idle_seconds=0.0005)
    rng = random.Random(7)
    counts: dict[int, int] = {}
    lock = threading.Lock()
    most = [0]

    def work(k: int, pause: float) -> int:
        with lock:
            counts[k] = counts.get(k, 0) + 1
            most[0] = max(most[0], len(workers_of(pool)))
        if pause:
            time.sleep(pause)
        return -k

    results: list[Any] = []
    for wave in range(30):
        calls = [
            call_in(pool, work, wave * 20 + n, rng.choice([0, 0, 0, 0.0005, 0.001]))
            for n in range(20)
        ]
        results += await asyncio.gather(*calls)
        await asyncio.sleep(rng.choice([0, 0.0005, 0.002]))
    assert results == [-k for k in range(600)]
    assert counts == dict.fromkeys(range(600), 1)
    assert most[0] <= 3
    await wait_until_gone(pool)


@asyncio_only
async def test_the_process_pool_counts_its_threads_right() -> None:
    """After many concurrent store-like calls through run_in_thread, the loop's pool's
    count matches its live threads and every live thread is idle."""
    await asyncio.gather(*(run_in_thread(time.sleep, 0.001 * (k % 5)) for k in range(120)))
    await asyncio.sleep(0.05)
    pool = POOL
    live = [t for t in threading.enumerate() if getattr(t, "pool", None) is pool]
    assert pool._threads == len(live)
    assert len(pool._idle) == len(live)
    assert not pool._loops  # no call running or waiting


class Payload:
    """Something a store call takes or gives back (a batch, a loaded session)."""


@asyncio_only
async def test_an_idle_worker_keeps_nothing_of_the_call_it_finished() -> None:
    pool = Pool(max_per_loop=1, idle_seconds=5)
    argument, holder = Payload(), Payload()
    argument_ref = weakref.ref(argument)

    def work(payload: Payload) -> Payload:
        return holder

    result = await call_in(pool, work, argument)
    assert result is holder
    del argument, result
    gc.collect()
    still = argument_ref() is not None
    await call_in(pool, int)  # the thread's next call drops the last one's
    gc.collect()
    assert argument_ref() is None
    assert not still, "the idle thread kept the finished call's argument alive"


@asyncio_only
async def test_what_an_idle_worker_keeps_is_dropped_by_its_next_call() -> None:
    """The same through run_in_thread and the process pool: the finished call's argument
    (a store's batch, say) lives on only until the thread runs another call (or leaves)."""
    argument = Payload()
    ref = weakref.ref(argument)
    await run_in_thread(id, argument)
    del argument
    for _ in range(3):
        await run_in_thread(int)  # the warmest thread (LIFO) takes each
    gc.collect()
    assert ref() is None


@asyncio_only
async def test_an_anyio_cancel_while_a_call_runs_is_delivered_after_it() -> None:
    """anyio's cancel scope cancelled while the function runs: the outcome comes back,
    then the cancellation lands at the next checkpoint (the shield works on this pool)."""
    started, go = threading.Event(), threading.Event()
    got: list[int] = []

    def work() -> int:
        started.set()
        go.wait(5)
        return 9

    with anyio.CancelScope() as scope:

        async def cancel_when_started() -> None:
            await anyio.to_thread.run_sync(started.wait, 5)
            scope.cancel()
            await asyncio.sleep(0.05)
            go.set()

        task = asyncio.ensure_future(cancel_when_started())
        got.append(await run_in_thread(work))
        await anyio.lowlevel.checkpoint()
        got.append(-1)  # never reached
    await task
    assert got == [9]
    assert scope.cancelled_caught
