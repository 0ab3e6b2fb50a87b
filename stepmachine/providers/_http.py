"""What every HTTP provider adapter shares: client, secrets, retries, SSE, errors.

An adapter subclasses :class:`HTTPModel` and implements four pure methods:

* ``build_body(request, stream) -> dict`` -- the provider-neutral request as
  the provider's JSON;
* ``parse_response(data) -> ModelResponse`` -- a blocking JSON reply;
* ``parse_stream(events, emit) -> ModelResponse`` -- an SSE stream: hand
  every delta to ``emit`` and return the *same* assembled response the blocking
  reply would give (same behaviour streaming or not);
* ``auth_headers() -> dict`` -- how the key is sent.

and may override ``url(stream=)`` (where a request goes, when streaming changes
the endpoint, as for Gemini) and ``reply_error(status, body, headers)`` (the
typed error for an HTTP error reply, to read provider-specific details).

:class:`HTTPModel` does the rest: one reused ``httpx.AsyncClient`` (injectable;
model-appropriate timeouts, not httpx's 5 s default), typed errors from HTTP
status and body, and retries with exponential backoff and jitter that honour
``Retry-After`` -- for rate limits, overload, 5xx, connection failures and
malformed replies, but never once any output of that attempt has reached the
emitter (a retry then would show the user text twice). Attempts are bounded by
the :class:`RetryPolicy`, by the total time, and by ``request.max_attempts``
(set by budgets: a budget of N model calls means N attempts, retries
included); the response and every error report how many attempts were made.

The API key is held in a :class:`Secret`, whose ``repr`` and ``str`` hide it.
Every exception that leaves :meth:`HTTPModel.request` (except the caller's
own, from ``on_chunk``) passes through one choke point that removes the key --
and the values of credential headers among ``headers`` -- from the error and
its whole ``__cause__``/``__context__`` chain (see
:func:`~stepmachine.providers._errors.redact_error`), whatever the raise site
put in it: a reply that echoes the key, a cut message, a chained parser error.
JSON from the server is decoded with a nesting limit: too deep is malformed,
never a ``RecursionError``.

A key in the base URL (``http://user:KEY@host/v1``, ``?api-key=KEY``) is sent
as a Basic ``Authorization`` header and in the query after the endpoint path,
and shown nowhere: not in ``repr``, ``base_url``, an error or httpx's log line
(see :mod:`stepmachine.providers._urls`). The adapter's own requests never
follow a redirect, whatever the injected client does (httpx drops only
``Authorization`` across origins, not ``x-api-key`` or ``x-goog-api-key``): a
3xx reply is a :class:`ProviderError` (``kind="redirect"``, not retried) that
says where it pointed, without credentials. A 404 (:class:`NotFoundError`)
says where the request went (without credentials or query) and, when the
base URL ends with an endpoint path the adapter adds itself
(``.../v1/chat/completions``), the API root to set instead.
"""

from __future__ import annotations

import contextlib
import random
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import httpx_sse
import msgspec

from .. import _log, _tracing
from .._errors import ConfigurationError
from .._media import check_media
from .._messages import ReasoningPart, TextPart, ToolCallPart
from .._model import (
    ChunkSink,
    ModelRequest,
    ModelResponse,
    ReasoningChunk,
    StreamChunk,
    TextChunk,
    ToolCallChunk,
)
from .._model_call import attempt_started
from ._errors import (
    MalformedResponseError,
    NotFoundError,
    ProviderConnectionError,
    ProviderError,
    error_from_response,
    redact_error,
    redact_text,
)
from ._urls import hide_in_httpx_log, parse_base_url, redact_url
from ._wire import PARSE_ERRORS, decode_body

__all__ = [
    "DEFAULT_TIMEOUT",
    "HTTPModel",
    "RetryPolicy",
    "SSEEvent",
    "Secret",
    "refuse_missing_key",
]

DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=15.0)
"""Model calls stream for minutes: generous read timeout, short connect timeout."""


class Secret:
    """An API key that never shows itself in a repr, str, log line or error."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        """The key itself, for the request header only."""
        return self._value

    def __bool__(self) -> bool:
        return bool(self._value)

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how patiently to retry a failed model call.

    Attributes:
        max_attempts: first try plus retries.
        base_delay: the first backoff, in seconds; doubled each retry.
        max_delay: the longest single wait.
        total_timeout: no retry starts later than this many seconds after the
            first attempt began.
        jitter: each wait is multiplied by a random factor in ``[1 - jitter, 1]``.
    """

    max_attempts: int = 4
    base_delay: float = 0.5
    max_delay: float = 30.0
    total_timeout: float = 300.0
    jitter: float = 0.25

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (from 1)."""
        if retry_after is not None:
            return float(min(retry_after, self.max_delay))
        backoff = min(self.max_delay, self.base_delay * 2.0 ** (attempt - 1))
        return backoff * (1.0 - self.jitter * rng.random())


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One server-sent event: its ``event`` name (``"message"`` by default) and ``data``."""

    event: str
    data: str


class _ConsumerError(Exception):
    """Carries an exception raised by the caller's ``on_chunk`` through the parsers."""


_ENDPOINT_TAIL = re.compile(
    r"/(?:chat/completions|completions|responses|messages|embeddings|models(?:/[^/]*)?)$",
    re.IGNORECASE,
)
"""An endpoint path an adapter appends (Gemini's ``/models/{model}:...``), which a
base URL ending in one would repeat."""

_CREDENTIAL_HEADER = re.compile(r"auth|key|token|secret|cookie|signature", re.IGNORECASE)


def _check_key(key: str) -> None:
    """Raise :class:`ConfigurationError` if ``key`` cannot be sent in an HTTP header.

    httpx and h11 would otherwise fail at request time with errors whose
    arguments hold the whole header value. The message names the position,
    never the key.
    """
    for position, char in enumerate(key):
        if not " " <= char <= "~":
            what = (
                "a non-ASCII character"
                if ord(char) > 127
                else "a control character (a newline read from a file?)"
            )
            raise ConfigurationError(
                f"the API key cannot be sent in an HTTP header: {what} at position {position} "
                f"of {len(key)}"
            )
    if key != key.strip():
        raise ConfigurationError(
            "the API key cannot be sent in an HTTP header: it starts or ends with a space"
        )


def refuse_missing_key(
    who: str,
    key: str | Secret | None,
    base_url: str,
    *,
    default_url: str,
    variable: str,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Raise :class:`ConfigurationError` if a request to ``base_url`` would go to the
    provider's own API (``default_url``) without a key.

    The one check every adapter shares (at construction for
    :class:`OpenAIChatModel`, before the first request is sent for the others):
    a request without a key would only come back as an HTTP 401 that does not
    say which variable to set. Another server (a proxy, a gateway, a local
    one) may need no key, and a credential among ``headers`` (an
    ``Authorization`` header passed by hand) stands for one: neither is refused.
    ``variable`` names what to set (``"OPENAI_API_KEY"``); ``""`` means the
    adapter needs no key.
    """
    if key or not variable or not default_url:
        return
    if base_url.strip().rstrip("/") != default_url.rstrip("/"):
        return
    if headers and any(_CREDENTIAL_HEADER.search(name) for name in headers):
        return
    raise ConfigurationError(
        f"{who} needs an API key to call {default_url.rstrip('/')}: pass api_key=... "
        f"or set {variable}"
    )


class _Streamed:
    """Whether any output of the current attempt has reached the caller."""

    def __init__(self) -> None:
        self.value = False


class HTTPModel:
    """Base of the HTTP adapters; see the module docs.

    Args:
        model: the provider's model name.
        api_key: the key (a ``str`` or :class:`Secret`); adapters default it from
            their documented environment variable.
        base_url: the API root, e.g. ``https://api.openai.com/v1``.
        client: an ``httpx.AsyncClient`` to reuse; one is made if not given (and
            closed by :meth:`aclose`).
        retry: the retry policy.
        timeout: the timeout of every request (also through an injected client,
            whose own default -- 5 s for httpx -- is too short for models).
        headers: extra headers on every request.
        sleep: injectable for tests (``anyio.sleep``).
        rng: injectable for tests (a ``random.Random``).
    """

    reports_attempts = True  # each attempt sent is reported (exact budgets)

    provider = "http"
    path = ""
    media: frozenset[type] = frozenset()
    """The media part types the adapter sends in a message (see ``check_media``)."""
    result_media: frozenset[type] = frozenset()
    """The media part types the adapter sends in a tool result."""
    key_variable = ""
    """The environment variable the key is read from, named when it is missing
    (``""``: the adapter needs no key)."""
    default_base_url = ""
    """The provider's own API root: a request there needs a key (see
    :func:`refuse_missing_key`)."""

    def __init__(
        self,
        model: str,
        *,
        api_key: str | Secret | None,
        base_url: str,
        client: httpx.AsyncClient | None = None,
        retry: RetryPolicy | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        headers: Mapping[str, str] | None = None,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.model = model
        self.api_key = api_key if isinstance(api_key, Secret) else Secret(api_key or "")
        _check_key(self.api_key.reveal())
        self._base = parse_base_url(base_url)
        self.base_url = self._base.root
        hide_in_httpx_log(self._base.query_secrets, self._base.params())
        self._own_client = client is None
        self.client = client or httpx.AsyncClient(timeout=timeout)
        self.retry = retry or RetryPolicy()
        self.timeout = timeout
        self.extra_headers = dict(headers or {})
        self._sleep = sleep
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not security

    @property
    def max_attempts(self) -> int:
        """The most attempts one request makes (first try plus retries: the retry
        policy's); a budgeted request reserves no more calls than this before it is sent."""
        return self.retry.max_attempts

    def __repr__(self) -> str:
        shown = self.base_url + ("?..." if self._base.query else "")
        return f"{type(self).__name__}(model={self.model!r}, base_url={shown!r})"

    @property
    def name(self) -> str:
        """``"<provider>:<model>"``."""
        return f"{self.provider}:{self.model}"

    async def aclose(self) -> None:
        """Close the HTTP client if this model made it."""
        if self._own_client:
            await self.client.aclose()

    async def __aenter__(self) -> HTTPModel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- what adapters implement -----------------------------------------------------

    def build_body(self, request: ModelRequest, *, stream: bool) -> dict[str, Any]:
        """The provider's JSON body for ``request``."""
        raise NotImplementedError

    def parse_response(self, data: Any) -> ModelResponse:
        """A blocking reply as a response. Raise KeyError/TypeError/ValueError if malformed."""
        raise NotImplementedError

    async def parse_stream(self, events: AsyncIterator[SSEEvent], emit: ChunkSink) -> ModelResponse:
        """Consume a stream, emitting deltas; return the assembled response.

        Raise :class:`MalformedResponseError` if the stream ends before its
        final event, and a typed error for an error event.
        """
        raise NotImplementedError

    def auth_headers(self) -> dict[str, str]:
        """Headers carrying the key."""
        return {"authorization": f"Bearer {self.api_key.reveal()}"} if self.api_key else {}

    def url(self, *, stream: bool) -> str:
        """Where a request goes: ``{base_url}{path}`` (override when streaming changes it)."""
        return f"{self.base_url}{self.path}"

    def reply_error(self, status: int, body: bytes, headers: httpx.Headers) -> ProviderError:
        """The typed error for an HTTP error reply (override to read provider details)."""
        return error_from_response(self.provider, status, body, headers)

    def stream_error(self, data: Any) -> ProviderError:
        """The typed error for an error event inside a stream (override per provider)."""
        body = msgspec.json.encode(data)
        return error_from_response(self.provider, 500, body, httpx.Headers())

    # -- the call --------------------------------------------------------------------

    async def request(
        self, request: ModelRequest, *, on_chunk: ChunkSink | None = None
    ) -> ModelResponse:
        """Send ``request``; stream deltas to ``on_chunk`` when given.

        Returns the same response streaming or not, with ``attempts`` set.

        Raises:
            ProviderError: a typed subclass, with ``attempts`` set, after the
                retries the policy, the total time and ``request.max_attempts``
                allow -- or at once when the error is not retryable or output
                of the failed attempt was already streamed. Like every other
                exception raised here (except the caller's own, from
                ``on_chunk``, which propagates unchanged), it has been
                redacted: no secret in it or its cause chain (foreign causes
                become :class:`~stepmachine.providers.RedactedCauseError`), and
                a traceback that starts here (a note says where inside the
                adapter it was raised).

        Raises (before any request):
            ConfigurationError: no key while :attr:`base_url` is the
                provider's own API (:attr:`default_base_url`; the message
                names :attr:`key_variable` -- see :func:`refuse_missing_key`),
                or a message holds a media part this adapter cannot send
                (:attr:`media`, :attr:`result_media`).

        Cancellation: the HTTP request is abandoned; chunks already handed to
        ``on_chunk`` stay delivered.
        """
        self._refuse_missing_key()
        check_media(
            request.messages, accepts=self.media, in_results=self.result_media, who=self.name
        )
        body = msgspec.json.encode(self.build_body(request, stream=on_chunk is not None))
        limit = self.retry.max_attempts
        if request.max_attempts is not None:
            limit = min(limit, max(1, request.max_attempts))
        started = anyio.current_time()
        attempt = 0
        while True:
            attempt += 1
            attempt_started()  # counted while under way: a cancel after it still counts it
            streamed = _Streamed()
            failure: BaseException | None = None
            try:
                if on_chunk is None:
                    response = await self._blocking(body)
                else:
                    response = await self._streaming(body, on_chunk, streamed)
            except _ConsumerError as wrapped:
                original = wrapped.__cause__
                if original is None:  # pragma: no cover - always set by emit()
                    raise
                raise original from None  # the caller's own error, unchanged
            except ProviderError as exc:
                exc.attempts = attempt
                failure = self._redacted(exc)
                if exc.retryable and not streamed.value and attempt < limit:
                    delay = self._retry_delay(exc, attempt, started)
                    if delay is not None:
                        _report_retry(self.name, attempt, delay, exc)
                        await self._sleep(delay)
                        continue
            except Exception as exc:  # noqa: BLE001 - any other error: re-raised, redacted
                failure = self._redacted(exc)
            if failure is not None:
                raise failure  # outside the except blocks: no unredacted implicit context
            return self._cleaned(response, attempt)

    def _cleaned(self, response: ModelResponse, attempts: int) -> ModelResponse:
        """``response`` with ``attempts`` set, and no secret in the fields a server fills
        that are logged, traced and stored with capture off (``model``, ``finish_reason``):
        a gateway that echoes the credential there must not leak it (no secret escapes)."""
        model, finish = response.model, response.finish_reason
        secrets = self._secrets()
        if model:
            model = redact_text(model, secrets)
        if finish:
            finish = redact_text(finish, secrets)
        return msgspec.structs.replace(
            response, attempts=attempts, model=model, finish_reason=finish
        )

    def _retry_delay(self, error: ProviderError, attempt: int, started: float) -> float | None:
        """The wait before the next attempt, or None when the policy's time is up."""
        retry_after = getattr(error, "retry_after", None)
        if retry_after is not None and retry_after > self.retry.max_delay:
            return None  # the server asks for a longer wait than this policy allows
        delay = self.retry.delay(attempt, retry_after, self._rng)
        if anyio.current_time() + delay - started > self.retry.total_timeout:
            return None
        return delay

    def _refuse_missing_key(self) -> None:
        """:func:`refuse_missing_key` for this model, before a request is sent: a
        credential in the base URL (userinfo, a query key) counts as a key."""
        if self._base.basic is None and not self._base.query_secrets:
            refuse_missing_key(
                type(self).__name__,
                self.api_key,
                self.base_url,
                default_url=self.default_base_url,
                variable=self.key_variable,
                headers=self.extra_headers,
            )

    def _secrets(self) -> list[str]:
        """What must never appear in an error: the key and credential header values."""
        secrets = [self.api_key.reveal(), *self._base.secrets]
        secrets.extend(
            value
            for name, value in self.extra_headers.items()
            if _CREDENTIAL_HEADER.search(name) and isinstance(value, str)
        )
        return [s for s in secrets if s]

    def _redacted(self, error: BaseException) -> BaseException:
        """``error`` without any secret, in it or its cause chain (see the module docs)."""
        return redact_error(error, self._secrets())

    def _url(self) -> str:
        """The blocking request's URL (kept for callers of the former private name)."""
        return self.url(stream=False)

    def _headers(self, *, stream: bool) -> dict[str, str]:
        headers = {
            "content-type": "application/json",
            "accept": "text/event-stream" if stream else "application/json",
            **self.auth_headers(),
        }
        if self._base.basic is not None:  # the base URL's userinfo, as httpx would send it
            headers.pop("authorization", None)
            headers["authorization"] = self._base.basic
        return {**headers, **self.extra_headers}

    def _target(self, *, stream: bool) -> httpx.URL:
        """:meth:`url` with the base URL's query (see :mod:`._urls`)."""
        return self._base.target(self.url(stream=stream))

    def _reply_error(
        self, status: int, body: bytes, headers: httpx.Headers, *, stream: bool
    ) -> ProviderError:
        """:meth:`reply_error`; a :class:`NotFoundError` also says where the request went."""
        error = self.reply_error(status, body, headers)
        if isinstance(error, NotFoundError) and error.args:
            error.args = (f"{error.args[0]}; {self._not_found_advice(stream=stream)}",)
        return error

    def _not_found_advice(self, *, stream: bool) -> str:
        """What a 404 means for this adapter: the URL requested (redacted), and the
        base URL to set when it ends with an endpoint the adapter adds itself."""
        requested = redact_url(str(self._target(stream=stream)))
        tail = _ENDPOINT_TAIL.search(self.base_url)
        if tail is not None and self.base_url[: tail.start()].count("/") > 2:
            return (
                f"the request went to {requested}, and base_url ends with {tail.group()!r}, "
                "which the adapter adds itself: set base_url to the API root, "
                f"{redact_url(self.base_url[: tail.start()])!r}"
            )
        return (
            f"the request went to {requested}: check the model name {self.model!r}, and that "
            "base_url is the server's API root (the part before the endpoint path, "
            "e.g. ending at /v1)"
        )

    def _redirected(self, reply: httpx.Response) -> ProviderError:
        """The error for a redirect, which the adapter never follows."""
        location = reply.headers.get("location")
        if reply.next_request is not None:
            location = str(reply.next_request.url)
        where = f"to {redact_url(location)} " if location else ""
        return ProviderError(
            f"the server answered with a redirect {where}and the adapter never follows one "
            "(no secret escapes: the key would go wherever it points); set base_url to the "
            "API root the server expects (https:// rather than http://, the right path)",
            provider=self.provider,
            status=reply.status_code,
            kind="redirect",
        )

    async def _blocking(self, body: bytes) -> ModelResponse:
        failure: ProviderError | None = None
        try:
            reply = await self.client.post(
                self._target(stream=False),
                content=body,
                headers=self._headers(stream=False),
                timeout=self.timeout,
                follow_redirects=False,
            )
        except httpx.HTTPError as exc:
            failure = self._transport_error(exc, "the request failed")
        if failure is not None:
            raise failure  # outside the except block: no chained httpx request (and key)
        if reply.status_code >= 400:
            raise self._reply_error(reply.status_code, reply.content, reply.headers, stream=False)
        if reply.status_code >= 300:
            raise self._redirected(reply)
        return self._parse_json(reply.content, reply.status_code)

    def _parse_json(self, content: bytes, status: int) -> ModelResponse:
        try:
            return self.parse_response(decode_body(content))
        except PARSE_ERRORS as exc:
            raise MalformedResponseError(
                f"the reply is not a valid response: {type(exc).__name__}: {exc}",
                provider=self.provider,
                status=status,
            ) from exc

    async def _streaming(
        self, body: bytes, on_chunk: ChunkSink, streamed: _Streamed
    ) -> ModelResponse:
        async def emit(chunk: StreamChunk) -> None:
            streamed.value = True
            try:
                await on_chunk(chunk)
            except Exception as exc:
                raise _ConsumerError from exc  # the caller's own error: never blamed on us

        failure: ProviderError | None = None
        try:
            async with httpx_sse.aconnect_sse(
                self.client,
                "POST",
                str(self._target(stream=True)),
                content=body,
                headers=self._headers(stream=True),
                timeout=self.timeout,
                follow_redirects=False,
            ) as source:
                reply = source.response
                if reply.status_code >= 400:
                    content = await reply.aread()
                    raise self._reply_error(reply.status_code, content, reply.headers, stream=True)
                if reply.status_code >= 300:
                    await reply.aread()
                    raise self._redirected(reply)
                if "text/event-stream" not in reply.headers.get("content-type", ""):
                    # A server that ignored ``stream``: take the whole reply, emit it as chunks.
                    response = self._parse_json(await reply.aread(), reply.status_code)
                    await _emit_whole(response, emit)
                    return response
                return await self._parse_events(source, emit)
        except httpx.HTTPError as exc:
            failure = self._transport_error(exc, "the stream failed")
        raise failure  # outside the except block: no chained httpx request (and key)

    def _transport_error(self, exc: httpx.HTTPError, what: str) -> ProviderError:
        """A typed error for an httpx failure, carrying no reference to the request."""
        detail = f"{what}: {type(exc).__name__}: {exc}"
        if isinstance(exc, httpx.DecodingError):
            return MalformedResponseError(detail, provider=self.provider)
        return ProviderConnectionError(detail, provider=self.provider)

    async def _parse_events(self, source: httpx_sse.EventSource, emit: ChunkSink) -> ModelResponse:
        async def events() -> AsyncGenerator[SSEEvent, None]:
            try:
                async for sse in source.aiter_sse():
                    yield SSEEvent(event=sse.event or "message", data=sse.data)
            except httpx_sse.SSEError as exc:
                raise MalformedResponseError(
                    f"invalid server-sent events: {exc}", provider=self.provider
                ) from exc

        async with contextlib.aclosing(events()) as stream:
            try:
                response = await self.parse_stream(stream, emit)
            except (ProviderError, _ConsumerError):
                await _drain(stream)
                raise
            except PARSE_ERRORS as exc:
                await _drain(stream)
                raise MalformedResponseError(
                    f"the stream is not valid: {type(exc).__name__}: {exc}", provider=self.provider
                ) from exc
            await _drain(stream)
            return response


async def _drain(stream: AsyncGenerator[SSEEvent, None]) -> None:
    """Read what is left of a stream an adapter (or a failing ``on_chunk``) stopped reading.

    Ending the iteration properly (rather than abandoning the nested
    httpx / httpx-sse async generators) is what lets them close cleanly on
    every backend. Providers close the stream right after their final or
    error event, so this reads little. Errors while draining are ignored:
    the adapter's outcome stands. Cancellation is not caught.
    """
    with contextlib.suppress(ProviderError, httpx.HTTPError):
        async for _ in stream:
            pass


async def _emit_whole(response: ModelResponse, emit: ChunkSink) -> None:
    """Hand a whole response to ``emit`` as one chunk per part."""
    index = 0
    for part in response.parts:
        if isinstance(part, TextPart) and part.text:
            await emit(TextChunk(part.text))
        elif isinstance(part, ReasoningPart) and part.text:
            await emit(ReasoningChunk(part.text))
        elif isinstance(part, ToolCallPart):
            await emit(ToolCallChunk(index, part.call_id, part.name, part.raw_arguments))
            index += 1


def _report_retry(model: str, attempt: int, delay: float, error: ProviderError) -> None:
    """A ``model_retry`` event, and a ``gen_ai.retry`` event on the current (``chat``) span.

    Only the error's type, status and ``retry_after``: never its message (a
    server may echo the request in it).
    """
    fields = {
        "attempt": attempt,
        "delay_s": round(delay, 3),
        "error_type": type(error).__name__,
        "status": error.status,
        "retry_after": getattr(error, "retry_after", None),
    }
    _log.event(_log.INFO, "model_retry", model=model, **fields)
    _tracing.add_event("gen_ai.retry", {f"stepmachine.retry.{k}": v for k, v in fields.items()})
