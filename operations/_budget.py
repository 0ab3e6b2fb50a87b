"""Budgets: exact limits on model calls, tokens and tool calls (exact budgets).

:class:`Budget` enforces :class:`Limits` over three scopes:

* ``per_run`` -- since the current ``run()`` began (``ctx.run_start_revision``);
* ``per_turn`` -- since the last user message (feedback messages that
  operations append to re-prompt the model, marked with :data:`FEEDBACK`
  notes, do not start a turn);
* ``per_session`` -- the whole stored conversation.

Everything is counted from the session, never from memory (state is the session).

Cost per cycle (constant cost per step): model calls, tokens and tool calls come
from the running totals that every model-call record carries
(:class:`stepmachine.Ledger`, found by reading back to the latest model call),
so ``run``, ``shape_request`` and ``check_call`` read only the messages since
the last model call (per run: back to the first model call of the run, a run's
totals being the latest ledger minus the one before the run began; ``check_call``
also reads from the call's own message on, to place it). Each reply's receipt
counts its tool calls; a step that makes calls stop counting by the rules below
writes the correction with it (:class:`~stepmachine._ledger.LedgerCorrection`,
the corrected ledger): this budget refusing calls (on the last refusal's
result), an invalid-call retry hiding a reply (on its feedback message),
``HistoryGuard`` hiding a reply with unanswered calls (on the last message), a
:data:`SUPERSEDES` copy (on the copy, when the original's ledger is not the
latest one or a turn began since). Counted from the records one by one
(O(history)), by the rules below, are: sessions recorded before ledgers
existed or before they counted tool calls (``Ledger.tools``), sessions with
an assistant message holding tool calls but no ledger (one built by hand),
calls that another budget step (another ``name``) refused, and a call whose
id repeats (``check_call``). Where the two ways differ, the ledger counts what
was spent while the run or turn was under way (an interrupted reply within a
run, a summary inserted before the turn's first message; history deleted by a
``ReplaceConversation`` is still counted), the records by where they sit (a
record on the turn's own user message, such as a failed attempt, is of a call
made in the turn: both count it). :func:`budget_usage` with ``tool_calls=True``
(the ids of the counted calls) always counts the records.

The rules for counting from the records:

* **model calls**: the ``attempts`` that ``ModelInference`` records in the
  notes of each assistant message (any notes namespace holding an integer
  ``"attempts"``; on other messages every such namespace, since a failed
  request and a stuck summary may share one), hidden messages included (a retried answer was still a
  call). A message is in the run when its recorded ``revision`` is
  ``>= ctx.run_start_revision``. An assistant message kept after an
  interrupted request counts as one call (per turn and per session).
  Copies of assistant messages made by other operations (for example a
  repaired tool call) carry :data:`SUPERSEDES` notes and are not counted
  twice.
* **tokens**: the ``usage`` in the same notes (``input_tokens``,
  ``output_tokens``, ``total_tokens`` = input + output).
* **tool calls**: the tool calls in assistant messages that are in the scope
  (per run: asked for by the model during this run), hidden messages included
  when the call was answered: a call counts when its message is visible to
  the model, or when some tool result (visible or hidden) answers it -- so
  hiding history (compaction, a repair) never gives the budget back. Not
  counted: the calls this budget refused, the calls of a hidden message that
  no result answers (they never ran, e.g. a reply an invalid-call "retry"
  hid), and the calls of an original that a :data:`SUPERSEDES` copy replaces
  (the copy's calls count). A result answers the latest earlier call with its
  id that has no result yet. Calls are counted by position (message id and
  call id), so a call id the model used twice counts twice.

Behaviour, when offered a cycle (``run``):

* the conversation needs a model answer and a model-call or token limit is
  exhausted: ``Yield`` with reason ``budget_exhausted``, no effects; ``data``
  says which limit (``{"scope", "limit", "allowed", "used"}``);
* tool calls are open, every one of them is over a tool-call limit: each is
  answered with an error result ("not executed: tool-call budget
  exhausted"), the call is noted ``{"refused": ...}`` in this step's
  namespace, and the run yields ``budget_exhausted``. While some open calls
  are within the limit it refuses, so the tool step runs those first (a
  :class:`BudgetRefusal` record on the call and on its result);
* otherwise ``Refuse``.

Guards that hold whatever the order of the steps:

* ``check_call``: a tool call over a tool-call limit is objected to, so no
  tool step runs it.
* ``shape_request``: every model request gets ``max_attempts`` = the model
  calls left (so an adapter that retries cannot overshoot: retries count),
  and ``settings.max_tokens`` capped by the output/total tokens left. With
  ``offer_remaining=True`` a prompt part tells the model what is left.
  Should no call be left (the budget was placed after inference), it raises
  :class:`BudgetExhaustedError` rather than send the request.

Token limits are checked before each call; the call that crosses a token
limit completes (its size is capped through ``max_tokens`` only for output
tokens). Every model request sent is in the session, in every scope: a
call that failed after retries (``ModelError``) records its attempts on the
last message the model saw before the error propagates; a request cut off by
a cancellation records the attempts it sent; and because ``shape_request``
caps ``max_attempts``, the inference and compaction steps reserve those calls
in a batch of their own before the request is sent, so a crash in between
leaves them counted (see :class:`stepmachine.ModelInference`).

Placement: before ``ModelInference`` (and before ``Tools``), so it can yield
before a request is built; ``shape_request`` and ``check_call`` guard the
limits whatever the order.

Cancellation: nothing to finalize; the budget decides from the session.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec

from stepmachine import (
    Annotate,
    AppendMessage,
    Effect,
    Message,
    ModelRequest,
    Operation,
    Outcome,
    PromptPart,
    Refuse,
    RunError,
    Session,
    StepContext,
    StoredDataError,
    ToolCallPart,
    ToolResultPart,
    Yield,
)
from stepmachine._ledger import (
    FEEDBACK,
    LEDGER,
    LedgerCorrection,
    LedgerView,
    corrected_ledger,
    ledger_on,
    run_ledgers,
)
from stepmachine._records import TAG_FIELD
from stepmachine.extend import (
    Spent,
    YieldReason,
    latest_ledger,
    needs_answer,
    note_value,
    open_tool_calls,
    read_record,
    starts_turn,
)

from ._records import BudgetRefusal

__all__ = [
    "FEEDBACK",
    "SUPERSEDES",
    "Budget",
    "BudgetExhaustedError",
    "BudgetRefusal",
    "BudgetUsage",
    "Limits",
    "budget_usage",
    "turn_start",
]

SUPERSEDES: Final = "stepmachine.supersedes"
"""Notes namespace on an assistant message that replaces a hidden original.

The value is ``{"message_id": <original id>}``; budgets count the original's
model calls and tokens, not the copy's.
"""

Scope = Literal["run", "turn", "session"]
LimitName = Literal["model_calls", "input_tokens", "output_tokens", "total_tokens", "tool_calls"]


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """Limits for one scope; ``None`` means unlimited.

    Attributes:
        model_calls: model attempts (first tries plus retries).
        input_tokens: input tokens reported by the provider.
        output_tokens: output tokens reported by the provider.
        total_tokens: input plus output tokens.
        tool_calls: tool calls the model asked for.
    """

    model_calls: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    total_tokens: int | None = None
    tool_calls: int | None = None


class BudgetExhaustedError(RunError):
    """A model request was about to be sent with no model call left (exact budgets).

    Only raised when the :class:`Budget` step could not yield first, i.e. it
    is placed after the inference step.
    """


@dataclass(frozen=True, slots=True)
class BudgetUsage:
    """What one scope has used so far.

    Attributes:
        model_calls: model attempts.
        input_tokens, output_tokens: token counts.
        tool_calls: the ids of the counted tool calls, oldest first (an id the
            model used twice appears twice).
        tool_call_positions: the counted tool calls as ``(message id, call id)``
            pairs, in the same order as ``tool_calls``.
    """

    model_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    tool_calls: tuple[str, ...] = ()
    tool_call_positions: tuple[tuple[str, str], ...] = ()

    @property
    def total_tokens(self) -> int:
        """Input plus output tokens."""
        return self.input_tokens + self.output_tokens

    def used(self, limit: LimitName) -> int:
        """The amount used of ``limit``."""
        if limit == "tool_calls":
            return len(self.tool_calls)
        value: int = getattr(self, limit)
        return value


def turn_start(conversation: Sequence[Message]) -> int:
    """Index of the last user message visible to the model that starts a turn (-1 if none).

    User messages marked with :data:`FEEDBACK` notes, and user-role messages
    hidden from the user (operational ones, such as compaction summaries), do
    not start a turn.
    """
    for index in range(len(conversation) - 1, -1, -1):
        if starts_turn(conversation[index]):
            return index
    return -1


def _model_call_notes(message: Message) -> list[dict[str, Any]]:
    """Every record of model calls on ``message``: each notes namespace holding an
    integer ``"attempts"`` (a failed request and a stuck summary may share a message)."""
    return [
        values
        for values in message.notes.values()
        if isinstance(values, dict) and isinstance(values.get("attempts"), int)
    ]


def _spent_in(note: dict[str, Any], session: Session[Any], message: Message) -> Spent:
    """The model calls and tokens a model-call record holds.

    Raises:
        StoredDataError: its ``usage`` is not token counts (stored data is data), naming the
            session and the message.
    """
    usage = note.get("usage") or {}
    tokens = (
        (usage.get("input_tokens", 0), usage.get("output_tokens", 0))
        if isinstance(usage, dict)
        else None
    )
    if tokens is None or not all(type(count) is int for count in tokens):
        shown = repr(usage)
        raise StoredDataError(
            f"stored data is data: the model-call record of session "
            f"{session.id!r}, message {message.id!r} holds usage "
            f"{shown if len(shown) <= 200 else shown[:197] + '...'}, not token counts"
        )
    return Spent(int(note["attempts"]), tokens[0], tokens[1])


def _revision(note: dict[str, Any]) -> int:
    revision = note.get("revision")
    return revision if isinstance(revision, int) else -1


def _answered_calls(conversation: Sequence[Message], skip: set[str]) -> set[tuple[str, str]]:
    """The ``(message id, call id)`` of every call some tool result answers, hidden ones included.

    A result answers the latest earlier call with its id that has no result yet;
    the calls of the messages in ``skip`` (superseded originals) take no result.
    Exact for the calls of ``conversation`` also when it is the tail of a longer one
    (a result never answers a call that comes after it).
    """
    waiting: dict[str, list[str]] = {}  # call id -> ids of messages with it unanswered
    answered: set[tuple[str, str]] = set()
    for message in conversation:
        for part in message.parts:
            if isinstance(part, ToolCallPart):
                if message.role == "assistant" and message.id not in skip:
                    waiting.setdefault(part.call_id, []).append(message.id)
            elif isinstance(part, ToolResultPart):
                holders = waiting.get(part.call_id)
                if holders:
                    answered.add((holders.pop(), part.call_id))
    return answered


def _superseded(conversation: Sequence[Message]) -> set[str]:
    """The ids of the originals the :data:`SUPERSEDES` copies in ``conversation`` replace."""
    return {
        str(message.notes[SUPERSEDES].get("message_id"))
        for message in conversation
        if SUPERSEDES in message.notes
    }


def _message_revision(message: Message) -> int | None:
    """The revision the model call of an assistant message was made at (its first
    model-call record's), which decides the run it belongs to; ``None``: no record."""
    notes = _model_call_notes(message)
    revision = notes[0].get("revision") if notes else None
    return revision if isinstance(revision, int) else None


def _counted_calls(
    conversation: Sequence[Message],
    first: int,
    scope: Scope,
    run_start_revision: int,
    refused: Callable[[ToolCallPart], bool],
    turn_from: int = -1,
) -> list[tuple[str, str]]:
    """The counted tool calls (the module docs' rules) of the messages from ``first`` on,
    oldest first, as ``(message id, call id)``; from ``turn_from`` on too for a turn.

    Exact for those messages whatever ``first`` (a copy comes after its original, a
    result after its call): O(messages from ``first``).
    """
    tail = conversation[first:] if first > 0 else conversation
    superseded = _superseded(tail)
    answered = _answered_calls(tail, superseded)
    counted: list[tuple[str, str]] = []
    for index, message in enumerate(tail, start=max(first, 0)):
        if message.role != "assistant" or not message.tool_calls:
            continue
        if scope == "turn" and index < turn_from:
            continue
        if scope == "run":
            revision = _message_revision(message)
            if revision is None or revision < run_start_revision:
                continue
        if message.id in superseded and not message.visible_to_model:
            continue  # its copy's calls are counted
        counted.extend(
            (message.id, call.call_id)
            for call in message.tool_calls
            if not refused(call)
            and (message.visible_to_model or (message.id, call.call_id) in answered)
        )
    return counted


_REFUSAL_TAG: Final = BudgetRefusal.__struct_config__.tag


def _refused_by_any(call: ToolCallPart) -> bool:
    """Whether some budget step refused ``call`` (a :class:`BudgetRefusal` in its notes)."""
    return any(
        isinstance(value, dict) and value.get(TAG_FIELD) == _REFUSAL_TAG
        for value in call.notes.values()
    )


def current_turn_start(session: Session[Any], view: LedgerView | None = None) -> int:
    """The position of the message that started the current user turn (-1: none).

    Read from the latest model-call ledger ``view`` (``latest_ledger(session)``
    when not given: the turn it was made in, or a turn start after it):
    O(messages since the latest model call). A session without ledgers, or
    whose turn start is gone, is read back from the end (:func:`turn_start`).
    """
    view = latest_ledger(session) if view is None else view
    if view.ledger is not None and not view.legacy:
        started = view.turn_start if view.turn_start is not None else view.ledger.turn_start
        position = -1 if started is None else session.history.message_position(started)
        if position is not None:
            return position
    return turn_start(session.conversation)


def _correction(
    session: Session[Any],
    changes: Sequence[tuple[Message, int | None, int]],
    *,
    refused_by: str | None = None,
    always: bool = False,
) -> LedgerCorrection | None:
    """The correction of the latest ledger for ``changes``: ``(message, position, change)``
    where ``change`` tool calls of ``message`` start counting (negative: stop), and
    ``position`` is where it is (``None``: appended now, so in the current turn).

    Messages without a ledger of their own are left out: no ledger counts their calls
    (readers count them from the records), so a session without ledgers reads nothing.
    """
    changes = [change for change in changes if ledger_on(change[0]) is not None]
    if not changes:
        return None
    view = latest_ledger(session)
    if view.ledger is None or view.legacy:
        return None  # no ledger counts these calls: readers count the records
    start = current_turn_start(session, view)
    session_change = turn_change = 0
    removed: dict[int, int] = {}
    for message, position, change in changes:
        if not change:
            continue
        session_change += change
        if position is None or position >= start:
            turn_change += change
        revision = _message_revision(message)
        if revision is not None:
            removed[revision] = removed.get(revision, 0) - change
    return corrected_ledger(
        view,
        session_change,
        turn_change,
        [[revision, count] for revision, count in removed.items() if count],
        refused_by=refused_by,
        always=always,
    )


def _ledger_counted(message: Message, answered: set[tuple[str, str]], visible: bool) -> int:
    """How many calls of ``message`` a ledger counts when it is ``visible`` or not."""
    if message.role != "assistant":
        return 0
    return sum(
        1
        for call in message.tool_calls
        if not _refused_by_any(call) and (visible or (message.id, call.call_id) in answered)
    )


def hiding_correction(session: Session[Any], message_ids: Sequence[str]) -> LedgerCorrection | None:
    """The ledger correction for hiding ``message_ids`` from the model: their calls that no
    result answers stop counting (for a step that hides replies, such as an invalid-call
    retry). ``None`` when nothing changes. O(messages from the first of them)."""
    index = session.history
    positions = sorted(p for p in (index.message_position(i) for i in message_ids) if p is not None)
    if not positions:
        return None
    conversation = session.conversation
    tail = conversation[positions[0] :]
    answered = _answered_calls(tail, _superseded(tail))
    changes: list[tuple[Message, int | None, int]] = []
    for position in positions:
        message = conversation[position]
        if message.visible_to_model:
            now = _ledger_counted(message, answered, True)
            changes.append((message, position, _ledger_counted(message, answered, False) - now))
    return _correction(session, changes)


def copy_correction(
    session: Session[Any], original: Message, copy: Message
) -> LedgerCorrection | None:
    """The ledger correction for appending ``copy`` (marked :data:`SUPERSEDES`) while hiding
    ``original`` from the model: the copy's calls count instead of the original's.
    ``None`` when nothing changes (the usual case: one call for one)."""
    position = session.history.message_position(original.id)
    if position is None:
        return None
    tail = session.conversation[position:]
    answered = _answered_calls(tail, _superseded(tail))
    before = _ledger_counted(original, answered, original.visible_to_model)
    after = _ledger_counted(copy, set(), True)
    view = latest_ledger(session)
    # The copy keeps the original's notes, its ledger too: once appended it is read as the
    # latest, so it carries the latest ledger whenever the original's is not that one.
    stale = view.turn_start is not None or ledger_on(copy) != view.ledger
    changes = [(original, position, -before), (copy, None, after)]
    return _correction(session, changes, always=stale)


def with_correction(message: Message, correction: LedgerCorrection | None) -> Message:
    """``message`` carrying ``correction`` under :data:`LEDGER` (unchanged for ``None``)."""
    if correction is None:
        return message
    return msgspec.structs.replace(message, notes={**message.notes, LEDGER: note_value(correction)})


def correction_effects(session: Session[Any], correction: LedgerCorrection | None) -> list[Effect]:
    """The effect that writes ``correction`` on the conversation's last message (at or
    after the latest ledger), merged with a correction already there."""
    if correction is None or not len(session.conversation):
        return []
    last = session.conversation[-1]
    where = f"session {session.id!r}, message {last.id!r}"
    try:
        earlier = read_record(last.notes, LEDGER, LedgerCorrection, where=where)
    except StoredDataError:
        earlier = None  # a damaged correction: its ledger does not read either
    if earlier is not None:
        correction = LedgerCorrection(
            ledger=correction.ledger, removed=[*earlier.removed, *correction.removed]
        )
    return [Annotate(last.id, LEDGER, note_value(correction))]


def _ledger_tool_calls(
    session: Session[Any], scope: Scope, run_start_revision: int, refused_by: str
) -> int | None:
    """The tool calls ``scope`` counted, from the latest ledger; ``None`` when the records
    must be counted (a session without tool-call ledgers, or with calls another budget
    step refused). O(messages since the latest model call); for a run, O(the run)."""
    view = latest_ledger(session)
    if view.legacy or not view.tools:
        return None
    ledger = view.ledger
    if ledger is None:
        return 0  # no model call and no assistant message with tool calls
    if any(name != refused_by for name in ledger.refused_by):
        return None
    if scope == "session":
        return ledger.session.tool_calls
    if scope == "turn":
        return 0 if view.turn_start is not None else ledger.turn.tool_calls
    if ledger.revision < run_start_revision:
        return 0  # the latest call was made before this run began
    before = run_ledgers(session, run_start_revision)
    if before.legacy or not before.tools:
        return None
    base = before.ledger.session.tool_calls if before.ledger else 0
    return ledger.session.tool_calls - base + before.added_back


def _refused(call: ToolCallPart, refused_by: str, session: Session[Any]) -> bool:
    where = f"session {session.id!r}, tool call {call.call_id!r}"
    return read_record(call.notes, refused_by, BudgetRefusal, where=where) is not None


def _ledger_spent(session: Session[Any], scope: Scope, run_start_revision: int) -> Spent | None:
    """What ``scope`` spent, from the latest ledger; ``None`` when the records must be counted.

    O(messages since the latest model call); for a run, O(messages of the run).
    """
    view = latest_ledger(session)
    if view.legacy:
        return None
    ledger = view.ledger
    if ledger is None:
        return Spent()  # no model call recorded at all
    if scope == "session":
        return ledger.session
    if scope == "turn":
        return Spent() if view.turn_start is not None else ledger.turn
    if ledger.revision < run_start_revision:
        return Spent()  # the latest call was made before this run began
    before = latest_ledger(session, before_revision=run_start_revision)  # O(the run)
    if before.legacy:
        return None
    return ledger.session - (before.ledger.session if before.ledger else Spent())


def budget_usage(
    session: Session[Any],
    scope: Scope,
    *,
    run_start_revision: int = 0,
    refused_by: str = "budget",
    tool_calls: bool = True,
) -> BudgetUsage:
    """Count what ``scope`` of ``session`` has used (see the module docs for the rules).

    ``refused_by`` names the budget step whose refused tool calls are not
    counted. With ``tool_calls=False`` the tool calls are not counted (left
    empty), and model calls and tokens come from the ledger when the session
    has one: O(messages since the latest model call). With ``tool_calls=True``
    every record is counted (O(history); a :class:`Budget` reads its tool-call
    count from the ledger instead).
    """
    if not tool_calls:
        spent = _ledger_spent(session, scope, run_start_revision)
        if spent is not None:
            return BudgetUsage(spent.model_calls, spent.input_tokens, spent.output_tokens)
    return _counted_usage(session, scope, run_start_revision, refused_by)


def _counted_usage(
    session: Session[Any], scope: Scope, run_start_revision: int, refused_by: str
) -> BudgetUsage:
    """:func:`budget_usage` by reading every record (O(history)): the reference the
    ledgers agree with, and the way for sessions written before them."""
    conversation = session.conversation
    start = turn_start(conversation) if scope == "turn" else -1
    total = Spent()
    for index, message in enumerate(conversation):
        # The turn's own user message counts: a record on it is of a call made after it.
        if index < start:
            continue
        notes = _model_call_notes(message)
        note = notes[0] if notes else None
        if message.role != "assistant":
            # Other steps' model calls (a compaction summary, ...) count as calls too.
            for each in notes:
                if scope != "run" or _revision(each) >= run_start_revision:
                    total += _spent_in(each, session, message)
            continue
        if scope == "run":
            revision = note.get("revision") if note is not None else None
            if not isinstance(revision, int) or revision < run_start_revision:
                continue
        if SUPERSEDES not in message.notes:
            if note is not None:
                total += _spent_in(note, session, message)
            elif any(v.get("interrupted") for v in message.notes.values()):
                total += Spent(1)
    tool_calls = _counted_calls(
        conversation,
        0,
        scope,
        run_start_revision,
        lambda call: _refused(call, refused_by, session),
        start,
    )
    return BudgetUsage(
        total.model_calls,
        total.input_tokens,
        total.output_tokens,
        tuple(call_id for _, call_id in tool_calls),
        tuple(tool_calls),
    )


def _positions_of(conversation: Sequence[Message], call: ToolCallPart) -> list[tuple[str, str]]:
    """Where ``call`` is: the ``(message id, call id)`` of the visible message(s) holding it.

    The message holding this very part object when there is one (``Tools``
    asks about the parts of the conversation itself); otherwise the visible
    messages holding an unanswered call with its id, or failing that any call
    with its id. Oldest first.
    """
    holders = [
        (message, part)
        for message in conversation
        if message.visible_to_model
        for part in message.tool_calls
        if part.call_id == call.call_id
    ]
    chosen = [message for message, part in holders if part is call]
    if not chosen:
        answered = _answered_calls(conversation, set())
        chosen = [m for m, _ in holders if (m.id, call.call_id) not in answered]
    if not chosen:
        chosen = [m for m, _ in holders]
    return [(message.id, call.call_id) for message in chosen] or [("", call.call_id)]


_LIMIT_NAMES: Final[tuple[LimitName, ...]] = (
    "model_calls",
    "input_tokens",
    "output_tokens",
    "total_tokens",
    "tool_calls",
)
_MODEL_LIMITS: Final[tuple[LimitName, ...]] = _LIMIT_NAMES[:4]


def _scoped(
    per_run: Limits | None, per_turn: Limits | None, per_session: Limits | None
) -> tuple[tuple[Scope, Limits | None], ...]:
    return (("run", per_run), ("turn", per_turn), ("session", per_session))


class Budget(Operation[Any]):
    """Yields with ``budget_exhausted`` when a limit is reached; see the module docs.

    Args:
        per_run: limits since the current ``run()`` began.
        per_turn: limits since the last user message.
        per_session: limits over the whole session.
        offer_remaining: add a prompt part telling the model what is left.
        name: the step name and notes namespace.
    """

    def __init__(
        self,
        *,
        per_run: Limits | None = None,
        per_turn: Limits | None = None,
        per_session: Limits | None = None,
        offer_remaining: bool = False,
        name: str = "budget",
    ) -> None:
        self._scopes: tuple[tuple[Scope, Limits], ...] = tuple(
            (scope, limits)
            for scope, limits in _scoped(per_run, per_turn, per_session)
            if limits is not None
        )
        self._offer = offer_remaining
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    # -- counting -------------------------------------------------------------------

    def _usage(
        self, session: Session[Any], scope: Scope, run_start: int, limits: Limits
    ) -> tuple[BudgetUsage, int]:
        """What ``scope`` used, and how many tool calls (counted only under a tool-call
        limit): from the ledgers when the session has them, else from the records."""
        count = 0
        if limits.tool_calls is not None:
            found = _ledger_tool_calls(session, scope, run_start, self._name)
            if found is None:
                usage = _counted_usage(session, scope, run_start, self._name)  # O(history)
                return usage, len(usage.tool_calls)
            count = found
        usage = budget_usage(
            session, scope, run_start_revision=run_start, refused_by=self._name, tool_calls=False
        )
        return usage, count

    @staticmethod
    def _used(usage: tuple[BudgetUsage, int], limit: LimitName) -> int:
        return usage[1] if limit == "tool_calls" else usage[0].used(limit)

    def remaining(self, session: Session[Any], run_start_revision: int) -> dict[str, int]:
        """What is left of each limited quantity, over all scopes (the minimum)."""
        left: dict[str, int] = {}
        for scope, limits in self._scopes:
            usage = self._usage(session, scope, run_start_revision, limits)
            for limit in _LIMIT_NAMES:
                allowed = getattr(limits, limit)
                if allowed is not None:
                    value = max(allowed - self._used(usage, limit), 0)
                    left[limit] = min(left.get(limit, value), value)
        return left

    def _exhausted(
        self, session: Session[Any], run_start: int, limits_of: Sequence[LimitName]
    ) -> dict[str, Any] | None:
        for scope, limits in self._scopes:
            usage = self._usage(session, scope, run_start, limits)
            for limit in limits_of:
                allowed = getattr(limits, limit)
                if allowed is not None and self._used(usage, limit) >= allowed:
                    return {
                        "scope": scope,
                        "limit": limit,
                        "allowed": allowed,
                        "used": self._used(usage, limit),
                    }
        return None

    def _objection(self, session: Session[Any], run_start: int, call: ToolCallPart) -> str | None:
        """Why ``call`` is over a tool-call limit; ``None`` at once without such a limit."""
        for scope, limits in self._scopes:
            if limits.tool_calls is not None and self._over(
                session, run_start, scope, limits.tool_calls, call
            ):
                return f"not executed: tool-call budget exhausted ({limits.tool_calls} per {scope})"
        return None

    def _over(
        self, session: Session[Any], run_start: int, scope: Scope, allowed: int, call: ToolCallPart
    ) -> bool:
        """Whether ``call`` is counted in ``scope`` at a place ``>= allowed``.

        Its place is the count from the ledger minus the counted calls from its
        message on (O(messages since its message)); the records are counted when
        the session has no tool-call ledger, or the call id repeats.
        """
        index = session.history
        count = (
            None
            if call.call_id in index.repeated
            else _ledger_tool_calls(session, scope, run_start, self._name)
        )
        if count is None:
            positions = _positions_of(session.conversation, call)
            counted = _counted_usage(session, scope, run_start, self._name).tool_call_positions
            return any(
                position in positions and place >= allowed for place, position in enumerate(counted)
            )
        holder = index.first_visible_call(call.call_id)
        if holder is None:
            return False  # no message the model sees holds it: never counted
        conversation = session.conversation
        start = current_turn_start(session) if scope == "turn" else -1
        tail = _counted_calls(
            conversation,
            holder,
            scope,
            run_start,
            lambda each: _refused(each, self._name, session),
            start,
        )
        position = (conversation[holder].id, call.call_id)
        if position not in tail:
            return False
        return count - len(tail) + tail.index(position) >= allowed

    # -- hooks ----------------------------------------------------------------------

    def check_call(self, ctx: StepContext[Any], call: ToolCallPart) -> str | None:
        """Object to a call that is over a tool-call limit."""
        return self._objection(ctx.session, ctx.run_start_revision, call)

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        session = ctx.session
        run_start = ctx.run_start_revision

        open_calls = open_tool_calls(session)
        if open_calls:
            objections = {c.call_id: self._objection(session, run_start, c) for c in open_calls}
            if any(reason is None for reason in objections.values()):
                return Refuse("some open tool calls are within the budget")
            return self._refuse_calls(ctx, open_calls, objections)
        if needs_answer(session):
            exhausted = self._exhausted(session, run_start, _MODEL_LIMITS)
            if exhausted is not None:
                why = (
                    f"{exhausted['limit']} budget per {exhausted['scope']} exhausted "
                    f"({exhausted['used']} of {exhausted['allowed']})"
                )
                return Yield(
                    self._mark_exhausted(session, why),
                    YieldReason(YieldReason.BUDGET_EXHAUSTED, why, exhausted),
                )
        return Refuse("within budget")

    def _mark_exhausted(self, session: Session[Any], why: str) -> list[Effect]:
        """Record the refusal on the last message the model sees, once (key ``"exhausted"``).

        So the store says why the session stopped (an inspector reads it); a
        repeated yield for the same reason writes nothing.
        """
        last = next((m for m in reversed(session.conversation) if m.visible_to_model), None)
        if last is None:
            return []
        where = f"session {session.id!r}, message {last.id!r}"
        recorded = read_record(last.notes, self._name, BudgetRefusal, key="exhausted", where=where)
        if recorded is not None and recorded.refused == why:
            return []
        value = {"exhausted": note_value(BudgetRefusal(refused=why))}
        return [Annotate(last.id, self._name, value)]

    def _refuse_calls(
        self,
        ctx: StepContext[Any],
        calls: Sequence[ToolCallPart],
        objections: dict[str, str | None],
    ) -> Outcome:
        session = ctx.session
        index = session.history
        effects: list[Effect] = []
        changes: list[tuple[Message, int | None, int]] = []
        for position, call in index.open_call_positions():
            if call not in calls:
                continue
            reason = objections[call.call_id] or ""
            # The open call's own message (with a repeated call id, not the first holder).
            message = session.conversation[position]
            refusal = note_value(BudgetRefusal(refused=reason))
            effects.append(Annotate(message.id, self._name, refusal, call_id=call.call_id))
            changes.append((message, position, -1))
            result = ToolResultPart.for_call(call, reason, is_error=True)
            note = {self._name: note_value(BudgetRefusal(refused=call.call_id))}
            effects.append(AppendMessage(Message.tool_result(result, id=ctx.new_id(), notes=note)))
        # A refused call stops counting: the last result carries the corrected ledger.
        correction = _correction(session, changes, refused_by=self._name)
        last = effects[-1] if effects else None
        if correction is not None and isinstance(last, AppendMessage):
            effects[-1] = AppendMessage(with_correction(last.message, correction))
        return Yield(
            effects,
            YieldReason(
                YieldReason.BUDGET_EXHAUSTED,
                "tool-call budget exhausted",
                {"limit": "tool_calls", "calls": [c.call_id for c in calls]},
            ),
        )

    def shape_request(self, ctx: StepContext[Any], request: ModelRequest) -> ModelRequest:
        """Cap ``max_attempts`` and ``max_tokens`` by what is left; offer it if asked.

        Raises:
            BudgetExhaustedError: no model call is left (the budget was placed
                after inference, so it could not yield first).
        """
        session, run_start = ctx.session, ctx.run_start_revision
        left = self.remaining(session, run_start)
        if not left:
            return request
        changes: dict[str, Any] = {}
        exhausted = self._exhausted(session, run_start, _MODEL_LIMITS)
        if exhausted is not None:
            raise BudgetExhaustedError(
                f"exact budgets: session {session.id!r} has no model call left "
                f"({exhausted}); place Budget before the inference step so it can yield"
            )
        if "model_calls" in left:
            current = request.max_attempts
            changes["max_attempts"] = (
                left["model_calls"] if current is None else min(current, left["model_calls"])
            )
        token_cap = min(
            (left[k] for k in ("output_tokens", "total_tokens") if k in left), default=None
        )
        if token_cap is not None:
            current_max = request.settings.max_tokens
            capped = token_cap if current_max is None else min(current_max, token_cap)
            changes["settings"] = msgspec.structs.replace(request.settings, max_tokens=capped)
        if self._offer:
            text = "Budget remaining: " + ", ".join(
                f"{value} {limit.replace('_', ' ')}" for limit, value in left.items()
            )
            changes["prompt_parts"] = (
                *request.prompt_parts,
                PromptPart(source=self._name, text=text),
            )
        return msgspec.structs.replace(request, **changes) if changes else request
