"""Which stored characters the inspector shows escaped, and how: one table for every output.

Stored text is not trusted. Some characters would change what a reader sees
without being seen themselves: C0 and C1 controls (an ANSI escape moves the
cursor or retitles a terminal; a carriage return overwrites a line),
bidirectional embeddings, overrides and isolates (``pay \\u202e0001 EUR``
displays as ``pay 1000 EUR``), zero-width characters and marks (a name that
looks like another), the byte-order mark, and the line and paragraph
separators (a line-splitting reader breaks there). The inspector shows each
of them as an escape, in every output: the terminal (:mod:`._terminal`), the
HTML export and the live pages (:func:`~._html_parts.esc`), and what the live
page's script writes from the event stream (:func:`visible_js`, generated
from the same table). Newline and tab are shown as they are.

The escape is Python's: ``\\xNN`` below U+0100, ``\\uNNNN`` above (so
``\\u202e``, ``\\x1b``). It is text, not markup, so it reads the same in a
terminal, in a page, and in a page's search box. A literal backslash in
stored text is left alone: the escapes are for reading, not for decoding.
"""

from __future__ import annotations

import json
import re
from typing import Final

__all__ = [
    "SHOWN_ESCAPED",
    "escape_character",
    "json_escaped",
    "shown_escaped",
    "visible",
    "visible_js",
]

SHOWN_ESCAPED: Final[tuple[tuple[int, int], ...]] = (
    (0x0000, 0x0008),  # C0 controls before tab
    (0x000B, 0x001F),  # C0 controls after newline (CR, ESC, ...)
    (0x007F, 0x009F),  # DEL and the C1 controls (CSI, NEL, ...)
    (0x061C, 0x061C),  # ARABIC LETTER MARK
    (0x200B, 0x200F),  # zero-width space, non-joiner, joiner; LRM, RLM
    (0x2028, 0x202E),  # line and paragraph separators; LRE, RLE, PDF, LRO, RLO
    (0x2066, 0x2069),  # LRI, RLI, FSI, PDI
    (0xFEFF, 0xFEFF),  # zero-width no-break space (byte-order mark)
)
"""The inclusive code point ranges shown escaped (see the module docstring)."""

_CLASS: Final = "".join(
    f"\\u{low:04x}" if low == high else f"\\u{low:04x}-\\u{high:04x}" for low, high in SHOWN_ESCAPED
)
_PATTERN: Final = re.compile(f"[{_CLASS}]")


def shown_escaped(character: str) -> bool:
    """Whether ``character`` (one code point) is one the inspector shows escaped."""
    point = ord(character)
    return any(low <= point <= high for low, high in SHOWN_ESCAPED)


def escape_character(character: str) -> str:
    """The escape shown for ``character``: ``\\xNN`` below U+0100, else ``\\uNNNN``."""
    point = ord(character)
    return f"\\x{point:02x}" if point < 0x100 else f"\\u{point:04x}"


def visible(text: object) -> str:
    """``str(text)`` with every character of :data:`SHOWN_ESCAPED` replaced by its escape.

    Every other character is kept as it is (newline and tab included).
    """
    return _PATTERN.sub(lambda match: escape_character(match.group()), str(text))


def json_escaped(text: str) -> str:
    """JSON text ``text`` with those characters as JSON's ``\\uNNNN`` escapes (still valid JSON).

    For output that must stay machine-readable (``--json``): the value decodes
    to the stored text, unchanged, and nothing is raw on a terminal.
    """
    return _PATTERN.sub(lambda match: f"\\u{ord(match.group()):04x}", text)


def visible_js() -> str:
    """A JavaScript function ``visible(value)``, the same as :func:`visible`, for page scripts.

    Its character class is generated from :data:`SHOWN_ESCAPED`. The source
    holds no ``<``, so it can go inside a ``<script>`` element.
    """
    pattern = json.dumps(f"[{_CLASS}]")
    return (
        "function visible(value) {\n"
        f'    return String(value).replace(new RegExp({pattern}, "g"), function (c) {{\n'
        "      var code = c.charCodeAt(0);\n"
        '      return code < 256 ? "\\\\x" + ("0" + code.toString(16)).slice(-2)\n'
        '        : "\\\\u" + ("000" + code.toString(16)).slice(-4);\n'
        "    });\n"
        "  }"
    )
