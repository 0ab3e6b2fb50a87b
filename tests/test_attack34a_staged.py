"""Attack 34a: ``Staged`` work of a third-party step, in one process (asyncio and trio).

A step charges several cards, each a guarded ``Task`` with an idempotency key as its
intent and a receipt as its record (computed from the session as stored). Attacked:
a sibling task raising while a finished task's record waits to be written, a
cancellation (the machine's token, an anyio cancel scope, asyncio's ``task.cancel()``)
mid-way through concurrent tasks, ``then()`` raising, ``refused`` whose replacement is
refused too, a record that raises, effects that do not apply, empty intents, zero
tasks, a lazy (generator) record after a conflict, another writer moving the session
on between records, and ``run_step`` against the real machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from _attack34a_common import Order, StagedStep, keep_record, receipt_record

from stepmachine import (
    CancelToken,
    Codec,
    Continue,
    Effect,
    EffectError,
    Runtime,
    Session,
    Staged,
    StateMachine,
    StepApplied,
    StepContext,
    Task,
    UpdateData,
    Yield,
    submit,
)
from stepmachine.extend import counter_ids
from stepmachine.stores import SQLiteStore
from stepmachine.testing import run_step

SID = "order"


async def open_store(tmp_path: Path) -> SQLiteStore:
    store = await SQLiteStore.open(tmp_path / "db.sqlite3", codec=Codec(Order))
    await store.create(SID, data=Order())
    return store


async def receipt_additions(store: Any) -> list[str]:
    """Every receipt name added, batch by batch, in order (a name twice: written twice)."""
    added: list[str] = []
    seen: set[str] = set()
    for batch in await store.batches(SID):
        for effect in batch.effects:
            if isinstance(effect, UpdateData) and "receipts" in effect.changes:
                names = set(effect.changes["receipts"])
                added.extend(sorted(names - seen))
                seen = names
    return added


class Journal:
    """What took effect outside the session (the payment provider's side)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def charge(self, name: str, key: str) -> str:
        self.lines.append(f"{name} {key}")
        return f"receipt-{name}"


def charge_task(
    journal: Journal,
    name: str,
    key: str,
    *,
    before: Callable[[], Awaitable[None]] | None = None,
    landed: Callable[[], Awaitable[None]] | None = None,
    keep: bool = False,
) -> Task:
    async def run() -> Callable[[Session[Any]], Sequence[Effect]]:
        if before is not None:
            await before()
        receipt = journal.charge(name, key)
        return receipt_record(name, receipt)

    return Task(
        name,
        run,
        guarded=True,
        landed=landed,
        keep=keep_record(name, "kept") if keep else None,
    )


def intents(ctx: StepContext[Order], names: Sequence[str]) -> tuple[list[Effect], dict[str, str]]:
    keys = {name: ctx.new_id() for name in names}
    return [UpdateData.set(keys=keys)], keys


# -- a sibling's error while a finished task's record waits -----------------------------


async def test_sibling_error_keeps_a_landed_result(tmp_path: Path) -> None:
    """A task that returned (its charge made) and waits in ``landed`` when a sibling raises:
    its record is written before the error propagates (it was lost before 2026-12-07)."""
    store = await open_store(tmp_path)
    journal = Journal()
    a_landed = anyio.Event()

    async def hold_a() -> None:
        a_landed.set()
        await anyio.sleep_forever()  # the landed hook: "an interrupt there loses nothing"

    async def b_fails() -> None:
        await a_landed.wait()
        raise RuntimeError("card b declined by a bug")

    def make(ctx: StepContext[Order]) -> Staged:
        effects, keys = intents(ctx, ["a", "b"])
        tasks = [
            charge_task(journal, "a", keys["a"], landed=hold_a),
            charge_task(journal, "b", keys["b"], before=b_fails),
        ]
        return Staged(effects, tasks, max_concurrency=2, then=lambda: Yield([], "done"))

    machine = StateMachine([StagedStep(make)])
    with pytest.raises(RuntimeError, match="declined by a bug"):
        with anyio.fail_after(30):
            await machine.run(Runtime(store=store), SID)
    stored = await store.load(SID)
    assert [line.split()[0] for line in journal.lines] == ["a"]
    assert stored.data.receipts == {"a": "receipt-a"}, "charge a took effect: its receipt"
    await store.aclose()


async def test_a_refused_record_keeps_a_landed_siblings_record(tmp_path: Path) -> None:
    """The store refuses one task's record for good (``EffectError``, no ``refused``) while a
    sibling that returned waits in ``landed``: the sibling's record is written, the refused
    one is not, and the ``EffectError`` propagates."""
    store = await open_store(tmp_path)
    journal = Journal()
    b_landed = anyio.Event()

    async def hold_b() -> None:
        b_landed.set()
        await anyio.sleep_forever()

    def a_refused(stored: Session[Any]) -> Sequence[Effect]:
        return [UpdateData(changes={"receipts": "not a dict"})]

    def make(ctx: StepContext[Order]) -> Staged:
        effects, keys = intents(ctx, ["a", "b"])

        async def a_runs() -> Callable[[Session[Any]], Sequence[Effect]]:
            await b_landed.wait()
            journal.charge("a", keys["a"])
            return a_refused

        tasks = [
            Task("a", a_runs, guarded=True),
            charge_task(journal, "b", keys["b"], landed=hold_b),
        ]
        return Staged(effects, tasks, max_concurrency=2)

    with pytest.raises(EffectError):
        with anyio.fail_after(30):
            await StateMachine([StagedStep(make)]).run(Runtime(store=store), SID)
    assert sorted(line.split()[0] for line in journal.lines) == ["a", "b"]
    assert (await store.load(SID)).data.receipts == {"b": "receipt-b"}
    assert await receipt_additions(store) == ["b"]
    await store.aclose()


async def test_sibling_error_keeps_records_already_written(tmp_path: Path) -> None:
    """One after another: the first charge's record is written before the second raises."""
    store = await open_store(tmp_path)
    journal = Journal()

    async def b_fails() -> None:
        raise RuntimeError("b declined")

    def make(ctx: StepContext[Order]) -> Staged:
        effects, keys = intents(ctx, ["a", "b", "c"])
        tasks = [
            charge_task(journal, "a", keys["a"]),
            charge_task(journal, "b", keys["b"], before=b_fails),
            charge_task(journal, "c", keys["c"]),
        ]
        return Staged(effects, tasks)

    with pytest.raises(RuntimeError, match="b declined"):
        await StateMachine([StagedStep(make)]).run(Runtime(store=store), SID)
    stored = await store.load(SID)
    assert stored.data.receipts == {"a": "receipt-a"}
    assert [line.split()[0] for line in journal.lines] == ["a"]  # c never started
    assert await receipt_additions(store) == ["a"]
    # the next run sees b's intent without a receipt: outcome unknown, nothing charged
    report = await StateMachine([StagedStep(make)]).run_report(Runtime(store=store), SID)
    assert report.reason.kind == "outcome_unknown"
    assert len(journal.lines) == 1
    await store.aclose()


# -- cancellation mid-way through concurrent tasks ----------------------------------------


class Scenario:
    """Four charges at once: ``a`` recorded, ``b`` returned and held (in ``landed``),
    ``c`` and ``d`` running (with a keep) when the cancel fires.

    (All at once: trio starts tasks in a random order, so which task waits for a slot
    of a smaller limit is not deterministic; a task not yet started is attacked with
    ``max_concurrency=1`` below.)"""

    def __init__(self) -> None:
        self.journal = Journal()
        self.a_recorded = anyio.Event()
        self.c_started = anyio.Event()
        self.d_started = anyio.Event()
        self.b_landed = anyio.Event()
        self.fire: Callable[[], None] = lambda: None

    def make(self, ctx: StepContext[Order]) -> Staged:
        effects, keys = intents(ctx, ["a", "b", "c", "d"])

        async def a_returns() -> None:
            return None

        async def b_waits() -> None:
            await self.a_recorded.wait()

        async def b_landed() -> None:
            self.b_landed.set()
            await self.c_started.wait()
            await self.d_started.wait()
            self.fire()
            await anyio.sleep_forever()

        async def c_runs() -> None:
            self.c_started.set()
            await anyio.sleep_forever()

        async def d_runs() -> None:
            self.d_started.set()
            await anyio.sleep_forever()

        def recorded_a(stored: Session[Any]) -> Sequence[Effect]:
            effects = receipt_record("a", "receipt-a")(stored)
            self.a_recorded.set()  # computed: written right after (sequenced by the lock)
            return effects

        async def run_a() -> Callable[[Session[Any]], Sequence[Effect]]:
            self.journal.charge("a", keys["a"])
            return recorded_a

        tasks = [
            Task("a", run_a, guarded=True),
            charge_task(self.journal, "b", keys["b"], before=b_waits, landed=b_landed),
            charge_task(self.journal, "c", keys["c"], before=c_runs, keep=True),
            charge_task(self.journal, "d", keys["d"], before=d_runs, keep=True),
        ]
        return Staged(effects, tasks, max_concurrency=4, then=lambda: Yield([], "done"))


async def check_cancelled(store: Any, scenario: Scenario) -> None:
    stored = await store.load(SID)
    assert sorted(line.split()[0] for line in scenario.journal.lines) == ["a", "b"]
    assert stored.data.receipts == {"a": "receipt-a", "b": "receipt-b"}
    assert await receipt_additions(store) == ["a", "b"], "each result written exactly once"
    assert stored.data.kept == dict.fromkeys("cd", "kept"), "cancelled tasks record their keep"


async def test_token_cancel_keeps_every_finished_result(tmp_path: Path) -> None:
    store = await open_store(tmp_path)
    scenario = Scenario()
    token = CancelToken()
    scenario.fire = token.cancel
    machine = StateMachine([StagedStep(scenario.make)], cancel=token)
    with anyio.fail_after(30):
        report = await machine.run_report(Runtime(store=store), SID)
    assert report.reason.kind == "cancelled"
    await check_cancelled(store, scenario)
    await store.aclose()


async def test_scope_cancel_keeps_every_finished_result(tmp_path: Path) -> None:
    store = await open_store(tmp_path)
    scenario = Scenario()
    machine = StateMachine([StagedStep(scenario.make)])
    with anyio.fail_after(30):
        with anyio.CancelScope() as scope:
            scenario.fire = scope.cancel
            await machine.run(Runtime(store=store), SID)
    assert scope.cancelled_caught
    await check_cancelled(store, scenario)
    await store.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # native cancellation
async def test_native_task_cancel_keeps_every_finished_result(tmp_path: Path) -> None:
    store = await open_store(tmp_path)
    scenario = Scenario()
    machine = StateMachine([StagedStep(scenario.make)])
    run = asyncio.ensure_future(machine.run(Runtime(store=store), SID))
    scenario.fire = run.cancel
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(run, 30)
    await check_cancelled(store, scenario)
    await store.aclose()


@pytest.mark.parametrize("how", ["token", "scope"])
async def test_cancel_one_after_another_keeps_running_and_unstarted(
    tmp_path: Path, how: str
) -> None:
    """``max_concurrency=1``: ``a`` recorded, ``b`` cancelled while it runs, ``c`` never
    started: ``a`` once, ``b`` and ``c`` their keep, nothing charged after ``a``."""
    store = await open_store(tmp_path)
    journal = Journal()
    token = CancelToken()
    fire: list[Callable[[], None]] = [token.cancel]

    async def b_runs() -> None:
        fire[0]()
        await anyio.sleep_forever()

    def make(ctx: StepContext[Order]) -> Staged:
        effects, keys = intents(ctx, ["a", "b", "c"])
        tasks = [
            charge_task(journal, "a", keys["a"]),
            charge_task(journal, "b", keys["b"], before=b_runs, keep=True),
            charge_task(journal, "c", keys["c"], keep=True),
        ]
        return Staged(effects, tasks, then=lambda: Yield([], "done"))

    with anyio.fail_after(30):
        if how == "token":
            machine = StateMachine([StagedStep(make)], cancel=token)
            report = await machine.run_report(Runtime(store=store), SID)
            assert report.reason.kind == "cancelled"
        else:
            with anyio.CancelScope() as scope:
                fire[0] = scope.cancel
                await StateMachine([StagedStep(make)]).run(Runtime(store=store), SID)
            assert scope.cancelled_caught
    stored = await store.load(SID)
    assert [line.split()[0] for line in journal.lines] == ["a"]
    assert stored.data.receipts == {"a": "receipt-a"}
    assert await receipt_additions(store) == ["a"]
    assert stored.data.kept == {"b": "kept", "c": "kept"}
    await store.aclose()


# -- then(), refused, a record that raises, effects that do not apply ------------------


def one_charge(
    journal: Journal,
    *,
    then: Callable[[], Continue | Yield] | None = None,
    record: Callable[[Session[Any]], Sequence[Effect]] | None = None,
    refused: Callable[[Exception], Any] | None = None,
    names: Sequence[str] = ("a",),
) -> Callable[[StepContext[Order]], Staged]:
    def make(ctx: StepContext[Order]) -> Staged:
        effects, keys = intents(ctx, names)
        tasks = []
        for name in names:

            async def run(name: str = name) -> Callable[[Session[Any]], Sequence[Effect]]:
                receipt = journal.charge(name, keys[name])
                if record is not None and name == names[-1]:
                    return record
                return receipt_record(name, receipt)

            tasks.append(Task(name, run, guarded=True, refused=refused))
        return Staged(effects, tasks, then=then)

    return make


async def machine_and_kit(
    tmp_path: Path, make: Callable[[StepContext[Order]], Staged]
) -> tuple[BaseException | None, BaseException | None, Any, Any]:
    """Run ``make``'s step on the machine and in ``run_step``; each's error and result."""
    store = await open_store(tmp_path)
    machine_error: BaseException | None = None
    try:
        await StateMachine([StagedStep(make)]).run(Runtime(store=store, ids=counter_ids("id")), SID)
    except Exception as exc:
        machine_error = exc
    stored = await store.load(SID)
    batches = [tuple(b.effects) for b in await store.batches(SID)]
    await store.aclose()
    kit_error: BaseException | None = None
    check = None
    try:
        check = await run_step(
            StagedStep(make), Session(id=SID, revision=0, conversation=(), data=Order())
        )
    except Exception as exc:
        kit_error = exc
    return machine_error, kit_error, (stored, batches), check


async def test_then_raising_keeps_records_and_propagates(tmp_path: Path) -> None:
    journal = Journal()

    def then() -> Yield:
        raise LookupError("then failed")

    make = one_charge(journal, then=then, names=("a", "b"))
    machine_error, kit_error, (stored, batches), _ = await machine_and_kit(tmp_path, make)
    assert isinstance(machine_error, LookupError)
    assert isinstance(kit_error, LookupError)
    assert stored.data.receipts == {"a": "receipt-a", "b": "receipt-b"}
    assert len(batches) == 3  # intents, a, b


async def test_refused_replacement_refused_too_propagates_its_error(tmp_path: Path) -> None:
    journal = Journal()
    offered: list[str] = []

    def bad(stored: Session[Any]) -> Sequence[Effect]:
        return [UpdateData(changes={"no_such_field": 1})]

    def also_bad(stored: Session[Any]) -> Sequence[Effect]:
        return [UpdateData(changes={"also_missing": 2})]

    def refused(exc: Exception) -> Any:
        offered.append(str(exc))
        return also_bad

    make = one_charge(journal, record=bad, refused=refused, names=("a", "b"))
    machine_error, kit_error, (stored, batches), _ = await machine_and_kit(tmp_path, make)
    assert isinstance(machine_error, EffectError)
    assert "also_missing" in str(machine_error)
    assert isinstance(kit_error, EffectError)
    assert "also_missing" in str(kit_error)
    assert len(offered) == 2
    assert all("no_such_field" in o for o in offered)  # once per run
    assert stored.data.receipts == {"a": "receipt-a"}  # the earlier record stays
    assert len(batches) == 2


async def test_refused_replacement_is_written(tmp_path: Path) -> None:
    journal = Journal()

    def bad(stored: Session[Any]) -> Sequence[Effect]:
        return [UpdateData(changes={"no_such_field": 1})]

    make = one_charge(
        journal, record=bad, refused=lambda exc: keep_record("a", "refused"), names=("a",)
    )
    machine_error, kit_error, (stored, batches), check = await machine_and_kit(tmp_path, make)
    assert machine_error is None
    assert kit_error is None
    assert stored.data.kept == {"a": "refused"}
    assert [b[-1] for b in batches] == [UpdateData.set(keys={"a": "id1"}), check.commits[-1][-1]]
    assert check.session.data == stored.data


async def test_run_step_commits_leave_out_a_refused_batch(tmp_path: Path) -> None:
    """``StepCheck.commits`` lists the batches the machine writes: not one that was refused."""
    journal = Journal()

    def bad(stored: Session[Any]) -> Sequence[Effect]:
        return [UpdateData(changes={"no_such_field": 1})]

    make = one_charge(
        journal, record=bad, refused=lambda exc: keep_record("a", "refused"), names=("a",)
    )
    machine_error, kit_error, (_, batches), check = await machine_and_kit(tmp_path, make)
    assert machine_error is None
    assert kit_error is None
    assert check.commits == tuple(batches), "StepCheck.commits: the batches written"


async def test_a_record_of_non_effects_is_a_step_contract_error(tmp_path: Path) -> None:
    """A record returning something that is not an effect: the same ``StepContractError``,
    naming the task, from the machine and from ``run_step``; only the intents are written."""
    from stepmachine import StepContractError

    journal = Journal()

    def oops(stored: Session[Any]) -> Sequence[Effect]:
        return ["oops"]  # type: ignore[list-item]

    make = one_charge(journal, record=oops)
    machine_error, kit_error, (stored, batches), _ = await machine_and_kit(tmp_path, make)
    for error in (machine_error, kit_error):
        assert isinstance(error, StepContractError)
        assert "the record of task 'a' returned 'oops'" in str(error)
    assert len(batches) == 1  # the intents only
    assert not stored.data.receipts


async def test_record_raising_propagates_after_intents(tmp_path: Path) -> None:
    journal = Journal()

    def broken(stored: Session[Any]) -> Sequence[Effect]:
        raise ZeroDivisionError("record bug")

    make = one_charge(journal, record=broken)
    machine_error, kit_error, (stored, batches), _ = await machine_and_kit(tmp_path, make)
    assert isinstance(machine_error, ZeroDivisionError)
    assert isinstance(kit_error, ZeroDivisionError)
    assert stored.data.keys
    assert not stored.data.receipts
    assert len(batches) == 1  # the intents only


async def test_effects_that_do_not_apply_without_refused(tmp_path: Path) -> None:
    journal = Journal()

    def bad(stored: Session[Any]) -> Sequence[Effect]:
        return [UpdateData(changes={"receipts": "not a dict"})]

    make = one_charge(journal, record=bad)
    machine_error, kit_error, (stored, batches), _ = await machine_and_kit(tmp_path, make)
    assert isinstance(machine_error, EffectError)
    assert isinstance(kit_error, EffectError)
    assert len(batches) == 1
    assert not stored.data.receipts


# -- degenerate shapes: no intents, no tasks ------------------------------------------------


async def test_no_intents_one_task(tmp_path: Path) -> None:
    journal = Journal()
    asked: list[int] = []

    def make(ctx: StepContext[Order]) -> Staged:
        async def run() -> Callable[[Session[Any]], Sequence[Effect]]:
            journal.charge("a", "k")
            return receipt_record("a", "receipt-a")

        def then() -> Yield:
            asked.append(1)
            return Yield([], "done")

        return Staged([], [Task("a", run, guarded=True)], then=then)

    class Once(StagedStep):
        async def run(self, ctx: StepContext[Order]) -> Any:
            from stepmachine import Refuse

            if ctx.session.data.receipts:
                return Refuse("done")
            return make(ctx)

    store = await open_store(tmp_path)
    report = await StateMachine([Once(make)]).run_report(Runtime(store=store), SID)
    assert report.reason.kind == "done"
    assert asked == [1]
    batches = await store.batches(SID)
    assert len(batches) == 1
    assert (await store.load(SID)).data.receipts == {"a": "receipt-a"}
    check = await run_step(Once(make), Session(id=SID, revision=0, conversation=(), data=Order()))
    assert check.commits == tuple(tuple(b.effects) for b in batches)
    await store.aclose()


async def test_intents_and_zero_tasks(tmp_path: Path) -> None:
    asked: list[int] = []

    def make(ctx: StepContext[Order]) -> Staged:
        def then() -> Yield:
            asked.append(1)
            return Yield([UpdateData.set(count=7)], "done")

        return Staged([UpdateData.set(keys={"x": "k"}, receipts={"x": "r"})], [], then=then)

    store = await open_store(tmp_path)
    events: list[Any] = []

    class Sink:
        async def emit(self, event: Any) -> None:
            events.append(event.data)

    report = await StateMachine([StagedStep(make)]).run_report(
        Runtime(store=store), SID, emitter=Sink()
    )
    assert report.reason.kind == "done"
    assert asked == [1]
    stored = await store.load(SID)
    assert stored.data.count == 7
    assert stored.revision == 2
    statuses = [e.status for e in events if isinstance(e, StepApplied)]
    assert statuses == ["committed", "yielded"]
    await store.aclose()


def test_empty_staged_is_refused_at_construction() -> None:
    from stepmachine import ConfigurationError

    with pytest.raises(ConfigurationError):
        Staged([], [])


# -- another writer moving the session on; a lazy record -----------------------------------


async def test_other_writer_between_records_and_lazy_record(tmp_path: Path) -> None:
    """Task ``b`` submits two outside batches before it returns: ``b``'s record conflicts,
    is computed again (a generator each time) from the stored session; nothing is lost."""
    store = await open_store(tmp_path)
    journal = Journal()
    computed: list[int] = []

    def make(ctx: StepContext[Order]) -> Staged:
        effects, keys = intents(ctx, ["a", "b"])

        async def run_b() -> Callable[[Session[Any]], Sequence[Effect]]:
            journal.charge("b", keys["b"])
            for _ in range(2):
                await submit(store, SID, lambda s: [UpdateData.set(count=s.data.count + 1)])

            def lazy(stored: Session[Any]) -> Iterator[Effect]:
                computed.append(stored.revision)
                if "b" not in stored.data.receipts:
                    yield UpdateData.set(receipts={**stored.data.receipts, "b": "receipt-b"})

            return lazy

        tasks = [charge_task(journal, "a", keys["a"]), Task("b", run_b, guarded=True)]
        return Staged(effects, tasks, then=lambda: Yield([], "done"))

    report = await StateMachine([StagedStep(make)]).run_report(Runtime(store=store), SID)
    assert report.reason.kind == "done"
    stored = await store.load(SID)
    assert stored.data.receipts == {"a": "receipt-a", "b": "receipt-b"}
    assert stored.data.count == 2, "the other writer's batches are kept"
    assert len(computed) == 2
    assert computed[-1] == 4  # again, from the stored session
    assert await receipt_additions(store) == ["a", "b"]
    await store.aclose()


# -- run_step against the machine ------------------------------------------------------------


async def test_run_step_matches_machine(tmp_path: Path) -> None:
    journal = Journal()

    def make(ctx: StepContext[Order]) -> Staged:
        effects, keys = intents(ctx, ["a", "b", "c"])
        tasks = [charge_task(journal, n, keys[n]) for n in ("a", "b", "c")]
        return Staged(
            effects, tasks, max_concurrency=1, then=lambda: Yield([UpdateData.set(count=1)], "done")
        )

    store = await open_store(tmp_path)
    await StateMachine([StagedStep(make)]).run(Runtime(store=store, ids=counter_ids("id")), SID)
    batches = tuple(tuple(b.effects) for b in await store.batches(SID))
    check = await run_step(
        StagedStep(make), Session(id=SID, revision=0, conversation=(), data=Order())
    )
    assert (*check.commits, check.effects) == batches
    assert check.session.data == (await store.load(SID)).data
    await store.aclose()


# -- another writer that wins every race; a lease lost between guarded tasks -----------------


class Harasser:
    """A session loader that lets another writer move the session on right after every
    load, while ``left`` says so: every write computed from a load then conflicts."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.left = 0

    async def load(self, session_id: str) -> Session[Any]:
        session = await self.store.load(session_id)
        if self.left > 0:
            self.left -= 1
            await submit(self.store, session_id, lambda s: [UpdateData.set(count=s.data.count + 1)])
        return session


async def test_record_retried_past_many_lost_races(tmp_path: Path) -> None:
    """40 conflicts in a row, each explained by another writer's batch (more than the 16
    a stalled store gets, more than ``max_conflicts``): the receipt is still written,
    once, and ``then()``'s last answer counts."""
    store = await open_store(tmp_path)
    harasser = Harasser(store)
    journal = Journal()
    computed: list[int] = []
    asked: list[int] = []

    def make(ctx: StepContext[Order]) -> Staged:
        effects, keys = intents(ctx, ["a"])

        async def run() -> Callable[[Session[Any]], Sequence[Effect]]:
            journal.charge("a", keys["a"])
            await submit(store, SID, lambda s: [UpdateData.set(count=s.data.count + 1)])
            harasser.left = 40  # the first attempt conflicts; 40 reloads lose the race too

            def record(stored: Session[Any]) -> Sequence[Effect]:
                computed.append(stored.revision)
                return receipt_record("a", "receipt-a")(stored)

            return record

        def then() -> Yield:
            asked.append(len(computed))
            return Yield([], f"done after {len(computed)}")

        return Staged(effects, [Task("a", run, guarded=True)], then=then)

    runtime = Runtime(store=store, loader=harasser)
    with anyio.fail_after(60):
        report = await StateMachine([StagedStep(make)], max_conflicts=2).run_report(runtime, SID)
    stored = await store.load(SID)
    assert stored.data.receipts == {"a": "receipt-a"}
    assert stored.data.count == 41
    assert len(computed) == 42
    assert asked == list(range(1, 43))
    assert report.reason.kind == "done after 42"
    assert await receipt_additions(store) == ["a"]
    await store.aclose()


async def test_guarded_task_not_started_after_the_lease_is_lost() -> None:
    """The run's (expiring) lease lapses and another runner claims the session while task
    ``a`` runs: ``b`` (guarded) is not started, the run raises ``LeaseLostError``."""
    from stepmachine import LeaseLostError
    from stepmachine.stores import MemoryStore

    now = [1000.0]
    store = MemoryStore(Codec(Order), expiring_leases=True)
    store._leases._clock = lambda: now[0]  # a clock the test moves
    await store.create(SID, data=Order())
    journal = Journal()

    async def lapse() -> None:
        now[0] += 3600  # past any ttl
        stolen = await store.claim(SID, "another runner", 30.0)
        assert getattr(stolen, "owner", None) == "another runner"  # a Lease, not a LeaseHolder

    def make(ctx: StepContext[Order]) -> Staged:
        effects, keys = intents(ctx, ["a", "b"])
        tasks = [
            charge_task(journal, "a", keys["a"], landed=lapse),
            charge_task(journal, "b", keys["b"]),
        ]
        return Staged(effects, tasks)

    with pytest.raises(LeaseLostError):
        await StateMachine([StagedStep(make)]).run(Runtime(store=store), SID)
    assert [line.split()[0] for line in journal.lines] == ["a"]
    stored = await store.load(SID)
    assert "b" not in stored.data.receipts


async def test_then_raising_once_then_answering_after_a_conflict(tmp_path: Path) -> None:
    """``then()`` raises when first asked; the record conflicts (another writer), is
    computed again, and ``then()`` answers: the last answer counts, the run yields."""
    store = await open_store(tmp_path)
    answers: list[str] = []

    def make(ctx: StepContext[Order]) -> Staged:
        effects, _ = intents(ctx, ["a"])

        async def run() -> Callable[[Session[Any]], Sequence[Effect]]:
            await submit(store, SID, lambda s: [UpdateData.set(count=s.data.count + 1)])
            return receipt_record("a", "receipt-a")

        def then() -> Yield:
            answers.append("asked")
            if len(answers) == 1:
                raise LookupError("not yet")
            return Yield([], "done")

        return Staged(effects, [Task("a", run, guarded=True)], then=then)

    report = await StateMachine([StagedStep(make)]).run_report(Runtime(store=store), SID)
    assert answers == ["asked", "asked"]
    assert report.reason.kind == "done"
    assert (await store.load(SID)).data.receipts == {"a": "receipt-a"}
    await store.aclose()


async def test_finalize_offers_a_held_refused_record_to_refused(tmp_path: Path) -> None:
    """Cancelled while ``a``'s record is held (in ``landed``); the store refuses that
    record at finalize: ``refused``'s replacement is written, once."""
    store = await open_store(tmp_path)
    token = CancelToken()
    offered: list[str] = []

    def bad(stored: Session[Any]) -> Sequence[Effect]:
        return [UpdateData(changes={"no_such_field": 1})]

    def refused(exc: Exception) -> Any:
        offered.append(type(exc).__name__)
        return keep_record("a", "refused")

    async def landed() -> None:
        token.cancel()
        await anyio.sleep_forever()

    def make(ctx: StepContext[Order]) -> Staged:
        effects, _ = intents(ctx, ["a"])

        async def run() -> Callable[[Session[Any]], Sequence[Effect]]:
            return bad

        return Staged(effects, [Task("a", run, guarded=True, landed=landed, refused=refused)])

    with anyio.fail_after(30):
        report = await StateMachine([StagedStep(make)], cancel=token).run_report(
            Runtime(store=store), SID
        )
    assert report.reason.kind == "cancelled"
    assert offered == ["EffectError"]
    stored = await store.load(SID)
    assert stored.data.kept == {"a": "refused"}
    kept_batches = [
        b for b in await store.batches(SID) if any("kept" in e.changes for e in b.effects)
    ]
    assert len(kept_batches) == 1
    await store.aclose()


async def test_sibling_error_records_a_running_tasks_keep(tmp_path: Path) -> None:
    """A task cut while it runs because a sibling raised records its ``keep``, as after a
    cancellation."""
    store = await open_store(tmp_path)
    journal = Journal()
    a_running = anyio.Event()

    async def a_runs() -> None:
        a_running.set()
        await anyio.sleep_forever()

    async def b_fails() -> None:
        await a_running.wait()
        raise RuntimeError("b declined")

    def make(ctx: StepContext[Order]) -> Staged:
        effects, keys = intents(ctx, ["a", "b"])
        tasks = [
            charge_task(journal, "a", keys["a"], before=a_runs, keep=True),
            charge_task(journal, "b", keys["b"], before=b_fails),
        ]
        return Staged(effects, tasks, max_concurrency=2)

    with pytest.raises(RuntimeError, match="b declined"):
        with anyio.fail_after(30):
            await StateMachine([StagedStep(make)]).run(Runtime(store=store), SID)
    assert journal.lines == []
    assert (await store.load(SID)).data.kept == {"a": "kept"}
    await store.aclose()


@pytest.mark.parametrize("returned", [None, "done"])
async def test_then_returning_a_non_outcome_keeps_the_last_record(
    tmp_path: Path, returned: Any
) -> None:
    """``then()`` returning a non-outcome is a ``StepContractError``, raised after the last
    record (the charge made) is written."""
    from stepmachine import StepContractError

    store = await open_store(tmp_path)
    journal = Journal()

    def make(ctx: StepContext[Order]) -> Staged:
        effects, keys = intents(ctx, ["a"])
        return Staged(effects, [charge_task(journal, "a", keys["a"])], then=lambda: returned)

    with pytest.raises(Exception) as raised:  # noqa: PT011 - checked below
        await StateMachine([StagedStep(make)]).run(Runtime(store=store), SID)
    assert len(journal.lines) == 1
    assert (await store.load(SID)).data.receipts == {"a": "receipt-a"}, "the charge's record"
    assert isinstance(raised.value, StepContractError), repr(raised.value)
    await store.aclose()


async def test_then_raising_after_the_only_record_keeps_it(tmp_path: Path) -> None:
    """The peer that holds: ``then()`` raising writes the record first, then raises."""
    store = await open_store(tmp_path)
    journal = Journal()

    def then() -> Yield:
        raise LookupError("then failed")

    def make(ctx: StepContext[Order]) -> Staged:
        effects, keys = intents(ctx, ["a"])
        return Staged(effects, [charge_task(journal, "a", keys["a"])], then=then)

    with pytest.raises(LookupError):
        await StateMachine([StagedStep(make)]).run(Runtime(store=store), SID)
    assert (await store.load(SID)).data.receipts == {"a": "receipt-a"}
    await store.aclose()


@pytest.mark.parametrize("how", ["token", "scope"])
async def test_cancel_right_after_a_record_is_stored_writes_it_once(
    tmp_path: Path, how: str
) -> None:
    """The cancellation lands in the announcement of ``a``'s record batch (stored, still
    held by the machine): finalize computes the record again from the stored session,
    which records nothing, so the receipt is written exactly once."""
    store = await open_store(tmp_path)
    journal = Journal()
    token = CancelToken()
    scopes: list[anyio.CancelScope] = []
    computed: list[int] = []

    class Emitter:
        async def emit(self, event: Any) -> None:
            data = event.data
            if isinstance(data, StepApplied) and data.new_revision == 2:  # a's record
                if how == "token":
                    token.cancel()
                else:
                    scopes[0].cancel()
                await anyio.lowlevel.checkpoint()

    def make(ctx: StepContext[Order]) -> Staged:
        effects, keys = intents(ctx, ["a", "b"])

        async def run_a() -> Callable[[Session[Any]], Sequence[Effect]]:
            journal.charge("a", keys["a"])

            def record(stored: Session[Any]) -> Sequence[Effect]:
                computed.append(stored.revision)
                return receipt_record("a", "receipt-a")(stored)

            return record

        tasks = [Task("a", run_a, guarded=True), charge_task(journal, "b", keys["b"], keep=True)]
        return Staged(effects, tasks, then=lambda: Yield([], "done"))

    machine = StateMachine([StagedStep(make)], cancel=token if how == "token" else None)
    with anyio.fail_after(30):
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            await machine.run(Runtime(store=store), SID, emitter=Emitter())
    stored = await store.load(SID)
    assert [line.split()[0] for line in journal.lines] == ["a"]
    assert stored.data.receipts == {"a": "receipt-a"}
    assert await receipt_additions(store) == ["a"]
    assert len(computed) == 2, "computed again by finalize"
    assert computed[0] == 1
    assert computed[1] >= 2, "from the stored session, with its own batch in it"
    assert stored.data.kept == {"b": "kept"}
    await store.aclose()


async def test_intents_that_do_not_apply_start_no_task(tmp_path: Path) -> None:
    journal = Journal()

    def make(ctx: StepContext[Order]) -> Staged:
        return Staged(
            [UpdateData(changes={"keys": "not a dict"})],
            [charge_task(journal, "a", "k")],
        )

    machine_error, kit_error, (stored, batches), _ = await machine_and_kit(tmp_path, make)
    assert isinstance(machine_error, EffectError)
    assert isinstance(kit_error, EffectError)
    assert journal.lines == []
    assert batches == []
    assert stored.revision == 0


async def test_intents_losing_the_race_decide_again_and_start_tasks_once(
    tmp_path: Path,
) -> None:
    """Another writer moves the session on while the step decides: the intents conflict,
    nothing of that decision is written or started; the step decides again."""
    store = await open_store(tmp_path)
    journal = Journal()
    decided: list[dict[str, str]] = []

    class Racing(StagedStep):
        async def run(self, ctx: StepContext[Order]) -> Any:
            outcome = await super().run(ctx)
            if isinstance(outcome, Staged) and not decided:
                await submit(store, SID, [UpdateData.set(count=1)])  # the race, lost
            if isinstance(outcome, Staged):
                decided.append(dict(outcome.intents[0].changes["keys"]))
            return outcome

    def make(ctx: StepContext[Order]) -> Staged:
        effects, keys = intents(ctx, ["a", "b"])
        tasks = [charge_task(journal, n, keys[n]) for n in ("a", "b")]
        return Staged(effects, tasks, then=lambda: Yield([], "done"))

    report = await StateMachine([Racing(make)]).run_report(Runtime(store=store), SID)
    assert report.reason.kind == "done"
    assert len(decided) == 2
    stored = await store.load(SID)
    assert stored.data.keys == decided[1]
    assert stored.data.count == 1
    assert journal.lines == [f"a {decided[1]['a']}", f"b {decided[1]['b']}"]
    assert await receipt_additions(store) == ["a", "b"]
    await store.aclose()
