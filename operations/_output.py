"""Structured output: a final answer typed by a msgspec type, validated, stored, returned.

:class:`StructuredOutput` asks the model for a value of ``output_type`` in one
of three modes:

* ``"tool"`` -- it advertises a synthetic output tool (``tool_name``, default
  ``final_result``) whose parameters are the type's JSON schema (wrapped in
  ``{"response": ...}`` when the type is not an object). When the model calls
  it, this step answers the call itself: no tool step ever runs it, because
  ``check_call`` objects to it and a tool step leaves calls of tools it does
  not own and another step advertises alone. Other calls in the same message
  are objected to too, and answered "not executed: the final result was
  given" (the run ends early, as the model asked).
* ``"native"`` -- ``shape_request`` sets ``request.output_schema`` and
  ``output_name``; the final assistant text is validated as JSON.
* ``"prompted"`` -- a prompt part gives the schema; the final text (optionally
  in a fenced code block) is validated as JSON.

A valid value is stored as JSON builtins in the notes of the final message
(the assistant message holding the text or the output call), namespace
``name``: an :class:`OutputValue` record, and the step yields
``done`` with ``data={"output": ...}``. :func:`read_output` returns the typed
value from a stored session. Calling ``run()`` again without a new user
message yields the same ``done`` again (no model call).

A refusal (the inference step noted finish reason ``"content_filter"``, which
every adapter reports for a provider's refusal) is never parsed as JSON: it
counts as an invalid output whose error says the model refused and quotes it.

An invalid output is re-prompted: in tool mode an error result answers the
output call; otherwise the message is noted with an :class:`OutputError` and a feedback
user message (marked :data:`~stepmachine.operations.FEEDBACK`, hidden
from the user) explains the error. Each re-prompt is a model call, so a
:class:`Budget` before inference counts and limits it. After ``max_retries``
re-prompts in one user turn the step yields ``output_invalid`` with the
errors (nothing more is asked of the model until a new user message).

Placement and the final text reply. ``ModelInference`` yields ``done`` as
soon as the model replies without tool calls, so a step placed before it
sees that reply only on the next ``run()``. Two ways to compose:

* ``StructuredOutput(T, mode, inference=ModelInference(...))`` in place of the
  inference step (recommended, required for ``native`` and ``prompted`` to
  validate within the run): it calls the wrapped inference, and validates
  the reply before it is stored, re-prompting or finishing in the same run.
* ``StructuredOutput(T, "tool")`` standalone, before ``Tools`` and the
  inference step: the output call is handled within the run; a plain text
  reply ends that run ``done`` without output and is re-prompted by the next
  ``run()``.

In both, place it after ``Budget``. Standalone, place it before
``InvalidCalls`` too: it answers an invalid output call itself with an error
result the model can read; ``InvalidCalls`` then leaves the answered call
alone. Wrapping inference (so listed after ``InvalidCalls``), an invalid
output call meets the ``InvalidCalls`` policy for ``invalid_arguments``
first (``"retry"`` re-prompts too; both count against a budget).

Notes are typed records (:class:`stepmachine.Record`) under the step's name:
:class:`OutputValue`, :class:`OutputError`, :class:`OutputAnswer` (on the
results of the output call and its siblings) and :class:`OutputFeedback`.

Cost per cycle: the step reads the last visible messages (back to the latest
assistant message), never the whole history.

Cancellation: the wrapped inference's staged call keeps partial text (the
machine writes it); otherwise decisions are single batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Sequence
from typing import Any, Final, Generic, Literal, TypeVar

import msgspec

from stepmachine import (
    Annotate,
    AppendMessage,
    ConfigurationError,
    Continue,
    Effect,
    Inference,
    Message,
    ModelRequest,
    Operation,
    Outcome,
    PromptPart,
    Refuse,
    RunError,
    Session,
    Staged,
    StepContext,
    Task,
    TextPart,
    ToolCallPart,
    ToolDefinition,
    ToolResultPart,
    Yield,
)
from stepmachine._ledger import FEEDBACK
from stepmachine.extend import (
    InferenceReceipt,
    InterruptedReply,
    Recorder,
    YieldReason,
    effective_arguments,
    note_value,
    open_tool_calls,
    read_record,
)

from ._budget import turn_start
from ._records import OutputAnswer, OutputError, OutputFeedback, OutputValue

__all__ = [
    "OUTPUT_INVALID",
    "NoOutputError",
    "OutputAnswer",
    "OutputError",
    "OutputFeedback",
    "OutputValue",
    "StructuredOutput",
    "read_output",
]

T = TypeVar("T")

OUTPUT_INVALID: Final = "output_invalid"
"""The yield reason kind when the model's output failed validation ``max_retries`` times."""

_FENCE = re.compile(r"^\s*```[a-zA-Z]*\s*(.*?)\s*```\s*$", re.DOTALL)
_WRAP_KEY = "response"


_REFUSALS = frozenset({"content_filter", "refusal"})


def _record_of(message: Message, namespace: str, field: str, kind: type[Any]) -> Any:
    """The ``kind`` record on ``message`` if its stored form has ``field`` (else ``None``).

    The step keeps several records in one namespace, on different messages; the
    field each one requires tells them apart, also in notes stored before they
    were typed.
    """
    value = message.notes.get(namespace)
    if value is None or (isinstance(value, dict) and field not in value):
        return None
    return read_record(message.notes, namespace, kind, where=f"message {message.id!r}")


def _refusal(message: Message) -> str | None:
    """The finish reason an inference step noted when the reply is a refusal, else None.

    Every adapter reports a refusal (OpenAI ``refusal``, Anthropic ``stop_reason:
    refusal``) as text with finish reason ``"content_filter"``.
    """
    for namespace in message.notes:
        receipt = _record_of(message, namespace, "finish_reason", InferenceReceipt)
        if receipt is not None and receipt.finish_reason in _REFUSALS:
            return str(receipt.finish_reason)
    return None


class NoOutputError(RunError, LookupError):
    """The session holds no validated output under this name."""


def read_output(session: Session[Any], output_type: type[T], name: str = "output") -> T:
    """The latest validated output stored in ``session`` by the step ``name``, typed.

    Reads only the messages with notes in ``name`` (the history index).

    Raises:
        NoOutputError: no message carries an output in that namespace.
        StoredDataError: the stored record is damaged.
        msgspec.ValidationError: the stored value does not fit ``output_type``.
    """
    latest: tuple[int, OutputValue] | None = None
    for position, call_id in session.history.noted(name):
        if call_id is not None or (latest is not None and position < latest[0]):
            continue
        value = _record_of(session.conversation[position], name, "output", OutputValue)
        if value is not None:
            latest = (position, value)
    if latest is not None:
        return msgspec.json.decode(msgspec.json.encode(latest[1].output), type=output_type)
    raise NoOutputError(f"session {session.id!r} holds no output from step {name!r}")


def _schema(output_type: Any) -> dict[str, Any]:
    (ref,), components = msgspec.json.schema_components(
        [output_type], ref_template="#/$defs/{name}"
    )
    if "$ref" in ref:
        top = ref["$ref"].rsplit("/", 1)[-1]
        schema = dict(components.pop(top))
    else:
        schema = dict(ref)
    if components:
        schema["$defs"] = components
    return schema


class StructuredOutput(Operation[Any], Generic[T]):
    """Gets a final answer of ``output_type`` from the model; see the module docs.

    Args:
        output_type: any type msgspec can decode (Struct, dataclass, list, ...).
        mode: ``"tool"``, ``"native"`` or ``"prompted"``.
        inference: an inference step to wrap (recommended; see module docs).
        max_retries: re-prompts per user turn before yielding ``output_invalid``.
        tool_name: the output tool's name (tool mode); also ``output_name``
            of native requests.
        description: the output tool's description.
        name: the step name and notes namespace.

    Raises:
        ConfigurationError: unknown mode, or the type has no JSON schema.
    """

    def __init__(
        self,
        output_type: type[T],
        mode: Literal["tool", "native", "prompted"] = "tool",
        *,
        inference: Inference[Any] | None = None,
        max_retries: int = 2,
        tool_name: str = "final_result",
        description: str = "Give the final answer. Call this once, when you are done.",
        name: str = "output",
    ) -> None:
        if mode not in ("tool", "native", "prompted"):
            raise ConfigurationError(f"mode must be 'tool', 'native' or 'prompted', got {mode!r}")
        try:
            self.schema = _schema(output_type)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"output type {output_type!r} has no JSON schema: {exc}"
            ) from exc
        self.output_type = output_type
        self.mode = mode
        self._inference = inference
        self._max_retries = max_retries
        self._tool_name = tool_name
        self._name = name
        self._wrapped = self.schema.get("type") != "object"
        parameters = (
            {
                "type": "object",
                "properties": {_WRAP_KEY: self.schema},
                "required": [_WRAP_KEY],
                "additionalProperties": False,
            }
            if self._wrapped
            else self.schema
        )
        self._definition = ToolDefinition(tool_name, description, parameters)

    @property
    def name(self) -> str:
        return self._name

    # -- what the model is told ---------------------------------------------------------

    def tools(self, session: Session[Any]) -> Sequence[ToolDefinition]:
        own = (self._definition,) if self.mode == "tool" else ()
        inner = tuple(self._inference.tools(session)) if self._inference is not None else ()
        return (*inner, *own)

    def prompt_parts(self, session: Session[Any]) -> Sequence[PromptPart]:
        inner = tuple(self._inference.prompt_parts(session)) if self._inference else ()
        if self.mode == "tool":
            text = f"When you have the final answer, call the `{self._tool_name}` tool with it."
        elif self.mode == "prompted":
            schema = msgspec.json.encode(self.schema).decode()
            text = (
                "Give your final answer as a single JSON value, with no other text, matching "
                f"this JSON schema:\n{schema}"
            )
        else:
            return inner
        return (*inner, PromptPart(source=self._name, text=text))

    def shape_request(self, ctx: StepContext[Any], request: ModelRequest) -> ModelRequest:
        if self.mode != "native":
            return request
        return msgspec.structs.replace(
            request, output_schema=self.schema, output_name=self._tool_name
        )

    # -- validation ---------------------------------------------------------------------

    def _validate_value(self, value: Any) -> tuple[Any, str | None]:
        try:
            typed = msgspec.json.decode(msgspec.json.encode(value), type=self.output_type)
        except (msgspec.ValidationError, TypeError) as exc:
            return None, str(exc)
        return msgspec.to_builtins(typed), None

    def _validate_call(self, call: ToolCallPart) -> tuple[Any, str | None]:
        arguments = effective_arguments(call)
        if arguments is None:
            return None, f"the arguments are not valid JSON: {call.raw_arguments!r}"
        if self._wrapped:
            if not isinstance(arguments, dict) or _WRAP_KEY not in arguments:
                return None, f"expected an object with the key {_WRAP_KEY!r}"
            arguments = arguments[_WRAP_KEY]
        return self._validate_value(arguments)

    def _validate_text(self, text: str) -> tuple[Any, str | None]:
        fenced = _FENCE.match(text)
        body = fenced.group(1) if fenced else text.strip()
        try:
            raw = _decode(body)
        except msgspec.DecodeError as exc:
            return None, f"the reply is not valid JSON: {exc}"
        return self._validate_value(raw)

    def _retries(self, conversation: Sequence[Message]) -> int:
        start = turn_start(conversation)
        return sum(
            1
            for m in conversation[start + 1 :]
            if _record_of(m, self._name, "error", OutputError) is not None
        )

    # -- hooks --------------------------------------------------------------------------

    def _output_call(self, session: Session[Any]) -> tuple[Message, ToolCallPart] | None:
        """The first open output call, with its message (reads back to the latest assistant)."""
        if not session.history.has_open_calls:
            return None
        open_ids = {c.call_id for c in open_tool_calls(session)}
        conversation = session.conversation
        for position in range(session.history.last_visible, -1, -1):
            message = conversation[position]
            if not message.visible_to_model or message.role != "assistant":
                continue
            for call in message.tool_calls:
                if call.name == self._tool_name and call.call_id in open_ids:
                    return message, call
            return None
        return None

    def check_call(self, ctx: StepContext[Any], call: ToolCallPart) -> str | None:
        """The output call is answered here; with a valid one, its siblings are not run."""
        if self.mode != "tool":
            return None
        if call.name == self._tool_name:
            return f"the output tool {self._tool_name!r} is answered by {self._name!r}"
        found = self._output_call(ctx.session)
        if (
            found is not None
            and any(c.call_id == call.call_id for c in found[0].tool_calls)
            and self._validate_call(found[1])[1] is None
        ):
            return "not executed: the final result was given"
        return None

    # -- deciding -----------------------------------------------------------------------

    def _done(self, effects: Sequence[Effect], output: Any) -> Yield:
        return Yield(
            effects, YieldReason(YieldReason.DONE, "structured output", {"output": output})
        )

    def _exhausted(self, effects: Sequence[Effect], error: str) -> Yield:
        return Yield(
            effects,
            YieldReason(
                OUTPUT_INVALID,
                f"the output failed validation {self._max_retries + 1} times",
                {"error": error},
            ),
        )

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        session = ctx.session
        if self.mode == "tool":
            found = self._output_call(session)
            if found is not None:
                return self._answer_output_call(ctx, *found)
        settled = self._settled(session)
        if settled is not None:
            return settled
        final = self._unchecked_final(session)
        if final is not None:
            return self._check_final(ctx, final, appended=True)
        if self._inference is None:
            return Refuse("no output to check")
        outcome = await self._inference.run(ctx)
        if isinstance(outcome, Staged):
            return self._checked_staged(ctx, outcome)
        if not isinstance(outcome, Yield) or outcome.reason.kind != YieldReason.DONE:
            return outcome
        for index, effect in enumerate(outcome.effects):
            if (
                isinstance(effect, AppendMessage)
                and effect.message.role == "assistant"
                and not effect.message.tool_calls
            ):
                checked = self._check_final(ctx, effect.message, appended=False)
                before = list(outcome.effects[:index])
                after = list(outcome.effects[index + 1 :])
                if isinstance(checked, Yield):
                    return Yield([*before, *checked.effects, *after], checked.reason)
                return Continue([*before, *checked.effects, *after])
        return outcome

    def _checked_staged(self, ctx: StepContext[Any], staged: Staged) -> Staged:
        """The wrapped inference's staged call, its final answer checked as it is recorded.

        A record holding a final answer (an assistant message without tool
        calls) records the checked message instead, with what the check adds
        (feedback to re-prompt, or the output); the cycle then ends as the
        check says (``Continue`` to re-prompt, ``Yield`` with the output).
        Everything else (a failure's attempts, what a cancellation keeps) is
        recorded as the inference made it.
        """
        checked: list[Continue | Yield] = []  # the check of the record last computed

        def checking(task: Task) -> Task:
            async def run() -> Recorder:
                record = await task.run()

                def checked_record(stored: Session[Any]) -> Sequence[Effect]:
                    effects = list(record(stored))
                    checked.clear()
                    for index, effect in enumerate(effects):
                        if (
                            isinstance(effect, AppendMessage)
                            and effect.message.role == "assistant"
                            and not effect.message.tool_calls
                        ):
                            check = self._check_final(ctx, effect.message, appended=False)
                            checked.append(check)
                            return [*effects[:index], *check.effects, *effects[index + 1 :]]
                    return effects

                return checked_record

            return dataclasses.replace(task, run=run)

        def then() -> Continue | Yield:
            ending = staged.then() if staged.then is not None else Continue(())
            if not checked or not isinstance(ending, Yield):
                return ending
            check = checked[0]
            return Yield((), check.reason) if isinstance(check, Yield) else Continue(())

        return dataclasses.replace(
            staged, tasks=tuple(checking(task) for task in staged.tasks), then=then
        )

    async def finalize(self, ctx: StepContext[Any], *, interrupted: bool) -> Sequence[Effect]:
        """The wrapped inference keeps what it had received."""
        if self._inference is None:
            return ()
        return await self._inference.finalize(ctx, interrupted=interrupted)

    def _answer_output_call(
        self, ctx: StepContext[Any], message: Message, call: ToolCallPart
    ) -> Outcome:
        output, error = self._validate_call(call)

        def result(target: ToolCallPart, content: str, note: dict[str, Any]) -> AppendMessage:
            part = ToolResultPart(
                call_id=target.call_id,
                content=content,
                is_error=error is not None or target is not call,
                name=target.name,
            )
            return AppendMessage(
                Message.tool_result(part, id=ctx.new_id(), notes={self._name: note})
            )

        if error is not None:
            if self._retries(ctx.session.conversation) >= self._max_retries:
                return self._exhausted([], error)
            content = f"invalid final result: {error}. Call {self._tool_name!r} again, fixed."
            invalid = note_value(OutputError(error=error, call_id=call.call_id))
            return Continue([result(call, content, invalid)])
        value = OutputValue(output=output, mode="tool", call_id=call.call_id)
        accepted = note_value(OutputAnswer(accepted=call.call_id))
        effects: list[Effect] = [
            Annotate(message.id, self._name, note_value(value)),
            result(call, "Final result accepted.", accepted),
        ]
        open_ids = {c.call_id for c in open_tool_calls(ctx.session)}
        skipped = note_value(OutputAnswer(skipped=True))
        effects.extend(
            result(other, "not executed: the final result was given", skipped)
            for other in message.tool_calls
            if other.call_id != call.call_id and other.call_id in open_ids
        )
        return self._done(effects, output)

    def _settled(self, session: Session[Any]) -> Outcome | None:
        """Re-yield a finished turn: ``done`` with its output, or ``output_invalid``.

        Reads back from the last visible message over tool messages only.
        """
        conversation = session.conversation
        last = session.history.last_visible
        position = last
        while position >= 0 and (
            not conversation[position].visible_to_model or conversation[position].role == "tool"
        ):
            position -= 1
        if position < 0 or conversation[position].role != "assistant":
            return None
        message = conversation[position]
        value = _record_of(message, self._name, "output", OutputValue)
        if value is not None:
            return self._done([], value.output)
        invalid = _record_of(message, self._name, "error", OutputError)
        if invalid is not None and position == last and not message.tool_calls:
            return self._exhausted([], invalid.error)
        return None

    def _unchecked_final(self, session: Session[Any]) -> Message | None:
        if session.history.last_visible < 0:
            return None
        last = session.conversation[session.history.last_visible]
        if last.role != "assistant" or last.tool_calls or self._name in last.notes:
            return None
        if any(
            _record_of(last, namespace, "interrupted", InterruptedReply) is not None
            for namespace in last.notes
        ):
            return None  # a cancelled reply is not a final answer
        return last

    def _check_final(
        self, ctx: StepContext[Any], message: Message, *, appended: bool
    ) -> Continue | Yield:
        output: Any
        error: str | None
        refusal = _refusal(message)
        if refusal is not None:
            # The text is the provider's refusal, not an answer: never parsed as JSON.
            output, error = None, f"the model refused (finish reason {refusal!r}): {message.text}"
            advice = (
                f"Call the {self._tool_name!r} tool with your final answer."
                if self.mode == "tool"
                else "Reply with only a JSON value matching the schema."
            )
        elif self.mode == "tool":
            output, error = None, f"no call to the {self._tool_name!r} tool"
            advice = f"Call the {self._tool_name!r} tool with your final answer."
        else:
            output, error = self._validate_text(message.text)
            advice = "Reply with only a JSON value matching the schema."
        note = note_value(
            OutputValue(output=output, mode=self.mode) if error is None else OutputError(error)
        )
        effects: list[Effect] = (
            [Annotate(message.id, self._name, note)]
            if appended
            else [
                AppendMessage(
                    msgspec.structs.replace(message, notes={**message.notes, self._name: note})
                )
            ]
        )
        if error is None:
            return self._done(effects, output)
        if self._retries(ctx.session.conversation) >= self._max_retries:
            return self._exhausted(effects, error)
        feedback = Message(
            id=ctx.new_id(),
            role="user",
            parts=(TextPart(f"Your final answer was not valid: {error}. {advice}"),),
            notes={
                self._name: note_value(OutputFeedback(feedback_for=message.id)),
                FEEDBACK: {"by": self._name},
            },
            visible_to_user=False,
        )
        return Continue([*effects, AppendMessage(feedback)])


def _decode(text: str) -> Any:
    """``text`` as JSON, nested at most as deep as the kernel accepts (128 levels).

    ``ToolCallPart.parse`` applies the kernel's limit; deeper JSON raises
    ``msgspec.DecodeError`` saying so, never ``RecursionError``.

    Raises:
        msgspec.DecodeError: ``text`` is not JSON (msgspec's own message) or
            nests too deeply.
    """
    if not text.strip():
        return msgspec.json.decode(text)  # raises msgspec's error for empty input
    parsed = ToolCallPart.parse("", "", text).arguments
    if parsed is not None:
        return parsed
    if text.strip() == "null":
        return None
    with contextlib.suppress(RecursionError):
        msgspec.json.decode(text)  # invalid JSON: raises with msgspec's message
    raise msgspec.DecodeError("JSON nested deeper than 128 levels")
