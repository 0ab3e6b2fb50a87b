"""Two processes on one session: with the lease, no running tool is called "outcome unknown".

Runs ``tests/harness/two_runners.py`` (see its docs) on each durable store; the
``--no-lease`` run shows the defect the lease prevents, so the check can fail.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).parent / "harness" / "two_runners.py"
STORES = ["sqlite", "file", pytest.param("postgres", marks=pytest.mark.postgres)]


def run_harness(*args: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, str(HARNESS), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    return done.returncode, (lines[-1] if lines else done.stderr)


@pytest.mark.parametrize("store_kind", STORES, indirect=True)
def test_a_second_runner_waits_for_the_first(store_kind: str) -> None:
    code, last = run_harness("--store", store_kind, "--rounds", "1")
    assert last == "rounds=1 runners=2 tool_runs=1 outcome_unknown=0 invalid=0", last
    assert code == 0


def test_without_the_lease_the_second_runner_calls_the_tool_unknown() -> None:
    code, last = run_harness("--store", "sqlite", "--rounds", "1", "--no-lease")
    assert last == "rounds=1 runners=2 tool_runs=1 outcome_unknown=1 invalid=0", last
    assert code == 1
