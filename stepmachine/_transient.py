"""Which errors are transient, and how long to wait before trying again.

The one place that decides it, for ``serve()`` and durable turns. A run (or a
durable cycle) that raised a *transient* error is run again after a bounded
backoff; any other error fails it for good, with a visible record (see
``serve()`` and ``DurableMachine``).

Transient (:func:`is_transient`): the store could not be reached or answered
with a fault of its connection, not of its data:

- ``OSError`` (``ConnectionError`` and ``TimeoutError`` among them): a file,
  socket or SQLite read that failed;
- ``psycopg.OperationalError`` (``AdminShutdown`` when the server restarts,
  a connection the server closed, ``psycopg_pool.PoolTimeout``), checked
  without importing psycopg (the ``postgres`` extra is optional);
- :class:`~stepmachine.LeaseLostError`: the lease lapsed (a renewal could not
  reach the store in time) or another runner took the session over, and
  :class:`~stepmachine.ConflictError` (other writers won every retry): running
  the turn again is harmless (the next runner decides from the stored session);
- an ``ExceptionGroup`` whose every leaf error is transient.

Never transient: :class:`~stepmachine.StoredDataError` (damaged or unknown
stored data: trying again reads the same bytes), :class:`~stepmachine.ConfigurationError`,
a closed store (:class:`~stepmachine.StoreClosedError`), any other error of a
step, tool or model (a model's own retries are the model call's business),
and ``BaseException`` that is not an ``Exception`` (cancellation, Ctrl-C).
"""

from __future__ import annotations

import random
import sys
import traceback

from ._errors import (
    ConfigurationError,
    ConflictError,
    LeaseLostError,
    ModelError,
    StoreClosedError,
    StoredDataError,
)

__all__ = [
    "BACKOFF_CAP",
    "BACKOFF_FIRST",
    "DETAIL_LIMIT",
    "MAX_ATTEMPTS",
    "backoff",
    "describe",
    "is_transient",
    "raised_at",
]

MAX_ATTEMPTS = 8
"""How many times in a row a run may fail on transient errors before it counts as failed."""

BACKOFF_FIRST = 0.2
"""Seconds before the second attempt; each later pause doubles, up to :data:`BACKOFF_CAP`."""

BACKOFF_CAP = 5.0
"""The longest pause between two attempts, in seconds."""


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a transient fault worth trying again (see the module docstring)."""
    if isinstance(exc, BaseExceptionGroup):
        leaves = exc.exceptions
        return bool(leaves) and all(is_transient(leaf) for leaf in leaves)
    if not isinstance(exc, Exception):
        return False
    if isinstance(exc, StoredDataError | ConfigurationError | StoreClosedError):
        return False
    if isinstance(exc, LeaseLostError | ConflictError | OSError):
        return True
    return _is_psycopg_operational(exc)


def _is_psycopg_operational(exc: Exception) -> bool:
    psycopg = sys.modules.get("psycopg")
    if psycopg is None:  # never imported: no psycopg error can exist
        return False
    operational: type[BaseException] = psycopg.OperationalError
    return isinstance(exc, operational)


def backoff(attempt: int, *, rng: random.Random | None = None) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1-based).

    ``BACKOFF_FIRST * 2 ** (attempt - 1)``, at most :data:`BACKOFF_CAP`, with
    "equal jitter" (a random half of it added to the other half), so workers
    that failed together do not all try again at the same instant. Always
    within ``[BACKOFF_FIRST / 2, BACKOFF_CAP]``.
    """
    pick: float = (rng or random).random()
    full = min(BACKOFF_CAP, BACKOFF_FIRST * 2.0 ** max(0, min(attempt - 1, 32)))
    return full / 2 + full / 2 * pick


DETAIL_LIMIT = 1000
"""The most characters of an error's text a log record's ``detail`` carries."""

RAISED_AT_FRAMES = 6
"""How many of the innermost frames ``raised_at`` names."""


def describe(exc: BaseException, *, content: bool) -> str:
    """The text of ``exc`` for a log record's ``detail``: ``str(exc)``, cut at
    :data:`DETAIL_LIMIT` characters (the cut says how many more there were).

    No secret: a provider's error leaves its model call redacted (no key in
    its text or chain). A provider's error message is the server's text, which
    may quote the prompt, so without ``content`` (content capture off) a
    :class:`~stepmachine.ModelError` that names a provider is described by its
    provider, status, kind and request id only (as the ``model_call`` event
    carries its type only). An error whose ``str`` raises is "(unprintable)".
    """
    if not content and isinstance(exc, ModelError) and hasattr(exc, "provider"):
        fields = ("provider", "status", "kind", "request_id")
        shown = ", ".join(f"{name} {getattr(exc, name, None)!r}" for name in fields)
        return f"{shown} (its message is logged with content capture on)"
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the failure itself
        return "(unprintable)"
    if len(text) <= DETAIL_LIMIT:
        return text
    return f"{text[:DETAIL_LIMIT]}... ({len(text) - DETAIL_LIMIT} more characters)"


def raised_at(exc: BaseException) -> str:
    """Where ``exc`` was raised: its innermost frames as ``file:line in function``,
    innermost first, joined by `` <- `` (at most :data:`RAISED_AT_FRAMES`).

    A stack of names and line numbers, never the frames' local variables (a
    traceback rendered with locals would show prompts and stored content); ``""``
    without a traceback.
    """
    frames = traceback.extract_tb(exc.__traceback__)[-RAISED_AT_FRAMES:]
    return " <- ".join(f"{f.filename}:{f.lineno} in {f.name}" for f in reversed(frames))
