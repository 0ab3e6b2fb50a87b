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
- ``stepmachine.stores``: ``MemoryStore``, ``SQLiteStore``, ``FileStore``.
- ``stepmachine.providers``: model adapters over httpx (OpenAI, Anthropic,
  OpenAI-compatible servers).
- ``stepmachine.testing``: fakes for tests (scripted models, ``run_step``) and
  ``stepmachine.testing.conformance``, the store conformance suite.

Modules whose names start with ``_`` are private: import from the packages above.
"""

from ._codec import KERNEL_EFFECTS, Batch, Codec
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
    ModelError,
    RunError,
    SessionExistsError,
    SessionNotFoundError,
    StepContractError,
    StepmachineError,
    StoreClosedError,
    StoredDataError,
    ToolAbortError,
    ToolArgumentsError,
    UnexpectedModelCallError,
)
from ._history import check_history, history_problems, open_tool_calls, request_order
from ._index import HistoryIndex
from ._inference import CONTEXT_LENGTH_EXCEEDED, ModelInference, needs_answer
from ._machine import (
    DEFAULT_MAX_CYCLES,
    FINALIZE_STEP,
    INTERRUPTED,
    Decision,
    RunReport,
    StateMachine,
)
from ._messages import (
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
from ._runtime import Runtime, counter_ids, uuid_ids
from ._session import NoData, Session
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
from ._tool_step import JOURNAL, NOT_EXECUTED, OUTCOME_UNKNOWN, Tools, resolve_unknown_outcome
from ._tools import (
    EDITED_ARGUMENTS,
    SideEffects,
    Tool,
    ToolContext,
    effective_arguments,
    fingerprint,
    idempotency_key,
    tool,
)

__version__ = "0.1.0.dev0"

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
    "Annotate",
    "AppendMessage",
    "Batch",
    "CancelToken",
    "ChunkSink",
    "Codec",
    "ConfigurationError",
    "ConflictError",
    "ContextLengthError",
    "Continue",
    "Conversation",
    "Decision",
    "DefinitionError",
    "Effect",
    "EffectError",
    "EffectHandler",
    "Emitter",
    "Event",
    "EventData",
    "EventSink",
    "HistoryError",
    "HistoryIndex",
    "Inference",
    "InvalidFieldError",
    "InvalidSessionIdError",
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
    "Operation",
    "Outcome",
    "Part",
    "PromptPart",
    "ReasoningChunk",
    "ReasoningDelta",
    "ReasoningPart",
    "RecordingEmitter",
    "Refuse",
    "ReplaceConversation",
    "Role",
    "RunError",
    "RunReport",
    "Runtime",
    "Session",
    "SessionExistsError",
    "SessionLoader",
    "SessionNotFoundError",
    "SetVisibility",
    "SideEffects",
    "StateMachine",
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
    "TextChunk",
    "TextDelta",
    "TextPart",
    "Tool",
    "ToolAbortError",
    "ToolArgumentsDelta",
    "ToolArgumentsError",
    "ToolCallChunk",
    "ToolCallPart",
    "ToolContext",
    "ToolDefinition",
    "ToolFinished",
    "ToolResultPart",
    "ToolStarted",
    "Tools",
    "UnexpectedModelCallError",
    "UpdateData",
    "Usage",
    "Yield",
    "YieldReason",
    "Yielded",
    "apply_batch",
    "apply_effects",
    "check_history",
    "counter_ids",
    "effective_arguments",
    "fingerprint",
    "history_problems",
    "idempotency_key",
    "needs_answer",
    "open_tool_calls",
    "request_order",
    "resolve_unknown_outcome",
    "submit",
    "tool",
    "uuid_ids",
]
