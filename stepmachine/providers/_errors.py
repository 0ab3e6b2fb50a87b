"""Typed provider errors, mapped from HTTP status and the provider's error body.

Every error is a :class:`~stepmachine.ModelError` (so callers can catch one
root) and carries what a caller needs to decide: the provider, the HTTP status,
the provider's error type/code and message, the request id, and for rate
limits the server's ``retry_after``.

:func:`error_from_response` is the one place that turns an HTTP error into a
typed error, for every adapter. Messages are built from the response body and
status only -- but a server may echo the key in them, so no message is trusted:
:func:`redact_error` is the one place that removes secrets from an error and
its whole cause chain before it leaves a provider call (the HTTP base applies
it to every exception it raises; see :mod:`stepmachine.providers._http`).

Permanent versus retried: rate limits, overload, 5xx, 408/409 and connection
failures are retryable; an exhausted quota, credit or spend limit
(:class:`QuotaExceededError`) is not, whatever its status.
"""

from __future__ import annotations

import email.utils
import json
import math
import os
import re
import time
import traceback
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import msgspec

from .. import _json
from .._errors import ContextLengthError, ModelError, RunError, StepmachineError

__all__ = [
    "AuthenticationError",
    "BadRequestError",
    "ContextLengthExceededError",
    "MalformedResponseError",
    "NotFoundError",
    "OverloadedError",
    "PermissionDeniedError",
    "ProviderConnectionError",
    "ProviderError",
    "QuotaExceededError",
    "RateLimitError",
    "RedactedCauseError",
    "ServerError",
    "error_from_response",
    "parse_retry_after",
    "redact_error",
]

BODY_DEPTH = _json.MAX_DEPTH + 32
"""The deepest nesting accepted in a provider's JSON body: a value at the
kernel's limit plus the envelope around it (``content[i].input``, ...)."""


class ProviderError(ModelError):
    """A provider call failed.

    Attributes:
        provider: ``"openai"``, ``"anthropic"``, ...
        status: the HTTP status, or ``None`` when there was no response.
        kind: the provider's error code or type (``"invalid_request_error"``,
            ``"model_not_found"``, ``429``, ...): a string or an integer, or
            ``None`` (a code of any other JSON type is not kept).
        request_id: the provider's request id header, when sent.
        attempts: attempts made before giving up (budgets count them).
        retryable: whether the retry policy may try again.
    """

    retryable = False

    def __init__(
        self,
        message: str,
        *,
        provider: str,
        status: int | None = None,
        kind: Any = None,
        request_id: str | None = None,
    ) -> None:
        self.provider = provider
        self.status = status
        self.kind = kind
        self.request_id = request_id
        self.attempts = 1
        where = f"{provider} HTTP {status}" if status is not None else provider
        super().__init__(f"{where}: {message}" + (f" (request {request_id})" if request_id else ""))


class AuthenticationError(ProviderError):
    """401: the API key is missing or wrong."""


class PermissionDeniedError(ProviderError):
    """403: the key may not use this model or feature."""


class QuotaExceededError(PermissionDeniedError):
    """The account may make no more calls until someone acts: quota, credit or spend limit.

    OpenAI sends it as a 429 whose code is ``insufficient_quota``, Anthropic
    as a 402 ``billing_error`` (or a 429 whose ``details.error_code`` is
    ``enforced_spend_limit_reached``, or a 400 "You have reached your
    specified ... API usage limits"). Unlike a rate limit it is permanent:
    never retried. ``status`` is the HTTP status the provider sent. A
    :class:`PermissionDeniedError`, not a :class:`RateLimitError`, so code that
    waits and retries on rate limits does not wait for it.
    """


class NotFoundError(ProviderError):
    """404: unknown model or endpoint."""


class BadRequestError(ProviderError):
    """400/422: the request was refused as invalid."""


class ContextLengthExceededError(BadRequestError, ContextLengthError):
    """The request does not fit the model's context window (compaction can react)."""


class RateLimitError(ProviderError):
    """429: too many requests. ``retry_after`` is the server's wait, in seconds, if sent."""

    retryable = True

    def __init__(self, message: str, *, retry_after: float | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class OverloadedError(ProviderError):
    """529/503: the provider is overloaded; retried."""

    retryable = True

    def __init__(self, message: str, *, retry_after: float | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class ServerError(ProviderError):
    """5xx (and 408, 409): the provider failed or asks to try again; retried."""

    retryable = True

    def __init__(self, message: str, *, retry_after: float | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class ProviderConnectionError(ProviderError):
    """The connection failed or timed out before a response; retried."""

    retryable = True


class MalformedResponseError(ProviderError):
    """The response (or stream) was not what the protocol promises: bad JSON,
    missing fields, a stream cut before its end. Not retried once output was streamed."""

    retryable = True


class RedactedCauseError(RunError):
    """Stands for an exception that could not be kept or copied safely (a foreign
    exception type, which may hold the request and its headers): in a provider
    error's ``__cause__``/``__context__`` chain, or raised in its place.

    Its message is ``"<module>.<type>: <message>"`` of the exception it
    replaces, with every secret removed, and a note says where that was raised.
    """


_CONTEXT_PATTERNS = re.compile(
    r"context[ _-]?(length|size|window)|prompt is too long|maximum context|too many tokens"
    r"|context_length_exceeded|reduce the length",
    re.IGNORECASE,
)


def parse_retry_after(headers: Any, *, now: float | None = None) -> float | None:
    """Seconds to wait from ``retry-after-ms``, or ``retry-after`` (seconds or an HTTP date).

    Only a finite, positive wait counts: a header that is absent, unreadable,
    zero, negative or not finite is ignored, so ``retry-after-ms: 0`` next to
    ``retry-after: 1`` means 1 s, and with no usable header the caller's
    backoff applies (``None``). A date in the past counts as no header.
    """
    value = headers.get("retry-after-ms")
    if value is not None:
        seconds = _positive(value)
        if seconds is not None:
            return seconds / 1000.0
    value = headers.get("retry-after")
    if value is None:
        return None
    seconds = _positive(value)
    if seconds is not None:
        return seconds
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    current = time.time() if now is None else now
    try:
        wait = when.timestamp() - current
    except (OverflowError, OSError, ValueError):
        return None
    return wait if math.isfinite(wait) and wait > 0 else None


def _positive(value: str) -> float | None:
    """``value`` as a finite number greater than zero, else None."""
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) and number > 0 else None


_MAX_MESSAGE = 2_000
"""Characters of a provider's error message an error keeps."""


def _error_fields(body: bytes) -> tuple[str, Any, Any]:
    """(message, kind, the error object) from an error body of any of the providers' shapes.

    ``kind`` is the ``code`` when it is a string or an integer, else the
    ``type`` when that is a string, else ``None``: a code of any other type
    (a list, an object) is never kept.
    """
    try:
        data = _json.decode(body, max_depth=BODY_DEPTH)
    except msgspec.DecodeError:
        text = body.decode("utf-8", "replace").strip()
        return (text[:500] or "no error body", None, None)
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        message = str(error.get("message") or error)
        return message, _kind(error.get("code"), error.get("type")), error
    if isinstance(error, str):
        return error, None, None
    if isinstance(data, dict) and "message" in data:
        return str(data["message"]), _kind(data.get("type")), data
    return (str(data)[:500], None, None)


def _kind(*candidates: Any) -> str | int | None:
    """The first candidate that is a string or an integer (not a boolean)."""
    for value in candidates:
        if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
            return value
    return None


_QUOTA_KINDS = frozenset({"insufficient_quota", "billing_error"})
_QUOTA_DETAILS = frozenset({"enforced_spend_limit_reached"})
_SPEND_LIMIT = re.compile(r"you have reached your specified (workspace )?api usage limits", re.I)


def _is_quota(status: int, kind: Any, message: str, error: Any) -> bool:
    """Whether an error says the account is out of quota, credit or spend (permanent)."""
    if status == 402 or (isinstance(kind, str) and kind in _QUOTA_KINDS):
        return True
    if isinstance(error, dict):
        if _kind(error.get("type")) in _QUOTA_KINDS:
            return True
        details = error.get("details")
        if isinstance(details, dict) and _kind(details.get("error_code")) in _QUOTA_DETAILS:
            return True
    return bool(_SPEND_LIMIT.search(message))


def error_from_response(
    provider: str, status: int, body: bytes, headers: Any, request_id_header: str = "x-request-id"
) -> ProviderError:
    """The typed error for an HTTP error response.

    Out of quota/credit/spend (see :class:`QuotaExceededError`) wins over the
    status; then a context overflow; then the status decides.
    """
    message, kind, error = _error_fields(body)
    if len(message) > _MAX_MESSAGE:  # a provider's (or a proxy's) 5 MB message stays a line
        message = message[:_MAX_MESSAGE] + f"... ({len(message):,} characters)"
    request_id = headers.get(request_id_header) or headers.get("request-id")
    common: dict[str, Any] = {
        "provider": provider,
        "status": status,
        "kind": kind,
        "request_id": request_id,
    }
    retry_after = parse_retry_after(headers)
    if _is_quota(status, kind, message, error):
        return QuotaExceededError(message, **common)
    if _CONTEXT_PATTERNS.search(message) or kind == "context_length_exceeded":
        return ContextLengthExceededError(message, **common)
    if status == 401:
        return AuthenticationError(message, **common)
    if status == 403:
        return PermissionDeniedError(message, **common)
    if status == 404:
        return NotFoundError(message, **common)
    if status == 429:
        return RateLimitError(message, retry_after=retry_after, **common)
    if status in (408, 409):  # request timeout / lock conflict: the providers' SDKs retry these
        return ServerError(message, retry_after=retry_after, **common)
    if status in (503, 529) or kind == "overloaded_error":
        return OverloadedError(message, retry_after=retry_after, **common)
    if status >= 500:
        return ServerError(message, retry_after=retry_after, **common)
    return BadRequestError(message, **common)


# -- redaction -------------------------------------------------------------------------

_REDACTED = "***"
_PREFIX = 8
"""A secret's first characters that mark the start of a (possibly cut) copy of it."""


def redact_text(text: str, secrets: Sequence[str]) -> str:
    """``text`` with every secret removed: as is, as ``repr`` and JSON escape it,
    and any copy cut short (a truncated message) that keeps its first characters."""
    for secret in secrets:
        if not secret:
            continue
        for form in {secret, repr(secret)[1:-1], json.dumps(secret)[1:-1]}:
            text = text.replace(form, _REDACTED)
        if len(secret) >= _PREFIX:
            text = _redact_cut(text, secret)
    return text


def _redact_cut(text: str, secret: str) -> str:
    head = secret[:_PREFIX]
    start = text.find(head)
    while start != -1:
        end = start + _PREFIX
        while end < len(text) and end - start < len(secret) and text[end] == secret[end - start]:
            end += 1
        text = text[:start] + _REDACTED + text[end:]
        start = text.find(head, start + len(_REDACTED))
    return text


def _shows(value: Any, secrets: Sequence[str]) -> bool:
    try:
        shown = repr(value)
    except Exception:  # noqa: BLE001 - an unprintable value cannot be checked: assume it shows
        return True
    return redact_text(shown, secrets) != shown


def _redact_value(value: Any, secrets: Sequence[str]) -> Any:
    """``value`` unchanged if it shows no secret; a string with each removed; else
    the redacted ``repr`` (a string) -- a secret never survives in any form."""
    if isinstance(value, str):
        return redact_text(value, secrets)
    if not _shows(value, secrets):
        return value
    try:
        return redact_text(repr(value), secrets)
    except Exception:  # noqa: BLE001 - see _shows
        return _REDACTED


def redact_error(error: BaseException, secrets: Sequence[str]) -> BaseException:
    """``error`` ready to leave a provider call: no secret in it or in its cause chain.

    Returns the exception to raise. A stepmachine error (every
    :class:`ProviderError`) is redacted in place (``args``, attributes, notes)
    and returned itself. Any other exception is kept when it is a built-in or
    msgspec exception that shows no secret; otherwise it is replaced by a copy
    built from its redacted message -- of its own type for a built-in or
    msgspec exception, else a :class:`RedactedCauseError`, since a foreign
    exception (httpx, ...) may hold the request and its headers. The
    ``__cause__``/``__context__`` chain below is rebuilt the same way.

    Every exception of the result also loses its traceback, whose frames hold
    the parsers' local variables (the reply, which may echo the key, shown by
    loggers that render locals such as structlog's ``dict_tracebacks``); a note
    ``raised at file:line in function <- ...`` keeps where it came from. Raised
    again, the error gets a fresh traceback from the raise site upwards. So
    ``str``, ``repr``, ``vars``, the chain, ``traceback.format_exception`` and
    ``logging.exception`` show no secret.
    """
    return _redact_chain(error, [s for s in secrets if s], {})


def _redact_chain(
    error: BaseException, secrets: Sequence[str], done: dict[int, BaseException]
) -> BaseException:
    if id(error) in done:
        return done[id(error)]
    target: BaseException
    if isinstance(error, StepmachineError):
        target = error
        _redact_in_place(target, secrets)
    elif type(error).__module__ in _PLAIN_MODULES and not _exception_shows(error, secrets):
        target = error
    else:
        target = _redacted_copy(error, secrets)
    done[id(error)] = target
    cause, context = error.__cause__, error.__context__
    suppress = error.__suppress_context__
    _detach_traceback(target, error.__traceback__)
    target.__cause__ = None if cause is None else _redact_chain(cause, secrets, done)
    target.__context__ = None if context is None else _redact_chain(context, secrets, done)
    target.__suppress_context__ = suppress
    return target


def _detach_traceback(error: BaseException, tb: TracebackType | None) -> None:
    """Drop ``error``'s traceback (and the frames' locals), noting where it was raised."""
    error.__traceback__ = None
    if tb is None:
        return
    frames = traceback.StackSummary.extract(
        traceback.walk_tb(tb), limit=None, lookup_lines=False, capture_locals=False
    )
    where = " <- ".join(
        f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" for f in reversed(frames)
    )
    notes = getattr(error, "__notes__", None)
    note = f"raised at {where}"
    if not isinstance(notes, list) or note not in notes:
        error.add_note(note)


def _exception_shows(error: BaseException, secrets: Sequence[str]) -> bool:
    shown: list[Any] = [error.args, getattr(error, "__notes__", None)]
    attributes = getattr(error, "__dict__", None)
    if attributes:
        shown.append(attributes)
    try:
        shown.append(str(error))
    except Exception:  # noqa: BLE001 - an unprintable exception cannot be checked
        return True
    return _shows(shown, secrets)


def _redact_in_place(error: BaseException, secrets: Sequence[str]) -> None:
    error.args = tuple(_redact_value(arg, secrets) for arg in error.args)
    attributes = getattr(error, "__dict__", None)
    if isinstance(attributes, dict):
        for name, value in list(attributes.items()):
            if name == "__notes__" and isinstance(value, list):
                attributes[name] = [redact_text(str(note), secrets) for note in value]
                continue
            redacted = _redact_value(value, secrets)
            if redacted is not value:
                attributes[name] = redacted


_PLAIN_MODULES = frozenset({"builtins", "msgspec"})


def _redacted_copy(error: BaseException, secrets: Sequence[str]) -> BaseException:
    kind = type(error)
    copy: BaseException | None = None
    plain = kind.__module__ in _PLAIN_MODULES and not getattr(error, "__dict__", None)
    if plain and not isinstance(error, UnicodeError):  # Unicode errors keep the whole text
        try:
            copy = kind(*(_redact_value(arg, secrets) for arg in error.args))
        except Exception:  # noqa: BLE001 - an odd constructor: summarise instead
            copy = None
    if copy is None:
        name = (
            kind.__qualname__
            if kind.__module__ == "builtins"
            else (f"{kind.__module__}.{kind.__qualname__}")
        )
        try:
            shown = str(error)
        except Exception:  # noqa: BLE001 - an unprintable exception
            shown = "<unprintable>"
        copy = RedactedCauseError(f"{name}: {redact_text(shown, secrets)}")
    notes = getattr(error, "__notes__", None)
    if isinstance(notes, list):
        copy.__notes__ = [redact_text(str(note), secrets) for note in notes]
    return copy
