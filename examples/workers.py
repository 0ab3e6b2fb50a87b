"""Many workers, one PostgreSQL: N worker processes serve M sessions; kill one, another picks up.

    python examples/workers.py [--workers 3] [--sessions 4] [--dsn DSN] [--backend trio]

Every worker process runs the same agent and the same loop,
``stepmachine.serve``: claim a session that has a pending run (a lease with a
fencing epoch, renewed in the background), run it, release it, repeat. The
main process plays the application: it creates the sessions, submits user
turns with ``submit`` and approvals with ``approve``, and after each calls
``store.request_run`` so that some worker picks the session up. Nothing is
sent to a particular worker: the database is the queue.

Then it SIGKILLs a worker in the middle of a tool call: the tool's effect
took place, its answer has not come back, nothing of it is stored. Its lease
is no longer renewed and lapses after ``--ttl`` seconds; a lease that lapsed
without being released is work, so the next ``claim_next`` of another worker
takes the session (with a new epoch: the dead worker could not write any more
even if it woke up) and finishes the turn. The tool is idempotent: the new
worker runs the call again with the same idempotency key, and the side-effect
table (``INSERT ... ON CONFLICT DO NOTHING`` on that key) tells it the effect
took place already. Every line a worker prints starts with its name.

PostgreSQL: ``--dsn`` (or ``$STEPMACHINE_POSTGRES``) names a database to use;
without one the example starts a throwaway server of its own (``initdb`` in a
temporary folder, ``pg_ctl`` on a free loopback port; run as root, both run as
the ``postgres`` system user, since initdb refuses root) and removes it at the
end. So on a machine with PostgreSQL installed (Debian: ``apt-get install
postgresql``) and the ``postgres`` extra (``pip install 'stepmachine[postgres]'``)
it runs as written, and finishes by itself in about 15 seconds.

Model: the scripted stand-in from the testing kit (no network, no API key),
unless ``OPENAI_API_KEY``, ``ANTHROPIC_API_KEY`` or
``OPENAI_COMPATIBLE_BASE_URL`` is set (``STEPMACHINE_MODEL`` names the model),
as in ``hello_world.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.to_thread

try:
    import psycopg
except ImportError:
    raise SystemExit(
        "this example needs the postgres extra: pip install 'stepmachine[postgres]'"
    ) from None

from stepmachine import (
    AppendMessage,
    CancelToken,
    Message,
    Model,
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
    submit,
    tool,
)
from stepmachine.operations import Approval, approve
from stepmachine.providers import AnthropicModel, OpenAIChatModel, OpenAICompatibleModel
from stepmachine.stores import PostgresStore
from stepmachine.testing import FunctionModel, call, reply

DSN_VARIABLE = "STEPMACHINE_POSTGRES"
TURNS = 2
TOOL_SECONDS = 1.0  # the "external API" answers this long after the effect took place
EFFECTS = (
    "CREATE TABLE IF NOT EXISTS example_effects (key text PRIMARY KEY, session_id text NOT NULL, "
    "what text NOT NULL, worker text NOT NULL)"
)


# -- the agent: the same in every process -------------------------------------------


def user_text(session_id: str, turn: int) -> str:
    """What the user asks in turn ``turn``; sessions with an odd number also want money moved."""
    text = f"Please file report {turn} for {session_id}."
    if turn == 1 and int(session_id.rsplit("s", 1)[1]) % 2 == 1:
        text += f" And transfer {10 * turn} EUR to acct-{session_id}."
    return text


def scripted() -> FunctionModel:
    """The stand-in model: decides from the history alone, so any worker can continue."""

    def decide(request: ModelRequest) -> ModelResponse:
        last = request.messages[-1]
        if last.role == "user":
            session_id = last.text.rsplit(" for ", 1)[1].split(".")[0]
            turn = int(last.text.split("report ", 1)[1].split(" ", 1)[0])
            calls: list[tuple[str, dict[str, Any]]] = [
                ("file_report", {"title": f"report {turn} of {session_id}"})
            ]
            if "transfer" in last.text:
                calls.append(("transfer", {"to": f"acct-{session_id}", "amount_eur": 10}))
            return call(*calls, text="On it.")
        return reply("Done: " + "; ".join(r.content for r in last.tool_results))

    return FunctionModel(decide, name="scripted (no provider configured)")


def choose_model() -> Model:
    """A real provider when one is configured in the environment, else the stand-in."""
    chosen = os.environ.get("STEPMACHINE_MODEL")
    if os.environ.get("OPENAI_API_KEY"):
        return OpenAIChatModel(chosen or "gpt-4.1-mini")
    if os.environ.get("ANTHROPIC_API_KEY"):
        return AnthropicModel(chosen or "claude-haiku-4-5")
    if os.environ.get("OPENAI_COMPATIBLE_BASE_URL"):
        return OpenAICompatibleModel(chosen or "qwen3")
    return scripted()


def record_effect(dsn: str, key: str, session_id: str, what: str, worker: str) -> bool:
    """Write the effect once per idempotency key; True when this call wrote it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO example_effects VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (key) DO NOTHING RETURNING key",
            (key, session_id, what, worker),
        ).fetchone()
    return row is not None


def agent(worker: str, dsn: str) -> tuple[StateMachine[Any], Approval, Any]:
    """Approval before Tools before ModelInference; the tools write to ``example_effects``."""

    async def effect(ctx: ToolContext, what: str) -> str:
        print(f"[{worker}] {ctx.session_id}: running {what}", flush=True)
        wrote = await anyio.to_thread.run_sync(
            record_effect, dsn, ctx.idempotency_key, ctx.session_id, what, worker
        )
        if not wrote:
            print(
                f"[{worker}] {ctx.session_id}: {what} had taken effect already "
                "(same idempotency key): not repeated",
                flush=True,
            )
            return f"{what}: done (already, deduplicated)"
        print(f"[{worker}] {ctx.session_id}: {what} took effect; awaiting the answer", flush=True)
        await anyio.sleep(TOOL_SECONDS)  # the slow answer of an external API
        return f"{what}: done"

    @tool(side_effects="idempotent")
    async def file_report(title: str, ctx: ToolContext) -> str:
        """File a report."""
        return await effect(ctx, f"file_report {title!r}")

    @tool(side_effects="idempotent")
    async def transfer(to: str, amount_eur: int, ctx: ToolContext) -> str:
        """Move money (needs approval)."""
        return await effect(ctx, f"transfer {amount_eur} EUR to {to}")

    gate = Approval(["transfer"])
    steps = [gate, Tools([file_report, transfer]), ModelInference(instructions="Be brief.")]
    return StateMachine(steps), gate, transfer


# -- a worker process ---------------------------------------------------------------


async def worker_main(name: str, ttl: float) -> None:
    """Serve sessions until SIGTERM: ``stepmachine.serve`` does claim, run, release."""
    dsn = os.environ[DSN_VARIABLE]
    async with await PostgresStore.open(dsn) as store:
        machine, _, _ = agent(name, dsn)
        runtime = Runtime(store=store, model=choose_model())
        stop = CancelToken()
        async with anyio.create_task_group() as group:

            async def stop_on_sigterm() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM) as signals:
                    async for _ in signals:
                        stop.cancel("SIGTERM")
                        return

            def on_report(report: RunReport[Any]) -> None:
                session = report.session
                print(
                    f"[{name}] {session.id}: run returned {report.reason.kind} at revision "
                    f"{session.revision} ({len(report.results)} steps)",
                    flush=True,
                )

            group.start_soon(stop_on_sigterm)
            print(f"[{name}] serving (pid {os.getpid()})", flush=True)
            await run_worker(
                machine,
                runtime,
                stop=stop,
                ttl=ttl,
                poll=0.2,
                owner_prefix=f"{name}:",
                on_report=on_report,
            )
            group.cancel_scope.cancel()
    print(f"[{name}] stopped", flush=True)


# -- the application: sessions, turns, approvals, one kill ------------------------------


def answered(session: Session[Any]) -> int:
    """User turns that have their final answer (a reply without tool calls)."""
    done, waiting = 0, False
    for message in session.conversation:
        if message.role == "user":
            waiting = True
        elif message.role == "assistant" and waiting and not message.tool_calls:
            done, waiting = done + 1, False
    return done


class Workers:
    """The worker processes; their lines are printed and the tool starts queued for the killer."""

    def __init__(self, count: int, ttl: float, backend: str) -> None:
        self.processes: dict[str, subprocess.Popen[str]] = {}
        self.tool_starts: queue.Queue[tuple[str, str]] = queue.Queue()
        self.killed = False
        self.ttl = ttl
        for i in range(1, count + 1):
            name = f"w{i}"
            process = subprocess.Popen(  # noqa: S603 - runs this very script
                [sys.executable, __file__, "worker", name, "--ttl", str(ttl), "--backend", backend],
                stdout=subprocess.PIPE,
                text=True,
            )
            self.processes[name] = process
            threading.Thread(target=self._relay, args=(name, process), daemon=True).start()

    def _relay(self, name: str, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            print(line, end="", flush=True)
            if "took effect; awaiting the answer" in line:
                self.tool_starts.put((name, line.split("]", 1)[1].split(":", 1)[0].strip()))

    def kill_one_in_a_tool(self) -> None:
        """SIGKILL the first worker seen waiting for a tool's answer (once)."""
        with contextlib.suppress(queue.Empty):
            name, session_id = self.tool_starts.get_nowait()
            process = self.processes[name]
            if process.poll() is None and not self.killed:
                self.killed = True
                process.send_signal(signal.SIGKILL)
                process.wait()
                print(
                    f"[main] SIGKILL {name} (pid {process.pid}) in the middle of {session_id}'s "
                    f"tool call; its lease on {session_id} lapses within {self.ttl:.0f} s, "
                    "then another worker claims the session",
                    flush=True,
                )

    def stop(self) -> None:
        """SIGTERM every live worker and wait for it."""
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


async def application(dsn: str, workers: int, sessions: int, ttl: float, backend: str) -> None:
    """Create the sessions, start the workers, feed them turns and approvals, kill one."""
    run = os.urandom(2).hex()  # session ids of this run: <run>-s0, <run>-s1, ...
    ids = [f"{run}-s{i}" for i in range(sessions)]
    async with await PostgresStore.open(dsn) as store:
        await anyio.to_thread.run_sync(create_effects_table, dsn)
        for session_id in ids:
            await store.create(session_id)
        _, gate, transfer = agent("main", dsn)
        pool = Workers(workers, ttl, backend)
        try:
            await feed(store, gate, transfer, ids, pool)
        finally:
            pool.stop()
        print("\nevery session is done:")
        for session_id in ids:
            session = await store.load(session_id)
            print(f"  {session_id}: revision {session.revision}, {session.conversation[-1].text}")
    keys, rows = await anyio.to_thread.run_sync(count_effects, dsn, run)
    print(f"side effects: {rows} rows for {keys} idempotency keys (each call took effect once)")


async def feed(
    store: PostgresStore, gate: Approval, transfer: Any, ids: list[str], pool: Workers
) -> None:
    """The application's loop: approvals and next turns, until every session is done.

    It never says which worker runs what: ``request_run`` marks the session, and
    some worker's ``serve`` claims it.
    """
    done: set[str] = set()
    deadline = time.monotonic() + 50
    while len(done) < len(ids):
        if time.monotonic() > deadline:
            raise SystemExit("not every session finished within 50 s")
        pool.kill_one_in_a_tool()
        for session_id in ids:
            if session_id in done:
                continue
            session = await store.load(session_id)
            users = sum(1 for m in session.conversation if m.role == "user")
            if gate.pending(session):
                for item in gate.pending(session):
                    await approve(store, session_id, item.call_id, by="main", tool=transfer)
                    print(f"[main] {session_id}: approved {item.name}({item.arguments})")
                await store.request_run(session_id)
            elif answered(session) == users == TURNS:
                done.add(session_id)
            elif answered(session) == users:
                text = user_text(session_id, users + 1)
                message = Message.user(text, id=f"{session_id}-user-{users + 1}")
                await submit(store, session_id, [AppendMessage(message)])
                await store.request_run(session_id)
                print(f"[main] {session_id}: user says {text!r}", flush=True)
        await anyio.sleep(0.2)


def create_effects_table(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(EFFECTS)


def count_effects(dsn: str, run: str) -> tuple[int, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(DISTINCT key), count(*) FROM example_effects WHERE session_id LIKE %s",
            (f"{run}-%",),
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


# -- a throwaway PostgreSQL server ----------------------------------------------------


@contextlib.contextmanager
def throwaway_postgres() -> Iterator[str]:
    """Start a server in a temporary folder on a free loopback port; yield its DSN; remove it."""
    bindir = None
    if shutil.which("initdb") and shutil.which("pg_ctl"):
        bindir = Path(str(shutil.which("initdb"))).parent
    else:
        versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=_version)
        bindir = versions[-1].parent if versions else None
    if bindir is None:
        raise SystemExit(
            "no PostgreSQL server binaries (initdb, pg_ctl): install PostgreSQL "
            f"(Debian: apt-get install postgresql) or pass --dsn / set {DSN_VARIABLE}"
        )
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    folder = Path(tempfile.mkdtemp(prefix="stepmachine-example-pg-", dir="/tmp"))
    try:
        if as_postgres:
            user = pwd.getpwnam("postgres")
            os.chown(folder, user.pw_uid, user.pw_gid)
        data = folder / "data"
        _quiet([*as_postgres, str(bindir / "initdb"), "-D", str(data), "-U", "postgres",
                "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync"])  # fmt: skip
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        settings = (
            f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={folder}"
        )
        pg_ctl = [*as_postgres, str(bindir / "pg_ctl"), "-D", str(data)]
        _quiet([*pg_ctl, "-l", str(folder / "log"), "-o", settings, "-w", "start"])
        print(f"[main] started a throwaway PostgreSQL server on 127.0.0.1:{port}")
        try:
            yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
        finally:
            _quiet([*pg_ctl, "-m", "fast", "-w", "stop"])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _version(path: Path) -> tuple[int, ...]:
    return tuple(int(p) for p in path.parent.parent.name.split(".") if p.isdigit())


def _quiet(command: list[str]) -> None:
    done = subprocess.run(  # noqa: S603 - the PostgreSQL binaries found above
        command, capture_output=True, text=True, check=False, cwd="/"
    )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}{done.stderr}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--ttl", type=float, default=3.0, help="lease seconds")
    parser.add_argument("--dsn", default=os.environ.get(DSN_VARIABLE))
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    commands = parser.add_subparsers(dest="command")
    worker = commands.add_parser("worker", help=argparse.SUPPRESS)
    worker.add_argument("name")
    worker.add_argument("--ttl", type=float, default=3.0)
    worker.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr] # lines in order
    backend: Literal["asyncio", "trio"] = args.backend
    if args.command == "worker":
        anyio.run(worker_main, args.name, args.ttl, backend=backend)
        return
    with contextlib.ExitStack() as stack:
        dsn = args.dsn or stack.enter_context(throwaway_postgres())
        os.environ[DSN_VARIABLE] = dsn  # the workers inherit it
        print(f"[main] model: {choose_model().name}; {args.workers} workers")
        anyio.run(application, dsn, args.workers, args.sessions, args.ttl, backend, backend=backend)


if __name__ == "__main__":
    main()
