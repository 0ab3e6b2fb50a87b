"""Shared pieces of the attack34c tests: a two-task staged step and a faulty store."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from _attack34a_common import Order, StagedStep, keep_record, receipt_record

from stepmachine import Codec, Staged, StateMachine, Task, UpdateData, Yield
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore

SID = "order"


async def open_store(kind: str, tmp: Path, **options: Any) -> Any:
    codec = Codec(Order)
    if kind == "memory":
        store: Any = MemoryStore(codec=codec, **options)
    elif kind == "sqlite":
        store = await SQLiteStore.open(tmp / "db.sqlite3", codec=codec)
    else:
        store = await FileStore.open(tmp / "store", codec=codec)
    await store.create(SID, data=Order())
    return store


def receipts_written(batches: list[Any]) -> list[str]:
    """Each receipt name in the order its batch added it (twice: written twice)."""
    added: list[str] = []
    seen: set[str] = set()
    for batch in batches:
        for effect in batch.effects:
            if isinstance(effect, UpdateData) and "receipts" in effect.changes:
                names = set(effect.changes["receipts"])
                added.extend(sorted(names - seen))
                seen |= names
    return added


def keeps_written(batches: list[Any]) -> list[str]:
    added: list[str] = []
    seen: set[str] = set()
    for batch in batches:
        for effect in batch.effects:
            if isinstance(effect, UpdateData) and "kept" in effect.changes:
                names = set(effect.changes["kept"])
                added.extend(sorted(names - seen))
                seen |= names
    return added


def is_record_of(batch: Any, field: str, name: str) -> bool:
    return any(
        isinstance(e, UpdateData) and name in e.changes.get(field, {}) for e in batch.effects
    )


def two_tasks(
    journal: list[str],
    *,
    a_landed: Callable[[], Awaitable[None]] | None = None,
    b_run: Callable[[], Awaitable[None]],
    concurrency: int = 2,
) -> StateMachine[Order]:
    """``a`` charges and returns (``a_landed`` awaited once held); ``b`` runs ``b_run``
    (which raises, typically) and keeps ``kept`` when cut."""

    async def run_a() -> Any:
        journal.append("a")
        return receipt_record("a", "receipt-a")

    async def run_b() -> Any:
        await b_run()
        journal.append("b")
        return receipt_record("b", "receipt-b")

    def make(ctx: Any) -> Staged:
        return Staged(
            [UpdateData.set(keys={"a": "ka", "b": "kb"})],
            [
                Task("a", run_a, guarded=True, landed=a_landed),
                Task("b", run_b, guarded=True, keep=keep_record("b", "kept")),
            ],
            max_concurrency=concurrency,
            then=lambda: Yield([], "done"),
        )

    return StateMachine([StagedStep(make)])
