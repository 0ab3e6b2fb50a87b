"""``ModelCall``: one model call, observed (a ``chat`` span and a ``model_call`` event).

Every model call a step makes goes through :meth:`StepContext.request_model
<stepmachine.StepContext.request_model>`, which uses this: the inference
step's reply, a compaction's summary, an application step's own call.

:func:`counting` and :func:`attempt_started` count the attempts a request
made while it is under way (first try plus retries), so that a request cut
off by a cancellation is counted as the attempts it really sent: the HTTP
adapters and the testing models report each attempt as it is sent; a model
that reports none is counted as one attempt.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import Any

import msgspec

from . import _log, _tracing
from ._conversation import Conversation
from ._media import AudioPart, DocumentPart, ImagePart
from ._messages import Message
from ._model import Model, ModelRequest, ModelResponse
from ._telemetry import Telemetry

__all__ = [
    "Attempts",
    "ModelCall",
    "attempt_started",
    "counting",
    "failed_attempts",
    "reserved_calls",
]


def reserved_calls(model: object, cap: int | None) -> int | None:
    """The calls a request capped at ``cap`` attempts (a ``Budget``'s calls left) reserves
    before it is sent, or ``None`` when it is not capped.

    At least one (a model is asked at least once) and at most ``cap``; and no
    more than one request to ``model`` can make, when the model says so (its
    ``max_attempts``: first try plus retries, as the HTTP adapters' retry
    policy). A crash while the request is under way leaves the reservation
    counted: the smaller it is, the less a crash costs the budget, and it is
    never less than what may have been sent.
    """
    if cap is None:
        return None
    calls = max(1, cap)
    most = getattr(model, "max_attempts", None)
    if type(most) is int and most >= 1:
        calls = min(calls, most)
    return calls


def failed_attempts(exc: BaseException) -> int:
    """The attempts a failed request made: the ``attempts`` an adapter set on its error
    (its retries count), else 1."""
    attempts = getattr(exc, "attempts", 1)
    return attempts if type(attempts) is int and attempts > 0 else 1


class Attempts:
    """The attempts a request under way has sent, as its model reports them."""

    __slots__ = ("began", "reported", "started")

    def __init__(self) -> None:
        self.began = False  # the request was handed to the model
        self.started = 0
        self.reported = False

    @property
    def made(self) -> int:
        """Attempts sent: as reported; 1 when the model was asked and reports none; 0 when
        the request never reached the model."""
        if self.reported:
            return self.started
        return 1 if self.began else 0


_COUNTING: ContextVar[Attempts | None] = ContextVar("stepmachine_model_attempts", default=None)


class _Counting:
    """What :func:`counting` returns: a plain context manager (no generator frame)."""

    __slots__ = ("_attempts", "_model", "_token")

    def __init__(self, attempts: Attempts, model: object) -> None:
        self._attempts = attempts
        self._model = model

    def __enter__(self) -> Attempts:
        attempts = self._attempts
        attempts.began = True
        attempts.reported = getattr(type(self._model), "reports_attempts", False) is True
        self._token = _COUNTING.set(attempts)
        return attempts

    def __exit__(self, *exc_info: object) -> None:
        _COUNTING.reset(self._token)


def counting(attempts: Attempts, model: object) -> AbstractContextManager[Attempts]:
    """Count in ``attempts`` the attempts ``model``, called inside, reports (see
    :func:`attempt_started`); a model whose class sets ``reports_attempts = True``
    is known to report each one, so none reported means none was sent."""
    return _Counting(attempts, model)


def attempt_started() -> None:
    """A model adapter sends an attempt of a request (its first try, or a retry)."""
    attempts = _COUNTING.get()
    if attempts is not None:
        attempts.started += 1
        attempts.reported = True


def _model_id(model: Model) -> str:
    """The model's own id (``gpt-4.1``) when it has one, else its name."""
    own = getattr(model, "model", None)
    return own if isinstance(own, str) and own else model.name


class ModelCall:
    """One model call, observed: a ``chat`` span around it (in a traced run) and a
    ``model_call`` event after it.

    A plain context manager (not a wrapping coroutine: every resume of the
    step would pass through one more frame). Attributes follow the
    OpenTelemetry GenAI conventions (see ``_tracing``); the request's messages
    and the reply go into the span and the event only with content capture on.
    """

    __slots__ = (
        "_capture",
        "_model",
        "_request",
        "_session_id",
        "_span",
        "_started",
        "_telemetry",
        "_traced",
    )

    def __init__(
        self, session_id: str, telemetry: Telemetry, model: Model, request: ModelRequest
    ) -> None:
        self._session_id = session_id
        self._telemetry = telemetry
        self._model = model
        self._request = request
        self._capture = telemetry.captures_content
        self._span: Any = None
        self._traced: Any = None
        self._started = 0.0

    def __enter__(self) -> ModelCall:
        self._started = time.perf_counter()
        if _tracing.active():
            model = self._model
            requested = _model_id(model)
            attributes: dict[str, Any] = {
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": getattr(model, "provider", None) or "stepmachine",
                "gen_ai.request.model": requested,
                "gen_ai.conversation.id": self._session_id,
            }
            self._traced = _tracing.span(
                self._telemetry, f"chat {requested}", attributes, client=True
            )
            self._span = self._traced.__enter__()
            if self._span is not None and self._capture:
                self._span.set_attribute("gen_ai.input.messages", _content(self._request.messages))
        return self

    def replied(self, response: ModelResponse) -> None:
        """Record the reply on the span and log the ``model_call`` event."""
        span = self._span
        if span is not None:
            usage = response.usage
            _tracing.set_attributes(
                span,
                {
                    "gen_ai.response.model": response.model or _model_id(self._model),
                    "gen_ai.usage.input_tokens": usage.input_tokens,
                    "gen_ai.usage.output_tokens": usage.output_tokens,
                    "gen_ai.response.finish_reasons": (
                        [response.finish_reason] if response.finish_reason else None
                    ),
                    "stepmachine.attempts": response.attempts,
                    "gen_ai.output.messages": (_content(response.parts) if self._capture else None),
                },
            )
        _log_model_call(self._session_id, self._model, self._started, response, self._capture)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        if isinstance(exc, Exception):
            _log_model_failure(self._session_id, self._model, self._started, exc)
        if self._traced is not None:
            self._traced.__exit__(kind, exc, tb)


def _log_model_call(
    session_id: str, model: Model, started: float, response: ModelResponse, capture: bool
) -> None:
    """The ``model_call`` event of a reply (DEBUG)."""
    if not _log.enabled(_log.DEBUG):
        return
    usage = response.usage
    fields: dict[str, Any] = {
        "session_id": session_id,
        "model": model.name,
        "attempts": response.attempts,
        "duration_ms": round((time.perf_counter() - started) * 1000, 3),
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "finish_reason": response.finish_reason,
    }
    if capture:
        fields["reply"] = _content(response.parts)
    _log.event(_log.DEBUG, "model_call", **fields)


def _log_model_failure(session_id: str, model: Model, started: float, exc: BaseException) -> None:
    """The ``model_call`` event of a call that failed (WARNING): its error type, never its text."""
    _log.event(
        _log.WARNING,
        "model_call",
        session_id=session_id,
        model=model.name,
        attempts=failed_attempts(exc),
        duration_ms=round((time.perf_counter() - started) * 1000, 3),
        error_type=type(exc).__name__,
    )


def _content(value: object) -> str:
    """``value`` (messages or parts) as JSON text, for content capture.

    A media part is described (kind, media type, size, digest or URL), never
    its bytes: a span is not the place for an image.
    """
    messages = value if isinstance(value, list | tuple | Conversation) else None
    if messages is not None and any(_has_media(m) for m in messages):
        value = [_described(m) if isinstance(m, Message) else m for m in messages]
    return msgspec.json.encode(value, enc_hook=Conversation.enc_hook).decode()


def _has_media(message: object) -> bool:
    return isinstance(message, Message) and any(
        isinstance(p, ImagePart | DocumentPart | AudioPart) for p in message.parts
    )


def _described(message: Message) -> Any:
    """``message`` with each media part as a small description (content capture)."""
    if not _has_media(message):
        return message
    parts: list[Any] = []
    for part in message.parts:
        if isinstance(part, ImagePart | DocumentPart | AudioPart):
            source = (
                {"url": part.url}
                if part.data is None
                else {"size": len(part.data), "digest": part.digest}
            )
            parts.append({"type": type(part).__name__, "media_type": part.media_type, **source})
        else:
            parts.append(part)
    return {"id": message.id, "role": message.role, "parts": parts}
