"""``run()`` holds the session's lease: wait, fail, queue, fencing, renewal, ``serve``.

The stores' side of leases is the lease conformance suite (tests/test_leases_*.py);
here the machine's: two runners on one session never mark a finished tool
"outcome unknown", a busy session follows the caller's policy, a lost lease
stops the run and nothing it computes afterwards is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import msgspec
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

import stepmachine._hold
from stepmachine import (
    AppendMessage,
    CancelToken,
    ConfigurationError,
    LeaseLostError,
    LeasePolicy,
    Message,
    ModelInference,
    Refuse,
    Runtime,
    SessionBusyError,
    StateMachine,
    StoreClosedError,
    StoredDataError,
    Tools,
    Yield,
    run_worker,
    submit,
    tool,
)
from stepmachine.extend import (
    OUTCOME_UNKNOWN,
    Batch,
    Lease,
    LeaseHolder,
    YieldReason,
    history_problems,
    new_owner,
)
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore, _flock_leases
from stepmachine.testing import FunctionModel, ScriptedModel, call, reply


class Slow:
    """A non-idempotent ``charge`` tool that waits for a gate; counts what it did."""

    def __init__(self) -> None:
        self.started = anyio.Event()
        self.go = anyio.Event()
        self.charges: list[int] = []

    def tool(self) -> Any:
        async def charge(amount: int) -> str:
            """Charge the card."""
            self.started.set()
            await self.go.wait()
            self.charges.append(amount)
            return f"charged {amount}"

        return tool(charge)


def results_text(session: Any) -> list[str]:
    return [
        part.content if isinstance(part.content, str) else repr(part.content)
        for message in session.conversation
        for part in message.parts
        if type(part).__name__ == "ToolResultPart"
    ]


def machine_for(slow: Slow, **kwargs: Any) -> StateMachine[Any]:
    return StateMachine([Tools([slow.tool()]), ModelInference()], **kwargs)


async def two_runners(lease: LeasePolicy | None) -> tuple[Slow, Any]:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("pay 5", id="u1")])
    slow = Slow()
    model = ScriptedModel([call(("charge", {"amount": 5})), reply("paid")])
    runtime = Runtime(store=store, model=model)
    machine = machine_for(slow, lease=lease)
    async with anyio.create_task_group() as tg:
        tg.start_soon(machine.run, runtime, "s")
        await slow.started.wait()
        second = anyio.Event()

        async def run_second() -> None:
            await machine.run(runtime, "s")
            second.set()

        tg.start_soon(run_second)
        with anyio.move_on_after(0.3):
            await second.wait()  # without a lease the second run answers at once
        slow.go.set()
    return slow, await store.load("s")


async def test_a_second_runner_waits_and_never_calls_a_running_tool_unknown() -> None:
    slow, session = await two_runners(LeasePolicy())
    assert slow.charges == [5]
    assert results_text(session) == ["charged 5"]
    assert OUTCOME_UNKNOWN not in " ".join(results_text(session))
    assert history_problems(session.conversation) == []


async def test_without_a_lease_the_second_runner_reads_the_call_as_crashed() -> None:
    """The defect leases fix, shown: this is what ``lease=None`` still does."""
    slow, session = await two_runners(None)
    assert slow.charges == [5]  # the tool did run
    assert any(OUTCOME_UNKNOWN in text for text in results_text(session))


async def hold_session(store: MemoryStore) -> Lease:
    held = await store.claim("s", "someone-else", 30.0)
    assert isinstance(held, Lease)
    return held


async def test_busy_fail_raises_and_writes_nothing() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    await hold_session(store)
    machine = StateMachine([ModelInference()], lease=LeasePolicy(busy="fail"))
    with pytest.raises(SessionBusyError) as caught:
        await machine.run(Runtime(store=store, model=ScriptedModel([reply("x")])), "s")
    assert caught.value.holder == "someone-else"
    assert (await store.load("s")).revision == 0


async def test_busy_wait_gives_up_after_wait_timeout() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    await hold_session(store)
    machine = StateMachine([ModelInference()], lease=LeasePolicy(wait_timeout=0.2, poll=0.05))
    with pytest.raises(SessionBusyError):
        await machine.run(Runtime(store=store, model=ScriptedModel([reply("x")])), "s")
    assert (await store.load("s")).revision == 0


async def test_busy_wait_runs_once_the_holder_lets_go() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    held = await hold_session(store)
    machine = StateMachine([ModelInference()], lease=LeasePolicy(poll=0.05))
    runtime = Runtime(store=store, model=ScriptedModel([reply("hello")]))
    async with anyio.create_task_group() as tg:
        tg.start_soon(machine.run, runtime, "s")
        await anyio.sleep(0.1)
        assert (await store.load("s")).revision == 0  # still waiting
        await store.release(held)
    session = await store.load("s")
    assert session.conversation[-1].text == "hello"


async def test_busy_queue_returns_and_the_holder_runs_the_turn() -> None:
    """A turn queued just before the holder lets go is run by the holder."""
    queued: list[Any] = []

    class Racy(MemoryStore):
        """Another runner queues a turn in the window before the holder's release."""

        async def release(self, lease: Lease, *, unless_requested: bool = False) -> bool:
            if not queued:
                await submit(self, "s", [AppendMessage(Message.user("thanks", id="u2"))])
                queued.append(await machine.run_report(runtime, "s"))
            return await super().release(lease, unless_requested=unless_requested)

    store = Racy()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    runtime = Runtime(store=store, model=ScriptedModel([reply("hello"), reply("welcome")]))
    machine = StateMachine([ModelInference()], lease=LeasePolicy(busy="queue"))
    report = await machine.run_report(runtime, "s")
    assert queued[0].reason.kind == YieldReason.QUEUED
    assert queued[0].results == ()
    session = await store.load("s")
    assert [m.text for m in session.conversation] == ["hi", "hello", "thanks", "welcome"]
    assert [r.step for r in report.results] == ["inference", "inference"]
    assert await store.claim_next("w", 30.0) is None  # the queued turn was taken


async def test_a_queued_turn_survives_a_holder_that_dies() -> None:
    store = MemoryStore(expiring_leases=True)
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    held = await store.claim("s", "doomed", 0.2)
    assert isinstance(held, Lease)
    machine = StateMachine([ModelInference()], lease=LeasePolicy(busy="queue"))
    runtime = Runtime(store=store, model=ScriptedModel([reply("hello")]))
    assert (await machine.run_report(runtime, "s")).reason.kind == YieldReason.QUEUED
    await anyio.sleep(0.4)  # the holder never releases: its lease lapses
    lease = await store.claim_next("worker", 30.0)
    assert isinstance(lease, Lease)
    session = await machine.run(runtime, "s", lease=lease)
    assert session.conversation[-1].text == "hello"


async def test_a_lost_lease_stops_the_run_and_nothing_later_is_stored() -> None:
    """A holder that cannot renew (paused, partitioned) loses the session to another."""

    class NoRenew(MemoryStore):
        async def renew(self, lease: Lease) -> Lease:
            return lease  # pretend: the renewal never reaches the store

    store = NoRenew(expiring_leases=True)
    await store.create("s", conversation=[Message.user("pay 5", id="u1")])
    slow = Slow()
    model = ScriptedModel([call(("charge", {"amount": 5})), reply("paid")])
    machine = machine_for(slow, lease=LeasePolicy(ttl=0.3))
    runtime = Runtime(store=store, model=model)
    lost: list[LeaseLostError] = []
    async with anyio.create_task_group() as tg:

        async def first() -> None:
            try:
                await machine.run(runtime, "s")
            except LeaseLostError as exc:
                lost.append(exc)

        tg.start_soon(first)
        await slow.started.wait()
        await anyio.sleep(0.5)  # the lease lapsed
        taken = await store.claim("s", "newcomer", 30.0)
        assert isinstance(taken, Lease)
        before = (await store.load("s")).revision
        slow.go.set()  # the tool finishes; its result write is fenced off
    assert len(lost) == 1
    assert slow.charges == [5]
    after = await store.load("s")
    assert after.revision == before
    assert "charged 5" not in results_text(after)


async def test_a_lease_lost_while_renewing_cancels_the_run() -> None:
    class Revoked(MemoryStore):
        async def renew(self, lease: Lease) -> Lease:
            raise LeaseLostError(lease.session_id, lease.owner, lease.epoch, "revoked")

    store = Revoked(expiring_leases=True)
    await store.create("s", conversation=[Message.user("pay 5", id="u1")])
    slow = Slow()
    model = ScriptedModel([call(("charge", {"amount": 5})), reply("paid")])
    machine = machine_for(slow, lease=LeasePolicy(ttl=0.15))
    with pytest.raises(LeaseLostError), anyio.fail_after(5):
        await machine.run(Runtime(store=store, model=model), "s")
    assert slow.charges == []  # cancelled while waiting for the gate
    busy = await store.claim("s", "next", 30.0)
    assert isinstance(busy, Lease)  # the run released what it held


async def test_the_run_releases_its_lease_on_return_and_on_error() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    machine = StateMachine([ModelInference()])
    await machine.run(Runtime(store=store, model=ScriptedModel([reply("a")])), "s")
    assert isinstance(await store.claim("s", "probe", 30.0), Lease)

    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])

    def broken(request: Any) -> Any:
        raise RuntimeError("model down")

    with pytest.raises(RuntimeError, match="model down"):
        await machine.run(Runtime(store=store, model=FunctionModel(broken)), "s")
    assert isinstance(await store.claim("s", "probe", 30.0), Lease)


async def test_lease_none_runs_without_claiming() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    await hold_session(store)
    machine = StateMachine([ModelInference()], lease=None)
    session = await machine.run(Runtime(store=store, model=ScriptedModel([reply("a")])), "s")
    assert session.revision == 1


async def test_a_claimed_lease_is_run_and_released() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    await store.request_run("s")
    lease = await store.claim_next("worker", 30.0)
    assert isinstance(lease, Lease)
    machine = StateMachine([ModelInference()])
    session = await machine.run(
        Runtime(store=store, model=ScriptedModel([reply("a")])), "s", lease=lease
    )
    assert session.revision == 1
    assert isinstance(await store.claim("s", "probe", 30.0), Lease)
    with pytest.raises(ConfigurationError, match="lease of session"):
        await machine.run(Runtime(store=store), "other", lease=lease)


def test_lease_policy_is_checked() -> None:
    with pytest.raises(ConfigurationError, match="busy"):
        LeasePolicy(busy="later")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="ttl"):
        LeasePolicy(ttl=0)
    with pytest.raises(ConfigurationError, match="wait_timeout"):
        LeasePolicy(wait_timeout=-1)
    with pytest.raises(ConfigurationError, match="lease"):
        StateMachine([ModelInference()], lease="wait")  # type: ignore[arg-type]


async def test_serve_runs_requested_sessions_until_stopped() -> None:
    store = MemoryStore()
    names = [f"s{i}" for i in range(5)]
    for name in names:
        await store.create(name, conversation=[Message.user(f"hi {name}", id="u1")])
        await store.request_run(name)

    def answer(request: Any) -> Any:
        return reply(f"re: {request.messages[-1].text}")

    machine = StateMachine([ModelInference()])
    runtime = Runtime(store=store, model=FunctionModel(answer))
    stop = CancelToken()
    served: list[str] = []

    def seen(report: Any) -> None:
        served.append(report.session.id)
        if len(served) == len(names):
            stop.cancel("all served")

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(
                    lambda i=i: run_worker(
                        machine,
                        runtime,
                        stop=stop,
                        poll=0.02,
                        on_report=seen,
                        owner_prefix=f"w{i}:",
                    )
                )
    assert sorted(served) == names
    for name in names:
        session = await store.load(name)
        assert session.conversation[-1].text == f"re: hi {name}"
        holder = await store.claim(name, "probe", 30.0)
        assert not isinstance(holder, LeaseHolder)


async def test_serve_needs_a_store_with_leases() -> None:
    class Plain:
        async def load(self, session_id: str) -> Any: ...
        async def apply(self, batch: Any) -> Any: ...

    with pytest.raises(ConfigurationError, match="leases"):
        await run_worker(StateMachine([ModelInference()]), Runtime(store=Plain()))  # type: ignore[arg-type]


async def test_a_wrapper_forwarding_attributes_runs_without_a_lease() -> None:
    """Leases are read from the store's class: a forwarding wrapper's apply takes no lease."""

    class Forwarding:
        def __init__(self, inner: MemoryStore) -> None:
            self.inner = inner

        async def apply(self, batch: Any) -> Any:  # no lease keyword
            return await self.inner.apply(batch)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    inner = MemoryStore()
    await inner.create("s", conversation=[Message.user("hi", id="u1")])
    store: Any = Forwarding(inner)
    assert store.leases_expire is False  # forwarded, but not declared by the class
    session = await StateMachine([ModelInference()]).run(
        Runtime(store=store, model=ScriptedModel([reply("a")])), "s"
    )
    assert session.revision == 1


KINDS = ["memory", "memory-expiring", "sqlite", "file", "postgres"]


async def open_store(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    if kind == "memory":
        return MemoryStore()
    if kind == "memory-expiring":
        return MemoryStore(expiring_leases=True)
    if kind == "sqlite":
        return await SQLiteStore.open(tmp_path / "db.sqlite3")
    if kind == "file":
        return await FileStore.open(tmp_path / "files", fsync="never")
    pytest.importorskip("psycopg", reason="psycopg is not installed (the postgres extra)")
    from stepmachine.stores import PostgresStore

    dsn = request.getfixturevalue("postgres_dsn")
    return await PostgresStore.open(dsn)


@pytest.fixture(params=KINDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    made = await open_store(str(request.param), tmp_path, request)
    try:
        yield made
    finally:
        await made.aclose()


class Proxy:
    """A store that forwards everything to ``inner``; tests override single methods.

    It declares leases on its class (``has_leases`` reads the class, so that a
    wrapper written before leases is not taken for one with them) and forwards
    ``lease=`` with every apply, as a wrapper written for leases does.
    """

    leases_expire: bool = False  # declared: this wrapper takes leases; the instance's is inner's

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.leases_expire = inner.leases_expire

    async def apply(self, batch: Any, *, lease: Lease | None = None) -> Any:
        """Forwarded through ``__getattr__`` (so subclasses that wrap calls see it)."""
        return await self.__getattr__("apply")(batch, lease=lease)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def counting_model() -> FunctionModel:
    """Answers every request with "ok"; ``model.calls`` counts the requests."""

    def answer(_request: Any) -> Any:
        return reply("ok")

    return FunctionModel(answer)


async def make_session(store: Any, session_id: str = "s") -> None:
    await store.create(session_id, conversation=[Message.user("hi", id=f"{session_id}-u1")])


def machine(**kwargs: Any) -> StateMachine[Any]:
    return StateMachine([ModelInference()], **kwargs)


async def pending_work(store: Any) -> Lease | None:
    """What ``claim_next`` gives out now (released again at once)."""
    lease: Lease | None = await store.claim_next(new_owner("probe:"), 30.0)
    if lease is not None:
        await store.release(lease)
    return lease


# -- (2) lost turns ---------------------------------------------------------------------


async def test_a_turn_queued_while_held_survives_a_cancel_after_the_mark_was_taken(
    store: Any,
) -> None:
    await make_session(store)
    proxy: Any = Proxy(store)
    scope = anyio.CancelScope()

    async def release(lease: Lease, *, unless_requested: bool = False) -> bool:
        if unless_requested:
            await store.request_run(lease.session_id)  # a busy="queue" run() arrives just now
        released: bool = await store.release(lease, unless_requested=unless_requested)
        if not released:  # the holder took the mark: it promised to run the turn
            scope.cancel()  # ... and is cancelled (Ctrl-C, a shutdown) before it starts
        return released

    proxy.release = release
    model = counting_model()
    with scope:
        await machine().run(Runtime(store=proxy, model=model), "s")
    assert model.calls == 1  # the queued turn did not run in the cancelled holder
    # So it must still be work for whoever claims next (as for a cancelled run):
    assert await pending_work(store) is not None


async def test_a_turn_queued_while_held_survives_a_failing_second_round(store: Any) -> None:
    await make_session(store)
    proxy: Any = Proxy(store)
    took_mark = False

    async def release(lease: Lease, *, unless_requested: bool = False) -> bool:
        nonlocal took_mark
        if unless_requested and not took_mark:
            await store.request_run(lease.session_id)
        released: bool = await store.release(lease, unless_requested=unless_requested)
        took_mark = took_mark or not released
        return released

    async def load(session_id: str) -> Any:
        if took_mark:
            raise OSError("the database went away for a moment")
        return await store.load(session_id)

    proxy.release = release
    proxy.load = load
    with pytest.raises(OSError, match="went away"):
        await machine().run(Runtime(store=proxy, model=counting_model()), "s")
    assert await pending_work(store) is not None  # the queued turn is still work


async def test_a_queued_turn_survives_a_holder_whose_first_round_raises(store: Any) -> None:
    """Held up: the mark set during a round that raises stays for the next claimer."""
    await make_session(store)

    async def answer(_request: Any) -> Any:
        await store.request_run("s")  # a busy="queue" run() arrives while the model answers
        raise RuntimeError("the model fell over")

    with pytest.raises(RuntimeError, match="fell over"):
        await machine().run(Runtime(store=store, model=FunctionModel(answer)), "s")
    assert await pending_work(store) is not None


# -- (5) hostile input: a damaged lock-file record -----------------------------------------


LOCAL_KINDS = ["sqlite", "file"]


@pytest.fixture(params=LOCAL_KINDS)
async def local_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    made = await open_store(str(request.param), tmp_path, request)
    try:
        yield made
    finally:
        await made.aclose()


def lock_path(store: Any, session_id: str) -> str:
    path: str = store._open_leases()._lock_path(session_id)
    return path


async def test_one_damaged_lock_file_does_not_stop_claim_next(local_store: Any) -> None:
    store = local_store
    for session_id in ("a", "b"):
        await make_session(store, session_id)
    lease = await store.claim("a", new_owner(), 30.0)  # makes a's lock file
    assert isinstance(lease, Lease)
    await store.release(lease)
    await anyio.Path(lock_path(store, "a")).write_bytes(b"\x00garbage\n")
    for session_id in ("a", "b"):
        await store.request_run(session_id)
    with pytest.raises(StoredDataError):
        await store.claim("a", new_owner(), 30.0)  # a itself is reported (that is right)
    got = await store.claim_next(new_owner(), 30.0)  # but b is still served
    assert got is not None
    assert got.session_id == "b"


# -- (4)/(5) a release that fails once leaves the session busy for good ---------------------


NON_EXPIRING = ["memory", "sqlite", "file"]


@pytest.fixture(params=NON_EXPIRING)
async def held_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    made = await open_store(str(request.param), tmp_path, request)
    try:
        yield made
    finally:
        await made.aclose()


async def test_a_release_that_fails_once_does_not_leave_the_session_busy_forever(
    held_store: Any,
) -> None:
    store = held_store
    await make_session(store)
    proxy: Any = Proxy(store)
    failures = [OSError("EINTR: interrupted system call")]

    async def release(lease: Lease, *, unless_requested: bool = False) -> bool:
        if failures:
            raise failures.pop()
        released: bool = await store.release(lease, unless_requested=unless_requested)
        return released

    proxy.release = release
    await machine().run(Runtime(store=proxy, model=counting_model()), "s")  # returns normally
    # The same process, later: the session should not be busy (nobody runs it).
    got = await store.claim("s", new_owner(), 30.0)
    assert isinstance(got, Lease), got


# -- (2)/(5) a claim that fails half-way on the lock-file stores ---------------------------


async def test_a_claim_that_fails_half_way_keeps_the_requested_turn(
    local_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = local_store
    await make_session(store)
    await store.request_run("s")
    real_touch = _flock_leases._touch

    def touch(path: str) -> None:
        if f"{os.sep}held{os.sep}" in path:
            raise OSError(28, "No space left on device")
        real_touch(path)

    monkeypatch.setattr(_flock_leases, "_touch", touch)
    with pytest.raises(OSError, match="No space"):
        await store.claim_next(new_owner(), 30.0)
    monkeypatch.setattr(_flock_leases, "_touch", real_touch)
    assert await pending_work(store) is not None  # nobody ran it: it is still work


# -- (4) asyncio's own cancellation (task.cancel(): asyncio.timeout, a web server's
# disconnect, asyncio.run's Ctrl-C handler) is not stopped by anyio's shield -----------------


async def test_a_native_asyncio_cancel_during_the_claim_leaks_no_lease(
    local_store: Any, anyio_backend: str
) -> None:
    if anyio_backend != "asyncio":
        pytest.skip("task.cancel() is asyncio's; trio has only cancel scopes (which held up)")

    store = local_store
    await make_session(store)
    leases = store._open_leases()
    entered, proceed, claimed = threading.Event(), threading.Event(), threading.Event()
    real_check, real_claim = leases._check, leases._claim

    def check(session_id: str) -> None:
        entered.set()
        proceed.wait(10)
        real_check(session_id)

    def claim(*args: Any) -> Any:
        try:
            return real_claim(*args)
        finally:
            claimed.set()

    leases._check, leases._claim = check, claim
    task = asyncio.get_running_loop().create_task(
        machine().run(Runtime(store=store, model=counting_model()), "s")
    )
    await anyio.to_thread.run_sync(entered.wait, 10)
    task.cancel()  # what asyncio.timeout() or a cancelled request handler does
    proceed.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    await anyio.to_thread.run_sync(claimed.wait, 10)
    leases._check, leases._claim = real_check, real_claim
    got = await store.claim("s", new_owner(), 30.0)
    assert isinstance(got, Lease), got  # the cancelled run holds nothing any more


# -- (4) a cancel scope or KeyboardInterrupt at every store call of a run -----------------


class Interrupting(Proxy):
    """Counts the store's async calls; at call number ``at`` it runs ``hit`` before or
    after forwarding (a cancel landing at that await, or Ctrl-C raised there)."""

    def __init__(self, inner: Any, at: int, hit: Callable[[], None], *, after: bool) -> None:
        super().__init__(inner)
        self.at, self.hit, self.after = at, hit, after
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if not callable(value) or name.startswith("_") or name in ("session_loader",):
            return value

        async def call(*args: Any, **kwargs: Any) -> Any:
            number = len(self.calls)
            self.calls.append(name)
            if number == self.at and not self.after:
                self.hit()
                await anyio.lowlevel.checkpoint()
            result = await value(*args, **kwargs)
            if number == self.at and self.after:
                self.hit()
                await anyio.lowlevel.checkpoint()
            return result

        return call


# Call 0 is the claim; a hit *after* it returned is the two tests below.
POINTS = [(at, after) for at in range(6) for after in (False, True) if (at, after) != (0, True)]
POINT_IDS = [f"{at}-{'after' if after else 'before'}" for at, after in POINTS]


@pytest.mark.parametrize(("at", "after"), POINTS, ids=POINT_IDS)
async def test_a_cancel_at_any_store_call_leaks_no_lease(store: Any, at: int, after: bool) -> None:
    """Held up: the run releases its lease whichever store call a cancel lands at."""
    await make_session(store)
    scope = anyio.CancelScope()
    proxy = Interrupting(store, at, scope.cancel, after=after)
    with scope:
        await machine().run(Runtime(store=proxy, model=counting_model()), "s")
    got = await store.claim("s", new_owner(), 30.0)
    assert isinstance(got, Lease), (proxy.calls, got)
    await store.release(got)


def interrupt() -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize(("at", "after"), POINTS, ids=POINT_IDS)
async def test_ctrl_c_at_any_store_call_leaks_no_lease(store: Any, at: int, after: bool) -> None:
    """Held up: KeyboardInterrupt at any other store call; the run releases its lease."""
    await make_session(store)
    proxy = Interrupting(store, at, interrupt, after=after)
    with contextlib.suppress(KeyboardInterrupt):
        await machine().run(Runtime(store=proxy, model=counting_model()), "s")
    got = await store.claim("s", new_owner(), 30.0)
    assert isinstance(got, Lease), (proxy.calls, got)
    await store.release(got)


async def test_ctrl_c_right_after_the_claim_leaks_no_lease(store: Any) -> None:
    await make_session(store)
    proxy = Interrupting(store, 0, interrupt, after=True)
    with pytest.raises(KeyboardInterrupt):
        await machine().run(Runtime(store=proxy, model=counting_model()), "s")
    got = await store.claim("s", new_owner(), 30.0)
    assert isinstance(got, Lease), got


async def test_a_cancel_right_after_the_claim_leaks_no_lease(store: Any) -> None:
    await make_session(store)
    scope = anyio.CancelScope()
    proxy = Interrupting(store, 0, scope.cancel, after=True)
    with scope:
        await machine().run(Runtime(store=proxy, model=counting_model()), "s")
    got = await store.claim("s", new_owner(), 30.0)
    assert isinstance(got, Lease), got


# -- (5) hostile durations -------------------------------------------------------------------


@pytest.mark.parametrize("ttl", [1e300, 1e18])
async def test_a_huge_ttl_is_refused_or_works(
    store: Any, ttl: float, request: pytest.FixtureRequest
) -> None:
    """``check_claim`` accepts any finite ttl > 0, so every store must take it (or say no
    with ValueError before touching anything); a lease must then renew and release."""
    await make_session(store)
    try:
        got = await store.claim("s", new_owner(), ttl)
    except ValueError:
        return
    assert isinstance(got, Lease)
    assert await store.renew(got) == got
    assert await store.release(got)
    assert isinstance(await store.claim("s", new_owner(), 30.0), Lease)


def test_a_ttl_too_short_to_renew_is_refused() -> None:
    with pytest.raises(ConfigurationError):
        LeasePolicy(ttl=1e-9)


# -- (5) a renewal that fails: random errors, a closed store, Ctrl-C -------------------------

EXPIRING = ["memory-expiring", "postgres"]


@pytest.fixture(params=EXPIRING)
async def expiring_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    made = await open_store(str(request.param), tmp_path, request)
    try:
        yield made
    finally:
        await made.aclose()


def renewing_run(
    store: Any, renew: Callable[[Lease, int], Any], renewals: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[Proxy, FunctionModel]:
    """A proxy whose renew calls ``renew(lease, n)``; the run renews every millisecond (the
    lease keeps its 30 s ttl, so nothing lapses on any clock) and the model answers once
    ``renewals`` renewals were attempted."""
    monkeypatch.setattr(stepmachine._hold, "renew_interval", lambda lease: 0.001)
    proxy: Any = Proxy(store)
    attempts = [0]
    enough = anyio.Event()

    async def proxy_renew(lease: Lease) -> Lease:
        attempts[0] += 1
        if attempts[0] >= renewals:
            enough.set()
        result: Lease = await renew(lease, attempts[0])
        return result

    async def answer(_request: Any) -> Any:
        await enough.wait()
        return reply("ok")

    proxy.renew = proxy_renew
    return proxy, FunctionModel(answer)


async def test_renewals_that_fail_now_and_then_keep_the_run_going(
    expiring_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held up: errors of a renewal are retried while the lease cannot have lapsed."""
    store = expiring_store
    await make_session(store)

    async def renew(lease: Lease, n: int) -> Lease:
        if n % 3:
            raise [OSError("reset"), TimeoutError("slow"), RuntimeError("?")][n % 3]
        result: Lease = await store.renew(lease)
        return result

    proxy, model = renewing_run(store, renew, 12, monkeypatch)
    session = await machine().run(Runtime(store=proxy, model=model), "s")
    assert session.revision == 1
    assert isinstance(await store.claim("s", new_owner(), 30.0), Lease)  # released


async def test_a_store_closed_under_the_renewal_stops_the_run(
    expiring_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held up: StoreClosedError from renew is a lost lease; the run writes nothing more."""

    store = expiring_store
    await make_session(store)

    async def renew(lease: Lease, n: int) -> Lease:
        raise StoreClosedError("closed under the run")

    proxy, model = renewing_run(store, renew, 1, monkeypatch)
    with pytest.raises(LeaseLostError, match="closed under the run"):
        await machine().run(Runtime(store=proxy, model=model), "s")
    assert (await store.load("s")).revision == 0


async def test_ctrl_c_in_the_renewal_is_a_keyboard_interrupt(
    expiring_store: Any, monkeypatch: pytest.MonkeyPatch, anyio_backend: str
) -> None:
    if anyio_backend != "trio":
        pytest.skip("asyncio lets a KeyboardInterrupt of any task leave the event loop at once")
    store = expiring_store
    await make_session(store)

    async def renew(lease: Lease, n: int) -> Lease:
        raise KeyboardInterrupt

    proxy, model = renewing_run(store, renew, 1, monkeypatch)
    try:
        await machine().run(Runtime(store=proxy, model=model), "s")
    except KeyboardInterrupt:
        return
    except BaseExceptionGroup as group:  # kept from pytest, which stops the session on a KI
        raise AssertionError(f"the KeyboardInterrupt came wrapped: {group!r}") from None
    raise AssertionError("no KeyboardInterrupt")


# -- (6) serve(): failing sessions, fairness, the stop token --------------------------------


class Again:
    """A step for session ``a``: each run appends a note and asks for another run of ``a``
    (a chatty submitter keeps requesting it), ``times`` times; it refuses elsewhere."""

    name = "again"

    def __init__(self, store: Any, times: int) -> None:
        self.store, self.left, self.ran = store, times, 0

    async def run(self, ctx: Any) -> Any:

        if ctx.session.id != "a" or self.left == 0 or ctx.session.revision > self.ran:
            return Refuse()
        self.left -= 1
        self.ran += 1
        await self.store.request_run("a")
        note = Message.user(f"more {self.ran}", id=f"a-more-{self.ran}")
        return Yield([AppendMessage(note)], "done")


async def test_serve_gives_every_requested_session_a_turn(store: Any) -> None:
    for session_id in ("a", "b"):
        await make_session(store, session_id)
        await store.request_run(session_id)
    again = Again(store, times=20)
    served_b = anyio.Event()
    runs_of_a_before_b: list[int] = []

    async def answer(request: Any) -> Any:
        if request.messages[0].id == "b-u1":
            runs_of_a_before_b.append(again.ran)
            served_b.set()
        return reply("ok")

    stop = CancelToken()
    worker: StateMachine[Any] = StateMachine([again, ModelInference()])
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: run_worker(
                worker, Runtime(store=store, model=FunctionModel(answer)), stop=stop, poll=0.001
            )
        )
        await served_b.wait()
        stop.cancel()
    assert runs_of_a_before_b[0] <= 2, runs_of_a_before_b


async def test_serve_does_not_retry_a_failing_session_in_a_loop(store: Any) -> None:
    """Held up: a run that raises takes its mark; serve polls on and runs it no more."""
    await make_session(store)
    await store.request_run("s")
    proxy: Any = Proxy(store)
    polls = [0]
    enough = anyio.Event()

    async def claim_next(owner: str, ttl: float) -> Lease | None:
        polls[0] += 1
        if polls[0] >= 20:
            enough.set()
        result: Lease | None = await store.claim_next(owner, ttl)
        return result

    proxy.claim_next = claim_next

    def answer(_request: Any) -> Any:
        raise RuntimeError("this session always fails")

    model = FunctionModel(answer)
    stop = CancelToken()
    async with anyio.create_task_group() as tg:
        tg.start_soon(
            lambda: run_worker(machine(), Runtime(store=proxy, model=model), stop=stop, poll=0.001)
        )
        await enough.wait()
        stop.cancel()
    assert model.calls == 1
    assert isinstance(await store.claim("s", new_owner(), 30.0), Lease)  # released


# -- (1) fencing: stale, forged, copied, foreign leases ------------------------------------


def one_message_batch(session: Any, text: str) -> Any:

    return Batch(
        session_id=session.id,
        revision=session.revision + 1,
        step="test",
        cycle=session.revision + 1,
        timestamp=1_700_000_000.0,
        effects=(AppendMessage(Message.user(text, id=f"m{session.revision + 1}")),),
    )


async def test_no_lease_but_the_current_one_writes(store: Any) -> None:
    """Held up: a released lease, a copy of it, a lease forged from the holder's owner string
    (as LeaseHolder shows it) with a guessed epoch, and the current lease of another session
    are all refused; renewing or releasing them leaves the holder alone."""
    await make_session(store)
    await make_session(store, "other")
    first = await store.claim("s", new_owner(), 30.0)
    assert isinstance(first, Lease)
    assert await store.release(first)
    current = await store.claim("s", new_owner(), 30.0)
    assert isinstance(current, Lease)
    holder = await store.claim("s", new_owner(), 30.0)
    assert isinstance(holder, LeaseHolder)
    foreign = await store.claim("other", new_owner(), 30.0)
    assert isinstance(foreign, Lease)

    stale = [
        first,
        msgspec.json.decode(msgspec.json.encode(first), type=Lease),  # a copy, as stored by DBOS
        Lease("s", holder.owner, current.epoch + 1, 30.0),  # the next epoch, guessed
        Lease("s", holder.owner, current.epoch - 1, 30.0),
        Lease("s", first.owner, current.epoch, 30.0),  # the right epoch, an old owner
        Lease("s", foreign.owner, foreign.epoch, 30.0),  # another session's lease, relabelled
        foreign,
    ]
    for lease in stale:
        session = await store.load("s")
        with pytest.raises(LeaseLostError):
            await store.apply(one_message_batch(session, "stale"), lease=lease)
        if lease is not foreign:
            with pytest.raises(LeaseLostError):
                await store.renew(lease)
            assert await store.release(lease, unless_requested=True)
    assert (await store.load("s")).revision == 0
    after = await store.apply(one_message_batch(await store.load("s"), "ok"), lease=current)
    assert after.revision == 1
    with pytest.raises(ConfigurationError):
        await machine().run(Runtime(store=store, model=counting_model()), "s", lease=foreign)


async def test_a_run_given_a_released_lease_writes_nothing(store: Any) -> None:
    """Held up: run_report(lease=...) with a lease the run before released."""
    await make_session(store)
    lease = await store.claim("s", new_owner(), 30.0)
    assert isinstance(lease, Lease)
    await machine().run(Runtime(store=store, model=counting_model()), "s", lease=lease)
    assert (await store.load("s")).revision == 1

    await submit(store, "s", [AppendMessage(Message.user("again", id="u2"))])
    with pytest.raises(LeaseLostError):
        await machine().run(Runtime(store=store, model=counting_model()), "s", lease=lease)
    assert (await store.load("s")).revision == 2


# -- (3) durable cycles and run() callers on one session --------------------------------------


class Gate:
    """A non-idempotent ``charge`` tool that waits for ``go``; counts its charges."""

    def __init__(self) -> None:
        self.started = anyio.Event()
        self.go = anyio.Event()
        self.charges = 0

    def tool(self) -> Any:

        async def charge(amount: int) -> str:
            """Charge the card."""
            self.started.set()
            await self.go.wait()
            self.charges += 1
            return f"charged {amount}"

        return tool(charge)


def charging_model() -> FunctionModel:

    def answer(request: Any) -> Any:
        if request.messages[-1].role == "user" and request.messages[-1].id == "s-u1":
            return call(("charge", {"amount": 5}))
        return reply("paid")

    return FunctionModel(answer)


def tool_results(session: Any) -> list[str]:
    return [
        str(part.content)
        for message in session.conversation
        for part in message.parts
        if type(part).__name__ == "ToolResultPart"
    ]


@pytest.fixture
def durable_machine() -> Any:
    dbos = pytest.importorskip("dbos", reason="DBOS is not installed (the dbos extra)")
    from stepmachine.durable import DurableMachine

    dbos.DBOS.destroy(destroy_registry=True)
    yield DurableMachine
    dbos.DBOS.destroy(destroy_registry=True)


async def durable_cycles(durable: Any, session_id: str) -> None:
    """A durable turn's cycles, run in place (what the DBOS workflow does, without DBOS)."""
    start = await durable._start(session_id)
    for number in range(1, 10):
        summary = await durable._cycle(session_id, number, start)
        if summary["status"] != "continue":
            return


@pytest.mark.parametrize("second", ["run", "durable"])
async def test_a_durable_cycle_and_a_second_runner_never_call_a_tool_unknown(
    store: Any, durable_machine: Any, second: str
) -> None:
    """Held up: a durable cycle holds the lease while its tool runs; a run() or a second
    (recovered) durable turn waits for it and finds the call answered."""

    await make_session(store)
    gate = Gate()
    steps = [Tools([gate.tool()]), ModelInference()]
    runtime = Runtime(store=store, model=charging_model())
    durable = durable_machine(StateMachine(steps), runtime, name="review")
    async with anyio.create_task_group() as tg:
        tg.start_soon(durable_cycles, durable, "s")
        await gate.started.wait()
        done = anyio.Event()

        async def other() -> None:
            if second == "run":
                await StateMachine(steps).run(runtime, "s")
            else:
                await durable_cycles(durable, "s")
            done.set()

        tg.start_soon(other)
        for _ in range(50):  # give the second runner every chance to read the call as crashed
            await anyio.lowlevel.checkpoint()
        assert not done.is_set()
        gate.go.set()
    session = await store.load("s")
    assert gate.charges == 1
    assert OUTCOME_UNKNOWN not in " ".join(tool_results(session))
    assert history_problems(session.conversation) == []


@pytest.mark.parametrize("holder", ["run", "durable"])
async def test_a_turn_queued_behind_the_last_cycle_is_run(
    store: Any, durable_machine: Any, holder: str
) -> None:
    """``run``: the reference (held up): the holder takes the mark and runs again."""

    await make_session(store)
    proxy: Any = Proxy(store)
    queued: list[str] = []

    async def release(lease: Lease, *, unless_requested: bool = False) -> bool:
        session = await store.load("s")
        if not queued and session.conversation[-1].role == "assistant":  # the turn is done
            # A user writes now and queues a turn: the holder still holds the session.
            await submit(store, "s", [AppendMessage(Message.user("and more", id="u2"))])
            report = await StateMachine(
                [ModelInference()], lease=LeasePolicy(busy="queue")
            ).run_report(Runtime(store=store, model=counting_model()), "s")
            queued.append(report.reason.kind)
        released: bool = await store.release(lease, unless_requested=unless_requested)
        return released

    proxy.release = release
    runtime = Runtime(store=proxy, model=counting_model())
    if holder == "run":
        await machine().run(runtime, "s")
    else:
        await durable_cycles(durable_machine(machine(), runtime, name="review"), "s")
    assert queued == [YieldReason.QUEUED]
    session = await store.load("s")
    assert session.conversation[-1].role == "assistant"  # "and more" was answered


@pytest.mark.parametrize("runner", ["run", "durable"])
async def test_a_user_message_during_a_tool_keeps_the_tools_result(
    store: Any, durable_machine: Any, runner: str
) -> None:
    """A submit() while the holder's tool runs makes the tool cycle's write conflict; the
    holder must keep the result it has, not read its own intent as a crash."""

    await make_session(store)
    gate = Gate()
    steps = [Tools([gate.tool()]), ModelInference()]
    runtime = Runtime(store=store, model=charging_model())
    async with anyio.create_task_group() as tg:
        if runner == "run":
            tg.start_soon(StateMachine(steps).run, runtime, "s")
        else:
            tg.start_soon(durable_cycles, durable_machine(StateMachine(steps), runtime), "s")
        await gate.started.wait()
        await submit(store, "s", [AppendMessage(Message.user("also this", id="u2"))])
        gate.go.set()
    session = await store.load("s")
    assert gate.charges == 1
    assert tool_results(session) == ["charged 5"], tool_results(session)
    assert OUTCOME_UNKNOWN not in " ".join(tool_results(session))


@pytest.mark.parametrize("ttl", [float("nan"), float("inf"), -1.0])
async def test_renew_refuses_a_lease_with_a_bad_ttl(expiring_store: Any, ttl: float) -> None:

    store = expiring_store
    await make_session(store)
    lease = await store.claim("s", new_owner(), 30.0)
    assert isinstance(lease, Lease)
    with pytest.raises(ValueError, match="ttl"):
        await store.renew(msgspec.structs.replace(lease, ttl=ttl))
    assert await store.renew(lease) == lease  # the lease as it was
    other = await store.claim("s", new_owner(), 30.0)
    assert isinstance(other, LeaseHolder)
    assert other.expires_in is not None
    assert 0 < other.expires_in <= 30.0


# -- (4)/(5) a process stopped inside the store-wide meta lock (SIGSTOP, `docker pause`) ----


async def test_a_stopped_process_in_the_meta_lock_does_not_hang_busy_fail(
    local_store: Any,
) -> None:

    store = local_store
    await make_session(store)
    await store.request_run("s")  # makes the lease folder
    await store.claim_next(new_owner(), 30.0)  # the session is now held (by this process)
    meta = os.path.join(store._open_leases().folder, "meta.lock")
    fd = os.open(meta, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a process stopped inside it
        busy = machine(lease=LeasePolicy(busy="fail"))
        with anyio.move_on_after(1.0):  # a hang guard only: fail fast means at once
            with pytest.raises(SessionBusyError):
                await busy.run(Runtime(store=store, model=counting_model()), "s")
            return
        raise AssertionError("busy='fail' hung on the meta lock")
    finally:
        os.close(fd)


async def test_lease_calls_after_aclose(store: Any, request: pytest.FixtureRequest) -> None:
    """The Leases protocol: every method raises StoreClosedError after aclose."""

    await make_session(store)
    lease = await store.claim("s", new_owner(), 30.0)
    assert isinstance(lease, Lease)
    await store.aclose()
    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "claim": lambda: store.claim("s", new_owner(), 30.0),
        "claim_next": lambda: store.claim_next(new_owner(), 30.0),
        "request_run": lambda: store.request_run("s"),
        "renew": lambda: store.renew(lease),
        "release": lambda: store.release(lease),
    }
    answered = {}
    for name, lease_call in calls.items():
        try:
            answered[name] = repr(await lease_call())
        except StoreClosedError:
            answered[name] = "StoreClosedError"
    assert answered == dict.fromkeys(calls, "StoreClosedError")


# -- (1) a real holder process paused (SIGSTOP) while its tool runs ---------------------------

PAUSED_CHILD = Path(__file__).with_name("_paused_child.py")
ROOT = Path(__file__).resolve().parents[1]


async def start_paused_child(kind: str, where: str, backend: str) -> Any:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    return await anyio.open_process(
        [sys.executable, str(PAUSED_CHILD), kind, where, backend], env=env
    )


async def read_line(stream: Any) -> dict[str, Any]:

    line: dict[str, Any] = json.loads(await stream.receive_until(b"\n", 1 << 16))
    return line


@pytest.mark.parametrize("kind", ["postgres", "sqlite", "file"])
async def test_a_holder_paused_mid_tool_is_fenced_off_or_waited_for(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest, anyio_backend: str
) -> None:
    """Held up. PostgreSQL: the paused holder's lease lapses, a second runner takes over
    (the call is "outcome unknown": its holder is not live), and the holder, woken, writes
    nothing. Lock files: no expiry, the second runner (busy="fail") is refused."""

    if kind == "postgres":
        where = request.getfixturevalue("postgres_dsn")
    else:
        where = str(tmp_path / ("db.sqlite3" if kind == "sqlite" else "files"))
    store = await open_store(kind, tmp_path, request)
    runs_here = [0]

    def charge(amount: int) -> str:
        """Charge the card."""
        runs_here[0] += 1
        return "charged here"

    def answer(request: Any) -> Any:

        if request.messages[-1].role == "user":
            return call(("charge", {"amount": 5}))
        return reply("paid")

    steps = [Tools([tool(charge)]), ModelInference()]
    try:
        await make_session(store)
        process = await start_paused_child(kind, where, anyio_backend)
        out = BufferedByteReceiveStream(process.stdout)
        try:
            with anyio.fail_after(60):  # a hang guard only
                assert await read_line(out) == {"started": True}
                process.send_signal(signal.SIGSTOP)
                second = Runtime(store=store, model=FunctionModel(answer))
                if kind == "postgres":
                    while not await pending_free(store):  # noqa: ASYNC110 - polls the store
                        await anyio.sleep(0.05)
                    await StateMachine(steps, lease=LeasePolicy(busy="fail")).run(second, "s")
                else:
                    with pytest.raises(SessionBusyError):
                        await StateMachine(steps, lease=LeasePolicy(busy="fail")).run(second, "s")
                before = await store.load("s")
                process.send_signal(signal.SIGCONT)
                await process.stdin.send(b"go\n")
                assert await read_line(out) == {"charged": True}
                ended = await read_line(out)
                await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
                with anyio.CancelScope(shield=True):
                    await process.wait()
            await process.aclose()
        after = await store.load("s")
        results = tool_results(after)
        assert history_problems(after.conversation) == []
        assert runs_here == [0]  # the second runner never ran the call itself
        if kind == "postgres":
            assert ended == {"ended": "LeaseLostError"}
            assert after == before  # the woken holder wrote nothing
            assert len(results) == 1
            assert OUTCOME_UNKNOWN in results[0]
        else:
            assert ended == {"ended": "returned"}
            assert results == ["charged 5"]
    finally:
        await store.aclose()


async def pending_free(store: Any) -> bool:
    """Whether the session's lease can be claimed now (claimed and released again)."""
    got = await store.claim("s", new_owner("probe:"), 30.0)
    if isinstance(got, Lease):
        await store.release(got)
        return True
    return False


@pytest.mark.parametrize("poll", [0.0, -1.0, float("nan")])
async def test_serve_refuses_a_poll_that_would_spin(poll: float) -> None:
    store = MemoryStore()
    proxy: Any = Proxy(store)
    stop = CancelToken()
    polls = [0]

    async def claim_next(owner: str, ttl: float) -> Lease | None:
        polls[0] += 1
        if polls[0] >= 1000:
            stop.cancel()  # a guard: a worker that polls a thousand times at once spins
        result: Lease | None = await store.claim_next(owner, ttl)
        return result

    proxy.claim_next = claim_next
    proxy.leases_expire = False
    with pytest.raises(ConfigurationError):
        await run_worker(
            machine(), Runtime(store=proxy, model=counting_model()), stop=stop, poll=poll
        )


# -- (7) secrets ------------------------------------------------------------------------------


async def test_lease_errors_never_show_the_database_password(
    postgres_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Held up: a DSN's password appears in no lease error (busy, lost, closed) and in no
    log line of a failed renewal. Owner strings (host:pid:random) do appear: see the report."""
    pytest.importorskip("psycopg", reason="psycopg is not installed (the postgres extra)")
    from psycopg.conninfo import make_conninfo

    from stepmachine.stores import PostgresStore

    secret = "hunter2-s3cret"
    dsn = make_conninfo(postgres_dsn, password=secret)  # the test server trusts loopback
    store = await PostgresStore.open(dsn)
    seen: list[str] = []
    try:
        await make_session(store)
        lease = await store.claim("s", new_owner(), 30.0)
        assert isinstance(lease, Lease)
        with pytest.raises(SessionBusyError) as busy:
            await machine(lease=LeasePolicy(busy="fail")).run(
                Runtime(store=store, model=counting_model()), "s"
            )
        seen.append(str(busy.value))
        await store.release(lease)
        with pytest.raises(LeaseLostError) as lost:
            await store.renew(lease)
        seen.append(str(lost.value))
    finally:
        await store.aclose()
    with pytest.raises(StoreClosedError) as closed:
        await store.claim("s", new_owner(), 30.0)
    seen.append(str(closed.value))
    seen.extend(record.getMessage() for record in caplog.records)
    assert all(secret not in text for text in seen), seen


@pytest.mark.parametrize("hit", ["cancel", "ctrl-c"])
@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
async def test_a_waiting_run_interrupted_between_claims_leaks_nothing(
    store: Any, hit: str, after: bool
) -> None:
    """Held up: a run waiting for a busy session (busy="wait") is cancelled, or gets Ctrl-C,
    at its third claim; the holder's release then frees the session for anyone."""
    await make_session(store)
    holder = await store.claim("s", new_owner("holder:"), 30.0)
    assert isinstance(holder, Lease)
    scope = anyio.CancelScope()
    proxy = Interrupting(store, 2, scope.cancel if hit == "cancel" else interrupt, after=after)
    with scope, contextlib.suppress(KeyboardInterrupt):
        await machine().run(Runtime(store=proxy, model=counting_model()), "s")
    # Ctrl-C escapes a claim: one claim more, the guard asking whether the cut-short
    # claim took effect (the session is the holder's: nothing to release).
    assert proxy.calls == ["claim"] * (3 if hit == "cancel" else 4)
    assert await store.release(holder)
    got = await store.claim("s", new_owner(), 30.0)
    assert isinstance(got, Lease), got


@pytest.mark.parametrize("kind", ["sqlite", "file"])
async def test_a_store_closed_mid_run_frees_the_session_for_another_instance(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Held up: aclose() while a run holds the lock-file lease: the run fails with
    StoreClosedError or LeaseLostError, writes nothing more, and another store instance
    on the same files can claim the session at once."""
    store = await open_store(kind, tmp_path, request)
    other = await open_store(kind, tmp_path, request)
    try:
        await make_session(store)
        inside = anyio.Event()
        closed = anyio.Event()

        async def answer(_request: Any) -> Any:
            inside.set()
            await closed.wait()
            return reply("too late")

        async def run() -> None:
            with pytest.raises((StoreClosedError, LeaseLostError)):
                await machine().run(Runtime(store=store, model=FunctionModel(answer)), "s")

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await inside.wait()
            assert isinstance(await other.claim("s", new_owner(), 30.0), LeaseHolder)
            await store.aclose()
            closed.set()
        got = await other.claim("s", new_owner(), 30.0)
        assert isinstance(got, Lease), got
        assert (await other.load("s")).revision == 0
    finally:
        await other.aclose()
        await store.aclose()


# -- a store wrapper written before leases ----------------------------------------------------


class Instrumented:
    """An application's store wrapper from before leases: it counts writes and forwards
    everything else (tests/harness/crash.py's AckingStore is one)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.writes = 0

    async def apply(self, batch: Any) -> Any:
        self.writes += 1
        return await self._inner.apply(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def test_a_store_wrapper_from_before_leases_still_runs(store: Any) -> None:
    await make_session(store)
    wrapper = Instrumented(store)
    session = await machine().run(Runtime(store=wrapper, model=counting_model()), "s")
    assert session.revision == 1
    assert wrapper.writes == 1


class CountingMemoryStore(MemoryStore):
    """A subclass from before leases that overrides apply (tests/harness/dbos_crash.py's
    AckingStore(PostgresStore) is one)."""

    writes = 0

    async def apply(self, batch: Any) -> Any:  # type: ignore[override]
        CountingMemoryStore.writes += 1
        return await super().apply(batch)


async def test_a_store_subclass_from_before_leases_gets_a_clear_error() -> None:
    store = CountingMemoryStore()
    await make_session(store)
    with pytest.raises(ConfigurationError, match="lease"):
        await machine().run(Runtime(store=store, model=counting_model()), "s")
