"""A step that refuses looks at little: with no open tool call, ``Tools``, ``Approval`` and
``ModelInference`` refuse without walking the conversation's messages.

The open calls of a conversation are computed once per cycle and shared by every step
(``open_tool_calls``: memoised or indexed); what is measured here is what each step
reads beyond asking it once.
"""

from __future__ import annotations

from typing import Any

import pytest

from operations import Approval
from stepmachine import (
    Message,
    ModelInference,
    Operation,
    Session,
    ToolCallPart,
    ToolResultPart,
    Tools,
    tool,
)
from stepmachine.extend import open_tool_calls
from stepmachine.testing import make_session, run_step


@tool
def lookup(key: str) -> str:
    """Look a key up."""
    return key


def long_closed_history(turns: int) -> Session[Any]:
    """``turns`` rounds of user, call, result, answer: no call is open; ends on an answer."""
    messages: list[Message] = []
    for i in range(turns):
        messages.append(Message.user(f"q{i}", id=f"u{i}"))
        messages.append(
            Message.assistant(ToolCallPart.of(f"c{i}", "lookup", {"key": "k"}), id=f"a{i}")
        )
        result = ToolResultPart(call_id=f"c{i}", content="v", name="lookup")
        messages.append(Message.tool_result(result, id=f"r{i}"))
        messages.append(Message.assistant(f"answer {i}", id=f"b{i}"))
    return make_session(*messages)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts every read of ``Message.tool_calls`` / ``tool_results`` while installed."""
    seen: list[str] = []
    calls, results = Message.tool_calls, Message.tool_results

    def counted(name: str, prop: Any) -> property:
        def get(self: Message) -> Any:
            seen.append(name)
            return prop.fget(self)

        return property(get)

    monkeypatch.setattr(Message, "tool_calls", counted("tool_calls", calls))
    monkeypatch.setattr(Message, "tool_results", counted("tool_results", results))
    return seen


@pytest.mark.parametrize(
    "step",
    [Tools([lookup]), Approval({"lookup"}), ModelInference()],
    ids=["Tools", "Approval", "ModelInference"],
)
async def test_a_refusing_step_reads_no_message_beyond_the_shared_open_calls(
    step: Operation[Any], reads: list[str]
) -> None:
    session = long_closed_history(50)
    assert open_tool_calls(session.conversation) == []  # the cycle's shared answer
    reads.clear()
    open_tool_calls(session.conversation)  # what asking it again costs (memo or index)
    shared = len(reads)
    reads.clear()
    others: list[Operation[Any]] = [] if isinstance(step, Tools) else [Tools([lookup])]
    check = await run_step(step, session, others=others)
    assert check.refused
    assert len(reads) <= shared, f"{len(reads)} reads beyond the shared open calls ({shared})"
