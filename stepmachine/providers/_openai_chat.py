"""OpenAI Chat Completions and OpenAI-compatible servers (``POST {base_url}/chat/completions``).

:class:`OpenAIChatModel` talks to OpenAI itself; :class:`OpenAICompatibleModel`
to the many servers that speak the same schema (Ollama, vLLM, llama.cpp's
``llama-server``, GPUStack, Groq, OpenRouter, ...), with their deviations:

* reasoning arrives in a non-standard ``reasoning`` or ``reasoning_content``
  field (message or delta); it becomes a :class:`~stepmachine.ReasoningPart`
  whose ``provider_data`` records the field (``{"field": "reasoning"}``), and
  the compatible adapter echoes it back in that same field on the next request
  (``send_reasoning=False`` turns that off, e.g. for servers that reject it);
* OpenRouter's structured ``reasoning_details`` (reasoning text with its
  signature, summaries, encrypted reasoning) are kept whole in that part's
  ``provider_data["reasoning_details"]`` -- streamed pieces merged per
  ``index``, text fields concatenated -- and sent back unchanged in the
  assistant turn's ``reasoning_details``, as Anthropic thinking signatures are
  (a model that signed its reasoning needs it back, e.g. between tool calls);
* a streamed tool call may arrive whole in one chunk, repeat its id and name on
  every delta, carry no id at all (a stable id is derived from the response id
  and the call's position, or from its content when the response has no id) or
  reuse an id already used in the same response (made unique with a suffix);
* ``tool_calls: []``, ``choices: []`` usage chunks, integer ``error.code``,
  llama.cpp's ``timings`` (used for token counts when no ``usage`` is sent),
  servers that need no model name (pass ``model=""`` and no ``model`` field is
  sent) and streams that end without ``data: [DONE]`` after a finish reason.

Mapping decisions (both adapters):

* The system prompt (prompt parts, then ``system`` messages in place) is sent
  with role ``system``; ``system_role="developer"`` sends it as ``developer``
  (OpenAI maps ``system`` to ``developer`` for reasoning models itself, while
  some models, e.g. ``o1-mini``, reject ``developer``).
* Each tool result is one ``role: tool`` message with its ``tool_call_id``.
  The ``is_error`` flag has no wire field; the content is sent as is.
* A refusal (``message.refusal``) is returned as text, so the user sees it, and
  the finish reason becomes ``"content_filter"``, so a structured-output step
  knows the text is not the requested JSON.
* ``usage.input_tokens`` is ``prompt_tokens`` (cached tokens included, also
  reported as ``cache_read_tokens``); reasoning tokens come from
  ``completion_tokens_details.reasoning_tokens``.
* Structured output uses ``response_format: json_schema`` named
  ``request.output_name``; ``strict`` is true when the schema qualifies for
  OpenAI's strict mode (every object closed and fully required) unless
  ``strict_output`` says otherwise.
* Only the first choice (``index`` 0) is read; with ``n`` > 1 the others are
  ignored, in a blocking reply and in a stream alike.

Media (both adapters), in a ``user`` message only; the message's ``content``
becomes a list of parts in the message's order:

* :class:`~stepmachine.ImagePart` -> ``{type: "image_url", image_url: {url,
  detail?}}``: its URL, or its bytes as a ``data:<media_type>;base64,...``
  URL (PNG, JPEG, GIF or WebP); ``detail`` when the part sets one;
* :class:`~stepmachine.DocumentPart` -> ``{type: "file", file: {file_data,
  filename}}``: PDF bytes as a data URL, the part's ``title`` as the file
  name (``document.pdf`` without one). Chat Completions takes no file URL and
  no other file type;
* :class:`~stepmachine.AudioPart` -> ``{type: "input_audio", input_audio:
  {data, format}}``: WAV or MP3 bytes in base64 (audio-capable models only);
* the ``cache`` hint has no wire field (OpenAI caches prompt prefixes itself).

Anything else is a :class:`~stepmachine.ConfigurationError` before any
request, naming the part: a document by URL or not a PDF, audio by URL or not
WAV/MP3, an image type other than those four, media in a system or assistant
message, and images or documents in a tool result (OpenAI refuses them in
``tool`` messages: ``result_media`` is empty). Whether a compatible server's
model reads images (or fetches remote URLs) is the server's to say.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Literal

import anyio
import httpx
import msgspec

from .._errors import ConfigurationError
from .._media import MEDIA_PARTS, AudioPart, DocumentPart, ImagePart
from .._messages import Message, Part, ReasoningPart, TextPart, ToolCallPart
from .._model import (
    ChunkSink,
    ModelRequest,
    ModelResponse,
    ReasoningChunk,
    StreamChunk,
    TextChunk,
    ToolCallChunk,
    Usage,
)
from ._errors import MalformedResponseError, ProviderError, error_from_response
from ._http import DEFAULT_TIMEOUT, HTTPModel, RetryPolicy, Secret, SSEEvent, refuse_missing_key
from ._media_wire import (
    IMAGE_TYPES,
    PDF,
    b64,
    data_url,
    default_filename,
    image_type,
    unsendable,
)
from ._wire import decode_arguments, decode_body, strict_compatible

__all__ = ["OpenAIChatModel", "OpenAICompatibleModel"]

OPENAI_BASE_URL = "https://api.openai.com/v1"
_REASONING_FIELDS = ("reasoning", "reasoning_content")
_FINISH = {"function_call": "tool_calls"}
_DETAIL_TEXT = frozenset({"text", "summary", "data", "signature"})  # streamed in pieces
_AUDIO_FORMATS = {
    "audio/wav": "wav",
    "audio/x-wav": "wav",
    "audio/wave": "wav",
    "audio/vnd.wave": "wav",
    "audio/mpeg": "mp3",
    "audio/mp3": "mp3",
}
_ONLY_USER_MEDIA = (
    "Chat Completions takes images, files and audio in user messages only (a tool result's "
    "images are refused by OpenAI: use OpenAIResponsesModel or AnthropicModel for those)"
)
_IMAGE_TYPES_TAKEN = "Chat Completions takes PNG, JPEG, GIF and WebP images"
_NO_FILE_URL = (
    "Chat Completions takes files as bytes only (file_data), not by URL: fetch the bytes, "
    "or use OpenAIResponsesModel (file_url)"
)
_PDF_ONLY = (
    "Chat Completions takes PDF files only: send a text file's contents as text, "
    "or use OpenAIResponsesModel"
)
_AUDIO_TAKEN = "Chat Completions takes audio as WAV or MP3 bytes (input_audio), not by URL"


class OpenAIChatModel(HTTPModel):
    """OpenAI Chat Completions; see the module docs for the mapping.

    Args:
        model: the model name, e.g. ``"gpt-4.1"``.
        api_key: the key; default ``$OPENAI_API_KEY``. Required for the default
            base URL (:class:`~stepmachine.ConfigurationError` otherwise).
        base_url: the API root; default ``$OPENAI_BASE_URL``, else
            ``https://api.openai.com/v1``.
        client: see :class:`HTTPModel`.
        retry: see :class:`HTTPModel`.
        timeout: see :class:`HTTPModel`.
        headers: see :class:`HTTPModel`.
        sleep: see :class:`HTTPModel`.
        rng: see :class:`HTTPModel`.
        system_role: ``"system"`` (default) or ``"developer"``.
        strict_output: force ``strict`` on or off for structured output;
            ``None`` decides from the schema.
    """

    provider = "openai"
    path = "/chat/completions"
    key_variable = "OPENAI_API_KEY"
    default_base_url = OPENAI_BASE_URL
    media = frozenset({ImagePart, DocumentPart, AudioPart})
    result_media: frozenset[type] = frozenset()  # OpenAI refuses images in tool messages
    max_tokens_field = "max_completion_tokens"
    #: ``content`` of an assistant turn that has no text (only tool calls).
    empty_assistant_content: str | None = None
    #: Whether a stream must end with ``data: [DONE]`` (else a finish reason will do).
    require_done = True
    send_reasoning = False

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
        system_role: Literal["system", "developer"] = "system",
        strict_output: bool | None = None,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        url = base_url or os.environ.get("OPENAI_BASE_URL") or OPENAI_BASE_URL
        refuse_missing_key(  # at once here; the other adapters before their first request
            type(self).__name__,
            key,
            url,
            default_url=self.default_base_url,
            variable=self.key_variable,
            headers=headers,
        )
        super().__init__(
            model,
            api_key=key,
            base_url=url,
            client=client,
            retry=retry,
            timeout=timeout,
            headers=headers,
            sleep=sleep,
            rng=rng,
        )
        self.system_role = system_role
        self.strict_output = strict_output

    # -- request ---------------------------------------------------------------------

    def build_body(self, request: ModelRequest, *, stream: bool) -> dict[str, Any]:
        """The Chat Completions body for ``request`` (``settings.extra`` merged last)."""
        body: dict[str, Any] = {}
        if self.model:
            body["model"] = self.model
        body["messages"] = self._messages(request)
        if request.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description,
                        "parameters": tool.parameters,
                    },
                }
                for tool in request.tools
            ]
        settings = request.settings
        if settings.max_tokens is not None:
            body[self.max_tokens_field] = settings.max_tokens
        if settings.temperature is not None:
            body["temperature"] = settings.temperature
        if request.output_schema is not None:
            strict = self.strict_output
            if strict is None:
                strict = strict_compatible(request.output_schema)
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {
                    "name": request.output_name,
                    "schema": request.output_schema,
                    "strict": strict,
                },
            }
        body["stream"] = stream
        if stream:
            body["stream_options"] = {"include_usage": True}
        body.update(settings.extra)
        return body

    def _messages(self, request: ModelRequest) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if request.system_prompt:
            out.append({"role": self.system_role, "content": request.system_prompt})
        for message in request.messages:
            media = [p for p in message.parts if isinstance(p, MEDIA_PARTS)]
            if media and message.role != "user":
                raise unsendable(self.name, media[0], _ONLY_USER_MEDIA)
            if message.role == "assistant":
                out.append(self._assistant(message))
                continue
            out.extend(
                {"role": "tool", "tool_call_id": part.call_id, "content": part.content}
                for part in message.tool_results
            )
            if media:
                content = [
                    self._content_part(p)
                    for p in message.parts
                    if isinstance(p, TextPart | ImagePart | DocumentPart | AudioPart)
                ]
                out.append({"role": "user", "content": content})
                continue
            texts = [p.text for p in message.parts if isinstance(p, TextPart)]
            if texts or (message.role != "tool" and not message.tool_results):
                role = self.system_role if message.role == "system" else "user"
                out.append({"role": role, "content": _content(texts)})
        return out

    def _content_part(
        self, part: TextPart | ImagePart | DocumentPart | AudioPart
    ) -> dict[str, Any]:
        """A text, image, PDF or audio part of a user message as a content part.

        Raises:
            ConfigurationError: a part Chat Completions cannot take in this form
                (see the module docs).
        """
        if isinstance(part, ImagePart):
            return {"type": "image_url", "image_url": self._image_url(part)}
        if isinstance(part, DocumentPart):
            return {"type": "file", "file": self._file(part)}
        if isinstance(part, AudioPart):
            return {"type": "input_audio", "input_audio": self._audio(part)}
        return {"type": "text", "text": part.text}

    def _image_url(self, part: ImagePart) -> dict[str, Any]:
        if part.data is not None and image_type(part) not in IMAGE_TYPES:
            raise unsendable(self.name, part, _IMAGE_TYPES_TAKEN)
        url = part.url if part.data is None else data_url(image_type(part), part.data)
        image: dict[str, Any] = {"url": url}
        if part.detail is not None:
            image["detail"] = part.detail
        return image

    def _file(self, part: DocumentPart) -> dict[str, Any]:
        if part.data is None:
            raise unsendable(self.name, part, _NO_FILE_URL)
        if part.media_type != PDF:
            raise unsendable(self.name, part, _PDF_ONLY)
        return {
            "file_data": data_url(PDF, part.data),
            "filename": part.title or default_filename(PDF),
        }

    def _audio(self, part: AudioPart) -> dict[str, Any]:
        audio_format = _AUDIO_FORMATS.get(part.media_type)
        if part.data is None or audio_format is None:
            raise unsendable(self.name, part, _AUDIO_TAKEN)
        return {"data": b64(part.data), "format": audio_format}

    def _assistant(self, message: Message) -> dict[str, Any]:
        text = "".join(p.text for p in message.parts if isinstance(p, TextPart))
        calls = message.tool_calls
        wire: dict[str, Any] = {
            "role": "assistant",
            "content": text if text or not calls else self.empty_assistant_content,
        }
        if calls:
            wire["tool_calls"] = [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {
                        "name": call.name,
                        "arguments": call.raw_arguments if call.raw_arguments.strip() else "{}",
                    },
                }
                for call in calls
            ]
        if self.send_reasoning:
            details = [
                detail
                for p in message.parts
                if isinstance(p, ReasoningPart)
                and isinstance(p.provider_data.get("reasoning_details"), list)
                for detail in p.provider_data["reasoning_details"]
            ]
            if details:
                wire["reasoning_details"] = details
            for field in _REASONING_FIELDS:
                texts = [
                    p.text
                    for p in message.parts
                    if isinstance(p, ReasoningPart) and p.provider_data.get("field") == field
                ]
                if texts:
                    wire[field] = "".join(texts)
        return wire

    # -- blocking reply ----------------------------------------------------------------

    def parse_response(self, data: Any) -> ModelResponse:
        """A ``chat.completion`` object as a response.

        Raises:
            ProviderError: the body is an error object (some servers answer 200).
            TypeError, ValueError: the body is not a completion (the base turns
                these into :class:`MalformedResponseError`).
        """
        if not isinstance(data, dict):
            raise TypeError(f"expected a JSON object, got {type(data).__name__}")
        if data.get("error") is not None:
            raise self.stream_error(data)
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise ValueError("the reply has no choices")
        # n > 1: the choice whose index is 0 (else the first), as a stream is read
        choice = next(
            (c for c in choices if isinstance(c, dict) and c.get("index") == 0), choices[0]
        )
        message = choice.get("message")
        if not isinstance(message, dict):
            raise TypeError("the first choice has no message")
        acc = _Accumulator()
        acc.read_header(data)
        acc.read_reasoning(message)
        acc.read_details(message)
        acc.text.append(_text(message.get("content")))
        acc.refusal.append(_str(message.get("refusal")))
        for position, raw in enumerate(_list(message.get("tool_calls"))):
            call = _dict(raw)
            # Whole calls: the wire index (Ollama sends one) is ignored, the position counts.
            acc.feed_call({**call, "index": position})
        acc.finish_reason = _str(choice.get("finish_reason")) or None
        return acc.response()

    # -- stream ------------------------------------------------------------------------

    async def parse_stream(self, events: AsyncIterator[SSEEvent], emit: ChunkSink) -> ModelResponse:
        """Consume ``chat.completion.chunk`` events; return the blocking-equivalent response.

        Raises:
            ProviderError: an error payload inside the stream (typed by its code).
            MalformedResponseError: the stream held no chunk, or ended before
                ``[DONE]`` (or, when ``require_done`` is false, before any finish reason).

        After ``[DONE]`` or an error the rest of the stream is still read (servers
        close it at once), so no half-read HTTP stream is left to the garbage
        collector. Cancellation: the stream is abandoned; emitted chunks stay emitted.
        """
        acc = _Accumulator()
        done = False
        chunks = 0
        async for event in events:
            data = event.data.strip()
            if done or not data:
                continue  # after [DONE]: read on to the end, so the HTTP stream closes
            if data == "[DONE]":
                done = True
                continue
            chunks += 1
            for chunk in acc.feed(self._chunk_payload(event.event, data)):
                await emit(chunk)
        if not chunks:
            raise MalformedResponseError(
                "the stream held no completion chunk", provider=self.provider
            )
        if not done and (self.require_done or acc.finish_reason is None):
            raise MalformedResponseError(
                "the stream ended before its final event (data: [DONE])", provider=self.provider
            )
        return acc.response()

    def _chunk_payload(self, event: str, data: str) -> dict[str, Any]:
        """One chunk's JSON; raises the typed error for an error payload."""
        payload = decode_body(data)
        if not isinstance(payload, dict):
            raise TypeError(f"a stream chunk is not a JSON object: {data[:80]!r}")
        if payload.get("error") is not None or event == "error":
            raise self.stream_error(payload)
        return payload

    def stream_error(self, data: Any) -> ProviderError:
        """The typed error for an error object (an integer ``code`` is used as the status)."""
        error = data.get("error") if isinstance(data, dict) else None
        code = error.get("code") if isinstance(error, dict) else None
        status = code if isinstance(code, int) and 400 <= code <= 599 else 500
        return error_from_response(
            self.provider, status, msgspec.json.encode(data), httpx.Headers()
        )


class OpenAICompatibleModel(OpenAIChatModel):
    """A server speaking the Chat Completions schema (Ollama, vLLM, llama.cpp, Groq, ...).

    Args:
        model: the model name; ``""`` sends no ``model`` field (single-model servers).
        base_url: the API root including ``/v1`` where the server uses it, e.g.
            ``http://localhost:11434/v1``; default ``$OPENAI_COMPATIBLE_BASE_URL``;
            required (:class:`~stepmachine.ConfigurationError` otherwise).
        api_key: default ``$OPENAI_COMPATIBLE_API_KEY``; optional (no
            ``Authorization`` header without it).
        send_reasoning: echo reasoning back in the field it arrived in.

    The other arguments are those of :class:`OpenAIChatModel`. ``max_tokens`` is sent as
    ``max_tokens`` (the field every such server reads).
    """

    provider = "openai_compatible"
    key_variable = "OPENAI_COMPATIBLE_API_KEY"
    default_base_url = ""  # a server of the user's own: a key is optional
    max_tokens_field = "max_tokens"
    empty_assistant_content = ""
    require_done = False
    send_reasoning = True

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | Secret | None = None,
        client: httpx.AsyncClient | None = None,
        retry: RetryPolicy | None = None,
        timeout: httpx.Timeout = DEFAULT_TIMEOUT,
        headers: Mapping[str, str] | None = None,
        system_role: Literal["system", "developer"] = "system",
        strict_output: bool | None = None,
        send_reasoning: bool = True,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        url = base_url or os.environ.get("OPENAI_COMPATIBLE_BASE_URL")
        if not url:
            raise ConfigurationError(
                "OpenAICompatibleModel needs the server's base URL: pass base_url=... "
                "(e.g. 'http://localhost:11434/v1') or set OPENAI_COMPATIBLE_BASE_URL"
            )
        key = api_key if api_key is not None else os.environ.get("OPENAI_COMPATIBLE_API_KEY")
        super().__init__(
            model,
            api_key=key or "",
            base_url=url,
            client=client,
            retry=retry,
            timeout=timeout,
            headers=headers,
            system_role=system_role,
            strict_output=strict_output,
            sleep=sleep,
            rng=rng,
        )
        self.send_reasoning = send_reasoning


# -- assembling one response (shared by the blocking and streaming paths) ----------------


class _Call:
    """One tool call being assembled; ``wire_id`` is the id as the server sent it."""

    __slots__ = ("arguments", "call_id", "index", "name", "wire_id")

    def __init__(self, index: int) -> None:
        self.wire_id: str | None = None
        self.call_id: str | None = None  # unique within the response
        self.name = ""
        self.arguments: list[str] = []
        self.index = index  # the wire index, for id generation

    def complete(self) -> bool:
        try:
            decode_arguments("".join(self.arguments))
        except msgspec.DecodeError:
            return False
        return True


class _Accumulator:
    """One response, read whole or chunk by chunk; :meth:`response` assembles it."""

    def __init__(self) -> None:
        self.response_id = ""
        self.model: str | None = None
        self.reasoning: list[str] = []
        self.reasoning_field: str | None = None
        self.details: dict[int, dict[str, Any]] = {}
        self.text: list[str] = []
        self.refusal: list[str] = []
        self.calls: list[_Call] = []
        self.slots: dict[int, _Call] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.timings: dict[str, Any] | None = None

    def read_header(self, payload: dict[str, Any]) -> None:
        if not self.response_id:
            self.response_id = _str(payload.get("id"))
        if self.model is None:
            self.model = _str(payload.get("model")) or None
        usage = payload.get("usage")
        if not isinstance(usage, dict):
            usage = _dict(payload.get("x_groq")).get("usage")  # Groq streams put it there
        if isinstance(usage, dict):
            self.usage = usage
        if isinstance(payload.get("timings"), dict):
            self.timings = payload["timings"]

    def read_reasoning(self, source: dict[str, Any]) -> str:
        for field in _REASONING_FIELDS:
            piece = _str(source.get(field))
            if piece and self.reasoning_field in (None, field):
                self.reasoning_field = field
                self.reasoning.append(piece)
                return piece
        return ""

    def read_details(self, source: dict[str, Any]) -> None:
        """Merge ``reasoning_details`` pieces by their ``index`` (else their position)."""
        for position, raw in enumerate(_list(source.get("reasoning_details"))):
            piece = _dict(raw)
            index = piece.get("index")
            key = index if isinstance(index, int) and not isinstance(index, bool) else position
            merged = self.details.setdefault(key, {})
            for name, value in piece.items():
                before = merged.get(name)
                if name in _DETAIL_TEXT and isinstance(value, str) and isinstance(before, str):
                    merged[name] = before + value
                elif value is not None or name not in merged:
                    merged[name] = value

    def feed(self, payload: dict[str, Any]) -> list[StreamChunk]:
        """Read one chunk; return the deltas to emit."""
        self.read_header(payload)
        out: list[StreamChunk] = []
        for raw_choice in _list(payload.get("choices")):
            choice = _dict(raw_choice)
            index = choice.get("index")
            if isinstance(index, int) and index != 0:
                continue  # only the first choice is read
            delta = _dict(choice.get("delta"))
            self.read_details(delta)
            reasoning = self.read_reasoning(delta)
            if reasoning:
                out.append(ReasoningChunk(reasoning))
            for field, sink in (("content", self.text), ("refusal", self.refusal)):
                piece = _text(delta.get(field))
                if piece:
                    sink.append(piece)
                    out.append(TextChunk(piece))
            for raw_call in _list(delta.get("tool_calls")):
                chunk = self.feed_call(_dict(raw_call))
                if chunk is not None:
                    out.append(chunk)
            finish = _str(choice.get("finish_reason"))
            if finish:
                self.finish_reason = finish
        return out

    def feed_call(self, delta: dict[str, Any]) -> ToolCallChunk | None:
        """Read one tool-call delta (or whole call); return the chunk to emit, if any."""
        index = delta.get("index")
        wire_id = _str(delta.get("id")) or None
        function = _dict(delta.get("function"))
        name = _str(function.get("name"))
        arguments = _arguments(function.get("arguments"))
        call: _Call | None = None
        if isinstance(index, int) and index in self.slots:
            call = self.slots[index]
            if wire_id and call.wire_id and wire_id != call.wire_id and call.complete():
                call = None  # a server that numbers every whole call 0: a new call
        elif not isinstance(index, int):
            known = [c for c in self.calls if wire_id and c.wire_id == wire_id]
            if known:
                call = known[0]
            elif not wire_id and self.calls:
                call = self.calls[-1]
        new = call is None
        if call is None:
            call = _Call(index if isinstance(index, int) else len(self.calls))
            self.calls.append(call)
        if isinstance(index, int):
            self.slots[index] = call
        chunk_id = chunk_name = None
        if wire_id and not call.wire_id:
            call.wire_id = wire_id
            taken = {c.call_id for c in self.calls if c is not call}
            call.call_id = chunk_id = wire_id if wire_id not in taken else f"{wire_id}_{call.index}"
        if name and not call.name:
            call.name = chunk_name = name
        if arguments:
            call.arguments.append(arguments)
        if not (new or chunk_id or chunk_name or arguments):
            return None
        return ToolCallChunk(self.calls.index(call), chunk_id, chunk_name, arguments)

    def response(self) -> ModelResponse:
        parts: list[Part] = []
        reasoning = "".join(self.reasoning)
        if reasoning or self.details:
            data: dict[str, Any] = {"field": self.reasoning_field}
            if self.details:
                data["reasoning_details"] = [self.details[k] for k in sorted(self.details)]
            parts.append(ReasoningPart(reasoning, data))
        content, refusal = "".join(self.text), "".join(self.refusal)
        if content or refusal:
            parts.append(TextPart(content + refusal))
        for call in self.calls:
            raw = "".join(call.arguments)
            call_id = call.call_id or _generated_id(self.response_id, call.index, call.name, raw)
            parts.append(ToolCallPart.parse(call_id, call.name, raw))
        finish = _FINISH.get(self.finish_reason or "", self.finish_reason)
        if refusal and finish in (None, "stop"):
            finish = "content_filter"
        return ModelResponse(
            parts=tuple(parts),
            usage=_usage(self.usage, self.timings),
            finish_reason=finish,
            model=self.model,
        )


# -- small readers that never raise on a wrong type ----------------------------------------


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _text(content: Any) -> str:
    """``content`` as text: a string, or the text of a list of parts."""
    if isinstance(content, str):
        return content
    return "".join(_str(_dict(p).get("text")) for p in _list(content))


def _arguments(value: Any) -> str:
    """Tool-call arguments as the raw string; an object some servers send is encoded."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return msgspec.json.encode(value).decode()


def _content(texts: list[str]) -> str | list[dict[str, str]]:
    if len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": t} for t in texts] if texts else ""


def _generated_id(response_id: str, index: int, name: str, raw: str) -> str:
    """A stable id for a call the server sent without one."""
    if response_id:
        return f"call_{re.sub(r'[^A-Za-z0-9_-]', '', response_id)}_{index}"
    digest = hashlib.sha256(f"{index}\0{name}\0{raw}".encode()).hexdigest()[:16]
    return f"call_{digest}"


def _usage(usage: dict[str, Any] | None, timings: dict[str, Any] | None) -> Usage:
    if usage is not None:
        prompt = _dict(usage.get("prompt_tokens_details"))
        completion = _dict(usage.get("completion_tokens_details"))
        return Usage(
            input_tokens=_int(usage.get("prompt_tokens")),
            output_tokens=_int(usage.get("completion_tokens")),
            cache_read_tokens=_int(prompt.get("cached_tokens")),
            reasoning_tokens=_int(completion.get("reasoning_tokens")),
        )
    if timings is not None:  # llama.cpp without a usage chunk
        cached = _int(timings.get("cache_n"))
        return Usage(
            input_tokens=_int(timings.get("prompt_n")) + cached,
            output_tokens=_int(timings.get("predicted_n")),
            cache_read_tokens=cached,
        )
    return Usage()
