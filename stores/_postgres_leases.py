"""The leases of :class:`~stepmachine.stores.PostgresStore`: columns of the session row.

Each session row carries its lease (see :mod:`._postgres_schema`), outside the
row's checksum:

- ``lease_owner``: the holder's owner string, NULL when nobody holds it;
- ``lease_epoch``: the number of the last claim. It only grows (every claim
  adds one, a release keeps it), so a lease is identified by owner and epoch;
- ``lease_expires_at``: when the lease lapses without a renewal. A lease is
  *live* while ``lease_expires_at > now()``;
- ``run_requested_at``: the pending-run mark (NULL: none), the time of the
  first :meth:`request_run` since a claim last took it, so ``claim_next``
  serves the longest-waiting session first. A lease that lapsed without a
  release (``lease_owner`` still set) is work for ``claim_next`` too: its run
  was cut short.

Clock: every expiry is computed and compared with the server's ``now()`` (the
transaction's start time), never a client's clock, so machines whose clocks
disagree still agree on who holds a session.

Concurrency: every change of a lease is one ``UPDATE`` of the session row, or
follows a ``SELECT ... FOR UPDATE`` of it, so PostgreSQL's row lock orders
claims, renewals, releases and fenced applies (:func:`fenced_condition`)
against each other, across processes and machines. At READ COMMITTED an
``UPDATE`` that waited for another transaction's lock re-checks its ``WHERE``
on the row that transaction committed: two claims never both match, and a
fenced apply that waited behind a takeover does not match either.

Everything here is synchronous and runs in a worker thread, on a connection
the caller holds, inside a write transaction (:func:`._postgres_schema.transaction`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from stepmachine import LeaseLostError, SessionNotFoundError
from stepmachine.extend import Lease, LeaseHolder

from ._postgres_schema import SCHEMA

if TYPE_CHECKING:
    import psycopg

__all__ = [
    "check",
    "claim",
    "claim_next",
    "fenced_condition",
    "release",
    "renew",
    "request_run",
]

_SESSIONS: Final = f"{SCHEMA}.sessions"
_EXPIRES: Final = "now() + make_interval(secs => %(ttl)s::float8)"
_HELD_BY: Final = "lease_owner = %(owner)s AND lease_epoch = %(epoch)s AND lease_expires_at > now()"

fenced_condition: Final = " AND lease_owner = %s AND lease_epoch = %s AND lease_expires_at > now()"
"""What a fenced apply adds to the compare-and-set ``UPDATE``'s ``WHERE`` (owner, epoch)."""

_CLAIM = (
    f"UPDATE {_SESSIONS} SET lease_owner = %(owner)s, lease_epoch = lease_epoch + 1, "  # noqa: S608 - fixed names
    f"lease_expires_at = {_EXPIRES}, run_requested_at = NULL "
    "WHERE session_id = %(session_id)s "
    "AND (lease_owner IS NULL OR lease_expires_at <= now()) RETURNING lease_epoch"
)
_LEASE_OF = (
    "SELECT lease_owner, lease_epoch, lease_expires_at > now(), "  # noqa: S608 - fixed names
    "EXTRACT(EPOCH FROM lease_expires_at - now())::float8 "
    f"FROM {_SESSIONS} WHERE session_id = %(session_id)s FOR UPDATE"
)
_PICK = (
    f"SELECT session_id FROM {_SESSIONS} "  # noqa: S608 - fixed names
    "WHERE (run_requested_at IS NOT NULL AND lease_owner IS NULL) "
    "OR (lease_owner IS NOT NULL AND lease_expires_at <= now()) "
    "ORDER BY coalesce(run_requested_at, lease_expires_at), sid LIMIT 1 FOR UPDATE SKIP LOCKED"
)
"""A session with work and no live lease: a pending-run mark and nobody holding it, or
a lease that lapsed without a release (its run was cut short: abandoned)."""
_REQUEST = (
    f"UPDATE {_SESSIONS} SET run_requested_at = coalesce(run_requested_at, now()) "  # noqa: S608 - fixed names
    "WHERE session_id = %(session_id)s RETURNING sid"
)
_RENEW = (
    f"UPDATE {_SESSIONS} SET lease_expires_at = {_EXPIRES} "  # noqa: S608 - fixed names
    f"WHERE session_id = %(session_id)s AND {_HELD_BY} RETURNING sid"
)
_TAKE_REQUEST = (
    f"UPDATE {_SESSIONS} SET run_requested_at = NULL "  # noqa: S608 - fixed names
    f"WHERE session_id = %(session_id)s AND {_HELD_BY} AND run_requested_at IS NOT NULL "
    "RETURNING sid"
)
_LOCK_ROW = f"SELECT sid FROM {_SESSIONS} WHERE session_id = %(session_id)s FOR UPDATE"  # noqa: S608 - fixed names
_RELEASE = (
    f"UPDATE {_SESSIONS} SET lease_owner = NULL, lease_expires_at = NULL "  # noqa: S608 - fixed names
    "WHERE session_id = %(session_id)s AND lease_owner = %(owner)s AND lease_epoch = %(epoch)s"
)


def _params(lease: Lease) -> dict[str, Any]:
    return {"session_id": lease.session_id, "owner": lease.owner, "epoch": lease.epoch}


def _lease_of(conn: psycopg.Connection[Any], session_id: str) -> tuple[Any, ...]:
    """The session's lease columns, its row locked: owner, epoch, live, seconds left.

    Raises:
        SessionNotFoundError: no session has this id.
    """
    row = conn.execute(_LEASE_OF, {"session_id": session_id}).fetchone()
    if row is None:
        raise SessionNotFoundError(session_id)
    return tuple(row)


def claim(
    conn: psycopg.Connection[Any], session_id: str, owner: str, ttl: float
) -> Lease | LeaseHolder:
    """Claim the session for ``owner`` (``Leases.claim``): the new lease, or its holder.

    One ``UPDATE`` that matches only a free or expired lease, adds one to the
    epoch and takes the pending-run mark. When it matches nothing, the row is
    read locked: a live lease's holder is returned; a lease released in
    between is claimed now (the lock keeps it free).

    Raises:
        SessionNotFoundError: no session has this id.
    """
    params = {"session_id": session_id, "owner": owner, "ttl": float(ttl)}
    row = conn.execute(_CLAIM, params).fetchone()
    if row is None:
        holder, epoch, live, seconds_left = _lease_of(conn, session_id)
        if holder is not None and live:
            return LeaseHolder(holder, max(0.0, float(seconds_left)), int(epoch))
        row = conn.execute(_CLAIM, params).fetchone()
        assert row is not None, "a free lease on a locked row was not claimed"
    return Lease(session_id, owner, int(row[0]), ttl)


def claim_next(conn: psycopg.Connection[Any], owner: str, ttl: float) -> Lease | None:
    """Claim the session whose pending run waits longest and has no live lease, or ``None``.

    ``SELECT ... FOR UPDATE SKIP LOCKED LIMIT 1`` picks it without waiting on
    rows other transactions hold (two claimers never pick one row), then the
    claim's ``UPDATE`` takes it in the same transaction.
    """
    picked = conn.execute(_PICK).fetchone()
    if picked is None:
        return None
    claimed = claim(conn, str(picked[0]), owner, ttl)
    assert isinstance(claimed, Lease), "a picked and locked session was held"
    return claimed


def request_run(conn: psycopg.Connection[Any], session_id: str) -> None:
    """Set the session's pending-run mark (kept as it was when already set).

    Raises:
        SessionNotFoundError: no session has this id.
    """
    if conn.execute(_REQUEST, {"session_id": session_id}).fetchone() is None:
        raise SessionNotFoundError(session_id)


def check(conn: psycopg.Connection[Any], lease: Lease) -> None:
    """Raise :class:`LeaseLostError` unless ``lease`` is the session's live lease.

    Reads the row locked, so the answer holds until the transaction ends.

    Raises:
        LeaseLostError: the lease expired, was released or was claimed by another.
        SessionNotFoundError: no session has this id.
    """
    holder, epoch, live, _ = _lease_of(conn, lease.session_id)
    if holder == lease.owner and epoch == lease.epoch:
        if live:
            return
        why = "it expired"
    elif holder is None and epoch == lease.epoch:
        why = "it was released"
    elif holder is None:
        why = f"the session was claimed since (epoch {epoch}) and released"
    else:
        why = f"{holder!r} holds the session now (epoch {epoch})"
    raise LeaseLostError(lease.session_id, lease.owner, lease.epoch, why)


def renew(conn: psycopg.Connection[Any], lease: Lease) -> Lease:
    """Extend the live ``lease`` by its ttl from now; the same lease back.

    Raises:
        LeaseLostError: ``lease`` is not the session's live lease.
        SessionNotFoundError: no session has this id.
    """
    params = {**_params(lease), "ttl": float(lease.ttl)}
    if conn.execute(_RENEW, params).fetchone() is None:
        check(conn, lease)  # raises, unless a renewal of this very lease committed meanwhile
    return lease


def release(conn: psycopg.Connection[Any], lease: Lease, *, unless_requested: bool) -> bool:
    """Let go of ``lease`` (``Leases.release``); ``True`` when released.

    With ``unless_requested``, while ``lease`` is live and the pending-run mark
    is set, the mark is taken and the lease kept (``False``). A lease that is
    not the current one (or a session that is gone) is left alone: ``True``.
    """
    params = _params(lease)
    if unless_requested:
        # Lock the row first: without it, a request_run (and a claim that then
        # finds the session held and says "queued") could commit between the
        # look at the mark and the release, and the requested turn would be lost.
        conn.execute(_LOCK_ROW, params)
        if conn.execute(_TAKE_REQUEST, params).fetchone() is not None:
            return False
    conn.execute(_RELEASE, params)
    return True
