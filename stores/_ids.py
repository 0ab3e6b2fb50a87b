"""Session id validation shared by the stores.

A session id may end up in a file name, so every store accepts only ids that
are safe everywhere: 1 to 128 characters from ``A-Z a-z 0-9 . _ -``, not
starting with ``.`` or ``-``, and not a name Windows reserves (``CON``,
``NUL``, ``COM1``, ...). Nothing a caller passes can then name a path
outside a store's folder: no separators, no ``..``, no NUL bytes, no
absolute paths.
"""

from __future__ import annotations

import re

from stepmachine import InvalidSessionIdError

__all__ = ["MAX_SESSION_ID_LENGTH", "validate_session_id"]

MAX_SESSION_ID_LENGTH = 128
_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_RESERVED = {
    "CON", "PRN", "AUX", "NUL",
    *(f"COM{i}" for i in range(1, 10)),
    *(f"LPT{i}" for i in range(1, 10)),
}  # fmt: skip


def validate_session_id(session_id: object) -> str:
    """Return ``session_id`` if safe; else raise ``InvalidSessionIdError`` naming it."""
    if not isinstance(session_id, str):
        raise InvalidSessionIdError(f"a session id is a string, got {type(session_id).__name__}")
    if not 1 <= len(session_id) <= MAX_SESSION_ID_LENGTH:
        raise InvalidSessionIdError(
            f"a session id has 1 to {MAX_SESSION_ID_LENGTH} characters, got {len(session_id)}"
        )
    if not _PATTERN.fullmatch(session_id):
        raise InvalidSessionIdError(
            f"session id {session_id!r} may use only A-Z a-z 0-9 . _ - and must not start "
            "with . or -"
        )
    if session_id.split(".", 1)[0].upper() in _RESERVED:
        raise InvalidSessionIdError(f"session id {session_id!r} is a reserved device name")
    return session_id
