"""SIGKILL of the agent process mid-call of an MCP tool, then resume (invariant 6).

A real agent process (tests/harness/mcp_agent.py, SQLite store) calls a tool
of a real stdio MCP server; the server appends its ledger line, then sleeps.
The test SIGKILLs the agent while the call is in flight, stops the orphaned
server, and resumes the session in a new process, on asyncio and on trio.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from stepmachine import (
    Message,
    Runtime,
    StateMachine,
)
from stepmachine.stores import MemoryStore

HARNESS = Path(__file__).parent / "harness" / "mcp_agent.py"


def _ledger(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    return [line.split("\t") for line in path.read_text().splitlines()]


def _kill_started_servers(events: Path) -> None:
    for line in events.read_text().splitlines() if events.exists() else []:
        kind, pid = line.split()
        if kind == "start":
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _kill_mid_call(
    tmp_path: Path, tool: str, backend: str, *, trust: bool = False
) -> dict[str, object]:
    """Start the agent, SIGKILL it mid-call, resume it; the resumed run's report."""
    db, ledger, events = tmp_path / "agent.db", tmp_path / "ledger.txt", tmp_path / "events.txt"
    base = [sys.executable, str(HARNESS), "--db", str(db), "--ledger", str(ledger)]
    base += ["--events", str(events), "--tool", tool, "--backend", backend]
    base += ["--trust"] if trust else []
    stderr = tmp_path / "agent.stderr"
    with stderr.open("wb") as err:
        agent = subprocess.Popen(base, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 60
        while not _ledger(ledger):  # the server has started the side effect
            if agent.poll() is not None or time.monotonic() > deadline:
                tail = stderr.read_text(errors="replace")[-2000:]
                raise AssertionError(f"the call never reached the server: {tail}")
            time.sleep(0.02)
        agent.send_signal(signal.SIGKILL)
        agent.wait(30)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        _kill_started_servers(events)
    assert agent.returncode == -signal.SIGKILL
    resumed = subprocess.run(
        [*base, "--no-delay"], capture_output=True, text=True, timeout=120, check=False
    )
    _kill_started_servers(events)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report: dict[str, object] = json.loads(resumed.stdout.strip().splitlines()[-1])
    report["ledger"] = _ledger(ledger)
    return report


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_non_idempotent_mcp_call_killed_mid_flight_is_not_run_again(
    tmp_path: Path, backend: str
) -> None:
    report = _kill_mid_call(tmp_path, "record", backend)
    assert len(report["ledger"]) == 1  # type: ignore[arg-type]  # the side effect happened once
    (result,) = report["results"]  # type: ignore[misc]
    assert result["is_error"]
    assert result["content"].startswith("outcome unknown")
    assert str(report["final"]).startswith("error: outcome unknown")


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_idempotent_mcp_call_killed_mid_flight_runs_again_with_the_same_key(
    tmp_path: Path, backend: str
) -> None:
    report = _kill_mid_call(tmp_path, "mark", backend, trust=True)  # a server one trusts
    ledger = report["ledger"]
    assert len(ledger) == 2  # type: ignore[arg-type]  # re-run: the tool said it is idempotent
    (_, first_key, _), (_, second_key, _) = ledger  # type: ignore[misc]
    assert first_key == second_key  # the server can deduplicate by it
    assert first_key.startswith("sm-")
    (result,) = report["results"]  # type: ignore[misc]
    assert result == {"content": "marked once", "is_error": False}
    assert report["final"] == "marked once"


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_false_read_only_hint_of_an_untrusted_server_does_not_rerun_the_call(
    tmp_path: Path, backend: str
) -> None:
    """Annotations are the server's hints: by default they do not lower the class."""
    report = _kill_mid_call(tmp_path, "liar", backend)
    assert len(report["ledger"]) == 1  # type: ignore[arg-type]  # one charge for one key
    (result,) = report["results"]  # type: ignore[misc]
    assert result["is_error"]
    assert result["content"].startswith("outcome unknown")


FIXTURES = Path(__file__).parent / "fixtures"


HOSTILE = FIXTURES / "mcp_hostile_server.py"


SERVER = FIXTURES / "mcp_light_server.py"  # the SDK's tools without the SDK: starts at once


BOUND = 60  # seconds: no test here may hang longer


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def pids(events: Path) -> list[int]:
    return [int(x.split()[1]) for x in lines(events) if x.startswith("start ")]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def kill_all(found: list[int]) -> None:
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def run(steps: list[Any], model: Any, sid: str = "s") -> Any:
    store = MemoryStore()
    await store.create(sid, conversation=[Message.user("go", id="u1")])
    with anyio.fail_after(BOUND):
        return await StateMachine(steps).run(Runtime(store=store, model=model), sid)


@pytest.fixture
def events(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "events.txt"
    yield path
    kill_all(pids(path))
    kill_all(pids(tmp_path / "events.txt"))


# -- invariant 6: SIGKILL of the agent mid-call, then resume ---------------------------


AGENT = textwrap.dedent(
    """
    import sys, anyio
    from stepmachine import Message, ModelInference, Runtime, SessionNotFoundError, StateMachine
    from stepmachine.operations import McpStdio, McpTools
    from stepmachine.stores import SQLiteStore
    from stepmachine.testing import ScriptedModel, call, reply

    db, server, ledger, events = sys.argv[1:5]

    async def main():
        store = await SQLiteStore.open(db)
        try:
            await store.load("s")
        except SessionNotFoundError:
            await store.create("s", conversation=[Message.user("go", id="u1")])
        mcp = McpTools([McpStdio(command=sys.executable, args=[server], name="fx",
                        env={"MCP_LEDGER": ledger, "MCP_EVENTS": events})])
        turns = [call(("record", {"note": "pay", "delay": 120})), reply("done")]
        model = ScriptedModel(turns[int(sys.argv[5]):])  # a resumed run only replies
        await StateMachine([mcp, ModelInference()]).run(Runtime(store=store, model=model), "s")

    anyio.run(main)
    """
)


def test_sigkill_of_the_agent_mid_call_then_resume_never_runs_the_call_twice(
    tmp_path: Path,
) -> None:
    ledger, events, db = tmp_path / "ledger.txt", tmp_path / "events.txt", tmp_path / "s.db"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    argv = [sys.executable, "-c", AGENT, str(db), str(SERVER), str(ledger), str(events), "0"]
    errors = tmp_path / "agent-stderr.txt"
    with errors.open("wb") as err:
        agent = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + BOUND
        while not lines(ledger):
            assert agent.poll() is None, errors.read_text()[-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    # The orphaned server: its stdin closed with the agent; it must not live on for ever.
    first = pids(events)
    deadline = time.monotonic() + 15
    while any(alive(p) for p in first) and time.monotonic() < deadline:
        time.sleep(0.05)
    orphans = [p for p in first if alive(p)]
    kill_all(orphans)
    argv2 = [*argv[:-1], "1"]
    done = subprocess.run(argv2, env=env, capture_output=True, timeout=BOUND, check=False)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert len(lines(ledger)) == 1  # the non-idempotent call did not run again
    check = textwrap.dedent(
        """
        import sys, anyio
        from stepmachine.stores import SQLiteStore
        async def main():
            store = await SQLiteStore.open(sys.argv[1])
            s = await store.load("s")
            rs = [r for m in s.conversation for r in m.tool_results]
            print(len(rs), rs[0].is_error, s.conversation[-1].text)
        anyio.run(main)
        """
    )
    out = (
        subprocess.run(
            [sys.executable, "-c", check, str(db)],
            env=env,
            capture_output=True,
            timeout=BOUND,
            check=True,
        )
        .stdout.decode()
        .split()
    )
    assert out[:2] == ["1", "True"]
    kill_all(pids(events))
    assert first  # a server had started
    assert orphans == []  # the server of the killed agent exited with its stdin


# -- invariant 6: the class at the time of the intent, not the server's later word ---------


FLIP_AGENT = textwrap.dedent(
    """
    import sys, anyio
    from stepmachine import Message, ModelInference, Runtime, SessionNotFoundError, StateMachine
    from stepmachine.operations import McpStdio, McpTools
    from stepmachine.stores import SQLiteStore
    from stepmachine.testing import ScriptedModel, call, reply

    db, server, ledger, flip, skip = sys.argv[1:6]

    async def main():
        store = await SQLiteStore.open(db)
        try:
            await store.load("s")
        except SessionNotFoundError:
            await store.create("s", conversation=[Message.user("go", id="u1")])
        env = {"HOSTILE_LEDGER": ledger, "HOSTILE_FLIP": flip}
        mcp = McpTools([McpStdio(command=sys.executable, args=[server, "flip"], name="hx",
                                 env=env)])
        turns = [call(("record", {"text": "pay"})), reply("done")]
        model = ScriptedModel(turns[int(skip):])
        session = await StateMachine([mcp, ModelInference()]).run(
            Runtime(store=store, model=model), "s")
        rs = [r for m in session.conversation for r in m.tool_results]
        print(len(rs), rs[0].is_error)

    anyio.run(main)
    """
)


def test_a_server_changing_its_annotations_after_a_crash_does_not_rerun_the_call(
    tmp_path: Path,
) -> None:
    ledger, flip, db = tmp_path / "ledger.txt", tmp_path / "flip", tmp_path / "s.db"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    argv = [sys.executable, "-c", FLIP_AGENT, str(db), str(HOSTILE), str(ledger), str(flip), "0"]
    errors = tmp_path / "agent-stderr.txt"
    with errors.open("wb") as err:
        agent = subprocess.Popen(
            argv, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )
    try:
        deadline = time.monotonic() + BOUND
        while not lines(ledger):
            assert agent.poll() is None, errors.read_text()[-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(agent.pid, signal.SIGKILL)  # the agent and its server, mid-call
        agent.wait(10)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    flip.write_text("upgraded")  # the restarted server now says the tool is idempotent
    done = subprocess.run(
        [*argv[:-1], "1"], env=env, capture_output=True, timeout=BOUND, check=False
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert len(lines(ledger)) == 1  # the call journalled non-idempotent did not run again
    assert done.stdout.decode().split() == ["1", "True"]  # answered: outcome unknown
