"""Compaction: what it keeps, hides and records; mid-loop and reactive runs; tool-pair integrity."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import pytest
from _scans import context as scan_context
from _scans import counted, tool_loop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import (
    Annotate,
    CancelToken,
    ConfigurationError,
    ContextLengthError,
    Message,
    ModelError,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Operation,
    PromptPart,
    Refuse,
    ReplaceConversation,
    Runtime,
    StateMachine,
    TextPart,
    ToolCallPart,
    ToolDefinition,
    ToolResultPart,
    Tools,
    Usage,
    tool,
)
from stepmachine.extend import (
    CONTEXT_LENGTH_EXCEEDED,
    InferenceAttempts,
    YieldReason,
    counter_ids,
    history_problems,
    latest_ledger,
    needs_answer,
    note_value,
    read_record,
)
from stepmachine.operations._budget import (
    Budget,
    BudgetExhaustedError,
    Limits,
    budget_usage,
)
from stepmachine.operations._compaction import (
    COMPACTION_STUCK,
    SUMMARY_PREFIX,
    Compaction,
    CompactionMark,
    estimate_tokens,
    render_transcript,
)
from stepmachine.operations._history_guard import HistoryGuard, fsck
from stepmachine.stores import MemoryStore, SQLiteStore
from stepmachine.testing import FunctionModel, ScriptedModel, call, make_session, reply, run_step

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


# -- building conversations ---------------------------------------------------------


def tc(call_id: str, n: int = 1) -> ToolCallPart:
    return ToolCallPart.of(call_id, "read", {"n": n})


def asst(message_id: str, *calls: ToolCallPart, text: str = "") -> Message:
    parts: tuple[Any, ...] = ((TextPart(text),) if text else ()) + calls
    return Message(id=message_id, role="assistant", parts=parts)


def res(message_id: str, call_id: str, content: str = "a result of some length") -> Message:
    return Message(
        id=message_id, role="tool", parts=(ToolResultPart(call_id, content, name="read"),)
    )


def user(message_id: str, text: str = "please do the next thing") -> Message:
    return Message.user(text, id=message_id)


def loop(rounds: int, *, prefix: str = "") -> list[Message]:
    """``rounds`` assistant-call / tool-result pairs."""
    messages: list[Message] = []
    for n in range(rounds):
        messages += [
            asst(f"{prefix}a{n}", tc(f"{prefix}c{n}", n)),
            res(f"{prefix}r{n}", f"{prefix}c{n}"),
        ]
    return messages


def visible(session: Any) -> list[Message]:
    return [m for m in session.conversation if m.visible_to_model]


def summaries(session: Any) -> list[Message]:
    return [
        m for m in session.conversation if m.notes.get("compaction", {}).get("kind") == "summary"
    ]


def assert_pairs_intact(session: Any) -> None:
    shown = visible(session)
    assert history_problems(shown) == []
    calls = {c.call_id for m in shown for c in m.tool_calls}
    results = {r.call_id for m in shown for r in m.tool_results}
    assert calls == results


async def compact(
    messages: list[Message], *, summary: str = "short", ids: str = "id", **options: Any
) -> Any:
    model = ScriptedModel([summary], name="summariser")
    runtime = Runtime(model=model, ids=counter_ids(ids))
    check = await run_step(Compaction(**options), make_session(*messages), runtime=runtime)
    return check, model


# -- single step --------------------------------------------------------------------


def test_estimate_tokens_counts_text_arguments_and_results() -> None:
    assert estimate_tokens([]) == 0
    assert estimate_tokens([Message.user("x" * 40, id="u")]) == 4 + 10
    call_message = asst("a", ToolCallPart.of("c", "abcd", {"k": "v" * 20}))
    assert estimate_tokens([call_message]) == 4 + (4 + len('{"k":"' + "v" * 20 + '"}') + 3) // 4
    assert estimate_tokens([res("r", "c", "y" * 8)]) == 4 + 2


def test_options_are_checked() -> None:
    with pytest.raises(ConfigurationError):
        Compaction(threshold=10, keep_turns=0)
    with pytest.raises(ConfigurationError):
        Compaction(threshold=10, keep_rounds=0)
    with pytest.raises(ConfigurationError):
        Compaction(threshold=10, on_stuck="panic")  # type: ignore[arg-type]


async def test_under_the_threshold_it_refuses() -> None:
    check, model = await compact([user("u1"), *loop(2)], threshold=10_000)
    assert check.refused
    assert model.requests == []


async def test_it_refuses_unless_the_model_is_about_to_be_asked() -> None:
    done = [user("u1"), *loop(5), asst("end", text="finished")]
    check, _ = await compact(done, threshold=1)
    assert check.refused
    open_call = [user("u1"), *loop(5), asst("a9", tc("c9"))]
    check, _ = await compact(open_call, threshold=1)
    assert check.refused


async def test_it_refuses_a_broken_history() -> None:
    broken = [user("u1"), *loop(5), res("stray", "ghost"), user("u2")]
    check, model = await compact(broken, threshold=1)
    assert check.refused
    assert "HistoryGuard" in check.outcome.why
    assert model.requests == []


async def test_old_turns_are_summarised_and_the_last_turns_kept() -> None:
    system = Message.system("be helpful", id="sys")
    messages = [
        system,
        user("u1"),
        *loop(2, prefix="x"),
        user("u2"),
        *loop(1, prefix="y"),
        user("u3"),
    ]
    check, model = await compact(messages, threshold=20, summary="the user asked twice")
    assert check.continued
    ((effect, ledger),) = check.commits  # the summariser call is recorded as it lands
    assert isinstance(effect, ReplaceConversation)
    # The summariser's call goes into the running totals, on the last message.
    assert isinstance(ledger, Annotate)
    assert ledger.message_id == messages[-1].id
    mark = msgspec.convert(ledger.values, CompactionMark)
    assert mark.ledger is not None
    assert mark.ledger.session.model_calls == 1
    after = check.session
    # nothing deleted, order kept, summary inserted right before the kept turn
    assert [m.id for m in after.conversation] == [m.id for m in messages[:-1]] + ["id1", "u3"]
    assert [m.id for m in visible(after)] == ["sys", "id1", "u3"]
    (summary,) = summaries(after)
    assert summary.role == "user"
    assert summary.text == f"{SUMMARY_PREFIX}\nthe user asked twice"
    assert not summary.visible_to_user
    receipt = summary.notes["compaction"]
    summarised = ["u1", "xa0", "xr0", "xa1", "xr1", "u2", "ya0", "yr0"]
    assert receipt["summarised"] == summarised
    assert receipt["tokens_before"] == estimate_tokens(messages)
    assert receipt["tokens_after"] == estimate_tokens(visible(after))
    assert receipt["tokens_after"] < receipt["tokens_before"]
    assert receipt["model"] == "summariser"
    assert receipt["trigger"] == "threshold"
    assert receipt["cut"] == "turns"
    for message_id in summarised:
        hidden = after.message(message_id)
        assert hidden is not None
        assert not hidden.visible_to_model
        assert hidden.visible_to_user
        mark = read_record(hidden.notes, "compaction", CompactionMark)
        assert mark == CompactionMark(summarised_into="id1")
    # the summariser saw a transcript of exactly the summarised messages, no tools
    (request,) = model.requests
    assert request.tools == ()
    assert "[user] please do the next thing" in request.messages[0].text
    assert "[assistant calls read]" in request.messages[0].text
    assert "be helpful" not in request.messages[0].text
    assert needs_answer(after.conversation)


async def test_keep_turns_keeps_more_turns() -> None:
    messages = [user("u1"), *loop(3, prefix="x"), user("u2"), *loop(1, prefix="y"), user("u3")]
    check, _ = await compact(messages, threshold=20, keep_turns=2)
    assert [m.id for m in visible(check.session)] == ["id1", "u2", "ya0", "yr0", "u3"]


async def test_a_long_tool_loop_is_cut_between_rounds_keeping_the_request() -> None:
    messages = [user("u1", "do ten things"), *loop(10)]
    check, _ = await compact(messages, threshold=40, keep_rounds=2)
    assert check.continued
    after = check.session
    assert [m.id for m in visible(after)] == ["u1", "id1", "a8", "r8", "a9", "r9"]
    (summary,) = summaries(after)
    assert summary.notes["compaction"]["cut"] == "rounds"
    assert summary.notes["compaction"]["summarised"] == [m.id for m in loop(8)]
    assert_pairs_intact(after)


async def test_parallel_calls_with_separate_results_are_never_split() -> None:
    batch = [
        asst("p", tc("p1"), tc("p2"), tc("p3")),
        res("q1", "p1"),
        res("q2", "p2"),
        asst("mid", text="still waiting on p3? no:"),  # not a safe place: p3 is open
        res("q3", "p3"),
    ]
    messages = [user("u1"), *loop(3, prefix="x"), *batch, *loop(1, prefix="y")]
    check, _ = await compact(messages, threshold=20, keep_rounds=2)
    after = check.session
    assert_pairs_intact(after)
    # the "mid" assistant message is not a safe cut (p3 open), so the cut is at "p"
    assert [m.id for m in visible(after)][:3] == ["u1", "id1", "p"]


async def test_nothing_to_summarise_yields_stuck_without_a_model_call() -> None:
    messages = [user("u1", "x" * 400)]
    check, model = await compact(messages, threshold=10)
    assert check.yielded
    assert check.outcome.reason.kind == COMPACTION_STUCK
    assert check.outcome.reason.data["reason"] == "nothing_to_summarise"
    assert check.effects == ()
    assert model.requests == []


async def test_only_an_earlier_summary_before_the_cut_is_no_progress() -> None:
    first, _ = await compact([user("u1"), *loop(6)], threshold=30, keep_rounds=2)
    again, model = await compact(list(first.session.conversation), threshold=10, keep_rounds=2)
    assert again.yielded
    assert again.outcome.reason.data["reason"] == "nothing_to_summarise"
    assert model.requests == []


async def test_a_summary_that_is_not_smaller_is_recorded_and_not_retried() -> None:
    messages = [user("u1"), *loop(3)]
    check, model = await compact(messages, threshold=10, keep_rounds=2, summary="z" * 2000)
    assert check.yielded
    assert check.outcome.reason.data["reason"] == "not_smaller"
    ((note,),) = check.commits
    assert isinstance(note, Annotate)
    assert note.message_id == "r2"
    assert note.values["stuck"] == "not_smaller"
    assert len(model.requests) == 1
    # the next cycle decides from the note: no second summariser call
    again, model = await compact(list(check.session.conversation), threshold=10, keep_rounds=2)
    assert again.yielded
    assert again.outcome.reason.data["reason"] == "not_smaller"
    assert model.requests == []


async def test_an_empty_summary_is_stuck() -> None:
    check, _ = await compact([user("u1"), *loop(4)], threshold=10, summary="  ")
    assert check.yielded
    assert check.outcome.reason.data["reason"] == "empty_summary"


async def test_on_stuck_proceed_lets_inference_go_ahead() -> None:
    check, _ = await compact([user("u1", "x" * 400)], threshold=10, on_stuck="proceed")
    assert check.refused
    noted, _ = await compact(
        [user("u1"), *loop(3)], threshold=10, summary="z" * 2000, on_stuck="proceed"
    )
    assert noted.continued  # records the note, so the summariser is not asked again
    after, model = await compact(list(noted.session.conversation), threshold=10, on_stuck="proceed")
    assert after.refused
    assert model.requests == []


async def test_overflow_mark_triggers_compaction_and_is_reset() -> None:
    messages = [user("u1"), *loop(4)]
    flagged = msgspec.structs.replace(
        messages[-1], notes={"inference": {CONTEXT_LENGTH_EXCEEDED: True}}
    )
    messages[-1] = flagged
    check, _ = await compact(messages, threshold=10_000, keep_rounds=1)
    assert check.continued
    ((replace, ledger, reset),) = check.commits
    assert isinstance(replace, ReplaceConversation)
    assert isinstance(ledger, Annotate)
    assert ledger.namespace == "compaction"
    # The mark (here in the shape stored before records were typed) is reset as a record.
    assert reset == Annotate("r3", "inference", note_value(InferenceAttempts()))
    (summary,) = summaries(check.session)
    assert summary.notes["compaction"]["trigger"] == CONTEXT_LENGTH_EXCEEDED


async def test_overflow_that_cannot_be_compacted_yields_even_with_proceed() -> None:
    flagged = Message(
        id="u1",
        role="user",
        parts=(TextPart("huge"),),
        notes={"inference": {CONTEXT_LENGTH_EXCEEDED: True}},
    )
    check, _ = await compact([flagged], threshold=10_000, on_stuck="proceed")
    assert check.yielded
    assert check.outcome.reason.kind == COMPACTION_STUCK
    assert check.outcome.reason.data["trigger"] == CONTEXT_LENGTH_EXCEEDED


async def test_summaries_roll_up_into_the_next_summary() -> None:
    first, _ = await compact([user("u1"), *loop(6)], threshold=30, keep_rounds=2)
    more = [*first.session.conversation, *loop(4, prefix="n")]
    second, model = await compact(more, threshold=30, keep_rounds=2, summary="second", ids="second")
    assert second.continued
    old, new = summaries(second.session)
    assert not old.visible_to_model
    assert new.visible_to_model
    assert old.id in new.notes["compaction"]["summarised"]
    assert "[summary of what came before]\nshort" in model.requests[0].messages[0].text
    assert [m.id for m in visible(second.session)] == ["u1", new.id, "na2", "nr2", "na3", "nr3"]
    assert_pairs_intact(second.session)


def test_render_transcript_marks_errors_and_summaries() -> None:
    error = Message(
        id="e", role="tool", parts=(ToolResultPart("c", "boom", is_error=True, name="read"),)
    )
    text = render_transcript([error])
    assert text == "[result of read (error)] boom"


# -- property: tool pairs stay together ---------------------------------------------


@st.composite
def closed_conversations(draw: st.DrawFn) -> list[Message]:
    """Valid conversations with no open call that end on a user message or results."""
    messages: list[Message] = []
    if draw(st.booleans()):
        messages.append(Message.system("system prompt", id="sys"))
    counter = 0
    for turn in range(draw(st.integers(1, 4))):
        messages.append(user(f"u{turn}", "ask " * draw(st.integers(1, 30))))
        for _ in range(draw(st.integers(0, 6))):
            counter += 1
            n_calls = draw(st.integers(0, 3))
            calls = [tc(f"c{counter}-{k}") for k in range(n_calls)]
            words = draw(st.integers(0 if calls else 1, 5))  # never an empty assistant turn
            messages.append(asst(f"a{counter}", *calls, text="thinking " * words))
            if not calls:
                continue
            order = draw(st.permutations(calls))
            if draw(st.booleans()):  # all results in one message
                parts = tuple(ToolResultPart(c.call_id, "r" * 20, name="read") for c in order)
                messages.append(Message(id=f"t{counter}", role="tool", parts=parts))
            else:
                for k, c in enumerate(order):
                    messages.append(res(f"t{counter}-{k}", c.call_id, "r" * 20))
    if not needs_answer(messages):
        messages.append(user("last"))
    return messages


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    closed_conversations(),
    st.integers(5, 200),
    st.integers(1, 3),
    st.sampled_from([None, 1, 2, 3]),
)
async def test_tool_pairs_survive_compaction(
    messages: list[Message], threshold: int, keep_turns: int, keep_rounds: int | None
) -> None:
    check, _ = await compact(
        messages, threshold=threshold, keep_turns=keep_turns, keep_rounds=keep_rounds
    )
    after = check.session
    assert_pairs_intact(after)
    assert fsck(after) == []
    assert {m.id for m in messages} <= {m.id for m in after.conversation}  # nothing deleted
    shown = visible(after)
    assert all(m.visible_to_model for m in after.conversation if m.role == "system")
    assert shown[-1].id == messages[-1].id
    assert needs_answer(after.conversation)
    if check.continued:
        (summary,) = summaries(after)
        receipt = summary.notes["compaction"]
        assert receipt["tokens_after"] < receipt["tokens_before"]
        hidden = {m.id for m in after.conversation if not m.visible_to_model}
        assert set(receipt["summarised"]) == hidden


# -- whole runs ---------------------------------------------------------------------

READ = re.compile(r"item (\d+) = (\d+)")
TOTAL = re.compile(r"total (\d+) after item (\d+)")


@tool
def read(n: int) -> str:
    """Read one item."""
    return f"item {n} = {n * 3 % 7}"


def progress(text: str) -> tuple[int, int]:
    total, last = 0, 0
    for match in TOTAL.finditer(text):
        total, last = int(match[1]), int(match[2])
    for match in READ.finditer(text):
        if int(match[1]) > last:
            total, last = total + int(match[2]), int(match[1])
    return total, last


def transcript_of(request: ModelRequest) -> str:
    return "\n".join(
        " ".join(r.content for r in m.tool_results) if m.role == "tool" else m.text
        for m in request.messages
    )


def agent_answer(rounds: int) -> Callable[[ModelRequest], ModelResponse]:
    def answer(request: ModelRequest) -> ModelResponse:
        total, last = progress(transcript_of(request))
        if last < rounds:
            return call(("read", {"n": last + 1}))
        return reply(f"sum of {rounds} items: {total}")

    return answer


def summarise(request: ModelRequest) -> ModelResponse:
    total, last = progress(request.messages[-1].text)
    return reply(f"total {total} after item {last}")


def expected(rounds: int) -> str:
    return f"sum of {rounds} items: {sum(n * 3 % 7 for n in range(1, rounds + 1))}"


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield MemoryStore()
    else:
        async with await SQLiteStore.open(tmp_path / "db.sqlite3") as opened:
            yield opened


def machine(threshold: int, cancel: CancelToken | None = None) -> StateMachine[Any]:
    return StateMachine(
        [
            Tools([read]),
            HistoryGuard(),
            Compaction(threshold=threshold, keep_rounds=2, model="summariser"),
            ModelInference(),
        ],
        cancel=cancel,
    )


async def test_long_tool_loop_compacts_mid_loop_and_completes(store: Any) -> None:
    await store.create("s", conversation=[user("u1", "read 20 items and sum them")])
    summariser = FunctionModel(summarise, name="summariser")
    runtime = Runtime(
        store=store,
        model=FunctionModel(agent_answer(20), name="agent"),
        models={"summariser": summariser},
    )
    report = await machine(threshold=80).run_report(runtime, "s")
    assert report.reason.kind == "done"
    final = report.session
    assert final.conversation[-1].text == expected(20)
    steps = [r.step for r in report.results]
    assert steps.count("compaction") >= 2
    # compaction happened between rounds, with more rounds after it
    first = steps.index("compaction")
    assert "tools" in steps[first:]
    assert summariser.calls == steps.count("compaction")
    assert_pairs_intact(final)
    assert fsck(final) == []
    # everything is still stored; only the model's view shrank
    assert len([m for m in final.conversation if m.role == "tool"]) == 20
    assert len(visible(final)) < 12
    assert await store.load("s") == final


async def test_reactive_compaction_after_a_context_length_error(store: Any) -> None:
    await store.create("s", conversation=[user("u1", "read 8 items and sum them")])
    errors: list[int] = []
    answer = agent_answer(8)

    def limited(request: ModelRequest) -> ModelResponse:
        size = estimate_tokens(request.messages)
        if size > 90:
            errors.append(size)
            raise ContextLengthError(f"{size} tokens do not fit")
        return answer(request)

    runtime = Runtime(
        store=store,
        model=FunctionModel(limited, name="agent"),
        models={"summariser": FunctionModel(summarise, name="summariser")},
    )
    report = await machine(threshold=100_000).run_report(runtime, "s")  # never proactive
    assert report.reason.kind == "done"
    assert report.session.conversation[-1].text == expected(8)
    assert errors  # the provider did refuse
    found = summaries(report.session)
    assert len(found) == len(errors)
    assert all(s.notes["compaction"]["trigger"] == CONTEXT_LENGTH_EXCEEDED for s in found)
    assert_pairs_intact(report.session)


async def test_stuck_compaction_yields_instead_of_looping(store: Any) -> None:
    await store.create("s", conversation=[user("u1", "x" * 1000)])
    model = ScriptedModel([])
    runtime = Runtime(store=store, model=model, models={"summariser": ScriptedModel([])})
    report = await machine(threshold=50).run_report(runtime, "s")
    assert report.reason.kind == COMPACTION_STUCK
    assert report.results[-1].step == "compaction"
    assert model.requests == []


# -- property: cancellation in the middle of a compaction ---------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 32))  # a whole run has about 25 checkpoints
async def test_tool_pairs_survive_cancellation_mid_compaction(cancel_at: int) -> None:
    """Cancel at the n-th checkpoint of the models (summariser or agent); history stays valid."""
    store = MemoryStore()
    await store.create("s", conversation=[user("u1", "read 12 items and sum them")])
    token = CancelToken()
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        ticks += 1
        if ticks == cancel_at:
            token.cancel("test")
        await anyio.lowlevel.checkpoint()

    answer = agent_answer(12)

    async def agent(request: ModelRequest) -> ModelResponse:
        await tick()
        return answer(request)

    async def summariser(request: ModelRequest) -> ModelResponse:
        for _ in range(3):
            await tick()
        return summarise(request)

    runtime = Runtime(
        store=store,
        model=FunctionModel(agent, name="agent"),
        models={"summariser": FunctionModel(summariser, name="summariser")},
    )
    report = await machine(threshold=80, cancel=token).run_report(runtime, "s")
    assert report.reason.kind in ("cancelled", "done")
    stored = await store.load("s")
    assert_pairs_intact(stored)
    assert fsck(stored) == []
    # a fresh machine without the token finishes the job from the stored session
    final = await machine(threshold=80).run(runtime, "s")
    assert final.conversation[-1].text == expected(12)
    assert_pairs_intact(final)


# -- the example ----------------------------------------------------------------------


def test_example_compacts_mid_loop(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "compaction.py"), "--db", str(tmp_path / "c.sqlite3")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    out = done.stdout
    assert "compaction 1: summarised" in out
    total = sum(s * 7 % 11 for s in range(1, 31))
    assert f"done: All 30 sensors read; the readings sum to {total}." in out
    count = int(re.search(r"compactions=(\d+)", out)[1])  # type: ignore[index]
    assert count >= 3


# -- invariant 7: the summariser's calls are model calls like any other -------------


class Shaper(Operation[Any]):
    """A step that shapes every request: a native output schema, a tool, a prompt part."""

    name = "shaper"

    async def run(self, ctx: Any) -> Any:
        return Refuse("never applies")

    def shape_request(self, ctx: Any, request: ModelRequest) -> ModelRequest:
        return msgspec.structs.replace(
            request,
            output_schema={"type": "object"},
            tools=(ToolDefinition(name="final", description="", parameters={}),),
            prompt_parts=(*request.prompt_parts, PromptPart(source="shaper", text="shaped")),
        )


def spent(message_id: str, attempts: int) -> Message:
    """An assistant answer as ModelInference records it, ``attempts`` model calls."""
    note = {"attempts": attempts, "revision": 0, "usage": {}}
    return Message(
        id=message_id, role="assistant", parts=(TextPart("y" * 400),), notes={"inference": note}
    )


async def test_the_summariser_request_is_shaped_by_every_step() -> None:
    messages = [user("u0", "x" * 400), spent("a0", 1), user("u1", "next " + "z" * 400)]
    model = ScriptedModel(["short"], name="summariser")
    budget = Budget(per_session=Limits(model_calls=3, output_tokens=1000))
    check = await run_step(
        Compaction(threshold=50),
        make_session(*messages),
        runtime=Runtime(model=model, ids=counter_ids()),
        others=[budget, Shaper()],
    )
    assert check.continued
    (request,) = model.requests
    assert request.max_attempts == 2  # capped by the budget: 3 - 1 used
    assert request.settings.max_tokens == 1000
    assert [p.source for p in request.prompt_parts] == ["compaction", "shaper"]
    # what belongs to the conversation's own requests is not imposed on the summariser
    assert request.output_schema is None
    assert request.tools == ()
    assert [m.id for m in request.messages] == ["compaction-request"]


async def test_a_budget_with_no_call_left_stops_the_summariser_request() -> None:
    messages = [user("u0", "x" * 400), spent("a0", 2), user("u1", "next " + "z" * 400)]
    model = ScriptedModel(["short"], name="summariser")
    with pytest.raises(BudgetExhaustedError, match="place Budget before"):
        await run_step(
            Compaction(threshold=50),
            make_session(*messages),
            runtime=Runtime(model=model, ids=counter_ids()),
            others=[Budget(per_session=Limits(model_calls=2))],
        )
    assert model.requests == []


class Attempts:
    """Counts every attempt of every model; each request needs ``need`` attempts.

    Respects ``max_attempts``: with fewer allowed it gives up (``ModelError``)
    or, if ``lenient``, answers after the last allowed attempt.
    """

    def __init__(self, need: int, *, lenient: bool) -> None:
        self.need = need
        self.lenient = lenient
        self.made = 0
        self.requests: dict[str, list[ModelRequest]] = {}

    def model(self, name: str, answer: Callable[[ModelRequest], ModelResponse]) -> FunctionModel:
        def respond(request: ModelRequest) -> ModelResponse:
            self.requests.setdefault(name, []).append(request)
            allowed = request.max_attempts if request.max_attempts is not None else self.need
            attempts = min(self.need, allowed)
            self.made += attempts
            if attempts < self.need and not self.lenient:
                raise ModelError(f"gave up after {attempts} attempts")
            response = answer(request)
            return msgspec.structs.replace(response, usage=Usage(1, 1), attempts=attempts)

        return FunctionModel(respond, name=name)


@pytest.mark.parametrize("limit", range(1, 17))  # the summariser is first asked after 5 answers
@pytest.mark.parametrize("need", [1, 2])
@pytest.mark.parametrize("lenient", [True, False])
async def test_a_per_run_model_call_budget_counts_the_summariser_and_holds(
    limit: int, need: int, lenient: bool
) -> None:
    store = MemoryStore()
    await store.create("s", conversation=[user("u1", "read 20 items and sum them")])
    models = Attempts(need, lenient=lenient)
    runtime = Runtime(
        store=store,
        model=models.model("agent", agent_answer(20)),
        models={"summariser": models.model("summariser", summarise)},
        ids=counter_ids(),
    )
    steps = [
        Budget(per_run=Limits(model_calls=limit)),
        Tools([read]),
        HistoryGuard(),
        Compaction(threshold=80, keep_rounds=2, model="summariser"),
        ModelInference(),
    ]
    try:
        report = await StateMachine(steps).run_report(runtime, "s")
    except ModelError:
        assert not lenient  # a strict model gave up on its last allowed attempt
        assert models.made <= limit
        return
    # invariant 7: the summariser's attempts count, and the limit is never exceeded
    assert models.made <= limit
    assert models.made == limit  # 20 rounds need more calls than any limit here
    summariser = models.requests.get("summariser", [])
    assert all(r.max_attempts is not None for r in summariser)  # capped by what was left
    assert report.reason.kind == YieldReason.BUDGET_EXHAUSTED
    assert report.results[-1].step == "budget"  # it yielded before Compaction could ask
    assert budget_usage(report.session, "run").model_calls == limit
    # The running totals (summaries included) agree with counting the records one by one.
    assert not latest_ledger(report.session).legacy
    for scope in ("session", "turn", "run"):
        fast = budget_usage(report.session, scope, tool_calls=False)
        slow = budget_usage(report.session, scope)
        assert (fast.model_calls, fast.input_tokens) == (slow.model_calls, slow.input_tokens)
    if limit > 5 * need:
        assert summariser  # the summariser was asked within the budget


async def test_deciding_not_to_compact_reads_no_more_of_a_longer_history() -> None:
    """Below the threshold, ``run`` reads the index (validity, last message, the
    token estimate), not every message -- hidden ones in the history included."""
    reads = []
    for turns in (5, 200):
        old = msgspec.structs.replace(Message.user("old", id="old"), visible_to_model=False)
        session = make_session(old, *tool_loop(turns), "next question")
        session, conversation = counted(session)
        outcome = await Compaction(threshold=10**9).run(scan_context(session))
        assert isinstance(outcome, Refuse)
        reads.append(conversation.read)
        assert estimate_tokens(session.visible_to_model) == session.history.estimated_tokens
    assert reads[0] == reads[1] < 5
