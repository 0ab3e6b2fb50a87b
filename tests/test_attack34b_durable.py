"""Attack 34b: durable turns (``stepmachine.durable``) against ``machine.run()``.

DBOS runs with its SQLite system database here (``sqlite:///...``), so no PostgreSQL is
needed. DBOS Transact is asyncio-only (the module docs; its entry points refuse trio,
which ``tests/test_durable_dbos.py`` checks), so these tests pin ``anyio_backend`` to
asyncio.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from _attack34b_agent import Agent
from dbos import DBOS
from test_attack34b_paths import charge_call, log_of, open_store, scenario

from stepmachine import AppendMessage, CancelToken, Message, StateMachine, submit
from stepmachine._durable_codec import _sqlite_system_database_problem
from stepmachine.durable import DurableMachine, DurableTurnError, dbos_config
from stepmachine.extend import history_problems
from stepmachine.operations import approve

POLL = 0.05
DBOS_SQLITE_PROBLEM = _sqlite_system_database_problem("sqlite://")
pytestmark = pytest.mark.skipif(DBOS_SQLITE_PROBLEM is not None, reason=str(DBOS_SQLITE_PROBLEM))
"""DBOS keeps its tables in SQLite here: not where it cannot (Python 3.12 or later with
SQLite before 3.42; ``dbos_config`` refuses, saying so)."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # DBOS is asyncio-only


@pytest.fixture
def fresh_dbos() -> Iterator[None]:
    DBOS.destroy(destroy_registry=True)
    yield
    DBOS.destroy(destroy_registry=True)


async def durable_scenario(
    kind: str, tmp: Path, budget: int | None = None, machine: StateMachine[Any] | None = None
) -> dict[str, Any]:
    agent = Agent()
    store = await open_store(kind, tmp)
    machine = machine or agent.machine(budget=budget)
    runtime = agent.runtime(store)
    DBOS(config=dbos_config("a34b", f"sqlite:///{tmp}/sys.sqlite3", log_level="ERROR"))
    durable = DurableMachine(machine, runtime, name="a34b", polling_interval=POLL)
    await durable.launch()
    reasons: list[str] = []
    turns = 0

    async def go() -> None:
        nonlocal turns
        turns += 1
        handle = await durable.enqueue_turn("s", turn_id=f"turn-{turns}")
        report = await durable.result(handle, polling_interval=POLL)
        reasons.append(report.reason)

    try:
        await store.create("s")
        await submit(store, "s", [AppendMessage(Message.user("invoice", id="u1"))], clock=lambda: 1)
        await go()
        for _ in range(6):
            if reasons[-1] == "done":
                break
            if reasons[-1] == "awaiting_approval":
                session = await store.load("s")
                await approve(store, "s", charge_call(session), by="tester", clock=lambda: 1_500.0)
            await go()
        session = await store.load("s")
        return {
            "conversation": msgspec.to_builtins(tuple(session.conversation)),
            "log": log_of(await store.batches("s")),
            "reasons": reasons,
            "effects": agent.effects,
            "requests": agent.requests,
        }
    finally:
        DBOS.destroy(destroy_registry=True)
        await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["sqlite", "file"])
@pytest.mark.parametrize("budget", [None, 1])
async def test_durable_turns_match_run(
    kind: str, budget: int | None, tmp_path: Path, fresh_dbos: None
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    expected = await scenario(kind, tmp_path / "a", "run", budget=budget)
    got = await durable_scenario(kind, tmp_path / "b", budget=budget)
    assert expected["reasons"][-1] == "done"
    assert got["reasons"] == expected["reasons"]
    assert got["conversation"] == expected["conversation"]
    assert got["effects"] == expected["effects"]
    assert got["requests"] == expected["requests"]
    assert got["log"] == expected["log"]


@pytest.mark.anyio
async def test_a_fired_token_ends_a_durable_turn_as_cancelled(
    tmp_path: Path, fresh_dbos: None
) -> None:
    agent = Agent()
    token = CancelToken()
    machine = StateMachine(agent.machine().steps, cancel=token)
    token.cancel("stop")
    store = await open_store("sqlite", tmp_path)
    try:
        await store.create("s")
        await submit(store, "s", [AppendMessage(Message.user("invoice", id="u1"))])
        report = await machine.run_report(agent.runtime(store, fixed_ids=False), "s")
        assert report.reason.kind == "cancelled"  # what run() does
        DBOS(config=dbos_config("a34b", f"sqlite:///{tmp_path}/sys.sqlite3", log_level="ERROR"))
        durable = DurableMachine(machine, agent.runtime(store), name="a34b", polling_interval=POLL)
        await durable.launch()
        turn = await durable.result(await durable.enqueue_turn("s"), polling_interval=POLL)
        assert agent.requests == 0  # nothing was asked of the model either way
        assert [(c.status, c.reason) for c in turn.cycles][-1][1] == "cancelled"
        assert all(c.status != "continue" or c.reason == "" for c in turn.cycles), turn.cycles
        assert turn.reason == "cancelled", turn
        assert len(turn.cycles) == 1
    finally:
        DBOS.destroy(destroy_registry=True)
        await store.aclose()


def only_the_stores(tmp: Path) -> bool:
    """Nothing but the store's folder and DBOS's database files in ``tmp``."""
    return all(p.name == "inside" or p.name.startswith("sys.sqlite3") for p in tmp.iterdir())


async def launched(agent: Agent, store: Any, tmp: Path) -> DurableMachine:
    DBOS(config=dbos_config("a34b", f"sqlite:///{tmp}/sys.sqlite3", log_level="ERROR"))
    durable = DurableMachine(
        agent.machine(), agent.runtime(store, fixed_ids=False), name="a34b", polling_interval=POLL
    )
    await durable.launch()
    return durable


@pytest.mark.anyio
@pytest.mark.parametrize("session_id", ["../escape", "a/b", "x\x00y", ""])
async def test_durable_turn_of_a_hostile_id_fails_clearly(
    session_id: str, tmp_path: Path, fresh_dbos: None
) -> None:
    agent = Agent(approval=False)
    store = await open_store("file", tmp_path / "inside")
    try:
        durable = await launched(agent, store, tmp_path)
        turn = await durable.enqueue_turn(session_id)
        with pytest.raises(DurableTurnError) as caught:
            await durable.result(turn, polling_interval=POLL)
        assert caught.value.error_type == "InvalidSessionIdError", caught.value
        assert only_the_stores(tmp_path)
    finally:
        DBOS.destroy(destroy_registry=True)
        await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["sqlite", "file"])
async def test_durable_turn_waits_for_a_run_holding_the_lease(
    kind: str, tmp_path: Path, fresh_dbos: None
) -> None:
    """A ``run()`` holds the session inside ``charge``; a durable turn enqueued meanwhile
    waits for the lease (module docs: "a waiting one sees the first one's results instead
    of reading its in-flight calls as crashed"): the charge keeps its real result."""
    agent = Agent(approval=False)
    store = await open_store(kind, tmp_path)
    try:
        await store.create("s")
        await submit(store, "s", [AppendMessage(Message.user("invoice", id="u1"))])
        durable = await launched(agent, store, tmp_path)
        inside, go = anyio.Event(), anyio.Event()

        async def block() -> None:
            inside.set()
            await go.wait()

        agent.on_charge_done = block
        machine = agent.machine()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(machine.run, agent.runtime(store, fixed_ids=False), "s")
            with anyio.fail_after(30):
                await inside.wait()
            turn = await durable.enqueue_turn("s")
            with anyio.fail_after(30):  # dequeued: its first cycle now waits for the lease
                while (await DBOS.get_workflow_status_async(turn)).status != "PENDING":  # noqa: ASYNC110 - DBOS's status, polled
                    await anyio.sleep(POLL)
            await anyio.sleep(0.3)
            assert agent.requests == 2  # the turn sent nothing while the holder ran
            go.set()
        report = await durable.result(turn, polling_interval=POLL)
        final = await store.load("s")
        results = [str(r.content) for m in final.conversation for r in m.tool_results]
        assert results == ["found invoice", "charged 1"]
        assert len([e for e in agent.effects if e.startswith("charge")]) == 1
        assert report.reason in {"idle", "done"}
    finally:
        DBOS.destroy(destroy_registry=True)
        await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["sqlite", "file"])
async def test_cancel_workflow_mid_tool_keeps_the_result(
    kind: str, tmp_path: Path, fresh_dbos: None
) -> None:
    """``DBOS.cancel_workflow`` while ``charge`` runs (module docs: the turn "stops at the
    next cycle boundary"): the charge's real result is stored, nothing more runs in that
    turn, and ``run()`` afterwards finishes the session without charging again."""
    agent = Agent(approval=False)
    store = await open_store(kind, tmp_path)
    try:
        await store.create("s")
        await submit(store, "s", [AppendMessage(Message.user("invoice", id="u1"))])
        durable = await launched(agent, store, tmp_path)
        inside, go = anyio.Event(), anyio.Event()

        async def block() -> None:
            inside.set()
            await go.wait()

        agent.on_charge_done = block
        turn = await durable.enqueue_turn("s")
        with anyio.fail_after(30):
            await inside.wait()
        requests = agent.requests
        await DBOS.cancel_workflow_async(turn)
        go.set()
        with anyio.fail_after(30):
            while True:
                status = await DBOS.get_workflow_status_async(turn)
                stored = await store.load("s")
                answered = [r for m in stored.conversation for r in m.tool_results]
                if len(answered) == 2 or (status is not None and status.status == "CANCELLED"):
                    break
                await anyio.sleep(POLL)
        await anyio.sleep(0.5)  # a turn that went on would ask the model meanwhile
        stored = await store.load("s")
        results = [str(r.content) for m in stored.conversation for r in m.tool_results]
        assert results[0] == "found invoice"
        assert len(results) == 2
        assert agent.requests == requests, "the cancelled turn asked the model again"
        assert (
            await agent.machine().run_report(agent.runtime(store, fixed_ids=False), "s")
        ).reason.kind == "done"
        assert len([e for e in agent.effects if e.startswith("charge")]) == 1
        final = await store.load("s")
        assert history_problems(final.conversation) == []
    finally:
        DBOS.destroy(destroy_registry=True)
        await store.aclose()
