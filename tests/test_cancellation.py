"""Cancellation never replaces a result that exists with "interrupted".

A tool that ran to completion has a real result; whatever instant a
cancellation lands at (while the tool runs, while its "tool finished" event is
emitted, while its result is committed), the stored result must be that real
result, recorded exactly once. The model would otherwise be told that a
payment did not happen.

Every test runs on asyncio and trio. The assertions never depend on timing:
they say "if the tool ran to completion, its stored result is its real output".
Where the cancellation must land at one precise instant, the tool and the
canceller coordinate through events.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stepmachine import (
    CancelToken,
    Emitter,
    Event,
    Message,
    ModelInference,
    RecordingEmitter,
    Runtime,
    Session,
    StateMachine,
    Store,
    StreamEmitter,
    Tool,
    ToolFinished,
    Tools,
    tool,
)
from stepmachine.extend import (
    INTERRUPTED,
    Batch,
    NullEmitter,
    YieldReason,
    counter_ids,
    history_problems,
    open_tool_calls,
)
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore
from stepmachine.testing import FunctionModel, ScriptedModel, call, reply

How = Literal["token", "outside"]
EmitterKind = Literal["null", "recording", "stream"]
ToolKind = Literal["sync", "async"]
StoreKind = Literal["memory", "sqlite", "file"]


@dataclass
class Gate:
    """Lets a test hold a tool at its last instant and cancel the run right then.

    ``started`` is set when the first call enters the tool. While ``hold`` is
    true, the tool then waits for ``release`` before it records its charge and
    returns: the canceller cancels, then releases, so the tool finishes with a
    cancellation already pending.
    """

    hold: bool
    started: anyio.Event = field(default_factory=anyio.Event)
    release_sync: threading.Event = field(default_factory=threading.Event)
    release_async: anyio.Event = field(default_factory=anyio.Event)
    charged: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def release(self) -> None:
        self.release_sync.set()
        self.release_async.set()

    def record(self, amount: int) -> None:
        with self.lock:
            self.charged.append(amount)


def charging_tool(kind: ToolKind, gate: Gate) -> Tool:
    """A ``charge_card`` tool that records every charge it completes."""
    if kind == "sync":

        def charge_card(amount: int) -> str:
            """Charge the card (in a worker thread)."""
            anyio.from_thread.run_sync(gate.started.set)
            if gate.hold:
                gate.release_sync.wait()
            gate.record(amount)
            return f"charged {amount}"

        return tool(charge_card)

    async def charge_card_async(amount: int) -> str:
        """Charge the card."""
        gate.started.set()
        if gate.hold:
            await gate.release_async.wait()
        gate.record(amount)  # from here to the return there is no checkpoint
        return f"charged {amount}"

    return tool(name="charge_card")(charge_card_async)


def make_emitter(kind: EmitterKind) -> Emitter:
    if kind == "null":
        return NullEmitter()
    if kind == "recording":
        return RecordingEmitter()
    return StreamEmitter(16)


@asynccontextmanager
async def open_store(kind: StoreKind) -> AsyncIterator[Store]:
    with tempfile.TemporaryDirectory() as folder:
        store: Store
        if kind == "memory":
            store = MemoryStore()
        elif kind == "sqlite":
            store = await SQLiteStore.open(Path(folder) / "db.sqlite3")
        else:
            store = await FileStore.open(Path(folder) / "sessions")
        try:
            yield store
        finally:
            await store.aclose()


@dataclass(frozen=True)
class Case:
    how: How
    emitter: EmitterKind
    tool_kind: ToolKind
    store: StoreKind = "memory"
    amounts: tuple[int, ...] = (100,)
    max_concurrency: int = 8
    cancel_after_ticks: int | None = None
    """None: cancel the moment the first call is about to return (the tool is held)."""


async def run_cancelled(case: Case, store: Store) -> tuple[Gate, bool]:
    """Run one turn of tool calls and cancel it as ``case`` says.

    Returns the gate (what the tool completed) and whether the run was cut by
    the cancellation rather than finishing.
    """
    await store.create("s", conversation=[Message.user("pay", id="u1")])
    gate = Gate(hold=case.cancel_after_ticks is None)
    token = CancelToken()
    machine = StateMachine(
        [
            Tools([charging_tool(case.tool_kind, gate)], max_concurrency=case.max_concurrency),
            ModelInference(),
        ],
        cancel=token if case.how == "token" else None,
    )
    script = [call(*[("charge_card", {"amount": a}) for a in case.amounts]), reply("paid")]
    runtime = Runtime(store=store, model=ScriptedModel(script), ids=counter_ids())
    emitter = make_emitter(case.emitter)
    finished = False
    try:
        async with anyio.create_task_group() as outer:
            if isinstance(emitter, StreamEmitter):
                outer.start_soon(drain, emitter)
            async with anyio.create_task_group() as run_group:

                def cancel() -> None:
                    if case.how == "token":
                        token.cancel("stop")
                    else:
                        run_group.cancel_scope.cancel()

                async def canceller() -> None:
                    if case.cancel_after_ticks is None:
                        await gate.started.wait()
                        if case.tool_kind == "sync":
                            cancel()  # the worker thread is not cancellable: it runs on
                            gate.release()
                        else:
                            # Released first, the async tool is already scheduled to
                            # resume when the cancellation arrives, so it runs on too.
                            gate.release()
                            cancel()
                    else:
                        for _ in range(case.cancel_after_ticks):
                            await anyio.lowlevel.checkpoint()
                        cancel()

                async def runner() -> None:
                    nonlocal finished
                    report = await machine.run_report(runtime, "s", emitter)
                    finished = report.reason.kind != YieldReason.CANCELLED
                    run_group.cancel_scope.cancel()  # stop the canceller

                run_group.start_soon(runner)
                run_group.start_soon(canceller)
            if isinstance(emitter, StreamEmitter):
                await emitter.aclose()
    finally:
        gate.release()  # never leave a worker thread waiting
    session = await store.load("s")
    if case.how == "outside":
        finished = session.conversation[-1].text == "paid"
    return gate, not finished


async def drain(emitter: StreamEmitter) -> None:
    async with emitter.receive:
        async for _ in emitter.receive:
            pass


def assert_results_are_real(session: Session[Any], gate: Gate) -> None:
    """Every call has exactly one result; a call that was charged has its real result."""
    assert history_problems(session.conversation) == []
    assert open_tool_calls(session.conversation) == []
    results: dict[str, list[tuple[str, bool]]] = {}
    for message in session.conversation:
        for result in message.tool_results:
            results.setdefault(result.call_id, []).append((result.content, result.is_error))
    for message in session.conversation:
        for tool_call in message.tool_calls:
            amount = tool_call.arguments["amount"]
            charges = gate.charged.count(amount)
            assert charges <= 1, f"charge {amount} ran {charges} times"
            (stored,) = results[tool_call.call_id]
            if charges:
                # The tool ran to completion: its result exists and must be the one stored.
                assert stored == (f"charged {amount}", False), (tool_call.call_id, stored)
            else:
                assert stored[1], f"call {tool_call.call_id} was never charged, yet {stored}"


@pytest.mark.parametrize("tool_kind", ["sync", "async"])
@pytest.mark.parametrize("emitter", ["null", "recording", "stream"])
@pytest.mark.parametrize("how", ["token", "outside"])
async def test_a_tool_finishing_with_a_cancellation_pending_keeps_its_real_result(
    how: How, emitter: EmitterKind, tool_kind: ToolKind
) -> None:
    case = Case(how=how, emitter=emitter, tool_kind=tool_kind)
    store = MemoryStore()
    gate, cancelled = await run_cancelled(case, store)
    session = await store.load("s")
    assert cancelled
    assert gate.charged == [100]  # the tool ran to completion, after the cancel fired
    ((call_id, content, is_error),) = [
        (r.call_id, r.content, r.is_error) for m in session.conversation for r in m.tool_results
    ]
    assert (call_id, content, is_error) == ("call-0-0", "charged 100", False)
    assert content != INTERRUPTED
    assert_results_are_real(session, gate)


cases = st.builds(
    Case,
    how=st.sampled_from(["token", "outside"]),
    emitter=st.sampled_from(["null", "recording", "stream"]),
    tool_kind=st.sampled_from(["sync", "async"]),
    store=st.sampled_from(["memory", "memory", "sqlite", "file"]),
    amounts=st.lists(st.integers(1, 999), min_size=1, max_size=3, unique=True).map(tuple),
    max_concurrency=st.sampled_from([1, 8]),
    cancel_after_ticks=st.none() | st.integers(0, 120),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases)
@example(case=Case(how="token", emitter="stream", tool_kind="sync", amounts=(100, 200)))
@example(case=Case(how="outside", emitter="stream", tool_kind="async", max_concurrency=1))
async def test_at_any_cancel_point_a_result_that_exists_is_never_replaced(case: Case) -> None:
    async with open_store(case.store) as store:
        gate, _ = await run_cancelled(case, store)
        session = await store.load("s")
        assert_results_are_real(session, gate)
        # The session resumes to a valid end, and nothing is charged twice.
        resume = StateMachine([Tools([charging_tool(case.tool_kind, gate)]), ModelInference()])
        model = FunctionModel(lambda request: reply("resumed"))
        resumed = await resume.run(Runtime(store=store, model=model, ids=counter_ids("r")), "s")
        assert_results_are_real(resumed, gate)


# -- the result's own commit is cancelled ------------------------------------------------


class CancelDuringResultCommit:
    """A store wrapper that fires a cancellation while a tool result is being committed.

    ``when="before"``: the cancellation lands before the batch is written (so
    nothing is written); ``"after"``: the batch is written, then the
    cancellation lands before ``apply`` returns.
    """

    def __init__(
        self, store: Store, when: Literal["before", "after"], cancel: Callable[[], None]
    ) -> None:
        self.store = store
        self.when = when
        self.cancel = cancel
        self.fired = False

    async def load(self, session_id: str) -> Session[Any]:
        return await self.store.load(session_id)

    async def apply(self, batch: Batch[Any]) -> Session[Any] | None:
        is_result = batch.step == "tools" and any(
            getattr(getattr(e, "message", None), "tool_results", ()) for e in batch.effects
        )
        if is_result and not self.fired:
            self.fired = True
            if self.when == "before":
                self.cancel()
                await anyio.lowlevel.checkpoint()
            else:
                stored = await self.store.apply(batch)
                self.cancel()
                await anyio.lowlevel.checkpoint()
                return stored
        return await self.store.apply(batch)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("how", ["token", "outside"])
@pytest.mark.parametrize("store_kind", ["memory", "sqlite", "file"])
async def test_a_cancelled_result_commit_is_recorded_once_with_the_real_result(
    store_kind: StoreKind, how: How, when: Literal["before", "after"]
) -> None:
    gate = Gate(hold=False)
    token = CancelToken()
    async with open_store(store_kind) as store:
        await store.create("s", conversation=[Message.user("pay", id="u1")])
        machine = StateMachine(
            [Tools([charging_tool("sync", gate)]), ModelInference()],
            cancel=token if how == "token" else None,
        )
        model = ScriptedModel([call(("charge_card", {"amount": 7})), reply("paid")])
        with anyio.CancelScope() as scope:
            wrapper = CancelDuringResultCommit(
                store, when, (lambda: token.cancel("stop")) if how == "token" else scope.cancel
            )
            runtime = Runtime(loader=wrapper, handler=wrapper, model=model, ids=counter_ids())
            report = await machine.run_report(runtime, "s")
            assert report.reason.kind == YieldReason.CANCELLED
        assert wrapper.fired
        session = await store.load("s")
        assert gate.charged == [7]
        assert_results_are_real(session, gate)
        steps = [b.step for b in await store.batches("s")]
        # Written by the tool step itself, or (cancelled before the write) by its finalize.
        assert steps[:2] == ["inference", "tools"]
        assert steps.count("stepmachine.finalize") == 0


# -- callers driving step() themselves ---------------------------------------------------


@pytest.mark.parametrize("tool_kind", ["sync", "async"])
@pytest.mark.parametrize("emitter_kind", ["null", "recording", "stream"])
async def test_a_cancelled_step_keeps_a_result_that_exists_before_the_callers_finalize(
    emitter_kind: EmitterKind, tool_kind: ToolKind
) -> None:
    gate = Gate(hold=True)
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("pay", id="u1")])
    machine = StateMachine([Tools([charging_tool(tool_kind, gate)]), ModelInference()])
    model = ScriptedModel([call(("charge_card", {"amount": 3})), reply("paid")])
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    session = await store.load("s")
    decision = await machine.step(runtime, session)
    assert decision is not None
    session, _ = await machine.apply(runtime, session, decision)
    emitter = make_emitter(emitter_kind)
    try:
        async with anyio.create_task_group() as outer:
            if isinstance(emitter, StreamEmitter):
                outer.start_soon(drain, emitter)
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:

                    async def canceller() -> None:
                        await gate.started.wait()
                        if tool_kind == "sync":
                            scope.cancel()
                            gate.release()
                        else:
                            gate.release()
                            scope.cancel()

                    tg.start_soon(canceller)
                    tools = await machine.step(runtime, session, emitter)
                    assert tools is not None
                    await machine.apply(runtime, session, tools)
            if isinstance(emitter, StreamEmitter):
                await emitter.aclose()
    finally:
        gate.release()
    assert scope.cancelled_caught
    assert gate.charged == [3]
    final = await machine.finalize(runtime, "s", interrupted=tools)
    assert_results_are_real(final, gate)


# -- an interrupt (Ctrl-C under trio, SystemExit) lands after the tool finished ---------------


class InterruptOnToolFinished:
    """An emitter that raises ``exc`` when a ``ToolFinished`` event is emitted.

    Under trio, Ctrl-C raises ``KeyboardInterrupt`` at the next checkpoint,
    which can be the emit right after the tool returned: the same instant.
    """

    def __init__(self, exc: type[BaseException]) -> None:
        self.exc = exc

    async def emit(self, event: Event) -> None:
        if isinstance(event.data, ToolFinished):
            raise self.exc


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("driver", ["run", "step"])
async def test_an_interrupt_after_the_tool_finished_keeps_its_real_result(
    exc: type[BaseException], driver: str
) -> None:
    """The interrupt propagates, but first the result that exists is recorded, once.

    Before: the run ended with the call open (its intent but no result), and
    the next run answered a tool that had run "outcome unknown".
    """
    gate = Gate(hold=False)
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("pay", id="u1")])
    machine = StateMachine(
        [Tools([charging_tool("sync", gate)], max_concurrency=1), ModelInference()]
    )
    model = ScriptedModel([call(("charge_card", {"amount": 5})), reply("paid")])
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    emitter = InterruptOnToolFinished(exc)

    async def drive() -> None:
        if driver == "run":
            await machine.run_report(runtime, "s", emitter)
            return
        session = await store.load("s")
        decision = await machine.step(runtime, session)
        assert decision is not None
        session, _ = await machine.apply(runtime, session, decision)
        tools = await machine.step(runtime, session, emitter)
        assert tools is not None
        await machine.apply(runtime, session, tools)  # the interrupt lands in here

    with pytest.raises(exc):
        await drive()
    assert gate.charged == [5]
    stored = await store.load("s")
    assert open_tool_calls(stored.conversation) == []
    assert_results_are_real(stored, gate)
