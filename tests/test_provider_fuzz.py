"""Fuzzing the decoders of every adapter with broken recorded bodies (hypothesis).

The bodies are real: every successful reply recorded under
``../shared/conformance/cassettes/<provider>/`` (JSON and server-sent events), plus
small hand-written ones so the tests still bite without the recordings. Hypothesis
damages them -- cuts at a random byte offset, flips bytes, deletes or duplicates a
span, inserts garbage lines (non-JSON ``data:``, unknown events, a lone ``[DONE]``,
binary junk, invalid UTF-8) -- and serves the result through ``httpx.MockTransport``:
SSE bodies to a streaming request, JSON bodies to a blocking one (and, sometimes, to
a streaming request, the server-ignored-``stream`` path).

What must hold, for every adapter:

* the adapter returns a :class:`~stepmachine.ModelResponse` or raises a typed
  :class:`~stepmachine.providers.ProviderError` -- never any other exception;
* a JSON body cut short (anything but trailing whitespace removed) raises
  :class:`~stepmachine.providers.MalformedResponseError`;
* a stream cut in its first half (before its final event) raises
  :class:`~stepmachine.providers.MalformedResponseError`;
* a response that does come back is well formed: its parts are message parts and
  every tool call's ``arguments`` is what its ``raw_arguments`` parses to (``None``
  past the kernel's nesting limit of 128 levels).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _provider_wires as wires
import cassettes
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import ModelResponse, ReasoningPart, TextPart, ToolCallPart
from stepmachine._json import MAX_DEPTH, nesting_depth
from stepmachine.extend import StreamChunk
from stepmachine.providers import MalformedResponseError, ProviderError, RetryPolicy

HERE = Path(__file__).resolve().parent
FOLDER = HERE.parents[1] / "shared" / "conformance" / "cassettes"


WIRES = {w.name: w for w in wires.WIRES}


@dataclass(frozen=True)
class Body:
    origin: str
    data: bytes  # decompressed
    sse: bool


def _bodies(provider: str) -> list[Body]:
    wire = WIRES[provider]
    found = [
        Body("hand-written json", wire.ok_json, sse=False),
        Body("hand-written sse", wire.ok_sse, sse=True),
    ]
    folder = FOLDER / provider
    if folder.is_dir():
        for path in sorted(folder.iterdir()):
            for n, interaction in enumerate(cassettes.load_cassette(path)):
                if interaction.status != 200:
                    continue
                served = httpx.Response(
                    200, headers=list(interaction.headers), content=interaction.response_body
                )
                found.append(Body(f"{path.name}#{n}", served.content, sse=interaction.is_sse))
    return found


BODIES = {name: _bodies(name) for name in WIRES}

GARBAGE_LINES = [
    b"data: {not json\n\n",
    b"data: [DONE]\n\n",
    b"data: \n\n",
    b"data: null\n\n",
    b"data: 42\n\n",
    b'data: "a string"\n\n',
    b"data: []\n\n",
    b'data: {"type": "unheard_of", "x": 1}\n\n',
    b'event: mystery\ndata: {"type": "mystery"}\n\n',
    b'data: {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 7}]}}]}\n\n',
    (
        b'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 99, '
        b'"delta": {"type": "text_delta", "text": "x"}}\n\n'
    ),
    (
        b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", '
        b'"output_index": 42, "delta": 5}\n\n'
    ),
    b": a comment\n\n",
    b"retry: 10\n\n",
    b"\xff\xfe\x00garbage\n\n",
    b"\x00\x01\x02\n",
    b"id: 1\n",
    b"\n\n\n",
]


@st.composite
def damaged(draw: st.DrawFn, provider: str) -> tuple[Body, bytes, list[str]]:
    body = draw(st.sampled_from(BODIES[provider]))
    data = body.data
    done: list[str] = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["cut", "flip", "insert", "delete", "duplicate"]))
        at = draw(st.integers(0, max(0, len(data))))
        if kind == "cut":
            data = data[:at]
        elif kind == "flip" and data:
            at = min(at, len(data) - 1)
            data = data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]
        elif kind == "insert":
            line_starts = [0] + [i + 1 for i, b in enumerate(data) if b == 0x0A]
            at = draw(st.sampled_from(line_starts)) if draw(st.booleans()) else at
            junk = draw(st.sampled_from(GARBAGE_LINES) | st.binary(min_size=1, max_size=40))
            data = data[:at] + junk + data[at:]
        elif kind == "delete":
            end = draw(st.integers(at, min(len(data), at + 200)))
            data = data[:at] + data[end:]
        elif kind == "duplicate":
            end = draw(st.integers(at, min(len(data), at + 400)))
            data = data[:end] + data[at:end] + data[end:]
        done.append(f"{kind}@{at}")
    return body, data, done


async def _serve(provider: str, data: bytes, *, sse: bool, stream: bool) -> tuple[Any, list[Any]]:
    """(the response or the exception, the chunks) of one request answered with ``data``."""
    headers = {"content-type": "text/event-stream" if sse else "application/json"}
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return httpx.Response(200, content=data, headers=headers)

    chunks: list[StreamChunk] = []

    async def sink(chunk: StreamChunk) -> None:
        chunks.append(chunk)

    model = WIRES[provider].make(handler, retry=RetryPolicy(max_attempts=1))
    try:
        outcome: Any = await model.request(wires.REQUEST, on_chunk=sink if stream else None)
    except Exception as exc:
        outcome = exc
    finally:
        await model.client.aclose()
    assert len(requests) == 1
    return outcome, chunks


def _check(outcome: Any, what: str) -> None:
    if isinstance(outcome, BaseException):
        if not isinstance(outcome, ProviderError):
            pytest.fail(f"{what}: untyped {type(outcome).__name__}: {outcome}")
        assert outcome.attempts == 1
        return
    assert isinstance(outcome, ModelResponse), what
    for part in outcome.parts:
        assert isinstance(part, TextPart | ReasoningPart | ToolCallPart), (what, part)
        if isinstance(part, ToolCallPart):
            raw = part.raw_arguments
            try:
                parsed = json.loads(raw) if raw.strip() else {}
            except (ValueError, RecursionError):
                parsed = None
            if nesting_depth(raw) > MAX_DEPTH:
                parsed = None  # deeper than the kernel accepts: an invalid call
            assert part.arguments == parsed, (what, part)


def _final_event_missing(body: Body, data: bytes) -> bool:
    """A cut that loses at least the second half of a stream (where its final event is)."""
    return body.data.startswith(data) and len(data) < len(body.data) // 2


FUZZ = settings(
    # STEPMACHINE_FUZZ_EXAMPLES=5000 for a long local run
    max_examples=int(os.environ.get("STEPMACHINE_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.parametrize("provider", list(WIRES))
@FUZZ
@given(data=st.data())
async def test_damaged_bodies_give_a_response_or_a_typed_error(
    anyio_backend: str, provider: str, data: st.DataObject
) -> None:
    body, broken, done = data.draw(damaged(provider))
    stream = body.sse or data.draw(st.booleans())
    what = f"{provider} {body.origin} {done} stream={stream}"
    outcome, _ = await _serve(provider, broken, sse=body.sse, stream=stream)
    _check(outcome, what)


@pytest.mark.parametrize("provider", list(WIRES))
@FUZZ
@given(data=st.data())
async def test_cut_bodies_are_malformed(
    anyio_backend: str, provider: str, data: st.DataObject
) -> None:
    body = data.draw(st.sampled_from(BODIES[provider]))
    cut = data.draw(st.integers(0, len(body.data) - 1))
    broken = body.data[:cut]
    outcome, _ = await _serve(provider, broken, sse=body.sse, stream=body.sse)
    what = f"{provider} {body.origin} cut at {cut}/{len(body.data)}"
    _check(outcome, what)
    if body.sse:
        if _final_event_missing(body, broken):
            assert isinstance(outcome, MalformedResponseError), what
    elif broken.rstrip() != body.data.rstrip():
        assert isinstance(outcome, MalformedResponseError), what


@pytest.mark.parametrize("provider", list(WIRES))
async def test_every_recorded_body_whole_is_a_response(provider: str) -> None:
    """The fuzzers' starting points are valid: undamaged, each one parses."""
    for body in BODIES[provider]:
        outcome, chunks = await _serve(provider, body.data, sse=body.sse, stream=body.sse)
        assert isinstance(outcome, ModelResponse), (body.origin, outcome)
        _check(outcome, body.origin)
        if body.sse:
            assert chunks, body.origin


@pytest.mark.parametrize("provider", list(WIRES))
@pytest.mark.parametrize(
    "junk", [b"", b"   ", b"null", b"[]", b'"text"', b"{}", b"\xff\xfe", b"<html>502</html>"]
)
async def test_nonsense_json_replies_are_malformed(provider: str, junk: bytes) -> None:
    outcome, _ = await _serve(provider, junk, sse=False, stream=False)
    assert isinstance(outcome, MalformedResponseError), outcome


@pytest.mark.parametrize("provider", list(WIRES))
async def test_a_stream_of_only_done_is_malformed(provider: str) -> None:
    outcome, _ = await _serve(provider, b"data: [DONE]\n\n", sse=True, stream=True)
    assert isinstance(outcome, MalformedResponseError), outcome


@pytest.mark.parametrize("provider", list(WIRES))
@pytest.mark.parametrize("junk", [b"", b"\n\n", b": comment\n\n", b"data: {oops\n\n"])
async def test_nonsense_streams_are_malformed(provider: str, junk: bytes) -> None:
    outcome, _ = await _serve(provider, junk, sse=True, stream=True)
    assert isinstance(outcome, MalformedResponseError), outcome
