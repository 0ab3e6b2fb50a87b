"""No key, prompt, reply or tool content in events or spans unless captured (invariant 12).

One scenario exercises every place content could slip out:

* an HTTP adapter (over ``httpx.MockTransport``, with a recognisable fake API
  key) that answers 429 and 503 with bodies echoing the key and the prompt,
  then the reply; and a run whose provider fails with a body echoing the key;
* a scripted tool loop whose tool arguments and results carry the texts, and a
  tool that raises with the argument in its message.

Everything the run reports is gathered: every ``capture_logs()`` event, every
JSON line a ``ProcessorFormatter(JSONRenderer())`` handler writes, and every
finished span as the SDK serialises it (attributes, events, status
descriptions, links). With capture off none of the texts and no piece of the
key appears; with ``Telemetry(capture_content=True)`` the texts do appear (so
the check can fail) and the key still never does. Prompt, reply, argument and
result texts are drawn by hypothesis.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import _provider_wires as wires
import anyio
import anyio.lowlevel
import httpx
import msgspec
import pytest
from _observability import Spans, json_lines
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from stepmachine import (
    AppendMessage,
    CancelToken,
    Message,
    ModelInference,
    Runtime,
    StateMachine,
    Telemetry,
    ToolAbortError,
    Tools,
    submit,
    tool,
)
from stepmachine.extend import counter_ids
from stepmachine.operations import Approval, Compaction, HistoryGuard, InvalidCalls, approve
from stepmachine.providers import ProviderError
from stepmachine.stores import MemoryStore
from stepmachine.testing import ScriptedModel, call, reply

KEY = wires.KEY
WINDOW = 10


def holds_key(text: str) -> bool:
    """Whether ``text`` holds any ``WINDOW`` characters of the key in a row."""
    return any(KEY[i : i + WINDOW] in text for i in range(len(KEY) - WINDOW + 1))


@dataclass(frozen=True)
class Texts:
    """The content of one scenario; each text is distinctive enough to search for."""

    prompt: str
    reply: str
    argument: str
    result: str

    def all(self) -> dict[str, str]:
        return {
            "prompt": self.prompt,
            "reply": self.reply,
            "argument": self.argument,
            "result": self.result,
        }


FIXED = Texts(
    prompt="PROMPT-please-pay-the-invoice-of-Alice",
    reply="REPLY-the-invoice-is-paid",
    argument="ARGUMENT-iban-DE0012345678",
    result="RESULT-receipt-number-998877",
)


def json_response(code: int, body: bytes, **headers: str) -> httpx.Response:
    return httpx.Response(
        code, content=body, headers={"content-type": "application/json", **headers}
    )


async def provider_runs(wire: wires.Wire, texts: Texts, telemetry: Telemetry) -> None:
    """A run with two retries and a reply, then a run whose provider fails; bodies echo the key."""
    echo = f"bad request for {texts.prompt} with key {KEY}"
    answers = [
        json_response(429, wire.error("rate_limit_error", echo), **{"retry-after": "1"}),
        json_response(503, wire.error("server_error", f"Bearer {KEY}")),
        json_response(200, wire.ok_json.replace(b"Hello", texts.reply.encode())),
        json_response(401, wire.error("invalid_api_key", f"Incorrect API key provided: {KEY}")),
    ]
    model = wire.make(lambda request: answers.pop(0))
    store = MemoryStore()
    failures: list[tuple[str, str]] = []
    try:
        runtime = Runtime(store=store, model=model, telemetry=telemetry)
        for session_id in ("ok", "fails"):
            await store.create(session_id, conversation=[Message.user(texts.prompt, id="u1")])
            try:
                await StateMachine([ModelInference()]).run(runtime, session_id)
            except ProviderError as exc:
                failures.append((session_id, str(exc)))
    finally:
        await model.aclose()
    assert answers == []
    assert [session_id for session_id, _ in failures] == ["fails"]
    assert not holds_key(failures[0][1])


async def tool_run(texts: Texts, telemetry: Telemetry) -> None:
    """A tool loop whose arguments and results carry the texts; one tool raises, one aborts."""

    @tool
    def lookup(text: str) -> str:
        """Returns the result text."""
        return f"{texts.result} for {text}"

    @tool
    def explode(text: str) -> str:
        """Raises with its argument in the message."""
        raise ValueError(f"cannot handle {text}")

    store = MemoryStore()
    await store.create("tools", conversation=[Message.user(texts.prompt, id="u1")])
    model = ScriptedModel(
        [
            call(("lookup", {"text": texts.argument}), ("explode", {"text": texts.argument})),
            reply(texts.reply),
        ]
    )
    machine = StateMachine([Tools([lookup, explode]), ModelInference()])
    await machine.run(
        Runtime(store=store, model=model, ids=counter_ids(), telemetry=telemetry), "tools"
    )


Scenario = Callable[[Texts, Telemetry], Awaitable[None]]


def scenarios(wire: wires.Wire) -> list[Scenario]:
    async def through_provider(texts: Texts, telemetry: Telemetry) -> None:
        await provider_runs(wire, texts, telemetry)

    return [through_provider, tool_run]


async def everything_reported(texts: Texts, *, capture: bool, wire: wires.Wire) -> str:
    """Run every scenario twice (capture_logs, then stdlib JSON lines); all output as text."""
    spans = Spans()
    telemetry = spans.telemetry(capture_content=capture)
    with capture_logs() as captured:
        for scenario in scenarios(wire):
            await scenario(texts, telemetry)
    with json_lines() as lines:
        for scenario in scenarios(wire):
            await scenario(texts, telemetry)
    assert {e["event"] for e in captured} >= {"model_call", "model_retry", "tool_call", "cycle"}
    assert {line["event"] for line in lines} == {e["event"] for e in captured}
    parts = [json.dumps(captured, default=repr), json.dumps(lines)]
    parts += [span.to_json(indent=None) for span in spans.finished]
    assert any(s.name.startswith("execute_tool") for s in spans.finished)
    assert any(s.events for s in spans.finished)  # the retries
    return "\n".join(parts)


@pytest.mark.parametrize("wire", wires.WIRES, ids=[w.name for w in wires.WIRES])
async def test_with_capture_off_no_key_and_no_content_is_reported(wire: wires.Wire) -> None:
    reported = await everything_reported(FIXED, capture=False, wire=wire)
    assert not holds_key(reported)
    for name, text in FIXED.all().items():
        assert text not in reported, f"the {name} text was reported with capture off"


@pytest.mark.parametrize("wire", wires.WIRES, ids=[w.name for w in wires.WIRES])
async def test_with_capture_on_the_content_is_reported_but_never_the_key(wire: wires.Wire) -> None:
    reported = await everything_reported(FIXED, capture=True, wire=wire)
    assert not holds_key(reported)
    for name, text in FIXED.all().items():
        assert text in reported, f"the {name} text is missing with capture on"


async def test_capture_follows_the_standard_environment_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    telemetry = Telemetry(capture_content=None)
    monkeypatch.delenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", raising=False)
    with capture_logs() as off:
        await tool_run(FIXED, telemetry)
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "true")
    with capture_logs() as on:
        await tool_run(FIXED, telemetry)
    assert FIXED.argument not in json.dumps(off)
    assert FIXED.argument in json.dumps(on)


WORD = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", min_size=1
)


@st.composite
def texts(draw: st.DrawFn) -> Texts:
    """Four different texts, each marked so that no other output can hold it by chance."""
    words = draw(st.lists(WORD, min_size=4, max_size=4, unique=True))
    prompt, answer, argument, result = (f"zq{w}qz" for w in words)
    return Texts(prompt=prompt, reply=answer, argument=argument, result=result)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=texts(), capture=st.booleans())
async def test_any_content_is_reported_exactly_when_capture_is_on(
    drawn: Texts, capture: bool
) -> None:
    reported = await everything_reported(drawn, capture=capture, wire=wires.WIRES[0])
    assert not holds_key(reported)
    for name, text in drawn.all().items():
        assert (text in reported) == capture, f"{name}: {text!r}"


# -- a fail-closed tool's message ------------------------------------------------------------


async def test_a_fail_closed_tools_message_stays_out_of_the_events() -> None:
    @tool
    def guard(text: str) -> str:
        """Fails closed, naming its argument."""
        raise ToolAbortError(f"refusing {text}")

    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    model = ScriptedModel([call(("guard", {"text": FIXED.argument}))])
    spans = Spans()
    runtime = Runtime(store=store, model=model, telemetry=spans.telemetry())
    with capture_logs() as captured:
        report = await StateMachine([Tools([guard]), ModelInference()]).run_report(runtime, "s")
    assert report.reason.kind == "tool_failed"
    assert FIXED.argument in report.reason.message  # the application still reads it
    reported = json.dumps(captured) + "".join(s.to_json() for s in spans.finished)
    assert FIXED.argument not in reported


async def test_captured_content_goes_into_the_documented_fields_and_attributes() -> None:
    spans = Spans()
    with capture_logs() as captured:
        await tool_run(FIXED, spans.telemetry(capture_content=True))
    replies = [e["reply"] for e in captured if e["event"] == "model_call"]
    assert FIXED.reply in replies[-1]
    lookup = next(e for e in captured if e["event"] == "tool_call" and e["tool"] == "lookup")
    assert FIXED.argument in lookup["arguments"]
    assert lookup["result"] == f"{FIXED.result} for {FIXED.argument}"
    chats = [s for s in spans.finished if s.name.startswith("chat")]
    assert FIXED.prompt in str((chats[0].attributes or {})["gen_ai.input.messages"])
    assert FIXED.reply in str((chats[-1].attributes or {})["gen_ai.output.messages"])
    (executed,) = [s for s in spans.finished if s.name == "execute_tool lookup"]
    attributes = dict(executed.attributes or {})
    assert FIXED.argument in str(attributes["gen_ai.tool.call.arguments"])
    assert attributes["gen_ai.tool.call.result"] == f"{FIXED.result} for {FIXED.argument}"


def everything(captured: list[Any], spans: Spans) -> str:
    """Every captured event and every finished span, serialised, as one text."""
    return json.dumps(captured, default=repr) + "\n".join(s.to_json() for s in spans.finished)


# -- secrets: server-supplied text in a successful reply ---------------------------------------


def echoing_reply(wire: wires.Wire) -> Callable[[httpx.Request], httpx.Response]:
    """A 200 reply whose ``model`` and finish reason echo the request's credential."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(wire.ok_json)
        credential = request.headers.get("authorization") or request.headers.get("x-api-key")
        body["model"] = f"echo {credential}"
        if "choices" in body:
            body["choices"][0]["finish_reason"] = KEY
        if "stop_reason" in body:
            body["stop_reason"] = KEY
        return httpx.Response(200, json=body)

    return handler


@pytest.mark.parametrize("wire", wires.WIRES, ids=[w.name for w in wires.WIRES])
async def test_a_reply_echoing_the_key_does_not_put_it_into_spans_or_events(
    wire: wires.Wire,
) -> None:
    model = wire.make(echoing_reply(wire))
    spans = Spans()
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    try:
        with capture_logs() as captured:
            await StateMachine([ModelInference()]).run(
                Runtime(store=store, model=model, telemetry=spans.telemetry()), "s"
            )
    finally:
        await model.aclose()
    assert spans.named("chat")  # the check below can fail
    assert KEY not in everything(captured, spans)


# -- capture off: no content on the paths the secrets tests do not walk ---------------------------


MARKS = {
    "prompt": "zqPROMPTqz",
    "argument": "zqARGUMENTqz",
    "bad-argument": "zqBADARGqz",
    "result": "zqRESULTqz",
    "partial": "zqPARTIALqz",
    "summary": "zqSUMMARYqz",
}


class Scripted:
    """A model that decides from the history; it streams PARTIAL then hangs when told to."""

    name = "stand-in"

    def __init__(self, cancel: CancelToken) -> None:
        self.cancel = cancel

    async def request(self, request: Any, *, on_chunk: Any = None) -> Any:
        from stepmachine.extend import TextChunk

        last = request.messages[-1]
        text = " ".join(m.text or "" for m in request.messages)
        if "summar" in text.lower() and "and now?" not in (last.text or ""):
            return reply(f"{MARKS['summary']} of the talk")
        if last.role == "user" and "invalid tool calls" in (last.text or ""):
            made = call(("pay", {"to": MARKS["argument"]}))
        elif last.role == "user" and "please pay" in (last.text or ""):
            made = call(
                ("pay", {"to": MARKS["argument"]}),
                ("nosuchtool", {"x": MARKS["bad-argument"]}),
            )
        else:
            made = None
        if made is not None:
            parts = tuple(
                msgspec.structs.replace(part, call_id=f"call-{len(request.messages)}-{n}")
                for n, part in enumerate(made.parts)
            )
            return msgspec.structs.replace(made, parts=parts)
        if last.role == "tool" and not self.cancel.cancelled:
            if on_chunk is not None:
                await on_chunk(TextChunk(f"{MARKS['partial']} so far"))
            self.cancel.cancel("operator pressed stop")
            await anyio.sleep_forever()
        return reply("fine")


async def content_scenario(telemetry: Telemetry) -> tuple[list[Any], str]:
    """Approval yield (arguments in its data), approve, an invalid call repaired, the tool's
    result, a streamed reply cancelled (finalize keeps the partial text), a compaction."""

    @tool
    def pay(to: str) -> str:
        """Pay someone (needs approval)."""
        return f"{MARKS['result']} paid {to}"

    store = MemoryStore()
    conversation = [Message.user(f"{MARKS['prompt']} please pay", id="u1")]
    await store.create("s", conversation=conversation)
    token = CancelToken()
    runtime = Runtime(store=store, model=Scripted(token), ids=counter_ids(), telemetry=telemetry)

    def machine(compact: bool = False) -> StateMachine[Any]:
        steps: list[Any] = [HistoryGuard(), InvalidCalls()]
        if compact:
            steps.append(Compaction(threshold=1))
        steps += [Approval(["pay"]), Tools([pay]), ModelInference(stream=True)]
        return StateMachine(steps, cancel=None if compact else token)

    reports = []
    with capture_logs() as captured:
        reports.append(await machine().run_report(runtime, "s"))
        assert reports[-1].reason.kind == "awaiting_approval"
        assert MARKS["argument"] in json.dumps(reports[-1].reason.data)  # the app reads it
        for pending in reports[-1].reason.data["calls"]:
            await approve(store, "s", pending["call_id"], by="operator")
        reports.append(await machine().run_report(runtime, "s"))
        assert reports[-1].reason.kind == "cancelled"
        await submit(store, "s", [AppendMessage(Message.user("and now?", id="u2"))])
        reports.append(await machine(compact=True).run_report(runtime, "s"))
    stored = repr(await store.batches("s"))  # the audit log holds all but the prompt
    for name in set(MARKS) - {"prompt"}:
        assert MARKS[name] in stored, f"the scenario never produced the {name}"
    return captured, "\n".join(r.reason.kind for r in reports)


async def test_with_capture_off_approval_repairs_finalize_and_compaction_report_no_content() -> (
    None
):
    spans = Spans()
    captured, kinds = await content_scenario(spans.telemetry())
    reported = everything(captured, spans)
    assert {e["event"] for e in captured} >= {"finalize", "yield", "tool_call", "cycle"}
    leaked = [name for name, mark in MARKS.items() if mark in reported]
    assert leaked == [], f"with capture off these reached events or spans: {leaked} ({kinds})"


async def test_with_capture_on_the_same_scenario_does_report_content() -> None:
    spans = Spans()
    captured, _ = await content_scenario(spans.telemetry(capture_content=True))
    reported = everything(captured, spans)
    assert MARKS["argument"] in reported
    assert MARKS["result"] in reported
