"""PostgresStore's leases on a real PostgreSQL server.

The lease conformance suite (one process), then processes on one database:

- a holder paused with SIGSTOP past its ttl, while another process takes the
  session over and writes, is fenced off when it wakes: its apply (stale or
  current revision) and its renewal raise ``LeaseLostError`` and nothing of it
  is stored;
- worker processes racing ``claim_next`` over many requested sessions are never
  given one session twice;
- a SIGKILLed holder's session (with a queued turn) is claimed again once its
  lease expired, with a greater epoch.

Every wait is for a condition (a line from a child, a claim that succeeds),
bounded only by a generous hang guard: no timing thresholds.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import pytest
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream
from hypothesis import given, settings
from hypothesis import strategies as st

from stepmachine import (
    AppendMessage,
    Codec,
    ConfigurationError,
    ConflictError,
    Effect,
    LeaseLostError,
    LeasePolicy,
    Message,
    ModelInference,
    Runtime,
    Session,
    StateMachine,
    submit,
)
from stepmachine.extend import Batch, Lease, LeaseHolder, new_owner
from stepmachine.stores import FileStore, MemoryStore, PostgresStore, SQLiteStore
from stepmachine.stores._memory_leases import MemoryLeases
from stepmachine.testing import FunctionModel, reply
from stepmachine.testing.leases import LeaseConformance

pytest.importorskip("psycopg", reason="psycopg is not installed (the postgres extra)")

ROOT = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).with_name("_postgres_lease_child.py")
HANG_GUARD = 120.0
"""Seconds after which a test that waits for a condition is failed as hung."""


class TestPostgresStoreLeases(LeaseConformance):
    @pytest.fixture(autouse=True)
    def _dsn(self, postgres_dsn: str) -> None:
        self.dsn = postgres_dsn

    async def make_store(self, codec: Codec[Any], path: Path) -> PostgresStore:
        return await PostgresStore.open(self.dsn, codec)


# -- processes on one database ------------------------------------------------------


def batch_for(session: Session[Any], text: str) -> Batch[Effect]:
    revision = session.revision + 1
    return Batch(
        session_id=session.id,
        revision=revision,
        step=text,
        cycle=revision,
        timestamp=1_700_000_000.0 + revision,
        effects=(AppendMessage(Message.user(text, id=f"{text}-{revision}")),),
    )


class Child:
    """A running ``tests/_postgres_lease_child.py``: JSON lines out, lines in."""

    def __init__(self, process: Process) -> None:
        self.process = process
        assert process.stdout is not None
        self._out = BufferedByteReceiveStream(process.stdout)

    async def line(self) -> dict[str, Any]:
        """The child's next line (fails when it exits first)."""
        try:
            raw = await self._out.receive_until(b"\n", 1 << 16)
        except (anyio.EndOfStream, anyio.IncompleteRead):
            await self.process.wait()
            assert self.process.stderr is not None
            error = (await self.process.stderr.receive()).decode(errors="replace")
            pytest.fail(f"the child exited ({self.process.returncode}) without a line: {error}")
        said: dict[str, Any] = json.loads(raw)
        return said

    async def send(self, text: str) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send(text.encode() + b"\n")

    def signal(self, number: int) -> None:
        self.process.send_signal(number)

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()  # SIGKILL: also ends a stopped process


@asynccontextmanager
async def child(role: str, dsn: str, backend: str, *args: str) -> AsyncIterator[Child]:
    """Start a child in ``role``; SIGKILLed and reaped when the block ends."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(CHILD), role, dsn, backend, *args]
    process = await anyio.open_process(command, env=env)
    running = Child(process)
    try:
        yield running
    finally:
        with anyio.CancelScope(shield=True):
            running.kill()
            await process.wait()
            await process.aclose()


async def claim_when_free(store: PostgresStore, session_id: str, owner: str) -> Lease:
    """Claim ``session_id`` as soon as its holder's lease expired (polling)."""
    with anyio.fail_after(HANG_GUARD):
        while not isinstance(got := await store.claim(session_id, owner, 30.0), Lease):  # noqa: ASYNC110 - polls the database
            await anyio.sleep(0.05)
    return got


async def test_a_paused_holder_wakes_fenced_off(postgres_dsn: str, anyio_backend: str) -> None:
    async with await PostgresStore.open(postgres_dsn) as store:
        await store.create("s")
        async with child("paused", postgres_dsn, anyio_backend, "s", "1.0") as paused:
            with anyio.fail_after(HANG_GUARD):
                first = (await paused.line())["claimed"]
            paused.signal(signal.SIGSTOP)  # paused, not dead: it stops renewing
            me = new_owner("parent:")
            lease = await claim_when_free(store, "s", me)
            assert lease.epoch == first + 1
            mine = await store.apply(batch_for(await store.load("s"), "parent"), lease=lease)
            await paused.send("go")
            paused.signal(signal.SIGCONT)
            with anyio.fail_after(HANG_GUARD):
                said = await paused.line()
        assert said == {
            "stale": "LeaseLostError",  # its batch on the revision it read at the claim
            "fresh": "LeaseLostError",  # its batch on the revision it read after waking
            "renew": "LeaseLostError",
            "seen": 1,
        }
        assert await store.load("s") == mine
        assert [batch.step for batch in await store.batches("s")] == ["parent"]
        busy = await store.claim("s", new_owner("third:"), 30.0)
        assert isinstance(busy, LeaseHolder)
        assert busy.owner == me


async def test_racing_worker_processes_never_share_a_session(
    postgres_dsn: str, anyio_backend: str
) -> None:
    names = [f"s{i:02}" for i in range(40)]
    async with await PostgresStore.open(postgres_dsn) as store:
        for name in names:
            await store.create(name)
            await store.request_run(name)
        got: list[tuple[str, int]] = []
        done: list[int] = []
        async with (
            child("worker", postgres_dsn, anyio_backend, "w0") as w0,
            child("worker", postgres_dsn, anyio_backend, "w1") as w1,
            child("worker", postgres_dsn, anyio_backend, "w2") as w2,
            child("worker", postgres_dsn, anyio_backend, "w3") as w3,
        ):
            workers = [w0, w1, w2, w3]
            with anyio.fail_after(HANG_GUARD):
                for worker in workers:
                    assert await worker.line() == {"ready": True}
                for worker in workers:  # all start together
                    await worker.send("go")

                async def collect(worker: Child) -> None:
                    while "done" not in (said := await worker.line()):
                        got.append(tuple(said["got"]))
                    done.append(said["done"])

                async with anyio.create_task_group() as tg:
                    for worker in workers:
                        tg.start_soon(collect, worker)
        twice = [name for name, count in Counter(name for name, _ in got).items() if count > 1]
        assert twice == []
        assert sorted(name for name, _ in got) == names
        assert sum(done) == len(names)
        for name in names:  # one batch each: no second claimer wrote
            assert (await store.load(name)).revision == 1
        assert await store.claim_next("late", 30.0) is None


async def test_a_killed_holders_session_is_claimed_after_its_ttl(
    postgres_dsn: str, anyio_backend: str
) -> None:
    async with await PostgresStore.open(postgres_dsn) as store:
        await store.create("s")
        async with child("holder", postgres_dsn, anyio_backend, "s", "1.0") as holder:
            with anyio.fail_after(HANG_GUARD):
                said = await holder.line()
            await store.request_run("s")  # a turn queued while it holds the session
            holder.kill()
            await holder.process.wait()
        with anyio.fail_after(HANG_GUARD):  # the queued turn waits for the lease to lapse
            while (lease := await store.claim_next("worker", 30.0)) is None:  # noqa: ASYNC110 - polls the database
                await anyio.sleep(0.05)
        assert (lease.session_id, lease.epoch) == ("s", said["claimed"] + 1)
        after = await store.apply(batch_for(await store.load("s"), "worker"), lease=lease)
        assert after.revision == 1


# -- a process stalled inside a transaction -------------------------------------------


async def test_a_stalled_transaction_holds_the_session_only_until_the_idle_limit(
    postgres_dsn: str,
) -> None:
    """A writer stalled between two statements (paused, partitioned) keeps its row lock
    only until the server ends its connection; then a claim goes through."""
    import psycopg

    stalled = anyio.Event()
    resume = threading.Event()
    token = anyio.lowlevel.current_token()

    def hook(name: str) -> None:
        if name == "apply.inserted":  # the session row is locked, nothing committed
            anyio.from_thread.run_sync(stalled.set, token=token)
            resume.wait(HANG_GUARD)

    async with (
        await PostgresStore.open(
            postgres_dsn, idle_in_transaction_timeout=0.5, boundary_hook=hook
        ) as writer,
        await PostgresStore.open(postgres_dsn) as other,
    ):
        session = await writer.create("s")
        async with anyio.create_task_group() as tg:

            async def write() -> None:
                with pytest.raises(psycopg.Error, match="idle-in-transaction"):
                    await writer.apply(batch_for(session, "stalled"))

            tg.start_soon(write)
            with anyio.fail_after(HANG_GUARD):
                await stalled.wait()
                lease = await other.claim("s", "other", 30.0)  # waits for the row lock
            resume.set()
        assert isinstance(lease, Lease)
        assert (await other.load("s")).revision == 0
        assert await other.batches("s") == []


@pytest.mark.parametrize("seconds", [0, -1.0, True, "5"])
async def test_the_idle_limit_must_be_positive(postgres_dsn: str, seconds: Any) -> None:
    with pytest.raises(ConfigurationError, match="idle_in_transaction_timeout"):
        await PostgresStore.open(postgres_dsn, idle_in_transaction_timeout=seconds)


# -- fencing and the compare-and-set --------------------------------------------------


async def test_a_lost_lease_is_said_before_a_conflict(postgres_dsn: str) -> None:
    """A stale holder whose store's cache is behind too gets LeaseLostError, not a conflict."""
    async with (
        await PostgresStore.open(postgres_dsn) as old_store,
        await PostgresStore.open(postgres_dsn) as new_store,
    ):
        session = await old_store.create("s")
        old = await old_store.claim("s", "old", 30.0)
        assert isinstance(old, Lease)
        await old_store.release(old)
        new = await new_store.claim("s", "new", 30.0)
        assert isinstance(new, Lease)
        await new_store.apply(batch_for(await new_store.load("s"), "new"), lease=new)
        for stale in (session, await old_store.load("s")):  # wrong revision, then right
            with pytest.raises(LeaseLostError, match="'new' holds the session now"):
                await old_store.apply(batch_for(stale, "old"), lease=old)
        assert [batch.step for batch in await new_store.batches("s")] == ["new"]


async def test_a_current_lease_still_gets_conflicts(postgres_dsn: str) -> None:
    async with await PostgresStore.open(postgres_dsn) as store:
        session = await store.create("s")
        lease = await store.claim("s", "a", 30.0)
        assert isinstance(lease, Lease)
        await store.apply(batch_for(session, "submitted"))  # unfenced: submit()
        with pytest.raises(ConflictError):
            await store.apply(batch_for(session, "runner"), lease=lease)
        after = await store.apply(batch_for(await store.load("s"), "runner"), lease=lease)
        assert after.revision == 2


# -- the same answers as the reference (MemoryStore's lease table) ---------------------

OWNERS = ("a", "b", "c")
Op = tuple[Any, ...]
operations = st.lists(
    st.one_of(
        st.tuples(st.just("claim"), st.sampled_from(OWNERS)),
        st.tuples(st.just("claim_next"), st.sampled_from(OWNERS)),
        st.tuples(st.just("request_run")),
        st.tuples(st.just("renew"), st.integers(0, 5)),
        st.tuples(st.just("release"), st.integers(0, 5), st.booleans()),
        st.tuples(st.just("apply"), st.none() | st.integers(0, 5)),
        st.tuples(st.just("expire")),
    ),
    max_size=14,
)


def _answer(got: object) -> object:
    """What a call returned, comparable across stores (holders' expiry left out)."""
    if isinstance(got, Lease):
        return ("lease", got.session_id, got.owner, got.epoch)
    if isinstance(got, LeaseHolder):
        return ("busy", got.owner)
    if isinstance(got, Session):
        return ("applied", got.revision)
    return got


async def _reference(ops: list[Op]) -> list[object]:
    """The answers of MemoryLeases (``expire``: its clock jumps past every ttl)."""
    now = [0.0]
    leases = MemoryLeases(expire=True, clock=lambda: now[0])
    revision = 0
    held: list[Lease] = []
    answers: list[object] = []
    for op in ops:
        try:
            got: object = None
            if op[0] == "claim":
                got = leases.claim("s", op[1], 30.0)
            elif op[0] == "claim_next":
                got = leases.claim_next(["s"], op[1], 30.0)
            elif op[0] == "request_run":
                leases.request_run("s")
            elif op[0] == "expire":
                now[0] += 1000.0
            elif op[0] == "apply":
                if op[1] is not None and held:
                    leases.check(held[op[1] % len(held)])
                revision += 1
                got = ("applied", revision)
            elif held:
                lease = held[op[1] % len(held)]
                if op[0] == "renew":
                    got = leases.renew(lease)
                else:
                    got = leases.release(lease, unless_requested=op[2])
            if isinstance(got, Lease):
                held.append(got)
            answers.append(_answer(got))
        except LeaseLostError:
            answers.append("LeaseLostError")
    return answers


async def _postgres(dsn: str, ops: list[Op]) -> list[object]:
    """The answers of PostgresStore (``expire``: the lease's expiry is set in the past)."""
    import psycopg

    async with await PostgresStore.open(dsn, min_size=1, max_size=1) as store:
        await store.create("s")
        held: list[Lease] = []
        answers: list[object] = []
        try:
            for op in ops:
                try:
                    got: object = None
                    if op[0] == "claim":
                        got = await store.claim("s", op[1], 30.0)
                    elif op[0] == "claim_next":
                        got = await store.claim_next(op[1], 30.0)
                    elif op[0] == "request_run":
                        await store.request_run("s")
                    elif op[0] == "expire":
                        with psycopg.connect(dsn, autocommit=True) as conn:
                            conn.execute(
                                "UPDATE stepmachine.sessions "
                                "SET lease_expires_at = now() - interval '1 second' "
                                "WHERE lease_owner IS NOT NULL"
                            )
                    elif op[0] == "apply":
                        lease = held[op[1] % len(held)] if op[1] is not None and held else None
                        got = await store.apply(batch_for(await store.load("s"), "op"), lease=lease)
                    elif held:
                        lease = held[op[1] % len(held)]
                        if op[0] == "renew":
                            got = await store.renew(lease)
                        else:
                            got = await store.release(lease, unless_requested=op[2])
                    if isinstance(got, Lease):
                        held.append(got)
                    answers.append(_answer(got))
                except LeaseLostError:
                    answers.append("LeaseLostError")
        finally:
            await store.delete("s")
    return answers


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
def test_the_same_answers_as_the_reference(postgres_dsn: str, anyio_backend: str) -> None:
    """Any sequence of lease calls on one session answers as MemoryStore's lease table does."""

    @settings(max_examples=200, deadline=None, derandomize=True)
    @given(ops=operations)
    def same(ops: list[Op]) -> None:
        expected = anyio.run(_reference, ops, backend=anyio_backend)
        assert anyio.run(_postgres, postgres_dsn, ops, backend=anyio_backend) == expected

    same()


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


def counting_model() -> FunctionModel:
    """Answers every request with "ok"; ``model.calls`` counts the requests."""

    def answer(_request: Any) -> Any:
        return reply("ok")

    return FunctionModel(answer)


async def make_session(store: Any, session_id: str = "s") -> None:
    await store.create(session_id, conversation=[Message.user("hi", id=f"{session_id}-u1")])


def machine(**kwargs: Any) -> StateMachine[Any]:
    return StateMachine([ModelInference()], **kwargs)


# -- (2) PostgreSQL: a queue-run between the two statements of a holder's release ----------------


async def test_postgres_a_turn_queued_during_the_holders_release_is_run(
    postgres_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another runner queues a turn between the release's look at the mark and its unlock.

    The other runner runs in a thread with its own event loop and store (another
    process, in effect), started right after the release looked at the mark; the
    release then pauses before it goes on. Either the other runner's request is seen
    by the holder (which runs the turn), or it waits for the release and then claims
    the session itself: never "queued" with nobody to run the turn.
    """
    pytest.importorskip("psycopg", reason="psycopg is not installed (the postgres extra)")
    import threading
    import time

    from stepmachine.stores import PostgresStore
    from stepmachine.stores import _postgres_leases as leases

    store = await PostgresStore.open(postgres_dsn)
    outcome: list[str] = []

    async def queue_a_turn() -> None:
        async with await PostgresStore.open(postgres_dsn) as other:
            await submit(other, "s", [AppendMessage(Message.user("and more", id="u2"))])
            runner = StateMachine([ModelInference()], lease=LeasePolicy(busy="queue"))
            report = await runner.run_report(Runtime(store=other, model=counting_model()), "s")
            outcome.append(report.reason.kind)

    other = threading.Thread(target=lambda: anyio.run(queue_a_turn, backend="asyncio"))
    real_release = leases.release

    class Interleaving:
        def __init__(self, conn: Any) -> None:
            self.conn = conn

        def execute(self, query: Any, params: Any = None) -> Any:
            result = self.conn.execute(query, params)
            if query == leases._TAKE_REQUEST and not other.is_alive() and not outcome:
                other.start()
                time.sleep(0.5)  # the other runner commits now, unless the row is locked
            return result

    def release(conn: Any, lease: Lease, *, unless_requested: bool) -> bool:
        return real_release(Interleaving(conn), lease, unless_requested=unless_requested)

    monkeypatch.setattr(leases, "release", release)
    try:
        await make_session(store)
        await machine().run(Runtime(store=store, model=counting_model()), "s")
        await anyio.to_thread.run_sync(other.join, 60)
        assert len(outcome) == 1
        session = await store.load("s")
        assert session.conversation[-1].role == "assistant"  # "and more" was answered
    finally:
        await store.aclose()


# -- driving cycles by hand beside a lease holder, on every store ------------------------------


async def test_hand_driven_apply_and_finalize_hold_the_lease_on_every_store(store: Any) -> None:
    """While ``run()`` holds the session (its model call under way), a hand-driven
    ``apply()`` and ``finalize()`` raise ``SessionBusyError`` and write nothing; once the
    run let go, ``step()`` + ``apply()`` write under a lease of their own and let it go
    too (a following ``run()`` claims at once, ``busy="fail"``). On PostgreSQL (leases that
    expire) the hand-driven lease is the renewed kind."""
    from stepmachine import SessionBusyError

    await make_session(store)
    asked = anyio.Event()
    go_on = anyio.Event()

    async def slow(_request: Any) -> Any:
        asked.set()
        await go_on.wait()
        return reply("ok")

    holder = machine()
    busy_fail = LeasePolicy(busy="fail")
    by_hand = StateMachine([ModelInference()], lease=busy_fail)
    quick = Runtime(store=store, model=counting_model())
    async with anyio.create_task_group() as group:
        group.start_soon(holder.run, Runtime(store=store, model=FunctionModel(slow)), "s")
        with anyio.fail_after(30):
            await asked.wait()
        session = await store.load("s")
        decision = await by_hand.step(quick, session)
        assert decision is not None
        with pytest.raises(SessionBusyError):
            await by_hand.apply(quick, session, decision)
        with pytest.raises(SessionBusyError):
            await by_hand.finalize(quick, "s")
        assert (await store.load("s")).revision == session.revision, "nothing written"
        go_on.set()
    after_run = await store.load("s")
    assert after_run.conversation[-1].text == "ok"
    await submit(store, "s", [AppendMessage(Message.user("again", id="s-u2"))])
    session = await store.load("s")
    decision = await by_hand.step(quick, session)
    assert decision is not None
    written, result = await by_hand.apply(quick, session, decision)
    assert result.status == "yielded"
    assert written.conversation[-1].text == "ok"
    await submit(store, "s", [AppendMessage(Message.user("and again", id="s-u3"))])
    report = await StateMachine([ModelInference()], lease=busy_fail).run_report(quick, "s")
    assert report.reason.kind == "done", "the hand-driven lease was let go"
