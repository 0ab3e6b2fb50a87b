"""ExternalEvents: waiting, submitting, and consuming every event exactly once, in order."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import pytest
from _scans import context, counted, tool_loop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import (
    AppendMessage,
    Continue,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    Session,
    StateMachine,
    Store,
    StoredDataError,
    ToolCallPart,
    submit,
)
from stepmachine.extend import YieldReason, counter_ids, history_problems, note_value, read_record
from stepmachine.operations._events import (
    EventRecord,
    ExternalEvents,
    WaitMarker,
    consumed_events,
    pending_events,
    submit_event,
    wait_for,
)
from stepmachine.stores import MemoryStore
from stepmachine.testing import FunctionModel, make_session, reply, run_step


def event_message(event_id: str, kind: str, payload: Any, *, consumed: bool = False) -> Message:
    note: dict[str, Any] = {
        "event": {"id": event_id, "kind": kind, "payload": payload, "submitted_at": 1.0}
    }
    if consumed:
        note["consumed"] = True
    return Message(
        id=f"events:{event_id}",
        role="system",
        parts=(),
        notes={"events": note},
        visible_to_model=False,
        visible_to_user=False,
    )


def echo(request: ModelRequest) -> ModelResponse:
    return reply(f"seen: {request.messages[-1].text}")


# -- single step ---------------------------------------------------------------------------


async def test_pending_events_are_consumed_in_order_in_one_batch() -> None:
    session = make_session(
        Message.assistant("hello", id="a0"),
        event_message("e1", "message", "stop that"),
        event_message("e2", "job_done", {"job": 7}),
        event_message("e0", "old", None, consumed=True),
    )
    check = await run_step(ExternalEvents(), session)
    assert check.continued
    assert [m.text for m in check.new_messages] == [
        "[event message] stop that",
        '[event job_done] {"job":7}',
    ]
    assert pending_events(check.session) == []
    assert [e.id for e in consumed_events(check.session)] == ["e1", "e2", "e0"]
    assert check.session.message("events:e1").notes["events"]["delivered_as"] == "id1"  # type: ignore[union-attr]


async def test_waits_on_a_marker_and_a_matching_event_satisfies_it() -> None:
    rt = Runtime(ids=counter_ids("x"))
    base = make_session(Message.user("start the job", id="u0"), Message.assistant("ok", id="a0"))
    waiting = wait_for("a0", "job_done").apply(base)
    check = await run_step(ExternalEvents(), runtime=rt, session=waiting)
    assert check.yielded
    assert not check.effects
    reason = check.outcome.reason  # type: ignore[union-attr]
    assert reason.kind == YieldReason.AWAITING_EVENT
    assert reason.data["kinds"] == ["job_done"]
    # an event of another kind is delivered, but the wait goes on
    other = AppendMessage(event_message("e1", "chat", "hi")).apply(waiting)
    check = await run_step(ExternalEvents(), runtime=rt, session=other)
    assert check.continued
    assert (await run_step(ExternalEvents(), runtime=rt, session=check.session)).yielded
    done = AppendMessage(event_message("e2", "job_done", {"ok": True})).apply(check.session)
    check = await run_step(ExternalEvents(), runtime=rt, session=done)
    assert check.continued
    assert check.session.message("a0").notes["events"]["satisfied_by"] == "e2"  # type: ignore[union-attr]
    assert (await run_step(ExternalEvents(), runtime=rt, session=check.session)).refused


async def test_wait_when_predicate_and_render() -> None:
    op = ExternalEvents(
        wait_when=lambda s: not any(m.role == "user" for m in s.conversation),
        render=lambda e: None if e.kind == "ping" else f"{e.kind}!",
    )
    empty = make_session()
    assert (await run_step(op, empty)).yielded
    session = make_session(event_message("e1", "ping", None), event_message("e2", "hello", None))
    check = await run_step(op, session)
    assert [m.text for m in check.new_messages] == ["hello!"]
    assert check.session.message("events:e1").notes["events"]["delivered_as"] is None  # type: ignore[union-attr]


async def test_events_wait_while_tool_calls_are_open() -> None:
    asking = Message(id="a1", role="assistant", parts=(ToolCallPart.of("c1", "x", {}),))
    session = make_session(Message.user("go", id="u0"), asking, event_message("e1", "msg", "hi"))
    assert (await run_step(ExternalEvents(), session)).refused


# -- submitting ------------------------------------------------------------------------------


async def test_submit_event_persists_and_ignores_duplicate_ids(store: Store) -> None:
    await store.create("s")
    first = await submit_event(store, "s", "webhook", {"n": 1}, event_id="w1")
    again = await submit_event(store, "s", "webhook", {"n": 2}, event_id="w1")
    generated = await submit_event(store, "s", "webhook", [1, 2])
    assert first.accepted
    assert not again.accepted
    assert generated.accepted
    session = await store.load("s")
    events = pending_events(session)
    assert [(e.id, e.payload) for e in events] == [("w1", {"n": 1}), (generated.event_id, [1, 2])]
    assert not session.visible_to_model  # events are hidden until consumed
    batches = await store.batches("s")
    assert [b.step for b in batches] == ["events.submit", "events.submit"]


async def test_a_whole_run_consumes_events_then_waits(store: Store) -> None:
    await store.create("s", conversation=[Message.user("hi", id="u0")])
    model = FunctionModel(echo)
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    machine = StateMachine(
        [
            ExternalEvents(wait_when=lambda s: s.conversation[-1].role == "assistant"),
            ModelInference(),
        ]
    )
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == YieldReason.DONE
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == YieldReason.AWAITING_EVENT
    await submit_event(store, "s", "message", "what's up?", event_id="m1")
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == YieldReason.DONE
    assert report.session.conversation[-1].text == "seen: [event message] what's up?"
    assert model.calls == 2
    assert not history_problems(report.session.visible_to_model)


# -- exactly once, in order: property test ---------------------------------------------------

actions = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(min_value=0, max_value=12)),
        st.tuples(st.just("run"), st.just(0)),
        st.tuples(st.just("concurrent"), st.integers(min_value=1, max_value=4)),
    ),
    min_size=1,
    max_size=12,
)


def agent() -> StateMachine[Any]:
    """A fresh machine: events, then a model that answers every delivered event."""
    return StateMachine([ExternalEvents(), ModelInference()], max_conflicts=64)


def delivered_ids(session: Session[Any]) -> list[str]:
    return [
        m.notes["events"]["event_id"]
        for m in session.conversation
        if "event_id" in m.notes.get("events", {})
    ]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=actions)
async def test_every_event_is_consumed_exactly_once_in_submission_order(
    script: list[tuple[str, int]],
) -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.assistant("ready", id="a0")])
    runtime = Runtime(store=store, model=FunctionModel(echo), ids=counter_ids())
    counter = 0

    async def submit_one(event_number: int) -> None:
        await anyio.lowlevel.checkpoint()
        await submit_event(store, "s", "message", f"n{event_number}", event_id=f"e{event_number}")

    for action, argument in script:
        if action == "submit":
            await submit_one(argument)  # repeated ids are duplicates
        elif action == "run":
            await agent().run(runtime, "s")
        else:
            async with anyio.create_task_group() as tg:
                for _ in range(argument):
                    counter += 1
                    tg.start_soon(submit_one, 100 + counter)
                tg.start_soon(agent().run, runtime, "s")
                tg.start_soon(submit_one, 100 + counter)  # a racing duplicate
    await agent().run(runtime, "s")

    session = await store.load("s")
    submitted = [
        m.notes["events"]["event"]["id"]
        for m in session.conversation
        if "event" in m.notes.get("events", {})
    ]
    assert len(submitted) == len(set(submitted))  # duplicates were ignored
    assert pending_events(session) == []
    assert delivered_ids(session) == submitted  # each once, in submission order
    # the audit log marks each event consumed exactly once
    marks = [
        effect.message_id
        for batch in await store.batches("s")
        for effect in batch.effects
        if isinstance(effect, msgspec.Struct)
        and getattr(effect, "values", {}).get("consumed") is True
    ]
    assert sorted(marks) == sorted(f"events:{i}" for i in submitted)
    assert not history_problems(session.visible_to_model)


async def test_submit_is_the_only_way_in_and_it_is_a_kernel_effect(store: Store) -> None:
    await store.create("s")
    receipt = await submit_event(store, "s", "k", None, event_id="x")
    session = await submit(store, "s", [wait_for("events:x", "k")])
    assert receipt.revision == 1
    assert session.revision == 2


# -- stored shapes and cost ------------------------------------------------------------------


async def test_events_and_markers_stored_before_records_were_typed_still_read() -> None:
    old_marker = Message.assistant("waiting", id="a0")
    old_marker = msgspec.structs.replace(
        old_marker, notes={"events": {"awaiting": ["job"], "satisfied_by": None}}
    )
    consumed = event_message("e0", "job", "x", consumed=True)
    consumed = msgspec.structs.replace(
        consumed,
        notes={"events": {**consumed.notes["events"], "consumed_at": 2, "delivered_as": None}},
    )
    session = make_session("hi", consumed, old_marker, event_message("e1", "job", {"n": 1}))
    assert [e.id for e in consumed_events(session)] == ["e0"]
    assert [e.id for e in pending_events(session)] == ["e1"]
    check = await run_step(ExternalEvents(), session)
    assert check.continued
    marker = check.session.message("a0")
    assert marker is not None
    assert read_record(marker.notes, "events", WaitMarker) == WaitMarker(["job"], "e1")
    event = check.session.message("events:e1")
    assert event is not None
    assert read_record(event.notes, "events", EventRecord, key="event") == EventRecord(
        "e1", "job", {"n": 1}, 1.0
    )
    assert pending_events(check.session) == []


def test_a_damaged_event_raises_naming_the_message() -> None:
    broken = Message(
        id="events:e9",
        role="system",
        parts=(),
        notes={"events": {"event": {"id": "e9"}}},  # no kind
        visible_to_model=False,
        visible_to_user=False,
    )
    with pytest.raises(StoredDataError, match=r"message 'events:e9'.*EventRecord"):
        pending_events(make_session("hi", broken))


async def test_events_read_no_more_of_a_longer_history() -> None:
    """The step reads the messages with notes in its namespace, not every message."""
    reads = []
    for turns in (5, 200):
        marker = msgspec.structs.replace(
            Message.assistant("wait", id="m0"),
            notes={"events": note_value(WaitMarker(awaiting=["job"]))},
        )
        session = make_session(
            event_message("e0", "job", "old", consumed=True),
            *tool_loop(turns),
            marker,
            event_message("e1", "job", "new"),
        )
        session, conversation = counted(session)
        outcome = await ExternalEvents().run(context(session))
        assert isinstance(outcome, Continue)
        assert [e.id for e in pending_events(session)] == ["e1"]
        reads.append(conversation.read)
    assert reads[0] == reads[1] < 30


async def test_a_cycle_reads_no_more_after_200_events_consumed_than_after_5() -> None:
    """Each consumption leaves a cursor: a cycle reads what came after it, not every event.

    Reading every message with notes in the namespace cost two messages per event
    ever consumed (the event and its delivery); the marker set before them all is
    still found (the cursor lists it) and the last event satisfies it.
    """
    from stepmachine import Codec

    reads = []
    for consumed in (5, 200):
        rt = Runtime(ids=counter_ids("x"))
        session = make_session(Message.user("go", id="u0"), Message.assistant("ok", id="a0"))
        session = wait_for("a0", "job_done").apply(session)
        for n in range(consumed):
            session = AppendMessage(event_message(f"e{n}", "chat", n)).apply(session)
            check = await run_step(ExternalEvents(), runtime=rt, session=session)
            assert check.continued
            session = check.session
            if n % 50 == 0:  # as loaded from a store: the index is rebuilt
                session = Codec().decode_session(Codec().encode_session(session))
        assert (await run_step(ExternalEvents(), runtime=rt, session=session)).yielded
        session = AppendMessage(event_message("last", "job_done", {"ok": True})).apply(session)
        session, conversation = counted(session)
        outcome = await ExternalEvents().run(context(session))
        assert isinstance(outcome, Continue)
        assert [e.id for e in pending_events(session)] == ["last"]
        reads.append(conversation.read)
        satisfied = [e for e in outcome.effects if getattr(e, "message_id", None) == "a0"]
        assert [e.values["satisfied_by"] for e in satisfied] == ["last"]  # type: ignore[attr-defined]
    assert reads[0] == reads[1], reads


async def test_a_marker_set_later_on_an_earlier_message_is_seen_after_a_load() -> None:
    from stepmachine import Codec

    session = make_session(Message.user("go", id="u0"), Message.assistant("ok", id="a0"))
    session = AppendMessage(event_message("e1", "chat", "hi")).apply(session)
    check = await run_step(ExternalEvents(), session)
    assert check.continued
    session = wait_for("a0", "job_done").apply(check.session)
    assert (await run_step(ExternalEvents(), session)).yielded  # live: the marker is noted last
    codec: Codec[Any] = Codec()
    loaded = codec.decode_session(codec.encode_session(session))
    assert (await run_step(ExternalEvents(), loaded)).yielded


async def test_a_marker_set_again_on_a_message_that_held_one_is_seen_live_and_loaded() -> None:
    """A marker satisfied by an earlier event, set again on the same message after that
    consumption: the message already had notes in the namespace (listed where it was
    first noted, behind the cursor); the new wait is seen all the same."""
    from stepmachine import Codec

    session = make_session(Message.user("go", id="u0"), Message.assistant("ok", id="a0"))
    session = wait_for("a0", "first").apply(session)
    session = AppendMessage(event_message("e0", "first", "hi")).apply(session)
    check = await run_step(ExternalEvents(), session)
    assert check.continued
    session = wait_for("a0", "job_done").apply(check.session)
    codec: Codec[Any] = Codec()
    loaded = codec.decode_session(codec.encode_session(session))
    for each in (session, loaded):
        check = await run_step(ExternalEvents(), each)
        assert check.yielded
        assert check.outcome.reason.data["message_id"] == "a0"  # type: ignore[union-attr]


def _decision(check: Any) -> tuple[str, list[Any], Any]:
    """What a cycle decided: the outcome's kind, its effects, and the yield's data."""
    reason = getattr(check.outcome, "reason", None)
    effects = [msgspec.to_builtins(effect) for effect in check.effects]
    return type(check.outcome).__name__, effects, reason.data if reason is not None else None


def _reference(session: Session[Any]) -> tuple[list[str], list[str]]:
    """The pending events and the open waits, found by reading every message."""
    pending, waiting = [], []
    for message in session.conversation:
        note = message.notes.get("events")
        if not isinstance(note, dict):
            continue
        if "event" in note and not note.get("consumed"):
            pending.append(note["event"]["id"])
        if "awaiting" in note and not note.get("satisfied_by"):
            waiting.append(message.id)
    return pending, waiting


# One thing happening to a session: an event submitted, a cycle of ExternalEvents, a
# wait set on the n-th message (counted from the end), a message of the conversation, or
# the session stored and loaded again.
session_actions = st.lists(
    st.one_of(
        st.tuples(st.just("event"), st.sampled_from(["chat", "job_done"])),
        st.tuples(st.just("cycle"), st.just("")),
        st.tuples(st.just("wait"), st.sampled_from(["", "job_done", "chat"]), st.integers(0, 9)),
        st.tuples(st.just("say"), st.just("")),
        st.tuples(st.just("load"), st.just("")),
    ),
    max_size=25,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=session_actions)
async def test_a_loaded_session_decides_as_the_live_one(script: list[tuple[Any, ...]]) -> None:
    """Events, consumptions and waits set on any message (the latest, or an earlier one,
    one that held a wait before, a delivered event): after every step the cycle of
    a session loaded from a store decides exactly as the cycle of the live session, and
    both see every pending event and every open wait (as a reading of every message does)."""
    from stepmachine import Codec

    codec: Codec[Any] = Codec()

    def runtime() -> Runtime:  # ids from the start again: the two cycles compared agree
        return Runtime(ids=counter_ids(f"x{count}-"), clock=lambda: 1.0)

    session = make_session(Message.user("go", id="u0"), Message.assistant("ok", id="a0"))
    count = 0
    for count, action in enumerate(script, start=1):  # runtime() reads count
        if action[0] == "event":
            session = AppendMessage(event_message(f"e{count}", action[1], count)).apply(session)
        elif action[0] == "say":
            session = AppendMessage(Message.user(f"more {count}", id=f"m{count}")).apply(session)
        elif action[0] == "wait":
            # on a message of the conversation (a delivered event's included), not on an
            # event's own hidden message: its note holds the event's records
            shown = [m for m in session.conversation if m.role != "system"]
            target = shown[max(0, len(shown) - 1 - action[2])]
            kinds = (action[1],) if action[1] else ()
            session = wait_for(target.id, *kinds).apply(session)
        elif action[0] == "load":
            session = codec.decode_session(codec.encode_session(session))
        else:
            session = (await run_step(ExternalEvents(), runtime=runtime(), session=session)).session
        loaded = codec.decode_session(codec.encode_session(session))
        live = await run_step(ExternalEvents(), runtime=runtime(), session=session)
        again = await run_step(ExternalEvents(), runtime=runtime(), session=loaded)
        assert _decision(live) == _decision(again), action
        pending, waiting = _reference(session)
        assert [e.id for e in pending_events(session)] == pending
        assert [e.id for e in pending_events(loaded)] == pending
        if not pending and waiting:
            assert live.yielded
            assert live.outcome.reason.data["message_id"] == waiting[-1]  # type: ignore[union-attr]
