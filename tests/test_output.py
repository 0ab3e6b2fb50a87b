"""StructuredOutput: tool, native and prompted modes; validation, re-prompts, storage."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from _scans import context as scan_context
from _scans import counted, tool_loop

from stepmachine import (
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    StateMachine,
    Store,
    StoredDataError,
    ToolCallPart,
    Tools,
    tool,
)
from stepmachine.extend import YieldReason, counter_ids, history_problems, note_value
from stepmachine.operations._budget import FEEDBACK, Budget, Limits
from stepmachine.operations._invalid_calls import InvalidCalls
from stepmachine.operations._output import (
    OUTPUT_INVALID,
    NoOutputError,
    OutputValue,
    StructuredOutput,
    read_output,
)
from stepmachine.testing import FunctionModel, ScriptedModel, call, make_session, reply, run_step


class City(msgspec.Struct, frozen=True):
    name: str
    population: int


ran: list[str] = []


@tool(side_effects="pure")
def lookup(name: str) -> str:
    """Look a city up."""
    ran.append(name)
    return f"{name}: 700000 people"


@pytest.fixture(autouse=True)
def _reset() -> None:
    ran.clear()


def asking(*calls: ToolCallPart) -> Message:
    return Message(id="a1", role="assistant", parts=calls)


OSLO = {"name": "Oslo", "population": 700000}


# -- single step --------------------------------------------------------------------------


async def test_tool_mode_advertises_the_output_tool_and_answers_a_valid_call() -> None:
    op = StructuredOutput(City)
    definition = op.tools(make_session())[0]
    assert definition.name == "final_result"
    assert definition.parameters["required"] == ["name", "population"]
    session = make_session("which city?", asking(ToolCallPart.of("c1", "final_result", OSLO)))
    check = await run_step(op, session)
    assert check.yielded
    reason = check.outcome.reason  # type: ignore[union-attr]
    assert reason.kind == YieldReason.DONE
    assert reason.data == {"output": OSLO}
    assert read_output(check.session, City) == City("Oslo", 700000)
    assert not history_problems(check.session.conversation)
    # the same turn asked again: done again, no effects, no model call
    again = await run_step(op, check.session)
    assert again.yielded
    assert not again.effects
    assert again.outcome.reason.data == {"output": OSLO}  # type: ignore[union-attr]


async def test_tool_mode_output_call_never_reaches_tools_and_ends_siblings_early() -> None:
    op = StructuredOutput(City)
    tools = Tools([lookup])
    session = make_session(
        "which city?",
        asking(
            ToolCallPart.of("c1", "lookup", {"name": "Oslo"}),
            ToolCallPart.of("c2", "final_result", OSLO),
        ),
    )
    assert (await run_step(tools, session, others=[op])).refused
    assert ran == []
    check = await run_step(op, session, others=[tools])
    results = {r.call_id: r for m in check.new_messages for r in m.tool_results}
    assert results["c1"].is_error
    assert "final result" in results["c1"].content
    assert not results["c2"].is_error


async def test_tool_mode_invalid_call_gets_an_error_result_then_gives_up() -> None:
    op = StructuredOutput(City, max_retries=1)
    bad = ToolCallPart.of("c1", "final_result", {"name": "Oslo"})
    check = await run_step(op, make_session("q", asking(bad)))
    assert check.continued
    result = check.new_messages[0].tool_results[0]
    assert result.is_error
    assert "population" in result.content
    second = ToolCallPart.of("c2", "final_result", {"name": 1, "population": 2})
    retried = make_session(*check.session.conversation, asking_as("a2", second))
    check = await run_step(op, retried, runtime=Runtime(ids=counter_ids("r")))
    assert check.yielded
    assert check.outcome.reason.kind == OUTPUT_INVALID  # type: ignore[union-attr]


def asking_as(message_id: str, *calls: ToolCallPart) -> Message:
    return Message(id=message_id, role="assistant", parts=calls)


async def test_non_object_types_are_wrapped() -> None:
    op = StructuredOutput(list[int])
    assert op.tools(make_session())[0].parameters["required"] == ["response"]
    session = make_session("q", asking(ToolCallPart.of("c1", "final_result", {"response": [1, 2]})))
    check = await run_step(op, session)
    assert check.outcome.reason.data == {"output": [1, 2]}  # type: ignore[union-attr]
    assert read_output(check.session, list[int]) == [1, 2]


async def test_native_mode_shapes_the_request_and_validates_text() -> None:
    op = StructuredOutput(City, "native")
    ctx = (await run_step(op, make_session())).ctx
    request = op.shape_request(ctx, ModelRequest(messages=()))
    assert request.output_schema == op.schema
    assert request.output_name == "final_result"
    assert op.tools(make_session()) == ()
    check = await run_step(
        op, make_session("q", Message.assistant('{"name": "Oslo", "population": 1}', id="a1"))
    )
    assert check.yielded
    assert read_output(check.session, City) == City("Oslo", 1)


async def test_prompted_mode_offers_the_schema_and_reprompts_invalid_text() -> None:
    op = StructuredOutput(City, "prompted")
    assert '"population"' in op.prompt_parts(make_session())[0].text
    check = await run_step(op, make_session("q", Message.assistant("Oslo, I think", id="a1")))
    assert check.continued
    feedback = check.new_messages[0]
    assert feedback.role == "user"
    assert FEEDBACK in feedback.notes
    assert not feedback.visible_to_user
    assert "not valid JSON" in feedback.text
    assert check.session.message("a1").notes["output"]["error"]  # type: ignore[union-attr]
    fenced = make_session(
        "q", Message.assistant('```json\n{"name": "Oslo", "population": 2}\n```', id="a1")
    )
    assert (await run_step(op, fenced)).yielded


async def test_read_output_without_output_raises() -> None:
    with pytest.raises(NoOutputError):
        read_output(make_session("q"), City)


# -- whole runs ---------------------------------------------------------------------------------


async def test_tool_mode_whole_run_standalone(store: Store) -> None:
    await store.create("s", conversation=[Message.user("biggest city in Norway?", id="u0")])
    model = ScriptedModel(
        [
            call(("lookup", {"name": "Oslo"})),
            call(("final_result", {"name": "Oslo"})),  # invalid: re-prompted with an error result
            call(("final_result", OSLO)),
        ]
    )
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    machine = StateMachine(
        [StructuredOutput(City), InvalidCalls("stop"), Tools([lookup]), ModelInference()]
    )
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == YieldReason.DONE
    assert report.reason.data == {"output": OSLO}
    assert ran == ["Oslo"]
    model.assert_all_used()
    assert "final_result" in [d.name for d in model.requests[0].tools]
    stored = await store.load("s")
    assert read_output(stored, City) == City("Oslo", 700000)
    report = await machine.run_report(runtime, "s")  # asked again: the same answer, no call
    assert report.reason.data == {"output": OSLO}
    assert len(model.requests) == 3


@pytest.mark.parametrize("mode", ["native", "prompted"])
async def test_wrapped_inference_validates_within_the_run(store: Store, mode: Any) -> None:
    await store.create("s", conversation=[Message.user("a city?", id="u0")])
    replies = iter(["Oslo!", '{"name": "Oslo"}', '{"name": "Oslo", "population": 700000}'])
    seen: list[ModelRequest] = []

    def answer(request: ModelRequest) -> ModelResponse:
        seen.append(request)
        return reply(next(replies))

    runtime = Runtime(store=store, model=FunctionModel(answer), ids=counter_ids())
    op = StructuredOutput(City, mode, inference=ModelInference(), max_retries=2)
    report = await StateMachine([op]).run_report(runtime, "s")
    assert report.reason.kind == YieldReason.DONE
    assert report.reason.data == {"output": OSLO}
    assert len(seen) == 3
    if mode == "native":
        assert all(r.output_schema == op.schema for r in seen)
    else:
        assert any('"population"' in p.text for p in seen[0].prompt_parts)
    assert read_output(await store.load("s"), City).population == 700000
    assert all(not history_problems(r.messages) for r in seen)


async def test_reprompts_respect_the_budget(store: Store) -> None:
    await store.create("s", conversation=[Message.user("a city?", id="u0")])
    model = FunctionModel(lambda r: reply("not json"))
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    machine = StateMachine(
        [
            Budget(per_turn=Limits(model_calls=2)),
            StructuredOutput(City, "native", inference=ModelInference(), max_retries=5),
        ]
    )
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == YieldReason.BUDGET_EXHAUSTED
    assert model.calls == 2


async def test_retries_exhausted_yields_output_invalid(store: Store) -> None:
    await store.create("s", conversation=[Message.user("a city?", id="u0")])
    model = FunctionModel(lambda r: reply("[]"))
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    machine = StateMachine(
        [StructuredOutput(City, "prompted", inference=ModelInference(), max_retries=1)]
    )
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == OUTPUT_INVALID
    assert model.calls == 2
    report = await machine.run_report(runtime, "s")  # no new user message: no new call
    assert report.reason.kind == OUTPUT_INVALID
    assert model.calls == 2


# -- stored shapes and cost ------------------------------------------------------------------


async def test_outputs_stored_before_records_were_typed_still_read() -> None:
    final = msgspec.structs.replace(
        Message.assistant('{"name": "Oslo", "population": 700000}', id="a9"),
        notes={"output": {"output": OSLO, "mode": "native"}},
    )
    session = make_session("which city?", final)
    assert read_output(session, City) == City("Oslo", 700000)
    check = await run_step(StructuredOutput(City, "native"), session)
    assert check.yielded
    assert check.outcome.reason.data == {"output": OSLO}  # type: ignore[union-attr]
    damaged = msgspec.structs.replace(final, notes={"output": {"output": OSLO}})  # no mode
    with pytest.raises(StoredDataError, match=r"message 'a9'.*OutputValue"):
        read_output(make_session("which city?", damaged), City)


async def test_structured_output_reads_no_more_of_a_longer_history() -> None:
    """Re-yielding a settled turn and reading the output read the latest messages only."""
    step = StructuredOutput(City, "native")
    reads = []
    for turns in (5, 200):
        final = msgspec.structs.replace(
            Message.assistant("{}", id="final"),
            notes={"output": note_value(OutputValue(output=OSLO, mode="native"))},
        )
        hidden = msgspec.structs.replace(Message.user("old", id="old"), visible_to_model=False)
        session = make_session(hidden, *tool_loop(turns), "which city?", final)
        session, conversation = counted(session)
        outcome = await step.run(scan_context(session))
        assert outcome.reason.data == {"output": OSLO}  # type: ignore[union-attr]
        assert read_output(session, City) == City("Oslo", 700000)
        reads.append(conversation.read)
    assert reads[0] == reads[1] < 10
