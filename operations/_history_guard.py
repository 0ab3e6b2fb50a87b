"""``HistoryGuard``: repair a conversation so every provider accepts it, and ``fsck``.

Valid history says that before any model request every tool call
has exactly one result, results follow their calls and call ids are unique.
:class:`HistoryGuard` keeps it true for histories that got broken from outside
the machine (an application that ``submit``-ted messages while a call was open,
a crash between a call and its result, an import from another system) and adds
one provider rule the kernel does not check: no empty assistant turns. Every
repair is an effect with a note saying why (namespace ``"history_guard"``);
nothing is rewritten silently and nothing is deleted.

:func:`fsck` reports the same problems for a stored session without changing it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import msgspec

from stepmachine import (
    Annotate,
    AppendMessage,
    Continue,
    DocumentPart,
    Effect,
    ImagePart,
    Message,
    NoData,
    Operation,
    Outcome,
    Refuse,
    ReplaceConversation,
    Session,
    SetVisibility,
    StepContext,
    ToolCallPart,
    ToolResultPart,
)
from stepmachine.extend import Conversation, HistoryIndex, apply_effects, journal_entry

from ._budget import correction_effects, hiding_correction

__all__ = [
    "CALL_OUTSIDE_ASSISTANT",
    "DUPLICATE_CALL_ID",
    "EMPTY_ASSISTANT",
    "HISTORY_GUARD",
    "OPEN_CALL",
    "ORPHANED_CALL",
    "ORPHAN_RESULT",
    "RESULT_BEFORE_CALL",
    "SECOND_RESULT",
    "HistoryGuard",
    "Problem",
    "fsck",
]

HISTORY_GUARD: Final = "history_guard"
"""The default step name, and the notes namespace of every repair."""

# Problem kinds -------------------------------------------------------------------------
CALL_OUTSIDE_ASSISTANT: Final = "call_outside_assistant"
"""A tool call in a message whose role is not ``assistant``."""
DUPLICATE_CALL_ID: Final = "duplicate_call_id"
"""A tool call whose id an earlier visible call already used."""
ORPHAN_RESULT: Final = "orphan_result"
"""A tool result whose call id names no visible call at all."""
RESULT_BEFORE_CALL: Final = "result_before_call"
"""A tool result that comes before the call it answers."""
SECOND_RESULT: Final = "second_result"
"""A tool result for a call that already has one."""
ORPHANED_CALL: Final = "orphaned_call"
"""A call without a result that a later assistant message follows: the model moved on without it."""
OPEN_CALL: Final = "open_call"
"""A call without a result and no assistant message after it: pending (Tools, approval, ...).

User, system or tool messages after it do not change that: a late result is shown right
after its call in requests (:func:`stepmachine.request_order`).
"""
EMPTY_ASSISTANT: Final = "empty_assistant"
"""An assistant message with no text, no tool call and no reasoning."""


class Problem(msgspec.Struct, frozen=True):
    """One way a stored conversation breaks what providers accept.

    Attributes:
        index: position of the message in ``session.conversation`` (hidden
            messages included, so it indexes the stored conversation).
        message_id: the id of that message.
        kind: one of the kind constants of this module (``orphan_result``, ...).
        detail: a readable explanation.
        call_id: the tool call concerned, when there is one.
    """

    index: int
    message_id: str
    kind: str
    detail: str
    call_id: str | None = None


def _nothing_to_repair(session: Session[Any], advertised: set[str], has_tools_step: bool) -> bool:
    """Whether :meth:`HistoryGuard.repairs` finds nothing, read from the history index. O(open).

    True only if the index shows no problem a repair handles: nothing but
    calls waiting for a result (``sound``), no empty assistant message before
    the last visible one, no open call that an assistant message moved past,
    and (without a step that answers unknown tools) no open call naming a
    tool nobody offers.
    """
    index = session.history
    if not index.sound:
        return False
    if any(position < index.last_visible for position in index.empty_assistants):
        return False
    for position, call in index.open_call_positions():
        if position < index.last_assistant:
            return False  # orphaned: the model moved on past it
        if not has_tools_step and call.name not in advertised:
            return False
    return True


def _calls_without_result(session: Session[Any]) -> list[tuple[Problem, ToolCallPart]] | None:
    """The calls without a result, as :func:`_analyse` reports them, read from the history
    index when they are the only problems a repair handles; ``None`` when they are not.

    ``None`` unless the history is sound (each call id once, every result after its
    call) and no empty assistant message precedes the last visible message. Then the
    problems :func:`_analyse` would report, apart from an empty assistant message that
    ends the conversation (never repaired), are the open calls: ``orphaned_call`` when
    an assistant message follows, ``open_call`` otherwise. O(open calls).
    """
    index = session.history
    if not index.sound or any(position < index.last_visible for position in index.empty_assistants):
        return None
    conversation = session.conversation
    found: list[tuple[Problem, ToolCallPart]] = []
    for position, call in index.open_call_positions():
        moved_on = position < index.last_assistant
        problem = Problem(
            position,
            conversation[position].id,
            ORPHANED_CALL if moved_on else OPEN_CALL,
            _no_result_detail(call.call_id, position, moved_on=moved_on),
            call.call_id,
        )
        found.append((problem, call))
    found.sort(key=lambda item: item[0].index)
    return found


def _no_result_detail(call_id: str, index: int, *, moved_on: bool) -> str:
    return f"tool call {call_id!r} at message {index} has no result" + (
        " and a later assistant message moved on past it" if moved_on else " yet"
    )


def _analyse(conversation: Sequence[Message]) -> list[Problem]:
    """Every problem of the visible conversation, ordered by message position."""
    problems: list[Problem] = []
    visible = [(i, m) for i, m in enumerate(conversation) if m.visible_to_model]
    later_calls: dict[str, int] = {}  # call id -> how many visible calls carry it, not yet seen
    for _, message in visible:
        for call in message.tool_calls:
            later_calls[call.call_id] = later_calls.get(call.call_id, 0) + 1
    calls: dict[str, tuple[int, Message, ToolCallPart]] = {}
    answered: set[str] = set()
    for index, message in visible:
        for call in message.tool_calls:
            later_calls[call.call_id] -= 1
            if message.role != "assistant":
                problems.append(
                    Problem(
                        index,
                        message.id,
                        CALL_OUTSIDE_ASSISTANT,
                        f"message {index} ({message.id!r}, role {message.role!r}) holds tool "
                        f"call {call.call_id!r}; only assistant messages may",
                        call.call_id,
                    )
                )
            if call.call_id in calls:
                first = calls[call.call_id][0]
                problems.append(
                    Problem(
                        index,
                        message.id,
                        DUPLICATE_CALL_ID,
                        f"tool call id {call.call_id!r} at message {index} was already used "
                        f"at message {first}",
                        call.call_id,
                    )
                )
            else:
                calls[call.call_id] = (index, message, call)
        for result in message.tool_results:
            if result.call_id not in calls:
                before = later_calls.get(result.call_id, 0) > 0
                problems.append(
                    Problem(
                        index,
                        message.id,
                        RESULT_BEFORE_CALL if before else ORPHAN_RESULT,
                        f"tool result for {result.call_id!r} at message {index} "
                        + ("comes before its call" if before else "follows no call"),
                        result.call_id,
                    )
                )
            elif result.call_id in answered:
                problems.append(
                    Problem(
                        index,
                        message.id,
                        SECOND_RESULT,
                        f"tool call {result.call_id!r} has a second result at message {index}",
                        result.call_id,
                    )
                )
            else:
                answered.add(result.call_id)
        if HistoryIndex.is_empty_assistant(message):
            problems.append(
                Problem(
                    index,
                    message.id,
                    EMPTY_ASSISTANT,
                    f"assistant message {index} ({message.id!r}) has no text, tool call or "
                    "reasoning",
                )
            )
    # Assistant messages, hidden ones included: hiding a turn (say, an empty one) does not
    # undo the fact that the model was asked while the call was open.
    assistant_at = [i for i, m in enumerate(conversation) if m.role == "assistant"]
    for call_id, (index, message, _) in calls.items():
        if call_id in answered:
            continue
        moved_on = any(i > index for i in assistant_at)
        problems.append(
            Problem(
                index,
                message.id,
                ORPHANED_CALL if moved_on else OPEN_CALL,
                _no_result_detail(call_id, index, moved_on=moved_on),
                call_id,
            )
        )
    problems.sort(key=lambda p: p.index)
    return problems


def fsck(session: Session[Any]) -> list[Problem]:
    """Report every problem of ``session``'s model-visible conversation; change nothing.

    Covers everything :func:`stepmachine.history_problems` reports (as
    structured :class:`Problem` values, ordered by message position) plus
    empty assistant messages. A call without a result is ``orphaned_call``
    when an assistant message (visible or hidden) follows it -- the model
    moved on without its result -- and ``open_call`` (pending, normal while
    tools run or approvals wait) otherwise, even when user messages follow it:
    requests show a late result right after its call
    (:func:`stepmachine.request_order`). Hidden messages are never reported:
    they are never sent.

    Returns:
        The problems; an empty list means any provider accepts the history.
    """
    index = session.history
    if index.valid and not index.empty_assistants:
        return []  # the index knows: nothing to report, no scan
    return _analyse(session.conversation)


def _orphan_content(call: ToolCallPart, why: str) -> str:
    journal = journal_entry(call)
    if journal is not None and journal.intent:
        return (
            f"orphaned: no result was recorded for this tool call and it can no longer be "
            f"answered ({why}). It was started, so its outcome is unknown."
        )
    return (
        f"orphaned: no result was recorded for this tool call and it can no longer be "
        f"answered ({why}). It was not run."
    )


class HistoryGuard(Operation[Any]):
    """Repairs the model-visible conversation before inference, with recorded effects.

    Applies whenever the visible conversation has a problem that would make
    the next model request invalid (see :func:`fsck` for the kinds); refuses
    otherwise -- in particular for calls that are merely pending (``open_call``:
    the conversation ends on them, Tools or an approval will answer them) and
    for an empty assistant reply that ends the conversation (it is never sent).
    Repairs, all in one ``Continue`` batch, each with a note under the step's
    name (``{"repair": kind, "detail": ...}``):

    * a tool call outside an assistant message, or a call whose id repeats an
      earlier call's: the message holding it is hidden (``SetVisibility
      to_model=False``) -- for duplicates the *later* message, since the first
      call is the one its results were matched to. Results of other calls of a
      hidden message then become orphans and are hidden too. Hidden calls that
      no result answers stop counting for budgets (a ledger correction on the
      last message);
    * an orphan result, a result before its call, a second result: the tool
      message is hidden; if it also holds good results, a copy without the bad
      parts is inserted right after it (``ReplaceConversation``);
    * an empty assistant message that something follows: hidden;
    * an orphaned call (no result, and a later assistant message shows the
      model moved on without it): an error result is inserted right after the
      call's message and its sibling results (``ReplaceConversation``, or
      ``AppendMessage`` when that is the end). If the journal recorded an
      intent the content says the outcome is unknown. A call that only user
      (or system) messages follow is pending, not orphaned: a user may write
      while a call waits for approval or a tool runs, and requests show the
      late result right after its call (:func:`stepmachine.request_order`);
    * a pending call naming a tool no step advertises, in a machine without a
      step that answers such calls (``ctx.answers_unknown_tools``; a ``Tools``
      step answers them "unknown tool"): an error result.

    It also objects (``check_call``) to running an orphaned call (by the same
    rule: an assistant message follows it), so a ``Tools`` step never runs a
    call the model already moved on from, whatever the step order; a pending
    call that user messages follow is not objected to.

    Placement: after the operations that answer or decide tool calls (Approval,
    invalid-call recovery, Tools) so pending calls are theirs to answer, and
    before Compaction and ModelInference, so those always see a valid history.
    Never yields. Cancellation: no awaits, nothing to finalize.

    Cost per cycle: a history whose only problems are calls without a result
    (pending, orphaned, naming an unknown tool) is read from the history index,
    O(open calls) plus the messages after each call answered; an answer inserted
    before the end rebuilds the conversation (``ReplaceConversation``), and so
    does any other repair, which reads the whole visible history (rare: a
    history broken from outside the machine).

    Args:
        name: the step name and notes namespace.
    """

    def __init__(self, *, name: str = HISTORY_GUARD) -> None:
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def check_call(self, ctx: StepContext[Any], call: ToolCallPart) -> str | None:
        index = ctx.session.history
        if index.sound:  # each call id once: the call is orphaned iff it is open and moved past
            orphaned = any(
                open_call.call_id == call.call_id and position < index.last_assistant
                for position, open_call in index.open_call_positions()
            )
        else:
            orphaned = any(
                problem.kind == ORPHANED_CALL and problem.call_id == call.call_id
                for problem in _analyse(ctx.session.conversation)
            )
        if orphaned:
            return (
                "the model moved on past this call (an assistant message follows it); "
                "the history guard answers it"
            )
        return None

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        effects = self.repairs(ctx)
        if not effects:
            return Refuse("the visible history is valid for any provider")
        return Continue(effects)

    def repairs(self, ctx: StepContext[Any]) -> list[Effect]:
        """The effects that make ``ctx.session`` valid; empty when it already is."""
        advertised = {d.name for d in ctx.tools}
        has_tools_step = ctx.answers_unknown_tools
        session = ctx.session
        if _nothing_to_repair(session, advertised, has_tools_step):
            return []
        effects: list[Effect] = []
        for _ in range(len(session.conversation) + 4):  # each round fixes one kind, bounded
            batch = self._one_round(ctx, session, advertised, has_tools_step)
            if not batch:
                break
            session = apply_effects(session, batch)
            effects.extend(batch)
        return effects

    def _one_round(
        self,
        ctx: StepContext[Any],
        session: Session[Any],
        advertised: set[str],
        has_tools_step: bool,
    ) -> list[Effect]:
        conversation = session.conversation
        pending = _calls_without_result(session)
        if pending is not None:  # only calls without a result: answer them from the index
            return self._answer_unanswerable(ctx, conversation, pending, advertised, has_tools_step)
        problems = _analyse(conversation)

        hide = [p for p in problems if p.kind in (CALL_OUTSIDE_ASSISTANT, DUPLICATE_CALL_ID)]
        if hide:
            return self._hide(hide, session)

        bad_results = [p for p in problems if p.kind in (ORPHAN_RESULT, RESULT_BEFORE_CALL)]
        bad_results += [p for p in problems if p.kind == SECOND_RESULT]
        if bad_results:
            return self._drop_results(ctx, conversation, bad_results)

        last_visible = session.history.last_visible
        empty = [p for p in problems if p.kind == EMPTY_ASSISTANT and p.index < last_visible]
        if empty:
            return self._hide(empty, session)

        calls: list[tuple[Problem, ToolCallPart]] = []
        for p in problems:
            if p.kind in (ORPHANED_CALL, OPEN_CALL):
                call = _find_call(conversation[p.index], p.call_id)
                assert call is not None  # the analysis found it there
                calls.append((p, call))
        return self._answer_unanswerable(ctx, conversation, calls, advertised, has_tools_step)

    def _answer_unanswerable(
        self,
        ctx: StepContext[Any],
        conversation: Sequence[Message],
        calls: list[tuple[Problem, ToolCallPart]],
        advertised: set[str],
        has_tools_step: bool,
    ) -> list[Effect]:
        """Answer the orphaned calls, and the pending ones naming a tool nobody offers."""
        unanswerable: list[tuple[Problem, ToolCallPart, str]] = []
        for p, call in calls:
            if p.kind == ORPHANED_CALL:
                unanswerable.append((p, call, "the model moved on past it"))
            elif p.kind == OPEN_CALL and not has_tools_step and call.name not in advertised:
                unanswerable.append((p, call, f"no step provides a tool named {call.name!r}"))
        if unanswerable:
            return self._answer(ctx, conversation, unanswerable)
        return []

    def _note(self, problem: Problem, **extra: Any) -> dict[str, Any]:
        return {"repair": problem.kind, "detail": problem.detail, **extra}

    def _hide(
        self, problems: Sequence[Problem], session: Session[Any] | None = None
    ) -> list[Effect]:
        """Hide the messages of ``problems``; with ``session``, the calls of a hidden reply
        that no result answers stop counting (the correction of the budgets' ledger)."""
        ids = tuple(dict.fromkeys(p.message_id for p in problems))
        effects: list[Effect] = [SetVisibility(ids, to_model=False)]
        if session is not None:
            effects.extend(correction_effects(session, hiding_correction(session, ids)))
        for message_id in ids:
            mine = [p for p in problems if p.message_id == message_id]
            note = self._note(mine[0], hidden=True)
            if len(mine) > 1:
                note["also"] = [p.detail for p in mine[1:]]
            effects.append(Annotate(message_id, self._name, note))
        return effects

    def _drop_results(
        self, ctx: StepContext[Any], conversation: Sequence[Message], problems: list[Problem]
    ) -> list[Effect]:
        # One message per round. Bad parts are dropped from the end of the message, so of two
        # results for one call id in one message the later (the second result) goes.
        by_message: dict[int, list[Problem]] = {}
        for p in problems:
            by_message.setdefault(p.index, []).append(p)
        index, mine = min(by_message.items())
        message = conversation[index]
        bad_ids = [p.call_id for p in mine]
        kept: list[Any] = []
        following: list[Any] = []  # the images and documents after a result go with it
        for part in reversed(message.parts):
            if isinstance(part, ImagePart | DocumentPart):
                following.insert(0, part)
                continue
            if isinstance(part, ToolResultPart) and part.call_id in bad_ids:
                bad_ids.remove(part.call_id)
                following = []
                continue
            kept[0:0] = [part, *following]
            following = []
        kept[0:0] = following
        effects = self._hide(mine)
        if not kept:
            return effects
        copy = Message(
            id=ctx.new_id(),
            role=message.role,
            parts=tuple(kept),
            notes={self._name: {"repair": "split", "copy_of": message.id}},
        )
        hidden = apply_effects(_as_session(conversation), effects).conversation
        effects.append(_insert(hidden, index + 1, copy))
        return effects

    def _answer(
        self,
        ctx: StepContext[Any],
        conversation: Sequence[Message],
        problems: list[tuple[Problem, ToolCallPart, str]],
    ) -> list[Effect]:
        # One inserted message per call, each placed after the call's message and the tool
        # messages right after it; insert from the back so earlier positions stay valid.
        # Finding the places reads what follows each call's message; only an insert before
        # the end rebuilds the conversation.
        inserts: list[tuple[int, Message]] = []
        for problem, call, why in problems:
            position = problem.index + 1
            while position < len(conversation) and (
                conversation[position].role == "tool" or not conversation[position].visible_to_model
            ):
                position += 1
            result = ToolResultPart(
                call_id=call.call_id,
                content=_orphan_content(call, why),
                is_error=True,
                name=call.name,
            )
            note = self._note(problem, why=why, call_id=call.call_id)
            message = Message(
                id=ctx.new_id(), role="tool", parts=(result,), notes={self._name: note}
            )
            inserts.append((position, message))
        if all(position == len(conversation) for position, _ in inserts):
            return [AppendMessage(message) for _, message in inserts]
        new = list(conversation)
        for position, message in sorted(inserts, key=lambda item: item[0], reverse=True):
            new.insert(position, message)
        # Several inserts at one position were inserted in reverse; restore call order there.
        return [ReplaceConversation(tuple(_stable_order(new, inserts)))]


def _stable_order(new: list[Message], inserts: list[tuple[int, Message]]) -> list[Message]:
    order = {message.id: n for n, (_, message) in enumerate(inserts)}
    result: list[Message] = []
    run: list[Message] = []
    for message in new:
        if message.id in order:
            run.append(message)
            continue
        result.extend(sorted(run, key=lambda m: order[m.id]))
        run = []
        result.append(message)
    result.extend(sorted(run, key=lambda m: order[m.id]))
    return result


def _find_call(message: Message, call_id: str | None) -> ToolCallPart | None:
    for call in message.tool_calls:
        if call.call_id == call_id:
            return call
    return None


def _as_session(conversation: Sequence[Message]) -> Session[Any]:
    return Session(
        id="history_guard", revision=0, conversation=Conversation(conversation), data=NoData()
    )


def _insert(conversation: Sequence[Message], position: int, message: Message) -> Effect:
    if position >= len(conversation):
        return AppendMessage(message)
    new = (*conversation[:position], message, *conversation[position:])
    return ReplaceConversation(new)
