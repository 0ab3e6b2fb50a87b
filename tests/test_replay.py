"""replay(): a stored session's decisions re-run against a new step list, with no side effects.

The stored histories come from real runs (a tool loop with an approval, a
budget, two runs around an ``approve()``); each test replays them against the
same or a changed list and checks where the report says the decisions first
differ. The hypothesis test replays random scripted tool-loop histories with
the same steps: they must all be the same.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import (
    Annotate,
    AppendMessage,
    CancelToken,
    ConfigurationError,
    Continue,
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
    Yield,
    submit,
    tool,
)
from stepmachine._replay import ReplayReport, replay
from stepmachine.extend import FINALIZE_STEP, INTERRUPTED, YieldReason, counter_ids
from stepmachine.operations import Approval, Budget, Limits, approve
from stepmachine.stores import MemoryStore
from stepmachine.testing import FunctionModel, ScriptedModel, call, reply

# Steps written for earlier releases still commit through ctx.commit: it works, with a
# DeprecationWarning (test_machine.py checks the warning itself).
pytestmark = pytest.mark.filterwarnings(
    "ignore:StepContext.commit is deprecated:DeprecationWarning"
)


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
    clock = Clock()
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("clean up", id="u1"))], clock=clock)
    runtime = Runtime(store=store, model=ScriptedModel(TURNS), clock=clock, ids=counter_ids())
    machine: StateMachine[Any] = StateMachine(pipeline(calls))
    first = await machine.run_report(runtime, "s")
    assert first.reason.kind == "awaiting_approval"
    await approve(store, "s", "call-1-1", by="ops", clock=clock)
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
    run_one = report.cycles[:4]
    run_two = report.cycles[4:]
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
    assert first.new_step == "budget"  # its yield records the refusal on the last message
    assert "annotate budget" in first.difference
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


# -- what a replay cannot reproduce ---------------------------------------------------


class Raises(Operation[Any]):
    """Raises in the cycle that starts from revision ``at``; refuses otherwise."""

    def __init__(self, at: int) -> None:
        self.at = at

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        if ctx.session.revision == self.at:
            raise ValueError("boom")
        return Refuse("not now")


class AsksTheModel(Operation[Any]):
    """Asks the model for a word whenever a tool call is open (and appends nothing)."""

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        if not ctx.session.history.has_open_calls:
            return Refuse("no open call")
        request = ModelRequest(messages=(Message.user("a word?", id="q"),))
        await ctx.runtime.get_model().request(request)
        return Refuse("asked")


async def test_a_step_that_raises_is_that_cycles_difference_and_the_replay_goes_on(
    store: Store,
) -> None:
    calls = Calls()
    await recorded(store, calls)

    # The first cycle (inference, budgeted) wrote revisions 2 (its reservation) and 3.
    report = await replay(store, "s", [Raises(at=3), *pipeline(calls)])

    assert [c.same for c in report.cycles] == [True, False, True, True, True, True]
    first = report.first_difference
    assert first is not None
    assert first.revision == 4
    assert first.new_step is None
    assert first.difference == "the new pipeline raises ValueError: boom"


async def test_a_model_call_where_the_history_has_none_is_a_difference(store: Store) -> None:
    calls = Calls()
    await recorded(store, calls)

    report = await replay(store, "s", [AsksTheModel(), *pipeline(calls)])

    first = report.first_difference
    assert first is not None
    assert (first.cycle, first.stored_step) == (2, "tools")
    assert "calls the model here" in first.difference
    assert "'tools'" in first.difference
    assert report.cycles[0].same


async def test_a_tool_call_without_a_recorded_result_is_answered_with_an_error(
    store: Store,
) -> None:
    calls = Calls()
    clock = Clock()
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("clean up", id="u1"))], clock=clock)
    runtime = Runtime(store=store, model=ScriptedModel(TURNS), clock=clock, ids=counter_ids())
    report = await StateMachine(pipeline(calls)).run_report(runtime, "s")
    assert report.reason.kind == "awaiting_approval"  # delete never ran, lookup b neither
    executed = list(calls.made)

    replayed = await replay(store, "s", pipeline(calls, approve_tools=()))

    first = replayed.first_difference
    assert first is not None
    assert (first.cycle, first.stored_step, first.new_step) == (4, "approval", "tools")
    assert "no recorded result for tool call(s) 'call-1-0' (lookup), 'call-1-1' (delete)" in (
        first.difference  # in call id order, whatever order they ran in
    )
    assert calls.made == executed


class Greets(Operation[Any]):
    """Before the model answers, appends the greeting ``services["greeting"]`` (once)."""

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        if len(ctx.session.conversation) != 1:
            return Refuse("greets the first message only")
        text = ctx.runtime.services["greeting"]
        return Continue([AppendMessage(Message.user(text, id=ctx.new_id()))])


async def test_services_reach_the_replayed_steps(store: Store) -> None:
    clock = Clock()
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("hi", id="u1"))], clock=clock)
    runtime = Runtime(
        store=store,
        model=ScriptedModel(["hello"]),
        clock=clock,
        ids=counter_ids(),
        services={"greeting": "welcome"},
    )
    await StateMachine([Greets(), ModelInference()]).run(runtime, "s")

    same = await replay(store, "s", [Greets(), ModelInference()], services={"greeting": "welcome"})
    other = await replay(store, "s", [Greets(), ModelInference()], services={"greeting": "hey"})

    assert same.same, str(same)
    first = other.first_difference
    assert first is not None
    assert first.stored_step == "Greets"
    assert "'welcome' -> 'hey'" in first.difference


async def test_an_unknown_session_and_a_store_without_a_log_are_refused(store: Store) -> None:
    with pytest.raises(SessionNotFoundError):
        await replay(store, "missing", pipeline(Calls()))

    class LoadOnly:
        async def load(self, session_id: str) -> Session[Any]:
            return await store.load(session_id)

    await store.create("s")
    with pytest.raises(ConfigurationError, match="batches"):
        await replay(LoadOnly(), "s", pipeline(Calls()))


async def test_a_session_without_machine_cycles_replays_to_an_empty_same_report(
    store: Store,
) -> None:
    clock = Clock()
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("hi", id="u1"))], clock=clock)
    report = await replay(store, "s", pipeline(Calls()))
    assert report.cycles == ()
    assert report.same


class NoteTaker(Operation[Any]):
    """After the model's final reply: commits a hidden note message, then annotates it.

    The annotation names the message the step added earlier in the same cycle,
    so the replay must give it the id the stored cycle gave it.
    """

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        last = ctx.session.conversation[-1]
        if last.role != "assistant" or last.tool_calls:
            return Refuse("not after a final reply")
        note = Message(
            id=ctx.new_id(), role="user", parts=(TextPart("noted"),), visible_to_model=False
        )
        await ctx.commit([AppendMessage(note)])
        return Yield([Annotate(note.id, "notes", {"seen": last.id})], YieldReason("done"))


async def test_a_step_referring_to_a_message_it_added_in_the_cycle_replays_the_same(
    store: Store,
) -> None:
    clock = Clock()
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("hi", id="u1"))], clock=clock)
    runtime = Runtime(store=store, model=ScriptedModel(["hello"]), clock=clock, ids=counter_ids())
    machine: StateMachine[Any] = StateMachine([NoteTaker(), ModelInference()])
    await machine.run(runtime, "s")  # inference yields done: the note comes in the next run
    await machine.run(runtime, "s")

    report = await replay(store, "s", [NoteTaker(), ModelInference()])

    assert [(c.stored_step, len(c.stored)) for c in report.cycles] == [
        ("inference", 1),
        ("NoteTaker", 2),
    ]
    assert report.same, str(report)


async def test_a_cancelled_cycle_differs_and_its_finalize_batch_is_not_replayed(
    store: Store,
) -> None:
    token = CancelToken()

    @tool
    async def slow() -> str:
        """Never finishes: cancels its own run."""
        token.cancel("enough")
        await anyio.sleep_forever()
        return "unreachable"

    def steps() -> list[Step[Any]]:
        return [Tools([slow]), ModelInference()]

    clock = Clock()
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("go", id="u1"))], clock=clock)
    turns = [call(("slow", {})), reply("fine")]
    runtime = Runtime(store=store, model=ScriptedModel(turns), clock=clock, ids=counter_ids())
    cancelled = await StateMachine(steps(), cancel=token).run_report(runtime, "s")
    assert cancelled.reason.kind == "cancelled"
    done = await StateMachine(steps()).run_report(runtime, "s")
    assert done.reason.kind == "done"
    log = await store.batches("s")
    assert [b.step for b in log] == [
        "application",
        "inference",
        "tools",  # the intent
        FINALIZE_STEP,  # "interrupted" answers the call
        "inference",
    ]

    report = await replay(store, "s", steps())

    assert [(c.cycle, c.stored_step, c.same) for c in report.cycles] == [
        (1, "inference", True),
        (2, "tools", False),  # the replayed tool "returns" its recorded (interrupted) result
        (1, "inference", True),
    ]
    assert "an extra batch 2" in report.cycles[1].difference
    assert INTERRUPTED[:20] in report.cycles[1].difference


# -- invariant: the same steps replay the same ---------------------------------------


def planned_model(plan: list[list[tuple[str, int]]]) -> FunctionModel:
    """Answers the n-th assistant turn with plan[n]'s tool calls, then "done"."""

    def answer(request: ModelRequest) -> ModelResponse:
        turn = sum(1 for m in request.messages if m.role == "assistant")
        if turn >= len(plan):
            return reply(f"done after {turn} turns")
        parts: list[ToolCallPart] = []
        for index, (name, value) in enumerate(plan[turn]):
            call_id = f"t{turn}-{index}"
            if name == "broken":
                parts.append(ToolCallPart.parse(call_id, "pure", "{not json"))
            else:
                parts.append(ToolCallPart.of(call_id, name, {"n": value}))
        return ModelResponse(parts=(TextPart(f"turn {turn}"), *parts), finish_reason="tool_calls")

    return FunctionModel(answer)


def random_tools(made: list[str]) -> list[Tool]:
    @tool(side_effects="pure")
    async def pure(n: int) -> str:
        """Pure."""
        made.append("pure")
        return f"pure {n}"

    @tool(side_effects="idempotent")
    def idem(n: int) -> str:
        """Idempotent."""
        made.append("idem")
        return f"idem {n}"

    @tool
    def once(n: int) -> str:
        """Not idempotent."""
        made.append("once")
        return f"once {n}"

    @tool(side_effects="pure")
    def fails(n: int) -> str:
        """Raises."""
        made.append("fails")
        raise RuntimeError(f"fails {n}")

    return [pure, idem, once, fails]


TOOL_NAMES = ["pure", "idem", "once", "fails", "nope", "broken"]


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    plan=st.lists(
        st.lists(st.tuples(st.sampled_from(TOOL_NAMES), st.integers(0, 9)), max_size=3),
        min_size=1,
        max_size=4,
    ),
    concurrency=st.sampled_from([1, 8]),
    model_calls=st.integers(1, 6),
    approve_once=st.booleans(),
    turns=st.integers(1, 3),
)
async def test_random_histories_replay_the_same_with_the_same_steps(
    anyio_backend: str,
    plan: list[list[tuple[str, int]]],
    concurrency: int,
    model_calls: int,
    approve_once: bool,
    turns: int,
) -> None:
    store = MemoryStore()
    made: list[str] = []

    def steps() -> list[Step[Any]]:
        return [
            Budget(per_run=Limits(model_calls=model_calls)),
            Approval(["once"] if approve_once else []),
            Tools(random_tools(made), max_concurrency=concurrency),
            ModelInference(),
        ]

    clock = Clock()
    runtime = Runtime(store=store, model=planned_model(plan), clock=clock, ids=counter_ids())
    await store.create("p")
    for turn in range(turns):
        await submit(
            store, "p", [AppendMessage(Message.user(f"go {turn}", id=f"u{turn}"))], clock=clock
        )
        for _ in range(4):  # runs until done, resuming after budgets and approvals
            report = await StateMachine(steps()).run_report(runtime, "p")
            if report.reason.kind == "done":
                break
            if report.reason.kind == "awaiting_approval":
                for pending in report.reason.data["calls"]:
                    await approve(store, "p", pending["call_id"], by="ops", clock=clock)
    executed = list(made)
    log = await store.batches("p")

    replayed = await replay(store, "p", steps())

    assert replayed.same, str(replayed)
    assert replayed.cycles
    assert made == executed
    assert await store.batches("p") == log
