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
  message, in a batch of their own, before the request is sent (the calls
  left, or fewer when the model says one request makes no more: an HTTP
  adapter's retry policy, see ``reserved_calls``); the reply
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
    Model,
    ModelRequest,
    ModelResponse,
    ModelSettings,
    PromptPart,
    ReasoningChunk,
    StreamChunk,
    TextChunk,
    Usage,
)
from ._model_call import Attempts, counting, failed_attempts, reserved_calls
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


class _Request:
    """One model request under way: its task (:meth:`call`), what it keeps when cut off
    (:meth:`keep`), and how the cycle ends (:meth:`then`).

    An object rather than closures over ``ModelInference.run``'s locals: a run
    waiting for the model holds this one object (and the bound methods its task
    names), not a cell per variable, which the garbage collector would walk on
    every collection while thousands of runs wait.
    """

    __slots__ = (
        "ctx",
        "earlier",
        "ending",
        "failure",
        "last",
        "latest",
        "model",
        "partial",
        "request",
        "restore",
        "sent",
        "session",
        "step",
    )

    def __init__(
        self,
        step: ModelInference,
        ctx: StepContext[Any],
        session: Session[Any],
        model: Model,
        request: ModelRequest,
        last: Message,
        latest: str,
        earlier: InferenceAttempts,
        restore: list[Effect],
    ) -> None:
        self.step = step
        self.ctx = ctx
        self.session = session
        self.model = model
        self.request = request
        self.last = last  # the last message the model sees: calls are recorded on it
        self.latest = latest  # the id of the last visible message, as stored
        self.earlier = earlier
        self.restore = restore
        self.partial = _Partial()
        self.sent = Attempts()  # the attempts the request has sent, while it is under way
        self.ending: Continue | Yield | None = None
        self.failure: ModelError | None = None

    async def on_chunk(self, chunk: StreamChunk) -> None:
        """Keep a streamed chunk (for an interruption) and emit its delta event."""
        ctx, partial = self.ctx, self.partial
        sink = ctx.events
        drops = type(sink) is EventSink and sink.drops  # no delta event is built then
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

    async def call(self) -> Recorder:
        """The task: send the request; how to record the reply, or the failed attempts."""
        step, ctx, session, model = self.step, self.ctx, self.session, self.model
        last, earlier = self.last, self.earlier
        try:
            with counting(self.sent, ctx.runtime.model_override or model):
                response = await ctx.request_model(
                    model, self.request, on_chunk=self.on_chunk if step._stream else None
                )
        except ModelError as exc:
            made = failed_attempts(exc)  # an adapter's retries count
            failed = step._spent(earlier, session, last, made)
            if isinstance(exc, ContextLengthError) and not earlier.context_length_exceeded:
                # the first overflow: marked, so a compaction step can shorten the history
                failed = msgspec.structs.replace(failed, context_length_exceeded=True)
                self.ending = Continue(())
            else:
                self.failure = exc  # raised once its attempts are recorded
            return constant_record(Annotate(last.id, step._name, note_value(failed)))
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
            notes={step._name: note_value(receipt)},
        )
        return _Reply(self, response, message).record

    def keep(self, stored: Session[Any]) -> Sequence[Effect]:
        """What a request cut off keeps: the calls it sent, and what streamed."""
        step, session, last, earlier = self.step, self.session, self.last, self.earlier
        made = self.sent.made
        position = stored.history.last_visible
        moved = not (position >= 0 and stored.conversation[position].id == self.latest)
        if moved or not needs_answer(stored):
            # Someone else answered, or a message arrived: what streamed answers a
            # question that is no longer the last. Only the calls sent are recorded.
            return step._cut_off(session, last, earlier, made, self.restore, False)
        partial = self.partial
        if not (partial.text or partial.reasoning):
            return step._cut_off(session, last, earlier, made, self.restore, True)
        return step._interrupted(self.ctx, session, made, partial, self.restore)

    def then(self) -> Continue | Yield:
        """How the cycle ends once the request is recorded; a model error is raised here."""
        if self.failure is not None:
            raise self.failure
        if self.ending is None:  # pragma: no cover - the machine records the task first
            raise RuntimeError("then() was called before the model request was recorded")
        return self.ending


class _Reply:
    """A model's reply, to be recorded: :meth:`record` is the request's :data:`Recorder`."""

    __slots__ = ("done", "message", "new", "request", "response")

    def __init__(self, request: _Request, response: ModelResponse, message: Message) -> None:
        self.request = request
        self.response = response
        self.message = message
        self.done: Continue | Yield = (
            Continue(()) if message.tool_calls else Yield((), YieldReason(YieldReason.DONE))
        )
        # A reply found stored later was stored by this record (O(1): by id).
        self.new = request.session.message(message.id) is None

    def record(self, stored: Session[Any]) -> Sequence[Effect]:
        """The reply's record, computed from the session as stored (again after a conflict).

        When a message arrived while the model was answering (the user steered),
        or someone else answered, the reply answers a question that is no longer
        the last: only its calls are recorded, and the model is asked again. The reply
        found stored was written by this record (a write whose reply was lost, then
        waited out, or a cancellation right after it): nothing more is written, and
        its model call is not counted again.
        """
        request = self.request
        request.ending = self.done
        if self.new and stored.message(self.message.id) is not None:
            return ()  # stored already: not again
        position = stored.history.last_visible
        if position >= 0 and stored.conversation[position].id == request.latest:
            return (*request.restore, AppendMessage(self.message))
        request.ending = Continue(())
        step, response = request.step, self.response
        spent = step._spent(
            request.earlier, request.session, request.last, response.attempts, response.usage
        )
        return (Annotate(request.last.id, step._name, note_value(spent)),)


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
        # Capped (by a Budget): reserve the calls first (at least one, at most what the
        # model can send for one request).
        reserved = reserved_calls(ctx.runtime.model_override or model, request.max_attempts)
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
        under_way = _Request(self, ctx, session, model, request, last, latest, earlier, restore)
        task = Task(f"model call ({self._name})", under_way.call, keep=under_way.keep)
        return Staged(intents, [task], then=under_way.then)

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
