"""Invariant 2 (nothing lost) under kill -9, via the crash-point harness.

Runs ``tests/harness/crash.py`` for the SQLite, file and PostgreSQL stores with small
parameters: a child agent is SIGKILLed at (the first and last hit of) every
persistence boundary the store lists, plus a few random kills; each crash is
checked for lost acknowledged batches, half-applied batches and a history
that does not resume to a valid, complete conversation. Deliberately broken
stores prove the harness reports each kind of failure.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import crash
import pytest

HARNESS = Path(__file__).resolve().parent / "harness"


BROKEN = HARNESS / "_common.py"

HARNESS_STORES = ["sqlite", "file", pytest.param("postgres", marks=pytest.mark.postgres)]
"""The stores the harness runs against (``store_kind``, see conftest.py)."""


def _report(summary: object) -> str:
    return "\n".join(summary.lines())  # type: ignore[attr-defined]


@pytest.mark.parametrize("store_kind", HARNESS_STORES, indirect=True)
def test_every_boundary_crash_loses_nothing(store_kind: str, tmp_path: Path) -> None:
    summary = crash.run(
        store_kind,
        rounds=2,
        max_per_boundary=2,
        random_kills=2,
        seed=1,
        jobs=2,
        workdir=tmp_path,
        echo=False,
    )
    report = _report(summary)
    assert summary.crash_points > 0, report
    assert set(summary.boundaries) <= summary.boundaries_hit, report
    assert summary.never_hit == [], report
    assert summary.lost == 0, report
    assert summary.half_applied == 0, report
    assert summary.invalid == 0, report
    assert summary.ok


def test_script_prints_the_summary_line_last(tmp_path: Path) -> None:
    completed = subprocess.run(
        [
            sys.executable,
            str(HARNESS / "crash.py"),
            "--store",
            "sqlite",
            "--rounds",
            "1",
            "--max-per-boundary",
            "1",
            "--random-kills",
            "0",
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = completed.stdout.strip().splitlines()
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert lines[-1].startswith("crash_points=")
    fields = dict(item.split("=") for item in lines[-1].split())
    assert list(fields) == ["crash_points", "lost", "half_applied", "invalid"]
    assert int(fields["crash_points"]) >= 4
    assert fields["lost"] == fields["half_applied"] == fields["invalid"] == "0"


def test_harness_reports_a_store_that_acknowledges_before_writing(tmp_path: Path) -> None:
    summary = crash.run(
        f"{BROKEN}:LosingStore",
        rounds=1,
        max_per_boundary=2,
        jobs=2,
        workdir=tmp_path,
        echo=False,
    )
    assert summary.crash_points > 0
    assert summary.lost > 0, _report(summary)
    assert not summary.ok


def test_harness_reports_a_store_that_writes_half_a_batch(tmp_path: Path) -> None:
    summary = crash.run(
        f"{BROKEN}:SplittingStore",
        rounds=1,
        max_per_boundary=2,
        jobs=2,
        workdir=tmp_path,
        echo=False,
    )
    assert summary.crash_points > 0
    assert summary.half_applied > 0, _report(summary)
    assert not summary.ok


def test_harness_accepts_a_correct_store(tmp_path: Path) -> None:
    summary = crash.run(
        f"{BROKEN}:JsonlStore", rounds=1, max_per_boundary=1, jobs=2, workdir=tmp_path, echo=False
    )
    assert summary.ok, _report(summary)
