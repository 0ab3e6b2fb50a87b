"""stepmachine beside LangGraph, pydantic-ai and the OpenAI Agents SDK, same agent, one process.

The agent, identical in every framework: one async tool, ``lookup_value(key)``
returning ``"value of <key>"``, and a scripted model (an async function, no
network) that answers a user message with one call of that tool (the key is
the user's text) and answers a tool result with ``"The answer is: <result>"``.
User messages are 500 bytes, so every message (call arguments, result, answer)
is about 500 bytes.

**One agent step** is one round of that conversation: the user's message goes
in, the model turn that calls the tool, the tool turn, and the model turn that
gives the final answer (two model calls, one tool call, four messages), i.e.
one ``submit`` + ``machine.run`` in stepmachine, one ``graph.ainvoke`` in
LangGraph, one ``agent.run`` in pydantic-ai, one ``Runner.run`` in the Agents
SDK. The time of a round includes the framework's persistence (checkpointer,
store, session) and history handling. Every framework is measured the same
way: a fresh session (thread, conversation) of ``--rounds`` rounds per
repetition, and the figure is, per round index, the median over repetitions,
summed over the rounds, divided by the rounds (µs per agent step). A session
preempted by another process on a shared machine spoils one round, not the
figure.

Each framework is written the way its documentation shows:

* **stepmachine**: ``StateMachine([Tools([lookup]), ModelInference(stream=False)])``,
  ``FunctionModel`` from the testing kit, ``submit`` + ``machine.run`` per round,
  on ``MemoryStore`` and on ``SQLiteStore`` (WAL, ``synchronous=NORMAL``).
  Not streaming, like every peer here (``ainvoke``, ``agent.run`` and
  ``Runner.run`` take the non-streaming model path): a streaming
  ``ModelInference`` hands the scripted model's answer over in 8-character
  chunks, one event-loop checkpoint each, which is a simulated network, not
  the framework's cost (until 2026-12 this benchmark streamed on the
  stepmachine side only).
* **LangGraph**: ``StateGraph(MessagesState)`` with a model node (a
  ``BaseChatModel`` whose ``bind_tools`` binds the tool, as provider models
  do), ``ToolNode`` and ``tools_condition``, compiled with ``InMemorySaver`` or
  with ``AsyncSqliteSaver`` (``langgraph-checkpoint-sqlite``; WAL, and
  ``synchronous=NORMAL`` set on its connection for equal durability); one
  ``thread_id`` per session.
* **pydantic-ai**: ``Agent(FunctionModel(...))`` with ``@agent.tool_plain``;
  the history is carried with ``message_history=result.all_messages()``
  (pydantic-ai has no store of its own, so it has no SQLite figure).
* **OpenAI Agents SDK**: ``Agent(model=<a Model subclass returning scripted
  responses>)`` with ``@function_tool``, ``Runner.run``; tracing disabled; the
  history is carried with ``result.to_input_list()`` (memory) or in a
  ``SQLiteSession`` on a file (its defaults: WAL, SQLite's default
  ``synchronous``, one session object per conversation).
* **bare**: a plain Python loop doing the same model and tool calls, with the
  messages as dicts in a list and the tool arguments as a JSON string.

All of them run interleaved in one process (A, B, C, ..., A, B, C, ...) after
warm-ups, so a noisy machine slows them alike; read the ratios. Before timing,
each one runs one session whose answers are checked against the expected
final answers and whose tool calls are counted (one per round), so a broken
setup cannot report a fast figure. A framework whose package is missing is
skipped with a message naming the ``bench`` extra; its figures read ``nan``.

**Concurrency**: ``--sessions`` (default 10,000) sessions started at once,
each one user message to which a model that sleeps 100 ms (``anyio.sleep``)
answers with four tool calls, one per turn, then the answer: five model
calls, four tool calls per session. stepmachine on a ``MemoryStore`` against
the bare loop doing the same calls; the figure is wall time ÷ wall time. Beside
it (not in the last line), the same stepmachine run with the cyclic garbage
collector's thresholds raised to :data:`GC_TUNED` for its duration: with
thousands of runs waiting at once, every run's coroutines and values outlive
the young generations, and full collections over all of them take much of
the wall time; the row shows what the tuning the performance guide describes
gives on this machine.

Run:  python benchmarks/peers.py [--quick] [--json FILE] [--plot]

The last line is
``stream_delta_us=<f> vs_langgraph=<f> vs_langgraph_minimal=<f> vs_pydantic_ai=<f>
vs_openai_agents=<f> sqlite_vs_langgraph=<f> concurrent_10k_over_bare=<f>`` (on one
line): stepmachine's µs per agent step ÷ the peer's, same run (memory variants;
``vs_langgraph_minimal`` against a hand-built two-node LangGraph graph without a
checkpointer; ``sqlite_vs_langgraph`` is stepmachine on SQLite ÷ LangGraph with its
SQLite checkpointer); below 1 means stepmachine is cheaper. ``stream_delta_us`` is
what streaming adds per delta: (stepmachine streaming - stepmachine) minus (bare
streaming - bare), per delta of a step (the scripted model's 8-character pieces of
the tool call's arguments and of the answer, one checkpoint each in both).
``--plot`` also rewrites the results section and plot of ``benchmarks/README.md``
(as ``benchmarks/report.py`` does).

Before the last line, ``thread_us=<f>`` is what the worker thread of the
plain-function tool costs in a stepmachine step, measured in the same run: the
step with that tool minus the step with the same tool written ``async def``
(the "stepmachine async tool" row), and that cost as a fraction of each peer's
whole step. The line after it times a bare hop (``anyio.to_thread.run_sync`` of a
no-op) right after another one and after 400 µs of work on the event loop: what
a hop costs on this machine without any framework around it.
"""

# The peers are optional (the bench extra): each is imported where it is set up.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import anyio
import anyio.lowlevel

from stepmachine import (
    AppendMessage,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    SideEffects,
    StateMachine,
    Tools,
    submit,
    tool,
)
from stepmachine.stores import MemoryStore, SQLiteStore
from stepmachine.testing import FunctionModel, call, reply

MESSAGE_BYTES = 500
INSTRUCTIONS = "You answer questions by looking them up."
BENCH_EXTRA = "pip install -e '.[bench]'"
CONCURRENT_TOOL_CALLS = 4  # then the answer: five model calls per session
MODEL_SLEEP_S = 0.1


# -- the agent, shared by every framework ------------------------------------------


class ToolCounter:
    """Counts the calls of the tool (checked against the rounds run)."""

    calls = 0


class Seen:
    """What the scripted models saw, recorded only while a setup is verified.

    ``users`` is the number of user messages in the last model request: a setup
    that dropped the history between rounds would see 1 instead of the rounds run.
    """

    enabled = False
    users = 0


def saw(users: Callable[[], int]) -> None:
    """Record the user messages a model request holds (only while verifying)."""
    if Seen.enabled:
        Seen.users = users()


async def lookup_value(key: str) -> str:
    """Look up the value stored under ``key``."""
    ToolCounter.calls += 1
    return f"value of {key}"


def lookup_value_sync(key: str) -> str:
    """``lookup_value`` as a README user writes a tool: a plain function (a worker thread)."""
    ToolCounter.calls += 1
    return f"value of {key}"


def user_text(r: int) -> str:
    """The user's message of round ``r``: exactly ``MESSAGE_BYTES`` bytes."""
    head = f"question {r}: "
    return head + "x" * (MESSAGE_BYTES - len(head))


def answer_text(result: str) -> str:
    """The scripted model's final answer to a tool result."""
    return f"The answer is: {result}"


def expected_answers(rounds: int) -> list[str]:
    """The final answer of each round, as the scripted agent must give it."""
    return [answer_text(f"value of {user_text(r)}") for r in range(rounds)]


@dataclass
class Runner:
    """One framework (and variant) under measurement.

    ``session(rounds)`` runs one fresh session and returns the nanoseconds of
    each round and each round's final answer.
    """

    name: str
    variant: str  # "memory" or "sqlite"
    session: Callable[[int], Awaitable[tuple[list[int], list[str]]]]
    close: Callable[[], Awaitable[None]] | None = None
    concurrent: Callable[[int], Awaitable[str]] | None = None  # one concurrency session

    @property
    def label(self) -> str:
        """``name (variant)``."""
        return f"{self.name} ({self.variant})"


class SkippedError(Exception):
    """A framework could not be set up (its package is missing)."""


def missing(package: str, error: ImportError) -> SkippedError:
    """The skip message naming the ``bench`` extra."""
    return SkippedError(
        f"skipped: {package} is not installed ({error}); install the bench extra: {BENCH_EXTRA}"
    )


# -- bare --------------------------------------------------------------------------


async def bare_decide(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The scripted model over plain dict messages."""
    saw(lambda: sum(1 for m in messages if m["role"] == "user"))
    last = messages[-1]
    if last["role"] == "user":
        arguments = json.dumps({"key": last["content"]})
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": uuid.uuid4().hex, "name": "lookup_value", "arguments": arguments}
            ],
        }
    return {"role": "assistant", "content": answer_text(last["content"])}


async def bare_round(
    messages: list[dict[str, Any]],
    text: str,
    on_delta: Callable[[object], Awaitable[None]] | None = None,
) -> str:
    """One round of the agent as a plain loop; returns the final answer.

    ``on_delta``: the model's turns are handed over in 8-character pieces, a
    checkpoint before each (as the scripted model streams).
    """
    tools = {"lookup_value": lookup_value}
    messages.append({"role": "user", "content": text})
    while True:
        turn = await bare_decide(messages)
        if on_delta is not None:
            streamed = (
                "".join(c["arguments"] for c in turn.get("tool_calls", ())) or turn["content"]
            )
            for start in range(0, len(streamed), 8):
                await anyio.lowlevel.checkpoint()
                await on_delta(streamed[start : start + 8])
        messages.append(turn)
        calls = turn.get("tool_calls")
        if not calls:
            return str(turn["content"])
        for tool_call in calls:
            result = await tools[tool_call["name"]](**json.loads(tool_call["arguments"]))
            messages.append({"role": "tool", "tool_call_id": tool_call["id"], "content": result})


async def bare_runner() -> Runner:
    """The bare Python loop."""

    async def session(rounds: int) -> tuple[list[int], list[str]]:
        messages: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS}]
        elapsed, answers = [], []
        for r in range(rounds):
            start = time.perf_counter_ns()
            answers.append(await bare_round(messages, user_text(r)))
            elapsed.append(time.perf_counter_ns() - start)
        return elapsed, answers

    return Runner("bare loop", "memory", session)


# -- stepmachine -------------------------------------------------------------------


async def stepmachine_runner(
    variant: str, folder: Path, *, stream: bool = False, thread: bool = True, pure: bool = False
) -> Runner:
    """stepmachine on a MemoryStore or an SQLiteStore, configured as the README shows.

    The default configuration a README user gets: a plain-function ``@tool``
    (run in a worker thread), the runtime's default ids, the machine's
    default lease, observability off. ``stream``: ``ModelInference(stream=True)``
    (the scripted model hands its answer over in 8-character deltas, one
    event-loop checkpoint each; see ``stream_delta_us``). ``thread=False``: the
    tool is the same function written ``async def`` (no worker thread), to show
    what the worker thread costs inside a step (``thread_us``). ``pure`` (with
    ``thread=False``): the tool is also declared ``side_effects="pure"``, so it
    gets no durable intent before it runs (one batch fewer per step): the
    cheapest configuration, for a tool that only reads.
    """

    async def decide(request: ModelRequest) -> ModelResponse:
        saw(lambda: sum(1 for m in request.messages if m.role == "user"))
        last = request.messages[-1]
        if last.role == "user":
            return call(("lookup_value", {"key": last.text}))
        return reply(answer_text(str(last.tool_results[0].content)))

    function = lookup_value_sync if thread else lookup_value
    side_effects: SideEffects = "pure" if pure else "non_idempotent"
    store: Any
    if variant == "memory":
        store = MemoryStore()
    else:
        store = await SQLiteStore.open(folder / "stepmachine.sqlite3")
    runtime = Runtime(store=store, model=FunctionModel(decide))
    machine: StateMachine[Any] = StateMachine(
        [
            Tools([tool(name="lookup_value", side_effects=side_effects)(function)]),
            ModelInference(instructions=INSTRUCTIONS, stream=stream),
        ]
    )

    async def session(rounds: int) -> tuple[list[int], list[str]]:
        session_id = uuid.uuid4().hex
        elapsed, answers = [], []
        for r in range(rounds):
            start = time.perf_counter_ns()
            if r == 0:  # creating the session is part of the first step, as in the peers
                await store.create(session_id)
            await submit(
                store, session_id, [AppendMessage(Message.user(user_text(r), id=runtime.ids()))]
            )
            result = await machine.run(runtime, session_id)
            elapsed.append(time.perf_counter_ns() - start)
            answers.append(result.conversation[-1].text)
        return elapsed, answers

    close = None if variant == "memory" else store.aclose
    name = "stepmachine streaming" if stream else "stepmachine"
    if not thread:
        name = "stepmachine async pure tool" if pure else "stepmachine async tool"
    return Runner(name, variant, session, close)


def deltas_per_step() -> int:
    """The deltas one streaming step hands over: the call's and the answer's 8-character pieces."""
    arguments = json.dumps({"key": user_text(0)})
    answer = answer_text(f"value of {user_text(0)}")
    return math.ceil(len(arguments) / 8) + math.ceil(len(answer) / 8)


async def bare_streaming_runner() -> Runner:
    """The bare loop, with the model's turns handed over in the same 8-character deltas.

    The same checkpoint per delta as the scripted model's streaming (the
    simulated network), delivered to a callback that does nothing: what is
    left of stepmachine's streaming figure over this one is its cost per delta.
    """

    async def drop(chunk: object) -> None:
        return None

    async def session(rounds: int) -> tuple[list[int], list[str]]:
        messages: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS}]
        elapsed, answers = [], []
        for r in range(rounds):
            start = time.perf_counter_ns()
            answers.append(await bare_round(messages, user_text(r), on_delta=drop))
            elapsed.append(time.perf_counter_ns() - start)
        return elapsed, answers

    return Runner("bare loop streaming", "memory", session)


# -- LangGraph ---------------------------------------------------------------------


async def langgraph_runner(variant: str, folder: Path, *, sleepy: bool = False) -> Runner:
    """LangGraph: StateGraph(MessagesState) + ToolNode + a checkpointer.

    ``sleepy``: the concurrency agent instead (the model sleeps 100 ms and
    calls the tool four times before answering); use the runner's ``concurrent``.
    """
    try:
        from langchain_core.language_models.chat_models import BaseChatModel
        from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
        from langchain_core.outputs import ChatGeneration, ChatResult
        from langchain_core.tools import tool as lc_tool
        from langchain_core.utils.function_calling import convert_to_openai_tool
        from langgraph.checkpoint.memory import InMemorySaver
        from langgraph.graph import START, MessagesState, StateGraph
        from langgraph.prebuilt import ToolNode, tools_condition
    except ImportError as error:
        raise missing("langgraph", error) from error
    saver_context: Any = None
    if variant == "sqlite":
        try:
            from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
        except ImportError as error:
            raise missing("langgraph-checkpoint-sqlite", error) from error
        saver_context = AsyncSqliteSaver.from_conn_string(str(folder / "langgraph.sqlite3"))

    class ScriptedChatModel(BaseChatModel):
        """A chat model answering with the scripted agent's turns."""

        @property
        def _llm_type(self) -> str:
            return "scripted"

        def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
            return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)

        def _turn(self, messages: list[BaseMessage]) -> ChatResult:
            if sleepy:
                done = sum(1 for m in messages if isinstance(m, ToolMessage))
                if done < CONCURRENT_TOOL_CALLS:
                    calls = [{"name": "lookup_value", "args": {"key": str(done)}, "id": _call_id()}]
                    message = AIMessage(content="", tool_calls=calls)
                else:
                    message = AIMessage(content=answer_text(str(messages[-1].content)))
                return ChatResult(generations=[ChatGeneration(message=message)])
            saw(lambda: sum(1 for m in messages if isinstance(m, HumanMessage)))
            last = messages[-1]
            if isinstance(last, HumanMessage):
                calls = [{"name": "lookup_value", "args": {"key": last.content}, "id": _call_id()}]
                message = AIMessage(content="", tool_calls=calls)
            elif isinstance(last, ToolMessage):
                message = AIMessage(content=answer_text(str(last.content)))
            else:
                raise TypeError(f"unexpected last message {last!r}")
            return ChatResult(generations=[ChatGeneration(message=message)])

        def _generate(
            self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kw: Any
        ) -> ChatResult:
            return self._turn(messages)

        async def _agenerate(
            self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kw: Any
        ) -> ChatResult:
            if sleepy:
                await anyio.sleep(MODEL_SLEEP_S)
            return self._turn(messages)

    lookup = lc_tool(lookup_value)
    model = ScriptedChatModel().bind_tools([lookup])

    async def call_model(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("model", call_model)
    builder.add_node("tools", ToolNode([lookup]))
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", tools_condition)
    builder.add_edge("tools", "model")
    if saver_context is None:
        checkpointer: Any = InMemorySaver()
        close = None
    else:
        checkpointer = await saver_context.__aenter__()
        # Equal durability with stepmachine's SQLiteStore: WAL + synchronous=NORMAL.
        await checkpointer.conn.execute("PRAGMA synchronous=NORMAL")

        async def close() -> None:
            await saver_context.__aexit__(None, None, None)

    graph = builder.compile(checkpointer=checkpointer)

    async def session(rounds: int) -> tuple[list[int], list[str]]:
        config: Any = {"configurable": {"thread_id": uuid.uuid4().hex}}
        elapsed, answers = [], []
        for r in range(rounds):
            start = time.perf_counter_ns()
            if r == 0:
                first = {"messages": [("system", INSTRUCTIONS), ("user", user_text(r))]}
                state = await graph.ainvoke(first, config)
            else:
                state = await graph.ainvoke({"messages": [("user", user_text(r))]}, config)
            elapsed.append(time.perf_counter_ns() - start)
            answers.append(str(state["messages"][-1].content))
        return elapsed, answers

    async def concurrent(index: int) -> str:
        config: Any = {"configurable": {"thread_id": f"c{index}"}}
        state = await graph.ainvoke({"messages": [("user", user_text(index))]}, config)
        return str(state["messages"][-1].content)

    return Runner("LangGraph", variant, session, close, concurrent=concurrent)


class State(TypedDict):
    """The minimal LangGraph graph's state (module level: LangGraph reads the hints)."""

    messages: list[dict[str, Any]]


async def langgraph_minimal_runner() -> Runner:
    """LangGraph at its leanest: a hand-built two-node graph, no checkpointer.

    ``StateGraph`` over a ``TypedDict`` holding the bare loop's dict messages,
    a model node (the bare loop's scripted model), a tool node that runs the
    calls, a conditional edge between them; compiled without a checkpointer, so
    the caller carries the history (the state ``ainvoke`` returns) from round
    to round. Nothing is stored: the figure is LangGraph's graph machinery.
    """
    try:
        from langgraph.graph import END, START, StateGraph
    except ImportError as error:
        raise missing("langgraph", error) from error

    async def model_node(state: State) -> dict[str, Any]:
        return {"messages": [*state["messages"], await bare_decide(state["messages"])]}

    async def tools_node(state: State) -> dict[str, Any]:
        results = [
            {
                "role": "tool",
                "tool_call_id": c["id"],
                "content": await lookup_value(**json.loads(c["arguments"])),
            }
            for c in state["messages"][-1]["tool_calls"]
        ]
        return {"messages": [*state["messages"], *results]}

    def route(state: State) -> str:
        return "tools" if state["messages"][-1].get("tool_calls") else END

    builder = StateGraph(State)
    builder.add_node("model", model_node)
    builder.add_node("tools", tools_node)
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", route, ["tools", END])
    builder.add_edge("tools", "model")
    graph = builder.compile()

    async def session(rounds: int) -> tuple[list[int], list[str]]:
        messages: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS}]
        elapsed, answers = [], []
        for r in range(rounds):
            start = time.perf_counter_ns()
            user = {"role": "user", "content": user_text(r)}
            state = await graph.ainvoke({"messages": [*messages, user]})
            messages = state["messages"]
            elapsed.append(time.perf_counter_ns() - start)
            answers.append(str(messages[-1]["content"]))
        return elapsed, answers

    return Runner("LangGraph minimal", "memory", session)


_CALLS = [0]


def _call_id() -> str:
    """A fresh tool call id."""
    _CALLS[0] += 1
    return f"call_{_CALLS[0]}"


# -- pydantic-ai -------------------------------------------------------------------


async def pydantic_ai_runner() -> Runner:
    """pydantic-ai: Agent(FunctionModel) with a plain tool; history passed back in."""
    try:
        from pydantic_ai import Agent
        from pydantic_ai.messages import (
            ModelMessage,
            ModelRequest,
            ModelResponse,
            TextPart,
            ToolCallPart,
            ToolReturnPart,
            UserPromptPart,
        )
        from pydantic_ai.models.function import AgentInfo, FunctionModel
    except ImportError as error:
        raise missing("pydantic-ai-slim", error) from error

    async def decide(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        saw(
            lambda: sum(
                1
                for m in messages
                if isinstance(m, ModelRequest)
                for p in m.parts
                if isinstance(p, UserPromptPart)
            )
        )
        last = messages[-1]
        assert isinstance(last, ModelRequest)
        part = last.parts[-1]
        if isinstance(part, UserPromptPart):
            tool_call = ToolCallPart(tool_name="lookup_value", args={"key": part.content})
            return ModelResponse(parts=[tool_call])
        if isinstance(part, ToolReturnPart):
            return ModelResponse(parts=[TextPart(answer_text(str(part.content)))])
        raise AssertionError(f"unexpected last part {part!r}")

    agent = Agent(FunctionModel(decide), instructions=INSTRUCTIONS)
    agent.tool_plain(lookup_value)

    async def session(rounds: int) -> tuple[list[int], list[str]]:
        history: list[ModelMessage] = []
        elapsed, answers = [], []
        for r in range(rounds):
            start = time.perf_counter_ns()
            result = await agent.run(user_text(r), message_history=history)
            history = result.all_messages()
            elapsed.append(time.perf_counter_ns() - start)
            answers.append(result.output)
        return elapsed, answers

    return Runner("pydantic-ai", "memory", session)


# -- OpenAI Agents SDK -------------------------------------------------------------


async def openai_agents_runner(variant: str, folder: Path) -> Runner:
    """OpenAI Agents SDK: Agent + function_tool + a scripted Model, tracing disabled."""
    try:
        from agents import (
            Agent,
            Model,
            ModelResponse,
            SQLiteSession,
            Usage,
            function_tool,
            set_tracing_disabled,
        )
        from agents import (
            Runner as AgentsRunner,
        )
        from openai.types.responses import (
            ResponseFunctionToolCall,
            ResponseOutputMessage,
            ResponseOutputText,
        )
    except ImportError as error:
        raise missing("openai-agents", error) from error
    set_tracing_disabled(True)

    class ScriptedModel(Model):
        """A Model answering with the scripted agent's turns, in Responses items."""

        async def get_response(
            self,
            system_instructions: Any,
            input: Any,  # noqa: A002  (the Model interface's name: passed by keyword)
            *a: Any,
            **k: Any,
        ) -> Any:
            saw(lambda: sum(1 for item in input if item.get("role") == "user"))
            last = input[-1]
            if last.get("type") == "function_call_output":
                text = answer_text(str(last["output"]))
                message = ResponseOutputMessage(
                    id=f"msg_{_call_id()}",
                    type="message",
                    role="assistant",
                    status="completed",
                    content=[ResponseOutputText(text=text, type="output_text", annotations=[])],
                )
                return ModelResponse(output=[message], usage=Usage(), response_id=None)
            if last.get("role") == "user":
                call_id = _call_id()
                tool_call = ResponseFunctionToolCall(
                    id=f"fc_{call_id}",
                    call_id=call_id,
                    type="function_call",
                    name="lookup_value",
                    arguments=json.dumps({"key": last["content"]}),
                )
                return ModelResponse(output=[tool_call], usage=Usage(), response_id=None)
            raise AssertionError(f"unexpected last input item {last!r}")

        def stream_response(self, *a: Any, **k: Any) -> Any:
            raise NotImplementedError("the benchmark does not stream")

    agent = Agent(
        name="bench",
        instructions=INSTRUCTIONS,
        model=ScriptedModel(),
        tools=[function_tool(lookup_value)],
    )
    database = folder / "openai_agents.sqlite3"

    async def session(rounds: int) -> tuple[list[int], list[str]]:
        elapsed, answers = [], []
        if variant == "memory":
            items: list[Any] = []
            for r in range(rounds):
                start = time.perf_counter_ns()
                result = await AgentsRunner.run(
                    agent, [*items, {"role": "user", "content": user_text(r)}]
                )
                items = result.to_input_list()
                elapsed.append(time.perf_counter_ns() - start)
                answers.append(str(result.final_output))
            return elapsed, answers
        stored = SQLiteSession(uuid.uuid4().hex, database)
        try:
            for r in range(rounds):
                start = time.perf_counter_ns()
                result = await AgentsRunner.run(agent, user_text(r), session=stored)
                elapsed.append(time.perf_counter_ns() - start)
                answers.append(str(result.final_output))
        finally:
            stored.close()
        return elapsed, answers

    return Runner("OpenAI Agents SDK", variant, session)


# -- measuring ---------------------------------------------------------------------


@dataclass
class Figures:
    """One runner's samples: ``rounds[s][r]`` is round ``r`` of session ``s``, in ns."""

    runner: Runner
    rounds: list[list[int]] = field(default_factory=list)

    @property
    def step_us(self) -> float:
        """Per round index the median over sessions, summed, per round, in µs."""
        if not self.rounds:
            return math.nan
        count = len(self.rounds[0])
        medians = [statistics.median(s[r] for s in self.rounds) for r in range(count)]
        return sum(medians) / (count * 1_000)


async def verify(runner: Runner, rounds: int) -> None:
    """Run one session and check its answers and tool calls; raise SystemExit if wrong."""
    before = ToolCounter.calls
    Seen.enabled, Seen.users = True, 0
    try:
        _, answers = await runner.session(rounds)
    finally:
        Seen.enabled = False
    calls = ToolCounter.calls - before
    if Seen.users != rounds:
        raise SystemExit(
            f"{runner.label}: the model saw {Seen.users} user messages in round {rounds}"
        )
    if answers != expected_answers(rounds):
        raise SystemExit(f"{runner.label}: wrong final answers: {answers[:1]!r}...")
    if calls != rounds:
        raise SystemExit(f"{runner.label}: the tool ran {calls} times in {rounds} rounds")


async def make_runners(folder: Path) -> list[Runner]:
    """Every runner that can be set up; skipped ones are reported."""
    makers: list[tuple[str, Callable[[], Awaitable[Runner]]]] = [
        ("bare loop", bare_runner),
        ("stepmachine (memory)", lambda: stepmachine_runner("memory", folder)),
        ("stepmachine (sqlite)", lambda: stepmachine_runner("sqlite", folder)),
        ("bare loop streaming", bare_streaming_runner),
        ("stepmachine streaming", lambda: stepmachine_runner("memory", folder, stream=True)),
        ("stepmachine async tool", lambda: stepmachine_runner("memory", folder, thread=False)),
        (
            "stepmachine async pure tool",
            lambda: stepmachine_runner("memory", folder, thread=False, pure=True),
        ),
        ("LangGraph (memory)", lambda: langgraph_runner("memory", folder)),
        ("LangGraph minimal (memory)", langgraph_minimal_runner),
        ("LangGraph (sqlite)", lambda: langgraph_runner("sqlite", folder)),
        ("pydantic-ai (memory)", pydantic_ai_runner),
        ("OpenAI Agents SDK (memory)", lambda: openai_agents_runner("memory", folder)),
        ("OpenAI Agents SDK (sqlite)", lambda: openai_agents_runner("sqlite", folder)),
    ]
    runners = []
    for label, make in makers:
        try:
            runners.append(await make())
        except SkippedError as skipped:
            print(f"  {label}: {skipped}")
    return runners


async def measure(opts: Options, folder: Path) -> list[Figures]:
    """Verify, warm up, then time every runner interleaved."""
    runners = await make_runners(folder)
    try:
        for runner in runners:
            await verify(runner, opts.rounds)
        print(f"  checked: {len(runners)} setups give the expected answers, one tool call a round")
        for _ in range(opts.warmup):
            for runner in runners:
                await runner.session(opts.rounds)
        figures = [Figures(runner) for runner in runners]
        gc.collect()
        gc.freeze()
        try:
            for _ in range(opts.repetitions):
                for figure in figures:
                    figure.rounds.append((await figure.runner.session(opts.rounds))[0])
        finally:
            gc.unfreeze()
    finally:
        for runner in runners:
            if runner.close is not None:
                await runner.close()
    return figures


# -- concurrency -------------------------------------------------------------------


async def concurrent_bare(sessions: int) -> float:
    """Wall seconds of ``sessions`` concurrent bare sessions (five 100 ms model calls each)."""

    async def decide(messages: list[dict[str, Any]]) -> dict[str, Any]:
        await anyio.sleep(MODEL_SLEEP_S)
        done = sum(1 for m in messages if m["role"] == "tool")
        if done < CONCURRENT_TOOL_CALLS:
            arguments = json.dumps({"key": str(done)})
            calls = [{"id": uuid.uuid4().hex, "name": "lookup_value", "arguments": arguments}]
            return {"role": "assistant", "content": "", "tool_calls": calls}
        return {"role": "assistant", "content": answer_text(messages[-1]["content"])}

    answers: list[str] = []

    async def one(index: int) -> None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": user_text(index)}]
        while True:
            turn = await decide(messages)
            messages.append(turn)
            if not turn.get("tool_calls"):
                answers.append(turn["content"])
                return
            for tool_call in turn["tool_calls"]:
                result = await lookup_value(**json.loads(tool_call["arguments"]))
                messages.append(
                    {"role": "tool", "tool_call_id": tool_call["id"], "content": result}
                )

    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        for index in range(sessions):
            group.start_soon(one, index)
    wall = time.perf_counter() - start
    check_concurrent("bare loop", answers, sessions)
    return wall


async def concurrent_stepmachine(sessions: int) -> float:
    """Wall seconds of ``sessions`` concurrent stepmachine sessions on one MemoryStore."""

    async def decide(request: ModelRequest) -> ModelResponse:
        await anyio.sleep(MODEL_SLEEP_S)
        done = sum(1 for m in request.messages if m.role == "tool")
        if done < CONCURRENT_TOOL_CALLS:
            return call(("lookup_value", {"key": str(done)}))
        return reply(answer_text(str(request.messages[-1].tool_results[0].content)))

    store = MemoryStore()
    runtime = Runtime(store=store, model=FunctionModel(decide))
    machine: StateMachine[Any] = StateMachine(
        [Tools([tool(lookup_value)]), ModelInference(stream=False)]
    )
    answers: list[str] = []

    async def one(index: int) -> None:
        session_id = f"s{index}"
        await store.create(
            session_id, conversation=[Message.user(user_text(index), id=runtime.ids())]
        )
        answers.append((await machine.run(runtime, session_id)).conversation[-1].text)

    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        for index in range(sessions):
            group.start_soon(one, index)
    wall = time.perf_counter() - start
    check_concurrent("stepmachine", answers, sessions)
    return wall


GC_TUNED = (50_000, 20, 10)
"""``gc.set_threshold`` for the "stepmachine, gc tuned" concurrency row: young
collections every 50,000 allocations instead of 700 (and full ones after 20 x 10
of them instead of 10 x 10)."""


async def concurrent_stepmachine_gc_tuned(sessions: int) -> float:
    """:func:`concurrent_stepmachine` with the collector's thresholds at :data:`GC_TUNED`."""
    before = gc.get_threshold()
    gc.set_threshold(*GC_TUNED)
    try:
        return await concurrent_stepmachine(sessions)
    finally:
        gc.set_threshold(*before)


async def concurrent_langgraph(sessions: int) -> float:
    """Wall seconds of ``sessions`` concurrent LangGraph sessions on one InMemorySaver."""
    runner = await langgraph_runner("memory", Path(), sleepy=True)
    assert runner.concurrent is not None
    one = runner.concurrent
    answers: list[str] = []

    async def run(index: int) -> None:
        answers.append(await one(index))

    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        for index in range(sessions):
            group.start_soon(run, index)
    wall = time.perf_counter() - start
    check_concurrent("LangGraph", answers, sessions)
    return wall


HOP_WORK_US = 400
"""The work on the event loop before each hop of ``hop_us``'s second figure: about
what a stepmachine step does between two calls of its tool."""


async def hop_us(samples: int) -> dict[str, float]:
    """Median µs of one worker-thread hop (``anyio.to_thread.run_sync`` of a no-op):
    ``back_to_back`` (right after another hop: the thread and the loop never idle),
    and ``after_work`` (after :data:`HOP_WORK_US` µs of work on the event loop, while
    the worker waits for a job). The difference is what waking an idle thread costs
    on this machine."""

    def noop() -> None:
        return None

    def work() -> None:
        end = time.perf_counter_ns() + HOP_WORK_US * 1000
        while time.perf_counter_ns() < end:
            pass

    for _ in range(50):  # warm-up: the worker thread exists
        await anyio.to_thread.run_sync(noop)
    timed: dict[str, list[float]] = {"back_to_back": [], "after_work": []}
    for _ in range(samples):  # interleaved, so a noisy moment slows both alike
        for kind, times in timed.items():
            if kind == "after_work":
                work()
            else:
                await anyio.to_thread.run_sync(noop)  # the hop before: the thread is awake
            start = time.perf_counter_ns()
            await anyio.to_thread.run_sync(noop)
            times.append((time.perf_counter_ns() - start) / 1000)
    return {kind: statistics.median(times) for kind, times in timed.items()}


def check_concurrent(name: str, answers: list[str], sessions: int) -> None:
    """Every session ended with the answer to its last tool result."""
    expected = answer_text(f"value of {CONCURRENT_TOOL_CALLS - 1}")
    if len(answers) != sessions or any(a != expected for a in answers):
        raise SystemExit(f"{name}: concurrent sessions did not all give {expected!r}")


# -- output ------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """The command line, parsed."""

    rounds: int
    repetitions: int
    warmup: int
    sessions: int
    json_path: Path | None
    plot: bool
    concurrent_langgraph: bool
    hop_samples: int  # hops timed per kind (hop_us)


def parse(argv: list[str]) -> Options:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="a short run (a few seconds)")
    parser.add_argument("--rounds", type=int, default=None, help="agent steps per session")
    parser.add_argument("--repetitions", type=int, default=None, help="timed sessions per setup")
    parser.add_argument("--warmup", type=int, default=None, help="untimed sessions per setup")
    parser.add_argument(
        "--sessions", type=int, default=None, help="concurrent sessions (0: skip; default 10000)"
    )
    parser.add_argument(
        "--concurrent-langgraph",
        action="store_true",
        help="also run the concurrent sessions through LangGraph (InMemorySaver); slow",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument(
        "--plot", action="store_true", help="rewrite benchmarks/README.md's results and plot"
    )
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 10)
    repetitions = args.repetitions or (5 if args.quick else 200)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 10)
    sessions = args.sessions if args.sessions is not None else (200 if args.quick else 10_000)
    if rounds < 1 or repetitions < 1 or sessions < 0:
        parser.error("--rounds and --repetitions must be at least 1, --sessions at least 0")
    hop_samples = 20 if args.quick else 500
    return Options(
        rounds,
        repetitions,
        warmup,
        sessions,
        args.json,
        args.plot,
        args.concurrent_langgraph,
        hop_samples,
    )


def find(figures: list[Figures], name: str, variant: str) -> float:
    """A runner's µs per agent step, nan when it was skipped."""
    for figure in figures:
        if figure.runner.name == name and figure.runner.variant == variant:
            return figure.step_us
    return math.nan


def summary(figures: list[Figures], concurrent: dict[str, float]) -> dict[str, float]:
    """The last line's figures."""
    sm, sm_sqlite = find(figures, "stepmachine", "memory"), find(figures, "stepmachine", "sqlite")
    bare_wall = concurrent.get("bare loop", math.nan)
    streaming = find(figures, "stepmachine streaming", "memory") - sm
    bare_streaming = find(figures, "bare loop streaming", "memory") - find(
        figures, "bare loop", "memory"
    )
    return {
        "stream_delta_us": (streaming - bare_streaming) / deltas_per_step(),
        "vs_langgraph": sm / find(figures, "LangGraph", "memory"),
        "vs_langgraph_minimal": sm / find(figures, "LangGraph minimal", "memory"),
        "vs_pydantic_ai": sm / find(figures, "pydantic-ai", "memory"),
        "vs_openai_agents": sm / find(figures, "OpenAI Agents SDK", "memory"),
        "sqlite_vs_langgraph": sm_sqlite / find(figures, "LangGraph", "sqlite"),
        "concurrent_10k_over_bare": concurrent.get("stepmachine", math.nan) / bare_wall
        if bare_wall
        else math.nan,
    }


def print_table(figures: list[Figures], bare: float) -> None:
    """µs per agent step, memory and SQLite columns, ratios to the bare loop."""
    names = list(dict.fromkeys(f.runner.name for f in figures))
    print(
        f"{'framework':28s} {'memory us/step':>15s} {'x bare':>8s} {'sqlite us/step':>15s} "
        f"{'x bare':>8s}"
    )
    for name in names:
        cells = []
        for variant in ("memory", "sqlite"):
            us = find(figures, name, variant)
            cells.append(
                "—".rjust(15) + "—".rjust(9) if math.isnan(us) else f"{us:15.1f} {us / bare:8.1f}"
            )
        print(f"{name:28s} {cells[0]} {cells[1]}")


def main(argv: list[str]) -> None:
    """Measure, print the table, then the summary line last."""
    opts = parse(argv)
    load_at_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    print(
        f"peers benchmark: python={sys.version.split()[0]} rounds={opts.rounds} "
        f"repetitions={opts.repetitions} warmup={opts.warmup} sessions={opts.sessions}"
    )
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        figures: list[Figures] = anyio.run(measure, opts, Path(tmp), backend="asyncio")
    bare = find(figures, "bare loop", "memory")
    print(
        f"µs per agent step (user message -> model calls the tool -> tool -> model answers; "
        f"{MESSAGE_BYTES}-byte messages, {opts.rounds} steps per session, median of "
        f"{opts.repetitions} sessions per step index):"
    )
    print_table(figures, bare)
    thread = find(figures, "stepmachine", "memory") - find(
        figures, "stepmachine async tool", "memory"
    )
    print(
        f"thread_us={thread:.1f}: what the plain-function tool's worker thread costs in a "
        "stepmachine step (stepmachine - stepmachine async tool), "
        + ", ".join(
            f"{thread / us:.3f}x {peer}'s step"
            for peer in ("LangGraph", "pydantic-ai", "OpenAI Agents SDK")
            if not math.isnan(us := find(figures, peer, "memory"))
        )
    )
    hops = anyio.run(hop_us, opts.hop_samples, backend="asyncio")
    print(
        "  a bare hop (anyio.to_thread.run_sync of a no-op, median of "
        f"{opts.hop_samples}): {hops['back_to_back']:.1f} us back to back, "
        f"{hops['after_work']:.1f} us after {HOP_WORK_US} us of work on the event loop "
        "(the worker idle meanwhile, as between two tool calls)"
    )
    concurrent: dict[str, float] = {}
    if opts.sessions:
        runs: list[tuple[str, Callable[[int], Awaitable[float]]]] = [
            ("bare loop", concurrent_bare),
            ("stepmachine", concurrent_stepmachine),
            ("stepmachine, gc tuned", concurrent_stepmachine_gc_tuned),
        ]
        if opts.concurrent_langgraph:
            runs.append(("LangGraph", concurrent_langgraph))
        print(
            f"{opts.sessions} concurrent sessions x 5 calls of a {MODEL_SLEEP_S * 1000:.0f} ms "
            "model, memory store (wall time):"
        )
        for name, run in runs:
            gc.collect()
            try:
                concurrent[name] = anyio.run(run, opts.sessions, backend="asyncio")
            except SkippedError as skipped:
                print(f"  {name}: {skipped}")
                continue
            ratio = concurrent[name] / concurrent["bare loop"]
            print(f"  {name:22s} {concurrent[name]:8.2f} s  {ratio:6.2f} x bare")
    line = summary(figures, concurrent)
    if opts.json_path is not None or opts.plot:
        data = {
            "rounds": opts.rounds,
            "repetitions": opts.repetitions,
            "sessions": opts.sessions,
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
            "load_at_start": round(load_at_start, 1),
            "step_us": {
                f"{f.runner.name}|{f.runner.variant}": round(f.step_us, 2) for f in figures
            },
            "concurrent_s": {k: round(v, 3) for k, v in concurrent.items()},
            "thread_us": round(thread, 1),
            "hop_us": {kind: round(us, 1) for kind, us in hops.items()},
            "summary": line,
        }
        if opts.json_path is not None:
            opts.json_path.write_text(json.dumps(data, indent=2))
        if opts.plot:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import report

            report.write(data)
    print(" ".join(f"{k}={v:.3f}" for k, v in line.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
