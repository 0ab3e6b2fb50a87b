"""``Conversation``: a sequence of messages that shares structure, and behaves like the tuple.

Every operation is checked against the same operation on a plain tuple, over
random lengths around the chunk boundaries and random edit sequences.
"""

from __future__ import annotations

import pickle

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepmachine import (
    AppendMessage,
    Codec,
    InvalidFieldError,
    Message,
    NoData,
    ReplaceConversation,
    Session,
    UpdateData,
)
from stepmachine._conversation import CHUNK
from stepmachine.extend import Conversation, apply_batch
from stepmachine.testing import make_session


def messages(n: int, prefix: str = "m") -> tuple[Message, ...]:
    return tuple(Message.user(f"text {i}", id=f"{prefix}{i}") for i in range(n))


LENGTHS = st.one_of(
    st.integers(0, 3 * CHUNK + 3),
    st.sampled_from([CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 2 * CHUNK + 1]),
)

# An edit: ("append",) or ("replace", position seed).
EDITS = st.lists(
    st.one_of(st.just(("append", 0)), st.tuples(st.just("replace"), st.integers(0, 10_000))),
    max_size=3 * CHUNK,
)


@settings(max_examples=200, deadline=None)
@given(LENGTHS, EDITS)
def test_edits_match_the_same_edits_on_a_tuple(n: int, edits: list[tuple[str, int]]) -> None:
    reference = messages(n)
    conversation = Conversation(reference)
    versions = [(conversation, reference)]
    for step, (kind, seed) in enumerate(edits):
        new = Message.user(f"new {step}", id=f"new{step}")
        if kind == "append" or not reference:
            conversation = conversation.appended(new)
            reference = (*reference, new)
        else:
            position = seed % len(reference)
            conversation = conversation.replaced(position, new)
            reference = (*reference[:position], new, *reference[position + 1 :])
        versions.append((conversation, reference))
    # Every older version is unchanged by the edits derived from it (structure is shared).
    for version, expected in versions:
        assert len(version) == len(expected)
        assert tuple(version) == expected
        assert version == expected
        assert version == list(expected)
        assert version == Conversation(expected)
        assert list(reversed(version)) == list(reversed(expected))
        assert version.as_tuple() == expected
        assert bool(version) == bool(expected)


@settings(max_examples=200, deadline=None)
@given(
    LENGTHS,
    st.integers(-300, 300),
    st.integers(-300, 300) | st.none(),
    st.integers(-300, 300) | st.none(),
    st.sampled_from([None, 1, 2, -1, 3]),
)
def test_indexing_and_slicing_match_the_tuple(
    n: int, index: int, start: int | None, stop: int | None, step: int | None
) -> None:
    reference = messages(n)
    conversation = Conversation(reference)
    if -n <= index < n:
        assert conversation[index] is reference[index]
    else:
        with pytest.raises(IndexError):
            conversation[index]
    sliced = conversation[start:stop:step]
    assert type(sliced) is tuple
    assert sliced == reference[start:stop:step]


def test_equality_and_inequality() -> None:
    a = Conversation(messages(CHUNK + 2))
    assert a == Conversation(messages(CHUNK + 2))
    assert a != Conversation(messages(CHUNK + 1))
    assert a != Conversation(messages(CHUNK + 2, prefix="x"))
    assert a != "not a conversation"
    assert (a == 3) is False
    assert messages(3) == Conversation(messages(3))  # the tuple on the left
    assert Conversation() == ()


def test_add_appends_and_radd_makes_a_tuple() -> None:
    base = Conversation(messages(2))
    extra = messages(3, prefix="x")
    joined = base + extra
    assert type(joined) is Conversation
    assert joined == (*messages(2), *extra)
    assert base == messages(2)  # unchanged
    left = extra + base
    assert type(left) is tuple
    assert left == (*extra, *messages(2))


def test_replaced_outside_the_conversation_raises() -> None:
    conversation = Conversation(messages(3))
    with pytest.raises(IndexError):
        conversation.replaced(3, messages(1)[0])
    with pytest.raises(IndexError):
        conversation.replaced(-1, messages(1)[0])


def test_sequence_methods_and_pickle() -> None:
    items = messages(CHUNK + 5)
    conversation = Conversation(items)
    assert conversation.index(items[CHUNK + 1]) == CHUNK + 1
    assert conversation.count(items[0]) == 1
    assert items[3] in conversation
    assert pickle.loads(pickle.dumps(conversation)) == conversation
    assert repr(Conversation(messages(1))).startswith("Conversation((Message(")


def test_session_converts_tuples_and_lists_and_checks_items() -> None:
    items = messages(3)
    for given_as in (items, list(items), Conversation(items)):
        session = Session(id="s", revision=0, conversation=given_as, data=NoData())
        assert type(session.conversation) is Conversation
        assert session.conversation == items
    with pytest.raises(InvalidFieldError):
        Session(id="s", revision=0, conversation=("not a message",), data=NoData())  # type: ignore[arg-type]
    with pytest.raises(InvalidFieldError):
        Session(
            id="s",
            revision=0,
            conversation=Conversation(["not a message"]),  # type: ignore[list-item]
            data=NoData(),
        )


def test_appending_shares_every_full_chunk() -> None:
    session = Session(id="s", revision=0, conversation=messages(3 * CHUNK + 1), data=NoData())
    after = apply_batch(session, [AppendMessage(Message.user("new", id="new"))])
    before_chunks = session.conversation._chunks
    after_chunks = after.conversation._chunks
    assert all(a is b for a, b in zip(before_chunks[:-1], after_chunks[:-1], strict=True))
    assert session.conversation == messages(3 * CHUNK + 1)  # the old value is unchanged


def test_codec_round_trip_and_encoding_hook() -> None:
    codec: Codec[NoData] = Codec()
    session = Session(id="s", revision=4, conversation=messages(CHUNK + 3), data=NoData())
    encoded = codec.encode_session(session)
    assert encoded == msgspec.json.encode(session, enc_hook=Conversation.enc_hook)
    decoded = codec.decode_session(encoded)
    assert type(decoded.conversation) is Conversation
    assert decoded == session
    plain = msgspec.json.decode(encoded)
    assert [m["id"] for m in plain["conversation"]] == [m.id for m in messages(CHUNK + 3)]
    with pytest.raises(TypeError):
        msgspec.json.encode(session)  # msgspec does not know the type without the hook
    with pytest.raises(NotImplementedError):
        Conversation.enc_hook(object())


def test_replace_conversation_takes_the_sessions_conversation_and_its_sum() -> None:
    """``session.conversation + (m,)`` was a tuple and is now a Conversation: both still work.

    Compaction-like user code builds ``ReplaceConversation(session.conversation + (summary,))``
    or ``ReplaceConversation(session.conversation)``; it raised ``InvalidFieldError``.
    """
    session = make_session("a", "b", "c")
    extra = Message.user("d", id="d")
    plus = session.conversation + (extra,)  # noqa: RUF005 - the operator under test
    for conversation in (session.conversation, plus):
        effect = ReplaceConversation(conversation)
        assert type(effect.conversation) is tuple
        assert effect.conversation == tuple(conversation)
        after = apply_batch(session, [effect])
        assert after.conversation == conversation
        codec = Codec()
        assert codec.decode_effects(codec.encode_effects((effect,)), where="t") == (effect,)


class _Archive(msgspec.Struct, frozen=True):
    archive: tuple[Message, ...] = ()


def test_update_data_set_takes_the_sessions_conversation() -> None:
    """``UpdateData.set(archive=session.conversation)`` worked on the tuple; it raised TypeError.

    ``set`` takes "field values of any msgspec-supported type"; a conversation
    (archived before a compaction, say) is one since the session holds one.
    """
    session = make_session("a", "b", data=_Archive())
    effect = UpdateData.set(archive=session.conversation)
    after = apply_batch(session, [effect])
    assert after.data.archive == tuple(session.conversation)
    codec = Codec(_Archive)
    assert codec.decode_effects(codec.encode_effects((effect,)), where="t") == (effect,)
