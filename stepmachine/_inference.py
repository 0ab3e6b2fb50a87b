"""``ModelInference``: the step that calls a model.

It applies when the conversation (as the model sees it) ends on something the
model must answer: a user message, or tool results that close every open call.
It refuses while any tool call is open, and otherwise.

Before the request it checks valid history and raises
:class:`~stepmachine.HistoryError` rather than send a broken history; the
request shows each turn's tool results right after that turn
(:func:`~stepmachine.request_order`), as providers require, even when a user
message arrived while tools were running. It
streams text, reasoning and tool-argument deltas to the emitter, and returns
the assistant message, with the usage, model, finish reason, number of
attempts and the revision it answered recorded in its notes under the step's
name. Every step's ``shape_request`` may adjust the request first
(``ctx.shape_request``). A reply
with tool calls continues the run; a reply without them yields with reason
``done``.

Streaming adds events only: the effects come from the assembled response, so
they are the same with ``stream=True`` or ``False`` (same behaviour streaming or not).

The call is staged work (:class:`~stepmachine.Staged`): the step decides and
builds the request; the machine makes the call and records what came of it,
so every model request sent is counted (exact budgets), whatever happens:

* a reply is recorded as its assistant message (with its receipt), unless
  the conversation moved on while the model answered (a user message
  submitted meanwhile, or another writer answered): then only its calls are
  recorded, on the last message the model saw, and the next cycle asks the
  model again, with what arrived;
* a failure after the adapter's retries (:class:`~stepmachine.ModelError`)
  records its attempts on the last message the model saw
  (:class:`InferenceAttempts`), then the error propagates;
* when the request's attempts are capped (``max_attempts``: a ``Budget``
  sets it to the calls left), the calls are first **reserved** on that
  message, in a batch of their own, before the request is sent; the reply
  or the failure replaces the reservation with the calls made. A crash in
  between leaves the reservation, which stays counted: a resumed run never
  gets back a call that may have been sent. That is one more batch per
  model call, and only for budgeted requests;
* a cancellation keeps what streamed (below).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from ._effects import Annotate, AppendMessage, Effect
from ._emitter import EventSink, ReasoningDelta, TextDelta, ToolArgumentsDelta
from ._errors import ContextLengthError, HistoryError, ModelError
from ._history import check_history, history_problems, open_tool_calls, request_order
from ._ledger import Ledger, next_ledger, standing_ledger
from ._messages import Message, Part, ReasoningPart, TextPart, ToolCallPart
from ._model import (
    ModelRequest,
    ModelSettings,
    PromptPart,
    ReasoningChunk,
    StreamChunk,
    TextChunk,
    Usage,
)
from ._model_call import Attempts, counting, failed_attempts
from ._outcomes import Recorder, Staged, Task, constant_record
from ._records import Record, note_value, read_record
from ._session import Session
from ._steps import Continue, Inference, Outcome, Refuse, StepContext, Yield, YieldReason

__all__ = [
    "CONTEXT_LENGTH_EXCEEDED",
    "InferenceAttempts",
    "InferenceReceipt",
    "InterruptedReply",
    "ModelInference",
    "needs_answer",
]

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""Note key set on the last message when the model reported a context overflow."""


class InferenceReceipt(Record, frozen=True, tag="stepmachine.inference.reply"):
    """What a model reply cost: the notes of the assistant message, under the step's name.

    Attributes:
        usage: the provider's token counts.
        model: the model that answered.
        finish_reason: the provider's finish reason.
        attempts: model calls made for this reply (first try plus retries).
        revision: the session revision the request was built from.
        ledger: the totals including this reply (:class:`~stepmachine.Ledger`).
    """

    attempts: int
    revision: int
    usage: Usage = msgspec.field(default_factory=Usage)
    model: str | None = None
    finish_reason: str | None = None
    ledger: Ledger | None = None


class InferenceAttempts(Record, frozen=True, tag="stepmachine.inference.attempts"):
    """Model calls that produced no reply, recorded on the last message the model saw.

    Attributes:
        attempts: the calls made (they add up over several failures).
        revision: the session revision of the latest of them.
        context_length_exceeded: the model reported a context overflow (a
            compaction step resets it once the history is shorter).
        interrupted_request: the latest request was cancelled before anything
            streamed.
        ledger: the totals including these attempts.
        reserved: of ``attempts``, the calls reserved for a request under way
            (written before it is sent when its attempts are capped, as a
            ``Budget`` caps them); its reply, or its failure, replaces them with
            the calls made. Left by a crash, they stay counted: they may have
            been sent.
    """

    attempts: int = 0
    revision: int | None = None
    context_length_exceeded: bool = False
    interrupted_request: bool = False
    ledger: Ledger | None = None
    reserved: int = 0


class InterruptedReply(Record, frozen=True, tag="stepmachine.inference.interrupted"):
    """The notes of an assistant message kept from an interrupted request (one model call).

    Attributes:
        interrupted: always ``True``.
        ledger: the totals including that call (its tokens are not known).
    """

    interrupted: bool = True
    ledger: Ledger | None = None


def needs_answer(conversation: Sequence[Message] | Session[Any]) -> bool:
    """True when the model must speak next.

    That is: the last message visible to the model is from the user, or is a
    tool message, and no tool call is left open. Given a session, the open
    calls come from its history index (no scan).
    """
    messages = conversation.conversation if isinstance(conversation, Session) else conversation
    for message in reversed(messages):
        if message.visible_to_model:
            if message.role not in ("user", "tool"):
                return False
            if isinstance(conversation, Session):
                return not conversation.history.has_open_calls
            return not open_tool_calls(messages)
    return False


def _refuse_repeated_call_ids(session: Session[Any]) -> None:
    """Raise :class:`HistoryError` if open calls reuse a call id.

    Tools never runs such calls (a result could not say which call it
    answers), so without a repairing step (HistoryGuard, InvalidCalls) before
    this one the session would wait forever: say so instead.
    """
    index = session.history
    if not index.has_open_calls or not index.repeated:
        return
    repeats = [p for p in history_problems(session.visible_to_model) if "repeats" in p]
    if repeats:
        raise HistoryError(
            f"valid history broken in session {session.id!r}: "
            + "; ".join(repeats)
            + ". Place HistoryGuard or InvalidCalls before the tool step to repair it."
        )


def _without_notes(parts: tuple[Part, ...]) -> tuple[Part, ...]:
    """The parts with any notes on tool calls removed.

    Notes record what operations did (approvals, the journal); a model must
    never be able to write one, or a reply could approve its own call.
    """
    if not any(isinstance(p, ToolCallPart) and p.notes for p in parts):
        return parts
    return tuple(
        msgspec.structs.replace(p, notes={}) if isinstance(p, ToolCallPart) and p.notes else p
        for p in parts
    )


class _Partial:
    """What streamed in before an interruption."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []


class ModelInference(Inference[Any]):
    """Calls a model from the Runtime and appends its reply.

    Args:
        model: the name of a model in ``runtime.models``; ``None`` uses
            ``runtime.model``.
        instructions: a system prompt part this step contributes.
        settings: sampling settings for every request.
        stream: hand deltas to the emitter as they arrive.
        name: the step name (also the notes namespace for usage).

    Raises (from ``run``):
        HistoryError: the history breaks the "valid history" guarantee; no request is sent.
        ConfigurationError: the runtime has no such model.
        ModelError: the model failed.
        ContextLengthError: a second overflow in a row (the first one marks
            the last message ``context_length_exceeded`` and continues, so a
            compaction step placed before inference can shorten the history).

    Cancellation: the request is abandoned; the machine keeps the text and
    reasoning received so far as an assistant message noted ``interrupted``
    (the task's ``keep``), or, when nothing had streamed, the attempt on the
    last message. Tool calls that had not finished streaming are dropped,
    never half-kept.
    """

    def __init__(
        self,
        *,
        model: str | None = None,
        instructions: str | None = None,
        settings: ModelSettings | None = None,
        stream: bool = True,
        name: str = "inference",
    ) -> None:
        self._model = model
        self._instructions = instructions
        self._settings = settings or ModelSettings()
        self._stream = stream
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def prompt_parts(self, session: Session[Any]) -> Sequence[PromptPart]:
        if self._instructions:
            return (PromptPart(source=self._name, text=self._instructions),)
        return ()

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        session = ctx.session
        if not needs_answer(session):
            _refuse_repeated_call_ids(session)
            return Refuse("the conversation does not end on something the model must answer")
        visible = request_order(session)  # O(1) when nothing needs to move
        if not (session.history.valid and session.history.in_order):
            check_history(visible, session_id=session.id)  # the full list of problems
        model = ctx.runtime.get_model(self._model)
        request = ModelRequest(
            messages=visible,
            tools=ctx.tools,
            prompt_parts=ctx.prompt_parts,
            settings=self._settings,
        )
        built = request.messages  # ``visible`` itself (a list would have been copied)
        request = ctx.shape_request(request)
        if request.messages is not built:  # a shaper changed them: check what is sent
            check_history(request.messages, session_id=session.id)
        last = visible[-1]  # the last message the model sees: calls are recorded on it
        latest = session.conversation[session.history.last_visible].id  # as stored
        earlier = self._attempts_on(last, session)
        # Capped (by a Budget): reserve the calls first (an adapter makes at least one).
        reserved = None if request.max_attempts is None else max(1, request.max_attempts)
        intents: list[Effect] = []
        restore: list[Effect] = []
        if reserved is not None:
            reservation = self._spent(earlier, session, last, reserved)
            reservation = msgspec.structs.replace(reservation, reserved=reserved)
            intents.append(Annotate(last.id, self._name, note_value(reservation)))
            # What the last message's record goes back to once the calls reserved are
            # accounted for elsewhere (a reply's receipt): ``earlier``, the totals as
            # they stood.
            restored = msgspec.structs.replace(
                earlier, reserved=0, ledger=standing_ledger(session, on=last)
            )
            restore.append(Annotate(last.id, self._name, note_value(restored)))
        partial = _Partial()
        sent = Attempts()  # the attempts the request has sent, while it is under way
        ending: list[Continue | Yield] = []
        failure: list[ModelError] = []

        sink = ctx.events
        drops = type(sink) is EventSink and sink.drops  # no delta event is built then

        async def on_chunk(chunk: StreamChunk) -> None:
            if isinstance(chunk, TextChunk):
                partial.text.append(chunk.text)
                if drops:
                    sink.skip()
                    return
                await ctx.emit(TextDelta(chunk.text))
            elif isinstance(chunk, ReasoningChunk):
                partial.reasoning.append(chunk.text)
                if drops:
                    sink.skip()
                    return
                await ctx.emit(ReasoningDelta(chunk.text))
            elif drops:
                sink.skip()
            else:
                await ctx.emit(
                    ToolArgumentsDelta(
                        index=chunk.index,
                        call_id=chunk.call_id,
                        name=chunk.name,
                        delta=chunk.arguments_delta,
                    )
                )

        async def call() -> Recorder:
            try:
                with counting(sent, ctx.runtime.model_override or model):
                    response = await ctx.request_model(
                        model, request, on_chunk=on_chunk if self._stream else None
                    )
            except ModelError as exc:
                made = failed_attempts(exc)  # an adapter's retries count
                failed = self._spent(earlier, session, last, made)
                if isinstance(exc, ContextLengthError) and not earlier.context_length_exceeded:
                    # the first overflow: marked, so a compaction step can shorten the history
                    failed = msgspec.structs.replace(failed, context_length_exceeded=True)
                    ending.append(Continue(()))
                else:
                    failure.append(exc)  # raised once its attempts are recorded
                return constant_record(Annotate(last.id, self._name, note_value(failed)))
            receipt = InferenceReceipt(
                attempts=response.attempts,
                revision=session.revision,
                usage=response.usage,
                model=response.model or model.name,
                finish_reason=response.finish_reason,
                ledger=next_ledger(
                    session,
                    response.attempts,
                    response.usage,
                    tool_calls=sum(isinstance(p, ToolCallPart) for p in response.parts),
                ),
            )
            message = Message(
                id=ctx.new_id(),
                role="assistant",
                parts=_without_notes(response.parts),
                notes={self._name: note_value(receipt)},
            )
            done = Continue(()) if message.tool_calls else Yield((), YieldReason(YieldReason.DONE))
            new = session.message(message.id) is None  # found stored later: it was written

            def record(stored: Session[Any]) -> Sequence[Effect]:
                # Computed from the session as stored (again after a conflict): when a
                # message arrived while the model was answering (the user steered), or
                # someone else answered, the reply answers a question that is no longer
                # the last: only its calls are recorded, and the model is asked again.
                # The reply found stored was written by this record (a write whose reply
                # was lost, then waited out): nothing more is written, and its model
                # call is not counted again.
                ending[:] = [done]
                if new and stored.message(message.id) is not None:
                    return ()  # stored already: not again
                position = stored.history.last_visible
                if position >= 0 and stored.conversation[position].id == latest:
                    return (*restore, AppendMessage(message))
                ending[:] = [Continue(())]
                spent = self._spent(earlier, session, last, response.attempts, response.usage)
                return (Annotate(last.id, self._name, note_value(spent)),)

            return record

        def keep(stored: Session[Any]) -> Sequence[Effect]:
            position = stored.history.last_visible
            moved = not (position >= 0 and stored.conversation[position].id == latest)
            if moved or not needs_answer(stored):
                # Someone else answered, or a message arrived: what streamed answers a
                # question that is no longer the last. Only the calls sent are recorded.
                return self._cut_off(session, last, earlier, sent.made, restore, False)
            if not (partial.text or partial.reasoning):
                return self._cut_off(session, last, earlier, sent.made, restore, True)
            return self._interrupted(ctx, session, sent.made, partial, restore)

        def then() -> Continue | Yield:
            if failure:
                raise failure[0]
            return ending[0]

        return Staged(intents, [Task(f"model call ({self._name})", call, keep=keep)], then=then)

    def _attempts_on(self, message: Message, session: Session[Any]) -> InferenceAttempts:
        """The failed attempts already recorded on ``message`` (none: an empty record)."""
        where = f"session {session.id!r}, message {message.id!r}"
        recorded = read_record(message.notes, self._name, InferenceAttempts, where=where)
        return recorded or InferenceAttempts()

    def _spent(
        self,
        earlier: InferenceAttempts,
        session: Session[Any],
        last: Message,
        made: int,
        usage: Usage | None = None,
    ) -> InferenceAttempts:
        """``earlier`` plus ``made`` model calls that produced no reply (none reserved).

        Attempts add up on the message they are recorded on (``last``, the last
        one the model saw); ``revision`` says which run they belong to. Calls
        reserved by an earlier request that never recorded its end (a crash)
        stay counted: they may have been sent.
        """
        ledger = next_ledger(session, made, usage or Usage(), on=last)
        return msgspec.structs.replace(
            earlier,
            attempts=earlier.attempts + made,
            revision=session.revision if made else earlier.revision,
            reserved=0,
            ledger=ledger,
        )

    def _cut_off(
        self,
        session: Session[Any],
        last: Message,
        earlier: InferenceAttempts,
        made: int,
        restore: Sequence[Effect],
        interrupted: bool,
    ) -> tuple[Effect, ...]:
        """The record of a request cut off with no reply kept: the ``made`` attempts it
        sent, on the last message (budgets count every model call, exact budgets), in
        place of its reservation; nothing, or only ``restore``, when none was sent."""
        if made == 0:
            return tuple(restore)  # never sent: the reservation is given back
        note = self._spent(earlier, session, last, made)
        if interrupted:
            note = msgspec.structs.replace(note, interrupted_request=True)
        return (Annotate(last.id, self._name, note_value(note)),)

    def _interrupted(
        self,
        ctx: StepContext[Any],
        session: Session[Any],
        made: int,
        partial: _Partial,
        restore: Sequence[Effect],
    ) -> tuple[Effect, ...]:
        """What an interrupted request keeps of what streamed: the text and reasoning as
        an assistant message noted ``interrupted``, counting the ``made`` attempts the
        request sent (at least this one). Half-streamed tool calls are dropped."""
        parts: list[Part] = []
        if partial.reasoning:
            parts.append(ReasoningPart(text="".join(partial.reasoning)))
        if partial.text:
            parts.append(TextPart(text="".join(partial.text)))
        ledger = next_ledger(session, max(made, 1), Usage())
        message = Message(
            id=ctx.new_id(),
            role="assistant",
            parts=tuple(parts),
            notes={self._name: note_value(InterruptedReply(ledger=ledger))},
        )
        return (*restore, AppendMessage(message))
