"""Built-in operations, installed as ``stepmachine.operations``.

Compose them with the kernel's steps. The first applicable step wins each
cycle, so order matters; a typical list::

    [
        ExternalEvents(...),      # deliver webhook / steering events first
        Budget(per_run=Limits(model_calls=20)),  # yield before a call that would overspend
        InvalidCalls(policy),     # answer or re-prompt malformed calls before anyone acts on them
        Approval(policy),         # yield for decisions before tools run
        Tools([...]),             # run approved, valid calls (journaled)
        HistoryGuard(),           # repair a broken history before a request is built
        Compaction(...),          # shorten the history before the next request
        ModelInference(...),      # or StructuredOutput(T, inference=ModelInference(...))
    ]

Guards that must hold whatever the order (approval, tool-call budgets) are
also enforced through ``Operation.check_call``, which the Tools step asks
every step before running a call; budgets cap every request through
``Operation.shape_request``. Every decision is persisted as an effect (notes
on messages and tool calls), so a fresh machine in a new process decides the
same. Operations use only kernel effects: no codec registration is needed.
"""

from stepmachine._ledger import FEEDBACK
from stepmachine._public import publish as _publish

from ._approval import (
    APPROVED,
    DENIED,
    Approval,
    ApprovalDecision,
    ApprovalError,
    ApprovalPolicy,
    ApprovalRequest,
    PendingCall,
    always_allowed,
    approve,
    deny,
    recorded_decision,
)
from ._budget import (
    SUPERSEDES,
    Budget,
    BudgetExhaustedError,
    BudgetRefusal,
    BudgetUsage,
    Limits,
    budget_usage,
    turn_start,
)
from ._compaction import (
    COMPACTION,
    COMPACTION_STUCK,
    SUMMARY_PREFIX,
    SUMMARY_PROMPT,
    Compaction,
    CompactionMark,
    CompactionReceipt,
    estimate_tokens,
    render_transcript,
)
from ._events import (
    EventConsumed,
    EventDelivery,
    EventReceipt,
    EventRecord,
    ExternalEvent,
    ExternalEvents,
    WaitMarker,
    consumed_events,
    pending_events,
    submit_event,
    wait_for,
)
from ._history_guard import HISTORY_GUARD, HistoryGuard, Problem, fsck
from ._invalid_calls import (
    INVALID_TOOL_CALL,
    CallProblem,
    InvalidCalls,
    InvalidCallsDecision,
    InvalidCallsFeedback,
    InvalidCallsRepair,
    InvalidCallsSkipped,
    InvalidToolCallError,
    schema_errors,
)
from ._mcp import McpTools
from ._mcp_servers import McpHttp, McpStdio
from ._output import (
    OUTPUT_INVALID,
    NoOutputError,
    OutputAnswer,
    OutputError,
    OutputFeedback,
    OutputValue,
    StructuredOutput,
    read_output,
)

__all__ = [
    "APPROVED",
    "COMPACTION",
    "COMPACTION_STUCK",
    "DENIED",
    "FEEDBACK",
    "HISTORY_GUARD",
    "INVALID_TOOL_CALL",
    "OUTPUT_INVALID",
    "SUMMARY_PREFIX",
    "SUMMARY_PROMPT",
    "SUPERSEDES",
    "Approval",
    "ApprovalDecision",
    "ApprovalError",
    "ApprovalPolicy",
    "ApprovalRequest",
    "Budget",
    "BudgetExhaustedError",
    "BudgetRefusal",
    "BudgetUsage",
    "CallProblem",
    "Compaction",
    "CompactionMark",
    "CompactionReceipt",
    "EventConsumed",
    "EventDelivery",
    "EventReceipt",
    "EventRecord",
    "ExternalEvent",
    "ExternalEvents",
    "HistoryGuard",
    "InvalidCalls",
    "InvalidCallsDecision",
    "InvalidCallsFeedback",
    "InvalidCallsRepair",
    "InvalidCallsSkipped",
    "InvalidToolCallError",
    "Limits",
    "McpHttp",
    "McpStdio",
    "McpTools",
    "NoOutputError",
    "OutputAnswer",
    "OutputError",
    "OutputFeedback",
    "OutputValue",
    "PendingCall",
    "Problem",
    "StructuredOutput",
    "WaitMarker",
    "always_allowed",
    "approve",
    "budget_usage",
    "consumed_events",
    "deny",
    "estimate_tokens",
    "fsck",
    "pending_events",
    "read_output",
    "recorded_decision",
    "render_transcript",
    "schema_errors",
    "submit_event",
    "turn_start",
    "wait_for",
]

_publish(__name__, globals())
