"""Naming a store by URL, and opening it for the inspector.

One function, :func:`open_store`, turns a URL into an open shipped store:

- ``sqlite:///agent.sqlite3`` (a relative path), ``sqlite:////abs/agent.sqlite3``
  (an absolute one: SQLAlchemy's convention, one slash more than the path);
- ``file:///abs/folder`` or ``file:relative/folder``: a :class:`FileStore` folder;
- ``postgresql://user@host/db`` (or ``postgres://``): a :class:`PostgresStore`;
- ``memory:`` is refused: an in-memory store lives in one process and
  another process cannot see it.

A store opened to read (``write=False``) is never created or changed: a
missing SQLite file or store folder is a :class:`StoreNotFoundError`; SQLite
is opened so that no statement writes (``query_only``, no migration, and no
``-wal``/``-shm`` left behind); a PostgreSQL schema is
neither created nor migrated; the file store's reads take shared locks and
write nothing.

The codec decides which stored data can be read. Without one, the
inspector's codec reads sessions that keep no application data and only the
kernel's effects, and refuses any other session with a
:class:`~stepmachine.StoredDataError` (instead of dropping fields it does not
know, which a write would then lose). ``--codec module:attribute`` names the
application's own codec; that imports the named module, which is the one
place the inspector runs application code, and only when asked.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import urllib.parse
from typing import Any, Final

import anyio

from stepmachine import Codec, ConfigurationError, NoData, StepmachineError
from stepmachine.stores import FileStore, PostgresStore, SQLiteStore

__all__ = [
    "StoreNotFoundError",
    "UsageError",
    "inspection_codec",
    "list_entries",
    "load_codec",
    "load_object",
    "open_store",
]

SCHEMES = "sqlite:///PATH, file:///FOLDER, postgresql://..."


class UsageError(StepmachineError, ValueError):
    """A store URL or an option the inspector cannot use; nothing was opened."""


class StoreNotFoundError(StepmachineError, FileNotFoundError):
    """The URL names a store that does not exist (the inspector creates none to read)."""


class _StrictNoData(NoData, frozen=True, forbid_unknown_fields=True):
    """``NoData`` that refuses stored fields instead of dropping them."""


def inspection_codec() -> Codec[Any]:
    """The codec used without ``--codec``: kernel effects, and no application data.

    A session whose data has fields, or whose log holds an effect of the
    application's, does not decode with it (:class:`~stepmachine.StoredDataError`
    naming the record): the inspector never shows or writes a session it
    read partly.
    """
    return Codec(_StrictNoData)


def load_object(spec: str, option: str) -> Any:
    """The object ``module:attribute`` names, imported (the cwd is on the import path).

    Raises:
        UsageError: the spec is malformed, the module or the attribute is
            missing, or importing the module raised; the message names ``option``.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise UsageError(f"{option} takes module:attribute (like myapp.agent:codec), not {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        value: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"{option} {spec}: cannot import {module_name!r}: {exc}") from exc
    except Exception as exc:  # the application's module failed while it was imported
        raise UsageError(
            f"{option} {spec}: importing {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    for name in attribute.split("."):
        try:
            value = getattr(value, name)
        except AttributeError:
            raise UsageError(f"{option} {spec}: {module_name} has no {attribute!r}") from None
    return value


def load_codec(spec: str) -> Codec[Any]:
    """The :class:`~stepmachine.Codec` named ``module:attribute`` (see :func:`load_object`).

    The attribute may be a codec or a function of no arguments returning one.

    Raises:
        UsageError: see :func:`load_object`; or it is not a codec, or calling
            it raised (a function that needs arguments, say).
    """
    value = load_object(spec, "--codec")
    if callable(value) and not isinstance(value, Codec):
        try:
            value = value()
        except Exception as exc:  # not a function of no arguments, or it failed
            raise UsageError(
                f"--codec {spec} is neither a Codec nor a function of no arguments returning "
                f"one: calling it raised {type(exc).__name__}: {exc}"
            ) from exc
    if not isinstance(value, Codec):
        raise UsageError(f"--codec {spec} is a {type(value).__name__}, not a stepmachine Codec")
    return value


async def list_entries(store: Any) -> list[tuple[str, str | None]]:
    """Every session of ``store``: ``(id, None)``, or ``(id, why)`` for one whose stored
    row is damaged, sorted by id.

    Uses the store's ``scan_sessions()`` (the shipped stores have it), which lists
    a damaged session as unreadable instead of failing the whole listing; a
    store without it is listed with ``list_sessions()``. Either way, loading a
    listed session may still find it unreadable.
    """
    scan = getattr(store, "scan_sessions", None)
    if scan is None:
        return [(session_id, None) for session_id in await store.list_sessions()]
    return [(entry.id, entry.unreadable) for entry in await scan()]


def _path_of(url: str, scheme: str) -> str:
    rest = url[len(scheme) + 1 :]
    if rest.startswith("//"):
        parsed = urllib.parse.urlsplit(url)
        if parsed.netloc not in ("", "localhost"):
            raise UsageError(f"{url!r} names a host; a {scheme} store is a local path")
        rest = parsed.path
        if scheme == "sqlite":
            rest = rest[1:]  # sqlite:///relative, sqlite:////absolute
    path = urllib.parse.unquote(rest)
    if not path:
        raise UsageError(f"{url!r} names no path")
    return path


CONNECT_TIMEOUT: Final = 10
"""Seconds to wait for a PostgreSQL server before saying it cannot be reached."""


def _reach_postgres(url: str) -> None:
    """Connect once (``connect_timeout``), so an unreachable server or a refused login is
    said at once, in libpq's words, instead of after the pool's timeout.

    Raises:
        ConnectionError: the server cannot be reached or refused the connection.
    """
    try:
        import psycopg  # noqa: PLC0415 - the postgres extra; PostgresStore.open says so
    except ImportError:
        return
    try:
        psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT, autocommit=True).close()
    except psycopg.Error as exc:
        said = str(exc)
        secret = re.search(r"://[^/@:]*:([^@/]+)@", url)
        if secret is not None:  # libpq may quote the URL, password and all (no secret escapes)
            said = said.replace(secret.group(1), "***")
        raise ConnectionError(f"cannot connect to the PostgreSQL store: {said}") from None


async def open_store(url: str, *, codec: Codec[Any] | None = None, write: bool = False) -> Any:
    """Open the store ``url`` names (see the module docstring for the forms).

    Args:
        url: the store URL.
        codec: the application's codec; :func:`inspection_codec` by default.
        write: open it for writing (approve, deny, fork, ...); otherwise it is
            opened so that nothing can be written.

    Returns:
        The open store (close it with ``aclose()``).

    Raises:
        UsageError: an unknown scheme, ``memory:``, or a malformed URL.
        StoreNotFoundError: no database file or store folder there.
        ConnectionError: the PostgreSQL server cannot be reached, or refused us.
        StoredDataError: the file is not a stepmachine store, or was written
            by a newer schema version.

    Cancellation: as the store's own ``open``: an open that started runs to its
    end and the cancellation arrives at the next checkpoint, so close what you
    got (``async with``).
    """
    if not isinstance(url, str) or not url.strip():
        raise UsageError(f"no store given: pass --store URL or set STEPMACHINE_STORE ({SCHEMES})")
    codec = codec or inspection_codec()
    scheme, colon, _ = url.partition(":")
    scheme = scheme.lower() if colon else ""
    if scheme == "memory":
        raise UsageError(
            "memory: names an in-memory store, which lives inside one process: the "
            f"inspector cannot see it; use a durable store ({SCHEMES})"
        )
    if scheme == "sqlite":
        path = _path_of(url, "sqlite")
        there = anyio.Path(path)
        if not await there.exists() or await there.is_dir():  # a FIFO, say: the store refuses it
            where = "is a folder" if await there.is_dir() else "does not exist"
            raise StoreNotFoundError(f"no SQLite store at {path!r}: it {where}")
        return await SQLiteStore.open(path, codec, read_only=not write)
    if scheme == "file":
        path = _path_of(url, "file")
        if not await anyio.Path(path).is_dir():
            raise StoreNotFoundError(f"no file store at {path!r}: no such folder")
        return await FileStore.open(path, codec)
    if scheme in ("postgresql", "postgres"):
        try:
            await anyio.to_thread.run_sync(_reach_postgres, url)
            return await PostgresStore.open(url, codec, read_only=not write)
        except ConfigurationError:
            raise
        except ImportError as exc:  # the extra is missing
            raise UsageError(f"{exc}") from exc
    raise UsageError(f"cannot tell which store {url!r} names; use one of {SCHEMES}")
