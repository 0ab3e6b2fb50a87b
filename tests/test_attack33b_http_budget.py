"""Attack 33b: exact budgets (invariant 7) against a real local HTTP model server.

A child process (``_attack33b_model_server.py``) speaks OpenAI Chat Completions and
counts every request it receives. Budgeted sessions run in other child processes
(``_attack33b_budget_child.py``, SQLiteStore, ``OpenAIChatModel`` pointed at the
server); the server knows when a request is in flight, so a child is SIGKILLed exactly
then, and a fresh child resumes. Checked: the server never saw more requests than the
budget allows, and the stored ledger counts every request the server saw (never fewer).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from _attack33b_common import (
    ModelServer,
    finish,
    kill,
    model_server,
    reap_children,
    start_child,
    wait_for,
)

from stepmachine.operations import budget_usage
from stepmachine.stores import SQLiteStore

CALL = {"kind": "call", "calls": [["c{n}", "noop", '{"n": 1}']]}
HANG = {"kind": "hang", "seconds": 120}


@pytest.fixture(autouse=True)
def _reap() -> Any:
    yield
    reap_children()


@pytest.fixture
def server(tmp_path: Path) -> Any:
    with model_server(tmp_path) as made:
        yield made


def stored_calls(db: Path, session_id: str = "s") -> int:
    async def read() -> int:
        async with await SQLiteStore.open(db) as store:
            return budget_usage(await store.load(session_id), "session").model_calls

    return anyio.run(read)


def run_child(
    server: ModelServer, db: Path, scope: str, n: int, stream: bool, attempts: int = 1
) -> subprocess.Popen[str]:
    return start_child(
        "_attack33b_budget_child.py",
        str(db),
        "s",
        str(server.port),
        scope,
        str(n),
        "1" if stream else "0",
        str(attempts),
    )


def kill_in_flight(server: ModelServer, child: subprocess.Popen[str], requests: int) -> None:
    """SIGKILL ``child`` once the server holds its ``requests``-th request in flight."""
    wait_for(
        lambda: (s := server.stats())["requests"] == requests and requests in s["open"],
        what=f"request {requests} in flight",
    )
    kill(child)


def kill_if_in_flight(server: ModelServer, child: subprocess.Popen[str]) -> bool:
    """SIGKILL ``child`` once the server holds a new request of it in flight; False when
    the child ended first (it sent no request that the server still holds)."""
    before = server.requests
    while child.poll() is None:
        stats = server.stats()
        if stats["requests"] > before and stats["requests"] in stats["open"]:
            kill(child)
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
def test_a_session_budget_holds_across_kills_in_flight(
    server: ModelServer, tmp_path: Path, stream: bool
) -> None:
    n = 4
    db = tmp_path / "agent.sqlite3"
    server.default(CALL)
    # Process 1: a call answered (the tool runs), the second request hangs: killed.
    server.script([CALL, HANG])
    kill_in_flight(server, run_child(server, db, "session", n, stream), 2)
    assert stored_calls(db) >= 2
    # More processes, each killed while its first request is in flight, if it sends one.
    for _ in range(3):
        server.script([HANG])
        killed = kill_if_in_flight(server, run_child(server, db, "session", n, stream))
        assert server.requests <= n
        assert stored_calls(db) >= server.requests
        if not killed:
            break
    # Then the model keeps calling the tool; the budget must stop it at n.
    server.script([])
    result = finish(run_child(server, db, "session", n, stream))
    seen = server.requests
    assert seen <= n, f"server saw {seen} requests under Budget(model_calls={n})"
    assert result["outcome"] == "budget_exhausted"
    assert result["session_calls"] >= seen
    result = finish(run_child(server, db, "session", n, stream))
    assert result["outcome"] == "budget_exhausted"
    assert server.requests == seen


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
def test_a_per_run_budget_holds_in_each_process_and_the_ledger_counts_every_request(
    server: ModelServer, tmp_path: Path, stream: bool
) -> None:
    n = 2
    db = tmp_path / "agent.sqlite3"
    server.default(CALL)
    server.script([CALL, HANG])
    kill_in_flight(server, run_child(server, db, "run", n, stream), 2)
    assert stored_calls(db) >= 2
    server.script([HANG])
    kill_in_flight(server, run_child(server, db, "run", n, stream), 3)
    assert stored_calls(db) >= 3
    server.script([])
    before = server.requests
    result = finish(run_child(server, db, "run", n, stream))
    assert result["outcome"] == "budget_exhausted"
    assert server.requests - before == n  # a fresh run: n requests of its own, no more
    assert result["session_calls"] >= server.requests


def test_retries_count_429_then_success(server: ModelServer, tmp_path: Path) -> None:
    db = tmp_path / "agent.sqlite3"
    server.default(CALL)
    server.script(
        [
            {"kind": "status", "code": 429, "retry_after": 0},
            CALL,
            {"kind": "status", "code": 429, "retry_after": 0},
        ]
    )
    result = finish(run_child(server, db, "session", 3, False, attempts=4))
    # request 1: 429, request 2: a call; request 3: 429, then the budget (3) is spent:
    # the adapter must not retry past it.
    assert server.requests == 3
    assert result["outcome"] == "RateLimitError"
    assert result["session_calls"] == 3
    result = finish(run_child(server, db, "session", 3, False, attempts=4))
    assert result["outcome"] == "budget_exhausted"
    assert server.requests == 3


def test_a_model_error_after_retries_is_counted(server: ModelServer, tmp_path: Path) -> None:
    db = tmp_path / "agent.sqlite3"
    server.default({"kind": "status", "code": 500})
    result = finish(run_child(server, db, "session", 5, False, attempts=3))
    assert result["outcome"] == "ServerError"
    assert server.requests == 3
    assert result["session_calls"] == 3
    # Two calls left: a second run's retries stop at them.
    result = finish(run_child(server, db, "session", 5, False, attempts=3))
    assert result["outcome"] == "ServerError"
    assert server.requests == 5
    assert result["session_calls"] == 5
    result = finish(run_child(server, db, "session", 5, False, attempts=3))
    assert result["outcome"] == "budget_exhausted"
    assert server.requests == 5


def test_a_kill_during_the_retry_backoff_keeps_the_attempt_counted(
    server: ModelServer, tmp_path: Path
) -> None:
    db = tmp_path / "agent.sqlite3"
    # A 429 asking to wait 30 s: the child sleeps in the adapter's backoff; killed there.
    server.script([{"kind": "status", "code": 429, "retry_after": 30}])
    server.default(CALL)
    child = run_child(server, db, "session", 3, False, attempts=3)
    wait_for(lambda: server.requests == 1 and server.stats()["in_flight"] == 0, what="the 429")
    time.sleep(0.5)  # well inside the 30 s wait
    kill(child)
    assert stored_calls(db) >= 1
    result = finish(run_child(server, db, "session", 3, False, attempts=3))
    assert result["outcome"] == "budget_exhausted"
    assert server.requests <= 3
    assert result["session_calls"] >= server.requests


def test_a_streaming_reply_cut_after_output_is_counted_once(
    server: ModelServer, tmp_path: Path
) -> None:
    db = tmp_path / "agent.sqlite3"
    server.script([{"kind": "cut"}])
    server.default(CALL)
    result = finish(run_child(server, db, "session", 3, True, attempts=3))
    # output reached the emitter: never retried, one request, a typed error
    assert server.requests == 1, server.stats()["requests"]
    assert result["outcome"] not in ("done", "budget_exhausted")
    assert result["session_calls"] == 1
    result = finish(run_child(server, db, "session", 3, True, attempts=3))
    assert result["outcome"] == "budget_exhausted"
    assert server.requests == 3
    assert result["session_calls"] == 3


def test_one_kill_in_flight_does_not_spend_the_whole_session_budget(
    server: ModelServer, tmp_path: Path
) -> None:
    n = 20
    db = tmp_path / "agent.sqlite3"
    server.default(CALL)
    server.script([HANG])
    kill_in_flight(server, run_child(server, db, "session", n, False, attempts=1), 1)
    server.script([{"kind": "text", "text": "done"}])
    result = finish(run_child(server, db, "session", n, False, attempts=1))
    # One request was seen; with the adapter unable to retry, at most one call was spent.
    assert result["outcome"] == "done", result
    assert server.requests == 2
