"""Constant cost per step: each built-in operation reads as many messages at turn 2,000 as at
turn 20."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from stepmachine import Message, Session, Step, ToolCallPart, ToolResultPart
from stepmachine._conversation import CHUNK
from stepmachine.extend import Conversation, InferenceReceipt, Ledger, Spent, note_value
from stepmachine.operations import (
    Approval,
    Budget,
    Compaction,
    HistoryGuard,
    InvalidCalls,
    Limits,
)
from stepmachine.testing import make_session, run_step

# -- invariant 10 for the built-in operations ---------------------------------------------


def _receipt(i: int) -> dict[str, Any]:
    """The notes of the ``i``-th reply (one tool call) as ModelInference records them: its
    ledger counts ``i + 1`` model calls and tool calls, the call made at revision ``i``."""
    spent = Spent(i + 1, 0, 0, i + 1)
    ledger = Ledger(spent, spent, revision=i, turn_start="u", tools=True)
    return {"inference": note_value(InferenceReceipt(attempts=1, revision=i, ledger=ledger))}


def _tool_session(turns: int, *, open_call: bool) -> Session[Any]:
    """``turns`` answered tool turns, each reply with its receipt and ledger; then an open
    call, or a new user message."""
    messages = [Message.user("go", id="u")]
    for i in range(turns):
        call = ToolCallPart.of(f"c{i}", "add", {"a": i})
        messages.append(Message(id=f"a{i}", role="assistant", parts=(call,), notes=_receipt(i)))
        if open_call and i == turns - 1:
            break
        messages.append(Message.tool_result(ToolResultPart.for_call(call, "ok"), id=f"r{i}"))
    if not open_call:
        messages.append(Message.user("more", id="u2"))
    return make_session(*messages)


class _Touches:
    """Counts the messages read through a Conversation (iteration, slices, as_tuple)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        iterate, backwards = Conversation.__iter__, Conversation.__reversed__
        as_tuple, get = Conversation.as_tuple, Conversation.__getitem__

        def counted_iter(conversation: Conversation) -> Iterator[Message]:
            for message in iterate(conversation):
                self.count += 1
                yield message

        def counted_reversed(conversation: Conversation) -> Iterator[Message]:
            for message in backwards(conversation):
                self.count += 1
                yield message

        def counted_as_tuple(conversation: Conversation) -> tuple[Message, ...]:
            self.count += len(conversation)
            return as_tuple(conversation)

        def counted_get(conversation: Conversation, index: Any) -> Any:
            got = get(conversation, index)
            self.count += len(got) if isinstance(index, slice) else 1
            return got

        monkeypatch.setattr(Conversation, "__iter__", counted_iter)
        monkeypatch.setattr(Conversation, "__reversed__", counted_reversed)
        monkeypatch.setattr(Conversation, "as_tuple", counted_as_tuple)
        monkeypatch.setattr(Conversation, "__getitem__", counted_get)


def _operation(kind: str) -> Step[Any]:
    if kind == "approval":
        return Approval(["pay"])
    if kind == "history_guard":
        return HistoryGuard()
    if kind == "invalid_calls":
        return InvalidCalls()
    if kind == "budget":
        # Per turn and per session (a run that began at revision 0, as run_step's does, is the
        # whole history: per run, a budget reads the run, see test_budget).
        limits = Limits(model_calls=10**6, tool_calls=10**6)
        return Budget(per_turn=limits, per_session=limits)
    return Compaction(threshold=10**9)


# The open call here is of a tool no step advertises: HistoryGuard and InvalidCalls repair it
# (a repair rebuilds what it changes, O(history), once); in a run with the tool served they
# refuse on the index. Budget reads its counts from the latest ledger (the replies carry them).
OPERATION_CASES = [
    ("approval", True),
    ("history_guard", True),
    ("invalid_calls", True),
    ("budget", True),
    ("budget", False),
    ("compaction", False),
    ("approval", False),
    ("history_guard", False),
    ("invalid_calls", False),
    ("compaction", True),
]


@pytest.mark.parametrize(("kind", "open_call"), OPERATION_CASES)
async def test_a_built_in_operation_reads_as_many_messages_at_turn_2000_as_at_turn_20(
    kind: str, open_call: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Invariant 10: a cycle's cost does not grow with the history, operations included.

    Counts the messages each operation's ``run`` and ``check_call`` read from
    the conversation (no timing): at turn 2,000 no more than at turn 20, plus
    a constant. Measured on this machine, a cycle with an open call costs
    Approval 106x, HistoryGuard 90x, InvalidCalls 57x, Budget 100x at turn
    2,000 what it costs at turn 20; a cycle ending on a user message costs
    Budget 100x and Compaction (below its threshold) 131x. Budget, with
    tool-call and model-call limits per turn and per session, now reads 15
    messages (open call) and 33 (user message) at either length.
    """
    touched: list[int] = []
    for turns in (20, 2000):
        session = _tool_session(turns, open_call=open_call)
        assert session.history.length == len(session.conversation)  # built once, as on load
        step = _operation(kind)
        counter = _Touches(monkeypatch)
        check = await run_step(step, session)
        last_call = next(m for m in reversed(session.conversation) if m.tool_calls).tool_calls[0]
        check.ctx.vet_call(last_call)
        touched.append(counter.count)
        monkeypatch.undo()
    assert touched[1] <= touched[0] + 2 * CHUNK, touched
