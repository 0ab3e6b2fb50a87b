"""Public constructors check their field types (issue 8, item 22).

Every message, part, kernel effect and session constructor (and the factory
classmethods) rejects a wrong-typed value with ``InvalidFieldError`` -- a
``TypeError`` and ``ValueError`` -- naming the field, the expected type and the
type of the value given; right-typed values construct. Property-tested over
every constructor and field.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stepmachine._session as session_module
from stepmachine import (
    Annotate,
    AppendMessage,
    Codec,
    InvalidFieldError,
    Message,
    NoData,
    ReasoningPart,
    ReplaceConversation,
    Session,
    SetVisibility,
    StepmachineError,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    UpdateData,
)
from stepmachine._checks import tuple_of
from stepmachine.extend import Conversation, apply_batch
from stepmachine.stores import MemoryStore

CALL = ToolCallPart.of("c1", "add", {"a": 1})
RESULT = ToolResultPart(call_id="c1", content="2")
USER = Message.user("hi", id="u1")
PARTS = (TextPart("t"), CALL, RESULT, ReasoningPart(text="r"))
ASSISTANT_PARTS = (TextPart("t"), CALL, ReasoningPart(text="r"))
PART_TYPES = (TextPart, ToolCallPart, ToolResultPart, ReasoningPart)


class Data(msgspec.Struct, frozen=True):
    n: int = 0


# -- what each field accepts ------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """A field (or factory argument): values that fit, and which values are accepted."""

    valid: st.SearchStrategy[Any]
    accepts: Callable[[Any], bool]


def _str() -> Field:
    return Field(st.text(max_size=5), lambda v: isinstance(v, str))


def _bool() -> Field:
    return Field(st.booleans(), lambda v: isinstance(v, bool))


def _optional(field: Field) -> Field:
    return Field(st.none() | field.valid, lambda v: v is None or field.accepts(v))


def _dict() -> Field:
    return Field(
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
        lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
    )


def _notes() -> Field:
    return Field(
        st.dictionaries(st.text(max_size=3), st.just({"k": 1}), max_size=2),
        lambda v: (
            isinstance(v, dict)
            and all(isinstance(k, str) and isinstance(x, dict) for k, x in v.items())
        ),
    )


def _items(types: tuple[type, ...], items: st.SearchStrategy[Any], max_size: int = 3) -> Field:
    return Field(
        st.lists(items, max_size=max_size).map(tuple),
        lambda v: isinstance(v, list | tuple) and all(isinstance(x, types) for x in v),
    )


def _instance(*types: type, example: Any) -> Field:
    return Field(st.just(example), lambda v: isinstance(v, types))


ROLES = ("user", "assistant", "tool", "system")


def _assistant_content(value: Any) -> bool:
    if isinstance(value, str | TextPart | ToolCallPart | ReasoningPart):
        return True
    return isinstance(value, list | tuple) and all(
        isinstance(x, str | TextPart | ToolCallPart | ReasoningPart) for x in value
    )


def _new_session(**kwargs: Any) -> Session[Any]:
    return Codec(Data).new_session(
        kwargs["session_id"], kwargs["data"], conversation=kwargs["conversation"]
    )


CONSTRUCTORS: dict[str, tuple[Callable[..., Any], dict[str, Field]]] = {
    "TextPart": (TextPart, {"text": _str()}),
    "ToolCallPart": (
        ToolCallPart,
        {
            "call_id": _str(),
            "name": _str(),
            "arguments": Field(st.none() | st.just({"a": 1}), lambda v: True),
            "raw_arguments": _str(),
            "notes": _notes(),
        },
    ),
    "ToolCallPart.parse": (
        ToolCallPart.parse,
        {"call_id": _str(), "name": _str(), "raw_arguments": _str()},
    ),
    "ToolCallPart.of": (
        ToolCallPart.of,
        {"call_id": _str(), "name": _str(), "arguments": _dict()},
    ),
    "ToolResultPart": (
        ToolResultPart,
        {"call_id": _str(), "content": _str(), "is_error": _bool(), "name": _str()},
    ),
    "ToolResultPart.for_call": (
        ToolResultPart.for_call,
        {
            "call": _instance(ToolCallPart, example=CALL),
            "content": _str(),
            "is_error": _bool(),
        },
    ),
    "ReasoningPart": (ReasoningPart, {"text": _str(), "provider_data": _dict()}),
    "Message": (
        Message,
        {
            "id": _str(),
            "role": Field(st.sampled_from(ROLES), lambda v: isinstance(v, str) and v in ROLES),
            "parts": _items(PART_TYPES, st.sampled_from(PARTS)),
            "notes": _notes(),
            "visible_to_model": _bool(),
            "visible_to_user": _bool(),
        },
    ),
    "Message.user": (Message.user, {"text": _str(), "id": _str()}),
    "Message.system": (Message.system, {"text": _str(), "id": _str()}),
    "Message.assistant": (
        Message.assistant,
        {
            "content": Field(
                st.text(max_size=3)
                | st.sampled_from(ASSISTANT_PARTS)
                | st.lists(st.text(max_size=3) | st.sampled_from(ASSISTANT_PARTS), max_size=3),
                _assistant_content,
            ),
            "id": _str(),
        },
    ),
    "Message.tool_result": (
        Message.tool_result,
        {
            "result": _instance(ToolResultPart, example=RESULT),
            "id": _str(),
            "notes": _optional(_notes()),
        },
    ),
    "AppendMessage": (AppendMessage, {"message": _instance(Message, example=USER)}),
    "ReplaceConversation": (
        ReplaceConversation,
        {"conversation": _items((Message,), st.just(USER))},
    ),
    "Annotate": (
        Annotate,
        {
            "message_id": _str(),
            "namespace": _str(),
            "values": _dict(),
            "call_id": _optional(_str()),
        },
    ),
    "SetVisibility": (
        SetVisibility,
        {
            "message_ids": _items((str,), st.text(max_size=3)),
            "to_model": _optional(_bool()),
            "to_user": _optional(_bool()),
        },
    ),
    "UpdateData": (UpdateData, {"changes": _dict()}),
    "Session": (
        Session,
        {
            "id": _str(),
            "revision": Field(
                st.integers(0, 10),
                lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
            ),
            "conversation": _items((Message,), st.just(USER)),
            "data": _instance(msgspec.Struct, example=NoData()),
        },
    ),
    "Codec.new_session": (
        _new_session,
        {
            "session_id": _str(),
            "data": Field(st.just(Data()), lambda v: isinstance(v, Data)),
            "conversation": _items((Message,), st.just(USER), max_size=1),  # ids are unique
        },
    ),
}
# Codec.new_session checks data itself (ConfigurationError, as before); only the rest here.
NOT_CORRUPTED = {("Codec.new_session", "data")}
# ... and names the Session field its session_id becomes
REPORTED_AS = {("Codec.new_session", "session_id"): "id"}

WRONG = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.lists(st.integers(), min_size=1, max_size=2),
    st.lists(st.text(max_size=2), max_size=2),
    st.tuples(st.integers()),
    st.dictionaries(st.integers(), st.integers(), min_size=1, max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.sampled_from([*PARTS, USER, NoData(), object(), ["x", CALL], (CALL, 1)]),
)


@st.composite
def valid_arguments(draw: Any, name: str) -> dict[str, Any]:
    _, fields = CONSTRUCTORS[name]
    return {field: draw(spec.valid) for field, spec in fields.items()}


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", sorted(CONSTRUCTORS))
@SETTINGS
@given(st.data())
def test_right_typed_arguments_construct(name: str, data: st.DataObject) -> None:
    build, _ = CONSTRUCTORS[name]
    arguments = data.draw(valid_arguments(name))
    built = build(**arguments)
    assert built is not None
    # tuple fields given as lists come back as tuples, so values stay hashable and equal;
    # a session's conversation comes back as a Conversation (equal to the tuple)
    for field in ("parts", "conversation", "message_ids"):
        if hasattr(built, field):
            value = getattr(built, field)
            if isinstance(built, Session) and field == "conversation":
                assert type(value) is Conversation
                assert value == tuple(value)
            else:
                assert type(value) is tuple


@pytest.mark.parametrize("name", sorted(CONSTRUCTORS))
@SETTINGS
@given(st.data())
def test_a_wrong_typed_argument_raises_naming_field_expected_type_and_value_type(
    name: str, data: st.DataObject
) -> None:
    build, fields = CONSTRUCTORS[name]
    arguments = data.draw(valid_arguments(name))
    field = data.draw(
        st.sampled_from([f for f in sorted(fields) if (name, f) not in NOT_CORRUPTED])
    )
    wrong = data.draw(WRONG.filter(lambda v: not fields[field].accepts(v)))
    arguments[field] = wrong
    with pytest.raises(InvalidFieldError) as info:
        build(**arguments)
    error = info.value
    assert isinstance(error, TypeError)
    assert isinstance(error, ValueError)
    assert isinstance(error, StepmachineError)
    message = str(error)
    # the field (or, for a bad item, the field with its index) and the value's type
    reported = REPORTED_AS.get((name, field), field)
    assert error.field.split("[")[0].removesuffix(" key") == reported, message
    assert f".{reported}" in message
    assert "expected " in message
    assert error.expected in message
    assert f"got {type(error.value).__name__}" in message


# -- specific cases ------------------------------------------------------------------------


def test_the_reported_mistake_is_now_a_clear_error_or_the_meant_message() -> None:
    call = ToolCallPart.of("c1", "add", {"a": 1})
    # the report: a list of parts given to Message.assistant made a TextPart holding a list;
    # a list of parts now means those parts
    message = Message.assistant([call], id="a1")
    assert message.parts == (call,)
    mixed = Message.assistant(["Let me add.", call], id="a2")
    assert mixed.parts == (TextPart("Let me add."), call)
    # a part that does not belong in an assistant message is refused, naming its position
    with pytest.raises(InvalidFieldError, match=r"Message\.assistant\.content\[1\]: .*ToolResult"):
        Message.assistant(["ok", RESULT], id="a3")
    # the Struct itself no longer takes a list where a str belongs
    with pytest.raises(InvalidFieldError, match=r"TextPart\.text: expected str, got list"):
        TextPart([call])  # type: ignore[arg-type]


def test_messages_nested_wrongly_name_the_item() -> None:
    with pytest.raises(InvalidFieldError) as info:
        Message(id="m", role="assistant", parts=[[CALL]])  # type: ignore[arg-type]
    assert info.value.field == "parts[0]"
    assert "got list" in str(info.value)
    with pytest.raises(InvalidFieldError, match=r"Message\.role: expected one of"):
        Message(id="m", role="robot", parts=())  # type: ignore[arg-type]


def test_replace_checks_too() -> None:
    with pytest.raises(InvalidFieldError, match=r"Message\.visible_to_model: expected bool"):
        msgspec.structs.replace(USER, visible_to_model=0)
    session = Session(id="s", revision=0, conversation=(USER,), data=NoData())
    with pytest.raises(InvalidFieldError, match=r"Session\.conversation\[1\]: expected Message"):
        msgspec.structs.replace(session, conversation=(USER, "hello"))
    # a list is converted, and the session stays equal to its tuple twin
    listed = msgspec.structs.replace(session, conversation=[USER])
    assert listed == session


def test_a_bare_string_is_not_taken_for_a_sequence_of_ids() -> None:
    with pytest.raises(InvalidFieldError, match=r"SetVisibility\.message_ids: expected a tuple"):
        SetVisibility("m1")  # type: ignore[arg-type]


def test_decoding_still_reports_stored_data_errors() -> None:
    codec: Codec[NoData] = Codec()
    # Every field written (the codec leaves the default visibility out, issue 9).
    raw = msgspec.json.encode(USER).replace(b'"visible_to_model":true', b'"visible_to_model":1')
    with pytest.raises(StepmachineError):
        codec.decode_message(raw)


async def test_store_create_rejects_a_conversation_of_strings_clearly() -> None:
    store = MemoryStore()
    with pytest.raises(InvalidFieldError, match=r"Session\.conversation\[0\]: expected Message"):
        await store.create("s", conversation=["hello"])  # type: ignore[list-item]
    with pytest.raises(InvalidFieldError, match=r"Session\.conversation: expected a tuple"):
        await store.create("s", conversation="hello")  # type: ignore[arg-type]


def test_nothing_outside_a_session_keeps_its_conversation_alive() -> None:
    """State is the session (invariant 1): building one leaves no reference behind.

    A process-wide memo of "checked" conversations kept the last few alive
    after every session holding them was dropped (a deleted session's messages
    stayed in memory).
    """
    conversation = tuple(Message.user(f"m{i}", id=f"m{i}") for i in range(3))
    before = sys.getrefcount(conversation)
    session = Session(id="s", revision=0, conversation=conversation, data=NoData())
    built = sys.getrefcount(conversation)
    assert built == before + 1  # the session's own field, nothing else
    applied = apply_batch(session, [AppendMessage(Message.user("x", id="x"))])
    grown = applied.conversation
    held = sys.getrefcount(grown)
    assert held == 3  # ``applied``, ``grown`` and getrefcount's argument


def test_kernel_effects_do_not_recheck_the_conversation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Applying a kernel effect checks only what is new, never every message again."""
    checked: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
        checked.append(len(args[2]))
        return tuple_of(*args, **kwargs)

    session = Session(
        id="s",
        revision=0,
        conversation=tuple(Message.user(f"m{i}", id=f"m{i}") for i in range(50)),
        data=Data(),
    )
    monkeypatch.setattr(session_module, "tuple_of", counting)
    after = apply_batch(
        session,
        [
            AppendMessage(Message.user("x", id="x")),
            Annotate("m0", "ns", {"k": 1}),
            SetVisibility(("m1",), to_model=False),
            UpdateData.set(n=3),
        ],
    )
    assert (after.revision, after.data, len(after.conversation)) == (1, Data(n=3), 51)
    assert checked == []


def test_a_session_built_from_a_conversation_is_checked_every_time() -> None:
    """A conversation once accepted is no pass for later sessions: each is checked."""
    good = (USER,)
    Session(id="s", revision=0, conversation=good, data=NoData())
    with pytest.raises(InvalidFieldError, match=r"conversation\[1\]"):
        Session(id="s", revision=0, conversation=(*good, "x"), data=NoData())  # type: ignore[arg-type]
