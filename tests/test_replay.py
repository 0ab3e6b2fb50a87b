"""replay(): a stored session's decisions re-run against a new step list, with no side effects.

The stored histories come from real runs (a tool loop with an approval, a
budget, two runs around an ``approve()``); each test replays them against the
same or a changed list and checks where the report says the decisions first
differ. The hypothesis test replays random scripted tool-loop histories with
the same steps: they must all be the same.
"""

from __future__ import annotations

import hashlib
import itertools
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import make_golden_sqlite as golden
import msgspec
import pytest
from _scans import CountingConversation, counted, tool_loop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import (
    Annotate,
    AppendMessage,
    CancelToken,
    ConfigurationError,
    ContextLengthError,
    Continue,
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
    SetVisibility,
    StateMachine,
    Step,
    StepContext,
    Store,
    StoredDataError,
    TextPart,
    Tool,
    ToolCallPart,
    ToolResultPart,
    Tools,
    Yield,
    resolve_unknown_outcome,
    submit,
    tool,
)
from stepmachine._records import TAG_FIELD
from stepmachine._replay import ReplayReport, replay
from stepmachine.extend import (
    FINALIZE_STEP,
    INTERRUPTED,
    JOURNAL,
    Batch,
    InferenceReceipt,
    JournalEntry,
    Lease,
    LeaseHolder,
    YieldReason,
    counter_ids,
    idempotency_key,
    journal_entry,
)
from stepmachine.operations import (
    Approval,
    Budget,
    Compaction,
    ExternalEvents,
    HistoryGuard,
    InvalidCalls,
    Limits,
    approve,
    deny,
    submit_event,
)
from stepmachine.stores import MemoryStore, SQLiteStore
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


class ClockReplay:
    """A clock that moves one second per reading."""

    def __init__(self, start: float = 1_000) -> None:
        self._ticks = itertools.count(start)

    def __call__(self) -> float:
        return float(next(self._ticks))


class Made:
    """Every tool execution, by tool name."""

    def __init__(self) -> None:
        self.made: list[str] = []

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


def agent(made: Made, *, approve_tools: Sequence[str] = ("delete",)) -> list[Step[Any]]:
    return [
        Budget(per_run=Limits(model_calls=10)),
        Approval(list(approve_tools)),
        Tools(made.tools()),
        ModelInference(),
    ]


RUNS = itertools.count(1)


async def run_turns(
    store: Store, session_id: str, turns: list[Any], steps: list[Step[Any]], clock: ClockReplay
) -> None:
    ids = counter_ids(f"{session_id}-r{next(RUNS)}-")
    runtime = Runtime(store=store, model=ScriptedModel(turns), clock=clock, ids=ids)
    await StateMachine(steps).run_report(runtime, session_id)


async def tool_session(store: Store, made: Made, session_id: str = "s") -> Session[Any]:
    """A user message, a lookup, a reply: stored by a real run."""
    clock = ClockReplay()
    await store.create(session_id)
    user = Message.user("look a up", id=f"{session_id}-u1")
    await submit(store, session_id, [AppendMessage(user)], clock=clock)
    turns = [call(("lookup", {"key": "a"})), reply("a is a value")]
    await run_turns(store, session_id, turns, agent(made), clock)
    return await store.load(session_id)


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_a_replay_leaves_the_sqlite_file_byte_for_byte_unchanged(tmp_path: Path) -> None:
    """Not only the batches: nothing at all is written to the database (no snapshot, no lease)."""
    path = tmp_path / "db.sqlite3"
    store = await SQLiteStore.open(path)
    made = Made()
    try:
        await tool_session(store, made)
    finally:
        await store.aclose()

    def digest() -> dict[str, str]:
        return {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(tmp_path.iterdir())
            if p.is_file()
        }

    before = digest()
    store = await SQLiteStore.open(path)
    try:
        opened = digest()
        report = await replay(store, "s", agent(made))
        assert report.same, str(report)
        assert digest() == opened
    finally:
        await store.aclose()
    assert made.made == ["lookup"]
    assert set(before) <= set(digest())


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_a_step_committing_through_ctx_commit_writes_only_to_the_sandbox(
    store: Store,
) -> None:
    made = Made()
    session = await tool_session(store, made)
    log = await store.batches("s")

    class Noter(Operation[Any]):
        name = "noter"

        async def run(self, ctx: StepContext[Any]) -> Outcome:
            await ctx.commit([AppendMessage(Message.user("sneaked in", id=ctx.new_id()))])
            return Continue([])

    report = await replay(store, "s", [Noter(), *agent(made)])
    assert not report.same
    assert all(c.new_step == "noter" for c in report.cycles)
    assert (await store.load("s")).revision == session.revision
    assert await store.batches("s") == log
    assert made.made == ["lookup"]


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_a_step_reaching_for_runtime_store_finds_none(store: Store) -> None:
    """A step writing through ``ctx.runtime.store`` directly cannot reach the real store."""
    made = Made()
    session = await tool_session(store, made)

    class Direct(Operation[Any]):
        name = "direct"

        async def run(self, ctx: StepContext[Any]) -> Outcome:
            assert ctx.runtime.store is None
            assert ctx.runtime.http is None
            return Refuse("looked")

    report = await replay(store, "s", [Direct(), *agent(made)])
    assert report.same, str(report)
    assert (await store.load("s")).revision == session.revision


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_a_thread_tool_and_an_async_tool_never_run(store: Store) -> None:
    ran: list[str] = []

    @tool(thread=True)
    def lookup(key: str) -> str:
        """Look a key up (in a worker thread)."""
        ran.append("thread")
        return f"value of {key}"

    clock = ClockReplay()
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("go", id="u1"))], clock=clock)
    steps: list[Step[Any]] = [Tools([lookup]), ModelInference()]
    await run_turns(store, "s", [call(("lookup", {"key": "a"})), reply("ok")], steps, clock)
    assert ran == ["thread"]

    report = await replay(store, "s", [Tools([lookup]), ModelInference()])
    assert report.same, str(report)
    assert ran == ["thread"]


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_a_hanging_step_is_cancelled_from_outside_and_nothing_is_written(
    store: Store,
) -> None:
    made = Made()
    session = await tool_session(store, made)
    log = await store.batches("s")
    entered = anyio.Event()

    class Hangs(Operation[Any]):
        name = "hangs"

        async def run(self, ctx: StepContext[Any]) -> Outcome:
            await ctx.commit([AppendMessage(Message.user("half", id=ctx.new_id()))])
            entered.set()
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:

            async def cancel_when_entered() -> None:
                await entered.wait()
                scope.cancel()

            tg.start_soon(cancel_when_entered)
            await replay(store, "s", [Hangs(), *agent(made)])
    assert scope.cancelled_caught
    assert (await store.load("s")).revision == session.revision
    assert await store.batches("s") == log


# -- bad input --------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_an_empty_or_repeated_step_list_is_a_configuration_error(store: Store) -> None:
    made = Made()
    await tool_session(store, made)
    with pytest.raises(ConfigurationError):
        await replay(store, "s", [])
    with pytest.raises(ConfigurationError):
        await replay(store, "s", [Tools(made.tools()), Tools(made.tools())])


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_an_unknown_session_is_not_found(store: Store) -> None:
    with pytest.raises(SessionNotFoundError):
        await replay(store, "nope", [ModelInference()])


# -- false "different" / false "same" ------------------------------------------------


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_a_call_id_reused_after_the_first_was_hidden_replays_the_same(
    store: Store,
) -> None:
    """Providers that number calls per turn reuse ids; hidden history allows it.

    Run 1 calls lookup("a") as ``call-0-0``; the application hides that
    exchange from the model; run 2 (a new process: a new model) calls
    lookup("b"), again as ``call-0-0``. The tool step of run 2 must be
    answered with run 2's stored result, not run 1's.
    """
    made = Made()
    clock = ClockReplay()
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("a?", id="u1"))], clock=clock)
    await run_turns(store, "s", [call(("lookup", {"key": "a"})), reply("a")], agent(made), clock)
    first = await store.load("s")
    hide = SetVisibility(tuple(m.id for m in first.conversation), to_model=False)
    await submit(store, "s", [hide, AppendMessage(Message.user("b?", id="u2"))], clock=clock)
    await run_turns(store, "s", [call(("lookup", {"key": "b"})), reply("b")], agent(made), clock)
    assert made.made == ["lookup", "lookup"]
    results = [p for m in (await store.load("s")).conversation for p in m.tool_results]
    assert [p.content for p in results] == ["value of a", "value of b"]
    assert results[0].call_id == results[1].call_id  # the same id, answered twice, legally

    report = await replay(store, "s", agent(made))
    assert report.same, str(report)


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_a_step_that_changes_the_id_it_gives_a_message_is_a_difference(
    store: Store,
) -> None:
    """A message id the step chooses (not one from ``ctx.new_id()``) is its decision.

    Events and other dedupe-by-id schemes depend on it, so a new version
    that names its message differently does not behave the same.
    """
    made = Made()
    await tool_session(store, made)

    class Marker(Operation[Any]):
        def __init__(self, prefix: str) -> None:
            self.prefix = prefix

        @property
        def name(self) -> str:
            return "marker"

        async def run(self, ctx: StepContext[Any]) -> Outcome:
            if ctx.session.conversation[-1].id != "u2":
                return Refuse("not after u2")
            return Continue([AppendMessage(Message.user("mark", id=f"{self.prefix}:1"))])

    clock = ClockReplay()
    await submit(store, "s", [AppendMessage(Message.user("again", id="u2"))], clock=clock)
    await run_turns(store, "s", [reply("fine")], [Marker("old"), *agent(made)], clock)

    same = await replay(store, "s", [Marker("old"), *agent(made)])
    assert same.same, str(same)
    changed = await replay(store, "s", [Marker("new"), *agent(made)])
    assert not changed.same, str(changed)


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_a_forked_session_replays_like_its_source(tmp_path: Path) -> None:
    store = await SQLiteStore.open(tmp_path / "db.sqlite3")
    try:
        made = Made()
        source = await tool_session(store, made)
        await store.fork("s", source.revision, "f")
        original = await replay(store, "s", agent(made))
        forked = await replay(store, "f", agent(made))
        assert original.same, str(original)
        assert forked.same, str(forked)
        assert [(c.revision, c.stored_step) for c in forked.cycles] == [
            (c.revision, c.stored_step) for c in original.cycles
        ]
        assert len(forked.cycles) >= 3
    finally:
        await store.aclose()


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_a_step_that_changes_the_prefix_it_puts_on_a_new_id_is_a_difference(
    store: Store,
) -> None:
    """``f"ack-{ctx.new_id()}"``: the id source's part is the runtime's, the prefix the step's."""

    class Prefixed(Operation[Any]):
        name = "prefixed"

        def __init__(self, prefix: str) -> None:
            self.prefix = prefix

        async def run(self, ctx: StepContext[Any]) -> Outcome:
            if ctx.session.conversation[-1].role != "user":
                return Refuse("nothing to note")
            note = Message.user("noted", id=f"{self.prefix}{ctx.new_id()}")
            return Yield([AppendMessage(note)], YieldReason(YieldReason.DONE))

    clock = ClockReplay()
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("hi", id="u1"))], clock=clock)
    await run_turns(store, "s", [], [Prefixed("ack-")], clock)
    (stored,) = [m for m in (await store.load("s")).conversation if m.text == "noted"]
    assert stored.id.startswith("ack-s-r")  # the prefix around the runtime's id

    same = await replay(store, "s", [Prefixed("ack-")])
    assert same.same, str(same)
    changed = await replay(store, "s", [Prefixed("note-")])
    assert not changed.same, str(changed)
    assert "message.id" in changed.cycles[0].difference, str(changed)


class Journals(Operation[Any]):
    """Records a journal intent on an open call with an idempotency key ``key`` makes."""

    name = "journals"

    def __init__(self, key: Any) -> None:
        self.key = key

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        for position, call_part in ctx.session.history.open_call_positions():
            if call_part.notes.get(JOURNAL):
                continue
            message_id = ctx.session.conversation[position].id
            entry = JournalEntry(
                intent=True,
                idempotency_key=self.key(ctx.session.id, call_part.call_id, message_id),
                side_effects="non_idempotent",
                attempt=1,
                at=ctx.runtime.clock(),
            )
            values = msgspec.to_builtins(entry)
            effect = Annotate(message_id, JOURNAL, values, call_id=call_part.call_id)
            return Yield([effect], YieldReason(YieldReason.DONE))
        return Refuse("every open call has a journal")


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_an_idempotency_key_the_runtime_would_not_make_is_a_difference(
    tmp_path: Path,
) -> None:
    """The key is left out only as the runtime makes it: another key is a decision."""
    store = await SQLiteStore.open(tmp_path / "db.sqlite3")
    try:
        clock = ClockReplay()
        asked = Message.assistant(ToolCallPart.of("c1", "pay", {"amount": 5}), id="a1")
        await store.create("s", conversation=[Message.user("pay", id="u1"), asked])
        await run_turns(store, "s", [], [Journals(idempotency_key)], clock)
        made = [p for m in (await store.load("s")).conversation for p in m.tool_calls]
        recorded = journal_entry(made[0])
        assert recorded is not None
        assert recorded.idempotency_key == idempotency_key("s", "c1", "a1")
        await store.fork("s", (await store.load("s")).revision, "f")

        for session_id in ("s", "f"):
            same = await replay(store, session_id, [Journals(idempotency_key)])
            assert same.same, str(same)
            other = await replay(store, session_id, [Journals(lambda *_: "sm-mine")])
            assert not other.same, str(other)
            assert "idempotency_key" in other.cycles[0].difference, str(other)
    finally:
        await store.aclose()


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_a_fork_that_ran_on_replays_the_same(tmp_path: Path) -> None:
    """The copied cycles carry the source's keys, the fork's own cycles the fork's."""
    store = await SQLiteStore.open(tmp_path / "db.sqlite3")
    try:
        made = Made()
        source = await tool_session(store, made)
        await store.fork("s", source.revision, "f")
        clock = ClockReplay(start=10_000)
        await submit(store, "f", [AppendMessage(Message.user("b?", id="f-u2"))], clock=clock)
        ask = ToolCallPart.of("fork-call", "lookup", {"key": "b"})
        await run_turns(store, "f", [call(ask), reply("b is a value")], agent(made), clock)
        keys = [
            entry.idempotency_key
            for m in (await store.load("f")).conversation
            for p in m.tool_calls
            if (entry := journal_entry(p)) is not None
        ]
        assert len(set(keys)) == 2  # the source's key, then the fork's own

        report = await replay(store, "f", agent(made))
        assert report.same, str(report)
        assert len([c for c in report.cycles if c.stored_step == "tools"]) == 2
    finally:
        await store.aclose()


# -- histories from crashes, operators and denials -----------------------------------


class Crash(BaseException):
    """Stands for kill -9 in the middle of a tool: nothing after it runs."""


async def crashed_session(store: Store, *, rerun: bool | None) -> list[str]:
    """Run 1 crashes inside a non-idempotent tool after its intent was committed.

    ``rerun=None``: run 2 answers the call "outcome unknown" (the default
    policy). Otherwise an operator decides first with ``resolve_unknown_outcome``.
    """
    ran: list[str] = []
    crash = [True]
    # resolve_unknown_outcome() takes no clock= (approve and deny do): it stamps with
    # time.time, so the runs' clock starts there too, as in an application.
    clock = ClockReplay(start=time.time())

    @tool
    def pay(amount: int) -> str:
        """Pay an amount (not idempotent)."""
        ran.append("pay")
        if crash[0]:
            raise Crash
        return f"paid {amount}"

    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("pay 5", id="u1"))], clock=clock)
    steps: list[Step[Any]] = [Tools([pay]), ModelInference()]
    with pytest.raises(Crash):
        await run_turns(store, "s", [call(("pay", {"amount": 5}))], steps, clock)
    crash[0] = False
    session = await store.load("s")
    (open_call,) = [p for m in session.conversation for p in m.tool_calls]
    if rerun is not None:
        await resolve_unknown_outcome(store, "s", open_call.call_id, rerun=rerun, by="ops")
    await run_turns(store, "s", [reply("sorted out")], [Tools([pay]), ModelInference()], clock)
    return ran


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
@pytest.mark.parametrize("rerun", [None, True, False])
async def test_a_crashed_run_replays_the_same_after_the_crash(
    store: Store, rerun: bool | None
) -> None:
    """The cycle the crash cut is incomplete; every cycle after it replays the same."""
    ran = await crashed_session(store, rerun=rerun)
    before = list(ran)
    report = await replay(store, "s", [Tools([_no_pay()]), ModelInference()])
    assert ran == before
    crashed = next(c for c in report.cycles if c.stored_step == "tools")
    after = [c for c in report.cycles if c.revision > crashed.revision]
    assert after, str(report)
    assert all(c.same for c in after), str(report)


def _no_pay() -> Tool:
    @tool
    def pay(amount: int) -> str:
        """Pay an amount (not idempotent)."""
        raise AssertionError("a replay ran a tool")

    return pay


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_a_denied_call_replays_the_same_and_an_approving_policy_differs(
    store: Store,
) -> None:
    made = Made()
    clock = ClockReplay()
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("delete a", id="u1"))], clock=clock)
    turns = [call(("delete", {"key": "a"}))]
    await run_turns(store, "s", turns, agent(made), clock)
    session = await store.load("s")
    (pending,) = [p for m in session.conversation for p in m.tool_calls]
    await deny(store, "s", pending.call_id, by="ops", message="no", clock=clock)
    await run_turns(store, "s", [reply("ok, not deleted")], agent(made), clock)
    assert made.made == []

    same = await replay(store, "s", agent(made))
    assert same.same, str(same)
    assert made.made == []
    no_approval = await replay(store, "s", agent(made, approve_tools=()))
    first = no_approval.first_difference
    assert first is not None, str(no_approval)
    assert first.stored_step == "approval", str(no_approval)
    assert made.made == []


# -- histories written before the feature --------------------------------------------


class Declines(Operation[Any]):
    """Refuses every cycle."""

    name = "declines"

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Refuse("never")


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
@pytest.mark.parametrize("version", [1, 2, 3, 4])
async def test_golden_databases_of_every_schema_version_replay(
    tmp_path: Path, version: int
) -> None:
    """Batches without refusals (and v1 rows without checksums) replay; nothing is written."""
    path = tmp_path / "store.db"
    shutil.copyfile(golden.HERE / golden.db_name(version), path)
    async with await SQLiteStore.open(path, golden.make_codec()) as store:  # migrates here
        opened = hashlib.sha256(path.read_bytes()).hexdigest()
        for session_id in await store.list_sessions():
            log = await store.batches(session_id)
            report = await replay(store, session_id, [Declines()])
            machine_batches = [b for b in log if b.cycle >= 1]
            assert len(report.cycles) <= len(machine_batches)
            assert all(c.stored_refused == () for c in report.cycles)
            assert all(not c.same and c.new_step is None for c in report.cycles), str(report)
            assert await store.batches(session_id) == log
        assert hashlib.sha256(path.read_bytes()).hexdigest() == opened


# -- a full agent: repairs, parallel tools, budgets per run and session, compaction ---


def scripted(request: ModelRequest) -> ModelResponse:
    """A deterministic model: the answer depends on the request only."""
    if request.purpose != ModelRequest.TURN:
        return reply("summary: keys were looked up")
    answered = sum(len(m.tool_results) for m in request.messages)
    users = sum(m.role == "user" for m in request.messages)
    if users == 1:  # a malformed call first, that InvalidCalls handles
        return call(ToolCallPart.parse("bad-1", "lookup", "{not json"))
    if answered < 4 and users < 4:
        return call(("lookup", {"key": f"k{answered}"}), ("delete", {"key": f"k{answered}"}))
    return reply(f"done after {answered} results")


def full_agent(made: Made, *, threshold: int = 10_000) -> list[Step[Any]]:
    return [
        InvalidCalls("retry"),
        HistoryGuard(),
        Budget(per_run=Limits(model_calls=20), per_session=Limits(model_calls=50)),
        Compaction(threshold=threshold, keep_turns=1, on_stuck="proceed"),
        Tools(made.tools(), max_concurrency=4),
        ModelInference(),
    ]


async def full_session(store: Store, made: Made, *, threshold: int) -> None:
    clock = ClockReplay()
    await store.create("s")
    for turn in range(2):
        user = Message.user(f"tidy up round {turn} " + "x" * 200, id=f"u{turn}")
        await submit(store, "s", [AppendMessage(user)], clock=clock)
        runtime = Runtime(
            store=store,
            model=FunctionModel(scripted),
            clock=clock,
            ids=counter_ids(f"r{turn}-"),
        )
        result = await StateMachine(full_agent(made, threshold=threshold)).run_report(runtime, "s")
        assert result.reason.kind == "done", result.reason


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
@pytest.mark.parametrize("threshold", [10_000, 120])
async def test_a_full_agent_replays_the_same_with_its_model(store: Store, threshold: int) -> None:
    """With compaction (threshold 120) the model must be given; then every cycle is the same."""
    made = Made()
    await full_session(store, made, threshold=threshold)
    executed = list(made.made)
    log = await store.batches("s")
    steps_seen = {b.step for b in log}
    assert {"invalid_calls", "tools", "inference"} <= steps_seen
    if threshold == 120:
        assert "compaction" in steps_seen

    report = await replay(
        store, "s", full_agent(made, threshold=threshold), model=FunctionModel(scripted)
    )
    assert report.same, str(report)
    assert made.made == executed
    assert await store.batches("s") == log
    if threshold == 10_000:  # no compaction: the stored replies are enough
        recorded = await replay(store, "s", full_agent(made, threshold=threshold))
        assert recorded.same, str(recorded)


# -- model calls that produced no reply ---------------------------------------------


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_a_context_length_error_the_model_gave_replays_the_same(store: Store) -> None:
    """The stored cycle called the model and got ``ContextLengthError``; the same steps do too.

    ModelInference recorded the failed attempt (an ``Annotate``) and
    continued; the next cycle's call succeeded. The replay should answer the
    first call with the recorded failure, not call it "an extra model call".
    """
    answers: list[ModelResponse | Exception] = [ContextLengthError("too long"), reply("short")]

    def model_fn(request: ModelRequest) -> ModelResponse:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    clock = ClockReplay()
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("hi", id="u1"))], clock=clock)
    runtime = Runtime(store=store, model=FunctionModel(model_fn), clock=clock, ids=counter_ids())
    result = await StateMachine([ModelInference()]).run_report(runtime, "s")
    assert result.reason.kind == "done"
    assert [b.step for b in await store.batches("s")] == ["application", "inference", "inference"]

    report = await replay(store, "s", [ModelInference()])
    assert report.same, str(report)


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_a_reply_that_took_more_attempts_than_the_new_budget_allows_differs(
    store: Store,
) -> None:
    def model_fn(request: ModelRequest) -> ModelResponse:
        return msgspec.structs.replace(reply("after two retries"), attempts=3)

    clock = ClockReplay()
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("hi", id="u1"))], clock=clock)
    runtime = Runtime(store=store, model=FunctionModel(model_fn), clock=clock, ids=counter_ids())
    steps: list[Step[Any]] = [Budget(per_run=Limits(model_calls=10)), ModelInference()]
    assert (await StateMachine(steps).run_report(runtime, "s")).reason.kind == "done"
    session = await store.load("s")
    assert [m.role for m in session.conversation] == ["user", "assistant"]

    seen: list[int | None] = []

    def strict_fn(request: ModelRequest) -> ModelResponse:
        seen.append(request.max_attempts)
        return reply("unused")

    # What a live run of the new pipeline asks of the model: at most 2 attempts.
    await store.create("probe")
    await submit(store, "probe", [AppendMessage(Message.user("hi", id="u1"))], clock=clock)
    tight: list[Step[Any]] = [Budget(per_run=Limits(model_calls=2)), ModelInference()]
    probe = Runtime(store=store, model=FunctionModel(strict_fn), clock=clock, ids=counter_ids())
    await StateMachine(tight).run_report(probe, "probe")
    assert seen == [2]

    report = await replay(store, "s", [Budget(per_run=Limits(model_calls=2)), ModelInference()])
    assert not report.same, str(report)


# -- cost ---------------------------------------------------------------------------


class CountingStore(MemoryStore):
    """A memory store whose ``load_at`` hands out conversations that count their reads."""

    def __init__(self) -> None:
        super().__init__()
        self.conversations: list[CountingConversation] = []

    async def load_at(self, session_id: str, revision: int) -> Session[Any]:
        session, conversation = counted(await super().load_at(session_id, revision))
        self.conversations.append(conversation)
        return session


class Acknowledges(Operation[Any]):
    """Appends one note (a user message the model answers) after each other user message."""

    name = "acknowledges"

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        last = ctx.session.conversation[-1]
        if last.role != "user" or last.id.startswith("ack-"):
            return Refuse("nothing to acknowledge")
        note = Message(id=f"ack-{ctx.new_id()}", role="user", parts=(TextPart("noted"),))
        return Yield([AppendMessage(note)], YieldReason(YieldReason.DONE))


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_replaying_a_cycle_does_not_read_the_whole_history() -> None:
    store = CountingStore()
    history = [*tool_loop(200), Message.user("one more", id="last")]
    await store.create("s", conversation=history)
    runtime = Runtime(store=store, ids=counter_ids())
    await StateMachine([Acknowledges()]).run_report(runtime, "s")

    report = await replay(store, "s", [Acknowledges()])
    assert report.same, str(report)
    assert len(report.cycles) == 1, str(report)
    (conversation,) = store.conversations
    assert conversation.read < 20, f"the replay read {conversation.read} messages"


# -- yield or continue ------------------------------------------------------------------


class AcknowledgesAndGoesOn(Acknowledges):
    """The same note, but the run goes on (the model answers next)."""

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        outcome = await super().run(ctx)
        return Continue(outcome.effects) if isinstance(outcome, Yield) else outcome


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_a_step_that_now_continues_where_it_yielded_differs(store: Store) -> None:
    clock = ClockReplay()
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("hi", id="u1"))], clock=clock)
    runtime = Runtime(store=store, model=ScriptedModel([]), clock=clock, ids=counter_ids())
    stored = await StateMachine([Acknowledges(), ModelInference()]).run_report(runtime, "s")
    assert stored.reason.kind == "done"

    live = MemoryStore()
    await live.create("s")
    await submit(live, "s", [AppendMessage(Message.user("hi", id="u1"))], clock=clock)
    model = ScriptedModel([reply("hello")])
    rt = Runtime(store=live, model=model, clock=clock, ids=counter_ids())
    await StateMachine([AcknowledgesAndGoesOn(), ModelInference()]).run_report(rt, "s")
    assert [m.role for m in (await live.load("s")).conversation][-1] == "assistant"
    assert len((await live.load("s")).conversation) == 3  # the new pipeline also calls the model

    report = await replay(store, "s", [AcknowledgesAndGoesOn(), ModelInference()])
    assert not report.same, str(report)


# -- leases -------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_a_replay_neither_needs_nor_touches_the_sessions_lease(store: Store) -> None:
    """A worker holds the lease: the replay reads anyway, claims nothing, requests no run."""
    made = Made()
    await tool_session(store, made)
    leases: Any = store
    lease = await leases.claim("s", "worker-1", 60.0)
    assert isinstance(lease, Lease)

    report = await replay(store, "s", agent(made))
    assert report.same, str(report)

    assert isinstance(await leases.claim("s", "worker-2", 60.0), LeaseHolder)
    assert await leases.renew(lease) is not None  # still the holder, same epoch
    assert await leases.release(lease) is True
    assert await leases.claim_next("worker-3", 60.0) is None  # no run was requested


# -- damaged data -------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_a_damaged_receipt_fails_clearly_naming_session_and_revision(store: Store) -> None:
    clock = ClockReplay()
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("hi", id="u1"))], clock=clock)
    tag = InferenceReceipt.__struct_config__.tag
    broken = Message(
        id="a1",
        role="assistant",
        parts=(TextPart("hello"),),
        notes={"inference": {TAG_FIELD: tag, "attempts": "three"}},
    )
    session = await store.load("s")
    batch: Batch[Effect] = Batch(
        session_id="s",
        revision=session.revision + 1,
        step="inference",
        cycle=1,
        timestamp=clock(),
        effects=(AppendMessage(broken),),
    )
    await store.apply(batch)
    log = await store.batches("s")

    with pytest.raises(StoredDataError) as caught:
        await replay(store, "s", [ModelInference()])
    assert "'s'" in str(caught.value), str(caught.value)
    assert "revision 2" in str(caught.value), str(caught.value)
    assert await store.batches("s") == log


# -- external events ------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_external_events_replay_the_same_and_a_new_rendering_differs(store: Store) -> None:
    clock = ClockReplay()
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("wait for it", id="u1"))], clock=clock)
    await run_turns(store, "s", [reply("waiting")], [ExternalEvents(), ModelInference()], clock)
    await submit_event(store, "s", "webhook", {"x": 1}, event_id="e1", clock=clock)
    await run_turns(store, "s", [reply("got it")], [ExternalEvents(), ModelInference()], clock)
    assert "events" in {b.step for b in await store.batches("s")}

    same = await replay(store, "s", [ExternalEvents(), ModelInference()])
    assert same.same, str(same)
    other = await replay(
        store, "s", [ExternalEvents(render=lambda e: f"EVENT {e.kind}"), ModelInference()]
    )
    first = other.first_difference
    assert first is not None, str(other)
    assert first.stored_step == "events", str(other)


# -- Runtime.tool_caller in a live run ----------------------------------------------------


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_a_tool_caller_that_raises_gives_an_error_result_not_a_crash(store: Store) -> None:
    @tool
    def lookup(key: str) -> str:
        """Look a key up."""
        raise AssertionError("the caller answers instead")

    async def executor_down(call_part: ToolCallPart, context: Any) -> ToolResultPart:
        raise RuntimeError("remote executor down")

    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("go", id="u1"))])
    model = ScriptedModel([call(("lookup", {"key": "a"})), reply("sorry")])
    runtime = Runtime(store=store, model=model, ids=counter_ids(), tool_caller=executor_down)
    result = await StateMachine([Tools([lookup]), ModelInference()]).run_report(runtime, "s")
    assert result.reason.kind == "done"
    (answer,) = [p for m in (await store.load("s")).conversation for p in m.tool_results]
    assert answer.is_error
    assert "remote executor down" in answer.content


# -- models the steps hold themselves ------------------------------------------------------


class CountingModel:
    """A model that counts its calls (it stands for a provider client: the network)."""

    name = "judge"

    def __init__(self) -> None:
        self.calls = 0

    async def request(self, request: ModelRequest, *, on_chunk: Any = None) -> ModelResponse:
        self.calls += 1
        return reply("fine")


class Judge(Operation[Any]):
    """Asks its own model whether the last user message is fine, then refuses."""

    name = "judge"

    def __init__(self, model: CountingModel) -> None:
        self.model = model

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        last = ctx.session.conversation[-1]
        if last.role != "user":
            return Refuse("nothing to judge")
        request = ModelRequest(messages=(last,), purpose="judge")
        await ctx.request_model(self.model, request)
        return Refuse("judged fine")


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_a_step_with_its_own_model_calls_no_model_in_a_replay(store: Store) -> None:
    judge = CountingModel()
    clock = ClockReplay()
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("hi", id="u1"))], clock=clock)
    await run_turns(store, "s", [reply("hello")], [Judge(judge), ModelInference()], clock)
    assert judge.calls == 1

    await replay(store, "s", [Judge(judge), ModelInference()])
    assert judge.calls == 1


# -- a message submitted while a tool runs ---------------------------------------------------


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_a_message_submitted_while_a_tool_ran_replays_the_same(store: Store) -> None:
    """The user steers while a tool runs: the tool step's result commit conflicts and retries.

    The tool step's intent batch and its result batch are then split by the
    user's batch; they are still one cycle of one run.
    """
    clock = ClockReplay()

    @tool
    async def lookup(key: str) -> str:
        """Look a key up (slowly: the user writes meanwhile)."""
        steer = AppendMessage(Message.user("also look up b", id="steer"))
        if "steer" not in {m.id for m in (await store.load("s")).conversation}:
            await submit(store, "s", [steer], clock=clock)
        return f"value of {key}"

    steps: list[Step[Any]] = [
        Budget(per_run=Limits(model_calls=3)),
        Tools([lookup]),
        ModelInference(),
    ]
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("look up a", id="u1"))], clock=clock)
    turns = [call(("lookup", {"key": "a"})), reply("a and b")]
    await run_turns(store, "s", turns, steps, clock)
    log = await store.batches("s")
    assert [b.step for b in log] == [
        "application",
        "inference",  # the budgeted request's reservation
        "inference",
        "tools",
        "application",
        "tools",
        "inference",
        "inference",
    ]

    report = await replay(
        store, "s", [Budget(per_run=Limits(model_calls=3)), Tools([lookup]), ModelInference()]
    )
    assert len({c.run_start_revision for c in report.cycles}) == 1, str(report)
    assert report.same, str(report)


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_a_call_answered_from_outside_while_its_cycle_ran_replays_the_same(
    store: Store,
) -> None:
    """The application answers call b while the tool step runs a (one after another).

    The step's commit of a conflicts and retries on top of that answer, and b,
    no longer open then, gets no second result. The replay applies the
    application's batch where it landed, so the new step sees it too.
    """
    clock = ClockReplay()
    ran: list[str] = []

    @tool
    async def lookup(key: str) -> str:
        """Look a key up; while looking a up, the application answers b itself."""
        ran.append(key)
        if key == "a":
            session = await store.load("s")
            (b,) = [
                c for m in session.conversation for c in m.tool_calls if c.arguments == {"key": "b"}
            ]
            answer = Message.tool_result(ToolResultPart.for_call(b, "b, from the app"), id="app-b")
            await submit(store, "s", [AppendMessage(answer)], clock=clock)
        return f"value of {key}"

    def steps() -> list[Step[Any]]:
        return [Tools([lookup], max_concurrency=1), ModelInference()]

    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("a and b", id="u1"))], clock=clock)
    both = call(("lookup", {"key": "a"}), ("lookup", {"key": "b"}))
    await run_turns(store, "s", [both, reply("a and b")], steps(), clock)
    assert ran == ["a", "b"]
    log = await store.batches("s")
    assert [b.step for b in log] == [
        "application",
        "inference",
        "tools",  # both intents
        "application",  # b answered from outside
        "tools",  # a's result, after a conflict; b's is not written
        "inference",
    ]

    report = await replay(store, "s", steps())
    assert ran == ["a", "b"]
    assert report.same, str(report)
    (tools_cycle,) = [c for c in report.cycles if c.stored_step == "tools"]
    assert len(tools_cycle.new) == 2, str(report)


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_two_chat_turns_with_a_message_between_stay_two_runs(store: Store) -> None:
    """Inference in cycle 1, ``submit``, inference in cycle 1 again: two runs, not one cycle."""
    clock = ClockReplay()
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("hi", id="u1"))], clock=clock)
    await run_turns(store, "s", [reply("hello")], [ModelInference()], clock)
    await submit(store, "s", [AppendMessage(Message.user("and?", id="u2"))], clock=clock)
    await run_turns(store, "s", [reply("that is all")], [ModelInference()], clock)
    log = await store.batches("s")
    assert [(b.step, b.cycle) for b in log] == [
        ("application", 0),
        ("inference", 1),
        ("application", 0),
        ("inference", 1),
    ]

    report = await replay(store, "s", [ModelInference()])
    assert report.same, str(report)
    assert [c.revision for c in report.cycles] == [2, 4]
    assert [c.run_start_revision for c in report.cycles] == [1, 3]


class Gate(Operation[Any]):
    """Holds back every tool call without a ``gate`` note ``{"open": True}``."""

    name = "gate"

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Refuse("a gate only holds calls back")

    def check_call(self, ctx: StepContext[Any], call: ToolCallPart) -> str | None:
        return None if call.notes.get("gate", {}).get("open") else "the gate is closed"


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_an_outside_batch_touching_the_next_call_begins_a_new_run(store: Store) -> None:
    """Run 1 runs call a in its cycle 1 (b held); the application opens b's gate; run 2
    runs b in its cycle 1. The same cycle number and step, but the outside batch
    annotated the call the later batches work on: run 2 is not run 1's cycle going on."""
    made = Made()
    clock = ClockReplay()
    asked = Message.assistant(
        [
            ToolCallPart.of("ca", "lookup", {"key": "a"}),
            ToolCallPart.of("cb", "lookup", {"key": "b"}),
        ],
        id="a1",
    )
    await store.create("s", conversation=[Message.user("a and b", id="u1"), asked])
    opened = Annotate("a1", "gate", {"open": True}, call_id="ca")
    await submit(store, "s", [opened], clock=clock)

    def steps() -> list[Step[Any]]:
        return [Gate(), Tools(made.tools()), ModelInference()]

    await run_turns(store, "s", [], steps(), clock)
    await submit(store, "s", [Annotate("a1", "gate", {"open": True}, call_id="cb")], clock=clock)
    await run_turns(store, "s", [reply("both")], steps(), clock)
    assert made.made == ["lookup", "lookup"]
    log = await store.batches("s")
    assert [(b.step, b.cycle) for b in log] == [
        ("application", 0),
        ("tools", 1),  # the intent of a
        ("tools", 1),  # its result
        ("application", 0),
        ("tools", 1),  # the intent of b
        ("tools", 1),
        ("inference", 2),
    ]

    report = await replay(store, "s", steps())
    assert report.same, str(report)
    tools_cycles = [c for c in report.cycles if c.stored_step == "tools"]
    assert [len(c.stored) for c in tools_cycles] == [2, 2]
    assert len({c.run_start_revision for c in report.cycles}) == 2


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_a_tool_caller_that_never_answers_is_bounded_by_the_tools_timeout() -> None:
    @tool(timeout=0.05)
    async def lookup(key: str) -> str:
        """Look a key up."""
        return key

    async def never(call_part: ToolCallPart, context: Any) -> ToolResultPart:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    store = MemoryStore()
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("go", id="u1"))])
    model = ScriptedModel([call(("lookup", {"key": "a"})), reply("sorry")])
    runtime = Runtime(store=store, model=model, ids=counter_ids(), tool_caller=never)
    with anyio.move_on_after(2):  # only so that the defect fails instead of hanging the suite
        await StateMachine([Tools([lookup]), ModelInference()]).run_report(runtime, "s")
    results = [p for m in (await store.load("s")).conversation for p in m.tool_results]
    assert [r.is_error for r in results] == [True]
    assert "timed out" in results[0].content


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_two_steps_advertising_one_tool_name_is_a_configuration_error(
    store: Store,
) -> None:
    """A configuration error before anything runs (DESIGN section 2), not a cycle's difference."""
    made = Made()
    await tool_session(store, made)
    steps: list[Step[Any]] = [
        Tools(made.tools()),
        Tools(made.tools(), name="more_tools"),
        ModelInference(),
    ]
    with pytest.raises(ConfigurationError):
        await replay(store, "s", steps)


# -- the clock a replayed cycle sees -------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:StepContext.commit is deprecated:DeprecationWarning")
async def test_an_approval_that_expired_while_its_tool_ran_replays_the_same(store: Store) -> None:
    clock = ClockReplay()

    @tool(side_effects="idempotent")
    def delete(key: str) -> str:
        """Delete a key (it takes a while: 100 clock seconds)."""
        for _ in range(100):
            clock()
        return f"deleted {key}"

    def steps() -> list[Step[Any]]:
        return [Approval(["delete"]), Tools([delete]), ModelInference()]

    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("delete a", id="u1"))], clock=clock)
    await run_turns(store, "s", [call(("delete", {"key": "a"}))], steps(), clock)
    (pending,) = [p for m in (await store.load("s")).conversation for p in m.tool_calls]
    await approve(store, "s", pending.call_id, by="ops", expires_at=clock() + 10, clock=clock)
    await run_turns(store, "s", [reply("deleted")], steps(), clock)
    results = [p for m in (await store.load("s")).conversation for p in m.tool_results]
    assert [r.content for r in results] == ["deleted a"]

    report = await replay(store, "s", steps())
    assert report.same, str(report)
