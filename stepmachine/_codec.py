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
compacted. A batch's ``refused`` and ``trace`` are left out while they are
empty. One mechanism leaves fields out: the value is copied with them set to
``msgspec.UNSET``, which msgspec's encoder omits, and encoded once (the copy
is never checked or handed out). Records written before hold every field
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


_MESSAGE: Final = Message
_MESSAGES: Final = tuple[Message, ...]


_UNSET: Final = msgspec.UNSET

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


def _after_parts() -> tuple[tuple[str, Any], ...]:
    """The fields a message encodes after ``parts``, with their defaults: ``(name,
    default)`` (a default factory called once here; the value is only compared)."""
    fields = msgspec.structs.fields(Message)
    at = [field.name for field in fields].index("parts")
    return tuple(
        (f.name, f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory())
        for f in fields[at + 1 :]
    )


_AFTER_PARTS: Final = _after_parts()
"""``notes``, ``visible_to_model``, ``visible_to_user`` today: left out of a stored
message when all hold these defaults."""


def _compact(value: Any) -> Any:
    """``value`` (a message, an effects tuple or a batch) as :meth:`Codec._encode` writes
    it: a copy with the fields it leaves out set to ``UNSET``; ``value`` itself when
    nothing is left out."""
    kind = type(value)
    if kind is Message:
        return _compact_message(value)
    if kind is tuple:
        return tuple([_compact_effect(effect) for effect in value])
    if kind is Batch:
        effects = tuple([_compact_effect(effect) for effect in value.effects])
        batch = value.__copy__()
        msgspec.structs.force_setattr(batch, "effects", effects)
        if not value.refused:
            msgspec.structs.force_setattr(batch, "refused", _UNSET)
        if value.trace is None:
            msgspec.structs.force_setattr(batch, "trace", _UNSET)
        return batch
    return value


def _compact_effect(effect: Effect) -> Effect:
    """``effect`` with the messages in its fields declared as messages compacted."""
    names = _message_fields(type(effect))
    if not names:
        return effect
    short: Effect = effect.__copy__()  # type: ignore[attr-defined]  # msgspec's: no checks
    for name in names:
        field = getattr(effect, name)
        if type(field) is Message:
            msgspec.structs.force_setattr(short, name, _compact_message(field))
        elif type(field) is tuple:
            msgspec.structs.force_setattr(short, name, tuple(map(_compact_message, field)))
    return short


def _compact_message(message: Message) -> Message:
    """A copy of ``message`` without what decoding gives back: the ``arguments`` of each
    tool call whose raw string parses to the same JSON, and the fields after
    ``parts`` when all hold their defaults; ``message`` itself when neither applies.
    The copy is only encoded: it is never checked, compared or handed out."""
    parts: list[Any] | None = None
    for position, part in enumerate(message.parts):
        if type(part) is ToolCallPart and _encode_plain(
            parse_arguments(part.raw_arguments)
        ) == _encode_plain(part.arguments):
            if parts is None:
                parts = list(message.parts)
            short = part.__copy__()  # type: ignore[attr-defined]  # msgspec's: no checks
            msgspec.structs.force_setattr(short, "arguments", _UNSET)
            parts[position] = short
    defaults = True
    for name, default in _AFTER_PARTS:
        if getattr(message, name) != default:
            defaults = False
            break
    if parts is None and not defaults:
        return message
    compact: Message = message.__copy__()  # type: ignore[attr-defined]
    if parts is not None:
        msgspec.structs.force_setattr(compact, "parts", tuple(parts))
    if defaults:
        for name, _ in _AFTER_PARTS:
            msgspec.structs.force_setattr(compact, name, _UNSET)
    return compact


_encode_plain: Final = msgspec.json.Encoder(enc_hook=enc_hook).encode
"""Encodes a call's arguments, and what its raw string parses to, to compare them."""

_UNKNOWN_EFFECT: Final = re.compile(r"^Invalid value .* - at `\$(\.effects)?\[\d+\]\.type`")
"""A validation error of an effects or batch record naming an effect tag the codec lacks."""
_PART_TAGS: Final = sorted(str(part.__struct_config__.tag) for part in typing.get_args(Part))
"""The tags of message parts, named when a stored part's tag is unknown."""


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
        messages in fields declared as messages (an effect's ``Message`` or
        ``tuple[Message, ...]`` fields) are compacted. A batch's ``refused``
        and ``trace`` are written only when they are not their defaults.

        One mechanism does it all: ``value`` is copied (unchecked, for encoding
        only) with each field to leave out set to ``msgspec.UNSET``, which
        msgspec's encoder omits, and encoded once. A text holding a lone
        surrogate raises :class:`InvalidFieldError` naming its message
        (:func:`unencodable`).
        """
        try:
            return self._encoder.encode(_compact(value))
        except UnicodeEncodeError as exc:  # checked only here: a valid text costs nothing
            raise unencodable(value) from exc

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
