"""Crash test for the tool journal (invariant 6: at most once where it matters).

    python tests/harness/tool_crash.py [--store sqlite|file] [--rounds N] [--idempotent | --pure]

A child process runs an agent whose only tool, ``append_line``, is NOT
idempotent: it appends a line to a side-effect file. The child is killed with
SIGKILL, by the tool itself, at two moments:

* ``after_tool``: the line was appended, the result was not yet stored;
* ``before_tool``: the intent was stored, the line was not yet appended.

(Pure and idempotent tools get no intent: at ``before_tool`` only the model's
call was stored.)

Then a fresh child resumes the session with ``run()``. The parent checks that
the side-effect file holds every line at most once, that the history explains
what happened (the crashed call is answered "outcome unknown"), that the
history is provider-valid, and that the conversation completed. An
idempotent variant (``--idempotent``) checks the other branch: the call is
re-run with the same idempotency key, which the tool uses to deduplicate. A
pure variant (``--pure``) checks that a pure tool killed at either moment is
simply run again: it writes no side effect (its runs are only counted, in
``runs.txt``), each call ends with exactly one result, and the tool ran twice
in the round it was killed after running (``reruns``).

Last line: ``kills=<n> duplicate_side_effects=<n>``; exit status 1 if any
line was duplicated or any check failed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import anyio

from stepmachine import (
    AppendMessage,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    SideEffects,
    StateMachine,
    Store,
    ToolContext,
    Tools,
    submit,
    tool,
)
from stepmachine.extend import OUTCOME_UNKNOWN, history_problems
from stepmachine.stores import FileStore, SQLiteStore
from stepmachine.testing import FunctionModel, call, reply

SESSION = "tool-crash"
ROUNDS_ENV = "TOOL_CRASH_KILL"  # "<round>:<moment>" -- kill in that round at that moment


async def open_store(kind: str, where: Path) -> Store:
    if kind == "sqlite":
        return await SQLiteStore.open(where / "store.sqlite3")
    return await FileStore.open(where / "store")


def decide(rounds: int) -> Any:
    """A stateless model: one append per user turn, then an answer."""

    def answer(request: ModelRequest) -> ModelResponse:
        last = request.messages[-1]
        users = sum(1 for m in request.messages if m.role == "user")
        if last.role == "user":
            return call(("append_line", {"line": f"round-{users}"}))
        return reply(f"round {users} finished")

    return answer


def make_tool(side_effect_file: Path, *, idempotent: bool, pure: bool = False) -> Any:
    kill = os.environ.get(ROUNDS_ENV, "")

    def append_line(line: str, ctx: ToolContext) -> str:
        """Append a line to the side-effect file."""
        if kill == f"{line}:before_tool":
            os.kill(os.getpid(), signal.SIGKILL)
        if pure:  # no side effect: only count the run, then crash where asked
            with (side_effect_file.parent / "runs.txt").open("a") as handle:
                handle.write(f"{line}\n")
            if kill == f"{line}:after_tool":
                os.kill(os.getpid(), signal.SIGKILL)
            return f"{line} computed"
        if idempotent and side_effect_file.exists():
            done = side_effect_file.read_text().splitlines()
            if any(entry.endswith(ctx.idempotency_key) for entry in done):
                return f"{line} already written"
        with side_effect_file.open("a") as handle:
            handle.write(f"{line} {ctx.idempotency_key}\n")
            handle.flush()
            os.fsync(handle.fileno())
        if kill == f"{line}:after_tool":
            os.kill(os.getpid(), signal.SIGKILL)
        return f"{line} written"

    side_effects: SideEffects = "pure" if pure else "idempotent" if idempotent else "non_idempotent"
    return tool(side_effects=side_effects, thread=False)(append_line)


async def child(kind: str, where: Path, rounds: int, idempotent: bool, pure: bool) -> None:
    """Run (or resume) the agent through ``rounds`` user turns."""
    store = await open_store(kind, where)
    try:
        if SESSION not in await store.list_sessions():
            await store.create(SESSION)
        append_line = make_tool(where / "side_effects.txt", idempotent=idempotent, pure=pure)
        machine = StateMachine([Tools([append_line]), ModelInference()])
        runtime = Runtime(store=store, model=FunctionModel(decide(rounds)))
        for round_number in range(1, rounds + 1):
            session = await store.load(SESSION)
            if sum(1 for m in session.conversation if m.role == "user") < round_number:
                text = f"please do round {round_number}"
                user = Message.user(text, id=f"u{round_number}")
                await submit(store, SESSION, [AppendMessage(user)])
            await machine.run(runtime, SESSION)  # resumes a round a crash interrupted
    finally:
        await store.aclose()


def run_child(
    kind: str, where: Path, rounds: int, *, idempotent: bool, pure: bool, kill: str
) -> int:
    env = {**os.environ, ROUNDS_ENV: kill}
    command = [
        sys.executable,
        __file__,
        "--child",
        "--store",
        kind,
        "--dir",
        str(where),
        "--rounds",
        str(rounds),
    ]
    if idempotent:
        command.append("--idempotent")
    if pure:
        command.append("--pure")
    return subprocess.run(command, env=env, check=False, timeout=120).returncode


async def inspect(kind: str, where: Path, rounds: int) -> dict[str, Any]:
    store = await open_store(kind, where)
    try:
        session = await store.load(SESSION)
    finally:
        await store.aclose()
    lines = (
        (where / "side_effects.txt").read_text().splitlines()
        if (where / "side_effects.txt").exists()
        else []
    )
    counts = Counter(line.split(" ")[0] for line in lines)
    runs_file = where / "runs.txt"
    runs = Counter(runs_file.read_text().splitlines() if runs_file.exists() else [])
    results = [r for m in session.conversation for r in m.tool_results]
    calls = [c.call_id for m in session.conversation for c in m.tool_calls]
    per_call = Counter(r.call_id for r in results)
    return {
        "duplicates": sum(n - 1 for n in counts.values() if n > 1),
        "one_result_each": sorted(per_call) == sorted(calls) and set(per_call.values()) <= {1},
        "runs": dict(runs),
        "unknown": sum(1 for r in results if r.content == OUTCOME_UNKNOWN),
        "problems": history_problems(session.conversation),
        "finished": session.conversation[-1].text == f"round {rounds} finished",
        "lines": dict(counts),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", choices=["sqlite", "file"], default="sqlite")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idempotent", action="store_true")
    parser.add_argument("--pure", action="store_true", help="the tool is declared pure")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--dir", type=Path)
    args = parser.parse_args()
    if args.child:
        anyio.run(child, args.store, args.dir, args.rounds, args.idempotent, args.pure)
        return 0

    kills = duplicates = failures = reruns = 0
    for round_number in range(1, args.rounds + 1):
        for moment in ("before_tool", "after_tool"):
            with tempfile.TemporaryDirectory() as tmp:
                where = Path(tmp)
                kill = f"round-{round_number}:{moment}"
                code = run_child(
                    args.store,
                    where,
                    args.rounds,
                    idempotent=args.idempotent,
                    pure=args.pure,
                    kill=kill,
                )
                killed = code == -signal.SIGKILL
                kills += killed
                resumed = run_child(
                    args.store,
                    where,
                    args.rounds,
                    idempotent=args.idempotent,
                    pure=args.pure,
                    kill="",
                )
                try:
                    report = anyio.run(inspect, args.store, where, args.rounds)
                except Exception as exc:  # report and count, keep sweeping
                    report = {
                        "duplicates": 0,
                        "unknown": -1,
                        "problems": [repr(exc)],
                        "finished": False,
                        "lines": {},
                        "one_result_each": False,
                        "runs": {},
                    }
                duplicates += report["duplicates"]
                expected_unknown = 0 if args.idempotent or args.pure else 1
                rerun = report["runs"].get(f"round-{round_number}", 0) == 2
                reruns += rerun
                ok = (
                    killed
                    and resumed == 0
                    and report["duplicates"] == 0
                    and report["unknown"] == expected_unknown
                    and report["one_result_each"]
                    and not report["problems"]
                    and report["finished"]
                    # a pure tool killed after running is simply run again
                    and (not args.pure or rerun == (moment == "after_tool"))
                    and (not args.pure or not report["lines"])
                )
                failures += not ok
                print(
                    f"{args.store} {kill}: killed={killed} resumed_exit={resumed} "
                    f"lines={report['lines']} runs={report['runs']} "
                    f"outcome_unknown={report['unknown']} "
                    f"one_result_each={report['one_result_each']} "
                    f"problems={len(report['problems'])} finished={report['finished']} "
                    f"{'ok' if ok else 'FAILED'}",
                    flush=True,
                )
    if args.pure:
        print(f"reruns={reruns}")
    print(f"kills={kills} duplicate_side_effects={duplicates}")
    return 1 if failures or duplicates else 0


if __name__ == "__main__":
    sys.exit(main())
