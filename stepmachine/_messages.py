"""Provider-neutral messages and their parts.

A :class:`Message` has a stable ``id``, a ``role`` and a tuple of parts. Parts
are msgspec Structs in a tagged union (tag field ``"type"``) with explicit,
stable tag strings; new kinds of part (images, files) are added as new tags.

Messages are immutable values. Operation notes (``notes``) are namespaced by
operation name and record what an operation *did*; visibility flags hide a
message from the model or the user without deleting it.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

import msgspec

from . import _json

__all__ = [
    "Message",
    "Notes",
    "Part",
    "ReasoningPart",
    "Role",
    "TextPart",
    "ToolCallPart",
    "ToolResultPart",
]

Role: TypeAlias = Literal["user", "assistant", "tool", "system"]
Notes: TypeAlias = dict[str, dict[str, Any]]
"""Operation notes: ``{operation name: {key: JSON value}}``."""


class TextPart(msgspec.Struct, frozen=True, tag_field="type", tag="text"):
    """Plain text."""

    text: str


class ToolCallPart(msgspec.Struct, frozen=True, tag_field="type", tag="tool_call"):
    """A request by the model to run a tool.

    Attributes:
        call_id: the id the model gave the call; unique within a session's history.
        name: the tool name as the model sent it (it may name no known tool).
        arguments: the arguments parsed from ``raw_arguments`` as JSON, or
            ``None`` when the raw string is not valid JSON.
        raw_arguments: exactly the string the model sent.
        notes: operation notes bound to this call (approval, journal, ...).
    """

    call_id: str
    name: str
    arguments: Any
    raw_arguments: str
    notes: Notes = msgspec.field(default_factory=dict)

    @classmethod
    def parse(cls, call_id: str, name: str, raw_arguments: str) -> ToolCallPart:
        """Build a call from the raw argument string a model sent.

        Invalid JSON does not raise: ``arguments`` is ``None`` and the raw string
        is kept, so the tool step can answer with a clear error result. JSON
        nested deeper than 128 levels counts as invalid (never a ``RecursionError``).
        """
        try:
            arguments: Any = _json.decode(raw_arguments) if raw_arguments.strip() else {}
        except msgspec.DecodeError:
            arguments = None
        return cls(call_id=call_id, name=name, arguments=arguments, raw_arguments=raw_arguments)

    @classmethod
    def of(cls, call_id: str, name: str, arguments: dict[str, Any]) -> ToolCallPart:
        """Build a call from parsed arguments; the raw string is their JSON encoding."""
        raw = msgspec.json.encode(arguments).decode()
        return cls(call_id=call_id, name=name, arguments=arguments, raw_arguments=raw)


class ToolResultPart(msgspec.Struct, frozen=True, tag_field="type", tag="tool_result"):
    """The answer to one tool call.

    Attributes:
        call_id: the call this result answers.
        content: what the model is shown.
        is_error: True when the call failed (bad arguments, tool raised,
            interrupted, denied); the model sees the content as an error.
        name: the tool name of the call, for providers that want it.
    """

    call_id: str
    content: str
    is_error: bool = False
    name: str = ""

    @classmethod
    def for_call(
        cls, call: ToolCallPart, content: str, *, is_error: bool = False
    ) -> ToolResultPart:
        """The result answering ``call`` (its id and tool name) with ``content``."""
        return cls(call_id=call.call_id, content=content, is_error=is_error, name=call.name)


class ReasoningPart(msgspec.Struct, frozen=True, tag_field="type", tag="reasoning"):
    """Model reasoning, with the provider's opaque data kept for round trips.

    Attributes:
        text: the reasoning text (may be empty when the provider encrypts it).
        provider_data: opaque provider data, such as a signature or an encrypted
            reasoning item, sent back unchanged on the next request.
    """

    text: str
    provider_data: dict[str, Any] = msgspec.field(default_factory=dict)


Part: TypeAlias = TextPart | ToolCallPart | ToolResultPart | ReasoningPart


class Message(msgspec.Struct, frozen=True):
    """One message of a conversation.

    Attributes:
        id: stable id, unique within the session.
        role: ``user``, ``assistant``, ``tool`` or ``system``.
        parts: the content, in order.
        notes: operation notes, namespaced by operation name.
        visible_to_model: False hides the message from model requests.
        visible_to_user: False hides the message from user-facing views.
    """

    id: str
    role: Role
    parts: tuple[Part, ...]
    notes: Notes = msgspec.field(default_factory=dict)
    visible_to_model: bool = True
    visible_to_user: bool = True

    @classmethod
    def user(cls, text: str, *, id: str) -> Message:  # noqa: A002 - "id" is the field's name
        """A user message holding one text part."""
        return cls(id=id, role="user", parts=(TextPart(text),))

    @classmethod
    def system(cls, text: str, *, id: str) -> Message:  # noqa: A002 - "id" is the field's name
        """A system message holding one text part."""
        return cls(id=id, role="system", parts=(TextPart(text),))

    @classmethod
    def assistant(cls, text: str, *, id: str) -> Message:  # noqa: A002 - "id" is the field's name
        """An assistant message holding one text part."""
        return cls(id=id, role="assistant", parts=(TextPart(text),))

    @classmethod
    def tool_result(
        cls,
        result: ToolResultPart,
        *,
        id: str,  # noqa: A002 - "id" is the field's name
        notes: Notes | None = None,
    ) -> Message:
        """A ``tool`` message answering one call."""
        return cls(id=id, role="tool", parts=(result,), notes=notes or {})

    @property
    def text(self) -> str:
        """The concatenated text parts."""
        return "".join(p.text for p in self.parts if isinstance(p, TextPart))

    @property
    def tool_calls(self) -> tuple[ToolCallPart, ...]:
        """The tool-call parts, in order."""
        return tuple([p for p in self.parts if isinstance(p, ToolCallPart)])

    @property
    def tool_results(self) -> tuple[ToolResultPart, ...]:
        """The tool-result parts, in order."""
        return tuple([p for p in self.parts if isinstance(p, ToolResultPart)])
