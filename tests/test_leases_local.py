"""SQLiteStore's and FileStore's leases (file locks): the conformance suite, then
what only several processes show: a SIGKILLed holder's lease comes free, racing
``claim_next`` never gives a session twice, and a ``request_run`` from another
process while the holder runs is never lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from stepmachine import (
    AppendMessage,
    Batch,
    Codec,
    Effect,
    Lease,
    LeaseHolder,
    LeaseLostError,
    Leases,
    Message,
    Session,
    StoreClosedError,
)
from stepmachine.stores import FileStore, SQLiteStore
from stepmachine.testing.leases import LeaseConformance

KINDS = ["sqlite", "file"]


async def _open(kind: str, path: Path, codec: Codec[Any] | None = None) -> Any:
    if kind == "sqlite":
        return await SQLiteStore.open(path / "db.sqlite3", codec)
    return await FileStore.open(path / "files", codec, fsync="never")


class TestSQLiteStoreLeases(LeaseConformance):
    async def make_store(self, codec: Codec[Any], path: Path) -> SQLiteStore:
        store: SQLiteStore = await _open("sqlite", path, codec)
        return store


class TestFileStoreLeases(LeaseConformance):
    async def make_store(self, codec: Codec[Any], path: Path) -> FileStore:
        store: FileStore = await _open("file", path, codec)
        return store


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def store(kind: str, tmp_path: Path) -> AsyncIterator[Any]:
    made = await _open(kind, tmp_path)
    try:
        yield made
    finally:
        await made.aclose()


def _batch(session: Session[Any], text: str) -> Batch[Effect]:
    return Batch(
        session_id=session.id,
        revision=session.revision + 1,
        step="test",
        cycle=session.revision + 1,
        timestamp=1_700_000_000.0,
        effects=(AppendMessage(Message.user(text, id=f"m{session.revision + 1}")),),
    )


# -- one process, several store instances ---------------------------------------------


async def test_two_instances_exclude_each_other(kind: str, tmp_path: Path) -> None:
    first, second = await _open(kind, tmp_path), await _open(kind, tmp_path)
    try:
        session = await first.create("s")
        lease = await first.claim("s", "a", 30.0)
        assert isinstance(lease, Lease)
        assert await second.claim("s", "b", 30.0) == LeaseHolder("a", None)
        # fencing is per instance: the lease is not held by `second`
        with pytest.raises(LeaseLostError):
            await second.apply(_batch(session, "x"), lease=lease)
        assert await second.release(lease) is True  # not its lease: nothing done
        assert isinstance(await second.claim("s", "b", 30.0), LeaseHolder)
        await first.release(lease)
        taken = await second.claim("s", "b", 30.0)
        assert isinstance(taken, Lease)
        assert taken.epoch == lease.epoch + 1
    finally:
        await first.aclose()
        await second.aclose()


async def test_aclose_releases_and_refuses(kind: str, tmp_path: Path) -> None:
    first, second = await _open(kind, tmp_path), await _open(kind, tmp_path)
    try:
        await first.create("s")
        lease = await first.claim("s", "a", 30.0)
        assert isinstance(lease, Lease)
        await first.aclose()
        for call in (
            first.claim("s", "a", 30.0),
            first.claim_next("a", 30.0),
            first.request_run("s"),
            first.renew(lease),
            first.release(lease),
        ):
            with pytest.raises(StoreClosedError):
                await call
        assert isinstance(await second.claim("s", "b", 30.0), Lease)
    finally:
        await first.aclose()
        await second.aclose()


async def test_epochs_continue_across_instances_and_delete(kind: str, tmp_path: Path) -> None:
    epochs = []
    for _ in range(2):
        store = await _open(kind, tmp_path)
        try:
            if "s" not in await store.list_sessions():
                await store.create("s")
            lease = await store.claim("s", "a", 30.0)
            assert isinstance(lease, Lease)
            epochs.append(lease.epoch)
            await store.request_run("s")
            await store.release(lease)
            await store.delete("s")  # the mark goes with the session
            assert await store.claim_next("w", 30.0) is None
            await store.create("s")
            again = await store.claim("s", "b", 30.0)
            assert isinstance(again, Lease)
            epochs.append(again.epoch)
        finally:
            await store.aclose()
    assert epochs == sorted(set(epochs)), epochs


async def test_a_stale_mark_of_a_deleted_session_is_skipped(store: Any) -> None:
    await store.create("s")
    await store.create("t")
    await store.request_run("s")
    await store.request_run("t")
    leases = store._leases  # a mark left behind (a crash between delete and its unmark)
    await store.delete("s")
    await leases._meta(lambda: leases._mark("s"))
    got = await store.claim_next("w", 30.0)
    assert isinstance(got, Lease)
    assert got.session_id == "t"
    assert await store.claim_next("w2", 30.0) is None


async def test_hostile_but_valid_ids(store: Any) -> None:
    ids = ["a" * 128, "A", "a", "CON_", "x.lock", "_", "9-9.9"]
    for session_id in ids:
        await store.create(session_id)
        await store.request_run(session_id)
    got = []
    while (lease := await store.claim_next("w", 30.0)) is not None:
        got.append(lease.session_id)
    assert got == sorted(ids)
    assert sorted(await store.list_sessions()) == sorted(ids)  # lease files are not sessions


def test_stores_have_leases() -> None:
    assert SQLiteStore.leases_expire is False
    assert FileStore.leases_expire is False
    for cls in (SQLiteStore, FileStore):
        assert all(hasattr(cls, name) for name in ("claim", "claim_next", "request_run"))


async def test_isinstance_leases(store: Any) -> None:
    assert isinstance(store, Leases)
