"""What the machine costs on top of the model and tool work it drives.

A scripted agent on a :class:`~stepmachine.stores.MemoryStore`: every round
the user's message is appended with :func:`stepmachine.submit`, then
``machine.run()`` goes inference (a tool call) -> tools (the result) ->
inference (the answer) -> yield. That is three machine cycles per round.

The "bare" side does the same model and tool work without the machine: it
calls the same :class:`~stepmachine.testing.FunctionModel` ``request`` and the
same tool function directly, building the same messages in a list: no store,
no effects, no steps.

Both sides run interleaved in one process (machine, bare, machine, bare, ...)
so that a noisy, shared machine slows both alike; the figures to compare are
the ratios. Each repetition is one fresh session of ``--rounds`` rounds
(conversations stay short and equal across repetitions); the reported
figure is the median over repetitions of the time per machine cycle
(round time / 3), for both sides.

Fast path: ``NullEmitter``, deterministic ids (``counter_ids``), a fixed
clock, a non-streaming ``ModelInference`` (``--stream`` streams) and a tool
run inline (``thread=False``; ``--thread`` runs it in a worker thread).

Run:  python benchmarks/cycle.py [--quick] [--backend trio] [--profile]

The last line is ``cycle_us=<median> bare_us=<median>``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio

from stepmachine import (
    AppendMessage,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    NullEmitter,
    PromptPart,
    Runtime,
    StateMachine,
    Tool,
    ToolCallPart,
    ToolResultPart,
    Tools,
    counter_ids,
    submit,
    tool,
)
from stepmachine.stores import MemoryStore
from stepmachine.testing import FunctionModel, call, reply

CYCLES_PER_ROUND = 3  # inference (tool call), tools, inference (answer)
INSTRUCTIONS = "You answer questions by looking them up."
SESSION_ID = "bench"


def lookup_value(key: str) -> str:
    """Look up the value stored under ``key``."""
    return f"value of {key}"


def decide(request: ModelRequest) -> ModelResponse:
    """The scripted model: call ``lookup`` for a user message, answer after the result."""
    last = request.messages[-1]
    if last.role == "user":
        return call(("lookup_value", {"key": last.text}))
    return reply(f"The answer is: {last.tool_results[0].content}")


def fixed_clock() -> float:
    """A constant clock: batches are stamped identically in every run."""
    return 1_700_000_000.0


@dataclass(frozen=True)
class Options:
    """The command line, parsed."""

    backend: str
    rounds: int
    repetitions: int
    warmup: int
    stream: bool
    thread: bool
    profile: bool
    profile_top: int
    long_rounds: int
    long_repetitions: int
    tool: Tool


# -- the two sides -----------------------------------------------------------------


async def machine_session(opts: Options, rounds: int) -> tuple[int, list[Message]]:
    """One fresh session of ``rounds`` rounds through the machine; (ns, conversation)."""
    lookup = opts.tool
    store = MemoryStore()
    ids = counter_ids()
    runtime = Runtime(store=store, model=FunctionModel(decide), ids=ids, clock=fixed_clock)
    machine: StateMachine[Any] = StateMachine(
        [Tools([lookup]), ModelInference(instructions=INSTRUCTIONS, stream=opts.stream)]
    )
    emitter = NullEmitter()
    await store.create(SESSION_ID)
    start = time.perf_counter_ns()
    for r in range(rounds):
        user = Message.user(f"question {r}", id=ids())
        await submit(store, SESSION_ID, [AppendMessage(user)], clock=fixed_clock)
        await machine.run(runtime, SESSION_ID, emitter)
    elapsed = time.perf_counter_ns() - start
    session = await store.load(SESSION_ID)
    return elapsed, list(session.conversation)


async def bare_session(opts: Options, rounds: int) -> tuple[int, list[Message]]:
    """The same model and tool work, called directly; (ns, messages built)."""
    lookup = opts.tool
    model = FunctionModel(decide)
    ids = counter_ids()
    definitions = (lookup.definition,)
    prompt = (PromptPart(source="inference", text=INSTRUCTIONS),)
    on_chunk = _drop_chunk if opts.stream else None
    messages: list[Message] = []
    start = time.perf_counter_ns()
    for r in range(rounds):
        messages.append(Message.user(f"question {r}", id=ids()))
        request = ModelRequest(messages=tuple(messages), tools=definitions, prompt_parts=prompt)
        response = await model.request(request, on_chunk=on_chunk)
        messages.append(Message(id=ids(), role="assistant", parts=response.parts))
        for part in response.parts:
            if isinstance(part, ToolCallPart):
                content = lookup_value(**part.arguments)
                result = ToolResultPart(call_id=part.call_id, content=content, name=part.name)
                messages.append(Message(id=ids(), role="tool", parts=(result,)))
        request = ModelRequest(messages=tuple(messages), tools=definitions, prompt_parts=prompt)
        response = await model.request(request, on_chunk=on_chunk)
        messages.append(Message(id=ids(), role="assistant", parts=response.parts))
    elapsed = time.perf_counter_ns() - start
    return elapsed, messages


async def _drop_chunk(chunk: object) -> None:
    """The bare side's chunk sink when streaming: drop every chunk."""


def same_work(machine: list[Message], bare: list[Message]) -> None:
    """Check that both sides built the same conversation (roles, texts, results)."""

    def shape(messages: list[Message]) -> list[tuple[str, str, tuple[str, ...]]]:
        return [
            (
                m.role,
                m.text,
                tuple(r.content for r in m.tool_results)
                + tuple(c.raw_arguments for c in m.tool_calls),
            )
            for m in messages
        ]

    if shape(machine) != shape(bare):
        raise SystemExit("the machine and bare sides did not build the same conversation")


# -- measuring ---------------------------------------------------------------------


async def measure(
    opts: Options, rounds: int, repetitions: int, warmup: int
) -> tuple[list[float], list[float]]:
    """Interleaved repetitions; per-cycle microseconds for (machine, bare)."""
    _, machine_conv = await machine_session(opts, rounds)
    _, bare_conv = await bare_session(opts, rounds)
    same_work(machine_conv, bare_conv)
    for _ in range(warmup):
        await machine_session(opts, rounds)
        await bare_session(opts, rounds)
    per_cycle = rounds * CYCLES_PER_ROUND * 1_000
    machine_us: list[float] = []
    bare_us: list[float] = []
    for _ in range(repetitions):
        gc.collect()
        ns, _ = await machine_session(opts, rounds)
        machine_us.append(ns / per_cycle)
        gc.collect()
        ns, _ = await bare_session(opts, rounds)
        bare_us.append(ns / per_cycle)
    return machine_us, bare_us


def describe(name: str, samples: list[float]) -> str:
    """Median, quartiles and minimum of a list of microsecond figures."""
    q1, _, q3 = statistics.quantiles(samples, n=4) if len(samples) > 1 else samples * 3
    return (
        f"  {name:8s} median {statistics.median(samples):9.2f} us/cycle   "
        f"q1 {q1:9.2f}   q3 {q3:9.2f}   min {min(samples):9.2f}   n={len(samples)}"
    )


KERNEL_FILES = r"/(stepmachine|stores|operations)/"


async def profile(opts: Options) -> None:
    """cProfile the machine path once; print top entries, overall and kernel-only."""
    for _ in range(opts.warmup):
        await machine_session(opts, opts.rounds)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(opts.repetitions):
        await machine_session(opts, opts.rounds)
    profiler.disable()
    for title, order, restriction in (
        ("cumulative, everything", "cumulative", ()),
        ("cumulative, stepmachine files only", "cumulative", (KERNEL_FILES,)),
        ("own time, everything", "tottime", ()),
    ):
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out).sort_stats(order)
        stats.print_stats(*restriction, opts.profile_top)
        print(f"== profile: {title} ==")
        print(out.getvalue().replace("/work/main/", ""))


def run_async(fn: Callable[[], Awaitable[Any]], backend: str) -> Any:
    """Run ``fn()`` on the chosen anyio backend."""
    return anyio.run(fn, backend=backend)


def parse(argv: list[str]) -> Options:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n", 1)[0])
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--quick", action="store_true", help="a short run (a few seconds)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds per session")
    parser.add_argument("--repetitions", type=int, default=None, help="timed sessions per side")
    parser.add_argument("--warmup", type=int, default=None, help="untimed sessions per side")
    parser.add_argument(
        "--long-rounds", type=int, default=100, help="rounds per session of the long-session line"
    )
    parser.add_argument(
        "--long-repetitions", type=int, default=None, help="timed long sessions per side (0: skip)"
    )
    parser.add_argument("--stream", action="store_true", help="stream model responses")
    parser.add_argument("--thread", action="store_true", help="run the tool in a worker thread")
    parser.add_argument("--profile", action="store_true", help="cProfile the machine path first")
    parser.add_argument("--profile-top", type=int, default=30, help="profile rows to print")
    args = parser.parse_args(argv)
    repetitions = args.repetitions or (200 if args.quick else 2_000)
    warmup = args.warmup if args.warmup is not None else (10 if args.quick else 50)
    long_repetitions = args.long_repetitions
    if long_repetitions is None:
        long_repetitions = 5 if args.quick else 40
    if args.rounds < 1 or repetitions < 1 or args.long_rounds < 1:
        parser.error("--rounds, --long-rounds and --repetitions must be at least 1")
    return Options(
        backend=args.backend,
        rounds=args.rounds,
        repetitions=repetitions,
        warmup=warmup,
        stream=args.stream,
        thread=args.thread,
        profile=args.profile,
        profile_top=args.profile_top,
        long_rounds=args.long_rounds,
        long_repetitions=long_repetitions,
        tool=tool(thread=args.thread)(lookup_value),
    )


def main(argv: list[str]) -> None:
    """Measure, print the details, then the summary line last."""
    opts = parse(argv)
    print(
        f"cycle benchmark: backend={opts.backend} python={sys.version.split()[0]} "
        f"stream={opts.stream} thread={opts.thread} warmup={opts.warmup} sessions/side"
    )
    if opts.profile:
        run_async(lambda: profile(opts), opts.backend)
    if opts.long_repetitions:
        rounds = opts.long_rounds
        machine_us, bare_us = run_async(
            lambda: measure(opts, rounds, opts.long_repetitions, min(opts.warmup, 3)), opts.backend
        )
        print(
            f"long sessions: {rounds} rounds = {rounds * CYCLES_PER_ROUND} cycles, "
            f"up to {rounds * 4} messages"
        )
        print(describe("machine", machine_us))
        print(describe("bare", bare_us))
        ratio = statistics.median(machine_us) / statistics.median(bare_us)
        print(f"  ratio machine/bare: {ratio:.2f}x")
    machine_us, bare_us = run_async(
        lambda: measure(opts, opts.rounds, opts.repetitions, opts.warmup), opts.backend
    )
    cycle = statistics.median(machine_us)
    bare = statistics.median(bare_us)
    print(
        f"short sessions: {opts.rounds} rounds = {opts.rounds * CYCLES_PER_ROUND} cycles, "
        f"up to {opts.rounds * 4} messages"
    )
    print(describe("machine", machine_us))
    print(describe("bare", bare_us))
    print(
        f"  per round (submit + run = {CYCLES_PER_ROUND} cycles): machine "
        f"{cycle * CYCLES_PER_ROUND:.2f} us, bare {bare * CYCLES_PER_ROUND:.2f} us"
    )
    print(f"  machine overhead per cycle: {cycle - bare:.2f} us")
    print(f"ratio machine/bare: {cycle / bare:.2f}x")
    print(f"cycle_us={cycle:.2f} bare_us={bare:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
