"""The file byte backend of :class:`~stepmachine.stores.FileStore`: the folder and its locks.

:class:`FileBackend` holds the folder, its options and its locks, and runs
each operation in a worker thread holding the session log's ``fcntl.flock``
(:meth:`FileBackend.locked`): that lock hold is the backend's transaction, and
:class:`._file_txn.FileTxn` the core's view of it. It also writes new logs
(create, fork) and snapshot files.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import msgspec

try:
    import fcntl
except ImportError:  # not POSIX (Windows): FileStore refuses to open
    fcntl = None  # type: ignore[assignment]

from stepmachine import RunError, SessionExistsError, SessionNotFoundError, StepmachineError
from stepmachine._async import run_in_thread

from ._backend import NewSnapshot
from ._file_log import (
    TAG_HEAD,
    TAG_SNAPSHOT,
    LastRecord,
    LogHead,
    create_file,
    digest_of,
    encode_record,
    fsync_dir,
    snapshot_payload,
    write_all,
)
from ._file_media import put_blobs, read_blob, release_media
from ._file_txn import FilePos, FileTxn, log
from ._ids import validate_session_id
from ._regular import open_regular

__all__ = ["FileBackend", "FileLockTimeoutError"]

T = TypeVar("T")


class FileLockTimeoutError(RunError, TimeoutError):
    """The session's file lock was not acquired within ``lock_timeout``; nothing was done."""


@dataclass(slots=True)
class FileBackend:
    """The folder, its options, its locks, and what was reported (torn tails)."""

    folder: str
    fsync: bool
    lock_timeout: float
    hook: Callable[[str], None] | None
    torn_seen: set[tuple[str, str, int]] = field(default_factory=set)
    locks: dict[str, anyio.Lock] = field(default_factory=dict)

    def log_path(self, session_id: str) -> str:
        """The log file of ``session_id`` (checked to be a safe id)."""
        return os.path.join(self.folder, validate_session_id(session_id) + ".log")

    def snap_path(self, session_id: str) -> str:
        """The snapshot file of ``session_id``."""
        return os.path.join(self.folder, validate_session_id(session_id) + ".snap")

    @property
    def media_folder(self) -> str:
        """The folder of media blobs, ``<folder>/.media`` (see :meth:`put_blobs`)."""
        return os.path.join(self.folder, ".media")

    def blob(self, digest: str) -> bytes | None:
        """The bytes of the blob file for ``digest``, or None when there is none
        (:func:`._file_media.read_blob`: never follows a link, never blocks)."""
        return read_blob(self.folder, digest)

    def put_blobs(self, blobs: Mapping[str, bytes]) -> None:
        """Write each blob of ``blobs`` (digest to bytes) that is missing or damaged,
        fsynced before this returns (:func:`._file_media.put_blobs`)."""
        put_blobs(self.folder, blobs, fsync=self.fsync, boundary=self.boundary)

    def boundary(self, name: str) -> None:
        """Call the boundary hook (crash tests), if any."""
        if self.hook is not None:
            self.hook(name)

    def session_lock(self, session_id: str) -> anyio.Lock:
        """This instance's lock on one session (operations within one process queue on it)."""
        lock = self.locks.get(session_id)
        if lock is None:
            lock = self.locks[session_id] = anyio.Lock()
        return lock

    def list_sessions(self) -> list[str]:
        """The ids of the logs in the folder, sorted (worker thread)."""
        ids: list[str] = []
        with os.scandir(self.folder) as entries:
            for entry in entries:
                name = entry.name
                if name.endswith(".log") and not name.startswith("."):
                    try:
                        ids.append(validate_session_id(name[: -len(".log")]))
                    except StepmachineError:
                        continue  # a file someone else put here
        return sorted(ids)

    async def locked(self, session_id: str, *, exclusive: bool, work: Callable[[FileTxn], T]) -> T:
        """Run ``work(txn)`` in a worker thread, holding the log's file lock.

        The lock is tried without blocking in the worker thread; while another
        process holds it, this task sleeps (cancellably) and tries again, until
        ``lock_timeout``. The descriptor is closed (releasing the lock) by the
        worker thread when ``work`` ends, or here if the task is cancelled first.

        The log is opened without blocking and must be a regular file (a FIFO
        there would block a plain ``open()`` until some process wrote to it).

        Raises:
            SessionNotFoundError: no log, or it was deleted while we waited.
            StoredDataError: the log is not a regular file (a FIFO, a directory,
                a symbolic link, a device); nothing was read.
            FileLockTimeoutError: another process held the lock too long.
        """
        path = self.log_path(session_id)
        operation = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        flags = os.O_RDWR | os.O_APPEND if exclusive else os.O_RDONLY
        handle = _Handle()

        def attempt() -> T | _Busy:
            if handle.fd < 0:
                try:
                    handle.fd = open_regular(path, flags, f"the log of session {session_id!r}")
                except FileNotFoundError:
                    raise SessionNotFoundError(session_id) from None
            try:
                fcntl.flock(handle.fd, operation | fcntl.LOCK_NB)
            except BlockingIOError:
                return _BUSY
            try:
                if os.fstat(handle.fd).st_nlink == 0:  # deleted while we waited
                    raise SessionNotFoundError(session_id)
                return work(FileTxn(self, handle.fd))
            finally:
                release_media()  # the shared .media lock put_blobs took (its record is written)
                handle.close()

        async with self.session_lock(session_id):
            try:
                deadline = anyio.current_time() + self.lock_timeout
                delay = 0.001
                while True:
                    result = await run_in_thread(attempt)
                    if not isinstance(result, _Busy):
                        return result
                    if anyio.current_time() >= deadline:
                        raise FileLockTimeoutError(
                            f"the lock on {path} was held by another writer for longer than "
                            f"lock_timeout={self.lock_timeout} s"
                        )
                    await anyio.sleep(delay)
                    delay = min(delay * 2, 0.05)
            finally:
                handle.close()

    def new_log(
        self, session_id: str, records: list[bytes], snapshot: NewSnapshot | None
    ) -> FilePos:
        """Write head + ``records`` to a temporary file, fsync, link it in place,
        then write ``snapshot`` (worker thread); the position at its end.

        Raises:
            SessionExistsError: the id is taken (in this or another process).
        """
        log_path = self.log_path(session_id)
        if os.path.lexists(log_path):
            raise SessionExistsError(session_id)
        nonce = secrets.token_hex(16)
        head = encode_record(TAG_HEAD, 0, msgspec.json.encode(LogHead(session_id, nonce)))
        data = head + b"".join(records)
        temp = os.path.join(self.folder, f".{session_id}.{secrets.token_hex(8)}.new.tmp")
        fd = create_file(temp, exclusive=True)
        try:
            try:
                write_all(fd, data)
                if self.fsync:
                    os.fsync(fd)
                fcntl.flock(fd, fcntl.LOCK_EX)  # held until the snapshot below is in place
                os.link(temp, log_path)
            except FileExistsError:
                raise SessionExistsError(session_id) from None
            finally:
                os.unlink(temp)
            if self.fsync:
                fsync_dir(self.folder)
            self.boundary("create.synced")
            last = LastRecord(len(data) - len(records[-1]), digest_of(records[-1]))
            position = FilePos(nonce, len(data), last)
            if snapshot is not None:
                self.write_snapshot(session_id, position, snapshot)
            return position
        finally:
            os.close(fd)

    def write_snapshot(self, session_id: str, at: FilePos, snapshot: NewSnapshot) -> None:
        """Replace the snapshot with ``snapshot``, bound to the record ending at ``at``
        (the caller holds the log's exclusive lock). A failure is logged, not raised:
        the snapshot is only a cache of the log."""
        payload = snapshot_payload(session_id, at.nonce, at.offset, snapshot.record, at.last)
        data = encode_record(TAG_SNAPSHOT, snapshot.revision, payload)
        temp = os.path.join(self.folder, f".{session_id}.snap.tmp")
        try:
            fd = create_file(temp, exclusive=False)
            try:
                write_all(fd, data)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            self.boundary("snapshot.written")
            os.replace(temp, self.snap_path(session_id))
            self.boundary("snapshot.replaced")
            if self.fsync:
                fsync_dir(self.folder)
        except OSError as exc:
            log.warning(
                "file_store.snapshot_failed",
                session_id=session_id,
                revision=snapshot.revision,
                error=repr(exc),
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
