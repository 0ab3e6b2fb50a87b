"""SQLiteStore's load of a session nothing has changed: no thread hop, no table read.

The store keeps, per cached session, SQLite's ``PRAGMA data_version`` as of the
transaction that last read or wrote it; a load compares it with the current one on
the event loop and returns the cached session when they agree. These tests check
that such a load is exactly as fresh as a read: whatever another connection (another
store instance, another process) committed is seen, and what this store wrote is
what it returns.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
import threading
from contextlib import closing
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import AppendMessage, Codec, Effect, Message, Session
from stepmachine.extend import Batch
from stepmachine.stores import SQLiteStore
from stepmachine.testing.conformance import ConformanceData, Increment


def codec() -> Codec[ConformanceData]:
    return Codec(ConformanceData, effects=[Increment])


def batch_for(session: Session[Any], *effects: Effect) -> Batch[Effect]:
    return Batch(
        session_id=session.id,
        revision=session.revision + 1,
        step="test",
        cycle=1,
        timestamp=1_700_000_000.5,
        effects=effects,
    )


def statements_of(store: SQLiteStore) -> list[tuple[str, int]]:
    """Record the SQL the store's connection runs, with the thread that ran it."""
    seen: list[tuple[str, int]] = []
    connection = store._conn
    assert connection is not None
    connection.set_trace_callback(lambda sql: seen.append((sql, threading.get_ident())))
    return seen


async def test_a_load_that_finds_nothing_new_reads_no_table_on_the_loop(tmp_path: Path) -> None:
    async with await SQLiteStore.open(tmp_path / "s.db", codec()) as store:
        session = await store.create("s")
        session = await store.apply(batch_for(session, Increment(2)))
        seen = statements_of(store)
        loaded = await store.load("s")
        assert loaded == session
        assert [sql for sql, _ in seen] == [
            "PRAGMA busy_timeout = 0",
            "PRAGMA data_version",
            "PRAGMA busy_timeout = 30000",
        ]
        assert {thread for _, thread in seen} == {threading.get_ident()}  # no hop


async def test_another_instances_commit_is_seen(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    async with (
        await SQLiteStore.open(db, codec()) as first,
        await SQLiteStore.open(db, codec()) as second,
    ):
        await first.create("s")
        await first.load("s")
        moved = await second.apply(batch_for(await second.load("s"), Increment(5)))
        assert await first.load("s") == moved
        assert (await first.load("s")).data.counter == 5


async def test_another_process_commit_is_seen(tmp_path: Path) -> None:
    """A commit by another process (its own connection) changes data_version too."""
    db = tmp_path / "s.db"
    async with await SQLiteStore.open(db, codec()) as store:
        await store.apply(batch_for(await store.create("s"), Increment(1)))
        assert (await store.load("s")).revision == 1
        child = textwrap.dedent(
            f"""
            import anyio
            from stepmachine import Codec
            from stepmachine.extend import Batch
            from stepmachine.stores import SQLiteStore
            from stepmachine.testing.conformance import ConformanceData, Increment

            async def main():
                codec = Codec(ConformanceData, effects=[Increment])
                async with await SQLiteStore.open({str(db)!r}, codec) as store:
                    session = await store.load("s")
                    await store.apply(Batch(session_id="s", revision=session.revision + 1,
                        step="child", cycle=1, timestamp=1.0, effects=(Increment(10),)))

            anyio.run(main)
            """
        )
        await anyio.to_thread.run_sync(
            lambda: subprocess.run([sys.executable, "-c", child], check=True, timeout=60)
        )
        loaded = await store.load("s")
        assert (loaded.revision, loaded.data.counter) == (2, 11)


async def test_a_raw_write_by_another_connection_is_read(tmp_path: Path) -> None:
    """Any commit by another connection makes the load read, even one that does not
    touch the session (it cannot tell): it then reads what is there."""
    db = tmp_path / "s.db"
    async with await SQLiteStore.open(db, codec()) as store:
        session = await store.apply(batch_for(await store.create("s"), Increment(1)))
        with closing(sqlite3.connect(db)) as other, other:
            other.execute("CREATE TABLE unrelated (x)")
        seen = statements_of(store)
        assert await store.load("s") == session
        assert any(sql.startswith("SELECT") for sql, _ in seen)  # read, not trusted


async def test_where_sqlite_would_wait_the_load_reads_in_the_worker_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check runs with SQLite's busy wait off; where it would have waited (another
    connection recovering the log after a crash: SQLITE_BUSY), the load reads in the
    worker thread instead, and the busy wait is set back."""
    import stepmachine.stores._sqlite as sqlite_module

    async with await SQLiteStore.open(tmp_path / "s.db", codec(), busy_timeout=2.5) as store:
        session = await store.apply(batch_for(await store.create("s"), Increment(1)))
        real = sqlite_module._data_version
        on_loop = threading.get_ident()

        def busy_on_the_loop(connection: Any) -> int:
            if threading.get_ident() == on_loop:
                raise sqlite3.OperationalError("database is locked")
            return real(connection)

        monkeypatch.setattr(sqlite_module, "_data_version", busy_on_the_loop)
        seen = statements_of(store)
        assert await store.load("s") == session
        assert any(sql.startswith("SELECT") and t != on_loop for sql, t in seen)
        assert store._conn is not None
        ((timeout,),) = store._conn.execute("PRAGMA busy_timeout").fetchall()
        assert timeout == 2500


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(["apply", "load"]))))
def test_every_load_is_what_a_fresh_instance_reads(
    tmp_path: Path, ops: list[tuple[str, str]]
) -> None:
    """Two instances write and read one session in any order: every load of either
    equals a cold load by a third, fresh instance at that moment."""
    db = tmp_path / f"h{abs(hash(tuple(ops)))}.db"
    db.unlink(missing_ok=True)

    async def main() -> None:
        async with (
            await SQLiteStore.open(db, codec()) as a,
            await SQLiteStore.open(db, codec()) as b,
        ):
            await a.create("s")
            stores = {"a": a, "b": b}
            for k, (who, op) in enumerate(ops):
                store = stores[who]
                if op == "apply":
                    current = await store.load("s")
                    message = Message.user(f"m{k}", id=f"m{k}")
                    await store.apply(batch_for(current, Increment(1), AppendMessage(message)))
                else:
                    loaded = await store.load("s")
                    async with await SQLiteStore.open(db, codec()) as fresh:
                        assert loaded == await fresh.load("s")

    anyio.run(main)
