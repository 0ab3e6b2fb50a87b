"""How :func:`~stepmachine.replay` compares a replayed cycle's batches with the stored ones.

Two batches are equal when their effects, as JSON builtins with dict keys
sorted, are equal, leaving out what the runtime rather than a decision
makes:

- the ids of appended messages (they come from the id source);
- clock readings. A step that records the time (an approval request's
  ``requested_at``, a tool journal intent's ``at``) read the clock before its
  batch was stamped, and the log keeps only the stamp. So a float in the
  stored effects that lies after the timestamp of the batch before the cycle
  and no later than the cycle's last batch, and a float in the new effects
  that the replay's clock returned, both count as "a clock reading of this
  cycle".

The batches of one cycle are compared in order, or else as a set: concurrent
tool calls finish, and commit their results, in any order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from ._conversation import Conversation
from ._effects import Annotate, AppendMessage, Effect
from ._messages import ToolCallPart, ToolResultPart

__all__ = ["Readings", "first_change", "same_batches"]

_ENCODER = msgspec.json.Encoder(enc_hook=Conversation.enc_hook, order="sorted")
_READING = "<clock reading>"


@dataclass(frozen=True, slots=True)
class Readings:
    """What counts as a clock reading of the cycle (see the module docs).

    Attributes:
        after: the timestamp of the batch before the stored cycle.
        until: the timestamp of the stored cycle's last batch.
        returned: the values the replay's clock returned.
    """

    after: float
    until: float
    returned: frozenset[float]

    def stored(self, value: float) -> bool:
        return self.after < value <= self.until

    def new(self, value: float) -> bool:
        return value in self.returned


def same_batches(
    old: Sequence[Sequence[Effect]], new: Sequence[Sequence[Effect]], readings: Readings
) -> bool:
    """Whether the stored batches ``old`` and the replayed ``new`` are equal (in any order)."""
    old_keys = [_key(effects, readings.stored) for effects in old]
    new_keys = [_key(effects, readings.new) for effects in new]
    return old_keys == new_keys or sorted(old_keys) == sorted(new_keys)


def first_change(
    old: Sequence[Sequence[Effect]], new: Sequence[Sequence[Effect]], readings: Readings
) -> str:
    """The first batch where ``old`` and ``new`` differ, described briefly, in order."""
    several = len(old) > 1 or len(new) > 1
    for index in range(max(len(old), len(new))):
        if index >= len(old):
            return f"an extra batch {index + 1}: {describe(new[index])}"
        if index >= len(new):
            return f"no batch {index + 1} (stored: {describe(old[index])})"
        before = _normalised(old[index], readings.stored)
        after = _normalised(new[index], readings.new)
        path = _first_path(before, after, "effects")
        if path is None:
            continue
        where = f"batch {index + 1}: " if several else ""
        return f"{where}stored {describe(old[index])}; new {describe(new[index])} ({path})"
    return "the same effects in another order"


def describe(effects: Sequence[Effect]) -> str:
    """A short description of a batch's effects."""
    if not effects:
        return "no effects"
    more = f" and {len(effects) - 3} more" if len(effects) > 3 else ""
    return ", ".join(_describe_one(e) for e in effects[:3]) + more


def _key(effects: Sequence[Effect], is_reading: Any) -> bytes:
    return _ENCODER.encode(_normalised(effects, is_reading))


def _normalised(effects: Sequence[Effect], is_reading: Any) -> list[Any]:
    """The effects as JSON builtins; appended message ids and clock readings left out."""
    values: list[Any] = list(msgspec.to_builtins(tuple(effects), enc_hook=Conversation.enc_hook))
    for value in values:
        if isinstance(value, dict) and value.get("type") == "append_message":
            value["message"]["id"] = ""
    return [_without_readings(v, is_reading) for v in values]


def _without_readings(value: Any, is_reading: Any) -> Any:
    if type(value) is float:
        return _READING if is_reading(value) else value
    if isinstance(value, dict):
        return {k: _without_readings(v, is_reading) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_without_readings(v, is_reading) for v in value]
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
