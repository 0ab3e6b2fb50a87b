"""The shared provider base: secrets, the retry policy, error mapping, configuration.

* :class:`Secret` never shows the key: not in a repr or str, not in any model's repr,
  not in any error (str, repr, args, formatted traceback with its causes) of any
  adapter, not in any log record (stdlib logging at DEBUG and structlog);
* :meth:`RetryPolicy.delay`: exponential backoff capped by ``max_delay``, jitter
  within ``[1 - jitter, 1]`` of the full wait (and actually random), the server's
  ``Retry-After`` used as is (capped);
* :func:`error_from_response`: the status/body mapping table, the context-length
  messages of each provider (OpenAI, Responses, Anthropic, llama.cpp, vLLM, Groq),
  ``kind``/``request_id``/``retry_after`` and the retryable flags;
* environment variables as the documented defaults of every adapter (key and base
  URL), arguments overriding them, and the timeouts a model's own client gets.
"""

from __future__ import annotations

import json
import logging
import random
import traceback
from typing import Any

import _provider_wires as wires
import httpx
import pytest
import structlog.testing

from stepmachine import (
    ConfigurationError,
    ContextLengthError,
    Message,
    ModelError,
    ModelRequest,
    providers,
)
from stepmachine.providers import (
    DEFAULT_TIMEOUT,
    AnthropicModel,
    AuthenticationError,
    BadRequestError,
    ContextLengthExceededError,
    MalformedResponseError,
    NotFoundError,
    OpenAIChatModel,
    OpenAICompatibleModel,
    OpenAIResponsesModel,
    OverloadedError,
    PermissionDeniedError,
    ProviderConnectionError,
    ProviderError,
    RateLimitError,
    RetryPolicy,
    Secret,
    ServerError,
)
from stepmachine.providers._errors import error_from_response, parse_retry_after

KEY = wires.KEY
WIRES = wires.WIRES


# -- Secret -----------------------------------------------------------------------------


def test_secret_hides_the_key() -> None:
    secret = Secret(KEY)
    for shown in (repr(secret), str(secret), f"{secret}", f"{secret!r}", "%s" % secret):  # noqa: UP031
        assert KEY not in shown
        assert "***" in shown
    assert secret.reveal() == KEY
    assert secret
    assert not Secret("")
    assert KEY not in repr([secret, {"key": secret}])


@pytest.mark.parametrize("wire", WIRES, ids=[w.name for w in WIRES])
def test_no_model_repr_shows_the_key(wire: Any) -> None:
    model = wire.make(lambda _: httpx.Response(200))
    assert KEY not in repr(model)
    assert KEY not in str(model)
    assert KEY not in repr(model.api_key)
    assert KEY not in model.name


def _everything_shown(error: BaseException) -> str:
    return "\n".join(
        [
            str(error),
            repr(error),
            repr(error.args),
            "".join(traceback.format_exception(error)),
            repr(vars(error)),
        ]
    )


def _echo(status: int) -> Any:
    """A server that echoes the authorization it got (as some proxies do)."""

    def handler(request: httpx.Request) -> httpx.Response:
        sent = request.headers.get("authorization") or request.headers.get("x-api-key") or ""
        body = {"error": {"message": f"Incorrect API key provided: {sent}", "type": "x"}}
        return httpx.Response(status, json=body)

    return handler


@pytest.mark.parametrize("wire", WIRES, ids=[w.name for w in WIRES])
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
async def test_no_error_or_log_line_shows_the_key(
    wire: Any, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"refused {request.url}")

    cases: list[tuple[Any, type[ProviderError]]] = [
        (
            lambda _: httpx.Response(401, json={"error": {"message": "bad key"}}),
            AuthenticationError,
        ),
        (lambda _: httpx.Response(429, json={"error": {"message": "slow"}}), RateLimitError),
        (lambda _: httpx.Response(200, content=b"{broken"), MalformedResponseError),
        (refuse, ProviderConnectionError),
    ]
    caplog.set_level(logging.DEBUG)
    with structlog.testing.capture_logs() as logs:
        for handler, error in cases:
            model = wire.make(handler, retry=RetryPolicy(max_attempts=2))
            sink = None
            if stream:

                async def sink(chunk: Any) -> None:
                    pass

            with pytest.raises(error) as caught:
                await model.request(wires.REQUEST, on_chunk=sink)
            assert KEY not in _everything_shown(caught.value)
    assert KEY not in caplog.text
    assert all(KEY not in repr(entry) for entry in logs)


@pytest.mark.parametrize("wire", WIRES, ids=[w.name for w in WIRES])
async def test_a_server_echoing_the_key_does_not_leak_it_into_the_error(wire: Any) -> None:
    model = wire.make(_echo(401))
    with pytest.raises(AuthenticationError) as caught:
        await model.request(wires.REQUEST)
    assert KEY not in _everything_shown(caught.value)


# -- RetryPolicy.delay ------------------------------------------------------------------


class _Fixed(random.Random):
    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


def test_default_policy() -> None:
    policy = RetryPolicy()
    assert policy.max_attempts >= 2
    assert 0 < policy.base_delay <= policy.max_delay <= policy.total_timeout
    assert 0 <= policy.jitter < 1


@pytest.mark.parametrize("attempt", [1, 2, 3, 4, 5, 6, 10, 30])
def test_backoff_doubles_up_to_max_delay_without_jitter(attempt: int) -> None:
    policy = RetryPolicy(base_delay=0.5, max_delay=8.0, jitter=0.0)
    assert policy.delay(attempt, None, random.Random(1)) == min(8.0, 0.5 * 2 ** (attempt - 1))


@pytest.mark.parametrize("attempt", [1, 2, 3, 7, 12])
def test_jitter_bounds(attempt: int) -> None:
    policy = RetryPolicy(base_delay=1.0, max_delay=20.0, jitter=0.25)
    full = min(20.0, 2.0 ** (attempt - 1))
    assert policy.delay(attempt, None, _Fixed(0.0)) == full
    assert policy.delay(attempt, None, _Fixed(0.999999)) == pytest.approx(full * 0.75, rel=1e-5)
    rng = random.Random(3)
    waits = [policy.delay(attempt, None, rng) for _ in range(200)]
    assert all(full * 0.75 <= w <= full for w in waits)
    assert len(set(waits)) > 100  # actually random: retries of many clients spread out
    assert max(waits) - min(waits) > full * 0.2


def test_retry_after_wins_without_jitter_and_is_capped() -> None:
    policy = RetryPolicy(base_delay=0.5, max_delay=30.0, jitter=0.5)
    assert policy.delay(1, 2.0, _Fixed(0.9)) == 2.0
    assert policy.delay(5, 0.0, _Fixed(0.9)) == 0.0
    assert policy.delay(1, 3600.0, _Fixed(0.9)) == 30.0


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({"retry-after": "2"}, 2.0),
        ({"retry-after": "0.5"}, 0.5),
        ({"retry-after-ms": "1500"}, 1.5),
        ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),
        ({"retry-after-ms": "soon", "retry-after": "9"}, 9.0),
        ({"retry-after": "-3"}, None),  # not a wait: the backoff applies
        ({"retry-after": "0"}, None),
        ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, None),  # now: the backoff applies
        ({"retry-after": "Wed, 21 Oct 2015 07:28:30 GMT"}, 30.0),  # 30 s after "now"
        ({"retry-after": "not a date"}, None),
        ({"retry-after": "inf"}, None),
        ({"retry-after": "nan"}, None),
        ({"retry-after-ms": "nan", "retry-after": "4"}, 4.0),
        ({}, None),
    ],
)
def test_parse_retry_after(headers: dict[str, str], seconds: float | None) -> None:
    now = 1445412480.0  # Wed, 21 Oct 2015 07:28:00 GMT
    assert parse_retry_after(httpx.Headers(headers), now=now) == seconds


# -- error_from_response ----------------------------------------------------------------


def _openai(message: str, kind: str = "invalid_request_error", code: Any = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}
    ).encode()


def _anthropic(message: str, kind: str) -> bytes:
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


MAPPING = [
    (401, _openai("Incorrect API key provided", code="invalid_api_key"), AuthenticationError),
    (401, _anthropic("invalid x-api-key", "authentication_error"), AuthenticationError),
    (403, _anthropic("no access", "permission_error"), PermissionDeniedError),
    (404, _openai("The model `x` does not exist", code="model_not_found"), NotFoundError),
    (404, _anthropic("model: x", "not_found_error"), NotFoundError),
    (
        400,
        _openai("Unsupported value: 'messages[0].role'", code="unsupported_value"),
        BadRequestError,
    ),
    (422, b'{"detail": "bad"}', BadRequestError),
    (429, _openai("Rate limit reached", "requests", "rate_limit_exceeded"), RateLimitError),
    (429, _anthropic("rate limited", "rate_limit_error"), RateLimitError),
    (429, b'{"error": {"code": 429, "message": "Provider returned error"}}', RateLimitError),
    (503, _openai("The engine is currently overloaded", "server_error"), OverloadedError),
    (529, _anthropic("Overloaded", "overloaded_error"), OverloadedError),
    (500, _openai("The server had an error", "server_error"), ServerError),
    (502, b"<html><body>Bad gateway</body></html>", ServerError),
    (500, b"", ServerError),
]


@pytest.mark.parametrize(("status", "body", "error"), MAPPING)
def test_mapping(status: int, body: bytes, error: type[ProviderError]) -> None:
    made = error_from_response("p", status, body, httpx.Headers())
    assert type(made) is error
    assert made.status == status
    assert made.provider == "p"
    assert made.attempts == 1
    assert isinstance(made, ModelError)
    assert str(status) in str(made)


CONTEXT_LENGTH = [
    # OpenAI Chat Completions
    (
        400,
        _openai(
            "This model's maximum context length is 128000 tokens. However, your messages "
            "resulted in 130123 tokens. Please reduce the length of the messages.",
            code="context_length_exceeded",
        ),
    ),
    # OpenAI Responses API
    (
        400,
        _openai(
            "Your input exceeds the context window of this model. Please adjust your input "
            "and try again.",
            code="context_length_exceeded",
        ),
    ),
    # Anthropic
    (
        400,
        _anthropic("prompt is too long: 210000 tokens > 200000 maximum", "invalid_request_error"),
    ),
    # llama.cpp llama-server (HTTP 500!)
    (
        500,
        b'{"error":{"code":500,"message":"Context size has been exceeded.","type":"server_error"}}',
    ),
    # vLLM
    (
        400,
        (
            b'{"object":"error","message":"This model\'s maximum context length is 2048 tokens. '
            b'However, you requested 4096 tokens.","type":"BadRequestError","param":null,'
            b'"code":400}'
        ),
    ),
    # Groq
    (
        400,
        _openai(
            "Please reduce the length of the messages or completion.",
            code="context_length_exceeded",
        ),
    ),
    # a code alone
    (400, _openai("too big", code="context_length_exceeded")),
]


@pytest.mark.parametrize(("status", "body"), CONTEXT_LENGTH)
def test_context_length_messages_of_each_provider(status: int, body: bytes) -> None:
    made = error_from_response("p", status, body, httpx.Headers())
    assert type(made) is ContextLengthExceededError
    assert isinstance(made, BadRequestError)
    assert isinstance(made, ContextLengthError)  # what compaction reacts to
    assert not made.retryable


def test_kind_message_request_id_and_retry_after() -> None:
    made = error_from_response(
        "openai",
        429,
        _openai("Rate limit reached for gpt-4o", "requests", "rate_limit_exceeded"),
        httpx.Headers({"x-request-id": "req_123", "retry-after": "7"}),
    )
    assert isinstance(made, RateLimitError)
    assert made.kind == "rate_limit_exceeded"  # the code when present, else the type
    assert made.request_id == "req_123"
    assert made.retry_after == 7.0
    assert "Rate limit reached for gpt-4o" in str(made)
    assert "req_123" in str(made)
    anthropic = error_from_response(
        "anthropic",
        529,
        _anthropic("Overloaded", "overloaded_error"),
        httpx.Headers({"request-id": "req_9", "retry-after": "3"}),
    )
    assert isinstance(anthropic, OverloadedError)
    assert anthropic.kind == "overloaded_error"
    assert anthropic.request_id == "req_9"
    assert anthropic.retry_after == 3.0
    openrouter = error_from_response(
        "openai_compatible",
        429,
        b'{"error": {"code": 429, "message": "upstream"}}',
        httpx.Headers(),
    )
    assert openrouter.kind == 429
    assert openrouter.request_id is None


def test_an_overloaded_error_type_is_overloaded_whatever_the_status() -> None:
    made = error_from_response("anthropic", 500, _anthropic("Overloaded", "overloaded_error"), {})
    assert type(made) is OverloadedError


def test_non_json_bodies_keep_a_short_message() -> None:
    made = error_from_response("p", 502, b"<html>" + b"x" * 5000 + b"</html>", httpx.Headers())
    assert type(made) is ServerError
    assert len(str(made)) < 700
    empty = error_from_response("p", 500, b"", httpx.Headers())
    assert "no error body" in str(empty)


def test_retryable_flags() -> None:
    retryable = {RateLimitError, OverloadedError, ServerError, ProviderConnectionError}
    never = {AuthenticationError, PermissionDeniedError, NotFoundError, BadRequestError}
    assert all(c.retryable for c in retryable)
    assert not any(c.retryable for c in never)
    assert not ContextLengthExceededError.retryable
    assert MalformedResponseError.retryable  # but never once output was streamed


# -- configuration from the environment -------------------------------------------------

_ENV = [
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_BASE_URL",
    "OPENAI_COMPATIBLE_API_KEY",
    "OPENAI_COMPATIBLE_BASE_URL",
]

_BY_ENV = [
    (OpenAIChatModel, "OPENAI_API_KEY", "OPENAI_BASE_URL", "/chat/completions"),
    (OpenAIResponsesModel, "OPENAI_API_KEY", "OPENAI_BASE_URL", "/responses"),
    (AnthropicModel, "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "/messages"),
    (
        OpenAICompatibleModel,
        "OPENAI_COMPATIBLE_API_KEY",
        "OPENAI_COMPATIBLE_BASE_URL",
        "/chat/completions",
    ),
]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _sent_key(request: httpx.Request) -> str:
    if "x-api-key" in request.headers:
        return request.headers["x-api-key"]
    return request.headers.get("authorization", "").removeprefix("Bearer ")


@pytest.mark.parametrize(
    ("cls", "key_var", "url_var", "path"), _BY_ENV, ids=[c[0].__name__ for c in _BY_ENV]
)
async def test_environment_variables_are_the_defaults(
    clean_env: pytest.MonkeyPatch, cls: Any, key_var: str, url_var: str, path: str
) -> None:
    clean_env.setenv(key_var, "env-key")
    clean_env.setenv(url_var, "https://env.example/v1/")
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(500, json={"error": {"message": "stop here"}})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        model = cls("m", client=client, retry=RetryPolicy(max_attempts=1))
        assert model.base_url == "https://env.example/v1"
        assert model.api_key.reveal() == "env-key"
        with pytest.raises(ServerError):
            await model.request(wires.REQUEST)
    assert str(seen[0].url) == f"https://env.example/v1{path}"
    assert _sent_key(seen[0]) == "env-key"


@pytest.mark.parametrize(
    ("cls", "key_var", "url_var", "path"), _BY_ENV, ids=[c[0].__name__ for c in _BY_ENV]
)
def test_arguments_override_the_environment(
    clean_env: pytest.MonkeyPatch, cls: Any, key_var: str, url_var: str, path: str
) -> None:
    clean_env.setenv(key_var, "env-key")
    clean_env.setenv(url_var, "https://env.example/v9")
    model = cls("m", api_key="arg-key", base_url="https://arg.example/v1")
    assert model.api_key.reveal() == "arg-key"
    assert model.base_url == "https://arg.example/v1"
    assert model._url() == f"https://arg.example/v1{path}"
    assert "env-key" not in repr(model)


@pytest.mark.parametrize(
    ("cls", "default"),
    [
        (OpenAIChatModel, "https://api.openai.com/v1"),
        (OpenAIResponsesModel, "https://api.openai.com/v1"),
        (AnthropicModel, "https://api.anthropic.com/v1"),
    ],
)
def test_default_base_urls(clean_env: pytest.MonkeyPatch, cls: Any, default: str) -> None:
    assert cls("m", api_key="k").base_url == default


def test_anthropic_base_url_from_the_sdk_form(clean_env: pytest.MonkeyPatch) -> None:
    # documented: Anthropic's SDKs write the variable without the version
    clean_env.setenv("ANTHROPIC_BASE_URL", "https://proxy.example")
    assert AnthropicModel("m", api_key="k").base_url == "https://proxy.example/v1"


def test_openai_compatible_needs_a_base_url(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigurationError, match="OPENAI_COMPATIBLE_BASE_URL"):
        OpenAICompatibleModel("m")
    model = OpenAICompatibleModel("m", base_url="http://localhost:11434/v1")
    assert not model.api_key  # a local server needs no key
    assert "authorization" not in {k.lower() for k in model.auth_headers()}


async def test_own_client_uses_model_timeouts_and_is_closed(clean_env: pytest.MonkeyPatch) -> None:
    assert DEFAULT_TIMEOUT.read is not None
    assert DEFAULT_TIMEOUT.read >= 60  # model replies take long; not httpx's 5 s default
    for cls in (OpenAIChatModel, OpenAIResponsesModel, AnthropicModel):
        model = cls("m", api_key="k")
        assert model.client.timeout == DEFAULT_TIMEOUT
        async with model:
            pass
        assert model.client.is_closed


async def test_an_injected_client_is_not_closed(clean_env: pytest.MonkeyPatch) -> None:
    async with httpx.AsyncClient() as client:
        for cls in (OpenAIChatModel, OpenAIResponsesModel, AnthropicModel):
            model = cls("m", api_key="k", client=client)
            await model.aclose()
            assert not client.is_closed


# -- failures around the HTTP exchange ---------------------------------------------------


def _walk(error: BaseException) -> list[BaseException]:
    """The error and every exception chained to it."""
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


@pytest.mark.parametrize("wire", WIRES, ids=[w.name for w in WIRES])
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
async def test_a_connection_error_carries_no_request_and_no_key(wire: Any, stream: bool) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    model = wire.make(refuse, retry=RetryPolicy(max_attempts=1))
    with pytest.raises(ProviderConnectionError) as caught:
        await model.request(wires.REQUEST, on_chunk=(lambda c: _noop()) if stream else None)
    chain = _walk(caught.value)
    assert len(chain) == 1  # nothing chained: no httpx.Request, whose headers hold the key
    assert KEY not in repr(vars(caught.value))
    assert "ConnectError" in str(caught.value)


async def _noop() -> None:
    return None


@pytest.mark.parametrize("wire", WIRES, ids=[w.name for w in WIRES])
async def test_the_callers_own_chunk_error_propagates_unchanged(wire: Any) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200, content=wire.ok_sse, headers={"content-type": "text/event-stream"}
        )

    class BoomError(Exception):
        pass

    async def sink(chunk: Any) -> None:
        raise BoomError("the UI crashed")

    model = wire.make(handler)
    with pytest.raises(BoomError, match="the UI crashed"):
        await model.request(wires.REQUEST, on_chunk=sink)


@pytest.mark.parametrize("wire", WIRES, ids=[w.name for w in WIRES])
async def test_an_undecodable_body_is_a_malformed_response(wire: Any) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200,
            content=b"this is not gzip",
            headers={"content-type": "application/json", "content-encoding": "gzip"},
        )

    model = wire.make(handler, retry=RetryPolicy(max_attempts=1))
    with pytest.raises(MalformedResponseError):
        await model.request(wires.REQUEST)


@pytest.mark.parametrize("status", [408, 409])
def test_timeouts_and_lock_conflicts_are_retryable(status: int) -> None:
    error = error_from_response("openai", status, _openai("try again"), httpx.Headers())
    assert error.retryable
    assert error.status == status


@pytest.mark.parametrize("wire", WIRES, ids=[w.name for w in WIRES])
async def test_an_injected_client_gets_the_models_timeout(wire: Any) -> None:
    seen: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.extensions.get("timeout"))
        return httpx.Response(
            200, content=wire.ok_json, headers={"content-type": "application/json"}
        )

    model = wire.make(handler)
    await model.request(wires.REQUEST)
    (timeout,) = seen
    assert timeout["read"] == DEFAULT_TIMEOUT.read  # not httpx's 5 s default


# -- at the edges, as a user meets them ----------------------------------------


_KEY_VARIABLES = (
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_BASE_URL",
    "GEMINI_API_KEY",
    "GOOGLE_API_KEY",
    "GEMINI_BASE_URL",
)


@pytest.mark.parametrize(
    ("adapter", "model"),
    [
        ("OpenAIResponsesModel", "gpt-5-mini"),
        ("AnthropicModel", "claude-haiku-4-5"),
        ("GeminiModel", "gemini-2.5-flash"),
    ],
)
async def test_a_missing_key_is_refused_before_a_request_is_sent(
    adapter: str, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in _KEY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    sent: list[str] = []

    def provider(request: httpx.Request) -> httpx.Response:
        sent.append(str(request.url))
        return httpx.Response(401, json={"error": {"message": "no key", "type": "auth"}})

    async with httpx.AsyncClient(transport=httpx.MockTransport(provider)) as client:
        made = getattr(providers, adapter)(model, client=client)
        with pytest.raises(ConfigurationError, match="_API_KEY"):
            await made.request(ModelRequest(messages=[Message.user("hi", id="u1")]))
    assert sent == []


async def test_a_404_from_a_wrong_base_url_names_what_was_requested(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def server(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, text="404 page not found")

    monkeypatch.delenv("OPENAI_COMPATIBLE_API_KEY", raising=False)
    async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as client:
        model = providers.OpenAICompatibleModel(
            "qwen3", base_url="http://localhost:11434/v1/chat/completions", client=client
        )
        with pytest.raises(providers.NotFoundError) as caught:
            await model.request(ModelRequest(messages=[Message.user("hi", id="u1")]))
    assert "/chat/completions/chat/completions" in str(caught.value) or "base_url" in str(
        caught.value
    )
