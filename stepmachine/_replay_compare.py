"""How :func:`~stepmachine.replay` compares a replayed cycle's batches with the stored ones.

Two batches are equal when their effects, as JSON builtins with dict keys
sorted, are equal, leaving out what the runtime rather than a decision
makes:

- the part of an appended message's id that the id source made. The
  sandbox's id source hands out the ids the stored cycle added, then fresh
  ones (a retry that asks again gets those). In a new id, that part is the
  longest id the replay's id source returned found in it; the step's own
  prefix and suffix around it are compared (``f"ack-{ctx.new_id()}"``). A
  stored id the id source handed out loses the part between the longest
  prefix and suffix the new ids put around theirs (all of it when a new id
  is a returned one whole). An id a step chose itself (events, dedupe by
  id) is compared whole: naming a message differently is a decision;
- idempotency keys: a Tools journal entry's ``idempotency_key`` (a record
  tagged ``stepmachine.journal`` annotated on a call) is made from the
  session id, the id of the message holding the call and the call id
  (:func:`~stepmachine.idempotency_key`). The new key is left out when it
  is exactly the key of its call for the replayed session; the stored key
  when it is that key too, or, in the part of the log a fork can have
  copied from its source (see :class:`RuntimeMade`), whatever key it is:
  a fork's copied batches carry the keys made for the source's id;
- clock readings. A step that records the time (an approval request's
  ``requested_at``, a tool journal intent's ``at``) read the clock before its
  batch was stamped, and the log keeps only the stamp. So a float in the
  stored effects that lies after the timestamp of the batch before the cycle
  and no later than the cycle's last batch, and a float in the new effects
  that the replay's clock returned, both count as "a clock reading of this
  cycle".

Left out as well: the calls a budgeted model request reserved before it was
sent (an ``InferenceAttempts`` or compaction mark with ``reserved`` set, see
:class:`~stepmachine.ModelInference`). Its size is what the budget allowed,
bookkeeping for a crash; the request itself is compared by what it recorded
(its reply, or its failure), and a budget that now stops the run shows where
it does.

The batches of one cycle are compared in order, or else as a set: concurrent
tool calls finish, and commit their results, in any order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from ._conversation import Conversation
from ._effects import Annotate, AppendMessage, Effect
from ._inference import InferenceAttempts
from ._messages import ToolCallPart, ToolResultPart
from ._records import TAG_FIELD
from ._tool_step import JournalEntry
from ._tools import idempotency_key

__all__ = ["RuntimeMade", "first_change", "same_batches"]

_ENCODER = msgspec.json.Encoder(enc_hook=Conversation.enc_hook, order="sorted")
_READING = "<clock reading>"
_MADE_ID = "<id from the id source>"
_MADE_KEY = "<idempotency key of the call>"
_JOURNAL_TAG = JournalEntry.__struct_config__.tag
_RESERVING = frozenset({InferenceAttempts.__struct_config__.tag, "stepmachine.compaction.mark"})
"""Tags of the model-call records that reserve calls (the inference step's, compaction's)."""


@dataclass(frozen=True, slots=True)
class RuntimeMade:
    """What counts as made by the runtime in one cycle (see the module docs).

    Attributes:
        after: the timestamp of the batch before the stored cycle.
        until: the timestamp of the stored cycle's last batch.
        returned: the values the replay's clock returned.
        ids: the ids the replay's id source returned.
        affixes: the (prefix, suffix) the new ids put around a returned id
            (filled by :meth:`seeing`).
        session_id: the replayed session's id (idempotency keys are made from it).
        copied: the stored cycle lies before the first batch of the log whose
            journal keys were made for ``session_id``: a fork may have copied
            it from its source, so its stored keys may be made for another id.
    """

    after: float
    until: float
    returned: frozenset[float]
    ids: frozenset[str] = frozenset()
    session_id: str = ""
    copied: bool = False
    affixes: frozenset[tuple[str, str]] = frozenset()

    def seeing(self, new: Sequence[Sequence[Effect]]) -> RuntimeMade:
        """These rules with the affixes of the new batches' message ids."""
        affixes = set(self.affixes)
        for effects in new:
            for effect in effects:
                if isinstance(effect, AppendMessage):
                    found = _source_part(effect.message.id, self.ids)
                    if found is not None:
                        start, end = found
                        affixes.add((effect.message.id[:start], effect.message.id[end:]))
        return replace(self, affixes=frozenset(affixes))

    def stored(self) -> _Side:
        return _Side(self, new=False)

    def new(self) -> _Side:
        return _Side(self, new=True)


@dataclass(frozen=True, slots=True)
class _Side:
    """The rules of :class:`RuntimeMade` for the stored or the new effects."""

    made: RuntimeMade
    new: bool

    def is_reading(self, value: float) -> bool:
        if self.new:
            return value in self.made.returned
        return self.made.after < value <= self.made.until

    def message_id(self, message_id: str) -> str:
        """``message_id`` with the part the id source made replaced by a placeholder."""
        if self.new:
            found = _source_part(message_id, self.made.ids)
            if found is None:
                return message_id
            start, end = found
        else:
            if message_id not in self.made.ids:
                return message_id
            fitting = [
                (len(prefix) + len(suffix), prefix, suffix)
                for prefix, suffix in self.made.affixes
                if message_id.startswith(prefix)
                and message_id.endswith(suffix)
                and (len(message_id) > len(prefix) + len(suffix) or not (prefix or suffix))
            ]
            if not fitting:
                return message_id
            _, prefix, suffix = max(fitting)
            start, end = len(prefix), len(message_id) - len(suffix)
        return message_id[:start] + _MADE_ID + message_id[end:]

    def is_made_key(self, key: str, message_id: str, call_id: str) -> bool:
        if key == idempotency_key(self.made.session_id, call_id, message_id):
            return True
        return not self.new and self.made.copied and bool(key)


def _source_part(message_id: str, ids: frozenset[str]) -> tuple[int, int] | None:
    """Where the longest of ``ids`` first occurs in ``message_id`` (start, end), or ``None``."""
    best: tuple[int, int] | None = None
    for made in ids:
        if made and (best is None or len(made) > best[1] - best[0]):
            start = message_id.find(made)
            if start >= 0:
                best = (start, start + len(made))
    return best


def journal_key(effect: Effect) -> tuple[str, str, str] | None:
    """``(key, message id, call id)`` of the idempotency key a Tools journal entry
    annotated on a call records, or ``None`` when ``effect`` records none."""
    if not isinstance(effect, Annotate) or effect.call_id is None:
        return None
    values = effect.values
    if values.get(TAG_FIELD) != _JOURNAL_TAG:
        return None
    key = values.get("idempotency_key")
    return (key, effect.message_id, effect.call_id) if isinstance(key, str) else None


def same_batches(
    old: Sequence[Sequence[Effect]], new: Sequence[Sequence[Effect]], made: RuntimeMade
) -> bool:
    """Whether the stored batches ``old`` and the replayed ``new`` are equal (in any order)."""
    old, new = _decided(old), _decided(new)
    made = made.seeing(new)
    old_keys = [_key(effects, made.stored()) for effects in old]
    new_keys = [_key(effects, made.new()) for effects in new]
    return old_keys == new_keys or sorted(old_keys) == sorted(new_keys)


def first_change(
    old: Sequence[Sequence[Effect]], new: Sequence[Sequence[Effect]], made: RuntimeMade
) -> str:
    """The first batch where ``old`` and ``new`` differ, described briefly, in order."""
    old, new = _decided(old), _decided(new)
    made = made.seeing(new)
    several = len(old) > 1 or len(new) > 1
    for index in range(max(len(old), len(new))):
        if index >= len(old):
            return f"an extra batch {index + 1}: {describe(new[index])}"
        if index >= len(new):
            return f"no batch {index + 1} (stored: {describe(old[index])})"
        before = _normalised(old[index], made.stored())
        after = _normalised(new[index], made.new())
        path = _first_path(before, after, "effects")
        if path is None:
            continue
        where = f"batch {index + 1}: " if several else ""
        return f"{where}stored {describe(old[index])}; new {describe(new[index])} ({path})"
    return "the same effects in another order"


def _decided(batches: Sequence[Sequence[Effect]]) -> list[Sequence[Effect]]:
    """``batches`` without reservations (see the module docs), and without a batch left empty."""
    kept: list[Sequence[Effect]] = []
    for effects in batches:
        decided = [effect for effect in effects if not _is_reservation(effect)]
        if decided:
            kept.append(decided if len(decided) < len(effects) else effects)
    return kept


def _is_reservation(effect: Effect) -> bool:
    if not isinstance(effect, Annotate) or effect.call_id is not None:
        return False
    values = effect.values
    reserved = values.get("reserved")
    return values.get(TAG_FIELD) in _RESERVING and type(reserved) is int and reserved > 0


def describe(effects: Sequence[Effect]) -> str:
    """A short description of a batch's effects."""
    if not effects:
        return "no effects"
    more = f" and {len(effects) - 3} more" if len(effects) > 3 else ""
    return ", ".join(_describe_one(e) for e in effects[:3]) + more


def _key(effects: Sequence[Effect], side: _Side) -> bytes:
    return _ENCODER.encode(_normalised(effects, side))


def _normalised(effects: Sequence[Effect], side: _Side) -> list[Any]:
    """The effects as JSON builtins, what the runtime made replaced by placeholders."""
    values: list[Any] = list(msgspec.to_builtins(tuple(effects), enc_hook=Conversation.enc_hook))
    for effect, value in zip(effects, values, strict=True):
        if isinstance(effect, AppendMessage):
            value["message"]["id"] = side.message_id(effect.message.id)
            continue
        journal = journal_key(effect)
        if journal is not None and side.is_made_key(*journal):
            value["values"]["idempotency_key"] = _MADE_KEY
    return [_without_readings(v, side) for v in values]


def _without_readings(value: Any, side: _Side) -> Any:
    if type(value) is float:
        return _READING if side.is_reading(value) else value
    if isinstance(value, dict):
        return {k: _without_readings(v, side) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_without_readings(v, side) for v in value]
    return value


def _first_path(old: Any, new: Any, path: str) -> str | None:
    """Where two JSON values first differ, with both values there; ``None`` if equal.

    Fields are visited in the stored order (a struct's field order), then the new ones.
    """
    if isinstance(old, dict) and isinstance(new, dict):
        for key in [*old, *(k for k in new if k not in old)]:
            found = _first_path(old.get(key), new.get(key), f"{path}.{key}")
            if found is not None:
                return found
        return None
    if isinstance(old, list) and isinstance(new, list):
        for index, (a, b) in enumerate(zip(old, new, strict=False)):
            found = _first_path(a, b, f"{path}[{index}]")
            if found is not None:
                return found
        if len(old) != len(new):
            return f"{path}: {len(old)} item(s) -> {len(new)}"
        return None
    if old == new:
        return None
    return f"{path}: {_short(old)} -> {_short(new)}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe_one(effect: Effect) -> str:
    if isinstance(effect, AppendMessage):
        message = effect.message
        parts: list[str] = []
        for part in message.parts:
            if isinstance(part, ToolCallPart):
                parts.append(f"call {part.name}({_short(part.raw_arguments)})")
            elif isinstance(part, ToolResultPart):
                error = " error" if part.is_error else ""
                parts.append(f"result{error} {part.call_id}: {_short(part.content)}")
            else:
                text = getattr(part, "text", None)
                parts.append(_short(text) if isinstance(text, str) else type(part).__name__)
        return f"append {message.role} [{'; '.join(parts)}]"
    if isinstance(effect, Annotate):
        on = effect.message_id if effect.call_id is None else f"call {effect.call_id}"
        return f"annotate {effect.namespace} on {on}"
    return str(type(effect).__struct_config__.tag)
