"""Minimal hand-written wire bodies per adapter, shared by the cross-cutting provider tests.

Not a test module. For every adapter: how to build it against a MockTransport, a
blocking JSON reply and a complete SSE stream that both say "Hello" (usage 3 in /
1 out, finish "stop"), a stream's opening events (before any output), and an
error body of the provider's shape.
"""

from __future__ import annotations

import json
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from stepmachine import Message, ModelRequest
from stepmachine.providers import (
    AnthropicModel,
    GeminiModel,
    HTTPModel,
    OpenAIChatModel,
    OpenAICompatibleModel,
    OpenAIResponsesModel,
    RetryPolicy,
)

KEY = "sk-test-DO-NOT-LEAK-0123456789"
REQUEST = ModelRequest(messages=(Message.user("Say hello", id="u1"),))


def sse(*events: tuple[str | None, Any]) -> bytes:
    """A server-sent event stream: ``(event name or None, JSON payload or raw string)``."""
    out = []
    for name, payload in events:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        out.append((f"event: {name}\n" if name else "") + f"data: {data}\n\n")
    return "".join(out).encode()


@dataclass(frozen=True)
class Wire:
    """One adapter, and small bodies of its wire format."""

    name: str
    factory: Callable[..., HTTPModel]
    ok_json: bytes
    stream_head: bytes  # the opening events: no output yet
    stream_text: bytes  # the text deltas ("Hel", "lo")
    stream_tail: bytes  # the closing events
    error: Callable[[str, str], bytes]  # (type, message) -> an error body

    @property
    def ok_sse(self) -> bytes:
        return self.stream_head + self.stream_text + self.stream_tail

    def make(
        self,
        handler: Callable[[httpx.Request], httpx.Response | Awaitable[httpx.Response]],
        *,
        sleeps: list[float] | None = None,
        retry: RetryPolicy | None = None,
        **kwargs: Any,
    ) -> HTTPModel:
        """The adapter over a MockTransport; waits are recorded in ``sleeps``, never slept."""
        record = sleeps if sleeps is not None else []

        async def sleep(seconds: float) -> None:
            record.append(seconds)

        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        return self.factory(
            "test-model",
            api_key=KEY,
            base_url="https://llm.test/v1",
            client=client,
            retry=retry,
            sleep=sleep,
            rng=random.Random(7),
            **kwargs,
        )


def _openai_error(kind: str, message: str) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": None}}
    ).encode()


def _anthropic_error(kind: str, message: str) -> bytes:
    return json.dumps(
        {"type": "error", "error": {"type": kind, "message": message}, "request_id": "req_1"}
    ).encode()


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "test-model",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


_CHAT_USAGE = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}

_CHAT = {
    "ok_json": json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": "test-model",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello", "refusal": None},
                    "finish_reason": "stop",
                }
            ],
            "usage": _CHAT_USAGE,
        }
    ).encode(),
    "stream_head": sse((None, _chunk({"role": "assistant", "content": ""}))),
    "stream_text": sse((None, _chunk({"content": "Hel"})), (None, _chunk({"content": "lo"}))),
    "stream_tail": sse(
        (None, _chunk({}, "stop")),
        (
            None,
            {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "test-model",
                "choices": [],
                "usage": _CHAT_USAGE,
            },
        ),
        (None, "[DONE]"),
    ),
    "error": _openai_error,
}

_MESSAGE_ITEM = {
    "type": "message",
    "id": "msg_1",
    "role": "assistant",
    "status": "completed",
    "content": [{"type": "output_text", "text": "Hello", "annotations": []}],
}
_RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "status": "completed",
    "model": "test-model",
    "output": [_MESSAGE_ITEM],
    "usage": {
        "input_tokens": 3,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 1,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 4,
    },
    "error": None,
    "incomplete_details": None,
}
_IN_PROGRESS = {**_RESPONSE, "status": "in_progress", "output": [], "usage": None}
_EMPTY_ITEM = {**_MESSAGE_ITEM, "status": "in_progress", "content": []}
_PART = {"type": "output_text", "text": "", "annotations": []}


def _responses_event(kind: str, n: int, **fields: Any) -> tuple[str, dict[str, Any]]:
    return kind, {"type": kind, "sequence_number": n, **fields}


_RESPONSES = {
    "ok_json": json.dumps(_RESPONSE).encode(),
    "stream_head": sse(
        _responses_event("response.created", 0, response=_IN_PROGRESS),
        _responses_event("response.in_progress", 1, response=_IN_PROGRESS),
        _responses_event("response.output_item.added", 2, output_index=0, item=_EMPTY_ITEM),
        _responses_event(
            "response.content_part.added",
            3,
            item_id="msg_1",
            output_index=0,
            content_index=0,
            part=_PART,
        ),
    ),
    "stream_text": sse(
        _responses_event(
            "response.output_text.delta",
            4,
            item_id="msg_1",
            output_index=0,
            content_index=0,
            delta="Hel",
        ),
        _responses_event(
            "response.output_text.delta",
            5,
            item_id="msg_1",
            output_index=0,
            content_index=0,
            delta="lo",
        ),
    ),
    "stream_tail": sse(
        _responses_event(
            "response.output_text.done",
            6,
            item_id="msg_1",
            output_index=0,
            content_index=0,
            text="Hello",
        ),
        _responses_event(
            "response.content_part.done",
            7,
            item_id="msg_1",
            output_index=0,
            content_index=0,
            part={**_PART, "text": "Hello"},
        ),
        _responses_event("response.output_item.done", 8, output_index=0, item=_MESSAGE_ITEM),
        _responses_event("response.completed", 9, response=_RESPONSE),
    ),
    "error": _openai_error,
}

_ANTHROPIC_USAGE = {"input_tokens": 3, "output_tokens": 1}
_ANTHROPIC = {
    "ok_json": json.dumps(
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "test-model",
            "content": [{"type": "text", "text": "Hello"}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": _ANTHROPIC_USAGE,
        }
    ).encode(),
    "stream_head": sse(
        (
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": "msg_1",
                    "type": "message",
                    "role": "assistant",
                    "model": "test-model",
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": 3, "output_tokens": 1},
                },
            },
        ),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        ("ping", {"type": "ping"}),
    ),
    "stream_text": sse(
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": "Hel"},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": "lo"},
            },
        ),
    ),
    "stream_tail": sse(
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": 1},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ),
    "error": _anthropic_error,
}


def _gemini_error(kind: str, message: str) -> bytes:
    return json.dumps({"error": {"code": 400, "message": message, "status": kind}}).encode()


def _gemini_chunk(parts: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
    candidate = {"content": {"role": "model", "parts": parts}, "index": 0, **more}
    return {"candidates": [candidate], "modelVersion": "test-model", "responseId": "r1"}


def _gemini_sse(*chunks: dict[str, Any]) -> bytes:
    # Gemini separates events with CRLF and sends no event names and no [DONE].
    return "".join(f"data: {json.dumps(c)}\r\n\r\n" for c in chunks).encode()


_GEMINI_USAGE = {"promptTokenCount": 3, "candidatesTokenCount": 1, "totalTokenCount": 4}
_GEMINI = {
    "ok_json": json.dumps(
        {**_gemini_chunk([{"text": "Hello"}], finishReason="STOP"), "usageMetadata": _GEMINI_USAGE}
    ).encode(),
    # No output yet: a chunk with usage only.
    "stream_head": _gemini_sse({"usageMetadata": {"promptTokenCount": 3}, "responseId": "r1"}),
    "stream_text": _gemini_sse(_gemini_chunk([{"text": "Hel"}]), _gemini_chunk([{"text": "lo"}])),
    "stream_tail": _gemini_sse(
        {**_gemini_chunk([{"text": ""}], finishReason="STOP"), "usageMetadata": _GEMINI_USAGE}
    ),
    "error": _gemini_error,
}

WIRES = [
    Wire("openai_chat", OpenAIChatModel, **_CHAT),
    Wire("openai_compatible", OpenAICompatibleModel, **_CHAT),
    Wire("openai_responses", OpenAIResponsesModel, **_RESPONSES),
    Wire("anthropic", AnthropicModel, **_ANTHROPIC),
    Wire("gemini", GeminiModel, **_GEMINI),
]
