"""Reading and writing the rows of :class:`~stepmachine.stores.PostgresStore`.

The layout is in :mod:`._postgres_schema`; the rows, their checksums and the
compression of bodies are SQLite's (:mod:`._sqlite_rows`), and so are the
checks a row passes before any of its columns is used (checksum, row version,
column types, a complete log, bodies that decompress): reading fails closed
(stored data is data) with a :class:`~stepmachine.StoredDataError` naming the
database, the table, the session, the revision and the effect index, and
nothing here ever rewrites a row it read.

Everything here is synchronous and runs in a worker thread, on a connection
the caller holds, inside a transaction (:func:`._postgres_schema.transaction`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final

from stepmachine.extend import Lease

from ._backend import EffectRows
from ._listing import ListedSession
from ._media_blobs import named_digests, unreferenced
from ._postgres_leases import fenced_condition
from ._postgres_schema import ROW_VERSIONS, SCHEMA, SCHEMA_VERSION, TRAIL_FROM
from ._sqlite_rows import (
    SessionRow,
    assemble_log,
    batch_row_values,
    check_row_version,
    check_session_row,
    compact,
    copied_rows,
    scan_session_rows,
)
from ._sqlite_rows import _plain as plain
from ._sqlite_rows import _stored_record as stored_record
from ._sqlite_rows import _typed as typed
from ._sqlite_rows import _verify as verify
from ._sqlite_schema import checksum

if TYPE_CHECKING:
    import psycopg

__all__ = [
    "advance_session_row",
    "copy_log",
    "delete_session",
    "held_blobs",
    "insert_batch",
    "insert_blobs",
    "insert_session",
    "insert_snapshot",
    "prune_snapshots",
    "read_blob",
    "read_log",
    "read_snapshot",
    "session_digests",
    "session_ids",
    "session_row",
    "sweep_blobs",
    "write_session_row",
]

_JSON_START: Final = b"{"
_EFFECTS_START: Final = b"["


def _check_version(label: str, where: str, version: object) -> None:
    check_row_version(label, where, version, ROW_VERSIONS)


# -- sessions ------------------------------------------------------------------

_SESSION_COLUMNS = (
    "session_id, sid, revision, schema_version, snapshot_revision, snapshot_bytes, "
    "pending_bytes, crc"
)
_SELECT_SESSION = f"SELECT {_SESSION_COLUMNS} FROM {SCHEMA}.sessions WHERE session_id = %s"  # noqa: S608 - fixed names
_SET_SESSION = (
    f"UPDATE {SCHEMA}.sessions SET revision = %s, schema_version = %s, "  # noqa: S608 - fixed names
    "snapshot_revision = %s, snapshot_bytes = %s, pending_bytes = %s, crc = %s WHERE sid = %s"
)
# The compare-and-set; fenced by a lease, the lease's owner and epoch join the
# condition (and its expiry): a fenced-off holder's append writes nothing.
_ADVANCE_SESSION = _SET_SESSION + " AND revision = %s"
_ADVANCE_LEASED_SESSION = _ADVANCE_SESSION + fenced_condition


def _session_from(label: str, row: Sequence[Any], session_id: str | None = None) -> SessionRow:
    return check_session_row(label, row, session_id, ROW_VERSIONS)


def session_row(
    conn: psycopg.Connection[Any], label: str, session_id: str, *, lock: bool
) -> SessionRow | None:
    """The checked row of ``session_id`` (locked ``FOR UPDATE`` when ``lock``), or ``None``."""
    query = _SELECT_SESSION + (" FOR UPDATE" if lock else "")
    row = conn.execute(query, (session_id,)).fetchone()
    return None if row is None else _session_from(label, row, session_id)


def session_ids(conn: psycopg.Connection[Any], label: str) -> list[str]:
    """The ids of all sessions, sorted; every row is checked."""
    ids: list[str] = []
    for row in conn.execute(f"SELECT {_SESSION_COLUMNS} FROM {SCHEMA}.sessions"):  # noqa: S608 - fixed names
        _session_from(label, row)
        ids.append(typed(label, f"session {row[0]!r}", "session_id", row[0], str))
    return sorted(ids)


def session_entries(conn: psycopg.Connection[Any], label: str) -> list[ListedSession]:
    """Every session, a damaged row marked unreadable (see :mod:`._listing`)."""
    rows = conn.execute(f"SELECT {_SESSION_COLUMNS} FROM {SCHEMA}.sessions")  # noqa: S608 - fixed names
    return scan_session_rows(rows, label, ROW_VERSIONS)


def _session_values(session_id: str, row: SessionRow) -> tuple[Any, ...]:
    return (session_id, row.sid, row.revision, SCHEMA_VERSION, *row[2:])


def insert_session(conn: psycopg.Connection[Any], session_id: str, record_bytes: int) -> int | None:
    """Insert the revision-0 row of ``session_id`` (its snapshot ``record_bytes`` long);
    its new ``sid``, or ``None`` when the id is taken (nothing is written then)."""
    found = conn.execute(f"SELECT nextval(pg_get_serial_sequence('{SCHEMA}.sessions', 'sid'))")
    (sid,) = found.fetchone() or (None,)
    assert isinstance(sid, int)  # nextval always returns one
    values = _session_values(session_id, SessionRow(sid, 0, 0, record_bytes, 0))
    inserted = conn.execute(
        f"INSERT INTO {SCHEMA}.sessions ({_SESSION_COLUMNS}) "  # noqa: S608 - fixed names
        "VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (session_id) DO NOTHING",
        (*values, checksum("sessions", values)),
    )
    return sid if inserted.rowcount == 1 else None


def write_session_row(conn: psycopg.Connection[Any], session_id: str, row: SessionRow) -> None:
    """Set every column of the row of ``row.sid`` (``session_id``), with its checksum."""
    values = _session_values(session_id, row)
    conn.execute(_SET_SESSION, (*values[2:], checksum("sessions", values), row.sid))


def advance_session_row(
    conn: psycopg.Connection[Any],
    session_id: str,
    expected: int,
    row: SessionRow,
    lease: Lease | None = None,
) -> bool:
    """Compare-and-set: write ``row`` (with its checksum) if ``row.sid`` is still at ``expected``
    (and, with ``lease``, while it is the session's live lease).

    One ``UPDATE ... WHERE sid = %s AND revision = %s`` (with ``lease``: ``AND
    lease_owner = %s AND lease_epoch = %s AND lease_expires_at > now()``);
    whether it matched. At READ COMMITTED a concurrent writer's (or claimer's)
    ``UPDATE`` of the row makes this one wait for its commit and then re-check
    the condition on the new row, so two writers never both match, and a
    holder fenced off meanwhile does not. ``False`` leaves the database unchanged.
    """
    values = _session_values(session_id, row)
    params = (*values[2:], checksum("sessions", values), row.sid, expected)
    if lease is None:
        cursor = conn.execute(_ADVANCE_SESSION, params)
    else:
        cursor = conn.execute(_ADVANCE_LEASED_SESSION, (*params, lease.owner, lease.epoch))
    return cursor.rowcount == 1


def delete_session(conn: psycopg.Connection[Any], sid: int) -> None:
    """Delete the rows of ``sid`` in every table."""
    for table in ("effects", "batches", "snapshots", "sessions"):
        conn.execute(f"DELETE FROM {SCHEMA}.{table} WHERE sid = %s", (sid,))  # noqa: S608 - fixed names


# -- snapshots -----------------------------------------------------------------

_SELECT_SNAPSHOT = (
    f"SELECT sid, revision, schema_version, body, crc FROM {SCHEMA}.snapshots "  # noqa: S608 - fixed names
    "WHERE sid = %s AND revision <= %s ORDER BY revision DESC LIMIT 1"
)
_INSERT_SNAPSHOT = (
    f"INSERT INTO {SCHEMA}.snapshots (sid, revision, schema_version, body, crc) "  # noqa: S608 - fixed names
    "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (sid, revision) DO UPDATE SET "
    "schema_version = EXCLUDED.schema_version, body = EXCLUDED.body, crc = EXCLUDED.crc"
)


def read_snapshot(
    conn: psycopg.Connection[Any], label: str, session_id: str, sid: int, upto: int
) -> tuple[int, bytes, str] | None:
    """The newest snapshot with ``revision <= upto``, checked: its revision, the codec's
    session record (decompressed) and how errors name it; ``None`` if there is none."""
    row = conn.execute(_SELECT_SNAPSHOT, (sid, upto)).fetchone()
    if row is None:
        return None
    where = f"session {session_id!r} snapshot at revision {row[1]!r} (table snapshots)"
    verify(label, where, "snapshots", tuple(row[:4]), row[4])
    revision = typed(label, where, "revision", row[1], int)
    _check_version(label, where, row[2])
    body = stored_record(label, where, typed(label, where, "body", row[3], bytes), _JSON_START)
    return revision, body, f"{where} in {label}"


def insert_snapshot(conn: psycopg.Connection[Any], sid: int, revision: int, record: bytes) -> None:
    """Store the codec's session ``record`` (compressed) as the snapshot of ``sid`` at
    ``revision``, replacing one at the same revision."""
    values = (sid, revision, SCHEMA_VERSION, compact(record))
    conn.execute(_INSERT_SNAPSHOT, (*values, checksum("snapshots", values)))


def prune_snapshots(conn: psycopg.Connection[Any], sid: int, newest: int) -> None:
    """Delete the snapshots of ``sid`` that ``newest`` supersedes: all but 0 and ``newest``."""
    conn.execute(
        f"DELETE FROM {SCHEMA}.snapshots WHERE sid = %s AND revision > 0 AND revision < %s",  # noqa: S608 - fixed names
        (sid, newest),
    )


# -- the log -------------------------------------------------------------------

_BATCH_COLUMNS = "sid, revision, step, cycle, ts, effect_count, schema_version, refused, trace, crc"
_EFFECT_COLUMNS = "sid, revision, position, schema_version, body, crc"
_INSERT_BATCH = (
    f"INSERT INTO {SCHEMA}.batches ({_BATCH_COLUMNS}) "  # noqa: S608 - fixed names
    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
)
_INSERT_EFFECT = f"INSERT INTO {SCHEMA}.effects ({_EFFECT_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s)"  # noqa: S608 - fixed names
_SELECT_BATCHES = (
    f"SELECT {_BATCH_COLUMNS} FROM {SCHEMA}.batches "  # noqa: S608 - fixed names
    "WHERE sid = %s AND revision > %s AND revision <= %s ORDER BY revision"
)
_SELECT_EFFECTS = (
    f"SELECT {_EFFECT_COLUMNS} FROM {SCHEMA}.effects "  # noqa: S608 - fixed names
    "WHERE sid = %s AND revision > %s AND revision <= %s ORDER BY revision, position"
)


def _log_rows(
    conn: psycopg.Connection[Any], sid: int, after: int, upto: int
) -> tuple[list[Any], list[Any]]:
    """The batch rows and effect rows of ``sid`` with ``after < revision <= upto``, in order."""
    batch_rows = conn.execute(_SELECT_BATCHES, (sid, after, upto)).fetchall()
    effect_rows = conn.execute(_SELECT_EFFECTS, (sid, after, upto)).fetchall()
    return batch_rows, effect_rows


def read_log(
    conn: psycopg.Connection[Any], label: str, session_id: str, sid: int, after: int, upto: int
) -> list[EffectRows]:
    """The batches with ``after < revision <= upto``, checked to be complete, not decoded.

    Reads only those rows and checks them as SQLite's are
    (:func:`._sqlite_rows.assemble_log`); every row version may hold a
    compressed body.
    """
    batch_rows, effect_rows = _log_rows(conn, sid, after, upto)
    return assemble_log(
        label,
        session_id,
        after,
        upto,
        batch_rows,
        effect_rows,
        row_versions=ROW_VERSIONS,
        compressed_from=min(ROW_VERSIONS),
        trail_from=TRAIL_FROM,
        timestamp_column="ts",
    )


def insert_batch(
    conn: psycopg.Connection[Any],
    sid: int,
    revision: int,
    step: str,
    cycle: int,
    timestamp: float,
    bodies: Sequence[bytes],
    refused: str | None,
    trace: str | None,
) -> None:
    """Append one batch row and its effect rows (one ``executemany``), with their checksums.

    ``refused`` and ``trace`` are the batch's, as :class:`._backend.EffectRows` holds them.

    The effect rows go first: psycopg runs ``executemany`` in pipeline mode,
    after which the server does not arm ``idle_in_transaction_session_timeout``
    until the next statement; the batch row's plain ``INSERT`` is that
    statement, so a process stalled after it, holding the session row
    locked, is still cut off (see ``PostgresStore.open``).
    """
    header = (sid, revision, step, cycle, timestamp)
    batch, effects = batch_row_values(*header, bodies, refused, trace, SCHEMA_VERSION)
    with conn.cursor() as cursor:
        cursor.executemany(_INSERT_EFFECT, effects)
    conn.execute(_INSERT_BATCH, batch)


def copy_log(
    conn: psycopg.Connection[Any], label: str, session_id: str, source: int, target: int, upto: int
) -> None:
    """Copy the batch and effect rows of ``source`` with ``revision <= upto`` to ``target``.

    Each row is checked against its checksum, then written under ``target``
    with a new one; bodies are not decoded. :class:`StoredDataError` for a row
    that does not match (the caller's transaction rolls back: nothing written).
    """
    rows = _log_rows(conn, source, 0, upto)
    batches, effects = copied_rows(label, session_id, target, *rows, trail_from=TRAIL_FROM)
    with conn.cursor() as cursor:
        cursor.executemany(_INSERT_BATCH, batches)
        cursor.executemany(_INSERT_EFFECT, effects)


# -- media blobs ---------------------------------------------------------------


def held_blobs(conn: psycopg.Connection[Any], digests: Sequence[str]) -> dict[str, int]:
    """The stored size of each of ``digests`` the media table holds (made by
    ``prepare_schema``), those rows locked ``FOR KEY SHARE`` until the caller's
    transaction ends: a delete's :func:`sweep_blobs` waits for the record that
    relies on them, and a row it removed first is not reported (so written anew)."""
    rows = conn.execute(
        f"SELECT digest, octet_length(body) FROM {SCHEMA}.media "  # noqa: S608 - fixed names
        "WHERE digest = ANY(%s) FOR KEY SHARE",
        (list(digests),),
    ).fetchall()
    return {row[0]: row[1] for row in rows}


def insert_blobs(conn: psycopg.Connection[Any], blobs: dict[str, bytes]) -> None:
    """Store ``blobs`` (digest to bytes) in the caller's transaction, over a
    damaged row the caller found (a row a concurrent transaction stored first
    holds the same bytes: overwriting it changes nothing)."""
    with conn.cursor() as cursor:
        cursor.executemany(
            f"INSERT INTO {SCHEMA}.media (digest, body) VALUES (%s, %s) "  # noqa: S608 - fixed names
            "ON CONFLICT (digest) DO UPDATE SET body = excluded.body",
            sorted(blobs.items()),
        )


def read_blob(conn: psycopg.Connection[Any], digest: str) -> bytes | None:
    """The body stored under ``digest``, or None."""
    row = conn.execute(
        f"SELECT body FROM {SCHEMA}.media WHERE digest = %s",  # noqa: S608 - fixed names
        (digest,),
    ).fetchone()
    if row is None:
        return None
    body = row[0]
    return bytes(body) if isinstance(body, bytes | bytearray | memoryview) else b""


def session_digests(conn: psycopg.Connection[Any], sid: int) -> set[str] | None:
    """The digests the effect and snapshot rows of ``sid`` name
    (:func:`._media_blobs.named_digests`); None when a body cannot be read."""
    bodies = (
        plain(row[0])
        for table in ("effects", "snapshots")
        for row in conn.execute(
            f"SELECT body FROM {SCHEMA}.{table} WHERE sid = %s",  # noqa: S608 - fixed names
            (sid,),
        )
    )
    return named_digests(bodies)


def sweep_blobs(conn: psycopg.Connection[Any], candidates: set[str]) -> int:
    """Delete the media rows of ``candidates`` that no effect or snapshot row names,
    in the caller's transaction; how many.

    The candidate rows are locked ``FOR UPDATE`` first: that waits for every
    transaction that found them held (:func:`held_blobs`) and appends a record
    naming them, and the scan after it (a new statement, so a new snapshot
    under READ COMMITTED) sees those records. The scan reads the bodies
    through a server-side cursor (the store's records never all in memory).
    """
    locked = {
        row[0]
        for row in conn.execute(
            f"SELECT digest FROM {SCHEMA}.media WHERE digest = ANY(%s) FOR UPDATE",  # noqa: S608 - fixed names
            (sorted(candidates),),
        )
    }
    if not locked:
        return 0

    def bodies() -> Iterator[bytes | None]:
        for table in ("effects", "snapshots"):
            with conn.cursor(name=f"stepmachine_media_sweep_{table}") as cursor:
                cursor.itersize = 256
                cursor.execute(f"SELECT body FROM {SCHEMA}.{table}")  # noqa: S608 - fixed names
                for row in cursor:
                    yield plain(bytes(row[0]) if isinstance(row[0], memoryview) else row[0])

    gone = sorted(unreferenced(locked, bodies()))
    if gone:
        conn.execute(
            f"DELETE FROM {SCHEMA}.media WHERE digest = ANY(%s)",  # noqa: S608 - fixed names
            (gone,),
        )
    return len(gone)
