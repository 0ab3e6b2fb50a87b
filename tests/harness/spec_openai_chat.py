"""Conformance specs for the Chat Completions recordings: folders ``openai_chat`` and
``openai_compatible`` (Ollama, vLLM, llama.cpp, Groq, OpenRouter).

Written independently of the adapter: ``decode_request`` reads a recorded Chat
Completions body back into a provider-neutral request, ``request_differences``
compares the body the adapter sent with the recorded one on the fields that
matter, and ``expect`` reads what the recorded reply says (its JSON, or its
server-sent events with a small reader of its own) without calling the adapter.

Media in a user message (``image_url``, ``file`` with ``file_data``, ``input_audio``)
become image, document and audio parts -- inline base64 as bytes, remote URLs as URLs
(``_media_spec``) -- and sent and recorded bodies are compared on the decoded bytes.

Conventions of the adapter this spec relies on (documented in
``stepmachine/providers/_openai_chat.py``):

* reasoning sent back in an assistant turn is a ``ReasoningPart`` whose
  ``provider_data`` is ``{"field": "reasoning" | "reasoning_content"}``, plus
  ``"reasoning_details"`` (OpenRouter's list, sent back unchanged) when the
  turn has them;
* a refusal is returned as text with finish reason ``"content_filter"``;
* token counts come from ``usage``, else from llama.cpp's ``timings``
  (``prompt_n + cache_n`` in, ``predicted_n`` out).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from _media_spec import base64_key, decode_base64, document_from_url, image_from_url, media_key
from _spec import (  # the harness contract, beside this file
    Expected,
    ExpectedCall,
    ProviderSpec,
    UnsupportedPartError,
)

from stepmachine import (
    AudioPart,
    Message,
    ModelRequest,
    ModelSettings,
    PromptPart,
    ToolDefinition,
)
from stepmachine._messages import Part, ReasoningPart, TextPart, ToolCallPart, ToolResultPart
from stepmachine.providers import (
    AuthenticationError,
    BadRequestError,
    ContextLengthExceededError,
    HTTPModel,
    NotFoundError,
    OpenAIChatModel,
    OpenAICompatibleModel,
    OverloadedError,
    PermissionDeniedError,
    ProviderError,
    RateLimitError,
    ServerError,
)

TEST_KEY = "sk-conformance-test-key"

# Top-level fields the neutral request expresses directly; every other recorded field
# (tool_choice, parallel_tool_calls, n, enable_thinking, chat_template_kwargs,
# cache_prompt, reasoning_format, ...) is carried in ``settings.extra`` and must come
# back unchanged.
_MODELLED = frozenset(
    {
        "model",
        "messages",
        "tools",
        "stream",
        "stream_options",
        "response_format",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
    }
)


def make_chat_model(client: httpx.AsyncClient, model: str) -> HTTPModel:
    """The OpenAI adapter over the harness's client."""
    return OpenAIChatModel(model, api_key=TEST_KEY, client=client)


def make_compatible_model(client: httpx.AsyncClient, model: str) -> HTTPModel:
    """The OpenAI-compatible adapter (``model`` may be ``""``: go-vcr requests have none)."""
    return OpenAICompatibleModel(
        model, base_url="http://compatible.invalid/v1", api_key=TEST_KEY, client=client
    )


# -- decoding a recorded request ---------------------------------------------------------------


def _text_of(content: Any) -> str:
    """A message's ``content``: a string, ``null``, or a list of text parts.

    Raises:
        UnsupportedPartError: a part that is not text. A user message's media is read
            by ``_user_parts``; media anywhere else (a tool, system or assistant
            message) is nothing the adapter can send.
    """
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise UnsupportedPartError(f"a content part of type {kind!r}")
        return "".join(str(p.get("text", "")) for p in content)
    return ""


# -- media in a user message (images, PDFs, audio) ---------------------------------------------

_AUDIO_TYPES = {"wav": "audio/wav", "mp3": "audio/mpeg"}


def _has_media(content: Any) -> bool:
    """Whether a message's ``content`` is a list holding a part that is not text."""
    return isinstance(content, list) and any(
        not isinstance(p, dict) or p.get("type") != "text" for p in content
    )


def _user_parts(content: list[Any]) -> list[Part]:
    """A user message's content parts as neutral parts, in order: ``text``, ``image_url``
    (URL, or a data URL -> bytes), ``file`` (``file_data`` -> bytes, ``filename`` ->
    title) and ``input_audio`` (base64 -> bytes).

    Raises:
        UnsupportedPartError: any other part, or a file given by ``file_id`` (an upload
            the neutral request cannot name).
    """
    parts: list[Part] = []
    for wire in content:
        kind = wire.get("type") if isinstance(wire, dict) else type(wire).__name__
        if kind == "text":
            parts.append(TextPart(str(wire.get("text", ""))))
        elif kind == "image_url":
            image = wire["image_url"]
            url = image if isinstance(image, str) else image["url"]
            detail = None if isinstance(image, str) else image.get("detail")
            parts.append(image_from_url(url, detail))
        elif kind == "file" and "file_data" in wire.get("file", {}):
            file = wire["file"]
            parts.append(document_from_url(file["file_data"], file.get("filename")))
        elif kind == "input_audio" and wire["input_audio"].get("format") in _AUDIO_TYPES:
            audio = wire["input_audio"]
            media_type = _AUDIO_TYPES[audio["format"]]
            parts.append(AudioPart(media_type=media_type, data=decode_base64(audio["data"])))
        else:
            raise UnsupportedPartError(f"a content part of type {kind!r}")
    return parts


def _norm_part(wire: Any) -> Any:
    """One content part in a comparable form: inline bytes decoded (see ``media_key``)."""
    kind = wire.get("type")
    if kind == "text":
        return ("text", wire.get("text"))
    if kind == "image_url":
        image = wire.get("image_url")
        if isinstance(image, str):
            image = {"url": image}
        return ("image_url", media_key(image.get("url")), image.get("detail"))
    if kind == "file":
        file = wire.get("file") or {}
        return ("file", media_key(file.get("file_data")), file.get("filename"), file.get("file_id"))
    if kind == "input_audio":
        audio = wire.get("input_audio") or {}
        return ("input_audio", base64_key(audio.get("data")), audio.get("format"))
    return (kind, wire)


def _norm_content(content: Any) -> Any:
    """Text content as its joined text; content with media as its normalised parts."""
    if _has_media(content):
        return [_norm_part(p) for p in content]
    return _text_of(content)


def _raw_arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def decode_request(body: dict[str, Any]) -> tuple[ModelRequest, bool]:
    """The neutral request a recorded Chat Completions body shows, and whether it streamed."""
    messages: list[Message] = []
    prompt_parts: list[PromptPart] = []
    for number, wire in enumerate(body.get("messages") or []):
        role = wire.get("role")
        mid = f"m{number}"
        if role in ("system", "developer"):
            if number == 0:
                prompt_parts.append(PromptPart("recorded", _text_of(wire.get("content"))))
            else:
                messages.append(Message.system(_text_of(wire.get("content")), id=mid))
        elif role == "user" and _has_media(wire.get("content")):
            messages.append(Message(id=mid, role="user", parts=tuple(_user_parts(wire["content"]))))
        elif role == "user":
            messages.append(Message.user(_text_of(wire.get("content")), id=mid))
        elif role == "tool":
            result = ToolResultPart(wire["tool_call_id"], _text_of(wire.get("content")))
            messages.append(Message.tool_result(result, id=mid))
        elif role == "assistant":
            parts: list[Part] = []
            data: dict[str, Any] = {"field": None}
            text = ""
            for field in ("reasoning", "reasoning_content"):
                if wire.get(field):
                    data["field"], text = field, wire[field]
                    break  # ruby_llm sends the same text in both fields
            if wire.get("reasoning_details"):
                data["reasoning_details"] = wire["reasoning_details"]  # OpenRouter
            if text or "reasoning_details" in data:
                parts.append(ReasoningPart(text, data))
            if _text_of(wire.get("content")):
                parts.append(TextPart(_text_of(wire.get("content"))))
            for call in wire.get("tool_calls") or []:
                function = call["function"]
                raw = _raw_arguments(function.get("arguments"))
                parts.append(ToolCallPart.parse(call["id"], function["name"], raw))
            messages.append(Message(id=mid, role="assistant", parts=tuple(parts)))
        else:
            raise ValueError(f"unexpected role {role!r} in recorded message {number}")
    tools = tuple(
        ToolDefinition(
            t["function"]["name"],
            t["function"].get("description") or "",
            t["function"].get("parameters") or {},
        )
        for t in body.get("tools") or []
    )
    output_schema, output_name = None, "output"
    response_format = body.get("response_format")
    extra = {k: v for k, v in body.items() if k not in _MODELLED}
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        output_schema = response_format["json_schema"]["schema"]
        output_name = response_format["json_schema"]["name"]
    elif response_format is not None:
        extra["response_format"] = response_format  # e.g. json_object: passed through
    settings = ModelSettings(
        max_tokens=body.get("max_completion_tokens", body.get("max_tokens")),
        temperature=body.get("temperature"),
        extra=extra,
    )
    request = ModelRequest(
        messages=tuple(messages),
        tools=tools,
        prompt_parts=tuple(prompt_parts),
        settings=settings,
        output_schema=output_schema,
        output_name=output_name,
    )
    return request, bool(body.get("stream"))


# -- comparing the sent request with the recorded one ------------------------------------------


def _norm_message(wire: dict[str, Any]) -> dict[str, Any]:
    role = wire.get("role")
    out: dict[str, Any] = {
        # OpenAI treats ``developer`` as the system role of newer models; the neutral
        # request has one system prompt, which the adapter sends as ``system`` by default
        # (``system_role="developer"`` on request).
        "role": "system" if role == "developer" else role,
        # ``content`` null, absent and "" are the same empty turn; a list of text parts
        # (go-vcr / llama.cpp) is its joined text; a list with media is compared part by
        # part, inline bytes decoded (``_norm_content``).
        "content": _norm_content(wire.get("content")),
    }
    if wire.get("tool_calls"):
        out["tool_calls"] = [
            (
                c.get("id"),
                c.get("function", {}).get("name"),
                _raw_arguments(c.get("function", {}).get("arguments")),
            )
            for c in wire["tool_calls"]
        ]
    if role == "tool":
        out["tool_call_id"] = wire.get("tool_call_id")
    # Reasoning echoed back: ruby_llm sends the same text as both ``reasoning`` and
    # ``reasoning_content``; the adapter sends it once, in the field it arrived in.
    reasoning = wire.get("reasoning") or wire.get("reasoning_content")
    if reasoning:
        out["reasoning"] = reasoning
    # OpenRouter's structured reasoning (signatures included) must come back unchanged.
    if wire.get("reasoning_details"):
        out["reasoning_details"] = wire["reasoning_details"]
    return out


def _norm_tools(body: dict[str, Any]) -> list[Any]:
    # ``function.strict`` is ignored: the neutral ToolDefinition has no strict flag.
    return [
        (
            t.get("function", {}).get("name"),
            t.get("function", {}).get("description") or "",
            t.get("function", {}).get("parameters"),
        )
        for t in body.get("tools") or []
    ]


def _norm_response_format(body: dict[str, Any]) -> Any:
    value = body.get("response_format")
    if isinstance(value, dict) and value.get("type") == "json_schema":
        schema = value.get("json_schema", {})
        # ``strict`` is ignored: the adapter derives it from the schema (strict when
        # every object is closed and fully required); its unit tests check that the
        # derived flag matches these recordings.
        return ("json_schema", schema.get("name"), schema.get("schema"))
    return value


def request_differences(sent: dict[str, Any], recorded: dict[str, Any]) -> list[str]:
    """Differences on the fields that matter; ``[]`` when the bodies agree.

    Ignored, and why:

    * ``model`` when the recording has none (go-vcr / llama.cpp requests omit it; the
      harness then gives the adapter ``""`` and it sends none either);
    * ``stream_options``: the adapter always asks for the usage chunk when streaming;
      servers that do not know it ignore it (maruel/genai did not send it);
    * ``stream: false`` versus no ``stream`` field: the same thing;
    * ``max_tokens`` versus ``max_completion_tokens``: the same setting, named per
      server family (compared by value);
    * the normalisations listed in ``_norm_message`` / ``_norm_tools`` /
      ``_norm_response_format``.
    """
    problems: list[str] = []

    def check(what: str, mine: Any, theirs: Any) -> None:
        if mine != theirs:
            problems.append(f"{what}: sent {_short(mine)} != recorded {_short(theirs)}")

    if "model" in recorded:
        check("model", sent.get("model"), recorded.get("model"))
    check("stream", bool(sent.get("stream")), bool(recorded.get("stream")))
    mine = [_norm_message(m) for m in sent.get("messages") or []]
    theirs = [_norm_message(m) for m in recorded.get("messages") or []]
    if len(mine) != len(theirs):
        check("messages", mine, theirs)
    else:
        for n, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            check(f"messages[{n}]", a, b)
    check("tools", _norm_tools(sent), _norm_tools(recorded))
    check("response_format", _norm_response_format(sent), _norm_response_format(recorded))
    check(
        "max tokens",
        sent.get("max_completion_tokens", sent.get("max_tokens")),
        recorded.get("max_completion_tokens", recorded.get("max_tokens")),
    )
    for key in sorted((set(sent) | set(recorded)) - (_MODELLED - {"temperature"})):
        check(key, sent.get(key), recorded.get(key))
    return problems


def _short(value: Any, limit: int = 200) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- what the recorded reply says ----------------------------------------------------------------


def _expected_error(status: int, body: bytes) -> type[ProviderError]:
    try:
        error = json.loads(body).get("error") or {}
    except ValueError:
        error = {}
    message = str(error.get("message", "")) if isinstance(error, dict) else str(error)
    code = error.get("code") if isinstance(error, dict) else None
    lowered = message.lower()
    if (
        code == "context_length_exceeded"
        or "context size has been exceeded" in lowered
        or "maximum context length" in lowered
    ):
        return ContextLengthExceededError
    by_status: dict[int, type[ProviderError]] = {
        401: AuthenticationError,
        403: PermissionDeniedError,
        404: NotFoundError,
        429: RateLimitError,
        503: OverloadedError,
        529: OverloadedError,
    }
    if status in by_status:
        return by_status[status]
    return ServerError if status >= 500 else BadRequestError


def _read_stream(text: str) -> dict[str, Any]:
    """A ``chat.completion``-shaped dict assembled from the ``data:`` lines of a stream.

    Choice 0 only (``n`` > 1 interleaves the others, which are ignored); tool-call
    deltas are placed by ``index``, or without one (Mistral) as ``_call_for`` says.
    """
    content: list[str] = []
    refusal: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    by_index: dict[int, dict[str, Any]] = {}
    finish = None
    usage = timings = None
    for line in text.splitlines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if not data or data == "[DONE]":
            continue
        chunk = json.loads(data)
        usage = chunk.get("usage") or usage
        timings = chunk.get("timings") or timings
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue  # n > 1: choice 0 is the reply, the others are ignored
            delta = choice.get("delta") or {}
            content.append(delta.get("content") or "")
            refusal.append(delta.get("refusal") or "")
            reasoning.append(delta.get("reasoning") or delta.get("reasoning_content") or "")
            for piece in delta.get("tool_calls") or []:
                call = _call_for(piece, calls, by_index)
                call["id"] = call["id"] or piece.get("id")
                function = piece.get("function") or {}
                call["name"] = call["name"] or function.get("name") or ""
                call["arguments"] += function.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    message = {
        "content": "".join(content),
        "refusal": "".join(refusal),
        "reasoning": "".join(reasoning),
        "tool_calls": [
            {"id": c["id"], "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls
        ],
    }
    return {
        "choices": [{"message": message, "finish_reason": finish}],
        "usage": usage,
        "timings": timings,
    }


def _call_for(
    piece: dict[str, Any], calls: list[dict[str, Any]], by_index: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    """The call a streamed tool-call delta belongs to.

    By ``index`` when it has one; without (Mistral): the call with the same
    ``id``, else -- no id -- the call being streamed, else a new call.
    """
    index = piece.get("index")
    if isinstance(index, int):
        if index not in by_index:
            by_index[index] = {"id": None, "name": "", "arguments": ""}
            calls.append(by_index[index])
        return by_index[index]
    wire_id = piece.get("id")
    known = [c for c in calls if wire_id and c["id"] == wire_id]
    if known:
        return known[0]
    if not wire_id and calls:
        return calls[-1]
    calls.append({"id": None, "name": "", "arguments": ""})
    return calls[-1]


def expect(status: int, body: bytes, headers: httpx.Headers, streamed: bool) -> Any:
    """What the adapter must make of this recorded reply (choice 0 when ``n`` > 1)."""
    if status >= 400:
        return Expected(error=_expected_error(status, body))
    is_sse = "text/event-stream" in headers.get("content-type", "")
    data = _read_stream(body.decode()) if is_sse else json.loads(body)
    choices = data["choices"]
    choice = next((c for c in choices if c.get("index", 0) == 0), choices[0])
    message = choice.get("message") or {}
    notes: list[str] = []
    text = message.get("content") or ""
    finish = choice.get("finish_reason")
    if message.get("refusal"):
        text += message["refusal"]
        finish = "content_filter"
        notes.append("refusal: returned as text with finish_reason content_filter")
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    calls = tuple(
        ExpectedCall(
            name=c["function"]["name"],
            arguments=json.loads(c["function"].get("arguments") or "{}"),
            call_id=c.get("id"),
        )
        for c in message.get("tool_calls") or []
    )
    usage, timings = data.get("usage"), data.get("timings")
    input_tokens = output_tokens = reasoning_tokens = None
    if usage:
        input_tokens, output_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
        details = usage.get("completion_tokens_details") or {}
        reasoning_tokens = details.get("reasoning_tokens")
    elif timings:
        input_tokens = timings.get("prompt_n", 0) + timings.get("cache_n", 0)
        output_tokens = timings.get("predicted_n")
        notes.append("usage: from llama.cpp timings (no usage sent)")
    return Expected(
        text=text,
        tool_calls=calls,
        reasoning=bool(reasoning),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        reasoning_tokens=reasoning_tokens,
        finish_reason=finish,
        notes=tuple(notes),
    )


SPECS: dict[str, Any] = {
    "openai_chat": ProviderSpec(
        folder="openai_chat",
        path_suffix="/chat/completions",
        make_model=make_chat_model,
        decode_request=decode_request,
        request_differences=request_differences,
        expect=expect,
    ),
    "openai_compatible": ProviderSpec(
        folder="openai_compatible",
        path_suffix="/chat/completions",
        make_model=make_compatible_model,
        decode_request=decode_request,
        request_differences=request_differences,
        expect=expect,
    ),
}
