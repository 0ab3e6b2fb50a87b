"""The Gemini adapter: request body, thought signatures, call ids, safety blocks, errors,
retries, secrets, Vertex AI and streaming parity (``httpx.MockTransport``; the real
recordings are replayed by ``test_conformance.py``)."""

from __future__ import annotations

import base64
import itertools
import json
import traceback
from collections.abc import Callable
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import (
    ConfigurationError,
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
from stepmachine.providers import (
    AuthenticationError,
    BadRequestError,
    ContextLengthExceededError,
    GeminiModel,
    MalformedResponseError,
    NotFoundError,
    OverloadedError,
    PermissionDeniedError,
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
def test_every_signature_goes_back_on_the_part_it_came_with(parts: list[dict[str, Any]]) -> None:
    model = GeminiModel("g", api_key="k")
    response = model.parse_response(_reply(parts))
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
