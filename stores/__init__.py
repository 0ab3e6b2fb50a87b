"""Stores: where sessions and their effect logs live.

Every store implements :class:`stepmachine.SessionLoader` and
:class:`stepmachine.EffectHandler` (compare-and-set, atomic batches) and the
management API of :class:`stepmachine.Store`, and passes the store
conformance suite in :mod:`stepmachine.testing.conformance`.

- :class:`MemoryStore`: in process, for tests and short-lived agents.
- :class:`SQLiteStore`: the embedded default; one database file, WAL.
- :class:`FileStore`: one append-only log file per session in a folder.
- :class:`PostgresStore`: a PostgreSQL database shared by many processes and
  machines (extra ``postgres``; psycopg is imported by its ``open``, so this
  package imports without it).

Each shipped store also lists its sessions with ``scan_sessions()``: every
session as a :class:`ListedSession`, one whose stored row is damaged marked
``unreadable`` with the reason, where the strict ``list_sessions()`` raises
:class:`~stepmachine.StoredDataError` (tools that show a whole store use it).

The durable stores share one log-and-snapshot core (``_core``: cache, replay,
compare-and-set, snapshot policy, errors) over byte backends that implement a
small protocol (``_backend``), so a new durable store is a backend, not a copy.

Supported platforms: this package imports on every OS Python runs on.
:class:`MemoryStore` works everywhere. :class:`SQLiteStore` works wherever
Python's ``sqlite3`` does (Linux, macOS, the BSDs, Windows). :class:`FileStore`
needs POSIX file locks (``fcntl.flock``) on a local filesystem: Linux, macOS
and the BSDs; elsewhere (Windows) :meth:`FileStore.open` raises
:class:`~stepmachine.ConfigurationError` naming the platform.
"""

from stepmachine._public import publish as _publish

from ._file import FileStore
from ._ids import MAX_SESSION_ID_LENGTH, validate_session_id
from ._listing import ListedSession
from ._memory import MemoryStore
from ._postgres import PostgresStore
from ._sqlite import SQLiteStore

__all__ = [
    "MAX_SESSION_ID_LENGTH",
    "FileStore",
    "ListedSession",
    "MemoryStore",
    "PostgresStore",
    "SQLiteStore",
    "validate_session_id",
]

_publish(__name__, globals())
