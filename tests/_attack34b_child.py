"""A child for tests/test_attack34b_kills.py: one session run by one path, maybe SIGKILLed.

    python _attack34b_child.py PATH KIND WHERE MODE FOLDER [BUDGET]

PATH: ``run`` (machine.run), ``step`` (step/apply by hand), ``worker`` (run_worker) or
``durable`` (a DBOS durable turn, executor ``w1``, system database in FOLDER).
KIND: ``sqlite`` or ``file``; WHERE: the store's location.
MODE: when the child SIGKILLs itself:

* ``none``: never;
* ``tool_start``: when ``charge`` has started, before its side effect;
* ``tool_done``: when ``charge``'s side effect is journalled, before it returns;
* ``model2``: when the second model request has arrived (counted), before it answers;
* ``hold``: never; when ``charge``'s side effect is journalled it writes FOLDER/inside and
  waits for FOLDER/release before returning.

Side effects go to FOLDER/effects.txt, model requests to FOLDER/requests.txt. BUDGET:
``N`` puts ``Budget(per_session=Limits(model_calls=N))`` in front of the steps, ``run:N``
``Budget(per_run=...)``. Prints
``finished <reason>`` when the session's turn is over.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
from _attack34b_agent import Agent, by_hand

from stepmachine import CancelToken, RunReport, StateMachine, run_worker
from stepmachine.operations import Budget, Limits


def kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


async def open_store(kind: str, where: str) -> Any:
    if kind == "sqlite":
        from stepmachine.stores import SQLiteStore

        return await SQLiteStore.open(where)
    from stepmachine.stores import FileStore

    return await FileStore.open(where)


def build(path: str, mode: str, folder: Path, budget: str) -> tuple[Agent, Any]:
    agent = Agent(folder, approval=False)
    seen = (
        len((folder / "requests.txt").read_text().splitlines())
        if (folder / "requests.txt").exists()
        else 0
    )

    async def tool_start() -> None:
        if mode == "tool_start":
            kill()

    async def tool_done() -> None:
        if mode == "tool_done":
            kill()
        if mode == "hold":  # tell the parent, then wait for it to say go on
            (folder / "inside").write_text("charge took effect")
            while not (folder / "release").exists():  # noqa: ASYNC110 - another process's file
                await anyio.sleep(0.02)

    def on_model() -> None:
        if mode == "model2" and seen + agent.requests == 2:
            kill()

    agent.on_charge_start = tool_start
    agent.on_charge_done = tool_done
    agent.on_model = on_model
    machine = agent.machine()
    if budget:
        scope, _, count = budget.rpartition(":")
        limits = Limits(model_calls=int(count))
        limit = Budget(per_run=limits) if scope == "run" else Budget(per_session=limits)
        steps = [limit, *machine.steps]
        machine = StateMachine(steps)
    return agent, machine


async def main(path: str, kind: str, where: str, mode: str, folder: str, budget: str) -> None:
    home = Path(folder)
    agent, machine = build(path, mode, home, budget)
    store = await open_store(kind, where)
    runtime = agent.runtime(store, fixed_ids=False)
    try:
        if path == "run":
            reason = (await machine.run_report(runtime, "s")).reason.kind
        elif path == "step":
            _, reason, _ = await by_hand(machine, runtime, "s")
        elif path == "worker":
            await store.request_run("s")
            stop = CancelToken()
            reasons: list[str] = []

            def seen(report: RunReport[Any]) -> None:
                reasons.append(report.reason.kind)
                stop.cancel()

            await run_worker(machine, runtime, stop=stop, poll=0.01, on_report=seen)
            reason = reasons[-1]
        else:
            reason = await durable(machine, runtime, home)
    finally:
        await store.aclose()
    print(f"finished {reason}", flush=True)  # noqa: T201 - the child talks to its parent


async def durable(machine: StateMachine[Any], runtime: Any, home: Path) -> str:
    from dbos import DBOS

    from stepmachine.durable import DurableMachine, dbos_config

    config = dbos_config(
        "a34b", f"sqlite:///{home}/sys.sqlite3", executor_id="w1", log_level="ERROR"
    )
    DBOS(config=config)
    worker = DurableMachine(machine, runtime, name="a34b", polling_interval=0.05)
    await worker.launch()
    try:
        handle = await worker.enqueue_turn("s", turn_id="turn-1")
        report = await worker.result(handle, polling_interval=0.05)
        return str(report.reason)
    finally:
        DBOS.destroy()


if __name__ == "__main__":
    args = sys.argv[1:] + [""] * (7 - len(sys.argv))
    backend = os.environ.get("ATTACK34B_BACKEND", "asyncio")
    anyio.run(main, *args[:6], backend=backend)
