"""Conformance spec for the Google Gemini recordings (folder ``gemini``), Gemini API and Vertex AI.

Written independently of the adapter (it shares only the documented prefix of
made-up call ids): ``decode_request`` reads a recorded ``GenerateContentRequest``
back into a provider-neutral request, ``request_differences`` compares the
body the adapter sent with the recorded one after normalising what the API
treats as one, and ``expect`` reads the recorded reply (JSON, SSE or the JSON
array of ``:streamGenerateContent`` without ``alt=sse``) with its own reader.

Gemini puts the model and the streaming switch in the URL, so this spec also
gives ``model_for`` (the adapter for the recorded URL: Gemini API or Vertex AI
project and location), ``streamed_in_url`` and ``check_request`` (the method,
``alt=sse``, the key in the ``x-goog-api-key`` header and never in the URL, a
bearer token for Vertex AI). ``POST /cachedContents`` and ``DELETE
/cachedContents/<id>`` around the model calls are not model calls: skipped.

Normalised before comparing request bodies (WIRE_FORMATS.md §5): snake_case
keys (``function_call``, ``thinking_budget``) as camelCase; ``thoughtSignature``
and ``inlineData.data`` compared as the bytes they encode (standard or url-safe
base64); a signature repeated on later parallel calls of one turn (ruby_llm
copies the first) counted once; ``parameters`` (Google's upper-case OpenAPI
subset) and ``parametersJsonSchema`` as one schema with lower-case types; a
``functionResponse.response`` as the text it carries (``{output}``, ``{result}``,
``{error}`` or ruby_llm's ``{name, content: [{text}]}``); unsigned thought
summaries in a replayed model turn (the API ignores them); an empty
``generationConfig``; the role of ``systemInstruction``.
"""

from __future__ import annotations

import base64
import gzip
import json
import re
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
from _spec import Expected, ExpectedCall, ProviderSpec, UnsupportedPartError

from stepmachine import Message, ModelRequest, ModelSettings, PromptPart, ToolDefinition
from stepmachine._media import AudioPart, DocumentPart, ImagePart
from stepmachine._messages import Part, ReasoningPart, TextPart, ToolCallPart, ToolResultPart
from stepmachine.providers import (
    AuthenticationError,
    BadRequestError,
    ContextLengthExceededError,
    GeminiModel,
    HTTPModel,
    NotFoundError,
    OverloadedError,
    PermissionDeniedError,
    ProviderError,
    QuotaExceededError,
    RateLimitError,
    RetryPolicy,
    ServerError,
)
from stepmachine.providers._gemini_wire import SYNTHETIC_ID_PREFIX

KEY = "gemini-test-key-0123456789"
TOKEN = "ya29.vertex-test-token-0123456789"
_METHODS = (":generateContent", ":streamGenerateContent")
_OPAQUE = frozenset(
    {
        "args",
        "response",
        "parameters",
        "parametersJsonSchema",
        "responseSchema",
        "responseJsonSchema",
        "properties",
    }
)  # values that are the user's data: their keys are never renamed


# -- the URL -------------------------------------------------------------------------------


def _split(url: str) -> tuple[str, str, str]:
    """(the root before ``/models/``, the model, the method) of a model call's URL."""
    path = urlsplit(url).path
    root, _, tail = url.split("?", 1)[0].partition("/models/")
    model, _, method = tail.partition(":")
    if not path or not method:
        raise ValueError(f"not a Gemini model call: {url}")
    return root, model, method


def model_for(client: httpx.AsyncClient, interaction: Any) -> HTTPModel:
    """The adapter as the recording was made: Vertex AI (project, location from the URL,
    a bearer token) or the Gemini API (the recorded root, a dummy key); no retries."""
    root, model, _ = _split(interaction.url)
    vertex = re.search(r"/projects/([^/]+)/locations/([^/]+)/publishers/google$", root)
    if vertex:
        return GeminiModel(
            model,
            project=vertex.group(1),
            location=vertex.group(2),
            access_token=TOKEN,
            client=client,
            retry=RetryPolicy(max_attempts=1),
        )
    return GeminiModel(
        model, api_key=KEY, base_url=root, client=client, retry=RetryPolicy(max_attempts=1)
    )


def streamed_in_url(url: str) -> bool:
    """Whether the method is ``streamGenerateContent`` (with or without ``alt=sse``)."""
    return _split(url)[2] == "streamGenerateContent"


def check_request(request: httpx.Request, recorded: Any) -> list[str]:
    """Same root, model and method as recorded; ``alt=sse`` exactly when streaming (the
    adapter always asks for SSE, also where the recording's client did not); the
    credential in a header, never in the URL."""
    problems = []
    sent_root, sent_model, sent_method = _split(str(request.url))
    root, model, method = _split(recorded.url)
    if (sent_root, sent_model, sent_method) != (root, model, method):
        problems.append(
            f"URL {sent_root}/models/{sent_model}:{sent_method} != recorded {recorded.url}"
        )
    query = parse_qs(request.url.query.decode())
    if (query.get("alt") == ["sse"]) != (sent_method == "streamGenerateContent"):
        problems.append(f"alt={query.get('alt')} for method {sent_method}")
    if "key" in query or KEY in str(request.url) or TOKEN in str(request.url):
        problems.append("the credential is in the URL")
    if "/projects/" in root:
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            problems.append("Vertex AI: no bearer token")
    elif request.headers.get("x-goog-api-key") != KEY:
        problems.append("no x-goog-api-key header")
    return problems


# -- normalising ---------------------------------------------------------------------------


def _camel(key: str) -> str:
    return re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), key) if "_" in key[1:] else key


def camel(value: Any) -> Any:
    """``value`` with snake_case keys as camelCase (not inside arguments, schemas, responses)."""
    if isinstance(value, list):
        return [camel(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for key, item in value.items():
        name = _camel(key)
        out[name] = item if name in _OPAQUE else camel(item)
    return out


def _b64(value: str) -> bytes:
    padded = value + "=" * (-len(value) % 4)
    return base64.b64decode(padded.replace("-", "+").replace("_", "/"))


def _lower_types(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_lower_types(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _lower_types(v) for k, v in schema.items()}
    if isinstance(out.get("type"), str):
        out["type"] = out["type"].lower()
    return out


def _result_text(response: Any) -> tuple[str, bool]:
    """(the text a ``functionResponse.response`` carries, whether it is an error)."""
    if isinstance(response, dict) and len(response) == 1:
        [(key, value)] = response.items()
        if key in ("output", "result", "error"):
            return (value if isinstance(value, str) else json.dumps(value)), key == "error"
    if isinstance(response, dict) and isinstance(response.get("content"), list):
        return "".join(str(c.get("text", "")) for c in response["content"]), False
    return json.dumps(response, sort_keys=True), False


def _media(mime: str, data: bytes | None, url: str | None) -> Part:
    kind = (
        ImagePart
        if mime.startswith("image/")
        else AudioPart
        if mime.startswith("audio/")
        else DocumentPart
    )
    return kind(media_type=mime, data=data, url=url)


# -- decode_request ------------------------------------------------------------------------


def _model_parts(parts: list[dict[str, Any]], turn: int) -> list[Part]:
    out: list[Part] = []
    signatures: set[bytes] = set()
    calls = 0
    for p in parts:
        signature = p.get("thoughtSignature")
        if signature is not None and "functionCall" in p:
            if _b64(signature) in signatures:
                signature = None  # a copy of an earlier call's signature (ruby_llm)
            else:
                signatures.add(_b64(signature))
        if p.get("thought") is True:
            data = {"gemini": "thought"} | ({"signature": signature} if signature else {})
            out.append(ReasoningPart(p.get("text", ""), data))
            continue
        carrier = {"gemini": "signature", "signature": signature} if signature else None
        if "functionCall" in p:
            call = p["functionCall"]
            call_id = call.get("id") or f"{SYNTHETIC_ID_PREFIX}t{turn}-{calls}"
            calls += 1
            if carrier:
                out.append(ReasoningPart("", carrier))
            out.append(ToolCallPart.of(call_id, call["name"], call.get("args") or {}))
        elif "text" in p:
            if carrier:
                out.append(ReasoningPart("", carrier | ({} if p["text"] else {"alone": True})))
            if p["text"]:
                out.append(TextPart(p["text"]))
        else:
            raise UnsupportedPartError(f"a model part {sorted(p)}")
    return out


def decode_request(body: dict[str, Any]) -> tuple[ModelRequest, bool]:
    """The provider-neutral request a recorded body shows (streaming is in the URL: False)."""
    body = camel(body)
    messages: list[Message] = []
    open_calls: list[ToolCallPart] = []

    def add(role: Any, parts: list[Part]) -> None:
        if parts:
            messages.append(Message(id=f"m{len(messages)}", role=role, parts=tuple(parts)))

    for turn, content in enumerate(body.get("contents", [])):
        parts = content.get("parts", [])
        if content.get("role") == "model":
            decoded = _model_parts(parts, turn)
            open_calls = [p for p in decoded if isinstance(p, ToolCallPart)]
            add("assistant", decoded)
            continue
        results: list[Part] = []
        user: list[Part] = []
        for p in parts:
            if "functionResponse" in p:
                response = p["functionResponse"]
                call = _pair(response, open_calls)
                text, is_error = _result_text(response.get("response"))
                results.append(ToolResultPart(call.call_id, text, is_error, response["name"]))
            elif "text" in p:
                user.append(TextPart(p["text"]))
            elif "inlineData" in p:
                data = p["inlineData"]
                (results if results else user).append(
                    _media(data["mimeType"], _b64(data["data"]), None)
                )
            elif "fileData" in p:
                data = p["fileData"]
                (results if results else user).append(
                    _media(data.get("mimeType", ""), None, data["fileUri"])
                )
            else:
                raise UnsupportedPartError(f"a user part {sorted(p)}")
        add("tool", results)
        add("user", user)
    system = "\n\n".join(
        p.get("text", "") for p in (body.get("systemInstruction") or {}).get("parts", [])
    )
    tools = tuple(
        ToolDefinition(
            d["name"],
            d.get("description") or "",
            _lower_types(d.get("parametersJsonSchema", d.get("parameters") or {})),
        )
        for tool in body.get("tools", [])
        for d in tool.get("functionDeclarations", [])
    )
    config = dict(body.get("generationConfig") or {})
    max_tokens = config.pop("maxOutputTokens", None)
    temperature = config.pop("temperature", None)
    schema = None
    if "responseJsonSchema" in config and config.get("responseMimeType") == "application/json":
        schema = config.pop("responseJsonSchema")
        config.pop("responseMimeType")
    extra = {
        k: v
        for k, v in body.items()
        if k not in ("contents", "systemInstruction", "tools", "generationConfig")
    }
    if config:
        extra["generationConfig"] = config
    request = ModelRequest(
        messages=tuple(messages),
        tools=tools,
        prompt_parts=(PromptPart("recorded", system),) if system else (),
        settings=ModelSettings(max_tokens=max_tokens, temperature=temperature, extra=extra),
        output_schema=schema,
    )
    return request, False


def _pair(response: dict[str, Any], calls: list[ToolCallPart]) -> ToolCallPart:
    """The call a ``functionResponse`` answers: by id, else the next unanswered call of its name."""
    for call in calls:
        if response.get("id") and call.call_id == response["id"]:
            calls.remove(call)
            return call
    for call in calls:
        if call.name == response.get("name"):
            calls.remove(call)
            return call
    raise UnsupportedPartError(f"a functionResponse for no call: {response.get('name')!r}")


# -- request_differences -------------------------------------------------------------------


def _norm_part(p: dict[str, Any]) -> Any:
    signature = _b64(p["thoughtSignature"]) if p.get("thoughtSignature") else None
    if p.get("thought") is True:
        return ("thought", p.get("text"), signature) if signature else None
    if "functionCall" in p:
        c = p["functionCall"]
        return ("call", c.get("name"), c.get("args") or {}, c.get("id"), signature)
    if "functionResponse" in p:
        r = p["functionResponse"]
        return ("result", r.get("name"), r.get("id"), _result_text(r.get("response")))
    if "text" in p:
        return ("text", p["text"], signature) if p["text"] or signature else None
    if "inlineData" in p:
        return ("inline", p["inlineData"].get("mimeType"), _b64(p["inlineData"]["data"]))
    if "fileData" in p:
        return ("file", p["fileData"].get("mimeType"), p["fileData"].get("fileUri"))
    return ("other", p)


def _norm_contents(body: dict[str, Any]) -> list[Any]:
    turns = []
    for content in body.get("contents", []):
        parts = [n for p in content.get("parts", []) if (n := _norm_part(p)) is not None]
        seen: set[bytes] = set()
        for index, part in enumerate(parts):  # a copied signature on later calls counts once
            if part[0] == "call" and part[4] is not None:
                if part[4] in seen:
                    parts[index] = (*part[:4], None)
                seen.add(part[4])
        turns.append((content.get("role", "user"), parts))
    return turns


def _norm_tools(body: dict[str, Any]) -> list[Any]:
    return [
        (
            d.get("name"),
            d.get("description") or "",
            _lower_types(d.get("parametersJsonSchema", d.get("parameters"))),
        )
        for tool in body.get("tools", [])
        for d in tool.get("functionDeclarations", [])
    ]


def request_differences(sent: dict[str, Any], recorded: dict[str, Any]) -> list[str]:
    """Differences on contents, system instruction, tools, generation config and the rest
    (see the module docs for what is normalised first)."""
    sent, recorded = camel(sent), camel(recorded)

    def system(body: dict[str, Any]) -> str:
        parts = (body.get("systemInstruction") or {}).get("parts", [])
        return "\n\n".join(p.get("text", "") for p in parts)

    checks = {
        "contents": (_norm_contents(sent), _norm_contents(recorded)),
        "systemInstruction": (system(sent), system(recorded)),
        "tools": (_norm_tools(sent), _norm_tools(recorded)),
        "generationConfig": (
            sent.get("generationConfig") or {},
            recorded.get("generationConfig") or {},
        ),
    }
    for key in sorted((set(sent) | set(recorded)) - set(checks)):
        checks[key] = (sent.get(key), recorded.get(key))
    return [
        f"{name}: sent {mine!r}, recorded {theirs!r}"[:600]
        for name, (mine, theirs) in checks.items()
        if mine != theirs
    ]


# -- expect --------------------------------------------------------------------------------

_ERRORS: dict[int, type[ProviderError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    429: RateLimitError,
    503: OverloadedError,
}
_BLOCKED = {"SAFETY", "RECITATION", "BLOCKLIST", "PROHIBITED_CONTENT", "SPII", "IMAGE_SAFETY"}


def _error_class(status: int, error: dict[str, Any]) -> type[ProviderError]:
    """The class the adapter documents for an error body, read here on its own: by HTTP
    status, except a bad key (``ErrorInfo`` reason ``API_KEY_INVALID``, sent as a 400:
    AuthenticationError), a 400 whose input token count exceeds the maximum
    (ContextLengthExceededError) and a 429 whose ``QuotaFailure`` names a quota of 0
    (QuotaExceededError: no waiting helps)."""
    details = [d for d in error.get("details") or [] if isinstance(d, dict)]
    if any(d.get("reason") == "API_KEY_INVALID" for d in details):
        return AuthenticationError
    message = str(error.get("message") or "")
    if status == 400 and re.search(r"input token count.*exceeds the maximum", message, re.I | re.S):
        return ContextLengthExceededError
    if status == 429 and any(
        str(v.get("quotaValue")) == "0"
        for d in details
        if str(d.get("@type", "")).endswith("QuotaFailure")
        for v in d.get("violations") or []
        if isinstance(v, dict)
    ):
        return QuotaExceededError
    return _ERRORS.get(status, ServerError)


def _chunks(body: bytes, headers: httpx.Headers) -> list[dict[str, Any]]:
    """The ``GenerateContentResponse`` objects of a reply: SSE, a JSON array or one object."""
    if "text/event-stream" in headers.get("content-type", ""):
        return [
            json.loads(line[5:])
            for line in body.decode().splitlines()
            if line.startswith("data:") and line[5:].strip()
        ]
    data = json.loads(body)
    return data if isinstance(data, list) else [data]


def expect(status: int, body: bytes, headers: httpx.Headers, streamed: bool) -> Any:
    """What the recorded reply says the adapter must return (or raise)."""
    if body[:2] == b"\x1f\x8b":
        body = gzip.decompress(body)
    if status >= 400:
        error = json.loads(body).get("error", {})
        return Expected(
            error=_error_class(status, error), notes=(f"error {status} {error.get('status')}",)
        )
    text, calls, reasoning = "", [], False
    finish, blocked, usage = None, None, {}
    for chunk in _chunks(body, headers):
        usage = chunk.get("usageMetadata") or usage
        blocked = (chunk.get("promptFeedback") or {}).get("blockReason") or blocked
        for candidate in chunk.get("candidates") or []:
            if candidate.get("index", 0) != 0:
                continue
            finish = candidate.get("finishReason") or finish
            for part in (candidate.get("content") or {}).get("parts") or []:
                reasoning = reasoning or part.get("thought") is True or "thoughtSignature" in part
                if "functionCall" in part:
                    c = part["functionCall"]
                    calls.append(ExpectedCall(c["name"], c.get("args") or {}, c.get("id")))
                elif "text" in part and part.get("thought") is not True:
                    text += part["text"]
    if finish in _BLOCKED or (blocked and finish is None):
        reason = "content_filter"
    elif finish == "STOP":
        reason = "tool_calls" if calls else "stop"
    else:
        reason = {"MAX_TOKENS": "length"}.get(finish or "", (finish or "").lower() or None)
    thoughts = usage.get("thoughtsTokenCount")
    return Expected(
        text=text,
        tool_calls=tuple(calls),
        reasoning=reasoning,
        input_tokens=usage.get("promptTokenCount", 0),
        output_tokens=usage.get("candidatesTokenCount", 0) + (thoughts or 0),
        reasoning_tokens=thoughts,
        finish_reason=reason,
        notes=("stream" if streamed else "json", f"finishReason {finish}"),
    )


def make_model(client: httpx.AsyncClient, model: str) -> HTTPModel:
    """The Gemini API adapter with a dummy key and no retries (``model_for`` is used instead)."""
    return GeminiModel(model, api_key=KEY, client=client, retry=RetryPolicy(max_attempts=1))


SPECS: dict[str, Any] = {
    "gemini": ProviderSpec(
        folder="gemini",
        path_suffix=_METHODS,
        make_model=make_model,
        decode_request=decode_request,
        request_differences=request_differences,
        expect=expect,
        model_for=model_for,
        streamed_in_url=streamed_in_url,
        check_request=check_request,
    )
}
