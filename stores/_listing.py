"""A store's listing that names its damaged sessions instead of failing whole.

``list_sessions()`` is strict: a database store checks every ``sessions`` row
against its checksum and raises :class:`~stepmachine.StoredDataError` for the
first damaged one (a damaged row's id cannot be trusted, so it is never handed
out as a plain id: stored data is data). A tool that shows a whole store (the
inspector's ``sessions list``, ``fsck``, the web view's list) needs the other
sessions too: ``scan_sessions()`` gives every session as a
:class:`ListedSession`, a damaged one marked ``unreadable`` with the reason, and
raises only when the store itself cannot be read.

The decision: damaged sessions are *entries marked unreadable*, not skipped, so
that whoever lists a store sees every session it holds, and a check over all
sessions can report (and fail on) each damaged one by name. The id of an
unreadable entry is the id as stored, which the damage may have changed: show
it, do not act on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import msgspec

from stepmachine import StoredDataError

__all__ = ["ListedSession", "scan_rows"]

R = TypeVar("R")


class ListedSession(msgspec.Struct, frozen=True):
    """One session of a store's :meth:`~stepmachine.stores.SQLiteStore.scan_sessions`.

    Attributes:
        id: the session id as stored (of an unreadable entry: as stored, which
            the damage may have changed).
        unreadable: why the session cannot be read (the
            :class:`~stepmachine.StoredDataError` message, naming the store,
            the session and the row); ``None`` when the listing found nothing
            wrong with it (loading it checks the rest of its stored data).
    """

    id: str
    unreadable: str | None = None


ListedSession.__module__ = "stepmachine.stores"


def scan_rows(
    rows: Iterable[R], id_of: Callable[[R], str], check: Callable[[R], object]
) -> list[ListedSession]:
    """``rows`` as listed sessions, sorted by id: ``check(row)`` raising
    :class:`~stepmachine.StoredDataError` marks that row's entry unreadable."""
    listed: list[ListedSession] = []
    for row in rows:
        try:
            check(row)
        except StoredDataError as exc:
            listed.append(ListedSession(id_of(row), str(exc)))
        else:
            listed.append(ListedSession(id_of(row)))
    return sorted(listed, key=lambda entry: entry.id)
