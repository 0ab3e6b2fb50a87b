"""Provider-neutral messages and their parts.

A :class:`Message` has a stable ``id``, a ``role`` and a tuple of parts. Parts
are msgspec Structs in a tagged union (tag field ``"type"``) with explicit,
stable tag strings; new kinds of part (images, files) are added as new tags.

Messages are immutable values. Operation notes (``notes``) are namespaced by
operation name and record what an operation *did*; visibility flags hide a
message from the model or the user without deleting it.

Every message and part checks its fields when built (directly, through a
factory, by ``msgspec.structs.replace`` or by decoding) with cheap
``isinstance`` checks, and raises :class:`~stepmachine.InvalidFieldError` (a
``TypeError`` and ``ValueError``) naming the field, the expected type and the
type of the value given. A list given for ``Message.parts`` becomes a tuple.

Messages and parts are not tracked by Python's cyclic garbage collector
(msgspec ``gc=False``; the kernel effects and ``Batch`` too): a process
holding long conversations, or thousands of sessions, does not have every
message traversed by each full collection. They hold only strings, numbers,
tuples of parts and JSON values (notes, arguments), which cannot form a
reference cycle through them; do not put other objects in their JSON fields
(a value that refers back to the message would never be freed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias

import msgspec

from . import _json
from ._checks import (
    check_bool,
    check_dict,
    check_notes,
    check_str,
    fail,
    notes_ok,
    str_keys,
    tuple_of,
)
from ._media import AudioPart, DocumentPart, ImagePart, MediaRef

__all__ = [
    "AudioPart",
    "DocumentPart",
    "ImagePart",
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


class TextPart(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="text"):
    """Plain text."""

    text: str

    def __post_init__(self) -> None:
        if type(self.text) is not str:
            check_str("TextPart", "text", self.text)


class _FromRaw:
    """The default of ``ToolCallPart.arguments``: parse them from ``raw_arguments``."""

    def __repr__(self) -> str:
        return "<parsed from raw_arguments>"


class _Missing:
    """The default of ``ToolCallPart.raw_arguments``: there is none (it is required)."""

    def __repr__(self) -> str:
        return "(missing required field `raw_arguments`)"


_FROM_RAW: Final[Any] = _FromRaw()
_REQUIRED: Final[Any] = _Missing()


def parse_arguments(raw_arguments: str) -> Any:
    """Tool-call arguments from the raw string a model sent, as :meth:`ToolCallPart.parse` does.

    Blank means no arguments (``{}``); a string that is not JSON, or JSON nested
    deeper than 128 levels, gives ``None`` (never a ``RecursionError``).
    """
    try:
        return _json.decode(raw_arguments) if raw_arguments.strip() else {}
    except msgspec.DecodeError:
        return None


class ToolCallPart(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="tool_call"):
    """A request by the model to run a tool.

    Attributes:
        call_id: the id the model gave the call; unique within a session's history.
        name: the tool name as the model sent it (it may name no known tool).
        arguments: the arguments parsed from ``raw_arguments`` as JSON, or
            ``None`` when the raw string is not valid JSON. Left out, they
            are parsed from ``raw_arguments`` (:func:`parse_arguments`): that
            is how a store keeps them, once, as the raw string (see
            :class:`~stepmachine.Codec`).
        raw_arguments: exactly the string the model sent (required).
        notes: operation notes bound to this call (approval, journal, ...).
    """

    call_id: str
    name: str
    arguments: Any = _FROM_RAW
    raw_arguments: str = _REQUIRED
    notes: Notes = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.arguments is _FROM_RAW:
            if self.raw_arguments is _REQUIRED:
                fail("ToolCallPart", "raw_arguments", "str", _REQUIRED)
            check_str("ToolCallPart", "raw_arguments", self.raw_arguments)
            msgspec.structs.force_setattr(self, "arguments", parse_arguments(self.raw_arguments))
        elif self.raw_arguments is _REQUIRED:
            fail("ToolCallPart", "raw_arguments", "str", _REQUIRED)
        if not (
            type(self.call_id) is str
            and type(self.name) is str
            and type(self.raw_arguments) is str
            and type(self.notes) is dict
            and notes_ok(self.notes)
        ):
            check_str("ToolCallPart", "call_id", self.call_id)
            check_str("ToolCallPart", "name", self.name)
            check_str("ToolCallPart", "raw_arguments", self.raw_arguments)
            check_notes("ToolCallPart", "notes", self.notes)

    @classmethod
    def parse(cls, call_id: str, name: str, raw_arguments: str) -> ToolCallPart:
        """Build a call from the raw argument string a model sent.

        Invalid JSON does not raise: ``arguments`` is ``None`` and the raw string
        is kept, so the tool step can answer with a clear error result. JSON
        nested deeper than 128 levels counts as invalid (never a ``RecursionError``).

        Raises:
            InvalidFieldError: ``call_id``, ``name`` or ``raw_arguments`` is not a str.
        """
        check_str("ToolCallPart.parse", "raw_arguments", raw_arguments)
        arguments = parse_arguments(raw_arguments)
        return cls(call_id=call_id, name=name, arguments=arguments, raw_arguments=raw_arguments)

    @classmethod
    def of(cls, call_id: str, name: str, arguments: dict[str, Any]) -> ToolCallPart:
        """Build a call from parsed arguments; the raw string is their JSON encoding.

        Raises:
            InvalidFieldError: ``call_id`` or ``name`` is not a str, or
                ``arguments`` is not a dict with str keys.
        """
        check_dict("ToolCallPart.of", "arguments", arguments)
        raw = msgspec.json.encode(arguments).decode()
        return cls(call_id=call_id, name=name, arguments=arguments, raw_arguments=raw)


_RESULT_MEDIA: Final = (ImagePart, DocumentPart)
_MEDIA: Final = (ImagePart, DocumentPart, AudioPart)


class ToolResultPart(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="tool_result"):
    """The answer to one tool call.

    Images and documents a result carries (a screenshot, a chart) are not in
    it: they are the image and document parts that follow it in its ``tool``
    message (:meth:`Message.tool_result` with ``media=``, read back with
    :meth:`Message.result_media`), so a reader that does not know media parts
    refuses such a message instead of dropping them.

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

    def __post_init__(self) -> None:
        if not (
            type(self.call_id) is str
            and type(self.content) is str
            and type(self.is_error) is bool
            and type(self.name) is str
        ):
            check_str("ToolResultPart", "call_id", self.call_id)
            check_str("ToolResultPart", "content", self.content)
            check_bool("ToolResultPart", "is_error", self.is_error)
            check_str("ToolResultPart", "name", self.name)

    @classmethod
    def for_call(
        cls, call: ToolCallPart, content: str, *, is_error: bool = False
    ) -> ToolResultPart:
        """The result answering ``call`` (its id and tool name) with ``content``.

        Raises:
            InvalidFieldError: ``call`` is not a ``ToolCallPart``, or ``content``
                is not a str.
        """
        if not isinstance(call, ToolCallPart):
            fail("ToolResultPart.for_call", "call", "ToolCallPart", call)
        return cls(call_id=call.call_id, content=content, is_error=is_error, name=call.name)


class ReasoningPart(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="reasoning"):
    """Model reasoning, with the provider's opaque data kept for round trips.

    Attributes:
        text: the reasoning text (may be empty when the provider encrypts it).
        provider_data: opaque provider data, such as a signature or an encrypted
            reasoning item, sent back unchanged on the next request.
    """

    text: str
    provider_data: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        data = self.provider_data
        if not (type(self.text) is str and type(data) is dict and (not data or str_keys(data))):
            check_str("ReasoningPart", "text", self.text)
            check_dict("ReasoningPart", "provider_data", self.provider_data)


Part: TypeAlias = (
    TextPart | ToolCallPart | ToolResultPart | ReasoningPart | ImagePart | DocumentPart | AudioPart
)

_PARTS: Final = (
    TextPart,
    ToolCallPart,
    ToolResultPart,
    ReasoningPart,
    ImagePart,
    DocumentPart,
    AudioPart,
)
_A_PART: Final = (
    "a part (TextPart, ToolCallPart, ToolResultPart, ReasoningPart, ImagePart, DocumentPart "
    "or AudioPart)"
)
_PART_TYPES: Final = frozenset((*_PARTS, MediaRef))
"""What ``Message.parts`` holds; a ``MediaRef`` only while a store decodes its record."""

if TYPE_CHECKING:
    _Parts: TypeAlias = tuple[Part, ...]
else:
    # What msgspec decodes: a stored record may hold a MediaRef (the stores keep
    # media bytes apart, see stepmachine._media), which the store replaces by the
    # media part before the message leaves it. Typed code never sees one.
    _Parts = tuple[Part | MediaRef, ...]


def _all_parts(parts: tuple[Any, ...]) -> bool:
    """Whether every item is exactly one of the part types (the fast path; no error)."""
    for part in parts:  # noqa: SIM110 - cheaper than all() over a generator (hot path)
        if type(part) not in _PART_TYPES:
            return False
    return True


_ROLES: Final = frozenset(("user", "assistant", "tool", "system"))
_ASSISTANT_PARTS: Final = (TextPart, ToolCallPart, ReasoningPart)


class Message(msgspec.Struct, frozen=True, gc=False):
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
    parts: _Parts
    notes: Notes = msgspec.field(default_factory=dict)
    visible_to_model: bool = True
    visible_to_user: bool = True

    def __post_init__(self) -> None:
        # One cheap expression for the usual case; the field-by-field checks
        # (exact errors, subclasses, a list for parts) only when it fails.
        if not (
            type(self.id) is str
            and type(self.role) is str
            and self.role in _ROLES
            and type(self.parts) is tuple
            and type(self.notes) is dict
            and type(self.visible_to_model) is bool
            and type(self.visible_to_user) is bool
            and _all_parts(self.parts)
            and notes_ok(self.notes)
        ):
            check_str("Message", "id", self.id)
            if not isinstance(self.role, str) or self.role not in _ROLES:
                fail("Message", "role", "one of 'user', 'assistant', 'tool', 'system'", self.role)
            tuple_of("Message", "parts", self.parts, _PARTS, _A_PART, target=self)
            check_notes("Message", "notes", self.notes)
            check_bool("Message", "visible_to_model", self.visible_to_model)
            check_bool("Message", "visible_to_user", self.visible_to_user)

    @classmethod
    def user(
        cls,
        text: str,
        *,
        id: str,  # noqa: A002 - "id" is the field's name
        media: Sequence[ImagePart | DocumentPart | AudioPart] = (),
    ) -> Message:
        """A user message holding one text part, then the ``media`` parts, in order.

        ``Message.user("What is on this invoice?", id="u1",
        media=[DocumentPart(media_type="application/pdf", data=pdf)])``.

        Raises:
            InvalidFieldError: ``text`` or ``id`` is not a str, or an item of
                ``media`` is not an image, document or audio part.
        """
        check_str("Message.user", "text", text)
        if not media:
            return cls(id=id, role="user", parts=(TextPart(text),))
        items = tuple_of(
            "Message.user", "media", media, _MEDIA, "an ImagePart, DocumentPart or AudioPart"
        )
        return cls(id=id, role="user", parts=(TextPart(text), *items))

    @classmethod
    def system(cls, text: str, *, id: str) -> Message:  # noqa: A002 - "id" is the field's name
        """A system message holding one text part.

        Raises:
            InvalidFieldError: ``text`` or ``id`` is not a str.
        """
        check_str("Message.system", "text", text)
        return cls(id=id, role="system", parts=(TextPart(text),))

    @classmethod
    def assistant(
        cls,
        content: str | TextPart | ToolCallPart | ReasoningPart | Sequence[str | Part],
        *,
        id: str,  # noqa: A002 - "id" is the field's name
    ) -> Message:
        """An assistant message.

        ``content`` is a str (one text part), one part, or a sequence mixing
        str (each a text part) and parts, kept in order:
        ``Message.assistant(["Let me check.", ToolCallPart.of(...)], id=...)``.
        An assistant message holds text, tool calls and reasoning.

        Raises:
            InvalidFieldError: ``content`` or one of its items is of another
                type (a ``ToolResultPart`` belongs in a ``tool`` message), or
                ``id`` is not a str.
        """
        if isinstance(content, str):
            return cls(id=id, role="assistant", parts=(TextPart(content),))
        if isinstance(content, _ASSISTANT_PARTS):
            return cls(id=id, role="assistant", parts=(content,))
        expected = "str, TextPart, ToolCallPart or ReasoningPart"
        if not isinstance(content, list | tuple):
            fail("Message.assistant", "content", f"{expected}, or a list of them", content)
        parts: list[Part] = []
        for index, item in enumerate(content):
            if isinstance(item, str):
                parts.append(TextPart(item))
            elif isinstance(item, _ASSISTANT_PARTS):
                parts.append(item)
            else:
                fail("Message.assistant", f"content[{index}]", expected, item)
        return cls(id=id, role="assistant", parts=tuple(parts))

    @classmethod
    def tool_result(
        cls,
        result: ToolResultPart,
        *,
        id: str,  # noqa: A002 - "id" is the field's name
        notes: Notes | None = None,
        media: Sequence[ImagePart | DocumentPart] = (),
    ) -> Message:
        """A ``tool`` message answering one call: the result, then the images and
        documents it carries (``media``), in order.

        Raises:
            InvalidFieldError: ``result`` is not a ``ToolResultPart``, ``id``
                is not a str, ``notes`` is not notes, or an item of ``media``
                is not an image or document part.
        """
        if not isinstance(result, ToolResultPart):
            fail("Message.tool_result", "result", "ToolResultPart", result)
        items = tuple_of(
            "Message.tool_result", "media", media, _RESULT_MEDIA, "an ImagePart or DocumentPart"
        )
        parts: tuple[Part, ...] = (result, *items) if items else (result,)
        return cls(id=id, role="tool", parts=parts, notes={} if notes is None else notes)

    def result_media(self, call_id: str) -> tuple[ImagePart | DocumentPart, ...]:
        """The images and documents that follow the result of ``call_id`` in this message."""
        found: list[ImagePart | DocumentPart] = []
        inside = False
        for part in self.parts:
            if isinstance(part, ToolResultPart):
                inside = part.call_id == call_id
            elif inside and isinstance(part, ImagePart | DocumentPart):
                found.append(part)
            else:
                inside = inside and isinstance(part, AudioPart)
        return tuple(found)

    @property
    def text(self) -> str:
        """The concatenated text parts."""
        return "".join(p.text for p in self.parts if isinstance(p, TextPart))

    # ``tool_calls`` and ``tool_results`` are read many times per cycle. They
    # allocate nothing in the usual cases: a message whose parts are all calls
    # (or all results) returns its own ``parts`` tuple, one without any returns
    # the shared ``()``. (Caching them on the instance would need ``dict=True``:
    # measured, some 250 more bytes per message, one more object for the cyclic
    # GC to track, and a slower first access, for a gain only on messages mixing
    # calls with text.)

    @property
    def tool_calls(self) -> tuple[ToolCallPart, ...]:
        """The tool-call parts, in order."""
        parts = self.parts
        if len(parts) == 1:
            if isinstance(parts[0], ToolCallPart):
                return parts  # type: ignore[return-value]
            return ()
        calls = [p for p in parts if isinstance(p, ToolCallPart)]
        if len(calls) == len(parts):
            return parts  # type: ignore[return-value]
        return tuple(calls)

    @property
    def tool_results(self) -> tuple[ToolResultPart, ...]:
        """The tool-result parts, in order."""
        parts = self.parts
        if len(parts) == 1:
            if isinstance(parts[0], ToolResultPart):
                return parts  # type: ignore[return-value]
            return ()
        results = [p for p in parts if isinstance(p, ToolResultPart)]
        if len(results) == len(parts):
            return parts  # type: ignore[return-value]
        return tuple(results)
