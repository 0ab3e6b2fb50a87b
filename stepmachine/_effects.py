"""Effects: serialisable descriptions of one change, applied by a pure function.

An effect is a frozen msgspec Struct subclassing :class:`Effect`, with an
explicit, stable tag string (the tag field is ``"type"``). Its :meth:`~Effect.apply`
method maps a session to the next one and never performs IO, so applying the
same effects to the same session always gives the same result. Effects are the
only way state changes; the stored effect log is the audit trail of a session.

Applications add their own effects by subclassing :class:`Effect` with a tag of
their own (``tag="myapp.flag_raised"``) and registering them in the
:class:`~stepmachine.Codec`. Schema evolution follows msgspec's rule: add fields
only with defaults, never rename a tag.

:func:`apply_batch` applies a whole batch and bumps the revision by one; a batch
that fails part-way raises and leaves nothing changed (sessions are values).

The effects defined here check their fields when built (cheap ``isinstance``
checks in ``__post_init__``, which also runs on decoding) and raise
:class:`~stepmachine.InvalidFieldError` naming the field, the expected type and
the type of the value given; a list given for a tuple field becomes a tuple.

The kernel effects are not tracked by the cyclic garbage collector (msgspec
``gc=False``, as messages are). A subclass of one of them inherits that:
if it adds a field that may hold an object referring back to the effect, pass
``gc=True`` in its class definition. Subclasses of :class:`Effect` itself are
tracked as usual.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

import msgspec

from ._checks import (
    check_dict,
    check_optional_bool,
    check_optional_str,
    check_str,
    fail,
    str_keys,
    tuple_of,
)
from ._conversation import Conversation
from ._errors import EffectError
from ._index import HistoryIndex
from ._messages import Message, ToolCallPart
from ._session import Session, derive_session

__all__ = [
    "Annotate",
    "AppendMessage",
    "Effect",
    "ReplaceConversation",
    "SetVisibility",
    "UpdateData",
    "apply_batch",
    "apply_effects",
]

S = TypeVar("S", bound=Session[Any])


class Effect(msgspec.Struct, frozen=True, tag_field="type"):
    """Base of every effect. Subclasses set ``tag="..."`` and implement ``apply``."""

    def apply(self, session: Session[Any]) -> Session[Any]:
        """Return the session with this effect applied. Pure: no IO, no clock."""
        raise NotImplementedError(f"{type(self).__name__} does not implement apply()")


class AppendMessage(Effect, frozen=True, gc=False, tag="append_message"):
    """Append ``message`` to the conversation.

    Raises:
        EffectError: a message with the same id is already in the conversation.
    """

    message: Message

    def __post_init__(self) -> None:
        if not isinstance(self.message, Message):
            fail("AppendMessage", "message", "Message", self.message)

    def apply(self, session: Session[Any]) -> Session[Any]:
        message = self.message
        index = session.history
        if index.message_position(message.id) is not None:
            raise EffectError(
                f"message ids are stable and unique: session {session.id!r} already "
                f"holds a message with id {message.id!r}"
            )
        conversation = session.conversation.appended(message)  # O(1): shares structure
        index = index.appended(message, session.conversation)
        return derive_session(session, conversation=conversation, index=index)


class ReplaceConversation(Effect, frozen=True, gc=False, tag="replace_conversation"):
    """Replace the whole conversation (after compaction).

    ``conversation`` is a tuple of messages; a list or a
    :class:`~stepmachine.Conversation` (``session.conversation + (m,)``) is converted.

    Raises:
        EffectError: two messages of the new conversation share an id.
    """

    conversation: tuple[Message, ...]

    def __post_init__(self) -> None:
        owner, conversation = "ReplaceConversation", self.conversation
        if isinstance(conversation, Conversation):  # a session's conversation, or one + (m,)
            conversation = conversation.as_tuple()
            msgspec.structs.force_setattr(self, "conversation", conversation)
        tuple_of(owner, "conversation", conversation, Message, "Message", target=self)

    def apply(self, session: Session[Any]) -> Session[Any]:
        ids = [m.id for m in self.conversation]
        if len(set(ids)) != len(ids):
            duplicates = sorted({i for i in ids if ids.count(i) > 1})
            raise EffectError(
                f"message ids are stable and unique: replacement conversation for session "
                f"{session.id!r} repeats ids {duplicates!r}"
            )
        # The messages were checked when this effect was built (or decoded).
        conversation = Conversation(self.conversation)
        return derive_session(
            session, conversation=conversation, index=HistoryIndex.build(conversation)
        )


def _message_index(session: Session[Any], message_id: str) -> int:
    index = session.history.message_position(message_id)
    if index is None:
        raise EffectError(f"session {session.id!r} holds no message with id {message_id!r}")
    return index


def _merge(
    notes: dict[str, dict[str, Any]], namespace: str, values: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    merged = dict(notes)
    merged[namespace] = {**notes.get(namespace, {}), **values}
    return merged


class Annotate(Effect, frozen=True, gc=False, tag="annotate"):
    """Merge ``values`` into the notes of ``namespace`` on a message or a tool call.

    With ``call_id`` set, the note is bound to that tool call of the message;
    otherwise to the message itself. Keys already present are overwritten.

    Raises:
        EffectError: the message or the call does not exist.
    """

    message_id: str
    namespace: str
    values: dict[str, Any]
    call_id: str | None = None

    def __post_init__(self) -> None:
        call_id = self.call_id
        if not (
            type(self.message_id) is str
            and type(self.namespace) is str
            and type(self.values) is dict
            and (call_id is None or type(call_id) is str)
            and str_keys(self.values)
        ):
            check_str("Annotate", "message_id", self.message_id)
            check_str("Annotate", "namespace", self.namespace)
            check_dict("Annotate", "values", self.values)
            check_optional_str("Annotate", "call_id", self.call_id)

    def apply(self, session: Session[Any]) -> Session[Any]:
        index = _message_index(session, self.message_id)
        message = session.conversation[index]
        history = session.history
        if self.call_id is None:
            updated = msgspec.structs.replace(
                message, notes=_merge(message.notes, self.namespace, self.values)
            )
            if self.namespace not in message.notes:
                history = history.noted_at(index, None, self.namespace)
        else:
            parts = list(message.parts)
            for position, part in enumerate(parts):
                if isinstance(part, ToolCallPart) and part.call_id == self.call_id:
                    annotated = msgspec.structs.replace(
                        part, notes=_merge(part.notes, self.namespace, self.values)
                    )
                    parts[position] = annotated
                    history = history.annotated(index, position, annotated)
                    if self.namespace not in part.notes:
                        history = history.noted_at(index, self.call_id, self.namespace)
                    break
            else:
                raise EffectError(
                    f"message {self.message_id!r} of session {session.id!r} holds no tool call "
                    f"{self.call_id!r}"
                )
            updated = msgspec.structs.replace(message, parts=tuple(parts))
        conversation = session.conversation.replaced(index, updated)  # O(1): shares structure
        history = history.replaced(index, updated)
        return derive_session(session, conversation=conversation, index=history)


class SetVisibility(Effect, frozen=True, gc=False, tag="set_visibility"):
    """Show or hide messages, to the model and/or the user, without deleting them.

    ``None`` leaves that flag as it is.

    Raises:
        EffectError: one of the ids names no message.
    """

    message_ids: tuple[str, ...]
    to_model: bool | None = None
    to_user: bool | None = None

    def __post_init__(self) -> None:
        tuple_of("SetVisibility", "message_ids", self.message_ids, str, "str", target=self)
        check_optional_bool("SetVisibility", "to_model", self.to_model)
        check_optional_bool("SetVisibility", "to_user", self.to_user)

    def apply(self, session: Session[Any]) -> Session[Any]:
        history = session.history
        conversation = session.conversation
        missing: list[str] = []
        first: int | None = None  # the first position whose visibility to the model changes
        for message_id in dict.fromkeys(self.message_ids):
            index = history.message_position(message_id)
            if index is None:
                missing.append(message_id)
                continue
            message = conversation[index]
            to_model = message.visible_to_model if self.to_model is None else self.to_model
            to_user = message.visible_to_user if self.to_user is None else self.to_user
            if (to_model, to_user) == (message.visible_to_model, message.visible_to_user):
                continue
            updated = msgspec.structs.replace(
                message, visible_to_model=to_model, visible_to_user=to_user
            )
            conversation = conversation.replaced(index, updated)  # O(1): shares structure
            if to_model == message.visible_to_model:
                history = history.replaced(index, updated)  # seen by the user only: O(1)
            elif first is None or index < first:
                first = index
        if missing:
            raise EffectError(
                f"session {session.id!r} holds no messages with ids {sorted(set(missing))!r}"
            )
        if first is not None:  # what the model sees changed: replay the index from there
            history = history.shown_or_hidden(conversation, first)
        return derive_session(session, conversation=conversation, index=history)


class UpdateData(Effect, frozen=True, gc=False, tag="update_data"):
    """Set fields of the application data.

    ``changes`` maps field names to values in their JSON form (what decoding
    JSON gives: lists, not tuples); build one with :meth:`set`. Applying
    converts the merged fields back to the data type, so the new data is
    validated exactly like decoded data.

    Raises:
        EffectError: a name is not a field of the data type, or a value does
            not validate.
    """

    changes: dict[str, Any]

    def __post_init__(self) -> None:
        if not (type(self.changes) is dict and str_keys(self.changes)):
            check_dict("UpdateData", "changes", self.changes)

    @classmethod
    def set(cls, **changes: Any) -> UpdateData:
        """Build the effect from field values of any msgspec-supported type.

        The values are normalised to exactly what JSON gives back (tuples become
        lists, ...), so the effect equals its own stored copy.
        """
        encoded = msgspec.json.encode(changes, enc_hook=Conversation.enc_hook)  # a Conversation too
        return cls(changes=msgspec.json.decode(encoded))

    def apply(self, session: Session[Any]) -> Session[Any]:
        data = session.data
        data_type = type(data)
        # Changes use Python field names; the encoded form may rename fields.
        encoded_names = {f.name: f.encode_name for f in msgspec.structs.fields(data_type)}
        unknown = sorted(set(self.changes) - set(encoded_names))
        if unknown:
            raise EffectError(
                f"{data_type.__name__} of session {session.id!r} has no fields {unknown!r}"
            )
        merged = {
            **msgspec.to_builtins(data),
            **{encoded_names[name]: value for name, value in self.changes.items()},
        }
        try:
            new_data = msgspec.convert(merged, data_type)
        except msgspec.ValidationError as exc:
            raise EffectError(
                f"update of {data_type.__name__} in session {session.id!r} does not validate: {exc}"
            ) from exc
        return derive_session(session, data=new_data)


def apply_effects(session: S, effects: Iterable[Effect]) -> S:
    """Apply ``effects`` in order; the revision is left as it is. Pure."""
    for effect in effects:
        session = effect.apply(session)  # type: ignore[assignment]  # apply keeps the type
    return session


def apply_batch(session: S, effects: Iterable[Effect]) -> S:
    """Apply one batch: the effects in order, then ``revision + 1``. Pure.

    Raises whatever an effect raises (usually :class:`EffectError`); the input
    session is unchanged, so a failed batch changes nothing.
    """
    applied: Session[Any] = session
    last: Effect | None = None
    for last in effects:
        applied = last.apply(applied)
    if type(last) in _FRESH:
        # The last effect is a kernel effect: it returned a session of its own, built by
        # ``derive_session`` and held by no one else yet, so the revision is set on it
        # rather than on a second copy (one copy per batch, not two).
        msgspec.structs.force_setattr(applied, "revision", session.revision + 1)
        return applied  # type: ignore[return-value]  # apply keeps the type
    return derive_session(applied, revision=session.revision + 1)  # type: ignore[return-value]


_FRESH: frozenset[type[Effect]] = frozenset(
    (AppendMessage, Annotate, ReplaceConversation, SetVisibility, UpdateData)
)
"""The kernel effects, whose ``apply`` always returns a new session (never its argument
nor one kept elsewhere): exactly these types, not subclasses (which may override ``apply``)."""
