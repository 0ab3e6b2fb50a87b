"""Attack 33b: a real process SIGSTOPped while it holds a session's lease, or while it is
inside the lock-file leases' store-wide meta lock (SQLiteStore and FileStore).

Documented bounds (``stores/_flock_leases.py``, many-machines.md): a claim of a session
someone holds answers at once; while another process keeps the meta lock, a claim says
"busy, holder unknown" after ``CLAIM_META_WAIT`` (1 s), ``request_run`` and
``claim_next`` raise ``TimeoutError`` after ``META_WAIT`` (5 s), and a release lets go
without the meta lock after ``META_WAIT``. Checked here with wall-clock bounds (with
slack), then SIGCONT: the stopped run finishes, its non-idempotent tool ran once, and
the other sessions' runs were not disturbed.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _attack33b_common import finish_text, reap_children, start_child, wait_for

from stepmachine import (
    LeasePolicy,
    Message,
    ModelInference,
    Runtime,
    SessionBusyError,
    StateMachine,
)
from stepmachine.extend import history_problems
from stepmachine.stores import FileStore, SQLiteStore
from stepmachine.testing import ScriptedModel, reply


@pytest.fixture(autouse=True)
def _reap() -> Iterator[None]:
    yield
    reap_children()


def where(kind: str, tmp_path: Path) -> Path:
    return tmp_path / ("db.sqlite3" if kind == "sqlite" else "files")


async def open_store(kind: str, path: Path) -> Any:
    return await (SQLiteStore.open(path) if kind == "sqlite" else FileStore.open(path))


def stopped_child(kind: str, want: str, path: Path, tmp_path: Path) -> subprocess.Popen[str]:
    marker, go = tmp_path / "marker", tmp_path / "go"
    child = start_child("_attack33b_lease_child.py", kind, want, str(path), str(marker), str(go))
    wait_for(marker.exists, what=f"the child in {want}")
    child.send_signal(signal.SIGSTOP)
    return child


def resume(child: subprocess.Popen[str], tmp_path: Path) -> None:
    (tmp_path / "go").write_text("")
    child.send_signal(signal.SIGCONT)
    assert "finished" in finish_text(child)


def read_journal(path: Path) -> list[str]:
    return Path(str(path) + ".journal").read_text().split()


async def check_child_session(store: Any, path: Path) -> None:
    session = await store.load("s")
    assert session.conversation[-1].text == "charged"
    assert history_problems(session) == []
    journal = read_journal(path)
    assert len(journal) == 1, journal


async def timed(coro: Any) -> tuple[float, BaseException | None, Any]:
    start = time.monotonic()
    try:
        value = await coro
    except Exception as error:
        return time.monotonic() - start, error, None
    return time.monotonic() - start, None, value


MACHINE = StateMachine([ModelInference()])


@pytest.mark.parametrize("kind", ["sqlite", "file"])
async def test_a_stopped_lease_holder_leaves_others_bounded(tmp_path: Path, kind: str) -> None:
    path = where(kind, tmp_path)
    async with await open_store(kind, path) as store:
        await store.create("s", conversation=[Message.user("pay", id="u1")])
        await store.create("other", conversation=[Message.user("hi", id="u1")])
    child = stopped_child(kind, "tool", path, tmp_path)
    try:
        async with await open_store(kind, path) as store:
            runtime = Runtime(store=store, model=ScriptedModel([reply("x")] * 3))
            took, error, _ = await timed(MACHINE.run(runtime, "s", lease=LeasePolicy(busy="fail")))
            assert isinstance(error, SessionBusyError), repr(error)
            assert took < 1.0
            took, error, _ = await timed(
                MACHINE.run(runtime, "s", lease=LeasePolicy(busy="wait", wait_timeout=1.0))
            )
            assert isinstance(error, SessionBusyError), repr(error)
            assert took < 3.0
            took, error, report = await timed(
                MACHINE.run_report(runtime, "s", lease=LeasePolicy(busy="queue"))
            )
            assert error is None
            assert report.reason.kind == "queued"
            assert took < 1.0
            took, error, report = await timed(MACHINE.run_report(runtime, "other"))
            assert error is None
            assert report.reason.kind == "done"
            assert took < 2.0
            # Nothing was written to the held session while its holder was stopped.
            session = await store.load("s")
            assert [m.text for m in session.conversation][-1] != "x"
        resume(child, tmp_path)
        async with await open_store(kind, path) as store:
            await check_child_session(store, path)
            # The lease is free again.
            lease = await store.claim("s", "after", 10.0)
            assert hasattr(lease, "epoch")
            assert await store.release(lease) in (True, None)
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("kind", ["sqlite", "file"])
async def test_a_process_stopped_inside_the_meta_lock_leaves_others_bounded(
    tmp_path: Path, kind: str
) -> None:
    path = where(kind, tmp_path)
    async with await open_store(kind, path) as store:
        await store.create("s", conversation=[Message.user("pay", id="u1")])
        await store.create("other", conversation=[Message.user("hi", id="u1")])
        await store.create("third", conversation=[Message.user("hi", id="u1")])
        held = await store.claim("third", "parent", 10.0)  # claimed before the stop
        assert hasattr(held, "epoch")
        child = stopped_child(kind, "meta", path, tmp_path)
        try:
            runtime = Runtime(store=store, model=ScriptedModel([reply("x")] * 3))
            took, error, _ = await timed(
                MACHINE.run(runtime, "other", lease=LeasePolicy(busy="fail"))
            )
            assert isinstance(error, SessionBusyError), repr(error)
            assert took < 3.0
            took, error, _ = await timed(
                MACHINE.run(runtime, "other", lease=LeasePolicy(busy="wait", wait_timeout=2.0))
            )
            assert isinstance(error, SessionBusyError), repr(error)
            assert took < 5.0
            took, error, _ = await timed(store.request_run("other"))
            assert isinstance(error, TimeoutError), repr(error)
            assert took < 8.0
            took, error, _ = await timed(store.claim_next("parent", 10.0))
            assert isinstance(error, TimeoutError), repr(error)
            assert took < 8.0
            took, error, _ = await timed(store.release(held))
            assert error is None, repr(error)
            assert took < 8.0
            resume(child, tmp_path)
            await check_child_session(store, path)
            # Every lease is free afterwards; the other sessions run.
            for sid in ("other", "third"):
                report = await MACHINE.run_report(runtime, sid, lease=LeasePolicy(busy="fail"))
                assert report.reason.kind == "done"
        finally:
            if child.poll() is None:
                child.send_signal(signal.SIGCONT)
