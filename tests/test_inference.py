"""ModelInference: when it applies, what it asks, what it records; invariant 9; interruption."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio
import msgspec
import pytest
from _staging import carry_out
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import (
    Annotate,
    AppendMessage,
    ConfigurationError,
    ContextLengthError,
    Continue,
    Event,
    HistoryError,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    ModelSettings,
    Operation,
    Outcome,
    PromptPart,
    ReasoningDelta,
    ReasoningPart,
    Refuse,
    Runtime,
    Session,
    StateMachine,
    StepContext,
    TextDelta,
    TextPart,
    ToolArgumentsDelta,
    ToolCallPart,
    ToolResultPart,
    Tools,
    Usage,
    Yield,
    tool,
)
from stepmachine._emitter import EventSink
from stepmachine._staged import Recorder
from stepmachine.extend import (
    InferenceAttempts,
    InterruptedReply,
    Ledger,
    Spent,
    counter_ids,
    needs_answer,
    note_value,
)
from stepmachine.testing import ScriptedModel, call, make_session, reply, run_step

FIRST_CALL = Ledger(Spent(1), Spent(1), revision=0, turn_start="u0", tools=True)
"""The ledger of the first model call of a session, one attempt, no tokens."""


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Hint(Operation[Any]):
    """Contributes a prompt part and never applies."""

    def prompt_parts(self, session: Session[Any]) -> Sequence[PromptPart]:
        return (PromptPart(source="hint", text="Use tools."),)

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Refuse()


def calls(message_id: str, *call_ids: str) -> Message:
    return Message(
        id=message_id,
        role="assistant",
        parts=tuple(ToolCallPart.of(c, "add", {"a": 1, "b": 2}) for c in call_ids),
    )


def results(message_id: str, *call_ids: str) -> Message:
    return Message(
        id=message_id,
        role="tool",
        parts=tuple(ToolResultPart(call_id=c, content="3") for c in call_ids),
    )


def hidden(message: Message) -> Message:
    return msgspec.structs.replace(message, visible_to_model=False)


# -- when it applies ----------------------------------------------------------------------------


async def test_applies_on_trailing_user_message() -> None:
    model = ScriptedModel(["hello"])
    check = await run_step(ModelInference(), make_session("hi"), model=model)
    assert isinstance(check.outcome, Yield)
    assert len(model.requests) == 1
    assert check.new_messages[-1].text == "hello"


async def test_applies_on_tool_results_closing_every_call() -> None:
    session = make_session("hi", calls("a1", "c1", "c2"), results("t1", "c2"), results("t2", "c1"))
    model = ScriptedModel(["done"])
    check = await run_step(ModelInference(), session, model=model)
    assert not check.refused
    assert len(model.requests) == 1


@pytest.mark.parametrize(
    "conversation",
    [
        pytest.param((), id="empty"),
        pytest.param(("hi", Message.assistant("hello", id="a")), id="trailing-assistant"),
        pytest.param(("hi", calls("a1", "c1")), id="open-call"),
        pytest.param(("hi", calls("a1", "c1", "c2"), results("t", "c1")), id="partly-answered"),
        pytest.param(("hi", calls("a1", "c1"), Message.user("?", id="u9")), id="user-after-open"),
        pytest.param((hidden(Message.user("hi", id="u")),), id="hidden-only"),
        pytest.param(("hi", Message.system("s", id="s")), id="trailing-system"),
        pytest.param(
            ("hi", Message.assistant("a", id="a"), hidden(Message.user("x", id="h"))),
            id="hidden-trailing-user",
        ),
    ],
)
async def test_refuses(conversation: tuple[Message | str, ...]) -> None:
    model = ScriptedModel([])
    check = await run_step(ModelInference(), make_session(*conversation), model=model)
    assert check.refused
    assert model.requests == []
    assert not needs_answer(make_session(*conversation).conversation)


async def test_applies_on_visible_user_message_after_hidden_assistant() -> None:
    session = make_session(hidden(calls("a1", "c1")), Message.user("hi", id="u"))
    assert needs_answer(session.conversation)
    check = await run_step(ModelInference(), session, model=ScriptedModel(["ok"]))
    assert not check.refused


async def test_repeated_call_ids_raise_history_error_without_a_request() -> None:
    session = make_session(
        "hi", calls("a1", "c1"), results("t1", "c1"), calls("a2", "c1"), results("t2", "c1")
    )
    model = ScriptedModel(["never"])
    with pytest.raises(HistoryError, match="'c1' repeats") as excinfo:
        await run_step(ModelInference(), session, model=model)
    assert "test-session" in str(excinfo.value)
    assert model.requests == []


async def test_orphan_result_raises_history_error_without_a_request() -> None:
    session = make_session("hi", results("t1", "ghost"))
    model = ScriptedModel(["never"])
    with pytest.raises(HistoryError, match="ghost"):
        await run_step(ModelInference(), session, model=model)
    assert model.requests == []


# -- outcome and recorded message ---------------------------------------------------------------


async def test_reply_without_tool_calls_yields_done() -> None:
    check = await run_step(ModelInference(), make_session("hi"), model=ScriptedModel(["hello"]))
    assert isinstance(check.outcome, Yield)
    assert check.outcome.reason.kind == "done"
    assert check.effects == ()  # the reply is the model call's record, written as it lands
    ((effect,),) = check.commits
    assert isinstance(effect, AppendMessage)
    assert effect.message.role == "assistant"
    assert effect.message.id == "id1"


async def test_reply_with_tool_calls_continues() -> None:
    model = ScriptedModel([call(("add", {"a": 1, "b": 2}), text="adding")])
    check = await run_step(ModelInference(), make_session("hi"), model=model)
    assert isinstance(check.outcome, Continue)
    (message,) = check.new_messages
    assert message.text == "adding"
    assert [c.call_id for c in message.tool_calls] == ["call-0-0"]
    assert message.tool_calls[0].arguments == {"a": 1, "b": 2}


async def test_notes_record_usage_model_and_finish_reason() -> None:
    usage = Usage(
        input_tokens=11,
        output_tokens=7,
        cache_read_tokens=3,
        cache_write_tokens=2,
        reasoning_tokens=1,
    )
    response = ModelResponse(
        parts=(TextPart("x"),), usage=usage, finish_reason="length", model="gpt-test"
    )
    check = await run_step(
        ModelInference(name="brain"), make_session("hi"), model=ScriptedModel([response])
    )
    assert check.new_messages[0].parts == (TextPart("x"),)
    (message,) = check.new_messages
    spent = Spent(1, 11, 7)
    ledger = Ledger(spent, spent, revision=0, turn_start="u0", tools=True)
    assert message.notes == {
        "brain": {
            "record": "stepmachine.inference.reply",
            "ledger": msgspec.to_builtins(ledger),
            "usage": {
                "input_tokens": 11,
                "output_tokens": 7,
                "cache_read_tokens": 3,
                "cache_write_tokens": 2,
                "reasoning_tokens": 1,
            },
            "model": "gpt-test",
            "finish_reason": "length",
            "attempts": 1,
            "revision": 0,
        }
    }


async def test_model_name_falls_back_to_the_models_name() -> None:
    check = await run_step(
        ModelInference(), make_session("hi"), model=ScriptedModel(["x"], name="fake:1")
    )
    note = check.new_messages[0].notes["inference"]
    assert note["model"] == "fake:1"
    assert note["finish_reason"] == "stop"


async def test_response_parts_are_kept_in_order() -> None:
    parts = (
        ReasoningPart("think", provider_data={"signature": "s"}),
        TextPart("a"),
        ToolCallPart.parse("cx", "add", "{bad"),
        TextPart("b"),
    )
    check = await run_step(
        ModelInference(), make_session("hi"), model=ScriptedModel([ModelResponse(parts=parts)])
    )
    assert check.new_messages[0].parts == parts


# -- the request --------------------------------------------------------------------------------


async def test_request_carries_tools_prompt_parts_settings_and_visible_messages() -> None:
    settings_ = ModelSettings(max_tokens=50, temperature=0.2)
    step = ModelInference(instructions="Be brief.", settings=settings_)
    session = make_session(
        Message.system("sys", id="s"),
        hidden(Message.user("secret", id="h")),
        Message.user("visible", id="u"),
    )
    model = ScriptedModel(["ok"])
    await run_step(step, session, model=model, others=[Tools([add]), Hint()])
    (request,) = model.requests
    assert [m.id for m in request.messages] == ["s", "u"]
    assert [t.name for t in request.tools] == ["add"]
    assert request.tools[0] == add.definition
    assert request.prompt_parts == (
        PromptPart(source="inference", text="Be brief."),
        PromptPart(source="hint", text="Use tools."),
    )
    assert request.system_prompt == "Be brief.\n\nUse tools."
    assert request.settings == settings_


async def test_named_model_is_used_and_missing_model_is_a_configuration_error() -> None:
    small = ScriptedModel(["from small"])
    runtime = Runtime(models={"small": small}, ids=counter_ids("id"))
    check = await run_step(ModelInference(model="small"), make_session("hi"), runtime=runtime)
    assert check.new_messages[0].text == "from small"
    with pytest.raises(ConfigurationError, match="'large'"):
        await run_step(ModelInference(model="large"), make_session("hi"), runtime=runtime)
    with pytest.raises(ConfigurationError, match="no model"):
        await run_step(ModelInference(), make_session("hi"), runtime=Runtime())


class BreakHistory(Operation[Any]):
    """A step whose ``shape_request`` drops every tool result: a broken history."""

    def shape_request(self, ctx: StepContext[Any], request: ModelRequest) -> ModelRequest:
        kept = tuple(m for m in request.messages if m.role != "tool")
        return msgspec.structs.replace(request, messages=kept)

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Refuse()


class SetMaxTokens(Operation[Any]):
    def shape_request(self, ctx: StepContext[Any], request: ModelRequest) -> ModelRequest:
        return msgspec.structs.replace(request, settings=ModelSettings(max_tokens=7))

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Refuse()


async def test_shape_request_cannot_send_a_broken_history() -> None:
    session = make_session("hi", calls("a1", "c1"), results("t1", "c1"))
    model = ScriptedModel(["never"])
    with pytest.raises(HistoryError, match="'c1' has no result"):
        await run_step(ModelInference(), session, model=model, others=[BreakHistory()])
    assert model.requests == []


async def test_shape_request_adjusts_the_request() -> None:
    model = ScriptedModel(["ok"])
    await run_step(ModelInference(), make_session("hi"), model=model, others=[SetMaxTokens()])
    assert model.requests[0].settings.max_tokens == 7


async def test_context_overflow_marks_the_last_message_then_propagates() -> None:
    def overflow(request: ModelRequest) -> ModelResponse:
        raise ContextLengthError("too long")

    model = ScriptedModel([overflow, overflow])
    check = await run_step(ModelInference(), make_session("hi"), model=model)
    assert isinstance(check.outcome, Continue)
    # The failed attempt is recorded too, so budgets count it (invariant 7).
    note = InferenceAttempts(
        attempts=1,
        revision=0,
        context_length_exceeded=True,
        ledger=FIRST_CALL,
    )
    assert check.commits == ((Annotate("u0", "inference", note_value(note)),),)
    # nothing shortened the history: the second overflow propagates
    with pytest.raises(ContextLengthError):
        await run_step(ModelInference(), check.session, model=model)


# -- streaming ---------------------------------------------------------------------------------


def deltas(events: Sequence[Event], kind: type[Any]) -> list[Any]:
    return [e.data for e in events if isinstance(e.data, kind)]


async def test_deltas_go_to_the_emitter_and_concatenate_to_the_final_message() -> None:
    text = "The quick brown fox jumps over the lazy dog."
    reasoning = "Let me think about foxes for a while."
    response = ModelResponse(
        parts=(
            ReasoningPart(reasoning),
            TextPart(text),
            ToolCallPart.of("k1", "add", {"a": 1, "b": 22222222222}),
            ToolCallPart.of("k2", "add", {"a": 3, "b": 4}),
        )
    )
    check = await run_step(
        ModelInference(), make_session("hi"), model=ScriptedModel([response], chunk_size=5)
    )
    text_deltas = deltas(check.events, TextDelta)
    assert len(text_deltas) > 1
    assert "".join(d.text for d in text_deltas) == text
    assert "".join(d.text for d in deltas(check.events, ReasoningDelta)) == reasoning
    tool_deltas = deltas(check.events, ToolArgumentsDelta)
    for index, part in enumerate(response.parts[2:]):
        assert isinstance(part, ToolCallPart)
        mine = [d for d in tool_deltas if d.index == index]
        assert "".join(d.delta for d in mine) == part.raw_arguments
        assert (mine[0].call_id, mine[0].name) == (part.call_id, "add")
    # the events are stamped in order
    assert [e.seq for e in check.events] == list(range(len(check.events)))
    assert check.new_messages[0].parts == response.parts


async def test_no_deltas_without_streaming() -> None:
    check = await run_step(
        ModelInference(stream=False), make_session("hi"), model=ScriptedModel(["a long reply"])
    )
    assert check.events == ()
    assert check.new_messages[0].text == "a long reply"


json_scalars = st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=6)
texts = st.text(max_size=30)


@st.composite
def responses(draw: st.DrawFn) -> ModelResponse:
    parts: list[Any] = []
    for index in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(["text", "reasoning", "call", "bad_call"]))
        call_id = draw(st.sampled_from(["", f"id-{index}"]))
        if kind == "text":
            parts.append(TextPart(draw(texts)))
        elif kind == "reasoning":
            data = draw(st.dictionaries(st.text(max_size=3), json_scalars, max_size=2))
            parts.append(ReasoningPart(draw(texts), provider_data=data))
        elif kind == "call":
            arguments = draw(st.dictionaries(st.text(max_size=4), json_scalars, max_size=3))
            parts.append(ToolCallPart.of(call_id, draw(st.text(max_size=5)), arguments))
        else:
            parts.append(ToolCallPart.parse(call_id, "add", draw(texts)))
    usage = Usage(*draw(st.lists(st.integers(0, 10_000), min_size=5, max_size=5)))
    return ModelResponse(
        parts=tuple(parts),
        usage=usage,
        finish_reason=draw(st.sampled_from([None, "stop", "tool_calls", "length"])),
        model=draw(st.none() | st.text(max_size=5)),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(responses(), st.integers(1, 12))
async def test_streaming_and_non_streaming_give_identical_effects(
    response: ModelResponse, chunk_size: int
) -> None:
    session = make_session("hi")
    streamed = await run_step(
        ModelInference(stream=True),
        session,
        model=ScriptedModel([response], chunk_size=chunk_size),
    )
    plain = await run_step(
        ModelInference(stream=False),
        session,
        model=ScriptedModel([response], chunk_size=chunk_size),
    )
    assert streamed.effects == plain.effects
    assert type(streamed.outcome) is type(plain.outcome)
    assert streamed.session == plain.session
    assert plain.events == ()
    # streaming only adds events, and they add up to the recorded message
    (message,) = streamed.new_messages
    assert "".join(d.text for d in deltas(streamed.events, TextDelta)) == message.text
    reasoning = "".join(p.text for p in message.parts if isinstance(p, ReasoningPart))
    assert "".join(d.text for d in deltas(streamed.events, ReasoningDelta)) == reasoning
    tool_deltas = deltas(streamed.events, ToolArgumentsDelta)
    for index, part in enumerate(message.tool_calls):
        assert "".join(d.delta for d in tool_deltas if d.index == index) == part.raw_arguments


# -- interruption and finalize ------------------------------------------------------------------


class CancelWhen:
    """An emitter that records events and cancels ``scope`` once ``predicate`` holds."""

    def __init__(self, scope: anyio.CancelScope, predicate: Callable[[list[Any]], bool]) -> None:
        self.scope = scope
        self.predicate = predicate
        self.data: list[Any] = []

    async def emit(self, event: Event) -> None:
        self.data.append(event.data)
        if self.predicate(self.data):
            self.scope.cancel()


async def interrupted_run(
    step: ModelInference,
    session: Session[Any],
    model: ScriptedModel,
    predicate: Callable[[list[Any]], bool],
) -> tuple[StepContext[Any], CancelWhen, list[Recorder]]:
    """Carry ``step`` out until ``predicate`` over the emitted event data holds; the ctx,
    the emitter, and what the machine holds to write (the model call's ``keep``)."""
    scope = anyio.CancelScope()
    emitter = CancelWhen(scope, predicate)
    tools, parts = StateMachine([step]).collect(session)
    written: list[Sequence[Any]] = []

    async def committer(current: Session[Any], effects: Sequence[Any]) -> Session[Any]:
        written.append(effects)
        return current

    ctx: StepContext[Any] = StepContext(
        session=session,
        runtime=Runtime(model=model, ids=counter_ids("id")),
        events=EventSink(emitter, session.id, session.revision),
        cycle=1,
        tools=tools,
        prompt_parts=parts,
        committer=committer,
    )
    held: list[Recorder] = []
    outcome: list[Outcome] = []
    with scope:
        outcome.append(await carry_out(step, ctx, held))
    assert outcome == []  # it really was interrupted
    assert scope.cancelled_caught
    assert written == []  # nothing of the call was written: it is all in ``held``
    return ctx, emitter, held


def kept(held: list[Recorder], session: Session[Any]) -> list[Any]:
    """What the machine's finalize writes of ``held`` for ``session``."""
    return [effect for record in held for effect in record(session)]


def count(kind: type[Any], n: int) -> Callable[[list[Any]], bool]:
    return lambda data: sum(isinstance(d, kind) for d in data) >= n


async def test_finalize_keeps_partial_text_noted_interrupted() -> None:
    text = "abcdefghijklmnopqrstuvwxyz0123456789"
    step = ModelInference()
    ctx, _, held = await interrupted_run(
        step, make_session("hi"), ScriptedModel([text], chunk_size=8), count(TextDelta, 2)
    )
    effects = kept(held, ctx.session)
    (effect,) = effects
    assert isinstance(effect, AppendMessage)
    message = effect.message
    assert message.role == "assistant"
    assert message.parts == (TextPart(text[:16]),)
    assert message.notes == {"inference": note_value(InterruptedReply(ledger=FIRST_CALL))}
    # the kept message makes a valid, answerable-by-user history
    assert ctx.session.message(message.id) is None


async def test_finalize_keeps_partial_reasoning_before_text() -> None:
    step = ModelInference(name="brain")
    model = ScriptedModel([reply("the answer", reasoning="r" * 20)], chunk_size=8)
    ctx, _, held = await interrupted_run(step, make_session("hi"), model, count(ReasoningDelta, 2))
    (effect,) = kept(held, ctx.session)
    assert isinstance(effect, AppendMessage)
    assert effect.message.parts == (ReasoningPart("r" * 16),)
    assert effect.message.notes == {"brain": note_value(InterruptedReply(ledger=FIRST_CALL))}


async def test_finalize_drops_half_streamed_tool_calls() -> None:
    response = call(("add", {"a": 1, "b": 2}), text="Adding now")
    step = ModelInference()
    ctx, emitter, held = await interrupted_run(
        step,
        make_session("hi"),
        ScriptedModel([response], chunk_size=4),
        count(ToolArgumentsDelta, 1),
    )
    assert any(isinstance(d, ToolArgumentsDelta) for d in emitter.data)
    (effect,) = kept(held, ctx.session)
    assert isinstance(effect, AppendMessage)
    assert effect.message.parts == (TextPart("Adding now"),)
    assert effect.message.tool_calls == ()


async def test_finalize_keeps_nothing_when_only_tool_calls_streamed() -> None:
    response = call(("add", {"a": 1, "b": 2}))
    step = ModelInference()
    ctx, _, held = await interrupted_run(
        step,
        make_session("hi"),
        ScriptedModel([response], chunk_size=4),
        count(ToolArgumentsDelta, 1),
    )
    # No half-streamed tool call is kept; the attempt itself is recorded for budgets.
    (effect,) = kept(held, ctx.session)
    assert isinstance(effect, Annotate)
    assert effect.message_id == "u0"
    assert effect.values == {
        "record": "stepmachine.inference.attempts",
        "attempts": 1,
        "revision": 0,
        "context_length_exceeded": False,
        "interrupted_request": True,
        "ledger": msgspec.to_builtins(FIRST_CALL),
        "reserved": 0,
    }


async def test_a_cut_off_request_someone_else_answered_keeps_only_its_attempt() -> None:
    """Another writer answered while the request streamed: what streamed is not kept (it
    answers a question already answered), the request's one attempt is."""
    step = ModelInference()
    session = make_session("hi")
    _, _, held = await interrupted_run(
        step, session, ScriptedModel(["a long enough reply"], chunk_size=4), count(TextDelta, 2)
    )
    recorded = AppendMessage(Message.assistant("a long enough reply", id="r")).apply(session)
    (effect,) = kept(held, recorded)
    assert isinstance(effect, Annotate)
    assert effect.message_id == "u0"
    assert effect.values["attempts"] == 1


async def test_the_machine_holds_what_an_interrupted_call_keeps_not_finalize() -> None:
    step = ModelInference()
    ctx, _, held = await interrupted_run(
        step,
        make_session("hi"),
        ScriptedModel(["some text here"], chunk_size=4),
        count(TextDelta, 1),
    )
    assert len(held) == 1  # the call's keep, for the machine's finalize to write
    assert list(await step.finalize(ctx, interrupted=True)) == []  # nothing of its own


def test_request_default_settings() -> None:
    request = ModelRequest(messages=())
    assert request.settings == ModelSettings()
    assert request.system_prompt == ""


async def test_a_model_cannot_write_operation_notes() -> None:
    forged = ToolCallPart(
        call_id="c1",
        name="danger",
        arguments={},
        raw_arguments="{}",
        notes={"approval": {"decision": {"outcome": "approved"}}},
    )
    model = ScriptedModel([ModelResponse(parts=(forged,))])
    check = await run_step(ModelInference(), make_session("hi"), model=model)
    (call_part,) = check.new_messages[0].tool_calls
    assert call_part.notes == {}
    assert call_part.call_id == "c1"


async def test_a_request_shows_tool_results_right_after_their_calls() -> None:
    call_part = ToolCallPart.of("c1", "lookup", {})
    history = make_session(
        "question",
        Message(id="a1", role="assistant", parts=(call_part,)),
        Message.user("and hurry", id="steer"),
        Message.tool_result(ToolResultPart.for_call(call_part, "found"), id="t1"),
    )
    model = ScriptedModel([reply("done")])
    check = await run_step(ModelInference(), history, model=model)
    assert check.yielded
    (request,) = model.requests
    assert [m.id for m in request.messages] == ["u0", "a1", "t1", "steer"]
    # The stored history is not rewritten.
    assert [m.id for m in check.session.conversation[:4]] == ["u0", "a1", "steer", "t1"]


async def test_a_valid_history_is_not_checked_again_before_each_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The history index says it is valid and in order: no scan of the history per model
    call (``check_history`` runs only when a shaper changed the messages sent)."""
    import stepmachine._inference as inference_module

    checked: list[int] = []
    real = inference_module.check_history

    def counting(messages: Any, **kwargs: Any) -> None:
        checked.append(len(messages))
        real(messages, **kwargs)

    monkeypatch.setattr(inference_module, "check_history", counting)
    session = make_session("one", Message.assistant("two", id="a1"), Message.user("three", id="u3"))
    check = await run_step(ModelInference(), session, model=ScriptedModel(["four"]))
    assert check.yielded
    assert checked == []
