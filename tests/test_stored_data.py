"""Stored data is data, for the durable stores' compressed records: a record that inflates
into something huge (a decompression bomb) fails with a clear StoredDataError instead of
exhausting memory, and valid zlib of something that is not the codec's JSON fails naming the
session and the record's position. The bomb tests load in a child process whose address space
is limited (``RLIMIT_AS``)."""

from __future__ import annotations

import base64
import functools
import json
import os
import sqlite3
import struct
import subprocess
import sys
import zlib
from contextlib import closing
from pathlib import Path
from typing import Any

import anyio
import pytest
from _sqlite_effect_rows import VERSION as EFFECT_ROWS_VERSION
from _sqlite_effect_rows import insert_batch_as_version_4

from stepmachine import AppendMessage, Effect, Message, Session, StoredDataError
from stepmachine.extend import Batch
from stepmachine.stores import FileStore, SQLiteStore, _sqlite_rows
from stepmachine.stores._file_log import SCHEMA_VERSION as FILE_SCHEMA_VERSION
from stepmachine.stores._file_log import TAG_BATCH, encode_record
from stepmachine.stores._sqlite_schema import SCHEMA_VERSION, checksum

ROOT = Path(__file__).resolve().parent.parent


LONG = "a long message that repeats itself, " * 20


@functools.cache
def bomb(chunks: int = 1024) -> bytes:
    """A valid zlib stream of ``chunks`` x 16 MiB of zero bytes (16 GiB), about 16 MB long.

    Built without compressing 16 GiB: after a full flush the compressor's output
    for the same 16 MiB chunk repeats byte for byte, so one block is repeated;
    the Adler-32 of ``n`` zero bytes is ``(n % 65521) << 16 | 1``.
    """
    zeros = bytes(1 << 24)
    compressor = zlib.compressobj(9)
    first = compressor.compress(zeros) + compressor.flush(zlib.Z_FULL_FLUSH)
    again = compressor.compress(zeros) + compressor.flush(zlib.Z_FULL_FLUSH)
    end = compressor.flush()[:-4]  # the final empty block, without its checksum
    adler = ((chunks << 24) % 65521) << 16 | 1
    return first + again * (chunks - 1) + end + struct.pack(">I", adler)


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/statm are Linux's"
)
def test_the_bomb_is_a_valid_stream() -> None:
    small = bomb(3)
    inflater = zlib.decompressobj()
    size = 0
    while small:
        size += len(inflater.decompress(small, 1 << 24))
        small = inflater.unconsumed_tail
    assert inflater.eof
    assert size == 3 << 24


_CHILD = """
import resource, sys
import anyio
from stepmachine import StoredDataError
from stepmachine.stores import FileStore, SQLiteStore

kind, path = sys.argv[1], sys.argv[2]

def address_space() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * resource.getpagesize()

async def main() -> None:
    store = await (SQLiteStore.open(path) if kind == "sqlite" else FileStore.open(path))
    limit = address_space() + (3 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        session = await store.load("s")
    except StoredDataError as exc:
        print("StoredDataError", str(exc)[:500])
    except MemoryError:
        print("MemoryError")
    else:
        print("loaded", session.revision)

anyio.run(main)
"""


def load_with_bounded_memory(kind: str, path: Path) -> str:
    """What a child process limited to 3 GiB more memory gets from ``load("s")``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, kind, str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    return (done.stdout + done.stderr).strip()


def batch_for(session: Session[Any], *effects: Effect) -> Batch[Effect]:
    return Batch(
        session_id=session.id,
        revision=session.revision + 1,
        step="test",
        cycle=1,
        timestamp=1_700_000_000.0,
        effects=effects,
    )


async def sqlite_session(path: Path, effect_rows: bool = False) -> None:
    """Session ``s`` at revision 1, whose one effect is stored compressed: in the batch
    row, or (``effect_rows``) in an effect row as schema version 4 wrote it."""
    with pytest.MonkeyPatch.context() as patch:
        if effect_rows:
            patch.setattr(_sqlite_rows, "insert_batch", insert_batch_as_version_4)
        async with await SQLiteStore.open(path) as store:
            session = await store.create("s")
            await store.apply(batch_for(session, AppendMessage(Message.user(LONG, id="long"))))


def replace_sqlite_body(path: Path, table: str, revision: int, body: bytes) -> None:
    """Put ``body`` in the row of ``table`` at ``revision``, with a matching checksum."""
    with closing(sqlite3.connect(path, isolation_level=None)) as connection:
        if table == "effects":
            values: tuple[Any, ...] = (1, revision, 0, EFFECT_ROWS_VERSION, body)
            where = "revision = ? AND position = 0"
        elif table == "batches":
            header = (1, revision, "test", 1, 1_700_000_000.0, 1, SCHEMA_VERSION, None, None)
            values = (*header, body)
            where = "revision = ?"
        else:
            values = (1, revision, SCHEMA_VERSION, body)
            where = "revision = ?"
        connection.execute(
            f"UPDATE {table} SET body = ?, crc = ? WHERE {where}",
            (body, checksum(table, values), revision),
        )


async def file_session(folder: Path, snapshot_every: int = 100) -> Path:
    """Session ``s`` at revision 1, whose batch record is version 2 (compressed)."""
    store = await FileStore.open(folder, snapshot_every=snapshot_every)
    session = await store.create("s")
    await store.apply(batch_for(session, AppendMessage(Message.user(LONG, id="long"))))
    await store.aclose()
    log = folder / "s.log"
    assert log.read_bytes().splitlines()[2].startswith(b"2 B 1 ")
    return log


def replace_file_batch(log: Path, payload: bytes) -> None:
    """Replace the batch record of revision 1 with a version-2 record holding ``payload``
    (compressed), its checksum right."""
    lines = log.read_bytes().splitlines(keepends=True)
    packed = base64.b64encode(zlib.compress(payload) if payload[:1] != b"\x78" else payload)
    lines[2] = encode_record(TAG_BATCH, 1, packed, version=FILE_SCHEMA_VERSION)
    log.write_bytes(b"".join(lines))


# -- decompression bombs ---------------------------------------------------------------


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/statm are Linux's"
)
@pytest.mark.parametrize("table", ["batches", "effects"])
def test_sqlite_effect_row_bomb_fails_clearly(tmp_path: Path, table: str) -> None:
    db = tmp_path / "store.db"
    anyio.run(sqlite_session, db, table == "effects")
    replace_sqlite_body(db, table, 1, bomb())
    outcome = load_with_bounded_memory("sqlite", db)
    assert outcome.startswith("StoredDataError"), outcome
    assert "'s'" in outcome
    assert "revision 1" in outcome


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/statm are Linux's"
)
def test_sqlite_snapshot_bomb_fails_clearly(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    anyio.run(sqlite_session, db)
    replace_sqlite_body(db, "snapshots", 0, bomb())
    outcome = load_with_bounded_memory("sqlite", db)
    assert outcome.startswith("StoredDataError"), outcome
    assert "snapshot" in outcome


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/statm are Linux's"
)
def test_file_record_bomb_fails_clearly(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    log = anyio.run(file_session, folder)
    replace_file_batch(log, bomb())
    outcome = load_with_bounded_memory("file", folder)
    assert outcome.startswith("StoredDataError"), outcome
    assert str(log) in outcome


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/statm are Linux's"
)
def test_file_snapshot_bomb_is_not_a_memory_error(tmp_path: Path) -> None:
    """A snapshot is only a cache: a bomb in it is ignored (the log is replayed) or
    refused, never inflated whole."""
    folder = tmp_path / "store"
    anyio.run(file_session, folder, 1)
    snap = folder / "s.snap"
    body = json.loads(snap.read_bytes().split(b" ", 5)[5])
    body["compressed"] = base64.b64encode(bomb()).decode()
    snap.write_bytes(encode_record(b"S", 1, json.dumps(body).encode()))
    outcome = load_with_bounded_memory("file", folder)
    assert outcome.startswith(("loaded 1", "StoredDataError")), outcome


# -- valid zlib, invalid content ---------------------------------------------------------


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/statm are Linux's"
)
@pytest.mark.anyio
@pytest.mark.parametrize(
    "inner", [b"[not json", b"{}", b"[1, 2]", b'[{"type": "no.such.effect"}]', b"\xff\xfe"]
)
@pytest.mark.parametrize("table", ["batches", "effects"])
async def test_sqlite_compressed_effect_of_invalid_json_names_the_row(
    tmp_path: Path, inner: bytes, table: str
) -> None:
    """``inner`` as the effect's record: the effect row's body, or the only item of the
    batch row's body (a JSON array of the batch's records)."""
    db = tmp_path / "store.db"
    await sqlite_session(db, effect_rows=table == "effects")
    record = inner if table == "effects" else b"[" + inner + b"]"
    replace_sqlite_body(db, table, 1, zlib.compress(record))
    async with await SQLiteStore.open(db) as store:
        with pytest.raises(StoredDataError, match=r"'s'.*revision 1") as caught:
            await store.load("s")
    if table == "effects" or _is_json(inner):  # else the batch row's body is not JSON at all
        assert "effect 0" in str(caught.value)


def _is_json(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/statm are Linux's"
)
@pytest.mark.anyio
@pytest.mark.parametrize("inner", [b"{not json", b"[]", b'{"id": 3}', b"\xff\xfe"])
async def test_sqlite_compressed_snapshot_of_invalid_json_names_it(
    tmp_path: Path, inner: bytes
) -> None:
    db = tmp_path / "store.db"
    await sqlite_session(db)
    replace_sqlite_body(db, "snapshots", 0, zlib.compress(inner))
    async with await SQLiteStore.open(db) as store:
        with pytest.raises(StoredDataError, match=r"snapshot"):
            await store.load("s")


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/statm are Linux's"
)
@pytest.mark.anyio
@pytest.mark.parametrize(
    "inner", [b"{not json", b"[]", b'{"session_id": "s"}', b"\xff\xfe", b"a\nb"]
)
async def test_file_compressed_record_of_invalid_json_names_it(
    tmp_path: Path, inner: bytes
) -> None:
    folder = tmp_path / "store"
    log = await file_session(folder)
    replace_file_batch(log, inner)
    store = await FileStore.open(folder)
    with pytest.raises(StoredDataError, match=str(log)):
        await store.load("s")
    with pytest.raises(StoredDataError, match=str(log)):
        await store.batches("s")


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/statm are Linux's"
)
@pytest.mark.anyio
async def test_file_truncated_compressed_record_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    log = await file_session(folder)
    lines = log.read_bytes().splitlines(keepends=True)
    packed = lines[2].split(b" ", 5)[5][:-1]
    stream = base64.b64decode(packed)
    lines[2] = encode_record(TAG_BATCH, 1, base64.b64encode(stream[:-7]), version=2)
    log.write_bytes(b"".join(lines))
    store = await FileStore.open(folder)
    with pytest.raises(StoredDataError, match="decompress"):
        await store.load("s")


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/statm are Linux's"
)
@pytest.mark.anyio
async def test_file_compressed_record_with_trailing_garbage_is_refused(tmp_path: Path) -> None:
    """Bytes after the end of the zlib stream are not data: refused, not ignored."""
    folder = tmp_path / "store"
    log = await file_session(folder)
    lines = log.read_bytes().splitlines(keepends=True)
    packed = lines[2].split(b" ", 5)[5][:-1]
    stream = base64.b64decode(packed) + b"trailing"
    lines[2] = encode_record(TAG_BATCH, 1, base64.b64encode(stream), version=2)
    log.write_bytes(b"".join(lines))
    store = await FileStore.open(folder)
    with pytest.raises(StoredDataError):
        await store.load("s")


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/statm are Linux's"
)
@pytest.mark.anyio
@pytest.mark.parametrize("table", ["batches", "effects", "snapshots"])
async def test_sqlite_compressed_body_with_trailing_garbage_is_refused(
    tmp_path: Path, table: str
) -> None:
    """The row's checksum matches (it covers the stored bytes), but bytes after the end
    of the zlib stream are not part of the record: refused, not ignored."""
    db = tmp_path / "store.db"
    await sqlite_session(db, effect_rows=table == "effects")
    revision = 0 if table == "snapshots" else 1
    with closing(sqlite3.connect(db, isolation_level=None)) as connection:
        column = "position = 0" if table == "effects" else "1 = 1"
        (body,) = connection.execute(
            f"SELECT body FROM {table} WHERE revision = ? AND {column}",
            (revision,),
        ).fetchone()
    assert body[:1] == b"\x78"
    replace_sqlite_body(db, table, revision, body + b"trailing")
    async with await SQLiteStore.open(db) as store:
        with pytest.raises(StoredDataError):
            await store.load("s")
