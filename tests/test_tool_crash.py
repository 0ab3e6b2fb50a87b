"""The tool journal survives SIGKILL: a non-idempotent tool runs at most once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).parent / "harness" / "tool_crash.py"


@pytest.mark.parametrize("store", ["sqlite", "file"])
@pytest.mark.parametrize("idempotent", [False, True], ids=["non_idempotent", "idempotent"])
def test_killed_tool_runs_at_most_once(store: str, idempotent: bool) -> None:
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
