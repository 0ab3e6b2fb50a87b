"""The layout of :class:`~stepmachine.stores.PostgresStore`: schema, version check, transactions
and the settings of its connections.

Everything here is synchronous and runs in a worker thread, on a connection
taken from the store's pool (``autocommit`` on, so every transaction is an
explicit ``BEGIN ... COMMIT``). Reading and writing rows is :mod:`._postgres_rows`.

Layout (schema version 2), in the PostgreSQL schema ``stepmachine`` (so the
store shares a database with an application's own tables)::

    schema_version(version PK, applied_at)        one row per migration applied
    sessions(sid PK bigserial, session_id UNIQUE, revision, schema_version,
             snapshot_revision, snapshot_bytes, pending_bytes, crc,
             lease_owner, lease_epoch, lease_expires_at, run_requested_at)
    batches(sid, revision, step, cycle, ts, effect_count, schema_version, crc,
            refused, trace)
    effects(sid, revision, position, schema_version, body, crc)
    snapshots(sid, revision, schema_version, body, crc)
    media(digest PK, body)                        made by a writing open when missing

The rows are those of :class:`~stepmachine.stores.SQLiteStore` (its schema
version 4, see :mod:`._sqlite_schema`): ``sid`` is never reused (a sequence),
effects are append-only, one row per effect, ``body`` is the codec's record,
compressed with zlib when that pays (:func:`._sqlite_rows.compact`); every row
carries ``crc``, the CRC-32 of :func:`._sqlite_schema.checksum` over the
table's name and every other column, so a flipped bit or a row moved to
another session, revision or position fails closed when read. The bodies are
stored ``EXTERNAL`` (out of line, not compressed again by PostgreSQL).

Media bytes live in ``media``, once per SHA-256 digest, written in the same
transaction as the first record that refers to them (:mod:`._media_blobs`);
the records hold a ``"media_ref"`` reference. A writing open makes the table
when it is missing (under the migration lock), with no version change: code
that does not know it never reads it, and refuses the records that refer to
it by their tag. A row has no ``crc``: every body read is checked against its
digest.

The session row also carries the session's lease (:mod:`._postgres_leases`):
``lease_owner``, ``lease_epoch`` (only grows), ``lease_expires_at`` (the
server's clock) and the pending-run mark ``run_requested_at`` (NULL: none),
indexed for ``claim_next``. They are outside ``crc``: a claim or a renewal
changes them without the log changing, and no read of the log depends on them.

Versions: the database records each migration applied in
``stepmachine.schema_version``; its version is the largest. A database of a
newer version than :data:`SCHEMA_VERSION` is refused with
:class:`~stepmachine.StoredDataError` before anything is written; so is a
``stepmachine`` schema holding tables but no version table (not ours). A
database without the schema gets it, in one transaction holding a
transaction-level advisory lock (:data:`LOCK_KEY`), so stores opening one
new database at once create it once. An older database is migrated the
same way (one transaction under the lock, each version in turn):

- 1 to 2: adds the nullable ``text`` columns ``refused`` (the batch's
  refusals as compact JSON, NULL when there are none; ``text``, not
  ``jsonb``, so the checksum covers the exact bytes written) and ``trace``
  (the W3C ``traceparent``, or NULL) to ``batches``. No row is read or
  rewritten: the rows of version 1 keep their checksum (which does not cover
  the new columns) and read with both NULL; a version-2 row's covers both
  (:data:`TRAIL_FROM`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Final

from stepmachine import ConfigurationError, StoredDataError

if TYPE_CHECKING:
    import psycopg

__all__ = [
    "LOCK_KEY",
    "ROW_VERSIONS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "TRAIL_FROM",
    "describe",
    "idle_limit",
    "prepare_schema",
    "transaction",
]

SCHEMA: Final = "stepmachine"
"""The PostgreSQL schema (namespace) holding the store's tables."""

SCHEMA_VERSION: Final = 2
"""The schema version this code writes; it opens databases of this version or older."""

ROW_VERSIONS: Final = (1, 2)
"""The row versions this code reads."""

TRAIL_FROM: Final = 2
"""The first schema (and row) version whose ``batches`` rows hold ``refused`` and ``trace``."""

LOCK_KEY: Final = 0x5354_4550_4D41_4348 >> 1  # "STEPMACH", kept positive for a bigint
"""The advisory lock a migration holds for its transaction."""

_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}",
        f"""CREATE TABLE {SCHEMA}.schema_version (
            version integer PRIMARY KEY,
            applied_at timestamptz NOT NULL DEFAULT now()
        )""",
        # The lease columns (lease_owner .. run_requested_at) are outside the
        # crc: they change without the log changing (see _postgres_leases).
        f"""CREATE TABLE {SCHEMA}.sessions (
            sid bigserial PRIMARY KEY,
            session_id text NOT NULL UNIQUE,
            revision bigint NOT NULL,
            schema_version integer NOT NULL,
            snapshot_revision bigint NOT NULL,
            snapshot_bytes bigint NOT NULL,
            pending_bytes bigint NOT NULL,
            crc bigint NOT NULL,
            lease_owner text,
            lease_epoch bigint NOT NULL DEFAULT 0 CHECK (lease_epoch >= 0),
            lease_expires_at timestamptz,
            run_requested_at timestamptz
        )""",
        # claim_next finds the sessions with a pending run without a scan.
        f"""CREATE INDEX sessions_run_requested ON {SCHEMA}.sessions (run_requested_at, sid)
            WHERE run_requested_at IS NOT NULL""",
        f"""CREATE INDEX sessions_leased ON {SCHEMA}.sessions (lease_expires_at, sid)
            WHERE lease_owner IS NOT NULL""",
        f"""CREATE TABLE {SCHEMA}.batches (
            sid bigint NOT NULL,
            revision bigint NOT NULL,
            step text NOT NULL,
            cycle bigint NOT NULL,
            ts double precision NOT NULL,
            effect_count integer NOT NULL,
            schema_version integer NOT NULL,
            crc bigint NOT NULL,
            PRIMARY KEY (sid, revision)
        )""",
        f"""CREATE TABLE {SCHEMA}.effects (
            sid bigint NOT NULL,
            revision bigint NOT NULL,
            position integer NOT NULL,
            schema_version integer NOT NULL,
            body bytea NOT NULL,
            crc bigint NOT NULL,
            PRIMARY KEY (sid, revision, position)
        )""",
        f"""CREATE TABLE {SCHEMA}.snapshots (
            sid bigint NOT NULL,
            revision bigint NOT NULL,
            schema_version integer NOT NULL,
            body bytea NOT NULL,
            crc bigint NOT NULL,
            PRIMARY KEY (sid, revision)
        )""",
        # The store compresses bodies itself: PostgreSQL need not try again.
        f"ALTER TABLE {SCHEMA}.effects ALTER COLUMN body SET STORAGE EXTERNAL",
        f"ALTER TABLE {SCHEMA}.snapshots ALTER COLUMN body SET STORAGE EXTERNAL",
    ),
    # The decision trail: nullable, so no row is rewritten (the old ones read NULL).
    2: (f"ALTER TABLE {SCHEMA}.batches ADD COLUMN refused text, ADD COLUMN trace text",),
}
"""The statements that bring a database from the previous version to each version."""

_TABLES: Final = ("schema_version", "sessions", "batches", "effects", "snapshots")


def describe(conn: psycopg.Connection[Any]) -> str:
    """How errors name the database: its name, host and port (never a password)."""
    info = conn.info
    return f"PostgreSQL database {info.dbname!r} on {info.host}:{info.port}"


@contextmanager
def transaction(conn: psycopg.Connection[Any], *, write: bool) -> Iterator[None]:
    """One transaction on an autocommit connection; commits when the block ends normally,
    rolls back on any exception.

    A write transaction runs at READ COMMITTED (whatever the server's default): the
    store's compare-and-set is an ``UPDATE ... WHERE sid = %s AND revision =
    %s``, and a write that must read the session row first locks it (``SELECT
    ... FOR UPDATE``), so what it read stays current until it commits. A read
    transaction is ``REPEATABLE READ, READ ONLY``: one snapshot for every
    statement (a session row and the log it points to agree), and it never
    fails with a serialization error.

    Both are set on the connection (psycopg puts them in its ``BEGIN``), and they
    stay set when the connection goes back to the pool: every transaction of the
    store goes through here, which sets them each time.
    """
    from psycopg import IsolationLevel  # noqa: PLC0415 - psycopg is optional; it is here

    # Set on the connection, these go into psycopg's BEGIN: no extra round trip.
    conn.isolation_level = (
        IsolationLevel.READ_COMMITTED if write else IsolationLevel.REPEATABLE_READ
    )
    conn.read_only = not write
    with conn.transaction():
        yield


def idle_limit(seconds: float | None) -> Callable[[psycopg.Connection[Any]], None] | None:
    """The pool's ``configure``: set ``idle_in_transaction_session_timeout`` on each
    new connection (``None``: leave the server's setting).

    Raises:
        ConfigurationError: ``seconds`` is not > 0.
    """
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ConfigurationError(
            f"idle_in_transaction_timeout must be a number of seconds > 0 or None, not {seconds!r}"
        )
    milliseconds = str(max(1, round(seconds * 1000)))

    def configure(connection: psycopg.Connection[Any]) -> None:
        # A session setting (is_local false); the connection is in autocommit.
        query = "SELECT set_config('idle_in_transaction_session_timeout', %s, false)"
        connection.execute(query, (milliseconds,))

    return configure


def prepare_schema(conn: psycopg.Connection[Any], *, read_only: bool = False) -> None:
    """Refuse what is not ours or is newer; create the schema when it is missing.

    Nothing is written before the version has been read and checked: a refused
    database is left unchanged. With ``read_only`` nothing is written at all:
    a missing or older schema is refused instead of created or migrated.

    Raises:
        StoredDataError: a ``stepmachine`` schema that is not a store's, or a
            newer schema version; with ``read_only``, a missing or older one.
    """
    label = describe(conn)
    with transaction(conn, write=not read_only):
        version = _stored_version(conn, label)
        if version == SCHEMA_VERSION:
            if not read_only:
                _ensure_media(conn)
            return
        if read_only:
            what = "holds no stepmachine store" if version == 0 else f"is at schema {version}"
            raise StoredDataError(
                f"{label} {what}; this stepmachine reads schema {SCHEMA_VERSION} and a "
                "read-only open creates and migrates nothing: open it for writing once"
            )
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
        version = _stored_version(conn, label)  # another store may have migrated meanwhile
        for target in range(version + 1, SCHEMA_VERSION + 1):
            for statement in _MIGRATIONS[target]:
                conn.execute(statement)
            conn.execute(
                f"INSERT INTO {SCHEMA}.schema_version (version) VALUES (%s)",  # noqa: S608 - fixed names
                (target,),
            )
        _ensure_media(conn)


_MEDIA_TABLE: Final = (
    f"CREATE TABLE IF NOT EXISTS {SCHEMA}.media (digest text PRIMARY KEY, body bytea NOT NULL)",
    # Images and PDFs are compressed already: PostgreSQL need not try again.
    f"ALTER TABLE {SCHEMA}.media ALTER COLUMN body SET STORAGE EXTERNAL",
)


def _ensure_media(conn: psycopg.Connection[Any]) -> None:
    """Make the media table (the bytes media records refer to, one row per digest;
    see :mod:`._media_blobs`) if it is missing, under the migration lock.

    No schema version: code that does not know the table never reads it, and
    refuses the records that refer to it by their tag (``"media_ref"``). A row
    carries no ``crc``: the core checks every body read against its digest.
    """
    found = conn.execute("SELECT to_regclass(%s)", (f"{SCHEMA}.media",)).fetchone()
    if found is not None and found[0] is not None:
        return
    conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
    for statement in _MEDIA_TABLE:
        conn.execute(statement)


def _stored_version(conn: psycopg.Connection[Any], label: str) -> int:
    """The database's schema version (0: no ``stepmachine`` schema yet), checked.

    Raises:
        StoredDataError: a newer version, or tables that are not a store's.
    """
    found = {
        name
        for (name,) in conn.execute(
            "SELECT tablename FROM pg_catalog.pg_tables WHERE schemaname = %s", (SCHEMA,)
        )
    }
    if "schema_version" not in found:
        if found:
            raise StoredDataError(
                f"{label} has a {SCHEMA!r} schema that is not a stepmachine store: it has "
                f"tables {sorted(found)!r} and no schema_version table; it was left unchanged"
            )
        return 0
    query = f"SELECT max(version) FROM {SCHEMA}.schema_version"  # noqa: S608 - fixed names
    row = conn.execute(query).fetchone()
    version = None if row is None else row[0]
    if not isinstance(version, int) or version < 1:
        raise StoredDataError(f"{label} has a malformed schema_version table (max {version!r})")
    if version > SCHEMA_VERSION:
        raise StoredDataError(
            f"{label} was written by stepmachine PostgreSQL schema version {version}; this "
            f"version of stepmachine reads schema versions up to {SCHEMA_VERSION}. Upgrade "
            "stepmachine to open it; the database was left unchanged"
        )
    missing = sorted(set(_TABLES) - found)
    if missing:
        raise StoredDataError(
            f"{label}: its schema_version table says version {version}, but the tables "
            f"{missing!r} are missing from schema {SCHEMA!r}; the database was left unchanged"
        )
    return version
