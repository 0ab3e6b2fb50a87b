"""An outside review of kernel v2 (issue 9): each test is a defect found, then fixed.

Conversation, one apply per batch, step capabilities and ``gc=False`` structs.
"""

from __future__ import annotations

from typing import Any

import pytest

from stepmachine import (
    Batch,
    Codec,
    ConfigurationError,
    Message,
    ModelInference,
    ReplaceConversation,
    Runtime,
    Session,
    StateMachine,
    apply_batch,
    counter_ids,
)
from stepmachine.stores import MemoryStore
from stepmachine.testing import ScriptedModel, make_session, reply


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


class _ReturnsTheSessionBefore:
    """A third-party handler that stores the batch but returns the session *before* it."""

    def __init__(self) -> None:
        self.inner = MemoryStore()

    async def load(self, session_id: str) -> Session[Any]:
        return await self.inner.load(session_id)

    async def apply(self, batch: Batch[Any]) -> Session[Any] | None:
        before = await self.inner.load(batch.session_id)
        await self.inner.apply(batch)
        return before


class _DeclaresAndReturnsTheSessionBefore(_ReturnsTheSessionBefore):
    applies_batches = True


@pytest.mark.parametrize(
    "handler_type", [_ReturnsTheSessionBefore, _DeclaresAndReturnsTheSessionBefore]
)
async def test_a_handler_returning_a_session_of_another_revision_is_an_error(
    handler_type: type[_ReturnsTheSessionBefore],
) -> None:
    """A machine given a stale session by ``apply`` reported revision 0 with no reply, silently.

    ``apply`` must return the session *after* the batch (or ``None``); one that
    does not is a broken handler, said at once instead of a run that decides
    from a session the store no longer holds (invariant 1).
    """
    handler = handler_type()
    await handler.inner.create("s", conversation=[Message.user("hi", id="u")])
    machine = StateMachine([ModelInference()])
    runtime = Runtime(
        loader=handler, handler=handler, model=ScriptedModel([reply("a")]), ids=counter_ids()
    )
    with pytest.raises(ConfigurationError, match="at revision 0 for the batch producing"):
        await machine.run(runtime, "s")
