"""Crash-point harness: kill -9 an agent at every persistence boundary, then check the store.

Usage::

    python tests/harness/crash.py --store sqlite
    python tests/harness/crash.py --store file --rounds 4 --random-kills 20 --seed 7
    python tests/harness/crash.py --store sqlite --from-v1
    python tests/harness/crash.py --store postgres   # $STEPMACHINE_TEST_POSTGRES or its own server

A child process (this file, run with ``--child agent``) drives a scripted agent,
``StateMachine([Tools([record]), ModelInference()])`` with a stateless
``FunctionModel``: for each user turn ``n`` (submitted with
``stepmachine.submit`` together with an ``Annotate``; even turns as a
``ReplaceConversation``, like a compaction) the model calls
``record`` twice in one message, then answers ``done n``. Every batch the store
acknowledges is recorded out of band: before ``apply`` an *intent* line, after
``apply`` returned an *ack* line (revision, sha256 of ``codec.encode_batch``,
number of effects), each flushed and fsynced.

Crash points. A first child runs the whole script with a hook that only counts
how often each boundary in the store's ``BOUNDARIES`` is hit. Then, for each
boundary ``B`` and occurrence ``k`` (all of them, or ``--max-per-boundary``
spread from first to last), a fresh child runs with a hook that SIGKILLs its
own process at the ``k``-th hit of ``B``; ``--random-kills N`` more children
are killed by the parent at a random moment (after a random number of
acknowledged batches, plus a random fraction of a batch's time). After each
kill the parent reopens the store and checks:

- lost: every acknowledged batch is stored at its revision with identical
  encoded bytes (and an acknowledged ``create`` left a session);
- half_applied: the stored log is whole: revisions 1..n without gaps, every
  batch decodes and is byte-identical to a batch the agent submitted (so no
  effect is missing), ``load()`` equals ``load_at(n)`` and equals the replay of
  the log, and ``load_at(r)`` equals the replay prefix for every ``r``;
- invalid: a fresh child without a hook runs ``machine.finalize`` and then
  ``machine.run`` (submitting the remaining turns) and must finish every
  turn; the parent then checks ``history_problems`` is empty, every tool call
  has exactly one result, and repeats the lost / half_applied checks with
  the acknowledgements of both children.

With ``--from-v1`` (SQLite only) every crash point starts from a copy of the
golden database written by SQLiteStore schema version 1
(``tests/fixtures/golden/sqlite/store-v1.db``): the first child migrates it
on open (a random kill may land in the migration), and after the resume the
parent also checks that every golden session still reads exactly as
``expected.json`` says; a session that does not counts as lost.

One line per crash point; the last line is exactly
``crash_points=<n> lost=<n> half_applied=<n> invalid=<n>`` where
``crash_points`` counts children actually killed, ``lost`` counts
acknowledged batches (or creates) missing, and ``half_applied`` / ``invalid``
count crash points with a problem. Exit status 1 when any of those is
non-zero, or when a boundary of the store was never hit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common as common  # beside this file: on sys.path as a script and in pytest
import anyio
import msgspec

from stepmachine import (
    Annotate,
    AppendMessage,
    Codec,
    Effect,
    ImagePart,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    ReplaceConversation,
    Runtime,
    Session,
    StateMachine,
    Tools,
    submit,
    tool,
)
from stepmachine.extend import Batch, Conversation, apply_batch, history_problems
from stepmachine.testing import FunctionModel, call, reply

HERE = Path(__file__).resolve().parent
SESSION_ID = "crash-harness"


# -- the scripted agent (runs in the child) --------------------------------------------


@tool(thread=False)
def record(n: int) -> str:
    """Record that turn ``n`` happened (pure: safe to run again after a crash)."""
    return f"recorded {n}"


def decide(request: ModelRequest) -> ModelResponse:
    """The model: decided from the history alone, so any process answers the same."""
    messages = request.messages
    users = [m for m in messages if m.role == "user"]
    if not users:
        raise ValueError("the harness model needs a user message")
    n = int(users[-1].text.rsplit(" ", 1)[-1])
    last = messages[-1]
    if last.role == "user":
        return call(("record", {"n": n}), ("record", {"n": 1000 + n}))
    if last.role == "tool":
        return reply(f"done {n}")
    raise ValueError(f"the harness model cannot answer a {last.role!r} message")


def build_machine() -> StateMachine[Any]:
    """The agent: tools first, then inference."""
    return StateMachine([Tools([record]), ModelInference()])


def user_turn(n: int, conversation: Sequence[Message]) -> list[Effect]:
    """The batch submitting user turn ``n``: the message and a note on it.

    Even turns replace the conversation (with itself plus the message), as a
    compaction would: stores snapshot on ``ReplaceConversation``, so that
    path is crashed at too. Odd turns carry an image of their own (stores keep
    its bytes apart, written before the batch: that path is crashed at too).
    """
    media = [ImagePart(media_type="image/png", data=bytes([n % 256]) * 3000)] if n % 2 else []
    message = Message.user(f"turn {n}", id=f"u{n}", media=media)
    note = Annotate(message_id=message.id, namespace="harness", values={"turn": n})
    if n % 2 == 0:
        return [ReplaceConversation((*conversation, message)), note]
    return [AppendMessage(message), note]


def turn_finished(conversation: Sequence[Message], n: int) -> bool:
    """True when the conversation ends on the assistant's ``done n``."""
    visible = [m for m in conversation if m.visible_to_model]
    return bool(visible) and visible[-1].role == "assistant" and visible[-1].text == f"done {n}"


class AckingStore:
    """A store proxy that records every batch out of band: intent before, ack after ``apply``.

    ``apply`` returns what the store's ``apply`` returned (the stored session
    or ``None``), so the machine runs exactly as it would on the bare store.
    """

    def __init__(self, store: Any, codec: Codec[Any], log: Any) -> None:
        self._store = store
        self._codec = codec
        self._log = log

    @property
    def codec(self) -> Codec[Any]:
        return self._codec

    async def create(self, session_id: str, *args: Any, **kwargs: Any) -> Session[Any]:
        session: Session[Any] = await self._store.create(session_id, *args, **kwargs)
        self._log.write({"kind": "create", "session": session_id})
        return session

    async def load(self, session_id: str) -> Session[Any]:
        session: Session[Any] = await self._store.load(session_id)
        return session

    async def apply(self, batch: Batch[Effect], *, lease: Any = None) -> Session[Any] | None:
        facts = {
            "session": batch.session_id,
            "rev": batch.revision,
            "sha": common.digest(self._codec, batch),
            "effects": len(batch.effects),
        }
        self._log.write({"kind": "intent", **facts})
        # A store with leases gets the lease the run writes with (fenced), others none.
        stored: Session[Any] | None = (
            await self._store.apply(batch)
            if lease is None
            else await self._store.apply(batch, lease=lease)
        )
        self._log.write({"kind": "ack", **facts})
        return stored

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


async def drive(store: Any, rounds: int) -> Session[Any]:
    """Finalize, then run and submit turns until all ``rounds`` turns are answered."""
    machine = build_machine()
    runtime = Runtime(store=store, model=FunctionModel(decide))
    session_ids = await store.list_sessions()
    if SESSION_ID not in session_ids:
        await store.create(SESSION_ID)
    await machine.finalize(runtime, SESSION_ID)
    for _ in range(4 * rounds + 8):
        session = await machine.run(runtime, SESSION_ID)
        users = [m for m in session.conversation if m.role == "user"]
        if users and not turn_finished(session.conversation, len(users)):
            raise RuntimeError(
                f"run() returned with turn {len(users)} unanswered at revision {session.revision}"
            )
        if len(users) >= rounds:
            return session
        await submit(store, SESSION_ID, user_turn(len(users) + 1, session.conversation))
    raise RuntimeError(f"the agent did not finish {rounds} turns")


async def agent(args: argparse.Namespace) -> None:
    """The child: run the script against the store, optionally killing itself at a boundary."""
    folder = Path(args.dir)
    counts: Counter[str] = Counter()

    def hook(name: str, *_: Any) -> None:
        counts[name] += 1
        if name == args.kill_at and counts[name] == args.kill_k:
            os.kill(os.getpid(), signal.SIGKILL)

    codec: Codec[Any] = Codec()
    log = common.AckLog(folder / "acks.jsonl")
    print("ready", flush=True)
    started = time.perf_counter()
    store = await common.open_store(
        args.store, folder, codec, hook=hook, snapshot_every=args.snapshot_every
    )
    try:
        await drive(AckingStore(store, codec, log), args.rounds)
    finally:
        await store.aclose()
        log.close()
    elapsed = time.perf_counter() - started
    print(json.dumps({"counts": dict(counts), "elapsed": elapsed}), flush=True)


# -- checks (run in the parent) -----------------------------------------------------------


@dataclass
class Inspection:
    """What the parent found in the store."""

    lost: set[str] = field(default_factory=set)
    whole: list[str] = field(default_factory=list)
    conversation: list[str] = field(default_factory=list)
    batches: int = 0
    acked: int = 0


def conversation_problems(conversation: Sequence[Message], rounds: int) -> list[str]:
    """Why ``conversation`` is not the complete, valid script of ``rounds`` turns."""
    problems = list(history_problems(conversation))
    ids = [m.id for m in conversation]
    problems.extend(
        f"message id {i!r} repeats" for i in sorted({i for i in ids if ids.count(i) > 1})
    )
    calls: Counter[str] = Counter()
    results: Counter[str] = Counter()
    for message in conversation:
        calls.update(c.call_id for c in message.tool_calls)
        results.update(r.call_id for r in message.tool_results)
    problems.extend(
        f"tool call {c!r} has {results[c]} results" for c in sorted(calls) if results[c] != 1
    )
    problems.extend(f"result for unknown call {c!r}" for c in sorted(set(results) - set(calls)))
    for n in range(1, rounds + 1):
        positions = [i for i, m in enumerate(conversation) if m.id == f"u{n}"]
        if len(positions) != 1:
            problems.append(f"user turn u{n} appears {len(positions)} times")
            continue
        answers = [
            m
            for m in conversation[positions[0] :]
            if m.role == "assistant" and m.text == f"done {n}"
        ]
        if len(answers) != 1:
            problems.append(f"turn {n} has {len(answers)} 'done {n}' answers")
    if conversation and not turn_finished(conversation, rounds):
        problems.append(f"the conversation does not end on 'done {rounds}'")
    return problems


async def inspect_store(
    spec: str, folder: Path, records: list[dict[str, Any]], rounds: int | None = None
) -> Inspection:
    """Reopen the store in ``folder`` and check it against the child's records.

    With ``rounds``, also check that the conversation is the complete script.
    """
    codec: Codec[Any] = Codec()
    found = Inspection()
    acks = [r for r in records if r["kind"] == "ack"]
    found.acked = len(acks)
    intents: dict[int, set[tuple[str, int]]] = defaultdict(set)
    for r in records:
        if r["kind"] == "intent":
            intents[r["rev"]].add((r["sha"], r["effects"]))
    created = any(r["kind"] == "create" for r in records)
    try:
        store = await common.open_store(spec, folder, codec)
    except Exception as exc:
        found.whole.append(f"reopening the store failed: {type(exc).__name__}: {exc}")
        found.lost.update(f"rev {a['rev']}" for a in acks)
        return found
    try:
        if SESSION_ID not in await store.list_sessions():
            if created:
                found.lost.add("create")
            found.lost.update(f"rev {a['rev']}" for a in acks)
            if rounds is not None:
                found.conversation.append("no session after the resume")
            return found
        batches: list[Batch[Effect]] = await store.batches(SESSION_ID)
        found.batches = len(batches)
        revisions = [b.revision for b in batches]
        if revisions != list(range(1, len(batches) + 1)):
            found.whole.append(f"revisions are not 1..{len(batches)}: {revisions}")
        stored: dict[int, str] = {}  # by position in the log: revision r is the r-th batch
        for position, b in enumerate(batches, start=1):
            sha = common.digest(codec, b)
            stored[position] = sha
            if b.session_id != SESSION_ID:
                found.whole.append(f"batch {b.revision} names session {b.session_id!r}")
            if (sha, len(b.effects)) not in intents.get(b.revision, set()):
                wanted = sorted(n for _, n in intents.get(b.revision, set()))
                found.whole.append(
                    f"batch {b.revision} ({len(b.effects)} effects) is not byte-identical to "
                    f"any batch submitted for that revision (effects submitted: {wanted})"
                )
        for a in acks:
            if stored.get(a["rev"]) != a["sha"]:
                found.lost.add(f"rev {a['rev']}")
        current: Session[Any] = await store.load(SESSION_ID)
        if current.revision != len(batches):
            found.whole.append(
                f"load() is at revision {current.revision} but the log holds {len(batches)}"
            )
        replay: Session[Any] = await store.load_at(SESSION_ID, 0)
        if replay.revision != 0 or replay.conversation:
            found.whole.append(f"load_at(0) is not the empty revision-0 session: {replay!r}")
        for b in batches:
            replay = apply_batch(replay, b.effects)
            at = await store.load_at(SESSION_ID, b.revision)
            if at != replay:
                found.whole.append(f"load_at({b.revision}) differs from the replayed log")
        if current != replay:
            found.whole.append("load() differs from the replayed log")
        if batches and await store.load_at(SESSION_ID, len(batches)) != current:
            found.whole.append(f"load() differs from load_at({len(batches)})")
        if rounds is not None:
            found.conversation.extend(conversation_problems(current.conversation, rounds))
    except Exception as exc:
        found.whole.append(f"reading the store failed: {type(exc).__name__}: {exc}")
    finally:
        await store.aclose()
    return found


# -- the parent -------------------------------------------------------------------------


@dataclass
class Child:
    """How a child ended."""

    returncode: int | None
    stdout: str
    stderr: str
    elapsed: float = 0.0
    """Seconds from the child's ``ready`` to its end, as the parent saw them."""

    @property
    def killed(self) -> bool:
        return self.returncode == -signal.SIGKILL

    def tail(self) -> str:
        lines = [line for line in self.stderr.strip().splitlines() if line.strip()]
        return " | ".join(lines[-3:]) if lines else f"exit status {self.returncode}"


@dataclass(frozen=True)
class Options:
    """Size and tuning of a harness run."""

    store: str
    rounds: int = 3
    snapshot_every: int = 3
    timeout: float = 120.0
    from_v1: bool = False


GOLDEN_SQLITE = Path(__file__).resolve().parents[1] / "fixtures" / "golden" / "sqlite"
"""The golden SQLite databases (``store-v1.db``, ...) and their ``expected.json``."""


async def golden_problems(spec: str, folder: Path) -> list[str]:
    """The golden sessions of the store in ``folder`` that no longer read as expected."""
    fixtures = str(GOLDEN_SQLITE.parents[1])
    if fixtures not in sys.path:
        sys.path.append(fixtures)
    import make_golden_sqlite  # the fixture script (its codec), beside the fixtures

    expected = json.loads((GOLDEN_SQLITE / "expected.json").read_text(encoding="utf-8"))
    problems: list[str] = []
    store = await common.open_store(spec, folder, make_golden_sqlite.make_codec())
    try:
        for session_id, content in expected["sessions"].items():
            try:
                session = await store.load(session_id)
                log = await store.batches(session_id)
            except Exception as exc:
                problems.append(f"golden session {session_id!r}: {type(exc).__name__}: {exc}")
                continue
            if (
                json.loads(msgspec.json.encode(session, enc_hook=Conversation.enc_hook))
                != content["revisions"][-1]
            ):
                problems.append(f"golden session {session_id!r} differs from expected.json")
            added_later = {"refused": [], "trace": None}  # batch fields newer than the fixture
            if json.loads(msgspec.json.encode(log)) != [
                {**added_later, **batch} for batch in content["batches"]
            ]:
                problems.append(f"golden session {session_id!r}: its log differs")
    finally:
        await store.aclose()
    return problems


def run_child(
    options: Options,
    folder: Path,
    *,
    kill_at: str | None = None,
    kill_k: int = 0,
    kill_after: tuple[int, float] | None = None,
) -> Child:
    """Run one agent child in ``folder``.

    With ``kill_after=(acks, seconds)`` the parent SIGKILLs it ``seconds``
    after it has acknowledged ``acks`` batches (so random kills land all over
    the run however fast or loaded the machine is).
    """
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "agent",
        "--store",
        options.store,
        "--dir",
        str(folder),
        "--rounds",
        str(options.rounds),
        "--snapshot-every",
        str(options.snapshot_every),
    ]
    if kill_at is not None:
        command += ["--kill-at", kill_at, "--kill-k", str(kill_k)]
    errors = folder / f"stderr-{len(list(folder.glob('stderr-*.txt')))}.txt"
    with (
        errors.open("ab") as stderr,
        subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL
        ) as process,
    ):
        assert process.stdout is not None
        first = process.stdout.readline()
        ready = time.perf_counter()
        try:
            if kill_after is not None and first.strip() == b"ready":
                acks, delay = kill_after
                deadline = ready + options.timeout
                while process.poll() is None and count_acks(folder) < acks:
                    if time.perf_counter() > deadline:
                        with errors.open("a") as note:
                            note.write(f"\nharness: no ack {acks} after {options.timeout} s\n")
                        break
                    time.sleep(0.001)
                time.sleep(delay)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
            out, _ = process.communicate(timeout=options.timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            out, _ = process.communicate()
            with errors.open("a") as note:
                note.write(f"\nharness: child timed out after {options.timeout} s\n")
        elapsed = time.perf_counter() - ready
        stdout = (first + out).decode(errors="replace")
        returncode = process.returncode
    return Child(returncode, stdout, errors.read_text(errors="replace"), elapsed)


def count_acks(folder: Path) -> int:
    """How many batches the child in ``folder`` has acknowledged so far."""
    try:
        return (folder / "acks.jsonl").read_bytes().count(b'"kind": "ack"')
    except FileNotFoundError:
        return 0


def last_json(stdout: str) -> dict[str, Any]:
    """The JSON report a child prints last."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            report: dict[str, Any] = json.loads(line)
            return report
    return {}


@dataclass
class PointResult:
    """The outcome of one crash point."""

    label: str
    boundary: str | None
    killed: bool
    lost: int = 0
    half_applied: int = 0
    invalid: int = 0
    batches: int = 0
    acked: int = 0
    notes: list[str] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return (
            f"point={self.label} killed={'yes' if self.killed else 'no'} "
            f"batches={self.batches} acked={self.acked} lost={self.lost} "
            f"half_applied={self.half_applied} invalid={self.invalid}"
        )


def crash_point(
    options: Options,
    folder: Path,
    label: str,
    *,
    kill_at: str | None = None,
    kill_k: int = 0,
    kill_after: tuple[int, float] | None = None,
) -> PointResult:
    """Crash a child at one point, check the store, resume in a fresh child, check again."""
    folder.mkdir(parents=True)
    if options.from_v1:
        shutil.copyfile(GOLDEN_SQLITE / "store-v1.db", common.store_location(options.store, folder))
    crashed = run_child(options, folder, kill_at=kill_at, kill_k=kill_k, kill_after=kill_after)
    report = last_json(crashed.stdout)
    report["parent_elapsed"] = crashed.elapsed
    result = PointResult(label, kill_at, crashed.killed, report=report)
    if not crashed.killed and crashed.returncode != 0:
        result.notes.append(f"the crashing child failed: {crashed.tail()}")
        result.invalid = 1
    records = common.read_records(folder / "acks.jsonl")
    after_crash = anyio.run(inspect_store, options.store, folder, records)
    resumed = run_child(options, folder)
    records = common.read_records(folder / "acks.jsonl")
    after_resume = anyio.run(inspect_store, options.store, folder, records, options.rounds)
    result.lost = len(after_crash.lost | after_resume.lost)
    if options.from_v1:
        golden = anyio.run(golden_problems, options.store, folder)
        result.lost += len(golden)
        result.notes.extend(golden)
    result.notes.extend(f"lost after crash: {x}" for x in sorted(after_crash.lost))
    result.notes.extend(
        f"lost after resume: {x}" for x in sorted(after_resume.lost - after_crash.lost)
    )
    whole = [f"after crash: {p}" for p in after_crash.whole]
    whole += [f"after resume: {p}" for p in after_resume.whole]
    result.notes.extend(whole)
    result.half_applied = int(bool(whole))
    if resumed.returncode != 0:
        result.notes.append(f"the resuming child failed: {resumed.tail()}")
        result.invalid = 1
    if after_resume.conversation:
        result.notes.extend(f"invalid after resume: {p}" for p in after_resume.conversation)
        result.invalid = 1
    result.batches = after_resume.batches
    result.acked = after_crash.acked
    return result


def pick(count: int, limit: int) -> list[int]:
    """Occurrences 1..count, or ``limit`` of them spread from the first to the last."""
    if limit <= 0 or count <= limit:
        return list(range(1, count + 1))
    if limit == 1:
        return [1]
    return sorted({1 + round(i * (count - 1) / (limit - 1)) for i in range(limit)})


@dataclass
class Summary:
    """The outcome of a harness run."""

    store: str
    boundaries: tuple[str, ...]
    counts: dict[str, int]
    points: list[PointResult]

    @property
    def crash_points(self) -> int:
        return sum(p.killed for p in self.points)

    @property
    def lost(self) -> int:
        return sum(p.lost for p in self.points)

    @property
    def half_applied(self) -> int:
        return sum(p.half_applied for p in self.points)

    @property
    def invalid(self) -> int:
        return sum(p.invalid for p in self.points)

    @property
    def boundaries_hit(self) -> set[str]:
        """The boundaries at which a child was actually killed."""
        return {p.boundary for p in self.points if p.killed and p.boundary is not None}

    @property
    def never_hit(self) -> list[str]:
        """The boundaries of the store no child was killed at."""
        return [b for b in self.boundaries if b not in self.boundaries_hit]

    def lines(self) -> list[str]:
        """One line per crash point (with its notes indented), then the summary line."""
        lines = [f"boundary hits in one uncrashed run: {json.dumps(self.counts, sort_keys=True)}"]
        for point in self.points:
            lines.append(point.line())
            lines.extend(f"    {note}" for note in point.notes)
        lines.extend(
            f"boundary {b} was never hit: no child was killed there" for b in self.never_hit
        )
        lines.append(self.last_line())
        return lines

    def last_line(self) -> str:
        return (
            f"crash_points={self.crash_points} lost={self.lost} "
            f"half_applied={self.half_applied} invalid={self.invalid}"
        )

    @property
    def ok(self) -> bool:
        return (
            self.crash_points > 0
            and not self.never_hit
            and self.lost == self.half_applied == self.invalid == 0
        )


def run(
    store: str,
    *,
    rounds: int = 3,
    max_per_boundary: int = 0,
    random_kills: int = 0,
    seed: int = 0,
    snapshot_every: int = 3,
    jobs: int = 2,
    workdir: Path | None = None,
    timeout: float = 120.0,
    echo: bool = True,
    from_v1: bool = False,
) -> Summary:
    """Run the harness; print one line per crash point when ``echo``; return the summary.

    With ``from_v1`` (``store`` must be ``"sqlite"``) every point starts from
    the golden schema-version-1 database, migrated on open.
    """
    if from_v1 and store != "sqlite":
        raise ValueError(f"from_v1 needs the sqlite store, not {store!r}")
    options = Options(store, rounds, snapshot_every, timeout, from_v1)
    boundaries = common.boundaries_of(store)
    with contextlib.ExitStack() as stack:
        stack.enter_context(common.store_server(store))
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="crash-")))
        baseline = crash_point(options, workdir / "baseline", "baseline")
        counts: dict[str, int] = baseline.report.get("counts", {})
        total = baseline.acked
        per_batch = float(baseline.report.get("parent_elapsed", 0.5)) / max(1, total)
        if echo:
            print(baseline.line())
            for note in baseline.notes:
                print(f"    {note}")
            print(f"boundary hits in one uncrashed run: {json.dumps(counts, sort_keys=True)}")
        plan: list[tuple[str, dict[str, Any]]] = []
        if baseline.lost or baseline.half_applied or baseline.invalid or not counts:
            if echo:
                print("the uncrashed run already fails; no crash points are tried")
            random_kills = 0
            boundaries_to_try: tuple[str, ...] = ()
        else:
            boundaries_to_try = boundaries
        plan.extend(
            (f"{boundary}#{k}", {"kill_at": boundary, "kill_k": k})
            for boundary in boundaries_to_try
            for k in pick(counts.get(boundary, 0), max_per_boundary)
        )
        rng = random.Random(seed)
        for index in range(random_kills):
            acks = rng.randrange(0, total + 1)
            delay = rng.uniform(0.0, per_batch)
            label = f"random{index}@ack{acks}+{delay * 1000:.1f}ms"
            plan.append((label, {"kill_after": (acks, delay)}))

        def one(item: tuple[int, tuple[str, dict[str, Any]]]) -> PointResult:
            index, (label, kwargs) = item
            return crash_point(options, workdir / f"p{index:04d}", label, **kwargs)

        points = [baseline]
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            for result in pool.map(one, enumerate(plan)):
                points.append(result)
                if echo:
                    print(result.line(), flush=True)
                    for note in result.notes:
                        print(f"    {note}", flush=True)
    summary = Summary(store, boundaries, counts, points)
    if echo:
        for boundary in summary.never_hit:
            print(f"boundary {boundary} was never hit: no child was killed there")
        print(summary.last_line(), flush=True)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else "")
    parser.add_argument("--store", required=True, help="sqlite, file, postgres, or module:Class")
    parser.add_argument("--rounds", type=int, default=3, help="user turns in the script")
    parser.add_argument(
        "--max-per-boundary",
        type=int,
        default=0,
        help="occurrences of each boundary to crash at, spread first to last (0: all)",
    )
    parser.add_argument("--random-kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--snapshot-every", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--timeout", type=float, default=120.0, help="per child, seconds")
    parser.add_argument("--workdir", type=Path, help="keep the stores here (default: temp)")
    parser.add_argument(
        "--from-v1",
        action="store_true",
        help="sqlite only: start every point from the golden schema-version-1 database",
    )
    parser.add_argument("--child", choices=["agent"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--kill-at", help=argparse.SUPPRESS)
    parser.add_argument("--kill-k", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "agent":
        anyio.run(agent, args)
        return 0
    if args.from_v1 and args.store != "sqlite":
        parser.error("--from-v1 needs --store sqlite")
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    summary = run(
        args.store,
        rounds=args.rounds,
        max_per_boundary=args.max_per_boundary,
        random_kills=args.random_kills,
        seed=args.seed,
        snapshot_every=args.snapshot_every,
        jobs=args.jobs,
        workdir=args.workdir,
        timeout=args.timeout,
        from_v1=args.from_v1,
    )
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
