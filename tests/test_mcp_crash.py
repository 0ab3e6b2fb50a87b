"""SIGKILL of the agent process mid-call of an MCP tool, then resume (invariant 6).

A real agent process (tests/harness/mcp_agent.py, SQLite store) calls a tool
of a real stdio MCP server; the server appends its ledger line, then sleeps.
The test SIGKILLs the agent while the call is in flight, stops the orphaned
server, and resumes the session in a new process, on asyncio and on trio.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HARNESS = Path(__file__).parent / "harness" / "mcp_agent.py"


def _ledger(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    return [line.split("\t") for line in path.read_text().splitlines()]


def _kill_started_servers(events: Path) -> None:
    for line in events.read_text().splitlines() if events.exists() else []:
        kind, pid = line.split()
        if kind == "start":
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _kill_mid_call(
    tmp_path: Path, tool: str, backend: str, *, trust: bool = False
) -> dict[str, object]:
    """Start the agent, SIGKILL it mid-call, resume it; the resumed run's report."""
    db, ledger, events = tmp_path / "agent.db", tmp_path / "ledger.txt", tmp_path / "events.txt"
    base = [sys.executable, str(HARNESS), "--db", str(db), "--ledger", str(ledger)]
    base += ["--events", str(events), "--tool", tool, "--backend", backend]
    base += ["--trust"] if trust else []
    stderr = tmp_path / "agent.stderr"
    with stderr.open("wb") as err:
        agent = subprocess.Popen(base, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 60
        while not _ledger(ledger):  # the server has started the side effect
            if agent.poll() is not None or time.monotonic() > deadline:
                tail = stderr.read_text(errors="replace")[-2000:]
                raise AssertionError(f"the call never reached the server: {tail}")
            time.sleep(0.02)
        agent.send_signal(signal.SIGKILL)
        agent.wait(30)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        _kill_started_servers(events)
    assert agent.returncode == -signal.SIGKILL
    resumed = subprocess.run(
        [*base, "--no-delay"], capture_output=True, text=True, timeout=120, check=False
    )
    _kill_started_servers(events)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report: dict[str, object] = json.loads(resumed.stdout.strip().splitlines()[-1])
    report["ledger"] = _ledger(ledger)
    return report


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_non_idempotent_mcp_call_killed_mid_flight_is_not_run_again(
    tmp_path: Path, backend: str
) -> None:
    report = _kill_mid_call(tmp_path, "record", backend)
    assert len(report["ledger"]) == 1  # type: ignore[arg-type]  # the side effect happened once
    (result,) = report["results"]  # type: ignore[misc]
    assert result["is_error"]
    assert result["content"].startswith("outcome unknown")
    assert str(report["final"]).startswith("error: outcome unknown")


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_idempotent_mcp_call_killed_mid_flight_runs_again_with_the_same_key(
    tmp_path: Path, backend: str
) -> None:
    report = _kill_mid_call(tmp_path, "mark", backend, trust=True)  # a server one trusts
    ledger = report["ledger"]
    assert len(ledger) == 2  # type: ignore[arg-type]  # re-run: the tool said it is idempotent
    (_, first_key, _), (_, second_key, _) = ledger  # type: ignore[misc]
    assert first_key == second_key  # the server can deduplicate by it
    assert first_key.startswith("sm-")
    (result,) = report["results"]  # type: ignore[misc]
    assert result == {"content": "marked once", "is_error": False}
    assert report["final"] == "marked once"


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_false_read_only_hint_of_an_untrusted_server_does_not_rerun_the_call(
    tmp_path: Path, backend: str
) -> None:
    """Annotations are the server's hints: by default they do not lower the class."""
    report = _kill_mid_call(tmp_path, "liar", backend)
    assert len(report["ledger"]) == 1  # type: ignore[arg-type]  # one charge for one key
    (result,) = report["results"]  # type: ignore[misc]
    assert result["is_error"]
    assert result["content"].startswith("outcome unknown")
