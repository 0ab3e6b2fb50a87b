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
  error -- while a stream that fails before any output is retried;
* ``Retry-After-Ms``/``Retry-After``: only a finite, positive value is a wait; a zero,
  negative or unreadable one falls back to the other header, then to the backoff, so
  no combination of headers (hypothesis) makes a retry wait 0 s;
* out of quota/credit (OpenAI ``insufficient_quota``, Anthropic ``billing_error``, a
  spend limit) is :class:`QuotaExceededError`: permanent, one request, never retried,
  blocking or streaming, as an HTTP status or as an error event inside a stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import _provider_wires as wires
import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import TextPart
from stepmachine.extend import StreamChunk, TextChunk
from stepmachine.providers import (
    AuthenticationError,
    BadRequestError,
    MalformedResponseError,
    OverloadedError,
    PermissionDeniedError,
    ProviderConnectionError,
    ProviderError,
    QuotaExceededError,
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


# -- Retry-After-Ms / Retry-After combinations ---------------------------------------------

_WAIT_VALUES = ["0", "-1", "0.0", "-0", "nan", "inf", "-inf", "1e400", "soon", "", "250", "1500"]
_DATES = ["Wed, 21 Oct 2015 07:28:00 GMT", "Wed, 21 Oct 2099 07:28:00 GMT", "not a date"]


def _usable(value: str | None) -> float | None:
    """What the spec says a header value is worth: a finite number > 0, else nothing."""
    try:
        number = float(value) if value is not None else None
    except ValueError:
        return None
    return number if number is not None and 0 < number < float("inf") else None


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    ms=st.none() | st.sampled_from(_WAIT_VALUES),
    seconds=st.none() | st.sampled_from(_WAIT_VALUES + _DATES),
    status_code=st.sampled_from([429, 503, 529, 500]),
)
async def test_no_retry_after_combination_disables_the_backoff(
    anyio_backend: str, wire: Any, ms: str | None, seconds: str | None, status_code: int
) -> None:
    headers = {k: v for k, v in (("retry-after-ms", ms), ("retry-after", seconds)) if v is not None}
    script = Script(
        status(status_code, wire.error("x", "wait"), **headers), status(200, wire.ok_json)
    )
    sleeps: list[float] = []
    policy = RetryPolicy()
    expected_ms, expected_s = _usable(ms), _usable(seconds)
    asked = expected_ms / 1000 if expected_ms is not None else expected_s
    if asked is None and seconds is not None and "2099" in seconds:
        asked = float("inf")  # a date far ahead
    model = wire.make(script, sleeps=sleeps)
    if asked is not None and asked > policy.max_delay:
        with pytest.raises(ProviderError):  # a longer wait than the policy allows: no retry
            await model.request(REQUEST)
        assert sleeps == []
        return
    response = await model.request(REQUEST)
    assert response.attempts == 2
    (waited,) = sleeps
    assert waited > 0  # never a retry at once
    if asked is not None:
        assert waited == pytest.approx(asked)
    else:
        assert policy.base_delay * (1 - policy.jitter) <= waited <= policy.base_delay


async def test_retry_after_ms_zero_next_to_retry_after_one_waits_one_second(wire: Any) -> None:
    """Azure sends both; the zero used to make every retry immediate."""
    busy = status(
        429, wire.error("rate_limit_error", "busy"), **{"retry-after-ms": "0", "retry-after": "1"}
    )
    script = Script(busy, busy, busy, status(200, wire.ok_json))
    sleeps: list[float] = []
    response = await wire.make(script, sleeps=sleeps).request(REQUEST)
    assert response.attempts == 4
    assert sleeps == [1.0, 1.0, 1.0]


# -- out of quota: permanent -----------------------------------------------------------------


def _quota_bodies(wire: Any) -> list[tuple[int, bytes]]:
    openai = json.dumps(
        {
            "error": {
                "message": "You exceeded your current quota, please check your plan and billing.",
                "type": "insufficient_quota",
                "param": None,
                "code": "insufficient_quota",
            }
        }
    ).encode()
    billing = wire.error("billing_error", "Your credit balance is too low to access the API.")
    spend = json.dumps(
        {
            "type": "error",
            "error": {
                "type": "rate_limit_error",
                "message": "This request would exceed your organization's monthly spend limit.",
                "details": {"error_code": "enforced_spend_limit_reached"},
            },
        }
    ).encode()
    limit = wire.error(
        "invalid_request_error",
        "You have reached your specified API usage limits. You will regain access on 2026-01-01.",
    )
    return [(429, openai), (402, billing), (429, spend), (400, limit)]


@pytest.mark.parametrize(
    "case", range(4), ids=["insufficient_quota", "billing", "spend", "usage-limit"]
)
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
async def test_out_of_quota_is_permanent(wire: Any, case: int, stream: bool) -> None:
    code, body = _quota_bodies(wire)[case]
    script = Script(status(code, body, **{"retry-after": "1"}))
    sleeps: list[float] = []
    with pytest.raises(QuotaExceededError) as caught:
        await wire.make(script, sleeps=sleeps).request(REQUEST, on_chunk=Sink() if stream else None)
    error = caught.value
    assert isinstance(error, PermissionDeniedError)
    assert not isinstance(error, RateLimitError)  # code that waits on rate limits must not wait
    assert not error.retryable
    assert error.attempts == 1
    assert error.status == code
    assert sleeps == []
    assert len(script.requests) == 1


_QUOTA_EVENTS = {
    "openai_chat": (
        None,
        {"error": {"message": "quota", "type": "insufficient_quota", "code": "insufficient_quota"}},
    ),
    "openai_compatible": (None, {"error": {"message": "quota", "code": "insufficient_quota"}}),
    "openai_responses": (
        "error",
        {
            "type": "error",
            "sequence_number": 1,
            "code": "insufficient_quota",
            "message": "quota",
            "param": None,
        },
    ),
    "anthropic": (
        "error",
        {"type": "error", "error": {"type": "billing_error", "message": "credit"}},
    ),
    "gemini": (
        None,
        {
            "error": {
                "code": 429,
                "status": "RESOURCE_EXHAUSTED",
                "message": "You exceeded your current quota ... limit: 0",
                "details": [
                    {
                        "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                        "violations": [{"quotaId": "FreeTierRequests", "quotaValue": "0"}],
                    }
                ],
            }
        },
    ),
}


async def test_an_out_of_quota_event_in_a_stream_is_permanent(wire: Any) -> None:
    name, payload = _QUOTA_EVENTS[wire.name]
    body = wire.stream_head + wires.sse((name, payload))
    script = Script(sse_reply(body))
    sleeps: list[float] = []
    with pytest.raises(QuotaExceededError) as caught:
        await wire.make(script, sleeps=sleeps).request(REQUEST, on_chunk=Sink())
    assert caught.value.attempts == 1
    assert sleeps == []
    assert len(script.requests) == 1


async def test_a_plain_rate_limit_is_still_retried(wire: Any) -> None:
    script = Script(
        status(429, wire.error("rate_limit_error", "slow down")), status(200, wire.ok_json)
    )
    response = await wire.make(script).request(REQUEST)
    assert response.attempts == 2
