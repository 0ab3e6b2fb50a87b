"""Deeply nested JSON from a model never crashes a run (issue 8, item 6).

Every JSON library recurses once per nesting level; msgspec raises a bare
``RecursionError`` near 1,000 levels, and a value that does decode that deep breaks
the walks after it (a store encoding the message, the call's fingerprint, a log
line) further down the stack. Text from a model or a server is therefore decoded
with a limit of 128 levels (``stepmachine._json``):

* a tool call whose arguments nest deeper is an *invalid call* (``arguments`` is
  ``None``, the raw string kept): the Tools step answers it with its invalid-JSON
  error result, and the run goes on;
* a reply whose own JSON nests deeper than the adapters accept (128 + an envelope
  of 32: Anthropic's blocking ``input`` object, a server sending arguments as an
  object) is a :class:`MalformedResponseError`;
* never another exception: checked for every adapter, blocking and streaming, at
  depths 129 to 100,000, and through ``machine.run()`` with a SQLite store and a
  MemoryStore, after which the session still loads (and, for SQLite, from a fresh
  store on the same file);
* arguments exactly at the limit work end to end: the tool runs with them, the
  call is fingerprinted and stored, the session loads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _provider_wires as wires
import httpx
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepmachine import (
    Message,
    ModelInference,
    ModelResponse,
    Runtime,
    StateMachine,
    ToolCallPart,
    ToolResultPart,
    Tools,
    tool,
)
from stepmachine._json import MAX_DEPTH, decode, nesting_depth
from stepmachine.operations import StructuredOutput, read_output
from stepmachine.providers import BadRequestError, MalformedResponseError, RetryPolicy
from stepmachine.stores import MemoryStore, SQLiteStore
from stepmachine.testing import ScriptedModel, reply

WIRES = {w.name: w for w in wires.WIRES}
DEEP = [MAX_DEPTH + 1, 999, 1000, 5000, 100_000]


def _nested(depth: int, opener: str = "[") -> str:
    """Arguments ``{"v": ...}`` nested ``depth`` levels in all (the object counts)."""
    inner = depth - 1
    if inner == 0:
        value = "0"
    elif opener == "[":
        value = "[" * inner + "]" * inner
    else:
        value = '{"k": ' * (inner - 1) + "{}" + "}" * (inner - 1)
    return '{"v": ' + value + "}"


# -- the decoder ------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    depth=st.integers(1, 3000) | st.sampled_from([MAX_DEPTH, MAX_DEPTH + 1, 100_000]),
    opener=st.sampled_from(["[", "{"]),
    noise=st.sampled_from(["", '"[[[{{{"', '"\\"[\\\\"', "1", "true"]),
)
def test_parse_is_an_invalid_call_past_the_limit_and_exact_below(
    depth: int, opener: str, noise: str
) -> None:
    raw = _nested(depth, opener)
    if noise:  # brackets inside strings do not nest
        raw = raw[:-1] + f', "n": {noise}' + "}"
    call = ToolCallPart.parse("c1", "echo", raw)
    assert call.raw_arguments == raw
    if depth <= MAX_DEPTH:
        assert call.arguments == json.loads(raw)
        assert nesting_depth(raw) == depth
    else:
        assert call.arguments is None
        with pytest.raises(msgspec.DecodeError, match="nested deeper than 128"):
            decode(raw)


def test_invalid_json_with_brackets_in_strings_is_measured_without_recursion() -> None:
    assert nesting_depth('["]]]]"') == 1
    # An unterminated string proves nothing: its brackets count (the text is invalid anyway).
    assert nesting_depth('"' + "[" * 10_000) == 10_000
    assert nesting_depth("[" * 10_000) == 10_000
    with pytest.raises(msgspec.DecodeError):
        decode("[" * 10_000)


# -- what each adapter answers ---------------------------------------------------------------


def _chat_reply(raw: str) -> bytes:
    call = {"id": "call_1", "type": "function", "function": {"name": "echo", "arguments": raw}}
    return json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "test-model",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                    "finish_reason": "tool_calls",
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1},
        }
    ).encode()


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "test-model",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def _chat_stream(raw: str) -> bytes:
    head = {"index": 0, "id": "call_1", "type": "function"}
    return wires.sse(
        (
            None,
            _chunk(
                {
                    "role": "assistant",
                    "tool_calls": [{**head, "function": {"name": "echo", "arguments": ""}}],
                }
            ),
        ),
        (None, _chunk({"tool_calls": [{"index": 0, "function": {"arguments": raw}}]})),
        (None, _chunk({}, "tool_calls")),
        (None, "[DONE]"),
    )


def _responses_item(raw: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "echo",
        "arguments": raw,
        "status": "completed",
    }


def _responses_reply(raw: str) -> bytes:
    return json.dumps(
        {
            "id": "resp_1",
            "object": "response",
            "status": "completed",
            "model": "test-model",
            "output": [_responses_item(raw)],
            "usage": {"input_tokens": 3, "output_tokens": 1},
        }
    ).encode()


def _responses_stream(raw: str) -> bytes:
    added = {**_responses_item(""), "status": "in_progress"}
    final = {"id": "resp_1", "object": "response", "status": "completed", "model": "test-model"}
    return wires.sse(
        (
            "response.created",
            {
                "type": "response.created",
                "response": {**final, "status": "in_progress", "output": []},
            },
        ),
        (
            "response.output_item.added",
            {"type": "response.output_item.added", "output_index": 0, "item": added},
        ),
        (
            "response.function_call_arguments.delta",
            {"type": "response.function_call_arguments.delta", "output_index": 0, "delta": raw},
        ),
        (
            "response.output_item.done",
            {"type": "response.output_item.done", "output_index": 0, "item": _responses_item(raw)},
        ),
        (
            "response.completed",
            {"type": "response.completed", "response": {**final, "output": [_responses_item(raw)]}},
        ),
    )


def _anthropic_reply(raw: str) -> bytes:
    # The arguments are an object inside the body: built as text, never through json.dumps.
    return (
        '{"id": "msg_1", "type": "message", "role": "assistant", "model": "test-model", '
        '"content": [{"type": "tool_use", "id": "call_1", "name": "echo", "input": '
        + raw
        + '}], "stop_reason": "tool_use", "usage": {"input_tokens": 3, "output_tokens": 1}}'
    ).encode()


def _anthropic_stream(raw: str) -> bytes:
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "test-model",
        "content": [],
        "usage": {"input_tokens": 3, "output_tokens": 0},
    }
    block = {"type": "tool_use", "id": "call_1", "name": "echo", "input": {}}
    return wires.sse(
        ("message_start", {"type": "message_start", "message": message}),
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": block},
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "input_json_delta", "partial_json": raw},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "tool_use"},
                "usage": {"output_tokens": 1},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    )


def _gemini_reply(raw: str) -> bytes:
    # ``args`` is an object inside the body, as Anthropic's ``input``: built as text.
    return (
        '{"candidates": [{"content": {"role": "model", "parts": [{"functionCall": '
        '{"name": "echo", "args": ' + raw + '}}]}, "finishReason": "STOP"}], '
        '"usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 1}, '
        '"modelVersion": "test-model", "responseId": "r1"}'
    ).encode()


def _gemini_stream(raw: str) -> bytes:
    return b"data: " + _gemini_reply(raw) + b"\r\n\r\n"


REPLIES: dict[str, tuple[Callable[[str], bytes], Callable[[str], bytes]]] = {
    "openai_chat": (_chat_reply, _chat_stream),
    "openai_compatible": (_chat_reply, _chat_stream),
    "openai_responses": (_responses_reply, _responses_stream),
    "anthropic": (_anthropic_reply, _anthropic_stream),
    "gemini": (_gemini_reply, _gemini_stream),
}


def _answer(provider: str, raw: str, *, stream: bool) -> httpx.Response:
    blocking, streaming = REPLIES[provider]
    if stream:
        return httpx.Response(
            200, content=streaming(raw), headers={"content-type": "text/event-stream"}
        )
    return httpx.Response(200, content=blocking(raw), headers={"content-type": "application/json"})


def _body_too_deep(provider: str, stream: bool, depth: int) -> bool:
    """Whether the reply's own JSON is deeper than the adapters read (the arguments
    are an object inside Anthropic's blocking body, and inside every Gemini chunk)."""
    if provider == "gemini":
        return depth + 7 > MAX_DEPTH + 32
    return provider == "anthropic" and not stream and depth + 3 > MAX_DEPTH + 32


@pytest.mark.parametrize("provider", list(WIRES))
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
@pytest.mark.parametrize("depth", DEEP)
async def test_every_adapter_makes_deep_arguments_an_invalid_call(
    provider: str, stream: bool, depth: int
) -> None:
    raw = _nested(depth)
    model = WIRES[provider].make(
        lambda _: _answer(provider, raw, stream=stream), retry=RetryPolicy(max_attempts=1)
    )

    async def sink(chunk: Any) -> None:
        pass

    try:
        outcome: Any = await model.request(wires.REQUEST, on_chunk=sink if stream else None)
    except Exception as exc:  # whatever comes out is checked below
        outcome = exc
    if _body_too_deep(provider, stream, depth):
        assert isinstance(outcome, MalformedResponseError), repr(outcome)[:300]
        assert "nested deeper" in str(outcome)
        return
    assert isinstance(outcome, ModelResponse), repr(outcome)[:300]
    (call,) = [p for p in outcome.parts if isinstance(p, ToolCallPart)]
    assert call.arguments is None
    assert call.name == "echo"
    # the raw string is what was sent (Anthropic's blocking reply re-encodes valid input
    # only; Gemini sends an object, always re-encoded compactly)
    if provider == "gemini":
        assert json.loads(call.raw_arguments) == json.loads(raw)
    elif provider != "anthropic" or stream:
        assert call.raw_arguments == raw


@pytest.mark.parametrize("provider", ["openai_compatible"])
async def test_a_server_sending_deep_arguments_as_an_object_is_malformed(provider: str) -> None:
    body = _chat_reply("PLACEHOLDER").decode().replace('"PLACEHOLDER"', _nested(1000))
    model = WIRES[provider].make(
        lambda _: httpx.Response(200, content=body.encode()), retry=RetryPolicy(max_attempts=1)
    )
    with pytest.raises(MalformedResponseError, match="nested deeper"):
        await model.request(wires.REQUEST)


@pytest.mark.parametrize("provider", list(WIRES))
async def test_a_deep_error_body_is_still_a_typed_error(provider: str) -> None:
    body = '{"error": {"message": "no", "type": "x", "param": ' + "[" * 5000 + "]" * 5000 + "}}"
    model = WIRES[provider].make(
        lambda _: httpx.Response(400, content=body.encode()), retry=RetryPolicy(max_attempts=1)
    )
    with pytest.raises(BadRequestError):
        await model.request(wires.REQUEST)


# -- through machine.run() -----------------------------------------------------------------


@tool
def echo(v: list[Any]) -> str:
    """Say how deep ``v`` nests."""
    depth, value = 1, v
    while value and isinstance(value[0], list):
        depth, value = depth + 1, value[0]
    return f"depth {depth}"


class _Server:
    """Answers the first model request with a tool call, every later one with text."""

    def __init__(self, provider: str, raw: str, *, stream: bool) -> None:
        self.provider, self.raw, self.stream = provider, raw, stream
        self.requests = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        if self.requests == 1:
            return _answer(self.provider, self.raw, stream=self.stream)
        wire = WIRES[self.provider]
        if self.stream:
            return httpx.Response(
                200, content=wire.ok_sse, headers={"content-type": "text/event-stream"}
            )
        return httpx.Response(
            200, content=wire.ok_json, headers={"content-type": "application/json"}
        )


async def _store(kind: str, path: Path) -> Any:
    if kind == "sqlite":
        return await SQLiteStore.open(str(path / "deep.sqlite3"))
    return MemoryStore()


async def _reload(kind: str, store: Any, path: Path) -> Any:
    """The session as a fresh reader sees it (a new SQLite store on the same file)."""
    if kind != "sqlite":
        return await store.load("s1")
    async with await SQLiteStore.open(str(path / "deep.sqlite3")) as fresh:
        return await fresh.load("s1")


@pytest.mark.parametrize("provider", list(WIRES))
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
@pytest.mark.parametrize("depth", [1000, 100_000])
@pytest.mark.parametrize("kind", ["sqlite", "memory"])
async def test_machine_run_answers_deep_arguments_with_an_error_result(
    provider: str, stream: bool, depth: int, kind: str, tmp_path: Path
) -> None:
    server = _Server(provider, _nested(depth), stream=stream)
    store = await _store(kind, tmp_path)
    try:
        await store.create("s1", conversation=[Message.user("go deep", id="u1")])
        model = WIRES[provider].make(server, retry=RetryPolicy(max_attempts=1))
        machine = StateMachine([Tools([echo]), ModelInference(stream=stream)])
        runtime = Runtime(store=store, model=model)
        if _body_too_deep(provider, stream, depth):
            with pytest.raises(MalformedResponseError):
                await machine.run(runtime, "s1")
            session = await _reload(kind, store, tmp_path)
            assert [m.id for m in session.conversation] == ["u1"]  # nothing half-written
            return
        await machine.run(runtime, "s1")
        session = await _reload(kind, store, tmp_path)
    finally:
        await store.aclose()
    roles = [m.role for m in session.conversation]
    assert roles == ["user", "assistant", "tool", "assistant"], roles
    (call,) = session.conversation[1].tool_calls
    assert call.arguments is None
    (result,) = [p for p in session.conversation[2].parts if isinstance(p, ToolResultPart)]
    assert result.is_error
    assert "not valid JSON" in result.content
    assert session.conversation[3].text == "Hello"


@pytest.mark.parametrize("provider", list(WIRES))
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
async def test_arguments_at_the_limit_run_the_tool_and_store(
    provider: str, stream: bool, tmp_path: Path
) -> None:
    server = _Server(provider, _nested(MAX_DEPTH), stream=stream)
    store = await _store("sqlite", tmp_path)
    try:
        await store.create("s1", conversation=[Message.user("go deep", id="u1")])
        model = WIRES[provider].make(server, retry=RetryPolicy(max_attempts=1))
        machine = StateMachine([Tools([echo]), ModelInference(stream=stream)])
        await machine.run(Runtime(store=store, model=model), "s1")
    finally:
        await store.aclose()
    session = await _reload("sqlite", store, tmp_path)
    (call,) = session.conversation[1].tool_calls
    assert call.arguments is not None
    (result,) = [p for p in session.conversation[2].parts if isinstance(p, ToolResultPart)]
    assert not result.is_error, result.content
    assert result.content == f"depth {MAX_DEPTH - 1}"


# -- structured output read from the reply's text ------------------------------------------


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 900, 1000, 100_000])
@pytest.mark.parametrize("mode", ["native", "prompted"])
async def test_structured_output_too_deep_is_re_prompted_not_a_crash(depth: int, mode: str) -> None:
    store = MemoryStore()
    await store.create("s1", conversation=[Message.user("answer", id="u1")])
    model = ScriptedModel([reply(_nested(depth)), reply('{"v": [[1]]}')])
    machine = StateMachine([StructuredOutput(dict[str, Any], mode, inference=ModelInference())])
    session = await machine.run(Runtime(store=store, model=model), "s1")
    feedback = session.conversation[2]
    assert "nested deeper than 128 levels" in feedback.text
    assert read_output(session, dict[str, Any]) == {"v": [[1]]}
