"""Review B: attacks on exact budgets (invariant 7) through the model-call ledger and
the typed records (issue 9).

A budget of N model calls must mean N calls whatever else the session holds:
notes an application keeps under its own namespaces, a failure of the model,
a run that starts again.
"""

from __future__ import annotations

from typing import Any

import pytest

from stepmachine import (
    Annotate,
    AppendMessage,
    ContextLengthError,
    Message,
    ModelError,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    StateMachine,
    StoredDataError,
    Tools,
    submit,
    tool,
)
from stepmachine.extend import YieldReason, counter_ids
from stepmachine.operations import Budget, Compaction, Limits
from stepmachine.stores import MemoryStore
from stepmachine.testing import FunctionModel, make_session, reply, run_step


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


# -- a model that fails ---------------------------------------------------------------------


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
