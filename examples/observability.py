"""Seeing inside a run: OpenTelemetry spans and structured events, across two processes.

    python examples/observability.py [--db PATH] [--backend trio]

Runs a payment agent with approval on SQLite until it yields
``awaiting_approval``, approves the pending call, and resumes the run in a
second process (this script again, ``resume``). Each process traces into an
in-memory span exporter (``Telemetry(tracer_provider=...)``) and logs the
library's structured events through the standard-library logger
``stepmachine``, rendered as JSON lines by structlog's ``ProcessorFormatter``.
At the end it prints the span tree of both processes (the resumed run's
``invoke_agent`` span shows its link to the span that wrote the first run's
last batch) and every event as one JSON line.

With no provider configured the model is a stand-in (``FunctionModel``) that
decides from the history alone -- no network, no API key. Set
``OPENAI_API_KEY``, ``ANTHROPIC_API_KEY`` or ``OPENAI_COMPATIBLE_BASE_URL``
(and optionally ``STEPMACHINE_MODEL``) to use a real model. Content capture is
off: the spans and events carry names, ids, counts, timings and error types,
never the prompt, the reply or the tool's arguments and result.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import anyio
import structlog
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from stepmachine import (
    Message,
    Model,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    StateMachine,
    Telemetry,
    Tools,
    tool,
)
from stepmachine.operations import Approval, approve
from stepmachine.providers import (
    AnthropicModel,
    HTTPModel,
    OpenAIChatModel,
    OpenAICompatibleModel,
)
from stepmachine.stores import SQLiteStore
from stepmachine.testing import FunctionModel, call, reply

SESSION = "invoice-42"


@tool(thread=False)
def send_payment(to: str, amount_eur: int) -> str:
    """Send money to someone (needs approval)."""
    return f"paid {amount_eur} EUR to {to}"


def stand_in(request: ModelRequest) -> ModelResponse:
    """The stand-in model: asks to pay, then reports what happened. Stateless."""
    last = request.messages[-1]
    if last.role == "user":
        return call(("send_payment", {"to": "Alice", "amount_eur": 120}), text="Paying Alice.")
    (result,) = last.tool_results
    return reply(f"Done: {result.content}.")


def choose_model() -> Model:
    """A real provider when one is configured in the environment, else the stand-in."""
    chosen = os.environ.get("STEPMACHINE_MODEL")
    if os.environ.get("OPENAI_API_KEY"):
        return OpenAIChatModel(chosen or "gpt-4.1-mini")
    if os.environ.get("ANTHROPIC_API_KEY"):
        return AnthropicModel(chosen or "claude-haiku-4-5")
    if os.environ.get("OPENAI_COMPATIBLE_BASE_URL"):
        return OpenAICompatibleModel(chosen or "qwen3")
    return FunctionModel(stand_in, name="stand-in")


def agent() -> StateMachine[Any]:
    """The step list: the same in every process."""
    instructions = "Pay invoices with send_payment."
    return StateMachine(
        [
            Approval(["send_payment"]),
            Tools([send_payment]),
            ModelInference(instructions=instructions),
        ]
    )


# -- seeing inside: spans and events -------------------------------------------------------------


@contextmanager
def observed() -> Iterator[tuple[Telemetry, InMemorySpanExporter, io.StringIO]]:
    """Spans into an in-memory exporter; events as JSON lines into a string buffer."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    lines = io.StringIO()
    handler = logging.StreamHandler(lines)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(processor=structlog.processors.JSONRenderer())
    )
    logger = logging.getLogger("stepmachine")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield Telemetry(tracer_provider=provider), exporter, lines
    finally:
        logger.removeHandler(handler)
        provider.shutdown()


def span_data(span: ReadableSpan, process: int) -> dict[str, Any]:
    """A finished span as plain JSON data (ids in hex), tagged with its process."""
    return {
        "process": process,
        "name": span.name,
        "trace_id": f"{span.context.trace_id:032x}",
        "span_id": f"{span.context.span_id:016x}",
        "parent_id": None if span.parent is None else f"{span.parent.span_id:016x}",
        "start": span.start_time,
        "attributes": dict(span.attributes or {}),
        "links": [f"{link.context.span_id:016x}" for link in span.links],
    }


SHOWN = {
    "stepmachine.yield.kind": "yield",
    "stepmachine.refused": "refused",
    "stepmachine.outcome": "outcome",
    "gen_ai.usage.input_tokens": "in",
    "gen_ai.usage.output_tokens": "out",
    "gen_ai.response.finish_reasons": "finish",
    "gen_ai.tool.call.id": "call",
    "stepmachine.tool.outcome": "outcome",
    "error.type": "error",
}


def describe(span: dict[str, Any]) -> str:
    """A span's name and the attributes worth a glance."""
    shown = []
    for key, label in SHOWN.items():
        value = span["attributes"].get(key)
        if isinstance(value, list | tuple):
            value = ",".join(str(v) for v in value) or "-"
        if value is not None:
            shown.append(f"{label}={value}")
    name = str(span["name"])
    return name + (f"  [{' '.join(shown)}]" if shown else "")


def print_tree(spans: list[dict[str, Any]]) -> None:
    """Each process's spans as an indented tree; a link names the span it points to."""
    by_id = {s["span_id"]: s for s in spans}
    ordered = sorted(spans, key=lambda s: s["start"])

    def show(span: dict[str, Any], depth: int) -> None:
        print("  " * depth + describe(span))
        for target in span["links"]:
            known = by_id.get(target)
            where = f"{known['name']} in process {known['process']}" if known else "not shown"
            print("  " * depth + f"  -> linked to span {target} ({where})")
        if span["name"].startswith("invoke_agent") and not span["links"]:
            print("  " * depth + "  -> no link (nothing stored names an earlier run's span)")
        for child in ordered:
            if child["parent_id"] == span["span_id"]:
                show(child, depth + 1)

    print("spans:")
    for process in sorted({s["process"] for s in spans}):
        roots = [s for s in ordered if s["process"] == process and s["parent_id"] is None]
        for root in roots:
            print(f" process {process}, trace {root['trace_id']}:")
            show(root, 1)


# -- the two processes ---------------------------------------------------------------------------


async def first_run(db: Path, model: Model, telemetry: Telemetry) -> list[str]:
    """Process 1: run until the approval, then approve the pending call."""
    approved: list[str] = []
    async with await SQLiteStore.open(db) as store:
        await store.create(
            SESSION, conversation=[Message.user("Please pay Alice's invoice (120 EUR).", id="u1")]
        )
        report = await agent().run_report(
            Runtime(store=store, model=model, telemetry=telemetry), SESSION
        )
        print(f"process 1: run yielded {report.reason.kind}")
        for item in report.reason.data.get("calls", []):
            await approve(store, SESSION, item["call_id"], by="operator")
            approved.append(item["call_id"])
            print(f"process 1: approved {item['name']} ({item['call_id']}) by operator")
    return approved


async def resume(db: Path, out: Path) -> None:
    """Process 2: resume the session; write its spans and events to ``out``."""
    model = choose_model()
    try:
        with observed() as (telemetry, exporter, lines):
            async with await SQLiteStore.open(db) as store:
                runtime = Runtime(store=store, model=model, telemetry=telemetry)
                report = await agent().run_report(runtime, SESSION)
            spans = [span_data(s, 2) for s in exporter.get_finished_spans()]
    finally:
        if isinstance(model, HTTPModel):
            await model.aclose()
    result = {
        "kind": report.reason.kind,
        "answer": report.session.conversation[-1].text,
        "spans": spans,
        "events": lines.getvalue().splitlines(),
    }
    await anyio.Path(out).write_text(json.dumps(result), encoding="utf-8")


async def demo(db: Path, backend: str) -> None:
    model = choose_model()
    print(f"model: {model.name}")
    try:
        with observed() as (telemetry, exporter, lines):
            await first_run(db, model, telemetry)
            spans = [span_data(s, 1) for s in exporter.get_finished_spans()]
    finally:
        if isinstance(model, HTTPModel):
            await model.aclose()
    events = lines.getvalue().splitlines()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "process-2.json"
        command = [sys.executable, __file__, "--backend", backend, "resume", str(db), str(out)]
        await anyio.run_process(command, stdout=None, stderr=None, check=True)
        second = json.loads(await anyio.Path(out).read_text(encoding="utf-8"))
    print(f"process 2: run returned {second['kind']}")
    print(f"final answer: {second['answer']}")
    print()
    print_tree(spans + second["spans"])
    print()
    print("events (JSON lines, logger 'stepmachine'):")
    for process, process_events in ((1, events), (2, second["events"])):
        print(f" process {process}")
        for line in process_events:
            print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    commands = parser.add_subparsers(dest="command")
    resume_cmd = commands.add_parser("resume", help="(the second process) resume the run")
    resume_cmd.add_argument("db", type=Path)
    resume_cmd.add_argument("out", type=Path)
    parser.add_argument("--db", type=Path, help="the SQLite file (default: a temporary one)")
    args = parser.parse_args()
    backend: Literal["asyncio", "trio"] = args.backend
    if args.command == "resume":
        anyio.run(resume, args.db, args.out, backend=backend)
        return
    if args.db is not None:
        anyio.run(demo, args.db, backend, backend=backend)
        return
    with tempfile.TemporaryDirectory() as folder:
        anyio.run(demo, Path(folder) / "observability.sqlite3", backend, backend=backend)


if __name__ == "__main__":
    main()
