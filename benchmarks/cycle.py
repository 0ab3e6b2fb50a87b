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
    Session,
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


async def machine_session(opts: Options, rounds: int) -> tuple[list[int], Session[Any], int]:
    """One fresh session of ``rounds`` rounds through the machine.

    Returns the nanoseconds of each round, the session, and the machine cycles run.
    """
    lookup = opts.tool
    store = MemoryStore()
    ids = counter_ids()
    runtime = Runtime(store=store, model=FunctionModel(decide), ids=ids, clock=fixed_clock)
    machine: StateMachine[Any] = StateMachine(
        [Tools([lookup]), ModelInference(instructions=INSTRUCTIONS, stream=opts.stream)]
    )
    emitter = NullEmitter()
    await store.create(SESSION_ID)
    cycles = 0
    elapsed: list[int] = []
    for r in range(rounds):
        start = time.perf_counter_ns()
        user = Message.user(f"question {r}", id=ids())
        await submit(store, SESSION_ID, [AppendMessage(user)], clock=fixed_clock)
        report = await machine.run_report(runtime, SESSION_ID, emitter)
        elapsed.append(time.perf_counter_ns() - start)
        cycles += len(report.results)
    return elapsed, await store.load(SESSION_ID), cycles


async def bare_session(opts: Options, rounds: int) -> tuple[list[int], list[Message]]:
    """The same model and tool work, called directly; (ns of each round, messages built)."""
    lookup = opts.tool
    model = FunctionModel(decide)
    ids = counter_ids()
    definitions = (lookup.definition,)
    prompt = (PromptPart(source="inference", text=INSTRUCTIONS),)
    on_chunk = _drop_chunk if opts.stream else None
    messages: list[Message] = []
    elapsed: list[int] = []
    for r in range(rounds):
        start = time.perf_counter_ns()
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
        elapsed.append(time.perf_counter_ns() - start)
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


@dataclass(frozen=True)
class Samples:
    """One side's timings: ``rounds[s][r]`` is round ``r`` of session ``s``, in ns."""

    rounds: list[list[int]]

    @property
    def per_cycle_us(self) -> float:
        """The headline figure: for each round index the median over sessions, summed,
        per machine cycle. A session preempted by another process (shared machines)
        spoils one round of it, not the figure."""
        count = len(self.rounds[0])
        medians = [statistics.median(s[r] for s in self.rounds) for r in range(count)]
        return sum(medians) / (count * CYCLES_PER_ROUND * 1_000)

    @property
    def sessions_us(self) -> list[float]:
        """Per session: its whole time per machine cycle (preemptions included)."""
        return [sum(s) / (len(s) * CYCLES_PER_ROUND * 1_000) for s in self.rounds]


async def measure(
    opts: Options, rounds: int, repetitions: int, warmup: int
) -> tuple[Samples, Samples]:
    """Interleaved repetitions of both sides: (machine, bare)."""
    _, session, cycles = await machine_session(opts, rounds)
    _, bare_conv = await bare_session(opts, rounds)
    same_work(list(session.conversation), bare_conv)
    if cycles != rounds * CYCLES_PER_ROUND:
        raise SystemExit(f"expected {CYCLES_PER_ROUND} machine cycles per round, got {cycles}")
    print(
        f"  {rounds} rounds: {cycles} machine cycles, {session.revision} batches "
        f"({session.revision / rounds:g} per round, submit included), "
        f"{len(session.conversation)} messages"
    )
    for _ in range(warmup):
        await machine_session(opts, rounds)
        await bare_session(opts, rounds)
    machine_ns: list[list[int]] = []
    bare_ns: list[list[int]] = []
    # The garbage collector stays on (its cost is part of the cost), but what
    # was allocated before timing is frozen out of its reach.
    gc.collect()
    gc.freeze()
    for _ in range(repetitions):
        machine_ns.append((await machine_session(opts, rounds))[0])
        bare_ns.append((await bare_session(opts, rounds))[0])
    gc.unfreeze()
    return Samples(machine_ns), Samples(bare_ns)


def describe(name: str, samples: Samples) -> str:
    """The headline figure, then quartiles and minimum of whole sessions."""
    whole = samples.sessions_us
    q1, median, q3 = statistics.quantiles(whole, n=4) if len(whole) > 1 else whole * 3
    return (
        f"  {name:8s} {samples.per_cycle_us:9.2f} us/cycle   whole sessions: "
        f"median {median:9.2f}  q1 {q1:9.2f}  q3 {q3:9.2f}  min {min(whole):9.2f}  "
        f"n={len(whole)}"
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
        machine, bare = run_async(
            lambda: measure(opts, rounds, opts.long_repetitions, min(opts.warmup, 3)), opts.backend
        )
        print(
            f"long sessions: {rounds} rounds = {rounds * CYCLES_PER_ROUND} cycles, "
            f"up to {rounds * 4} messages"
        )
        print(describe("machine", machine))
        print(describe("bare", bare))
        print(f"  ratio machine/bare: {machine.per_cycle_us / bare.per_cycle_us:.2f}x")
    machine, bare = run_async(
        lambda: measure(opts, opts.rounds, opts.repetitions, opts.warmup), opts.backend
    )
    cycle, bare_us = machine.per_cycle_us, bare.per_cycle_us
    print(
        f"short sessions: {opts.rounds} rounds = {opts.rounds * CYCLES_PER_ROUND} cycles, "
        f"up to {opts.rounds * 4} messages"
    )
    print(describe("machine", machine))
    print(describe("bare", bare))
    print(
        f"  per round (submit + run = {CYCLES_PER_ROUND} cycles): machine "
        f"{cycle * CYCLES_PER_ROUND:.2f} us, bare {bare_us * CYCLES_PER_ROUND:.2f} us"
    )
    print(f"  machine overhead per cycle: {cycle - bare_us:.2f} us")
    print(f"ratio machine/bare: {cycle / bare_us:.2f}x")
    print(f"cycle_us={cycle:.2f} bare_us={bare_us:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
