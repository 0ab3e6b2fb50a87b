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
``isinstance`` calls, O(n) for the conversation (at C speed).

The kernel's effects do not pay that per applied effect: they build the next
session with :func:`derive_session`, which copies a session without running
``__post_init__`` and sets the fields that changed. It is only for values
checked where they entered (a :class:`Message` checks itself when built or
decoded, ``AppendMessage`` / ``ReplaceConversation`` check that they hold
messages), so the next session is as checked as the previous one.

Each session carries a :class:`~stepmachine.HistoryIndex` of its
conversation (derived data, outside the fields: not encoded, not compared),
built on first use and handed on by the kernel effects; see
:meth:`Session.history`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec

from ._checks import check_str, fail, tuple_of
from ._conversation import Conversation
from ._index import HistoryIndex
from ._messages import Message

__all__ = ["NoData", "Session", "derive_session"]

_INDEX = "_history_index"  # the key of the index in a session's __dict__


class NoData(msgspec.Struct, frozen=True):
    """Application data for applications that keep none."""


D = TypeVar("D", bound=msgspec.Struct)


class Session(msgspec.Struct, Generic[D], frozen=True, dict=True):
    """What the machine loads each cycle.

    Attributes:
        id: the session id.
        revision: monotonic; 0 when created, +1 for every applied batch.
        conversation: the messages, oldest first, hidden ones included: a
            :class:`~stepmachine.Conversation` (an immutable sequence; give a
            tuple or a list of messages and it is converted).
        data: application data, a msgspec Struct the application defines.
    """

    id: str
    revision: int
    conversation: Conversation
    data: D

    def __post_init__(self) -> None:
        if type(self.id) is not str:
            check_str("Session", "id", self.id)
        revision = self.revision
        if (type(revision) is not int or revision < 0) and (
            not isinstance(revision, int) or isinstance(revision, bool) or revision < 0
        ):
            fail("Session", "revision", "int >= 0", revision)
        conversation: Any = self.conversation
        if type(conversation) is not Conversation:
            items = tuple_of("Session", "conversation", conversation, Message, "Message")
            msgspec.structs.force_setattr(self, "conversation", Conversation(items))
        elif conversation:  # a Conversation is not checked when built: check its messages
            tuple_of("Session", "conversation", conversation.as_tuple(), Message, "Message")
        if not isinstance(self.data, msgspec.Struct):
            fail("Session", "data", "a msgspec Struct (NoData() for none)", self.data)

    @property
    def history(self) -> HistoryIndex:
        """The index of the conversation (open calls, positions, validity). O(1) once built.

        Built from the conversation on first use (O(n)); the kernel effects
        hand the next session an index derived from this one.
        """
        index: HistoryIndex | None = self.__dict__.get(_INDEX)
        if index is None:
            index = HistoryIndex.build(self.conversation)
            self.__dict__[_INDEX] = index
        return index

    def message(self, message_id: str) -> Message | None:
        """The message with this id (the first, if several share it), or ``None``. O(1)."""
        position = self.history.message_position(message_id)
        return None if position is None else self.conversation[position]

    @property
    def visible_to_model(self) -> Sequence[Message]:
        """The messages a model request is built from (the conversation if none is hidden)."""
        visible = self.history.visible  # kept by the index: O(1)
        return self.conversation if visible is None else visible


def derive_session(
    session: Session[Any],
    *,
    conversation: Conversation | None = None,
    index: HistoryIndex | None = None,
    revision: int | None = None,
    data: msgspec.Struct | None = None,
) -> Session[Any]:
    """``session`` with the given fields changed, **without** running its checks. Internal.

    For the kernel's effects and ``apply_batch`` only: every value given must
    already be checked (a conversation made of checked messages, a revision
    that is an int >= 0, data a msgspec Struct), so the result is as valid as
    ``session``. ``index`` is the index of the new conversation; without a new
    conversation the index is kept, without an index it is rebuilt on first use.
    Costs O(1): no O(n) item check, no copy of the conversation.
    """
    new = copy.copy(session)  # msgspec's __copy__: the fields, no __post_init__, no __dict__
    if conversation is not None:
        msgspec.structs.force_setattr(new, "conversation", conversation)
    else:
        index = session.__dict__.get(_INDEX)
    if index is not None:
        new.__dict__[_INDEX] = index
    if revision is not None:
        msgspec.structs.force_setattr(new, "revision", revision)
    if data is not None:
        msgspec.structs.force_setattr(new, "data", data)
    return new
