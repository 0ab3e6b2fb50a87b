"""The store conformance suite: any store, ours or yours, runs it with one line.

::

    from stepmachine.testing.conformance import StoreConformance

    class TestMyStore(StoreConformance):
        def make_store(self, codec, path):
            return MyStore(codec=codec, folder=path)

``make_store`` gets the codec to use (the suite registers its own data and
effect types) and an empty temporary folder; it returns a fresh, empty
store (or an awaitable of one). Every test runs on asyncio and trio when the
anyio pytest plugin is in auto mode with both backends pinned (see the
repository's root ``conftest.py``); otherwise mark the class ``anyio``.

What is checked: create / load / list / delete; unknown ids; compare-and-set
(stale and future revisions conflict and change nothing); atomic batches (a
failing or unregistered effect writes nothing); application data and effects
round-trip; reading at every earlier revision; the audit log, including each
batch's ``refused`` (the steps that refused, and why) and ``trace`` exactly as
applied; large sessions; many concurrent appliers losing no update.

This module imports pytest; import it from tests only.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import pytest

from stepmachine import (
    Annotate,
    AppendMessage,
    AudioPart,
    Codec,
    ConfigurationError,
    ConflictError,
    DocumentPart,
    Effect,
    EffectError,
    ImagePart,
    Message,
    ReplaceConversation,
    Session,
    SessionExistsError,
    SessionNotFoundError,
    SetVisibility,
    Store,
    ToolResultPart,
    UpdateData,
)
from stepmachine.extend import Batch, Conversation, Refusal, apply_batch

__all__ = ["ConformanceData", "Increment", "StoreConformance", "Unregistered"]


class ConformanceData(msgspec.Struct, frozen=True):
    """Application data used by the suite."""

    counter: int = 0
    label: str = ""
    tags: tuple[str, ...] = ()


class Increment(Effect, frozen=True, tag="conformance.increment"):
    """An application effect: add ``by`` to the counter."""

    by: int = 1

    def apply(self, session: Session[Any]) -> Session[Any]:
        data = msgspec.structs.replace(session.data, counter=session.data.counter + self.by)
        return msgspec.structs.replace(session, data=data)


class Unregistered(Effect, frozen=True, tag="conformance.unregistered"):
    """An effect type the suite's codec does not register."""

    def apply(self, session: Session[Any]) -> Session[Any]:
        return session


def _batch(session: Session[Any], effects: list[Effect], step: str = "test") -> Batch[Effect]:
    return Batch(
        session_id=session.id,
        revision=session.revision + 1,
        step=step,
        cycle=session.revision + 1,
        timestamp=1_700_000_000.0 + session.revision,
        effects=tuple(effects),
    )


def _message(index: int, text: str | None = None) -> Message:
    return Message.user(text if text is not None else f"message {index}", id=f"msg-{index}")


PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4 + b"\x00\xff"
"""Image bytes for the media tests (every byte value, a NUL, not valid UTF-8)."""


def _media_message(index: int) -> Message:
    """A user message holding an image, a PDF and audio by bytes, and an image by URL."""
    return Message.user(
        f"look {index}",
        id=f"media-{index}",
        media=[
            ImagePart(media_type="image/png", data=PNG, detail="high", cache=True),
            DocumentPart(media_type="application/pdf", data=b"%PDF-1.7 " + PNG, title="a.pdf"),
            AudioPart(media_type="audio/wav", data=b"RIFF" + bytes(index)),
            ImagePart(url="https://example.com/cat.png"),
        ],
    )


class StoreConformance:
    """Subclass and implement :meth:`make_store`; pytest collects the tests."""

    def make_store(self, codec: Codec[Any], path: Path) -> Store | Awaitable[Store]:
        """Return a fresh, empty store using ``codec``, keeping files under ``path``."""
        raise NotImplementedError

    @pytest.fixture
    async def store(self, tmp_path: Path) -> AsyncIterator[Store]:
        """A fresh store with the suite's codec; closed afterwards."""
        codec = Codec(ConformanceData, effects=[Increment])
        made = self.make_store(codec, tmp_path)
        store = await made if inspect.isawaitable(made) else made
        try:
            yield store
        finally:
            await store.aclose()

    async def _apply(self, store: Store, session: Session[Any], *effects: Effect) -> Session[Any]:
        await store.apply(_batch(session, list(effects)))
        return apply_batch(session, effects)

    # -- lifecycle -------------------------------------------------------------

    async def test_create_and_load(self, store: Store) -> None:
        created = await store.create("s-1", ConformanceData(label="x"), [_message(0)])
        assert created.revision == 0
        loaded = await store.load("s-1")
        assert loaded == created
        assert loaded.data == ConformanceData(label="x")
        assert loaded.conversation == (_message(0),)

    async def test_create_default_data(self, store: Store) -> None:
        created = await store.create("s-1")
        assert created.data == ConformanceData()
        assert await store.load("s-1") == created

    async def test_create_twice_is_an_error(self, store: Store) -> None:
        await store.create("s-1")
        with pytest.raises(SessionExistsError):
            await store.create("s-1")

    async def test_list_and_delete(self, store: Store) -> None:
        assert await store.list_sessions() == []
        for session_id in ["b", "a", "c"]:
            await store.create(session_id)
        assert await store.list_sessions() == ["a", "b", "c"]
        await store.delete("b")
        assert await store.list_sessions() == ["a", "c"]
        with pytest.raises(SessionNotFoundError):
            await store.load("b")

    async def test_unknown_ids(self, store: Store) -> None:
        with pytest.raises(SessionNotFoundError):
            await store.load("missing")
        with pytest.raises(SessionNotFoundError):
            await store.delete("missing")
        with pytest.raises(SessionNotFoundError):
            await store.load_at("missing", 0)
        with pytest.raises(SessionNotFoundError):
            await store.batches("missing")
        ghost = Session(
            id="missing", revision=0, conversation=Conversation(), data=ConformanceData()
        )
        with pytest.raises(SessionNotFoundError):
            await store.apply(_batch(ghost, [Increment()]))

    # -- compare-and-set and atomic batches ------------------------------------

    async def test_apply_advances_revision(self, store: Store) -> None:
        session = await store.create("s-1")
        session = await self._apply(store, session, AppendMessage(_message(1)), Increment(2))
        loaded = await store.load("s-1")
        assert loaded == session
        assert loaded.revision == 1
        assert loaded.data.counter == 2

    async def test_stale_revision_conflicts_and_changes_nothing(self, store: Store) -> None:
        session = await store.create("s-1")
        await self._apply(store, session, Increment())
        with pytest.raises(ConflictError) as info:
            await store.apply(_batch(session, [Increment(100)]))
        assert info.value.expected == 0
        assert info.value.actual == 1
        loaded = await store.load("s-1")
        assert loaded.revision == 1
        assert loaded.data.counter == 1
        assert len(await store.batches("s-1")) == 1

    async def test_future_revision_conflicts(self, store: Store) -> None:
        session = await store.create("s-1")
        ahead = msgspec.structs.replace(session, revision=5)
        with pytest.raises(ConflictError):
            await store.apply(_batch(ahead, [Increment()]))
        assert (await store.load("s-1")).revision == 0

    async def test_failing_effect_writes_nothing(self, store: Store) -> None:
        session = await store.create("s-1", conversation=[_message(0)])
        bad = [AppendMessage(_message(1)), Increment(), Annotate("no-such-id", "ns", {"k": 1})]
        with pytest.raises(EffectError):
            await store.apply(_batch(session, bad))
        assert await store.load("s-1") == session
        assert await store.batches("s-1") == []
        # The same revision is still free for a good batch.
        await self._apply(store, session, AppendMessage(_message(1)))
        assert (await store.load("s-1")).revision == 1

    async def test_unregistered_effect_writes_nothing(self, store: Store) -> None:
        session = await store.create("s-1")
        with pytest.raises(ConfigurationError):
            await store.apply(_batch(session, [Increment(), Unregistered()]))
        assert await store.load("s-1") == session

    # -- data, time travel, audit ----------------------------------------------

    async def test_kernel_and_application_effects_round_trip(self, store: Store) -> None:
        session = await store.create("s-1", conversation=[_message(0)])
        session = await self._apply(
            store,
            session,
            AppendMessage(_message(1, "héllo ✓ \x00 null byte")),
            Annotate("msg-1", "approval", {"decided": True, "who": "ana"}),
            SetVisibility(("msg-0",), to_model=False),
            UpdateData.set(label="seen", tags=("a", "b")),
            Increment(7),
        )
        loaded = await store.load("s-1")
        assert loaded == session
        assert loaded.conversation[1].notes == {"approval": {"decided": True, "who": "ana"}}
        assert loaded.conversation[0].visible_to_model is False
        assert loaded.data == ConformanceData(counter=7, label="seen", tags=("a", "b"))

    async def test_media_round_trip(self, store: Store) -> None:
        """Images, documents and audio (by bytes and by URL) come back equal, byte for
        byte, from load, load_at and the audit log; the same bytes twice are fine."""
        session = await store.create("s-1", conversation=[_media_message(0)])
        result = Message.tool_result(
            ToolResultPart(call_id="c1", content="the chart"),
            id="tool-1",
            media=[ImagePart(media_type="image/png", data=PNG)],
        )
        batch = _batch(session, [AppendMessage(_media_message(1)), AppendMessage(result)])
        await store.apply(batch)
        after = apply_batch(session, batch.effects)
        assert await store.load("s-1") == after
        assert await store.load_at("s-1", 0) == session
        assert await store.load_at("s-1", 1) == after
        assert await store.batches("s-1") == [batch]
        loaded = await store.load("s-1")
        assert loaded.conversation[2].result_media("c1") == (ImagePart("image/png", PNG),)
        parts = loaded.conversation[0].parts
        assert isinstance(parts[1], ImagePart)
        assert parts[1].data == PNG

    async def test_media_survive_compaction(self, store: Store) -> None:
        """A ReplaceConversation keeping a message with media keeps its bytes."""
        session = await store.create("s-1", conversation=[_message(0), _media_message(1)])
        session = await self._apply(store, session, AppendMessage(_message(2)))
        kept = session.conversation[1]
        session = await self._apply(
            store, session, ReplaceConversation((_message(3, "summary"), kept))
        )
        session = await self._apply(store, session, AppendMessage(_media_message(4)))
        assert await store.load("s-1") == session
        assert await store.load_at("s-1", 2) == apply_batch(
            await store.load_at("s-1", 1), (ReplaceConversation((_message(3, "summary"), kept)),)
        )
        assert (await store.load("s-1")).conversation[1] == kept

    async def test_load_at_every_revision(self, store: Store) -> None:
        session = await store.create("s-1")
        history = [session]
        for index in range(12):
            session = await self._apply(store, session, AppendMessage(_message(index)), Increment())
            history.append(session)
        for expected in history:
            assert await store.load_at("s-1", expected.revision) == expected
        with pytest.raises(ValueError, match="revision"):
            await store.load_at("s-1", 13)
        with pytest.raises(ValueError, match="revision"):
            await store.load_at("s-1", -1)

    async def test_audit_log(self, store: Store) -> None:
        session = await store.create("s-1")
        sent = []
        for index in range(5):
            batch = _batch(session, [AppendMessage(_message(index))], step=f"step-{index % 2}")
            await store.apply(batch)
            sent.append(batch)
            session = apply_batch(session, batch.effects)
        assert await store.batches("s-1") == sent
        assert await store.batches("s-1", after=3) == sent[3:]
        assert await store.batches("s-1", after=5) == []

    async def test_audit_log_keeps_refusals_and_trace(self, store: Store) -> None:
        """``batches()`` returns each batch's ``refused`` and ``trace`` as applied, exactly."""
        session = await store.create("s-1")
        trails: list[tuple[tuple[Refusal, ...], str | None]] = [
            ((Refusal("inference", "the conversation ends on an assistant message"),), None),
            ((), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            (
                (
                    Refusal("tools", 'no "open" calls, \\ none'),
                    Refusal("approval ✓ 承認", 'ünïcödé 🚦 \n\t\x00 ["]'),
                    Refusal("budget", "w" * 5000),
                    Refusal("", ""),
                ),
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
            ),
            ((), None),
        ]
        sent = []
        for index, (refused, trace) in enumerate(trails):
            batch = msgspec.structs.replace(
                _batch(session, [AppendMessage(_message(index))], step=f"step-{index}"),
                refused=refused,
                trace=trace,
            )
            await store.apply(batch)
            sent.append(batch)
            session = apply_batch(session, batch.effects)
        got = await store.batches("s-1")
        assert [(b.refused, b.trace) for b in got] == trails
        assert got == sent
        assert await store.batches("s-1", after=2) == sent[2:]
        assert await store.load("s-1") == session

    async def test_large_session(self, store: Store) -> None:
        session = await store.create("big")
        big_text = "x" * 1_000_000
        session = await self._apply(store, session, AppendMessage(_message(0, big_text)))
        for start in range(1, 2001, 100):
            effects: list[Effect] = [AppendMessage(_message(i)) for i in range(start, start + 100)]
            session = await self._apply(store, session, *effects)
        loaded = await store.load("big")
        assert loaded == session
        assert len(loaded.conversation) == 2001
        assert loaded.conversation[0].text == big_text

    async def test_deleted_id_can_be_created_again(self, store: Store) -> None:
        session = await store.create("s-1")
        await self._apply(store, session, Increment())
        await store.delete("s-1")
        again = await store.create("s-1")
        assert again.revision == 0
        assert again.data.counter == 0
        assert await store.batches("s-1") == []

    # -- concurrency ------------------------------------------------------------

    async def test_concurrent_appliers_lose_nothing(self, store: Store) -> None:
        await store.create("shared")
        writers, per_writer = 8, 15
        acknowledged: list[tuple[int, int]] = []

        async def writer(number: int) -> None:
            for index in range(per_writer):
                while True:
                    current = await store.load("shared")
                    message = _message(number * 1000 + index)
                    try:
                        await store.apply(_batch(current, [AppendMessage(message), Increment()]))
                    except ConflictError:
                        await anyio.lowlevel.checkpoint()
                        continue
                    acknowledged.append((number, index))
                    break

        async with anyio.create_task_group() as tg:
            for number in range(writers):
                tg.start_soon(writer, number)

        final = await store.load("shared")
        total = writers * per_writer
        assert len(acknowledged) == total
        assert final.revision == total
        assert final.data.counter == total
        ids = [m.id for m in final.conversation]
        assert sorted(ids) == sorted(f"msg-{n * 1000 + i}" for n, i in acknowledged)
        assert [b.revision for b in await store.batches("shared")] == list(range(1, total + 1))
