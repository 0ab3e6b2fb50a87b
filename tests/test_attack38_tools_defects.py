"""Attack 38: plain-function tools in stepmachine's own worker pool (``_threads.TOOLS``),
held to what ``anyio.to_thread.run_sync(abandon_on_cancel=True)`` gave them before.

Written against a pool of stepmachine's own that plain-function tools ran in for a
while on asyncio (they run in anyio's threads again); three differences an outsider met
there, each held here:

* anyio runs the function in a copy of the caller's context with sniffio's
  ``current_async_library_cvar`` cleared (the worker thread runs no event loop); the
  pool copied the context as is, so under ``anyio.run`` (so under ``Agent.run_sync``)
  ``anyio.run`` / ``Agent.run_sync`` in the tool thread refused with "Already running
  asyncio in this thread": a sub-agent called from a sync tool failed. The stores'
  pool clears it too.
* anyio's worker threads are not daemons: ``threading._shutdown`` joins them before any
  ``atexit`` handler runs, so a tool its caller left still ends before the handlers
  registered after ``import stepmachine`` (a user's, the one ``weakref.finalize``
  registers for a ``TemporaryDirectory``) tear its world down.
* a KeyboardInterrupt landing in the pool's hand-off left the call counted for ever
  (for the stores' pool: one of the loop's 40 slots taken for good).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
import sniffio

from stepmachine import Agent, Runtime, ToolContext, tool
from stepmachine.testing import ScriptedModel, call, reply

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), *sys.path])}


def context() -> ToolContext:
    return ToolContext(Runtime(), "s", "c", "k")


def library_in_thread() -> str:
    try:
        return sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return "none"


@tool
def which_library() -> str:
    """Which async library does sniffio see in the tool's thread?"""
    return library_in_thread()


async def _inner() -> str:
    await anyio.lowlevel.checkpoint()
    return "inner ran"


@tool
def nested_run() -> str:
    """Run an event loop of its own in the tool's thread."""
    return anyio.run(_inner)


@pytest.mark.parametrize("runner", ["asyncio.run", "anyio.run"])
def test_the_control_anyio_worker_thread_sees_no_async_library(runner: str) -> None:
    """The reference: in anyio's own worker thread sniffio finds no library and
    ``anyio.run`` works, however the loop was started."""

    async def main() -> tuple[str, str]:
        return (
            await anyio.to_thread.run_sync(library_in_thread),
            await anyio.to_thread.run_sync(lambda: anyio.run(_inner)),
        )

    result = asyncio.run(main()) if runner == "asyncio.run" else anyio.run(main)
    assert result == ("none", "inner ran")


def test_under_asyncio_run_a_sync_tool_can_run_an_event_loop_of_its_own() -> None:
    async def main() -> tuple[str, str]:
        return (
            await which_library.call({}, context()),
            await nested_run.call({}, context()),
        )

    assert asyncio.run(main()) == ("none", "inner ran")


def test_under_anyio_run_sniffio_sees_no_library_in_a_sync_tools_thread() -> None:
    async def main() -> str:
        return await which_library.call({}, context())

    assert anyio.run(main, backend="asyncio") == "none"


def test_under_anyio_run_a_sync_tool_can_run_an_event_loop_of_its_own() -> None:
    async def main() -> str:
        return await nested_run.call({}, context())

    assert anyio.run(main, backend="asyncio") == "inner ran"


def test_agent_run_sync_on_trio_lets_a_sync_tool_run_a_sub_agent(tmp_path: Path) -> None:
    """The same sub-agent pattern on trio (anyio's threads there): it works."""
    assert _sub_agent_answer(tmp_path, "trio") == "the sub-agent says hi"


def test_agent_run_sync_lets_a_sync_tool_run_a_sub_agent(tmp_path: Path) -> None:
    """A sync tool that asks another agent (``run_sync``, the documented blocking entry
    point, from a thread that runs no loop), inside an outer ``Agent.run_sync``."""
    assert _sub_agent_answer(tmp_path, "asyncio") == "the sub-agent says hi"


def _sub_agent_answer(tmp_path: Path, backend: str) -> str:
    sub = Agent(ScriptedModel([reply("the sub-agent says hi")]), store=tmp_path / "sub.sqlite3")

    @tool
    def ask_sub_agent(question: str) -> str:
        """Ask the sub-agent."""
        return sub.run_sync("inner", question).text

    outer = Agent(
        ScriptedModel([call(("ask_sub_agent", {"question": "hello?"})), reply("done")]),
        tools=[ask_sub_agent],
        store=tmp_path / "outer.sqlite3",
    )
    report = outer.run_sync("outer", "go", backend=backend)  # type: ignore[arg-type]
    assert report.text == "done"
    results = [
        part.content
        for message in report.session.conversation
        for part in message.parts
        if type(part).__name__ == "ToolResultPart"
    ]
    assert len(results) == 1, results
    return str(results[0])


EXIT_SCRIPT = """
import asyncio, atexit, os, tempfile, time
import anyio
from stepmachine import Runtime, ToolContext, tool

outcome = {outcome!r}
{runner_import}
workdir = tempfile.TemporaryDirectory()  # removed at exit by weakref.finalize's atexit hook
seen_by_atexit = []

@atexit.register
def a_users_clean_up():
    seen_by_atexit.append(os.path.exists(os.path.join(workdir.name, "charged")))
    with open(outcome + ".atexit", "w") as f:
        f.write(repr(seen_by_atexit))

@tool
def charge() -> str:
    \"\"\"Charge the card, writing the receipt into the work folder.\"\"\"
    time.sleep(0.5)
    try:
        with open(os.path.join(workdir.name, "charged"), "w") as f:
            f.write("once")
    except OSError as exc:
        with open(outcome, "w") as f:
            f.write("failed: " + type(exc).__name__)
        raise
    with open(outcome, "w") as f:
        f.write("written")
    return "charged"

async def main():
    with anyio.move_on_after(0.05):
        await charge.call({{}}, ToolContext(Runtime(), "s", "c", "k"))
    print("left", flush=True)

{run}
"""


def _exit_script(tmp_path: Path, run: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    outcome = tmp_path / "outcome"
    script = textwrap.dedent(EXIT_SCRIPT).format(outcome=str(outcome), runner_import="", run=run)
    done = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    return done, outcome


def test_an_abandoned_tool_finishes_before_later_atexit_hooks_tear_its_world_down(
    tmp_path: Path,
) -> None:
    """A run stops waiting for its sync tool; the script ends. As with anyio's
    non-daemon worker threads, the tool ends before any ``atexit`` clean-up: its receipt
    is written into a ``TemporaryDirectory`` still there, and a user's ``atexit``
    handler sees it."""
    done, outcome = _exit_script(tmp_path, "asyncio.run(main())")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "left"
    assert outcome.read_text() == "written"
    assert Path(str(outcome) + ".atexit").read_text() == "[True]"


def test_an_abandoned_tool_still_ends_before_the_process_does(tmp_path: Path) -> None:
    """What does hold: the process does not exit before the tool has ended (the
    outcome file exists, whatever it says), and it exits with status 0."""
    done, outcome = _exit_script(tmp_path, "asyncio.run(main())")
    assert done.returncode == 0, done.stderr
    assert outcome.exists()


INTERRUPT_SCRIPT = """
import asyncio, sys
import stepmachine._threads as threads
from stepmachine._async import run_in_thread

# The line of Pool.submit that hands the call to the thread it picked: a KeyboardInterrupt
# lands there, as a Ctrl-C's would (at any bytecode of the main thread).
PUT = next(
    number for number, line in enumerate(open(threads.__file__), 1)
    if "worker.calls.put(call)" in line
)
fired = []

def trace(frame, event, arg):
    if frame.f_code.co_filename != threads.__file__ or frame.f_code.co_name != "submit":
        return None
    def line(frame, event, arg):
        if event == "line" and frame.f_lineno == PUT and not fired:
            fired.append(PUT)
            raise KeyboardInterrupt
        return line
    return line

async def interrupted():
    sys.settrace(trace)
    try:
        return await run_in_thread(int, "1")
    finally:
        sys.settrace(None)

async def main():
    try:
        await interrupted()
    except KeyboardInterrupt:
        print("interrupted at", fired, flush=True)
    counted = threads.POOL._loops.get(asyncio.get_running_loop())
    print("counted", 0 if counted is None else counted.running, flush=True)
    print("next", await run_in_thread(int, "2"), flush=True)

asyncio.run(main())
"""


def test_an_interrupt_inside_the_pools_hand_off_leaves_nothing_counted() -> None:
    """Ctrl-C's KeyboardInterrupt lands in the main thread at whatever bytecode runs; here
    in the hand-off of a store's call to its worker thread (injected with a trace function
    at that line). The call never runs, nothing stays counted for it (it would hold one of
    the loop's 40 slots for good), and the next call runs."""
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(INTERRUPT_SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        out, err = process.communicate(timeout=20)  # a bound on a hang, not a timing
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        hung = True
    else:
        hung = False
    assert not hung, "the process hung"
    lines = out.splitlines()
    assert lines[0].startswith("interrupted at ["), (out, err)  # the interrupt did land there
    assert lines[1:] == ["counted 0", "next 2"], (out, err)
    assert process.returncode == 0, err
