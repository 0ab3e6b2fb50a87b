"""Retries of every HTTP adapter, through httpx.MockTransport: backoff, Retry-After, budgets.

Each test runs for every adapter (OpenAI Chat, OpenAI-compatible, OpenAI Responses,
Anthropic), blocking and streaming where it applies. Sleeps are injected and recorded,
never slept, so "waits exactly 2 s" is checked exactly and no test depends on time.

* 429 (Retry-After: 2) -> 529 -> 503 -> success: the reply comes back with
  ``attempts == 4``; the first wait is exactly 2 s, the others follow the backoff;
* every attempt failing: the typed error of the last one, with ``attempts`` set;
* ``request.max_attempts`` caps attempts (a budget of N calls is N requests);
* the policy's ``total_timeout``: no wait that would end past it;
* connection errors are retried; a 401/400 is not;
* replay safety: a stream that fails after output reached ``on_chunk`` (cut short,
  or a transport error mid-stream) is never retried -- exactly one request, a typed
  error -- while a stream that fails before any output is retried.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import _provider_wires as wires
import httpx
import msgspec
import pytest

from stepmachine import StreamChunk, TextChunk, TextPart
from stepmachine.providers import (
    AuthenticationError,
    BadRequestError,
    MalformedResponseError,
    OverloadedError,
    ProviderConnectionError,
    RateLimitError,
    RetryPolicy,
    ServerError,
)

REQUEST = wires.REQUEST
WIRES = {w.name: w for w in wires.WIRES}

pytestmark = pytest.mark.parametrize("wire", list(WIRES.values()), ids=list(WIRES))


class Script:
    """A MockTransport handler answering requests from a list of steps, in order."""

    def __init__(self, *steps: Callable[[httpx.Request], httpx.Response]) -> None:
        self.steps = list(steps)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if len(self.requests) > len(self.steps):
            pytest.fail(f"unexpected request {len(self.requests)}: only {len(self.steps)} scripted")
        return self.steps[len(self.requests) - 1](request)


def status(code: int, body: bytes, **headers: str) -> Callable[[httpx.Request], httpx.Response]:
    return lambda _: httpx.Response(
        code, content=body, headers={"content-type": "application/json", **headers}
    )


def reply(wire: Any, *, stream: bool) -> Callable[[httpx.Request], httpx.Response]:
    if stream:
        return lambda _: httpx.Response(
            200, content=wire.ok_sse, headers={"content-type": "text/event-stream"}
        )
    return status(200, wire.ok_json)


class Broken(httpx.AsyncByteStream):
    """A response body that yields ``head`` and then fails like a dropped connection."""

    def __init__(self, head: bytes) -> None:
        self.head = head

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.head:
            yield self.head
        raise httpx.ReadError("connection reset by peer")


def sse_reply(body: bytes | httpx.AsyncByteStream) -> Callable[[httpx.Request], httpx.Response]:
    headers = {"content-type": "text/event-stream"}
    if isinstance(body, bytes):
        return lambda _: httpx.Response(200, content=body, headers=headers)
    return lambda _: httpx.Response(200, stream=body, headers=headers)


def refuse(_: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused")


class Sink:
    def __init__(self) -> None:
        self.chunks: list[StreamChunk] = []

    async def __call__(self, chunk: StreamChunk) -> None:
        self.chunks.append(chunk)


def _text(response: Any) -> str:
    return "".join(p.text for p in response.parts if isinstance(p, TextPart))


# -- backoff and Retry-After ------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
async def test_rate_limit_then_overload_then_server_error_then_success(
    wire: Any, stream: bool
) -> None:
    script = Script(
        status(429, wire.error("rate_limit_error", "slow down"), **{"retry-after": "2"}),
        status(529, wire.error("overloaded_error", "Overloaded")),
        status(503, wire.error("server_error", "unavailable")),
        reply(wire, stream=stream),
    )
    sleeps: list[float] = []
    model = wire.make(script, sleeps=sleeps)
    sink = Sink()
    response = await model.request(REQUEST, on_chunk=sink if stream else None)
    assert _text(response) == "Hello"
    assert response.attempts == 4
    assert len(script.requests) == 4
    policy = RetryPolicy()
    assert sleeps[0] == 2.0  # the server's Retry-After, exactly
    assert len(sleeps) == 3
    for attempt, waited in enumerate(sleeps[1:], start=2):
        full = min(policy.max_delay, policy.base_delay * 2 ** (attempt - 1))
        assert full * (1 - policy.jitter) <= waited <= full
    bodies = {r.content for r in script.requests}
    assert len(bodies) == 1  # every retry sends the same body
    if stream:
        assert "".join(c.text for c in sink.chunks if isinstance(c, TextChunk)) == "Hello"


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
async def test_exhausted_attempts_raise_the_last_typed_error(wire: Any, stream: bool) -> None:
    body = wire.error("server_error", "unavailable")
    script = Script(*[status(503, body) for _ in range(4)])
    model = wire.make(script)
    with pytest.raises(OverloadedError) as caught:
        await model.request(REQUEST, on_chunk=Sink() if stream else None)
    assert caught.value.attempts == 4
    assert caught.value.status == 503
    assert len(script.requests) == 4


async def test_a_500_is_retried_as_a_server_error(wire: Any) -> None:
    script = Script(status(500, wire.error("api_error", "boom")), status(200, wire.ok_json))
    response = await wire.make(script).request(REQUEST)
    assert response.attempts == 2


async def test_policy_max_attempts(wire: Any) -> None:
    script = Script(*[status(500, wire.error("api_error", "boom")) for _ in range(2)])
    model = wire.make(script, retry=RetryPolicy(max_attempts=2))
    with pytest.raises(ServerError) as caught:
        await model.request(REQUEST)
    assert caught.value.attempts == 2
    assert len(script.requests) == 2


@pytest.mark.parametrize("budget", [1, 2, 3])
async def test_request_max_attempts_is_a_budget(wire: Any, budget: int) -> None:
    script = Script(*[status(429, wire.error("rate_limit_error", "slow")) for _ in range(budget)])
    model = wire.make(script)
    with pytest.raises(RateLimitError) as caught:
        await model.request(msgspec.structs.replace(REQUEST, max_attempts=budget))
    assert caught.value.attempts == budget
    assert len(script.requests) == budget


async def test_request_max_attempts_never_raises_the_policy(wire: Any) -> None:
    script = Script(*[status(429, wire.error("rate_limit_error", "slow")) for _ in range(2)])
    model = wire.make(script, retry=RetryPolicy(max_attempts=2))
    with pytest.raises(RateLimitError) as caught:
        await model.request(msgspec.structs.replace(REQUEST, max_attempts=10))
    assert caught.value.attempts == 2


async def test_total_timeout_stops_a_wait_that_would_overrun(wire: Any) -> None:
    script = Script(status(429, wire.error("rate_limit_error", "slow"), **{"retry-after": "20"}))
    sleeps: list[float] = []
    model = wire.make(script, sleeps=sleeps, retry=RetryPolicy(total_timeout=5.0))
    with pytest.raises(RateLimitError) as caught:
        await model.request(REQUEST)
    assert caught.value.retry_after == 20.0
    assert caught.value.attempts == 1
    assert sleeps == []
    assert len(script.requests) == 1


async def test_total_timeout_allows_a_wait_that_fits(wire: Any) -> None:
    script = Script(
        status(429, wire.error("rate_limit_error", "slow"), **{"retry-after": "2"}),
        status(200, wire.ok_json),
    )
    sleeps: list[float] = []
    model = wire.make(script, sleeps=sleeps, retry=RetryPolicy(total_timeout=5.0))
    response = await model.request(REQUEST)
    assert response.attempts == 2
    assert sleeps == [2.0]


async def test_a_retry_after_longer_than_the_policy_allows_is_not_cut_short(wire: Any) -> None:
    # Retrying earlier than the server asked would only spend an attempt (which budgets
    # count): the error is raised at once, with the server's wait, for the caller to honour.
    script = Script(
        status(429, wire.error("rate_limit_error", "slow"), **{"retry-after": "9999"}),
        status(200, wire.ok_json),
    )
    sleeps: list[float] = []
    model = wire.make(
        script, sleeps=sleeps, retry=RetryPolicy(max_delay=3.0, total_timeout=10_000.0)
    )
    with pytest.raises(RateLimitError) as caught:
        await model.request(REQUEST)
    assert caught.value.retry_after == 9999.0
    assert caught.value.attempts == 1
    assert sleeps == []


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
async def test_connection_errors_are_retried(wire: Any, stream: bool) -> None:
    script = Script(refuse, refuse, reply(wire, stream=stream))
    sleeps: list[float] = []
    response = await wire.make(script, sleeps=sleeps).request(
        REQUEST, on_chunk=Sink() if stream else None
    )
    assert response.attempts == 3
    assert len(sleeps) == 2


async def test_connection_errors_exhausted(wire: Any) -> None:
    script = Script(refuse, refuse)
    model = wire.make(script, retry=RetryPolicy(max_attempts=2))
    with pytest.raises(ProviderConnectionError) as caught:
        await model.request(REQUEST)
    assert caught.value.attempts == 2
    assert caught.value.status is None
    assert wires.KEY not in str(caught.value)


@pytest.mark.parametrize(
    ("code", "kind", "error"),
    [
        (401, "authentication_error", AuthenticationError),
        (400, "invalid_request_error", BadRequestError),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
async def test_client_errors_are_not_retried(
    wire: Any, code: int, kind: str, error: type[Exception], stream: bool
) -> None:
    script = Script(status(code, wire.error(kind, "no")))
    sleeps: list[float] = []
    with pytest.raises(error) as caught:
        await wire.make(script, sleeps=sleeps).request(REQUEST, on_chunk=Sink() if stream else None)
    assert type(caught.value) is error
    assert caught.value.attempts == 1  # type: ignore[attr-defined]
    assert sleeps == []
    assert len(script.requests) == 1


# -- replay safety: never retry once output was streamed ---------------------------------


async def test_a_complete_stream_is_one_request(wire: Any) -> None:
    script = Script(sse_reply(wire.ok_sse))
    sink = Sink()
    response = await wire.make(script).request(REQUEST, on_chunk=sink)
    assert _text(response) == "Hello"
    assert response.attempts == 1
    assert [c.text for c in sink.chunks if isinstance(c, TextChunk)] == ["Hel", "lo"]


async def test_a_stream_cut_after_output_is_not_retried(wire: Any) -> None:
    script = Script(sse_reply(wire.stream_head + wire.stream_text), sse_reply(wire.ok_sse))
    sink = Sink()
    with pytest.raises(MalformedResponseError) as caught:
        await wire.make(script).request(REQUEST, on_chunk=sink)
    assert caught.value.attempts == 1
    assert len(script.requests) == 1
    assert "".join(c.text for c in sink.chunks if isinstance(c, TextChunk)) == "Hello"


async def test_a_transport_error_after_output_is_not_retried(wire: Any) -> None:
    script = Script(sse_reply(Broken(wire.stream_head + wire.stream_text)), sse_reply(wire.ok_sse))
    sink = Sink()
    with pytest.raises(ProviderConnectionError) as caught:
        await wire.make(script).request(REQUEST, on_chunk=sink)
    assert caught.value.attempts == 1
    assert len(script.requests) == 1
    assert sink.chunks


async def test_a_stream_cut_before_output_is_retried(wire: Any) -> None:
    script = Script(sse_reply(wire.stream_head), sse_reply(wire.ok_sse))
    sink = Sink()
    response = await wire.make(script).request(REQUEST, on_chunk=sink)
    assert response.attempts == 2
    assert len(script.requests) == 2
    # the chunks are those of the successful attempt only
    assert "".join(c.text for c in sink.chunks if isinstance(c, TextChunk)) == "Hello"


async def test_a_transport_error_before_output_is_retried(wire: Any) -> None:
    script = Script(
        sse_reply(Broken(wire.stream_head)), sse_reply(Broken(b"")), sse_reply(wire.ok_sse)
    )
    response = await wire.make(script).request(REQUEST, on_chunk=Sink())
    assert response.attempts == 3
    assert len(script.requests) == 3


async def test_an_empty_stream_is_malformed_and_retried(wire: Any) -> None:
    script = Script(sse_reply(b""), sse_reply(b""))
    model = wire.make(script, retry=RetryPolicy(max_attempts=2))
    with pytest.raises(MalformedResponseError) as caught:
        await model.request(REQUEST, on_chunk=Sink())
    assert caught.value.attempts == 2


async def test_a_malformed_blocking_reply_is_retried(wire: Any) -> None:
    script = Script(status(200, b"{not json"), status(200, wire.ok_json))
    response = await wire.make(script).request(REQUEST)
    assert response.attempts == 2
