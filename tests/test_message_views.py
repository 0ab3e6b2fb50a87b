"""``Message.tool_calls`` / ``tool_results``: the same parts as a filter, allocating nothing
in the usual cases (all parts of the kind, or none)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from stepmachine import Message, ReasoningPart, TextPart, ToolCallPart, ToolResultPart

part = st.one_of(
    st.builds(TextPart, st.text(max_size=3)),
    st.builds(ReasoningPart, st.text(max_size=3)),
    st.builds(ToolCallPart.of, st.text(max_size=3), st.text(max_size=3), st.just({})),
    st.builds(ToolResultPart, call_id=st.text(max_size=3), content=st.text(max_size=3)),
)


@given(parts=st.lists(part, max_size=5), role=st.sampled_from(["user", "assistant", "tool"]))
def test_views_are_the_parts_of_their_kind_in_order(parts: list[object], role: str) -> None:
    message = Message(id="m", role=role, parts=tuple(parts))  # type: ignore[arg-type]
    calls = tuple(p for p in parts if isinstance(p, ToolCallPart))
    results = tuple(p for p in parts if isinstance(p, ToolResultPart))
    assert message.tool_calls == calls
    assert message.tool_results == results
    assert type(message.tool_calls) is tuple
    assert type(message.tool_results) is tuple


def test_views_reuse_the_parts_tuple_when_every_part_is_of_their_kind() -> None:
    calls = Message.assistant(
        [ToolCallPart.of("c1", "t", {}), ToolCallPart.of("c2", "t", {})], id="a"
    )
    result = Message.tool_result(ToolResultPart(call_id="c1", content="x"), id="r")
    assert calls.tool_calls is calls.parts
    assert result.tool_results is result.parts
    assert calls.tool_results == ()
    assert Message.user("hi", id="u").tool_calls == ()
    assert calls.tool_calls is calls.tool_calls  # no tuple built per access
