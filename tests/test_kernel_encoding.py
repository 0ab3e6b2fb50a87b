"""Kernel values through msgspec: requests encode as they are, sessions with the hooks.

A session's conversation is a :class:`~stepmachine.Conversation` (chunks
shared between sessions), which msgspec encodes only with
``Conversation.enc_hook`` and decodes with ``Conversation.dec_hook``; every
other kernel value (messages, parts, effects, model requests, which copy a
conversation into a tuple) encodes as it is. These properties check the round trips over random
conversations, across chunk boundaries, for JSON and for builtins.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepmachine import (
    Annotate,
    AppendMessage,
    Codec,
    Message,
    ModelRequest,
    ModelSettings,
    NoData,
    PromptPart,
    ReasoningPart,
    ReplaceConversation,
    Session,
    SetVisibility,
    TextPart,
    ToolCallPart,
    ToolResultPart,
)
from stepmachine._conversation import CHUNK
from stepmachine.extend import Conversation, apply_batch

TEXT = st.text(max_size=12)
PARTS = st.lists(
    st.one_of(
        st.builds(TextPart, TEXT),
        st.builds(ReasoningPart, TEXT),
        st.builds(
            lambda c, n, a: ToolCallPart.of(c, n, {"a": a}),
            st.sampled_from(["c1", "c2"]),
            st.sampled_from(["read", "write"]),
            st.integers(-5, 5) | TEXT,
        ),
        st.builds(
            lambda c, content, error: ToolResultPart(call_id=c, content=content, is_error=error),
            st.sampled_from(["c1", "c2"]),
            TEXT,
            st.booleans(),
        ),
    ),
    max_size=3,
).map(tuple)
NOTES = st.sampled_from([{}, {"app": {"k": 1}}, {"app": {"nested": [1, "x", None]}}])


def message(n: int, role: str, parts: tuple[Any, ...], notes: Any, shown: bool) -> Message:
    return Message(
        id=f"m{n}",
        role=role,
        parts=parts,
        notes=notes,
        visible_to_model=shown,  # type: ignore[arg-type]
    )


MESSAGE_FIELDS = st.tuples(
    st.sampled_from(["user", "assistant", "tool", "system"]), PARTS, NOTES, st.booleans()
)
LENGTH = st.one_of(st.integers(0, 2 * CHUNK + 2), st.sampled_from([CHUNK - 1, CHUNK, CHUNK + 1]))


@st.composite
def sessions(draw: st.DrawFn) -> Session[NoData]:
    """A session grown by effects: its conversation shares chunks with earlier ones."""
    fields = draw(st.lists(MESSAGE_FIELDS, min_size=draw(LENGTH), max_size=2 * CHUNK + 2))
    session: Session[NoData] = Session(id="s", revision=0, conversation=(), data=NoData())
    effects: list[Any] = [AppendMessage(message(n, *values)) for n, values in enumerate(fields)]
    if fields and draw(st.booleans()):
        effects.append(Annotate("m0", "later", {"v": draw(TEXT)}))
    if fields and draw(st.booleans()):
        effects.append(SetVisibility((f"m{len(fields) - 1}",), to_model=False))
    session = apply_batch(session, effects)
    assert type(session.conversation) is Conversation
    return session


def encode(value: Any) -> bytes:
    return msgspec.json.encode(value, enc_hook=Conversation.enc_hook)


# Each example is a session of up to 130 messages across chunk boundaries (50 examples hold
# thousands of messages); the same strategy feeds the two tests below.
@settings(max_examples=50, deadline=None)
@given(sessions())
def test_a_session_round_trips_through_json_and_builtins(session: Session[NoData]) -> None:
    data = encode(session)
    decoded = msgspec.json.decode(data, type=Session[NoData], dec_hook=Conversation.dec_hook)
    assert decoded == session
    assert type(decoded.conversation) is Conversation
    assert data == Codec().encode_session(session)  # the hook encodes as the codec stores
    builtins = msgspec.to_builtins(session, enc_hook=Conversation.enc_hook)
    assert [m["id"] for m in builtins["conversation"]] == [m.id for m in session.conversation]
    converted = msgspec.convert(builtins, Session[NoData], dec_hook=Conversation.dec_hook)
    assert converted == session
    assert converted.history.open_calls() == session.history.open_calls()


@settings(max_examples=50, deadline=None)
@given(sessions(), st.integers(1, 5) | st.none(), TEXT)
def test_a_model_request_round_trips_through_json_and_builtins(
    session: Session[NoData], attempts: int | None, prompt: str
) -> None:
    request = ModelRequest(
        messages=session.visible_to_model,  # the session's Conversation, as ModelInference sends
        prompt_parts=(PromptPart(source="test", text=prompt),),
        settings=ModelSettings(max_tokens=attempts, extra={"k": [1, 2]}),
        max_attempts=attempts,
        output_schema={"type": "object"} if attempts else None,
    )
    assert type(request.messages) is tuple  # a value of its own: plain msgspec encodes it
    decoded = msgspec.json.decode(msgspec.json.encode(request), type=ModelRequest)
    assert decoded == request
    assert list(decoded.messages) == list(session.visible_to_model)
    assert msgspec.convert(msgspec.to_builtins(request), ModelRequest) == request


@settings(max_examples=50, deadline=None)
@given(sessions())
def test_messages_and_effects_encode_with_plain_msgspec(session: Session[NoData]) -> None:
    codec = Codec()
    effects = (
        *(AppendMessage(m) for m in session.conversation),
        ReplaceConversation(session.conversation),  # converted to a tuple when built
        Annotate("m0", "ns", {"k": [1]}),
    )
    for effect in effects:
        assert msgspec.to_builtins(effect) == msgspec.to_builtins(
            codec.decode_effects(codec.encode_effects((effect,)), where="t")[0]
        )
    for item in session.conversation:
        assert msgspec.json.decode(msgspec.json.encode(item), type=Message) == item


def test_the_decoding_hook_refuses_other_types_and_bad_messages() -> None:
    with pytest.raises(NotImplementedError):
        Conversation.dec_hook(dict, {})
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(
            b'{"id":"s","revision":0,"conversation":[{"id":1}],"data":{}}',
            type=Session[NoData],
            dec_hook=Conversation.dec_hook,
        )


def test_a_model_request_from_a_list_holds_a_tuple_and_encodes_with_plain_msgspec() -> None:
    request = ModelRequest(messages=[Message.user("hi", id="u")])
    assert type(request.messages) is tuple
    encoded = msgspec.json.encode(request)  # no enc_hook
    assert msgspec.json.decode(encoded, type=ModelRequest) == request
    assert msgspec.to_builtins(request)["messages"][0]["id"] == "u"


def test_a_model_request_holding_a_conversation_encodes_with_plain_msgspec() -> None:
    session = Session(id="s", revision=0, conversation=(Message.user("hi", id="u"),), data=NoData())
    request = ModelRequest(messages=session.conversation)
    assert type(request.messages) is tuple
    encoded = msgspec.json.decode(msgspec.json.encode(request))  # no enc_hook
    assert [m["id"] for m in encoded["messages"]] == ["u"]
