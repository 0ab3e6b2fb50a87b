"""Attack 33b: Ctrl-C (SIGINT) to a real ``asyncio.run(main())`` process running
``machine.run()`` on SQLite, at every hit of a run: each store boundary (inside the
worker thread's transaction), the lock-file leases' claim and release, the plain tool
(its worker thread) and the model call.

``asyncio.run`` turns the first SIGINT into a native ``task.cancel()`` of ``main``; the
store's hop (``_async.run_in_thread``) must wait for the thread. Checked: the process
ends (``KeyboardInterrupt``, within a bound) once the hit is let go, a fresh process
resumes and finishes, the history is valid, the non-idempotent ``charge`` took effect at
most once and is answered once (its real result, "interrupted" or "outcome unknown").
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from _attack33b_common import finish_text, reap_children, start_child, wait_for

from stepmachine.extend import history_problems
from stepmachine.stores import SQLiteStore


@pytest.fixture(autouse=True)
def _reap() -> Iterator[None]:
    yield
    reap_children()


def child(db: Path, nth: int, tmp_path: Path) -> subprocess.Popen[str]:
    return start_child(
        "_attack33b_sigint_child.py", str(db), str(nth), str(tmp_path / "marker"),
        str(tmp_path / "go"),
    )  # fmt: skip


def check(db: Path) -> None:
    async def read() -> None:
        async with await SQLiteStore.open(db) as store:
            session = await store.load("s")
            assert history_problems(session) == []
            assert session.conversation[-1].text == "charged"
            results = Counter(r.call_id for m in session.conversation for r in m.tool_results)
            assert all(n == 1 for n in results.values()), results

    anyio.run(read)
    journal_path = Path(str(db) + ".journal")
    journal = journal_path.read_text().split() if journal_path.exists() else []
    assert all(n == 1 for n in Counter(journal).values()), journal


def test_ctrl_c_at_every_hit_of_a_sqlite_run(tmp_path: Path) -> None:
    hits = json.loads(finish_text(child(tmp_path / "count.sqlite3", 0, tmp_path)))
    assert "leases._claim" in hits
    assert "tool" in hits
    assert len(hits) < 40
    outcomes: dict[str, int] = {}
    for nth in range(1, len(hits) + 1):
        folder = tmp_path / f"hit{nth}"
        folder.mkdir()
        db = folder / "db.sqlite3"
        process = child(db, nth, folder)
        wait_for((folder / "marker").exists, what=f"hit {nth}")
        name = (folder / "marker").read_text()
        process.send_signal(signal.SIGINT)
        time.sleep(0.2)
        (folder / "go").write_text("")
        start = time.monotonic()
        _, err = process.communicate(timeout=30)
        took = time.monotonic() - start
        # A run may finish if the interrupt lands after its last await; otherwise
        # KeyboardInterrupt. Either way it ends, within about a second plus finalize.
        assert process.returncode in (0, 1, -signal.SIGINT, 130), (nth, name, err[-2000:])
        if process.returncode != 0:
            assert "KeyboardInterrupt" in err, (nth, name, err[-2000:])
        assert took < 15.0, (nth, name, took)
        outcomes[f"{nth}:{name}"] = process.returncode
        assert "cannot start a transaction" not in err, (nth, name, err[-2000:])
        # A fresh process resumes and finishes.
        (folder / "go").unlink()
        resumed = child(db, 10**6, folder)
        finish_text(resumed)
        check(db)
    interrupted = [hit for hit, code in outcomes.items() if code != 0]
    assert len(interrupted) >= len(hits) - 2, outcomes  # the interrupt did land
