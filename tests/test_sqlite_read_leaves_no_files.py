"""Reading an SQLite store leaves nothing behind, and still sees a live writer's data.

A WAL database needs its ``-wal`` and ``-shm`` files while any connection has it
open; SQLite removes them when the last connection closes, but only a connection
that may write can (it checkpoints first). A ``mode=ro`` reader closing last left
both beside a store that had been closed cleanly. Here: a cleanly closed store,
each read command (and a read-only open, and the web view), then the folder is
exactly as it was; and a reader opened while a writer is live sees what the
writer commits afterwards, and leaves the writer's files alone.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import anyio
import httpx
import pytest
from click.testing import CliRunner

from stepmachine import Message
from stepmachine.inspector._cli import cli
from stepmachine.inspector._open import open_store
from stepmachine.stores import SQLiteStore


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _folder(folder: Path) -> dict[str, str]:
    """Every name in ``folder`` and the hash of its bytes."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


async def _closed_store(folder: Path) -> Path:
    path = folder / "agent.sqlite3"
    async with await SQLiteStore.open(path) as store:
        await store.create("s1", conversation=[Message.user("hello", id="u1")])
        await store.create("s2")
    assert _names(folder) == ["agent.sqlite3"]  # closed cleanly
    return path


READS = {  # each read command, and a text its output holds
    "sessions list": "s2",
    "sessions list --json": '"id": "s1"',
    "show s1": "hello",
    "show s1 --json": '"text": "hello"',
    "log s1": "",
    "fsck": "checked 2 session(s)",
    "fsck s1": "no problems found",
}


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("command", sorted(READS))
def test_a_read_command_leaves_the_folder_unchanged(
    tmp_path: Path, backend: str, command: str
) -> None:
    folder = tmp_path / "store"
    folder.mkdir()
    path = anyio.run(_closed_store, folder)
    before = _folder(folder)
    args = ["--store", f"sqlite:///{path}", "--backend", backend, *command.split()]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert READS[command] in result.output
    assert _folder(folder) == before


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_export_leaves_the_store_folder_unchanged(tmp_path: Path, backend: str) -> None:
    folder = tmp_path / "store"
    folder.mkdir()
    path = anyio.run(_closed_store, folder)
    before = _folder(folder)
    out = tmp_path / "s1.html"
    args = [
        "--store",
        f"sqlite:///{path}",
        "--backend",
        backend,
        "export",
        "s1",
        "--html",
        str(out),
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 0
    assert _folder(folder) == before


async def test_a_read_only_open_and_the_web_view_leave_the_folder_unchanged(
    tmp_path: Path,
) -> None:
    pytest.importorskip("starlette")
    from stepmachine.inspector._web import create_app  # the web extra

    path = await _closed_store(tmp_path)
    before = _folder(tmp_path)
    async with await SQLiteStore.open(path, read_only=True) as reader:
        assert await reader.list_sessions() == ["s1", "s2"]
    assert _folder(tmp_path) == before
    async with await open_store(f"sqlite:///{path}") as store:  # as `serve` opens it
        transport = httpx.ASGITransport(app=create_app(store))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            assert (await http.get("/")).status_code == 200
            assert (await http.get("/api/sessions/s1")).status_code == 200
    assert _folder(tmp_path) == before


async def test_a_reader_sees_a_live_writer_and_leaves_its_files(tmp_path: Path) -> None:
    path = await _closed_store(tmp_path)
    async with await SQLiteStore.open(path) as writer:
        async with await SQLiteStore.open(path, read_only=True) as reader:
            assert await reader.list_sessions() == ["s1", "s2"]
            await writer.create("s3", conversation=[Message.user("later", id="u2")])
            assert await reader.list_sessions() == ["s1", "s2", "s3"]  # committed after it opened
            assert (await reader.load("s3")).conversation[0].text == "later"
        # The reader closed first: the writer's -wal and -shm are still its own.
        names = _names(tmp_path)
        assert names == ["agent.sqlite3", "agent.sqlite3-shm", "agent.sqlite3-wal"]
        await writer.create("s4")
        assert (await writer.load("s4")).revision == 0
    assert _names(tmp_path) == ["agent.sqlite3"]
    async with await SQLiteStore.open(path, read_only=True) as reader:
        assert await reader.list_sessions() == ["s1", "s2", "s3", "s4"]
    assert _names(tmp_path) == ["agent.sqlite3"]


async def test_a_reader_that_closes_last_leaves_what_a_writer_would(tmp_path: Path) -> None:
    """A writer that closes while a reader is open leaves its -wal for the reader; the
    reader closing last removes both files (after folding the log into the database,
    as the writer's own close would have) and the data is all there."""
    path = await _closed_store(tmp_path)
    async with await SQLiteStore.open(path, read_only=True) as reader:
        async with await SQLiteStore.open(path) as writer:
            await writer.create("s3")
        assert await reader.list_sessions() == ["s1", "s2", "s3"]
    assert _names(tmp_path) == ["agent.sqlite3"]
    async with await SQLiteStore.open(path, read_only=True) as again:
        assert await again.list_sessions() == ["s1", "s2", "s3"]
