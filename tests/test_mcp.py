"""McpTools against real MCP servers (tests/fixtures/mcp_server.py, written with the SDK).

Every server here is a real process: stdio servers started by McpTools, an
HTTP server started by the test on a loopback port. Each async test runs on
asyncio and trio.
"""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
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
)
from stepmachine.operations import Approval, McpHttp, McpStdio, McpTools, approve
from stepmachine.operations._mcp_tool import McpTool, result_output, result_text
from stepmachine.stores import MemoryStore
from stepmachine.testing import FunctionModel, ScriptedModel, call, reply

SERVER = Path(__file__).parent / "fixtures" / "mcp_server.py"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    return {"ledger": tmp_path / "ledger.txt", "events": tmp_path / "events.txt"}


def stdio(files: dict[str, Path], **kwargs: Any) -> McpStdio:
    env = {"MCP_LEDGER": str(files["ledger"]), "MCP_EVENTS": str(files["events"])}
    kwargs.setdefault("name", "fx")
    return McpStdio(command=sys.executable, args=[str(SERVER), "stdio"], env=env, **kwargs)


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
    server = stdio(files, side_effects={"add": "pure"}, **trust)
    async with McpTools([server]) as mcp:
        mcp.tools(None)  # type: ignore[arg-type]
        assert mcp.side_effects("echo") == "non_idempotent"  # its readOnlyHint is ignored
        assert mcp.side_effects("liar") == "non_idempotent"  # so is a false one
        assert mcp.side_effects("add") == "pure"


async def test_namespace_prefixes_each_server_and_a_clash_is_a_configuration_error(
    files: dict[str, Path], tmp_path: Path
) -> None:
    a, b = stdio(files, name="a"), stdio(files, name="b")
    model = ScriptedModel([])  # never called: the clash stops the run first
    with pytest.raises(ConfigurationError, match="'echo' is given by both"):
        await run([McpTools([a, b]), ModelInference()], model)
    assert model.requests == []
    async with McpTools([a, b], namespace=True) as mcp:
        names = {d.name for d in mcp.tools(None)}  # type: ignore[arg-type]
        assert {"a__echo", "b__echo"} <= names
        assert "echo" not in names
    async with McpTools([stdio(files, prefix="files_")]) as mcp:
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
    session, _ = await run([McpTools([stdio(files)]), ModelInference()], ScriptedModel(turns))
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
    session, _ = await run([McpTools([stdio(files)]), ModelInference()], ScriptedModel(turns))
    assert [r.content for r in results(session)] != []
    order = [x.split("\t")[0].split()[0] for x in lines(files["ledger"])]
    # All three started before any ended: they overlapped at the server.
    assert order == ["start"] * 3 + ["end"] * 3, order
    assert sorted(r.content for r in results(session)) == ["slept 0", "slept 1", "slept 2"]


async def test_too_long_a_result_is_an_error_result_not_stored(files: dict[str, Path]) -> None:
    turns = [call(("big", {"chars": 5000})), reply("ok")]
    mcp = McpTools([stdio(files)], max_result_chars=1000)
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
    steps = [Approval(["record"]), McpTools([stdio(files)]), ModelInference()]
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
    session, _ = await run([McpTools([stdio(files)]), ModelInference()], ScriptedModel(turns))
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
    mcp = McpTools([stdio(files, timeout=0.5)])
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
        connect_timeout=1.0,
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
    async with McpTools([stdio(files)]) as mcp:
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
    machine = StateMachine([McpTools([stdio(files)]), ModelInference()])
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
    session, _ = await run([McpTools([stdio(files)]), ModelInference()], ScriptedModel(turns))
    (pid,) = started_pids(files)
    assert results(session)[0].content == str(pid)
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:  # noqa: ASYNC110 - a process has no event
        await anyio.sleep(0.05)
    assert not _alive(pid)


async def test_shared_connections_serve_several_runs_with_one_process(
    files: dict[str, Path],
) -> None:
    async with McpTools([stdio(files)]) as mcp:
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
        await run([McpTools([stdio(files)]), ModelInference()], FunctionModel(model))


async def test_cancelling_a_run_mid_call_stops_the_server_and_answers_the_call(
    files: dict[str, Path],
) -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    machine = StateMachine([McpTools([stdio(files)]), ModelInference()])
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

    steps = [InvalidCalls("retry"), McpTools([stdio(files)]), ModelInference()]
    session, _ = await run(steps, FunctionModel(model))
    notes = [x.split("\t")[0] for x in lines(files["ledger"])]
    assert notes == ["fixed"]  # the invalid call never reached the server
    feedback = session.conversation[2].text
    assert "invalid arguments for tool 'record': $.note: expected string" in feedback
    assert session.conversation[-1].text == "done"


async def test_a_tool_call_budget_governs_mcp_calls(files: dict[str, Path]) -> None:
    from stepmachine.operations import Budget, Limits

    turns = [call(("record", {"note": "a"}), ("record", {"note": "b"})), reply("done")]
    steps = [Budget(per_run=Limits(tool_calls=1)), McpTools([stdio(files)]), ModelInference()]
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
