"""What the stores cost: throughput, apply, incremental reload, bytes on disk.

The words are those of issue 9's table and ``cycle.py``: the scripted agent
has one tool and 500-byte user messages (so the tool call's arguments, the
tool's result and the answer are about 500 bytes each too); a **turn** is one
round of the conversation (the user's message, the model turn that calls the
tool, the tool turn, the model turn that answers: four messages, three
machine steps); a **tool step** is a model turn that calls tools plus the
tool turn that runs them.

For each store (MemoryStore, SQLiteStore, FileStore, PostgresStore), in one run:

* steps/s: a long scripted session driven by the machine (every turn the
  user's message is appended with ``submit``, then ``machine.run()`` goes
  inference (a tool call) -> tools -> inference (the answer) -> yield; three
  machine steps per turn, and more batches, as Tools commits its journal).
  steps/s counts machine steps per second of the whole session, submits
  included; batches/s counts every batch applied.
* batches per tool step, counted from the store's audit log
  (``store.batches``) of that session: the batches written by the tools step
  or appending a model message that calls tools, divided by the model
  messages that call tools. For the default tool (``side_effects=
  "non_idempotent"``, whose intent is committed before it runs) and, in a
  shorter session, for a pure tool (``side_effects="pure"``).
* apply: median microseconds of one ``store.apply`` of a one-message batch,
  on sessions holding 20 and 2,000 messages (built one message per batch).
  On SQLite each apply at 20 messages is interleaved with a raw ``sqlite3``
  commit of a comparable row: the same encoded effects as one BLOB row in a
  ``(sid, revision, body)`` WITHOUT ROWID table, one transaction (BEGIN,
  INSERT, COMMIT), the store's PRAGMAs (WAL, synchronous=NORMAL), run through
  the same worker-thread hop as the store uses (``stepmachine._async.run_in_thread``:
  on asyncio the stores' own worker threads, elsewhere ``anyio.to_thread``).
  On PostgreSQL likewise, with a raw commit of a comparable transaction (see
  ``benchmarks/_pg.py``): BEGIN, an UPDATE of one row (the revision), an
  INSERT of the same encoded effects as one ``bytea`` row, COMMIT, on a
  connection of a ``psycopg_pool`` pool with the store's settings, through
  one worker-thread hop, in the store's database.
* reload: median microseconds of ``store.load`` on an instance that has the
  session loaded already, when nothing is new, and right after ANOTHER
  instance of the store (same file or folder) applied one batch. Cold load (a
  fresh instance loading the session) is printed too.
* bytes: bytes of the files on disk after the long session (store closed;
  for PostgreSQL, the size of the store's tables with their TOAST and indexes)
  per byte of message content (the text, tool call arguments and tool
  results of every message, UTF-8) after ``--session-rounds`` (200) turns;
  and, as before, per byte of encoded effects,
  ``len(codec.encode_effects(batch.effects))`` summed over every batch written.

And, in the same run, raw ``sqlite3`` throughput: commits per second of the
same raw transaction, called directly and through one worker-thread hop per
commit (as the store does); the same for PostgreSQL's raw transaction.

PostgreSQL: the server is ``$STEPMACHINE_TEST_POSTGRES`` when set, else a
throwaway server that ``tests/harness/_postgres.py`` starts (initdb in a
temporary folder, a free loopback port; run as root, as the ``postgres``
system user) with PostgreSQL's durable defaults (``fsync`` on), removed
afterwards. Each measurement gets a database of its own, dropped at the end.
Where no server can be had (psycopg or the binaries missing) PostgreSQL is
skipped with a note.

Samples are taken round-robin over several sessions of the given size, so no
session grows by more than 5% of its size while it is measured. Machines are
shared and noisy: compare the ratios printed, not absolute figures.

Run:  python benchmarks/store.py [--quick] [--backend trio] [--stores memory,sqlite,file,postgres]

The line before the last holds the PostgreSQL figures: ``postgres_batch_us=<f>
postgres_raw_commit_us=<f> postgres_batch_over_raw=<f>`` (the median apply at
20 messages, the median raw commit interleaved with it, and their ratio;
``n/a`` when PostgreSQL was not measured).

The last line holds the SQLite figures: ``batch_us=<f> raw_commit_us=<f>
batches_per_step=<f> apply_2000_over_20=<f> reload_2000_over_20=<f>
bytes_ratio=<f>`` (on one line): ``batch_us`` is the median apply at 20
messages, ``raw_commit_us`` the median raw commit interleaved with it,
``batches_per_step`` is for the default tool, ``reload`` is the reload after
another instance's batch, ``bytes_ratio`` is per byte of message content.
``--quick`` uses sessions of 200 messages instead of 2,000 (the figures keep
their names).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import _pg  # benchmarks/_pg.py, beside this file
import anyio
import anyio.to_thread

from stepmachine import (
    AppendMessage,
    Codec,
    Effect,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    StateMachine,
    Store,
    ToolCallPart,
    ToolResultPart,
    Tools,
    submit,
    tool,
)
from stepmachine._async import run_in_thread  # the stores' own hop, for the raw commits
from stepmachine.extend import Batch, NullEmitter, counter_ids
from stepmachine.stores import FileStore, MemoryStore, PostgresStore, SQLiteStore
from stepmachine.testing import FunctionModel, call, reply

STORE_KINDS = ("memory", "sqlite", "file", "postgres")
DURABLE = ("sqlite", "file", "postgres")
SIZES = [20, 2_000]  # the second is set from --large (200 with --quick)
MESSAGE_BYTES = 500  # user messages of the long session (as in cycle.py and peers.py)
FILE_FSYNC: list[Literal["always", "never"]] = ["always"]  # set from --file-fsync
SERVER: list[str] = []  # the PostgreSQL server's DSN, set in main() when postgres is measured
CLOCK = 1_700_000_000.0
FILLER = (
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor "
    "incididunt ut labore et dolore magna aliqua."
)


def fixed_clock() -> float:
    """A constant clock: runs are deterministic."""
    return CLOCK


# -- the scripted agent (as in cycle.py) -------------------------------------------


def lookup_value(key: str) -> str:
    """Look up the value stored under ``key``."""
    return f"value of {key}: {FILLER}"


LOOKUP = tool(thread=False)(lookup_value)  # the default: side_effects="non_idempotent"
LOOKUP_PURE = tool(thread=False, side_effects="pure")(lookup_value)


def user_text(turn: int) -> str:
    """The user's message of turn ``turn``: ``MESSAGE_BYTES`` bytes."""
    head = f"question {turn}: "
    return head + "x" * (MESSAGE_BYTES - len(head))


def content_bytes(messages: Sequence[Message]) -> int:
    """UTF-8 bytes of the content of ``messages``: text, tool call arguments, tool results."""
    total = 0
    for message in messages:
        total += len(message.text.encode())
        total += sum(len(c.raw_arguments.encode()) for c in message.tool_calls)
        total += sum(len(r.content.encode()) for r in message.tool_results)
    return total


def tool_step_batches(batches: Sequence[Batch[Effect]], tools_step: str) -> tuple[int, int]:
    """From an audit log: (batches of tool steps, tool steps).

    A tool step is a model message that calls tools plus the tool turn that runs
    them; its batches are those written by the tools step ``tools_step`` and those
    appending a model message that calls tools (each batch counted once).
    """
    step_batches = 0
    steps = 0
    for batch in batches:
        calling = sum(
            1
            for effect in batch.effects
            if isinstance(effect, AppendMessage)
            and effect.message.role == "assistant"
            and effect.message.tool_calls
        )
        steps += calling
        if calling or batch.step == tools_step:
            step_batches += 1
    return step_batches, steps


def decide(request: ModelRequest) -> ModelResponse:
    """The scripted model: call ``lookup_value`` for a user message, answer after the result."""
    last = request.messages[-1]
    if last.role == "user":
        return call(("lookup_value", {"key": last.text}))
    return reply(f"The answer is: {last.tool_results[0].content}")


def nth_message(i: int) -> Message:
    """The ``i``-th message of a synthetic session: user, tool call, tool result, answer."""
    kind = i % 4
    if kind == 0:
        return Message.user(f"question {i}: {FILLER}", id=f"m{i}")
    if kind == 1:
        part = ToolCallPart.of(f"call-{i}", "lookup_value", {"key": f"question {i - 1}"})
        return Message(id=f"m{i}", role="assistant", parts=(part,))
    if kind == 2:
        result = ToolResultPart(
            call_id=f"call-{i - 1}", content=f"value {i}: {FILLER}", name="lookup_value"
        )
        return Message(id=f"m{i}", role="tool", parts=(result,))
    return Message.assistant(f"The answer is {i}: {FILLER}", id=f"m{i}")


def one_message_batch(session_id: str, index: int) -> Batch[Effect]:
    """The batch appending message ``index`` (revision ``index + 1``)."""
    return Batch(
        session_id=session_id,
        revision=index + 1,
        step="bench",
        cycle=0,
        timestamp=CLOCK,
        effects=(AppendMessage(nth_message(index)),),
    )


# -- stores ------------------------------------------------------------------------


def available(kind: str) -> str | None:
    """Why the store cannot be measured here (a placeholder, no PostgreSQL), or None."""
    if kind == "postgres":
        return _pg.unavailable()
    cls = {"memory": MemoryStore, "sqlite": SQLiteStore, "file": FileStore}[kind]
    if kind == "memory" or callable(getattr(cls, "open", None)):
        return None
    return "still a placeholder (no open())"


def location(kind: str, folder: Path) -> Path:
    """Where a store of this kind keeps its data inside ``folder``."""
    return folder / "store.db" if kind == "sqlite" else folder / "sessions"


async def open_store(kind: str, folder: Path, codec: Codec[Any]) -> Store:
    """A store of ``kind`` on ``folder`` (created if needed); memory ignores the folder."""
    if kind == "memory":
        return MemoryStore(codec)
    await anyio.Path(folder).mkdir(parents=True, exist_ok=True)
    if kind == "sqlite":
        return await SQLiteStore.open(location(kind, folder), codec)
    if kind == "postgres":
        dsn = await anyio.to_thread.run_sync(_pg.database, SERVER[0], folder)
        return await PostgresStore.open(dsn, codec)
    return await FileStore.open(location(kind, folder), codec, fsync=FILE_FSYNC[0])


def disk_bytes(folder: Path) -> int:
    """Bytes of every file under ``folder``."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


async def stored_bytes(kind: str, folder: Path) -> int:
    """Bytes the store of ``kind`` in ``folder`` takes: its files, or its PostgreSQL tables."""
    if kind == "postgres":
        dsn = await anyio.to_thread.run_sync(_pg.database, SERVER[0], folder)
        return await anyio.to_thread.run_sync(_pg.stored_bytes, dsn)
    return disk_bytes(folder)


# -- measurements ------------------------------------------------------------------


@dataclass
class Figures:
    """What was measured for one store."""

    kind: str
    steps: int = 0
    batches: int = 0
    steps_per_s: list[float] = field(default_factory=list)
    batches_per_s: list[float] = field(default_factory=list)
    apply_us: dict[int, list[float]] = field(default_factory=dict)
    load_same_us: dict[int, list[float]] = field(default_factory=dict)
    reload_us: dict[int, list[float]] = field(default_factory=dict)
    cold_us: dict[int, list[float]] = field(default_factory=dict)
    disk: int = 0
    disk_open: int = 0
    encoded: int = 0
    content: int = 0
    batch_count: int = 0
    batches_per_step: float = math.nan
    batches_per_step_pure: float = math.nan
    raw_us: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Options:
    """The command line, parsed."""

    backend: str
    kinds: tuple[str, ...]
    session_rounds: int
    session_repetitions: int
    pure_rounds: int
    samples: int
    commits: int
    folder: Path


async def scripted_session(
    store: Store, rounds: int, lookup: Any, session_id: str = "long"
) -> tuple[int, float, Tools]:
    """Drive a scripted session of ``rounds`` turns on ``store``.

    Returns the machine steps run, the seconds taken, and the Tools step used.
    """
    ids = counter_ids()
    runtime = Runtime(store=store, model=FunctionModel(decide), ids=ids, clock=fixed_clock)
    tools = Tools([lookup])
    machine: StateMachine[Any] = StateMachine([tools, ModelInference()])
    emitter = NullEmitter()
    await store.create(session_id)
    steps = 0
    start = time.perf_counter_ns()
    for r in range(rounds):
        user = Message.user(user_text(r), id=ids())
        await submit(store, session_id, [AppendMessage(user)], clock=fixed_clock)
        report = await machine.run_report(runtime, session_id, emitter)
        steps += len(report.results)
    seconds = (time.perf_counter_ns() - start) / 1e9
    session = await store.load(session_id)
    if len(session.conversation) != rounds * 4:
        raise SystemExit(
            f"{session_id}: the session holds {len(session.conversation)} messages, "
            f"expected {rounds * 4}"
        )
    return steps, seconds, tools


async def batches_per_step(store: Store, session_id: str, tools: Tools) -> float:
    """Batches per tool step, counted from the store's audit log of ``session_id``."""
    step_batches, steps = tool_step_batches(await store.batches(session_id), tools.name)
    return step_batches / steps if steps else math.nan


async def long_session(kind: str, folder: Path, opts: Options, figures: Figures) -> None:
    """Drive one long scripted session through the machine; record steps/s (and bytes).

    The first time for a store, also batches per tool step (default and pure tool)
    and the bytes on disk.
    """
    codec: Codec[Any] = Codec()
    store = await open_store(kind, folder, codec)
    first = math.isnan(figures.batches_per_step)
    try:
        steps, seconds, tools = await scripted_session(store, opts.session_rounds, LOOKUP)
        session = await store.load("long")
        figures.steps = steps
        figures.batches = session.revision
        figures.steps_per_s.append(steps / seconds)
        figures.batches_per_s.append(session.revision / seconds)
        if first:
            figures.batches_per_step = await batches_per_step(store, "long", tools)
            figures.content = content_bytes(session.conversation)
            if kind in DURABLE:
                batches = await store.batches("long")
                figures.batch_count = len(batches)
                figures.encoded = sum(len(codec.encode_effects(b.effects)) for b in batches)
                figures.disk_open = await stored_bytes(kind, folder)
    finally:
        await store.aclose()
    if first and kind in DURABLE:
        figures.disk = await stored_bytes(kind, folder)
    if first:
        pure = await open_store(kind, folder / "pure", codec)
        try:
            _, _, tools = await scripted_session(pure, opts.pure_rounds, LOOKUP_PURE, "pure")
            figures.batches_per_step_pure = await batches_per_step(pure, "pure", tools)
        finally:
            await pure.aclose()


def sessions_for(size: int, samples: int) -> int:
    """How many sessions to spread ``samples`` over so none grows by more than 5%."""
    growth = max(1, size // 20)
    return math.ceil(samples / growth)


async def per_size(kind: str, folder: Path, size: int, opts: Options, figures: Figures) -> None:
    """apply, load (nothing new), reload (after another instance's batch), cold load."""
    codec: Codec[Any] = Codec()
    count = sessions_for(size, opts.samples)
    names = [f"s{size}-{j}" for j in range(count)]
    lengths = dict.fromkeys(names, size)
    store = await open_store(kind, folder, codec)
    try:
        for name in names:
            await store.create(name)
            for i in range(size):
                await store.apply(one_message_batch(name, i))
        raw: sqlite3.Connection | None = None
        raw_pg: _pg.RawPostgres | None = None
        if kind == "sqlite" and size == SIZES[0]:
            raw = await anyio.to_thread.run_sync(raw_connection, folder / "raw.db")
        if kind == "postgres" and size == SIZES[0]:
            dsn = await anyio.to_thread.run_sync(_pg.database, SERVER[0], folder)
            raw_pg = await _pg.RawPostgres.open(dsn)  # in the store's database
        applies: list[float] = []
        try:
            for k in range(opts.samples):
                name = names[k % count]
                batch = one_message_batch(name, lengths[name])
                start = time.perf_counter_ns()
                await store.apply(batch)
                applies.append((time.perf_counter_ns() - start) / 1e3)
                if raw is not None or raw_pg is not None:
                    body = codec.encode_effects(batch.effects)
                    start = time.perf_counter_ns()
                    if raw is not None:
                        await run_in_thread(raw_commit, raw, (k, body))
                    elif raw_pg is not None:
                        await raw_pg.commit_hop(k + 1, body)
                    figures.raw_us.append((time.perf_counter_ns() - start) / 1e3)
                lengths[name] += 1
        finally:
            if raw is not None:
                raw.close()
            if raw_pg is not None:
                await raw_pg.aclose()
        figures.apply_us[size] = applies
        for name in names:
            await store.load(name)
        loads: list[float] = []
        for k in range(opts.samples):
            name = names[k % count]
            start = time.perf_counter_ns()
            await store.load(name)
            loads.append((time.perf_counter_ns() - start) / 1e3)
        figures.load_same_us[size] = loads
        if kind not in DURABLE:
            return
        other = await open_store(kind, folder, codec)
        try:
            reloads: list[float] = []
            for k in range(opts.samples):
                name = names[k % count]
                await other.apply(one_message_batch(name, lengths[name]))
                lengths[name] += 1
                start = time.perf_counter_ns()
                session = await store.load(name)
                reloads.append((time.perf_counter_ns() - start) / 1e3)
                if session.revision != lengths[name] or len(session.conversation) != lengths[name]:
                    raise SystemExit(
                        f"{kind}: reload of {name} saw revision {session.revision}, "
                        f"expected {lengths[name]}"
                    )
            figures.reload_us[size] = reloads
        finally:
            await other.aclose()
        cold = await open_store(kind, folder, codec)
        try:
            colds: list[float] = []
            for name in names[: min(count, 50)]:
                start = time.perf_counter_ns()
                await cold.load(name)
                colds.append((time.perf_counter_ns() - start) / 1e3)
            figures.cold_us[size] = colds
        finally:
            await cold.aclose()
    finally:
        await store.aclose()


def raw_commits(path: Path, count: int, payload: bytes) -> float:
    """Commits per second of one INSERT + COMMIT per transaction, called directly."""
    connection = raw_connection(path)
    try:
        start = time.perf_counter_ns()
        for k in range(count):
            raw_commit(connection, (k, payload))
        return count / ((time.perf_counter_ns() - start) / 1e9)
    finally:
        connection.close()


async def raw_commits_threaded(path: Path, count: int, payload: bytes) -> float:
    """Commits per second with one worker-thread hop per commit (the store's hop)."""
    connection = await anyio.to_thread.run_sync(raw_connection, path)
    try:
        start = time.perf_counter_ns()
        for k in range(count):
            await run_in_thread(raw_commit, connection, (k, payload))
        return count / ((time.perf_counter_ns() - start) / 1e9)
    finally:
        connection.close()


def noop() -> None:
    """Nothing: what a bare worker-thread hop runs."""


async def thread_hops(count: int) -> list[float]:
    """Microseconds of each of ``count`` worker-thread hops (the store's) running nothing."""
    hops: list[float] = []
    for _ in range(count):
        start = time.perf_counter_ns()
        await run_in_thread(noop)
        hops.append((time.perf_counter_ns() - start) / 1e3)
    return hops


def raw_connection(path: Path) -> sqlite3.Connection:
    """A connection with the store's PRAGMAs and a table like the store's effect rows."""
    connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    connection.execute("PRAGMA journal_mode = WAL")
    connection.execute("PRAGMA synchronous = NORMAL")
    connection.execute(
        "CREATE TABLE IF NOT EXISTS log (sid INTEGER NOT NULL, revision INTEGER NOT NULL, "
        "body BLOB NOT NULL, PRIMARY KEY (sid, revision)) WITHOUT ROWID"
    )
    return connection


def raw_commit(connection: sqlite3.Connection, row: tuple[int, bytes]) -> None:
    """One transaction: BEGIN, one INSERT of ``(revision, body)`` (sid 1), COMMIT."""
    connection.execute("BEGIN")
    connection.execute("INSERT INTO log (sid, revision, body) VALUES (1, ?, ?)", row)
    connection.execute("COMMIT")


# -- the run -----------------------------------------------------------------------


@dataclass
class Raw:
    """Raw sqlite3 and thread-hop figures."""

    direct: list[float] = field(default_factory=list)
    threaded: list[float] = field(default_factory=list)
    hops_us: list[float] = field(default_factory=list)
    pg_direct: list[float] = field(default_factory=list)
    pg_threaded: list[float] = field(default_factory=list)


async def measure(opts: Options) -> tuple[dict[str, Figures], Raw]:
    """Every measurement, stores interleaved round by round."""
    figures = {kind: Figures(kind) for kind in opts.kinds}
    payload = Codec().encode_effects((AppendMessage(nth_message(3)),))
    raw = Raw()
    # warm-up: a short session on every store, a few raw commits
    warm = Options(
        opts.backend, opts.kinds, 3, 1, 2, opts.samples, opts.commits, opts.folder / "warm"
    )
    for kind in opts.kinds:
        await long_session(kind, warm.folder / kind, warm, Figures(kind))
    raw_commits(warm.folder / "raw.db", 50, payload)
    for rep in range(opts.session_repetitions):
        for kind in opts.kinds:
            await long_session(kind, opts.folder / f"long-{rep}-{kind}", opts, figures[kind])
        raw.direct.append(raw_commits(opts.folder / f"raw-{rep}.db", opts.commits, payload))
        raw.threaded.append(
            await raw_commits_threaded(opts.folder / f"raw-t-{rep}.db", opts.commits, payload)
        )
        raw.hops_us.extend(await thread_hops(opts.commits // 3))
        if "postgres" in opts.kinds:
            await raw_postgres_commits(
                opts.folder / f"raw-pg-{rep}", opts.commits // 3, payload, raw
            )
    for size in SIZES:
        for kind in opts.kinds:
            await per_size(kind, opts.folder / f"size-{size}-{kind}", size, opts, figures[kind])
    return figures, raw


async def raw_postgres_commits(folder: Path, count: int, payload: bytes, raw: Raw) -> None:
    """Raw PostgreSQL commits per second, called directly and through a thread hop each."""
    dsn = await anyio.to_thread.run_sync(_pg.database, SERVER[0], folder)
    connection = await _pg.RawPostgres.open(dsn)
    try:
        raw.pg_direct.append(await connection.commits_per_s(1, count, payload, hop=False))
        raw.pg_threaded.append(await connection.commits_per_s(1 + count, count, payload, hop=True))
    finally:
        await connection.aclose()


def med(samples: list[float] | None) -> float:
    """The median, or NaN when nothing was measured."""
    return statistics.median(samples) if samples else math.nan


def fmt(value: float, digits: int = 1) -> str:
    """A figure, or ``n/a``."""
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def spread(samples: list[float] | None) -> str:
    """Median, mean and max of microsecond samples."""
    if not samples:
        return f"{'n/a':>9s}"
    return (
        f"{med(samples):9.1f} (mean {statistics.fmean(samples):8.1f}, "
        f"max {max(samples):9.1f}, n={len(samples)})"
    )


def report(opts: Options, figures: dict[str, Figures], raw: Raw) -> None:
    """Print every figure, then the summary line last."""
    baseline = med(figures["memory"].steps_per_s) if "memory" in figures else math.nan
    first = next(iter(figures.values()))
    print(
        f"long session: {opts.session_rounds} turns = {first.steps} machine steps, "
        f"{first.batches} batches (submits included), {opts.session_rounds * 4} messages; "
        f"median of {opts.session_repetitions}"
    )
    for f in figures.values():
        steps = med(f.steps_per_s)
        versus = f"  ({steps / baseline:.2f}x memory)" if not math.isnan(baseline) else ""
        per_batch = 1e6 / med(f.batches_per_s)
        extra = ""
        if "memory" in figures and f.kind != "memory":
            extra = f", {per_batch - 1e6 / med(figures['memory'].batches_per_s):.1f} over memory"
        print(
            f"  {f.kind:8s} steps/s {steps:9.1f}   batches/s {med(f.batches_per_s):9.1f}{versus}"
            f"   us per batch {per_batch:.1f}{extra}"
        )
    print("batches per tool step (model turn calling the tool + tool turn), from the audit log:")
    for f in figures.values():
        print(
            f"  {f.kind:8s} default tool (non_idempotent) {fmt(f.batches_per_step, 2)}   "
            f"pure tool {fmt(f.batches_per_step_pure, 2)}"
        )
    print(f"raw sqlite3 commits/s (WAL, synchronous=NORMAL), {opts.commits} per run:")
    print(f"  direct        {med(raw.direct):9.1f}")
    print(f"  thread hop    {med(raw.threaded):9.1f}")
    print(f"one worker-thread hop running nothing, us: {spread(raw.hops_us)}")
    if "postgres" in figures:
        print(
            f"raw PostgreSQL commits/s (UPDATE + INSERT, pooled connection), "
            f"{opts.commits // 3} per run:"
        )
        print(f"  direct        {med(raw.pg_direct):9.1f}")
        print(f"  thread hop    {med(raw.pg_threaded):9.1f}")
    for title, attr in (
        ("apply, us", "apply_us"),
        ("load, nothing new, us", "load_same_us"),
        ("reload after another instance's batch, us", "reload_us"),
        ("cold load (fresh instance), us", "cold_us"),
    ):
        print(f"{title}: median (mean, max, n)")
        for f in figures.values():
            samples: dict[int, list[float]] = getattr(f, attr)
            for size in SIZES:
                print(f"  {f.kind:8s} {size:5d} msgs {spread(samples.get(size))}")
            ratio = med(samples.get(SIZES[1])) / med(samples.get(SIZES[0]))
            print(f"  {f.kind:8s} {SIZES[1]}/{SIZES[0]} ratio {fmt(ratio, 2)}")
    sqlite = figures.get("sqlite")
    if sqlite is None:
        print("SQLiteStore was not measured (placeholder or --stores); its figures read n/a")
        sqlite = Figures("sqlite")
    batch_us, raw_us = versus_raw(sqlite, "a raw sqlite3 commit")
    postgres = figures.get("postgres") or Figures("postgres")
    pg_batch_us, pg_raw_us = math.nan, math.nan
    if "postgres" in figures:
        pg_batch_us, pg_raw_us = versus_raw(postgres, "a raw PostgreSQL transaction")
    print(
        f"bytes on disk (long session, {opts.session_rounds} turns, store closed) per byte of "
        "message content, and per byte of encoded effects:"
    )
    for f in figures.values():
        if f.kind not in DURABLE:
            continue
        print(
            f"  {f.kind:8s} {f.disk} B on disk ({f.disk_open} B while open) / {f.content} B of "
            f"message content = {f.disk / f.content:.2f}; / {f.encoded} B of effects in "
            f"{f.batch_count} batches = {f.disk / f.encoded:.2f}"
        )
    apply_ratio = med(sqlite.apply_us.get(SIZES[1])) / batch_us
    reload_ratio = med(sqlite.reload_us.get(SIZES[1])) / med(sqlite.reload_us.get(SIZES[0]))
    bytes_ratio = sqlite.disk / sqlite.content if sqlite.content else math.nan
    print(
        f"sqlite_steps_per_s={fmt(med(sqlite.steps_per_s))} "
        f"raw_commits_per_s={fmt(med(raw.direct))} "
        f"raw_commits_per_s_thread={fmt(med(raw.threaded))}"
    )
    print(f"batches_per_step_pure={fmt(sqlite.batches_per_step_pure, 2)}")
    print(
        f"postgres_batch_us={fmt(pg_batch_us)} postgres_raw_commit_us={fmt(pg_raw_us)} "
        f"postgres_batch_over_raw={fmt(pg_batch_us / pg_raw_us, 2)}"
    )
    print(
        f"batch_us={fmt(batch_us)} raw_commit_us={fmt(raw_us)} "
        f"batches_per_step={fmt(sqlite.batches_per_step, 2)} "
        f"apply_2000_over_20={fmt(apply_ratio, 2)} reload_2000_over_20={fmt(reload_ratio, 2)} "
        f"bytes_ratio={fmt(bytes_ratio, 2)}"
    )


def versus_raw(f: Figures, what: str) -> tuple[float, float]:
    """Print the store's apply at the small size beside the raw commit interleaved with it.

    Returns the two medians (microseconds).
    """
    batch_us, raw_us = med(f.apply_us.get(SIZES[0])), med(f.raw_us)
    print(
        f"{f.kind} apply at {SIZES[0]} msgs vs {what} of the same effects through "
        f"the same thread hop, interleaved, us:"
    )
    print(f"  apply         {spread(f.apply_us.get(SIZES[0]))}")
    print(f"  raw commit    {spread(f.raw_us)}")
    print(f"  apply / raw commit: {fmt(batch_us / raw_us, 2)}x")
    return batch_us, raw_us


def parse(argv: list[str]) -> Options:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n", 1)[0])
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--quick", action="store_true", help="a short run (a few seconds)")
    parser.add_argument(
        "--stores",
        default=",".join(STORE_KINDS),
        help="comma-separated: memory,sqlite,file,postgres",
    )
    parser.add_argument(
        "--session-rounds", type=int, default=None, help="rounds of the long session"
    )
    parser.add_argument(
        "--session-repetitions", type=int, default=None, help="long sessions per store"
    )
    parser.add_argument(
        "--pure-rounds", type=int, default=None, help="turns of the pure-tool session"
    )
    parser.add_argument(
        "--large", type=int, default=None, help="messages of the large sessions (2000; quick 200)"
    )
    parser.add_argument("--samples", type=int, default=None, help="samples per apply/load figure")
    parser.add_argument("--commits", type=int, default=None, help="raw sqlite3 commits per run")
    parser.add_argument(
        "--file-fsync",
        choices=["always", "never"],
        default="always",
        help="FileStore's fsync option (its default: always; SQLite runs synchronous=NORMAL)",
    )
    parser.add_argument("--dir", default=None, help="where to put the files (default: a temp dir)")
    args = parser.parse_args(argv)
    kinds = tuple(k.strip() for k in args.stores.split(",") if k.strip())
    unknown = sorted(set(kinds) - set(STORE_KINDS))
    if unknown:
        parser.error(f"unknown stores {unknown}; choose from {STORE_KINDS}")
    reasons = {k: available(k) for k in kinds}
    skipped = [k for k in kinds if reasons[k] is not None]
    for kind in skipped:
        print(f"note: {kind} store skipped: {reasons[kind]}")
    kinds = tuple(k for k in kinds if k not in skipped)
    if not kinds:
        parser.error("no store to measure")
    quick = args.quick
    FILE_FSYNC[0] = args.file_fsync
    SIZES[1] = args.large or (200 if quick else 2_000)
    if SIZES[1] <= SIZES[0]:
        parser.error(f"--large must exceed {SIZES[0]}")
    folder = Path(tempfile.mkdtemp(prefix="stepmachine-bench-", dir=args.dir))
    return Options(
        backend=args.backend,
        kinds=kinds,
        session_rounds=args.session_rounds or (25 if quick else 200),
        session_repetitions=args.session_repetitions or (1 if quick else 3),
        pure_rounds=args.pure_rounds or (5 if quick else 20),
        samples=args.samples or (40 if quick else 200),
        commits=args.commits or (300 if quick else 3_000),
        folder=folder,
    )


def run_async(fn: Callable[[], Awaitable[Any]], backend: str) -> Any:
    """Run ``fn()`` on the chosen anyio backend."""
    return anyio.run(fn, backend=backend)


def main(argv: list[str]) -> None:
    """Measure every store and print the figures, the summary line last."""
    opts = parse(argv)
    print(
        f"store benchmark: backend={opts.backend} python={sys.version.split()[0]} "
        f"sqlite={sqlite3.sqlite_version} (synchronous=NORMAL) file fsync={FILE_FSYNC[0]} "
        f"stores={','.join(opts.kinds)} "
        f"files in {opts.folder} (fs of {os.path.dirname(opts.folder)})"
    )
    try:
        with contextlib.ExitStack() as stack:
            if "postgres" in opts.kinds:
                given = _pg.given()
                SERVER[:] = [stack.enter_context(_pg.server())]
                print(f"postgres: {given or 'a throwaway server (fsync on)'}")
            figures, raw = run_async(lambda: measure(opts), opts.backend)
    finally:
        shutil.rmtree(opts.folder, ignore_errors=True)
    report(opts, figures, raw)


if __name__ == "__main__":
    main(sys.argv[1:])
