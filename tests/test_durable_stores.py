"""The durable stores (FileStore, SQLiteStore) with snapshots as often as they go:
``load_at`` and ``fork`` at every revision around pruned snapshots, two store instances on one
file, and every call after ``aclose``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from stepmachine import (
    Annotate,
    AppendMessage,
    ConflictError,
    Effect,
    Message,
    ReplaceConversation,
    Session,
    StoreClosedError,
)
from stepmachine.extend import Batch, apply_batch
from stepmachine.stores import FileStore, SQLiteStore, _sqlite_rows

Opener = Callable[[], Any]


def batch_for(session: Session[Any], *effects: Effect) -> Batch[Effect]:
    return Batch(
        session_id=session.id,
        revision=session.revision + 1,
        step="test",
        cycle=1,
        timestamp=1_700_000_000.0 + session.revision,
        effects=effects,
    )


def effects_at(session: Session[Any], index: int) -> tuple[Effect, ...]:
    """Batch ``index``: a message, every fifth a compaction, every third an annotation."""
    text = f"message {index} " + "long text " * (40 if index % 2 else 1)
    message = Message.user(text, id=f"m{index}")
    if index % 5 == 0:
        kept = session.conversation[-1:]
        return (ReplaceConversation((*kept, message)),)
    if index % 3 == 0 and session.conversation:
        return (AppendMessage(message), Annotate(session.conversation[-1].id, "app", {"i": index}))
    return (AppendMessage(message),)


@pytest.fixture(params=["file", "sqlite"])
async def opener(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Opener]:
    monkeypatch.setattr(_sqlite_rows, "SNAPSHOT_EVERY", 1)
    monkeypatch.setattr(_sqlite_rows, "SNAPSHOT_MAX_GAP", 2)
    opened: list[Any] = []  # closed at the end (aclose is idempotent): no connection is left

    async def open_one() -> Any:
        if request.param == "file":
            store: Any = await FileStore.open(tmp_path / "store", snapshot_every=2)
        else:
            store = await SQLiteStore.open(tmp_path / "store.db")
        opened.append(store)
        return store

    yield open_one
    for store in opened:
        await store.aclose()


async def grow(store: Any, session_id: str, batches: int) -> list[Session[Any]]:
    session = await store.create(session_id)
    history = [session]
    for index in range(1, batches + 1):
        effects = effects_at(session, index)
        returned = await store.apply(batch_for(session, *effects))
        session = apply_batch(session, effects)
        assert returned == session
        history.append(session)
    return history


@pytest.mark.anyio
async def test_load_at_and_fork_at_every_revision(opener: Opener) -> None:
    store = await opener()
    history = await grow(store, "s", 13)
    fresh = await opener()  # cold: from what is on disk only
    for reader in (store, fresh):
        for expected in history:
            assert await reader.load_at("s", expected.revision) == expected
            assert [b.revision for b in await reader.batches("s", expected.revision)] == list(
                range(expected.revision + 1, 14)
            )
    for point in history:
        name = f"f{point.revision}"
        forked = await store.fork("s", point.revision, name)
        assert forked.id == name
        cold = await opener()
        assert (await cold.load(name)).conversation == point.conversation
        for earlier in history[: point.revision + 1]:
            got = await cold.load_at(name, earlier.revision)
            assert got.conversation == earlier.conversation
            assert got.revision == earlier.revision
        # The fork grows on its own; the source is unchanged.
        grown = await cold.apply(batch_for(forked, AppendMessage(Message.user("x", id="x"))))
        assert grown.revision == point.revision + 1
        assert await (await opener()).load(name) == grown
        await cold.aclose()
    assert await (await opener()).load("s") == history[-1]
    await store.aclose()
    await fresh.aclose()


@pytest.mark.anyio
async def test_two_instances_see_each_other_and_never_overwrite(opener: Opener) -> None:
    one, two = await opener(), await opener()
    history = await grow(one, "s", 4)
    assert await two.load("s") == history[-1]  # two caches revision 4
    for index in range(5, 12):
        writer, stale = (one, two) if index % 2 else (two, one)
        current = await writer.load("s")
        effects = effects_at(current, index)
        await writer.apply(batch_for(current, *effects))
        with pytest.raises(ConflictError):  # built on what it cached before
            await stale.apply(batch_for(current, AppendMessage(Message.user("lost", id="lost"))))
        after = apply_batch(current, effects)
        assert await stale.load("s") == after
        assert await writer.load("s") == after
        assert await stale.load_at("s", current.revision) == current
    assert [b.revision for b in await two.batches("s")] == list(range(1, 12))
    await one.aclose()
    await two.aclose()


@pytest.mark.anyio
async def test_concurrent_writers_on_two_instances_lose_nothing(opener: Opener) -> None:
    one, two = await opener(), await opener()
    await one.create("s")
    acknowledged: list[int] = []

    async def writer(store: Any, tag: str) -> None:
        for index in range(15):
            while True:
                session = await store.load("s")
                batch = batch_for(
                    session, AppendMessage(Message.user(f"{tag}{index}", id=f"{tag}{index}"))
                )
                try:
                    await store.apply(batch)
                except ConflictError:
                    continue
                acknowledged.append(batch.revision)
                break

    async with anyio.create_task_group() as group:
        group.start_soon(writer, one, "a")
        group.start_soon(writer, two, "b")
    assert sorted(acknowledged) == list(range(1, 31))
    final = await (await opener()).load("s")
    assert final.revision == 30
    texts = sorted(m.parts[0].text for m in final.conversation)
    assert texts == sorted([f"a{i}" for i in range(15)] + [f"b{i}" for i in range(15)])
    await one.aclose()
    await two.aclose()


@pytest.mark.anyio
async def test_every_call_after_aclose_is_refused(opener: Opener) -> None:
    store = await opener()
    history = await grow(store, "s", 2)
    await store.aclose()
    await store.aclose()  # idempotent
    calls = [
        lambda: store.load("s"),
        lambda: store.apply(batch_for(history[-1], AppendMessage(Message.user("late", id="late")))),
        lambda: store.create("t"),
        lambda: store.load_at("s", 1),
        lambda: store.batches("s"),
        lambda: store.fork("s", 1, "f"),
        lambda: store.delete("s"),
        store.list_sessions,
    ]
    for call in calls:
        with pytest.raises((StoreClosedError, anyio.ClosedResourceError)):
            await call()
    reopened = await opener()
    assert await reopened.load("s") == history[-1]
    assert await reopened.list_sessions() == ["s"]
    await reopened.aclose()


@pytest.mark.anyio
async def test_closed_stores_raise_the_same_error(opener: Opener) -> None:
    """Both durable stores say "closed" with the kernel's StoreClosedError (the
    SQLite store does; an application catching it must not need anyio's)."""
    store = await opener()
    await store.create("s")
    await store.aclose()
    with pytest.raises(StoreClosedError):
        await store.load("s")
