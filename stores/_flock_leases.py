"""Leases as operating-system file locks: the :class:`~stepmachine.Leases` of
:class:`~stepmachine.stores.SQLiteStore` and :class:`~stepmachine.stores.FileStore`.

What a store with these leases does (one machine, any number of processes and
store instances, the files on a local filesystem):

- A lease is an exclusive ``fcntl.flock`` on the session's lock file, taken
  without waiting. It is held exactly as long as the store instance that
  claimed it keeps it: until ``release``, ``aclose``, or the death of the
  process (the kernel drops the lock, ``SIGKILL`` included). There is no clock
  and no expiry (``leases_expire = False``); ``renew`` only checks, in memory,
  that this instance still holds the lease. ``flock`` belongs to an open file
  description, so two instances in one process exclude each other exactly as
  two processes do. A process that ``fork``\\ s without ``exec`` shares its
  descriptors with the child: the lock is then released only when both are gone.
- ``claim`` gives the next epoch of the session (the last one plus one) and
  records it with the new owner in the lock file itself, so a failed claim
  reads who holds the session (``LeaseHolder(owner, None, epoch)``). The counter
  survives the death of any process; it keeps growing for the id even across
  ``delete`` (lock files are never removed). An owner string must fit that
  record (4 KiB with the session id; a longer one raises ``ValueError``).
- The pending-run mark is an empty file. Marking, taking the mark with a claim,
  ``claim_next``, and a holder's ``release(unless_requested=True)`` (look at
  the mark, then take it or unlock) each run under one short store-wide *meta
  lock* (a second ``flock``), so a ``request_run`` that returned is either seen
  by the holder's release (which then returns ``False`` and keeps the lease) or
  made after the unlock (and the next claimer takes it): it is never lost.
  ``claim_next`` takes the sessions with a mark in id order, skipping those
  another claimer holds; under the meta lock no two claimers interleave, and
  the ``flock`` itself could not be taken twice anyway.
- Abandoned leases: a claim also creates the session's *held* file, and a
  release removes it before it unlocks. A held file whose lock can be taken
  was left by a process that died holding the lease (its run cut short), so
  ``claim_next`` gives that session out too, like a marked one.
- Fencing: ``apply(batch, lease=...)`` writes only while this instance holds
  the session's lock under that owner and epoch (:meth:`FlockLeases.fenced`).
  Checking this instance's table is enough: while the process lives and keeps
  the descriptor open, no other claim can take the lock, so no newer epoch can
  exist; and a release of that lease in this instance waits for the write (and a
  write after it is refused).

Durability: the record is one JSON line at the start of the lock file,
overwritten by a single ``pwrite`` of at most one page (a process killed
during it leaves the old record or the new one, never a mix; what a longer
old record leaves after the newline is ignored), read and written only under
the meta lock. A mark is a created file. Both survive the death of any process
at any instant. Neither is fsynced: after an operating-system crash a mark may
be gone (request the run again) and a record may be back at an earlier epoch,
or damaged (:class:`~stepmachine.StoredDataError` naming the file; removing it
restarts that session's epochs at 1). That cannot weaken fencing: a crash ends
every holder, and only a live holder's own instance accepts its lease.

Only regular files are lease files: every one is opened with ``O_NONBLOCK |
O_NOFOLLOW`` and checked with ``fstat`` (:func:`._regular.open_regular`), so a
FIFO, a directory, a device, a socket or a symbolic link where a lock file or
a mark belongs never blocks a process (which, inside the meta lock, would stop
every process using the folder): it is a :class:`~stepmachine.StoredDataError`
naming the file and what to do. ``claim`` raises it; ``claim_next`` skips that
session (logged once per store instance at ERROR, ``lease_files_damaged``) and
serves the others, as it does a damaged record. A mark is only created and
unlinked, never read: a folder there, which cannot be unlinked, is the error of
a claim or ``request_run`` (a release or a delete, whose work is done all the
same, logs it and goes on). A damaged meta lock or lease folder is the error of
every lease operation.

Layout of the lease folder (``<database>-leases`` beside an SQLite database,
``.leases`` inside a FileStore folder; created 0o700 at the first lease
operation, files 0o600). ``<name>`` is the session id encoded as lowercase
base32 without padding: reversible, unique on case-insensitive filesystems, at
most 205 characters::

    meta.lock               the meta lock (empty)
    sessions/<name>.lock    the session's lock; holds {"session_id","epoch","owner"}
                            of its last claim (never removed, never replaced)
    runs/<name>             the session's pending-run mark (empty)
    held/<name>             a claim not yet released (empty; see "abandoned leases")

Do not remove the folder while a process uses the store: a lock file made anew
could be locked while the old one still is.

Every file operation runs in an anyio worker thread, on asyncio and trio. The
meta lock is tried without blocking; while another process holds it (for a
few system calls), the task sleeps (cancellably) and tries again, but never
without bound: a process stopped inside it (``SIGSTOP``, ``docker pause``, a
debugger) must not hang every other process's lease calls. A claim answers
at once that a session this instance holds is busy, and otherwise after
:data:`CLAIM_META_WAIT` (1 s, or its ttl if shorter) that the session is busy,
holder unknown (``busy="fail"`` fails, ``busy="wait"`` tries again within its
``wait_timeout``); a release lets go of its lock without the meta lock after
:data:`META_WAIT` (5 s, or the lease's ttl if shorter), leaving a mark set
meanwhile for the next claimer; ``request_run`` and ``claim_next`` raise
:class:`TimeoutError` (transient: ``serve()`` tries again) after
:data:`META_WAIT`, nothing done. A worker thread whose caller is gone
(asyncio's native ``task.cancel()`` is not stopped by a shield) undoes a claim
it made (the lock let go, a mark it took made again) and gives back a mark
that a release took. On a platform without ``fcntl`` (Windows) every lease
operation raises :class:`~stepmachine.ConfigurationError`.
"""

from __future__ import annotations

import base64
import contextlib
import os
import stat
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar

import anyio
import anyio.lowlevel
import msgspec
import structlog

try:
    import fcntl
except ImportError:  # not POSIX (Windows): the stores import, leases refuse
    fcntl = None  # type: ignore[assignment]

from stepmachine import (
    ConfigurationError,
    LeaseLostError,
    SessionNotFoundError,
    StepmachineError,
    StoreClosedError,
    StoredDataError,
)
from stepmachine._async import light_checkpoint, run_in_thread
from stepmachine._lease import check_claim
from stepmachine.extend import Lease, LeaseHolder

from ._ids import validate_session_id
from ._regular import describe_mode, not_regular, open_regular

__all__ = ["FlockLeaseMethods", "FlockLeases"]

T = TypeVar("T")

_log = structlog.stdlib.get_logger("stepmachine")


RECORD_LIMIT = 4096
"""The most bytes a lock file's record takes: one page, written by one ``pwrite``."""


class _Record(msgspec.Struct, frozen=True):
    """A lock file's content: the session's last claim, as one JSON line."""

    session_id: str
    epoch: int
    owner: str


_record_decoder = msgspec.json.Decoder(_Record)


@dataclass(slots=True)
class _Held:
    """A lease this instance holds: the locked descriptor, and a guard that a
    fenced write and the release hold, so neither runs inside the other."""

    lease: Lease
    fd: int
    guard: threading.Lock
    took_mark: bool = False  # the claim took the pending-run mark (given back if undone)


class _Busy:
    """Returned by an attempt that found the meta lock taken."""


_BUSY = _Busy()


META_WAIT = 5.0
"""Seconds a lease call waits at most for the store-wide meta lock (or the lease's ttl,
if shorter); see :meth:`FlockLeases._meta` for what each call does then."""

CLAIM_META_WAIT = 1.0
"""Seconds a claim waits at most for the meta lock (or its ttl, if shorter) before it
answers that the session is busy."""


class _Handoff:
    """Between a call into the worker thread and its caller, which may be gone (asyncio's
    native cancel is not stopped by the hop's shield): whoever learns last that the other
    side is done undoes the work's effect, so a lease is never taken for nobody."""

    __slots__ = ("abandoned", "done", "lock", "result")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = False
        self.abandoned = False
        self.result: object = None


class Hop(Protocol):
    """The store's way into its worker thread: ``await hop(work)`` runs ``work()`` there."""

    def __call__(self, work: Callable[[], T], /) -> Awaitable[T]: ...


class FlockLeases:
    """The leases of one store instance, kept as file locks in ``folder``.

    Args:
        folder: the lease folder (created at the first lease operation).
        hop: runs a function in the store's worker thread and returns its
            result (once started, to its end, whatever the cancellation); it
            may raise :class:`~stepmachine.StoreClosedError` once the store is
            closed (a claim that races ``close`` is refused here too).
        check: called inside ``hop`` with a session id; raises
            :class:`~stepmachine.SessionNotFoundError` unless the session exists.
        name: the store, for messages ("SQLiteStore on /path").
    """

    def __init__(self, folder: str, *, hop: Hop, check: Callable[[str], None], name: str) -> None:
        self.folder = folder
        self._hop = hop
        self._check = check
        self._name = name
        self._held: dict[str, _Held] = {}
        self._table = threading.Lock()  # guards _held and _closed
        self._closed = False
        self._made = False
        self._damaged: set[tuple[str, str]] = set()  # (session, error) logged by claim_next

    # -- the Leases operations -------------------------------------------------------

    async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | LeaseHolder:
        """The new lease (next epoch, the mark taken), or who holds the session.

        While the meta lock is taken by another process: a session this
        instance holds is busy at once; otherwise the claim waits for the lock
        at most :data:`CLAIM_META_WAIT` seconds (or ``ttl``, if shorter), then
        answers busy, its holder unknown (``LeaseHolder("(unknown: ...)")``):
        ``busy="fail"`` fails, ``busy="wait"`` tries again within its
        ``wait_timeout``.
        """
        check_claim(owner, ttl)
        wait = min(CLAIM_META_WAIT, ttl)
        return await self._meta(
            lambda: self._claim(session_id, owner, ttl),
            session_id,
            wait=wait,
            busy=lambda: self._held_here(session_id),
            timed_out=lambda: LeaseHolder(
                f"(unknown: another process has held the lease lock {self._meta_path()} "
                f"for over {wait:g} s)",
                None,
            ),
            undo=self._undo_claim,
        )

    async def claim_next(self, owner: str, ttl: float) -> Lease | None:
        """Claim the first session (by id) with a mark and no holder, or ``None``.

        A mark left by a session deleted meanwhile is dropped, and the next
        one is tried.
        """
        check_claim(owner, ttl)
        return await self._meta(
            lambda: self._claim_marked(owner, ttl),
            wait=min(META_WAIT, ttl),
            undo=self._undo_claim,
        )

    async def request_run(self, session_id: str) -> None:
        """Set the session's pending-run mark (an empty file, made under the meta lock)."""
        await self._meta(lambda: self._mark(session_id), session_id, wait=META_WAIT)

    async def renew(self, lease: Lease) -> Lease:
        """``lease`` itself while this instance holds it; no file is touched.

        Raises:
            LeaseLostError: this instance does not hold ``lease`` (released,
                or claimed by another instance or process).
        """
        await light_checkpoint()  # nothing here waits: a cancellation point is what it needs
        self._require_flock()
        self._holding(lease, lease.session_id)
        return lease

    async def release(self, lease: Lease, *, unless_requested: bool = False) -> bool:
        """Unlock ``lease`` (``True``), or, with ``unless_requested`` and a mark set,
        take the mark and keep the lease (``False``). A lease this instance does
        not hold: ``True``, nothing done.

        Never leaves the lease held when it cannot do its work: if the meta
        lock stays taken by another process for :data:`META_WAIT` seconds (or
        the lease's ttl, if shorter), the lock is let go without it and without
        looking at the mark (logged, ``lease_release_without_meta_lock``;
        ``True``: a mark set meanwhile stays for the next claimer); and if the
        release raises (or its caller is cancelled while it runs), the lease is
        let go in this instance before that propagates.
        """
        try:
            return await self._meta(
                lambda: self._release(lease, unless_requested),
                wait=min(META_WAIT, lease.ttl) if lease.ttl > 0 else META_WAIT,
                timed_out=lambda: self._release_without_meta(lease),
                undo=lambda released: self._undo_release(lease, released),
            )
        except BaseException:
            with contextlib.suppress(Exception):  # the first error is the one to see
                self._drop(lease)
            raise

    async def forget(self, session_id: str) -> None:
        """The session was deleted: drop its mark. Its lease files stay (module docstring)."""
        if fcntl is not None:  # a plain unlink: whoever looks at the mark next sees it gone
            await run_in_thread(_unmark, self._run_path(session_id))

    async def close(self) -> None:
        """Release every lease this instance holds (marks stay); later claims are refused.

        Shielded from cancellation. Idempotent.
        """
        with anyio.CancelScope(shield=True):
            await run_in_thread(self._close)

    @contextlib.contextmanager
    def fenced(self, lease: Lease | None, session_id: str) -> Iterator[None]:
        """Run the body (a write of ``session_id``) only while ``lease`` is held here.

        Called in the worker thread that writes. ``None``: no check. The
        lease's guard is held until the body ends, so a release of the lease in
        this instance waits for the write.

        Raises:
            LeaseLostError: ``lease`` is for another session, or this instance
                does not hold it (released, never claimed here, or superseded).
        """
        if lease is None:
            yield
            return
        if lease.session_id != session_id:
            raise LeaseLostError(
                session_id, lease.owner, lease.epoch, f"it is a lease of {lease.session_id!r}"
            )
        self._require_flock()
        held = self._holding(lease, session_id)
        with held.guard:
            if held.fd < 0:
                raise LeaseLostError(session_id, lease.owner, lease.epoch, "released")
            yield

    # -- under the meta lock (worker thread) -------------------------------------------

    def _claim(self, session_id: str, owner: str, ttl: float) -> Lease | LeaseHolder:
        held_here = self._held_here(session_id)
        if held_here is not None:  # held by this instance (the same owner string included)
            return held_here
        path = self._lock_path(session_id)
        fd = open_regular(
            path, os.O_RDWR | os.O_CREAT, f"the lease lock of session {session_id!r}", fix=_FIX_LOCK
        )
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                last = _read_record(fd, path, session_id)
                if last is None:
                    return LeaseHolder("(unknown)", None)
                return LeaseHolder(last.owner, None, last.epoch)
            self._refuse_if_closed()
            last = _read_record(fd, path, session_id)
            lease = Lease(session_id, owner, (last.epoch if last else 0) + 1, ttl)
            for mark in (self._held_path(session_id), self._run_path(session_id)):
                _check_mark(mark)  # before the record: a refused claim changes nothing
            _write_record(fd, path, _Record(session_id, lease.epoch, owner))
            _touch(self._held_path(session_id))  # first: a claim cut short leaves work behind
            took_mark = _remove(self._run_path(session_id))  # the claimer runs the turn
            with self._table:
                self._refuse_if_closed()
                self._held[session_id] = _Held(lease, fd, threading.Lock(), took_mark)
                fd = -1  # kept open by the table: the lease
        finally:
            if fd >= 0:
                os.close(fd)  # unlocks, if locked
        return lease

    def _claim_marked(self, owner: str, ttl: float) -> Lease | None:
        for session_id in self._marked():
            try:
                claimed = self._claim(session_id, owner, ttl)
            except StoredDataError as exc:  # one damaged lease file does not stop every worker
                self._report_damaged(session_id, exc)
                continue
            if not isinstance(claimed, Lease):
                continue  # held by another
            try:
                self._check(session_id)
            except SessionNotFoundError:  # deleted (its mark is taken by the claim)
                self._drop(claimed)
                continue
            except BaseException:
                self._drop(claimed)
                raise
            return claimed
        return None

    def _marked(self) -> list[str]:
        """The ids with a mark or a held file, the longest-waiting first (by the file's
        modification time, then id); names of no valid id are skipped."""
        waiting: dict[str, tuple[int, str]] = {}
        for folder in ("runs", "held"):
            with os.scandir(os.path.join(self.folder, folder)) as entries:
                for entry in entries:
                    try:
                        session_id = _decode(entry.name)
                        since = entry.stat().st_mtime_ns
                    except (ValueError, StepmachineError, FileNotFoundError):
                        continue  # not ours, or gone meanwhile
                    key = (since, session_id)
                    waiting[session_id] = min(waiting.get(session_id, key), key)
        return [session_id for _, session_id in sorted(waiting.values())]

    def _report_damaged(self, session_id: str, exc: StoredDataError) -> None:
        """Log (at ERROR, once per store instance and error) that ``claim_next`` skips
        ``session_id``: one of its lease files is damaged (``exc`` names it and the fix)."""
        with self._table:
            seen = (session_id, str(exc)) in self._damaged
            self._damaged.add((session_id, str(exc)))
        if not seen:
            _log.error(
                "lease_files_damaged",
                session_id=session_id,
                detail=str(exc),
                note="the session is skipped by claim_next until the file is fixed",
            )

    def _mark(self, session_id: str) -> None:
        _touch(self._run_path(session_id))

    def _held_here(self, session_id: str) -> LeaseHolder | None:
        """Who holds ``session_id`` in this instance, or ``None`` (no file is touched)."""
        with self._table:
            held = self._held.get(session_id)
        if held is None:
            return None
        return LeaseHolder(held.lease.owner, None, held.lease.epoch)

    def _undo_claim(self, claimed: Lease | LeaseHolder | None) -> None:
        """Let go of a lease claimed for a caller that is gone, giving back the mark it took.

        The mark is made first, while the lock still keeps every other claimer out.
        """
        if not isinstance(claimed, Lease):
            return
        held = self._holds(claimed)
        if held is None:
            return
        try:
            if held.took_mark:
                _touch(self._run_path(claimed.session_id))
        finally:
            self._drop(claimed)

    def _undo_release(self, lease: Lease, released: bool) -> None:
        """A release that took the mark (``False``) for a caller that is gone gives it back."""
        if not released and self._holds(lease) is not None:
            _touch(self._run_path(lease.session_id))

    def _release_without_meta(self, lease: Lease) -> bool:
        """Let go of ``lease`` without the meta lock, which another process does not let go."""
        _log.warning(
            "lease_release_without_meta_lock",
            session_id=lease.session_id,
            detail=f"another process has held {self._meta_path()} too long; the lease was let "
            "go without looking at the pending-run mark (a turn requested meanwhile stays "
            "marked for the next claimer)",
        )
        self._drop(lease)
        return True

    def _release(self, lease: Lease, unless_requested: bool) -> bool:
        held = self._holds(lease) is not None
        if unless_requested and held and _unmark(self._run_path(lease.session_id)):
            return False  # the mark is taken: the holder runs the requested turn
        self._drop(lease)
        return True

    # -- plumbing --------------------------------------------------------------------

    async def _meta(
        self,
        work: Callable[[], T],
        session_id: str | None = None,
        *,
        wait: float = META_WAIT,
        busy: Callable[[], T | None] | None = None,
        timed_out: Callable[[], T] | None = None,
        undo: Callable[[T], None] | None = None,
    ) -> T:
        """Run ``work()`` in the store's worker thread holding the meta lock,
        after checking that ``session_id`` (if given) exists.

        The meta lock is tried without blocking, again and again (pauses from
        0.5 ms doubling to 20 ms), for at most ``wait`` seconds: it is never
        waited for without bound, so a process stopped inside it (``SIGSTOP``,
        ``docker pause``, a debugger) cannot hang the lease calls of others.
        While it is taken, ``busy()`` may answer instead (not ``None``). When
        ``wait`` passed: ``timed_out()``, or without it a :class:`TimeoutError`
        (an ``OSError``: transient, so ``serve()`` and durable cycles try again).

        Cancellation: a cancel while waiting for the meta lock does nothing;
        once ``work`` runs it finishes and its result is returned, the cancel
        landing at the caller's next checkpoint. If the caller is gone all the
        same (asyncio's native cancel does not stop at the hop's shield),
        ``undo(result)`` is called once ``work`` has finished, in whichever
        thread learns last, so that no lease is kept for a caller that is gone.
        """
        self._require_flock()
        if session_id is not None:
            validate_session_id(session_id)
        deadline = anyio.current_time() + wait
        delay = 0.0005
        while True:
            result = await self._attempt(work, session_id, undo)
            if not isinstance(result, _Busy):
                return result
            if busy is not None:
                answer = busy()
                if answer is not None:
                    return answer
            now = anyio.current_time()
            if now >= deadline:
                if timed_out is not None:
                    return timed_out()
                raise TimeoutError(
                    f"another process has held the lease lock {self._meta_path()} of "
                    f"{self._name} for over {wait:g} s, so nothing was done; a process stopped "
                    "inside it (SIGSTOP, `docker pause`, a debugger) holds up every lease call "
                    "of every process using the store: resume or end it, then try again"
                )
            await anyio.sleep(min(delay, deadline - now))
            delay = min(delay * 2, 0.02)

    async def _attempt(
        self, work: Callable[[], T], session_id: str | None, undo: Callable[[T], None] | None
    ) -> T | _Busy:
        """One try of the meta lock in the worker thread; ``work()``'s result, or ``_BUSY``.

        With ``undo``: a result whose caller is gone is undone (see :meth:`_meta`),
        by the worker thread still holding the meta lock when the caller left
        first, so no other lease call sees the work before it is undone.
        """
        if undo is None:
            return await self._hop(lambda: self._try_meta(work, session_id))
        handoff = _Handoff()

        def handing_off() -> T:
            result = work()
            with handoff.lock:
                handoff.done, handoff.result = True, result
                abandoned = handoff.abandoned
            if abandoned:
                _undo_quietly(undo, result)  # the caller left while this ran
            return result

        try:
            return await self._hop(lambda: self._try_meta(handing_off, session_id))
        except BaseException:
            with handoff.lock:
                handoff.abandoned = True
                finished, result = handoff.done, handoff.result
            if finished:  # it ran to its end, but its result never reached the caller
                _undo_quietly(undo, result)  # type: ignore[arg-type]  # handing_off's: a T
            raise

    def _try_meta(self, work: Callable[[], T], session_id: str | None) -> T | _Busy:
        if session_id is not None:
            self._check(session_id)
        if not self._made:
            subfolders = [os.path.join(self.folder, name) for name in ("sessions", "runs", "held")]
            for path in (self.folder, *subfolders):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path, 0o700)  # owner-only (the umask can only narrow it)
                if not os.path.isdir(path):  # a file there: every lease file in it would fail
                    kind = describe_mode(os.lstat(path).st_mode)
                    raise StoredDataError(
                        f"{path}, a folder of the leases of {self._name}, is {kind}, not a "
                        "folder: no lease was taken and nothing was changed; move it away "
                        "when no process uses the store (the folder is made again)"
                    )
            self._made = True
        fd = open_regular(
            self._meta_path(),
            os.O_RDWR | os.O_CREAT,
            f"the lock of the leases of {self._name}",
            fix=_FIX_META,
        )
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return _BUSY
            return work()
        finally:
            os.close(fd)  # releases the meta lock

    def _holds(self, lease: Lease) -> _Held | None:
        """This instance's entry for ``lease`` (same session, owner and epoch), if any."""
        with self._table:
            held = self._held.get(lease.session_id)
        if held is None or (held.lease.owner, held.lease.epoch) != (lease.owner, lease.epoch):
            return None
        return held

    def _holding(self, lease: Lease, session_id: str) -> _Held:
        held = self._holds(lease)
        if held is None:
            raise LeaseLostError(
                session_id, lease.owner, lease.epoch, "this store instance does not hold it"
            )
        return held

    def _drop(self, lease: Lease) -> None:
        """Unlock ``lease`` if this instance holds it; waits for a fenced write in flight."""
        held = self._holds(lease)
        if held is None:
            return  # lost already, or never ours: nothing to do
        with held.guard:
            with self._table:
                if self._held.get(lease.session_id) is held:
                    del self._held[lease.session_id]
            fd, held.fd = held.fd, -1
            if fd >= 0:
                try:
                    _unmark(self._held_path(lease.session_id))  # not abandoned
                finally:
                    os.close(fd)  # the kernel drops the lock

    def _close(self) -> None:
        with self._table:
            self._closed = True
            leases = [held.lease for held in self._held.values()]
        for lease in leases:
            self._drop(lease)

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self._name} is closed")

    def _require_flock(self) -> None:
        if fcntl is None or not hasattr(fcntl, "flock"):
            raise ConfigurationError(
                f"leases of {self._name} need POSIX file locks (fcntl.flock), which this "
                f"platform (sys.platform={sys.platform!r}) does not have"
            )

    def _meta_path(self) -> str:
        return os.path.join(self.folder, "meta.lock")

    def _lock_path(self, session_id: str) -> str:
        return os.path.join(self.folder, "sessions", _encode(session_id) + ".lock")

    def _run_path(self, session_id: str) -> str:
        return os.path.join(self.folder, "runs", _encode(session_id))

    def _held_path(self, session_id: str) -> str:
        return os.path.join(self.folder, "held", _encode(session_id))


class FlockLeaseMethods:
    """The :class:`~stepmachine.Leases` methods of a store whose leases are file locks.

    A store inherits them and defines ``_open_leases`` (its
    :class:`FlockLeases`, or :class:`~stepmachine.StoreClosedError` once
    closed); its ``apply`` wraps the write in ``fenced(lease, session_id)``,
    its ``delete`` calls ``forget`` and its ``aclose`` calls ``close``.
    """

    leases_expire: ClassVar[bool] = False
    """Leases are file locks held as long as the holder's store instance (and process)."""

    def _open_leases(self) -> FlockLeases:
        """The store's leases; raises :class:`~stepmachine.StoreClosedError` once closed."""
        raise NotImplementedError

    async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | LeaseHolder:
        """Claim the session for ``owner``: a :class:`~stepmachine.Lease`, or who holds it.

        The lease is this instance's lock on the session's lock file, held
        until :meth:`release`, ``aclose`` or the end of the process; ``ttl`` is
        kept in the lease but nothing expires. Its epoch is one more than the
        session's last claim, and the pending-run mark is taken. A session held
        by anyone (this instance and the same ``owner`` included) gives
        ``LeaseHolder(owner, expires_in=None, epoch=epoch)``; while another
        process keeps the store-wide lock (stopped inside it) for over 1 s,
        ``LeaseHolder("(unknown: ...)")``.

        Raises:
            InvalidSessionIdError: the id is not safe.
            SessionNotFoundError: no session has this id.
            StoreClosedError: the store is closed.
            ValueError: ``owner`` is empty, longer than 256 characters or has
                control characters, or ``ttl`` is not a finite number > 0.
            ConfigurationError: the platform has no ``fcntl.flock`` (Windows).

        Cancellation: a cancel while waiting for the store-wide lock claims
        nothing; once the claim runs, the lease is returned and the cancel
        lands at the caller's next checkpoint (release it in a shielded
        ``finally``). A caller that is gone all the same (asyncio's native
        cancel) leaves no lease: the worker thread lets go of it.
        """
        return await self._open_leases().claim(session_id, owner, ttl)

    async def claim_next(self, owner: str, ttl: float) -> Lease | None:
        """Claim the first session, by id, with a pending-run mark and no holder; or ``None``.

        Never gives one session to two claimers (of any process). Raises and
        cancels as :meth:`claim`.
        """
        return await self._open_leases().claim_next(owner, ttl)

    async def request_run(self, session_id: str) -> None:
        """Set the session's pending-run mark (a file; it survives the death of any process).

        The holder's ``release(lease, unless_requested=True)`` then takes it and
        keeps the lease; without a holder, the next :meth:`claim` or
        :meth:`claim_next` takes it. Raises as :meth:`claim`.
        """
        await self._open_leases().request_run(session_id)

    async def renew(self, lease: Lease) -> Lease:
        """``lease`` itself while this instance holds it (nothing expires; no file is read).

        Raises:
            LeaseLostError: this instance does not hold ``lease``.
            StoreClosedError: the store is closed.
        """
        check_claim(lease.owner, lease.ttl)
        return await self._open_leases().renew(lease)

    async def release(self, lease: Lease, *, unless_requested: bool = False) -> bool:
        """Unlock ``lease``: ``True`` (see :meth:`stepmachine.Leases.release`).

        With ``unless_requested`` and the pending-run mark set, the mark is
        taken and the lease kept: ``False``. Looking at the mark and unlocking
        are one step for every other process (a store-wide lock), so a
        :meth:`request_run` that returned is never lost. A lease this instance
        does not hold: ``True``, nothing done.

        It never raises with the lease still held: a release that fails (or
        is cancelled) lets go of the lock in this instance first, and one
        that cannot get the store-wide lock within 5 s (or the lease's ttl)
        lets go without it, leaving a mark set meanwhile for the next claimer.

        Raises:
            StoreClosedError: the store is closed (its leases were released).

        Cancellation: once it runs, it finishes; a cancel while it waits for
        the store-wide lock lets go of the lease without looking at the mark
        (call it shielded to have the mark looked at).
        """
        return await self._open_leases().release(lease, unless_requested=unless_requested)


def _undo_quietly(undo: Callable[[T], None], result: T) -> None:
    """``undo(result)`` for a caller that is gone: a failure is logged (nobody is left to
    raise it to; the caller's own exception must propagate)."""
    try:
        undo(result)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        _log.warning("lease_undo_failed", error_type=type(exc).__name__, detail=str(exc))


def _encode(session_id: str) -> str:
    """The file name of a (validated) session id: lowercase base32, no padding."""
    return base64.b32encode(session_id.encode()).decode("ascii").rstrip("=").lower()


def _decode(name: str) -> str:
    """The session id a file name encodes; ``ValueError`` or an id error if none."""
    raw = base64.b32decode(name.upper() + "=" * (-len(name) % 8))
    session_id = validate_session_id(raw.decode("ascii"))
    if _encode(session_id) != name:
        raise ValueError(f"{name!r} is not the name of {session_id!r}")
    return session_id


_FIX_LOCK = (
    "remove it when no process holds the session (a lock file made anew restarts the "
    "session's epochs at 1)"
)
_FIX_META = "remove it when no process uses the store (it is made again, empty)"
_FIX_MARK = "remove it (the store makes its marks again, as empty files)"


def _mark_what(path: str) -> str:
    """What ``path`` (``held/<name>`` or ``runs/<name>``) is, for an error."""
    session_id = _decode(os.path.basename(path))
    if os.path.basename(os.path.dirname(path)) == "held":
        return f"the held mark of session {session_id!r}"
    return f"the pending-run mark of session {session_id!r}"


def _touch(path: str) -> None:
    """Create the mark ``path`` (empty) if it does not exist.

    Raises:
        StoredDataError: something that is not a regular file is there (a FIFO
            is refused without blocking: :func:`._regular.open_regular`).
    """
    os.close(open_regular(path, os.O_WRONLY | os.O_CREAT, _mark_what(path), fix=_FIX_MARK))


def _remove(path: str) -> bool:
    """Remove the mark ``path``; whether it was there.

    Whatever is there but a folder is unlinked (nothing is opened: a FIFO or a
    link there is only removed).

    Raises:
        StoredDataError: a folder is there (it cannot be unlinked).
    """
    try:
        os.remove(path)
    except FileNotFoundError:
        return False
    except OSError:
        if os.path.isdir(path) and not os.path.islink(path):
            raise not_regular(path, _mark_what(path), "a directory", _FIX_MARK) from None
        raise
    return True


def _check_mark(path: str) -> None:
    """Refuse what is not a regular file at the mark ``path`` (a FIFO, a folder, a link,
    ...), looking with ``lstat`` only: nothing is opened or changed. Missing or regular:
    nothing to say."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise not_regular(path, _mark_what(path), describe_mode(mode), _FIX_MARK)


def _unmark(path: str) -> bool:
    """:func:`_remove` where the work is done whatever the mark (a release, a delete):
    a folder at ``path`` is logged (ERROR, ``lease_files_damaged``), not raised, and
    counts as no mark. The next claim of the session raises the error."""
    try:
        return _remove(path)
    except StoredDataError as exc:
        _log.error(
            "lease_files_damaged", session_id=_decode(os.path.basename(path)), detail=str(exc)
        )
        return False


def _read_record(fd: int, path: str, session_id: str) -> _Record | None:
    """The record of the lock file open at ``fd`` (``None``: the session was never claimed).

    Raises:
        StoredDataError: the record does not decode or names another session.
    """
    line = os.pread(fd, RECORD_LIMIT, 0).split(b"\n", 1)[0]
    if not line:
        return None
    try:
        record = _record_decoder.decode(line)
    except msgspec.DecodeError as exc:
        raise StoredDataError(
            f"{path}: the lease record of session {session_id!r} is damaged ({exc}); "
            "remove the file (when no process holds the session) to restart its epochs at 1"
        ) from None
    if record.session_id != session_id:
        raise StoredDataError(
            f"{path}: the lease record of session {session_id!r} names {record.session_id!r}"
        )
    return record


def _write_record(fd: int, path: str, record: _Record) -> None:
    """Overwrite the record at the start of the lock file with one ``pwrite``.

    What a longer record written before leaves after the newline is ignored.
    """
    data = _record_bytes(record)
    if os.pwrite(fd, data, 0) != len(data):
        raise OSError(f"{path}: the lease record was written short")


def _record_bytes(record: _Record) -> bytes:
    """The record as written: a JSON line of at most :data:`RECORD_LIMIT` bytes.

    Raises:
        ValueError: the owner string is too long for that.
    """
    data = msgspec.json.encode(record) + b"\n"
    if len(data) > RECORD_LIMIT:
        raise ValueError(
            f"the owner string is too long for a lease record ({len(data)} bytes encoded with "
            f"the session id, at most {RECORD_LIMIT}): {record.owner[:80]!r}..."
        )
    return data
