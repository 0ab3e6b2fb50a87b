"""``run_worker()``: a worker's loop over the sessions that have work.

Many workers (tasks, processes, machines) call ``run_worker`` on one store. Each
round claims some session with a pending run (``store.claim_next``: set by
``store.request_run``, by a ``run()`` that queued its turn, or left by a
holder that died) and runs it holding that lease; the run renews the lease,
runs again while more turns are requested, and releases it. A session is
served by one worker at a time; a dead worker's session is picked up by
another once its lease is free (PostgreSQL: after its ``ttl``; the lock-file
stores: at once, the process being gone).

Nothing stuck, nothing dropped: the claim took the session's pending-run
mark, so a run that raised and let go of its lease would leave its turn to
nobody. Instead a run that raised a transient error (the store unreachable
or restarted, a lost lease) keeps its lease through a backoff and is run
again, and one that failed for good is logged at ERROR. See :func:`run_worker`.

The log events keep their ``serve_`` prefix (``serve_run_retried``, ...):
log queries written for the earlier name of this function keep working.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec

from . import _log, _transient
from ._cycle import Driver
from ._decision import RunReport
from ._errors import ConfigurationError, LeaseLostError
from ._hold import leasing_store, release, request_again
from ._lease import MIN_TTL, Lease, Leases, check_claim, new_owner
from ._machine import StateMachine
from ._runtime import Runtime
from ._steps import CancelToken

__all__ = ["run_worker"]


async def run_worker(
    machine: StateMachine[Any],
    runtime: Runtime,
    *,
    stop: CancelToken | None = None,
    ttl: float = 30.0,
    poll: float = 0.2,
    owner_prefix: str = "",
    on_report: Callable[[RunReport[Any]], Awaitable[None] | None] | None = None,
) -> None:
    """Run the sessions of ``runtime.store`` that have pending runs, until ``stop`` fires.

    Args:
        machine: the machine to run each session with.
        runtime: its store must have leases (:class:`~stepmachine.Leases`).
        stop: a token; once it fires, ``run_worker`` returns after the run in
            progress (to interrupt that run too, cancel the task calling
            ``run_worker``: the run finalizes as any cancelled run). ``None``:
            run until cancelled.
        ttl: the lease's ttl for each claimed session (see :class:`LeasePolicy`).
        poll: seconds to sleep when no session has work.
        owner_prefix: put in front of each run's owner string (a worker's name).
        on_report: called with each run's :class:`RunReport` (may be async).

    A run that raises does not stop the worker, and its turn is not dropped.
    The rule that keeps it: *at every instant a claimed turn is either marked
    pending or its lease is held (or lapsing unreleased, which ``claim_next``
    gives out as abandoned work)*, so a worker killed at any instant leaves
    the turn to the next claimer. The claim took the mark; so a run that is to
    be retried does not release its lease: it keeps it from its failure
    through the backoff to its next run.

    - a *transient* error (the store unreachable, a restarted PostgreSQL
      server's ``OperationalError``/``AdminShutdown``, an ``OSError`` of a
      file or SQLite read, a lost lease, conflicts past ``max_conflicts``;
      one classification, shared with durable turns): the turn is run again
      after a backoff (0.1-0.2 s, doubling, at most 5 s, jittered). The
      worker keeps the failed run's lease for that long: a lease that lapses
      (PostgreSQL, memory with expiring leases) is renewed to lapse when the
      backoff is over, unreleased (then any worker's ``claim_next`` takes it
      as abandoned work); a lease held until released (the lock-file stores)
      is held, and this worker runs the turn with it when the backoff is
      over (a dead worker's lock goes with its process, and ``claim_next``
      gives the session out). A lease found no longer current (taken over)
      gets the session's pending-run mark set, for its holder. No worker runs
      the turn before its backoff is over; the pause never holds up the
      worker's other sessions. Logged at WARNING (``serve_run_retried``:
      error_type, attempt, delay_s, detail).
    - any other error (a step's or tool's bug, damaged stored data, a model
      error after its own retries), or a transient one for the eighth time
      in a row: the run failed for good and released its lease; the turn is
      not run again until something requests a run. Logged at ERROR
      (``serve_run_failed``: session_id, error_type, attempts, retried False,
      detail: the error's text cut at 1,000 characters, raised_at: its
      innermost frames as ``file:line in function``, never their local
      variables): the record a user of ``run_worker`` finds in the log; the session
      keeps what the run stored (its finalize answered open calls
      "interrupted"). A provider's error carries no key (it is redacted where
      it is raised); its message, the server's text, which may quote the
      prompt, is in ``detail`` only with content capture on (else its
      provider, status, kind and request id).

    A transient error of the store while claiming (``claim_next``) is logged
    (``serve_claim_failed``, WARNING) and the claim tried again after a
    backoff; other store errors propagate.

    Raises:
        ConfigurationError: the runtime's store has no leases, or the runtime
            names its own effect handler (writes could not be fenced); ``poll``
            is not a number > 0, or ``ttl`` or ``owner_prefix`` is unfit for a
            claim (see :data:`~stepmachine.LeasePolicy`).
    """
    if (
        isinstance(poll, bool)
        or not isinstance(poll, int | float)
        or not math.isfinite(poll)
        or not poll > 0
    ):
        raise ConfigurationError(f"run_worker() needs a poll of seconds > 0, got {poll!r}")
    try:
        check_claim(new_owner(owner_prefix), ttl)
    except ValueError as exc:
        raise ConfigurationError(f"run_worker(): {exc}") from None
    store = leasing_store(runtime)
    if store is None:
        raise ConfigurationError(
            "run_worker() needs a runtime whose store has leases (the shipped stores do) "
            "and no separate effect handler"
        )
    worker = _Worker(store, owner_prefix, ttl)
    try:
        await _loop(machine, runtime, store, worker, stop, poll, on_report)
    finally:
        await worker.give_back()


async def _loop(
    machine: StateMachine[Any],
    runtime: Runtime,
    store: Leases,
    worker: _Worker,
    stop: CancelToken | None,
    poll: float,
    on_report: Callable[[RunReport[Any]], Awaitable[None] | None] | None,
) -> None:
    """The rounds of :func:`run_worker`."""
    while stop is None or not stop.cancelled:
        lease = await worker.next_lease()
        if lease is None:
            with anyio.move_on_after(worker.idle_for(poll)):
                if stop is None:
                    await anyio.sleep(poll)
                else:
                    await stop.wait()
            continue
        session_id = lease.session_id
        try:  # one round per claim: a session requested again goes back in the queue
            report = await Driver(machine, runtime).run(
                session_id,
                None,
                lease,
                max_rounds=1,
                keep=lambda exc: worker.will_retry(session_id, exc),  # noqa: B023 - called here
            )
        except Exception as exc:  # noqa: BLE001 - one session's failure does not stop the worker
            await worker.failed(lease, exc, runtime)
            continue
        worker.served(lease.session_id)
        if on_report is not None:
            done = on_report(report)
            if done is not None:
                await done


class _Worker:
    """What one ``run_worker()`` call keeps between rounds: retries owed, and their pauses.

    ``failures``: transient failures in a row per session (this worker's);
    ``parked``: leases of stores whose leases do not lapse, kept from a failed
    run until its backoff is over; ``owed``: sessions whose lease was found
    taken over and whose pending-run mark could not be set (the store was
    unreachable), tried again every round.
    """

    def __init__(self, store: Leases, owner_prefix: str, ttl: float) -> None:
        self.store = store
        self.owner_prefix = owner_prefix
        self.ttl = ttl
        self.failures: dict[str, int] = {}
        self.parked: dict[str, tuple[float, Lease]] = {}
        self.owed: set[str] = set()
        self.claim_failures = 0

    async def next_lease(self) -> Lease | None:
        """A parked lease whose pause is over, else ``claim_next``; ``None``: nothing now."""
        now = anyio.current_time()
        for session_id, (due, lease) in self.parked.items():
            if due <= now:
                del self.parked[session_id]
                return lease
        try:
            await self._settle_owed()
            claimed = await self.store.claim_next(new_owner(self.owner_prefix), self.ttl)
        except Exception as exc:
            if not _transient.is_transient(exc):
                raise
            self.claim_failures += 1
            delay = _transient.backoff(self.claim_failures)
            _log.event(
                _log.WARNING,
                "serve_claim_failed",
                error_type=type(exc).__name__,
                attempt=self.claim_failures,
                delay_s=round(delay, 3),
                detail=_transient.describe(exc, content=True),
            )
            await anyio.sleep(delay)
            return None
        self.claim_failures = 0
        return claimed

    def idle_for(self, poll: float) -> float:
        """Seconds to sleep with nothing to claim: ``poll``, or less if a parked lease is due."""
        if not self.parked:
            return poll
        soonest = min(due for due, _ in self.parked.values())
        return max(0.0, min(poll, soonest - anyio.current_time()))

    def served(self, session_id: str) -> None:
        """A run of ``session_id`` returned: its count of failures starts over."""
        self.failures.pop(session_id, None)

    def will_retry(self, session_id: str, exc: Exception) -> bool:
        """Whether a run of ``session_id`` that raised ``exc`` is run again (after a backoff).

        Asked before the failed run lets go of its lease: a turn to run again
        keeps it (see :meth:`failed`)."""
        attempt = self.failures.get(session_id, 0) + 1
        return _transient.is_transient(exc) and attempt < _transient.MAX_ATTEMPTS

    async def failed(self, lease: Lease, exc: Exception, runtime: Runtime) -> None:
        """A run under ``lease`` raised ``exc``: retry later, or log it as failed.

        A run to retry (:meth:`will_retry`) kept its lease, and this worker
        holds it through the backoff (:meth:`_pend`): the turn is never both
        unmarked and unheld. A run that failed for good released it.
        """
        session_id = lease.session_id
        attempt = self.failures.get(session_id, 0) + 1
        if not self.will_retry(session_id, exc):
            self.failures.pop(session_id, None)
            _log.event(
                _log.ERROR,
                "serve_run_failed",
                session_id=session_id,
                error_type=type(exc).__name__,
                attempts=attempt,
                retried=False,
                detail=_transient.describe(exc, content=runtime.telemetry.captures_content),
                raised_at=_transient.raised_at(exc),
            )
            return
        self.failures[session_id] = attempt
        delay = _transient.backoff(attempt)
        if not self.store.leases_expire:  # parked before any await: a cancelled worker releases it
            self.parked[session_id] = (anyio.current_time() + delay, lease)
        _log.event(
            _log.WARNING,
            "serve_run_retried",
            session_id=session_id,
            error_type=type(exc).__name__,
            attempt=attempt,
            delay_s=round(delay, 3),
            detail=_transient.describe(exc, content=runtime.telemetry.captures_content),
        )
        try:
            await self._pend(lease, delay)
        except Exception as again:  # noqa: BLE001 - the store is down: the lease lapses, or is
            _log.event(  # parked, or the mark is owed (set every round): the turn is kept
                _log.WARNING,
                "serve_run_retry_deferred",
                session_id=session_id,
                error_type=type(again).__name__,
                detail=_transient.describe(again, content=True),
            )

    async def _pend(self, lease: Lease, delay: float) -> None:
        """Keep the failed run's ``lease`` so that its turn runs again in about ``delay`` s.

        - a lease that lapses (PostgreSQL, memory with expiring leases): renewed
          to lapse in ``delay`` seconds, unreleased; then any worker's
          ``claim_next`` takes it as abandoned work (if the renewal fails, it
          lapses at its own expiry, the same way);
        - a lease held until released (the lock-file stores): parked by
          :meth:`failed` (this worker runs it when the pause is over; a dead
          worker's lock goes with its process, its *held* file left for the
          next ``claim_next``); checked to be still this store's;
        - a lease that is no longer current (:class:`LeaseLostError`: another
          runner took the session, or it lapsed): the session's pending-run mark
          is set, so its holder or the next claimer runs the turn.
        """
        store = self.store
        try:
            if store.leases_expire:
                await store.renew(msgspec.structs.replace(lease, ttl=max(MIN_TTL, delay)))
            else:
                await store.renew(lease)  # only checks that this store still holds it
        except LeaseLostError:
            self.parked.pop(lease.session_id, None)
            self.owed.add(lease.session_id)  # until the mark is set (every round if this fails)
            await store.request_run(lease.session_id)
            self.owed.discard(lease.session_id)

    async def give_back(self) -> None:
        """``run_worker`` returns: set the mark of each parked session and release it (shielded)."""
        for session_id, (_, lease) in list(self.parked.items()):
            del self.parked[session_id]
            await request_again(self.store, lease)
            await release(self.store, lease, unless_requested=False)

    async def _settle_owed(self) -> None:
        """Set the pending-run mark of every owed session (raises while the store is down)."""
        for session_id in sorted(self.owed):
            await self.store.request_run(session_id)
            self.owed.discard(session_id)
