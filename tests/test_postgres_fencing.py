"""The SQL of leases with fencing (issue 10), checked on a real PostgreSQL server.

Not the store: the pattern the PostgreSQL store's leases are built on, shown to
hold under PostgreSQL's default isolation (READ COMMITTED), on asyncio and trio,
through psycopg's sync API in anyio worker threads.

- A session row carries ``lease_owner``, ``lease_epoch`` (never reset: every claim
  adds one) and ``lease_expires_at`` (the server's clock only).
- A claim succeeds when the row is free, expired, or already the claimer's, and
  returns the new epoch; renew and release name owner and epoch.
- An apply compares the revision AND the owner/epoch in the same ``UPDATE`` that
  advances the revision, so the row lock orders it against any claim: a holder
  that was paused while another took over is refused, however late it wakes up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread
import pytest

pytest.importorskip("psycopg", reason="psycopg is not installed (the postgres extra)")

T = TypeVar("T")

SCHEMA = """
CREATE TABLE sessions (
    id text PRIMARY KEY,
    revision bigint NOT NULL DEFAULT 0,
    lease_owner text,
    lease_epoch bigint NOT NULL DEFAULT 0,
    lease_expires_at timestamptz
);
CREATE TABLE effects (
    session text NOT NULL REFERENCES sessions (id),
    revision bigint NOT NULL,
    owner text NOT NULL,
    epoch bigint NOT NULL,
    PRIMARY KEY (session, revision)
);
INSERT INTO sessions (id) VALUES ('s');
"""

CLAIM = """
UPDATE sessions
SET lease_owner = %(owner)s, lease_epoch = lease_epoch + 1,
    lease_expires_at = now() + make_interval(secs => %(ttl)s)
WHERE id = 's'
  AND (lease_owner IS NULL OR lease_owner = %(owner)s OR lease_expires_at <= now())
RETURNING lease_epoch
"""

RENEW = """
UPDATE sessions SET lease_expires_at = now() + make_interval(secs => %(ttl)s)
WHERE id = 's' AND lease_owner = %(owner)s AND lease_epoch = %(epoch)s
RETURNING lease_epoch
"""

RELEASE = """
UPDATE sessions SET lease_owner = NULL, lease_expires_at = NULL
WHERE id = 's' AND lease_owner = %(owner)s AND lease_epoch = %(epoch)s
RETURNING lease_epoch
"""

APPLY = """
UPDATE sessions SET revision = revision + 1
WHERE id = 's' AND revision = %(expected)s
  AND lease_owner = %(owner)s AND lease_epoch = %(epoch)s
RETURNING revision
"""


class Leases:
    """Blocking helpers, each one connection and one transaction in one worker thread."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def _one(self, query: str, **params: object) -> int | None:
        import psycopg

        with psycopg.connect(self.dsn) as conn:  # commits on a clean exit
            row = conn.execute(query, params).fetchone()
            return None if row is None else int(row[0])

    def setup(self) -> None:
        import psycopg

        with psycopg.connect(self.dsn) as conn:
            conn.execute(SCHEMA)

    def claim(self, owner: str, ttl: float = 60.0) -> int | None:
        return self._one(CLAIM, owner=owner, ttl=ttl)

    def renew(self, owner: str, epoch: int, ttl: float = 60.0) -> int | None:
        return self._one(RENEW, owner=owner, epoch=epoch, ttl=ttl)

    def release(self, owner: str, epoch: int) -> None:
        self._one(RELEASE, owner=owner, epoch=epoch)

    def expire(self) -> None:
        """What time does to a holder that stopped renewing (paused, partitioned)."""
        self._one("UPDATE sessions SET lease_expires_at = now() - interval '1 s' RETURNING 1")

    def revision(self) -> int:
        revision = self._one("SELECT revision FROM sessions WHERE id = 's'")
        assert revision is not None
        return revision

    def apply(self, owner: str, epoch: int, expected: int) -> int | None:
        """Fenced compare-and-set and the effect row, in one transaction."""
        import psycopg

        with psycopg.connect(self.dsn) as conn, conn.transaction():
            params = {"owner": owner, "epoch": epoch, "expected": expected}
            row = conn.execute(APPLY, params).fetchone()
            if row is None:
                return None
            conn.execute("INSERT INTO effects VALUES ('s', %s, %s, %s)", (row[0], owner, epoch))
            return int(row[0])

    def effects(self) -> list[tuple[int, str, int]]:
        import psycopg

        with psycopg.connect(self.dsn) as conn:
            rows = conn.execute("SELECT revision, owner, epoch FROM effects ORDER BY revision")
            return [(int(r), str(o), int(e)) for r, o, e in rows.fetchall()]


async def hop(function: Callable[..., T], *args: object) -> T:
    """One blocking call in a worker thread."""
    return await anyio.to_thread.run_sync(function, *args)


async def test_a_paused_holder_is_fenced_out(postgres_dsn: str) -> None:
    db = Leases(postgres_dsn)
    await hop(db.setup)
    assert await hop(db.claim, "a") == 1
    assert await hop(db.claim, "b") is None  # held and not expired
    assert await hop(db.apply, "a", 1, 0) == 1
    await hop(db.expire)  # "a" stops renewing: paused, partitioned
    assert await hop(db.claim, "b") == 2
    assert await hop(db.apply, "a", 1, 1) is None  # right revision, stale epoch
    assert await hop(db.renew, "a", 1) is None
    await hop(db.release, "a", 1)  # a stale release lets nothing go
    assert await hop(db.claim, "c") is None
    assert await hop(db.apply, "b", 2, 1) == 2
    await hop(db.release, "b", 2)
    assert await hop(db.claim, "c") == 3  # released: free at once, epochs never repeat
    assert await hop(db.effects) == [(1, "a", 1), (2, "b", 2)]


async def test_racing_claims_and_applies_never_let_an_old_epoch_write(postgres_dsn: str) -> None:
    """Leases that expire at once: every claim takes over, every apply races a claim."""
    db = Leases(postgres_dsn)
    await hop(db.setup)
    acknowledged: list[tuple[int, str, int]] = []

    async def runner(owner: str) -> None:
        for _ in range(15):
            epoch = await hop(db.claim, owner, 0.0)
            if epoch is None:
                continue
            expected = await hop(db.revision)
            revision = await hop(db.apply, owner, epoch, expected)
            if revision is not None:
                acknowledged.append((revision, owner, epoch))

    async with anyio.create_task_group() as tg:
        for owner in ("a", "b", "c", "d"):
            tg.start_soon(runner, owner)
    effects = await hop(db.effects)
    assert sorted(acknowledged) == effects
    epochs = [epoch for _, _, epoch in effects]
    assert epochs == sorted(epochs)  # nobody wrote after a newer epoch was handed out
    owners = {epoch: owner for _, owner, epoch in effects}
    assert all(owners[epoch] == owner for _, owner, epoch in effects)
