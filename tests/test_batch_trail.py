"""Every shipped store keeps a batch's decision trail: ``refused`` and ``trace`` (issue 11).

A batch applied with refusals (the steps that refused before the deciding
step, and why) and a W3C ``traceparent`` comes back from ``store.batches()``
equal, on the memory, file, SQLite and PostgreSQL stores, after a reopen and
through a fork. The SQL stores keep both in two nullable columns of the batch
row, covered by its checksum from SQLite schema version 4 and PostgreSQL
schema version 2: older databases migrate in place and read their batches
with the defaults; a damaged ``refused`` value is a StoredDataError naming the
session and the revision, and nothing is rewritten.
"""

from __future__ import annotations

import hashlib
import itertools
import shutil
import sqlite3
from collections.abc import AsyncIterator, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import make_golden_sqlite as golden
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import AppendMessage, Codec, Effect, Message, Session, Store, StoredDataError
from stepmachine.extend import Batch, Refusal, apply_batch
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore
from stepmachine.stores import _sqlite_schema as sqlite_schema
from stepmachine.stores._sqlite_schema import checksum
from stepmachine.testing.conformance import ConformanceData, Increment

GOLDEN = Path(golden.__file__).resolve().parent / "golden" / "sqlite"
TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRAIL = (Refusal("inference", "no user message"), Refusal("tools", 'no "open" calls'))
BATCH_COLUMNS = (
    "sid, revision, step, cycle, timestamp, effect_count, schema_version, refused, trace"
)


def codec() -> Codec[ConformanceData]:
    return Codec(ConformanceData, effects=[Increment])


def batch_for(
    session: Session[Any],
    *effects: Effect,
    refused: tuple[Refusal, ...] = (),
    trace: str | None = None,
) -> Batch[Effect]:
    return Batch(
        session_id=session.id,
        revision=session.revision + 1,
        step="test",
        cycle=session.revision + 1,
        timestamp=1_700_000_000.5 + session.revision,
        effects=effects,
        refused=refused,
        trace=trace,
    )


async def advance(store: Store, session: Session[Any], batch: Batch[Effect]) -> Session[Any]:
    await store.apply(batch)
    return apply_batch(session, batch.effects)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def raw(path: Path) -> closing[sqlite3.Connection]:
    """A plain sqlite3 connection (autocommit), closed on exit."""
    return closing(sqlite3.connect(path, isolation_level=None))


# -- every store -------------------------------------------------------------------

KINDS = ["memory", "file", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


class Opener:
    """Opens the store of one kind on one place, as often as asked (a reopen)."""

    def __init__(self, kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        self.kind = kind
        self.memory: MemoryStore | None = None
        self.where = str(tmp_path / "store")
        if kind == "postgres":
            self.where = request.getfixturevalue("postgres_dsn")

    async def open(self) -> Any:
        if self.kind == "memory":  # a reopen is the same instance: it lives in memory only
            self.memory = self.memory or MemoryStore(codec())
            return self.memory
        if self.kind == "file":
            return await FileStore.open(self.where, codec(), fsync="never")
        if self.kind == "sqlite":
            return await SQLiteStore.open(self.where + ".db", codec())
        from stepmachine.stores import PostgresStore

        return await PostgresStore.open(self.where, codec())


@pytest.fixture(params=KINDS)
async def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Opener:
    return Opener(request.param, request, tmp_path)


@pytest.fixture
async def store(opener: Opener) -> AsyncIterator[Any]:
    made = await opener.open()
    try:
        yield made
    finally:
        await made.aclose()


_ids = itertools.count()

# Refusals as the machine writes them and as a third party might: any text
# (hypothesis's text never holds lone surrogates, which are not UTF-8).
refusals = st.lists(st.builds(Refusal, st.text(max_size=30), st.text(max_size=300)), max_size=4)
# A traceparent, or any text without NUL (PostgreSQL text cannot hold NUL; a
# traceparent is ASCII hex, so this is only a check that text is kept exactly).
traces = (
    st.none()
    | st.from_regex(r"00-[0-9a-f]{32}-[0-9a-f]{16}-0[01]", fullmatch=True)
    | st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=60)
)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(trails=st.lists(st.tuples(refusals.map(tuple), traces), min_size=1, max_size=4))
async def test_batches_return_refused_and_trace_as_applied(
    store: Any, trails: list[tuple[tuple[Refusal, ...], str | None]]
) -> None:
    session = await store.create(f"s-{next(_ids)}")
    sent = []
    for index, (refused, trace) in enumerate(trails):
        message = AppendMessage(Message.user(f"m {index}", id=f"m{index}"))
        batch = batch_for(session, message, Increment(), refused=refused, trace=trace)
        session = await advance(store, session, batch)
        sent.append(batch)
    assert await store.batches(session.id) == sent
    assert await store.load(session.id) == session


async def test_long_and_awkward_texts_survive_a_reopen_and_a_fork(opener: Opener) -> None:
    awkward = (
        Refusal("approval ✓ 承認", "quotes \" ' and \\ backslash, \x00 nul, \n newline"),
        Refusal("budget", "🚦" * 3000),
        Refusal("", ""),
    )
    store = await opener.open()
    try:
        session = await store.create("s")
        sent = []
        for refused, trace in [(awkward, TRACE), ((), None), (TRAIL, None), ((), TRACE)]:
            batch = batch_for(session, Increment(), refused=refused, trace=trace)
            session = await advance(store, session, batch)
            sent.append(batch)
    finally:
        await store.aclose()
    store = await opener.open()
    try:
        assert await store.batches("s") == sent
        assert await store.batches("s", after=2) == sent[2:]
        if opener.kind != "memory":  # MemoryStore has no fork
            forked = await store.fork("s", 3, "f")
            renamed = [msgspec.structs.replace(b, session_id="f") for b in sent[:3]]
            assert await store.batches("f") == renamed
            await store.apply(batch_for(forked, Increment(), refused=TRAIL, trace=TRACE))
            assert (await store.batches("f"))[-1].refused == TRAIL
    finally:
        await store.aclose()


# -- SQLite: the columns, the migration, damage ----------------------------------------


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "store.db"


async def test_sqlite_stores_compact_json_and_text_or_null(db: Path) -> None:
    async with await SQLiteStore.open(db, codec()) as store:
        session = await store.create("s")
        session = await advance(store, session, batch_for(session, Increment(), refused=TRAIL))
        await advance(store, session, batch_for(session, Increment(), trace=TRACE))
    with raw(db) as connection:
        rows = connection.execute(
            "SELECT revision, refused, trace, schema_version FROM batches ORDER BY revision"
        ).fetchall()
    assert rows == [
        (1, '[["inference","no user message"],["tools","no \\"open\\" calls"]]', None, 5),
        (2, None, TRACE, 5),
    ]


def columns(path: Path, table: str) -> list[str]:
    with raw(path) as connection:
        return [row[1] for row in connection.execute(f"PRAGMA table_info({table})")]


def versions(path: Path) -> list[int]:
    with raw(path) as connection:
        return [row[0] for row in connection.execute("SELECT version FROM schema_version")]


def rows_of_version_2_columns(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    with raw(path) as connection:
        return {
            table: connection.execute(
                f"SELECT {', '.join(names)}, crc FROM {table} ORDER BY 1, 2, 3"
            ).fetchall()
            for table, names in sqlite_schema.columns_at(2).items()
        }


@pytest.mark.parametrize("version", [1, 2, 3])
async def test_an_older_sqlite_database_migrates_and_reads_the_defaults(
    tmp_path: Path, version: int
) -> None:
    path = tmp_path / "store.db"
    shutil.copyfile(GOLDEN / golden.db_name(version), path)
    before = rows_of_version_2_columns(path) if version >= 2 else None
    gcodec = golden.make_codec()
    async with await SQLiteStore.open(path, gcodec) as store:  # migrates
        logs = {s: await store.batches(s) for s in await store.list_sessions()}
    assert versions(path) == [1, 2, 3, 4, 5]
    assert columns(path, "batches")[-3:] == ["refused", "trace", "body"]
    if before is not None:  # migrations 3 and 4 read and rewrite no row
        assert rows_of_version_2_columns(path) == before
    assert all(b.refused == () and b.trace is None for log in logs.values() for b in log)
    assert sum(map(len, logs.values())) > 100
    async with await SQLiteStore.open(path, gcodec) as store:
        beta = await store.load("beta")
        effects = (golden.Scored(2),)
        trailing = Batch("beta", beta.revision + 1, "x", 0, 1.8e9, effects, TRAIL, TRACE)
        await store.apply(trailing)
    async with await SQLiteStore.open(path, gcodec) as store:
        assert (await store.batches("beta"))[-1] == trailing
        assert await store.batches("beta", after=0) == [*logs["beta"], trailing]
        forked = await store.fork("beta", beta.revision + 1, "beta-fork")
        assert await store.batches("beta-fork") == [
            msgspec.structs.replace(b, session_id="beta-fork") for b in [*logs["beta"], trailing]
        ]
        assert forked.revision == beta.revision + 1
    with raw(path) as connection:
        nulls = connection.execute(
            "SELECT count(*) FROM batches WHERE schema_version < 4 "
            "AND (refused IS NOT NULL OR trace IS NOT NULL)"
        ).fetchone()
    assert nulls == (0,)


async def test_code_of_version_3_refuses_a_version_4_database_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "store.db"
    shutil.copyfile(GOLDEN / golden.db_name(4), path)
    monkeypatch.setattr(sqlite_schema, "SCHEMA_VERSION", 3)
    before = digest(path)
    with pytest.raises(StoredDataError, match=r"schema version 4.*up to 3.*left unchanged"):
        await SQLiteStore.open(path, golden.make_codec())
    assert digest(path) == before
    assert names(tmp_path) == ["store.db"]


@contextmanager
def damaged_row(db: Path, **values: Any) -> Iterator[None]:
    """Set columns of revision 1's batch row of session 's', with a matching crc."""
    with raw(db) as connection:
        query = f"SELECT {BATCH_COLUMNS}, body FROM batches WHERE revision = 1"
        row = list(connection.execute(query).fetchone())
        names = [*(name.strip() for name in BATCH_COLUMNS.split(",")), "body"]
        for name, value in values.items():
            row[names.index(name)] = value
        kept = sqlite_schema.row_columns("batches", row[6])  # the columns its crc covers
        covered = tuple(row[names.index(name)] for name in kept)
        assignments = ", ".join(f"{name} = ?" for name in values)
        connection.execute(
            f"UPDATE batches SET {assignments}, crc = ? WHERE revision = 1",
            (*values.values(), checksum("batches", covered)),
        )
    yield


async def _one_batch(db: Path) -> None:
    async with await SQLiteStore.open(db, codec()) as store:
        session = await store.create("s")
        await store.apply(batch_for(session, Increment(), refused=TRAIL, trace=TRACE))


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"refused": '[["tools"'}, "refused column.*not a list"),
        ({"refused": '[["a","b","c"]]'}, "refused column.*not a list"),
        ({"refused": '[["a",1]]'}, "refused column.*not a list"),
        ({"refused": '{"step":"a"}'}, "refused column.*not a list"),
        ({"refused": "[]"}, "refused column.*empty list"),
        ({"refused": b'[["a","b"]]'}, "column refused holds"),
        ({"refused": "7"}, "refused column.*not a list"),
        ({"trace": b"00-ab"}, "column trace holds"),
        ({"schema_version": 3}, "version 3 holds refused"),
    ],
    ids=[
        *("truncated", "three", "not-text", "object", "empty"),
        *("blob", "number", "blob-trace", "old"),
    ],
)
async def test_a_malformed_trail_is_stored_data_error_naming_the_batch(
    db: Path, values: dict[str, Any], problem: str
) -> None:
    await _one_batch(db)
    with damaged_row(db, **values):
        before = digest(db)
        async with await SQLiteStore.open(db, codec()) as store:
            with pytest.raises(StoredDataError, match=rf"'s' revision 1.*{problem}"):
                await store.batches("s")
            with pytest.raises(StoredDataError, match=r"'s'.*revision 1|revision 1.*'s'"):
                await store.load_at("s", 1)
            with pytest.raises(StoredDataError, match="'s'"):
                await store.fork("s", 1, "f")
        assert digest(db) == before


@pytest.mark.parametrize(
    "change",
    [
        "refused = replace(refused, 'tools', 'toolz')",
        "refused = NULL",
        "trace = replace(trace, '-01', '-00')",
        "trace = NULL",
    ],
)
async def test_the_checksum_covers_refused_and_trace(db: Path, change: str) -> None:
    await _one_batch(db)
    with raw(db) as connection:
        connection.execute(f"UPDATE batches SET {change} WHERE revision = 1")
    before = digest(db)
    async with await SQLiteStore.open(db, codec()) as store:
        with pytest.raises(StoredDataError, match=r"'s' revision 1 \(table batches\).*checksum"):
            await store.batches("s")
    assert digest(db) == before


# -- PostgreSQL: the columns, the migration from version 1, damage ---------------------

_PG_COLUMNS = {
    "sessions": "session_id, sid, revision, schema_version, snapshot_revision, snapshot_bytes, "
    "pending_bytes",
    "batches": "sid, revision, step, cycle, ts, effect_count, schema_version",
    "effects": "sid, revision, position, schema_version, body",
    "snapshots": "sid, revision, schema_version, body",
}


def sql(dsn: str, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Run one statement on its own connection (autocommit); its rows, if any."""
    psycopg = pytest.importorskip("psycopg")
    with psycopg.connect(dsn, autocommit=True) as conn:
        cursor = conn.execute(statement, params)
        return list(cursor.fetchall()) if cursor.description else []


def dump(dsn: str) -> list[Any]:
    """Every row of every store table, in order."""
    return [
        (
            table,
            [
                tuple(map(str, row))
                for row in sql(dsn, f"SELECT * FROM stepmachine.{table} ORDER BY 1, 2")
            ],
        )
        for table in ("schema_version", "sessions", "batches", "effects", "snapshots")
    ]


def as_version_1(dsn: str) -> None:
    """Make the database what PostgreSQL schema version 1 wrote: no refused and trace
    columns, every row of version 1 with the checksum version 1 computed."""
    sql(dsn, "ALTER TABLE stepmachine.batches DROP COLUMN refused, DROP COLUMN trace")
    sql(dsn, "DELETE FROM stepmachine.schema_version WHERE version > 1")
    for table, names in _PG_COLUMNS.items():
        keys = ["sid", "revision", "position"][: {"sessions": 1, "effects": 3}.get(table, 2)]
        for row in sql(dsn, f"SELECT {names} FROM stepmachine.{table}"):
            values = dict(zip(names.replace(" ", "").split(","), row, strict=True))
            values["schema_version"] = 1
            crc = checksum(table, tuple(values.values()))
            where = " AND ".join(f"{key} = %s" for key in keys)
            sql(
                dsn,
                f"UPDATE stepmachine.{table} SET schema_version = 1, crc = %s WHERE {where}",
                (crc, *(values[key] for key in keys)),
            )


@pytest.mark.postgres
async def test_postgres_migrates_version_1_and_reads_the_defaults(postgres_dsn: str) -> None:
    from stepmachine.stores import PostgresStore

    async with await PostgresStore.open(postgres_dsn, codec()) as store:
        session = await store.create("s")
        old = []
        for index in range(3):
            message = Message.user("hi", id=f"m{index}")
            batch = batch_for(session, AppendMessage(message), Increment())
            session = await advance(store, session, batch)
            old.append(batch)
    as_version_1(postgres_dsn)
    assert sql(postgres_dsn, "SELECT version FROM stepmachine.schema_version") == [(1,)]
    async with await PostgresStore.open(postgres_dsn, codec()) as store:  # migrates
        assert await store.batches("s") == old
        new = batch_for(session, Increment(), refused=TRAIL, trace=TRACE)
        session = await advance(store, session, new)
    versions = sql(postgres_dsn, "SELECT version FROM stepmachine.schema_version ORDER BY 1")
    assert versions == [(1,), (2,)]
    async with await PostgresStore.open(postgres_dsn, codec()) as store:
        assert await store.batches("s") == [*old, new]
        assert await store.load("s") == session
        await store.fork("s", 4, "f")
        assert await store.batches("f") == [
            msgspec.structs.replace(b, session_id="f") for b in [*old, new]
        ]
    rows = sql(
        postgres_dsn,
        "SELECT revision, schema_version, refused, trace FROM stepmachine.batches "
        "WHERE sid = (SELECT sid FROM stepmachine.sessions WHERE session_id = 'f') ORDER BY 1",
    )
    assert rows == [
        (1, 1, None, None),
        (2, 1, None, None),
        (3, 1, None, None),
        (4, 2, '[["inference","no user message"],["tools","no \\"open\\" calls"]]', TRACE),
    ]


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ("refused = %s, crc = %s", "refused column is not a list"),
        ("refused = %s", "checksum"),
        ("trace = replace(trace, '-01', '-00')", "checksum"),
        ("schema_version = 1, crc = %s", "version 1 holds refused"),
    ],
    ids=["malformed", "changed", "trace-changed", "old"],
)
async def test_postgres_fails_closed_on_a_damaged_trail(
    postgres_dsn: str, change: str, problem: str
) -> None:
    from stepmachine.stores import PostgresStore

    async with await PostgresStore.open(postgres_dsn, codec()) as store:
        session = await store.create("s")
        await store.apply(batch_for(session, Increment(), refused=TRAIL, trace=TRACE))
    (row,) = sql(postgres_dsn, f"SELECT {_PG_COLUMNS['batches']}, trace FROM stepmachine.batches")
    malformed = '[["tools"'
    params: tuple[Any, ...] = ()
    if change.startswith("refused"):
        crc = checksum("batches", (*row[:7], malformed, row[7]))
        params = (malformed, crc) if "crc" in change else (malformed,)
    elif change.startswith("schema_version"):
        params = (checksum("batches", (*row[:6], 1)),)
    sql(postgres_dsn, f"UPDATE stepmachine.batches SET {change}", params)
    before = dump(postgres_dsn)
    async with await PostgresStore.open(postgres_dsn, codec()) as store:
        with pytest.raises(StoredDataError, match=rf"'s' revision 1.*{problem}"):
            await store.batches("s")
        with pytest.raises(StoredDataError, match="'s'"):
            await store.fork("s", 1, "f")
    assert dump(postgres_dsn) == before
