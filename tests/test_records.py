"""Typed records: registered tags, stable schemas, stored as JSON, read back or refused loudly."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

import stepmachine.operations  # noqa: F401 - registers the operations' record types
from stepmachine import (
    Annotate,
    Codec,
    ConfigurationError,
    Message,
    StoredDataError,
    ToolCallPart,
    Usage,
)
from stepmachine.extend import (
    InferenceAttempts,
    InferenceReceipt,
    InterruptedReply,
    JournalEntry,
    Ledger,
    Record,
    Spent,
    apply_batch,
    journal_entry,
    note_value,
    read_record,
    record_types,
)
from stepmachine.operations import ApprovalDecision, ApprovalRequest, BudgetRefusal
from stepmachine.testing import make_session

# tag -> (required fields, optional fields) as first released. Schema evolution adds
# optional fields only: a required field may never be added, and no field may disappear.
RELEASED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "stepmachine.approval.decision": (
        ("outcome", "fingerprint"),
        ("tool", "by", "reason", "message", "decided_at", "expires_at", "always", "edited"),
    ),
    "stepmachine.approval.request": (("fingerprint",), ("requested_at",)),
    "stepmachine.budget.refusal": (("refused",), ()),
    "stepmachine.compaction.mark": (
        (),
        ("summarised_into", "stuck", "attempts", "revision", "usage", "ledger"),
    ),
    "stepmachine.compaction.summary": (
        ("summarised", "tokens_before", "tokens_after", "trigger", "cut", "revision", "attempts"),
        ("kind", "model", "usage", "summarised_into", "ledger"),
    ),
    "stepmachine.events.consumed": ((), ("consumed", "consumed_at", "delivered_as")),
    "stepmachine.events.cursor": ((), ("waiting",)),
    "stepmachine.events.delivery": (("event_id", "kind"), ()),
    "stepmachine.events.event": (("id", "kind"), ("payload", "submitted_at")),
    "stepmachine.events.wait": (("awaiting",), ("satisfied_by",)),
    "stepmachine.inference.attempts": (
        (),
        ("attempts", "revision", "context_length_exceeded", "interrupted_request", "ledger"),
    ),
    "stepmachine.inference.interrupted": ((), ("interrupted", "ledger")),
    "stepmachine.inference.reply": (
        ("attempts", "revision"),
        ("usage", "model", "finish_reason", "ledger"),
    ),
    "stepmachine.invalid_calls.decision": (("action",), ("problems", "replaced_by")),
    "stepmachine.invalid_calls.feedback": (("feedback_for",), ("problems",)),
    "stepmachine.invalid_calls.repair": (("repaired_from",), ("repairs",)),
    "stepmachine.invalid_calls.skipped": (("skipped",), ()),
    "stepmachine.ledger.correction": (("ledger",), ("removed",)),
    "stepmachine.journal": (
        (),
        (
            "intent",
            "fingerprint",
            "idempotency_key",
            "side_effects",
            "attempt",
            "at",
            "rerun_approved",
            "rerun_attempt",
            "decided_by",
            "decision_note",
        ),
    ),
    "stepmachine.output.answer": ((), ("accepted", "skipped")),
    "stepmachine.output.error": (("error",), ("call_id",)),
    "stepmachine.output.feedback": (("feedback_for",), ()),
    "stepmachine.output.value": (("output", "mode"), ("call_id",)),
}


def fields_of(kind: type[Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    fields = msgspec.structs.fields(kind)
    return (
        tuple(f.name for f in fields if f.required),
        tuple(f.name for f in fields if not f.required),
    )


# -- the rules -------------------------------------------------------------------------------


def test_every_built_in_record_is_registered_with_its_released_schema() -> None:
    registered = {tag: kind for tag, kind in record_types().items() if tag.startswith("stepm")}
    assert sorted(registered) == sorted(RELEASED), "add a new record type to RELEASED"
    for tag, kind in registered.items():
        required, optional = fields_of(kind)
        released_required, released_optional = RELEASED[tag]
        assert required == released_required, f"{tag}: required fields never change"
        assert set(released_optional) <= set(optional), f"{tag}: fields are never removed"
        assert kind.__struct_config__.frozen, tag
        assert kind.__struct_config__.tag_field == "record", tag


def test_the_ledger_inside_records_keeps_its_schema() -> None:
    assert fields_of(Spent) == ((), ("model_calls", "input_tokens", "output_tokens", "tool_calls"))
    assert fields_of(Ledger) == (
        ("session", "turn", "revision"),
        ("turn_start", "partial", "tools", "refused_by", "before"),
    )


def test_a_record_type_needs_a_dotted_tag_of_its_own() -> None:
    with pytest.raises(ConfigurationError, match="explicit tag with a dot"):

        class Untagged(Record, frozen=True):  # pyright: ignore[reportUnusedClass]
            value: int = 0

    with pytest.raises(ConfigurationError, match="explicit tag with a dot"):

        class Flat(Record, frozen=True, tag="flat"):  # pyright: ignore[reportUnusedClass]
            value: int = 0

    with pytest.raises(ConfigurationError, match="used by both"):

        class Clash(Record, frozen=True, tag="stepmachine.journal"):  # pyright: ignore[reportUnusedClass]
            value: int = 0


class Flag(Record, frozen=True, tag="tests.flag"):
    """An application's own record."""

    raised_by: str
    level: int = 1
    reasons: list[str] = msgspec.field(default_factory=list)


def test_an_applications_record_is_written_and_read_like_the_built_in_ones() -> None:
    assert record_types()["tests.flag"] is Flag
    notes = {"myapp": {"flag": note_value(Flag("ops", 2, ["x"]))}}
    assert notes["myapp"]["flag"] == {
        "record": "tests.flag",
        "raised_by": "ops",
        "level": 2,
        "reasons": ["x"],
    }
    assert read_record(notes, "myapp", Flag, key="flag") == Flag("ops", 2, ["x"])
    assert read_record(notes, "myapp", Flag, key="other") is None
    assert read_record(notes, "absent", Flag, key="flag") is None
    assert read_record({}, "myapp", Flag) is None


@given(
    raised_by=st.text(max_size=20),
    level=st.integers(-(2**53), 2**53),
    reasons=st.lists(st.text(max_size=5), max_size=3),
)
def test_a_record_survives_json_exactly(raised_by: str, level: int, reasons: list[str]) -> None:
    record = Flag(raised_by, level, reasons)
    stored = msgspec.json.decode(msgspec.json.encode({"ns": note_value(record)}))
    assert stored == {"ns": note_value(record)}
    assert read_record(stored, "ns", Flag) == record


def test_unknown_fields_are_ignored_and_untagged_values_convert() -> None:
    newer = {"ns": {"record": "tests.flag", "raised_by": "a", "added_later": True}}
    assert read_record(newer, "ns", Flag) == Flag("a")
    older = {"ns": {"raised_by": "a", "level": 3}}  # written before the record was typed
    assert read_record(older, "ns", Flag) == Flag("a", 3)


@pytest.mark.parametrize(
    ("notes", "key", "match"),
    [
        ({"ns": "flag"}, None, "not an object"),
        ({"ns": ["flag"]}, "flag", "the namespace is not an object"),
        ({"ns": {"flag": 3}}, "flag", "not an object"),
        ({"ns": {"level": 1}}, None, "raised_by"),
        ({"ns": {"raised_by": "a", "level": "high"}}, None, r"Expected `int`, got `str`"),
        ({"ns": {"record": "stepmachine.journal", "raised_by": "a"}}, None, "JournalEntry"),
        ({"ns": {"record": "nobody.knows", "raised_by": "a"}}, None, "nobody.knows"),
    ],
)
def test_a_malformed_note_raises_naming_where_it_is(
    notes: dict[str, Any], key: str | None, match: str
) -> None:
    with pytest.raises(StoredDataError, match=match) as info:
        read_record(notes, "ns", Flag, key=key, where="session 's1', message 'm7'")
    text = str(info.value)
    assert "stored data is data" in text
    assert "session 's1', message 'm7'" in text
    assert "'ns'" in text
    assert "Flag" in text


def test_a_session_after_a_live_apply_equals_the_one_decoded() -> None:
    """Invariant 1: notes hold the builtins form, so a fresh process sees the same session."""
    call = ToolCallPart.of("c1", "delete", {"path": "x"})
    session = make_session("go", Message(id="a1", role="assistant", parts=(call,)))
    decision = ApprovalDecision(outcome="approved", fingerprint="f", expires_at=5.0)
    after = apply_batch(
        session,
        [
            Annotate("a1", "approval", {"decision": note_value(decision)}, call_id="c1"),
            Annotate("u0", "myapp", note_value(Flag("ops"))),
        ],
    )
    codec: Codec[Any] = Codec()
    decoded = codec.decode_session(codec.encode_session(after))
    assert decoded == after
    part = decoded.conversation[1].tool_calls[0]
    assert read_record(part.notes, "approval", ApprovalDecision, key="decision") == decision


# -- shapes stored before records were typed ---------------------------------------------------


def test_kernel_notes_stored_before_records_were_typed_still_read() -> None:
    receipt = {
        "usage": {"input_tokens": 11, "output_tokens": 7, "cache_read_tokens": 3},
        "model": "gpt-test",
        "finish_reason": "stop",
        "attempts": 2,
        "revision": 4,
    }
    assert read_record({"inference": receipt}, "inference", InferenceReceipt) == (
        InferenceReceipt(
            attempts=2,
            revision=4,
            usage=Usage(11, 7, cache_read_tokens=3),
            model="gpt-test",
            finish_reason="stop",
        )
    )
    mark = {"context_length_exceeded": True, "attempts": 1, "revision": 0}
    assert read_record({"i": mark}, "i", InferenceAttempts) == InferenceAttempts(
        attempts=1, revision=0, context_length_exceeded=True
    )
    interrupted = {"attempts": 1, "revision": 0, "interrupted_request": True}
    assert read_record({"i": interrupted}, "i", InferenceAttempts) == InferenceAttempts(
        attempts=1, revision=0, interrupted_request=True
    )
    assert read_record({"i": {"interrupted": True}}, "i", InterruptedReply) == InterruptedReply()
    journal = {
        "intent": True,
        "fingerprint": "charge:abc",
        "idempotency_key": "k",
        "side_effects": "non_idempotent",
        "attempt": 1,
        "at": 1700000000,
        "rerun_approved": True,
        "rerun_attempt": 1,
        "decided_by": "ops",
        "decision_note": "",
    }
    call = msgspec.structs.replace(ToolCallPart.of("c1", "charge", {}), notes={"journal": journal})
    assert journal_entry(call) == JournalEntry(
        intent=True,
        fingerprint="charge:abc",
        idempotency_key="k",
        side_effects="non_idempotent",
        attempt=1,
        at=1700000000.0,
        rerun_approved=True,
        rerun_attempt=1,
        decided_by="ops",
    )
    refused = {"budget": {"refused": "over the limit"}}
    assert read_record(refused, "budget", BudgetRefusal) == BudgetRefusal("over the limit")
    request = {"approval": {"request": {"fingerprint": "f", "requested_at": 3}}}
    assert read_record(request, "approval", ApprovalRequest, key="request") == ApprovalRequest(
        "f", 3.0
    )


def test_a_damaged_journal_names_the_call() -> None:
    call = msgspec.structs.replace(
        ToolCallPart.of("c9", "charge", {}), notes={"journal": {"attempt": "two"}}
    )
    with pytest.raises(StoredDataError, match=r"session 's1' \(call 'c9'\).*JournalEntry"):
        journal_entry(call, where="session 's1'")
