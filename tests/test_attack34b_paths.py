"""Attack 34b: the run paths other than ``run()`` give what ``run()`` gives.

``machine.step()``/``apply()`` driven by hand, ``run_worker`` (the worker loop) and
``run_step`` are compared with ``machine.run()`` on the same scripted agent (a lookup,
a charge that needs approval, an answer), on SQLiteStore and FileStore, under asyncio
and trio: the same final conversation, the same batches in the store's log, the same
yield reasons, approval and budgets included.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgspec
import pytest
from _attack34b_agent import Agent, by_hand

from stepmachine import (
    AppendMessage,
    CancelToken,
    Message,
    RunReport,
    StateMachine,
    run_worker,
    submit,
)
from stepmachine.extend import history_problems
from stepmachine.operations import approve
from stepmachine.stores import FileStore, SQLiteStore
from stepmachine.testing import run_step


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def open_store(kind: str, tmp: Path) -> Any:
    if kind == "sqlite":
        return await SQLiteStore.open(tmp / "db.sqlite3")
    return await FileStore.open(tmp / "store")


def charge_call(session: Any) -> str:
    for message in session.conversation:
        for part in message.tool_calls:
            if part.name == "charge":
                return str(part.call_id)
    raise AssertionError("no charge call")


def log_of(batches: list[Any]) -> list[Any]:
    return [
        (
            b.revision,
            b.step,
            b.cycle,
            msgspec.to_builtins(b.effects),
            msgspec.to_builtins(b.refused),
        )
        for b in batches
    ]


async def scenario(kind: str, tmp: Path, path: str, budget: int | None = None) -> dict[str, Any]:
    """Two user turns, the second needing an approval, run by ``path``; what is stored."""
    agent = Agent()
    store = await open_store(kind, tmp)
    machine = agent.machine(budget=budget)
    runtime = agent.runtime(store)
    reasons: list[str] = []

    async def go() -> None:
        if path == "run":
            report = await machine.run_report(runtime, "s")
            reasons.append(report.reason.kind)
        elif path == "step":
            _, reason, _ = await by_hand(machine, runtime, "s")
            reasons.append(reason)
        else:
            await store.request_run("s")
            stop = CancelToken()

            def seen(report: RunReport[Any]) -> None:
                reasons.append(report.reason.kind)
                stop.cancel()

            await run_worker(machine, runtime, stop=stop, poll=0.01, on_report=seen)

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
            "problems": history_problems(session.conversation),
        }
    finally:
        await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["sqlite", "file"])
@pytest.mark.parametrize("path", ["step", "worker"])
async def test_path_matches_run_with_approval(kind: str, path: str, tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    expected = await scenario(kind, tmp_path / "a", "run")
    got = await scenario(kind, tmp_path / "b", path)
    assert expected["reasons"] == ["awaiting_approval", "done"]
    assert expected["problems"] == []
    assert got["reasons"] == expected["reasons"]
    assert got["conversation"] == expected["conversation"]
    assert got["effects"] == expected["effects"]
    assert got["requests"] == expected["requests"] == 3
    assert got["log"] == expected["log"]


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["sqlite", "file"])
@pytest.mark.parametrize("path", ["step", "worker"])
async def test_path_matches_run_with_a_budget(kind: str, path: str, tmp_path: Path) -> None:
    """``Budget(per_run=Limits(model_calls=1))``: each run sends at most one request."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    expected = await scenario(kind, tmp_path / "a", "run", budget=1)
    got = await scenario(kind, tmp_path / "b", path, budget=1)
    assert expected["reasons"] == [
        "budget_exhausted",
        "awaiting_approval",
        "done",
    ]
    assert expected["requests"] == 3
    assert got["reasons"] == expected["reasons"]
    assert got["requests"] == expected["requests"]
    assert got["conversation"] == expected["conversation"]
    assert got["log"] == expected["log"]


@pytest.mark.anyio
async def test_run_step_gives_the_machines_first_cycle(tmp_path: Path) -> None:
    """``run_step`` of the inference step on the stored session writes what ``run()``'s
    first cycle wrote (the model's call), from the same session."""
    agent = Agent()
    store = await SQLiteStore.open(tmp_path / "db.sqlite3")
    try:
        await store.create("s")
        before = await submit(store, "s", [AppendMessage(Message.user("x", id="u1"))])
        machine = agent.machine()
        runtime = agent.runtime(store)
        inference = machine.steps[-1]
        check = await run_step(
            inference, before, runtime=agent.runtime(None), others=machine.steps[:-1]
        )
        report = await machine.run_report(runtime, "s")
        assert report.reason.kind == "awaiting_approval"
        first = (await store.batches("s", after=before.revision))[0]
        assert first.step == "inference"
        written = [e for batch in check.commits for e in batch] + list(check.effects)
        assert msgspec.to_builtins(tuple(written)) == msgspec.to_builtins(first.effects)
        assert check.session.revision == before.revision + len(check.commits) + (
            1 if check.effects else 0
        )
    finally:
        await store.aclose()


def test_machine_steps_reject_unknown_kwargs() -> None:
    machine: StateMachine[Any] = Agent().machine()
    with pytest.raises(TypeError):
        machine.step(None, None, bogus=1)  # type: ignore[call-arg]


class Ids:
    """A counter id source that can be copied at its current position."""

    def __init__(self, count: int = 0) -> None:
        self.count = count

    def __call__(self) -> str:
        self.count += 1
        return f"m{self.count}"


@pytest.mark.anyio
async def test_run_step_matches_each_machine_cycle(tmp_path: Path) -> None:
    """Drive the agent by hand; before each ``apply``, ``run_step`` the deciding step on the
    same session (with the other steps as ``others``, ids and clock in step): it writes the
    same effects and ends with the same outcome and yield reason as the machine's cycle."""
    agent = Agent()
    store = await SQLiteStore.open(tmp_path / "db.sqlite3")
    try:
        await store.create("s")
        await submit(store, "s", [AppendMessage(Message.user("invoice", id="u1"))])
        machine = agent.machine()
        ids = Ids()
        runtime = dataclasses.replace(agent.runtime(store), ids=ids, clock=lambda: 5.0)
        compared: list[str] = []
        for _ in range(3):  # runs: budget / approval / done
            session = await store.load("s")
            start = session.revision
            for cycle in range(1, 20):
                decision = await machine.step(
                    runtime, session, cycle=cycle, run_start_revision=start
                )
                if decision is None:
                    break
                others = [s for s in machine.steps if s is not decision.step]
                mirror = dataclasses.replace(runtime, ids=Ids(ids.count), store=None)
                mirror = dataclasses.replace(mirror, loader=None, handler=None)
                if start != session.revision:
                    break  # run_step has no run_start_revision: compare first cycles of runs
                check = await run_step(decision.step, session, runtime=mirror, others=others)
                session, result = await machine.apply(runtime, session, decision, cycle=cycle)
                written = [e for batch in check.commits for e in batch] + list(check.effects)
                assert msgspec.to_builtins(tuple(written)) == msgspec.to_builtins(result.effects)
                assert (check.yielded, check.continued) == (
                    result.status == "yielded",
                    result.status == "continue",
                )
                reason = getattr(check.outcome, "reason", None)
                assert (reason.kind if reason else None) == (
                    result.reason.kind if result.reason else None
                )
                compared.append(f"{result.step}:{result.status}")
                if result.reason is not None:
                    break
            if session.conversation[-1].text.startswith("done"):
                break
            if any(p.name == "charge" for m in session.conversation for p in m.tool_calls):
                stored = await store.load("s")
                await approve(store, "s", charge_call(stored), by="t", clock=lambda: 5.0)
        assert compared, "nothing compared"
    finally:
        await store.aclose()


@pytest.mark.anyio
async def test_run_step_counts_a_per_run_budget_as_a_new_run_would(tmp_path: Path) -> None:
    agent = Agent(approval=False)
    store = await SQLiteStore.open(tmp_path / "db.sqlite3")
    try:
        await store.create("s")
        await submit(store, "s", [AppendMessage(Message.user("invoice", id="u1"))])
        machine = agent.machine(budget=1)
        runtime = agent.runtime(store)
        first = await machine.run_report(runtime, "s")
        assert first.reason.kind == "budget_exhausted"  # one request in the first run
        session = await store.load("s")
        decision = await machine.step(runtime, session, cycle=1)  # a new run starts here
        assert decision is not None
        assert decision.step.name == "inference"
        others = [s for s in machine.steps if s is not decision.step]
        kit = agent.runtime(None, fixed_ids=False)  # ids the stored session does not hold yet
        check = await run_step(decision.step, session, runtime=kit, others=others)
        assert check.continued
        assert agent.requests == 2
    finally:
        await store.aclose()
