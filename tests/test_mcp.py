"""McpTools against real MCP servers.

Every server here is a real process: stdio servers started by McpTools, an
HTTP server started by the test on a loopback port. Each async test runs on
asyncio and trio. The tests of what the SDK's own server does (its schemas,
its results, its list changes, its HTTP transport) use tests/fixtures/mcp_server.py,
written with the SDK; the tests of McpTools itself (its journal, restarts,
cancellation, limits, governance) use tests/fixtures/mcp_light_server.py, the
same tools in plain JSON-RPC, which starts in milliseconds where the SDK's server
spends a second or more importing the SDK.
"""

from __future__ import annotations

import base64
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
from hypothesis import given
from hypothesis import strategies as st
from mcp.types import (
    AudioContent,
    BlobResourceContents,
    CallToolResult,
    EmbeddedResource,
    ImageContent,
    TextContent,
)

from stepmachine import (
    ConfigurationError,
    DocumentPart,
    ImagePart,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    StateMachine,
    ToolContext,
    ToolError,
    ToolOutput,
    ToolResultPart,
    Tools,
)
from stepmachine.operations import Approval, McpHttp, McpStdio, McpTools, approve
from stepmachine.operations._mcp_tool import McpTool, result_output, result_text
from stepmachine.stores import MemoryStore
from stepmachine.testing import FunctionModel, ScriptedModel, call, reply

SERVER = Path(__file__).parent / "fixtures" / "mcp_server.py"
LIGHT = Path(__file__).parent / "fixtures" / "mcp_light_server.py"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    return {"ledger": tmp_path / "ledger.txt", "events": tmp_path / "events.txt"}


def stdio(files: dict[str, Path], **kwargs: Any) -> McpStdio:
    env = {"MCP_LEDGER": str(files["ledger"]), "MCP_EVENTS": str(files["events"])}
    kwargs.setdefault("name", "fx")
    return McpStdio(command=sys.executable, args=[str(SERVER), "stdio"], env=env, **kwargs)


def light(files: dict[str, Path], **kwargs: Any) -> McpStdio:
    """The light server (the same tools, no SDK) with the ledger and events of ``files``."""
    env = {"MCP_LEDGER": str(files["ledger"]), "MCP_EVENTS": str(files["events"])}
    env.update(kwargs.pop("env", {}))
    kwargs.setdefault("name", "fx")
    return McpStdio(command=sys.executable, args=[str(LIGHT)], env=env, **kwargs)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def results(session: Any) -> list[ToolResultPart]:
    return [r for m in session.conversation for r in m.tool_results]


async def run(steps: list[Any], model: Any, text: str = "go") -> tuple[Any, MemoryStore]:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user(text, id="u1")])
    machine = StateMachine(steps)
    session = await machine.run(Runtime(store=store, model=model), "s")
    return session, store


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def started_pids(files: dict[str, Path]) -> list[int]:
    return [int(x.split()[1]) for x in lines(files["events"]) if x.startswith("start ")]


# -- listing -------------------------------------------------------------------------


async def test_lists_tools_with_their_schemas_and_side_effect_classes(
    files: dict[str, Path],
) -> None:
    server = stdio(files, side_effects={"record": "idempotent"}, trust_annotations=True)
    async with McpTools([server]) as mcp:
        definitions = {d.name: d for d in mcp.tools(None)}  # type: ignore[arg-type]
        assert {"echo", "add", "record", "crash", "hang", "grow"} <= set(definitions)
        assert definitions["echo"].description == "Say the text back."
        assert definitions["add"].parameters["required"] == ["a", "b"]
        assert definitions["add"].parameters["properties"]["a"]["type"] == "integer"
        # readOnlyHint -> pure; idempotentHint -> idempotent; no hint -> configuration.
        assert mcp.side_effects("echo") == "pure"
        assert mcp.side_effects("add") == "idempotent"
        assert mcp.side_effects("record") == "idempotent"
        assert mcp.side_effects("crash") == "non_idempotent"
        assert mcp.side_effects("nope") is None


@pytest.mark.parametrize("trust", [{}, {"trust_annotations": False}])
async def test_untrusted_annotations_leave_the_class_to_configuration(
    files: dict[str, Path], trust: dict[str, bool]
) -> None:
    """Untrusted is the default: a server's hints never lower a tool's class."""
    server = light(files, side_effects={"add": "pure"}, **trust)
    async with McpTools([server]) as mcp:
        mcp.tools(None)  # type: ignore[arg-type]
        assert mcp.side_effects("echo") == "non_idempotent"  # its readOnlyHint is ignored
        assert mcp.side_effects("liar") == "non_idempotent"  # so is a false one
        assert mcp.side_effects("add") == "pure"


async def test_namespace_prefixes_each_server_and_a_clash_is_a_configuration_error(
    files: dict[str, Path], tmp_path: Path
) -> None:
    a, b = light(files, name="a"), light(files, name="b")
    model = ScriptedModel([])  # never called: the clash stops the run first
    with pytest.raises(ConfigurationError, match="'echo' is given by both"):
        await run([McpTools([a, b]), ModelInference()], model)
    assert model.requests == []
    async with McpTools([a, b], namespace=True) as mcp:
        names = {d.name for d in mcp.tools(None)}  # type: ignore[arg-type]
        assert {"a__echo", "b__echo"} <= names
        assert "echo" not in names
    async with McpTools([light(files, prefix="files_")]) as mcp:
        assert "files_echo" in {d.name for d in mcp.tools(None)}  # type: ignore[arg-type]


# -- calling -------------------------------------------------------------------------


async def test_calls_map_text_structured_content_images_and_errors(
    files: dict[str, Path],
) -> None:
    turns = [
        call(
            ("echo", {"text": "hi"}),
            ("add", {"a": 2, "b": 3}),
            ("image", {}),
            ("fail", {"why": "no disk"}),
            ("add", {"a": "x", "b": 1}),
            ("nope", {}),
        ),
        reply("done"),
    ]
    model = ScriptedModel(turns)
    session, _ = await run([McpTools([stdio(files)]), ModelInference()], model)
    got = {r.call_id: r for r in results(session)}
    by_call = [got[c.call_id] for m in session.conversation for c in m.tool_calls]
    echo, add, image, fail, bad, nope = by_call
    assert (echo.content, echo.is_error) == ("hi", False)
    assert not add.is_error
    assert '"total": 5' in add.content
    assert image.content == "[image follows: image/png, 16 bytes]"
    (stored_image,) = next(
        m.result_media(image.call_id) for m in session.conversation if image in m.tool_results
    )
    assert stored_image == ImagePart(
        media_type="image/png", data=base64.b64decode("iVBORw0KGgoAAAANSUhEUg==")
    )
    assert (fail.content, fail.is_error) == ("Error executing tool fail: cannot: no disk", True)
    assert bad.is_error
    assert "validation error" in bad.content
    assert nope.is_error
    assert nope.content.startswith("unknown tool 'nope'")
    # The model's second request saw every result and the tools.
    assert {"echo", "add"} <= {t.name for t in model.requests[1].tools}
    assert session.conversation[-1].text == "done"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_result_blocks_become_text_and_media_parts() -> None:
    png, pdf = b"\x89PNG\r\n\x1a\n-pixels", b"%PDF-1.4 pages"
    blob = "file:///r/report.pdf"
    result = CallToolResult(
        content=[
            TextContent(type="text", text="the chart"),
            ImageContent(type="image", data=_b64(png), mime_type="image/png"),
            EmbeddedResource(
                type="resource",
                resource=BlobResourceContents(
                    uri=blob, mime_type="application/pdf", blob=_b64(pdf)
                ),
            ),
            EmbeddedResource(
                type="resource",
                resource=BlobResourceContents(
                    uri="file:///r/a.gif", mime_type="image/gif", blob=_b64(b"GIF89a")
                ),
            ),
            EmbeddedResource(
                type="resource",
                resource=BlobResourceContents(
                    uri="file:///r/x.bin", mime_type="application/zip", blob=_b64(b"PK")
                ),
            ),
            AudioContent(type="audio", data=_b64(b"RIFF"), mime_type="audio/wav"),
            ImageContent(type="image", data="not base64!", mime_type="image/png"),
            ImageContent(type="image", data=_b64(png), mime_type="text/plain"),  # not an image
        ]
    )
    output = result_output(result)
    assert output.media == (
        ImagePart(media_type="image/png", data=png),
        DocumentPart(media_type="application/pdf", data=pdf, title=blob),
        ImagePart(media_type="image/gif", data=b"GIF89a"),
    )
    assert output.text.splitlines() == [
        "the chart",
        "[resource file:///r/x.bin: application/zip, 2 bytes; not shown]",
        "[audio: audio/wav, 4 bytes; not shown]",
        "[image: image/png, undecodable base64; not shown]",
        f"[image: text/plain, {len(png)} bytes; not shown]",
    ]
    assert result_text(result) == output.text
    only_image = CallToolResult(
        content=[ImageContent(type="image", data=_b64(png), mime_type="image/png")]
    )
    assert result_output(only_image) == ToolOutput(
        "", (ImagePart(media_type="image/png", data=png),)
    )
    assert result_text(only_image) == f"[image follows: image/png, {len(png)} bytes]"


async def test_an_error_result_names_its_images_and_stores_none() -> None:
    class _Link:
        server = McpStdio(command="unused", name="fx")

        async def call(self, name: str, arguments: Any, meta: Any) -> CallToolResult:
            return CallToolResult(
                content=[
                    TextContent(type="text", text="render failed"),
                    ImageContent(type="image", data=_b64(b"\x89PNG"), mime_type="image/png"),
                ],
                is_error=True,
            )

    tool = McpTool(
        name="draw",
        remote_name="draw",
        definition=None,  # type: ignore[arg-type]
        side_effects="pure",
        timeout=None,
        link=_Link(),  # type: ignore[arg-type]
        max_result_chars=10_000,
    )
    context = ToolContext(runtime=Runtime(), session_id="s", call_id="c", idempotency_key="k")
    with pytest.raises(ToolError) as raised:
        await tool.call({}, context)
    assert str(raised.value) == "render failed\n[image: image/png, 4 bytes; not shown]"


async def test_non_object_arguments_are_an_invalid_call_error(files: dict[str, Path]) -> None:
    from stepmachine import ToolCallPart

    turns = [call(ToolCallPart.parse("c1", "echo", "[1, 2]")), reply("ok")]
    session, _ = await run([McpTools([light(files)]), ModelInference()], ScriptedModel(turns))
    (result,) = results(session)
    assert result.is_error
    assert "must be a JSON object" in result.content


async def test_each_call_carries_its_idempotency_key(files: dict[str, Path]) -> None:
    turns = [call(("record", {"note": "n1"})), reply("ok")]
    session, _ = await run([McpTools([stdio(files)]), ModelInference()], ScriptedModel(turns))
    (line,) = lines(files["ledger"])
    note, key, _ = line.split("\t")
    assert note == "n1"
    journal = next(c for m in session.conversation for c in m.tool_calls).notes["journal"]
    assert key == journal["idempotency_key"]
    assert key.startswith("sm-")


async def test_parallel_calls_run_at_once(files: dict[str, Path]) -> None:
    turns = [
        call(*[("slow", {"seconds": 0.5, "label": str(i)}) for i in range(3)]),
        reply("ok"),
    ]
    session, _ = await run([McpTools([light(files)]), ModelInference()], ScriptedModel(turns))
    assert [r.content for r in results(session)] != []
    order = [x.split("\t")[0].split()[0] for x in lines(files["ledger"])]
    # All three started before any ended: they overlapped at the server.
    assert order == ["start"] * 3 + ["end"] * 3, order
    assert sorted(r.content for r in results(session)) == ["slept 0", "slept 1", "slept 2"]


async def test_too_long_a_result_is_an_error_result_not_stored(files: dict[str, Path]) -> None:
    turns = [call(("big", {"chars": 5000})), reply("ok")]
    mcp = McpTools([light(files)], max_result_chars=1000)
    session, _ = await run([mcp, ModelInference()], ScriptedModel(turns))
    (result,) = results(session)
    assert result.is_error
    assert "5,000 characters" in result.content
    assert "xxxx" not in result.content


# -- governance ----------------------------------------------------------------------


async def test_approval_holds_an_mcp_call_until_a_person_approves(files: dict[str, Path]) -> None:
    def model(request: ModelRequest) -> ModelResponse:
        if request.messages[-1].role == "user":
            return call(("record", {"note": "pay"}))
        return reply(f"result: {request.messages[-1].tool_results[0].content}")

    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    steps = [Approval(["record"]), McpTools([light(files)]), ModelInference()]
    machine = StateMachine(steps)
    runtime = Runtime(store=store, model=FunctionModel(model))
    report = await machine.run_report(runtime, "s")
    assert report.reason.kind == "awaiting_approval"
    assert lines(files["ledger"]) == []  # nothing ran
    (pending,) = report.reason.data["calls"]
    await approve(store, "s", pending["call_id"], by="ana", reason="ok")
    session = await machine.run(runtime, "s")
    assert len(lines(files["ledger"])) == 1
    assert session.conversation[-1].text == "result: recorded pay"


# -- faults --------------------------------------------------------------------------


async def test_a_crash_mid_call_is_an_error_result_and_the_server_starts_again(
    files: dict[str, Path],
) -> None:
    turns = [call(("pid", {})), call(("crash", {})), call(("pid", {})), reply("done")]
    session, _ = await run([McpTools([light(files)]), ModelInference()], ScriptedModel(turns))
    first, crashed, second = results(session)
    assert crashed.is_error
    assert "closed the connection during the call" in crashed.content
    assert "outcome is unknown" in crashed.content
    assert not second.is_error
    assert second.content != first.content
    assert len(started_pids(files)) == 2
    assert session.conversation[-1].text == "done"


async def test_a_hang_hits_the_per_call_timeout_and_the_server_goes_on(
    files: dict[str, Path],
) -> None:
    turns = [call(("hang", {}), ("echo", {"text": "still here"})), reply("done")]
    mcp = McpTools([light(files, timeout=0.5)])
    started = time.monotonic()
    session, _ = await run([mcp, ModelInference()], ScriptedModel(turns))
    assert time.monotonic() - started < 30  # not the hour the tool sleeps
    got = {r.name: r for r in results(session)}
    hang, echo = got["hang"], got["echo"]
    assert hang.is_error
    assert "timed out after 0.5 s" in hang.content
    assert (echo.content, echo.is_error) == ("still here", False)


async def test_a_server_that_does_not_start_leaves_the_run_going(tmp_path: Path) -> None:
    missing = McpStdio(command=str(tmp_path / "no-such-server"), name="missing")
    silent = McpStdio(
        command=sys.executable,
        args=["-c", "import time; time.sleep(60)"],
        name="silent",
        connect_timeout=0.5,
        stop_grace=0.1,  # it reads no stdin and waits out SIGTERM's grace: keep both short
    )
    model = ScriptedModel([call(("echo", {"text": "x"})), reply("no tools")])
    session, _ = await run([McpTools([missing, silent]), ModelInference()], model)
    assert model.requests[0].tools == ()  # neither server listed anything
    (result,) = results(session)
    assert result.is_error
    assert result.content.startswith("unknown tool 'echo'")
    assert session.conversation[-1].text == "no tools"


async def test_a_changed_tool_list_applies_from_a_later_cycle(files: dict[str, Path]) -> None:
    seen: list[set[str]] = []

    def model(request: ModelRequest) -> ModelResponse:
        names = {t.name for t in request.tools}
        seen.append(names)
        last = request.messages[-1]
        if last.role == "user":
            return call(("grow", {}))
        if "fresh" in names and not any(r.name == "fresh" for r in last.tool_results):
            return call(("fresh", {}))
        if last.tool_results and last.tool_results[0].name == "fresh":
            return reply(last.tool_results[0].content)
        if len(seen) > 10:
            return reply("the list never changed")
        return call(("echo", {"text": "wait"}))

    session, _ = await run([McpTools([stdio(files)]), ModelInference()], FunctionModel(model))
    assert "fresh" not in seen[0]
    assert any("fresh" in names for names in seen)
    assert session.conversation[-1].text == "fresh result"


async def test_the_tool_list_is_stable_within_a_cycle(files: dict[str, Path]) -> None:
    async with McpTools([light(files)]) as mcp:
        machine = StateMachine([mcp, ModelInference()])
        runtime = Runtime(store=MemoryStore(), model=ScriptedModel([]))
        async with machine.opened(runtime):
            before = mcp.tools(None)  # type: ignore[arg-type]  # the start of a cycle
            link = mcp._shared.links[0]  # type: ignore[union-attr]
            assert link.listing is not None
            link._publish(link.listing[:1])  # the server's list shrank meanwhile
            ctx: Any = None
            assert set(mcp._own_tools(ctx)) == {d.name for d in before}  # this cycle: as advertised
            after = mcp.tools(None)  # type: ignore[arg-type]  # the next cycle
            assert [d.name for d in after] == [link.listing[0].name]


# -- opening and closing ---------------------------------------------------------------


async def test_driving_steps_by_hand_needs_the_machine_opened(files: dict[str, Path]) -> None:
    machine = StateMachine([McpTools([light(files)]), ModelInference()])
    store = MemoryStore()
    session = await store.create("s", conversation=[Message.user("go", id="u1")])
    runtime = Runtime(store=store, model=ScriptedModel([reply("hi")]))
    with pytest.raises(ConfigurationError, match="is not open"):
        await machine.step(runtime, session)
    async with machine.opened(runtime):
        decision = await machine.step(runtime, session)
    assert decision is not None
    assert "echo" in {t.name for t in decision.ctx.tools}


async def test_a_run_stops_its_stdio_server_when_it_returns(files: dict[str, Path]) -> None:
    turns = [call(("pid", {})), reply("done")]
    session, _ = await run([McpTools([light(files)]), ModelInference()], ScriptedModel(turns))
    (pid,) = started_pids(files)
    assert results(session)[0].content == str(pid)
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:  # noqa: ASYNC110 - a process has no event
        await anyio.sleep(0.05)
    assert not _alive(pid)


async def test_shared_connections_serve_several_runs_with_one_process(
    files: dict[str, Path],
) -> None:
    async with McpTools([light(files)]) as mcp:
        for _ in range(2):
            turns = [call(("pid", {})), reply("done")]
            await run([mcp, ModelInference()], ScriptedModel(turns))
    assert len(started_pids(files)) == 1


async def test_an_error_in_the_run_propagates_as_itself(files: dict[str, Path]) -> None:
    class BoomError(Exception):
        pass

    def model(request: ModelRequest) -> ModelResponse:
        raise BoomError("model down")

    with pytest.raises(BoomError, match="model down"):
        await run([McpTools([light(files)]), ModelInference()], FunctionModel(model))


async def test_cancelling_a_run_mid_call_stops_the_server_and_answers_the_call(
    files: dict[str, Path],
) -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    machine = StateMachine([McpTools([light(files)]), ModelInference()])
    turns = [call(("record", {"note": "slow", "delay": 3600}))]
    runtime = Runtime(store=store, model=ScriptedModel(turns))
    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(machine.run, runtime, "s")
            while not lines(files["ledger"]):  # noqa: ASYNC110 - the call reached the server
                await anyio.sleep(0.02)
            tg.cancel_scope.cancel()
    (pid,) = started_pids(files)
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:  # noqa: ASYNC110 - a process has no event
        await anyio.sleep(0.05)
    assert not _alive(pid)
    stored = await store.load("s")
    (result,) = results(stored)
    assert result.is_error
    assert "interrupted" in result.content


def test_the_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mcp" else real(name, *a)
    )
    with pytest.raises(ConfigurationError, match=r"pip install 'stepmachine\[mcp\]'"):
        McpTools([McpStdio(command="x")])


def test_configuration_is_checked_and_secrets_stay_out_of_repr() -> None:
    with pytest.raises(ConfigurationError, match="non-empty"):
        McpStdio(command="")
    with pytest.raises(ConfigurationError, match="sequence of str"):
        McpStdio(command="x", args="--flag")
    with pytest.raises(ConfigurationError, match="http"):
        McpHttp(url="ftp://example.com/mcp")
    with pytest.raises(ConfigurationError, match="side_effects"):
        McpStdio(command="x", side_effects="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="unique"):
        McpTools([McpStdio(command="x"), McpStdio(command="x")])
    with pytest.raises(ConfigurationError, match="at least one"):
        McpTools([])
    secret = McpHttp(url="https://user:pw@example.com/mcp", headers={"Authorization": "Bearer S3"})
    stdio_secret = McpStdio(command="x", env={"API_KEY": "S3"})
    for text in (repr(secret), secret.describe(), repr(stdio_secret), stdio_secret.describe()):
        assert "S3" not in text
        assert "pw" not in text


@given(
    read_only=st.sampled_from([None, True, False]),
    idempotent=st.sampled_from([None, True, False]),
    destructive=st.sampled_from([None, True, False]),
    configured=st.sampled_from([None, "pure", "idempotent", "non_idempotent"]),
    trust=st.sampled_from([None, True, False]),  # None: the default
)
def test_side_effect_class_follows_annotations_then_configuration(
    read_only: bool | None,
    idempotent: bool | None,
    destructive: bool | None,
    configured: Any,
    trust: bool | None,
) -> None:
    from mcp.types import Tool, ToolAnnotations

    from stepmachine.operations._mcp_tool import side_effects_of

    hints = ToolAnnotations(
        read_only_hint=read_only, idempotent_hint=idempotent, destructive_hint=destructive
    )
    remote = Tool(name="t", input_schema={"type": "object"}, annotations=hints)
    chosen = {} if trust is None else {"trust_annotations": trust}
    server = McpStdio(command="x", side_effects=configured, **chosen)
    got = side_effects_of(remote, server)
    said = [h for h in (read_only, idempotent, destructive) if h is not None]
    if trust is True and read_only is True:
        assert got == "pure"
    elif trust is True and idempotent is True:
        assert got == "idempotent"
    elif trust is True and said:
        assert got == "non_idempotent"
    else:  # untrusted (the default): the configuration alone, whatever the hints say
        assert got == (configured or "non_idempotent")


# -- streamable HTTP -----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A streamable-HTTP server on a loopback port that wants ``Bearer t0ken``."""
    ledger = tmp_path_factory.mktemp("mcp-http") / "ledger.txt"
    port = _free_port()
    env = {**os.environ, "MCP_LEDGER": str(ledger)}
    process = subprocess.Popen(
        [sys.executable, str(SERVER), "http", str(port), "t0ken"],
        env=env,
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
        yield f"http://127.0.0.1:{port}/mcp", ledger
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def test_http_server_with_a_bearer_token(http_server: tuple[str, Path]) -> None:
    url, ledger = http_server
    before = len(lines(ledger))
    server = McpHttp(url=url, headers={"Authorization": "Bearer t0ken"}, name="remote")
    turns = [call(("record", {"note": "over http"}), ("whoami", {})), reply("done")]
    session, _ = await run([McpTools([server]), ModelInference()], ScriptedModel(turns))
    by_tool = {r.name: r for r in results(session)}  # the two calls finish in any order
    recorded, whoami = by_tool["record"], by_tool["whoami"]
    assert (recorded.content, recorded.is_error) == ("recorded over http", False)
    # The server saw the header (it answered record), but echoing it stores no secret.
    assert whoami.content == "[redacted]"
    assert len(lines(ledger)) == before + 1


async def test_http_server_refusing_a_wrong_token_is_an_error_result(
    http_server: tuple[str, Path],
) -> None:
    url, ledger = http_server
    before = len(lines(ledger))
    server = McpHttp(url=url, headers={"Authorization": "Bearer wrong-S3CRET"}, name="remote")
    turns = [call(("record", {"note": "nope"})), reply("done")]
    session, _ = await run([McpTools([server]), ModelInference()], ScriptedModel(turns))
    (result,) = results(session)
    assert result.is_error
    assert "bearer token" in result.content
    assert "S3CRET" not in result.content
    assert len(lines(ledger)) == before


async def test_an_unreachable_http_server_leaves_the_run_going() -> None:
    server = McpHttp(url=f"http://127.0.0.1:{_free_port()}/mcp", name="gone", connect_timeout=5)
    model = ScriptedModel([reply("fine")])
    session, _ = await run([McpTools([server]), ModelInference()], model)
    assert model.requests[0].tools == ()
    assert session.conversation[-1].text == "fine"


async def test_an_unreachable_http_servers_problem_and_logs_name_no_secret() -> None:
    import structlog

    server = McpHttp(
        url=f"http://user:hunter22@127.0.0.1:{_free_port()}/mcp",
        headers={"Authorization": "Bearer S3CRET-TOKEN"},
        name="gone",
        connect_timeout=5,
    )
    with structlog.testing.capture_logs() as logs:
        async with McpTools([server]) as mcp:
            status = mcp.status()["gone"]
    assert status.startswith("down: it failed")
    assert any(e.get("event") == "mcp_server" and e.get("state") == "down" for e in logs)
    text = repr(logs) + status
    assert "hunter22" not in text
    assert "S3CRET" not in text


def test_redact_removes_header_values_tokens_and_url_credentials() -> None:
    server = McpHttp(
        url="https://ana:pa55word@example.com/mcp", headers={"X-Key": "Bearer tok-123456"}
    )
    said = "401 for https://ana:pa55word@example.com/mcp with Bearer tok-123456 (tok-123456)"
    redacted = server.redact(said)
    assert "pa55word" not in redacted
    assert "tok-123456" not in redacted
    assert redacted.count("[redacted]") >= 3
    stdio_server = McpStdio(command="x", env={"API_KEY": "sk-live-abcdef"})
    assert stdio_server.redact("bad key sk-live-abcdef") == "bad key [redacted]"


async def test_invalid_arguments_are_caught_by_the_servers_schema_before_any_call(
    files: dict[str, Path],
) -> None:
    from stepmachine.operations import InvalidCalls

    def model(request: ModelRequest) -> ModelResponse:
        last = request.messages[-1]
        if len(request.messages) == 1:
            return call(("record", {"note": 42}))  # the schema wants a string
        if last.role == "tool":
            return reply("done")
        return call(("record", {"note": "fixed"}))  # after InvalidCalls' feedback

    steps = [InvalidCalls("retry"), McpTools([light(files)]), ModelInference()]
    session, _ = await run(steps, FunctionModel(model))
    notes = [x.split("\t")[0] for x in lines(files["ledger"])]
    assert notes == ["fixed"]  # the invalid call never reached the server
    feedback = session.conversation[2].text
    assert "invalid arguments for tool 'record': $.note: expected string" in feedback
    assert session.conversation[-1].text == "done"


async def test_a_tool_call_budget_governs_mcp_calls(files: dict[str, Path]) -> None:
    from stepmachine.operations import Budget, Limits

    turns = [call(("record", {"note": "a"}), ("record", {"note": "b"})), reply("done")]
    steps = [Budget(per_run=Limits(tool_calls=1)), McpTools([light(files)]), ModelInference()]
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    report = await StateMachine(steps).run_report(
        Runtime(store=store, model=ScriptedModel(turns)), "s"
    )
    assert [x.split("\t")[0] for x in lines(files["ledger"])] == ["a"]  # one call ran
    first, second = results(report.session)
    assert (first.content, first.is_error) == ("recorded a", False)
    assert second.is_error
    assert second.content.startswith("not executed: tool-call budget exhausted")
    assert report.reason.kind == "budget_exhausted"


FIXTURES = Path(__file__).parent / "fixtures"


HOSTILE = FIXTURES / "mcp_hostile_server.py"


SERVER_MCP = FIXTURES / "mcp_server.py"


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
    return McpStdio(command=sys.executable, args=[str(SERVER_MCP), "stdio"], env=env, **kwargs)


def light_server(tmp_path: Path, **kwargs: Any) -> McpStdio:
    return light({"ledger": tmp_path / "ledger.txt", "events": tmp_path / "events.txt"}, **kwargs)


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


async def all_gone(found: list[int]) -> bool:
    deadline = time.monotonic() + 15
    while any(alive(p) for p in found) and time.monotonic() < deadline:  # noqa: ASYNC110
        await anyio.sleep(0.05)
    return not any(alive(p) for p in found)


def kill_all(found: list[int]) -> None:
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def run_mcp(steps: list[Any], model: Any, sid: str = "s") -> Any:
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


async def test_garbage_lines_on_stdout_do_not_stop_the_tools(events: Path) -> None:
    turns = [call(("echo", {"text": "hi"})), reply("done")]
    session = await run_mcp(
        [McpTools([hostile("garbage", events)]), ModelInference()], ScriptedModel(turns)
    )
    (result,) = results(session)
    assert (result.content, result.is_error) == ("hi", False)
    assert session.conversation[-1].text == "done"


async def test_a_huge_garbage_line_is_survived(events: Path) -> None:
    turns = [call(("echo", {"text": "after"})), reply("done")]
    session = await run_mcp(
        [McpTools([hostile("huge_line", events, timeout=20)]), ModelInference()],
        ScriptedModel(turns),
    )
    (result,) = results(session)
    assert result.content == "after"
    assert session.conversation[-1].text == "done"


async def test_a_malformed_call_result_is_an_error_result(events: Path) -> None:
    turns = [call(("echo", {"text": "x"})), reply("done")]
    session = await run_mcp(
        [McpTools([hostile("bad_result", events, timeout=10)]), ModelInference()],
        ScriptedModel(turns),
    )
    (result,) = results(session)
    assert result.is_error
    assert "not an MCP tool result" in result.content
    assert session.conversation[-1].text == "done"


async def test_a_huge_json_rpc_error_is_cut_short_in_the_result(events: Path) -> None:
    turns = [call(("echo", {"text": "x"})), reply("done")]
    session = await run_mcp(
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
    session = await run_mcp(
        [McpTools([hostile("no_init", events, connect_timeout=0.5)]), ModelInference()], model
    )
    assert model.requests[0].tools == ()
    assert session.conversation[-1].text == "fine"
    assert await all_gone(pids(events))


@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_a_server_that_exits_while_listing_leaves_the_run_going(events: Path) -> None:
    """(On asyncio the restart under way when the run ends leaves a ResourceWarning,
    'subprocess N is still running': collected here so it is not blamed on the next test.)"""
    model = ScriptedModel([reply("fine")])
    session = await run_mcp([McpTools([hostile("exit_on_list", events)]), ModelInference()], model)
    assert model.requests[0].tools == ()
    assert session.conversation[-1].text == "fine"
    gc.collect()


async def test_thousands_of_tools_with_big_schemas_are_listed(events: Path) -> None:
    model = ScriptedModel([call(("t2999", {"text": "last"})), reply("fine")])
    session = await run_mcp([McpTools([hostile("many_tools", events)]), ModelInference()], model)
    assert len(model.requests[0].tools) == 3000
    (result,) = results(session)
    assert result.content == "last"


async def test_a_server_listing_one_name_twice_does_not_crash_the_run(events: Path) -> None:
    model = ScriptedModel([call(("echo", {"text": "x"})), reply("fine")])
    session = await run_mcp([McpTools([hostile("dup_names", events)]), ModelInference()], model)
    assert session.conversation[-1].text == "fine"


VALID_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@pytest.mark.parametrize("mode", ["empty_name", "odd_name"])
async def test_a_tool_name_models_refuse_is_not_advertised(events: Path, mode: str) -> None:
    model = ScriptedModel([call(("echo", {"text": "x"})), reply("fine")])
    session = await run_mcp([McpTools([hostile(mode, events)]), ModelInference()], model)
    names = [t.name for t in model.requests[0].tools]
    assert "echo" in names
    assert all(VALID_NAME.match(n) for n in names), names
    (result,) = results(session)
    assert result.content == "x"


async def test_a_list_changed_storm_does_not_stall_calls(events: Path) -> None:
    turns = [call(("echo", {"text": "1"})), call(("echo", {"text": "2"})), reply("done")]
    session = await run_mcp(
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
    session = await run_mcp([McpTools(servers), ModelInference()], FunctionModel(model))
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
    mcp = McpTools([light_server(tmp_path)], max_concurrency=8)
    session = await run_mcp([mcp, ModelInference()], ScriptedModel(turns))
    got = results(session)
    assert len(got) == 3
    assert len({r.call_id for r in got}) == 3
    by_name = {r.name: r for r in got}
    assert by_name["crash"].is_error
    # The non-idempotent record ran at most once, whatever its answer.
    assert len(lines(tmp_path / "ledger.txt")) <= 1
    assert session.conversation[-1].text == "done"
    kill_all(pids(tmp_path / "events.txt"))


@pytest.mark.parametrize("when", ["soon", "once_started"])
async def test_cancelling_during_connect_ends_cleanly_and_stops_the_server(
    events: Path, when: str
) -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    machine = StateMachine(
        [McpTools([hostile("no_init", events, connect_timeout=30)]), ModelInference()]
    )
    runtime = Runtime(store=store, model=ScriptedModel([reply("x")]))
    with anyio.fail_after(BOUND):
        async with anyio.create_task_group() as tg:
            tg.start_soon(machine.run, runtime, "s")
            if when == "soon":  # the process may not have started yet
                await anyio.sleep(0.2)
            else:  # it runs, and waits for an initialize it never answers
                while not pids(events):  # noqa: ASYNC110 - a process has no event
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    assert await all_gone(pids(events))


async def test_cancelling_during_a_restart_ends_cleanly(tmp_path: Path) -> None:
    """A crash, then a cancel while the next call waits for the server to start again."""
    events = tmp_path / "events.txt"
    turns = [call(("crash", {})), call(("hang", {})), reply("x")]
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    # Started again after the crash, the server waits before it answers initialize: the
    # cancel below lands while the restart is under way.
    server = light_server(tmp_path, env={"MCP_SLOW_RESTART": "300"})
    machine = StateMachine([McpTools([server]), ModelInference()])
    runtime = Runtime(store=store, model=ScriptedModel(turns))
    with anyio.fail_after(BOUND):
        async with anyio.create_task_group() as tg:
            tg.start_soon(machine.run, runtime, "s")
            while len(pids(events)) < 2:  # noqa: ASYNC110 - the restart has begun
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    assert any(x.startswith("crash ") for x in lines(events))
    assert await all_gone(pids(events))


async def test_an_error_in_the_run_during_connect_propagates_as_itself(events: Path) -> None:
    """A failure of another step while a server is still connecting is not an ExceptionGroup."""

    class BoomError(Exception):
        pass

    def model(request: ModelRequest) -> ModelResponse:
        raise BoomError("model down")

    servers = [
        hostile("plain", events, name="a"),
        hostile("no_init", events, name="b", connect_timeout=0.5),
    ]
    with pytest.raises(BoomError):
        await run_mcp([McpTools(servers), ModelInference()], FunctionModel(model))
    assert await all_gone(pids(events))


async def test_concurrent_runs_share_one_opening(tmp_path: Path) -> None:
    events = tmp_path / "events.txt"
    done: dict[str, str] = {}
    async with McpTools([light_server(tmp_path)]) as mcp:

        async def one(sid: str) -> None:
            turns = [call(("echo", {"text": sid}), ("pid", {})), reply(sid)]
            session = await run_mcp([mcp, ModelInference()], ScriptedModel(turns), sid)
            done[sid] = next(r.content for r in results(session) if r.name == "echo")

        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tg:
                for i in range(5):
                    tg.start_soon(one, f"s{i}")
    assert done == {f"s{i}": f"s{i}" for i in range(5)}
    assert len(pids(events)) == 1
    assert await all_gone(pids(events))


async def test_a_crash_in_one_shared_run_does_not_break_another(tmp_path: Path) -> None:
    async with McpTools([light_server(tmp_path)]) as mcp:
        crashing = [call(("crash", {})), reply("a")]
        await run_mcp([mcp, ModelInference()], ScriptedModel(crashing), "a")
        session = await run_mcp(
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
        session = await run_mcp([McpTools([server]), ModelInference()], model)
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
        await run_mcp([McpTools([server]), ModelInference()], ScriptedModel([reply("fine")]))
    texts = [repr(e) for e in captured] + [r.getMessage() for r in caplog.records]
    assert [t for t in texts if "Q-S3CRET" in t] == []


async def test_a_slow_http_server_costs_connect_timeout_not_more() -> None:
    """A port that accepts and never answers: the run goes on after connect_timeout."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    try:
        server = McpHttp(url=f"http://127.0.0.1:{port}/mcp", name="slow", connect_timeout=0.5)
        model = ScriptedModel([reply("fine")])
        started = time.monotonic()
        session = await run_mcp([McpTools([server]), ModelInference()], model)
        assert session.conversation[-1].text == "fine"
        assert time.monotonic() - started < BOUND
    finally:
        listener.close()


# -- secrets in error results from a live HTTP server ------------------------------------


@pytest.fixture(scope="module")
def http_url(http_server: tuple[str, Path]) -> str:
    """``http_server`` as host:port/path (its ``big`` tool wants no token)."""
    url, _ = http_server
    return url.removeprefix("http://")


async def test_userinfo_stays_out_of_error_results(http_url: str) -> None:
    server = McpHttp(url=f"http://alice:PW-S3CRET@{http_url}", name="remote")
    turns = [call(("big", {"chars": 500})), reply("done")]
    session = await run_mcp(
        [McpTools([server], max_result_chars=100), ModelInference()], ScriptedModel(turns)
    )
    (result,) = results(session)
    assert result.is_error
    assert "remote" in result.content  # the error names the server
    assert "PW-S3CRET" not in result.content


async def test_a_key_in_the_url_query_stays_out_of_error_results(http_url: str) -> None:
    server = McpHttp(url=f"http://{http_url}?api_key=Q-S3CRET", name="remote")
    turns = [call(("big", {"chars": 500})), reply("done")]
    session = await run_mcp(
        [McpTools([server], max_result_chars=100), ModelInference()], ScriptedModel(turns)
    )
    (result,) = results(session)
    assert result.is_error
    assert "Q-S3CRET" not in result.content


async def test_a_server_ignoring_sigterm_and_its_child_are_stopped_with_the_run(
    events: Path,
) -> None:
    turns = [call(("echo", {"text": "x"})), reply("done")]
    # stop_grace: its stdin closed, then SIGTERM, each ignored for 0.2 s, then SIGKILL.
    stubborn = hostile("stubborn", events, stop_grace=0.2)
    session = await run_mcp([McpTools([stubborn]), ModelInference()], ScriptedModel(turns))
    assert results(session)[0].content == "x"
    started = pids(events)
    assert len(started) == 2  # the server and its child
    assert await all_gone(started)


def test_stop_grace_defaults_to_the_sdks_and_is_checked() -> None:
    assert McpStdio(command="x").stop_grace == 2.0
    assert McpStdio(command="x", stop_grace=0).stop_grace == 0
    for bad in (-1, float("inf"), float("nan"), 10**400, True, "1"):
        with pytest.raises(ConfigurationError, match="stop_grace"):
            McpStdio(command="x", stop_grace=bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="connect_timeout"):
            McpStdio(command="x", connect_timeout=bad)  # type: ignore[arg-type]


async def test_stop_grace_bounds_each_wait_and_a_server_that_exits_is_not_signalled(
    events: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mcp.os.posix import utilities

    signalled: list[float] = []
    real = utilities.terminate_posix_process_tree

    async def spy(process: Any, timeout_seconds: float = 2.0) -> None:
        signalled.append(timeout_seconds)
        await real(process, timeout_seconds)

    monkeypatch.setattr(utilities, "terminate_posix_process_tree", spy)
    own = {"ledger": tmp_path / "polite-ledger.txt", "events": tmp_path / "polite-events.txt"}
    polite = light(own, stop_grace=0.3)  # it exits when its stdin closes
    async with McpTools([polite]):
        pass
    assert signalled == []  # no SIGTERM: it exited within its grace
    async with McpTools([hostile("stubborn", events, stop_grace=0.3)]):
        pass
    assert signalled == [0.3]  # SIGTERM, then 0.3 s, then SIGKILL
    assert len(pids(events)) == 2  # the server and its child
    assert await all_gone(pids(events) + pids(own["events"]))


async def test_cancelling_a_run_with_a_stubborn_server_mid_call_stops_it(events: Path) -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    # The model calls echo again and again: the run is cancelled between calls or during one.
    stubborn = hostile("stubborn", events, stop_grace=0.2)
    machine = StateMachine([McpTools([stubborn]), ModelInference()])
    asked = 0

    def model(request: ModelRequest) -> ModelResponse:
        nonlocal asked
        asked += 1
        return call(("echo", {"text": "again"}))

    runtime = Runtime(store=store, model=FunctionModel(model))
    with anyio.fail_after(BOUND):
        async with anyio.create_task_group() as tg:
            tg.start_soon(machine.run, runtime, "s")
            while asked < 3:  # noqa: ASYNC110 - two calls answered, the third on its way
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    assert len(pids(events)) == 2  # the server and its child
    assert await all_gone(pids(events))


async def test_an_error_in_a_shared_block_propagates_as_itself(tmp_path: Path) -> None:
    with anyio.fail_after(BOUND):
        with pytest.raises(ValueError, match="mine"):
            async with McpTools([light_server(tmp_path)]):
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
                    with anyio.move_on_after(10):  # the other task's try, while open
                        while not outcomes:
                            await anyio.sleep(0.01)
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
    argv = [sys.executable, "-c", TWO_ENTERS, str(LIGHT), str(events), backend]
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
    session = await run_mcp(
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
        session = await run_mcp(steps, FunctionModel(model))
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
        await run_mcp(
            [McpTools([hostile("plain", events)]), Tools([echo]), ModelInference()], model
        )
    assert model.requests == []


async def test_an_image_over_max_media_bytes_from_a_server_is_an_error_result(
    tmp_path: Path,
) -> None:
    store = MemoryStore(max_media_bytes=8)  # the fixture's image holds 16 bytes
    await store.create("s", conversation=[Message.user("go", id="u1")])
    model = ScriptedModel([call(("image", {})), reply("done")])
    machine = StateMachine([McpTools([light_server(tmp_path)]), ModelInference()])
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
    server = light_server(tmp_path)
    server = McpStdio(
        command=server.command,
        args=server.args,
        env={**(server.env or {}), "FX_TOKEN": SECRET, "MCP_SAY": f"token {SECRET}"},
        name="fx",
    )
    turns = [call(("getenv", {"name": "FX_TOKEN"})), call(("fail", {"why": SECRET})), reply("ok")]
    with structlog.testing.capture_logs() as captured:
        session = await run_mcp([McpTools([server]), ModelInference()], ScriptedModel(turns))
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
    mcp = McpTools([light_server(tmp_path)], max_message_bytes=65_536)
    session = await run_mcp([mcp, ModelInference()], ScriptedModel(turns))
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


# -- a hostile server quoting its configured secret (tests/_mcp_secret_server.py) -----


MCP_SERVER = Path(__file__).parent / "_mcp_secret_server.py"
MCP_SECRET = "mcp-env-secret-DO-NOT-LEAK-9911"


def _mcp(mode: str) -> Any:
    from stepmachine.operations import McpStdio

    return McpStdio(
        name="h2",
        command=sys.executable,
        args=[str(MCP_SERVER), mode],
        env={"SECRET": MCP_SECRET},
    )


async def _mcp_run(mode: str, model: Any, bound: float = 60) -> tuple[Any, list[dict[str, Any]]]:
    from stepmachine.operations import McpTools

    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    with structlog.testing.capture_logs() as logs, anyio.fail_after(bound):
        session = await StateMachine([McpTools([_mcp(mode)]), ModelInference()]).run(
            Runtime(store=store, model=model), "s"
        )
    return session, logs


def _stored(session: Any) -> str:
    import msgspec

    return "\n".join(msgspec.json.encode(m).decode() for m in session.conversation)


async def test_mcp_a_description_quoting_the_secret_is_redacted() -> None:
    model = ScriptedModel([reply("fine")])
    await _mcp_run("desc", model)
    [tool] = model.requests[0].tools
    assert "server key" in tool.description
    import msgspec

    assert MCP_SECRET not in msgspec.json.encode(model.requests[0].tools).decode()


async def test_mcp_structured_content_quoting_the_secret_is_redacted() -> None:
    model = ScriptedModel([call(("echo", {"text": "x"})), reply("fine")])
    session, _ = await _mcp_run("structured", model)
    stored = _stored(session)
    assert '"key"' in stored or "key" in stored
    assert MCP_SECRET not in stored


async def test_mcp_a_resource_uri_quoting_the_secret_is_redacted() -> None:
    model = ScriptedModel([call(("echo", {"text": "x"})), reply("fine")])
    session, _ = await _mcp_run("uri", model)
    stored = _stored(session)
    assert "files.test" in stored
    assert MCP_SECRET not in stored


async def test_mcp_a_10_mb_stderr_line_is_cut_and_redacted() -> None:
    model = ScriptedModel([call(("echo", {"text": "x"})), reply("fine")])
    session, logs = await _mcp_run("stderr", model)
    lines = [e for e in logs if e.get("event") == "mcp_stderr"]
    assert any("short line" in str(e.get("line")) for e in lines), lines[:3]
    assert all(len(str(e.get("line"))) <= 2100 for e in lines)
    shown = repr(logs) + _stored(session)
    assert MCP_SECRET not in shown
    assert MCP_SECRET[:12] not in shown


async def test_mcp_a_server_answering_every_probe_with_32000_ends_the_call_cleanly() -> None:
    """Every call and every probe get -32000: the call is an error result (the run ends,
    bounded), never a hang or a crash of the run."""
    from stepmachine import ToolResultPart

    model = ScriptedModel([call(("echo", {"text": "x"})), reply("fine")])
    session, _ = await _mcp_run("all32000", model, bound=60)
    [result] = [p for m in session.conversation for p in m.parts if isinstance(p, ToolResultPart)]
    assert result.is_error
    text = str(result.content)
    assert "busy" in text or "closed" in text or "unknown" in text, text


async def test_mcp_a_32000_error_quoting_the_secret_is_its_message_redacted() -> None:
    model = ScriptedModel([call(("echo", {"text": "x"})), reply("fine")])
    session, logs = await _mcp_run("echo32000", model)
    [result] = [p for m in session.conversation for p in m.parts if isinstance(p, ToolResultPart)]
    assert result.is_error
    assert "quota" in str(result.content)
    assert MCP_SECRET not in _stored(session) + repr(logs)
