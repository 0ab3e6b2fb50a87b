"""PostgresStore on a real PostgreSQL server (a fresh database per test).

The store conformance suite, plus what is PostgreSQL's own: a newer schema
refused untouched, a damaged row failing closed with nothing rewritten, two
stores (two pools) on one database never losing an update, the
compare-and-set and the batch in one transaction.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from stepmachine import (
    AppendMessage,
    Codec,
    ConflictError,
    Effect,
    Message,
    ReplaceConversation,
    Session,
    SessionExistsError,
    Store,
    StoredDataError,
)
from stepmachine.extend import Batch, apply_batch
from stepmachine.stores import PostgresStore
from stepmachine.stores._postgres_schema import SCHEMA_VERSION
from stepmachine.testing.conformance import ConformanceData, Increment, StoreConformance

psycopg = pytest.importorskip("psycopg", reason="psycopg is not installed (the postgres extra)")


def codec() -> Codec[ConformanceData]:
    return Codec(ConformanceData, effects=[Increment])


def batch_for(session: Session[Any], *effects: Effect) -> Batch[Effect]:
    return Batch(
        session_id=session.id,
        revision=session.revision + 1,
        step="test",
        cycle=session.revision + 1,
        timestamp=1_700_000_000.0 + session.revision,
        effects=tuple(effects),
    )


async def advance(store: Store, session: Session[Any], *effects: Effect) -> Session[Any]:
    await store.apply(batch_for(session, *effects))
    return apply_batch(session, effects)


def sql(dsn: str, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Run one statement on its own connection (autocommit); its rows, if any."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        cursor = conn.execute(statement, params)
        return list(cursor.fetchall()) if cursor.description else []


def dump(dsn: str) -> list[Any]:
    """Every row of every store table, in order: what "left unchanged" compares."""
    tables = ["schema_version", "sessions", "batches", "effects", "snapshots"]
    out: list[Any] = []
    for table in tables:
        rows = sql(dsn, f"SELECT * FROM stepmachine.{table} ORDER BY 1, 2")
        out.append((table, [tuple(str(v) for v in row) for row in rows]))
    return out


class TestPostgresStore(StoreConformance):
    @pytest.fixture
    async def store(self, postgres_dsn: str) -> AsyncIterator[Store]:  # type: ignore[override]
        made = await PostgresStore.open(postgres_dsn, codec())
        try:
            yield made
        finally:
            await made.aclose()


@pytest.fixture
def dsn(postgres_dsn: str) -> str:
    return postgres_dsn


# -- schema ----------------------------------------------------------------------


async def test_a_newer_schema_is_refused_untouched(dsn: str) -> None:
    async with await PostgresStore.open(dsn, codec()) as store:
        session = await store.create("s")
        await advance(store, session, Increment())
    newer = SCHEMA_VERSION + 1
    sql(dsn, "INSERT INTO stepmachine.schema_version (version) VALUES (%s)", (newer,))
    before = dump(dsn)
    with pytest.raises(StoredDataError, match=f"schema version {newer}") as info:
        await PostgresStore.open(dsn, codec())
    assert "left unchanged" in str(info.value)
    assert dump(dsn) == before


async def test_a_foreign_stepmachine_schema_is_refused_untouched(dsn: str) -> None:
    sql(dsn, "CREATE SCHEMA stepmachine")
    sql(dsn, "CREATE TABLE stepmachine.sessions (x int)")
    with pytest.raises(StoredDataError, match="not a stepmachine store"):
        await PostgresStore.open(dsn, codec())
    tables = sql(dsn, "SELECT tablename FROM pg_tables WHERE schemaname = 'stepmachine'")
    assert tables == [("sessions",)]


async def test_stores_opening_a_new_database_at_once_create_the_schema_once(dsn: str) -> None:
    stores: list[PostgresStore] = []

    async def open_one() -> None:
        stores.append(await PostgresStore.open(dsn, codec()))

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(open_one)
    for store in stores:
        await store.aclose()
    versions = sql(dsn, "SELECT version FROM stepmachine.schema_version ORDER BY 1")
    assert versions == [(v,) for v in range(1, SCHEMA_VERSION + 1)]


async def test_import_needs_no_psycopg_until_open() -> None:
    import sys

    code = (
        "import sys; sys.modules['psycopg'] = None; sys.modules['psycopg_pool'] = None\n"
        "import anyio, stepmachine.stores as s\n"
        "from stepmachine import ConfigurationError\n"
        "async def main():\n"
        "    try:\n"
        "        await s.PostgresStore.open('postgresql://x/y')\n"
        "    except ConfigurationError as exc:\n"
        "        print('refused:', exc)\n"
        "anyio.run(main)\n"
    )
    done = await anyio.run_process([sys.executable, "-c", code], check=True)
    assert "stepmachine[postgres]" in done.stdout.decode()


# -- damage --------------------------------------------------------------------


async def test_a_damaged_effect_row_fails_closed_and_is_not_rewritten(dsn: str) -> None:
    async with await PostgresStore.open(dsn, codec()) as store:
        session = await store.create("s")
        session = await advance(store, session, AppendMessage(Message.user("one", id="m1")))
        await advance(store, session, AppendMessage(Message.user("two", id="m2")))
    # One flipped bit in the body of revision 2's effect.
    sql(
        dsn,
        "UPDATE stepmachine.effects SET body = set_byte(body, 3, get_byte(body, 3) # 1) "
        "WHERE revision = 2",
    )
    before = dump(dsn)
    async with await PostgresStore.open(dsn, codec()) as store:
        for read in (store.load("s"), store.batches("s")):
            with pytest.raises(StoredDataError) as info:
                await read
            message = str(info.value)
            assert "session 's'" in message
            assert "revision 2" in message
            assert "checksum" in message
        assert (await store.load_at("s", 1)).revision == 1  # before the damage: readable
        with pytest.raises(StoredDataError):
            await store.apply(batch_for(session, Increment()))
    assert dump(dsn) == before


async def test_a_damaged_session_row_fails_closed(dsn: str) -> None:
    async with await PostgresStore.open(dsn, codec()) as store:
        await store.create("s")
    sql(dsn, "UPDATE stepmachine.sessions SET revision = 7")
    before = dump(dsn)
    async with await PostgresStore.open(dsn, codec()) as store:
        with pytest.raises(StoredDataError, match=r"session 's'.*sessions"):
            await store.load("s")
        with pytest.raises(StoredDataError, match="checksum"):
            await store.list_sessions()
    assert dump(dsn) == before


# -- two stores, one database ------------------------------------------------------


async def test_two_stores_no_lost_update(dsn: str) -> None:
    async with (
        await PostgresStore.open(dsn, codec()) as first,
        await PostgresStore.open(dsn, codec()) as second,
    ):
        session = await first.create("s")
        assert await second.load("s") == session
        mine = await advance(first, session, Increment(1))
        with pytest.raises(ConflictError) as info:
            await second.apply(batch_for(session, Increment(100)))
        assert (info.value.expected, info.value.actual) == (0, 1)
        assert await second.load("s") == mine
        # The stale one, caught up, writes on top; the first sees it.
        theirs = await advance(second, mine, Increment(10))
        assert await first.load("s") == theirs
        assert theirs.data.counter == 11


async def test_two_stores_concurrent_writers_lose_nothing(dsn: str) -> None:
    writers, per_writer = 6, 10
    async with (
        await PostgresStore.open(dsn, codec()) as first,
        await PostgresStore.open(dsn, codec(), max_size=2) as second,
    ):
        await first.create("shared")
        acknowledged: list[str] = []

        async def writer(store: PostgresStore, number: int) -> None:
            for index in range(per_writer):
                while True:
                    current = await store.load("shared")
                    message = Message.user(f"{number}.{index}", id=f"m-{number}-{index}")
                    try:
                        await store.apply(batch_for(current, AppendMessage(message), Increment()))
                    except ConflictError:
                        continue
                    acknowledged.append(message.id)
                    break

        async with anyio.create_task_group() as tg:
            for number in range(writers):
                tg.start_soon(writer, first if number % 2 else second, number)
        final = await first.load("shared")
        assert final == await second.load("shared")
    total = writers * per_writer
    assert final.revision == total
    assert final.data.counter == total
    assert sorted(m.id for m in final.conversation) == sorted(acknowledged)


# -- one transaction ---------------------------------------------------------------


async def test_the_compare_and_set_and_the_rows_are_one_transaction(dsn: str) -> None:
    seen: dict[str, list[Any]] = {}

    def hook(name: str) -> None:
        if name == "apply.inserted":  # rows written, not committed: invisible outside
            seen["revision"] = sql(dsn, "SELECT revision FROM stepmachine.sessions")
            seen["batches"] = sql(dsn, "SELECT count(*) FROM stepmachine.batches")
            seen["effects"] = sql(dsn, "SELECT count(*) FROM stepmachine.effects")
            raise RuntimeError("killed before COMMIT")

    async with await PostgresStore.open(dsn, codec(), boundary_hook=hook) as store:
        session = await store.create("s")
        with pytest.raises(RuntimeError, match="before COMMIT"):
            await store.apply(batch_for(session, Increment(), Increment()))
        assert seen == {"revision": [(0,)], "batches": [(0,)], "effects": [(0,)]}
        assert await store.load("s") == session
        assert await store.batches("s") == []
    assert sql(dsn, "SELECT count(*) FROM stepmachine.effects") == [(0,)]
    async with await PostgresStore.open(dsn, codec()) as store:
        assert (await advance(store, session, Increment())).revision == 1
        assert (await store.load("s")).revision == 1


def test_transactions_pick_their_isolation_whatever_the_server_default(dsn: str) -> None:
    from stepmachine.stores._postgres_schema import transaction

    sql(
        dsn,
        "DO $$ BEGIN EXECUTE format('ALTER DATABASE %%I SET "
        "default_transaction_isolation = serializable', current_database()); END $$",
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        settings = (
            "SELECT current_setting('transaction_isolation'), "
            "current_setting('transaction_read_only')"
        )
        with transaction(conn, write=False):
            assert conn.execute(settings).fetchone() == ("repeatable read", "on")
        with transaction(conn, write=True):
            assert conn.execute(settings).fetchone() == ("read committed", "off")


# -- damage, at random -------------------------------------------------------------

# (table, key columns, the columns a flip may hit: name -> kind). Keys are not
# flipped (the flip is undone by key); a row moved elsewhere fails the same crc.
_DAMAGEABLE = {
    "sessions": (("sid",), {"revision": "int", "snapshot_revision": "int", "pending_bytes": "int"}),
    "batches": (("sid", "revision"), {"cycle": "int", "effect_count": "int", "ts": "float"}),
    "effects": (("sid", "revision", "position"), {"body": "bytes", "schema_version": "int"}),
    "snapshots": (("sid", "revision"), {"body": "bytes", "schema_version": "int"}),
}


def _flip(dsn: str, table: str, key: tuple[Any, ...], column: str, bit: int) -> int:
    """XOR one bit of ``column`` in the row ``key`` of ``table`` (twice restores it)."""
    names, kinds = _DAMAGEABLE[table]
    where = " AND ".join(f"{name} = %s" for name in names)
    if kinds[column] == "bytes":
        change = f"{column} = set_bit({column}, mod(%s, 8 * length({column})), "
        change += f"1 - get_bit({column}, mod(%s, 8 * length({column}))))"
        params: tuple[Any, ...] = (bit, bit, *key)
    elif kinds[column] == "float":  # a different float: the sign
        change, params = f"{column} = -{column}", key
    else:
        change, params = f"{column} = {column} # %s", (1 << (bit % 20), *key)
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            f"UPDATE stepmachine.{table} SET {change} WHERE {where}", params
        ).rowcount


async def _reads(store: PostgresStore) -> dict[str, Any]:
    """Everything readable, each read on its own: a value or "StoredDataError"."""
    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "list": store.list_sessions,
        "load a": lambda: store.load("a"),
        "load b": lambda: store.load("b"),
        "batches a": lambda: store.batches("a"),
        **{f"load_at a {r}": (lambda r=r: store.load_at("a", r)) for r in range(4)},
    }
    out: dict[str, Any] = {}
    for name, call in calls.items():
        try:
            out[name] = await call()
        except StoredDataError:
            out[name] = "StoredDataError"
    return out


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
def test_flipped_bits_never_read_as_different_data(dsn: str, anyio_backend: str) -> None:
    """Invariant 8: one flipped bit in any checked column of any row is refused or harmless."""

    async def setup() -> dict[str, Any]:
        async with await PostgresStore.open(dsn, codec()) as store:
            for session_id in ("a", "b"):
                session = await store.create(session_id)
                for index in range(3):
                    message = Message.user(f"transfer {index}00 EUR " * 20, id=f"m{index}")
                    session = await advance(store, session, AppendMessage(message), Increment())
            return await _reads(store)

    expected = anyio.run(setup, backend=anyio_backend)
    keys = {
        table: sql(dsn, f"SELECT {', '.join(names)} FROM stepmachine.{table} ORDER BY 1")
        for table, (names, _) in _DAMAGEABLE.items()
    }

    async def read_all() -> dict[str, Any]:
        async with await PostgresStore.open(dsn, codec()) as store:
            return await _reads(store)

    @settings(max_examples=25, deadline=None, derandomize=True)
    @given(data=st.data())
    def flip_one(data: st.DataObject) -> None:
        table = data.draw(st.sampled_from(sorted(_DAMAGEABLE)))
        key = data.draw(st.sampled_from(keys[table]))
        column = data.draw(st.sampled_from(sorted(_DAMAGEABLE[table][1])))
        bit = data.draw(st.integers(0, 4000))
        assert _flip(dsn, table, key, column, bit) == 1
        try:
            got = anyio.run(read_all, backend=anyio_backend)
        finally:
            assert _flip(dsn, table, key, column, bit) == 1
        for name, value in got.items():
            assert value in (expected[name], "StoredDataError"), (table, key, column, name)
        assert any(value == "StoredDataError" for value in got.values()), (table, key, column)

    flip_one()
    assert anyio.run(read_all, backend=anyio_backend) == expected


async def test_fork_refuses_to_copy_a_damaged_row(dsn: str) -> None:
    async with await PostgresStore.open(dsn, codec()) as store:
        session = await store.create("a")
        for _ in range(3):
            session = await advance(store, session, Increment())
    sql(dsn, "UPDATE stepmachine.effects SET body = body || '\\x20'::bytea WHERE revision = 1")
    before = dump(dsn)
    async with await PostgresStore.open(dsn, codec()) as store:
        with pytest.raises(StoredDataError, match=r"'a' revision 1 effect 0 \(table effects\)"):
            await store.fork("a", 3, "copy")
        assert await store.list_sessions() == ["a"]
    assert dump(dsn) == before


# -- sessions across stores, fork, snapshots ------------------------------------------


async def test_a_session_deleted_and_created_again_elsewhere_is_not_served_from_cache(
    dsn: str,
) -> None:
    async with (
        await PostgresStore.open(dsn, codec()) as first,
        await PostgresStore.open(dsn, codec()) as second,
    ):
        old = await first.create("s")
        for _ in range(3):
            old = await advance(first, old, Increment(5))
        await second.delete("s")
        new = await second.create("s")
        new = await advance(second, new, Increment(1))
        assert await first.load("s") == new  # same revision would not do: another sid
        with pytest.raises(ConflictError):
            await first.apply(batch_for(old, Increment()))
        assert [b.revision for b in await first.batches("s")] == [1]


async def test_fork_copies_the_log_up_to_the_revision(dsn: str) -> None:
    async with await PostgresStore.open(dsn, codec()) as store:
        session = await store.create("a", ConformanceData(label="x"))
        history = [session]
        for index in range(5):
            message = Message.user(f"m{index}", id=f"m{index}")
            session = await advance(store, session, AppendMessage(message), Increment())
            history.append(session)
        forked = await store.fork("a", 3, "b")
        assert forked.id == "b"
        assert forked.revision == 3
        assert forked.conversation == history[3].conversation
        source = (await store.batches("a"))[:3]
        assert await store.batches("b") == [replace(b, session_id="b") for b in source]
        for revision in range(4):
            at = await store.load_at("b", revision)
            assert at.conversation == history[revision].conversation
        # The fork goes its own way; the source is untouched.
        await advance(store, forked, Increment(100))
        assert (await store.load("a")) == history[-1]
    async with await PostgresStore.open(dsn, codec()) as store:  # cold: from the rows
        assert (await store.load("b")).data.counter == 103
        with pytest.raises(SessionExistsError):
            await store.fork("a", 1, "b")


async def test_snapshots_bound_the_replay_and_prune_each_other(dsn: str) -> None:
    def snapshot_revisions() -> list[int]:
        rows = sql(dsn, "SELECT revision FROM stepmachine.snapshots ORDER BY revision")
        return [revision for (revision,) in rows]

    async with await PostgresStore.open(dsn, codec()) as store:
        session = await store.create("s")
        assert snapshot_revisions() == [0]
        kept = Message.user("kept", id="kept")
        session = await advance(store, session, ReplaceConversation((kept,)))
        assert snapshot_revisions() == [0, 1]  # after a ReplaceConversation, always
        for index in range(120):
            message = Message.user(f"x{index} " * 50, id=f"x{index}")
            session = await advance(store, session, AppendMessage(message))
        newest = snapshot_revisions()
        assert len(newest) == 2
        assert newest[0] == 0
        assert newest[1] > 1  # a periodic one replaced the one at 1
    async with await PostgresStore.open(dsn, codec()) as store:
        assert await store.load("s") == session
        assert (await store.load_at("s", 1)).conversation == (kept,)
