"""Cheap field checks for public constructors.

Messages, parts, effects and sessions are built on every step, and msgspec
Structs do not validate on construction (only on decoding). These helpers run
in their ``__post_init__`` (which msgspec calls on construction, on
``msgspec.structs.replace`` and on decoding) and in factory classmethods. They
use ``isinstance`` only: no msgspec round trip, no copying, except that a list
given for a tuple field becomes a tuple.

Every failure raises :class:`~stepmachine.InvalidFieldError` naming the owner,
the field, the expected type and the type of the value seen.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any, NoReturn

import msgspec

from ._errors import InvalidFieldError

__all__ = [
    "check_bool",
    "check_dict",
    "check_notes",
    "check_optional_bool",
    "check_optional_str",
    "check_str",
    "fail",
    "notes_ok",
    "str_keys",
    "tuple_of",
]


def fail(owner: str, field: str, expected: str, value: object) -> NoReturn:
    """Raise :class:`InvalidFieldError` for ``owner.field``."""
    raise InvalidFieldError(owner, field, expected, value)


def check_str(owner: str, field: str, value: object) -> None:
    """``value`` is a ``str``, else :class:`InvalidFieldError`."""
    if not isinstance(value, str):
        fail(owner, field, "str", value)


def check_optional_str(owner: str, field: str, value: object) -> None:
    """``value`` is a ``str`` or ``None``, else :class:`InvalidFieldError`."""
    if value is not None and not isinstance(value, str):
        fail(owner, field, "str or None", value)


def check_bool(owner: str, field: str, value: object) -> None:
    """``value`` is a ``bool`` (not merely 0 or 1), else :class:`InvalidFieldError`."""
    if not isinstance(value, bool):
        fail(owner, field, "bool", value)


def check_optional_bool(owner: str, field: str, value: object) -> None:
    """``value`` is a ``bool`` or ``None``, else :class:`InvalidFieldError`."""
    if value is not None and not isinstance(value, bool):
        fail(owner, field, "bool or None", value)


def check_dict(owner: str, field: str, value: object) -> None:
    """``value`` is a ``dict`` with ``str`` keys, else :class:`InvalidFieldError`."""
    if not isinstance(value, dict):
        fail(owner, field, "dict with str keys", value)
    for key in value:
        if not isinstance(key, str):
            fail(owner, f"{field} key", "str", key)


def check_notes(owner: str, field: str, value: object) -> None:
    """``value`` is notes: ``{namespace (str): {key (str): value}}``."""
    if not isinstance(value, dict):
        fail(owner, field, "notes: a dict {namespace: dict}", value)
    for namespace, values in value.items():
        if not isinstance(namespace, str):
            fail(owner, f"{field} key", "str", namespace)
        if not isinstance(values, dict):
            fail(owner, f"{field}[{namespace!r}]", "dict", values)


def notes_ok(notes: dict[Any, Any]) -> bool:
    """Whether a dict is notes (str keys, dict values), exactly; the fast path, no error."""
    for key, values in notes.items():
        if type(key) is not str or type(values) is not dict:
            return False
    return True


def str_keys(values: dict[Any, Any]) -> bool:
    """Whether every key of a dict is exactly a ``str``; the fast path, no error."""
    for key in values:  # noqa: SIM110 - cheaper than all() over a generator (hot path)
        if type(key) is not str:
            return False
    return True


def tuple_of(
    owner: str,
    field: str,
    value: Any,
    types: type | tuple[type, ...],
    expected: str,
    *,
    target: msgspec.Struct | None = None,
) -> tuple[Any, ...]:
    """``value`` as a tuple whose items are all ``types``, else :class:`InvalidFieldError`.

    A list is accepted and converted; with ``target`` given, the converted
    tuple is written back to ``target.<field>`` (a frozen Struct, from its
    ``__post_init__``). A ``str`` is never taken for a sequence.
    """
    if type(value) is tuple:
        items: tuple[Any, ...] = value
    else:
        if not isinstance(value, list | tuple):
            fail(owner, field, f"a tuple of {expected}", value)
        items = tuple(value)
        if target is not None:
            msgspec.structs.force_setattr(target, field, items)
    if not all(map(isinstance, items, repeat(types))):  # C speed; find the culprit only on failure
        for index, item in enumerate(items):
            if not isinstance(item, types):
                fail(owner, f"{field}[{index}]", expected, item)
    return items
