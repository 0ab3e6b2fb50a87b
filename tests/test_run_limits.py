"""Why a run stops: held tool calls name their objector, and a run has a cycle cap.

* A step whose ``check_call`` objects to an open call, when no step applies,
  makes the run yield ``call_held`` naming the step, the call and the tool
  (never a silent ``idle``). ``Approval`` still yields ``awaiting_approval``.
* Without a ``Budget``, a model that keeps calling tools stops at
  ``max_cycles`` with ``cycle_limit``; ``run()`` again continues.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import (
    AppendMessage,
    Codec,
    ConfigurationError,
    Continue,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Operation,
    Outcome,
    RecordingEmitter,
    Refuse,
    Runtime,
    StateMachine,
    StepContext,
    ToolCallPart,
    ToolResultPart,
    Tools,
    UpdateData,
    Yield,
    Yielded,
    submit,
    tool,
)
from stepmachine.extend import (
    DEFAULT_MAX_CYCLES,
    YieldReason,
    counter_ids,
    history_problems,
    open_tool_calls,
)
from stepmachine.operations import Approval
from stepmachine.stores import MemoryStore
from stepmachine.testing import FunctionModel, ScriptedModel, call, reply


class Flags(msgspec.Struct, frozen=True):
    """Application data: the calls a reviewer has cleared."""

    cleared: tuple[str, ...] = ()


async def new_store(conversation: Sequence[Message] = ()) -> MemoryStore:
    store = MemoryStore(Codec(Flags))
    await store.create("s", conversation=conversation)
    return store


ran: list[str] = []


@tool
def transfer(amount: int) -> str:
    """Transfer money."""
    ran.append(f"transfer {amount}")
    return f"sent {amount}"


@tool
def lookup(key: str) -> str:
    """Look a key up."""
    ran.append(f"lookup {key}")
    return f"value of {key}"


class Compliance(Operation[Flags]):
    """Holds back every ``transfer`` call until its id is in ``data.cleared``; never runs."""

    name = "compliance"

    def check_call(self, ctx: StepContext[Flags], call: ToolCallPart) -> str | None:
        if call.name == "transfer" and call.call_id not in ctx.session.data.cleared:
            return "transfers need a compliance review"
        return None

    async def run(self, ctx: StepContext[Flags]) -> Outcome:
        return Refuse("compliance only objects")


# -- item 13: a held call names its objector -------------------------------------------------


@pytest.mark.parametrize("compliance_first", [True, False], ids=["before-tools", "after-tools"])
async def test_a_held_call_yields_call_held_naming_the_step_the_call_and_the_tool(
    compliance_first: bool,
) -> None:
    ran.clear()
    store = await new_store([Message.user("pay 100", id="u1")])
    model = ScriptedModel([call(("transfer", {"amount": 100})), reply("paid")])
    steps: list[Operation[Flags]] = [Tools([transfer]), ModelInference()]
    steps.insert(0 if compliance_first else 1, Compliance())
    machine = StateMachine(steps)
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    emitter = RecordingEmitter()
    report = await machine.run_report(runtime, "s", emitter)
    assert report.reason.kind == YieldReason.CALL_HELD == "call_held"
    assert "'compliance'" in report.reason.message
    assert "'call-0-0'" in report.reason.message
    assert "transfer" in report.reason.message
    assert report.reason.data == {
        "calls": [
            {
                "call_id": "call-0-0",
                "tool": "transfer",
                "step": "compliance",
                "objection": "transfers need a compliance review",
            }
        ]
    }
    assert emitter.of_type(Yielded)[-1] == Yielded("call_held", report.reason.message)
    assert ran == []
    assert [c.call_id for c in open_tool_calls(report.session.conversation)] == ["call-0-0"]
    # Once the session changes (a reviewer clears the call), run() again runs it.
    await submit(store, "s", [UpdateData.set(cleared=("call-0-0",))])
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == YieldReason.DONE
    assert ran == ["transfer 100"]
    assert report.session.conversation[-1].text == "paid"


class Refuser(Operation[Flags]):
    """Objects to ``transfer`` and answers such calls itself with an error result."""

    name = "refuser"

    def check_call(self, ctx: StepContext[Flags], call: ToolCallPart) -> str | None:
        return "transfers are not allowed" if call.name == "transfer" else None

    async def run(self, ctx: StepContext[Flags]) -> Outcome:
        answers = [
            AppendMessage(
                Message.tool_result(
                    ToolResultPart.for_call(c, "refused: transfers are not allowed", is_error=True),
                    id=ctx.new_id(),
                )
            )
            for c in open_tool_calls(ctx.session.conversation)
            if c.name == "transfer"
        ]
        return Continue(answers) if answers else Refuse()


async def test_an_objector_may_answer_the_call_with_an_error_result_instead() -> None:
    ran.clear()
    store = await new_store([Message.user("pay 5", id="u1")])
    model = ScriptedModel([call(("transfer", {"amount": 5})), reply("could not pay")])
    machine = StateMachine([Tools([transfer]), Refuser(), ModelInference()])
    report = await machine.run_report(Runtime(store=store, model=model, ids=counter_ids()), "s")
    assert report.reason.kind == YieldReason.DONE
    assert ran == []
    results = [r for m in report.session.conversation for r in m.tool_results]
    assert [(r.content, r.is_error) for r in results] == [
        ("refused: transfers are not allowed", True)
    ]
    assert report.session.conversation[-1].text == "could not pay"


@pytest.mark.parametrize("approval_first", [True, False], ids=["before-tools", "after-tools"])
async def test_approval_still_yields_awaiting_approval_not_call_held(approval_first: bool) -> None:
    ran.clear()
    store = await new_store([Message.user("pay 9", id="u1")])
    model = ScriptedModel([call(("transfer", {"amount": 9})), reply("paid")])
    steps: list[Operation[Any]] = [Tools([transfer]), ModelInference()]
    steps.insert(0 if approval_first else 1, Approval(["transfer"]))
    report = await StateMachine(steps).run_report(
        Runtime(store=store, model=model, ids=counter_ids()), "s"
    )
    assert report.reason.kind == YieldReason.AWAITING_APPROVAL
    assert ran == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    calls=st.lists(st.sampled_from(["transfer", "lookup"]), min_size=1, max_size=4),
    compliance_at=st.integers(0, 2),
)
async def test_every_held_call_is_named_and_every_other_call_runs(
    calls: list[str], compliance_at: int
) -> None:
    ran.clear()
    store = await new_store([Message.user("go", id="u1")])
    arguments = [
        {"amount": i} if name == "transfer" else {"key": f"k{i}"} for i, name in enumerate(calls)
    ]
    model = ScriptedModel([call(*zip(calls, arguments, strict=True)), reply("done")])
    steps: list[Operation[Flags]] = [Tools([transfer, lookup]), ModelInference()]
    steps.insert(compliance_at, Compliance())
    report = await StateMachine(steps).run_report(
        Runtime(store=store, model=model, ids=counter_ids()), "s"
    )
    held = [f"call-0-{i}" for i, name in enumerate(calls) if name == "transfer"]
    assert sorted(history_problems(report.session.conversation)) == sorted(
        f"tool call {c!r} has no result" for c in held
    )
    assert [c.call_id for c in open_tool_calls(report.session.conversation)] == held
    assert sorted(ran) == sorted(f"lookup k{i}" for i, n in enumerate(calls) if n == "lookup")
    if held:
        assert report.reason.kind == YieldReason.CALL_HELD
        assert [c["call_id"] for c in report.reason.data["calls"]] == held
        assert {c["step"] for c in report.reason.data["calls"]} == {"compliance"}
        assert {c["tool"] for c in report.reason.data["calls"]} == {"transfer"}
    else:
        assert report.reason.kind == YieldReason.DONE
        assert report.session.conversation[-1].text == "done"


# -- item 15: a finite default cap on cycles per run -------------------------------------------


def tool_loop(stop_after: int | None) -> FunctionModel:
    """A model that asks for a lookup every turn (and answers after ``stop_after`` turns)."""

    def answer(request: ModelRequest) -> ModelResponse:
        turns = sum(1 for m in request.messages if m.role == "assistant")
        if stop_after is not None and turns >= stop_after:
            return reply("finally done")
        return call(("lookup", {"key": f"k{turns}"}))

    return FunctionModel(answer)


async def test_without_a_budget_a_tool_loop_stops_at_the_default_cycle_cap() -> None:
    store = await new_store([Message.user("go", id="u1")])
    machine: StateMachine[Flags] = StateMachine([Tools([lookup]), ModelInference()])
    assert machine.max_cycles == DEFAULT_MAX_CYCLES == 100
    # It would stop by itself only after 150 tool rounds (301 cycles).
    runtime = Runtime(store=store, model=tool_loop(stop_after=150), ids=counter_ids())
    emitter = RecordingEmitter()
    report = await machine.run_report(runtime, "s", emitter)
    assert report.reason.kind == YieldReason.CYCLE_LIMIT == "cycle_limit"
    assert report.reason.data == {"max_cycles": DEFAULT_MAX_CYCLES}
    assert len(report.results) == DEFAULT_MAX_CYCLES
    assert emitter.of_type(Yielded)[-1].reason == "cycle_limit"
    # 50 model turns and 50 tool cycles, each committing its intents and its result.
    assert report.session.revision == 150
    # run() again continues with a fresh count, from the stored session.
    # 150 rounds are 301 cycles: three more runs (100, 100, 1).
    kinds = [(await machine.run_report(runtime, "s")).reason.kind for _ in range(3)]
    assert kinds == [YieldReason.CYCLE_LIMIT, YieldReason.CYCLE_LIMIT, YieldReason.DONE]
    final = await store.load("s")
    assert final.conversation[-1].text == "finally done"
    assert history_problems(final.conversation) == []


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(max_cycles=st.integers(1, 12), rounds=st.integers(0, 10))
async def test_runs_under_a_cycle_cap_add_up_to_the_uncapped_run(
    max_cycles: int, rounds: int
) -> None:
    capped_store = await new_store([Message.user("go", id="u1")])
    free_store = await new_store([Message.user("go", id="u1")])
    capped: StateMachine[Flags] = StateMachine(
        [Tools([lookup]), ModelInference()], max_cycles=max_cycles
    )
    free: StateMachine[Flags] = StateMachine([Tools([lookup]), ModelInference()], max_cycles=None)
    model = tool_loop(stop_after=rounds)
    free_report = await free.run_report(Runtime(store=free_store, model=model), "s")
    assert free_report.reason.kind == YieldReason.DONE
    steps: list[str] = []
    for _ in range(2 * rounds + 2):
        report = await capped.run_report(Runtime(store=capped_store, model=model), "s")
        assert len(report.results) <= max_cycles
        steps += [r.step for r in report.results]
        if report.reason.kind != YieldReason.CYCLE_LIMIT:
            break
        assert len(report.results) == max_cycles
    assert report.reason.kind == YieldReason.DONE
    assert steps == [r.step for r in free_report.results]
    assert [m.text for m in report.session.conversation] == [
        m.text for m in free_report.session.conversation
    ]


class YieldAtOnce(Operation[Flags]):
    name = "checkpoint"

    async def run(self, ctx: StepContext[Flags]) -> Outcome:
        if ctx.session.data.cleared:
            return Refuse()
        return Yield([UpdateData.set(cleared=("x",))], "checkpoint")


async def test_a_yield_on_the_last_allowed_cycle_keeps_its_own_reason() -> None:
    store = await new_store()
    report = await StateMachine([YieldAtOnce()], max_cycles=1).run_report(Runtime(store=store), "s")
    assert report.reason.kind == "checkpoint"


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "10"])
def test_max_cycles_must_be_none_or_a_positive_integer(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="max_cycles"):
        StateMachine([YieldAtOnce()], max_cycles=bad)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), True, "10"])
def test_finalize_timeout_must_be_a_positive_number(bad: Any) -> None:
    """With 0 or less, finalize was cancelled before it began: a result that existed at the
    cancellation was never recorded (its call left open, later answered "outcome unknown")."""
    with pytest.raises(ConfigurationError, match=rf"finalize_timeout.*{bad!r}"):
        StateMachine([YieldAtOnce()], finalize_timeout=bad)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3", None])
def test_max_conflicts_must_be_a_non_negative_integer(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match=rf"max_conflicts.*{bad!r}"):
        StateMachine([YieldAtOnce()], max_conflicts=bad)


def test_finalize_timeout_and_max_conflicts_accept_their_ranges() -> None:
    machine = StateMachine([YieldAtOnce()], max_conflicts=0, finalize_timeout=float("inf"))
    assert (machine.max_conflicts, machine.finalize_timeout) == (0, float("inf"))
