"""The Tools operation's journal: intents, per-result commits, crash recovery, aborts."""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import pytest
from _staging import carry_out
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import (
    Agent,
    Annotate,
    AppendMessage,
    ConfigurationError,
    Effect,
    Message,
    ModelInference,
    Operation,
    Outcome,
    Refuse,
    Runtime,
    Session,
    SideEffects,
    StateMachine,
    StepContext,
    Tool,
    ToolAbortError,
    ToolCallPart,
    ToolContext,
    Tools,
    Yield,
    resolve_unknown_outcome,
    submit,
    tool,
)
from stepmachine._codec import Batch
from stepmachine.extend import (
    JOURNAL,
    NOT_EXECUTED,
    OUTCOME_UNKNOWN,
    EventSink,
    NullEmitter,
    apply_batch,
    counter_ids,
    fingerprint,
    history_problems,
    idempotency_key,
    open_tool_calls,
)
from stepmachine.stores import MemoryStore
from stepmachine.testing import FunctionModel, ScriptedModel, call, make_session, reply, run_step


def calls_message(*calls: ToolCallPart, message_id: str = "a1") -> Message:
    return Message(id=message_id, role="assistant", parts=calls)


def with_intent(call: ToolCallPart) -> ToolCallPart:
    """The call as the journal leaves it when a crash hit after the intent."""
    note = {"intent": True, "attempt": 1, "fingerprint": fingerprint(call.name, call.arguments)}
    return ToolCallPart(
        call_id=call.call_id,
        name=call.name,
        arguments=call.arguments,
        raw_arguments=call.raw_arguments,
        notes={JOURNAL: note},
    )


ran: list[str] = []


@tool
def charge(amount: int) -> str:
    """Charge a card (not idempotent)."""
    ran.append(f"charge {amount}")
    return f"charged {amount}"


@tool(side_effects="idempotent")
def upsert(key: str, ctx: ToolContext) -> str:
    """Write a record under an idempotency key."""
    ran.append(f"upsert {key} {ctx.idempotency_key}")
    return "ok"


@tool(side_effects="pure")
def square(x: int) -> int:
    """Square a number."""
    return x * x


@pytest.fixture(autouse=True)
def _reset() -> None:
    ran.clear()


async def test_intent_is_committed_before_the_tool_runs_and_each_result_after() -> None:
    seen_at_run: list[dict[str, Any]] = []

    @tool
    async def probe(ctx: ToolContext) -> str:
        seen_at_run.append({"key": ctx.idempotency_key})
        return "probed"

    session = make_session(calls_message(ToolCallPart.of("c1", "probe", {})))
    check = await run_step(Tools([probe]), session)
    assert check.continued
    assert check.effects == ()  # everything went through ctx.commit
    intent_batch, result_batch = check.commits
    (intent,) = intent_batch
    assert isinstance(intent, Annotate)
    assert intent.namespace == JOURNAL
    assert intent.call_id == "c1"
    assert intent.values["intent"] is True
    assert intent.values["side_effects"] == "non_idempotent"
    assert intent.values["fingerprint"] == fingerprint("probe", {})
    assert intent.values["idempotency_key"] == idempotency_key("test-session", "c1", "a1")
    assert seen_at_run == [{"key": idempotency_key("test-session", "c1", "a1")}]
    (result,) = result_batch
    assert isinstance(result, AppendMessage)
    assert result.message.tool_results[0].content == "probed"


async def test_each_result_is_committed_as_soon_as_it_exists() -> None:
    release = anyio.Event()
    order: list[str] = []

    @tool
    async def slow() -> str:
        await release.wait()
        return "slow"

    @tool
    async def fast() -> str:
        return "fast"

    async def commit_watch(current: Session[Any], effects: Any) -> Session[Any]:
        for effect in effects:
            if isinstance(effect, AppendMessage):
                order.append(effect.message.tool_results[0].content)
                if effect.message.tool_results[0].content == "fast":
                    release.set()  # the slow tool may finish only after fast was committed
        return apply_batch(current, effects)

    session = make_session(
        calls_message(ToolCallPart.of("c1", "slow", {}), ToolCallPart.of("c2", "fast", {}))
    )
    machine = StateMachine([Tools([slow, fast])])
    tools, _parts = machine.collect(session)
    ctx: StepContext[Any] = StepContext(
        session=session,
        runtime=Runtime(ids=counter_ids()),
        events=EventSink(NullEmitter(), session.id, 0),
        tools=tools,
        steps=machine.steps,
        committer=commit_watch,
    )
    with anyio.fail_after(120):  # a deadlock guard, not a timing assertion
        await carry_out(machine.steps[0], ctx)
    assert order == ["fast", "slow"]
    assert open_tool_calls(ctx.session.conversation) == []


async def test_crashed_non_idempotent_call_is_answered_outcome_unknown_not_rerun() -> None:
    call = with_intent(ToolCallPart.of("c1", "charge", {"amount": 5}))
    check = await run_step(Tools([charge]), make_session(calls_message(call)))
    assert ran == []
    (result,) = [r for m in check.new_messages for r in m.tool_results]
    assert result.is_error
    assert result.content == OUTCOME_UNKNOWN


@pytest.mark.parametrize("tool_obj", [upsert, square], ids=["idempotent", "pure"])
async def test_crashed_idempotent_or_pure_call_is_rerun_with_the_same_key(tool_obj: Any) -> None:
    arguments = {"key": "k"} if tool_obj is upsert else {"x": 3}
    call = with_intent(ToolCallPart.of("c1", tool_obj.name, arguments))
    check = await run_step(Tools([tool_obj]), make_session(calls_message(call)))
    (result,) = [r for m in check.new_messages for r in m.tool_results]
    assert not result.is_error
    # Re-running is harmless by declaration: no new intent, just the one result.
    ((only,),) = check.commits
    assert isinstance(only, AppendMessage)
    assert only.message.tool_results == (result,)
    if tool_obj is upsert:
        assert ran == [f"upsert k {idempotency_key('test-session', 'c1', 'a1')}"]


async def test_the_class_recorded_with_the_intent_decides_a_rerun_not_the_tools_class_now() -> None:
    # The intent was recorded while `upsert` was non-idempotent; it is declared
    # idempotent now (a new version, or an MCP server's new annotations): the
    # call may have run, so it is not run again blindly (invariants 1 and 6).
    call = with_intent(ToolCallPart.of("c1", "upsert", {"key": "k"}))
    journal = {**call.notes[JOURNAL], "side_effects": "non_idempotent"}
    call = msgspec.structs.replace(call, notes={JOURNAL: journal})
    check = await run_step(Tools([upsert]), make_session(calls_message(call)))
    assert ran == []
    (result,) = [r for m in check.new_messages for r in m.tool_results]
    assert result.is_error
    assert result.content == OUTCOME_UNKNOWN


async def test_unknown_outcome_can_wait_for_an_operator() -> None:
    store = MemoryStore()
    call = with_intent(ToolCallPart.of("c1", "charge", {"amount": 5}))
    await store.create("s", conversation=[Message.user("pay", id="u1"), calls_message(call)])
    machine = StateMachine([Tools([charge], on_unknown_outcome="yield"), ModelInference()])
    model = FunctionModel(lambda request: reply("paid"))
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == "outcome_unknown"
    assert report.reason.data == {"calls": ["c1"]}
    assert ran == []
    await resolve_unknown_outcome(store, "s", "c1", rerun=True, by="ops@example.com")
    report = await machine.run_report(runtime, "s")
    assert ran == ["charge 5"]
    assert report.session.conversation[-1].text == "paid"
    notes = report.session.conversation[1].tool_calls[0].notes[JOURNAL]
    assert notes["decided_by"] == "ops@example.com"
    assert notes["attempt"] == 2


async def test_operator_can_refuse_a_rerun() -> None:
    store = MemoryStore()
    call = with_intent(ToolCallPart.of("c1", "charge", {"amount": 5}))
    await store.create("s", conversation=[Message.user("pay", id="u1"), calls_message(call)])
    session = await resolve_unknown_outcome(store, "s", "c1", rerun=False, by="ana", note="refund")
    (result,) = session.conversation[-1].tool_results
    assert result.is_error
    assert "ana decided not to run it again" in result.content
    with pytest.raises(ConfigurationError):
        await resolve_unknown_outcome(store, "s", "c1", rerun=True, by="ana")


async def test_a_tool_that_fails_closed_stops_the_batch_and_the_run() -> None:
    @tool
    async def guard() -> str:
        raise ToolAbortError("database is read-only")

    session = make_session(
        calls_message(
            ToolCallPart.of("c1", "guard", {}),
            ToolCallPart.of("c2", "charge", {"amount": 1}),
        )
    )
    check = await run_step(Tools([guard, charge], max_concurrency=1), session)
    assert isinstance(check.outcome, Yield)
    assert check.outcome.reason.kind == "tool_failed"
    assert "database is read-only" in check.outcome.reason.message
    assert ran == []  # the second call was never started
    results = {r.call_id: r for m in check.new_messages for r in m.tool_results}
    assert results["c1"].is_error
    assert results["c2"].content == NOT_EXECUTED.format(reason="guard: database is read-only")


async def test_per_tool_timeout_gives_an_error_result() -> None:
    @tool(timeout=0.01)
    async def hang() -> str:
        await anyio.sleep_forever()
        return "never"

    check = await run_step(
        Tools([hang]), make_session(calls_message(ToolCallPart.of("c", "hang", {})))
    )
    (result,) = [r for m in check.new_messages for r in m.tool_results]
    assert result.is_error
    assert "timed out" in result.content


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_call_without_timeout_runs_unbounded_and_its_own_timeout_error_is_a_timeout(
    kind: str,
) -> None:
    """Without a timeout (the tool's or the step's) a call runs under no deadline; a
    ``TimeoutError`` the tool raises itself is answered "timed out", as with one."""
    seen: list[float] = []

    def slow_sync() -> str:
        raise TimeoutError("the tool's own")

    async def slow_async() -> str:
        seen.append(anyio.current_effective_deadline())
        raise TimeoutError("the tool's own")

    impl = tool(slow_sync if kind == "sync" else slow_async, name="slow")
    check = await run_step(
        Tools([impl]), make_session(calls_message(ToolCallPart.of("c", "slow", {})))
    )
    (result,) = [r for m in check.new_messages for r in m.tool_results]
    assert result.is_error
    assert "timed out after None s" in result.content
    assert seen == ([] if kind == "sync" else [math.inf])


class Objector(Operation[Any]):
    """Objects to every call of ``charge``."""

    def check_call(self, ctx: StepContext[Any], call: ToolCallPart) -> str | None:
        return "needs a human" if call.name == "charge" else None

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Refuse()


async def test_calls_another_step_objects_to_are_held_back_whatever_the_order() -> None:
    session = make_session(
        calls_message(
            ToolCallPart.of("c1", "charge", {"amount": 1}),
            ToolCallPart.of("c2", "square", {"x": 2}),
        )
    )
    check = await run_step(Tools([charge, square]), session, others=[Objector()])
    assert ran == []
    assert [c.call_id for c in open_tool_calls(check.session.conversation)] == ["c1"]
    only_charge = make_session(calls_message(ToolCallPart.of("c1", "charge", {"amount": 1})))
    check = await run_step(Tools([charge]), only_charge, others=[Objector()])
    assert check.refused


async def test_a_whole_run_records_an_audit_trail_per_result() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    await submit(
        store,
        "s",
        [
            AppendMessage(
                calls_message(*(ToolCallPart.of(f"c{i}", "square", {"x": i}) for i in range(3)))
            )
        ],
    )
    machine = StateMachine([Tools([square]), ModelInference()])
    model = FunctionModel(lambda request: reply("done"))
    session = await machine.run(Runtime(store=store, model=model, ids=counter_ids()), "s")
    steps = [b.step for b in await store.batches("s")]
    # square is pure: no intents batch, one batch per result.
    assert steps == ["application", "tools", "tools", "tools", "inference"]
    assert sorted(r.content for m in session.conversation for r in m.tool_results) == [
        "0",
        "1",
        "4",
    ]


async def test_calls_with_a_repeated_id_are_never_run() -> None:
    first = ToolCallPart.of("c1", "charge", {"amount": 1})
    again = ToolCallPart.of("c1", "charge", {"amount": 2})
    session = make_session(calls_message(first, again))
    check = await run_step(Tools([charge]), session)
    assert check.refused
    assert ran == []


async def test_an_operators_rerun_covers_one_attempt_only() -> None:
    store = MemoryStore()
    call = with_intent(ToolCallPart.of("c1", "charge", {"amount": 5}))
    await store.create("s", conversation=[Message.user("pay", id="u1"), calls_message(call)])
    await resolve_unknown_outcome(store, "s", "c1", rerun=True, by="ops")
    # The re-run crashes too (simulated: a new intent for attempt 2, no result).
    session = await store.load("s")
    journal = session.conversation[1].tool_calls[0].notes[JOURNAL]
    assert journal["rerun_attempt"] == 1
    crashed_again = msgspec.structs.replace(call, notes={JOURNAL: {**journal, "attempt": 2}})
    check = await run_step(
        Tools([charge]), make_session(Message.user("pay", id="u1"), calls_message(crashed_again))
    )
    assert ran == []  # the decision was about attempt 1: attempt 2 is "outcome unknown"
    (result,) = [r for m in check.new_messages for r in m.tool_results]
    assert result.content == OUTCOME_UNKNOWN


def _noop(x: int) -> str:
    """Do nothing."""
    return str(x)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "4", None])
def test_tools_refuse_a_max_concurrency_that_cannot_run_a_call(value: Any) -> None:
    """0 hung the run forever after the intents were committed; -1 and 1.5 raised then, so
    the next run answered calls that never ran "outcome unknown". Refused when built."""
    with pytest.raises(ConfigurationError, match=rf"max_concurrency.*{value!r}"):
        Tools([_noop], max_concurrency=value)


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("-inf"), True, "5"])
def test_tools_and_tool_refuse_a_timeout_that_is_not_positive(value: Any) -> None:
    """A timeout of 0 or -1 answered every call "timed out, outcome unknown" without running
    it; "5" made every call "failed: TypeError". Refused when built, on Tools and on Tool."""
    with pytest.raises(ConfigurationError, match=r"timeout"):
        Tools([_noop], timeout=value)
    with pytest.raises(ConfigurationError, match=r"timeout"):
        Tool(_noop, timeout=value)


def test_positive_limits_and_no_timeout_are_accepted() -> None:
    assert Tools([_noop], max_concurrency=1, timeout=0.5).name == "tools"
    assert Tools([_noop], timeout=float("inf")).name == "tools"
    assert Tool(_noop, timeout=3).timeout == 3
    assert Tool(_noop).timeout is None


# -- how many batches a tool step costs ----------------------------------------------------------


@pytest.mark.parametrize("tool_obj", [upsert, square], ids=["idempotent", "pure"])
async def test_a_pure_or_idempotent_call_commits_no_intent_only_its_result(tool_obj: Any) -> None:
    arguments = {"key": "k"} if tool_obj is upsert else {"x": 3}
    session = make_session(calls_message(ToolCallPart.of("c1", tool_obj.name, arguments)))
    check = await run_step(Tools([tool_obj]), session)
    ((only,),) = check.commits  # one batch: the result
    assert isinstance(only, AppendMessage)
    assert only.message.tool_results[0].call_id == "c1"
    assert JOURNAL not in check.session.conversation[-2].tool_calls[0].notes


async def test_a_mixed_batch_records_intents_for_the_non_idempotent_calls_only() -> None:
    session = make_session(
        calls_message(
            ToolCallPart.of("c1", "square", {"x": 2}),
            ToolCallPart.of("c2", "charge", {"amount": 5}),
            ToolCallPart.of("c3", "upsert", {"key": "k"}),
        )
    )
    check = await run_step(Tools([square, charge, upsert], max_concurrency=1), session)
    intents, *results = check.commits
    assert [(type(e), e.call_id) for e in intents] == [(Annotate, "c2")]  # type: ignore[attr-defined]
    assert [[r.call_id for e in b for r in e.message.tool_results] for b in results] == [  # type: ignore[attr-defined]
        ["c1"],
        ["c2"],
        ["c3"],
    ]


async def test_a_whole_run_with_a_pure_tool_takes_two_batches_per_tool_step() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    model = FunctionModel(
        lambda request: (
            reply("done")
            if request.messages[-1].role == "tool"
            else msgspec.structs.replace(
                reply(""), parts=(ToolCallPart.of("c1", "square", {"x": 4}),)
            )
        )
    )
    machine = StateMachine([Tools([square]), ModelInference()])
    await machine.run(Runtime(store=store, model=model, ids=counter_ids()), "s")
    assert [b.step for b in await store.batches("s")] == ["inference", "tools", "inference"]


async def test_one_call_runs_without_a_task_group_limiter_or_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    session = make_session(calls_message(ToolCallPart.of("c1", "charge", {"amount": 1})))
    step = Tools([charge])  # max_concurrency 8, but one call

    def unused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the single-call path built concurrency machinery")

    for name in ("create_task_group", "CapacityLimiter", "Lock"):
        monkeypatch.setattr(anyio, name, unused)
    check = await run_step(step, session)
    monkeypatch.undo()
    assert ran == ["charge 1"]
    assert [r.content for m in check.new_messages for r in m.tool_results] == ["charged 1"]


# -- invariant 6 under crashes at every batch (property) ------------------------------------------


class Crash(BaseException):
    """The process dies: nothing after it runs (not an Exception, so nothing catches it)."""


class CrashingHandler:
    """Writes batches to ``store`` until the ``at``-th one, which kills the "process" instead."""

    def __init__(self, store: MemoryStore, at: int) -> None:
        self.store = store
        self.at = at
        self.seen = 0

    async def apply(self, batch: Batch[Effect]) -> Session[Any] | None:
        self.seen += 1
        if self.seen == self.at:
            raise Crash
        return await self.store.apply(batch)


def counting_tools(executed: list[str]) -> list[Tool]:
    built = []
    kinds: tuple[SideEffects, ...] = ("pure", "idempotent", "non_idempotent")
    for kind in kinds:

        def run(x: int, ctx: ToolContext, kind: str = kind) -> str:
            executed.append(ctx.call_id)
            return f"{kind} {x}"

        built.append(Tool(run, name=kind, side_effects=kind, thread=False))
    return built


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kinds=st.lists(
        st.sampled_from(["pure", "idempotent", "non_idempotent"]), min_size=1, max_size=4
    ),
    crash_at=st.integers(min_value=1, max_value=7),
    max_concurrency=st.sampled_from([1, 8]),
)
async def test_after_a_crash_at_any_batch_only_harmless_calls_run_again(
    kinds: list[str], crash_at: int, max_concurrency: int
) -> None:
    """Invariant 6: a non-idempotent call runs at most once whatever batch a crash hits;
    pure and idempotent calls are simply run again; every call ends with exactly one result."""
    store = MemoryStore()
    calls = [ToolCallPart.of(f"c{i}", kind, {"x": i}) for i, kind in enumerate(kinds)]
    await store.create("s", conversation=[Message.user("go", id="u1"), calls_message(*calls)])
    executed: list[str] = []
    model = FunctionModel(lambda request: reply("done"))

    def machine() -> StateMachine[Any]:
        return StateMachine(
            [Tools(counting_tools(executed), max_concurrency=max_concurrency), ModelInference()]
        )

    handler = CrashingHandler(store, crash_at)
    runtime = Runtime(store=store, handler=handler, model=model, ids=counter_ids())
    crashed = False
    try:
        await machine().run(runtime, "s")
    except Crash:  # also when it hit inside the parallel task group: never an ExceptionGroup
        crashed = True
    first_run = list(executed)
    if not crashed:  # no crash: the batches are the model's call, intents where needed, results
        steps = [b.step for b in await store.batches("s")]
        intents = 1 if "non_idempotent" in kinds else 0
        assert steps == ["tools"] * (intents + len(kinds)) + ["inference"]
    final = await machine().run(Runtime(store=store, model=model, ids=counter_ids("r")), "s")
    assert history_problems(final.conversation) == []
    assert final.conversation[-1].text == "done"
    results = [r for m in final.conversation for r in m.tool_results]
    assert sorted(r.call_id for r in results) == sorted(c.call_id for c in calls)  # one each
    for made, kind in zip(calls, kinds, strict=True):
        (result,) = [r for r in results if r.call_id == made.call_id]
        runs = executed.count(made.call_id)
        if kind == "non_idempotent":
            assert runs <= 1
            if result.content == OUTCOME_UNKNOWN:
                # Its intent was committed before the crash (it may not have run yet);
                # the resumed run did not run it.
                assert crashed
                assert runs == first_run.count(made.call_id)
            else:
                assert result.content == f"{kind} {calls.index(made)}"
                assert runs == 1
        else:
            assert result.content == f"{kind} {calls.index(made)}"  # re-run if need be
            assert runs >= 1


# -- at the edges, as a user meets them ----------------------------------------


async def test_cancelling_a_run_with_a_hung_sync_tool_is_bounded() -> None:
    release = threading.Event()
    entered = threading.Event()

    @tool
    def fetch(url: str) -> str:
        """A blocking call with no timeout of its own (a hung socket)."""
        entered.set()
        release.wait(timeout=30)
        return "late"

    store = MemoryStore()
    await store.create("s1", conversation=[Message.user("fetch it", id="u1")])
    model = ScriptedModel([call(("fetch", {"url": "http://example.com"})), reply("ok")])
    machine = StateMachine([Tools([fetch]), ModelInference()], finalize_timeout=0.2)
    released_by: list[str] = []

    async def watchdog() -> None:
        # Releases the tool only if the cancelled run has not returned on its own
        # long after finalize_timeout: then the run was waiting for the tool.
        await anyio.sleep(3)
        if not released_by:
            released_by.append("watchdog")
            release.set()

    async with anyio.create_task_group() as group:
        group.start_soon(watchdog)
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as inner:
                inner.start_soon(machine.run, Runtime(store=store, model=model), "s1")
                while not entered.is_set():  # noqa: ASYNC110 - set from the tool's thread
                    await anyio.sleep(0.01)
                scope.cancel()
        if not released_by:
            released_by.append("run returned")
        release.set()
        group.cancel_scope.cancel()
    assert released_by == ["run returned"]


class _UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this exception cannot be printed")


async def test_a_tool_raising_an_unprintable_exception_becomes_an_error_result(
    tmp_path: Path,
) -> None:
    @tool
    def lookup(query: str) -> str:
        """Look something up."""
        raise _UnprintableError

    model = ScriptedModel([call(("lookup", {"query": "x"})), reply("sorry")])
    report = await Agent(model, tools=[lookup], store=tmp_path / "db.sqlite3").run("s1", "find x")
    assert report.text == "sorry"
    results = [part for message in report.session.conversation for part in message.tool_results]
    assert [part.is_error for part in results] == [True]


async def test_a_sync_tool_is_bounded_by_its_timeout(tmp_path: Path) -> None:
    release = threading.Event()

    @tool(timeout=0.2)
    def fetch(url: str) -> str:
        """A blocking call that hangs (released by the test after at most 3 s)."""
        release.wait(timeout=3)
        return "late"

    model = ScriptedModel([call(("fetch", {"url": "http://example.com"})), reply("ok")])
    agent = Agent(model, tools=[fetch], store=tmp_path / "db.sqlite3")
    try:
        report = await agent.run("s1", "fetch it")
    finally:
        release.set()
    results = [part for message in report.session.conversation for part in message.tool_results]
    assert [(part.is_error, "timed out" in str(part.content)) for part in results] == [(True, True)]
