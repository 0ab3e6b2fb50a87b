"""Anthropic Messages API (``POST {base_url}/messages``), blocking and streaming.

Request mapping (:meth:`AnthropicModel.build_body`):

* ``system``: the request's system prompt, then the text of every ``system``
  message, joined by blank lines (the API has no system role in ``messages``);
* ``messages``: ``user`` and ``assistant`` turns of content blocks. Reasoning
  parts go back as ``thinking`` blocks with their signature, or as
  ``redacted_thinking`` blocks with their opaque data, unchanged; reasoning
  without Anthropic data (from another provider) is dropped, since the API
  refuses thinking it did not sign. Tool calls become ``tool_use`` blocks whose
  ``input`` is the parsed arguments object (``{}`` when the arguments were not a
  JSON object). Text that is empty or only whitespace is left out (the API
  refuses blank text blocks). Tool results become ``tool_result`` blocks in
  the next ``user`` turn, with ``is_error``; an error result whose content is
  empty or only whitespace is sent as ``"error"`` (the API refuses an error
  result without content). Consecutive turns of one role are merged,
  as the API requires, with tool results first in a ``user`` turn;
* media, in part order: :class:`~stepmachine.ImagePart` -> an ``image``
  block, :class:`~stepmachine.DocumentPart` -> a ``document`` block (with
  ``title``), each with ``source`` ``{type: "base64", media_type, data}``
  (bare base64; PNG, JPEG, GIF or WebP images, PDF documents), ``{type:
  "text", media_type: "text/plain", data}`` (a UTF-8 text document) or
  ``{type: "url", url}``, and ``cache_control: {type: "ephemeral"}`` when the
  part's ``cache`` hint is set (at most four a request, as the API allows),
  with ``ttl: "5m"`` or ``"1h"`` from its ``cache_ttl`` (none without one: the
  API's default, five minutes). The API wants longer-lived breakpoints first:
  a ``"1h"`` one after a five-minute one is refused before any request.
  The images and documents that follow a tool result go inside its
  ``tool_result`` block, whose ``content`` becomes a list (a text block with
  the result's content first, unless blank). More cache hints, audio,
  other media types, and media in a system or assistant message are a
  :class:`~stepmachine.ConfigurationError` before any request;
* ``tools``: ``{name, description, input_schema}``;
* ``output_config: {format: {type: "json_schema", schema}}`` for structured output;
* ``max_tokens`` (required by the API): ``settings.max_tokens``, else the
  model's default; ``thinking`` from the constructor; ``settings.extra`` last.

Response mapping: content blocks become parts in the order the API sent them
(``thinking`` -> :class:`ReasoningPart` with ``{"signature": ...}``,
``redacted_thinking`` -> ``ReasoningPart("", {"redacted": data})``, ``text``,
``tool_use`` -> :class:`ToolCallPart` whose raw arguments are the compact JSON
of ``input``); empty text blocks and block types this adapter does not know
(server tools, ...) are left out. A stream gives exactly the same response: argument fragments are
joined, parsed and re-encoded compactly when the block stops. The argument
chunks emitted for a call add up to the same JSON value as its raw arguments
(the fragments as sent; re-encoding may change their spacing), and a call whose
stream carried no argument text emits its raw arguments (``"{}"``) when its
block stops. Usage: ``input_tokens`` as Anthropic reports it (cache reads and
writes excluded; they are ``cache_read_tokens`` and ``cache_write_tokens``);
reasoning tokens from ``output_tokens_details.thinking_tokens`` (part of
``output_tokens``). Stop reasons:
``end_turn``/``stop_sequence`` -> ``"stop"``, ``tool_use`` -> ``"tool_calls"``,
``max_tokens``/``model_context_window_exceeded`` -> ``"length"``, ``refusal``
-> ``"content_filter"``, others as sent.
"""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import httpx
import msgspec

from .._errors import ConfigurationError
from .._media import MEDIA_PARTS, AudioPart, DocumentPart, ImagePart
from .._messages import Message, Part, ReasoningPart, TextPart, ToolCallPart, ToolResultPart
from .._model import (
    ChunkSink,
    ModelRequest,
    ModelResponse,
    ReasoningChunk,
    TextChunk,
    ToolCallChunk,
    Usage,
)
from ._errors import MalformedResponseError, ProviderError, error_from_response
from ._http import DEFAULT_TIMEOUT, HTTPModel, RetryPolicy, Secret, SSEEvent
from ._media_wire import IMAGE_TYPES, PDF, b64, image_type, unsendable
from ._wire import (
    PARSE_ERRORS,
    decode_arguments,
    decode_body,
    expect_list,
    expect_object,
    expect_str,
)

__all__ = ["AnthropicModel"]

DEFAULT_BASE_URL = "https://api.anthropic.com/v1"

_FINISH = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "refusal": "content_filter",
}

# The HTTP status each error type of the API stands for (used for error events in streams).
_ERROR_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}


class AnthropicModel(HTTPModel):
    """A Claude model over the Anthropic Messages API.

    Args:
        model: the model name, e.g. ``"claude-sonnet-4-5"``.
        api_key: the key; defaults to ``$ANTHROPIC_API_KEY``. Sent as
            ``x-api-key`` and never shown in a repr, log line or error.
            Required for the default base URL: without it a request is refused
            with a :class:`~stepmachine.ConfigurationError` before it is sent.
        base_url: the API root including the version (requests go to
            ``{base_url}/messages``); defaults to ``$ANTHROPIC_BASE_URL``, then
            ``https://api.anthropic.com/v1``. The variable is shared with
            Anthropic's SDKs, which write it without the version
            (``https://api.anthropic.com``), so ``/v1`` is appended to a value
            from the environment that does not already end with it.
        client: an ``httpx.AsyncClient`` to reuse (one is made otherwise).
        retry: the retry policy.
        headers: extra headers on every request (e.g. ``anthropic-beta``).
        max_tokens: the output limit when ``settings.max_tokens`` is not set
            (the API requires one).
        thinking: extended thinking, e.g. ``{"type": "enabled", "budget_tokens": 1024}``.
        anthropic_version: the ``anthropic-version`` header.
        timeout: see :class:`HTTPModel`.
        sleep: see :class:`HTTPModel`.
        rng: see :class:`HTTPModel`.
    """

    provider = "anthropic"
    path = "/messages"
    key_variable = "ANTHROPIC_API_KEY"
    default_base_url = DEFAULT_BASE_URL
    media = frozenset({ImagePart, DocumentPart})
    result_media = frozenset({ImagePart, DocumentPart})

    def __init__(
        self,
        model: str,
        *,
        api_key: str | Secret | None = None,
        base_url: str | None = None,
        client: httpx.AsyncClient | None = None,
        retry: RetryPolicy | None = None,
        headers: Mapping[str, str] | None = None,
        max_tokens: int = 4096,
        thinking: Mapping[str, Any] | None = None,
        anthropic_version: str = "2023-06-01",
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(
            model,
            api_key=api_key if api_key is not None else os.environ.get("ANTHROPIC_API_KEY"),
            base_url=base_url or _env_base_url() or DEFAULT_BASE_URL,
            client=client,
            retry=retry,
            timeout=timeout,
            headers=headers,
            sleep=sleep,
            rng=rng,
        )
        self.max_tokens = max_tokens
        self.thinking = dict(thinking) if thinking is not None else None
        self.anthropic_version = anthropic_version

    def auth_headers(self) -> dict[str, str]:
        """``x-api-key`` (when a key is set) and ``anthropic-version``."""
        headers = {"anthropic-version": self.anthropic_version}
        if self.api_key:
            headers["x-api-key"] = self.api_key.reveal()
        return headers

    # -- request ---------------------------------------------------------------------

    def build_body(self, request: ModelRequest, *, stream: bool) -> dict[str, Any]:
        """The Messages API body for ``request`` (see the module docs)."""
        settings = request.settings
        max_tokens = settings.max_tokens if settings.max_tokens is not None else self.max_tokens
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens}
        system = [request.system_prompt] if request.system_prompt else []
        system += [m.text for m in request.messages if m.role == "system" and m.text]
        if system:
            body["system"] = "\n\n".join(system)
        body["messages"] = _messages(request.messages, self.name)
        if request.tools:
            body["tools"] = [
                {"name": t.name, "description": t.description, "input_schema": t.parameters}
                for t in request.tools
            ]
        if request.output_schema is not None:
            body["output_config"] = {
                "format": {"type": "json_schema", "schema": request.output_schema}
            }
        if settings.temperature is not None:
            body["temperature"] = settings.temperature
        if self.thinking is not None:
            body["thinking"] = self.thinking
        body["stream"] = stream
        body.update(settings.extra)
        return body

    # -- blocking reply --------------------------------------------------------------

    def parse_response(self, data: Any) -> ModelResponse:
        """A Messages API reply as a response (raises ValueError/TypeError if malformed)."""
        message = expect_object(data, "the reply")
        if message.get("type") == "error":
            raise self.stream_error(message)
        parts = [
            part
            for block in expect_list(message.get("content"), "content")
            if (part := _part(block))
        ]
        return ModelResponse(
            parts=tuple(parts),
            usage=_usage(message.get("usage")),
            finish_reason=_finish(message.get("stop_reason")),
            model=_opt_str(message.get("model"), "model"),
        )

    # -- stream ----------------------------------------------------------------------

    async def parse_stream(self, events: AsyncIterator[SSEEvent], emit: ChunkSink) -> ModelResponse:
        """Consume Messages API events, emitting deltas; return the same response as blocking.

        After ``message_stop``, an error event or a protocol error, the rest of
        the stream is read and ignored before returning or raising, so that the
        HTTP stream is finished cleanly (the API closes it right after such events).

        Raises:
            MalformedResponseError: the stream ended before ``message_stop``, or
                broke the protocol (a delta for a block that was never started).
            ProviderError: a typed error for an ``error`` event
                (``overloaded_error`` -> :class:`OverloadedError`, ...).
        """
        state = _StreamState()
        stopped = False
        failure: Exception | None = None
        async for event in events:
            if stopped or failure is not None:
                continue  # read to the end: an abandoned httpx stream warns under trio
            try:
                data = expect_object(decode_body(event.data), "an event") if event.data else {}
                kind = data.get("type", event.event)
                if kind == "error" or event.event == "error":
                    raise self.stream_error(data)
                if kind == "message_stop":
                    stopped = True
                    await state.finish(emit)
                else:
                    await state.handle(kind, data, emit)
            except (ProviderError, *PARSE_ERRORS) as exc:
                failure = exc
        if failure is not None:
            raise failure
        if not stopped:
            raise MalformedResponseError(
                "the stream ended before message_stop", provider=self.provider
            )
        return state.response()

    def stream_error(self, data: Any) -> ProviderError:
        """The typed error for ``{"type": "error", "error": {"type", "message"}}``.

        The error's ``status`` is the HTTP status the API documents for that
        error type (``overloaded_error`` -> 529), as a stream has already sent 200.
        """
        error = data.get("error") if isinstance(data, dict) else None
        kind = error.get("type") if isinstance(error, dict) else None
        status = _ERROR_STATUS.get(kind, 500) if isinstance(kind, str) else 500
        body = msgspec.json.encode(data if isinstance(data, dict) else {"error": str(data)})
        return error_from_response(self.provider, status, body, httpx.Headers())


def _env_base_url() -> str | None:
    """``$ANTHROPIC_BASE_URL`` in this adapter's form (ending in ``/v1``), or None."""
    value = os.environ.get("ANTHROPIC_BASE_URL", "").strip().rstrip("/")
    if not value:
        return None
    return value if value.endswith("/v1") else f"{value}/v1"


class _Block:
    """A content block being streamed."""

    __slots__ = ("block", "call_index", "fragments", "signature", "stopped", "text")

    def __init__(self, block: dict[str, Any], call_index: int) -> None:
        self.block = block
        self.call_index = call_index
        self.text: list[str] = []
        self.fragments: list[str] = []
        self.signature: list[str] = []
        self.stopped = False

    def part(self) -> Part | None:
        """The finished part, built as the blocking reply's block would be."""
        block = dict(self.block)
        kind = block.get("type")
        if kind == "text":
            block["text"] = expect_str(block.get("text", ""), "text") + "".join(self.text)
        elif kind == "thinking":
            block["thinking"] = expect_str(block.get("thinking", ""), "thinking") + "".join(
                self.text
            )
            block["signature"] = expect_str(block.get("signature", ""), "signature") + "".join(
                self.signature
            )
        elif kind == "tool_use":
            joined = "".join(self.fragments)
            if joined.strip():
                try:
                    block["input"] = decode_arguments(joined)
                except msgspec.DecodeError:
                    # Not JSON: keep exactly what was sent; the arguments are None.
                    return ToolCallPart.parse(
                        expect_str(block.get("id"), "id"),
                        expect_str(block.get("name"), "name"),
                        joined,
                    )
        return _part(block)


class _StreamState:
    """What a stream has said so far."""

    def __init__(self) -> None:
        self.blocks: dict[int, _Block] = {}
        self.usage: dict[str, Any] = {}
        self.stop_reason: Any = None
        self.model: str | None = None
        self.calls = 0

    async def handle(self, kind: Any, data: dict[str, Any], emit: ChunkSink) -> None:
        if kind == "message_start":
            message = expect_object(data.get("message"), "message")
            self.model = _opt_str(message.get("model"), "model")
            self.usage.update(expect_object(message.get("usage") or {}, "usage"))
        elif kind == "content_block_start":
            await self._start(
                _index(data), expect_object(data.get("content_block"), "content_block"), emit
            )
        elif kind == "content_block_delta":
            await self._delta(_index(data), expect_object(data.get("delta"), "delta"), emit)
        elif kind == "message_delta":
            delta = expect_object(data.get("delta") or {}, "delta")
            if delta.get("stop_reason") is not None:
                self.stop_reason = delta["stop_reason"]
            usage = expect_object(data.get("usage") or {}, "usage")
            self.usage.update({k: v for k, v in usage.items() if v is not None})
        elif kind == "content_block_stop":
            await self.stop(_index(data), emit)
        # ping and unknown events need nothing

    async def stop(self, index: int, emit: ChunkSink) -> None:
        """Close block ``index``: a tool call whose stream sent no argument text (a call
        without arguments sends only ``partial_json: ""``, a proxy may put the whole
        ``input`` in ``content_block_start``) emits its raw arguments now, so that the
        argument chunks add up to the assembled call (``"{}"``, never ``""``)."""
        streamed = self.blocks.get(index)
        if streamed is None:
            raise ValueError(f"content block {index} stopped, but it was never started")
        if streamed.stopped:
            return
        streamed.stopped = True
        if streamed.block.get("type") != "tool_use" or "".join(streamed.fragments).strip():
            return
        part = streamed.part()
        if isinstance(part, ToolCallPart) and part.raw_arguments:
            await emit(ToolCallChunk(streamed.call_index, arguments_delta=part.raw_arguments))

    async def finish(self, emit: ChunkSink) -> None:
        """``message_stop``: close every block the stream left open."""
        for index in sorted(self.blocks):
            await self.stop(index, emit)

    async def _start(self, index: int, block: dict[str, Any], emit: ChunkSink) -> None:
        if index in self.blocks:
            raise ValueError(f"content block {index} started twice")
        streamed = _Block(block, self.calls)
        self.blocks[index] = streamed
        kind = block.get("type")
        if kind == "tool_use":
            call_id, name = expect_str(block.get("id"), "id"), expect_str(block.get("name"), "name")
            self.calls += 1
            await emit(ToolCallChunk(streamed.call_index, call_id, name))
        elif kind == "text" and block.get("text"):
            await emit(TextChunk(expect_str(block["text"], "text")))
        elif kind == "thinking" and block.get("thinking"):
            await emit(ReasoningChunk(expect_str(block["thinking"], "thinking")))

    async def _delta(self, index: int, delta: dict[str, Any], emit: ChunkSink) -> None:
        streamed = self.blocks.get(index)
        if streamed is None:
            raise ValueError(f"a delta for content block {index}, which was never started")
        kind = delta.get("type")
        if kind == "text_delta":
            text = expect_str(delta.get("text"), "text")
            streamed.text.append(text)
            if text:
                await emit(TextChunk(text))
        elif kind == "thinking_delta":
            text = expect_str(delta.get("thinking"), "thinking")
            streamed.text.append(text)
            if text:
                await emit(ReasoningChunk(text))
        elif kind == "signature_delta":
            streamed.signature.append(expect_str(delta.get("signature"), "signature"))
        elif kind == "input_json_delta":
            fragment = expect_str(delta.get("partial_json"), "partial_json")
            streamed.fragments.append(fragment)
            if fragment:
                await emit(ToolCallChunk(streamed.call_index, arguments_delta=fragment))

    def response(self) -> ModelResponse:
        parts = [p for _, b in sorted(self.blocks.items()) if (p := b.part())]
        return ModelResponse(
            parts=tuple(parts),
            usage=_usage(self.usage),
            finish_reason=_finish(self.stop_reason),
            model=self.model,
        )


# -- messages ------------------------------------------------------------------------------


_MEDIA_WHERE = (
    "the Messages API takes images and documents in user turns and tool results only, and no audio"
)
_CACHE_BREAKPOINTS = 4
"""The most ``cache_control`` marks the API takes in one request."""
_EMPTY_ERROR = "error"
"""The content sent for an ``is_error`` tool result whose content is blank."""


def _messages(messages: Sequence[Message], who: str) -> list[dict[str, Any]]:
    """The conversation as alternating ``user``/``assistant`` turns of content blocks.

    Raises:
        ConfigurationError: a media part the API cannot take where it is
            (``who`` names the adapter in the message).
    """
    marked = sum(
        isinstance(p, ImagePart | DocumentPart) and p.cache for m in messages for p in m.parts
    )
    if marked > _CACHE_BREAKPOINTS:
        raise ConfigurationError(
            f"{who} cannot send {marked} media parts with the cache hint: the Messages API "
            f"takes at most {_CACHE_BREAKPOINTS} cache breakpoints (cache_control) a request"
        )
    turns: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "system":
            media = [p for p in message.parts if isinstance(p, MEDIA_PARTS)]
            if media:  # the system prompt is text: never drop what it cannot hold
                raise unsendable(who, media[0], _MEDIA_WHERE)
            continue
        role = "assistant" if message.role == "assistant" else "user"
        blocks = _blocks(message, who)
        if not blocks:
            continue  # the API refuses empty turns
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    for turn in turns:
        if turn["role"] == "user":
            # tool results must open the turn that answers the calls
            turn["content"].sort(key=lambda b: b["type"] != "tool_result")
    _check_cache_order(turns, who)
    return turns


def _check_cache_order(turns: list[dict[str, Any]], who: str) -> None:
    """Raise :class:`ConfigurationError` for a one-hour cache breakpoint after a
    five-minute one, in the order the blocks are sent (the API refuses it)."""
    short = False
    for turn in turns:
        for block in turn["content"]:
            inner = block.get("content") if block.get("type") == "tool_result" else None
            for b in [block, *(inner if isinstance(inner, list) else [])]:
                mark = b.get("cache_control")
                if mark is None:
                    continue
                if mark.get("ttl", "5m") == "5m":
                    short = True
                elif short:
                    raise ConfigurationError(
                        f"{who} cannot send a media part with cache_ttl='1h' after one cached "
                        "for five minutes: the Messages API takes longer-lived cache "
                        "breakpoints before shorter ones; put the '1h' parts first, or give "
                        "them the same cache_ttl"
                    )


def _blocks(message: Message, who: str) -> list[dict[str, Any]]:
    """The content blocks of one message, in part order; the images and documents that
    follow a tool result go inside its ``tool_result`` block."""
    blocks: list[dict[str, Any]] = []
    result: dict[str, Any] | None = None  # the tool_result the next media parts belong to
    for part in message.parts:
        if isinstance(part, ImagePart | DocumentPart | AudioPart):
            if message.role == "assistant" or isinstance(part, AudioPart):
                raise unsendable(who, part, _MEDIA_WHERE)
            block = _media_block(part, who)
            if result is None:
                blocks.append(block)
            else:
                result["content"].append(block)
            continue
        result = None
        b = _block(part)
        if b is None:
            continue
        if isinstance(part, ToolResultPart) and message.result_media(part.call_id):
            text = b["content"]
            b["content"] = [{"type": "text", "text": text}] if text.strip() else []
            result = b
        blocks.append(b)
    return blocks


def _media_block(part: ImagePart | DocumentPart, who: str) -> dict[str, Any]:
    """An ``image`` or ``document`` block: its source, ``title``, ``cache_control``."""
    block: dict[str, Any]
    if isinstance(part, ImagePart):
        block = {"type": "image", "source": _image_source(part, who)}
    else:
        block = {"type": "document", "source": _document_source(part, who)}
        if part.title:
            block["title"] = part.title
    if part.cache:
        block["cache_control"] = {"type": "ephemeral"}
        if part.cache_ttl is not None:
            block["cache_control"]["ttl"] = part.cache_ttl
    return block


def _image_source(part: ImagePart, who: str) -> dict[str, Any]:
    if part.data is None:
        return {"type": "url", "url": part.url}
    if image_type(part) not in IMAGE_TYPES:
        raise unsendable(who, part, "the Messages API takes PNG, JPEG, GIF and WebP images")
    return {"type": "base64", "media_type": image_type(part), "data": b64(part.data)}


def _document_source(part: DocumentPart, who: str) -> dict[str, Any]:
    if part.data is None:
        return {"type": "url", "url": part.url}
    if part.media_type == PDF:
        return {"type": "base64", "media_type": PDF, "data": b64(part.data)}
    if part.media_type == "text/plain":
        try:
            text = part.data.decode("utf-8")
        except UnicodeDecodeError:
            raise unsendable(who, part, "a text/plain document must be UTF-8") from None
        return {"type": "text", "media_type": "text/plain", "data": text}
    raise unsendable(who, part, "the Messages API takes PDF and text/plain documents")


def _block(part: Part) -> dict[str, Any] | None:
    """One part as a content block, or None when it has no Anthropic form."""
    if isinstance(part, TextPart):
        # the API refuses text blocks that are empty or only whitespace
        return {"type": "text", "text": part.text} if part.text.strip() else None
    if isinstance(part, ToolCallPart):
        arguments = part.arguments if isinstance(part.arguments, dict) else {}
        return {"type": "tool_use", "id": part.call_id, "name": part.name, "input": arguments}
    if isinstance(part, ToolResultPart):
        content = part.content
        if part.is_error and not content.strip():
            content = _EMPTY_ERROR  # the API refuses an error result without content
        return {
            "type": "tool_result",
            "tool_use_id": part.call_id,
            "content": content,
            "is_error": part.is_error,
        }
    if not isinstance(part, ReasoningPart):
        return None  # media parts are _media_block's
    data = part.provider_data
    if "gemini" in data:
        return None  # Gemini's thought signatures mean nothing to Anthropic (a model switch)
    if "redacted" in data:
        return {"type": "redacted_thinking", "data": data["redacted"]}
    if "signature" in data:
        return {"type": "thinking", "thinking": part.text, "signature": data["signature"]}
    return None


# -- reply ---------------------------------------------------------------------------------


def _part(raw: Any) -> Part | None:
    """One reply content block as a part; None for empty text and unknown blocks."""
    block = expect_object(raw, "a content block")
    kind = block.get("type")
    if kind == "text":
        text = expect_str(block.get("text"), "text")
        return TextPart(text) if text else None
    if kind == "tool_use":
        raw_arguments = msgspec.json.encode(block.get("input", {})).decode()
        return ToolCallPart.parse(
            expect_str(block.get("id"), "id"), expect_str(block.get("name"), "name"), raw_arguments
        )
    if kind == "thinking":
        signature = expect_str(block.get("signature") or "", "signature")
        return ReasoningPart(
            expect_str(block.get("thinking"), "thinking"),
            {"signature": signature} if signature else {},
        )
    if kind == "redacted_thinking":
        return ReasoningPart("", {"redacted": expect_str(block.get("data"), "data")})
    return None


def _usage(raw: Any) -> Usage:
    usage = expect_object(raw or {}, "usage")
    details = expect_object(usage.get("output_tokens_details") or {}, "output_tokens_details")
    return Usage(
        input_tokens=_count(usage.get("input_tokens")),
        output_tokens=_count(usage.get("output_tokens")),
        cache_read_tokens=_count(usage.get("cache_read_input_tokens")),
        cache_write_tokens=_count(usage.get("cache_creation_input_tokens")),
        reasoning_tokens=_count(details.get("thinking_tokens")),
    )


def _finish(stop_reason: Any) -> str | None:
    if stop_reason is None:
        return None
    reason = expect_str(stop_reason, "stop_reason")
    return _FINISH.get(reason, reason)


# -- checked access (a malformed reply raises TypeError/ValueError, never AttributeError) ---


def _opt_str(value: Any, what: str) -> str | None:
    return None if value is None else expect_str(value, what)


def _count(value: Any) -> int:
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"a token count is not an integer: {value!r}")
    return value


def _index(data: dict[str, Any]) -> int:
    index = data.get("index")
    if not isinstance(index, int) or isinstance(index, bool):
        raise TypeError(f"a content block index is not an integer: {index!r}")
    return index
