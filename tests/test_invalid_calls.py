"""InvalidCalls: unknown names, invalid JSON, invalid arguments, duplicate ids; every policy."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import pytest
from _scans import context as scan_context
from _scans import counted, tool_loop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import (
    Message,
    ModelInference,
    Runtime,
    StateMachine,
    Store,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    Tools,
    tool,
)
from stepmachine.extend import Conversation, YieldReason, counter_ids, history_problems, read_record
from stepmachine.operations._budget import FEEDBACK, SUPERSEDES, Budget, Limits, budget_usage
from stepmachine.operations._invalid_calls import (
    INVALID_TOOL_CALL,
    InvalidCalls,
    InvalidCallsDecision,
    InvalidToolCallError,
    schema_errors,
)
from stepmachine.testing import ScriptedModel, call, make_session, run_step

ran: list[Any] = []


@tool(side_effects="pure")
def add(a: int, b: int) -> int:
    """Add two numbers."""
    ran.append(("add", a, b))
    return a + b


@tool(side_effects="pure")
def get_weather(city: str) -> str:
    """The weather."""
    ran.append(("get_weather", city))
    return "sunny"


TOOLS = Tools([add, get_weather])


@pytest.fixture(autouse=True)
def _reset() -> None:
    ran.clear()


def asking(*calls: ToolCallPart, message_id: str = "a1") -> Message:
    note = {"inference": {"attempts": 1, "revision": 0, "usage": {}}}
    return Message(id=message_id, role="assistant", parts=calls, notes=note)


def session_with(*calls: ToolCallPart) -> Any:
    return make_session(Message.user("hi", id="u1"), asking(*calls))


GOOD = ToolCallPart.of("c1", "add", {"a": 1, "b": 2})


async def check(op: InvalidCalls, *calls: ToolCallPart) -> Any:
    return await run_step(op, session_with(*calls), others=[TOOLS])


# -- detection ------------------------------------------------------------------------------


def test_schema_errors_cover_the_common_keywords() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
            "kind": {"enum": ["x", "y"]},
            "inner": {"$ref": "#/$defs/Inner"},
            "maybe": {"anyOf": [{"type": "null"}, {"type": "string"}]},
        },
        "required": ["a"],
        "additionalProperties": False,
        "$defs": {"Inner": {"type": "object", "properties": {"n": {"type": "number"}}}},
    }
    assert schema_errors({"a": 1, "tags": ["t"], "kind": "x", "inner": {"n": 1.5}}, schema) == []
    assert schema_errors({"a": 1, "maybe": None}, schema) == []
    assert schema_errors({}, schema) == ["$: missing required property 'a'"]
    assert schema_errors({"a": True}, schema) == ["$.a: expected integer, got bool"]
    assert schema_errors({"a": -1}, schema) == ["$.a: -1 violates minimum 0"]
    assert len(schema_errors({"a": 1, "x": 0}, schema)) == 1
    assert len(schema_errors({"a": 1, "tags": [1, "b", "c"]}, schema)) == 2
    assert len(schema_errors({"a": 1, "inner": {"n": "no"}}, schema)) == 1
    assert len(schema_errors({"a": 1, "maybe": 3}, schema)) == 1
    assert len(schema_errors({"a": 1, "kind": "z"}, schema)) == 1


@pytest.mark.parametrize(
    ("bad", "case"),
    [
        (ToolCallPart.of("c2", "nope", {}), "unknown_tool"),
        (ToolCallPart.parse("c2", "add", "{not json"), "invalid_json"),
        (ToolCallPart.of("c2", "add", {"a": "one", "b": 2}), "invalid_arguments"),
        (ToolCallPart.of("c1", "add", {"a": 1, "b": 2}), "duplicate_id"),
    ],
)
async def test_each_case_is_found_and_the_stop_policy_yields_with_it(
    bad: ToolCallPart, case: str
) -> None:
    result = await check(InvalidCalls("stop"), GOOD, bad)
    assert result.yielded
    reason = result.outcome.reason
    assert reason.kind == INVALID_TOOL_CALL
    assert case in {p["case"] for p in reason.data["problems"]}
    assert result.session.conversation[1].notes["invalid_calls"]["action"] == "stop"


async def test_valid_calls_are_left_alone() -> None:
    assert (await check(InvalidCalls("fail"), GOOD)).refused
    assert (await run_step(InvalidCalls(), make_session("hi"))).refused


async def test_tool_objects_validate_exactly() -> None:
    # The JSON schema allows it only loosely? Both must agree on a wrong type.
    bad = ToolCallPart.of("c2", "add", {"a": 1})
    result = await check(InvalidCalls("stop", tools=[add]), bad)
    assert "invalid arguments for tool 'add'" in result.outcome.reason.data["problems"][0]["detail"]


async def test_check_call_objects_so_no_tool_runs_an_invalid_call() -> None:
    bad = ToolCallPart.of("c2", "add", {"a": "x", "b": 1})
    session = session_with(GOOD, bad)
    tools_run = await run_step(TOOLS, session, others=[InvalidCalls("skip")])
    assert ran == [("add", 1, 2)]
    assert [m.tool_results[0].call_id for m in tools_run.new_messages] == ["c1"]


# -- policies -------------------------------------------------------------------------------


async def test_fail_raises_a_stepmachine_error() -> None:
    with pytest.raises(InvalidToolCallError, match="unknown tool 'nope'") as info:
        await check(InvalidCalls("fail"), ToolCallPart.of("c2", "nope", {}))
    assert info.value.problems[0].case == "unknown_tool"


async def test_retry_hides_the_message_and_explains_to_the_model() -> None:
    result = await check(InvalidCalls("retry"), GOOD, ToolCallPart.parse("c2", "add", "{x"))
    assert result.continued
    hidden, feedback = result.session.conversation[1], result.session.conversation[2]
    assert not hidden.visible_to_model
    assert hidden.notes["invalid_calls"]["action"] == "retry"
    assert feedback.role == "user"
    assert feedback.visible_to_model
    assert not feedback.visible_to_user
    assert FEEDBACK in feedback.notes
    assert "not valid JSON" in feedback.text
    assert not history_problems(result.session.visible_to_model)


async def test_retry_becomes_stop_after_max_retries_in_a_turn() -> None:
    op = InvalidCalls("retry", max_retries=1)
    first = await check(op, ToolCallPart.of("c2", "nope", {}))
    again = (
        *first.session.conversation,
        asking(ToolCallPart.of("c3", "nope", {}), message_id="a2"),
    )
    second = await run_step(op, make_session(*again), others=[TOOLS])
    assert second.yielded
    assert second.outcome.reason.kind == INVALID_TOOL_CALL


async def test_skip_answers_every_call_of_the_turn() -> None:
    result = await check(InvalidCalls("skip"), GOOD, ToolCallPart.of("c2", "nope", {}))
    assert result.continued
    results = [r for m in result.new_messages for r in m.tool_results]
    assert [(r.call_id, r.is_error) for r in results] == [("c1", True), ("c2", True)]
    assert "another tool call" in results[0].content
    assert "unknown tool" in results[1].content
    assert not history_problems(result.session.conversation)


async def test_skip_with_duplicate_ids_gives_fresh_ids_first() -> None:
    dup = ToolCallPart.of("c1", "add", {"a": 3, "b": 4})
    result = await check(InvalidCalls("skip"), GOOD, dup)
    assert not history_problems(result.session.visible_to_model)
    copy = result.session.conversation[2]
    assert copy.notes[SUPERSEDES] == {"message_id": "a1"}
    assert all(r.is_error for m in result.new_messages for r in m.tool_results)


async def test_repair_renames_a_close_tool_name_and_revalidates() -> None:
    result = await check(
        InvalidCalls("repair"), ToolCallPart.of("c2", "GetWeather", {"city": "Oslo"})
    )
    assert result.continued
    original, copy = result.session.conversation[1], result.session.conversation[2]
    assert not original.visible_to_model
    assert not original.visible_to_user
    assert original.notes["invalid_calls"]["replaced_by"] == copy.id
    assert copy.tool_calls[0].name == "get_weather"
    assert copy.notes[SUPERSEDES] == {"message_id": "a1"}
    assert copy.notes["invalid_calls"]["repairs"][0]["renamed"] == "GetWeather -> get_weather"
    # the copy does not count as a second model call
    assert budget_usage(result.session, "session").model_calls == 1
    tools_run = await run_step(
        TOOLS,
        result.session,
        others=[InvalidCalls("repair")],
        runtime=Runtime(ids=counter_ids("t")),
    )
    assert ran == [("get_weather", "Oslo")]
    assert not history_problems(tools_run.session.visible_to_model)


async def test_repair_cleans_fenced_json_and_duplicate_ids() -> None:
    fenced = ToolCallPart.parse("c2", "add", '```json\n{"a": 1, "b": 2,}\n```')
    result = await check(
        InvalidCalls("repair"), GOOD, fenced, ToolCallPart.of("c1", "add", {"a": 0, "b": 0})
    )
    copy = result.session.conversation[-1]
    assert [c.arguments for c in copy.tool_calls] == [
        {"a": 1, "b": 2},
        {"a": 1, "b": 2},
        {"a": 0, "b": 0},
    ]
    assert len({c.call_id for c in copy.tool_calls}) == 3
    problems = history_problems(result.session.visible_to_model)
    assert problems
    assert all(p.endswith("has no result") for p in problems)


async def test_an_unrepairable_problem_uses_the_fallback() -> None:
    result = await check(
        InvalidCalls("repair", repair_fallback="stop"),
        ToolCallPart.of("c2", "add", {"a": "x", "b": 1}),
    )
    assert result.yielded
    assert result.outcome.reason.kind == INVALID_TOOL_CALL
    result = await check(InvalidCalls("repair"), ToolCallPart.of("c2", "zzzzzz", {}))
    assert result.continued
    assert result.session.conversation[-1].role == "user"


async def test_policy_per_case_and_the_most_severe_wins() -> None:
    op = InvalidCalls({"unknown_tool": "skip", "invalid_json": "stop"})
    result = await check(op, ToolCallPart.of("c2", "nope", {}))
    assert result.continued
    result = await check(
        op, ToolCallPart.of("c2", "nope", {}), ToolCallPart.parse("c3", "add", "{")
    )
    assert result.yielded


# -- whole runs ------------------------------------------------------------------------------


async def test_retry_in_a_whole_run_counts_against_the_budget(store: Store) -> None:
    await store.create("s", conversation=[Message.user("add 1 and 2", id="u0")])
    model = ScriptedModel(
        [call(("addd_numbers", {"a": 1, "b": 2})), call(("add", {"a": 1, "b": 2})), "3"]
    )
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    machine = StateMachine(
        [Budget(per_turn=Limits(model_calls=3)), InvalidCalls("retry"), TOOLS, ModelInference()]
    )
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == YieldReason.DONE
    model.assert_all_used()
    assert ran == [("add", 1, 2)]
    assert budget_usage(report.session, "turn").model_calls == 3
    assert "unknown tool 'addd_numbers'" in model.requests[1].messages[-1].text
    assert all(not history_problems(r.messages) for r in model.requests)

    # a fourth model call in the turn is over budget
    await store.create("t", conversation=[Message.user("add", id="u0")])
    model = ScriptedModel([call(("nope", {}))] * 3)
    runtime = Runtime(store=store, model=model, ids=counter_ids("t"))
    machine = StateMachine(
        [
            Budget(per_turn=Limits(model_calls=3)),
            InvalidCalls("retry", max_retries=5),
            TOOLS,
            ModelInference(),
        ]
    )
    report = await machine.run_report(runtime, "t")
    assert report.reason.kind == YieldReason.BUDGET_EXHAUSTED
    assert len(model.requests) == 3


async def test_repair_in_a_whole_run(store: Store) -> None:
    await store.create("s", conversation=[Message.user("weather?", id="u0")])
    model = ScriptedModel([call(("get-weather", {"city": "Oslo"})), "sunny"])
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    machine = StateMachine([InvalidCalls("repair"), TOOLS, ModelInference()])
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == YieldReason.DONE
    assert ran == [("get_weather", "Oslo")]
    sent = model.requests[1].messages
    assert [p.name for m in sent for p in m.tool_calls] == ["get_weather"]
    assert isinstance(sent[-1].parts[0], ToolResultPart)


async def test_stop_in_a_whole_run_then_the_application_decides(store: Store) -> None:
    await store.create("s", conversation=[Message.user("go", id="u0")])
    model = ScriptedModel([call(ToolCallPart.parse("x1", "add", "{oops"))])
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    machine = StateMachine([InvalidCalls("stop"), TOOLS, ModelInference()])
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == INVALID_TOOL_CALL
    assert ran == []
    again = await machine.run_report(runtime, "s")  # a fresh run decides the same
    assert again.reason.kind == INVALID_TOOL_CALL
    assert again.session.revision == report.session.revision  # noted once
    assert isinstance(report.session.conversation[0].parts[0], TextPart)


# -- repairs compose (issue 8, item 14) --------------------------------------------------------


async def test_repair_fixes_a_near_miss_name_and_a_trailing_comma_together() -> None:
    damaged = ToolCallPart.parse("c2", "get_wether", '{"city": "Oslo",}')
    result = await check(InvalidCalls("repair", repair_fallback="stop"), damaged)
    assert result.continued
    copy = result.session.conversation[-1]
    assert copy.tool_calls == (ToolCallPart.of("c2", "get_weather", {"city": "Oslo"}),)
    assert copy.notes["invalid_calls"]["repairs"] == [
        {"call_id": "c2", "renamed": "get_wether -> get_weather"},
        {"call_id": "c2", "arguments": "cleaned invalid JSON"},
    ]
    assert not result.session.conversation[1].visible_to_model


async def test_a_call_with_two_problems_reports_both_and_the_stricter_policy_wins() -> None:
    damaged = ToolCallPart.parse("c2", "get_wether", '{"city": "Oslo",}')
    result = await check(InvalidCalls("stop"), damaged)
    assert {p["case"] for p in result.outcome.reason.data["problems"]} == {
        "unknown_tool",
        "invalid_json",
    }
    # the name may be repaired, but the JSON policy says stop: nothing is repaired
    op = InvalidCalls({"unknown_tool": "repair", "invalid_json": "stop"})
    result = await check(op, damaged)
    assert result.yielded
    assert result.outcome.reason.kind == INVALID_TOOL_CALL
    assert len(result.session.conversation) == 2


async def test_trailing_comma_repair_never_changes_string_values() -> None:
    damaged = ToolCallPart.parse("c2", "get_weather", '{"city": "a,}\\",]", }')
    result = await check(InvalidCalls("repair", repair_fallback="stop"), damaged)
    assert result.continued
    assert result.session.conversation[-1].tool_calls[0].arguments == {"city": 'a,}",]'}


async def test_repair_keeps_the_notes_bound_to_a_call() -> None:
    damaged = msgspec.structs.replace(
        ToolCallPart.parse("c2", "get_weather", '{"city": "Oslo",}'), notes={"mine": {"k": 1}}
    )
    result = await check(InvalidCalls("repair", repair_fallback="stop"), damaged)
    assert result.session.conversation[-1].tool_calls[0].notes == {"mine": {"k": 1}}


async def test_a_name_close_to_two_tools_is_not_repaired() -> None:
    @tool(side_effects="pure", name="get-weather")
    def other(city: str) -> str:
        """Another weather tool."""
        return "rain"

    session = session_with(ToolCallPart.of("c2", "GET_WEATHER", {"city": "Oslo"}))
    op = InvalidCalls("repair", repair_fallback="stop")
    result = await run_step(op, session, others=[Tools([get_weather, other])])
    assert result.yielded


# A property test: damage valid calls in the documented repairable ways and check that
# repair gives back exactly the original calls; add unrepairable damage and check that
# nothing is repaired.


@tool(side_effects="pure")
def send_email(to: str, subject: str, body: str = "") -> str:
    """Send an email."""
    return "sent"


@tool(side_effects="pure")
def search_documents(query: str, tags: list[str] | None = None, limit: int = 10) -> str:
    """Search."""
    return "found"


PROPERTY_TOOLS = [get_weather, add, send_email, search_documents]
_text = st.text(max_size=12)
_int = st.integers(-(2**53), 2**53)
_ARGUMENTS: dict[str, Any] = {
    "get_weather": st.fixed_dictionaries({"city": _text}),
    "add": st.fixed_dictionaries({"a": _int, "b": _int}),
    "send_email": st.fixed_dictionaries({"to": _text, "subject": _text}, optional={"body": _text}),
    "search_documents": st.fixed_dictionaries(
        {"query": _text},
        optional={"tags": st.lists(_text, max_size=3), "limit": _int},
    ),
}
# wrong in a way no repair may touch: a wrong type or a missing required argument
_WRONG: dict[str, list[dict[str, Any]]] = {
    "get_weather": [{"city": 5}, {}],
    "add": [{"a": "one", "b": 2}, {"a": 1}],
    "send_email": [{"to": ["x"], "subject": "s"}, {"subject": "s"}],
    "search_documents": [{"query": None}, {"tags": ["t"]}],
}


def _dump(value: Any, draw: Any, *, force_comma: bool = False) -> str:
    """JSON text of ``value`` with trailing commas (and whitespace) drawn at random."""
    if not isinstance(value, dict | list):
        return msgspec.json.encode(value, enc_hook=Conversation.enc_hook).decode()
    space = draw(st.sampled_from(["", " ", "\n  "]))
    items = (
        [f"{_dump(k, draw)}:{space}{_dump(v, draw)}" for k, v in value.items()]
        if isinstance(value, dict)
        else [_dump(v, draw) for v in value]
    )
    comma = "," + space if items and (force_comma or draw(st.booleans())) else ""
    opening, closing = ("{", "}") if isinstance(value, dict) else ("[", "]")
    return opening + ("," + space).join(items) + comma + space + closing


def _damaged_name(name: str, draw: Any) -> str:
    """A name that differs from ``name`` only in the ways repair is documented to undo."""
    kinds = draw(st.sets(st.sampled_from(["case", "separator", "typo"]), min_size=1))
    damaged = name
    if "separator" in kinds:
        separator = draw(st.sampled_from(["-", ".", " ", "", "__"]))
        damaged = damaged.replace("_", separator) if "_" in damaged else damaged + "_"
    if "typo" in kinds and len(name) >= 8:
        letters = [i for i, c in enumerate(damaged) if c.isalpha()]
        drop = draw(st.sampled_from(letters))
        damaged = damaged[:drop] + damaged[drop + 1 :]
    if "case" in kinds or damaged == name:
        damaged = damaged.upper() if draw(st.booleans()) else damaged.title()
    return damaged


UNREPAIRABLE = ("far_name", "truncated", "wrong_arguments")


@st.composite
def damaged_calls(
    draw: Any, unrepairable: bool
) -> tuple[list[ToolCallPart], list[ToolCallPart], set[str]]:
    """(valid calls, the damaged calls the model sent, the ids that were made duplicates).

    Damage: a near-miss name, trailing commas, a code fence, a repeated id; with
    ``unrepairable``, one call also gets damage no repair may undo.
    """
    count = draw(st.integers(1, 3))
    broken = draw(st.integers(0, count - 1)) if unrepairable else -1
    originals: list[ToolCallPart] = []
    sent: list[ToolCallPart] = []
    duplicated: set[str] = set()
    for index in range(count):
        name = draw(st.sampled_from(sorted(_ARGUMENTS)))
        arguments = draw(_ARGUMENTS[name])
        original = ToolCallPart.of(f"c{index}", name, arguments)
        originals.append(original)
        damages = draw(st.sets(st.sampled_from(["name", "comma", "fence", "id"])))
        call_id = original.call_id
        if "id" in damages and index > 0:
            call_id = "c0"
            duplicated.add("c0")
        sent_name = _damaged_name(name, draw) if "name" in damages else name
        sent_arguments: Any = arguments
        how = draw(st.sampled_from(UNREPAIRABLE)) if index == broken else None
        if how == "far_name":
            sent_name = draw(st.sampled_from(["zzz", "", "delete_all", "temperature"]))
        elif how == "wrong_arguments":
            sent_arguments = draw(st.sampled_from(_WRONG[name]))
        if "comma" in damages:
            raw = _dump(sent_arguments, draw, force_comma=True)
        else:
            raw = msgspec.json.encode(sent_arguments).decode()
        if how == "truncated":
            raw = raw.rstrip()[:-1]
        if "fence" in damages:
            fence = draw(
                st.sampled_from(["```json\nBODY\n```", "```BODY```", "  ```\nBODY\n```\n"])
            )
            raw = fence.replace("BODY", raw)
        sent.append(ToolCallPart.parse(call_id, sent_name, raw))
    return originals, sent, duplicated


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(damaged_calls(unrepairable=False), st.booleans())
async def test_repair_gives_back_exactly_the_valid_calls(
    case: tuple[list[ToolCallPart], list[ToolCallPart], set[str]], exact: bool
) -> None:
    originals, sent, duplicated = case
    op = InvalidCalls("repair", repair_fallback="stop", tools=PROPERTY_TOOLS if exact else ())
    result = await run_step(op, session_with(*sent), others=[Tools(PROPERTY_TOOLS)])
    if sent == originals:
        assert result.refused
        return
    assert result.continued, result.outcome
    copy = result.session.conversation[-1]
    assert copy.notes["invalid_calls"]["repaired_from"] == "a1"
    assert not result.session.conversation[1].visible_to_model
    repaired = copy.tool_calls
    assert len({c.call_id for c in repaired}) == len(repaired)
    for original, damaged, fixed in zip(originals, sent, repaired, strict=True):
        if damaged.call_id in duplicated:
            assert fixed.call_id.startswith(damaged.call_id + "_r")
            assert msgspec.structs.replace(fixed, call_id=original.call_id) == original
        else:
            assert fixed == original


@PROPERTY
@given(damaged_calls(unrepairable=True), st.booleans())
async def test_unrepairable_damage_is_never_repaired_into_something_else(
    case: tuple[list[ToolCallPart], list[ToolCallPart], set[str]], exact: bool
) -> None:
    _, sent, _ = case
    op = InvalidCalls("repair", repair_fallback="stop", tools=PROPERTY_TOOLS if exact else ())
    result = await run_step(op, session_with(*sent), others=[Tools(PROPERTY_TOOLS)])
    assert result.yielded, result.outcome
    assert result.outcome.reason.kind == INVALID_TOOL_CALL
    assert [m.id for m in result.session.conversation] == ["u1", "a1"]


# -- stored shapes and cost ------------------------------------------------------------------


async def test_decisions_stored_before_records_were_typed_count_as_retries() -> None:
    """A retry recorded as the plain dict earlier versions wrote still counts."""
    hidden = msgspec.structs.replace(
        asking(ToolCallPart.of("c2", "nope", {})),
        visible_to_model=False,
        notes={"invalid_calls": {"action": "retry", "problems": []}},
    )
    feedback = Message(
        id="f1", role="user", parts=(TextPart("again"),), notes={FEEDBACK: {"by": "x"}}
    )
    session = make_session(
        Message.user("hi", id="u1"),
        hidden,
        feedback,
        asking(ToolCallPart.of("c3", "nope", {}), message_id="a2"),
    )
    result = await run_step(InvalidCalls("retry", max_retries=1), session, others=[TOOLS])
    assert result.yielded
    stopped = result.session.message("a2")
    assert stopped is not None
    decision = read_record(stopped.notes, "invalid_calls", InvalidCallsDecision)
    assert decision is not None
    assert decision.action == "stop"


async def test_invalid_calls_read_no_more_of_a_longer_history() -> None:
    """With a valid open call, ``run`` and ``check_call`` read the latest messages only."""
    op = InvalidCalls("retry")
    reads = []
    for turns in (5, 200):
        duplicate = ToolCallPart.of("t0", "add", {"a": 1, "b": 2})  # repeats the first turn's id
        session = make_session(*tool_loop(turns), "add", asking(GOOD, duplicate, message_id="z"))
        last = len(session.conversation) - 1
        plain = op.problems(session.conversation, last, TOOLS.tools(session))
        session, conversation = counted(session)
        ctx = scan_context(session)
        ctx = dataclasses.replace(ctx, tools=tuple(TOOLS.tools(session)))
        assert op.check_call(ctx, GOOD) is None
        found = op.problems(session, last, ctx.tools)
        assert found == plain
        assert [p.case for p in found] == ["duplicate_id"]
        reads.append(conversation.read)
    assert reads[0] == reads[1] < 10
