"""A child for tests/test_attack33_kills.py: concurrent tools in one model turn, killed.

    python _attack33_tools_child.py KIND WHERE MODE

KIND is ``sqlite``, ``file`` or ``postgres`` (WHERE is then a DSN); WHERE is the store's
location, and the side-effect journal ``effects.txt`` lives beside it (in the folder named
by the environment variable ``ATTACK33_DIR``).

The model asks, in each of two user turns, for three ``charge`` calls (non-idempotent)
and one ``lookup`` (idempotent), run with ``max_concurrency=4``. Every tool run appends
``<tool> <idempotency key>`` to ``effects.txt`` (fsynced) before it returns.

MODE says when the child SIGKILLs itself:

* ``none``: never (run to the end);
* ``after_intents``: right after the first intents batch is stored (no tool started);
* ``mid``: once ``charge 1``'s record is stored and ``charge 2`` has taken effect (its
  side effect is in the journal, its record not yet stored); ``charge 3`` has started
  and waits before taking effect;
* ``after_all``: when the last charge of the first turn returned (every side effect
  done), before its record is stored;
* ``random``: never by itself (the parent kills it at a random instant); tools sleep a
  little so that an instant can land among them.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import anyio

from stepmachine import (
    AppendMessage,
    LeasePolicy,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    StateMachine,
    StepApplied,
    ToolContext,
    Tools,
    submit,
    tool,
)
from stepmachine.testing import FunctionModel, call, reply

SESSION = "s"
TURNS = 2


def kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Child:
    def __init__(self, folder: Path, mode: str) -> None:
        self.effects = folder / "effects.txt"
        self.mode = mode
        self.records = 0  # StepApplied batches seen in this process
        self.charge1_recorded = anyio.Event()
        self.charges_returned = 0

    def journal(self, line: str) -> None:
        with self.effects.open("a") as handle:
            handle.write(line + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    async def emit(self, event: Any) -> None:
        data = event.data
        if not isinstance(data, StepApplied):
            return
        intents = data.step == "tools" and data.status == "committed" and not self.records
        if self.mode == "after_intents" and intents:
            kill()
        if data.step == "tools":
            self.records += 1
            if self.records >= 3:  # the intents, then lookup's and charge 1's records
                self.charge1_recorded.set()

    async def charge(self, n: int, ctx: ToolContext) -> str:
        """Charge the card (not idempotent)."""
        if self.mode == "random":
            await anyio.sleep(0.1 * n)
        if self.mode == "mid" and n == 3:
            await anyio.sleep(3600)  # started, never takes effect before the kill
        if self.mode == "mid" and n == 2:
            await self.charge1_recorded.wait()
        self.journal(f"charge {ctx.idempotency_key}")
        if self.mode == "mid" and n == 2:
            kill()
        self.charges_returned += 1
        if self.mode == "after_all" and self.charges_returned == 3:
            kill()
        return f"charged {n}"

    async def lookup(self, ctx: ToolContext) -> str:
        """Look something up (idempotent)."""
        self.journal(f"lookup {ctx.idempotency_key}")
        return "found"


def answer(request: ModelRequest) -> ModelResponse:
    last = request.messages[-1]
    if last.role == "user":
        return call(
            ("charge", {"n": 1}),
            ("charge", {"n": 2}),
            ("charge", {"n": 3}),
            ("lookup", {}),
        )
    return reply("all done")


async def open_store(kind: str, where: str) -> Any:
    if kind == "sqlite":
        from stepmachine.stores import SQLiteStore

        return await SQLiteStore.open(where)
    if kind == "file":
        from stepmachine.stores import FileStore

        return await FileStore.open(where)
    from stepmachine.stores import PostgresStore

    return await PostgresStore.open(where)


async def main(kind: str, where: str, mode: str) -> None:
    child = Child(Path(os.environ["ATTACK33_DIR"]), mode)
    tools = Tools(
        [
            tool(side_effects="non_idempotent", thread=False)(child.charge),
            tool(side_effects="idempotent", thread=False)(child.lookup),
        ],
        max_concurrency=4,
    )
    machine = StateMachine([tools, ModelInference()], lease=LeasePolicy(ttl=1.0))
    store = await open_store(kind, where)
    try:
        runtime = Runtime(store=store, model=FunctionModel(answer))
        for turn in range(1, TURNS + 1):
            session = await store.load(SESSION)
            if sum(m.role == "user" for m in session.conversation) < turn:
                message = Message.user(f"turn {turn}", id=f"u{turn}")
                await submit(store, SESSION, [AppendMessage(message)])
            await machine.run(runtime, SESSION, child)
    finally:
        await store.aclose()
    print("finished", flush=True)  # noqa: T201 - the child talks to its parent


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:4])
