"""HistoryGuard repairs (as recorded effects) and fsck (reports, never changes)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import (
    Annotate,
    AppendMessage,
    Message,
    ModelInference,
    ReasoningPart,
    ReplaceConversation,
    Runtime,
    SetVisibility,
    StateMachine,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    Tools,
    submit,
    tool,
)
from stepmachine.extend import (
    JOURNAL,
    Conversation,
    apply_batch,
    counter_ids,
    history_problems,
    open_tool_calls,
)
from stepmachine.operations import Approval, approve
from stepmachine.operations._history_guard import (
    CALL_OUTSIDE_ASSISTANT,
    DUPLICATE_CALL_ID,
    EMPTY_ASSISTANT,
    OPEN_CALL,
    ORPHAN_RESULT,
    ORPHANED_CALL,
    RESULT_BEFORE_CALL,
    SECOND_RESULT,
    HistoryGuard,
    Problem,
    _analyse,
    _nothing_to_repair,
    fsck,
)
from stepmachine.stores import MemoryStore, SQLiteStore
from stepmachine.testing import ScriptedModel, make_session, run_step
from stepmachine.testing import call as calling

RUNS: list[int] = []


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    RUNS.append(a + b)
    return a + b


def call(call_id: str, name: str = "add") -> ToolCallPart:
    return ToolCallPart.of(call_id, name, {"a": 1, "b": 2})


def asst(message_id: str, *calls: ToolCallPart, text: str = "") -> Message:
    parts: tuple[Any, ...] = ((TextPart(text),) if text else ()) + calls
    return Message(id=message_id, role="assistant", parts=parts)


def result(message_id: str, *call_ids: str, content: str = "3") -> Message:
    parts = tuple(ToolResultPart(call_id=c, content=content, name="add") for c in call_ids)
    return Message(id=message_id, role="tool", parts=parts)


def user(message_id: str, text: str = "next") -> Message:
    return Message.user(text, id=message_id)


def visible(session: Any) -> tuple[Message, ...]:
    return tuple(m for m in session.conversation if m.visible_to_model)


def kinds(problems: list[Problem]) -> list[str]:
    return [p.kind for p in problems]


async def guard(*messages: Message, others: Any = ()) -> Any:
    return await run_step(HistoryGuard(), make_session(*messages), others=others)


# -- single step: nothing to repair -------------------------------------------------


async def test_valid_history_is_refused() -> None:
    check = await guard(user("u"), asst("a", call("c1")), result("r", "c1"), user("u2"))
    assert check.refused
    assert fsck(check.session) == []


async def test_pending_call_is_left_to_tools() -> None:
    check = await guard(user("u"), asst("a", call("c1")), others=[Tools([add])])
    assert check.refused
    assert kinds(fsck(check.session)) == [OPEN_CALL]


async def test_empty_reply_that_ends_the_conversation_is_left_alone() -> None:
    check = await guard(user("u"), asst("a"))
    assert check.refused
    assert kinds(fsck(check.session)) == [EMPTY_ASSISTANT]


# -- single step: repairs -----------------------------------------------------------


async def test_orphaned_call_gets_an_error_result_right_after_it() -> None:
    check = await guard(
        user("u"),
        asst("a", call("c1"), call("c2")),
        result("r1", "c1"),
        user("u2"),
        asst("a2", text="moved on"),
    )
    assert check.continued
    (effect,) = check.effects
    assert isinstance(effect, ReplaceConversation)
    ids = [m.id for m in check.session.conversation]
    assert ids == ["u", "a", "r1", "id1", "u2", "a2"]
    inserted = check.session.conversation[3]
    (part,) = inserted.tool_results
    assert part.call_id == "c2"
    assert part.is_error
    assert part.content.startswith("orphaned:")
    assert "It was not run" in part.content
    assert inserted.notes["history_guard"]["repair"] == ORPHANED_CALL
    assert history_problems(visible(check.session)) == []
    # the other messages are untouched
    for before in check.before.conversation:
        assert check.session.message(before.id) == before


async def test_orphaned_call_with_an_intent_says_outcome_unknown() -> None:
    started = msgspec.structs.replace(call("c1"), notes={JOURNAL: {"intent": True}})
    check = await guard(user("u"), asst("a", started), asst("a2", text="moved on"))
    (part,) = check.session.conversation[2].tool_results
    assert "outcome is unknown" in part.content


async def test_guard_objects_to_running_an_orphaned_call() -> None:
    RUNS.clear()
    session = make_session(user("u"), asst("a", call("c1")), user("u2"), asst("a2", text="hm"))
    check = await run_step(Tools([add]), session, others=[HistoryGuard()])
    assert check.refused
    assert RUNS == []
    # a pending call (nothing after it) is not objected to
    pending = make_session(user("u"), asst("a", call("c1")))
    check = await run_step(Tools([add]), pending, others=[HistoryGuard()])
    assert not check.refused
    assert RUNS == [3]


async def test_a_user_message_after_a_pending_call_does_not_orphan_it() -> None:
    # A user typed while the call waited for approval, or after a crash mid-tool: the call
    # is still pending (requests show its late result right after it), not orphaned.
    RUNS.clear()
    session = make_session(user("u"), asst("a", call("c1")), user("u2", "and please hurry"))
    assert kinds(fsck(session)) == [OPEN_CALL]
    guard_step = HistoryGuard()
    check = await run_step(guard_step, session, others=[Tools([add])])
    assert check.refused
    assert guard_step.check_call(check.ctx, call("c1")) is None
    ran = await run_step(Tools([add]), session, others=[guard_step])
    assert not ran.refused
    assert RUNS == [3]
    # a system message in between does not orphan it either
    system = Message(id="s1", role="system", parts=(TextPart("be quick"),))
    assert kinds(fsck(make_session(user("u"), asst("a", call("c1")), system))) == [OPEN_CALL]


async def test_an_assistant_message_after_a_call_orphans_it_even_once_hidden() -> None:
    hidden_reply = msgspec.structs.replace(asst("a2", text="moved on"), visible_to_model=False)
    session = make_session(user("u"), asst("a", call("c1")), user("u2"), hidden_reply)
    assert kinds(fsck(session)) == [ORPHANED_CALL]
    check = await guard(*session.conversation, others=[Tools([add])])
    assert check.continued
    assert guard_objection(check, call("c1")) is not None
    ids = [m.id for m in check.session.conversation]
    assert ids == ["u", "a", "id1", "u2", "a2"]
    assert fsck(check.session) == []


def guard_objection(check: Any, part: ToolCallPart) -> str | None:
    return HistoryGuard().check_call(check.ctx, part)


async def test_unadvertised_call_without_a_tools_step_is_answered() -> None:
    check = await guard(user("u"), asst("a", call("c1", name="nowhere")))
    assert check.continued
    (effect,) = check.effects
    assert isinstance(effect, AppendMessage)
    (part,) = effect.message.tool_results
    assert "no step provides a tool named 'nowhere'" in part.content
    assert history_problems(visible(check.session)) == []


async def test_unadvertised_call_is_left_to_a_tools_step() -> None:
    check = await guard(user("u"), asst("a", call("c1", name="nowhere")), others=[Tools([add])])
    assert check.refused


async def test_orphan_result_is_hidden_not_deleted() -> None:
    check = await guard(user("u"), result("r", "ghost"), user("u2"))
    assert check.continued
    assert isinstance(check.effects[0], SetVisibility)
    assert isinstance(check.effects[1], Annotate)
    hidden = check.session.message("r")
    assert hidden is not None
    assert not hidden.visible_to_model
    assert hidden.visible_to_user
    assert hidden.notes["history_guard"]["repair"] == ORPHAN_RESULT
    assert fsck(check.session) == []


async def test_second_result_is_hidden() -> None:
    check = await guard(
        user("u"), asst("a", call("c1")), result("r1", "c1"), result("r2", "c1", content="4")
    )
    second = check.session.message("r2")
    assert second is not None
    assert not second.visible_to_model
    assert second.notes["history_guard"]["repair"] == SECOND_RESULT
    first = check.session.message("r1")
    assert first is not None
    assert first.visible_to_model


async def test_second_result_in_the_same_message_drops_the_later_part() -> None:
    both = Message(
        id="r",
        role="tool",
        parts=(
            ToolResultPart(call_id="c1", content="first"),
            ToolResultPart(call_id="c1", content="second"),
        ),
    )
    check = await guard(user("u"), asst("a", call("c1")), both)
    (copy,) = [m for m in visible(check.session) if m.role == "tool"]
    assert [p.content for p in copy.tool_results] == ["first"]
    assert copy.notes["history_guard"] == {"repair": "split", "copy_of": "r"}
    assert fsck(check.session) == []


async def test_mixed_tool_message_is_split() -> None:
    mixed = Message(
        id="r",
        role="tool",
        parts=(ToolResultPart(call_id="c1", content="3"), ToolResultPart("ghost", "?")),
    )
    check = await guard(user("u"), asst("a", call("c1")), mixed, user("u2"))
    assert [m.id for m in visible(check.session)] == ["u", "a", "id1", "u2"]
    copy = check.session.conversation[3]
    assert [p.call_id for p in copy.tool_results] == ["c1"]
    assert fsck(check.session) == []


async def test_result_before_its_call() -> None:
    check = await guard(user("u"), result("r", "c1"), asst("a", call("c1")), user("u2"))
    assert kinds(fsck(check.before)) == [RESULT_BEFORE_CALL, OPEN_CALL]
    early = check.session.message("r")
    assert early is not None
    assert not early.visible_to_model
    assert fsck(check.session) == []
    assert [m.role for m in visible(check.session)] == ["user", "assistant", "tool", "user"]


async def test_duplicate_call_id_hides_the_later_call_and_its_results() -> None:
    check = await guard(
        user("u"),
        asst("a1", call("x")),
        result("r1", "x"),
        asst("a2", call("x"), call("y")),
        result("r2", "x"),
        result("r3", "y"),
        user("u2"),
    )
    assert DUPLICATE_CALL_ID in kinds(fsck(check.before))
    assert [m.id for m in visible(check.session)] == ["u", "a1", "r1", "u2"]
    later = check.session.message("a2")
    assert later is not None
    assert later.notes["history_guard"]["repair"] == DUPLICATE_CALL_ID
    assert fsck(check.session) == []


async def test_empty_assistant_followed_by_more_is_hidden() -> None:
    empty = Message(id="e", role="assistant", parts=(TextPart("  "),))
    check = await guard(user("u"), empty, user("u2"))
    assert [m.id for m in visible(check.session)] == ["u", "u2"]
    hidden = check.session.message("e")
    assert hidden is not None
    assert hidden.notes["history_guard"]["repair"] == EMPTY_ASSISTANT


async def test_reasoning_only_assistant_is_not_empty() -> None:
    thinking = Message(id="t", role="assistant", parts=(ReasoningPart("hmm"),))
    check = await guard(user("u"), thinking, user("u2"))
    assert check.refused


async def test_tool_call_in_a_user_message_is_hidden() -> None:
    odd = Message(id="odd", role="user", parts=(call("c1"),))
    check = await guard(user("u"), odd, result("r", "c1"), user("u2"))
    assert CALL_OUTSIDE_ASSISTANT in kinds(fsck(check.before))
    assert [m.id for m in visible(check.session)] == ["u", "u2"]
    assert fsck(check.session) == []


async def test_fsck_changes_nothing() -> None:
    session = make_session(
        user("u"), asst("a", call("c1")), user("u2"), result("r", "ghost"), asst("e")
    )
    snapshot = msgspec.json.encode(session, enc_hook=Conversation.enc_hook)
    problems = fsck(session)
    assert msgspec.json.encode(session, enc_hook=Conversation.enc_hook) == snapshot
    assert kinds(problems) == [ORPHANED_CALL, ORPHAN_RESULT, EMPTY_ASSISTANT]
    assert [p.index for p in problems] == [1, 3, 4]
    assert problems[0].call_id == "c1"
    assert problems[0].message_id == "a"


# -- property: repairs always leave a valid history ---------------------------------


@st.composite
def messy_conversations(draw: st.DrawFn) -> tuple[Message, ...]:
    """Random mixes of users, assistants with calls (ids may repeat), results (may be stray)."""
    ids = st.sampled_from(["c1", "c2", "c3", "c4"])
    messages: list[Message] = []
    for n in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(["user", "assistant", "tool", "empty", "hidden"]))
        mid = f"m{n}"
        if kind == "user":
            messages.append(user(mid))
        elif kind == "assistant":
            calls = draw(st.lists(ids, max_size=3))
            messages.append(asst(mid, *(call(c) for c in calls), text="t"))
        elif kind == "tool":
            messages.append(result(mid, *draw(st.lists(ids, min_size=1, max_size=2))))
        elif kind == "empty":
            messages.append(asst(mid))
        else:
            message = asst(mid, call(draw(ids)))
            messages.append(msgspec.structs.replace(message, visible_to_model=False))
    return tuple(messages)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messy_conversations(), st.booleans())
async def test_guard_repairs_any_history(messages: tuple[Message, ...], with_tools: bool) -> None:
    session = make_session(*messages)
    before_problems = fsck(session)
    # fsck sees at least what the kernel's check sees
    assert bool(history_problems(visible(session))) <= bool(before_problems)
    others = [Tools([add])] if with_tools else []
    check = await run_step(HistoryGuard(), session, others=others)
    after = check.session
    # nothing is deleted
    assert {m.id for m in session.conversation} <= {m.id for m in after.conversation}
    left = fsck(after)
    last = visible(after)[-1].id if visible(after) else None
    for problem in left:
        assert problem.kind in (OPEN_CALL, EMPTY_ASSISTANT), problem
        if problem.kind == EMPTY_ASSISTANT:
            assert problem.message_id == last
    if not with_tools:
        assert not open_tool_calls(after.conversation)
    if with_tools:  # what is left open are pending calls Tools will answer
        problems = history_problems(visible(after))
        assert all(p.endswith("has no result") for p in problems)
    # a second pass has nothing left to do
    again = await run_step(HistoryGuard(), after, others=others)
    assert again.refused


# -- whole runs ---------------------------------------------------------------------


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield MemoryStore()
    else:
        async with await SQLiteStore.open(tmp_path / "db.sqlite3") as opened:
            yield opened


async def test_corrupted_history_is_repaired_and_the_run_completes(store: Any) -> None:
    RUNS.clear()
    await store.create("s", conversation=[user("u1", "add 1 and 2")])
    # An assistant asked for a tool, then (say, after a crash) the application added a
    # user message and a stray result, and an empty assistant turn was imported.
    await submit(store, "s", [AppendMessage(asst("a1", call("c1"), text="adding"))])
    await submit(store, "s", [AppendMessage(user("u2", "never mind, just say hi"))])
    await submit(store, "s", [AppendMessage(result("stray", "ghost"))])
    await submit(store, "s", [AppendMessage(asst("empty"))])
    await submit(store, "s", [AppendMessage(user("u3", "hi?"))])
    stored = await store.load("s")
    assert kinds(fsck(stored)) == [ORPHANED_CALL, ORPHAN_RESULT, EMPTY_ASSISTANT]
    assert await store.load("s") == stored  # fsck changed nothing

    model = ScriptedModel(["hi!"])
    machine = StateMachine([Tools([add]), HistoryGuard(), ModelInference()])
    runtime = Runtime(store=store, model=model, ids=counter_ids("m"))
    report = await machine.run_report(runtime, "s")

    assert report.reason.kind == "done"
    assert [r.step for r in report.results] == ["history_guard", "inference"]
    assert RUNS == []  # the orphaned call was never run
    model.assert_all_used()
    (request,) = model.requests
    assert history_problems(request.messages) == []
    assert [m.id for m in request.messages] == ["u1", "a1", "m1", "u2", "u3"]
    final = await store.load("s")
    assert fsck(final) == []
    batches = await store.batches("s")
    assert [b.step for b in batches][-2:] == ["history_guard", "inference"]


async def test_an_approved_call_runs_although_the_user_wrote_while_it_waited(store: Any) -> None:
    RUNS.clear()
    await store.create("s", conversation=[user("u1", "add 1 and 2")])
    model = ScriptedModel([calling(call("c1")), "3, as asked"])
    steps = [Approval({"add"}), Tools([add]), HistoryGuard(), ModelInference()]
    runtime = Runtime(store=store, model=model, ids=counter_ids("m"))
    report = await StateMachine(steps).run_report(runtime, "s")
    assert report.reason.kind == "awaiting_approval"
    # the user writes while the call waits; then the call is approved
    await submit(store, "s", [AppendMessage(user("u2", "and please hurry"))])
    await approve(store, "s", "c1", by="alice")
    report = await StateMachine(steps).run_report(runtime, "s")
    assert report.reason.kind == "done"
    assert RUNS == [3]  # it ran, rather than being answered "orphaned ... not run"
    results = [r for m in report.session.conversation for r in m.tool_results]
    assert [(r.call_id, r.is_error) for r in results] == [("c1", False)]
    assert fsck(report.session) == []
    model.assert_all_used()
    # the last request showed the late result right after its call
    assert [m.role for m in model.requests[-1].messages] == [
        "user",
        "assistant",
        "tool",
        "user",
    ]


@st.composite
def grown_sessions(draw: st.DrawFn) -> Any:
    """A messy conversation grown effect by effect (the index updated incrementally),
    sometimes with messages hidden afterwards."""
    session = make_session()
    for message in draw(messy_conversations()):
        session = apply_batch(session, [AppendMessage(message)])
    ids = [m.id for m in session.conversation]
    hide = draw(st.lists(st.sampled_from(ids), max_size=2))
    if hide:
        session = apply_batch(session, [SetVisibility(tuple(hide), to_model=False)])
    if draw(st.booleans()):
        session = apply_batch(session, [AppendMessage(asst("late", text="moved on"))])
    return session


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grown_sessions(), st.booleans(), st.booleans())
async def test_index_fast_paths_agree_with_the_full_analysis(
    session: Any, with_tools: bool, advertise: bool
) -> None:
    advertised = {"add"} if advertise else set()
    guard_step = HistoryGuard()
    others = [Tools([add])] if with_tools else []
    check = await run_step(guard_step, session, others=others)
    full = guard_step._one_round(check.ctx, session, advertised, with_tools)
    assert _nothing_to_repair(session, advertised, with_tools) == (full == [])
    assert fsck(session) == _analyse(session.conversation)
    check.ctx.session = session
    for message in session.conversation:
        for part in message.tool_calls:
            slow = any(
                p.kind == ORPHANED_CALL and p.call_id == part.call_id
                for p in _analyse(session.conversation)
            )
            assert (guard_step.check_call(check.ctx, part) is not None) == slow
