"""Invalid tool calls: detect them before any runs, and apply a policy per case.

:class:`InvalidCalls` looks at the latest assistant message visible to the
model whose tool calls are not all answered, and finds, per call:

* ``"unknown_tool"`` -- the name is advertised by no step (``ctx.tools``);
* ``"invalid_json"`` -- the raw arguments are not valid JSON
  (:func:`stepmachine.effective_arguments` is ``None``); found whether or not
  the name is known, so one call can have both problems;
* ``"invalid_arguments"`` -- the arguments fail the tool's schema (checked
  only when the name is known and the JSON valid). With
  ``tools=`` given, those :class:`~stepmachine.Tool` objects validate exactly
  (``Tool.validate``, msgspec); every other tool is checked against its
  advertised JSON schema (``ToolDefinition.parameters``) by a small checker
  covering ``type``, ``required``, ``properties``, ``additionalProperties``,
  ``enum``, ``const``, ``items``, ``anyOf``/``oneOf``/``allOf``, ``$ref``
  into ``$defs`` and numeric/length bounds; anything else is accepted (the
  tool step validates exactly again before running);
* ``"duplicate_id"`` -- the call id repeats within the message or repeats an
  earlier call visible to the model.

``policy`` (one for every case, or a mapping per case; missing cases use
``"retry"``) says what happens. When several problems are present the most
severe action wins: fail > stop > retry > skip > repair.

* ``"fail"``: raise :class:`InvalidToolCallError`; nothing is written.
* ``"stop"``: annotate the message ``{"action": "stop", "problems": [...]}``
  and yield with reason ``invalid_tool_call`` (``data["problems"]``).
* ``"retry"``: hide the message from the model (``SetVisibility``), annotate
  it, and append a feedback user message (visible to the model, hidden from
  the user, marked with :data:`~stepmachine.operations.FEEDBACK`)
  that explains each problem; ``Continue`` -- the model answers again, which
  is another model call, so a :class:`Budget` counts it. The hidden reply's
  calls never run: the feedback message carries the budgets' ledger
  correction (they stop counting). After
  ``max_retries`` retries in one user turn the action becomes ``"stop"``.
* ``"skip"``: answer every open call of the message with an error result
  (the bad ones explain their problem, the others say they were not run
  because another call of the turn was invalid); ``Continue``.
* ``"repair"``: every repair below that a call needs is applied, so they
  compose (a near-miss name *and* a trailing comma are both repaired):

  - an unknown name close to exactly one advertised name is renamed: the
    names are compared ignoring case and the separators `` _-.`` and
    whitespace, else by ``difflib`` similarity (at least 0.8) of those
    normalised forms; a name that matches two advertised names equally is
    not repairable;
  - invalid JSON is cleaned of a surrounding code fence (```` ``` ```` or
    ```` ```json ````) and of trailing commas before ``}`` or ``]`` (outside
    strings, so string values are never changed); the repaired call's raw
    arguments are the compact JSON encoding of the parsed arguments;
  - duplicate ids get fresh ids (``<old id>_r<new id>``: letters, digits, ``_``
    and ``-`` only, which every provider accepts).

  Arguments that fail the schema are never repaired. The repaired calls are
  then re-validated as a whole; if any problem cannot be repaired or
  re-validation finds one, ``repair_fallback`` (default ``"retry"``)
  applies instead. A repair hides the original message (from model and
  user), annotates it ``{"action": "repair", "replaced_by": ...}`` and
  appends a corrected copy that keeps the original's notes (usage, attempts),
  marked with :data:`~stepmachine.operations._budget.SUPERSEDES` so budgets
  do not count the call twice (the copy carries the latest ledger when the
  original's is not that one), plus ``{"repaired_from", "repairs"}`` in this
  step's namespace; ``repairs`` lists one entry per repair, in the order
  applied: ``{"call_id", "renamed": "old -> new"}``, ``{"call_id",
  "arguments": "cleaned invalid JSON"}``, ``{"call_id", "new_id"}``. Notes
  bound to a call are kept. Tool names cannot be changed through notes,
  hence a copy.

Retry, repair and skip need every call of the message still unanswered
(true when this step runs before the tool step); if some were already
answered, retry and repair become skip, which keeps the history valid.

Duplicate ids under ``"skip"`` are first given fresh ids (a copy, as for
repair), because one result cannot answer two calls validly.

Guards: ``check_call`` objects to every invalid call, so no tool step runs
one whatever the order of the steps.

Placement: before ``Approval`` and ``Tools`` (it decides before anything
asks a human or runs), after ``Budget``, and after a standalone
``StructuredOutput`` (which answers its own output call, invalid or not).

Notes are typed records (:class:`stepmachine.Record`), under the step's
name: :class:`InvalidCallsDecision` on the message that held the invalid
calls, :class:`InvalidCallsRepair` on a repaired copy,
:class:`InvalidCallsFeedback` on a retry's feedback message and
:class:`InvalidCallsSkipped` on a "not executed" result.

Cost per cycle: with no open tool call the step answers from the history
index; otherwise it reads the latest assistant message and what follows it,
and a retry counts the retries of the turn from the messages with notes in
the step's namespace (the history index), back to the turn's start as the
latest model call's ledger records it.

Cancellation: nothing to finalize; decisions are single batches.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, Final, Literal, TypeAlias

import msgspec

from stepmachine import (
    Annotate,
    AppendMessage,
    ConfigurationError,
    Continue,
    Effect,
    Message,
    Operation,
    Outcome,
    Refuse,
    RunError,
    Session,
    SetVisibility,
    StepContext,
    TextPart,
    Tool,
    ToolArgumentsError,
    ToolCallPart,
    ToolDefinition,
    ToolResultPart,
    Yield,
)
from stepmachine._ledger import FEEDBACK
from stepmachine.extend import YieldReason, effective_arguments, note_value, read_record

from ._budget import (
    SUPERSEDES,
    copy_correction,
    current_turn_start,
    hiding_correction,
    with_correction,
)
from ._records import (
    InvalidCallsDecision,
    InvalidCallsFeedback,
    InvalidCallsRepair,
    InvalidCallsSkipped,
)

__all__ = [
    "INVALID_TOOL_CALL",
    "CallProblem",
    "InvalidCalls",
    "InvalidCallsDecision",
    "InvalidCallsFeedback",
    "InvalidCallsRepair",
    "InvalidCallsSkipped",
    "InvalidToolCallError",
    "schema_errors",
]

Case: TypeAlias = Literal["unknown_tool", "invalid_json", "invalid_arguments", "duplicate_id"]
Policy: TypeAlias = Literal["fail", "retry", "repair", "skip", "stop"]

CASES: Final[tuple[Case, ...]] = (
    "unknown_tool",
    "invalid_json",
    "invalid_arguments",
    "duplicate_id",
)
_POLICIES: Final[tuple[Policy, ...]] = ("repair", "skip", "retry", "stop", "fail")  # by severity

INVALID_TOOL_CALL: Final = "invalid_tool_call"
"""The yield reason kind of the ``"stop"`` policy."""


class InvalidToolCallError(RunError):
    """The model made invalid tool calls and the policy is ``"fail"``.

    Attributes:
        problems: what was wrong, one :class:`CallProblem` per case found.
    """

    def __init__(self, message: str, problems: Sequence[CallProblem]) -> None:
        super().__init__(message)
        self.problems = tuple(problems)


@dataclass(frozen=True, slots=True)
class CallProblem:
    """One thing wrong with one tool call."""

    call_id: str
    name: str
    case: Case
    detail: str

    def as_note(self) -> dict[str, str]:
        """The problem as JSON builtins, for notes and yield data."""
        return {
            "call_id": self.call_id,
            "name": self.name,
            "case": self.case,
            "detail": self.detail,
        }


def _decision(message: Message, namespace: str) -> InvalidCallsDecision | None:
    """The decision recorded on ``message`` (``None``: none, or another record of the step)."""
    value = message.notes.get(namespace)
    if value is None or (isinstance(value, dict) and "action" not in value):
        return None
    where = f"message {message.id!r}"
    return read_record(message.notes, namespace, InvalidCallsDecision, where=where)


# -- a small JSON-schema checker -------------------------------------------------------

_JSON_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "object": (dict,),
    "array": (list, tuple),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def _type_ok(value: Any, name: str) -> bool:
    if name in ("integer", "number") and isinstance(value, bool):
        return False
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES.get(name, (object,)))


def schema_errors(
    value: Any, schema: Mapping[str, Any], root: Mapping[str, Any] | None = None, path: str = "$"
) -> list[str]:
    """Reasons ``value`` does not match ``schema`` (empty: it matches, as far as checked).

    Covers the keywords listed in the module docs; others are ignored.
    """
    root = schema if root is None else root
    if "$ref" in schema:
        ref = str(schema["$ref"])
        target: Any = root
        for key in ref.removeprefix("#/").split("/") if ref.startswith("#/") else ():
            target = target.get(key, {}) if isinstance(target, Mapping) else {}
        return schema_errors(value, target, root, path)
    errors: list[str] = []
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_type_ok(value, n) for n in names):
            return [f"{path}: expected {' or '.join(names)}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']!r}")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: expected {schema['const']!r}")
    for key, alternatives in (("anyOf", "any"), ("oneOf", "one")):
        if key in schema:
            matching = [s for s in schema[key] if not schema_errors(value, s, root, path)]
            if not matching:
                errors.append(f"{path}: matches none of the {alternatives}Of alternatives")
    for sub in schema.get("allOf", ()):
        errors.extend(schema_errors(value, sub, root, path))
    if isinstance(value, dict):
        properties: Mapping[str, Any] = schema.get("properties", {})
        errors.extend(
            f"{path}: missing required property {k!r}"
            for k in schema.get("required", ())
            if k not in value
        )
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in properties:
                errors.extend(schema_errors(item, properties[key], root, f"{path}.{key}"))
            elif extra is False:
                errors.append(f"{path}: unexpected property {key!r}")
            elif isinstance(extra, Mapping):
                errors.extend(schema_errors(item, extra, root, f"{path}.{key}"))
    if isinstance(value, list | tuple) and isinstance(schema.get("items"), Mapping):
        for index, item in enumerate(value):
            errors.extend(schema_errors(item, schema["items"], root, f"{path}[{index}]"))
    if isinstance(value, int | float) and not isinstance(value, bool):
        bounds = (
            ("minimum", value >= schema.get("minimum", value)),
            ("maximum", value <= schema.get("maximum", value)),
            (
                "exclusiveMinimum",
                "exclusiveMinimum" not in schema or value > schema["exclusiveMinimum"],
            ),
            (
                "exclusiveMaximum",
                "exclusiveMaximum" not in schema or value < schema["exclusiveMaximum"],
            ),
        )
        errors.extend(
            f"{path}: {value!r} violates {key} {schema[key]!r}" for key, ok in bounds if not ok
        )
    if isinstance(value, str | list | tuple):
        low, high = (
            ("minLength", "maxLength") if isinstance(value, str) else ("minItems", "maxItems")
        )
        if low in schema and len(value) < schema[low]:
            errors.append(f"{path}: shorter than {schema[low]}")
        if high in schema and len(value) > schema[high]:
            errors.append(f"{path}: longer than {schema[high]}")
    return errors


# -- repairs ---------------------------------------------------------------------------

_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)
_JSON_SPACE = re.compile(r"[ \t\r\n]*")
_MISSING: Final = object()


def _drop_trailing_commas(text: str) -> str:
    """``text`` without commas that are followed (after whitespace) by ``}`` or ``]``.

    Commas inside JSON strings are kept: the scan tracks string state,
    escapes included, so ``{"s": "a,}"}`` is left unchanged.
    """
    out: list[str] = []
    in_string = escaped = False
    for index, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char == ",":
            after = _JSON_SPACE.match(text, index + 1)
            end = after.end() if after else index + 1
            if text[end : end + 1] in ("}", "]"):
                continue
        out.append(char)
    return "".join(out)


def _repair_json(raw: str) -> Any:
    """Arguments parsed from a slightly broken JSON string, or :data:`_MISSING`.

    Removes a surrounding code fence and trailing commas (see the module docs).
    """
    text = raw
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1)
    text = _drop_trailing_commas(text)
    if not text.strip():
        return _MISSING
    # ToolCallPart.parse decodes with the kernel's nesting limit: deep JSON stays unrepaired.
    arguments = ToolCallPart.parse("", "", text).arguments
    if arguments is None and text.strip() != "null":
        return _MISSING
    return arguments


def _normalise(name: str) -> str:
    return re.sub(r"[\s_\-.]", "", name).lower()


def _repair_name(name: str, known: Sequence[str]) -> str | None:
    """The one advertised name ``name`` nearly is, or ``None`` (none, or ambiguous)."""
    by_form: dict[str, list[str]] = {}
    for candidate in dict.fromkeys(known):
        by_form.setdefault(_normalise(candidate), []).append(candidate)
    form = _normalise(name)
    if form in by_form:
        exact = by_form[form]
        return exact[0] if len(exact) == 1 else None
    close = difflib.get_close_matches(form, list(by_form), n=2, cutoff=0.8)
    if len(close) == 1 and len(by_form[close[0]]) == 1:
        return by_form[close[0]][0]
    return None


# -- the operation ---------------------------------------------------------------------


class InvalidCalls(Operation[Any]):
    """Finds invalid tool calls and applies a policy per case; see the module docs.

    Args:
        policy: one policy for every case, or a mapping case -> policy
            (missing cases: ``"retry"``).
        tools: ``Tool`` objects whose ``validate`` checks their arguments
            exactly; other tools are checked against their JSON schema.
        max_retries: retries per user turn before ``"retry"`` becomes ``"stop"``.
        repair_fallback: the action when a ``"repair"`` case cannot be repaired.
        name: the step name and notes namespace.

    Raises:
        ConfigurationError: an unknown case or policy.
    """

    def __init__(
        self,
        policy: Policy | Mapping[Case, Policy] = "retry",
        *,
        tools: Iterable[Tool] = (),
        max_retries: int = 2,
        repair_fallback: Policy = "retry",
        name: str = "invalid_calls",
    ) -> None:
        if isinstance(policy, str):
            policies: dict[Case, Policy] = dict.fromkeys(CASES, policy)
        else:
            unknown = sorted(set(policy) - set(CASES))
            if unknown:
                raise ConfigurationError(f"unknown invalid-call cases {unknown!r}; use {CASES!r}")
            policies = {**dict.fromkeys(CASES, "retry"), **policy}
        for value in (*policies.values(), repair_fallback):
            if value not in _POLICIES:
                raise ConfigurationError(f"unknown policy {value!r}; use one of {_POLICIES!r}")
        if repair_fallback == "repair":
            raise ConfigurationError("repair_fallback cannot be 'repair'")
        self._policies = policies
        self._tools = {t.name: t for t in tools}
        self._max_retries = max_retries
        self._fallback: Policy = repair_fallback
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    # -- finding problems -------------------------------------------------------------

    def _target(self, session: Session[Any]) -> tuple[int, Message] | None:
        """The latest visible assistant message with tool calls, if one of them is open.

        O(1) when no call is open; otherwise it reads back to that message.
        """
        if not session.history.has_open_calls:
            return None
        conversation = session.conversation
        for index in range(session.history.last_visible, -1, -1):
            message = conversation[index]
            if not message.visible_to_model or message.role != "assistant":
                continue
            if not message.tool_calls:
                return None
            answered = _answered_after(conversation, index)
            if all(c.call_id in answered for c in message.tool_calls):
                return None
            return index, message
        return None

    def problems(
        self,
        conversation: Sequence[Message] | Session[Any],
        index: int,
        definitions: Sequence[ToolDefinition],
        *,
        open_only: bool = True,
    ) -> list[CallProblem]:
        """Every problem of the calls of ``conversation[index]`` (unanswered ones only).

        Given a session, whether a call id repeats an earlier call comes from
        its history index; given messages, from reading those before ``index``.
        """
        if isinstance(conversation, Session):
            history = conversation.history
            conversation = conversation.conversation
            message = conversation[index]
            earlier = set()
            for call in message.tool_calls:
                first = history.first_visible_call(call.call_id)
                if first is not None and first < index:
                    earlier.add(call.call_id)
        else:
            message = conversation[index]
            earlier = {
                c.call_id for m in conversation[:index] if m.visible_to_model for c in m.tool_calls
            }
        answered = _answered_after(conversation, index) if open_only else set()
        schemas = {d.name: d.parameters for d in definitions}
        found: list[CallProblem] = []
        counts: dict[str, int] = {}
        for call in message.tool_calls:
            counts[call.call_id] = counts.get(call.call_id, 0) + 1
        for call in message.tool_calls:
            if call.call_id in earlier or counts[call.call_id] > 1:
                where = "an earlier call" if call.call_id in earlier else "another call"
                found.append(
                    CallProblem(
                        call.call_id, call.name, "duplicate_id", f"the call id repeats {where}"
                    )
                )
            if call.call_id in answered:
                continue
            found.extend(self._call_problems(call, schemas))
        return found

    def _call_problems(
        self, call: ToolCallPart, schemas: Mapping[str, Mapping[str, Any]]
    ) -> list[CallProblem]:
        found: list[CallProblem] = []
        if call.name not in schemas:
            known = ", ".join(sorted(schemas)) or "none"
            detail = f"unknown tool {call.name!r}; available tools: {known}"
            found.append(CallProblem(call.call_id, call.name, "unknown_tool", detail))
        arguments = effective_arguments(call)
        if arguments is None:
            detail = f"the arguments are not valid JSON: {call.raw_arguments!r}"
            found.append(CallProblem(call.call_id, call.name, "invalid_json", detail))
        if found:
            return found
        impl = self._tools.get(call.name)
        if impl is not None:
            try:
                impl.validate(arguments)
            except ToolArgumentsError as exc:
                return [CallProblem(call.call_id, call.name, "invalid_arguments", str(exc))]
            return []
        errors = schema_errors(arguments, schemas[call.name])
        if errors:
            detail = f"invalid arguments for tool {call.name!r}: " + "; ".join(errors)
            return [CallProblem(call.call_id, call.name, "invalid_arguments", detail)]
        return []

    def check_call(self, ctx: StepContext[Any], call: ToolCallPart) -> str | None:
        """Object to a call with a problem, so no tool step runs it."""
        target = self._target(ctx.session)
        if target is None:
            return None
        for problem in self.problems(ctx.session, target[0], ctx.tools):
            if problem.call_id == call.call_id:
                return f"invalid tool call ({problem.case}): {problem.detail}"
        return None

    # -- deciding ---------------------------------------------------------------------

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        conversation = ctx.session.conversation
        target = self._target(ctx.session)
        if target is None:
            return Refuse("no unanswered tool calls")
        index, message = target
        found = self.problems(ctx.session, index, ctx.tools)
        if not found:
            return Refuse("every tool call is valid")
        action = max((self._policies[p.case] for p in found), key=_POLICIES.index)
        answered = _answered_after(conversation, index)
        partly_answered = any(c.call_id in answered for c in message.tool_calls)
        repaired: Message | None = None
        if action == "repair":
            repaired = None if partly_answered else self._repair(ctx, message, found)
            if repaired is None:
                action = self._fallback
        if action == "retry" and partly_answered:
            action = "skip"
        if action == "retry" and self._retries(ctx.session) >= self._max_retries:
            action = "stop"
        notes = [p.as_note() for p in found]
        if action == "fail":
            raise InvalidToolCallError(
                f"invalid tool calls in message {message.id!r} of session {ctx.session.id!r}: "
                + "; ".join(f"{p.call_id} ({p.case}): {p.detail}" for p in found),
                found,
            )
        if action == "stop":
            effects: list[Effect] = []
            decided = _decision(message, self._name)
            if decided is None or decided.action != "stop":
                stop = InvalidCallsDecision(action="stop", problems=notes)
                effects.append(Annotate(message.id, self._name, note_value(stop)))
            return Yield(
                effects,
                YieldReason(
                    INVALID_TOOL_CALL,
                    f"invalid tool calls in message {message.id!r}",
                    {"message_id": message.id, "problems": notes},
                ),
            )
        if action == "retry":
            return Continue(self._retry(ctx, message, found))
        if action == "repair" and repaired is not None:
            return Continue(self._replace(ctx, message, repaired, found, "repair"))
        return Continue(self._skip(ctx, message, found, partly_answered))

    def _retries(self, session: Session[Any]) -> int:
        """The retries decided in the current user turn (on assistant messages after its start).

        Reads the messages with notes in this step's namespace (the history
        index), newest first, back to the turn's start; none: no turn start
        needed, nothing read.
        """
        entries = session.history.noted(self._name)
        newest = next(entries, None)
        if newest is None:
            return 0
        start = current_turn_start(session)
        conversation = session.conversation
        count = 0
        for position, call_id in chain((newest,), entries):
            if position <= start:
                break  # noted before the turn began: the step notes the turn's messages
            if call_id is not None:
                continue
            message = conversation[position]
            if message.role != "assistant":
                continue
            decided = _decision(message, self._name)
            if decided is not None and decided.action == "retry":
                count += 1
        return count

    def _retry(
        self, ctx: StepContext[Any], message: Message, found: Sequence[CallProblem]
    ) -> list[Effect]:
        lines = "\n".join(f"- call {p.call_id!r} to {p.name!r}: {p.detail}" for p in found)
        text = (
            "Your previous reply was not carried out because it contained invalid tool calls:\n"
            f"{lines}\nPlease reply again with valid tool calls."
        )
        feedback = Message(
            id=ctx.new_id(),
            role="user",
            parts=(TextPart(text),),
            notes={
                self._name: note_value(
                    InvalidCallsFeedback(
                        feedback_for=message.id, problems=[p.as_note() for p in found]
                    )
                ),
                FEEDBACK: {"by": self._name},
            },
            visible_to_user=False,
        )
        # The hidden reply's calls never run: they stop counting (budgets' ledger).
        feedback = with_correction(feedback, hiding_correction(ctx.session, (message.id,)))
        return [
            SetVisibility((message.id,), to_model=False),
            Annotate(
                message.id,
                self._name,
                note_value(
                    InvalidCallsDecision(action="retry", problems=[p.as_note() for p in found])
                ),
            ),
            AppendMessage(feedback),
        ]

    def _repair(
        self, ctx: StepContext[Any], message: Message, found: Sequence[CallProblem]
    ) -> Message | None:
        """A corrected copy of ``message``, or ``None`` when some problem cannot be repaired.

        Every repair a call needs is applied (name, JSON, id), whichever
        problems ``found`` lists, then the copy is re-validated as a whole.
        """
        if any(p.case == "invalid_arguments" for p in found):
            return None
        known = [d.name for d in ctx.tools]
        duplicated = {p.call_id for p in found if p.case == "duplicate_id"}
        parts: list[Any] = []
        repairs: list[dict[str, str]] = []
        for part in message.parts:
            if not isinstance(part, ToolCallPart):
                parts.append(part)
                continue
            call = part
            if call.name not in known:
                new_name = _repair_name(call.name, known)
                if new_name is None:
                    return None
                repairs.append({"call_id": call.call_id, "renamed": f"{call.name} -> {new_name}"})
                call = msgspec.structs.replace(call, name=new_name)
            if effective_arguments(call) is None:
                arguments = _repair_json(call.raw_arguments)
                if arguments is _MISSING:
                    return None
                repairs.append({"call_id": call.call_id, "arguments": "cleaned invalid JSON"})
                call = msgspec.structs.replace(
                    call,
                    arguments=arguments,
                    raw_arguments=msgspec.json.encode(arguments).decode(),
                )
            if call.call_id in duplicated:
                new_id = f"{call.call_id}_r{ctx.new_id()}"
                repairs.append({"call_id": call.call_id, "new_id": new_id})
                call = msgspec.structs.replace(call, call_id=new_id)
            parts.append(call)
        copy = Message(
            id=ctx.new_id(),
            role="assistant",
            parts=tuple(parts),
            notes={
                **message.notes,
                SUPERSEDES: {"message_id": message.id},
                self._name: note_value(
                    InvalidCallsRepair(repaired_from=message.id, repairs=repairs)
                ),
            },
        )
        conversation = (*ctx.session.conversation, copy)
        hidden = tuple(
            msgspec.structs.replace(m, visible_to_model=False) if m.id == message.id else m
            for m in conversation
        )
        if self.problems(hidden, len(hidden) - 1, ctx.tools):
            return None  # re-validation failed
        return copy

    def _replace(
        self,
        ctx: StepContext[Any],
        message: Message,
        copy: Message,
        found: Sequence[CallProblem],
        action: str,
    ) -> list[Effect]:
        # The copy's calls count instead of the original's: its ledger says so (budgets).
        copy = with_correction(copy, copy_correction(ctx.session, message, copy))
        return [
            SetVisibility((message.id,), to_model=False, to_user=False),
            Annotate(
                message.id,
                self._name,
                note_value(
                    InvalidCallsDecision(
                        action=action,
                        problems=[p.as_note() for p in found],
                        replaced_by=copy.id,
                    )
                ),
            ),
            AppendMessage(copy),
        ]

    def _skip(
        self,
        ctx: StepContext[Any],
        message: Message,
        found: Sequence[CallProblem],
        partly_answered: bool,
    ) -> list[Effect]:
        effects: list[Effect] = []
        target = message
        if any(p.case == "duplicate_id" for p in found) and not partly_answered:
            parts: list[Any] = [
                msgspec.structs.replace(part, call_id=f"{part.call_id}_r{ctx.new_id()}")
                if isinstance(part, ToolCallPart)
                else part
                for part in message.parts
            ]
            target = Message(
                id=ctx.new_id(),
                role="assistant",
                parts=tuple(parts),
                notes={**message.notes, SUPERSEDES: {"message_id": message.id}},
            )
            effects.extend(self._replace(ctx, message, target, found, "skip"))
        else:
            effects.append(
                Annotate(
                    message.id,
                    self._name,
                    note_value(
                        InvalidCallsDecision(action="skip", problems=[p.as_note() for p in found])
                    ),
                )
            )
        conversation = ctx.session.conversation
        position = ctx.session.history.message_position(message.id)
        assert position is not None  # the target is in the session
        answered = _answered_after(conversation, position)
        details: dict[str, list[str]] = {}
        for problem in found:
            details.setdefault(problem.call_id, []).append(problem.detail)
        done: set[str] = set()
        original_ids = [c.call_id for c in message.tool_calls]
        for original_id, call in zip(original_ids, target.tool_calls, strict=True):
            if call.call_id in done or (target is message and call.call_id in answered):
                continue
            done.add(call.call_id)
            if original_id in details:
                content = "not executed: invalid tool call: " + "; ".join(details[original_id])
            else:
                content = "not executed: another tool call of this turn was invalid"
            result = ToolResultPart.for_call(call, content, is_error=True)
            note = {self._name: note_value(InvalidCallsSkipped(skipped=call.call_id))}
            effects.append(AppendMessage(Message.tool_result(result, id=ctx.new_id(), notes=note)))
        return effects


def _answered_after(conversation: Sequence[Message], index: int) -> set[str]:
    return {
        r.call_id for m in conversation[index + 1 :] if m.visible_to_model for r in m.tool_results
    }
