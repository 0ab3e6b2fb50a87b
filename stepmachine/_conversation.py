"""``Conversation``: the session's messages, an immutable sequence that shares structure.

A session's conversation only ever changes by a new value (effects are pure,
sessions immutable). With a plain tuple each new value is a copy: appending
one message to a conversation of ``n`` costs O(n), and so does freeing the old
one, which made a step at turn 2,000 cost many times a step at turn 20
(constant cost per step). A :class:`Conversation` is a tuple of *chunks* of at most
:data:`CHUNK` messages: every chunk but the last is full, and chunks are
tuples shared, never changed, by every conversation derived from them.

* :meth:`Conversation.appended` copies the last chunk (at most ``CHUNK``
  items) and, once every ``CHUNK`` appends, the tuple of chunks (``n / CHUNK``
  items): constant for any practical length (a million messages: a copy of
  15,625 pointers every 64th append).
* :meth:`Conversation.replaced` (``Annotate``, ``SetVisibility``) copies one
  chunk and the tuple of chunks.
* Indexing is two tuple lookups; iteration walks the chunks; ``len`` is stored.

It is a read-only :class:`~collections.abc.Sequence` of
:class:`~stepmachine.Message`: index it, slice it (a slice is a ``tuple``),
iterate it, take its ``len``, compare it with ``==`` to any tuple, list or
conversation holding the same messages in the same order, hash it (as the
tuple of its messages hashes), and ``+`` a tuple or list of messages to it
(a new conversation). It is not a ``tuple`` (``isinstance(c, tuple)`` is
false; ``tuple(c)`` makes one).

msgspec does not know the type: the :class:`~stepmachine.Codec` encodes and
decodes sessions (a conversation is stored as a JSON array, as before), and
:meth:`Conversation.enc_hook` lets
``msgspec.json.encode(session, enc_hook=Conversation.enc_hook)`` encode one
directly (``msgspec.to_builtins`` takes the same hook); :meth:`Conversation.dec_hook`
decodes it back (``msgspec.json.decode(data, type=Session[T],
dec_hook=Conversation.dec_hook)``, ``msgspec.convert``). Plain msgspec cannot
encode it: msgspec encodes a list or tuple (or a subclass) from its own storage,
so a type it encodes without a hook holds every message in one array, and
deriving one is a copy of the whole history (O(n) per appended message, the
cost this type removes).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from typing import Any, Final, overload

import msgspec

from ._messages import Message

__all__ = ["CHUNK", "Conversation", "dec_hook", "enc_hook"]

CHUNK: Final = 64
"""Messages per chunk (a power of two: positions split with a shift and a mask)."""

_SHIFT: Final = CHUNK.bit_length() - 1
_MASK: Final = CHUNK - 1
_NO_CHUNKS: Final[tuple[tuple[Message, ...], ...]] = ()


class Conversation(Sequence[Message]):
    """An immutable sequence of messages sharing structure with those it derives from.

    Build one with ``Conversation(messages)`` (any iterable of messages; the
    items are not checked here: :class:`~stepmachine.Session` checks them) or
    derive one with :meth:`appended` / :meth:`replaced`. See the module docs.
    """

    __slots__ = ("_chunks", "_length")

    _chunks: tuple[tuple[Message, ...], ...]
    _length: int

    def __init__(self, messages: Iterable[Message] = ()) -> None:
        items = messages if type(messages) is tuple else tuple(messages)
        self._chunks = tuple(items[i : i + CHUNK] for i in range(0, len(items), CHUNK))
        self._length = len(items)

    @classmethod
    def _of(cls, chunks: tuple[tuple[Message, ...], ...], length: int) -> Conversation:
        new = cls.__new__(cls)
        new._chunks = chunks
        new._length = length
        return new

    # -- deriving -------------------------------------------------------------------

    def appended(self, message: Message) -> Conversation:
        """This conversation with ``message`` at the end. O(CHUNK), see the module docs."""
        chunks, n = self._chunks, self._length
        if n & _MASK:  # the last chunk has room
            return Conversation._of((*chunks[:-1], (*chunks[-1], message)), n + 1)
        return Conversation._of((*chunks, (message,)), n + 1)

    def replaced(self, position: int, message: Message) -> Conversation:
        """This conversation with the message at ``position`` (>= 0) replaced. O(CHUNK)."""
        if not 0 <= position < self._length:
            raise IndexError(f"position {position} is outside 0..{self._length - 1}")
        chunks = self._chunks
        which, at = position >> _SHIFT, position & _MASK
        chunk = chunks[which]
        new_chunk = (*chunk[:at], message, *chunk[at + 1 :])
        return Conversation._of((*chunks[:which], new_chunk, *chunks[which + 1 :]), self._length)

    def prefix(self, length: int) -> Conversation:
        """The first ``length`` messages (0 <= ``length`` <= ``len(self)``), sharing this
        conversation's full chunks: O(length / CHUNK + CHUNK)."""
        if not 0 <= length <= self._length:
            raise IndexError(f"length {length} is outside 0..{self._length}")
        if length == self._length:
            return self
        chunks = self._chunks
        full, rest = length >> _SHIFT, length & _MASK
        kept = chunks[:full] if not rest else (*chunks[:full], chunks[full][:rest])
        return Conversation._of(kept, length)

    # -- the Sequence protocol --------------------------------------------------------

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> Message: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Message, ...]: ...

    def __getitem__(self, index: int | slice) -> Message | tuple[Message, ...]:
        if isinstance(index, slice):
            return self._slice(index)
        n = self._length
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("conversation index out of range")
        return self._chunks[index >> _SHIFT][index & _MASK]

    def _slice(self, index: slice) -> tuple[Message, ...]:
        """``self[index]`` as a tuple: O(CHUNK + length of the slice)."""
        start, stop, step = index.indices(self._length)
        if step != 1:
            return tuple(self[i] for i in range(start, stop, step))
        if start >= stop:
            return ()
        chunks = self._chunks
        first, last = start >> _SHIFT, (stop - 1) >> _SHIFT
        if first == last:
            return chunks[first][start & _MASK : ((stop - 1) & _MASK) + 1]
        head = chunks[first][start & _MASK :]
        tail = chunks[last][: ((stop - 1) & _MASK) + 1]
        return (*head, *chain.from_iterable(chunks[first + 1 : last]), *tail)

    def __iter__(self) -> Iterator[Message]:
        return chain.from_iterable(self._chunks)

    def __reversed__(self) -> Iterator[Message]:
        for chunk in reversed(self._chunks):
            yield from reversed(chunk)

    def __bool__(self) -> bool:
        return self._length > 0

    def as_tuple(self) -> tuple[Message, ...]:
        """The messages as a tuple (a copy: O(n))."""
        chunks = self._chunks
        if len(chunks) == 1:
            return chunks[0]
        items: list[Message] = []
        for chunk in chunks:  # a C-level extend per chunk: about twice chain's speed
            items += chunk
        return tuple(items)

    # -- values -----------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Conversation):
            if self._chunks is other._chunks:
                return True
            return self._length == other._length and self._chunks == other._chunks
        if isinstance(other, tuple | list):
            return self._length == len(other) and all(
                a == b for a, b in zip(self, other, strict=True)
            )
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.as_tuple())

    def __add__(self, other: Iterable[Message]) -> Conversation:
        if not isinstance(other, Conversation | tuple | list):
            return NotImplemented
        new = self
        for message in other:
            new = new.appended(message)
        return new

    def __radd__(self, other: Sequence[Message]) -> tuple[Message, ...]:
        if not isinstance(other, tuple | list):
            return NotImplemented
        return (*other, *self)

    def __repr__(self) -> str:
        return f"Conversation({self.as_tuple()!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Conversation, (self.as_tuple(),))

    @staticmethod
    def enc_hook(value: object) -> Any:
        """A msgspec ``enc_hook`` that encodes a conversation as the array of its messages.

        ``msgspec.json.encode(session, enc_hook=Conversation.enc_hook)``.
        """
        return enc_hook(value)

    @staticmethod
    def dec_hook(kind: type, value: Any) -> Any:
        """A msgspec ``dec_hook`` that decodes the array of messages into a conversation.

        ``msgspec.json.decode(data, type=Session[T], dec_hook=Conversation.dec_hook)``
        (and ``msgspec.convert`` of the builtins ``msgspec.to_builtins`` made with
        :meth:`enc_hook`). Each message is decoded and checked as
        :class:`~stepmachine.Message`.
        """
        return dec_hook(kind, value)


def enc_hook(value: object) -> Any:
    """A msgspec ``enc_hook`` that encodes a :class:`Conversation` as the array of its messages."""
    if isinstance(value, Conversation):
        return value.as_tuple()
    raise NotImplementedError(f"msgspec cannot encode objects of type {type(value).__name__}")


def dec_hook(kind: type, value: Any) -> Any:
    """A msgspec ``dec_hook`` that decodes an array of messages as a :class:`Conversation`."""
    if kind is Conversation:
        return Conversation(msgspec.convert(value, tuple[Message, ...]))
    raise NotImplementedError(f"msgspec cannot decode objects of type {kind!r}")
