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
work already done: a tool's result, a card's receipt).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ._errors import ConflictError
from ._session import Session

__all__ = ["MAX_STALLED_CONFLICTS", "Conflicts", "retry_conflicts", "retry_while_moving"]

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

    Raises:
        ConflictError: the store refused the write that many times in a row
            without the session moving on (a broken store, or one lying about
            the revision).
        Exception: whatever ``attempt`` or ``reload`` raises otherwise.

    Cancellation: propagates from ``attempt`` or ``reload`` as is.
    """
    stalled = 0
    while True:
        try:
            return await attempt(session)
        except ConflictError:
            before = session.revision
            session = await reload(session.id)
            stalled = stalled + 1 if session.revision <= before else 0
            if stalled > MAX_STALLED_CONFLICTS:
                raise
