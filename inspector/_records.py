"""Finding the records operations left in notes, without knowing their namespaces.

Operations store what they decided as tagged records (``{"record": tag, ...}``)
under a namespace of their choosing (the step's name), either directly
(``notes[namespace]``) or under a key (``notes[namespace][key]``). The
inspector reads them by tag, so an operation given another name is still found.
Values are only read (JSON builtins); nothing is decoded into classes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from stepmachine import TAG_FIELD

__all__ = ["find", "records_in"]


def records_in(notes: Mapping[str, Any]) -> Iterator[tuple[str, str | None, dict[str, Any]]]:
    """Every tagged record in ``notes``: (namespace, key or ``None``, the record's fields)."""
    for namespace, value in notes.items():
        if not isinstance(value, dict):
            continue
        if isinstance(value.get(TAG_FIELD), str):
            yield namespace, None, value
            continue
        for key, inner in value.items():
            if isinstance(inner, dict) and isinstance(inner.get(TAG_FIELD), str):
                yield namespace, key, inner


def find(notes: Mapping[str, Any], tag: str) -> dict[str, Any] | None:
    """The first record tagged ``tag`` in ``notes``, or ``None``."""
    for _, _, record in records_in(notes):
        if record[TAG_FIELD] == tag:
            return record
    return None
