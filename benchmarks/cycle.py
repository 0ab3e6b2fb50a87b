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

**Growth with the history** (issue 9): what one agent step costs at turn
2,000 of a natural session, divided by what it costs at turn 20, on the
memory store. The words are those of issue 9's table:

* the agent is the same as above, with **500-byte user messages** (so the
  tool call's arguments, the tool's result and the answer are about 500 bytes
  each too) and **one tool**;
* an **agent step** is a model turn plus a tool turn: the user's message goes
  in (``submit``), the model turn calls the tool, the tool turn runs it, and
  the model turn that answers ends it; four messages, three machine cycles,
  one ``submit`` + ``machine.run`` (as in ``peers.py``);
* a **turn** is one such round of the conversation: "at turn N" is the step
  taken on a session that already holds N rounds (4N messages).

The long session is *natural*: grown to ``--growth-turns`` (2,000) turns by
the machine itself, step by step, so it holds everything a real session
does (journal notes, every batch in the store's log), not messages written
directly. Then ``--growth-samples`` (60) steps at turn 2,000 (on that
session, which grows by 3% while measured) and as many at turn 20 (each on a
fresh session grown to 20 turns untimed) are timed interleaved, one of each
in turn. The collector stays on, but what was allocated before timing is
frozen out of its reach (``gc.freeze``, as for ``cycle_us``).
``growth_2000_over_20`` is the median CPU time (``time.process_time_ns``) of
a step at turn 2,000 divided by that of a step at turn 20: on the memory
store the work is all CPU, and on a loaded machine a 100 ms step is
preempted many times where a 1 ms step rarely is, so wall-clock time would
inflate the ratio (it is printed beside it). Growing the long session prints
the step cost along the way (medians of the last 10 steps).

**Growth with operations on** (``growth_ops_2000_over_20``): the same
figure for the same agent with the built-in operations a production agent
runs before its tools and its model -- ``Budget`` with tool-call limits (per
turn and per session), ``Approval`` for a tool the agent never calls,
``HistoryGuard`` -- and tracing on (a ``TracerProvider`` exporting to an
``InMemorySpanExporter``, cleared after each step, untimed). Still three
machine cycles per step: the operations refuse.

**What still grows**: one thing on a step's path is O(history) by design: a
``ModelRequest`` holds its messages as a tuple (so that ``msgspec.json.encode``
encodes a request without hooks), copied from the session's
:class:`~stepmachine.Conversation` once per model call, twice per step: one
pointer per message, and one reference count touched per message (a cache miss
each once the history outgrows the cache). A provider adapter then encodes every
one of those messages anyway, so with a real model this is a small part of the
call; with the scripted model here it is most of the growth. Each growth
figure's block prints that copy timed alone (``ModelRequest(messages=...)`` on
each end's session, warm cache): a floor of what it adds in a step, where the
cache is colder.

Run:  python benchmarks/cycle.py [--quick] [--backend trio] [--profile]

The last line is ``cycle_us=<median> bare_us=<median> growth_2000_over_20=<ratio>
growth_ops_2000_over_20=<ratio>``.
With ``--quick`` (or ``--growth-turns``) the long session is shorter; the
figure keeps its name.
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
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from stepmachine import (
    AppendMessage,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    PromptPart,
    Runtime,
    Session,
    StateMachine,
    Step,
    Telemetry,
    Tool,
    ToolCallPart,
    ToolResultPart,
    Tools,
    submit,
    tool,
)
from stepmachine.extend import NullEmitter, counter_ids
from stepmachine.operations import Approval, Budget, HistoryGuard, Limits
from stepmachine.stores import MemoryStore
from stepmachine.testing import FunctionModel, call, reply

CYCLES_PER_ROUND = 3  # inference (tool call), tools, inference (answer)
INSTRUCTIONS = "You answer questions by looking them up."
SESSION_ID = "bench"
MESSAGE_BYTES = 500  # user messages of the growth measurement (as in peers.py)
GROWTH_SHORT_TURNS = 20


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
    growth_turns: int
    growth_samples: int
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


# -- growth with the history (issue 9) ---------------------------------------------


def user_text(turn: int) -> str:
    """The user's message of turn ``turn``: ``MESSAGE_BYTES`` bytes."""
    head = f"question {turn}: "
    return head + "x" * (MESSAGE_BYTES - len(head))


def operations(opts: Options) -> list[Step[Any]]:
    """The agent's steps with operations on (the ``growth_ops`` figure).

    Budget with tool-call limits (per turn and per session, never reached, so
    that it counts every cycle), an Approval step for a tool this agent never
    calls (it reads the open calls, and ``check_call`` vets every call), the
    tool step, HistoryGuard, then inference: three cycles per step, as without.
    """
    return [
        Budget(
            per_turn=Limits(tool_calls=1_000, model_calls=1_000),
            per_session=Limits(tool_calls=10**9, model_calls=10**9),
        ),
        Approval(["transfer_money"]),
        Tools([opts.tool]),
        HistoryGuard(),
        ModelInference(instructions=INSTRUCTIONS, stream=opts.stream),
    ]


class Traced:
    """Tracing on: a ``TracerProvider`` exporting every span to memory (cleared per step)."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.telemetry = Telemetry(tracer_provider=provider)


class GrowingSession:
    """One natural session on its own ``MemoryStore``, advanced one agent step at a time.

    With ``ops``, the machine runs :func:`operations` with tracing on (:class:`Traced`).
    """

    def __init__(self, opts: Options, *, ops: bool = False) -> None:
        self.store = MemoryStore()
        self.ids = counter_ids()
        self.traced = Traced() if ops else None
        self.runtime = Runtime(
            store=self.store,
            model=FunctionModel(decide),
            ids=self.ids,
            clock=fixed_clock,
            telemetry=self.traced.telemetry if self.traced is not None else Telemetry(),
        )
        steps: list[Step[Any]] = (
            operations(opts)
            if ops
            else [Tools([opts.tool]), ModelInference(instructions=INSTRUCTIONS, stream=opts.stream)]
        )
        self.machine: StateMachine[Any] = StateMachine(steps)
        self.emitter = NullEmitter()
        self.turns = 0

    async def start(self) -> GrowingSession:
        """Create the session (empty: turn 0)."""
        await self.store.create(SESSION_ID)
        return self

    async def step(self) -> tuple[int, int]:
        """One agent step (submit + run); returns its (CPU, wall-clock) nanoseconds."""
        start, cpu_start = time.perf_counter_ns(), time.process_time_ns()
        user = Message.user(user_text(self.turns), id=self.ids())
        await submit(self.store, SESSION_ID, [AppendMessage(user)], clock=fixed_clock)
        report = await self.machine.run_report(self.runtime, SESSION_ID, self.emitter)
        elapsed = (time.process_time_ns() - cpu_start, time.perf_counter_ns() - start)
        if len(report.results) != CYCLES_PER_ROUND:
            raise SystemExit(
                f"turn {self.turns}: expected {CYCLES_PER_ROUND} machine cycles per step, "
                f"got {len(report.results)}"
            )
        if self.traced is not None:
            if not self.traced.exporter.get_finished_spans():
                raise SystemExit(f"turn {self.turns}: tracing is on, yet no span was exported")
            self.traced.exporter.clear()  # untimed: only the spans of one step are kept
        self.turns += 1
        return elapsed

    async def check(self) -> None:
        """Check the conversation: four messages per turn, the tool's result answered."""
        session = await self.store.load(SESSION_ID)
        conversation = session.conversation
        if len(conversation) != 4 * self.turns:
            raise SystemExit(
                f"the session holds {len(conversation)} messages after {self.turns} turns, "
                f"expected {4 * self.turns}"
            )
        last = conversation[-1]
        if last.text != f"The answer is: value of {user_text(self.turns - 1)}":
            raise SystemExit(f"unexpected final answer at turn {self.turns}: {last.text[:60]!r}")


@dataclass(frozen=True)
class Growth:
    """Steps at the long turn and at the short turn, (CPU, wall) ns, and the growth curve."""

    ops: bool
    long_turns: int
    long_ns: list[tuple[int, int]]
    short_ns: list[tuple[int, int]]
    curve: list[tuple[int, float]]
    request_us: tuple[float, float]  # building one ModelRequest: (long session, short), us

    def median_us(self, samples: list[tuple[int, int]], clock: int) -> float:
        """The median of one clock (0: CPU, 1: wall) over ``samples``, in us."""
        return statistics.median(s[clock] for s in samples) / 1_000

    @property
    def ratio(self) -> float:
        """Median CPU time of a step at the long turn / at the short turn."""
        return self.median_us(self.long_ns, 0) / self.median_us(self.short_ns, 0)

    @property
    def wall_ratio(self) -> float:
        """The same ratio in wall-clock time (inflated by preemption on a loaded machine)."""
        return self.median_us(self.long_ns, 1) / self.median_us(self.short_ns, 1)


async def short_session(opts: Options, *, ops: bool) -> GrowingSession:
    """A fresh session grown (untimed) to ``GROWTH_SHORT_TURNS`` turns."""
    session = await GrowingSession(opts, ops=ops).start()
    for _ in range(GROWTH_SHORT_TURNS):
        await session.step()
    return session


async def growth(opts: Options, *, ops: bool = False) -> Growth:
    """Grow one natural session, then time steps at its length and at turn 20, interleaved.

    With ``ops``, the machine has :func:`operations` and tracing on.
    """
    for _ in range(min(opts.warmup, 3)):
        await short_session(opts, ops=ops)
    long = await GrowingSession(opts, ops=ops).start()
    curve: list[tuple[int, float]] = []
    window: list[int] = []
    marks = {GROWTH_SHORT_TURNS, 100, 500, 1_000, opts.growth_turns}
    for _ in range(opts.growth_turns):
        window = [*window[-9:], (await long.step())[0]]
        if long.turns in marks:
            curve.append((long.turns, statistics.median(window) / 1_000))
    await long.check()
    long_ns: list[tuple[int, int]] = []
    short_ns: list[tuple[int, int]] = []
    gc.collect()
    gc.freeze()
    try:
        for _ in range(opts.growth_samples):
            short = await short_session(opts, ops=ops)
            short_ns.append(await short.step())
            long_ns.append(await long.step())
    finally:
        gc.unfreeze()
    await short.check()
    await long.check()
    request_us = await request_copies(long, short, opts.growth_samples)
    return Growth(ops, opts.growth_turns, long_ns, short_ns, curve, request_us)


async def request_copies(
    long: GrowingSession, short: GrowingSession, samples: int
) -> tuple[float, float]:
    """Median us of ``ModelRequest(messages=conversation)`` on each session, interleaved."""
    conversations = [
        (await long.store.load(SESSION_ID)).conversation,
        (await short.store.load(SESSION_ID)).conversation,
    ]
    timings: list[list[float]] = [[], []]
    for _ in range(max(samples, 10)):
        for side, conversation in enumerate(conversations):
            start = time.perf_counter_ns()
            request = ModelRequest(messages=conversation)
            timings[side].append((time.perf_counter_ns() - start) / 1_000)
            if len(request.messages) != len(conversation):
                raise SystemExit("ModelRequest did not keep every message")
            del request
    return statistics.median(timings[0]), statistics.median(timings[1])


def describe_growth(result: Growth) -> list[str]:
    """The growth figures, one line each."""
    lines = [
        (
            f"growth{'_ops' if result.ops else ''}: a natural session grown to "
            f"{result.long_turns} turns ({4 * result.long_turns} messages of ~{MESSAGE_BYTES} "
            "bytes), memory store"
            + (
                "; Budget (tool-call limits), Approval, Tools, HistoryGuard, inference, traced"
                if result.ops
                else ""
            )
        ),
        "  while growing, CPU us per step (median of the last 10): "
        + ", ".join(f"turn {turn} {us:.0f}" for turn, us in result.curve),
    ]
    for name, samples in (
        (f"turn {result.long_turns}", result.long_ns),
        (f"turn {GROWTH_SHORT_TURNS}", result.short_ns),
    ):
        for clock, clock_name in ((0, "CPU"), (1, "wall")):
            us = [s[clock] / 1_000 for s in samples]
            q1, median, q3 = statistics.quantiles(us, n=4) if len(us) > 1 else us * 3
            lines.append(
                f"  step at {name:10s} {clock_name:4s} median {median:10.1f} us  q1 {q1:10.1f}  "
                f"q3 {q3:10.1f}  min {min(us):10.1f}  n={len(us)}"
            )
    lines.append(
        f"  step at turn {result.long_turns} / step at turn {GROWTH_SHORT_TURNS}: "
        f"{result.ratio:.2f}x CPU time ({result.wall_ratio:.2f}x wall-clock)"
    )
    long_us, short_us = result.request_us
    lines.append(
        f"  O(history) on a step's path, by design: the model request's tuple of the "
        f"history, 2 per step, {long_us:.1f} us each at turn {result.long_turns} and "
        f"{short_us:.1f} us at turn {GROWTH_SHORT_TURNS} (timed alone, warm cache; see the "
        "module docs)"
    )
    return lines


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
    parser.add_argument(
        "--growth-turns",
        type=int,
        default=None,
        help="turns of the natural session of the growth figure (default 2000; --quick 100)",
    )
    parser.add_argument(
        "--growth-samples",
        type=int,
        default=None,
        help="steps timed at each end of the growth figure (default 60; --quick 10)",
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
    growth_turns = args.growth_turns or (100 if args.quick else 2_000)
    growth_samples = args.growth_samples or (10 if args.quick else 60)
    if args.rounds < 1 or repetitions < 1 or args.long_rounds < 1:
        parser.error("--rounds, --long-rounds and --repetitions must be at least 1")
    if growth_turns <= GROWTH_SHORT_TURNS or growth_samples < 1:
        parser.error(f"--growth-turns must exceed {GROWTH_SHORT_TURNS}, --growth-samples be >= 1")
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
        growth_turns=growth_turns,
        growth_samples=growth_samples,
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
    grown: Growth = run_async(lambda: growth(opts), opts.backend)
    for line in describe_growth(grown):
        print(line)
    grown_ops: Growth = run_async(lambda: growth(opts, ops=True), opts.backend)
    for line in describe_growth(grown_ops):
        print(line)
    print(
        f"cycle_us={cycle:.2f} bare_us={bare_us:.2f} growth_2000_over_20={grown.ratio:.2f} "
        f"growth_ops_2000_over_20={grown_ops.ratio:.2f}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
