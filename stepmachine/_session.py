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
``isinstance`` calls; the conversation's items are checked once per tuple: a
session built from a conversation just checked (``msgspec.structs.replace``
with other fields) or built by one of the kernel effects from checked parts
skips the O(n) check, so applying an effect stays cheap.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec

from ._checks import _CHECKED, check_str, fail, tuple_of, vouch
from ._messages import Message

__all__ = ["NoData", "Session"]


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
        revision = self.revision
        if (type(revision) is not int or revision < 0) and (
            not isinstance(revision, int) or isinstance(revision, bool) or revision < 0
        ):
            fail("Session", "revision", "int >= 0", revision)
        conversation = self.conversation
        if type(conversation) is not tuple or _CHECKED.get(id(conversation)) is not conversation:
            owner = "Session"
            vouch(tuple_of(owner, "conversation", conversation, Message, "Message", target=self))
        if not isinstance(self.data, msgspec.Struct):
            fail("Session", "data", "a msgspec Struct (NoData() for none)", self.data)

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
