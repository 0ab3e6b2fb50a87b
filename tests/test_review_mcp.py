"""An outside review of McpTools: hostile real MCP servers, cancellation, secrets, crashes.

Each test passes when the behaviour is right. A defect found is a test of the
right behaviour marked ``xfail(strict=True, reason="DEFECT: ...")``. Servers
are real processes: tests/fixtures/mcp_hostile_server.py (raw JSON-RPC, no
SDK) and tests/fixtures/mcp_server.py (the SDK's).
"""

from __future__ import annotations

import contextlib
import gc
import http.server
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog

from stepmachine import (
    ConfigurationError,
    ImagePart,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    StateMachine,
    ToolOutput,
    ToolResultPart,
    Tools,
)
from stepmachine.operations import McpHttp, McpStdio, McpTools
from stepmachine.stores import MemoryStore
from stepmachine.testing import FunctionModel, ScriptedModel, call, reply

FIXTURES = Path(__file__).parent / "fixtures"
HOSTILE = FIXTURES / "mcp_hostile_server.py"
SERVER = FIXTURES / "mcp_server.py"
BOUND = 60  # seconds: no test here may hang longer


def hostile(mode: str, events: Path, **kwargs: Any) -> McpStdio:
    kwargs.setdefault("name", "hx")
    return McpStdio(
        command=sys.executable,
        args=[str(HOSTILE), mode, str(events)],  # events: a marker to find the process
        env={"HOSTILE_EVENTS": str(events)},
        **kwargs,
    )


def fixture_server(tmp_path: Path, **kwargs: Any) -> McpStdio:
    env = {"MCP_LEDGER": str(tmp_path / "ledger.txt"), "MCP_EVENTS": str(tmp_path / "events.txt")}
    kwargs.setdefault("name", "fx")
    return McpStdio(command=sys.executable, args=[str(SERVER), "stdio"], env=env, **kwargs)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def pids(events: Path) -> list[int]:
    return [int(x.split()[1]) for x in lines(events) if x.startswith("start ")]


def results(session: Any) -> list[ToolResultPart]:
    return [r for m in session.conversation for r in m.tool_results]


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


async def all_gone(found: list[int]) -> bool:
    deadline = time.monotonic() + 15
    while any(alive(p) for p in found) and time.monotonic() < deadline:  # noqa: ASYNC110
        await anyio.sleep(0.05)
    return not any(alive(p) for p in found)


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


# -- garbage on the wire -------------------------------------------------------------


async def test_garbage_lines_on_stdout_do_not_stop_the_tools(events: Path) -> None:
    turns = [call(("echo", {"text": "hi"})), reply("done")]
    session = await run(
        [McpTools([hostile("garbage", events)]), ModelInference()], ScriptedModel(turns)
    )
    (result,) = results(session)
    assert (result.content, result.is_error) == ("hi", False)
    assert session.conversation[-1].text == "done"


async def test_a_huge_garbage_line_is_survived(events: Path) -> None:
    turns = [call(("echo", {"text": "after"})), reply("done")]
    session = await run(
        [McpTools([hostile("huge_line", events, timeout=20)]), ModelInference()],
        ScriptedModel(turns),
    )
    (result,) = results(session)
    assert result.content == "after"
    assert session.conversation[-1].text == "done"


async def test_a_malformed_call_result_is_an_error_result(events: Path) -> None:
    turns = [call(("echo", {"text": "x"})), reply("done")]
    session = await run(
        [McpTools([hostile("bad_result", events, timeout=10)]), ModelInference()],
        ScriptedModel(turns),
    )
    (result,) = results(session)
    assert result.is_error
    assert "not an MCP tool result" in result.content
    assert session.conversation[-1].text == "done"


async def test_a_huge_json_rpc_error_is_cut_short_in_the_result(events: Path) -> None:
    turns = [call(("echo", {"text": "x"})), reply("done")]
    session = await run(
        [McpTools([hostile("error_response", events)]), ModelInference()], ScriptedModel(turns)
    )
    (result,) = results(session)
    assert result.is_error
    assert len(result.content) < 2_000


# -- starting ------------------------------------------------------------------------


async def test_a_server_that_never_answers_initialize_costs_connect_timeout(
    events: Path,
) -> None:
    model = ScriptedModel([call(("echo", {"text": "x"})), reply("fine")])
    session = await run(
        [McpTools([hostile("no_init", events, connect_timeout=1.0)]), ModelInference()], model
    )
    assert model.requests[0].tools == ()
    assert session.conversation[-1].text == "fine"
    assert await all_gone(pids(events))


@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_a_server_that_exits_while_listing_leaves_the_run_going(events: Path) -> None:
    """(On asyncio the restart under way when the run ends leaves a ResourceWarning,
    'subprocess N is still running': collected here so it is not blamed on the next test.)"""
    model = ScriptedModel([reply("fine")])
    session = await run([McpTools([hostile("exit_on_list", events)]), ModelInference()], model)
    assert model.requests[0].tools == ()
    assert session.conversation[-1].text == "fine"
    gc.collect()


async def test_thousands_of_tools_with_big_schemas_are_listed(events: Path) -> None:
    model = ScriptedModel([call(("t2999", {"text": "last"})), reply("fine")])
    session = await run([McpTools([hostile("many_tools", events)]), ModelInference()], model)
    assert len(model.requests[0].tools) == 3000
    (result,) = results(session)
    assert result.content == "last"


async def test_a_server_listing_one_name_twice_does_not_crash_the_run(events: Path) -> None:
    model = ScriptedModel([call(("echo", {"text": "x"})), reply("fine")])
    session = await run([McpTools([hostile("dup_names", events)]), ModelInference()], model)
    assert session.conversation[-1].text == "fine"


VALID_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@pytest.mark.parametrize("mode", ["empty_name", "odd_name"])
async def test_a_tool_name_models_refuse_is_not_advertised(events: Path, mode: str) -> None:
    model = ScriptedModel([call(("echo", {"text": "x"})), reply("fine")])
    session = await run([McpTools([hostile(mode, events)]), ModelInference()], model)
    names = [t.name for t in model.requests[0].tools]
    assert "echo" in names
    assert all(VALID_NAME.match(n) for n in names), names
    (result,) = results(session)
    assert result.content == "x"


async def test_a_list_changed_storm_does_not_stall_calls(events: Path) -> None:
    turns = [call(("echo", {"text": "1"})), call(("echo", {"text": "2"})), reply("done")]
    session = await run(
        [McpTools([hostile("notify_loop", events)]), ModelInference()], ScriptedModel(turns)
    )
    assert [r.content for r in results(session)] == ["1", "2"]


async def test_a_list_change_that_makes_a_clash_mid_run_does_not_crash_the_run(
    events: Path,
) -> None:
    """Two servers fine at start; one later lists a name the other has: not a crashed run."""
    seen: list[int] = []

    def model(request: ModelRequest) -> ModelResponse:
        seen.append(len(seen))
        last = request.messages[-1]
        if last.role == "user":
            return call(("grow", {}))
        if len(seen) < 6:
            return call(("echo", {"text": "wait"}))
        return reply("survived")

    servers = [hostile("clash_later", events, name="a"), hostile("shared", events, name="b")]
    session = await run([McpTools(servers), ModelInference()], FunctionModel(model))
    assert session.conversation[-1].text == "survived"


# -- crashes and cancellation ----------------------------------------------------------


# The server this test crashes is gone when the run returns (no process is left: checked
# with kill(pid, 0)), but on asyncio its exit can reach the event loop only after anyio's
# runner closed that loop, at the switch to the trio variant: asyncio then warns "Loop ...
# that handles pid ... is closed" and the Popen object, which never saw its returncode,
# raises a ResourceWarning when collected, in the next test's setup. Known and left: the
# crashed connection's shutdown does not wait for the loop to see the exit.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_crash_in_a_parallel_batch_answers_every_call_once(tmp_path: Path) -> None:
    turns = [
        call(("record", {"note": "n1", "delay": 1.0}), ("crash", {}), ("echo", {"text": "e"})),
        reply("done"),
    ]
    mcp = McpTools([fixture_server(tmp_path)], max_concurrency=8)
    session = await run([mcp, ModelInference()], ScriptedModel(turns))
    got = results(session)
    assert len(got) == 3
    assert len({r.call_id for r in got}) == 3
    by_name = {r.name: r for r in got}
    assert by_name["crash"].is_error
    # The non-idempotent record ran at most once, whatever its answer.
    assert len(lines(tmp_path / "ledger.txt")) <= 1
    assert session.conversation[-1].text == "done"
    kill_all(pids(tmp_path / "events.txt"))


@pytest.mark.parametrize("when", [0.2, 1.5])
async def test_cancelling_during_connect_ends_cleanly_and_stops_the_server(
    events: Path, when: float
) -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    machine = StateMachine(
        [McpTools([hostile("no_init", events, connect_timeout=30)]), ModelInference()]
    )
    runtime = Runtime(store=store, model=ScriptedModel([reply("x")]))
    with anyio.fail_after(BOUND):
        with anyio.move_on_after(when) as scope:
            await machine.run(runtime, "s")
    assert scope.cancelled_caught
    assert await all_gone(pids(events))


async def test_cancelling_during_a_restart_ends_cleanly(tmp_path: Path) -> None:
    """A crash, then a cancel while the next call waits for the server to start again."""
    events = tmp_path / "events.txt"
    turns = [call(("crash", {})), call(("hang", {})), reply("x")]
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    machine = StateMachine([McpTools([fixture_server(tmp_path)]), ModelInference()])
    runtime = Runtime(store=store, model=ScriptedModel(turns))
    with anyio.fail_after(BOUND):
        with anyio.move_on_after(4) as scope:
            await machine.run(runtime, "s")
    assert scope.cancelled_caught
    assert await all_gone(pids(events))


async def test_an_error_in_the_run_during_connect_propagates_as_itself(events: Path) -> None:
    """A failure of another step while a server is still connecting is not an ExceptionGroup."""

    class BoomError(Exception):
        pass

    def model(request: ModelRequest) -> ModelResponse:
        raise BoomError("model down")

    servers = [
        hostile("plain", events, name="a"),
        hostile("no_init", events, name="b", connect_timeout=1),
    ]
    with pytest.raises(BoomError):
        await run([McpTools(servers), ModelInference()], FunctionModel(model))
    assert await all_gone(pids(events))


async def test_concurrent_runs_share_one_opening(tmp_path: Path) -> None:
    events = tmp_path / "events.txt"
    done: dict[str, str] = {}
    async with McpTools([fixture_server(tmp_path)]) as mcp:

        async def one(sid: str) -> None:
            turns = [call(("echo", {"text": sid}), ("pid", {})), reply(sid)]
            session = await run([mcp, ModelInference()], ScriptedModel(turns), sid)
            done[sid] = next(r.content for r in results(session) if r.name == "echo")

        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tg:
                for i in range(5):
                    tg.start_soon(one, f"s{i}")
    assert done == {f"s{i}": f"s{i}" for i in range(5)}
    assert len(pids(events)) == 1
    assert await all_gone(pids(events))


async def test_a_crash_in_one_shared_run_does_not_break_another(tmp_path: Path) -> None:
    async with McpTools([fixture_server(tmp_path)]) as mcp:
        crashing = [call(("crash", {})), reply("a")]
        await run([mcp, ModelInference()], ScriptedModel(crashing), "a")
        session = await run(
            [mcp, ModelInference()], ScriptedModel([call(("echo", {"text": "b"})), reply("b")]), "b"
        )
        (result,) = results(session)
        assert (result.content, result.is_error) == ("b", False)
    assert await all_gone(pids(tmp_path / "events.txt"))


# -- secrets ---------------------------------------------------------------------------


class _Refuse(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = b'{"error": "denied"}'
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST  # noqa: N815
    do_DELETE = do_POST  # noqa: N815

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def refusing_server() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


async def test_secrets_in_url_and_headers_stay_out_of_logs_and_results(
    refusing_server: int, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"http://alice:PW-S3CRET@127.0.0.1:{refusing_server}/mcp?token=Q-S3CRET"
    server = McpHttp(
        url=url, headers={"Authorization": "Bearer H-S3CRET"}, name="remote", connect_timeout=5
    )
    model = ScriptedModel([call(("anything", {})), reply("fine")])
    caplog.set_level(logging.DEBUG, logger="stepmachine")
    with structlog.testing.capture_logs() as captured:
        session = await run([McpTools([server]), ModelInference()], model)
    texts = [repr(e) for e in captured] + [r.getMessage() for r in caplog.records]
    texts += [r.content for r in results(session)]
    leaked = [t for t in texts if "PW-S3CRET" in t or "H-S3CRET" in t]
    assert leaked == []
    assert session.conversation[-1].text == "fine"


async def test_a_query_token_in_the_url_stays_out_of_logs(
    refusing_server: int, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"http://127.0.0.1:{refusing_server}/mcp?api_key=Q-S3CRET"
    server = McpHttp(url=url, name="remote", connect_timeout=5)
    caplog.set_level(logging.DEBUG, logger="stepmachine")
    with structlog.testing.capture_logs() as captured:
        await run([McpTools([server]), ModelInference()], ScriptedModel([reply("fine")]))
    texts = [repr(e) for e in captured] + [r.getMessage() for r in caplog.records]
    assert [t for t in texts if "Q-S3CRET" in t] == []


async def test_a_slow_http_server_costs_connect_timeout_not_more() -> None:
    """A port that accepts and never answers: the run goes on after connect_timeout."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    try:
        server = McpHttp(url=f"http://127.0.0.1:{port}/mcp", name="slow", connect_timeout=2)
        model = ScriptedModel([reply("fine")])
        started = time.monotonic()
        session = await run([McpTools([server]), ModelInference()], model)
        assert session.conversation[-1].text == "fine"
        assert time.monotonic() - started < BOUND
    finally:
        listener.close()


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
        mcp = McpTools([McpStdio(command=sys.executable, args=[server, "stdio"], name="fx",
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


# -- secrets in error results from a live HTTP server ------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def http_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The SDK fixture server over streamable HTTP on a loopback port (no token)."""
    ledger = tmp_path_factory.mktemp("review-http") / "ledger.txt"
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, str(SERVER), "http", str(port)],
        env={**os.environ, "MCP_LEDGER": str(ledger)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the MCP HTTP server did not start") from None
                time.sleep(0.05)
        yield f"127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def test_userinfo_stays_out_of_error_results(http_url: str) -> None:
    server = McpHttp(url=f"http://alice:PW-S3CRET@{http_url}", name="remote")
    turns = [call(("big", {"chars": 500})), reply("done")]
    session = await run(
        [McpTools([server], max_result_chars=100), ModelInference()], ScriptedModel(turns)
    )
    (result,) = results(session)
    assert result.is_error
    assert "remote" in result.content  # the error names the server
    assert "PW-S3CRET" not in result.content


async def test_a_key_in_the_url_query_stays_out_of_error_results(http_url: str) -> None:
    server = McpHttp(url=f"http://{http_url}?api_key=Q-S3CRET", name="remote")
    turns = [call(("big", {"chars": 500})), reply("done")]
    session = await run(
        [McpTools([server], max_result_chars=100), ModelInference()], ScriptedModel(turns)
    )
    (result,) = results(session)
    assert result.is_error
    assert "Q-S3CRET" not in result.content


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


async def test_a_server_ignoring_sigterm_and_its_child_are_stopped_with_the_run(
    events: Path,
) -> None:
    turns = [call(("echo", {"text": "x"})), reply("done")]
    session = await run(
        [McpTools([hostile("stubborn", events)]), ModelInference()], ScriptedModel(turns)
    )
    assert results(session)[0].content == "x"
    started = pids(events)
    assert len(started) == 2  # the server and its child
    assert await all_gone(started)


async def test_cancelling_a_run_with_a_stubborn_server_mid_call_stops_it(events: Path) -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    # The model calls echo again and again: the run is cancelled between calls or during one.
    machine = StateMachine([McpTools([hostile("stubborn", events)]), ModelInference()])

    def model(request: ModelRequest) -> ModelResponse:
        return call(("echo", {"text": "again"}))

    runtime = Runtime(store=store, model=FunctionModel(model))
    with anyio.fail_after(BOUND):
        with anyio.move_on_after(2) as scope:
            await machine.run(runtime, "s")
    assert scope.cancelled_caught
    assert await all_gone(pids(events))


async def test_an_error_in_a_shared_block_propagates_as_itself(tmp_path: Path) -> None:
    with anyio.fail_after(BOUND):
        with pytest.raises(ValueError, match="mine"):
            async with McpTools([fixture_server(tmp_path)]):
                raise ValueError("mine")
    assert await all_gone(pids(tmp_path / "events.txt"))


TWO_ENTERS = textwrap.dedent(
    """
    import sys, anyio
    from stepmachine import ConfigurationError
    from stepmachine.operations import McpStdio, McpTools

    async def main():
        mcp = McpTools([McpStdio(command=sys.executable, args=[sys.argv[1], "stdio"], name="fx",
                                 env={"MCP_EVENTS": sys.argv[2]})])
        outcomes = []

        async def enter():
            try:
                async with mcp:
                    await anyio.sleep(0.5)
                outcomes.append("opened")
            except ConfigurationError:
                outcomes.append("refused")

        async with anyio.create_task_group() as tg:
            tg.start_soon(enter)
            tg.start_soon(enter)
        print(" ".join(sorted(outcomes)))

    anyio.run(main, backend=sys.argv[3])
    """
)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_two_tasks_entering_one_mcp_tools_at_once_open_it_once(
    tmp_path: Path, backend: str
) -> None:
    events = tmp_path / "events.txt"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    argv = [sys.executable, "-c", TWO_ENTERS, str(SERVER), str(events), backend]
    errors = tmp_path / "stderr.txt"
    with errors.open("wb") as err:
        process = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=err, start_new_session=True
        )
    try:
        out, _ = process.communicate(timeout=40)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        out = b"<hung>"
    finally:
        kill_all(pids(events))
    assert out.decode().split() == ["opened", "refused"], errors.read_text()[-1500:]
    assert len(pids(events)) == 1


# -- hardening 2: server errors, clashes with local tools, media limits, secrets ------------


async def test_a_servers_own_error_minus_32000_is_its_message_not_a_closed_connection(
    events: Path,
) -> None:
    """-32000 is also the SDK's code for a closed connection: the server is alive here."""
    turns = [call(("echo", {"text": "x"})), reply("done")]
    session = await run(
        [McpTools([hostile("server_error", events)]), ModelInference()], ScriptedModel(turns)
    )
    (result,) = results(session)
    assert result.is_error
    assert "quota exceeded: try again tomorrow" in result.content
    assert "outcome is unknown" not in result.content
    assert len(pids(events)) == 1  # not taken for a crash: not started again
    assert session.conversation[-1].text == "done"


async def test_a_list_change_adding_a_local_tools_name_leaves_it_out_and_logs_it(
    events: Path,
) -> None:
    """A server cannot stop a running agent by listing a name a local tool has."""

    def shared() -> str:
        """The local tool named like the server's later one."""
        return "the local shared"

    requests: list[ModelRequest] = []

    def model(request: ModelRequest) -> ModelResponse:
        requests.append(request)
        last = request.messages[-1]
        if last.role == "user":
            return call(("grow", {}))
        if len(requests) < 6:
            return call(("echo", {"text": "wait"}))  # the new list comes in the background
        if last.tool_results[0].name != "shared":
            return call(("shared", {}))
        return reply(last.tool_results[0].content)

    steps = [McpTools([hostile("clash_later", events)]), Tools([shared]), ModelInference()]
    with structlog.testing.capture_logs() as captured:
        session = await run(steps, FunctionModel(model))
    assert session.conversation[-1].text == "the local shared"
    assert [d.name for d in requests[-1].tools].count("shared") == 1
    notes = [str(e) for e in captured if e.get("event") == "mcp_catalog"]
    assert any("'shared'" in n and "left out" in n for n in notes), notes


async def test_a_local_tools_name_listed_when_the_servers_open_is_a_configuration_error(
    events: Path,
) -> None:
    """A clash there from the start is a configuration mistake, found before any model call."""

    def echo(text: str) -> str:
        """A local echo."""
        return text

    model = ScriptedModel([])
    with pytest.raises(ConfigurationError, match="'echo' is advertised by both"):
        await run([McpTools([hostile("plain", events)]), Tools([echo]), ModelInference()], model)
    assert model.requests == []


async def test_an_image_over_max_media_bytes_from_a_server_is_an_error_result(
    tmp_path: Path,
) -> None:
    store = MemoryStore(max_media_bytes=8)  # the fixture's image holds 16 bytes
    await store.create("s", conversation=[Message.user("go", id="u1")])
    model = ScriptedModel([call(("image", {})), reply("done")])
    machine = StateMachine([McpTools([fixture_server(tmp_path)]), ModelInference()])
    with anyio.fail_after(BOUND):
        session = await machine.run(Runtime(store=store, model=model), "s")
    (result,) = results(session)
    assert result.is_error
    assert "max_media_bytes" in result.content
    assert "16 bytes" in result.content
    assert [p for m in session.conversation for p in m.parts if isinstance(p, ImagePart)] == []
    assert session.conversation[-1].text == "done"


async def test_an_image_over_max_media_bytes_from_a_local_tool_is_an_error_result() -> None:
    def picture() -> ToolOutput:
        """A picture too large for the store."""
        return ToolOutput("a picture", [ImagePart(media_type="image/png", data=b"p" * 100)])

    store = MemoryStore(max_media_bytes=10)
    await store.create("s", conversation=[Message.user("go", id="u1")])
    model = ScriptedModel([call(("picture", {}), ("picture", {})), reply("done")])
    machine = StateMachine([Tools([picture]), ModelInference()])
    session = await machine.run(Runtime(store=store, model=model), "s")
    found = results(session)
    assert len(found) == 2  # one result per call
    assert all(r.is_error and "max_media_bytes" in r.content for r in found)
    assert all("10 bytes" in r.content for r in found)
    assert session.conversation[-1].text == "done"


SECRET = "tok-S3CRET-4242"


async def test_a_server_echoing_its_environment_stores_no_secret(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    server = fixture_server(tmp_path)
    server = McpStdio(
        command=server.command,
        args=server.args,
        env={**(server.env or {}), "FX_TOKEN": SECRET, "MCP_SAY": f"token {SECRET}"},
        name="fx",
    )
    turns = [call(("getenv", {"name": "FX_TOKEN"})), call(("fail", {"why": SECRET})), reply("ok")]
    with structlog.testing.capture_logs() as captured:
        session = await run([McpTools([server]), ModelInference()], ScriptedModel(turns))
    got, failed = results(session)
    assert (got.content, got.is_error) == ("[redacted]", False)
    assert failed.is_error
    assert SECRET not in failed.content
    err = capfd.readouterr().err
    assert SECRET not in err  # the server's stderr is not the agent's
    said = [e for e in captured if e.get("event") == "mcp_stderr"]
    assert any(e["line"] == "starting with [redacted]" for e in said), captured
    assert [e for e in captured if SECRET in repr(e)] == []


async def test_a_result_over_max_message_bytes_is_not_read_and_the_server_goes_on(
    tmp_path: Path,
) -> None:
    turns = [call(("big", {"chars": 2_000_000})), call(("echo", {"text": "after"})), reply("ok")]
    mcp = McpTools([fixture_server(tmp_path)], max_message_bytes=65_536)
    session = await run([mcp, ModelInference()], ScriptedModel(turns))
    big, after = results(session)
    assert big.is_error
    assert "longer than 65,536 bytes" in big.content
    assert "xxxx" not in big.content
    assert (after.content, after.is_error) == ("after", False)
    assert len(pids(tmp_path / "events.txt")) == 1  # the same server, not a restart


def test_the_stdio_reader_holds_no_more_than_the_bound_of_a_long_line() -> None:
    from stepmachine.operations._mcp_stdio import split_lines

    lines = split_lines(1_000)
    head = b'{"jsonrpc": "2.0", "id": 7, "result": {"content": [{"text": "'
    assert lines.feed(head) == []
    held = []
    for _ in range(500):  # half a megabyte of one line, in reads of 1,000 bytes
        assert lines.feed(b"x" * 1_000) == []
        held.append(lines.held)
    assert max(held) <= 2_000  # the bound and one read, never the line
    ((first, over),) = lines.feed(b'"}]}}\n{"id": 8}\n'[:6])
    assert over
    assert first.startswith(head)
    assert lines.feed(b'{"id": 8}\n') == [(b'{"id": 8}', False)]
