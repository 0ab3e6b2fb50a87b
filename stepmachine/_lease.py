"""Leases with fencing: at most one runner per session at a time, across processes.

Two ``run()`` calls on one session used to race: the second read the first's
in-flight tool intents as a crash and answered a call that was still running
"outcome unknown". A *lease* keeps them apart. A runner *claims* the session
before its first cycle and *releases* it (shielded) when the run returns; while
it holds the lease, a second ``run()`` follows the caller's :class:`LeasePolicy`:
wait, fail fast with :class:`~stepmachine.SessionBusyError`, or queue the turn
for the holder.

The store keeps the lease (the :class:`Leases` capability); the shipped stores
have it:

- :class:`~stepmachine.stores.PostgresStore`: columns of the session row
  (owner, epoch, expiry on the server's clock). A lease *expires* unless renewed
  (the machine renews every ``ttl / 3`` in the background), so a machine that
  died or was partitioned away loses it and another takes over.
- :class:`~stepmachine.stores.SQLiteStore`, :class:`~stepmachine.stores.FileStore`:
  the operating system's lock on a lock file (one machine, several processes). It
  is held exactly as long as the holding process lives: no clock, no expiry, and
  renewing is free.
- :class:`~stepmachine.stores.MemoryStore`: in this process, held until released
  (``MemoryStore(expiring_leases=True)``: with expiry, to test takeovers).

*Fencing.* Every claim gets a new ``epoch`` (a number that only grows). The
machine writes its batches through ``apply(batch, lease=lease)``: the store
accepts the batch only while ``lease`` is the current one, in the same atomic
step as the compare-and-set on the revision. A holder that was paused past its
lease's expiry and wakes after another runner claimed the session is refused
with :class:`~stepmachine.LeaseLostError`, whatever it had computed: it can
never write after the takeover.

Writes without a lease (``submit()``: user messages, approvals, events) are not
fenced, only compare-and-set: they are what the holder's next cycle reads.

*Queued turns.* :meth:`Leases.request_run` records that the session has work
(a pending-run mark on the session). A claim takes the mark (the claimer will
run); the holder's ``release(lease, unless_requested=True)`` refuses to release
while the mark is set, and takes it, so a turn requested while the session was
held is run by the holder before it lets go (the machine does this); a holder
that dies leaves the mark, and :meth:`Leases.claim_next` (a worker pool's loop)
finds the session once the lease is free or expired.

*Abandoned leases.* A lease that lapsed (or whose process died) without being
released belonged to a run that was cut short: its session has work too, and
``claim_next`` gives it out like a marked one. So a worker that dies mid-turn
is replaced by whichever worker claims next, and the turn finishes from the
stored session; a run that *returns* (normally or with an error) releases its
lease, and its session waits for the next request.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import msgspec

from ._codec import Batch
from ._effects import Effect
from ._errors import ConfigurationError
from ._session import Session

__all__ = [
    "MAX_OWNER",
    "MAX_TTL",
    "MIN_TTL",
    "Lease",
    "LeaseHolder",
    "LeasePolicy",
    "Leases",
    "check_claim",
    "mark_now",
    "new_owner",
    "now",
]

Busy = Literal["wait", "fail", "queue"]


class Lease(msgspec.Struct, frozen=True):
    """A runner's claim on a session; present it with every write (fencing).

    Attributes:
        session_id: the session leased.
        owner: who holds it (one string per run; see :func:`new_owner`).
        epoch: the claim's number; every claim of the session gets a greater one.
        ttl: seconds the lease lasts without a renewal (stores whose lease is an
            operating-system lock ignore it: theirs lasts as long as the process).
    """

    session_id: str
    owner: str
    epoch: int
    ttl: float


class LeaseHolder(msgspec.Struct, frozen=True):
    """Who holds a session, as a failed claim sees it.

    Attributes:
        owner: the holder's owner string.
        expires_in: seconds until the lease expires without a renewal, or
            ``None`` where leases do not expire (an operating-system lock).
        epoch: the epoch of the holder's lease, or ``None`` where the store
            does not say. With the owner it names the lease, so a runner whose
            own claim was cut short (the claim took effect, its answer never
            arrived) can tell the lease is its own and let go of it.
    """

    owner: str
    expires_in: float | None = None
    epoch: int | None = None


@runtime_checkable
class Leases(Protocol):
    """The lease capability of a store (the shipped stores have it).

    Every method raises :class:`~stepmachine.SessionNotFoundError` for a session
    that does not exist (``claim_next`` excepted) and
    :class:`~stepmachine.StoreClosedError` after ``aclose``. The
    behaviour each promises is checked by
    :class:`stepmachine.testing.leases.LeaseConformance`.

    No lease is kept for a runner that no longer knows of it:

    - a release that fails still lets go, within a bound: at once where
      leases do not expire (the store drops the lease on the holder's side
      before it raises), at most ``ttl`` after the last renewal where they do
      (see :meth:`release`);
    - a claim that took effect but whose answer never reached the caller (a
      cancel, ``KeyboardInterrupt``) is found by the caller, by its owner
      string and the ``epoch`` that a refused claim names
      (:class:`LeaseHolder`), and released (see :meth:`claim`).
    """

    leases_expire: bool
    """Whether a lease lapses when not renewed (``ttl``); False where a lease is held
    until released or the holding process ends (OS locks). A run renews only
    leases that lapse."""

    async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | LeaseHolder:
        """Claim the session for ``owner``: the new :class:`Lease`, or who holds it.

        Succeeds when nobody holds the session or the holder's lease expired;
        then the epoch grows and the session's pending-run mark is taken. A claim
        by the current holder's own ``owner`` string is *not* a renewal: it gets
        :class:`LeaseHolder` like any other (one owner string per run), with the
        holder's ``epoch``.

        A claim cut short. A cancel, a ``KeyboardInterrupt`` or an error can
        reach the caller after the claim took effect (a store that commits,
        then checkpoints; a wrapper around the store; asyncio's own
        ``task.cancel()``, which no anyio shield stops). The store need not
        guard against that: the *caller* does. ``run()`` (and a durable cycle)
        make the store call shielded from cancel scopes and, when anything but
        an ``Exception`` escapes it, ask again with the same owner string: a
        :class:`LeaseHolder` naming that owner (owner strings are one per run)
        and its ``epoch`` is the claim that took effect, and it is released
        (its pending-run mark set again: the turn it may have taken goes back
        to whoever claims next). So a store must give the holder's ``epoch``
        in :class:`LeaseHolder`; one that does not leaves such a lease to lapse
        at its ttl, or, if its leases do not expire, held until the process ends.
        A store whose call can outlive its caller (a worker thread that goes on
        after a native cancel) lets go itself of a lease it took for a caller
        that is gone (the lock-file stores do), or lets it lapse at its ttl
        (PostgreSQL's, whose leases expire). A claim that raises an
        ``Exception`` must have taken nothing, or, where leases expire, lets
        its lease lapse at its ttl (a commit whose answer was lost).
        """
        ...

    async def claim_next(self, owner: str, ttl: float) -> Lease | None:
        """Claim some session with work and no live lease, or ``None``.

        A session has work when its pending-run mark is set, or when its last
        lease was abandoned (lapsed, or its process died, without a release).

        Sessions are taken without waiting on each other (``SKIP LOCKED`` or
        the like); which one is unspecified, but a session is never given to two
        claimers at once.
        """
        ...

    async def request_run(self, session_id: str) -> None:
        """Mark the session as having work: its holder, or the next claimer, runs it."""
        ...

    async def renew(self, lease: Lease) -> Lease:
        """Extend ``lease`` by its ttl from now; the same lease (same epoch) back.

        Raises:
            LeaseLostError: ``lease`` is not the current lease (expired and
                claimed by another, or released).
        """
        ...

    async def release(self, lease: Lease, *, unless_requested: bool = False) -> bool:
        """Let go of ``lease``; ``True`` when released.

        With ``unless_requested``, a set pending-run mark is taken instead and
        the lease kept (``False``): the holder runs the requested turn, then
        releases again. Releasing a lease that is no longer current does nothing
        and returns ``True`` (it was lost already; nothing can be written with it).

        A release that fails (raises an ``Exception``) has let go all the
        same, within a bound: where
        leases expire (``leases_expire``), the lease lapses at most ``ttl``
        after its last renewal (its holder stopped renewing it); where they do
        not (held until released or the process ends), the store lets go of the
        lease on the holder's side before it raises (the lock-file stores close
        the lock whatever else failed; the memory store's release cannot fail
        but when it is closed, which released everything). So a live holder
        whose release failed never keeps its session busy for good.
        ``run()`` tries a release that failed with a transient error again
        (three attempts in all, a short backoff between) before it relies on that.
        """
        ...

    async def apply(self, batch: Batch[Effect], *, lease: Lease | None = None) -> Session[Any]:
        """``EffectHandler.apply``, fenced by ``lease`` when one is given.

        Raises:
            LeaseLostError: ``lease`` is not the session's current lease; nothing
                was written. Checked with the compare-and-set, atomically.
            ConflictError: the revision moved on (as without a lease).
        """
        ...


MAX_OWNER = 256
"""Characters an owner string may have at most."""

MIN_TTL = 0.1
"""Seconds a lease lasts at least: a shorter one would lapse before its first renewal."""

MAX_TTL = 7 * 24 * 3600.0
"""Seconds a lease lasts at most (a week): every store can represent its expiry."""


_NOW_FORMS: dict[Callable[..., Any], str] = {}
"""Async lease methods of store classes that have a synchronous form, by function."""


def mark_now(method: Callable[..., Any], name: str) -> None:
    """Say that ``method`` (a store class's async ``claim``, ``renew`` or ``release``)
    has a synchronous form, the method ``name`` of the same class, that does all it
    does but its checkpoint: an in-process store, whose lease calls never wait.

    A run then calls that form directly (see :func:`now`): no checkpoint and no
    shielded scope around a call that cannot be cut short anyway.
    """
    _NOW_FORMS[method] = name


def now(store: object, method: str) -> Callable[..., Any] | None:
    """The synchronous form of ``store.<method>`` (see :func:`mark_now`), or ``None``.

    Only when ``store.<method>`` is the very function that was marked: a subclass
    that overrides it, or a wrapper put on the instance, is called as it is.
    """
    if not _NOW_FORMS:
        return None
    function = getattr(getattr(store, method, None), "__func__", None)
    name = _NOW_FORMS.get(function) if function is not None else None
    return None if name is None else getattr(store, name, None)


def check_claim(owner: object, ttl: object) -> None:
    """Raise :class:`ValueError` unless ``owner`` and ``ttl`` are fit for a claim.

    ``owner``: a non-empty string of at most :data:`MAX_OWNER` printable
    characters (no control characters: owners are stored and shown);
    ``ttl``: seconds from :data:`MIN_TTL` to :data:`MAX_TTL`. Every store checks
    both before it touches anything (``renew`` checks the lease it is given).
    """
    if not isinstance(owner, str) or not owner or len(owner) > MAX_OWNER:
        shown = (
            repr(owner[:40]) + f"... ({len(owner)} characters)"
            if isinstance(owner, str) and len(owner) > 40
            else repr(owner)
        )
        raise ValueError(f"a lease owner is a string of 1..{MAX_OWNER} characters, got {shown}")
    if not owner.isprintable():
        raise ValueError(f"a lease owner has no control characters, got {owner!r}")
    if (
        isinstance(ttl, bool)
        or not isinstance(ttl, int | float)
        or not math.isfinite(ttl)
        or not MIN_TTL <= ttl <= MAX_TTL
    ):
        raise ValueError(
            f"a lease ttl is a number of seconds from {MIN_TTL} to {MAX_TTL:.0f}, got {ttl!r}"
        )


def new_owner(prefix: str = "") -> str:
    """A fresh owner string: host, process id and a random part (one per run)."""
    return f"{prefix}{_HOST}:{os.getpid()}:{os.urandom(6).hex()}"


_HOST = socket.gethostname() or "host"


@dataclass(frozen=True, slots=True)
class LeasePolicy:
    """How ``run()`` claims its session when the store has leases.

    Args:
        busy: what a ``run()`` does when another runner holds the session:
            ``"wait"`` until it is released (or expires), ``"fail"`` at once with
            :class:`~stepmachine.SessionBusyError`, or ``"queue"``: mark the
            session as having a pending turn and return at once with reason
            ``queued`` (the holder runs the turn before it releases; if the
            holder dies, the next claimer does).
        ttl: seconds a lease lasts without renewal; the machine renews every
            ``ttl / 3``. A runner that stops renewing (a dead or partitioned
            machine) loses the session after ``ttl``.
        wait_timeout: with ``busy="wait"``, seconds to wait at most before
            :class:`~stepmachine.SessionBusyError`; ``None`` waits as long as it
            takes (cancel the run to stop waiting).
        poll: the longest pause, in seconds, between two claims while waiting
            (the first pauses are shorter).

    Raises:
        ConfigurationError: ``busy`` is not one of the three, or a duration is not a
            finite number > 0.
    """

    busy: Busy = "wait"
    ttl: float = 30.0
    wait_timeout: float | None = None
    poll: float = 0.5

    WAIT: ClassVar[Busy] = "wait"
    FAIL: ClassVar[Busy] = "fail"
    QUEUE: ClassVar[Busy] = "queue"

    def __post_init__(self) -> None:
        if self.busy not in ("wait", "fail", "queue"):
            raise ConfigurationError(
                f"LeasePolicy.busy must be 'wait', 'fail' or 'queue', got {self.busy!r}"
            )
        for name in ("ttl", "poll"):
            _positive(name, getattr(self, name))
        if not MIN_TTL <= self.ttl <= MAX_TTL:
            raise ConfigurationError(
                f"LeasePolicy.ttl must be from {MIN_TTL} to {MAX_TTL:.0f} seconds, got {self.ttl!r}"
            )
        if self.wait_timeout is not None:
            _positive("wait_timeout", self.wait_timeout)


def _positive(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not value > 0
    ):
        raise ConfigurationError(
            f"LeasePolicy.{name} must be a number of seconds > 0, got {value!r}"
        )
