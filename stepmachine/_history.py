"""Reading a conversation as a provider would: calls, results, validity.

Invariant 4 (valid history): before any model request, every tool call has
exactly one result, every result follows its call, and call ids are unique.
:func:`history_problems` lists every way a conversation breaks that rule and
:func:`check_history` raises :class:`~stepmachine.HistoryError` naming them.
Only messages visible to the model count: hidden messages are never sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ._errors import HistoryError
from ._messages import Message, ToolCallPart

__all__ = ["check_history", "history_problems", "open_tool_calls"]


def open_tool_calls(conversation: Iterable[Message]) -> list[ToolCallPart]:
    """The tool calls (visible to the model) that have no result yet, oldest first."""
    calls: dict[str, ToolCallPart] = {}
    for message in conversation:
        if not message.visible_to_model:
            continue
        for part in message.tool_calls:
            calls.setdefault(part.call_id, part)
        for result in message.tool_results:
            calls.pop(result.call_id, None)
    return list(calls.values())


def history_problems(conversation: Sequence[Message]) -> list[str]:
    """Every violation of invariant 4 in ``conversation``, as readable strings.

    An empty list means the history may be sent to any provider.
    """
    problems: list[str] = []
    seen_calls: set[str] = set()
    answered: set[str] = set()
    for index, message in enumerate(conversation):
        if not message.visible_to_model:
            continue
        for call in message.tool_calls:
            if message.role != "assistant":
                problems.append(
                    f"message {index} ({message.id!r}, role {message.role!r}) holds tool call "
                    f"{call.call_id!r}; only assistant messages may"
                )
            if call.call_id in seen_calls:
                problems.append(f"tool call id {call.call_id!r} repeats at message {index}")
            seen_calls.add(call.call_id)
        for result in message.tool_results:
            if result.call_id not in seen_calls:
                problems.append(
                    f"tool result for {result.call_id!r} at message {index} follows no call"
                )
            elif result.call_id in answered:
                problems.append(
                    f"tool call {result.call_id!r} has a second result at message {index}"
                )
            answered.add(result.call_id)
    problems.extend(
        f"tool call {call_id!r} has no result" for call_id in sorted(seen_calls - answered)
    )
    return problems


def check_history(conversation: Sequence[Message], *, session_id: str = "?") -> None:
    """Raise :class:`HistoryError` if ``conversation`` breaks invariant 4."""
    problems = history_problems(conversation)
    if problems:
        raise HistoryError(
            f"invariant 4 (valid history) broken in session {session_id!r}: " + "; ".join(problems)
        )
