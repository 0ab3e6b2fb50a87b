"""An outside review of issue 11 (structured events, spans, decision trace), as a hostile user.

Each test tries to break one promise of ``stepmachine._log``, ``stepmachine._tracing``,
``Telemetry`` and the stored decision trace (``Batch.refused``, ``Batch.trace``).
A test marked ``xfail(strict=True)`` documents a defect found: it fails while
the defect is there, and its reason says what happens and what should.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import _provider_wires as wires
import anyio
import anyio.lowlevel
import httpx
import msgspec
import pytest
import structlog
from _observability import Spans
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from stepmachine import (
    AppendMessage,
    CancelToken,
    Codec,
    ConfigurationError,
    Effect,
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
    StoredDataError,
    Telemetry,
    ToolCallPart,
    ToolResultPart,
    Tools,
    _tracing,
    submit,
    tool,
)
from stepmachine._codec import MAX_WHY
from stepmachine.extend import Batch, counter_ids
from stepmachine.operations import Approval, Compaction, HistoryGuard, InvalidCalls, approve
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore
from stepmachine.testing import ScriptedModel, call, reply

KEY = wires.KEY
ROOT = Path(__file__).resolve().parent.parent
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
    ["a\x00b", "é" * 100_000, "\U0001f600" * 1_000, 'line\nbreak\r\t"quoted"\\', ""],
    ids=["nul", "huge", "astral", "controls", "empty"],
)
async def test_odd_refusal_reasons_are_stored_cut_and_read_back(any_store: Store, why: str) -> None:
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


@pytest.mark.parametrize(
    "answer",
    [lambda: iter(()), lambda: [{"trace": None}], lambda: None],
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
        loader=LoaderWithOddBatches(store, answer),
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


# -- logging never changes a run: even when stderr is gone ---------------------------------------


class BrokenPipe:
    """A stderr whose reader went away (a daemon's closed pipe)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


@pytest.fixture
def raising_processor() -> Any:
    def explode(_logger: Any, _method: str, event_dict: Any) -> Any:
        raise RuntimeError("a broken log processor")

    structlog.configure(processors=[explode])
    try:
        yield
    finally:
        structlog.reset_defaults()


@pytest.mark.usefixtures("raising_processor")
@pytest.mark.parametrize("stderr", [None, BrokenPipe()], ids=["none", "broken-pipe"])
async def test_a_broken_log_processor_changes_nothing_even_without_a_usable_stderr(
    monkeypatch: pytest.MonkeyPatch, stderr: Any
) -> None:
    ran: list[int] = []

    @tool
    def add(a: int, b: int) -> int:
        """Add."""
        ran.append(a + b)
        return a + b

    monkeypatch.setattr("sys.stderr", stderr)
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("2 + 3?", id="u1")])
    model = ScriptedModel([call(("add", {"a": 2, "b": 3})), reply("5")])
    report = await StateMachine([Tools([add]), ModelInference()]).run_report(
        Runtime(store=store, model=model), "s"
    )
    assert report.reason.kind == "done"
    assert ran == [5]


# -- cancellation: spans end, context is restored ------------------------------------------------


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


async def tool_loop(store: Store, session_id: str, runtime: Runtime) -> None:
    await store.create(session_id, conversation=[Message.user("1 + 2?", id="u1")])
    await StateMachine([Tools([add]), ModelInference()]).run(runtime, session_id)


@pytest.mark.parametrize("how", ["token", "outside"])
async def test_after_a_cancelled_run_the_next_run_in_the_task_is_a_root_without_the_old_session(
    how: str,
) -> None:
    from opentelemetry import trace

    scope = anyio.CancelScope()
    token = CancelToken()

    @tool
    async def stop_here() -> str:
        """Cancels the run it is part of, then waits."""
        if how == "token":
            token.cancel("stop")
        else:
            scope.cancel()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    spans = Spans()
    store = MemoryStore()
    await store.create("old", conversation=[Message.user("go", id="u1")])
    runtime = Runtime(
        store=store,
        model=ScriptedModel([call(("stop_here", {}))]),
        ids=counter_ids(),
        telemetry=spans.telemetry(),
    )
    machine = StateMachine(
        [Tools([stop_here]), ModelInference()], cancel=token if how == "token" else None
    )
    with scope:
        await machine.run(runtime, "old")
    # Everything the run set is back as it was, in this very task.
    assert not _tracing.active()
    assert not trace.get_current_span().get_span_context().is_valid
    with capture_logs() as after:
        from stepmachine import _log

        _log.event(logging.INFO, "probe")
    assert "session_id" not in after[0]
    old_spans = {s.context.span_id for s in spans.finished}
    assert len(old_spans) >= 4  # agent, cycles, chat, tool: all ended
    (executed,) = spans.named("execute_tool stop_here")
    assert (executed.attributes or {})["error.type"] == "cancelled"
    # The next run in the same task is a root of its own, not a child of the old run.
    spans.exporter.clear()
    runtime = Runtime(
        store=store,
        model=ScriptedModel([call(("add", {"a": 1, "b": 2})), reply("3")]),
        telemetry=spans.telemetry(),
    )
    with capture_logs() as captured:
        await tool_loop(store, "new", runtime)
    (agent,) = spans.named("invoke_agent")
    assert agent.parent is None
    assert all(s.context.trace_id == agent.context.trace_id for s in spans.finished)
    assert {e.get("session_id") for e in captured} == {"new"}
    # The old session is whole: its call was answered (interrupted), exactly once.
    old = await store.load("old")
    results = [r for m in old.conversation for r in m.tool_results]
    assert len(results) == 1
    assert results[0].is_error


# -- concurrency: many traced runs in one task group ---------------------------------------------


async def test_concurrent_traced_runs_keep_their_spans_and_events_apart() -> None:
    spans = Spans()
    store = MemoryStore()
    names = [f"s{n}" for n in range(8)]

    @tool
    async def slow_add(a: int, b: int) -> int:
        """Add, yielding to the others first."""
        await anyio.lowlevel.checkpoint()
        return a + b

    async def one(session_id: str) -> None:
        await store.create(session_id, conversation=[Message.user("1 + 2?", id="u1")])
        model = ScriptedModel([call(("slow_add", {"a": 1, "b": 2})), reply(f"3 for {session_id}")])
        runtime = Runtime(store=store, model=model, telemetry=spans.telemetry())
        await StateMachine([Tools([slow_add]), ModelInference()]).run(runtime, session_id)

    with capture_logs() as captured:
        async with anyio.create_task_group() as group:
            for session_id in names:
                group.start_soon(one, session_id)
    agents = spans.named("invoke_agent")
    assert sorted(str((a.attributes or {})["gen_ai.conversation.id"]) for a in agents) == names
    by_trace = {a.context.trace_id: (a.attributes or {})["gen_ai.conversation.id"] for a in agents}
    assert len(by_trace) == len(names)
    for span in spans.finished:
        assert span.context.trace_id in by_trace, span.name
        own = (span.attributes or {}).get("gen_ai.conversation.id")
        if own is not None:
            assert own == by_trace[span.context.trace_id], span.name
        if span.name.startswith("invoke_agent"):
            assert span.parent is None
        else:
            parent = spans.parent(span)
            assert parent is not None
            assert parent.context.trace_id == span.context.trace_id
    assert len(spans.named("execute_tool")) == len(names)
    for session_id in names:
        mine = [e for e in captured if e.get("session_id") == session_id]
        assert [e["event"] for e in mine if e["event"] in ("model_call", "tool_call")] == [
            "model_call",
            "tool_call",
            "model_call",
        ]
    assert all("session_id" in e for e in captured)
    for session_id in names:
        batches = await store.batches(session_id)
        traces = {b.trace.split("-")[1] for b in batches if b.trace}
        (agent,) = [
            a for a in agents if (a.attributes or {})["gen_ai.conversation.id"] == session_id
        ]
        assert traces == {f"{agent.context.trace_id:032x}"}


# -- structlog configured in unusual ways --------------------------------------------------------


def configurations() -> dict[str, Callable[[list[Any]], None]]:
    def keep(into: list[Any]) -> Any:
        def processor(_logger: Any, _method: str, event_dict: Any) -> Any:
            into.append(dict(event_dict))
            return event_dict

        return processor

    return {
        "filtering-info": lambda into: structlog.configure(
            processors=[keep(into), structlog.processors.KeyValueRenderer()],
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        ),
        "print-logger": lambda into: structlog.configure(
            processors=[keep(into), structlog.dev.ConsoleRenderer(colors=False)],
            logger_factory=structlog.PrintLoggerFactory(),
        ),
        "stdlib-bound": lambda into: structlog.configure(
            processors=[keep(into), structlog.stdlib.render_to_log_kwargs],
            wrapper_class=structlog.stdlib.BoundLogger,
            logger_factory=structlog.stdlib.LoggerFactory(),
        ),
    }


@pytest.mark.parametrize("name", list(configurations()))
async def test_unusual_structlog_configurations_change_nothing_and_print_nothing_to_stdout(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[Any] = []
    configurations()[name](seen)
    try:
        for round_ in range(2):
            store = MemoryStore()
            runtime = Runtime(
                store=store, model=ScriptedModel([call(("add", {"a": 1, "b": 2})), reply("3")])
            )
            await tool_loop(store, f"s{round_}", runtime)
            session = await store.load(f"s{round_}")
            assert session.conversation[-1].text == "3"
    finally:
        structlog.reset_defaults()
    kinds = {e["event"] for e in seen}
    assert "yield" in kinds
    if name == "filtering-info":
        assert "cycle" not in kinds  # DEBUG filtered by the configured wrapper
    else:
        assert {"cycle", "tool_call", "model_call"} <= kinds
    assert capsys.readouterr().out == ""


async def test_with_structlog_unconfigured_and_no_logging_setup_nothing_is_printed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    structlog.reset_defaults()
    store = MemoryStore()
    await tool_loop(
        store,
        "s",
        Runtime(store=store, model=ScriptedModel([call(("add", {"a": 1, "b": 2})), reply("3")])),
    )
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ""


# -- cost: no OpenTelemetry call per cycle without a provider ------------------------------------


async def test_without_a_provider_a_run_makes_one_opentelemetry_call_whatever_its_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from opentelemetry import trace

    calls: list[str] = []
    for name in ("get_tracer_provider", "get_current_span", "use_span", "get_tracer"):
        original = getattr(trace, name)

        def counted(*args: Any, __name: str = name, __original: Any = original, **kw: Any) -> Any:
            calls.append(__name)
            return __original(*args, **kw)

        monkeypatch.setattr(trace, name, counted)
    counts = []
    for rounds in (1, 5):
        calls.clear()
        store = MemoryStore()
        model = ScriptedModel(
            [call(("add", {"a": n, "b": n})) for n in range(rounds)] + [reply("done")]
        )
        await tool_loop(store, "s", Runtime(store=store, model=model))
        assert len(await store.batches("s")) >= 2 * rounds + 1  # cycles grow with rounds
        counts.append(list(calls))
    assert counts[0] == counts[1] == ["get_tracer_provider"]


CACHED_THEN_CAPTURED = """
import anyio, structlog
from structlog.testing import capture_logs
from stepmachine import Message, ModelInference, Runtime, StateMachine
from stepmachine.stores import MemoryStore
from stepmachine.testing import ScriptedModel, reply

first = []
def keep(logger, method, event_dict):
    first.append(event_dict["event"])
    raise structlog.DropEvent

async def once(session_id):
    store = MemoryStore()
    await store.create(session_id, conversation=[Message.user("hi", id="u1")])
    runtime = Runtime(store=store, model=ScriptedModel([reply("ok")]))
    await StateMachine([ModelInference()]).run(runtime, session_id)

structlog.configure(processors=[keep], cache_logger_on_first_use=True)
anyio.run(once, "a")
structlog.reset_defaults()  # e.g. the next test of an application's suite
with capture_logs() as captured:
    anyio.run(once, "b")
print(sorted(set(first)))
print(sorted({e["event"] for e in captured}))
"""


def test_a_cached_structlog_configuration_does_not_pin_the_librarys_logger_forever() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CACHED_THEN_CAPTURED],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    first, then = done.stdout.splitlines()
    assert "model_call" in first  # the first configuration did get the events
    assert "model_call" in then, "capture_logs() saw no library event"


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


# -- every model call is a chat span and a model_call event --------------------------------------


async def test_the_summarisers_model_call_is_a_chat_span_and_a_model_call_event() -> None:
    store = MemoryStore()
    conversation = []
    for n in range(4):
        conversation += [
            Message.user(f"question {n} " * 20, id=f"u{n}"),
            Message.assistant(f"answer {n} " * 20, id=f"a{n}"),
        ]
    conversation.append(Message.user("last question", id="u-last"))
    await store.create("s", conversation=conversation)
    model = ScriptedModel([reply("a summary"), reply("second answer")])
    spans = Spans()
    runtime = Runtime(store=store, model=model, telemetry=spans.telemetry())
    machine = StateMachine([Compaction(threshold=100), ModelInference()])
    with capture_logs() as captured:
        report = await machine.run_report(runtime, "s")
    assert report.reason.kind == "done"
    assert [r.step for r in report.results] == ["compaction", "inference"]  # two model calls
    assert len([e for e in captured if e["event"] == "model_call"]) == 2
    assert len(spans.named("chat")) == 2


# -- a batch the store accepts is a batch the store can read back -------------------------------


def mistyped_trace_batch() -> Batch[Any]:
    """A public Batch built by hand with a trace that is not a str (msgspec does not check
    types when a Struct is made)."""
    return Batch(
        session_id="s",
        revision=1,
        step="application",
        cycle=0,
        timestamp=1.0,
        effects=(AppendMessage(Message.user("x", id="u1")),),
        trace=123,  # type: ignore[arg-type]
    )


async def apply_then_reopen(kind: str, where: Path) -> str:
    """Apply the mistyped batch; ``refused`` if apply said no, else what a reopened store reads."""
    store = await open_store(kind, where)
    await store.create("s", conversation=[])
    try:
        await store.apply(mistyped_trace_batch())
    except (StoredDataError, ConfigurationError):
        return "refused"
    finally:
        await store.aclose()
    reopened = await open_store(kind, where)
    try:
        session = await reopened.load("s")
        await reopened.batches("s")
        return f"readable at revision {session.revision}"
    finally:
        await reopened.aclose()


async def test_memory_and_file_stores_refuse_a_trace_that_is_not_a_str(tmp_path: Path) -> None:
    assert await apply_then_reopen("memory", tmp_path) == "refused"
    assert await apply_then_reopen("file", tmp_path) == "refused"


async def test_sqlite_refuses_a_trace_that_is_not_a_str_instead_of_bricking_the_session(
    tmp_path: Path,
) -> None:
    outcome = await apply_then_reopen("sqlite", tmp_path)
    assert outcome in ("refused", "readable at revision 1")


async def test_postgres_refuses_a_trace_that_is_not_a_str_or_reads_it_back(
    postgres_dsn: str,
) -> None:
    from stepmachine.stores import PostgresStore

    store = await PostgresStore.open(postgres_dsn)
    try:
        await store.create("s", conversation=[])
        try:
            await store.apply(mistyped_trace_batch())
        except (StoredDataError, ConfigurationError):
            return
        assert (await store.load("s")).revision == 1
        await store.batches("s")
    finally:
        await store.aclose()
    reopened = await PostgresStore.open(postgres_dsn)
    try:
        assert (await reopened.load("s")).revision == 1
        await reopened.batches("s")
    finally:
        await reopened.aclose()


# -- Telemetry's tracer provider ----------------------------------------------------------------


class SlottedProvider:
    """A TracerProvider-API object without ``__weakref__`` (a wrapper an application wrote)."""

    __slots__ = ("inner",)

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.get_tracer(*args, **kwargs)


async def test_a_provider_that_cannot_be_weakly_referenced_still_traces() -> None:
    spans = Spans()
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    telemetry = Telemetry(tracer_provider=SlottedProvider(spans.provider))
    runtime = Runtime(store=store, model=ScriptedModel([reply("ok")]), telemetry=telemetry)
    report = await StateMachine([ModelInference()]).run_report(runtime, "s")
    assert report.reason.kind == "done"
    assert spans.named("invoke_agent")


async def test_a_tracer_provider_that_is_not_one_is_a_configuration_error() -> None:
    from stepmachine import ConfigurationError

    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    telemetry = Telemetry(tracer_provider="console")
    runtime = Runtime(store=store, model=ScriptedModel([reply("ok")]), telemetry=telemetry)
    with pytest.raises(ConfigurationError, match="tracer_provider"):
        await StateMachine([ModelInference()]).run(runtime, "s")


# -- cost: a traced run's link costs the same at turn 500 as at turn 50 ------------------------


async def bytes_a_run_reads(folder: Path, *, traced: bool, monkeypatch: pytest.MonkeyPatch) -> int:
    from stepmachine.stores import _file_txn

    read: list[int] = []
    original = _file_txn.read_range  # type: ignore[attr-defined]

    def counted(fd: int, start: int, end: int) -> bytes:
        data: bytes = original(fd, start, end)
        read.append(len(data))
        return data

    monkeypatch.setattr(_file_txn, "read_range", counted)
    store = await FileStore.open(folder, Codec(NoData), fsync="never", snapshot_every=50)
    try:
        telemetry = Spans().telemetry() if traced else Telemetry()
        runtime = Runtime(store=store, model=ScriptedModel([reply("ok")]), telemetry=telemetry)
        await StateMachine([ModelInference()]).run(runtime, "s")
    finally:
        await store.aclose()
        monkeypatch.setattr(_file_txn, "read_range", original)
    return sum(read)


async def file_session(folder: Path, batches: int) -> None:
    store = await FileStore.open(folder, Codec(NoData), fsync="never", snapshot_every=50)
    try:
        await store.create("s", conversation=[])
        for n in range(batches):
            text = f"message {n} " * 10
            await submit(store, "s", [AppendMessage(Message.user(text, id=f"u{n}"))])
    finally:
        await store.aclose()


async def test_a_traced_runs_link_does_not_read_the_whole_file_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = {}
    for batches in (50, 500):
        folder = tmp_path / f"h{batches}"
        await file_session(folder, batches)  # a snapshot at the head (every 50)
        plain = await bytes_a_run_reads(folder, traced=False, monkeypatch=monkeypatch)
        traced = await bytes_a_run_reads(folder, traced=True, monkeypatch=monkeypatch)
        extra[batches] = traced - plain
    assert extra[500] <= 2 * extra[50], extra


# -- a run inside a tool (a sub-agent) -----------------------------------------------------------


async def test_a_sub_agent_run_inside_a_traced_tool_is_traced_fully_or_not_at_all() -> None:
    spans = Spans()
    inner_store = MemoryStore()

    @tool
    async def ask_helper(question: str) -> str:
        """Runs a helper agent of its own (untraced runtime)."""
        await inner_store.create("inner", conversation=[Message.user(question, id="u1")])
        runtime = Runtime(store=inner_store, model=ScriptedModel([reply("inner answer")]))
        report = await StateMachine([ModelInference()]).run_report(runtime, "inner")
        return report.session.conversation[-1].text or ""

    store = MemoryStore()
    await store.create("outer", conversation=[Message.user("go", id="u1")])
    model = ScriptedModel([call(("ask_helper", {"question": "x"})), reply("done")])
    runtime = Runtime(store=store, model=model, telemetry=spans.telemetry())
    await StateMachine([Tools([ask_helper]), ModelInference()]).run(runtime, "outer")
    inner_spans = [
        s for s in spans.finished if (s.attributes or {}).get("gen_ai.conversation.id") == "inner"
    ]
    inner_agents = [s for s in inner_spans if s.name.startswith("invoke_agent")]
    inner_traces = [b.trace for b in await inner_store.batches("inner")]
    untraced = inner_spans == [] and inner_traces == [None]
    fully_traced = len(inner_agents) == 1 and all(
        spans.parent(s) is not None for s in inner_spans if s not in inner_agents
    )
    assert untraced or fully_traced, spans.tree()


# -- a cycle cancelled from outside is reported like one cancelled by the token -----------------


async def test_a_cycle_cancelled_from_outside_has_its_cycle_event_and_outcome() -> None:
    scope = anyio.CancelScope()

    @tool
    async def wait_forever() -> str:
        """Cancels the scope around the run, then never returns."""
        scope.cancel()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    spans = Spans()
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    runtime = Runtime(
        store=store,
        model=ScriptedModel([call(("wait_forever", {}))]),
        telemetry=spans.telemetry(),
    )
    with capture_logs() as captured, scope:
        await StateMachine([Tools([wait_forever]), ModelInference()]).run(runtime, "s")
    assert [e for e in captured if e["event"] == "finalize"]  # it was cut and finalized
    cancelled = [e for e in captured if e["event"] == "cycle" and e["outcome"] == "cancelled"]
    assert [e["step"] for e in cancelled] == ["tools"]
    (cut,) = [s for s in spans.named("cycle") if (s.attributes or {}).get("error.type")]
    assert (cut.attributes or {}).get("stepmachine.outcome") == "cancelled"


# -- the decision trail round-trips whatever text it holds (hypothesis) -------------------------


TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=400)


@settings(max_examples=200, deadline=None)
@given(
    whys=st.lists(st.tuples(TEXT.filter(bool), TEXT), max_size=5),
    trace=st.none() | TEXT,
)
def test_any_refusals_and_trace_round_trip_through_the_codec(
    whys: list[tuple[str, str]], trace: str | None
) -> None:
    from stepmachine._codec import refusal

    codec = Codec(NoData)
    refused = tuple(refusal(step, why) for step, why in whys)
    for kept, (_, why) in zip(refused, whys, strict=True):
        assert len(kept.why) <= MAX_WHY
        assert kept.why == why or (kept.why.endswith("...") and why.startswith(kept.why[:-3]))
    nothing: tuple[Effect, ...] = ()
    one: tuple[Effect, ...] = (AppendMessage(Message.user("x", id="u1")),)
    for effects in (nothing, one):
        batch: Batch[Effect] = Batch(
            session_id="s",
            revision=1,
            step="inference",
            cycle=1,
            timestamp=1.0,
            effects=effects,
            refused=refused,
            trace=trace,
        )
        encoded = codec.encode_batch(batch)
        assert codec.decode_batch(encoded) == batch
        fields = msgspec.json.decode(encoded)
        assert ("refused" in fields) == bool(refused)
        assert ("trace" in fields) == (trace is not None)


@settings(max_examples=50, deadline=None)
@given(why=st.text(st.characters(categories=["Cs"]), min_size=1, max_size=5))
def test_any_refusal_reason_at_all_gives_an_encodable_batch(why: str) -> None:
    from stepmachine._codec import refusal

    batch: Batch[Effect] = Batch(
        session_id="s",
        revision=1,
        step="inference",
        cycle=1,
        timestamp=1.0,
        effects=(),
        refused=(refusal("refuses", why),),
    )
    Codec(NoData).encode_batch(batch)


# -- links: the window of batches read back ------------------------------------------------------


@pytest.mark.parametrize(("untraced", "linked"), [(15, True), (16, False)])
async def test_a_run_links_across_at_most_fifteen_later_untraced_batches(
    any_store: Store, untraced: int, linked: bool
) -> None:
    spans = Spans()
    await any_store.create("s", conversation=[Message.user("hi", id="u0")])
    runtime = Runtime(
        store=any_store,
        model=ScriptedModel([reply("one"), reply("two")]),
        telemetry=spans.telemetry(),
    )
    await StateMachine([ModelInference()]).run(runtime, "s")
    (wrote,) = spans.named("cycle inference")
    for n in range(untraced):  # an application writing outside any run
        await submit(any_store, "s", [AppendMessage(Message.user(f"more {n}", id=f"u{n + 1}"))])
    spans.exporter.clear()
    await StateMachine([ModelInference()]).run(runtime, "s")
    (agent,) = spans.named("invoke_agent")
    links = [(link.context.trace_id, link.context.span_id) for link in agent.links]
    assert links == ([(wrote.context.trace_id, wrote.context.span_id)] if linked else [])


# -- links: a run after a crash (kill -9 mid-tool) ----------------------------------------------


CRASHING_CHILD = """
import sys
from pathlib import Path
import anyio
from opentelemetry.sdk.trace import TracerProvider
from stepmachine import Message, ModelInference, Runtime, StateMachine, Telemetry, Tools, tool
from stepmachine.stores import SQLiteStore
from stepmachine.testing import ScriptedModel, call

db, marker = Path(sys.argv[1]), Path(sys.argv[2])

@tool(thread=False)
async def transfer(to: str) -> str:
    "Moves money; killed while it runs."
    marker.write_text("running")
    await anyio.sleep_forever()
    return "unreachable"

async def main():
    store = await SQLiteStore.open(db)
    await store.create("s", conversation=[Message.user("pay", id="u1")])
    runtime = Runtime(
        store=store,
        model=ScriptedModel([call(("transfer", {"to": "Alice"}))]),
        telemetry=Telemetry(tracer_provider=TracerProvider()),
    )
    await StateMachine([Tools([transfer]), ModelInference()]).run(runtime, "s")

anyio.run(main)
"""


async def test_a_run_after_a_kill_mid_tool_links_to_the_killed_run_and_reports_the_journal(
    tmp_path: Path,
) -> None:
    db, marker = tmp_path / "crash.sqlite3", anyio.Path(tmp_path / "running")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    async with await anyio.open_process(
        [sys.executable, "-c", CRASHING_CHILD, str(db), str(marker)], env=env, stdout=None
    ) as child:
        try:
            while not await marker.exists():
                assert child.returncode is None, "the child died before its tool ran"
                await anyio.sleep(0.05)
        finally:
            child.send_signal(signal.SIGKILL)
            await child.wait()
    store = await SQLiteStore.open(db)
    try:
        stored = [b.trace for b in await store.batches("s")]
        killed = [t for t in stored if t is not None]
        assert killed, stored  # the killed run's batches carry its traceparent
        spans = Spans()

        @tool(thread=False)
        async def transfer(to: str) -> str:
            """Moves money (must not run again after the crash)."""
            raise AssertionError("re-run after a crash")

        model = ScriptedModel([reply("noted")])
        runtime = Runtime(store=store, model=model, telemetry=spans.telemetry())
        with capture_logs() as captured:
            report = await StateMachine([Tools([transfer]), ModelInference()]).run_report(
                runtime, "s"
            )
    finally:
        await store.aclose()
    assert report.reason.kind == "done"
    (journal,) = [e for e in captured if e["event"] == "journal"]
    assert journal["decision"] == "outcome_unknown"
    assert journal["session_id"] == "s"
    (agent,) = spans.named("invoke_agent")
    (link,) = agent.links
    _, trace_hex, span_hex, _ = killed[-1].split("-")
    assert (link.context.trace_id, link.context.span_id) == (int(trace_hex, 16), int(span_hex, 16))


# -- a sync tool that finishes after the cancellation: one result, one event, one span ----------


@pytest.mark.parametrize("how", ["token", "outside"])
async def test_a_thread_tool_finishing_after_a_cancel_is_recorded_reported_and_traced_once(
    how: str,
) -> None:
    import threading

    release = threading.Event()
    scope = anyio.CancelScope()
    token = CancelToken()

    @tool
    def slow_lookup(key: str) -> str:
        """Runs in a worker thread; the run is cancelled while it runs."""
        anyio.from_thread.run_sync(token.cancel if how == "token" else scope.cancel)
        release.wait(timeout=30)
        return f"value of {key}"

    async def let_it_finish() -> None:
        # The cancel is in: let the thread finish (it cannot be interrupted).
        await anyio.lowlevel.checkpoint()
        release.set()

    spans = Spans()
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("look up k", id="u1")])
    runtime = Runtime(
        store=store,
        model=ScriptedModel([call(("slow_lookup", {"key": "k"}))]),
        telemetry=spans.telemetry(),
    )
    machine = StateMachine(
        [Tools([slow_lookup]), ModelInference()], cancel=token if how == "token" else None
    )
    with capture_logs() as captured:
        async with anyio.create_task_group() as group:
            group.start_soon(let_it_finish)
            with scope:
                await machine.run(runtime, "s")
            release.set()
    session = await store.load("s")
    results = [r for m in session.conversation for r in m.tool_results]
    assert [(r.content, r.is_error) for r in results] == [("value of k", False)]
    calls = [e for e in captured if e["event"] == "tool_call"]
    assert [e["outcome"] for e in calls] == ["ok"]
    assert len(spans.named("execute_tool slow_lookup")) == 1


# -- Runtime.tool_caller (untested elsewhere) ----------------------------------------------------


@tool
def must_not_run(a: int, b: int) -> int:
    """A tool the caller stands in for."""
    raise AssertionError("the tool ran although a tool_caller answers its calls")


async def run_with_caller(caller: Any) -> tuple[Any, list[Any]]:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    model = ScriptedModel([call(("must_not_run", {"a": 2, "b": 3})), reply("5")])
    runtime = Runtime(store=store, model=model, tool_caller=caller)
    machine = StateMachine([Tools([must_not_run]), ModelInference()], max_cycles=10)
    with capture_logs() as captured:
        report = await machine.run_report(runtime, "s")
    return report, captured


async def test_a_tool_caller_answers_the_call_and_is_reported() -> None:
    async def caller(part: ToolCallPart, context: Any) -> ToolResultPart:
        return ToolResultPart.for_call(part, "5")

    report, captured = await run_with_caller(caller)
    assert report.reason.kind == "done"
    assert report.session.conversation[2].tool_results[0].content == "5"
    assert [e["outcome"] for e in captured if e["event"] == "tool_call"] == ["recorded"]


async def test_a_tool_callers_result_for_another_call_is_an_error_not_a_phantom_crash() -> None:
    async def caller(part: ToolCallPart, context: Any) -> ToolResultPart:
        return ToolResultPart.for_call(msgspec.structs.replace(part, call_id="other"), "5")

    from stepmachine import StepContractError

    with capture_logs() as captured, pytest.raises(StepContractError, match="other"):
        await run_with_caller(caller)
    assert not [e for e in captured if e["event"] == "journal"]


async def test_a_tool_caller_returning_text_is_a_clear_error() -> None:
    async def caller(part: ToolCallPart, context: Any) -> Any:
        return "5"

    from stepmachine import StepContractError

    with pytest.raises(StepContractError, match="ToolResultPart"):
        await run_with_caller(caller)


# -- captured arguments are the ones the tool ran with -------------------------------------------


async def test_with_capture_on_an_edited_calls_span_and_event_show_the_arguments_that_ran() -> None:
    ran: list[int] = []

    @tool
    def pay(amount_eur: int) -> str:
        """Pay (needs approval)."""
        ran.append(amount_eur)
        return f"paid {amount_eur}"

    spans = Spans()
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("pay 9999", id="u1")])
    model = ScriptedModel([call(("pay", {"amount_eur": 9999})), reply("done")])
    runtime = Runtime(store=store, model=model, telemetry=spans.telemetry(capture_content=True))
    machine = StateMachine([Approval(["pay"]), Tools([pay]), ModelInference()])
    report = await machine.run_report(runtime, "s")
    (pending,) = report.reason.data["calls"]
    edit = {"amount_eur": 10}
    await approve(store, "s", pending["call_id"], by="operator", edited_arguments=edit, tool=pay)
    with capture_logs() as captured:
        await machine.run(runtime, "s")
    assert ran == [10]
    (event,) = [e for e in captured if e["event"] == "tool_call"]
    (executed,) = spans.named("execute_tool pay")
    arguments = [event["arguments"], (executed.attributes or {})["gen_ai.tool.call.arguments"]]
    assert all("9999" not in str(a) and "10" in str(a) for a in arguments), arguments
