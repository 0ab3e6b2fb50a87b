"""The benchmarks run and end with the summary line issue 9 asks for.

Each benchmark runs with ``--quick`` (tiny sizes) in a subprocess; only the
format of its last line is checked (the names, in order, and that every value
parses as a float), never the values: timings are measured, not asserted.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import _postgres
import pytest

ROOT = Path(__file__).resolve().parent.parent

CYCLE_NAMES = ("cycle_us", "bare_us", "growth_2000_over_20", "growth_ops_2000_over_20")
STORE_NAMES = (
    "batch_us",
    "raw_commit_us",
    "batches_per_step",
    "apply_2000_over_20",
    "reload_2000_over_20",
    "bytes_ratio",
)
OBSERVABILITY_NAMES = ("off_us", "events_over_off", "spans_over_off", "both_over_off")
MEDIA_NAMES = ("forged_jpeg_ms", "unbounded_jpeg_ms", "three_images_index_ms")
POSTGRES_NAMES = ("postgres_batch_us", "postgres_raw_commit_us", "postgres_batch_over_raw")


def last_line_pattern(names: tuple[str, ...]) -> re.Pattern[str]:
    """``name=<value>`` for each name, in order, separated by single spaces, nothing else."""
    return re.compile(" ".join(rf"{name}=(?P<{name}>\S+)" for name in names))


def run_benchmark(
    script: str, *args: str, cwd: Path, env: dict[str, str] | None = None
) -> list[str]:
    """Run ``benchmarks/<script> --quick *args``; its output lines (at least one)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,  # a guard against a hang, not a timing threshold
        check=False,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines, f"{script} printed nothing; stderr: {done.stderr}"
    return lines


def check_last_line(line: str, names: tuple[str, ...]) -> dict[str, float]:
    """The figures of a summary line, each a finite float; fails on any other format."""
    match = last_line_pattern(names).fullmatch(line)
    assert match is not None, f"last line {line!r} is not {' '.join(f'{n}=<f>' for n in names)}"
    figures = {name: float(match[name]) for name in names}
    assert all(math.isfinite(value) for value in figures.values()), line
    return figures


def test_pattern_rejects_other_lines() -> None:
    # The check itself can fail: wrong order, missing or extra names, non-numbers.
    line = "cycle_us=1.5 bare_us=0.2 growth_2000_over_20=3.00 growth_ops_2000_over_20=4.00"
    assert check_last_line(line, CYCLE_NAMES) == {
        "cycle_us": 1.5,
        "bare_us": 0.2,
        "growth_2000_over_20": 3.0,
        "growth_ops_2000_over_20": 4.0,
    }
    for bad in (
        "bare_us=0.2 cycle_us=1.5 growth_2000_over_20=3.00 growth_ops_2000_over_20=4.00",
        "cycle_us=1.5 bare_us=0.2 growth_2000_over_20=3.00",
        "cycle_us=1.5 bare_us=0.2 growth_2000_over_20=3.00 growth_ops_2000_over_20=4 extra=1",
        "cycle_us=1.5 bare_us=n/a growth_2000_over_20=3.00 growth_ops_2000_over_20=4.00",
        "cycle_us=1.5 bare_us=0.2 growth_ops_2000_over_20=4.00 growth_2000_over_20=3.00",
    ):
        with pytest.raises((AssertionError, ValueError)):
            check_last_line(bad, CYCLE_NAMES)


@pytest.mark.slow
def test_cycle_benchmark_last_line(tmp_path: Path) -> None:
    check_last_line(run_benchmark("cycle.py", cwd=tmp_path)[-1], CYCLE_NAMES)


@pytest.mark.slow
def test_observability_benchmark_last_line(tmp_path: Path) -> None:
    check_last_line(run_benchmark("observability.py", cwd=tmp_path)[-1], OBSERVABILITY_NAMES)


def test_media_benchmark_last_line(tmp_path: Path) -> None:
    check_last_line(run_benchmark("media.py", cwd=tmp_path)[-1], MEDIA_NAMES)


@pytest.mark.slow
def test_store_benchmark_last_line(tmp_path: Path) -> None:
    # FileStore without fsync keeps the quick run to seconds; the figures checked are SQLite's.
    # PostgreSQL has its own test below (skipped where no server can be started).
    lines = run_benchmark(
        "store.py",
        "--stores",
        "memory,sqlite,file",
        "--file-fsync",
        "never",
        "--dir",
        str(tmp_path),
        cwd=tmp_path,
    )
    check_last_line(lines[-1], STORE_NAMES)
    unmeasured = "postgres_batch_us=n/a postgres_raw_commit_us=n/a postgres_batch_over_raw=n/a"
    assert lines[-2] == unmeasured


@pytest.mark.slow
def test_store_benchmark_measures_postgres(postgres_server: str, tmp_path: Path) -> None:
    # The session's server (postgres_server) is passed on: the benchmark starts none of its own.
    lines = run_benchmark(
        "store.py",
        "--stores",
        "sqlite,postgres",
        "--dir",
        str(tmp_path),
        cwd=tmp_path,
        env={_postgres.ENV_VAR: postgres_server},
    )
    check_last_line(lines[-1], STORE_NAMES)
    check_last_line(lines[-2], POSTGRES_NAMES)
    assert "postgres apply at 20 msgs vs a raw PostgreSQL transaction" in "\n".join(lines)
