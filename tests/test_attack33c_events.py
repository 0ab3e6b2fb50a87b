"""Attack 33c: unchanged pipelines on sessions made by messages submitted at odd moments
(while the model answers, while a tool runs, two in a row), with and without a Budget's
reservation, and forks of them taken at every revision and resumed: replay must say same.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from _attack33b_common import Clock

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
from stepmachine.operations import Budget, Limits
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore
from stepmachine.testing import FunctionModel, call, reply


@pytest.fixture(params=["memory", "sqlite", "file"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield MemoryStore()
        return
    made: Any = (
        await SQLiteStore.open(tmp_path / "db.sqlite3")
        if request.param == "sqlite"
        else await FileStore.open(tmp_path / "files")
    )
    try:
        yield made
    finally:
        await made.aclose()


class Scenario:
    """One session: the user asks; the model calls ``lookup`` (optionally while the user
    steers, ``model_steers`` times); the tool runs while the user sends ``tool_steers``
    messages; the model answers."""

    def __init__(
        self, store: Any, *, budget: bool, stream: bool, model_steers: int, tool_steers: int
    ) -> None:
        self.store = store
        self.budget = budget
        self.stream = stream
        self.model_steers = model_steers
        self.tool_steers = tool_steers
        self.clock = Clock()
        self.sid = "s"
        self.sent = 0

    def steps(self) -> list[Step[Any]]:
        scenario = self

        @tool(side_effects="idempotent")
        async def lookup(q: str) -> str:
            """Look something up."""
            for n in range(scenario.tool_steers):
                await scenario.steer(f"tool {n}")
            scenario.tool_steers = 0  # only the first run's tool steers
            return f"found {q}"

        budget: list[Step[Any]] = [Budget(per_run=Limits(model_calls=20))] if self.budget else []
        return [*budget, Tools([lookup]), ModelInference(stream=self.stream)]

    async def steer(self, text: str) -> None:
        self.sent += 1
        message = Message.user(text, id=f"m{self.sent}")
        await submit(self.store, self.sid, [AppendMessage(message)], clock=self.clock)

    async def answer(self, request: ModelRequest) -> ModelResponse:
        if not any(m.role == "tool" for m in request.messages):
            if self.model_steers:
                self.model_steers -= 1
                await self.steer("while the model answers")
                return call(("lookup", {"q": "stale"}))
            return call(("lookup", {"q": "x"}))
        return reply("final")

    async def run(self, sid: str = "s", ids: str = "r-") -> None:
        self.sid = sid
        runtime = Runtime(
            store=self.store,
            model=FunctionModel(self.answer),
            clock=self.clock,
            ids=counter_ids(ids),
        )
        report = await StateMachine(self.steps()).run_report(runtime, sid)
        assert report.reason.kind in ("done", "idle"), report.reason

    async def make(self) -> None:
        await self.store.create("s")
        await submit(
            self.store, "s", [AppendMessage(Message.user("go", id="u1"))], clock=self.clock
        )
        await self.run()


CASES = [
    pytest.param({"model_steers": 1, "tool_steers": 0}, id="steer-model"),
    pytest.param({"model_steers": 2, "tool_steers": 0}, id="steer-model-twice"),
    pytest.param({"model_steers": 0, "tool_steers": 1}, id="steer-tool"),
    pytest.param({"model_steers": 0, "tool_steers": 2}, id="steer-tool-twice"),
    pytest.param({"model_steers": 1, "tool_steers": 2}, id="steer-both"),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("budget", [True, False], ids=["budget", "nobudget"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "block"])
async def test_steered_sessions_replay_the_same(
    store: Any, case: dict[str, int], budget: bool, stream: bool
) -> None:
    scenario = Scenario(store, budget=budget, stream=stream, **case)
    await scenario.make()
    session = await store.load("s")
    assert session.conversation[-1].text == "final"
    report = await replay(store, "s", scenario.steps())
    assert report.same, str(report)


def fork_case(case: dict[str, int], budget: bool, name: str) -> Any:
    return pytest.param(case, budget, id=name)


FORK_CASES = [
    fork_case({"model_steers": 1, "tool_steers": 0}, True, "budget-steer-model"),
    fork_case({"model_steers": 2, "tool_steers": 0}, True, "budget-steer-model-twice"),
    fork_case({"model_steers": 1, "tool_steers": 0}, False, "nobudget-steer-model"),
    fork_case({"model_steers": 2, "tool_steers": 0}, False, "nobudget-steer-model-twice"),
    fork_case({"model_steers": 0, "tool_steers": 1}, True, "budget-steer-tool"),
    fork_case({"model_steers": 0, "tool_steers": 2}, True, "budget-steer-tool-twice"),
    fork_case({"model_steers": 1, "tool_steers": 2}, True, "budget-steer-both"),
    fork_case({"model_steers": 0, "tool_steers": 1}, False, "nobudget-steer-tool"),
    fork_case({"model_steers": 0, "tool_steers": 2}, False, "nobudget-steer-tool-twice"),
    fork_case({"model_steers": 1, "tool_steers": 2}, False, "nobudget-steer-both"),
]


async def test_a_fork_after_a_message_sent_while_the_tool_ran_resumed_is_the_same(
    tmp_path: Path,
) -> None:
    """Minimal: user message; the model calls lookup; while lookup runs the user sends a
    message (revision 3); fork at 3 and resume the fork with the same steps."""
    store = await SQLiteStore.open(tmp_path / "db.sqlite3")
    try:
        scenario = Scenario(store, budget=False, stream=False, model_steers=0, tool_steers=1)
        await scenario.make()
        log = await store.batches("s")
        assert [b.step for b in log][:3] == ["application", "inference", "application"]
        await store.fork("s", 3, "f")
        await scenario.run("f", ids="f-")
        report = await replay(store, "f", scenario.steps())
        assert report.same, str(report)
    finally:
        await store.aclose()


@pytest.mark.parametrize(("case", "budget"), FORK_CASES)
async def test_forks_at_every_revision_resumed_replay_the_same(
    tmp_path: Path, case: dict[str, int], budget: bool
) -> None:
    store = await SQLiteStore.open(tmp_path / "db.sqlite3")
    try:
        scenario = Scenario(store, budget=budget, stream=False, **case)
        await scenario.make()
        top = (await store.load("s")).revision
        failures: list[str] = []
        for revision in range(1, top + 1):
            fork = f"f{revision}"
            await store.fork("s", revision, fork)
            scenario.clock.now += 1000
            await scenario.run(fork, ids=f"{fork}-")
            report = await replay(store, fork, scenario.steps())
            if not report.same:
                failures.append(f"fork at {revision}:\n{report}")
        assert not failures, "\n".join(failures)
    finally:
        await store.aclose()
