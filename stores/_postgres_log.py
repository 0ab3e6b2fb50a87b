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

Fencing. A txn made with a :class:`~stepmachine.Lease` appends only while
that lease is the session's live lease: its owner, epoch and expiry join the
compare-and-set ``UPDATE`` (:func:`._postgres_rows.advance_session_row`), so
the check and the write are one statement under the row lock. When that
``UPDATE`` matches nothing, the row is read again, locked, in the same
transaction: a lost lease raises :class:`~stepmachine.LeaseLostError` (nothing
was written); otherwise the revision moved on, and ``append`` returns None as
without a lease (the core reads the log again: a conflict, or a retry).

Everything here is synchronous and runs in a worker thread, inside the
transaction the store opened (:func:`._postgres_schema.transaction`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from stepmachine import SessionExistsError
from stepmachine.extend import Lease

from . import _postgres_leases as _leases
from . import _postgres_rows as _rows
from ._backend import Marks
from ._sql_txn import SQLTxn
from ._sqlite_rows import SessionRow, marks_of

if TYPE_CHECKING:
    import psycopg

__all__ = ["PostgresTxn"]


class PostgresTxn(SQLTxn):
    """The core's view of one PostgreSQL transaction (see the module docstring).

    Reading, the snapshot offered and the compare-and-set append are
    :class:`._sql_txn.SQLTxn`'s, over :mod:`._postgres_rows`.

    Args:
        connection: a connection of the store's pool, inside a transaction.
        label: how errors name the database.
        write: the transaction writes: session rows are read ``FOR UPDATE``.
        lease: the lease that fences this transaction's appends, if any.
    """

    ROWS: ClassVar = _rows
    STORE: ClassVar[str] = "PostgresStore"

    def __init__(
        self,
        connection: psycopg.Connection[Any],
        label: str,
        *,
        write: bool,
        lease: Lease | None = None,
    ) -> None:
        super().__init__(connection, label)
        self._write = write
        self._lease = lease

    def _read_row(self, session_id: str) -> SessionRow | None:
        return _rows.session_row(self.conn, self.label, session_id, lock=self._write)

    def _advance(self, session_id: str, expected: int, row: SessionRow) -> bool:
        """The compare-and-set, fenced by the lease when there is one.

        Raises:
            LeaseLostError: the lease is not the session's live lease; nothing written.
        """
        lease = self._lease
        if lease is None:
            return super()._advance(session_id, expected, row)
        if _rows.advance_session_row(self.conn, session_id, expected, row, lease):
            return True
        _leases.check(self.conn, lease)  # a lost lease raises; else the revision moved
        return False

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
