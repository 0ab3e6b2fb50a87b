"""The agent, side-effect table and worker loop of ``workers.py`` (not a test module).

- The script: session ``s<i>`` gets ``turns`` user turns (:func:`user_text`);
  every session with an even index asks, in its second turn (its only turn
  when there is one), for a ``transfer`` that needs an approval.
- The model (:func:`decide`, wrapped in ``FunctionModel``): decides from the
  history alone, so whichever worker runs a session next continues it. A user
  message gets one assistant message calling ``lookup`` (read-only) and
  ``file_report`` (idempotent), plus ``transfer`` (idempotent, approval) where
  the script asks; tool results get the answer ``answer <k> for s<i>``. It
  takes :data:`MODEL_SECONDS` per request, as a model would take some.
- The side-effect table (:class:`SideEffects`), in the store's PostgreSQL
  database: every run of an idempotent tool is a row of
  ``harness_executions``; the effect itself is a row of ``harness_effects``,
  written only when no row has the call's idempotency key yet. The check and the
  write are two transactions with :data:`TOOL_SECONDS` between them (a real API
  call would sit there), and there is no unique constraint, so two runners
  executing one call at once both write it: a duplicate the harness counts.
  Re-running a call after a kill is expected and deduplicated.
- :class:`AckingStore`: PostgresStore that appends one fsynced line per batch
  it acknowledged (session, revision, sha256 of the encoded batch) and one per
  claim, so the parent can check that nothing acknowledged was lost.
- :func:`worker`: one worker process: ``stepmachine.serve`` (claim a session
  that has a pending run or an abandoned lease, run it holding the lease,
  repeat) until SIGTERM; each run's reason is recorded too.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _common as common  # beside this file: on sys.path as a script and in pytest
import anyio
import anyio.to_thread

from stepmachine import (
    CancelToken,
    Codec,
    Effect,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    RunReport,
    Runtime,
    Session,
    StateMachine,
    ToolContext,
    Tools,
    run_worker,
    tool,
)
from stepmachine._transient import is_transient
from stepmachine.extend import Batch, Lease
from stepmachine.operations import Approval
from stepmachine.stores import PostgresStore
from stepmachine.testing import FunctionModel, call, reply

__all__ = [
    "DSN_VAR",
    "AckingStore",
    "SideEffects",
    "agent",
    "answered",
    "decide",
    "log_events",
    "needs_transfer",
    "open_store",
    "session_ids",
    "user_text",
    "worker",
]

DSN_VAR = "STEPMACHINE_WORKERS_DSN"
"""The environment variable the parent passes the run's database DSN in."""

OPEN_ATTEMPTS = 120
"""How many times a child tries to open its store while the server restarts (0.25 s apart)."""

TOOL_ATTEMPTS = 120
"""How many times a tool's side-effect write is tried while the server restarts (0.25 s apart),
as a real client of an API retries a request that could not be sent."""

MODEL_SECONDS = 0.1
TOOL_SECONDS = 0.3
APPROVED_TOOL = "transfer"

_COLUMNS = (
    "(id bigserial PRIMARY KEY, key text NOT NULL, tool text NOT NULL, "
    "session_id text NOT NULL, worker text NOT NULL)"
)
EFFECT_TABLES = tuple(
    f"CREATE TABLE IF NOT EXISTS {table} {_COLUMNS}"
    for table in ("harness_executions", "harness_effects")
)


def session_ids(count: int) -> list[str]:
    """The ids of ``count`` sessions."""
    return [f"s{i:03d}" for i in range(count)]


def user_text(session_id: str, turn: int, turns: int) -> str:
    """The user's message of turn ``turn`` (1-based, of ``turns``) of ``session_id``."""
    return f"{session_id} turn {turn} of {turns}: please file report {turn}"


def needs_transfer(session_id: str, turn: int, turns: int) -> bool:
    """Whether the model asks for an approved ``transfer`` in this turn."""
    return int(session_id[1:]) % 2 == 0 and turn == min(2, turns)


def answered(session: Session[Any]) -> int:
    """How many user turns of ``session`` have their final answer (a text-only reply)."""
    done = 0
    waiting = False
    for message in session.conversation:
        if message.role == "user":
            waiting = True
        elif message.role == "assistant" and waiting and not message.tool_calls:
            done += 1
            waiting = False
    return done


# -- the model --------------------------------------------------------------------


def _turn_of(messages: Sequence[Message]) -> tuple[str, int, int]:
    """(session id, turn, turns) from the latest user message of a request."""
    for message in reversed(messages):
        if message.role == "user":
            head, _, _ = message.text.partition(":")
            session_id, _, rest = head.partition(" turn ")
            turn, _, turns = rest.partition(" of ")
            return session_id, int(turn), int(turns)
    raise AssertionError("a request without a user message")


async def decide(request: ModelRequest) -> ModelResponse:
    """The scripted model (see the module docstring); the same answer for the same history."""
    await anyio.sleep(MODEL_SECONDS)
    session_id, turn, turns = _turn_of(request.messages)
    last = request.messages[-1]
    if last.role == "user":
        calls: list[tuple[str, dict[str, Any]]] = [
            ("lookup", {"topic": f"{session_id}-{turn}"}),
            ("file_report", {"title": f"report {turn} of {session_id}"}),
        ]
        if needs_transfer(session_id, turn, turns):
            calls.append((APPROVED_TOOL, {"to": f"acct-{session_id}", "amount": 10 * turn}))
        return call(*calls, text=f"Working on turn {turn}.")
    results = "; ".join(r.content for r in last.tool_results)
    return reply(f"answer {turn} for {session_id}: {results}")


# -- the side-effect table ------------------------------------------------------------


class SideEffects:
    """Idempotent side effects in the table ``harness_effects`` (see the module docstring)."""

    def __init__(self, dsn: str, worker: str) -> None:
        self._dsn = dsn
        self._worker = worker

    def prepare(self) -> None:
        """Create the tables (once, by the parent)."""
        import psycopg

        with psycopg.connect(self._dsn, autocommit=True) as conn:
            for statement in EFFECT_TABLES:
                conn.execute(statement)

    def _apply(self, key: str, name: str, session_id: str) -> str:
        import psycopg

        with psycopg.connect(self._dsn, autocommit=True) as conn:
            row = (key, name, session_id, self._worker)
            with conn.transaction():
                conn.execute(
                    "INSERT INTO harness_executions (key, tool, session_id, worker) "
                    "VALUES (%s, %s, %s, %s)",
                    row,
                )
                seen = conn.execute(
                    "SELECT 1 FROM harness_effects WHERE key = %s LIMIT 1", (key,)
                ).fetchone()
            if seen is not None:
                return "already done"
            time.sleep(TOOL_SECONDS)  # the external call
            conn.execute(
                "INSERT INTO harness_effects (key, tool, session_id, worker) "
                "VALUES (%s, %s, %s, %s)",
                row,
            )
        return "done"

    async def apply(self, key: str, name: str, session_id: str) -> str:
        """Run the effect keyed ``key`` unless it was run; ``"done"`` or ``"already done"``.

        A connection error (the server restarting) tries the whole effect again: its
        check finds the row if the failed attempt wrote it.
        """
        return await _retrying(lambda: anyio.to_thread.run_sync(self._apply, key, name, session_id))

    def _read(self, session_id: str) -> int:
        import psycopg

        with psycopg.connect(self._dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM harness_effects WHERE session_id = %s", (session_id,)
            ).fetchone()
        return int(row[0]) if row is not None else 0

    async def read(self, session_id: str) -> int:
        """Read-only: how many effect rows the session has."""
        return await _retrying(lambda: anyio.to_thread.run_sync(self._read, session_id))


async def _retrying(work: Any, attempts: int = TOOL_ATTEMPTS) -> Any:
    """``await work()``, again 0.25 s later while it raises a transient error."""
    for attempt in range(1, attempts + 1):
        try:
            return await work()
        except Exception as exc:
            if not is_transient(exc) or attempt == attempts:
                raise
            await anyio.sleep(0.25)
    raise AssertionError("unreachable")


async def open_store(cls: type[PostgresStore], dsn: str, **options: Any) -> PostgresStore:
    """``cls.open(dsn, **options)``, tried again while the server restarts."""
    return await _retrying(lambda: cls.open(dsn, **options), OPEN_ATTEMPTS)  # type: ignore[no-any-return]


class _JsonEvents(logging.Handler):
    """Prints each stepmachine event as one line ``{"log": {...}}`` (the harness reads them)."""

    def emit(self, record: logging.LogRecord) -> None:
        fields = record.msg if isinstance(record.msg, dict) else {"event": record.getMessage()}
        line = json.dumps({"log": {**fields, "level": record.levelname}}, default=str)
        print(line, file=sys.stdout, flush=True)


def log_events() -> None:
    """Send stepmachine's WARNING and ERROR events to stdout as JSON lines."""
    logger = logging.getLogger("stepmachine")
    logger.setLevel(logging.WARNING)
    logger.addHandler(_JsonEvents())


def agent(effects: SideEffects) -> tuple[StateMachine[Any], Approval, Any]:
    """The step list (the same in every process), its approval gate and the approved tool."""

    @tool(side_effects="pure")
    async def lookup(topic: str, ctx: ToolContext) -> str:
        """Look a topic up (read-only)."""
        await anyio.sleep(TOOL_SECONDS)
        count = await effects.read(ctx.session_id)
        return f"facts about {topic} ({count} effects so far)"

    @tool(side_effects="idempotent")
    async def file_report(title: str, ctx: ToolContext) -> str:
        """File a report (idempotent: deduplicated by the call's idempotency key)."""
        outcome = await effects.apply(ctx.idempotency_key, "file_report", ctx.session_id)
        return f"{title}: {outcome}"

    @tool(side_effects="idempotent")
    async def transfer(to: str, amount: int, ctx: ToolContext) -> str:
        """Transfer money (needs approval; idempotent)."""
        outcome = await effects.apply(ctx.idempotency_key, APPROVED_TOOL, ctx.session_id)
        return f"transfer of {amount} to {to}: {outcome}"

    gate = Approval([APPROVED_TOOL])
    steps = [gate, Tools([lookup, file_report, transfer]), ModelInference()]
    return StateMachine(steps), gate, transfer


# -- the worker -------------------------------------------------------------------------


class AckingStore(PostgresStore):
    """PostgresStore that records every acknowledged batch and every claim (fsynced)."""

    acks: common.AckLog | None = None
    worker: str = ""

    async def apply(self, batch: Batch[Effect], *, lease: Lease | None = None) -> Session[Any]:
        session = await super().apply(batch, lease=lease)
        if self.acks is not None:
            self.acks.write(
                {
                    "kind": "batch",
                    "session": batch.session_id,
                    "revision": batch.revision,
                    "step": batch.step,
                    "digest": common.digest(self.codec, batch),
                    "worker": self.worker,
                }
            )
        return session

    async def claim_next(self, owner: str, ttl: float) -> Lease | None:
        lease = await super().claim_next(owner, ttl)
        if lease is not None and self.acks is not None:
            self.acks.write(
                {
                    "kind": "claim",
                    "session": lease.session_id,
                    "epoch": lease.epoch,
                    "worker": self.worker,
                }
            )
        return lease


async def _unleased(
    machine: StateMachine[Any], runtime: Runtime, stop: CancelToken, sessions: int, poll: float
) -> None:
    """BROKEN on purpose (``--unleased``): run random sessions without a lease, at once."""
    ids = session_ids(sessions)
    rng = random.Random(os.getpid())
    while not stop.cancelled:
        await machine.run_report(runtime, rng.choice(ids), lease=None)
        await anyio.sleep(poll * rng.random())


async def worker(
    index: int, log: Path, ttl: float, poll: float, *, unleased_sessions: int = 0
) -> None:
    """One worker process: serve sessions from the run's database until SIGTERM.

    With ``unleased_sessions`` (the harness's ``--unleased``) it runs sessions
    without leases instead, several workers on one session at once: the harness
    must then report duplicates or invalid histories.
    """
    dsn = os.environ[DSN_VAR]
    name = f"worker{index}"
    log_events()
    store = await open_store(AckingStore, dsn, codec=Codec(), max_size=3)
    assert isinstance(store, AckingStore)  # open() builds cls
    store.acks = common.AckLog(log)
    store.worker = f"{name}/{os.getpid()}"
    machine, _, _ = agent(SideEffects(dsn, store.worker))
    runtime = Runtime(store=store, model=FunctionModel(decide, name="scripted"))
    stop = CancelToken()
    try:
        async with anyio.create_task_group() as group:

            async def on_sigterm() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM) as signals:
                    async for _ in signals:
                        stop.cancel("SIGTERM")
                        return

            group.start_soon(on_sigterm)
            print(json.dumps({"ready": name}), flush=True)
            if unleased_sessions:
                await _unleased(machine, runtime, stop, unleased_sessions, poll)
            else:

                def on_report(report: RunReport[Any]) -> None:
                    assert store.acks is not None
                    record = {"kind": "run", "reason": report.reason.kind, "worker": store.worker}
                    store.acks.write({**record, "session": report.session.id})

                await run_worker(
                    machine,
                    runtime,
                    stop=stop,
                    ttl=ttl,
                    poll=poll,
                    owner_prefix=f"{name}:",
                    on_report=on_report,
                )
            group.cancel_scope.cancel()
    finally:
        store.acks.close()
        await store.aclose()
