"""The history index a session carries: always equal to a full rescan of its conversation.

The index (``Session.history``) is derived data that the kernel effects update
incrementally. These properties apply random effect sequences -- to the newest
session and to older ones (branches), twice to the same session (as the
machine and the store both do), and after an encode/decode round trip -- and
check every answer of the index against a rescan written independently here.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stepmachine._checks as checks_module
import stepmachine._history as history_module
import stepmachine._session as session_module
from stepmachine import (
    Annotate,
    AppendMessage,
    Codec,
    EffectError,
    HistoryError,
    InvalidFieldError,
    Message,
    NoData,
    ReasoningPart,
    ReplaceConversation,
    Session,
    SetVisibility,
    TextPart,
    ToolCallPart,
    ToolResultPart,
)
from stepmachine._index import HistoryIndex, estimate_tokens
from stepmachine.extend import (
    apply_batch,
    check_history,
    history_problems,
    open_tool_calls,
    request_order,
)

CALL_IDS = ("c0", "c1", "c2", "c3")

# -- the rescans the index must agree with --------------------------------------------------


def scan_open_calls(conversation: tuple[Message, ...]) -> list[ToolCallPart]:
    calls: dict[str, ToolCallPart] = {}
    for message in conversation:
        if message.visible_to_model:
            for part in message.parts:
                if isinstance(part, ToolCallPart):
                    calls.setdefault(part.call_id, part)
                elif isinstance(part, ToolResultPart):
                    calls.pop(part.call_id, None)
    return list(calls.values())


def scan_repeated(conversation: tuple[Message, ...]) -> set[str]:
    seen: set[str] = set()
    repeated: set[str] = set()
    for message in conversation:
        if message.visible_to_model:
            for call in message.tool_calls:
                (repeated if call.call_id in seen else seen).add(call.call_id)
    return repeated


def scan_locations(conversation: tuple[Message, ...]) -> dict[str, str]:
    return {call.call_id: m.id for m in conversation for call in m.tool_calls}


def is_empty(message: Message) -> bool:
    """No non-blank text, no reasoning, no other part (the rule HistoryGuard repairs)."""
    return all(
        (isinstance(p, TextPart) and not p.text.strip())
        or (isinstance(p, ReasoningPart) and not p.text.strip() and not p.provider_data)
        for p in message.parts
    )


def first_position(conversation: tuple[Message, ...], message_id: str) -> int | None:
    for position, message in enumerate(conversation):
        if message.id == message_id:
            return position
    return None


def assert_index_matches(session: Session[Any]) -> None:
    """Every answer of ``session.history`` equals the rescan of ``session.conversation``."""
    conversation = session.conversation
    index = session.history
    visible = tuple(m for m in conversation if m.visible_to_model)
    assert index.length == len(conversation)
    assert index.hidden == len(conversation) - len(visible)
    positions = range(len(conversation))
    shown = [i for i in positions if conversation[i].visible_to_model]
    assistants = [i for i in positions if conversation[i].role == "assistant"]
    assert index.last_visible == max(shown, default=-1)
    assert index.estimated_tokens == estimate_tokens(visible)
    assert index.last_assistant == max(assistants, default=-1)
    assert index.empty_assistants == tuple(
        i for i in shown if conversation[i].role == "assistant" and is_empty(conversation[i])
    )
    assert index.sound == all("has no result" in p for p in history_problems(visible))
    assert session.visible_to_model == visible
    assert index.open_calls() == scan_open_calls(conversation)
    assert open_tool_calls(session) == open_tool_calls(list(conversation))
    assert index.has_open_calls == bool(scan_open_calls(conversation))
    assert set(index.repeated) == scan_repeated(conversation)
    problems = history_problems(visible)
    assert index.valid == (not problems)
    assert history_problems(session) == problems
    reordered = request_order(visible)
    assert index.in_order == (
        len(reordered) == len(visible)
        and all(a is b for a, b in zip(reordered, visible, strict=True))
    )
    assert request_order(session) == reordered
    locations = scan_locations(conversation)
    for call_id in (*CALL_IDS, "absent"):
        position = index.call_position(call_id)
        if call_id in locations:
            assert position is not None
            assert conversation[position].id == locations[call_id]
        else:
            assert position is None
    for call_id in (*CALL_IDS, "absent"):
        holders = [
            p
            for p, m in enumerate(conversation)
            if m.visible_to_model and any(c.call_id == call_id for c in m.tool_calls)
        ]
        assert index.first_visible_call(call_id) == (holders[0] if holders else None)
    for namespace in ("ns", "other"):
        noted = {(p, None) for p, m in enumerate(conversation) if namespace in m.notes}
        noted |= {
            (p, c.call_id)
            for p, m in enumerate(conversation)
            for c in m.tool_calls
            if namespace in c.notes
        }
        found = list(index.noted(namespace))
        assert len(found) == len(set(found))
        assert set(found) == noted
    for message_id in {m.id for m in conversation} | {"absent"}:
        expected = first_position(conversation, message_id)
        assert index.message_position(message_id) == expected
        assert session.message(message_id) == (None if expected is None else conversation[expected])


# -- random effects ------------------------------------------------------------------------


def parts_strategy() -> st.SearchStrategy[tuple[Any, ...]]:
    call = st.builds(
        lambda c, i: ToolCallPart.of(c, "tool", {"i": i}),
        st.sampled_from(CALL_IDS),
        st.integers(0, 3),
    )
    result = st.builds(
        lambda c: ToolResultPart(call_id=c, content="r", name="tool"), st.sampled_from(CALL_IDS)
    )
    text = st.builds(TextPart, st.sampled_from(["a", " ", ""]))
    reasoning = st.builds(ReasoningPart, st.sampled_from(["r", ""]))
    return st.lists(st.one_of(call, result, text, reasoning), max_size=3).map(tuple)


def message_strategy(message_id: str) -> st.SearchStrategy[Message]:
    return st.builds(
        lambda role, parts, visible, notes: Message(
            id=message_id, role=role, parts=parts, visible_to_model=visible, notes=notes
        ),
        st.sampled_from(["user", "assistant", "assistant", "tool", "tool", "system"]),
        parts_strategy(),
        st.sampled_from([True, True, True, False]),
        st.sampled_from([{}, {}, {"ns": {"k": 1}}, {"other": {"k": 2}}]),
    )


def draw_effect(data: st.DataObject, session: Session[Any], fresh: str) -> Any:
    conversation = session.conversation
    kinds = ["append"] * 6
    if conversation:
        kinds += ["hide", "annotate", "annotate", "replace", "append_existing"]
    kind = data.draw(st.sampled_from(kinds))
    if kind == "append":
        return AppendMessage(data.draw(message_strategy(fresh)))
    if kind == "append_existing":
        existing = data.draw(st.sampled_from(conversation))
        return AppendMessage(Message.user("again", id=existing.id))
    if kind == "hide":
        ids = data.draw(st.lists(st.sampled_from([m.id for m in conversation]), min_size=1))
        return SetVisibility(tuple(ids), to_model=data.draw(st.booleans()))
    if kind == "annotate":
        message = data.draw(st.sampled_from(conversation))
        calls = [c.call_id for c in message.tool_calls]
        call_id = data.draw(st.sampled_from([None, *calls])) if calls else None
        values = {"k": data.draw(st.integers(0, 9))}
        namespace = data.draw(st.sampled_from(["ns", "other"]))
        return Annotate(message.id, namespace, values, call_id=call_id)
    keep = data.draw(
        st.lists(st.booleans(), min_size=len(conversation), max_size=len(conversation))
    )
    return ReplaceConversation(tuple(m for m, k in zip(conversation, keep, strict=True) if k))


def roundtrip(session: Session[Any]) -> Session[Any]:
    codec: Codec[Any] = Codec()
    return codec.decode_session(codec.encode_session(session))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_index_equals_a_rescan_after_any_effect_sequence(data: st.DataObject) -> None:
    sessions: list[Session[Any]] = [Session(id="s", revision=0, conversation=(), data=NoData())]
    for step in range(data.draw(st.integers(1, 25))):
        # Mostly the newest session; sometimes an older one (a branch of the shared tables).
        base = (
            sessions[-1] if data.draw(st.integers(0, 4)) else data.draw(st.sampled_from(sessions))
        )
        if data.draw(st.integers(0, 9)) == 0:
            base = roundtrip(base)  # a decoded session: its index is rebuilt on first use
        effect = draw_effect(data, base, f"m{step}")
        try:
            after = apply_batch(base, [effect])
        except EffectError:
            continue
        assert_index_matches(after)
        if data.draw(st.booleans()):
            # The same batch applied to the same session again, from a decoded copy (the store).
            stored = Codec().decode_effects(Codec().encode_effects([effect]))
            again = apply_batch(base, stored)
            assert again == after
            assert_index_matches(again)
        assert_index_matches(base)  # applying never changes what the base session answers
        sessions.append(after)
    for session in sessions:
        assert_index_matches(session)
        rebuilt = HistoryIndex.build(session.conversation)
        assert rebuilt.open_calls() == session.history.open_calls()
        assert rebuilt.in_order == session.history.in_order
        assert rebuilt.valid == session.history.valid


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_check_history_fast_form_agrees_with_the_full_check(data: st.DataObject) -> None:
    session: Session[Any] = Session(id="s", revision=0, conversation=(), data=NoData())
    for step in range(data.draw(st.integers(0, 12))):
        try:
            session = apply_batch(session, [AppendMessage(data.draw(message_strategy(f"m{step}")))])
        except EffectError:
            continue
    visible = session.visible_to_model
    full: str | None = None
    try:
        check_history(visible, session_id="s")
    except HistoryError as exc:
        full = str(exc)
    fast: str | None = None
    try:
        check_history(session)
    except HistoryError as exc:
        fast = str(exc)
    assert fast == full


# -- the index is derived data ------------------------------------------------------------


def test_the_index_is_not_encoded_nor_compared() -> None:
    message = Message(id="a", role="assistant", parts=(ToolCallPart.of("c1", "tool", {}),))
    session = Session(id="s", revision=0, conversation=(message,), data=NoData())
    codec: Codec[Any] = Codec()
    before = codec.encode_session(session)
    assert session.history.has_open_calls  # built now
    assert codec.encode_session(session) == before
    assert b"history" not in before
    twin = Session(id="s", revision=0, conversation=(message,), data=NoData())
    assert twin == session
    assert set(msgspec.json.decode(before)) == {"id", "revision", "conversation", "data"}
    decoded = codec.decode_session(before)
    assert "_history_index" not in decoded.__dict__  # rebuilt on first use, not stored
    assert open_tool_calls(decoded) == [message.parts[0]]


def test_no_module_global_memos_remain() -> None:
    assert not hasattr(history_module, "_memo")
    assert not hasattr(checks_module, "_CHECKED")


def test_applying_an_effect_does_not_recheck_the_conversation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    session = Session(
        id="s",
        revision=0,
        conversation=tuple(Message.user(str(i), id=f"u{i}") for i in range(50)),
        data=NoData(),
    )
    calls: list[str] = []
    real = checks_module.tuple_of

    def counting(owner: str, field: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(f"{owner}.{field}")
        return real(owner, field, *args, **kwargs)

    monkeypatch.setattr(session_module, "tuple_of", counting)
    after = apply_batch(session, [AppendMessage(Message.user("x", id="new"))])
    after = apply_batch(after, [Annotate("u3", "ns", {"k": 1})])
    assert after.revision == 2
    assert len(after.conversation) == 51
    assert calls == []  # the kernel builds sessions from checked pieces
    Session(id="s", revision=0, conversation=after.conversation, data=NoData())
    assert calls == ["Session.conversation"]  # direct construction still checks


def test_direct_construction_still_names_the_bad_field() -> None:
    with pytest.raises(InvalidFieldError) as caught:
        Session(id="s", revision=0, conversation=["hi"], data=NoData())  # type: ignore[arg-type]
    assert "conversation[0]" in str(caught.value)
    with pytest.raises(InvalidFieldError):
        msgspec.structs.replace(
            Session(id="s", revision=0, conversation=(), data=NoData()),
            conversation=("hi",),
        )


def test_after_a_message_is_hidden_the_visible_messages_come_from_the_index() -> None:
    """Invariant 10 after a compaction: a request's messages are not filtered from the history.

    The conversation here counts every message read from it; appending, annotating
    and reading ``visible_to_model`` read none of it, at any length.
    """
    from _scans import counted

    from stepmachine.testing import make_session

    for turns in (10, 500):
        old = msgspec.structs.replace(Message.user("old", id="old"), visible_to_model=False)
        messages = [old] + [Message.user(f"m{i}", id=f"m{i}") for i in range(turns)]
        session, conversation = counted(make_session(*messages))
        assert len(session.visible_to_model) == turns
        after = apply_batch(
            session,
            [
                AppendMessage(Message.user("new", id="new")),
                Annotate("m0", "app", {"k": 1}),
                AppendMessage(
                    msgspec.structs.replace(Message.user("h", id="h"), visible_to_model=False)
                ),
            ],
        )
        visible = after.visible_to_model
        assert conversation.read == 0
        assert tuple(visible) == tuple(m for m in after.conversation if m.visible_to_model)
        assert visible[0].notes == {"app": {"k": 1}}
        assert visible[-1].id == "new"
