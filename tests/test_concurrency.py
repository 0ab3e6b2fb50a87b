"""Invariants 2 and 3 across processes, via the concurrency harness.

Runs ``tests/harness/concurrency.py`` for the SQLite, file and PostgreSQL stores: eight
processes, released together, apply to the same session through their own
store objects, retrying on conflicts. Every acknowledged batch must be in the
final log exactly once, at the revision it was acknowledged with, also when
some writers are SIGKILLed mid-run. A store without a lock shows that the
harness reports lost updates.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import concurrency
import pytest

HARNESS = Path(__file__).resolve().parent / "harness"


BROKEN = HARNESS / "_common.py"

HARNESS_STORES = ["sqlite", "file", pytest.param("postgres", marks=pytest.mark.postgres)]
"""The stores the harness runs against (``store_kind``, see conftest.py)."""


def _report(summary: object) -> str:
    return "\n".join(summary.lines())  # type: ignore[attr-defined]


@pytest.mark.parametrize("store_kind", HARNESS_STORES, indirect=True)
def test_eight_writers_lose_nothing(store_kind: str, tmp_path: Path) -> None:
    summary = concurrency.run(
        store_kind, writers=8, batches_per_writer=6, workdir=tmp_path, echo=False
    )
    report = _report(summary)
    assert summary.failed_writers == [], report
    assert summary.problems == [], report
    assert summary.batches == 8 * 6, report
    assert summary.stored == 8 * 6, report
    assert summary.lost == 0, report
    assert summary.ok


@pytest.mark.parametrize("store_kind", HARNESS_STORES, indirect=True)
def test_killed_writers_block_nobody_and_lose_nothing(store_kind: str, tmp_path: Path) -> None:
    summary = concurrency.run(
        store_kind,
        writers=8,
        batches_per_writer=6,
        kill_writers=2,
        seed=4,
        workdir=tmp_path,
        echo=False,
    )
    report = _report(summary)
    assert summary.killed == 2, report
    assert summary.failed_writers == [], report
    assert summary.problems == [], report
    assert summary.lost == 0, report
    assert summary.batches >= 6 * 6, report
    assert summary.ok


def test_script_prints_the_summary_line_last(tmp_path: Path) -> None:
    completed = subprocess.run(
        [
            sys.executable,
            str(HARNESS / "concurrency.py"),
            "--store",
            "sqlite",
            "--writers",
            "8",
            "--batches-per-writer",
            "2",
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert completed.stdout.strip().splitlines()[-1] == "writers=8 batches=16 lost=0"


def test_harness_reports_lost_updates(tmp_path: Path) -> None:
    summary = concurrency.run(
        f"{BROKEN}:UnlockedStore", writers=8, batches_per_writer=6, workdir=tmp_path, echo=False
    )
    assert summary.lost > 0, _report(summary)
    assert not summary.ok


def test_harness_accepts_a_correct_store(tmp_path: Path) -> None:
    summary = concurrency.run(
        f"{BROKEN}:JsonlStore", writers=8, batches_per_writer=6, workdir=tmp_path, echo=False
    )
    assert summary.ok, _report(summary)
