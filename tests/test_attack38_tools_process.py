"""Attack 38: a sync tool's worker thread (the tools' pool on asyncio) when the process
ends around it, in real processes (``tests/_attack38_child.py``): SIGINT, ``sys.exit``
in ``asyncio.run``, ``os.fork()``, a loop closed under a running tool.

What must hold: the process exits (no hang; a child still alive after ``HANG`` seconds
is killed and reported), only once the tool's side effect is done (exactly once); the
session's history stays valid and its call is answered once; nothing but the
interrupt's own traceback is printed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stepmachine.extend import history_problems
from stepmachine.stores import SQLiteStore

HERE = Path(__file__).resolve().parent
HANG = 30.0  # seconds: a bound on a hang, not a timing
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), *sys.path])}


def start(scenario: str, folder: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-X", "dev", str(HERE / "_attack38_child.py"), scenario, str(folder)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )


def finish(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=HANG)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"the child hung: stdout={out!r} stderr={err[-2000:]!r}")
    return process.returncode, out, err


def tool_results(folder: Path) -> list[str]:
    async def load() -> list[str]:
        store = await SQLiteStore.open(folder / "db.sqlite3")
        try:
            session = await store.load("s")
            assert history_problems(session) == []
            return [
                str(part.content)
                for message in session.conversation
                for part in message.parts
                if type(part).__name__ == "ToolResultPart"
            ]
        finally:
            await store.aclose()

    return asyncio.run(load())


def test_sigint_while_a_sync_tool_runs_under_agent_run_sync(tmp_path: Path) -> None:
    process = start("sigint", tmp_path)
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "tool started"
    process.send_signal(signal.SIGINT)
    code, _, err = finish(process)
    assert code in (-signal.SIGINT, 1, 130), err
    assert err.count("KeyboardInterrupt") >= 1
    assert "Exception in thread" not in err
    assert "was never retrieved" not in err
    assert (tmp_path / "effects").read_text() == "charged\n"  # done before the exit
    (result,) = tool_results(tmp_path)  # answered once: its real result (it ended within
    assert result == "charged" or result.startswith("interrupted")  # THREAD_GRACE) or not


def test_sys_exit_in_asyncio_run_while_a_sync_tool_runs(tmp_path: Path) -> None:
    code, out, err = finish(start("sys_exit", tmp_path))
    assert out.strip() == "tool started"
    assert code in (1, 3), err
    assert "SystemExit" in err
    assert "Exception in thread" not in err
    assert (tmp_path / "effects").read_text() == "charged\n"
    (result,) = tool_results(tmp_path)  # answered once: its real result (it ended within
    assert result == "charged" or result.startswith("interrupted")  # THREAD_GRACE) or not


def test_fork_while_a_sync_tool_runs(tmp_path: Path) -> None:
    """The child starts with an empty tools' pool: its own sync tool runs and reaches its
    own loop, and its exit does not wait for the parent's tool (which the parent
    releases only once the child ended); then the parent's run completes."""
    code, out, err = finish(start("fork", tmp_path))
    assert code == 0, err
    assert (tmp_path / "child_status").read_text() == "0", err
    assert (tmp_path / "child" / "report").read_text() == "done"
    assert (tmp_path / "report").read_text() == "done"
    assert (tmp_path / "effects").read_text() == "charged\n"
    assert tool_results(tmp_path) == ["charged"]
    assert "Exception in thread" not in err
    assert out.count("tool started") == 1


@pytest.mark.parametrize("ending", ["returns", "raises", "calls_back", "checks_cancelled"])
def test_a_tool_ending_after_its_loop_closed_is_dropped_quietly(
    tmp_path: Path, ending: str
) -> None:
    """``asyncio.run`` returns while a sync tool still runs; the tool then returns,
    raises, calls back its (closed) loop or checks for cancellation: nothing is printed,
    the process exits 0 after the tool ended."""
    mark = tmp_path / "ended"
    script = textwrap.dedent(
        f"""
        import asyncio, gc, time
        import anyio, anyio.from_thread
        from stepmachine import Runtime, ToolContext, tool

        @tool
        def late() -> str:
            \"\"\"Late.\"\"\"
            time.sleep(0.3)
            try:
                if {ending!r} == "raises":
                    raise ValueError("late failure")
                if {ending!r} == "calls_back":
                    return anyio.from_thread.run_sync(lambda: "back")
                if {ending!r} == "checks_cancelled":
                    anyio.from_thread.check_cancelled()
                return "late"
            finally:
                with open({str(mark)!r}, "w") as f:
                    f.write("ended")

        async def main():
            with anyio.move_on_after(0.05):
                await late.call({{}}, ToolContext(Runtime(), "s", "c", "k"))

        asyncio.run(main())
        gc.collect()
        """
    )
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-c", script],
        check=False,
        capture_output=True,
        text=True,
        timeout=HANG,
        env=ENV,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert mark.read_text() == "ended"
