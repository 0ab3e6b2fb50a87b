"""What seeing inside a run costs: events and spans off, events on, spans on.

The agent of ``cycle.py`` (a scripted model that calls one tool, then answers;
three machine cycles per round, a :class:`~stepmachine.stores.MemoryStore`),
run four ways, interleaved in one process so a noisy machine slows all alike:

* ``off``: nothing configured (the library's default: one level check per event,
  one tracer-provider check per run);
* ``events``: the logger ``stepmachine`` at DEBUG with a handler that renders
  every event as a JSON line (``structlog.stdlib.ProcessorFormatter`` with
  ``JSONRenderer``) into memory;
* ``spans``: a ``TracerProvider`` with a ``SimpleSpanProcessor`` into an
  ``InMemorySpanExporter`` (cleared after each session), via ``Telemetry``;
* ``both``.

Prints the median time per machine cycle of each and the ratios to ``off``.
Needs the ``otel`` extra (the SDK).

Run:  python benchmarks/observability.py [--quick] [--backend trio]

The last line is ``off_us=<us> events_over_off=<r> spans_over_off=<r> both_over_off=<r>``.
"""

from __future__ import annotations

import argparse
import io
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio
import structlog
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from stepmachine import (
    AppendMessage,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    StateMachine,
    Telemetry,
    Tools,
    submit,
    tool,
)
from stepmachine.extend import counter_ids
from stepmachine.stores import MemoryStore
from stepmachine.testing import FunctionModel, call, reply


@tool(thread=False)
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def model(request: ModelRequest) -> ModelResponse:
    if request.messages[-1].role == "user":
        return call(("add", {"a": 2, "b": 3}))
    return reply("5")


class Setup:
    """One way of running the agent."""

    def __init__(self, name: str, *, events: bool, spans: bool) -> None:
        self.name = name
        self.events = events
        self.exporter = InMemorySpanExporter()
        provider = None
        if spans:
            provider = TracerProvider()
            provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.telemetry = Telemetry(tracer_provider=provider)
        self.sink = io.StringIO()
        self.handler = logging.StreamHandler(self.sink)
        self.handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(processor=structlog.processors.JSONRenderer())
        )
        self.per_cycle: list[float] = []

    def __enter__(self) -> Setup:
        if self.events:
            logger = logging.getLogger("stepmachine")
            logger.addHandler(self.handler)
            logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc: object) -> None:
        logger = logging.getLogger("stepmachine")
        logger.removeHandler(self.handler)
        logger.setLevel(logging.NOTSET)
        self.sink.seek(0)
        self.sink.truncate()
        self.exporter.clear()


async def session(setup: Setup, machine: StateMachine[Any], index: int, rounds: int) -> float:
    """One fresh session of ``rounds`` rounds; seconds per machine cycle."""
    store = MemoryStore()
    runtime = Runtime(
        store=store,
        model=FunctionModel(model, name="bench"),
        ids=counter_ids(),
        clock=lambda: 1.7e9,
        telemetry=setup.telemetry,
    )
    session_id = f"s{index}"
    await store.create(session_id)
    started = time.perf_counter()
    for turn in range(rounds):
        message = Message.user("2 + 3?", id=f"u{turn}")
        await submit(store, session_id, [AppendMessage(message)])
        await machine.run(runtime, session_id)
    elapsed = time.perf_counter() - started
    return elapsed / (rounds * 3)


async def main(repetitions: int, rounds: int) -> None:
    machine = StateMachine([Tools([add]), ModelInference(stream=False)])
    setups = [
        Setup("off", events=False, spans=False),
        Setup("events", events=True, spans=False),
        Setup("spans", events=False, spans=True),
        Setup("both", events=True, spans=True),
    ]
    for warm in range(3):
        for setup in setups:
            with setup:
                await session(setup, machine, warm, rounds)
    for index in range(repetitions):
        for setup in setups:
            with setup:
                setup.per_cycle.append(await session(setup, machine, index, rounds))
    medians: dict[str, float] = {s.name: statistics.median(s.per_cycle) * 1e6 for s in setups}
    for name, value in medians.items():
        print(f"  {name:7s} {value:8.2f} us/cycle   x{value / medians['off']:.2f}")
    off = medians["off"]
    ratio: Callable[[str], str] = lambda name: f"{medians[name] / off:.2f}"  # noqa: E731
    print(
        f"off_us={off:.2f} events_over_off={ratio('events')} "
        f"spans_over_off={ratio('spans')} both_over_off={ratio('both')}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (a few seconds)")
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    parser.add_argument("--repetitions", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    repetitions = 10 if args.quick else args.repetitions
    print(f"observability benchmark: backend={args.backend} repetitions={repetitions}")
    anyio.run(main, repetitions, args.rounds, backend=args.backend)
