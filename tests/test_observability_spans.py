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
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import _observability_child as child
import _provider_wires as wires
import anyio
import httpx
import pytest
from _observability import Spans
from opentelemetry.trace import SpanKind, StatusCode

from stepmachine import (
    CancelToken,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    StateMachine,
    Telemetry,
    Tools,
    tool,
)
from stepmachine._tracing import tracer
from stepmachine.extend import counter_ids
from stepmachine.operations import approve
from stepmachine.providers import ProviderError, RetryPolicy
from stepmachine.stores import MemoryStore, SQLiteStore
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
