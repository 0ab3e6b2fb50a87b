"""A child for tests/test_attack35_interrupts.py: an interrupt raised in one of a run's
own child tasks (a concurrent tool, the lease's renewal task), in a real process.

    python _attack35_child.py SCENARIO RUNNER STORE FOLDER

SCENARIO names the fault (see ``TOOLS`` / ``main``; ``resume`` runs the same turn with
no fault). RUNNER: ``asyncio`` (``asyncio.run``), ``anyio`` (``anyio.run``, asyncio
backend), ``trio`` (``anyio.run``, trio backend), ``taskgroup`` (``asyncio.run`` with an
``asyncio.TaskGroup`` around the run), ``anyiogroup`` (``asyncio.run`` with an anyio task
group around the run). STORE: ``memory``, ``sqlite`` or ``file`` (in FOLDER).

Each tool's side effect is a line in FOLDER/journal.txt. The child prints one line to
stderr saying how ``RUNNER`` ended (``CAUGHT <type>`` or ``RETURNED``) and exits 130
after a ``KeyboardInterrupt``, the ``SystemExit``'s code after one, 0 after a return.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from stepmachine import (
    LeasePolicy,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    StateMachine,
    ToolCallPart,
    Tools,
    tool,
)
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore
from stepmachine.testing import FunctionModel, call, reply

SCENARIO, RUNNER, STORE, FOLDER = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
JOURNAL = FOLDER / "journal.txt"
RESUME = SCENARIO == "resume"


def journal(line: str) -> None:
    with JOURNAL.open("a") as out:
        out.write(line + "\n")
        out.flush()
        os.fsync(out.fileno())


def journalled(line: str) -> bool:
    return JOURNAL.exists() and line in JOURNAL.read_text().split()


def mark(name: str) -> None:
    (FOLDER / name).write_text("")


async def until(predicate: Any) -> None:
    while not predicate():  # noqa: ASYNC110 - a file another task writes
        await anyio.sleep(0.01)


# -- tools ---------------------------------------------------------------------------


@tool(side_effects="non_idempotent")
async def fast() -> str:
    """Charge at once (async)."""
    journal("fast")
    return "fast done"


@tool(side_effects="non_idempotent")
async def boom() -> str:
    """Raise the scenario's interrupt once ``fast`` took effect (async)."""
    if not RESUME:
        await until(lambda: journalled("fast"))
        await anyio.sleep(0.05)  # fast's result is on its way to the store
        if SCENARIO in ("exit_async",):
            raise SystemExit(7)
        if SCENARIO in (
            "ki_async", "two_sessions", "ki_lag_short", "ki_lag_long", "double_interrupt",
        ):  # fmt: skip
            raise KeyboardInterrupt
        if SCENARIO == "busy":  # Ctrl-C twice from the parent lands in this loop
            mark("busy")
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                sum(range(1000))
            return "busy for 20 s"
        if SCENARIO == "sigint":
            mark("waiting")
            await anyio.sleep(30)
    journal("boom")
    return "boom done"


@tool(side_effects="non_idempotent")
def boom_sync() -> str:
    """Raise SystemExit / KeyboardInterrupt in a worker thread once ``fast`` took effect."""
    if not RESUME:
        deadline = time.monotonic() + 10
        while not journalled("fast") and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        if SCENARIO == "exit_sync":
            sys.exit(7)
        if SCENARIO == "ki_sync":
            raise KeyboardInterrupt
    journal("boom_sync")
    return "boom_sync done"


@tool(side_effects="non_idempotent")
async def slow() -> str:
    """Wait (async) for a long time: left open when the interrupt comes."""
    if not RESUME:
        journal("slow-start")
        await anyio.sleep(30)
    journal("slow")
    return "slow done"


@tool(side_effects="non_idempotent")
def lag() -> str:
    """A sync tool still running in its worker thread when the interrupt comes."""
    if not RESUME:
        time.sleep({"ki_lag_long": 2.5, "ki_lag_short": 0.5}.get(SCENARIO, 0.0))
        if SCENARIO == "double_interrupt":
            time.sleep(0.3)
            raise SystemExit(9)  # a second interrupt, while the run is being cancelled
    journal("lag")
    return "lag done"


CALLS: dict[str, list[str]] = {
    "ki_async": ["fast", "boom", "slow"],
    "exit_async": ["fast", "boom", "slow"],
    "exit_sync": ["fast", "boom_sync", "slow"],
    "ki_sync": ["fast", "boom_sync", "slow"],
    "ki_lag_short": ["fast", "lag", "boom"],
    "ki_lag_long": ["fast", "lag", "boom"],
    "double_interrupt": ["fast", "lag", "boom"],
    "renewal": ["fast", "slow"],
    "renewal_write": ["fast", "slow"],
    "busy": ["fast", "boom"],
    "sigint": ["fast", "boom"],
    "two_sessions": ["fast", "boom"],
}


def calls_of(scenario: str) -> list[str]:
    kind = (FOLDER / "kind").read_text() if RESUME else scenario
    return CALLS[kind]


def model_for(names: list[str], prefix: str) -> FunctionModel:
    def answer(request: ModelRequest) -> ModelResponse:
        if request.messages[-1].role == "user":
            return call(*(ToolCallPart.of(f"{prefix}{n}", n, {}) for n in names))
        return reply("finished")

    return FunctionModel(answer)


# -- stores --------------------------------------------------------------------------


def faulty(base: type) -> type:
    """``base`` whose leases expire (so a run renews them in a task of its own); a renewal
    raises ``KeyboardInterrupt`` once tools run (``renewal``) or while a record is written
    (``renewal_write``), as Ctrl-C landing in that task would."""

    class Faulty(base):  # type: ignore[misc, valid-type]
        leases_expire = True
        writing = False

        async def renew(self, lease: Any) -> Any:
            if SCENARIO == "renewal" and journalled("slow-start"):
                raise KeyboardInterrupt
            if SCENARIO == "renewal_write" and self.writing:
                raise KeyboardInterrupt
            return await super().renew(lease)

        async def apply(self, *args: Any, **kwargs: Any) -> Any:
            text = repr(args[0] if args else kwargs.get("batch"))
            if SCENARIO == "renewal_write" and "fast done" in text and not self.writing:
                self.writing = True  # the renewal raises while this write waits
                await anyio.sleep(0.5)
            return await super().apply(*args, **kwargs)

    return Faulty


async def open_store() -> Any:
    fault = SCENARIO in ("renewal", "renewal_write")
    if STORE == "memory":
        return (faulty(MemoryStore) if fault else MemoryStore)(expiring_leases=True)
    if STORE == "sqlite":
        return await (faulty(SQLiteStore) if fault else SQLiteStore).open(FOLDER / "db.sqlite3")
    return await (faulty(FileStore) if fault else FileStore).open(FOLDER / "store")


async def one_run(store: Any, sid: str, prefix: str) -> None:
    names = calls_of(SCENARIO)
    if sid not in await store.list_sessions():
        await store.create(sid, conversation=[Message.user("go", id=f"u-{sid}")])
    machine: StateMachine[Any] = StateMachine(
        [Tools([fast, boom, boom_sync, slow, lag], max_concurrency=4), ModelInference()],
        lease=LeasePolicy(ttl=0.3),
        finalize_timeout=5.0,
    )
    if SCENARIO == "two_sessions" and sid == "s2":
        names = ["slow"]
    await machine.run(Runtime(store=store, model=model_for(names, prefix)), sid)


async def main() -> None:
    if not RESUME:
        (FOLDER / "kind").write_text(SCENARIO)
    store = await open_store()
    try:
        if RUNNER == "taskgroup":
            async with asyncio.TaskGroup() as group:
                group.create_task(one_run(store, "s", "c-"))
                group.create_task(asyncio.sleep(60))
        elif RUNNER == "anyiogroup" or SCENARIO == "two_sessions":
            async with anyio.create_task_group() as tg:
                tg.start_soon(one_run, store, "s", "c-")
                if SCENARIO == "two_sessions":
                    tg.start_soon(one_run, store, "s2", "d-")
                else:
                    tg.start_soon(anyio.sleep, 60)
        else:
            await one_run(store, "s", "c-")
    finally:
        if STORE != "memory":
            await store.aclose()


if __name__ == "__main__":
    # As in a terminal: a launcher that ignores SIGINT (a suite started as a background job of
    # a non-interactive shell) passes that on, and Ctrl-C would never reach this process.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if RUNNER in ("asyncio", "taskgroup", "anyiogroup"):
            asyncio.run(main())
        elif RUNNER == "anyio":
            anyio.run(main)
        else:
            anyio.run(main, backend="trio")
    except KeyboardInterrupt:
        print("CAUGHT KeyboardInterrupt", file=sys.stderr, flush=True)  # noqa: T201
        sys.exit(130)  # an ordinary exit: it waits for every non-daemon thread
    except SystemExit as exc:
        print(f"CAUGHT SystemExit {exc.code}", file=sys.stderr, flush=True)  # noqa: T201
        raise
    except BaseException as exc:  # the parent reads what came out
        print(f"CAUGHT {type(exc).__name__} {exc!r}", file=sys.stderr, flush=True)  # noqa: T201
        sys.exit(3)
    print("RETURNED", file=sys.stderr, flush=True)  # noqa: T201
