"""The SQLite byte backend: :class:`SQLiteTxn` implements the core's
:class:`._backend.LogTxn` on one connection, inside one transaction.

A session's position is its :class:`._sqlite_rows.SessionRow`: the never
reused ``sid`` proves the session was not deleted and re-created, and the
revision is the one the compare-and-set (``UPDATE sessions ... WHERE sid = ?
AND revision = ?``) expects. The session row also keeps the snapshot policy's
bookkeeping (:class:`._backend.Marks`). Rows are checked (checksum, schema
version, types, completeness) and effect bodies decompressed here
(:mod:`._sqlite_rows`); decoding them is the core's.

Everything here is synchronous and runs in the store's worker thread, inside
the transaction the store opened (:func:`._sqlite_schema.transaction`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from typing import ClassVar

from stepmachine import SessionExistsError, SessionNotFoundError, StoredDataError

from . import _sqlite_rows as _rows
from ._backend import Base, Cached, EffectRows, Marks, Moved, NewSnapshot, StoredBatch, Tail
from ._sqlite_rows import SessionRow

__all__ = ["SQLiteTxn"]


class SQLiteTxn:
    """The core's view of one SQLite transaction (see the module docstring).

    Args:
        connection: the store's connection, inside a transaction.
        path: the database file, for error messages.
    """

    FORM: ClassVar[type[EffectRows]] = EffectRows

    def __init__(self, connection: sqlite3.Connection, path: str) -> None:
        self._conn = connection
        self._path = path
        self._rows: dict[str, SessionRow] = {}

    def row(self, session_id: str) -> SessionRow:
        """The checked session row, read once per transaction.

        Raises:
            SessionNotFoundError: no session has this id.
        """
        row = self._rows.get(session_id)
        if row is None:
            row = _rows.session_row(self._conn, self._path, session_id)
            if row is None:
                raise SessionNotFoundError(session_id)
            self._rows[session_id] = row
        return row

    def head(self, session_id: str) -> int | None:
        """The revision in the session row."""
        return self.row(session_id).revision

    def tail(self, session_id: str, cached: Cached[SessionRow]) -> Tail[SessionRow] | Moved:
        """The rows after the cached revision; Moved when the session was re-created."""
        row = self.row(session_id)
        if row.sid != cached.position.sid:
            return Moved(rewritten=False)
        if row.revision < cached.session.revision:  # revisions only grow: damage
            return Moved(rewritten=True, remedy="open a new SQLiteStore")
        return self.records(session_id, cached.session.revision, None, None)

    def bases(self, session_id: str, upto: int | None) -> Iterator[Base[SessionRow]]:
        """The newest snapshot at or before ``upto`` (there is always one at 0)."""
        row = self.row(session_id)
        found = _rows.read_snapshot(
            self._conn, self._path, session_id, row.sid, row.revision if upto is None else upto
        )
        if found is None:
            raise StoredDataError(
                f"invariant 8 (stored data is data): session {session_id!r} in {self._path} "
                "has no snapshot at revision 0"
            )
        revision, record, where = found
        yield Base(revision, record, where, row)

    def records(
        self, session_id: str, after: int, upto: int | None, start: SessionRow | None
    ) -> Tail[SessionRow]:
        """The batches in ``(after, upto]``, read from the batch and effect rows."""
        del start  # rows are found by revision
        row = self.row(session_id)
        last = row.revision if upto is None else upto
        log = _rows.read_log(self._conn, self._path, session_id, row.sid, after, last)
        return Tail(log, row, _rows.marks_of(row), self._path)

    def append(
        self,
        session_id: str,
        at: SessionRow,
        batch: StoredBatch,
        marks: Marks,
        snapshot: NewSnapshot | None,
    ) -> SessionRow | None:
        """The compare-and-set ``UPDATE``, the batch row, its effect rows and the snapshot.

        Nothing is read: the ``UPDATE``'s row count proves the session row is
        still ``at`` (a ``sid`` is never reused, the revision only grows).
        """
        assert isinstance(batch, EffectRows)  # FORM says so
        moved = SessionRow(at.sid, batch.revision, *marks)
        if not _rows.advance_session_row(self._conn, session_id, at.revision, moved):
            self._rows.pop(session_id, None)
            return None
        header = (batch.revision, batch.step, batch.cycle, batch.timestamp)
        _rows.insert_batch(self._conn, at.sid, *header, batch.effects)
        if snapshot is not None:
            _rows.insert_snapshot(self._conn, at.sid, snapshot.revision, snapshot.record)
            _rows.prune_snapshots(self._conn, at.sid, snapshot.revision)
        self._rows[session_id] = moved
        return moved

    def create(self, session_id: str, record: bytes) -> tuple[SessionRow, Marks]:
        """The session row and its revision-0 snapshot."""
        if _rows.session_row(self._conn, self._path, session_id) is not None:
            raise SessionExistsError(session_id)
        sid = _rows.insert_session(self._conn, session_id)
        _rows.insert_snapshot(self._conn, sid, 0, record)
        row = SessionRow(sid, 0, 0, len(record), 0)
        _rows.write_session_row(self._conn, session_id, row)
        self._rows[session_id] = row
        return row, _rows.marks_of(row)

    def delete(self, session_id: str) -> None:
        """The session's rows in every table."""
        sid = self.row(session_id).sid
        for table in ("effects", "batches", "snapshots", "sessions"):
            self._conn.execute(f"DELETE FROM {table} WHERE sid = ?", (sid,))  # noqa: S608 - fixed names
        self._rows.pop(session_id, None)

    def unusable(self, session_id: str, base: Base[SessionRow], reason: str) -> None:
        """Never called: the only base SQLite offers is the one a replay needs."""
        del session_id, base, reason
