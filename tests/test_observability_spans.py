"""OpenTelemetry GenAI spans of a run, read back from the SDK's in-memory exporter (issue 11).

Every test passes ``Telemetry(tracer_provider=...)`` with a provider of its
own; only a subprocess touches the global provider. What is proved, on
asyncio and trio:

* a tool loop is the tree ``invoke_agent -> cycle {step} -> chat {model} /
  execute_tool {tool}`` with the GenAI attributes; parallel tool calls of one
  task group are each a child of their cycle, and a span a tool starts in its
  worker thread is a child of its ``execute_tool`` span;
* a retry of an HTTP adapter is a ``gen_ai.retry`` span event on its ``chat``
  span (also when the attempts run out: then the span's status is ERROR);
* an approval yield, then the resume in a second process on the SQLite file:
  the resumed ``invoke_agent`` links to the span that wrote the first run's
  last batch; a run resumed in-process links the same way;
* a cancellation (token or from outside) ends every span, with
  ``error.type=cancelled`` where it cut through, and the run's yield kind;
* a tool that raises and a model that fails: ``error.type`` and status ERROR;
* zero cost: without a tracer provider nothing is traced (``tracer()`` is
  ``None``, no batch stores a trace); without the ``opentelemetry`` package
  (hidden by a meta path blocker in a subprocess) runs work and make no spans;
  the global provider is used when the telemetry names none.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import _observability_child as child
import _provider_wires as wires
import anyio
import anyio.lowlevel
import httpx
import pytest
from _observability import Spans
from opentelemetry.trace import SpanKind, StatusCode
from structlog.testing import capture_logs

from stepmachine import (
    AppendMessage,
    CancelToken,
    Codec,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    NoData,
    Runtime,
    StateMachine,
    Store,
    Telemetry,
    Tools,
    _tracing,
    submit,
    tool,
)
from stepmachine._tracing import tracer
from stepmachine.extend import Batch, counter_ids
from stepmachine.operations import Approval, Compaction, approve
from stepmachine.providers import ProviderError, RetryPolicy
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore
from stepmachine.testing import FunctionModel, ScriptedModel, call, reply

ROOT = Path(__file__).resolve().parent.parent


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


async def test_a_tool_loop_is_a_tree_of_agent_cycle_chat_and_tool_spans() -> None:
    spans = Spans()
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("What is 1 + 2?", id="u1")])
    model = ScriptedModel([call(("add", {"a": 1, "b": 2})), reply("3")])
    machine = StateMachine([Tools([add]), ModelInference()])
    runtime = Runtime(store=store, model=model, ids=counter_ids(), telemetry=spans.telemetry())
    await machine.run(runtime, "s")
    assert spans.tree() == [
        "invoke_agent stepmachine",
        "  cycle inference",
        "    chat scripted",
        "  cycle tools",
        "    execute_tool add",
        "  cycle inference",
        "    chat scripted",
    ]
    (agent,) = spans.named("invoke_agent")
    assert agent.kind is SpanKind.INTERNAL
    assert dict(agent.attributes or {}) == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": "stepmachine",
        "gen_ai.conversation.id": "s",
        "stepmachine.revision.start": 0,
        "stepmachine.revision.end": 4,
        "stepmachine.yield.kind": "done",
        "stepmachine.cycles": 3,
    }
    first, second, third = spans.named("cycle")
    assert first.attributes is not None
    assert first.attributes["stepmachine.cycle"] == 1
    assert first.attributes["stepmachine.step"] == "inference"
    assert first.attributes["stepmachine.refused"] == ("tools",)
    assert first.attributes["stepmachine.outcome"] == "continue"
    assert first.attributes["stepmachine.revision"] == 1
    assert second.attributes is not None
    assert second.attributes["stepmachine.step"] == "tools"
    assert third.attributes is not None
    assert third.attributes["stepmachine.outcome"] == "yielded"
    chat = spans.named("chat")[0]
    assert chat.kind is SpanKind.CLIENT
    assert chat.attributes is not None
    assert chat.attributes["gen_ai.operation.name"] == "chat"
    assert chat.attributes["gen_ai.request.model"] == "scripted"
    assert chat.attributes["gen_ai.response.model"] == "scripted"
    assert chat.attributes["gen_ai.provider.name"]
    assert chat.attributes["gen_ai.usage.input_tokens"] == 10
    assert chat.attributes["gen_ai.usage.output_tokens"] == 5
    assert chat.attributes["gen_ai.response.finish_reasons"] == ("tool_calls",)
    (executed,) = spans.named("execute_tool")
    assert dict(executed.attributes or {}) == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "add",
        "gen_ai.tool.call.id": "call-0-0",
        "gen_ai.tool.type": "function",
        "stepmachine.tool.side_effects": "non_idempotent",
        "stepmachine.tool.outcome": "ok",
    }
    assert executed.status.status_code is StatusCode.UNSET
    assert {s.context.trace_id for s in spans.finished} == {agent.context.trace_id}


async def test_parallel_tool_calls_are_each_a_child_of_their_cycle() -> None:
    arrived = 0
    everyone = anyio.Event()

    @tool(thread=False)
    async def meet(who: str) -> str:
        """Waits until all three calls are running at once."""
        nonlocal arrived
        arrived += 1
        if arrived == 3:
            everyone.set()
        await everyone.wait()
        return f"met {who}"

    @tool
    def in_thread(who: str) -> str:
        """Runs in a worker thread."""
        return f"thread {who}"

    spans = Spans()
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("meet", id="u1")])
    calls = [("meet", {"who": w}) for w in ("a", "b", "c")] + [("in_thread", {"who": "d"})]
    model = ScriptedModel([call(*calls), reply("done")])
    machine = StateMachine([Tools([meet, in_thread], max_concurrency=8), ModelInference()])
    runtime = Runtime(store=store, model=model, ids=counter_ids(), telemetry=spans.telemetry())
    with anyio.fail_after(60):  # a deadlock guard (calls run one by one), not a timing check
        await machine.run(runtime, "s")
    executed = spans.named("execute_tool")
    assert sorted(s.name for s in executed) == [
        "execute_tool in_thread",
        *["execute_tool meet"] * 3,
    ]
    (tools_cycle,) = [s for s in spans.named("cycle") if s.name == "cycle tools"]
    for span in executed:
        assert spans.parent(span) is tools_cycle
    assert len({s.context.span_id for s in executed}) == 4
    ids = sorted(str((s.attributes or {})["gen_ai.tool.call.id"]) for s in executed)
    assert ids == ["call-0-0", "call-0-1", "call-0-2", "call-0-3"]


@pytest.mark.parametrize("wire", wires.WIRES, ids=[w.name for w in wires.WIRES])
async def test_a_retry_is_a_span_event_on_its_chat_span(wire: wires.Wire) -> None:
    answers = [
        httpx.Response(
            429,
            content=wire.error("rate_limit_error", "slow down"),
            headers={"content-type": "application/json", "retry-after": "2"},
        ),
        httpx.Response(
            503,
            content=wire.error("server_error", "unavailable"),
            headers={"content-type": "application/json"},
        ),
        httpx.Response(200, content=wire.ok_json, headers={"content-type": "application/json"}),
    ]
    model = wire.make(lambda request: answers.pop(0))
    spans = Spans()
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    try:
        await StateMachine([ModelInference()]).run(
            Runtime(store=store, model=model, telemetry=spans.telemetry()), "s"
        )
    finally:
        await model.aclose()
    (chat,) = spans.named("chat")
    assert chat.name == "chat test-model"
    attributes = dict(chat.attributes or {})
    assert attributes["gen_ai.request.model"] == "test-model"
    assert attributes["gen_ai.response.model"] == "test-model"
    assert attributes["gen_ai.provider.name"] in {
        "openai",
        "anthropic",
        "openai_compatible",
        "gemini",
    }
    assert attributes["gen_ai.usage.input_tokens"] == 3
    assert attributes["gen_ai.usage.output_tokens"] == 1
    assert attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert attributes["stepmachine.attempts"] == 3
    assert chat.status.status_code is StatusCode.UNSET
    first, second = chat.events
    assert (first.name, second.name) == ("gen_ai.retry", "gen_ai.retry")
    assert dict(first.attributes or {}) == {
        "stepmachine.retry.attempt": 1,
        "stepmachine.retry.delay_s": 2.0,
        "stepmachine.retry.error_type": "RateLimitError",
        "stepmachine.retry.status": 429,
        "stepmachine.retry.retry_after": 2.0,
    }
    assert (second.attributes or {})["stepmachine.retry.status"] == 503
    assert (second.attributes or {})["stepmachine.retry.attempt"] == 2
    assert "stepmachine.retry.retry_after" not in (second.attributes or {})  # None: left out
    for other in spans.finished:
        if other is not chat:
            assert not other.events


# -- a run resumed later links to the run before ------------------------------------------------


def link_ids(span: Any) -> list[tuple[int, int]]:
    return [(link.context.trace_id, link.context.span_id) for link in span.links]


async def test_a_resumed_run_links_to_the_span_that_wrote_the_last_batch() -> None:
    spans = Spans()
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("What is 1 + 2?", id="u1")])
    model = ScriptedModel([call(("add", {"a": 1, "b": 2})), reply("3")])
    machine = StateMachine([Tools([add]), ModelInference()], max_cycles=1)
    runtime = Runtime(store=store, model=model, ids=counter_ids(), telemetry=spans.telemetry())
    first = await machine.run_report(runtime, "s")
    assert first.reason.kind == "cycle_limit"
    (wrote,) = spans.named("cycle inference")
    (first_agent,) = spans.named("invoke_agent")
    assert first_agent.links == ()  # a new session has nothing to link to
    spans.exporter.clear()
    await StateMachine([Tools([add]), ModelInference()]).run(runtime, "s")
    (second_agent,) = spans.named("invoke_agent")
    assert link_ids(second_agent) == [(wrote.context.trace_id, wrote.context.span_id)]
    assert dict(second_agent.links[0].attributes or {}) == {"stepmachine.link": "resumed"}
    assert second_agent.context.trace_id != wrote.context.trace_id  # a new trace, linked


async def test_a_run_resumed_after_an_approval_links_to_the_run_that_yielded() -> None:
    spans = Spans()
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("Pay Alice", id="u1")])
    runtime = Runtime(
        store=store, model=FunctionModel(child.model, name="stand-in"), telemetry=spans.telemetry()
    )
    report = await child.agent().run_report(runtime, "s")
    assert report.reason.kind == "awaiting_approval"
    (wrote,) = spans.named("cycle approval")
    for pending in report.reason.data["calls"]:
        await approve(store, "s", pending["call_id"], by="operator")
    spans.exporter.clear()
    await child.agent().run(runtime, "s")
    (resumed,) = spans.named("invoke_agent")
    assert link_ids(resumed) == [(wrote.context.trace_id, wrote.context.span_id)]


async def test_approval_then_resume_in_a_second_process_links_the_two_runs(
    tmp_path: Path, anyio_backend: str
) -> None:
    db = tmp_path / "approval.sqlite3"
    spans = Spans()
    async with await SQLiteStore.open(db) as store:
        await store.create("pay", conversation=[Message.user("Pay Alice", id="u1")])
        report = await child.agent().run_report(child.runtime(store, spans.telemetry()), "pay")
        assert report.reason.kind == "awaiting_approval"
        for pending in report.reason.data["calls"]:
            await approve(store, "pay", pending["call_id"], by="operator")
    assert spans.tree() == [
        "invoke_agent stepmachine",
        "  cycle inference",
        "    chat stand-in",
        "  cycle approval",
    ]
    (first_agent,) = spans.named("invoke_agent")
    assert (first_agent.attributes or {})["stepmachine.yield.kind"] == "awaiting_approval"
    (wrote,) = spans.named("cycle approval")
    out = tmp_path / "spans.json"
    command = [sys.executable, str(Path(child.__file__)), str(db), "pay", str(out)]
    done = await anyio.run_process(
        [*command, "--backend", anyio_backend], check=False, env=child_env()
    )
    assert done.returncode == 0, done.stderr.decode()
    exported = json.loads(await anyio.Path(out).read_text(encoding="utf-8"))
    assert exported["kind"] == "done"
    names = sorted(s["name"] for s in exported["spans"])
    assert names == [
        "chat stand-in",
        "cycle inference",
        "cycle tools",
        "execute_tool send_payment",
        "invoke_agent stepmachine",
    ]
    (resumed,) = [s for s in exported["spans"] if s["name"].startswith("invoke_agent")]
    assert resumed["links"] == [
        {
            "trace_id": f"{wrote.context.trace_id:032x}",
            "span_id": f"{wrote.context.span_id:016x}",
            "attributes": {"stepmachine.link": "resumed"},
        }
    ]


def child_env() -> dict[str, str]:
    """The environment for a child process: this checkout first on the path."""
    paths = [str(ROOT), str(ROOT / "tests")]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


# -- cancellation and errors ---------------------------------------------------------------------


@pytest.mark.parametrize("how", ["token", "outside"])
async def test_a_cancelled_run_ends_every_span_and_marks_the_cut(how: str) -> None:
    started = anyio.Event()

    @tool
    async def wait_forever() -> str:
        """Never returns."""
        started.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    spans = Spans()
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    token = CancelToken()
    machine = StateMachine(
        [Tools([wait_forever]), ModelInference()], cancel=token if how == "token" else None
    )
    runtime = Runtime(
        store=store,
        model=ScriptedModel([call(("wait_forever", {}))]),
        telemetry=spans.telemetry(),
    )
    async with anyio.create_task_group() as group:
        group.start_soon(machine.run, runtime, "s")
        await started.wait()
        if how == "token":
            token.cancel("stop")
        else:
            group.cancel_scope.cancel()
    # Every span that was started has ended (only ended spans are exported).
    assert [line.strip() for line in spans.tree()] == [
        "invoke_agent stepmachine",
        "cycle inference",
        "chat scripted",
        "cycle tools",  # a cycle cut from outside is named and reported like the token's
        "execute_tool wait_forever",
    ]
    (executed,) = spans.named("execute_tool")
    assert (executed.attributes or {})["error.type"] == "cancelled"
    assert executed.status.status_code is StatusCode.ERROR
    (agent,) = spans.named("invoke_agent")
    attributes = dict(agent.attributes or {})
    cycle = spans.named("cycle tools")[0]
    assert (cycle.attributes or {})["stepmachine.outcome"] == "cancelled"
    if how == "token":
        assert attributes["stepmachine.yield.kind"] == "cancelled"
        assert agent.status.status_code is StatusCode.UNSET  # the run returned normally
    else:
        assert attributes["error.type"] == "cancelled"
        assert agent.status.status_code is StatusCode.ERROR
        assert agent.status.description == "cancelled"


class ModelDownError(Exception):
    """The stand-in model's failure."""


async def test_a_failing_model_marks_its_chat_cycle_and_run_spans() -> None:
    def broken(request: ModelRequest) -> ModelResponse:
        raise ModelDownError("the model is down")

    spans = Spans()
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    runtime = Runtime(
        store=store, model=FunctionModel(broken, name="down"), telemetry=spans.telemetry()
    )
    with pytest.raises(ModelDownError):
        await StateMachine([ModelInference()]).run(runtime, "s")
    assert [line.strip() for line in spans.tree()] == [
        "invoke_agent stepmachine",
        "cycle",
        "chat down",
    ]
    for span in spans.finished:
        assert (span.attributes or {})["error.type"] == "ModelDownError"
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description == "ModelDownError"
        assert span.events == ()  # the exception (and its message) only with content capture


async def test_a_tool_that_raises_is_an_error_result_and_its_span_says_so() -> None:
    @tool
    def fails(x: int) -> int:
        """Raises."""
        raise ValueError("no")

    spans = Spans()
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    model = ScriptedModel([call(("fails", {"x": 1})), reply("it failed")])
    runtime = Runtime(store=store, model=model, telemetry=spans.telemetry())
    await StateMachine([Tools([fails]), ModelInference()]).run(runtime, "s")
    (executed,) = spans.named("execute_tool")
    attributes = dict(executed.attributes or {})
    assert attributes["stepmachine.tool.outcome"] == "error"
    assert "error.type" in attributes
    (agent,) = spans.named("invoke_agent")
    assert agent.status.status_code is StatusCode.UNSET  # the run itself went on


async def test_a_tool_that_raises_has_an_error_status_and_its_exception_type() -> None:
    @tool
    def fails(x: int) -> int:
        """Raises."""
        raise ValueError("no")

    spans = Spans()
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    model = ScriptedModel([call(("fails", {"x": 1})), reply("it failed")])
    runtime = Runtime(store=store, model=model, telemetry=spans.telemetry())
    await StateMachine([Tools([fails]), ModelInference()]).run(runtime, "s")
    (executed,) = spans.named("execute_tool")
    assert executed.status.status_code is StatusCode.ERROR
    assert (executed.attributes or {})["error.type"] == "ValueError"


# -- zero cost -----------------------------------------------------------------------------------


async def test_without_a_tracer_provider_nothing_is_traced() -> None:
    # No provider in the telemetry and none set globally (tests never set one).
    assert tracer(Telemetry()) is None
    unrelated = Spans()
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("What is 1 + 2?", id="u1")])
    model = ScriptedModel([call(("add", {"a": 1, "b": 2})), reply("3")])
    report = await StateMachine([Tools([add]), ModelInference()]).run_report(
        Runtime(store=store, model=model), "s"
    )
    assert report.reason.kind == "done"
    assert unrelated.finished == ()
    assert [b.trace for b in await store.batches("s")] == [None] * 4
    # With a provider, the same run is traced: the check above can fail.
    assert tracer(unrelated.telemetry()) is not None


GLOBAL_PROVIDER = """
import anyio
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from stepmachine import Message, ModelInference, Runtime, StateMachine
from stepmachine.stores import MemoryStore
from stepmachine.testing import reply, ScriptedModel

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)

async def main():
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    runtime = Runtime(store=store, model=ScriptedModel([reply("hello")]))
    await StateMachine([ModelInference()]).run(runtime, "s")
    (batch,) = await store.batches("s")
    print(batch.trace is not None)

anyio.run(main, backend={backend!r})
print(sorted(s.name for s in exporter.get_finished_spans()))
"""


def run_python(source: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=child_env(),
    )


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_global_tracer_provider_is_used_when_the_telemetry_names_none(backend: str) -> None:
    done = run_python(GLOBAL_PROVIDER.format(backend=backend))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "True",
        "['chat scripted', 'cycle inference', 'invoke_agent stepmachine']",
    ]


WITHOUT_OPENTELEMETRY = """
import sys
import importlib.abc

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ImportError(f"blocked: {{name}}")
        return None

sys.meta_path.insert(0, Blocker())

import anyio
from stepmachine import Message, ModelInference, Runtime, StateMachine, Telemetry, Tools, tool
from stepmachine._tracing import available, tracer
from stepmachine.stores import MemoryStore
from stepmachine.testing import call, reply, ScriptedModel

@tool
def add(a: int, b: int) -> int:
    "Add."
    return a + b

async def main():
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("1 + 2?", id="u1")])
    model = ScriptedModel([call(("add", {{"a": 1, "b": 2}})), reply("3")])
    telemetry = Telemetry(capture_content=True, tracer_provider=object())
    runtime = Runtime(store=store, model=model, telemetry=telemetry)
    report = await StateMachine([Tools([add]), ModelInference()]).run_report(runtime, "s")
    print(report.reason.kind, report.session.conversation[-1].text)
    print([b.trace for b in await store.batches("s")])

print(available(), tracer(Telemetry(tracer_provider=object())))
anyio.run(main, backend={backend!r})
print(any(m == "opentelemetry" or m.startswith("opentelemetry.") for m in sys.modules))
"""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_without_opentelemetry_installed_runs_work_and_make_no_spans(backend: str) -> None:
    done = run_python(WITHOUT_OPENTELEMETRY.format(backend=backend))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "False None",
        "done 3",
        "[None, None, None, None]",
        "False",
    ]


async def test_spans_made_inside_a_tool_in_a_worker_thread_are_children_of_its_span() -> None:
    spans = Spans()
    inner = spans.provider.get_tracer("a library the tool uses")

    @tool  # runs in a worker thread (anyio copies the context into it)
    def fetch(url: str) -> str:
        """Fetches, under a span of its own."""
        with inner.start_as_current_span("GET"):
            return "ok"

    store = MemoryStore()
    await store.create("s", conversation=[Message.user("fetch", id="u1")])
    model = ScriptedModel([call(("fetch", {"url": "https://example.test"})), reply("done")])
    runtime = Runtime(store=store, model=model, telemetry=spans.telemetry())
    await StateMachine([Tools([fetch]), ModelInference()]).run(runtime, "s")
    (get,) = spans.named("GET")
    parent = spans.parent(get)
    assert parent is not None
    assert parent.name == "execute_tool fetch"


async def test_a_model_call_out_of_attempts_has_its_retries_and_an_error_status() -> None:
    wire = wires.WIRES[-1]
    busy = [
        httpx.Response(
            503,
            content=wire.error("overloaded_error", "busy"),
            headers={"content-type": "application/json"},
        )
        for _ in range(3)
    ]
    model = wire.make(lambda request: busy.pop(0), retry=RetryPolicy(max_attempts=3))
    spans = Spans()
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    try:
        with pytest.raises(ProviderError):
            await StateMachine([ModelInference()]).run(
                Runtime(store=store, model=model, telemetry=spans.telemetry()), "s"
            )
    finally:
        await model.aclose()
    (chat,) = spans.named("chat")
    assert [e.name for e in chat.events] == ["gen_ai.retry", "gen_ai.retry"]
    assert chat.status.status_code is StatusCode.ERROR
    assert (chat.attributes or {})["error.type"] in {"OverloadedError", "ServerError"}


STORE_KINDS = ["memory", "sqlite", "file"]


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


# -- cancellation: spans end, context is restored ------------------------------------------------


@tool
def add_observability(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


async def tool_loop(store: Store, session_id: str, runtime: Runtime) -> None:
    await store.create(session_id, conversation=[Message.user("1 + 2?", id="u1")])
    await StateMachine([Tools([add_observability]), ModelInference()]).run(runtime, session_id)


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
