"""PostgreSQL for ``store.py``: the server, one database per folder, the raw commit.

- :func:`server`: the DSN of a server for the whole run: ``$STEPMACHINE_TEST_POSTGRES``
  when set, else a throwaway server started by ``tests/harness/_postgres.py``
  with PostgreSQL's durable defaults (``fsync`` on: the benchmark measures real
  commits), stopped and removed afterwards. :func:`unavailable` says, without
  starting anything, why no server can be had (``None`` when one can).
- :func:`database`: the DSN of the database a benchmark folder names on that
  server (created on first use); :func:`drop_databases` removes the run's ones.
- :func:`stored_bytes`: bytes of the store's tables (heap, TOAST and indexes) in
  one database, the PostgreSQL counterpart of the bytes of the files on disk.
- :class:`RawPostgres`: the raw commit PostgresStore's ``apply`` is compared
  with: ``BEGIN``, an ``UPDATE`` of one row (the revision, as the store's
  compare-and-set), an ``INSERT`` of the encoded effects as one ``bytea`` row,
  ``COMMIT``, at READ COMMITTED, run like the store runs its transactions: one
  hop to a worker thread (the stores' own, ``stepmachine._async.run_in_thread``)
  holding one connection of a ``psycopg_pool`` connection pool with the store's
  settings (autocommit connections, at most 4), behind a capacity limiter, shielded.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from stepmachine._async import run_in_thread  # the stores' own hop

HARNESS = Path(__file__).resolve().parent.parent / "tests" / "harness"
if str(HARNESS) not in sys.path:
    sys.path.insert(0, str(HARNESS))

import _postgres  # noqa: E402 - tests/harness/_postgres.py, on the path just above

__all__ = [
    "RawPostgres",
    "database",
    "drop_databases",
    "given",
    "server",
    "stored_bytes",
    "unavailable",
]

RUN = f"stepmachine_bench_{uuid.uuid4().hex[:8]}_"
"""The prefix of this run's databases."""


def unavailable() -> str | None:
    """Why no PostgreSQL server can be had here (psycopg missing, no binaries), or None."""
    try:
        import psycopg  # noqa: F401, PLC0415 - only to know it is there
        import psycopg_pool  # noqa: F401, PLC0415
    except ImportError:
        return "psycopg is not installed: pip install 'stepmachine[postgres]'"
    return _postgres.unavailable_reason()


def given() -> str | None:
    """Where the DSN comes from when it is given (never the DSN: it may hold a password)."""
    return f"the server of ${_postgres.ENV_VAR}" if os.environ.get(_postgres.ENV_VAR) else None


@contextlib.contextmanager
def server() -> Iterator[str]:
    """The DSN of the run's server (see the module docstring); its databases dropped after."""
    with _postgres.postgres_server(durable=True) as dsn:
        try:
            yield dsn
        finally:
            drop_databases(dsn)


def database(server_dsn: str, folder: Path) -> str:
    """The DSN of the database of ``folder`` on ``server_dsn``, created if missing."""
    import psycopg  # noqa: PLC0415 - optional
    from psycopg import sql  # noqa: PLC0415

    name = RUN + hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:12]
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        found = admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if found is None:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return _postgres.with_database(server_dsn, name)


def drop_databases(server_dsn: str) -> None:
    """Drop every database of this run (``WITH (FORCE)``)."""
    import psycopg  # noqa: PLC0415 - optional
    from psycopg import sql  # noqa: PLC0415

    with psycopg.connect(server_dsn, autocommit=True) as admin:
        names = admin.execute(
            "SELECT datname FROM pg_database WHERE starts_with(datname, %s)", (RUN,)
        ).fetchall()
        for (name,) in names:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def stored_bytes(dsn: str) -> int:
    """Bytes of the tables of schema ``stepmachine`` in ``dsn``'s database (TOAST, indexes too)."""
    import psycopg  # noqa: PLC0415 - optional

    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'stepmachine' AND c.relkind = 'r'"
        ).fetchone()
    return int(row[0]) if row is not None else 0


class RawPostgres:
    """Raw commits on a pool like PostgresStore's; build with :meth:`open`, then :meth:`aclose`."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._connections = anyio.CapacityLimiter(4)

    @classmethod
    async def open(cls, dsn: str) -> RawPostgres:
        """A pool on ``dsn`` (the store's settings) and the raw tables, created empty."""
        from psycopg_pool import ConnectionPool  # noqa: PLC0415 - optional

        pool: Any = ConnectionPool(
            dsn, min_size=1, max_size=4, kwargs={"autocommit": True}, open=False, name="raw"
        )

        def start() -> None:
            pool.open(wait=True, timeout=30.0)
            with pool.connection() as conn:
                conn.execute("DROP TABLE IF EXISTS raw_log, raw_head")
                conn.execute(
                    "CREATE TABLE raw_log (sid bigint NOT NULL, revision bigint NOT NULL, "
                    "body bytea NOT NULL, PRIMARY KEY (sid, revision))"
                )
                conn.execute("CREATE TABLE raw_head (sid bigint PRIMARY KEY, revision bigint)")
                conn.execute("INSERT INTO raw_head VALUES (1, 0)")

        await anyio.to_thread.run_sync(start)
        return cls(pool)

    def commit(self, revision: int, body: bytes) -> None:
        """One transaction on a pooled connection, in the calling thread."""
        from psycopg import IsolationLevel  # noqa: PLC0415 - optional

        with self._pool.connection() as conn:
            conn.isolation_level = IsolationLevel.READ_COMMITTED
            conn.read_only = False
            with conn.transaction():
                conn.execute("UPDATE raw_head SET revision = %s WHERE sid = 1", (revision,))
                conn.execute(
                    "INSERT INTO raw_log (sid, revision, body) VALUES (1, %s, %s)",
                    (revision, body),
                )

    async def commit_hop(self, revision: int, body: bytes) -> None:
        """:meth:`commit` through one worker-thread hop, as PostgresStore runs a transaction."""
        async with self._connections:
            with anyio.CancelScope(shield=True):
                await run_in_thread(self.commit, revision, body)

    async def commits_per_s(self, first: int, count: int, body: bytes, *, hop: bool) -> float:
        """Commits per second of ``count`` raw commits (revisions from ``first``)."""
        start = time.perf_counter_ns()
        for k in range(first, first + count):
            if hop:
                await self.commit_hop(k, body)
            else:
                self.commit(k, body)
        return count / ((time.perf_counter_ns() - start) / 1e9)

    async def aclose(self) -> None:
        """Close the pool."""
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._pool.close)
