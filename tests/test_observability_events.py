"""Structured events: every decision of a run is a structlog event with fields (issue 11).

Each event kind of the catalogue in ``stepmachine._log`` is produced by a real
run and checked field by field, on asyncio and trio:

* ``cycle``: the applied step, every refusing step with its ``why``, the
  outcome, the effect count, a duration; an idle cycle lists every refusal;
* ``yield``: kind and message; ``conflict`` and ``reload``: a step whose batch
  loses the compare-and-set race to a write through another path;
* ``finalize``: a run stopped by its ``CancelToken`` and one cancelled from
  outside;
* ``model_call`` (model, attempts, usage, finish reason; a failure is a
  WARNING with ``error_type``) and ``model_retry`` (an HTTP adapter over
  ``httpx.MockTransport`` answering 429, then 503, then the reply; or 503
  until the attempts run out); two concurrent runs each name their own
  session in the retries their adapters report;
* ``tool_call`` for each outcome (ok, error, timeout, invalid_arguments,
  aborted); ``journal`` after a crash (outcome_unknown, rerun).

Two routes see them: ``structlog.testing.capture_logs()``, and plain
standard-library logging with a ``ProcessorFormatter(JSONRenderer())`` handler
(JSON lines), with structlog unconfigured or configured for the standard
library. With logging off (structlog unconfigured, logger ``stepmachine`` at
WARNING), nothing reaches a handler.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import _provider_wires as wires
import anyio
import anyio.lowlevel
import httpx
import msgspec
import pytest
import structlog
from _observability import Spans, events, json_lines
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from stepmachine import (
    AppendMessage,
    CancelToken,
    Codec,
    ConfigurationError,
    Continue,
    Effect,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    NoData,
    Operation,
    Outcome,
    Refuse,
    Runtime,
    StateMachine,
    StepContext,
    Store,
    StoredDataError,
    ToolAbortError,
    ToolCallPart,
    Tools,
    resolve_unknown_outcome,
    submit,
    tool,
)
from stepmachine._codec import MAX_WHY
from stepmachine.extend import JOURNAL, Batch, counter_ids, fingerprint
from stepmachine.operations import Approval
from stepmachine.providers import ProviderError, RetryPolicy
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore
from stepmachine.testing import FunctionModel, ScriptedModel, call, reply

# The catalogue (stepmachine/_log.py): the fields each event documents.
DOCUMENTED = {
    "cycle": {"session_id", "revision", "cycle", "step", "refused", "outcome", "effects"},
    "yield": {"session_id", "revision", "kind", "message", "cycles"},
    "conflict": {"session_id", "revision", "step", "cycle"},
    "reload": {"session_id", "revision"},
    "finalize": {"session_id", "revision", "interrupted", "batches", "answered"},
    "model_call": {"session_id", "model", "attempts", "duration_ms"},
    "model_retry": {"session_id", "model", "attempt", "delay_s", "error_type", "status"},
    "tool_call": {"session_id", "tool", "call_id", "side_effects", "duration_ms", "outcome"},
    "journal": {"session_id", "tool", "call_id", "decision", "attempt"},
}


def documented(event: Mapping[str, Any]) -> None:
    """``event`` carries every field the catalogue documents for its kind."""
    missing = DOCUMENTED[event["event"]] - event.keys()
    assert not missing, f"{event['event']} lacks {sorted(missing)}: {event}"


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


async def tool_loop(store: MemoryStore, session_id: str = "s") -> None:
    """A user asks, the model calls ``add``, the tool runs, the model answers."""
    await store.create(session_id, conversation=[Message.user("What is 1 + 2?", id="u1")])
    model = ScriptedModel([call(("add", {"a": 1, "b": 2})), reply("3")])
    machine = StateMachine([Tools([add]), ModelInference()])
    await machine.run(Runtime(store=store, model=model, ids=counter_ids()), session_id)


# -- cycle, yield --------------------------------------------------------------------------------


async def test_each_cycle_names_its_step_refusals_outcome_effects_and_duration() -> None:
    with capture_logs() as captured:
        await tool_loop(MemoryStore())
    cycles = events(captured, "cycle")
    assert [(c["cycle"], c["step"], c["outcome"]) for c in cycles] == [
        (1, "inference", "continue"),
        (2, "tools", "continue"),
        (3, "inference", "yielded"),
    ]
    for cycle in cycles:
        documented(cycle)
        assert cycle["session_id"] == "s"
        assert cycle["log_level"] == "debug"
        assert isinstance(cycle["duration_ms"], float)
        assert cycle["duration_ms"] >= 0
    first, second, third = cycles
    assert first["refused"] == [{"step": "tools", "why": "no open tool calls"}]
    assert (first["revision"], first["effects"]) == (1, 1)
    assert second["refused"] == []
    # The tools step commits its batches itself (intent, then the result).
    assert second["revision"] == 3
    assert third["refused"] == [{"step": "tools", "why": "no open tool calls"}]
    assert (third["revision"], third["effects"]) == (4, 1)


class Never(Operation[Any]):
    """A step that never applies, and says why."""

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Refuse("nothing for me here")


async def test_an_idle_cycle_lists_every_refusing_step_with_why() -> None:
    store = MemoryStore()
    await store.create(
        "s", conversation=[Message.user("hi", id="u1"), Message.assistant("hello", id="a1")]
    )
    machine = StateMachine([Never(), Tools([add]), ModelInference()])
    with capture_logs() as captured:
        await machine.run(Runtime(store=store, model=ScriptedModel([])), "s")
    (cycle,) = events(captured, "cycle")
    documented(cycle)
    assert cycle["step"] is None
    assert cycle["outcome"] == "idle"
    assert [r["step"] for r in cycle["refused"]] == ["Never", "tools", "inference"]
    assert cycle["refused"][0]["why"] == "nothing for me here"
    assert all(isinstance(r["why"], str) and r["why"] for r in cycle["refused"])
    (yielded,) = events(captured, "yield")
    assert yielded["kind"] == "idle"


async def test_a_yield_is_an_info_event_with_its_kind_and_message() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("What is 1 + 2?", id="u1")])
    model = ScriptedModel([call(("add", {"a": 1, "b": 2}))])
    machine = StateMachine([Approval(["add"]), Tools([add]), ModelInference()])
    with capture_logs() as captured:
        report = await machine.run_report(Runtime(store=store, model=model), "s")
    (yielded,) = events(captured, "yield")
    documented(yielded)
    assert yielded["log_level"] == "info"
    assert yielded["kind"] == "awaiting_approval" == report.reason.kind
    assert yielded["message"] == report.reason.message
    assert "add" in yielded["message"]
    assert yielded["revision"] == report.session.revision
    assert yielded["cycles"] == 2
    assert events(captured, "cycle")[-1]["step"] == "approval"


# -- conflict, reload ----------------------------------------------------------------------------


class Interloper(Operation[Any]):
    """Once, writes a note through another path (the store), then returns its own effect.

    Its own batch was computed from the session it read, which the write moved
    on: the machine's commit conflicts, the machine reloads and steps again.
    """

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.done = False

    @property
    def name(self) -> str:
        return "interloper"

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        if ctx.session.conversation[-1].role == "assistant":
            return Refuse("answered")
        if not self.done:
            self.done = True
            await submit(
                self.store, ctx.session.id, [AppendMessage(Message.user("meanwhile", id="u2"))]
            )
        return Continue([AppendMessage(Message.assistant("ok", id="a1"))])


async def test_a_lost_race_is_a_conflict_then_a_reload() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    machine = StateMachine([Interloper(store)])
    with capture_logs() as captured:
        report = await machine.run_report(Runtime(store=store), "s")
    assert report.session.conversation[-1].text == "ok"
    (conflict,) = events(captured, "conflict")
    documented(conflict)
    assert conflict == {
        "event": "conflict",
        "log_level": "info",
        "session_id": "s",
        "revision": 0,  # the revision the step read
        "step": "interloper",
        "cycle": 1,
    }
    (reload,) = events(captured, "reload")
    documented(reload)
    assert (reload["revision"], reload["log_level"]) == (1, "debug")  # the other write
    assert [c["outcome"] for c in events(captured, "cycle")] == ["conflict", "continue", "idle"]
    names = [e["event"] for e in captured]
    assert names.index("conflict") < names.index("reload")


# -- finalize ------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["token", "outside"])
async def test_a_cancelled_run_reports_its_finalize(how: str) -> None:
    started = anyio.Event()

    @tool
    async def wait_forever() -> str:
        """Never returns."""
        started.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    token = CancelToken()
    machine = StateMachine(
        [Tools([wait_forever]), ModelInference()], cancel=token if how == "token" else None
    )
    runtime = Runtime(store=store, model=ScriptedModel([call(("wait_forever", {}))]))
    with capture_logs() as captured:
        async with anyio.create_task_group() as group:
            group.start_soon(machine.run, runtime, "s")
            await started.wait()
            if how == "token":
                token.cancel("user pressed stop")
            else:
                group.cancel_scope.cancel()
    (finalize,) = events(captured, "finalize")
    assert finalize["log_level"] == "info"
    assert finalize["session_id"] == "s"
    assert finalize["interrupted"] == "tools"
    assert finalize["answered"] == 1  # the open call, answered "interrupted"
    assert finalize["revision"] == (await store.load("s")).revision
    if how == "token":
        (yielded,) = events(captured, "yield")
        assert (yielded["kind"], yielded["message"]) == ("cancelled", "user pressed stop")
        assert events(captured, "cycle")[-1]["outcome"] == "cancelled"
    else:
        assert events(captured, "yield") == []  # the cancellation propagated to the caller


async def test_the_finalize_event_has_the_documented_fields() -> None:
    started = anyio.Event()

    @tool
    async def wait_forever() -> str:
        """Never returns."""
        started.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    token = CancelToken()
    machine = StateMachine([Tools([wait_forever]), ModelInference()], cancel=token)
    runtime = Runtime(store=store, model=ScriptedModel([call(("wait_forever", {}))]))
    with capture_logs() as captured:
        async with anyio.create_task_group() as group:
            group.start_soon(machine.run, runtime, "s")
            await started.wait()
            token.cancel()
    (finalize,) = events(captured, "finalize")
    documented(finalize)


# -- model_call, model_retry ---------------------------------------------------------------------


async def test_a_model_call_names_the_model_attempts_usage_and_finish_reason() -> None:
    with capture_logs() as captured:
        await tool_loop(MemoryStore())
    calls = events(captured, "model_call")
    assert [c["finish_reason"] for c in calls] == ["tool_calls", "stop"]
    for made in calls:
        documented(made)
        assert made["log_level"] == "debug"
        assert made["model"] == "scripted"
        assert made["attempts"] == 1
        assert (made["input_tokens"], made["output_tokens"]) == (10, 5)
        assert "error_type" not in made
        assert "reply" not in made  # content capture is off


class ModelDownError(Exception):
    """The stand-in model's failure."""


async def test_a_failed_model_call_is_a_warning_with_the_error_type() -> None:
    def broken(request: ModelRequest) -> ModelResponse:
        raise ModelDownError("the model is down")

    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    machine = StateMachine([ModelInference()])
    runtime = Runtime(store=store, model=FunctionModel(broken, name="down"))
    with capture_logs() as captured, pytest.raises(ModelDownError):
        await machine.run(runtime, "s")
    (failed,) = events(captured, "model_call")
    documented(failed)
    assert failed["log_level"] == "warning"
    assert failed["error_type"] == "ModelDownError"
    assert failed["model"] == "down"
    assert failed["attempts"] == 1


def answering(*responses: httpx.Response) -> Any:
    """A MockTransport handler that answers each request with the next response."""
    queue = list(responses)

    def handler(request: httpx.Request) -> httpx.Response:
        return queue.pop(0)

    return handler


def json_response(code: int, body: bytes, **headers: str) -> httpx.Response:
    return httpx.Response(
        code, content=body, headers={"content-type": "application/json", **headers}
    )


@pytest.mark.parametrize("wire", wires.WIRES, ids=[w.name for w in wires.WIRES])
async def test_each_retry_of_an_http_adapter_is_a_model_retry_event(wire: wires.Wire) -> None:
    sleeps: list[float] = []
    model = wire.make(
        answering(
            json_response(429, wire.error("rate_limit_error", "slow down"), **{"retry-after": "2"}),
            json_response(503, wire.error("server_error", "unavailable")),
            json_response(200, wire.ok_json),
        ),
        sleeps=sleeps,
    )
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    try:
        with capture_logs() as captured:
            await StateMachine([ModelInference()]).run(Runtime(store=store, model=model), "s")
    finally:
        await model.aclose()
    first, second = events(captured, "model_retry")
    for retry in (first, second):
        documented(retry)
        assert retry["log_level"] == "info"
        assert retry["session_id"] == "s"  # the run's, though the adapter knows no session
        assert retry["model"] == model.name
    assert (first["attempt"], first["status"], first["error_type"]) == (1, 429, "RateLimitError")
    assert (first["retry_after"], first["delay_s"]) == (2.0, 2.0)
    assert (second["attempt"], second["status"], second["retry_after"]) == (2, 503, None)
    assert second["error_type"] in {"OverloadedError", "ServerError"}
    assert second["delay_s"] == pytest.approx(sleeps[1], abs=1e-3)
    (made,) = events(captured, "model_call")
    assert made["attempts"] == 3
    assert (made["input_tokens"], made["output_tokens"], made["finish_reason"]) == (3, 1, "stop")


# -- tool_call -----------------------------------------------------------------------------------


@tool
def fails(x: int) -> int:
    """Raises."""
    raise ValueError("no")


@tool(timeout=0.01, thread=False)
async def hangs(x: int) -> int:
    """Never returns: always past its timeout."""
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


@tool(side_effects="idempotent")
def stops(x: int) -> int:
    """Fails closed."""
    raise ToolAbortError("read-only")


@pytest.mark.parametrize(
    ("name", "arguments", "outcome"),
    [
        ("add", {"a": 1, "b": 2}, "ok"),
        ("fails", {"x": 1}, "error"),
        ("hangs", {"x": 1}, "timeout"),
        ("add", {"a": "one"}, "invalid_arguments"),
        ("stops", {"x": 1}, "aborted"),
    ],
)
async def test_each_tool_call_reports_its_outcome(
    name: str, arguments: dict[str, Any], outcome: str
) -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    model = ScriptedModel([call((name, arguments)), reply("done")])
    machine = StateMachine([Tools([add, fails, hangs, stops]), ModelInference()])
    with capture_logs() as captured:
        await machine.run(Runtime(store=store, model=model, ids=counter_ids()), "s")
    (reported,) = events(captured, "tool_call")
    documented(reported)
    assert reported["log_level"] == "debug"
    assert reported["tool"] == name
    assert reported["call_id"] == "call-0-0"
    assert reported["outcome"] == outcome
    expected_class = "idempotent" if name == "stops" else "non_idempotent"
    assert reported["side_effects"] == expected_class
    assert isinstance(reported["duration_ms"], float)
    assert "arguments" not in reported
    assert "result" not in reported


# -- journal -------------------------------------------------------------------------------------


def with_intent(call_part: ToolCallPart) -> ToolCallPart:
    """The call as the journal leaves it when the process died after the intent."""
    note = {
        "intent": True,
        "attempt": 1,
        "fingerprint": fingerprint(call_part.name, call_part.arguments),
    }
    return ToolCallPart(
        call_id=call_part.call_id,
        name=call_part.name,
        arguments=call_part.arguments,
        raw_arguments=call_part.raw_arguments,
        notes={JOURNAL: note},
    )


@tool
def charge(amount: int) -> str:
    """Charge a card (not idempotent)."""
    return f"charged {amount}"


@tool(side_effects="idempotent")
def upsert(key: str) -> str:
    """Write under an idempotency key."""
    return "ok"


async def crashed(store: MemoryStore, name: str, arguments: dict[str, Any]) -> None:
    """Session ``s`` as a crash leaves it: a call with an intent and no result."""
    pending = with_intent(ToolCallPart.of("c1", name, arguments))
    await store.create(
        "s",
        conversation=[
            Message.user("go", id="u1"),
            Message(id="a1", role="assistant", parts=(pending,)),
        ],
    )


async def test_an_intent_without_a_result_is_reported_outcome_unknown() -> None:
    store = MemoryStore()
    await crashed(store, "charge", {"amount": 5})
    machine = StateMachine([Tools([charge]), ModelInference()])
    model = ScriptedModel([reply("I could not tell whether it was charged.")])
    with capture_logs() as captured:
        await machine.run(Runtime(store=store, model=model), "s")
    (journal,) = events(captured, "journal")
    documented(journal)
    assert journal["log_level"] == "warning"
    assert (journal["tool"], journal["call_id"], journal["decision"]) == (
        "charge",
        "c1",
        "outcome_unknown",
    )
    assert journal["attempt"] == 1
    assert events(captured, "tool_call") == []  # not run again


@pytest.mark.parametrize("route", ["idempotent", "operator"])
async def test_a_call_run_again_after_a_crash_is_reported_rerun(route: str) -> None:
    store = MemoryStore()
    if route == "idempotent":
        await crashed(store, "upsert", {"key": "k"})
    else:
        await crashed(store, "charge", {"amount": 5})
        await resolve_unknown_outcome(store, "s", "c1", rerun=True, by="ops")
    machine = StateMachine([Tools([charge, upsert]), ModelInference()])
    with capture_logs() as captured:
        await machine.run(Runtime(store=store, model=ScriptedModel([reply("done")])), "s")
    (journal,) = events(captured, "journal")
    documented(journal)
    assert journal["log_level"] == "info"
    assert (journal["call_id"], journal["decision"]) == ("c1", "rerun")
    (ran,) = events(captured, "tool_call")
    assert (ran["call_id"], ran["outcome"]) == ("c1", "ok")


# -- the standard-library route ------------------------------------------------------------------


async def test_plain_stdlib_logging_gets_json_lines_with_the_fields() -> None:
    with json_lines() as lines:
        await tool_loop(MemoryStore())
    assert [line["event"] for line in lines] == [
        "model_call",
        "cycle",
        "tool_call",
        "cycle",
        "model_call",
        "cycle",
        "yield",
    ]
    for line in lines:
        assert line["logger"] == "stepmachine"
        assert line["session_id"] == "s"
        documented(line)
    first_cycle = lines[1]
    assert first_cycle["level"] == "debug"
    assert first_cycle["refused"] == [{"step": "tools", "why": "no open tool calls"}]
    assert (first_cycle["step"], first_cycle["outcome"], first_cycle["effects"]) == (
        "inference",
        "continue",
        1,
    )
    assert lines[2]["tool"] == "add"
    assert (lines[-1]["level"], lines[-1]["kind"]) == ("info", "done")


async def test_a_json_line_per_retry_through_plain_stdlib_logging() -> None:
    wire = wires.WIRES[0]
    model = wire.make(
        answering(
            json_response(429, wire.error("rate_limit_error", "slow"), **{"retry-after": "1"}),
            json_response(200, wire.ok_json),
        )
    )
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    try:
        with json_lines(logging.INFO) as lines:
            await StateMachine([ModelInference()]).run(Runtime(store=store, model=model), "s")
    finally:
        await model.aclose()
    # At INFO: the retry and the yield, not the DEBUG cycle and model_call events.
    assert [line["event"] for line in lines] == ["model_retry", "yield"]
    retry = lines[0]
    assert (retry["status"], retry["retry_after"], retry["attempt"]) == (429, 1.0, 1)
    assert retry["level"] == "info"


async def test_configured_structlog_for_the_stdlib_gets_the_fields_too() -> None:
    structlog.configure(
        processors=[
            structlog.stdlib.add_log_level,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
        logger_factory=structlog.stdlib.LoggerFactory(),
    )
    try:
        with json_lines() as lines:
            # json_lines resets structlog on entry: configure again inside.
            structlog.configure(
                processors=[
                    structlog.stdlib.add_log_level,
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
                ],
                wrapper_class=structlog.stdlib.BoundLogger,
                logger_factory=structlog.stdlib.LoggerFactory(),
            )
            await tool_loop(MemoryStore())
    finally:
        structlog.reset_defaults()
    assert {line["event"] for line in lines} == {"model_call", "cycle", "tool_call", "yield"}
    (tool_line,) = [line for line in lines if line["event"] == "tool_call"]
    assert (tool_line["tool"], tool_line["outcome"], tool_line["level"]) == ("add", "ok", "debug")


class Counting(logging.Handler):
    """Counts what reaches it and what it formats."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.handled = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.handled += 1
        self.format(record)


async def test_with_logging_off_nothing_reaches_a_handler() -> None:
    structlog.reset_defaults()
    assert not structlog.is_configured()
    handler = Counting()
    target = logging.getLogger("stepmachine")
    old_level = target.level
    target.addHandler(handler)
    target.setLevel(logging.WARNING)
    try:
        await tool_loop(MemoryStore())
        assert handler.handled == 0
        # The same handler does see a WARNING event: the test can fail.
        store = MemoryStore()
        await crashed(store, "charge", {"amount": 5})
        machine = StateMachine([Tools([charge]), ModelInference()])
        await machine.run(Runtime(store=store, model=ScriptedModel([reply("unknown")])), "s")
        assert handler.handled == 1
    finally:
        target.removeHandler(handler)
        target.setLevel(old_level)


async def test_a_model_call_that_runs_out_of_attempts_reports_each_retry_then_the_failure() -> None:
    wire = wires.WIRES[-1]
    busy = [json_response(503, wire.error("overloaded_error", "busy")) for _ in range(3)]
    model = wire.make(answering(*busy), retry=RetryPolicy(max_attempts=3))
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    try:
        with capture_logs() as captured, pytest.raises(ProviderError):
            await StateMachine([ModelInference()]).run(Runtime(store=store, model=model), "s")
    finally:
        await model.aclose()
    assert [r["attempt"] for r in events(captured, "model_retry")] == [1, 2]
    (failed,) = events(captured, "model_call")
    assert (failed["log_level"], failed["attempts"]) == ("warning", 3)
    assert failed["error_type"] in {"OverloadedError", "ServerError"}


async def test_concurrent_runs_each_name_their_own_session_in_retry_events() -> None:
    wire = wires.WIRES[0]
    both_waiting = anyio.Event()
    waiting = 0

    def handler() -> Any:
        """429 once both runs are inside their first model call, then the reply."""
        answered = 0

        async def answer(request: httpx.Request) -> httpx.Response:
            nonlocal answered, waiting
            answered += 1
            if answered > 1:
                return json_response(200, wire.ok_json)
            waiting += 1
            if waiting == 2:
                both_waiting.set()
            await both_waiting.wait()
            return json_response(
                429, wire.error("rate_limit_error", "slow"), **{"retry-after": "1"}
            )

        return answer

    store = MemoryStore()
    models = []
    for session_id in ("left", "right"):
        await store.create(session_id, conversation=[Message.user("hi", id="u1")])
        models.append(wire.make(handler()))
    try:
        with capture_logs() as captured, anyio.fail_after(60):  # a deadlock guard
            async with anyio.create_task_group() as group:
                for session_id, model in zip(("left", "right"), models, strict=True):
                    runtime = Runtime(store=store, model=model)
                    group.start_soon(StateMachine([ModelInference()]).run, runtime, session_id)
    finally:
        for model in models:
            await model.aclose()
    retries = events(captured, "model_retry")
    assert sorted((r["session_id"], r["model"]) for r in retries) == [
        ("left", models[0].name),
        ("right", models[1].name),
    ]
    assert {e["session_id"] for e in captured} == {"left", "right"}  # none without a session


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
            await tool_loop_with_runtime(store, f"s{round_}", runtime)
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
    await tool_loop_with_runtime(
        store,
        "s",
        Runtime(store=store, model=ScriptedModel([call(("add", {"a": 1, "b": 2})), reply("3")])),
    )
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ""


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


async def tool_loop_with_runtime(store: Store, session_id: str, runtime: Runtime) -> None:
    await store.create(session_id, conversation=[Message.user("1 + 2?", id="u1")])
    await StateMachine([Tools([add]), ModelInference()]).run(runtime, session_id)
