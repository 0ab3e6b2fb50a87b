"""``FileStore``: one append-only log file per session, in one folder. POSIX only.

Supported platforms: Linux, macOS and the BSDs (any OS with ``fcntl.flock``,
``os.pread`` and ``O_NOFOLLOW``), on a local filesystem. Not Windows: this
module imports there (so ``stepmachine.stores`` and its other stores do), but
:meth:`FileStore.open` raises :class:`~stepmachine.ConfigurationError` naming
the platform.

Layout of the folder (created 0o700; every file 0o600):

- ``<id>.log``: the session's log: a head record, the revision-0 session, then
  one record per applied batch (format in :mod:`._file_log`). Only ever
  appended to, except that a torn final record is cut off before the next append.
- ``<id>.snap``: the latest snapshot: the session at some revision, the log
  offset just past that revision's record, and the offset and digest of that
  record, which bind it to the log content it covers. Written every ``snapshot_every``
  batches and after any batch holding a ``ReplaceConversation``, to a temporary
  file that is fsynced, ``os.replace``d into place, then the folder is fsynced.
- ``.<id>...tmp``: temporary files (names starting with ``.`` are never session ids).

Concurrency: writers (``apply``, ``delete``) hold an exclusive ``fcntl.flock`` on
the log, readers a shared one, so several processes (each with its own
``FileStore``) can use one folder without losing an update; the
compare-and-set on the revision happens inside the lock. Within one instance,
operations on one session are also serialised with an ``anyio.Lock``.

Cost: the instance caches, per session, the last session value and the log
offset it was read up to; ``load`` and ``apply`` read only the bytes appended
since (and the last record read before, to check that the log still holds it),
and ``apply`` encodes only its own batch, never the history. A cold load starts
from the snapshot when the snapshot covers exactly this log (the last record it
includes is still in the log, byte for byte), so it replays at most
``snapshot_every`` batches.

All file IO runs in worker threads (``anyio.to_thread.run_sync``), on asyncio
and trio. Requires ``fcntl.flock`` and ``os.link`` on the folder's filesystem
(a local POSIX filesystem; not Windows). On a case-insensitive filesystem two
ids differing only in case would share files: avoid such ids there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar, Literal, TypeVar

import anyio
import anyio.to_thread
import msgspec
import structlog

try:
    import fcntl
except ImportError:  # not POSIX (Windows): the module imports, FileStore.open refuses
    fcntl = None  # type: ignore[assignment]

from stepmachine import (
    Batch,
    Codec,
    ConfigurationError,
    ConflictError,
    Effect,
    Message,
    ReplaceConversation,
    RunError,
    Session,
    SessionExistsError,
    SessionNotFoundError,
    StepmachineError,
    StoredDataError,
    apply_batch,
)

from ._file_log import (
    TAG_BATCH,
    TAG_CREATE,
    TAG_HEAD,
    TAG_SNAPSHOT,
    LastRecord,
    LogHead,
    Record,
    Snapshot,
    Torn,
    create_file,
    decode_batch,
    decode_snapshot_session,
    digest_of,
    encode_record,
    fold,
    fsync_dir,
    parse_records,
    read_head,
    read_range,
    read_snapshot,
    snapshot_misfit,
    snapshot_payload,
    write_all,
)
from ._ids import validate_session_id

__all__ = ["FileLockTimeoutError", "FileStore"]

T = TypeVar("T")

_log = structlog.wrap_logger(
    logging.getLogger("stepmachine.stores.file"),
    wrapper_class=structlog.stdlib.BoundLogger,
    processors=[structlog.processors.KeyValueRenderer(key_order=["event"])],
)


class FileLockTimeoutError(RunError, TimeoutError):
    """The session's file lock was not acquired within ``lock_timeout``; nothing was done."""


@dataclass(frozen=True, slots=True)
class _Cached:
    """``session`` is the log's state after its bytes ``[0, offset)``; ``nonce`` names the
    log; ``last`` is the record ending at ``offset``, to check the log still holds it."""

    nonce: str
    session: Session[Any]
    offset: int
    last: LastRecord


def _require_flock() -> None:
    """Raise ConfigurationError naming the platform if it has no ``fcntl.flock``."""
    if fcntl is None or not hasattr(fcntl, "flock"):
        raise ConfigurationError(
            "FileStore needs POSIX file locks (fcntl.flock), which this platform "
            f"(sys.platform={sys.platform!r}, os.name={os.name!r}) does not have; "
            "FileStore supports Linux, macOS and the BSDs: use SQLiteStore or MemoryStore here"
        )


class _Busy:
    """Returned by a lock attempt that found the lock taken."""


_BUSY = _Busy()


class _Handle:
    """The log file descriptor of one operation; closing it releases the lock."""

    __slots__ = ("fd",)

    def __init__(self) -> None:
        self.fd = -1

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class FileStore:
    """A durable store: one append-only log file per session in ``folder``. POSIX only.

    Supported platforms: Linux, macOS and the BSDs, on a local filesystem. On a
    platform without ``fcntl.flock`` (Windows), :meth:`open` and the constructor
    raise :class:`~stepmachine.ConfigurationError` naming the platform; use
    :class:`~stepmachine.stores.SQLiteStore` there.

    Build one with :meth:`open`. Implements :class:`stepmachine.Store`; use it as
    ``async with await FileStore.open(...) as store`` or call :meth:`aclose`.

    Durability: with ``fsync="always"`` a batch is fsynced before ``apply``
    returns, so it survives a crash of the process or the machine
    (invariant 2); with ``"never"`` it survives a crash of the process only.

    Damage: a final record left incomplete by a crash (no newline, or a length
    running past the end of the file) was never acknowledged; it is ignored,
    logged as a warning on the ``stepmachine.stores.file`` logger, counted in
    :attr:`torn_tails`, and cut off by the next ``apply`` (under the lock) before
    it appends. Any other damage -- a checksum mismatch, a malformed or
    undecodable record, an unknown record or effect tag, a record of a newer
    schema version -- raises :class:`~stepmachine.StoredDataError` naming the
    file and byte offset, and nothing is written.

    Snapshots: a snapshot is only a cache of the log, bound to the log content
    it covers by the offset and BLAKE2b digest of the last record it includes
    (one record is read to check it; a rewrite reproducing that record byte for
    byte -- same revision, step, cycle, timestamp and effects -- is not told
    apart). A damaged snapshot, or one whose record is no longer in the log (the log
    was cut back and rewritten: a restored backup, a power loss under
    ``fsync="never"``), is ignored with a ``file_store.damaged_snapshot_ignored``
    warning on the same logger and the log is replayed from its head; the next
    snapshot written replaces it. A snapshot written by an earlier version
    carries no binding: it is *unbound*, never used in place of the log (an
    info record ``file_store.unbound_snapshot_ignored``; cold loads replay the
    whole log until the next snapshot is written). A snapshot -- bound or not
    -- at a revision the log no longer reaches proves that acknowledged
    batches were lost (the log was truncated): that raises
    :class:`~stepmachine.StoredDataError` naming both files, and nothing is
    written; delete the snapshot file to accept the loss and carry on from the
    log. The same holds for this instance's cache: a log that lost revisions
    the instance already read raises. Decoding goes through the codec only:
    stored data never names a class to import (invariant 8).

    Attributes:
        BOUNDARIES: the persistence boundaries passed to ``boundary_hook``:
            ``apply.locked`` (lock held, nothing written), ``apply.written``
            (record written, not yet fsynced), ``apply.synced`` (fsynced, lock
            still held), ``snapshot.written`` (temporary snapshot written and
            fsynced), ``snapshot.replaced`` (renamed into place, folder not yet
            fsynced), ``create.synced`` (a new log of :meth:`create` or
            :meth:`fork` linked in place and the folder fsynced).
    """

    applies_batches: ClassVar[bool] = True
    """``apply`` applies each batch once and returns the session (see ``EffectHandler``)."""

    BOUNDARIES: ClassVar[tuple[str, ...]] = (
        "apply.locked",
        "apply.written",
        "apply.synced",
        "snapshot.written",
        "snapshot.replaced",
        "create.synced",
    )

    def __init__(
        self,
        folder: str,
        codec: Codec[Any],
        *,
        fsync: Literal["always", "never"],
        snapshot_every: int,
        lock_timeout: float,
        boundary_hook: Callable[[str], None] | None,
    ) -> None:
        """Use :meth:`open`, which checks the options and creates the folder.

        Raises:
            ConfigurationError: the platform has no ``fcntl.flock`` (Windows).
        """
        _require_flock()
        self._folder = folder
        self._codec = codec
        self._fsync = fsync == "always"
        self._snapshot_every = snapshot_every
        self._lock_timeout = lock_timeout
        self._hook = boundary_hook
        self._cache: dict[str, _Cached] = {}
        self._locks: dict[str, anyio.Lock] = {}
        self._torn_seen: set[tuple[str, str, int]] = set()
        self._closed = False

    @classmethod
    async def open(
        cls,
        folder: str | os.PathLike[str],
        codec: Codec[Any] | None = None,
        *,
        fsync: Literal["always", "never"] = "always",
        snapshot_every: int = 100,
        lock_timeout: float = 30.0,
        boundary_hook: Callable[[str], None] | None = None,
    ) -> FileStore:
        """Open the store kept in ``folder``, creating the folder (0o700) if needed.

        Args:
            folder: the store's folder; missing parents are created too (with
                default permissions); an existing folder keeps its permissions.
            codec: the application's codec (kernel effects and ``NoData`` by default).
            fsync: ``"always"`` fsyncs every record, snapshot and folder change
                before reporting it done; ``"never"`` leaves that to the OS.
            snapshot_every: write a snapshot every this many batches (>= 1).
            lock_timeout: seconds to wait for another process's file lock
                before raising :class:`FileLockTimeoutError`.
            boundary_hook: called with each name of :attr:`BOUNDARIES`, in the
                IO thread, at that point of persisting (for crash tests).

        Raises:
            ConfigurationError: the platform has no ``fcntl.flock`` (Windows);
                the message names the platform.
            ValueError: an option is out of range.
            TypeError: ``snapshot_every`` is not an int.
            NotADirectoryError: ``folder`` exists and is not a folder.
            OSError: the folder cannot be created.

        Cancellation: the folder is created whole or not at all.
        """
        _require_flock()
        if fsync not in ("always", "never"):
            raise ValueError(f"fsync must be 'always' or 'never', got {fsync!r}")
        if isinstance(snapshot_every, bool) or not isinstance(snapshot_every, int):
            raise TypeError(f"snapshot_every must be an int >= 1, got {snapshot_every!r}")
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
        if not lock_timeout >= 0:
            raise ValueError(f"lock_timeout must be >= 0 seconds, got {lock_timeout!r}")
        path = await anyio.to_thread.run_sync(_make_folder, os.fspath(folder), fsync == "always")
        return cls(
            path,
            codec or Codec(),
            fsync=fsync,
            snapshot_every=snapshot_every,
            lock_timeout=lock_timeout,
            boundary_hook=boundary_hook,
        )

    # -- properties and lifecycle -----------------------------------------------

    @property
    def codec(self) -> Codec[Any]:
        """The codec the store encodes with."""
        return self._codec

    @property
    def folder(self) -> str:
        """The absolute path of the store's folder."""
        return self._folder

    @property
    def torn_tails(self) -> int:
        """How many distinct torn final records this instance found (and ignored).

        Each is also logged as a warning on the ``stepmachine.stores.file`` logger.
        """
        return len(self._torn_seen)

    async def aclose(self) -> None:
        """Forget the caches; later calls raise ``anyio.ClosedResourceError``.

        Operations already running finish normally. Idempotent.
        """
        self._closed = True
        self._cache.clear()

    async def __aenter__(self) -> FileStore:
        """Return the store itself."""
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the store (:meth:`aclose`)."""
        await self.aclose()

    # -- the Store API --------------------------------------------------------------

    async def create(
        self,
        session_id: str,
        data: msgspec.Struct | None = None,
        conversation: Sequence[Message] = (),
    ) -> Session[Any]:
        """Create a revision-0 session and return it (as decoded from what was stored).

        The log is written to a temporary file, fsynced, then hard-linked into
        place, so a session exists whole or not at all; the folder is fsynced
        before ``"create.synced"``.

        Raises:
            InvalidSessionIdError: the id is not safe as a file name.
            SessionExistsError: the id is taken (in this or another process).
            ConfigurationError: ``data`` is not the codec's data type.

        Cancellation: a cancel before the worker thread starts creates nothing;
        once it runs, it finishes, and the session exists afterwards.
        """
        self._check_open()
        log_path = self._log_path(session_id)
        session = self._codec.new_session(session_id, data, conversation)
        payload = self._codec.encode_session(session)
        stored = self._codec.decode_session(payload, where=f"new session {session_id!r}")
        async with self._session_lock(session_id):
            records = [encode_record(TAG_CREATE, 0, payload)]
            await anyio.to_thread.run_sync(
                self._write_new_log, session_id, log_path, records, stored
            )
        return stored

    async def load(self, session_id: str) -> Session[Any]:
        """The current session.

        Reads only the log bytes appended since this instance last read the
        session (from the snapshot on the first load). A torn final record is
        ignored and reported (see :attr:`torn_tails`).

        Raises:
            InvalidSessionIdError: the id is not safe as a file name.
            SessionNotFoundError: no session has this id.
            StoredDataError: a record is damaged (naming the file and byte offset),
                or the snapshot (or this instance's cache) holds a revision the log
                no longer reaches (acknowledged batches were lost); nothing is
                changed, on disk or in the cache.
            FileLockTimeoutError: a writer held the lock for ``lock_timeout``.

        Cancellation: safe at any point; nothing is written.
        """
        return await self._locked(session_id, exclusive=False, work=self._load_work)

    def _load_work(self, fd: int, session_id: str) -> Session[Any]:
        return self._current(fd, session_id)[0].session

    async def apply(self, batch: Batch[Effect]) -> Session[Any]:
        """Append ``batch`` if the session is at ``batch.revision - 1``; all or nothing.

        Returns the session after the batch, as a load would give it.

        Under the session's exclusive file lock: read what other writers
        appended, compare-and-set the revision, check that the batch encodes,
        decodes and applies, cut off a torn final record if there is one, then
        append the batch as one record and (``fsync="always"``) fsync it. Every
        ``snapshot_every`` revisions, and after a ``ReplaceConversation``, a
        snapshot is written too; if that fails the batch stays applied and a
        warning is logged.

        Raises:
            InvalidSessionIdError: ``batch.session_id`` is not safe as a file name.
            ConflictError: the session is at another revision; nothing is written.
            SessionNotFoundError: no session has this id.
            EffectError: an effect does not apply; nothing is written.
            ConfigurationError: an effect type is not registered in the codec.
            StoredDataError: the stored log is damaged, or lost acknowledged
                batches (see :meth:`load`); nothing is written.
            FileLockTimeoutError: another writer held the lock for ``lock_timeout``.
            OSError: the write or fsync failed; the record is cut off again
                (best effort), so a later load normally shows the batch missing.

        Cancellation: a cancel while waiting for a lock writes nothing. Once a
        worker thread has started it is not interrupted: it either finds the
        lock taken (and the wait ends with nothing written) or writes the batch
        whole (and fsyncs it), and ``apply`` returns normally, the cancel
        landing at the caller's next checkpoint; the next load sees the batch.
        A crash mid-write leaves a torn final record, which the next load
        ignores and the next apply removes.
        """
        return await self._locked(
            batch.session_id, exclusive=True, work=lambda fd, sid: self._apply_work(fd, sid, batch)
        )

    async def list_sessions(self) -> list[str]:
        """The ids of all sessions, sorted.

        Cancellation: safe at any point.
        """
        self._check_open()
        return await anyio.to_thread.run_sync(self._list_work)

    async def delete(self, session_id: str) -> None:
        """Delete a session: its snapshot, then its log (under the exclusive lock).

        Raises:
            SessionNotFoundError: no session has this id.

        Cancellation: a cancel while waiting for the lock deletes nothing; once
        the worker thread runs, the session is deleted.
        """
        await self._locked(session_id, exclusive=True, work=self._delete_work)

    async def load_at(self, session_id: str, revision: int) -> Session[Any]:
        """The session as it was at ``revision`` (time travel).

        Replays from the snapshot when it is at or before ``revision`` and covers
        exactly this log, otherwise from the start of the log.

        Raises:
            SessionNotFoundError: no session has this id.
            ValueError: ``revision`` is negative or beyond the current one.
            StoredDataError: a record on the way is damaged, or acknowledged
                batches were lost (see :meth:`load`).

        Cancellation: safe at any point; nothing is written.
        """
        return await self._locked(
            session_id, exclusive=False, work=lambda fd, sid: self._load_at_work(fd, sid, revision)
        )

    async def batches(self, session_id: str, after: int = 0) -> list[Batch[Effect]]:
        """The audit log: every applied batch with ``revision > after``, in order.

        Raises:
            SessionNotFoundError: no session has this id.
            StoredDataError: a record is damaged, or acknowledged batches were
                lost (see :meth:`load`).

        Cancellation: safe at any point; nothing is written.
        """
        return await self._locked(
            session_id, exclusive=False, work=lambda fd, sid: self._batches_work(fd, sid, after)
        )

    async def fork(self, session_id: str, revision: int, new_session_id: str) -> Session[Any]:
        """Copy ``session_id``'s history up to ``revision`` into a new session.

        The new session has the same revision, conversation and data as the
        source at ``revision``, and the same audit log up to there (each batch
        carrying the new id); the source is unchanged. The new log is written
        like :meth:`create` (temporary file, fsync, hard link), then snapshotted.

        Returns:
            The new session, at ``revision``.

        Raises:
            InvalidSessionIdError: either id is not safe as a file name.
            SessionNotFoundError: ``session_id`` does not exist.
            SessionExistsError: ``new_session_id`` is taken.
            ValueError: ``revision`` is negative or beyond the current one.
            StoredDataError: a record of the source is damaged.

        Cancellation: a cancel before the writing thread starts creates
        nothing; once it runs, the fork exists afterwards.
        """
        self._check_open()
        new_path = self._log_path(new_session_id)
        initial, batches = await self._locked(
            session_id, exclusive=False, work=lambda fd, sid: self._history(fd, sid, revision)
        )
        session = msgspec.structs.replace(initial, id=new_session_id)
        records = [encode_record(TAG_CREATE, 0, self._codec.encode_session(session))]
        for batch in batches:
            renamed = msgspec.structs.replace(batch, session_id=new_session_id)
            records.append(
                encode_record(TAG_BATCH, batch.revision, self._codec.encode_batch(renamed))
            )
            session = apply_batch(session, batch.effects)
        async with self._session_lock(new_session_id):
            await anyio.to_thread.run_sync(
                self._write_new_log, new_session_id, new_path, records, session
            )
        return session

    # -- worker-thread bodies -----------------------------------------------------

    def _apply_work(self, fd: int, session_id: str, batch: Batch[Effect]) -> Session[Any]:
        self._boundary("apply.locked")
        cached, torn = self._current(fd, session_id)
        current = cached.session
        if current.revision != batch.revision - 1:
            raise ConflictError(session_id, batch.revision - 1, current.revision)
        payload = self._codec.encode_batch(batch)
        where = f"new batch for session {session_id!r} revision {batch.revision}"
        stored = self._codec.decode_batch(payload, where=where)
        after = apply_batch(current, stored.effects)
        record = encode_record(TAG_BATCH, batch.revision, payload)
        if torn is not None:
            os.ftruncate(fd, torn.offset)
            _log.warning(
                "file_store.torn_tail_truncated",
                session_id=session_id,
                path=self._log_path(session_id),
                offset=torn.offset,
                length=torn.length,
            )
        try:
            write_all(fd, record)
            self._boundary("apply.written")
            if self._fsync:
                os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):  # best effort; the next apply cuts a torn tail
                os.ftruncate(fd, cached.offset)
            raise
        self._boundary("apply.synced")
        end = cached.offset + len(record)
        last = LastRecord(cached.offset, digest_of(record))
        self._cache[session_id] = _Cached(cached.nonce, after, end, last)
        if after.revision % self._snapshot_every == 0 or any(
            isinstance(effect, ReplaceConversation) for effect in stored.effects
        ):
            self._write_snapshot(session_id, cached.nonce, after, end, last)
        return after

    def _write_new_log(
        self, session_id: str, log_path: str, records: list[bytes], session: Session[Any]
    ) -> None:
        """Write head + ``records`` to a temporary file, fsync, link to ``log_path``."""
        if os.path.lexists(log_path):
            raise SessionExistsError(session_id)
        nonce = secrets.token_hex(16)
        head = encode_record(TAG_HEAD, 0, msgspec.json.encode(LogHead(session_id, nonce)))
        data = head + b"".join(records)
        temp = os.path.join(self._folder, f".{session_id}.{secrets.token_hex(8)}.new.tmp")
        fd = create_file(temp, exclusive=True)
        try:
            try:
                write_all(fd, data)
                if self._fsync:
                    os.fsync(fd)
                fcntl.flock(fd, fcntl.LOCK_EX)  # held until the snapshot below is in place
                os.link(temp, log_path)
            except FileExistsError:
                raise SessionExistsError(session_id) from None
            finally:
                os.unlink(temp)
            if self._fsync:
                fsync_dir(self._folder)
            self._boundary("create.synced")
            last = LastRecord(len(data) - len(records[-1]), digest_of(records[-1]))
            self._cache[session_id] = _Cached(nonce, session, len(data), last)
            if session.revision > 0:
                self._write_snapshot(session_id, nonce, session, len(data), last)
        finally:
            os.close(fd)

    def _write_snapshot(
        self, session_id: str, nonce: str, session: Session[Any], offset: int, last: LastRecord
    ) -> None:
        """Replace the snapshot, bound to ``last``, the record ending at ``offset``
        (the caller holds the log's exclusive lock)."""
        payload = snapshot_payload(
            session_id, nonce, offset, self._codec.encode_session(session), last
        )
        data = encode_record(TAG_SNAPSHOT, session.revision, payload)
        temp = os.path.join(self._folder, f".{session_id}.snap.tmp")
        try:
            fd = create_file(temp, exclusive=False)
            try:
                write_all(fd, data)
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            self._boundary("snapshot.written")
            os.replace(temp, self._snap_path(session_id))
            self._boundary("snapshot.replaced")
            if self._fsync:
                fsync_dir(self._folder)
        except OSError as exc:
            _log.warning(
                "file_store.snapshot_failed",
                session_id=session_id,
                revision=session.revision,
                error=repr(exc),
            )

    def _delete_work(self, fd: int, session_id: str) -> None:
        del fd  # the lock is what matters
        for path in (
            self._snap_path(session_id),
            os.path.join(self._folder, f".{session_id}.snap.tmp"),
        ):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        os.unlink(self._log_path(session_id))
        if self._fsync:
            fsync_dir(self._folder)
        self._cache.pop(session_id, None)

    def _list_work(self) -> list[str]:
        ids: list[str] = []
        with os.scandir(self._folder) as entries:
            for entry in entries:
                name = entry.name
                if name.endswith(".log") and not name.startswith("."):
                    try:
                        ids.append(validate_session_id(name[: -len(".log")]))
                    except StepmachineError:
                        continue  # a file someone else put here
        return sorted(ids)

    def _load_at_work(self, fd: int, session_id: str, revision: int) -> Session[Any]:
        cached, _ = self._current(fd, session_id)
        current = cached.session
        if not 0 <= revision <= current.revision:
            raise ValueError(
                f"session {session_id!r} has revisions 0..{current.revision}, not {revision}"
            )
        if revision == current.revision:
            return current
        path = self._log_path(session_id)
        session, records = self._records_from(fd, session_id, cached, revision, decode=True)
        for record in records:
            if session is not None and session.revision >= revision:
                break
            session = fold(self._codec, record, session, session_id, path)
        assert session is not None  # _current read the same records before
        return session

    def _batches_work(self, fd: int, session_id: str, after: int) -> list[Batch[Effect]]:
        cached, _ = self._current(fd, session_id)
        if after >= cached.session.revision:
            return []
        path = self._log_path(session_id)
        _, records = self._records_from(fd, session_id, cached, max(after, 0), decode=False)
        return [
            decode_batch(self._codec, record, session_id, path)
            for record in records
            if record.tag == TAG_BATCH and record.revision > after
        ]

    def _history(
        self, fd: int, session_id: str, revision: int
    ) -> tuple[Session[Any], list[Batch[Effect]]]:
        """The revision-0 session and the batches up to ``revision``."""
        cached, _ = self._current(fd, session_id)
        if not 0 <= revision <= cached.session.revision:
            raise ValueError(
                f"session {session_id!r} has revisions 0..{cached.session.revision}, not {revision}"
            )
        path = self._log_path(session_id)
        _, head_end = read_head(fd, session_id, path)
        records, _ = parse_records(read_range(fd, head_end, cached.offset), head_end, path)
        initial = fold(self._codec, records[0], None, session_id, path)
        batches = [
            decode_batch(self._codec, record, session_id, path)
            for record in records[1:]
            if record.tag == TAG_BATCH and record.revision <= revision
        ]
        return initial, batches

    # -- reading the log --------------------------------------------------------

    def _current(self, fd: int, session_id: str) -> tuple[_Cached, Torn | None]:
        """Bring the cache up to the end of the log; report a torn tail.

        Warm read: the cache is of this log (same nonce) and the log still holds
        the cached last record, byte for byte, where it was: only the bytes after
        it are read. Otherwise a cold read (:meth:`_cold_replay`); when the log
        changed under the cache (cut back and rewritten), that is reported with
        a ``file_store.log_rewritten`` warning. Nothing is cached when a record
        is damaged (StoredDataError propagates).

        Raises:
            StoredDataError: a record is damaged; or the log no longer reaches a
                revision the snapshot or this instance's cache holds.
        """
        path = self._log_path(session_id)
        size = os.fstat(fd).st_size
        nonce, head_end = read_head(fd, session_id, path)
        cached = self._cache.get(session_id)
        state = None
        if cached is not None and cached.nonce == nonce:
            state = self._warm_replay(fd, session_id, cached, size)
        if state is None:
            state = self._cold_replay(fd, session_id, nonce, head_end, size)
            if cached is not None and cached.nonce == nonce:
                self._check_reaches(
                    session_id,
                    cached.session.revision,
                    "this FileStore's cache",
                    state[0],
                    "open a new FileStore",
                )
                _log.warning(
                    "file_store.log_rewritten",
                    session_id=session_id,
                    path=path,
                    cached_revision=cached.session.revision,
                    revision=state[0].session.revision,
                )
        fresh, torn = state
        self._cache[session_id] = fresh
        if torn is not None and (path, nonce, torn.offset) not in self._torn_seen:
            self._torn_seen.add((path, nonce, torn.offset))
            _log.warning(
                "file_store.torn_tail_ignored",
                session_id=session_id,
                path=path,
                offset=torn.offset,
                length=torn.length,
                revision=fresh.session.revision,
            )
        return fresh, torn

    def _warm_replay(
        self, fd: int, session_id: str, cached: _Cached, size: int
    ) -> tuple[_Cached, Torn | None] | None:
        """:meth:`_replay` from ``cached``; None if the log no longer holds its last record."""
        if cached.offset > size:
            return None
        if digest_of(read_range(fd, cached.last.offset, cached.offset)) != cached.last.digest:
            return None
        return self._replay(
            fd, session_id, cached.nonce, cached.session, cached.last, cached.offset, size
        )

    def _cold_replay(
        self, fd: int, session_id: str, nonce: str, head_end: int, size: int
    ) -> tuple[_Cached, Torn | None]:
        """:meth:`_replay` from the snapshot if it covers exactly this log, else from
        the head of the log.

        If replaying from the snapshot fails, the whole log is replayed; if the
        log itself is damaged, that raises, naming the log file and offset. When
        the snapshot was not used, a snapshot at a revision the log does not
        reach raises (acknowledged batches were lost); any other is reported.
        """
        path = self._log_path(session_id)
        snapshot = self._read_snapshot(session_id, nonce)
        reason = ""
        if snapshot is not None:
            misfit = snapshot_misfit(fd, snapshot, head_end, size, path)
            if misfit is None:
                try:
                    session = decode_snapshot_session(self._codec, snapshot, session_id)
                    return self._replay(
                        fd, session_id, nonce, session, snapshot.last_record, snapshot.offset, size
                    )
                except StoredDataError as exc:
                    reason = str(exc)
            else:
                reason = misfit
        replayed = self._replay(fd, session_id, nonce, None, None, head_end, size)
        if snapshot is not None:
            self._check_reaches(
                session_id,
                snapshot.revision,
                f"the snapshot {snapshot.path}",
                replayed[0],
                f"delete {snapshot.path} and open a new FileStore",
            )
            self._snapshot_unused(session_id, snapshot, reason)
        return replayed

    def _replay(
        self,
        fd: int,
        session_id: str,
        nonce: str,
        session: Session[Any] | None,
        last: LastRecord | None,
        offset: int,
        size: int,
    ) -> tuple[_Cached, Torn | None]:
        """Fold the log's records in ``[offset, size)`` onto ``session``, whose last
        record is ``last`` (both None: the create record comes first); the new
        cache entry and the torn tail."""
        path = self._log_path(session_id)
        data = read_range(fd, offset, size)
        records, torn = parse_records(data, offset, path)
        for record in records:
            session = fold(self._codec, record, session, session_id, path)
        if records:
            final = records[-1]
            last = LastRecord(
                final.offset, digest_of(data[final.offset - offset : final.end - offset])
            )
            offset = final.end
        if session is None or last is None:
            raise StoredDataError(
                f"invariant 8 (stored data is data): {path} holds no complete create record"
            )
        return _Cached(nonce, session, offset, last), torn

    def _check_reaches(
        self, session_id: str, revision: int, holder: str, replayed: _Cached, remedy: str
    ) -> None:
        """Raise StoredDataError if ``holder`` (a snapshot, the cache) saw ``revision``
        of this log, which the log, replayed whole, no longer reaches; the message
        ends with ``remedy``, what accepts the loss."""
        if revision <= replayed.session.revision:
            return
        raise StoredDataError(
            f"invariant 2 (nothing is lost): {holder} holds session {session_id!r} at "
            f"revision {revision}, but its log {self._log_path(session_id)} ends at revision "
            f"{replayed.session.revision} (byte {replayed.offset}): acknowledged batches "
            f"{replayed.session.revision + 1}..{revision} are missing (a truncated or restored "
            "log, or a power loss under fsync='never'). Nothing was changed; to accept the "
            f"loss and carry on from the log, {remedy}"
        )

    def _records_from(
        self, fd: int, session_id: str, cached: _Cached, revision: int, *, decode: bool
    ) -> tuple[Session[Any] | None, list[Record]]:
        """Where to replay from to reach ``revision``, and the log's records from
        there up to ``cached.offset``: the snapshot (its session, None unless
        ``decode``) if it is not later and covers exactly this log, else the
        create record (``None``).

        A snapshot that does not cover this log is ignored and reported like a
        damaged one (:meth:`_snapshot_unused`).
        """
        path = self._log_path(session_id)
        head_end = read_head(fd, session_id, path)[1]
        stop = cached.offset
        snapshot = self._read_snapshot(session_id, cached.nonce)
        if snapshot is not None and snapshot.revision <= revision:
            misfit = snapshot_misfit(fd, snapshot, head_end, stop, path)
            if misfit is None:
                try:
                    session = (
                        decode_snapshot_session(self._codec, snapshot, session_id)
                        if decode
                        else None
                    )
                    records, _ = parse_records(
                        read_range(fd, snapshot.offset, stop), snapshot.offset, path
                    )
                except StoredDataError as exc:
                    misfit = str(exc)
                else:
                    return session, records
            self._snapshot_unused(session_id, snapshot, misfit)
        records, _ = parse_records(read_range(fd, head_end, stop), head_end, path)
        return None, records

    def _read_snapshot(self, session_id: str, nonce: str) -> Snapshot | None:
        """The snapshot of this incarnation of the log (``nonce``), if there is one.

        It is checked as a file only (checksum, format), not yet against the log.
        A damaged or unreadable one is ignored with a warning, and so is one of
        an earlier incarnation (a stale one). The next snapshot written replaces it.
        """
        path = self._snap_path(session_id)
        try:
            snapshot = read_snapshot(path, session_id, nonce)
        except (StoredDataError, OSError) as exc:
            self._snapshot_ignored(session_id, str(exc))
            return None
        if snapshot is not None and snapshot.stale:
            _log.warning("file_store.stale_snapshot_ignored", session_id=session_id, path=path)
            return None
        return snapshot

    def _snapshot_unused(self, session_id: str, snapshot: Snapshot, reason: str) -> None:
        """Report a snapshot not used: unbound ones (from an earlier version) at
        info level, any other that does not fit the log as a warning."""
        if snapshot.last_record is None:
            _log.info(
                "file_store.unbound_snapshot_ignored",
                session_id=session_id,
                path=snapshot.path,
                revision=snapshot.revision,
            )
        else:
            self._snapshot_ignored(session_id, reason)

    def _snapshot_ignored(self, session_id: str, reason: str) -> None:
        """Warn that the snapshot is ignored (it is only a cache of the log)."""
        _log.warning(
            "file_store.damaged_snapshot_ignored",
            session_id=session_id,
            path=self._snap_path(session_id),
            reason=reason,
        )

    # -- small helpers ----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise anyio.ClosedResourceError(f"the FileStore on {self._folder} is closed")

    def _log_path(self, session_id: str) -> str:
        return os.path.join(self._folder, validate_session_id(session_id) + ".log")

    def _snap_path(self, session_id: str) -> str:
        return os.path.join(self._folder, validate_session_id(session_id) + ".snap")

    def _session_lock(self, session_id: str) -> anyio.Lock:
        lock = self._locks.get(session_id)
        if lock is None:
            lock = self._locks[session_id] = anyio.Lock()
        return lock

    def _boundary(self, name: str) -> None:
        if self._hook is not None:
            self._hook(name)

    async def _locked(
        self, session_id: str, *, exclusive: bool, work: Callable[[int, str], T]
    ) -> T:
        """Run ``work(fd, session_id)`` in a worker thread, holding the log's file lock.

        The lock is tried without blocking in the worker thread; while another
        process holds it, this task sleeps (cancellably) and tries again, until
        ``lock_timeout``. The descriptor is closed (releasing the lock) by the
        worker thread when ``work`` ends, or here if the task is cancelled first.
        """
        self._check_open()
        path = self._log_path(session_id)
        operation = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        flags = (os.O_RDWR | os.O_APPEND if exclusive else os.O_RDONLY) | os.O_CLOEXEC
        handle = _Handle()

        def attempt() -> T | _Busy:
            if handle.fd < 0:
                try:
                    handle.fd = os.open(path, flags | os.O_NOFOLLOW)
                except FileNotFoundError:
                    raise SessionNotFoundError(session_id) from None
            try:
                fcntl.flock(handle.fd, operation | fcntl.LOCK_NB)
            except BlockingIOError:
                return _BUSY
            try:
                if os.fstat(handle.fd).st_nlink == 0:  # deleted while we waited
                    raise SessionNotFoundError(session_id)
                return work(handle.fd, session_id)
            finally:
                handle.close()

        async with self._session_lock(session_id):
            try:
                deadline = anyio.current_time() + self._lock_timeout
                delay = 0.001
                while True:
                    result = await anyio.to_thread.run_sync(attempt)
                    if not isinstance(result, _Busy):
                        return result
                    if anyio.current_time() >= deadline:
                        raise FileLockTimeoutError(
                            f"the lock on {path} was held by another writer for longer than "
                            f"lock_timeout={self._lock_timeout} s"
                        )
                    await anyio.sleep(delay)
                    delay = min(delay * 2, 0.05)
            finally:
                handle.close()


def _make_folder(folder: str, fsync: bool) -> str:
    """Create ``folder`` owner-only (0o700), and its parents, unless it is a folder already.

    Returns its absolute path.
    """
    path = os.path.abspath(folder)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not os.path.isdir(path):
            raise NotADirectoryError(
                f"the FileStore folder {path} exists and is not a folder"
            ) from None
        return path
    os.chmod(path, 0o700)
    if fsync:
        fsync_dir(parent)
    return path
