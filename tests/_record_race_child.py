"""A child process for tests/test_record_race_attack.py: one writer of a shared SQLite session.

    python tests/_record_race_child.py DB LOG MODE NAME BACKEND [KIND]

KIND: ``sqlite`` (DB is the database file; the default) or ``file`` (DB is a
FileStore's folder).

MODE ``charge``: runs a machine (no lease: runners race on the intent) whose one
step charges keys ``k0`` .. ``k5``, three at a time, as ``examples/charge_card.py``
does: the intent message ``intent``, then one task per key whose record is the
message ``receipt KEY`` unless the stored session holds it. Each charge appends
``charge KEY PID`` to LOG (opened for appending) before its record exists.
MODE ``write``: submits 40 annotations on message ``u1`` (another writer).
Prints one JSON line: the yield kind (``charge``) or the batches written (``write``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.lowlevel

from stepmachine import (
    Annotate,
    AppendMessage,
    Effect,
    Message,
    Operation,
    Refuse,
    Runtime,
    Session,
    Staged,
    StateMachine,
    Task,
    Yield,
    submit,
)
from stepmachine.stores import FileStore, SQLiteStore

KEYS = tuple(f"k{i}" for i in range(6))


def texts(session: Session[Any]) -> list[str]:
    return [m.text or "" for m in session.conversation]


class Charges(Operation[Any]):
    """Charges each key once: the intent, then a guarded task per key, a receipt each."""

    name = "charges"

    def __init__(self, log: str) -> None:
        self.log = log

    def note(self, line: str) -> None:
        descriptor = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(descriptor, f"{line} {os.getpid()}\n".encode())
        finally:
            os.close(descriptor)

    async def run(self, ctx: Any) -> Any:
        seen = texts(ctx.session)
        if "intent" in seen:
            if all(f"receipt {k}" in seen for k in KEYS):
                return Refuse("charged")
            return Yield([], "outcome_unknown")
        intent = [AppendMessage(Message.user("intent", id=ctx.new_id()))]
        tasks = [self.task(ctx, key) for key in KEYS]
        return Staged(intent, tasks, max_concurrency=3, then=lambda: Yield([], "done"))

    def task(self, ctx: Any, key: str) -> Task:
        async def charge() -> Any:
            await anyio.lowlevel.checkpoint()
            self.note(f"charge {key}")
            text = f"receipt {key}"

            def record(stored: Session[Any]) -> Sequence[Effect]:
                if text in texts(stored):
                    return ()
                return [AppendMessage(Message.user(text, id=ctx.new_id()))]

            return record

        return Task(f"charge {key}", charge, guarded=True)


async def main(db: str, log: str, mode: str, name: str, kind: str) -> dict[str, Any]:
    store: Any = await (FileStore.open(db) if kind == "file" else SQLiteStore.open(db))
    try:
        if mode == "write":
            for n in range(40):
                await submit(store, "s", [Annotate("u1", name, {"n": n})], max_attempts=1000)
                await anyio.lowlevel.checkpoint()
            return {"wrote": 40}
        machine = StateMachine([Charges(log)], lease=None, max_conflicts=1000)
        report = await machine.run_report(Runtime(store=store), "s")
        return {"reason": report.reason.kind}
    finally:
        await store.aclose()


if __name__ == "__main__":
    db, log, mode, name, backend = sys.argv[1:6]
    kind = sys.argv[6] if len(sys.argv) > 6 else "sqlite"
    done = anyio.run(main, db, log, mode, name, kind, backend=backend)
    sys.stdout.write(json.dumps(done) + "\n")
