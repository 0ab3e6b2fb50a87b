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

from stepmachine import Message, StoredDataError
from stepmachine.extend import Lease
from stepmachine.stores import FileStore, SQLiteStore

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
