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
- ``.media/<hex>``: the media bytes (images, documents, audio) the records
  refer to, one file per SHA-256 digest, shared by every session (see
  :mod:`._media_blobs`); written (temporary file, fsync, rename, folder fsync)
  before the record that refers to them. ``delete`` leaves them.
- ``.leases/``: the leases (lock files, epochs, pending-run marks; layout in
  :mod:`._flock_leases`), made at the first lease operation.

Concurrency: writers (``apply``, ``delete``) hold an exclusive ``fcntl.flock`` on
the log, readers a shared one, so several processes (each with its own
``FileStore``) can use one folder without losing an update; the
compare-and-set on the revision happens inside the lock. Within one instance,
operations on one session are also serialised with an ``anyio.Lock``. Leases
(one runner per session across those processes) are file locks too, on
separate lock files (:mod:`._flock_leases`).

Structure: the cache, replay, compare-and-set, snapshot policy and errors
are the durable stores' shared core (:mod:`._core`); this module is the public
class, and :mod:`._file_backend` the byte backend (the file lock is its
transaction) over the record format of :mod:`._file_log`.

Cost: the instance caches, per session, the last session value and the log
offset it was read up to; ``load`` and ``apply`` read only the bytes appended
since (and the last record read before, to check that the log still holds it),
and ``apply`` encodes and decodes only its own batch, never the history, and
applies it once, to the cached session, which it returns. A cold load starts
from the snapshot when the snapshot covers exactly this log (the last record it
includes is still in the log, byte for byte), so it replays at most
``snapshot_every`` batches.

All file IO runs in worker threads (``stepmachine._async.run_in_thread``: on
asyncio the stores' own, on trio anyio's); a call is never left while its
thread runs (asyncio's native ``task.cancel()`` included: it is raised once the
thread's work ended, so a log's descriptor is never closed, nor its lock let
go, under a write).
Requires ``fcntl.flock`` and ``os.link`` on the folder's filesystem (a local
POSIX filesystem; not Windows). On a case-insensitive filesystem two ids
differing only in case would share files: avoid such ids there.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, ClassVar, Literal, TypeVar

import msgspec

try:
    import fcntl
except ImportError:  # not POSIX (Windows): the module imports, FileStore.open refuses
    fcntl = None  # type: ignore[assignment]

from stepmachine import (
    Codec,
    ConfigurationError,
    Effect,
    Message,
    Session,
    SessionNotFoundError,
    StoreClosedError,
)
from stepmachine._async import run_in_thread
from stepmachine.extend import Batch, Lease

from ._backend import Cached, Marks, NewSnapshot
from ._core import LogCore
from ._file_backend import FileBackend, FileLockTimeoutError
from ._file_log import TAG_BATCH, TAG_CREATE, encode_packed, fsync_dir
from ._file_media import log_digests, released, sweep_blobs
from ._file_txn import FilePos, FileTxn, log
from ._flock_leases import FlockLeaseMethods, FlockLeases
from ._ids import validate_session_id
from ._listing import ListedSession
from ._media_blobs import DEFAULT_MAX_MEDIA_BYTES, check_max_media_bytes
from ._snapshot_policy import EveryN

__all__ = ["FileLockTimeoutError", "FileStore"]

T = TypeVar("T")


def _require_flock() -> None:
    """Raise ConfigurationError naming the platform if it has no ``fcntl.flock``."""
    if fcntl is None or not hasattr(fcntl, "flock"):
        raise ConfigurationError(
            "FileStore needs POSIX file locks (fcntl.flock), which this platform "
            f"(sys.platform={sys.platform!r}, os.name={os.name!r}) does not have; "
            "FileStore supports Linux, macOS and the BSDs: use SQLiteStore or MemoryStore here"
        )


class FileStore(FlockLeaseMethods):
    """A durable store: one append-only log file per session in ``folder``. POSIX only.

    Supported platforms: Linux, macOS and the BSDs, on a local filesystem. On a
    platform without ``fcntl.flock`` (Windows), :meth:`open` and the constructor
    raise :class:`~stepmachine.ConfigurationError` naming the platform; use
    :class:`~stepmachine.stores.SQLiteStore` there.

    Build one with :meth:`open`. Implements :class:`stepmachine.Store`; use it as
    ``async with await FileStore.open(...) as store`` or call :meth:`aclose`.

    Durability: with ``fsync="always"`` a batch is fsynced before ``apply``
    returns, so it survives a crash of the process or the machine
    (nothing is lost); with ``"never"`` it survives a crash of the process only.

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
    stored data never names a class to import (stored data is data).

    Leases (:class:`~stepmachine.Leases`, ``leases_expire = False``): a lease
    is an exclusive ``fcntl.flock`` on the session's lock file in the folder's
    ``.leases`` subfolder (never the log's lock), held until :meth:`release`,
    :meth:`aclose` or the end of the process (the kernel releases it even on
    ``SIGKILL``): no clock, no expiry; two store instances exclude each other
    as two processes do. The lock file also holds the session's last epoch
    and owner (so a failed claim names the holder, and epochs keep growing
    across processes, and across ``delete``: lock files are never removed);
    a pending-run mark is a file of its own, and a store-wide lock makes
    looking at a mark and unlocking one step for every other process. All of
    it survives the death of any process; nothing is fsynced (after an
    operating-system crash a mark may be gone and an epoch may repeat, which
    cannot weaken fencing: only the live holder's own store instance accepts
    its lease).

    Attributes:
        BOUNDARIES: the persistence boundaries passed to ``boundary_hook``:
            ``apply.locked`` (lock held, nothing written), ``apply.written``
            (record written, not yet fsynced), ``apply.synced`` (fsynced, lock
            still held), ``snapshot.written`` (temporary snapshot written and
            fsynced), ``snapshot.replaced`` (renamed into place, folder not yet
            fsynced), ``create.synced`` (a new log of :meth:`create` or
            :meth:`fork` linked in place and the folder fsynced),
            ``media.written`` (new media blob files renamed into place, before
            the record referring to them) and ``media.synced`` (their folder
            fsynced, the record not yet written). The hook is also called with
            ``"delete.removed"`` (a deleted session's files removed, the blobs
            only it named not yet), which is not a boundary of writing records
            and so not listed here.
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
        "media.written",
        "media.synced",
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
        max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES,
    ) -> None:
        """Use :meth:`open`, which checks the options and creates the folder.

        Raises:
            ConfigurationError: the platform has no ``fcntl.flock`` (Windows).
        """
        _require_flock()
        self._backend = FileBackend(folder, fsync == "always", lock_timeout, boundary_hook)
        self._core: LogCore[FilePos] = LogCore(
            codec, EveryN(snapshot_every), FileTxn.FORM, max_media_bytes=max_media_bytes
        )
        self._closed = False
        self._leases = FlockLeases(
            os.path.join(folder, ".leases"),
            hop=_hop,
            check=self._check_session,
            name=f"FileStore on {folder}",
        )

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
        max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES,
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
                IO thread, at that point of persisting (for crash tests; on
                asyncio not one of anyio's threads: a hook calling
                ``anyio.from_thread`` passes its ``token=``).
            max_media_bytes: the bytes one image, document or audio part may
                hold (20 MiB by default); a larger one raises
                :class:`~stepmachine.MediaTooLargeError` and nothing is written.

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
        check_max_media_bytes(max_media_bytes)
        path = await run_in_thread(_make_folder, os.fspath(folder), fsync == "always")
        return cls(
            path,
            codec or Codec(),
            fsync=fsync,
            snapshot_every=snapshot_every,
            lock_timeout=lock_timeout,
            boundary_hook=boundary_hook,
            max_media_bytes=max_media_bytes,
        )

    # -- properties and lifecycle -----------------------------------------------

    @property
    def codec(self) -> Codec[Any]:
        """The codec the store encodes with."""
        return self._core.codec

    @property
    def folder(self) -> str:
        """The absolute path of the store's folder."""
        return self._backend.folder

    @property
    def torn_tails(self) -> int:
        """How many distinct torn final records this instance found (and ignored).

        Each is also logged as a warning on the ``stepmachine.stores.file`` logger.
        """
        return len(self._backend.torn_seen)

    async def aclose(self) -> None:
        """Release every lease this instance holds and forget the caches.

        Later calls raise :class:`~stepmachine.StoreClosedError`. Operations
        already running finish normally (a fenced :meth:`apply` in flight ends
        before its lease is released). Pending-run marks stay. Shielded from
        cancellation. Idempotent.
        """
        self._closed = True
        self._core.clear()
        await self._leases.close()

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
        validate_session_id(session_id)
        session, record, blobs = self._core.new_session(session_id, data, conversation)
        async with self._backend.session_lock(session_id):
            created = await run_in_thread(
                lambda: released(  # the .media lock held until the log is in place
                    lambda: self._core.create(
                        FileTxn(self._backend, -1), session_id, session, record, blobs
                    )
                )
            )
        self._core.remember(session_id, created)
        return session

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

        def work(txn: FileTxn) -> Session[Any]:
            return self._core.current(txn, session_id).session

        return await self._locked(session_id, exclusive=False, work=work)

    async def apply(self, batch: Batch[Effect], *, lease: Lease | None = None) -> Session[Any]:
        """Append ``batch`` if the session is at ``batch.revision - 1``; all or nothing.

        Returns the session after the batch, as a load would give it: the batch
        is encoded once, decoded back (O(batch), never the history) and applied
        once, to the session this instance last read or wrote, and that result
        is returned and kept.

        Under the session's exclusive file lock: check that the log still ends
        where this instance last saw it (or read what other writers appended),
        compare-and-set the revision, check that the batch applies, cut off a
        torn final record if there is one, then append the batch as one record
        and (``fsync="always"``) fsync it. Every
        ``snapshot_every`` revisions, and after a ``ReplaceConversation``, a
        snapshot is written too; if that fails the batch stays applied and a
        warning is logged.

        With ``lease`` (fencing), inside the same lock hold and before
        anything else: the batch is written only while this instance holds
        that lease of ``batch.session_id`` (same owner and epoch); a release of
        the lease here waits for the write to end. That check is sound without
        reading a file: the lease is this instance's lock on the session's
        lock file, which no other claim can take while it is held, so no newer
        lease can exist.

        Raises:
            LeaseLostError: ``lease`` is not held by this store instance, or
                is a lease of another session; nothing is written.
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
        session_id = validate_session_id(batch.session_id)
        where = f"new batch for session {session_id!r} revision {batch.revision}"
        prepared = self._core.prepare(batch, where)

        def work(txn: FileTxn) -> Session[Any]:
            with self._leases.fenced(lease, session_id):
                self._backend.boundary("apply.locked")
                written = self._core.apply(txn, prepared)
            self._core.remember(session_id, written)
            return written.session

        return await self._locked(session_id, exclusive=True, work=work)

    async def list_sessions(self) -> list[str]:
        """The ids of all sessions, sorted.

        Cancellation: safe at any point.
        """
        self._check_open()
        return await run_in_thread(self._backend.list_sessions)

    async def scan_sessions(self) -> list[ListedSession]:
        """Every session, sorted by id, as :meth:`list_sessions` (the log files' names; a
        name is listed whatever its file holds), each a :class:`ListedSession` with
        ``unreadable`` None: the listing reads no log, so a damaged log (a FIFO or a
        folder in its place, a bad checksum) is found by loading the session.

        Cancellation: safe at any point.
        """
        return [ListedSession(session_id) for session_id in await self.list_sessions()]

    async def delete(self, session_id: str) -> None:
        """Delete a session: its snapshot, then its log (under the exclusive lock).

        Then, when its log named media blobs, the blobs no remaining log names
        are removed (a fork or another session holding the same bytes keeps
        them; writers of other processes hold a shared lock on ``.media`` until
        their record is written, the removal an exclusive one): the session's
        files first, then the blobs, so a crash between leaves only blobs
        nothing names, removed by the next such delete.

        Then its pending-run mark is removed. A lease on it is not touched: the
        holder keeps it until it releases (its writes meet
        :class:`~stepmachine.SessionNotFoundError`), and a session created
        later with the same id has the same lock, its epochs continuing above
        the old ones.

        Raises:
            SessionNotFoundError: no session has this id.

        Cancellation: a cancel while waiting for the lock deletes nothing; once
        the worker thread runs, the session is deleted.
        """

        backend = self._backend

        def work(txn: FileTxn) -> None:
            named = log_digests(backend.log_path(session_id))  # under its lock: complete
            txn.delete(session_id)
            self._core.forget(session_id)
            if named != set():  # it named blobs (None: unreadable; sweep, keeping what is named)
                backend.boundary("delete.removed")
                if (
                    sweep_blobs(backend.folder, fsync=backend.fsync, timeout=backend.lock_timeout)
                    is None
                ):
                    log.warning(
                        "media blobs not swept", session_id=session_id, folder=backend.folder
                    )

        await self._locked(session_id, exclusive=True, work=work)
        await self._leases.forget(session_id)

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
            session_id,
            exclusive=False,
            work=lambda txn: self._core.session_at(txn, session_id, revision),
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
            session_id, exclusive=False, work=lambda txn: self._core.batches(txn, session_id, after)
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
        validate_session_id(new_session_id)
        initial, batches, session = await self._locked(
            session_id,
            exclusive=False,
            work=lambda txn: self._core.history(txn, session_id, revision),
        )
        core = self._core
        first = msgspec.structs.replace(initial, id=new_session_id)
        record, blobs = core.session_record(first)
        records = [encode_packed(TAG_CREATE, 0, record)]
        for batch in batches:
            renamed = msgspec.structs.replace(batch, session_id=new_session_id)
            record, more = core.batch_record(renamed)
            records.append(encode_packed(TAG_BATCH, batch.revision, record))
            blobs.update(more)
        forked = msgspec.structs.replace(session, id=new_session_id)
        snapshot = None
        if revision:
            record, more = core.session_record(forked)
            snapshot = NewSnapshot(revision, record)
            blobs.update(more)

        def write() -> FilePos:
            self._backend.put_blobs(blobs)  # the source's: held already, nothing written
            return self._backend.new_log(new_session_id, records, snapshot)

        async with self._backend.session_lock(new_session_id):
            position = await run_in_thread(lambda: released(write))
        self._core.remember(new_session_id, Cached(forked, position, Marks()))
        return forked

    # -- small helpers ----------------------------------------------------------

    def _check_session(self, session_id: str) -> None:
        """Raise :class:`~stepmachine.SessionNotFoundError` unless the session's log
        exists (in a worker thread)."""
        if not os.path.lexists(self._backend.log_path(session_id)):
            raise SessionNotFoundError(session_id)

    def _open_leases(self) -> FlockLeases:
        self._check_open()
        return self._leases

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"FileStore on {self.folder} is closed")

    async def _locked(self, session_id: str, *, exclusive: bool, work: Callable[[FileTxn], T]) -> T:
        """Run ``work(txn)`` in a worker thread, holding the log's file lock
        (:meth:`._file_backend.FileBackend.locked`)."""
        self._check_open()
        return await self._backend.locked(session_id, exclusive=exclusive, work=work)


async def _hop(work: Callable[[], T]) -> T:
    """Run ``work()`` in a worker thread (the leases' file work). Once started it
    runs to its end and its result is returned; a cancel lands at the next checkpoint."""
    return await run_in_thread(work)


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
