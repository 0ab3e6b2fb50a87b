"""Something that is not a regular file where a lease file or an SQLite companion file
belongs: a clear StoredDataError naming it, never a hang, and the other sessions served.

The FIFOs, folders and links are real. Every operation that could block on a FIFO runs
in a child process under a hang guard, so a regression fails the test
(``subprocess.TimeoutExpired``) instead of stalling the suite.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog

from stepmachine import (
    CancelToken,
    Message,
    ModelInference,
    Runtime,
    StateMachine,
    StoredDataError,
    run_worker,
)
from stepmachine import _transient as transient
from stepmachine.extend import Lease
from stepmachine.stores import FileStore, SQLiteStore
from stepmachine.testing import FunctionModel, reply

pytestmark = pytest.mark.skipif(
    not hasattr(os, "mkfifo") or sys.platform == "win32", reason="needs FIFOs and flock"
)

LEASE_CHILD = Path(__file__).resolve().parent / "_lease_child.py"
HANG_GUARD = 60  # seconds: far past any honest run on a loaded machine; only a hang reaches it
KINDS = ["fifo", "directory", "symlink"]


def _name(session_id: str) -> str:
    return base64.b32encode(session_id.encode()).decode().rstrip("=").lower()


def _spoil(path: Path, kind: str) -> None:
    """Put ``kind`` (a FIFO, a folder, a link to a regular file) at ``path``."""
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        target = path.with_name(path.name + ".target")  # no name of the store's
        target.write_bytes(b"")
        path.symlink_to(target)


def _child(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
        check=False,
        stdin=subprocess.DEVNULL,
        env=env,
    )


async def _claimed_once(folder: Path, *sessions: str) -> None:
    """Sessions each claimed and released once (epoch 1), then each marked pending."""
    async with await FileStore.open(folder) as store:
        for sid in sessions:
            await store.create(sid, conversation=[Message.user(f"hi {sid}", id="u1")])
            lease = await store.claim(sid, "setup", 5.0)
            assert isinstance(lease, Lease)
            await store.release(lease)
            await store.request_run(sid)


def _where(folder: Path, position: str) -> Path:
    leases = folder / ".leases"
    return {
        "lock": leases / "sessions" / f"{_name('a')}.lock",
        "held": leases / "held" / _name("a"),
        "runs": leases / "runs" / _name("a"),
        "meta": leases / "meta.lock",
    }[position]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("op", "position"),
    [
        ("claim", "lock"),
        ("claim", "held"),
        ("claim", "runs"),
        ("claim", "meta"),
        ("request_run", "runs"),
        ("request_run", "meta"),
    ],
)
def test_a_lease_file_that_is_not_regular_is_a_stored_data_error_naming_it(
    tmp_path: Path, position: str, kind: str, op: str, anyio_backend: str
) -> None:
    folder = tmp_path / "store"
    anyio.run(_claimed_once, folder, "a")
    bad = _where(folder, position)
    _spoil(bad, kind)
    done = _child(str(LEASE_CHILD), op, str(folder), "a", anyio_backend)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["error"] == "StoredDataError", got
    assert str(bad) in got["message"]
    assert "remove it" in got["message"]
    if position == "lock":
        return  # a lock file made anew restarts the epochs (its record is what was lost)

    async def after() -> None:  # the refused call changed nothing: the next epoch is 2
        bad.rmdir() if kind == "directory" else bad.unlink()
        async with await FileStore.open(folder) as store:
            lease = await store.claim("a", "after", 5.0)
            assert isinstance(lease, Lease)
            assert lease.epoch == 2

    anyio.run(after, backend=anyio_backend)


@pytest.mark.parametrize("kind", ["directory", "symlink"])
@pytest.mark.parametrize("position", ["lock", "held", "runs"])
async def test_claim_next_skips_the_damaged_session_logs_it_once_and_serves_the_next(
    tmp_path: Path, position: str, kind: str
) -> None:
    folder = tmp_path / "store"
    await _claimed_once(folder, "a", "b")
    bad = _where(folder, position)
    _spoil(bad, kind)
    runs_a = folder / ".leases" / "runs" / _name("a")  # "a" waited longest: tried first
    os.utime(runs_a, ns=(1, 1), follow_symlinks=False)
    async with await FileStore.open(folder) as store:
        with structlog.testing.capture_logs() as logs:
            first = await store.claim_next("w", 5.0)
            again = await store.claim_next("w", 5.0)
    assert isinstance(first, Lease)
    assert first.session_id == "b"
    assert again is None
    damaged = [e for e in logs if e["event"] == "lease_files_damaged"]
    assert len(damaged) == 1, logs
    assert damaged[0]["log_level"] == "error"
    assert damaged[0]["session_id"] == "a"
    assert str(bad) in damaged[0]["detail"]


async def test_a_release_unlocks_even_when_the_held_mark_became_a_folder(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    await _claimed_once(folder, "a")
    async with await FileStore.open(folder) as one, await FileStore.open(folder) as two:
        lease = await one.claim("a", "one", 5.0)
        assert isinstance(lease, Lease)
        held = _where(folder, "held")
        held.unlink()
        held.mkdir()
        with structlog.testing.capture_logs() as logs:
            assert await one.release(lease) is True
        assert [e["event"] for e in logs if e["log_level"] == "error"] == ["lease_files_damaged"]
        with pytest.raises(StoredDataError, match="held mark"):  # unlocked: the claim gets
            await two.claim("a", "two", 5.0)  # as far as the folder, and names it


# -- serve() and a claim past a lock, held or mark file that is not regular -----------


def _echo(request: Any) -> Any:
    return reply(f"re: {request.messages[-1].text}")


@pytest.fixture
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transient, "BACKOFF_FIRST", 0.01)
    monkeypatch.setattr(transient, "BACKOFF_CAP", 0.05)


async def _two_pending(folder: Path) -> None:
    async with await FileStore.open(folder) as store:
        for sid in ("a", "b"):
            await store.create(sid, conversation=[Message.user(f"hi {sid}", id="u1")])
            await store.request_run(sid)
            os.utime(folder / ".leases" / "runs" / _name(sid), ns=(1, 1 if sid == "a" else 2))


async def _serve_for(folder: Path, seconds: float) -> tuple[list[str], list[dict[str, Any]]]:
    """serve() over the folder until ``b`` is served or ``seconds`` pass (a hang guard)."""
    served: list[str] = []
    stop = CancelToken()

    def seen(report: Any) -> None:
        served.append(report.session.id)
        if "b" in served:
            stop.cancel("done")

    async with await FileStore.open(folder) as store:
        runtime = Runtime(store=store, model=FunctionModel(_echo))
        with structlog.testing.capture_logs() as logs:
            with anyio.move_on_after(seconds):
                await run_worker(
                    StateMachine([ModelInference()]), runtime, stop=stop, poll=0.01, on_report=seen
                )
    return served, logs


@pytest.mark.usefixtures("quick_backoff")
async def test_a_directory_lock_file_does_not_stop_other_sessions_being_served(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "store"
    await _two_pending(folder)
    lock = folder / ".leases" / "sessions" / f"{_name('a')}.lock"
    lock.unlink(missing_ok=True)
    lock.mkdir()
    served, logs = await _serve_for(folder, 10)
    failed = [e for e in logs if e["event"] == "serve_claim_failed"]
    assert "b" in served, (failed[:1], len(failed))


@pytest.mark.parametrize("where", ["held", "runs"])
def test_a_fifo_held_or_mark_file_never_blocks_a_claim(
    tmp_path: Path, where: str, anyio_backend: str
) -> None:
    folder = tmp_path / "store"
    anyio.run(_two_pending, folder)
    path = folder / ".leases" / where / _name("a")
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    op = "claim" if where == "held" else "request_run"
    try:
        done = subprocess.run(
            [sys.executable, str(LEASE_CHILD), op, str(folder), "a", anyio_backend],
            capture_output=True,
            text=True,
            timeout=15,
            env=env,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{op} blocked on a FIFO at .leases/{where}/ (killed after 15 s)")
    assert done.returncode == 0, done.stderr


_SQLITE_CHILD = """
import json, sys, anyio
from stepmachine.stores import SQLiteStore

async def main(path, read_only):
    try:
        store = await SQLiteStore.open(path, read_only=read_only == "1")
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    try:
        session = await store.load("s1")
    finally:
        await store.aclose()
    return {"ok": session.id}

print(json.dumps(anyio.run(main, sys.argv[1], sys.argv[2], backend=sys.argv[3])))
"""


@pytest.mark.parametrize("read_only", ["0", "1"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("suffix", ["-journal", "-wal", "-shm"])
def test_no_regular_file_beside_the_sqlite_database_is_a_stored_data_error_naming_it(
    tmp_path: Path, suffix: str, kind: str, read_only: str, anyio_backend: str
) -> None:
    path = tmp_path / "db" / "agent.sqlite3"
    path.parent.mkdir()

    async def make() -> None:
        store = await SQLiteStore.open(path)
        await store.create("s1", conversation=[Message.user("hi", id="u1")])
        await store.aclose()

    anyio.run(make)
    before = path.read_bytes()
    side = Path(f"{path}{suffix}")
    _spoil(side, kind)
    done = _child("-c", _SQLITE_CHILD, str(path), read_only, anyio_backend)
    assert done.returncode == 0, done.stderr
    got: dict[str, Any] = json.loads(done.stdout)
    assert got.get("error") == "StoredDataError", got
    assert str(side) in got["message"]
    assert "remove it" in got["message"]
    assert path.read_bytes() == before  # nothing changed


def test_a_companion_beside_the_file_a_database_link_leads_to_is_checked(
    tmp_path: Path, anyio_backend: str
) -> None:
    """SQLite names its files after the resolved database path: those are checked too."""
    real = tmp_path / "real" / "agent.sqlite3"
    real.parent.mkdir()

    async def make() -> None:
        store = await SQLiteStore.open(real)
        await store.create("s1", conversation=[Message.user("hi", id="u1")])
        await store.aclose()

    anyio.run(make)
    link = tmp_path / "link.sqlite3"
    link.symlink_to(real)
    os.mkfifo(f"{real}-journal")
    done = _child("-c", _SQLITE_CHILD, str(link), "0", anyio_backend)
    got = json.loads(done.stdout)
    assert got.get("error") == "StoredDataError", got
    assert f"{real}-journal" in got["message"]
