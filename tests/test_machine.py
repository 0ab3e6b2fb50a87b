"""The machine loop: ordering, yield and resume, invariants 1, 3 and 4, cancellation."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import (
    AppendMessage,
    CancelToken,
    Codec,
    ConfigurationError,
    ConflictError,
    Continue,
    Effect,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Operation,
    Outcome,
    RecordingEmitter,
    Refuse,
    Runtime,
    Session,
    Staged,
    StateMachine,
    StepApplied,
    StepContext,
    StepmachineError,
    StoredDataError,
    Task,
    TextDelta,
    ToolCallPart,
    ToolDefinition,
    ToolFinished,
    Tools,
    ToolStarted,
    UpdateData,
    Yield,
    Yielded,
    submit,
    tool,
)
from stepmachine._retry import (
    MAX_STALLED_CONFLICTS,
    Conflicts,
    retry_conflicts,
    retry_while_moving,
)
from stepmachine.extend import (
    INTERRUPTED,
    Batch,
    InterruptedReply,
    Recorder,
    YieldReason,
    counter_ids,
    history_problems,
    open_tool_calls,
    read_record,
)
from stepmachine.stores import MemoryStore
from stepmachine.testing import FunctionModel, ScriptedModel, call, reply

# Steps written for earlier releases still commit through ctx.commit: it works, with a
# DeprecationWarning (test_machine.py checks the warning itself).
pytestmark = pytest.mark.filterwarnings(
    "ignore:StepContext.commit is deprecated:DeprecationWarning"
)


class Flags(msgspec.Struct, frozen=True):
    """Application data for these tests."""

    done: tuple[str, ...] = ()
    go: bool = False


class Mark(Operation[Flags]):
    """Applies once: records its name in ``data.done``; logs every offer."""

    def __init__(self, name: str, offers: list[str], *, yield_after: bool = False) -> None:
        self._name = name
        self._offers = offers
        self._yield_after = yield_after

    @property
    def name(self) -> str:
        return self._name

    async def run(self, ctx: StepContext[Flags]) -> Outcome:
        self._offers.append(self._name)
        if self._name in ctx.session.data.done:
            return Refuse()
        effects = [UpdateData.set(done=(*ctx.session.data.done, self._name))]
        if self._yield_after:
            return Yield(effects, "checkpoint")
        return Continue(effects)


def fixed_clock() -> float:
    return 1_800_000_000.0


async def new_store(**create: Any) -> MemoryStore:
    store = MemoryStore(Codec(Flags))
    await store.create("s", **create)
    return store


# -- ordering -----------------------------------------------------------------------


async def test_first_applicable_step_wins_and_every_cycle_starts_from_the_top() -> None:
    offers: list[str] = []
    store = await new_store()
    machine = StateMachine([Mark("a", offers), Mark("b", offers), Mark("c", offers)])
    report = await machine.run_report(Runtime(store=store, clock=fixed_clock), "s")
    assert [r.step for r in report.results] == ["a", "b", "c"]
    # Cycle 1 offers a; cycle 2 starts again at a, then b; cycle 3: a, b, c; cycle 4: all refuse.
    assert offers == ["a", "a", "b", "a", "b", "c", "a", "b", "c"]
    assert report.reason.kind == YieldReason.IDLE
    assert report.session.data.done == ("a", "b", "c")
    assert report.session.revision == 3


async def test_yield_then_resume_by_calling_run_again() -> None:
    offers: list[str] = []
    store = await new_store()
    machine = StateMachine(
        [Mark("a", offers), Mark("b", offers, yield_after=True), Mark("c", offers)]
    )
    runtime = Runtime(store=store)
    first = await machine.run_report(runtime, "s")
    assert first.reason.kind == "checkpoint"
    assert first.session.data.done == ("a", "b")
    # A brand-new machine (as in a new process) continues where the session left off.
    second = await StateMachine(
        [Mark("a", []), Mark("b", [], yield_after=True), Mark("c", [])]
    ).run_report(runtime, "s")
    assert [r.step for r in second.results] == ["c"]
    assert second.session.data.done == ("a", "b", "c")
    assert second.reason.kind == YieldReason.IDLE


class WaitForGo(Operation[Flags]):
    """Yields awaiting an event until ``data.go`` is set, then records itself once."""

    name = "wait"

    async def run(self, ctx: StepContext[Flags]) -> Outcome:
        if "wait" in ctx.session.data.done:
            return Refuse()
        if not ctx.session.data.go:
            return Yield([], YieldReason(YieldReason.AWAITING_EVENT, "set go"))
        return Continue([UpdateData.set(done=(*ctx.session.data.done, "wait"))])


async def test_yield_without_effects_writes_nothing_and_resumes_after_external_change() -> None:
    store = await new_store()
    runtime = Runtime(store=store)
    machine = StateMachine([WaitForGo()])
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == YieldReason.AWAITING_EVENT
    assert report.session.revision == 0
    assert await store.batches("s") == []
    await submit(store, "s", [UpdateData.set(go=True)])
    report = await machine.run_report(runtime, "s")
    assert report.session.data.done == ("wait",)
    assert [b.step for b in await store.batches("s")] == ["application", "wait"]


class EmptyContinue(Operation[Any]):
    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Continue([])


async def test_continue_without_effects_is_an_error_not_a_busy_loop() -> None:
    store = await new_store()
    with pytest.raises(StepmachineError, match="Continue with no effects"):
        await StateMachine([EmptyContinue()]).run(Runtime(store=store), "s")


def test_step_names_must_be_unique() -> None:
    with pytest.raises(ConfigurationError, match="unique"):
        StateMachine([Mark("a", []), Mark("a", [])])
    with pytest.raises(ConfigurationError):
        StateMachine([])


# -- tools and inference in a whole run ------------------------------------------------


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_duplicated_tool_name_of_fixed_tools_is_a_configuration_error_when_built() -> None:
    with pytest.raises(ConfigurationError, match="'add' is advertised by both 't1' and 't2'"):
        StateMachine([Tools([add], name="t1"), Tools([add], name="t2"), ModelInference()])


class _AdvertisesAdd(Operation[Any]):
    """Tools that depend on the session: known only when a cycle collects them."""

    def tools(self, session: Session[Any]) -> Sequence[ToolDefinition]:
        return (add.definition,)

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Refuse("never runs anything")


async def test_duplicated_tool_name_is_a_configuration_error_before_any_model_call() -> None:
    store = await new_store(conversation=[Message.user("hi", id="u1")])
    model = ScriptedModel([reply("hello")])
    machine = StateMachine([Tools([add], name="t1"), _AdvertisesAdd(), ModelInference()])
    with pytest.raises(
        ConfigurationError, match=r"'add' is advertised by both 't1' and '_AdvertisesAdd'.*name="
    ):
        await machine.run(Runtime(store=store, model=model), "s")
    assert model.requests == []
    assert (await store.load("s")).revision == 0


async def test_audit_log_records_step_cycle_and_clock() -> None:
    store = await new_store(conversation=[Message.user("2+3?", id="u1")])
    model = ScriptedModel([call(("add", {"a": 2, "b": 3})), reply("5")])
    machine = StateMachine([Tools([add]), ModelInference()])
    emitter = RecordingEmitter()
    runtime = Runtime(store=store, model=model, clock=fixed_clock, ids=counter_ids())
    session = await machine.run(runtime, "s", emitter)
    assert session.conversation[-1].text == "5"
    batches = await store.batches("s")
    assert [(b.step, b.cycle, b.revision) for b in batches] == [
        ("inference", 1, 1),
        ("tools", 2, 2),  # the journal's intent record, before the tool ran
        ("tools", 2, 3),  # the result, committed as soon as it existed
        ("inference", 3, 4),
    ]
    assert {b.timestamp for b in batches} == {fixed_clock()}
    applied = emitter.of_type(StepApplied)
    assert [(e.step, e.new_revision, e.status) for e in applied] == [
        ("inference", 1, "continue"),
        ("tools", 2, "committed"),
        ("tools", 3, "continue"),  # the last batch of the cycle says how it ended
        ("inference", 4, "yielded"),
    ]
    assert emitter.of_type(Yielded) == [Yielded("done")]
    # Events carry the revision they follow, and seq restarts after each batch.
    for event in emitter.events:
        if isinstance(event.data, StepApplied):
            assert event.revision == event.data.new_revision - 1
    by_revision: dict[int, list[int]] = {}
    for event in emitter.events:
        by_revision.setdefault(event.revision, []).append(event.seq)
    assert all(seqs == list(range(len(seqs))) for seqs in by_revision.values())
    model.assert_all_used()


async def test_one_debug_log_record_per_cycle(caplog: pytest.LogCaptureFixture) -> None:
    offers: list[str] = []
    store = await new_store()
    machine = StateMachine([Mark("a", offers), Mark("b", offers)])
    with caplog.at_level(logging.DEBUG, logger="stepmachine"):
        await machine.run(Runtime(store=store), "s")
    # Each record's message is the event dict (structlog's wrap_for_formatter form).
    events = [r.msg for r in caplog.records if r.name == "stepmachine" and isinstance(r.msg, dict)]
    cycles = [e for e in events if e["event"] == "cycle"]
    assert len(cycles) == 3  # a applies, b applies, nobody applies
    assert cycles[0]["step"] == "a"
    assert cycles[1]["step"] == "b"
    assert [r["step"] for r in cycles[1]["refused"]] == ["a"]
    assert cycles[2]["outcome"] == "idle"
    assert [r["step"] for r in cycles[2]["refused"]] == ["a", "b"]


# -- invariant 1: a fresh machine per cycle decides the same --------------------------------


@tool
def echo(text: str) -> str:
    """Echo the text."""
    return text


@tool
async def fail(reason: str) -> str:
    """Always fails."""
    await anyio.lowlevel.checkpoint()
    raise RuntimeError(reason)


tool_calls = st.one_of(
    st.tuples(st.just("echo"), st.fixed_dictionaries({"text": st.text(max_size=5)})),
    st.tuples(st.just("fail"), st.fixed_dictionaries({"reason": st.text(max_size=5)})),
    st.tuples(st.just("add"), st.fixed_dictionaries({"a": st.integers(), "b": st.just("x")})),
    st.tuples(st.just("nope"), st.just({})),
)
turns = st.lists(
    st.one_of(
        st.text(max_size=10).map(reply),
        st.lists(tool_calls, min_size=1, max_size=3).map(lambda cs: call(*cs)),
    ),
    max_size=5,
).map(lambda ts: [*ts, reply("bye")])


def agent() -> StateMachine[Any]:
    # One call at a time: concurrent tools commit their results in completion order, which
    # depends on the scheduler, not on the machine; invariant 1 is about the machine.
    return StateMachine(
        [Tools([echo, fail, add], max_concurrency=1), ModelInference(instructions="be nice")]
    )


async def run_long(script: list[ModelResponse]) -> list[tuple[str, tuple[Effect, ...]]]:
    store = await new_store(conversation=[Message.user("go", id="u1")])
    runtime = Runtime(
        store=store, model=ScriptedModel(script), ids=counter_ids(), clock=fixed_clock
    )
    await agent().run(runtime, "s")
    return [(b.step, b.effects) for b in await store.batches("s")]


async def run_fresh_each_cycle(script: list[ModelResponse]) -> list[tuple[str, tuple[Effect, ...]]]:
    store = await new_store(conversation=[Message.user("go", id="u1")])
    runtime = Runtime(
        store=store, model=ScriptedModel(script), ids=counter_ids(), clock=fixed_clock
    )
    for cycle in range(1, 100):
        machine = agent()  # new machine, new step objects, session reloaded from the store
        session = await store.load("s")
        decision = await machine.step(runtime, session, cycle=cycle)
        if decision is None:
            break
        _, result = await machine.apply(runtime, session, decision, cycle=cycle)
        if result.status == "yielded":
            break
    return [(b.step, b.effects) for b in await store.batches("s")]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=turns)
async def test_fresh_machine_every_cycle_gives_the_same_effects(
    script: list[ModelResponse],
) -> None:
    long_lived = await run_long(script)
    fresh = await run_fresh_each_cycle(script)
    assert fresh == long_lived
    assert long_lived[-1][0] == "inference"


# -- invariant 3: concurrent machines on one session ------------------------------------------


class AppendOwn(Operation[Any]):
    """Appends messages ``<writer>-0`` .. ``<writer>-<count-1>``, deciding from the session."""

    def __init__(self, writer: str, count: int) -> None:
        self._writer = writer
        self._count = count

    @property
    def name(self) -> str:
        return self._writer

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        mine = sum(1 for m in ctx.session.conversation if m.id.startswith(f"{self._writer}-"))
        if mine >= self._count:
            return Refuse()
        await anyio.lowlevel.checkpoint()  # let other writers interleave
        message = Message.user(f"{self._writer} #{mine}", id=f"{self._writer}-{mine}")
        return Continue([AppendMessage(message)])


class CountingConflicts:
    """Wraps a store and counts the conflicts it reports."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.conflicts = 0

    async def load(self, session_id: str) -> Session[Any]:
        return await self.store.load(session_id)

    async def apply(self, batch: Batch[Effect]) -> None:
        try:
            await self.store.apply(batch)
        except ConflictError:
            self.conflicts += 1
            raise


async def test_concurrent_machines_on_one_session_lose_no_update() -> None:
    store = await new_store()
    counting = CountingConflicts(store)
    writers, count = 8, 10
    runtime = Runtime(loader=counting, handler=counting)

    async def writer(number: int) -> None:
        machine = StateMachine([AppendOwn(f"w{number}", count)], max_conflicts=10_000)
        await machine.run(runtime, "s")

    async with anyio.create_task_group() as tg:
        for number in range(writers):
            tg.start_soon(writer, number)

    session = await store.load("s")
    ids = sorted(m.id for m in session.conversation)
    assert ids == sorted(f"w{n}-{i}" for n in range(writers) for i in range(count))
    assert session.revision == writers * count
    assert counting.conflicts > 0  # the writers really did race
    batches = await store.batches("s")
    assert [b.revision for b in batches] == list(range(1, writers * count + 1))


class AlwaysConflicting:
    """A handler whose every apply loses the race."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    async def load(self, session_id: str) -> Session[Any]:
        return await self.store.load(session_id)

    async def apply(self, batch: Batch[Effect]) -> None:
        raise ConflictError(batch.session_id, batch.revision - 1, batch.revision)


async def test_conflicts_are_bounded_and_never_overwrite() -> None:
    store = await new_store()
    offers: list[str] = []
    handler = AlwaysConflicting(store)
    machine = StateMachine([Mark("a", offers)], max_conflicts=3)
    with pytest.raises(ConflictError):
        await machine.run(Runtime(loader=handler, handler=handler), "s")
    assert offers == ["a"] * 4  # re-stepped after each of the 3 tolerated conflicts
    assert (await store.load("s")).revision == 0


# -- cancellation: every await point -----------------------------------------------------------


@tool
async def slow_echo(text: str) -> str:
    """Echo after a few awaits."""
    for _ in range(3):
        await anyio.lowlevel.checkpoint()
    return text


def cancellation_script() -> list[ModelResponse]:
    return [
        call(("slow_echo", {"text": "one"}), ("echo", {"text": "two"}), text="calling tools"),
        call(("slow_echo", {"text": "three"})),
        reply("all done, thanks for waiting"),
    ]


def assert_history_valid(session: Session[Any]) -> None:
    assert history_problems(session.conversation) == []
    assert open_tool_calls(session.conversation) == []
    results: dict[str, int] = {}
    for message in session.conversation:
        for result in message.tool_results:
            results[result.call_id] = results.get(result.call_id, 0) + 1
    calls = [c.call_id for m in session.conversation for c in m.tool_calls]
    assert sorted(results) == sorted(calls)
    assert set(results.values()) <= {1}


async def cancelled_run(ticks: int, *, outside: bool) -> tuple[bool, MemoryStore]:
    """Run the script, cancelling after ``ticks`` scheduler steps. True if it was cancelled."""
    store = await new_store(conversation=[Message.user("go", id="u1")])
    token = CancelToken()
    machine = StateMachine(
        [Tools([slow_echo, echo]), ModelInference()],
        cancel=None if outside else token,
    )
    runtime = Runtime(store=store, model=ScriptedModel(cancellation_script()), ids=counter_ids())
    cancelled = False
    async with anyio.create_task_group() as tg:
        scope = tg.cancel_scope if outside else None

        async def canceller() -> None:
            for _ in range(ticks):
                await anyio.lowlevel.checkpoint()
            if scope is not None:
                scope.cancel()
            else:
                token.cancel("test")

        async def runner() -> None:
            nonlocal cancelled
            report = await machine.run_report(runtime, "s")
            cancelled = report.reason.kind == YieldReason.CANCELLED
            tg.cancel_scope.cancel()  # stop the canceller

        tg.start_soon(runner)
        tg.start_soon(canceller)
    if outside:
        cancelled = not (await store.load("s")).conversation[-1].text.startswith("all done")
    return cancelled, store


@pytest.mark.parametrize("outside", [False, True], ids=["token", "outside"])
async def test_cancelling_at_every_await_point_leaves_a_valid_history(outside: bool) -> None:
    cancelled_runs = 0
    for ticks in range(400):
        cancelled, store = await cancelled_run(ticks, outside=outside)
        session = await store.load("s")
        assert_history_valid(session)
        if not cancelled:
            break
        cancelled_runs += 1
        # Every interrupted call got exactly the interrupted error, nothing else was invented.
        for message in session.conversation:
            for result in message.tool_results:
                if result.content == INTERRUPTED:
                    assert result.is_error
        # And the session can always be resumed to a valid end.
        resume = StateMachine([Tools([slow_echo, echo]), ModelInference()])
        model = FunctionModel(lambda request: reply("resumed"))
        resumed = await resume.run(Runtime(store=store, model=model, ids=counter_ids("r")), "s")
        assert_history_valid(resumed)
    else:
        pytest.fail("the run never completed within 400 ticks")
    assert cancelled_runs > 20  # the sweep really did cut the run at many points


class CancelOn:
    """An emitter that fires a token on the n-th event of a given type."""

    def __init__(self, token: CancelToken, kind: type[Any], nth: int = 1) -> None:
        self.token = token
        self.kind = kind
        self.nth = nth
        self.seen = 0

    async def emit(self, event: Any) -> None:
        if isinstance(event.data, self.kind):
            self.seen += 1
            if self.seen == self.nth:
                self.token.cancel("user pressed stop")


async def test_cancel_mid_stream_keeps_the_partial_text() -> None:
    store = await new_store(conversation=[Message.user("tell me a story", id="u1")])
    token = CancelToken()
    machine = StateMachine([ModelInference()], cancel=token)
    model = ScriptedModel([reply("Once upon a time, in a land far away")], chunk_size=5)
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    report = await machine.run_report(runtime, "s", CancelOn(token, TextDelta, nth=2))
    assert report.reason == YieldReason(YieldReason.CANCELLED, "user pressed stop")
    assert report.results[-1].status == "cancelled"
    last = report.session.conversation[-1]
    assert last.role == "assistant"
    assert last.text == "Once upon "
    assert list(last.notes) == ["inference"]
    kept = read_record(last.notes, "inference", InterruptedReply)
    assert kept is not None
    assert kept.interrupted
    assert [b.step for b in await store.batches("s")] == ["inference"]


@tool
async def forever() -> str:
    """Never finishes."""
    await anyio.sleep_forever()
    return "unreachable"


async def test_cancel_keeps_finished_tool_results_and_interrupts_the_rest() -> None:
    model = ScriptedModel([call(("echo", {"text": "fast"}), ("forever", {}))])
    store = await new_store(conversation=[Message.user("go", id="u1")])
    token = CancelToken()
    machine = StateMachine([Tools([echo, forever]), ModelInference()], cancel=token)
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    report = await machine.run_report(runtime, "s", CancelOn(token, ToolFinished))
    assert report.reason.kind == YieldReason.CANCELLED
    results = {
        r.call_id: (r.content, r.is_error)
        for m in report.session.conversation
        for r in m.tool_results
    }
    assert results == {"call-0-0": ("fast", False), "call-0-1": (INTERRUPTED, True)}
    assert [b.step for b in await store.batches("s")] == [
        "inference",
        "tools",  # intents
        "tools",  # the fast result, committed before the cancellation
        "stepmachine.finalize",
    ]
    assert_history_valid(report.session)


class StuckFinalize(Operation[Any]):
    """Applies by hanging (``started`` is set then); its finalize hangs too."""

    def __init__(self) -> None:
        self.started = anyio.Event()

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        self.started.set()
        await anyio.sleep_forever()
        return Refuse()

    async def finalize(self, ctx: StepContext[Any], *, interrupted: bool) -> Sequence[Effect]:
        await anyio.sleep_forever()
        return ()


async def test_outside_cancellation_bounds_finalize_in_time() -> None:
    store = await new_store()
    stuck = StuckFinalize()
    machine = StateMachine([stuck], finalize_timeout=0.05)
    async with anyio.create_task_group() as tg:

        async def cancel_once_stuck() -> None:
            await stuck.started.wait()
            tg.cancel_scope.cancel()  # from outside, while the step hangs

        tg.start_soon(cancel_once_stuck)
        await machine.run(Runtime(store=store), "s")
    # Reaching this line at all proves finalize was bounded: it would hang forever.
    assert tg.cancel_scope.cancelled_caught


class CancelAtCommit:
    """An emitter that cancels ``scope`` at the n-th batch a step commits itself."""

    def __init__(self, scope: anyio.CancelScope, nth: int) -> None:
        self.scope = scope
        self.nth = nth
        self.commits = 0
        self.started: list[str] = []

    async def emit(self, event: Any) -> None:
        if isinstance(event.data, ToolStarted):
            self.started.append(event.data.name)
        if isinstance(event.data, StepApplied) and event.data.status == "committed":
            self.commits += 1
            if self.commits == self.nth:
                self.scope.cancel()


async def test_callers_driving_step_and_apply_finalize_themselves() -> None:
    model = ScriptedModel([call(("forever", {}), ("echo", {"text": "x"}))])
    store = await new_store(conversation=[Message.user("go", id="u1")])
    machine = StateMachine([Tools([echo, forever]), ModelInference()])
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    session = await store.load("s")
    decision = await machine.step(runtime, session)
    assert decision is not None
    session, _ = await machine.apply(runtime, session, decision)
    with anyio.CancelScope() as scope:
        # The machine writes the tools step's intents, then echo's result, while `forever`
        # hangs: cancel at the second write, which echo's result made (no timing involved).
        watch = CancelAtCommit(scope, nth=2)
        decision = await machine.step(runtime, session, watch)
        assert decision is not None
        await machine.apply(runtime, session, decision)
    assert scope.cancelled_caught
    assert "echo" in watch.started
    assert len(open_tool_calls((await store.load("s")).conversation)) == 1
    final = await machine.finalize(runtime, "s", interrupted=decision)
    assert_history_valid(final)
    results = {r.call_id: r.content for m in final.conversation for r in m.tool_results}
    # The echo finished and its result was committed at once; `forever` was interrupted.
    assert results == {"call-0-0": INTERRUPTED, "call-0-1": "x"}


# -- invariant 8 at the machine boundary ----------------------------------------------------------


async def test_unknown_effect_tag_in_the_log_gives_a_clear_error() -> None:
    store = await new_store(conversation=[Message.user("hi", id="u1")])
    await submit(store, "s", [UpdateData.set(go=True)])
    codec = store.codec
    (raw,) = [codec.encode_batch(b) for b in await store.batches("s")]
    tampered = raw.replace(b'"update_data"', b'"myapp.unheard_of"')
    with pytest.raises(StoredDataError) as info:
        codec.decode_batch(tampered, where="session 's' revision 1")
    message = str(info.value)
    assert "myapp.unheard_of" in message
    assert "session 's' revision 1" in message
    assert "stored data is data" in message


async def test_history_error_stops_the_run_before_the_model_is_called() -> None:
    duplicate = ToolCallPart.of("same", "echo", {"text": "a"})
    conversation = [
        Message.user("go", id="u1"),
        Message(id="a1", role="assistant", parts=(duplicate, duplicate)),
    ]
    store = await new_store(conversation=conversation)
    model = FunctionModel(lambda request: reply("never"))
    machine = StateMachine([Tools([echo]), ModelInference()])
    with pytest.raises(StepmachineError, match="valid history"):
        await machine.run(Runtime(store=store, model=model, ids=counter_ids()), "s")
    assert model.calls == 0


async def test_a_request_is_built_from_the_stored_session_only() -> None:
    seen: list[ModelRequest] = []

    def answer(request: ModelRequest) -> ModelResponse:
        seen.append(request)
        return reply("ok")

    hidden = msgspec.structs.replace(Message.user("secret", id="h"), visible_to_model=False)
    store = await new_store(conversation=[hidden, Message.user("hi", id="u1")])
    machine = StateMachine([Tools([echo]), ModelInference(instructions="Be brief.")])
    await machine.run(Runtime(store=store, model=FunctionModel(answer), ids=counter_ids()), "s")
    (request,) = seen
    assert [m.id for m in request.messages] == ["u1"]
    assert [t.name for t in request.tools] == ["echo"]
    assert request.system_prompt == "Be brief."


class Broken:
    """An emitter whose client is gone."""

    async def emit(self, event: Any) -> None:
        raise ConnectionResetError("client went away")


async def test_an_emitter_that_raises_never_fails_the_run(caplog: pytest.LogCaptureFixture) -> None:
    store = await new_store(conversation=[Message.user("2+3?", id="u1")])
    model = ScriptedModel([call(("add", {"a": 2, "b": 3})), reply("5")])
    machine = StateMachine([Tools([add]), ModelInference()])
    with caplog.at_level(logging.WARNING, logger="stepmachine"):
        session = await machine.run(Runtime(store=store, model=model), "s", Broken())
    assert session.conversation[-1].text == "5"
    warnings = [r for r in caplog.records if "emitter" in r.getMessage()]
    assert len(warnings) == 1  # logged once, not once per event


class CommitThenRefuse(Operation[Flags]):
    """Records a note through ctx.commit, then refuses."""

    name = "committer"

    async def run(self, ctx: StepContext[Flags]) -> Outcome:
        if "committer" in ctx.session.data.done:
            return Refuse()
        await ctx.commit([UpdateData.set(done=(*ctx.session.data.done, "committer"))])
        return Refuse("nothing more to do")


async def test_a_step_that_committed_and_refused_restarts_the_cycle() -> None:
    offers: list[str] = []
    store = await new_store()
    machine = StateMachine([Mark("a", offers), CommitThenRefuse(), Mark("b", offers)])
    report = await machine.run_report(Runtime(store=store), "s")
    assert report.session.data.done == ("a", "committer", "b")
    # No conflict: after the commit the cycle restarted from the top with the new session.
    assert [b.step for b in await store.batches("s")] == ["a", "committer", "b"]
    assert [r.step for r in report.results] == ["a", "committer", "b"]


@pytest.mark.filterwarnings("error::DeprecationWarning")
async def test_ctx_commit_still_works_and_says_it_is_deprecated() -> None:
    store = await new_store()
    machine = StateMachine([CommitThenRefuse()])
    with pytest.warns(DeprecationWarning, match=r"return Staged\(intents, tasks\)"):
        report = await machine.run_report(Runtime(store=store), "s")
    assert report.session.data.done == ("committer",)
    assert [b.step for b in await store.batches("s")] == ["committer"]


class StagedNote(Operation[Flags]):
    """Staged work of its own: an intent, a task, its record; the machine writes all three."""

    name = "staged"

    def __init__(self, finished: list[str]) -> None:
        self.finished = finished

    async def run(self, ctx: StepContext[Flags]) -> Outcome | Staged:
        if "staged" in ctx.session.data.done:
            return Refuse("done")

        async def work() -> Recorder:
            self.finished.append("work")

            def record(session: Session[Any]) -> list[Effect]:
                return [UpdateData.set(done=(*session.data.done, "staged"))]

            return record

        intent = UpdateData.set(done=(*ctx.session.data.done, "intent"))
        return Staged([intent], [Task("work", work)])


async def test_a_third_party_step_gets_staged_work_written_by_the_machine() -> None:
    store = await new_store()
    finished: list[str] = []
    report = await StateMachine([StagedNote(finished)]).run_report(Runtime(store=store), "s")
    assert finished == ["work"]
    assert report.session.data.done == ("intent", "staged")
    assert [b.step for b in await store.batches("s")] == ["staged", "staged"]
    (result,) = report.results
    assert result.status == "continue"
    assert len(result.effects) == 2  # every effect the machine wrote in the cycle
    assert report.reason.kind == YieldReason.IDLE


# -- the compare-and-set retry helper ------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    conflicts=st.lists(st.booleans(), max_size=8),
    tolerated=st.integers(min_value=0, max_value=6),
)
async def test_conflicts_retry_reloads_after_each_conflict_and_spends_its_budget(
    conflicts: list[bool], tolerated: int
) -> None:
    """Attempt ``i`` conflicts when ``conflicts[i]``; every attempt sees the latest reload."""
    start = Session(id="s", revision=0, data=Flags(), conversation=())
    seen: list[int] = []
    reloads: list[int] = []

    async def attempt(session: Session[Flags]) -> int:
        seen.append(session.revision)
        if len(seen) <= len(conflicts) and conflicts[len(seen) - 1]:
            raise ConflictError(session.id, session.revision, session.revision + 1)
        return len(seen)

    async def reload(session_id: str) -> Session[Flags]:
        reloads.append(len(seen))
        return Session(id=session_id, revision=len(reloads), data=Flags(), conversation=())

    budget = Conflicts(tolerated)
    first_success = next((i for i, c in enumerate(conflicts) if not c), len(conflicts))
    if first_success <= tolerated:
        assert await budget.retry(start, attempt, reload) == first_success + 1
        assert budget.left == tolerated - first_success
    else:
        with pytest.raises(ConflictError):
            await budget.retry(start, attempt, reload)
        assert budget.left == 0
    attempts = min(first_success, tolerated) + 1
    assert seen == list(range(attempts))  # attempt n saw the n-th reload, never a stale one
    assert reloads == list(range(1, attempts))


async def test_one_conflict_budget_is_shared_by_every_retry_that_uses_it() -> None:
    start = Session(id="s", revision=0, data=Flags(), conversation=())

    async def conflict(session: Session[Flags]) -> None:
        raise ConflictError(session.id, session.revision, session.revision + 1)

    async def reload(session_id: str) -> Session[Flags]:
        return start

    budget = Conflicts(3)
    with pytest.raises(ConflictError):
        await budget.retry(start, conflict, reload)
    with pytest.raises(ConflictError):  # spent: the first conflict of the next retry propagates
        await budget.retry(start, conflict, reload)
    with pytest.raises(ValueError, match="at least 1, got 0"):
        await retry_conflicts(start, conflict, reload, attempts=0)


@settings(max_examples=200, deadline=None)
@given(
    moves=st.lists(st.booleans(), max_size=3 * MAX_STALLED_CONFLICTS),
)
async def test_retry_while_moving_gives_up_only_on_conflicts_the_store_does_not_explain(
    moves: list[bool],
) -> None:
    """Every attempt but the last conflicts; after conflict ``i`` the reload shows another
    writer's batch when ``moves[i]``. Any number of explained conflicts is retried; the
    (MAX_STALLED_CONFLICTS + 1)-th unexplained one in a row raises."""
    revision = [0]
    seen: list[int] = []

    async def attempt(session: Session[Flags]) -> int:
        seen.append(session.revision)
        if len(seen) <= len(moves):
            raise ConflictError(session.id, session.revision, revision[0])
        return len(seen)

    async def reload(session_id: str) -> Session[Flags]:
        if moves[len(seen) - 1]:
            revision[0] += 1
        return Session(id=session_id, revision=revision[0], data=Flags(), conversation=())

    start = Session(id="s", revision=0, data=Flags(), conversation=())
    stalled, gave_up_after = 0, None
    for index, moved in enumerate(moves):
        stalled = 0 if moved else stalled + 1
        if stalled > MAX_STALLED_CONFLICTS:
            gave_up_after = index + 1
            break
    if gave_up_after is None:
        assert await retry_while_moving(start, attempt, reload) == len(moves) + 1
    else:
        with pytest.raises(ConflictError):
            await retry_while_moving(start, attempt, reload)
        assert len(seen) == gave_up_after
    assert seen == sorted(seen)  # every attempt saw the latest reload


# -- finalize takes one argument: the decision whose apply was cancelled ---------------------


class FinalizeLog(Operation[Flags]):
    """Applies once (like ``Mark``), keeps a scratch value, and logs every ``finalize``."""

    def __init__(self, name: str, log: list[tuple[str, bool, object]], *, apply: bool) -> None:
        self._name = name
        self._log = log
        self._apply = apply

    @property
    def name(self) -> str:
        return self._name

    async def run(self, ctx: StepContext[Flags]) -> Outcome:
        ctx.scratch["mine"] = self._name
        if not self._apply or self._name in ctx.session.data.done:
            return Refuse()
        return Continue([UpdateData.set(done=(*ctx.session.data.done, self._name))])

    async def finalize(self, ctx: StepContext[Flags], *, interrupted: bool) -> Sequence[Effect]:
        self._log.append((self._name, interrupted, ctx.scratch.get("mine")))
        return ()


def test_finalize_takes_one_argument_for_the_interrupted_step() -> None:
    import inspect

    parameters = inspect.signature(StateMachine.finalize).parameters
    assert "interrupted_step" not in parameters
    assert parameters["interrupted"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.filterwarnings("ignore:StepContext.scratch is deprecated:DeprecationWarning")
async def test_finalize_with_the_decision_whose_apply_was_cancelled() -> None:
    store = await new_store()
    log: list[tuple[str, bool, object]] = []
    machine = StateMachine([FinalizeLog("a", log, apply=True), FinalizeLog("b", log, apply=True)])
    runtime = Runtime(store=store)
    decision = await machine.step(runtime, await store.load("s"))
    assert decision is not None
    await machine.finalize(runtime, "s", interrupted=decision)
    # The decided step keeps what it had, with its cycle's scratch; the other one is told
    # nothing was interrupted, and runs with a fresh ctx.
    assert log == [("a", True, "a"), ("b", False, None)]


class BlockingLoads:
    """A store wrapper: ``hold_load`` / ``hold_apply`` (1-based) never return; others pass."""

    def __init__(self, store: MemoryStore, *, hold_load: int = 0, hold_apply: int = 0) -> None:
        self.store = store
        self.hold_load = hold_load
        self.hold_apply = hold_apply
        self.loads = 0
        self.applies = 0
        self.holding = anyio.Event()

    async def load(self, session_id: str) -> Session[Any]:
        self.loads += 1
        if self.loads == self.hold_load:
            self.holding.set()
            await anyio.sleep_forever()
        return await self.store.load(session_id)

    async def apply(self, batch: Batch[Effect]) -> Session[Any] | None:
        self.applies += 1
        if self.applies == self.hold_apply:
            self.holding.set()
            await anyio.sleep_forever()
        return await self.store.apply(batch)


async def run_until_held(machine: StateMachine[Flags], blocking: BlockingLoads) -> None:
    runtime = Runtime(loader=blocking, handler=blocking)
    async with anyio.create_task_group() as tg:

        async def cancel_when_held() -> None:
            await blocking.holding.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(cancel_when_held)
        await machine.run(runtime, "s")
    assert tg.cancel_scope.cancelled_caught


@pytest.mark.filterwarnings("ignore:StepContext.scratch is deprecated:DeprecationWarning")
async def test_an_outside_cancellation_while_applying_finalizes_the_deciding_step() -> None:
    store = await new_store()
    log: list[tuple[str, bool, object]] = []
    machine = StateMachine([FinalizeLog("a", log, apply=True), FinalizeLog("b", log, apply=True)])
    await run_until_held(machine, BlockingLoads(store, hold_apply=1))
    assert log == [("a", True, "a"), ("b", False, None)]


class ConflictOnce(Operation[Flags]):
    """Decides to mark itself, but another writer gets in first (the first time only)."""

    def __init__(self, store: MemoryStore, log: list[tuple[str, bool, object]]) -> None:
        self._store = store
        self._log = log
        self._raced = False

    async def run(self, ctx: StepContext[Flags]) -> Outcome:
        ctx.scratch["mine"] = "stale"
        if not self._raced:
            self._raced = True
            await submit(self._store, "s", [UpdateData.set(go=True)], clock=fixed_clock)
        return Continue([UpdateData.set(done=("x",))])

    async def finalize(self, ctx: StepContext[Flags], *, interrupted: bool) -> Sequence[Effect]:
        self._log.append((self.name, interrupted, ctx.scratch.get("mine")))
        return ()


@pytest.mark.filterwarnings("ignore:StepContext.scratch is deprecated:DeprecationWarning")
async def test_a_cancellation_after_a_conflict_does_not_finalize_the_stale_decision() -> None:
    """The decision lost its race and was dropped: nothing of it is "interrupted" any more.

    The machine reloads after the conflict; cancelled there, no step is running, so
    every step gets ``finalize(interrupted=False)`` -- none sees the stale cycle's ctx.
    """
    store = await new_store()
    log: list[tuple[str, bool, object]] = []
    # loads: 1 = the run's first, 2 = the reload after the conflict (held there)
    blocking = BlockingLoads(store, hold_load=2)
    machine = StateMachine([ConflictOnce(store, log), FinalizeLog("b", log, apply=False)])
    await run_until_held(machine, blocking)
    assert log == [("ConflictOnce", False, None), ("b", False, None)]
    assert (await store.load("s")).data == Flags(go=True)


class _ReturnsTheSessionBefore:
    """A third-party handler that stores the batch but returns the session *before* it."""

    def __init__(self) -> None:
        self.inner = MemoryStore()

    async def load(self, session_id: str) -> Session[Any]:
        return await self.inner.load(session_id)

    async def apply(self, batch: Batch[Any]) -> Session[Any] | None:
        before = await self.inner.load(batch.session_id)
        await self.inner.apply(batch)
        return before


class _DeclaresAndReturnsTheSessionBefore(_ReturnsTheSessionBefore):
    applies_batches = True


@pytest.mark.parametrize(
    "handler_type", [_ReturnsTheSessionBefore, _DeclaresAndReturnsTheSessionBefore]
)
async def test_a_handler_returning_a_session_of_another_revision_is_an_error(
    handler_type: type[_ReturnsTheSessionBefore],
) -> None:
    """A machine given a stale session by ``apply`` reported revision 0 with no reply, silently.

    ``apply`` must return the session *after* the batch (or ``None``); one that
    does not is a broken handler, said at once instead of a run that decides
    from a session the store no longer holds (invariant 1).
    """
    handler = handler_type()
    await handler.inner.create("s", conversation=[Message.user("hi", id="u")])
    machine = StateMachine([ModelInference()])
    runtime = Runtime(
        loader=handler, handler=handler, model=ScriptedModel([reply("a")]), ids=counter_ids()
    )
    with pytest.raises(ConfigurationError, match="at revision 0 for the batch producing"):
        await machine.run(runtime, "s")


# -- at the edges, as a user meets them ----------------------------------------


def test_a_tool_name_advertised_by_two_steps_is_refused_when_the_machine_is_built() -> None:
    @tool
    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    @tool(name="add")
    def add_again(a: int) -> int:
        """Also add."""
        return a

    with pytest.raises(ConfigurationError, match=r"'add'.*name="):
        StateMachine(
            [Tools([add], name="maths"), Tools([add_again], name="more"), ModelInference()]
        )


@tool
def _add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.mark.parametrize("mistake", ["a tool", "a step class"])
def test_something_that_is_not_a_step_is_refused_when_the_machine_is_built(mistake: str) -> None:
    wrong: Any = _add if mistake == "a tool" else ModelInference
    with pytest.raises(ConfigurationError, match=r"Tools\(\[|ModelInference\(\)"):
        StateMachine([wrong])
