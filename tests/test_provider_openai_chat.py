"""OpenAIChatModel and OpenAICompatibleModel: request mapping, blocking and streamed replies,
the quirks of compatible servers, errors, secrets and configuration.

The recordings in ``../shared/conformance/cassettes/openai_chat`` and ``openai_compatible``
are replayed in full by the conformance harness (``tests/harness/conformance.py``); here
they also feed streaming/blocking parity and fuzz tests.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import cassettes
import httpx
import pytest
import spec_openai_chat
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import (
    ConfigurationError,
    Message,
    ModelRequest,
    ModelResponse,
    ModelSettings,
    PromptPart,
    ReasoningPart,
    TextPart,
    ToolCallPart,
    ToolDefinition,
    ToolResultPart,
    Usage,
)
from stepmachine.extend import ReasoningChunk, StreamChunk, TextChunk, ToolCallChunk
from stepmachine.providers import (
    AuthenticationError,
    BadRequestError,
    ContextLengthExceededError,
    MalformedResponseError,
    NotFoundError,
    OpenAIChatModel,
    OpenAICompatibleModel,
    ProviderError,
    RateLimitError,
    RetryPolicy,
    ServerError,
)

HARNESS = Path(__file__).resolve().parent / "harness"
CASSETTES = Path(__file__).resolve().parents[2] / "shared/conformance/cassettes"
KEY = "sk-secret-key-that-must-never-leak"


def _cassette_paths(folder: str) -> list[Path]:
    return [p for p in cassettes.cassette_files(CASSETTES) if p.parent.name == folder]


Handler = Callable[[httpx.Request], httpx.Response]


async def _no_sleep(_: float) -> None:
    return None


def chat(handler: Handler, **kwargs: Any) -> OpenAIChatModel:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    kwargs.setdefault("api_key", KEY)
    return OpenAIChatModel(kwargs.pop("model", "gpt-4o"), client=client, sleep=_no_sleep, **kwargs)


def compatible(handler: Handler, **kwargs: Any) -> OpenAICompatibleModel:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    kwargs.setdefault("base_url", "http://localhost:11434/v1")
    return OpenAICompatibleModel(
        kwargs.pop("model", "qwen3"), client=client, sleep=_no_sleep, **kwargs
    )


def sse(*payloads: Any, done: bool = True) -> bytes:
    lines = [f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n" for p in payloads]
    if done:
        lines.append("data: [DONE]\n\n")
    return "".join(lines).encode()


def sse_reply(body: bytes) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)


def completion(message: dict[str, Any], finish: str | None = "stop", **top: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "gpt-4o-2024",
        "choices": [
            {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}
        ],
        **top,
    }


def chunk(
    delta: dict[str, Any] | None = None, finish: str | None = None, **top: Any
) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": choices,
        **top,
    }


class Capture:
    """A MockTransport handler answering with fixed replies and keeping the bodies sent."""

    def __init__(self, *replies: httpx.Response) -> None:
        self.replies = list(replies)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.replies[min(len(self.requests), len(self.replies)) - 1]

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests]


async def collect(
    model: OpenAIChatModel, request: ModelRequest
) -> tuple[ModelResponse, list[StreamChunk]]:
    chunks: list[StreamChunk] = []

    async def sink(c: StreamChunk) -> None:
        chunks.append(c)

    return await model.request(request, on_chunk=sink), chunks


HELLO = ModelRequest(messages=(Message.user("hi", id="u1"),))


# -- configuration and secrets ---------------------------------------------------------------


def test_openai_reads_key_and_base_url_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("OPENAI_BASE_URL", "https://proxy.example/v1/")
    model = OpenAIChatModel("gpt-4o")
    assert model.base_url == "https://proxy.example/v1"
    assert model.auth_headers() == {"authorization": f"Bearer {KEY}"}
    assert model.name == "openai:gpt-4o"


def test_openai_needs_a_key_for_the_default_base_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(ConfigurationError, match="OPENAI_API_KEY"):
        OpenAIChatModel("gpt-4o")
    # another server (a proxy, a local one) may need no key
    assert OpenAIChatModel("m", base_url="http://localhost:8000/v1").auth_headers() == {}


def test_compatible_requires_a_base_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_COMPATIBLE_BASE_URL", raising=False)
    with pytest.raises(ConfigurationError, match="OPENAI_COMPATIBLE_BASE_URL"):
        OpenAICompatibleModel("qwen3")


def test_compatible_reads_the_environment_and_the_key_is_optional(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OPENAI_COMPATIBLE_BASE_URL", "http://gpu:8000/v1")
    monkeypatch.delenv("OPENAI_COMPATIBLE_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "not-for-this-server")
    model = OpenAICompatibleModel("llama")
    assert model.base_url == "http://gpu:8000/v1"
    assert model.auth_headers() == {}
    assert model.name == "openai_compatible:llama"
    monkeypatch.setenv("OPENAI_COMPATIBLE_API_KEY", KEY)
    assert OpenAICompatibleModel("llama").auth_headers() == {"authorization": f"Bearer {KEY}"}


async def test_the_key_is_sent_but_never_shown() -> None:
    capture = Capture(
        httpx.Response(
            401, json={"error": {"message": "Incorrect API key", "code": "invalid_api_key"}}
        )
    )
    model = chat(capture)
    assert KEY not in repr(model)
    assert KEY not in repr(model.api_key)
    with pytest.raises(AuthenticationError) as caught:
        await model.request(HELLO)
    assert capture.requests[0].headers["authorization"] == f"Bearer {KEY}"
    assert KEY not in str(caught.value)
    assert KEY not in repr(caught.value)
    assert caught.value.kind == "invalid_api_key"


# -- building the request ----------------------------------------------------------------------

WEATHER = ToolDefinition(
    "get_weather",
    "Weather of a city.",
    {"type": "object", "properties": {"city": {"type": "string"}}},
)
CALL = ToolCallPart.parse("call_1", "get_weather", '{"city": "Paris"}')


def conversation() -> ModelRequest:
    return ModelRequest(
        messages=(
            Message.user("Weather in Paris?", id="u1"),
            Message(
                id="a1",
                role="assistant",
                parts=(ReasoningPart("think", {"field": "reasoning_content"}), CALL),
            ),
            Message.tool_result(ToolResultPart.for_call(CALL, "sunny"), id="t1"),
            Message.system("Be brief.", id="s1"),
        ),
        tools=(WEATHER,),
        prompt_parts=(PromptPart("a", "You help."), PromptPart("b", "Use tools.")),
        settings=ModelSettings(
            max_tokens=100, temperature=0.5, extra={"tool_choice": "auto", "seed": 7}
        ),
    )


def test_build_body_maps_the_whole_conversation() -> None:
    body = chat(Capture()).build_body(conversation(), stream=False)
    assert body == {
        "model": "gpt-4o",
        "messages": [
            {"role": "system", "content": "You help.\n\nUse tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "system", "content": "Be brief."},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Weather of a city.",
                    "parameters": WEATHER.parameters,
                },
            }
        ],
        "max_completion_tokens": 100,
        "temperature": 0.5,
        "stream": False,
        "tool_choice": "auto",
        "seed": 7,
    }


def test_compatible_body_echoes_reasoning_and_uses_max_tokens() -> None:
    body = compatible(Capture()).build_body(conversation(), stream=True)
    assistant = body["messages"][2]
    assert assistant["content"] == ""
    assert assistant["reasoning_content"] == "think"
    assert "reasoning" not in assistant
    assert body["max_tokens"] == 100
    assert "max_completion_tokens" not in body
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    quiet = compatible(Capture(), send_reasoning=False).build_body(conversation(), stream=False)
    assert "reasoning_content" not in quiet["messages"][2]


def test_details_of_the_message_mapping() -> None:
    request = ModelRequest(
        messages=(
            Message(id="u", role="user", parts=(TextPart("one"), TextPart("two"))),
            Message(
                id="a", role="assistant", parts=(TextPart("ok"), ToolCallPart.parse("c", "f", ""))
            ),
            Message(
                id="r",
                role="user",
                parts=(ToolResultPart("c", "done", is_error=True), TextPart("and?")),
            ),
        ),
        prompt_parts=(PromptPart("p", "sys"),),
    )
    body = chat(Capture(), system_role="developer", model="o3").build_body(request, stream=False)
    assert body["messages"] == [
        {"role": "developer", "content": "sys"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
        },
        {
            "role": "assistant",
            "content": "ok",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "done"},
        {"role": "user", "content": "and?"},
    ]
    # OpenAI itself gets no reasoning fields; a server without a model name gets no model
    assert (
        "reasoning" not in chat(Capture()).build_body(conversation(), stream=False)["messages"][2]
    )
    assert "model" not in compatible(Capture(), model="").build_body(HELLO, stream=False)


def test_structured_output_strict_follows_the_schema() -> None:
    closed = {
        "type": "object",
        "properties": {
            "a": {
                "type": "array",
                "items": {"type": "object", "properties": {}, "additionalProperties": False},
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    }
    open_ = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    model = chat(Capture())
    for schema, strict in ((closed, True), (open_, False)):
        request = ModelRequest(messages=HELLO.messages, output_schema=schema, output_name="Answer")
        assert model.build_body(request, stream=False)["response_format"] == {
            "type": "json_schema",
            "json_schema": {"name": "Answer", "schema": schema, "strict": strict},
        }
    forced = chat(Capture(), strict_output=True)
    request = ModelRequest(messages=HELLO.messages, output_schema=open_)
    assert (
        forced.build_body(request, stream=False)["response_format"]["json_schema"]["strict"] is True
    )


def test_derived_strict_matches_the_recordings() -> None:
    seen = 0
    for folder in ("openai_chat", "openai_compatible"):
        for path in _cassette_paths(folder):
            for interaction in cassettes.load_cassette(path):
                body = interaction.request_body or {}
                fmt = (body.get("response_format") or {}).get("json_schema")
                if not fmt or "strict" not in fmt:
                    continue
                request = ModelRequest(messages=HELLO.messages, output_schema=fmt["schema"])
                sent = chat(Capture()).build_body(request, stream=False)
                assert sent["response_format"]["json_schema"]["strict"] is fmt["strict"], path.name
                seen += 1
    assert seen >= 2


# -- blocking replies --------------------------------------------------------------------------


async def test_blocking_reply_with_tool_calls_and_usage() -> None:
    reply = completion(
        {
            "content": None,
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"x": 1}'},
                },
                {
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "g", "arguments": "not json"},
                },
            ],
        },
        finish="tool_calls",
        usage={
            "prompt_tokens": 10,
            "completion_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 4},
            "completion_tokens_details": {"reasoning_tokens": 2},
        },
        unknown_field={"ignored": True},
    )
    response = await chat(Capture(httpx.Response(200, json=reply))).request(HELLO)
    assert response.parts == (
        ToolCallPart.parse("call_a", "f", '{"x": 1}'),
        ToolCallPart.parse("call_b", "g", "not json"),
    )
    assert isinstance(response.parts[1], ToolCallPart)
    assert response.parts[1].arguments is None
    assert response.usage == Usage(
        input_tokens=10, output_tokens=5, cache_read_tokens=4, reasoning_tokens=2
    )
    assert response.finish_reason == "tool_calls"
    assert response.model == "gpt-4o-2024"
    assert response.attempts == 1


async def test_a_refusal_is_text_with_finish_reason_content_filter() -> None:
    reply = completion({"content": None, "refusal": "I can't help with that."})
    response = await chat(Capture(httpx.Response(200, json=reply))).request(HELLO)
    assert response.parts == (TextPart("I can't help with that."),)
    assert response.finish_reason == "content_filter"


async def test_compatible_quirks_in_a_blocking_reply() -> None:
    reply = completion(
        {
            "content": [{"type": "text", "text": "Hello"}],
            "reasoning": "hmm",
            "tool_calls": [
                {"index": 0, "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
                {"id": "dup", "function": {"name": "g", "arguments": "{}"}},
                {"id": "dup", "function": {"name": "h", "arguments": "{}"}},
            ],
        },
        finish="function_call",
        timings={"prompt_n": 7, "cache_n": 3, "predicted_n": 4},
    )
    response = await compatible(Capture(httpx.Response(200, json=reply))).request(HELLO)
    reasoning, text, first, second, third = response.parts
    assert reasoning == ReasoningPart("hmm", {"field": "reasoning"})
    assert text == TextPart("Hello")
    assert first == ToolCallPart.parse("call_chatcmpl-1_0", "f", '{"a":1}')
    assert (second.call_id, third.call_id) == ("dup", "dup_2")  # type: ignore[union-attr]
    assert response.finish_reason == "tool_calls"
    assert response.usage == Usage(input_tokens=10, output_tokens=4, cache_read_tokens=3)


async def test_vllm_empty_tool_calls_and_missing_response_id() -> None:
    reply = {
        "choices": [
            {
                "message": {"content": "joke", "tool_calls": []},
                "finish_reason": "stop",
                "stop_reason": None,
            }
        ]
    }
    response = await compatible(Capture(httpx.Response(200, json=reply))).request(HELLO)
    assert response.parts == (TextPart("joke"),)
    no_id = {
        "choices": [{"message": {"tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}}]
    }
    first = await compatible(Capture(httpx.Response(200, json=no_id))).request(HELLO)
    again = await compatible(Capture(httpx.Response(200, json=no_id))).request(HELLO)
    assert first.parts[0].call_id.startswith("call_")  # type: ignore[union-attr]
    assert first == again  # the generated id is stable


@pytest.mark.parametrize(
    "reply",
    [b"not json", b"[]", b'{"choices": []}', b'{"choices": [{"message": 3}]}', b'{"object": "x"}'],
)
async def test_malformed_blocking_replies(reply: bytes) -> None:
    model = chat(Capture(httpx.Response(200, content=reply)), retry=RetryPolicy(max_attempts=1))
    with pytest.raises(MalformedResponseError):
        await model.request(HELLO)


async def test_an_error_object_with_status_200_is_typed() -> None:
    body = {"error": {"code": 429, "message": "Provider returned error"}, "user_id": "u"}
    model = compatible(Capture(httpx.Response(200, json=body)), retry=RetryPolicy(max_attempts=2))
    with pytest.raises(RateLimitError) as caught:
        await model.request(HELLO)
    assert caught.value.attempts == 2


# -- errors ------------------------------------------------------------------------------------


async def test_http_errors_are_typed() -> None:
    cases: list[tuple[int, dict[str, Any], type[ProviderError], Any]] = [
        (
            404,
            {
                "error": {
                    "message": "no such model",
                    "type": "invalid_request_error",
                    "code": "model_not_found",
                }
            },
            NotFoundError,
            "model_not_found",
        ),
        (
            400,
            {
                "error": {
                    "message": "bad tool",
                    "type": "invalid_request_error",
                    "code": "tool_use_failed",
                    "failed_generation": "{}",
                }
            },
            BadRequestError,
            "tool_use_failed",
        ),
        (
            500,
            {
                "error": {
                    "code": 500,
                    "message": "Context size has been exceeded.",
                    "type": "server_error",
                }
            },
            ContextLengthExceededError,
            500,
        ),
        (
            400,
            {"error": {"message": "too long", "code": "context_length_exceeded"}},
            ContextLengthExceededError,
            "context_length_exceeded",
        ),
    ]
    for status, body, error, kind in cases:
        capture = Capture(httpx.Response(status, json=body))
        with pytest.raises(error) as caught:
            await compatible(capture).request(HELLO)
        assert type(caught.value) is error
        assert caught.value.kind == kind
        assert caught.value.status == status
        assert len(capture.requests) == 1  # not retried


async def test_rate_limits_and_overload_are_retried_with_retry_after() -> None:
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    capture = Capture(
        httpx.Response(
            429, headers={"retry-after": "2"}, json={"error": {"code": 429, "message": "slow down"}}
        ),
        httpx.Response(503, json={"error": {"message": "busy"}}),
        httpx.Response(200, json=completion({"content": "ok"})),
    )
    client = httpx.AsyncClient(transport=httpx.MockTransport(capture))
    model = OpenAIChatModel("gpt-4o", api_key=KEY, client=client, sleep=sleep)
    response = await model.request(HELLO)
    assert response.parts == (TextPart("ok"),)
    assert response.attempts == 3
    assert sleeps[0] == 2.0
    assert len(sleeps) == 2


async def test_an_error_inside_a_stream_is_typed_and_not_retried_after_output() -> None:
    body = sse(
        chunk({"role": "assistant", "content": "Hel"}),
        {"error": {"code": 502, "message": "upstream died"}},
        done=False,
    )
    capture = Capture(sse_reply(body))
    with pytest.raises(ServerError) as caught:
        await collect(compatible(capture), HELLO)
    assert caught.value.status == 502
    assert len(capture.requests) == 1


# -- streams -----------------------------------------------------------------------------------


async def test_stream_of_text_and_split_tool_calls() -> None:
    body = sse(
        chunk({"role": "assistant", "content": "", "refusal": None}, obfuscation="x"),
        chunk({"content": "Let me "}),
        chunk({"content": "check."}),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_a",
                        "type": "function",
                        "function": {"name": "f", "arguments": ""},
                    }
                ]
            }
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"x"'}}]}),
        chunk(
            {
                "tool_calls": [
                    {"index": 1, "id": "call_b", "function": {"name": "g", "arguments": "{}"}}
                ]
            }
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
        chunk({}, finish="tool_calls"),
        chunk(None, usage={"prompt_tokens": 3, "completion_tokens": 2}),
    )
    response, chunks = await collect(chat(Capture(sse_reply(body))), HELLO)
    assert response.parts == (
        TextPart("Let me check."),
        ToolCallPart.parse("call_a", "f", '{"x": 1}'),
        ToolCallPart.parse("call_b", "g", "{}"),
    )
    assert response.usage == Usage(input_tokens=3, output_tokens=2)
    assert response.finish_reason == "tool_calls"
    assert chunks == [
        TextChunk("Let me "),
        TextChunk("check."),
        ToolCallChunk(0, "call_a", "f", ""),
        ToolCallChunk(0, None, None, '{"x"'),
        ToolCallChunk(1, "call_b", "g", "{}"),
        ToolCallChunk(0, None, None, ": 1}"),
    ]


async def test_stream_quirks_of_compatible_servers() -> None:
    body = sse(
        # reasoning in a non-standard field, role repeated on every delta
        chunk({"role": "assistant", "content": "", "reasoning": "Let me"}),
        chunk({"role": "assistant", "content": "", "reasoning": " think."}),
        # OpenRouter style: id and name repeated on every delta
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"a"'},
                    }
                ]
            }
        ),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": ": 1}"},
                    }
                ]
            }
        ),
        # a server numbering every whole call 0, with new ids
        chunk(
            {"tool_calls": [{"index": 0, "id": "c2", "function": {"name": "g", "arguments": "{}"}}]}
        ),
        # no index, no id: continues the last call; then a new call with no id at all
        chunk({"tool_calls": [{"id": "c3", "function": {"name": "h", "arguments": "{"}}]}),
        chunk({"tool_calls": [{"function": {"arguments": "}"}}]}),
        chunk({"tool_calls": [{"index": 5, "function": {"name": "k", "arguments": "{}"}}]}),
        chunk({"role": "assistant", "content": ""}, finish="tool_calls"),
        done=False,  # no [DONE]: a finish reason was seen, fine for compatible servers
    )
    response, chunks = await collect(compatible(Capture(sse_reply(body))), HELLO)
    assert response.parts == (
        ReasoningPart("Let me think.", {"field": "reasoning"}),
        ToolCallPart.parse("c1", "f", '{"a": 1}'),
        ToolCallPart.parse("c2", "g", "{}"),
        ToolCallPart.parse("c3", "h", "{}"),
        ToolCallPart.parse("call_chatcmpl-1_5", "k", "{}"),
    )
    assert [c for c in chunks if isinstance(c, ReasoningChunk)] == [
        ReasoningChunk("Let me"),
        ReasoningChunk(" think."),
    ]
    assert sorted({c.index for c in chunks if isinstance(c, ToolCallChunk)}) == [0, 1, 2, 3]


@pytest.mark.parametrize("make", [chat, compatible])
async def test_a_truncated_stream_is_malformed(make: Callable[..., OpenAIChatModel]) -> None:
    body = sse(chunk({"role": "assistant", "content": "Hel"}), done=False)
    with pytest.raises(MalformedResponseError):
        await collect(make(Capture(sse_reply(body)), retry=RetryPolicy(max_attempts=1)), HELLO)


@pytest.mark.parametrize("make", [chat, compatible])
async def test_a_stream_of_only_done_is_malformed(make: Callable[..., OpenAIChatModel]) -> None:
    model = make(Capture(sse_reply(b"data: [DONE]\n\n")), retry=RetryPolicy(max_attempts=1))
    with pytest.raises(MalformedResponseError, match="no completion chunk"):
        await collect(model, HELLO)


async def test_openai_streams_must_end_with_done() -> None:
    body = sse(chunk({"content": "Hi"}, finish="stop"), done=False)
    with pytest.raises(MalformedResponseError):
        await collect(chat(Capture(sse_reply(body)), retry=RetryPolicy(max_attempts=1)), HELLO)


async def test_a_stream_with_invalid_json_is_malformed_and_retried_before_output() -> None:
    capture = Capture(
        sse_reply(b"data: {not json\n\n"),
        sse_reply(sse(chunk({"content": "ok"}, finish="stop"))),
    )
    response, _ = await collect(chat(capture), HELLO)
    assert response.parts == (TextPart("ok"),)
    assert response.attempts == 2


# -- parity (invariant 9) ----------------------------------------------------------------------


def _as_stream(reply: dict[str, Any]) -> bytes:
    """A blocking reply cut into the chunks a server would stream for it."""
    message = reply["choices"][0]["message"]
    pieces: list[dict[str, Any]] = [chunk({"role": "assistant", "content": ""})]
    for field in ("reasoning", "reasoning_content", "content", "refusal"):
        text = message.get(field) or ""
        pieces.extend(chunk({field: text[i : i + 3]}) for i in range(0, len(text), 3))
    for index, call in enumerate(message.get("tool_calls") or []):
        arguments = call["function"]["arguments"]
        first = {"index": index, "function": {"name": call["function"]["name"], "arguments": ""}}
        if "id" in call:
            first["id"] = call["id"]
        pieces.append(chunk({"tool_calls": [first]}))
        pieces.extend(
            chunk(
                {"tool_calls": [{"index": index, "function": {"arguments": arguments[i : i + 2]}}]}
            )
            for i in range(0, len(arguments), 2)
        )
    pieces.append(chunk({}, finish=reply["choices"][0]["finish_reason"]))
    pieces.append(chunk(None, usage=reply.get("usage")))
    return sse(*[{**p, "id": reply.get("id"), "model": reply.get("model")} for p in pieces])


PARITY_REPLIES = [
    completion(
        {"content": "Hello there, friend."}, usage={"prompt_tokens": 4, "completion_tokens": 5}
    ),
    completion({"content": None, "refusal": "No."}),
    completion(
        {
            "content": "Calling.",
            "reasoning_content": "I should call f.",
            "tool_calls": [
                {"id": "a", "function": {"name": "f", "arguments": '{"q": "x"}'}},
                {"function": {"name": "g", "arguments": "{}"}},
            ],
        },
        finish="tool_calls",
        usage={
            "prompt_tokens": 4,
            "completion_tokens": 9,
            "completion_tokens_details": {"reasoning_tokens": 3},
        },
    ),
]


@pytest.mark.parametrize("reply", PARITY_REPLIES)
async def test_streaming_and_blocking_give_the_same_response(reply: dict[str, Any]) -> None:
    blocking = await compatible(Capture(httpx.Response(200, json=reply))).request(HELLO)
    streamed, chunks = await collect(compatible(Capture(sse_reply(_as_stream(reply)))), HELLO)
    assert streamed == blocking
    assert "".join(c.text for c in chunks if isinstance(c, TextChunk)) == "".join(
        p.text for p in blocking.parts if isinstance(p, TextPart)
    )


def _recorded_streams() -> list[tuple[str, Any]]:
    found = []
    for folder in ("openai_chat", "openai_compatible"):
        for path in _cassette_paths(folder):
            for n, interaction in enumerate(cassettes.load_cassette(path)):
                if interaction.is_sse:
                    found.append((f"{folder}/{path.name}#{n}", interaction))
    return found


RECORDED_STREAMS = _recorded_streams()


@pytest.mark.parametrize(
    ("name", "interaction"), RECORDED_STREAMS, ids=[n for n, _ in RECORDED_STREAMS]
)
async def test_recorded_streams_match_their_blocking_equivalent(
    name: str, interaction: Any
) -> None:
    """Each recorded stream, and the blocking reply holding the same content, give one response."""
    spec = spec_openai_chat
    text = interaction.response_body.decode()
    first = json.loads(text.split("data:", 1)[1].split("\n", 1)[0])
    assembled = spec._read_stream(text)
    message = assembled["choices"][0]["message"]
    for call in message["tool_calls"]:
        if call["id"] is None:
            del call["id"]
    blocking_reply = {**assembled, "id": first.get("id"), "model": first.get("model")}
    make = compatible if name.startswith("openai_compatible") else chat
    streamed, chunks = await collect(make(Capture(sse_reply(interaction.response_body))), HELLO)
    blocking = await make(Capture(httpx.Response(200, json=blocking_reply))).request(HELLO)
    if not message["reasoning"]:
        assert not any(isinstance(p, ReasoningPart) for p in streamed.parts)

    # the recorded reasoning field is whichever the server used; the reader above renames it
    def strip(response: ModelResponse) -> tuple[Any, ...]:
        return tuple(
            ReasoningPart(p.text) if isinstance(p, ReasoningPart) else p for p in response.parts
        )

    assert strip(streamed) == strip(blocking)
    assert streamed.usage == blocking.usage
    assert streamed.finish_reason == blocking.finish_reason
    assert any(chunks)


# -- fuzzing the decoders ----------------------------------------------------------------------

_SAMPLE_STREAM = _as_stream(PARITY_REPLIES[2])
_SAMPLE_JSON = json.dumps(PARITY_REPLIES[2]).encode()


def _outcome(body: bytes, *, stream: bool) -> BaseException | ModelResponse:
    async def run() -> BaseException | ModelResponse:
        reply = sse_reply(body) if stream else httpx.Response(200, content=body)
        model = compatible(Capture(reply), retry=RetryPolicy(max_attempts=1))
        try:
            if stream:
                return (await collect(model, HELLO))[0]
            return await model.request(HELLO)
        except ProviderError as exc:
            return exc

    return anyio.run(run)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(min_value=0, max_value=len(_SAMPLE_STREAM)), st.data())
def test_fuzzed_streams_give_a_response_or_a_typed_error(cut: int, data: st.DataObject) -> None:
    body = bytearray(_SAMPLE_STREAM[:cut])
    corrupt = bool(body) and data.draw(st.booleans())
    if corrupt:
        at = data.draw(st.integers(min_value=0, max_value=len(body) - 1))
        body[at] = data.draw(st.integers(min_value=0, max_value=255))
    outcome = _outcome(bytes(body), stream=True)
    assert isinstance(outcome, ModelResponse | ProviderError)
    if not corrupt and cut < _SAMPLE_STREAM.index(b'"finish_reason": "tool_calls"'):
        assert isinstance(outcome, MalformedResponseError)  # cut before the end: never a response


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=len(_SAMPLE_JSON) - 1), st.binary(max_size=3))
def test_fuzzed_json_gives_a_response_or_a_typed_error(cut: int, noise: bytes) -> None:
    outcome = _outcome(_SAMPLE_JSON[:cut] + noise, stream=False)
    assert isinstance(outcome, MalformedResponseError | ModelResponse)


# -- OpenRouter reasoning_details round trip (issue 8, item 11) --------------------------------

OR_DETAILS = [
    {
        "type": "reasoning.text",
        "text": "Let me think about the weather.",
        "signature": "sig-EqQBCkgIAR",
        "format": "anthropic-claude-v1",
        "index": 0,
        "id": None,
    },
    {
        "type": "reasoning.encrypted",
        "data": "ENCRYPTED==",
        "format": "anthropic-claude-v1",
        "index": 1,
    },
]
OR_CALL = {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}


def _details_stream() -> bytes:
    """The reply of ``OR_DETAILS`` streamed as OpenRouter does: text, then the signature."""
    text = OR_DETAILS[0]["text"]
    assert isinstance(text, str)
    first = {k: v for k, v in OR_DETAILS[0].items() if k != "signature"}
    pieces = [
        {"reasoning": text[:9], "reasoning_details": [{**first, "text": text[:9]}]},
        {"reasoning": text[9:], "reasoning_details": [{**first, "text": text[9:]}]},
        {"reasoning_details": [{**first, "text": "", "signature": OR_DETAILS[0]["signature"]}]},
        {"reasoning_details": [OR_DETAILS[1]]},
        {"tool_calls": [{**OR_CALL, "index": 0}]},
    ]
    return sse(
        chunk({"role": "assistant", "content": ""}),
        *(chunk(p) for p in pieces),
        chunk({}, finish="tool_calls"),
    )


async def test_reasoning_details_are_kept_and_sent_back() -> None:
    reply = completion(
        {
            "content": None,
            "reasoning": OR_DETAILS[0]["text"],
            "reasoning_details": OR_DETAILS,
            "tool_calls": [OR_CALL],
        },
        finish="tool_calls",
    )
    capture = Capture(httpx.Response(200, json=reply), sse_reply(_details_stream()))
    model = compatible(capture, model="anthropic/claude-sonnet-4")
    blocking = await model.request(ModelRequest(messages=(Message.user("weather?", id="u1"),)))
    [reasoning] = [p for p in blocking.parts if isinstance(p, ReasoningPart)]
    assert reasoning.text == OR_DETAILS[0]["text"]
    assert reasoning.provider_data["reasoning_details"] == OR_DETAILS
    streamed, chunks = await collect(model, ModelRequest(messages=(Message.user("w?", id="u1"),)))
    assert streamed.parts == blocking.parts
    assert "".join(c.text for c in chunks if isinstance(c, ReasoningChunk)) == reasoning.text

    # the next request carries them back unchanged, with the call they led to
    history = (
        Message.user("weather?", id="u1"),
        Message(id="a1", role="assistant", parts=blocking.parts),
        Message.tool_result(ToolResultPart("toolu_1", "sunny"), id="t1"),
    )
    body = model.build_body(ModelRequest(messages=history), stream=False)
    assistant = body["messages"][1]
    assert assistant["reasoning_details"] == OR_DETAILS
    assert assistant["tool_calls"][0]["id"] == "toolu_1"
    # OpenAI itself does not know the field: its adapter never sends it
    openai = chat(capture).build_body(ModelRequest(messages=history), stream=False)
    assert "reasoning_details" not in openai["messages"][1]
    # nor does a compatible server told not to echo reasoning
    quiet = compatible(capture, send_reasoning=False).build_body(
        ModelRequest(messages=history), stream=False
    )
    assert "reasoning_details" not in quiet["messages"][1]


async def test_openai_picks_choice_zero_of_a_blocking_reply_with_n_choices() -> None:
    reply = completion({"content": "zero"})
    reply["choices"] = [
        {"index": 1, "message": {"role": "assistant", "content": "one"}, "finish_reason": "length"},
        reply["choices"][0],
    ]
    response = await chat(Capture(httpx.Response(200, json=reply))).request(
        ModelRequest(messages=(Message.user("hi", id="u1"),))
    )
    assert response.parts == (TextPart("zero"),)
    assert response.finish_reason == "stop"
