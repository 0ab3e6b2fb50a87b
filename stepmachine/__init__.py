"""stepmachine: LLM agents as a composable list of steps.

A :class:`StateMachine` loops over an ordered list of steps; the first step
that applies to the stored session wins, its effects are applied
(compare-and-set) and the loop continues or yields. Every decision is made
from the stored session, so ``run()`` called again, in any process, continues
exactly where the session left off.

The public packages:

- ``stepmachine``: what users compose (this package): messages, sessions,
  effects, steps, the machine and the worker loop (:func:`run_worker`), the
  ``Tools`` and ``ModelInference`` steps, models, events, errors.
- ``stepmachine.extend``: for authors of stores, model adapters and
  capabilities: batches and the codec's parts, history checks, token counts,
  leases, the ledger, records, the tool journal and the capability protocols.
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
- ``stepmachine.durable``: durable turns on DBOS Transact (extra ``dbos``).

Modules whose names start with ``_`` are private: import from the packages above.
"""

import typing as _typing
import warnings

from ._capabilities import Step
from ._codec import Codec
from ._effects import (
    Annotate,
    AppendMessage,
    Effect,
    ReplaceConversation,
    SetVisibility,
    UpdateData,
)
from ._emitter import (
    Emitter,
    Event,
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
from ._inference import ModelInference
from ._lease import LeasePolicy
from ._machine import RunReport, StateMachine
from ._media import MediaRef
from ._messages import (
    AudioPart,
    DocumentPart,
    ImagePart,
    Message,
    ReasoningPart,
    TextPart,
    ToolCallPart,
    ToolResultPart,
)
from ._model import (
    Model,
    ModelRequest,
    ModelResponse,
    ModelSettings,
    PromptPart,
    ToolDefinition,
    Usage,
)
from ._replay import ReplayReport, replay
from ._runtime import Runtime
from ._serve import run_worker
from ._session import NoData, Session
from ._staged import Staged, Task
from ._steps import CancelToken, Continue, Inference, Operation, Outcome, Refuse, StepContext, Yield
from ._store import Store, submit
from ._telemetry import Telemetry
from ._tool_step import Tools, resolve_unknown_outcome
from ._tools import SideEffects, Tool, ToolContext, ToolOutput, tool

__version__ = "0.4.0.dev0"


__all__ = [
    "Agent",
    "Annotate",
    "AppendMessage",
    "AudioPart",
    "CancelToken",
    "Codec",
    "ConfigurationError",
    "ConflictError",
    "ContextLengthError",
    "Continue",
    "DefinitionError",
    "DocumentPart",
    "Effect",
    "EffectError",
    "Emitter",
    "Event",
    "HistoryError",
    "ImagePart",
    "Inference",
    "InvalidFieldError",
    "InvalidSessionIdError",
    "LeaseLostError",
    "LeasePolicy",
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
    "Operation",
    "Outcome",
    "PromptPart",
    "ReasoningDelta",
    "ReasoningPart",
    "RecordingEmitter",
    "Refuse",
    "ReplaceConversation",
    "ReplayReport",
    "RunError",
    "RunReport",
    "Runtime",
    "Session",
    "SessionBusyError",
    "SessionExistsError",
    "SessionNotFoundError",
    "SetVisibility",
    "SideEffects",
    "Staged",
    "StateMachine",
    "Step",
    "StepApplied",
    "StepContext",
    "StepContractError",
    "StepmachineError",
    "Store",
    "StoreClosedError",
    "StoredDataError",
    "StreamEmitter",
    "Task",
    "Telemetry",
    "TextDelta",
    "TextPart",
    "Tool",
    "ToolAbortError",
    "ToolArgumentsDelta",
    "ToolArgumentsError",
    "ToolCallPart",
    "ToolContext",
    "ToolDefinition",
    "ToolError",
    "ToolFinished",
    "ToolOutput",
    "ToolResultPart",
    "ToolStarted",
    "Tools",
    "UnexpectedModelCallError",
    "UpdateData",
    "Usage",
    "Yield",
    "Yielded",
    "replay",
    "resolve_unknown_outcome",
    "run_worker",
    "submit",
    "tool",
]

from . import extend as _extend
from ._public import publish as _publish

if _typing.TYPE_CHECKING:  # the lazy Agent, and the moved names until they go
    from ._agent import Agent as Agent
    from ._index import estimate_tokens as estimate_tokens
    from ._ledger import FEEDBACK as FEEDBACK
    from .extend import *  # noqa: F403

    serve = run_worker

# Old top-level name -> its new home (the module and the name there).
_MOVED: dict[str, tuple[str, str]] = {
    **{name: ("stepmachine.extend", name) for name in _extend.__all__},
    "FEEDBACK": ("stepmachine.operations", "FEEDBACK"),
    "estimate_tokens": ("stepmachine.operations", "estimate_tokens"),
    "serve": ("stepmachine", "run_worker"),
}


def __getattr__(name: str) -> _typing.Any:
    """The names that moved out of the top level: still found, with a DeprecationWarning."""
    if name == "Agent":
        # Agent composes the kernel with stepmachine.operations and .stores, which
        # the kernel never imports: it is imported on first use.
        from ._agent import Agent  # noqa: PLC0415 - on first use (see above)

        _publish(__name__, {"__all__": ["Agent"], "Agent": Agent})
        return Agent
    moved = _MOVED.get(name)
    if moved is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, new = moved
    if name == "serve":
        value: _typing.Any = run_worker
        advice = (
            "stepmachine.serve (the worker loop) is now stepmachine.run_worker: "
            "use `from stepmachine import run_worker`; the web server keeps its name, "
            "stepmachine.inspector.serve"
        )
    else:
        if module == "stepmachine.operations":  # the same object; the kernel does not import it
            from ._index import estimate_tokens  # noqa: PLC0415
            from ._ledger import FEEDBACK  # noqa: PLC0415

            value = {"FEEDBACK": FEEDBACK, "estimate_tokens": estimate_tokens}[name]
        else:
            value = getattr(_extend, name)
        advice = f"stepmachine.{name} moved to {module}.{new}: use `from {module} import {new}`"
    warnings.warn(
        f"{advice}; the old name goes in the next release",
        DeprecationWarning,
        stacklevel=2,  # the user's line (warnings skips importlib's frames of a from-import)
    )
    return value


def __dir__() -> list[str]:
    return list(__all__)


_publish(__name__, globals())
