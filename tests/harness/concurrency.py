"""Concurrency harness: several processes apply to ONE session through a durable store.

Usage::

    python tests/harness/concurrency.py --store sqlite
    python tests/harness/concurrency.py --store file --writers 8 --batches-per-writer 50
    python tests/harness/concurrency.py --store postgres   # $STEPMACHINE_TEST_POSTGRES or its own

The parent creates the session, then starts ``--writers`` child processes (this
file, run with ``--child writer``), each with its own store object on the same
database file or folder. Every child opens its store, says ``ready`` and waits
on its stdin; once all are ready the parent releases them together. Each child
then applies ``--batches-per-writer`` batches: load, build
``[AppendMessage(<unique id>)]`` (every other batch with an ``Annotate`` of that
message too), ``apply`` with the revision it read, and on ``ConflictError``
reload and retry. After ``apply`` returns it appends the message id, the
revision and the sha256 of the encoded batch to its own ack file (flush +
fsync).

The parent then checks invariants 2 and 3 on the final log: every acknowledged
batch is in it exactly once, at the revision it was acknowledged with and with
identical bytes (two writers acknowledged at the same revision would be a lost
update); revisions are 1..n without gaps; ``load()`` equals ``load_at(n)`` and
the replay of the log; every message of the log is in the conversation once.
A writer that fails (an exception other than a conflict, including an
``EffectError`` from re-applying a batch that had in fact been written when
``apply`` raised) is reported and fails the run.

With ``--kill-writers K``, K writers are also SIGKILLed at random moments (a
few milliseconds after a random number of their acknowledged batches): the
others must still finish, nothing acknowledged may be lost, and a killed
writer may leave at most its one in-flight batch stored (whole) without an
acknowledgement.

The last line is exactly ``writers=<n> batches=<acknowledged> lost=<n>``; the
exit status is 1 when anything was lost or any writer failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common as common  # beside this file: on sys.path as a script and in pytest
import anyio

from stepmachine import Annotate, AppendMessage, Codec, ConflictError, Effect, Message, Session
from stepmachine.extend import Batch, apply_batch

HERE = Path(__file__).resolve().parent
SESSION_ID = "concurrency-harness"


# -- the writer (runs in a child) ---------------------------------------------------------


def effects_for(writer: int, index: int) -> list[Effect]:
    """The batch writer ``writer`` applies as its ``index``-th: a message, maybe a note."""
    message_id = f"w{writer}-{index}"
    effects: list[Effect] = [
        AppendMessage(Message.user(f"writer {writer} batch {index}", id=message_id))
    ]
    if index % 2:
        effects.append(
            Annotate(
                message_id=message_id,
                namespace="harness",
                values={"writer": writer, "index": index},
            )
        )
    return effects


async def writer(args: argparse.Namespace) -> None:
    """The child: apply ``args.batches`` batches, retrying on conflicts, acking each."""
    codec: Codec[Any] = Codec()
    log = common.AckLog(Path(args.ack))
    store = await common.open_store(args.store, Path(args.dir), codec)
    conflicts = 0
    errors: list[str] = []

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    try:
        print("ready", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)
        for index in range(args.batches):
            if index == args.die_after:
                threading.Timer(args.die_delay, die).start()
            effects = effects_for(args.writer, index)
            while True:
                session: Session[Any] = await store.load(SESSION_ID)
                batch: Batch[Effect] = Batch(
                    session_id=SESSION_ID,
                    revision=session.revision + 1,
                    step=f"writer-{args.writer}",
                    cycle=index,
                    timestamp=time.time(),
                    effects=tuple(effects),
                )
                try:
                    await store.apply(batch)
                except ConflictError:
                    conflicts += 1
                    continue
                break
            log.write(
                {
                    "id": f"w{args.writer}-{index}",
                    "rev": batch.revision,
                    "sha": common.digest(codec, batch),
                    "writer": args.writer,
                }
            )
        if args.die_after >= 0:
            die()  # the timer has not fired yet: die now, before any report
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        await store.aclose()
        log.close()
    print(json.dumps({"conflicts": conflicts, "errors": errors}), flush=True)


# -- the parent -------------------------------------------------------------------------


@dataclass
class Summary:
    """The outcome of a harness run."""

    writers: int
    batches: int = 0
    lost: int = 0
    conflicts: int = 0
    stored: int = 0
    killed: int = 0
    problems: list[str] = field(default_factory=list)
    failed_writers: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The report: counts, each failure and problem, then the summary line."""
        return [
            f"stored={self.stored} conflicts_retried={self.conflicts} killed={self.killed}",
            *(f"FAILED {failure}" for failure in self.failed_writers),
            *(f"PROBLEM {problem}" for problem in self.problems),
            self.last_line(),
        ]

    def last_line(self) -> str:
        return f"writers={self.writers} batches={self.batches} lost={self.lost}"

    @property
    def ok(self) -> bool:
        return self.lost == 0 and not self.problems and not self.failed_writers


async def create_session(store_spec: str, folder: Path) -> None:
    """Create the shared session."""
    store = await common.open_store(store_spec, folder, Codec())
    try:
        await store.create(SESSION_ID)
    finally:
        await store.aclose()


async def check(
    store_spec: str,
    folder: Path,
    acks: list[dict[str, Any]],
    summary: Summary,
    in_flight: Collection[str] = (),
) -> None:
    """Check the final log against the acknowledgements; record findings in ``summary``.

    ``in_flight``: message ids of batches a killed writer may have stored
    without acknowledging them.
    """
    codec: Codec[Any] = Codec()
    store = await common.open_store(store_spec, folder, codec)
    try:
        batches: list[Batch[Effect]] = await store.batches(SESSION_ID)
        summary.stored = len(batches)
        revisions = [b.revision for b in batches]
        if revisions != list(range(1, len(batches) + 1)):
            summary.problems.append(f"revisions are not 1..{len(batches)}: {revisions}")
        by_id: dict[str, list[tuple[int, str]]] = {}
        logged_ids: list[str] = []
        for b in batches:
            for effect in b.effects:
                if isinstance(effect, AppendMessage):
                    by_id.setdefault(effect.message.id, []).append(
                        (b.revision, common.digest(codec, b))
                    )
                    logged_ids.append(effect.message.id)
        acked_at: Counter[int] = Counter(a["rev"] for a in acks)
        for revision, times in sorted(acked_at.items()):
            if times > 1:
                summary.problems.append(
                    f"lost update: {times} writers were acknowledged at revision {revision}"
                )
        at_position = {i: common.digest(codec, b) for i, b in enumerate(batches, start=1)}
        for a in acks:
            found = by_id.get(a["id"], [])
            if found != [(a["rev"], a["sha"])] or at_position.get(a["rev"]) != a["sha"]:
                summary.lost += 1
                summary.problems.append(
                    f"acknowledged batch {a['id']} at revision {a['rev']}: the log holds "
                    f"{[rev for rev, _ in found] or 'nothing'}"
                    + (" with other bytes" if found and found[0][1] != a["sha"] else "")
                )
        unacked = sorted(set(by_id) - {a["id"] for a in acks} - set(in_flight))
        if unacked:
            summary.problems.append(f"stored but never acknowledged: {unacked}")
        current: Session[Any] = await store.load(SESSION_ID)
        replay: Session[Any] = await store.load_at(SESSION_ID, 0)
        for b in batches:
            replay = apply_batch(replay, b.effects)
        if current != replay:
            summary.problems.append("load() differs from the replayed log")
        if await store.load_at(SESSION_ID, current.revision) != current:
            summary.problems.append(f"load() differs from load_at({current.revision})")
        if [m.id for m in current.conversation] != logged_ids:
            summary.problems.append("the conversation is not the log's messages in log order")
    except Exception as exc:
        summary.problems.append(f"reading the store failed: {type(exc).__name__}: {exc}")
    finally:
        await store.aclose()


def run(
    store: str,
    *,
    writers: int = 8,
    batches_per_writer: int = 25,
    workdir: Path | None = None,
    kill_writers: int = 0,
    seed: int = 0,
    timeout: float = 300.0,
    echo: bool = True,
) -> Summary:
    """Run the harness; print a report when ``echo``; return the summary.

    With ``kill_writers=K`` writers 0..K-1 are SIGKILLed, each a random few
    milliseconds after a random number of its own acknowledged batches (a
    timer in the writer sends the signal, so the kill always happens): the
    others must still finish (no lock is left held), nothing acknowledged may
    be lost, and a killed writer may leave at most its one in-flight batch,
    whole, unacknowledged.
    """
    summary = Summary(writers)
    rng = random.Random(seed)
    with contextlib.ExitStack() as stack:
        stack.enter_context(common.store_server(store))
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="conc-")))
        anyio.run(create_session, store, workdir)
        processes: list[subprocess.Popen[bytes]] = []
        for number in range(writers):
            command = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--child",
                "writer",
                "--store",
                store,
                "--dir",
                str(workdir),
                "--writer",
                str(number),
                "--batches",
                str(batches_per_writer),
                "--ack",
                str(workdir / f"acks-{number}.jsonl"),
            ]
            if number < kill_writers:
                # Dies by SIGKILL a random moment after a random number of its acks.
                command += [
                    "--die-after",
                    str(rng.randrange(0, batches_per_writer)),
                    "--die-delay",
                    str(rng.uniform(0.0, 0.005)),
                ]
            stderr = stack.enter_context((workdir / f"stderr-{number}.txt").open("wb"))
            process = stack.enter_context(
                subprocess.Popen(
                    command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr
                )
            )
            processes.append(process)
        # The barrier: every writer has opened its store before any is released.
        for process in processes:
            assert process.stdout is not None
            process.stdout.readline()
        for process in processes:
            assert process.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                process.stdin.write(b"go\n")
                process.stdin.flush()  # communicate() closes it
        acks: list[dict[str, Any]] = []
        killed: dict[int, int] = {}  # killed writer -> batches it acknowledged
        for number, process in enumerate(processes):
            try:
                out, _ = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                out, _ = process.communicate()
            report: dict[str, Any] = {}
            for line in reversed(out.decode(errors="replace").splitlines()):
                if line.startswith("{"):
                    report = json.loads(line)
                    break
            summary.conflicts += int(report.get("conflicts", 0))
            errors = report.get("errors", [])
            mine = common.read_records(workdir / f"acks-{number}.jsonl")
            acks.extend(mine)
            if process.returncode == -signal.SIGKILL and number < kill_writers:
                killed[number] = len(mine)
            elif process.returncode != 0 or errors or not report:
                tail = (workdir / f"stderr-{number}.txt").read_text(errors="replace").strip()
                detail = "; ".join(errors) or (tail.splitlines()[-1] if tail else "no report")
                summary.failed_writers.append(
                    f"writer {number} (exit status {process.returncode}): {detail}"
                )
        summary.killed = len(killed)
        summary.batches = len(acks)
        expected = (writers - len(killed)) * batches_per_writer + sum(killed.values())
        if summary.batches != expected:
            summary.problems.append(f"{summary.batches} batches acknowledged, {expected} expected")
        in_flight = {f"w{number}-{count}" for number, count in killed.items()}
        anyio.run(check, store, workdir, acks, summary, in_flight)
    if echo:
        print(f"store={store} expected={writers * batches_per_writer}")
        for line in summary.lines():
            print(line, flush=True)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else "")
    parser.add_argument("--store", required=True, help="sqlite, file, postgres, or module:Class")
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--batches-per-writer", type=int, default=25)
    parser.add_argument(
        "--kill-writers", type=int, default=0, help="SIGKILL this many writers mid-run"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="per writer, seconds")
    parser.add_argument("--workdir", type=Path, help="keep the store here (default: temp)")
    parser.add_argument("--child", choices=["writer"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--writer", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--batches", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--ack", help=argparse.SUPPRESS)
    parser.add_argument("--die-after", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--die-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "writer":
        anyio.run(writer, args)
        return 0
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    summary = run(
        args.store,
        writers=args.writers,
        batches_per_writer=args.batches_per_writer,
        workdir=args.workdir,
        kill_writers=args.kill_writers,
        seed=args.seed,
        timeout=args.timeout,
    )
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
