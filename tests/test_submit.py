"""stepmachine.submit: one batch from outside a machine, retried on conflict."""

from __future__ import annotations

from typing import Any

import pytest

from stepmachine import (
    Annotate,
    AppendMessage,
    ConflictError,
    Effect,
    EffectError,
    Message,
    Session,
    StepmachineError,
    submit,
)
from stepmachine.extend import Batch
from stepmachine.stores import MemoryStore


class FlakyStore:
    """Wraps a store; ``apply`` raises ``ConflictError`` for the first ``conflicts`` calls.

    With ``interleave`` set, each conflict is a real one: another writer appends a
    message through the inner store first, so the stale batch really is stale.
    """

    def __init__(self, inner: MemoryStore, conflicts: int, *, interleave: bool = False) -> None:
        self.inner = inner
        self.conflicts = conflicts
        self.interleave = interleave
        self.loads = 0
        self.applied: list[Batch[Effect]] = []
        self.attempts: list[Batch[Effect]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def load(self, session_id: str) -> Session[Any]:
        self.loads += 1
        return await self.inner.load(session_id)

    async def apply(self, batch: Batch[Effect]) -> None:
        self.attempts.append(batch)
        if self.conflicts > 0:
            self.conflicts -= 1
            if self.interleave:
                other = Message.user("other writer", id=f"other-{len(self.attempts)}")
                await submit(self.inner, batch.session_id, [AppendMessage(other)])
                await self.inner.apply(batch)  # the store itself refuses the stale batch
                raise AssertionError("the stale batch was accepted")  # pragma: no cover
            raise ConflictError(batch.session_id, batch.revision - 1, batch.revision)
        await self.inner.apply(batch)
        self.applied.append(batch)


async def new_store() -> MemoryStore:
    store = MemoryStore()
    await store.create("s1", conversation=[Message.user("hi", id="u0")])
    return store


async def test_submit_appends_effects_as_one_application_batch() -> None:
    store = await new_store()
    effects: list[Effect] = [
        AppendMessage(Message.user("more", id="u1")),
        Annotate(message_id="u0", namespace="app", values={"seen": True}),
    ]
    after = await submit(store, "s1", effects, clock=lambda: 1234.5)
    assert after.revision == 1
    assert [m.id for m in after.conversation] == ["u0", "u1"]
    assert after.message("u0").notes == {"app": {"seen": True}}  # type: ignore[union-attr]
    assert after == await store.load("s1")
    (batch,) = await store.batches("s1")
    assert batch.step == "application"
    assert batch.timestamp == 1234.5
    assert batch.revision == 1
    assert batch.cycle == 0
    assert batch.session_id == "s1"
    assert batch.effects == tuple(effects)


async def test_submit_step_name_can_be_set() -> None:
    store = await new_store()
    await submit(store, "s1", [AppendMessage(Message.user("x", id="u1"))], step="webhook")
    (batch,) = await store.batches("s1")
    assert batch.step == "webhook"


async def test_submit_retries_on_conflict() -> None:
    store = FlakyStore(await new_store(), conflicts=3)
    after = await submit(store, "s1", [AppendMessage(Message.user("x", id="u1"))])  # type: ignore[arg-type]
    assert len(store.attempts) == 4
    assert store.loads == 4  # it reloads before every attempt
    assert len(store.applied) == 1
    assert after.revision == 1
    assert [m.id for m in (await store.inner.load("s1")).conversation] == ["u0", "u1"]


async def test_submit_retries_against_a_real_interleaved_writer() -> None:
    store = FlakyStore(await new_store(), conflicts=2, interleave=True)
    after = await submit(store, "s1", [AppendMessage(Message.user("mine", id="mine"))])  # type: ignore[arg-type]
    # both other writes survive, and mine comes after them: nothing was overwritten
    assert [m.id for m in after.conversation] == ["u0", "other-1", "other-2", "mine"]
    assert after.revision == 3
    assert after == await store.inner.load("s1")
    assert [b.revision for b in store.attempts] == [1, 2, 3]


async def test_submit_gives_up_after_max_attempts() -> None:
    store = FlakyStore(await new_store(), conflicts=1000)
    with pytest.raises(ConflictError):
        await submit(
            store,  # type: ignore[arg-type]
            "s1",
            [AppendMessage(Message.user("x", id="u1"))],
            max_attempts=5,
        )
    assert len(store.attempts) == 5
    assert (await store.inner.load("s1")).revision == 0  # nothing written


async def test_submit_succeeds_on_the_last_allowed_attempt() -> None:
    store = FlakyStore(await new_store(), conflicts=4)
    after = await submit(
        store,  # type: ignore[arg-type]
        "s1",
        [AppendMessage(Message.user("x", id="u1"))],
        max_attempts=5,
    )
    assert after.revision == 1
    assert len(store.attempts) == 5


async def test_submit_effect_error_is_not_retried_and_writes_nothing() -> None:
    store = FlakyStore(await new_store(), conflicts=0)
    with pytest.raises(EffectError):
        await submit(store, "s1", [AppendMessage(Message.user("dup", id="u0"))])  # type: ignore[arg-type]
    assert store.attempts == []
    assert store.loads == 1
    assert (await store.inner.load("s1")).revision == 0


async def test_submit_on_a_store_with_history_produces_the_next_revision() -> None:
    store = await new_store()
    for n in range(1, 4):
        after = await submit(store, "s1", [AppendMessage(Message.user(str(n), id=f"u{n}"))])
        assert after.revision == n
    assert [b.revision for b in await store.batches("s1")] == [1, 2, 3]


async def test_submit_refuses_zero_attempts_clearly() -> None:
    store = await new_store()
    with pytest.raises((ValueError, StepmachineError)):
        await submit(store, "s1", [AppendMessage(Message.user("x", id="u1"))], max_attempts=0)
