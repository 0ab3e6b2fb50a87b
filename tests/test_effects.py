"""Kernel effects: what each one does, how it fails, and that applying is pure."""

from __future__ import annotations

import copy
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import (
    Annotate,
    AppendMessage,
    Effect,
    EffectError,
    Message,
    ReplaceConversation,
    Session,
    SetVisibility,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    UpdateData,
)
from stepmachine.extend import apply_batch, apply_effects
from stepmachine.testing import make_session


class AppData(msgspec.Struct, frozen=True):
    count: int = 0
    label: str = ""
    tags: tuple[str, ...] = ()
    limit: int | None = None


def assistant_with_calls(message_id: str, *call_ids: str) -> Message:
    return Message(
        id=message_id,
        role="assistant",
        parts=(TextPart("t"), *(ToolCallPart.of(c, "tool", {"i": c}) for c in call_ids)),
    )


def base_session() -> Session[AppData]:
    return make_session(
        Message.user("hello", id="u1"),
        assistant_with_calls("a1", "c1", "c2"),
        Message(id="t1", role="tool", parts=(ToolResultPart(call_id="c1", content="1"),)),
        data=AppData(count=1, label="x"),
        session_id="s1",
        revision=4,
    )


# -- AppendMessage ---------------------------------------------------------------------------


def test_append_message_appends_at_the_end() -> None:
    session = base_session()
    message = Message.user("more", id="u2")
    after = AppendMessage(message).apply(session)
    assert after.conversation == (*session.conversation, message)
    assert after.revision == session.revision  # apply alone never touches the revision
    assert after.data == session.data


def test_append_message_duplicate_id_raises() -> None:
    session = base_session()
    with pytest.raises(EffectError, match=r"'a1'") as excinfo:
        AppendMessage(Message.user("dup", id="a1")).apply(session)
    assert "s1" in str(excinfo.value)


def test_append_message_duplicate_within_one_batch_fails_the_batch() -> None:
    session = base_session()
    effects = [
        AppendMessage(Message.user("x", id="new")),
        AppendMessage(Message.user("y", id="new")),
    ]
    with pytest.raises(EffectError, match="new"):
        apply_batch(session, effects)


def test_append_message_checks_hidden_messages_too() -> None:
    hidden = Message(id="h", role="user", parts=(TextPart("x"),), visible_to_model=False)
    session = make_session(hidden)
    with pytest.raises(EffectError):
        AppendMessage(Message.user("y", id="h")).apply(session)


# -- ReplaceConversation -----------------------------------------------------------------------


def test_replace_conversation_replaces_everything() -> None:
    session = base_session()
    summary = Message.system("summary", id="sum")
    after = ReplaceConversation((summary, Message.user("hello", id="u1"))).apply(session)
    assert after.conversation == (summary, Message.user("hello", id="u1"))
    assert ReplaceConversation(()).apply(session).conversation == ()


def test_replace_conversation_duplicate_ids_raise_naming_them() -> None:
    session = base_session()
    conversation = (
        Message.user("a", id="x"),
        Message.user("b", id="y"),
        Message.user("c", id="x"),
        Message.user("d", id="y"),
        Message.user("e", id="z"),
    )
    with pytest.raises(EffectError) as excinfo:
        ReplaceConversation(conversation).apply(session)
    text = str(excinfo.value)
    assert "['x', 'y']" in text
    assert "'z'" not in text


# -- Annotate --------------------------------------------------------------------------------


def test_annotate_message_creates_namespace() -> None:
    session = base_session()
    after = Annotate(message_id="u1", namespace="approval", values={"ok": True}).apply(session)
    assert after.message("u1").notes == {"approval": {"ok": True}}  # type: ignore[union-attr]
    # the other messages are untouched
    assert after.conversation[1:] == session.conversation[1:]


def test_annotate_merges_within_namespace_and_keeps_other_namespaces() -> None:
    session = base_session()
    effects = [
        Annotate(message_id="u1", namespace="a", values={"x": 1, "y": 2}),
        Annotate(message_id="u1", namespace="b", values={"z": 3}),
        Annotate(message_id="u1", namespace="a", values={"y": 20, "w": 4}),
    ]
    after = apply_effects(session, effects)
    assert after.message("u1").notes == {  # type: ignore[union-attr]
        "a": {"x": 1, "y": 20, "w": 4},
        "b": {"z": 3},
    }


def test_annotate_does_not_mutate_the_notes_it_merged_into() -> None:
    session = base_session()
    first = Annotate(message_id="u1", namespace="a", values={"x": 1}).apply(session)
    first_notes = copy.deepcopy(first.message("u1").notes)  # type: ignore[union-attr]
    Annotate(message_id="u1", namespace="a", values={"x": 2, "y": 3}).apply(first)
    assert first.message("u1").notes == first_notes  # type: ignore[union-attr]


def test_annotate_tool_call_binds_note_to_that_call_only() -> None:
    session = base_session()
    after = Annotate(
        message_id="a1", namespace="approval", values={"approved": True}, call_id="c2"
    ).apply(session)
    message = after.message("a1")
    assert message is not None
    c1, c2 = message.tool_calls
    assert c2.notes == {"approval": {"approved": True}}
    assert c1.notes == {}
    assert message.notes == {}  # the message itself is not annotated
    # the rest of the call is unchanged
    assert msgspec.structs.replace(c2, notes={}) == session.message("a1").tool_calls[1]  # type: ignore[union-attr]
    assert message.parts[0] == TextPart("t")


def test_annotate_tool_call_merges() -> None:
    session = base_session()
    after = apply_effects(
        session,
        [
            Annotate(message_id="a1", namespace="j", values={"a": 1, "b": 1}, call_id="c1"),
            Annotate(message_id="a1", namespace="j", values={"b": 2}, call_id="c1"),
        ],
    )
    assert after.message("a1").tool_calls[0].notes == {"j": {"a": 1, "b": 2}}  # type: ignore[union-attr]


def test_annotate_unknown_message_raises() -> None:
    with pytest.raises(EffectError, match="'nope'"):
        Annotate(message_id="nope", namespace="a", values={}).apply(base_session())


@pytest.mark.parametrize(
    ("message_id", "call_id"),
    [("a1", "c9"), ("u1", "c1"), ("t1", "c1")],
    ids=["unknown-call", "call-in-other-message", "result-is-not-a-call"],
)
def test_annotate_unknown_call_raises(message_id: str, call_id: str) -> None:
    with pytest.raises(EffectError, match=repr(call_id)):
        Annotate(message_id=message_id, namespace="a", values={"x": 1}, call_id=call_id).apply(
            base_session()
        )


# -- SetVisibility ---------------------------------------------------------------------------


def test_set_visibility_none_leaves_flags() -> None:
    session = base_session()
    hidden = SetVisibility(("u1",), to_model=False).apply(session)
    message = hidden.message("u1")
    assert message is not None
    assert (message.visible_to_model, message.visible_to_user) == (False, True)
    user_hidden = SetVisibility(("u1",), to_user=False).apply(hidden)
    message = user_hidden.message("u1")
    assert message is not None
    assert (message.visible_to_model, message.visible_to_user) == (False, False)
    unchanged = SetVisibility(("u1",)).apply(user_hidden)
    assert unchanged == user_hidden
    shown = SetVisibility(("u1",), to_model=True).apply(user_hidden)
    message = shown.message("u1")
    assert message is not None
    assert (message.visible_to_model, message.visible_to_user) == (True, False)


def test_set_visibility_several_ids_and_only_those() -> None:
    session = base_session()
    after = SetVisibility(("u1", "t1"), to_model=False, to_user=False).apply(session)
    flags = [(m.id, m.visible_to_model, m.visible_to_user) for m in after.conversation]
    assert flags == [("u1", False, False), ("a1", True, True), ("t1", False, False)]
    # content and notes are kept: hidden, not deleted
    assert [m.parts for m in after.conversation] == [m.parts for m in session.conversation]


def test_set_visibility_unknown_ids_raise_naming_them() -> None:
    with pytest.raises(EffectError) as excinfo:
        SetVisibility(("u1", "zz", "aa"), to_model=False).apply(base_session())
    assert "['aa', 'zz']" in str(excinfo.value)


# -- UpdateData -----------------------------------------------------------------------------


def test_update_data_set_changes_fields() -> None:
    session = base_session()
    after = UpdateData.set(count=5, tags=("a", "b")).apply(session)
    assert after.data == AppData(count=5, label="x", tags=("a", "b"))
    assert isinstance(after.data.tags, tuple)
    assert session.data == AppData(count=1, label="x")


def test_update_data_set_converts_values_to_builtins() -> None:
    class Inner(msgspec.Struct, frozen=True):
        a: int

    effect = UpdateData.set(limit=None, inner=Inner(1), when={1, 2})
    assert effect.changes == {"limit": None, "inner": {"a": 1}, "when": [1, 2]}


def test_update_data_means_the_same_after_a_json_round_trip() -> None:
    effect = UpdateData.set(tags=("a", "b"), count=2)
    decoded = msgspec.json.decode(msgspec.json.encode(effect), type=UpdateData)
    assert decoded.apply(base_session()) == effect.apply(base_session())


def test_update_data_unknown_field_raises() -> None:
    with pytest.raises(EffectError, match="nope"):
        UpdateData.set(nope=1).apply(base_session())


@pytest.mark.parametrize(
    "changes",
    [{"count": "five"}, {"count": 1.5}, {"tags": "abc"}, {"label": None}, {"limit": "x"}],
)
def test_update_data_wrong_type_raises(changes: dict[str, Any]) -> None:
    with pytest.raises(EffectError, match="does not validate"):
        UpdateData(changes=changes).apply(base_session())


class CamelData(msgspec.Struct, frozen=True, rename="camel"):
    my_field: int = 1


def test_update_data_on_renamed_fields() -> None:
    session = make_session(data=CamelData())
    after = UpdateData.set(my_field=2).apply(session)
    assert after.data.my_field == 2


# -- batches ---------------------------------------------------------------------------------


def test_apply_batch_bumps_revision_by_exactly_one_and_leaves_input_untouched() -> None:
    session = base_session()
    snapshot = copy.deepcopy(session)
    effects = [
        AppendMessage(Message.user("x", id="u2")),
        Annotate(message_id="u1", namespace="n", values={"a": 1}),
        SetVisibility(("a1",), to_user=False),
        UpdateData.set(count=9),
    ]
    after = apply_batch(session, effects)
    assert after.revision == session.revision + 1
    assert session == snapshot
    assert after != session
    # an empty batch still bumps the revision by one
    assert apply_batch(session, []).revision == session.revision + 1
    assert apply_batch(session, []).conversation == session.conversation


def test_apply_batch_never_changes_a_session_an_effect_returned_as_it_was_given() -> None:
    """The revision is set on the last kernel effect's new session only: an effect of
    the application's (or a subclass of a kernel effect) that returns the session it
    was given, or one it keeps, still gets a new session after the batch."""
    kept = base_session()

    class Same(Effect, frozen=True, tag="test.same"):
        def apply(self, session: Session[Any]) -> Session[Any]:
            return session

    class Cached(AppendMessage, frozen=True, tag="test.cached"):
        def apply(self, session: Session[Any]) -> Session[Any]:
            return kept

    session = base_session()
    cached = Cached(Message.user("y", id="u9"))
    for effects in ([Same()], [UpdateData.set(count=1), Same()], [cached]):
        revision, kept_revision = session.revision, kept.revision
        after = apply_batch(session, effects)
        assert after.revision == revision + 1
        assert (session.revision, kept.revision) == (revision, kept_revision)
        assert after is not session
        assert after is not kept
    # a kernel effect last: its new session is the one returned, at the next revision
    after = apply_batch(session, [Same(), UpdateData.set(count=4)])
    assert (after.revision, after.data.count) == (session.revision + 1, 4)
    assert session.data.count == 1


def test_apply_effects_leaves_revision() -> None:
    session = base_session()
    assert apply_effects(session, [UpdateData.set(count=2)]).revision == session.revision


def test_failing_batch_changes_nothing() -> None:
    session = base_session()
    snapshot = copy.deepcopy(session)
    effects = [
        AppendMessage(Message.user("x", id="u2")),
        Annotate(message_id="u1", namespace="n", values={"a": 1}),
        UpdateData.set(count=9),
        Annotate(message_id="missing", namespace="n", values={}),
    ]
    with pytest.raises(EffectError):
        apply_batch(session, effects)
    assert session == snapshot


def test_base_effect_apply_is_not_implemented() -> None:
    class Bare(Effect, frozen=True, tag="test.bare"):
        pass

    with pytest.raises(NotImplementedError, match="Bare"):
        Bare().apply(base_session())


def test_effects_accept_any_iterable() -> None:
    session = base_session()
    after = apply_batch(session, (e for e in [UpdateData.set(count=3)]))
    assert after.data.count == 3


# -- purity (hypothesis) ---------------------------------------------------------------------

IDS = ["u1", "a1", "t1", "n1", "n2", "n3"]
CALL_IDS = ["c1", "c2", "c3"]

json_scalars = st.none() | st.booleans() | st.integers(-(2**31), 2**31) | st.text(max_size=5)
small_values = st.dictionaries(st.text(max_size=3), json_scalars, max_size=3)


@st.composite
def messages(draw: st.DrawFn) -> Message:
    message_id = draw(st.sampled_from(IDS))
    role = draw(st.sampled_from(["user", "assistant", "tool", "system"]))
    parts = draw(
        st.lists(
            st.one_of(
                st.builds(TextPart, st.text(max_size=5)),
                st.builds(lambda c: ToolCallPart.of(c, "tool", {}), st.sampled_from(CALL_IDS)),
                st.builds(
                    lambda c: ToolResultPart(call_id=c, content="r"), st.sampled_from(CALL_IDS)
                ),
            ),
            max_size=3,
        )
    )
    return Message(id=message_id, role=role, parts=tuple(parts))


effects_strategy = st.one_of(
    st.builds(AppendMessage, messages()),
    st.builds(ReplaceConversation, st.lists(messages(), max_size=3).map(tuple)),
    st.builds(
        Annotate,
        message_id=st.sampled_from(IDS),
        namespace=st.sampled_from(["a", "b"]),
        values=small_values,
        call_id=st.none() | st.sampled_from(CALL_IDS),
    ),
    st.builds(
        SetVisibility,
        st.lists(st.sampled_from(IDS), max_size=3).map(tuple),
        to_model=st.none() | st.booleans(),
        to_user=st.none() | st.booleans(),
    ),
    st.builds(
        UpdateData,
        st.dictionaries(
            st.sampled_from(["count", "label", "limit", "bogus"]),
            st.integers(-5, 5) | st.text(max_size=3) | st.none(),
            max_size=2,
        ),
    ),
)

PURITY = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _outcome(fn: Any) -> tuple[str, Any]:
    try:
        return ("ok", fn())
    except EffectError as exc:
        return ("error", str(exc))


@PURITY
@given(st.lists(effects_strategy, max_size=8))
def test_applying_the_same_effects_twice_gives_equal_sessions(effects: list[Effect]) -> None:
    session = base_session()
    snapshot = copy.deepcopy(session)
    first = _outcome(lambda: apply_batch(session, effects))
    second = _outcome(lambda: apply_batch(session, effects))
    assert first == second
    assert session == snapshot


@PURITY
@given(st.lists(effects_strategy, max_size=5), st.lists(effects_strategy, max_size=5))
def test_two_batches_equal_one_application_of_both(a: list[Effect], b: list[Effect]) -> None:
    session = base_session()
    chained = _outcome(lambda: apply_batch(apply_batch(session, a), b))
    combined = _outcome(lambda: apply_effects(session, [*a, *b]))
    assert chained[0] == combined[0]
    if chained[0] == "ok":
        expected = msgspec.structs.replace(combined[1], revision=session.revision + 2)
        assert chained[1] == expected
