"""Attack 33b: a process that holds a lease (or the store-wide meta lock) when it is stopped.

``python _attack33b_lease_child.py KIND WHERE PATH MARKER GO``: opens a SQLiteStore
(KIND ``sqlite``, PATH a database) or a FileStore (KIND ``file``, PATH a folder) and runs
session ``s`` (created if missing). WHERE says where it waits, after writing MARKER,
until the file GO exists:

- ``tool``: inside the tool ``charge`` (the run holds the session's lease);
- ``meta``: inside the leases' ``_claim`` (under the store-wide meta lock, before the
  session's lock is taken).

``charge`` appends its call id to ``PATH.journal``. Prints ``finished`` at the end.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import anyio

from stepmachine import (
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    StateMachine,
    ToolContext,
    Tools,
    tool,
)
from stepmachine.stores import FileStore, SQLiteStore
from stepmachine.testing import FunctionModel, call, reply

ARGS: list[str] = []


def wait_here(where: str) -> None:
    _kind, want, _path, marker, go = ARGS
    if where == want:
        Path(marker).write_text(where)
        while not Path(go).exists():
            time.sleep(0.01)


@tool(side_effects="non_idempotent")
def charge(ctx: ToolContext, amount: int) -> str:
    """Charge a card."""
    wait_here("tool")
    with open(ARGS[2] + ".journal", "a") as journal:
        journal.write(ctx.call_id + "\n")
    return f"charged {amount}"


def answer(request: ModelRequest) -> ModelResponse:
    if request.messages[-1].role == "user":
        return call(("charge", {"amount": 5}))
    return reply("charged")


async def main() -> None:
    ARGS[:] = sys.argv[1:6]
    kind, _, path, _, _ = ARGS
    store: Any = await (SQLiteStore.open(path) if kind == "sqlite" else FileStore.open(path))
    async with store:
        leases: Any = store._open_leases()  # the attack needs the moment
        original = leases._claim

        def claim(*args: Any) -> Any:
            wait_here("meta")
            return original(*args)

        leases._claim = claim
        if "s" not in await store.list_sessions():
            await store.create("s", conversation=[Message.user("pay", id="u1")])
        machine = StateMachine([Tools([charge]), ModelInference()])
        await machine.run(Runtime(store=store, model=FunctionModel(answer)), "s")
    print("finished", flush=True)  # noqa: T201 - the child talks to its parent


if __name__ == "__main__":
    anyio.run(main)
