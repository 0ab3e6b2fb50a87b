"""What the SQL byte backends share: one :class:`SQLTxn` over their row modules.

SQLite (:mod:`._sqlite_log`) and PostgreSQL (:mod:`._postgres_log`) store a
session the same way: a session row (:class:`._sqlite_rows.SessionRow`, whose
never reused ``sid`` and revision are the position the core's compare-and-set
proves), one batch row and one row per effect, checked snapshots. Reading the
rows back, offering the snapshot, and the compare-and-set append are the same
against either database; only the SQL differs, and that is in each backend's
row module (:mod:`._sqlite_rows`, :mod:`._postgres_rows`), which a subclass
names as :attr:`SQLTxn.ROWS`. A subclass adds what differs: how the session
row is read (PostgreSQL locks it in a write transaction), ``create`` and
``delete``.

Everything here is synchronous and runs in a worker thread, inside the
transaction the store opened.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any, ClassVar

from stepmachine import SessionNotFoundError, StoredDataError

from ._backend import Base, Cached, EffectRows, Marks, Moved, NewSnapshot, StoredBatch, Tail
from ._media_blobs import blobs_to_write
from ._sqlite_rows import SessionRow, marks_of

__all__ = ["SQLTxn"]


class SQLTxn:
    """The core's view of one transaction on an SQL backend (see the module docstring).

    Args:
        connection: the backend's connection, inside a transaction.
        label: how errors name the database (a path, a DSN without secrets).
    """

    FORM: ClassVar[type[EffectRows]] = EffectRows
    ROWS: ClassVar[ModuleType]
    """The backend's row module: ``read_snapshot``, ``read_log``, ``advance_session_row``,
    ``insert_batch``, ``insert_snapshot``, ``prune_snapshots``, ``held_blobs``,
    ``insert_blobs``, ``read_blob`` with the same signatures."""
    STORE: ClassVar[str]
    """The store's class name, for remedies in error messages."""

    def __init__(self, connection: Any, label: str) -> None:
        self.conn = connection
        self.label = label
        self._rows: dict[str, SessionRow] = {}

    def _read_row(self, session_id: str) -> SessionRow | None:
        """The checked session row as stored, or ``None`` (subclasses)."""
        raise NotImplementedError

    def row(self, session_id: str) -> SessionRow:
        """The checked session row, read once per transaction.

        Raises:
            SessionNotFoundError: no session has this id.
        """
        row = self._rows.get(session_id)
        if row is None:
            row = self._read_row(session_id)
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
        if row.revision < cached.session.revision:  # revisions only grow: damage, or a restore
            return Moved(rewritten=True, remedy=f"open a new {self.STORE}")
        return self.records(session_id, cached.session.revision, None, None)

    def bases(self, session_id: str, upto: int | None) -> Iterator[Base[SessionRow]]:
        """The newest snapshot at or before ``upto`` (there is always one at 0)."""
        row = self.row(session_id)
        last = row.revision if upto is None else upto
        found = self.ROWS.read_snapshot(self.conn, self.label, session_id, row.sid, last)
        if found is None:
            raise StoredDataError(
                f"stored data is data: session {session_id!r} in {self.label} "
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
        log = self.ROWS.read_log(self.conn, self.label, session_id, row.sid, after, last)
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
        still ``at`` (a ``sid`` is never reused, the revision only grows).
        A backend that fences writes with a lease adds its condition in
        :meth:`_advance`, which raises its lease error instead of returning False.
        """
        assert isinstance(batch, EffectRows)  # FORM says so
        rows = self.ROWS
        moved = SessionRow(at.sid, batch.revision, *marks)
        if not self._advance(session_id, at.revision, moved):
            self._rows.pop(session_id, None)
            return None
        header = (batch.revision, batch.step, batch.cycle, batch.timestamp)
        rows.insert_batch(self.conn, at.sid, *header, batch.effects, batch.refused, batch.trace)
        if snapshot is not None:
            rows.insert_snapshot(self.conn, at.sid, snapshot.revision, snapshot.record)
            rows.prune_snapshots(self.conn, at.sid, snapshot.revision)
        self._rows[session_id] = moved
        return moved

    def _advance(self, session_id: str, expected: int, row: SessionRow) -> bool:
        """The compare-and-set ``UPDATE`` of the session row to ``row``: whether it matched
        (False writes nothing). A subclass may add a condition (a lease) here."""
        return bool(self.ROWS.advance_session_row(self.conn, session_id, expected, row))

    def unusable(self, session_id: str, base: Base[SessionRow], reason: str) -> None:
        """Never called: the only base offered is the one a replay needs."""
        del session_id, base, reason

    @property
    def media_label(self) -> str:
        """The media table, as errors name it."""
        return f"the media table of {self.label}"

    def blob(self, digest: str) -> bytes | None:
        """The media row's body for ``digest``, or None."""
        return self.ROWS.read_blob(self.conn, digest)  # type: ignore[no-any-return]

    def put_blobs(self, blobs: Mapping[str, bytes]) -> None:
        """Insert the media rows of ``blobs`` the table does not hold, and rewrite
        those it holds damaged (:func:`._media_blobs.blobs_to_write`), in this
        transaction (so with the batch or snapshot that refers to them, or not at all)."""
        missing = blobs_to_write(
            blobs,
            lambda digests: self.ROWS.held_blobs(self.conn, digests),
            self.blob,
            self.media_label,
        )
        if missing:
            self.ROWS.insert_blobs(self.conn, missing)
