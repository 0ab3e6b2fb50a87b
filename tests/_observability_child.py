"""The agent of the two-process span test, and its second process (not a test module).

    python tests/_observability_child.py DB SESSION OUT [--backend trio]

resumes session ``SESSION`` of the SQLite file ``DB`` with the same step list
the test's first process ran, under a tracer provider of its own with an
in-memory exporter, and writes the finished spans to ``OUT`` as JSON (a list
of ``{name, trace_id, span_id, parent_id, attributes, links}``; ids in hex).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import anyio
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from stepmachine import (
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    StateMachine,
    Telemetry,
    Tools,
    tool,
)
from stepmachine.operations import Approval
from stepmachine.stores import SQLiteStore
from stepmachine.testing import FunctionModel, call, reply


@tool(thread=False)
def send_payment(to: str, amount_eur: int) -> str:
    """Send money (needs approval)."""
    return f"paid {amount_eur} EUR to {to}"


def model(request: ModelRequest) -> ModelResponse:
    """Asks to pay, then reports the result; decides from the history alone."""
    last = request.messages[-1]
    if last.role == "user":
        return call(("send_payment", {"to": "Alice", "amount_eur": 120}))
    (result,) = last.tool_results
    return reply(f"Done: {result.content}.")


def agent() -> StateMachine[Any]:
    """The same step list in both processes."""
    return StateMachine(
        [Approval(["send_payment"]), Tools([send_payment]), ModelInference()],
    )


def runtime(store: SQLiteStore, telemetry: Telemetry) -> Runtime:
    return Runtime(store=store, model=FunctionModel(model, name="stand-in"), telemetry=telemetry)


def as_json(span: ReadableSpan) -> dict[str, Any]:
    """One finished span as plain JSON data."""
    return {
        "name": span.name,
        "trace_id": f"{span.context.trace_id:032x}",
        "span_id": f"{span.context.span_id:016x}",
        "parent_id": None if span.parent is None else f"{span.parent.span_id:016x}",
        "attributes": dict(span.attributes or {}),
        "links": [
            {
                "trace_id": f"{link.context.trace_id:032x}",
                "span_id": f"{link.context.span_id:016x}",
                "attributes": dict(link.attributes or {}),
            }
            for link in span.links
        ],
    }


async def resume(db: Path, session_id: str, out: Path) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with await SQLiteStore.open(db) as store:
        report = await agent().run_report(
            runtime(store, Telemetry(tracer_provider=provider)), session_id
        )
    spans = [as_json(s) for s in exporter.get_finished_spans()]
    data = json.dumps({"kind": report.reason.kind, "spans": spans})
    await anyio.Path(out).write_text(data, encoding="utf-8")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("db", type=Path)
    parser.add_argument("session")
    parser.add_argument("out", type=Path)
    parser.add_argument("--backend", default="asyncio")
    args = parser.parse_args()
    anyio.run(resume, args.db, args.session, args.out, backend=args.backend)
