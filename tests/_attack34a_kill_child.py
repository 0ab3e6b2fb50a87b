"""A child for tests/test_attack34a_kills.py: a staged step charging three cards, killed.

    python _attack34a_kill_child.py KIND WHERE MODE CONCURRENCY [BACKEND]

KIND is ``sqlite`` or ``file``; WHERE the store's location. The journal ``effects.txt``
(in the folder ``ATTACK34A_DIR``) gets ``start NAME KEY PID`` when a task starts and
``charge NAME KEY PID`` when its charge takes effect (each line fsynced).

The step (``Charges``) writes the intents ``keys = {a, b, c}`` (idempotency keys), runs
three guarded charge tasks (``CONCURRENCY`` at a time) whose records add their receipt to
the stored receipts, then yields ``done``. Seeing an intent without a receipt, it yields
``outcome_unknown`` naming the keys; with every receipt, it refuses (the run idles).

MODE says when the child SIGKILLs itself:

* ``none``: never; ``slow``: never, each task waits for the file ``go`` first;
* ``after_intents``: once the intents batch is stored (nothing started);
* ``in_task``: in task ``b``, after its start line, before the charge;
* ``after_return``: in ``b``'s ``landed`` (its charge took effect, the record held, not
  written);
* ``between_records``: once ``a``'s record is stored, before ``b`` starts
  (``CONCURRENCY`` 1);
* ``kill_on_go``: in task ``b``, after its start line, once the file ``go`` exists;
* ``jitter``: never by itself (the parent kills it at a random instant); each task
  sleeps a little before its charge and in ``landed``.

The child prints ``reason <kind>`` and ``finished`` when its run returns.
"""

from __future__ import annotations

import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
from _attack34a_common import Order, StagedStep, receipt_record

from stepmachine import (
    Codec,
    Runtime,
    Staged,
    StateMachine,
    StepApplied,
    StepContext,
    Task,
    UpdateData,
    Yield,
)

SESSION = "order"
NAMES = ("a", "b", "c")


def kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Child:
    def __init__(self, folder: Path, mode: str, concurrency: int) -> None:
        self.folder = folder
        self.journal_path = folder / "effects.txt"
        self.mode = mode
        self.concurrency = concurrency
        self.batches = 0

    def journal(self, line: str) -> None:
        with self.journal_path.open("a") as handle:
            handle.write(f"{line} {os.getpid()}\n")
            handle.flush()
            os.fsync(handle.fileno())

    async def emit(self, event: Any) -> None:
        data = event.data
        if not isinstance(data, StepApplied) or data.step != "Charges":
            return
        self.batches += 1
        if self.mode == "after_intents" and self.batches == 1:
            kill()
        if self.mode == "between_records" and self.batches == 2:
            kill()

    def make(self, ctx: StepContext[Order]) -> Staged:
        keys = {name: ctx.new_id() for name in NAMES}
        tasks = [self.task(name, keys[name]) for name in NAMES]

        def then() -> Yield:
            return Yield([], "done")

        return Staged(
            [UpdateData.set(keys=keys)], tasks, max_concurrency=self.concurrency, then=then
        )

    def task(self, name: str, key: str) -> Task:
        async def run() -> Any:
            self.journal(f"start {name} {key}")
            if self.mode == "slow":
                while not (self.folder / "go").exists():  # noqa: ASYNC110 - another process makes it
                    await anyio.sleep(0.02)
            if self.mode == "in_task" and name == "b":
                kill()
            if self.mode == "kill_on_go" and name == "b":
                while not (self.folder / "go").exists():  # noqa: ASYNC110 - another process makes it
                    await anyio.sleep(0.02)
                kill()
            if self.mode == "jitter":
                await anyio.sleep(random.uniform(0.0, 0.15))
            await anyio.lowlevel.checkpoint()
            self.journal(f"charge {name} {key}")
            return receipt_record(name, f"receipt-{key}")

        async def landed() -> None:
            if self.mode == "after_return" and name == "b":
                kill()
            if self.mode == "jitter":
                await anyio.sleep(random.uniform(0.0, 0.05))

        return Task(name, run, guarded=True, landed=landed)


class Unknown(StagedStep):
    async def run(self, ctx: StepContext[Order]) -> Any:
        outcome = await super().run(ctx)
        if isinstance(outcome, Yield) and outcome.reason.kind == "outcome_unknown":
            data = ctx.session.data
            missing = sorted(set(data.keys) - set(data.receipts))
            return Yield([], f"outcome_unknown {','.join(missing)}")
        return outcome


async def open_store(kind: str, where: str) -> Any:
    from stepmachine.stores import FileStore, SQLiteStore

    if kind == "sqlite":
        return await SQLiteStore.open(where, codec=Codec(Order))
    return await FileStore.open(where, codec=Codec(Order))


async def main(kind: str, where: str, mode: str, concurrency: int) -> None:
    child = Child(Path(os.environ["ATTACK34A_DIR"]), mode, concurrency)
    store = await open_store(kind, where)
    try:
        machine = StateMachine([Unknown(child.make)])
        report = await machine.run_report(Runtime(store=store), SESSION, emitter=child)
        sys.stdout.write(f"reason {report.reason.kind}\n")
    finally:
        await store.aclose()
    sys.stdout.write("finished\n")


if __name__ == "__main__":
    kind, where, mode, concurrency = sys.argv[1:5]
    backend = sys.argv[5] if len(sys.argv) > 5 else "asyncio"
    anyio.run(main, kind, where, mode, int(concurrency), backend=backend)
