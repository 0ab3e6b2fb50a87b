"""Attack 33b: ``asyncio.run(main())`` running ``machine.run()`` on SQLite, for Ctrl-C.

``python _attack33b_sigint_child.py DB NTH MARKER GO``: every persistence boundary of the
store, the leases' claim and release, the tool ``charge`` and the model call are
*hits*; at hit number NTH (from 1; 0: none) the process writes MARKER and waits (in
whatever thread the hit runs) until the file GO exists. ``charge`` (non-idempotent)
appends its call id to ``DB.journal``. At the end it prints the hits as one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

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
from stepmachine.stores import SQLiteStore
from stepmachine.testing import FunctionModel, call, reply

HITS: list[str] = []
ARGS: list[str] = []


def hit(name: str) -> None:
    HITS.append(name)
    _db, nth, marker, go = ARGS
    if len(HITS) == int(nth):
        Path(marker).write_text(name)
        while not Path(go).exists():
            time.sleep(0.01)


@tool(side_effects="non_idempotent")
def charge(ctx: ToolContext, amount: int) -> str:
    """Charge a card."""
    hit("tool")
    with open(ARGS[0] + ".journal", "a") as journal:
        journal.write(ctx.call_id + "\n")
    return f"charged {amount}"


async def answer(request: ModelRequest) -> ModelResponse:
    await asyncio.to_thread(hit, "model")
    if request.messages[-1].role == "user":
        return call(("charge", {"amount": 5}))
    return reply("charged")


async def main() -> None:
    ARGS[:] = sys.argv[1:5]
    store = await SQLiteStore.open(ARGS[0], boundary_hook=hit)
    async with store:
        leases: Any = store._open_leases()  # the attack needs the moment
        for name in ("_claim", "_release"):
            original = getattr(leases, name)

            def gated(*args: Any, _original: Any = original, _name: str = name) -> Any:
                hit(f"leases.{_name}")
                return _original(*args)

            setattr(leases, name, gated)
        if "s" not in await store.list_sessions():
            await store.create("s", conversation=[Message.user("pay", id="u1")])
        HITS.clear()
        machine = StateMachine([Tools([charge]), ModelInference()])
        await machine.run(Runtime(store=store, model=FunctionModel(answer)), "s")
    print(json.dumps(HITS), flush=True)  # noqa: T201 - the child talks to its parent


if __name__ == "__main__":
    # As in a terminal: a launcher that ignores SIGINT (a shell's background job without
    # job control) passes that on, and asyncio.run then installs no handler of its own.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    asyncio.run(main())
