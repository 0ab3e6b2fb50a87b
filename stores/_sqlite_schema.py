"""The on-disk layout of :class:`~stepmachine.stores.SQLiteStore`: schema, migrations, rows.

Everything here is synchronous and runs in the store's worker thread, on a
connection the caller holds exclusively.

Layout (schema version 1)::

    schema_version(version PK, applied_at)        one row per migration applied
    sessions(sid PK AUTOINCREMENT, session_id UNIQUE, revision, schema_version,
             snapshot_revision, snapshot_bytes, pending_bytes)
    batches(sid, revision, step, cycle, timestamp, effect_count, schema_version)
    effects(sid, revision, position, schema_version, body)
    snapshots(sid, revision, schema_version, body)

``sid`` is never reused (``AUTOINCREMENT``), so a session deleted and created
again under the same id is a different ``sid``, and a cache keyed by ``sid``
never serves the old one. Effects are append-only, one row per effect: ``body``
is the codec's effects record holding exactly that one effect. A snapshot is
the codec's session record; there is always one at revision 0 (written by
``create``) and one after every batch holding a
:class:`~stepmachine.ReplaceConversation`. Periodic snapshots follow
:func:`wants_snapshot`: at least :data:`SNAPSHOT_EVERY` revisions apart, taken
once the effect bytes since the last snapshot reach half its size, and at most
:data:`SNAPSHOT_MAX_GAP` revisions apart. So rebuilding any revision replays at
most ``SNAPSHOT_MAX_GAP`` batches (and, past ``SNAPSHOT_EVERY``, no more effect
bytes than half the snapshot it starts from), while snapshots take at most
about twice the room of the effect log, and their encoding costs each apply,
on average, about twice the encoding of its own effects. The session row keeps the revision and
size of the last snapshot and the effect bytes written since (``pending_bytes``).

Reading fails closed (invariant 8): a row of an unknown schema version, a
column of the wrong type, a gap in the log, an undecodable body or a stored
effect that no longer applies raises :class:`~stepmachine.StoredDataError`
naming the file, the session, the revision and the effect index. Nothing here
ever rewrites a row it read.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from stepmachine import (
    Codec,
    ConfigurationError,
    Effect,
    EffectError,
    Session,
    StoredDataError,
    apply_batch,
)

__all__ = [
    "SCHEMA_VERSION",
    "SNAPSHOT_EVERY",
    "SNAPSHOT_MAX_GAP",
    "SessionRow",
    "StoredBatch",
    "insert_batch",
    "insert_session",
    "insert_snapshot",
    "open_connection",
    "read_log",
    "read_snapshot",
    "read_snapshots",
    "replay",
    "session_row",
    "transaction",
    "wants_snapshot",
]

SCHEMA_VERSION = 1
"""The schema version this code writes; it opens databases of this version or older."""

SNAPSHOT_EVERY = 100
"""The fewest revisions between two periodic snapshots."""

SNAPSHOT_MAX_GAP = 1000
"""The most revisions between two snapshots."""

_HEADER = b"SQLite format 3\x00"

_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        """CREATE TABLE schema_version (
            version INTEGER PRIMARY KEY,
            applied_at REAL NOT NULL
        )""",
        """CREATE TABLE sessions (
            sid INTEGER PRIMARY KEY AUTOINCREMENT,
            session_id TEXT NOT NULL UNIQUE,
            revision INTEGER NOT NULL,
            schema_version INTEGER NOT NULL,
            snapshot_revision INTEGER NOT NULL,
            snapshot_bytes INTEGER NOT NULL,
            pending_bytes INTEGER NOT NULL
        )""",
        """CREATE TABLE batches (
            sid INTEGER NOT NULL,
            revision INTEGER NOT NULL,
            step TEXT NOT NULL,
            cycle INTEGER NOT NULL,
            timestamp REAL NOT NULL,
            effect_count INTEGER NOT NULL,
            schema_version INTEGER NOT NULL,
            PRIMARY KEY (sid, revision)
        ) WITHOUT ROWID""",
        """CREATE TABLE effects (
            sid INTEGER NOT NULL,
            revision INTEGER NOT NULL,
            position INTEGER NOT NULL,
            schema_version INTEGER NOT NULL,
            body BLOB NOT NULL,
            PRIMARY KEY (sid, revision, position)
        ) WITHOUT ROWID""",
        # A rowid table: snapshot bodies are large, and SQLite keeps large rows of a
        # WITHOUT ROWID table in the key b-tree, which makes range lookups slow.
        """CREATE TABLE snapshots (
            sid INTEGER NOT NULL,
            revision INTEGER NOT NULL,
            schema_version INTEGER NOT NULL,
            body BLOB NOT NULL,
            PRIMARY KEY (sid, revision)
        )""",
    ),
}


# -- opening -------------------------------------------------------------------


def open_connection(
    path: str, synchronous: Literal["NORMAL", "FULL"], busy_timeout: float
) -> sqlite3.Connection:
    """Open ``path``, refuse what is not ours, enable WAL and migrate to :data:`SCHEMA_VERSION`.

    Nothing is written to the file before its schema version has been checked,
    so a refused file keeps its exact bytes. A missing file is created
    owner-only (0o600) before SQLite opens it, so its ``-wal`` and ``-shm``
    files (which SQLite gives the database file's permissions) are owner-only
    too; an existing file keeps its permissions.

    Raises:
        StoredDataError: the file is not an SQLite database, is another
            application's database, or was written by a newer schema version.
        ConfigurationError: WAL could not be enabled (an in-memory database).
        sqlite3.OperationalError: the file cannot be opened at all.
    """
    _check_header(path)
    _create_owner_only(path)
    conn = sqlite3.connect(
        path, timeout=busy_timeout, isolation_level=None, check_same_thread=False
    )
    try:
        conn.execute(f"PRAGMA busy_timeout = {round(busy_timeout * 1000)}")
        if _stored_version(conn, path) < SCHEMA_VERSION:
            _enable_wal(conn, path)
            with transaction(conn, write=True):
                _migrate(conn, _stored_version(conn, path))
        else:
            _enable_wal(conn, path)
        conn.execute(f"PRAGMA synchronous = {synchronous}")
    except sqlite3.DatabaseError as exc:
        conn.close()
        if isinstance(exc, sqlite3.OperationalError):
            raise
        raise StoredDataError(f"{path} is not a readable SQLite database: {exc}") from exc
    except BaseException:
        conn.close()
        raise
    return conn


def _create_owner_only(path: str) -> None:
    """Create ``path`` empty and 0o600 (whatever the umask) if it does not exist.

    An existing file (or anything else at ``path``) is left alone; other
    failures are left for SQLite to report when it opens the path.
    """
    if path in ("", ":memory:"):
        return  # SQLite's temporary and in-memory databases: no file
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:
        return
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _check_header(path: str) -> None:
    try:
        with open(path, "rb") as file:
            header = file.read(len(_HEADER))
    except FileNotFoundError:
        return
    except IsADirectoryError:
        raise StoredDataError(f"{path} is a directory, not an SQLite database") from None
    if header and header != _HEADER:
        raise StoredDataError(
            f"{path} is not an SQLite database (it starts with {header!r}); "
            "SQLiteStore opens only its own database files and left it unchanged"
        )


def _stored_version(conn: sqlite3.Connection, path: str) -> int:
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "schema_version" not in tables:
        foreign = sorted(tables - {"sqlite_sequence"})
        if foreign:
            raise StoredDataError(
                f"{path} is an SQLite database but not a stepmachine store: it has tables "
                f"{foreign!r} and no schema_version table; it was left unchanged"
            )
        return 0
    (version,) = conn.execute("SELECT max(version) FROM schema_version").fetchone()
    if not isinstance(version, int) or version < 1:
        raise StoredDataError(f"{path} has a malformed schema_version table (max {version!r})")
    if version > SCHEMA_VERSION:
        raise StoredDataError(
            f"{path} was written by stepmachine schema version {version}; this version of "
            f"stepmachine reads schema versions up to {SCHEMA_VERSION}. Upgrade stepmachine "
            "to open it; the file was left unchanged"
        )
    return version


def _enable_wal(conn: sqlite3.Connection, path: str) -> None:
    (mode,) = conn.execute("PRAGMA journal_mode = WAL").fetchone()
    if str(mode).lower() != "wal":
        raise ConfigurationError(f"SQLiteStore needs WAL, but {path} runs journal_mode={mode}")


def _migrate(conn: sqlite3.Connection, version: int) -> None:
    for target in range(version + 1, SCHEMA_VERSION + 1):
        for statement in _MIGRATIONS[target]:
            conn.execute(statement)
        conn.execute(
            "INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", (target, time.time())
        )


@contextmanager
def transaction(conn: sqlite3.Connection, *, write: bool) -> Iterator[None]:
    """One transaction: ``BEGIN IMMEDIATE`` to write, ``BEGIN`` (a read snapshot) to read.

    Commits when the block ends normally; rolls back on any exception,
    including a failed ``COMMIT``, so no transaction is ever left open.
    """
    conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        # Also when COMMIT itself fails (SQLITE_BUSY, an IO error): SQLite may leave
        # the transaction open, which would lock every later call and other processes.
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


# -- rows ----------------------------------------------------------------------


class SessionRow(NamedTuple):
    """The row of one session: its never-reused ``sid``, revision and snapshot bookkeeping."""

    sid: int
    revision: int
    snapshot_revision: int
    snapshot_bytes: int
    pending_bytes: int


@dataclass(frozen=True, slots=True)
class StoredBatch:
    """One batch read back from the log."""

    revision: int
    step: str
    cycle: int
    timestamp: float
    effects: tuple[Effect, ...]


def _fail(path: str, where: str, problem: str) -> StoredDataError:
    return StoredDataError(f"invariant 8 (stored data is data): {where} in {path}: {problem}")


def _check_version(path: str, where: str, version: object) -> None:
    if version != SCHEMA_VERSION or not isinstance(version, int):
        raise _fail(
            path, where, f"record schema version is {version!r}, this code reads {SCHEMA_VERSION}"
        )


def _typed(path: str, where: str, column: str, value: Any, kind: type) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _fail(path, where, f"column {column} holds {value!r}, not {kind.__name__}")
    return value


def session_row(conn: sqlite3.Connection, path: str, session_id: str) -> SessionRow | None:
    """The row of ``session_id``, or ``None`` when there is none."""
    row = conn.execute(
        "SELECT schema_version, sid, revision, snapshot_revision, snapshot_bytes, pending_bytes "
        "FROM sessions WHERE session_id = ?",
        (session_id,),
    ).fetchone()
    if row is None:
        return None
    where = f"session {session_id!r}"
    _check_version(path, where, row[0])
    columns = ("sid", "revision", "snapshot_revision", "snapshot_bytes", "pending_bytes")
    values = [
        _typed(path, where, name, value, int) for name, value in zip(columns, row[1:], strict=True)
    ]
    if min(values) < 0 or values[2] > values[1]:
        raise _fail(path, where, f"inconsistent session row {values!r} for {columns!r}")
    return SessionRow(*values)


def wants_snapshot(row: SessionRow, revision: int, batch_bytes: int, replaces: bool) -> bool:
    """Whether the batch producing ``revision`` (``batch_bytes`` of effects) ends with a snapshot.

    Always after a ReplaceConversation. Otherwise only :data:`SNAPSHOT_EVERY`
    or more revisions after the last snapshot, and then once the effect bytes
    since it reach half its size, or :data:`SNAPSHOT_MAX_GAP` revisions have
    passed. Snapshots then take at most about twice the room of the effects
    they follow, and cost each apply, on average, twice its own encoding.
    """
    if replaces:
        return True
    gap = revision - row.snapshot_revision
    pending = row.pending_bytes + batch_bytes
    due = 2 * pending >= row.snapshot_bytes or gap >= SNAPSHOT_MAX_GAP
    return gap >= SNAPSHOT_EVERY and due


def _decode_snapshot(
    codec: Codec[Any], path: str, session_id: str, row: Sequence[Any]
) -> Session[Any]:
    where = f"session {session_id!r} snapshot at revision {row[0]!r}"
    revision = _typed(path, where, "revision", row[0], int)
    _check_version(path, where, row[1])
    body = _typed(path, where, "body", row[2], bytes)
    session = codec.decode_session(body, where=f"{where} in {path}")
    if session.id != session_id or session.revision != revision:
        raise _fail(
            path, where, f"the record holds session {session.id!r} revision {session.revision}"
        )
    return session


def read_snapshot(
    conn: sqlite3.Connection,
    codec: Codec[Any],
    path: str,
    session_id: str,
    sid: int,
    after: int,
    upto: int,
) -> Session[Any] | None:
    """The newest snapshot with ``after < revision <= upto``, decoded; ``None`` if there is none."""
    row = conn.execute(
        "SELECT revision, schema_version, body FROM snapshots "
        "WHERE sid = ? AND revision > ? AND revision <= ? ORDER BY revision DESC LIMIT 1",
        (sid, after, upto),
    ).fetchone()
    return None if row is None else _decode_snapshot(codec, path, session_id, row)


def read_snapshots(
    conn: sqlite3.Connection, codec: Codec[Any], path: str, session_id: str, sid: int, upto: int
) -> list[Session[Any]]:
    """Every snapshot with ``revision <= upto``, oldest first, decoded."""
    rows = conn.execute(
        "SELECT revision, schema_version, body FROM snapshots "
        "WHERE sid = ? AND revision <= ? ORDER BY revision",
        (sid, upto),
    ).fetchall()
    return [_decode_snapshot(codec, path, session_id, row) for row in rows]


def read_log(
    conn: sqlite3.Connection,
    codec: Codec[Any],
    path: str,
    session_id: str,
    sid: int,
    after: int,
    upto: int,
) -> list[StoredBatch]:
    """The batches with ``after < revision <= upto``, decoded, checked to be complete.

    Reads only those rows. Raises :class:`StoredDataError` for a missing batch
    or effect, an orphan effect, or a record that does not decode, naming the
    revision and effect index.
    """
    batch_rows = conn.execute(
        "SELECT revision, step, cycle, timestamp, effect_count, schema_version FROM batches "
        "WHERE sid = ? AND revision > ? AND revision <= ? ORDER BY revision",
        (sid, after, upto),
    ).fetchall()
    effect_rows = conn.execute(
        "SELECT revision, position, schema_version, body FROM effects "
        "WHERE sid = ? AND revision > ? AND revision <= ? ORDER BY revision, position",
        (sid, after, upto),
    ).fetchall()
    log: list[StoredBatch] = []
    cursor = 0
    for expected, row in enumerate(batch_rows, start=after + 1):
        where = f"session {session_id!r} revision {row[0]!r}"
        revision = _typed(path, where, "revision", row[0], int)
        if revision != expected:
            raise _fail(path, f"session {session_id!r} revision {expected}", "the batch is missing")
        _check_version(path, where, row[5])
        count = _typed(path, where, "effect_count", row[4], int)
        effects: list[Effect] = []
        for position in range(count):
            at = f"{where} effect {position}"
            if cursor >= len(effect_rows) or effect_rows[cursor][:2] != (revision, position):
                raise _fail(path, at, "the effect is missing")
            effect_row = effect_rows[cursor]
            cursor += 1
            _check_version(path, at, effect_row[2])
            body = _typed(path, at, "body", effect_row[3], bytes)
            decoded = codec.decode_effects(body, where=f"{at} in {path}")
            if len(decoded) != 1:
                raise _fail(path, at, f"the record holds {len(decoded)} effects, not 1")
            effects.append(decoded[0])
        if cursor < len(effect_rows) and effect_rows[cursor][0] == revision:
            raise _fail(path, f"{where} effect {effect_rows[cursor][1]!r}", "orphan effect row")
        log.append(
            StoredBatch(
                revision=revision,
                step=_typed(path, where, "step", row[1], str),
                cycle=_typed(path, where, "cycle", row[2], int),
                timestamp=_typed(path, where, "timestamp", row[3], float),
                effects=tuple(effects),
            )
        )
    if len(log) != upto - after:
        missing = after + len(log) + 1
        raise _fail(path, f"session {session_id!r} revision {missing}", "the batch is missing")
    if cursor != len(effect_rows):
        orphan = effect_rows[cursor]
        raise _fail(
            path,
            f"session {session_id!r} revision {orphan[0]!r} effect {orphan[1]!r}",
            "orphan effect row",
        )
    return log


def replay(
    session: Session[Any], log: Sequence[StoredBatch], path: str, session_id: str
) -> Session[Any]:
    """Apply ``log`` to ``session``; a stored effect that no longer applies is a StoredDataError."""
    for batch in log:
        try:
            session = apply_batch(session, batch.effects)
        except EffectError as exc:
            raise _fail(
                path, f"session {session_id!r} revision {batch.revision}", f"does not apply: {exc}"
            ) from exc
    return session


# -- writing -------------------------------------------------------------------


def insert_session(conn: sqlite3.Connection, session_id: str, revision: int) -> int:
    """Insert a session row at ``revision``; return its new ``sid``. Add a snapshot next."""
    sid = conn.execute(
        "INSERT INTO sessions (session_id, revision, schema_version, snapshot_revision, "
        "snapshot_bytes, pending_bytes) VALUES (?, ?, ?, 0, 0, 0)",
        (session_id, revision, SCHEMA_VERSION),
    ).lastrowid
    assert sid is not None  # an INSERT into a rowid table always sets it
    return sid


def insert_snapshot(
    conn: sqlite3.Connection, codec: Codec[Any], sid: int, session: Session[Any]
) -> None:
    """Store ``session`` as the snapshot of ``sid`` at its revision, the latest one.

    Replaces a snapshot at the same revision; resets the session row's
    snapshot bookkeeping to this one (write snapshots oldest first).
    """
    body = codec.encode_session(session)
    conn.execute(
        "INSERT OR REPLACE INTO snapshots (sid, revision, schema_version, body) "
        "VALUES (?, ?, ?, ?)",
        (sid, session.revision, SCHEMA_VERSION, body),
    )
    conn.execute(
        "UPDATE sessions SET snapshot_revision = ?, snapshot_bytes = ?, pending_bytes = 0 "
        "WHERE sid = ?",
        (session.revision, len(body), sid),
    )


def insert_batch(
    conn: sqlite3.Connection,
    sid: int,
    revision: int,
    step: str,
    cycle: int,
    timestamp: float,
    bodies: Sequence[bytes],
) -> None:
    """Append one batch row and its effect rows; move the session row to ``revision``."""
    conn.execute(
        "INSERT INTO batches (sid, revision, step, cycle, timestamp, effect_count, schema_version) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        (sid, revision, step, cycle, float(timestamp), len(bodies), SCHEMA_VERSION),
    )
    conn.executemany(
        "INSERT INTO effects (sid, revision, position, schema_version, body) "
        "VALUES (?, ?, ?, ?, ?)",
        [(sid, revision, position, SCHEMA_VERSION, body) for position, body in enumerate(bodies)],
    )
    conn.execute(
        "UPDATE sessions SET revision = ?, pending_bytes = pending_bytes + ? WHERE sid = ?",
        (revision, sum(len(body) for body in bodies), sid),
    )
