"""Attack 33b: hostile model output from a real local HTTP server (OpenAI Chat Completions).

The server (``_attack33b_model_server.py``, a child process) answers the first request
with something hostile (a body that is not JSON, an empty ``choices`` list, tool calls
with invalid JSON arguments, an unknown tool, duplicate call ids within a reply or
repeating an earlier turn's id, megabytes of arguments), then sensible replies. The
run goes through the step list ``Agent`` builds (``InvalidCalls``, ``HistoryGuard``,
``Tools``, ``ModelInference``) on SQLiteStore, blocking and streaming. Checked: the run
ends with a typed error or a valid history, no tool ran twice for one call, the ledger
counts every request the server saw, and a second run finishes with a valid history.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _attack33b_common import ModelServer, model_server

from stepmachine import (
    Message,
    ModelError,
    ModelInference,
    Runtime,
    StateMachine,
    ToolContext,
    Tools,
    tool,
)
from stepmachine.extend import history_problems
from stepmachine.operations import HistoryGuard, InvalidCalls, budget_usage
from stepmachine.providers import MalformedResponseError, OpenAIChatModel, RetryPolicy
from stepmachine.stores import SQLiteStore

RAN: list[str] = []


@tool(side_effects="idempotent")
def noop(ctx: ToolContext, n: int = 0) -> str:
    """Do nothing, and say so."""
    RAN.append(ctx.call_id)
    return f"noop {n}"


def call(*calls: tuple[str, str, str]) -> dict[str, Any]:
    return {"kind": "call", "calls": [list(c) for c in calls]}


TEXT = {"kind": "text", "text": "all done"}
OK = '{"n": 1}'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelServer]:
    with model_server(tmp_path_factory.mktemp("server")) as made:
        yield made


def machine(stream: bool) -> StateMachine[Any]:
    return StateMachine(
        [InvalidCalls(), HistoryGuard(), Tools([noop]), ModelInference(stream=stream)]
    )


async def run_once(
    server: ModelServer, store: SQLiteStore, stream: bool
) -> tuple[str, BaseException | None]:
    model = OpenAIChatModel(
        "test-model",
        api_key="sk-attack33b",
        base_url=f"http://127.0.0.1:{server.port}/v1",
        retry=RetryPolicy(max_attempts=1),
    )
    try:
        report = await machine(stream).run_report(Runtime(store=store, model=model), "s")
    except Exception as error:
        return type(error).__name__, error
    finally:
        await model.aclose()
    return report.reason.kind, None


CASES: dict[str, list[dict[str, Any]]] = {
    "not_json": [{"kind": "raw", "body": '{"id": "x", "choices": [ {"index": 0, "mess'}],
    "empty_choices": [
        {
            "kind": "raw",
            "body": json.dumps({"id": "x", "object": "chat.completion", "choices": []}),
        }
    ],
    "null_message": [
        {
            "kind": "raw",
            "body": json.dumps(
                {"id": "x", "choices": [{"index": 0, "message": None, "finish_reason": "stop"}]}
            ),
        }
    ],
    "invalid_json_arguments": [call(("a{n}", "noop", '{"n": 1,,}'))],
    "unknown_tool": [call(("a{n}", "rm_rf", OK))],
    "unknown_and_valid": [call(("a{n}", "rm_rf", OK), ("b{n}", "noop", OK))],
    "duplicate_ids_in_one_reply": [call(("dup", "noop", OK), ("dup", "noop", '{"n": 2}'))],
    "id_of_an_earlier_turn": [call(("same", "noop", OK)), call(("same", "noop", OK))],
    "arguments_not_an_object": [call(("a{n}", "noop", "[1, 2, 3]"))],
    "empty_id": [call(("", "noop", OK))],
    "huge_arguments": [call(("a{n}", "noop", json.dumps({"n": 1, "pad": "x" * 3_000_000})))],
}


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
@pytest.mark.parametrize("case", list(CASES))
async def test_hostile_output_ends_in_a_typed_error_or_a_valid_history(
    server: ModelServer, tmp_path: Path, case: str, stream: bool
) -> None:
    RAN.clear()
    server.script(CASES[case])
    server.default(TEXT)
    before = server.requests
    async with await SQLiteStore.open(tmp_path / "db.sqlite3") as store:
        await store.create("s", conversation=[Message.user("go", id="u1")])
        outcome, error = await run_once(server, store, stream)
        session = await store.load("s")
        assert history_problems(session) == [], (case, outcome)
        if error is not None:
            assert isinstance(error, ModelError), (case, repr(error))
        seen = server.requests - before
        assert budget_usage(session, "session").model_calls >= seen, (case, outcome, seen)
        # A second run: the session is not stuck.
        outcome2, error2 = await run_once(server, store, stream)
        session = await store.load("s")
        assert error2 is None, (case, outcome, repr(error2))
        assert outcome2 in ("done", "idle", "invalid_tool_call"), (case, outcome2)
        assert history_problems(session) == []
        assert budget_usage(session, "session").model_calls >= server.requests - before
        # No call ran twice: one result per (message, call) at most, one run per result.
        runs = Counter(RAN)
        results = Counter(
            r.call_id for m in session.conversation for r in m.tool_results if not r.is_error
        )
        for call_id, count in runs.items():
            assert count <= results[call_id], (case, call_id, runs, results)
        assert "rm_rf" not in RAN


async def test_a_reply_that_is_not_json_is_a_malformed_response(
    server: ModelServer, tmp_path: Path
) -> None:
    server.script(CASES["not_json"])
    server.default(TEXT)
    async with await SQLiteStore.open(tmp_path / "db.sqlite3") as store:
        await store.create("s", conversation=[Message.user("go", id="u1")])
        outcome, error = await run_once(server, store, False)
        assert isinstance(error, MalformedResponseError), outcome
        session = await store.load("s")
        assert [m.role for m in session.conversation] == ["user"]
        assert budget_usage(session, "session").model_calls == 1
