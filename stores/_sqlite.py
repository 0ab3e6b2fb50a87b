"""``SQLiteStore``: sessions and their effect logs in one SQLite database file (WAL).

The embedded default store. The log is append-only, one row per batch carrying
step, cycle, timestamp and the batch's effects (schema version 5; a database
written before keeps those batches' effects in rows of their own, read as they
are); the session row holds the current revision. Applying a batch is one
``BEGIN IMMEDIATE`` transaction: compare-and-set on the revision, then the
batch's row, or nothing. The store keeps the last session it read or wrote per
session id, so a load reads only the rows written since, and an apply on top
of it reads nothing: its compare-and-set is one ``UPDATE ... WHERE sid = ? AND
revision = ?`` whose row count proves the cached session current (the row is
read only when it fails, to say why). Snapshots (at revision 0, after a
``ReplaceConversation``, and periodically, see :mod:`._sqlite_schema`) bound
what a cold load replays; each new one prunes the one before (revision 0
stays), so a session holds at most two, compressed; long effect records are
compressed too (schema version 3). Every row carries a CRC-32 checked on load
(since schema version 2). A batch row keeps the batch's ``refused`` and
``trace`` (schema version 4), and its effects (schema version 5). Media bytes
(images, documents, audio) are kept once per digest in a ``media`` table,
apart from the records (:mod:`._media_blobs`). The on-disk layout, its
migrations and the checksums live in :mod:`._sqlite_schema`; reading and
writing rows in :mod:`._sqlite_rows`. The cache, replay, compare-and-set,
snapshot policy and errors are the durable stores' shared core
(:mod:`._core`), over the byte backend of :mod:`._sqlite_log`.

What SQLite does and does not guarantee (durability, a damaged WAL, backups)
is in the :class:`SQLiteStore` docstring: in short, an acknowledged batch
survives a process crash (and, with ``synchronous="FULL"``, a power loss), but
damage to the ``-wal`` file silently rolls the database back to the last
commit before the damage, so back up with :meth:`SQLiteStore.backup` (or the
sqlite3 backup API, or ``VACUUM INTO``), never by copying the database file
alone while it is open.

All IO runs in a worker thread (:func:`stepmachine._async.run_in_thread`, one
hop per transaction: on asyncio the stores' own threads, on trio anyio's) on a
single connection guarded by an :class:`anyio.Lock`, so the store works on
asyncio and trio. Several processes, each with its own
``SQLiteStore``, may share one file: SQLite's locks serialise the writers, and a
stale batch raises :class:`~stepmachine.ConflictError`. Leases (one runner per
session across those processes) are file locks beside the database
(:mod:`._flock_leases`).
"""

from __future__ import annotations

import functools
import os
import sqlite3
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, ClassVar, Literal, TypeVar

import anyio
import anyio.to_thread
import msgspec

from stepmachine import Codec, Effect, Message, Session, StoreClosedError, StoredDataError
from stepmachine._async import run_in_thread
from stepmachine.extend import Batch, Lease

from . import _sqlite_rows as _rows
from . import _sqlite_schema as _schema
from ._backend import Cached, Marks
from ._core import LogCore
from ._flock_leases import FlockLeaseMethods, FlockLeases
from ._ids import validate_session_id
from ._listing import ListedSession
from ._media_blobs import DEFAULT_MAX_MEDIA_BYTES, check_max_media_bytes
from ._snapshot_policy import Weighted
from ._sqlite_log import SQLiteTxn
from ._sqlite_rows import SessionRow, session_digests, sweep_blobs
from ._sqlite_schema import transaction

__all__ = ["SQLiteStore"]

T = TypeVar("T")

_CACHE_SIZE = 256
"""How many sessions the store keeps decoded (least recently used ones are dropped)."""


class _SQLitePolicy:
    """The core's :class:`._snapshot_policy.Weighted` policy with the limits of
    :mod:`._sqlite_rows` (``SNAPSHOT_EVERY``, ``SNAPSHOT_MAX_GAP``), read at each call."""

    def due(self, marks: Marks, revision: int, batch_bytes: int, replaces: bool) -> bool:
        if not replaces and revision - marks.snapshot_revision < _rows.SNAPSHOT_EVERY:
            return False  # the usual batch: Weighted says no too, without being built
        policy = Weighted(_rows.SNAPSHOT_EVERY, _rows.SNAPSHOT_MAX_GAP)
        return policy.due(marks, revision, batch_bytes, replaces)


def _no_hook(name: str) -> None:
    """The default boundary hook: does nothing."""


def _cannot_open(file: str, exc: sqlite3.OperationalError) -> str:
    """Why SQLite could not open ``file``: the path, SQLite's words and what to do."""
    folder = os.path.dirname(os.path.abspath(file))
    if not os.path.isdir(folder):
        fix = f"the folder {folder!r} does not exist: create it first, or use a path in a folder"
        fix += " that exists"
    else:
        fix = "check that the path names a file (not a folder) you may read and write"
    return f"cannot open the SQLite database {file!r} ({exc}): {fix}"


def _data_version(connection: sqlite3.Connection | sqlite3.Cursor) -> int:
    """SQLite's ``PRAGMA data_version`` on ``connection``: it changes when another
    connection commits (read whole, so no statement stays open)."""
    ((version,),) = connection.execute("PRAGMA data_version").fetchall()
    return int(version)


def _fast_lock() -> anyio.Lock:
    """The store's lock: taken without an event-loop pass when it is free (anyio 4.5+).

    A pending cancellation is still delivered when it is taken; only the yield
    to other tasks goes (each operation then hops to the worker thread anyway).
    """
    try:
        return anyio.Lock(fast_acquire=True)
    except TypeError:  # anyio 4.4: no fast_acquire
        return anyio.Lock()


class SQLiteStore(FlockLeaseMethods):
    """A store in one SQLite database file, shared safely by several processes.

    Build one with :meth:`open`; close it with :meth:`aclose` or ``async with``.

    Durability: the database runs in WAL mode: a commit is appended to the
    ``-wal`` file beside the database, and copied into the database file by a
    later checkpoint (SQLite runs one when the WAL reaches about 1000 pages,
    and when the last connection closes). With ``synchronous="NORMAL"`` (the
    default) a batch is durable once :meth:`apply` returns against a crash of
    the process (``kill -9``): the "nothing is lost" guarantee. A power loss or operating system
    crash may lose the last batches acknowledged before it (the database
    stays consistent, at an earlier commit). With ``synchronous="FULL"`` the
    WAL is synced to disk at every commit, before :meth:`apply` returns, so
    acknowledged batches also survive a power loss, at the cost of one fsync
    per batch.

    A damaged WAL loses acknowledged batches silently, whatever
    ``synchronous`` says. Every WAL frame carries a checksum chained to the
    frames before it; when SQLite opens a WAL it replays the frames up to the
    first one whose checksum fails and ignores that frame *and every frame
    after it*, including transactions committed after it. So one damaged byte
    in the ``-wal`` file (a failing disk, a copy or a tool that touched it)
    rolls the database back to the last commit before the damage, with no
    error; the next checkpoint (at the latest when the last connection
    closes) writes that state into the database file and deletes the WAL, and
    the loss is permanent. ``synchronous="FULL"`` decides when the WAL reaches
    the disk, not what happens to a damaged one. The store's row checksums do
    not see it either: the lost rows are absent, and what remains is
    consistent. This store does not detect it: keep the database on storage
    you trust, and keep backups.

    Backups: call :meth:`backup` (``VACUUM INTO``: a consistent copy of
    everything committed, the WAL included, taken while the store stays in
    use), or use the sqlite3 online backup API
    (``sqlite3.connect(path).backup(sqlite3.connect(copy))``), or the
    ``sqlite3`` shell's ``.backup``. Never copy the database file alone while
    any process has it open: committed batches may still be only in the
    ``-wal`` file, and copying the database file and its WAL one after the
    other can capture a pair that does not belong together. A file copy is
    safe only once every process has closed the database (the last close
    checkpoints and removes the WAL). Verify a backup by opening it with
    :meth:`open` and loading its sessions.

    Damage inside the database file is detected: every row carries a CRC-32
    over its content and the columns that place it (session, revision,
    position), checked before the row is decoded, so a flipped bit raises
    :class:`~stepmachine.StoredDataError` naming the table, session and
    revision instead of loading different data. SQLite's own structures
    (page headers, indexes) are checked by ``PRAGMA integrity_check``, not by
    the store.

    Schema: a database written by an older schema version is migrated when
    opened (one transaction: whole or not at all); version 1 (no checksums)
    gets the checksum of every row as it is stored; version 2 is marked
    version 3 (its rows are read as they are); version 3 gets the batch
    columns ``refused`` and ``trace`` (its rows read with the defaults: no
    refusals, no trace); version 4 gets the batch column ``body``, where new
    batches keep their effects (its batches keep theirs in the ``effects``
    table, and read as they are). A database of a newer version than this code knows
    is refused and left unchanged: version 3 stores long effect records
    compressed, so code that knows only version 2 refuses a version-3
    database on open instead of failing on such a row (and code of version 3
    refuses version 4 rather than drop the batches' refusals and traces, and
    code of version 4 refuses version 5 rather than miss the batches' effects).

    Cancellation: a method cancelled while it waits for the store's lock does
    nothing. Once its transaction is running in the worker thread it is not
    interrupted: the method returns (or raises) exactly as it would have, and
    the cancellation is delivered at the caller's next checkpoint. So an
    :meth:`apply` cancelled in the worker thread either committed the whole
    batch and returns normally (the next :meth:`load` shows the new revision,
    and re-applying the same batch raises :class:`~stepmachine.ConflictError`)
    or raised and wrote nothing. asyncio's native ``task.cancel()`` (which no
    anyio shield stops) is raised only once the transaction ended, whatever it
    did staying done (a committed batch stays, as after a lost reply): the
    store's connection is never used by two calls at once. A process killed
    mid-transaction likewise leaves the batch committed whole or not at all.

    Locking: writers queue on SQLite's write lock for up to ``busy_timeout``
    seconds; only a lock held longer than that raises
    ``sqlite3.OperationalError("database is locked")``, with nothing written.
    Readers never wait for writers (WAL). The store keeps the last session it
    read or wrote for up to 256 session ids, least recently used dropped first.

    Leases (:class:`~stepmachine.Leases`, ``leases_expire = False``; POSIX
    only, :class:`~stepmachine.ConfigurationError` on Windows): a lease is an
    exclusive ``fcntl.flock`` on the session's lock file in the folder
    ``<path>-leases`` beside the database, held until :meth:`release`,
    :meth:`aclose` or the end of the process (the kernel releases it even on
    ``SIGKILL``): no clock, no expiry; two store instances exclude each other
    as two processes do. The lock file also holds the session's last epoch
    and owner (so a failed claim names the holder, and epochs keep growing
    across processes, and across ``delete``: lock files are never removed);
    a pending-run mark is a file of its own, and a store-wide lock makes
    looking at a mark and unlocking one step for every other process. All of
    it survives the death of any process; nothing is fsynced (after an
    operating-system crash a mark may be gone and an epoch may repeat, which
    cannot weaken fencing: only the live holder's own store instance accepts
    its lease). A :meth:`backup` does not copy the lease folder: a
    copy opened at another path starts its sessions' epochs at 1 again.

    Attributes:
        BOUNDARIES: the persistence boundaries at which ``boundary_hook`` is
            called, in the worker thread (on asyncio not one of anyio's: a hook
            calling ``anyio.from_thread`` passes its ``token=``): ``"apply.begin"``
            (after ``BEGIN IMMEDIATE``, before any insert), ``"apply.inserted"`` (rows
            inserted, before ``COMMIT``), ``"apply.committed"`` (after
            ``COMMIT``, before :meth:`apply` returns) and ``"create.committed"``.
    """

    applies_batches: ClassVar[bool] = True
    """``apply`` applies each batch once and returns the session (see ``EffectHandler``)."""

    BOUNDARIES: ClassVar[tuple[str, ...]] = (
        "apply.begin",
        "apply.inserted",
        "apply.committed",
        "create.committed",
    )

    def __init__(
        self,
        connection: sqlite3.Connection,
        path: str,
        codec: Codec[Any],
        boundary_hook: Callable[[str], None],
        max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES,
        busy_timeout: float = 30.0,
    ) -> None:
        """Wrap an open connection; use :meth:`open` instead."""
        self._conn: sqlite3.Connection | None = connection
        self._busy_ms = round(busy_timeout * 1000)
        self._seen: dict[str, int] = {}
        """Per cached session, the ``data_version`` of the transaction that last read or
        wrote it (see :meth:`_unchanged`)."""
        self._cursor = connection.cursor()  # the apply path's statements (see apply)
        self._valid_ids: set[str] = set()  # session ids apply has validated (bounded)
        self._path = path
        self._hook = boundary_hook
        self._lock = _fast_lock()
        self._core: LogCore[SessionRow] = LogCore(
            codec,
            _SQLitePolicy(),
            SQLiteTxn.FORM,
            cache_size=_CACHE_SIZE,
            max_media_bytes=max_media_bytes,
        )
        self._leases = FlockLeases(
            os.path.abspath(path) + "-leases",
            hop=self._hop,
            check=self._check_session,
            name=f"SQLiteStore on {path}",
        )

    @classmethod
    async def open(
        cls,
        path: str | os.PathLike[str],
        codec: Codec[Any] | None = None,
        *,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        busy_timeout: float = 30.0,
        boundary_hook: Callable[[str], None] | None = None,
        read_only: bool = False,
        max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES,
    ) -> SQLiteStore:
        """Open (creating if needed) the database at ``path`` and migrate it to this schema.

        Args:
            path: the database file; created owner-only (0o600, whatever the
                umask) when missing, as are its ``-wal`` and ``-shm`` files; an
                existing file keeps its permissions.
            codec: the application's codec (kernel effects and ``NoData`` by default).
            synchronous: ``"NORMAL"`` (durable against process crashes) or
                ``"FULL"`` (also against power loss); see the class docstring.
            busy_timeout: seconds to wait for another connection's lock
                before SQLite gives up with ``database is locked``.
            boundary_hook: called with each name of :attr:`BOUNDARIES` as the
                store passes it (crash tests kill the process there).
            read_only: open an existing database without writing to it (for
                inspection): nothing is created or migrated, and every write
                raises ``sqlite3.OperationalError``. It still sees what a live
                writer commits, and leaves no ``-wal`` or ``-shm`` file behind
                when it closes last (it is ``mode=rw`` with ``query_only``,
                not ``mode=ro``; see ``_sqlite_schema._open_read_only``).
            max_media_bytes: the bytes one image, document or audio part may
                hold (20 MiB by default); a larger one raises
                :class:`~stepmachine.MediaTooLargeError` and nothing is written.
                Media bytes are kept once per digest in the ``media`` table,
                apart from the records, and checked against it when read.

        Returns:
            The open store; its schema is at the current ``SCHEMA_VERSION``.

        Raises:
            StoredDataError: the file is not an SQLite database, belongs to
                another application, or was written by a newer schema version;
                the file is left unchanged.
            ValueError: ``synchronous`` or ``busy_timeout`` is out of range.
            sqlite3.OperationalError: the file cannot be opened at all (a
                missing folder, no permission); the message names the path
                and, for a missing folder, says to create it.
            FileNotFoundError: ``read_only`` and no file at ``path``.

        Cancellation: once in the worker thread, opening runs to its end and
        returns the open store (or raises); the cancellation is delivered at
        the caller's next checkpoint, so close what you got (``async with``
        does). Migrations are one transaction: applied whole or not at all.
        """
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be 'NORMAL' or 'FULL', not {synchronous!r}")
        if not busy_timeout >= 0:
            raise ValueError(f"busy_timeout must be a number of seconds >= 0, not {busy_timeout}")
        check_max_media_bytes(max_media_bytes)
        file = os.fspath(path)
        connect = functools.partial(
            _schema.open_connection, file, synchronous, busy_timeout, read_only=read_only
        )
        try:
            with anyio.CancelScope(shield=True):
                connection = await run_in_thread(connect)
        except sqlite3.OperationalError as exc:
            raise sqlite3.OperationalError(_cannot_open(file, exc)) from exc
        hook = boundary_hook or _no_hook
        return cls(connection, file, codec or Codec(), hook, max_media_bytes, busy_timeout)

    @property
    def codec(self) -> Codec[Any]:
        """The codec the store encodes with."""
        return self._core.codec

    # -- plumbing -----------------------------------------------------------------

    async def _run(self, function: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``function(connection)`` in the worker thread, holding the lock."""
        async with self._lock:
            connection = self._conn
            if connection is None:
                raise StoreClosedError(f"SQLiteStore on {self._path} is closed")
            try:
                # A cancellation before the worker thread starts raises with nothing
                # done; once the function runs, its outcome (return or exception) is
                # handed back and a pending cancellation is delivered at the caller's
                # next checkpoint. asyncio's native task.cancel() is raised only once
                # the function ended (run_in_thread): the lock is never let go while
                # the connection is inside a transaction.
                result = await run_in_thread(function, connection)
            except sqlite3.DatabaseError as exc:
                if type(exc) is not sqlite3.DatabaseError:
                    raise
                raise StoredDataError(f"{self._path} is damaged: {exc}") from exc
            return result

    # -- the Store API -----------------------------------------------------------

    async def create(
        self,
        session_id: str,
        data: msgspec.Struct | None = None,
        conversation: Sequence[Message] = (),
    ) -> Session[Any]:
        """Create a revision-0 session, stored as its first snapshot.

        Returns:
            The new session (``data`` defaults to the codec's ``data_type()``).

        Raises:
            InvalidSessionIdError: the id is not safe (see ``validate_session_id``).
            SessionExistsError: the id is taken; nothing is written.
            ConfigurationError: ``data`` is not the codec's data type.

        Cancellation: see the class docstring; once in the worker thread the
        creation commits whole (and returns) or not at all (and raises).
        """
        validate_session_id(session_id)
        session, record, blobs = self._core.new_session(session_id, data, conversation)

        def run(connection: sqlite3.Connection) -> Session[Any]:
            with transaction(connection, write=True):
                txn = SQLiteTxn(connection, self._path)
                created = self._core.create(txn, session_id, session, record, blobs)
                version = _data_version(connection)
            self._core.remember(session_id, created)
            self._saw(session_id, version)
            self._hook("create.committed")
            return session

        return await self._run(run)

    async def load(self, session_id: str) -> Session[Any]:
        """The current session.

        When this store last read or wrote the session and no other connection
        has committed to the database since (SQLite's ``PRAGMA data_version``,
        checked on the event loop), returns that session at once: no thread
        hop, no read. Otherwise reads the session row, then only the rows
        written since the session this store last read or wrote (nothing more
        when nothing changed).

        Raises:
            InvalidSessionIdError: the id is not safe.
            SessionNotFoundError: no session has this id.
            StoredDataError: a stored row does not match its checksum, or a
                record does not decode or apply; the message names the file,
                table, session, revision and effect index.
        """
        validate_session_id(session_id)
        async with self._lock:
            connection = self._conn
            if connection is None:
                raise StoreClosedError(f"SQLiteStore on {self._path} is closed")
            unchanged = self._unchanged(connection, session_id)
        if unchanged is not None:
            return unchanged

        def run(connection: sqlite3.Connection) -> Session[Any]:
            with transaction(connection, write=False):
                current = self._core.current(SQLiteTxn(connection, self._path), session_id)
                version = _data_version(connection)
            self._saw(session_id, version)
            return current.session

        return await self._run(run)

    def _unchanged(self, connection: sqlite3.Connection, session_id: str) -> Session[Any] | None:
        """The cached session when no other connection committed since the transaction
        that last read or wrote it, else None (read it in the worker thread).

        SQLite's ``PRAGMA data_version`` changes, on this connection, exactly when
        another connection (another process, another store instance) commits; this
        store's own writes go through its cache. Reading it touches only the
        shared-memory index of the write-ahead log, not the file, so it runs here,
        on the event loop, with the store's lock held (no thread uses the
        connection) and with SQLite's busy wait off: where it would wait (another
        connection recovering the log after a crash), the load takes the thread
        hop instead. A load that finds nothing new costs no hop and no read.
        """
        seen = self._seen.get(session_id)
        cached = self._core.cached(session_id)
        if seen is None or cached is None:
            return None
        try:
            connection.execute("PRAGMA busy_timeout = 0")
            try:
                version = _data_version(connection)
            finally:
                connection.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
        except sqlite3.OperationalError:  # busy: read it in the worker thread, waiting there
            return None
        return cached.session if version == seen else None

    def _saw(self, session_id: str, version: int) -> None:
        """Note that the cache holds ``session_id`` as stored at ``version`` (in the worker
        thread, once its transaction committed)."""
        if len(self._seen) >= 2 * _CACHE_SIZE:  # bounded like the cache (a miss reads)
            self._seen.clear()
        self._seen[session_id] = version

    async def apply(self, batch: Batch[Effect], *, lease: Lease | None = None) -> Session[Any]:
        """Append ``batch`` if the session is at ``batch.revision - 1``; all rows or none.

        Returns the session after the batch, as a load would give it.

        The effects are encoded once and decoded back (O(batch), never the
        history), then applied once, to the session this store last read or
        wrote, before anything is written, so nothing invalid is stored; that
        result is what is returned and kept. The
        write is one ``BEGIN IMMEDIATE`` transaction of constant statements:
        the compare-and-set (``UPDATE sessions ... WHERE sid = ? AND revision
        = ?``, which also moves the revision; its row count proves the session
        this store last read or wrote is the stored one, so nothing is read),
        the batch row holding its effects (one ``INSERT``), and a snapshot
        after a ``ReplaceConversation`` or when one is due (periodic
        snapshots, once the effects since the last one reach half its size,
        cost each apply, on average, about twice encoding its own effects),
        which prunes the one before it. Nothing else is read or re-encoded,
        whatever the history length. When this store has not read the session
        at ``batch.revision - 1`` (first use, or another writer moved it), the
        session row is read (and checked against its checksum) and the rows
        since the cached session are replayed first; a failed
        compare-and-set is diagnosed the same way, on that path only.

        With ``lease`` (fencing), the batch is written only while this store
        instance holds that lease of ``batch.session_id`` (same owner and
        epoch), checked in the worker thread just before the transaction; a
        release of the lease here waits for the transaction to end. That check
        is sound without reading the database: the lease is this instance's
        lock on the session's lock file, which no other claim can take while
        it is held, so no newer lease can exist.

        Raises:
            LeaseLostError: ``lease`` is not held by this store instance, or
                is a lease of another session; nothing is written.
            InvalidSessionIdError: ``batch.session_id`` is not safe.
            ConflictError: the session is at another revision; nothing is written.
            SessionNotFoundError: no session has this id.
            EffectError: an effect does not apply; nothing is written.
            ConfigurationError: an effect type is not registered in the codec.
            StoredDataError: a stored row the session is rebuilt from does not
                match its checksum or does not decode; nothing is written.

        Cancellation: see the class docstring; once in the worker thread the
        batch is committed whole or not at all, and the next load shows which.
        """
        session_id = batch.session_id
        if type(session_id) is not str or session_id not in self._valid_ids:
            validate_session_id(session_id)
            if len(self._valid_ids) >= _CACHE_SIZE:
                self._valid_ids.clear()
            self._valid_ids.add(session_id)
        prepared = self._core.prepare(batch, f"{self._path}: new batch for session {session_id!r}")
        cursor = self._cursor  # one cursor for every statement: none made per statement

        def write(connection: sqlite3.Connection) -> tuple[Cached[SessionRow], int]:
            with transaction(connection, write=True, cursor=cursor):
                self._hook("apply.begin")
                written = self._core.apply(SQLiteTxn(cursor, self._path), prepared)
                version = _data_version(cursor)
                self._hook("apply.inserted")
            return written, version

        def run(connection: sqlite3.Connection) -> Session[Any]:
            if lease is None:
                written, version = write(connection)
            else:
                with self._leases.fenced(lease, session_id):
                    written, version = write(connection)
            self._core.remember(session_id, written)
            self._saw(session_id, version)
            self._hook("apply.committed")
            return written.session

        return await self._run(run)

    async def list_sessions(self) -> list[str]:
        """The ids of all sessions, sorted.

        Raises:
            StoredDataError: a session row does not match its checksum (its id
                cannot be trusted; :meth:`scan_sessions` lists the others and
                marks it unreadable).
        """

        def run(connection: sqlite3.Connection) -> list[str]:
            with transaction(connection, write=False):
                return _rows.session_ids(connection, self._path)

        return await self._run(run)

    async def scan_sessions(self) -> list[ListedSession]:
        """Every session, sorted by id, each a :class:`ListedSession`; a session whose
        row does not match its checksum (or is otherwise damaged) is listed
        ``unreadable`` with the reason instead of failing the listing.

        This is the listing for showing a whole store (the inspector's ``sessions
        list``, ``fsck``, the web view); :meth:`list_sessions` stays strict.
        Only the ``sessions`` rows are checked: loading a session checks the rest.

        Raises:
            StoredDataError: the database itself cannot be read.
        """

        def run(connection: sqlite3.Connection) -> list[ListedSession]:
            with transaction(connection, write=False):
                return _rows.session_entries(connection, self._path)

        return await self._run(run)

    async def delete(self, session_id: str) -> None:
        """Delete a session with its log and snapshots, in one transaction.

        The media bytes its records named are deleted with it, in the same
        transaction, unless a record of another session (a fork, a session
        holding the same bytes) names them too: the last session deleted
        takes them.

        Then its pending-run mark is removed. A lease on it is not touched: the
        holder keeps it until it releases (its writes meet
        :class:`~stepmachine.SessionNotFoundError`), and a session created
        later with the same id has the same lock, its epochs continuing above
        the old ones.

        Raises:
            InvalidSessionIdError: the id is not safe.
            SessionNotFoundError: no session has this id.
            StoredDataError: the session's row does not match its checksum, so
                the rows that belong to it are not known; nothing is deleted.
        """
        validate_session_id(session_id)

        def run(connection: sqlite3.Connection) -> None:
            try:
                with transaction(connection, write=True):
                    named = session_digests(connection, session_id)
                    SQLiteTxn(connection, self._path).delete(session_id)
                    if named != set():  # it named blobs (None: unreadable, sweep anyway)
                        sweep_blobs(connection)
            finally:
                self._core.forget(session_id)
                self._seen.pop(session_id, None)

        await self._run(run)
        await self._leases.forget(session_id)

    async def load_at(self, session_id: str, revision: int) -> Session[Any]:
        """The session as it was at ``revision``: the nearest snapshot, then its log.

        Cost: a session keeps two snapshots, revision 0 and the newest (each
        new snapshot prunes the one before it, so the bytes on disk stay
        proportional to the log, whatever the history length). A revision at
        or after the newest snapshot replays at most ``SNAPSHOT_MAX_GAP``
        (1000) batches, like :meth:`load`; an earlier one (an audit or a
        rewind, not the hot path) replays the log from revision 0: ``revision``
        batches.

        Raises:
            InvalidSessionIdError: the id is not safe.
            SessionNotFoundError: no session has this id.
            ValueError: ``revision`` is negative or beyond the current one.
            StoredDataError: a stored row does not match its checksum, or a
                record does not decode or apply.
        """
        validate_session_id(session_id)

        def run(connection: sqlite3.Connection) -> Session[Any]:
            with transaction(connection, write=False):
                txn = SQLiteTxn(connection, self._path)
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

        def run(connection: sqlite3.Connection) -> list[Batch[Effect]]:
            with transaction(connection, write=False):
                return self._core.batches(SQLiteTxn(connection, self._path), session_id, after)

        return await self._run(run)

    async def fork(self, session_id: str, revision: int, new_session_id: str) -> Session[Any]:
        """Create ``new_session_id`` as a copy of ``session_id`` at ``revision``.

        The fork is at the same revision, with the same conversation and data,
        and carries the source's batches ``1..revision`` (so its audit log and
        :meth:`load_at` match the source's up to there). Batch and effect rows
        are checked against their checksums and copied under the new session
        with new ones, not decoded or re-encoded. One transaction.

        Returns:
            The new session (``id`` is ``new_session_id``).

        Raises:
            InvalidSessionIdError: either id is not safe.
            SessionNotFoundError: ``session_id`` does not exist.
            SessionExistsError: ``new_session_id`` is taken.
            ValueError: ``revision`` is negative or beyond the current one.
            StoredDataError: a row to copy does not match its checksum, or a
                record does not decode; nothing is written.

        Cancellation: see the class docstring; once in the worker thread the
        fork commits whole (and returns) or not at all (and raises).
        """
        validate_session_id(session_id)
        validate_session_id(new_session_id)

        def run(connection: sqlite3.Connection) -> Session[Any]:
            with transaction(connection, write=True):
                txn = SQLiteTxn(connection, self._path)
                source = txn.row(session_id)
                at = self._core.session_at(txn, session_id, revision)
                forked = msgspec.structs.replace(at, id=new_session_id)
                # The snapshots the source keeps: revision 0 and the fork point.
                first = self._core.session_at(txn, session_id, 0)
                first = msgspec.structs.replace(first, id=new_session_id)
                record, blobs = self._core.session_record(first)
                sid = self._core.create(txn, new_session_id, first, record, blobs).position.sid
                _rows.copy_log(connection, self._path, session_id, source.sid, sid, revision)
                record, blobs = self._core.session_record(forked)
                txn.put_blobs(blobs)  # held already (the rows copied refer to them): no bytes
                if revision > 0:
                    _rows.insert_snapshot(connection, sid, revision, record)
                row = SessionRow(sid, revision, revision, len(record), 0)
                _rows.write_session_row(connection, new_session_id, row)
            self._core.remember(new_session_id, Cached(forked, row, _rows.marks_of(row)))
            return forked

        return await self._run(run)

    async def backup(self, target: str | os.PathLike[str]) -> None:
        """Write a consistent copy of the whole database to ``target`` (``VACUUM INTO``).

        The copy holds every batch committed before the call, including those
        still only in the WAL, in a compact file of the same schema version
        that :meth:`open` reads; the rows keep their checksums. ``target`` is
        created owner-only (0o600). Other processes keep reading while the
        copy is written; their writes wait for it (``busy_timeout``).

        Raises:
            sqlite3.OperationalError: ``target`` exists and is not empty, or
                cannot be written.
            StoreClosedError: the store is closed.

        Cancellation: see the class docstring; once in the worker thread the
        copy is written to its end.
        """
        file = os.fspath(target)

        def run(connection: sqlite3.Connection) -> None:
            _schema.create_owner_only(file)
            connection.execute("VACUUM INTO ?", (file,))

        await self._run(run)

    async def aclose(self) -> None:
        """Release every lease this instance holds, and close the connection.

        Shielded from cancellation. Idempotent. Pending-run marks stay. Any
        later call but :meth:`aclose` raises :class:`~stepmachine.StoreClosedError`.
        """
        with anyio.CancelScope(shield=True):
            async with self._lock:
                connection, self._conn = self._conn, None
                self._core.clear()
                self._seen.clear()
                await self._leases.close()
                if connection is not None:
                    await run_in_thread(connection.close)

    def _open_leases(self) -> FlockLeases:
        self._check_open()
        return self._leases

    def _check_open(self) -> None:
        if self._conn is None:
            raise StoreClosedError(f"SQLiteStore on {self._path} is closed")

    async def _hop(self, work: Callable[[], T]) -> T:
        """Run ``work()`` as :meth:`_run` runs a transaction (the leases' file work)."""
        return await self._run(lambda connection: work())

    def _check_session(self, session_id: str) -> None:
        """Raise :class:`~stepmachine.SessionNotFoundError` unless the session exists
        (in the worker thread, inside :meth:`_hop`)."""
        connection = self._conn
        if connection is None:
            raise StoreClosedError(f"SQLiteStore on {self._path} is closed")
        with transaction(connection, write=False):
            SQLiteTxn(connection, self._path).row(session_id)

    async def __aenter__(self) -> SQLiteStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()
