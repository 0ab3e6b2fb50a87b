"""Reading a conversation as a provider would: calls, results, validity.

Valid history: before any model request, every tool call has
exactly one result, every result follows its call, and call ids are unique.
:func:`history_problems` lists every way a conversation breaks that rule and
:func:`check_history` raises :class:`~stepmachine.HistoryError` naming them.
Only messages visible to the model count: hidden messages are never sent.

Each function takes a conversation (any sequence of messages: a full scan) or
a :class:`~stepmachine.Session`, whose history index
(:attr:`Session.history <stepmachine.Session.history>`) answers without
rescanning: ``open_tool_calls(session)`` is O(open calls),
``check_history(session)`` and ``request_order(session)`` are O(1) when the
history is valid and in order. With a session, the functions read the
messages visible to the model, as a request would.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ._errors import HistoryError
from ._messages import Message, ToolCallPart, ToolResultPart
from ._session import Session

__all__ = ["check_history", "history_problems", "open_tool_calls", "request_order"]


def open_tool_calls(conversation: Iterable[Message] | Session[Any]) -> list[ToolCallPart]:
    """The tool calls (visible to the model) that have no result yet, oldest first.

    Given a session, read from its history index (O(open calls)); given
    messages, a scan of them. Returns a new list.
    """
    if isinstance(conversation, Session):
        return conversation.history.open_calls()
    return _scan_open_calls(conversation)


def _scan_open_calls(conversation: Iterable[Message]) -> list[ToolCallPart]:
    calls: dict[str, ToolCallPart] = {}
    for message in conversation:
        if not message.visible_to_model:
            continue
        for part in message.parts:
            if isinstance(part, ToolCallPart):
                calls.setdefault(part.call_id, part)
            elif isinstance(part, ToolResultPart):
                calls.pop(part.call_id, None)
    return list(calls.values())


def history_problems(conversation: Sequence[Message] | Session[Any]) -> list[str]:
    """Every violation of the "valid history" guarantee in ``conversation``, as readable strings.

    An empty list means the history may be sent to any provider. Given a
    session, its visible messages are checked, and a valid history (the index
    knows) costs O(1).
    """
    if isinstance(conversation, Session):
        if conversation.history.valid:
            return []
        conversation = conversation.visible_to_model
    problems: list[str] = []
    seen_calls: set[str] = set()
    answered: set[str] = set()
    for index, message in enumerate(conversation):
        if not message.visible_to_model:
            continue
        for part in message.parts:
            if isinstance(part, ToolCallPart):
                if message.role != "assistant":
                    problems.append(
                        f"message {index} ({message.id!r}, role {message.role!r}) holds tool "
                        f"call {part.call_id!r}; only assistant messages may"
                    )
                if part.call_id in seen_calls:
                    problems.append(f"tool call id {part.call_id!r} repeats at message {index}")
                seen_calls.add(part.call_id)
            elif isinstance(part, ToolResultPart):
                if part.call_id not in seen_calls:
                    problems.append(
                        f"tool result for {part.call_id!r} at message {index} follows no call"
                    )
                elif part.call_id in answered:
                    problems.append(
                        f"tool call {part.call_id!r} has a second result at message {index}"
                    )
                answered.add(part.call_id)
    problems.extend(
        f"tool call {call_id!r} has no result" for call_id in sorted(seen_calls - answered)
    )
    return problems


def check_history(
    conversation: Sequence[Message] | Session[Any], *, session_id: str | None = None
) -> None:
    """Raise :class:`HistoryError` if ``conversation`` breaks the "valid history" guarantee.

    Given a session (its id named in the error unless ``session_id`` is
    given), O(1) when its history is valid.
    """
    if session_id is None:
        session_id = conversation.id if isinstance(conversation, Session) else "?"
    problems = history_problems(conversation)
    if problems:
        raise HistoryError(
            f"valid history broken in session {session_id!r}: " + "; ".join(problems)
        )


def request_order(messages: Sequence[Message] | Session[Any]) -> Sequence[Message]:
    """The messages in the order providers accept: results right after their calls.

    OpenAI and Anthropic require the results of an assistant turn's tool calls
    to come directly after that turn. A history can hold something in between
    (a user message submitted while tools were running); the stored history is
    never rewritten, but a request shows each tool message right after the
    assistant message whose calls it answers, and everything else in its
    original order. A tool message answering calls of several assistant
    messages stays where it is. Pure; returns the input order when nothing
    needs to move. Given a session, orders its visible messages, O(1) when
    its index says nothing needs to move (the session's own tuple is returned
    when no message is hidden).
    """
    if isinstance(messages, Session):
        if messages.history.in_order:
            return messages.visible_to_model
        messages = messages.visible_to_model
    owner: dict[str, int] = {}  # call id -> index of the assistant message holding it
    for index, message in enumerate(messages):
        for call in message.tool_calls:
            owner.setdefault(call.call_id, index)
    results_of: dict[int, list[int]] = {}  # assistant index -> indexes of its tool messages
    moved: set[int] = set()
    for index, message in enumerate(messages):
        if message.role != "tool" or not message.tool_results:
            continue
        owners = {owner.get(result.call_id) for result in message.tool_results}
        if len(owners) != 1 or None in owners:
            continue
        (assistant,) = owners
        if assistant is not None and assistant < index:
            results_of.setdefault(assistant, []).append(index)
            moved.add(index)
    if not moved:
        return tuple(messages)
    ordered: list[Message] = []
    for index, message in enumerate(messages):
        if index in moved:
            continue
        ordered.append(message)
        ordered.extend(messages[i] for i in results_of.get(index, ()))
    return tuple(ordered)
