"""MemoryStore passes the store conformance suite (and nothing more is special)."""

import anyio

from stepmachine import AppendMessage, Effect, Message
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
