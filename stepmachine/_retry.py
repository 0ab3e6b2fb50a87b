"""The one compare-and-set retry loop: write from a session, reload on conflict, write again.

Every writer that computes a batch from a session it read (the machine's run,
finalize, :func:`~stepmachine.submit`, the ``Tools`` step's result commits)
retries the same way: the attempt raises :class:`ConflictError` when the
stored session moved on, nothing was written, so the writer reloads and
computes again from what is stored now -- it never overwrites (no lost updates).

Two budgets: :class:`Conflicts` / :func:`retry_conflicts` count every conflict
(a decision made from a session that moved on is simply made again);
:func:`retry_while_moving` counts only conflicts the stored session does not
explain, for a write that must not be dropped for losing the race (a record of
work already done: a tool's result, a card's receipt); it also waits out a few
store faults (a lost connection), since such a record cannot be computed again
by running the work again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from ._errors import ConflictError, LeaseLostError
from ._session import Session
from ._transient import backoff, is_transient

__all__ = [
    "MAX_STALLED_CONFLICTS",
    "MAX_STORE_FAULTS",
    "Conflicts",
    "retry_conflicts",
    "retry_while_moving",
    "store_fault",
    "wait_out",
]

R = TypeVar("R")
S = TypeVar("S", bound=Session[Any])


class Conflicts:
    """A budget of conflicts, spent by :meth:`retry`; share one across calls to cap a whole run.

    Args:
        tolerated: conflicts tolerated in all (``0``: the first one propagates).
    """

    __slots__ = ("left",)

    def __init__(self, tolerated: int) -> None:
        self.left = tolerated

    async def retry(
        self,
        session: S,
        attempt: Callable[[S], Awaitable[R]],
        reload: Callable[[str], Awaitable[S]],
    ) -> R:
        """``attempt(session)``; after a conflict, ``reload(session.id)`` and attempt again.

        Returns:
            What the first attempt that did not conflict returned.

        Raises:
            ConflictError: the conflict that found the budget spent.
            Exception: whatever ``attempt`` or ``reload`` raises otherwise.

        Cancellation: propagates from ``attempt`` or ``reload`` as is.
        """
        while True:
            try:
                return await attempt(session)
            except ConflictError:
                if self.left <= 0:
                    raise
                self.left -= 1
            session = await reload(session.id)


async def retry_conflicts(
    session: S,
    attempt: Callable[[S], Awaitable[R]],
    reload: Callable[[str], Awaitable[S]],
    *,
    attempts: int,
) -> R:
    """:meth:`Conflicts.retry` with a budget of its own: at most ``attempts`` attempts in all.

    Raises:
        ValueError: ``attempts`` is less than 1.
        ConflictError: every attempt conflicted.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    return await Conflicts(attempts - 1).retry(session, attempt, reload)


MAX_STALLED_CONFLICTS = 16
"""Conflicts in a row :func:`retry_while_moving` tolerates with the session found at the
same revision after each: a store that refuses the write yet shows no other batch."""

MAX_STORE_FAULTS = 3
"""Store faults (a lost connection, a server restarting: see :func:`store_fault`)
:func:`retry_while_moving` waits out, in all, before it lets the next one propagate."""


def store_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is the store failing to answer (an ``OSError``, psycopg's
    ``OperationalError``): transient (see ``_transient.is_transient``), and neither a
    conflict nor a lost lease, which say something about the session, not the store."""
    if isinstance(exc, ConflictError | LeaseLostError):
        return False
    return isinstance(exc, Exception) and is_transient(exc)


async def retry_while_moving(
    session: S,
    attempt: Callable[[S], Awaitable[R]],
    reload: Callable[[str], Awaitable[S]],
) -> R:
    """``attempt(session)``; after a conflict, reload and attempt again, for as long as
    the stored session keeps moving on.

    A conflict after which the reloaded session is at a later revision is the
    race lost to another writer: it is retried however often it happens (each
    retry follows one of that writer's batches, so this loop is never busier
    than the writers it loses to). Only a conflict the stored session does not
    explain (no batch since the last attempt) counts, and
    :data:`MAX_STALLED_CONFLICTS` of them in a row raise.

    A store fault (:func:`store_fault`) of the attempt or of a reload is waited
    out too, after a backoff, up to :data:`MAX_STORE_FAULTS` in all: the attempt
    is made again from the session reloaded after it. A write whose reply was
    lost may have been stored: the attempt computed again from the stored
    session then finds it there (a record never writes what is stored already).

    Raises:
        ConflictError: the store refused the write that many times in a row
            without the session moving on (a broken store, or one lying about
            the revision).
        Exception: a store fault past :data:`MAX_STORE_FAULTS`; whatever else
            ``attempt`` or ``reload`` raises, at once.

    Cancellation: propagates from ``attempt``, ``reload`` or a backoff as is.
    """
    stalled = faults = 0
    while True:
        conflict: ConflictError | None = None
        try:
            return await attempt(session)
        except ConflictError as exc:
            conflict = exc
        except Exception as exc:  # noqa: BLE001 - re-raised by wait_out unless a store fault
            faults = await wait_out(exc, faults)
        before = session.revision
        while True:
            try:
                session = await reload(session.id)
                break
            except Exception as exc:  # noqa: BLE001 - re-raised by wait_out unless a store fault
                faults = await wait_out(exc, faults)
        if conflict is not None:
            stalled = stalled + 1 if session.revision <= before else 0
            if stalled > MAX_STALLED_CONFLICTS:
                raise conflict


async def wait_out(exc: Exception, faults: int) -> int:
    """Re-raise ``exc`` unless it is a store fault with faults to spare (``faults``
    counted so far, fewer than :data:`MAX_STORE_FAULTS`); else sleep the backoff and
    return the faults counted so far."""
    if not store_fault(exc) or faults >= MAX_STORE_FAULTS:
        raise exc
    faults += 1
    await anyio.sleep(backoff(faults))
    return faults
