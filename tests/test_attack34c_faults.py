"""Attack 34c: faults around the hand-driven path's lease and the error path: a store
whose lease claim or release fails once, ``KeyboardInterrupt`` raised by the store while
the held records are written, and the machine's token fired before ``apply()``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from _attack34a_common import StagedStep, receipt_record
from _attack34c_common import SID, is_record_of, keeps_written, open_store, receipts_written
from _attack34c_common import two_tasks as machine_of

from stepmachine import (
    CancelToken,
    LeasePolicy,
    Runtime,
    SessionBusyError,
    Staged,
    StateMachine,
    Task,
    UpdateData,
)

LIMIT = 30
KINDS = ["memory", "sqlite", "file"]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def one_task(ran: list[str]) -> Any:
    async def run() -> Any:
        ran.append("x")
        return receipt_record("x", "receipt-x")

    def make(ctx: Any) -> Staged:
        return Staged([UpdateData.set(keys={"x": "k"})], [Task("x", run, guarded=True)])

    return StagedStep(make)


def fail_once(store: Any, name: str) -> list[int]:
    inner = getattr(store, name)
    calls: list[int] = []

    async def once(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise OSError(f"{name}: connection reset")
        return await inner(*args, **kw)

    setattr(store, name, once)
    return calls


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
async def test_hand_apply_whose_release_fails_once_lets_go(kind: str, tmp_path: Path) -> None:
    store = await open_store(kind, tmp_path)
    ran: list[str] = []
    machine = StateMachine([one_task(ran)])
    runtime = Runtime(store=store)
    calls = fail_once(store, "release")
    session = await store.load(SID)
    decision = await machine.step(runtime, session)
    with anyio.fail_after(LIMIT):
        after, _ = await machine.apply(runtime, session, decision)
    assert after.data.receipts == {"x": "receipt-x"}
    assert len(calls) >= 2, "the release was tried again"
    strict = StateMachine(machine.steps, lease=LeasePolicy(busy="fail"))
    report = await strict.run_report(runtime, SID)  # SessionBusyError if still held
    assert report.reason.kind == "idle"
    assert ran == ["x"]
    await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
async def test_hand_apply_whose_claim_fails_once_runs_nothing(kind: str, tmp_path: Path) -> None:
    """A claim that fails: either waited out, or it propagates with nothing run or written
    and the session left free."""
    store = await open_store(kind, tmp_path)
    ran: list[str] = []
    machine = StateMachine([one_task(ran)])
    runtime = Runtime(store=store)
    fail_once(store, "claim")
    session = await store.load(SID)
    decision = await machine.step(runtime, session)
    try:
        with anyio.fail_after(LIMIT):
            await machine.apply(runtime, session, decision)
    except OSError:
        assert ran == []
        assert (await store.load(SID)).revision == 0
        await machine.apply(runtime, session, decision)
    assert ran == ["x"]
    assert (await store.load(SID)).data.receipts == {"x": "receipt-x"}
    await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_keyboard_interrupt_while_held_records_are_written(kind: str, tmp_path: Path) -> None:
    """Ctrl-C (``KeyboardInterrupt``) lands in the first write of what is held after a
    task's error: it propagates, and finalize writes each record once first."""
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
    hit: list[bool] = []

    async def apply(batch: Any, **kw: Any) -> Any:
        if is_record_of(batch, "kept", "b") and not hit:
            hit.append(True)
            raise KeyboardInterrupt
        return await inner(batch, **kw)

    store.apply = apply
    with pytest.raises(KeyboardInterrupt):
        with anyio.fail_after(LIMIT):
            await machine.run(Runtime(store=store), SID)
    batches = await store.batches(SID)
    assert receipts_written(batches) == ["a"]
    assert keeps_written(batches) == ["b"]
    await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
async def test_token_fired_before_hand_apply(kind: str, tmp_path: Path) -> None:
    store = await open_store(kind, tmp_path)
    ran: list[str] = []
    token = CancelToken()
    machine = StateMachine([one_task(ran)], cancel=token)
    runtime = Runtime(store=store)
    session = await store.load(SID)
    decision = await machine.step(runtime, session)
    token.cancel("stop")
    after, result = await machine.apply(runtime, session, decision)
    assert result.status == "cancelled"
    assert ran == []
    assert after.revision == 0, "nothing of the cycle written"
    final = await machine.finalize(runtime, SID, interrupted=decision)
    assert final.revision == 0
    lease = await store.claim(SID, "other", 30.0)  # another runner holds it now
    try:
        with pytest.raises(SessionBusyError):
            await machine.finalize(runtime, SID)
    finally:
        await store.release(lease)
    await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
async def test_stale_hand_apply_conflicts_and_lets_go(kind: str, tmp_path: Path) -> None:
    """apply() of staged work decided from a session another writer moved on: ConflictError
    before any task starts, nothing written, and the lease it claimed let go."""
    from stepmachine import ConflictError, submit

    store = await open_store(kind, tmp_path)
    ran: list[str] = []
    machine = StateMachine([one_task(ran)])
    runtime = Runtime(store=store)
    session = await store.load(SID)
    decision = await machine.step(runtime, session)
    await submit(store, SID, [UpdateData.set(count=1)])
    with pytest.raises(ConflictError):
        await machine.apply(runtime, session, decision)
    assert ran == []
    assert (await store.load(SID)).revision == 1
    strict = StateMachine(machine.steps, lease=LeasePolicy(busy="fail"))
    await strict.run_report(runtime, SID)  # SessionBusyError if the lease were still held
    assert ran == ["x"]
    await store.aclose()
