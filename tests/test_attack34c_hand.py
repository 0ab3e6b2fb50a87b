"""Attack 34c: misuse and faults of the hand-driven path (``step``/``apply``/``finalize``).

``apply()`` given the session object of another session (or of another store),
``finalize()`` with nothing open and beside a holder, a hand-driven ``apply()`` whose
lease lapses while a slow task runs (the process stalled) or is kept alive by renewals,
and the machine's token firing while ``apply()`` writes what it holds after a task's
error.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from _attack34a_common import Order, StagedStep, receipt_record
from _attack34c_common import SID, is_record_of, keeps_written, open_store, receipts_written
from _attack34c_common import two_tasks as machine_of

from stepmachine import (
    CancelToken,
    ConflictError,
    LeaseLostError,
    LeasePolicy,
    Runtime,
    SessionBusyError,
    Staged,
    StateMachine,
    Task,
    UpdateData,
    submit,
)

LIMIT = 30


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def one_task_machine(ran: list[str], *, seconds: float = 0.0, stall: float = 0.0) -> Any:
    async def run() -> Any:
        ran.append("x")
        if stall:
            time.sleep(stall)  # noqa: ASYNC251 - a stalled process: nothing renews
        if seconds:
            await anyio.sleep(seconds)
        return receipt_record("x", "receipt-x")

    def make(ctx: Any) -> Staged:
        return Staged([UpdateData.set(keys={"x": ctx.session.id})], [Task("x", run)])

    return StagedStep(make)


# -- apply() given another session's object ----------------------------------------------


@pytest.mark.anyio
async def test_apply_with_another_sessions_object(tmp_path: Path) -> None:
    store = await open_store("memory", tmp_path)
    await store.create("b", data=Order())
    for n in range(3):  # b is further on than the decision's session
        await submit(store, "b", [UpdateData.set(count=n + 1)])
    ran: list[str] = []
    machine = StateMachine([one_task_machine(ran)])
    runtime = Runtime(store=store)
    decision = await machine.step(runtime, await store.load(SID))
    other = await store.load("b")
    with pytest.raises(Exception):  # noqa: B017, PT011 - any refusal will do
        await machine.apply(runtime, other, decision)
    assert ran == [], "a task of session 'order' ran for session 'b'"
    assert (await store.load("b")).revision == other.revision, "session b was written"


@pytest.mark.anyio
async def test_apply_with_a_session_behind_from_another_id_writes_nothing(tmp_path: Path) -> None:
    """The decision's session is further on than the one given: nothing runs, nothing is
    written (the error is a LeaseLostError today; the check is on what happened)."""
    store = await open_store("memory", tmp_path)
    await store.create("b", data=Order())
    for n in range(3):
        await submit(store, SID, [UpdateData.set(count=n + 1)])
    ran: list[str] = []
    machine = StateMachine([one_task_machine(ran)])
    runtime = Runtime(store=store)
    decision = await machine.step(runtime, await store.load(SID))
    with pytest.raises(Exception):  # noqa: B017, PT011 - any refusal will do
        await machine.apply(runtime, await store.load("b"), decision)
    assert ran == []
    assert (await store.load(SID)).revision == 3
    assert (await store.load("b")).revision == 0


# -- finalize() -------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["memory", "sqlite", "file"])
async def test_finalize_with_nothing_open_writes_nothing(kind: str, tmp_path: Path) -> None:
    store = await open_store(kind, tmp_path)
    ran: list[str] = []
    machine = StateMachine([one_task_machine(ran)])
    runtime = Runtime(store=store)
    before = await store.load(SID)
    after = await machine.finalize(runtime, SID)
    assert after.revision == before.revision == 0
    session, _ = await machine.apply(runtime, before, await machine.step(runtime, before))
    again = await machine.finalize(runtime, SID)
    again = await machine.finalize(runtime, SID)
    assert again.revision == session.revision, "a finished session: finalize writes nothing"
    assert len(await store.batches(SID)) == session.revision
    assert ran == ["x"]
    await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["memory", "sqlite", "file"])
async def test_finalize_and_apply_beside_a_holder(kind: str, tmp_path: Path) -> None:
    """A run inside its task holds the session: finalize() and apply() raise
    SessionBusyError and write nothing; the run's result is then written as usual."""
    store = await open_store(kind, tmp_path)
    inside, go = anyio.Event(), anyio.Event()
    ran: list[str] = []

    async def run() -> Any:
        ran.append("x")
        inside.set()
        await go.wait()
        return receipt_record("x", "receipt-x")

    def make(ctx: Any) -> Staged:
        return Staged([UpdateData.set(keys={"x": "k"})], [Task("x", run, guarded=True)])

    machine = StateMachine([StagedStep(make)])
    runtime = Runtime(store=store)
    async with anyio.create_task_group() as group:
        group.start_soon(machine.run, runtime, SID)
        with anyio.fail_after(LIMIT):
            await inside.wait()
        stored = await store.load(SID)
        with pytest.raises(SessionBusyError):
            await machine.finalize(runtime, SID)
        decision = await machine.step(runtime, stored)
        if decision is not None:  # the step yields "outcome_unknown" on open keys
            with pytest.raises(SessionBusyError):
                await machine.apply(runtime, stored, decision)
        assert (await store.load(SID)).revision == stored.revision
        go.set()
    final = await store.load(SID)
    assert final.data.receipts == {"x": "receipt-x"}
    assert ran == ["x"]
    await store.aclose()


# -- a hand-driven apply()'s lease ------------------------------------------------------


@pytest.mark.anyio
async def test_hand_driven_apply_keeps_its_lease_alive_through_a_slow_task(
    tmp_path: Path,
) -> None:
    store = await open_store("memory", tmp_path, expiring_leases=True)
    ran: list[str] = []
    machine = StateMachine([one_task_machine(ran, seconds=1.2)], lease=LeasePolicy(ttl=0.3))
    runtime = Runtime(store=store)
    thefts: list[Any] = []
    session = await store.load(SID)
    decision = await machine.step(runtime, session)
    async with anyio.create_task_group() as group:

        async def thief() -> None:
            while True:
                thefts.append(await store.claim(SID, "thief", 30.0))
                await anyio.sleep(0.05)

        group.start_soon(thief)
        with anyio.fail_after(LIMIT):
            after, result = await machine.apply(runtime, session, decision)
        group.cancel_scope.cancel()
    assert thefts, "the thief tried"
    assert all(getattr(t, "owner", "") != "thief" for t in thefts[:-1]), "taken mid-way"
    assert after.data.receipts == {"x": "receipt-x"}
    assert result.status == "continue"


@pytest.mark.anyio
async def test_hand_driven_apply_whose_lease_lapsed_writes_nothing_after(
    tmp_path: Path,
) -> None:
    """The process stalls past the ttl inside the task; another runner claims the
    session; the task's record is not written (LeaseLostError), nor anything else."""
    store = await open_store("memory", tmp_path, expiring_leases=True)
    ran: list[str] = []
    stolen: list[Any] = []

    async def run() -> Any:
        ran.append("x")
        time.sleep(0.8)  # noqa: ASYNC251 - a stalled process: nothing renews
        stolen.append(await store.claim(SID, "thief", 30.0))
        return receipt_record("x", "receipt-x")

    def make(ctx: Any) -> Staged:
        return Staged([UpdateData.set(keys={"x": "k"})], [Task("x", run)])

    machine = StateMachine([StagedStep(make)], lease=LeasePolicy(ttl=0.3))
    runtime = Runtime(store=store)
    session = await store.load(SID)
    decision = await machine.step(runtime, session)
    with pytest.raises(LeaseLostError):
        with anyio.fail_after(LIMIT):
            await machine.apply(runtime, session, decision)
    assert getattr(stolen[0], "owner", None) == "thief", stolen
    assert len(await store.batches(SID)) == 1, "only the intents, before the loss"
    with pytest.raises(SessionBusyError):
        await machine.finalize(runtime, SID)


# -- the token fires while apply() writes what it holds after a task's error -------------


async def hand_token_during_error_path(tmp_path: Path) -> tuple[Any, Any, list[str]]:
    store = await open_store("sqlite", tmp_path)
    journal: list[str] = []
    landed = anyio.Event()

    async def hold_a() -> None:
        landed.set()
        await anyio.sleep_forever()

    async def b_run() -> None:
        await landed.wait()
        raise RuntimeError("bug in b")

    machine = machine_of(journal, a_landed=hold_a, b_run=b_run)
    token = CancelToken()
    machine.cancel = token
    inner = store.apply
    fired: list[bool] = []

    async def apply(batch: Any, **kw: Any) -> Any:
        if is_record_of(batch, "kept", "b") and not fired:
            fired.append(True)
            token.cancel("stop")
            await anyio.lowlevel.checkpoint()
        return await inner(batch, **kw)

    store.apply = apply
    runtime = Runtime(store=store)
    session = await store.load(SID)
    decision = await machine.step(runtime, session)
    outcome: Any
    try:
        with anyio.fail_after(LIMIT):
            outcome = await machine.apply(runtime, session, decision)
    except Exception as exc:
        outcome = exc
    if not isinstance(outcome, Exception):
        await machine.finalize(runtime, SID, interrupted=decision)
    return store, outcome, journal


@pytest.mark.anyio
async def test_hand_token_during_error_path_writes_each_record_once(tmp_path: Path) -> None:
    store, _, journal = await hand_token_during_error_path(tmp_path)
    batches = await store.batches(SID)
    assert journal == ["a"]
    assert receipts_written(batches) == ["a"]
    assert keeps_written(batches) == ["b"]
    await store.aclose()


@pytest.mark.anyio
async def test_hand_token_during_error_path_still_raises(tmp_path: Path) -> None:
    store, outcome, _ = await hand_token_during_error_path(tmp_path)
    await store.aclose()
    assert isinstance(outcome, RuntimeError), f"the task's error was replaced by {outcome!r:.300}"


# -- two hand-driven apply() of the same decision at once ---------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["memory", "sqlite", "file"])
async def test_two_hand_applies_at_once_run_the_task_once(kind: str, tmp_path: Path) -> None:
    store = await open_store(kind, tmp_path)
    inside, go = anyio.Event(), anyio.Event()
    ran: list[str] = []

    async def run() -> Any:
        ran.append("x")
        inside.set()
        await go.wait()
        return receipt_record("x", "receipt-x")

    def make(ctx: Any) -> Staged:
        return Staged([UpdateData.set(keys={"x": "k"})], [Task("x", run, guarded=True)])

    machine = StateMachine([StagedStep(make)])
    runtime = Runtime(store=store)
    session = await store.load(SID)
    first = await machine.step(runtime, session)
    second = await machine.step(runtime, session)
    errors: list[BaseException] = []

    async def one(decision: Any) -> None:
        try:
            await machine.apply(runtime, session, decision)
        except (SessionBusyError, ConflictError) as exc:
            errors.append(exc)

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as group:
            group.start_soon(one, first)
            await inside.wait()
            await one(second)  # beside the first, inside its task
            go.set()
    assert ran == ["x"]
    assert len(errors) == 1, errors
    assert (await store.load(SID)).data.receipts == {"x": "receipt-x"}
    await store.aclose()


# -- asyncio's native cancel of a hand-driven apply() on the error path ------------------


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["sqlite", "file"])
async def test_native_cancel_of_hand_apply_on_the_error_path(kind: str, tmp_path: Path) -> None:
    import asyncio

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
    writing = asyncio.Event()

    async def apply(batch: Any, **kw: Any) -> Any:
        if is_record_of(batch, "kept", "b") and not writing.is_set():
            writing.set()
            await asyncio.sleep(5)  # cancelled from outside here
        return await inner(batch, **kw)

    store.apply = apply
    runtime = Runtime(store=store)
    session = await store.load(SID)
    decision = await machine.step(runtime, session)
    task = asyncio.ensure_future(machine.apply(runtime, session, decision))
    await asyncio.wait_for(writing.wait(), LIMIT)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, LIMIT)
    middle = await store.batches(SID)
    assert receipts_written(middle) == ["a"]
    assert keeps_written(middle) == ["b"]
    after = await machine.finalize(runtime, SID, interrupted=decision)
    assert after.revision == len(middle)
    assert journal == ["a"]
    await store.aclose()


# -- KeyboardInterrupt in a task of a hand-driven apply() ----------------------------------


@pytest.mark.parametrize("anyio_backend", ["trio"])  # asyncio: it leaves the loop at once
@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["memory", "sqlite", "file"])
async def test_keyboard_interrupt_in_a_task_of_hand_apply(kind: str, tmp_path: Path) -> None:
    store = await open_store(kind, tmp_path)
    journal: list[str] = []
    landed = anyio.Event()

    async def hold_a() -> None:
        landed.set()
        await anyio.sleep_forever()

    async def b_run() -> None:
        await landed.wait()
        raise KeyboardInterrupt

    machine = machine_of(journal, a_landed=hold_a, b_run=b_run)
    runtime = Runtime(store=store)
    session = await store.load(SID)
    decision = await machine.step(runtime, session)
    with pytest.raises(KeyboardInterrupt):
        with anyio.fail_after(LIMIT):
            await machine.apply(runtime, session, decision)
    middle = await store.batches(SID)
    assert receipts_written(middle) == ["a"]
    assert keeps_written(middle) == ["b"]
    after = await machine.finalize(runtime, SID, interrupted=decision)
    assert after.revision == len(middle), "finalize wrote nothing again"
    strict = StateMachine(machine.steps, lease=LeasePolicy(busy="fail"))
    assert (await strict.run_report(runtime, SID)).reason.kind == "idle", "the lease let go"
    assert journal == ["a"]
    await store.aclose()
