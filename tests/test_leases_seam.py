"""Leases at the seam between a run and its store: a release that keeps failing, a
claim cut short, the lock-file stores' meta lock held by a stopped process, and a
turn queued behind a durable turn's last allowed cycle."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from stepmachine import (
    AppendMessage,
    LeasePolicy,
    Message,
    ModelInference,
    Runtime,
    SessionBusyError,
    StateMachine,
    Tools,
    submit,
    tool,
)
from stepmachine import _hold as hold_module
from stepmachine.extend import Lease, LeaseHolder, YieldReason, new_owner
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore, _flock_leases
from stepmachine.testing import FunctionModel, call, reply

LOCAL = ["sqlite", "file"]


async def _open(kind: str, path: Path) -> Any:
    if kind == "memory":
        return MemoryStore()
    if kind == "sqlite":
        return await SQLiteStore.open(path / "db.sqlite3")
    return await FileStore.open(path / "files", fsync="never")


@pytest.fixture(params=LOCAL)
async def local_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    made = await _open(str(request.param), tmp_path)
    try:
        yield made
    finally:
        await made.aclose()


@pytest.fixture(params=["memory", *LOCAL])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    made = await _open(str(request.param), tmp_path)
    try:
        yield made
    finally:
        await made.aclose()


class Proxy:
    """Forwards everything to ``inner``; tests override single methods on the instance."""

    leases_expire: bool = False

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.leases_expire = inner.leases_expire

    async def apply(self, batch: Any, *, lease: Lease | None = None) -> Any:
        return await self.__getattr__("apply")(batch, lease=lease)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def model() -> FunctionModel:
    return FunctionModel(lambda _request: reply("ok"))


async def make_session(store: Any, session_id: str = "s") -> None:
    await store.create(session_id, conversation=[Message.user("hi", id=f"{session_id}-u1")])


@pytest.fixture
def short_meta_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock-file stores give up on the meta lock after 0.05 s instead of 5 s / 1 s."""
    monkeypatch.setattr(_flock_leases, "META_WAIT", 0.05)
    monkeypatch.setattr(_flock_leases, "CLAIM_META_WAIT", 0.05)


@contextlib.contextmanager
def meta_held(store: Any) -> Iterator[None]:
    """The store's meta lock, held as by a process stopped inside it."""
    fd = os.open(os.path.join(store._open_leases().folder, "meta.lock"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


# -- a release that keeps failing --------------------------------------------------------


async def test_a_release_that_always_fails_is_tried_again_then_counted_released(
    store: Any,
) -> None:
    """Transient failures are tried again (three attempts), then the release counts as done."""
    await make_session(store)
    lease = await store.claim("s", new_owner(), 30.0)
    assert isinstance(lease, Lease)
    proxy: Any = Proxy(store)
    attempts: list[bool] = []

    async def release(lease: Lease, *, unless_requested: bool = False) -> bool:
        attempts.append(unless_requested)
        raise OSError("EIO")

    proxy.release = release
    assert await hold_module.release(proxy, lease, unless_requested=True) is True
    assert attempts == [True] * hold_module.RELEASE_ATTEMPTS
    await store.release(lease)


async def test_a_release_that_fails_for_good_is_not_tried_again(store: Any) -> None:
    await make_session(store)
    lease = await store.claim("s", new_owner(), 30.0)
    assert isinstance(lease, Lease)
    proxy: Any = Proxy(store)
    attempts: list[bool] = []

    async def release(lease: Lease, *, unless_requested: bool = False) -> bool:
        attempts.append(unless_requested)
        raise RuntimeError("not transient")

    proxy.release = release
    assert await hold_module.release(proxy, lease, unless_requested=False) is True
    assert attempts == [False]
    await store.release(lease)


async def test_a_lock_file_release_that_raises_lets_go_first(
    local_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Leases rule where leases do not expire: a release never raises still holding."""
    store = local_store
    await make_session(store)
    lease = await store.claim("s", new_owner(), 30.0)
    assert isinstance(lease, Lease)
    leases = store._open_leases()

    def broken(lease: Lease, unless_requested: bool) -> bool:
        raise OSError("EIO: the disk went away")

    monkeypatch.setattr(leases, "_release", broken)
    with pytest.raises(OSError, match="EIO"):
        await store.release(lease)
    monkeypatch.undo()
    got = await store.claim("s", new_owner(), 30.0)
    assert isinstance(got, Lease), got


# -- the meta lock held by a stopped process -----------------------------------------------


@pytest.mark.usefixtures("short_meta_wait")
async def test_a_release_lets_go_without_a_stuck_meta_lock(local_store: Any) -> None:
    """The release gives up on the meta lock after its bound and unlocks all the same; a
    mark set meanwhile stays for the next claimer (it was not looked at)."""
    store = local_store
    leases = store._open_leases()
    await make_session(store)
    lease = await store.claim("s", new_owner(), 30.0)
    assert isinstance(lease, Lease)
    with meta_held(store):
        await anyio.to_thread.run_sync(leases._mark, "s")  # a turn requested while held
        assert await store.release(lease, unless_requested=True) is True
        assert leases._held_here("s") is None
    got = await store.claim_next(new_owner(), 30.0)  # the request is still there
    assert got is not None
    await store.release(got)


@pytest.mark.usefixtures("short_meta_wait")
async def test_request_run_and_claim_next_give_up_on_a_stuck_meta_lock(local_store: Any) -> None:
    store = local_store
    await make_session(store)
    await store.request_run("s")  # makes the lease folder
    with meta_held(store):
        with pytest.raises(TimeoutError, match=r"meta\.lock.*resume or end it"):
            await store.request_run("s")
        with pytest.raises(TimeoutError, match=r"meta\.lock"):
            await store.claim_next(new_owner(), 30.0)


@pytest.mark.usefixtures("short_meta_wait")
async def test_a_claim_answers_busy_on_a_stuck_meta_lock(local_store: Any) -> None:
    """Busy, holder unknown: busy="wait" then gives up at its wait_timeout."""
    store = local_store
    await make_session(store)
    await store.request_run("s")  # makes the lease folder
    with meta_held(store):
        got = await store.claim("s", new_owner(), 30.0)
        assert isinstance(got, LeaseHolder)
        assert got.owner.startswith("(unknown")
        waiting = StateMachine([ModelInference()], lease=LeasePolicy(wait_timeout=0.2))
        with pytest.raises(SessionBusyError):
            await waiting.run(Runtime(store=store, model=model()), "s")


# -- a claim cut short: the worker thread undoes it ----------------------------------------


async def test_a_native_cancel_during_claim_next_leaves_the_work_marked(
    local_store: Any, anyio_backend: str
) -> None:
    """The thread's claim for a caller that is gone is undone: the lock let go and the
    mark it took made again, so the requested turn is still work."""
    if anyio_backend != "asyncio":
        pytest.skip("task.cancel() is asyncio's")
    store = local_store
    await make_session(store)
    await store.request_run("s")
    leases = store._open_leases()
    entered, proceed, done = threading.Event(), threading.Event(), threading.Event()
    real = leases._claim_marked

    def claim_marked(owner: str, ttl: float) -> Any:
        entered.set()
        proceed.wait(10)
        try:
            return real(owner, ttl)
        finally:
            done.set()

    leases._claim_marked = claim_marked
    task = asyncio.get_running_loop().create_task(store.claim_next(new_owner(), 30.0))
    await anyio.to_thread.run_sync(entered.wait, 10)
    task.cancel()
    proceed.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    await anyio.to_thread.run_sync(done.wait, 10)
    leases._claim_marked = real
    got = await store.claim_next(new_owner(), 30.0)  # waits for the meta lock: undone by then
    assert got is not None
    assert got.session_id == "s"
    await store.release(got)


async def test_ctrl_c_escaping_a_claim_hands_its_turn_back(store: Any) -> None:
    """A claim that took effect and then raised KeyboardInterrupt: released, and the mark it
    may have taken is set again (the requested turn is still work)."""
    await make_session(store)
    await store.request_run("s")
    proxy: Any = Proxy(store)
    real = store.claim
    calls = []

    async def claim(session_id: str, owner: str, ttl: float) -> Any:
        got = await real(session_id, owner, ttl)
        calls.append(got)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return got

    proxy.claim = claim
    with pytest.raises(KeyboardInterrupt):
        await hold_module.claim(proxy, "s", new_owner(), LeasePolicy())
    assert isinstance(calls[0], Lease)
    assert isinstance(calls[1], LeaseHolder)  # the guard asked: that owner holds it
    assert calls[1].epoch == calls[0].epoch
    got = await store.claim_next(new_owner(), 30.0)  # free, and marked again
    assert got is not None
    await store.release(got)


# -- a turn queued behind a durable turn's last allowed cycle --------------------------------


@pytest.fixture
def durable_machine() -> Any:
    dbos = pytest.importorskip("dbos", reason="DBOS is not installed (the dbos extra)")
    from stepmachine.durable import DurableMachine

    dbos.DBOS.destroy(destroy_registry=True)
    yield DurableMachine
    dbos.DBOS.destroy(destroy_registry=True)


async def test_a_turn_queued_behind_a_durable_turns_last_cycle_stays_marked(
    store: Any, durable_machine: Any
) -> None:
    """With no cycle left in the turn, the mark the release took is set again."""
    await make_session(store)
    proxy: Any = Proxy(store)
    queued: list[str] = []

    async def release(lease: Lease, *, unless_requested: bool = False) -> bool:
        if not queued:
            await submit(store, "s", [AppendMessage(Message.user("and more", id="u2"))])
            report = await StateMachine(
                [ModelInference()], lease=LeasePolicy(busy="queue")
            ).run_report(Runtime(store=store, model=model()), "s")
            queued.append(report.reason.kind)
        released: bool = await store.release(lease, unless_requested=unless_requested)
        return released

    proxy.release = release
    durable = durable_machine(
        StateMachine([ModelInference()]), Runtime(store=proxy, model=model()), max_cycles=1
    )
    start = await durable._start("s")
    summary = await durable._cycle("s", 1, start)
    assert queued == [YieldReason.QUEUED]
    assert summary["status"] != "continue"  # the turn's only cycle: it ends
    got = await store.claim_next(new_owner(), 30.0)  # the queued turn is still work
    assert got is not None
    await store.release(got)


# -- an in-process store's synchronous lease calls ---------------------------------------


def test_only_the_marked_lease_methods_have_a_synchronous_form() -> None:
    """``now`` finds MemoryStore's own forms; an override or a wrapper is called as it is."""
    from stepmachine._lease import now

    plain = MemoryStore()
    for method, form in [
        ("claim", "_claim_now"),
        ("renew", "_renew_now"),
        ("release", "_release_now"),
    ]:
        found = now(plain, method)
        assert found is not None
        assert getattr(found, "__func__", None) is getattr(MemoryStore, form)

    class Overriding(MemoryStore):
        async def release(self, lease: Lease, *, unless_requested: bool = False) -> bool:
            return await super().release(lease, unless_requested=unless_requested)

    assert now(Overriding(), "release") is None
    assert now(Overriding(), "claim") is not None  # not overridden: still its own
    wrapped = MemoryStore()
    inner = wrapped.renew

    async def renew(lease: Lease) -> Lease:
        return await inner(lease)

    patched: Any = wrapped
    patched.renew = renew
    assert now(wrapped, "renew") is None
    assert now(SQLiteStore, "claim") is None  # a store that waits on its lease calls: none


async def test_a_run_calls_a_subclass_lease_override(tmp_path: Path) -> None:
    """A MemoryStore subclass that overrides claim, renew and release sees every call of a run."""
    calls: list[str] = []

    class Counting(MemoryStore):
        async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | LeaseHolder:
            calls.append("claim")
            return await super().claim(session_id, owner, ttl)

        async def renew(self, lease: Lease) -> Lease:
            calls.append("renew")
            return await super().renew(lease)

        async def release(self, lease: Lease, *, unless_requested: bool = False) -> bool:
            calls.append("release")
            return await super().release(lease, unless_requested=unless_requested)

    @tool
    def ping() -> str:
        """Answer pong (a plain tool: non-idempotent, its lease confirmed before it starts)."""
        return "pong"

    def decide(request: Any) -> Any:
        return call(("ping", {})) if request.messages[-1].role == "user" else reply("ok")

    store = Counting()
    await make_session(store)
    machine: StateMachine[Any] = StateMachine([Tools([ping]), ModelInference(stream=False)])
    session = await machine.run(Runtime(store=store, model=FunctionModel(decide)), "s")
    assert session.conversation[-1].text == "ok"
    assert calls == ["claim", "renew", "release"]
