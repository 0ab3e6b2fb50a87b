"""A conversation that counts the messages read from it, to catch whole-history scans.

Invariant 10 (constant cost per step): a step's ``run`` and hooks read what
the session's history index points at, never every message. Tests wrap a
session's conversation in :class:`CountingConversation` (its index already
built) and check how many messages a step read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, overload

from stepmachine import Message, Session
from stepmachine._session import derive_session
from stepmachine.extend import Conversation

__all__ = ["CountingConversation", "counted", "tool_loop"]


class CountingConversation(Conversation):
    """A conversation that counts every message handed out (``read``).

    Derived conversations (``appended``, ``replaced``) are plain ones: only
    reads of the conversation a test hands a step are counted.
    """

    def __init__(self, items: Iterable[Message]) -> None:
        super().__init__(items)
        self.read = 0

    def __iter__(self) -> Iterator[Message]:
        for message in super().__iter__():
            self.read += 1
            yield message

    def __reversed__(self) -> Iterator[Message]:
        for message in super().__reversed__():
            self.read += 1
            yield message

    @overload
    def __getitem__(self, key: int) -> Message: ...
    @overload
    def __getitem__(self, key: slice) -> tuple[Message, ...]: ...
    def __getitem__(self, key: Any) -> Any:
        result = super().__getitem__(key)
        self.read += len(result) if isinstance(key, slice) else 1
        return result

    def as_tuple(self) -> tuple[Message, ...]:
        self.read += len(self)
        return super().as_tuple()


def counted(session: Session[Any]) -> tuple[Session[Any], CountingConversation]:
    """``session`` with its conversation counting reads; its index is built first (free)."""
    index = session.history
    conversation = CountingConversation(session.conversation)
    return derive_session(session, conversation=conversation, index=index), conversation


def tool_loop(turns: int, *, prefix: str = "t") -> list[Message]:
    """``turns`` finished turns: a user message, an assistant call (with an inference
    receipt and its ledger, as ``ModelInference`` writes them, the call of turn ``n``
    made at revision ``n``), and its result."""
    from stepmachine import ToolCallPart, ToolResultPart, Usage
    from stepmachine.extend import InferenceReceipt, Ledger, Spent, note_value

    messages: list[Message] = []
    for turn in range(turns):
        call = ToolCallPart.of(f"{prefix}{turn}", "read_file", {"path": f"f{turn}"})
        total = Spent(turn + 1, 10 * (turn + 1), 5 * (turn + 1))
        ledger = Ledger(total, Spent(1, 10, 5), turn, turn_start=f"{prefix}u{turn}")
        receipt = InferenceReceipt(attempts=1, revision=turn, usage=Usage(10, 5), ledger=ledger)
        messages += [
            Message.user(f"read f{turn}", id=f"{prefix}u{turn}"),
            Message(
                id=f"{prefix}a{turn}",
                role="assistant",
                parts=(call,),
                notes={"inference": note_value(receipt)},
            ),
            Message.tool_result(ToolResultPart.for_call(call, "contents"), id=f"{prefix}r{turn}"),
        ]
    return messages


def context(session: Session[Any], *, steps: Any = ()) -> Any:
    """A bare step context for ``session`` (no store; a fixed clock)."""
    from stepmachine import Runtime, StepContext
    from stepmachine._emitter import EventSink
    from stepmachine.extend import NullEmitter

    return StepContext(
        session=session,
        runtime=Runtime(clock=lambda: 1_000.0),
        events=EventSink(NullEmitter(), session.id, session.revision),
        steps=tuple(steps),
    )
