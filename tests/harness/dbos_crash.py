"""Crash harness for durable turns on DBOS: SIGKILL workers mid-turn, check nothing went wrong.

    python tests/harness/dbos_crash.py [--workers K] [--sessions M] [--turns T]
                                       [--kills N] [--seed S] [--non-idempotent]

K worker processes serve one PostgreSQL database (the stepmachine store, DBOS's
tables and this harness's side-effect tables, each in its own schema). Each
worker is a :class:`stepmachine.durable.DurableMachine` with a stable executor
id ``worker-<slot>``. The supervisor (this process) appends a user message to
each of M sessions and enqueues a turn (``dbos.DBOSClient``); when a turn ends
it appends the next message and enqueues the next turn, at least T turns per
session, and more until N kills have landed.

Each worker is a new process forked from a ``multiprocessing`` fork server that
imported DBOS and stepmachine once (:func:`fork_server`), so a replacement is
serving within a second of a kill instead of after seconds of imports. The
supervisor migrates DBOS's tables (``DBOS.migrate``) before the first workers
start, all at once. The workers hold the store's leases for 3 s (:data:`LEASE`):
a turn recovered after a kill waits for the dead worker's lease to lapse.

Meanwhile it SIGKILLs, at random moments, a worker that has a turn PENDING
(mid-turn, then: in a model call, in a tool, between a store commit and DBOS's
record of the step, ...), and starts a fresh process for the slot with the same
executor id: its ``DBOS.launch()`` hands the dead process's PENDING turns back
to the queue, and whichever worker dequeues a turn resumes it from its last
recorded cycle. A kill counts only if the turn was still PENDING under the dead
process afterwards (it really was mid-turn).

The scripted model makes each turn two rounds of two parallel calls of the
idempotent tool ``work`` (it dedupes by idempotency key, and counts every raw
execution), then a reply. With ``--non-idempotent`` each first round also calls
``send``, a non-idempotent tool (a kill between its intent and its result makes
it "outcome unknown", by design). Every tool run also checks, before acting,
whether its call already has a result in the store: a run after that is a tool
run twice.

Checks at the end: every acknowledged batch is in the store with the same bytes
and each session's revisions are 1..N with no gap (``lost``); no side effect
applied twice and no tool run after its result was stored
(``duplicate_side_effects``); every history is provider-valid
(``history_problems == []``), each call has exactly one result, the last turn
was answered, and DBOS's record agrees with the store (every turn SUCCESS, turn
reports chain revision to revision, each cycle's revision was written by the
step it names, the last report's revision is the store's) (``invalid``);
``outcome_unknown`` counts calls answered "outcome unknown", each of which must
be a ``send`` whose process was killed (else it is counted invalid).

Two options make a crash point deterministic (the tests use them): ``--self-kill
TOOL`` makes the first run of TOOL in the whole run SIGKILL its own worker right
after its side effect; ``--mislabel`` declares ``send`` idempotent although it
does not dedupe, a broken agent whose second ``send`` the harness must report.

``--restart-db`` runs on a throwaway server of its own and restarts it
(``pg_ctl restart -m fast``, then ``-m immediate``: :data:`RESTARTS`) once the
first turns are enqueued; the supervisor and the tools retry store calls that
fail meanwhile (the next turn is submitted and enqueued idempotently).

Without ``$STEPMACHINE_TEST_POSTGRES`` a throwaway server is started (see
``_postgres.py``); either way the run gets a fresh database, dropped at the end.

Output: ``problem: ...`` lines, then ``seed=... turns=... cut_by_a_kill=...
finished_on_another_slot=... reruns=... seconds=...``, then the last line
``workers=K sessions=M kills=N lost=0 duplicate_side_effects=0 dropped_turns=0
invalid=0 outcome_unknown=0`` (``dropped_turns``: turns enqueued that never
ended, or sessions that never got their next turn, when the run stalls; a turn
that ended ERROR is counted invalid, with DBOS's record); exit status 1 if a
check failed or fewer than N kills landed. Import it and call :func:`run_dbos`
(or ``main(argv)``) for the counts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import _common as common  # beside this file: on sys.path as a script and in pytest
import _postgres  # beside this file
import anyio

import stepmachine
from stepmachine import (
    AppendMessage,
    Effect,
    LeasePolicy,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    Session,
    StateMachine,
    ToolContext,
    Tools,
    submit,
    tool,
)
from stepmachine._transient import is_transient
from stepmachine.extend import OUTCOME_UNKNOWN, Batch, Lease, history_problems
from stepmachine.stores import PostgresStore
from stepmachine.testing import FunctionModel, call, reply

APP = "stepmachine-dbos-harness"
NAME = "harness"  # DurableMachine name: workflow harness.turn, queue harness.turns
VERSION = "harness-1"
READY_TIMEOUT = 120  # seconds a worker may take to import and launch DBOS
STALL_TIMEOUT = 180  # seconds without any turn ending before the run is declared stuck
RESTARTS = ((0.5, "fast"), (3.0, "immediate"))
"""``--restart-db``: when (seconds after the first turns were enqueued) and how the
server is restarted; a restart still under way delays the next one."""
LEASE = LeasePolicy(ttl=3.0, poll=0.1)
"""The workers' lease policy. A killed worker's cycle leaves the session's lease held
until its ttl lapses, and the turn's recovery waits for that: with the default 30 s
ttl every kill mid-cycle stalls its session 30 s. 3 s (renewed each second while a
cycle runs) still outlasts a loaded machine's scheduling pauses. Should one lapse
under a live worker anyway, its next write is refused and the cycle tried again (the
product's own case, not a loss); a ``send`` caught in that is answered "outcome
unknown" in a process that was not killed, which the checks count invalid."""
RETRY_PAUSE = 0.25  # seconds between two tries of a store call while the server restarts
RETRY_ATTEMPTS = 240
SCHEMA = """
CREATE SCHEMA IF NOT EXISTS harness;
CREATE TABLE IF NOT EXISTS harness.runs (
    key text NOT NULL, tool text NOT NULL, pid integer NOT NULL, after_result boolean NOT NULL,
    session text NOT NULL, call_id text NOT NULL
);
CREATE TABLE IF NOT EXISTS harness.applied (key text PRIMARY KEY, tool text NOT NULL);
"""


@dataclass(frozen=True)
class Agent:
    """How the workers' agent behaves (the same in every worker of a run).

    Attributes:
        non_idempotent: each turn's first round also calls ``send``.
        self_kill: a tool name: the first run of that tool in the whole run
            SIGKILLs its own worker right after its side effect (a deterministic
            crash point, on top of the random kills).
        mislabel: ``send`` is declared idempotent although it does not dedupe
            (a broken agent: the harness must report its duplicate side effects).
    """

    non_idempotent: bool = False
    self_kill: str | None = None
    mislabel: bool = False


@dataclass
class Counts:
    """What a run saw; ``ok`` when nothing went wrong."""

    workers: int
    sessions: int
    kills: int = 0
    lost: int = 0
    duplicate_side_effects: int = 0
    dropped_turns: int = 0
    invalid: int = 0
    outcome_unknown: int = 0
    turns: int = 0
    restarts: int = 0
    store_errors: int = 0
    reruns: int = 0
    cut: dict[str, str] = field(default_factory=dict)  # turn cut by a kill -> executor killed
    finished_elsewhere: int = 0  # of those, turns a worker of another slot finished
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"workers={self.workers} sessions={self.sessions} kills={self.kills} "
            f"lost={self.lost} duplicate_side_effects={self.duplicate_side_effects} "
            f"dropped_turns={self.dropped_turns} "
            f"invalid={self.invalid} outcome_unknown={self.outcome_unknown}"
        )

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicate_side_effects or self.dropped_turns or self.invalid)


def transient_or_wrapped(exc: BaseException) -> bool:
    """:func:`is_transient`, also for an error that wraps a transient one (SQLAlchemy's
    ``OperationalError``, raised by DBOS, wraps psycopg's)."""
    return is_transient(exc) or (exc.__cause__ is not None and is_transient(exc.__cause__))


async def retrying(work: Any, attempts: int = RETRY_ATTEMPTS) -> Any:
    """``await work()``, again :data:`RETRY_PAUSE` later while it raises a transient error
    (the server restarting), as a careful client of the store does."""
    for attempt in range(1, attempts + 1):
        try:
            return await work()
        except Exception as exc:
            if not transient_or_wrapped(exc) or attempt == attempts:
                raise
            await asyncio.sleep(RETRY_PAUSE)
    raise AssertionError("unreachable")


# -- the agent every worker runs ----------------------------------------------------------


def decide(non_idempotent: bool) -> Any:
    """A stateless scripted model: per user turn, two rounds of tool calls, then a reply."""

    async def answer(request: ModelRequest) -> ModelResponse:
        await asyncio.sleep(random.uniform(0, 0.03))  # kills land inside model calls too
        messages = request.messages
        turn = sum(1 for m in messages if m.role == "user")
        last_user = max(i for i, m in enumerate(messages) if m.role == "user")
        rounds = sum(1 for m in messages[last_user:] if m.role == "assistant")
        if rounds >= 2:
            return reply(f"turn {turn} done")
        calls: list[tuple[str, dict[str, Any]]] = [
            ("work", {"turn": turn, "step": rounds, "part": part}) for part in range(2)
        ]
        if non_idempotent and rounds == 0:
            calls.append(("send", {"turn": turn}))
        return call(*calls)

    return answer


async def act(ctx: ToolContext, name: str, idempotent: bool) -> str:
    """One tool run: note whether its result is already stored, count it, apply once."""
    store = ctx.runtime.store
    assert store is not None
    stored = await retrying(lambda: store.load(ctx.session_id))
    done = any(r.call_id == ctx.call_id for m in stored.conversation for r in m.tool_results)
    dsn = ctx.runtime.services["dsn"]

    def write() -> bool:
        import psycopg

        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO harness.runs VALUES (%s, %s, %s, %s, %s, %s)",
                (ctx.idempotency_key, name, os.getpid(), done, ctx.session_id, ctx.call_id),
            )
            if not idempotent:
                conn.execute(
                    "INSERT INTO harness.applied VALUES (%s, %s) ON CONFLICT DO NOTHING",
                    (ctx.idempotency_key, name),
                )
                return True
            inserted = conn.execute(
                "INSERT INTO harness.applied VALUES (%s, %s) ON CONFLICT DO NOTHING RETURNING 1",
                (ctx.idempotency_key, name),
            ).fetchone()
            return inserted is not None

    applied = await retrying(lambda: anyio.to_thread.run_sync(write))
    agent: Agent = ctx.runtime.services["agent"]
    marker = ctx.runtime.services["folder"] / "self-killed"
    if agent.self_kill == name and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    await asyncio.sleep(random.uniform(0, 0.03))  # kills land between the effect and its result
    return f"{name} {'applied' if applied else 'already applied'}"


@tool(side_effects="idempotent", thread=False)
async def work(turn: int, step: int, part: int, ctx: ToolContext) -> str:
    """Do one piece of work (idempotent: deduplicated by the idempotency key)."""
    return await act(ctx, "work", idempotent=True)


async def send(turn: int, ctx: ToolContext) -> str:
    """Send a message to the outside world (not idempotent)."""
    return await act(ctx, "send", idempotent=False)


def build_machine(agent: Agent) -> StateMachine[Any]:
    labelled = "idempotent" if agent.mislabel else "non_idempotent"
    send_tool = tool(side_effects=labelled, thread=False)(send)
    return StateMachine([Tools([work, send_tool]), ModelInference()], lease=LEASE)


class AckingStore(PostgresStore):
    """A PostgresStore that logs every acknowledged batch (fsynced) to :attr:`acks`."""

    acks: ClassVar[common.AckLog | None] = None

    async def apply(self, batch: Batch[Effect], *, lease: Lease | None = None) -> Session[Any]:
        session = await super().apply(batch, lease=lease)
        if AckingStore.acks is not None:
            record = {
                "session": batch.session_id,
                "revision": batch.revision,
                "digest": common.digest(self.codec, batch),
            }
            AckingStore.acks.write(record)
        return session


async def worker(dsn: str, slot: int, folder: Path, agent: Agent) -> None:
    """Serve turns until killed."""
    from dbos import DBOS

    from stepmachine.durable import DurableMachine, dbos_config

    AckingStore.acks = common.AckLog(folder / f"acks-{os.getpid()}.jsonl")
    store = await retrying(lambda: AckingStore.open(dsn, max_size=8))
    model = FunctionModel(decide(agent.non_idempotent))
    services = {"dsn": dsn, "agent": agent, "folder": folder}
    runtime = Runtime(store=store, model=model, services=services)

    async def launch() -> Any:  # a DurableMachine
        DBOS(
            config=dbos_config(
                APP,
                dsn,
                executor_id=f"worker-{slot}",
                application_version=VERSION,
                log_level="WARNING",
            )
        )
        durable = DurableMachine(build_machine(agent), runtime, name=NAME, polling_interval=0.05)
        try:
            await durable.launch()
        except BaseException:
            DBOS.destroy(destroy_registry=True)  # the next try registers and launches anew
            raise
        return durable

    # A replacement can start while --restart-db restarts the server: launch again then.
    durable = await retrying(launch)
    (folder / f"ready-{slot}-{os.getpid()}").touch()
    await asyncio.Event().wait()
    del durable  # served until killed


# -- the supervisor -----------------------------------------------------------------------


def serve_worker(dsn: str, slot: int, folder: Path, agent: Agent) -> None:
    """A worker process's body (forked by :func:`fork_server`): output to its slot's log."""
    log = os.open(folder / f"worker-{slot}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    asyncio.run(worker(dsn, slot, folder, agent))


PRELOAD = [
    "__main__",  # imported once by the server, not by each worker
    "anyio",
    "dbos",
    "msgspec",
    "psycopg",
    "psycopg_pool",
    "stepmachine",
    "stepmachine.durable",
    "stepmachine.stores",
    "stepmachine.testing",
    "structlog",
]
"""What the fork server imports once, so that a worker started after a kill does not
import it again: a fresh interpreter spends seconds of CPU on these, and the 50-kill
run starts 50 replacements."""


def fork_server() -> Any:
    """The ``forkserver`` multiprocessing context the workers are started from.

    Every worker is a new process (``fork()`` of a server that imported
    :data:`PRELOAD` and holds no connection, thread or event loop), SIGKILLed as a
    process started from scratch would be. The server imports the stepmachine this
    process imported (its folder first on the server's ``PYTHONPATH``); it is started
    once per process and ends with it.
    """
    import multiprocessing
    import multiprocessing.forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    here = str(Path(stepmachine.__file__).resolve().parents[1])
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [saved])])
    try:
        multiprocessing.forkserver.ensure_running()  # a server already running is kept
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return context


@dataclass
class Slot:
    number: int
    process: Any  # a multiprocessing Process
    ready: Path


class Supervisor:
    def __init__(self, dsn: str, folder: Path, workers: int, agent: Agent) -> None:
        self.dsn = dsn
        self.folder = folder
        self.workers = workers
        self.agent = agent
        self.slots: dict[int, Slot] = {}
        self.killed: set[int] = set()
        self.context = fork_server()

    def start(self, number: int) -> Slot:
        process = self.context.Process(
            target=serve_worker,
            args=(self.dsn, number, self.folder, self.agent),
            name=f"worker-{number}",
            daemon=True,  # killed if this process exits without stop_all()
        )
        process.start()
        slot = Slot(number, process, self.folder / f"ready-{number}-{process.pid}")
        self.slots[number] = slot
        return slot

    async def wait_ready(self, slot: Slot) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while not slot.ready.exists():
            if slot.process.exitcode is not None:
                log = (self.folder / f"worker-{slot.number}.log").read_text()[-3000:]
                raise RuntimeError(f"worker {slot.number} exited {slot.process.exitcode}:\n{log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {slot.number} not ready after {READY_TIMEOUT}s")
            await asyncio.sleep(0.05)

    def kill(self, number: int) -> None:
        slot = self.slots[number]
        slot.process.kill()  # SIGKILL
        slot.process.join()
        self.killed.add(slot.process.pid)

    def died(self, slot: Slot) -> None:
        """``slot``'s process exited by itself: it must have been SIGKILLed; restart the slot."""
        if slot.process.exitcode != -signal.SIGKILL:
            log = (self.folder / f"worker-{slot.number}.log").read_text()[-3000:]
            raise RuntimeError(f"worker {slot.number} exited {slot.process.exitcode}:\n{log}")
        self.killed.add(slot.process.pid)
        self.start(slot.number)

    def stop_all(self) -> None:
        for slot in self.slots.values():
            if slot.process.exitcode is None:
                slot.process.kill()
                slot.process.join()


async def supervise(
    dsn: str,
    folder: Path,
    workers: int,
    sessions: int,
    turns: int,
    kills: int,
    seed: int,
    agent: Agent,
    restarter: _postgres.Restarter | None = None,
) -> Counts:
    import psycopg
    from dbos import DBOS, DBOSClient

    from stepmachine.durable import DurableMachine, MsgspecSerializer, TurnReport

    rng = random.Random(seed)
    counts = Counts(workers, sessions)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
    store = await PostgresStore.open(dsn)
    ids = [f"s{i}" for i in range(sessions)]
    for sid in ids:
        await store.create(sid)
    supervisor = Supervisor(dsn, folder, workers, agent)
    durable = DurableMachine(build_machine(agent), Runtime(store=store), name=NAME)
    began = time.monotonic()
    client: DBOSClient | None = None
    try:
        # DBOS's tables first (each worker's launch would migrate them; two at once could
        # collide), then every worker starts at once: their launches only find the tables.
        await asyncio.to_thread(DBOS.migrate, dsn)
        for number in range(workers):
            supervisor.start(number)
        for number in range(workers):
            await supervisor.wait_ready(supervisor.slots[number])
        client = DBOSClient(
            system_database_url=dsn, serializer=MsgspecSerializer(), application_name=APP
        )
        done_turns: dict[str, list[tuple[int, str]]] = {sid: [] for sid in ids}  # (rev, wid)
        active: dict[str, str] = {}  # workflow id -> session

        async def next_turn(sid: str) -> None:
            """Submit the session's next user message and enqueue its turn; tried again
            (the same message id and turn id) after a store error: each part is done once."""
            number = len(done_turns[sid]) + 1
            message_id = f"{sid}-u{number}"
            wid = f"{sid}-turn-{number}"
            revision = await submitted_at(store, sid, message_id)
            if revision is None:
                user = Message.user(f"please do turn {number}", id=message_id)
                after = await submit(store, sid, [AppendMessage(user)])
                revision = after.revision
            options = durable.enqueue_options(sid, turn_id=wid)
            assert client is not None
            await client.enqueue_async(options, sid)  # idempotent: the turn id
            done_turns[sid].append((revision, wid))
            active[wid] = sid

        owed: set[str] = set()  # sessions whose next turn could not be submitted yet
        for sid in ids:
            owed.add(sid)
        if restarter is not None:
            restarter.start()
        next_kill = time.monotonic() + rng.uniform(0.05, 0.6)
        progress = time.monotonic()
        while active or owed:
            if time.monotonic() - progress > STALL_TIMEOUT:
                counts.dropped_turns += len(active) + len(owed)
                counts.problems.append(
                    f"no turn ended for {STALL_TIMEOUT}s: turns {sorted(active)} never ended, "
                    f"sessions {sorted(owed)} never got their next turn"
                )
                break
            try:
                for sid in sorted(owed):
                    await next_turn(sid)
                    owed.discard(sid)
                statuses = await client.list_workflows_async(workflow_ids=list(active))
                for status in statuses:
                    if status.status in {"PENDING", "ENQUEUED"}:
                        continue
                    progress = time.monotonic()
                    sid = active.pop(status.workflow_id)
                    if status.status != "SUCCESS":
                        counts.problems.append(
                            f"{status.workflow_id}: {status.status} {status.error}"
                        )
                        continue
                    finished = len(done_turns[sid])
                    restarting = restarter is not None and not restarter.finished
                    if finished < turns or counts.kills < kills or restarting:
                        owed.add(sid)
                for slot in list(supervisor.slots.values()):
                    if slot.process.exitcode is not None:  # a worker that killed itself
                        supervisor.died(slot)
                        counts.kills += 1
                if counts.kills < kills and time.monotonic() >= next_kill:
                    await kill_one(client, supervisor, counts, rng)
                    next_kill = time.monotonic() + rng.uniform(0.05, 0.6)
            except Exception as exc:
                if not transient_or_wrapped(exc):
                    raise
                counts.store_errors += 1  # the server restarts: the next pass goes on
            await asyncio.sleep(0.02)
        if restarter is not None:
            restarter.stop()
            counts.restarts = len(restarter.done)
            counts.problems.extend(restarter.errors)
            if len(restarter.done) < len(restarter.schedule):
                counts.problems.append(
                    f"{len(restarter.done)} of {len(restarter.schedule)} server restarts made"
                )
        counts.seconds = time.monotonic() - began
        await check(store, client, folder, supervisor, done_turns, counts, TurnReport, dsn)
    finally:
        supervisor.stop_all()
        if client is not None:
            client.destroy()
        await store.aclose()
    return counts


async def submitted_at(store: PostgresStore, sid: str, message_id: str) -> int | None:
    """The revision that stored the user message ``message_id``, or ``None`` (not stored)."""
    session = await store.load(sid)
    if not any(m.id == message_id for m in session.conversation):
        return None
    for batch in await store.batches(sid):
        for effect in batch.effects:
            if isinstance(effect, AppendMessage) and effect.message.id == message_id:
                return batch.revision
    return None


async def kill_one(client: Any, supervisor: Supervisor, counts: Counts, rng: random.Random) -> None:
    """SIGKILL a worker with a PENDING turn; restart its slot (same executor id)."""
    pending = await client.list_workflows_async(
        status="PENDING", queue_name=f"{NAME}.turns", load_input=False, load_output=False
    )
    owners = sorted({w.executor_id for w in pending if (w.executor_id or "").startswith("worker-")})
    alive = [
        int(owner.removeprefix("worker-"))
        for owner in owners
        if supervisor.slots[int(owner.removeprefix("worker-"))].ready.exists()
    ]
    if not alive:
        return
    number = rng.choice(alive)
    supervisor.kill(number)
    after = await client.list_workflows_async(
        status="PENDING", executor_id=f"worker-{number}", queue_name=f"{NAME}.turns"
    )
    if after:  # the dead process still owned a running turn: a kill mid-turn
        counts.kills += 1
        counts.cut.update((w.workflow_id, f"worker-{number}") for w in after)
    supervisor.start(number)  # its DBOS.launch() recovers worker-<number>'s PENDING turns


async def check(
    store: PostgresStore,
    client: Any,
    folder: Path,
    supervisor: Supervisor,
    done_turns: dict[str, list[tuple[int, str]]],
    counts: Counts,
    report_type: Any,
    dsn: str,
) -> None:
    import psycopg

    problems = counts.problems
    counts.invalid += len(problems)
    # lost: every acknowledged batch is stored with the same bytes; revisions have no gap
    stored: dict[tuple[str, int], str] = {}
    batches: dict[str, list[Batch[Effect]]] = {}
    for sid in done_turns:
        batches[sid] = await store.batches(sid)
        revisions = [b.revision for b in batches[sid]]
        if revisions != list(range(1, len(revisions) + 1)):
            counts.lost += 1
            problems.append(f"{sid}: revisions {revisions} have a gap")
        for batch in batches[sid]:
            stored[batch.session_id, batch.revision] = common.digest(store.codec, batch)
    for path in sorted(os.listdir(folder)):
        if not path.startswith("acks-"):
            continue
        for ack in common.read_records(folder / path):
            if stored.get((ack["session"], ack["revision"])) != ack["digest"]:
                counts.lost += 1
                problems.append(f"acknowledged batch lost or changed: {ack}")
    # side effects
    with psycopg.connect(dsn) as conn:
        runs = conn.execute(
            "SELECT key, tool, pid, after_result, session, call_id FROM harness.runs"
        ).fetchall()
    per_key = Counter(key for key, *_ in runs)
    tools = {key: name for key, name, *_ in runs}
    late = [(key, name) for key, name, _, after, *_ in runs if after]
    counts.duplicate_side_effects += len(late)
    problems += [f"tool {name} ran after its result was stored ({key})" for key, name in late]
    twice = [key for key, n in per_key.items() if n > 1 and tools[key] == "send"]
    counts.duplicate_side_effects += len(twice)
    problems += [f"non-idempotent send ran {per_key[key]} times ({key})" for key in twice]
    counts.reruns = sum(n - 1 for key, n in per_key.items() if tools[key] == "work")
    pids_of: dict[tuple[str, str], set[int]] = {}  # (session, call id) -> pids that ran it
    for _, _, pid, _, session_id, call_id in runs:
        pids_of.setdefault((session_id, call_id), set()).add(pid)
    # histories, and DBOS's record against the store
    for sid, turns in done_turns.items():
        session = await store.load(sid)
        conversation = session.conversation
        found = history_problems(conversation)
        calls = [c for m in conversation for c in m.tool_calls]
        results = Counter(r.call_id for m in conversation for r in m.tool_results)
        if found or any(results[c.call_id] != 1 for c in calls) or len(results) != len(calls):
            counts.invalid += 1
            problems.append(f"{sid}: history problems {found} or a call without one result")
        if conversation[-1].text != f"turn {len(turns)} done":
            counts.invalid += 1
            problems.append(f"{sid}: ends with {conversation[-1].text!r}")
        for message in conversation:
            for result in message.tool_results:
                if result.content != OUTCOME_UNKNOWN:
                    continue
                counts.outcome_unknown += 1
                name = next(c.name for c in calls if c.call_id == result.call_id)
                ran_in = pids_of.get((sid, result.call_id), set())
                if name != "send" or not ran_in <= supervisor.killed:
                    counts.invalid += 1
                    problems.append(f"{sid}: {result.call_id} ({name}) unknown, ran in {ran_in}")
        counts.turns += len(turns)
        by_revision = {b.revision: b for b in batches[sid]}
        previous_end = 0
        for index, (submitted, wid) in enumerate(turns):
            [status] = await client.list_workflows_async(workflow_ids=[wid])
            if status.status != "SUCCESS":
                continue  # already counted
            if wid in counts.cut and status.executor_id != counts.cut[wid]:
                counts.finished_elsewhere += 1
            report = report_type.from_output(status.output)
            bad = []
            if report.start_revision != submitted or submitted != previous_end + 1:
                bad.append(f"started at {report.start_revision}, message at {submitted}")
            last = report.start_revision
            for cycle in report.cycles:
                if cycle.revision < last:
                    bad.append(f"cycle {cycle.cycle} went back to {cycle.revision}")
                named = cycle.status != "idle"  # an idle cycle names no step
                if (
                    named
                    and cycle.revision > last
                    and by_revision[cycle.revision].step != cycle.step
                ):
                    bad.append(f"cycle {cycle.cycle} names {cycle.step}")
                last = cycle.revision
            if index == len(turns) - 1 and report.revision != session.revision:
                bad.append(f"last report at {report.revision}, store at {session.revision}")
            if bad:
                counts.invalid += 1
                problems.append(f"{wid}: DBOS and the store disagree: {bad}")
            previous_end = report.revision


def run_dbos(
    *,
    workers: int = 3,
    sessions: int = 4,
    turns: int = 2,
    kills: int = 50,
    seed: int | None = None,
    agent: Agent | None = None,
    dsn: str | None = None,
    restart_db: bool = False,
) -> Counts:
    """Run the harness (on ``dsn``'s server, or ``$STEPMACHINE_TEST_POSTGRES``, or a
    throwaway server) in a fresh database; return the counts.

    ``restart_db``: on a throwaway server of its own (``dsn`` and the variable are not
    used), restarted on :data:`RESTARTS` (``-m fast``, then ``-m immediate``).
    """
    seed = random.randrange(2**32) if seed is None else seed
    with contextlib.ExitStack() as stack:
        restarter: _postgres.Restarter | None = None
        if restart_db:
            own = stack.enter_context(_postgres.throwaway_server())
            restarter = _postgres.Restarter(own, RESTARTS)
            server = own.dsn
        else:
            server = dsn or stack.enter_context(_postgres.postgres_server())
        database = stack.enter_context(_postgres.fresh_database(server, prefix="stepmachine_dbos"))
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dbos-crash-")))
        return asyncio.run(
            supervise(
                database,
                folder,
                workers,
                sessions,
                turns,
                kills,
                seed,
                agent or Agent(),
                restarter,
            )
        )
    raise AssertionError("unreachable")  # pragma: no cover


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=2, help="at least this many per session")
    parser.add_argument("--kills", type=int, default=50, help="mid-turn kills to land")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--non-idempotent", action="store_true", help="also call send")
    parser.add_argument("--self-kill", choices=["work", "send"], help="see Agent.self_kill")
    parser.add_argument("--mislabel", action="store_true", help="see Agent.mislabel")
    parser.add_argument(
        "--restart-db",
        action="store_true",
        help="restart the PostgreSQL server (a throwaway one of its own: pg_ctl restart -m "
        "fast, then -m immediate) while turns run",
    )
    args = parser.parse_args(argv)
    seed = random.randrange(2**32) if args.seed is None else args.seed
    counts = run_dbos(
        workers=args.workers,
        sessions=args.sessions,
        turns=args.turns,
        kills=args.kills,
        seed=seed,
        agent=Agent(args.non_idempotent, args.self_kill, args.mislabel),
        restart_db=args.restart_db,
    )
    for problem in counts.problems[:20]:
        print(f"problem: {problem}")
    print(
        f"seed={seed} turns={counts.turns} cut_by_a_kill={len(counts.cut)} "
        f"finished_on_another_slot={counts.finished_elsewhere} reruns={counts.reruns} "
        f"seconds={counts.seconds:.1f} restarts={counts.restarts} "
        f"store_errors={counts.store_errors}"
    )
    print(counts.line())
    return 0 if counts.ok and counts.kills >= args.kills else 1


if __name__ == "__main__":
    sys.exit(main())
