"""stepmachine: LLM agents as a composable list of steps.

A :class:`StateMachine` loops over an ordered list of steps; the first step
that applies to the stored session wins, its effects are applied
(compare-and-set) and the loop continues or yields. Every decision is made
from the stored session, so ``run()`` called again, in any process, continues
exactly where the session left off.

The public packages:

- ``stepmachine``: the kernel (this package): messages, sessions, effects,
  steps, the machine, the ``Tools`` and ``ModelInference`` steps, errors.
- ``stepmachine.operations``: the built-in operations (approval, budgets,
  invalid calls, external events, structured output, compaction, history guard).
- ``stepmachine.stores``: ``MemoryStore``, ``SQLiteStore``, ``FileStore`` and
  ``PostgresStore`` (PostgreSQL, extra ``postgres``).
- ``stepmachine.providers``: model adapters over httpx (OpenAI Chat Completions
  and Responses, Anthropic, Google Gemini, OpenAI-compatible servers).
- ``stepmachine.inspector``: the ``stepmachine`` command (extra ``cli``), the
  HTML export and the live web view (extra ``web``).
- ``stepmachine.testing``: fakes for tests (scripted models, ``run_step``) and
  ``stepmachine.testing.conformance``, the store conformance suite.

Modules whose names start with ``_`` are private: import from the packages above.
"""

from typing import TYPE_CHECKING, Any

from ._capabilities import (
    AnswersUnknownTools,
    Capabilities,
    ContributesPromptParts,
    ContributesTools,
    Finalizes,
    Objection,
    OpensForRun,
    ShapesRequests,
    Step,
    VetsCalls,
)
from ._codec import KERNEL_EFFECTS, Batch, Codec, Refusal
from ._conversation import Conversation
from ._effects import (
    Annotate,
    AppendMessage,
    Effect,
    ReplaceConversation,
    SetVisibility,
    UpdateData,
    apply_batch,
    apply_effects,
)
from ._emitter import (
    Emitter,
    Event,
    EventData,
    EventSink,
    NullEmitter,
    ReasoningDelta,
    RecordingEmitter,
    StepApplied,
    StreamEmitter,
    TextDelta,
    ToolArgumentsDelta,
    ToolFinished,
    ToolStarted,
    Yielded,
)
from ._errors import (
    ConfigurationError,
    ConflictError,
    ContextLengthError,
    DefinitionError,
    EffectError,
    HistoryError,
    InvalidFieldError,
    InvalidSessionIdError,
    LeaseLostError,
    MediaTooLargeError,
    ModelError,
    RunError,
    SessionBusyError,
    SessionExistsError,
    SessionNotFoundError,
    StepContractError,
    StepmachineError,
    StoreClosedError,
    StoredDataError,
    ToolAbortError,
    ToolArgumentsError,
    ToolError,
    UnexpectedModelCallError,
)
from ._history import check_history, history_problems, open_tool_calls, request_order
from ._index import HistoryIndex, estimate_tokens, message_tokens
from ._inference import (
    CONTEXT_LENGTH_EXCEEDED,
    InferenceAttempts,
    InferenceReceipt,
    InterruptedReply,
    ModelInference,
    needs_answer,
)
from ._lease import Lease, LeaseHolder, LeasePolicy, Leases, new_owner
from ._ledger import (
    FEEDBACK,
    Ledger,
    LedgerView,
    Spent,
    latest_ledger,
    next_ledger,
    starts_turn,
)
from ._machine import (
    DEFAULT_MAX_CYCLES,
    FINALIZE_STEP,
    INTERRUPTED,
    Decision,
    RunReport,
    StateMachine,
)
from ._media import MediaPart, MediaRef, media_digest
from ._media_tokens import media_tokens
from ._messages import (
    AudioPart,
    DocumentPart,
    ImagePart,
    Message,
    Notes,
    Part,
    ReasoningPart,
    Role,
    TextPart,
    ToolCallPart,
    ToolResultPart,
)
from ._model import (
    ChunkSink,
    Model,
    ModelRequest,
    ModelResponse,
    ModelSettings,
    PromptPart,
    ReasoningChunk,
    StreamChunk,
    TextChunk,
    ToolCallChunk,
    ToolDefinition,
    Usage,
)
from ._records import TAG_FIELD, Record, note_value, read_record, record_types
from ._replay import ReplayCycle, ReplayReport, replay
from ._runtime import Runtime, ToolCaller, counter_ids, uuid_ids
from ._serve import serve
from ._session import NoData, Session
from ._staged import Recorder, Staged, Task
from ._steps import (
    CancelToken,
    Continue,
    Inference,
    Operation,
    Outcome,
    Refuse,
    StepContext,
    StepResult,
    Yield,
    YieldReason,
)
from ._store import EffectHandler, SessionLoader, Store, submit
from ._telemetry import Telemetry
from ._tool_step import (
    JOURNAL,
    NOT_EXECUTED,
    OUTCOME_UNKNOWN,
    JournalEntry,
    Tools,
    journal_entry,
    resolve_unknown_outcome,
)
from ._tools import (
    EDITED_ARGUMENTS,
    SideEffects,
    Tool,
    ToolContext,
    ToolLike,
    ToolOutput,
    effective_arguments,
    fingerprint,
    idempotency_key,
    tool,
)

if TYPE_CHECKING:
    from .agent import Agent

__version__ = "0.1.0.dev0"


def __getattr__(name: str) -> Any:
    # ``Agent`` composes the kernel with stepmachine.operations and .stores, which
    # the kernel never imports: it is imported on first use.
    if name == "Agent":
        from .agent import Agent  # noqa: PLC0415 - on first use (see above)

        return Agent
    raise AttributeError(f"module 'stepmachine' has no attribute {name!r}")


__all__ = [
    "CONTEXT_LENGTH_EXCEEDED",
    "DEFAULT_MAX_CYCLES",
    "EDITED_ARGUMENTS",
    "FEEDBACK",
    "FINALIZE_STEP",
    "INTERRUPTED",
    "JOURNAL",
    "KERNEL_EFFECTS",
    "NOT_EXECUTED",
    "OUTCOME_UNKNOWN",
    "TAG_FIELD",
    "Agent",
    "Annotate",
    "AnswersUnknownTools",
    "AppendMessage",
    "AudioPart",
    "Batch",
    "CancelToken",
    "Capabilities",
    "ChunkSink",
    "Codec",
    "ConfigurationError",
    "ConflictError",
    "ContextLengthError",
    "Continue",
    "ContributesPromptParts",
    "ContributesTools",
    "Conversation",
    "Decision",
    "DefinitionError",
    "DocumentPart",
    "Effect",
    "EffectError",
    "EffectHandler",
    "Emitter",
    "Event",
    "EventData",
    "EventSink",
    "Finalizes",
    "HistoryError",
    "HistoryIndex",
    "ImagePart",
    "Inference",
    "InferenceAttempts",
    "InferenceReceipt",
    "InterruptedReply",
    "InvalidFieldError",
    "InvalidSessionIdError",
    "JournalEntry",
    "Lease",
    "LeaseHolder",
    "LeaseLostError",
    "LeasePolicy",
    "Leases",
    "Ledger",
    "LedgerView",
    "MediaPart",
    "MediaRef",
    "MediaTooLargeError",
    "Message",
    "Model",
    "ModelError",
    "ModelInference",
    "ModelRequest",
    "ModelResponse",
    "ModelSettings",
    "NoData",
    "Notes",
    "NullEmitter",
    "Objection",
    "OpensForRun",
    "Operation",
    "Outcome",
    "Part",
    "PromptPart",
    "ReasoningChunk",
    "ReasoningDelta",
    "ReasoningPart",
    "Record",
    "Recorder",
    "RecordingEmitter",
    "Refusal",
    "Refuse",
    "ReplaceConversation",
    "ReplayCycle",
    "ReplayReport",
    "Role",
    "RunError",
    "RunReport",
    "Runtime",
    "Session",
    "SessionBusyError",
    "SessionExistsError",
    "SessionLoader",
    "SessionNotFoundError",
    "SetVisibility",
    "ShapesRequests",
    "SideEffects",
    "Spent",
    "Staged",
    "StateMachine",
    "Step",
    "StepApplied",
    "StepContext",
    "StepContractError",
    "StepResult",
    "StepmachineError",
    "Store",
    "StoreClosedError",
    "StoredDataError",
    "StreamChunk",
    "StreamEmitter",
    "Task",
    "Telemetry",
    "TextChunk",
    "TextDelta",
    "TextPart",
    "Tool",
    "ToolAbortError",
    "ToolArgumentsDelta",
    "ToolArgumentsError",
    "ToolCallChunk",
    "ToolCallPart",
    "ToolCaller",
    "ToolContext",
    "ToolDefinition",
    "ToolError",
    "ToolFinished",
    "ToolLike",
    "ToolOutput",
    "ToolResultPart",
    "ToolStarted",
    "Tools",
    "UnexpectedModelCallError",
    "UpdateData",
    "Usage",
    "VetsCalls",
    "Yield",
    "YieldReason",
    "Yielded",
    "apply_batch",
    "apply_effects",
    "check_history",
    "counter_ids",
    "effective_arguments",
    "estimate_tokens",
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
    "replay",
    "request_order",
    "resolve_unknown_outcome",
    "serve",
    "starts_turn",
    "submit",
    "tool",
    "uuid_ids",
]
