"""``_async.run_in_thread``: the stores' hop to a worker thread is never left while its
function runs, asyncio's native ``task.cancel()`` included (no anyio shield stops it).

A store holding a lock or a connection around the hop (SQLiteStore's one connection,
PostgresStore's pool slots) must not let it go while the thread still uses it:
``tests/test_attack33_native_cancel.py`` shows what went wrong with SQLiteStore.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import anyio
import anyio.to_thread
import pytest

from stepmachine import AppendMessage, Message, submit
from stepmachine._async import _Hop, run_in_thread
from stepmachine.stores import PostgresStore

native = pytest.mark.parametrize("anyio_backend", ["asyncio"])  # task.cancel() is asyncio's


class Blocking:
    """A function for the worker thread that waits for ``go`` (and says it started)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.go = threading.Event()
        self.ended = threading.Event()

    def __call__(self, value: int) -> int:
        self.started.set()
        self.go.wait(10)
        time.sleep(0.01)  # still running a moment after go: the caller must wait it out
        self.ended.set()
        return value


async def cancel_natively_while(work: Blocking, task: asyncio.Task[int], times: int) -> bool:
    """Cancel ``task`` ``times`` times while ``work`` runs; whether it stayed pending."""
    await anyio.to_thread.run_sync(work.started.wait, 10)
    for _ in range(times):
        task.cancel()
        await asyncio.sleep(0.05)
    pending = not task.done()
    work.go.set()
    return pending


@native
@pytest.mark.parametrize("times", [1, 3])
async def test_a_native_cancel_waits_for_the_function_then_raises(times: int) -> None:
    work = Blocking()
    task = asyncio.ensure_future(run_in_thread(work, 7))
    assert await cancel_natively_while(work, task, times)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert work.ended.is_set()  # raised only once the function had ended


@native
async def test_a_function_whose_caller_was_cancelled_first_never_starts() -> None:
    """The race behind anyio's own check: the worker picks the call up after its caller,
    natively cancelled, stopped waiting; the function is not run for nobody."""
    ran: list[int] = []
    hop = _Hop(asyncio.get_running_loop())
    await hop.ended()  # the cancelled caller: the function has not started
    with pytest.raises(asyncio.CancelledError):
        await anyio.to_thread.run_sync(hop.run, ran.append, (1,))
    assert ran == []


@pytest.mark.anyio
async def test_an_anyio_cancel_while_it_runs_returns_the_outcome() -> None:
    work = Blocking()
    got: list[int] = []
    with anyio.CancelScope() as scope:

        async def run() -> None:
            got.append(await run_in_thread(work, 5))

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await anyio.to_thread.run_sync(work.started.wait, 10)
            scope.cancel()
            work.go.set()
    assert got == [5]  # the outcome was handed back; the cancel landed afterwards


@native
async def test_postgres_apply_natively_cancelled_is_waited_out(postgres_dsn: str) -> None:
    """PostgresStore's pool slot is not given back while its transaction runs on."""
    entered, go = threading.Event(), threading.Event()

    def hook(name: str) -> None:
        if name == "apply.inserted" and not entered.is_set():
            entered.set()
            go.wait(10)

    store = await PostgresStore.open(postgres_dsn, boundary_hook=hook)
    try:
        await store.create("s")
        task = asyncio.ensure_future(
            submit(store, "s", [AppendMessage(Message.user("hi", id="u1"))])
        )
        await anyio.to_thread.run_sync(entered.wait, 10)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=0.3)
        go.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert not done, "apply returned (cancelled) while its transaction ran on"
        session = await store.load("s")
        assert [m.id for m in session.conversation] == ["u1"]  # committed whole: stays
    finally:
        go.set()
        await store.aclose()
