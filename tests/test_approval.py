"""Approval: policy, check_call, run(), the decision API, whole runs, and invariant 5.

Invariant 5 (approval cannot be bypassed) is attacked by a hypothesis property
test: random step orders, random model outputs and random decisions, with every
tool execution checked against the approvals recorded before it ran.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from _scans import counted, tool_loop
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from stepmachine import (
    Annotate,
    AppendMessage,
    ConfigurationError,
    ConflictError,
    Continue,
    Effect,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Operation,
    ReplaceConversation,
    Runtime,
    Session,
    SetVisibility,
    StateMachine,
    StepContext,
    StepmachineError,
    Store,
    StoredDataError,
    TextPart,
    Tool,
    ToolCallPart,
    ToolContext,
    ToolResultPart,
    Tools,
    Yield,
    submit,
    tool,
)
from stepmachine._emitter import EventSink
from stepmachine.extend import (
    EDITED_ARGUMENTS,
    Batch,
    NullEmitter,
    check_history,
    counter_ids,
    effective_arguments,
    fingerprint,
    note_value,
    read_record,
)
from stepmachine.operations._approval import (
    Approval,
    ApprovalDecision,
    ApprovalError,
    ApprovalRequest,
    PendingCall,
    always_allowed,
    approve,
    deny,
    recorded_decision,
)
from stepmachine.stores import MemoryStore
from stepmachine.testing import FunctionModel, call, make_session, reply, run_step

REPO = Path(__file__).resolve().parent.parent

# -- fixtures and helpers ---------------------------------------------------------------------


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class Execution:
    """One run of an instrumented tool."""

    name: str
    call_id: str
    arguments: dict[str, Any]
    time: float
    decisions_before: int = 0


@dataclass
class Ledger:
    """Every tool execution, and how many decisions had been made when it ran."""

    executions: list[Execution] = field(default_factory=list)
    decisions: int = 0

    def record(self, name: str, ctx: ToolContext, arguments: dict[str, Any]) -> None:
        now = ctx.runtime.clock()
        self.executions.append(Execution(name, ctx.call_id, arguments, now, self.decisions))


def file_tools(ledger: Ledger) -> dict[str, Tool]:
    """``delete_file`` (needs approval in these tests) and ``read_file`` (does not)."""

    @tool(thread=False)
    def delete_file(path: str, ctx: ToolContext) -> str:
        """Delete a file."""
        ledger.record("delete_file", ctx, {"path": path})
        return f"deleted {path}"

    @tool(thread=False)
    def read_file(path: str, ctx: ToolContext) -> str:
        """Read a file."""
        ledger.record("read_file", ctx, {"path": path})
        return f"contents of {path}"

    return {t.name: t for t in (delete_file, read_file)}


def agent(request: ModelRequest) -> ModelResponse:
    """A stateless model: a user's ``"<tool> <path>"`` becomes that call; results are summed up.

    Call ids derive from the user message id, so they stay unique even after a
    compaction hid earlier turns.
    """
    last = request.messages[-1]
    if last.role == "user":
        tool_name, _, path = last.text.partition(" ")
        return call(ToolCallPart.of(f"call-{last.id}", tool_name, {"path": path}))
    return reply("final: " + " | ".join(r.content for r in last.tool_results))


def assistant_with(*calls: ToolCallPart, message_id: str = "a1") -> Message:
    return Message(id=message_id, role="assistant", parts=calls)


def pending_session(*calls: ToolCallPart) -> Session[Any]:
    return make_session("go", assistant_with(*calls))


def with_decision(
    part: ToolCallPart, outcome: str, *, name: str = "approval", **extra: Any
) -> ToolCallPart:
    record = {
        "outcome": outcome,
        "fingerprint": fingerprint(part.name, effective_arguments(part)),
        "tool": part.name,
        "by": "alice",
        "message": "",
        "expires_at": None,
        "always": False,
        **extra,
    }
    notes = {**part.notes, name: {"decision": record}}
    return msgspec.structs.replace(part, notes=notes)


def context(session: Session[Any], clock: Callable[[], float] | None = None) -> StepContext[Any]:
    return StepContext(
        session=session,
        runtime=Runtime(clock=clock or FakeClock()),
        events=EventSink(NullEmitter(), session.id, session.revision),
    )


def message_of(session: Session[Any], call_id: str) -> str:
    """The id of the visible message holding the tool call ``call_id``."""
    for message in session.visible_to_model:
        if any(c.call_id == call_id for c in message.tool_calls):
            return message.id
    raise AssertionError(f"no visible call {call_id!r}")


def call_part(session: Session[Any], call_id: str) -> ToolCallPart:
    for message in session.visible_to_model:
        for part in message.tool_calls:
            if part.call_id == call_id:
                return part
    raise AssertionError(f"no visible call {call_id!r}")


DELETE = ToolCallPart.of("c1", "delete_file", {"path": "a.txt"})
READ = ToolCallPart.of("c2", "read_file", {"path": "b.txt"})


# -- policy and configuration -----------------------------------------------------------------


def test_policy_forms() -> None:
    session = pending_session(DELETE, READ)
    by_names = Approval(["delete_file"])
    by_tool = Approval([file_tools(Ledger())["delete_file"]])
    by_str = Approval("delete_file")
    by_one_tool = Approval(file_tools(Ledger())["delete_file"])
    by_callable = Approval(lambda c, s: c.arguments.get("path", "").endswith(".txt"))
    for policy in (by_names, by_tool, by_str, by_one_tool):
        assert policy.needs_approval(DELETE, session)
        assert not policy.needs_approval(READ, session)
    assert by_callable.needs_approval(DELETE, session)
    assert by_callable.needs_approval(READ, session)
    assert Approval(["x"], name="gate").name == "gate"


def test_bad_policy_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="approval policy"):
        Approval([1])  # type: ignore[list-item]
    with pytest.raises(ConfigurationError, match="approval policy"):
        Approval(42)  # type: ignore[arg-type]


def test_approval_error_is_a_stepmachine_error() -> None:
    assert issubclass(ApprovalError, StepmachineError)


# -- check_call --------------------------------------------------------------------------------


def test_check_call_objects_without_a_valid_approval() -> None:
    gate = Approval(["delete_file"])
    session = pending_session(DELETE, READ)
    objection = gate.check_call(context(session), DELETE)
    assert objection is not None
    assert "c1" in objection
    assert fingerprint("delete_file", {"path": "a.txt"}) in objection
    assert gate.check_call(context(session), READ) is None


def test_check_call_accepts_a_matching_approval_only() -> None:
    gate = Approval(["delete_file"])
    approved = with_decision(DELETE, "approved")
    assert gate.check_call(context(pending_session(approved)), approved) is None
    other = with_decision(DELETE, "approved", fingerprint=fingerprint("delete_file", {"path": "b"}))
    assert gate.check_call(context(pending_session(other)), other) is not None
    # arguments edited after the approval: the fingerprint no longer matches
    changed = msgspec.structs.replace(
        approved, notes={**approved.notes, EDITED_ARGUMENTS: {"arguments": {"path": "/etc"}}}
    )
    assert gate.check_call(context(pending_session(changed)), changed) is not None
    # approved for another tool name with the same arguments: no
    renamed = msgspec.structs.replace(approved, name="delete_all")
    assert Approval(["delete_all"]).check_call(context(pending_session(renamed)), renamed)


def test_check_call_honours_expiry_against_the_runtime_clock() -> None:
    gate = Approval(["delete_file"])
    approved = with_decision(DELETE, "approved", expires_at=1_010.0)
    session = pending_session(approved)
    assert gate.check_call(context(session, FakeClock(1_000.0)), approved) is None
    assert gate.check_call(context(session, FakeClock(1_010.0)), approved) is not None
    # A damaged decision fails loudly, naming where it is; it never approves.
    malformed = with_decision(DELETE, "approved", expires_at="never")
    with pytest.raises(StoredDataError, match=r"'approval' / 'decision' of session .*'c1'"):
        gate.check_call(context(pending_session(malformed)), malformed)


def test_check_call_objects_to_denied_calls_even_without_policy() -> None:
    denied = with_decision(READ, "denied")
    assert Approval(["delete_file"]).check_call(context(pending_session(denied)), denied)


def test_always_allow_covers_later_calls_and_hidden_messages() -> None:
    gate = Approval(["delete_file"])
    earlier = with_decision(
        ToolCallPart.of("old", "delete_file", {"path": "x"}), "approved", always=True
    )
    hidden = msgspec.structs.replace(
        assistant_with(earlier, message_id="a0"), visible_to_model=False
    )
    session = make_session(hidden, "go", assistant_with(DELETE))
    assert always_allowed(session, now=0.0) == {"delete_file"}
    assert gate.check_call(context(session), DELETE) is None
    expiring = with_decision(
        ToolCallPart.of("old", "delete_file", {"path": "x"}),
        "approved",
        always=True,
        expires_at=1_005.0,
    )
    session = make_session(assistant_with(expiring, message_id="a0"), assistant_with(DELETE))
    assert gate.check_call(context(session, FakeClock(1_000.0)), DELETE) is None
    assert gate.check_call(context(session, FakeClock(1_006.0)), DELETE) is not None
    # another namespace's "always" does not count
    assert always_allowed(session, name="other", now=0.0) == frozenset()


async def test_notes_of_the_wrong_shape_approve_nothing_and_say_where_they_are() -> None:
    gate = Approval(["delete_file"])
    junk = msgspec.structs.replace(DELETE, notes={"approval": {"decision": "approved"}})
    with pytest.raises(StoredDataError, match="not an object"):
        recorded_decision(junk)
    with pytest.raises(StoredDataError, match="ApprovalDecision"):
        gate.check_call(context(pending_session(junk)), junk)
    # The tool step asks the gate, which fails loudly: the call never runs.
    ledger = Ledger()
    tools = Tools(file_tools(ledger).values())
    with pytest.raises(StoredDataError):
        await run_step(tools, pending_session(junk), others=[gate])
    assert ledger.executions == []


def test_decisions_stored_before_records_were_typed_still_read() -> None:
    """The dict shapes written by earlier versions (no tag) convert to the records."""
    old = {
        "outcome": "approved",
        "fingerprint": fingerprint("delete_file", {"path": "a.txt"}),
        "tool": "delete_file",
        "by": "alice",
        "reason": "ticket 7",
        "message": "",
        "decided_at": 500,
        "expires_at": None,
        "always": True,
        "edited": False,
    }
    request = {"fingerprint": old["fingerprint"], "requested_at": 400.0}
    part = msgspec.structs.replace(
        DELETE, notes={"approval": {"decision": old, "request": request}}
    )
    assert recorded_decision(part) == ApprovalDecision(
        outcome="approved",
        fingerprint=str(old["fingerprint"]),
        tool="delete_file",
        by="alice",
        reason="ticket 7",
        decided_at=500.0,
        always=True,
    )
    assert read_record(part.notes, "approval", ApprovalRequest, key="request") == (
        ApprovalRequest(fingerprint=str(old["fingerprint"]), requested_at=400.0)
    )
    session = pending_session(part)
    assert Approval(["delete_file"]).check_call(context(session), part) is None
    assert always_allowed(session, now=0.0) == {"delete_file"}


# -- run() as a single step -----------------------------------------------------------------------


async def test_run_yields_with_the_pending_calls_and_annotates_them_once() -> None:
    gate = Approval(["delete_file"])
    check = await run_step(gate, pending_session(DELETE, READ))
    assert isinstance(check.outcome, Yield)
    reason = check.outcome.reason
    assert reason.kind == "awaiting_approval"
    assert reason.data == {
        "calls": [
            {
                "call_id": "c1",
                "name": "delete_file",
                "arguments": {"path": "a.txt"},
                "fingerprint": fingerprint("delete_file", {"path": "a.txt"}),
            }
        ]
    }
    assert check.effects == (
        Annotate(
            "a1",
            "approval",
            {
                "request": note_value(
                    ApprovalRequest(
                        fingerprint=fingerprint("delete_file", {"path": "a.txt"}),
                        requested_at=check.effects[0].values["request"]["requested_at"],  # type: ignore[attr-defined]
                    )
                )
            },
            call_id="c1",
        ),
    )
    again = await run_step(gate, check.session)
    assert isinstance(again.outcome, Yield)
    assert again.effects == ()  # already requested for this fingerprint


async def test_run_refuses_when_nothing_waits() -> None:
    gate = Approval(["delete_file"])
    assert (await run_step(gate, make_session("hello"))).refused
    assert (await run_step(gate, pending_session(READ))).refused
    assert (await run_step(gate, pending_session(with_decision(DELETE, "approved")))).refused
    answered = make_session(
        "go",
        assistant_with(DELETE),
        Message(id="t1", role="tool", parts=(ToolResultPart("c1", "done"),)),
    )
    assert (await run_step(gate, answered)).refused


async def test_run_answers_denied_calls_with_an_error_result() -> None:
    gate = Approval(["delete_file"])
    denied = with_decision(DELETE, "denied", by="bob", message="that file is needed")
    check = await run_step(gate, pending_session(denied, READ))
    assert isinstance(check.outcome, Continue)
    (message,) = check.new_messages
    (result,) = message.tool_results
    assert result.call_id == "c1"
    assert result.is_error
    assert "denied by bob" in result.content
    assert "that file is needed" in result.content
    assert "Do not retry" in result.content


async def test_run_reports_a_call_whose_arguments_changed_after_approval() -> None:
    gate = Approval(["delete_file"])
    approved = with_decision(DELETE, "approved")
    changed = msgspec.structs.replace(
        approved, notes={**approved.notes, EDITED_ARGUMENTS: {"arguments": {"path": "/etc"}}}
    )
    check = await run_step(gate, pending_session(changed))
    assert isinstance(check.outcome, Yield)
    (item,) = check.outcome.reason.data["calls"]
    assert item["arguments"] == {"path": "/etc"}
    assert item["fingerprint"] == fingerprint("delete_file", {"path": "/etc"})


async def test_pending_lists_what_run_would_report() -> None:
    gate = Approval(["delete_file"])
    session = pending_session(DELETE, READ)
    assert gate.pending(session, now=0.0) == [
        PendingCall("c1", "delete_file", {"path": "a.txt"}, DELETE_FP),
    ]
    assert gate.pending(pending_session(with_decision(DELETE, "approved"))) == []


DELETE_FP = fingerprint("delete_file", {"path": "a.txt"})


async def test_tools_holds_back_unapproved_calls_whatever_the_order() -> None:
    ledger = Ledger()
    tools = Tools(file_tools(ledger).values())
    gate = Approval(["delete_file"])
    check = await run_step(tools, pending_session(DELETE, READ), others=[gate])
    assert [e.name for e in ledger.executions] == ["read_file"]
    assert {r.call_id for m in check.new_messages for r in m.tool_results} == {"c2"}
    held = await run_step(tools, check.session, others=[gate])
    assert held.refused
    approved = await run_step(
        tools, pending_session(with_decision(DELETE, "approved")), others=[gate]
    )
    assert approved.continued
    assert [e.name for e in ledger.executions] == ["read_file", "delete_file"]


# -- the decision API ----------------------------------------------------------------------------


async def new_pending(store: Store, *calls: ToolCallPart, session_id: str = "s1") -> None:
    await store.create(
        session_id, conversation=[Message.user("go", id="u1"), assistant_with(*calls)]
    )


async def test_approve_records_an_annotation_bound_to_the_fingerprint(store: Store) -> None:
    await new_pending(store, DELETE)
    clock = FakeClock(500.0)
    session = await approve(
        store, "s1", "c1", by="alice", reason="ticket 7", expires_at=900.0, clock=clock
    )
    decision = recorded_decision(call_part(session, "c1"))
    assert decision == ApprovalDecision(
        outcome="approved",
        fingerprint=DELETE_FP,
        tool="delete_file",
        by="alice",
        reason="ticket 7",
        message="",
        decided_at=500.0,
        expires_at=900.0,
        always=False,
        edited=False,
    )
    stored = call_part(session, "c1").notes["approval"]["decision"]
    assert stored["record"] == "stepmachine.approval.decision"
    (batch,) = await store.batches("s1")
    assert batch.step == "approval"
    assert batch.cycle == 0
    assert batch.timestamp == 500.0
    (effect,) = batch.effects
    assert isinstance(effect, Annotate)
    assert (effect.message_id, effect.call_id, effect.namespace) == ("a1", "c1", "approval")
    assert await store.load("s1") == session


async def test_approve_with_edited_arguments(store: Store) -> None:
    await new_pending(store, DELETE)
    delete_file = file_tools(Ledger())["delete_file"]
    session = await approve(
        store, "s1", "c1", by="alice", edited_arguments={"path": "tmp/a.txt"}, tool=delete_file
    )
    part = call_part(session, "c1")
    assert part.arguments == {"path": "a.txt"}  # the model's original stays
    assert part.notes[EDITED_ARGUMENTS] == {"arguments": {"path": "tmp/a.txt"}}
    decision = recorded_decision(part)
    assert decision is not None
    assert decision.fingerprint == fingerprint("delete_file", {"path": "tmp/a.txt"})
    assert decision.edited is True
    assert Approval(["delete_file"]).check_call(context(session), part) is None


async def test_edited_arguments_are_validated(store: Store) -> None:
    await new_pending(store, DELETE)
    tools = file_tools(Ledger())
    with pytest.raises(ApprovalError, match="do not validate"):
        await approve(
            store, "s1", "c1", by="a", edited_arguments={"path": 3}, tool=tools["delete_file"]
        )
    with pytest.raises(ApprovalError, match="do not validate"):
        await approve(
            store, "s1", "c1", by="a", edited_arguments={"nope": "x"}, tool=tools["delete_file"]
        )
    with pytest.raises(ApprovalError, match="pass tool="):
        await approve(store, "s1", "c1", by="a", edited_arguments={"path": "x"})
    with pytest.raises(ApprovalError, match="not 'read_file'"):
        await approve(
            store, "s1", "c1", by="a", edited_arguments={"path": "x"}, tool=tools["read_file"]
        )
    assert await store.batches("s1") == []


async def test_decisions_are_validated(store: Store) -> None:
    await new_pending(store, DELETE, READ)
    with pytest.raises(ApprovalError, match="holds no tool call 'nope'"):
        await approve(store, "s1", "nope", by="alice")
    with pytest.raises(ApprovalError, match="names who made it"):
        await approve(store, "s1", "c1", by=" ")
    with pytest.raises(ApprovalError, match="not after now"):
        await approve(store, "s1", "c1", by="alice", expires_at=10.0, clock=FakeClock(10.0))
    await deny(store, "s1", "c1", by="bob", message="no")
    with pytest.raises(ApprovalError, match="was denied by 'bob'"):
        await approve(store, "s1", "c1", by="alice")
    await approve(store, "s1", "c2", by="alice")
    with pytest.raises(ApprovalError, match="approved call cannot be denied"):
        await deny(store, "s1", "c2", by="bob", message="no")
    await submit(
        store,
        "s1",
        [AppendMessage(Message(id="t2", role="tool", parts=(ToolResultPart("c2", "ok"),)))],
    )
    with pytest.raises(ApprovalError, match="not pending"):
        await approve(store, "s1", "c2", by="alice")
    assert len(await store.batches("s1")) == 3  # deny, approve, the result


async def test_stale_approvals_may_be_renewed_or_denied(store: Store) -> None:
    await new_pending(store, DELETE)
    clock = FakeClock(100.0)
    await approve(store, "s1", "c1", by="alice", expires_at=110.0, clock=clock)
    clock.now = 120.0
    session = await approve(store, "s1", "c1", by="alice", expires_at=200.0, clock=clock)
    assert recorded_decision(call_part(session, "c1")).expires_at == 200.0  # type: ignore[union-attr]
    clock.now = 300.0
    session = await deny(store, "s1", "c1", by="bob", message="too late", clock=clock)
    decision = recorded_decision(call_part(session, "c1"))
    assert decision is not None
    assert decision.outcome == "denied"
    assert decision.expires_at is None


async def test_a_denial_wins_over_always_allow(store: Store) -> None:
    second = ToolCallPart.of("c3", "delete_file", {"path": "z"})
    await new_pending(store, DELETE, second)
    await approve(store, "s1", "c1", by="alice", always=True)
    session = await deny(store, "s1", "c3", by="bob", message="not that one")
    gate = Approval(["delete_file"])
    assert gate.check_call(context(session), call_part(session, "c1")) is None
    assert gate.check_call(context(session), call_part(session, "c3")) is not None
    check = await run_step(gate, session)
    assert [r.call_id for m in check.new_messages for r in m.tool_results] == ["c3"]


async def test_a_custom_name_is_the_namespace_and_the_audit_step(store: Store) -> None:
    await new_pending(store, DELETE)
    session = await approve(store, "s1", "c1", by="alice", name="gate")
    assert recorded_decision(call_part(session, "c1"), name="gate") is not None
    assert recorded_decision(call_part(session, "c1")) is None
    assert (
        Approval(["delete_file"], name="gate").check_call(
            context(session), call_part(session, "c1")
        )
        is None
    )
    assert Approval(["delete_file"]).check_call(context(session), call_part(session, "c1"))
    assert [b.step for b in await store.batches("s1")] == ["gate"]


class InterleavingStore:
    """Wraps a store: before the first ``apply``, another writer records a decision."""

    def __init__(self, inner: MemoryStore) -> None:
        self.inner = inner
        self.interfered = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def load(self, session_id: str) -> Session[Any]:
        return await self.inner.load(session_id)

    async def apply(self, batch: Batch[Effect]) -> None:
        if not self.interfered:
            self.interfered = True
            await deny(self.inner, batch.session_id, "c1", by="bob", message="no")
        await self.inner.apply(batch)


async def test_a_racing_decision_is_revalidated_not_overwritten() -> None:
    inner = MemoryStore()
    await new_pending(inner, DELETE)
    racing = InterleavingStore(inner)
    with pytest.raises(ApprovalError, match="was denied by 'bob'"):
        await approve(racing, "s1", "c1", by="alice")  # type: ignore[arg-type]
    decision = recorded_decision(call_part(await inner.load("s1"), "c1"))
    assert decision is not None
    assert decision.outcome == "denied"


async def test_conflicts_are_retried_then_raised() -> None:
    class AlwaysConflicting(InterleavingStore):
        async def apply(self, batch: Batch[Effect]) -> None:
            raise ConflictError(batch.session_id, batch.revision - 1, batch.revision)

    inner = MemoryStore()
    await new_pending(inner, DELETE)
    with pytest.raises(ConflictError):
        await approve(AlwaysConflicting(inner), "s1", "c1", by="alice")  # type: ignore[arg-type]


# -- whole runs ----------------------------------------------------------------------------------


@dataclass
class Agent:
    store: Store
    ledger: Ledger
    tools: dict[str, Tool]
    machine: StateMachine[Any]
    runtime: Runtime
    clock: FakeClock
    model: FunctionModel


def build_agent(store: Store, order: tuple[str, ...] = ("approval", "tools", "inference")) -> Agent:
    ledger = Ledger()
    tools = file_tools(ledger)
    steps: dict[str, Operation[Any]] = {
        "approval": Approval(["delete_file"]),
        "tools": Tools(tools.values()),
        "inference": ModelInference(),
    }
    clock = FakeClock()
    model = FunctionModel(agent)
    runtime = Runtime(store=store, model=model, clock=clock, ids=counter_ids("m"))
    return Agent(
        store, ledger, tools, StateMachine([steps[n] for n in order]), runtime, clock, model
    )


ORDERS = list(itertools.permutations(["approval", "tools", "inference"]))


@pytest.mark.parametrize("order", ORDERS, ids=["-".join(o) for o in ORDERS])
async def test_yield_decide_resume_to_the_final_answer(
    store: Store, order: tuple[str, ...]
) -> None:
    a = build_agent(store, order)
    await store.create("s1", conversation=[Message.user("delete_file a.txt", id="u1")])
    report = await a.machine.run_report(a.runtime, "s1")
    assert report.reason.kind == "awaiting_approval"
    (item,) = report.reason.data["calls"]
    assert item["name"] == "delete_file"
    assert a.ledger.executions == []
    # running again without a decision changes nothing and runs nothing
    again = await a.machine.run_report(a.runtime, "s1")
    assert again.reason.kind == "awaiting_approval"
    assert again.session.revision == report.session.revision
    await approve(store, "s1", item["call_id"], by="alice", reason="looks fine")
    final = await a.machine.run_report(a.runtime, "s1")
    assert final.reason.kind == "done"
    assert [(e.name, e.arguments) for e in a.ledger.executions] == [
        ("delete_file", {"path": "a.txt"})
    ]
    assert final.session.conversation[-1].text == "final: deleted a.txt"
    check_history(final.session.visible_to_model)
    steps = [b.step for b in await store.batches("s1")]
    assert "approval" in steps


async def test_denial_reaches_the_model(store: Store) -> None:
    a = build_agent(store)
    await store.create("s1", conversation=[Message.user("delete_file a.txt", id="u1")])
    report = await a.machine.run_report(a.runtime, "s1")
    (item,) = report.reason.data["calls"]
    await deny(store, "s1", item["call_id"], by="bob", message="keep it", reason="audit")
    final = await a.machine.run_report(a.runtime, "s1")
    assert final.reason.kind == "done"
    assert a.ledger.executions == []
    results = [r for m in final.session.conversation for r in m.tool_results]
    assert len(results) == 1
    assert results[0].is_error
    assert "denied by bob: keep it" in results[0].content
    assert "denied by bob: keep it" in final.session.conversation[-1].text


async def test_always_allow_skips_later_approvals(store: Store) -> None:
    a = build_agent(store)
    await store.create("s1", conversation=[Message.user("delete_file a.txt", id="u1")])
    report = await a.machine.run_report(a.runtime, "s1")
    (item,) = report.reason.data["calls"]
    await approve(store, "s1", item["call_id"], by="alice", always=True)
    assert (await a.machine.run_report(a.runtime, "s1")).reason.kind == "done"
    await submit(store, "s1", [AppendMessage(Message.user("delete_file b.txt", id="u2"))])
    final = await a.machine.run_report(a.runtime, "s1")
    assert final.reason.kind == "done"
    assert [e.arguments["path"] for e in a.ledger.executions] == ["a.txt", "b.txt"]


async def test_expired_approval_asks_again(store: Store) -> None:
    a = build_agent(store)
    await store.create("s1", conversation=[Message.user("delete_file a.txt", id="u1")])
    report = await a.machine.run_report(a.runtime, "s1")
    (item,) = report.reason.data["calls"]
    await approve(
        store, "s1", item["call_id"], by="alice", expires_at=a.clock.now + 10, clock=a.clock
    )
    a.clock.now += 60
    expired = await a.machine.run_report(a.runtime, "s1")
    assert expired.reason.kind == "awaiting_approval"
    assert [c["call_id"] for c in expired.reason.data["calls"]] == [item["call_id"]]
    assert a.ledger.executions == []
    await approve(
        store, "s1", item["call_id"], by="alice", expires_at=a.clock.now + 10, clock=a.clock
    )
    assert (await a.machine.run_report(a.runtime, "s1")).reason.kind == "done"
    assert len(a.ledger.executions) == 1


async def test_arguments_changed_after_approval_are_pending_again(store: Store) -> None:
    a = build_agent(store)
    await store.create("s1", conversation=[Message.user("delete_file a.txt", id="u1")])
    report = await a.machine.run_report(a.runtime, "s1")
    (item,) = report.reason.data["calls"]
    await approve(store, "s1", item["call_id"], by="alice")
    session = await store.load("s1")
    await submit(
        store,
        "s1",
        [
            Annotate(
                message_of(session, item["call_id"]),
                EDITED_ARGUMENTS,
                {"arguments": {"path": "/"}},
                call_id=item["call_id"],
            )
        ],
        step="tamper",
    )
    again = await a.machine.run_report(a.runtime, "s1")
    assert again.reason.kind == "awaiting_approval"
    assert again.reason.data["calls"][0]["arguments"] == {"path": "/"}
    assert a.ledger.executions == []


async def test_edited_arguments_run_instead_of_the_models(store: Store) -> None:
    a = build_agent(store)
    await store.create("s1", conversation=[Message.user("delete_file a.txt", id="u1")])
    report = await a.machine.run_report(a.runtime, "s1")
    (item,) = report.reason.data["calls"]
    await approve(
        store,
        "s1",
        item["call_id"],
        by="alice",
        edited_arguments={"path": "trash/a.txt"},
        tool=a.tools["delete_file"],
    )
    final = await a.machine.run_report(a.runtime, "s1")
    assert final.reason.kind == "done"
    assert [e.arguments for e in a.ledger.executions] == [{"path": "trash/a.txt"}]


def compacted(session: Session[Any], keep: int) -> list[Effect]:
    """A compaction: hide all but the last ``keep`` messages, add a summary, keep the originals."""
    old = session.conversation[:-keep] if keep else session.conversation
    kept = session.conversation[len(old) :]
    hidden = tuple(msgspec.structs.replace(m, visible_to_model=False) for m in old)
    summary = Message(
        id=f"summary-{session.revision}",
        role="user",
        parts=(TextPart("(summary of earlier turns)"),),
        notes={"compaction": {"summarised": [m.id for m in old]}},
    )
    return [ReplaceConversation((*hidden, summary, *kept))]


async def test_decisions_survive_compaction(store: Store) -> None:
    a = build_agent(store)
    await store.create("s1", conversation=[Message.user("delete_file a.txt", id="u1")])
    (item,) = (await a.machine.run_report(a.runtime, "s1")).reason.data["calls"]
    await approve(store, "s1", item["call_id"], by="alice", always=True)
    # a compaction between the decision and the tool run keeps the call's own approval
    session = await store.load("s1")
    await submit(store, "s1", compacted(session, keep=1), step="compaction")
    assert (await a.machine.run_report(a.runtime, "s1")).reason.kind == "done"
    assert len(a.ledger.executions) == 1
    # hide everything (SetVisibility only): "always allow" is still found
    session = await store.load("s1")
    await submit(
        store,
        "s1",
        [
            SetVisibility(tuple(m.id for m in session.conversation), to_model=False),
            AppendMessage(Message.user("delete_file b.txt", id="u2")),
        ],
        step="compaction",
    )
    final = await a.machine.run_report(a.runtime, "s1")
    assert final.reason.kind == "done"
    assert [e.arguments["path"] for e in a.ledger.executions] == ["a.txt", "b.txt"]


async def test_pending_approval_survives_compaction_and_a_fresh_machine(store: Store) -> None:
    a = build_agent(store)
    await store.create("s1", conversation=[Message.user("delete_file a.txt", id="u1")])
    (item,) = (await a.machine.run_report(a.runtime, "s1")).reason.data["calls"]
    session = await store.load("s1")
    await submit(store, "s1", compacted(session, keep=1), step="compaction")
    await approve(store, "s1", item["call_id"], by="alice")
    b = build_agent(store)  # a fresh machine, as in another process
    b.runtime = Runtime(store=store, model=b.model, clock=b.clock, ids=counter_ids("n"))
    final = await b.machine.run_report(b.runtime, "s1")
    assert final.reason.kind == "done"
    assert len(b.ledger.executions) == 1


# -- invariant 5, as a property ------------------------------------------------------------------

DANGEROUS = ("danger_a", "danger_b")
DECISIONS = ("approve", "deny", "edit", "approve_then_change", "none", "always", "expired")


@dataclass
class Oracle:
    """The approvals the test recorded, in order: (call id or None for always, tool, fp, expiry)."""

    approvals: list[tuple[str | None, str, str | None, float | None]] = field(default_factory=list)

    def allows(self, execution: Execution) -> bool:
        ran = fingerprint(execution.name, execution.arguments)
        for call_id, name, fp, expires in self.approvals[: execution.decisions_before]:
            unexpired = expires is None or execution.time < expires
            if call_id is None and name == execution.name and unexpired:
                return True
            if call_id == execution.call_id and fp == ran and unexpired:
                return True
        return False


def numbered_tools(ledger: Ledger) -> dict[str, Tool]:
    def make(tool_name: str) -> Tool:
        def run(n: int, ctx: ToolContext) -> str:
            ledger.record(tool_name, ctx, {"n": n})
            return f"{tool_name} ran with {n}"

        return Tool(run, name=tool_name, thread=False)

    return {name: make(name) for name in ("safe", *DANGEROUS)}


calls_strategy = st.lists(
    st.tuples(st.sampled_from(["safe", *DANGEROUS]), st.integers(0, 3)), min_size=1, max_size=3
)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    order=st.permutations(["approval", "tools", "inference"]),
    plan=st.lists(calls_strategy, min_size=1, max_size=3),
    decisions=st.lists(st.sampled_from(DECISIONS), max_size=10),
)
async def test_no_tool_that_needs_approval_runs_without_a_matching_approval(
    anyio_backend: str,
    order: list[str],
    plan: list[list[tuple[str, int]]],
    decisions: list[str],
) -> None:
    store = MemoryStore()
    ledger = Ledger()
    tools = numbered_tools(ledger)
    clock = FakeClock()

    def model(request: ModelRequest) -> ModelResponse:
        turn = sum(1 for m in request.messages if m.role == "assistant")
        if turn >= len(plan):
            return reply("done")
        return call(
            *(ToolCallPart.of(f"t{turn}-{i}", n, {"n": v}) for i, (n, v) in enumerate(plan[turn]))
        )

    steps: dict[str, Operation[Any]] = {
        "approval": Approval(DANGEROUS),
        "tools": Tools(tools.values()),
        "inference": ModelInference(),
    }
    machine: StateMachine[Any] = StateMachine([steps[n] for n in order])
    runtime = Runtime(store=store, model=FunctionModel(model), clock=clock, ids=counter_ids())
    await store.create("p", conversation=[Message.user("go", id="u")])
    oracle = Oracle()
    todo = list(decisions)

    async def decide(kind: str, item: dict[str, Any]) -> None:
        cid, name, fp = item["call_id"], item["name"], item["fingerprint"]
        if kind == "none":
            return
        if kind == "deny":
            await deny(store, "p", cid, by="bob", message="no")
        elif kind == "edit":
            edited = {"n": item["arguments"]["n"] + 10}
            await approve(store, "p", cid, by="alice", edited_arguments=edited, tool=tools[name])
            oracle.approvals.append((cid, name, fingerprint(name, edited), None))
        elif kind == "expired":
            await approve(store, "p", cid, by="alice", expires_at=clock.now + 5, clock=clock)
            oracle.approvals.append((cid, name, fp, clock.now + 5))
            clock.now += 10
        else:
            await approve(store, "p", cid, by="alice", always=kind == "always")
            oracle.approvals.append((cid, name, fp, None))
            if kind == "always":
                oracle.approvals.append((None, name, None, None))
            if kind == "approve_then_change":
                session = await store.load("p")
                await submit(
                    store,
                    "p",
                    [
                        Annotate(
                            message_of(session, cid),
                            EDITED_ARGUMENTS,
                            {"arguments": {"n": item["arguments"]["n"] + 100}},
                            call_id=cid,
                        )
                    ],
                    step="tamper",
                )
        ledger.decisions = len(oracle.approvals)

    report = await machine.run_report(runtime, "p")
    for _ in range(len(decisions) + 1):
        if report.reason.kind != "awaiting_approval" or not todo:
            break
        for item in report.reason.data["calls"]:
            if todo:
                await decide(todo.pop(0), item)
        report = await machine.run_report(runtime, "p")

    assert report.reason.kind in {"done", "awaiting_approval"}
    dangerous_runs = sum(1 for e in ledger.executions if e.name in DANGEROUS)
    bucket = dangerous_runs if dangerous_runs < 2 else "2+"
    event(f"ends {report.reason.kind}; dangerous runs: {bucket}")
    final = await store.load("p")
    for execution in ledger.executions:
        part = call_part(final, execution.call_id)
        assert effective_arguments(part) == execution.arguments  # it ran what the history says
        if execution.name not in DANGEROUS:
            continue
        assert oracle.allows(execution), (execution, oracle.approvals)
        decision = recorded_decision(part)
        bound = (
            decision is not None
            and decision.outcome == "approved"
            and decision.fingerprint == fingerprint(execution.name, execution.arguments)
            and (decision.expires_at is None or execution.time < decision.expires_at)
        )
        assert bound or execution.name in always_allowed(final, now=execution.time)
    assert len({e.call_id for e in ledger.executions}) == len(ledger.executions)
    if report.reason.kind == "done":
        check_history(final.visible_to_model)


# -- the example ---------------------------------------------------------------------------------


def test_example_demo_runs_in_two_processes() -> None:
    completed = subprocess.run(
        [sys.executable, str(REPO / "examples" / "approval.py"), "demo"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
    )
    assert completed.returncode == 0, completed.stderr
    out = completed.stdout
    assert "awaiting_approval" in out
    assert "send_payment" in out
    assert "approved by" in out
    assert out.count("PAYMENT SENT") == 1  # the tool ran once, in the second process
    assert out.strip().splitlines()[-1].startswith("final answer: ")


# -- constant cost per step (invariant 10) ----------------------------------------------------


async def test_approval_reads_no_more_of_a_longer_history() -> None:
    """``run``, ``check_call``, ``pending`` and ``always_allowed`` read what the index points
    at (open calls, calls with approval notes), not every message."""
    gate = Approval(["delete_file"])
    writer = with_decision(
        ToolCallPart.of("w0", "write_file", {"path": "x"}), "approved", always=True
    )
    reads = []
    for turns in (5, 200):
        session = make_session(
            assistant_with(writer, message_id="w"),
            Message.tool_result(ToolResultPart.for_call(writer, "ok"), id="wr"),
            *tool_loop(turns),
            "delete it",
            assistant_with(DELETE, message_id="last"),
        )
        session, conversation = counted(session)
        ctx = context(session)
        outcome = await gate.run(ctx)
        assert isinstance(outcome, Yield)
        assert gate.check_call(ctx, DELETE) is not None
        assert [p.call_id for p in gate.pending(session, now=0.0)] == ["c1"]
        assert always_allowed(session, now=0.0) == {"write_file"}
        reads.append(conversation.read)
    assert reads[0] == reads[1] < 20
