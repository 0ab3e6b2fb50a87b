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
from collections.abc import Mapping
from typing import ClassVar

from stepmachine import SessionExistsError

from . import _sqlite_rows as _rows
from ._backend import Marks
from ._sql_txn import SQLTxn
from ._sqlite_rows import SessionRow

__all__ = ["SQLiteTxn"]


class SQLiteTxn(SQLTxn):
    """The core's view of one SQLite transaction (see the module docstring).

    Reading, the snapshot offered and the compare-and-set append are
    :class:`._sql_txn.SQLTxn`'s, over :mod:`._sqlite_rows`.

    Args:
        connection: the store's connection, inside a transaction; or a cursor of it
            (the apply path reuses one: every statement here reads its result at
            once, before the next one runs).
        path: the database file, for error messages.
    """

    ROWS: ClassVar = _rows
    STORE: ClassVar[str] = "SQLiteStore"

    def __init__(self, connection: sqlite3.Connection | sqlite3.Cursor, path: str) -> None:
        super().__init__(connection, path)

    def _read_row(self, session_id: str) -> SessionRow | None:
        return _rows.session_row(self.conn, self.label, session_id)

    def create(self, session_id: str, record: bytes) -> tuple[SessionRow, Marks]:
        """The session row and its revision-0 snapshot."""
        if _rows.session_row(self.conn, self.label, session_id) is not None:
            raise SessionExistsError(session_id)
        sid = _rows.insert_session(self.conn, session_id)
        _rows.insert_snapshot(self.conn, sid, 0, record)
        row = SessionRow(sid, 0, 0, len(record), 0)
        _rows.write_session_row(self.conn, session_id, row)
        self._rows[session_id] = row
        return row, _rows.marks_of(row)

    def put_blobs(self, blobs: Mapping[str, bytes]) -> None:
        """As :meth:`._sql_txn.SQLTxn.put_blobs`; nothing to do (no statement) for none,
        the usual batch."""
        if blobs:
            super().put_blobs(blobs)

    def delete(self, session_id: str) -> None:
        """The session's rows in every table."""
        sid = self.row(session_id).sid
        for table in ("effects", "batches", "snapshots", "sessions"):
            self.conn.execute(f"DELETE FROM {table} WHERE sid = ?", (sid,))  # noqa: S608 - fixed names
        self._rows.pop(session_id, None)
