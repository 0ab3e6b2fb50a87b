"""``PostgresStore``: sessions and their effect logs in a PostgreSQL database (extra ``postgres``).

The store for many processes and machines on one database. Its rows are
SQLiteStore's (one row per effect under a batch row, a session row holding
the revision, at most two compressed snapshots per session, a CRC-32 on every
row, a schema version that a newer database is refused by, untouched), in the
PostgreSQL schema ``stepmachine`` (:mod:`._postgres_schema`). The cache,
replay, compare-and-set, snapshot policy and errors are the durable stores'
shared core (:mod:`._core`), over the byte backend of :mod:`._postgres_log`.

Driver: psycopg 3's synchronous API and its connection pool
(``psycopg_pool.ConnectionPool``), each call one hop to an anyio worker
thread holding one pooled connection for one ``BEGIN ... COMMIT``: psycopg's
async API runs only on asyncio, this works on asyncio and trio. Calls of one
store run in parallel, up to the pool's ``max_size`` (the rest wait for a
connection, cancellably); the core's cache is shared by them (a cache entry
that falls behind only costs a read: every write proves its position).

Applying a batch is one transaction: the compare-and-set ``UPDATE
stepmachine.sessions ... WHERE sid = %s AND revision = %s`` (its row count says
whether the session this store last read or wrote is still the stored one;
PostgreSQL's row lock orders it against every other writer, in this process
or another), then the effect rows (one ``executemany``), the batch row and,
when due, a snapshot with the ``DELETE`` of the one it supersedes.

Leases (:class:`~stepmachine.Leases`, :mod:`._postgres_leases`): the session
row carries the lease (owner, an epoch that only grows, an expiry on the
server's clock) and the pending-run mark, outside its checksum. Claims,
renewals and releases are ``UPDATE`` statements on that row; ``claim_next`` picks a
requested session with ``FOR UPDATE SKIP LOCKED``. An apply with a lease is
fenced in the compare-and-set itself (``AND lease_owner = %s AND lease_epoch
= %s AND lease_expires_at > now()``): a holder that was paused or partitioned
past its lease's expiry, and woke after another runner claimed the session,
gets :class:`~stepmachine.LeaseLostError`, with nothing written.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import anyio
import anyio.to_thread
import msgspec

from stepmachine import (
    Codec,
    ConfigurationError,
    ConflictError,
    Effect,
    LeaseLostError,
    Message,
    Session,
    StoreClosedError,
)
from stepmachine._async import run_in_thread
from stepmachine._lease import check_claim
from stepmachine.extend import Batch, Lease, LeaseHolder

from . import _postgres_leases as _leases
from . import _postgres_rows as _rows
from ._backend import Cached
from ._core import LogCore
from ._ids import validate_session_id
from ._listing import ListedSession
from ._media_blobs import DEFAULT_MAX_MEDIA_BYTES, check_max_media_bytes
from ._postgres_log import PostgresTxn
from ._postgres_schema import describe, idle_limit, prepare_schema, transaction
from ._snapshot_policy import Weighted
from ._sqlite_rows import SNAPSHOT_EVERY, SNAPSHOT_MAX_GAP, SessionRow, marks_of

if TYPE_CHECKING:
    import psycopg
    from psycopg_pool import ConnectionPool

__all__ = ["PostgresStore"]

T = TypeVar("T")

_CACHE_SIZE = 256
"""How many sessions the store keeps decoded (least recently used ones are dropped)."""


class _SharedCore(LogCore[SessionRow]):
    """The core, with its cache updated under a lock: hops run in several threads."""

    def __init__(self, codec: Codec[Any], max_media_bytes: int) -> None:
        policy = Weighted(SNAPSHOT_EVERY, SNAPSHOT_MAX_GAP)
        super().__init__(
            codec,
            policy,
            PostgresTxn.FORM,
            cache_size=_CACHE_SIZE,
            max_media_bytes=max_media_bytes,
        )
        self._guard = threading.Lock()

    def remember(self, session_id: str, cached: Cached[SessionRow]) -> None:
        with self._guard:
            super().remember(session_id, cached)

    def forget(self, session_id: str) -> None:
        with self._guard:
            super().forget(session_id)

    def clear(self) -> None:
        with self._guard:
            super().clear()


def _no_hook(name: str) -> None:
    """The default boundary hook: does nothing."""


class PostgresStore:
    """A store in a PostgreSQL database, shared safely by many processes and machines.

    Build one with :meth:`open`; close it with :meth:`aclose` or ``async with``.

    Durability: a batch is durable once :meth:`apply` returns, as PostgreSQL's
    ``COMMIT`` is (with the server's defaults, ``fsync`` and
    ``synchronous_commit`` on, it survives a crash of the server machine too).
    A connection lost during ``COMMIT`` leaves the outcome unknown to the
    caller (psycopg raises ``OperationalError``): the next :meth:`load` shows
    whether the batch is there; re-applying it raises
    :class:`~stepmachine.ConflictError` if it is.

    A server restart: the pool checks each connection as it hands it out
    (``psycopg_pool.ConnectionPool.check_connection``, one round trip) and
    replaces a dead one, so after a restart the next call gets a fresh
    connection instead of each of the pool's dead ones failing a call in
    turn. A call whose transaction the restart ended raises
    ``psycopg.OperationalError`` (``AdminShutdown`` among them): a transient
    error, which ``serve()`` and durable turns run again.

    Damage is detected as in :class:`~stepmachine.stores.SQLiteStore`: every
    row carries a CRC-32 over its content and placement, checked before it is
    decoded; a row that fails raises :class:`~stepmachine.StoredDataError`
    naming the database, table, session and revision, and nothing is rewritten.

    Schema: :meth:`open` creates the ``stepmachine`` schema in an empty
    database and refuses, leaving it unchanged, a database whose
    ``stepmachine`` schema was written by a newer schema version or is not a
    store's.

    Cancellation: a method cancelled while it waits for a connection does
    nothing. Once its transaction is running in the worker thread it is not
    interrupted: the method returns (or raises) exactly as it would have, and
    the cancellation is delivered at the caller's next checkpoint. So an
    :meth:`apply` cancelled in the worker thread either committed the whole
    batch or wrote nothing. A process killed mid-transaction loses the
    connection, and PostgreSQL rolls the transaction back.

    Attributes:
        BOUNDARIES: the persistence boundaries at which ``boundary_hook`` is
            called, in the worker thread (on asyncio not one of anyio's: a hook
            calling ``anyio.from_thread`` passes its ``token=``): ``"apply.begin"`` (in the
            transaction, before any statement), ``"apply.inserted"`` (rows
            written, before ``COMMIT``), ``"apply.committed"`` (after
            ``COMMIT``, before :meth:`apply` returns) and ``"create.committed"``.
    """

    applies_batches: ClassVar[bool] = True
    """``apply`` applies each batch once and returns the session (see ``EffectHandler``)."""

    leases_expire: ClassVar[bool] = True
    """Leases lapse ``ttl`` seconds after the last claim or renewal (the server's clock)."""

    BOUNDARIES: ClassVar[tuple[str, ...]] = (
        "apply.begin",
        "apply.inserted",
        "apply.committed",
        "create.committed",
    )

    def __init__(
        self,
        pool: Any,
        label: str,
        codec: Codec[Any],
        boundary_hook: Callable[[str], None],
        connections: anyio.CapacityLimiter,
        max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES,
    ) -> None:
        """Wrap an open ``psycopg_pool.ConnectionPool``; use :meth:`open` instead.

        (``pool`` is typed ``Any`` here so that the signature resolves without
        psycopg installed.)
        """
        self._pool: ConnectionPool[Any] | None = pool
        self._label = label
        self._hook = boundary_hook
        self._connections = connections
        self._core = _SharedCore(codec, max_media_bytes)

    @classmethod
    async def open(
        cls,
        dsn: str,
        codec: Codec[Any] | None = None,
        *,
        min_size: int = 1,
        max_size: int = 4,
        pool_timeout: float = 30.0,
        idle_in_transaction_timeout: float | None = 60.0,
        boundary_hook: Callable[[str], None] | None = None,
        read_only: bool = False,
        max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES,
    ) -> PostgresStore:
        """Connect to the database ``dsn`` names, and create or check its schema.

        Args:
            dsn: a libpq connection string or URI (``postgresql://user@host/db``).
            codec: the application's codec (kernel effects and ``NoData`` by default).
            min_size: the pool's connections kept open.
            max_size: the pool's connections at most.
            pool_timeout: seconds to wait for the first connection, and later
                for a free one (then ``psycopg_pool.PoolTimeout``).
            idle_in_transaction_timeout: seconds one of this store's
                transactions may sit idle on the server (its process paused or
                partitioned away between two statements) before the server ends
                its connection, rolling it back and freeing the session rows it
                locked; so such a process holds up a lease's takeover for at most
                this long. ``None`` keeps the server's setting (often: forever).
                The store's own transactions are never idle longer than their
                decoding takes.
            boundary_hook: called with each name of :attr:`BOUNDARIES` as the
                store passes it (crash tests kill the process there).
            read_only: open for reading (inspection): opening writes nothing,
                so the schema is neither created nor migrated (a missing or
                older one is :class:`StoredDataError`). The store's own write
                methods still write: do not call them.
            max_media_bytes: the bytes one image, document or audio part may
                hold (20 MiB by default); a larger one raises
                :class:`~stepmachine.MediaTooLargeError` and nothing is written.
                Media bytes are kept once per digest in the ``media`` table,
                apart from the effect rows, and checked against it when read.

        Returns:
            The open store; the database's schema is at the current version.

        Raises:
            ConfigurationError: psycopg or psycopg_pool is not installed (the
                ``postgres`` extra), a size is out of range, or
                ``idle_in_transaction_timeout`` is not > 0.
            StoredDataError: the database was written by a newer schema version,
                or its ``stepmachine`` schema is not a store's; nothing was changed.
            psycopg_pool.PoolTimeout: no connection within ``pool_timeout``.

        Cancellation: once in the worker thread, opening runs to its end and
        returns the open store (or raises); close what you got.
        """
        try:
            # Imported here: the package imports without the postgres extra.
            import psycopg  # noqa: F401, PLC0415 - the pool needs it; say so clearly
            from psycopg_pool import ConnectionPool  # noqa: PLC0415
        except ImportError as exc:
            raise ConfigurationError(
                "PostgresStore needs psycopg 3 and psycopg_pool: "
                f"pip install 'stepmachine[postgres]' ({exc})"
            ) from exc
        if not 1 <= min_size <= max_size:
            raise ConfigurationError(f"need 1 <= min_size <= max_size, not {min_size}, {max_size}")
        check_max_media_bytes(max_media_bytes)
        configure = idle_limit(idle_in_transaction_timeout)
        pool: ConnectionPool[Any] = ConnectionPool(
            dsn,
            min_size=min_size,
            max_size=max_size,
            timeout=pool_timeout,
            kwargs={"autocommit": True},
            configure=configure,
            check=ConnectionPool.check_connection,  # a restarted server's dead connections
            open=False,
            name="stepmachine",
        )

        def start() -> str:
            try:
                pool.open(wait=True, timeout=pool_timeout)
                with pool.connection() as conn:
                    prepare_schema(conn, read_only=read_only)
                    return describe(conn)
            except BaseException:
                pool.close()
                raise

        with anyio.CancelScope(shield=True):
            label = await run_in_thread(start)
        hook = boundary_hook or _no_hook
        limiter = anyio.CapacityLimiter(max_size)
        return cls(pool, label, codec or Codec(), hook, limiter, max_media_bytes)

    @property
    def codec(self) -> Codec[Any]:
        """The codec the store encodes with."""
        return self._core.codec

    # -- plumbing -----------------------------------------------------------------

    async def _run(self, function: Callable[[psycopg.Connection[Any]], T]) -> T:
        """Run ``function(connection)`` in a worker thread on a pooled connection."""
        async with self._connections:
            pool = self._pool
            if pool is None:
                raise StoreClosedError(f"PostgresStore on {self._label} is closed")

            def hop() -> T:
                with pool.connection() as connection:
                    return function(connection)

            # Shielded: a started transaction runs to its end, and its outcome
            # (return or exception) reaches the caller; a pending cancellation
            # is delivered at the caller's next checkpoint. asyncio's native
            # task.cancel() is raised only once the transaction ended
            # (run_in_thread): the connection slot is never given back early.
            with anyio.CancelScope(shield=True):
                result = await run_in_thread(hop)
        return result

    def _txn(self, connection: psycopg.Connection[Any], *, write: bool) -> PostgresTxn:
        return PostgresTxn(connection, self._label, write=write)

    async def _write(self, function: Callable[[psycopg.Connection[Any]], T]) -> T:
        """Run ``function(connection)`` in one write transaction (see :meth:`_run`)."""

        def run(connection: psycopg.Connection[Any]) -> T:
            with transaction(connection, write=True):
                return function(connection)

        return await self._run(run)

    # -- the Store API -----------------------------------------------------------

    async def create(
        self,
        session_id: str,
        data: msgspec.Struct | None = None,
        conversation: Sequence[Message] = (),
    ) -> Session[Any]:
        """Create a revision-0 session, stored as its first snapshot.

        Raises:
            InvalidSessionIdError: the id is not safe (see ``validate_session_id``).
            SessionExistsError: the id is taken; nothing is written.
            ConfigurationError: ``data`` is not the codec's data type.
        """
        validate_session_id(session_id)
        session, record, blobs = self._core.new_session(session_id, data, conversation)

        def run(connection: psycopg.Connection[Any]) -> Session[Any]:
            with transaction(connection, write=True):
                txn = self._txn(connection, write=True)
                created = self._core.create(txn, session_id, session, record, blobs)
            self._core.remember(session_id, created)
            self._hook("create.committed")
            return session

        return await self._run(run)

    async def load(self, session_id: str) -> Session[Any]:
        """The current session: the session row, then only the rows written since the
        session this store last read or wrote.

        Raises:
            InvalidSessionIdError: the id is not safe.
            SessionNotFoundError: no session has this id.
            StoredDataError: a stored row does not match its checksum, or a
                record does not decode or apply; the message names the database,
                table, session, revision and effect index.
        """
        validate_session_id(session_id)

        def run(connection: psycopg.Connection[Any]) -> Session[Any]:
            with transaction(connection, write=False):
                txn = self._txn(connection, write=False)
                return self._core.current(txn, session_id).session

        return await self._run(run)

    async def apply(self, batch: Batch[Effect], *, lease: Lease | None = None) -> Session[Any]:
        """Append ``batch`` if the session is at ``batch.revision - 1``; all rows or none.

        Returns the session after the batch, as a load would give it. One
        transaction (see the module docstring); on top of this store's cache
        nothing is read. With ``lease``, only while it is the session's live
        lease, checked in the same ``UPDATE`` as the revision (no extra statement).

        Raises:
            LeaseLostError: ``lease`` is not the session's live lease (expired,
                released, claimed by another, or a lease of another session);
                nothing is written. Said rather than a conflict when both hold.
            InvalidSessionIdError: ``batch.session_id`` is not safe.
            ConflictError: the session is at another revision; nothing is written.
            SessionNotFoundError: no session has this id.
            EffectError: an effect does not apply; nothing is written.
            ConfigurationError: an effect type is not registered in the codec.
            StoredDataError: a stored row the session is rebuilt from does not
                match its checksum or does not decode; nothing is written.
        """
        session_id = validate_session_id(batch.session_id)
        if lease is not None and lease.session_id != session_id:
            why = f"it is a lease of {lease.session_id!r}"
            raise LeaseLostError(session_id, lease.owner, lease.epoch, why)
        prepared = self._core.prepare(batch, f"{self._label}: new batch for {session_id!r}")

        def run(connection: psycopg.Connection[Any]) -> Session[Any]:
            with transaction(connection, write=True):
                self._hook("apply.begin")
                txn = PostgresTxn(connection, self._label, write=True, lease=lease)
                try:
                    written = self._core.apply(txn, prepared)
                except ConflictError:
                    if lease is not None:
                        _leases.check(connection, lease)  # a lost lease is said first
                    raise
                self._hook("apply.inserted")
            self._core.remember(session_id, written)
            self._hook("apply.committed")
            return written.session

        return await self._run(run)

    async def list_sessions(self) -> list[str]:
        """The ids of all sessions, sorted.

        Raises:
            StoredDataError: a session row does not match its checksum.
        """

        def run(connection: psycopg.Connection[Any]) -> list[str]:
            with transaction(connection, write=False):
                return _rows.session_ids(connection, self._label)

        return await self._run(run)

    async def scan_sessions(self) -> list[ListedSession]:
        """Every session, sorted by id; a damaged ``sessions`` row is listed
        ``unreadable`` with the reason instead of failing the listing (as
        :meth:`SQLiteStore.scan_sessions <stepmachine.stores.SQLiteStore.scan_sessions>`).

        Raises:
            StoredDataError: the database itself cannot be read.
        """

        def run(connection: psycopg.Connection[Any]) -> list[ListedSession]:
            with transaction(connection, write=False):
                return _rows.session_entries(connection, self._label)

        return await self._run(run)

    async def delete(self, session_id: str) -> None:
        """Delete a session with its log and snapshots, in one transaction.

        The media bytes its records named are deleted with it, in the same
        transaction, unless a record of another session (a fork, a session
        holding the same bytes) names them too; a writer that relies on a blob
        holds its row until it commits, so the delete waits for its record.

        Raises:
            InvalidSessionIdError: the id is not safe.
            SessionNotFoundError: no session has this id.
            StoredDataError: the session's row does not match its checksum;
                nothing is deleted.
        """
        validate_session_id(session_id)

        def run(connection: psycopg.Connection[Any]) -> None:
            try:
                with transaction(connection, write=True):
                    txn = self._txn(connection, write=True)
                    named = _rows.session_digests(connection, txn.row(session_id).sid)
                    txn.delete(session_id)
                    if named:  # None (a body unreadable): the blobs are kept
                        _rows.sweep_blobs(connection, named)
            finally:
                self._core.forget(session_id)

        await self._run(run)

    async def load_at(self, session_id: str, revision: int) -> Session[Any]:
        """The session as it was at ``revision``: the nearest snapshot, then its log.

        Raises:
            InvalidSessionIdError: the id is not safe.
            SessionNotFoundError: no session has this id.
            ValueError: ``revision`` is negative or beyond the current one.
            StoredDataError: a stored row does not match its checksum, or a
                record does not decode or apply.
        """
        validate_session_id(session_id)

        def run(connection: psycopg.Connection[Any]) -> Session[Any]:
            with transaction(connection, write=False):
                txn = self._txn(connection, write=False)
                return self._core.session_at(txn, session_id, revision)

        return await self._run(run)

    async def batches(self, session_id: str, after: int = 0) -> list[Batch[Effect]]:
        """The audit log: every applied batch with ``revision > after``, in order.

        Raises:
            InvalidSessionIdError: the id is not safe.
            SessionNotFoundError: no session has this id.
            StoredDataError: a stored row does not match its checksum, or a
                record does not decode.
        """
        validate_session_id(session_id)

        def run(connection: psycopg.Connection[Any]) -> list[Batch[Effect]]:
            with transaction(connection, write=False):
                txn = self._txn(connection, write=False)
                return self._core.batches(txn, session_id, after)

        return await self._run(run)

    async def fork(self, session_id: str, revision: int, new_session_id: str) -> Session[Any]:
        """Create ``new_session_id`` as a copy of ``session_id`` at ``revision``.

        The fork is at the same revision, with the same conversation and data,
        and carries the source's batches ``1..revision``; rows are checked
        against their checksums and copied with new ones, not re-encoded. One
        transaction.

        Raises:
            InvalidSessionIdError: either id is not safe.
            SessionNotFoundError: ``session_id`` does not exist.
            SessionExistsError: ``new_session_id`` is taken.
            ValueError: ``revision`` is negative or beyond the current one.
            StoredDataError: a row to copy does not match its checksum, or a
                record does not decode; nothing is written.
        """
        validate_session_id(session_id)
        validate_session_id(new_session_id)

        def run(connection: psycopg.Connection[Any]) -> Session[Any]:
            with transaction(connection, write=True):
                txn = self._txn(connection, write=True)
                source = txn.row(session_id)
                at = self._core.session_at(txn, session_id, revision)
                forked = msgspec.structs.replace(at, id=new_session_id)
                # The snapshots the source keeps: revision 0 and the fork point.
                first = self._core.session_at(txn, session_id, 0)
                first = msgspec.structs.replace(first, id=new_session_id)
                record, blobs = self._core.session_record(first)
                sid = self._core.create(txn, new_session_id, first, record, blobs).position.sid
                _rows.copy_log(connection, self._label, session_id, source.sid, sid, revision)
                record, blobs = self._core.session_record(forked)
                txn.put_blobs(blobs)  # held already (the rows copied refer to them): no bytes
                if revision > 0:
                    _rows.insert_snapshot(connection, sid, revision, record)
                row = SessionRow(sid, revision, revision, len(record), 0)
                _rows.write_session_row(connection, new_session_id, row)
            self._core.remember(new_session_id, Cached(forked, row, marks_of(row)))
            return forked

        return await self._run(run)

    # -- leases (see stepmachine.Leases and ._postgres_leases) -----------------------

    async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | LeaseHolder:
        """Claim the session's lease for ``owner``, or say who holds it (``Leases.claim``).

        Succeeds when nobody holds the session or the holder's lease expired
        (the server's clock); the epoch grows by one and the pending-run mark is
        taken. A live lease, even ``owner``'s own, gives :class:`LeaseHolder`.

        Raises:
            InvalidSessionIdError: the id is not safe.
            SessionNotFoundError: no session has this id.
            ValueError: ``owner`` or ``ttl`` is unfit (see ``check_claim``).
        """
        validate_session_id(session_id)
        check_claim(owner, ttl)
        return await self._write(lambda conn: _leases.claim(conn, session_id, owner, ttl))

    async def claim_next(self, owner: str, ttl: float) -> Lease | None:
        """Claim the session whose pending run waits longest and has no live lease, or ``None``.

        A session whose lease lapsed without a release (its holder died or was
        cut off mid-run) has work too, and is given out like a marked one.

        Rows that another transaction holds locked at that moment are skipped
        (``SKIP LOCKED``), never waited for: a session is never given to two
        claimers, and ``None`` may be answered while a session is only busy
        being written (a worker polls again).
        """
        check_claim(owner, ttl)
        return await self._write(lambda conn: _leases.claim_next(conn, owner, ttl))

    async def request_run(self, session_id: str) -> None:
        """Mark the session as having a pending run (``Leases.request_run``).

        Raises:
            InvalidSessionIdError: the id is not safe.
            SessionNotFoundError: no session has this id.
        """
        validate_session_id(session_id)
        await self._write(lambda conn: _leases.request_run(conn, session_id))

    async def renew(self, lease: Lease) -> Lease:
        """Extend ``lease`` by its ttl from now (the server's clock); the same lease back.

        Raises:
            LeaseLostError: ``lease`` is not the session's live lease.
            SessionNotFoundError: no session has this id.
        """
        validate_session_id(lease.session_id)
        check_claim(lease.owner, lease.ttl)
        return await self._write(lambda conn: _leases.renew(conn, lease))

    async def release(self, lease: Lease, *, unless_requested: bool = False) -> bool:
        """Let go of ``lease``; ``True`` when released (``Leases.release``).

        With ``unless_requested``, a set pending-run mark is taken instead and
        the lease kept (``False``). A lease that is no longer current is left
        alone (``True``). Call it shielded from cancellation: once running in
        the worker thread it completes anyway (see the class docstring).
        """
        validate_session_id(lease.session_id)
        return await self._write(
            lambda conn: _leases.release(conn, lease, unless_requested=unless_requested)
        )

    async def aclose(self) -> None:
        """Close the pool (shielded from cancellation). Idempotent.

        Any later call but :meth:`aclose` raises :class:`~stepmachine.StoreClosedError`.
        """
        with anyio.CancelScope(shield=True):
            pool, self._pool = self._pool, None
            self._core.clear()
            if pool is not None:
                await run_in_thread(pool.close)

    async def __aenter__(self) -> PostgresStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()
