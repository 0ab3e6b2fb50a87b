"""Workers harness: K worker processes on one PostgreSQL, SIGKILLed at random, drive M sessions.

Usage::

    python tests/harness/workers.py                  # 3 workers, 10 sessions of 6 turns, 20-30 s
    python tests/harness/workers.py --workers 4 --sessions 10 --seconds 40 --seed 7
    python tests/harness/workers.py --durable dbos   # durable turns: tests/harness/dbos_crash.py
    python tests/harness/workers.py --restart-db     # and restart PostgreSQL while they run

PostgreSQL: ``$STEPMACHINE_TEST_POSTGRES`` names a server, else a throwaway one
is started (``tests/harness/_postgres.py``: initdb in a temporary folder, a free
loopback port, run as the ``postgres`` system user when run as root) and
removed afterwards. The run gets a fresh database on it, dropped at the end.

The parent creates M sessions and starts K workers and one submitter, each a
process running this file (``--child``):

- a worker (``_workers_agent.worker``) loops: ``claim_next`` a session with a
  pending run, ``run_report`` it holding the lease (renewed in the background,
  fenced: a stale holder's write is refused), repeat; ``stepmachine.serve``
  is that loop. The agent is ``Approval`` + ``Tools`` + ``ModelInference``
  with a scripted model (deterministic per session), a read-only tool and two
  idempotent tools whose effects go to a side-effect table in the same
  database, deduplicated by the journal's idempotency key (see
  ``_workers_agent``). Every batch a worker's store acknowledges is recorded
  out of band (fsynced).
- the submitter walks every session's script: when the last turn is answered
  it ``submit``s the next user turn, when a call awaits approval it
  ``approve``s it, each followed by ``request_run``. It never runs the
  machine, and never hands a session out again: a worker killed in the middle
  of a run leaves an abandoned lease, which ``claim_next`` gives to another
  worker once it lapses (``--ttl``).

For ``--seconds`` the parent SIGKILLs a random worker every 0.5-2.5 s and
starts a new one in its place; then it waits for the submitter to see every
session done (at most ``--timeout`` more seconds), stops the workers (SIGTERM)
and checks the database:

- lost: user turns without their final answer (or never submitted), batches a
  worker or the submitter was told were stored that are not in the log with
  identical bytes, and idempotent tool results whose effect row is missing;
- duplicate_side_effects: effect rows beyond the first for one idempotency
  key (re-runs after kills are expected and deduplicated; a duplicate means two
  runners executed one call at once);
- invalid: sessions whose history has problems (``history_problems``) or
  whose audit log is not whole (revisions 1..n, ``load()`` equal to the
  replay of ``batches()``);
- outcome_unknown: tool results answered "outcome unknown";
- dropped_turns: a turn requested and never served that left no record: a
  session owed a run at the end with no pending-run mark, no lease and no
  ``serve_run_failed`` event at ERROR, or a run that failed and was neither
  tried again (``serve_run_retried``) nor recorded as failed for good. The
  workers print stepmachine's WARNING/ERROR events as ``{"log": ...}`` lines;
  a run recorded as failed for good is a problem too.

``--restart-db``: the run uses a throwaway server of its own (never
``$STEPMACHINE_TEST_POSTGRES``'s) and restarts it, once work began, with
``pg_ctl restart -m fast`` and then ``-m immediate`` (:data:`RESTARTS`),
while the kills go on. The submitter and the tools retry store calls that
fail on the restart, as careful clients do; the workers rely on ``serve()``.

With ``--durable dbos`` the run is handed to ``tests/harness/dbos_crash.py``
(durable turns on DBOS Transact: each machine cycle a DBOS step, a queue
partitioned by session), passing on ``--workers``, ``--sessions``, ``--turns``
and ``--seed`` as given; it prints the same last line. Without that module the
flag says so and exits 2.

Info lines first, then any problem, then the last line, exactly
``workers=K sessions=M kills=N lost=0 duplicate_side_effects=0 dropped_turns=0
invalid=0 outcome_unknown=0`` with the counts. Exit status 1 when a count is not 0 or a
process failed; 2 when no PostgreSQL server can be had (the reason is printed).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common as common  # beside this file: on sys.path as a script and in pytest
import _postgres
import _workers_agent as agent_kit
import anyio

from stepmachine import AppendMessage, Message, submit
from stepmachine._transient import is_transient
from stepmachine.extend import apply_batch, history_problems, idempotency_key
from stepmachine.operations import approve
from stepmachine.stores import PostgresStore

HERE = Path(__file__).resolve()
KILL_GAP = (0.5, 2.5)  # seconds between two kills
FIRST_KILL = (0.3, 1.0)  # seconds after the start: the first kill lands while work is going on
IDEMPOTENT_TOOLS = ("file_report", agent_kit.APPROVED_TOOL)


@dataclass
class Summary:
    """What a run found; :meth:`line` is the harness's last line."""

    workers: int
    sessions: int
    kills: int = 0
    lost: int = 0
    duplicate_side_effects: int = 0
    dropped_turns: int = 0
    invalid: int = 0
    outcome_unknown: int = 0
    info: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No count is wrong and no process failed."""
        counts = (
            self.lost,
            self.duplicate_side_effects,
            self.dropped_turns,
            self.invalid,
            self.outcome_unknown,
        )
        return not any(counts) and not self.problems

    def line(self) -> str:
        """The last line: ``workers=K sessions=M kills=N lost=.. ... outcome_unknown=..``."""
        return (
            f"workers={self.workers} sessions={self.sessions} kills={self.kills} "
            f"lost={self.lost} duplicate_side_effects={self.duplicate_side_effects} "
            f"dropped_turns={self.dropped_turns} "
            f"invalid={self.invalid} outcome_unknown={self.outcome_unknown}"
        )

    def lines(self) -> list[str]:
        """The report: info, problems, the last line."""
        info = " ".join(f"{k}={v}" for k, v in self.info.items())
        return [*([info] if info else []), *(f"PROBLEM: {p}" for p in self.problems), self.line()]


# -- the submitter ------------------------------------------------------------------


async def submitter(args: argparse.Namespace) -> None:
    """Walk every session's script to its end (see the module docstring); print events."""
    dsn = os.environ[agent_kit.DSN_VAR]
    store = await agent_kit.open_store(PostgresStore, dsn, max_size=2)
    _, gate, transfer = agent_kit.agent(agent_kit.SideEffects(dsn, "submitter"))
    acks = common.AckLog(Path(args.ack))
    counts = {"submitted": 0, "approved": 0, "store_errors": 0}
    remaining = set(agent_kit.session_ids(args.sessions))
    unrequested: set[str] = set()  # a request_run owed: the last attempt failed
    try:
        while remaining:
            for session_id in sorted(remaining):
                try:
                    if session_id in unrequested:
                        await store.request_run(session_id)
                        unrequested.discard(session_id)
                    await walk(store, session_id, args, gate, transfer, acks, counts, remaining)
                except Exception as exc:
                    if not is_transient(exc):
                        raise
                    # The database restarts: what was written is in the store (the next
                    # pass reads it); the run it needs is requested again to be sure.
                    unrequested.add(session_id)
                    counts["store_errors"] += 1
                    print(f"{session_id}: {type(exc).__name__}, again later", flush=True)
                    await anyio.sleep(args.poll)
            await anyio.sleep(args.poll)
    finally:
        acks.close()
        await store.aclose()
    print(json.dumps(counts), flush=True)


async def walk(
    store: PostgresStore,
    session_id: str,
    args: argparse.Namespace,
    gate: Any,
    transfer: Any,
    acks: common.AckLog,
    counts: dict[str, int],
    remaining: set[str],
) -> None:
    """One look at one session: approve, submit the next turn, or see it done."""
    session = await store.load(session_id)
    users = sum(1 for m in session.conversation if m.role == "user")
    pending = gate.pending(session)
    if pending:
        for item in pending:
            after = await approve(store, session_id, item.call_id, by="submitter", tool=transfer)
            acks.write({"kind": "approval", "session": session_id, "revision": after.revision})
            counts["approved"] += 1
            print(f"{session_id}: approved {item.name} {item.call_id}", flush=True)
        await store.request_run(session_id)
    elif agent_kit.answered(session) == users:
        if users == args.turns:
            remaining.discard(session_id)
            print(f"{session_id}: done ({users} turns answered)", flush=True)
            return
        turn = users + 1
        message = Message.user(
            agent_kit.user_text(session_id, turn, args.turns),
            id=f"{session_id}-user-{turn}",
        )
        after = await submit(store, session_id, [AppendMessage(message)])
        acks.write(
            {
                "kind": "user",
                "session": session_id,
                "revision": after.revision,
                "message": message.id,
            }
        )
        counts["submitted"] += 1
        await store.request_run(session_id)
        print(f"{session_id}: turn {turn} submitted", flush=True)


# -- the parent ---------------------------------------------------------------------


async def setup(dsn: str, sessions: int) -> None:
    """Create the store's schema, the side-effect tables and the sessions."""
    async with await PostgresStore.open(dsn) as store:
        await anyio.to_thread.run_sync(agent_kit.SideEffects(dsn, "parent").prepare)
        for session_id in agent_kit.session_ids(sessions):
            await store.create(session_id)


class Processes:
    """The children of a run, with their ack and output files in ``workdir``."""

    def __init__(self, workdir: Path, env: dict[str, str], options: list[str]) -> None:
        self.workdir = workdir
        self.env = env
        self.options = options
        self.generation = 0
        self.outputs: dict[int, Path] = {}  # pid -> its output file

    def start(self, role: str, *extra: str) -> subprocess.Popen[bytes]:
        """Start a child ``role`` (``worker`` or ``submitter``); its files are numbered."""
        self.generation += 1
        name = f"{role}-{self.generation}"
        command = [
            sys.executable,
            str(HERE),
            "--child",
            role,
            *self.options,
            "--ack",
            str(self.workdir / f"acks-{name}.jsonl"),
            *extra,
        ]
        output = self.workdir / f"out-{name}.txt"
        with output.open("wb") as out:
            process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.workdir
            )
        self.outputs[process.pid] = output
        return process

    def failed(self, what: str, process: subprocess.Popen[bytes]) -> str:
        """A problem line: who exited how, and the end of its output."""
        output = self.outputs.get(process.pid)
        said = tail(output) if output is not None else ""
        return f"{what} (pid {process.pid}) exited {process.returncode}: {said}"


def working(processes: Processes, first: list[subprocess.Popen[bytes]]) -> bool:
    """Whether work began: every worker started first said it is ready (or was killed),
    and the submitter acknowledged a turn."""
    for process in first:
        output = processes.outputs[process.pid]
        if process.poll() is None and '"ready"' not in output.read_text(errors="replace"):
            return False
    return any(path.stat().st_size > 0 for path in processes.workdir.glob("acks-submitter-*"))


def tail(path: Path, lines: int = 5) -> str:
    """The last lines of a child's output file."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


RESTARTS = ((0.5, "fast"), (2.5, "immediate"))
"""``--restart-db``: when (seconds after work began: every first worker ready and a turn
submitted) and how the server is restarted; a restart still under way delays the next one."""


def drive(
    options: argparse.Namespace,
    processes: Processes,
    summary: Summary,
    say: Callable[[str], None],
    restarter: _postgres.Restarter | None = None,
) -> None:
    """Run the workers and the submitter to the end, killing workers at random (and
    restarting the server on :data:`RESTARTS` with ``restarter``)."""
    rng = random.Random(options.seed)
    workers = {i: processes.start("worker", "--index", str(i)) for i in range(options.workers)}
    submitter_process = processes.start("submitter")
    start = time.monotonic()
    first = list(workers.values())
    next_kill = start + rng.uniform(*FIRST_KILL)
    deadline = start + options.seconds + options.timeout
    try:
        while submitter_process.poll() is None and time.monotonic() < deadline:
            now = time.monotonic()
            if now < start + options.seconds and now >= next_kill:
                index = rng.randrange(options.workers)
                process = workers[index]
                if process.poll() is None:
                    process.send_signal(signal.SIGKILL)
                    process.wait()
                    summary.kills += 1
                    say(f"t={now - start:5.1f}s SIGKILL worker {index} (pid {process.pid})")
                workers[index] = processes.start("worker", "--index", str(index))
                next_kill = now + rng.uniform(*KILL_GAP)
            if restarter is not None and not restarter.started and working(processes, first):
                restarter.start()
                say(f"t={now - start:5.1f}s work began; the server restarts from now on")
            for index, process in list(workers.items()):
                if process.poll() is not None:  # died by itself: a failure; replace it
                    summary.problems.append(processes.failed(f"worker {index}", process))
                    workers[index] = processes.start("worker", "--index", str(index))
            time.sleep(0.05)
        if restarter is not None:
            if not restarter.finished:
                summary.problems.append(
                    f"the run ended before every restart of the server ({len(restarter.done)} "
                    f"of {len(restarter.schedule)} made): give it more --turns or --sessions"
                )
            restarter.stop()
            summary.info["restarts"] = len(restarter.done)
            summary.problems.extend(restarter.errors)
            for mode, took in restarter.done:
                say(f"restarted the server (-m {mode}, {took:.1f} s)")
        if submitter_process.poll() is None:
            submitter_process.kill()
            submitter_process.wait()
            summary.problems.append(
                f"not every session was done after {options.seconds + options.timeout:.0f} s"
            )
        elif submitter_process.returncode != 0:
            summary.problems.append(processes.failed("the submitter", submitter_process))
        if submitter_process.returncode == 0:
            say(f"t={time.monotonic() - start:5.1f}s every session done; stopping the workers")
    finally:
        for process in [*workers.values(), submitter_process]:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for index, process in workers.items():
            try:
                code = process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                summary.problems.append(f"worker {index} did not stop on SIGTERM")
                continue
            if code not in (0, -signal.SIGTERM):
                summary.problems.append(processes.failed(f"worker {index}", process))
        with contextlib.suppress(subprocess.TimeoutExpired):
            submitter_process.wait(timeout=15)


async def check(dsn: str, workdir: Path, options: argparse.Namespace, summary: Summary) -> None:
    """Count lost, duplicate, invalid and outcome-unknown (see the module docstring)."""
    import psycopg

    paths = await anyio.to_thread.run_sync(lambda: sorted(workdir.glob("acks-*.jsonl")))
    acks = [record for path in paths for record in common.read_records(path)]
    async with await PostgresStore.open(dsn) as store:
        codec = store.codec
        digests: dict[tuple[str, int], str] = {}
        messages: set[tuple[str, str]] = set()
        effect_keys: list[str] = []
        for session_id in agent_kit.session_ids(options.sessions):
            session = await store.load(session_id)
            summary.lost += max(0, options.turns - agent_kit.answered(session))
            problems = history_problems(session)
            log = await store.batches(session_id)
            replay = await store.load_at(session_id, 0)
            for batch in log:
                replay = apply_batch(replay, batch.effects)
                digests[session_id, batch.revision] = common.digest(codec, batch)
            if [b.revision for b in log] != list(range(1, session.revision + 1)):
                problems.append("the log's revisions are not 1..n")
            if replay != session:
                problems.append("load() differs from the replayed log")
            if problems:
                summary.invalid += 1
                summary.problems.append(f"{session_id}: {problems}")
            for message in session.conversation:
                messages.add((session_id, message.id))
                for result in message.tool_results:
                    if result.content.startswith("outcome unknown"):
                        summary.outcome_unknown += 1
                effect_keys.extend(
                    idempotency_key(session_id, part.call_id, message.id)
                    for part in message.tool_calls
                    if part.name in IDEMPOTENT_TOOLS
                )
        missing = 0
        for ack in acks:
            if ack["kind"] in ("claim", "run"):
                continue
            key = (ack["session"], ack["revision"])
            stored = digests.get(key)
            if ack["kind"] == "batch":
                missing += stored != ack["digest"]
            elif ack["kind"] == "user":
                missing += stored is None or (ack["session"], ack["message"]) not in messages
            else:  # an approval
                missing += stored is None
        summary.lost += missing

    def counts() -> tuple[int, int, int, set[str]]:
        with psycopg.connect(dsn, autocommit=True) as conn:
            executions = conn.execute("SELECT count(*) FROM harness_executions").fetchone()
            rows = conn.execute("SELECT key, count(*) FROM harness_effects GROUP BY key").fetchall()
        keys = {str(key) for key, _ in rows}
        duplicates = sum(int(n) - 1 for _, n in rows)
        return int(executions[0]) if executions else 0, len(rows), duplicates, keys

    executions, distinct, duplicates, applied = await anyio.to_thread.run_sync(counts)
    summary.duplicate_side_effects = duplicates
    unapplied = [key for key in effect_keys if key not in applied]
    summary.lost += len(unapplied)
    events = await anyio.to_thread.run_sync(worker_events, workdir)
    # A run that raised is either tried again (serve_run_retried) or failed for good,
    # said at ERROR (serve_run_failed, retried False): a problem, with its record. A
    # failure said otherwise (not retried, not final) dropped its turn.
    final = [e for e in events if e.get("event") == "serve_run_failed" and e["level"] == "ERROR"]
    unsaid = [e for e in events if e.get("event") == "serve_run_failed" and e not in final]
    for event in final:
        summary.problems.append(
            f"{event.get('session_id')}: a run failed for good "
            f"({event.get('error_type')}, {event.get('attempts')} attempts)"
        )
    for event in unsaid:
        summary.problems.append(
            f"{event.get('session_id')}: a run failed ({event.get('error_type')}) and its "
            "turn was neither run again nor recorded as failed"
        )
    failed = {e.get("session_id") for e in final}
    summary.dropped_turns = len(unsaid) + await dropped(dsn, options, failed)
    summary.info.update(
        run_retries=sum(1 for e in events if e.get("event") == "serve_run_retried"),
        claim_retries=sum(1 for e in events if e.get("event") == "serve_claim_failed"),
    )
    claims = sum(1 for ack in acks if ack["kind"] == "claim")
    runs = sum(1 for ack in acks if ack["kind"] == "run")
    summary.info.update(
        executions=executions,
        effects=distinct,
        reruns=executions - distinct,
        claims=claims,
        runs=runs,
    )


def worker_events(workdir: Path) -> list[dict[str, Any]]:
    """The stepmachine events the workers printed (``{"log": {...}}`` lines)."""
    events: list[dict[str, Any]] = []
    for path in sorted(workdir.glob("out-worker-*.txt")):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith('{"log": '):
                with contextlib.suppress(ValueError):
                    events.append(json.loads(line)["log"])
    return events


async def dropped(dsn: str, options: argparse.Namespace, failed: set[Any]) -> int:
    """Turns requested and never served that left no record: a session owed a run (its
    last user turn or approval unanswered) with no pending-run mark, no lease and no
    ``serve_run_failed`` event."""
    async with await PostgresStore.open(dsn) as store:
        owed: list[str] = []
        for session_id in agent_kit.session_ids(options.sessions):
            session = await store.load(session_id)
            users = sum(1 for m in session.conversation if m.role == "user")
            if agent_kit.answered(session) < users and session_id not in failed:
                owed.append(session_id)
    if not owed:
        return 0
    import psycopg

    def waiting() -> set[str]:
        with psycopg.connect(dsn, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT session_id FROM stepmachine.sessions WHERE session_id = ANY(%s) "
                "AND (run_requested_at IS NOT NULL OR lease_owner IS NOT NULL)",
                (owed,),
            ).fetchall()
        return {str(row[0]) for row in rows}

    pending = await anyio.to_thread.run_sync(waiting)
    return sum(1 for session_id in owed if session_id not in pending)


def run(options: argparse.Namespace, say: Callable[[str], None] = print) -> Summary:
    """One run of the harness (see the module docstring); the summary."""
    summary = Summary(options.workers, options.sessions)
    with contextlib.ExitStack() as stack:
        restarter: _postgres.Restarter | None = None
        if options.restart_db:  # a server of our own: it is restarted
            own = stack.enter_context(_postgres.throwaway_server())
            restarter = _postgres.Restarter(own, RESTARTS)
            server = own.dsn
        else:
            server = stack.enter_context(_postgres.postgres_server())
        dsn = stack.enter_context(_postgres.fresh_database(server, prefix="stepmachine_workers"))
        if options.workdir is not None:
            workdir = options.workdir
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="workers-")))
        anyio.run(setup, dsn, options.sessions)
        env = {**os.environ, agent_kit.DSN_VAR: dsn}
        common_options = [
            *(["--unleased"] if options.unleased else []),
            "--sessions",
            str(options.sessions),
            "--turns",
            str(options.turns),
            "--ttl",
            str(options.ttl),
        ]
        drive(options, Processes(workdir, env, common_options), summary, say, restarter)
        anyio.run(check, dsn, workdir, options, summary)
        for path in workdir.glob("out-submitter-*.txt"):
            last = tail(path, 1)
            if last.startswith("{"):
                summary.info.update({k: int(v) for k, v in json.loads(last).items()})
    return summary


FORWARDED = ("--workers", "--sessions", "--turns", "--seed")
"""The options ``--durable`` passes on (as given) to the durable harness."""

FORWARDED_FLAGS = ("--restart-db",)
"""The flags (no value) ``--durable`` passes on."""


def durable(name: str, argv: Sequence[str]) -> int:
    """``--durable NAME``: run ``tests/harness/<NAME>_crash.py``'s ``main(argv)``; its status.

    Of this command line only :data:`FORWARDED` options and :data:`FORWARDED_FLAGS`
    are passed on, as given;
    that harness prints the same last line (its own defaults for the rest: for
    DBOS, 50 mid-turn kills). Returns 2, saying so, when the module is not there.
    """
    module_name = f"{name}_crash"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(
            f"--durable {name}: tests/harness/{module_name}.py is not here (durable turns on "
            f"{name.upper()} come from that module); run without --durable for leases alone",
            file=sys.stderr,
        )
        return 2
    forwarded: list[str] = []
    for index, arg in enumerate(argv):
        option = arg.split("=", 1)[0]
        if option in FORWARDED_FLAGS:
            forwarded.append(arg)
            continue
        if option not in FORWARDED:
            continue
        forwarded.append(arg)
        if "=" not in arg and index + 1 < len(argv):
            forwarded.append(argv[index + 1])
    return int(module.main(forwarded) or 0)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n", 1)[0])
    parser.add_argument("--workers", type=int, default=3, help="worker processes (K)")
    parser.add_argument("--sessions", type=int, default=10, help="sessions (M)")
    parser.add_argument("--turns", type=int, default=6, help="user turns per session")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds of random kills")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttl", type=float, default=3.0, help="lease seconds (renewed ttl/3)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds more to finish")
    parser.add_argument("--poll", type=float, default=0.2, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help="keep the processes' files here")
    parser.add_argument("--durable", choices=["dbos"], help="durable turns (another module)")
    parser.add_argument(
        "--restart-db",
        action="store_true",
        help="restart the PostgreSQL server (pg_ctl restart -m fast, then -m immediate) while "
        "the workers run; always a throwaway server of the harness's own",
    )
    parser.add_argument(
        "--unleased",
        action="store_true",
        help="BROKEN on purpose: workers run random sessions without leases (the harness "
        "must report it)",
    )
    parser.add_argument("--child", choices=["worker", "submitter"], help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--ack", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.workers < 1 or options.sessions < 1 or options.turns < 1:
        parser.error("--workers, --sessions and --turns must be at least 1")
    return options


def main(argv: Sequence[str] | None = None) -> int:
    """Run the harness (or a child); the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    options = parse(args)
    if options.child == "worker":
        unleased = options.sessions if options.unleased else 0
        anyio.run(
            lambda: agent_kit.worker(
                options.index,
                Path(options.ack),
                options.ttl,
                options.poll,
                unleased_sessions=unleased,
            )
        )
        return 0
    if options.child == "submitter":
        anyio.run(submitter, options)
        return 0
    if options.durable is not None:
        return durable(options.durable, args)
    try:
        summary = run(options)
    except _postgres.PostgresUnavailable as exc:
        print(f"no PostgreSQL server: {exc}", file=sys.stderr)
        return 2
    for line in summary.lines():
        print(line, flush=True)
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
