"""A child process for tests/test_driver_attack.py: one caller of a shared SQLite session.

    python tests/_driver_attack_child.py DB LOG NAME BACKEND

Submits the user message ``u-NAME`` to session ``s``, then ``run_report()``s it
with ``LeasePolicy(busy="queue")`` (a run that finds the session held asks the
holder to run its turn and returns at once). The machine's one step answers
every unanswered ``u-*`` message, one per cycle, and writes ``start X`` /
``end X`` lines to LOG (opened for appending) around each answer, with a
checkpoint in between, so that two runners inside the step at once would show.
Prints one JSON line: the report's yield kind.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import anyio

from stepmachine import (
    AppendMessage,
    Continue,
    LeasePolicy,
    Message,
    Operation,
    Refuse,
    Runtime,
    StateMachine,
    submit,
)
from stepmachine.stores import SQLiteStore


class Answer(Operation[Any]):
    """Answers the oldest unanswered ``u-X`` with ``a-X``; refuses when none is left."""

    name = "answer"

    def __init__(self, log: str) -> None:
        self.log = log

    def note(self, line: str) -> None:
        descriptor = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(descriptor, f"{line} {os.getpid()}\n".encode())
        finally:
            os.close(descriptor)

    async def run(self, ctx: Any) -> Any:
        ids = [message.id for message in ctx.session.conversation]
        open_ones = [i[2:] for i in ids if i.startswith("u-") and f"a-{i[2:]}" not in ids]
        if not open_ones:
            return Refuse()
        name = open_ones[0]
        self.note(f"start {name}")
        await anyio.sleep(0.01)  # a window for another runner (none may enter it)
        self.note(f"end {name}")
        return Continue([AppendMessage(Message.user(f"answer {name}", id=f"a-{name}"))])


async def main(db: str, log: str, name: str) -> dict[str, str]:
    store = await SQLiteStore.open(db)
    try:
        await submit(store, "s", [AppendMessage(Message.user(name, id=f"u-{name}"))])
        machine = StateMachine([Answer(log)], lease=LeasePolicy(busy="queue"))
        report = await machine.run_report(Runtime(store=store), "s")
        return {"reason": report.reason.kind}
    finally:
        await store.aclose()


if __name__ == "__main__":
    db, log, name, backend = sys.argv[1:5]
    sys.stdout.write(json.dumps(anyio.run(main, db, log, name, backend=backend)) + "\n")
