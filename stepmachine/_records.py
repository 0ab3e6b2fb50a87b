"""Typed records: what operations write in notes, as registered, tagged msgspec Structs.

An operation records what it *did* (an approval decision, a journal entry, an
inference receipt) in the notes of a message or a tool call
(``Message.notes`` / ``ToolCallPart.notes``: ``namespace -> {key: value}``).
Each such record is a :class:`Record`: a frozen msgspec Struct with an
explicit, stable tag string, read and written through two helpers.

Writing. Notes stay JSON builtins (a session after a live apply must equal the
one a fresh process decodes, state is the session), so a record is written as its
builtins form, :func:`note_value`::

    Annotate(message_id, "approval", {"decision": note_value(decision)}, call_id=call_id)

A record may fill a whole namespace instead (``Annotate(message_id, "journal",
note_value(entry), ...)``); ``Annotate`` merges keys, so a writer that updates
such a record writes the whole new value (``msgspec.structs.replace`` of the
one it read), never a part of it.

Reading. :func:`read_record` converts the stored value back to its type::

    decision = read_record(call.notes, "approval", Decision, key="decision", where=...)

It returns ``None`` when the namespace (or the key) is absent. A value that is
present and does not convert -- not an object, a field of the wrong type, a
required field missing, another record's tag -- raises
:class:`~stepmachine.StoredDataError` naming ``where`` (the session, message
and call), the namespace and the key: damaged data fails loudly where it is
read, never as a ``KeyError`` deep inside an operation, and is never taken for
"no record".

The rules (the same as for effects, see :class:`~stepmachine.Effect`):

* Every concrete record sets ``tag="owner.kind"``: a string with a dot, so
  applications' tags (``"myapp.flag"``) never collide with the built-in ones
  (``"stepmachine.*"``). The tag is stored with the record (field
  ``"record"``); it is never renamed. Two record types with one tag raise
  :class:`~stepmachine.ConfigurationError` when the second is defined;
  :func:`record_types` lists them all.
* Schema evolution adds fields, each with a default; never renames or removes
  one. Unknown fields are ignored on reading, so an older program reads a
  newer record. A stored value without a tag (written before the records
  were typed) converts like a tagged one: the field names are the keys the
  older code wrote.
* Records hold JSON builtins only (str, int, float, bool, None, lists, dicts,
  nested records), so the stored form converts back to an equal record.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, Final, NoReturn, TypeVar

import msgspec

from ._errors import ConfigurationError, StoredDataError

__all__ = ["TAG_FIELD", "Record", "note_value", "read_record", "record_types"]

TAG_FIELD: Final = "record"
"""The key under which a stored record keeps its tag."""

R = TypeVar("R", bound="Record")

_REGISTRY: dict[str, type[Record]] = {}
# Where each tag's type was defined, taken when it was defined: a public
# package later sets the class's ``__module__`` to its public home.
_ORIGINS: dict[str, tuple[str, str]] = {}


class _RecordType(msgspec.StructMeta):
    """Registers each record type by its tag when the class is made (the tag is known then)."""

    def __new__(
        cls, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kwargs: Any
    ) -> Any:
        made = super().__new__(cls, name, bases, namespace, **kwargs)
        if bases and bases[0] is not msgspec.Struct:
            _register(made)
        return made


def _register(cls: Any) -> None:
    tag = cls.__struct_config__.tag
    if not isinstance(tag, str) or "." not in tag:
        raise ConfigurationError(
            f"record type {cls.__qualname__} needs an explicit tag with a dot, such as "
            f"tag='myapp.{cls.__name__.lower()}'; got {tag!r}"
        )
    known = _REGISTRY.get(tag)
    origin = _origin(cls)
    if known is not None and _ORIGINS[tag] != origin:
        raise ConfigurationError(
            f"record tag {tag!r} is used by both {known.__module__}.{known.__qualname__} "
            f"and {cls.__module__}.{cls.__qualname__}: a stored record names its type by "
            f"tag, so each tag must be one type; give one of them another tag"
        )
    _REGISTRY[tag] = cls  # a module loaded again (reloaded, or by a second name) redefines it
    _ORIGINS[tag] = origin


def _origin(cls: Any) -> tuple[str, str]:
    """Where a class is defined: its source file (or module name) and qualified name."""
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    return (os.path.realpath(path) if path else cls.__module__, cls.__qualname__)


class Record(msgspec.Struct, frozen=True, tag_field=TAG_FIELD, metaclass=_RecordType):
    """Base of every typed record. Subclasses set ``tag="owner.kind"`` (see the module docs).

    Raises (when a subclass is defined):
        ConfigurationError: the tag is not a string with a dot, or another
            record type already uses it.
    """


def record_types() -> dict[str, type[Record]]:
    """Every record type defined so far, by tag (a new dict)."""
    return dict(_REGISTRY)


def note_value(record: Record) -> dict[str, Any]:
    """The stored form of ``record``: JSON builtins, its tag under ``"record"``."""
    value: dict[str, Any] = msgspec.to_builtins(record)
    return value


def read_record(
    notes: Mapping[str, Any],
    namespace: str,
    record_type: type[R],
    *,
    key: str | None = None,
    where: str = "a note",
) -> R | None:
    """The record of ``record_type`` stored in ``notes[namespace]`` (or ``[namespace][key]``).

    Returns ``None`` when the namespace, or the key within it, is absent.

    Raises:
        StoredDataError: the stored value is not an object, or does not
            convert to ``record_type`` (stored data is data); the message names
            ``where``, the namespace, the key and the field at fault.
    """
    value = notes.get(namespace)
    if value is None:
        return None
    if key is not None:
        if not isinstance(value, dict):
            _fail(value, namespace, None, record_type, where, "the namespace is not an object")
        value = value.get(key)
        if value is None:
            return None
    if not isinstance(value, dict):
        _fail(value, namespace, key, record_type, where, "not an object")
    try:
        return msgspec.convert(value, record_type)
    except msgspec.ValidationError as exc:
        detail = str(exc)
        tag = value.get(TAG_FIELD)
        other = _REGISTRY.get(tag) if isinstance(tag, str) else None
        if other is not None and other is not record_type:
            detail = f"it holds a {other.__qualname__} (tag {tag!r})"
        _fail(value, namespace, key, record_type, where, detail)


def _fail(
    value: Any,
    namespace: str,
    key: str | None,
    record_type: type[Record],
    where: str,
    detail: str,
) -> NoReturn:
    place = f"{namespace!r}" if key is None else f"{namespace!r} / {key!r}"
    raise StoredDataError(
        f"stored data is data: note {place} of {where} is not a valid "
        f"{record_type.__qualname__} (tag {record_type.__struct_config__.tag!r}): {detail}; "
        f"value {_short(value)}"
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."
