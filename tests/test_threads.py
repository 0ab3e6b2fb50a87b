"""The stores' worker threads on asyncio (``stepmachine._threads``): each call runs once,
in the caller's context, at most ``max_per_loop`` of a loop at a time; idle threads leave; a
forked child starts with a pool of its own."""

from __future__ import annotations

import asyncio
import contextvars
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import anyio
import pytest
from _pool_calls import call_in, workers_of
from hypothesis import given, settings
from hypothesis import strategies as st

from stepmachine._async import run_in_thread
from stepmachine._threads import POOL, Pool

asyncio_only = pytest.mark.parametrize("anyio_backend", ["asyncio"])

WHO: contextvars.ContextVar[str] = contextvars.ContextVar("WHO", default="nobody")


async def test_a_call_runs_in_another_thread_with_the_callers_context() -> None:
    WHO.set("the caller")

    def where() -> tuple[int, str]:
        return threading.get_ident(), WHO.get()

    ident, who = await run_in_thread(where)
    assert ident != threading.get_ident()
    assert who == "the caller"


async def test_errors_come_back_as_raised() -> None:
    def fails() -> None:
        raise KeyError("missing")

    with pytest.raises(KeyError, match="missing"):
        await run_in_thread(fails)


@asyncio_only
async def test_stop_iteration_comes_back_as_a_runtime_error() -> None:
    """A future cannot hold StopIteration (it would end the awaiting coroutine)."""

    def stops() -> None:
        raise StopIteration

    with pytest.raises(RuntimeError, match="StopIteration") as caught:
        await run_in_thread(stops)
    assert isinstance(caught.value.__cause__, StopIteration)


@asyncio_only
async def test_at_most_max_threads_run_and_every_call_runs_once() -> None:
    pool = Pool(max_per_loop=2, idle_seconds=5)
    running, most, ran = 0, 0, []
    lock = threading.Lock()

    def work(k: int) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.02)
        with lock:
            running -= 1
            ran.append(k)
        return k * 10

    results = await asyncio.gather(*(call_in(pool, work, k) for k in range(7)))
    assert results == [k * 10 for k in range(7)]
    assert sorted(ran) == list(range(7))
    assert most == 2  # the backlog waited for a free thread, never a third one
    assert len(workers_of(pool)) <= 2


@asyncio_only
async def test_idle_threads_leave() -> None:
    pool = Pool(max_per_loop=4, idle_seconds=0.05)
    await asyncio.gather(*(call_in(pool, time.sleep, 0.01) for _ in range(3)))
    assert workers_of(pool)
    deadline = time.monotonic() + 5
    while workers_of(pool) and time.monotonic() < deadline:  # noqa: ASYNC110 - polls threads
        await asyncio.sleep(0.02)
    assert workers_of(pool) == []
    assert await call_in(pool, int, "7") == 7  # and new ones start when needed


@asyncio_only
async def test_a_warm_thread_is_reused() -> None:
    pool = Pool(max_per_loop=4, idle_seconds=5)
    idents = {await call_in(pool, threading.get_ident) for _ in range(20)}
    assert len(idents) == 1  # one after another: the same (warm) thread every time


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=12),
    st.integers(min_value=1, max_value=3),
)
def test_concurrent_calls_each_run_exactly_once(delays: list[int], limit: int) -> None:
    """Whatever the mix of call lengths and the thread limit, every call runs exactly
    once and returns its own result, with no more than ``limit`` threads."""
    pool = Pool(max_per_loop=limit, idle_seconds=0.2)
    counts: dict[int, int] = {}
    lock = threading.Lock()

    def work(k: int, delay: int) -> int:
        with lock:
            counts[k] = counts.get(k, 0) + 1
        time.sleep(delay / 1000)
        return k

    async def main() -> list[int]:
        calls = (call_in(pool, work, k, d) for k, d in enumerate(delays))
        return list(await asyncio.gather(*calls))

    assert asyncio.run(main()) == list(range(len(delays)))
    assert counts == dict.fromkeys(range(len(delays)), 1)
    assert len(workers_of(pool)) <= limit


@asyncio_only
@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX")
async def test_a_forked_child_gets_a_pool_of_its_own() -> None:
    """The parent's idle thread does not exist in the child: a hop there would wait for
    it for ever without the reset at fork."""
    await run_in_thread(int)  # the parent's pool holds an idle thread now
    assert POOL._idle
    with warnings.catch_warnings():  # 3.12+: "this process is multi-threaded"
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        signal.alarm(10)  # a hop that waits for a thread that is not there: killed
        got: list[int] = []
        try:
            # A thread of its own: this one still has the parent's running loop.
            hop = threading.Thread(target=lambda: got.append(asyncio.run(run_in_thread(int, "3"))))
            hop.start()
            hop.join()
        finally:
            os._exit(0 if got == [3] else 1)
    status = await anyio.to_thread.run_sync(wait_for_child, pid)
    assert status == 0, "the child's hop never came back" if status is None else status


def wait_for_child(pid: int, timeout: float = 20) -> int | None:
    """The child's exit code; None (the child killed) when it is still running after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def test_event_loops_one_after_another_share_the_warm_thread() -> None:
    """A process that runs one event loop after another (``asyncio.run`` per request,
    ``Agent.run_sync``) reuses one thread rather than leaving one per loop behind."""
    pool = Pool(max_per_loop=4, idle_seconds=5)
    for k in range(50):
        assert asyncio.run(call_in(pool, int, str(k))) == k
    assert len(workers_of(pool)) == 1
    assert pool._threads == 1
    assert not pool._loops  # no loop is kept once its calls ended


def test_stores_used_from_many_event_loops_leave_few_threads(tmp_path: Path) -> None:
    """The same with real stores, in a process of its own: 200 ``asyncio.run`` calls
    each opening an SQLiteStore, loading and closing it."""
    script = textwrap.dedent(
        f"""
        import asyncio, threading
        from stepmachine.stores import SQLiteStore

        async def once(k):
            async with await SQLiteStore.open({str(tmp_path / "s.db")!r}) as store:
                if k == 0:
                    await store.create("s")
                await store.load("s")

        for k in range(200):
            asyncio.run(once(k))
        names = [t.name for t in threading.enumerate()]
        print("WORKERS", names.count("stepmachine store worker"))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    workers = int(done.stdout.split("WORKERS")[1])
    assert 1 <= workers <= 2, done.stdout
