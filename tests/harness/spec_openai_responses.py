"""How the conformance harness drives :class:`OpenAIResponsesModel` (folder ``openai_responses``).

Written independently of the adapter: ``decode_request`` reads a recorded
``/responses`` body into a provider-neutral request, ``request_differences``
compares two bodies on the fields that matter, and ``expect`` reads what a
recorded reply says (a JSON ``response`` object, or an SSE stream whose
text and argument *deltas* are concatenated here) without calling the adapter.

Images and files (``input_image``, ``input_file``) in a user message or a
``function_call_output`` become image and document parts -- inline base64 as
bytes, remote URLs as URLs (``_media_spec``) -- and bodies are compared on the
decoded bytes, ``detail`` absent equal to ``"auto"``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
from _media_spec import document_from_url, image_from_url, media_key
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
    AuthenticationError,
    BadRequestError,
    ContextLengthExceededError,
    HTTPModel,
    MalformedResponseError,
    NotFoundError,
    OpenAIResponsesModel,
    OverloadedError,
    PermissionDeniedError,
    ProviderError,
    RateLimitError,
    RetryPolicy,
    ServerError,
)

# Top-level request fields the neutral request maps itself; every other recorded
# field (tool_choice, include, store, reasoning, service_tier, parallel_tool_calls,
# top_p, ...) is passed through ``settings.extra`` and compared verbatim.
_MAPPED = frozenset(
    {"model", "input", "instructions", "tools", "stream", "max_output_tokens", "temperature"}
)
_PLACEHOLDER = re.compile(r"^<[A-Z0-9_]+>$")


def make_model(client: httpx.AsyncClient, model: str) -> HTTPModel:
    """The adapter under test: no ``store`` of its own (the recording's, if any, comes
    through ``settings.extra``), one attempt per interaction."""
    return OpenAIResponsesModel(
        model,
        api_key="sk-test-not-a-key",
        base_url="https://api.openai.com/v1",
        client=client,
        store=None,
        retry=RetryPolicy(max_attempts=1),
    )


# -- decode_request ------------------------------------------------------------------------


_TEXT_BLOCKS = frozenset({"input_text", "output_text", "text"})


def _content_text(content: Any) -> str:
    """A message's content: a string, or a list of text blocks.

    Raises:
        UnsupportedPartError: a block that is not text (the callers read images and
            files with ``_content_parts`` / ``_media_part`` first).
    """
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            if kind not in _TEXT_BLOCKS:
                raise UnsupportedPartError(f"a content block of type {kind!r}")
        return "".join(str(block.get("text", "")) for block in content)
    return ""


# -- media: input_image / input_file in a message or a function_call_output ------------------

_MEDIA_BLOCKS = frozenset({"input_image", "input_file"})


def _has_media(content: Any) -> bool:
    """Whether ``content`` (or an ``output``) is a list holding an image or a file."""
    return isinstance(content, list) and any(
        isinstance(b, dict) and b.get("type") in _MEDIA_BLOCKS for b in content
    )


def _media_part(block: dict[str, Any]) -> ImagePart | DocumentPart:
    """An ``input_image`` (URL or data URL -> bytes; ``detail``) or ``input_file``
    (``file_data`` -> bytes, or ``file_url``; ``filename`` -> title) as a neutral part.

    Raises:
        UnsupportedPartError: a file given by ``file_id`` (an upload the neutral request
            cannot name).
    """
    if block["type"] == "input_image" and isinstance(block.get("image_url"), str):
        return image_from_url(block["image_url"], block.get("detail"))
    if block["type"] == "input_file" and ("file_data" in block or "file_url" in block):
        return document_from_url(block.get("file_data") or block["file_url"], block.get("filename"))
    raise UnsupportedPartError(f"a {block['type']} block without a URL or data (a file_id?)")


def _content_parts(content: list[Any]) -> list[Part]:
    """Content blocks (text, images, files) as neutral parts, in order."""
    parts: list[Part] = []
    for block in content:
        if block.get("type") in _MEDIA_BLOCKS:
            parts.append(_media_part(block))
        else:
            parts.append(TextPart(_content_text([block])))
    return parts


def _normal_block(block: Any) -> Any:
    """One content block in a comparable form: inline bytes decoded, ``detail`` absent
    equal to ``"auto"`` (the API's default)."""
    kind = block.get("type")
    if kind in _TEXT_BLOCKS:
        return ("text", block.get("text"))
    if kind == "input_image":
        return ("input_image", media_key(block.get("image_url")), block.get("detail") or "auto")
    if kind == "input_file":
        data = block.get("file_data") or block.get("file_url")
        return ("input_file", media_key(data), block.get("filename"), block.get("file_id"))
    return (kind, block)


def _normal_content(content: Any) -> Any:
    """Text content as its joined text; content with media as its normalised blocks."""
    if _has_media(content):
        return [_normal_block(b) for b in content]
    return _content_text(content)


def decode_request(body: dict[str, Any]) -> tuple[ModelRequest, bool]:
    """The neutral request a recorded ``/responses`` body shows, and whether it streamed."""
    raw_input = body.get("input") or []
    if isinstance(raw_input, str):
        raw_input = [{"role": "user", "content": raw_input}]
    messages: list[Message] = []
    assistant: list[Part] = []

    def close_assistant() -> None:
        if assistant:
            messages.append(
                Message(id=f"m{len(messages)}", role="assistant", parts=tuple(assistant))
            )
            assistant.clear()

    for item in raw_input:
        kind = item.get("type", "message")
        role = item.get("role")
        if kind == "function_call":
            assistant.append(
                ToolCallPart.parse(item["call_id"], item["name"], item.get("arguments") or "")
            )
        elif kind == "reasoning":
            summary = item.get("summary") or []
            data = {"type": "reasoning", "summary": summary}
            if "id" in item:  # ruby_llm sends the encrypted content back without the id
                data["id"] = item["id"]
            if item.get("encrypted_content"):
                data["encrypted_content"] = item["encrypted_content"]
            text = "\n\n".join(s.get("text", "") for s in summary)
            assistant.append(ReasoningPart(text=text, provider_data=data))
        elif kind == "message" and role == "assistant":
            assistant.append(TextPart(_content_text(item.get("content"))))
        elif kind == "function_call_output":
            close_assistant()
            output = item["output"]
            media: list[ImagePart | DocumentPart] = []
            if _has_media(output):
                media = [_media_part(b) for b in output if b.get("type") in _MEDIA_BLOCKS]
                output = [b for b in output if b.get("type") not in _MEDIA_BLOCKS]
            result = ToolResultPart(call_id=item["call_id"], content=_content_text(output))
            messages.append(Message.tool_result(result, id=f"m{len(messages)}", media=media))
        elif role == "user" and _has_media(item.get("content")):
            close_assistant()
            parts = tuple(_content_parts(item["content"]))
            messages.append(Message(id=f"m{len(messages)}", role="user", parts=parts))
        else:  # user / system / developer message
            close_assistant()
            who = "user" if role == "user" else "system"
            text = _content_text(item.get("content"))
            messages.append(Message(id=f"m{len(messages)}", role=who, parts=(TextPart(text),)))
    close_assistant()

    tools = tuple(
        ToolDefinition(
            name=t["name"], description=t.get("description") or "", parameters=t["parameters"]
        )
        for t in body.get("tools") or []
    )
    extra = {k: v for k, v in body.items() if k not in _MAPPED}
    schema: dict[str, Any] | None = None
    name = "output"
    text_config = extra.get("text")
    if isinstance(text_config, dict) and set(text_config) == {"format"}:
        fmt = text_config["format"]
        if fmt.get("type") == "json_schema":
            schema, name = fmt["schema"], fmt["name"]
            del extra["text"]
    instructions = body.get("instructions") or ""
    request = ModelRequest(
        messages=tuple(messages),
        tools=tools,
        prompt_parts=(PromptPart("recording", instructions),) if instructions else (),
        settings=ModelSettings(
            max_tokens=body.get("max_output_tokens"),
            temperature=body.get("temperature"),
            extra=extra,
        ),
        output_schema=schema,
        output_name=name,
    )
    return request, bool(body.get("stream", False))


# -- request_differences -------------------------------------------------------------------


def _system_texts(raw: Any) -> list[str]:
    """The texts of the ``system`` / ``developer`` message items of an input."""
    if not isinstance(raw, list):
        return []
    return [
        _content_text(item.get("content"))
        for item in raw
        if item.get("type", "message") == "message" and item.get("role") in ("system", "developer")
    ]


def _instructions(body: dict[str, Any]) -> str:
    """The system prompt a body gives, wherever it puts it.

    ``instructions`` and the ``system`` / ``developer`` message items mean the
    same to the model: a recording may hold its system prompt as a ``developer``
    item where the adapter sends ``instructions`` (the adapter joins the system
    prompt and every system message with a blank line, in order).
    """
    texts = [body.get("instructions") or "", *_system_texts(body.get("input"))]
    return "\n\n".join(t for t in texts if t)


def _normal_text(sent: Any, recorded: Any) -> tuple[Any, Any]:
    """The ``text`` config of both bodies, ``format.strict`` dropped from the sent one
    when the recording has none (the recording left it to the server's default; the
    adapter derives it from the schema, and its own tests check that)."""
    fmt = recorded.get("format") if isinstance(recorded, dict) else None
    mine = sent.get("format") if isinstance(sent, dict) else None
    if isinstance(fmt, dict) and isinstance(mine, dict) and "strict" not in fmt:
        sent = {**sent, "format": {k: v for k, v in mine.items() if k != "strict"}}
    return sent, recorded


def _normal_input(raw: Any) -> list[Any]:
    """Input items in a comparable form.

    Ignored, with why: an empty assistant message (pydantic-ai sends one before
    its function calls; it carries nothing), a function_call's ``status``
    (pydantic-ai sends ``null``: a client artefact) and ``id`` (the neutral
    tool call keeps the ``call_id`` only, which is what results refer to);
    ``arguments`` compared as parsed JSON (simonw/llm re-serialises them).
    """
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    out: list[Any] = []
    for item in raw or []:
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") in ("system", "developer"):
                continue  # part of the system prompt: compared as instructions
            content = _normal_content(item.get("content"))
            if item.get("role") == "assistant" and not content:
                continue
            out.append({"role": item.get("role"), "content": content})
        elif kind == "function_call":
            try:
                arguments: Any = json.loads(item.get("arguments") or "{}")
            except ValueError:
                arguments = item.get("arguments")
            out.append(["function_call", item["call_id"], item["name"], arguments])
        elif kind == "function_call_output":
            output = _normal_content(item["output"])
            out.append(["function_call_output", item["call_id"], output])
        elif kind == "reasoning":
            out.append(
                [
                    "reasoning",
                    item.get("id"),
                    item.get("summary") or [],
                    item.get("encrypted_content"),
                ]
            )
        else:
            out.append(item)
    return out


def _normal_tools(raw: Any) -> list[Any]:
    """Tools as (type, name, description, parameters).

    Ignored: ``strict`` (the neutral tool definition has no such flag; the
    adapter leaves it to the server unless configured). A ``null`` description
    equals an empty one.
    """
    return [
        [t.get("type"), t.get("name"), t.get("description") or "", t.get("parameters")]
        for t in raw or []
    ]


def _same(sent: Any, recorded: Any) -> bool:
    """Equal as JSON, a recorded placeholder such as ``<MASSIVE_TEXT>`` matching anything."""
    if isinstance(recorded, str) and _PLACEHOLDER.match(recorded):
        return True
    if isinstance(sent, dict) and isinstance(recorded, dict):
        return set(sent) == set(recorded) and all(_same(sent[k], recorded[k]) for k in sent)
    if isinstance(sent, list) and isinstance(recorded, list):
        return len(sent) == len(recorded) and all(map(_same, sent, recorded))
    return bool(sent == recorded)


def request_differences(sent: dict[str, Any], recorded: dict[str, Any]) -> list[str]:
    """The fields that matter on which the sent body differs from the recorded one.

    ``instructions`` "" equals no instructions, and ``system`` / ``developer``
    input items are part of them (see ``_instructions``); ``stream`` absent
    equals false; ``input`` as a plain string equals one user message;
    ``text.format.strict`` absent in the recording is not compared. Every other
    top-level field is compared verbatim (after the normalisations above).
    """
    differences: list[str] = []
    checks: dict[str, tuple[Any, Any]] = {
        "model": (sent.get("model"), recorded.get("model")),
        "stream": (bool(sent.get("stream")), bool(recorded.get("stream"))),
        "instructions": (_instructions(sent), _instructions(recorded)),
        "text": _normal_text(sent.get("text"), recorded.get("text")),
        "input": (_normal_input(sent.get("input")), _normal_input(recorded.get("input"))),
        "tools": (_normal_tools(sent.get("tools")), _normal_tools(recorded.get("tools"))),
    }
    for key in (set(sent) | set(recorded)) - set(checks):
        checks[key] = (sent.get(key), recorded.get(key))
    for key, (mine, theirs) in sorted(checks.items()):
        if not _same(mine, theirs):
            differences.append(f"{key}: sent {mine!r}, recorded {theirs!r}")
    return differences


# -- expect --------------------------------------------------------------------------------


def _error_type(status: int, body: bytes) -> type[ProviderError]:
    try:
        error = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        error = {}
    code = error.get("code") if isinstance(error, dict) else None
    if code == "context_length_exceeded":
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


def _finish(response: dict[str, Any], calls: int, *, refused: bool = False) -> str | None:
    status = response.get("status")
    if status == "completed":
        if refused:
            return "content_filter"
        return "tool_calls" if calls else "stop"
    if status == "incomplete":
        reason = (response.get("incomplete_details") or {}).get("reason")
        return "length" if reason == "max_output_tokens" else reason
    return status


def _sse_events(body: bytes) -> list[dict[str, Any]]:
    events = []
    for block in body.decode("utf-8").replace("\r\n", "\n").split("\n\n"):
        data = "\n".join(
            line[5:].lstrip(" ") for line in block.split("\n") if line.startswith("data:")
        )
        if data.strip() and data.strip() != "[DONE]":  # OpenRouter ends with [DONE]
            events.append(json.loads(data))
    return events


def expect(status: int, body: bytes, headers: httpx.Headers, streamed: bool) -> Any:
    """What the adapter must make of one recorded reply (read from the reply alone)."""
    if status >= 400:
        return Expected(error=_error_type(status, body))
    if "text/event-stream" in headers.get("content-type", ""):
        return _expect_stream(_sse_events(body))
    response = json.loads(body)
    text = ""
    calls = []
    reasoning = False
    refused = False
    for item in response["output"]:
        if item["type"] == "message":
            for c in item["content"]:
                if c["type"] == "output_text":
                    text += c["text"]
                elif c["type"] == "refusal":  # shown as text, finish reason content_filter
                    text += c["refusal"]
                    refused = True
        elif item["type"] == "function_call":
            calls.append(
                ExpectedCall(item["name"], json.loads(item["arguments"] or "{}"), item["call_id"])
            )
        elif item["type"] == "reasoning":
            reasoning = True
    usage = response.get("usage") or {}
    return Expected(
        text=text,
        tool_calls=tuple(calls),
        reasoning=reasoning,
        input_tokens=usage.get("input_tokens"),
        output_tokens=usage.get("output_tokens"),
        reasoning_tokens=(usage.get("output_tokens_details") or {}).get("reasoning_tokens"),
        finish_reason=_finish(response, len(calls), refused=refused),
    )


def _expect_stream(events: list[dict[str, Any]]) -> Any:
    """From the deltas: text concatenated, calls opened by output_item.added and
    filled by argument deltas; usage and status from response.completed."""
    text = ""
    calls: dict[str, list[Any]] = {}  # item id -> [name, call_id, arguments]
    reasoning = refused = False
    final: dict[str, Any] | None = None
    for event in events:
        kind = event.get("type")
        if kind in ("response.output_text.delta", "response.refusal.delta"):
            text += event["delta"]
            refused = refused or kind == "response.refusal.delta"
        elif kind == "response.output_item.added":
            item = event["item"]
            if item["type"] == "function_call":
                calls[item["id"]] = [item["name"], item["call_id"], item.get("arguments") or ""]
            elif item["type"] == "reasoning":
                reasoning = True
        elif kind == "response.function_call_arguments.delta":
            calls[event["item_id"]][2] += event["delta"]
        elif kind in ("response.completed", "response.incomplete"):
            final = event["response"]
        elif kind in ("response.failed", "error"):
            return Expected(
                error=ProviderError, notes=("a failure event: its type depends on its code",)
            )
    if final is None:
        return Expected(error=MalformedResponseError, notes=("no response.completed event",))
    usage = final.get("usage") or {}
    expected_calls = tuple(
        ExpectedCall(name, json.loads(arguments or "{}"), call_id)
        for name, call_id, arguments in calls.values()
    )
    return Expected(
        text=text,
        tool_calls=expected_calls,
        reasoning=reasoning,
        input_tokens=usage.get("input_tokens"),
        output_tokens=usage.get("output_tokens"),
        reasoning_tokens=(usage.get("output_tokens_details") or {}).get("reasoning_tokens"),
        finish_reason=_finish(final, len(expected_calls), refused=refused),
    )


SPECS: dict[str, Any] = {
    "openai_responses": ProviderSpec(
        folder="openai_responses",
        path_suffix="/responses",
        make_model=make_model,
        decode_request=decode_request,
        request_differences=request_differences,
        expect=expect,
    )
}
