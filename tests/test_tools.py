"""@tool schemas, argument validation, and the Tools operation (errors become results)."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, Any, Literal

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import msgspec
import pytest
import sniffio
from _staging import carry_out

import stepmachine
from stepmachine import (
    Annotate,
    AppendMessage,
    ConfigurationError,
    Continue,
    Effect,
    Message,
    RecordingEmitter,
    Refuse,
    Runtime,
    Session,
    StateMachine,
    StepContext,
    ToolArgumentsError,
    ToolCallPart,
    ToolContext,
    ToolFinished,
    ToolResultPart,
    Tools,
    ToolStarted,
    tool,
)
from stepmachine._emitter import EventSink
from stepmachine._staged import Recorder
from stepmachine.extend import apply_batch, counter_ids, history_problems, open_tool_calls
from stepmachine.testing import StepCheck, make_session, run_step


class Point(msgspec.Struct):
    """A point on the plane."""

    x: int
    y: int = 0


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    The second paragraph is not part of the description.
    """
    return a + b


@tool
async def echo(text: str) -> str:
    """Echo the text back."""
    await anyio.lowlevel.checkpoint()
    return text


def assistant(*parts: ToolCallPart, message_id: str = "a1") -> Message:
    return Message(id=message_id, role="assistant", parts=parts)


def session_with_calls(*parts: ToolCallPart, session_id: str = "s1") -> Session[Any]:
    return make_session("go", assistant(*parts), session_id=session_id)


def recorded_results(check: StepCheck) -> list[ToolResultPart]:
    """The results the step recorded (committed or returned), in conversation order.

    Every result is alone in its own ``tool`` message.
    """
    found: list[ToolResultPart] = []
    for message in check.new_messages:
        assert message.role == "tool"
        (part,) = message.parts
        assert isinstance(part, ToolResultPart)
        found.append(part)
    return found


async def run_tools(step: Tools, *calls: ToolCallPart, **kwargs: Any) -> dict[str, ToolResultPart]:
    """Run ``step`` on one assistant message holding ``calls``; the results by call id."""
    check = await run_step(step, session_with_calls(*calls), **kwargs)
    assert isinstance(check.outcome, Continue)
    results = recorded_results(check)
    assert sorted(r.call_id for r in results) == sorted(c.call_id for c in calls)
    assert history_problems(check.session.conversation) == []
    return {r.call_id: r for r in results}


async def run_one(step: Tools, call: ToolCallPart) -> ToolResultPart:
    return (await run_tools(step, call))[call.call_id]


# -- schema derivation -------------------------------------------------------------------------


def test_schema_from_signature() -> None:
    @tool
    def search(
        query: Annotated[str, msgspec.Meta(description="what to look for")],
        limit: int,
        mode: Literal["fast", "slow"] = "fast",
        page: int | None = None,
        near: Point | None = None,
    ) -> str:
        """Search the index."""
        return ""

    assert search.name == "search"
    assert search.description == "Search the index."
    assert search.parameters == {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "what to look for"},
            "limit": {"type": "integer"},
            "mode": {"enum": ["fast", "slow"], "default": "fast"},
            "page": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None},
            "near": {"anyOf": [{"$ref": "#/$defs/Point"}, {"type": "null"}], "default": None},
        },
        "required": ["query", "limit"],
        "additionalProperties": False,
        "$defs": {
            "Point": {
                "title": "Point",
                "description": "A point on the plane.",
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer", "default": 0}},
                "required": ["x"],
            }
        },
    }
    assert search.definition == stepmachine.ToolDefinition(
        name="search", description="Search the index.", parameters=search.parameters
    )


def test_schema_without_parameters() -> None:
    @tool
    def ping() -> str:
        return "pong"

    assert ping.parameters == {
        "type": "object",
        "properties": {},
        "required": [],
        "additionalProperties": False,
    }
    assert ping.description == ""


def test_description_is_first_docstring_paragraph() -> None:
    assert add.description == "Add two integers."

    @tool
    def wrapped() -> None:
        """First line
        continues here.

        Not this.
        """

    assert wrapped.description == "First line\ncontinues here."


def test_name_and_description_overrides() -> None:
    @tool(name="plus", description="Adds.")
    def add2(a: int) -> int:
        """Ignored."""
        return a

    assert add2.name == "plus"
    assert add2.description == "Adds."
    assert add2.definition.name == "plus"
    assert repr(add2) == "Tool(name='plus')"


def test_tool_context_is_not_in_the_schema() -> None:
    @tool
    def with_ctx(a: int, ctx: ToolContext, b: str = "x") -> str:
        return ""

    assert set(with_ctx.parameters["properties"]) == {"a", "b"}
    assert with_ctx.parameters["required"] == ["a"]
    assert "ctx" not in with_ctx.arguments_type.__struct_fields__


# -- configuration errors -------------------------------------------------------------------------


def test_star_args_are_refused() -> None:
    def star(*args: int) -> None:
        pass

    with pytest.raises(ConfigurationError, match="args"):
        tool(star)


def test_star_kwargs_are_refused() -> None:
    def kw(a: int, **kwargs: int) -> None:
        pass

    with pytest.raises(ConfigurationError, match="kwargs"):
        tool(kw)


def test_missing_annotation_is_refused() -> None:
    def bare(a: int, b) -> None:  # type: ignore[no-untyped-def]
        pass

    with pytest.raises(ConfigurationError, match="'b' needs a type annotation"):
        tool(bare)


def test_type_without_schema_is_refused() -> None:
    def odd(a: threading.Lock) -> None:  # type: ignore[valid-type]
        pass

    with pytest.raises(ConfigurationError):
        tool(odd)


def test_same_tool_twice_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="'add' is given twice"):
        Tools([add, add])

    def add_again(a: int) -> int:
        return a

    with pytest.raises(ConfigurationError, match="'add'"):
        Tools([add, tool(name="add")(add_again)])


def test_plain_functions_are_turned_into_tools() -> None:
    def double(n: int) -> int:
        """Double it."""
        return n * 2

    step = Tools([double])
    (definition,) = step.tools(make_session())
    assert definition.name == "double"
    assert definition.description == "Double it."


def positional_only(a: int, /) -> int:
    return a + 1


async def test_positional_only_parameters_are_refused_or_work() -> None:
    try:
        built = tool(positional_only)
    except ConfigurationError:
        return
    context = ToolContext(Runtime(), "s", "c", "k")
    assert await built.call({"a": 1}, context) == "2"


# -- validation ---------------------------------------------------------------------------------


def test_validate_returns_keyword_arguments() -> None:
    assert add.validate({"a": 1, "b": 2}) == {"a": 1, "b": 2}

    @tool
    def defaults(a: int, b: str = "x", p: Point | None = None) -> None:
        pass

    assert defaults.validate({"a": 1, "p": {"x": 3}}) == {"a": 1, "b": "x", "p": Point(3)}


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        ({"a": "1", "b": 2}, "Expected `int`, got `str`"),
        ({"a": 1}, "missing required field `b`"),
        ({"a": 1, "b": 2, "c": 3}, "unknown field `c`"),
        ([1, 2], "must be a JSON object, got list"),
        ("text", "must be a JSON object, got str"),
        (3, "must be a JSON object, got int"),
    ],
)
def test_validate_rejects(arguments: Any, fragment: str) -> None:
    with pytest.raises(ToolArgumentsError, match="'add'") as excinfo:
        add.validate(arguments)
    assert fragment in str(excinfo.value)


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ('{"a": "1", "b": 2}', "Expected `int`, got `str`"),
        ('{"a": 1}', "missing required field `b`"),
        ('{"a": 1, "b": 2, "c": 3}', "unknown field `c`"),
        ("[1, 2]", "must be a JSON object"),
        ('"a"', "must be a JSON object"),
        ("", "missing required field `a`"),
    ],
)
async def test_validation_errors_become_error_results(raw: str, fragment: str) -> None:
    called: list[int] = []

    @tool
    def add(a: int, b: int) -> int:
        called.append(1)
        return a + b

    result = await run_one(Tools([add]), ToolCallPart.parse("c1", "add", raw))
    assert result.is_error
    assert result.call_id == "c1"
    assert result.name == "add"
    assert fragment in result.content
    assert called == []


async def test_invalid_json_arguments_name_the_raw_string() -> None:
    raw = '{"a": 1, "b": '
    result = await run_one(Tools([add]), ToolCallPart.parse("c1", "add", raw))
    assert result.is_error
    assert "not valid JSON" in result.content
    assert repr(raw) in result.content


async def test_null_arguments_are_not_reported_as_invalid_json() -> None:
    result = await run_one(Tools([add]), ToolCallPart.parse("c1", "add", "null"))
    assert result.is_error
    assert "not valid JSON" not in result.content


async def test_unknown_tool_gets_an_error_result() -> None:
    result = await run_one(Tools([add, echo]), ToolCallPart.of("c1", "nope", {}))
    assert result.is_error
    assert result.call_id == "c1"
    assert "unknown tool 'nope'" in result.content
    assert "add, echo" in result.content


async def test_raising_tool_becomes_an_error_result() -> None:
    @tool
    def explode(a: int) -> str:
        raise ValueError(f"boom {a}")

    @tool
    async def explode_async() -> str:
        await anyio.lowlevel.checkpoint()
        raise KeyError("missing")

    results = await run_tools(
        Tools([explode, explode_async, add]),
        ToolCallPart.of("c1", "explode", {"a": 7}),
        ToolCallPart.of("c2", "explode_async", {}),
        ToolCallPart.of("c3", "add", {"a": 1, "b": 2}),
    )
    assert [results[c].is_error for c in ("c1", "c2", "c3")] == [True, True, False]
    assert "ValueError: boom 7" in results["c1"].content
    assert "'explode'" in results["c1"].content
    assert "KeyError" in results["c2"].content
    assert results["c3"].content == "3"


async def test_tool_raising_a_stepmachine_error_is_still_a_result() -> None:
    @tool
    def config() -> str:
        raise ConfigurationError("bad wiring")

    result = await run_one(Tools([config]), ToolCallPart.of("c1", "config", {}))
    assert result.is_error
    assert "bad wiring" in result.content


# -- running ------------------------------------------------------------------------------------


async def test_sync_tools_run_in_a_worker_thread() -> None:
    seen: list[bool] = []

    @tool
    def where() -> str:
        seen.append(threading.current_thread() is threading.main_thread())
        return "ok"

    @tool(thread=False)
    def inline() -> str:
        seen.append(threading.current_thread() is threading.main_thread())
        return "ok"

    await run_tools(Tools([where]), ToolCallPart.of("c1", "where", {}))
    await run_tools(Tools([inline]), ToolCallPart.of("c1", "inline", {}))
    assert seen == [False, True]


async def test_async_tools_run() -> None:
    result = await run_one(Tools([echo]), ToolCallPart.of("c1", "echo", {"text": "héllo"}))
    assert result == ToolResultPart(call_id="c1", content="héllo", is_error=False, name="echo")


@pytest.mark.parametrize(
    ("value", "content"),
    [
        ({"a": [1, 2]}, '{"a":[1,2]}'),
        ([1, "x", None], '[1,"x",null]'),
        (42, "42"),
        (None, "null"),
        (True, "true"),
        (Point(1, 2), '{"x":1,"y":2}'),
        ('plain "text"', 'plain "text"'),
    ],
)
async def test_results_are_json_encoded_unless_str(value: Any, content: str) -> None:
    @tool
    def give() -> Any:
        return value

    result = await run_one(Tools([give]), ToolCallPart.of("c1", "give", {}))
    assert not result.is_error
    assert result.content == content


async def test_unencodable_result_is_an_error_result() -> None:
    @tool
    def weird() -> Any:
        return object()

    result = await run_one(Tools([weird]), ToolCallPart.of("c1", "weird", {}))
    assert result.is_error


async def test_tool_context_is_injected() -> None:
    contexts: list[ToolContext] = []

    @tool
    async def spy(x: int, ctx: ToolContext) -> str:
        contexts.append(ctx)
        return str(x)

    runtime = Runtime(ids=counter_ids("id"), services={"k": "v"})
    session = session_with_calls(ToolCallPart.of("call-7", "spy", {"x": 1}), session_id="sess")
    await run_step(Tools([spy]), session, runtime=runtime)
    await run_step(Tools([spy]), session, runtime=runtime)
    first, second = contexts
    assert first.runtime is runtime
    assert first.session_id == "sess"
    assert first.call_id == "call-7"
    message_id = session.conversation[1].id
    assert first.idempotency_key == stepmachine.extend.idempotency_key("sess", "call-7", message_id)
    assert second.idempotency_key == first.idempotency_key  # stable across runs
    other = stepmachine.extend.idempotency_key("sess2", "call-7")
    assert other != first.idempotency_key
    assert stepmachine.extend.idempotency_key("sess", "call-8") != first.idempotency_key


def test_idempotency_key_does_not_collide_on_concatenation() -> None:
    assert stepmachine.extend.idempotency_key("ab", "c") != stepmachine.extend.idempotency_key(
        "a", "bc"
    )
    assert stepmachine.extend.idempotency_key("s", "c") == stepmachine.extend.idempotency_key(
        "s", "c"
    )
    assert stepmachine.extend.idempotency_key("s", "c", "m1") == stepmachine.extend.idempotency_key(
        "s", "c", "m1"
    )


def test_a_reused_call_id_in_another_message_gets_another_key() -> None:
    # Models reuse call ids (call_0 again after a compaction): another call, another key.
    assert stepmachine.extend.idempotency_key(
        "s", "call_0", "m1"
    ) != stepmachine.extend.idempotency_key("s", "call_0", "m9")


async def test_tools_emit_started_and_finished() -> None:
    check = await run_step(
        Tools([add]),
        session_with_calls(
            ToolCallPart.of("c1", "add", {"a": 1, "b": 1}),
            ToolCallPart.of("c2", "add", {"a": "x"}),
        ),
    )
    started = [e.data for e in check.events if isinstance(e.data, ToolStarted)]
    finished = [e.data for e in check.events if isinstance(e.data, ToolFinished)]
    assert {s.call_id for s in started} == {"c1", "c2"}
    assert {(f.call_id, f.is_error) for f in finished} == {("c1", False), ("c2", True)}
    assert all(e.session_id == "s1" for e in check.events)
    stamps = [(e.revision, e.seq) for e in check.events]
    assert len(set(stamps)) == len(stamps)
    # tools start only after the intents batch (revision 1) is committed
    assert all(e.revision >= 1 for e in check.events if isinstance(e.data, ToolStarted))


# -- which calls, in which order -------------------------------------------------------------------


async def test_refuses_when_no_call_is_open() -> None:
    step = Tools([add])
    assert (await run_step(step, make_session("hi"))).refused
    answered = make_session(
        "hi",
        assistant(ToolCallPart.of("c1", "add", {"a": 1, "b": 2})),
        Message(id="t", role="tool", parts=(ToolResultPart(call_id="c1", content="3"),)),
    )
    check = await run_step(step, answered)
    assert check.refused
    assert isinstance(check.outcome, Refuse)
    assert check.effects == ()
    assert check.commits == ()
    assert check.session == answered


async def test_hidden_calls_are_not_answered() -> None:
    call_message = msgspec.structs.replace(
        assistant(ToolCallPart.of("c1", "add", {"a": 1, "b": 2})), visible_to_model=False
    )
    assert (await run_step(Tools([add]), make_session("hi", call_message))).refused


async def test_two_tools_operations_answer_only_their_own_calls() -> None:
    first = Tools([add], name="math")
    second = Tools([echo], name="text")
    session = session_with_calls(
        ToolCallPart.of("c1", "echo", {"text": "a"}),
        ToolCallPart.of("c2", "add", {"a": 1, "b": 2}),
        ToolCallPart.of("c3", "mystery", {}),
    )
    runtime = Runtime(ids=counter_ids("id"))
    check = await run_step(first, session, others=[second], runtime=runtime)
    results = {r.call_id: r for r in recorded_results(check)}
    assert set(results) == {"c2", "c3"}  # its own, and the unknown tool
    assert results["c2"].content == "3"
    assert "unknown tool 'mystery'" in results["c3"].content
    assert "add, echo" in results["c3"].content  # every advertised tool is listed

    after = await run_step(second, check.session, others=[first], runtime=runtime)
    assert [r.call_id for r in recorded_results(after)] == ["c1"]
    assert history_problems(after.session.conversation) == []

    # and the first one now has nothing left
    assert (await run_step(first, after.session, others=[second], runtime=runtime)).refused


async def test_refuses_when_only_another_steps_calls_are_open() -> None:
    session = session_with_calls(ToolCallPart.of("c1", "echo", {"text": "a"}))
    check = await run_step(Tools([add], name="math"), session, others=[Tools([echo], name="t")])
    assert check.refused


async def test_each_result_is_committed_as_soon_as_its_call_finishes() -> None:
    """Tools finishing out of order: each result is its own batch, in finish order."""
    second_done = anyio.Event()

    @tool
    async def slow() -> str:
        await second_done.wait()
        return "slow"

    @tool
    async def quick() -> str:
        second_done.set()
        return "quick"

    check = await run_step(
        Tools([slow, quick]),
        session_with_calls(ToolCallPart.of("c1", "slow", {}), ToolCallPart.of("c2", "quick", {})),
    )
    finished = [e.data.call_id for e in check.events if isinstance(e.data, ToolFinished)]
    assert finished == ["c2", "c1"]  # they really finished out of order
    intents, *result_batches = check.commits
    # first one batch of intents, in call order, before any tool ran ...
    assert [(e.call_id, type(e)) for e in intents] == [("c1", Annotate), ("c2", Annotate)]  # type: ignore[attr-defined]
    # ... then one batch per result, as each call finished
    assert [results_of_batch(b) for b in result_batches] == [["c2"], ["c1"]]
    assert [r.content for r in recorded_results(check)] == ["quick", "slow"]
    assert history_problems(check.session.conversation) == []


async def test_results_are_committed_in_the_order_calls_finish() -> None:
    second_done = anyio.Event()

    @tool
    async def slow() -> str:
        await second_done.wait()
        return "slow"

    @tool
    async def quick() -> str:
        second_done.set()
        return "quick"

    check = await run_step(
        Tools([slow, quick]),
        session_with_calls(ToolCallPart.of("c1", "slow", {}), ToolCallPart.of("c2", "quick", {})),
    )
    # The journal commits each result the moment it exists: quick first.
    assert [r.call_id for r in recorded_results(check)] == ["c2", "c1"]


def results_of_batch(effects: tuple[Effect, ...]) -> list[str]:
    return [
        part.call_id
        for effect in effects
        if isinstance(effect, AppendMessage)
        for part in effect.message.tool_results
    ]


async def test_only_open_calls_are_run() -> None:
    runs: list[str] = []

    @tool
    def note(x: str) -> str:
        runs.append(x)
        return x

    session = make_session(
        "go",
        assistant(
            ToolCallPart.of("c1", "note", {"x": "one"}), ToolCallPart.of("c2", "note", {"x": "two"})
        ),
        Message(id="t1", role="tool", parts=(ToolResultPart(call_id="c1", content="one"),)),
    )
    check = await run_step(Tools([note]), session)
    assert runs == ["two"]
    assert [r.call_id for r in recorded_results(check)] == ["c2"]


async def test_calls_run_concurrently() -> None:
    started = 0
    all_started = anyio.Event()

    @tool
    async def gather() -> str:
        nonlocal started
        started += 1
        if started == 3:
            all_started.set()
        await all_started.wait()  # would hang if the calls ran one after another
        return "ok"

    results = await run_tools(
        Tools([gather]),
        *(ToolCallPart.of(f"c{i}", "gather", {}) for i in range(3)),
    )
    assert [r.content for r in results.values()] == ["ok", "ok", "ok"]


@pytest.mark.parametrize("limit", [1, 2, 3])
async def test_max_concurrency_limits_parallel_calls(limit: int) -> None:
    active = 0
    peak = 0

    @tool
    async def busy() -> str:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        for _ in range(5):
            await anyio.lowlevel.checkpoint()
        active -= 1
        return "ok"

    await run_tools(
        Tools([busy], max_concurrency=limit),
        *(ToolCallPart.of(f"c{i}", "busy", {}) for i in range(4)),
    )
    assert peak == limit


async def test_max_concurrency_one_commits_results_in_call_order() -> None:
    @tool
    async def work(n: int) -> str:
        for _ in range(5 - n):  # later calls would finish first if run concurrently
            await anyio.lowlevel.checkpoint()
        return str(n)

    check = await run_step(
        Tools([work], max_concurrency=1),
        session_with_calls(*(ToolCallPart.of(f"c{n}", "work", {"n": n}) for n in range(4))),
    )
    assert [r.call_id for r in recorded_results(check)] == ["c0", "c1", "c2", "c3"]


# -- finalize after an interruption ----------------------------------------------------------


def context_for(
    step: Tools,
    session: Session[Any],
    committer: Callable[[Session[Any], Sequence[Effect]], Awaitable[Session[Any]]] | None = None,
) -> StepContext[Any]:
    machine = StateMachine([step])
    tools, parts = machine.collect(session)

    async def apply(current: Session[Any], effects: Sequence[Effect]) -> Session[Any]:
        return apply_batch(current, effects)

    return StepContext(
        session=session,
        runtime=Runtime(ids=counter_ids("id")),
        events=EventSink(RecordingEmitter(), session.id, session.revision),
        cycle=1,
        tools=tools,
        prompt_parts=parts,
        steps=machine.steps,
        committer=committer or apply,
    )


async def test_the_machine_holds_finished_but_uncommitted_results() -> None:
    never = anyio.Event()
    c1_committed = anyio.Event()

    async def committer(current: Session[Any], effects: Sequence[Effect]) -> Session[Any]:
        answered = results_of_batch(tuple(effects))
        if "c3" in answered:
            await never.wait()  # the store write of c3's result never completes
        if "c1" in answered:
            c1_committed.set()
        return apply_batch(current, effects)

    @tool
    async def fast(n: int) -> str:
        if n == 3:
            await c1_committed.wait()
        return f"fast {n}"

    @tool
    async def stuck() -> str:
        await never.wait()
        return "never"

    step = Tools([fast, stuck])
    session = session_with_calls(
        ToolCallPart.of("c1", "fast", {"n": 1}),
        ToolCallPart.of("c2", "stuck", {}),
        ToolCallPart.of("c3", "fast", {"n": 3}),
    )
    ctx = context_for(step, session, committer)
    outcome: list[Any] = []
    held: list[Recorder] = []  # what the machine holds for finalize
    scope = anyio.CancelScope()

    async def runner() -> None:
        with scope:
            outcome.append(await carry_out(step, ctx, held))

    async with anyio.create_task_group() as tg:
        tg.start_soon(runner)
        await anyio.wait_all_tasks_blocked()
        scope.cancel()
    assert outcome == []  # the step was really interrupted
    assert scope.cancelled_caught
    # c1 was committed; c3 finished but its commit never completed; c2 never finished
    assert [c.call_id for c in open_tool_calls(ctx.session.conversation)] == ["c2", "c3"]

    effects = [e for record in held for e in record(ctx.session)]
    assert [results_of_batch((e,)) for e in effects] == [["c3"]]
    (effect,) = effects
    assert isinstance(effect, AppendMessage)
    assert effect.message.tool_results[0].content == "fast 3"
    after = apply_batch(ctx.session, effects)
    assert [c.call_id for c in open_tool_calls(after.conversation)] == ["c2"]

    # had c3's result been stored after all, its record writes nothing twice
    assert [e for record in held for e in record(after)] == []


async def test_finalize_without_a_run_or_not_interrupted_does_nothing() -> None:
    step = Tools([add])
    session = session_with_calls(ToolCallPart.of("c1", "add", {"a": 1, "b": 2}))
    assert list(await step.finalize(context_for(step, session), interrupted=True)) == []
    check = await run_step(step, session)
    assert await step.finalize(check.ctx, interrupted=False) == ()
    # a finished run committed everything: nothing left to keep
    assert list(await step.finalize(check.ctx, interrupted=True)) == []


def test_tool_called_with_a_function_keeps_its_options() -> None:
    """``tool(fn, side_effects=...)`` must not drop the options (the journal reads
    ``side_effects``: a dropped one changes what a crash re-runs)."""

    def lookup(key: str) -> str:
        """Look a key up."""
        return key

    made = tool(lookup, side_effects="pure", name="find", timeout=5.0)
    assert (made.name, made.side_effects, made.timeout) == ("find", "pure", 5.0)
    assert tool(side_effects="pure")(lookup).side_effects == "pure"


# -- at the edges, as a user meets them ----------------------------------------


def test_a_tool_made_from_a_method_in_a_class_body_gets_advice_that_helps() -> None:
    with pytest.raises(ConfigurationError) as caught:

        class Shop:
            @tool
            def price(self, item: str) -> int:
                """The price of an item."""
                return 3

    assert "self: str" not in str(caught.value)


# -- the worker thread of a sync tool -----------------------------------------------------------

_REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("test_request_id", default="")


async def test_a_sync_tool_borrows_a_token_of_anyios_default_thread_limiter() -> None:
    """One token of anyio's default limiter while it runs, given back after, and the
    caller's context variables are seen in the thread."""
    limiter = anyio.to_thread.current_default_thread_limiter()
    before = limiter.borrowed_tokens
    seen: list[tuple[int, str]] = []

    @tool
    def probe() -> str:
        borrowed = anyio.from_thread.run_sync(lambda: limiter.borrowed_tokens)
        seen.append((borrowed, _REQUEST_ID.get()))
        return "ok"

    _REQUEST_ID.set("r-1")
    assert await probe.call({}, ToolContext(Runtime(), "s", "c", "k")) == "ok"
    assert seen == [(before + 1, "r-1")]
    assert limiter.borrowed_tokens == before


async def test_sync_tools_never_run_more_threads_than_the_default_limiter_allows() -> None:
    """With anyio's default limiter at one token, concurrent sync tool calls run one at
    a time (each waits for the token in the limiter's own queue)."""
    limiter = anyio.to_thread.current_default_thread_limiter()
    limiter.total_tokens = 1
    lock = threading.Lock()
    running = [0]
    most = [0]

    @tool
    def busy(n: int) -> str:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        threading.Event().wait(0.01)  # long enough for the others to try
        with lock:
            running[0] -= 1
        return str(n)

    results: list[str] = []

    async def one(n: int) -> None:
        results.append(str(await busy.call({"n": n}, ToolContext(Runtime(), "s", f"c{n}", "k"))))

    try:
        async with anyio.create_task_group() as group:
            for n in range(4):
                group.start_soon(one, n)
    finally:
        limiter.total_tokens = 40
    assert sorted(results) == ["0", "1", "2", "3"]
    assert most == [1]
    assert limiter.borrowed_tokens == 0


async def test_a_cancelled_sync_tool_call_gives_its_token_back_at_once() -> None:
    """Cancelled while its thread runs, the call stops waiting (the thread runs on); its
    token goes back as anyio.to_thread.run_sync gives it back: at once on asyncio, when
    the thread ends on trio (trio's worker threads keep theirs until then)."""
    limiter = anyio.to_thread.current_default_thread_limiter()
    before = limiter.borrowed_tokens
    release = threading.Event()
    started = threading.Event()

    @tool
    def stuck() -> str:
        started.set()
        release.wait(10)
        return "late"

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            group.start_soon(stuck.call, {}, ToolContext(Runtime(), "s", "c", "k"))
            await anyio.to_thread.run_sync(started.wait, 10)
            scope.cancel()
    at_cancel = limiter.borrowed_tokens
    release.set()
    assert scope.cancelled_caught
    on_trio = sniffio.current_async_library() == "trio"
    assert at_cancel == (before + 1 if on_trio else before)
    for _ in range(1000):  # the thread ends as soon as it is released
        if limiter.borrowed_tokens == before:
            break
        await anyio.sleep(0.01)
    assert limiter.borrowed_tokens == before


def test_a_worker_threads_done_flag_is_waited_for_by_every_waiter() -> None:
    """``_Done`` (what the Tools step waits on after a cancellation): not set until the
    thread sets it, a wait with a timeout says so, and every waiter returns once set."""
    from stepmachine._tools import _Done

    done = _Done()
    assert not done.is_set()
    assert done.wait(0.001) is False
    results: list[bool] = []
    waiters = [threading.Thread(target=lambda: results.append(done.wait(30))) for _ in range(3)]
    for waiter in waiters:
        waiter.start()
    done.set()
    for waiter in waiters:
        waiter.join(30)
    assert results == [True, True, True]
    assert done.is_set()
    assert done.wait() is True
