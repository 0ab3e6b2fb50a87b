"""One codec per application: the registry of effect and data types.

The :class:`Codec` is built from the application's data type and its own
effect types, on top of the kernel effects. It owns one reused JSON encoder and
one reused decoder per record kind (sessions, batches, effects, data), built
for the closed tagged union of the registered effects.

Stored data is data: decoding never imports or constructs a
class named by the input. An unknown tag or a malformed record raises
:class:`~stepmachine.StoredDataError`, naming the record and where it came
from, and nothing is rewritten.

Effects, batches and messages are encoded compactly (issue 9), sessions as
msgspec encodes them (stores compress their snapshots):

- Tool arguments are stored once: a :class:`~stepmachine.ToolCallPart` whose
  ``arguments`` are what its ``raw_arguments`` parse to (every call a provider
  or :meth:`~stepmachine.ToolCallPart.of` builds) is encoded without
  ``arguments``, and decoding parses them back from the raw string
  (:func:`~stepmachine._messages.parse_arguments`). A call whose arguments
  differ from its raw string keeps both.
- A message whose ``notes`` are empty and that is visible to the model and the
  user is encoded without those three fields; decoding gives their defaults.

Only messages in fields declared as ``Message`` or ``tuple[Message, ...]`` are
compacted, and only where the bytes left out are known exactly (a message's
own tail; a call encoded on its own). Records written before hold every field
and decode as they always did: the change adds a default to
``ToolCallPart.arguments`` and renames nothing. (Code from before this change
cannot read a call stored without ``arguments``.)
"""

from __future__ import annotations

import re
import typing
from collections.abc import Iterable, Sequence
from typing import Any, Final, Generic, TypeVar, Union

import msgspec

from ._conversation import Conversation, enc_hook
from ._effects import (
    Annotate,
    AppendMessage,
    Effect,
    ReplaceConversation,
    SetVisibility,
    UpdateData,
)
from ._errors import ConfigurationError, InvalidFieldError, StoredDataError
from ._messages import Message, Part, ToolCallPart, parse_arguments
from ._session import NoData, Session

__all__ = ["KERNEL_EFFECTS", "MAX_WHY", "Batch", "Codec", "Refusal", "refusal"]

KERNEL_EFFECTS: tuple[type[Effect], ...] = (
    AppendMessage,
    ReplaceConversation,
    Annotate,
    SetVisibility,
    UpdateData,
)
"""The effect types every codec knows."""

D = TypeVar("D", bound=msgspec.Struct)
E = TypeVar("E", bound=Effect)


class _StoredSession(msgspec.Struct, frozen=True):
    """A session as stored: the fields of :class:`Session`, the conversation a JSON array.

    Decoded, then made a :class:`Session` (msgspec cannot decode a
    :class:`~stepmachine.Conversation` itself); the data is kept as its JSON
    text and decoded by :meth:`Codec.decode_data`, which checks its fields.
    """

    id: str
    revision: int
    conversation: tuple[Message, ...]
    data: msgspec.Raw


class Refusal(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A step that refused in the cycle that wrote a batch, and why (stored as ``[step, why]``).

    Attributes:
        step: the step's name.
        why: its ``Refuse.why``, cut to :data:`MAX_WHY` characters.
    """

    step: str
    why: str


MAX_WHY: Final = 200
"""Characters of a ``Refuse.why`` the audit log keeps (the rest is cut, ending in ``...``)."""


def refusal(step: str, why: object) -> Refusal:
    """The :class:`Refusal` the audit log keeps for ``step`` refusing with ``why``.

    ``why`` is cut to :data:`MAX_WHY` characters; what is not a str is kept as
    its ``str()``, and characters UTF-8 cannot encode (lone surrogates, as in
    a file name read with ``os.listdir``) as ``?``: a reason must never stop
    the batch it belongs to from being stored.
    """
    if type(why) is not str:
        why = _text(why)
    if len(why) > MAX_WHY:
        why = why[: MAX_WHY - 3] + "..."
    if not why.isascii():
        why = why.encode("utf-8", "replace").decode("utf-8")
    return Refusal(step, why)


def _text(value: object) -> str:
    try:
        return str(value)
    except Exception:  # noqa: BLE001 - a broken __str__ must not lose the batch
        return f"<{type(value).__name__} whose str() failed>"


class Batch(msgspec.Struct, Generic[E], frozen=True, gc=False):
    """One applied batch of effects: the unit of the audit trail.

    Attributes:
        session_id: the session the batch was applied to.
        revision: the revision this batch produced (the one read, plus one).
        step: the name of the step that produced it (or of the caller that
            submitted it, such as ``"application"``).
        cycle: the machine cycle within the run (0 outside a machine run).
        timestamp: seconds since the epoch, from the Runtime's clock.
        effects: the effects, in the order they were applied.
        refused: the steps that refused, in order, before ``step`` decided
            in that cycle, with why (the decision trace: "why did step X not
            run" is answered from the store). Empty outside a machine run.
        trace: the W3C ``traceparent`` of the span that wrote the batch, when
            the run was traced (OpenTelemetry); a later run links to it.

    ``refused`` and ``trace`` came later (schema evolution: defaulted fields
    after the others), so a record without them decodes with their defaults.
    """

    session_id: str
    revision: int
    step: str
    cycle: int
    timestamp: float
    effects: tuple[E, ...]
    refused: tuple[Refusal, ...] = ()
    trace: str | None = None


_KEYS: Final = msgspec.json.Decoder(dict[str, msgspec.Raw])


def _data_names(data_type: type[msgspec.Struct]) -> frozenset[str] | None:
    """The keys a data type's JSON object may hold, or ``None`` when it is an array."""
    config = data_type.__struct_config__
    if config.array_like:
        return None
    names = {field.encode_name for field in msgspec.structs.fields(data_type)}
    if config.tag_field is not None:
        names.add(config.tag_field)
    return frozenset(names)


def _tag_of(effect_type: type[Effect]) -> str:
    config = effect_type.__struct_config__
    tag = config.tag
    if config.tag_field != "type" or not isinstance(tag, str) or tag == effect_type.__name__:
        raise ConfigurationError(
            f"effect {effect_type.__qualname__} needs an explicit, stable tag string "
            f"(class {effect_type.__name__}(Effect, tag='myapp.something')); "
            f"got tag_field={config.tag_field!r} tag={tag!r}"
        )
    return tag


def _default_tail() -> bytes:
    """How a message's encoding ends when every field after ``parts`` is its default."""
    empty = msgspec.json.encode(Message(id="", role="user", parts=()))
    return empty[empty.index(b'"parts":[]') + len(b'"parts":[]') :]


_DEFAULT_TAIL: Final = _default_tail()
"""``,"notes":{},"visible_to_model":true,"visible_to_user":true}`` today."""


def _has_calls(message: Message) -> bool:
    for part in message.parts:  # noqa: SIM110 - cheaper than any() over a generator
        if type(part) is ToolCallPart:
            return True
    return False


_MESSAGE: Final = Message
_MESSAGES: Final = tuple[Message, ...]


_ARGUMENTS_KEY: Final = b',"arguments":'
_UNSET: Final = msgspec.UNSET
_NO_DEFAULT: Final = msgspec.NODEFAULT
_LAYOUTS: dict[type, tuple[bytes, tuple[tuple[str, bytes], ...]] | None] = {}


def _layout(kind: type) -> tuple[bytes, tuple[tuple[str, bytes], ...]] | None:
    """How msgspec lays out a Struct type's JSON object: its tag member (``b""`` if
    none), then ``(field name, b'"key":')`` in order; ``None`` for array-like
    structs and those omitting defaults (encoded whole, never piece by piece)."""
    if kind in _LAYOUTS:
        return _LAYOUTS[kind]
    config = kind.__struct_config__  # type: ignore[attr-defined]
    layout: tuple[bytes, tuple[tuple[str, bytes], ...]] | None = None
    if not (config.array_like or config.omit_defaults):
        encode = msgspec.json.encode
        tag = b"" if config.tag is None else encode(config.tag_field) + b":" + encode(config.tag)
        names = zip(kind.__struct_fields__, kind.__struct_encode_fields__, strict=True)  # type: ignore[attr-defined]
        layout = (tag, tuple((name, encode(key) + b":") for name, key in names))
    _LAYOUTS[kind] = layout
    return layout


_MESSAGE_FIELDS: dict[type, tuple[str, ...]] = {}


def _message_fields(kind: type) -> tuple[str, ...]:
    """The fields of Struct type ``kind`` declared as a ``Message`` or ``tuple[Message, ...]``.

    Only those are stored compactly: a decoder of that declared type gives
    the defaults back. A message in a field of another type (``Any``, a dict)
    is stored as msgspec encodes it.
    """
    known = _MESSAGE_FIELDS.get(kind)
    if known is not None:
        return known
    try:
        hints = typing.get_type_hints(kind)
    except Exception:  # noqa: BLE001 - an unresolvable annotation: nothing is compacted
        hints = {}
    names = getattr(kind, "__struct_fields__", ())
    found = tuple(name for name in names if hints.get(name) in (_MESSAGE, _MESSAGES))
    _MESSAGE_FIELDS[kind] = found
    return found


def _message_layout() -> tuple[tuple[tuple[str, bytes], ...], bytes]:
    """The fields a message encodes before ``parts``, and the ``parts`` key."""
    layout = _layout(Message)
    assert layout is not None  # a plain Struct: no tag
    assert not layout[0]
    names = [name for name, _ in layout[1]]
    at = names.index("parts")
    return layout[1][:at], layout[1][at][1]


_BEFORE_PARTS, _PARTS_KEY = _message_layout()


def _after_parts() -> tuple[tuple[str, Any, Any], ...]:
    """The fields a message encodes after ``parts``: ``(name, default, default factory)``
    (``msgspec.NODEFAULT`` for what a field lacks)."""
    fields = msgspec.structs.fields(Message)
    at = [field.name for field in fields].index("parts")
    return tuple((f.name, f.default, f.default_factory) for f in fields[at + 1 :])


_AFTER_PARTS: Final = _after_parts()
"""``notes``, ``visible_to_model``, ``visible_to_user`` today: what :data:`_DEFAULT_TAIL`
encodes when they hold these defaults."""


def _holding(value: Any, kind: type, message: Message) -> Any:
    """``value`` (a message, a one-``AppendMessage`` effects tuple or such a batch) with
    ``message`` in its place; copies, unchecked (for encoding only)."""
    if kind is Message:
        return message
    effect = (value[0] if kind is tuple else value.effects[0]).__copy__()
    msgspec.structs.force_setattr(effect, "message", message)
    if kind is tuple:
        return (effect,)
    batch = value.__copy__()
    msgspec.structs.force_setattr(batch, "effects", (effect,))
    return batch


_UNKNOWN_EFFECT: Final = re.compile(r"^Invalid value .* - at `\$(\.effects)?\[\d+\]\.type`")
"""A validation error of an effects or batch record naming an effect tag the codec lacks."""
_PART_TAGS: Final = sorted(str(part.__struct_config__.tag) for part in typing.get_args(Part))
"""The tags of message parts, named when a stored part's tag is unknown."""


def _last_field(kind: type) -> str | None:
    layout = _layout(kind)
    return layout[1][-1][0] if layout is not None and layout[1] else None


def _batch_trail() -> bytes:
    """How a batch's encoding ends after its effects when ``refused`` and ``trace`` are defaults."""
    empty = msgspec.json.encode(
        Batch(session_id="", revision=0, step="", cycle=0, timestamp=0.0, effects=())
    )
    return empty[empty.index(b'"effects":[]') + len(b'"effects":[]') :]


_BATCH_TRAIL: Final = _batch_trail()
"""``,"refused":[],"trace":null}`` today."""

_TAILS: Final[dict[type, tuple[bytes, bytes]]] = (
    {
        Message: (_DEFAULT_TAIL, b"}"),
        tuple: (_DEFAULT_TAIL + b"}]", b"}}]"),
        Batch: (_DEFAULT_TAIL + b"}]" + _BATCH_TRAIL, b"}}]" + _BATCH_TRAIL),
    }
    if _last_field(AppendMessage) == "message"
    and Batch.__struct_fields__[-3:] == ("effects", "refused", "trace")
    else {}
)
"""How a message, a one-``AppendMessage`` effects record and such a batch end when
the message's notes and visibility are the defaults, and what replaces that."""


def _unencodable_text(
    value: Any, path: str, message: tuple[str, str] | None, depth: int = 0
) -> tuple[str, str, tuple[str, str] | None] | None:
    """The first text in ``value`` UTF-8 cannot encode: ``(text, path, message)``,
    where ``message`` is the innermost :class:`Message` around it (its id and its
    own path), or None when no text in ``value`` is unencodable."""
    if type(value) is str:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value, path, message
        return None
    if depth > 64:
        return None
    items: Iterable[tuple[str, Any]]
    if isinstance(value, Message):
        message = (value.id, path)
    if isinstance(value, msgspec.Struct):
        items = ((f".{name}", getattr(value, name)) for name in value.__struct_fields__)
    elif isinstance(value, tuple | list | Conversation):
        items = ((f"[{index}]", item) for index, item in enumerate(value))
    elif isinstance(value, dict):
        items = (
            pair
            for key, item in value.items()
            for pair in ((f" (a key {key!r})", key), (f"[{key!r}]", item))
        )
    else:
        return None
    for step, item in items:
        found = _unencodable_text(item, path + step, message, depth + 1)
        if found is not None:
            return found
    return None


def unencodable(value: Any) -> InvalidFieldError:
    """The error for ``value``, which msgspec could not encode as UTF-8: a text in it
    holds a lone surrogate (half of a UTF-16 pair, such as what ``json.loads``
    gives for ``"\\ud83d"``: an emoji cut in two). It names the message holding
    the text (by id) and the field, and says how to fix the text.
    """
    found = _unencodable_text(value, "", None)
    expected = (
        "text UTF-8 can encode, without a lone surrogate (half of a character such as "
        "an emoji, as json.loads gives for a text cut in the middle of one); replace it "
        "first, e.g. text.encode('utf-8', 'replace').decode() (or "
        "decode the bytes it came from with errors='replace'); nothing was stored"
    )
    if found is None:  # pragma: no cover - msgspec raises only for such a text
        return InvalidFieldError(type(value).__name__, "?", expected, value)
    text, path, message = found
    if message is not None:
        message_id, at = message
        return InvalidFieldError(f"Message {message_id!r}", path[len(at) + 1 :], expected, text)
    if type(value) is tuple:  # the effects of a batch, encoded on their own
        return InvalidFieldError("effects", f"item{path}", expected, text)
    return InvalidFieldError(type(value).__name__, path.lstrip("."), expected, text)


class Codec(Generic[D]):
    """Encodes and decodes sessions, batches, effects and application data.

    Args:
        data_type: the application's data Struct; ``NoData`` by default.
        effects: the application's own effect types, each with an explicit tag.

    Raises:
        ConfigurationError: ``data_type`` is not a :class:`msgspec.Struct`
            subclass; an effect type is not an :class:`Effect`, has no explicit
            tag, or two types share a tag.
    """

    def __init__(
        self,
        data_type: type[D] = NoData,  # type: ignore[assignment]  # NoData is the default D
        effects: Iterable[type[Effect]] = (),
    ) -> None:
        if not (isinstance(data_type, type) and issubclass(data_type, msgspec.Struct)):
            raise ConfigurationError(
                f"Codec(data_type) takes a msgspec Struct subclass, got {data_type!r}; define "
                "the session's data as one (class MyData(msgspec.Struct): ...) and pass "
                "Codec(MyData), or leave it out for sessions without data"
            )
        self.data_type: type[D] = data_type
        registry: dict[str, type[Effect]] = {}
        for effect_type in (*KERNEL_EFFECTS, *effects):
            if not (isinstance(effect_type, type) and issubclass(effect_type, Effect)):
                raise ConfigurationError(
                    f"Codec(effects=[...]) takes Effect subclasses, got {effect_type!r}; "
                    "define one as class MyEffect(Effect, tag='myapp.my_effect')"
                )
            tag = _tag_of(effect_type)
            if tag in registry and registry[tag] is not effect_type:
                raise ConfigurationError(
                    f"effect tag {tag!r} is used by both {registry[tag].__qualname__} and "
                    f"{effect_type.__qualname__}; a stored batch names its effects by tag, so "
                    "give each effect type its own"
                )
            registry[tag] = effect_type
        self.effect_types: dict[str, type[Effect]] = registry
        union: Any = Union[tuple(registry.values())]  # noqa: UP007 - built at run time
        self._encoder = msgspec.json.Encoder(enc_hook=enc_hook)  # a Conversation: an array
        self._effects_decoder = msgspec.json.Decoder(tuple[union, ...])
        self._batch_decoder = msgspec.json.Decoder(Batch[union])
        # A session's data is decoded on its own, so its field names can be checked
        # against the data type (an unknown field would be dropped on the next write).
        self._session_decoder = msgspec.json.Decoder(_StoredSession)
        self._data_decoder = msgspec.json.Decoder(data_type)
        self._data_names = _data_names(data_type)
        self._message_decoder = msgspec.json.Decoder(Message)

    # -- sessions ---------------------------------------------------------------

    def new_session(
        self,
        session_id: str,
        data: D | None = None,
        conversation: Sequence[Message] = (),
    ) -> Session[D]:
        """A revision-0 session; ``data`` defaults to ``data_type()``."""
        expected = self.data_type.__name__
        if data is None:
            try:
                data = self.data_type()
            except TypeError as exc:
                raise ConfigurationError(
                    f"session {session_id!r} needs data: {expected} has required fields, so "
                    f"it has no default; pass data={expected}(...) explicitly"
                ) from exc
        elif not isinstance(data, self.data_type):
            got = type(data).__name__
            raise ConfigurationError(
                f"session {session_id!r}: data must be a {expected} (this codec's data type), "
                f"got a {got}; a store keeps the data type of the Codec it was opened with: "
                f"open it with Codec({got}) (e.g. MemoryStore(codec=Codec({got})), "
                f"SQLiteStore.open(path, Codec({got}))), or pass a {expected}"
            )
        # Session checks the id and every message (InvalidFieldError) before ids are read.
        items: Any = conversation
        if isinstance(conversation, Sequence) and not isinstance(
            conversation, str | bytes | bytearray | memoryview
        ):
            items = tuple(conversation)
        session = Session(id=session_id, revision=0, conversation=items, data=data)
        ids = [m.id for m in session.conversation]
        if len(set(ids)) != len(ids):
            raise ConfigurationError(
                f"message ids are stable and unique: the conversation for {session_id!r} "
                f"repeats ids {sorted({i for i in ids if ids.count(i) > 1})!r}; give each "
                "message its own id"
            )
        return session

    def encode_session(self, session: Session[D]) -> bytes:
        """JSON bytes of a session, as msgspec encodes it (stores compress snapshots).

        Raises:
            InvalidFieldError: a text holds a lone surrogate, which UTF-8 cannot
                encode (see :func:`unencodable`); nothing is stored.
        """
        try:
            return self._encoder.encode(session)
        except UnicodeEncodeError as exc:
            raise unencodable(session) from exc

    def decode_session(self, buf: bytes, *, where: str = "session record") -> Session[D]:
        """Decode a session. Raises :class:`StoredDataError` naming ``where``.

        Besides the types, the session's own rules are checked: a revision of
        at least 0 and message ids that are unique.
        """
        stored: _StoredSession = self._decode(self._session_decoder, buf, "session", where)
        data = self._data(stored.data, where, kind="session", at="$.data")
        ids = [m.id for m in stored.conversation]
        if stored.revision < 0 or len(set(ids)) != len(ids):
            raise StoredDataError(
                f"stored data is data: session in {where} is not valid: "
                f"revision {stored.revision}, "
                f"repeated message ids {sorted({i for i in ids if ids.count(i) > 1})!r}"
            )
        return Session(
            id=stored.id,
            revision=stored.revision,
            conversation=Conversation(stored.conversation),
            data=data,
        )

    # -- effects and batches ----------------------------------------------------

    def check_effects(self, effects: Iterable[Effect]) -> None:
        """Raise :class:`ConfigurationError` for an effect whose type is not registered."""
        for effect in effects:
            tag = type(effect).__struct_config__.tag
            if not isinstance(tag, str) or self.effect_types.get(tag) is not type(effect):
                raise ConfigurationError(
                    f"effect type {type(effect).__qualname__} (tag {tag!r}) is not registered "
                    f"in this codec; pass it in Codec(effects=[...])"
                )

    def encode_effects(self, effects: Sequence[Effect]) -> bytes:
        """JSON bytes of a sequence of effects (each tagged)."""
        self.check_effects(effects)
        return self._encode(tuple(effects))

    def decode_effects(self, buf: bytes, *, where: str = "effects record") -> tuple[Effect, ...]:
        """Decode effects. Raises :class:`StoredDataError` naming ``where``."""
        return self._decode(self._effects_decoder, buf, "effects", where)  # type: ignore[no-any-return]

    def encode_batch(self, batch: Batch[Effect]) -> bytes:
        """JSON bytes of a batch."""
        self.check_effects(batch.effects)
        return self._encode(batch)

    def decode_batch(self, buf: bytes, *, where: str = "batch record") -> Batch[Effect]:
        """Decode a batch. Raises :class:`StoredDataError` naming ``where``."""
        return self._decode(self._batch_decoder, buf, "batch", where)  # type: ignore[no-any-return]

    # -- application data and messages ------------------------------------------

    def encode_data(self, data: D) -> bytes:
        """JSON bytes of application data (:class:`InvalidFieldError` for a lone surrogate)."""
        try:
            return self._encoder.encode(data)
        except UnicodeEncodeError as exc:
            raise unencodable(data) from exc

    def decode_data(self, buf: bytes, *, where: str = "data record") -> D:
        """Decode application data. Raises :class:`StoredDataError` naming ``where``.

        Data with a field the data type does not have is refused, never decoded
        without it: the next write would store the data without that field. It
        is what a store opened with another codec than the one that wrote the
        session meets (``Codec(NoData)``, the default, for data of ``MyData``).
        """
        return self._data(buf, where, kind="data", at="$")

    def _data(self, buf: bytes, where: str, *, kind: str, at: str) -> D:
        """:meth:`decode_data`; a validation error names ``kind`` and the path ``at``."""
        try:
            data = self._data_decoder.decode(buf)
        except msgspec.ValidationError as exc:
            detail = str(exc).replace(" - at `$", f" - at `{at}")
            if " - at `" not in detail:
                detail += f" - at `{at}`"
            name = self.data_type.__name__
            raise StoredDataError(
                f"stored data is data: {kind} in {where} does not validate: {detail}; the "
                f"data does not fit {name}: if the session was written with another data "
                "type, open it with the Codec of that type; if you changed "
                f"{name}, change it only by adding fields with defaults, keeping each "
                "field's type (see the migrations how-to); nothing was changed"
            ) from exc
        except msgspec.DecodeError as exc:  # the session record itself was valid JSON
            raise StoredDataError(f"stored data is data: {kind} in {where}: {exc}") from exc
        if self._data_names is not None and bytes(memoryview(buf)[:1]) == b"{":
            names = self._decode(_KEYS, buf, "data", where)
            unknown = sorted(set(names) - self._data_names)
            if unknown:
                name = self.data_type.__name__
                raise StoredDataError(
                    f"stored data is data: the application data in {where} has fields "
                    f"{unknown!r} that {name} does not have, so it was not read (a write "
                    f"would drop them); this store was opened with Codec({name}): open it "
                    "with the Codec of the data type the session was written with, e.g. "
                    "Codec(MyData), or add the fields to "
                    f"{name}; nothing was changed"
                )
        return data

    def encode_message(self, message: Message) -> bytes:
        """JSON bytes of one message (tool arguments stored once)."""
        return self._encode(message)

    def decode_message(self, buf: bytes, *, where: str = "message record") -> Message:
        """Decode one message. Raises :class:`StoredDataError` naming ``where``."""
        return self._decode(self._message_decoder, buf, "message", where)  # type: ignore[no-any-return]

    # -- shared -----------------------------------------------------------------

    def _encode(self, value: Any) -> bytes:
        """JSON bytes of ``value`` (a session, batch, effects or message), messages compacted.

        A tool call whose ``arguments`` re-encode byte for byte like what its
        ``raw_arguments`` parse to is written without them (decoding parses
        them back, to the value an encoding with both would give). A message
        whose ``notes`` are empty and that is visible to both is written
        without those three fields (decoding gives their defaults). Only
        messages in fields declared as messages (a session's conversation, an
        effect's ``Message`` fields) are compacted. The value is then encoded
        piece by piece, and the pieces are used only if, joined, they are
        exactly msgspec's own encoding of it (else it is stored as msgspec
        encodes it). A text holding a lone surrogate raises
        :class:`InvalidFieldError` naming its message (:func:`unencodable`).
        """
        kind = type(value)
        try:
            if kind is Batch:
                return self._encode_batch(value)
            return self._encode_value(value, kind)
        except UnicodeEncodeError as exc:  # checked only here: a valid text costs nothing
            raise unencodable(value) from exc

    def _encode_batch(self, batch: Batch[Effect]) -> bytes:
        """A batch record: ``refused`` and ``trace`` are left out while they hold their defaults.

        The batch is encoded with both at their defaults (so the fast path of
        :meth:`_encode_value` applies), which ends in :data:`_BATCH_TRAIL`;
        that trail is then replaced by the real one, or dropped. A decoder
        gives the defaults back for fields that are absent.
        """
        plain = batch
        if batch.refused or batch.trace is not None:
            plain = msgspec.structs.replace(batch, refused=(), trace=None)
        body = self._encode_value(plain, Batch)
        if not body.endswith(_BATCH_TRAIL):  # pragma: no cover - msgspec keeps field order
            return self._encoder.encode(batch)
        head = body[: -len(_BATCH_TRAIL)]
        if plain is batch:
            return head + b"}"
        encode = self._encoder.encode
        trail = [head]
        if batch.refused:
            trail += [b',"refused":', encode(batch.refused)]
        if batch.trace is not None:
            trail += [b',"trace":', encode(batch.trace)]
        trail.append(b"}")
        return b"".join(trail)

    def _encode_value(self, value: Any, kind: type) -> bytes:
        """:meth:`_encode` of anything; batches end in :data:`_BATCH_TRAIL` here."""
        tails = _TAILS.get(kind)
        if tails is not None:
            # The usual record: one AppendMessage (or a message).
            message: Message | None = value
            if kind is not Message:
                effects = value if kind is tuple else value.effects
                first = effects[0] if len(effects) == 1 else None
                message = first.message if type(first) is AppendMessage else None
            if message is not None:
                if _has_calls(message):  # encoded once, the fields left out unset
                    return self._encoder.encode(_holding(value, kind, self._compacted(message)))
                # Without tool calls the message's fields are the last thing encoded.
                tail, end = tails
                encoded = self._encoder.encode(value)
                return encoded[: -len(tail)] + end if encoded.endswith(tail) else encoded
        encoded = self._encoder.encode(value)
        pieces = self._top_pieces(value)
        if pieces is None:
            return encoded
        plain, compact = pieces
        return compact if plain == encoded else encoded

    def _compacted(self, message: Message) -> Message:
        """A copy of ``message`` that encodes as :meth:`_message_pieces`'s compact form.

        msgspec leaves out a field set to ``UNSET``: the ``arguments`` of each
        tool call whose raw string gives them (:meth:`_call_pieces`'s test), and
        the fields after ``parts`` when all hold their defaults (what
        :data:`_DEFAULT_TAIL` drops). The copy is only encoded: it is never
        checked, compared or handed out.
        """
        encode = self._encoder.encode
        parts = list(message.parts)
        for position, part in enumerate(parts):
            if type(part) is ToolCallPart and encode(parse_arguments(part.raw_arguments)) == encode(
                part.arguments
            ):
                short = part.__copy__()  # type: ignore[attr-defined]  # msgspec's: no checks
                msgspec.structs.force_setattr(short, "arguments", _UNSET)
                parts[position] = short
        compact: Message = message.__copy__()  # type: ignore[attr-defined]
        msgspec.structs.force_setattr(compact, "parts", tuple(parts))
        for name, default, factory in _AFTER_PARTS:
            if getattr(message, name) != (default if factory is _NO_DEFAULT else factory()):
                break
        else:
            for name, _, _ in _AFTER_PARTS:
                msgspec.structs.force_setattr(compact, name, _UNSET)
        return compact

    def _top_pieces(self, value: Any) -> tuple[bytes, bytes] | None:
        """:meth:`_encode`'s pieces; ``None`` when nothing in ``value`` is compacted."""
        kind = type(value)
        if kind is tuple:
            if not any(_message_fields(type(effect)) for effect in value):
                return None
            return self._effects_pieces(value)
        if kind is Message:
            return self._message_pieces(value)
        if kind is Batch:
            if not any(_message_fields(type(effect)) for effect in value.effects):
                return None
            return self._struct_pieces(value, ("effects",))
        return None

    def _effects_pieces(self, effects: tuple[Effect, ...]) -> tuple[bytes, bytes]:
        items = [self._struct_pieces(effect, _message_fields(type(effect))) for effect in effects]
        return (
            b"[" + b",".join(p for p, _ in items) + b"]",
            b"[" + b",".join(c for _, c in items) + b"]",
        )

    def _message_pieces(self, message: Message) -> tuple[bytes, bytes]:
        """``(plain, compact)`` of a message; the same object twice when nothing is left out."""
        encode = self._encoder.encode
        plain = compact = encode(message)
        if _has_calls(message):
            # The parts, each encoded on its own, follow the fields before them:
            # where each call starts is known exactly, whatever the other parts hold.
            fields = [key + encode(getattr(message, name)) for name, key in _BEFORE_PARTS]
            prefix = b"{" + b",".join(fields) + b"," + _PARTS_KEY + b"["
            plains: list[bytes] = []
            compacts: list[bytes] = []
            for part in message.parts:
                if type(part) is ToolCallPart:
                    part_plain, part_compact = self._call_pieces(part)
                else:
                    part_plain = part_compact = encode(part)
                plains.append(part_plain)
                compacts.append(part_compact)
            head = prefix + b",".join(plains)
            if plain.startswith(head):
                compact = prefix + b",".join(compacts) + plain[len(head) :]
        if compact.endswith(_DEFAULT_TAIL):
            compact = compact[: -len(_DEFAULT_TAIL)] + b"}"
        return plain, compact

    def _call_pieces(self, call: ToolCallPart) -> tuple[bytes, bytes]:
        """A tool call, and the same without ``arguments`` when its raw string gives them.

        The call's encoding starts ``{"type":"tool_call","call_id":...,"name":...,
        "arguments":``: the first ``,"arguments":`` in it is that key (inside a
        JSON string a quote is escaped).
        """
        encode = self._encoder.encode
        plain = encode(call)
        arguments = encode(call.arguments)
        if encode(parse_arguments(call.raw_arguments)) != arguments:
            return plain, plain  # not what the raw string gives: both are kept
        return plain, plain.replace(_ARGUMENTS_KEY + arguments, b"", 1)

    def _field_pieces(self, owner: msgspec.Struct, field: Any) -> tuple[bytes, bytes]:
        """The pieces of a field :meth:`_struct_pieces` was asked to compact."""
        if type(field) is Message:
            return self._message_pieces(field)
        if isinstance(owner, Batch):
            return self._effects_pieces(field)
        encode = self._encoder.encode
        plain: list[bytes] = []
        compact: list[bytes] = []
        for item in field:  # a conversation, or a message's parts
            kind = type(item)
            if kind is Message:
                item_plain, item_compact = self._message_pieces(item)
            elif kind is ToolCallPart:
                item_plain, item_compact = self._call_pieces(item)
            else:
                item_plain = item_compact = encode(item)
            plain.append(item_plain)
            compact.append(item_compact)
        return b"[" + b",".join(plain) + b"]", b"[" + b",".join(compact) + b"]"

    def _struct_pieces(self, value: msgspec.Struct, fields: tuple[str, ...]) -> tuple[bytes, bytes]:
        """``(plain, compact)``: ``value`` encoded field by field in msgspec's order, the
        ``fields`` named compacted."""
        encode = self._encoder.encode
        layout = _layout(type(value))
        if layout is None:
            encoded = encode(value)
            return encoded, encoded
        tag, keys = layout
        plain: list[bytes] = [tag] if tag else []
        compact: list[bytes] = [tag] if tag else []
        for name, key in keys:
            field = getattr(value, name)
            if field is _UNSET:
                continue
            if name in fields:
                field_plain, field_compact = self._field_pieces(value, field)
                plain.append(key + field_plain)
                compact.append(key + field_compact)
            else:
                encoded = key + encode(field)
                plain.append(encoded)
                compact.append(encoded)
        return b"{" + b",".join(plain) + b"}", b"{" + b",".join(compact) + b"}"

    def _decode(self, decoder: msgspec.json.Decoder[Any], buf: bytes, kind: str, where: str) -> Any:
        try:
            return decoder.decode(buf)
        except msgspec.ValidationError as exc:
            detail = str(exc)
            if re.search(r"\.parts\[\d+\]\.type`", detail):
                detail += f" (the part tags: {_PART_TAGS!r})"
            elif "`" in detail and ".type`" in detail:
                detail += f" (registered effect tags: {sorted(self.effect_types)!r})"
                if _UNKNOWN_EFFECT.search(detail):
                    detail += (
                        "; register the effect type of that tag: open the store with the "
                        "Codec the session was written with, "
                        f"Codec({self.data_type.__name__}, effects=[MyEffect, ...]) (an "
                        "effect type stays registered while stored batches name its tag)"
                    )
            raise StoredDataError(
                f"stored data is data: {kind} in {where} does not validate: {detail}"
            ) from exc
        except msgspec.DecodeError as exc:
            raise StoredDataError(
                f"stored data is data: {kind} in {where} is not valid JSON: {exc}"
            ) from exc
        except RecursionError as exc:
            raise StoredDataError(
                f"stored data is data: {kind} in {where} is nested too deeply to decode"
            ) from exc
