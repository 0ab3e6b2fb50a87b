"""A child for tests/test_leases_machine.py: runs one turn holding the session's lease.

    python tests/_paused_child.py KIND WHERE BACKEND

KIND is ``postgres`` (WHERE a DSN), ``sqlite`` or ``file`` (WHERE a path). The
turn's model asks for ``charge``; the tool prints ``{"started": true}``, then waits
for a line on stdin and prints ``{"charged": true}``. At the end the child prints
``{"ended": "<what run() returned or raised>"}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import anyio

from stepmachine import (
    LeasePolicy,
    ModelInference,
    Runtime,
    StateMachine,
    Tools,
    tool,
)
from stepmachine.testing import FunctionModel, call, reply


def say(**what: Any) -> None:
    print(json.dumps(what), flush=True)  # noqa: T201 - the child talks to its parent


def charge(amount: int) -> str:
    """Charge the card (a sync tool: it runs in a worker thread)."""
    say(started=True)
    sys.stdin.readline()
    say(charged=True)
    return f"charged {amount}"


def answer(request: Any) -> Any:
    if request.messages[-1].role == "user":
        return call(("charge", {"amount": 5}))
    return reply("paid")


async def main(kind: str, where: str) -> None:
    from stepmachine.stores import FileStore, PostgresStore, SQLiteStore

    store: Any
    if kind == "postgres":
        store = await PostgresStore.open(where)
    elif kind == "sqlite":
        store = await SQLiteStore.open(where)
    else:
        store = await FileStore.open(where, fsync="never")
    machine = StateMachine([Tools([tool(charge)]), ModelInference()], lease=LeasePolicy(ttl=1.0))
    try:
        await machine.run(Runtime(store=store, model=FunctionModel(answer)), "s")
        say(ended="returned")
    except Exception as exc:
        say(ended=type(exc).__name__)
    finally:
        await store.aclose()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], backend=sys.argv[3])
