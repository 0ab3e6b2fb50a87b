"""OpenAI Responses API (``POST {base_url}/responses``), blocking and streaming.

Request mapping (provider-neutral -> wire):

* the system prompt (prompt parts, then the text of ``role=system`` messages)
  -> ``instructions``;
* user text -> ``{role: "user", content}``; assistant text ->
  ``{role: "assistant", content}``; each tool call -> a ``function_call``
  item (``call_id``, ``name``, the raw ``arguments`` string, ``"{}"`` when it
  is empty or only whitespace, as in the Chat adapter); each tool result -> a
  ``function_call_output`` item (the ``is_error`` flag has no wire field; the
  content is sent as is); a reasoning part that came from this API
  -> the ``reasoning`` item it was (``id``, ``summary``, ``encrypted_content``),
  in the order the parts have in the message;
* images and documents of a user message -> its ``content`` as a list of
  blocks in part order: ``input_text``, ``input_image`` (``image_url``: the
  URL, or the bytes as a ``data:<media_type>;base64,...`` URL -- PNG, JPEG,
  GIF or WebP; ``detail``: the part's, else ``"auto"``) and ``input_file``
  (bytes -> ``file_data`` data URL with ``filename``: the part's ``title``,
  else ``document.pdf`` / ``document.txt`` / ...; a URL -> ``file_url``) --
  PDF, ``text/*``, JSON, XML, Word, RTF, OpenDocument text, PowerPoint and
  Excel (the types OpenAI documents; any other, or one with parameters, is a
  :class:`~stepmachine.ConfigurationError` before any request);
  the images and documents that follow a tool result -> its ``output`` as
  such a list (``input_text`` with the result's content first, when it has
  any). The ``cache`` hint has no wire field. Audio, and media in a system
  or assistant message, are a :class:`~stepmachine.ConfigurationError`
  before any request;
* tools -> flat ``{type: "function", name, description, parameters}``;
  ``max_tokens`` -> ``max_output_tokens``; ``output_schema`` ->
  ``text.format`` ``json_schema``; ``settings.extra`` is merged in last.

Reply mapping: output items in the order the API gives them -- ``reasoning``
-> :class:`ReasoningPart` (summary text; the item kept in ``provider_data``
so it round-trips), ``message`` -> :class:`TextPart` per ``output_text`` (or
``refusal``) block, ``function_call`` -> :class:`ToolCallPart` whose id is the
``call_id``. ``completed`` -> ``"stop"`` or ``"tool_calls"``, or
``"content_filter"`` when a message holds a ``refusal`` block (as the Chat
adapter does for ``message.refusal``: the text is shown, and a structured-output
step knows it is not the requested JSON); ``incomplete`` -> ``"length"``
(``max_output_tokens``), ``"content_filter"`` or the raw reason.

Streaming hands text, refusal, reasoning-summary and argument deltas to the
emitter and assembles the result from the same final items a blocking reply
holds (the ``response.completed`` object, or the ``output_item.done`` items
when a server leaves that empty), so both paths give the same response
(same behaviour streaming or not). The chunks add up to the response: text (and refusal) deltas
concatenated are its text, argument deltas per call are its raw arguments,
reasoning deltas its reasoning; text, arguments or a reasoning summary that a
server sends only whole, in ``output_item.done``, are emitted from there.
``response.failed`` and ``error`` events raise typed errors; a stream that
ends before ``response.completed`` / ``response.incomplete`` raises
:class:`MalformedResponseError`.

Reasoning round trip. With ``store=False`` (the default: this framework
re-sends the whole history, so nothing needs to be kept server-side) a reasoning
item can only be sent back with its ``encrypted_content``, which the API
returns when ``include`` asks for it: that is asked automatically when
``reasoning`` is configured, or explicitly with
``include_encrypted_reasoning=True``. A reasoning item that cannot be resolved
(no encrypted content while ``store`` is false) is left out of the next
request rather than failing it; one that carries its encrypted content but no
``id`` (as some clients send it back) is sent without an ``id``.
"""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import anyio
import httpx
import msgspec

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
from ._media_wire import (
    IMAGE_TYPES,
    data_url,
    default_filename,
    image_type,
    openai_file_type,
    unsendable,
)
from ._wire import (
    count,
    decode_body,
    expect_int,
    expect_list,
    expect_object,
    expect_str,
    strict_compatible,
)

__all__ = ["OpenAIResponsesModel"]

DEFAULT_BASE_URL = "https://api.openai.com/v1"
ENCRYPTED_REASONING = "reasoning.encrypted_content"
_USER_OR_RESULT_MEDIA = (
    "the Responses API takes images and files in user messages and tool results only"
)
_IMAGE_TYPES_TAKEN = "the Responses API takes PNG, JPEG, GIF and WebP images"
_FILE_TYPES_TAKEN = (
    "the Responses API reads PDF, text and code (text/*), JSON, XML, Word, RTF, "
    "OpenDocument text, PowerPoint and Excel files, given by a bare media type (no "
    "parameters); convert the document to one of them, e.g. to PDF"
)

# Stream error codes -> the HTTP status whose typed error fits them best.
_STREAM_ERROR_STATUS = {
    "rate_limit_exceeded": 429,
    "insufficient_quota": 429,
    "server_is_overloaded": 503,
    "overloaded": 503,
    "slow_down": 503,
    "server_error": 500,
    "vector_store_timeout": 500,
    "invalid_prompt": 400,
    "invalid_request_error": 400,
    "invalid_image": 400,
    "context_length_exceeded": 400,
    "unauthorized": 401,
    "invalid_api_key": 401,
    "permission_denied": 403,
    "not_found": 404,
    "model_not_found": 404,
}


class OpenAIResponsesModel(HTTPModel):
    """A model behind the OpenAI Responses API.

    Args:
        model: the model name, e.g. ``"gpt-5"``.
        api_key: the key; defaults to ``$OPENAI_API_KEY``. Required for the
            default base URL: without it a request is refused with a
            :class:`~stepmachine.ConfigurationError` before it is sent.
        base_url: the API root; defaults to ``$OPENAI_BASE_URL``, else
            ``https://api.openai.com/v1``.
        client: an ``httpx.AsyncClient`` to reuse (one is made otherwise).
        retry: the retry policy (see :class:`RetryPolicy`).
        timeout: per-request timeout when this model makes its own client.
        headers: extra headers on every request (organization, project, ...).
        reasoning: the ``reasoning`` object, e.g. ``{"effort": "low",
            "summary": "auto"}``; ``None`` sends none (the model's default).
        store: the ``store`` flag; ``False`` by default (nothing is kept
            server-side); ``None`` leaves the field out (the server's default).
        include_encrypted_reasoning: ask for ``reasoning.encrypted_content`` so
            reasoning round-trips without server-side storage; ``None`` asks
            for it when ``store`` is false and ``reasoning`` is configured.
        strict_tools: the ``strict`` flag on every function tool; ``None``
            leaves it to the server.
        sleep: injectable for tests.
        rng: injectable for tests.

    The key is never shown: ``repr`` names the model and base URL only.
    """

    provider = "openai"
    path = "/responses"
    key_variable = "OPENAI_API_KEY"
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
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        headers: Mapping[str, str] | None = None,
        reasoning: Mapping[str, Any] | None = None,
        store: bool | None = False,
        include_encrypted_reasoning: bool | None = None,
        strict_tools: bool | None = None,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(
            model,
            api_key=api_key if api_key is not None else os.environ.get("OPENAI_API_KEY"),
            base_url=base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL,
            client=client,
            retry=retry,
            timeout=timeout,
            headers=headers,
            sleep=sleep,
            rng=rng,
        )
        self.reasoning = dict(reasoning) if reasoning is not None else None
        self.store = store
        if include_encrypted_reasoning is None:
            include_encrypted_reasoning = store is False and self.reasoning is not None
        self.include_encrypted_reasoning = include_encrypted_reasoning
        self.strict_tools = strict_tools

    # -- request -----------------------------------------------------------------------

    def build_body(self, request: ModelRequest, *, stream: bool) -> dict[str, Any]:
        """The ``/responses`` body for ``request`` (see the module docs)."""
        system = [request.system_prompt] if request.system_prompt else []
        items: list[dict[str, Any]] = []
        for message in request.messages:
            if message.role == "system":
                for part in message.parts:
                    if isinstance(part, MEDIA_PARTS):  # instructions are text: never drop it
                        raise unsendable(self.name, part, _USER_OR_RESULT_MEDIA)
                if message.text:
                    system.append(message.text)
                continue
            items.extend(self._items(message))
        body: dict[str, Any] = {"model": self.model, "input": items, "stream": stream}
        if system:
            body["instructions"] = "\n\n".join(system)
        if request.tools:
            body["tools"] = [self._tool(t.name, t.description, t.parameters) for t in request.tools]
        settings = request.settings
        if settings.max_tokens is not None:
            body["max_output_tokens"] = settings.max_tokens
        if settings.temperature is not None:
            body["temperature"] = settings.temperature
        if request.output_schema is not None:
            body["text"] = {
                "format": {
                    "type": "json_schema",
                    "name": request.output_name,
                    "schema": request.output_schema,
                    "strict": strict_compatible(request.output_schema),
                }
            }
        if self.reasoning is not None:
            body["reasoning"] = dict(self.reasoning)
        if self.store is not None:
            body["store"] = self.store
        if self.include_encrypted_reasoning:
            body["include"] = [ENCRYPTED_REASONING]
        body.update(settings.extra)
        return body

    def _tool(self, name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
        tool: dict[str, Any] = {
            "type": "function",
            "name": name,
            "description": description,
            "parameters": parameters,
        }
        if self.strict_tools is not None:
            tool["strict"] = self.strict_tools
        return tool

    def _items(self, message: Message) -> list[dict[str, Any]]:
        """The input items of one message, in part order (consecutive text joined).

        Images and documents join the content of the message they are in (a
        list of ``input_text`` / ``input_image`` / ``input_file`` blocks), or,
        right after a tool result, that result's ``output``.
        """
        items: list[dict[str, Any]] = []
        content: list[TextPart | ImagePart | DocumentPart] = []
        output: dict[str, Any] | None = None  # the result the next media parts belong to

        def flush() -> None:
            parts = [p for p in content if not isinstance(p, TextPart) or p.text]
            content.clear()
            if not parts:
                return
            role = "assistant" if message.role == "assistant" else "user"
            texts = [p.text for p in parts if isinstance(p, TextPart)]
            if len(texts) == len(parts):
                items.append({"role": role, "content": "".join(texts)})
            else:
                items.append({"role": role, "content": [self._block(p) for p in parts]})

        for part in message.parts:
            if isinstance(part, ImagePart | DocumentPart | AudioPart):
                media = self._check_media(message, part)
                if output is not None:
                    output["output"].append(self._block(media))
                else:
                    content.append(media)
                continue
            output = None
            if isinstance(part, TextPart):
                content.append(part)
                continue
            flush()
            if isinstance(part, ToolCallPart):
                items.append(
                    {
                        "type": "function_call",
                        "call_id": part.call_id,
                        "name": part.name,
                        # the API wants a JSON string; a call that had no arguments has "{}"
                        "arguments": part.raw_arguments if part.raw_arguments.strip() else "{}",
                    }
                )
            elif isinstance(part, ToolResultPart):
                item: dict[str, Any] = {
                    "type": "function_call_output",
                    "call_id": part.call_id,
                    "output": part.content,
                }
                if message.result_media(part.call_id):
                    text = [{"type": "input_text", "text": part.content}] if part.content else []
                    item["output"] = text
                    output = item
                items.append(item)
            elif isinstance(part, ReasoningPart):
                reasoning = self._reasoning_item(part)
                if reasoning is not None:
                    items.append(reasoning)
        flush()
        return items

    def _check_media(
        self, message: Message, part: ImagePart | DocumentPart | AudioPart
    ) -> ImagePart | DocumentPart:
        """Raise for media the API cannot take where it is (see the module docs)."""
        if message.role in ("assistant", "system"):
            raise unsendable(self.name, part, _USER_OR_RESULT_MEDIA)
        if isinstance(part, AudioPart):
            raise unsendable(self.name, part, "the Responses API takes no audio input")
        if isinstance(part, ImagePart) and part.data and image_type(part) not in IMAGE_TYPES:
            raise unsendable(self.name, part, _IMAGE_TYPES_TAKEN)
        if isinstance(part, DocumentPart) and part.data and not openai_file_type(part.media_type):
            raise unsendable(self.name, part, _FILE_TYPES_TAKEN)
        return part

    def _block(self, part: TextPart | ImagePart | DocumentPart) -> dict[str, Any]:
        """One content block of a message or of a tool result's output."""
        if isinstance(part, TextPart):
            return {"type": "input_text", "text": part.text}
        if isinstance(part, ImagePart):
            url = part.url if part.data is None else data_url(image_type(part), part.data)
            return {"type": "input_image", "image_url": url, "detail": part.detail or "auto"}
        if part.data is None:
            block: dict[str, Any] = {"type": "input_file", "file_url": part.url}
            if part.title:
                block["filename"] = part.title
            return block
        return {
            "type": "input_file",
            "filename": part.title or default_filename(part.media_type),
            "file_data": data_url(part.media_type, part.data),
        }

    def _reasoning_item(self, part: ReasoningPart) -> dict[str, Any] | None:
        """The reasoning item to echo, or ``None`` when the part cannot be sent back."""
        data = part.provider_data
        if data.get("type") != "reasoning":
            return None  # reasoning from another provider
        item_id = data.get("id")
        encrypted = data.get("encrypted_content")
        if not isinstance(item_id, str) and not encrypted:
            return None  # neither an id the server knows nor the content itself
        if self.store is False and not encrypted:
            return None  # not stored server-side and not carried: unresolvable
        item: dict[str, Any] = {"type": "reasoning"}
        if isinstance(item_id, str):
            item["id"] = item_id
        item["summary"] = data.get("summary") or []
        if encrypted:
            item["encrypted_content"] = encrypted
        return item

    # -- blocking reply ----------------------------------------------------------------

    def parse_response(self, data: Any) -> ModelResponse:
        """A ``response`` object as a :class:`ModelResponse`.

        Raises:
            ProviderError: the response says it failed (``error`` set).
            KeyError, TypeError, ValueError: it is malformed (the base turns
                these into :class:`MalformedResponseError`).
        """
        response = expect_object(data, "response")
        error = response.get("error")
        if error is not None:
            raise self.stream_error({"type": "response.failed", "response": response})
        return self._assemble(response, expect_list(response.get("output"), "output"))

    def _assemble(self, response: dict[str, Any], output: list[Any]) -> ModelResponse:
        parts: list[Part] = []
        calls = 0
        refused = False
        for raw in output:
            item = expect_object(raw, "output item")
            kind = item.get("type")
            if kind == "message":
                for raw_block in expect_list(item.get("content") or [], "content"):
                    block = expect_object(raw_block, "content block")
                    if block.get("type") == "output_text":
                        parts.append(TextPart(expect_str(block.get("text"), "output_text.text")))
                    elif block.get("type") == "refusal":
                        parts.append(TextPart(expect_str(block.get("refusal"), "refusal")))
                        refused = True
            elif kind == "function_call":
                parts.append(
                    ToolCallPart.parse(
                        expect_str(item.get("call_id"), "call_id"),
                        expect_str(item.get("name"), "name"),
                        expect_str(item.get("arguments") or "", "arguments"),
                    )
                )
                calls += 1
            elif kind == "reasoning":
                parts.append(_reasoning_part(item))
        return ModelResponse(
            parts=tuple(parts),
            usage=_usage(response.get("usage")),
            finish_reason=_finish_reason(response, calls, refused=refused),
            model=response.get("model") if isinstance(response.get("model"), str) else None,
        )

    # -- stream ------------------------------------------------------------------------

    async def parse_stream(self, events: AsyncIterator[SSEEvent], emit: ChunkSink) -> ModelResponse:
        """Consume a ``/responses`` event stream, emitting deltas; see the module docs.

        Raises:
            ProviderError: a typed error for ``response.failed`` / ``error``.
            MalformedResponseError: the stream ended before its final event.
        """
        state = _StreamState()
        async for event in events:
            if not event.data.strip() or event.data.strip() == "[DONE]":
                continue
            data = expect_object(decode_body(event.data), "event")
            kind = data.get("type", event.event)
            if kind in ("response.completed", "response.incomplete"):
                response = expect_object(data.get("response"), "response")
                output = response.get("output")
                if not output:
                    output = state.assembled()
                return self._assemble(response, expect_list(output, "output"))
            if kind in ("response.failed", "error"):
                raise self.stream_error(data)
            await state.feed(kind, data, emit)
        raise MalformedResponseError(
            "the stream ended before response.completed", provider=self.provider
        )

    def stream_error(self, data: Any) -> ProviderError:
        """The typed error for a ``response.failed`` or ``error`` event."""
        error: Any = data
        if isinstance(data, dict):
            response = data.get("response")
            if isinstance(response, dict):
                error = response.get("error") or {"message": f"status {response.get('status')}"}
            elif isinstance(data.get("error"), dict):
                error = data["error"]
        if not isinstance(error, dict):
            error = {"message": str(error)[:500]}
        code = error.get("code") if error.get("code") is not None else error.get("type")
        status = _STREAM_ERROR_STATUS.get(code, 500) if isinstance(code, str) else 500
        message = error.get("message") or "the response failed"
        body = msgspec.json.encode({"error": {"message": str(message), "code": code}})
        return error_from_response(self.provider, status, body, httpx.Headers())


class _StreamState:
    """What a stream has shown so far: items by output index, deltas emitted."""

    def __init__(self) -> None:
        self.items: dict[int, dict[str, Any]] = {}
        self.texts: dict[tuple[int, int], list[str]] = {}
        self.text_kinds: dict[tuple[int, int], str] = {}  # "output_text" or "refusal"
        self.arguments: dict[int, list[str]] = {}
        self.tool_index: dict[int, int] = {}
        self.summary_index: dict[int, int] = {}
        self.reasoning_sent: dict[int, list[str]] = {}  # reasoning text emitted, per item

    async def feed(self, kind: Any, data: dict[str, Any], emit: ChunkSink) -> None:
        if kind == "response.output_item.added":
            index = expect_int(data.get("output_index"))
            item = dict(expect_object(data.get("item"), "item"))
            self.items[index] = item
            if item.get("type") == "function_call":
                self.tool_index[index] = len(self.tool_index)
                arguments = expect_str(item.get("arguments") or "", "arguments")
                self.arguments[index] = [arguments]
                await emit(
                    ToolCallChunk(
                        self.tool_index[index],
                        expect_str(item.get("call_id"), "call_id"),
                        expect_str(item.get("name"), "name"),
                        arguments,
                    )
                )
        elif kind in ("response.output_text.delta", "response.refusal.delta"):
            delta = expect_str(data.get("delta"), "delta")
            key = (expect_int(data.get("output_index")), expect_int(data.get("content_index", 0)))
            self.texts.setdefault(key, []).append(delta)
            self.text_kinds[key] = "refusal" if kind == "response.refusal.delta" else "output_text"
            if delta:
                await emit(TextChunk(delta))
        elif kind == "response.function_call_arguments.delta":
            index = expect_int(data.get("output_index"))
            delta = expect_str(data.get("delta"), "delta")
            if index not in self.tool_index:
                raise ValueError(f"arguments for output {index}, which is no function call")
            self.arguments[index].append(delta)
            if delta:
                await emit(ToolCallChunk(self.tool_index[index], arguments_delta=delta))
        elif kind in ("response.reasoning_summary_text.delta", "response.reasoning_text.delta"):
            await self._reasoning_delta(data, emit)
        elif kind == "response.output_item.done":
            index = expect_int(data.get("output_index"))
            item = expect_object(data.get("item"), "item")
            self.items[index] = item
            if item.get("type") == "message":
                await self._rest_of_text(index, item, emit)
            elif item.get("type") == "reasoning":
                # A summary a server sent whole, only at the end: show the rest.
                sent = "".join(self.reasoning_sent.get(index, []))
                final = _reasoning_part(item).text
                if final.startswith(sent) and len(final) > len(sent):
                    self.reasoning_sent.setdefault(index, []).append(final[len(sent) :])
                    await emit(ReasoningChunk(final[len(sent) :]))
            if index in self.tool_index:
                # Arguments a server sent whole, only at the end: show the rest.
                sent = "".join(self.arguments[index])
                final = expect_str(item.get("arguments") or "", "arguments")
                if final.startswith(sent) and len(final) > len(sent):
                    self.arguments[index].append(final[len(sent) :])
                    await emit(
                        ToolCallChunk(self.tool_index[index], arguments_delta=final[len(sent) :])
                    )

    async def _rest_of_text(self, index: int, item: dict[str, Any], emit: ChunkSink) -> None:
        """Emit what a finished message holds beyond its deltas (text a server sent whole)."""
        for position, raw_block in enumerate(expect_list(item.get("content") or [], "content")):
            block = expect_object(raw_block, "content block")
            kind = block.get("type")
            if kind not in ("output_text", "refusal"):
                continue
            final = expect_str(block.get("text" if kind == "output_text" else "refusal"), kind)
            key = (index, position)
            sent = "".join(self.texts.get(key, []))
            if final.startswith(sent) and len(final) > len(sent):
                self.texts.setdefault(key, []).append(final[len(sent) :])
                self.text_kinds.setdefault(key, kind)
                await emit(TextChunk(final[len(sent) :]))

    async def _reasoning_delta(self, data: dict[str, Any], emit: ChunkSink) -> None:
        delta = expect_str(data.get("delta"), "delta")
        index = expect_int(data.get("output_index"))
        part = data.get("summary_index", data.get("content_index", 0))
        previous = self.summary_index.get(index)
        self.summary_index[index] = current = expect_int(part, "index")
        sent = self.reasoning_sent.setdefault(index, [])
        if previous is not None and previous != current:
            sent.append("\n\n")
            await emit(ReasoningChunk("\n\n"))  # summary parts are joined by a blank line
        if delta:
            sent.append(delta)
            await emit(ReasoningChunk(delta))

    def assembled(self) -> list[dict[str, Any]]:
        """The output items as the stream built them, for a final event without ``output``."""
        output = []
        for index in sorted(self.items):
            item = dict(self.items[index])
            if item.get("type") == "function_call" and not item.get("arguments"):
                item["arguments"] = "".join(self.arguments.get(index, []))
            if item.get("type") == "message" and not item.get("content"):
                blocks = sorted(k for k in self.texts if k[0] == index)
                item["content"] = [
                    _block(self.text_kinds.get(k), "".join(self.texts[k])) for k in blocks
                ]
            output.append(item)
        return output


# -- small pure helpers -----------------------------------------------------------------


def _block(kind: str | None, text: str) -> dict[str, Any]:
    """A message content block as a blocking reply holds it."""
    if kind == "refusal":
        return {"type": "refusal", "refusal": text}
    return {"type": "output_text", "text": text}


def _text_of(value: Any, what: str) -> str:
    """The ``text`` of a summary or content part (empty if it has none)."""
    return expect_str(expect_object(value, what).get("text") or "", f"{what} text")


def _reasoning_part(item: dict[str, Any]) -> ReasoningPart:
    summary = expect_list(item.get("summary") or [], "summary")
    texts = [
        expect_str(expect_object(s, "summary part").get("text") or "", "summary text")
        for s in summary
    ]
    if not any(texts):  # models that show raw reasoning text instead of a summary
        content = expect_list(item.get("content") or [], "reasoning content")
        texts = [
            expect_str(expect_object(c, "reasoning text").get("text") or "", "text")
            for c in content
        ]
    data: dict[str, Any] = {
        "type": "reasoning",
        "id": expect_str(item.get("id"), "reasoning id"),
        "summary": summary,
    }
    if item.get("encrypted_content"):
        data["encrypted_content"] = item["encrypted_content"]
    return ReasoningPart(text="\n\n".join(t for t in texts if t), provider_data=data)


def _usage(raw: Any) -> Usage:
    if not isinstance(raw, dict):
        return Usage()
    inputs = raw.get("input_tokens_details")
    outputs = raw.get("output_tokens_details")
    return Usage(
        input_tokens=count(raw.get("input_tokens")),
        output_tokens=count(raw.get("output_tokens")),
        cache_read_tokens=count(inputs.get("cached_tokens")) if isinstance(inputs, dict) else 0,
        reasoning_tokens=(
            count(outputs.get("reasoning_tokens")) if isinstance(outputs, dict) else 0
        ),
    )


def _finish_reason(response: dict[str, Any], calls: int, *, refused: bool) -> str | None:
    status = response.get("status")
    if status == "completed" or status is None:
        if refused:
            return "content_filter"
        return "tool_calls" if calls else "stop"
    if status == "incomplete":
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        if reason == "max_output_tokens":
            return "length"
        if reason == "content_filter":
            return "content_filter"
        return str(reason) if reason else "incomplete"
    return str(status)
