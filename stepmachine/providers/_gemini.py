"""Google Gemini (``:generateContent``, ``:streamGenerateContent?alt=sse``), and Vertex AI.

Endpoints: ``{base_url}/models/{model}:generateContent`` and, streaming,
``:streamGenerateContent?alt=sse``. The Gemini API's key travels in the
``x-goog-api-key`` header, never in the URL (a base URL's ``?key=`` is taken
as the key when none is given, and sent in that header too). Vertex AI (``project=``) takes
the same bodies at ``.../v1beta1/projects/{project}/locations/{location}/
publishers/google/models/{model}:...`` with an OAuth ``access_token`` sent as
a bearer token. Any other root of the same shape (a proxy, Vertex AI express
mode's ``.../v1beta1/publishers/google``) is a ``base_url`` with an
``api_key`` or an ``access_token``.

Request mapping (:meth:`GeminiModel.build_body`):

* ``systemInstruction``: the request's system prompt, then the text of every
  ``system`` message, joined by blank lines;
* ``contents``: ``user`` and ``model`` turns (see
  :mod:`~stepmachine.providers._gemini_wire` for thought signatures, call ids
  and ``functionResponse``, whose ``response`` is ``{"output": content}``, or
  ``{"error": content}`` for an error result);
* images, documents and audio with bytes as ``inlineData`` (base64), by URL
  as ``fileData`` (``fileUri``, and ``mimeType`` when known), in user
  messages; images and documents a tool result carries follow the
  ``functionResponse`` parts of their turn;
* ``tools: [{functionDeclarations: [{name, description, parametersJsonSchema}]}]``
  (the neutral parameters are JSON Schema);
* ``generationConfig``: ``maxOutputTokens``, ``temperature``, structured
  output as ``responseMimeType: "application/json"`` plus
  ``responseJsonSchema``, and ``thinkingConfig`` from the constructor;
  ``safetySettings`` from the constructor; ``settings.extra`` last (a
  ``generationConfig`` mapping in it is merged into the one built here, any
  other key such as ``cachedContent`` set at the top level).

Reply mapping: text, thought summaries (``thought: true`` ->
:class:`~stepmachine.ReasoningPart`) and function calls, in order, with the
same response streamed or not; usage from the last ``usageMetadata``
(``promptTokenCount`` as input, cached tokens as ``cache_read_tokens``,
``candidatesTokenCount + thoughtsTokenCount`` as output, thoughts as
reasoning tokens). A safety block -- ``finishReason: SAFETY`` (and
``RECITATION``, ``BLOCKLIST``, ...) or a blocked prompt
(``promptFeedback.blockReason``, no candidates) -- is a reply, not an error:
finish reason ``"content_filter"`` (what every adapter reports for a
provider's refusal, so a structured-output step counts it as a refusal), with
whatever parts came before the block (usually none).

Errors: ``{error: {code, message, status, details}}`` by HTTP status, as for
every adapter (a streaming request's error is one JSON body labelled
``text/event-stream``: decided by the status). A 429 ``RESOURCE_EXHAUSTED``
is a :class:`~stepmachine.providers.RateLimitError` whose ``retry_after`` is
``google.rpc.RetryInfo.retryDelay`` when the reply has no ``Retry-After``
header, unless its ``google.rpc.QuotaFailure`` names a quota of 0 (the plan has no
access: a permanent :class:`~stepmachine.providers.QuotaExceededError`); an
``API_KEY_INVALID`` 400 is an
:class:`~stepmachine.providers.AuthenticationError`; a 400 saying the input
token count exceeds the maximum is a
:class:`~stepmachine.providers.ContextLengthExceededError`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import os
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import anyio
import httpx
import msgspec

from .._errors import ConfigurationError
from .._media import AudioPart, DocumentPart, ImagePart
from .._model import ChunkSink, ModelRequest, ModelResponse
from ._errors import (
    AuthenticationError,
    ContextLengthExceededError,
    MalformedResponseError,
    OverloadedError,
    ProviderError,
    QuotaExceededError,
    RateLimitError,
    ServerError,
    error_from_response,
)
from ._gemini_wire import Assembler, contents, turn_of, usage
from ._http import DEFAULT_TIMEOUT, HTTPModel, RetryPolicy, Secret, SSEEvent
from ._wire import decode_body, expect_list

__all__ = ["GeminiModel"]

GEMINI_BASE_URL = "https://generativelanguage.googleapis.com/v1beta"
_RETRY_DELAY = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s*$")
_TOO_LONG = re.compile(r"input token count.*exceeds the maximum", re.IGNORECASE | re.DOTALL)
_TURN: contextvars.ContextVar[str | None] = contextvars.ContextVar("gemini_turn", default=None)
"""The turn of the request being parsed (seeds synthesised call ids; see ``_gemini_wire``)."""


def vertex_base_url(project: str, location: str = "global") -> str:
    """The Vertex AI root for ``project`` and ``location`` (``global`` or a region)."""
    host = "aiplatform.googleapis.com"
    if location != "global":
        host = f"{location}-{host}"
    return f"https://{host}/v1beta1/projects/{project}/locations/{location}/publishers/google"


class GeminiModel(HTTPModel):
    """A Gemini model over the Gemini API or Vertex AI; see the module docs.

    Args:
        model: the model name, e.g. ``"gemini-2.5-flash"``.
        api_key: the Gemini API key; default ``$GEMINI_API_KEY``, else
            ``$GOOGLE_API_KEY``. Sent as ``x-goog-api-key``, never in the URL,
            a repr, a log line or an error. Required for the default base URL:
            without it a request is refused with a
            :class:`~stepmachine.ConfigurationError` before it is sent.
        base_url: the API root (requests go to ``{base_url}/models/{model}:...``);
            default ``$GEMINI_BASE_URL``, else
            ``https://generativelanguage.googleapis.com/v1beta``; with
            ``project`` the Vertex AI root for it.
        project: use Vertex AI: the Google Cloud project.
        location: the Vertex AI location (default ``global``).
        access_token: an OAuth access token for Vertex AI, sent as
            ``Authorization: Bearer ...`` (and redacted like a key). Tokens
            expire: make a new model, or pass ``headers``, when it does.
        thinking: ``generationConfig.thinkingConfig``, e.g.
            ``{"includeThoughts": True, "thinkingBudget": 1024}``.
        safety_settings: ``safetySettings``, e.g.
            ``[{"category": "HARM_CATEGORY_HATE_SPEECH", "threshold": "BLOCK_ONLY_HIGH"}]``.
        client: see :class:`HTTPModel`.
        retry: see :class:`HTTPModel`.
        timeout: see :class:`HTTPModel`.
        headers: see :class:`HTTPModel`.
        sleep: see :class:`HTTPModel`.
        rng: see :class:`HTTPModel`.

    Raises:
        ConfigurationError: both ``api_key`` and ``access_token`` given, or
            ``access_token`` without ``project`` or ``base_url``.
    """

    provider = "gemini"
    key_variable = "GEMINI_API_KEY (or GOOGLE_API_KEY)"
    default_base_url = GEMINI_BASE_URL
    media = frozenset({ImagePart, DocumentPart, AudioPart})
    result_media = frozenset({ImagePart, DocumentPart})

    def __init__(
        self,
        model: str,
        *,
        api_key: str | Secret | None = None,
        base_url: str | None = None,
        project: str | None = None,
        location: str = "global",
        access_token: str | Secret | None = None,
        thinking: Mapping[str, Any] | None = None,
        safety_settings: list[dict[str, Any]] | None = None,
        client: httpx.AsyncClient | None = None,
        retry: RetryPolicy | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        headers: Mapping[str, str] | None = None,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        if api_key is not None and access_token is not None:
            raise ConfigurationError("GeminiModel takes api_key= or access_token=, not both")
        if access_token is not None and project is None and base_url is None:
            raise ConfigurationError(
                "GeminiModel(access_token=...) is for Vertex AI: pass project= (and location=) "
                "or the Vertex base_url="
            )
        if project is not None:
            url = base_url or vertex_base_url(project, location)
        else:
            url = base_url or os.environ.get("GEMINI_BASE_URL") or GEMINI_BASE_URL
        if access_token is not None:
            secret: str | Secret | None = access_token
        elif api_key is not None or project is not None:
            secret = api_key
        else:
            secret = os.environ.get("GEMINI_API_KEY") or os.environ.get("GOOGLE_API_KEY")
        super().__init__(
            model.removeprefix("models/"),  # the resource name models.list gives
            api_key=secret,
            base_url=url,
            client=client,
            retry=retry,
            timeout=timeout,
            headers=headers,
            sleep=sleep,
            rng=rng,
        )
        self.bearer = access_token is not None
        query = self._base.query
        keys = [value for name, value in query if name == "key"]
        if not self.api_key and not self.bearer and len(keys) == 1:
            # ``?key=`` is how Google documents the key in a URL: sent as the header
            # instead, it stays out of every URL httpx logs.
            self.api_key = Secret(keys[0])
            self._base = dataclasses.replace(
                self._base, query=tuple(p for p in query if p[0] != "key")
            )
        self.thinking = dict(thinking) if thinking is not None else None
        self.safety_settings = list(safety_settings) if safety_settings is not None else None

    def url(self, *, stream: bool) -> str:
        """``{base_url}/models/{model}:generateContent``, or ``:streamGenerateContent?alt=sse``."""
        if stream:
            return f"{self.base_url}/models/{self.model}:streamGenerateContent?alt=sse"
        return f"{self.base_url}/models/{self.model}:generateContent"

    def auth_headers(self) -> dict[str, str]:
        """``x-goog-api-key``, or ``authorization: Bearer`` with an access token."""
        if not self.api_key:
            return {}
        if self.bearer:
            return {"authorization": f"Bearer {self.api_key.reveal()}"}
        return {"x-goog-api-key": self.api_key.reveal()}

    async def request(
        self, request: ModelRequest, *, on_chunk: ChunkSink | None = None
    ) -> ModelResponse:
        """As :meth:`HTTPModel.request`; a call without an id in a reply without
        ``responseId`` gets an id derived from the turn ``request`` continues
        (unique per turn, the same for the same request: see ``_gemini_wire``)."""
        token = _TURN.set(turn_of(request.messages))
        try:
            return await super().request(request, on_chunk=on_chunk)
        finally:
            _TURN.reset(token)

    # -- request ---------------------------------------------------------------------

    def build_body(self, request: ModelRequest, *, stream: bool) -> dict[str, Any]:
        """The ``GenerateContentRequest`` for ``request`` (see the module docs);
        the same streamed or not (streaming is in the URL)."""
        del stream
        body: dict[str, Any] = {"contents": contents(request.messages)}
        system = [request.system_prompt] if request.system_prompt else []
        system += [m.text for m in request.messages if m.role == "system" and m.text]
        if system:
            body["systemInstruction"] = {"parts": [{"text": "\n\n".join(system)}]}
        if request.tools:
            declarations = [
                {"name": t.name, "description": t.description, "parametersJsonSchema": t.parameters}
                for t in request.tools
            ]
            body["tools"] = [{"functionDeclarations": declarations}]
        config: dict[str, Any] = {}
        settings = request.settings
        if settings.max_tokens is not None:
            config["maxOutputTokens"] = settings.max_tokens
        if settings.temperature is not None:
            config["temperature"] = settings.temperature
        if request.output_schema is not None:
            config["responseMimeType"] = "application/json"
            config["responseJsonSchema"] = request.output_schema
        if self.thinking is not None:
            config["thinkingConfig"] = self.thinking
        if self.safety_settings is not None:
            body["safetySettings"] = self.safety_settings
        extra = dict(settings.extra)
        more = extra.pop("generationConfig", None)
        if isinstance(more, dict):
            config.update(more)
        if config:
            body["generationConfig"] = config
        body.update(extra)
        return body

    # -- reply -----------------------------------------------------------------------

    def parse_response(self, data: Any) -> ModelResponse:
        """A ``GenerateContentResponse`` -- or the JSON array of them that
        ``:streamGenerateContent`` sends without ``alt=sse`` -- as a response."""
        chunks = expect_list(data, "the reply") if isinstance(data, list) else [data]
        assembler = Assembler(_TURN.get())
        for chunk in chunks:
            if isinstance(chunk, dict) and "error" in chunk:
                raise self.stream_error(chunk)
            assembler.feed(chunk)
        if not assembler.answered:
            raise ValueError("the reply has neither candidates nor a prompt block")
        return _response(assembler)

    async def parse_stream(self, events: AsyncIterator[SSEEvent], emit: ChunkSink) -> ModelResponse:
        """Consume ``data:`` chunks (no event names, no ``[DONE]``), emitting deltas.

        The stream ends when the connection closes; the last chunk holds the
        ``finishReason``.

        Raises:
            MalformedResponseError: the stream closed before a finish reason
                (or a prompt block): it was cut.
            ProviderError: a typed error for an ``{"error": ...}`` chunk.
        """
        assembler = Assembler(_TURN.get())
        failure: Exception | None = None
        async for event in events:
            if failure is not None or not event.data.strip():
                continue  # read to the end: an abandoned httpx stream warns under trio
            data = decode_body(event.data)
            if isinstance(data, dict) and "error" in data:
                failure = self.stream_error(data)
                continue
            for delta in assembler.feed(data):
                await emit(delta)
        if failure is not None:
            raise failure
        if assembler.finish is None and assembler.blocked is None:
            raise MalformedResponseError(
                "the stream ended before a finish reason", provider=self.provider
            )
        return _response(assembler)

    def stream_error(self, data: Any) -> ProviderError:
        """The typed error for ``{"error": {"code", "message", "status"}}`` in a reply."""
        error = data.get("error") if isinstance(data, dict) else None
        code = error.get("code") if isinstance(error, dict) else None
        status = code if isinstance(code, int) and 400 <= code < 600 else 500
        body = msgspec.json.encode(data if isinstance(data, dict) else {"error": str(data)})
        return self.reply_error(status, body, httpx.Headers())

    def reply_error(self, status: int, body: bytes, headers: httpx.Headers) -> ProviderError:
        """The typed error for an error reply, with Gemini's details read (module docs)."""
        error = error_from_response(self.provider, status, body, headers)
        details, reason, message = _details(body)
        common: dict[str, Any] = {
            "provider": error.provider,
            "status": error.status,
            "kind": error.kind,
            "request_id": error.request_id,
        }
        text = message or "no error message"
        if "API_KEY_INVALID" in reason:
            return AuthenticationError(text, **common)
        if status == 400 and _TOO_LONG.search(message):
            return ContextLengthExceededError(text, **common)
        if status == 429 and _no_quota_at_all(details):
            return QuotaExceededError(text, **common)
        if (
            isinstance(error, RateLimitError | OverloadedError | ServerError)
            and error.retry_after is None
        ):
            error.retry_after = _retry_delay(details)
        return error


def _response(assembler: Assembler) -> ModelResponse:
    return ModelResponse(
        parts=assembler.parts(),
        usage=usage(assembler.usage),
        finish_reason=assembler.finish_reason(),
        model=assembler.model,
    )


def _details(body: bytes) -> tuple[list[Any], set[str], str]:
    """An error body's ``details`` list, the ``ErrorInfo`` reasons in it, and its message."""
    try:
        data = decode_body(body)
    except msgspec.DecodeError:
        return [], set(), ""
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict):
        return [], set(), ""
    details = error.get("details")
    details = details if isinstance(details, list) else []
    reasons = {
        d["reason"] for d in details if isinstance(d, dict) and isinstance(d.get("reason"), str)
    }
    message = error.get("message")
    return details, reasons, message if isinstance(message, str) else ""


def _no_quota_at_all(details: list[Any]) -> bool:
    """Whether a ``google.rpc.QuotaFailure`` names a quota of 0 (the plan has no access to
    the model): waiting will not help, unlike a per-minute limit."""
    for detail in details:
        if isinstance(detail, dict) and str(detail.get("@type", "")).endswith("QuotaFailure"):
            violations = detail.get("violations")
            for violation in violations if isinstance(violations, list) else []:
                if isinstance(violation, dict) and str(violation.get("quotaValue")) == "0":
                    return True
    return False


def _retry_delay(details: list[Any]) -> float | None:
    """Seconds from a ``google.rpc.RetryInfo`` detail (``retryDelay: "48s"``), if any."""
    for detail in details:
        if not isinstance(detail, dict) or not str(detail.get("@type", "")).endswith("RetryInfo"):
            continue
        delay = detail.get("retryDelay")
        if isinstance(delay, dict):  # the proto form {seconds, nanos}
            seconds = delay.get("seconds", 0)
            nanos = delay.get("nanos", 0)
            try:
                value = float(seconds) + float(nanos) / 1e9
            except (TypeError, ValueError):
                continue
        else:
            match = _RETRY_DELAY.match(str(delay))
            if match is None:
                continue
            value = float(match.group(1))
        if value > 0:
            return value
    return None
