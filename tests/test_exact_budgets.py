"""Exact budgets across failures and crashes (invariant 7): every model request sent counts.

``ModelInference``'s call is staged work. A request whose attempts are capped
(``max_attempts``, as ``Budget`` sets it) first reserves its calls on the last
message, in a batch of its own; its reply or failure replaces the
reservation with the calls made; a crash in between leaves the reservation,
and it stays counted. Tested here with the records themselves, and with a
real process SIGKILLed while its model request is under way.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stepmachine import (
    Annotate,
    AppendMessage,
    CancelToken,
    ContextLengthError,
    Message,
    ModelError,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    StateMachine,
    StepApplied,
    StoredDataError,
    TextDelta,
    Tools,
    Usage,
    submit,
    tool,
)
from stepmachine._model_call import attempt_started, reserved_calls
from stepmachine.extend import (
    InferenceAttempts,
    InferenceReceipt,
    YieldReason,
    counter_ids,
    latest_ledger,
    next_ledger,
    note_value,
    read_record,
)
from stepmachine.operations import Budget, Compaction, Limits, budget_usage
from stepmachine.providers import OpenAIChatModel, RetryPolicy
from stepmachine.stores import MemoryStore, SQLiteStore
from stepmachine.testing import FunctionModel, ScriptedModel, make_session, reply, run_step

ROOT = Path(__file__).resolve().parent.parent


def long_history() -> list[Message]:
    """Six long turns and a question: enough for ``Compaction(threshold=10)`` to summarise."""
    history = [
        message
        for turn in range(6)
        for message in (
            Message.user(f"question {turn} " + "word " * 100, id=f"u{turn}"),
            Message.assistant(f"answer {turn} " + "word " * 100, id=f"a{turn}"),
        )
    ]
    return [*history, Message.user("and now?", id="u9")]


def attempts_on(message: Message) -> InferenceAttempts | None:
    return read_record(message.notes, "inference", InferenceAttempts, where="test")


async def test_a_budgeted_request_reserves_its_calls_before_it_is_sent() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u0")])
    seen: list[InferenceAttempts | None] = []

    async def model(request: ModelRequest) -> ModelResponse:
        stored = await store.load("s")  # what a crash right now would leave
        seen.append(attempts_on(stored.conversation[-1]))
        return reply("hi")

    runtime = Runtime(store=store, model=FunctionModel(model), ids=counter_ids())
    machine = StateMachine([Budget(per_session=Limits(model_calls=3)), ModelInference()])
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == YieldReason.DONE
    (during,) = seen
    assert during is not None
    assert (during.attempts, during.reserved) == (3, 3)  # every call the request may make
    assert during.ledger is not None
    assert during.ledger.session.model_calls == 3
    session = await store.load("s")
    after = attempts_on(session.conversation[0])
    assert after is not None
    assert (after.attempts, after.reserved) == (0, 0)
    view = latest_ledger(session)
    assert view.ledger is not None
    assert view.ledger.session.model_calls == 1
    receipt = read_record(session.conversation[-1].notes, "inference", InferenceReceipt)
    assert receipt is not None
    assert receipt.attempts == 1
    # the reservation is one batch of its own, before the reply's
    batches = await store.batches("s")
    assert [b.step for b in batches] == ["inference", "inference"]
    (reservation,) = batches[0].effects
    assert isinstance(reservation, Annotate)
    assert reservation.values["reserved"] == 3
    assert isinstance(batches[1].effects[-1], AppendMessage)


class FewAttempts(FunctionModel):
    """A model that says one request makes at most ``max_attempts`` attempts."""

    max_attempts = 2


@pytest.mark.parametrize(("declared", "left", "reserved"), [(2, 10, 2), (2, 1, 1), (None, 5, 5)])
async def test_the_reservation_is_no_more_than_the_model_can_send(
    declared: int | None, left: int, reserved: int
) -> None:
    """A crash while the request is under way costs the budget what the model could have
    sent (an HTTP adapter's retry policy), not every call left."""
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u0")])
    model = FunctionModel(lambda request: reply("hi"))
    if declared is not None:
        model = FewAttempts(lambda request: reply("hi"))
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    machine = StateMachine([Budget(per_session=Limits(model_calls=left)), ModelInference()])
    await machine.run_report(runtime, "s")
    (reservation,) = (await store.batches("s"))[0].effects
    assert isinstance(reservation, Annotate)
    assert reservation.values["reserved"] == reserved


def test_an_http_adapter_says_how_many_attempts_a_request_makes() -> None:
    adapter = OpenAIChatModel("gpt-test", api_key="sk-test", retry=RetryPolicy(max_attempts=3))
    assert adapter.max_attempts == 3
    assert reserved_calls(adapter, 10) == 3
    assert reserved_calls(adapter, 2) == 2
    assert reserved_calls(object(), 0) == 1  # a model is asked at least once
    assert reserved_calls(adapter, None) is None


async def test_an_unbudgeted_request_writes_one_batch() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u0")])
    runtime = Runtime(store=store, model=FunctionModel(lambda r: reply("hi")), ids=counter_ids())
    await StateMachine([ModelInference()]).run(runtime, "s")
    batches = await store.batches("s")
    assert len(batches) == 1
    assert [type(e) for e in batches[0].effects] == [AppendMessage]


async def test_a_failure_after_retries_records_its_attempts_then_raises() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u0")])

    def down(request: ModelRequest) -> ModelResponse:
        error = ModelError("the provider is down")
        error.attempts = 3  # type: ignore[attr-defined]  # as an adapter's retries report
        raise error

    runtime = Runtime(store=store, model=FunctionModel(down), ids=counter_ids())
    with pytest.raises(ModelError, match="down"):
        await StateMachine([ModelInference()]).run(runtime, "s")
    recorded = attempts_on((await store.load("s")).conversation[0])
    assert recorded is not None
    assert (recorded.attempts, recorded.reserved) == (3, 0)
    view = latest_ledger(await store.load("s"))
    assert view.ledger is not None
    assert view.ledger.session.model_calls == 3


async def test_a_reservation_a_crash_left_stays_counted_and_the_next_call_adds_to_it() -> None:
    """A crash left 2 calls reserved: a resumed run with 3 allowed may make 1 more."""
    store = MemoryStore()
    left = InferenceAttempts(attempts=2, revision=0, reserved=2)
    await store.create("s", conversation=[Message.user("go", id="u0")])
    session = await store.load("s")
    ledger = next_ledger(session, 2, Usage(), on=session.conversation[0])  # as a reservation's
    reservation = msgspec.structs.replace(left, ledger=ledger)
    await submit(store, "s", [Annotate("u0", "inference", note_value(reservation))])
    requests: list[int | None] = []

    def model(request: ModelRequest) -> ModelResponse:
        requests.append(request.max_attempts)
        return reply("hi")

    runtime = Runtime(store=store, model=FunctionModel(model), ids=counter_ids())
    machine = StateMachine([Budget(per_session=Limits(model_calls=3)), ModelInference()])
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == YieldReason.DONE
    assert requests == [1]  # only one call was left
    view = latest_ledger(await store.load("s"))
    assert view.ledger is not None
    assert view.ledger.session.model_calls == 3


_KILLED_MID_CALL = """
import os, signal, sys, anyio
from stepmachine import ModelInference, Runtime, StateMachine
from stepmachine.operations import Budget, Limits
from stepmachine.stores import SQLiteStore
from stepmachine.testing import FunctionModel

path, calls = sys.argv[1], sys.argv[2]

def model(request):
    with open(calls, "a") as seen:  # the model server saw the request
        seen.write("call\\n")
    os.kill(os.getpid(), signal.SIGKILL)  # the process dies before the reply is stored

async def main():
    store = await SQLiteStore.open(path)
    machine = StateMachine([Budget(per_session=Limits(model_calls=1)), ModelInference()])
    await machine.run(Runtime(store=store, model=FunctionModel(model)), "s")

anyio.run(main)
"""


@pytest.mark.parametrize("allowed", [1, 2])
async def test_a_sigkill_while_the_request_is_under_way_never_gives_the_call_back(
    tmp_path: Path, allowed: int
) -> None:
    path = str(tmp_path / "agent.db")
    calls = tmp_path / "calls.txt"
    store = await SQLiteStore.open(path)
    await store.create("s", conversation=[Message.user("go", id="u0")])
    await store.aclose()
    with anyio.fail_after(60):
        done = await anyio.run_process(
            [sys.executable, "-c", _KILLED_MID_CALL, path, str(calls)],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
    assert done.returncode == -9, done.stderr.decode()
    assert calls.read_text().count("call") == 1

    store = await SQLiteStore.open(path)
    try:
        answered = 0

        def model(request: ModelRequest) -> ModelResponse:
            nonlocal answered
            answered += 1
            return reply("hi")

        runtime = Runtime(store=store, model=FunctionModel(model))
        machine = StateMachine([Budget(per_session=Limits(model_calls=allowed)), ModelInference()])
        report = await machine.run_report(runtime, "s")
        # the killed request's call is spent: only what is left of the budget is made
        assert answered == allowed - 1
        expected = YieldReason.BUDGET_EXHAUSTED if allowed == 1 else YieldReason.DONE
        assert report.reason.kind == expected
        view = latest_ledger(await store.load("s"))
        assert view.ledger is not None
        assert view.ledger.session.model_calls == allowed
    finally:
        await store.aclose()


async def test_a_failed_summariser_call_counts_against_a_session_budget() -> None:
    store = MemoryStore()
    await store.create("s", conversation=long_history())

    def down(request: ModelRequest) -> ModelResponse:
        raise ModelError("the summariser is down")

    summariser = FunctionModel(down)
    runtime = Runtime(
        store=store,
        model=FunctionModel(lambda r: reply("hi")),
        models={"sum": summariser},
        ids=counter_ids(),
    )
    machine = StateMachine(
        [
            Budget(per_session=Limits(model_calls=2)),
            Compaction(threshold=10, model="sum"),
            ModelInference(),
        ]
    )
    for _ in range(4):
        try:
            report = await machine.run_report(runtime, "s")
        except ModelError:
            continue
        if report.reason.kind == YieldReason.BUDGET_EXHAUSTED:
            break
    assert summariser.calls == 2


async def test_a_message_submitted_while_the_model_answers_is_answered_and_the_call_counted() -> (
    None
):
    """The user steers while the model is answering: the reply to the earlier question is
    not appended after the new message (it did not see it); its call is recorded, and the
    model is asked again, with the new message."""
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("weather in Oslo?", id="u0")])
    seen: list[list[str]] = []

    async def model(request: ModelRequest) -> ModelResponse:
        seen.append([m.text for m in request.messages])
        if len(seen) == 1:
            steer = Message.user("and in Rome?", id="u1")
            await submit(store, "s", [AppendMessage(steer)])
            return reply("sunny in Oslo")
        return reply("sunny in both")

    runtime = Runtime(store=store, model=FunctionModel(model), ids=counter_ids())
    machine = StateMachine([Budget(per_session=Limits(model_calls=5)), ModelInference()])
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == YieldReason.DONE
    assert seen == [["weather in Oslo?"], ["weather in Oslo?", "and in Rome?"]]
    session = await store.load("s")
    assert [m.text for m in session.conversation] == [
        "weather in Oslo?",
        "and in Rome?",
        "sunny in both",
    ]
    first = attempts_on(session.conversation[0])
    assert first is not None
    assert (first.attempts, first.reserved) == (1, 0)  # the discarded reply's call
    view = latest_ledger(session)
    assert view.ledger is not None
    assert view.ledger.session.model_calls == 2


class _Retrying:
    """A model that reports ``tries`` attempts (as an HTTP adapter retrying does), then
    hangs: the run is cancelled while the last attempt is under way."""

    reports_attempts = True

    def __init__(self, tries: int, token: CancelToken) -> None:
        self.tries = tries
        self.token = token
        self.name = "retrying"

    async def request(self, request: ModelRequest, *, on_chunk: Any = None) -> ModelResponse:
        for _ in range(self.tries):
            attempt_started()
            await anyio.lowlevel.checkpoint()
        self.token.cancel()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


@pytest.mark.parametrize("tries", [1, 3])
async def test_a_request_cancelled_after_retries_counts_every_attempt_it_sent(tries: int) -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u0")])
    token = CancelToken()
    runtime = Runtime(store=store, model=_Retrying(tries, token), ids=counter_ids())
    machine = StateMachine(
        [Budget(per_session=Limits(model_calls=5)), ModelInference()], cancel=token
    )
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == YieldReason.CANCELLED
    session = await store.load("s")
    recorded = attempts_on(session.conversation[0])
    assert recorded is not None
    assert (recorded.attempts, recorded.reserved, recorded.interrupted_request) == (
        tries,
        0,
        True,
    )
    view = latest_ledger(session)
    assert view.ledger is not None
    assert view.ledger.session.model_calls == tries


async def test_a_cancel_before_the_request_is_sent_gives_the_reservation_back() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u0")])
    token = CancelToken()
    model = FunctionModel(lambda r: reply("hi"))

    class CancelOnReservation:
        async def emit(self, event: Any) -> None:
            if isinstance(event.data, StepApplied) and event.data.status == "committed":
                token.cancel()

    runtime = Runtime(store=store, model=model, ids=counter_ids())
    machine = StateMachine(
        [Budget(per_session=Limits(model_calls=2)), ModelInference()], cancel=token
    )
    report = await machine.run_report(runtime, "s", CancelOnReservation())
    assert report.reason.kind == YieldReason.CANCELLED
    assert model.calls == 0
    session = await store.load("s")
    view = latest_ledger(session)
    assert view.ledger is not None
    assert view.ledger.session.model_calls == 0  # nothing was sent: nothing is counted
    # and the whole budget is still there
    again = StateMachine([Budget(per_session=Limits(model_calls=2)), ModelInference()])
    report = await again.run_report(runtime, "s")
    assert report.reason.kind == YieldReason.DONE


async def test_a_steer_then_a_cancel_keeps_no_partial_reply_after_the_new_question() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("weather in Oslo?", id="u0")])
    token = CancelToken()
    model = ScriptedModel(["sunny in Oslo, and warm", "sunny in both"], chunk_size=4)

    class SteerThenCancel:
        deltas = 0

        async def emit(self, event: Any) -> None:
            if isinstance(event.data, TextDelta):
                self.deltas += 1
                if self.deltas == 2:
                    await submit(store, "s", [AppendMessage(Message.user("and Rome?", id="u1"))])
                    token.cancel()

    runtime = Runtime(store=store, model=model, ids=counter_ids())
    steps = [Budget(per_session=Limits(model_calls=5)), ModelInference()]
    report = await StateMachine(steps, cancel=token).run_report(runtime, "s", SteerThenCancel())
    assert report.reason.kind == YieldReason.CANCELLED
    session = await store.load("s")
    assert [m.id for m in session.conversation] == ["u0", "u1"]  # no partial answer to u0
    report = await StateMachine(steps).run_report(runtime, "s")  # u1 is still answered
    assert report.reason.kind == YieldReason.DONE
    session = await store.load("s")
    assert session.conversation[-1].text == "sunny in both"
    view = latest_ledger(session)
    assert view.ledger is not None
    assert view.ledger.session.model_calls == 2


async def test_a_cancelled_summariser_call_counts_what_it_sent_not_its_reservation() -> None:
    store = MemoryStore()
    await store.create("s", conversation=long_history())
    token = CancelToken()

    async def hangs(request: ModelRequest) -> ModelResponse:
        token.cancel()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    runtime = Runtime(
        store=store,
        model=FunctionModel(lambda r: reply("hi")),
        models={"sum": FunctionModel(hangs)},
        ids=counter_ids(),
    )
    steps = [
        Budget(per_session=Limits(model_calls=5)),
        Compaction(threshold=10, model="sum"),
        ModelInference(),
    ]
    report = await StateMachine(steps, cancel=token).run_report(runtime, "s")
    assert report.reason.kind == YieldReason.CANCELLED
    view = latest_ledger(await store.load("s"))
    assert view.ledger is not None
    assert view.ledger.session.model_calls == 1


async def test_a_per_run_budget_after_an_earlier_runs_failed_summariser_call() -> None:
    """A run's summary is recorded on the message where an earlier run's failed summariser
    call is: the run still starts from the totals the earlier run left (its ledger keeps
    them), so a per-run budget of 2 allows the summary and the answer."""
    store = MemoryStore()
    await store.create("s", conversation=long_history())
    down = [True]

    def summarise(request: ModelRequest) -> ModelResponse:
        if down[0]:
            raise ModelError("the summariser is down")
        return reply("short summary")

    model = FunctionModel(lambda r: reply("hi"))
    summariser = FunctionModel(summarise)
    runtime = Runtime(store=store, model=model, models={"sum": summariser}, ids=counter_ids())
    steps = [
        Budget(per_run=Limits(model_calls=2)),
        Compaction(threshold=100, model="sum"),  # the summary leaves less than 100
        ModelInference(),
    ]
    with pytest.raises(ModelError):
        await StateMachine(steps).run_report(runtime, "s")
    start = (await store.load("s")).revision
    down[0] = False
    report = await StateMachine(steps).run_report(runtime, "s")  # a summary and an answer
    assert report.reason.kind == YieldReason.DONE
    assert (summariser.calls, model.calls) == (2, 1)
    session = await store.load("s")
    assert session.conversation[-1].text == "hi"
    run = budget_usage(session, "run", run_start_revision=start, tool_calls=False)
    assert run.model_calls == 2
    assert budget_usage(session, "session", tool_calls=False).model_calls == 3


async def test_a_per_run_budget_after_an_earlier_runs_failed_call_and_an_overflow() -> None:
    """The same for the inference step's own record: an earlier run's failed call and this
    run's context overflow are recorded on one message, and the run goes on (an
    overflow is retried): the run counts its own two calls, not the earlier one."""
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u0")])
    script = ["down", "overflow", "ok"]

    def answer(request: ModelRequest) -> ModelResponse:
        step = script.pop(0)
        if step == "down":
            raise ModelError("the provider is down")
        if step == "overflow":
            raise ContextLengthError("too long")
        return reply("hi")

    model = FunctionModel(answer)
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    steps = [Budget(per_run=Limits(model_calls=2)), ModelInference()]
    with pytest.raises(ModelError):
        await StateMachine(steps).run_report(runtime, "s")
    report = await StateMachine(steps).run_report(runtime, "s")
    assert report.reason.kind == YieldReason.DONE
    assert model.calls == 3


# Each model call of a run, as scripted: the agent answers, fails, or overflows; the
# summariser summarises, fails, or answers nothing (compaction is stuck).
AGENT = st.sampled_from(["ok", "down", "overflow"])
SUMMARISER = st.sampled_from(["ok", "down", "empty"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.lists(AGENT, max_size=4), st.lists(SUMMARISER, max_size=3), st.booleans()),
        min_size=1,
        max_size=5,
    )
)
# a failed call, then in the next run an overflow, a summary and the answer, on one message
@example([([], [], True), (["down"], [], False), (["overflow"], [], False)])
async def test_every_run_counts_the_model_calls_it_made_and_no_other(
    runs: list[tuple[list[str], list[str], bool]],
) -> None:
    """Runs one after another, with failed calls, overflows, summaries and stuck summaries
    recorded on the same messages: after each, the totals read from the ledgers (what a
    budget reads) are the calls the models received, for the run and for the session."""
    store = MemoryStore()
    await store.create("s", conversation=long_history())
    agent_script: list[str] = []
    summariser_script: list[str] = []

    def agent_answer(request: ModelRequest) -> ModelResponse:
        step = agent_script.pop(0) if agent_script else "ok"
        if step == "down":
            raise ModelError("the provider is down")
        if step == "overflow":
            raise ContextLengthError("too long")
        return reply("hi")

    def summarise(request: ModelRequest) -> ModelResponse:
        step = summariser_script.pop(0) if summariser_script else "ok"
        if step == "down":
            raise ModelError("the summariser is down")
        return reply("" if step == "empty" else "short summary")

    model = FunctionModel(agent_answer)
    summariser = FunctionModel(summarise)
    runtime = Runtime(store=store, model=model, models={"sum": summariser}, ids=counter_ids())
    steps = [
        Budget(per_run=Limits(model_calls=100)),  # caps the attempts: calls are reserved
        Compaction(threshold=100, model="sum"),
        ModelInference(),
    ]
    made = 0
    for number, (agent_steps, summariser_steps, ask_again) in enumerate(runs):
        agent_script[:] = agent_steps
        summariser_script[:] = summariser_steps
        start = (await store.load("s")).revision
        before = model.calls + summariser.calls
        with contextlib.suppress(ModelError):  # recorded; the next run goes on
            await StateMachine(steps).run_report(runtime, "s")
        made += model.calls + summariser.calls - before
        session = await store.load("s")
        run = budget_usage(session, "run", run_start_revision=start, tool_calls=False)
        assert run.model_calls == model.calls + summariser.calls - before, number
        assert budget_usage(session, "session", tool_calls=False).model_calls == made, number
        if ask_again:
            # below the threshold after a summary; two of them are above it
            question = Message.user("and then? " + "word " * 30, id=f"q{number}")
            await submit(store, "s", [AppendMessage(question)])


@tool
def ping() -> str:
    """Ping."""
    return "pong"


def agent(budget: Budget) -> StateMachine[Any]:
    return StateMachine([budget, Tools([ping]), ModelInference()])


async def runs(machine: StateMachine[Any], runtime: Runtime, times: int) -> list[str]:
    """Run ``times`` times (as an application calling ``run`` again would); what each ended in."""
    ended: list[str] = []
    for _ in range(times):
        try:
            report = await machine.run_report(runtime, "s")
        except ModelError as exc:
            ended.append(type(exc).__name__)
        else:
            ended.append(report.reason.kind)
            if report.reason.kind == YieldReason.BUDGET_EXHAUSTED:
                break
    return ended


@pytest.mark.anyio
@pytest.mark.parametrize("scope", ["per_session", "per_turn"])
async def test_failed_model_calls_count_against_session_and_turn_budgets(scope: str) -> None:
    """A model call that fails (ModelError after the adapter's retries) was still made:
    a per-session or per-turn budget of 2 allows 2 such calls, however many times the
    application calls ``run`` again (the failure's attempts are recorded before the
    error propagates)."""
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u0")])

    def down(request: ModelRequest) -> ModelResponse:
        raise ModelError("the provider is down")

    model = FunctionModel(down)
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    limits = Limits(model_calls=2)
    budget = Budget(per_session=limits) if scope == "per_session" else Budget(per_turn=limits)
    ended = await runs(agent(budget), runtime, 5)
    assert model.calls == 2, ended
    assert ended[-1] == YieldReason.BUDGET_EXHAUSTED


# -- notes an application keeps -------------------------------------------------------------


@pytest.mark.anyio
async def test_a_ledger_shaped_note_of_the_application_does_not_reset_the_budget() -> None:
    """Only a model-call record's ledger counts: a value under the key ``"ledger"`` in
    an application's own namespace is not one (here it says nothing was spent)."""
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u0")])
    model = FunctionModel(lambda request: reply("hi"))
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    machine = agent(Budget(per_session=Limits(model_calls=2)))
    for turn in (1, 2):
        await submit(store, "s", [AppendMessage(Message.user(f"turn {turn}", id=f"u{turn}"))])
        await machine.run_report(runtime, "s")
    assert model.calls == 2
    zero = {"session": [0, 0, 0], "turn": [0, 0, 0], "revision": 0}
    await submit(
        store,
        "s",
        [
            AppendMessage(Message.user("turn 3", id="u3")),
            Annotate("u3", "billing", {"ledger": zero}),
        ],
    )
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == YieldReason.BUDGET_EXHAUSTED
    assert model.calls == 2


def overflow(request: ModelRequest) -> ModelResponse:
    raise ContextLengthError("too long")


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("budget", "notes"),
    [
        (Budget(per_session=Limits(model_calls=1)), {}),  # control: holds
        (Budget(per_turn=Limits(model_calls=1)), {}),  # control: holds
        (Budget(per_session=Limits(model_calls=1)), {"quiz": {"attempts": 0}}),
        (Budget(per_turn=Limits(model_calls=1)), {"quiz": {"attempts": 0}}),
        (Budget(per_turn=Limits(model_calls=1, tool_calls=10)), {}),
    ],
    ids=["session", "turn", "session-app-note", "turn-app-note", "turn-with-tool-limit"],
)
async def test_a_failed_attempt_recorded_on_the_user_message_counts(
    budget: Budget, notes: dict[str, Any]
) -> None:
    """A context overflow is recorded on the last message (the user's) and counts as a
    call. It must count whether or not the user message also carries an application's
    note with an integer ``"attempts"``, and whether or not the budget has a tool-call
    limit (which makes it count from the records)."""
    store = MemoryStore()
    await store.create("s", conversation=[Message(id="u0", role="user", parts=(), notes=notes)])
    model = FunctionModel(overflow)
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    ended = await runs(agent(budget), runtime, 3)
    assert model.calls == 1, ended
    assert ended == [YieldReason.BUDGET_EXHAUSTED]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "receipt",
    [
        {"attempts": 1, "revision": 0, "usage": "a lot"},
        {"attempts": 1, "revision": 0, "usage": {"input_tokens": "many"}},
        {"attempts": 1, "revision": 0, "usage": [1, 2]},
    ],
)
async def test_a_damaged_receipt_is_a_stored_data_error(receipt: dict[str, Any]) -> None:
    """Counting from the records (a tool-call limit) reads every receipt: a damaged one
    is a StoredDataError naming the session and message, not a TypeError or
    AttributeError from deep inside the budget."""
    damaged = Message(id="a1", role="assistant", parts=(), notes={"inference": receipt})
    session = make_session(Message.user("go", id="u0"), damaged, Message.user("more", id="u1"))
    with pytest.raises(StoredDataError, match="a1"):
        await run_step(Budget(per_session=Limits(model_calls=5, tool_calls=5)), session)


# -- a crash between the model's answer and its record ------------------------------------


class Killed(BaseException):
    """Stands for kill -9: nothing after it runs."""


class CrashingStore:
    """A MemoryStore that dies when asked to store the model's first reply."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self.armed = True
        self.applies_batches = store.applies_batches

    async def load(self, session_id: str) -> Any:
        return await self._store.load(session_id)

    async def apply(self, batch: Any) -> Any:
        replies = [
            e
            for e in batch.effects
            if isinstance(e, AppendMessage) and e.message.role == "assistant"
        ]
        if self.armed and replies:
            self.armed = False
            raise Killed
        return await self._store.apply(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@pytest.mark.anyio
async def test_a_crash_before_the_reply_is_stored_does_not_give_the_call_back() -> None:
    memory = MemoryStore()
    await memory.create("s", conversation=[Message.user("go", id="u0")])
    model = FunctionModel(lambda request: reply("hi"))
    budget = Limits(model_calls=1)
    crashing = CrashingStore(memory)
    with pytest.raises(Killed):
        await agent(Budget(per_session=budget)).run(
            Runtime(store=crashing, model=model, ids=counter_ids()),
            "s",  # type: ignore[arg-type]
        )
    assert model.calls == 1
    resumed = Runtime(store=memory, model=model, ids=counter_ids("r"))
    report = await agent(Budget(per_session=budget)).run_report(resumed, "s")
    assert model.calls == 1
    assert report.reason.kind == YieldReason.BUDGET_EXHAUSTED


# -- two model-call records on one message -------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("tool_calls", [None, 10], ids=["ledger", "records"])
async def test_an_overflow_and_a_stuck_summary_on_one_message_count_twice(
    tool_calls: int | None,
) -> None:
    """A context overflow (recorded by the inference step on the last message) and a
    summariser call that made nothing smaller (recorded by compaction on the same
    message) are two model calls. Counting from the records (a tool-call limit) reads
    only the first namespace with an ``"attempts"`` and counts one."""
    store = MemoryStore()
    answer = Message(id="a0", role="assistant", parts=(), notes={})
    await store.create(
        "s",
        conversation=[Message.user("first " * 50, id="u0"), answer, Message.user("go", id="u1")],
    )
    inference_calls = 0

    def main(request: ModelRequest) -> ModelResponse:
        nonlocal inference_calls
        inference_calls += 1
        if inference_calls == 1:
            raise ContextLengthError("too long")
        return reply("ok")

    summariser = FunctionModel(lambda request: reply(""))  # an empty summary: stuck
    model = FunctionModel(main)
    runtime = Runtime(store=store, model=model, models={"sum": summariser}, ids=counter_ids())
    budget = Budget(per_session=Limits(model_calls=2, tool_calls=tool_calls))
    machine = StateMachine(
        [budget, Compaction(threshold=10**6, model="sum"), Tools([ping]), ModelInference()]
    )
    first = await machine.run_report(runtime, "s")
    assert first.reason.kind == "compaction_stuck"
    assert (model.calls, summariser.calls) == (1, 1)
    await submit(store, "s", [AppendMessage(Message.user("again", id="u2"))])
    second = await machine.run_report(runtime, "s")
    assert model.calls + summariser.calls == 2
    assert second.reason.kind == YieldReason.BUDGET_EXHAUSTED
