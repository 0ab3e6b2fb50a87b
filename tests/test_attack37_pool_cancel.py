"""Attack 37: cancelling store calls that go through the stores' own worker threads
(``stepmachine._threads``) on asyncio: storms of native ``task.cancel()`` and of anyio
cancel scopes around real SQLiteStore and FileStore writes, and a cancellation that
lands while the call still waits for a thread (every thread of the pool busy).

``run_in_thread``'s contract: "A cancellation before the worker thread starts
``function`` raises with nothing done. Once it runs, anyio's own cancel scopes ...
wait for it"; a native cancel waits for a running function, then raises.
"""

from __future__ import annotations

import asyncio
import contextvars
import random
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import pytest

from stepmachine import AppendMessage, Message, submit
from stepmachine._async import run_in_thread
from stepmachine._threads import MAX_PER_LOOP, POOL
from stepmachine.extend import Batch, Lease
from stepmachine.stores import FileStore, SQLiteStore

asyncio_only = pytest.mark.parametrize("anyio_backend", ["asyncio"])


def batch(session_id: str, revision: int, message_id: str) -> Batch[Any]:
    message = Message.user("x", id=message_id)
    return Batch(session_id, revision, "application", 0, time.time(), (AppendMessage(message),))


async def open_stores(tmp_path: Path, hook: Any = None) -> list[Any]:
    return [
        await SQLiteStore.open(tmp_path / "a.sqlite3", boundary_hook=hook),
        await SQLiteStore.open(tmp_path / "b.sqlite3", boundary_hook=hook),
        await FileStore.open(tmp_path / "files", fsync="never", boundary_hook=hook),
    ]


async def check_consistent(stores: list[Any], tmp_path: Path, sessions: list[str]) -> dict:
    """Every session loads, in the live store and in a store opened afresh, the same:
    one message per revision, no id twice. Returns the message ids per (store, session)."""
    fresh = await open_stores(tmp_path)
    ids: dict[tuple[int, str], list[str]] = {}
    try:
        for k, (live, again) in enumerate(zip(stores, fresh, strict=True)):
            for sid in sessions:
                session = await live.load(sid)
                reloaded = await again.load(sid)
                got = [m.id for m in session.conversation]
                assert got == [m.id for m in reloaded.conversation]
                assert session.revision == reloaded.revision == len(got)
                assert len(set(got)) == len(got)
                ids[(k, sid)] = got
    finally:
        for store in fresh:
            await store.aclose()
    return ids


def pausing_hook(name: str) -> None:
    """Writes take a moment in their worker thread, so cancels land inside them."""
    if name in ("apply.inserted", "apply.written"):
        time.sleep(0.002)


WRITING: contextvars.ContextVar[tuple[int, str, str] | None] = contextvars.ContextVar(
    "WRITING", default=None
)


class CancelInside:
    """A boundary hook that, for the writes named in ``victims``, cancels the writing
    task natively from inside its write (SQLite: rows inserted, before ``COMMIT``;
    FileStore: record written, before its fsync), then lets the write go on."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.tasks: dict[tuple[int, str, str], asyncio.Task[Any]] = {}
        self.victims: set[tuple[int, str, str]] = set()
        self.hit: set[tuple[int, str, str]] = set()

    def __call__(self, name: str) -> None:
        if name not in ("apply.inserted", "apply.written"):
            return
        key = WRITING.get()
        if key in self.victims and key not in self.hit:
            self.hit.add(key)
            for _ in range(3):  # a storm: the same task cancelled three times
                self.loop.call_soon_threadsafe(self.tasks[key].cancel)
        time.sleep(0.003)  # the cancels land while this write still runs


@asyncio_only
async def test_a_storm_of_native_cancels_leaves_every_store_whole(tmp_path: Path) -> None:
    """120 writes (3 stores, 8 sessions each), 80 of the tasks cancelled natively 1-3
    times: half of those at a pseudo-random moment, half from inside their own write
    (in the worker thread). A write that returned is stored once; one cancelled inside
    its write is stored once, whole (it ran to its end before the cancel was raised);
    any other cancelled one at most once; and each store goes on working (and agrees
    with a store opened afresh)."""
    rng = random.Random(37)
    hook = CancelInside(asyncio.get_running_loop())
    stores = await open_stores(tmp_path, hook)
    sessions = [f"s{n}" for n in range(8)]

    async def write(key: tuple[int, str, str], store: Any) -> None:
        WRITING.set(key)
        _, sid, mid = key
        await submit(store, sid, [AppendMessage(Message.user("x", id=mid))], max_attempts=100)

    try:
        for store in stores:
            for sid in sessions:
                await store.create(sid)
        tasks = hook.tasks
        for k, store in enumerate(stores):
            for sid in sessions:
                for n in range(5):
                    key = (k, sid, f"{sid}-m{n}")
                    tasks[key] = asyncio.ensure_future(write(key, store))
        victims = rng.sample(sorted(tasks), 80)
        hook.victims.update(victims[:40])
        for key in victims[40:]:
            for _ in range(rng.randint(0, 6)):
                await asyncio.sleep(0)
            for _ in range(rng.randint(1, 3)):
                tasks[key].cancel()
        await asyncio.wait_for(asyncio.wait(list(tasks.values())), 30)
        ids = await check_consistent(stores, tmp_path, sessions)
        assert hook.hit  # writes were cancelled from inside
        for (k, sid, mid), task in tasks.items():
            stored = ids[(k, sid)].count(mid)
            if (k, sid, mid) in hook.hit:
                assert task.cancelled()
                assert stored == 1  # it ran to its end: committed whole
            elif task.cancelled():
                assert stored <= 1
            else:
                assert task.exception() is None
                assert stored == 1
        for store in stores:  # still usable
            for sid in sessions:
                after = await submit(store, sid, [AppendMessage(Message.user("z", id="z"))])
                assert [m.id for m in after.conversation][-1] == "z"
        assert POOL._threads == len(
            [t for t in threading.enumerate() if getattr(t, "pool", None) is POOL]
        )
    finally:
        for store in stores:
            await store.aclose()


@pytest.mark.anyio
async def test_a_storm_of_anyio_cancel_scopes_leaves_every_store_whole(tmp_path: Path) -> None:
    """The same writes, each under an anyio cancel scope; 60 scopes cancelled: half by
    another task at a pseudo-random moment, half from inside the write (the hook
    reaching the loop with ``anyio.from_thread`` and its token). A write cancelled from
    inside is stored once (it ran to its end); on asyncio and trio."""
    rng = random.Random(3737)
    token = anyio.lowlevel.current_token()
    scopes: dict[tuple[int, str, str], anyio.CancelScope] = {}
    inside: set[tuple[int, str, str]] = set()
    hit: set[tuple[int, str, str]] = set()

    def hook(name: str) -> None:
        if name not in ("apply.inserted", "apply.written"):
            return
        key = WRITING.get()
        if key in inside and key not in hit:
            hit.add(key)
            anyio.from_thread.run_sync(scopes[key].cancel, token=token)
        time.sleep(0.002)

    stores = await open_stores(tmp_path, hook)
    sessions = [f"s{n}" for n in range(6)]
    outcome: dict[tuple[int, str, str], str] = {}
    try:
        for store in stores:
            for sid in sessions:
                await store.create(sid)

        async def write(key: tuple[int, str, str], store: Any) -> None:
            WRITING.set(key)
            _, sid, mid = key
            with scopes[key]:
                effects = [AppendMessage(Message.user("x", id=mid))]
                await submit(store, sid, effects, max_attempts=100)
                outcome[key] = "returned"
                return
            outcome[key] = "cancelled"

        async with anyio.create_task_group() as group:
            for k, store in enumerate(stores):
                for sid in sessions:
                    for n in range(5):
                        key = (k, sid, f"{sid}-m{n}")
                        scopes[key] = anyio.CancelScope()
                        group.start_soon(write, key, store)
            victims = rng.sample(sorted(scopes), 60)
            inside.update(victims[:30])
            for key in victims[30:]:
                for _ in range(rng.randint(0, 6)):
                    await anyio.lowlevel.checkpoint()
                scopes[key].cancel()
        ids = await check_consistent(stores, tmp_path, sessions)
        assert "cancelled" in outcome.values()
        assert hit
        for (k, sid, mid), how in outcome.items():
            stored = ids[(k, sid)].count(mid)
            if (k, sid, mid) in hit or how == "returned":
                assert stored == 1
            else:
                assert stored <= 1
    finally:
        for store in stores:
            await store.aclose()


class Occupied:
    """Every thread of the pool busy: ``MAX_PER_LOOP`` calls waiting for ``release``."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.started = 0

    def __call__(self) -> None:
        with self.lock:
            self.started += 1
        self.release.wait(20)

    async def fill(self, group: anyio.abc.TaskGroup) -> None:
        for _ in range(MAX_PER_LOOP):
            group.start_soon(run_in_thread, self)
        deadline = time.monotonic() + 10
        while self.started < MAX_PER_LOOP:
            assert time.monotonic() < deadline
            await anyio.sleep(0.005)


@asyncio_only
async def test_a_native_cancel_of_a_write_waiting_for_a_thread_writes_nothing(
    tmp_path: Path,
) -> None:
    """asyncio.wait_for's timeout (a native cancel) on a write still waiting in the
    backlog: it raises at once and the write never happens."""
    store = await SQLiteStore.open(tmp_path / "db.sqlite3")
    occupied = Occupied()
    try:
        await store.create("s")
        async with anyio.create_task_group() as group:
            await occupied.fill(group)
            assert POOL._loops[asyncio.get_running_loop()].running == MAX_PER_LOOP
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(store.apply(batch("s", 1, "late")), 0.2)
            assert not occupied.release.is_set()  # it did not wait for a thread
            occupied.release.set()
        session = await store.load("s")
        assert session.revision == 0  # never written
        assert (await store.apply(batch("s", 1, "next"))).revision == 1  # the store goes on
    finally:
        occupied.release.set()
        await store.aclose()


async def test_an_anyio_timeout_on_a_write_waiting_for_a_thread_writes_nothing(
    tmp_path: Path,
) -> None:
    """Every worker thread busy (40 blocked calls); a write under ``anyio.move_on_after``
    waits for a thread; the deadline passes before it gets one. The cancellation lands
    before the function starts, so nothing may be written; the threads are let go only
    well after the deadline."""
    store = await SQLiteStore.open(tmp_path / "db.sqlite3")
    occupied = Occupied()
    try:
        await store.create("s")
        async with anyio.create_task_group() as group:
            await occupied.fill(group)
            scope = anyio.CancelScope(deadline=anyio.current_time() + 0.2)

            async def release_after_the_deadline() -> None:
                await anyio.sleep_until(scope.deadline + 0.5)
                occupied.release.set()

            group.start_soon(release_after_the_deadline)
            with scope:
                await store.apply(batch("s", 1, "late"))
            assert scope.cancel_called
        session = await store.load("s")
        assert [m.id for m in session.conversation] == []  # the cancelled write: not stored
    finally:
        occupied.release.set()
        await store.aclose()


@asyncio_only
async def test_native_cancels_of_lease_claims_under_load_leave_no_lease_for_nobody(
    tmp_path: Path,
) -> None:
    """Lease claims (lock files) cancelled natively, some while waiting for a thread
    (the pool filled by an outside writer's lock on another database): each session's
    lease can be claimed afterwards unless a claim returned it (then it is released)."""
    blocked = tmp_path / "blocked.sqlite3"
    await (await SQLiteStore.open(blocked)).aclose()
    store = await FileStore.open(tmp_path / "files", fsync="never")
    waiting = [await SQLiteStore.open(blocked, busy_timeout=20) for _ in range(MAX_PER_LOOP - 5)]
    holder = sqlite3.connect(blocked, isolation_level=None)
    sessions = [f"s{n}" for n in range(12)]
    try:
        for sid in sessions:
            await store.create(sid)
        for k, other in enumerate(waiting):
            await other.create(f"w{k}")
        holder.execute("BEGIN IMMEDIATE")
        writes = [
            asyncio.ensure_future(other.apply(batch(f"w{k}", 1, "w")))
            for k, other in enumerate(waiting)
        ]
        claims = [asyncio.ensure_future(store.claim(sid, f"owner-{sid}", 30)) for sid in sessions]
        for n, task in enumerate(claims):
            for _ in range(n % 4):
                await asyncio.sleep(0)
            task.cancel()
        await asyncio.wait(claims)
        holder.execute("ROLLBACK")
        await asyncio.gather(*writes)
        for sid, task in zip(sessions, claims, strict=True):
            if not task.cancelled():
                lease = task.result()
                assert await store.release(lease)
            again = await store.claim(sid, "after", 30)
            assert isinstance(again, Lease), again  # not held for nobody
            assert await store.release(again)
    finally:
        holder.close()
        await store.aclose()
        for other in waiting:
            await other.aclose()
