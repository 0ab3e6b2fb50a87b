"""Attack 33b: one ``run()`` of a budgeted session against the local model server.

``python _attack33b_budget_child.py DB SESSION PORT SCOPE N STREAM ATTEMPTS``

- SCOPE ``session`` or ``run``: ``Budget(per_session=...)`` or ``Budget(per_run=...)``
  with ``model_calls=N``;
- STREAM ``1``/``0``: ``ModelInference(stream=...)``;
- ATTEMPTS: the adapter's ``RetryPolicy(max_attempts=...)`` (tiny backoff).

Creates the session (one user message) if it does not exist, runs it on a SQLiteStore
with an ``OpenAIChatModel`` pointed at ``http://127.0.0.1:PORT/v1``, and prints one
JSON line: ``{"outcome": reason kind or error type, "session_calls": n}`` where
``session_calls`` is ``budget_usage(session, "session").model_calls`` afterwards.
"""

from __future__ import annotations

import json
import sys

import anyio

from stepmachine import Message, ModelInference, Runtime, StateMachine, Tools, tool
from stepmachine.operations import Budget, Limits, budget_usage
from stepmachine.providers import OpenAIChatModel, RetryPolicy
from stepmachine.stores import SQLiteStore


@tool(side_effects="idempotent")
def noop(n: int = 0) -> str:
    """Do nothing."""
    return f"noop {n}"


async def main() -> None:
    db, session_id, port, scope, n, stream, attempts = sys.argv[1:8]
    limits = Limits(model_calls=int(n))
    budget = Budget(per_session=limits) if scope == "session" else Budget(per_run=limits)
    machine = StateMachine([budget, Tools([noop]), ModelInference(stream=stream == "1")])
    model = OpenAIChatModel(
        "test-model",
        api_key="sk-attack33b",
        base_url=f"http://127.0.0.1:{port}/v1",
        retry=RetryPolicy(max_attempts=int(attempts), base_delay=0.01, max_delay=0.05),
    )
    async with await SQLiteStore.open(db) as store:
        if session_id not in await store.list_sessions():
            await store.create(session_id, conversation=[Message.user("go", id="u1")])
        try:
            report = await machine.run_report(Runtime(store=store, model=model), session_id)
            outcome = report.reason.kind
        except Exception as error:
            outcome = type(error).__name__
        finally:
            await model.aclose()
        session = await store.load(session_id)
        used = budget_usage(session, "session").model_calls
    print(json.dumps({"outcome": outcome, "session_calls": used}), flush=True)  # noqa: T201


if __name__ == "__main__":
    anyio.run(main)
