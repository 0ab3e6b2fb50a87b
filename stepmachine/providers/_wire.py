"""Small helpers every adapter needs to read and write provider JSON.

The checked accessors raise ``TypeError`` naming what was wrong; the HTTP
base turns that into :class:`~stepmachine.providers.MalformedResponseError`,
so a malformed reply never escapes as an ``AttributeError`` or ``KeyError``
from deep inside a parser.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .. import _json
from ._errors import BODY_DEPTH

__all__ = [
    "PARSE_ERRORS",
    "count",
    "decode_arguments",
    "decode_body",
    "expect_int",
    "expect_list",
    "expect_object",
    "expect_str",
    "strict_compatible",
]

PARSE_ERRORS = (msgspec.DecodeError, KeyError, TypeError, ValueError, IndexError, RecursionError)
"""What a parser raises for a malformed reply; the HTTP base makes each a
:class:`~stepmachine.providers.MalformedResponseError` (``RecursionError`` only
as a last guard: JSON is decoded with a nesting limit)."""


def decode_body(data: str | bytes) -> Any:
    """A provider's JSON body or event, nested at most ``BODY_DEPTH`` levels.

    Raises ``msgspec.DecodeError`` for invalid or too deeply nested JSON.
    """
    return _json.decode(data, max_depth=BODY_DEPTH)


def decode_arguments(data: str | bytes) -> Any:
    """Tool-call arguments, nested at most as deep as the kernel accepts.

    Raises ``msgspec.DecodeError`` for invalid or too deeply nested JSON.
    """
    return _json.decode(data)


def expect_object(value: Any, what: str) -> dict[str, Any]:
    """``value`` if it is a JSON object; else ``TypeError`` naming ``what``."""
    if not isinstance(value, dict):
        raise TypeError(f"{what}: expected an object, got {type(value).__name__}")
    return value


def expect_list(value: Any, what: str) -> list[Any]:
    """``value`` if it is a JSON array; else ``TypeError`` naming ``what``."""
    if not isinstance(value, list):
        raise TypeError(f"{what}: expected an array, got {type(value).__name__}")
    return value


def expect_str(value: Any, what: str) -> str:
    """``value`` if it is a JSON string; else ``TypeError`` naming ``what``."""
    if not isinstance(value, str):
        raise TypeError(f"{what}: expected a string, got {type(value).__name__}")
    return value


def expect_int(value: Any, what: str = "an index") -> int:
    """``value`` if it is a JSON integer (not a boolean); else ``TypeError`` naming ``what``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what}: expected an integer, got {type(value).__name__}")
    return value


def count(value: Any) -> int:
    """A token count: the integer, or 0 when absent or not an integer."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def strict_compatible(schema: Any) -> bool:
    """Whether a JSON schema meets OpenAI's strict mode.

    Strict mode needs every object closed (``additionalProperties: false``)
    and every property required; schemas that are not would get a 400, so the
    adapters ask for strict mode only when this holds.
    """
    if isinstance(schema, list):
        return all(strict_compatible(item) for item in schema)
    if not isinstance(schema, dict):
        return True
    properties = schema.get("properties")
    if schema.get("type") == "object" or isinstance(properties, dict):
        properties = properties if isinstance(properties, dict) else {}
        if schema.get("additionalProperties") is not False:
            return False
        if set(schema.get("required") or ()) != set(properties):
            return False
    children: list[Any] = list(properties.values()) if isinstance(properties, dict) else []
    children.extend(schema.get(key) for key in ("items", "not"))
    for key in ("anyOf", "allOf", "oneOf", "prefixItems"):
        value = schema.get(key)
        children.extend(value if isinstance(value, list) else [])
    for key in ("$defs", "definitions"):
        value = schema.get(key)
        children.extend(value.values() if isinstance(value, dict) else [])
    return all(strict_compatible(child) for child in children)
