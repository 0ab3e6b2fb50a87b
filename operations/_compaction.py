"""``Compaction``: summarise old history when the conversation grows too long.

Before the model is asked (the conversation ends on something the model must
answer), :class:`Compaction` estimates the size of the model-visible
conversation. Above a threshold -- or reactively, when ``ModelInference``
marked the last message ``context_length_exceeded`` after a provider's
context-length error -- it asks a summariser model for a summary of the older
messages and records one :class:`~stepmachine.ReplaceConversation` in which:

* the system messages stay visible, wherever they are;
* the last ``keep_turns`` turns (a turn starts at a user message) stay visible;
  when there is nothing older than them to summarise -- a long tool loop inside
  one turn -- the cut moves inside the last turn: its user message stays
  visible, and so do the last ``keep_rounds`` rounds (a round starts at an
  assistant message);
* every other visible message is hidden from the model (``visible_to_model=False``,
  noted with a :class:`CompactionMark` whose ``summarised_into`` is the summary's
  id), never deleted, and stays visible to users;
* a summary message (role ``user``, hidden from users, who still see the
  originals) is inserted right before the first message kept after the cut.
  Its notes, under the step's name, hold the receipt, a :class:`CompactionReceipt`:
  ``summarised`` (message ids), ``tokens_before``/``tokens_after`` (estimated,
  visible conversation), ``model``, ``trigger``, ``usage``, ``revision``.

Why ``ReplaceConversation`` rather than ``SetVisibility`` plus ``AppendMessage``:
the summary must sit *before* the kept messages, and only a replacement can
insert; it keeps every original (with its id) in the same order, so one effect
does it all and the audit log shows the whole result.

The cut is always at a boundary where every earlier call has its result
earlier, and compaction only runs when no call is open and the visible history
is valid (:func:`stepmachine.history_problems` is empty), so a tool call is
never split from its result. Older summaries are summarised again with the
rest (a rolling summary), and never count as a turn.

No progress, no loop: when nothing but earlier summaries lies before the cut,
or the summariser's answer is empty or does not make the conversation smaller,
the step yields ``compaction_stuck`` (``data["reason"]``: ``nothing_to_summarise``,
``empty_summary`` or ``not_smaller``). The last two cost a model call, so they
are recorded on the last visible message (a :class:`CompactionMark` with
``stuck`` set) and not retried until a new message arrives. With ``on_stuck="proceed"`` a
threshold-triggered compaction that is stuck lets inference go ahead instead
(an overflow always yields: inference would only fail again).

The summariser's request is a model call like any other (exact budgets): it
goes through every step's ``shape_request`` (``ctx.shape_request``; so a
budget caps its attempts and tokens), and its ``attempts`` and ``usage`` are
recorded in the receipt (or with the ``stuck`` note), so budgets count it.
The call is staged work, as :class:`~stepmachine.ModelInference`'s is: a
summary request that fails after the adapter's retries records its attempts
on the last visible message (a :class:`CompactionMark`) before the error
propagates, and a budgeted request (``max_attempts`` capped) first reserves
its calls there (``reserved``), so a crash never gives a call back.
It is a side request (``purpose="summary"``): the machine keeps
its transcript as the only message, no tools and no native output schema,
whatever shapers return for the conversation's own requests.

After a reactive compaction the ``context_length_exceeded`` mark of the last
message is set back to ``False`` (an ``Annotate`` in the inference step's
namespace), so that another overflow leads to another compaction, or to a
``compaction_stuck`` yield, rather than to ``ModelInference`` raising.

Cost per cycle: deciding whether to compact reads the session's history index
(the last visible message, validity, and the token estimate of the visible
messages it keeps, :attr:`stepmachine.HistoryIndex.estimated_tokens`), never
the whole history -- with the default ``count_tokens``. A custom counter is
called with the visible messages, each cycle the model is about to be asked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final, Literal

import msgspec

from stepmachine import (
    Annotate,
    AudioPart,
    ConfigurationError,
    Continue,
    DocumentPart,
    Effect,
    ImagePart,
    Message,
    ModelError,
    ModelRequest,
    ModelResponse,
    ModelSettings,
    Operation,
    Outcome,
    PromptPart,
    Refuse,
    ReplaceConversation,
    Session,
    Staged,
    StepContext,
    Task,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    Usage,
    Yield,
)
from stepmachine._index import estimate_tokens
from stepmachine._ledger import standing_ledger
from stepmachine._model_call import Attempts, counting, failed_attempts, reserved_calls
from stepmachine._outcomes import constant_record
from stepmachine.extend import (
    CONTEXT_LENGTH_EXCEEDED,
    InferenceAttempts,
    Ledger,
    Recorder,
    YieldReason,
    needs_answer,
    next_ledger,
    note_value,
    read_record,
)

from ._records import CompactionMark, CompactionReceipt

__all__ = [
    "COMPACTION",
    "COMPACTION_STUCK",
    "SUMMARY_PREFIX",
    "SUMMARY_PROMPT",
    "Compaction",
    "CompactionMark",
    "CompactionReceipt",
    "estimate_tokens",
    "render_transcript",
]

COMPACTION: Final = "compaction"
"""The default step name, and the notes namespace of receipts."""

COMPACTION_STUCK: Final = "compaction_stuck"
"""Yield reason kind: compaction is needed and cannot make the conversation smaller."""

SUMMARY_PREFIX: Final = "[Summary of the earlier conversation, which was compacted]"
"""The first line of every summary message."""

SUMMARY_PROMPT: Final = (
    "You summarise the earlier part of a conversation between a user and an AI assistant "
    "that uses tools, so that the assistant can continue the work from your summary and the "
    "most recent messages alone. Keep the user's goals and instructions, decisions made, "
    "facts learned from tool results (names, numbers, paths, ids), what was done and what is "
    "still to do. Be concise. Answer with the summary only, in plain text."
)
"""The default system prompt of the summariser request."""


def _summary_receipt(message: Message, namespace: str) -> CompactionReceipt | None:
    """The receipt of a summary message, or ``None`` for any other message."""
    value = message.notes.get(namespace)
    if not (isinstance(value, dict) and value.get("kind") == "summary"):
        return None
    where = f"message {message.id!r}"
    return read_record(message.notes, namespace, CompactionReceipt, where=where)


def _mark(message: Message, namespace: str) -> CompactionMark | None:
    """The compaction mark on ``message``, or ``None`` (none, or it is a summary)."""
    value = message.notes.get(namespace)
    if value is None or (isinstance(value, dict) and value.get("kind") == "summary"):
        return None
    return read_record(message.notes, namespace, CompactionMark, where=f"message {message.id!r}")


def _overflowed(message: Message) -> list[str]:
    """The namespaces in which an inference step marked ``message`` context_length_exceeded."""
    marked = []
    for namespace, value in message.notes.items():
        if isinstance(value, dict) and CONTEXT_LENGTH_EXCEEDED in value:
            where = f"message {message.id!r}"
            attempts = read_record(message.notes, namespace, InferenceAttempts, where=where)
            if attempts is not None and attempts.context_length_exceeded:
                marked.append(namespace)
    return sorted(marked)


def render_transcript(messages: Sequence[Message], *, summary_namespace: str = COMPACTION) -> str:
    """The messages as a plain-text transcript for the summariser (media named in a line)."""
    lines: list[str] = []
    for message in messages:
        if _summary_receipt(message, summary_namespace) is not None:
            text = message.text.removeprefix(SUMMARY_PREFIX).strip()
            lines.append(f"[summary of what came before]\n{text}")
            continue
        for part in message.parts:
            if isinstance(part, TextPart) and part.text.strip():
                lines.append(f"[{message.role}] {part.text}")
            elif isinstance(part, ToolCallPart):
                lines.append(f"[{message.role} calls {part.name}] {part.raw_arguments}")
            elif isinstance(part, ToolResultPart):
                error = " (error)" if part.is_error else ""
                lines.append(f"[result of {part.name or part.call_id}{error}] {part.content}")
            elif isinstance(part, ImagePart | DocumentPart | AudioPart):
                # named (the summariser cannot see it; the summary can say it was given)
                lines.append(f"[{message.role} gave {_media_words(part)}]")
    return "\n".join(lines)


def _media_words(part: ImagePart | DocumentPart | AudioPart) -> str:
    kind = {ImagePart: "an image", DocumentPart: "a document", AudioPart: "audio"}[type(part)]
    title = getattr(part, "title", None)
    named = f" {title!r}" if title else ""
    size = f"{len(part.data):,} bytes" if part.data is not None else "by URL"
    return f"{kind}{named} ({part.media_type or 'unknown type'}, {size})"


class _Plan(msgspec.Struct, frozen=True):
    cut: int  # position in the visible list of the first kept message after the summary
    summarised: tuple[int, ...]  # positions in the visible list
    mode: str  # "turns" or "rounds"


class Compaction(Operation[Any]):
    """Replaces old history by a summary when the conversation is too long.

    Applies when the conversation ends on something the model must answer
    (:func:`stepmachine.needs_answer`: so never while a tool call is open), its
    visible history is valid, and either the estimated size of the visible
    conversation exceeds ``threshold`` or its last message carries a
    ``context_length_exceeded`` mark from an inference step. Then it calls the
    summariser and continues with one ``ReplaceConversation`` (plus, after an
    overflow, the ``Annotate`` resetting the mark), or yields
    ``compaction_stuck``; see the module docs for what is kept and recorded.

    Placement: after Tools (and the HistoryGuard), immediately before the
    inference step. Compaction refuses while a call is open whatever its
    position, but placing it after the steps that answer calls means it sees
    each finished round of a tool loop; placing it after HistoryGuard means it
    never refuses because of a broken history. Before inference, so that every
    model request -- including the one after a context-length error -- is
    made from the compacted history. Decisions survive compaction: notes on
    hidden messages and calls stay where they are.

    Args:
        threshold: compact when the visible conversation's estimated tokens
            exceed this (the system prompt and tool definitions are not counted:
            leave room for them).
        keep_turns: turns kept verbatim (>= 1).
        keep_rounds: rounds of the last turn kept when the cut must move inside
            it; ``None`` never cuts inside a turn.
        model: the summariser's name in ``runtime.models``; ``None`` uses
            ``runtime.model``.
        count_tokens: the size estimate of a list of messages.
        prompt: the summariser's system prompt.
        settings: sampling settings of the summariser request.
        on_stuck: ``"yield"`` (default) or ``"proceed"``, see the module docs.
        name: the step name and notes namespace.

    The summariser request (``purpose="summary"``) goes through every step's
    ``shape_request``, like the inference step's requests, so a budget caps
    its attempts and tokens (and its calls are recorded in the receipt, so
    budgets count them).

    Raises (from ``run``): whatever the summariser raises (``ModelError``);
    nothing is recorded then. ``BudgetExhaustedError`` from a budget's
    ``shape_request`` when no model call is left -- place the budget before
    Compaction, so that it yields first.

    Cancellation: the summariser request is abandoned and nothing is recorded
    (the replacement is returned only once complete), so the history is as it
    was; nothing to finalize.
    """

    def __init__(
        self,
        *,
        threshold: int,
        keep_turns: int = 1,
        keep_rounds: int | None = 2,
        model: str | None = None,
        count_tokens: Callable[[Sequence[Message]], int] = estimate_tokens,
        prompt: str = SUMMARY_PROMPT,
        settings: ModelSettings | None = None,
        on_stuck: Literal["yield", "proceed"] = "yield",
        name: str = COMPACTION,
    ) -> None:
        if keep_turns < 1:
            raise ConfigurationError(f"keep_turns must be at least 1, got {keep_turns}")
        if keep_rounds is not None and keep_rounds < 1:
            raise ConfigurationError(f"keep_rounds must be at least 1 or None, got {keep_rounds}")
        if on_stuck not in ("yield", "proceed"):
            raise ConfigurationError(f"on_stuck must be 'yield' or 'proceed', got {on_stuck!r}")
        self._threshold = threshold
        self._keep_turns = keep_turns
        self._keep_rounds = keep_rounds
        self._model = model
        self._count = count_tokens
        self._prompt = prompt
        self._settings = settings or ModelSettings()
        self._on_stuck = on_stuck
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def _is_summary(self, message: Message) -> bool:
        return _summary_receipt(message, self._name) is not None

    def _size(self, session: Session[Any]) -> int:
        """The estimated size of the visible conversation (kept by the index by default)."""
        if self._count is estimate_tokens:
            return session.history.estimated_tokens
        return self._count(session.visible_to_model)

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        session = ctx.session
        if not needs_answer(session):
            return Refuse("the model is not about to be asked")
        index = session.history
        if not index.valid:
            return Refuse("the visible history is invalid; place HistoryGuard before Compaction")
        last = session.conversation[index.last_visible]
        overflow = _overflowed(last)
        before = self._size(session)
        if not overflow and before <= self._threshold:
            return Refuse(f"{before} estimated tokens, within the threshold {self._threshold}")
        visible = list(session.visible_to_model)
        trigger = CONTEXT_LENGTH_EXCEEDED if overflow else "threshold"
        details: dict[str, Any] = {
            "trigger": trigger,
            "tokens": before,
            "threshold": self._threshold,
        }
        mark = _mark(last, self._name)
        if mark is not None and mark.stuck:
            return self._stuck(mark.stuck, details, [])
        plan = self._plan(visible)
        if plan is None:
            return self._stuck("nothing_to_summarise", details, [])

        summarised = [visible[k] for k in plan.summarised]
        model = ctx.runtime.get_model(self._model)
        transcript = render_transcript(summarised, summary_namespace=self._name)
        request = ModelRequest(
            messages=(
                Message.user(
                    "Summarise this conversation so far:\n\n" + transcript,
                    id=f"{self._name}-request",
                ),
            ),
            prompt_parts=(PromptPart(source=self._name, text=self._prompt),),
            settings=self._settings,
            purpose="summary",
        )
        request = ctx.shape_request(request)
        # Capped (by a Budget): reserve the calls first (at least one, at most what the
        # model can send for one request).
        reserved = reserved_calls(ctx.runtime.model_override or model, request.max_attempts)
        intents: list[Effect] = []
        if reserved is not None:
            reservation = self._spent(mark, session, last, reserved, reserved=reserved)
            intents.append(Annotate(last.id, self._name, note_value(reservation)))
        ending: list[Continue | Yield] = []
        failure: list[ModelError] = []
        sent = Attempts()  # the attempts the request has sent, while it is under way

        async def call() -> Recorder:
            try:
                with counting(sent, ctx.runtime.model_override or model):
                    response = await ctx.request_model(model, request)
            except ModelError as exc:
                failure.append(exc)  # raised once its attempts are recorded
                made = failed_attempts(exc)  # an adapter's retries count
                failed = self._spent(mark, session, last, made)
                return constant_record(Annotate(last.id, self._name, note_value(failed)))
            outcome = self._summarised(
                ctx,
                session,
                last,
                mark,
                overflow,
                details,
                plan,
                visible[plan.cut].id,
                summarised,
                model.name,
                before,
                trigger,
                response,
            )
            done = Continue(()) if isinstance(outcome, Continue) else Yield((), outcome.reason)
            ending.append(done)
            effects = outcome.effects
            if not any(isinstance(effect, ReplaceConversation) for effect in effects):
                return constant_record(*effects)  # a note on the last message only
            decided_on = session.revision + (1 if intents else 0)  # the intents' batch
            usage = response.usage
            # A message the replacement brings (the summary): found stored, it was written.
            brought = next(
                (
                    m.id
                    for e in effects
                    if isinstance(e, ReplaceConversation)
                    for m in e.conversation
                    if session.message(m.id) is None
                ),
                None,
            )

            def record(stored: Session[Any]) -> Sequence[Effect]:
                # Computed from the session as stored (again after a conflict, and by
                # finalize). The replacement was built from the conversation as it was
                # when the summariser was asked: once another writer moved the session
                # on (a message submitted meanwhile), writing it would drop what they
                # wrote. Then only the call is recorded (budgets count it) and the
                # cycle decides again from what is stored.
                if stored.revision == decided_on:
                    ending[:] = [done]
                    return effects
                if brought is not None and stored.message(brought) is not None:
                    ending[:] = [done]
                    return ()  # stored already (its write's reply was lost): not again
                ending[:] = [Continue(())]
                spent = self._spent(mark, session, last, response.attempts, usage=usage)
                return (Annotate(last.id, self._name, note_value(spent)),)

            return record

        def then() -> Continue | Yield:
            if failure:
                raise failure[0]
            return ending[0]

        def keep(stored: Session[Any]) -> Sequence[Effect]:
            # Cut off: the attempts the request sent are recorded in place of the
            # reservation; none sent, the reservation is given back.
            if sent.made:
                failed = self._spent(mark, session, last, sent.made)
                return (Annotate(last.id, self._name, note_value(failed)),)
            if reserved is None:
                return ()
            given_back = self._restored(mark, standing_ledger(session, on=last))
            return (Annotate(last.id, self._name, note_value(given_back)),)

        task = Task(f"summariser call ({self._name})", call, keep=keep)
        return Staged(intents, [task], then=then)

    def _summarised(
        self,
        ctx: StepContext[Any],
        session: Session[Any],
        last: Message,
        mark: CompactionMark | None,
        overflow: list[str],
        details: dict[str, Any],
        plan: _Plan,
        cut_id: str,
        summarised: list[Message],
        model_name: str,
        before: int,
        trigger: str,
        response: ModelResponse,
    ) -> Continue | Yield:
        """The effects of the summariser's ``response``, and how the cycle ends."""
        text = "".join(p.text for p in response.parts if isinstance(p, TextPart)).strip()
        spent = Usage(response.usage.input_tokens, response.usage.output_tokens)
        ledger = next_ledger(session, response.attempts, spent, on=last)

        summary_id = ctx.new_id()
        summarised_ids = {m.id for m in summarised}
        summary = Message(
            id=summary_id,
            role="user",
            parts=(TextPart(f"{SUMMARY_PREFIX}\n{text}"),),
            visible_to_user=False,
        )
        conversation: list[Message] = []
        for message in session.conversation:
            if message.id == cut_id:
                conversation.append(summary)
            if message.id in summarised_ids:
                notes = dict(message.notes)
                notes[self._name] = self._summarised_note(message, summary_id)
                conversation.append(
                    msgspec.structs.replace(message, visible_to_model=False, notes=notes)
                )
            else:
                conversation.append(message)
        after = self._count([m for m in conversation if m.visible_to_model])
        if not text or after >= before:
            reason = "empty_summary" if not text else "not_smaller"
            details["tokens_after"] = after
            # The summariser call happened: record it like any model call, so budgets count it.
            earlier = mark or CompactionMark()
            stuck = msgspec.structs.replace(
                earlier,
                stuck=reason,
                revision=session.revision,
                attempts=(earlier.attempts or 0) + response.attempts,
                usage=spent,
                ledger=ledger,
                reserved=0,
            )
            note = Annotate(last.id, self._name, note_value(stuck))
            outcome = self._stuck(reason, details, [note])
            assert isinstance(outcome, Continue | Yield)  # it has a note to write
            return outcome
        usage = response.usage
        receipt = CompactionReceipt(
            summarised=[m.id for m in summarised],
            tokens_before=before,
            tokens_after=after,
            model=response.model or model_name,
            trigger=trigger,
            cut=plan.mode,
            usage=Usage(usage.input_tokens, usage.output_tokens),
            revision=session.revision,
            attempts=response.attempts,
            ledger=ledger,
        )
        position = conversation.index(summary)
        conversation[position] = msgspec.structs.replace(
            summary, notes={self._name: note_value(receipt)}
        )
        # The receipt counts the call for records read one by one; the ledger goes on the
        # last message, where readers of the running totals look first.
        effects: list[Effect] = [
            ReplaceConversation(tuple(conversation)),
            Annotate(
                last.id,
                self._name,
                note_value(self._restored(mark, ledger)),
            ),
        ]
        for namespace in overflow:
            where = f"session {session.id!r}, message {last.id!r}"
            marked = read_record(last.notes, namespace, InferenceAttempts, where=where)
            assert marked is not None  # _overflowed read it
            reset = msgspec.structs.replace(marked, context_length_exceeded=False)
            effects.append(Annotate(last.id, namespace, note_value(reset)))
        return Continue(effects)

    @staticmethod
    def _restored(mark: CompactionMark | None, ledger: Ledger) -> CompactionMark:
        """``mark`` (as it was before this call's reservation) with ``ledger``: the calls
        it counts stay counted, a reservation a crash left among them included."""
        return msgspec.structs.replace(mark or CompactionMark(), reserved=0, ledger=ledger)

    def _spent(
        self,
        mark: CompactionMark | None,
        session: Session[Any],
        last: Message,
        made: int,
        *,
        reserved: int = 0,
        usage: Usage | None = None,
    ) -> CompactionMark:
        """``mark`` plus ``made`` summariser calls that produced no summary (with the
        ``usage`` they reported, if any), or that are ``reserved`` for a request about
        to be sent (counted until its end replaces them)."""
        earlier = mark or CompactionMark()
        ledger = next_ledger(session, made, usage or Usage(), on=last)
        return msgspec.structs.replace(
            earlier,
            attempts=(earlier.attempts or 0) + made,
            revision=session.revision,
            ledger=ledger,
            reserved=reserved,
        )

    def _summarised_note(self, message: Message, summary_id: str) -> dict[str, Any]:
        """The notes of a message a summary replaces (an earlier summary keeps its receipt)."""
        receipt = _summary_receipt(message, self._name)
        if receipt is not None:
            return note_value(msgspec.structs.replace(receipt, summarised_into=summary_id))
        mark = _mark(message, self._name) or CompactionMark()
        return note_value(msgspec.structs.replace(mark, summarised_into=summary_id))

    def _stuck(self, reason: str, details: dict[str, Any], effects: list[Effect]) -> Outcome:
        if details["trigger"] == "threshold" and self._on_stuck == "proceed":
            return Continue(effects) if effects else Refuse(f"compaction is stuck: {reason}")
        message = (
            f"compaction cannot make the conversation smaller ({reason}): "
            f"{details['tokens']} estimated tokens, threshold {self._threshold}"
        )
        return Yield(effects, YieldReason(COMPACTION_STUCK, message, {"reason": reason, **details}))

    def _plan(self, visible: Sequence[Message]) -> _Plan | None:
        """Where to cut, and what to summarise; ``None`` when nothing can be."""
        n = len(visible)
        safe = [True]  # safe[k]: every call before position k has its result before k
        open_calls: set[str] = set()
        for message in visible:
            open_calls.update(c.call_id for c in message.tool_calls)
            open_calls.difference_update(r.call_id for r in message.tool_results)
            safe.append(not open_calls)
        turn_starts = [
            k
            for k, m in enumerate(visible)
            if m.role == "user" and not m.tool_results and not self._is_summary(m)
        ]

        def summarisable(cut: int, pinned: set[int]) -> tuple[int, ...] | None:
            chosen = tuple(k for k in range(cut) if visible[k].role != "system" and k not in pinned)
            if any(not self._is_summary(visible[k]) for k in chosen):
                return chosen
            return None  # nothing, or only earlier summaries: no progress

        if turn_starts:
            start = turn_starts[max(0, len(turn_starts) - self._keep_turns)]
            cut = max(k for k in range(start + 1) if safe[k])
            chosen = summarisable(cut, set())
            if chosen is not None:
                return _Plan(cut, chosen, "turns")
        if self._keep_rounds is None:
            return None
        last_turn = turn_starts[-1] if turn_starts else -1
        rounds = [k for k in range(last_turn + 1, n) if visible[k].role == "assistant" and safe[k]]
        if len(rounds) < self._keep_rounds:
            return None
        cut = rounds[-self._keep_rounds]
        chosen = summarisable(cut, {last_turn})
        if chosen is None:
            return None
        return _Plan(cut, chosen, "rounds")
