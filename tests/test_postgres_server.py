"""The PostgreSQL test server and the driver path the PostgreSQL store will take.

- ``tests/harness/_postgres.py``: why no server can be started is said precisely
  (binaries missing, root without a ``postgres`` user); a throwaway server answers
  on loopback and leaves nothing behind (no process, no folder).
- psycopg's sync API in anyio worker threads, on asyncio and trio: a
  compare-and-set on a revision and the effect rows it guards commit or roll back
  together, and of two writers expecting the same revision exactly one wins; a
  ``SELECT ... FOR UPDATE SKIP LOCKED`` claim from a second connection skips the
  row a first connection holds, and gets it once the first lets go.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import _postgres
import anyio
import anyio.to_thread
import pytest

SCHEMA = """
CREATE TABLE sessions (id text PRIMARY KEY, revision bigint NOT NULL);
CREATE TABLE effects (
    session text NOT NULL REFERENCES sessions (id),
    revision bigint NOT NULL,
    body text NOT NULL,
    PRIMARY KEY (session, revision)
);
CREATE TABLE jobs (id text PRIMARY KEY);
"""


def _fake_binaries(folder: Path) -> None:
    for name in ("initdb", "pg_ctl"):
        program = folder / name
        program.write_text("#!/bin/sh\nexit 1\n")
        program.chmod(program.stat().st_mode | stat.S_IXUSR)


def test_missing_binaries_are_the_reason(tmp_path: Path) -> None:
    reason = _postgres.unavailable_reason({"PATH": str(tmp_path)}, debian_root=str(tmp_path))
    assert reason is not None
    assert "initdb" in reason
    assert _postgres.ENV_VAR in reason


def test_root_without_the_server_user_is_the_reason(tmp_path: Path) -> None:
    _fake_binaries(tmp_path)
    environ = {"PATH": f"{tmp_path}{os.pathsep}{os.defpath}"}
    reason = _postgres.unavailable_reason(
        environ, debian_root=str(tmp_path), euid=0, server_user="no-such-user-stepmachine"
    )
    assert reason is not None
    assert "root" in reason
    assert "no-such-user-stepmachine" in reason
    assert _postgres.unavailable_reason(environ, debian_root=str(tmp_path), euid=1000) is None


def test_a_given_dsn_needs_nothing_here(tmp_path: Path) -> None:
    environ = {"PATH": str(tmp_path), _postgres.ENV_VAR: "postgresql://db.invalid/x"}
    assert _postgres.unavailable_reason(environ, debian_root=str(tmp_path)) is None


def test_debian_layout_is_found_newest_first(tmp_path: Path) -> None:
    for version in ("9.6", "15", "13"):
        folder = tmp_path / version / "bin"
        folder.mkdir(parents=True)
        _fake_binaries(folder)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _postgres.find_bindir(str(empty), str(tmp_path)) == tmp_path / "15" / "bin"


def test_with_database_keeps_the_form() -> None:
    pytest.importorskip("psycopg", reason="psycopg is not installed (the postgres extra)")
    assert (
        _postgres.with_database("postgresql://u@127.0.0.1:5/postgres?sslmode=disable", "t1")
        == "postgresql://u@127.0.0.1:5/t1?sslmode=disable"
    )
    assert "dbname=t1" in _postgres.with_database("host=127.0.0.1 port=5 dbname=postgres", "t1")


@pytest.mark.postgres
def test_throwaway_server_answers_and_leaves_nothing() -> None:
    psycopg = pytest.importorskip("psycopg", reason="psycopg is not installed (the postgres extra)")
    reason = _postgres.unavailable_reason(
        {k: v for k, v in os.environ.items() if k != _postgres.ENV_VAR}
    )
    if reason is not None:
        pytest.skip(f"no PostgreSQL server: {reason}")
    with _postgres.throwaway_server() as server:
        with psycopg.connect(server.dsn) as conn:
            row = conn.execute(
                "SELECT inet_server_addr()::text, current_setting('listen_addresses')"
            ).fetchone()
        assert row == ("127.0.0.1/32", "127.0.0.1")
        assert server.folder.is_dir()
    assert not server.folder.exists()
    with (
        pytest.raises(ConnectionRefusedError),
        socket.create_connection(("127.0.0.1", server.port), timeout=5),
    ):
        pass


class Db:
    """Blocking helpers, each run whole in one worker thread (one hop)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def setup(self) -> None:
        import psycopg

        with psycopg.connect(self.dsn) as conn:
            conn.execute(SCHEMA)
            conn.execute("INSERT INTO sessions VALUES ('s', 0)")
            conn.execute("INSERT INTO jobs VALUES ('a'), ('b')")

    def apply(self, expected: int, body: str, *, fail_after: bool = False) -> int | None:
        """Compare-and-set the revision and insert the effect row, in one transaction."""
        import psycopg

        with psycopg.connect(self.dsn) as conn, conn.transaction():
            row = conn.execute(
                "UPDATE sessions SET revision = revision + 1"
                " WHERE id = 's' AND revision = %s RETURNING revision",
                (expected,),
            ).fetchone()
            if row is None:
                return None
            conn.execute("INSERT INTO effects VALUES ('s', %s, %s)", (row[0], body))
            if fail_after:
                raise RuntimeError("crash between the update and the commit")
            return int(row[0])

    def state(self) -> tuple[int, list[tuple[int, str]]]:
        import psycopg

        with psycopg.connect(self.dsn) as conn:
            revision = conn.execute("SELECT revision FROM sessions WHERE id = 's'").fetchone()
            effects = conn.execute("SELECT revision, body FROM effects ORDER BY revision")
            assert revision is not None
            return int(revision[0]), [(int(r), str(b)) for r, b in effects.fetchall()]


async def test_compare_and_set_commits_with_its_effects(postgres_dsn: str) -> None:
    db = Db(postgres_dsn)
    await anyio.to_thread.run_sync(db.setup)
    with pytest.raises(RuntimeError, match="crash"):
        await anyio.to_thread.run_sync(lambda: db.apply(0, "lost", fail_after=True))
    assert await anyio.to_thread.run_sync(db.state) == (0, [])

    won: list[int | None] = []

    async def writer(body: str) -> None:
        won.append(await anyio.to_thread.run_sync(db.apply, 0, body))

    async with anyio.create_task_group() as tg:
        tg.start_soon(writer, "first")
        tg.start_soon(writer, "second")
    assert sorted(won, key=lambda r: r is None) == [1, None]
    revision, effects = await anyio.to_thread.run_sync(db.state)
    assert revision == 1
    assert len(effects) == 1
    assert effects[0][0] == 1
    assert await anyio.to_thread.run_sync(db.apply, 0, "stale") is None
    assert await anyio.to_thread.run_sync(db.apply, 1, "next") == 2


async def test_skip_locked_claim_skips_the_held_row(postgres_dsn: str) -> None:
    psycopg = pytest.importorskip("psycopg")
    from psycopg_pool import ConnectionPool

    db = Db(postgres_dsn)
    await anyio.to_thread.run_sync(db.setup)
    claim = "SELECT id FROM jobs ORDER BY id FOR UPDATE SKIP LOCKED LIMIT 1"
    # A claim that waited for the lock instead of skipping fails after 30 s instead of hanging.
    pool = ConnectionPool(
        postgres_dsn,
        min_size=3,
        max_size=3,
        open=False,
        kwargs={"options": "-c lock_timeout=30000"},
    )
    await anyio.to_thread.run_sync(lambda: pool.open(wait=True))
    try:
        first = await anyio.to_thread.run_sync(pool.getconn)
        second = await anyio.to_thread.run_sync(pool.getconn)
        third = await anyio.to_thread.run_sync(pool.getconn)

        def claim_on(conn: psycopg.Connection[tuple[str]]) -> str | None:
            row = conn.execute(claim).fetchone()  # opens a transaction, left open
            return None if row is None else str(row[0])

        assert await anyio.to_thread.run_sync(claim_on, first) == "a"
        assert await anyio.to_thread.run_sync(claim_on, second) == "b"
        assert await anyio.to_thread.run_sync(claim_on, third) is None
        await anyio.to_thread.run_sync(third.rollback)
        await anyio.to_thread.run_sync(first.rollback)  # lets go of "a"
        assert await anyio.to_thread.run_sync(claim_on, third) == "a"
        for conn in (first, second, third):
            await anyio.to_thread.run_sync(conn.rollback)
            await anyio.to_thread.run_sync(pool.putconn, conn)
    finally:
        await anyio.to_thread.run_sync(pool.close)
