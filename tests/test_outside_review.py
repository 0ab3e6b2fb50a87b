"""Defects found by an outside review of the user-facing surface.

Each test states what a user does and what should happen; each is a strict xfail
until the defect is fixed (then the mark goes and the test stays).
"""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest

from stepmachine import (
    Agent,
    Codec,
    ConfigurationError,
    ContextLengthError,
    Continue,
    Effect,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Operation,
    Outcome,
    Runtime,
    Session,
    StateMachine,
    StepContext,
    StepContractError,
    StepmachineError,
    StoredDataError,
    TextPart,
    ToolCallPart,
    Tools,
    Yield,
    providers,
    submit,
    tool,
)
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore
from stepmachine.testing import ScriptedModel, call, reply

SECRET = "SECRETTOKEN0123456789abcdef"


# -- no secret escapes ---------------------------------------------------------


@pytest.mark.parametrize(
    "base_url",
    [f"user:{SECRET}@localhost:8000/v1", f"https//user:{SECRET}@llm.example.com/v1"],
)
async def test_a_malformed_base_url_holding_a_token_is_not_echoed(
    base_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A user sets the base URL of an OpenAI-compatible server with credentials in it and
    # forgets "http://" (or writes "https//"). The error must say what is wrong without
    # printing the token (a query-string token is already removed from the same message).
    monkeypatch.setenv("OPENAI_COMPATIBLE_BASE_URL", base_url)
    agent = Agent("openai-compatible:qwen3", store=tmp_path / "db.sqlite3")
    with pytest.raises(ConfigurationError) as caught:
        await agent.run("s1", "hi")
    seen = [caught.value]
    while seen[-1].__cause__ is not None or seen[-1].__context__ is not None:
        seen.append(seen[-1].__cause__ or seen[-1].__context__)  # type: ignore[arg-type]
    assert all(SECRET not in f"{error!s} {error!r}" for error in seen)


# -- cancellation is bounded ---------------------------------------------------


async def test_cancelling_a_run_with_a_hung_sync_tool_is_bounded() -> None:
    release = threading.Event()
    entered = threading.Event()

    @tool
    def fetch(url: str) -> str:
        """A blocking call with no timeout of its own (a hung socket)."""
        entered.set()
        release.wait(timeout=30)
        return "late"

    store = MemoryStore()
    await store.create("s1", conversation=[Message.user("fetch it", id="u1")])
    model = ScriptedModel([call(("fetch", {"url": "http://example.com"})), reply("ok")])
    machine = StateMachine([Tools([fetch]), ModelInference()], finalize_timeout=0.2)
    released_by: list[str] = []

    async def watchdog() -> None:
        # Releases the tool only if the cancelled run has not returned on its own
        # long after finalize_timeout: then the run was waiting for the tool.
        await anyio.sleep(3)
        if not released_by:
            released_by.append("watchdog")
            release.set()

    async with anyio.create_task_group() as group:
        group.start_soon(watchdog)
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as inner:
                inner.start_soon(machine.run, Runtime(store=store, model=model), "s1")
                while not entered.is_set():  # noqa: ASYNC110 - set from the tool's thread
                    await anyio.sleep(0.01)
                scope.cancel()
        if not released_by:
            released_by.append("run returned")
        release.set()
        group.cancel_scope.cancel()
    assert released_by == ["run returned"]


# -- the front door ------------------------------------------------------------


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


# -- errors say what to do -----------------------------------------------------


def test_a_tool_name_advertised_by_two_steps_is_refused_when_the_machine_is_built() -> None:
    @tool
    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    @tool(name="add")
    def add_again(a: int) -> int:
        """Also add."""
        return a

    with pytest.raises(ConfigurationError, match=r"'add'.*name="):
        StateMachine(
            [Tools([add], name="maths"), Tools([add_again], name="more"), ModelInference()]
        )


class _ContinuesWithAString(Operation[Any]):
    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Continue(["not an effect"])  # type: ignore[list-item]


class _YieldsANumber(Operation[Any]):
    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Yield([], 42)  # type: ignore[arg-type]


async def test_a_step_continuing_with_a_non_effect_gets_a_clear_error() -> None:
    store = MemoryStore()
    await store.create("s1", conversation=[Message.user("hi", id="u1")])
    with pytest.raises(StepContractError, match=r"_ContinuesWithAString.*not an effect"):
        await StateMachine([_ContinuesWithAString()]).run(Runtime(store=store), "s1")
    assert (await store.load("s1")).revision == 0


async def test_a_step_yielding_a_reason_that_is_not_a_string_gets_a_clear_error() -> None:
    store = MemoryStore()
    await store.create("s1", conversation=[Message.user("hi", id="u1")])
    with pytest.raises(StepContractError, match=r"_YieldsANumber.*42"):
        await StateMachine([_YieldsANumber()]).run(Runtime(store=store), "s1")


def test_a_codec_of_a_type_that_is_not_a_struct_says_what_to_pass() -> None:
    with pytest.raises((ConfigurationError, TypeError), match="Struct"):
        Codec(dict)  # type: ignore[type-var]


# -- a model that reuses tool-call ids -----------------------------------------


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


# -- more of the front door ----------------------------------------------------


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


# -- stored data ---------------------------------------------------------------


async def test_a_damaged_file_store_record_names_the_session_and_revision(
    tmp_path: Path,
) -> None:
    store = await FileStore.open(tmp_path / "fs")
    async with store:
        agent = Agent("scripted", store=store)
        for question in ("one", "two", "three"):
            await agent.run("s1", question)
    log = tmp_path / "fs" / "s1.log"
    data = bytearray(log.read_bytes())
    data[len(data) // 2] ^= 0x20
    log.write_bytes(bytes(data))
    before = log.read_bytes()
    store = await FileStore.open(tmp_path / "fs")
    async with store:
        with pytest.raises(StoredDataError) as caught:
            await store.load("s1")
    assert log.read_bytes() == before  # nothing rewritten (this part holds)
    assert "'s1'" in str(caught.value)
    assert "revision" in str(caught.value)


async def test_a_store_path_in_a_missing_folder_is_named_in_the_error(tmp_path: Path) -> None:
    path = tmp_path / "no-such-folder" / "db.sqlite3"
    try:
        report = await Agent("scripted", store=path).run("s1", "hi")
    except Exception as error:  # any error is fine if it names the path
        assert str(path) in str(error)  # noqa: PT017
    else:
        assert report.reason.kind == "done"  # or the folder is made


async def test_a_user_message_with_a_lone_surrogate_gets_a_clear_error(tmp_path: Path) -> None:
    text = json.loads('"hello \\ud83d"')  # what json.loads gives for a truncated emoji
    agent = Agent("scripted", store=tmp_path / "db.sqlite3")
    try:
        report = await agent.run("s1", text)
    except StepmachineError as error:
        assert "surrogate" in str(error)  # noqa: PT017 - refused with the reason
    else:
        assert report.reason.kind == "done"  # or stored with the character replaced


# -- deprecated names ----------------------------------------------------------


class _ReadsDeprecatedContext(Operation[Any]):
    async def run(self, ctx: StepContext[Any]) -> Outcome:
        ctx.scratch["seen"] = len(ctx.steps)
        return Yield([], "read")


async def test_the_deprecated_context_fields_warn_when_read() -> None:
    store = MemoryStore()
    await store.create("s1", conversation=[Message.user("hi", id="u1")])
    with pytest.warns(DeprecationWarning, match="scratch|steps") as caught:
        report = await StateMachine([_ReadsDeprecatedContext()]).run_report(
            Runtime(store=store), "s1"
        )
    assert report.reason.kind == "read"  # still works
    messages = " ".join(str(warning.message) for warning in caught)
    assert "scratch" in messages
    assert "steps" in messages


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


# -- a tool that returns a huge result -----------------------------------------


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


# -- model strings and keys ----------------------------------------------------

_KEY_VARIABLES = (
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_BASE_URL",
    "GEMINI_API_KEY",
    "GOOGLE_API_KEY",
    "GEMINI_BASE_URL",
)


@pytest.mark.parametrize(
    ("adapter", "model"),
    [
        ("OpenAIResponsesModel", "gpt-5-mini"),
        ("AnthropicModel", "claude-haiku-4-5"),
        ("GeminiModel", "gemini-2.5-flash"),
    ],
)
async def test_a_missing_key_is_refused_before_a_request_is_sent(
    adapter: str, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in _KEY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    sent: list[str] = []

    def provider(request: httpx.Request) -> httpx.Response:
        sent.append(str(request.url))
        return httpx.Response(401, json={"error": {"message": "no key", "type": "auth"}})

    async with httpx.AsyncClient(transport=httpx.MockTransport(provider)) as client:
        made = getattr(providers, adapter)(model, client=client)
        with pytest.raises(ConfigurationError, match="_API_KEY"):
            await made.request(ModelRequest(messages=[Message.user("hi", id="u1")]))
    assert sent == []


class _Priority(msgspec.Struct):
    priority: int = 3


class _PriorityText(msgspec.Struct):
    priority: str = "low"


class _Bump(Effect, frozen=True, tag="review.bump"):
    by: int

    def apply(self, session: Session[Any]) -> Session[Any]:
        data = msgspec.structs.replace(session.data, priority=session.data.priority + self.by)
        return msgspec.structs.replace(session, data=data)


@pytest.mark.parametrize("wrong", ["effect missing", "field type differs"])
async def test_a_wrong_codec_error_says_what_to_do(wrong: str, tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"
    async with await SQLiteStore.open(path, Codec(_Priority, effects=[_Bump])) as store:
        await store.create("t1", _Priority())
        await submit(store, "t1", [_Bump(by=2)])
    codec: Codec[Any] = (
        Codec(_Priority) if wrong == "effect missing" else Codec(_PriorityText, effects=[_Bump])
    )
    async with await SQLiteStore.open(path, codec) as store:
        with pytest.raises(StoredDataError) as caught:
            await store.load("t1")
    assert "open it with" in str(caught.value) or "effects=" in str(caught.value)


# -- a tool that raises --------------------------------------------------------


class _UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this exception cannot be printed")


async def test_a_tool_raising_an_unprintable_exception_becomes_an_error_result(
    tmp_path: Path,
) -> None:
    @tool
    def lookup(query: str) -> str:
        """Look something up."""
        raise _UnprintableError

    model = ScriptedModel([call(("lookup", {"query": "x"})), reply("sorry")])
    report = await Agent(model, tools=[lookup], store=tmp_path / "db.sqlite3").run("s1", "find x")
    assert report.text == "sorry"
    results = [part for message in report.session.conversation for part in message.tool_results]
    assert [part.is_error for part in results] == [True]


async def test_a_sync_tool_is_bounded_by_its_timeout(tmp_path: Path) -> None:
    release = threading.Event()

    @tool(timeout=0.2)
    def fetch(url: str) -> str:
        """A blocking call that hangs (released by the test after at most 3 s)."""
        release.wait(timeout=3)
        return "late"

    model = ScriptedModel([call(("fetch", {"url": "http://example.com"})), reply("ok")])
    agent = Agent(model, tools=[fetch], store=tmp_path / "db.sqlite3")
    try:
        report = await agent.run("s1", "fetch it")
    finally:
        release.set()
    results = [part for message in report.session.conversation for part in message.tool_results]
    assert [(part.is_error, "timed out" in str(part.content)) for part in results] == [(True, True)]


async def test_the_agent_does_not_ask_a_human_to_approve_an_invalid_call(tmp_path: Path) -> None:
    @tool
    def pay(amount_eur: int) -> str:
        """Pay (needs approval)."""
        return "paid"

    model = ScriptedModel([call(("pay", {"amount_eur": "lots"})), reply("sorry")])
    agent = Agent(model, tools=[pay], approve=[pay], store=tmp_path / "db.sqlite3")
    report = await agent.run("s1", "pay them")
    assert report.reason.kind != "awaiting_approval"


@tool
def _add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.mark.parametrize("mistake", ["a tool", "a step class"])
def test_something_that_is_not_a_step_is_refused_when_the_machine_is_built(mistake: str) -> None:
    wrong: Any = _add if mistake == "a tool" else ModelInference
    with pytest.raises(ConfigurationError, match=r"Tools\(\[|ModelInference\(\)"):
        StateMachine([wrong])


def test_a_tool_made_from_a_method_in_a_class_body_gets_advice_that_helps() -> None:
    with pytest.raises(ConfigurationError) as caught:

        class Shop:
            @tool
            def price(self, item: str) -> int:
                """The price of an item."""
                return 3

    assert "self: str" not in str(caught.value)


async def test_a_404_from_a_wrong_base_url_names_what_was_requested(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def server(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, text="404 page not found")

    monkeypatch.delenv("OPENAI_COMPATIBLE_API_KEY", raising=False)
    async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as client:
        model = providers.OpenAICompatibleModel(
            "qwen3", base_url="http://localhost:11434/v1/chat/completions", client=client
        )
        with pytest.raises(providers.NotFoundError) as caught:
            await model.request(ModelRequest(messages=[Message.user("hi", id="u1")]))
    assert "/chat/completions/chat/completions" in str(caught.value) or "base_url" in str(
        caught.value
    )
