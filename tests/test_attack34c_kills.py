"""Attack 34c: SIGKILL in the middle of the error path of staged work (a task raised;
the machine is writing what it holds), then a resume in a fresh process, on SQLiteStore
and FileStore: nothing run twice, nothing stored twice, and what was stored stays."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from _attack34c_common import SID, keeps_written, receipts_written
from _attack34c_kill_child import reopen

HERE = Path(__file__).resolve().parent


def child(kind: str, folder: Path, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HERE / "_attack34c_kill_child.py"), kind, str(folder), mode],
        env={**os.environ, "PYTHONPATH": f"{HERE.parent}:{HERE}"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("kind", ["sqlite", "file"])
@pytest.mark.parametrize(
    ("mode", "receipts", "keeps"),
    [("before_keep", [], []), ("after_keep", [], ["b"]), ("after_receipt", ["a"], ["b"])],
)
def test_kill_in_the_error_path_then_resume(
    kind: str, mode: str, receipts: list[str], keeps: list[str], tmp_path: Path
) -> None:
    killed = child(kind, tmp_path, mode)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = child(kind, tmp_path, "resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    # the step answers keys without their record "outcome_unknown" (it never runs them
    # again), and refuses (idle) when every key has its record
    expected = "idle" if receipts else "outcome_unknown"
    assert resumed.stdout.strip() == f"finished {expected}", resumed.stdout
    lines = (tmp_path / "journal.txt").read_text().splitlines()
    assert lines == [f"a {mode}"], f"a's side effect: once, by the killed process: {lines}"

    async def check() -> None:
        store = await reopen(kind, tmp_path)
        batches = await store.batches(SID)
        assert receipts_written(batches) == receipts
        assert keeps_written(batches) == keeps
        stored = await store.load(SID)
        assert set(stored.data.keys) == {"a", "b"}
        await store.aclose()

    anyio.run(check)
