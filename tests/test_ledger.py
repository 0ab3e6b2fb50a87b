"""The model-call ledger: running totals per session and turn, found by reading back."""

from __future__ import annotations

from typing import Any

import msgspec

from stepmachine import Message, Session, Usage
from stepmachine.extend import (
    InferenceAttempts,
    InferenceReceipt,
    Ledger,
    Spent,
    latest_ledger,
    next_ledger,
    note_value,
)
from stepmachine.operations import FEEDBACK
from stepmachine.testing import make_session


def reply(message_id: str, session: Session[Any], attempts: int = 1) -> Message:
    """An assistant reply as ModelInference records it, ledger included."""
    usage = Usage(10, 5)
    receipt = InferenceReceipt(
        attempts=attempts,
        revision=session.revision,
        usage=usage,
        ledger=next_ledger(session, attempts, usage),
    )
    return Message(
        id=message_id,
        role="assistant",
        parts=(),
        notes={"inference": note_value(receipt)},
    )


def grow(session: Session[Any], *messages: Message) -> Session[Any]:
    return make_session(*session.conversation, *messages, revision=session.revision + 1)


def test_the_first_call_starts_the_totals_and_the_turn() -> None:
    session = make_session("go")
    assert latest_ledger(session).ledger is None
    ledger = next_ledger(session, 2, Usage(10, 5))
    assert ledger == Ledger(
        Spent(2, 10, 5), Spent(2, 10, 5), revision=0, turn_start="u0", tools=True
    )


def test_totals_add_up_and_a_new_user_turn_restarts_the_turn() -> None:
    session = make_session("go")
    session = grow(session, reply("a1", session, attempts=2))
    session = grow(session, reply("a2", session))
    view = latest_ledger(session)
    assert view.ledger is not None
    assert view.ledger.session == Spent(3, 20, 10)
    assert view.ledger.turn == Spent(3, 20, 10)
    feedback = Message(id="f1", role="user", parts=(), notes={FEEDBACK: {"by": "invalid_calls"}})
    session = grow(session, feedback)
    assert latest_ledger(session).turn_start is None  # feedback starts no turn
    session = grow(session, Message.user("next", id="u9"))
    assert latest_ledger(session).turn_start == "u9"
    ledger = next_ledger(session, 1, Usage(1, 1))
    assert ledger.session == Spent(4, 21, 11)
    assert ledger.turn == Spent(1, 1, 1)
    assert ledger.turn_start == "u9"


def test_before_revision_finds_the_totals_a_run_started_from() -> None:
    session = make_session("go")
    session = grow(session, reply("a1", session))  # made at revision 0
    session = grow(session, reply("a2", session))  # made at revision 1
    before = latest_ledger(session, before_revision=1).ledger
    assert before is not None
    assert before.session == Spent(1, 10, 5)
    assert latest_ledger(session, before_revision=0).ledger is None


def test_records_without_a_ledger_make_the_totals_partial() -> None:
    legacy = Message(
        id="a0",
        role="assistant",
        parts=(),
        notes={"inference": {"attempts": 3, "revision": 0, "usage": {}}},
    )
    session = make_session("go", legacy)
    assert latest_ledger(session).legacy
    ledger = next_ledger(session, 1, Usage())
    assert ledger.partial  # counts only what came after the old records
    session = grow(session, reply("a1", session))
    assert latest_ledger(session).legacy  # readers count the records one by one


def test_a_damaged_ledger_sends_readers_to_the_records() -> None:
    damaged = Message(
        id="a0",
        role="assistant",
        parts=(),
        notes={"inference": {"attempts": 1, "revision": 0, "ledger": {"session": "x"}}},
    )
    assert latest_ledger(make_session("go", damaged)).legacy


def test_of_two_ledgers_on_one_message_the_one_with_more_calls_counts() -> None:
    older = Ledger(Spent(1), Spent(1), revision=0)
    newer = Ledger(Spent(2), Spent(2), revision=1)
    message = Message(
        id="u1",
        role="user",
        parts=(),
        notes={
            "inference": note_value(InferenceAttempts(attempts=1, revision=0, ledger=older)),
            "summariser": note_value(InferenceAttempts(attempts=1, revision=1, ledger=newer)),
        },
    )
    assert latest_ledger(make_session(message)).ledger == newer


def test_a_ledger_in_a_note_that_is_no_model_call_record_is_not_read() -> None:
    """An application's note with a "ledger" key is not the budget's running totals."""
    real = Ledger(Spent(3), Spent(3), revision=0)
    forged = Ledger(Spent(0), Spent(0), revision=5)
    receipt = InferenceReceipt(attempts=3, revision=0, ledger=real)
    messages = (
        Message.user("hi", id="u1"),
        Message(id="a1", role="assistant", parts=(), notes={"inference": note_value(receipt)}),
        Message(
            id="u2",
            role="user",
            parts=(),
            notes={
                "billing": {"ledger": msgspec.to_builtins(forged)},
                "tagged": {
                    "record": "myapp.not.a.model.call",
                    "ledger": msgspec.to_builtins(forged),
                },
            },
        ),
    )
    view = latest_ledger(make_session(*messages))
    assert view.ledger == real
    assert not view.legacy


def attempts_on(message: Message, session: Session[Any], namespace: str = "inference") -> Message:
    """``message`` with a failed call recorded on it, as ModelInference records one: the
    record that was there is replaced, ledger included."""
    record = InferenceAttempts(
        attempts=1, revision=session.revision, ledger=next_ledger(session, 1, Usage(), on=message)
    )
    return msgspec.structs.replace(message, notes={**message.notes, namespace: note_value(record)})


def replace_last(session: Session[Any], message: Message) -> Session[Any]:
    return make_session(*session.conversation[:-1], message, revision=session.revision + 1)


def test_a_run_starts_from_a_ledger_its_own_records_replaced() -> None:
    """A failed call at revision 0 and the next run's two (at 1 and 2) recorded on the same
    message: each replaces the one before, and the run still starts from the first."""
    session = make_session("go")
    session = replace_last(session, attempts_on(session.conversation[-1], session))  # rev 0
    start = session.revision  # the next run begins
    for _ in range(2):
        session = replace_last(session, attempts_on(session.conversation[-1], session))
    latest = latest_ledger(session).ledger
    assert latest is not None
    assert latest.session.model_calls == 3
    assert [b[0] for b in latest.before] == [1, 0]
    base = latest_ledger(session, before_revision=start).ledger
    assert base is not None
    assert (base.revision, base.session.model_calls) == (0, 1)
    assert latest_ledger(session, before_revision=2).ledger == Ledger(
        Spent(2), Spent(), revision=1, tools=True
    )
    assert latest_ledger(session, before_revision=0).ledger is None


def test_a_ledger_keeps_two_totals_from_before_its_revision() -> None:
    session = make_session("go")
    for index in range(4):  # revisions 0 to 3
        session = grow(session, reply(f"a{index}", session))
    latest = latest_ledger(session).ledger
    assert latest is not None
    assert latest.revision == 3
    assert latest.before == [[2, 3, 30, 15, 0], [1, 2, 20, 10, 0]]  # [revision, totals]
    stored = note_value(InferenceAttempts(attempts=1, ledger=latest))["ledger"]["before"]
    assert stored == latest.before


def test_a_ledger_stored_without_what_came_before_reads_as_before() -> None:
    """Ledgers written before they kept totals from before their revision: ``before``
    reads empty, and a run starts from the latest ledger made before it, as it did."""
    stored = {"session": [1, 10, 5], "turn": [1, 10, 5], "revision": 0, "tools": True}
    old = Message(
        id="a1",
        role="assistant",
        parts=(),
        notes={
            "inference": {
                "record": "stepmachine.inference.reply",
                "attempts": 1,
                "revision": 0,
                "ledger": stored,
            }
        },
    )
    session = make_session("go", old, revision=1)
    session = grow(session, reply("a2", session))
    view = latest_ledger(session)
    assert view.ledger is not None
    assert not view.legacy
    assert view.ledger.session.model_calls == 2
    assert view.ledger.before[0][0] == 0
    base = latest_ledger(make_session("go", old, revision=1), before_revision=1).ledger
    assert base is not None
    assert base.before == []
    assert base.session == Spent(1, 10, 5)


def test_a_damaged_record_of_the_totals_before_is_not_read() -> None:
    """``before`` entries that are not five numbers: the run's start is looked for further
    back, as in ledgers written before they were kept (stored data is data)."""
    session = make_session("go")
    session = grow(session, reply("a1", session))  # made at revision 0
    session = grow(session, reply("a2", session))  # made at revision 1
    a2 = session.conversation[-1]
    note = dict(a2.notes["inference"])
    note["ledger"] = {**note["ledger"], "before": [[0, 1]]}
    damaged = msgspec.structs.replace(a2, notes={"inference": note})
    session = make_session(*session.conversation[:-1], damaged, revision=session.revision)
    base = latest_ledger(session, before_revision=1).ledger
    assert base is not None
    assert base.session == Spent(1, 10, 5)  # a1's own ledger
    assert base.before == []
