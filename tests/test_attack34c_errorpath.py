"""Attack 34c: the error path of staged work (a task raises; the machine writes what it
holds before the error propagates) under real faults: a cancellation (the machine's
token, an anyio scope, asyncio's native ``task.cancel()``) landing while those records
are written, a store failing transiently or for good there, ``KeyboardInterrupt`` in a
task, a task raising while a sibling's record write is in flight, a lease lost mid-way.

Task ``a`` charges and returns (its record is held); task ``b`` raises (``b`` keeps
``kept`` when cut). Checked each time: ``a``'s receipt and ``b``'s keep are written once
each (never twice, never lost while the run may write), and what propagates.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from _attack34c_common import SID, is_record_of, keeps_written, open_store, receipts_written
from _attack34c_common import two_tasks as machine_of

from stepmachine import CancelToken, LeaseLostError, LeasePolicy, Runtime, StateMachine

KINDS = ["memory", "sqlite"]
LIMIT = 30


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def hook_writes(
    store: Any, on: Callable[[Any], bool], fault: Callable[[int], Awaitable[None]]
) -> list[int]:
    """Patch ``store.apply``: before each batch ``on`` matches, await ``fault(n)`` (n: how
    many matched so far, from 1). Returns the list of match counts (for the test)."""
    inner = store.apply
    seen: list[int] = []

    async def apply(batch: Any, **kw: Any) -> Any:
        if on(batch):
            seen.append(len(seen) + 1)
            await fault(seen[-1])
        return await inner(batch, **kw)

    store.apply = apply
    return seen


def a_holds_b_raises(error: BaseException) -> tuple[Any, Any]:
    """``a`` lands and waits in ``landed``; then ``b`` raises ``error``."""
    a_landed = anyio.Event()

    async def hold_a() -> None:
        a_landed.set()
        await anyio.sleep_forever()

    async def b_run() -> None:
        await a_landed.wait()
        raise error

    return hold_a, b_run


def keep_of_b(batch: Any) -> bool:
    return is_record_of(batch, "kept", "b")


def receipt_of_a(batch: Any) -> bool:
    return is_record_of(batch, "receipts", "a")


async def assert_each_once(store: Any, journal: list[str]) -> None:
    batches = await store.batches(SID)
    assert journal == ["a"], journal
    assert receipts_written(batches) == ["a"], "a's receipt: written once"
    assert keeps_written(batches) == ["b"], "b's keep: written once"


# -- the machine's token fires while the held records are written -----------------------


async def token_during_error_path(kind: str, tmp_path: Path) -> tuple[Any, Any, list[str]]:
    store = await open_store(kind, tmp_path)
    journal: list[str] = []
    hold_a, b_run = a_holds_b_raises(RuntimeError("bug in b"))
    machine = machine_of(journal, a_landed=hold_a, b_run=b_run)
    token = CancelToken()
    machine.cancel = token

    async def fire(n: int) -> None:
        if n == 1:
            token.cancel("stop")
            await anyio.lowlevel.checkpoint()

    hook_writes(store, keep_of_b, fire)
    outcome: Any
    try:
        with anyio.fail_after(LIMIT):
            outcome = await machine.run_report(Runtime(store=store), SID)
    except Exception as exc:
        outcome = exc
    return store, outcome, journal


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
async def test_token_during_error_path_writes_each_record_once(kind: str, tmp_path: Path) -> None:
    store, _, journal = await token_during_error_path(kind, tmp_path)
    await assert_each_once(store, journal)
    await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
async def test_token_during_error_path_still_raises_the_task_error(
    kind: str, tmp_path: Path
) -> None:
    store, outcome, _ = await token_during_error_path(kind, tmp_path)
    await store.aclose()
    assert isinstance(outcome, RuntimeError), f"the task's error was replaced by {outcome!r}"


# -- an outside cancellation while the held records are written -------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("when", ["before_write", "after_write"])
async def test_scope_cancel_during_error_path(kind: str, when: str, tmp_path: Path) -> None:
    """A cancellation from outside while the held records are written after b's error:
    the writes are shielded (bounded by finalize_timeout), each record is written once,
    and b's error, not the cancellation, is what propagates (it is never lost)."""
    store = await open_store(kind, tmp_path)
    journal: list[str] = []
    hold_a, b_run = a_holds_b_raises(RuntimeError("bug in b"))
    machine = machine_of(journal, a_landed=hold_a, b_run=b_run)
    inner = store.apply
    scope = anyio.CancelScope()

    async def apply(batch: Any, **kw: Any) -> Any:
        if not keep_of_b(batch):
            return await inner(batch, **kw)
        if when == "before_write":
            scope.cancel()
            await anyio.lowlevel.checkpoint()
            return await inner(batch, **kw)
        written = await inner(batch, **kw)  # stored, then the reply is cut
        scope.cancel()
        await anyio.lowlevel.checkpoint()
        return written

    store.apply = apply
    with pytest.raises(RuntimeError, match="bug in b"), anyio.fail_after(LIMIT), scope:
        await machine.run(Runtime(store=store), SID)
    assert scope.cancel_called
    assert not scope.cancelled_caught, "b's error propagated, not the cancellation"
    await assert_each_once(store, journal)
    await store.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["sqlite", "file"])
async def test_native_cancel_during_error_path(kind: str, tmp_path: Path) -> None:
    store = await open_store(kind, tmp_path)
    journal: list[str] = []
    hold_a, b_run = a_holds_b_raises(RuntimeError("bug in b"))
    machine = machine_of(journal, a_landed=hold_a, b_run=b_run)
    writing = asyncio.Event()

    async def pause(n: int) -> None:
        if n == 1:  # the first write of what is held: cancelled from outside meanwhile
            writing.set()
            await asyncio.sleep(5)

    hook_writes(store, keep_of_b, pause)
    task = asyncio.ensure_future(machine.run(Runtime(store=store), SID))
    await asyncio.wait_for(writing.wait(), LIMIT)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, LIMIT)
    assert task.cancelled()
    await assert_each_once(store, journal)
    await store.aclose()


# -- the store fails while the held records are written ---------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("which", ["keep_of_b", "receipt_of_a"])
async def test_transient_store_fault_in_error_path(kind: str, which: str, tmp_path: Path) -> None:
    store = await open_store(kind, tmp_path)
    journal: list[str] = []
    hold_a, b_run = a_holds_b_raises(RuntimeError("bug in b"))
    machine = machine_of(journal, a_landed=hold_a, b_run=b_run)

    async def fail_once(n: int) -> None:
        if n == 1:
            raise OSError("disk hiccup")

    hook_writes(store, keep_of_b if which == "keep_of_b" else receipt_of_a, fail_once)
    with pytest.raises(RuntimeError, match="bug in b") as raised:
        with anyio.fail_after(LIMIT):
            await machine.run(Runtime(store=store), SID)
    notes = getattr(raised.value, "__notes__", [])
    assert not [n for n in notes if "could not all be written" in n], notes
    await assert_each_once(store, journal)
    await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
async def test_lasting_store_fault_in_error_path_is_noted(kind: str, tmp_path: Path) -> None:
    store = await open_store(kind, tmp_path)
    journal: list[str] = []
    hold_a, b_run = a_holds_b_raises(RuntimeError("bug in b"))
    machine = machine_of(journal, a_landed=hold_a, b_run=b_run)

    async def fail(_: int) -> None:
        raise OSError("disk gone")

    hook_writes(store, keep_of_b, fail)
    with pytest.raises(RuntimeError, match="bug in b") as raised:
        with anyio.fail_after(LIMIT):
            await machine.run(Runtime(store=store), SID)
    notes = " ".join(getattr(raised.value, "__notes__", []))
    assert "could not all be written" in notes, notes
    assert "OSError" in notes, notes
    batches = await store.batches(SID)
    assert receipts_written(batches) in ([], ["a"]), "never twice"
    assert keeps_written(batches) == []
    await store.aclose()


# -- KeyboardInterrupt in a task ---------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("concurrency", [1, 2])
async def test_keyboard_interrupt_in_a_task(
    kind: str, concurrency: int, anyio_backend: str, tmp_path: Path
) -> None:
    if concurrency == 2 and anyio_backend == "asyncio":
        pytest.skip("asyncio lets it out of the loop at once: the subprocess test below")
    store = await open_store(kind, tmp_path)
    journal: list[str] = []
    if concurrency == 2:
        hold_a, b_run = a_holds_b_raises(KeyboardInterrupt())
    else:
        hold_a = None

        async def b_run() -> None:
            raise KeyboardInterrupt

    machine = machine_of(journal, a_landed=hold_a, b_run=b_run, concurrency=concurrency)
    with pytest.raises(KeyboardInterrupt):
        with anyio.fail_after(LIMIT):
            await machine.run(Runtime(store=store), SID)
    await assert_each_once(store, journal)
    await store.aclose()


# -- a task raises while a sibling's record write is in flight --------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stored", [False, True])
async def test_error_while_sibling_record_in_flight(
    kind: str, stored: bool, tmp_path: Path
) -> None:
    """``a``'s record write is under way (before, or after, the store took it) when ``b``
    raises: the task group cuts the write; ``a``'s receipt must end up stored once."""
    store = await open_store(kind, tmp_path)
    journal: list[str] = []
    writing = anyio.Event()

    async def b_run() -> None:
        await writing.wait()
        raise RuntimeError("bug in b")

    machine = machine_of(journal, b_run=b_run)
    inner = store.apply
    cut: list[bool] = []

    async def apply(batch: Any, **kw: Any) -> Any:
        if not receipt_of_a(batch) or cut:
            return await inner(batch, **kw)
        cut.append(True)
        written = await inner(batch, **kw) if stored else None
        writing.set()
        await anyio.sleep_forever()
        return written

    store.apply = apply
    with pytest.raises(RuntimeError, match="bug in b"):
        with anyio.fail_after(LIMIT):
            await machine.run(Runtime(store=store), SID)
    assert cut, "a's record write was in flight"
    await assert_each_once(store, journal)
    await store.aclose()


# -- the lease is lost mid-way ------------------------------------------------------------


@pytest.mark.anyio
async def test_lease_lost_then_task_error_writes_nothing_more(tmp_path: Path) -> None:
    """The process stalls (the event loop blocked) past the lease's ttl, another runner
    claims the session, then ``b`` raises: nothing is written after the loss."""
    store = await open_store("memory", tmp_path, expiring_leases=True)
    journal: list[str] = []
    a_landed = anyio.Event()
    stolen: list[Any] = []

    async def hold_a() -> None:
        a_landed.set()
        await anyio.sleep_forever()

    async def b_run() -> None:
        await a_landed.wait()
        time.sleep(0.8)  # noqa: ASYNC251 - a stalled process: renewals stop
        # Shielded: the run's renewal may find its lease lapsed first and cancel this
        # task (which of the two runs first after the stall is the scheduler's choice);
        # the other runner's claim is not the run's to cancel.
        with anyio.CancelScope(shield=True):
            stolen.append(await store.claim(SID, "thief", 30.0))
        raise RuntimeError("bug in b")

    machine = machine_of(journal, a_landed=hold_a, b_run=b_run)
    machine = StateMachine(machine.steps, lease=LeasePolicy(ttl=0.3))
    before = len(await store.batches(SID))
    with pytest.raises((RuntimeError, LeaseLostError)):
        with anyio.fail_after(LIMIT):
            await machine.run(Runtime(store=store), SID)
    assert getattr(stolen[0], "owner", None) == "thief", stolen
    batches = await store.batches(SID)
    assert len(batches) == before + 1, "only the intents (before the loss) were written"
    assert journal == ["a"]


def test_keyboard_interrupt_in_a_concurrent_task_under_asyncio_run(tmp_path: Path) -> None:
    """Under asyncio, ``KeyboardInterrupt`` in a task-group child leaves the event loop at
    once; ``asyncio.run`` then cancels the run, whose finalize must still write ``a``'s
    receipt and ``b``'s keep, once each (checked in a fresh process's store); and the
    process exits (it hung at exit when the run raised the interrupt a second time: see
    ``tests/test_attack35_interrupts.py``)."""
    import subprocess
    import sys

    here = Path(__file__).resolve().parent
    done = subprocess.run(
        [sys.executable, str(here / "_attack34c_ki_child.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": f"{here.parent}:{here}"},
        check=False,
    )
    assert done.returncode == 130, done.stderr[-2000:]
    assert "KeyboardInterrupt" in done.stderr, done.stderr[-2000:]
    assert (tmp_path / "journal.txt").read_text() == "a\n"

    async def check() -> None:
        store = await open_store_existing(tmp_path)
        await assert_each_once(store, ["a"])
        await store.aclose()

    anyio.run(check)


async def open_store_existing(tmp: Path) -> Any:
    from _attack34a_common import Order

    from stepmachine import Codec
    from stepmachine.stores import SQLiteStore

    return await SQLiteStore.open(tmp / "db.sqlite3", codec=Codec(Order))


# -- another writer moves the session on while the held records are written ------------


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["memory", "sqlite", "file"])
async def test_other_writer_during_error_path(kind: str, tmp_path: Path) -> None:
    """Each held record's first write loses the race to another writer (a batch lands just
    before it): each is computed again from the stored session and written once; the
    other writer's batches stay."""
    from stepmachine import UpdateData, submit

    store = await open_store(kind, tmp_path)
    journal: list[str] = []
    hold_a, b_run = a_holds_b_raises(RuntimeError("bug in b"))
    machine = machine_of(journal, a_landed=hold_a, b_run=b_run)
    inner = store.apply
    raced: set[str] = set()

    async def apply(batch: Any, **kw: Any) -> Any:
        for field, name in (("kept", "b"), ("receipts", "a")):
            if is_record_of(batch, field, name) and name not in raced:
                raced.add(name)
                stored = await store.load(SID)
                await submit(store, SID, [UpdateData.set(count=stored.data.count + 1)])
        return await inner(batch, **kw)

    store.apply = apply
    with pytest.raises(RuntimeError, match="bug in b"):
        with anyio.fail_after(LIMIT):
            await machine.run(Runtime(store=store), SID)
    assert raced == {"a", "b"}
    await assert_each_once(store, journal)
    assert (await store.load(SID)).data.count == 2
    await store.aclose()


# -- a task not yet started (waiting its turn), and a landed hook that raises ----------


async def three_tasks(kind: str, tmp_path: Path, *, guarded: bool) -> tuple[list[str], Any]:
    """Three tasks, two at a time: ``a`` lands, ``b`` raises, ``c`` waits its turn."""
    from _attack34a_common import StagedStep, keep_record, receipt_record

    from stepmachine import Staged, Task, UpdateData, Yield

    store = await open_store(kind, tmp_path)
    journal: list[str] = []
    landed = anyio.Event()

    async def hold() -> None:
        landed.set()
        await anyio.sleep_forever()

    async def run_a() -> Any:
        journal.append("a")
        return receipt_record("a", "ra")

    raised: list[bool] = []

    async def run_b() -> Any:
        await landed.wait()
        raised.append(True)
        raise RuntimeError("bug in b")

    async def run_c() -> Any:
        # its side effect, before any checkpoint; noted if its sibling had raised already
        journal.append("c after b raised" if raised else "c")
        return receipt_record("c", "rc")

    def make(ctx: Any) -> Staged:
        return Staged(
            [UpdateData.set(keys={"a": "k", "b": "k", "c": "k"})],
            [
                Task("a", run_a, landed=hold, guarded=guarded),
                Task("b", run_b, keep=keep_record("b", "kept"), guarded=guarded),
                Task("c", run_c, keep=keep_record("c", "kept"), guarded=guarded),
            ],
            max_concurrency=2,
            then=lambda: Yield([], "done"),
        )

    with pytest.raises(RuntimeError, match="bug in b"):
        with anyio.fail_after(LIMIT):
            await StateMachine([StagedStep(make)]).run(Runtime(store=store), SID)
    batches = await store.batches(SID)
    await store.aclose()
    return journal, batches


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["sqlite", "file"])
async def test_guarded_task_waiting_its_turn_never_starts_after_an_error(
    kind: str, tmp_path: Path
) -> None:
    """On the lock-file stores the lease's confirmation is a checkpoint: the group's
    cancellation stops ``c`` there (20 of 20 on each backend when measured)."""
    journal, batches = await three_tasks(kind, tmp_path, guarded=True)
    assert "c after b raised" not in journal, journal
    assert receipts_written(batches) == [n for n in ("c", "a") if n in journal]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # trio draws who gets a slot first
@pytest.mark.anyio
@pytest.mark.parametrize(
    ("kind", "guarded"),
    [("memory", True), ("memory", False), ("sqlite", False), ("file", False)],
)
async def test_task_waiting_its_turn_never_starts_after_an_error(
    kind: str, guarded: bool, tmp_path: Path
) -> None:
    journal, _ = await three_tasks(kind, tmp_path, guarded=guarded)
    assert "c after b raised" not in journal, journal


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
async def test_landed_hook_raising_keeps_the_tasks_result(kind: str, tmp_path: Path) -> None:
    from _attack34a_common import StagedStep, receipt_record

    from stepmachine import Staged, Task, UpdateData

    store = await open_store(kind, tmp_path)
    journal: list[str] = []

    async def run_a() -> Any:
        journal.append("a")
        return receipt_record("a", "ra")

    async def landed_raises() -> None:
        raise RuntimeError("bug in the landed hook")

    def make(ctx: Any) -> Staged:
        return Staged([UpdateData.set(keys={"a": "k"})], [Task("a", run_a, landed=landed_raises)])

    with pytest.raises(RuntimeError, match="landed hook"):
        await StateMachine([StagedStep(make)]).run(Runtime(store=store), SID)
    assert receipts_written(await store.batches(SID)) == ["a"], "its result exists: written"
    assert journal == ["a"]
    await store.aclose()
