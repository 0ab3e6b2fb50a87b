"""The testing kit: scripted and function models, run_step, make_session."""

from __future__ import annotations

from typing import Any

import anyio.lowlevel
import msgspec
import pytest

from stepmachine import (
    AppendMessage,
    Continue,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    NoData,
    Operation,
    Outcome,
    Refuse,
    Runtime,
    StepContext,
    TextDelta,
    TextPart,
    ToolCallPart,
    UnexpectedModelCallError,
    Usage,
    Yield,
)
from stepmachine.extend import StreamChunk, TextChunk, ToolCallChunk, counter_ids
from stepmachine.testing import (
    FunctionModel,
    ScriptedModel,
    call,
    make_session,
    reply,
    run_step,
    stream_response,
)

# Steps written for earlier releases still commit through ctx.commit: it works, with a
# DeprecationWarning (test_machine.py checks the warning itself).
pytestmark = pytest.mark.filterwarnings(
    "ignore:StepContext.commit is deprecated:DeprecationWarning"
)


def request(*texts: str) -> ModelRequest:
    return ModelRequest(messages=tuple(Message.user(t, id=f"u{i}") for i, t in enumerate(texts)))


# -- ScriptedModel -------------------------------------------------------------------------------


async def test_scripted_model_answers_turns_in_order() -> None:
    model = ScriptedModel(["one", reply("two"), lambda req: reply(f"echo {len(req.messages)}")])
    assert (await model.request(request("a"))).parts == (TextPart("one"),)
    assert (await model.request(request("a"))).parts == (TextPart("two"),)
    assert (await model.request(request("a", "b"))).parts == (TextPart("echo 2"),)
    assert len(model.requests) == 3
    assert model.requests[2] == request("a", "b")


async def test_scripted_model_out_of_turns_names_the_call_number() -> None:
    model = ScriptedModel(["only"])
    await model.request(request("a"))
    with pytest.raises(UnexpectedModelCallError, match="#2") as excinfo:
        await model.request(request("last words"))
    assert "1 turn(s)" in str(excinfo.value)
    assert "last words" in str(excinfo.value)
    assert len(model.requests) == 1  # the failed call is not recorded as a used turn
    with pytest.raises(UnexpectedModelCallError, match="#2"):
        await model.request(request("again"))


async def test_empty_script_fails_on_first_call() -> None:
    with pytest.raises(UnexpectedModelCallError, match="#1"):
        await ScriptedModel([]).request(ModelRequest(messages=()))


async def test_unused_and_assert_all_used() -> None:
    model = ScriptedModel(["a", "b", "c"], name="script-x")
    assert model.unused == ["a", "b", "c"]
    with pytest.raises(AssertionError, match="3 scripted turn"):
        model.assert_all_used()
    await model.request(request("q"))
    assert model.unused == ["b", "c"]
    with pytest.raises(AssertionError, match="script-x") as excinfo:
        model.assert_all_used()
    assert "'b'" in str(excinfo.value)
    await model.request(request("q"))
    await model.request(request("q"))
    assert model.unused == []
    model.assert_all_used()  # does not raise


async def test_call_ids_are_numbered_by_turn_and_index() -> None:
    model = ScriptedModel(
        [
            call(("a", {}), ("b", {"x": 1})),
            "text turn",
            call(("c", {}), ToolCallPart.of("explicit", "d", {}), ("e", {}), text="hm"),
        ]
    )
    first = await model.request(request("q"))
    await model.request(request("q"))
    third = await model.request(request("q"))
    assert [p.call_id for p in first.parts if isinstance(p, ToolCallPart)] == [
        "call-0-0",
        "call-0-1",
    ]
    assert [p.call_id for p in third.parts if isinstance(p, ToolCallPart)] == [
        "call-2-0",
        "explicit",
        "call-2-2",
    ]
    assert third.parts[0] == TextPart("hm")
    assert first.finish_reason == "tool_calls"


def test_call_and_reply_build_responses() -> None:
    response = call(("add", {"a": 1}))
    (part,) = response.parts
    assert isinstance(part, ToolCallPart)
    assert (part.name, part.arguments, part.call_id) == ("add", {"a": 1}, "")
    assert msgspec.json.decode(part.raw_arguments) == {"a": 1}
    bad = ToolCallPart.parse("id", "add", "{oops")
    assert call(bad).parts == (bad,)
    answer = reply("hi", reasoning="think", usage=Usage(input_tokens=1))
    assert [type(p).__name__ for p in answer.parts] == ["ReasoningPart", "TextPart"]
    assert answer.usage == Usage(input_tokens=1)
    assert answer.finish_reason == "stop"
    assert reply("x").usage == Usage(input_tokens=10, output_tokens=5)


async def test_scripted_model_streams_the_same_response() -> None:
    response = call(("add", {"a": 123456789}), text="some text to stream")
    chunks: list[StreamChunk] = []

    async def sink(chunk: StreamChunk) -> None:
        chunks.append(chunk)

    streamed = await ScriptedModel([response], chunk_size=4).request(request("q"), on_chunk=sink)
    plain = await ScriptedModel([response], chunk_size=4).request(request("q"))
    assert streamed == plain
    text = "".join(c.text for c in chunks if isinstance(c, TextChunk))
    assert text == "some text to stream"
    tool_chunks = [c for c in chunks if isinstance(c, ToolCallChunk)]
    assert tool_chunks[0].call_id == "call-0-0"
    assert tool_chunks[0].name == "add"
    assert all(c.call_id is None for c in tool_chunks[1:])
    assert "".join(c.arguments_delta for c in tool_chunks) == plain.parts[1].raw_arguments  # type: ignore[union-attr]


async def test_stream_response_checkpoints_between_chunks() -> None:
    """Cancellation can land mid-stream: a cancelled scope stops it before the next chunk."""
    chunks: list[StreamChunk] = []
    with anyio.CancelScope() as scope:

        async def sink(chunk: StreamChunk) -> None:
            chunks.append(chunk)
            scope.cancel()

        await stream_response(reply("a" * 40), sink, chunk_size=8)
    assert scope.cancelled_caught
    assert len(chunks) == 1


# -- FunctionModel -------------------------------------------------------------------------------


async def test_function_model_sync_function() -> None:
    model = FunctionModel(lambda req: reply(f"{len(req.messages)} messages"), name="fn")
    assert model.name == "fn"
    response = await model.request(request("a", "b"))
    assert response.parts == (TextPart("2 messages"),)
    assert model.calls == 1


async def test_function_model_async_function() -> None:
    async def answer(req: ModelRequest) -> ModelResponse:
        await anyio.lowlevel.checkpoint()
        return reply("async " + req.messages[-1].text)

    model = FunctionModel(answer)
    assert (await model.request(request("x"))).parts == (TextPart("async x"),)
    assert (await model.request(request("y"))).parts == (TextPart("async y"),)
    assert model.calls == 2
    assert model.name == "function"


async def test_function_model_numbers_calls_by_history() -> None:
    model = FunctionModel(lambda req: call(("t", {}), ("u", {})))
    history = (
        Message.user("q", id="u0"),
        Message.assistant("a", id="a0"),
        Message.user("q", id="u1"),
    )
    first = await model.request(ModelRequest(messages=history))
    ids = [p.call_id for p in first.parts if isinstance(p, ToolCallPart)]
    assert len(set(ids)) == 2
    assert ids[0].endswith("-0")
    assert ids[1].endswith("-1")
    # The same history gives the same ids (a fresh process continues identically)...
    again = await model.request(ModelRequest(messages=history))
    assert [p.call_id for p in again.parts if isinstance(p, ToolCallPart)] == ids
    # ...and another history, even of the same length, other ids.
    other = (*history[:2], Message.user("q", id="u9"))
    moved = await model.request(ModelRequest(messages=other))
    assert not set(ids) & {p.call_id for p in moved.parts if isinstance(p, ToolCallPart)}


async def test_function_model_streams() -> None:
    chunks: list[StreamChunk] = []

    async def sink(chunk: StreamChunk) -> None:
        chunks.append(chunk)

    response = await FunctionModel(lambda req: reply("streamed text"), chunk_size=3).request(
        request("q"), on_chunk=sink
    )
    assert "".join(c.text for c in chunks if isinstance(c, TextChunk)) == "streamed text"
    assert response.parts == (TextPart("streamed text"),)


# -- run_step ----------------------------------------------------------------------------------


class Echo(Operation[Any]):
    """Appends an assistant message repeating the last user text."""

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        last = ctx.session.conversation[-1]
        if last.role != "user":
            return Refuse("nothing to echo")
        await ctx.emit(TextDelta(last.text))
        return Continue([AppendMessage(Message.assistant(last.text, id=ctx.new_id()))])


async def test_run_step_reports_outcome_effects_session_and_events() -> None:
    session = make_session("hello")
    check = await run_step(Echo(), session)
    assert check.continued
    assert not check.refused
    assert not check.yielded
    assert check.effects == (AppendMessage(Message.assistant("hello", id="id1")),)
    assert check.session.revision == session.revision + 1
    assert check.new_messages == (Message.assistant("hello", id="id1"),)
    assert [e.data for e in check.events] == [TextDelta("hello")]
    assert check.events[0].session_id == "test-session"
    assert check.ctx.session.id == "test-session"
    assert check.before == session


async def test_run_step_refused_leaves_session() -> None:
    session = make_session("hi", Message.assistant("a", id="a"))
    check = await run_step(Echo(), session)
    assert check.refused
    assert check.effects == ()
    assert check.session is session
    assert check.new_messages == ()


async def test_run_step_with_model_and_custom_runtime() -> None:
    check = await run_step(ModelInference(), make_session("q"), model=ScriptedModel(["answer"]))
    assert check.yielded
    assert isinstance(check.outcome, Yield)
    assert check.new_messages[0].text == "answer"
    runtime = Runtime(model=ScriptedModel(["x"]), ids=counter_ids("z"))
    check = await run_step(ModelInference(), make_session("q"), runtime=runtime)
    assert check.new_messages[0].id == "z1"


async def test_run_step_needs_no_store() -> None:
    """A step that commits on its own works without any store."""

    class Journal(Operation[Any]):
        async def run(self, ctx: StepContext[Any]) -> Outcome:
            await ctx.commit([AppendMessage(Message.assistant("noted", id=ctx.new_id()))])
            return Continue([AppendMessage(Message.assistant("done", id=ctx.new_id()))])

    check = await run_step(Journal(), make_session("q"))
    assert check.commits == ((AppendMessage(Message.assistant("noted", id="id1")),),)
    assert [m.text for m in check.new_messages] == ["noted", "done"]
    assert check.session.revision == 2


# -- make_session --------------------------------------------------------------------------------


def test_make_session() -> None:
    custom = Message.system("sys", id="s")
    session = make_session("first", custom, "third", session_id="abc", revision=5)
    assert session.id == "abc"
    assert session.revision == 5
    assert session.data == NoData()
    assert session.conversation == (
        Message.user("first", id="u0"),
        custom,
        Message.user("third", id="u2"),
    )


def test_make_session_defaults_and_data() -> None:
    class Data(msgspec.Struct, frozen=True):
        n: int = 0

    session = make_session(data=Data(3))
    assert session.conversation == ()
    assert session.id == "test-session"
    assert session.revision == 0
    assert session.data == Data(3)
