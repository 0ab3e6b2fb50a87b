"""The session: the one value every decision is made from.

A :class:`Session` is immutable. Steps never mutate one; they return effects,
and applying effects (a pure function, see :class:`stepmachine.Effect`)
produces the next session value. The store bumps ``revision`` once per applied
batch.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec

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
