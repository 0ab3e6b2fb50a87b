"""The front door: ``stepmachine.Agent`` (stepmachine/_agent.py), as a user meets it."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from stepmachine import (
    Agent,
    Codec,
    ConfigurationError,
    ContextLengthError,
    Message,
    ModelRequest,
    ModelResponse,
    StepmachineError,
    TextPart,
    ToolCallPart,
    Tools,
    tool,
)
from stepmachine.stores import MemoryStore
from stepmachine.testing import ScriptedModel, call, reply

# -- at the edges, as a user meets them ----------------------------------------


async def test_the_agent_takes_a_typed_function_as_a_tool(tmp_path: Path) -> None:
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    # Tools([...]) takes it; the Agent should too, or refuse it naming @tool.
    assert Tools([add]).name == "tools"
    model = ScriptedModel([call(("add", {"a": 2, "b": 3})), reply("5")])
    try:
        agent = Agent(model, tools=[add], store=tmp_path / "db.sqlite3")  # type: ignore[list-item]
    except ConfigurationError as error:
        assert "@tool" in str(error)  # noqa: PT017 - either outcome is fine
    else:
        assert (await agent.run("s1", "2 + 3?")).text == "5"


def test_an_agent_without_a_model_says_so_when_built(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="model"):
        Agent(None, store=tmp_path / "db.sqlite3")  # type: ignore[call-overload]


def test_an_agent_approving_one_tool_by_a_bare_string(tmp_path: Path) -> None:
    @tool
    def send(to: str) -> str:
        """Send."""
        return to

    # Either the one tool is approved, or the refusal names 'send' (not its letters).
    problem = ""
    try:
        agent = Agent("scripted", tools=[send], approve="send", store=tmp_path / "db.sqlite3")
    except ConfigurationError as error:
        problem = str(error)
    else:
        assert "approval" in [step.name for step in agent.steps]
    assert "['d'" not in problem


def test_an_agent_with_a_store_of_the_wrong_type_is_refused_when_built() -> None:
    with pytest.raises((ConfigurationError, TypeError), match="store"):
        Agent("scripted", store=123)  # type: ignore[call-overload]


class _ReusesCallIds:
    """A model (as some local OpenAI-compatible servers do) naming every turn's call 'call_0'."""

    name = "reuses-ids"

    def __init__(self) -> None:
        self.calls = 0

    async def request(self, request: ModelRequest, *, on_chunk: Any = None) -> ModelResponse:
        self.calls += 1
        last = request.messages[-1]
        if last.role == "user":
            arguments = json.dumps({"to": last.text})
            return ModelResponse(parts=(ToolCallPart.parse("call_0", "send", arguments),))
        return ModelResponse(parts=(TextPart("sent"),))


async def test_a_call_id_reused_in_a_later_turn_is_not_taken_as_answered(tmp_path: Path) -> None:
    sent: list[str] = []

    @tool
    def send(to: str) -> str:
        """Send a message."""
        sent.append(to)
        return f"sent to {to}"

    model = _ReusesCallIds()
    agent = Agent(model, tools=[send], store=tmp_path / "db.sqlite3")
    assert (await agent.run("s1", "alice")).reason.kind == "done"
    report = await agent.run("s1", "bob")
    # The second call is run, or answered with an error the model can read: either way
    # the run ends without looping, and every call in the history has a result.
    assert report.reason.kind != "cycle_limit"
    conversation = list(report.session.conversation)
    last_call = max(i for i, m in enumerate(conversation) if m.tool_calls)
    assert any(m.tool_results for m in conversation[last_call + 1 :])


class _Ticket(msgspec.Struct):
    number: int = 0


async def test_an_agent_does_not_drop_a_codec_given_with_a_store_object() -> None:
    try:
        agent = Agent("scripted", store=MemoryStore(), codec=Codec(_Ticket))
    except ConfigurationError as error:  # refusing the pair is fine, if it says why
        assert "codec" in str(error)  # noqa: PT017 - either outcome is fine
    else:
        report = await agent.run("s1", "hi")
        assert isinstance(report.session.data, _Ticket)


async def test_a_retried_message_id_says_how_to_continue(tmp_path: Path) -> None:
    agent = Agent("scripted", store=tmp_path / "db.sqlite3")
    await agent.run("s1", Message.user("pay Alice", id="request-7"))
    with pytest.raises(StepmachineError) as caught:  # a web request retried after a crash
        await agent.run("s1", Message.user("pay Alice", id="request-7"))
    assert "request-7" in str(caught.value)
    assert "None" in str(caught.value) or "no message" in str(caught.value)


async def test_a_store_path_in_a_missing_folder_is_named_in_the_error(tmp_path: Path) -> None:
    path = tmp_path / "no-such-folder" / "db.sqlite3"
    try:
        report = await Agent("scripted", store=path).run("s1", "hi")
    except Exception as error:  # any error is fine if it names the path
        assert str(path) in str(error)  # noqa: PT017
    else:
        assert report.reason.kind == "done"  # or the folder is made


class _RepeatsACallId:
    """A model whose reply holds two calls with one id (a custom or local model's bug)."""

    name = "repeats-an-id"

    def __init__(self) -> None:
        self.calls = 0

    async def request(self, request: ModelRequest, *, on_chunk: Any = None) -> ModelResponse:
        self.calls += 1
        if request.messages[-1].role == "user":
            return ModelResponse(
                parts=(
                    ToolCallPart.parse("c1", "send", '{"to": "alice"}'),
                    ToolCallPart.parse("c1", "send", '{"to": "bob"}'),
                )
            )
        return ModelResponse(parts=(TextPart("sent"),))


async def test_a_reply_with_a_repeated_call_id_does_not_loop_the_agent(tmp_path: Path) -> None:
    @tool
    def send(to: str) -> str:
        """Send a message."""
        return f"sent to {to}"

    model = _RepeatsACallId()
    report = await Agent(model, tools=[send], store=tmp_path / "db.sqlite3").run("s1", "go")
    assert report.reason.kind != "cycle_limit"
    assert model.calls < 10


class _SmallWindow:
    """A model with a context window of 100,000 characters (as a provider would refuse)."""

    name = "small-window"

    async def request(self, request: ModelRequest, *, on_chunk: Any = None) -> ModelResponse:
        size = sum(
            len(part.content if isinstance(part.content, str) else str(part.content))
            for message in request.messages
            for part in message.tool_results
        ) + sum(len(message.text) for message in request.messages)
        if size > 100_000:
            raise ContextLengthError(f"{size} characters do not fit")
        last = request.messages[-1]
        if last.role == "user" and last.text == "read the log":
            return ModelResponse(parts=(ToolCallPart.parse("c1", "read_log", "{}"),))
        return ModelResponse(parts=(TextPart("hi"),))


async def test_one_huge_tool_result_does_not_make_the_session_unusable(tmp_path: Path) -> None:
    @tool(side_effects="pure")
    def read_log() -> str:
        """Read the application log."""
        return "a log line\n" * 50_000

    agent = Agent(_SmallWindow(), tools=[read_log], store=tmp_path / "db.sqlite3")
    with contextlib.suppress(ContextLengthError):
        await agent.run("s1", "read the log")
    report = await agent.run("s1", "never mind; say hi")
    assert report.text == "hi"


async def test_the_agent_does_not_ask_a_human_to_approve_an_invalid_call(tmp_path: Path) -> None:
    @tool
    def pay(amount_eur: int) -> str:
        """Pay (needs approval)."""
        return "paid"

    model = ScriptedModel([call(("pay", {"amount_eur": "lots"})), reply("sorry")])
    agent = Agent(model, tools=[pay], approve=[pay], store=tmp_path / "db.sqlite3")
    report = await agent.run("s1", "pay them")
    assert report.reason.kind != "awaiting_approval"
