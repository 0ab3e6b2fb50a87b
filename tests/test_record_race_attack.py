"""The write path of staged work and of ``submit``, attacked from outside.

Two changes are under attack: a task's record is written under
``_retry.retry_while_moving`` (recomputed from the stored session after each
conflict, for as long as the stored revision moves on; only
``MAX_STALLED_CONFLICTS`` conflicts in a row without movement raise), and every
batch, ``submit``'s included, goes through ``_store.commit``. The attacks:
faults between writes (a store that writes and then raises, a lost reply, a
conflict on the Nth attempt, a reload that raises or is cancelled), records
that must not be written twice (a charge, a non-idempotent tool), concurrent
writers (tasks of one ``Staged``, other processes on one SQLite file),
cancellation at every store call of the retry loop (a ``CancelToken`` and an
outside cancel scope), ``Task.refused`` replacements with conflicts, handlers
that return ``None`` or a wrong session, ``submit`` with hostile inputs, and a
store that keeps refusing. Every test checks the stored history stays valid.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from stepmachine import (
    AppendMessage,
    Codec,
    ConflictError,
    Message,
    ModelInference,
    Runtime,
    Session,
    StateMachine,
    UpdateData,
    submit,
)
from stepmachine.extend import Lease, history_problems
from stepmachine.operations import Compaction
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore
from stepmachine.testing import FunctionModel, reply

HERE = Path(__file__).resolve().parent
KINDS = ["memory", "sqlite", "file"]


async def open_kind(kind: str, folder: Path, codec: Codec[Any] | None = None) -> Any:
    """A fresh store of ``kind`` kept in ``folder`` (memory: nothing on disk)."""
    if kind == "sqlite":
        return await SQLiteStore.open(folder / "db.sqlite3", codec)
    if kind == "file":
        return await FileStore.open(folder / "files", codec)
    return MemoryStore(codec)


@pytest.fixture(params=KINDS)
async def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Faulty:
    """A store that forwards everything to ``inner``; ``before(batch)`` / ``after(batch,
    stored)`` run around each ``apply`` (either may raise, ``before`` to refuse before
    anything is written, ``after`` once the batch is stored: a lost reply)."""

    applies_batches = True  # it forwards to a store that applies the batch itself
    leases_expire = False

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.leases_expire = inner.leases_expire
        self.before: Callable[[Any], Awaitable[None]] | None = None
        self.after: Callable[[Any, Any], Awaitable[Any]] | None = None
        self.on_load: Callable[[str], Awaitable[None]] | None = None
        self.applied: list[Any] = []  # every batch the inner store took, in order

    async def apply(self, batch: Any, *, lease: Lease | None = None) -> Any:
        if self.before is not None:
            await self.before(batch)
        stored = await self.inner.apply(batch, lease=lease)
        self.applied.append(batch)
        if self.after is not None:
            returned = await self.after(batch, stored)
            if returned is not None:
                return returned
        return stored

    async def load(self, session_id: str) -> Any:
        if self.on_load is not None:
            await self.on_load(session_id)
        return await self.inner.load(session_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def messages_with(session: Session[Any], text: str) -> int:
    return sum(1 for m in session.conversation if m.text == text)


async def assert_valid(store: Any, session_id: str) -> Session[Any]:
    """The stored session: its history valid, its audit log replaying to it."""
    session: Session[Any] = await store.load(session_id)
    assert history_problems(session.conversation) == []
    batches = await store.batches(session_id)
    assert [b.revision for b in batches] == list(range(1, session.revision + 1))
    return session


# -- submit with hostile inputs -------------------------------------------------------------


async def test_submit_reads_a_generator_once_so_a_conflict_does_not_empty_the_batch(
    kind: str, tmp_path: Path
) -> None:
    """Fixed: ``submit`` read a non-sequence iterable again on the attempt after a
    conflict, so a generator gave an empty batch there: the effects were silently lost
    (the call returned a session without them)."""
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s")
        store = Faulty(inner)
        refused = [0]

        async def lose_once(batch: Any) -> None:
            if batch.step == "mine" and not refused[0]:
                refused[0] += 1
                await submit(inner, "s", [AppendMessage(Message.user("other", id="o"))])
                raise ConflictError("s", batch.revision - 1, batch.revision)

        store.before = lose_once
        effects = (AppendMessage(Message.user(f"g{i}", id=f"g{i}")) for i in range(2))
        after = await submit(store, "s", effects, step="mine")  # type: ignore[arg-type]
        assert refused == [1]
        assert [m.id for m in after.conversation] == ["o", "g0", "g1"]
        session = await assert_valid(inner, "s")
        assert [m.id for m in session.conversation] == ["o", "g0", "g1"]
        assert [len(b.effects) for b in await inner.batches("s")] == [1, 2]
    finally:
        await inner.aclose()


@pytest.mark.parametrize("step", [3, b"step", None, 1.5])
async def test_a_batch_whose_step_is_not_a_name_is_refused_and_the_session_stays_readable(
    kind: str, tmp_path: Path, step: object
) -> None:
    """Fixed: ``submit(step=3)`` (or bytes) on a SQLiteStore stored the batch, and every
    later ``load`` of the session raised ``StoredDataError`` (the row did not match its
    checksum): one bad argument made a session unreadable for good."""
    store = await open_kind(kind, tmp_path)
    try:
        await store.create("s", conversation=[Message.user("hi", id="u1")])
        with pytest.raises(Exception) as raised:  # noqa: PT011 - the type differs per store
            await submit(store, "s", [AppendMessage(Message.user("x", id="x"))], step=step)  # type: ignore[arg-type]
        assert "step" in str(raised.value)
        if kind != "memory":
            await store.aclose()
            store = await open_kind(kind, tmp_path)  # what a fresh process reads
        session = await assert_valid(store, "s")
        assert session.revision == 0
        assert [m.id for m in session.conversation] == ["u1"]
        after = await submit(store, "s", [AppendMessage(Message.user("y", id="y"))])
        assert after.revision == 1
    finally:
        await store.aclose()


@pytest.mark.parametrize(
    "effects",
    [["not an effect"], None, lambda s: None, lambda s: 1 / 0, [UpdateData.set(x=1), object()]],
    ids=["str", "none", "callable-none", "callable-raises", "mixed"],
)
async def test_submit_with_hostile_effects_raises_and_writes_nothing(
    kind: str, tmp_path: Path, effects: Any
) -> None:
    store = await open_kind(kind, tmp_path)
    try:
        await store.create("s", conversation=[Message.user("hi", id="u1")])
        with pytest.raises(Exception):  # noqa: B017, PT011 - any error; the point: nothing stored
            await submit(store, "s", effects)
        session = await assert_valid(store, "s")
        assert session.revision == 0
        assert await store.batches("s") == []
    finally:
        await store.aclose()


# -- a record computed before a conflict must not overwrite what the other writer wrote -------


def _long_conversation() -> list[Message]:
    conversation = []
    for i in range(6):
        conversation.append(Message.user(f"question {i} " + "words " * 30, id=f"u{i}"))
        conversation.append(Message.assistant(f"answer {i} " + "more " * 30, id=f"a{i}"))
    conversation.append(Message.user("the last question", id="ulast"))
    return conversation


async def test_a_message_submitted_while_the_summariser_runs_survives_compaction(
    kind: str, tmp_path: Path
) -> None:
    """Fixed: compaction's record was a constant ``ReplaceConversation`` built from the
    conversation the summariser was asked about; when a user message was submitted
    meanwhile, the record's write conflicted, was retried from the stored session, and
    wrote that replacement over it: the acknowledged message was gone (a lost update)."""
    store = await open_kind(kind, tmp_path)
    try:
        await store.create("s", conversation=_long_conversation())
        steered = [0]

        async def summarise(request: Any) -> Any:
            if not steered[0]:  # the user steers while the summariser runs
                steered[0] += 1
                steer = Message.user("STEER: use metric units", id="steer")
                await submit(store, "s", [AppendMessage(steer)])
            return reply("a summary")

        asked: list[Any] = []

        def agent(request: Any) -> Any:
            asked.append(request)
            return reply("final")

        summariser = FunctionModel(summarise, name="summariser")
        runtime = Runtime(
            store=store,
            model=FunctionModel(agent, name="agent"),
            models={"summariser": summariser},
        )
        compaction = Compaction(threshold=100, keep_turns=1, model="summariser")
        report = await StateMachine([compaction, ModelInference()]).run_report(runtime, "s")
        assert report.reason.kind == "done"
        session = await assert_valid(store, "s")
        steer = session.message("steer")
        assert steer is not None, [m.id for m in session.conversation]
        assert steer.visible_to_model
        assert any(m.id == "steer" for m in asked[-1].messages)  # the model saw it
        assert summariser.calls == 2  # the stale summary was not written; asked again
        assert messages_with(session, "final") == 1
    finally:
        await store.aclose()
