"""The Anthropic Messages adapter: mapping, parsing, streaming parity, errors, configuration.

Recorded traffic comes from ``../shared/conformance/cassettes/anthropic`` (read
with a small loader of this module's own); hand-written payloads cover what
the recordings do not (redacted thinking, error events, truncation).
"""

from __future__ import annotations

import contextlib
import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cassettes
import httpx
import msgspec
import pytest
import spec_anthropic as spec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import (
    Message,
    ModelRequest,
    ModelResponse,
    ModelSettings,
    PromptPart,
    ToolDefinition,
)
from stepmachine._messages import ReasoningPart, TextPart, ToolCallPart, ToolResultPart
from stepmachine._model import ReasoningChunk, TextChunk, ToolCallChunk
from stepmachine.extend import StreamChunk
from stepmachine.providers import (
    AnthropicModel,
    AuthenticationError,
    BadRequestError,
    ContextLengthExceededError,
    MalformedResponseError,
    NotFoundError,
    OverloadedError,
    ProviderError,
    RateLimitError,
    RetryPolicy,
    ServerError,
)

HERE = Path(__file__).resolve().parent
CASSETTES = HERE.parent.parent / "shared" / "conformance" / "cassettes" / "anthropic"
KEY = "sk-ant-secret-0123456789"


# -- the recordings, through the harness's loader (all four storage formats) ---------------


@dataclass
class Interaction:
    """One recorded exchange, in the shape these tests use."""

    url: str
    request: dict[str, Any]
    status: int
    headers: dict[str, str]  # lower-case names; Content-Length / Transfer-Encoding dropped
    body: bytes  # as stored (gzip bytes stay gzip)


def load(path: Path) -> list[Interaction]:
    return [
        Interaction(
            i.url, i.request_body, i.status, {k.lower(): v for k, v in i.headers}, i.response_body
        )
        for i in cassettes.load_cassette(path)
    ]


ALL_CASSETTES = sorted(CASSETTES.glob("*.y*ml"))
STREAMING = [p for p in ALL_CASSETTES if any(i.request.get("stream") for i in load(p))]
BLOCKING_OK = [
    p for p in ALL_CASSETTES if not any(i.request.get("stream") or i.status >= 400 for i in load(p))
]


# -- helpers ---------------------------------------------------------------------------------


def model_for(handler: Callable[[httpx.Request], httpx.Response], **kwargs: Any) -> AnthropicModel:
    kwargs.setdefault("api_key", KEY)
    kwargs.setdefault("retry", RetryPolicy(max_attempts=1))

    async def no_sleep(_: float) -> None:
        return None

    return AnthropicModel(
        "claude-test",
        client=httpx.AsyncClient(transport=httpx.MockTransport(handler)),
        sleep=no_sleep,
        **kwargs,
    )


def serve(
    status: int, body: bytes, headers: dict[str, str] | None = None, seen: list[Any] | None = None
) -> Callable[[httpx.Request], httpx.Response]:
    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        return httpx.Response(status, content=body, headers=headers or {})

    return handler


def sse(*events: dict[str, Any], pad: str = "") -> bytes:
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}{pad}\n\n" for e in events).encode()


SSE_HEADERS = {"content-type": "text/event-stream"}
JSON_HEADERS = {"content-type": "application/json"}


def stream_of(message: dict[str, Any], *, pings: bool = True) -> bytes:
    """A reply message re-told as the event stream the API would send (independent synthesis)."""
    events: list[dict[str, Any]] = [
        {
            "type": "message_start",
            "message": {
                **{k: v for k, v in message.items() if k not in ("content", "stop_reason")},
                "content": [],
                "stop_reason": None,
                "usage": {**message["usage"], "output_tokens": 1},
            },
        }
    ]
    for index, block in enumerate(message["content"]):
        if pings:
            events.append({"type": "ping"})
        kind = block["type"]
        start = dict(block)
        deltas: list[dict[str, Any]] = []
        if kind == "text":
            start["text"] = ""
            text = block["text"]
            deltas = [
                {"type": "text_delta", "text": text[i : i + 7]} for i in range(0, len(text), 7)
            ]
        elif kind == "thinking":
            start["thinking"], start["signature"] = "", ""
            text = block["thinking"]
            deltas = [
                {"type": "thinking_delta", "thinking": text[i : i + 9]}
                for i in range(0, len(text), 9)
            ]
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
        elif kind == "tool_use":
            start["input"] = {}
            raw = json.dumps(block["input"], indent=None)  # spaced, unlike the compact form
            deltas = [{"type": "input_json_delta", "partial_json": ""}] + [
                {"type": "input_json_delta", "partial_json": raw[i : i + 5]}
                for i in range(0, len(raw), 5)
            ]
        events.append({"type": "content_block_start", "index": index, "content_block": start})
        events += [{"type": "content_block_delta", "index": index, "delta": d} for d in deltas]
        events.append({"type": "content_block_stop", "index": index})
    events.append(
        {
            "type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
            "usage": {"output_tokens": message["usage"]["output_tokens"]},
        }
    )
    events.append({"type": "message_stop"})
    return sse(*events, pad="     ")


async def run(
    model: AnthropicModel, request: ModelRequest, *, stream: bool
) -> tuple[ModelResponse, list[StreamChunk]]:
    chunks: list[StreamChunk] = []

    async def on_chunk(chunk: StreamChunk) -> None:
        chunks.append(chunk)

    response = await model.request(request, on_chunk=on_chunk if stream else None)
    return response, chunks


def ask(text: str = "hi", **kwargs: Any) -> ModelRequest:
    return ModelRequest(messages=(Message.user(text, id="u1"),), **kwargs)


def check_expected(response: ModelResponse, expected: Any) -> None:
    assert "".join(p.text for p in response.parts if isinstance(p, TextPart)) == expected.text
    calls = [p for p in response.parts if isinstance(p, ToolCallPart)]
    assert [(c.call_id, c.name, c.arguments) for c in calls] == [
        (e.call_id, e.name, e.arguments) for e in expected.tool_calls
    ]
    if expected.reasoning is not None:
        assert any(isinstance(p, ReasoningPart) for p in response.parts) == expected.reasoning
    assert response.usage.input_tokens == expected.input_tokens
    assert response.usage.output_tokens == expected.output_tokens
    assert response.finish_reason == expected.finish_reason


# -- every recording, through the spec ---------------------------------------------------------


@pytest.mark.parametrize("path", ALL_CASSETTES, ids=lambda p: p.name[:60])
async def test_recording_replays(path: Path) -> None:
    for interaction in load(path):
        request, stream = spec.decode_request(interaction.request)
        seen: list[httpx.Request] = []
        transport = httpx.MockTransport(
            serve(interaction.status, interaction.body, interaction.headers, seen)
        )
        model = spec.make_model(
            httpx.AsyncClient(transport=transport), interaction.request["model"]
        )
        expected = spec.expect(
            interaction.status, interaction.body, httpx.Headers(interaction.headers), stream
        )
        if expected.error is not None:
            with pytest.raises(expected.error) as caught:
                await run(model, request, stream=stream)
            assert type(caught.value) is expected.error
            assert seen[0].headers["x-api-key"] not in str(caught.value)
        else:
            response, chunks = await run(model, request, stream=stream)
            check_expected(response, expected)
            if stream:
                assert chunks
        sent = json.loads(seen[0].content)
        assert spec.request_differences(sent, interaction.request) == []
        assert seen[0].url.path.endswith("/messages")
        assert seen[0].headers["x-api-key"]
        assert seen[0].headers["anthropic-version"] == "2023-06-01"


@pytest.mark.parametrize("path", STREAMING, ids=lambda p: p.name[:60])
async def test_streamed_recordings_equal_their_blocking_form(path: Path) -> None:
    for interaction in load(path):
        request, _ = spec.decode_request(interaction.request)
        streamed, chunks = await run(
            model_for(serve(200, interaction.body, SSE_HEADERS)), request, stream=True
        )
        message = spec._message_from_stream(interaction.body.decode())
        blocking, _ = await run(
            model_for(serve(200, json.dumps(message).encode(), JSON_HEADERS)),
            request,
            stream=False,
        )
        assert streamed == blocking
        text = "".join(c.text for c in chunks if isinstance(c, TextChunk))
        assert text == "".join(p.text for p in blocking.parts if isinstance(p, TextPart))


@pytest.mark.parametrize("path", BLOCKING_OK, ids=lambda p: p.name[:60])
async def test_blocking_recordings_equal_their_streamed_form(path: Path) -> None:
    for interaction in load(path):
        body = interaction.body
        if body[:2] == b"\x1f\x8b":
            body = gzip.decompress(body)
        request, _ = spec.decode_request(interaction.request)
        blocking, _ = await run(model_for(serve(200, body, JSON_HEADERS)), request, stream=False)
        streamed, _ = await run(
            model_for(serve(200, stream_of(json.loads(body)), SSE_HEADERS)), request, stream=True
        )
        assert streamed == blocking


async def test_gzip_reply_is_decoded() -> None:
    [interaction] = load(CASSETTES / "test_anthropic_tools_legacy.yaml")
    assert interaction.headers["content-encoding"] == "gzip"
    request, _ = spec.decode_request(interaction.request)
    response, _ = await run(
        model_for(serve(200, interaction.body, interaction.headers)), request, stream=False
    )
    assert [p.name for p in response.parts if isinstance(p, ToolCallPart)] == [
        "get_weather",
        "get_time",
    ]


# -- the request body ---------------------------------------------------------------------------


def test_body_maps_system_tools_and_settings() -> None:
    model = AnthropicModel("claude-x", api_key=KEY, max_tokens=999)
    request = ModelRequest(
        messages=(
            Message.system("be brief", id="s1"),
            Message.user("hello", id="u1"),
        ),
        tools=(ToolDefinition("add", "adds", {"type": "object"}),),
        prompt_parts=(PromptPart("a", "you help"), PromptPart("b", "politely")),
        settings=ModelSettings(temperature=0.5, extra={"top_k": 3, "max_tokens": 7}),
    )
    body = model.build_body(request, stream=True)
    assert body == {
        "model": "claude-x",
        "max_tokens": 7,  # extra wins over everything
        "system": "you help\n\npolitely\n\nbe brief",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        "tools": [{"name": "add", "description": "adds", "input_schema": {"type": "object"}}],
        "temperature": 0.5,
        "stream": True,
        "top_k": 3,
    }
    assert model.build_body(ask(), stream=False)["max_tokens"] == 999
    assert (
        model.build_body(ask(settings=ModelSettings(max_tokens=5)), stream=False)["max_tokens"] == 5
    )
    assert "system" not in model.build_body(ask(), stream=False)


def test_body_round_trips_thinking_tool_calls_and_results() -> None:
    model = AnthropicModel("m", api_key=KEY, thinking={"type": "enabled", "budget_tokens": 1024})
    call = ToolCallPart.parse("toolu_1", "get", '{"city": "Paris"}')
    bad = ToolCallPart.parse("toolu_2", "get", "{not json")
    messages = (
        Message.user("q", id="u1"),
        Message(
            id="a1",
            role="assistant",
            parts=(
                ReasoningPart("hmm", {"signature": "sig=="}),
                ReasoningPart("", {"redacted": "opaque"}),
                ReasoningPart("foreign", {"encrypted_content": "x"}),  # another provider's
                TextPart(""),
                TextPart("calling"),
                call,
                bad,
            ),
        ),
        Message.tool_result(ToolResultPart.for_call(call, "sunny"), id="t1"),
        Message.tool_result(ToolResultPart.for_call(bad, "bad args", is_error=True), id="t2"),
        Message.user("and?", id="u2"),
        Message.user("tell me", id="u3"),
    )
    body = model.build_body(ModelRequest(messages=messages), stream=False)
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "q"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "sig=="},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "toolu_1", "name": "get", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": "sunny",
                    "is_error": False,
                },
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": "bad args",
                    "is_error": True,
                },
                {"type": "text", "text": "and?"},
                {"type": "text", "text": "tell me"},
            ],
        },
    ]


def test_body_asks_for_native_structured_output() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    body = AnthropicModel("m", api_key=KEY).build_body(ask(output_schema=schema), stream=False)
    assert body["output_config"] == {"format": {"type": "json_schema", "schema": schema}}


def test_blank_text_is_dropped_and_blank_error_results_get_content() -> None:
    call = ToolCallPart.parse("toolu_1", "add", "")
    other = ToolCallPart.parse("toolu_2", "add", "{}")
    messages = (
        Message.user("hi", id="u1"),
        Message(
            id="a1",
            role="assistant",
            parts=(TextPart("\n\n"), call, TextPart(" \t"), other, TextPart(" ok ")),
        ),
        Message.tool_result(ToolResultPart.for_call(call, "", is_error=True), id="t1"),
        Message.tool_result(ToolResultPart.for_call(other, "", is_error=False), id="t2"),
        Message(id="a2", role="assistant", parts=(TextPart("\n"),)),  # a blank turn: dropped
        Message.user("  \n", id="u2"),
        Message(id="a3", role="assistant", parts=(TextPart("done"),)),
        Message.tool_result(ToolResultPart("toolu_3", " \n", is_error=True), id="t3"),
    )
    body = AnthropicModel("m", api_key=KEY).build_body(
        ModelRequest(messages=messages), stream=False
    )
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {}},
                {"type": "tool_use", "id": "toolu_2", "name": "add", "input": {}},
                {"type": "text", "text": " ok "},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": "error",
                    "is_error": True,
                },
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "", "is_error": False},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "done"}]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_3",
                    "content": "error",
                    "is_error": True,
                }
            ],
        },
    ]


def test_empty_turns_are_dropped_and_neighbours_merged() -> None:
    messages = (
        Message.user("a", id="u1"),
        Message(id="a1", role="assistant", parts=(ReasoningPart("no signature"),)),
        Message.user("b", id="u2"),
    )
    body = AnthropicModel("m", api_key=KEY).build_body(
        ModelRequest(messages=messages), stream=False
    )
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]


# -- the reply --------------------------------------------------------------------------------

REPLY: dict[str, Any] = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "claude-x-2025",
    "content": [
        {"type": "thinking", "thinking": "let me see", "signature": "c2ln"},
        {"type": "redacted_thinking", "data": "EncRypTeD"},
        {"type": "text", "text": "Sure."},
        {"type": "tool_use", "id": "toolu_9", "name": "f", "input": {"b": [1, 2.5], "a": "é"}},
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}},
    ],
    "stop_reason": "tool_use",
    "stop_sequence": None,
    "usage": {
        "input_tokens": 10,
        "output_tokens": 20,
        "cache_creation_input_tokens": 30,
        "cache_read_input_tokens": 40,
        "service_tier": "standard",
    },
}


def test_reply_blocks_become_parts_in_order() -> None:
    response = AnthropicModel("m", api_key=KEY).parse_response(REPLY)
    assert response.parts == (
        ReasoningPart("let me see", {"signature": "c2ln"}),
        ReasoningPart("", {"redacted": "EncRypTeD"}),
        TextPart("Sure."),
        ToolCallPart("toolu_9", "f", {"b": [1, 2.5], "a": "é"}, '{"b":[1,2.5],"a":"é"}'),
    )
    assert response.usage.input_tokens == 10
    assert response.usage.output_tokens == 20
    assert response.usage.cache_write_tokens == 30
    assert response.usage.cache_read_tokens == 40
    assert response.finish_reason == "tool_calls"
    assert response.model == "claude-x-2025"


@pytest.mark.parametrize(
    ("stop", "finish"),
    [
        ("end_turn", "stop"),
        ("stop_sequence", "stop"),
        ("tool_use", "tool_calls"),
        ("max_tokens", "length"),
        ("refusal", "content_filter"),
        ("pause_turn", "pause_turn"),
        (None, None),
    ],
)
def test_stop_reasons_are_normalised(stop: str | None, finish: str | None) -> None:
    reply = {**REPLY, "stop_reason": stop}
    assert AnthropicModel("m", api_key=KEY).parse_response(reply).finish_reason == finish


async def test_hand_written_reply_streams_to_the_same_response() -> None:
    reply = {**REPLY, "content": REPLY["content"][:4]}
    blocking, _ = await run(
        model_for(serve(200, json.dumps(reply).encode(), JSON_HEADERS)), ask(), stream=False
    )
    streamed, chunks = await run(
        model_for(serve(200, stream_of(reply), SSE_HEADERS)), ask(), stream=True
    )
    assert streamed == blocking
    assert "".join(c.text for c in chunks if isinstance(c, ReasoningChunk)) == "let me see"
    assert "".join(c.text for c in chunks if isinstance(c, TextChunk)) == "Sure."
    calls = [c for c in chunks if isinstance(c, ToolCallChunk)]
    assert (calls[0].index, calls[0].call_id, calls[0].name) == (0, "toolu_9", "f")
    assert json.loads("".join(c.arguments_delta for c in calls)) == {"b": [1, 2.5], "a": "é"}


# -- streams ----------------------------------------------------------------------------------

START = {
    "type": "message_start",
    "message": {
        "model": "claude-x",
        "content": [],
        "usage": {"input_tokens": 5, "output_tokens": 1},
    },
}
TOOL_START = {
    "type": "content_block_start",
    "index": 0,
    "content_block": {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}},
}
END = (
    {"type": "content_block_stop", "index": 0},
    {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 9}},
    {"type": "message_stop"},
)


def json_delta(piece: str) -> dict[str, Any]:
    return {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "input_json_delta", "partial_json": piece},
    }


async def test_stream_joins_argument_fragments_and_keeps_invalid_ones_raw() -> None:
    good = sse(START, {"type": "ping"}, TOOL_START, json_delta('{"x": '), json_delta("1}"), *END)
    response, _ = await run(model_for(serve(200, good, SSE_HEADERS)), ask(), stream=True)
    assert response.parts == (ToolCallPart("toolu_1", "f", {"x": 1}, '{"x":1}'),)
    assert response.usage.input_tokens == 5
    assert response.usage.output_tokens == 9

    bad = sse(START, TOOL_START, json_delta('{"x": '), *END)
    response, _ = await run(model_for(serve(200, bad, SSE_HEADERS)), ask(), stream=True)
    assert response.parts == (ToolCallPart("toolu_1", "f", None, '{"x": '),)

    empty = sse(START, TOOL_START, json_delta(""), *END)
    response, _ = await run(model_for(serve(200, empty, SSE_HEADERS)), ask(), stream=True)
    assert response.parts == (ToolCallPart("toolu_1", "f", {}, "{}"),)


async def test_stream_carries_redacted_thinking_whole() -> None:
    events = sse(
        START,
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "redacted_thinking", "data": "opaque"},
        },
        {"type": "ping"},
        *END,
    )
    response, _ = await run(model_for(serve(200, events, SSE_HEADERS)), ask(), stream=True)
    assert response.parts == (ReasoningPart("", {"redacted": "opaque"}),)


@pytest.mark.parametrize(
    ("kind", "error"),
    [
        ("overloaded_error", OverloadedError),
        ("rate_limit_error", RateLimitError),
        ("invalid_request_error", BadRequestError),
        ("api_error", ServerError),
    ],
)
async def test_error_event_in_stream_is_typed(kind: str, error: type[ProviderError]) -> None:
    events = sse(
        START,
        {"type": "error", "error": {"type": kind, "message": "Overloaded"}},
    )
    with pytest.raises(error) as caught:
        await run(model_for(serve(200, events, SSE_HEADERS)), ask(), stream=True)
    assert caught.value.kind == kind


async def test_error_event_before_any_output_is_retried() -> None:
    replies = [
        sse(START, {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}),
        sse(START, *END[1:]),
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=replies.pop(0), headers=SSE_HEADERS)

    response, _ = await run(
        model_for(handler, retry=RetryPolicy(max_attempts=3)), ask(), stream=True
    )
    assert response.attempts == 2


async def test_error_event_after_output_is_not_retried() -> None:
    calls: list[httpx.Request] = []
    text_start = {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    text = {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": "Hi"},
    }
    events = sse(
        START,
        text_start,
        text,
        {"type": "error", "error": {"type": "overloaded_error", "message": "x"}},
    )
    model = model_for(serve(200, events, SSE_HEADERS, calls), retry=RetryPolicy(max_attempts=3))
    with pytest.raises(OverloadedError) as caught:
        await run(model, ask(), stream=True)
    assert caught.value.attempts == 1
    assert len(calls) == 1


async def test_truncated_stream_is_malformed() -> None:
    events = sse(START, TOOL_START, json_delta('{"x": 1}'), *END[:2])
    with pytest.raises(MalformedResponseError):
        await run(model_for(serve(200, events, SSE_HEADERS)), ask(), stream=True)


async def test_delta_for_unknown_block_is_malformed() -> None:
    events = sse(START, json_delta("{}"), *END)
    with pytest.raises(MalformedResponseError):
        await run(model_for(serve(200, events, SSE_HEADERS)), ask(), stream=True)


FULL_STREAM = sse(
    START,
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hé"}},
    {"type": "content_block_stop", "index": 0},
    {**TOOL_START, "index": 1},
    {**json_delta('{"a": [1'), "index": 1},
    {**json_delta("]}"), "index": 1},
    {"type": "content_block_stop", "index": 1},
    *END[1:],
    pad="   ",
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, len(FULL_STREAM) - 1))
async def test_fuzz_truncated_stream_is_malformed_or_whole(cut: int) -> None:
    model = model_for(serve(200, FULL_STREAM[:cut], SSE_HEADERS))
    try:
        response, _ = await run(model, ask(), stream=True)
    except MalformedResponseError:
        return
    whole, _ = await run(model_for(serve(200, FULL_STREAM, SSE_HEADERS)), ask(), stream=True)
    assert response == whole


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, len(FULL_STREAM) - 1), st.binary(min_size=1, max_size=4))
async def test_fuzz_corrupted_stream_raises_only_provider_errors(at: int, junk: bytes) -> None:
    body = FULL_STREAM[:at] + junk + FULL_STREAM[at + len(junk) :]
    with contextlib.suppress(ProviderError):
        await run(model_for(serve(200, body, SSE_HEADERS)), ask(), stream=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 400), st.binary(min_size=0, max_size=4))
async def test_fuzz_corrupted_json_reply_is_malformed(at: int, junk: bytes) -> None:
    whole = json.dumps(REPLY).encode()
    body = whole[:at] + junk + whole[at + len(junk) :]
    with contextlib.suppress(MalformedResponseError):
        await run(model_for(serve(200, body, JSON_HEADERS)), ask(), stream=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
        ),
        max_leaves=8,
    )
)
def test_fuzz_any_json_value_parses_or_raises_value_errors(value: Any) -> None:
    model = AnthropicModel("m", api_key=KEY)
    for data in (value, {**REPLY, "content": [value]}, {**REPLY, "usage": value}):
        with contextlib.suppress(TypeError, ValueError, KeyError, ProviderError):
            model.parse_response(data)


# -- errors and configuration ---------------------------------------------------------------


def error_body(kind: str, message: str) -> bytes:
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


@pytest.mark.parametrize(
    ("status", "kind", "message", "error"),
    [
        (401, "authentication_error", "invalid x-api-key", AuthenticationError),
        (404, "not_found_error", "model: claude-nope", NotFoundError),
        (
            400,
            "invalid_request_error",
            "prompt is too long: 3 tokens > 2 maximum",
            ContextLengthExceededError,
        ),
        (400, "invalid_request_error", "messages: field required", BadRequestError),
        (429, "rate_limit_error", "slow down", RateLimitError),
        (529, "overloaded_error", "Overloaded", OverloadedError),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_http_errors_are_typed_and_never_show_the_key(
    status: int, kind: str, message: str, error: type[ProviderError], stream: bool
) -> None:
    handler = serve(status, error_body(kind, message), {**JSON_HEADERS, "request-id": "req_1"})
    model = model_for(handler)
    with pytest.raises(error) as caught:
        await run(model, ask(), stream=stream)
    assert type(caught.value) is error
    assert caught.value.kind == kind
    assert caught.value.request_id == "req_1"
    assert message in str(caught.value)
    assert KEY not in str(caught.value)
    assert KEY not in repr(caught.value)
    assert KEY not in repr(model)


async def test_overload_is_retried_with_retry_after() -> None:
    waits: list[float] = []
    replies = [
        httpx.Response(
            529, content=error_body("overloaded_error", "x"), headers={"retry-after": "2"}
        ),
        httpx.Response(200, content=json.dumps(REPLY).encode(), headers=JSON_HEADERS),
    ]

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    model = AnthropicModel(
        "m",
        api_key=KEY,
        client=httpx.AsyncClient(transport=httpx.MockTransport(lambda _: replies.pop(0))),
        sleep=sleep,
    )
    response = await model.request(ask())
    assert response.attempts == 2
    assert waits == [2.0]


async def test_environment_supplies_key_and_base_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "https://proxy.example/anthropic/v1/")
    seen: list[httpx.Request] = []
    model = AnthropicModel(
        "m",
        client=httpx.AsyncClient(
            transport=httpx.MockTransport(
                serve(200, json.dumps(REPLY).encode(), JSON_HEADERS, seen)
            )
        ),
        headers={"anthropic-beta": "x"},
        anthropic_version="2099-01-01",
    )
    await model.request(ask())
    assert str(seen[0].url) == "https://proxy.example/anthropic/v1/messages"
    assert seen[0].headers["x-api-key"] == KEY
    assert seen[0].headers["anthropic-version"] == "2099-01-01"
    assert seen[0].headers["anthropic-beta"] == "x"
    assert "authorization" not in seen[0].headers
    assert KEY not in repr(model)
    assert KEY not in repr(model.api_key)
    assert model.name == "anthropic:m"


@pytest.mark.parametrize(
    ("value", "base_url"),
    [
        ("https://api.anthropic.com", "https://api.anthropic.com/v1"),  # the SDKs' form
        ("http://localhost:4000/", "http://localhost:4000/v1"),
        ("https://gw.example/acct/anthropic/v1", "https://gw.example/acct/anthropic/v1"),
        ("", "https://api.anthropic.com/v1"),
    ],
)
def test_environment_base_url_gets_the_version(
    monkeypatch: pytest.MonkeyPatch, value: str, base_url: str
) -> None:
    monkeypatch.setenv("ANTHROPIC_BASE_URL", value)
    assert AnthropicModel("m", api_key=KEY).base_url == base_url
    explicit = AnthropicModel("m", api_key=KEY, base_url="http://h/custom")
    assert explicit.base_url == "http://h/custom"  # an argument is taken as given


def test_defaults_without_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_BASE_URL", raising=False)
    model = AnthropicModel("m")
    assert model.base_url == "https://api.anthropic.com/v1"
    assert not model.api_key
    assert model.auth_headers() == {"anthropic-version": "2023-06-01"}
    assert msgspec.json.encode(model.build_body(ask(), stream=False))  # JSON-able


# -- streamed argument chunks add up to the call (issue 8, item 8) ---------------------------


def _arguments_by_call(chunks: list[StreamChunk]) -> dict[int, str]:
    joined: dict[int, str] = {}
    for chunk in chunks:
        if isinstance(chunk, ToolCallChunk):
            joined[chunk.index] = joined.get(chunk.index, "") + chunk.arguments_delta
    return joined


@pytest.mark.parametrize("stop", [True, False], ids=["block_stop", "no_block_stop"])
async def test_zero_argument_call_streams_the_empty_object(stop: bool) -> None:
    """A call without arguments streams only ``partial_json: ""``: the chunks must still
    add up to the part's raw arguments ``"{}"`` (also when the block is never stopped)."""
    events = [START, TOOL_START, json_delta("")]
    if stop:
        events.append({"type": "content_block_stop", "index": 0})
    events += [
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {}},
        {"type": "message_stop"},
    ]
    response, chunks = await run(
        model_for(serve(200, sse(*events), SSE_HEADERS)), ask(), stream=True
    )
    assert response.parts == (ToolCallPart("toolu_1", "f", {}, "{}"),)
    assert _arguments_by_call(chunks) == {0: "{}"}


async def test_input_given_whole_in_the_start_block_is_emitted_once() -> None:
    start = {**TOOL_START, "content_block": {**TOOL_START["content_block"], "input": {"x": 1}}}
    events = sse(START, start, {"type": "content_block_stop", "index": 0}, *END[1:])
    response, chunks = await run(model_for(serve(200, events, SSE_HEADERS)), ask(), stream=True)
    assert response.parts == (ToolCallPart("toolu_1", "f", {"x": 1}, '{"x":1}'),)
    assert _arguments_by_call(chunks) == {0: '{"x":1}'}


async def test_streamed_fragments_are_not_repeated_when_the_block_stops() -> None:
    events = sse(START, TOOL_START, json_delta(""), json_delta('{"x": '), json_delta("1}"), *END)
    _, chunks = await run(model_for(serve(200, events, SSE_HEADERS)), ask(), stream=True)
    assert _arguments_by_call(chunks) == {0: '{"x": 1}'}  # as sent; the part re-encodes it


# -- thinking tokens (issue 8, item 11) -------------------------------------------------------


async def test_thinking_tokens_are_reasoning_tokens_blocking_and_streamed() -> None:
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-test",
        "content": [{"type": "text", "text": "Hi"}],
        "stop_reason": "end_turn",
        "usage": {
            "input_tokens": 5,
            "output_tokens": 40,
            "output_tokens_details": {"thinking_tokens": 32},
        },
    }
    blocking, _ = await run(
        model_for(serve(200, json.dumps(message).encode(), JSON_HEADERS)), ask(), stream=False
    )
    assert blocking.usage.reasoning_tokens == 32
    assert blocking.usage.output_tokens == 40
    events = [
        {
            "type": "message_start",
            "message": {**message, "content": [], "usage": {"input_tokens": 5}},
        },
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": message["usage"]},
        {"type": "message_stop"},
    ]
    streamed, _ = await run(model_for(serve(200, sse(*events), SSE_HEADERS)), ask(), stream=True)
    assert streamed == blocking
