"""The history index: what steps ask of a conversation, kept up to date per effect.

Every cycle several steps ask the same questions of the session: which tool
calls are open, where a call or a message is, whether a call id repeats,
whether the history is valid (valid history), whether a request must reorder
tool results. Answering by rescanning the conversation costs O(history) per
question; a :class:`HistoryIndex` answers each in O(1) (or O(answer)).

The index is **derived data**: never stored, never encoded by the codec, never
compared (sessions are equal when their fields are). A session builds it from
its conversation the first time it is asked (after ``Session(...)``,
``msgspec.structs.replace``, decoding, loading) and the kernel effects derive
the next session's index from the previous one in their pure ``apply``:

* :meth:`HistoryIndex.appended` (``AppendMessage``) costs O(parts of the new
  message): the large tables (message id -> position, call id -> positions,
  first visible call / result per call id) are append-only dicts shared by the
  sessions of one line of history. An entry at position ``p`` belongs to every
  session of that line whose conversation is longer than ``p``; a session of
  length ``n`` ignores entries at ``n`` or later. Appending to the newest
  session of the line extends the tables in place; appending to an older one
  the very message the line already holds there (the machine and the store
  applying the same batch) shares them unchanged; appending anything else
  starts a new line (copies of the tables, O(n) at C speed).
* :meth:`HistoryIndex.annotated` (``Annotate``) is O(1): notes change no table,
  only the open call it annotates is replaced; :meth:`HistoryIndex.noted_at`
  (an ``Annotate`` opening a namespace on a message or call) is O(namespaces):
  :meth:`HistoryIndex.noted` lists, per namespace, where notes are (a linked
  list shared by later sessions), so an operation reads only its own records.
  When they were noted is not stored: a built index lists them in message
  order, except that notes holding an open wait (an unsatisfied wait marker
  of :class:`~stepmachine.operations.ExternalEvents`) come first, and an
  ``Annotate`` that leaves a message with one lists it again, first
  (:meth:`HistoryIndex.replaced`): a reader stopping at a cursor sees every
  open wait, loaded or not.
* ``SetVisibility`` (:meth:`HistoryIndex.shown_or_hidden`) replays the
  messages from the first one it changes, from the latest *checkpoint* (every
  :data:`CHECKPOINT_EVERY` messages an index keeps the index it derives from,
  a chain shared by later sessions) on a new line of tables: O(messages after
  the first change) read, plus the tables copied at C speed, as a branch.
  Hiding the latest reply (a retry) reads a few messages, not the history.
* ``ReplaceConversation`` rebuilds (O(n)); it is rare (repairs, compaction).
* Once a message is hidden, the index also carries the visible messages
  (:attr:`HistoryIndex.visible`, a :class:`~stepmachine.Conversation`
  sharing structure), extended by :meth:`~HistoryIndex.appended` and updated
  by :meth:`~HistoryIndex.replaced` in O(1), through a per-line table of each
  position's place among the visible messages.

The small per-session state (open calls, repeated call ids, problem counters)
is copied per change, O(open calls). ``tests/test_session_index.py`` checks
every view equal to a full rescan over random effect sequences.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Final, TypeAlias

from ._conversation import CHUNK, Conversation
from ._media import AudioPart, DocumentPart, ImagePart
from ._media_tokens import media_tokens
from ._messages import Message, ReasoningPart, TextPart, ToolCallPart, ToolResultPart

__all__ = ["HistoryIndex", "estimate_tokens", "is_empty_assistant", "message_tokens"]

_Key = tuple[str, bool, tuple[str, ...], tuple[str, ...]]
_Open = dict[str, tuple[int, int, ToolCallPart]]
_EMPTY_OPEN: Final[_Open] = {}
_NO_IDS: Final[frozenset[str]] = frozenset()
# Where notes of one namespace are: (message position, call id or None, the entry noted before).
_Noted: TypeAlias = "tuple[int, str | None, _Noted | None]"
_NO_NOTES: Final[dict[str, _Noted]] = {}
CHECKPOINT_EVERY: Final = CHUNK
"""Every this many messages an index keeps the one it derives from (``SetVisibility``)."""


def _key(message: Message) -> _Key:
    """What the shared tables record of a message: id, visibility, call ids, result ids."""
    calls: list[str] = []
    results: list[str] = []
    for part in message.parts:
        if isinstance(part, ToolCallPart):
            calls.append(part.call_id)
        elif isinstance(part, ToolResultPart):
            results.append(part.call_id)
    return (message.id, message.visible_to_model, tuple(calls), tuple(results))


def message_tokens(message: Message) -> int:
    """A cheap token estimate of one message: 4 plus a quarter of its characters,
    plus the estimate of each image, document and audio part.

    Counts text, reasoning text, tool names and raw arguments, and tool result
    content (rounded up); a media part counts
    :func:`~stepmachine.media_tokens` (an image by its size read
    from its header, the largest of Anthropic's, OpenAI's and Gemini's
    published formulas; a PDF by pages; audio by duration), never by the
    length of its bytes. O(size of the message) at most.
    """
    chars = 0
    media = 0
    for part in message.parts:
        if isinstance(part, TextPart | ReasoningPart):
            chars += len(part.text)
        elif isinstance(part, ToolCallPart):
            chars += len(part.name) + len(part.raw_arguments)
        elif isinstance(part, ToolResultPart):
            chars += len(part.content)
        elif isinstance(part, ImagePart | DocumentPart | AudioPart):
            media += media_tokens(part)
    return 4 + (chars + 3) // 4 + media


def estimate_tokens(messages: Sequence[Message]) -> int:
    """A cheap token estimate: :func:`message_tokens` summed over ``messages``.

    A session keeps this sum for its visible messages
    (:attr:`HistoryIndex.estimated_tokens`), so reading it costs nothing.
    """
    return sum(map(message_tokens, messages))


def is_empty_assistant(message: Message) -> bool:
    """An assistant message with no text, reasoning or tool call (providers reject it)."""
    if message.role != "assistant":
        return False
    for part in message.parts:
        if isinstance(part, TextPart) and part.text.strip():
            return False
        if isinstance(part, ReasoningPart) and (part.text.strip() or part.provider_data):
            return False
        if not isinstance(part, TextPart | ReasoningPart):
            return False  # a tool call, or a kind of part added later (images, files)
    return True


def _open_waits(message: Message) -> list[str]:
    """The namespaces in which ``message``'s notes hold an open wait: a wait marker
    (key ``"awaiting"``) that nothing satisfied yet (no ``"satisfied_by"``)."""
    return [
        namespace
        for namespace, value in message.notes.items()
        if isinstance(value, dict) and "awaiting" in value and not value.get("satisfied_by")
    ]


def _waits_first(noted: dict[str, _Noted], waits: dict[str, set[int]]) -> dict[str, _Noted]:
    """``noted`` with the messages at the positions in ``waits[namespace]`` listed first."""
    noted = dict(noted)
    for namespace, positions in waits.items():
        entries: list[tuple[int, str | None]] = []  # newest first
        entry = noted.get(namespace)
        while entry is not None:
            entries.append((entry[0], entry[1]))
            entry = entry[2]
        first = [e for e in entries if e[1] is None and e[0] in positions]
        rest = [e for e in entries if not (e[1] is None and e[0] in positions)]
        rebuilt: _Noted | None = None
        for position, call_id in reversed(first + rest):
            rebuilt = (position, call_id, rebuilt)
        if rebuilt is not None:
            noted[namespace] = rebuilt
    return noted


def _noted_with(noted: dict[str, _Noted], message: Message, n: int) -> dict[str, _Noted]:
    """``noted`` plus the notes of ``message``, appended at position ``n``."""
    targets: dict[tuple[str, str | None], None] = dict.fromkeys((ns, None) for ns in message.notes)
    for part in message.parts:
        if isinstance(part, ToolCallPart) and part.notes:
            targets.update(dict.fromkeys((ns, part.call_id) for ns in part.notes))
    if not targets:
        return noted
    noted = dict(noted)
    for namespace, call_id in targets:
        noted[namespace] = (n, call_id, noted.get(namespace))
    return noted


class _Line:
    """Append-only tables shared by the sessions of one line of history.

    Values are conversation positions; see the module docstring for who may
    extend them and how a session of length ``n`` reads them (entries < n).
    """

    __slots__ = (
        "call_positions",
        "first_call",
        "first_result",
        "keys",
        "message_position",
        "visible_at",
    )

    def __init__(self) -> None:
        self.keys: list[_Key] = []  # position -> key of the message there
        self.message_position: dict[str, int] = {}  # message id -> position
        self.call_positions: dict[str, tuple[int, ...]] = {}  # call id -> positions (all)
        self.first_call: dict[str, int] = {}  # call id -> first visible position holding it
        self.first_result: dict[str, int] = {}  # call id -> first visible position answering it
        self.visible_at: list[int] = []  # position -> its place among the visible messages, or -1

    def extend(self, position: int, key: _Key, visible_at: int) -> None:
        """Record the message ``key`` at ``position`` (== ``len(self.keys)``), the
        ``visible_at``-th visible message (-1: hidden)."""
        message_id, visible, calls, results = key
        self.keys.append(key)
        self.visible_at.append(visible_at)
        self.message_position.setdefault(message_id, position)  # the first, like Session.message
        for call_id in calls:
            positions = self.call_positions.get(call_id, ())
            if not positions or positions[-1] != position:
                self.call_positions[call_id] = (
                    *positions,
                    position,
                )  # tuples: never shared mutably
        if visible:
            for call_id in calls:
                self.first_call.setdefault(call_id, position)
            for call_id in results:
                self.first_result.setdefault(call_id, position)

    def prefix(self, length: int) -> _Line:
        """A new line holding the first ``length`` messages of this one.

        O(n) dict copies at C speed plus O(messages after ``length``) to drop
        their entries: the cost of a branch (appending to an older session).
        """
        line = _Line()
        dropped = self.keys[length:]
        line.keys = self.keys[:length]
        line.visible_at = self.visible_at[:length]
        line.message_position = self.message_position.copy()
        line.call_positions = self.call_positions.copy()
        line.first_call = self.first_call.copy()
        line.first_result = self.first_result.copy()
        for message_id, _, calls, results in dropped:
            if line.message_position.get(message_id, -1) >= length:
                del line.message_position[message_id]
            for call_id in calls:
                kept = tuple(p for p in line.call_positions.get(call_id, ()) if p < length)
                if kept:
                    line.call_positions[call_id] = kept
                else:
                    line.call_positions.pop(call_id, None)
            for table in (line.first_call, line.first_result):
                for call_id in (*calls, *results):
                    if table.get(call_id, -1) >= length:
                        del table[call_id]
        return line


_NO_LINE: Final = _Line()
"""The line of a checkpoint (never read: a replay takes the line of the index it replays for)."""


class HistoryIndex:
    """Answers about one conversation (see the module docstring). Immutable once built.

    Read one as :attr:`Session.history <stepmachine.Session.history>`; never
    build or keep one apart from its session (it is derived data).

    Attributes:
        length: the number of messages of the conversation it indexes.
        repeated: call ids held by more than one visible call.
        hidden: how many messages are hidden from the model.
        in_order: whether :func:`~stepmachine.request_order` keeps the visible
            messages as they are (no tool message has to move).
        last_visible: position of the last message visible to the model (-1: none).
        last_assistant: position of the last assistant message, hidden or not (-1: none).
        empty_assistants: positions of the visible empty assistant messages
            (:func:`is_empty_assistant`).
        estimated_tokens: :func:`estimate_tokens` of the messages visible to the model.
    """

    __slots__ = (
        "_bad",
        "_checkpoint",
        "_line",
        "_noted",
        "_open",
        "_tail",
        "_unanswered",
        "_visible",
        "empty_assistants",
        "estimated_tokens",
        "hidden",
        "in_order",
        "last_assistant",
        "last_visible",
        "length",
        "repeated",
    )

    def __init__(self) -> None:
        """The index of an empty conversation."""
        self._line = _Line()
        self.length = 0
        self._open: _Open = _EMPTY_OPEN
        self.repeated: frozenset[str] = _NO_IDS
        self._bad = 0  # problems other than calls without results (history_problems)
        self._unanswered = 0  # visible call ids that no visible result answers
        self.in_order = True
        self._tail = -1  # position of the request-order group the last visible message is in
        self.hidden = 0
        self.last_visible = -1  # position of the last message visible to the model
        self.last_assistant = -1  # position of the last assistant message, hidden or not
        self.empty_assistants: tuple[int, ...] = ()  # visible, no text/reasoning/calls
        self._noted: dict[str, _Noted] = _NO_NOTES  # namespace -> newest entry (copy on write)
        self.estimated_tokens = 0  # estimate_tokens of the visible messages
        self._visible: Conversation | None = None  # the visible messages, when some are hidden
        # The index this one derives from at the latest multiple of CHECKPOINT_EVERY messages
        # below its length (a chain down to the empty index), without its tables, notes and
        # visible messages: where a visibility change replays from. The parts of its open
        # calls may be out of date (annotated since).
        self._checkpoint: HistoryIndex | None = None

    def _clone(self) -> HistoryIndex:
        new = HistoryIndex.__new__(HistoryIndex)
        new._line = self._line
        new.length = self.length
        new._open = self._open
        new.repeated = self.repeated
        new._bad = self._bad
        new._unanswered = self._unanswered
        new.in_order = self.in_order
        new._tail = self._tail
        new.hidden = self.hidden
        new.last_visible = self.last_visible
        new.last_assistant = self.last_assistant
        new.empty_assistants = self.empty_assistants
        new._noted = self._noted
        new.estimated_tokens = self.estimated_tokens
        new._visible = self._visible
        new._checkpoint = self._checkpoint
        return new

    def _as_checkpoint(self) -> HistoryIndex:
        """This index without what a replay takes from the index it replays for (the
        tables, the notes, the visible messages): a checkpoint keeps no line alive."""
        checkpoint = self._clone()
        checkpoint._line = _NO_LINE
        checkpoint._noted = _NO_NOTES
        checkpoint._visible = None
        return checkpoint

    # -- building -----------------------------------------------------------------

    @classmethod
    def build(cls, conversation: Sequence[Message]) -> HistoryIndex:
        """Index ``conversation`` from scratch: O(n)."""
        index = cls()
        waits: dict[str, set[int]] = {}
        for position, message in enumerate(conversation):
            index = index._extended(message, _key(message), write=True)
            if message.notes:
                for namespace in _open_waits(message):
                    waits.setdefault(namespace, set()).add(position)
        if waits:  # when they were noted is not stored: open waits first (see noted())
            index._noted = _waits_first(index._noted, waits)
        if index.hidden:
            index._visible = Conversation(m for m in conversation if m.visible_to_model)
        return index

    def appended(self, message: Message, conversation: Conversation) -> HistoryIndex:
        """The index of ``conversation`` (the one this index indexes) with ``message`` appended.

        O(parts of ``message``) unless this session is not the newest of its
        line and the line holds another message at this position: then the
        tables are copied for a new line (dict copies, O(n) at C speed).
        The visible messages (:attr:`visible`) are shared and extended, O(1).
        """
        key = _key(message)
        line, n = self._line, self.length
        if len(line.keys) == n:
            new = self._extended(message, key, write=True)
        elif line.keys[n] == key:
            new = self._extended(message, key, write=False)
        else:
            branch = self._clone()  # a branch: this session's view of the line, its own line
            branch._line = line.prefix(n)
            new = branch._extended(message, key, write=True)
        if self._visible is not None:
            if key[1]:
                new._visible = self._visible.appended(message)
        elif not key[1]:
            new._visible = conversation  # the first hidden message: all before it are visible
        return new

    def replaced(self, position: int, message: Message) -> HistoryIndex:
        """The index after ``Annotate`` replaced the message at ``position`` with ``message``
        (the same message with other notes). O(namespaces of ``message``): :attr:`visible`
        changes, and a note holding an open wait is listed first again (:meth:`noted`)."""
        new = self
        if message.notes:
            for namespace in _open_waits(message):
                head = new._noted.get(namespace)
                if head is not None and head[0] == position and head[1] is None:
                    continue  # listed first already
                if new is self:
                    new = self._clone()
                    new._noted = dict(self._noted)
                new._noted[namespace] = (position, None, head)
        if self._visible is None:
            return new
        at = self._line.visible_at[position]
        if at < 0:
            return new
        if new is self:
            new = self._clone()
        new._visible = self._visible.replaced(at, message)
        return new

    def annotated(self, position: int, part_position: int, part: ToolCallPart) -> HistoryIndex:
        """The index after ``Annotate`` replaced the call at ``part_position`` of the message
        at ``position`` with ``part`` (new notes). O(open calls).

        Notes change no table; if that call is open, the open calls hand out ``part``.
        """
        entry = self._open.get(part.call_id)
        if entry is None or entry[0] != position or entry[1] != part_position:
            return self
        new = self._clone()
        new._open = dict(self._open)
        new._open[part.call_id] = (position, part_position, part)
        return new

    def noted_at(self, position: int, call_id: str | None, namespace: str) -> HistoryIndex:
        """The index after ``Annotate`` gave the message at ``position`` (or its call
        ``call_id``) notes in a ``namespace`` it had none in. O(namespaces)."""
        new = self._clone()
        new._noted = dict(self._noted)
        new._noted[namespace] = (position, call_id, self._noted.get(namespace))
        return new

    def shown_or_hidden(self, conversation: Conversation, first: int) -> HistoryIndex:
        """The index of ``conversation`` after ``SetVisibility``: the conversation this
        index indexes with the visibility of messages at ``first`` or later changed.

        Replays the messages from the latest checkpoint at or before ``first``
        (every :data:`CHECKPOINT_EVERY` messages) on a new line of tables:
        O(``CHECKPOINT_EVERY`` + messages after ``first``) messages read, plus
        a copy of the line's tables (O(n) at C speed, as a branch costs). Notes
        are taken from this index (they do not depend on visibility).
        """
        checkpoint = self._checkpoint
        while checkpoint is not None and checkpoint.length > first:
            checkpoint = checkpoint._checkpoint
        if checkpoint is None or len(conversation) != self.length:
            return HistoryIndex.build(conversation)
        start = checkpoint.length
        index = checkpoint._clone()
        index._line = self._line.prefix(start) if start else _Line()
        if checkpoint.hidden:  # the messages before ``start`` are as they are here
            assert self._visible is not None  # some are hidden here too
            index._visible = self._visible.prefix(start - checkpoint.hidden)
        else:
            index._visible = None
        for position in range(start, self.length):
            message = conversation[position]
            key = _key(message)
            new = index._extended(message, key, write=True)
            if index._visible is not None:
                if key[1]:
                    new._visible = index._visible.appended(message)
            elif not key[1]:
                new._visible = conversation.prefix(position)  # all before it are visible
            index = new
        index._noted = self._noted
        if index._open:  # calls opened before ``start``: their parts as annotated since
            refreshed: _Open = {}
            for call_id, (at, part_at, _) in index._open.items():
                part = conversation[at].parts[part_at]
                assert isinstance(part, ToolCallPart)  # the same message, other notes at most
                refreshed[call_id] = (at, part_at, part)
            index._open = refreshed
        return index

    def _extended(self, message: Message, key: _Key, *, write: bool) -> HistoryIndex:
        """This index plus ``message`` at position ``self.length``.

        Reads the line's tables as of this index (entries < n) and, with
        ``write``, extends them afterwards. Mirrors, part by part, what
        :func:`~stepmachine.history_problems`, ``open_tool_calls`` and
        :func:`~stepmachine.request_order` compute over the whole conversation.
        """
        line, n = self._line, self.length
        _, visible, call_ids, result_ids = key
        new = self._clone()
        new.length = n + 1
        if not n % CHECKPOINT_EVERY:
            new._checkpoint = self._as_checkpoint()
        if message.notes or key[2]:
            new._noted = _noted_with(self._noted, message, n)
        if message.role == "assistant":
            new.last_assistant = n
        if not visible:
            if write:
                line.extend(n, key, -1)
            new.hidden += 1
            return new
        new.last_visible = n
        new.estimated_tokens += message_tokens(message)
        if message.role == "assistant" and is_empty_assistant(message):
            new.empty_assistants = (*self.empty_assistants, n)
        open_calls = self._open
        repeated = self.repeated
        bad, unanswered, in_order, tail = self._bad, self._unanswered, self.in_order, n
        if call_ids or result_ids:
            first_call, first_result = line.first_call, line.first_result
            seen: set[str] = set()  # visible calls seen in this message so far
            answered: set[str] = set()  # visible results seen in this message so far
            # A call id was seen (answered) when a visible call (result) before this
            # message holds it, or one earlier in this message: read inline below.
            if message.role == "tool" and result_ids:
                owners = set()
                for call_id in result_ids:
                    position = first_call.get(call_id)
                    owners.add(position if position is not None and position < n else None)
                if len(owners) == 1:
                    (owner,) = owners
                    if owner is not None:  # moved right after its call's message in requests
                        in_order = in_order and self._tail == owner
                        tail = owner
            open_calls = dict(open_calls)
            new_repeats: set[str] = set()
            not_assistant = message.role != "assistant"
            for position, part in enumerate(message.parts):
                if isinstance(part, ToolCallPart):
                    call_id = part.call_id
                    if not_assistant:
                        bad += 1
                    at = first_call.get(call_id)
                    if (at is not None and at < n) or call_id in seen:
                        bad += 1
                        new_repeats.add(call_id)
                    else:
                        seen.add(call_id)
                        at = first_result.get(call_id)
                        if not ((at is not None and at < n) or call_id in answered):
                            unanswered += 1
                    open_calls.setdefault(call_id, (n, position, part))
                elif isinstance(part, ToolResultPart):
                    call_id = part.call_id
                    at = first_call.get(call_id)
                    was_seen = (at is not None and at < n) or call_id in seen
                    at = first_result.get(call_id)
                    was_answered = (at is not None and at < n) or call_id in answered
                    if not was_seen or was_answered:
                        bad += 1
                    if not was_answered:
                        answered.add(call_id)
                        if was_seen:
                            unanswered -= 1
                    open_calls.pop(call_id, None)
            if new_repeats - repeated:
                repeated = repeated | new_repeats
        if write:
            line.extend(n, key, n - self.hidden)
        new._open, new.repeated, new._bad, new._unanswered = open_calls, repeated, bad, unanswered
        new.in_order, new._tail = in_order, tail
        return new

    # -- answers ------------------------------------------------------------------

    def noted(self, namespace: str) -> Iterator[tuple[int, str | None]]:
        """Every message and tool call with notes in ``namespace``, hidden ones included.

        Yields ``(message position, call id)`` (``None`` for the message's own
        notes), the most recently noted first: the messages appended with such
        notes in the order appended, and the targets of ``Annotate`` effects
        that opened the namespace there, or left an open wait in it (listed
        again: a position can come more than once). An index built from a
        stored conversation cannot know when its notes were set: it lists the
        messages whose note holds an open wait first, then all others in
        message order, newest first. O(1) per item: a step that looks for
        its own records reads only where they are.
        """
        entry = self._noted.get(namespace)
        while entry is not None:
            yield entry[0], entry[1]
            entry = entry[2]

    is_empty_assistant = staticmethod(is_empty_assistant)

    @property
    def visible(self) -> Conversation | None:
        """The messages visible to the model, oldest first, when some are hidden; else ``None``
        (they are the whole conversation). Kept up to date per effect, like the rest: a
        request after a compaction (which hides what it summarised) does not filter the
        whole history."""
        return self._visible

    @property
    def valid(self) -> bool:
        """Whether the visible conversation is a valid history (``history_problems`` is empty)."""
        return self._bad == 0 and self._unanswered == 0

    @property
    def sound(self) -> bool:
        """Whether the only problems (if any) are calls still waiting for a result.

        No call outside an assistant message, no repeated call id, no result
        before or without its call, no second result.
        """
        return self._bad == 0

    @property
    def has_open_calls(self) -> bool:
        """Whether any visible tool call has no result yet."""
        return bool(self._open)

    def open_calls(self) -> list[ToolCallPart]:
        """The visible tool calls without a result, oldest first (a new list)."""
        return [entry[2] for entry in self._open.values()]

    def open_call_positions(self) -> list[tuple[int, ToolCallPart]]:
        """Like :meth:`open_calls`, with the position of the message holding each call."""
        return [(entry[0], entry[2]) for entry in self._open.values()]

    def message_position(self, message_id: str) -> int | None:
        """The position of the message with this id, or ``None``."""
        position = self._line.message_position.get(message_id)
        if position is None or position >= self.length:
            return None
        return position

    def first_visible_call(self, call_id: str) -> int | None:
        """The position of the first message visible to the model holding this call id."""
        position = self._line.first_call.get(call_id)
        if position is None or position >= self.length:
            return None
        return position

    def call_position(self, call_id: str) -> int | None:
        """The position of the latest message (hidden ones included) holding this call id."""
        positions = self._line.call_positions.get(call_id)
        if positions is None:
            return None
        n = self.length
        for position in reversed(positions):
            if position < n:
                return position
        return None
