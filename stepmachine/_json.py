"""JSON decoding with a nesting limit, for text that a model or a server wrote.

msgspec (like every JSON library) recurses once per nesting level and raises a
bare ``RecursionError`` near the interpreter's limit; and a value that does
decode deep breaks the walks that come after it (encoding it for a store,
fingerprinting a call, rendering a log line), which run further down the
stack. Text from outside the process is therefore decoded only through
:func:`decode`, which refuses more than :data:`MAX_DEPTH` levels of nesting as
invalid JSON (``msgspec.DecodeError``), before any of it is decoded. Every
caller that already treats invalid JSON (a tool call's arguments become an
invalid call, a reply becomes a ``MalformedResponseError``) handles deep JSON
the same way, with no extra code.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

__all__ = ["MAX_DEPTH", "decode", "nesting_depth"]

MAX_DEPTH = 128
"""The deepest nesting accepted in a value (a tool call's arguments, structured output).

Far beyond any real tool schema, and far enough from Python's recursion limit
(1,000) that every later walk of the value succeeds from deep in a call stack.
"""

# A JSON string (escapes included), or one bracket: the bracket is group 1.
_TOKENS_STR = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|([\[\]{}])', re.DOTALL)
_TOKENS_BYTES = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|([\[\]{}])', re.DOTALL)


def nesting_depth(text: str | bytes, *, stop_above: int | None = None) -> int:
    """The deepest bracket nesting of ``text`` outside JSON strings.

    Works on any text, valid JSON or not, without recursion. With
    ``stop_above`` the scan ends as soon as the depth exceeds it (and returns
    that depth).
    """
    pattern: Any
    if isinstance(text, str):
        openers = text.count("[") + text.count("{")
        pattern = _TOKENS_STR
    else:
        openers = text.count(b"[") + text.count(b"{")
        pattern = _TOKENS_BYTES
    if stop_above is not None and openers <= stop_above:
        return openers  # an upper bound, and within the limit: no scan needed
    depth = deepest = 0
    for match in pattern.finditer(text):
        bracket = match.group(1)
        if bracket is None:
            continue  # a string: brackets inside it do not nest
        if bracket in ("[", "{", b"[", b"{"):
            depth += 1
            if depth > deepest:
                deepest = depth
                if stop_above is not None and deepest > stop_above:
                    return deepest
        else:
            depth = max(0, depth - 1)
    return deepest


def decode(text: str | bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """``msgspec.json.decode(text)``, refusing more than ``max_depth`` levels of nesting.

    Returns the decoded value.

    Raises:
        msgspec.DecodeError: ``text`` is not JSON, or nests deeper than
            ``max_depth`` (the message says so and gives the limit; never a
            ``RecursionError``).
    """
    if nesting_depth(text, stop_above=max_depth) > max_depth:
        raise msgspec.DecodeError(f"JSON nested deeper than {max_depth} levels")
    try:
        return msgspec.json.decode(text)
    except RecursionError:
        # Only when called from an already very deep stack.
        raise msgspec.DecodeError(
            f"JSON nested too deeply to decode here (limit {max_depth} levels)"
        ) from None
