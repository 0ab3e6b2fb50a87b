"""Invariant 12 on every error path of every adapter: the API key never escapes.

A server (or a proxy in front of it) that echoes the credential it received puts
it wherever it likes: an error message, ``code``, ``type`` or a nested field of an
HTTP error body, a malformed reply, a malformed stream chunk (``["Bearer <key>"]``),
a token count that is not an integer, a request-id header, the text of a
connection error or timeout. For each adapter (OpenAI Chat, OpenAI-compatible,
OpenAI Responses, Anthropic), blocking and streaming, the error that comes out
must not show the key anywhere:

* ``str``, ``repr``, ``args``, notes and attributes (``vars``, one level into
  each attribute) of the error and of every exception on its whole
  ``__cause__``/``__context__`` chain;
* ``traceback.format_exception``, a stdlib log record at DEBUG with
  ``exc_info`` (what ``logging.exception`` prints), structlog's
  ``format_exc_info`` and ``dict_tracebacks`` (which renders frame locals);
* any log record emitted meanwhile (stdlib logging at DEBUG and structlog);
* through ``machine.run()`` as well.

"Anywhere" includes a copy cut short: no 12 characters of the key in a row.
The scenarios are generated (hypothesis): each recorded-shape body or event has a
random node replaced by a value echoing the key, is cut after it, or is an error
body of a random status whose fields echo it; and named regressions pin the
cases the issue reported.
"""

from __future__ import annotations

import io
import json
import logging
import traceback
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import _provider_wires as wires
import anyio
import httpx
import pytest
import structlog
import structlog.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import (
    ConfigurationError,
    Message,
    ModelInference,
    ModelResponse,
    Runtime,
    StateMachine,
)
from stepmachine.providers import (
    AuthenticationError,
    BadRequestError,
    HTTPModel,
    MalformedResponseError,
    ProviderConnectionError,
    ProviderError,
    RetryPolicy,
)
from stepmachine.stores import MemoryStore

KEY = wires.KEY
WIRES = {w.name: w for w in wires.WIRES}
WINDOW = 12


def _leaks(text: str) -> bool:
    """Whether ``text`` holds the key, or any 12 characters of it in a row."""
    return any(KEY[i : i + WINDOW] in text for i in range(len(KEY) - WINDOW + 1))


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and every exception on its cause/context chain (both links, recursively)."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo.extend(e for e in (current.__cause__, current.__context__) if e is not None)


def _everything_shown(error: BaseException) -> str:
    out: list[str] = []
    for current in _chain(error):
        out += [str(current), repr(current), repr(current.args)]
        out.append(repr(getattr(current, "__notes__", None)))
        for name, value in vars(current).items():
            out += [name, repr(value)]
            inner = getattr(value, "__dict__", None)
            if inner is not None:
                out.append(repr(inner))
    out.append("".join(traceback.format_exception(error)))
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("tests.provider_secrets")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        logger.debug("the call failed", exc_info=error)
    finally:
        logger.removeHandler(handler)
    out.append(stream.getvalue())
    for processor in (structlog.processors.format_exc_info, structlog.processors.dict_tracebacks):
        out.append(repr(processor(None, "error", {"event": "failed", "exc_info": error})))
    return "\n".join(out)


def _assert_hidden(error: BaseException, what: str) -> None:
    shown = _everything_shown(error)
    assert not _leaks(shown), f"{what}: the key shows:\n{shown}"


def _sent(request: httpx.Request) -> str:
    """The credential header value the adapter sent (``Bearer <key>`` or the bare key)."""
    return request.headers.get("authorization") or request.headers.get("x-api-key") or ""


# -- what a hostile server answers -------------------------------------------------------


def _poison(sent: str, form: int) -> Any:
    """A JSON value echoing the credential, in one of several shapes."""
    shapes: list[Any] = [
        sent,
        [sent],
        {"key": sent},
        f"Incorrect API key provided: {sent}.",
        [{"nested": [sent, 1]}],
        "x" * 470 + sent,  # cut by a 500-character message limit in the middle of the key
        KEY,
    ]
    return shapes[form % len(shapes)]


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*prefix, index))


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {k: (_replace(v, rest, new) if k == head else v) for k, v in value.items()}
    return [(_replace(v, rest, new) if i == head else v) for i, v in enumerate(value)]


def _events(sse: bytes) -> list[tuple[str | None, Any]]:
    """(event name, payload) of each event of a hand-written stream."""
    out: list[tuple[str | None, Any]] = []
    for block in sse.decode().split("\n\n"):
        if not block.strip():
            continue
        name = None
        data = ""
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = line[len("data: ") :]
        out.append((name, data if data == "[DONE]" else json.loads(data)))
    return out


Responder = Callable[[httpx.Request], httpx.Response]


@st.composite
def hostile(draw: st.DrawFn, wire: wires.Wire, stream: bool) -> tuple[str, Responder]:
    """(a description, a handler) answering with a key-echoing failure."""
    form = draw(st.integers(0, 20))
    kind = draw(
        st.sampled_from(["error status", "poisoned reply", "cut reply", "transport", "broken"])
    )
    status = draw(st.sampled_from([400, 401, 402, 403, 404, 408, 409, 413, 422, 429, 500, 503]))
    if kind == "error status":
        base = json.loads(wire.error(draw(st.sampled_from(["x", "invalid_request_error"])), "m"))
        paths = list(_paths(base))
        chosen = draw(st.lists(st.sampled_from(paths), min_size=1, max_size=3))
        echo_header = draw(st.booleans())

        def error_status(request: httpx.Request) -> httpx.Response:
            body = base
            for path in chosen:
                body = _replace(body, path, _poison(_sent(request), form))
            headers = {"x-request-id": _sent(request)} if echo_header else {}
            return httpx.Response(status, json=body, headers=headers)

        return f"{status} with {chosen} echoing the key (form {form})", error_status

    if kind in ("poisoned reply", "cut reply"):
        if stream:
            events = _events(wire.ok_sse)
            index = draw(st.integers(0, len(events) - 1))
            name, payload = events[index]
            path = draw(st.sampled_from(list(_paths(payload))))

            def poisoned_stream(request: httpx.Request) -> httpx.Response:
                poisoned = _replace(payload, path, _poison(_sent(request), form))
                data = json.dumps(poisoned)
                if kind == "cut reply":
                    data = data[: data.find(KEY) + len(KEY) + 2]
                chunks = [
                    (f"event: {n}\n" if n else "")
                    + f"data: {p if p == '[DONE]' else json.dumps(p)}"
                    for n, p in events
                ]
                chunks[index] = (f"event: {name}\n" if name else "") + f"data: {data}"
                body = "\n\n".join(chunks) + "\n\n"
                return httpx.Response(
                    200, content=body.encode(), headers={"content-type": "text/event-stream"}
                )

            return f"event {index} ({name}) with {path} echoing the key ({kind})", poisoned_stream
        reply = json.loads(wire.ok_json)
        path = draw(st.sampled_from(list(_paths(reply))))

        def poisoned_reply(request: httpx.Request) -> httpx.Response:
            data = json.dumps(_replace(reply, path, _poison(_sent(request), form)))
            if kind == "cut reply":
                data = data[: data.find(KEY) + len(KEY) + 2]
            return httpx.Response(
                200, content=data.encode(), headers={"content-type": "application/json"}
            )

        return f"reply with {path} echoing the key ({kind})", poisoned_reply

    if kind == "transport":
        error_type = draw(
            st.sampled_from(
                [
                    httpx.ConnectError,
                    httpx.ConnectTimeout,
                    httpx.ReadTimeout,
                    httpx.PoolTimeout,
                    httpx.RemoteProtocolError,
                    httpx.LocalProtocolError,
                    httpx.ReadError,
                ]
            )
        )

        def transport(request: httpx.Request) -> httpx.Response:
            # h11 words its header errors like this: the whole header value, as bytes
            raise error_type(f"Illegal header value {_sent(request).encode()!r}", request=request)

        return f"{error_type.__name__} echoing the header", transport

    def broken(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200,
            stream=_Broken(wire.stream_head if stream else b"", _sent(request)),
            headers={"content-type": "text/event-stream" if stream else "application/json"},
        )

    return "a body that breaks off with an error echoing the key", broken


class _Broken(httpx.AsyncByteStream):
    def __init__(self, head: bytes, sent: str) -> None:
        self.head = head
        self.sent = sent

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.head:
            yield self.head
        raise httpx.ReadError(f"connection reset while sending {self.sent}")


async def _noop(chunk: Any) -> None:
    return None


async def _outcome(model: Any, stream: bool) -> Any:
    """The response or the exception of one request (few locals: frames are rendered)."""
    try:
        return await model.request(wires.REQUEST, on_chunk=_noop if stream else None)
    except Exception as exc:
        return exc


SECRETS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.parametrize("provider", list(WIRES))
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
@SECRETS
@given(data=st.data())
async def test_no_error_path_shows_the_key(
    anyio_backend: str, provider: str, stream: bool, data: st.DataObject
) -> None:
    wire = WIRES[provider]
    what, handler = data.draw(hostile(wire, stream))
    model = wire.make(handler, retry=RetryPolicy(max_attempts=2))
    stdlib = io.StringIO()
    log_handler = logging.StreamHandler(stdlib)
    root = logging.getLogger()
    root.addHandler(log_handler)
    level = root.level
    root.setLevel(logging.DEBUG)
    try:
        with structlog.testing.capture_logs() as logs:
            outcome = await _outcome(model, stream)
    finally:
        root.removeHandler(log_handler)
        root.setLevel(level)
        await model.client.aclose()
    assert not _leaks(stdlib.getvalue()), what
    assert not _leaks(repr(logs)), what
    if isinstance(outcome, ModelResponse):
        return  # the echo landed in content (text, a tool argument): the reply, not an error
    assert isinstance(outcome, ProviderError), f"{what}: {outcome!r}"
    _assert_hidden(outcome, what)


# -- the cases the issue reported ----------------------------------------------------------


def _sse(wire: wires.Wire, *payloads: str) -> Responder:
    body = wire.stream_head + "".join(f"data: {p}\n\n" for p in payloads).encode()
    return lambda _: httpx.Response(
        200, content=body, headers={"content-type": "text/event-stream"}
    )


@pytest.mark.parametrize("provider", list(WIRES))
async def test_a_chunk_echoing_the_bearer_header_leaves_no_trace(provider: str) -> None:
    wire = WIRES[provider]
    model = wire.make(_sse(wire, json.dumps([f"Bearer {KEY}"])), retry=RetryPolicy(max_attempts=1))
    outcome = await _outcome(model, stream=True)
    assert isinstance(outcome, MalformedResponseError)
    _assert_hidden(outcome, "a chunk that is a JSON array echoing the header")


async def test_an_anthropic_token_count_echoing_the_key_leaves_no_trace() -> None:
    wire = WIRES["anthropic"]
    reply = json.loads(wire.ok_json)
    reply["usage"]["input_tokens"] = {"x-api-key": KEY}
    model = wire.make(lambda _: httpx.Response(200, json=reply), retry=RetryPolicy(max_attempts=1))
    outcome = await _outcome(model, stream=False)
    assert isinstance(outcome, MalformedResponseError)
    _assert_hidden(outcome, "a token count that is an object echoing the key")


@pytest.mark.parametrize("provider", list(WIRES))
@pytest.mark.parametrize("code", [[f"Bearer {KEY}"], {"key": KEY}, [1, [KEY]]])
async def test_an_error_code_that_is_not_a_string_is_not_kept(provider: str, code: Any) -> None:
    wire = WIRES[provider]
    body = {"type": "error", "error": {"message": "no", "type": "invalid_request_error"}}
    body["error"]["code"] = code
    model = wire.make(lambda _: httpx.Response(400, json=body), retry=RetryPolicy(max_attempts=1))
    outcome = await _outcome(model, stream=False)
    assert isinstance(outcome, BadRequestError)
    assert outcome.kind == "invalid_request_error"  # the type, as the code is no string
    _assert_hidden(outcome, "a list/object code echoing the key")


@pytest.mark.parametrize("provider", list(WIRES))
async def test_a_credential_header_among_the_extra_headers_is_hidden_too(provider: str) -> None:
    token = "tok-EXTRA-HEADER-SECRET-42"

    def echo(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"error": {"message": request.headers["api-key"]}})

    model = WIRES[provider].make(echo, headers={"api-key": token, "x-app": "demo"})
    outcome = await _outcome(model, stream=False)
    assert isinstance(outcome, AuthenticationError)
    assert token not in _everything_shown(outcome)


@pytest.mark.parametrize("provider", list(WIRES))
@pytest.mark.parametrize(
    ("key", "what"),
    [
        (KEY + "\n", "a control character"),
        (KEY + "é", "a non-ASCII character"),
        (f" {KEY}", "space"),
    ],
)
def test_a_key_no_header_can_carry_is_refused_without_showing_it(
    provider: str, key: str, what: str
) -> None:
    wire = WIRES[provider]
    with pytest.raises(ConfigurationError, match=what) as caught:
        wire.factory("m", api_key=key, base_url="https://llm.test/v1")
    # (frame locals are not checked here: the caller's own frame holds the key it passed)
    error = caught.value
    shown = [str(error), repr(error), repr(vars(error)), *traceback.format_exception(error)]
    assert not _leaks("".join(shown))


@pytest.mark.parametrize("provider", list(WIRES))
async def test_a_cause_is_kept_redacted_and_says_where_it_was_raised(provider: str) -> None:
    wire = WIRES[provider]
    model = wire.make(_sse(wire, json.dumps([f"Bearer {KEY}"])), retry=RetryPolicy(max_attempts=1))
    outcome = await _outcome(model, stream=True)
    chained = [e for e in _chain(outcome) if e is not outcome]
    assert chained, "the parser's error is still chained, redacted"
    formatted = "".join(traceback.format_exception(outcome))
    assert "raised at" in formatted


# -- through machine.run() ------------------------------------------------------------------


def _echo_everything(request: httpx.Request) -> httpx.Response:
    sent = _sent(request)
    return httpx.Response(
        429,
        json={"error": {"message": f"slow down {sent}", "code": [sent], "type": sent}},
        headers={"x-request-id": sent, "retry-after": "1"},
    )


@pytest.mark.parametrize("provider", list(WIRES))
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
async def test_an_error_through_machine_run_shows_no_key(
    provider: str, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    store = MemoryStore()
    await store.create("s1", conversation=[Message.user("hello", id="u1")])
    model = WIRES[provider].make(_echo_everything, retry=RetryPolicy(max_attempts=2))
    machine = StateMachine([ModelInference(stream=stream)])
    with structlog.testing.capture_logs() as logs:
        error = await _run(machine, Runtime(store=store, model=model))
    assert isinstance(error, ProviderError)
    assert error.attempts == 2
    _assert_hidden(error, "through machine.run()")
    assert not _leaks(caplog.text)
    assert not _leaks(repr(logs))


async def _run(machine: StateMachine[Any], runtime: Runtime) -> BaseException | None:
    try:
        await machine.run(runtime, "s1")
    except Exception as exc:
        return exc
    return None


@pytest.mark.parametrize("provider", list(WIRES))
async def test_a_connection_error_through_machine_run_shows_no_key(provider: str) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"refused {_sent(request)!r}", request=request)

    store = MemoryStore()
    await store.create("s1", conversation=[Message.user("hello", id="u1")])
    model = WIRES[provider].make(refuse, retry=RetryPolicy(max_attempts=1))
    error = await _run(StateMachine([ModelInference()]), Runtime(store=store, model=model))
    assert isinstance(error, ProviderConnectionError)
    _assert_hidden(error, "a connection error through machine.run()")


# -- providers: credentials in base URLs ------------------------------------------------

URL_WIRES = list(WIRES.values())
IDS = list(WIRES)
SAS_SIG = "AbC+dEf/GhI=jKl0123456789=="  # an Azure SAS signature: base64, so it percent-encodes
PLAIN = "plainsecret-DO-NOT-LEAK-77"


def _model(wire: Any, base_url: str, handler: Any) -> HTTPModel:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return wire.factory(
        "test-model",
        api_key=wires.KEY,
        base_url=base_url,
        client=client,
        retry=RetryPolicy(max_attempts=1),
    )


def _shown(error: BaseException) -> str:
    parts = [str(error), repr(error), repr(error.args)]
    parts.extend(traceback.format_exception(error))
    cause: BaseException | None = error
    while cause is not None:
        parts.append(repr(cause))
        cause = cause.__cause__ or cause.__context__
    return "\n".join(parts)


def _forms(secret: str) -> list[str]:
    from urllib.parse import quote, quote_plus

    return sorted({secret, quote(secret, safe=""), quote_plus(secret)})


@pytest.mark.parametrize("wire", URL_WIRES, ids=IDS)
async def test_a_percent_encoded_query_key_is_not_in_httpx_log(
    wire: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from urllib.parse import quote

    url = f"https://llm.test/v1?api-version=1&sig={quote(SAS_SIG, safe='')}"
    model = _model(wire, url, lambda r: httpx.Response(200, content=wire.ok_json))
    caplog.set_level(logging.DEBUG, logger="httpx")
    with anyio.fail_after(10):
        await model.request(wires.REQUEST)
    assert "HTTP Request: POST" in caplog.text
    leaked = [f for f in _forms(SAS_SIG) if f in caplog.text]
    assert not leaked, caplog.text


@pytest.mark.parametrize("wire", URL_WIRES, ids=IDS)
async def test_a_percent_encoded_query_key_is_not_in_an_error(wire: Any) -> None:
    from urllib.parse import quote

    url = f"https://llm.test/v1?sig={quote(SAS_SIG, safe='')}"

    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"cannot reach {request.url}", request=request)

    model = _model(wire, url, handler)
    with anyio.fail_after(10), pytest.raises(ProviderError) as caught:
        await model.request(wires.REQUEST)
    shown = _shown(caught.value)
    assert "cannot reach" in shown
    assert not [f for f in _forms(SAS_SIG) if f in shown], shown


@pytest.mark.parametrize("wire", URL_WIRES, ids=IDS)
async def test_a_key_under_an_unknown_query_name_is_not_in_httpx_log(
    wire: Any, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"https://fn.test/api?code={PLAIN}"
    model = _model(wire, url, lambda r: httpx.Response(200, content=wire.ok_json))
    caplog.set_level(logging.DEBUG, logger="httpx")
    with anyio.fail_after(10):
        await model.request(wires.REQUEST)
    assert "HTTP Request: POST" in caplog.text
    assert PLAIN not in caplog.text, caplog.text


@pytest.mark.parametrize(
    "url",
    [
        f"https://llm.test/v1?API-KEY={PLAIN}",
        f"https://llm.test/v1?X-Api-Key={PLAIN}&api-version=1",
        f"https://llm.test/v1#{PLAIN}",
        f"http://u:{PLAIN}@[::1]:8080/v1",
        f"http://u:{PLAIN.replace('-', '%2D')}@llm.test/v1",
        f"http://{PLAIN}@llm.test/v1",
    ],
    ids=["upper-API-KEY", "X-Api-Key", "fragment", "ipv6-userinfo", "pct-userinfo", "user-only"],
)
@pytest.mark.parametrize("wire", URL_WIRES, ids=IDS)
async def test_other_credential_shapes_are_not_shown(
    wire: Any, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Upper-case names, a fragment, an IPv6 host, percent-encoded userinfo: the key
    shows nowhere (repr, httpx log, an error naming the URL)."""
    seen: list[httpx.Request] = []

    def ok(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=wire.ok_json)

    model = _model(wire, url, ok)
    caplog.set_level(logging.DEBUG, logger="httpx")
    with anyio.fail_after(10):
        await model.request(wires.REQUEST)
    assert PLAIN not in repr(model)
    assert PLAIN not in caplog.text, caplog.text
    [request] = seen
    assert PLAIN not in request.url.fragment

    def fail(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"cannot reach {request.url} {request.headers}", request=request)

    failing = _model(wire, url, fail)
    with anyio.fail_after(10), pytest.raises(ProviderError) as caught:
        await failing.request(wires.REQUEST)
    assert PLAIN not in _shown(caught.value)


@pytest.mark.parametrize("wire", URL_WIRES, ids=IDS)
async def test_a_server_echoing_the_key_in_its_error_body_is_redacted(wire: Any) -> None:
    body = wire.error("authentication_error", f"Incorrect API key provided: {wires.KEY}")
    model = _model(wire, "https://llm.test/v1", lambda r: httpx.Response(401, content=body))
    with anyio.fail_after(10), pytest.raises(ProviderError) as caught:
        await model.request(wires.REQUEST)
    assert wires.KEY not in _shown(caught.value)
