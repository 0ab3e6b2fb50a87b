"""A child for tests/test_tool_fence.py: a worker paused between a tool's intent and its start.

    python _tool_fence_child.py DSN BACKEND

It runs one turn of session ``s`` on PostgreSQL holding the session's lease
(ttl 1 s). The model asks for ``charge`` (a non-idempotent tool). When the
intent batch is committed (its ``StepApplied`` event, before any tool starts),
the child prints ``{"intent": true}`` and waits for a line on stdin: the
parent stops it (SIGSTOP) meanwhile, past the lease's ttl, lets another worker
take the session over, then sends the line and SIGCONT. The tool prints
``{"charged": true}`` if it ever runs. At the end the child prints
``{"ended": "<what run() returned or raised>"}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import anyio
import anyio.to_thread

from stepmachine import (
    LeasePolicy,
    ModelInference,
    Runtime,
    StateMachine,
    StepApplied,
    Tools,
    tool,
)
from stepmachine.testing import FunctionModel, call, reply


def say(**what: Any) -> None:
    print(json.dumps(what), flush=True)  # noqa: T201 - the child talks to its parent


def charge(amount: int) -> str:
    """Charge the card (non-idempotent: the default)."""
    say(charged=True)
    return f"charged {amount}"


def answer(request: Any) -> Any:
    if request.messages[-1].role == "user":
        return call(("charge", {"amount": 5}))
    return reply("paid")


class PauseAfterIntent:
    """Waits for the parent once, right after the intent batch was committed."""

    def __init__(self) -> None:
        self.paused = False

    async def emit(self, event: Any) -> None:
        data = event.data
        if isinstance(data, StepApplied) and data.status == "committed" and not self.paused:
            self.paused = True
            say(intent=True)
            await anyio.to_thread.run_sync(sys.stdin.readline)


async def main(dsn: str) -> None:
    from stepmachine.stores import PostgresStore

    store = await PostgresStore.open(dsn, idle_in_transaction_timeout=1.0)
    machine = StateMachine([Tools([tool(charge)]), ModelInference()], lease=LeasePolicy(ttl=1.0))
    try:
        runtime = Runtime(store=store, model=FunctionModel(answer))
        await machine.run(runtime, "s", PauseAfterIntent())
        say(ended="returned")
    except Exception as exc:
        say(ended=type(exc).__name__)
    finally:
        await store.aclose()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], backend=sys.argv[2])
