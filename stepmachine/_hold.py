"""A run's side of a lease: claim by policy, renew in the background, fence, release.

:func:`claim` gets the lease the way the caller's :class:`LeasePolicy` says
(wait, fail fast, or queue the turn). :func:`hold` runs work while holding it:
a background task renews it every ``ttl / 3`` and every write of the work goes
through a :class:`Fence` (``apply(batch, lease=lease)``). :func:`release` lets
go, shielded and bounded. The machine (``StateMachine.run_report``) strings
them together; see ``stepmachine._lease`` for what a lease promises.
:func:`confirm_lease` is the check right before a guarded task (a
non-idempotent tool) starts.

A lost lease stops the work. Either a write is refused (the store raises
:class:`LeaseLostError` from ``apply``; the fence remembers it and refuses
every later write at once, so a finalize after the loss writes nothing), or
the renewal finds the lease gone, or cannot reach the store before the lease
would lapse: then the work is cancelled, and :func:`hold` raises
:class:`LeaseLostError` once the work has unwound.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from types import EllipsisType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

import anyio

from . import _log, _transient
from ._async import interrupt_once
from ._codec import Batch
from ._effects import Effect
from ._errors import ConfigurationError, LeaseLostError, SessionBusyError, StoreClosedError
from ._lease import Lease, LeaseHolder, LeasePolicy, Leases, check_claim, new_owner, now
from ._retry import wait_out
from ._runtime import Runtime, with_handler
from ._session import Session
from ._staged import lease_lost

if TYPE_CHECKING:
    from ._outcomes import Task

__all__ = [
    "QUEUED",
    "Fence",
    "Turns",
    "check_fenceable",
    "claim",
    "claim_for_run",
    "claim_once",
    "confirm_lease",
    "has_leases",
    "hold",
    "leasing_store",
    "release",
    "renew_interval",
    "request_again",
]

T = TypeVar("T")


FIRST_POLL = 0.01
"""Seconds before the second claim while waiting; each pause doubles, up to ``poll``."""

RELEASE_TIMEOUT = 10.0
"""Seconds a release may take (shielded, its attempts together) before it is abandoned."""

RELEASE_ATTEMPTS = 3
"""How many times a release that failed with a transient error is tried in all."""


class Fence:
    """An effect handler that writes with a lease: ``store.apply(batch, lease=lease)``.

    Once one write was refused for a lost lease, every later one is refused at
    once with the same error, without asking the store.
    """

    applies_batches: ClassVar[bool] = True
    """The store applies each batch once and returns the session (see ``EffectHandler``)."""

    def __init__(self, store: Leases, lease: Lease) -> None:
        self.store = store
        self.lease = lease
        self.lost: LeaseLostError | None = None

    async def apply(self, batch: Batch[Effect]) -> Session[Any]:
        """Write ``batch`` with the lease; :class:`LeaseLostError` once it is lost."""
        if self.lost is not None:
            raise LeaseLostError(
                self.lease.session_id, self.lease.owner, self.lease.epoch, "lost earlier"
            )
        try:
            return await self.store.apply(batch, lease=self.lease)
        except LeaseLostError as exc:
            self.lost = exc
            raise


QUEUED: Any = object()
"""What :func:`claim_for_run` returns when the turn was queued for the holder."""


async def claim_for_run(
    runtime: Runtime,
    session_id: str,
    chosen: LeasePolicy | Lease | EllipsisType | None,
    default: LeasePolicy | None,
) -> tuple[Leases, Lease] | None:
    """The store and lease a run holds; ``None`` to run without one; :data:`QUEUED` when
    the turn was queued for the holder.

    ``chosen`` is the run's ``lease`` argument (``...``: the machine's policy,
    ``default``). A run holds a lease when the runtime's store has leases and
    the runtime names no separate effect handler (see :func:`leasing_store`).

    Raises:
        SessionBusyError: the session is held and the policy says ``fail``, or
            ``wait`` past its ``wait_timeout``.
        ConfigurationError: ``chosen`` is not a ``LeasePolicy``, a ``Lease`` of
            this session or ``None``, or a ``Lease`` for a store without leases.
    """
    chosen = default if chosen is ... else chosen
    if chosen is None:
        return None
    leases = leasing_store(runtime)
    if isinstance(chosen, Lease):
        if leases is None:
            raise ConfigurationError(
                f"run() got a Lease ({chosen.owner!r}, epoch {chosen.epoch}), but the "
                "runtime's store has no leases (or the runtime names its own effect "
                "handler), so nothing could fence its writes; pass lease=None or a "
                "LeasePolicy, or run on the store that gave out the lease"
            )
        if chosen.session_id != session_id:
            raise ConfigurationError(
                f"run() got a lease of session {chosen.session_id!r} to run "
                f"{session_id!r}; pass the lease claimed for {session_id!r}, or run "
                f"{chosen.session_id!r}"
            )
        try:
            check_claim(chosen.owner, chosen.ttl)
        except ValueError as exc:
            raise ConfigurationError(f"run() got an unusable lease: {exc}") from None
        return leases, chosen
    if not isinstance(chosen, LeasePolicy):
        raise ConfigurationError(f"lease must be a LeasePolicy, a Lease or None, got {chosen!r}")
    if leases is None:
        return None
    claimed = await claim(leases, session_id, new_owner(), chosen)
    return QUEUED if claimed is None else (leases, claimed)


class Turns:
    """A run's lease across its rounds: held, renewed and fenced around them, then let go.

    A round is the run's cycles until one yields. After each, :meth:`another`
    releases the lease unless a turn was requested meanwhile (a ``run()`` that
    queued, ``store.request_run``); then the run owes that turn and runs
    another round. A requested turn is never dropped: once a release took the
    pending-run mark, the mark is set again before the lease is let go if the
    owed round does not complete (cancelled, failed), or when ``max_rounds``
    rounds were run (``serve`` runs one round per claim, so a session
    requested again and again does not keep its worker).

    ``keep``: a run that raised an ``Exception`` for which ``keep(exc)`` is
    true is not released: the error propagates with the lease still held (its
    mark set again first if a round was owed), and the caller owns it (``serve``
    keeps a turn it retries that way, so that it is never both unmarked and
    unheld). Cancellation always releases.
    """

    def __init__(
        self,
        store: Leases,
        lease: Lease,
        *,
        max_rounds: int | None = None,
        keep: Callable[[Exception], bool] | None = None,
    ) -> None:
        self.store, self.lease, self.max_rounds, self.keep = store, lease, max_rounds, keep
        self.owed = False  # a release took the mark: the next round is a requested turn
        self.released = False
        self.rounds = 0

    @asynccontextmanager
    async def held(self, runtime: Runtime) -> AsyncIterator[Runtime]:
        """``runtime`` writing through the lease's fence, renewed while the body runs;
        released (or kept, see the class docs) when it ends."""
        store, lease = self.store, self.lease
        try:
            async with holding(store, lease, renew_every=renew_interval(lease)) as fence:
                yield with_handler(runtime, fence)
                if self.owed:
                    await request_again(store, lease)
                if not self.released:
                    await release(store, lease, unless_requested=False)
        except BaseException as exc:
            if self.owed:
                await request_again(store, lease)
            if self.keep is None or not isinstance(exc, Exception) or not self.keep(exc):
                await release(store, lease, unless_requested=False)
            raise

    async def another(self, cancelled: bool) -> bool:
        """After a round (``cancelled``: it ended cancelled): whether the run owes another."""
        self.rounds += 1
        if cancelled:
            return False  # a requested turn is left to whoever claims next
        self.owed = False
        if await release(self.store, self.lease, unless_requested=True):
            self.released = True
            return False
        self.owed = True  # a turn was requested meanwhile: ours to run
        return self.max_rounds is None or self.rounds < self.max_rounds


async def claim(store: Leases, session_id: str, owner: str, policy: LeasePolicy) -> Lease | None:
    """The session's lease for ``owner`` under ``policy``; ``None`` when the turn was queued.

    - ``wait``: claim again after pauses growing from :data:`FIRST_POLL` to
      ``policy.poll`` until the claim succeeds (or ``wait_timeout`` passes:
      :class:`SessionBusyError`);
    - ``fail``: :class:`SessionBusyError` at once;
    - ``queue``: set the session's pending-run mark, then claim once more (the
      holder may have let go meanwhile); ``None`` if it is still held. The
      holder runs the turn before it releases, or, if it dies, whoever claims next.

    A claim that took effect is never lost between the store and the caller:
    each store call is shielded from cancel scopes (a cancel lands after it
    returned, where the caller's ``try`` releases the lease), and when anything
    but an ``Exception`` escapes it all the same (``KeyboardInterrupt``,
    asyncio's own ``task.cancel()``), the lease it may have taken is found by
    ``owner`` and released before that propagates (see :func:`claim_once`).
    The caller must only enter its ``try`` without a checkpoint in between.

    Raises:
        SessionNotFoundError: no such session.
        SessionBusyError: see above.
    """
    pause = FIRST_POLL
    deadline = None if policy.wait_timeout is None else anyio.current_time() + policy.wait_timeout
    while True:
        got = await claim_once(store, session_id, owner, policy.ttl)
        if isinstance(got, Lease):
            return got
        holder: LeaseHolder = got
        if policy.busy == "fail":
            raise SessionBusyError(session_id, holder.owner, holder.expires_in)
        if policy.busy == "queue":
            await store.request_run(session_id)
            again = await claim_once(store, session_id, owner, policy.ttl)
            return again if isinstance(again, Lease) else None
        now = anyio.current_time()
        if deadline is not None and now >= deadline:
            raise SessionBusyError(session_id, holder.owner, holder.expires_in)
        wake = now + pause if deadline is None else min(now + pause, deadline)
        await anyio.sleep_until(wake)
        pause = min(pause * 2, policy.poll)


async def claim_once(store: Leases, session_id: str, owner: str, ttl: float) -> Lease | LeaseHolder:
    """``store.claim(session_id, owner, ttl)``, guarded so that no lease it took is lost.

    The call is shielded from cancel scopes. When a ``BaseException`` that is
    not an ``Exception`` escapes it (``KeyboardInterrupt``, ``SystemExit``,
    asyncio's native cancellation, which no shield stops), the claim may have
    taken effect without its answer arriving: the session is claimed again
    with the same ``owner`` (shielded, bounded). A :class:`Lease` (it was free)
    or a :class:`LeaseHolder` naming ``owner`` with its epoch (the claim that
    took effect: one owner string per run) is released, its pending-run mark
    set again first (a claim cut short hands back the turn it may have taken;
    at worst the session is marked as having work it had not); then the
    exception propagates. An ``Exception`` from the claim propagates as it is
    (a store raises before its claim took effect, or its lease lapses).
    """
    sync = now(store, "claim")
    got: Lease | LeaseHolder
    try:
        if sync is not None:  # an in-process store: nothing can cut the claim short
            got = sync(session_id, owner, ttl)
        else:
            with anyio.CancelScope(shield=True):
                got = await store.claim(session_id, owner, ttl)
    except Exception:
        raise
    except BaseException:
        await _undo_claim(store, session_id, owner, ttl)
        raise
    return got


async def _undo_claim(store: Leases, session_id: str, owner: str, ttl: float) -> None:
    """Release the lease ``owner`` may hold on ``session_id`` (see :func:`claim_once`)."""

    async def undo() -> None:
        got = await store.claim(session_id, owner, ttl)
        if isinstance(got, Lease):
            lease = got
        elif got.owner == owner and got.epoch is not None:
            lease = Lease(session_id, owner, got.epoch, ttl)
        else:
            return  # another runner holds it (or the store does not say): nothing of ours
        try:
            await store.request_run(session_id)
        finally:
            await store.release(lease, unless_requested=False)

    await _quietly("lease_claim_undo_failed", session_id, undo)


@asynccontextmanager
async def holding(store: Leases, lease: Lease, *, renew_every: float) -> AsyncIterator[Fence]:
    """Hold ``lease`` around the body: its :class:`Fence`, renewed every ``renew_every`` s.

    Does not release the lease (see :func:`release`). A store whose leases do
    not expire (``leases_expire`` False: held until released or the process
    ends) has nothing to renew: the body runs without a renewal task.

    Raises:
        LeaseLostError: the renewal found the lease gone (the body was
            cancelled), or the body's write was refused.
        Exception: whatever the body raises (a ``KeyboardInterrupt`` as
            itself, never inside a group).
    """
    fence = Fence(store, lease)
    if not store.leases_expire:  # held until released or the process ends: nothing to renew
        yield fence
        return
    finished = False
    failure: BaseException | None = None
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_renew, fence, renew_every, tg.cancel_scope)
            try:
                yield fence
                finished = True
            except anyio.get_cancelled_exc_class():
                raise
            except BaseException as exc:  # noqa: BLE001 - re-raised below, outside the group
                failure = exc  # (a KeyboardInterrupt too): raised as itself, not in a group
            finally:
                tg.cancel_scope.cancel()  # stops the renewal
    except BaseExceptionGroup as group:  # Ctrl-C landed in the renewal task (trio)
        interrupt = _interrupt_in(group)
        if interrupt is None:
            raise
        once = interrupt_once(interrupt)  # on asyncio it left the loop already: see there
        raise once from (None if once is interrupt else interrupt)
    if failure is not None:
        raise failure
    if not finished:  # the renewal cancelled the body
        assert fence.lost is not None
        raise fence.lost


async def hold(
    store: Leases, lease: Lease, work: Callable[[Fence], Awaitable[T]], *, renew_every: float
) -> T:
    """``await work(fence)`` while holding ``lease`` (see :func:`holding`)."""
    async with holding(store, lease, renew_every=renew_every) as fence:
        return await work(fence)
    raise AssertionError("unreachable: holding re-raises what stopped the body")  # pragma: no cover


def _interrupt_in(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The first ``KeyboardInterrupt`` / ``SystemExit`` of ``group`` when it holds only
    those (and cancellations), else ``None``."""
    interrupts: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            inner = _interrupt_in(exc)
            if inner is None:
                return None
            interrupts.append(inner)
        elif isinstance(exc, KeyboardInterrupt | SystemExit):
            interrupts.append(exc)
        elif not isinstance(exc, anyio.get_cancelled_exc_class()):
            return None
    return interrupts[0] if interrupts else None


async def _renew(fence: Fence, every: float, work: anyio.CancelScope) -> None:
    """Renew until cancelled; on a loss, record it on the fence and cancel ``work``.

    A renewal that fails for another reason (the database unreachable) is tried
    again until the lease would lapse (``ttl`` after the last success, on this
    process's clock, which a lease on the store's clock never outlives).
    """
    lease = fence.lease
    lapses = anyio.current_time() + lease.ttl
    while True:
        await anyio.sleep(every)
        try:
            await fence.store.renew(lease)
            lapses = anyio.current_time() + lease.ttl
        except LeaseLostError as exc:
            fence.lost = exc
        except StoreClosedError as exc:
            fence.lost = LeaseLostError(lease.session_id, lease.owner, lease.epoch, str(exc))
        except Exception as exc:  # noqa: BLE001 - retried until the lease would lapse
            _log.event(
                _log.WARNING,
                "lease_renewal_failed",
                session_id=lease.session_id,
                error_type=type(exc).__name__,
                detail=str(exc),
            )
            if anyio.current_time() + every >= lapses:
                fence.lost = LeaseLostError(
                    lease.session_id, lease.owner, lease.epoch, f"could not renew: {exc}"
                )
        if fence.lost is not None:
            work.cancel()
            return


async def release(store: Leases, lease: Lease, *, unless_requested: bool) -> bool:
    """``store.release(...)``, shielded and bounded; ``True`` when let go.

    A release that fails with a transient error (``_transient.is_transient``:
    an ``OSError``, a lost connection) is tried again after a short backoff
    (0.1-0.2 s, then 0.2-0.4 s), :data:`RELEASE_ATTEMPTS` attempts in all,
    within :data:`RELEASE_TIMEOUT` seconds together. Each failure is logged
    (``lease_release_failed``), none is raised: what the run wrote is stored
    either way. A release that still failed counts as released, which the
    :class:`~stepmachine.Leases` protocol makes true within a bound: a lease
    that expires lapses at most its ``ttl`` after its last renewal (nobody
    renews it any more), and a store whose leases do not expire lets go of
    the lease on the holder's side before its release raises (the lock-file
    stores close the lock whatever else failed). So a live process never keeps
    a session busy for good because one release failed. (A pending-run mark
    such a release did not take stays set: the next claimer runs that turn.)

    ``unless_requested=True`` tried again after a failure sets the pending-run
    mark first (the failed attempt may have taken it, its reply lost): a turn
    requested meanwhile is never dropped by a retry; at worst the holder runs
    one round that finds nothing to do.
    """
    sync = now(store, "release")
    if sync is not None:  # an in-process store: done at once (a failure goes the usual way)
        try:
            return sync(lease, unless_requested=unless_requested)  # type: ignore[no-any-return]
        except Exception:  # noqa: BLE001, S110 - tried again, and logged, just below
            pass
    tried = [sync is not None]  # an attempt failed: it may have taken effect, unseen

    async def attempt() -> bool:
        if unless_requested and tried[0]:
            # A failed release(unless_requested=True) may have taken the pending-run
            # mark (keeping the lease) before its reply was lost; a retry would not see
            # the mark and would let go, dropping that turn. So the mark is set again
            # first: a retry then takes it and the holder runs the turn (at worst one
            # idle round, when the failed attempt had done nothing or had let go).
            await store.request_run(lease.session_id)
        tried[0] = True
        return await store.release(lease, unless_requested=unless_requested)

    released = await _quietly(
        "lease_release_failed", lease.session_id, attempt, attempts=RELEASE_ATTEMPTS
    )
    return True if released is None else released


async def request_again(store: Leases, lease: Lease) -> None:
    """Set the session's pending-run mark again, shielded and bounded (a turn a holder
    took and did not finish goes back to whoever claims next). Errors are logged."""
    await _quietly(
        "lease_request_again_failed",
        lease.session_id,
        lambda: store.request_run(lease.session_id),
        attempts=RELEASE_ATTEMPTS,
    )


async def _quietly(
    failure: str, session_id: str, work: Callable[[], Awaitable[T]], *, attempts: int = 1
) -> T | None:
    """``await work()`` shielded, for at most :data:`RELEASE_TIMEOUT` seconds, tried up to
    ``attempts`` times while it fails with a transient error (:func:`_transient.backoff`
    between); ``None`` when it timed out or failed (each failure logged as ``failure``:
    the run's own outcome must propagate)."""
    with anyio.move_on_after(RELEASE_TIMEOUT, shield=True):
        for attempt in range(1, attempts + 1):
            try:
                return await work()
            except Exception as exc:  # noqa: BLE001 - see the docstring
                again = attempt < attempts and _transient.is_transient(exc)
                _log.event(
                    _log.WARNING,
                    failure,
                    session_id=session_id,
                    error_type=type(exc).__name__,
                    detail=str(exc),
                    attempt=attempt,
                    will_retry=again,
                )
                if not again:
                    break
            await anyio.sleep(_transient.backoff(attempt))
    return None


async def confirm_lease(runtime: Runtime, task: Task) -> None:
    """Raise :class:`LeaseLostError` unless the run still holds its lease, right before
    ``task`` starts (at most once where it matters).

    A run holding a lease writes through a :class:`Fence`. Before a
    ``guarded`` task starts (a ``non_idempotent`` tool), the lease is
    confirmed with the store by ``renew`` (the store's fence read, plus an
    extension, harmless for its holder): one round trip on PostgreSQL, an
    in-process check on the lock-file and memory stores. Any other task is
    checked against what the run already knows (a write refused, a renewal that
    found the lease gone), at no cost. A run without a lease checks nothing.

    A store fault of the confirmation (a lost connection, a server restarting:
    see :func:`~stepmachine._retry.store_fault`) is waited out, after a backoff,
    up to :data:`~stepmachine._retry.MAX_STORE_FAULTS` in all, and the lease
    asked again (a renewal asked twice is harmless for its holder): the task's
    intents are stored already, and a task never started would otherwise be
    answered ``outcome unknown`` by the next run.

    Raises:
        LeaseLostError: the lease is gone; nothing was started.
        Exception: the store could not be asked (a store fault past
            ``MAX_STORE_FAULTS``, or any other error): the task is not started either.
    """
    fence = runtime.handler
    if not isinstance(fence, Fence):
        return
    if fence.lost is None and task.guarded:
        sync = now(fence.store, "renew")
        faults = 0
        while True:
            try:
                if sync is not None:  # an in-process store: the same check, without a checkpoint
                    sync(fence.lease)
                else:
                    await fence.store.renew(fence.lease)
                break
            except LeaseLostError as exc:
                fence.lost = exc  # every later write of the run is refused at once too
                break
            except Exception as exc:  # noqa: BLE001 - re-raised by wait_out unless a store fault
                faults = await wait_out(exc, faults)
    if fence.lost is not None:
        raise lease_lost(task, fence.lost) from fence.lost


def leasing_store(runtime: Runtime) -> Leases | None:
    """The store a run on ``runtime`` holds leases in, or ``None`` when it runs unleased.

    That is ``runtime.store`` when it is also the effect handler (no separate
    ``handler``) and its class declares leases (:func:`has_leases`).

    Raises:
        ConfigurationError: the store declares leases but its ``apply`` takes no
            ``lease=`` (see :func:`check_fenceable`).
    """
    store = runtime.store if runtime.handler is None else None
    if not has_leases(store):
        return None
    check_fenceable(store)
    return cast(Leases, store)  # has_leases said so (the protocol's isinstance is slow)


def has_leases(store: object) -> bool:
    """Whether ``store`` has the :class:`Leases` capability, in O(1).

    A store with leases declares ``leases_expire`` (a bool) on its class; the
    protocol's ``isinstance`` check would inspect every method, at each run.
    Read from the class, like ``applies_batches``, so that a wrapper forwarding
    attributes to a store (``__getattr__``) is not taken for one with leases:
    its ``apply`` would not take the lease.
    """
    return isinstance(getattr(type(store), "leases_expire", None), bool)


_FENCEABLE: dict[type, bool] = {}


def check_fenceable(store: object) -> None:
    """Raise :class:`ConfigurationError` unless ``store.apply`` takes ``lease=`` (cached per class).

    A subclass of a store with leases whose ``apply`` override predates them
    (``apply(self, batch)``) would fail at its first write with a ``TypeError``;
    this says what to change instead, before the run claims anything.
    """
    cls = type(store)
    known = _FENCEABLE.get(cls)
    if known is None:
        try:
            parameters = inspect.signature(cls.apply).parameters  # type: ignore[attr-defined]
        except (AttributeError, TypeError, ValueError):
            known = False
        else:
            known = "lease" in parameters or any(
                p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
            )
        _FENCEABLE[cls] = known
    if not known:
        raise ConfigurationError(
            f"{cls.__name__} declares leases (leases_expire) but its apply() takes no lease=: "
            "give it a keyword-only `lease=None` passed on to the store it extends, or run "
            "with lease=None"
        )


def renew_interval(lease: Lease) -> float:
    """How often to renew ``lease``: a third of its ttl (never zero or infinite)."""
    third = lease.ttl / 3
    return third if math.isfinite(third) and third > 0 else 1.0
