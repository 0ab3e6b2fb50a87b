"""An outside review of kernel v2 (issue 9): each test is a defect found, then fixed.

Conversation, one apply per batch, step capabilities and ``gc=False`` structs.
"""

from __future__ import annotations

from stepmachine import (
    Codec,
    Message,
    ReplaceConversation,
    apply_batch,
)
from stepmachine.testing import make_session


def test_replace_conversation_takes_the_sessions_conversation_and_its_sum() -> None:
    """``session.conversation + (m,)`` was a tuple and is now a Conversation: both still work.

    Compaction-like user code builds ``ReplaceConversation(session.conversation + (summary,))``
    or ``ReplaceConversation(session.conversation)``; it raised ``InvalidFieldError``.
    """
    session = make_session("a", "b", "c")
    extra = Message.user("d", id="d")
    for conversation in (session.conversation, session.conversation + (extra,)):
        effect = ReplaceConversation(conversation)
        assert type(effect.conversation) is tuple
        assert effect.conversation == tuple(conversation)
        after = apply_batch(session, [effect])
        assert after.conversation == conversation
        codec = Codec()
        assert codec.decode_effects(codec.encode_effects((effect,)), where="t") == (effect,)
