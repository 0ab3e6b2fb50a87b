"""Two processes run one session at once: the lease keeps them apart (invariant 11).

    python tests/harness/two_runners.py [--store sqlite|file|postgres] [--rounds N]

Each round creates a session whose model asks for one call of ``charge``, a
NOT idempotent tool that appends a line to a side-effect file and takes a
while. Process A starts ``run()``; once the tool is running, process B starts
``run()`` on the same session. Without a lease, B reads A's in-flight intent as
a crash and answers the call "outcome unknown" while A's tool is still
charging. With the lease (the machine's default policy, ``wait``), B waits for
A to release the session, then finds the call answered and the turn done.

The parent checks, per round: the tool ran once (one line), no tool result is
"outcome unknown", exactly one result per call (``history_problems`` is
empty), the turn completed, and both processes exited cleanly.

Last line: ``rounds=<n> runners=2 tool_runs=<n> outcome_unknown=<n> invalid=<n>``;
exit status 1 if any round failed (``--no-lease`` shows the failure it prevents).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common as common  # beside this file: on sys.path as a script and in pytest
import anyio

from stepmachine import (
    Codec,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    StateMachine,
    Tools,
    tool,
)
from stepmachine.extend import OUTCOME_UNKNOWN, history_problems
from stepmachine.testing import FunctionModel, call, reply

HERE = Path(__file__).resolve()
TOOL_SECONDS = 1.0


def answer(request: ModelRequest) -> ModelResponse:
    """Call ``charge`` once, then say done (the same answer in any process)."""
    last = request.messages[-1]
    if last.role == "user":
        return call(("charge", {"amount": 5}))
    return reply("charged")


def machine_for(folder: Path, lease: bool) -> StateMachine[Any]:
    @tool
    def charge(amount: int) -> str:
        """Charge the card: not idempotent."""
        (folder / "started").touch()
        # Charge until runner B has started (a cold start under load can take longer
        # than any fixed sleep), then a while more: B's run meets the call in flight.
        deadline = time.monotonic() + 60
        while not (folder / "b_ready").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(TOOL_SECONDS)
        with (folder / "charges.txt").open("a") as out:
            out.write(f"{amount}\n")
            out.flush()
            os.fsync(out.fileno())
        return f"charged {amount}"

    kwargs: dict[str, Any] = {} if lease else {"lease": None}
    return StateMachine([Tools([charge]), ModelInference()], **kwargs)


async def child(spec: str, folder: Path, lease: bool) -> None:
    store = await common.open_store(spec, folder, Codec())
    if (folder / "started").exists():  # runner B: ready to run, A's tool may go on
        (folder / "b_ready").touch()
    try:
        await machine_for(folder, lease).run(Runtime(store=store, model=FunctionModel(answer)), "s")
    finally:
        await store.aclose()


async def create(spec: str, folder: Path) -> None:
    store = await common.open_store(spec, folder, Codec())
    try:
        await store.create("s", conversation=[Message.user("pay 5", id="u1")])
    finally:
        await store.aclose()


async def inspect(spec: str, folder: Path) -> tuple[list[str], list[str], list[str]]:
    store = await common.open_store(spec, folder, Codec())
    try:
        session = await store.load("s")
    finally:
        await store.aclose()
    results = [
        str(part.content)
        for message in session.conversation
        for part in message.parts
        if type(part).__name__ == "ToolResultPart"
    ]
    texts = [m.text for m in session.conversation if m.role == "assistant" and m.text]
    return results, texts, [str(p) for p in history_problems(session.conversation)]


def spawn(spec: str, folder: Path, lease: bool) -> subprocess.Popen[str]:
    argv = [sys.executable, str(HERE), "--child", str(folder), "--store", spec]
    if not lease:
        argv.append("--no-lease")
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def one_round(spec: str, folder: Path, lease: bool) -> dict[str, int]:
    anyio.run(create, spec, folder)
    first = spawn(spec, folder, lease)
    deadline = time.monotonic() + 60
    while not (folder / "started").exists():
        if first.poll() is not None or time.monotonic() > deadline:
            out, err = first.communicate()
            raise SystemExit(f"runner A ended before its tool started:\n{out}\n{err}")
        time.sleep(0.01)
    second = spawn(spec, folder, lease)
    failed = 0
    for proc in (first, second):
        out, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            print(f"a runner exited {proc.returncode}:\n{out}\n{err}", file=sys.stderr)
            failed += 1
    results, texts, problems = anyio.run(inspect, spec, folder)
    runs = len((folder / "charges.txt").read_text().splitlines())
    unknown = sum(OUTCOME_UNKNOWN in text for text in results)
    invalid = failed + len(problems) + (texts[-1:] != ["charged"])
    return {"tool_runs": runs, "outcome_unknown": unknown, "invalid": invalid}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="sqlite")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-lease", action="store_true", help="run without leases (the defect)")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        anyio.run(child, args.store, args.child, not args.no_lease)
        return 0
    totals = {"tool_runs": 0, "outcome_unknown": 0, "invalid": 0}
    bad_rounds = 0
    with common.store_server(args.store), tempfile.TemporaryDirectory() as scratch:
        for index in range(args.rounds):
            folder = Path(scratch) / f"round-{index}"
            folder.mkdir()
            counts = one_round(args.store, folder, not args.no_lease)
            for key, value in counts.items():
                totals[key] += value
            bad_rounds += counts["tool_runs"] != 1 or counts["outcome_unknown"] or counts["invalid"]
    print(
        f"rounds={args.rounds} runners=2 tool_runs={totals['tool_runs']} "
        f"outcome_unknown={totals['outcome_unknown']} invalid={totals['invalid']}"
    )
    return 1 if bad_rounds else 0


if __name__ == "__main__":
    sys.exit(main())
