"""The core's view of one lock hold on a FileStore log: :class:`FileTxn`.

:class:`FileTxn` implements :class:`._backend.LogTxn` for
:class:`~stepmachine.stores.FileStore`: it reads and appends the records of one
log (format in :mod:`._file_log`) and reads its snapshot file, through the file
descriptor whose ``fcntl.flock`` the store holds (:mod:`._file_backend`); it
never decodes a record with the codec.

A position (:class:`FilePos`) is the log's nonce (its incarnation), the
offset just past the last record read, and that record's offset and digest:
the log still ends there when it has the same nonce, that size, and the same
bytes at that record. A snapshot is bound to the log the same way.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

import structlog

from stepmachine import StoredDataError

from ._backend import Base, BatchRecord, Cached, Marks, Moved, NewSnapshot, StoredBatch, Tail
from ._file_log import (
    TAG_BATCH,
    TAG_CREATE,
    LastRecord,
    Record,
    Snapshot,
    Torn,
    digest_of,
    encode_packed,
    fsync_dir,
    parse_records,
    read_head,
    read_range,
    read_snapshot,
    snapshot_misfit,
    write_all,
)


class Folder(Protocol):
    """What a :class:`FileTxn` needs of the store's folder (:class:`._file_backend.FileBackend`)."""

    folder: str
    fsync: bool
    torn_seen: set[tuple[str, str, int]]

    def log_path(self, session_id: str) -> str: ...

    def snap_path(self, session_id: str) -> str: ...

    def boundary(self, name: str) -> None: ...

    def new_log(
        self, session_id: str, records: list[bytes], snapshot: NewSnapshot | None
    ) -> FilePos: ...

    def write_snapshot(self, session_id: str, at: FilePos, snapshot: NewSnapshot) -> None: ...

    @property
    def media_folder(self) -> str: ...

    def blob(self, digest: str) -> bytes | None: ...

    def put_blobs(self, blobs: Mapping[str, bytes]) -> None: ...


__all__ = ["FilePos", "FileTxn", "Folder", "log"]

log = structlog.wrap_logger(
    logging.getLogger("stepmachine.stores.file"),
    wrapper_class=structlog.stdlib.BoundLogger,
    processors=[structlog.processors.KeyValueRenderer(key_order=["event"])],
)
"""The ``stepmachine.stores.file`` logger (warnings about torn tails and snapshots)."""

_NOWHERE = LastRecord(0, "")
"""The last record of a position that no record ends (an unbound snapshot's)."""


@dataclass(frozen=True, slots=True)
class FilePos:
    """The log ``nonce`` up to byte ``offset``, where the record ``last`` ends."""

    nonce: str
    offset: int
    last: LastRecord


class FileTxn:
    """The core's view of one lock hold on one session's log (see the module docstring)."""

    FORM: ClassVar[type[BatchRecord]] = BatchRecord

    def __init__(self, backend: Folder, fd: int) -> None:
        self._backend = backend
        self._fd = fd
        self._head: tuple[str, int] | None = None
        self._snapshot: Snapshot | None = None
        self._torn: Torn | None = None

    # -- reading -----------------------------------------------------------------------

    def head(self, session_id: str) -> int | None:
        """Unknown without reading the log: None."""
        del session_id
        return None

    def tail(self, session_id: str, cached: Cached[FilePos]) -> Tail[FilePos] | Moved:
        """The records after the cached position, if the log still holds it."""
        at = cached.position
        nonce, _ = self._log_head(session_id)
        if at.nonce != nonce:
            return Moved(rewritten=False)
        if not self._ends_at(at, os.fstat(self._fd).st_size, exactly=False):
            log.warning(
                "file_store.log_rewritten",
                session_id=session_id,
                path=self._backend.log_path(session_id),
                cached_revision=cached.session.revision,
            )
            return Moved(rewritten=True, remedy="open a new FileStore")
        return self.records(session_id, cached.session.revision, None, at)

    def bases(self, session_id: str, upto: int | None) -> Iterator[Base[FilePos]]:
        """The snapshot (when it is not past ``upto``), then the log's create record."""
        nonce, head_end = self._log_head(session_id)
        snapshot = self._read_snapshot(session_id, nonce)
        if snapshot is not None and (upto is None or snapshot.revision <= upto):
            size = os.fstat(self._fd).st_size
            path = self._backend.log_path(session_id)
            yield Base(
                snapshot.revision,
                snapshot.session,
                f"{snapshot.path} at byte 0",
                FilePos(nonce, snapshot.offset, snapshot.last_record or _NOWHERE),
                problem=snapshot_misfit(self._fd, snapshot, head_end, size, path),
                holder=f"the snapshot {snapshot.path}",
                remedy=f"delete {snapshot.path} and open a new FileStore",
            )
        record, data = self._create_record(session_id, head_end)
        where = f"{self._backend.log_path(session_id)} at byte {record.offset}"
        position = FilePos(nonce, record.end, LastRecord(record.offset, digest_of(data)))
        yield Base(0, record.payload, where, position)

    def records(
        self, session_id: str, after: int, upto: int | None, start: FilePos | None
    ) -> Tail[FilePos]:
        """The batch records in ``(after, upto]``, from ``start`` (or the snapshot, or
        the start of the log); a torn final record is noted and reported."""
        path = self._backend.log_path(session_id)
        nonce, head_end = self._log_head(session_id)
        begin = self._start_for(session_id, nonce, head_end, after) if start is None else start
        size = os.fstat(self._fd).st_size
        data = read_range(self._fd, begin.offset, size)
        parsed, torn = parse_records(data, begin.offset, path, session=session_id)
        if begin.offset == head_end and parsed:
            first = parsed.pop(0)  # the create record, a base of its own
            if first.tag != TAG_CREATE or first.revision != 0:
                raise StoredDataError(
                    f"stored data is data: expected the create record in {path} "
                    f"at byte {first.offset}, found a {first.tag.decode()!r} record"
                )
        found: list[StoredBatch] = []
        last: Record | None = None
        for record in parsed:
            if upto is not None and record.revision > upto:
                break
            if record.tag != TAG_BATCH:
                raise StoredDataError(
                    f"stored data is data: expected a batch record in {path} at "
                    f"byte {record.offset}, found a {record.tag.decode()!r} record for revision "
                    f"{record.revision}"
                )
            last = record
            if record.revision > after:
                where = f"{path} at byte {record.offset}"
                found.append(BatchRecord(record.revision, where, record.payload))
        position = begin
        if last is not None:
            span = data[last.offset - begin.offset : last.end - begin.offset]
            position = FilePos(nonce, last.end, LastRecord(last.offset, digest_of(span)))
        if upto is None and torn is not None:
            reached = last.revision if last is not None else after
            self._note_torn(session_id, nonce, torn, reached)
        return Tail(found, position, Marks(), path)

    # -- writing -----------------------------------------------------------------------

    def append(
        self,
        session_id: str,
        at: FilePos,
        batch: StoredBatch,
        marks: Marks,
        snapshot: NewSnapshot | None,
    ) -> FilePos | None:
        """Append the record if the log still ends at ``at`` (a torn final record
        after it, noted by this transaction's read, is cut off first); then fsync,
        and write the snapshot if one is given."""
        del marks  # the file policy needs none kept
        assert isinstance(batch, BatchRecord)  # FORM says so
        backend = self._backend
        nonce, _ = self._log_head(session_id)
        size = os.fstat(self._fd).st_size
        torn = self._torn
        if nonce != at.nonce or not self._ends_at(at, size, exactly=torn is None):
            return None
        if size != at.offset:
            if torn is None or (torn.offset, torn.offset + torn.length) != (at.offset, size):
                return None
            os.ftruncate(self._fd, torn.offset)
            log.warning(
                "file_store.torn_tail_truncated",
                session_id=session_id,
                path=backend.log_path(session_id),
                offset=torn.offset,
                length=torn.length,
            )
            self._torn = None
        record = encode_packed(TAG_BATCH, batch.revision, batch.record)
        try:
            write_all(self._fd, record)
            backend.boundary("apply.written")
            if backend.fsync:
                os.fsync(self._fd)
        except OSError:
            with contextlib.suppress(OSError):  # best effort; the next apply cuts a torn tail
                os.ftruncate(self._fd, at.offset)
            raise
        backend.boundary("apply.synced")
        position = FilePos(nonce, at.offset + len(record), LastRecord(at.offset, digest_of(record)))
        if snapshot is not None:
            backend.write_snapshot(session_id, position, snapshot)
        return position

    def create(self, session_id: str, record: bytes) -> tuple[FilePos, Marks]:
        """A new log holding the create record (see :meth:`._file_backend.FileBackend.new_log`)."""
        position = self._backend.new_log(session_id, [encode_packed(TAG_CREATE, 0, record)], None)
        return position, Marks()

    def delete(self, session_id: str) -> None:
        """The snapshot (and a temporary one), then the log (the caller holds its lock)."""
        backend = self._backend
        for path in (
            backend.snap_path(session_id),
            os.path.join(backend.folder, f".{session_id}.snap.tmp"),
        ):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        os.unlink(backend.log_path(session_id))
        if backend.fsync:
            fsync_dir(backend.folder)

    @property
    def media_label(self) -> str:
        """The folder of media blobs, as errors name it."""
        return self._backend.media_folder

    def blob(self, digest: str) -> bytes | None:
        """The blob file's bytes (:meth:`._file_backend.FileBackend.blob`)."""
        return self._backend.blob(digest)

    def put_blobs(self, blobs: Mapping[str, bytes]) -> None:
        """Write and fsync the missing blob files, before the record that refers to them."""
        self._backend.put_blobs(blobs)

    def unusable(self, session_id: str, base: Base[FilePos], reason: str) -> None:
        """Report the snapshot not used: an unbound one (from an earlier version) at
        info level, any other as a warning; the next snapshot written replaces it."""
        snapshot = self._snapshot
        if snapshot is not None and snapshot.last_record is None:
            log.info(
                "file_store.unbound_snapshot_ignored",
                session_id=session_id,
                path=snapshot.path,
                revision=base.revision,
            )
        else:
            self._snapshot_ignored(session_id, reason)

    # -- the pieces ----------------------------------------------------------------------

    def _log_head(self, session_id: str) -> tuple[str, int]:
        if self._head is None:
            self._head = read_head(self._fd, session_id, self._backend.log_path(session_id))
        return self._head

    def _ends_at(self, at: FilePos, size: int, *, exactly: bool) -> bool:
        """Whether the log (``size`` bytes) still holds ``at.last``, byte for byte,
        ending at ``at.offset`` (and nothing after it, when ``exactly``)."""
        if at.offset > size or (exactly and at.offset != size):
            return False
        return digest_of(read_range(self._fd, at.last.offset, at.offset)) == at.last.digest

    def _create_record(self, session_id: str, head_end: int) -> tuple[Record, bytes]:
        """The log's first record after the head, checked to be the create record."""
        path = self._backend.log_path(session_id)
        data = read_range(self._fd, head_end, os.fstat(self._fd).st_size)
        newline = data.find(b"\n")
        records, _ = parse_records(
            data[: newline + 1] if newline >= 0 else b"", head_end, path, session=session_id
        )
        if not records:
            raise StoredDataError(f"stored data is data: {path} holds no complete create record")
        record = records[0]
        if record.tag != TAG_CREATE or record.revision != 0:
            raise StoredDataError(
                f"stored data is data: expected the create record in {path} at "
                f"byte {record.offset}, found a {record.tag.decode()!r} record for revision "
                f"{record.revision}"
            )
        return record, data[: record.end - head_end]

    def _start_for(self, session_id: str, nonce: str, head_end: int, after: int) -> FilePos:
        """Where to read the batches after ``after``: the snapshot's end when it is
        not later and fits this log; when it is later (the last batches before a
        snapshot: a traced run's link, an audit of recent batches), the record
        of revision ``after + 1``, found reading back from the snapshot's end;
        else the start of the log."""
        snapshot = self._read_snapshot(session_id, nonce)
        if snapshot is not None:
            path = self._backend.log_path(session_id)
            size = os.fstat(self._fd).st_size
            misfit = snapshot_misfit(self._fd, snapshot, head_end, size, path)
            if misfit is None and snapshot.last_record is not None:
                if snapshot.revision <= after:
                    return FilePos(nonce, snapshot.offset, snapshot.last_record)
                start = self._record_before(head_end, snapshot.offset, snapshot.revision, after)
                if start is not None:
                    return FilePos(nonce, start, _NOWHERE)
            elif snapshot.revision <= after:
                base = Base(snapshot.revision, b"", "", FilePos(nonce, 0, _NOWHERE))
                self.unusable(session_id, base, misfit or "")
        return FilePos(nonce, head_end, _NOWHERE)

    def _record_before(self, head_end: int, end: int, revision: int, after: int) -> int | None:
        """The offset of the record of revision ``after + 1`` (or of an earlier one, the
        create record at the latest), reading back from ``end``, where the record of
        ``revision`` (> ``after``) ends; ``None`` when a line there does not start with
        a record header (the caller then reads the log from its start, which names the
        damage).

        Records are lines (no payload holds a raw newline), so every byte after a
        newline starts a record. The first read spans about as many bytes as the
        records wanted take on average in this log; each further read doubles it.
        O(bytes of the records after ``after``), not O(log).
        """
        wanted = revision - after + 1
        span = end - head_end
        window = max(512, (span // max(revision, 1) + 1) * wanted * 5 // 4)
        while True:
            low = max(head_end, end - window)
            data = read_range(self._fd, low, end)
            boundaries = [index + 1 for index in _newlines(data) if index + 1 < len(data)]
            if low == head_end:
                boundaries.insert(0, 0)
            for boundary in reversed(boundaries):
                fields = data[boundary : boundary + 64].split(b" ", 3)
                if len(fields) < 4 or not fields[2].isdigit():
                    return None
                if int(fields[2]) <= after + 1:
                    return low + boundary
            if low == head_end:
                return None
            window *= 2

    def _read_snapshot(self, session_id: str, nonce: str) -> Snapshot | None:
        """The snapshot of this incarnation of the log (``nonce``), if there is one.

        It is checked as a file only (checksum, format), not yet against the log.
        A damaged or unreadable one is ignored with a warning, and so is one of
        an earlier incarnation (a stale one).
        """
        path = self._backend.snap_path(session_id)
        try:
            snapshot = read_snapshot(path, session_id, nonce)
        except (StoredDataError, OSError) as exc:
            self._snapshot_ignored(session_id, str(exc))
            return None
        if snapshot is not None and snapshot.stale:
            log.warning("file_store.stale_snapshot_ignored", session_id=session_id, path=path)
            return None
        self._snapshot = snapshot
        return snapshot

    def _snapshot_ignored(self, session_id: str, reason: str) -> None:
        log.warning(
            "file_store.damaged_snapshot_ignored",
            session_id=session_id,
            path=self._backend.snap_path(session_id),
            reason=reason,
        )

    def _note_torn(self, session_id: str, nonce: str, torn: Torn, revision: int) -> None:
        """Keep the torn tail for :meth:`append`; report each one once per instance."""
        self._torn = torn
        path = self._backend.log_path(session_id)
        key = (path, nonce, torn.offset)
        if key not in self._backend.torn_seen:
            self._backend.torn_seen.add(key)
            log.warning(
                "file_store.torn_tail_ignored",
                session_id=session_id,
                path=path,
                offset=torn.offset,
                length=torn.length,
                revision=revision,
            )


def _newlines(data: bytes) -> Iterator[int]:
    """The offsets of the newlines in ``data``, in order."""
    at = data.find(b"\n")
    while at != -1:
        yield at
        at = data.find(b"\n", at + 1)
