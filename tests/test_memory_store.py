"""MemoryStore passes the store conformance suite; its calls are cancellation points
every time and scheduling points every so often."""

import time

import anyio
import anyio.lowlevel

from stepmachine import AppendMessage, Effect, Message
from stepmachine._async import SCHEDULE_EVERY, light_checkpoint
from stepmachine.extend import Batch
from stepmachine.stores import MemoryStore
from stepmachine.testing.conformance import StoreConformance


class TestMemoryStore(StoreConformance):
    def make_store(self, codec, path):  # type: ignore[no-untyped-def]
        return MemoryStore(codec)


async def test_every_call_is_a_checkpoint_a_cancellation_lands_at() -> None:
    """Each method awaits once before it reads or writes (on asyncio and trio alike): a
    cancelled scope stops it there, with nothing written."""
    store = MemoryStore()
    await store.create("s")
    batch: Batch[Effect] = Batch(
        session_id="s",
        revision=1,
        step="test",
        cycle=0,
        timestamp=0.0,
        effects=(AppendMessage(Message.user("hi", id="m1")),),
    )
    with anyio.CancelScope() as scope:
        scope.cancel()
        await store.apply(batch)
    assert scope.cancelled_caught
    assert (await store.load("s")).revision == 0  # nothing was written
    after = await store.apply(batch)  # outside the scope: written once
    assert after.revision == 1
    assert [m.id for m in (await store.load("s")).conversation] == ["m1"]
    for call in (store.load("s"), store.list_sessions(), store.batches("s")):
        with anyio.CancelScope() as scope:
            scope.cancel()
            await call
        assert scope.cancelled_caught


async def test_a_task_that_only_calls_the_store_still_lets_the_others_run() -> None:
    """The store's calls are a scheduling point at least every ``SCHEDULE_EVERY`` seconds
    (not on every call): a task calling ``load`` in a loop for long enough lets another
    task of its loop run, on asyncio and trio alike."""
    store = MemoryStore()
    await store.create("s")
    ran = anyio.Event()
    calls = 0

    async def other() -> None:
        ran.set()

    async with anyio.create_task_group() as group:
        group.start_soon(other)
        deadline = time.monotonic() + 5  # a bound on a hang: far above SCHEDULE_EVERY
        while not ran.is_set() and time.monotonic() < deadline:
            await store.load("s")
            calls += 1
        ran_meanwhile = ran.is_set()  # before the group's end lets it run anyway
    assert ran_meanwhile
    assert calls >= 1


async def test_the_light_checkpoint_lets_the_loop_go_round_only_every_so_often() -> None:
    """Many calls within ``SCHEDULE_EVERY`` make at most one pass of the event loop:
    a task woken by each pass sees far fewer passes than calls."""
    passes = 0
    stop = False

    async def count_passes() -> None:
        nonlocal passes
        while not stop:
            passes += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as group:
        group.start_soon(count_passes)
        await anyio.lowlevel.checkpoint()
        before = passes
        start = time.monotonic()
        calls = 0
        while calls < 200:
            await light_checkpoint()
            calls += 1
        elapsed = time.monotonic() - start
        seen = passes - before
        stop = True
    # One pass at most per SCHEDULE_EVERY of the calls' own time (plus the first).
    assert seen <= 1 + elapsed / SCHEDULE_EVERY, (seen, calls, elapsed)
    assert seen < calls
