"""Invariant 4 (valid history): open calls, every way a history can break, hidden messages."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepmachine import HistoryError, Message, TextPart, ToolCallPart, ToolResultPart
from stepmachine.extend import check_history, history_problems, open_tool_calls, request_order


def user(message_id: str, text: str = "hi") -> Message:
    return Message.user(text, id=message_id)


def calls(message_id: str, *call_ids: str, role: str = "assistant") -> Message:
    return Message(
        id=message_id,
        role=role,  # type: ignore[arg-type]
        parts=tuple(ToolCallPart.of(c, "tool", {"c": c}) for c in call_ids),
    )


def results(message_id: str, *call_ids: str) -> Message:
    return Message(
        id=message_id,
        role="tool",
        parts=tuple(ToolResultPart(call_id=c, content="ok") for c in call_ids),
    )


def hidden(message: Message) -> Message:
    return msgspec.structs.replace(message, visible_to_model=False)


# -- open_tool_calls ----------------------------------------------------------------------------


def test_open_tool_calls_oldest_first() -> None:
    conversation = [user("u"), calls("a1", "c1", "c2"), results("t1", "c1"), calls("a2", "c3")]
    assert [c.call_id for c in open_tool_calls(conversation)] == ["c2", "c3"]
    assert open_tool_calls(conversation)[0] == conversation[1].tool_calls[1]


def test_open_tool_calls_none_when_all_answered() -> None:
    conversation = [user("u"), calls("a1", "c1", "c2"), results("t1", "c2"), results("t2", "c1")]
    assert open_tool_calls(conversation) == []
    assert open_tool_calls([]) == []


def test_open_tool_calls_ignore_hidden_messages() -> None:
    assert open_tool_calls([user("u"), hidden(calls("a", "c1"))]) == []
    # a hidden result does not close a visible call
    conversation = [user("u"), calls("a", "c1"), hidden(results("t", "c1"))]
    assert [c.call_id for c in open_tool_calls(conversation)] == ["c1"]


def test_open_tool_calls_accepts_any_iterable() -> None:
    assert [c.call_id for c in open_tool_calls(iter([calls("a", "c1")]))] == ["c1"]


# -- history_problems / check_history -----------------------------------------------------------


def test_valid_history_has_no_problems() -> None:
    conversation = [
        Message.system("sys", id="s"),
        user("u1"),
        calls("a1", "c1", "c2"),
        results("t1", "c1", "c2"),
        Message.assistant("done", id="a2"),
        user("u2"),
        calls("a3", "c3"),
        results("t2", "c3"),
    ]
    assert history_problems(conversation) == []
    check_history(conversation)  # does not raise
    assert history_problems([]) == []


def test_missing_result() -> None:
    conversation = [user("u"), calls("a", "c1", "c2"), results("t", "c1")]
    assert history_problems(conversation) == ["tool call 'c2' has no result"]
    with pytest.raises(HistoryError, match="'c2' has no result") as excinfo:
        check_history(conversation, session_id="sess-9")
    assert "sess-9" in str(excinfo.value)
    assert "valid history" in str(excinfo.value)


def test_duplicate_call_ids() -> None:
    conversation = [calls("a1", "c1"), results("t1", "c1"), calls("a2", "c1"), results("t2", "c1")]
    problems = history_problems(conversation)
    assert any("'c1' repeats at message 2" in p for p in problems)
    with pytest.raises(HistoryError, match="repeats"):
        check_history(conversation)


def test_duplicate_call_ids_within_one_message() -> None:
    problems = history_problems([calls("a", "c1", "c1"), results("t", "c1")])
    assert any("repeats at message 0" in p for p in problems)


def test_orphan_result() -> None:
    conversation = [user("u"), results("t", "ghost")]
    assert history_problems(conversation) == [
        "tool result for 'ghost' at message 1 follows no call"
    ]
    with pytest.raises(HistoryError, match="ghost"):
        check_history(conversation)


def test_result_before_its_call_is_a_problem() -> None:
    conversation = [user("u"), results("t", "c1"), calls("a", "c1")]
    problems = history_problems(conversation)
    assert any("'c1' at message 1 follows no call" in p for p in problems)


def test_second_result() -> None:
    conversation = [calls("a", "c1"), results("t1", "c1"), results("t2", "c1")]
    assert history_problems(conversation) == ["tool call 'c1' has a second result at message 2"]


def test_second_result_in_the_same_message() -> None:
    problems = history_problems([calls("a", "c1"), results("t", "c1", "c1")])
    assert problems == ["tool call 'c1' has a second result at message 1"]


@pytest.mark.parametrize("role", ["user", "tool", "system"])
def test_tool_call_in_non_assistant_message(role: str) -> None:
    conversation = [calls("x", "c1", role=role), results("t", "c1")]
    problems = history_problems(conversation)
    assert len(problems) == 1
    assert f"role {role!r}" in problems[0]
    assert "'c1'" in problems[0]


def test_hidden_messages_are_ignored() -> None:
    # a hidden call without a result, a hidden orphan, hidden duplicates: none count
    conversation = [
        user("u"),
        hidden(calls("a0", "c1")),
        hidden(results("t0", "ghost")),
        calls("a1", "c1"),
        results("t1", "c1"),
        hidden(results("t2", "c1")),
        hidden(calls("x", "c9", role="user")),
    ]
    assert history_problems(conversation) == []


def test_hiding_a_result_exposes_the_missing_result() -> None:
    conversation = [user("u"), calls("a", "c1"), hidden(results("t", "c1"))]
    assert history_problems(conversation) == ["tool call 'c1' has no result"]


def test_hiding_a_call_makes_its_result_an_orphan() -> None:
    conversation = [user("u"), hidden(calls("a", "c1")), results("t", "c1")]
    assert history_problems(conversation) == ["tool result for 'c1' at message 2 follows no call"]


def test_every_problem_is_listed() -> None:
    conversation = [
        calls("u", "c0", role="user"),
        calls("a", "c1", "c2"),
        results("t", "c1", "c1", "zz"),
    ]
    problems = history_problems(conversation)
    assert len(problems) == 5  # call in user message, second result, orphan, c0 and c2 unanswered
    with pytest.raises(HistoryError) as excinfo:
        check_history(conversation)
    for problem in problems:
        assert problem in str(excinfo.value)


# -- hypothesis: valid interleavings -------------------------------------------------------------


@st.composite
def valid_histories(draw: st.DrawFn) -> list[Message]:
    """Rounds of: user text, assistant calls, results in tool messages (any order, grouped)."""
    conversation: list[Message] = []
    counter = 0
    for round_number in range(draw(st.integers(1, 4))):
        conversation.append(user(f"u{round_number}"))
        for turn in range(draw(st.integers(0, 3))):
            n_calls = draw(st.integers(0, 3))
            call_ids = [f"c{counter + i}" for i in range(n_calls)]
            counter += n_calls
            text = (TextPart("thinking"),) if draw(st.booleans()) else ()
            conversation.append(
                Message(
                    id=f"a{round_number}-{turn}",
                    role="assistant",
                    parts=(*text, *(ToolCallPart.of(c, "tool", {}) for c in call_ids)),
                )
            )
            if draw(st.booleans()):
                conversation.append(hidden(Message.system("note", id=f"h{round_number}-{turn}")))
            order = draw(st.permutations(call_ids))
            # split the answers into consecutive tool messages
            groups: list[list[str]] = []
            for call_id in order:
                if not groups or draw(st.booleans()):
                    groups.append([])
                groups[-1].append(call_id)
            for index, group in enumerate(groups):
                conversation.append(results(f"t{round_number}-{turn}-{index}", *group))
    return conversation


HISTORY = settings(max_examples=80, deadline=None)


@HISTORY
@given(valid_histories())
def test_valid_interleavings_have_no_problems(conversation: list[Message]) -> None:
    assert history_problems(conversation) == []
    assert open_tool_calls(conversation) == []
    check_history(conversation)


@HISTORY
@given(valid_histories(), st.data())
def test_removing_any_one_result_makes_a_problem(
    conversation: list[Message], data: st.DataObject
) -> None:
    positions = [
        (m_index, p_index)
        for m_index, message in enumerate(conversation)
        for p_index, part in enumerate(message.parts)
        if isinstance(part, ToolResultPart)
    ]
    if not positions:
        return
    m_index, p_index = data.draw(st.sampled_from(positions))
    message = conversation[m_index]
    removed = message.parts[p_index]
    assert isinstance(removed, ToolResultPart)
    broken = list(conversation)
    broken[m_index] = msgspec.structs.replace(
        message, parts=message.parts[:p_index] + message.parts[p_index + 1 :]
    )
    assert history_problems(broken) == [f"tool call {removed.call_id!r} has no result"]
    assert [c.call_id for c in open_tool_calls(broken)] == [removed.call_id]
    with pytest.raises(HistoryError):
        check_history(broken)


def test_request_order_puts_results_right_after_their_calls() -> None:
    history = [
        user("u1"),
        calls("a1", "c1", "c2"),
        results("t1", "c1"),
        user("u2", "by the way, hurry"),
        results("t2", "c2"),
    ]
    ordered = request_order(history)
    assert [m.id for m in ordered] == ["u1", "a1", "t1", "t2", "u2"]
    assert history_problems(ordered) == []
    # Nothing to move: the same order back.
    assert request_order(ordered) == ordered


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_request_order_is_a_permutation_with_results_adjacent(data: st.DataObject) -> None:
    turns = data.draw(st.integers(min_value=1, max_value=5))
    history: list[Message] = []
    pending: list[str] = []
    for turn in range(turns):
        history.append(user(f"u{turn}"))
        ids = [f"c{turn}-{i}" for i in range(data.draw(st.integers(0, 3)))]
        if ids:
            history.append(calls(f"a{turn}", *ids))
        pending = ids
        while pending:
            # Results arrive one by one, with user messages interleaved at random.
            if data.draw(st.booleans()):
                history.append(user(f"x{len(history)}", "meanwhile"))
            call_id = pending.pop(data.draw(st.integers(0, len(pending) - 1)))
            history.append(results(f"t{call_id}", call_id))
    ordered = request_order(history)
    assert sorted(m.id for m in ordered) == sorted(m.id for m in history)
    non_tool = [m.id for m in history if m.role != "tool"]
    assert [m.id for m in ordered if m.role != "tool"] == non_tool
    for index, message in enumerate(ordered):
        if message.role == "tool":
            before = ordered[index - 1]
            assert before.role == "tool" or before.tool_calls
    assert history_problems(ordered) == []
