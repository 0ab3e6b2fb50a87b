"""SQLiteStore migrates a schema version 1 database to version 2 (issue 8, item 2).

The golden database written by schema version 1 (``golden/sqlite/store-v1.db``,
no checksums) is opened by the current code: it is migrated in one
transaction, reads exactly the expected content, carries a valid checksum on
every row, accepts new batches, and reads the same after reopening. A
failing migration leaves version 1 as it was; a newer version is refused
untouched; a version-1 row the migration does not recognise still fails
closed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import crash
import make_golden_sqlite as golden
import msgspec
import pytest

from stepmachine import Batch, Conversation, Session, StoredDataError, apply_batch
from stepmachine.stores import SQLiteStore
from stepmachine.stores import _sqlite_schema as schema
from stepmachine.stores._sqlite_schema import COLUMNS, SCHEMA_VERSION, checksum

GOLDEN = Path(golden.__file__).resolve().parent / "golden" / "sqlite"
V1 = GOLDEN / golden.db_name(1)
EXPECTED: dict[str, Any] = json.loads((GOLDEN / "expected.json").read_text(encoding="utf-8"))


def raw(path: Path) -> closing[sqlite3.Connection]:
    """A plain sqlite3 connection (autocommit), closed (and checkpointed) on exit."""
    return closing(sqlite3.connect(path, isolation_level=None))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def as_json(value: Any) -> Any:
    return json.loads(msgspec.json.encode(value, enc_hook=Conversation.enc_hook))


@pytest.fixture
def v1(tmp_path: Path) -> Path:
    """A copy of the golden version-1 database."""
    path = tmp_path / "store.db"
    shutil.copyfile(V1, path)
    return path


def versions(path: Path) -> list[int]:
    with raw(path) as connection:
        return [row[0] for row in connection.execute("SELECT version FROM schema_version")]


def columns_of(path: Path, table: str) -> list[str]:
    with raw(path) as connection:
        return [row[1] for row in connection.execute(f"PRAGMA table_info({table})")]


def bad_checksums(path: Path) -> dict[str, int]:
    """Per table, how many rows are not version 2 with the checksum of their content."""
    bad: dict[str, int] = {}
    with raw(path) as connection:
        for table, names in COLUMNS.items():
            rows = connection.execute(f"SELECT {', '.join(names)}, crc FROM {table}").fetchall()
            assert rows, table
            bad[table] = sum(
                row[names.index("schema_version")] != 2 or checksum(table, row[:-1]) != row[-1]
                for row in rows
            )
    return bad


async def read_everything(path: Path) -> None:
    """Assert that the store at ``path`` holds exactly the golden content."""
    async with await SQLiteStore.open(path, golden.make_codec()) as store:
        assert await store.list_sessions() == sorted(EXPECTED["sessions"])
        for session_id, content in EXPECTED["sessions"].items():
            revisions = content["revisions"]
            assert as_json(await store.load(session_id)) == revisions[-1]
            for revision, session in enumerate(revisions):
                assert as_json(await store.load_at(session_id, revision)) == session
            assert as_json(await store.batches(session_id)) == content["batches"]


def test_the_golden_database_is_version_1_without_checksums() -> None:
    assert versions(V1) == [1]
    for table in COLUMNS:
        assert "crc" not in columns_of(V1, table)
    assert SCHEMA_VERSION == 2


async def test_v1_is_migrated_verified_and_reopened(v1: Path) -> None:
    before = digest(V1)
    await read_everything(v1)  # the first open migrates
    assert versions(v1) == [1, 2]
    assert bad_checksums(v1) == dict.fromkeys(COLUMNS, 0)
    await read_everything(v1)  # reopened: nothing more to migrate, same content
    assert versions(v1) == [1, 2]
    assert digest(V1) == before  # the fixture itself is never touched


async def test_a_migrated_database_takes_new_batches(v1: Path) -> None:
    codec = golden.make_codec()
    async with await SQLiteStore.open(v1, codec) as store:
        beta = await store.load("beta")
        effects = (golden.Scored(5, "after migration"),)
        await store.apply(Batch("beta", beta.revision + 1, "step-x", 0, 1.8e9, effects))
        fork = await store.fork("alpha", 6, "alpha-2")
    expected: Session[Any] = apply_batch(beta, effects)
    async with await SQLiteStore.open(v1, codec) as store:
        assert await store.load("beta") == expected
        assert await store.load("alpha-2") == fork
        assert len(await store.batches("alpha-2")) == 6
    assert bad_checksums(v1) == dict.fromkeys(COLUMNS, 0)


async def test_a_failed_migration_leaves_version_1(
    v1: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = (*schema._MIGRATIONS[2], "INSERT INTO no_such_table VALUES (1)")
    monkeypatch.setitem(schema._MIGRATIONS, 2, failing)
    with pytest.raises(sqlite3.OperationalError, match="no_such_table"):
        await SQLiteStore.open(v1, golden.make_codec())
    assert versions(v1) == [1]
    for table in COLUMNS:
        assert "crc" not in columns_of(v1, table)
    monkeypatch.undo()
    await read_everything(v1)  # and the next open migrates it
    assert versions(v1) == [1, 2]


@pytest.mark.parametrize("newer", [SCHEMA_VERSION + 1, 99])
async def test_a_newer_version_is_refused_untouched(v1: Path, newer: int) -> None:
    with raw(v1) as connection:
        connection.execute("INSERT INTO schema_version VALUES (?, 0)", (newer,))
    before = digest(v1)
    with pytest.raises(StoredDataError, match=f"schema version {newer}.*up to {SCHEMA_VERSION}"):
        await SQLiteStore.open(v1, golden.make_codec())
    assert digest(v1) == before
    assert sorted(p.name for p in v1.parent.iterdir()) == ["store.db"]


async def test_a_v1_row_of_another_version_is_not_blessed(v1: Path) -> None:
    with raw(v1) as connection:
        connection.execute("UPDATE effects SET schema_version = 7 WHERE revision = 3")
    async with await SQLiteStore.open(v1, golden.make_codec()) as store:
        with pytest.raises(StoredDataError, match="'alpha' revision 3 effect 0"):
            await store.load_at("alpha", 3)
        with pytest.raises(StoredDataError, match="'beta' revision 3 effect 0"):
            await store.batches("beta")
        assert as_json(await store.load("empty")) == EXPECTED["sessions"]["empty"]["revisions"][-1]


async def test_v1_text_that_is_not_utf8_migrates_and_fails_closed(v1: Path) -> None:
    with raw(v1) as connection:
        connection.execute(
            "UPDATE batches SET step = CAST(x'ff73746570' AS TEXT) WHERE revision = 2 "
            "AND sid = (SELECT sid FROM sessions WHERE session_id = 'beta')"
        )
    async with await SQLiteStore.open(v1, golden.make_codec()) as store:
        with pytest.raises(StoredDataError, match=r"'beta' revision 2.*not UTF-8"):
            await store.batches("beta")
        assert await store.list_sessions() == sorted(EXPECTED["sessions"])
    assert versions(v1) == [1, 2]


def test_crash_harness_from_v1_loses_nothing(tmp_path: Path) -> None:
    summary = crash.run(
        "sqlite",
        rounds=1,
        max_per_boundary=1,
        random_kills=1,
        seed=3,
        jobs=2,
        workdir=tmp_path,
        echo=False,
        from_v1=True,
    )
    report = "\n".join(summary.lines())
    assert summary.crash_points >= len(summary.boundaries), report
    assert (summary.lost, summary.half_applied, summary.invalid) == (0, 0, 0), report
    assert summary.ok, report
    # Every point started from the golden version-1 database and migrated it.
    for folder in tmp_path.iterdir():
        assert versions(folder / "store.db") == [1, 2], folder


async def test_crash_harness_notices_a_changed_golden_session(v1: Path) -> None:
    assert await crash.golden_problems("sqlite", v1.parent) == []
    async with await SQLiteStore.open(v1, golden.make_codec()) as store:
        beta = await store.load("beta")
        await store.apply(Batch("beta", beta.revision + 1, "x", 0, 0.0, (golden.Scored(1),)))
    problems = await crash.golden_problems("sqlite", v1.parent)
    assert problems == [
        "golden session 'beta' differs from expected.json",
        "golden session 'beta': its log differs",
    ]


@pytest.mark.parametrize(
    "damage",
    [
        "DELETE FROM schema_version WHERE version = 2",
        "UPDATE schema_version SET version = 0 WHERE version = 2",
    ],
)
async def test_a_damaged_version_table_of_a_migrated_database_is_stored_data_error(
    v1: Path, damage: str
) -> None:
    """The tables say version 2 but the version table says less: refused, nothing re-migrated."""
    await read_everything(v1)  # migrated
    with raw(v1) as connection:
        connection.execute(damage)
    before = digest(v1)
    with pytest.raises(StoredDataError, match=r"schema_version table.*crc"):
        await SQLiteStore.open(v1, golden.make_codec())
    assert digest(v1) == before
    assert sorted(p.name for p in v1.parent.iterdir()) == ["store.db"]


async def test_a_v1_database_whose_version_row_says_2_is_stored_data_error(v1: Path) -> None:
    """A version-1 file whose version row was damaged into 2 has no checksums: refused on open."""
    with raw(v1) as connection:
        connection.execute("UPDATE schema_version SET version = 2")
    before = digest(v1)
    with pytest.raises(StoredDataError, match=r"schema_version table.*crc"):
        await SQLiteStore.open(v1, golden.make_codec())
    assert digest(v1) == before


@pytest.mark.parametrize(
    "new_text",
    [
        "'schema_vession INTEGER'",  # a column renamed by a flipped bit: reads failed later
        "'position INTEGER, extra INTEGER'",  # a column too many
        "'revision, ' || CAST(X'70E9' AS TEXT) || ')'",  # invalid UTF-8 in SQLite's message
    ],
    ids=["renamed-column", "extra-column", "invalid-utf8"],
)
async def test_a_damaged_table_definition_is_stored_data_error_on_open(
    v1: Path, new_text: str
) -> None:
    """Damage in ``sqlite_master`` is refused on open as StoredDataError, not later as
    ``OperationalError`` ("no such column") nor as a ``UnicodeDecodeError``."""
    await read_everything(v1)  # migrated
    old_text = {
        "'schema_vession INTEGER'": "schema_version INTEGER",
        "'position INTEGER, extra INTEGER'": "position INTEGER",
    }.get(new_text, "revision, position)")
    with raw(v1) as connection:
        connection.execute("PRAGMA writable_schema = ON")
        connection.execute(
            f"UPDATE sqlite_master SET sql = replace(sql, '{old_text}', {new_text}) "
            "WHERE name = 'effects'"
        )
    with pytest.raises(StoredDataError, match=r"store\.db"):
        await SQLiteStore.open(v1, golden.make_codec())
