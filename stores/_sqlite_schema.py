"""The on-disk layout of :class:`~stepmachine.stores.SQLiteStore`: schema, migrations, checksums.

Everything here is synchronous and runs in the store's worker thread, on a
connection the caller holds exclusively. Reading and writing rows is
:mod:`._sqlite_rows`.

Layout (schema version 5)::

    schema_version(version PK, applied_at)        one row per migration applied
    sessions(sid PK AUTOINCREMENT, session_id UNIQUE, revision, schema_version,
             snapshot_revision, snapshot_bytes, pending_bytes, crc)
    batches(sid, revision, step, cycle, timestamp, effect_count, schema_version,
            crc, refused, trace, body)                 WITHOUT ROWID, key (sid, revision)
    effects(sid, revision, position, schema_version, body, crc)
    snapshots(sid, revision, schema_version, body, crc)
    media(digest PK, body)                        made by the first write of media

``sid`` is never reused (``AUTOINCREMENT``), so a session deleted and created
again under the same id is a different ``sid``, and a cache keyed by ``sid``
never serves the old one. The log is append-only. A batch row of version 5
holds the batch's effects in ``body``: one JSON array whose items are the
codec's effects records, one per effect, each holding exactly that effect, in
order (``[[{...}],[{...}]]``; ``[]`` for none; ``effect_count`` says how many),
stored compressed with zlib (it then starts with ``0x78``) when it is at least
256 bytes and that makes it smaller, else as it is (starting with ``[``); it
has no effect rows. Appending a batch is then one row in one b-tree besides the
session row. A batch row of version 4 or older (written before) has ``body``
NULL, and its effects are in ``effects``, one row per effect: ``body`` is the
codec's effects record holding exactly that one effect. A version-3 or -4 effect
row stores it compressed the same way; a version-2 row always stores it as it
is: a version-2 effect row whose body is compressed is a corrupt row
(:class:`~stepmachine.StoredDataError` naming the session, revision and effect
index), and so is an effect row of version 5 or later, or one at the revision
of a version-5 batch row. A snapshot is
the codec's session record; there is always one at revision 0 (written by
``create``) and one after every batch holding a
:class:`~stepmachine.ReplaceConversation`. Periodic snapshots follow
:func:`._sqlite_rows.wants_snapshot`. Each snapshot written deletes the ones
it supersedes, so a session keeps two: revision 0 and the newest
(:func:`._sqlite_rows.prune_snapshots`). A snapshot ``body`` is the session
record compressed with zlib (it starts with ``0x78``); one starting with ``{``
is the uncompressed record, as written before, and is read as it is (in a
row of version 2 or 3: version 2 wrote both). The
session row keeps the revision and encoded (uncompressed) size of the last
snapshot and the effect bytes written since (``pending_bytes``).

Media bytes (images, documents, audio in messages) are not in the effect or
snapshot records: those hold a reference (``"media_ref"``, the digest and
size), and ``media`` holds the bytes once per SHA-256 digest, written in the
same transaction as the first record that refers to them
(:mod:`._media_blobs`). The table is made by the first write of media, with no
version change: code that does not know it never reads it, and refuses the
records that refer to it by their tag, so a database without media stays
readable by it. A ``media`` row has no ``crc``: every body read is checked
against its digest, which covers the row and the column that places it.

Row versions: every row carries the ``schema_version`` it was written with.
Rows are written with :data:`SCHEMA_VERSION`; rows of version 2 written before
a database was migrated to 3 keep their version and are read as they are
(:data:`ROW_VERSIONS`). A row of any other version fails closed when read.

Checksums (since schema version 2): every row of ``sessions``, ``batches``,
``effects`` and ``snapshots`` carries ``crc``, the CRC-32 computed by
:func:`checksum` over the table's name and every other column of the row, in
the order above: the payload (``body``, ``step``, ...) *and* the columns that
say where it belongs (``sid``, ``session_id``, ``revision``, ``position``) and
the row's ``schema_version``; a ``batches`` row of version 4 or later also
``refused`` and ``trace``, after ``schema_version``, and one of version 5 or
later ``body`` after them (:func:`row_columns`). A
flipped bit, or a row moved to another session, revision or position, no
longer matches its ``crc``; the reader then raises
:class:`~stepmachine.StoredDataError` naming the table, the session and the
revision instead of decoding it. CRC-32 detects every error burst of up to 32
bits, so every single flipped bit; it is computed in the same statement that
writes the row (no extra round trip). The checksums cover rows, not SQLite's
own pages and indexes: ``PRAGMA quick_check`` verifies those.

Versions and migrations. A database records each migration applied in
``schema_version``; its version is the largest. Opening a database of a
newer version than :data:`SCHEMA_VERSION` is refused with
:class:`~stepmachine.StoredDataError` before anything is written ("written by
stepmachine schema version N"), so code that does not know a version never
reads its rows. Opening one of an older version migrates it, in one ``BEGIN
IMMEDIATE`` transaction (applied whole or not at all; a process killed in the
middle leaves the old version), through each version in turn:

- 1 to 2: version 1 had no ``crc`` column; the migration adds the column and
  computes the checksum of every version-1 row as it is stored, marking the
  row version 2. This reads every row once. A row of any other version is
  left as it is, and reading it still fails closed.
- 2 to 3: changes no row; it only records version 3. Version 3 allows
  compressed effect bodies, which code of version 2 cannot read: the version
  bump makes that code refuse the whole database on open, untouched, instead
  of failing on the first compressed row it reads.
- 3 to 4: adds the nullable columns ``refused`` (the batch's refusals as
  compact JSON text ``[["step","why"],...]``, NULL when there are none) and
  ``trace`` (the W3C ``traceparent`` of the span that wrote the batch, or NULL)
  to ``batches`` (``ALTER TABLE ... ADD COLUMN``: no row is read or rewritten).
  The rows written before keep their version and checksum and read with both
  NULL (the batch's defaults); such a row holding either is damage. A
  version-4 row's ``crc`` covers both columns.
- 4 to 5: adds the nullable column ``body`` to ``batches`` (``ALTER TABLE ...
  ADD COLUMN``: no row is read or rewritten). Batches written from then on keep
  their effects in it (see above), the ones written before keep theirs in
  ``effects`` and are read as they are; a log may hold both, in any order. A
  version-4 (or older) batch row holding a ``body`` is damage. Code of
  version 4 refuses a version-5 database on open, untouched, instead of
  reading batch rows whose effects it would not find.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import struct
import time
import urllib.parse
import zlib
from types import TracebackType
from typing import Literal

from stepmachine import ConfigurationError, StoredDataError

from ._regular import describe_mode, open_regular

__all__ = [
    "COLUMNS",
    "COMPRESSED_EFFECTS_FROM",
    "INLINE_FROM",
    "ROW_VERSIONS",
    "SCHEMA_VERSION",
    "TRAIL_COLUMNS",
    "TRAIL_FROM",
    "checksum",
    "columns_at",
    "create_owner_only",
    "open_connection",
    "row_columns",
    "transaction",
]

SCHEMA_VERSION = 5
"""The schema version this code writes; it opens databases of this version or older."""

ROW_VERSIONS = (2, 3, 4, 5)
"""The row versions this code reads: every row of a migrated database is one of these."""

COMPRESSED_EFFECTS_FROM = 3
"""The first row version whose effect bodies may be compressed."""

TRAIL_FROM = 4
"""The first schema (and row) version whose ``batches`` rows hold ``refused`` and ``trace``."""

TRAIL_COLUMNS = ("refused", "trace")
"""The ``batches`` columns that schema version 4 added (the decision trail)."""

INLINE_FROM = 5
"""The first schema (and row) version whose ``batches`` rows hold their effects in ``body``
(no ``effects`` rows)."""

_COLUMNS_2: dict[str, tuple[str, ...]] = {
    "sessions": (
        "session_id",
        "sid",
        "revision",
        "schema_version",
        "snapshot_revision",
        "snapshot_bytes",
        "pending_bytes",
    ),
    "batches": ("sid", "revision", "step", "cycle", "timestamp", "effect_count", "schema_version"),
    "effects": ("sid", "revision", "position", "schema_version", "body"),
    "snapshots": ("sid", "revision", "schema_version", "body"),
}
"""The columns of each table from schema version 2 to 3, which a row's ``crc`` covers."""

_COLUMNS_4: dict[str, tuple[str, ...]] = {
    **_COLUMNS_2,
    "batches": (*_COLUMNS_2["batches"], *TRAIL_COLUMNS),
}
"""The columns of each table in schema version 4, which a row's ``crc`` covers."""

COLUMNS: dict[str, tuple[str, ...]] = {
    **_COLUMNS_4,
    "batches": (*_COLUMNS_4["batches"], "body"),
}
"""The columns each table's ``crc`` covers in a row of :data:`SCHEMA_VERSION`, in the
order :func:`checksum` takes them (a row of an older version: :func:`row_columns`)."""


def row_columns(table: str, version: int, trail_from: int = TRAIL_FROM) -> tuple[str, ...]:
    """The columns ``crc`` covers in a row of ``table`` written as row ``version``.

    A ``batches`` row older than ``trail_from`` (the version that added
    ``refused`` and ``trace``; PostgreSQL passes its own) leaves them out.
    """
    if table == "batches" and version < trail_from:
        return _COLUMNS_2[table]
    if table == "batches" and version < INLINE_FROM:
        return _COLUMNS_4[table]
    return COLUMNS[table]


def columns_at(version: int) -> dict[str, tuple[str, ...]]:
    """The columns (without ``crc``) of each table in a database of schema ``version`` >= 2."""
    return {table: row_columns(table, version) for table in COLUMNS}


_HEADER = b"SQLite format 3\x00"

_TEXT_COLUMNS = frozenset({"session_id", "step"})


def _migrated_column(column: str) -> str:
    """How migration 2 passes ``column`` to ``stepmachine_crc``.

    The row's new version is 2. Text goes as its bytes (Python's sqlite3 would
    refuse text that is not UTF-8 before the function runs);
    :func:`_sql_checksum` decodes it back the way the connection reads it.
    """
    if column == "schema_version":
        return "2"
    return f"CAST({column} AS BLOB)" if column in _TEXT_COLUMNS else column


_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        """CREATE TABLE schema_version (
            version INTEGER PRIMARY KEY,
            applied_at REAL NOT NULL
        )""",
        """CREATE TABLE sessions (
            sid INTEGER PRIMARY KEY AUTOINCREMENT,
            session_id TEXT NOT NULL UNIQUE,
            revision INTEGER NOT NULL,
            schema_version INTEGER NOT NULL,
            snapshot_revision INTEGER NOT NULL,
            snapshot_bytes INTEGER NOT NULL,
            pending_bytes INTEGER NOT NULL
        )""",
        """CREATE TABLE batches (
            sid INTEGER NOT NULL,
            revision INTEGER NOT NULL,
            step TEXT NOT NULL,
            cycle INTEGER NOT NULL,
            timestamp REAL NOT NULL,
            effect_count INTEGER NOT NULL,
            schema_version INTEGER NOT NULL,
            PRIMARY KEY (sid, revision)
        ) WITHOUT ROWID""",
        """CREATE TABLE effects (
            sid INTEGER NOT NULL,
            revision INTEGER NOT NULL,
            position INTEGER NOT NULL,
            schema_version INTEGER NOT NULL,
            body BLOB NOT NULL,
            PRIMARY KEY (sid, revision, position)
        ) WITHOUT ROWID""",
        # A rowid table: snapshot bodies are large, and SQLite keeps large rows of a
        # WITHOUT ROWID table in the key b-tree, which makes range lookups slow.
        """CREATE TABLE snapshots (
            sid INTEGER NOT NULL,
            revision INTEGER NOT NULL,
            schema_version INTEGER NOT NULL,
            body BLOB NOT NULL,
            PRIMARY KEY (sid, revision)
        )""",
    ),
    2: tuple(
        statement
        for table, columns in _COLUMNS_2.items()
        for statement in (
            f"ALTER TABLE {table} ADD COLUMN crc INTEGER",
            # Every column as stored, but the row's new version: 2.
            f"UPDATE {table} SET schema_version = 2, crc = stepmachine_crc('{table}', "  # noqa: S608 - fixed names
            + ", ".join(_migrated_column(c) for c in columns)
            + ") WHERE schema_version = 1",
        )
    ),
    # Nothing to change: version 3 only allows compressed effect bodies in new rows.
    3: (),
    # The decision trail; the rows written before keep NULL (the defaults).
    4: tuple(f"ALTER TABLE batches ADD COLUMN {column} TEXT" for column in TRAIL_COLUMNS),
    # A batch's effects in its own row; the rows written before keep NULL (their
    # effects stay in the effects table).
    5: ("ALTER TABLE batches ADD COLUMN body BLOB",),
}
"""The statements that bring a database from the previous version to each version.

Version 1 is the historical layout, kept as it was written: a new database
goes through every migration, so the migration path runs on every new file.
"""

_TAGS = {table: table.encode("ascii") + b"\x00" for table in COLUMNS}
_DOUBLE = struct.Struct("<d")


def checksum(table: str, values: tuple[object, ...]) -> int:
    """The CRC-32 of ``values`` (one row's :data:`COLUMNS` of ``table``), as stored in ``crc``.

    Each value is encoded with its SQLite type and, for text and blobs, its
    length, so no two different rows (or the same values in another column
    order or type) share an encoding. Text is encoded as UTF-8 with
    ``surrogateescape``, matching the connection's text factory, so text that
    was damaged into invalid UTF-8 gets the checksum of its stored bytes.
    The encodings are joined and checksummed at once (CRC-32 of the whole is
    the CRC-32 carried over the pieces).

    Raises:
        TypeError: a value is not an SQLite value (int, float, str, bytes or None).
    """
    parts = [_TAGS[table]]
    add = parts.append
    for value in values:
        kind = type(value)
        if kind is int:
            add(b"i%d;" % value)  # type: ignore[str-format]
        elif kind is bytes:
            add(b"b%d:" % len(value))  # type: ignore[arg-type]
            add(value)  # type: ignore[arg-type]
        elif kind is str:
            encoded = value.encode("utf-8", "surrogateescape")  # type: ignore[attr-defined]
            add(b"s%d:" % len(encoded))
            add(encoded)
        elif value is None:
            add(b"n")
        elif kind is float:
            add(b"f" + _DOUBLE.pack(value))
        else:
            add(_encoded(table, value))
    return zlib.crc32(b"".join(parts))


def _encoded(table: str, value: object) -> bytes:
    """How :func:`checksum` encodes a value of a type other than exactly int, bytes,
    str, None or float: a subclass of an SQLite value's type (a bool is an int)."""
    if isinstance(value, int):
        return b"i%d;" % value
    if isinstance(value, bytes):
        return b"b%d:" % len(value) + value
    if isinstance(value, str):
        encoded = value.encode("utf-8", "surrogateescape")
        return b"s%d:" % len(encoded) + encoded
    if isinstance(value, float):
        return b"f" + _DOUBLE.pack(value)
    raise TypeError(f"{table} row value {value!r} is not an SQLite value")


def _sql_checksum(table: str, *values: object) -> int:
    """:func:`checksum` as the SQL function ``stepmachine_crc(table, column, ...)`` of migration 2.

    Text columns arrive as bytes (see :func:`_migrated_column`) and are
    decoded as the connection's text factory decodes them.
    """
    decoded = tuple(
        _decode_text(value) if name in _TEXT_COLUMNS and isinstance(value, bytes) else value
        for name, value in zip(_COLUMNS_2[table], values, strict=True)
    )
    return checksum(table, decoded)


def _decode_text(raw: bytes) -> str:
    """The connection's text factory: UTF-8, keeping invalid bytes (the checksum catches them)."""
    return raw.decode("utf-8", "surrogateescape")


# -- opening -------------------------------------------------------------------


def open_connection(
    path: str,
    synchronous: Literal["NORMAL", "FULL"],
    busy_timeout: float,
    *,
    read_only: bool = False,
) -> sqlite3.Connection:
    """Open ``path``, refuse what is not ours, enable WAL and migrate to :data:`SCHEMA_VERSION`.

    With ``read_only`` nothing is written through the connection (see
    :func:`_open_read_only`): a missing file is :class:`FileNotFoundError`, a
    file of an older schema version (which a writable open would migrate) is
    :class:`StoredDataError`, and the journal mode is left as it is.

    Nothing is written to the file before its schema version has been checked,
    so a refused file keeps its exact bytes. A missing file is created
    owner-only (0o600) before SQLite opens it, so its ``-wal`` and ``-shm``
    files (which SQLite gives the database file's permissions) are owner-only
    too; an existing file keeps its permissions.

    Raises:
        StoredDataError: the file is not an SQLite database, is another
            application's database, or was written by a newer schema version;
            or something that is not a regular file is where SQLite keeps its
            ``-journal``, ``-wal`` or ``-shm`` file (:func:`_check_companions`).
        ConfigurationError: WAL could not be enabled (an in-memory database).
        sqlite3.OperationalError: the file cannot be opened at all.
    """
    _check_header(path)
    _check_companions(path)
    if read_only:
        return _open_read_only(path, busy_timeout)
    create_owner_only(path)
    conn = sqlite3.connect(
        path, timeout=busy_timeout, isolation_level=None, check_same_thread=False
    )
    conn.text_factory = _decode_text
    try:
        conn.execute(f"PRAGMA busy_timeout = {round(busy_timeout * 1000)}")
        if _stored_version(conn, path) < SCHEMA_VERSION:
            _enable_wal(conn, path)
            with transaction(conn, write=True):
                _migrate(conn, _stored_version(conn, path))
        else:
            _enable_wal(conn, path)
        conn.execute(f"PRAGMA synchronous = {synchronous}")
    except sqlite3.DatabaseError as exc:
        conn.close()
        if isinstance(exc, sqlite3.OperationalError):
            raise
        raise StoredDataError(f"{path} is not a readable SQLite database: {exc}") from exc
    except UnicodeDecodeError as exc:
        # A damaged schema whose error message is not UTF-8: sqlite3 fails decoding it.
        conn.close()
        raise StoredDataError(
            f"{path} is not a readable SQLite database: its schema is damaged ({exc})"
        ) from exc
    except BaseException:
        conn.close()
        raise
    return conn


def _refuse_older(version: int, path: str) -> None:
    if version == 0:
        raise StoredDataError(
            f"{path} holds no stepmachine store (an empty SQLite database: no tables); a "
            "read-only open creates none"
        )
    if version < SCHEMA_VERSION:
        raise StoredDataError(
            f"{path} is at stepmachine schema version {version}; this stepmachine reads "
            f"version {SCHEMA_VERSION} and a read-only open does not migrate: open it "
            "for writing once (SQLiteStore.open) to migrate it"
        )


def _on_read_only_media(path: str) -> bool:
    """Whether ``path`` sits in a folder nobody can write (a read-only mount) and holds
    every committed page itself (no ``-wal`` file with content beside it)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        wal = os.path.getsize(path + "-wal")
    except FileNotFoundError:
        wal = 0
    return wal == 0 and not os.access(folder, os.W_OK)


def _open_read_only(path: str, busy_timeout: float) -> sqlite3.Connection:
    """Open ``path`` to read only; see :func:`open_connection`.

    The connection is opened ``mode=rw`` (never created: a missing file is an
    error) with ``PRAGMA query_only``, so no statement can write, rather than
    ``mode=ro``. The reasons, from SQLite's documentation of WAL mode:

    - a WAL database needs its ``-wal`` and ``-shm`` files while it is open,
      and SQLite creates them even for a ``mode=ro`` reader;
    - when the last connection closes, SQLite checkpoints the ``-wal`` into the
      database and deletes both files, but only a connection that may write can
      do that: a ``mode=ro`` reader closing last left both behind, beside a
      store that had been closed cleanly. This connection removes them as a
      writer's close would, so reading leaves the folder as it found it;
    - ``immutable=1`` would need no files at all, but it tells SQLite that
      nobody changes the database: with a live writer (the web view reads a
      store a worker is writing) it would miss new commits and could read a
      page mid-checkpoint. Correctness with a live writer comes first, so it is
      used only where nobody can write (below).

    What the close can write: when this reader is the last connection and a
    ``-wal`` holds committed transactions (a writer closed while the reader was
    open, or crashed), the close copies them into the database file before
    deleting the ``-wal``, exactly as the next writer's open or close would.
    The data stays the same; the database file's bytes change. A read while a
    writer is live sees every transaction committed before it began (WAL
    readers never block writers, nor writers readers).

    A database file the process may not write (its permissions) is opened
    read-only by SQLite, as ``mode=ro`` would be: then the ``-wal`` and ``-shm``
    it creates stay (it cannot run the checkpoint). On read-only media (no folder write access, no
    ``-wal`` content), where SQLite cannot create the ``-shm`` at all, the file
    is opened ``immutable``: nothing can change it there.

    Raises:
        StoredDataError: see :func:`open_connection`; or the database cannot be
            read where it is (read-only media holding a ``-wal`` file).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no SQLite database at {path}")
    try:
        return _connect_read_only(path, busy_timeout, immutable=False)
    except sqlite3.OperationalError as exc:
        if _on_read_only_media(path):
            return _connect_read_only(path, busy_timeout, immutable=True)
        if "unable to open" not in str(exc):
            raise
        raise StoredDataError(
            f"cannot read {path} ({exc}): SQLite needs to create or write its "
            f"{os.path.basename(path)}-shm file beside it even to read; on read-only media "
            "copy the database (with its -wal file) somewhere writable"
        ) from exc


def _connect_read_only(path: str, busy_timeout: float, *, immutable: bool) -> sqlite3.Connection:
    """A connection to ``path`` that writes nothing: ``mode=rw`` with ``query_only`` (see
    :func:`_open_read_only` for why not ``mode=ro``), or ``mode=ro&immutable=1``."""
    query = "?mode=ro&immutable=1" if immutable else "?mode=rw"
    uri = "file:" + urllib.parse.quote(os.path.abspath(path)) + query
    conn = sqlite3.connect(
        uri, uri=True, timeout=busy_timeout, isolation_level=None, check_same_thread=False
    )
    conn.text_factory = _decode_text
    try:
        conn.execute("PRAGMA query_only = ON")  # before anything is read: no statement writes
        conn.execute(f"PRAGMA busy_timeout = {round(busy_timeout * 1000)}")
        _refuse_older(_stored_version(conn, path), path)
    except sqlite3.DatabaseError as exc:
        conn.close()
        if isinstance(exc, sqlite3.OperationalError):
            raise
        raise StoredDataError(f"{path} is not a readable SQLite database: {exc}") from exc
    except BaseException:
        conn.close()
        raise
    return conn


def create_owner_only(path: str) -> None:
    """Create ``path`` empty and 0o600 (whatever the umask) if it does not exist.

    An existing file (or anything else at ``path``) is left alone; other
    failures are left for SQLite to report when it opens the path.
    """
    if path in ("", ":memory:"):
        return  # SQLite's temporary and in-memory databases: no file
    # O_CLOEXEC, O_NOFOLLOW and fchmod are POSIX; on Windows the file is created
    # with the mode os.open can give there (the store still works).
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    flags |= getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:
        return
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _check_header(path: str) -> None:
    """Refuse what is not an SQLite database (or missing) at ``path``, reading its header.

    The file is opened without blocking and must be a regular file: a FIFO
    there would block a plain ``open()`` (and SQLite's) until some process
    wrote to it. A symbolic link is followed (a database may be linked in).

    Raises:
        StoredDataError: a directory, a FIFO, a device or a socket is there,
            or a file that is not an SQLite database.
    """
    try:
        fd = open_regular(path, os.O_RDONLY, "the SQLite store's database", follow=True)
    except FileNotFoundError:
        return
    except StoredDataError as exc:
        if "a directory" in str(exc):
            raise StoredDataError(f"{path} is a directory, not an SQLite database") from None
        raise
    try:
        header = os.read(fd, len(_HEADER))
    finally:
        os.close(fd)
    if header and header != _HEADER:
        raise StoredDataError(
            f"{path} is not an SQLite database (it starts with {header!r}); "
            "SQLiteStore opens only its own database files and left it unchanged"
        )


COMPANIONS = (
    ("-journal", "rollback journal"),
    ("-wal", "write-ahead log"),
    ("-shm", "shared-memory index"),
)
"""The files SQLite keeps beside a database ``<db>``: ``<db>-journal``, ``-wal``, ``-shm``."""


def _check_companions(path: str) -> None:
    """Refuse a FIFO, a folder, a device, a socket or a symbolic link where SQLite
    keeps a file beside the database at ``path`` (see :data:`COMPANIONS`).

    SQLite opens those files with a plain ``open()``, which blocks on a FIFO
    (its check for a hot journal opens ``-journal`` whenever one exists), and a
    link there would send its writes elsewhere; SQLite itself only ever makes
    regular files there. Each name is looked at with ``lstat`` (which never
    opens, so never blocks), beside the path as given and beside the file a
    symbolic link leads to (SQLite names its files after the resolved path).
    Missing or regular: nothing to say.

    The check runs just before SQLite opens the database: something made at
    one of these names between the two is not seen. That window is accepted: it
    needs a process racing the open on purpose, and the files are the store's.

    Raises:
        StoredDataError: naming the file, what it is, and that it should be
            removed; nothing was opened or changed.
    """
    if path in ("", ":memory:"):
        return
    bases = dict.fromkeys((path, os.path.realpath(path)))
    for base in bases:
        for suffix, role in COMPANIONS:
            companion = base + suffix
            try:
                mode = os.lstat(companion).st_mode
            except (FileNotFoundError, NotADirectoryError):
                continue
            if stat.S_ISREG(mode):
                continue
            raise StoredDataError(
                f"{companion}, where SQLite keeps the {role} of the database {path}, is "
                f"{describe_mode(mode)}, not a regular file: SQLite would block on it or "
                "write through it, so the database was not opened and nothing was changed; "
                "remove it (SQLite makes its own file there when it needs one) and open the "
                "store again"
            )


def _stored_version(conn: sqlite3.Connection, path: str) -> int:
    """The schema version of ``path``, read in one read transaction (or the caller's).

    The version table is checked against the tables themselves: schema
    version 2 added ``crc`` to every table, so a version table that says 1
    where the tables have ``crc`` (a damaged or deleted version row; migrating
    again would fail half-way), or 2 where they do not, is damage.

    Raises:
        StoredDataError: another application's database, a newer version, or
            a version table that does not match the tables.
    """
    if conn.in_transaction:
        return _read_version(conn, path)
    with transaction(conn, write=False):  # one snapshot: a concurrent migration is all or nothing
        return _read_version(conn, path)


def _read_version(conn: sqlite3.Connection, path: str) -> int:
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "schema_version" not in tables:
        foreign = sorted(tables - {"sqlite_sequence"})
        if foreign:
            raise StoredDataError(
                f"{path} is an SQLite database but not a stepmachine store: it has tables "
                f"{foreign!r} and no schema_version table; it was left unchanged"
            )
        return 0
    (version,) = conn.execute("SELECT max(version) FROM schema_version").fetchone()
    if not isinstance(version, int) or version < 1:
        raise StoredDataError(f"{path} has a malformed schema_version table (max {version!r})")
    if version > SCHEMA_VERSION:
        raise StoredDataError(
            f"{path} was written by stepmachine schema version {version}; this version of "
            f"stepmachine reads schema versions up to {SCHEMA_VERSION}. Upgrade stepmachine "
            "to open it; the file was left unchanged"
        )
    for table, names in columns_at(max(version, 2)).items():
        columns = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        expected = {*names, "crc"} if version >= 2 else set(names)  # version 2 added crc
        if columns != expected:
            found = f"has columns {sorted(columns)!r}" if columns else "is missing"
            raise StoredDataError(
                f"{path}: its schema_version table says version {version}, but table {table!r} "
                f"{found}, not {sorted(expected)!r} (schema version 2 added a crc column "
                "to every table, version 4 refused and trace to batches, version 5 body to "
                "batches): the "
                "schema_version table or the schema is damaged; the file was left unchanged"
            )
    return version


def _enable_wal(conn: sqlite3.Connection, path: str) -> None:
    (mode,) = conn.execute("PRAGMA journal_mode = WAL").fetchone()
    if str(mode).lower() != "wal":
        raise ConfigurationError(f"SQLiteStore needs WAL, but {path} runs journal_mode={mode}")


def _migrate(conn: sqlite3.Connection, version: int) -> None:
    conn.create_function("stepmachine_crc", -1, _sql_checksum, deterministic=True)
    for target in range(version + 1, SCHEMA_VERSION + 1):
        for statement in _MIGRATIONS[target]:
            conn.execute(statement)
        conn.execute(
            "INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", (target, time.time())
        )


class transaction:  # noqa: N801 - used as a function, like contextlib's
    """One transaction: ``BEGIN IMMEDIATE`` to write, ``BEGIN`` (a read snapshot) to read.

    ``with transaction(conn, write=...):`` commits when the block ends
    normally; rolls back on any exception, including a failed ``COMMIT``, so
    no transaction is ever left open. (A class rather than a generator: it is
    entered on every call of the store.) ``cursor``: a cursor of ``conn`` to
    run ``BEGIN`` and ``COMMIT`` on (the apply path keeps one), else a new one each.
    """

    __slots__ = ("_begin", "_conn", "_run")

    def __init__(
        self, conn: sqlite3.Connection, *, write: bool, cursor: sqlite3.Cursor | None = None
    ) -> None:
        self._conn = conn
        self._run = conn.execute if cursor is None else cursor.execute
        self._begin = "BEGIN IMMEDIATE" if write else "BEGIN"

    def __enter__(self) -> None:
        self._run(self._begin)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self._rollback()
            return
        try:
            self._run("COMMIT")
        except BaseException:
            self._rollback()
            raise

    def _rollback(self) -> None:
        # Also when COMMIT itself fails (SQLITE_BUSY, an IO error): SQLite may leave
        # the transaction open, which would lock every later call and other processes.
        if self._conn.in_transaction:
            self._conn.execute("ROLLBACK")
