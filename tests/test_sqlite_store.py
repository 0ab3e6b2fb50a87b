"""SQLiteStore passes the store conformance suite, and keeps its own promises.

Beyond the suite: incremental loads, compare-and-set between store instances
and processes, WAL and synchronous really applied, fork, snapshots, schema
versioning, fail-closed decoding of corrupt rows, hostile ids, persistence
boundaries (with real ``kill -9``), cancellation, and the golden fixture
written by an earlier version.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import zlib
from collections import Counter
from contextlib import closing
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import anyio.lowlevel
import make_golden_sqlite
import msgspec
import pytest
from _sqlite_effect_rows import VERSION as EFFECT_ROWS_VERSION
from _sqlite_effect_rows import effect_rows
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import (
    AppendMessage,
    Codec,
    ConflictError,
    Effect,
    InvalidSessionIdError,
    Message,
    ReplaceConversation,
    Session,
    SessionExistsError,
    SessionNotFoundError,
    StepmachineError,
    StoredDataError,
)
from stepmachine.extend import Batch, Conversation, apply_batch
from stepmachine.stores import SQLiteStore
from stepmachine.stores import _sqlite_rows as _rows
from stepmachine.stores._sqlite_rows import (
    SNAPSHOT_EVERY,
    SNAPSHOT_MAX_GAP,
    SessionRow,
    wants_snapshot,
)
from stepmachine.stores._sqlite_schema import SCHEMA_VERSION, checksum
from stepmachine.testing.conformance import ConformanceData, Increment, StoreConformance

FIXTURES = Path(__file__).resolve().parent / "fixtures"


class TestSQLiteStore(StoreConformance):
    async def make_store(self, codec: Codec[Any], path: Path) -> SQLiteStore:  # type: ignore[override]
        return await SQLiteStore.open(path / "store.db", codec)


# -- helpers ---------------------------------------------------------------------


class CountingCodec(Codec[ConformanceData]):
    """The suite's codec, counting every record it encodes and decodes."""

    def __init__(self) -> None:
        super().__init__(ConformanceData, effects=[Increment])
        self.calls: Counter[str] = Counter()

    def decode_effects(self, buf: bytes, *, where: str = "effects record") -> tuple[Effect, ...]:
        self.calls["decode_effects"] += 1
        return super().decode_effects(buf, where=where)

    def decode_session(self, buf: bytes, *, where: str = "session record") -> Session[Any]:
        self.calls["decode_session"] += 1
        return super().decode_session(buf, where=where)

    def encode_session(self, session: Session[Any]) -> bytes:
        self.calls["encode_session"] += 1
        return super().encode_session(session)

    def encode_effects(self, effects: Any) -> bytes:
        self.calls["encode_effects"] += 1
        return super().encode_effects(effects)


def codec() -> Codec[ConformanceData]:
    return Codec(ConformanceData, effects=[Increment])


def batch_for(session: Session[Any], *effects: Effect, step: str = "test") -> Batch[Effect]:
    return Batch(
        session_id=session.id,
        revision=session.revision + 1,
        step=step,
        cycle=1,
        timestamp=1_700_000_000.5,
        effects=effects,
    )


async def apply(store: SQLiteStore, session: Session[Any], *effects: Effect) -> Session[Any]:
    await store.apply(batch_for(session, *effects))
    return apply_batch(session, effects)


def message(index: int) -> Message:
    return Message.user(f"message {index}", id=f"m-{index}")


def as_json(value: Any) -> Any:
    """``value`` as JSON builtins (tuples become lists), for comparing with expected.json."""
    return json.loads(msgspec.json.encode(value, enc_hook=Conversation.enc_hook))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_file(path: Path, content: bytes) -> None:
    path.write_bytes(content)


def names_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def raw(path: Path) -> closing[sqlite3.Connection]:
    """A plain sqlite3 connection (autocommit), closed (and checkpointed) on exit."""
    return closing(sqlite3.connect(path, isolation_level=None))


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "store.db"


@pytest.fixture
async def store(db: Path) -> Any:
    async with await SQLiteStore.open(db, codec()) as opened:
        yield opened


# -- incremental loads and applies ---------------------------------------------------


async def test_reload_reads_only_new_rows(db: Path) -> None:
    counting = CountingCodec()
    async with (
        await SQLiteStore.open(db, counting) as first,
        await SQLiteStore.open(db, codec()) as second,
    ):
        session = await first.create("s")
        for index in range(30):
            session = await apply(first, session, AppendMessage(message(index)), Increment())
        counting.calls.clear()
        assert await first.load("s") == session
        assert counting.calls == Counter()  # nothing new: no record decoded

        external = await second.load("s")
        await second.apply(batch_for(external, AppendMessage(message(99)), Increment(5)))
        counting.calls.clear()
        loaded = await first.load("s")
        assert loaded.revision == 31
        assert loaded.data.counter == 35
        assert loaded.conversation[-1] == message(99)
        assert counting.calls == Counter(decode_effects=2)  # the two new effect rows only


async def test_apply_never_reencodes_history_and_snapshots_periodically(db: Path) -> None:
    counting = CountingCodec()
    async with await SQLiteStore.open(db, counting) as store:
        session = await store.create("s")
        counting.calls.clear()
        for index in range(SNAPSHOT_EVERY + 20):
            session = await apply(store, session, AppendMessage(message(index)))
        # One effects record per effect (encoded and decoded back for validation),
        # one session record: the periodic snapshot. Never the history.
        assert counting.calls == Counter(
            encode_effects=SNAPSHOT_EVERY + 20, decode_effects=SNAPSHOT_EVERY + 20, encode_session=1
        )
    assert snapshot_revisions(db) == [0, SNAPSHOT_EVERY]

    cold = CountingCodec()
    async with await SQLiteStore.open(db, cold) as store:
        assert await store.load("s") == session
        # The snapshot, then only the 20 batches after it.
        assert cold.calls == Counter(decode_session=1, decode_effects=20)
        cold.calls.clear()
        assert (await store.load_at("s", SNAPSHOT_EVERY - 1)).revision == SNAPSHOT_EVERY - 1
        assert cold.calls == Counter(decode_session=1, decode_effects=SNAPSHOT_EVERY - 1)
        cold.calls.clear()
        assert (await store.load_at("s", SNAPSHOT_EVERY + 5)).conversation[-1] == message(
            SNAPSHOT_EVERY + 4
        )
        assert cold.calls == Counter(decode_session=1, decode_effects=5)


def snapshot_revisions(db: Path) -> list[int]:
    with raw(db) as connection:
        rows = connection.execute("SELECT revision FROM snapshots ORDER BY revision")
        return [row[0] for row in rows]


async def test_periodic_snapshots_follow_the_session_size(store: SQLiteStore, db: Path) -> None:
    # A 20 kB session: 120 small batches (about 5 kB) do not pay for a new snapshot...
    session = await store.create("s", conversation=[Message.user("x" * 20_000, id="big")])
    for _ in range(SNAPSHOT_EVERY + 20):
        session = await apply(store, session, Increment())
    assert snapshot_revisions(db) == [0]
    # ...but once the effects since the last one reach half its size, one is taken.
    session = await apply(store, session, AppendMessage(Message.user("y" * 6_000, id="more")))
    assert snapshot_revisions(db) == [0, SNAPSHOT_EVERY + 21]


def test_snapshots_are_never_more_than_max_gap_apart() -> None:
    huge = SessionRow(sid=1, revision=0, snapshot_revision=0, snapshot_bytes=10**9, pending_bytes=0)
    assert not wants_snapshot(huge, SNAPSHOT_MAX_GAP - 1, 10, replaces=False)
    assert wants_snapshot(huge, SNAPSHOT_MAX_GAP, 10, replaces=False)
    assert wants_snapshot(huge, 1, 10, replaces=True)
    tiny = huge._replace(snapshot_bytes=10)
    assert not wants_snapshot(tiny, SNAPSHOT_EVERY - 1, 10, replaces=False)
    assert wants_snapshot(tiny, SNAPSHOT_EVERY, 10, replaces=False)


async def test_delete_and_recreate_elsewhere_is_not_served_from_cache(db: Path) -> None:
    async with (
        await SQLiteStore.open(db, codec()) as first,
        await SQLiteStore.open(db, codec()) as second,
    ):
        session = await first.create("s")
        for _ in range(3):
            session = await apply(first, session, Increment(1))
        assert (await first.load("s")).data.counter == 3  # cached by `first` at revision 3
        await second.delete("s")
        other = await second.create("s")
        for _ in range(3):
            other = await apply(second, other, Increment(100))
        assert (await first.load("s")).data.counter == 300  # same id and revision, new session
        await second.delete("s")
        with pytest.raises(SessionNotFoundError):
            await first.load("s")


# -- compare-and-set between instances and processes -------------------------------


async def test_second_instance_gets_conflict_for_stale_batch(db: Path) -> None:
    async with (
        await SQLiteStore.open(db, codec()) as first,
        await SQLiteStore.open(db, codec()) as second,
    ):
        await first.create("s")
        seen_first = await first.load("s")
        seen_second = await second.load("s")
        await first.apply(batch_for(seen_first, Increment(1)))
        with pytest.raises(ConflictError) as info:
            await second.apply(batch_for(seen_second, Increment(10)))
        assert (info.value.session_id, info.value.expected, info.value.actual) == ("s", 0, 1)
        assert (await second.load("s")).data.counter == 1
        # A batch computed from the other instance's read is accepted (the
        # writing instance catches up inside the transaction).
        await second.apply(batch_for(await first.load("s"), Increment(10)))
        assert (await first.load("s")).data.counter == 11
        assert [b.revision for b in await first.batches("s")] == [1, 2]


async def test_writers_on_two_instances_lose_nothing(db: Path) -> None:
    async with (
        await SQLiteStore.open(db, codec(), busy_timeout=60) as first,
        await SQLiteStore.open(db, codec(), busy_timeout=60) as second,
    ):
        await first.create("shared")

        async def writer(store: SQLiteStore, number: int) -> None:
            for index in range(10):
                while True:
                    current = await store.load("shared")
                    effects = (AppendMessage(message(number * 100 + index)), Increment())
                    try:
                        await store.apply(batch_for(current, *effects))
                    except ConflictError:
                        continue
                    break

        async with anyio.create_task_group() as group:
            for number in range(6):
                group.start_soon(writer, (first, second)[number % 2], number)
        final = await second.load("shared")
        assert final.revision == final.data.counter == 60
        assert len({m.id for m in final.conversation}) == 60


_WRITER = textwrap.dedent(
    """
    import sys, anyio
    from stepmachine import AppendMessage, Batch, Codec, ConflictError, Message
    from stepmachine.stores import SQLiteStore
    from stepmachine.testing.conformance import ConformanceData, Increment

    async def main(path, number, count):
        codec = Codec(ConformanceData, effects=[Increment])
        async with await SQLiteStore.open(path, codec, busy_timeout=60) as store:
            for index in range(count):
                while True:
                    s = await store.load("shared")
                    m = Message.user("x", id=f"p{number}-{index}")
                    batch = Batch(session_id="shared", revision=s.revision + 1, step="w",
                                  cycle=0, timestamp=0.0, effects=(AppendMessage(m), Increment()))
                    try:
                        await store.apply(batch)
                    except ConflictError:
                        continue
                    break

    anyio.run(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    """
)


def test_writers_in_several_processes_lose_nothing(db: Path, tmp_path: Path) -> None:
    async def create() -> None:
        async with await SQLiteStore.open(db, codec()) as store:
            await store.create("shared")

    anyio.run(create)
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(db), str(number), "15"],
            cwd=tmp_path,
            stderr=subprocess.PIPE,
        )
        for number in range(3)
    ]
    for worker in workers:
        _, stderr = worker.communicate(timeout=120)
        assert worker.returncode == 0, stderr.decode()

    async def check() -> None:
        async with await SQLiteStore.open(db, codec()) as store:
            final = await store.load("shared")
            assert final.revision == final.data.counter == 45
            assert sorted(m.id for m in final.conversation) == sorted(
                f"p{n}-{i}" for n in range(3) for i in range(15)
            )

    anyio.run(check)


# -- pragmas, schema version --------------------------------------------------------


@pytest.mark.parametrize(("synchronous", "level"), [("NORMAL", 1), ("FULL", 2)])
async def test_wal_and_synchronous_are_applied(db: Path, synchronous: Any, level: int) -> None:
    async with await SQLiteStore.open(
        db, codec(), synchronous=synchronous, busy_timeout=2.5
    ) as store:
        connection = store._conn
        assert connection is not None
        assert connection.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert connection.execute("PRAGMA synchronous").fetchone() == (level,)
        assert connection.execute("PRAGMA busy_timeout").fetchone() == (2500,)
    with raw(db) as connection:  # WAL is a property of the file
        assert connection.execute("PRAGMA journal_mode").fetchone() == ("wal",)


async def test_open_rejects_bad_options(db: Path) -> None:
    with pytest.raises(ValueError, match="synchronous"):
        await SQLiteStore.open(db, synchronous="OFF")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="busy_timeout"):
        await SQLiteStore.open(db, busy_timeout=-1)
    assert names_in(db.parent) == []


async def test_schema_version_table_and_versioned_records(db: Path) -> None:
    for _ in range(2):  # opening again migrates nothing more
        async with await SQLiteStore.open(db, codec()) as store:
            if not await store.list_sessions():
                session = await store.create("s")
                await apply(store, session, Increment())
    with raw(db) as connection:
        # A new file goes through every migration, once.
        assert connection.execute("SELECT version FROM schema_version").fetchall() == [
            (version,) for version in range(1, SCHEMA_VERSION + 1)
        ]
        for table in ("sessions", "batches", "snapshots"):
            versions = connection.execute(f"SELECT DISTINCT schema_version FROM {table}")
            assert versions.fetchall() == [(SCHEMA_VERSION,)], table
            unchecked = connection.execute(f"SELECT count(*) FROM {table} WHERE crc IS NULL")
            assert unchecked.fetchone() == (0,), table
        # A batch keeps its effects in its own row: no effect rows are written.
        assert connection.execute("SELECT count(*) FROM effects").fetchone() == (0,)


@pytest.mark.parametrize("wal", [True, False], ids=["wal-file", "rollback-file"])
async def test_future_schema_version_is_refused_unchanged(db: Path, wal: bool) -> None:
    if wal:
        async with await SQLiteStore.open(db, codec()) as store:
            await store.create("s")
    else:
        with raw(db) as connection:
            connection.execute("CREATE TABLE schema_version (version INTEGER, applied_at REAL)")
    with raw(db) as connection:
        connection.execute("INSERT INTO schema_version VALUES (?, 0)", (SCHEMA_VERSION + 7,))
    before = digest(db)
    with pytest.raises(StoredDataError) as info:
        await SQLiteStore.open(db, codec())
    text = str(info.value)
    assert str(db) in text
    assert f"schema version {SCHEMA_VERSION + 7}" in text
    assert f"up to {SCHEMA_VERSION}" in text
    assert digest(db) == before
    assert names_in(db.parent) == ["store.db"]


async def test_non_database_file_is_refused_unchanged(db: Path) -> None:
    write_file(db, b"just some text, not a database\n" * 200)
    before = digest(db)
    with pytest.raises(StoredDataError, match="not an SQLite database") as info:
        await SQLiteStore.open(db, codec())
    assert str(db) in str(info.value)
    assert digest(db) == before


async def test_damaged_database_gives_stored_data_error(db: Path) -> None:
    write_file(db, b"SQLite format 3\x00" + b"\xab" * 4000)
    with pytest.raises(StoredDataError, match="not a readable SQLite database"):
        await SQLiteStore.open(db, codec())


async def test_other_applications_database_is_refused_unchanged(db: Path) -> None:
    with raw(db) as connection:
        connection.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
    before = digest(db)
    with pytest.raises(StoredDataError, match="not a stepmachine store"):
        await SQLiteStore.open(db, codec())
    assert digest(db) == before


def modes_in(folder: Path) -> dict[str, int]:
    return {path.name: stat.S_IMODE(path.stat().st_mode) for path in folder.iterdir()}


@pytest.mark.parametrize("umask", [0o022, 0o000], ids=["umask-022", "umask-000"])
async def test_new_database_files_are_owner_only(db: Path, umask: int) -> None:
    previous = os.umask(umask)
    try:
        async with await SQLiteStore.open(db, codec()) as store:
            await store.create("s")
            modes = modes_in(db.parent)
    finally:
        os.umask(previous)
    assert modes == {"store.db": 0o600, "store.db-wal": 0o600, "store.db-shm": 0o600}


async def test_existing_database_file_keeps_its_permissions(db: Path) -> None:
    write_file(db, b"")
    os.chmod(db, 0o640)
    previous = os.umask(0o022)
    try:
        async with await SQLiteStore.open(db, codec()) as store:
            await store.create("s")
            assert modes_in(db.parent)["store.db"] == 0o640
    finally:
        os.umask(previous)
    assert modes_in(db.parent) == {"store.db": 0o640}


# -- fork and snapshots -----------------------------------------------------------


async def test_fork(store: SQLiteStore, db: Path) -> None:
    session = await store.create("src", conversation=[message(0)])
    history = [session]
    for index in range(1, 6):
        session = await apply(store, session, AppendMessage(message(index)), Increment(index))
        history.append(session)

    forked = await store.fork("src", 3, "copy")
    assert forked == msgspec.structs.replace(history[3], id="copy")
    assert await store.load("copy") == forked
    for revision in range(4):
        assert await store.load_at("copy", revision) == msgspec.structs.replace(
            history[revision], id="copy"
        )
    source_log = await store.batches("src")
    assert await store.batches("copy") == [
        msgspec.structs.replace(b, session_id="copy") for b in source_log[:3]
    ]
    # The two sessions now evolve independently.
    await apply(store, forked, AppendMessage(message(50)))
    assert await store.load("src") == history[-1]
    assert await store.list_sessions() == ["copy", "src"]
    async with await SQLiteStore.open(db, codec()) as cold:
        assert (await cold.load("copy")).conversation[-1] == message(50)

    with pytest.raises(SessionExistsError):
        await store.fork("src", 1, "copy")
    with pytest.raises(SessionNotFoundError):
        await store.fork("missing", 0, "other")
    with pytest.raises(ValueError, match="revision"):
        await store.fork("src", 6, "other")
    with pytest.raises(ValueError, match="revision"):
        await store.fork("src", -1, "other")
    assert await store.list_sessions() == ["copy", "src"]


async def test_snapshot_after_replace_conversation(db: Path) -> None:
    async with await SQLiteStore.open(db, codec()) as store:
        session = await store.create("s")
        for index in range(3):
            session = await apply(store, session, AppendMessage(message(index)))
        before = session
        summary = Message.system("summary", id="sum")
        session = await apply(store, session, ReplaceConversation((summary,)), Increment())
        replaced = session
        session = await apply(store, session, AppendMessage(message(9)))
    assert snapshot_revisions(db) == [0, 4]

    counting = CountingCodec()
    async with await SQLiteStore.open(db, counting) as store:
        assert await store.load_at("s", 3) == before
        assert counting.calls == Counter(decode_session=1, decode_effects=3)
        counting.calls.clear()
        assert await store.load_at("s", 4) == replaced
        assert counting.calls == Counter(decode_session=1)  # the snapshot alone
        counting.calls.clear()
        assert await store.load("s") == session
        assert counting.calls == Counter(decode_session=1, decode_effects=1)


# -- corrupt rows fail closed ------------------------------------------------------

_CORRUPTIONS: dict[str, tuple[str, tuple[Any, ...]]] = {
    "garbage": (
        "UPDATE effects SET body = ? WHERE revision = 2 AND position = 1",
        (b"\xff\x00zz",),
    ),
    "unknown-tag": (
        "UPDATE effects SET body = ? WHERE revision = 2 AND position = 1",
        (b'[{"type":"evil.module:Class","by":1}]',),
    ),
    "truncated-json": (
        (
            "UPDATE effects SET body = substr(body, 1, length(body) - 4) "
            "WHERE revision = 2 AND position = 1"
        ),
        (),
    ),
    "text-not-blob": (
        "UPDATE effects SET body = ? WHERE revision = 2 AND position = 1",
        ('[{"type":"conformance.increment","by":1}]',),
    ),
    "two-effects-in-a-row": (
        "UPDATE effects SET body = ? WHERE revision = 2 AND position = 1",
        (b'[{"type":"conformance.increment"},{"type":"conformance.increment"}]',),
    ),
    "future-record": (
        "UPDATE effects SET schema_version = 99 WHERE revision = 2 AND position = 1",
        (),
    ),
    "missing-effect": ("DELETE FROM effects WHERE revision = 2 AND position = 1", ()),
    "wrong-type-for-message": (
        "UPDATE effects SET body = ? WHERE revision = 2 AND position = 1",
        (b'[{"type":"append_message","message":{"id":3}}]',),
    ),
}


@pytest.mark.usefixtures(effect_rows.__name__)
@pytest.mark.parametrize("corruption", sorted(_CORRUPTIONS))
async def test_corrupt_effect_row_fails_closed(db: Path, corruption: str) -> None:
    async with await SQLiteStore.open(db, codec()) as store:
        session = await store.create("s-1")
        for index in range(3):
            session = await apply(store, session, AppendMessage(message(index)), Increment())
        first = await store.load_at("s-1", 1)
    statement, parameters = _CORRUPTIONS[corruption]
    with raw(db) as connection:
        assert connection.execute(statement, parameters).rowcount == 1
    before = digest(db)

    async with await SQLiteStore.open(db, codec()) as store:
        for read in (
            store.load("s-1"),
            store.load_at("s-1", 2),
            store.batches("s-1"),
        ):
            with pytest.raises(StoredDataError) as info:
                await read
            text = str(info.value)
            assert "'s-1'" in text
            assert "revision 2" in text
            assert "effect 1" in text
            assert str(db) in text
        assert await store.load_at("s-1", 1) == first  # what precedes it still reads
        with pytest.raises(StoredDataError):  # and nothing can be appended on top of it
            await store.apply(batch_for(session, Increment()))
    assert digest(db) == before


def _records_of(body: bytes) -> list[bytes]:
    """The effect records of a batch row's body (a JSON array of them, maybe compressed)."""
    plain = zlib.decompress(body) if body[:1] == b"\x78" else body
    return [bytes(item) for item in msgspec.json.decode(plain, type=list[msgspec.Raw])]


_INCREMENT = b'[{"type":"conformance.increment","by":1}]'
_BODY_CORRUPTIONS: dict[str, tuple[Any, str]] = {
    # name: (the body, or how to make it from the records; what the error says)
    "garbage": (b"\xff\x00zz", "neither JSON nor zlib"),
    "not-zlib": (b"\x78not zlib", "does not decompress"),
    "truncated-json": (lambda r: (b"[" + b",".join(r) + b"]")[:-4], "not a JSON array"),
    "one-record-for-two": (lambda r: b"[" + r[0] + b"]", "holds 1 effect records.*says 2"),
    "three-records-for-two": (
        lambda r: b"[" + b",".join([*r, _INCREMENT]) + b"]",
        "holds 3 effect records.*says 2",
    ),
    "text-not-blob": ("[" + _INCREMENT.decode() + "," + _INCREMENT.decode() + "]", "column body"),
    "null": (None, "column body"),
    "not-an-array": (b'{"type":"conformance.increment"}', "neither JSON nor zlib"),
    "record-not-an-array": (
        lambda r: b'[{"type":"conformance.increment"},' + r[1] + b"]",
        "effect 0.*not an array",
    ),
    "unknown-tag": (
        lambda r: b"[" + r[0] + b',[{"type":"evil.module:Class","by":1}]]',
        "effect 1",
    ),
    "two-effects-in-a-record": (
        lambda r: b"[" + r[0] + b",[" + _INCREMENT[1:-1] + b"," + _INCREMENT[1:-1] + b"]]",
        "effect 1.*2 effects",
    ),
}


@pytest.mark.parametrize("corruption", sorted(_BODY_CORRUPTIONS))
async def test_corrupt_batch_body_fails_closed(db: Path, corruption: str) -> None:
    """A batch row's body (its effects) that does not hold its effect records, with a
    checksum that matches (so what is checked after the checksum is what fails)."""
    async with await SQLiteStore.open(db, codec()) as store:
        session = await store.create("s-1")
        for index in range(3):
            session = await apply(store, session, AppendMessage(message(index)), Increment())
        first = await store.load_at("s-1", 1)
    made, expected = _BODY_CORRUPTIONS[corruption]
    columns = "sid, revision, step, cycle, timestamp, effect_count, schema_version, refused, trace"
    with raw(db) as connection:
        *row, body = connection.execute(
            f"SELECT {columns}, body FROM batches WHERE revision = 2"
        ).fetchone()
        assert row[5:7] == [2, SCHEMA_VERSION]
        damaged = made(_records_of(body)) if callable(made) else made
        crc = checksum("batches", (*row, damaged))
        changed = connection.execute(
            "UPDATE batches SET body = ?, crc = ? WHERE revision = 2", (damaged, crc)
        )
        assert changed.rowcount == 1
    before = digest(db)

    async with await SQLiteStore.open(db, codec()) as store:
        for read in (store.load("s-1"), store.load_at("s-1", 2), store.batches("s-1")):
            with pytest.raises(StoredDataError, match=expected) as info:
                await read
            text = str(info.value)
            assert "'s-1'" in text
            assert "revision 2" in text
            assert str(db) in text
        assert await store.load_at("s-1", 1) == first  # what precedes it still reads
        with pytest.raises(StoredDataError):  # and nothing can be appended on top of it
            await store.apply(batch_for(session, Increment()))
    assert digest(db) == before


async def test_an_effect_row_under_a_batch_row_holding_its_effects_is_refused(db: Path) -> None:
    """A batch row of version 5 has no effect rows: one found at its revision is damage."""
    async with await SQLiteStore.open(db, codec()) as store:
        session = await store.create("s")
        await apply(store, session, Increment())
    values = (1, 1, 0, EFFECT_ROWS_VERSION, _INCREMENT)
    with raw(db) as connection:
        connection.execute(
            "INSERT INTO effects (sid, revision, position, schema_version, body, crc) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (*values, checksum("effects", values)),
        )
    async with await SQLiteStore.open(db, codec()) as store:
        with pytest.raises(StoredDataError, match=r"'s' revision 1 effect 0.*orphan"):
            await store.batches("s")


async def test_corrupt_snapshot_fails_closed(db: Path) -> None:
    async with await SQLiteStore.open(db, codec()) as store:
        await store.create("s-1")
    with raw(db) as connection:
        connection.execute("UPDATE snapshots SET body = ?", (b'{"id":"other"}',))
    before = digest(db)
    async with await SQLiteStore.open(db, codec()) as store:
        with pytest.raises(StoredDataError, match=r"'s-1' snapshot at revision 0"):
            await store.load("s-1")
    assert digest(db) == before


# -- ids, persistence, boundaries, cancellation, closing ------------------------------

HOSTILE_IDS = ["../x", "/etc/passwd", "a\x00b", "x" * 1000, "CON", "", "a/b", ".hidden", "nul.txt"]


@pytest.mark.parametrize("bad", HOSTILE_IDS)
async def test_hostile_session_ids_are_refused(store: SQLiteStore, db: Path, bad: str) -> None:
    await store.create("good")
    calls = [
        store.create(bad),
        store.load(bad),
        store.load_at(bad, 0),
        store.delete(bad),
        store.batches(bad),
        store.fork(bad, 0, "other"),
        store.fork("good", 0, bad),
        store.apply(Batch(bad, 1, "step", 0, 0.0, (Increment(),))),
    ]
    for call in calls:
        with pytest.raises(InvalidSessionIdError):
            await call
    assert await store.list_sessions() == ["good"]
    assert names_in(db.parent) == [
        "store.db",
        "store.db-shm",
        "store.db-wal",
    ]


async def test_data_survives_close_and_reopen(db: Path) -> None:
    async with await SQLiteStore.open(db, codec()) as store:
        session = await store.create("s", ConformanceData(label="kept"))
        history = [session]
        for index in range(4):
            session = await apply(store, session, AppendMessage(message(index)), Increment(2))
            history.append(session)
        log = await store.batches("s")
        await store.create("t")
    async with await SQLiteStore.open(db, codec()) as store:
        assert await store.list_sessions() == ["s", "t"]
        assert await store.load("s") == session
        assert await store.batches("s") == log
        for expected in history:
            assert await store.load_at("s", expected.revision) == expected


async def test_boundary_hook_is_called_in_the_worker_thread(db: Path) -> None:
    seen: list[tuple[str, bool]] = []
    loop_thread = threading.get_ident()

    def hook(name: str) -> None:
        seen.append((name, threading.get_ident() != loop_thread))

    async with await SQLiteStore.open(db, codec(), boundary_hook=hook) as store:
        session = await store.create("s")
        await apply(store, session, Increment())
        with pytest.raises(ConflictError):
            await apply(store, session, Increment())
    assert seen == [
        ("create.committed", True),
        ("apply.begin", True),
        ("apply.inserted", True),
        ("apply.committed", True),
        ("apply.begin", True),
    ]
    assert SQLiteStore.BOUNDARIES == (
        "apply.begin",
        "apply.inserted",
        "apply.committed",
        "create.committed",
    )


@pytest.mark.parametrize(
    ("boundary", "stored"), [("apply.inserted", False), ("apply.committed", True)]
)
async def test_hook_failure_before_commit_writes_nothing(
    db: Path, boundary: str, stored: bool
) -> None:
    def hook(name: str) -> None:
        if name == boundary:
            raise RuntimeError(f"stop at {name}")

    async with await SQLiteStore.open(db, codec(), boundary_hook=hook) as store:
        session = await store.create("s")
        with pytest.raises(RuntimeError, match=boundary):
            await apply(store, session, Increment())
    async with await SQLiteStore.open(db, codec()) as store:
        assert (await store.load("s")).revision == int(stored)


_KILLED = textwrap.dedent(
    """
    import os, signal, sys, anyio
    from stepmachine import Batch, Codec
    from stepmachine.stores import SQLiteStore
    from stepmachine.testing.conformance import ConformanceData, Increment

    def hook(name):
        if name == sys.argv[2]:
            os.kill(os.getpid(), signal.SIGKILL)

    async def main():
        codec = Codec(ConformanceData, effects=[Increment])
        store = await SQLiteStore.open(sys.argv[1], codec, boundary_hook=hook)
        await store.create("s")
        await store.apply(Batch("s", 1, "step", 0, 0.0, (Increment(5),)))
        print("survived")

    anyio.run(main)
    """
)


@pytest.mark.parametrize(
    ("boundary", "revision"),
    [("create.committed", 0), ("apply.begin", 0), ("apply.inserted", 0), ("apply.committed", 1)],
)
def test_kill_at_each_boundary(db: Path, tmp_path: Path, boundary: str, revision: int) -> None:
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED, str(db), boundary],
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    assert b"survived" not in killed.stdout

    async def check() -> None:
        async with await SQLiteStore.open(db, codec()) as store:
            session = await store.load("s")
            assert session.revision == revision
            assert session.data.counter == 5 * revision
            assert len(await store.batches("s")) == revision

    anyio.run(check)


async def test_apply_cancelled_in_the_worker_thread_commits_whole(db: Path) -> None:
    entered, release = threading.Event(), threading.Event()

    def hook(name: str) -> None:
        if name == "apply.inserted":
            entered.set()
            release.wait(timeout=60)

    async with await SQLiteStore.open(db, codec(), boundary_hook=hook) as store:
        session = await store.create("s")
        batch = batch_for(session, AppendMessage(message(1)), Increment())
        scope = anyio.CancelScope()
        returned: list[bool] = []

        async def cancelled_apply() -> None:
            with scope:
                await store.apply(batch)  # committed: returns normally
                returned.append(True)
                await anyio.lowlevel.checkpoint()  # the cancellation lands here
                returned.append(False)

        async with anyio.create_task_group() as group:
            group.start_soon(cancelled_apply)
            await anyio.to_thread.run_sync(entered.wait)
            scope.cancel()
            release.set()
        assert scope.cancelled_caught
        assert returned == [True]
        loaded = await store.load("s")
        assert loaded == apply_batch(session, batch.effects)
        with pytest.raises(ConflictError):
            await store.apply(batch)


async def test_closed_store_refuses_calls(db: Path) -> None:
    store = await SQLiteStore.open(db, codec())
    await store.create("s")
    await store.aclose()
    await store.aclose()  # idempotent
    with pytest.raises(StepmachineError, match="closed"):
        await store.load("s")
    async with await SQLiteStore.open(db, codec()) as reopened:
        assert await reopened.list_sessions() == ["s"]
    assert reopened._conn is None


# -- the golden fixture ------------------------------------------------------------


@pytest.fixture(scope="module")
def golden_module() -> ModuleType:
    """The fixture script (its codec and types decode the fixture)."""
    return make_golden_sqlite


@pytest.mark.parametrize("version", range(1, SCHEMA_VERSION + 1))
async def test_golden_fixture_still_reads_exactly(
    golden_module: ModuleType, tmp_path: Path, version: int
) -> None:
    golden = FIXTURES / "golden" / "sqlite"
    fixture = golden / golden_module.db_name(version)
    before = digest(fixture)
    db = tmp_path / "store.db"
    shutil.copyfile(fixture, db)
    expected = json.loads((golden / "expected.json").read_text(encoding="utf-8"))
    with raw(db) as connection:  # written by that schema version
        assert connection.execute("SELECT max(version) FROM schema_version").fetchone() == (
            version,
        )

    async with await SQLiteStore.open(db, golden_module.make_codec()) as store:
        assert await store.list_sessions() == sorted(expected["sessions"])
        for session_id, content in expected["sessions"].items():
            revisions = content["revisions"]
            assert as_json(await store.load(session_id)) == revisions[-1]
            for revision, session in enumerate(revisions):
                loaded = await store.load_at(session_id, revision)
                assert as_json(loaded) == session, (session_id, revision)
            assert as_json(await store.batches(session_id)) == [
                {**b, "refused": [], "trace": None} for b in content["batches"]
            ]  # fields added later decode as their defaults
        assert {len(c["revisions"]) for c in expected["sessions"].values()} >= {1, 103}
    assert digest(fixture) == before


# -- the WAL, and backups (issue 8, item 4) -------------------------------------------


async def test_backup_holds_what_is_still_only_in_the_wal(db: Path, tmp_path: Path) -> None:
    async with await SQLiteStore.open(db, codec()) as store:
        session = await store.create("s")
        for index in range(5):
            session = await apply(store, session, AppendMessage(message(index)), Increment())
        log = await store.batches("s")
        assert (db.parent / "store.db-wal").stat().st_size > 0  # not checkpointed yet
        naive, copy = tmp_path / "naive" / "store.db", tmp_path / "copy" / "store.db"
        naive.parent.mkdir()
        copy.parent.mkdir()
        shutil.copyfile(db, naive)  # what the documentation says never to do
        await store.backup(copy)
        with pytest.raises(sqlite3.OperationalError):
            await store.backup(copy)  # never over an existing database
        session = await apply(store, session, Increment())  # the store is still in use
    assert stat.S_IMODE(copy.stat().st_mode) == 0o600
    async with await SQLiteStore.open(naive, codec()) as store:
        assert await store.list_sessions() == []  # the batches were only in the WAL
    async with await SQLiteStore.open(copy, codec()) as store:
        assert (await store.load("s")).revision == 5
        assert await store.batches("s") == log


_WAL_WRITER = textwrap.dedent(
    """
    import os, signal, sys, anyio
    from stepmachine import Batch, Codec
    from stepmachine.stores import SQLiteStore
    from stepmachine.testing.conformance import ConformanceData, Increment

    async def main():
        codec = Codec(ConformanceData, effects=[Increment])
        store = await SQLiteStore.open(sys.argv[1], codec, synchronous="FULL")
        await store.create("s")
        for revision in range(1, 11):
            await store.apply(Batch("s", revision, "step", 0, 0.0, (Increment(),)))
        os.kill(os.getpid(), signal.SIGKILL)  # acknowledged, still only in the WAL

    anyio.run(main)
    """
)


def test_a_damaged_wal_rolls_back_acknowledged_batches_silently(db: Path, tmp_path: Path) -> None:
    """The limit the class docstring documents: SQLite stops WAL replay at the first bad frame."""
    killed = subprocess.run(
        [sys.executable, "-c", _WAL_WRITER, str(db)],
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    wal = db.parent / "store.db-wal"
    content = bytearray(wal.read_bytes())
    frame = 24 + 4096  # a frame header and one page (the default page size)
    frames = (len(content) - 32) // frame
    assert frames >= 10
    content[32 + (frames // 2) * frame + 24 + 100] ^= 0x01  # one bit, mid-WAL
    wal.write_bytes(bytes(content))

    async def reopen() -> int:
        async with await SQLiteStore.open(db, codec()) as store:
            return (await store.load("s")).revision

    revision = anyio.run(reopen)
    assert 0 <= revision < 10  # acknowledged batches are gone, and nothing said so
    assert not wal.exists()  # the close checkpointed the rolled-back state: for good
    assert anyio.run(reopen) == revision


def test_the_docstring_states_what_sqlite_guarantees() -> None:
    doc = " ".join((SQLiteStore.__doc__ or "").split())
    for claim in (
        "A damaged WAL loses acknowledged batches silently",
        "decides when the WAL reaches the disk, not what happens to a damaged one",
        "VACUUM INTO",
        "sqlite3 online backup API",
        "Never copy the database file alone while any process has it open",
        "every row carries a CRC-32",
        "A database of a newer version than this code knows is refused and left unchanged",
    ):
        assert claim in doc, claim
    assert "VACUUM INTO" in (SQLiteStore.backup.__doc__ or "")


# -- issue 9: one statement batch per apply, pruned and compressed snapshots --------


def statements_of(store: SQLiteStore) -> list[str]:
    """Start recording the SQL the store's connection runs (the list fills as it runs)."""
    seen: list[str] = []
    connection = store._conn
    assert connection is not None
    connection.set_trace_callback(seen.append)
    return seen


async def test_warm_apply_reads_nothing_and_compare_and_sets_in_one_update(
    store: SQLiteStore,
) -> None:
    session = await store.create("s")
    session = await apply(store, session, AppendMessage(message(0)))
    seen = statements_of(store)
    await store.apply(batch_for(session, AppendMessage(message(1)), Increment(2), Increment(3)))
    assert not [s for s in seen if s.lstrip().upper().startswith("SELECT")], seen
    updates = [s for s in seen if s.startswith("UPDATE sessions")]
    assert len(updates) == 1
    assert updates[0].endswith("WHERE sid = 1 AND revision = 1"), updates
    assert seen[0] == "BEGIN IMMEDIATE"
    assert seen[-1] == "COMMIT"
    # BEGIN, the CAS, the batch row holding its three effects, the data_version the
    # cache is then current at (no table read), COMMIT: two b-trees.
    assert seen[2].startswith("INSERT INTO batches"), seen
    assert seen[3] == "PRAGMA data_version", seen
    assert len(seen) == 5, seen


async def test_stale_cache_conflict_is_diagnosed_by_a_read(db: Path) -> None:
    async with (
        await SQLiteStore.open(db, codec()) as first,
        await SQLiteStore.open(db, codec()) as second,
    ):
        session = await first.create("s")
        await second.apply(batch_for(await second.load("s"), Increment(1)))
        await second.apply(batch_for(await second.load("s"), Increment(1)))
        seen = statements_of(first)
        with pytest.raises(ConflictError) as excinfo:
            await first.apply(batch_for(session, Increment(5)))
        assert (excinfo.value.expected, excinfo.value.actual) == (0, 2)
        assert any(s.startswith("SELECT") for s in seen)
        assert (await first.load("s")).data.counter == 2


async def test_apply_after_another_instance_recreated_the_session(db: Path) -> None:
    async with (
        await SQLiteStore.open(db, codec()) as first,
        await SQLiteStore.open(db, codec()) as second,
    ):
        session = await first.create("s")
        session = await apply(first, session, AppendMessage(message(0)))  # cached at 1
        await second.delete("s")
        other = await second.create("s", conversation=[message(7)])
        other = await apply(second, other, Increment(4))  # a new sid, also at revision 1
        # first's cache is at revision 1 of the old sid: its CAS misses, it reads
        # the new row, and applies on top of the session that is stored now.
        after = await first.apply(batch_for(session, Increment(1)))
        assert after.conversation == (message(7),)
        assert after.data.counter == 5
        assert await second.load("s") == after


async def test_apply_after_another_instance_deleted_the_session(db: Path) -> None:
    async with (
        await SQLiteStore.open(db, codec()) as first,
        await SQLiteStore.open(db, codec()) as second,
    ):
        session = await first.create("s")
        await second.delete("s")
        with pytest.raises(SessionNotFoundError):
            await first.apply(batch_for(session, Increment(1)))
        assert await first.list_sessions() == []


async def test_snapshots_are_compressed_and_superseded_ones_pruned(db: Path) -> None:
    counting = CountingCodec()
    async with await SQLiteStore.open(db, counting) as store:
        session = await store.create("s")
        for index in range(4 * SNAPSHOT_EVERY + 10):
            session = await apply(store, session, AppendMessage(message(index)))
        assert counting.calls["encode_session"] >= 3  # revision 0 and two periodic ones
        with raw(db) as connection:
            (newest,) = connection.execute("SELECT snapshot_revision FROM sessions").fetchone()
        assert newest > SNAPSHOT_EVERY
        assert snapshot_revisions(db) == [0, newest]
        with raw(db) as connection:
            body = connection.execute(
                "SELECT body FROM snapshots WHERE revision = ?", (newest,)
            ).fetchone()[0]
        record = store.codec.encode_session(await store.load_at("s", newest))
        assert body[:1] == b"\x78"
        assert zlib.decompress(body) == record
        assert len(body) * 3 < len(record)
    async with await SQLiteStore.open(db, codec()) as store:
        assert await store.load("s") == session
        assert (await store.load_at("s", 150)).conversation[-1] == message(149)


async def test_an_uncompressed_snapshot_still_reads(db: Path) -> None:
    async with await SQLiteStore.open(db, codec()) as store:
        session = await store.create("s", conversation=[message(0)])
        session = await apply(store, session, Increment(3))
    with raw(db) as connection:  # the revision-0 snapshot as written before compression
        record = Codec(ConformanceData).encode_session(
            Session(id="s", revision=0, conversation=(message(0),), data=ConformanceData())
        )
        values = (1, 0, SCHEMA_VERSION, record)
        connection.execute(
            "UPDATE snapshots SET body = ?, crc = ? WHERE sid = 1 AND revision = 0",
            (record, checksum("snapshots", values)),
        )
    async with await SQLiteStore.open(db, codec()) as store:
        assert await store.load("s") == session
        assert (await store.load_at("s", 0)).conversation == (message(0),)


async def test_a_snapshot_that_does_not_decompress_fails_closed(db: Path) -> None:
    async with await SQLiteStore.open(db, codec()) as store:
        await store.create("s")
    with raw(db) as connection:
        body = b"\x78not zlib"
        connection.execute(
            "UPDATE snapshots SET body = ?, crc = ? WHERE sid = 1",
            (body, checksum("snapshots", (1, 0, SCHEMA_VERSION, body))),
        )
    async with await SQLiteStore.open(db, codec()) as store:
        with pytest.raises(StoredDataError, match="does not decompress"):
            await store.load("s")


def snapshot_rows(db: Path) -> dict[int, list[int]]:
    with raw(db) as connection:
        rows = connection.execute("SELECT sid, revision FROM snapshots ORDER BY sid, revision")
        found: dict[int, list[int]] = {}
        for sid, revision in rows:
            found.setdefault(sid, []).append(revision)
        return found


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(
        st.one_of(
            st.integers(min_value=1, max_value=400).map(lambda n: ("append", n)),
            st.just(("replace", 0)),
            st.integers(min_value=-3, max_value=3).map(lambda n: ("increment", n)),
        ),
        min_size=1,
        max_size=60,
    ),
    every=st.integers(min_value=1, max_value=6),
    gap=st.integers(min_value=2, max_value=12),
    fork_at=st.floats(min_value=0, max_value=1),
)
async def test_any_history_keeps_two_snapshots_and_reads_every_revision(
    steps: list[tuple[str, int]], every: int, gap: int, fork_at: float
) -> None:
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as patch:
        patch.setattr(_rows, "SNAPSHOT_EVERY", every)
        patch.setattr(_rows, "SNAPSHOT_MAX_GAP", max(every, gap))
        db = Path(tmp) / "store.db"
        async with await SQLiteStore.open(db, codec()) as store:
            session = await store.create("s", conversation=[message(-1)])
            history = [session]
            for index, (kind, size) in enumerate(steps):
                if kind == "append":
                    effect: Effect = AppendMessage(Message.user("x" * size, id=f"a-{index}"))
                elif kind == "replace":
                    effect = ReplaceConversation((Message.system("summary", id=f"r-{index}"),))
                else:
                    effect = Increment(size)
                session = await apply(store, session, effect)
                history.append(session)
            fork = min(int(fork_at * len(history)), len(history) - 1)
            await store.fork("s", fork, "f")
        # Every session keeps revision 0 and at most its newest snapshot.
        with raw(db) as connection:
            rows = dict(connection.execute("SELECT sid, snapshot_revision FROM sessions"))
        for sid, revisions in snapshot_rows(db).items():
            assert revisions[0] == 0
            assert revisions[1:] in ([], [rows[sid]]), (revisions, rows[sid])
        async with await SQLiteStore.open(db, codec()) as store:  # cold: from the snapshots
            assert await store.load("s") == session
            for expected in history:
                assert await store.load_at("s", expected.revision) == expected
            forked = await store.load("f")
            assert forked == msgspec.structs.replace(history[fork], id="f")


async def test_long_effect_records_are_stored_compressed(db: Path) -> None:
    long_text = "a long message, " * 40
    async with await SQLiteStore.open(db, codec()) as store:
        session = await store.create("s")
        session = await apply(store, session, AppendMessage(Message.user(long_text, id="l")))
        session = await apply(store, session, Increment(2))
    with raw(db) as connection:
        bodies = dict(connection.execute("SELECT revision, body FROM batches"))
    assert bodies[1][:1] == b"\x78"  # compressed
    record = codec().encode_effects((session_effect(session),))
    assert zlib.decompress(bodies[1]) == b"[" + record + b"]"  # the batch's records, in an array
    assert bodies[2] == b"[" + codec().encode_effects((Increment(2),)) + b"]"  # short: as it is
    async with await SQLiteStore.open(db, codec()) as store:
        assert await store.load("s") == session


def session_effect(session: Session[Any]) -> Effect:
    return AppendMessage(session.conversation[0])


@pytest.mark.usefixtures(effect_rows.__name__)
async def test_uncompressed_long_effect_records_still_read(db: Path) -> None:
    """Rows written before effect records were compressed hold the JSON as it is."""
    async with await SQLiteStore.open(db, codec()) as store:
        session = await store.create("s")
        session = await apply(store, session, AppendMessage(Message.user("x " * 500, id="l")))
    record = codec().encode_effects((session_effect(session),))
    with raw(db) as connection:
        connection.execute(
            "UPDATE effects SET body = ?, crc = ? WHERE revision = 1",
            (record, checksum("effects", (1, 1, 0, EFFECT_ROWS_VERSION, record))),
        )
        assert connection.execute("SELECT changes()").fetchone() == (1,)
    async with await SQLiteStore.open(db, codec()) as store:
        assert await store.load("s") == session


@pytest.mark.usefixtures(effect_rows.__name__)
@pytest.mark.parametrize("compressed", [False, True], ids=["as-is", "compressed"])
@pytest.mark.parametrize("version", [1, 2, 3, 4, 5, 6])
async def test_which_effect_rows_read_by_row_version(
    db: Path, version: int, compressed: bool
) -> None:
    """Effect rows of versions 2 to 4 read; only version 3 and later may hold a compressed
    record; version 5 and later write no effect rows.

    A version-2 row with a compressed body, or a row of another version, is a
    corrupt row: StoredDataError naming session, revision and effect, and
    nothing is rewritten.
    """
    async with await SQLiteStore.open(db, codec()) as store:
        session = await store.create("s")
        session = await apply(store, session, AppendMessage(Message.user("z " * 500, id="l")))
    record = codec().encode_effects((session_effect(session),))
    body = zlib.compress(record) if compressed else record
    with raw(db) as connection:
        connection.execute(
            "UPDATE effects SET schema_version = ?, body = ?, crc = ? WHERE revision = 1",
            (version, body, checksum("effects", (1, 1, 0, version, body))),
        )
    before = digest(db)
    readable = version in (3, 4) or (version == 2 and not compressed)
    async with await SQLiteStore.open(db, codec()) as store:
        if readable:
            assert await store.load("s") == session
        else:
            with pytest.raises(StoredDataError, match=r"'s' revision 1 effect 0.*version") as info:
                await store.load("s")
            assert ("compressed" in str(info.value)) == (version == 2)
    assert digest(db) == before


@pytest.mark.usefixtures(effect_rows.__name__)
async def test_an_effect_record_that_does_not_decompress_fails_closed(db: Path) -> None:
    async with await SQLiteStore.open(db, codec()) as store:
        session = await store.create("s")
        await apply(store, session, AppendMessage(Message.user("y " * 500, id="l")))
    body = b"\x78not zlib"
    with raw(db) as connection:
        connection.execute(
            "UPDATE effects SET body = ?, crc = ? WHERE revision = 1",
            (body, checksum("effects", (1, 1, 0, EFFECT_ROWS_VERSION, body))),
        )
    before = digest(db)
    async with await SQLiteStore.open(db, codec()) as store:
        with pytest.raises(StoredDataError, match=r"'s' revision 1 effect 0.*does not decompress"):
            await store.load("s")
    assert digest(db) == before
