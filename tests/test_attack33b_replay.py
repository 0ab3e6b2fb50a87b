"""Attack 33b: replay after the fix that groups an inference record by the revision its
request was built from (a message submitted while the model answers no longer splits the
run or reads as a difference).

Variants: a steer while the model answers *after a tool result* (with ``Tools``), two
steers in a row, blocking and streaming, a fork of a steered session replayed (whole and
continued), and changed pipelines that must read as a difference (a lower per-run
budget that the dropped reply's call exhausts, a tool approval).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from _attack33b_common import Clock, finish_text, kill, reap_children, start_child, wait_for
from _attack33b_replay_child import pipeline

from stepmachine import (
    AppendMessage,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    StateMachine,
    Step,
    Tools,
    replay,
    submit,
    tool,
)
from stepmachine.extend import counter_ids
from stepmachine.operations import Approval, Budget, Limits
from stepmachine.stores import FileStore, SQLiteStore
from stepmachine.testing import FunctionModel, call, reply


@tool(side_effects="idempotent")
def lookup(q: str) -> str:
    """Look something up."""
    return f"found {q}"


def steps(*, calls: int = 10, stream: bool = True, approve: bool = False) -> list[Step[Any]]:
    approval: list[Step[Any]] = [Approval(frozenset({"lookup"}))] if approve else []
    return [
        Budget(per_run=Limits(model_calls=calls)),
        *approval,
        Tools([lookup]),
        ModelInference(stream=stream),
    ]


@pytest.fixture(autouse=True)
def _reap() -> Any:
    yield
    reap_children()


@pytest.fixture(params=["sqlite", "file"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    made: Any = (
        await SQLiteStore.open(tmp_path / "db.sqlite3")
        if request.param == "sqlite"
        else await FileStore.open(tmp_path / "files")
    )
    try:
        yield made
    finally:
        await made.aclose()


async def steered_tool_session(store: Any, *, steers: int, stream: bool, sid: str = "s") -> int:
    """The user asks; the model calls ``lookup``; while it answers the tool result, the
    user steers ``steers`` times (one per answer, each answer dropped); then the model
    answers. Returns the model calls made."""
    clock = Clock()
    made: list[int] = []

    async def answer(request: ModelRequest) -> ModelResponse:
        made.append(1)
        last = request.messages[-1]
        if last.role == "user" and last.id == "u1":
            return call(("lookup", {"q": "x"}))
        done = sum(1 for m in request.messages if m.role == "user" and m.id != "u1")
        if done < steers:
            steer = Message.user(f"also {done}", id=f"steer{done}")
            await submit(store, sid, [AppendMessage(steer)], clock=clock)
            return reply(f"stale {done}")
        return reply("final")

    await store.create(sid)
    await submit(store, sid, [AppendMessage(Message.user("go", id="u1"))], clock=clock)
    runtime = Runtime(store=store, model=FunctionModel(answer), clock=clock, ids=counter_ids("r-"))
    report = await StateMachine(steps(stream=stream)).run_report(runtime, sid)
    assert report.reason.kind == "done"
    session = await store.load(sid)
    texts = [m.text for m in session.conversation if m.role in ("user", "assistant") and m.text]
    assert texts == ["go", *[f"also {n}" for n in range(steers)], "final"], texts
    return len(made)


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "blocking"])
@pytest.mark.parametrize("steers", [1, 2])
async def test_a_steer_after_a_tool_result_replays_as_one_run_the_same(
    store: Any, steers: int, stream: bool
) -> None:
    await steered_tool_session(store, steers=steers, stream=stream)
    report = await replay(store, "s", steps(stream=stream))
    assert len({c.run_start_revision for c in report.cycles}) == 1, str(report)
    assert report.same, str(report)


@pytest.mark.parametrize("steers", [1, 2])
async def test_a_budget_the_dropped_replies_exhaust_is_a_difference(
    store: Any, steers: int
) -> None:
    made = await steered_tool_session(store, steers=steers, stream=True)
    assert made == 2 + steers
    # One call fewer than the run made: the new pipeline stops before the final answer.
    report = await replay(store, "s", steps(calls=made - 1))
    assert not report.same, str(report)
    assert report.first_difference is not None
    assert report.first_difference.new_step == "budget", str(report)


async def test_an_approval_of_the_tool_is_a_difference(store: Any) -> None:
    await steered_tool_session(store, steers=1, stream=True)
    report = await replay(store, "s", steps(approve=True))
    assert not report.same, str(report)


def answer_fork(request: ModelRequest) -> ModelResponse:
    last = request.messages[-1]
    if last.role == "user" and last.id == "u1":
        return call(("lookup", {"q": "x"}))
    return reply("final")


@pytest.mark.parametrize(
    "at",
    [
        "after_tool",
        "after_steer",
        "end",
    ],
)
async def test_a_fork_of_a_steered_session_resumed_replays_the_same(store: Any, at: str) -> None:
    """A fork taken at a revision of the steered run, resumed by a run of the unchanged
    pipeline (and at the end, given a new turn), replays the same."""
    await steered_tool_session(store, steers=1, stream=True)
    log = await store.batches("s")
    session = await store.load("s")
    if at == "end":
        revision = session.revision
    elif at == "after_tool":
        revision = next(b.revision for b in log if b.step == "tools")
    else:
        revision = next(b.revision for b in log if b.step == "application" and b.revision > 2)
    await store.fork("s", revision, "f")
    clock = Clock()
    clock.now = 5_000.0
    if at == "end":
        await submit(store, "f", [AppendMessage(Message.user("more", id="u9"))], clock=clock)
    runtime = Runtime(
        store=store, model=FunctionModel(answer_fork), clock=clock, ids=counter_ids("f-")
    )
    run = await StateMachine(steps()).run_report(runtime, "f")
    assert run.reason.kind == "done"
    report = await replay(store, "f", steps())
    assert report.same, str(report)


@pytest.mark.parametrize("hang", ["model", "tool", "model2"])
def test_a_run_killed_mid_cycle_then_resumed_replays_the_same(tmp_path: Path, hang: str) -> None:
    """SIGKILL while the model answers (after the budget's reservation) or while the tool
    runs (after its intent), then a fresh process resumes and finishes: the session is
    what an unchanged pipeline makes, so its replay must be the same."""
    db = tmp_path / "db.sqlite3"
    marker = tmp_path / "marker"
    child = start_child("_attack33b_replay_child.py", str(db), hang, str(marker))
    wait_for(marker.exists, what=f"the child stopped in {hang}")
    kill(child)
    assert finish_text(start_child("_attack33b_replay_child.py", str(db), "none", str(marker)))

    async def check() -> None:
        async with await SQLiteStore.open(db) as store:
            session = await store.load("s")
            assert session.conversation[-1].text == "final"
            report = await replay(store, "s", pipeline())
            assert report.same, str(report)

    anyio.run(check)


@pytest.mark.parametrize("hang", ["model", "model2"])
def test_a_changed_budget_on_a_run_killed_mid_cycle_still_differs(
    tmp_path: Path, hang: str
) -> None:
    """A run cut by a crash replays as the same only where the new steps decide as it did:
    a per-run budget of one model call stops the call after the first of its run (a
    reservation's size itself is not compared: see ``_replay_compare``)."""
    db = tmp_path / "db.sqlite3"
    marker = tmp_path / "marker"
    child = start_child("_attack33b_replay_child.py", str(db), hang, str(marker))
    wait_for(marker.exists, what=f"the child stopped in {hang}")
    kill(child)
    assert finish_text(start_child("_attack33b_replay_child.py", str(db), "none", str(marker)))

    async def check() -> None:
        async with await SQLiteStore.open(db) as store:
            report = await replay(store, "s", pipeline(calls=1))
            first = report.first_difference
            assert first is not None, str(report)
            assert first.new_step == "budget", str(report)
            assert first.stored_step == "inference", str(report)

    anyio.run(check)
