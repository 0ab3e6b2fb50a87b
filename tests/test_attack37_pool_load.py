"""Attack 37: the stores' own worker threads (``stepmachine._threads``) under load.

More store calls in flight than the pool has threads (several SQLiteStore and
FileStore instances, many sessions), calls finishing out of order, one call held
for a long time while the rest go on, several event loops in several threads
sharing the one pool, and the caller's context variables in the stores' hooks.
"""

from __future__ import annotations

import asyncio
import contextvars
import sqlite3
import threading
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from stepmachine import AppendMessage, Message, submit
from stepmachine._threads import MAX_PER_LOOP, POOL, Pool
from stepmachine.extend import Batch
from stepmachine.stores import FileStore, SQLiteStore

asyncio_only = pytest.mark.parametrize("anyio_backend", ["asyncio"])

SESSION: contextvars.ContextVar[str] = contextvars.ContextVar("SESSION", default="?")


def waiting(pool: Pool, loop: asyncio.AbstractEventLoop | None = None) -> int:
    """The calls of ``loop`` (this one by default) waiting in the pool's backlog."""
    here = pool._loops.get(loop or asyncio.get_running_loop())
    return 0 if here is None else len(here.backlog)


def running(pool: Pool, loop: asyncio.AbstractEventLoop) -> int:
    """The calls of ``loop`` running in the pool."""
    here = pool._loops.get(loop)
    return 0 if here is None else here.running


def store_workers(pool: Pool) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if getattr(t, "pool", None) is pool]


class Saturating:
    """A boundary hook that holds every write at ``boundary`` until ``go`` is set (the
    test sets it once ``MAX_PER_LOOP`` writes are held at once: every thread of the pool,
    with calls waiting in the backlog), then lets each go after a different short pause
    (so they finish out of order). It records, per session (read from the caller's
    context variable), how often the write ran."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inside = 0
        self.most = 0
        self.full = threading.Event()
        self.go = threading.Event()
        self.runs: dict[str, int] = {}

    def hook_for(self, boundary: str) -> Any:
        def hook(name: str) -> None:
            if name != boundary:
                return
            session = SESSION.get()
            with self.lock:
                self.runs[session] = self.runs.get(session, 0) + 1
                self.inside += 1
                self.most = max(self.most, self.inside)
                if self.inside == MAX_PER_LOOP:
                    self.full.set()
            self.go.wait(10)
            time.sleep((hash(session) % 7) / 1000)  # finish out of order
            with self.lock:
                self.inside -= 1

        return hook


async def write_one(store: Any, session_id: str) -> int:
    SESSION.set(session_id)
    session = await submit(store, session_id, [AppendMessage(Message.user("x", id=session_id))])
    return session.revision


@asyncio_only
async def test_more_store_calls_than_threads_all_complete_exactly_once(tmp_path: Path) -> None:
    """90 writes through 6 SQLiteStores and 2 FileStores at once: the pool's 40 threads
    are all held inside writes while the other calls wait in the backlog; every write
    then completes, exactly once, with its own result."""
    saturating = Saturating()
    sqlite_hook = saturating.hook_for("apply.inserted")
    file_hook = saturating.hook_for("apply.written")
    stores: list[Any] = [
        await SQLiteStore.open(tmp_path / f"db{k}.sqlite3", boundary_hook=sqlite_hook)
        for k in range(6)
    ]
    stores += [
        await FileStore.open(tmp_path / f"files{k}", fsync="never", boundary_hook=file_hook)
        for k in range(2)
    ]
    jobs: list[tuple[Any, str]] = []
    for k, store in enumerate(stores):
        count = 5 if k < 6 else 30  # a SQLiteStore runs one call at a time; a FileStore many
        for n in range(count):
            session_id = f"s{k}-{n}"
            await store.create(session_id)
            jobs.append((store, session_id))
    try:
        writes = asyncio.gather(*(write_one(store, sid) for store, sid in jobs))
        await anyio.to_thread.run_sync(saturating.full.wait, 10)
        assert saturating.full.is_set()  # every thread of the pool held inside a write
        deadline = time.monotonic() + 10
        pool = POOL
        while not waiting(pool):
            assert time.monotonic() < deadline, "no call waited in the backlog"
            await asyncio.sleep(0.005)
        saturating.go.set()
        results = await asyncio.wait_for(writes, 30)
        assert results == [1] * len(jobs)
        assert saturating.most == MAX_PER_LOOP  # never a 41st thread
        assert saturating.runs == {sid: 1 for _, sid in jobs}  # each write ran once
        for store, session_id in jobs:
            session = await store.load(session_id)
            assert session.revision == 1
            assert [m.id for m in session.conversation] == [session_id]
        assert pool._threads == len(store_workers(pool))  # the count matches the threads
        assert not waiting(pool)
    finally:
        saturating.go.set()
        for store in stores:
            await store.aclose()


@asyncio_only
async def test_one_store_call_held_long_does_not_stop_the_others(tmp_path: Path) -> None:
    """One FileStore write held in its worker thread until the end: 200 other calls on
    other stores and sessions go on meanwhile; the held one then completes once."""
    held = threading.Event()
    release = threading.Event()
    writes: list[str] = []

    def hook(name: str) -> None:
        if name == "apply.written":
            writes.append(SESSION.get())
            if SESSION.get() == "held":
                held.set()
                release.wait(20)

    files = await FileStore.open(tmp_path / "files", fsync="never", boundary_hook=hook)
    db = await SQLiteStore.open(tmp_path / "db.sqlite3")
    try:
        await files.create("held")
        for n in range(20):
            await files.create(f"f{n}")
            await db.create(f"d{n}")
        slow = asyncio.ensure_future(write_one(files, "held"))
        await anyio.to_thread.run_sync(held.wait, 10)
        await asyncio.gather(*(write_one(files, f"f{n}") for n in range(20)))
        for r in range(5):
            await asyncio.gather(
                *(
                    submit(db, f"d{n}", [AppendMessage(Message.user("y", id=f"y{r}"))])
                    for n in range(20)
                )
            )
        assert not slow.done()  # still held: the others did not wait for it
        release.set()
        assert await slow == 1
        assert writes.count("held") == 1
        assert [m.id for m in (await files.load("held")).conversation] == ["held"]
        for n in range(20):
            assert (await db.load(f"d{n}")).revision == 5
    finally:
        release.set()
        await files.aclose()
        await db.aclose()


def run_loop_in_thread(folder: Path, shared_db: Path, name: str, out: dict[str, Any]) -> None:
    """One event loop in this thread: its own FileStore instance on a shared folder and
    its own SQLiteStore on a shared database, 30 writes at once on sessions of its own."""

    async def main() -> list[int]:
        files = await FileStore.open(folder, fsync="never")
        db = await SQLiteStore.open(shared_db, busy_timeout=20)
        try:
            ids = [f"{name}-{n}" for n in range(15)]
            for sid in ids:
                await files.create(sid)
                await db.create(sid)
            got = await asyncio.gather(
                *(write_one(files, sid) for sid in ids), *(write_one(db, sid) for sid in ids)
            )
            loaded = [await files.load(sid) for sid in ids] + [await db.load(sid) for sid in ids]
            assert all([m.id for m in s.conversation] == [s.id] for s in loaded)
            return list(got)
        finally:
            await files.aclose()
            await db.aclose()

    try:
        out[name] = asyncio.run(main())
    except BaseException as exc:
        out[name] = exc


def test_several_event_loops_in_several_threads_share_the_pool(tmp_path: Path) -> None:
    """Four event loops, each in a thread of its own, use the one pool at once: each
    call's outcome comes back to the loop that made it, and every write lands once."""
    folder = tmp_path / "files"
    shared_db = tmp_path / "db.sqlite3"
    with closing(sqlite3.connect(shared_db)) as connection:
        connection.execute("PRAGMA journal_mode=WAL").fetchall()
    out: dict[str, Any] = {}
    threads = [
        threading.Thread(target=run_loop_in_thread, args=(folder, shared_db, f"L{k}", out))
        for k in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    assert out == {f"L{k}": [1] * 30 for k in range(4)}


@pytest.mark.anyio
async def test_store_hooks_see_each_callers_context_variables(tmp_path: Path) -> None:
    """50 writes at once, each from a task with its own value of a context variable:
    each write's hook (in a worker thread) sees its own caller's value; what the hook
    sets is not seen by the caller (a copy, as anyio's threads give)."""
    seen: dict[str, str] = {}
    lock = threading.Lock()

    def hook(name: str) -> None:
        if name == "apply.written":
            with lock:
                seen[SESSION.get()] = threading.current_thread().name
            SESSION.set("changed by the hook")

    store = await FileStore.open(tmp_path / "files", fsync="never", boundary_hook=hook)
    try:
        ids = [f"c{n}" for n in range(50)]
        for sid in ids:
            await store.create(sid)

        async def one(sid: str) -> None:
            assert await write_one(store, sid) == 1
            assert SESSION.get() == sid  # the hook's change stayed in its copy

        async with anyio.create_task_group() as group:
            for sid in ids:
                group.start_soon(one, sid)
        assert sorted(seen) == sorted(ids)
        assert threading.current_thread().name not in set(seen.values())
    finally:
        await store.aclose()


def batch(session_id: str) -> Batch[Any]:
    """The first batch of a new session: one user message, its id the session's."""
    message = Message.user("x", id=session_id)
    return Batch(session_id, 1, "application", 0, time.time(), (AppendMessage(message),))


def _writes_from_blocked_loop(
    db: Path,
    created: threading.Event,
    go: threading.Event,
    out: list[Any],
    loops: list[asyncio.AbstractEventLoop],
) -> None:
    """Another event loop (in this thread): 40 SQLiteStores whose writes all wait on a
    lock an outside connection holds (SQLite's busy timeout, in the worker thread)."""

    async def main() -> None:
        loops.append(asyncio.get_running_loop())
        stores = [await SQLiteStore.open(db, busy_timeout=20) for _ in range(MAX_PER_LOOP)]
        try:
            for k, store in enumerate(stores):
                await store.create(f"a{k}")
            created.set()
            await anyio.to_thread.run_sync(go.wait, 20)
            # store.apply directly: one hop each, the write (no load before it)
            await asyncio.gather(*(store.apply(batch(f"a{k}")) for k, store in enumerate(stores)))
        finally:
            for store in stores:
                await store.aclose()

    try:
        asyncio.run(main())
        out.append("done")
    except BaseException as exc:
        out.append(exc)


@asyncio_only
async def test_a_blocked_event_loop_does_not_starve_another_loops_store(tmp_path: Path) -> None:
    blocked_db = tmp_path / "blocked.sqlite3"
    await (await SQLiteStore.open(blocked_db)).aclose()  # the schema, before the lock
    other = await SQLiteStore.open(tmp_path / "other.sqlite3")
    await other.create("mine2")
    created, go = threading.Event(), threading.Event()
    out: list[Any] = []
    loops: list[asyncio.AbstractEventLoop] = []
    holder = sqlite3.connect(blocked_db, isolation_level=None)
    loop_a = threading.Thread(
        target=_writes_from_blocked_loop, args=(blocked_db, created, go, out, loops)
    )
    load: asyncio.Future[Any] | None = None
    try:
        loop_a.start()
        await anyio.to_thread.run_sync(created.wait, 20)
        holder.execute("BEGIN IMMEDIATE")  # the outside writer: every write of loop A waits
        go.set()
        deadline = time.monotonic() + 10
        while running(POOL, loops[0]) < MAX_PER_LOOP:
            assert time.monotonic() < deadline, "loop A's writes never took the pool"
            await asyncio.sleep(0.01)
        # Loop A's 40 writes (one hop each) hold every thread of its pool, each waiting
        # in SQLite's busy handler for the outside writer. A write here hops too (a
        # load would not: nothing changed).
        load = asyncio.ensure_future(other.apply(batch("mine2")))
        done, _ = await asyncio.wait([load], timeout=1.5)
        assert done, "a load on another loop's store waited for loop A's blocked calls"
    finally:
        go.set()
        holder.execute("ROLLBACK")
        holder.close()
        if load is not None:
            assert (await load).id == "mine2"
        await anyio.to_thread.run_sync(loop_a.join, 30)
        await other.aclose()
    assert out == ["done"]
