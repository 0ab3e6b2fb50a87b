"""The Gemini adapter: request body, thought signatures, call ids, safety blocks, errors,
retries, secrets, Vertex AI and streaming parity (``httpx.MockTransport``; the real
recordings are replayed by ``test_conformance.py``)."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import logging
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import (
    ConfigurationError,
    InvalidFieldError,
    Message,
    ModelRequest,
    ModelResponse,
    ModelSettings,
    PromptPart,
    ToolDefinition,
)
from stepmachine._media import AudioPart, DocumentPart, ImagePart
from stepmachine._messages import ReasoningPart, TextPart, ToolCallPart, ToolResultPart
from stepmachine._model import ReasoningChunk, StreamChunk, TextChunk, ToolCallChunk
from stepmachine.extend import history_problems
from stepmachine.providers import (
    AnthropicModel,
    AuthenticationError,
    BadRequestError,
    ContextLengthExceededError,
    GeminiModel,
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
from stepmachine.providers._gemini_wire import SYNTHETIC_ID_PREFIX, contents, same_signature

KEY = "AIza-gemini-secret-0123456789"
TOKEN = "ya29.vertex-secret-0123456789"
Handler = Callable[[httpx.Request], httpx.Response]


def _model(handler: Handler, **options: Any) -> tuple[GeminiModel, list[float]]:
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    options.setdefault("api_key", KEY)
    model = GeminiModel("gemini-2.5-flash", client=client, sleep=sleep, **options)
    return model, sleeps


def _reply(parts: list[dict[str, Any]], finish: str | None = "STOP", **more: Any) -> dict[str, Any]:
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
    if finish:
        candidate["finishReason"] = finish
    return {"candidates": [candidate], "responseId": "resp-1", "modelVersion": "g-1", **more}


def _sse(*chunks: dict[str, Any]) -> bytes:
    return "".join(f"data: {json.dumps(c)}\r\n\r\n" for c in chunks).encode()


def _json(data: Any, status: int = 200, **headers: str) -> Handler:
    return lambda request: httpx.Response(status, json=data, headers=headers)


def _request(*messages: Message, **fields: Any) -> ModelRequest:
    return ModelRequest(messages=messages or (Message.user("hi", id="u1"),), **fields)


async def _both(data: dict[str, Any]) -> tuple[ModelResponse, ModelResponse, list[StreamChunk]]:
    """The reply served blocking, then as one SSE event; and the chunks of the stream."""
    blocking, _ = _model(_json(data))
    response = await blocking.request(_request())
    body = _sse(data)
    streaming, _ = _model(
        lambda r: httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
    )
    chunks: list[StreamChunk] = []

    async def sink(chunk: StreamChunk) -> None:
        chunks.append(chunk)

    streamed = await streaming.request(_request(), on_chunk=sink)
    return response, streamed, chunks


# -- the request body ------------------------------------------------------------------------


def test_body_maps_system_tools_settings_schema_and_extras() -> None:
    model = GeminiModel(
        "gemini-2.5-flash",
        api_key=KEY,
        thinking={"includeThoughts": True},
        safety_settings=[{"category": "HARM_CATEGORY_HATE_SPEECH", "threshold": "BLOCK_NONE"}],
    )
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    request = _request(
        Message.system("be brief", id="s1"),
        Message.user("hi", id="u1"),
        tools=(ToolDefinition("f", "does f", schema),),
        prompt_parts=(PromptPart("p", "you are helpful"),),
        settings=ModelSettings(
            max_tokens=50,
            temperature=0.2,
            extra={"generationConfig": {"topK": 3}, "cachedContent": "cachedContents/x"},
        ),
        output_schema=schema,
    )
    body = model.build_body(request, stream=True)
    assert body == {
        "contents": [{"role": "user", "parts": [{"text": "hi"}]}],
        "systemInstruction": {"parts": [{"text": "you are helpful\n\nbe brief"}]},
        "tools": [
            {
                "functionDeclarations": [
                    {"name": "f", "description": "does f", "parametersJsonSchema": schema}
                ]
            }
        ],
        "generationConfig": {
            "maxOutputTokens": 50,
            "temperature": 0.2,
            "responseMimeType": "application/json",
            "responseJsonSchema": schema,
            "thinkingConfig": {"includeThoughts": True},
            "topK": 3,
        },
        "safetySettings": [{"category": "HARM_CATEGORY_HATE_SPEECH", "threshold": "BLOCK_NONE"}],
        "cachedContent": "cachedContents/x",
    }
    assert body == model.build_body(request, stream=False)  # streaming is in the URL


def test_media_go_as_inline_data_or_file_data() -> None:
    png, pdf = b"\x89PNG\r\n\x1a\n\xff\xfe", b"%PDF-1.7 \xfb\xff"
    message = Message.user(
        "what is this?",
        id="u1",
        media=[
            ImagePart("image/png", data=png),
            DocumentPart("application/pdf", data=pdf),
            AudioPart("audio/wav", url="gs://bucket/a.wav"),
            ImagePart(url="https://example.com/cat.jpg"),
        ],
    )
    [turn] = contents([message])
    assert turn["parts"] == [
        {"text": "what is this?"},
        {"inlineData": {"mimeType": "image/png", "data": base64.b64encode(png).decode()}},
        {"inlineData": {"mimeType": "application/pdf", "data": base64.b64encode(pdf).decode()}},
        {"fileData": {"fileUri": "gs://bucket/a.wav", "mimeType": "audio/wav"}},
        {"fileData": {"fileUri": "https://example.com/cat.jpg"}},
    ]


def test_results_are_function_responses_named_after_their_calls() -> None:
    made_up = f"{SYNTHETIC_ID_PREFIX}resp-1-0"
    calls = Message.assistant(
        [ToolCallPart.of(made_up, "weather", {"city": "Rome"}), ToolCallPart.of("c9", "f", {})],
        id="a1",
    )
    shot = ImagePart("image/png", data=b"png")
    history = [
        Message.user("go", id="u1"),
        calls,
        # finished in the other order (tools run in parallel): sent in the calls' order
        Message.tool_result(ToolResultPart("c9", "boom", is_error=True, name="f"), id="t2"),
        Message.tool_result(ToolResultPart(made_up, "sunny"), id="t1", media=[shot]),
        Message.user("thanks", id="u2"),
    ]
    turns = contents(history)
    assert [t["role"] for t in turns] == ["user", "model", "user"]
    assert turns[1]["parts"] == [
        {"functionCall": {"name": "weather", "args": {"city": "Rome"}}},  # made-up id: not sent
        {"functionCall": {"name": "f", "args": {}, "id": "c9"}},
    ]
    assert turns[2]["parts"] == [
        {"functionResponse": {"name": "weather", "response": {"output": "sunny"}}},
        {"functionResponse": {"name": "f", "response": {"error": "boom"}, "id": "c9"}},
        {"inlineData": {"mimeType": "image/png", "data": base64.b64encode(b"png").decode()}},
        {"text": "thanks"},
    ]


async def test_media_the_adapter_cannot_send_in_a_result_are_refused_before_any_request() -> None:
    sent: list[httpx.Request] = []
    model, _ = _model(lambda r: sent.append(r) or httpx.Response(500))
    call = ToolCallPart.of("c1", "f", {})
    history = (
        Message.user("go", id="u1"),
        Message.assistant([call], id="a1"),
        Message(
            id="t1",
            role="tool",
            parts=(ToolResultPart("c1", "ok"), AudioPart("audio/wav", data=b"RIFF")),
        ),
    )
    with pytest.raises(ConfigurationError, match="AudioPart in a tool result"):
        await model.request(_request(*history))
    assert sent == []
    assert model.media == {ImagePart, DocumentPart, AudioPart}
    assert model.result_media == {ImagePart, DocumentPart}


# -- replies: signatures, call ids, usage, safety ------------------------------------------


async def test_thoughts_signatures_and_usage() -> None:
    data = _reply(
        [
            {"text": "Let me think", "thought": True},
            {"text": " more.", "thought": True},
            {"functionCall": {"name": "f", "args": {"a": 1}}, "thoughtSignature": "c2lnMQ=="},
            {"text": "Done", "thoughtSignature": "c2lnMg=="},
        ],
        usageMetadata={
            "promptTokenCount": 100,
            "candidatesTokenCount": 7,
            "thoughtsTokenCount": 30,
            "cachedContentTokenCount": 60,
        },
    )
    response, streamed, chunks = await _both(data)
    assert response == streamed
    assert response.parts == (
        ReasoningPart("Let me think more.", {"gemini": "thought"}),
        ReasoningPart("", {"gemini": "signature", "signature": "c2lnMQ=="}),
        ToolCallPart.of(f"{SYNTHETIC_ID_PREFIX}resp-1-0", "f", {"a": 1}),
        ReasoningPart("", {"gemini": "signature", "signature": "c2lnMg=="}),
        TextPart("Done"),
    )
    assert (response.usage.input_tokens, response.usage.output_tokens) == (100, 37)
    assert (response.usage.reasoning_tokens, response.usage.cache_read_tokens) == (30, 60)
    assert response.finish_reason == "tool_calls"
    assert response.model == "g-1"
    assert chunks == [
        ReasoningChunk("Let me think"),
        ReasoningChunk(" more."),
        ToolCallChunk(0, f"{SYNTHETIC_ID_PREFIX}resp-1-0", "f", '{"a":1}'),
        TextChunk("Done"),
    ]
    # Sent back: each signature on the part it came with; the unsigned summary left out.
    [turn] = contents([Message(id="a1", role="assistant", parts=response.parts)])
    assert turn["parts"] == [
        {"functionCall": {"name": "f", "args": {"a": 1}}, "thoughtSignature": "c2lnMQ=="},
        {"text": "Done", "thoughtSignature": "c2lnMg=="},
    ]


async def test_a_trailing_empty_signed_text_part_is_kept_and_sent_back() -> None:
    chunks = [
        _reply([{"text": "Hel"}], finish=None),
        _reply([{"functionCall": {"name": "f", "args": {}, "id": "x1"}}], finish=None),
        _reply([{"text": "", "thoughtSignature": "c2ln"}]),
    ]
    body = _sse(*chunks)
    model, _ = _model(
        lambda r: httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
    )
    response = await model.request(_request(), on_chunk=_ignore)
    assert response.parts == (
        TextPart("Hel"),
        ToolCallPart.of("x1", "f", {}),
        ReasoningPart("", {"gemini": "signature", "signature": "c2ln", "alone": True}),
    )
    [turn] = contents([Message(id="a1", role="assistant", parts=response.parts)])
    assert turn["parts"] == [
        {"text": "Hel"},
        {"functionCall": {"name": "f", "args": {}, "id": "x1"}},
        {"text": "", "thoughtSignature": "c2ln"},
    ]


async def _ignore(chunk: StreamChunk) -> None:
    del chunk


def test_signatures_compare_as_bytes_in_either_base64_alphabet() -> None:
    raw = bytes(range(250, 256)) * 5
    standard, urlsafe = base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode()
    assert standard != urlsafe
    assert same_signature(standard, urlsafe)
    assert same_signature(standard, urlsafe.rstrip("="))
    assert not same_signature(standard, base64.b64encode(raw[:-1]).decode())


async def test_parallel_calls_without_ids_get_stable_distinct_ids() -> None:
    calls = [
        {"functionCall": {"name": "weather", "args": {"lat": "1"}}, "thoughtSignature": "c2ln"},
        {"functionCall": {"name": "weather", "args": {"lat": "2"}}},
    ]
    response, streamed, _ = await _both(_reply(calls))
    assert response == streamed
    ids = [p.call_id for p in response.parts if isinstance(p, ToolCallPart)]
    assert ids == [f"{SYNTHETIC_ID_PREFIX}resp-1-0", f"{SYNTHETIC_ID_PREFIX}resp-1-1"]
    again, _, _ = await _both(_reply(calls))
    assert again == response  # stable: the same reply gives the same ids
    no_id = {k: v for k, v in _reply(calls).items() if k != "responseId"}
    digest, digest_streamed, _ = await _both(no_id)
    assert digest == digest_streamed
    made = [p.call_id for p in digest.parts if isinstance(p, ToolCallPart)]
    assert len(set(made)) == 2
    assert all(i.startswith(SYNTHETIC_ID_PREFIX) for i in made)
    # The results go back paired by order and name: no made-up id is ever sent.
    results = [
        Message.tool_result(ToolResultPart(i, f"r{n}"), id=f"t{n}") for n, i in enumerate(ids)
    ]
    turns = contents([Message(id="a", role="assistant", parts=response.parts), *results])
    assert turns[1]["parts"] == [
        {"functionResponse": {"name": "weather", "response": {"output": "r0"}}},
        {"functionResponse": {"name": "weather", "response": {"output": "r1"}}},
    ]
    assert "id" not in json.dumps(turns[0]["parts"]).replace("Signature", "")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_safety_block_is_a_content_filter_reply(stream: bool) -> None:
    blocked = {
        "candidates": [
            {
                "content": {},
                "finishReason": "SAFETY",
                "safetyRatings": [{"category": "HARM_CATEGORY_HATE_SPEECH", "blocked": True}],
            }
        ],
        "usageMetadata": {"promptTokenCount": 14, "totalTokenCount": 14},
    }
    prompt_blocked = {
        "promptFeedback": {"blockReason": "MODEL_ARMOR", "blockReasonMessage": "no"},
        "usageMetadata": {"promptTokenCount": 9},
    }
    for data in (blocked, prompt_blocked):
        response, streamed, chunks = await _both(data)
        assert response == streamed
        assert response.parts == ()
        assert response.finish_reason == "content_filter"
        assert chunks == []


async def test_the_json_array_of_a_stream_without_alt_sse_is_one_reply() -> None:
    array = [
        _reply([{"text": "thinking", "thought": True}], finish=None),
        _reply([{"text": "Scoop"}], finish=None),
        _reply([{"text": "", "thoughtSignature": "c2ln"}]),
    ]
    model, _ = _model(lambda r: httpx.Response(200, json=array))
    chunks: list[StreamChunk] = []

    async def sink(chunk: StreamChunk) -> None:
        chunks.append(chunk)

    response = await model.request(_request(), on_chunk=sink)
    assert [type(p).__name__ for p in response.parts] == [
        "ReasoningPart",
        "ReasoningPart",
        "TextPart",
    ]
    assert response.parts[2] == TextPart("Scoop")
    assert chunks == [ReasoningChunk("thinking"), TextChunk("Scoop")]


async def test_a_stream_cut_before_its_finish_reason_is_malformed() -> None:
    body = _sse(_reply([{"text": "Hel"}], finish=None))
    model, _ = _model(
        lambda r: httpx.Response(200, content=body, headers={"content-type": "text/event-stream"}),
        retry=RetryPolicy(max_attempts=1),
    )
    with pytest.raises(MalformedResponseError, match="before a finish reason"):
        await model.request(_request(), on_chunk=_ignore)


# -- errors and retries ----------------------------------------------------------------------


def _error(code: int, status: str, message: str = "nope", **more: Any) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "status": status, **more}}


_RETRY_INFO = {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "48s"}


@pytest.mark.parametrize(
    ("code", "status", "details", "expected"),
    [
        (400, "INVALID_ARGUMENT", [], BadRequestError),
        (
            400,
            "INVALID_ARGUMENT",
            [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "API_KEY_INVALID"}],
            AuthenticationError,
        ),
        (403, "PERMISSION_DENIED", [], PermissionDeniedError),
        (404, "NOT_FOUND", [], NotFoundError),
        (429, "RESOURCE_EXHAUSTED", [_RETRY_INFO], RateLimitError),
        (500, "INTERNAL", [], ServerError),
        (503, "UNAVAILABLE", [], OverloadedError),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_errors_are_typed_by_status(
    code: int, status: str, details: list[Any], expected: type, stream: bool
) -> None:
    body = json.dumps(_error(code, status, details=details)).encode()
    # A streaming request's error is one JSON body labelled text/event-stream.
    content_type = "text/event-stream" if stream else "application/json"
    model, _ = _model(
        lambda r: httpx.Response(code, content=body, headers={"content-type": content_type}),
        retry=RetryPolicy(max_attempts=1),
    )
    with pytest.raises(expected) as caught:
        await model.request(_request(), on_chunk=_ignore if stream else None)
    assert type(caught.value) is expected
    assert caught.value.status == code
    if expected is RateLimitError:
        assert caught.value.retry_after == 48.0


async def test_a_too_long_prompt_is_a_context_length_error() -> None:
    message = (
        "The input token count (1200000) exceeds the maximum number of tokens allowed (1048576)."
    )
    model, _ = _model(_json(_error(400, "INVALID_ARGUMENT", message), status=400))
    with pytest.raises(ContextLengthExceededError):
        await model.request(_request())


async def test_retry_info_is_waited_for_then_the_call_succeeds() -> None:
    replies = [
        httpx.Response(429, json=_error(429, "RESOURCE_EXHAUSTED", details=[_RETRY_INFO])),
        httpx.Response(503, json=_error(503, "UNAVAILABLE")),
        httpx.Response(200, json=_reply([{"text": "ok"}])),
    ]
    bodies: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(request.content)
        return replies[len(bodies) - 1]

    model, sleeps = _model(handler, retry=RetryPolicy(max_attempts=3, max_delay=60, jitter=0))
    response = await model.request(_request())
    assert response.parts == (TextPart("ok"),)
    assert response.attempts == 3
    assert sleeps[0] == 48.0  # RetryInfo.retryDelay, honoured as retry-after
    assert len(set(bodies)) == 1  # every retry sends the same body


async def test_a_retry_delay_beyond_the_policy_gives_up_at_once() -> None:
    model, sleeps = _model(
        _json(_error(429, "RESOURCE_EXHAUSTED", details=[_RETRY_INFO]), status=429),
        retry=RetryPolicy(max_attempts=3, max_delay=30),
    )
    with pytest.raises(RateLimitError) as caught:
        await model.request(_request())
    assert (caught.value.attempts, sleeps) == (1, [])


async def test_no_retry_once_output_was_streamed() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        body = _sse(_reply([{"text": "Hel"}], finish=None)) + b"data: {not json\r\n\r\n"
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    model, _ = _model(handler)
    with pytest.raises(MalformedResponseError):
        await model.request(_request(), on_chunk=_ignore)
    assert calls == 1


async def test_an_error_chunk_inside_a_stream_is_typed() -> None:
    body = _sse(_reply([{"text": "a"}], finish=None), _error(503, "UNAVAILABLE", "overloaded"))
    model, _ = _model(
        lambda r: httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
    )
    with pytest.raises(OverloadedError):
        await model.request(_request(), on_chunk=_ignore)


# -- secrets, configuration, Vertex AI --------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_the_key_travels_in_a_header_and_never_shows_in_an_error(stream: bool) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        echo = f"API key not valid: {KEY} (url {request.url})"
        return httpx.Response(400, json=_error(400, "INVALID_ARGUMENT", echo))

    model, _ = _model(handler)
    with pytest.raises(BadRequestError) as caught:
        await model.request(_request(), on_chunk=_ignore if stream else None)
    [request] = seen
    assert request.headers["x-goog-api-key"] == KEY
    assert KEY not in str(request.url)
    assert "key=" not in str(request.url)
    shown = "".join(traceback.format_exception(caught.value)) + repr(vars(caught.value))
    assert KEY not in shown
    assert KEY not in repr(model)


def test_the_key_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GEMINI_API_KEY", raising=False)
    monkeypatch.setenv("GOOGLE_API_KEY", "google-key")
    monkeypatch.setenv("GEMINI_BASE_URL", "https://proxy.example/v1beta/")
    model = GeminiModel("gemini-2.5-flash")
    assert model.auth_headers() == {"x-goog-api-key": "google-key"}
    assert model.url(stream=False) == (
        "https://proxy.example/v1beta/models/gemini-2.5-flash:generateContent"
    )
    monkeypatch.setenv("GEMINI_API_KEY", "gemini-key")
    assert GeminiModel("m").auth_headers() == {"x-goog-api-key": "gemini-key"}
    assert GeminiModel("m", api_key="arg").auth_headers() == {"x-goog-api-key": "arg"}
    assert GeminiModel("m").url(stream=True) == (
        "https://proxy.example/v1beta/models/m:streamGenerateContent?alt=sse"
    )


async def test_vertex_ai_url_and_bearer_token() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(403, json=_error(403, "PERMISSION_DENIED", f"token {TOKEN}"))

    model, _ = _model(
        handler, api_key=None, project="my-proj", location="europe-west4", access_token=TOKEN
    )
    with pytest.raises(PermissionDeniedError) as caught:
        await model.request(_request())
    [request] = seen
    assert str(request.url) == (
        "https://europe-west4-aiplatform.googleapis.com/v1beta1/projects/my-proj/locations/"
        "europe-west4/publishers/google/models/gemini-2.5-flash:generateContent"
    )
    assert request.headers["authorization"] == f"Bearer {TOKEN}"
    assert "x-goog-api-key" not in request.headers
    assert TOKEN not in "".join(traceback.format_exception(caught.value))
    global_model = GeminiModel("g", project="p", access_token=TOKEN)
    assert global_model.url(stream=True) == (
        "https://aiplatform.googleapis.com/v1beta1/projects/p/locations/global/publishers/"
        "google/models/g:streamGenerateContent?alt=sse"
    )


def test_configuration_errors() -> None:
    with pytest.raises(ConfigurationError, match="not both"):
        GeminiModel("g", api_key="k", access_token="t", project="p")
    with pytest.raises(ConfigurationError, match="Vertex AI"):
        GeminiModel("g", access_token="t")


# -- invariant 9: any chunking of a reply gives the blocking reply ------------------------------

_TEXT = st.text(alphabet="ab ✓\n", min_size=1, max_size=8)
_SIG = st.binary(min_size=1, max_size=12).map(lambda b: base64.b64encode(b).decode())
_CALL = st.builds(
    lambda name, args, sig: (
        {"functionCall": {"name": name, "args": args}} | ({"thoughtSignature": sig} if sig else {})
    ),
    st.sampled_from(["f", "g"]),
    st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 9), max_size=2),
    st.none() | _SIG,
)
_PIECE = st.one_of(
    st.builds(lambda t: {"kind": "text", "text": t}, _TEXT),
    st.builds(lambda t: {"kind": "thought", "text": t}, _TEXT),
    st.builds(lambda c: {"kind": "call", "part": c}, _CALL),
)


def _wire(pieces: list[dict[str, Any]], cuts: list[int]) -> tuple[list[dict[str, Any]], list[Any]]:
    """(the parts of one blocking reply, the same reply's parts as stream chunks: each text
    cut at ``cuts``)."""
    whole: list[dict[str, Any]] = []
    streamed: list[list[dict[str, Any]]] = []
    for piece in pieces:
        if piece["kind"] == "call":
            whole.append(piece["part"])
            streamed.append([piece["part"]])
            continue
        extra = {"thought": True} if piece["kind"] == "thought" else {}
        whole.append({"text": piece["text"], **extra})
        text = piece["text"]
        points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
        streamed += [[{"text": text[a:b], **extra}] for a, b in itertools.pairwise(points) if b > a]
    return whole, streamed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pieces=st.lists(_PIECE, max_size=6),
    cuts=st.lists(st.integers(0, 20), max_size=4),
    backend=st.sampled_from(["asyncio", "trio"]),
)
def test_a_stream_cut_anywhere_gives_the_blocking_reply(
    pieces: list[dict[str, Any]], cuts: list[int], backend: str
) -> None:
    whole, streamed = _wire(pieces, cuts)
    usage = {"usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 2}}
    stream_chunks = [_reply(parts, finish=None, **usage) for parts in streamed]
    stream_chunks.append(_reply([{"text": ""}], **usage))
    body = _sse(*stream_chunks)

    async def run() -> tuple[ModelResponse, ModelResponse, list[StreamChunk]]:
        blocking, _ = _model(_json(_reply(whole, **usage)))
        streaming, _ = _model(
            lambda r: httpx.Response(
                200, content=body, headers={"content-type": "text/event-stream"}
            )
        )
        chunks: list[StreamChunk] = []

        async def sink(chunk: StreamChunk) -> None:
            chunks.append(chunk)

        return (
            await blocking.request(_request()),
            await streaming.request(_request(), on_chunk=sink),
            chunks,
        )

    response, streamed_response, chunks = anyio.run(run, backend=backend)
    assert streamed_response == response
    text = "".join(c.text for c in chunks if isinstance(c, TextChunk))
    assert text == "".join(p.text for p in response.parts if isinstance(p, TextPart))
    thought = "".join(c.text for c in chunks if isinstance(c, ReasoningChunk))
    assert thought == "".join(p.text for p in response.parts if isinstance(p, ReasoningPart))
    calls = [p for p in response.parts if isinstance(p, ToolCallPart)]
    call_chunks = [c for c in chunks if isinstance(c, ToolCallChunk)]
    assert [(c.index, c.call_id, c.name, c.arguments_delta) for c in call_chunks] == [
        (n, p.call_id, p.name, p.raw_arguments) for n, p in enumerate(calls)
    ]


# -- signatures: what came back goes back -------------------------------------------------------


def _turns(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A model turn as the API sends it, in the form it is sent back: signed thoughts,
    answer texts (signed or not) and calls (with ids, signed or not), never two texts or
    two thoughts in a row; an empty signed text only after a call or at the start."""
    parts: list[dict[str, Any]] = []
    for n in range(draw(st.integers(0, 6))):
        last = parts[-1] if parts else {}
        options = ["call"]
        if "thought" not in last:
            options.append("thought")
        if "text" not in last or "thought" in last:
            options += ["text", "empty"]
        kind = draw(st.sampled_from(options))
        signature = draw(_SIG)
        if kind == "thought":
            parts.append({"text": draw(_TEXT), "thought": True, "thoughtSignature": signature})
        elif kind == "text":
            part = {"text": draw(_TEXT)}
            parts.append(part | ({"thoughtSignature": signature} if draw(st.booleans()) else {}))
        elif kind == "empty":
            parts.append({"text": "", "thoughtSignature": signature})
        else:
            call = {"functionCall": {"name": "f", "args": {"n": n}, "id": f"id{n}"}}
            parts.append(call | ({"thoughtSignature": signature} if draw(st.booleans()) else {}))
    return parts


@settings(max_examples=80, deadline=None)
@given(parts=st.composite(_turns)())
def test_every_signature_goes_back_on_the_part_it_came_with(
    gemini_for_parsing: GeminiModel, parts: list[dict[str, Any]]
) -> None:
    response = gemini_for_parsing.parse_response(_reply(parts))
    [turn] = contents([Message(id="a1", role="assistant", parts=response.parts)]) or [{"parts": []}]
    assert turn["parts"] == parts


# -- through the machine: parallel calls without ids, signatures, results by name ------------


@pytest.mark.parametrize("stream", [False, True])
async def test_an_agent_turn_with_parallel_calls_round_trips_through_a_store(stream: bool) -> None:
    from stepmachine import ModelInference, Runtime, StateMachine, Tools, tool
    from stepmachine.stores import MemoryStore

    @tool
    def weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    replies = [
        _reply(
            [
                {"text": "Two cities.", "thought": True},
                {
                    "functionCall": {"name": "weather", "args": {"city": "Rome"}},
                    "thoughtSignature": "c2lnMQ==",
                },
                {"functionCall": {"name": "weather", "args": {"city": "Oslo"}}},
            ]
        ),
        _reply([{"text": "Both sunny.", "thoughtSignature": "c2lnMg=="}])
        | {"responseId": "resp-2"},
    ]
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        reply = replies[len(sent) - 1]
        if request.url.params.get("alt") == "sse":
            headers = {"content-type": "text/event-stream"}
            return httpx.Response(200, content=_sse(reply), headers=headers)
        return httpx.Response(200, json=reply)

    model, _ = _model(handler)
    store = MemoryStore()
    await store.create("s1", conversation=[Message.user("Weather in Rome and Oslo?", id="u1")])
    machine = StateMachine([Tools([weather]), ModelInference(stream=stream)])
    report = await machine.run_report(Runtime(store=store, model=model), "s1")
    assert report.reason.kind == "done"
    assert len(sent) == 2
    model_turn, results_turn = sent[1]["contents"][1:]
    assert model_turn == {
        "role": "model",
        "parts": [
            {
                "functionCall": {"name": "weather", "args": {"city": "Rome"}},
                "thoughtSignature": "c2lnMQ==",
            },
            {"functionCall": {"name": "weather", "args": {"city": "Oslo"}}},
        ],
    }
    assert results_turn == {
        "role": "user",
        "parts": [
            {"functionResponse": {"name": "weather", "response": {"output": "sunny in Rome"}}},
            {"functionResponse": {"name": "weather", "response": {"output": "sunny in Oslo"}}},
        ],
    }
    assert report.session.conversation[-1].text == "Both sunny."


KEY_GEMINI_MEDIA = "AIza-review-secret-0123456789"


TOKEN_GEMINI_MEDIA = "ya29.review-vertex-secret-0123456789"


SSE = {"content-type": "text/event-stream"}


# -- Gemini helpers ------------------------------------------------------------------------


def _model_gemini_media(handler: Handler, **options: Any) -> tuple[GeminiModel, list[float]]:
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    options.setdefault("api_key", KEY_GEMINI_MEDIA)
    return GeminiModel("gemini-2.5-flash", client=client, sleep=sleep, **options), sleeps


def _reply_gemini_media(
    parts: list[dict[str, Any]], finish: str | None = "STOP", **more: Any
) -> dict[str, Any]:
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
    if finish:
        candidate["finishReason"] = finish
    return {"candidates": [candidate], "modelVersion": "g-1", **more}


def _sse_gemini_media(*chunks: Any) -> bytes:
    return "".join(f"data: {json.dumps(c)}\r\n\r\n" for c in chunks).encode()


def _request_gemini_media(*messages: Message) -> ModelRequest:
    return ModelRequest(messages=messages or (Message.user("hi", id="u1"),))


async def _ignore_gemini_media(chunk: StreamChunk) -> None:
    del chunk


async def _ask(model: GeminiModel, *, stream: bool) -> ModelResponse:
    with anyio.fail_after(10):
        return await model.request(
            _request_gemini_media(), on_chunk=_ignore_gemini_media if stream else None
        )


def _error_gemini_media(
    code: int, status: str, message: str = "nope", **more: Any
) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "status": status, **more}}


def _served(data: Any, *, stream: bool, status: int = 200) -> Handler:
    if stream:
        body = _sse_gemini_media(*data) if isinstance(data, list) else _sse_gemini_media(data)
        return lambda r: httpx.Response(status, content=body, headers=SSE)
    return lambda r: httpx.Response(status, json=data)


# -- Gemini: malformed replies are typed, never a bare exception ------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
@pytest.mark.parametrize(
    "args", [[1, 2], "a string", 3, True], ids=["list", "string", "number", "bool"]
)
async def test_function_call_args_that_are_not_an_object_are_malformed(
    stream: bool, args: Any
) -> None:
    data = _reply_gemini_media([{"functionCall": {"name": "f", "args": args}}])
    model, _ = _model_gemini_media(_served(data, stream=stream))
    with pytest.raises(MalformedResponseError):
        await _ask(model, stream=stream)


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
@pytest.mark.parametrize(
    "chunk",
    [
        {"candidates": [{"content": {"parts": [{"text": 5}]}, "finishReason": "STOP"}]},
        {"candidates": "nope"},
        {"candidates": [{"content": {"parts": {"text": "x"}}}]},
        {"candidates": [{"content": "x", "finishReason": "STOP"}]},
        {"candidates": [{"finishReason": 7}]},
        {"candidates": [{"content": {"parts": [{"functionCall": {"args": {}}}]}}]},
        {"candidates": [{"content": {"parts": [{"text": "a", "thoughtSignature": 9}]}}]},
        {"usageMetadata": [1]},
        {"promptFeedback": {"blockReason": 3}},
    ],
    ids=[
        "text-number",
        "candidates-str",
        "parts-object",
        "content-str",
        "finish-number",
        "call-no-name",
        "signature-number",
        "usage-list",
        "block-number",
    ],
)
async def test_mistyped_reply_fields_are_malformed_responses(stream: bool, chunk: Any) -> None:
    model, _ = _model_gemini_media(_served(chunk, stream=stream))
    with pytest.raises(MalformedResponseError):
        await _ask(model, stream=stream)


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
async def test_chunks_without_candidates_content_or_parts_are_skipped(stream: bool) -> None:
    chunks = [
        {"usageMetadata": {"promptTokenCount": 3}},
        {"candidates": [{"index": 0}]},
        {"candidates": [{"content": {"role": "model"}}]},
        {"candidates": [{"content": {"parts": []}}]},
        _reply_gemini_media([{"text": "ok"}]),
    ]
    if stream:
        model, _ = _model_gemini_media(_served(chunks, stream=True))
    else:
        model, _ = _model_gemini_media(
            lambda r: httpx.Response(200, json=chunks)
        )  # the JSON-array form
    response = await _ask(model, stream=stream)
    assert response.parts == (TextPart("ok"),)
    assert response.finish_reason == "stop"


@pytest.mark.anyio
@pytest.mark.parametrize(
    "body",
    [
        b'data: {"candidates": [\r\n\r\n',  # truncated JSON
        b"data: [DONE]\r\n\r\n",
        b'data: "just a string"\r\n\r\n',
        _sse_gemini_media(
            _reply_gemini_media([{"text": "Hel"}], finish=None)
        ),  # cut before finishReason
        b"",  # nothing at all
        b": a comment only\r\n\r\n",
    ],
    ids=["truncated", "done", "string", "no-finish", "empty", "comment"],
)
async def test_a_broken_stream_is_a_malformed_response(body: bytes) -> None:
    model, _ = _model_gemini_media(lambda r: httpx.Response(200, content=body, headers=SSE))
    with pytest.raises(MalformedResponseError):
        await _ask(model, stream=True)


@pytest.mark.anyio
async def test_a_multi_line_data_event_is_one_chunk() -> None:
    text = json.dumps(_reply_gemini_media([{"text": "ok"}]), indent=1)
    body = ("".join(f"data: {line}\n" for line in text.splitlines()) + "\n").encode()
    model, _ = _model_gemini_media(lambda r: httpx.Response(200, content=body, headers=SSE))
    response = await _ask(model, stream=True)
    assert response.parts == (TextPart("ok"),)


# -- Gemini: signatures -----------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
@pytest.mark.parametrize(
    "signature", ["not base64 at all!!", "A" * 2_000_000, "é-unicode_", ""], ids=str.__len__
)
async def test_any_signature_string_comes_back_unchanged_on_its_call(
    stream: bool, signature: str
) -> None:
    part = {"functionCall": {"name": "f", "args": {"a": 1}}, "thoughtSignature": signature}
    model, _ = _model_gemini_media(
        _served(_reply_gemini_media([part], responseId="r1"), stream=stream)
    )
    response = await _ask(model, stream=stream)
    history = (
        Message.user("hi", id="u1"),
        Message(id="a1", role="assistant", parts=response.parts),
    )
    body = model.build_body(_request_gemini_media(*history), stream=False)
    [call] = body["contents"][1]["parts"]
    assert call["functionCall"]["name"] == "f"
    assert call["thoughtSignature"] == signature


def _gemini_history() -> tuple[Message, ...]:
    """A conversation whose assistant turn came from Gemini with signed thoughts."""
    parts = (
        ReasoningPart("thinking...", {"gemini": "thought", "signature": "R2VtaW5pU2ln"}),
        ReasoningPart("", {"gemini": "signature", "signature": "Q2FsbFNpZw=="}),
        ToolCallPart.parse("c1", "f", "{}"),
    )
    from stepmachine._messages import ToolResultPart

    return (
        Message.user("hi", id="u1"),
        Message(id="a1", role="assistant", parts=parts),
        Message(id="t1", role="tool", parts=(ToolResultPart("c1", "42", name="f"),)),
    )


def test_gemini_signatures_are_not_sent_to_anthropic() -> None:
    model = AnthropicModel("claude-sonnet-4-5", api_key="sk-ant-review")
    body = model.build_body(ModelRequest(messages=_gemini_history()), stream=False)
    blocks = [b for m in body["messages"] for b in m["content"] if isinstance(b, dict)]
    assert not [b for b in blocks if b.get("type") in {"thinking", "redacted_thinking"}]


def test_gemini_signatures_are_not_sent_to_openai_responses() -> None:
    model = OpenAIResponsesModel("gpt-5", api_key="sk-review")
    body = model.build_body(ModelRequest(messages=_gemini_history()), stream=False)
    assert not [i for i in body["input"] if i.get("type") == "reasoning"]


def test_anthropic_signatures_are_not_sent_to_gemini() -> None:
    parts = (
        ReasoningPart("hmm", {"signature": "anthropic-sig"}),
        ReasoningPart("", {"redacted": "xyz"}),
        TextPart("answer"),
    )
    model = GeminiModel("gemini-2.5-flash", api_key=KEY_GEMINI_MEDIA)
    history = (Message.user("hi", id="u1"), Message(id="a1", role="assistant", parts=parts))
    body = model.build_body(_request_gemini_media(*history), stream=False)
    assert body["contents"][1]["parts"] == [{"text": "answer"}]


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
async def test_synthesised_call_ids_differ_between_turns(stream: bool) -> None:
    """Without responseId, the same call (same tool, same arguments) in two turns of one
    conversation gets two ids: results pair unambiguously, and the history stays valid
    after a switch to a provider that requires unique ids (Anthropic)."""
    data = _reply_gemini_media([{"functionCall": {"name": "now", "args": {}}}])  # no responseId
    history: list[Message] = [Message.user("hi", id="u1")]
    ids = []
    for turn in range(3):
        model, _ = _model_gemini_media(_served(data, stream=stream))
        with anyio.fail_after(10):
            response = await model.request(
                ModelRequest(messages=tuple(history)),
                on_chunk=_ignore_gemini_media if stream else None,
            )
        [call] = [p for p in response.parts if isinstance(p, ToolCallPart)]
        ids.append(call.call_id)
        history.append(Message(id=f"a{turn}", role="assistant", parts=response.parts))
        history.append(Message.tool_result(ToolResultPart.for_call(call, "12:00"), id=f"t{turn}"))
    assert len(set(ids)) == 3, ids
    assert history_problems(history) == []
    body = AnthropicModel("claude-x", api_key=KEY_GEMINI_MEDIA).build_body(
        ModelRequest(messages=(*history, Message.user("thanks", id="u2"))), stream=False
    )
    uses = [b["id"] for m in body["messages"] for b in m["content"] if b["type"] == "tool_use"]
    assert uses == ids


@pytest.mark.anyio
async def test_synthesised_call_ids_are_the_same_for_the_same_request() -> None:
    """Replay-safe: the same request and reply give the same ids, streamed or not (the
    id is derived from the conversation the request continues, not drawn at random)."""
    data = _reply_gemini_media(
        [
            {"functionCall": {"name": "now", "args": {}}},
            {"functionCall": {"name": "now", "args": {}}},
        ]
    )
    history = (Message.user("hi", id="u1"), Message.user("again", id="u2"))
    ids = []
    for stream in (False, True, False):
        model, _ = _model_gemini_media(_served(data, stream=stream))
        with anyio.fail_after(10):
            response = await model.request(
                ModelRequest(messages=history), on_chunk=_ignore_gemini_media if stream else None
            )
        ids.append([p.call_id for p in response.parts if isinstance(p, ToolCallPart)])
    assert ids[0] == ids[1] == ids[2]
    assert len(set(ids[0])) == 2
    assert all(i.startswith("gemini-call-") for i in ids[0])


# -- Gemini: errors and retries ----------------------------------------------------------------


def _retry_info(delay: Any) -> dict[str, Any]:
    return {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay}


@pytest.mark.anyio
@pytest.mark.parametrize(
    "delay",
    ["999999s", "1e9s", {"seconds": "999999999"}, {"seconds": "inf"}, "99999999999999999999s"],
    ids=str,
)
async def test_a_huge_retry_delay_gives_up_at_once_without_sleeping(delay: Any) -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        body = _error_gemini_media(429, "RESOURCE_EXHAUSTED", details=[_retry_info(delay)])
        return httpx.Response(429, json=body)

    model, sleeps = _model_gemini_media(handler, retry=RetryPolicy(max_attempts=3, max_delay=30))
    with pytest.raises(RateLimitError):
        await _ask(model, stream=False)
    assert all(s <= 30 for s in sleeps)
    assert calls <= 3


@pytest.mark.anyio
@pytest.mark.parametrize(
    "delay",
    ["garbage", "-5s", "0s", None, [], {"seconds": "nan"}, {"seconds": []}, "nans", "1.5.2s"],
    ids=str,
)
async def test_a_garbage_retry_delay_falls_back_to_the_policy(delay: Any) -> None:
    replies = [
        httpx.Response(
            429, json=_error_gemini_media(429, "RESOURCE_EXHAUSTED", details=[_retry_info(delay)])
        ),
        httpx.Response(200, json=_reply_gemini_media([{"text": "ok"}])),
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        return replies.pop(0)

    model, sleeps = _model_gemini_media(
        handler, retry=RetryPolicy(max_attempts=2, max_delay=30, jitter=0)
    )
    response = await _ask(model, stream=False)
    assert response.parts == (TextPart("ok"),)
    assert len(sleeps) == 1
    assert 0 <= sleeps[0] <= 30


@pytest.mark.anyio
@pytest.mark.parametrize("code", [429, 500, 503, 400])
async def test_an_error_served_as_event_stream_is_typed_by_status(code: int) -> None:
    status = {429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}.get(
        code, "INVALID_ARGUMENT"
    )
    raw = json.dumps(_error_gemini_media(code, status, "boom")).encode()
    model, _ = _model_gemini_media(
        lambda r: httpx.Response(code, content=raw, headers=SSE),
        retry=RetryPolicy(max_attempts=1),
    )
    with pytest.raises(ProviderError) as caught:
        await _ask(model, stream=True)
    assert caught.value.status == code
    assert not isinstance(caught.value, MalformedResponseError)


@pytest.mark.anyio
@pytest.mark.parametrize("vertex", [False, True], ids=["key", "vertex"])
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
@pytest.mark.parametrize("how", ["error", "malformed", "transport"])
async def test_the_secret_never_leaks_into_errors_causes_reprs_or_logs(
    vertex: bool, stream: bool, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    secret = TOKEN_GEMINI_MEDIA if vertex else KEY_GEMINI_MEDIA

    def handler(request: httpx.Request) -> httpx.Response:
        echo = f"bad credential {secret} headers {dict(request.headers)}"
        if how == "transport":
            raise httpx.ConnectError(echo, request=request)
        if how == "malformed":
            return httpx.Response(
                200, content=b"data: {" + echo.encode() + b"\r\n\r\n", headers=SSE if stream else {}
            )
        return httpx.Response(403, json=_error_gemini_media(403, "PERMISSION_DENIED", echo))

    options: dict[str, Any] = (
        {"api_key": None, "project": "p", "access_token": TOKEN_GEMINI_MEDIA} if vertex else {}
    )
    model, _ = _model_gemini_media(handler, retry=RetryPolicy(max_attempts=2, jitter=0), **options)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(Exception) as caught:  # noqa: PT011 - any error; what it shows matters
        await _ask(model, stream=stream)
    shown = "".join(traceback.format_exception(caught.value))
    error: BaseException | None = caught.value
    while error is not None:
        shown += repr(error) + str(error) + repr(getattr(error, "__dict__", {}))
        error = error.__cause__ or error.__context__
    shown += caplog.text + repr(model) + str(model)
    assert secret not in shown


# -- Gemini: media it cannot send --------------------------------------------------------------


async def _refused(*messages: Message) -> None:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json=_reply_gemini_media([{"text": "ok"}]))

    model, _ = _model_gemini_media(handler)
    with anyio.fail_after(10), pytest.raises(ConfigurationError):
        await model.request(_request_gemini_media(*messages))
    assert sent == []


SHOT = ImagePart(media_type="image/png", data=b"\x89PNG\r\n\x1a\n....")


@pytest.mark.anyio
async def test_media_in_an_assistant_message_is_refused_before_any_request() -> None:
    assistant = Message(id="a1", role="assistant", parts=(TextPart("here"), SHOT))
    await _refused(Message.user("hi", id="u1"), assistant)


@pytest.mark.anyio
async def test_media_in_a_system_message_is_refused_before_any_request() -> None:
    system = Message(id="s", role="system", parts=(TextPart("be brief"), SHOT))
    await _refused(system, Message.user("hi", id="u1"))


def test_an_empty_image_cannot_even_be_made() -> None:
    with pytest.raises(InvalidFieldError):
        ImagePart(media_type="image/png", data=b"")


def test_a_data_url_image_never_goes_out_as_a_file_uri() -> None:
    url = "data:image/png;base64,iVBORw0KGgo="
    image = ImagePart(url=url, media_type="image/png")
    model = GeminiModel("gemini-2.5-flash", api_key=KEY_GEMINI_MEDIA)
    try:
        body = model.build_body(
            _request_gemini_media(Message.user("look", id="u1", media=[image])), stream=False
        )
    except ConfigurationError:
        return  # refused: fine
    assert url not in json.dumps(body)


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
@pytest.mark.parametrize("call_id", [7, ["x"], {"a": 1}], ids=str)
async def test_a_non_string_call_id_is_malformed(stream: bool, call_id: Any) -> None:
    data = _reply_gemini_media([{"functionCall": {"name": "f", "args": {}, "id": call_id}}])
    model, _ = _model_gemini_media(_served(data, stream=stream))
    with pytest.raises(MalformedResponseError):
        await _ask(model, stream=stream)


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
async def test_a_reply_with_only_other_candidates_is_malformed(stream: bool) -> None:
    data = {
        "candidates": [{"index": 1, "content": {"parts": [{"text": "x"}]}, "finishReason": "STOP"}]
    }
    model, _ = _model_gemini_media(_served(data, stream=stream))
    with pytest.raises(MalformedResponseError):
        await _ask(model, stream=stream)


def test_the_secret_is_not_in_the_models_attributes_repr() -> None:
    for model in (
        GeminiModel("g", api_key=KEY_GEMINI_MEDIA),
        GeminiModel("g", project="p", access_token=TOKEN_GEMINI_MEDIA),
    ):
        shown = repr(model) + repr(vars(model)) + str(model)
        assert KEY_GEMINI_MEDIA not in shown
        assert TOKEN_GEMINI_MEDIA not in shown


@pytest.mark.anyio
async def test_an_error_chunk_before_any_output_is_retried() -> None:
    """A stream whose first chunk is a 503 error has emitted nothing: as replay-safe
    as an HTTP 503, so it is retried like one."""
    replies = [
        _sse_gemini_media(_error_gemini_media(503, "UNAVAILABLE", "overloaded")),
        _sse_gemini_media(_reply_gemini_media([{"text": "ok"}])),
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=replies.pop(0), headers=SSE)

    model, _ = _model_gemini_media(handler, retry=RetryPolicy(max_attempts=2, jitter=0))
    response = await _ask(model, stream=True)
    assert response.parts == (TextPart("ok"),)


def test_a_model_resource_name_is_not_doubled_in_the_url() -> None:
    model = GeminiModel("models/gemini-2.5-flash", api_key=KEY_GEMINI_MEDIA)
    assert "/models/models/" not in model.url(stream=False)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param({"gemini": "signature"}, id="pending"),
        pytest.param({"gemini": "signature", "alone": True}, id="alone"),
        pytest.param({"gemini": "thought"}, id="thought"),
    ],
)
def test_a_gemini_carrier_without_its_signature_is_not_a_bare_key_error(
    data: dict[str, Any],
) -> None:
    """provider_data comes back from a store or from application code: a carrier that
    lost its signature is skipped (or refused with a ConfigurationError), never a
    KeyError from deep inside build_body."""
    parts = (ReasoningPart("", data), TextPart("answer"))
    history = (Message.user("hi", id="u1"), Message(id="a1", role="assistant", parts=parts))
    model = GeminiModel("gemini-2.5-flash", api_key=KEY_GEMINI_MEDIA)
    try:
        body = model.build_body(_request_gemini_media(*history), stream=False)
    except ConfigurationError:
        return
    assert {"text": "answer"} in [
        {k: v for k, v in p.items() if k != "thoughtSignature"}
        for p in body["contents"][1]["parts"]
    ]


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
async def test_the_key_does_not_follow_a_redirect_to_another_host(stream: bool) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.host == "generativelanguage.googleapis.com":
            return httpx.Response(307, headers={"location": "https://evil.example/collect"})
        return httpx.Response(200, json=_reply_gemini_media([{"text": "ok"}]))

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler), follow_redirects=True)
    model = GeminiModel("gemini-2.5-flash", api_key=KEY_GEMINI_MEDIA, client=client)
    with anyio.fail_after(10), contextlib.suppress(ProviderError):  # refusing it is fine
        await model.request(
            _request_gemini_media(), on_chunk=_ignore_gemini_media if stream else None
        )
    assert all(
        KEY_GEMINI_MEDIA not in str(r.headers)
        for r in seen
        if r.url.host != "generativelanguage.googleapis.com"
    )


_SIG_GEMINI_MEDIA = st.text(
    alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdef0123456789+/=_-", min_size=1, max_size=12
)
_WIRE_PART = st.one_of(
    st.builds(
        lambda text, sig: {"text": text, **({"thoughtSignature": sig} if sig else {})},
        st.text(alphabet="xyz ", max_size=4),
        st.none() | _SIG_GEMINI_MEDIA,
    ),
    st.builds(
        lambda text, sig: {
            "text": text,
            "thought": True,
            **({"thoughtSignature": sig} if sig else {}),
        },
        st.text(alphabet="tu", max_size=4),
        st.none() | _SIG_GEMINI_MEDIA,
    ),
    st.builds(
        lambda name, sig: {
            "functionCall": {"name": name, "args": {}},
            **({"thoughtSignature": sig} if sig else {}),
        },
        st.sampled_from(["f", "g"]),
        st.none() | _SIG_GEMINI_MEDIA,
    ),
)


@pytest.fixture(scope="module")
def gemini_for_parsing() -> Iterator[GeminiModel]:
    """One adapter for the properties that only parse replies and build bodies (no request).

    Building one per example made an HTTP client (an SSL context) 300 times.
    """
    model = GeminiModel("gemini-2.5-flash", api_key=KEY_GEMINI_MEDIA)
    yield model
    anyio.run(model.aclose)


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(_WIRE_PART, max_size=8))
def test_every_signature_goes_back_once_in_order_and_on_its_call(
    gemini_for_parsing: GeminiModel,
    parts: list[dict[str, Any]],
) -> None:
    """Whatever a reply holds, the next request carries each of its signatures exactly
    once, in their order, and a call's signature on that same call."""
    model = gemini_for_parsing
    response = model.parse_response(_reply_gemini_media(parts, responseId="r"))
    history = (
        Message.user("hi", id="u1"),
        Message(id="a1", role="assistant", parts=response.parts),
    )
    body = model.build_body(_request_gemini_media(*history), stream=False)
    sent = body["contents"][1]["parts"] if len(body["contents"]) > 1 else []
    assert [p["thoughtSignature"] for p in sent if "thoughtSignature" in p] == [
        p["thoughtSignature"] for p in parts if "thoughtSignature" in p
    ]
    assert [
        (p["functionCall"]["name"], p.get("thoughtSignature")) for p in sent if "functionCall" in p
    ] == [
        (p["functionCall"]["name"], p.get("thoughtSignature")) for p in parts if "functionCall" in p
    ]


@pytest.mark.anyio
@pytest.mark.parametrize("media_type", ["image/tiff", "image/bmp", "image/svg+xml"])
async def test_an_image_type_gemini_cannot_read_is_refused_before_any_request(
    media_type: str,
) -> None:
    image = ImagePart(media_type=media_type, data=b"II*\x00....")
    await _refused(Message.user("look", id="u1", media=[image]))


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
@pytest.mark.parametrize(
    "kind",
    [
        "html",
        "json",
    ],
)
async def test_a_huge_error_body_gives_a_bounded_error_message(stream: bool, kind: str) -> None:
    filler = "x" * 5_000_000
    if kind == "html":
        reply = httpx.Response(
            502, text=f"<html>{filler}</html>", headers={"content-type": "text/html"}
        )
    else:
        reply = httpx.Response(400, json=_error_gemini_media(400, "INVALID_ARGUMENT", filler))
    model, _ = _model_gemini_media(lambda r: reply, retry=RetryPolicy(max_attempts=1))
    with pytest.raises(ProviderError) as caught:
        await _ask(model, stream=stream)
    assert len(str(caught.value)) < 100_000


@pytest.mark.anyio
async def test_a_safety_block_after_some_text_is_the_same_streamed_or_not() -> None:
    chunks = [
        _reply_gemini_media([{"text": "Sure, here"}], finish=None),
        _reply_gemini_media([{"text": " is"}], finish=None),
        {"candidates": [{"index": 0, "finishReason": "SAFETY", "safetyRatings": []}]},
    ]
    streamed_model, _ = _model_gemini_media(_served(chunks, stream=True))
    blocking_model, _ = _model_gemini_media(lambda r: httpx.Response(200, json=chunks))
    streamed = await _ask(streamed_model, stream=True)
    blocking = await _ask(blocking_model, stream=False)
    assert streamed.parts == blocking.parts == (TextPart("Sure, here is"),)
    assert streamed.finish_reason == blocking.finish_reason == "content_filter"
