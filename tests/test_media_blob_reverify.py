"""A blob this process verified and later found damaged is checked again (issue 22).

A store remembers, once per process, the blobs it wrote or read back sound, so
a write of bytes it already holds does not hash them again. A load that finds
one of those blobs damaged (same size, other bytes) must forget it: the next
write of the same bytes then rewrites the blob and a load of it returns them.
Covered for every store with blobs (FileStore, SQLite, PostgreSQL), with the
blob verified by a load first, so the remembered verdict is what is tested.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

import anyio
import pytest
from _media_damage import damage_same_size

from stepmachine import ImagePart, Message, StoredDataError
from stepmachine.extend import media_digest
from stepmachine.stores import FileStore, SQLiteStore


def _message(data: bytes, mid: str = "u1") -> Message:
    return Message.user("look", id=mid, media=[ImagePart(media_type="image/png", data=data)])


class Place:
    def __init__(self, kind: str, path: Path, dsn: str) -> None:
        self.kind = kind
        self.path = path
        self.dsn = dsn

    async def open(self) -> Any:
        if self.kind == "file":
            return await FileStore.open(self.path / "files")
        if self.kind == "postgres":
            from stepmachine.stores import PostgresStore

            return await PostgresStore.open(self.dsn)
        return await SQLiteStore.open(self.path / "db.sqlite3")

    def damage(self, data: bytes) -> None:
        """Replace the stored blob of ``data`` by other bytes of the same size."""
        digest = media_digest(data)
        bad = bytes([data[0] ^ 0xFF]) + data[1:]
        if self.kind == "file":
            (self.path / "files" / ".media" / digest.removeprefix("sha256:")).write_bytes(bad)
        elif self.kind == "postgres":
            import psycopg

            with psycopg.connect(self.dsn, autocommit=True) as conn:
                done = conn.execute(
                    "UPDATE stepmachine.media SET body = %s WHERE digest = %s", (bad, digest)
                )
                assert done.rowcount == 1
        else:
            db = sqlite3.connect(self.path / "db.sqlite3")
            with db:
                done = db.execute("UPDATE media SET body = ? WHERE digest = ?", (bad, digest))
                assert done.rowcount == 1
            db.close()


@pytest.fixture(params=["file", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    dsn = request.getfixturevalue("postgres_dsn") if request.param == "postgres" else ""
    return Place(request.param, tmp_path, dsn)


def _images(session: Any) -> list[bytes]:
    return [p.data for p in session.conversation[0].parts if isinstance(p, ImagePart)]


async def test_a_verified_blob_found_damaged_is_rewritten_by_the_next_write(
    place: Place,
) -> None:
    data = os.urandom(6000)
    store = await place.open()
    try:
        with anyio.fail_after(30):
            await store.create("s1", conversation=[_message(data)])
            verifier = await place.open()  # no session cached: it reads the blob
            try:
                assert _images(await verifier.load("s1")) == [data]  # verified here
            finally:
                await verifier.aclose()
            place.damage(data)
            fresh = await place.open()  # no session cached: it reads the blob
            try:
                with pytest.raises(StoredDataError, match="damaged"):
                    await fresh.load("s1")
            finally:
                await fresh.aclose()
            await store.create("s2", conversation=[_message(data)])  # the same bytes
    finally:
        await store.aclose()
    reader = await place.open()
    try:
        with anyio.fail_after(30):
            assert _images(await reader.load("s2")) == [data]
            assert _images(await reader.load("s1")) == [data]  # repaired for both
    finally:
        await reader.aclose()


# -- a blob damaged to the same size, then the same bytes written again ----------------


async def _open(kind: str, tmp_path: Path) -> Any:
    if kind == "file":
        return await FileStore.open(tmp_path / "files")
    return await SQLiteStore.open(tmp_path / "db.sqlite3")


async def test_a_blob_damaged_to_the_same_size_is_repaired_by_a_later_write_file(
    tmp_path: Path,
) -> None:
    await _damaged_then_rewritten("file", tmp_path)


async def test_a_blob_damaged_to_the_same_size_is_repaired_by_a_later_write_sqlite(
    tmp_path: Path,
) -> None:
    """The same attack on SQLite: held (the write repairs the row)."""
    await _damaged_then_rewritten("sqlite", tmp_path)


async def _damaged_then_rewritten(kind: str, tmp_path: Path) -> None:
    data = os.urandom(5000)
    store = await _open(kind, tmp_path)
    try:
        await store.create("s1", conversation=[_message(data)])
        damage_same_size(kind, tmp_path, data)
        fresh = await _open(kind, tmp_path)
        try:
            with pytest.raises(StoredDataError, match="damaged"):
                await fresh.load("s1")  # the damage is seen, by this process
        finally:
            await fresh.aclose()
        await store.create("s2", conversation=[_message(data)])  # the same bytes again
    finally:
        await store.aclose()
    reader = await _open(kind, tmp_path)
    try:
        session = await reader.load("s2")
        [part] = [p for p in session.conversation[0].parts if isinstance(p, ImagePart)]
        assert part.data == data
    finally:
        await reader.aclose()
