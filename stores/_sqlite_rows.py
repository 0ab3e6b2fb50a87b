"""Reading and writing the rows of :class:`~stepmachine.stores.SQLiteStore`.

The layout, its migrations and the checksum are in :mod:`._sqlite_schema`.

Everything here is synchronous and runs in the store's worker thread, on a
connection the caller holds exclusively, inside a transaction.

Every row is written with its ``crc`` (:func:`._sqlite_schema.checksum`) in
the same statement, and every row read is checked against it before any of
its columns is used. Reading fails closed (stored data is data): a row whose checksum
does not match, a row of an unknown schema version, a column of the wrong
type, a gap in the log, a compressed effect body in a version-2 row, ``refused``
or ``trace`` in a batch row older than version 4, a ``body`` in a batch row
older than version 5 (or one that is not a JSON array of ``effect_count``
effect records in a row of version 5), an effect row where the batch row
holds its effects, or a compressed body that does not decompress raises
:class:`~stepmachine.StoredDataError` naming the file, the table, the
session, the revision and the effect index. Nothing here ever rewrites a row
it read. Records are handed to the stores' core (:mod:`._core`) as bytes; it
decodes them (an undecodable record or a stored effect that no longer applies
is its StoredDataError, naming the same position).
"""

from __future__ import annotations

import sqlite3
import zlib
from collections.abc import Iterable, Sequence
from typing import Any, Final, NamedTuple

import msgspec

from stepmachine import StoredDataError

from ._backend import EffectRows, Marks
from ._inflate import compressed, inflate
from ._listing import ListedSession, scan_rows
from ._media_blobs import named_digests, unreferenced
from ._snapshot_policy import Weighted
from ._sqlite_schema import (
    COMPRESSED_EFFECTS_FROM,
    INLINE_FROM,
    ROW_VERSIONS,
    SCHEMA_VERSION,
    TRAIL_FROM,
    checksum,
)

__all__ = [
    "COMPRESS_FROM",
    "SNAPSHOT_EVERY",
    "SNAPSHOT_MAX_GAP",
    "SessionRow",
    "advance_session_row",
    "compact",
    "copy_log",
    "held_blobs",
    "insert_batch",
    "insert_blobs",
    "insert_session",
    "insert_snapshot",
    "marks_of",
    "prune_snapshots",
    "read_blob",
    "read_log",
    "read_snapshot",
    "session_digests",
    "session_ids",
    "session_row",
    "sweep_blobs",
    "wants_snapshot",
    "write_session_row",
]

SNAPSHOT_EVERY = 100
"""The fewest revisions between two periodic snapshots."""

SNAPSHOT_MAX_GAP = 1000
"""The most revisions between two snapshots."""


class SessionRow(NamedTuple):
    """The row of one session: its never-reused ``sid``, revision and snapshot bookkeeping."""

    sid: int
    revision: int
    snapshot_revision: int
    snapshot_bytes: int
    pending_bytes: int


def _fail(path: str, where: str, problem: str) -> StoredDataError:
    return StoredDataError(f"stored data is data: {where} in {path}: {problem}")


def _verify(path: str, where: str, table: str, values: tuple[Any, ...], stored: object) -> None:
    """Raise unless ``stored`` is the checksum of ``values``, a row of ``table``."""
    computed = checksum(table, values)
    if stored != computed or not isinstance(stored, int):
        raise _fail(
            path,
            where,
            f"the {table} row does not match its checksum (crc column holds {stored!r}, "
            f"the row's content gives {computed}): it was damaged or moved after it was written",
        )


def check_row_version(
    label: str, where: str, version: object, row_versions: tuple[int, ...]
) -> int:
    """The row's schema version, one of ``row_versions``, or StoredDataError."""
    if not isinstance(version, int) or version not in row_versions:
        readable = " and ".join(map(str, row_versions))
        raise _fail(
            label, where, f"record schema version is {version!r}, this code reads {readable}"
        )
    return version


def _check_version(path: str, where: str, version: object) -> int:
    """The row's schema version, one of :data:`._sqlite_schema.ROW_VERSIONS`, or StoredDataError."""
    return check_row_version(path, where, version, ROW_VERSIONS)


def _typed(path: str, where: str, column: str, value: Any, kind: type) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _fail(path, where, f"column {column} holds {value!r}, not {kind.__name__}")
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise _fail(path, where, f"column {column} holds {value!r}, not UTF-8 text") from None
    return value


# -- sessions ------------------------------------------------------------------

_SESSION_COLUMNS = (
    "session_id, sid, revision, schema_version, snapshot_revision, snapshot_bytes, "
    "pending_bytes, crc"
)
_SESSION_NAMES = ("sid", "revision", "snapshot_revision", "snapshot_bytes", "pending_bytes")


def check_session_row(
    label: str, row: Sequence[Any], session_id: str | None, row_versions: tuple[int, ...]
) -> SessionRow:
    """Check one ``sessions`` row (its :data:`_SESSION_COLUMNS`, the same in every SQL
    backend) and return it; StoredDataError naming ``label`` otherwise."""
    stored_id = row[0]
    name = stored_id if session_id is None else session_id
    where = f"session {name!r} (table sessions, revision {row[2]!r} as stored)"
    _verify(label, where, "sessions", tuple(row[:7]), row[7])
    if session_id is not None and stored_id != session_id:
        raise _fail(label, where, f"the row found for it holds session id {stored_id!r}")
    check_row_version(label, where, row[3], row_versions)
    values = [row[1], row[2], *row[4:7]]
    for column, value in zip(_SESSION_NAMES, values, strict=True):
        _typed(label, where, column, value, int)
    if min(values) < 0 or values[2] > values[1]:
        raise _fail(label, where, f"inconsistent session row {values!r} for {_SESSION_NAMES!r}")
    return SessionRow(*values)


def _session_from(path: str, row: Sequence[Any], session_id: str | None = None) -> SessionRow:
    return check_session_row(path, row, session_id, ROW_VERSIONS)


_SELECT_SESSION = f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE session_id = ?"  # noqa: S608
_UPDATE_SESSION = (
    "UPDATE sessions SET revision = ?, schema_version = ?, snapshot_revision = ?, "
    "snapshot_bytes = ?, pending_bytes = ?, crc = ? WHERE sid = ?"
)
_ADVANCE_SESSION = _UPDATE_SESSION + " AND revision = ?"


def session_row(conn: sqlite3.Connection, path: str, session_id: str) -> SessionRow | None:
    """The checked row of ``session_id``, or ``None`` when there is none."""
    row = conn.execute(_SELECT_SESSION, (session_id,)).fetchone()
    return None if row is None else _session_from(path, row, session_id)


def session_ids(conn: sqlite3.Connection, path: str) -> list[str]:
    """The ids of all sessions, sorted; every row is checked."""
    ids: list[str] = []
    for row in conn.execute(f"SELECT {_SESSION_COLUMNS} FROM sessions"):  # noqa: S608 - fixed names
        _session_from(path, row)
        ids.append(_typed(path, f"session {row[0]!r}", "session_id", row[0], str))
    return sorted(ids)


def scan_session_rows(
    rows: Iterable[Sequence[Any]], label: str, row_versions: tuple[int, ...]
) -> list[ListedSession]:
    """Every ``sessions`` row (its :data:`_SESSION_COLUMNS`, the same in every SQL backend)
    as a listed session, sorted: a row that fails its checks is marked unreadable with
    the :class:`StoredDataError` message instead of failing the whole listing."""

    def check(row: Sequence[Any]) -> None:
        check_session_row(label, row, None, row_versions)
        _typed(label, f"session {row[0]!r}", "session_id", row[0], str)

    return scan_rows(rows, _listed_id, check)


def _listed_id(row: Sequence[Any]) -> str:
    """The id of a listed row: its ``session_id``, or a description when that is not text."""
    stored = row[0]
    return stored if isinstance(stored, str) else f"<a row whose session_id is {stored!r}>"


def session_entries(conn: sqlite3.Connection, path: str) -> list[ListedSession]:
    """Every session, a damaged row marked unreadable (see :mod:`._listing`)."""
    rows = conn.execute(f"SELECT {_SESSION_COLUMNS} FROM sessions")  # noqa: S608 - fixed names
    return scan_session_rows(rows, path, ROW_VERSIONS)


def insert_session(conn: sqlite3.Connection, session_id: str) -> int:
    """Insert a row for ``session_id``; return its new ``sid``.

    The row is a placeholder without a checksum: in the same transaction,
    write a snapshot and then :func:`write_session_row`.
    """
    sid = conn.execute(
        "INSERT INTO sessions (session_id, revision, schema_version, snapshot_revision, "
        "snapshot_bytes, pending_bytes) VALUES (?, 0, ?, 0, 0, 0)",
        (session_id, SCHEMA_VERSION),
    ).lastrowid
    assert sid is not None  # an INSERT into a rowid table always sets it
    return sid


def write_session_row(conn: sqlite3.Connection, session_id: str, row: SessionRow) -> None:
    """Set every column of the row of ``row.sid`` (``session_id``), with its checksum."""
    values = (session_id, row.sid, row.revision, SCHEMA_VERSION, *row[2:])
    conn.execute(_UPDATE_SESSION, (*values[2:], checksum("sessions", values), row.sid))


def advance_session_row(
    conn: sqlite3.Connection, session_id: str, expected: int, row: SessionRow
) -> bool:
    """Compare-and-set: write ``row`` (with its checksum) if ``row.sid`` is still at ``expected``.

    One ``UPDATE ... WHERE sid = ? AND revision = ?``; returns whether it
    matched the row. The revision only grows and a ``sid`` is never reused,
    so a match proves the row is the one the caller last read or wrote, and
    nothing is read. ``False`` (no row matched: another writer moved it, or
    the session was deleted) leaves the database unchanged; the caller reads
    the row only then, to say why.
    """
    values = (session_id, row.sid, row.revision, SCHEMA_VERSION, *row[2:])
    cursor = conn.execute(
        _ADVANCE_SESSION, (*values[2:], checksum("sessions", values), row.sid, expected)
    )
    return cursor.rowcount == 1


def wants_snapshot(row: SessionRow, revision: int, batch_bytes: int, replaces: bool) -> bool:
    """Whether the batch producing ``revision`` (``batch_bytes`` of effects) ends with a snapshot.

    The core's :class:`._snapshot_policy.Weighted` policy with this module's
    :data:`SNAPSHOT_EVERY` and :data:`SNAPSHOT_MAX_GAP` (read at each call), on
    the bookkeeping of ``row``.
    """
    policy = Weighted(SNAPSHOT_EVERY, SNAPSHOT_MAX_GAP)
    return policy.due(marks_of(row), revision, batch_bytes, replaces)


def marks_of(row: SessionRow) -> Marks:
    """The snapshot bookkeeping a session row holds."""
    return Marks(row.snapshot_revision, row.snapshot_bytes, row.pending_bytes)


# -- snapshots -----------------------------------------------------------------

_SNAPSHOT_SELECT = "SELECT sid, revision, schema_version, body, crc FROM snapshots "
_SELECT_SNAPSHOT = (
    _SNAPSHOT_SELECT + "WHERE sid = ? AND revision > ? AND revision <= ? "
    "ORDER BY revision DESC LIMIT 1"
)
_INSERT_SNAPSHOT = (
    "INSERT OR REPLACE INTO snapshots (sid, revision, schema_version, body, crc) "
    "VALUES (?, ?, ?, ?, ?)"
)
_PRUNE_SNAPSHOTS = "DELETE FROM snapshots WHERE sid = ? AND revision > 0 AND revision < ?"

"""Snapshots are compressed fast: they are written on the apply path (amortised)."""

_JSON_START = b"{"
_EFFECTS_START = b"["
_ZLIB_START = b"\x78"  # the first byte of every zlib stream (deflate, 32 KiB window)


def _stored_record(path: str, where: str, body: bytes, json_start: bytes) -> bytes:
    """The codec record in a stored ``body`` (a snapshot or an effect row): as stored,
    or decompressed.

    A body starting with ``json_start`` (``{`` for a session, ``[`` for effects)
    is the JSON record as it is (as written before bodies were compressed, and
    still for short effect records); one starting with ``0x78`` is that record
    compressed with zlib. Anything else, or a stream that does not decompress,
    raises :class:`StoredDataError`.
    """
    start = body[:1]
    if start == json_start:
        return body
    if start == _ZLIB_START:
        try:
            return inflate(body)
        except zlib.error as exc:
            raise _fail(path, where, f"the compressed body does not decompress: {exc}") from None
    raise _fail(path, where, f"the body starts with {start!r}, neither JSON nor zlib")


def read_snapshot(
    conn: sqlite3.Connection, path: str, session_id: str, sid: int, upto: int
) -> tuple[int, bytes, str] | None:
    """The newest snapshot with ``revision <= upto``, checked: its revision, the
    codec's session record (decompressed) and how errors name it; ``None`` if
    there is none."""
    row = conn.execute(_SELECT_SNAPSHOT, (sid, -1, upto)).fetchone()
    if row is None:
        return None
    where = f"session {session_id!r} snapshot at revision {row[1]!r} (table snapshots)"
    _verify(path, where, "snapshots", tuple(row[:4]), row[4])
    revision = _typed(path, where, "revision", row[1], int)
    _check_version(path, where, row[2])
    body = _stored_record(path, where, _typed(path, where, "body", row[3], bytes), _JSON_START)
    return revision, body, f"{where} in {path}"


def insert_snapshot(conn: sqlite3.Connection, sid: int, revision: int, record: bytes) -> None:
    """Store the codec's session ``record`` as the snapshot of ``sid`` at ``revision``.

    The body is the record compressed with zlib (a conversation's JSON shrinks
    several times); the snapshot policy weighs the record's size before
    compression. Replaces a snapshot at the same revision. The caller records
    the snapshot in the session row (:func:`write_session_row`) and prunes
    the ones it supersedes (:func:`prune_snapshots`).
    """
    body = compressed(record)  # None: too long to be inflated back; stored as it is
    values = (sid, revision, SCHEMA_VERSION, record if body is None else body)
    conn.execute(_INSERT_SNAPSHOT, (*values, checksum("snapshots", values)))


def prune_snapshots(conn: sqlite3.Connection, sid: int, newest: int) -> None:
    """Delete the snapshots of ``sid`` that ``newest`` supersedes: all but 0 and ``newest``.

    Revision 0 stays (it holds what ``create`` was given, and rebuilds any
    revision before ``newest``); the newest bounds what a load replays. So a
    session keeps at most two snapshots, and its bytes on disk stay
    proportional to its log, whatever its length.
    """
    conn.execute(_PRUNE_SNAPSHOTS, (sid, newest))


# -- the log -------------------------------------------------------------------

_BATCH_COLUMNS = (
    "sid, revision, step, cycle, timestamp, effect_count, schema_version, refused, trace, crc"
)
_EFFECT_COLUMNS = "sid, revision, position, schema_version, body, crc"
_INSERT_BATCH = f"INSERT INTO batches ({_BATCH_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"  # noqa: S608
_INSERT_INLINE = (
    f"INSERT INTO batches ({_BATCH_COLUMNS}, body) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"  # noqa: S608
)
_INSERT_EFFECT = f"INSERT INTO effects ({_EFFECT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)"  # noqa: S608
_SELECT_BATCHES = (
    f"SELECT {_BATCH_COLUMNS}, body FROM batches "  # noqa: S608 - fixed names
    "WHERE sid = ? AND revision > ? AND revision <= ? ORDER BY revision"
)
_SELECT_EFFECTS = (
    f"SELECT {_EFFECT_COLUMNS} FROM effects "  # noqa: S608 - fixed names
    "WHERE sid = ? AND revision > ? AND revision <= ? ORDER BY revision, position"
)


def _log_rows(
    conn: sqlite3.Connection, sid: int, after: int, upto: int
) -> tuple[list[Any], list[Any]]:
    """The batch rows and effect rows of ``sid`` with ``after < revision <= upto``, in order."""
    batch_rows = conn.execute(_SELECT_BATCHES, (sid, after, upto)).fetchall()
    effect_rows = conn.execute(_SELECT_EFFECTS, (sid, after, upto)).fetchall()
    return batch_rows, effect_rows


def read_log(
    conn: sqlite3.Connection, path: str, session_id: str, sid: int, after: int, upto: int
) -> list[EffectRows]:
    """The batches with ``after < revision <= upto``, checked to be complete, not decoded.

    Reads only those rows and checks them with :func:`assemble_log` (only a
    row of version 3 or later may hold a compressed effect body). Decoding
    the records is the core's (:mod:`._replay`).
    """
    batch_rows, effect_rows = _log_rows(conn, sid, after, upto)
    return assemble_log(
        path,
        session_id,
        after,
        upto,
        batch_rows,
        effect_rows,
        row_versions=ROW_VERSIONS,
        compressed_from=COMPRESSED_EFFECTS_FROM,
        trail_from=TRAIL_FROM,
        timestamp_column="timestamp",
        inline_from=INLINE_FROM,
    )


def _inline(version: object, inline_from: int | None) -> bool:
    """Whether a ``batches`` row of ``version`` holds its effects in ``body``."""
    return (
        inline_from is not None
        and isinstance(version, int)
        and not isinstance(version, bool)
        and version >= inline_from
    )


def _checked_batch_row(
    label: str, where: str, row: Sequence[Any], trail_from: int, inline_from: int | None = None
) -> bool:
    """Check one ``batches`` row (:data:`_BATCH_COLUMNS`, then ``body`` when ``inline_from``
    is given) against its checksum; whether the checksum covers ``refused`` and ``trace``.

    A row of version ``trail_from`` or later has ``crc`` over ``refused`` and
    ``trace`` too; an older row (written before the columns were added) has
    it over the others, and must hold NULL in both. With ``inline_from``
    (SQLite), a row of that version or later has ``crc`` over ``body`` too
    (its effects); an older row must hold NULL there.
    """
    version = row[6]
    trail = isinstance(version, int) and not isinstance(version, bool) and version >= trail_from
    table = f"{where} (table batches)"
    if _inline(version, inline_from):
        _verify(label, table, "batches", (*row[:9], row[10]), row[9])
        return True
    _verify(label, table, "batches", tuple(row[: 9 if trail else 7]), row[9])
    if not trail and (row[7] is not None or row[8] is not None):
        raise _fail(
            label,
            where,
            f"the batches row of schema version {version!r} holds refused {row[7]!r} and "
            f"trace {row[8]!r}; rows hold them from version {trail_from}",
        )
    if inline_from is not None and row[10] is not None:
        raise _fail(
            label,
            where,
            f"the batches row of schema version {version!r} holds a body; rows hold their "
            f"effects there from version {inline_from}",
        )
    return trail


def assemble_log(
    label: str,
    session_id: str,
    after: int,
    upto: int,
    batch_rows: Sequence[Sequence[Any]],
    effect_rows: Sequence[Sequence[Any]],
    *,
    row_versions: tuple[int, ...],
    compressed_from: int,
    trail_from: int,
    timestamp_column: str,
    inline_from: int | None = None,
) -> list[EffectRows]:
    """The batches in ``(after, upto]`` from their rows, as the SQL backends store them.

    ``batch_rows`` are ``(sid, revision, step, cycle, timestamp, effect_count,
    schema_version, refused, trace, crc)`` (then ``body`` with ``inline_from``:
    SQLite) and ``effect_rows`` ``(sid, revision, position, schema_version,
    body, crc)``, both in revision (and position) order. A batch row of
    version ``inline_from`` or later holds its effects in ``body``
    (:func:`inline_body`) and has no effect rows. Every row is checked
    against its checksum, row version (one of ``row_versions``) and column
    types, and each effect body decompressed (a row older than ``compressed_from`` may not hold a
    compressed one; a batch row older than ``trail_from`` holds neither
    ``refused`` nor ``trace``, and its checksum does not cover them);
    :class:`StoredDataError` for a row that does not match, a missing batch or
    effect, or an orphan effect, naming ``label``, the table, revision and
    effect index. Shared by SQLite and PostgreSQL.
    """
    log: list[EffectRows] = []
    cursor = 0
    for expected, row in enumerate(batch_rows, start=after + 1):
        where = f"session {session_id!r} revision {row[1]!r}"
        _checked_batch_row(label, where, row, trail_from, inline_from)
        revision = _typed(label, where, "revision", row[1], int)
        if revision != expected:
            raise _fail(
                label, f"session {session_id!r} revision {expected}", "the batch is missing"
            )
        version = check_row_version(label, where, row[6], row_versions)
        count = _typed(label, where, "effect_count", row[5], int)
        records: list[bytes] = []
        if _inline(version, inline_from):
            records.extend(_inline_records(label, where, row[10], count))
            count = 0  # no effect rows
        for position in range(count):
            at = f"{where} effect {position}"
            found = tuple(effect_rows[cursor][1:3]) if cursor < len(effect_rows) else None
            if found != (revision, position):
                raise _fail(label, at, "the effect is missing")
            effect_row = effect_rows[cursor]
            cursor += 1
            _verify(label, f"{at} (table effects)", "effects", tuple(effect_row[:5]), effect_row[5])
            version = check_row_version(label, at, effect_row[3], row_versions)
            if inline_from is not None and version >= inline_from:
                raise _fail(
                    label,
                    at,
                    f"an effects row of schema version {version}: from version {inline_from} "
                    "a batch keeps its effects in its own row",
                )
            body = _typed(label, at, "body", effect_row[4], bytes)
            if version < compressed_from and body[:1] == _ZLIB_START:
                raise _fail(
                    label,
                    at,
                    f"the effects row of schema version {version} holds a compressed body; "
                    f"compressed effect records are written from version {compressed_from}",
                )
            records.append(_stored_record(label, at, body, _EFFECTS_START))
        if cursor < len(effect_rows) and effect_rows[cursor][1] == revision:
            raise _fail(label, f"{where} effect {effect_rows[cursor][2]!r}", "orphan effect row")
        log.append(
            EffectRows(
                revision=revision,
                where=f"{label}: {where}",
                step=_typed(label, where, "step", row[2], str),
                cycle=_typed(label, where, "cycle", row[3], int),
                timestamp=_typed(label, where, timestamp_column, row[4], float),
                effects=tuple(records),
                refused=None if row[7] is None else _typed(label, where, "refused", row[7], str),
                trace=None if row[8] is None else _typed(label, where, "trace", row[8], str),
            )
        )
    if len(log) != upto - after:
        missing = after + len(log) + 1
        raise _fail(label, f"session {session_id!r} revision {missing}", "the batch is missing")
    if cursor != len(effect_rows):
        orphan = effect_rows[cursor]
        raise _fail(
            label,
            f"session {session_id!r} revision {orphan[1]!r} effect {orphan[2]!r}",
            "orphan effect row",
        )
    return log


_SPLIT: Final = msgspec.json.Decoder(list[msgspec.Raw])
"""A batch row's ``body``: a JSON array whose items are the effect records, as written."""


def inline_body(records: Sequence[bytes]) -> bytes:
    """How a batch row of version 5 or later stores its effects ``records`` (one codec
    effects record per effect, each a JSON array): one JSON array holding them, in
    order (``[[...],[...]]``; ``[]`` for none), stored as :func:`compact` says."""
    return compact(b"[" + b",".join(records) + b"]")


def _inline_records(label: str, where: str, body: object, count: int) -> tuple[bytes, ...]:
    """The effect records of a batch row's ``body`` (:func:`inline_body`), checked to be
    ``count`` JSON arrays; StoredDataError naming ``where`` otherwise."""
    stored = _stored_record(label, where, _typed(label, where, "body", body, bytes), _EFFECTS_START)
    try:
        items = _SPLIT.decode(stored)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        problem = f"the body is not a JSON array of effect records: {exc}"
        raise _fail(label, where, problem) from None
    if len(items) != count:
        raise _fail(
            label, where, f"the body holds {len(items)} effect records, effect_count says {count}"
        )
    records = tuple(bytes(item) for item in items)
    for position, record in enumerate(records):
        if record[:1] != _EFFECTS_START:
            raise _fail(label, f"{where} effect {position}", "the effect record is not an array")
    return records


COMPRESS_FROM = 256
"""Effect records of at least this many bytes are stored compressed (when that is smaller)."""


def compact(record: bytes) -> bytes:
    """How an effects ``record`` is stored: compressed with zlib when it is at least
    :data:`COMPRESS_FROM` bytes and that makes it smaller, else as it is.

    Message text and tool content are most of a session's bytes, and JSON of
    natural text shrinks about twice (far more for repetitive text); a short
    record (an ``Increment``, a small note) is not worth the header. Read back
    by :func:`read_log`, which tells the two apart by the first byte (``[`` or
    ``0x78``), like snapshot bodies. The checksum covers the stored bytes.
    Only rows of schema version 3 or later hold compressed records
    (:data:`._sqlite_schema.COMPRESSED_EFFECTS_FROM`), and every row is
    written at :data:`._sqlite_schema.SCHEMA_VERSION`.
    """
    if len(record) < COMPRESS_FROM:
        return record
    packed = compressed(record)
    return packed if packed is not None and len(packed) < len(record) else record


def insert_batch(
    conn: sqlite3.Connection,
    sid: int,
    revision: int,
    step: str,
    cycle: int,
    timestamp: float,
    bodies: Sequence[bytes],
    refused: str | None,
    trace: str | None,
) -> None:
    """Append one batch row holding its effects (``body``, :func:`inline_body`), with its
    checksum: one statement, one b-tree.

    ``refused`` is the batch's refusals as :func:`._replay.encode_refused`
    wrote them (None: none), ``trace`` its traceparent. The caller moves the
    session row to ``revision`` (:func:`write_session_row`).
    """
    body = inline_body(bodies)
    row = (sid, revision, step, cycle, float(timestamp), len(bodies), SCHEMA_VERSION)
    crc = checksum("batches", (*row, refused, trace, body))
    conn.execute(_INSERT_INLINE, (*row, refused, trace, crc, body))


def batch_row_values(
    sid: int,
    revision: int,
    step: str,
    cycle: int,
    timestamp: float,
    bodies: Sequence[bytes],
    refused: str | None,
    trace: str | None,
    version: int,
) -> tuple[tuple[Any, ...], list[tuple[Any, ...]]]:
    """The values of one batch row (:data:`_BATCH_COLUMNS`) and of its effect rows
    (bodies as :func:`compact` stores them), each with its checksum, written as row
    ``version`` (one that holds ``refused`` and ``trace``). Shared by the SQL
    backends."""
    batch = (sid, revision, step, cycle, float(timestamp), len(bodies), version, refused, trace)
    effects = []
    for position, body in enumerate(bodies):
        effect = (sid, revision, position, version, compact(body))
        effects.append((*effect, checksum("effects", effect)))
    return (*batch, checksum("batches", batch)), effects


def copy_log(
    conn: sqlite3.Connection, path: str, session_id: str, source: int, target: int, upto: int
) -> None:
    """Copy the batch and effect rows of ``source`` with ``revision <= upto`` to ``target``.

    Each row is checked against its checksum, then written under ``target``
    with a new one; bodies are not decoded. Raises :class:`StoredDataError`
    for a row that does not match its checksum; nothing is then written (the
    caller's transaction rolls back).
    """
    batch_rows, effect_rows = _log_rows(conn, source, 0, upto)
    inline = []
    older = []
    for row in batch_rows:
        where = f"session {session_id!r} revision {row[1]!r}"
        _checked_batch_row(path, where, row, TRAIL_FROM, INLINE_FROM)
        if _inline(row[6], INLINE_FROM):
            covered = (target, *row[1:9], row[10])  # its checksum covers its body too
            inline.append((*covered[:9], checksum("batches", covered), covered[9]))
        else:
            older.append(row[:10])
    batches, effects = copied_rows(
        path, session_id, target, older, effect_rows, trail_from=TRAIL_FROM
    )
    conn.executemany(_INSERT_BATCH, batches)
    conn.executemany(_INSERT_INLINE, inline)
    conn.executemany(_INSERT_EFFECT, effects)


def copied_rows(
    label: str,
    session_id: str,
    target: int,
    batch_rows: Sequence[Sequence[Any]],
    effect_rows: Sequence[Sequence[Any]],
    *,
    trail_from: int,
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The batch and effect rows of a session, checked against their checksums and
    moved to session ``target`` with new ones (bodies not decoded); StoredDataError
    for a row that does not match. Each row keeps its version, so a batch row
    older than ``trail_from`` keeps a checksum without ``refused`` and ``trace``
    (both NULL). Shared by the SQL backends' ``copy_log``."""
    batches = []
    for row in batch_rows:
        where = f"session {session_id!r} revision {row[1]!r}"
        trail = _checked_batch_row(label, where, row, trail_from)
        covered = (target, *row[1:9])
        crc = checksum("batches", covered if trail else covered[:7])
        batches.append((*covered, crc))
    effects = []
    for row in effect_rows:
        where = f"session {session_id!r} revision {row[1]!r} effect {row[2]!r} (table effects)"
        _verify(label, where, "effects", tuple(row[:5]), row[5])
        values = (target, *row[1:5])
        effects.append((*values, checksum("effects", values)))
    return batches, effects


# -- media blobs ---------------------------------------------------------------

_MEDIA_TABLE = "CREATE TABLE IF NOT EXISTS media (digest TEXT PRIMARY KEY, body BLOB NOT NULL)"
"""The media bytes records refer to, one row per digest (see :mod:`._media_blobs`).

Made by the first write of media (no schema version: code that does not know
it never reads it, and refuses the records that refer to it by their tag). A
row carries no ``crc``: the core checks every body read against its digest,
a SHA-256, which covers the row and the column that places it."""

_IN_CHUNK = 500
"""Digests per ``IN (...)``: below SQLite's smallest limit on bound parameters."""


def held_blobs(conn: sqlite3.Connection, digests: Sequence[str]) -> dict[str, int]:
    """The stored size of each of ``digests`` the media table holds (none when
    there is no table yet; -1 for a body that is not a BLOB)."""
    found: dict[str, int] = {}
    for start in range(0, len(digests), _IN_CHUNK):
        chunk = digests[start : start + _IN_CHUNK]
        marks = ",".join("?" * len(chunk))
        try:
            rows = conn.execute(
                "SELECT digest, CASE typeof(body) WHEN 'blob' THEN length(body) ELSE -1 END "  # noqa: S608 - only ?s
                f"FROM media WHERE digest IN ({marks})",
                tuple(chunk),
            ).fetchall()
        except sqlite3.OperationalError as exc:
            if "no such table" not in str(exc):
                raise
            return {}
        found.update((row[0], row[1]) for row in rows)
    return found


def insert_blobs(conn: sqlite3.Connection, blobs: dict[str, bytes]) -> None:
    """Store ``blobs`` (digest to bytes) that the table does not hold or holds
    damaged (the caller checked: a row there is overwritten), making the table
    first if needed; in the caller's transaction."""
    conn.execute(_MEDIA_TABLE)
    conn.executemany(
        "INSERT INTO media (digest, body) VALUES (?, ?) "
        "ON CONFLICT (digest) DO UPDATE SET body = excluded.body",
        sorted(blobs.items()),
    )


def read_blob(conn: sqlite3.Connection, digest: str) -> bytes | None:
    """The body stored under ``digest``, or None (also when there is no media table)."""
    try:
        row = conn.execute("SELECT body FROM media WHERE digest = ?", (digest,)).fetchone()
    except sqlite3.OperationalError as exc:
        if "no such table" not in str(exc):
            raise
        return None
    if row is None or not isinstance(row[0], bytes):
        return None if row is None else b""  # a body of another type: damaged (digest fails)
    return row[0]


def _plain(body: object) -> bytes | None:
    """A stored body as its uncompressed record, or None when it cannot be read."""
    if not isinstance(body, bytes):
        return None
    if body[:1] == _ZLIB_START:
        try:
            return inflate(body)
        except zlib.error:
            return None
    return body


_BODIES = ("batches", "effects", "snapshots")
"""The tables whose ``body`` holds records (a ``batches`` row of version 4 or older: NULL)."""


def session_digests(conn: sqlite3.Connection, session_id: str) -> set[str] | None:
    """The digests the records of ``session_id`` name (:func:`._media_blobs.named_digests`):
    empty when it has none or there is no session; None when a record cannot be read."""
    row = conn.execute("SELECT sid FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
    if row is None:
        return set()
    bodies = (
        _plain(body)
        for table in _BODIES
        for (body,) in conn.execute(f"SELECT body FROM {table} WHERE sid = ?", (row[0],))  # noqa: S608 - fixed names
        if body is not None or table != "batches"
    )
    return named_digests(bodies)


def sweep_blobs(conn: sqlite3.Connection) -> int:
    """Delete the media rows no effect or snapshot row names
    (:func:`._media_blobs.unreferenced`), in the caller's transaction; how many."""
    try:
        held = {row[0] for row in conn.execute("SELECT digest FROM media")}
    except sqlite3.OperationalError as exc:
        if "no such table" not in str(exc):
            raise
        return 0
    bodies = (
        _plain(body)
        for table in _BODIES
        for (body,) in conn.execute(f"SELECT body FROM {table}")  # noqa: S608 - fixed names
        if body is not None or table != "batches"
    )
    gone = sorted(unreferenced(held, bodies))
    conn.executemany("DELETE FROM media WHERE digest = ?", [(digest,) for digest in gone])
    return len(gone)
