"""``SharedHeads``: one store read per session per poll, shared by every stream watching it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
from _web_sessions import SESSION, open_events, record

from stepmachine import Message, SessionNotFoundError, Store
from stepmachine.inspector import inspection_codec
from stepmachine.inspector._heads import SharedHeads
from stepmachine.inspector._web import create_app
from stepmachine.stores import MemoryStore, SQLiteStore


class Counting:
    """A store whose ``load`` counts its calls (and can be slowed down)."""

    def __init__(self, store: Store, delay: float = 0.0) -> None:
        self._store = store
        self.delay = delay
        self.loads = 0

    async def load(self, session_id: str) -> Any:
        self.loads += 1
        await anyio.sleep(self.delay)
        return await self._store.load(session_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


async def test_concurrent_callers_share_one_load() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    counting = Counting(store, delay=0.05)
    heads = SharedHeads(counting, interval=60.0)  # type: ignore[arg-type]
    results: list[Any] = []

    async def watch() -> None:
        results.append(await heads.load("s"))

    async with anyio.create_task_group() as group:
        for _ in range(10):
            group.start_soon(watch)
    assert counting.loads == 1
    assert {session.revision for session in results} == {0}
    await heads.load("s")  # still fresh
    assert counting.loads == 1


async def test_a_head_older_than_the_interval_is_read_again() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    counting = Counting(store)
    heads = SharedHeads(counting, interval=0.0)  # type: ignore[arg-type]
    await heads.load("s")
    await heads.load("s")
    assert counting.loads == 2


async def test_a_failed_load_is_not_shared_and_is_tried_again() -> None:
    store = MemoryStore()
    counting = Counting(store, delay=0.02)
    heads = SharedHeads(counting, interval=60.0)  # type: ignore[arg-type]
    errors: list[BaseException] = []

    async def watch() -> None:
        try:
            await heads.load("missing")
        except SessionNotFoundError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as group:
        for _ in range(3):
            group.start_soon(watch)
    assert len(errors) == 3  # each caller gets the error
    await store.create("missing")
    assert (await heads.load("missing")).revision == 0  # and a later load succeeds


async def test_streams_of_one_session_share_the_polls(tmp_path: Path) -> None:
    """Ten clients on one session cost the store about one client's polls, not ten."""
    path = tmp_path / "agent.sqlite3"
    await record(path)
    async with await SQLiteStore.open(path, inspection_codec(), read_only=True) as reader:
        counting = Counting(reader)
        app = create_app(counting, poll_interval=0.02, keepalive=60.0)  # type: ignore[arg-type]
        streams = 10
        async with open_events(app, f"/sessions/{SESSION}/events") as first:
            assert await first.next_of("status") is not None
            others = [open_events(app, f"/sessions/{SESSION}/events") for _ in range(streams - 1)]
            readers = [await other.__aenter__() for other in others]
            try:
                for each in readers:
                    assert await each.next_of("status") is not None
                counting.loads = 0
                await anyio.sleep(0.4)  # about 20 polls per stream
                polls = counting.loads
            finally:
                for other in reversed(others):
                    await other.__aexit__(None, None, None)
    # Unshared, ten streams polling every 0.02 s for 0.4 s read the head ~200 times.
    # Shared, about 20: allow for slow scheduling, but not for one read per stream.
    assert 0 < polls < streams * 0.4 / 0.02 / 3, polls
