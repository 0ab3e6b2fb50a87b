"""Budget: exact model-call budgets (invariant 7), tokens, tool calls, scopes."""

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
    Annotate,
    AppendMessage,
    Message,
    ModelError,
    ModelInference,
    ModelRequest,
    ModelResponse,
    ModelSettings,
    Operation,
    Outcome,
    Refuse,
    Runtime,
    SetVisibility,
    StateMachine,
    StepContext,
    Store,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    Tools,
    Usage,
    submit,
    tool,
)
from stepmachine.extend import ChunkSink, YieldReason, counter_ids, history_problems, latest_ledger
from stepmachine.operations._budget import (
    FEEDBACK,
    SUPERSEDES,
    Budget,
    BudgetExhaustedError,
    Limits,
    budget_usage,
)
from stepmachine.stores import MemoryStore
from stepmachine.testing import FunctionModel, ScriptedModel, call, make_session, reply, run_step


def answered(
    message_id: str,
    *,
    revision: int = 0,
    attempts: int = 1,
    tokens: tuple[int, int] = (10, 5),
    calls: tuple[ToolCallPart, ...] = (),
) -> Message:
    """An assistant message as ModelInference records it."""
    note = {
        "usage": {"input_tokens": tokens[0], "output_tokens": tokens[1]},
        "attempts": attempts,
        "revision": revision,
    }
    parts: tuple[Any, ...] = calls or (TextPart("ok"),)
    return Message(id=message_id, role="assistant", parts=parts, notes={"inference": note})


def result(call_id: str, message_id: str) -> Message:
    return Message(
        id=message_id, role="tool", parts=(ToolResultPart(call_id=call_id, content="done"),)
    )


def user(text: str, message_id: str) -> Message:
    return Message.user(text, id=message_id)


@tool(side_effects="pure")
def ping() -> str:
    """Ping."""
    return "pong"


# -- single step ----------------------------------------------------------------------


async def test_refuses_within_budget_and_yields_when_the_run_has_used_its_calls() -> None:
    budget = Budget(per_run=Limits(model_calls=2))
    within = make_session(user("hi", "u1"), answered("a1", revision=1), user("more", "u2"))
    check = await run_step(budget, within)
    assert check.refused
    spent = make_session(
        user("hi", "u1"), answered("a1", revision=1, attempts=2), user("more", "u2")
    )
    check = await run_step(budget, spent)
    assert check.yielded
    # The refusal is recorded on the last message the model sees (an inspector reads
    # it), once: a session that already carries it yields without writing.
    (mark,) = check.effects
    assert isinstance(mark, Annotate)
    assert (mark.message_id, mark.namespace) == ("u2", "budget")
    assert mark.values["exhausted"]["refused"] == "model_calls budget per run exhausted (2 of 2)"
    marked = mark.apply(spent)
    again = await run_step(budget, marked)
    assert again.yielded
    assert not again.effects
    assert check.outcome.reason.kind == YieldReason.BUDGET_EXHAUSTED  # type: ignore[union-attr]
    assert check.outcome.reason.data == {  # type: ignore[union-attr]
        "scope": "run",
        "limit": "model_calls",
        "allowed": 2,
        "used": 2,
    }


async def test_messages_of_earlier_runs_do_not_count_per_run() -> None:
    session = make_session(
        user("hi", "u1"), answered("a1", revision=1, attempts=5), user("more", "u2"), revision=3
    )
    usage = budget_usage(session, "run", run_start_revision=3)
    assert usage.model_calls == 0
    assert budget_usage(session, "session").model_calls == 5


async def test_per_turn_counts_since_the_last_user_message_but_not_feedback() -> None:
    feedback = Message(
        id="f1", role="user", parts=(TextPart("try again"),), notes={FEEDBACK: {"by": "x"}}
    )
    hidden = msg_hidden(answered("a2", attempts=2))
    session = make_session(
        user("hi", "u1"), answered("a1", attempts=3), user("next", "u2"), hidden, feedback
    )
    assert budget_usage(session, "turn").model_calls == 2  # hidden retries still count
    check = await run_step(Budget(per_turn=Limits(model_calls=2)), session)
    assert check.yielded
    assert check.outcome.reason.data["scope"] == "turn"  # type: ignore[union-attr]


def msg_hidden(message: Message) -> Message:
    return msgspec.structs.replace(message, visible_to_model=False)


async def test_copies_marked_supersedes_are_not_counted_twice() -> None:
    original = msg_hidden(answered("a1", attempts=2))
    copy = answered("a2", attempts=2)

    copy = msgspec.structs.replace(copy, notes={**copy.notes, SUPERSEDES: {"message_id": "a1"}})
    session = make_session(user("hi", "u1"), original, copy)
    assert budget_usage(session, "session").model_calls == 2


async def test_token_limits() -> None:
    session = make_session(user("hi", "u1"), answered("a1", tokens=(100, 40)), user("x", "u2"))
    assert (await run_step(Budget(per_session=Limits(total_tokens=141)), session)).refused
    check = await run_step(Budget(per_session=Limits(output_tokens=40)), session)
    assert check.yielded
    assert check.outcome.reason.data["limit"] == "output_tokens"  # type: ignore[union-attr]


async def test_shape_request_caps_attempts_and_tokens_and_offers_what_is_left() -> None:
    budget = Budget(
        per_run=Limits(model_calls=5, output_tokens=100),
        per_session=Limits(model_calls=4),
        offer_remaining=True,
    )
    session = make_session(user("hi", "u1"), answered("a1", tokens=(1, 30)), user("x", "u2"))
    check = await run_step(budget, session)
    assert check.refused
    request = budget.shape_request(check.ctx, ModelRequest(messages=session.conversation))
    assert request.max_attempts == 3  # min(5 - 1, 4 - 1)
    assert request.settings.max_tokens == 70
    assert request.prompt_parts[-1].source == "budget"
    assert "3 model calls" in request.prompt_parts[-1].text


async def test_tool_calls_over_the_limit_are_objected_to_then_refused() -> None:
    calls = tuple(ToolCallPart.of(f"c{i}", "ping", {}) for i in range(3))
    session = make_session(user("hi", "u1"), answered("a1", calls=calls))
    budget = Budget(per_turn=Limits(tool_calls=2))
    tools = Tools([ping])
    check = await run_step(budget, session, others=[tools])
    assert check.refused  # c0, c1 may still run
    assert [budget.check_call(check.ctx, c) is None for c in calls] == [True, True, False]
    ran = await run_step(tools, session, others=[budget])
    assert sorted(m.tool_results[0].call_id for m in ran.new_messages) == ["c0", "c1"]
    runtime = Runtime(ids=counter_ids("b"))
    check = await run_step(budget, ran.session, others=[tools], runtime=runtime)
    assert check.yielded
    assert check.outcome.reason.kind == YieldReason.BUDGET_EXHAUSTED  # type: ignore[union-attr]
    refused = check.new_messages[0].tool_results[0]
    assert refused.call_id == "c2"
    assert refused.is_error
    assert not history_problems(check.session.conversation)
    assert check.session.conversation[1].tool_calls[2].notes["budget"]["refused"]


def hidden_result(call_id: str, message_id: str, **notes: Any) -> Message:
    return msgspec.structs.replace(result(call_id, message_id), visible_to_model=False, notes=notes)


async def test_hiding_answered_calls_does_not_give_the_tool_call_budget_back() -> None:
    # What a compaction leaves: the first round hidden (never deleted), a summary, a new turn.
    summary = msgspec.structs.replace(
        Message.user("[summary] pinged once", id="sum"), visible_to_user=False
    )
    first = msg_hidden(answered("a1", calls=(ToolCallPart.of("c1", "ping", {}),)))
    asked = answered("a2", calls=(ToolCallPart.of("c2", "ping", {}),))
    session = make_session(
        user("go", "u1"), first, hidden_result("c1", "r1"), summary, user("again", "u2"), asked
    )
    usage = budget_usage(session, "session")
    assert usage.tool_calls == ("c1", "c2")
    assert usage.tool_call_positions == (("a1", "c1"), ("a2", "c2"))
    budget = Budget(per_session=Limits(tool_calls=1))
    check = await run_step(budget, session, others=[Tools([ping])])
    assert budget.check_call(check.ctx, asked.tool_calls[0]) is not None
    assert check.yielded
    assert check.outcome.reason.kind == YieldReason.BUDGET_EXHAUSTED  # type: ignore[union-attr]
    assert [r.call_id for m in check.new_messages for r in m.tool_results] == ["c2"]


async def test_hidden_calls_that_never_ran_or_were_refused_do_not_count() -> None:
    c1 = ToolCallPart.of("c1", "ping", {})
    # A reply InvalidCalls "retry" hid: its calls never ran (no result anywhere).
    retried = msg_hidden(answered("a1", calls=(c1,)))
    retried = msgspec.structs.replace(
        retried, notes={**retried.notes, "invalid_calls": {"action": "retry", "problems": []}}
    )
    feedback = Message(
        id="f1", role="user", parts=(TextPart("try again"),), notes={FEEDBACK: {"by": "x"}}
    )
    # The model reuses the id in its next reply; that call ran: it counts, once.
    again = answered("a2", calls=(c1,))
    # A call this budget refused, later hidden with its refusal result.
    refused_call = msgspec.structs.replace(
        ToolCallPart.of("c2", "ping", {}), notes={"budget": {"refused": "over"}}
    )
    refused = msg_hidden(answered("a3", calls=(refused_call,)))
    # A repaired copy (SUPERSEDES) replaces a hidden original with the same call id.
    c3 = ToolCallPart.of("c3", "ping", {})
    original = msg_hidden(answered("a4", calls=(c3,)))
    copy = answered("a5", calls=(c3,))
    copy = msgspec.structs.replace(copy, notes={**copy.notes, SUPERSEDES: {"message_id": "a4"}})
    session = make_session(
        user("go", "u1"),
        retried,
        feedback,
        again,
        result("c1", "r1"),
        refused,
        hidden_result("c2", "r2", budget={"refused": "c2"}),
        original,
        copy,
        result("c3", "r3"),
    )
    usage = budget_usage(session, "session")
    assert usage.tool_call_positions == (("a2", "c1"), ("a5", "c3"))


async def test_a_repeated_call_id_is_counted_and_refused_by_position() -> None:
    first = answered("a1", calls=(ToolCallPart.of("call_0", "ping", {}),))
    second = answered("a2", calls=(ToolCallPart.of("call_0", "ping", {}),))
    session = make_session(user("go", "u1"), first, result("call_0", "r1"), second)
    assert budget_usage(session, "session").tool_call_positions == (
        ("a1", "call_0"),
        ("a2", "call_0"),
    )
    budget = Budget(per_session=Limits(tool_calls=1))
    runtime = Runtime(ids=counter_ids("b"))
    check = await run_step(budget, session, others=[Tools([ping])], runtime=runtime)
    # the second call_0 is the second call: over a limit of 1, whatever its id
    assert budget.check_call(check.ctx, check.before.conversation[3].tool_calls[0]) is not None
    assert budget.check_call(check.ctx, check.before.conversation[1].tool_calls[0]) is None
    assert check.yielded
    assert check.outcome.reason.kind == YieldReason.BUDGET_EXHAUSTED  # type: ignore[union-attr]
    # the refusal is noted on the second call, not on the first one with that id
    assert "budget" not in check.session.message("a1").tool_calls[0].notes  # type: ignore[union-attr]
    assert check.session.message("a2").tool_calls[0].notes["budget"]["refused"]  # type: ignore[union-attr]
    assert budget_usage(check.session, "session").tool_call_positions == (("a1", "call_0"),)


async def test_placed_after_inference_it_raises_instead_of_sending() -> None:
    session = make_session(user("hi", "u1"), answered("a1", revision=0), user("x", "u2"))
    model = ScriptedModel(["never"])
    inference = ModelInference()
    with pytest.raises(BudgetExhaustedError, match="exact budgets"):
        await run_step(
            inference, session, model=model, others=[Budget(per_session=Limits(model_calls=1))]
        )
    assert model.requests == []


# -- whole runs --------------------------------------------------------------------------


def agent(budget: Budget) -> StateMachine[Any]:
    return StateMachine([budget, Tools([ping]), ModelInference()])


def always_ping(request: ModelRequest) -> ModelResponse:
    return call(("ping", {}))


async def test_a_run_stops_after_exactly_n_model_calls_and_the_next_run_gets_n_more(
    store: Store,
) -> None:
    await store.create("s", conversation=[Message.user("go", id="u0")])
    model = FunctionModel(always_ping)
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    report = await agent(Budget(per_run=Limits(model_calls=3))).run_report(runtime, "s")
    assert report.reason.kind == YieldReason.BUDGET_EXHAUSTED
    assert model.calls == 3
    report = await agent(Budget(per_run=Limits(model_calls=3))).run_report(runtime, "s")
    assert model.calls == 6
    assert not history_problems(report.session.conversation)
    assert [r.step for r in report.results][-1] == "budget"


async def test_tool_call_budget_in_a_whole_run(store: Store) -> None:
    await store.create("s", conversation=[Message.user("go", id="u0")])
    model = ScriptedModel([call(("ping", {}), ("ping", {}), ("ping", {})), "done"])
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    report = await agent(Budget(per_turn=Limits(tool_calls=2))).run_report(runtime, "s")
    assert report.reason.kind == YieldReason.BUDGET_EXHAUSTED
    results = [r for m in report.session.conversation for r in m.tool_results]
    assert [r.is_error for r in results] == [False, False, True]
    report = await agent(Budget(per_turn=Limits(tool_calls=2))).run_report(runtime, "s")
    assert report.reason.kind == YieldReason.DONE  # the model sees the refusal and answers
    model.assert_all_used()


async def test_compaction_hiding_the_history_gives_no_tool_calls_back(store: Store) -> None:
    runs: list[int] = []

    @tool
    def count(n: int) -> str:
        """Count."""
        runs.append(n)
        return "ok"

    await store.create("s", conversation=[Message.user("go", id="u1")])
    machine = StateMachine(
        [Budget(per_session=Limits(tool_calls=1)), Tools([count]), ModelInference()]
    )
    model = ScriptedModel([call(("count", {"n": 1})), call(("count", {"n": 2}))])
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == YieldReason.BUDGET_EXHAUSTED
    assert runs == [1]
    # what a compaction does: hide the older messages (never deleted), add a summary
    session = await store.load("s")
    await submit(
        store,
        "s",
        [
            SetVisibility(tuple(m.id for m in session.conversation), to_model=False),
            AppendMessage(Message.user("[summary] counted once", id="sum")),
            AppendMessage(Message.user("again", id="u2")),
        ],
    )
    model = ScriptedModel([call(("count", {"n": 3})), "fine"])
    runtime = Runtime(store=store, model=model, ids=counter_ids("z"))
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == YieldReason.BUDGET_EXHAUSTED
    assert runs == [1]  # the per-session limit of 1 holds across the compaction


# -- invariant 7: property test ------------------------------------------------------------


class RetryingModel:
    """A model adapter that retries: each scripted turn needs ``k`` attempts to succeed.

    It respects ``request.max_attempts``: with fewer attempts allowed it either
    gives up (raises ModelError) or, if ``lenient``, returns after the last
    allowed attempt. Every attempt is counted in ``made``.
    """

    def __init__(self, needs: list[int], *, lenient: bool) -> None:
        self.needs = needs
        self.turn = 0
        self.made = 0
        self.lenient = lenient

    async def __call__(self, request: ModelRequest) -> ModelResponse:
        need = self.needs[self.turn % len(self.needs)]
        self.turn += 1
        allowed = request.max_attempts if request.max_attempts is not None else need
        attempts = min(need, allowed)
        self.made += attempts
        if attempts < need and not self.lenient:
            raise ModelError(f"gave up after {attempts} attempts")
        response = call(("ping", {})) if self.turn < len(self.needs) else reply("done")
        return ModelResponse(
            parts=response.parts, usage=Usage(1, 1), finish_reason="x", attempts=attempts
        )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    budget=st.integers(min_value=1, max_value=8),
    needs=st.lists(st.integers(min_value=1, max_value=3), min_size=1, max_size=8),
    lenient=st.booleans(),
    scope=st.sampled_from(["run", "turn"]),
)
async def test_exact_model_call_budgets(
    budget: int, needs: list[int], lenient: bool, scope: str
) -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u0")])
    fake = RetryingModel(needs, lenient=lenient)
    runtime = Runtime(store=store, model=FunctionModel(fake), ids=counter_ids())
    limits = Limits(model_calls=budget)
    step = Budget(per_run=limits) if scope == "run" else Budget(per_turn=limits)
    raised = False
    try:
        session = await agent(step).run(runtime, "s")
    except ModelError:
        raised = True
        session = await store.load("s")
    assert fake.made <= budget
    wanted = sum(needs)
    if not raised:
        recorded = budget_usage(session, "session").model_calls
        assert recorded == fake.made
        assert fake.made == min(budget, wanted) or (fake.made < budget and fake.made == wanted)
        if wanted > budget:
            assert fake.made == budget


async def test_other_steps_model_calls_count_and_hidden_summaries_start_no_turn() -> None:
    summary = msgspec.structs.replace(
        Message.user("Summary of earlier work", id="sum"),
        visible_to_user=False,
        notes={"compaction": {"kind": "summary", "attempts": 2, "revision": 3, "usage": {}}},
    )
    session = make_session(user("go", "u1"), answered("a1", tokens=(1, 1)), summary, revision=4)
    # Three model calls so far: one inference, two summariser attempts.
    assert (await run_step(Budget(per_session=Limits(model_calls=4)), session)).refused
    assert (await run_step(Budget(per_session=Limits(model_calls=3)), session)).yielded
    # The summary is not a user turn: the per-turn count still starts at "go".
    assert (await run_step(Budget(per_turn=Limits(model_calls=3)), session)).yielded


# -- the ledger: constant cost, same counts ------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    runs=st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(1, 3), min_size=1, max_size=4)),
        min_size=1,
        max_size=4,
    )
)
async def test_the_ledger_agrees_with_counting_the_records(
    runs: list[tuple[bool, list[int]]],
) -> None:
    """Model calls and tokens read from the latest ledger equal the records counted one by
    one, for every scope, over runs with retries, tool calls and new user turns."""
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u0")])
    for number, (new_turn, needs) in enumerate(runs):
        if new_turn:
            message = Message.user(f"more {number}", id=f"m{number}")
            await submit(store, "s", [AppendMessage(message)])
        start = (await store.load("s")).revision
        model = FunctionModel(RetryingModel(needs, lenient=True))
        runtime = Runtime(store=store, model=model, ids=counter_ids(f"r{number}-"))
        await agent(Budget(per_session=Limits(model_calls=1_000))).run(runtime, "s")
        session = await store.load("s")
        for scope in ("session", "turn", "run"):
            fast = budget_usage(session, scope, run_start_revision=start, tool_calls=False)
            slow = budget_usage(session, scope, run_start_revision=start)
            assert (fast.model_calls, fast.input_tokens, fast.output_tokens) == (
                slow.model_calls,
                slow.input_tokens,
                slow.output_tokens,
            ), scope
        assert not latest_ledger(session).legacy


async def test_model_call_budgets_read_no_more_of_a_longer_history() -> None:
    """Without a tool-call limit, ``run``, ``check_call`` and ``shape_request`` read back
    to the latest model call only (per run: back to the run's start)."""
    limits = Limits(model_calls=10_000, input_tokens=10**6, total_tokens=10**6)
    budget = Budget(per_run=limits, per_turn=limits, per_session=limits)
    reads = []
    for turns in (5, 200):
        session = make_session(*tool_loop(turns), user("next", "last"), revision=turns)
        assert budget_usage(session, "session").model_calls == turns  # counted one by one
        session, conversation = counted(session)
        # This run began at the session's revision: it has made no call yet.
        ctx = dataclasses.replace(scan_context(session), run_start_revision=turns)
        assert isinstance(await budget.run(ctx), Refuse)
        assert budget.check_call(ctx, ToolCallPart.of("new", "ping", {})) is None
        request = budget.shape_request(ctx, ModelRequest(messages=()))
        assert request.max_attempts == 10_000 - turns  # the session has made one call a turn
        fast = budget_usage(session, "session", tool_calls=False)
        assert (fast.model_calls, fast.input_tokens) == (turns, 10 * turns)
        reads.append(conversation.read)
    assert reads[0] == reads[1] < 40  # a few messages per scope and question, at any length


class _RetryingModel:
    """A model that fails ``failures`` attempts of every request, then answers.

    It honours ``request.max_attempts`` (default 10) like a provider adapter
    with retries, and counts every attempt it makes.
    """

    name = "retrying"

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.attempts = 0

    async def request(
        self, request: ModelRequest, *, on_chunk: ChunkSink | None = None
    ) -> ModelResponse:
        allowed = request.max_attempts or 10
        for attempt in range(1, allowed + 1):
            self.attempts += 1
            if attempt > self.failures:
                return ModelResponse(parts=(TextPart("answer"),), attempts=attempt)
        raise ModelError(f"failed {allowed} attempts")


class _MoreRetries(Operation[Any]):
    """A retry policy written as a request shaper: every request may take 5 attempts."""

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Refuse("policy only")

    def shape_request(self, ctx: StepContext[Any], request: ModelRequest) -> ModelRequest:
        return msgspec.structs.replace(request, max_attempts=5)


class _RebuildsTheRequest(Operation[Any]):
    """A shaper that builds a new request and forgets ``max_attempts`` (left to the model)."""

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Refuse("shaper only")

    def shape_request(self, ctx: StepContext[Any], request: ModelRequest) -> ModelRequest:
        return ModelRequest(
            messages=request.messages, tools=request.tools, prompt_parts=request.prompt_parts
        )


@pytest.mark.parametrize("shaper", [_MoreRetries, _RebuildsTheRequest])
async def test_a_shaper_after_the_budget_cannot_raise_the_attempts_it_allows(
    shaper: type[Operation[Any]],
) -> None:
    """Invariant 7: a budget of 2 model calls is 2 attempts, whatever shapes the request after it.

    ``Budget.shape_request`` caps ``max_attempts`` at the calls left, "whatever
    the order"; a later shaper that sets it higher (a retry policy) or drops it
    (rebuilds the request) let the model make 4 attempts.
    """
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u")])
    model = _RetryingModel(failures=3)
    machine = StateMachine([Budget(per_run=Limits(model_calls=2)), shaper(), ModelInference()])
    with pytest.raises(ModelError):
        await machine.run(Runtime(store=store, model=model, ids=counter_ids()), "s")
    assert model.attempts == 2


class _TokenModel:
    """A model whose answer is as long as it may be: ``max_tokens`` output tokens (100 if unset)."""

    name = "tokens"

    async def request(
        self, request: ModelRequest, *, on_chunk: ChunkSink | None = None
    ) -> ModelResponse:
        tokens = request.settings.max_tokens or 100
        return ModelResponse(parts=(TextPart("x"),), usage=Usage(output_tokens=tokens))


class _ResetsTheSettings(Operation[Any]):
    """A shaper that sets its own sampling settings (and so drops ``max_tokens``)."""

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Refuse("shaper only")

    def shape_request(self, ctx: StepContext[Any], request: ModelRequest) -> ModelRequest:
        return msgspec.structs.replace(request, settings=ModelSettings(temperature=0.0))


async def test_a_shaper_after_the_budget_cannot_undo_its_output_token_cap() -> None:
    """An output-token budget of 10 is "capped through max_tokens"; a later shaper undoes it.

    Budget's docs: token limits hold "whatever the order" of the steps, output
    tokens exactly, through ``settings.max_tokens``. A shaper after it that
    replaces the settings lets the call produce 100 output tokens.
    """
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u")])
    budget = Budget(per_run=Limits(output_tokens=10))
    machine = StateMachine([budget, _ResetsTheSettings(), ModelInference()])
    session = await machine.run(Runtime(store=store, model=_TokenModel(), ids=counter_ids()), "s")
    assert budget_usage(session, "per_run").output_tokens <= 10


class _LongAnswers(Operation[Any]):
    """A shaper that asks for long answers: raises ``max_tokens`` to 500."""

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Refuse("shaper only")

    def shape_request(self, ctx: StepContext[Any], request: ModelRequest) -> ModelRequest:
        settings = msgspec.structs.replace(request.settings, max_tokens=500)
        return msgspec.structs.replace(request, settings=settings)


async def test_a_shaper_may_raise_the_askers_max_tokens_but_not_a_budgets_cap() -> None:
    """The asker's own ``max_tokens`` is a default a shaper may raise; a shaper's cap is not."""
    for steps, expected in (
        ([_LongAnswers()], 500),  # raises the asker's 50
        ([Budget(per_run=Limits(output_tokens=10)), _LongAnswers()], 10),
        ([_LongAnswers(), Budget(per_run=Limits(output_tokens=10))], 10),
    ):
        store = MemoryStore()
        await store.create("s", conversation=[Message.user("hi", id="u")])
        inference = ModelInference(settings=ModelSettings(max_tokens=50))
        machine = StateMachine([*steps, inference])
        runtime = Runtime(store=store, model=_TokenModel(), ids=counter_ids())
        session = await machine.run(runtime, "s")
        assert budget_usage(session, "per_run").output_tokens == expected, steps
