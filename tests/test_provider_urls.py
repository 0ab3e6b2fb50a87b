"""Base URLs that carry credentials, and redirects, for every adapter.

* a key in a base URL's userinfo (``http://user:KEY@host/v1``) or query
  (``?api-key=KEY``) still reaches the server -- userinfo as an HTTP Basic
  ``Authorization`` header, the query on every request after the endpoint path --
  but never shows: not in the model's ``repr``, not in httpx's INFO line
  ("HTTP Request: POST ..."), not in an error or its cause chain;
* the adapter's own requests never follow a redirect, even through an injected
  client that follows redirects: no credential header goes to another host, and
  a redirect is a clear error naming where it pointed (without credentials).
"""

from __future__ import annotations

import base64
import logging
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus

import _provider_wires as wires
import anyio
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepmachine import (
    Agent,
    ConfigurationError,
    TextPart,
)
from stepmachine.providers import GeminiModel, HTTPModel, ProviderError, RetryPolicy
from stepmachine.providers._errors import redact_text
from stepmachine.providers._urls import MIN_SECRET, _HideSecrets, parse_base_url

KEY = wires.KEY
USER_KEY = "userinfo-secret-DO-NOT-LEAK-42"
QUERY_KEY = "query-secret-DO-NOT-LEAK-43"
WIRES = wires.WIRES
IDS = [w.name for w in WIRES]

BASE_URLS = {
    "userinfo": f"http://proxy:{USER_KEY}@llm.test/v1",
    "query": f"http://llm.test/v1?api-version=2024-10&api-key={QUERY_KEY}",
    "both": f"https://proxy:{USER_KEY}@llm.test:8443/v1/?api-key={QUERY_KEY}",
}
SECRETS = (USER_KEY, QUERY_KEY, KEY)


def _model(wire: Any, base_url: str, handler: Any, **options: Any) -> HTTPModel:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler), **options)
    return wire.factory(
        "test-model",
        api_key=KEY,
        base_url=base_url,
        client=client,
        retry=RetryPolicy(max_attempts=1),
    )


def _shown(error: BaseException) -> str:
    """Everything an error shows: str, repr, args and the formatted chain."""
    parts = [str(error), repr(error), repr(error.args)]
    parts.extend(traceback.format_exception(error))
    cause: BaseException | None = error
    while cause is not None:
        parts.append(repr(cause))
        parts.append(repr(cause.args))
        cause = cause.__cause__ or cause.__context__
    return "\n".join(parts)


async def _ignore(chunk: Any) -> None:
    del chunk


@pytest.mark.parametrize("where", list(BASE_URLS))
@pytest.mark.parametrize("wire", WIRES, ids=IDS)
def test_a_credential_in_the_base_url_is_not_in_the_repr(wire: Any, where: str) -> None:
    model = _model(wire, BASE_URLS[where], lambda r: httpx.Response(200))
    for shown in (repr(model), str(model), model.base_url, model.name):
        assert not [s for s in SECRETS if s in shown], shown
    assert "llm.test" in repr(model)


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
@pytest.mark.parametrize("where", list(BASE_URLS))
@pytest.mark.parametrize("wire", WIRES, ids=IDS)
async def test_a_credential_in_the_base_url_reaches_the_server_and_no_log(
    wire: Any, where: str, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if stream:
            return httpx.Response(
                200, content=wire.ok_sse, headers={"content-type": "text/event-stream"}
            )
        return httpx.Response(200, content=wire.ok_json)

    model = _model(wire, BASE_URLS[where], handler)
    caplog.set_level(logging.DEBUG, logger="httpx")
    with anyio.fail_after(10):
        response = await model.request(wires.REQUEST, on_chunk=_ignore if stream else None)
    assert "".join(p.text for p in response.parts if isinstance(p, TextPart)) == "Hello"
    assert "HTTP Request: POST" in caplog.text  # the line is there, without the secrets
    assert not [s for s in SECRETS if s in caplog.text], caplog.text
    [request] = seen
    assert request.url.host == "llm.test"
    assert not request.url.userinfo
    path = request.url.path
    assert path.startswith("/v1/")
    assert "?" not in path
    assert "api-key" not in path
    if where in ("userinfo", "both"):
        basic = base64.b64encode(f"proxy:{USER_KEY}".encode()).decode()
        assert request.headers["authorization"] == f"Basic {basic}"
    if where in ("query", "both"):
        assert request.url.params["api-key"] == QUERY_KEY
    if where == "query":
        assert request.url.params["api-version"] == "2024-10"
    if wire.name == "gemini" and stream:
        assert request.url.params["alt"] == "sse"


@pytest.mark.parametrize("where", list(BASE_URLS))
@pytest.mark.parametrize("wire", WIRES, ids=IDS)
async def test_a_credential_in_the_base_url_is_not_in_an_error_or_its_causes(
    wire: Any, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"cannot reach {request.url!s} ({request.url!r})", request=request)

    model = _model(wire, BASE_URLS[where], handler)
    caplog.set_level(logging.DEBUG)
    with anyio.fail_after(10), pytest.raises(ProviderError) as caught:
        await model.request(wires.REQUEST)
    shown = _shown(caught.value) + caplog.text
    assert "cannot reach" in shown
    assert not [s for s in SECRETS if s in shown], shown


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
@pytest.mark.parametrize("wire", WIRES, ids=IDS)
async def test_no_request_follows_a_redirect_with_the_key(
    wire: Any, stream: bool, status: int
) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.host == "llm.test":
            return httpx.Response(status, headers={"location": "https://evil.test/collect?x=1"})
        return httpx.Response(200, content=wire.ok_json)

    model = _model(wire, BASE_URLS["userinfo"], handler, follow_redirects=True)
    with anyio.fail_after(10), pytest.raises(ProviderError) as caught:
        await model.request(wires.REQUEST, on_chunk=_ignore if stream else None)
    assert [r.url.host for r in seen] == ["llm.test"]
    message = str(caught.value)
    assert f"HTTP {status}" in message
    assert "redirect" in message
    assert "https://evil.test/collect" in message
    assert "base_url" in message
    assert caught.value.status == status
    assert not caught.value.retryable
    assert not [s for s in SECRETS if s in _shown(caught.value)]


async def test_a_gemini_key_in_the_base_url_query_goes_in_its_header(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Google takes the key as ``?key=`` or ``x-goog-api-key``: the header keeps it out
    of the URL (and of every log of it)."""
    monkeypatch.delenv("GEMINI_API_KEY", raising=False)
    monkeypatch.delenv("GOOGLE_API_KEY", raising=False)
    seen: list[httpx.Request] = []
    gemini = next(w for w in WIRES if w.name == "gemini")

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=gemini.ok_json)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    model = GeminiModel("m", base_url=f"https://g.test/v1beta?key={QUERY_KEY}", client=client)
    caplog.set_level(logging.INFO, logger="httpx")
    with anyio.fail_after(10):
        await model.request(wires.REQUEST)
    [request] = seen
    assert request.headers["x-goog-api-key"] == QUERY_KEY
    assert "key" not in request.url.params
    assert QUERY_KEY not in str(request.url)
    assert QUERY_KEY not in caplog.text
    assert QUERY_KEY not in repr(model)


# -- every query value of a base URL is a secret in what is shown -----------------------

PLAIN_NAME_URL = f"https://llm.test/v1?api-version=2024-10&code={QUERY_KEY}"
"""Azure Functions' ``?code=KEY``, and a short version value under a plain name."""


@pytest.mark.parametrize("wire", WIRES, ids=IDS)
async def test_httpx_shows_each_base_url_parameter_as_name_stars(
    wire: Any, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[httpx.Request] = []

    def ok(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=wire.ok_json)

    model = _model(wire, PLAIN_NAME_URL, ok)
    caplog.set_level(logging.INFO, logger="httpx")
    with anyio.fail_after(10):
        await model.request(wires.REQUEST)
    [request] = seen
    assert request.url.params["code"] == QUERY_KEY  # still sent
    assert request.url.params["api-version"] == "2024-10"
    [line] = [r.getMessage() for r in caplog.records if r.name == "httpx"]
    assert "api-version=***" in line
    assert "code=***" in line
    assert QUERY_KEY not in line
    assert "2024-10" not in line


@pytest.mark.parametrize("wire", WIRES, ids=IDS)
async def test_an_error_hides_a_long_query_value_and_keeps_a_short_plain_one(wire: Any) -> None:
    """Values under a plain name from ``MIN_SECRET`` characters on are secrets; a
    short one (a version) stays, so that the error stays readable."""

    def fail(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"cannot reach {request.url}", request=request)

    model = _model(wire, PLAIN_NAME_URL, fail)
    with anyio.fail_after(10), pytest.raises(ProviderError) as caught:
        await model.request(wires.REQUEST)
    message = str(caught.value)
    assert "api-version=2024-10" in message
    assert "code=***" in message
    assert QUERY_KEY not in _shown(caught.value)


_URL_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)


@settings(deadline=None, max_examples=150)
@given(
    name=_URL_TEXT,
    value=st.text(st.characters(codec="utf-8"), min_size=MIN_SECRET, max_size=48),
    encode=st.sampled_from([quote_plus, lambda v: quote(v, safe="")]),
)
def test_a_long_query_value_shows_in_no_spelling(
    name: str, value: str, encode: Callable[[str], str]
) -> None:
    """Whatever the parameter's name and however the value is spelled in the base
    URL: neither httpx's request line nor an error naming the request URL shows
    it, decoded or percent-encoded."""
    base = parse_base_url(f"https://llm.test/v1?api-version=1&{encode(name)}={encode(value)}")
    assert (name, value) in base.query
    hide = _HideSecrets()  # what hide_in_httpx_log registers, on a filter of its own
    hide.update(base.query_secrets, base.params())
    target = base.target(f"{base.root}/chat/completions")
    record = logging.LogRecord(
        "httpx", logging.INFO, __file__, 0, 'HTTP Request: %s %s "%s"', ("POST", target, "OK"), None
    )
    assert hide.filter(record)
    line = record.getMessage()
    error = redact_text(f"cannot reach {target}", base.secrets)
    forms = {value, quote(value), quote(value, safe=""), quote_plus(value)}
    for shown in (line, error):
        assert not [f for f in forms if f in shown], shown
    assert "api-version=***" in line


# -- at the edges, as a user meets them ----------------------------------------


SECRET = "SECRETTOKEN0123456789abcdef"


@pytest.mark.parametrize(
    "base_url",
    [f"user:{SECRET}@localhost:8000/v1", f"https//user:{SECRET}@llm.example.com/v1"],
)
async def test_a_malformed_base_url_holding_a_token_is_not_echoed(
    base_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A user sets the base URL of an OpenAI-compatible server with credentials in it and
    # forgets "http://" (or writes "https//"). The error must say what is wrong without
    # printing the token (a query-string token is already removed from the same message).
    monkeypatch.setenv("OPENAI_COMPATIBLE_BASE_URL", base_url)
    agent = Agent("openai-compatible:qwen3", store=tmp_path / "db.sqlite3")
    with pytest.raises(ConfigurationError) as caught:
        await agent.run("s1", "hi")
    seen = [caught.value]
    while seen[-1].__cause__ is not None or seen[-1].__context__ is not None:
        seen.append(seen[-1].__cause__ or seen[-1].__context__)  # type: ignore[arg-type]
    assert all(SECRET not in f"{error!s} {error!r}" for error in seen)
