"""One codec per application: the registry of effect and data types.

The :class:`Codec` is built from the application's data type and its own
effect types, on top of the kernel effects. It owns one reused JSON encoder and
one reused decoder per record kind (sessions, batches, effects, data), built
for the closed tagged union of the registered effects.

Stored data is data (invariant 8): decoding never imports or constructs a
class named by the input. An unknown tag or a malformed record raises
:class:`~stepmachine.StoredDataError`, naming the record and where it came
from, and nothing is rewritten.

Tool arguments are stored once: a :class:`~stepmachine.ToolCallPart` whose
``arguments`` are what its ``raw_arguments`` parse to (every call a provider
or :meth:`~stepmachine.ToolCallPart.of` builds) is encoded without
``arguments``, and decoding parses them back from the raw string
(:func:`~stepmachine._messages.parse_arguments`). A call whose arguments differ
from its raw string keeps both. Records written before hold both and decode as
they always did: the change only adds a default to a field.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Generic, TypeVar, Union

import msgspec

from ._effects import (
    Annotate,
    AppendMessage,
    Effect,
    ReplaceConversation,
    SetVisibility,
    UpdateData,
)
from ._errors import ConfigurationError, StoredDataError
from ._messages import Message, ToolCallPart, parse_arguments
from ._session import NoData, Session

__all__ = ["KERNEL_EFFECTS", "Batch", "Codec"]

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


class Batch(msgspec.Struct, Generic[E], frozen=True):
    """One applied batch of effects: the unit of the audit trail.

    Attributes:
        session_id: the session the batch was applied to.
        revision: the revision this batch produced (the one read, plus one).
        step: the name of the step that produced it (or of the caller that
            submitted it, such as ``"application"``).
        cycle: the machine cycle within the run (0 outside a machine run).
        timestamp: seconds since the epoch, from the Runtime's clock.
        effects: the effects, in the order they were applied.
    """

    session_id: str
    revision: int
    step: str
    cycle: int
    timestamp: float
    effects: tuple[E, ...]


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


def _has_calls(message: Message) -> bool:
    for part in message.parts:  # noqa: SIM110 - cheaper than any() over a generator
        if type(part) is ToolCallPart:
            return True
    return False


def _holds_calls(value: object) -> bool:
    """Whether ``value`` (a session, effect, batch, message or tuple of them) holds a tool call
    in a message reached through Struct fields and tuples."""
    kind = type(value)
    if kind is Message:
        return _has_calls(value)  # type: ignore[arg-type]
    if kind is tuple:
        return any(_holds_calls(item) for item in value)  # type: ignore[attr-defined]
    if isinstance(value, msgspec.Struct) and kind is not ToolCallPart:
        return any(_holds_calls(getattr(value, name)) for name in value.__struct_fields__)
    return False


class Codec(Generic[D]):
    """Encodes and decodes sessions, batches, effects and application data.

    Args:
        data_type: the application's data Struct; ``NoData`` by default.
        effects: the application's own effect types, each with an explicit tag.

    Raises:
        ConfigurationError: a type is not an :class:`Effect`, has no explicit tag,
            or two types share a tag.
    """

    def __init__(
        self,
        data_type: type[D] = NoData,  # type: ignore[assignment]  # NoData is the default D
        effects: Iterable[type[Effect]] = (),
    ) -> None:
        self.data_type: type[D] = data_type
        registry: dict[str, type[Effect]] = {}
        for effect_type in (*KERNEL_EFFECTS, *effects):
            if not (isinstance(effect_type, type) and issubclass(effect_type, Effect)):
                raise ConfigurationError(f"{effect_type!r} is not an Effect subclass")
            tag = _tag_of(effect_type)
            if tag in registry and registry[tag] is not effect_type:
                raise ConfigurationError(
                    f"effect tag {tag!r} is used by both {registry[tag].__qualname__} and "
                    f"{effect_type.__qualname__}"
                )
            registry[tag] = effect_type
        self.effect_types: dict[str, type[Effect]] = registry
        union: Any = Union[tuple(registry.values())]  # noqa: UP007 - built at run time
        self._encoder = msgspec.json.Encoder()
        self._effects_decoder = msgspec.json.Decoder(tuple[union, ...])
        self._batch_decoder = msgspec.json.Decoder(Batch[union])
        self._session_decoder = msgspec.json.Decoder(Session[data_type])  # type: ignore[valid-type]
        self._data_decoder = msgspec.json.Decoder(data_type)
        self._message_decoder = msgspec.json.Decoder(Message)

    # -- sessions ---------------------------------------------------------------

    def new_session(
        self,
        session_id: str,
        data: D | None = None,
        conversation: Sequence[Message] = (),
    ) -> Session[D]:
        """A revision-0 session; ``data`` defaults to ``data_type()``."""
        if data is None:
            try:
                data = self.data_type()
            except TypeError as exc:
                raise ConfigurationError(
                    f"{self.data_type.__name__} has required fields; pass data= explicitly"
                ) from exc
        elif not isinstance(data, self.data_type):
            raise ConfigurationError(
                f"data must be a {self.data_type.__name__}, got {type(data).__name__}"
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
                f"repeats ids {sorted({i for i in ids if ids.count(i) > 1})!r}"
            )
        return session

    def encode_session(self, session: Session[D]) -> bytes:
        """JSON bytes of a session (tool arguments stored once, see the module docstring)."""
        return self._encode(session)

    def decode_session(self, buf: bytes, *, where: str = "session record") -> Session[D]:
        """Decode a session. Raises :class:`StoredDataError` naming ``where``.

        Besides the types, the session's own rules are checked: a revision of
        at least 0 and message ids that are unique.
        """
        session: Session[D] = self._decode(self._session_decoder, buf, "session", where)
        ids = [m.id for m in session.conversation]
        if session.revision < 0 or len(set(ids)) != len(ids):
            raise StoredDataError(
                f"invariant 8 (stored data is data): session in {where} is not valid: "
                f"revision {session.revision}, "
                f"repeated message ids {sorted({i for i in ids if ids.count(i) > 1})!r}"
            )
        return session

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
        """JSON bytes of application data."""
        return self._encoder.encode(data)

    def decode_data(self, buf: bytes, *, where: str = "data record") -> D:
        """Decode application data. Raises :class:`StoredDataError` naming ``where``."""
        return self._decode(self._data_decoder, buf, "data", where)  # type: ignore[no-any-return]

    def encode_message(self, message: Message) -> bytes:
        """JSON bytes of one message (tool arguments stored once)."""
        return self._encode(message)

    def decode_message(self, buf: bytes, *, where: str = "message record") -> Message:
        """Decode one message. Raises :class:`StoredDataError` naming ``where``."""
        return self._decode(self._message_decoder, buf, "message", where)  # type: ignore[no-any-return]

    # -- shared -----------------------------------------------------------------

    def _encode(self, value: Any) -> bytes:
        """JSON bytes of ``value``, its tool calls' arguments stored once where they can be.

        A call whose ``arguments`` re-encode byte for byte like what its
        ``raw_arguments`` parse to is written without them (decoding parses
        them back, to the value an encoding with both would give). Only values
        holding such calls take the slower path: the value is encoded piece by
        piece, and the pieces are used only if, joined, they are exactly
        msgspec's own encoding of it (else it is stored as msgspec encodes it).
        """
        encoded = self._encoder.encode(value)
        if not _holds_calls(value):
            return encoded
        plain, compact = self._pieces(value)
        return compact if plain == encoded else encoded

    def _pieces(self, value: Any) -> tuple[bytes, bytes]:
        """``(plain, compact)``: ``value`` encoded as msgspec does, and with calls compacted."""
        kind = type(value)
        if kind is tuple:
            items = [self._pieces(item) for item in value]
            return (
                b"[" + b",".join(p for p, _ in items) + b"]",
                b"[" + b",".join(c for _, c in items) + b"]",
            )
        if not isinstance(value, msgspec.Struct) or (
            isinstance(value, Message) and not _has_calls(value)
        ):
            encoded = self._encoder.encode(value)
            return encoded, encoded
        config = value.__struct_config__
        if config.array_like or config.omit_defaults:
            encoded = self._encoder.encode(value)
            return encoded, encoded
        encode = self._encoder.encode
        plain: list[bytes] = []
        compact: list[bytes] = []
        if config.tag is not None:
            tag = encode(config.tag_field) + b":" + encode(config.tag)
            plain.append(tag)
            compact.append(tag)
        names = zip(value.__struct_fields__, value.__struct_encode_fields__, strict=True)
        for name, encoded_name in names:
            field = getattr(value, name)
            if field is msgspec.UNSET:
                continue
            key = encode(encoded_name) + b":"
            if isinstance(value, ToolCallPart) and name == "arguments":
                arguments = encode(field)
                plain.append(key + arguments)
                if encode(parse_arguments(value.raw_arguments)) != arguments:
                    compact.append(key + arguments)  # not what the raw string gives: keep both
                continue
            field_plain, field_compact = self._pieces(field)
            plain.append(key + field_plain)
            compact.append(key + field_compact)
        return b"{" + b",".join(plain) + b"}", b"{" + b",".join(compact) + b"}"

    def _decode(self, decoder: msgspec.json.Decoder[Any], buf: bytes, kind: str, where: str) -> Any:
        try:
            return decoder.decode(buf)
        except msgspec.ValidationError as exc:
            detail = str(exc)
            if "`" in detail and ".type`" in detail:
                detail += f" (registered effect tags: {sorted(self.effect_types)!r})"
            raise StoredDataError(
                f"invariant 8 (stored data is data): {kind} in {where} does not validate: {detail}"
            ) from exc
        except msgspec.DecodeError as exc:
            raise StoredDataError(
                f"invariant 8 (stored data is data): {kind} in {where} is not valid JSON: {exc}"
            ) from exc
        except RecursionError as exc:
            raise StoredDataError(
                f"invariant 8 (stored data is data): {kind} in {where} is nested too deeply "
                "to decode"
            ) from exc
