"""Conformance spec for the Anthropic Messages recordings (folder ``anthropic``).

Written independently of the adapter: ``decode_request`` reads a recorded
Messages API body back into a provider-neutral request, ``request_differences``
compares the body the adapter sent with the recorded one on the fields that
matter, and ``expect`` reads what the recorded reply says (its JSON, or its
server-sent events with a small reader of its own) without calling the adapter.

``image`` and ``document`` blocks (in a user turn or inside a ``tool_result``)
become image and document parts -- a base64 source as bytes, a text source as
UTF-8 bytes, a URL source as the URL, ``cache_control`` as the cache hint -- and
bodies are compared on the decoded bytes.
"""

from __future__ import annotations

import gzip
import json
import re
from typing import Any

import httpx
from _media_spec import base64_key, decode_base64
from _spec import (  # the harness contract, beside this file
    Expected,
    ExpectedCall,
    ProviderSpec,
    UnsupportedPartError,
)

from stepmachine import (
    DocumentPart,
    ImagePart,
    Message,
    ModelRequest,
    ModelSettings,
    PromptPart,
    ToolDefinition,
)
from stepmachine._messages import Part, ReasoningPart, TextPart, ToolCallPart, ToolResultPart
from stepmachine.providers import (
    AnthropicModel,
    AuthenticationError,
    BadRequestError,
    ContextLengthExceededError,
    HTTPModel,
    NotFoundError,
    OverloadedError,
    PermissionDeniedError,
    ProviderError,
    RateLimitError,
    RetryPolicy,
    ServerError,
)

# Top-level request fields the neutral request carries (or that travel through settings.extra).
_EXTRA_FIELDS = ("thinking", "tool_choice", "top_p", "top_k", "stop_sequences", "metadata")
_PLACEHOLDER = re.compile(r"^<[A-Z0-9_]+>$")  # e.g. <MASSIVE_TEXT>: the recorder hid the value


def make_model(client: httpx.AsyncClient, model: str) -> HTTPModel:
    """The adapter as the recordings were made: default base URL, a dummy key, no retries."""
    return AnthropicModel(
        model,
        api_key="sk-ant-test-key",
        base_url="https://api.anthropic.com/v1",
        client=client,
        retry=RetryPolicy(max_attempts=1),
    )


# -- decode_request ------------------------------------------------------------------------


def _blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content or [])


def _result_text(content: Any) -> str:
    """A tool_result's content: a string, or its text blocks joined (its image and
    document blocks are ``_result_media``; ``UnsupportedPartError`` for any other)."""
    if isinstance(content, str):
        return content
    for block in content or []:
        if block.get("type") not in ("text", *_MEDIA_BLOCKS):
            raise UnsupportedPartError(f"a block of type {block.get('type')!r} in a tool_result")
    return "".join(b.get("text", "") for b in content or [] if b.get("type") == "text")


# -- media: image and document blocks ------------------------------------------------------

_MEDIA_BLOCKS = ("image", "document")


def _media_part(block: dict[str, Any]) -> ImagePart | DocumentPart:
    """An ``image`` or ``document`` block as a neutral part: a ``base64`` source -> bytes,
    a ``text`` source -> UTF-8 bytes (``text/plain``), a ``url`` source -> the URL;
    ``cache_control`` -> the cache hint (its ``ttl`` -> ``cache_ttl``); a document's ``title``.

    Raises:
        UnsupportedPartError: another source (``file``, ``content``), or a document with
            ``context`` or ``citations`` (the neutral part has neither).
    """
    source = block.get("source") or {}
    kind = source.get("type")
    cache = "cache_control" in block
    ttl = (block.get("cache_control") or {}).get("ttl")
    fields: dict[str, Any]
    if kind == "base64":
        fields = {"media_type": source["media_type"], "data": decode_base64(source["data"])}
    elif kind == "text" and block["type"] == "document":
        fields = {"media_type": source.get("media_type"), "data": source["data"].encode()}
    elif kind == "url":
        fields = {"url": source["url"]}
    else:
        raise UnsupportedPartError(f"a {block['type']} block with a {kind!r} source")
    if block["type"] == "image":
        return ImagePart(**fields, cache=cache, cache_ttl=ttl)
    unknown = set(block) - {"type", "source", "cache_control", "title"}
    if unknown:
        raise UnsupportedPartError(f"a document block with {sorted(unknown)}")
    return DocumentPart(**fields, title=block.get("title"), cache=cache, cache_ttl=ttl)


def _result_media(content: Any) -> list[ImagePart | DocumentPart]:
    """The images and documents inside a tool_result's content."""
    if not isinstance(content, list):
        return []
    return [_media_part(b) for b in content if b.get("type") in _MEDIA_BLOCKS]


def _norm_media(b: dict[str, Any]) -> Any:
    """An image or document block in a comparable form: base64 decoded to bytes."""
    source = dict(b.get("source") or {})
    if source.get("type") == "base64":
        source["data"] = base64_key(source.get("data"))
    return (b.get("type"), source, b.get("cache_control"), b.get("title"))


def decode_request(body: dict[str, Any]) -> tuple[ModelRequest, bool]:
    """The provider-neutral request a recorded body shows, and whether it streamed."""
    messages: list[Message] = []

    def add(role: Any, parts: list[Part]) -> None:
        if parts:
            messages.append(Message(id=f"m{len(messages)}", role=role, parts=tuple(parts)))

    for turn in body.get("messages", []):
        blocks = _blocks(turn.get("content"))
        if turn["role"] == "assistant":
            parts: list[Part] = []
            for b in blocks:
                if b["type"] == "text":
                    parts.append(TextPart(b["text"]))
                elif b["type"] == "thinking":
                    parts.append(ReasoningPart(b["thinking"], {"signature": b["signature"]}))
                elif b["type"] == "redacted_thinking":
                    parts.append(ReasoningPart("", {"redacted": b["data"]}))
                elif b["type"] == "tool_use":
                    parts.append(ToolCallPart.of(b["id"], b["name"], b["input"]))
                else:
                    raise UnsupportedPartError(
                        f"a block of type {b['type']!r} in an assistant turn"
                    )
            add("assistant", parts)
        else:
            for b in blocks:
                if b["type"] not in ("text", "tool_result", *_MEDIA_BLOCKS):
                    raise UnsupportedPartError(f"a block of type {b['type']!r} in a user turn")
            results: list[Part] = []
            for b in blocks:
                if b["type"] == "tool_result":
                    results.append(
                        ToolResultPart(
                            call_id=b["tool_use_id"],
                            content=_result_text(b.get("content")),
                            is_error=bool(b.get("is_error", False)),
                        )
                    )
                    results.extend(_result_media(b.get("content")))
            add("tool", results)
            add(
                "user",
                [
                    TextPart(b["text"]) if b["type"] == "text" else _media_part(b)
                    for b in blocks
                    if b["type"] != "tool_result"
                ],
            )
    system = body.get("system")
    if isinstance(system, list):
        system = "\n\n".join(b["text"] for b in system if b.get("type") == "text")
    tools = tuple(
        ToolDefinition(t["name"], t.get("description") or "", t.get("input_schema") or {})
        for t in body.get("tools", [])
    )
    output = body.get("output_config", {}).get("format", {})
    settings = ModelSettings(
        max_tokens=body.get("max_tokens"),
        temperature=body.get("temperature"),
        extra={k: body[k] for k in _EXTRA_FIELDS if k in body},
    )
    request = ModelRequest(
        messages=tuple(messages),
        tools=tools,
        prompt_parts=(PromptPart("recorded", system),) if system else (),
        settings=settings,
        output_schema=output.get("schema") if output.get("type") == "json_schema" else None,
    )
    return request, bool(body.get("stream", False))


# -- request_differences -------------------------------------------------------------------


def _norm_block(b: dict[str, Any]) -> Any:
    kind = b.get("type")
    if kind == "text":
        return ("text", b.get("text"))
    if kind == "thinking":
        return ("thinking", b.get("thinking"), b.get("signature"))
    if kind == "redacted_thinking":
        return ("redacted_thinking", b.get("data"))
    if kind == "tool_use":
        return ("tool_use", b.get("id"), b.get("name"), b.get("input"))
    if kind == "tool_result":
        # content: a string or a list of text blocks (ruby_llm) say the same thing;
        # is_error: absent means false.
        # images and documents inside it: compared as media blocks, in order
        content = b.get("content")
        blocks = content if isinstance(content, list) else []
        return (
            "tool_result",
            b.get("tool_use_id"),
            _result_text(content),
            bool(b.get("is_error", False)),
            [_norm_media(m) for m in blocks if m.get("type") in _MEDIA_BLOCKS],
        )
    if kind in _MEDIA_BLOCKS:
        return _norm_media(b)
    return (kind, b)


def _norm_messages(body: dict[str, Any]) -> list[Any]:
    return [
        (m.get("role"), [_norm_block(b) for b in _blocks(m.get("content"))])
        for m in body.get("messages", [])
    ]


def _norm_tools(body: dict[str, Any]) -> list[Any]:
    # Ignored per tool: "strict" (pydantic-ai sets it; the neutral ToolDefinition has no
    # such flag), "cache_control" and "type" (not expressible either).
    return [
        (t.get("name"), t.get("description") or "", t.get("input_schema"))
        for t in body.get("tools", [])
    ]


def _norm_system(body: dict[str, Any]) -> str:
    system = body.get("system") or ""
    if isinstance(system, list):
        system = "\n\n".join(b.get("text", "") for b in system if b.get("type") == "text")
    return str(system)


def _same(sent: Any, recorded: Any) -> bool:
    """Equal, treating a recorded placeholder string (``<MASSIVE_TEXT>``) as any value."""
    if isinstance(recorded, str) and _PLACEHOLDER.match(recorded):
        return True
    if isinstance(sent, dict) and isinstance(recorded, dict):
        return sent.keys() == recorded.keys() and all(_same(sent[k], recorded[k]) for k in sent)
    if isinstance(sent, list | tuple) and isinstance(recorded, list | tuple):
        return len(sent) == len(recorded) and all(
            _same(a, b) for a, b in zip(sent, recorded, strict=True)
        )
    return bool(sent == recorded)


def request_differences(sent: dict[str, Any], recorded: dict[str, Any]) -> list[str]:
    """Differences on model, max tokens, stream, system, messages, tools, output and extras.

    Not compared: key order and JSON formatting (bodies are compared parsed), the
    per-tool fields listed in ``_norm_tools``, and the forms the API treats as one
    (string vs text-block content, absent vs false ``is_error`` / ``stream``).
    """
    checks = {
        "model": (sent.get("model"), recorded.get("model")),
        "max_tokens": (sent.get("max_tokens"), recorded.get("max_tokens")),
        "stream": (bool(sent.get("stream", False)), bool(recorded.get("stream", False))),
        "system": (_norm_system(sent), _norm_system(recorded)),
        "messages": (_norm_messages(sent), _norm_messages(recorded)),
        "tools": (_norm_tools(sent), _norm_tools(recorded)),
        "output_config": (sent.get("output_config"), recorded.get("output_config")),
        "temperature": (sent.get("temperature"), recorded.get("temperature")),
    }
    for key in _EXTRA_FIELDS:
        checks[key] = (sent.get(key), recorded.get(key))
    differences = [
        f"{name}: sent {mine!r}, recorded {theirs!r}"
        for name, (mine, theirs) in checks.items()
        if not _same(mine, theirs)
    ]
    unknown = sorted(set(sent) - set(recorded) - {"stream"})
    if unknown:
        differences.append(f"fields sent but not recorded: {unknown}")
    return differences


# -- expect --------------------------------------------------------------------------------

_ERRORS: dict[str, type[ProviderError]] = {
    "authentication_error": AuthenticationError,
    "permission_error": PermissionDeniedError,
    "not_found_error": NotFoundError,
    "rate_limit_error": RateLimitError,
    "overloaded_error": OverloadedError,
    "api_error": ServerError,
    "invalid_request_error": BadRequestError,
}
_FINISH = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "length",
}


def _expected_error(status: int, body: bytes) -> Any:
    error = json.loads(body).get("error", {})
    kind, message = error.get("type"), error.get("message", "")
    cls = _ERRORS.get(kind, ServerError if status >= 500 else BadRequestError)
    if "prompt is too long" in message:
        cls = ContextLengthExceededError
    return Expected(error=cls, notes=(f"error {status} {kind}",))


def _events(text: str) -> list[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream, in order."""
    payloads = []
    for chunk in re.split(r"\r?\n\r?\n", text):
        data = "\n".join(
            line[5:].lstrip(" ") for line in chunk.splitlines() if line.startswith("data:")
        )
        if data.strip():
            payloads.append(json.loads(data))
    return payloads


def _message_from_stream(text: str) -> dict[str, Any]:
    """The message object a stream amounts to."""
    message: dict[str, Any] = {}
    blocks: dict[int, dict[str, Any]] = {}
    partial: dict[int, str] = {}
    for event in _events(text):
        kind = event.get("type")
        if kind == "message_start":
            message = dict(event["message"])
            message["usage"] = dict(message.get("usage") or {})
        elif kind == "content_block_start":
            blocks[event["index"]] = dict(event["content_block"])
        elif kind == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] = block.get("text", "") + delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = block.get("signature", "") + delta["signature"]
            elif delta["type"] == "input_json_delta":
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
        elif kind == "message_delta":
            message["stop_reason"] = event["delta"].get("stop_reason")
            message["usage"].update(
                {k: v for k, v in (event.get("usage") or {}).items() if v is not None}
            )
    for index, joined in partial.items():
        if joined.strip():
            blocks[index]["input"] = json.loads(joined)
    message["content"] = [blocks[i] for i in sorted(blocks)]
    return message


def expect(status: int, body: bytes, headers: httpx.Headers, streamed: bool) -> Any:
    """What the recorded reply says the adapter must return (or raise)."""
    if body[:2] == b"\x1f\x8b":
        body = gzip.decompress(body)
    if status >= 400:
        return _expected_error(status, body)
    is_sse = "text/event-stream" in headers.get("content-type", "")
    message = _message_from_stream(body.decode()) if is_sse else json.loads(body)
    content = message.get("content", [])
    usage = message.get("usage") or {}
    return Expected(
        text="".join(b["text"] for b in content if b["type"] == "text"),
        tool_calls=tuple(
            ExpectedCall(b["name"], b.get("input", {}), b["id"])
            for b in content
            if b["type"] == "tool_use"
        ),
        reasoning=any(b["type"] in ("thinking", "redacted_thinking") for b in content),
        input_tokens=usage.get("input_tokens"),
        output_tokens=usage.get("output_tokens"),
        reasoning_tokens=(usage.get("output_tokens_details") or {}).get("thinking_tokens"),
        finish_reason=_FINISH.get(message.get("stop_reason"), message.get("stop_reason")),
        notes=("stream" if is_sse else "json",),
    )


SPECS: dict[str, Any] = {
    "anthropic": ProviderSpec(
        folder="anthropic",
        path_suffix="/messages",
        make_model=make_model,
        decode_request=decode_request,
        request_differences=request_differences,
        expect=expect,
    )
}
