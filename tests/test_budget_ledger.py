"""Tool-call limits from the ledger: the same counts as the records, read in constant cost.

The reference is :func:`stepmachine.operations._budget._counted_usage` (every record,
O(history), the way for sessions written before ledgers counted tool calls); the
property drives real machines (Budget, InvalidCalls, Tools, HistoryGuard,
ModelInference) through histories with refusals, replies an invalid-call retry hid,
SUPERSEDES copies, repeated call ids and new turns, and compares both, per scope.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import pytest
from _scans import context as scan_context
from _scans import counted
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import (
    AppendMessage,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    Session,
    StateMachine,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    Tools,
    Usage,
    submit,
    tool,
)
from stepmachine._ledger import LEDGER, LedgerCorrection, run_ledgers
from stepmachine.extend import (
    InferenceAttempts,
    InferenceReceipt,
    Ledger,
    Spent,
    counter_ids,
    latest_ledger,
    next_ledger,
    note_value,
)
from stepmachine.operations import FEEDBACK, HistoryGuard, InvalidCalls
from stepmachine.operations._budget import (
    SUPERSEDES,
    Budget,
    Limits,
    Scope,
    _counted_usage,
    _ledger_tool_calls,
    _positions_of,
)
from stepmachine.stores import MemoryStore
from stepmachine.testing import FunctionModel, make_session, run_step

SCOPES: tuple[Scope, ...] = ("session", "turn", "run")


@tool(side_effects="pure")
def ping() -> str:
    """Ping."""
    return "pong"


# -- Spent: old ledgers still decode -------------------------------------------------------


def test_a_ledger_stored_before_tool_calls_decodes_with_none_counted() -> None:
    old = msgspec.json.decode(b"[3, 10, 5]", type=Spent)
    assert old == Spent(3, 10, 5, 0)
    assert msgspec.json.encode(Spent(1, 2, 3, 4)) == b"[1,2,3,4]"
    stored = {"session": [3, 10, 5], "turn": [1, 1, 1], "revision": 4}
    ledger = msgspec.convert(stored, Ledger)
    assert ledger.session.tool_calls == 0
    assert not ledger.tools  # so readers count the tool calls from the records


def test_a_session_whose_ledgers_do_not_count_tool_calls_is_counted_from_the_records() -> None:
    old = Ledger(Spent(1, 10, 5), Spent(1, 10, 5), revision=0, turn_start="u0")  # tools=False
    receipt = InferenceReceipt(attempts=1, revision=0, ledger=old)
    reply = Message(
        id="a1",
        role="assistant",
        parts=(ToolCallPart.of("c1", "ping", {}),),
        notes={"inference": note_value(receipt)},
    )
    session = make_session("go", reply)
    assert not latest_ledger(session).tools
    assert _ledger_tool_calls(session, "session", 0, "budget") is None
    budget = Budget(per_session=Limits(tool_calls=1))
    assert budget.remaining(session, 0) == {"tool_calls": 0}  # counted from the records


# -- the property ----------------------------------------------------------------------------

# What the model answers, one reply per request: calls of "ping" (valid), of a near-miss
# name (InvalidCalls repairs it: a SUPERSEDES copy), of a name nothing is close to (not
# repairable: the retry hides the reply, its calls never run), a call id repeated within
# the reply or from an earlier reply (a repair gives fresh ids: a copy), or text.
REPLY = st.sampled_from(["ping", "ping2", "near", "unknown", "dup", "again", "text"])


class _Model:
    def __init__(self, script: list[str]) -> None:
        self.script = script
        self.turn = 0

    def __call__(self, request: ModelRequest) -> ModelResponse:
        kind = self.script[self.turn] if self.turn < len(self.script) else "text"
        self.turn += 1
        n = self.turn
        parts: tuple[Any, ...]
        if kind == "ping":
            parts = (ToolCallPart.of(f"c{n}", "ping", {}),)
        elif kind == "ping2":
            parts = (ToolCallPart.of(f"c{n}a", "ping", {}), ToolCallPart.of(f"c{n}b", "ping", {}))
        elif kind == "near":
            parts = (ToolCallPart.of(f"c{n}", "Ping", {}), ToolCallPart.of(f"d{n}", "ping", {}))
        elif kind == "unknown":
            parts = (ToolCallPart.of(f"c{n}", "zzz_nothing", {}),)
        elif kind == "dup":
            parts = (ToolCallPart.of(f"c{n}", "ping", {}), ToolCallPart.of(f"c{n}", "ping", {}))
        elif kind == "again":
            parts = (ToolCallPart.of("c1", "ping", {}),)  # the first reply's id, once more
        else:
            parts = (TextPart("done"),)
        return ModelResponse(parts=parts, usage=Usage(2, 1), finish_reason="stop", attempts=1)


def _machine(limits: dict[str, Limits]) -> StateMachine[Any]:
    return StateMachine(
        [
            Budget(**limits),
            InvalidCalls(policy="repair"),
            Tools([ping]),
            HistoryGuard(),
            ModelInference(),
        ]
    )


def _reference_over(
    session: Session[Any], scope: Scope, run_start: int, allowed: int, call: ToolCallPart
) -> bool:
    """Whether ``call`` is over ``allowed`` by the records (the rule before the ledger)."""
    positions = _positions_of(session.conversation, call)
    counted_calls = _counted_usage(session, scope, run_start, "budget").tool_call_positions
    return any(
        position in positions and place >= allowed for place, position in enumerate(counted_calls)
    )


def _check(session: Session[Any], run_starts: list[int]) -> None:
    """Ledger counts equal the records' for every scope and every run start so far, and
    ``check_call``'s answer for every visible call agrees with the records'."""
    assert latest_ledger(session).tools
    for scope in SCOPES:
        for start in run_starts if scope == "run" else run_starts[-1:]:
            fast = _ledger_tool_calls(session, scope, start, "budget")
            slow = len(_counted_usage(session, scope, start, "budget").tool_calls)
            assert fast == slow, (scope, start)
    calls = [c for m in session.conversation if m.visible_to_model for c in m.tool_calls]
    for call in calls:
        for scope in SCOPES:
            for allowed in (0, 1, 2, 4):
                limits = Limits(tool_calls=allowed)
                budget = Budget(**{f"per_{scope}": limits})
                start = run_starts[-1]
                fast = budget._over(session, start, scope, allowed, call)
                assert fast == _reference_over(session, scope, start, allowed, call), (
                    scope,
                    allowed,
                    call.call_id,
                )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    runs=st.lists(
        st.tuples(st.sampled_from(["user", "feedback"]), st.lists(REPLY, max_size=5)),
        min_size=1,
        max_size=4,
    ),
    per_run=st.none() | st.integers(0, 4),
    per_turn=st.none() | st.integers(0, 4),
    per_session=st.none() | st.integers(0, 6),
)
async def test_the_tool_call_ledger_agrees_with_counting_the_records(
    runs: list[tuple[str, list[str]]],
    per_run: int | None,
    per_turn: int | None,
    per_session: int | None,
) -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u0")])
    limits = {
        f"per_{scope}": Limits(model_calls=12, tool_calls=allowed)
        for scope, allowed in (("run", per_run), ("turn", per_turn), ("session", per_session))
    }
    run_starts: list[int] = []
    for number, (prompt, script) in enumerate(runs):
        if number:
            notes = {FEEDBACK: {"by": "test"}} if prompt == "feedback" else {}
            message = Message(
                id=f"m{number}", role="user", parts=(TextPart(f"more {number}"),), notes=notes
            )
            await submit(store, "s", [AppendMessage(message)])
        run_starts.append((await store.load("s")).revision)
        runtime = Runtime(
            store=store, model=FunctionModel(_Model(script)), ids=counter_ids(f"r{number}-")
        )
        await _machine(limits).run_report(runtime, "s")
        _check(await store.load("s"), run_starts)


# -- the writers of corrections ------------------------------------------------------------


async def test_a_refused_call_stops_counting_in_the_ledger() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u0")])
    model = FunctionModel(_Model(["ping2", "ping2", "text"]))
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    report = await _machine({"per_turn": Limits(tool_calls=3)}).run_report(runtime, "s")
    session = report.session
    refused = [m for m in session.conversation if LEDGER in m.notes]
    assert len(refused) == 1  # the last refusal's result carries the corrected ledger
    correction = msgspec.convert(refused[0].notes[LEDGER], LedgerCorrection)
    assert correction.ledger.session.tool_calls == 3  # four asked for, one refused
    assert correction.ledger.refused_by == ["budget"]
    assert _ledger_tool_calls(session, "turn", 0, "budget") == 3
    # Another budget step's name counts the refused call: from the records, as before.
    assert _ledger_tool_calls(session, "turn", 0, "other") is None


async def test_a_retry_that_hides_a_reply_takes_its_calls_out_of_the_ledger() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u0")])
    model = FunctionModel(_Model(["ping", "unknown", "text"]))
    runtime = Runtime(store=store, model=model, ids=counter_ids())
    session = await _machine({"per_session": Limits(tool_calls=5)}).run(runtime, "s")
    hidden = [m for m in session.conversation if not m.visible_to_model]
    assert [c.name for m in hidden for c in m.tool_calls] == ["zzz_nothing"]
    assert _ledger_tool_calls(session, "session", 0, "budget") == 1
    assert len(_counted_usage(session, "session", 0, "budget").tool_calls) == 1


# -- constant cost ---------------------------------------------------------------------------


def _tool_turns(turns: int) -> list[Message]:
    """``turns`` answered tool calls in one user turn, each reply with its receipt and a
    ledger counting its call (the call of reply ``i`` made at revision ``i``)."""
    messages = [Message.user("go", id="u")]
    for i in range(turns):
        spent = Spent(i + 1, 0, 0, i + 1)
        ledger = Ledger(spent, spent, revision=i, turn_start="u", tools=True)
        receipt = InferenceReceipt(attempts=1, revision=i, ledger=ledger)
        call = ToolCallPart.of(f"c{i}", "ping", {})
        notes = {"inference": note_value(receipt)}
        messages.append(Message(id=f"a{i}", role="assistant", parts=(call,), notes=notes))
        if i < turns - 1:
            result = ToolResultPart.for_call(call, "pong")
            messages.append(Message.tool_result(result, id=f"r{i}"))
    return messages


@pytest.mark.parametrize("scope", SCOPES)
async def test_tool_call_limits_read_no_more_of_a_longer_history(scope: Scope) -> None:
    """``run`` and ``check_call`` under a tool-call limit read back to the latest model call
    (per run: to the run's start; this run began three model calls ago), at any length."""
    reads = []
    for turns in (10, 400):
        session = make_session(*_tool_turns(turns), revision=turns)
        open_call = session.conversation[-1].tool_calls[0]
        budget = Budget(**{f"per_{scope}": Limits(tool_calls=turns)})
        session, conversation = counted(session)
        ctx = dataclasses.replace(scan_context(session), run_start_revision=turns - 3)
        assert budget.check_call(ctx, open_call) is None  # the last of ``turns`` calls
        over = Budget(**{f"per_{scope}": Limits(tool_calls=turns - 1)})
        wanted = "exhausted" if scope != "run" else None  # the run asked for three
        objection = over.check_call(ctx, open_call)
        assert (objection is not None and wanted in objection) if wanted else objection is None
        outcome = await budget.run(ctx)
        assert outcome.__class__.__name__ == "Refuse"
        reads.append(conversation.read)
    assert reads[0] == reads[1] < 60, reads


def _reply(message_id: str, session: Session[Any], *calls: ToolCallPart) -> Message:
    """An assistant reply as ModelInference records it: its ledger counts its calls."""
    usage = Usage(1, 1)
    ledger = next_ledger(session, 1, usage, tool_calls=len(calls))
    receipt = InferenceReceipt(attempts=1, revision=session.revision, usage=usage, ledger=ledger)
    notes = {"inference": note_value(receipt)}
    return Message(id=message_id, role="assistant", parts=calls, notes=notes)


def _grow(session: Session[Any], *messages: Message) -> Session[Any]:
    return make_session(*session.conversation, *messages, revision=session.revision + 1)


def _agrees(session: Session[Any]) -> None:
    for scope in SCOPES:
        for start in range(session.revision + 1):
            fast = _ledger_tool_calls(session, scope, start, "budget")
            slow = len(_counted_usage(session, scope, start, "budget").tool_calls)
            assert fast == slow, (scope, start)


async def test_a_copy_made_after_a_new_turn_began_counts_its_calls_in_that_turn() -> None:
    """A user wrote while the reply's calls waited; a repair's copy lands in the new turn."""
    session = make_session("go")
    session = _grow(session, _reply("a1", session, ToolCallPart.of("c1", "Ping", {})))
    session = _grow(session, Message.user("and now?", id="u1"))
    check = await run_step(InvalidCalls(policy="repair"), session, others=[Tools([ping])])
    after = check.session
    copy = after.conversation[-1]
    assert SUPERSEDES in copy.notes
    assert LEDGER in copy.notes  # the copy carries the latest ledger
    assert _ledger_tool_calls(after, "turn", 0, "budget") == 1
    _agrees(after)


async def test_hiding_a_reply_with_a_repeated_call_id_takes_its_open_calls_out() -> None:
    session = make_session("go")
    call = ToolCallPart.of("c1", "ping", {})
    session = _grow(session, _reply("a1", session, call))
    session = _grow(session, Message.tool_result(ToolResultPart.for_call(call, "pong"), id="r1"))
    session = _grow(session, _reply("a2", session, call, ToolCallPart.of("c2", "ping", {})))
    check = await run_step(HistoryGuard(), session, others=[Tools([ping])])
    after = check.session
    hidden = [m.id for m in after.conversation if not m.visible_to_model]
    assert _ledger_tool_calls(after, "session", 0, "budget") == len(
        _counted_usage(after, "session", 0, "budget").tool_calls
    ), hidden
    _agrees(after)


async def test_a_refusal_in_a_later_run_of_calls_made_before_it_is_added_back_for_that_run() -> (
    None
):
    """Calls asked for in one run and refused in the next: the later run never counted them,
    so its count from the ledger is not made negative (the correction is added back)."""
    session = make_session("go")
    calls = (ToolCallPart.of("c1", "ping", {}), ToolCallPart.of("c2", "ping", {}))
    session = _grow(session, _reply("a1", session, *calls))  # made at revision 0
    session = _grow(session, Message.user("still there?", id="u1"))  # the next run, at 2
    check = await run_step(Budget(per_session=Limits(tool_calls=0)), session)
    after = check.session
    assert sum(1 for m in after.conversation if m.role == "tool") == 2  # both refused
    assert _ledger_tool_calls(after, "session", 0, "budget") == 0
    assert _ledger_tool_calls(after, "run", 2, "budget") == 0
    after = _grow(after, _reply("a2", after, ToolCallPart.of("c3", "ping", {})))
    assert _ledger_tool_calls(after, "run", 2, "budget") == 1
    _agrees(after)


async def test_a_correction_after_a_model_call_of_the_run_is_added_back_by_the_run() -> None:
    """The run made a model call (a summariser's, while the calls waited) before the
    refusal: its ledger is the run's, so the correction of the earlier run's calls comes
    after the run's start and is added back (``run_ledgers``)."""
    session = make_session("go")
    calls = (ToolCallPart.of("c1", "ping", {}), ToolCallPart.of("c2", "ping", {}))
    session = _grow(session, _reply("a1", session, *calls))  # made at revision 0
    session = _grow(session, Message.user("still there?", id="u1"))
    session = make_session(*session.conversation, revision=2)  # the next run begins at 2
    last = session.conversation[-1]
    attempt = InferenceAttempts(
        attempts=1, revision=2, ledger=next_ledger(session, 1, Usage(), on=last)
    )
    noted = msgspec.structs.replace(last, notes={"summariser": note_value(attempt)})
    session = make_session(*session.conversation[:-1], noted, revision=3)
    check = await run_step(Budget(per_session=Limits(tool_calls=0)), session)
    after = check.session
    assert run_ledgers(after, 2).added_back == 2
    assert _ledger_tool_calls(after, "run", 2, "budget") == 0
    assert _ledger_tool_calls(after, "session", 0, "budget") == 0
    _agrees(after)
