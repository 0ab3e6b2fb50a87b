"""A child for tests/test_attack38_tools_process.py.

    python _attack38_child.py SCENARIO FOLDER

Every scenario runs an agent (SQLite store in FOLDER, a scripted model) whose one sync
tool ``charge`` prints ``tool started``, waits, then appends ``charged`` to
FOLDER/effects (fsynced) and returns. What differs is how the process ends:

* ``sigint``: ``Agent.run_sync``; the parent sends SIGINT once the tool started;
* ``sys_exit``: ``asyncio.run`` of a task group running the agent beside a task that
  calls ``sys.exit(3)`` once the tool started;
* ``fork``: once the tool started, the process forks; the child runs an agent of its
  own with a sync tool (in FOLDER/child), runs the ``atexit`` hooks (the tools' pool
  waits there for its calls) and exits; the parent's tool then ends and its run
  completes.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import anyio
import anyio.from_thread

from stepmachine import Agent, tool
from stepmachine.testing import ScriptedModel, call, reply

SCENARIO, FOLDER = sys.argv[1], Path(sys.argv[2])
started = threading.Event()
release = threading.Event()


@tool
def charge() -> str:
    """Charge the card."""
    print("tool started", flush=True)  # noqa: T201 - the parent waits for this line
    started.set()
    if SCENARIO == "fork":
        release.wait(30)
    else:
        time.sleep(1.0)
    with open(FOLDER / "effects", "a") as journal:
        journal.write("charged\n")
        journal.flush()
        os.fsync(journal.fileno())
    return "charged"


def agent(folder: Path, tools: list[object]) -> Agent[object]:
    model = ScriptedModel([call(("charge", {})), reply("done")])
    return Agent(model, tools=tools, store=folder / "db.sqlite3")  # type: ignore[arg-type]


def fork_child() -> None:
    """In the forked child: an agent of its own whose tool calls back its loop."""
    child = FOLDER / "child"
    child.mkdir()

    @tool
    def charge() -> str:  # the same name: the child's own tool
        """Charge in the child."""
        loop_id = anyio.from_thread.run_sync(lambda: id(asyncio.get_running_loop()))
        return f"child charged on loop {loop_id}"

    report = agent(child, [charge]).run_sync("s", "go")
    (child / "report").write_text(report.text)


async def main_sys_exit() -> None:
    async with anyio.create_task_group() as group:
        group.start_soon(agent(FOLDER, [charge]).run, "s", "go")
        await anyio.to_thread.run_sync(started.wait, 30)
        sys.exit(3)


async def main_fork() -> None:
    async with anyio.create_task_group() as group:

        async def fork_once_started() -> None:
            await anyio.to_thread.run_sync(started.wait, 30)
            pid = os.fork()
            if pid == 0:
                try:
                    fork_child()
                    atexit._run_exitfuncs()  # as an exit would: the tools' pool's wait too
                except BaseException:
                    traceback.print_exc()
                    os._exit(70)
                os._exit(0)
            _, status = await anyio.to_thread.run_sync(os.waitpid, pid, 0)
            (FOLDER / "child_status").write_text(str(os.waitstatus_to_exitcode(status)))
            release.set()

        group.start_soon(fork_once_started)
        report = await agent(FOLDER, [charge]).run("s", "go")
        (FOLDER / "report").write_text(report.text)


if SCENARIO == "sigint":
    agent(FOLDER, [charge]).run_sync("s", "go")
elif SCENARIO == "sys_exit":
    asyncio.run(main_sys_exit())
elif SCENARIO == "fork":
    asyncio.run(main_fork())
else:
    raise SystemExit(f"unknown scenario {SCENARIO}")
