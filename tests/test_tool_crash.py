"""The tool journal survives SIGKILL: a non-idempotent tool runs at most once;
a pure tool is simply run again and ends with exactly one result."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).parent / "harness" / "tool_crash.py"


@pytest.mark.parametrize("store", ["sqlite", "file"])
@pytest.mark.parametrize("kind", ["non_idempotent", "idempotent"])
def test_killed_tool_runs_at_most_once(store: str, kind: str) -> None:
    idempotent = kind == "idempotent"
    command = [sys.executable, str(HARNESS), "--store", store, "--rounds", "1"]
    if idempotent:
        command.append("--idempotent")
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr
    assert lines[-1] == "kills=2 duplicate_side_effects=0", done.stdout + done.stderr
    # Each crash point was really hit, and the history explains it.
    assert all(line.endswith(" ok") for line in lines[:-1]), done.stdout
    expected = "outcome_unknown=0" if idempotent else "outcome_unknown=1"
    assert all(expected in line for line in lines[:-1]), done.stdout
    assert done.returncode == 0


@pytest.mark.parametrize("store", ["sqlite", "file"])
def test_a_killed_pure_tool_is_simply_run_again_with_one_result(store: str) -> None:
    command = [sys.executable, str(HARNESS), "--store", store, "--rounds", "1", "--pure"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr
    assert lines[-2:] == ["reruns=1", "kills=2 duplicate_side_effects=0"], done.stdout + done.stderr
    checks = lines[:-2]
    assert len(checks) == 2, done.stdout
    assert all(line.endswith(" ok") for line in checks), done.stdout
    assert all("outcome_unknown=0 one_result_each=True" in line for line in checks), done.stdout
    # Killed after it ran: run again on resume (two runs, one result); killed before: once.
    (after,) = [line for line in checks if "after_tool" in line]
    assert "runs={'round-1': 2}" in after, done.stdout
    assert done.returncode == 0
