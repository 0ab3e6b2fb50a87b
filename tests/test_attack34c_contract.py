"""Attack 34c: the new contract errors of staged work (``then()`` returning something
that is not an outcome, a record returning something that is not an effect) with a
sibling landed meanwhile, an outside cancellation of a hand-driven ``apply()`` on the
error path followed by ``finalize(interrupted=...)``, and regressions of ``run()``
(the lease is let go after each way a run ends)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from _attack34a_common import StagedStep, receipt_record
from _attack34c_common import SID, is_record_of, keeps_written, open_store, receipts_written
from _attack34c_common import two_tasks as machine_of

from stepmachine import (
    CancelToken,
    LeasePolicy,
    Runtime,
    Staged,
    StateMachine,
    StepContractError,
    Task,
    UpdateData,
)
from stepmachine.testing import run_step

LIMIT = 30


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def staged_of(records: dict[str, Any], then: Any, concurrency: int) -> Any:
    def make(ctx: Any) -> Staged:
        tasks = []
        for name, record in records.items():

            async def run(record: Any = record) -> Any:
                return record

            tasks.append(Task(name, run))
        return Staged(
            [UpdateData.set(keys=dict.fromkeys(records, "k"))],
            tasks,
            max_concurrency=concurrency,
            then=then,
        )

    return StagedStep(make)


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["memory", "sqlite"])
@pytest.mark.parametrize("concurrency", [1, 2])
async def test_record_returning_a_non_effect_beside_a_good_sibling(
    kind: str, concurrency: int, tmp_path: Path
) -> None:
    store = await open_store(kind, tmp_path)

    def bad(stored: Any) -> Any:
        return [UpdateData.set(receipts={"bad": "half"}), "not an effect"]

    step = staged_of({"good": receipt_record("good", "r"), "bad": bad}, None, concurrency)
    with pytest.raises(StepContractError, match="'bad'"):
        with anyio.fail_after(LIMIT):
            await StateMachine([step]).run(Runtime(store=store), SID)
    batches = await store.batches(SID)
    assert receipts_written(batches) == ["good"], "good's record written; nothing of bad's"
    await store.aclose()


@pytest.mark.anyio
async def test_run_step_refuses_a_non_effect_record_too(tmp_path: Path) -> None:
    store = await open_store("memory", tmp_path)

    def bad(stored: Any) -> Any:
        return ["not an effect"]

    with pytest.raises(StepContractError, match="'bad'"):
        await run_step(staged_of({"bad": bad}, None, 1), await store.load(SID))


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["memory", "sqlite"])
@pytest.mark.parametrize("concurrency", [1, 2])
async def test_then_returning_none_after_every_record(
    kind: str, concurrency: int, tmp_path: Path
) -> None:
    store = await open_store(kind, tmp_path)
    records = {"a": receipt_record("a", "ra"), "b": receipt_record("b", "rb")}
    step = staged_of(records, lambda: None, concurrency)
    with pytest.raises(StepContractError, match="then"):
        with anyio.fail_after(LIMIT):
            await StateMachine([step]).run(Runtime(store=store), SID)
    batches = await store.batches(SID)
    assert sorted(receipts_written(batches)) == ["a", "b"], "every record written first"
    # the lease was let go: a run that fails at once on a held session gets it
    again = StateMachine([step], lease=LeasePolicy(busy="fail"))
    report = await again.run_report(Runtime(store=store), SID)
    assert report.reason.kind == "idle"
    await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["memory", "sqlite", "file"])
async def test_lease_let_go_after_a_task_error_and_after_the_token(
    kind: str, tmp_path: Path
) -> None:
    store = await open_store(kind, tmp_path)
    journal: list[str] = []

    async def b_run() -> None:
        raise RuntimeError("bug in b")

    machine = machine_of(journal, b_run=b_run, concurrency=1)
    with pytest.raises(RuntimeError):
        await machine.run(Runtime(store=store), SID)
    batches = await store.batches(SID)
    assert receipts_written(batches) == ["a"]
    assert keeps_written(batches) == ["b"], "the task that raised: its keep"
    strict = StateMachine(machine.steps, lease=LeasePolicy(busy="fail"))
    report = await strict.run_report(Runtime(store=store), SID)
    assert report.reason.kind == "idle"  # every key has its record: the step refuses
    assert journal == ["a"]
    token = CancelToken()
    token.cancel("stop")
    stopped = StateMachine(machine.steps, cancel=token)
    assert (await stopped.run_report(Runtime(store=store), SID)).reason.kind == "cancelled"
    assert (await strict.run_report(Runtime(store=store), SID)).reason.kind == "idle"
    await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_outside_cancel_of_hand_apply_on_the_error_path_then_finalize(
    kind: str, tmp_path: Path
) -> None:
    """A scope cancels a hand-driven apply() while it writes what it holds after a task's
    error; apply() writes the rest (shielded) and the task's error, not the cancellation,
    propagates; a later finalize(interrupted=decision) writes none of it again."""
    store = await open_store(kind, tmp_path)
    journal: list[str] = []
    landed = anyio.Event()

    async def hold_a() -> None:
        landed.set()
        await anyio.sleep_forever()

    async def b_run() -> None:
        await landed.wait()
        raise RuntimeError("bug in b")

    machine = machine_of(journal, a_landed=hold_a, b_run=b_run)
    inner = store.apply
    scope = anyio.CancelScope()

    async def apply(batch: Any, **kw: Any) -> Any:
        if is_record_of(batch, "kept", "b") and not scope.cancel_called:
            scope.cancel()
            await anyio.lowlevel.checkpoint()
        return await inner(batch, **kw)

    store.apply = apply
    runtime = Runtime(store=store)
    session = await store.load(SID)
    decision = await machine.step(runtime, session)
    with pytest.raises(RuntimeError, match="bug in b"), anyio.fail_after(LIMIT), scope:
        await machine.apply(runtime, session, decision)
    assert scope.cancel_called
    assert not scope.cancelled_caught, "the task's error propagated, not the cancellation"
    middle = await store.batches(SID)
    assert receipts_written(middle) == ["a"], "written before the error propagated"
    assert keeps_written(middle) == ["b"]
    after = await machine.finalize(runtime, SID, interrupted=decision)
    assert after.revision == len(middle), "finalize wrote nothing again"
    await store.aclose()


# -- run_step(run_start_revision=) --------------------------------------------------------


@pytest.mark.anyio
async def test_run_step_counts_a_per_run_budget_from_the_runs_start() -> None:
    from _attack34b_agent import Agent

    from stepmachine import AppendMessage, Message, ModelInference, submit
    from stepmachine.operations import Budget, BudgetExhaustedError, Limits
    from stepmachine.stores import MemoryStore
    from stepmachine.testing import FunctionModel

    store = MemoryStore()
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("invoice", id="u1"))])
    agent = Agent(approval=False)
    report = await agent.machine().run_report(agent.runtime(store), "s")
    assert report.reason.kind == "done"
    assert agent.requests == 3
    await submit(store, "s", [AppendMessage(Message.user("again", id="u2"))])
    session = await store.load("s")
    budget = [Budget(per_run=Limits(model_calls=2))]
    model = FunctionModel(agent.answer)
    for start in (None, session.revision):  # a new run: none of its 2 calls spent yet
        check = await run_step(
            ModelInference(), session, model=model, others=budget, run_start_revision=start
        )
        assert not check.refused
        assert check.commits, "the model was called and its reply recorded"
    with pytest.raises(BudgetExhaustedError, match="'used': 3"):  # the whole session: 3
        await run_step(ModelInference(), session, model=model, others=budget, run_start_revision=0)
