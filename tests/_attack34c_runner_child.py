"""A child for tests/test_attack34c_race.py: runs ``run()`` on session after session.

    python _attack34c_runner_child.py KIND WHERE FOLDER COUNT

For i in 0..COUNT-1 it waits for FOLDER/go-i, runs ``machine.run_report`` on session
``s-i`` (the attack34b agent, no approval; each tool call pauses a random few ms), and
writes FOLDER/done-i with the reason (or the error's type). Side effects go to
FOLDER/i/effects.txt.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import anyio
from _attack34b_agent import Agent
from _attack34b_child import open_store


async def main(kind: str, where: str, folder: str, count: str) -> None:
    home = Path(folder)
    store = await open_store(kind, where)
    try:
        for i in range(int(count)):
            while not (home / f"go-{i}").exists():  # noqa: ASYNC110 - the parent's file
                await anyio.sleep(0.005)
            agent = Agent(home / str(i), approval=False)

            async def pause() -> None:
                await anyio.sleep(random.uniform(0, 0.01))

            agent.on_charge_start = pause
            agent.on_charge_done = pause
            try:
                report = await agent.machine().run_report(
                    agent.runtime(store, fixed_ids=False), f"s-{i}"
                )
                outcome = report.reason.kind
            except Exception as exc:
                outcome = f"error {type(exc).__name__}: {exc}"
            (home / f"done-{i}").write_text(outcome)
    finally:
        await store.aclose()


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:5])
