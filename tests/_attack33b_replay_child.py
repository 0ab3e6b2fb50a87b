"""Attack 33b: a run that a parent SIGKILLs mid-cycle, then resumes in a fresh process.

``python _attack33b_replay_child.py DB HANG MARKER``: runs session ``s`` (created with
one user message if missing) with :func:`pipeline` on a SQLiteStore. HANG says where
this process stops until it is killed, after writing MARKER: ``model`` (the model's
first request), ``model2`` (its request after the tool result), ``tool`` (inside
``lookup``), or ``none`` (it runs to the end and prints ``finished``).
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
    Step,
    Tools,
    tool,
)
from stepmachine.operations import Budget, Limits
from stepmachine.stores import SQLiteStore
from stepmachine.testing import FunctionModel, call, reply

HANG = "none"
MARKER = Path("/nonexistent")


def stop_here(where: str) -> None:
    if where == HANG:
        MARKER.write_text(where)
        time.sleep(600)


@tool(side_effects="idempotent")
def lookup(q: str) -> str:
    """Look something up."""
    stop_here("tool")
    return f"found {q}"


def pipeline(calls: int = 10) -> list[Step[Any]]:
    return [Budget(per_run=Limits(model_calls=calls)), Tools([lookup]), ModelInference()]


def answer(request: ModelRequest) -> ModelResponse:
    if request.messages[-1].role == "user":
        stop_here("model")
        return call(("lookup", {"q": "x"}))
    stop_here("model2")
    return reply("final")


async def main() -> None:
    global HANG, MARKER
    db, HANG, marker = sys.argv[1:4]
    MARKER = Path(marker)
    async with await SQLiteStore.open(db) as store:
        if "s" not in await store.list_sessions():
            await store.create("s", conversation=[Message.user("go", id="u1")])
        runtime = Runtime(store=store, model=FunctionModel(answer))
        await StateMachine(pipeline()).run(runtime, "s")
    print("finished", flush=True)  # noqa: T201 - the child talks to its parent


if __name__ == "__main__":
    anyio.run(main)
