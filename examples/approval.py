"""Approval across processes: yield for a human decision, exit, decide later, resume.

    python examples/approval.py demo                       (both steps, as two real processes)
    python examples/approval.py start --db PATH            (run until the approval; exits)
    python examples/approval.py approve --db PATH --session ID [--by NAME] [--amount N]
    python examples/approval.py deny --db PATH --session ID --message TEXT [--by NAME]
    python examples/approval.py resume --db PATH --session ID   (after a decision made elsewhere,
                                                                 e.g. with `stepmachine approve`)

The agent may pay people with ``send_payment``, which needs approval. ``start``
runs until the model asks to pay, prints the pending call and exits: the run
yielded with reason ``awaiting_approval`` and everything it needs is in the
SQLite file. ``approve`` (or ``deny``), in another process, records the decision
with :func:`approve` / :func:`deny` (validated, persisted as effects, in the
audit log) and calls ``run()`` again, which continues to the final answer.

The model is a stand-in (``FunctionModel``) that decides from the history
alone, so a second process continues exactly where the first stopped -- no
network, no API key. Step order: ``Approval`` before ``Tools`` (stop before
anything of the batch runs) and before ``ModelInference``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import anyio

from stepmachine import (
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    StateMachine,
    Tools,
    tool,
)
from stepmachine.operations import Approval, approve, deny
from stepmachine.stores import SQLiteStore
from stepmachine.testing import FunctionModel, call, reply


@tool(thread=False)
def send_payment(to: str, amount_eur: int) -> str:
    """Send money to someone (needs approval)."""
    print(f"    PAYMENT SENT: {amount_eur} EUR to {to}")
    return f"paid {amount_eur} EUR to {to}"


def model(request: ModelRequest) -> ModelResponse:
    """The stand-in model: asks to pay, then reports what happened. Stateless."""
    last = request.messages[-1]
    if last.role == "user":
        return call(("send_payment", {"to": "Alice", "amount_eur": 120}), text="I'll pay Alice.")
    (result,) = last.tool_results
    if result.is_error:
        return reply(f"I did not pay Alice. {result.content}")
    return reply(f"Done: {result.content}.")


def agent() -> tuple[StateMachine[Any], Approval]:
    """The step list: the same in every process."""
    gate = Approval(["send_payment"])
    steps = [gate, Tools([send_payment]), ModelInference(instructions="Pay invoices.")]
    return StateMachine(steps), gate


def runtime(store: SQLiteStore) -> Runtime:
    return Runtime(store=store, model=FunctionModel(model, name="stand-in"))


async def start(db: Path, session_id: str) -> None:
    async with await SQLiteStore.open(db) as store:
        await store.create(
            session_id,
            conversation=[Message.user("Please pay Alice's invoice (120 EUR).", id="u1")],
        )
        machine, _ = agent()
        report = await machine.run_report(runtime(store), session_id)
        print(f"session: {session_id}")
        print(f"run yielded: {report.reason.kind} -- {report.reason.message}")
        for item in report.reason.data.get("calls", []):
            print(f"  pending: {item['call_id']} {item['name']}({item['arguments']})")
        print(f"next: python examples/approval.py approve --db {db} --session {session_id}")


async def decide(
    db: Path, session_id: str, *, by: str, amount: int | None, denial: str | None
) -> None:
    async with await SQLiteStore.open(db) as store:
        machine, gate = agent()
        for item in gate.pending(await store.load(session_id)):
            if denial is not None:
                await deny(store, session_id, item.call_id, by=by, message=denial)
                print(f"denied by {by}: {item.call_id} {item.name}({item.arguments})")
                continue
            edited = None
            if amount is not None:
                edited = {**item.arguments, "amount_eur": amount}
            await approve(
                store,
                session_id,
                item.call_id,
                by=by,
                reason="invoice checked",
                edited_arguments=edited,
                tool=send_payment,
            )
            print(f"approved by {by}: {item.call_id} {item.name}({edited or item.arguments})")
        print("resuming the run:")
        report = await machine.run_report(runtime(store), session_id)
        print(f"run returned: {report.reason.kind}")
        print(f"final answer: {report.session.conversation[-1].text}")


async def resume(db: Path, session_id: str) -> None:
    """Run again: after a decision recorded by another process (``stepmachine approve``)."""
    async with await SQLiteStore.open(db) as store:
        machine, _ = agent()
        report = await machine.run_report(runtime(store), session_id)
        print(f"run returned: {report.reason.kind}")
        print(f"final answer: {report.session.conversation[-1].text}")


def demo() -> None:
    """Both steps as two separate processes sharing one SQLite file."""
    here = Path(__file__).resolve()
    with tempfile.TemporaryDirectory() as folder:
        db = str(Path(folder) / "approval.sqlite3")
        first = subprocess.run(  # noqa: S603 - runs this very script
            [sys.executable, str(here), "start", "--db", db],
            capture_output=True,
            text=True,
            check=True,
        )
        print(f"$ approval.py start  (process 1)\n{first.stdout}")
        session_id = next(
            line.split(": ", 1)[1]
            for line in first.stdout.splitlines()
            if line.startswith("session: ")
        )
        second = subprocess.run(  # noqa: S603 - runs this very script
            [sys.executable, str(here), "approve", "--db", db, "--session", session_id],
            capture_output=True,
            text=True,
            check=True,
        )
        print(f"$ approval.py approve  (process 2)\n{second.stdout.rstrip()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="run start and approve as two processes")
    start_cmd = commands.add_parser("start", help="run until the approval, then exit")
    start_cmd.add_argument("--db", type=Path, required=True)
    start_cmd.add_argument("--session", default=f"pay-{time.time_ns()}")
    for name in ("approve", "deny"):
        sub = commands.add_parser(name, help=f"{name} the pending calls and resume")
        sub.add_argument("--db", type=Path, required=True)
        sub.add_argument("--session", required=True)
        sub.add_argument("--by", default="operator")
        if name == "approve":
            sub.add_argument("--amount", type=int, help="approve with this amount instead")
        else:
            sub.add_argument("--message", required=True, help="what the model is told")
    resume_cmd = commands.add_parser("resume", help="resume the run after a decision")
    resume_cmd.add_argument("--db", type=Path, required=True)
    resume_cmd.add_argument("--session", required=True)
    args = parser.parse_args()
    backend: Literal["asyncio", "trio"] = args.backend
    if args.command == "demo":
        demo()
    elif args.command == "start":
        anyio.run(start, args.db, args.session, backend=backend)
    elif args.command == "resume":
        anyio.run(resume, args.db, args.session, backend=backend)
    else:
        amount = getattr(args, "amount", None)
        denial = getattr(args, "message", None)
        anyio.run(
            lambda: decide(args.db, args.session, by=args.by, amount=amount, denial=denial),
            backend=backend,
        )


if __name__ == "__main__":
    main()
