"""Deleting the last session that names a media blob removes the blob (issue 22).

Media bytes are kept once per digest and shared by every record naming them
(two sessions holding the same bytes, a fork, a snapshot). ``delete`` removes,
in its own transaction, the blobs no remaining record names, so a deleted
session's images are not left readable in the store; a blob another session
still names stays. PostgreSQL: a writer relying on a blob it found holds
its row ``FOR KEY SHARE`` until it commits, so a concurrent delete never
removes a blob a new record names (tested with two real connections).
FileStore: the same through a lock on the ``.media`` folder that writers take
shared until their record is written; a SIGKILL between removing the session's
files and the blobs leaves blobs that the next delete removes.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import AsyncIterator
from contextlib import closing
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import AppendMessage, Effect, ImagePart, Message, Session
from stepmachine.extend import Batch, media_digest
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore

ROOT = Path(__file__).resolve().parent.parent
SHARED = bytes(range(256)) * 16
OWN = b"own " * 1000
OTHER = b"other " * 1000


def _image(data: bytes) -> ImagePart:
    return ImagePart(media_type="image/png", data=data)


def _user(index: int, *data: bytes) -> Message:
    return Message.user(f"look {index}", id=f"m{index}", media=[_image(d) for d in data])


def _batch(session: Session[Any], *effects: Effect) -> Batch[Effect]:
    return Batch(
        session_id=session.id,
        revision=session.revision + 1,
        step="test",
        cycle=0,
        timestamp=1.0,
        effects=effects,
    )


class Opened:
    def __init__(self, kind: str, path: Path, dsn: str = "") -> None:
        self.kind = kind
        self.path = path
        self.dsn = dsn
        self.store: Any = None

    async def open(self) -> Any:
        if self.kind == "memory":
            self.store = self.store or MemoryStore()
        elif self.kind == "file":
            self.store = await FileStore.open(self.path / "files")
        elif self.kind == "postgres":
            from stepmachine.stores import PostgresStore

            self.store = await PostgresStore.open(self.dsn)
        else:
            self.store = await SQLiteStore.open(self.path / "db.sqlite3")
        return self.store

    def held(self) -> set[str]:
        """The digests the store holds blobs for, read from outside the store."""
        if self.kind == "memory":
            return set(self.store._blobs)
        if self.kind == "file":
            folder = self.path / "files" / ".media"
            names = os.listdir(folder) if folder.exists() else []
            return {"sha256:" + n for n in names if not n.startswith(".")}
        if self.kind == "postgres":
            import psycopg

            with psycopg.connect(self.dsn, autocommit=True) as conn:
                return {row[0] for row in conn.execute("SELECT digest FROM stepmachine.media")}
        with closing(sqlite3.connect(self.path / "db.sqlite3")) as conn, conn:
            try:
                return {row[0] for row in conn.execute("SELECT digest FROM media")}
            except sqlite3.OperationalError:
                return set()


KINDS = [
    "memory",
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
    "file",
]


@pytest.fixture(params=KINDS)
async def opened(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Opened]:
    dsn = request.getfixturevalue("postgres_dsn") if request.param == "postgres" else ""
    opened = Opened(request.param, tmp_path, dsn)
    try:
        yield opened
    finally:
        if opened.store is not None and hasattr(opened.store, "aclose"):
            await opened.store.aclose()


async def test_deleting_the_last_session_naming_a_blob_removes_it(opened: Opened) -> None:
    store = await opened.open()
    with anyio.fail_after(20):
        s = await store.create("s", conversation=[_user(0, SHARED)])
        await store.apply(_batch(s, AppendMessage(_user(1, OWN))))
        await store.create("t", conversation=[_user(0, SHARED, OTHER)])
        assert opened.held() == {media_digest(d) for d in (SHARED, OWN, OTHER)}
        await store.delete("s")
        assert opened.held() == {media_digest(SHARED), media_digest(OTHER)}
        loaded = await store.load("t")
        assert [p.data for p in loaded.conversation[0].parts if isinstance(p, ImagePart)] == [
            SHARED,
            OTHER,
        ]
        await store.delete("t")
        assert opened.held() == set()
        again = await store.create("s", conversation=[_user(0, SHARED)])  # written anew
        assert opened.held() == {media_digest(SHARED)}
    assert again.conversation[0].parts[-1] == _image(SHARED)


@pytest.mark.parametrize("opened", KINDS[1:], indirect=True)  # memory: no fork
async def test_a_fork_keeps_the_blobs_until_it_is_deleted_too(opened: Opened) -> None:
    store = await opened.open()
    with anyio.fail_after(20):
        s = await store.create("s", conversation=[_user(0, OWN)])
        await store.apply(_batch(s, AppendMessage(_user(1, OTHER))))
        await store.fork("s", 1, "f")
        await store.delete("s")
        assert opened.held() == {media_digest(OWN), media_digest(OTHER)}
        await store.aclose()
        store = await opened.open()
        forked = await store.load_at("f", 1)
        assert forked.conversation[-1].parts[-1] == _image(OTHER)
        await store.delete("f")
    assert opened.held() == set()


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    holders=st.lists(st.sets(st.integers(0, 3), max_size=3), min_size=1, max_size=4),
    order=st.randoms(use_true_random=False),
)
def test_a_blob_lives_exactly_while_a_session_names_it(
    tmp_path_factory: pytest.TempPathFactory, holders: list[set[int]], order: Any
) -> None:
    images = [bytes([n]) * (100 + n) for n in range(4)]

    async def main() -> None:
        opened = Opened("sqlite", tmp_path_factory.mktemp("db"))
        store = await opened.open()
        try:
            live: dict[str, set[int]] = {}
            for n, held in enumerate(holders):
                await store.create(
                    f"s{n}", conversation=[_user(0, *(images[i] for i in sorted(held)))]
                )
                live[f"s{n}"] = held
            names = sorted(live)
            order.shuffle(names)
            for name in names:
                await store.delete(name)
                del live[name]
                expected = {media_digest(images[i]) for held in live.values() for i in held}
                assert opened.held() == expected
        finally:
            await store.aclose()

    anyio.run(main)


@pytest.mark.parametrize(
    "opened", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
async def test_a_postgres_delete_waits_for_a_writer_relying_on_the_blob(opened: Opened) -> None:
    """A writer that found the blob held (its row locked FOR KEY SHARE, as the store's
    writes do) and commits a record naming it after the delete began keeps the blob."""
    import psycopg

    from stepmachine.stores._postgres_rows import held_blobs

    store = await opened.open()
    digest = media_digest(OWN)
    conn = psycopg.connect(opened.dsn)  # the writer: its transaction holds the row
    try:
        with anyio.fail_after(60):
            await store.create("s", conversation=[_user(0, OWN)])
            await store.create("t", conversation=[_user(0)])
            assert held_blobs(conn, [digest]) == {digest: len(OWN)}
            done = anyio.Event()

            async def delete() -> None:
                await store.delete("s")
                done.set()

            async with anyio.create_task_group() as group:
                group.start_soon(delete)
                await anyio.sleep(0.5)
                deleted_early = done.is_set()
                row = conn.execute(
                    "SELECT sid FROM stepmachine.sessions WHERE session_id = 't'"
                ).fetchone()
                assert row is not None
                conn.execute(
                    "INSERT INTO stepmachine.snapshots (sid, revision, schema_version, body, crc) "
                    "VALUES (%s, 999, 1, %s, 0)",
                    (row[0], b'{"ref":"' + digest.encode() + b'"}'),
                )
                await anyio.to_thread.run_sync(conn.commit)
    finally:
        conn.close()
    assert not deleted_early  # it waited for the writer
    assert digest in opened.held()


_KILLED_DELETE = """
import os, signal, sys, anyio
from stepmachine.stores import FileStore

def hook(name):
    if name == "delete.removed":
        os.kill(os.getpid(), signal.SIGKILL)

async def main(folder):
    store = await FileStore.open(folder, boundary_hook=hook)
    await store.delete("s")

anyio.run(main, sys.argv[1])
"""


async def test_a_sigkill_between_removing_the_session_and_its_blobs_loses_nothing(
    tmp_path: Path,
) -> None:
    import subprocess
    import sys

    root = ROOT
    folder = tmp_path / "files"
    opened = Opened("file", tmp_path)
    with anyio.fail_after(60):
        store = await opened.open()
        await store.create("s", conversation=[_user(0, OWN, SHARED)])
        await store.create("t", conversation=[_user(0, SHARED)])
        await store.create("u", conversation=[_user(0, OTHER)])
        await store.aclose()
        done = await anyio.run_process(
            [sys.executable, "-c", _KILLED_DELETE, str(folder)],
            env={**os.environ, "PYTHONPATH": str(root)},
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        assert done.returncode == -9  # killed at the boundary
        # the session is gone, its own blob not yet: nothing a remaining session names is lost
        assert opened.held() == {media_digest(d) for d in (OWN, SHARED, OTHER)}
        store = await opened.open()
        assert sorted(await store.list_sessions()) == ["t", "u"]
        await store.delete("u")  # the next sweep removes what the killed delete left
        assert opened.held() == {media_digest(SHARED)}
        loaded = await store.load_at("t", 0)
        await store.aclose()
    assert loaded.conversation[0].parts[-1] == _image(SHARED)


# -- a delete racing a writer of the same bytes (two store instances) ------------------


def _img_msg(data: bytes, mid: str = "u1") -> Message:
    return Message.user("look", id=mid, media=[ImagePart(media_type="image/png", data=data)])


async def _open(kind: str, tmp_path: Path) -> Any:
    if kind == "file":
        return await FileStore.open(tmp_path / "files")
    return await SQLiteStore.open(tmp_path / "db.sqlite3")


@pytest.mark.parametrize("kind", ["file", "sqlite"])
async def test_delete_racing_a_writer_of_the_same_bytes_keeps_the_writers_blob(
    kind: str, tmp_path: Path
) -> None:
    """Two store instances (two connections / open files, like two processes): one
    deletes the only session naming a blob while the other creates a session with the
    same bytes. Whatever the interleaving, the writer's session loads with its image."""
    deleter = await _open(kind, tmp_path)
    writer = await _open(kind, tmp_path)
    try:
        with anyio.fail_after(120):
            for i in range(25):
                data = os.urandom(3000)
                await deleter.create(f"old{i}", conversation=[_img_msg(data)])
                async with anyio.create_task_group() as tg:
                    tg.start_soon(deleter.delete, f"old{i}")
                    tg.start_soon(
                        lambda i=i, data=data: writer.create(
                            f"new{i}", conversation=[_img_msg(data)]
                        )
                    )
                reader = await _open(kind, tmp_path)
                try:
                    session = await reader.load(f"new{i}")
                    parts = session.conversation[0].parts
                    assert [p.data for p in parts if isinstance(p, ImagePart)] == [data], i
                finally:
                    await reader.aclose()
    finally:
        await deleter.aclose()
        await writer.aclose()
