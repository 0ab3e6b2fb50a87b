"""Attack 33: replay exactness when the user steers while the *model* answers.

The maintainers' test covers a message submitted while a tool runs. Here the user's
message lands while a budgeted model request is under way (its reservation written,
its reply not yet): the reply is recorded as calls only and the model is asked again,
all within one run. Replaying the same steps must see one run and report "same"; and
a concurrent tool batch whose records are split by a message submitted between them
must too.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from _attack33b_common import Clock

from stepmachine import (
    Annotate,
    AppendMessage,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    StateMachine,
    Step,
    Store,
    Tools,
    replay,
    submit,
    tool,
)
from stepmachine.extend import counter_ids
from stepmachine.operations import Budget, Limits
from stepmachine.testing import FunctionModel, call, reply


async def steered_session(store: Store, steps: list[Step[Any]], clock: Clock) -> None:
    """Session ``s``: the user asks "a"; while the model answers, the user adds "and b
    too"; the run drops the stale reply and asks again."""
    steered: list[bool] = []

    async def answer(request: ModelRequest) -> ModelResponse:
        if not steered:
            steered.append(True)
            steer = AppendMessage(Message.user("and b too", id="steer"))
            await submit(store, "s", [steer], clock=clock)
            return reply("a only")
        return reply("a and b")

    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("a", id="u1"))], clock=clock)
    runtime = Runtime(store=store, model=FunctionModel(answer), clock=clock, ids=counter_ids("r-"))
    await StateMachine(steps).run_report(runtime, "s")
    session = await store.load("s")
    assert [m.text for m in session.conversation] == ["a", "and b too", "a and b"]


@pytest.mark.parametrize("budgeted", [True, False], ids=["budget", "no-budget"])
async def test_steering_while_the_model_answers_replays_the_same(
    store: Store, budgeted: bool
) -> None:
    """Without a Budget the dropped reply's record is the cycle's first batch, after the
    user's message: the cycle still began before it (the record says so)."""

    def steps() -> list[Step[Any]]:
        budget: list[Step[Any]] = [Budget(per_run=Limits(model_calls=4))] if budgeted else []
        return [*budget, ModelInference()]

    await steered_session(store, steps(), Clock())
    report = await replay(store, "s", steps())
    assert [c.cycle for c in report.cycles] == [1, 2], str(report)
    assert len({c.run_start_revision for c in report.cycles}) == 1, str(report)
    assert report.same, str(report)


async def test_a_note_written_while_the_model_answers_replays_as_one_cycle(
    store: Store,
) -> None:
    """An outside batch that does not move the question (a note on the user's message):
    the reply is appended after it, in the same cycle (its receipt names the revision the
    request was built from), and the replay is one cycle, the same."""
    clock = Clock()
    noted: list[bool] = []

    async def answer(request: ModelRequest) -> ModelResponse:
        if not noted:
            noted.append(True)
            note = Annotate("u1", "app", {"seen": True})
            await submit(store, "s", [note], clock=clock)
        return reply("an answer")

    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("a", id="u1"))], clock=clock)
    runtime = Runtime(store=store, model=FunctionModel(answer), clock=clock, ids=counter_ids("r-"))
    await StateMachine([ModelInference()]).run_report(runtime, "s")
    log = await store.batches("s")
    assert [(b.step, b.cycle) for b in log] == [
        ("application", 0),
        ("application", 0),
        ("inference", 1),
    ]
    report = await replay(store, "s", [ModelInference()])
    assert [c.revision for c in report.cycles] == [3], str(report)
    assert report.cycles[0].run_start_revision == 1, str(report)
    assert report.same, str(report)


async def test_a_message_submitted_between_concurrent_records_replays_the_same(
    store: Store,
) -> None:
    clock = Clock()
    second = anyio.Event()

    @tool(side_effects="idempotent")
    async def fast(key: str) -> str:
        """Fast lookup."""
        return f"fast {key}"

    @tool(side_effects="idempotent")
    async def slow(key: str) -> str:
        """Slow lookup: the user writes while it runs, after fast's record."""
        session = await store.load("s")
        while not any(r.content == "fast a" for m in session.conversation for r in m.tool_results):
            await anyio.sleep(0.001)
            session = await store.load("s")
        if "steer" not in {m.id for m in session.conversation}:
            await submit(
                store, "s", [AppendMessage(Message.user("hurry", id="steer"))], clock=clock
            )
        second.set()
        return f"slow {key}"

    def steps() -> list[Step[Any]]:
        return [Budget(per_run=Limits(model_calls=4)), Tools([fast, slow]), ModelInference()]

    def answer(request: ModelRequest) -> ModelResponse:
        if request.messages[-1].id == "u1":
            return call(("fast", {"key": "a"}), ("slow", {"key": "b"}))
        return reply("done")

    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("go", id="u1"))], clock=clock)
    runtime = Runtime(store=store, model=FunctionModel(answer), clock=clock, ids=counter_ids("r-"))
    with anyio.fail_after(20):
        await StateMachine(steps()).run_report(runtime, "s")
    assert second.is_set()
    session = await store.load("s")
    assert session.conversation[-1].text == "done"
    report = await replay(store, "s", steps())
    assert len({c.run_start_revision for c in report.cycles}) == 1, str(report)
    assert report.same, str(report)
