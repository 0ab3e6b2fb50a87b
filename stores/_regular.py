"""Opening a stored file without ever blocking: only regular files are read.

``open()`` of a FIFO for reading waits until some process opens it for writing,
which may be never; a device or a socket in a store's folder is no stored data
either. :func:`open_regular` opens with ``O_NONBLOCK`` (a FIFO opens at once),
``O_NOFOLLOW`` (a symbolic link is refused where the store wrote a file) and
``O_CLOEXEC``, checks with ``fstat`` that what it opened is a regular file, and
only then hands the descriptor back. ``O_NONBLOCK`` has no effect on a regular
file's reads and writes, so the descriptor is used as it is.

Everything else is a :class:`~stepmachine.StoredDataError` naming the file and
what it is (stored data is data: it is read only when it is what the store
wrote), and nothing is read or changed.
"""

from __future__ import annotations

import errno
import os
import stat

from stepmachine import StoredDataError

__all__ = ["describe_mode", "not_regular", "open_regular"]

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISLNK, "a symbolic link"),
)

_FLAGS = os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def describe_mode(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words ("a FIFO (named pipe)", ...)."""
    for test, words in _KINDS:
        if test(mode):
            return words
    return f"a file of type {stat.S_IFMT(mode):#o}"


_MOVE_IT = "move it out of the store's folder (or restore the file from a backup)"


def not_regular(path: str, what: str, kind: str, fix: str = _MOVE_IT) -> StoredDataError:
    """The error for ``path`` (``what`` it should be, e.g. "the log of session 'a'")
    being ``kind`` instead of a regular file; ``fix`` says what to do."""
    return StoredDataError(
        f"{path}, {what}, is {kind}, not a regular file: stored data is read only from "
        "the regular files the store wrote, so nothing was read from it and nothing was "
        f"changed; {fix}"
    )


def open_regular(
    path: str,
    flags: int,
    what: str,
    *,
    follow: bool = False,
    mode: int = 0o600,
    fix: str = _MOVE_IT,
) -> int:
    """Open ``path`` with ``flags`` (plus ``O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC``) and return
    the descriptor of what is there, a regular file.

    With ``os.O_CREAT`` in ``flags`` a regular file (``mode``, narrowed by the
    umask) is made when nothing is there; whatever else is there is refused as
    without it (``O_CREAT`` opens an existing FIFO; ``O_NONBLOCK`` makes that
    open return at once, or fail with ``ENXIO`` when it is write-only).

    Args:
        path: the file.
        flags: ``os.O_RDONLY``, or ``os.O_RDWR | os.O_APPEND``, ``os.O_RDWR |
            os.O_CREAT``, ...; never ``O_EXCL`` (an existing file is opened).
        what: what the file is to the store, for the error ("the log of session 'a'").
        follow: follow a symbolic link (no ``O_NOFOLLOW``) to the regular file it
            names, where a link is expected (a database file linked in).
        mode: the permissions of a file ``O_CREAT`` makes.
        fix: what to do about a file that is not regular, for the error.

    Raises:
        FileNotFoundError: nothing is there (without ``O_CREAT``), or the folder
            is missing.
        StoredDataError: something that is not a regular file is there (a FIFO,
            a directory, a device, a socket, a symbolic link); nothing was read
            or written.
        OSError: it cannot be opened (no permission, ...).
    """
    try:
        fd = os.open(path, flags | _FLAGS | (0 if follow else _NOFOLLOW), mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow and os.path.islink(path):
            raise not_regular(path, what, "a symbolic link", fix) from None
        if exc.errno in (errno.EISDIR, errno.ENXIO) and os.path.lexists(path):
            # EISDIR: a directory opened to write; ENXIO: a FIFO opened write-only
            # with no reader, or a socket.
            raise not_regular(path, what, describe_mode(os.stat(path).st_mode), fix) from None
        raise
    try:
        st_mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st_mode):
        os.close(fd)
        raise not_regular(path, what, describe_mode(st_mode), fix)
    return fd
