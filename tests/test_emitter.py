"""Emitters: ordered delivery, backpressure, gone readers; EventSink stamping."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import pytest

from stepmachine import (
    Emitter,
    Event,
    RecordingEmitter,
    StepApplied,
    StreamEmitter,
    TextDelta,
    ToolFinished,
    ToolStarted,
    Yielded,
)
from stepmachine.extend import EventSink, NullEmitter


def event(n: int) -> Event:
    return Event(session_id="s", revision=0, seq=n, data=TextDelta(str(n)))


@contextlib.asynccontextmanager
async def stream_emitter(max_buffer: int = 256) -> AsyncIterator[StreamEmitter]:
    """A StreamEmitter whose two ends are closed afterwards."""
    emitter = StreamEmitter(max_buffer=max_buffer)
    try:
        yield emitter
    finally:
        await emitter.aclose()
        await emitter.receive.aclose()


async def test_stream_emitter_delivers_in_order() -> None:
    async with stream_emitter(max_buffer=100) as emitter:
        for n in range(20):
            await emitter.emit(event(n))
        await emitter.aclose()
        received = [e async for e in emitter.receive]
        assert received == [event(n) for n in range(20)]


async def test_stream_emitter_concurrent_reader_sees_everything_in_order() -> None:
    async with stream_emitter(max_buffer=1) as emitter:
        received: list[Event] = []

        async def read() -> None:
            async with emitter.receive:
                received.extend([item async for item in emitter.receive])

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            for n in range(50):
                await emitter.emit(event(n))
            await emitter.aclose()
        assert received == [event(n) for n in range(50)]


async def test_stream_emitter_applies_backpressure() -> None:
    async with stream_emitter(max_buffer=2) as emitter:
        emitted: list[int] = []

        async def produce() -> None:
            for n in range(4):
                await emitter.emit(event(n))
                emitted.append(n)

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            await anyio.wait_all_tasks_blocked()
            # the buffer holds two; the third emit waits for the reader
            assert emitted == [0, 1]
            assert emitter.receive.statistics().tasks_waiting_send == 1
            assert emitter.receive.statistics().current_buffer_used == 2

            assert await emitter.receive.receive() == event(0)
            await anyio.wait_all_tasks_blocked()
            assert emitted == [0, 1, 2]  # one read made room for exactly one more
            assert emitter.receive.statistics().tasks_waiting_send == 1

            assert await emitter.receive.receive() == event(1)
            await anyio.wait_all_tasks_blocked()
            assert emitted == [0, 1, 2, 3]
        assert emitter.receive.statistics().tasks_waiting_send == 0
        assert [emitter.receive.receive_nowait() for _ in range(2)] == [event(2), event(3)]


async def test_stream_emitter_drops_silently_once_reader_closed() -> None:
    async with stream_emitter(max_buffer=1) as emitter:
        await emitter.receive.aclose()
        for n in range(5):  # more than the buffer: would block if not dropped
            assert await emitter.emit(event(n)) is None


async def test_stream_emitter_unblocks_a_waiting_emit_when_reader_closes() -> None:
    async with stream_emitter(max_buffer=1) as emitter:
        done: list[int] = []

        async def produce() -> None:
            for n in range(3):
                await emitter.emit(event(n))
                done.append(n)

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            await anyio.wait_all_tasks_blocked()
            assert done == [0]  # blocked on the second emit
            await emitter.receive.aclose()
        assert done == [0, 1, 2]  # the rest were dropped without error


async def test_stream_emitter_aclose_ends_the_readers_stream() -> None:
    async with stream_emitter() as emitter:
        await emitter.emit(event(0))
        await emitter.aclose()
        assert await emitter.receive.receive() == event(0)
        with pytest.raises(anyio.EndOfStream):
            await emitter.receive.receive()
        # emitting after the producer closed is dropped too, never raised
        assert await emitter.emit(event(1)) is None


async def test_null_emitter_drops_everything() -> None:
    emitter: Emitter = NullEmitter()
    assert await emitter.emit(event(0)) is None
    sink = EventSink(emitter, "s", 0)
    await sink.emit(TextDelta("x"))
    assert vars(emitter) == {}  # it keeps nothing


async def test_a_skipped_event_takes_its_sequence_number_as_an_emitted_one_does() -> None:
    """``drops`` says a sink has nobody to show events to; ``skip`` advances the sequence
    as ``emit`` does, so a step that skips building a dropped event numbers the rest alike."""
    assert EventSink(NullEmitter(), "s", 0).drops
    emitter = RecordingEmitter()
    sink = EventSink(emitter, "s", 0)
    assert not sink.drops
    sink.skip()
    await sink.emit(TextDelta("a"))
    emitted = RecordingEmitter()
    other = EventSink(emitted, "s", 0)
    await other.emit(TextDelta("skipped"))
    await other.emit(TextDelta("a"))
    assert [e.seq for e in emitter.events] == [emitted.events[1].seq] == [1]


async def test_recording_emitter_keeps_events_and_filters_by_type() -> None:
    emitter = RecordingEmitter()
    sink = EventSink(emitter, "s", 3)
    await sink.emit(ToolStarted("c1", "t"))
    await sink.emit(TextDelta("a"))
    await sink.emit(ToolFinished("c1", "t", is_error=False))
    assert [type(e.data) for e in emitter.events] == [ToolStarted, TextDelta, ToolFinished]
    assert emitter.of_type(TextDelta) == [TextDelta("a")]
    assert emitter.of_type(Yielded) == []


async def test_event_sink_stamps_session_revision_and_sequence() -> None:
    emitter = RecordingEmitter()
    sink = EventSink(emitter, "sess", 7)
    await sink.emit(TextDelta("a"))
    await sink.emit(TextDelta("b"))
    await sink.emit(StepApplied("step", 8, "continue", 1))
    assert [(e.session_id, e.revision, e.seq) for e in emitter.events] == [
        ("sess", 7, 0),
        ("sess", 7, 1),
        ("sess", 7, 2),
    ]
    assert emitter.events[0].data == TextDelta("a")


async def test_event_sink_restarts_seq_after_follow_new_revision() -> None:
    emitter = RecordingEmitter()
    sink = EventSink(emitter, "sess", 0)
    await sink.emit(TextDelta("a"))
    await sink.emit(TextDelta("b"))
    sink.follow(1)
    await sink.emit(TextDelta("c"))
    sink.follow(1)  # same revision: the sequence goes on, (revision, seq) stays unique
    await sink.emit(TextDelta("d"))
    sink.follow(5)
    await sink.emit(Yielded("done"))
    stamps = [(e.revision, e.seq) for e in emitter.events]
    assert stamps == [(0, 0), (0, 1), (1, 0), (1, 1), (5, 0)]
    assert len(set(stamps)) == len(stamps)
    assert sink.revision == 5


def test_event_data_tags_are_stable() -> None:
    import msgspec

    encoded = msgspec.json.encode(
        [
            TextDelta("t"),
            ToolStarted("c", "n"),
            ToolFinished("c", "n", True),
            StepApplied("s", 1, "continue", 2),
            Yielded("done"),
        ]
    )
    assert encoded == (
        b'[{"kind":"text_delta","text":"t"},'
        b'{"kind":"tool_started","call_id":"c","name":"n"},'
        b'{"kind":"tool_finished","call_id":"c","name":"n","is_error":true},'
        b'{"kind":"step_applied","step":"s","new_revision":1,"status":"continue","effects":2},'
        b'{"kind":"yielded","reason":"done","message":""}]'
    )


async def test_sink_over_a_null_emitter_keeps_counting_and_a_subclass_still_receives() -> None:
    """A NullEmitter's sink builds no events, yet its sequence advances as if it did;
    a subclass of NullEmitter is an emitter like any other and receives every event."""

    class Kept(NullEmitter):
        def __init__(self) -> None:
            self.events: list[Event] = []

        async def emit(self, event: Event) -> None:
            self.events.append(event)

    quiet = EventSink(NullEmitter(), "s", 3)
    await quiet.emit(TextDelta("a"))
    await quiet.emit(TextDelta("b"))
    assert quiet._seq == 2
    kept = Kept()
    sink = EventSink(kept, "s", 3)
    await sink.emit(TextDelta("a"))
    await sink.emit(TextDelta("b"))
    assert [(e.revision, e.seq, e.data) for e in kept.events] == [
        (3, 0, TextDelta("a")),
        (3, 1, TextDelta("b")),
    ]
