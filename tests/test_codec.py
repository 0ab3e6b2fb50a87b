"""The Codec: invariant 8 (stored data is data), app effects, round trips, schema evolution."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import (
    Agent,
    Annotate,
    AppendMessage,
    Codec,
    ConfigurationError,
    Effect,
    InvalidFieldError,
    Message,
    NoData,
    ReasoningPart,
    ReplaceConversation,
    Session,
    SetVisibility,
    StepmachineError,
    Store,
    StoredDataError,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    UpdateData,
    submit,
)
from stepmachine.extend import KERNEL_EFFECTS, Batch, Conversation, Refusal
from stepmachine.stores import FileStore, SQLiteStore


class AppData(msgspec.Struct, frozen=True):
    count: int = 0
    labels: list[str] = msgspec.field(default_factory=list)
    owner: str | None = None


class FlagRaised(Effect, frozen=True, tag="test.flag_raised"):
    flag: str
    level: int = 1

    def apply(self, session: Session[Any]) -> Session[Any]:
        return session


class Unregistered(Effect, frozen=True, tag="test.unregistered"):
    def apply(self, session: Session[Any]) -> Session[Any]:
        return session


CODEC: Codec[AppData] = Codec(AppData, effects=[FlagRaised])


def batch_bytes(effects_json: bytes) -> bytes:
    return (
        b'{"session_id":"s1","revision":3,"step":"x","cycle":1,"timestamp":1.5,"effects":'
        + effects_json
        + b"}"
    )


# -- tags ----------------------------------------------------------------------------------


def test_kernel_effect_tags_are_stable() -> None:
    assert {t.__struct_config__.tag: t for t in KERNEL_EFFECTS} == {
        "append_message": AppendMessage,
        "replace_conversation": ReplaceConversation,
        "annotate": Annotate,
        "set_visibility": SetVisibility,
        "update_data": UpdateData,
    }
    assert CODEC.encode_effects(
        [
            Annotate(message_id="m", namespace="n", values={"a": 1}),
            SetVisibility(("m",), to_model=False),
            UpdateData(changes={"count": 1}),
            ReplaceConversation(()),
            AppendMessage(Message.user("x", id="m")),
        ]
    ) == (
        b'[{"type":"annotate","message_id":"m","namespace":"n","values":{"a":1},"call_id":null},'
        b'{"type":"set_visibility","message_ids":["m"],"to_model":false,"to_user":null},'
        b'{"type":"update_data","changes":{"count":1}},'
        b'{"type":"replace_conversation","conversation":[]},'
        # A message's default notes and visibility are left out (issue 9).
        b'{"type":"append_message","message":{"id":"m","role":"user","parts":'
        b'[{"type":"text","text":"x"}]}}]'
    )


# -- invariant 8: unknown tags ----------------------------------------------------------------


def test_unknown_effect_tag_names_tag_and_where_in_a_batch() -> None:
    buf = batch_bytes(b'[{"type":"test.flag_raised","flag":"a"},{"type":"myapp.gone","x":1}]')
    with pytest.raises(StoredDataError) as excinfo:
        CODEC.decode_batch(buf, where="session 's1' revision 3")
    message = str(excinfo.value)
    assert "myapp.gone" in message
    assert "session 's1' revision 3" in message
    assert "effects[1]" in message  # the position inside the record


def test_unknown_effect_tag_names_tag_and_where_in_effects() -> None:
    with pytest.raises(StoredDataError) as excinfo:
        CODEC.decode_effects(b'[{"type":"nope"}]', where="session 'abc' position 7")
    assert "'nope'" in str(excinfo.value)
    assert "session 'abc' position 7" in str(excinfo.value)


def test_unknown_part_tag_in_a_session_names_tag_and_where() -> None:
    # "image" was this test's unknown tag until image parts came (issue 14).
    buf = (
        b'{"id":"s","revision":0,"data":{},"conversation":[{"id":"m","role":"user",'
        b'"parts":[{"type":"hologram","url":"x"}]}]}'
    )
    with pytest.raises(StoredDataError) as excinfo:
        CODEC.decode_session(buf, where="session 's' snapshot")
    assert "'hologram'" in str(excinfo.value)
    assert "session 's' snapshot" in str(excinfo.value)


def test_app_effect_unknown_to_a_codec_without_it_is_refused() -> None:
    encoded = CODEC.encode_effects([FlagRaised("f")])
    with pytest.raises(StoredDataError, match=r"test\.flag_raised"):
        Codec(AppData).decode_effects(encoded)


# -- invariant 8: nothing constructed from names in the input -------------------------------


@pytest.mark.parametrize(
    "tag",
    [
        "os.system",
        "builtins.eval",
        "subprocess.Popen",
        "stepmachine._effects.AppendMessage",
        "stepmachine.AppendMessage",
        "AppendMessage",
        "tests.test_codec.FlagRaised",
        "FlagRaised",
        "Effect",
        "",
    ],
)
def test_class_names_in_the_input_are_never_resolved(tag: str) -> None:
    record = msgspec.json.encode(
        [{"type": tag, "message": {"id": "m", "role": "user", "parts": []}, "command": "echo"}]
    )
    with pytest.raises(StoredDataError):
        CODEC.decode_effects(record)


def test_missing_tag_is_refused() -> None:
    with pytest.raises(StoredDataError):
        CODEC.decode_effects(b'[{"message_id":"m","namespace":"n","values":{}}]')


def test_any_typed_fields_stay_plain_data() -> None:
    payload = {"__class__": "os.system", "type": "append_message", "py/object": "os.system"}
    effect = Annotate(message_id="m", namespace="n", values={"evil": payload})
    call = ToolCallPart(call_id="c", name="n", arguments=payload, raw_arguments="{}")
    decoded = CODEC.decode_effects(
        CODEC.encode_effects([effect, AppendMessage(Message("m", "assistant", (call,)))])
    )
    assert decoded[0].values == {"evil": payload}  # type: ignore[attr-defined]
    assert type(decoded[0].values["evil"]) is dict  # type: ignore[attr-defined]
    assert decoded[1].message.parts[0].arguments == payload  # type: ignore[attr-defined]
    assert type(decoded[1].message.parts[0].arguments) is dict  # type: ignore[attr-defined]


# -- invariant 8: malformed records -----------------------------------------------------------


@pytest.mark.parametrize(
    "buf",
    [b"", b"{", b'[{"type": ', b"not json", b"\xff\xfe", b"[1,]", b'[{"type":"annotate"}] x'],
)
def test_malformed_json_raises_stored_data_error(buf: bytes) -> None:
    for decode in (CODEC.decode_effects, CODEC.decode_batch, CODEC.decode_session):
        with pytest.raises(StoredDataError, match=r"where-\w+") as excinfo:
            decode(buf, where="where-" + decode.__name__)
        assert "stored data is data" in str(excinfo.value)


@pytest.mark.parametrize(
    ("effects_json", "fragment"),
    [
        (b'[{"type":"annotate","message_id":1,"namespace":"n","values":{}}]', "message_id"),
        (b'[{"type":"annotate","message_id":"m","namespace":"n","values":[]}]', "values"),
        (
            b'[{"type":"annotate","message_id":"m","namespace":"n","values":{},"call_id":5}]',
            "call_id",
        ),
        (b'[{"type":"set_visibility","message_ids":"m"}]', "message_ids"),
        (b'[{"type":"set_visibility","message_ids":["m"],"to_model":"yes"}]', "to_model"),
        (b'[{"type":"update_data","changes":null}]', "changes"),
        (
            b'[{"type":"append_message","message":{"id":"m","role":"robot","parts":[]}}]',
            "role",
        ),
        (b'[{"type":"append_message","message":{"id":"m","role":"user","parts":{}}}]', "parts"),
        (b'[{"type":"test.flag_raised","flag":"f","level":"high"}]', "level"),
        (b'{"type":"update_data","changes":{}}', "Expected `array`"),
    ],
)
def test_wrong_field_types_raise_stored_data_error(effects_json: bytes, fragment: str) -> None:
    with pytest.raises(StoredDataError) as excinfo:
        CODEC.decode_effects(effects_json, where="session 'q' revision 2")
    assert fragment in str(excinfo.value)
    assert "session 'q' revision 2" in str(excinfo.value)


@pytest.mark.parametrize(
    ("effects_json", "field"),
    [
        (b'[{"type":"append_message"}]', "message"),
        (b'[{"type":"annotate","message_id":"m","values":{}}]', "namespace"),
        (b'[{"type":"set_visibility"}]', "message_ids"),
        (b'[{"type":"test.flag_raised"}]', "flag"),
        (b'[{"type":"append_message","message":{"id":"m","parts":[]}}]', "role"),
        (
            (
                b'[{"type":"append_message","message":{"id":"m","role":"assistant","parts":'
                b'[{"type":"tool_call","call_id":"c","name":"n","arguments":{}}]}}]'
            ),
            "raw_arguments",
        ),
    ],
)
def test_missing_fields_raise_stored_data_error(effects_json: bytes, field: str) -> None:
    with pytest.raises(StoredDataError, match=f"missing required field `{field}`"):
        CODEC.decode_effects(effects_json)


def test_wrong_batch_and_session_fields() -> None:
    with pytest.raises(StoredDataError, match="revision"):
        CODEC.decode_batch(
            b'{"session_id":"s","revision":"3","step":"x","cycle":0,"timestamp":1,"effects":[]}'
        )
    with pytest.raises(StoredDataError, match="data"):
        CODEC.decode_session(b'{"id":"s","revision":0,"conversation":[],"data":{"count":"x"}}')
    with pytest.raises(StoredDataError, match="conversation"):
        CODEC.decode_session(b'{"id":"s","revision":0,"data":{}}')
    with pytest.raises(StoredDataError, match="count"):
        CODEC.decode_data(b'{"count":[]}', where="data of 's'")


def test_deeply_nested_record_raises_stored_data_error() -> None:
    # Deeper than msgspec decodes on any supported Python: 3.11 stops at its recursion
    # limit (1,000), 3.12 and later at their C stack limit (on 3.13, 5,000 levels decode).
    depth = 100_000
    buf = (
        b'[{"type":"annotate","message_id":"m","namespace":"n","values":{"x":'
        + b"[" * depth
        + b"]" * depth
        + b"}}]"
    )
    with pytest.raises(StoredDataError, match="session 'deep'"):
        CODEC.decode_effects(buf, where="session 'deep'")


def test_stored_data_error_chains_the_msgspec_error() -> None:
    with pytest.raises(StoredDataError) as excinfo:
        CODEC.decode_effects(b'[{"type":"x"}]')
    assert isinstance(excinfo.value.__cause__, msgspec.ValidationError)


# -- app effects ---------------------------------------------------------------------------------


def test_registered_app_effect_round_trips() -> None:
    effects = (FlagRaised("red", level=3), AppendMessage(Message.user("x", id="m")))
    decoded = CODEC.decode_effects(CODEC.encode_effects(effects))
    assert decoded == effects
    assert type(decoded[0]) is FlagRaised
    batch: Batch[Effect] = Batch("s", 1, "step", 2, 3.5, effects)
    assert CODEC.decode_batch(CODEC.encode_batch(batch)) == batch
    assert CODEC.encode_effects([FlagRaised("a")]) == (
        b'[{"type":"test.flag_raised","flag":"a","level":1}]'
    )


def test_unregistered_effect_is_refused_on_encode() -> None:
    with pytest.raises(ConfigurationError, match="Unregistered"):
        CODEC.encode_effects([AppendMessage(Message.user("x", id="m")), Unregistered()])
    batch: Batch[Effect] = Batch("s", 1, "step", 0, 0.0, (Unregistered(),))
    with pytest.raises(ConfigurationError, match=r"test\.unregistered"):
        CODEC.encode_batch(batch)
    with pytest.raises(ConfigurationError):
        CODEC.check_effects([Unregistered()])


def test_subclass_of_a_registered_effect_is_refused_on_encode() -> None:
    """A subclass inherits the tag string; encoding it would decode as the parent."""

    class Sneaky(AppendMessage, frozen=True):
        pass

    with pytest.raises(ConfigurationError, match="Sneaky"):
        CODEC.encode_effects([Sneaky(Message.user("x", id="m"))])


def test_effect_without_explicit_tag_is_refused() -> None:
    class NoTag(Effect, frozen=True):
        x: int = 0

    with pytest.raises(ConfigurationError, match="NoTag"):
        Codec(effects=[NoTag])


def test_effect_with_tag_true_is_refused() -> None:
    class TagTrue(Effect, frozen=True, tag=True):
        pass

    with pytest.raises(ConfigurationError, match="TagTrue"):
        Codec(effects=[TagTrue])


def test_effect_with_non_string_tag_is_refused() -> None:
    class IntTag(Effect, frozen=True, tag=7):
        pass

    with pytest.raises(ConfigurationError, match="IntTag"):
        Codec(effects=[IntTag])


def test_effect_with_another_tag_field_is_refused() -> None:
    class OtherField(Effect, frozen=True, tag_field="kind", tag="test.other_field"):
        pass

    with pytest.raises(ConfigurationError, match="OtherField"):
        Codec(effects=[OtherField])


def test_duplicate_tag_is_refused() -> None:
    class One(Effect, frozen=True, tag="test.same"):
        pass

    class Two(Effect, frozen=True, tag="test.same"):
        pass

    with pytest.raises(ConfigurationError, match=r"test\.same") as excinfo:
        Codec(effects=[One, Two])
    assert "One" in str(excinfo.value)
    assert "Two" in str(excinfo.value)


def test_app_effect_reusing_a_kernel_tag_is_refused() -> None:
    class Impostor(Effect, frozen=True, tag="annotate"):
        pass

    with pytest.raises(ConfigurationError, match="Impostor"):
        Codec(effects=[Impostor])


def test_registering_the_same_type_twice_is_fine() -> None:
    codec = Codec(effects=[FlagRaised, FlagRaised, AppendMessage])
    assert codec.effect_types["test.flag_raised"] is FlagRaised
    assert set(codec.effect_types) == {
        "append_message",
        "replace_conversation",
        "annotate",
        "set_visibility",
        "update_data",
        "test.flag_raised",
    }


@pytest.mark.parametrize("bad", [int, "test.flag_raised", FlagRaised("x"), msgspec.Struct])
def test_non_effect_types_are_refused(bad: Any) -> None:
    with pytest.raises(ConfigurationError):
        Codec(effects=[bad])


# -- new_session ---------------------------------------------------------------------------------


def test_new_session_defaults() -> None:
    session = CODEC.new_session("s1", conversation=[Message.user("x", id="m")])
    assert session == Session("s1", 0, (Message.user("x", id="m"),), AppData())
    assert Codec().new_session("s").data == NoData()


def test_wrong_data_says_which_codec_the_store_needs() -> None:
    """The value seen and the fix: open the store with Codec(<the data's type>)."""
    with pytest.raises(ConfigurationError) as raised:
        Codec().new_session("s", data=AppData())  # type: ignore[arg-type]
    message = str(raised.value)
    assert "NoData" in message
    assert "AppData" in message
    assert "Codec(AppData)" in message


def test_new_session_refuses_wrong_data_and_required_fields() -> None:
    with pytest.raises(ConfigurationError, match="AppData"):
        CODEC.new_session("s", data=NoData())  # type: ignore[arg-type]

    class Required(msgspec.Struct, frozen=True):
        x: int

    with pytest.raises(ConfigurationError, match="Required"):
        Codec(Required).new_session("s")


def test_decoded_session_has_the_codecs_data_type() -> None:
    session = CODEC.new_session("s", data=AppData(count=2, labels=["a"]))
    decoded = CODEC.decode_session(CODEC.encode_session(session))
    assert type(decoded.data) is AppData
    assert decoded == session
    assert CODEC.decode_data(CODEC.encode_data(AppData(3))) == AppData(3)


# -- schema evolution ---------------------------------------------------------------------------


def test_older_writer_without_defaulted_fields_decodes() -> None:
    """Records written before defaulted fields existed decode with the defaults."""
    old_message = (
        b'{"id":"m","role":"tool","parts":[{"type":"tool_result","call_id":"c","content":"x"}]}'
    )
    message = CODEC.decode_message(old_message)
    assert message == Message("m", "tool", (ToolResultPart(call_id="c", content="x"),))
    assert message.notes == {}
    assert message.visible_to_model is True
    old_effects = (
        b'[{"type":"annotate","message_id":"m","namespace":"n","values":{}},'
        b'{"type":"set_visibility","message_ids":["m"]},'
        b'{"type":"test.flag_raised","flag":"f"},'
        b'{"type":"append_message","message":{"id":"a","role":"assistant","parts":['
        b'{"type":"tool_call","call_id":"c","name":"n","arguments":{},"raw_arguments":"{}"},'
        b'{"type":"reasoning","text":"r"}]}}]'
    )
    decoded = CODEC.decode_effects(old_effects)
    assert decoded[0] == Annotate(message_id="m", namespace="n", values={}, call_id=None)
    assert decoded[1] == SetVisibility(("m",))
    assert decoded[2] == FlagRaised("f", level=1)
    assert decoded[3] == AppendMessage(
        Message(
            "a",
            "assistant",
            (ToolCallPart("c", "n", {}, "{}"), ReasoningPart("r")),
        )
    )
    old_session = b'{"id":"s","revision":2,"conversation":[],"data":{}}'
    assert CODEC.decode_session(old_session).data == AppData()


def test_app_effect_gaining_a_defaulted_field_reads_old_records() -> None:
    class FlagV1(Effect, frozen=True, tag="test.flag"):
        flag: str

    class FlagV2(Effect, frozen=True, tag="test.flag"):
        flag: str
        severity: str = "low"

    old = Codec(effects=[FlagV1]).encode_effects([FlagV1("x")])
    assert Codec(effects=[FlagV2]).decode_effects(old) == (FlagV2("x", severity="low"),)
    # ...and an old reader ignores the new field rather than failing
    new = Codec(effects=[FlagV2]).encode_effects([FlagV2("x", severity="high")])
    assert Codec(effects=[FlagV1]).decode_effects(new) == (FlagV1("x"),)


def test_app_effect_gaining_a_required_field_refuses_old_records() -> None:
    class FlagV1(Effect, frozen=True, tag="test.flag"):
        flag: str

    class FlagV2(Effect, frozen=True, tag="test.flag"):
        flag: str
        severity: str

    old = Codec(effects=[FlagV1]).encode_effects([FlagV1("x")])
    with pytest.raises(StoredDataError, match="severity"):
        Codec(effects=[FlagV2]).decode_effects(old, where="old log")


# -- round trips (hypothesis) --------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
json_objects = st.dictionaries(st.text(max_size=4), json_values, max_size=3)
notes = st.dictionaries(st.text(max_size=4), json_objects, max_size=2)
ids = st.text(min_size=1, max_size=6)

parts = st.one_of(
    st.builds(TextPart, st.text(max_size=10)),
    st.builds(ReasoningPart, st.text(max_size=10), json_objects),
    st.builds(ToolCallPart, ids, st.text(max_size=5), json_values, st.text(max_size=10), notes),
    st.builds(ToolResultPart, ids, st.text(max_size=10), st.booleans(), st.text(max_size=5)),
)
messages = st.builds(
    Message,
    ids,
    st.sampled_from(["user", "assistant", "tool", "system"]),
    st.lists(parts, max_size=4).map(tuple),
    notes,
    st.booleans(),
    st.booleans(),
)
app_data = st.builds(
    AppData,
    st.integers(-(2**31), 2**31),
    st.lists(st.text(max_size=3), max_size=3),
    st.none() | st.text(max_size=3),
)
effects = st.one_of(
    st.builds(AppendMessage, messages),
    st.builds(ReplaceConversation, st.lists(messages, max_size=3).map(tuple)),
    st.builds(Annotate, ids, st.text(max_size=4), json_objects, st.none() | ids),
    st.builds(
        SetVisibility,
        st.lists(ids, max_size=3).map(tuple),
        st.none() | st.booleans(),
        st.none() | st.booleans(),
    ),
    st.builds(UpdateData, json_objects),
    st.builds(FlagRaised, st.text(max_size=5), st.integers(-100, 100)),
)
batches = st.builds(
    Batch,
    ids,
    st.integers(0, 2**40),
    st.text(max_size=10),
    st.integers(0, 1000),
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(effects, max_size=4).map(tuple),
)
sessions = st.builds(
    Session,
    ids,
    st.integers(0, 2**40),
    st.lists(messages, max_size=4, unique_by=lambda m: m.id).map(tuple),  # ids are unique
    app_data,
)

ROUND_TRIP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@ROUND_TRIP
@given(sessions)
def test_session_round_trip(session: Session[AppData]) -> None:
    assert CODEC.decode_session(CODEC.encode_session(session)) == session


@ROUND_TRIP
@given(messages)
def test_message_round_trip(message: Message) -> None:
    assert CODEC.decode_message(CODEC.encode_message(message)) == message


@ROUND_TRIP
@given(batches)
def test_batch_round_trip(batch: Batch[Effect]) -> None:
    decoded = CODEC.decode_batch(CODEC.encode_batch(batch))
    assert decoded == batch
    assert [type(e) for e in decoded.effects] == [type(e) for e in batch.effects]


@ROUND_TRIP
@given(st.lists(effects, max_size=5))
def test_effects_round_trip(items: list[Effect]) -> None:
    assert CODEC.decode_effects(CODEC.encode_effects(items)) == tuple(items)


def test_a_session_record_breaking_its_own_rules_is_refused() -> None:
    codec = Codec()
    message = Message.user("x", id="dup")
    # A negative revision cannot even be built (Session checks its fields), so
    # its record is written by hand.
    negative = codec.encode_session(
        Session(id="s", revision=0, conversation=(), data=NoData())
    ).replace(b'"revision":0', b'"revision":-1')
    for bad in (
        codec.encode_session(
            Session(id="s", revision=0, conversation=(message, message), data=NoData())
        ),
        negative,
    ):
        with pytest.raises(StoredDataError, match=r"file f\.db"):
            codec.decode_session(bad, where="file f.db")


# -- issue 9: tool arguments are stored once -------------------------------------------


class Quoted(Effect, frozen=True, tag="test.quoted"):
    """A user effect holding a message, and a dict shaped like a tool call before it."""

    shape: dict[str, Any]
    message: Message

    def apply(self, session: Session[Any]) -> Session[Any]:
        return session


QUOTING: Codec[NoData] = Codec(effects=[Quoted])

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def tool_calls(draw: st.DrawFn) -> ToolCallPart:
    """Calls as providers build them (raw strings, valid or not) and as code builds them."""
    call_id = draw(st.text(min_size=1, max_size=6))
    name = draw(st.text(max_size=6))
    notes = draw(st.sampled_from([{}, {"journal": {"intent": True, "arguments": "x"}}]))
    kind = draw(st.sampled_from(["parse_json", "parse_text", "of", "forged"]))
    if kind == "parse_json":
        value = draw(json_values)
        spaced = draw(st.booleans())
        raw = msgspec.json.encode(value, enc_hook=Conversation.enc_hook).decode()
        part = ToolCallPart.parse(call_id, name, f" {raw} " if spaced else raw)
    elif kind == "parse_text":
        part = ToolCallPart.parse(call_id, name, draw(st.text(max_size=12)))
    elif kind == "of":
        part = ToolCallPart.of(
            call_id, name, draw(st.dictionaries(st.text(max_size=5), json_values, max_size=3))
        )
    else:  # arguments that are not what the raw string parses to (1 vs 1.0, a tuple, another value)
        arguments = draw(st.sampled_from([{"a": 1}, {"a": (1, 2)}, [1.0], None, {"b": "c"}]))
        raw = draw(
            st.sampled_from(['{"a":1.0}', '{"a":[1,2]}', "[1]", "", '{"b":"d"}', "not json"])
        )
        part = ToolCallPart(call_id=call_id, name=name, arguments=arguments, raw_arguments=raw)
    return msgspec.structs.replace(part, notes=notes)


def _both(part: ToolCallPart) -> bytes:
    """The part as encoded before issue 9: arguments and raw string."""
    return msgspec.json.encode(part)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    calls=st.lists(tool_calls(), min_size=1, max_size=4),
    text=st.text(max_size=5),
    flags=st.lists(
        st.tuples(
            st.sampled_from([{}, {"op": {}}, {"op": {"notes": {}}}]), st.booleans(), st.booleans()
        ),
        min_size=4,
        max_size=4,
    ),
    plain=st.integers(min_value=0, max_value=3),
)
def test_tool_arguments_are_stored_once_and_decode_as_before(
    calls: list[ToolCallPart], text: str, flags: list[tuple[Any, bool, bool]], plain: int
) -> None:
    # Unique ids (a session refuses repeats); the same call may appear twice;
    # some messages hold no call; notes and visibility vary.
    messages = tuple(
        Message(
            id=f"m{i}",
            role="assistant",
            parts=(TextPart(text),) if i < plain else (TextPart(text), call, call),
            notes=flags[i % 4][0],
            visible_to_model=flags[i % 4][1],
            visible_to_user=flags[i % 4][2],
        )
        for i, call in enumerate(calls)
    )
    session = Session(id="s", revision=0, conversation=messages, data=NoData())
    codec: Codec[NoData] = Codec()
    effects = (AppendMessage(messages[0]), ReplaceConversation(messages))
    batch = Batch(session_id="s", revision=1, step="x", cycle=0, timestamp=0.0, effects=effects)
    old = {  # the same records as written before: both fields in every call
        "session": msgspec.json.encode(session, enc_hook=Conversation.enc_hook),
        "effects": msgspec.json.encode(effects),
        "batch": msgspec.json.encode(batch),
        "message": msgspec.json.encode(messages[0]),
    }
    new = {
        "session": codec.encode_session(session),
        "effects": codec.encode_effects(effects),
        "batch": codec.encode_batch(batch),
        "message": codec.encode_message(messages[0]),
    }
    decode = {
        "session": codec.decode_session,
        "effects": codec.decode_effects,
        "batch": codec.decode_batch,
        "message": codec.decode_message,
    }
    for kind, record in new.items():
        assert decode[kind](record) == decode[kind](old[kind]), kind  # type: ignore[operator]
        assert len(record) <= len(old[kind])
    # The first message's call is stored once exactly when its arguments are what
    # its raw string parses to (byte for byte, once encoded).
    call = calls[0]
    if plain:
        return
    derivable = msgspec.json.encode(call.arguments) == msgspec.json.encode(
        ToolCallPart.parse("x", "y", call.raw_arguments).arguments
    )
    assert (_both(call) in new["message"]) is not derivable


_MESSAGE_DEFAULTS = {"notes": {}, "visible_to_model": True, "visible_to_user": True}


def _derivable(call: dict[str, Any]) -> bool:
    """Whether a call's arguments are what its raw string parses to, once encoded."""
    parsed = ToolCallPart.parse("x", "y", call["raw_arguments"]).arguments
    return msgspec.json.encode(call["arguments"]) == msgspec.json.encode(parsed)


def _compact_message_oracle(message: dict[str, Any]) -> dict[str, Any]:
    """The stored form of a message, stated on its plain JSON (the codec does it otherwise):
    a call's derivable ``arguments`` dropped, the defaults after ``parts`` dropped."""
    parts = []
    for part in message["parts"]:
        if part["type"] == "tool_call" and _derivable(part):
            parts.append({key: value for key, value in part.items() if key != "arguments"})
        else:
            parts.append(part)
    compact = {**message, "parts": parts}
    if all(compact[key] == value for key, value in _MESSAGE_DEFAULTS.items()):
        compact = {key: value for key, value in compact.items() if key not in _MESSAGE_DEFAULTS}
    return compact


def _expected(value: Any) -> bytes:
    """What the codec stores for a message, a one-``AppendMessage`` effects tuple or a
    batch of one, derived from msgspec's plain encoding of it."""
    plain = msgspec.json.decode(msgspec.json.encode(value))
    if isinstance(value, Message):
        return msgspec.json.encode(_compact_message_oracle(plain))
    effects = plain if isinstance(value, tuple) else plain["effects"]
    effects[0]["message"] = _compact_message_oracle(effects[0]["message"])
    if isinstance(value, Batch):
        if plain["refused"] == []:
            del plain["refused"]
        if plain["trace"] is None:
            del plain["trace"]
    return msgspec.json.encode(plain)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    calls=st.lists(tool_calls(), min_size=1, max_size=3),
    text=st.text(max_size=5),
    notes=st.sampled_from([{}, {"op": {}}, {"inference": {"attempts": 1}}]),
    to_model=st.booleans(),
    to_user=st.booleans(),
    refused=st.sampled_from([(), (Refusal("tools", "no open tool calls"),)]),
    trace=st.sampled_from([None, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"]),
)
def test_one_appended_message_is_stored_without_what_decoding_gives_back(
    calls: list[ToolCallPart],
    text: str,
    notes: dict[str, dict[str, Any]],
    to_model: bool,
    to_user: bool,
    refused: tuple[Refusal, ...],
    trace: str | None,
) -> None:
    """The usual record with calls (one ``AppendMessage``, or its message alone, in a
    batch or not) is msgspec's plain encoding without exactly what decoding gives
    back (derivable arguments, default notes and visibility, an empty ``refused``,
    no ``trace``), whatever the calls, notes and visibility, and it decodes back."""
    message = Message(
        id="m",
        role="assistant",
        parts=(TextPart(text), *calls),
        notes=notes,
        visible_to_model=to_model,
        visible_to_user=to_user,
    )
    codec: Codec[NoData] = Codec()
    effects: tuple[Effect, ...] = (AppendMessage(message),)
    batch: Batch[Effect] = Batch(
        session_id="s", revision=1, step="x", cycle=0, timestamp=0.0, effects=effects
    )
    full = msgspec.structs.replace(batch, refused=refused, trace=trace)
    assert codec.encode_message(message) == _expected(message)
    assert codec.encode_effects(effects) == _expected(effects)
    assert codec.encode_batch(batch) == _expected(batch)
    assert codec.encode_batch(full) == _expected(full)
    # it decodes as the record with every field does (a tuple comes back a list)
    assert codec.decode_batch(codec.encode_batch(full)) == codec.decode_batch(
        msgspec.json.encode(full)
    )
    assert codec.decode_message(codec.encode_message(message)) == codec.decode_message(
        msgspec.json.encode(message)
    )


def test_a_call_stored_once_holds_the_raw_string_only() -> None:
    call = ToolCallPart.parse("c1", "search", '{"query": "weather in Paris", "days": 3}')
    record = CODEC.encode_message(Message(id="m", role="assistant", parts=(call,)))
    assert b'"arguments"' not in record
    assert record.count(b"weather in Paris") == 1
    decoded = CODEC.decode_message(record).parts[0]
    assert decoded == call
    assert isinstance(decoded, ToolCallPart)
    assert decoded.arguments == {"query": "weather in Paris", "days": 3}


def test_calls_whose_arguments_differ_from_the_raw_string_keep_both() -> None:
    for arguments, raw in [({"a": 1}, '{"a":1.0}'), ({"x": 1}, "{}"), (None, "{}")]:
        call = ToolCallPart(call_id="c", name="n", arguments=arguments, raw_arguments=raw)
        record = CODEC.encode_message(Message(id="m", role="assistant", parts=(call,)))
        assert b'"arguments":' in record
        assert CODEC.decode_message(record).parts[0] == call


def test_only_the_messages_own_calls_are_compacted() -> None:
    call = ToolCallPart.of("c", "n", {"k": "v"})
    shape = msgspec.to_builtins(call)  # a dict with the very bytes of the call
    effect = Quoted(shape=shape, message=Message(id="m", role="assistant", parts=(call,)))
    record = QUOTING.encode_effects((effect,))
    assert record.count(b'"arguments":{"k":"v"}') == 1  # the dict's; the call's is gone
    assert QUOTING.decode_effects(record) == (effect,)


def test_tool_call_without_raw_arguments_is_refused() -> None:
    with pytest.raises(InvalidFieldError, match="missing required field `raw_arguments`"):
        ToolCallPart("c", "n", {"a": 1})
    with pytest.raises(InvalidFieldError, match="missing required field `raw_arguments`"):
        ToolCallPart(call_id="c", name="n")
    assert ToolCallPart("c", "n", raw_arguments='{"a": 1}').arguments == {"a": 1}


def test_default_notes_and_visibility_are_left_out_only_where_a_message_is_declared() -> None:
    message = Message.user("hello", id="m")
    effect = Quoted(shape=msgspec.json.decode(msgspec.json.encode(message)), message=message)
    record = QUOTING.encode_effects((effect,))
    # The dict keeps every key (its decoder gives no defaults); the message does not.
    assert record.count(b'"visible_to_model":true') == 1
    assert QUOTING.decode_effects(record) == (effect,)
    hidden = msgspec.structs.replace(message, visible_to_model=False, notes={"op": {"k": 1}})
    record = QUOTING.encode_message(hidden)
    assert record.endswith(
        b'"notes":{"op":{"k":1}},"visible_to_model":false,"visible_to_user":true}'
    )
    assert QUOTING.decode_message(record) == hidden


# -- data written with another data type is refused, never read without its fields --------


class _Ledger(msgspec.Struct):
    balance: int = 0
    owner: str = ""


class _Renamed(msgspec.Struct, rename="camel"):
    account_owner: str = ""


class _Tagged(msgspec.Struct, tag="ledger"):
    balance: int = 0


@pytest.mark.parametrize(
    ("kind", "data"),
    [(_Renamed, b'{"accountOwner":"ann"}'), (_Tagged, b'{"type":"ledger","balance":3}')],
)
def test_data_of_its_own_type_decodes_with_renamed_and_tag_fields(kind: type, data: bytes) -> None:
    assert Codec(kind).decode_data(data) == msgspec.json.decode(data, type=kind)


def test_data_with_a_field_the_type_lacks_is_refused_naming_the_fields_and_the_fix() -> None:
    with pytest.raises(StoredDataError) as caught:
        Codec(_Ledger).decode_data(b'{"balance":1,"limit":5}', where="here")
    text = str(caught.value)
    assert "['limit']" in text
    assert "here" in text
    assert "Codec(_Ledger)" in text
    assert "open it with the Codec of the data type" in text


@pytest.mark.parametrize("store_kind", ["sqlite", "file"])
async def test_a_store_opened_without_the_data_codec_refuses_the_session_and_loses_nothing(
    tmp_path: Path, store_kind: str
) -> None:
    """Opening a store with the default ``Codec(NoData)`` for sessions written with
    ``Codec(_Ledger)`` refuses to load them (naming the fix) instead of reading them
    without their data, which the next write (a snapshot) would have stored."""
    from stepmachine.stores import SQLiteStore

    async def open_store(codec: Codec[Any] | None) -> Store:
        if store_kind == "sqlite":
            path = tmp_path / "db.sqlite3"
            return await (SQLiteStore.open(path, codec=codec) if codec else SQLiteStore.open(path))
        folder = tmp_path / "sessions"
        return await (FileStore.open(folder, codec=codec) if codec else FileStore.open(folder))

    async with await open_store(Codec(_Ledger)) as store:
        await store.create("s1", data=_Ledger(balance=7, owner="ann"))
    async with await open_store(None) as store:
        with pytest.raises(StoredDataError, match=r"\['balance', 'owner'\].*Codec\(NoData\)"):
            await store.load("s1")
        with pytest.raises(StoredDataError):
            await submit(store, "s1", [AppendMessage(Message.user("hi", id="u1"))])
    async with await open_store(Codec(_Ledger)) as store:
        session = await store.load("s1")
    assert session.data == _Ledger(balance=7, owner="ann")
    assert session.revision == 0


# -- at the edges, as a user meets them ----------------------------------------


def test_a_codec_of_a_type_that_is_not_a_struct_says_what_to_pass() -> None:
    with pytest.raises((ConfigurationError, TypeError), match="Struct"):
        Codec(dict)  # type: ignore[type-var]


async def test_a_user_message_with_a_lone_surrogate_gets_a_clear_error(tmp_path: Path) -> None:
    text = json.loads('"hello \\ud83d"')  # what json.loads gives for a truncated emoji
    agent = Agent("scripted", store=tmp_path / "db.sqlite3")
    try:
        report = await agent.run("s1", text)
    except StepmachineError as error:
        assert "surrogate" in str(error)  # noqa: PT017 - refused with the reason
    else:
        assert report.reason.kind == "done"  # or stored with the character replaced


class _Priority(msgspec.Struct):
    priority: int = 3


class _PriorityText(msgspec.Struct):
    priority: str = "low"


class _Bump(Effect, frozen=True, tag="review.bump"):
    by: int

    def apply(self, session: Session[Any]) -> Session[Any]:
        data = msgspec.structs.replace(session.data, priority=session.data.priority + self.by)
        return msgspec.structs.replace(session, data=data)


@pytest.mark.parametrize("wrong", ["effect missing", "field type differs"])
async def test_a_wrong_codec_error_says_what_to_do(wrong: str, tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"
    async with await SQLiteStore.open(path, Codec(_Priority, effects=[_Bump])) as store:
        await store.create("t1", _Priority())
        await submit(store, "t1", [_Bump(by=2)])
    codec: Codec[Any] = (
        Codec(_Priority) if wrong == "effect missing" else Codec(_PriorityText, effects=[_Bump])
    )
    async with await SQLiteStore.open(path, codec) as store:
        with pytest.raises(StoredDataError) as caught:
            await store.load("t1")
    assert "open it with" in str(caught.value) or "effects=" in str(caught.value)
