"""The whole run in one driver (``Driver.run``), attacked from outside.

``run()``, ``run_report()`` and ``serve`` run ``_cycle.Driver.run``: it claims
the lease, holds it across rounds (``_hold.Turns``), and retries conflicts in
``Driver.cycle``; the durable worker loops on ``Driver.cycle``. These tests
hold it to what runs did before it: one runner per session (processes on one
SQLite file), a requested turn is never dropped (a cancel at every checkpoint
found by polling, Ctrl-C and a token in an owed round, a release that fails
once, ``max_rounds``, ``keep``), conflicts (retried per round, the cycle's
span marked, events following the reloaded revision, ``ConflictError`` past
``max_conflicts``), runs with a caller's lease, ``lease=None`` and a store
without leases, and the durable worker's reload after a conflict.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import pytest
from _observability import Spans
from opentelemetry.trace import StatusCode

from stepmachine import (
    AppendMessage,
    CancelToken,
    Codec,
    ConflictError,
    Continue,
    LeasePolicy,
    Message,
    ModelInference,
    Operation,
    RecordingEmitter,
    Refuse,
    Runtime,
    Staged,
    StateMachine,
    Task,
    Tools,
    UpdateData,
    Yield,
    submit,
    tool,
)
from stepmachine._cycle import Driver
from stepmachine._emitter import StepApplied, TextDelta, Yielded
from stepmachine._messages import ToolCallPart
from stepmachine._retry import MAX_STALLED_CONFLICTS
from stepmachine.extend import Lease, LeaseHolder, YieldReason, history_problems, new_owner
from stepmachine.stores import MemoryStore, SQLiteStore
from stepmachine.testing import FunctionModel, call, reply

HERE = Path(__file__).resolve().parent
Hook = Callable[[int], Awaitable[None]]


async def nothing(_n: int) -> None:
    await anyio.lowlevel.checkpoint()


class Turns(Operation[Any]):
    """Round ``n`` (from 0) appends ``t-n`` and yields ``turn``, after ``hook(n)``; it
    refuses once ``limit`` rounds ran. Each decision emits a ``TextDelta`` naming the
    revision it saw."""

    name = "turns"

    def __init__(self, hook: Hook = nothing, limit: int = 3) -> None:
        self.hook, self.limit, self.runs = hook, limit, 0

    async def run(self, ctx: Any) -> Any:
        n = sum(1 for m in ctx.session.conversation if m.id.startswith("t-"))
        if n >= self.limit:
            return Refuse()
        self.runs += 1
        await ctx.events.emit(TextDelta(str(ctx.session.revision)))
        await self.hook(n)
        return Yield([AppendMessage(Message.user("t", id=f"t-{n}"))], "turn")


class Notes(Operation[Any]):
    """Appends ``n-0`` (continue) then ``n-1`` (yield ``noted``); its first ``lose``
    decisions see another writer move the session on (a ``submit``), so their write
    conflicts. Each decision emits a ``TextDelta`` naming the revision it saw."""

    name = "notes"

    def __init__(self, store: Any, lose: int, before: Hook = nothing) -> None:
        self.store, self.lose, self.before, self.runs = store, lose, before, 0

    async def run(self, ctx: Any) -> Any:
        mine = sum(1 for m in ctx.session.conversation if m.id.startswith("n-"))
        if mine >= 2:
            return Refuse()
        self.runs += 1
        await ctx.events.emit(TextDelta(str(ctx.session.revision)))
        await self.before(self.runs)
        if self.runs <= self.lose:
            other = Message.user("other", id=f"x-{self.runs}")
            await submit(self.store, "s", [AppendMessage(other)])
        note = Message.user("n", id=f"n-{mine}")
        if mine == 1:
            return Yield([AppendMessage(note)], "noted")
        return Continue([AppendMessage(note)])


class Proxy:
    """Forwards to ``inner``; ``hooks[name]`` wraps one method (``hook(call, *a, **kw)``);
    ``calls`` names every async call (``release(u)``: ``unless_requested=True``)."""

    leases_expire: bool = False  # declared on the class: a wrapper that takes leases

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.leases_expire = inner.leases_expire
        self.hooks: dict[str, Callable[..., Awaitable[Any]]] = {}
        self.calls: list[str] = []

    async def apply(self, batch: Any, *, lease: Lease | None = None) -> Any:
        return await self.__getattr__("apply")(batch, lease=lease)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if not callable(value) or name.startswith("_") or name == "session_loader":
            return value

        async def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name + ("(u)" if kwargs.get("unless_requested") else ""))
            hook = self.hooks.get(name)
            if hook is not None:
                return await hook(value, *args, **kwargs)
            return await value(*args, **kwargs)

        return call


async def open_store(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    """A store of ``kind`` with session ``s`` (one user message)."""
    if kind == "sqlite":
        made: Any = await SQLiteStore.open(tmp_path / "db.sqlite3")
    elif kind == "postgres":
        pytest.importorskip("psycopg", reason="psycopg is not installed (the postgres extra)")
        from stepmachine.stores import PostgresStore

        made = await PostgresStore.open(request.getfixturevalue("postgres_dsn"))
    else:
        made = MemoryStore(expiring_leases=kind == "memory-expiring")
    await made.create("s", conversation=[Message.user("hi", id="u1")])
    return made


@pytest.fixture(params=["memory", "memory-expiring", "sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    made = await open_store(request.param, tmp_path, request)
    try:
        yield made
    finally:
        await made.aclose()


@pytest.fixture(params=["memory", "memory-expiring"])
async def local_store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """An in-memory store (the polled-cancel tests need a run whose checkpoints are its
    own: one waiting on a database server or a worker thread lets the poller spin on)."""
    made = await open_store(request.param, tmp_path, request)
    try:
        yield made
    finally:
        await made.aclose()


async def pending(store: Any) -> bool:
    """Whether ``claim_next`` gives the session out now (a requested turn is waiting)."""
    lease = await store.claim_next(new_owner("probe:"), 30.0)
    if lease is None:
        return False
    await store.release(lease)
    return True


async def free(store: Any) -> bool:
    """Whether nobody holds the session's lease (a claim gets it; let go at once).

    The claim takes the session's pending-run mark: ask :func:`pending` first."""
    got = await store.claim("s", new_owner("probe:"), 30.0)
    if isinstance(got, Lease):
        await store.release(got)
        return True
    return False


async def cancel_after(scope: anyio.CancelScope, polls: int) -> None:
    """Cancel ``scope`` after ``polls`` checkpoints (a cancellation at a polled point)."""
    for _ in range(polls):
        await anyio.lowlevel.checkpoint()
    scope.cancel()


def ids(session: Any, prefix: str) -> list[str]:
    return [m.id for m in session.conversation if m.id.startswith(prefix)]


# -- conflicts: retried per round, spans, events, ConflictError ---------------------------


@pytest.mark.parametrize("lose", [1, 2])
async def test_a_retried_conflict_leaves_its_cycle_span_in_error(store: Any, lose: int) -> None:
    spans = Spans()
    notes = Notes(store, lose)
    machine = StateMachine([notes], max_conflicts=2)
    runtime = Runtime(store=store, telemetry=spans.telemetry(capture_content=True))
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == "noted"
    cycles = [s for s in spans.finished if s.name.startswith("cycle")]
    cycles.sort(key=lambda s: int(str((s.attributes or {})["stepmachine.cycle"])))
    assert len(cycles) == lose + 2
    for span in cycles[:lose]:  # each lost the race and was retried
        attributes = span.attributes or {}
        assert attributes["stepmachine.outcome"] == "conflict"
        assert attributes["error.type"] == "ConflictError"
        assert span.status.status_code == StatusCode.ERROR
        assert [event.name for event in span.events] == ["exception"]
    for span in cycles[lose:]:
        assert span.status.status_code == StatusCode.UNSET
        assert "error.type" not in (span.attributes or {})
    (run,) = [s for s in spans.finished if s.name.startswith("invoke_agent")]
    assert run.status.status_code == StatusCode.UNSET
    assert (run.attributes or {})["stepmachine.cycles"] == lose + 2


async def test_conflicts_past_max_conflicts_raise_and_hand_the_turn_on(store: Any) -> None:
    async def queue_a_turn(runs: int) -> None:
        if runs == 1:
            await store.request_run("s")  # a busy="queue" run() arrives meanwhile

    notes = Notes(store, lose=3, before=queue_a_turn)
    machine = StateMachine([notes], max_conflicts=2)
    with pytest.raises(ConflictError):
        await machine.run(Runtime(store=store), "s")
    assert notes.runs == 3  # the first decision and two retries
    session = await store.load("s")
    assert ids(session, "n-") == []  # nothing of the machine's was written
    assert ids(session, "x-") == ["x-1", "x-2", "x-3"]
    assert await pending(store)  # the queued turn waits for the next claimer
    assert await free(store)


async def test_conflicts_are_counted_per_round(store: Any) -> None:
    """Two conflicts in each of two rounds, with ``max_conflicts=2``: both rounds run."""
    lost: list[int] = []

    async def hook(n: int) -> None:
        if n == 0:
            await store.request_run("s")  # the run owes a second round
        if sum(1 for r in lost if r == n) < 2:
            lost.append(n)
            await submit(store, "s", [AppendMessage(Message.user("o", id=f"o-{len(lost)}"))])

    turns = Turns(hook, limit=2)
    report = await StateMachine([turns], max_conflicts=2).run_report(Runtime(store=store), "s")
    assert lost == [0, 0, 1, 1]
    assert turns.runs == 6
    assert [r.status for r in report.results] == ["yielded", "yielded"]
    assert ids(await store.load("s"), "t-") == ["t-0", "t-1"]
    assert not await pending(store)
    assert await free(store)


@pytest.mark.parametrize("lose", [0, 1, 2])
async def test_events_after_a_conflict_follow_the_reloaded_revision(store: Any, lose: int) -> None:
    emitter = RecordingEmitter()
    machine = StateMachine([Notes(store, lose)], max_conflicts=2)
    report = await machine.run_report(Runtime(store=store), "s", emitter)
    events = emitter.events
    deltas = [e for e in events if isinstance(e.data, TextDelta)]
    assert len(deltas) == lose + 2
    for event in deltas:  # stamped with the revision the deciding step saw, first after it
        assert isinstance(event.data, TextDelta)
        assert (event.revision, event.seq) == (int(event.data.text), 0)
    applied = [e for e in events if isinstance(e.data, StepApplied)]
    assert len(applied) == 2
    for event in applied:
        assert isinstance(event.data, StepApplied)
        assert event.data.new_revision == event.revision + 1
        assert event.seq == 1
    last = events[-1]
    assert isinstance(last.data, Yielded)
    assert (last.revision, last.seq) == (report.session.revision, 0)
    assert report.session.revision == (await store.load("s")).revision == lose + 2


@pytest.mark.parametrize("lost", [0, 1, 3, 4])
async def test_a_finalize_that_loses_the_race_at_a_cycles_start_is_retried(lost: int) -> None:
    """The token fired before the cycle: its finalize (answering an open call) loses the
    race ``lost`` times. Finalize tries ``max_conflicts + 1`` times, and the driver
    reloads and finalizes again up to ``max_conflicts`` times, as for any conflict."""
    store = MemoryStore()
    call = ToolCallPart.parse("c1", "lookup", "{}")
    await store.create(
        "s", conversation=[Message.user("hi", id="u1"), Message.assistant(call, id="a1")]
    )
    attempts: list[int] = []

    class Racing:
        async def load(self, session_id: str) -> Any:
            return await store.load(session_id)

        async def apply(self, batch: Any) -> Any:
            attempts.append(batch.revision)
            if len(attempts) <= lost:
                raise ConflictError(batch.session_id, batch.revision - 1, batch.revision)
            return await store.apply(batch)

    token = CancelToken()
    token.cancel("stopped before it started")
    max_conflicts = 1
    machine = StateMachine([Notes(store, 0)], cancel=token, max_conflicts=max_conflicts)
    racing = Racing()
    runtime = Runtime(loader=racing, handler=racing)
    budget = (max_conflicts + 1) ** 2
    if lost >= budget:
        with pytest.raises(ConflictError):
            await machine.run(runtime, "s")
        assert len(attempts) == budget
        assert (await store.load("s")).revision == 0
        return
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == YieldReason.CANCELLED
    assert len(attempts) == lost + 1
    assert report.session.revision == (await store.load("s")).revision == 1  # call answered


# -- rounds: a requested turn runs in the holder's run, or stays requested ------------------


async def test_a_turn_requested_while_a_run_holds_the_lease_runs_in_the_same_run(
    store: Any,
) -> None:
    spans = Spans()
    started, go = anyio.Event(), anyio.Event()

    async def hook(n: int) -> None:
        if n == 0:
            started.set()
            await go.wait()

    machine = StateMachine([Turns(hook, limit=2)])
    runtime = Runtime(store=store, telemetry=spans.telemetry())
    reports: list[Any] = []
    async with anyio.create_task_group() as tg:

        async def first() -> None:
            reports.append(await machine.run_report(runtime, "s"))

        tg.start_soon(first)
        await started.wait()
        queued = await machine.run_report(runtime, "s", lease=LeasePolicy(busy="queue"))
        assert queued.reason.kind == YieldReason.QUEUED
        go.set()
    (report,) = reports
    assert [(r.step, r.status, r.revision) for r in report.results] == [
        ("turns", "yielded", 1),
        ("turns", "yielded", 2),
    ]
    assert report.reason.kind == "turn"
    runs = sorted(
        (s for s in spans.finished if s.name.startswith("invoke_agent")),
        key=lambda s: s.start_time or 0,
    )
    assert len(runs) == 2  # one span per round
    starts = [(s.attributes or {})["stepmachine.revision.start"] for s in runs]
    ends = [(s.attributes or {})["stepmachine.revision.end"] for s in runs]
    assert (starts, ends) == ([0, 1], [1, 2])
    (wrote,) = [s for s in spans.named("cycle") if spans.parent(s) is runs[0]]
    # The second round's span links to the span that wrote the first round's batch.
    assert [link.context.span_id for link in runs[1].links] == [wrote.context.span_id]
    assert not await pending(store)
    assert await free(store)


async def test_a_cancel_at_every_checkpoint_never_drops_the_requested_turn(
    local_store: Any,
) -> None:
    """A canceller polls ``k`` checkpoints, then cancels the run, for every ``k`` until the
    run finishes first. A turn is requested in round 0 and round 1 (three rounds)."""
    finished = False
    k = 0
    while not finished:
        assert k < 2000, "the run never finished before the canceller"
        session_id = f"k{k}"
        await local_store.create(session_id, conversation=[Message.user("hi", id="u1")])

        requested: list[int] = []  # rounds in which a turn was requested (from 0)

        async def hook(
            n: int, session_id: str = session_id, requested: list[int] = requested
        ) -> None:
            if n < 2:
                await local_store.request_run(session_id)
                requested.append(n)

        scope = anyio.CancelScope()
        done: list[Any] = []

        async def run(
            session_id: str = session_id, scope: anyio.CancelScope = scope, done: list[Any] = done
        ) -> None:
            with scope:
                machine = StateMachine([Turns(hook, limit=3)])
                done.append(await machine.run_report(Runtime(store=local_store), session_id))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            tg.start_soon(cancel_after, scope, k)
        session = await local_store.load(session_id)
        rounds = len(ids(session, "t-"))
        assert ids(session, "t-") == [f"t-{n}" for n in range(rounds)]  # no round twice
        waiting = await local_store.claim_next(
            new_owner("probe:"), 30.0
        )  # (claiming takes the mark)
        marked = waiting is not None
        if waiting is not None:
            assert waiting.session_id == session_id  # earlier sessions' marks were taken
            await local_store.release(waiting)
        got = await local_store.claim(session_id, new_owner("probe:"), 30.0)
        assert isinstance(got, Lease), (k, got)  # the run let go
        await local_store.release(got)
        if done:
            finished = True
            assert rounds == 3
            assert not marked
        elif requested and rounds <= requested[-1] + 1:  # a requested turn did not run ...
            assert marked, (k, rounds, requested)  # ... so it is still requested
        k += 1


async def test_ctrl_c_in_an_owed_round_requests_the_turn_again(store: Any) -> None:
    async def hook(n: int) -> None:
        if n == 0:
            await store.request_run("s")
        else:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        await StateMachine([Turns(hook)]).run(Runtime(store=store), "s")
    assert ids(await store.load("s"), "t-") == ["t-0"]
    assert await pending(store)
    assert await free(store)


async def test_a_token_in_an_owed_round_reports_every_round_and_requests_the_turn_again(
    store: Any,
) -> None:
    token = CancelToken()

    async def hook(n: int) -> None:
        if n == 0:
            await store.request_run("s")
        else:
            token.cancel("enough")
            await anyio.lowlevel.checkpoint()

    report = await StateMachine([Turns(hook)], cancel=token).run_report(Runtime(store=store), "s")
    assert report.reason.kind == YieldReason.CANCELLED
    assert [(r.step, r.status) for r in report.results] == [
        ("turns", "yielded"),
        ("turns", "cancelled"),
    ]
    assert await pending(store)
    assert await free(store)


@pytest.mark.parametrize("where", ["between-rounds", "last"])
async def test_a_release_that_fails_once_is_tried_again(store: Any, where: str) -> None:
    """The first ``release`` call at ``where`` raises a transient error before reaching
    the store: the run goes on as if it had not, and lets go in the end."""
    proxy = Proxy(store)
    failed: list[bool] = []

    async def release(call: Any, lease: Lease, *, unless_requested: bool = False) -> Any:
        first_of_its_kind = (where == "between-rounds") == unless_requested
        if not failed and first_of_its_kind and len(ids(await store.load("s"), "t-")) == 1:
            failed.append(True)
            raise ConnectionResetError("the store went away for a moment")
        return await call(lease, unless_requested=unless_requested)

    proxy.hooks["release"] = release

    async def hook(n: int) -> None:
        if n == 0:
            await store.request_run("s")
        if n == 1 and where == "last":
            raise RuntimeError("the second round fails")

    machine = StateMachine([Turns(hook, limit=2)])
    if where == "last":
        with pytest.raises(RuntimeError, match="second round"):
            await machine.run(Runtime(store=proxy), "s")
    else:
        report = await machine.run_report(Runtime(store=proxy), "s")
        assert [r.status for r in report.results] == ["yielded", "yielded"]
    assert failed == [True]
    assert await pending(store) == (where == "last")  # the failed owed turn stays requested
    assert await free(store)


async def test_a_release_whose_reply_is_lost_after_it_took_the_mark_keeps_the_turn(
    store: Any,
) -> None:
    proxy = Proxy(store)
    took: list[bool] = []

    async def release(call: Any, lease: Lease, *, unless_requested: bool = False) -> Any:
        released = await call(lease, unless_requested=unless_requested)
        if unless_requested and not took:
            took.append(not released)
            raise ConnectionResetError("the reply was lost")
        return released

    proxy.hooks["release"] = release

    async def hook(n: int) -> None:
        if n == 0:
            await store.request_run("s")  # a busy="queue" caller was told the holder runs it

    report = await StateMachine([Turns(hook, limit=2)]).run_report(Runtime(store=proxy), "s")
    assert took == [True]  # the first release took the mark
    assert len(report.results) == 2  # the retry set the mark again, took it: the turn ran
    assert not await pending(store)
    assert await free(store)


async def test_a_release_whose_reply_is_lost_after_it_let_go_ends_the_run_free(
    store: Any,
) -> None:
    """The other side of the retry above: the lost attempt had let go (no turn was
    requested). The retry sets the mark and finds the lease gone; the run returns, the
    session is free, and the mark left behind costs the next claimer one idle round."""
    proxy = Proxy(store)
    lost: list[bool] = []

    async def release(call: Any, lease: Lease, *, unless_requested: bool = False) -> Any:
        released = await call(lease, unless_requested=unless_requested)
        if unless_requested and not lost:
            lost.append(bool(released))
            raise ConnectionResetError("the reply was lost")
        return released

    proxy.hooks["release"] = release

    async def hook(n: int) -> None:
        return None

    report = await StateMachine([Turns(hook, limit=1)]).run_report(Runtime(store=proxy), "s")
    assert lost == [True]  # the first release let go
    assert len(report.results) == 1
    assert await free(store)
    again = await StateMachine([Turns(hook, limit=1)]).run_report(Runtime(store=store), "s")
    assert again.reason.kind == "idle"  # the extra round finds nothing to do
    assert not await pending(store)


@pytest.mark.parametrize("max_rounds", [1, 2, None])
async def test_max_rounds_hands_a_turn_back_once_reached(
    store: Any, max_rounds: int | None
) -> None:
    async def hook(n: int) -> None:
        await store.request_run("s")  # a turn requested in every round

    machine = StateMachine([Turns(hook, limit=3)])
    report = await Driver(machine, Runtime(store=store)).run("s", max_rounds=max_rounds)
    rounds = 3 if max_rounds is None else max_rounds
    assert len(report.results) == rounds
    assert ids(await store.load("s"), "t-") == [f"t-{n}" for n in range(rounds)]
    # Handed back with the mark set again; without a bound, the run ran every requested
    # turn (the last one idle: nothing left to do) and let go with nothing requested.
    assert report.reason.kind == ("turn" if max_rounds is not None else "idle")
    assert await pending(store) == (max_rounds is not None)
    assert await free(store)


@pytest.mark.parametrize("kept", [True, False])
async def test_keep_holds_the_lease_with_the_turn_requested_again(store: Any, kept: bool) -> None:
    async def hook(n: int) -> None:
        if n == 0:
            await store.request_run("s")
        else:
            raise OSError("a transient failure the caller retries")

    machine = StateMachine([Turns(hook)])
    with pytest.raises(OSError, match="transient"):
        await Driver(machine, Runtime(store=store)).run("s", keep=lambda exc: kept)
    if not kept:
        assert await pending(store)  # let go, with the mark set again
        return
    got = await store.claim("s", new_owner("probe:"), 30.0)
    assert isinstance(got, LeaseHolder)  # still the failed run's
    assert got.epoch is not None
    held = Lease("s", got.owner, got.epoch, 30.0)
    assert not await store.release(held, unless_requested=True)  # ... and the mark set again


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_staged_tools_cancelled_at_every_checkpoint_lose_and_repeat_nothing(
    local_store: Any, concurrency: int
) -> None:
    """Three tool calls, the run cancelled after ``k`` polled checkpoints for every ``k``
    until it finishes first: every call is answered once (its result if the tool
    finished, else ``interrupted``), and the run lets go of the lease."""
    finished = False
    k = 0
    while not finished:
        assert k < 3000, "the run never finished before the canceller"
        session_id = f"k{k}"
        await local_store.create(session_id, conversation=[Message.user("go", id="u1")])
        ran: list[int] = []

        async def work(x: int, ran: list[int] = ran) -> str:
            """Work on ``x``."""
            await anyio.lowlevel.checkpoint()
            ran.append(x)
            return f"r{x}"

        def answer(request: Any) -> Any:
            if request.messages[-1].role == "user":
                return call(("work", {"x": 1}), ("work", {"x": 2}), ("work", {"x": 3}))
            return reply("done")

        tools = Tools([tool(work)], max_concurrency=concurrency)
        machine = StateMachine([tools, ModelInference()])
        runtime = Runtime(store=local_store, model=FunctionModel(answer))
        scope = anyio.CancelScope()
        done: list[Any] = []

        async def run(
            session_id: str = session_id,
            scope: anyio.CancelScope = scope,
            done: list[Any] = done,
            machine: StateMachine[Any] = machine,
            runtime: Runtime = runtime,
        ) -> None:
            with scope:
                done.append(await machine.run_report(runtime, session_id))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            tg.start_soon(cancel_after, scope, k)
        if k == 0:
            assert not done  # the canceller got in first
        session = await local_store.load(session_id)
        assert history_problems(session.conversation) == [], k
        results = [
            part.content
            for message in session.conversation
            for part in message.parts
            if type(part).__name__ == "ToolResultPart"
        ]
        calls = sum(len(m.tool_calls) for m in session.conversation)
        assert len(results) == calls, (k, results)  # every call answered, once
        for x in ran:  # a tool that finished has its result stored
            assert f"r{x}" in results, (k, ran, results)
        got = await local_store.claim(session_id, new_owner("probe:"), 30.0)
        assert isinstance(got, Lease), (k, got)
        await local_store.release(got)
        if done:
            finished = True
            assert sorted(results) == ["r1", "r2", "r3"]
            assert done[0].reason.kind == "done"
        k += 1


# -- leases given, none, and a store without them -------------------------------------------


async def test_a_callers_lease_is_held_across_rounds_and_released(store: Any) -> None:
    lease = await store.claim("s", new_owner(), 30.0)
    assert isinstance(lease, Lease)
    proxy = Proxy(store)

    async def hook(n: int) -> None:
        if n == 0:
            await store.request_run("s")

    report = await StateMachine([Turns(hook)]).run_report(Runtime(store=proxy), "s", lease=lease)
    assert [r.status for r in report.results] == ["yielded", "yielded"]
    assert "claim" not in proxy.calls
    assert proxy.calls.count("release(u)") == 2
    assert await free(store)
    assert not await pending(store)


async def test_lease_none_claims_nothing_and_leaves_a_requested_turn(store: Any) -> None:
    proxy = Proxy(store)

    async def hook(n: int) -> None:
        await store.request_run("s")

    report = await StateMachine([Turns(hook)]).run_report(Runtime(store=proxy), "s", lease=None)
    assert len(report.results) == 1
    assert not any(c.startswith(("claim", "release", "renew")) for c in proxy.calls)
    assert await pending(store)


async def test_a_store_without_leases_runs_one_round(store: Any) -> None:
    class Plain:
        async def load(self, session_id: str) -> Any:
            return await store.load(session_id)

        async def apply(self, batch: Any) -> Any:
            return await store.apply(batch)

    async def hook(n: int) -> None:
        await store.request_run("s")

    plain = Plain()
    machine = StateMachine([Turns(hook)], lease=LeasePolicy(busy="fail"))
    report = await machine.run_report(Runtime(loader=plain, handler=plain), "s")
    assert [r.status for r in report.results] == ["yielded"]
    assert await pending(store)


# -- the durable worker: a conflict's reload is like the cycle's first load ------------------


@pytest.fixture
def fresh_dbos() -> Iterator[None]:
    dbos = pytest.importorskip("dbos")
    dbos.DBOS.destroy(destroy_registry=True)
    yield
    dbos.DBOS.destroy(destroy_registry=True)


@pytest.mark.parametrize("lose", [0, 1, 2, 3])
async def test_the_durable_cycle_retries_conflicts_and_a_cancel_at_the_reload_writes_nothing(
    fresh_dbos: None, lose: int
) -> None:
    from stepmachine.durable import DurableMachine

    store = MemoryStore()
    call = ToolCallPart.parse("c1", "lookup", "{}")  # an open call: a finalize would answer it
    await store.create(
        "s", conversation=[Message.user("hi", id="u1"), Message.assistant(call, id="a1")]
    )
    scope = anyio.CancelScope()
    loads: list[int] = []

    class Loader:
        async def load(self, session_id: str) -> Any:
            loads.append(1)
            if len(loads) == 2:  # the reload after the first conflict
                scope.cancel()
                await anyio.lowlevel.checkpoint()
            return await store.load(session_id)

        async def apply(self, batch: Any) -> Any:
            return await store.apply(batch)

    class Note(Operation[Any]):
        name = "note"
        runs = 0

        async def run(self, ctx: Any) -> Any:
            self.runs += 1
            if self.runs <= lose:
                await submit(store, "s", [AppendMessage(Message.user("o", id=f"o-{self.runs}"))])
            return Continue([AppendMessage(Message.user("n", id=f"n-{self.runs}"))])

    machine = StateMachine([Note()], max_conflicts=2, lease=None)
    durable = DurableMachine(machine, Runtime(store=store))
    loader = Loader()
    summary: dict[str, Any] = {}
    with scope:
        summary = await durable._cycle_in(Runtime(loader=loader, handler=loader), "s", 3, 0)
    session = await store.load("s")
    if lose == 0:
        assert summary["conflicts"] == 0
        assert summary["status"] == "continue"
        assert summary["cycle"] == 3
        assert ids(session, "n-") == ["n-1"]
    else:  # cancelled at the reload: propagated as at the first load, nothing written
        assert scope.cancelled_caught
        assert summary == {}
        assert session.revision == 1
        assert ids(session, "o-") == ["o-1"]
        assert ids(session, "n-") == []
        assert len(session.conversation) == 3  # the open call was not answered


@pytest.mark.parametrize("lose", [1, 2, 3])
async def test_the_durable_cycle_counts_its_conflicts(fresh_dbos: None, lose: int) -> None:
    from stepmachine.durable import DurableMachine

    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    notes = Notes(store, lose)
    machine = StateMachine([notes], max_conflicts=2, lease=None)
    durable = DurableMachine(machine, Runtime(store=store))
    if lose > 2:
        with pytest.raises(ConflictError):
            await durable._cycle_in(Runtime(store=store), "s", 5, 0)
        assert notes.runs == 3
        return
    summary = await durable._cycle_in(Runtime(store=store), "s", 5, 0)
    assert (summary["conflicts"], summary["cycle"], summary["status"]) == (lose, 5, "continue")
    assert summary["revision"] == lose + 1
    assert notes.runs == lose + 1


# -- processes: one runner per session, no requested turn dropped -----------------------------


async def test_processes_queueing_on_one_session_run_one_at_a_time_and_drop_no_turn(
    tmp_path: Path, anyio_backend_name: str
) -> None:
    db, log = tmp_path / "db.sqlite3", tmp_path / "steps.log"
    store = await SQLiteStore.open(db)
    await store.create("s", conversation=[Message.user("hi", id="u0")])
    await store.aclose()
    child = str(HERE / "_driver_attack_child.py")
    names = [f"p{n}" for n in range(4)]
    outputs: dict[str, dict[str, str]] = {}

    async def one(name: str) -> None:
        command = [sys.executable, child, str(db), str(log), name, anyio_backend_name]
        done = await anyio.run_process(command, check=True)
        outputs[name] = json.loads(done.stdout.decode().strip().splitlines()[-1])

    async with anyio.create_task_group() as tg:
        for name in names:
            tg.start_soon(one, name)
    store = await SQLiteStore.open(db)
    try:
        session = await store.load("s")
        assert not await pending(store)  # no turn left requested
        assert await free(store)
    finally:
        await store.aclose()
    assert sorted(ids(session, "a-")) == sorted(f"a-{name}" for name in names)  # all answered
    assert len(ids(session, "a-")) == len(set(ids(session, "a-")))
    inside: str | None = None
    for line in log.read_text().splitlines():  # never two runners inside the step
        kind, name, _pid = line.split()
        if kind == "start":
            assert inside is None, (inside, line)
            inside = name
        else:
            assert inside == name, (inside, line)
            inside = None
    assert {o["reason"] for o in outputs.values()} <= {"idle", YieldReason.QUEUED}


# -- a task's record that keeps losing the race ---------------------------------------


class _Order(msgspec.Struct):
    charge_key: str = ""
    receipt: str = ""


class _Charge(Operation[Any]):
    """Staged work as ``examples/charge_card.py`` does it: the intent, the charge, the receipt."""

    name = "charge"

    def __init__(self) -> None:
        self.charges = 0

    async def run(self, ctx: Any) -> Any:
        order = ctx.session.data
        if order.receipt:
            return Refuse("charged")
        if order.charge_key:
            return Yield([], "outcome_unknown")

        async def charge() -> Any:
            self.charges += 1
            receipt = f"receipt-{self.charges}"

            def record(session: Any) -> Any:
                return () if session.data.receipt else [UpdateData.set(receipt=receipt)]

            return record

        intent = [UpdateData.set(charge_key=ctx.new_id())]
        task = Task("charge", charge, guarded=True)
        return Staged(intent, [task], then=lambda: Yield([], "done"))


ReceiptHook = Callable[[Callable[..., Awaitable[Any]], Any], Awaitable[None]]


async def _order_store() -> MemoryStore:
    """A store holding one order session, ``"s"``."""
    inner = MemoryStore(Codec(_Order))
    await inner.create("s", data=_Order())
    return inner


def _receipt_proxy(inner: MemoryStore, on_receipt: ReceiptHook) -> Proxy:
    """A proxy of ``inner`` whose ``apply`` awaits ``on_receipt(call, batch)`` before each
    write of the charge's receipt (then writes it as asked)."""
    proxy = Proxy(inner)

    async def apply(call: Any, batch: Any, *, lease: Lease | None = None) -> Any:
        receipt = any(isinstance(e, UpdateData) and "receipt" in str(e) for e in batch.effects)
        if batch.step == "charge" and receipt:
            await on_receipt(call, batch)
        return await call(batch, lease=lease)

    proxy.hooks["apply"] = apply
    return proxy


def _another_writer(inner: MemoryStore, moved: list[int], times: int) -> ReceiptHook:
    """A hook that moves the session on first (a real conflict), ``times`` times."""

    async def move(call: Any, batch: Any) -> None:
        if moved[0] < times:
            moved[0] += 1
            await submit(inner, "s", [AppendMessage(Message.user("x", id=f"x-{moved[0]}"))])

    return move


async def test_a_record_that_keeps_losing_the_race_is_still_written() -> None:
    moved = [0]
    inner = await _order_store()
    proxy = _receipt_proxy(inner, _another_writer(inner, moved, 17))
    step = _Charge()
    report = await StateMachine([step], max_conflicts=3).run_report(Runtime(store=proxy), "s")
    assert step.charges == 1  # charged once (the intent keeps it from charging again)
    assert moved[0] == 17
    assert (await inner.load("s")).data.receipt == "receipt-1", report.reason


async def test_a_held_record_finalize_writes_is_not_dropped_for_losing_the_race() -> None:
    """Cancelled while the receipt is written: finalize writes the receipt it held, and
    losing that race more often than ``max_conflicts`` does not drop it."""
    token = CancelToken()
    moved = [0]
    inner = await _order_store()
    move = _another_writer(inner, moved, 20)

    async def cancel_then_move(call: Any, batch: Any) -> None:
        if not token.cancelled:
            token.cancel("stopped while the receipt was written")
            await anyio.lowlevel.checkpoint()  # the run's cancellation lands here
        await move(call, batch)

    proxy = _receipt_proxy(inner, cancel_then_move)
    step = _Charge()
    machine = StateMachine([step], cancel=token, max_conflicts=2)
    report = await machine.run_report(Runtime(store=proxy), "s")
    assert report.reason.kind == YieldReason.CANCELLED
    assert step.charges == 1
    assert moved[0] == 20
    assert (await inner.load("s")).data.receipt == "receipt-1"


async def test_a_store_that_refuses_a_record_without_moving_on_is_not_retried_forever() -> None:
    """A conflict the stored session does not explain (no other batch since) is bounded:
    a broken store raises ConflictError instead of a livelock."""
    refusals = [0]

    async def refuse(call: Any, batch: Any) -> None:
        refusals[0] += 1
        raise ConflictError("s", batch.revision - 1, batch.revision - 1)

    inner = await _order_store()
    proxy = _receipt_proxy(inner, refuse)
    step = _Charge()
    with pytest.raises(ConflictError):
        await StateMachine([step], max_conflicts=0).run(Runtime(store=proxy), "s")
    assert step.charges == 1
    assert refusals[0] == MAX_STALLED_CONFLICTS + 1
    assert (await inner.load("s")).data.receipt == ""  # nothing half-written
