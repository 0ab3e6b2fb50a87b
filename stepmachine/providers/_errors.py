"""Typed provider errors, mapped from HTTP status and the provider's error body.

Every error is a :class:`~stepmachine.ModelError` (so callers can catch one
root) and carries what a caller needs to decide: the provider, the HTTP status,
the provider's error type/code and message, the request id, and for rate
limits the server's ``retry_after``. No error, log line or repr ever contains
the API key: messages are built only from the response body and status.

:func:`error_from_response` is the one place that turns an HTTP error into a
typed error, for every adapter.
"""

from __future__ import annotations

import email.utils
import math
import re
import time
from typing import Any

import msgspec

from .._errors import ContextLengthError, ModelError

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
    "RateLimitError",
    "ServerError",
    "error_from_response",
    "parse_retry_after",
]


class ProviderError(ModelError):
    """A provider call failed.

    Attributes:
        provider: ``"openai"``, ``"anthropic"``, ...
        status: the HTTP status, or ``None`` when there was no response.
        kind: the provider's error type or code (``"invalid_request_error"``,
            ``"model_not_found"``, ``429``, ...), or ``None``.
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


_CONTEXT_PATTERNS = re.compile(
    r"context[ _-]?(length|size|window)|prompt is too long|maximum context|too many tokens"
    r"|context_length_exceeded|reduce the length",
    re.IGNORECASE,
)


def parse_retry_after(headers: Any, *, now: float | None = None) -> float | None:
    """Seconds to wait from ``retry-after-ms``, or ``retry-after`` (seconds or an HTTP date).

    ``None`` when absent or unreadable; non-finite values count as unreadable.
    """
    value = headers.get("retry-after-ms")
    if value is not None:
        try:
            seconds = float(value) / 1000.0
        except ValueError:
            seconds = math.nan
        if math.isfinite(seconds):
            return max(0.0, seconds)
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        current = time.time() if now is None else now
        return max(0.0, when.timestamp() - current)
    return max(0.0, seconds) if math.isfinite(seconds) else None


def _error_fields(body: bytes) -> tuple[str, Any]:
    """(message, kind) from an error body of any of the providers' shapes."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError:
        text = body.decode("utf-8", "replace").strip()
        return (text[:500] or "no error body", None)
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        message = str(error.get("message") or error)
        kind = error.get("code") if error.get("code") is not None else error.get("type")
        return message, kind
    if isinstance(error, str):
        return error, None
    if isinstance(data, dict) and "message" in data:
        return str(data["message"]), data.get("type")
    return (str(data)[:500], None)


def error_from_response(
    provider: str, status: int, body: bytes, headers: Any, request_id_header: str = "x-request-id"
) -> ProviderError:
    """The typed error for an HTTP error response."""
    message, kind = _error_fields(body)
    request_id = headers.get(request_id_header) or headers.get("request-id")
    common: dict[str, Any] = {
        "provider": provider,
        "status": status,
        "kind": kind,
        "request_id": request_id,
    }
    retry_after = parse_retry_after(headers)
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
