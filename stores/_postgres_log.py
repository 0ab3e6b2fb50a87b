"""The PostgreSQL byte backend: :class:`PostgresTxn` implements the core's
:class:`._backend.LogTxn` on one pooled connection, inside one transaction.

As in SQLite (:mod:`._sqlite_log`), a session's position is its
:class:`._sqlite_rows.SessionRow`: the never reused ``sid`` proves the session
was not deleted and re-created, and the revision is the one the
compare-and-set (``UPDATE ... WHERE sid = %s AND revision = %s``) expects; the
row keeps the snapshot policy's bookkeeping too.

Isolation. A write transaction runs at READ COMMITTED, where two statements
may see different commits; so, in a write transaction, the session row is read
``FOR UPDATE``: once read, no other writer moves it before this one commits,
and the core's "read the log again, then compare-and-set once more" cannot
fail twice. An apply on top of this store's cache reads nothing at all: its
``UPDATE`` is the compare-and-set, and PostgreSQL's row lock orders it against
any other writer's. A read transaction is ``REPEATABLE READ``: one snapshot.

Everything here is synchronous and runs in a worker thread, inside the
transaction the store opened (:func:`._postgres_schema.transaction`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from stepmachine import SessionExistsError, SessionNotFoundError

from . import _postgres_rows as _rows
from ._backend import Base, Cached, EffectRows, Marks, Moved, NewSnapshot, StoredBatch, Tail
from ._sqlite_rows import SessionRow, marks_of

if TYPE_CHECKING:
    import psycopg

__all__ = ["PostgresTxn"]


class PostgresTxn:
    """The core's view of one PostgreSQL transaction (see the module docstring).

    Args:
        connection: a connection of the store's pool, inside a transaction.
        label: how errors name the database.
        write: the transaction writes: session rows are read ``FOR UPDATE``.
    """

    FORM: ClassVar[type[EffectRows]] = EffectRows

    def __init__(self, connection: psycopg.Connection[Any], label: str, *, write: bool) -> None:
        self.conn = connection
        self.label = label
        self._write = write
        self._rows: dict[str, SessionRow] = {}

    def row(self, session_id: str) -> SessionRow:
        """The checked session row, read once per transaction (locked when writing).

        Raises:
            SessionNotFoundError: no session has this id.
        """
        row = self._rows.get(session_id)
        if row is None:
            row = _rows.session_row(self.conn, self.label, session_id, lock=self._write)
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
        if row.revision < cached.session.revision:  # revisions only grow: a restored backup
            return Moved(rewritten=True, remedy="open a new PostgresStore")
        return self.records(session_id, cached.session.revision, None, None)

    def bases(self, session_id: str, upto: int | None) -> Iterator[Base[SessionRow]]:
        """The newest snapshot at or before ``upto`` (there is always one at 0)."""
        row = self.row(session_id)
        last = row.revision if upto is None else upto
        found = _rows.read_snapshot(self.conn, self.label, session_id, row.sid, last)
        if found is None:
            raise _rows.no_snapshot(self.label, session_id)
        revision, record, where = found
        yield Base(revision, record, where, row)

    def records(
        self, session_id: str, after: int, upto: int | None, start: SessionRow | None
    ) -> Tail[SessionRow]:
        """The batches in ``(after, upto]``, read from the batch and effect rows."""
        del start  # rows are found by revision
        row = self.row(session_id)
        last = row.revision if upto is None else upto
        log = _rows.read_log(self.conn, self.label, session_id, row.sid, after, last)
        return Tail(log, row, marks_of(row), self.label)

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
        still ``at``. With leases (next), the same ``UPDATE`` will also name
        the holder's owner and epoch, and a fenced-off holder will get the
        lease error instead of None.
        """
        assert isinstance(batch, EffectRows)  # FORM says so
        moved = SessionRow(at.sid, batch.revision, *marks)
        if not _rows.advance_session_row(self.conn, session_id, at.revision, moved):
            self._rows.pop(session_id, None)
            return None
        header = (batch.revision, batch.step, batch.cycle, batch.timestamp)
        _rows.insert_batch(self.conn, at.sid, *header, batch.effects)
        if snapshot is not None:
            _rows.insert_snapshot(self.conn, at.sid, snapshot.revision, snapshot.record)
            _rows.prune_snapshots(self.conn, at.sid, snapshot.revision)
        self._rows[session_id] = moved
        return moved

    def create(self, session_id: str, record: bytes) -> tuple[SessionRow, Marks]:
        """The session row and its revision-0 snapshot."""
        sid = _rows.insert_session(self.conn, session_id, len(record))
        if sid is None:
            raise SessionExistsError(session_id)
        _rows.insert_snapshot(self.conn, sid, 0, record)
        row = SessionRow(sid, 0, 0, len(record), 0)
        self._rows[session_id] = row
        return row, marks_of(row)

    def delete(self, session_id: str) -> None:
        """The session's rows in every table."""
        _rows.delete_session(self.conn, self.row(session_id).sid)
        self._rows.pop(session_id, None)

    def unusable(self, session_id: str, base: Base[SessionRow], reason: str) -> None:
        """Never called: the only base offered is the one a replay needs."""
        del session_id, base, reason
