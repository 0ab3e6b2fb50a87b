"""For authors of stores, model adapters and capabilities: the parts under the machine.

Users compose agents from the names in :mod:`stepmachine` (steps, effects,
messages, the machine, models, stores, errors). This module holds what you
need when you build the parts those rest on:

- **a store** (see :class:`~stepmachine.Store`): the stored units
  (:class:`Batch`, :class:`Refusal`, :data:`KERNEL_EFFECTS`), applying them
  (:func:`apply_batch`, :func:`apply_effects`, :class:`EffectHandler`,
  :class:`SessionLoader`), history checks (:func:`check_history`,
  :func:`history_problems`, :func:`open_tool_calls`, :func:`request_order`,
  :class:`HistoryIndex`), token and media counts (:func:`message_tokens`,
  :func:`media_tokens`, :func:`media_digest`, :data:`MediaPart`), leases
  (:class:`Lease`, :class:`Leases`, :class:`LeaseHolder`, :func:`new_owner`),
  and session ids (:func:`counter_ids`, :func:`uuid_ids`);
- **a model adapter** (see :class:`~stepmachine.Model`): the stream chunks
  (:class:`StreamChunk`, :class:`TextChunk`, :class:`ReasoningChunk`,
  :class:`ToolCallChunk`, :data:`ChunkSink`), :data:`CONTEXT_LENGTH_EXCEEDED`,
  and the inference records (:class:`InferenceAttempts`,
  :class:`InferenceReceipt`, :class:`InterruptedReply`, :func:`needs_answer`);
- **a capability or an operation** (see :class:`~stepmachine.Step`): the
  capability protocols (:class:`Capabilities`, :class:`AnswersUnknownTools`,
  :class:`ContributesPromptParts`, :class:`ContributesTools`,
  :class:`Finalizes`, :class:`Objection`, :class:`OpensForRun`,
  :class:`ShapesRequests`, :class:`VetsCalls`), typed records
  (:class:`Record`, :data:`TAG_FIELD`, :func:`read_record`,
  :func:`note_value`, :func:`record_types`), the run ledger
  (:class:`Ledger`, :class:`LedgerView`, :class:`Spent`,
  :func:`latest_ledger`, :func:`next_ledger`, :func:`starts_turn`), the tool
  journal (:data:`JOURNAL`, :class:`JournalEntry`, :func:`journal_entry`,
  :data:`NOT_EXECUTED`, :data:`OUTCOME_UNKNOWN`, :data:`EDITED_ARGUMENTS`,
  :func:`effective_arguments`, :func:`fingerprint`, :func:`idempotency_key`,
  :class:`ToolLike`, :class:`ToolCaller`), and the machine's own parts
  (:class:`Conversation`, :class:`Decision`, :class:`StepResult`,
  :class:`Recorder`, :class:`ReplayCycle`, :data:`YieldReason`,
  :data:`DEFAULT_MAX_CYCLES`, :data:`FINALIZE_STEP`, :data:`INTERRUPTED`,
  events' :data:`EventData`, :class:`EventSink`, :class:`NullEmitter`,
  messages' :data:`Role`, :data:`Part`, :data:`Notes`).

These names were importable from :mod:`stepmachine` until this release; the old
imports still work for one release, with a ``DeprecationWarning`` naming the
new one.
"""

from ._capabilities import (
    AnswersUnknownTools,
    Capabilities,
    ContributesPromptParts,
    ContributesTools,
    Finalizes,
    Objection,
    OpensForRun,
    ShapesRequests,
    VetsCalls,
)
from ._codec import KERNEL_EFFECTS, Batch, Refusal
from ._conversation import Conversation
from ._effects import apply_batch, apply_effects
from ._emitter import EventData, EventSink, NullEmitter
from ._history import check_history, history_problems, open_tool_calls, request_order
from ._index import HistoryIndex, message_tokens
from ._inference import (
    CONTEXT_LENGTH_EXCEEDED,
    InferenceAttempts,
    InferenceReceipt,
    InterruptedReply,
    needs_answer,
)
from ._lease import Lease, LeaseHolder, Leases, new_owner
from ._ledger import Ledger, LedgerView, Spent, latest_ledger, next_ledger, starts_turn
from ._machine import DEFAULT_MAX_CYCLES, FINALIZE_STEP, INTERRUPTED, Decision
from ._media import MediaPart, media_digest
from ._media_tokens import media_tokens
from ._messages import Notes, Part, Role
from ._model import ChunkSink, ReasoningChunk, StreamChunk, TextChunk, ToolCallChunk
from ._public import publish as _publish
from ._records import TAG_FIELD, Record, note_value, read_record, record_types
from ._replay import ReplayCycle
from ._runtime import ToolCaller, counter_ids, uuid_ids
from ._staged import Recorder
from ._steps import StepResult, YieldReason
from ._store import EffectHandler, SessionLoader
from ._tool_step import JOURNAL, NOT_EXECUTED, OUTCOME_UNKNOWN, JournalEntry, journal_entry
from ._tools import EDITED_ARGUMENTS, ToolLike, effective_arguments, fingerprint, idempotency_key

__all__ = [
    "CONTEXT_LENGTH_EXCEEDED",
    "DEFAULT_MAX_CYCLES",
    "EDITED_ARGUMENTS",
    "FINALIZE_STEP",
    "INTERRUPTED",
    "JOURNAL",
    "KERNEL_EFFECTS",
    "NOT_EXECUTED",
    "OUTCOME_UNKNOWN",
    "TAG_FIELD",
    "AnswersUnknownTools",
    "Batch",
    "Capabilities",
    "ChunkSink",
    "ContributesPromptParts",
    "ContributesTools",
    "Conversation",
    "Decision",
    "EffectHandler",
    "EventData",
    "EventSink",
    "Finalizes",
    "HistoryIndex",
    "InferenceAttempts",
    "InferenceReceipt",
    "InterruptedReply",
    "JournalEntry",
    "Lease",
    "LeaseHolder",
    "Leases",
    "Ledger",
    "LedgerView",
    "MediaPart",
    "Notes",
    "NullEmitter",
    "Objection",
    "OpensForRun",
    "Part",
    "ReasoningChunk",
    "Record",
    "Recorder",
    "Refusal",
    "ReplayCycle",
    "Role",
    "SessionLoader",
    "ShapesRequests",
    "Spent",
    "StepResult",
    "StreamChunk",
    "TextChunk",
    "ToolCallChunk",
    "ToolCaller",
    "ToolLike",
    "VetsCalls",
    "YieldReason",
    "apply_batch",
    "apply_effects",
    "check_history",
    "counter_ids",
    "effective_arguments",
    "fingerprint",
    "history_problems",
    "idempotency_key",
    "journal_entry",
    "latest_ledger",
    "media_digest",
    "media_tokens",
    "message_tokens",
    "needs_answer",
    "new_owner",
    "next_ledger",
    "note_value",
    "open_tool_calls",
    "read_record",
    "record_types",
    "request_order",
    "starts_turn",
    "uuid_ids",
]

_publish(__name__, globals())
