"""The workers harness (``tests/harness/workers.py``): many worker processes, one PostgreSQL.

The harness runs briefly as a subprocess, the way it is run by hand, on the
test session's server; its last line must read every session done with nothing
lost, duplicated, invalid or of unknown outcome, after at least one SIGKILL.
Its summary and exit status, and the ``--durable`` hook without its module,
are checked without a server.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import _postgres
import pytest
import workers

HARNESS = Path(workers.__file__).resolve()
OWN_SERVER_ENV = {k: v for k, v in os.environ.items() if k != _postgres.ENV_VAR}
"""The environment that decides whether a harness can start a server of its own."""
LAST_LINE = re.compile(
    r"workers=(?P<workers>\d+) sessions=(?P<sessions>\d+) kills=(?P<kills>\d+) "
    r"lost=(?P<lost>\d+) duplicate_side_effects=(?P<duplicate_side_effects>\d+) "
    r"dropped_turns=(?P<dropped_turns>\d+) "
    r"invalid=(?P<invalid>\d+) outcome_unknown=(?P<outcome_unknown>\d+)"
)


def run_harness(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``workers.py *args``; its output."""
    return subprocess.run(
        [sys.executable, str(HARNESS), *args],
        capture_output=True,
        text=True,
        timeout=600,  # a guard against a hang, not a timing threshold
        check=False,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow
def test_killed_workers_leave_every_session_done(postgres_server: str) -> None:
    done = run_harness(
        *("--workers", "2", "--sessions", "3", "--turns", "2", "--seconds", "6", "--seed", "3"),
        env={_postgres.ENV_VAR: postgres_server},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    match = LAST_LINE.fullmatch(last)
    assert match is not None, last
    counts = {name: int(value) for name, value in match.groupdict().items()}
    assert counts["workers"] == 2
    assert counts["sessions"] == 3
    assert counts["kills"] >= 1  # the first kill lands in the first second, mid-work
    assert counts["lost"] == counts["duplicate_side_effects"] == counts["dropped_turns"] == 0
    assert counts["invalid"] == counts["outcome_unknown"] == 0


@pytest.mark.slow
def test_workers_ride_out_restarts_of_the_database() -> None:
    """``--restart-db``: its own server is restarted (-m fast, then -m immediate) while
    workers run and are killed; every turn is served, none dropped, nothing duplicated."""
    if (
        _postgres.unavailable_reason(OWN_SERVER_ENV) is not None
    ):  # its own server, whatever the variable
        pytest.skip(f"no PostgreSQL server: {_postgres.unavailable_reason(OWN_SERVER_ENV)}")
    done = run_harness(
        *("--restart-db", "--workers", "2", "--sessions", "3", "--turns", "3"),
        *("--seconds", "6", "--seed", "5", "--timeout", "90"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    match = LAST_LINE.fullmatch(lines[-1])
    assert match is not None, lines[-1]
    counts = {name: int(value) for name, value in match.groupdict().items()}
    assert counts["lost"] == counts["duplicate_side_effects"] == counts["dropped_turns"] == 0
    assert counts["invalid"] == counts["outcome_unknown"] == 0
    assert "restarted the server (-m fast" in done.stdout
    assert "restarted the server (-m immediate" in done.stdout
    assert " restarts=2 " in f" {lines[-2]} "


def test_summary_line_and_exit_status() -> None:
    summary = workers.Summary(3, 6, kills=4)
    assert summary.line() == (
        "workers=3 sessions=6 kills=4 lost=0 duplicate_side_effects=0 dropped_turns=0 "
        "invalid=0 outcome_unknown=0"
    )
    assert summary.ok
    assert LAST_LINE.fullmatch(summary.lines()[-1])
    for name in ("lost", "duplicate_side_effects", "dropped_turns", "invalid", "outcome_unknown"):
        wrong = workers.Summary(3, 6, kills=4)
        setattr(wrong, name, 1)
        assert not wrong.ok
        assert f"{name}=1" in wrong.line()
    failed = workers.Summary(3, 6)
    failed.problems.append("worker 1 exited 1")
    assert not failed.ok
    assert failed.lines()[-2] == "PROBLEM: worker 1 exited 1"


def test_durable_without_its_module_says_what_is_missing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert workers.durable("nosuch", ["--workers", "2"]) == 2
    said = capsys.readouterr().err
    assert "tests/harness/nosuch_crash.py is not here" in said
    assert "run without --durable for leases alone" in said


def test_durable_passes_on_the_options_it_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def main(argv: list[str]) -> int:
        seen.append(argv)
        return 7

    monkeypatch.setitem(sys.modules, "fake_crash", SimpleNamespace(main=main))
    argv = ["--workers", "2", "--seconds", "5", "--seed=3", "--durable", "dbos", "--turns", "1"]
    assert workers.durable("fake", argv) == 7
    assert seen == [["--workers", "2", "--seed=3", "--turns", "1"]]
    assert workers.durable("fake", ["--restart-db", "--sessions", "2"]) == 7
    assert seen[-1] == ["--restart-db", "--sessions", "2"]
