"""OpenAIResponsesModel: request mapping, replies, streams, errors, config, recorded traffic."""

from __future__ import annotations

import contextlib
import gzip
import json
from pathlib import Path
from typing import Any

import anyio
import cassettes
import httpx
import msgspec
import pytest
import spec_openai_responses as spec_module
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
from stepmachine.extend import ReasoningChunk, StreamChunk, TextChunk, ToolCallChunk
from stepmachine.providers import (
    AuthenticationError,
    BadRequestError,
    ContextLengthExceededError,
    MalformedResponseError,
    OpenAIResponsesModel,
    ProviderError,
    RateLimitError,
    RetryPolicy,
    ServerError,
)
from stepmachine.providers._http import SSEEvent

HARNESS = Path(__file__).parent / "harness"
CASSETTES = Path(__file__).resolve().parents[2] / "shared" / "conformance" / "cassettes"
FOLDER = CASSETTES / "openai_responses"
KEY = "sk-secret-key-0123456789"


SPEC = spec_module.SPECS["openai_responses"]
FILES = sorted(FOLDER.glob("*.yaml")) if FOLDER.is_dir() else []
needs_cassettes = pytest.mark.skipif(not FILES, reason="no recordings beside the repository")


async def _no_sleep(_: float) -> None:
    return None


def _model(handler: Any, **options: Any) -> OpenAIResponsesModel:
    options.setdefault("api_key", KEY)
    options.setdefault("base_url", "https://example.test/v1")
    return OpenAIResponsesModel(
        "gpt-test",
        client=httpx.AsyncClient(transport=httpx.MockTransport(handler)),
        sleep=_no_sleep,
        **options,
    )


def _offline() -> OpenAIResponsesModel:
    def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError("no request expected")

    return _model(handler)


def _sse(*events: dict[str, Any]) -> bytes:
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


def _json_reply(body: Any, status: int = 200, **headers: str) -> httpx.Response:
    return httpx.Response(status, json=body, headers=headers)


def _sse_reply(body: bytes) -> httpx.Response:
    return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})


class _Events:
    """The SSE events of ``body`` as the async iterator ``parse_stream`` takes."""

    def __init__(self, body: bytes) -> None:
        self.events = []
        for block in body.decode().split("\n\n"):
            lines = block.split("\n")
            name = next((ln[6:].strip() for ln in lines if ln.startswith("event:")), "message")
            data = "\n".join(ln[5:].strip() for ln in lines if ln.startswith("data:"))
            if data:
                self.events.append(SSEEvent(name, data))

    def __aiter__(self) -> _Events:
        return self

    async def __anext__(self) -> SSEEvent:
        if not self.events:
            raise StopAsyncIteration
        return self.events.pop(0)


_events = _Events


class Sink:
    def __init__(self) -> None:
        self.chunks: list[StreamChunk] = []

    async def __call__(self, chunk: StreamChunk) -> None:
        self.chunks.append(chunk)

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks if isinstance(c, TextChunk))


USAGE = {
    "input_tokens": 10,
    "input_tokens_details": {"cached_tokens": 4},
    "output_tokens": 7,
    "output_tokens_details": {"reasoning_tokens": 3},
    "total_tokens": 17,
}
REASONING_ITEM = {
    "id": "rs_1",
    "type": "reasoning",
    "summary": [
        {"type": "summary_text", "text": "Think A."},
        {"type": "summary_text", "text": "Think B."},
    ],
    "encrypted_content": "ENC",
}
CALL_ITEM = {
    "id": "fc_1",
    "type": "function_call",
    "status": "completed",
    "call_id": "call_1",
    "name": "lookup",
    "arguments": '{"key": "a"}',
}
MESSAGE_ITEM = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "status": "completed",
    "content": [{"type": "output_text", "text": "Hello there", "annotations": []}],
}


def _response(*output: dict[str, Any], status: str = "completed", **extra: Any) -> dict[str, Any]:
    return {
        "id": "resp_1",
        "object": "response",
        "status": status,
        "model": "gpt-test-2025",
        "output": list(output),
        "usage": USAGE,
        "error": None,
        "incomplete_details": None,
        **extra,
    }


def _stream_of(response: dict[str, Any]) -> bytes:
    """A realistic event stream for ``response`` (deltas split in two)."""
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": {**response, "output": [], "usage": None}},
    ]
    for index, item in enumerate(response["output"]):
        if item["type"] == "function_call":
            args = item["arguments"]
            events.append(
                {
                    "type": "response.output_item.added",
                    "output_index": index,
                    "item": {**item, "arguments": ""},
                }
            )
            events.extend(
                {
                    "type": "response.function_call_arguments.delta",
                    "output_index": index,
                    "item_id": item["id"],
                    "delta": piece,
                }
                for piece in (args[: len(args) // 2], args[len(args) // 2 :])
            )
        elif item["type"] == "message":
            events.append(
                {
                    "type": "response.output_item.added",
                    "output_index": index,
                    "item": {**item, "content": []},
                }
            )
            for c, block in enumerate(item["content"]):
                text = block["text"]
                events.extend(
                    {
                        "type": "response.output_text.delta",
                        "output_index": index,
                        "content_index": c,
                        "item_id": item["id"],
                        "delta": piece,
                    }
                    for piece in (text[:3], text[3:])
                )
        elif item["type"] == "reasoning":
            events.append(
                {
                    "type": "response.output_item.added",
                    "output_index": index,
                    "item": {**item, "summary": []},
                }
            )
            for s, part in enumerate(item["summary"]):
                events.append(
                    {
                        "type": "response.reasoning_summary_text.delta",
                        "output_index": index,
                        "summary_index": s,
                        "item_id": item["id"],
                        "delta": part["text"],
                    }
                )
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events.append({"type": "response.completed", "response": response})
    return _sse(*events)


TOOL = ToolDefinition("lookup", "Look a key up.", {"type": "object", "properties": {}})


def _conversation() -> tuple[Message, ...]:
    call = ToolCallPart.parse("call_1", "lookup", '{"key": "a"}')
    reasoning = ReasoningPart(
        "Think.",
        provider_data={"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "E"},
    )
    return (
        Message.system("Be brief.", id="s"),
        Message.user("Look a up", id="u"),
        Message(id="a", role="assistant", parts=(reasoning, TextPart("Sure."), call)),
        Message.tool_result(ToolResultPart.for_call(call, "found"), id="t"),
    )


# -- build_body ------------------------------------------------------------------------------


def test_body_maps_messages_tools_and_settings() -> None:
    request = ModelRequest(
        messages=_conversation(),
        tools=(TOOL,),
        prompt_parts=(PromptPart("a", "You help."),),
        settings=ModelSettings(max_tokens=100, temperature=0.2, extra={"tool_choice": "auto"}),
    )
    body = _offline().build_body(request, stream=True)
    assert body == {
        "model": "gpt-test",
        "instructions": "You help.\n\nBe brief.",
        "input": [
            {"role": "user", "content": "Look a up"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "E"},
            {"role": "assistant", "content": "Sure."},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "lookup",
                "arguments": '{"key": "a"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "found"},
        ],
        "tools": [
            {
                "type": "function",
                "name": "lookup",
                "description": "Look a key up.",
                "parameters": {"type": "object", "properties": {}},
            }
        ],
        "max_output_tokens": 100,
        "temperature": 0.2,
        "stream": True,
        "store": False,
        "tool_choice": "auto",
    }


@pytest.mark.parametrize("raw", ["", "  \n"])
def test_empty_tool_call_arguments_are_sent_as_an_empty_object(raw: str) -> None:
    call = ToolCallPart.parse("call_1", "lookup", raw)
    messages = (
        Message.user("q", id="u"),
        Message(id="a", role="assistant", parts=(call,)),
        Message.tool_result(ToolResultPart.for_call(call, "", is_error=True), id="t"),
    )
    items = _offline().build_body(ModelRequest(messages=messages), stream=False)["input"]
    assert items[1:] == [
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"},
        # is_error has no wire field: the content goes unchanged
        {"type": "function_call_output", "call_id": "call_1", "output": ""},
    ]


def test_reasoning_round_trip_rules() -> None:
    ours = ReasoningPart("", provider_data={"type": "reasoning", "id": "rs_2", "summary": []})
    foreign = ReasoningPart("t", provider_data={"signature": "sig"})
    message = Message(id="a", role="assistant", parts=(ours, foreign, TextPart("x")))
    request = ModelRequest(messages=(Message.user("q", id="u"), message))
    # store=False: an item without encrypted content cannot be resolved; foreign data never goes.
    assert [i.get("type") for i in _offline().build_body(request, stream=False)["input"]] == [
        None,
        None,
    ]
    stored = _model(lambda r: httpx.Response(500), store=True)
    items = stored.build_body(request, stream=False)["input"]
    assert items[1] == {"type": "reasoning", "id": "rs_2", "summary": []}
    assert len(items) == 3


def test_reasoning_store_and_include_options() -> None:
    request = ModelRequest(messages=(Message.user("q", id="u"),))
    body = _model(lambda r: httpx.Response(500), reasoning={"effort": "low"}).build_body(
        request, stream=False
    )
    assert body["reasoning"] == {"effort": "low"}
    assert body["store"] is False
    assert body["include"] == ["reasoning.encrypted_content"]
    plain = _offline().build_body(request, stream=False)
    assert "include" not in plain
    assert "reasoning" not in plain
    server_default = _model(lambda r: httpx.Response(500), store=None, strict_tools=True)
    body = server_default.build_body(msgspec.structs.replace(request, tools=(TOOL,)), stream=False)
    assert "store" not in body
    assert body["tools"][0]["strict"] is True


def test_output_schema_strict_only_when_the_schema_allows_it() -> None:
    closed = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    opened = {"type": "object", "properties": {"city": {"type": "string"}}}
    model = _offline()
    for schema, strict in ((closed, True), (opened, False)):
        request = ModelRequest(
            messages=(Message.user("q", id="u"),), output_schema=schema, output_name="City"
        )
        fmt = model.build_body(request, stream=False)["text"]["format"]
        assert fmt == {"type": "json_schema", "name": "City", "schema": schema, "strict": strict}


# -- parse_response ---------------------------------------------------------------------------


def test_parse_response_keeps_item_order_and_round_trip_data() -> None:
    response = _offline().parse_response(_response(REASONING_ITEM, MESSAGE_ITEM, CALL_ITEM))
    reasoning, text, call = response.parts
    assert isinstance(reasoning, ReasoningPart)
    assert reasoning.text == "Think A.\n\nThink B."
    assert reasoning.provider_data == {
        "type": "reasoning",
        "id": "rs_1",
        "summary": REASONING_ITEM["summary"],
        "encrypted_content": "ENC",
    }
    assert text == TextPart("Hello there")
    assert call == ToolCallPart.parse("call_1", "lookup", '{"key": "a"}')
    assert response.finish_reason == "tool_calls"
    assert response.model == "gpt-test-2025"
    assert response.usage.input_tokens == 10
    assert response.usage.output_tokens == 7
    assert response.usage.cache_read_tokens == 4
    assert response.usage.reasoning_tokens == 3


def test_parse_response_edge_cases() -> None:
    model = _offline()
    bad_args = {**CALL_ITEM, "arguments": '{"key": '}
    call = model.parse_response(_response(bad_args)).parts[0]
    assert isinstance(call, ToolCallPart)
    assert call.arguments is None
    assert call.raw_arguments == '{"key": '
    refusal = {**MESSAGE_ITEM, "content": [{"type": "refusal", "refusal": "No."}]}
    assert model.parse_response(_response(refusal)).parts == (TextPart("No."),)
    cut = _response(
        MESSAGE_ITEM, status="incomplete", incomplete_details={"reason": "max_output_tokens"}
    )
    assert model.parse_response(cut).finish_reason == "length"
    filtered = _response(status="incomplete", incomplete_details={"reason": "content_filter"})
    assert model.parse_response(filtered).finish_reason == "content_filter"
    assert model.parse_response(_response(MESSAGE_ITEM)).finish_reason == "stop"


async def test_failed_response_body_is_a_typed_error() -> None:
    failed = _response(
        status="failed", error={"code": "rate_limit_exceeded", "message": "slow down"}
    )
    model = _model(lambda r: _json_reply(failed), retry=RetryPolicy(max_attempts=1))
    with pytest.raises(RateLimitError, match="slow down"):
        await model.request(ModelRequest(messages=(Message.user("q", id="u"),)))


# -- parse_stream -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "output",
    [
        (MESSAGE_ITEM,),
        (CALL_ITEM,),
        (REASONING_ITEM, MESSAGE_ITEM, CALL_ITEM, {**CALL_ITEM, "call_id": "call_2", "id": "f2"}),
    ],
)
async def test_stream_equals_blocking_and_emits_deltas(output: tuple[dict[str, Any], ...]) -> None:
    body = _response(*output)
    model = _offline()
    sink = Sink()
    streamed = await model.parse_stream(_events(_stream_of(body)), sink)
    assert streamed == model.parse_response(body)
    assert sink.text == "".join(p.text for p in streamed.parts if isinstance(p, TextPart))
    reasoning = "".join(c.text for c in sink.chunks if isinstance(c, ReasoningChunk))
    assert reasoning == "".join(p.text for p in streamed.parts if isinstance(p, ReasoningPart))
    calls: dict[int, list[str]] = {}
    for chunk in sink.chunks:
        if isinstance(chunk, ToolCallChunk):
            entry = calls.setdefault(chunk.index, [chunk.call_id or "", ""])
            entry[1] += chunk.arguments_delta
    assert [tuple(v) for _, v in sorted(calls.items())] == [
        (p.call_id, p.raw_arguments) for p in streamed.parts if isinstance(p, ToolCallPart)
    ]


async def test_stream_without_final_output_is_assembled_from_items() -> None:
    body = _response(MESSAGE_ITEM, CALL_ITEM)
    events = _stream_of(body).decode().split("\n\n")
    completed = json.loads(events[-2].split("data: ", 1)[1])
    completed["response"]["output"] = []
    events[-2] = f"event: response.completed\ndata: {json.dumps(completed)}"
    stream = "\n\n".join(events).encode()
    assert await _offline().parse_stream(_events(stream), Sink()) == _offline().parse_response(body)


async def test_arguments_sent_only_in_done_are_still_emitted() -> None:
    body = _response(CALL_ITEM)
    stream = _sse(
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": {**CALL_ITEM, "arguments": ""},
        },
        {"type": "response.output_item.done", "output_index": 0, "item": CALL_ITEM},
        {"type": "response.completed", "response": body},
    )
    sink = Sink()
    await _offline().parse_stream(_events(stream), sink)
    assert (
        "".join(c.arguments_delta for c in sink.chunks if isinstance(c, ToolCallChunk))
        == (CALL_ITEM["arguments"])
    )


async def test_stream_ignores_unknown_events_and_done_marker() -> None:
    body = _response(MESSAGE_ITEM)
    stream = b'event: ping\ndata: {"type": "ping"}\n\n' + _stream_of(body) + b"data: [DONE]\n\n"
    assert await _offline().parse_stream(_events(stream), Sink()) == _offline().parse_response(body)


@pytest.mark.parametrize(
    ("event", "error"),
    [
        (
            {
                "type": "response.failed",
                "response": _response(
                    status="failed", error={"code": "server_error", "message": "boom"}
                ),
            },
            ServerError,
        ),
        ({"type": "error", "code": "rate_limit_exceeded", "message": "slow"}, RateLimitError),
        (
            {"type": "error", "error": {"code": "context_length_exceeded", "message": "too long"}},
            ContextLengthExceededError,
        ),
    ],
)
async def test_stream_error_events_are_typed(event: dict[str, Any], error: type) -> None:
    stream = _sse({"type": "response.created", "response": _response()}, event)
    with pytest.raises(error):
        await _offline().parse_stream(_events(stream), Sink())


async def test_truncated_stream_is_malformed() -> None:
    events = _stream_of(_response(MESSAGE_ITEM)).split(b"\n\n")
    model = _model(lambda r: _sse_reply(b"\n\n".join(events[:-2]) + b"\n\n"))
    with pytest.raises(MalformedResponseError, match="ended before"):
        await model.request(ModelRequest(messages=(Message.user("q", id="u"),)), on_chunk=Sink())


# -- HTTP, errors, retries, configuration ------------------------------------------------------


async def test_request_goes_to_base_url_with_bearer_key() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return _json_reply(_response(MESSAGE_ITEM))

    model = _model(handler)
    response = await model.request(ModelRequest(messages=(Message.user("q", id="u"),)))
    assert response.parts == (TextPart("Hello there"),)
    assert response.attempts == 1
    assert str(seen[0].url) == "https://example.test/v1/responses"
    assert seen[0].headers["authorization"] == f"Bearer {KEY}"
    assert json.loads(seen[0].content)["stream"] is False


async def test_json_error_to_a_stream_request_is_typed_and_hides_the_key() -> None:
    error = {
        "error": {
            "message": "Incorrect API key",
            "type": "invalid_request_error",
            "code": "invalid_api_key",
        }
    }
    model = _model(lambda r: _json_reply(error, 401))
    with pytest.raises(AuthenticationError) as caught:
        await model.request(ModelRequest(messages=(Message.user("q", id="u"),)), on_chunk=Sink())
    assert KEY not in str(caught.value)
    assert KEY not in repr(caught.value)
    assert KEY not in repr(model)


async def test_env_vars_configure_key_and_base_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("OPENAI_BASE_URL", "https://proxy.test/api/")
    model = OpenAIResponsesModel("gpt-x")
    assert model.base_url == "https://proxy.test/api"
    assert model.auth_headers() == {"authorization": f"Bearer {KEY}"}
    assert KEY not in repr(model)
    assert model.name == "openai:gpt-x"
    await model.aclose()
    monkeypatch.delenv("OPENAI_BASE_URL")
    explicit = OpenAIResponsesModel("gpt-x", api_key="other")
    assert explicit.base_url == "https://api.openai.com/v1"
    assert explicit.auth_headers() == {"authorization": "Bearer other"}
    await explicit.aclose()


async def test_rate_limit_is_retried_then_succeeds() -> None:
    replies = [
        _json_reply(
            {"error": {"message": "slow", "code": "rate_limit_exceeded"}},
            429,
            **{"retry-after": "2"},
        ),
        _json_reply({"error": {"message": "busy"}}, 503),
        _json_reply(_response(MESSAGE_ITEM)),
    ]
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    model = OpenAIResponsesModel(
        "gpt-test",
        api_key=KEY,
        client=httpx.AsyncClient(transport=httpx.MockTransport(lambda r: replies.pop(0))),
        sleep=sleep,
    )
    response = await model.request(ModelRequest(messages=(Message.user("q", id="u"),)))
    assert response.attempts == 3
    assert waits[0] == 2.0


async def test_failure_after_streamed_output_is_not_retried() -> None:
    calls: list[int] = []
    stream = _sse(
        {
            "type": "response.output_text.delta",
            "output_index": 0,
            "content_index": 0,
            "delta": "Hel",
        },
        {
            "type": "response.failed",
            "response": _response(
                status="failed", error={"code": "server_error", "message": "boom"}
            ),
        },
    )

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return _sse_reply(stream)

    sink = Sink()
    with pytest.raises(ServerError) as caught:
        await _model(handler).request(
            ModelRequest(messages=(Message.user("q", id="u"),)), on_chunk=sink
        )
    assert len(calls) == 1
    assert caught.value.attempts == 1
    assert sink.text == "Hel"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cut=st.integers(min_value=0, max_value=10_000), flip=st.integers(0, 10_000))
def test_fuzzed_streams_and_bodies_fail_only_with_typed_errors(cut: int, flip: int) -> None:

    good = _stream_of(_response(REASONING_ITEM, MESSAGE_ITEM, CALL_ITEM))
    broken = bytearray(good[: cut % (len(good) + 1)])
    if broken and flip % 3 == 0:
        broken[flip % len(broken)] = ord("}")
    blocking = json.dumps(_response(MESSAGE_ITEM)).encode()[: cut % 400]

    async def run() -> None:
        for reply, on_chunk in (
            (_sse_reply(bytes(broken)), Sink()),
            (
                httpx.Response(200, content=blocking, headers={"content-type": "application/json"}),
                None,
            ),
        ):
            model = _model(lambda r, reply=reply: reply, retry=RetryPolicy(max_attempts=1))
            with contextlib.suppress(ProviderError):
                await model.request(
                    ModelRequest(messages=(Message.user("q", id="u"),)), on_chunk=on_chunk
                )

    anyio.run(run)


# -- recorded traffic ---------------------------------------------------------------------------


def _interactions() -> list[Any]:
    return [
        pytest.param(path, n, id=f"{path.stem}#{n}")
        for path in FILES
        for n in range(len(cassettes.load_cassette(path)))
    ]


def _plain_body(interaction: Any) -> bytes:
    body: bytes = interaction.response_body
    return gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body


@needs_cassettes
@pytest.mark.parametrize(("path", "n"), _interactions())
async def test_recorded_interaction(path: Path, n: int) -> None:
    interaction = cassettes.load_cassette(path)[n]
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path.endswith(SPEC.path_suffix)
        sent.append(json.loads(request.content))
        return httpx.Response(
            interaction.status, headers=list(interaction.headers), content=interaction.response_body
        )

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        model = SPEC.make_model(client, interaction.request_body["model"])
        request, stream = SPEC.decode_request(interaction.request_body)
        headers = httpx.Headers(list(interaction.headers))
        expected = SPEC.expect(interaction.status, _plain_body(interaction), headers, stream)
        sink = Sink()
        if expected.error is not None:
            with pytest.raises(expected.error):
                await model.request(request, on_chunk=sink if stream else None)
            return
        response = await model.request(request, on_chunk=sink if stream else None)
    assert SPEC.request_differences(sent[0], interaction.request_body) == []
    assert "".join(p.text for p in response.parts if isinstance(p, TextPart)) == expected.text
    calls = [p for p in response.parts if isinstance(p, ToolCallPart)]
    assert [(c.name, c.arguments, c.call_id) for c in calls] == [
        (e.name, e.arguments, e.call_id) for e in expected.tool_calls
    ]
    assert any(isinstance(p, ReasoningPart) for p in response.parts) == expected.reasoning
    assert response.usage.input_tokens == expected.input_tokens
    assert response.usage.output_tokens == expected.output_tokens
    assert response.finish_reason == expected.finish_reason
    if stream:
        assert sink.text == expected.text


def _completed(body: bytes) -> dict[str, Any]:
    for block in body.decode().split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data:") and '"response.completed"' in line:
                return dict(json.loads(line[5:])["response"])
    raise AssertionError("no response.completed")


@needs_cassettes
@pytest.mark.parametrize(
    ("path", "n"),
    [p for p in _interactions() if cassettes.load_cassette(p.values[0])[p.values[1]].is_sse],
)
async def test_recorded_stream_matches_its_blocking_form(path: Path, n: int) -> None:
    body = cassettes.load_cassette(path)[n].response_body
    model = _offline()
    streamed = await model.parse_stream(_events(body.replace(b"\r\n", b"\n")), Sink())
    assert streamed == model.parse_response(_completed(body))


@needs_cassettes
def test_reasoning_items_round_trip_as_recorded() -> None:
    """Replay the interleaved-reasoning conversation with the adapter's own parsed replies:
    each next request it builds equals the recorded one (reasoning items echoed in place)."""
    path = FOLDER / "test_responses_interleaved_reasoning_between_tool_calls.yaml"
    interactions = cassettes.load_cassette(path)
    first = interactions[0].request_body
    model = OpenAIResponsesModel("gpt-5.5", api_key=KEY, reasoning={"effort": "high"})
    tools = tuple(
        ToolDefinition(t["name"], t["description"], t["parameters"]) for t in first["tools"]
    )
    messages = [Message.user(first["input"][0]["content"], id="u")]
    for n, interaction in enumerate(interactions[:-1]):
        reply: ModelResponse = model.parse_response(json.loads(_plain_body(interaction)))
        messages.append(Message(id=f"a{n}", role="assistant", parts=reply.parts))
        recorded = interactions[n + 1].request_body
        for item in recorded["input"]:
            if item.get("type") == "function_call_output" and item["call_id"] in {
                p.call_id for p in reply.parts if isinstance(p, ToolCallPart)
            }:
                result = ToolResultPart(item["call_id"], item["output"])
                messages.append(Message.tool_result(result, id=f"t{item['call_id']}"))
        body = model.build_body(ModelRequest(messages=tuple(messages), tools=tools), stream=False)
        assert SPEC.request_differences(body, recorded) == []


def test_request_differences_notice_real_differences() -> None:
    recorded = {
        "model": "m",
        "input": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "name": "f", "description": None, "parameters": {}}],
    }
    same = {
        **recorded,
        "input": "hi",
        "instructions": "",
        "stream": False,
        "tools": [{**recorded["tools"][0], "description": "", "strict": True}],
    }
    assert SPEC.request_differences(same, recorded) == []
    for changed in (
        {**recorded, "model": "n"},
        {**recorded, "input": [{"role": "user", "content": "ho"}]},
        {**recorded, "stream": True},
        {**recorded, "tools": []},
        {**recorded, "store": False},
    ):
        assert SPEC.request_differences(changed, recorded) != []
    assert (
        SPEC.request_differences(
            {**recorded, "input": [{"role": "user", "content": "long"}]},
            {**recorded, "input": [{"role": "user", "content": "<MASSIVE_TEXT>"}]},
        )
        == []
    )


def test_bad_request_error_type_from_the_recording() -> None:
    assert (
        SPEC.expect(400, b'{"error": {"code": "x"}}', httpx.Headers(), True).error
        is BadRequestError
    )


# -- refusals (issue 8, item 7) ----------------------------------------------------------------

REFUSAL_ITEM: dict[str, Any] = {
    "id": "msg_r",
    "type": "message",
    "role": "assistant",
    "status": "completed",
    "content": [{"type": "refusal", "refusal": "I'm sorry, I can't help with that."}],
}


def _refusal_stream(response: dict[str, Any], *, final_output: bool = True) -> bytes:
    """A refusal as the API streams it: ``response.refusal.delta`` pieces."""
    refusal = REFUSAL_ITEM["content"][0]["refusal"]
    pieces = [refusal[:7], refusal[7:20], refusal[20:]]
    final = response if final_output else {**response, "output": []}
    return _sse(
        {"type": "response.created", "response": {**response, "output": [], "usage": None}},
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": {**REFUSAL_ITEM, "content": [], "status": "in_progress"},
        },
        {
            "type": "response.content_part.added",
            "output_index": 0,
            "content_index": 0,
            "item_id": "msg_r",
            "part": {"type": "refusal", "refusal": ""},
        },
        *(
            {
                "type": "response.refusal.delta",
                "output_index": 0,
                "content_index": 0,
                "item_id": "msg_r",
                "delta": piece,
            }
            for piece in pieces
        ),
        {
            "type": "response.refusal.done",
            "output_index": 0,
            "content_index": 0,
            "item_id": "msg_r",
            "refusal": refusal,
        },
        {"type": "response.output_item.done", "output_index": 0, "item": REFUSAL_ITEM},
        {"type": "response.completed", "response": final},
    )


def test_blocking_refusal_is_text_with_finish_reason_content_filter() -> None:
    response = _offline().parse_response(_response(REFUSAL_ITEM))
    assert response.parts == (TextPart("I'm sorry, I can't help with that."),)
    assert response.finish_reason == "content_filter"  # as the Chat adapter says for a refusal


@pytest.mark.parametrize("final_output", [True, False])
async def test_streamed_refusal_reaches_the_emitter_and_equals_blocking(
    final_output: bool,
) -> None:
    body = _response(REFUSAL_ITEM)
    sink = Sink()
    model = _offline()
    streamed = await model.parse_stream(
        _events(_refusal_stream(body, final_output=final_output)), sink
    )
    assert streamed == model.parse_response(body)
    assert streamed.finish_reason == "content_filter"
    assert sink.text == "I'm sorry, I can't help with that."
    assert len([c for c in sink.chunks if isinstance(c, TextChunk)]) == 3


async def test_text_sent_only_in_the_finished_item_is_still_emitted() -> None:
    body = _response(MESSAGE_ITEM, REFUSAL_ITEM)
    stream = _sse(
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": {**MESSAGE_ITEM, "content": []},
        },
        {
            "type": "response.output_text.delta",
            "output_index": 0,
            "content_index": 0,
            "item_id": "msg_1",
            "delta": "Hello",
        },
        {"type": "response.output_item.done", "output_index": 0, "item": MESSAGE_ITEM},
        {
            "type": "response.output_item.added",
            "output_index": 1,
            "item": {**REFUSAL_ITEM, "content": []},
        },
        {"type": "response.output_item.done", "output_index": 1, "item": REFUSAL_ITEM},
        {"type": "response.completed", "response": body},
    )
    sink = Sink()
    streamed = await _offline().parse_stream(_events(stream), sink)
    assert sink.text == "Hello there" + "I'm sorry, I can't help with that."
    assert sink.text == "".join(p.text for p in streamed.parts if isinstance(p, TextPart))


@pytest.mark.parametrize("stream", [False, True])
async def test_structured_output_does_not_parse_a_refusal(stream: bool) -> None:
    from stepmachine import ModelInference, Runtime, StateMachine
    from stepmachine.extend import YieldReason, counter_ids
    from stepmachine.operations import OUTPUT_INVALID, StructuredOutput
    from stepmachine.stores import MemoryStore

    class City(msgspec.Struct):
        name: str

    body = _response(REFUSAL_ITEM)

    def handler(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["stream"]:
            return _sse_reply(_refusal_stream(body))
        return _json_reply(body)

    store = MemoryStore()
    await store.create("s", conversation=[Message.user("a city?", id="u0")])
    runtime = Runtime(store=store, model=_model(handler), ids=counter_ids())
    step = StructuredOutput(City, "native", inference=ModelInference(stream=stream), max_retries=0)
    report = await StateMachine([step]).run_report(runtime, "s")
    assert report.reason.kind == OUTPUT_INVALID
    assert report.reason.kind != YieldReason.DONE
    error = report.reason.data["error"]
    assert "refused" in error
    assert "content_filter" in error
    assert "not valid JSON" not in error


async def test_a_reasoning_summary_sent_only_in_the_finished_item_is_still_emitted() -> None:
    body = _response(REASONING_ITEM, MESSAGE_ITEM)
    stream = _sse(
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": {**REASONING_ITEM, "summary": []},
        },
        {
            "type": "response.reasoning_summary_text.delta",
            "output_index": 0,
            "summary_index": 0,
            "delta": "Think",
        },
        {"type": "response.output_item.done", "output_index": 0, "item": REASONING_ITEM},
        {"type": "response.completed", "response": body},
    )
    sink = Sink()
    streamed = await _offline().parse_stream(_events(stream), sink)
    reasoning = "".join(c.text for c in sink.chunks if isinstance(c, ReasoningChunk))
    assert reasoning == "Think A.\n\nThink B."
    assert reasoning == "".join(p.text for p in streamed.parts if isinstance(p, ReasoningPart))
