"""``serve()``: a worker's loop over the sessions that have work.

Many workers (tasks, processes, machines) call ``serve`` on one store. Each
round claims some session with a pending run (``store.claim_next``: set by
``store.request_run``, by a ``run()`` that queued its turn, or left by a
holder that died) and runs it holding that lease; the run renews the lease,
runs again while more turns are requested, and releases it. A session is
served by one worker at a time; a dead worker's session is picked up by
another once its lease is free (PostgreSQL: after its ``ttl``; the lock-file
stores: at once, the process being gone).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from . import _log
from ._errors import ConfigurationError
from ._hold import leasing_store
from ._lease import check_claim, new_owner
from ._machine import StateMachine
from ._run import RunReport
from ._runtime import Runtime
from ._steps import CancelToken

__all__ = ["serve"]


async def serve(
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
        stop: a token; once it fires, ``serve`` returns after the run in
            progress (to interrupt that run too, cancel the task calling
            ``serve``: the run finalizes as any cancelled run). ``None``:
            serve until cancelled.
        ttl: the lease's ttl for each claimed session (see :class:`LeasePolicy`).
        poll: seconds to sleep when no session has work.
        owner_prefix: put in front of each run's owner string (a worker's name).
        on_report: called with each run's :class:`RunReport` (may be async).

    A run that raises is logged (logger ``stepmachine``, with the session id
    and the error type) and the loop goes on: the session's pending-run mark
    was taken by the claim, so a session whose run keeps failing is not
    retried until something requests a run again. Errors of the store itself
    (``claim_next``) propagate.

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
        raise ConfigurationError(f"serve() needs a poll of seconds > 0, got {poll!r}")
    try:
        check_claim(new_owner(owner_prefix), ttl)
    except ValueError as exc:
        raise ConfigurationError(f"serve(): {exc}") from None
    store = leasing_store(runtime)
    if store is None:
        raise ConfigurationError(
            "serve() needs a runtime whose store has leases (the shipped stores do) "
            "and no separate effect handler"
        )
    while stop is None or not stop.cancelled:
        lease = await store.claim_next(new_owner(owner_prefix), ttl)
        if lease is None:
            with anyio.move_on_after(poll):
                if stop is None:
                    await anyio.sleep(poll)
                else:
                    await stop.wait()
            continue
        try:  # one round per claim: a session requested again goes back in the queue
            report = await machine._run_holding(runtime, store, lease, None, max_rounds=1)
        except Exception as exc:  # noqa: BLE001 - one session's failure does not stop the worker
            _log.event(
                _log.WARNING,
                "serve_run_failed",
                session_id=lease.session_id,
                error_type=type(exc).__name__,
            )
            continue
        if on_report is not None:
            done = on_report(report)
            if done is not None:
                await done
