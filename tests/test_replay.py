"""replay(): a stored session's decisions re-run against a new step list, with no side effects.

The stored histories come from real runs (a tool loop with an approval, a
budget, two runs around an ``approve()``); each test replays them against the
same or a changed list and checks where the report says the decisions first
differ. The hypothesis test replays random scripted tool-loop histories with
the same steps: they must all be the same.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import (
    AppendMessage,
    Batch,
    ConfigurationError,
    Effect,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Operation,
    Outcome,
    Refuse,
    Runtime,
    Session,
    SessionNotFoundError,
    StateMachine,
    Step,
    StepContext,
    Store,
    TextPart,
    Tool,
    ToolCallPart,
    Tools,
    counter_ids,
    submit,
    tool,
)
from stepmachine._replay import ReplayCycle, ReplayReport, replay
from stepmachine.operations import Approval, Budget, Limits, approve
from stepmachine.stores import MemoryStore
from stepmachine.testing import FunctionModel, ScriptedModel, call, reply


class Clock:
    """A clock that moves one second per reading."""

    def __init__(self) -> None:
        self._ticks = itertools.count(1_000)

    def __call__(self) -> float:
        return float(next(self._ticks))


@dataclass
class Calls:
    """Every tool execution, by tool name."""

    made: list[str] = field(default_factory=list)

    def tools(self) -> list[Tool]:
        @tool
        def lookup(key: str) -> str:
            """Look a key up."""
            self.made.append("lookup")
            return f"value of {key}"

        @tool(side_effects="idempotent")
        def delete(key: str) -> str:
            """Delete a key."""
            self.made.append("delete")
            return f"deleted {key}"

        return [lookup, delete]


def pipeline(
    calls: Calls,
    *,
    model_calls: int = 5,
    approve_tools: Sequence[str] = ("delete",),
    order: Sequence[str] = ("budget", "approval", "tools", "inference"),
) -> list[Step[Any]]:
    steps: dict[str, Step[Any]] = {
        "budget": Budget(per_run=Limits(model_calls=model_calls)),
        "approval": Approval(list(approve_tools)),
        "tools": Tools(calls.tools()),
        "inference": ModelInference(),
    }
    return [steps[name] for name in order]


TURNS = [
    call(("lookup", {"key": "a"})),
    call(("lookup", {"key": "b"}), ("delete", {"key": "a"})),
    reply("done"),
]


async def recorded(store: Store, calls: Calls) -> Session[Any]:
    """A stored session from real runs.

    Run 1: inference (calls lookup a), tools (intent, result), inference (calls
    lookup b and delete a), approval yields. ``approve()``. Run 2: tools (the
    intent of lookup b, then both results, in parallel), inference ("done").
    """
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("clean up", id="u1"))])
    runtime = Runtime(store=store, model=ScriptedModel(TURNS), clock=Clock(), ids=counter_ids())
    machine: StateMachine[Any] = StateMachine(pipeline(calls))
    first = await machine.run_report(runtime, "s")
    assert first.reason.kind == "awaiting_approval"
    await approve(store, "s", "call-1-1", by="ops", clock=Clock())
    second = await machine.run_report(runtime, "s")
    assert second.reason.kind == "done"
    assert sorted(calls.made) == ["delete", "lookup", "lookup"]
    return second.session


def by_step(report: ReplayReport) -> list[tuple[int, str]]:
    return [(c.cycle, c.stored_step) for c in report.cycles]


STORED_CYCLES = [
    (1, "inference"),
    (2, "tools"),
    (3, "inference"),
    (4, "approval"),
    (1, "tools"),
    (2, "inference"),
]


# -- the same steps ------------------------------------------------------------------


async def test_the_same_steps_decide_the_same_and_nothing_runs_or_is_written(
    store: Store,
) -> None:
    calls = Calls()
    session = await recorded(store, calls)
    log = await store.batches("s")
    executed = list(calls.made)

    report = await replay(store, "s", pipeline(calls))

    assert report.same, str(report)
    assert report.first_difference is None
    assert by_step(report) == STORED_CYCLES
    assert calls.made == executed  # no tool ran
    assert (await store.load("s")).revision == session.revision
    assert await store.batches("s") == log
    tools_cycles = [c for c in report.cycles if c.stored_step == "tools"]
    assert [len(c.stored) for c in tools_cycles] == [2, 3]  # intent + result; intents + 2 results
    assert [len(c.new) for c in tools_cycles] == [2, 3]
    # Per-run budgets count from the start of each stored run.
    starts = {c.run_start_revision for c in report.cycles}
    assert len(starts) == 2


async def test_run_boundaries_come_from_the_cycle_numbers(store: Store) -> None:
    calls = Calls()
    await recorded(store, calls)
    log = await store.batches("s")
    report = await replay(store, "s", pipeline(calls))
    run_one = [c for c in report.cycles[:4]]
    run_two = [c for c in report.cycles[4:]]
    assert {c.run_start_revision for c in run_one} == {log[0].revision}  # after the user message
    approved = next(b for b in log if b.step == "approval" and b.cycle == 0)
    assert {c.run_start_revision for c in run_two} == {approved.revision}


# -- changed pipelines --------------------------------------------------------------


async def test_a_smaller_budget_differs_where_it_now_stops(store: Store) -> None:
    calls = Calls()
    await recorded(store, calls)

    report = await replay(store, "s", pipeline(calls, model_calls=1))

    first = report.first_difference
    assert first is not None
    assert (first.cycle, first.stored_step) == (3, "inference")
    assert first.new_step is None
    assert "budget_exhausted" in first.difference
    assert all(c.same for c in report.cycles[:2])
    # Run 2 starts a new per-run count: its one model call is within the budget.
    assert report.cycles[-1].same, str(report)
    assert calls.made == ["lookup", "lookup", "delete"] or sorted(calls.made) == [
        "delete",
        "lookup",
        "lookup",
    ]


async def test_a_reordered_list_differs_where_the_order_matters(store: Store) -> None:
    calls = Calls()
    await recorded(store, calls)

    report = await replay(
        store, "s", pipeline(calls, order=("budget", "tools", "approval", "inference"))
    )

    first = report.first_difference
    assert first is not None, str(report)
    assert (first.cycle, first.stored_step, first.new_step) == (4, "approval", "tools")
    assert "annotate journal on call call-1-0" in first.difference  # lookup b's intent
    results = [
        part.content
        for batch in first.new
        for effect in batch
        if isinstance(effect, AppendMessage)
        for part in effect.message.tool_results
    ]
    assert results == ["value of b"]  # answered from the stored result; delete held back
    # Before it, the same decisions, though other steps refused on the way.
    earlier = report.cycles[:3]
    assert all(c.same for c in earlier)
    assert any(c.new_refused != c.stored_refused for c in earlier)


async def test_a_reordering_that_does_not_matter_is_the_same(store: Store) -> None:
    calls = Calls()
    await recorded(store, calls)
    report = await replay(
        store, "s", pipeline(calls, order=("approval", "budget", "tools", "inference"))
    )
    assert report.same, str(report)


async def test_a_tool_newly_needing_approval_differs_where_it_ran(store: Store) -> None:
    calls = Calls()
    await recorded(store, calls)

    report = await replay(store, "s", pipeline(calls, approve_tools=("delete", "lookup")))

    first = report.first_difference
    assert first is not None
    assert (first.cycle, first.stored_step, first.new_step) == (2, "tools", "approval")
    assert report.cycles[0].same


async def test_a_model_answering_differently_differs_at_its_first_answer(store: Store) -> None:
    calls = Calls()
    await recorded(store, calls)
    other = FunctionModel(lambda request: reply("I will not touch anything"))

    report = await replay(store, "s", pipeline(calls), model=other)

    first = report.first_difference
    assert first is not None
    assert (first.revision, first.cycle, first.stored_step, first.new_step) == (
        2,
        1,
        "inference",
        "inference",
    )
    assert "I will not touch anything" in first.difference
    assert other.calls >= 1


async def test_a_model_answering_the_same_is_the_same(store: Store) -> None:
    calls = Calls()
    await recorded(store, calls)
    report = await replay(store, "s", pipeline(calls), model=ScriptedModel(TURNS))
    assert report.same, str(report)
