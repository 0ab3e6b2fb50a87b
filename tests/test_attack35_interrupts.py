"""Attack 35: an interrupt raised in one of a run's own child tasks, in real processes.

On asyncio a ``KeyboardInterrupt`` / ``SystemExit`` raised in a concurrent tool's task or
in the lease's renewal task leaves the event loop at once; the loop's runner then cancels
the run. The run must finalize (a finished tool keeps its real result, a call left open
is answered "interrupted", nothing runs twice), end cancelled instead of raising the
interrupt again, and the process must exit; the caller gets the interrupt once. Under
trio the interrupt comes out as itself. Each child is ``tests/_attack35_child.py``; a
child that does not exit within ``HANG`` seconds is killed and reported as hung.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from stepmachine.extend import history_problems
from stepmachine.stores import FileStore, SQLiteStore

HERE = Path(__file__).resolve().parent
HANG = 6.0  # seconds: a child still alive then is hung (a normal one ends in about 1 s)
ENV = {**os.environ, "PYTHONPATH": f"{HERE.parent}{os.pathsep}{HERE}"}
DONE = {"fast": "fast done", "lag": "lag done"}


@dataclass
class Outcome:
    code: int | None  # None: hung (killed after HANG seconds)
    err: str
    took: float

    def summary(self) -> str:
        return f"code={self.code} took={self.took:.2f}s stderr={self.err[-1500:]!r}"


def start(scenario: str, runner: str, store: str, folder: Path) -> subprocess.Popen[str]:
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, str(HERE / "_attack35_child.py"), scenario, runner, store, str(folder)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )


def finish(process: subprocess.Popen[str], began: float, hang: float = HANG) -> Outcome:
    try:
        _, err = process.communicate(timeout=max(0.1, began + hang - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
        return Outcome(None, err, time.monotonic() - began)
    return Outcome(process.returncode, err, time.monotonic() - began)


def run(scenario: str, runner: str, store: str, folder: Path, hang: float = HANG) -> Outcome:
    began = time.monotonic()
    return finish(start(scenario, runner, store, folder), began, hang)


def run_all(cases: list[tuple[str, str, str, Path]]) -> list[Outcome]:
    """Several children at once (each bounded by ``HANG``), so hangs cost ``HANG`` once."""
    began = time.monotonic()
    started = [start(*case) for case in cases]
    return [finish(process, began) for process in started]


def journal(folder: Path) -> Counter[str]:
    path = folder / "journal.txt"
    return Counter(path.read_text().split() if path.exists() else [])


def load(folder: Path, store: str, sid: str = "s") -> Any:
    async def read() -> Any:
        if store == "sqlite":
            opened: Any = await SQLiteStore.open(folder / "db.sqlite3")
        else:
            opened = await FileStore.open(folder / "store")
        async with opened:
            return await opened.load(sid)

    return anyio.run(read)


def results(session: Any) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    for message in session.conversation:
        for result in message.tool_results:
            found.setdefault(result.call_id, []).append(result)
    return found


def check_finalized(
    folder: Path, store: str, done: list[str], interrupted: list[str], sid: str = "s"
) -> None:
    """Read in this (fresh) process: a valid history, one result per call, the finished
    tools' real results, "interrupted" for the calls left open; then a new run finishes
    the turn without running anything again."""
    prefix = "c-" if sid == "s" else "d-"
    session = load(folder, store, sid)
    assert history_problems(session) == [], history_problems(session)
    got = results(session)
    assert sorted(got) == sorted(prefix + n for n in done + interrupted), got
    assert all(len(answers) == 1 for answers in got.values()), got
    for name in done:
        (answer,) = got[prefix + name]
        assert (answer.content, answer.is_error) == (DONE[name], False), answer
    for name in interrupted:
        (answer,) = got[prefix + name]
        assert answer.is_error, answer
        assert answer.content.startswith("interrupted"), answer
    before = journal(folder)
    assert all(before[name] == 1 for name in done), before
    # A new process finishes the turn, running nothing again.
    resumed = run("resume", "asyncio", store, folder)
    assert resumed.code == 0, resumed.summary()
    session = load(folder, store, sid)
    assert history_problems(session) == []
    assert session.conversation[-1].text == "finished"
    assert all(len(a) == 1 for a in results(session).values()), results(session)
    after = journal(folder)
    assert after == before, (before, after)


def assert_interrupted_once(outcome: Outcome, kind: str = "KeyboardInterrupt") -> None:
    """The process exited (not hung), with the interrupt, delivered to the caller once
    (nothing else printed: no 'Task exception was never retrieved', no second
    traceback)."""
    assert outcome.code is not None, f"hung at exit: {outcome.summary()}"
    if kind == "KeyboardInterrupt":
        assert outcome.code == 130, outcome.summary()
        assert outcome.err.strip() == "CAUGHT KeyboardInterrupt", outcome.summary()
    else:
        assert outcome.code == 7, outcome.summary()
        assert outcome.err.strip() == "CAUGHT SystemExit 7", outcome.summary()


# -- asyncio.run, with and without the caller's own task groups -------------------------


@pytest.mark.parametrize(
    ("runner", "scenario", "store", "kind"),
    [
        ("asyncio", "ki_async", "sqlite", "KeyboardInterrupt"),
        ("asyncio", "exit_async", "file", "SystemExit"),
        ("asyncio", "exit_sync", "sqlite", "SystemExit"),
        ("asyncio", "ki_sync", "file", "KeyboardInterrupt"),
        ("taskgroup", "ki_async", "sqlite", "KeyboardInterrupt"),
        ("taskgroup", "exit_sync", "file", "SystemExit"),
        ("anyiogroup", "ki_sync", "sqlite", "KeyboardInterrupt"),
        ("anyiogroup", "exit_async", "file", "SystemExit"),
    ],
)
def test_concurrent_tool_interrupt_under_asyncio_run(
    tmp_path: Path, runner: str, scenario: str, store: str, kind: str
) -> None:
    """``fast`` finished, ``boom`` (async, or sync in a worker thread) raises the
    interrupt, ``slow`` still waits: the process exits with the interrupt once; the
    store holds ``fast``'s real result once and "interrupted" for the others."""
    outcome = run(scenario, runner, store, tmp_path)
    assert_interrupted_once(outcome, kind)
    assert outcome.took < 5.0, outcome.summary()
    boom = "boom" if scenario.endswith("async") else "boom_sync"
    check_finalized(tmp_path, store, ["fast"], [boom, "slow"])


def test_concurrent_tool_and_renewal_interrupt_under_anyio_run(tmp_path: Path) -> None:
    cases = [
        ("ki_async", "anyio", "sqlite", tmp_path / "ki"),
        ("exit_sync", "anyio", "file", tmp_path / "exit"),
        ("renewal", "anyio", "sqlite", tmp_path / "renewal"),
        ("ki_async", "anyio", "memory", tmp_path / "memory"),
    ]
    outcomes = run_all(cases)
    for (scenario, _, store, folder), outcome in zip(cases, outcomes, strict=True):
        kind = "SystemExit" if scenario.startswith("exit") else "KeyboardInterrupt"
        assert_interrupted_once(outcome, kind)
        if store != "memory":
            left = (
                ["slow"]
                if scenario == "renewal"
                else ["boom_sync" if scenario.endswith("_sync") else "boom", "slow"]
            )
            check_finalized(folder, store, ["fast"], left)


def test_two_sessions_in_one_process(tmp_path: Path) -> None:
    """Session ``s``'s tool raises ``KeyboardInterrupt`` while session ``s2`` (same
    process, same store) waits in a tool: both are finalized, the process exits once."""
    outcome = run("two_sessions", "asyncio", "sqlite", tmp_path)
    assert_interrupted_once(outcome)
    check_finalized(tmp_path, "sqlite", ["fast"], ["boom"])
    session = load(tmp_path, "sqlite", "s2")
    assert history_problems(session) == []
    got = results(session)
    assert list(got) == ["d-slow"], got
    assert len(got["d-slow"]) == 1, got
    assert got["d-slow"][0].content.startswith("interrupted"), got


# -- a sync sibling still in its worker thread ------------------------------------------


@pytest.mark.parametrize(("scenario", "lag_done"), [("ki_lag_short", True), ("ki_lag_long", False)])
def test_sync_sibling_still_running_in_its_thread(
    tmp_path: Path, scenario: str, lag_done: bool
) -> None:
    """``lag`` (sync, 0.5 s or 2.5 s in its worker thread) still runs when ``boom``
    raises ``KeyboardInterrupt``: the process exits after what ``lag`` takes (no hang);
    ``lag`` finishing within the grace keeps its real result, otherwise it is answered
    "interrupted" (its side effect still happens, once)."""
    outcome = run(scenario, "asyncio", "sqlite", tmp_path)
    assert_interrupted_once(outcome)
    assert outcome.took < (2.5 if lag_done else 5.0), outcome.summary()
    if lag_done:
        check_finalized(tmp_path, "sqlite", ["fast", "lag"], ["boom"])
    else:
        assert journal(tmp_path)["lag"] == 1
        check_finalized(tmp_path, "sqlite", ["fast"], ["lag", "boom"])


def test_second_interrupt_from_a_sync_sibling_during_the_cancellation(tmp_path: Path) -> None:
    outcome = run("double_interrupt", "asyncio", "sqlite", tmp_path)
    assert outcome.code is not None, f"hung at exit: {outcome.summary()}"
    session = load(tmp_path, "sqlite")
    assert history_problems(session) == [], history_problems(session)


# -- the lease's renewal task ----------------------------------------------------------


@pytest.mark.parametrize(
    ("runner", "scenario", "store"),
    [
        ("asyncio", "renewal", "sqlite"),
        ("asyncio", "renewal", "file"),
        ("asyncio", "renewal_write", "sqlite"),
        ("asyncio", "renewal_write", "file"),
        ("taskgroup", "renewal", "sqlite"),
        ("anyiogroup", "renewal_write", "sqlite"),
    ],
)
def test_renewal_interrupt_while_tools_run_or_records_are_written(
    tmp_path: Path, runner: str, scenario: str, store: str
) -> None:
    """The renewal task raises ``KeyboardInterrupt`` while a concurrent group of tools
    runs (``fast`` done, ``slow`` waiting), or while ``fast``'s result is being written:
    the process exits with it once; ``fast``'s result is recorded once."""
    outcome = run(scenario, runner, store, tmp_path)
    assert_interrupted_once(outcome)
    check_finalized(tmp_path, store, ["fast"], ["slow"])


def test_renewal_interrupt_with_a_memory_store(tmp_path: Path) -> None:
    """The brief's shape: ``MemoryStore(expiring_leases=True)`` and ``ttl=0.3``."""
    for scenario in ("renewal", "renewal_write"):
        outcome = run(scenario, "asyncio", "memory", tmp_path / scenario)
        assert_interrupted_once(outcome)


# -- trio: the interrupt comes out as itself ---------------------------------------------


@pytest.mark.parametrize(
    ("scenario", "store", "kind", "left"),
    [
        ("ki_async", "sqlite", "KeyboardInterrupt", ["boom", "slow"]),
        ("exit_sync", "file", "SystemExit", ["boom_sync", "slow"]),
        ("renewal", "sqlite", "KeyboardInterrupt", ["slow"]),
        ("renewal_write", "file", "KeyboardInterrupt", ["slow"]),
    ],
)
def test_trio_interrupt_is_itself(
    tmp_path: Path, scenario: str, store: str, kind: str, left: list[str]
) -> None:
    outcome = run(scenario, "trio", store, tmp_path)
    assert_interrupted_once(outcome, kind)
    check_finalized(tmp_path, store, ["fast"], left)


# -- real SIGINT from the parent ---------------------------------------------------------


def wait_for(path: Path, process: subprocess.Popen[str], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            _, err = process.communicate()
            raise AssertionError(f"the child never reached {path.name}: {err[-1500:]}")
        time.sleep(0.01)


def sigint_run(folder: Path, runner: str, scenario: str, times: int) -> Outcome:
    process = start(scenario, runner, "sqlite", folder)
    wait_for(folder / ("busy" if scenario == "busy" else "waiting"), process)
    began = time.monotonic()
    for _ in range(times):
        process.send_signal(signal.SIGINT)
        time.sleep(0.3)
    return finish(process, began)


@pytest.mark.parametrize("runner", ["asyncio", "anyio"])
def test_one_sigint_while_concurrent_tools_run(tmp_path: Path, runner: str) -> None:
    """One Ctrl-C (the runner cancels the main task) while ``boom`` waits beside the
    finished ``fast``: the process exits with ``KeyboardInterrupt``, finalized."""
    outcome = sigint_run(tmp_path, runner, "sigint", 1)
    assert_interrupted_once(outcome)
    check_finalized(tmp_path, "sqlite", ["fast"], ["boom"])


def test_ctrl_c_twice_lands_in_a_busy_concurrent_tool_under_asyncio_run(tmp_path: Path) -> None:
    """Ctrl-C twice while ``boom`` computes without awaiting: the first cancels the main
    task (not seen yet), the second raises ``KeyboardInterrupt`` inside ``boom``'s task,
    a run's child task: it leaves the loop; the process exits, finalized."""
    outcome = sigint_run(tmp_path, "asyncio", "busy", 2)
    assert_interrupted_once(outcome)
    check_finalized(tmp_path, "sqlite", ["fast"], ["boom"])


def test_ctrl_c_twice_lands_in_a_busy_concurrent_tool_under_anyio_run(tmp_path: Path) -> None:
    outcome = sigint_run(tmp_path, "anyio", "busy", 2)
    assert_interrupted_once(outcome)
    check_finalized(tmp_path, "sqlite", ["fast"], ["boom"])
