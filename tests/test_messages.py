"""Messages and their parts: codec round trips, parsing of raw arguments, helpers, tag stability."""

from __future__ import annotations

import msgspec
import pytest

from stepmachine import (
    Codec,
    Message,
    ReasoningPart,
    TextPart,
    ToolCallPart,
    ToolResultPart,
)

CODEC = Codec()


# -- tag strings are stable: the exact bytes each part encodes to ------------------------


@pytest.mark.parametrize(
    ("part", "expected"),
    [
        (TextPart("hi"), b'{"type":"text","text":"hi"}'),
        (
            ToolCallPart(call_id="c1", name="add", arguments={"a": 1}, raw_arguments='{"a":1}'),
            (  # stored once: the codec leaves out the arguments the raw string gives (issue 9)
                b'{"type":"tool_call","call_id":"c1","name":"add",'
                b'"raw_arguments":"{\\"a\\":1}","notes":{}}'
            ),
        ),
        (
            ToolResultPart(call_id="c1", content="3"),
            b'{"type":"tool_result","call_id":"c1","content":"3","is_error":false,"name":""}',
        ),
        (
            ReasoningPart(text="hmm", provider_data={"signature": "sig"}),
            b'{"type":"reasoning","text":"hmm","provider_data":{"signature":"sig"}}',
        ),
    ],
    ids=["text", "tool_call", "tool_result", "reasoning"],
)
def test_part_encodes_to_exact_stable_json(part: object, expected: bytes) -> None:
    message = Message(id="m1", role="assistant", parts=(part,))  # type: ignore[arg-type]
    encoded = CODEC.encode_message(message)
    assert encoded == (
        b'{"id":"m1","role":"assistant","parts":['
        + expected
        + b"]}"  # the default notes and visibility are left out (issue 9)
    )
    assert msgspec.json.encode(message).endswith(
        b'],"notes":{},"visible_to_model":true,"visible_to_user":true}'
    )


def test_stored_bytes_of_every_part_type_decode_to_the_same_parts() -> None:
    """An old record, written literally, still decodes (tags never change)."""
    raw = (
        b'{"id":"m","role":"assistant","parts":['
        b'{"type":"reasoning","text":"r","provider_data":{"sig":"x"}},'
        b'{"type":"text","text":"t"},'
        b'{"type":"tool_call","call_id":"c","name":"n","arguments":{"k":[1]},'
        b'"raw_arguments":"{\\"k\\":[1]}","notes":{"ns":{"a":1}}},'
        b'{"type":"tool_result","call_id":"c","content":"ok","is_error":true,"name":"n"}'
        b'],"notes":{"op":{"did":true}},"visible_to_model":false,"visible_to_user":true}'
    )
    message = CODEC.decode_message(raw)
    assert message.parts == (
        ReasoningPart(text="r", provider_data={"sig": "x"}),
        TextPart("t"),
        ToolCallPart(
            call_id="c",
            name="n",
            arguments={"k": [1]},
            raw_arguments='{"k":[1]}',
            notes={"ns": {"a": 1}},
        ),
        ToolResultPart(call_id="c", content="ok", is_error=True, name="n"),
    )
    assert message.notes == {"op": {"did": True}}
    assert message.visible_to_model is False
    assert message.visible_to_user is True


# -- round trips -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "part",
    [
        TextPart(""),
        TextPart('héllo \u2603 \n\t"quoted"'),
        ToolCallPart.of("c1", "add", {"a": 1, "b": [1, 2.5, None, True], "c": {"d": "e"}}),
        ToolCallPart.parse("c2", "broken", "{not json"),
        ToolCallPart.parse("c3", "empty", ""),
        ToolCallPart(
            call_id="c4", name="n", arguments=[1, 2], raw_arguments="[1,2]", notes={"a": {"b": 1}}
        ),
        ToolResultPart(call_id="c1", content="3"),
        ToolResultPart(call_id="c1", content="boom", is_error=True, name="add"),
        ReasoningPart(text=""),
        ReasoningPart(text="thinking", provider_data={"signature": "abc", "n": [1, {"x": None}]}),
    ],
)
@pytest.mark.parametrize("role", ["user", "assistant", "tool", "system"])
def test_parts_round_trip_through_the_codec(part: object, role: str) -> None:
    message = Message(
        id="m1",
        role=role,  # type: ignore[arg-type]
        parts=(part,),  # type: ignore[arg-type]
        notes={"op": {"x": 1}},
        visible_to_model=False,
        visible_to_user=False,
    )
    decoded = CODEC.decode_message(CODEC.encode_message(message))
    assert decoded == message
    assert type(decoded.parts[0]) is type(part)


def test_message_with_many_parts_keeps_their_order() -> None:
    parts = (
        ReasoningPart("r"),
        TextPart("a"),
        ToolCallPart.of("c1", "x", {}),
        TextPart("b"),
        ToolCallPart.of("c2", "y", {"q": 1}),
    )
    message = Message(id="m", role="assistant", parts=parts)
    assert CODEC.decode_message(CODEC.encode_message(message)).parts == parts


# -- ToolCallPart.parse / of ---------------------------------------------------------------


def test_parse_valid_json_gives_arguments_and_keeps_raw() -> None:
    raw = '{ "a" : 1,  "b": "two" }'
    part = ToolCallPart.parse("c1", "add", raw)
    assert part.arguments == {"a": 1, "b": "two"}
    assert part.raw_arguments == raw
    assert part.call_id == "c1"
    assert part.name == "add"
    assert part.notes == {}


@pytest.mark.parametrize("raw", ["{not json", '{"a": 1', "{'a': 1}", "nan", '{"a": 1}}', "\x00"])
def test_parse_invalid_json_gives_none_and_keeps_the_raw_string(raw: str) -> None:
    part = ToolCallPart.parse("c1", "add", raw)
    assert part.arguments is None
    assert part.raw_arguments == raw


@pytest.mark.parametrize("raw", ["", "   ", "\n\t "])
def test_parse_empty_or_blank_string_gives_empty_object(raw: str) -> None:
    part = ToolCallPart.parse("c1", "noargs", raw)
    assert part.arguments == {}
    assert part.raw_arguments == raw


def test_parse_non_object_json_is_kept_as_parsed() -> None:
    """Valid JSON that is not an object parses; the tool step rejects it later."""
    assert ToolCallPart.parse("c", "n", "[1, 2]").arguments == [1, 2]
    assert ToolCallPart.parse("c", "n", "3").arguments == 3
    assert ToolCallPart.parse("c", "n", '"s"').arguments == "s"


def test_of_builds_raw_string_from_arguments() -> None:
    part = ToolCallPart.of("c1", "add", {"a": 1, "b": "x"})
    assert part.arguments == {"a": 1, "b": "x"}
    assert msgspec.json.decode(part.raw_arguments) == {"a": 1, "b": "x"}
    assert ToolCallPart.parse("c1", "add", part.raw_arguments) == part


def test_parts_are_frozen() -> None:
    part = TextPart("x")
    with pytest.raises(AttributeError):
        part.text = "y"  # type: ignore[misc]
    message = Message.user("x", id="m")
    with pytest.raises(AttributeError):
        message.id = "other"  # type: ignore[misc]


# -- Message helpers -------------------------------------------------------------------------


def test_message_constructors() -> None:
    assert Message.user("hi", id="u") == Message(id="u", role="user", parts=(TextPart("hi"),))
    assert Message.system("s", id="s").role == "system"
    assert Message.assistant("a", id="a").role == "assistant"
    message = Message.user("hi", id="u")
    assert message.notes == {}
    assert message.visible_to_model is True
    assert message.visible_to_user is True


def test_text_concatenates_only_text_parts_in_order() -> None:
    message = Message(
        id="m",
        role="assistant",
        parts=(
            ReasoningPart("not this"),
            TextPart("Hello, "),
            ToolCallPart.of("c1", "t", {}),
            TextPart("world"),
            ToolResultPart(call_id="c1", content="nor this"),
        ),
    )
    assert message.text == "Hello, world"
    assert Message(id="e", role="assistant", parts=()).text == ""


def test_tool_calls_and_results_helpers() -> None:
    c1 = ToolCallPart.of("c1", "a", {})
    c2 = ToolCallPart.of("c2", "b", {"x": 1})
    r1 = ToolResultPart(call_id="c1", content="1")
    r2 = ToolResultPart(call_id="c2", content="2", is_error=True)
    message = Message(id="m", role="assistant", parts=(TextPart("t"), c1, r1, c2, r2))
    assert message.tool_calls == (c1, c2)
    assert message.tool_results == (r1, r2)
    assert isinstance(message.tool_calls, tuple)
    assert isinstance(message.tool_results, tuple)
    plain = Message.user("x", id="u")
    assert plain.tool_calls == ()
    assert plain.tool_results == ()


def test_notes_default_is_not_shared_between_instances() -> None:
    a = Message.user("a", id="a")
    b = Message.user("b", id="b")
    a.notes["x"] = {"y": 1}
    assert b.notes == {}
    c1 = ToolCallPart.of("c1", "n", {})
    c2 = ToolCallPart.of("c2", "n", {})
    c1.notes["x"] = {}
    assert c2.notes == {}


def test_messages_parts_effects_and_batches_are_not_tracked_by_the_cyclic_gc() -> None:
    """Stored conversations cost full collections nothing (msgspec ``gc=False``)."""
    import gc

    from stepmachine import AppendMessage, ToolResultPart
    from stepmachine.extend import Batch

    call = ToolCallPart.of("c1", "lookup", {"key": ["a", {"b": 1}]})
    message = Message(
        id="m1",
        role="assistant",
        parts=(TextPart("hi"), call, ReasoningPart("thinking")),
        notes={"journal": {"intent": {"at": 1.0, "keys": ["x"]}}},
    )
    result = ToolResultPart(call_id="c1", content="done")
    effect = AppendMessage(message)
    batch = Batch(session_id="s", revision=1, step="x", cycle=0, timestamp=0.0, effects=(effect,))
    for value in (message, call, result, message.parts[0], message.parts[2], effect, batch):
        assert not gc.is_tracked(value), type(value).__name__
