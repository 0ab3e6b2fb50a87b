"""The session: the one value every decision is made from.

A :class:`Session` is immutable. Steps never mutate one; they return effects,
and applying effects (a pure function, see :class:`stepmachine.Effect`)
produces the next session value. The store bumps ``revision`` once per applied
batch.

A session checks its fields when built (directly, by ``store.create``, by
``msgspec.structs.replace`` or by decoding): ``id`` a str, ``revision`` a
non-negative int, ``conversation`` a tuple (a list is converted) of
:class:`Message`, ``data`` a msgspec Struct. A wrong value raises
:class:`~stepmachine.InvalidFieldError` naming the field. The checks are
``isinstance`` calls (the conversation's items at C speed). The kernel's
effects build the next session with :func:`rebuilt`, which checks only the
fields it is given and not the messages again (each was checked when it was
built), so applying an effect adds no O(n) check. Nothing outside a session
remembers which conversations were checked (invariant 1: state is the session).
"""

from __future__ import annotations

import copy
from typing import Any, Generic, TypeVar

import msgspec

from ._checks import check_str, fail, tuple_of
from ._messages import Message

__all__ = ["NoData", "Session", "rebuilt"]


class NoData(msgspec.Struct, frozen=True):
    """Application data for applications that keep none."""


D = TypeVar("D", bound=msgspec.Struct)


class Session(msgspec.Struct, Generic[D], frozen=True):
    """What the machine loads each cycle.

    Attributes:
        id: the session id.
        revision: monotonic; 0 when created, +1 for every applied batch.
        conversation: the messages, oldest first, hidden ones included.
        data: application data, a msgspec Struct the application defines.
    """

    id: str
    revision: int
    conversation: tuple[Message, ...]
    data: D

    def __post_init__(self) -> None:
        if type(self.id) is not str:
            check_str("Session", "id", self.id)
        _check_revision(self.revision)
        tuple_of("Session", "conversation", self.conversation, Message, "Message", target=self)
        _check_data(self.data)

    def message(self, message_id: str) -> Message | None:
        """The message with this id, or ``None``."""
        for message in self.conversation:
            if message.id == message_id:
                return message
        return None

    @property
    def visible_to_model(self) -> tuple[Message, ...]:
        """The messages a model request is built from."""
        return tuple(m for m in self.conversation if m.visible_to_model)


def _check_revision(revision: object) -> None:
    if (type(revision) is not int or revision < 0) and (
        not isinstance(revision, int) or isinstance(revision, bool) or revision < 0
    ):
        fail("Session", "revision", "int >= 0", revision)


def _check_data(data: object) -> None:
    if not isinstance(data, msgspec.Struct):
        fail("Session", "data", "a msgspec Struct (NoData() for none)", data)


_KEEP: Any = object()


S = TypeVar("S", bound=Session[Any])


def rebuilt(
    session: S,
    *,
    conversation: tuple[Message, ...] = _KEEP,
    revision: int = _KEEP,
    data: msgspec.Struct = _KEEP,
) -> S:
    """``session`` with the given fields replaced, for the kernel's effects.

    Unlike ``msgspec.structs.replace`` it does not check every message of
    ``conversation`` again: callers pass a tuple made of messages of a session
    (checked when that session was built) and messages checked when they
    were built (a :class:`Message` checks its fields on construction, and the
    effects that carry messages check they are messages). ``revision`` and
    ``data`` are checked as :class:`Session` checks them; ``conversation``
    must be a tuple.

    Raises:
        InvalidFieldError: a given field has the wrong type.
    """
    new = copy.copy(session)  # msgspec copies a Struct without running __post_init__
    if conversation is not _KEEP:
        if type(conversation) is not tuple:
            fail("Session", "conversation", "a tuple of Message", conversation)
        msgspec.structs.force_setattr(new, "conversation", conversation)
    if revision is not _KEEP:
        _check_revision(revision)
        msgspec.structs.force_setattr(new, "revision", revision)
    if data is not _KEEP:
        _check_data(data)
        msgspec.structs.force_setattr(new, "data", data)
    return new
