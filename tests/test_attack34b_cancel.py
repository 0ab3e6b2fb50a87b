"""Attack 34b: cancellation and misuse of the hand-driven path (``step``/``apply``/
``finalize``) and of the worker loop, on SQLiteStore and FileStore, asyncio and trio.

Cancellation lands while the non-idempotent ``charge`` is in its tool (before its side
effect, or after it and before it returns). Then ``finalize`` must answer the open call,
keep what finished (the lookup's result), write nothing on a second call, and a later
``run()`` must finish the turn without running ``charge`` again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from _attack34b_agent import Agent, by_hand
from test_attack34b_paths import open_store

from stepmachine import (
    AppendMessage,
    CancelToken,
    ConflictError,
    LeasePolicy,
    Message,
    SessionBusyError,
    StateMachine,
    run_worker,
    submit,
)
from stepmachine.extend import INTERRUPTED, history_problems
from stepmachine.operations import Budget, Limits
from stepmachine.testing import FunctionModel

STORES = ["sqlite", "file"]
HERE = Path(__file__).resolve().parent


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def prepared(kind: str, tmp: Path) -> Any:
    store = await open_store(kind, tmp)
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("invoice", id="u1"))])
    return store


async def to_the_charge(agent: Agent, machine: Any, runtime: Any) -> tuple[Any, Any, int]:
    """Drive by hand up to the decision that runs ``charge``: (session, decision, cycle)."""
    session = await runtime.session_loader().load("s")
    cycle = 0
    while True:
        cycle += 1
        decision = await machine.step(runtime, session, cycle=cycle)
        assert decision is not None
        names = [p.name for m in session.conversation for p in m.tool_calls]
        if decision.step.name == "tools" and "charge" in names:
            return session, decision, cycle
        session, _ = await machine.apply(runtime, session, decision, cycle=cycle)


def results_of(conversation: Any) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for message in conversation:
        for result in message.tool_results:
            found.setdefault(result.call_id, []).append(str(result.content))
    return found


def charge_results(conversation: Any) -> list[str]:
    calls = {p.call_id for m in conversation for p in m.tool_calls if p.name == "charge"}
    return [r for call, rs in results_of(conversation).items() if call in calls for r in rs]


@pytest.mark.anyio
@pytest.mark.parametrize("kind", STORES)
@pytest.mark.parametrize("where", ["before_effect", "after_effect"])
async def test_cancelled_apply_then_finalize_then_run(
    kind: str, where: str, tmp_path: Path
) -> None:
    agent = Agent(approval=False)
    store = await prepared(kind, tmp_path)
    try:
        machine = agent.machine()
        runtime = agent.runtime(store)
        session, decision, cycle = await to_the_charge(agent, machine, runtime)
        inside = anyio.Event()

        async def block() -> None:
            inside.set()
            await anyio.sleep_forever()

        if where == "before_effect":
            agent.on_charge_start = block
        else:
            agent.on_charge_done = block
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tasks:

                async def cancel_when_inside() -> None:
                    await inside.wait()
                    scope.cancel()

                tasks.start_soon(cancel_when_inside)
                await machine.apply(runtime, session, decision, cycle=cycle)
        assert scope.cancelled_caught
        agent.on_charge_start = agent.on_charge_done = None
        after = await machine.finalize(runtime, "s", interrupted=decision)
        charged = charge_results(after.conversation)
        assert len(charged) == 1, charged
        assert INTERRUPTED in charged[0], charged
        assert history_problems(after.conversation) == []
        log = len(await store.batches("s"))
        again = await machine.finalize(runtime, "s", interrupted=decision)
        assert again.revision == after.revision  # a second finalize writes nothing
        assert len(await store.batches("s")) == log
        report = await machine.run_report(runtime, "s")
        assert report.reason.kind == "done"
        final = await store.load("s")
        assert len(charge_results(final.conversation)) == 1
        assert len([e for e in agent.effects if e.startswith("charge")]) == (
            0 if where == "before_effect" else 1
        )
        assert history_problems(final.conversation) == []
    finally:
        await store.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
@pytest.mark.parametrize("kind", STORES)
async def test_native_task_cancel_of_apply(kind: str, tmp_path: Path) -> None:
    """Asyncio only: ``task.cancel()`` on the task running ``apply()`` mid-tool."""
    agent = Agent(approval=False)
    store = await prepared(kind, tmp_path)
    try:
        machine = agent.machine()
        runtime = agent.runtime(store)
        session, decision, cycle = await to_the_charge(agent, machine, runtime)
        inside = asyncio.Event()

        async def block() -> None:
            inside.set()
            await asyncio.sleep(3600)

        agent.on_charge_done = block
        task = asyncio.ensure_future(machine.apply(runtime, session, decision, cycle=cycle))
        await asyncio.wait_for(inside.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        agent.on_charge_done = None
        after = await machine.finalize(runtime, "s", interrupted=decision)
        assert len(charge_results(after.conversation)) == 1
        assert (await machine.run_report(runtime, "s")).reason.kind == "done"
        assert len([e for e in agent.effects if e.startswith("charge")]) == 1
    finally:
        await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", STORES)
async def test_worker_cancelled_mid_tool_then_run(kind: str, tmp_path: Path) -> None:
    agent = Agent(approval=False)
    store = await prepared(kind, tmp_path)
    try:
        machine = agent.machine()
        runtime = agent.runtime(store)
        inside = anyio.Event()

        async def block() -> None:
            inside.set()
            await anyio.sleep_forever()

        agent.on_charge_done = block
        await store.request_run("s")
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(lambda: run_worker(machine, runtime, stop=CancelToken(), poll=0.01))
            with anyio.fail_after(30):
                await inside.wait()
            tasks.cancel_scope.cancel()
        agent.on_charge_done = None
        stopped = await store.load("s")
        charged = charge_results(stopped.conversation)
        assert len(charged) == 1, charged
        assert INTERRUPTED in charged[0], charged
        assert (await machine.run_report(runtime, "s")).reason.kind == "done"
        assert len([e for e in agent.effects if e.startswith("charge")]) == 1
        assert history_problems((await store.load("s")).conversation) == []
    finally:
        await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", STORES)
async def test_stale_inference_apply_conflicts_and_calls_no_model(
    kind: str, tmp_path: Path
) -> None:
    """A decision made before another writer moved the session on: ``apply`` raises
    ``ConflictError`` (its docstring: "the first batch lost the race; nothing was
    written") and sends no model request."""
    agent = Agent(approval=False)
    store = await prepared(kind, tmp_path)
    try:
        machine = agent.machine()
        runtime = agent.runtime(store)
        session = await store.load("s")
        decision = await machine.step(runtime, session, cycle=1)  # inference: the model call
        assert decision is not None
        assert decision.step.name == "inference"
        moved = await submit(store, "s", [AppendMessage(Message.user("more", id="u2"))])
        try:
            with pytest.raises(ConflictError):
                await machine.apply(runtime, session, decision, cycle=1)
        finally:
            assert agent.requests == 0, "a model request was sent for a stale decision"
        assert (await store.load("s")).revision == moved.revision
    finally:
        await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", STORES)
async def test_stale_tools_apply_runs_each_call_once(kind: str, tmp_path: Path) -> None:
    """A tools decision made stale by an unrelated user message: ``apply`` raises
    ``ConflictError`` before the tool runs; stepping again from the stored session runs
    the call once and its result lands there."""
    agent = Agent(approval=False)
    store = await prepared(kind, tmp_path)
    try:
        machine = agent.machine()
        runtime = agent.runtime(store)
        session = await store.load("s")
        first = await machine.step(runtime, session, cycle=1)
        assert first is not None
        session, _ = await machine.apply(runtime, session, first, cycle=1)
        decision = await machine.step(runtime, session, cycle=2)
        assert decision is not None
        assert decision.step.name == "tools"
        await submit(store, "s", [AppendMessage(Message.user("again", id="u3"))])
        with pytest.raises(ConflictError):
            await machine.apply(runtime, session, decision, cycle=2)
        assert agent.effects == []  # nothing ran for the stale decision
        session = await store.load("s")
        again = await machine.step(runtime, session, cycle=2)
        assert again is not None
        assert again.step.name == "tools"
        await machine.apply(runtime, session, again, cycle=2)
        assert len(agent.effects) == 1
        stored = await store.load("s")
        assert [r for rs in results_of(stored.conversation).values() for r in rs] == [
            "found invoice"
        ]
        assert history_problems(stored.conversation) == []
    finally:
        await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", STORES)
async def test_step_apply_while_a_run_holds_the_session(kind: str, tmp_path: Path) -> None:
    """A ``run()`` holds the session's lease and is inside ``charge``. A hand-driven
    ``step``/``apply`` of the same session must not answer that call as crashed (nor
    run anything) while the holder runs it: the charge keeps its one real result."""
    agent = Agent(approval=False)
    store = await prepared(kind, tmp_path)
    try:
        machine = agent.machine()
        runtime = agent.runtime(store)
        inside, go = anyio.Event(), anyio.Event()

        async def block() -> None:
            inside.set()
            await go.wait()

        agent.on_charge_done = block
        outcome: list[Any] = []
        async with anyio.create_task_group() as tasks:

            async def holder() -> None:
                outcome.append(await machine.run_report(runtime, "s"))

            tasks.start_soon(holder)
            with anyio.fail_after(30):
                await inside.wait()
            intruder: Any = None
            try:
                session = await store.load("s")
                decision = await machine.step(runtime, session, cycle=1)
                if decision is not None:
                    intruder = await machine.apply(runtime, session, decision, cycle=1)
            except (SessionBusyError, ConflictError) as exc:
                intruder = exc
            finally:
                go.set()
        final = await store.load("s")
        charged = charge_results(final.conversation)
        assert len([e for e in agent.effects if e.startswith("charge")]) == 1
        assert history_problems(final.conversation) == []
        assert charged == ["charged 1"], (charged, intruder, outcome)
    finally:
        await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", STORES)
async def test_by_hand_while_a_run_holds_the_lease_busy_fail(kind: str, tmp_path: Path) -> None:
    """The same holder, and a second ``run(busy='fail')``: refused with SessionBusyError
    (the baseline the hand-driven path is held to above)."""
    agent = Agent(approval=False)
    store = await prepared(kind, tmp_path)
    try:
        machine = agent.machine()
        runtime = agent.runtime(store)
        inside, go = anyio.Event(), anyio.Event()

        async def block() -> None:
            inside.set()
            await go.wait()

        agent.on_charge_done = block
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(machine.run, runtime, "s")
            with anyio.fail_after(30):
                await inside.wait()
            try:
                with pytest.raises(SessionBusyError):
                    await machine.run(runtime, "s", lease=LeasePolicy(busy="fail"))
            finally:
                go.set()
        final = await store.load("s")
        assert charge_results(final.conversation) == ["charged 1"]
        done = await by_hand(machine, runtime, "s")
        assert done[1] == "idle"  # nothing left to do
    finally:
        await store.aclose()


def outside(tmp: Path, folder: Path) -> set[Path]:
    return {p for p in tmp.rglob("*") if not p.is_relative_to(folder)}


HOSTILE = ["../escape", "a/b", "", "x\x00y", "con", "é" * 300, ".", "..", "s\n"]


@pytest.mark.anyio
@pytest.mark.parametrize("kind", STORES)
@pytest.mark.parametrize("session_id", HOSTILE)
async def test_hostile_session_ids_on_the_hand_driven_and_worker_paths(
    kind: str, session_id: str, tmp_path: Path
) -> None:
    """A hostile id is refused by ``create`` with a clear error or kept inside the store;
    the hand-driven path and the worker run it like any other id; nothing is written
    outside the store's folder."""
    agent = Agent(approval=False)
    folder = tmp_path / "inside"
    folder.mkdir()
    store = await open_store(kind, folder)
    before = outside(tmp_path, folder)
    try:
        refused: Exception | None = None
        try:
            await store.create(session_id)
        except Exception as exc:  # which error: checked below
            refused = exc
        if refused is not None:
            assert "session" in str(refused).lower(), repr(refused)  # names what is wrong
            assert outside(tmp_path, folder) == before
            return
        await submit(store, session_id, [AppendMessage(Message.user("invoice", id="u1"))])
        machine = agent.machine()
        runtime = agent.runtime(store)
        session, reason, _ = await by_hand(machine, runtime, session_id)
        assert reason == "done"
        assert session.id == session_id
        stored = await store.load(session_id)
        assert msgspec.to_builtins(tuple(stored.conversation)) == msgspec.to_builtins(
            tuple(session.conversation)
        )
        assert outside(tmp_path, folder) == before
    finally:
        await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", STORES)
async def test_machine_token_stops_apply(kind: str, tmp_path: Path) -> None:
    """``StateMachine(cancel=token)`` ("a token that stops the run"; ``_machine``'s docs:
    "When the machine's CancelToken fires, the running step is cancelled"), driven by
    hand: the token firing while ``charge`` runs in ``apply`` stops it within seconds."""
    agent = Agent(approval=False)
    store = await prepared(kind, tmp_path)
    try:
        token = CancelToken()
        machine = StateMachine(agent.machine().steps, cancel=token)
        runtime = agent.runtime(store)
        session, decision, cycle = await to_the_charge(agent, machine, runtime)
        inside = anyio.Event()

        async def block() -> None:
            inside.set()
            await anyio.sleep_forever()

        agent.on_charge_start = block
        with anyio.move_on_after(5) as guard:
            async with anyio.create_task_group() as tasks:

                async def fire() -> None:
                    await inside.wait()
                    token.cancel("stop")

                tasks.start_soon(fire)
                await machine.apply(runtime, session, decision, cycle=cycle)
        assert not guard.cancelled_caught, "apply() ran on for 5 s after the token fired"
    finally:
        await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", STORES)
async def test_finalize_while_a_run_holds_the_session(kind: str, tmp_path: Path) -> None:
    agent = Agent(approval=False)
    store = await prepared(kind, tmp_path)
    try:
        machine = agent.machine()
        runtime = agent.runtime(store)
        inside, go = anyio.Event(), anyio.Event()

        async def block() -> None:
            inside.set()
            await go.wait()

        agent.on_charge_done = block
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(machine.run, runtime, "s")
            with anyio.fail_after(30):
                await inside.wait()
            try:
                with contextlib.suppress(SessionBusyError):
                    await machine.finalize(runtime, "s")
            finally:
                go.set()
        final = await store.load("s")
        assert len([e for e in agent.effects if e.startswith("charge")]) == 1
        assert charge_results(final.conversation) == ["charged 1"]
    finally:
        await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", STORES)
async def test_apply_cancelled_during_the_model_call_keeps_the_budget_exact(
    kind: str, tmp_path: Path
) -> None:
    """``Budget(per_session=Limits(model_calls=2))``: ``apply`` cancelled while the first
    request is with the model, then ``finalize``, then ``run()``: at most two requests
    reach the model in all, and the session stays valid."""
    agent = Agent(approval=False)
    store = await prepared(kind, tmp_path)
    try:
        inside = anyio.Event()
        received: list[int] = []

        async def slow_answer(request: Any) -> Any:
            received.append(1)
            if len(received) == 1:
                inside.set()
                await anyio.sleep_forever()
            return agent.answer(request)

        steps = [Budget(per_session=Limits(model_calls=2)), *agent.machine().steps]
        machine = StateMachine(steps)
        runtime = dataclasses.replace(agent.runtime(store), model=FunctionModel(slow_answer))
        session = await store.load("s")
        decision = await machine.step(runtime, session, cycle=1)
        assert decision is not None
        assert decision.step.name == "inference"
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tasks:

                async def cancel_when_inside() -> None:
                    await inside.wait()
                    scope.cancel()

                tasks.start_soon(cancel_when_inside)
                await machine.apply(runtime, session, decision, cycle=1)
        assert scope.cancelled_caught
        await machine.finalize(runtime, "s", interrupted=decision)
        report = await machine.run_report(runtime, "s")
        assert len(received) <= 2, received
        assert report.reason.kind == "budget_exhausted"
        assert history_problems((await store.load("s")).conversation) == []
    finally:
        await store.aclose()


def holder(kind: str, where: str, folder: Path) -> subprocess.Popen[str]:
    """A child whose run() holds the session inside charge until FOLDER/release exists."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]),
        "ATTACK34B_BACKEND": "asyncio",
    }
    child = HERE / "_attack34b_child.py"
    return subprocess.Popen(
        [sys.executable, str(child), "run", kind, where, "hold", str(folder), "9"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.anyio
@pytest.mark.parametrize("kind", STORES)
async def test_step_apply_beside_another_process_holding_the_session(
    kind: str, tmp_path: Path
) -> None:
    """As above, with the holder a separate process (``_attack34b_child.py run ... hold``)."""
    await (await prepared(kind, tmp_path)).aclose()
    where = str(tmp_path / ("db.sqlite3" if kind == "sqlite" else "store"))
    child = holder(kind, where, tmp_path)
    store = await open_store(kind, tmp_path)
    agent = Agent(approval=False)
    try:
        with anyio.fail_after(60):
            while not await anyio.Path(tmp_path / "inside").exists():
                assert child.poll() is None, child.communicate()
                await anyio.sleep(0.02)
        machine = agent.machine()
        runtime = agent.runtime(store, fixed_ids=False)
        try:
            session = await store.load("s")
            decision = await machine.step(runtime, session, cycle=1)
            if decision is not None:
                await machine.apply(runtime, session, decision, cycle=1)
        except (SessionBusyError, ConflictError):
            pass
        finally:
            await anyio.Path(tmp_path / "release").write_text("go")
        _, err = await anyio.to_thread.run_sync(lambda: child.communicate(timeout=60))
        assert child.returncode == 0, err[-3000:]
        final = await store.load("s")
        assert agent.effects == []  # the intruder ran nothing itself
        charges = [e for e in (tmp_path / "effects.txt").read_text().splitlines() if "charge" in e]
        assert len(charges) == 1
        assert charge_results(final.conversation) == ["charged 1"]
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
        await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", STORES)
async def test_a_non_idempotent_decision_applied_twice_runs_once(kind: str, tmp_path: Path) -> None:
    """The charge's decision applied, then applied again from the same (now stale)
    session, and decided again from it: ``ConflictError`` each time, one charge."""
    agent = Agent(approval=False)
    store = await prepared(kind, tmp_path)
    try:
        machine = agent.machine()
        runtime = agent.runtime(store, fixed_ids=False)
        session, decision, cycle = await to_the_charge(agent, machine, runtime)
        await machine.apply(runtime, session, decision, cycle=cycle)
        with pytest.raises(ConflictError):
            await machine.apply(runtime, session, decision, cycle=cycle)
        again = await machine.step(runtime, session, cycle=cycle)
        assert again is not None
        with pytest.raises(ConflictError):
            await machine.apply(runtime, session, again, cycle=cycle)
        assert len([e for e in agent.effects if e.startswith("charge")]) == 1
        assert charge_results((await store.load("s")).conversation) == ["charged 1"]
    finally:
        await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", STORES)
async def test_finalize_of_a_bad_session_id_says_so(kind: str, tmp_path: Path) -> None:
    from stepmachine import InvalidSessionIdError, SessionNotFoundError

    agent = Agent(approval=False)
    store = await prepared(kind, tmp_path)
    try:
        machine = agent.machine()
        runtime = agent.runtime(store)
        with pytest.raises(InvalidSessionIdError, match="may use only"):
            await machine.finalize(runtime, "../x")
        with pytest.raises(SessionNotFoundError, match="nosuch"):
            await machine.finalize(runtime, "nosuch")
    finally:
        await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", STORES)
async def test_an_idempotent_decision_applied_twice_runs_once(kind: str, tmp_path: Path) -> None:
    """Durable docs: "a call whose result is stored is never run again"."""
    agent = Agent(approval=False)
    store = await prepared(kind, tmp_path)
    try:
        machine = agent.machine()
        runtime = agent.runtime(store, fixed_ids=False)
        session = await store.load("s")
        first = await machine.step(runtime, session, cycle=1)
        assert first is not None
        session, _ = await machine.apply(runtime, session, first, cycle=1)
        decision = await machine.step(runtime, session, cycle=2)
        assert decision is not None
        assert decision.step.name == "tools"
        await machine.apply(runtime, session, decision, cycle=2)
        with contextlib.suppress(ConflictError):
            await machine.apply(runtime, session, decision, cycle=2)
        assert results_of((await store.load("s")).conversation)
        assert len(agent.effects) == 1, agent.effects
    finally:
        await store.aclose()
