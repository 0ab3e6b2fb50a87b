"""SQLiteStore never loads damaged rows as different data (issue 8, item 2).

Every row carries a CRC-32 over its payload *and* the columns that say where
it belongs. The property test flips single bits inside the records of the
database file (the cells of the ``sessions``, ``batches``, ``effects`` and
``snapshots`` b-trees, overflow pages included) and reads everything back
through a fresh store: every read returns exactly the original data or raises
``StoredDataError``, never different data and never another exception. The
other tests move rows between sessions, revisions and positions, and check
that decoding still fails closed when a damaged row carries a valid checksum.

Both layouts of a batch are covered: its effects in the batch row (schema
version 5, what the store writes) and in effect rows under it (version 4 and
older, what a migrated database holds; written here as version 4 wrote them,
:mod:`_sqlite_effect_rows`).
"""

from __future__ import annotations

import random
import re
import sqlite3
import zlib
from collections.abc import Awaitable, Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from _sqlite_effect_rows import insert_batch_as_version_4

from stepmachine import (
    AppendMessage,
    Codec,
    Effect,
    Message,
    ReplaceConversation,
    Session,
    SessionNotFoundError,
    StoredDataError,
)
from stepmachine.extend import Batch, apply_batch
from stepmachine.stores import SQLiteStore, _sqlite_rows
from stepmachine.stores._sqlite_schema import COLUMNS, checksum, row_columns
from stepmachine.testing.conformance import ConformanceData, Increment

TABLES = ("sessions", "batches", "effects", "snapshots")
BIG_TEXT = "".join(str(digit) for digit in random.Random(9).choices(range(10), k=9000))


def codec() -> Codec[ConformanceData]:
    return Codec(ConformanceData, effects=[Increment])


def raw(path: Path) -> closing[sqlite3.Connection]:
    """A plain sqlite3 connection (autocommit), closed (and checkpointed) on exit."""
    return closing(sqlite3.connect(path, isolation_level=None))


async def apply(store: SQLiteStore, session: Session[Any], *effects: Effect) -> Session[Any]:
    await store.apply(
        Batch(session.id, session.revision + 1, "pay", session.revision % 4, 1.7e9, effects)
    )
    return apply_batch(session, effects)


def transfer(index: int, amount: int) -> Message:
    return Message.user(f"transfer {amount} EUR to account {index}", id=f"t-{index}")


async def write_sample(path: Path) -> None:
    """A small database with every kind of row: several sessions, snapshots, overflow, a fork,
    the first batches in effect rows (as version 4 wrote them), the later ones in batch rows."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_sqlite_rows, "insert_batch", insert_batch_as_version_4)
        async with await SQLiteStore.open(path, codec()) as store:
            session = await store.create("payments", ConformanceData(label="ledger"))
            for index in range(1, 5):
                session = await apply(store, session, AppendMessage(transfer(index, 100 * index)))
            session = await apply(store, session, Increment(7))
            # A big message: its rows spill onto overflow pages (stored compressed, so
            # the text is made of digits that do not repeat, which compress about half).
            big = Message.user("statement " + BIG_TEXT, id="big")
            session = await apply(store, session, AppendMessage(big), Increment(1))
    async with await SQLiteStore.open(path, codec()) as store:
        summary = Message.system("Summary: four transfers, 1000 EUR in total.", id="sum")
        session = await apply(store, session, ReplaceConversation((summary,)))  # a snapshot
        session = await apply(store, session, AppendMessage(transfer(5, 900)), Increment(-2))
        other = await store.create("other", conversation=[Message.system("terse", id="s0")])
        for index in range(3):
            other = await apply(store, other, Increment(index + 1))
        # A big batch row: its body spills onto overflow pages too.
        other = await apply(store, other, AppendMessage(Message.user(BIG_TEXT[::-1], id="b2")))
        forked = await store.fork("payments", 5, "payments-fork")
        await apply(store, forked, AppendMessage(transfer(6, 300)))


@dataclass(frozen=True)
class Read:
    """One read of the store, and what it returned on the undamaged file."""

    name: str
    call: Callable[[SQLiteStore], Awaitable[Any]]
    expected: Any


async def expected_reads(path: Path) -> list[Read]:
    """Every read a user can make of the sample, with its result on the undamaged file."""
    calls: list[tuple[str, Callable[[SQLiteStore], Awaitable[Any]]]] = [
        ("list_sessions", lambda store: store.list_sessions())
    ]
    async with await SQLiteStore.open(path, codec()) as store:
        for session_id in await store.list_sessions():
            revision = (await store.load(session_id)).revision

            def loader(sid: str) -> Callable[[SQLiteStore], Awaitable[Any]]:
                return lambda store: store.load(sid)

            def at(sid: str, r: int) -> Callable[[SQLiteStore], Awaitable[Any]]:
                return lambda store: store.load_at(sid, r)

            def log(sid: str) -> Callable[[SQLiteStore], Awaitable[Any]]:
                return lambda store: store.batches(sid)

            calls.append((f"load({session_id!r})", loader(session_id)))
            calls.extend(
                (f"load_at({session_id!r}, {r})", at(session_id, r)) for r in range(revision + 1)
            )
            calls.append((f"batches({session_id!r})", log(session_id)))
        return [Read(name, call, await call(store)) for name, call in calls]


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = 0
    for index in range(9):
        byte = data[pos + index]
        if index == 8:
            return (value << 8) | byte, pos + 9
        value = (value << 7) | (byte & 0x7F)
        if byte < 0x80:
            return value, pos + index + 1
    raise AssertionError("unreachable")


def record_regions(path: Path, tables: tuple[str, ...] = TABLES) -> list[tuple[str, int, int]]:
    """The byte ranges ``(table, start, end)`` holding the records of ``tables`` in ``path``.

    Walks each table's b-tree from its root page: every leaf cell (its record,
    after the cell's size and rowid) and the used part of its overflow pages.
    The file must be checkpointed (no WAL).
    """
    data = path.read_bytes()
    page_size = int.from_bytes(data[16:18], "big") or 65536
    page_size = 65536 if page_size == 1 else page_size
    usable = page_size - data[20]
    with raw(path) as connection:
        roots = dict(connection.execute("SELECT name, rootpage FROM sqlite_master"))
    regions: list[tuple[str, int, int]] = []

    def walk(table: str, page: int) -> None:
        base = (page - 1) * page_size
        header = base + (100 if page == 1 else 0)
        kind = data[header]
        cells = int.from_bytes(data[header + 3 : header + 5], "big")
        interior = kind in (2, 5)
        start = header + (12 if interior else 8)
        pointers = [
            base + int.from_bytes(data[start + 2 * i : start + 2 * i + 2], "big")
            for i in range(cells)
        ]
        if interior:
            for pointer in pointers:
                walk(table, int.from_bytes(data[pointer : pointer + 4], "big"))
            walk(table, int.from_bytes(data[header + 8 : header + 12], "big"))
            return
        assert kind in (10, 13), (table, page, kind)
        max_local = usable - 35 if kind == 13 else (usable - 12) * 64 // 255 - 23
        min_local = (usable - 12) * 32 // 255 - 23
        for pointer in pointers:
            size, pos = _varint(data, pointer)
            if kind == 13:
                _, pos = _varint(data, pos)  # the rowid
            local = size
            if size > max_local:
                local = min_local + (size - min_local) % (usable - 4)
                local = local if local <= max_local else min_local
            regions.append((table, pos, pos + local))
            remaining = size - local
            overflow = 0
            if remaining:
                overflow = int.from_bytes(data[pos + local : pos + local + 4], "big")
            while overflow:
                page_start = (overflow - 1) * page_size
                length = min(remaining, usable - 4)
                regions.append((table, page_start + 4, page_start + 4 + length))
                remaining -= length
                overflow = int.from_bytes(data[page_start : page_start + 4], "big")

    for table in tables:
        walk(table, roots[table])
    return regions


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    folder = tmp_path_factory.mktemp("sample")
    path = folder / "store.db"
    anyio.run(write_sample, path)
    assert sorted(p.name for p in folder.iterdir()) == ["store.db"]  # checkpointed, no WAL
    return path, path.read_bytes()


def test_record_regions_cover_every_table(sample: tuple[Path, bytes]) -> None:
    path, content = sample
    regions = record_regions(path)
    assert {table for table, _, _ in regions} == set(TABLES)
    with raw(path) as connection:
        counts = {t: connection.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES}
    for table in TABLES:
        # One region per row, plus overflow pages (only snapshots, effects and batches are big).
        local = [r for r in regions if r[0] == table]
        assert len(local) >= counts[table], table
    for table in ("effects", "batches"):  # the big messages' rows have overflow pages
        assert len([r for r in regions if r[0] == table]) > counts[table], table
    # The text the property test damages is inside the regions. (Snapshot bodies and
    # long effect records are compressed: "ledger" and the big text are not in the
    # file as text.)
    for needle in (b"transfer 100 EUR", b"transfer 900 EUR", b"payments-fork"):
        found = [i for i in range(len(content)) if content.startswith(needle, i)]
        inside = [i for i in found if any(start <= i < end for _, start, end in regions)]
        assert inside, needle


async def check_flip(
    reads: list[Read], content: bytes, folder: Path, offset: int, bit: int
) -> list[str]:
    """Flip one bit, read everything through a fresh store; return what went wrong."""
    path = folder / f"flip-{offset}-{bit}.db"
    damaged = bytearray(content)
    damaged[offset] ^= 1 << bit
    path.write_bytes(bytes(damaged))
    problems: list[str] = []
    try:
        store = await SQLiteStore.open(path, codec())
    except StoredDataError:
        return problems
    async with store:
        for read in reads:
            try:
                got = await read.call(store)
            except StoredDataError:
                continue
            except Exception as exc:
                problems.append(f"{read.name} raised {type(exc).__name__}: {exc}")
                continue
            if got != read.expected:
                problems.append(f"{read.name} returned different data")
    for suffix in ("", "-wal", "-shm"):
        await anyio.Path(f"{path}{suffix}").unlink(missing_ok=True)
    return problems


@pytest.mark.parametrize("seed", range(4))
async def test_flipped_bits_never_load_as_different_data(
    sample: tuple[Path, bytes], tmp_path: Path, seed: int
) -> None:
    path, content = sample
    reads = await expected_reads(path)
    regions = record_regions(path)
    rng = random.Random(seed)
    failures: list[str] = []
    for _ in range(50):
        table, start, end = rng.choice(regions)
        offset, bit = rng.randrange(start, end), rng.randrange(8)
        problems = await check_flip(reads, content, tmp_path, offset, bit)
        failures.extend(f"{table} byte {offset} bit {bit}: {p}" for p in problems)
    assert failures == []


@pytest.mark.parametrize(
    ("needle", "table"), [(b"transfer 100 EUR", "effects"), (b"transfer 900 EUR", "batches")]
)
def test_every_single_bit_of_one_effect_record_is_caught(
    sample: tuple[Path, bytes], needle: bytes, table: str
) -> None:
    """Exhaustively, for the row that holds the record of ``needle`` (an effect row, a
    batch row holding its effects): never different data."""
    path, content = sample
    at = content.find(needle)
    (region,) = [r for r in record_regions(path, (table,)) if r[1] <= at < r[2]]

    async def main() -> list[str]:
        wanted = ("load('payments')", "batches('payments')")
        reads = [r for r in await expected_reads(path) if r.name in wanted]
        failures: list[str] = []
        for offset in range(region[1], region[2]):
            for bit in range(8):
                problems = await check_flip(reads, content, path.parent, offset, bit)
                failures.extend(f"byte {offset} bit {bit}: {p}" for p in problems)
        return failures

    assert anyio.run(main) == []


# -- rows moved to where they do not belong ---------------------------------------------


async def make(path: Path, effect_rows: bool = False) -> None:
    """Sessions a and b, three batches each; with ``effect_rows``, written as version 4 did."""
    with pytest.MonkeyPatch.context() as patch:
        if effect_rows:
            patch.setattr(_sqlite_rows, "insert_batch", insert_batch_as_version_4)
        await _make(path)


async def _make(path: Path) -> None:
    async with await SQLiteStore.open(path, codec()) as store:
        for session_id in ("a", "b"):
            session = await store.create(session_id)
            for index in range(3):
                effects = (AppendMessage(transfer(index, 1)), Increment())
                session = await apply(store, session, *effects)


_MOVES: dict[str, tuple[str, str, str]] = {
    # name: (SQL script, table named in the error, what the error names)
    "effect-to-other-position": (
        (
            "UPDATE effects SET position = 9 WHERE sid = 1 AND revision = 2 AND position = 0;"
            "UPDATE effects SET position = 0 WHERE sid = 1 AND revision = 2 AND position = 1;"
            "UPDATE effects SET position = 1 WHERE sid = 1 AND revision = 2 AND position = 9;"
        ),
        "effects",
        "revision 2 effect 0",
    ),
    "effect-bodies-swapped": (
        (
            "UPDATE effects SET body = (SELECT body FROM effects e WHERE e.sid = 1 "
            "AND e.revision = 3 AND e.position = 0) WHERE sid = 1 AND revision = 2 AND position = 0"
        ),
        "effects",
        "revision 2 effect 0",
    ),
    "effect-to-other-session": (
        (
            "UPDATE effects SET body = (SELECT body FROM effects e WHERE e.sid = 2 "
            "AND e.revision = 2 AND e.position = 0), crc = (SELECT crc FROM effects e "
            "WHERE e.sid = 2 AND e.revision = 2 AND e.position = 0) "
            "WHERE sid = 1 AND revision = 2 AND position = 0"
        ),
        "effects",
        "revision 2 effect 0",
    ),
    "batch-bodies-swapped": (
        (
            "UPDATE batches SET body = (SELECT body FROM batches b WHERE b.sid = 1 "
            "AND b.revision = 3) WHERE sid = 1 AND revision = 2"
        ),
        "batches",
        "revision 2",
    ),
    "batch-body-to-other-session": (
        (
            "UPDATE batches SET body = (SELECT body FROM batches b WHERE b.sid = 2 "
            "AND b.revision = 2), crc = (SELECT crc FROM batches b WHERE b.sid = 2 "
            "AND b.revision = 2) WHERE sid = 1 AND revision = 2"
        ),
        "batches",
        "revision 2",
    ),
    "batches-swapped": (
        (
            "UPDATE batches SET revision = 9 WHERE sid = 1 AND revision = 2;"
            "UPDATE batches SET revision = 2 WHERE sid = 1 AND revision = 3;"
            "UPDATE batches SET revision = 3 WHERE sid = 1 AND revision = 9;"
        ),
        "batches",
        "revision 2",
    ),
    "batch-step-changed": (
        "UPDATE batches SET step = 'approve' WHERE sid = 1 AND revision = 2",
        "batches",
        "revision 2",
    ),
    "session-row-rewound": (
        "UPDATE sessions SET revision = 2 WHERE session_id = 'a'",
        "sessions",
        "revision 2 as stored",
    ),
    "snapshot-of-other-session": (
        "DELETE FROM snapshots WHERE sid = 1; UPDATE snapshots SET sid = 1 WHERE sid = 2",
        "snapshots",
        "snapshot at revision 0",
    ),
}


@pytest.mark.parametrize("move", sorted(_MOVES))
async def test_rows_moved_elsewhere_are_refused(tmp_path: Path, move: str) -> None:
    path = tmp_path / "store.db"
    await make(path, effect_rows=move.startswith("effect"))
    statement, table, where = _MOVES[move]
    with raw(path) as connection:
        connection.executescript(statement)
        assert connection.total_changes >= 1
    async with await SQLiteStore.open(path, codec()) as store:
        with pytest.raises(StoredDataError) as info:
            await store.load("a")
        text = str(info.value)
        assert f"the {table} row does not match its checksum" in text
        assert "session 'a'" in text
        assert where in text
        assert str(path) in text
        if table == "sessions":
            with pytest.raises(StoredDataError):
                await store.list_sessions()
        else:
            assert await store.list_sessions() == ["a", "b"]
        if move != "snapshot-of-other-session":
            assert (await store.load("b")).revision == 3  # the other session is intact


@pytest.mark.parametrize(
    ("table", "where"), [("effects", "effect 0 (table effects)"), ("batches", "(table batches)")]
)
async def test_fork_refuses_to_copy_a_damaged_row(tmp_path: Path, table: str, where: str) -> None:
    path = tmp_path / "store.db"
    await make(path, effect_rows=table == "effects")
    with raw(path) as connection:
        damage = f"UPDATE {table} SET body = body || x'20' WHERE sid = 1 AND revision = 1"
        assert connection.execute(damage).rowcount >= 1
    async with await SQLiteStore.open(path, codec()) as store:
        with pytest.raises(StoredDataError, match=re.escape(f"'a' revision 1 {where}")):
            await store.fork("a", 3, "copy")
        assert await store.list_sessions() == ["a", "b"]  # nothing was written
        with pytest.raises(SessionNotFoundError):
            await store.load("copy")


def rechecksum(path: Path) -> None:
    """Give every row the checksum of its current content (a buggy writer, not damage)."""
    with raw(path) as connection:
        for table, columns in COLUMNS.items():
            rows = connection.execute(
                f"SELECT rowid, {', '.join(columns)} FROM {table}"
                if table in ("sessions", "snapshots")
                else f"SELECT NULL, {', '.join(columns)} FROM {table}"
            ).fetchall()
            for row in rows:
                keys = dict(zip(columns, row[1:], strict=True))
                version = keys["schema_version"]
                covered = row_columns(table, version) if isinstance(version, int) else columns
                crc = checksum(table, tuple(keys[c] for c in covered))
                if table == "sessions":
                    connection.execute("UPDATE sessions SET crc = ? WHERE sid = ?", (crc, row[0]))
                elif table == "snapshots":
                    connection.execute(
                        "UPDATE snapshots SET crc = ? WHERE rowid = ?", (crc, row[0])
                    )
                else:
                    key = ("sid", "revision") + (("position",) if table == "effects" else ())
                    condition = " AND ".join(f"{k} = ?" for k in key)
                    connection.execute(
                        f"UPDATE {table} SET crc = ? WHERE {condition}",
                        (crc, *(keys[k] for k in key)),
                    )


_DECODED = b'[[{"type":"conformance.increment"}],[{"type":"conformance.increment"}]]'


@pytest.mark.parametrize(
    ("statement", "message"),
    [
        # The batch row holding its effects (what the store writes).
        ("UPDATE batches SET body = x'ff00' WHERE sid = 1 AND revision = 2", "neither JSON nor"),
        ("UPDATE batches SET body = 'text' WHERE sid = 1 AND revision = 2", "column body"),
        ("UPDATE batches SET body = NULL WHERE sid = 1 AND revision = 2", "column body"),
        ("UPDATE batches SET effect_count = 3 WHERE sid = 1 AND revision = 2", "says 3"),
        ("UPDATE batches SET schema_version = 9 WHERE sid = 1 AND revision = 2", "version is 9"),
        (
            "UPDATE batches SET body = x'" + zlib.compress(_DECODED[:-3]).hex() + "' "
            "WHERE sid = 1 AND revision = 2",
            "revision 2.*not a JSON array",
        ),
        (
            "UPDATE batches SET body = x'"
            + _DECODED.replace(b"increment", b"evil").hex()
            + "' WHERE sid = 1 AND revision = 2",
            "revision 2 effect 0",
        ),
        # Effect rows under a batch row (a database of version 4 or older).
        ("UPDATE effects SET body = x'ff00' WHERE sid = 1 AND revision = 2", "revision 2 effect 0"),
        ("UPDATE effects SET body = 'text' WHERE sid = 1 AND revision = 2", "column body"),
        ("UPDATE batches SET cycle = 'x' WHERE sid = 1 AND revision = 2", "column cycle"),
        ("UPDATE effects SET schema_version = 9 WHERE sid = 1 AND revision = 2", "version is 9"),
        (  # version 2 never wrote a compressed effect record (version 3 does)
            "UPDATE effects SET schema_version = 2, body = x'"
            + zlib.compress(b'[{"type":"conformance.increment"}]').hex()
            + "' WHERE sid = 1 AND revision = 2 AND position = 1",
            "revision 2 effect 1.*schema version 2 holds a compressed body",
        ),
        ("DELETE FROM effects WHERE sid = 1 AND revision = 2", "the effect is missing"),
    ],
)
async def test_bad_rows_with_valid_checksums_still_fail_closed(
    tmp_path: Path, statement: str, message: str
) -> None:
    path = tmp_path / "store.db"
    await make(path, effect_rows="effects" in statement)
    with raw(path) as connection:
        assert connection.execute(statement).rowcount >= 1
    rechecksum(path)
    async with await SQLiteStore.open(path, codec()) as store:
        with pytest.raises(StoredDataError, match=message):
            await store.batches("a")
        assert (await store.load_at("a", 1)).revision == 1  # what precedes it still reads
        assert (await store.load("b")).revision == 3


def test_checksum_encodes_type_and_length() -> None:
    assert checksum("effects", (1, 2, 0, 2, b"ab")) != checksum("effects", (1, 2, 0, 2, "ab"))
    assert checksum("batches", (1, 2, "s", 3, 4.0, 1, 2)) != checksum(
        "batches", (1, 2, "s", 3, 4, 1, 2)
    )
    assert checksum("snapshots", (1, 2, 2, b"x")) != checksum("effects", (1, 2, 2, b"x"))
    assert checksum("sessions", ("ab", 1)) != checksum("sessions", ("a", "b1"))
    assert checksum("sessions", (None,)) != checksum("sessions", (0,))
    with pytest.raises(TypeError, match="not an SQLite value"):
        checksum("sessions", ([],))
