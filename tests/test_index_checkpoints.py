"""``SetVisibility`` replays the history index from a checkpoint: still equal to a rescan.

Hiding or showing a message used to rebuild the whole index (O(history)); it
now replays the messages from the latest checkpoint before the first change.
The property of ``test_session_index`` runs here with a checkpoint every two
messages (the default is every ``CHUNK``), so that replays start mid-history,
after annotations and visibility changes the checkpoints do not know of.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_session_index import assert_index_matches, draw_effect, roundtrip

import stepmachine._index as index_module
from stepmachine import (
    Annotate,
    AppendMessage,
    EffectError,
    Message,
    NoData,
    Session,
    SetVisibility,
)
from stepmachine.extend import Conversation, apply_batch
from stepmachine.testing import make_session


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the messages read through every Conversation from now on (in ``[0]``)."""
    read = [0]
    iterate, get = Conversation.__iter__, Conversation.__getitem__
    backwards, as_tuple = Conversation.__reversed__, Conversation.as_tuple

    def counted_iter(conversation: Conversation) -> Iterator[Message]:
        for message in iterate(conversation):
            read[0] += 1
            yield message

    def counted_reversed(conversation: Conversation) -> Iterator[Message]:
        for message in backwards(conversation):
            read[0] += 1
            yield message

    def counted_as_tuple(conversation: Conversation) -> tuple[Message, ...]:
        read[0] += len(conversation)
        return as_tuple(conversation)

    def counted_get(conversation: Conversation, index: Any) -> Any:
        got = get(conversation, index)
        read[0] += len(got) if isinstance(index, slice) else 1
        return got

    monkeypatch.setattr(Conversation, "__iter__", counted_iter)
    monkeypatch.setattr(Conversation, "__reversed__", counted_reversed)
    monkeypatch.setattr(Conversation, "as_tuple", counted_as_tuple)
    monkeypatch.setattr(Conversation, "__getitem__", counted_get)
    return read


# 100 examples of up to 40 effects each: test_session_index runs the same property 200 times
# with the default checkpoints; here what is new is where the replays start.
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from([1, 2, 3]))
def test_the_index_after_a_visibility_change_equals_a_rescan(
    data: st.DataObject, every: int
) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(index_module, "CHECKPOINT_EVERY", every)
        sessions: list[Session[Any]] = [Session(id="s", revision=0, conversation=(), data=NoData())]
        for step in range(data.draw(st.integers(1, 40))):
            newest = data.draw(st.integers(0, 4))
            base = sessions[-1] if newest else data.draw(st.sampled_from(sessions))
            if data.draw(st.integers(0, 9)) == 0:
                base = roundtrip(base)
            effect = draw_effect(data, base, f"m{step}")
            try:
                after = apply_batch(base, [effect])
            except EffectError:
                continue
            assert_index_matches(after)
            assert_index_matches(base)
            sessions.append(after)
        for session in sessions:
            assert_index_matches(session)


def test_hiding_the_latest_reply_reads_no_more_of_a_longer_history(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A retry hides the reply it re-asks for: that reads the messages after the checkpoint.

    Counts every message read from any conversation (the derived ones too).
    """
    reads = []
    for turns in (20, 2000):
        messages = [Message.user(f"m{i}", id=f"m{i}") for i in range(turns)]
        session = make_session(*messages, Message.assistant("x", id="a"))
        assert session.history.length == turns + 1  # built once, as on load
        read = _count_reads(monkeypatch)
        after = apply_batch(
            session,
            [
                SetVisibility(("a",), to_model=False),
                Annotate("a", "app", {"hidden": True}),
                AppendMessage(Message.user("again", id="again")),
                SetVisibility(("m3",), to_user=False),  # the user's view only: O(1)
            ],
        )
        reads.append(read[0])
        monkeypatch.undo()
        assert not after.conversation[-2].visible_to_model
        assert after.visible_to_model == tuple(m for m in after.conversation if m.visible_to_model)
        assert after.history.visible is not None
        assert not after.conversation[3].visible_to_user
        assert msgspec.structs.replace(after.conversation[3], visible_to_user=True) == messages[3]
    assert reads[1] <= reads[0] + 2 * index_module.CHUNK, reads


def test_checkpoints_keep_no_tables_alive() -> None:
    """A checkpoint holds the small state only: replays do not keep earlier lines of tables."""
    session = make_session(*(Message.user(f"m{i}", id=f"m{i}") for i in range(300)))
    for n in range(5):
        session = apply_batch(
            session,
            [
                SetVisibility((f"m{290 - n}",), to_model=False),
                AppendMessage(Message.user(f"x{n}", id=f"x{n}")),
            ],
        )
    checkpoint = session.history._checkpoint
    lengths = []
    while checkpoint is not None:
        assert checkpoint._line is index_module._NO_LINE
        assert checkpoint._visible is None
        lengths.append(checkpoint.length)
        checkpoint = checkpoint._checkpoint
    assert lengths == list(range(0, 305, index_module.CHECKPOINT_EVERY))[::-1]
