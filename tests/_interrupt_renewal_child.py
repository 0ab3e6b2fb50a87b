"""A child for tests/test_interrupt_once.py: ``KeyboardInterrupt`` raised in the lease's
renewal task (a child task of the run) under ``asyncio.run``, while a plain-function
tool runs in a worker thread.

    python _interrupt_renewal_child.py

asyncio lets the interrupt out of the event loop at once and then cancels the run; the
process must then exit (code 130) instead of waiting at exit for a worker thread that
was never told to stop.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from stepmachine import (
    AppendMessage,
    LeasePolicy,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    StateMachine,
    Tools,
    submit,
    tool,
)
from stepmachine.stores import MemoryStore
from stepmachine.testing import FunctionModel, call, reply


class InterruptedRenewals(MemoryStore):
    """A store with expiring leases (so a run renews its lease in a task of its own) whose
    first renewal raises ``KeyboardInterrupt``, as Ctrl-C landing in that task would."""

    async def renew(self, lease: Any) -> Any:
        raise KeyboardInterrupt


@tool(side_effects="idempotent")
def slow_lookup(q: str) -> str:
    """Look something up, slowly (in anyio's worker thread)."""
    time.sleep(0.5)
    return f"found {q}"


def answer(request: ModelRequest) -> ModelResponse:
    if request.messages[-1].role == "user":
        return call(("slow_lookup", {"q": "x"}))
    return reply("done")


async def main() -> None:
    store = InterruptedRenewals(expiring_leases=True)
    await store.create("s")
    await submit(store, "s", [AppendMessage(Message.user("go", id="u1"))])
    machine: StateMachine[Any] = StateMachine(
        [Tools([slow_lookup]), ModelInference(stream=False)], lease=LeasePolicy(ttl=0.3)
    )
    await machine.run(Runtime(store=store, model=FunctionModel(answer)), "s")


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        print("KeyboardInterrupt", file=sys.stderr, flush=True)  # noqa: T201
        sys.exit(130)  # an ordinary exit: it waits for every non-daemon thread
