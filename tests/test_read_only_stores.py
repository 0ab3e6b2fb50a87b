"""``SQLiteStore.open(read_only=True)``: reading without creating, migrating or writing."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import anyio
import pytest

from stepmachine import Message, StoredDataError
from stepmachine.stores import SQLiteStore

GOLDEN = Path(__file__).resolve().parent / "fixtures" / "golden" / "sqlite"


async def test_reads_what_a_writer_wrote_and_refuses_to_write(tmp_path: Path) -> None:
    path = tmp_path / "agent.sqlite3"
    async with await SQLiteStore.open(path) as writer:
        await writer.create("s1", conversation=[Message.user("hi", id="u1")])
        async with await SQLiteStore.open(path, read_only=True) as reader:
            assert await reader.list_sessions() == ["s1"]
            assert (await reader.load("s1")).conversation[0].text == "hi"
            with pytest.raises(sqlite3.OperationalError, match="readonly"):
                await reader.create("s2")
            # A write by the other connection is seen by the next read.
            await writer.create("s3")
            assert await reader.list_sessions() == ["s1", "s3"]


async def test_a_missing_file_is_not_created(tmp_path: Path) -> None:
    path = tmp_path / "missing.sqlite3"
    with pytest.raises(FileNotFoundError):
        await SQLiteStore.open(path, read_only=True)
    assert [p async for p in anyio.Path(tmp_path).iterdir()] == []


async def test_an_older_schema_is_refused_not_migrated(tmp_path: Path) -> None:
    path = tmp_path / "store-v3.db"
    path.write_bytes((GOLDEN / "store-v3.db").read_bytes())
    before = path.read_bytes()
    with pytest.raises(StoredDataError, match="read-only open does not migrate"):
        await SQLiteStore.open(path, read_only=True)
    assert path.read_bytes() == before
    async with await SQLiteStore.open(path) as store:  # a writable open migrates it
        assert await store.list_sessions()
    async with await SQLiteStore.open(path, read_only=True) as reader:
        assert await reader.list_sessions()
