"""Attack 37: the stores' worker threads (``stepmachine._threads``) and the process:
an event loop closed (or ``asyncio.run`` ending) while a worker still runs a store
write, the interpreter exiting with busy and idle workers, a thread that cannot be
started, and ``fork`` while every worker is busy.

Each scenario that could hang or kill the interpreter runs in a child process.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from stepmachine import AppendMessage, Message, submit
from stepmachine._async import run_in_thread
from stepmachine._threads import MAX_PER_LOOP, POOL
from stepmachine.stores import FileStore, SQLiteStore

ROOT = Path(__file__).resolve().parents[1]

asyncio_only = pytest.mark.parametrize("anyio_backend", ["asyncio"])

PRELUDE = """
import asyncio, sys, threading, time
from pathlib import Path
from stepmachine import AppendMessage, Message, submit
from stepmachine.stores import FileStore, SQLiteStore

THREAD_ERRORS = []
threading.excepthook = lambda args: THREAD_ERRORS.append(repr(args.exc_value))
UNRAISABLE = []
sys.unraisablehook = lambda args: UNRAISABLE.append(repr(args.exc_value))
"""


def run_child(code: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code), *args],
        capture_output=True,
        check=False,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


LOOP_CLOSED = """
db = Path(sys.argv[1])
cancel_first = sys.argv[2] == "cancel"
entered, go, ended = threading.Event(), threading.Event(), threading.Event()

def hook(name):
    if name == "apply.inserted":
        entered.set()
        go.wait(10)
    if name == "apply.committed":
        ended.set()

loop = asyncio.new_event_loop()
store = loop.run_until_complete(SQLiteStore.open(db, boundary_hook=hook))
loop.run_until_complete(store.create("s"))
task = loop.create_task(submit(store, "s", [AppendMessage(Message.user("x", id="u1"))]))

async def until_entered():
    while not entered.is_set():
        await asyncio.sleep(0.005)

loop.run_until_complete(until_entered())
if cancel_first:  # natively cancelled: the task now waits for the function to end
    task.cancel()
    loop.run_until_complete(asyncio.sleep(0.05))
    assert not task.done()
loop.close()  # closed with the write still running in its worker thread
go.set()
assert ended.wait(10)
time.sleep(0.2)  # the worker hands the outcome back to the closed loop

async def check():
    again = await SQLiteStore.open(db)
    try:
        session = await again.load("s")
        assert [m.id for m in session.conversation] == ["u1"], session  # whole, once
        after = await submit(again, "s", [AppendMessage(Message.user("y", id="u2"))])
        assert after.revision == 2
    finally:
        await again.aclose()

asyncio.run(check())
print("THREAD_ERRORS", THREAD_ERRORS, "UNRAISABLE", UNRAISABLE)
"""


@pytest.mark.parametrize("how", ["pending", "cancel"])
def test_a_loop_closed_while_a_worker_runs_a_write(tmp_path: Path, how: str) -> None:
    """The loop that made a store write is closed while the write still runs in its
    worker thread (its task pending, or natively cancelled and waiting for it): the
    write ends whole, the outcome is dropped without an error in the worker thread,
    and the database is whole and writable."""
    done = run_child(LOOP_CLOSED, str(tmp_path / "db.sqlite3"), how)
    assert done.returncode == 0, done.stderr
    assert "THREAD_ERRORS [] UNRAISABLE []" in done.stdout, done.stdout
    assert "Exception in thread" not in done.stderr
    assert "Traceback" not in done.stderr, done.stderr


RUN_ENDS = """
db = Path(sys.argv[1])
entered, log = threading.Event(), []

def hook(name):
    if name == "apply.inserted":
        entered.set()
        time.sleep(0.3)
        log.append("function ended")

async def main():
    store = await SQLiteStore.open(db, boundary_hook=hook)
    await store.create("s")
    asyncio.ensure_future(submit(store, "s", [AppendMessage(Message.user("x", id="u1"))]))
    while not entered.is_set():
        await asyncio.sleep(0.005)
    # main returns: asyncio.run cancels the write's task (natively) and waits for it

asyncio.run(main())
log.append("run ended")

async def check():
    again = await SQLiteStore.open(db)
    try:
        session = await again.load("s")
        assert [m.id for m in session.conversation] == ["u1"], session
    finally:
        await again.aclose()

asyncio.run(check())
print("LOG", log, "THREAD_ERRORS", THREAD_ERRORS)
"""


def test_asyncio_run_ending_waits_for_a_running_store_write(tmp_path: Path) -> None:
    done = run_child(RUN_ENDS, str(tmp_path / "db.sqlite3"))
    assert done.returncode == 0, done.stderr
    assert "LOG ['function ended', 'run ended'] THREAD_ERRORS []" in done.stdout, done.stdout
    assert "Traceback" not in done.stderr, done.stderr


EXIT = """
from stepmachine._async import run_in_thread
from stepmachine._threads import Pool

folder = Path(sys.argv[1])
never = threading.Event()

async def use_stores():
    files = await FileStore.open(folder / "files", fsync="never")
    db = await SQLiteStore.open(folder / "db.sqlite3")
    for k in range(30):
        await files.create(f"s{k}")
        await db.create(f"s{k}")
    await asyncio.gather(
        *(submit(files, f"s{k}", [AppendMessage(Message.user("x", id="m"))]) for k in range(30)),
        *(submit(db, f"s{k}", [AppendMessage(Message.user("x", id="m"))]) for k in range(30)),
    )
    await files.aclose()
    await db.aclose()

asyncio.run(use_stores())  # idle workers are left
loop = asyncio.new_event_loop()
task = loop.create_task(run_in_thread(never.wait))  # a worker busy for ever
loop.run_until_complete(asyncio.sleep(0.05))
loop.close()
busy = [t for t in threading.enumerate() if isinstance(getattr(t, "pool", None), Pool)]
print("WORKERS", len(busy) > 1, "THREAD_ERRORS", THREAD_ERRORS, flush=True)
"""


def test_the_interpreter_exits_with_idle_and_busy_workers(tmp_path: Path) -> None:
    """Idle workers and one blocked for ever (its loop closed) do not keep the
    interpreter from exiting (daemon threads), and nothing is printed from them."""
    done = run_child(EXIT, str(tmp_path), timeout=30)
    assert done.returncode == 0, done.stderr
    assert "WORKERS True THREAD_ERRORS []" in done.stdout
    assert "Traceback" not in done.stderr, done.stderr


NO_THREADS = """
from stepmachine._async import run_in_thread
from stepmachine._threads import MAX_PER_LOOP, POOL

async def main():
    threading.stack_size(1 << 45)  # pthread_create fails (no memory for the stack)
    refused = 0
    for _ in range(MAX_PER_LOOP):
        try:
            await SQLiteStore.open(Path(sys.argv[1]) / "never.sqlite3")
        except RuntimeError as exc:
            assert "can't start new thread" in str(exc), exc
            refused += 1
    threading.stack_size(0)  # the fault is over: threads start again
    counted = POOL._threads
    print("REFUSED", refused, "COUNTED", counted, flush=True)
    if sys.argv[2:] == ["refused only"]:
        return
    store = await asyncio.wait_for(SQLiteStore.open(Path(sys.argv[1]) / "db.sqlite3"), 2)
    await store.create("s")
    await store.aclose()
    print("RECOVERED", flush=True)

try:
    asyncio.run(main())
except TimeoutError:
    print("HUNG", flush=True)
"""


def test_a_thread_that_cannot_start_is_reported_to_the_caller(tmp_path: Path) -> None:
    """While no thread can be started, a store call raises "can't start new thread"
    (it does not hang)."""
    done = run_child(NO_THREADS, str(tmp_path), "refused only")
    assert done.returncode == 0, done.stderr
    assert f"REFUSED {MAX_PER_LOOP}" in done.stdout, done.stdout


def test_the_pool_recovers_once_threads_can_start_again(tmp_path: Path) -> None:
    done = run_child(NO_THREADS, str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "RECOVERED" in done.stdout, done.stdout + " (the store's open hung)"


def _child_uses_stores(folder: str, tag: str) -> None:
    """In a forked child (no running loop in this thread): 60 concurrent writes on a
    SQLiteStore and a FileStore of its own, then a grandchild forked that does it too."""

    async def main(name: str) -> None:
        files = await FileStore.open(Path(folder) / f"files-{name}", fsync="never")
        db = await SQLiteStore.open(Path(folder) / f"db-{name}.sqlite3")
        try:
            ids = [f"s{k}" for k in range(30)]
            for sid in ids:
                await files.create(sid)
                await db.create(sid)
            sessions = await asyncio.gather(
                *(submit(files, s, [AppendMessage(Message.user("x", id=s))]) for s in ids),
                *(submit(db, s, [AppendMessage(Message.user("x", id=s))]) for s in ids),
            )
            assert all(s.revision == 1 for s in sessions)
        finally:
            await files.aclose()
            await db.aclose()

    code = 1
    try:
        import signal

        signal.alarm(20)  # a hop waiting for a thread that is not there: killed
        asyncio.run(main(tag))
        pid = os.fork()
        if pid == 0:  # the grandchild
            try:
                asyncio.run(main(tag + "-grandchild"))
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        code = 0 if os.waitstatus_to_exitcode(status) == 0 else 2
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(code)


@asyncio_only
@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")
async def test_a_fork_while_every_worker_is_busy_gives_the_child_working_stores(
    tmp_path: Path,
) -> None:
    """The parent's pool full (40 calls blocked, 5 more in the backlog) when it forks
    (multiprocessing's "fork", from a thread with no running loop): the child and its
    own forked child use SQLiteStore and FileStore with more calls than threads; the
    parent's 45 calls then each run once."""
    release = threading.Event()
    ran: list[int] = []
    lock = threading.Lock()

    def blocked(k: int) -> int:
        with lock:
            ran.append(k)
        release.wait(30)
        return k

    calls = [asyncio.ensure_future(run_in_thread(blocked, k)) for k in range(MAX_PER_LOOP + 5)]
    deadline = time.monotonic() + 10
    loop = asyncio.get_running_loop()

    def waiting() -> int:
        here = POOL._loops.get(loop)
        return 0 if here is None else len(here.backlog)

    while len(ran) < MAX_PER_LOOP or waiting() < 5:
        assert time.monotonic() < deadline, (len(ran), waiting())
        await asyncio.sleep(0.005)
    try:
        context = multiprocessing.get_context("fork")
        process = context.Process(target=_child_uses_stores, args=(str(tmp_path), "child"))
        starter = threading.Thread(target=process.start)  # no running loop in the child
        starter.start()
        await anyio.to_thread.run_sync(starter.join, 20)
        await anyio.to_thread.run_sync(process.join, 30)
        assert process.exitcode == 0, process.exitcode
    finally:
        release.set()
    results = await asyncio.gather(*calls)
    assert results == list(range(MAX_PER_LOOP + 5))
    assert sorted(ran) == list(range(MAX_PER_LOOP + 5))  # each ran once


def test_several_loops_hand_outcomes_to_their_own_loop(tmp_path: Path) -> None:
    """Eight event loops in eight threads, 50 calls each through the one pool (more
    than its threads at once): each outcome is set on its caller's loop (asyncio
    raises if a future of another loop is touched) and is the caller's own."""
    barrier = threading.Barrier(8)
    out: dict[int, Any] = {}

    def loop_thread(n: int) -> None:
        async def main() -> list[tuple[int, int]]:
            barrier.wait(10)

            def work(k: int) -> tuple[int, int]:
                time.sleep(0.001 * (k % 4))
                return n, k

            return list(await asyncio.gather(*(run_in_thread(work, k) for k in range(50))))

        try:
            out[n] = asyncio.run(main())
        except BaseException as exc:
            out[n] = exc

    threads = [threading.Thread(target=loop_thread, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert out == {n: [(n, k) for k in range(50)] for n in range(8)}
