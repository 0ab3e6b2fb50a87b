"""SQLiteStore migrates databases of schema versions 1 and 2 to the current version (issue 8,
item 2; version 3 to 4, the batches' refused and trace columns: ``test_batch_trail.py``).

The golden database written by schema version 1 (``golden/sqlite/store-v1.db``,
no checksums) is opened by the current code: it is migrated (through 2 and 3 to 4)
in one transaction, reads exactly the expected content, carries a valid
checksum on every row, accepts new batches, and reads the same after
reopening. A failing migration leaves version 1 as it was; a newer version is
refused untouched; a version-1 row the migration does not recognise still
fails closed. The golden version-2 database migrates to 3 without a row
changing, and code that knows only version 2 refuses a version-3 database
untouched (version 3 stores long effect records compressed).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import zlib
from contextlib import closing
from pathlib import Path
from typing import Any

import crash
import make_golden_sqlite as golden
import msgspec
import pytest

from stepmachine import Session, StoredDataError
from stepmachine.extend import Batch, Conversation, apply_batch
from stepmachine.stores import SQLiteStore
from stepmachine.stores import _sqlite_schema as schema
from stepmachine.stores._sqlite_schema import (
    COLUMNS,
    ROW_VERSIONS,
    SCHEMA_VERSION,
    checksum,
    columns_at,
    row_columns,
)

GOLDEN = Path(golden.__file__).resolve().parent / "golden" / "sqlite"
V1 = GOLDEN / golden.db_name(1)
V2 = GOLDEN / golden.db_name(2)
V3 = GOLDEN / golden.db_name(3)
V4 = GOLDEN / golden.db_name(4)
V5 = GOLDEN / golden.db_name(5)
MIGRATED = [1, 2, 3, 4, 5]
"""The schema_version table of a database at the current version."""
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


@pytest.fixture
def v2(tmp_path: Path) -> Path:
    """A copy of the golden version-2 database."""
    path = tmp_path / "store.db"
    shutil.copyfile(V2, path)
    return path


def versions(path: Path) -> list[int]:
    with raw(path) as connection:
        return [row[0] for row in connection.execute("SELECT version FROM schema_version")]


def columns_of(path: Path, table: str) -> list[str]:
    with raw(path) as connection:
        return [row[1] for row in connection.execute(f"PRAGMA table_info({table})")]


def bad_checksums(path: Path) -> dict[str, int]:
    """Per table, how many rows are not of a readable version with the checksum of their content."""
    bad: dict[str, int] = {}
    with raw(path) as connection:
        for table, names in COLUMNS.items():
            rows = connection.execute(f"SELECT {', '.join(names)}, crc FROM {table}").fetchall()
            assert rows, table
            bad[table] = 0
            for row in rows:
                version = row[names.index("schema_version")]
                covered = tuple(row[names.index(c)] for c in row_columns(table, version))
                bad[table] += version not in ROW_VERSIONS or checksum(table, covered) != row[-1]
    return bad


def row_versions(path: Path) -> dict[str, tuple[int, ...]]:
    """Per table, the distinct schema versions of its rows."""
    with raw(path) as connection:
        return {
            table: tuple(
                row[0]
                for row in connection.execute(
                    f"SELECT DISTINCT schema_version FROM {table} ORDER BY 1"
                )
            )
            for table in COLUMNS
        }


def every_row(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every store table (the columns of version 2), in a fixed order."""
    with raw(path) as connection:
        return {
            table: connection.execute(
                f"SELECT {', '.join(names)}, crc FROM {table} ORDER BY 1, 2, 3"
            ).fetchall()
            for table, names in columns_at(2).items()
        }


async def read_everything(path: Path) -> None:
    """Assert that the store at ``path`` holds exactly the golden content."""
    async with await SQLiteStore.open(path, golden.make_codec()) as store:
        assert await store.list_sessions() == sorted(EXPECTED["sessions"])
        for session_id, content in EXPECTED["sessions"].items():
            revisions = content["revisions"]
            assert as_json(await store.load(session_id)) == revisions[-1]
            for revision, session in enumerate(revisions):
                assert as_json(await store.load_at(session_id, revision)) == session
            assert as_json(await store.batches(session_id)) == [
                {**b, "refused": [], "trace": None} for b in content["batches"]
            ]  # fields added later decode as their defaults


def test_the_golden_database_is_version_1_without_checksums() -> None:
    assert versions(V1) == [1]
    for table in COLUMNS:
        assert "crc" not in columns_of(V1, table)
    assert SCHEMA_VERSION == 5


async def test_v1_is_migrated_verified_and_reopened(v1: Path) -> None:
    before = digest(V1)
    await read_everything(v1)  # the first open migrates
    assert versions(v1) == MIGRATED
    assert bad_checksums(v1) == dict.fromkeys(COLUMNS, 0)
    # Migration 2 marks every row version 2; migration 3 changes no row.
    assert row_versions(v1) == dict.fromkeys(COLUMNS, (2,))
    await read_everything(v1)  # reopened: nothing more to migrate, same content
    assert versions(v1) == MIGRATED
    assert digest(V1) == before  # the fixture itself is never touched


async def test_a_migrated_database_takes_new_batches(v1: Path) -> None:
    codec = golden.make_codec()
    async with await SQLiteStore.open(v1, codec) as store:
        beta = await store.load("beta")
        # The second record is long: the batch row's body is stored compressed.
        effects = (golden.Scored(5, "after migration"), golden.Scored(1, "long " * 100))
        await store.apply(Batch("beta", beta.revision + 1, "step-x", 0, 1.8e9, effects))
        fork = await store.fork("alpha", 6, "alpha-2")
    expected: Session[Any] = apply_batch(beta, effects)
    async with await SQLiteStore.open(v1, codec) as store:
        assert await store.load("beta") == expected
        assert await store.load("alpha-2") == fork
        assert len(await store.batches("alpha-2")) == 6
    assert bad_checksums(v1) == dict.fromkeys(COLUMNS, 0)
    with raw(v1) as connection:
        beta_sid = "(SELECT sid FROM sessions WHERE session_id = 'beta')"
        new_rows = connection.execute(
            "SELECT schema_version, effect_count, substr(body, 1, 1) FROM batches "
            f"WHERE revision = ? AND sid = {beta_sid}",
            (beta.revision + 1,),
        ).fetchall()
        new_effect_rows = connection.execute(
            f"SELECT count(*) FROM effects WHERE revision = ? AND sid = {beta_sid}",
            (beta.revision + 1,),
        ).fetchone()
    # The new batch is one row holding both effects (compressed), no effect rows.
    assert new_rows == [(5, 2, b"\x78")]
    assert new_effect_rows == (0,)
    # Old rows keep version 2 (the copies a fork makes too); new ones are version 5.
    assert row_versions(v1) == {**dict.fromkeys(COLUMNS, (2, 5)), "effects": (2,)}


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
    assert versions(v1) == MIGRATED


async def test_a_failed_last_migration_leaves_version_1(
    v1: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every migration of one open is one transaction: 3 failing undoes 2 as well."""
    monkeypatch.setitem(schema._MIGRATIONS, 3, ("INSERT INTO no_such_table VALUES (1)",))
    before = digest(v1)
    with pytest.raises(sqlite3.OperationalError, match="no_such_table"):
        await SQLiteStore.open(v1, golden.make_codec())
    assert versions(v1) == [1]
    assert row_versions(v1) == dict.fromkeys(COLUMNS, (1,))
    for table in COLUMNS:
        assert "crc" not in columns_of(v1, table)
    assert digest(v1) == before


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
    assert versions(v1) == MIGRATED


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
        assert versions(folder / "store.db") == MIGRATED, folder


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
        "DELETE FROM schema_version WHERE version >= 2",
        "UPDATE schema_version SET version = -version WHERE version >= 2",
    ],
)
async def test_a_damaged_version_table_of_a_migrated_database_is_stored_data_error(
    v1: Path, damage: str
) -> None:
    """The tables have crc but the version table says 1: refused, nothing re-migrated."""
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


# -- version 2 to 3 ------------------------------------------------------------------


def test_the_golden_databases_of_versions_2_and_3() -> None:
    """Version 2 stores every effect record as it is; version 3 compresses the long ones."""
    assert versions(V2) == [1, 2]
    assert versions(V3) == [1, 2, 3]
    with raw(V2) as connection:
        starts = connection.execute("SELECT DISTINCT substr(body, 1, 1) FROM effects").fetchall()
    assert starts == [(b"[",)]
    with raw(V3) as connection:
        compressed = connection.execute(
            "SELECT count(*) FROM effects WHERE substr(body, 1, 1) = x'78'"
        ).fetchone()
    assert compressed[0] > 0


async def test_v2_is_migrated_to_3_without_changing_a_row(v2: Path) -> None:
    before = every_row(v2)
    await read_everything(v2)  # the first open migrates
    assert versions(v2) == MIGRATED
    assert every_row(v2) == before  # migration 3 only records the version, 4 adds NULL columns
    assert row_versions(v2) == dict.fromkeys(COLUMNS, (2,))
    await read_everything(v2)  # reopened: nothing more to migrate
    assert versions(v2) == MIGRATED


async def test_a_failed_migration_leaves_version_2(
    v2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(schema._MIGRATIONS, 3, ("INSERT INTO no_such_table VALUES (1)",))
    before = digest(v2)
    with pytest.raises(sqlite3.OperationalError, match="no_such_table"):
        await SQLiteStore.open(v2, golden.make_codec())
    assert versions(v2) == [1, 2]
    assert digest(v2) == before
    monkeypatch.undo()
    await read_everything(v2)
    assert versions(v2) == MIGRATED


async def test_code_of_version_2_refuses_a_version_3_database_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a reader that knows only version 2 does with the golden version-3 database.

    Opening checks the version in ``_read_version`` before anything is
    written, the same code path as in version 2; only the constant differs.
    """
    db = tmp_path / "store.db"
    shutil.copyfile(V3, db)
    monkeypatch.setattr(schema, "SCHEMA_VERSION", 2)
    before = digest(db)
    with pytest.raises(StoredDataError, match=r"schema version 3.*up to 2.*left unchanged"):
        await SQLiteStore.open(db, golden.make_codec())
    assert digest(db) == before
    assert sorted(p.name for p in db.parent.iterdir()) == ["store.db"]
    monkeypatch.undo()
    await read_everything(db)  # and today's code reads it


async def test_a_compressed_effect_row_of_version_2_is_stored_data_error(v2: Path) -> None:
    """Version 2 never wrote a compressed effect record: such a row is corrupt, not read."""
    await read_everything(v2)  # migrated to 3; the rows stay version 2
    with raw(v2) as connection:
        (sid,) = connection.execute("SELECT sid FROM sessions WHERE session_id = 'beta'").fetchone()
        values = connection.execute(
            "SELECT sid, revision, position, schema_version, body FROM effects "
            "WHERE sid = ? AND revision = 2 AND position = 0",
            (sid,),
        ).fetchone()
        assert values[3] == 2
        body = zlib.compress(values[4])
        row = (*values[:4], body)
        connection.execute(
            "UPDATE effects SET body = ?, crc = ? WHERE sid = ? AND revision = 2 AND position = 0",
            (body, checksum("effects", row), sid),
        )
    before = digest(v2)
    async with await SQLiteStore.open(v2, golden.make_codec()) as store:
        with pytest.raises(
            StoredDataError, match=r"'beta' revision 2 effect 0.*schema version 2.*compressed"
        ):
            await store.batches("beta")
        with pytest.raises(StoredDataError, match=r"'beta' revision 2 effect 0"):
            await store.load_at("beta", 2)
        revisions = EXPECTED["sessions"]["beta"]["revisions"]
        assert as_json(await store.load_at("beta", 1)) == revisions[1]
    assert digest(v2) == before  # nothing rewritten


# -- version 4 to 5 ------------------------------------------------------------------


@pytest.fixture
def v4(tmp_path: Path) -> Path:
    """A copy of the golden version-4 database (written by the code before version 5)."""
    path = tmp_path / "store.db"
    shutil.copyfile(V4, path)
    return path


def test_the_golden_databases_of_versions_4_and_5() -> None:
    """Version 4 keeps a batch's effects in effect rows; version 5 in the batch row."""
    assert versions(V4) == [1, 2, 3, 4]
    assert "body" not in columns_of(V4, "batches")
    assert versions(V5) == MIGRATED
    with raw(V5) as connection:
        assert connection.execute("SELECT count(*) FROM effects").fetchone() == (0,)
        kinds = connection.execute(
            "SELECT DISTINCT schema_version, substr(body, 1, 1) FROM batches ORDER BY 2"
        ).fetchall()
    assert kinds == [(5, b"["), (5, b"\x78")]  # short bodies as they are, long ones compressed


async def test_v4_is_migrated_to_5_without_changing_a_row(v4: Path) -> None:
    before = every_row(v4)
    with raw(v4) as connection:
        effect_rows = connection.execute("SELECT count(*) FROM effects").fetchone()[0]
    assert effect_rows > 100
    await read_everything(v4)  # the first open migrates
    assert versions(v4) == MIGRATED
    assert columns_of(v4, "batches")[-1] == "body"
    assert every_row(v4) == before  # migration 5 adds a NULL column, reads and rewrites nothing
    assert row_versions(v4) == dict.fromkeys(COLUMNS, (4,))
    assert bad_checksums(v4) == dict.fromkeys(COLUMNS, 0)
    await read_everything(v4)  # reopened: nothing more to migrate
    assert versions(v4) == MIGRATED


async def test_a_migrated_v4_database_keeps_working_across_both_layouts(v4: Path) -> None:
    """Read, append, the audit log, load_at and fork over a log that is half version-4
    rows (effects in the effects table) and half version-5 rows (effects in the batch row)."""
    codec = golden.make_codec()
    async with await SQLiteStore.open(v4, codec) as store:
        alpha = await store.load("alpha")
        old_log = await store.batches("alpha")
        appended: list[Batch[Any]] = []
        session = alpha
        for index, effects in enumerate(
            [
                (golden.Scored(2, "after migration"),),
                (golden.Scored(1, "long " * 100), golden.Scored(3)),
                (),
            ]
        ):
            batch = Batch("alpha", session.revision + 1, f"new-{index}", 1, 1.8e9 + index, effects)
            session = await store.apply(batch)
            appended.append(batch)
    async with await SQLiteStore.open(v4, codec) as store:  # a fresh cache: read from disk
        assert await store.load("alpha") == session
        log = await store.batches("alpha")
        assert log == [*old_log, *appended]
        assert await store.batches("alpha", after=alpha.revision - 1) == log[alpha.revision - 1 :]
        expected = alpha
        for batch in appended:
            expected = apply_batch(expected, batch.effects)
            assert await store.load_at("alpha", batch.revision) == expected
        assert (
            as_json(await store.load_at("alpha", 3))
            == (EXPECTED["sessions"]["alpha"]["revisions"][3])
        )
        forked = await store.fork("alpha", session.revision, "alpha-both")
        assert forked == msgspec.structs.replace(session, id="alpha-both")
        assert await store.batches("alpha-both") == [
            msgspec.structs.replace(b, session_id="alpha-both") for b in log
        ]
        assert await store.load_at("alpha-both", 2) == msgspec.structs.replace(
            await store.load_at("alpha", 2), id="alpha-both"
        )
    assert bad_checksums(v4) == dict.fromkeys(COLUMNS, 0)
    assert row_versions(v4) == {**dict.fromkeys(COLUMNS, (4, 5)), "effects": (4,)}
    with raw(v4) as connection:
        new = connection.execute(
            "SELECT count(*) FROM effects WHERE revision > ? "
            "AND sid = (SELECT sid FROM sessions WHERE session_id = 'alpha')",
            (alpha.revision,),
        ).fetchone()
    assert new == (0,)  # the new batches wrote no effect rows


async def test_a_failed_migration_leaves_version_4(
    v4: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = (*schema._MIGRATIONS[5], "INSERT INTO no_such_table VALUES (1)")
    monkeypatch.setitem(schema._MIGRATIONS, 5, failing)
    before = digest(v4)
    with pytest.raises(sqlite3.OperationalError, match="no_such_table"):
        await SQLiteStore.open(v4, golden.make_codec())
    assert versions(v4) == [1, 2, 3, 4]
    assert "body" not in columns_of(v4, "batches")  # the ALTER TABLE was rolled back too
    assert digest(v4) == before
    monkeypatch.undo()
    await read_everything(v4)
    assert versions(v4) == MIGRATED


async def test_code_of_version_4_refuses_a_version_5_database_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a reader that knows only version 4 does with a version-5 database: refused on
    open, before reading a row whose effects it would not find, and left as it was."""
    db = tmp_path / "store.db"
    shutil.copyfile(V5, db)
    monkeypatch.setattr(schema, "SCHEMA_VERSION", 4)
    before = digest(db)
    with pytest.raises(
        StoredDataError, match=r"schema version 5.*up to 4\. Upgrade stepmachine.*left unchanged"
    ):
        await SQLiteStore.open(db, golden.make_codec())
    assert digest(db) == before
    assert sorted(p.name for p in db.parent.iterdir()) == ["store.db"]
    monkeypatch.undo()
    await read_everything(db)  # and today's code reads it


async def test_a_version_4_row_holding_a_body_is_stored_data_error(v4: Path) -> None:
    """A version-4 batch row never held a body: one that does is damage, not read."""
    await read_everything(v4)  # migrated to 5; the rows stay version 4
    with raw(v4) as connection:
        connection.execute(
            "UPDATE batches SET body = x'5b5d' WHERE revision = 2 "
            "AND sid = (SELECT sid FROM sessions WHERE session_id = 'beta')"
        )
    before = digest(v4)
    async with await SQLiteStore.open(v4, golden.make_codec()) as store:
        with pytest.raises(StoredDataError, match=r"'beta' revision 2.*version 4 holds a body"):
            await store.batches("beta")
        revisions = EXPECTED["sessions"]["beta"]["revisions"]
        assert as_json(await store.load_at("beta", 1)) == revisions[1]
    assert digest(v4) == before


@pytest.mark.parametrize(
    "damage",
    [
        "ALTER TABLE batches ADD COLUMN body BLOB",  # says 4, has version 5's column
        "INSERT INTO schema_version VALUES (5, 0)",  # says 5, lacks its column
    ],
    ids=["v4-with-body", "v5-without-body"],
)
async def test_a_version_table_that_does_not_match_the_batches_table_is_refused(
    v4: Path, damage: str
) -> None:
    """Migration 5 is not run over a table that already has its column, nor a database
    read as version 5 whose batches have nowhere to keep their effects: refused on open,
    with what is wrong, and left as it was."""
    with raw(v4) as connection:
        connection.execute(damage)
    before = digest(v4)
    with pytest.raises(
        StoredDataError, match=r"schema_version table says version [45].*'batches'.*left unchanged"
    ):
        await SQLiteStore.open(v4, golden.make_codec())
    assert digest(v4) == before
    assert sorted(p.name for p in v4.parent.iterdir()) == ["store.db"]
