"""An outside review of issue 11 (structured events, spans, decision trace), as a hostile user.

Each test tries to break one promise of ``stepmachine._log``, ``stepmachine._tracing``,
``Telemetry`` and the stored decision trace (``Batch.refused``, ``Batch.trace``).
A test marked ``xfail(strict=True)`` documents a defect found: it fails while
the defect is there, and its reason says what happens and what should.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import _provider_wires as wires
import anyio
import httpx
import msgspec
import pytest
import structlog
from _observability import Spans
from structlog.testing import capture_logs

from stepmachine import (
    AppendMessage,
    Batch,
    CancelToken,
    Codec,
    Message,
    ModelInference,
    NoData,
    Operation,
    Outcome,
    Refuse,
    Runtime,
    StateMachine,
    StepContext,
    Store,
    Tools,
    submit,
)
from stepmachine import _tracing
from stepmachine._codec import MAX_WHY
from stepmachine.operations import Approval, approve
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore
from stepmachine.testing import ScriptedModel, call, reply

KEY = wires.KEY
STORE_KINDS = ["memory", "sqlite", "file"]


class Refuses(Operation[Any]):
    """Always refuses, with the ``why`` it was given (of any type: a hostile step author)."""

    def __init__(self, why: Any) -> None:
        self._why = why

    @property
    def name(self) -> str:
        return "refuses"

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Refuse(self._why)


async def open_store(kind: str, where: Path) -> Store:
    if kind == "memory":
        return MemoryStore()
    if kind == "sqlite":
        return await SQLiteStore.open(where / "db.sqlite3")
    return await FileStore.open(where / "files", Codec(NoData), fsync="never")


@pytest.fixture(params=STORE_KINDS)
async def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    store = await open_store(request.param, tmp_path)
    try:
        yield store
    finally:
        await store.aclose()


def everything(captured: list[Any], spans: Spans) -> str:
    """Every captured event and every finished span, serialised, as one text."""
    return json.dumps(captured, default=repr) + "\n".join(s.to_json() for s in spans.finished)


# -- refusal reasons: the batch is stored whatever the step author wrote ----------------------


@pytest.mark.xfail(
    strict=True,
    reason=(
        "stepmachine/_codec.py:98 refusal() keeps a Refuse.why holding a lone surrogate "
        "(e.g. a file name from os.listdir, surrogateescape) as it is; _encode_batch "
        "(_codec.py:444) then raises UnicodeEncodeError in every store's apply, AFTER the "
        "model was called: the reply is lost, the run dies with a non-stepmachine error, and "
        "every later run pays for the same call and dies again. refusal() should replace "
        "unencodable characters (e.g. encode('utf-8', 'replace'))."
    ),
)
async def test_a_refusal_reason_with_a_lone_surrogate_does_not_lose_the_models_reply(
    any_store: Store,
) -> None:
    await any_store.create("s", conversation=[Message.user("hi", id="u1")])
    model = ScriptedModel([reply("the reply")])
    machine = StateMachine([Refuses("no file a\udcffb.txt"), ModelInference()])
    report = await machine.run_report(Runtime(store=any_store, model=model), "s")
    assert report.reason.kind == "done"
    assert report.session.conversation[-1].text == "the reply"
    (batch,) = await any_store.batches("s")
    (kept,) = batch.refused
    assert kept.step == "refuses"
    assert kept.why.startswith("no file a")


@pytest.mark.xfail(
    strict=True,
    reason=(
        "stepmachine/_codec.py:100 refusal() calls len(why): a Refuse whose why is not a str "
        "(None, an int, an exception object; Refuse is an unchecked dataclass and why was "
        "never read before issue 11) crashes the run with a bare TypeError "
        "('object of type NoneType has no len()') after the next step's model call. It "
        "should keep str(why), or raise a StepContractError naming the step before any "
        "later step runs."
    ),
)
@pytest.mark.parametrize("why", [None, 42, ValueError("no")], ids=["none", "int", "exception"])
async def test_a_refusal_reason_that_is_not_a_str_is_kept_as_text(
    any_store: Store, why: Any
) -> None:
    await any_store.create("s", conversation=[Message.user("hi", id="u1")])
    model = ScriptedModel([reply("the reply")])
    report = await StateMachine([Refuses(why), ModelInference()]).run_report(
        Runtime(store=any_store, model=model), "s"
    )
    assert report.reason.kind == "done"
    (batch,) = await any_store.batches("s")
    assert batch.refused[0].why == str(why)


@pytest.mark.parametrize(
    "why",
    ["a\x00b", "é" * 100_000, "\U0001f600" * 1_000, "line\nbreak\r\t\"quoted\"\\", ""],
    ids=["nul", "huge", "astral", "controls", "empty"],
)
async def test_odd_refusal_reasons_are_stored_cut_and_read_back(
    any_store: Store, why: str
) -> None:
    await any_store.create("s", conversation=[Message.user("hi", id="u1")])
    with capture_logs() as captured:
        report = await StateMachine([Refuses(why), ModelInference()]).run_report(
            Runtime(store=any_store, model=ScriptedModel([reply("ok")])), "s"
        )
    assert report.reason.kind == "done"
    (batch,) = await any_store.batches("s")
    (kept,) = batch.refused
    assert len(kept.why) <= MAX_WHY
    assert kept.why == (why if len(why) <= MAX_WHY else why[: MAX_WHY - 3] + "...")
    cycles = [e for e in captured if e["event"] == "cycle" and e["step"] == "inference"]
    assert cycles[0]["refused"] == [{"step": "refuses", "why": kept.why}]


async def test_odd_refusal_reasons_survive_postgres(postgres_dsn: str) -> None:
    from stepmachine.stores import PostgresStore

    store = await PostgresStore.open(postgres_dsn)
    try:
        for n, why in enumerate(["a\x00b", "é" * 10_000, "\U0001f600 \\u0000"]):
            await store.create(f"s{n}", conversation=[Message.user("hi", id="u1")])
            report = await StateMachine([Refuses(why), ModelInference()]).run_report(
                Runtime(store=store, model=ScriptedModel([reply("ok")])), f"s{n}"
            )
            assert report.reason.kind == "done"
            (batch,) = await store.batches(f"s{n}")
            assert batch.refused[0].why == (why if len(why) <= MAX_WHY else why[:197] + "...")
    finally:
        await store.aclose()


# -- hostile stored traces: never an error, never a link --------------------------------------


HOSTILE_TRACES = [
    "garbage",
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero span id
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",  # upper case
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff (invalid)
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\n",
    "x" * 1_000_000,
    "",
    "\x00",
]


@pytest.mark.parametrize("trace", HOSTILE_TRACES, ids=range(len(HOSTILE_TRACES)))
def test_link_to_never_raises_and_refuses_what_is_not_a_traceparent(trace: str) -> None:
    assert _tracing.link_to(trace) is None


async def test_a_run_after_batches_with_hostile_traces_is_unlinked_and_unharmed(
    any_store: Store,
) -> None:
    session = await any_store.create("s", conversation=[])
    for n, trace in enumerate(HOSTILE_TRACES):
        message = Message.user(f"u{n}", id=f"u{n}")
        await any_store.apply(
            Batch(
                session_id="s",
                revision=session.revision + 1,
                step="application",
                cycle=0,
                timestamp=1.0,
                effects=(AppendMessage(message),),
                trace=trace.replace("\x00", "") or None,
            )
        )
        session = await any_store.load("s")
    spans = Spans()
    runtime = Runtime(
        store=any_store, model=ScriptedModel([reply("ok")]), telemetry=spans.telemetry()
    )
    report = await StateMachine([ModelInference()]).run_report(runtime, "s")
    assert report.reason.kind == "done"
    (agent,) = spans.named("invoke_agent")
    assert agent.links == ()


class LoaderWithOddBatches:
    """A third-party loader whose ``batches`` answers something other than a list of Batch."""

    def __init__(self, store: MemoryStore, answer: Callable[[], Any]) -> None:
        self._store = store
        self._answer = answer

    async def load(self, session_id: str) -> Any:
        return await self._store.load(session_id)

    async def batches(self, session_id: str, after: int = 0) -> Any:
        return self._answer()


@pytest.mark.xfail(
    strict=True,
    reason=(
        "stepmachine/_machine.py:510 _link_to_previous guards only the await of the loader's "
        "batches(): a loader (third-party SessionLoader; batches is not part of that "
        "protocol) answering a generator or rows without .trace crashes every TRACED run "
        "with TypeError/AttributeError, while the docstring says a failing read gives no "
        "link ('a link is worth less than the run'). The loop over the answer should be "
        "inside the try (or the answer checked)."
    ),
)
@pytest.mark.parametrize(
    "answer",
    [lambda: (b for b in ()), lambda: [{"trace": None}], lambda: None],
    ids=["generator", "dicts", "none"],
)
async def test_a_loader_with_an_odd_batches_answer_never_breaks_a_traced_run(
    answer: Callable[[], Any],
) -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    await StateMachine([ModelInference()]).run(
        Runtime(store=store, model=ScriptedModel([reply("one")])), "s"
    )
    await submit(store, "s", [AppendMessage(Message.user("again", id="u2"))])
    spans = Spans()
    runtime = Runtime(
        loader=LoaderWithOddBatches(store, answer),  # type: ignore[arg-type]
        handler=store,
        model=ScriptedModel([reply("two")]),
        telemetry=spans.telemetry(),
    )
    report = await StateMachine([ModelInference()]).run_report(runtime, "s")
    assert report.reason.kind == "done"


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


@pytest.mark.xfail(
    strict=True,
    reason=(
        "stepmachine/_inference.py:214-222 and :245 put server-supplied text of a successful "
        "reply (response.model, response.finish_reason) into the chat span "
        "(gen_ai.response.model, gen_ai.response.finish_reasons) and the model_call event "
        "(finish_reason) unredacted, even with capture off; a server (proxy, gateway) that "
        "echoes the credential puts the API key into spans and logs (invariant 12). The "
        "errors path treats every server text as untrusted (redact_error); the reply's "
        "model/finish_reason should get the same redaction against the adapter's secrets "
        "(or be length/charset-checked)."
    ),
)
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
