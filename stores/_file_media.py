"""The media blobs of a :class:`~stepmachine.stores.FileStore`: ``<folder>/.media/<hex>``.

One regular file per SHA-256 digest (:mod:`._media_blobs`). Everything here
works through a descriptor of the ``.media`` folder opened with
``O_NOFOLLOW | O_DIRECTORY``, and every blob name is opened relative to it:

- **Inside the store.** A ``.media`` that is a symbolic link (or anything but a
  folder) is refused for reads and writes alike with
  :class:`~stepmachine.StoredDataError` naming it: the store's media never
  live, and are never written, outside its folder.
- **Never blocks.** A blob is opened with ``O_NONBLOCK | O_NOFOLLOW`` and
  ``fstat``-checked before a byte is read: a FIFO, a device, a directory or a
  symbolic link in its place is a ``StoredDataError`` (a FIFO would otherwise
  block ``open()`` for ever, waiting for a writer).
- **Damage is repaired by a write of the same bytes.** :func:`put_blobs`
  writes a blob that is missing, and rewrites one whose size differs from the
  bytes given, or that is not a regular file, or whose bytes do not hash to
  its digest. Cost: the size is an ``fstat`` on every write; the bytes are
  hashed at most once per process per digest (:data:`._media_blobs.VERIFIED`
  remembers blobs this process wrote, read back or checked). A rewrite is
  crash-safe: a temporary file, fsynced, renamed over the old name, the folder
  fsynced; a crash leaves the old file or the new one, never a torn blob.
- **Removal** (:func:`sweep_blobs`, when a session whose log named blobs is
  deleted): the blobs no remaining log names are unlinked and the folder
  fsynced. Shared blobs are counted by the logs themselves (a fork's log
  restates the records it copied; a snapshot only restates what its log
  names), so nothing can drift. Writers and the sweep are ordered by a
  ``flock`` on the ``.media`` folder itself (no extra file): :func:`put_blobs`
  takes it shared and the writer keeps it until its record is in its log
  (:func:`release_media`, called when the operation's lock hold ends), the
  sweep takes it exclusive; so a writer that found a blob present has its
  record in its log before the sweep reads the logs, and one that comes
  after finds the blob gone and writes it again. Crash-safe: the session's
  files are removed first, then the blobs; a crash between leaves blobs no log
  names, which the next sweep (any later delete of a session with media)
  removes. A sweep that cannot get the lock within ``timeout`` (a writer
  stuck holding it) is skipped with a warning: the blobs stay, nothing is
  lost.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

try:
    import fcntl
except ImportError:  # not POSIX (Windows): FileStore refuses to open, so nothing here runs
    fcntl = None  # type: ignore[assignment]

from stepmachine import StoredDataError
from stepmachine.extend import media_digest

from ._file_log import fsync_dir, parse_records, read_range, write_all
from ._media_blobs import VERIFIED, check_digest, named_digests

__all__ = [
    "log_digests",
    "media_dir",
    "put_blobs",
    "read_blob",
    "release_media",
    "released",
    "sweep_blobs",
]

T = TypeVar("T")
_BLOB_NAME = re.compile(r"[0-9a-f]{64}\Z")


class _Held(threading.local):
    """The ``.media`` descriptor this thread holds a shared lock on, and its store."""

    fd: int = -1
    folder: str = ""


_HELD = _Held()


def _hold(folder: str, fsync: bool) -> int:
    """The ``.media`` descriptor of ``folder``, locked shared for this thread until
    :func:`release_media` (made if missing)."""
    if _HELD.fd >= 0 and _HELD.folder == folder:
        return _HELD.fd
    release_media()
    dfd = media_dir(folder, create=True, fsync=fsync)
    assert dfd is not None
    try:
        fcntl.flock(dfd, fcntl.LOCK_SH)
    except BaseException:
        os.close(dfd)
        raise
    _HELD.fd, _HELD.folder = dfd, folder
    return dfd


def release_media() -> None:
    """Release the shared ``.media`` lock this thread took in :func:`put_blobs`, if any
    (call it once the record naming the blobs is written, or the operation ended)."""
    fd, _HELD.fd = _HELD.fd, -1
    if fd >= 0:
        os.close(fd)


def released(work: Callable[[], T]) -> T:
    """``work()``, then :func:`release_media` however it ends."""
    try:
        return work()
    finally:
        release_media()


_POSIX = {
    name: getattr(os, name, 0) for name in ("O_DIRECTORY", "O_NOFOLLOW", "O_CLOEXEC", "O_NONBLOCK")
}  # 0 where the platform lacks one (Windows: FileStore refuses to open there)
_DIR_FLAGS = os.O_RDONLY | _POSIX["O_DIRECTORY"] | _POSIX["O_NOFOLLOW"] | _POSIX["O_CLOEXEC"]
_READ_FLAGS = os.O_RDONLY | _POSIX["O_NONBLOCK"] | _POSIX["O_NOFOLLOW"] | _POSIX["O_CLOEXEC"]


def _refused(folder: str, what: str) -> StoredDataError:
    return StoredDataError(
        f"stored data is data: the media folder {folder} is {what}, not a folder inside the "
        "store; media are only read from and written to the store's own folder. Move the "
        "blobs into a real .media folder there (or restore it from a backup); nothing was "
        "read or written"
    )


def media_dir(folder: str, *, create: bool = False, fsync: bool = True) -> int | None:
    """A descriptor of ``<folder>/.media`` (the caller closes it), or None when
    it does not exist and ``create`` is false.

    With ``create`` a missing folder is made (0o700) and, with ``fsync``, its
    parent fsynced.

    Raises:
        StoredDataError: ``.media`` is a symbolic link or not a folder.
    """
    path = os.path.join(folder, ".media")
    for _ in range(2):
        try:
            return os.open(path, _DIR_FLAGS)
        except FileNotFoundError:
            if not create:
                return None
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)
            if fsync:
                fsync_dir(folder)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                kind = "a symbolic link" if os.path.islink(path) else "not a folder"
                raise _refused(path, kind) from None
            raise
    raise _refused(path, "missing though it was just made")  # pragma: no cover - a race


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device or special file"


def _read_at(dfd: int, name: str, where: str) -> bytes | None:
    """The bytes of regular file ``name`` in ``dfd``; None when there is none.

    Raises:
        StoredDataError: something else than a regular file is there.
    """
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise StoredDataError(
            f"stored data is data: the media blob {where} is a symbolic link, which is never "
            "followed; put the blob's own bytes there (or restore it); nothing was read"
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise StoredDataError(
                f"stored data is data: the media blob {where} is {_kind(info.st_mode)}, not a "
                "regular file; put the blob's own bytes there (or restore it); nothing was read"
            )
        os.set_blocking(fd, True)
        return read_range(fd, 0, info.st_size)
    finally:
        os.close(fd)


def read_blob(folder: str, digest: str) -> bytes | None:
    """The bytes of the blob for ``digest`` in ``<folder>/.media``, or None when
    there is none (or ``digest`` is not one: it names a file only once checked).

    Never blocks on what is in the blob's place (see the module docstring).

    Raises:
        StoredDataError: ``.media`` or the blob is not what it must be.
    """
    if not check_digest(digest):
        return None
    dfd = media_dir(folder)
    if dfd is None:
        return None
    try:
        name = digest.removeprefix("sha256:")
        return _read_at(dfd, name, os.path.join(folder, ".media", name))
    finally:
        os.close(dfd)


def _sound(dfd: int, name: str, digest: str, size: int, label: str) -> bool:
    """Whether the blob ``name`` holds ``size`` bytes hashing to ``digest``
    (hashed once per process per digest)."""
    try:
        info = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(info.st_mode) or info.st_size != size:
        return False
    if VERIFIED.holds(label, digest):
        return True
    try:
        data = _read_at(dfd, name, name)
    except StoredDataError:  # replaced by something else since the stat
        return False
    if data is None or media_digest(data) != digest:
        return False
    VERIFIED.add(label, digest)
    return True


def put_blobs(
    folder: str,
    blobs: Mapping[str, bytes],
    *,
    fsync: bool,
    boundary: Callable[[str], None],
) -> None:
    """Write each blob of ``blobs`` (digest to bytes) that is missing or damaged.

    Each goes to a temporary file in ``.media`` that is fsynced and then
    renamed to its digest's hex (whole or not at all, over a damaged one), and
    the folder is fsynced before this returns: a log record written afterwards
    never refers to a blob a crash could lose. ``boundary`` is called with
    ``"media.written"`` and ``"media.synced"`` when something was written.
    With ``fsync=False`` nothing is fsynced.

    Raises:
        StoredDataError: ``.media`` is a symbolic link or not a folder, or a
            folder stands in a blob's place (it cannot be renamed over).
    """
    if not blobs:
        return
    media = os.path.join(folder, ".media")
    dfd = _hold(folder, fsync)  # released by the caller once its record is written
    wrote = False
    for digest, data in sorted(blobs.items()):
        if not check_digest(digest):  # pragma: no cover - the core made it
            raise ValueError(f"not a media digest: {digest!r}")
        name = digest.removeprefix("sha256:")
        if _sound(dfd, name, digest, len(data), media):
            continue
        temp = f".{secrets.token_hex(8)}.tmp"
        fd = os.open(
            temp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
            0o600,
            dir_fd=dfd,
        )
        try:
            os.fchmod(fd, 0o600)
            write_all(fd, data)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.replace(temp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dfd)
            raise StoredDataError(
                f"stored data is data: the media blob {os.path.join(media, name)} cannot "
                f"be replaced by its bytes ({exc.strerror}); remove what stands there; "
                "nothing was written"
            ) from None
        VERIFIED.add(media, digest)
        wrote = True
    if wrote:
        boundary("media.written")
        if fsync:
            os.fsync(dfd)
        boundary("media.synced")


def log_digests(path: str) -> set[str] | None:
    """The digests the records of the log at ``path`` name; empty when there is
    no such file, None when it cannot be read whole (every blob is then kept)."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:
        return set()
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        buf = read_range(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    try:
        records, _ = parse_records(buf, 0, path)  # a torn tail names nothing durable
    except StoredDataError:
        return None
    return named_digests(record.payload for record in records)


def sweep_blobs(folder: str, *, fsync: bool, timeout: float) -> int | None:
    """Remove the blobs of ``<folder>/.media`` that no session log in ``folder``
    names, under the exclusive ``.media`` lock (module docstring: *Removal*).

    Returns how many were removed, or None when the sweep was skipped (the lock
    not had within ``timeout`` seconds, a log unreadable: every blob kept).

    Raises:
        StoredDataError: ``.media`` is a symbolic link or not a folder.
    """
    dfd = media_dir(folder)
    if dfd is None:
        return 0
    media = os.path.join(folder, ".media")
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.005)
        held = {"sha256:" + name for name in os.listdir(dfd) if _BLOB_NAME.match(name)}
        if not held:
            return 0
        logs = sorted(
            name
            for name in os.listdir(folder)
            if name.endswith(".log") and not name.startswith(".")
        )
        found: set[str] = set()
        for name in logs:
            named = log_digests(os.path.join(folder, name))
            if named is None:
                return None
            found |= named
        gone = held - found
        for digest in sorted(gone):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(digest.removeprefix("sha256:"), dir_fd=dfd)
            VERIFIED.discard(media, digest)
        if gone and fsync:
            os.fsync(dfd)
        return len(gone)
    finally:
        os.close(dfd)  # releases the lock
