"""Finding the records operations left in notes, without knowing their namespaces.

Operations store what they decided as tagged records (``{"record": tag, ...}``)
under a namespace of their choosing (the step's name), either directly
(``notes[namespace]``) or under a key (``notes[namespace][key]``). The
inspector reads them by tag, so an operation given another name is still found.
Values are only read (JSON builtins); nothing is decoded into classes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any, Final

from stepmachine.extend import TAG_FIELD, InferenceReceipt, JournalEntry, Record
from stepmachine.operations import (
    ApprovalDecision,
    ApprovalRequest,
    BudgetRefusal,
    CompactionMark,
    CompactionReceipt,
    EventConsumed,
    EventRecord,
    WaitMarker,
)

__all__ = [
    "BUDGET",
    "CONSUMED",
    "DECISION",
    "EVENT",
    "JOURNAL",
    "MARK",
    "RECEIPT",
    "REQUEST",
    "SUMMARY",
    "WAIT",
    "describe",
    "find",
    "records_in",
]


def _tag(record_type: type[Record]) -> str:
    tag = record_type.__struct_config__.tag
    assert isinstance(tag, str)  # every Record has a str tag
    return tag


RECEIPT: Final = _tag(InferenceReceipt)
JOURNAL: Final = _tag(JournalEntry)
REQUEST: Final = _tag(ApprovalRequest)
DECISION: Final = _tag(ApprovalDecision)
BUDGET: Final = _tag(BudgetRefusal)
SUMMARY: Final = _tag(CompactionReceipt)
MARK: Final = _tag(CompactionMark)
EVENT: Final = _tag(EventRecord)
CONSUMED: Final = _tag(EventConsumed)
WAIT: Final = _tag(WaitMarker)


def records_in(notes: Mapping[str, Any]) -> Iterator[tuple[str, str | None, dict[str, Any]]]:
    """Every tagged record in ``notes``: (namespace, key or ``None``, the record's fields).

    A keyed record of the same tag merged into a namespace that already holds
    a record directly (the budget's ``"exhausted"`` note on its own refusal
    result) is found too, after the record that holds it; other values inside a
    record (an event's payload, say) are its data, never records.
    """
    for namespace, value in notes.items():
        if not isinstance(value, dict):
            continue
        tag = value.get(TAG_FIELD)
        if isinstance(tag, str):
            yield namespace, None, value
        for key, inner in value.items():
            if not isinstance(inner, dict) or not isinstance(inner.get(TAG_FIELD), str):
                continue
            if tag is None or inner[TAG_FIELD] == tag:
                yield namespace, key, inner


def find(notes: Mapping[str, Any], tag: str) -> dict[str, Any] | None:
    """The first record tagged ``tag`` in ``notes``, or ``None``."""
    for _, _, record in records_in(notes):
        if record[TAG_FIELD] == tag:
            return record
    return None


def _payload(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, sort_keys=True)
    except (TypeError, ValueError):
        return repr(value)


def describe(record: Mapping[str, Any]) -> str:
    """One line saying what a record of a built-in operation means (its tag for the others)."""
    tag = record.get(TAG_FIELD)
    if tag == DECISION:
        why = record.get("reason") or record.get("message") or ""
        edited = " (edited arguments)" if record.get("edited") else ""
        always = " (and later calls of this tool)" if record.get("always") else ""
        return f"{record.get('outcome')} by {record.get('by')}{': ' + str(why) if why else ''}" + (
            edited + always
        )
    if tag == REQUEST:
        return "approval requested"
    if tag == JOURNAL:
        if record.get("decided_by"):
            verdict = "re-run allowed" if record.get("rerun_approved") else "not re-run"
            note = record.get("decision_note")
            return f"journal: {verdict} by {record.get('decided_by')}" + (
                f": {note}" if note else ""
            )
        if record.get("intent"):
            return (
                f"journal: intent, attempt {record.get('attempt')} "
                f"({record.get('side_effects')}, key {record.get('idempotency_key')})"
            )
        return "journal"
    if tag == SUMMARY:
        return (
            f"compaction: summary of {len(record.get('summarised') or [])} message(s), "
            f"~{record.get('tokens_before')} -> ~{record.get('tokens_after')} tokens "
            f"({record.get('trigger')})"
        )
    if tag == MARK:
        if record.get("summarised_into"):
            return f"compacted into {record.get('summarised_into')}"
        return f"compaction: {record.get('stuck') or 'mark'}"
    if tag == BUDGET:
        return f"budget: {record.get('refused')}"
    if tag == EVENT:
        return f"event {record.get('kind')} {record.get('id')}: {_payload(record.get('payload'))}"
    if tag == WAIT:
        satisfied = record.get("satisfied_by")
        kinds = ", ".join(map(str, record.get("awaiting") or [])) or "any event"
        return f"waits for {kinds}" + (f" (satisfied by {satisfied})" if satisfied else "")
    if tag == CONSUMED:
        return "event delivered" if record.get("consumed") else "event"
    if tag == RECEIPT:
        found = record.get("usage")
        usage: Mapping[str, Any] = found if isinstance(found, dict) else {}
        return (
            f"reply from {record.get('model')}: {usage.get('input_tokens', 0)} in / "
            f"{usage.get('output_tokens', 0)} out tokens, {record.get('attempts')} call(s)"
        )
    return str(tag)
