"""A FIFO (or another non-regular file) where a store keeps a file never blocks a reader.

``open()`` of a FIFO for reading waits for a writer that never comes. Each reader here
runs in a child process with a timeout: if the store ever blocks again, the test fails
(``subprocess.TimeoutExpired``) instead of stalling the suite. The FIFOs are real
(``os.mkfifo``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from stepmachine import Message
from stepmachine.stores import FileStore, SQLiteStore

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
BACKENDS = pytest.mark.parametrize("backend", ["asyncio", "trio"])  # the child's event loop

CHILD = Path(__file__).resolve().parent / "_store_reader_child.py"
HANG_GUARD = 60  # seconds: far past any honest run on a loaded machine; only a hang reaches it


def _child(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``args`` (a Python command line) in a child process that cannot hang the test."""
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


def _read(mode: str, url: str, session_id: str, backend: str) -> Any:
    done = _child(str(CHILD), mode, url, session_id, backend)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _cli(url: str, backend: str, *args: str) -> subprocess.CompletedProcess[str]:
    return _child("-m", "stepmachine", "--store", url, "--backend", backend, *args)


def _store(tmp_path: Path) -> Path:
    """A file store holding ``good`` (three batches, a snapshot after each) and ``pipe``,
    whose log is then replaced by a FIFO."""
    folder = tmp_path / "store"

    async def main() -> None:
        async with await FileStore.open(folder, snapshot_every=1) as store:
            for session_id in ("good", "pipe"):
                await store.create(session_id, conversation=[Message.user("hi", id="u1")])

    anyio.run(main)
    (folder / "pipe.log").unlink()
    os.mkfifo(folder / "pipe.log")
    return folder


@BACKENDS
def test_load_of_a_fifo_log_is_stored_data_error(tmp_path: Path, backend: str) -> None:
    folder = _store(tmp_path)
    got = _read("load", f"file://{folder}", "pipe", backend)
    assert got["error"] == "StoredDataError", got
    assert "'pipe'" in got["message"]
    assert str(folder / "pipe.log") in got["message"]
    assert "FIFO" in got["message"]
    assert "not a regular file" in got["message"]
    assert _read("load", f"file://{folder}", "good", backend) == {"revision": 0}


@BACKENDS
def test_a_fifo_snapshot_is_ignored_and_the_log_replayed(tmp_path: Path, backend: str) -> None:
    """A snapshot is a cache of the log: one that is not a regular file is ignored (with a
    warning), like a damaged one, and the log is replayed."""
    folder = _store(tmp_path)
    (folder / "good.snap").unlink(missing_ok=True)
    os.mkfifo(folder / "good.snap")
    assert _read("load", f"file://{folder}", "good", backend) == {"revision": 0}


@BACKENDS
def test_a_directory_log_is_stored_data_error(tmp_path: Path, backend: str) -> None:
    folder = _store(tmp_path)
    (folder / "dir.log").mkdir()
    got = _read("load", f"file://{folder}", "dir", backend)
    assert got["error"] == "StoredDataError", got
    assert "a directory" in got["message"]


@BACKENDS
def test_the_read_commands_never_block_on_a_fifo_log(tmp_path: Path, backend: str) -> None:
    folder = _store(tmp_path)
    url = f"file://{folder}"
    listed = _cli(url, backend, "sessions", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {row["id"]: row for row in map(json.loads, listed.stdout.splitlines())}
    assert rows["good"]["status"] == "idle"
    assert rows["pipe"]["status"] == "unreadable"
    assert "not a regular file" in rows["pipe"]["error"]
    text = _cli(url, backend, "sessions", "list")
    assert text.returncode == 0, text.stderr
    assert "good" in text.stdout
    assert "pipe: " in text.stderr
    checked = _cli(url, backend, "fsck")
    assert checked.returncode == 1, checked.stderr
    assert "pipe: unreadable" in checked.stdout
    assert "good:" not in checked.stdout
    one = _cli(url, backend, "fsck", "pipe")
    assert one.returncode == 1
    assert "pipe: unreadable" in one.stdout
    shown = _cli(url, backend, "show", "pipe")
    assert shown.returncode == 1
    assert "not a regular file" in shown.stderr
    assert "Traceback" not in shown.stderr
    exported = _cli(url, backend, "export", "pipe", "--json", str(tmp_path / "out.json"))
    assert exported.returncode == 1
    assert "not a regular file" in exported.stderr
    assert not (tmp_path / "out.json").exists()
    assert _cli(url, backend, "show", "good").returncode == 0


@BACKENDS
def test_the_web_list_never_blocks_on_a_fifo_log(tmp_path: Path, backend: str) -> None:
    pytest.importorskip("starlette")
    folder = _store(tmp_path)
    got = _read("web", f"file://{folder}", "-", backend)
    assert got["status"] == [200, 200], got
    rows = {row["id"]: row for row in got["api"]}
    assert rows["good"]["status"] == "idle"
    assert "not a regular file" in rows["pipe"]["error"]
    assert "unreadable" in got["page"]


@BACKENDS
def test_sqlite_open_of_a_fifo_is_stored_data_error(tmp_path: Path, backend: str) -> None:
    """The SQLite store reads its file's header before SQLite opens it: a FIFO there is
    refused, not waited on."""
    path = tmp_path / "agent.sqlite3"
    os.mkfifo(path)
    script = (
        "import sys, anyio\n"
        "from stepmachine import StoredDataError\n"
        "from stepmachine.stores import SQLiteStore\n"
        "async def main():\n"
        "    try:\n"
        "        await SQLiteStore.open(sys.argv[1], read_only=sys.argv[2] == 'ro')\n"
        "    except StoredDataError as exc:\n"
        "        print(exc)\n"
        "for mode in ('ro', 'rw'):\n"
        "    sys.argv[2:] = [mode]\n"
        f"    anyio.run(main, backend={backend!r})\n"
    )
    done = _child("-c", script, str(path), "ro")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stdout
    assert all("not a regular file" in line and str(path) in line for line in lines)


@BACKENDS
def test_the_read_commands_refuse_a_fifo_sqlite_store(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "agent.sqlite3"
    os.mkfifo(path)
    for command in (("sessions", "list"), ("show", "s1"), ("fsck",)):
        done = _cli(f"sqlite:///{path}", backend, *command)
        assert done.returncode == 1, (command, done.stderr)
        assert "FIFO" in done.stderr
        assert "not a regular file" in done.stderr
        assert "Traceback" not in done.stderr


# -- SQLite: a FIFO beside the database (-wal, -journal, -shm) -----------------------------


def _cli_child(*args: str, timeout: float = 20) -> subprocess.CompletedProcess[str] | None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        return subprocess.run(
            [sys.executable, "-m", "stepmachine", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None


@pytest.mark.parametrize(
    "suffix",
    [
        "-wal",
        "-shm",
        "-journal",
    ],
)
def test_a_fifo_beside_the_sqlite_database_never_blocks_the_cli(
    tmp_path: Path, suffix: str
) -> None:
    """Someone left a FIFO where SQLite keeps its WAL, shared memory or journal: the
    read commands end (with an error or a listing), they never hang."""
    path = tmp_path / "agent.sqlite3"

    async def make() -> None:
        store = await SQLiteStore.open(path)
        await store.create("s1", conversation=[Message.user("hi", id="u1")])
        await store.aclose()

    anyio.run(make)
    side = Path(str(path) + suffix)
    side.unlink(missing_ok=True)
    os.mkfifo(side)
    for command in (("sessions", "list"), ("show", "s1")):
        done = _cli_child("--store", f"sqlite:///{path}", *command)
        assert done is not None, f"{command} hung on a FIFO at {side.name} (killed after 20 s)"
        assert "Traceback" not in done.stderr, done.stderr[-1500:]
