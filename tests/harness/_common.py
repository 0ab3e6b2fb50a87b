"""Shared helpers of the crash and concurrency harnesses (not a test module).

- :func:`store_class` / :func:`boundaries_of` / :func:`open_store`: which store a
  ``--store`` argument names (``sqlite``, ``file``, ``postgres``, or ``module:Class`` /
  ``path/to/file.py:Class`` for any third-party store with the same ``open``),
  its persistence boundaries, and opening it with an optional boundary hook.
- :func:`store_server`: what a store needs around a whole harness run: for
  ``postgres``, a server (``_postgres.postgres_server``: ``$STEPMACHINE_TEST_POSTGRES``
  or a throwaway one), exported in that variable so every child uses it too. Each
  scratch folder then names its own database on it (created on first open,
  dropped when the run ends), so every crash point starts from an empty one.
- :class:`AckLog` / :func:`read_records`: the out-of-band record of what a child
  process was told, appended one JSON line at a time with flush + fsync, read
  back ignoring a torn last line (the child may die mid-write).
- :func:`digest`: sha256 of a batch as the codec encodes it.
- :class:`JsonlStore` and its deliberately broken variants :class:`LosingStore`,
  :class:`SplittingStore` and :class:`UnlockedStore`: a tiny durable store the
  test suite points the harnesses at (``--store tests/harness/_common.py:LosingStore``)
  to prove that they do report lost, half-applied and lost-update batches.

The harness scripts load this file by path (see ``load_common`` in each), so
they work both as scripts and when a test imports them with importlib.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import anyio.to_thread
import msgspec

from stepmachine import (
    Codec,
    ConflictError,
    Effect,
    Message,
    Session,
    SessionExistsError,
    SessionNotFoundError,
)
from stepmachine.extend import Batch, Refusal, apply_batch

__all__ = [
    "KNOWN_BOUNDARIES",
    "AckLog",
    "JsonlStore",
    "LosingStore",
    "SplittingStore",
    "UnlockedStore",
    "boundaries_of",
    "digest",
    "open_store",
    "read_records",
    "store_class",
    "store_location",
    "store_server",
]

KNOWN_BOUNDARIES: dict[str, tuple[str, ...]] = {
    "sqlite": ("apply.begin", "apply.inserted", "apply.committed", "create.committed"),
    "file": (
        "apply.locked",
        "apply.written",
        "apply.synced",
        "snapshot.written",
        "snapshot.replaced",
        "create.synced",
    ),
}
"""The boundaries the shipped stores document, used when a class does not list its own."""

Hook = Callable[..., None]


def store_class(spec: str) -> type[Any]:
    """The store class a ``--store`` argument names.

    ``sqlite`` and ``file`` are the shipped stores; ``pkg.module:Class`` or
    ``path/to/file.py:Class`` name any other store with the same ``open``.
    """
    if spec == "sqlite":
        from stepmachine.stores import SQLiteStore

        return SQLiteStore
    if spec == "file":
        from stepmachine.stores import FileStore

        return FileStore
    if spec == "postgres":
        from stepmachine.stores import PostgresStore

        return PostgresStore
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"--store must be sqlite, file, postgres or module:Class, got {spec!r}")
    if module_name.endswith(".py"):
        path = Path(module_name).resolve()
        name = f"_harness_store_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
        module = sys.modules.get(name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(name, path)
            if loader_spec is None or loader_spec.loader is None:
                raise SystemExit(f"cannot load a store from {path}")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[name] = module
            loader_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    cls: type[Any] = getattr(module, attr)
    return cls


def boundaries_of(spec: str) -> tuple[str, ...]:
    """The persistence boundaries of the store ``spec`` names, in the order it lists them."""
    cls = store_class(spec)
    names = getattr(cls, "BOUNDARIES", None)
    if names is None:
        names = getattr(sys.modules.get(cls.__module__), "BOUNDARIES", None)
    if names is None:
        names = KNOWN_BOUNDARIES.get(spec)
    if not names:
        raise SystemExit(f"store {spec!r} lists no BOUNDARIES; the crash harness needs them")
    return tuple(names)


def store_location(spec: str, folder: Path) -> Path | str:
    """Where, inside a scratch ``folder``, the store lives: a database file or a folder;
    for ``postgres``, the DSN of the folder's own database (see :func:`store_server`)."""
    if spec == "postgres":
        return _postgres_location(folder)
    return folder / ("store.db" if spec == "sqlite" else "store")


_RUN_VAR = "STEPMACHINE_HARNESS_RUN"
"""The environment variable naming a harness run: its databases share this prefix."""


def _database_prefix() -> str:
    return f"stepmachine_harness_{os.environ.get(_RUN_VAR, 'adhoc')}_"


def _postgres_location(folder: Path) -> str:
    """The DSN of the database of ``folder`` on the run's server, created if missing."""
    import _postgres  # beside this file
    import psycopg
    from psycopg import errors, sql

    server = os.environ.get(_postgres.ENV_VAR)
    if not server:
        raise SystemExit(f"--store postgres: run it from a harness, or set {_postgres.ENV_VAR}")
    name = _database_prefix() + hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:12]
    with psycopg.connect(server, autocommit=True) as admin:
        exists = admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if exists is None:
            with contextlib.suppress(errors.DuplicateDatabase, errors.UniqueViolation):
                admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return _postgres.with_database(server, name)


@contextlib.contextmanager
def store_server(spec: str) -> Iterator[None]:
    """Around a whole harness run: for ``postgres``, a server every process uses.

    The server's DSN and a run id are exported in the environment (children
    inherit them); on exit the run's databases are dropped and the
    environment restored. Other stores need nothing.
    """
    if spec != "postgres":
        yield
        return
    import _postgres  # beside this file
    import psycopg
    from psycopg import sql

    saved = {name: os.environ.get(name) for name in (_postgres.ENV_VAR, _RUN_VAR)}
    with _postgres.postgres_server() as server:
        os.environ[_postgres.ENV_VAR] = server
        os.environ[_RUN_VAR] = uuid.uuid4().hex[:8]
        prefix = _database_prefix()
        try:
            yield
        finally:
            with psycopg.connect(server, autocommit=True) as admin:
                names = admin.execute(
                    "SELECT datname FROM pg_database WHERE starts_with(datname, %s)", (prefix,)
                ).fetchall()
                for (name,) in names:
                    admin.execute(
                        sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                            sql.Identifier(name)
                        )
                    )
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


async def open_store(
    spec: str,
    folder: Path,
    codec: Codec[Any],
    *,
    hook: Hook | None = None,
    snapshot_every: int | None = None,
) -> Any:
    """Open the store ``spec`` names in ``folder``, with ``boundary_hook=hook`` when given.

    ``snapshot_every`` is passed only to stores whose ``open`` accepts it.
    """
    cls = store_class(spec)
    kwargs: dict[str, Any] = {}
    if hook is not None:
        kwargs["boundary_hook"] = hook
    if snapshot_every is not None:
        parameters: Mapping[str, inspect.Parameter]
        try:
            parameters = inspect.signature(cls.open).parameters
        except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
            parameters = {}
        accepts_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        if "snapshot_every" in parameters or accepts_any:
            kwargs["snapshot_every"] = snapshot_every
    return await cls.open(store_location(spec, folder), codec, **kwargs)


def digest(codec: Codec[Any], batch: Batch[Effect]) -> str:
    """sha256 (hex) of ``codec.encode_batch(batch)``."""
    return hashlib.sha256(codec.encode_batch(batch)).hexdigest()


class AckLog:
    """Append-only JSON lines, each flushed and fsynced before :meth:`write` returns."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("ab")

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` durably."""
        self._file.write(json.dumps(record, sort_keys=True).encode() + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every whole record of an :class:`AckLog`; a torn or missing last line is skipped."""
    if not path.exists():
        return []
    records: list[dict[str, Any]] = []
    data = path.read_bytes()
    lines = data.split(b"\n")
    for index, line in enumerate(lines):
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if index == len(lines) - 1:
                break  # the writer died mid-line: that record was never acknowledged
            raise
    return records


# -- a tiny store, correct and deliberately broken, for testing the harnesses ------------


class JsonlStore:
    """One JSON-lines file per session: the session, then one line per batch (fsynced).

    Correct, if slow: apply holds an exclusive ``flock`` on the session file
    for its compare-and-set. The subclasses break it on purpose.
    """

    BOUNDARIES: ClassVar[tuple[str, ...]] = ("create.written", "apply.locked", "apply.written")
    LOSE: ClassVar[bool] = False
    """Keep odd revisions in memory until the next apply: acknowledged, lost by a crash."""
    SPLIT: ClassVar[bool] = False
    """Write each effect as its own line: a crash in between leaves half a batch."""
    UNLOCKED: ClassVar[bool] = False
    """Skip the lock: concurrent compare-and-sets race and updates are lost."""

    def __init__(self, folder: Path, codec: Codec[Any], hook: Hook | None) -> None:
        self.folder = folder
        self._codec = codec
        self._hook: Hook = hook or (lambda name: None)
        self._pending: dict[str, list[bytes]] = {}

    @classmethod
    async def open(
        cls, folder: Path, codec: Codec[Any] | None = None, *, boundary_hook: Hook | None = None
    ) -> JsonlStore:
        """Open (creating) the store folder."""
        await anyio.to_thread.run_sync(lambda: Path(folder).mkdir(parents=True, exist_ok=True))
        return cls(Path(folder), codec or Codec(), boundary_hook)

    @property
    def codec(self) -> Codec[Any]:
        return self._codec

    async def __aenter__(self) -> JsonlStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Nothing to release."""

    def _path(self, session_id: str) -> Path:
        return self.folder / f"{session_id}.jsonl"

    def _read(self, session_id: str) -> tuple[Session[Any], list[Batch[Effect]]]:
        try:
            data = self._path(session_id).read_bytes()
        except FileNotFoundError:
            raise SessionNotFoundError(session_id) from None
        whole = data.split(b"\n")[:-1]  # a torn last line is ignored
        lines = [*whole, *(line.rstrip(b"\n") for line in self._pending.get(session_id, []))]
        session = self._codec.decode_session(lines[0])
        if not self.SPLIT:
            return session, [self._codec.decode_batch(line) for line in lines[1:]]
        groups: dict[int, list[Effect]] = {}
        heads: dict[int, dict[str, Any]] = {}
        for line in lines[1:]:
            record = msgspec.json.decode(line)
            effects = self._codec.decode_effects(msgspec.json.encode([record["effect"]]))
            groups.setdefault(record["rev"], []).extend(effects)
            heads[record["rev"]] = record
        batches: list[Batch[Effect]] = [
            Batch(
                session_id=session_id,
                revision=rev,
                step=heads[rev]["step"],
                cycle=heads[rev]["cycle"],
                timestamp=heads[rev]["timestamp"],
                effects=tuple(groups[rev]),
                refused=tuple(Refusal(step, why) for step, why in heads[rev]["refused"]),
                trace=heads[rev]["trace"],
            )
            for rev in sorted(groups)
        ]
        return session, batches

    async def create(
        self,
        session_id: str,
        data: msgspec.Struct | None = None,
        conversation: Sequence[Message] = (),
    ) -> Session[Any]:
        def work() -> Session[Any]:
            session = self._codec.new_session(session_id, data, conversation)
            try:
                fd = os.open(self._path(session_id), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                raise SessionExistsError(session_id) from None
            try:
                os.write(fd, self._codec.encode_session(session) + b"\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            self._hook("create.written")
            return session

        return await anyio.to_thread.run_sync(work)

    async def load(self, session_id: str) -> Session[Any]:
        session, batches = await anyio.to_thread.run_sync(self._read, session_id)
        for b in batches:
            session = apply_batch(session, b.effects)
        return session

    async def load_at(self, session_id: str, revision: int) -> Session[Any]:
        session, batches = await anyio.to_thread.run_sync(self._read, session_id)
        if not 0 <= revision <= len(batches):
            raise ValueError(f"session {session_id!r} has no revision {revision}")
        for b in batches[:revision]:
            session = apply_batch(session, b.effects)
        return session

    async def batches(self, session_id: str, after: int = 0) -> list[Batch[Effect]]:
        _, batches = await anyio.to_thread.run_sync(self._read, session_id)
        return batches[after:]

    async def list_sessions(self) -> list[str]:
        return sorted(p.stem for p in self.folder.glob("*.jsonl"))

    async def delete(self, session_id: str) -> None:
        self._path(session_id).unlink()

    async def apply(self, batch: Batch[Effect]) -> None:
        def work() -> None:
            path = self._path(batch.session_id)
            if not path.exists():
                raise SessionNotFoundError(batch.session_id)
            with path.open("ab") as file:
                if not self.UNLOCKED:
                    fcntl.flock(file, fcntl.LOCK_EX)
                self._hook("apply.locked")
                session, batches = self._read(batch.session_id)
                if len(batches) != batch.revision - 1:
                    raise ConflictError(batch.session_id, batch.revision - 1, len(batches))
                for b in batches:
                    session = apply_batch(session, b.effects)
                apply_batch(session, batch.effects)  # raises, writing nothing, if it fails
                if self.UNLOCKED:
                    time.sleep(0.002)  # widen the race window
                if self.SPLIT:
                    for effect in batch.effects:
                        record = {
                            "rev": batch.revision,
                            "step": batch.step,
                            "cycle": batch.cycle,
                            "timestamp": batch.timestamp,
                            "refused": [[r.step, r.why] for r in batch.refused],
                            "trace": batch.trace,
                            "effect": msgspec.json.decode(self._codec.encode_effects([effect]))[0],
                        }
                        file.write(msgspec.json.encode(record) + b"\n")
                        file.flush()
                        self._hook("apply.written")
                    os.fsync(file.fileno())
                    return
                line = self._codec.encode_batch(batch) + b"\n"
                pending = self._pending.setdefault(batch.session_id, [])
                if self.LOSE and batch.revision % 2 == 1:
                    pending.append(line)
                else:
                    file.write(b"".join(pending) + line)
                    pending.clear()
                    file.flush()
                    os.fsync(file.fileno())
                self._hook("apply.written")

        await anyio.to_thread.run_sync(work)


class LosingStore(JsonlStore):
    """BROKEN on purpose: acknowledges odd revisions before they are written."""

    LOSE = True


class SplittingStore(JsonlStore):
    """BROKEN on purpose: writes a batch one effect at a time."""

    SPLIT = True


class UnlockedStore(JsonlStore):
    """BROKEN on purpose: compare-and-set without a lock."""

    UNLOCKED = True
