"""``Agent``: the common agent in one call, on the embedded defaults.

    from stepmachine import Agent

    agent = Agent("openai:gpt-4.1-mini", tools=[add])
    print(agent.run_sync("s1", "What is 2 + 3?").text)

An :class:`Agent` is sugar over :class:`~stepmachine.StateMachine`, not a
second engine: it builds the standard step list -- answer invalid tool calls,
repair a broken history, ask for approval where you said a tool needs it, run
tools, call the model -- and runs it on a SQLite file with one
:class:`~stepmachine.Runtime`. The built list and machine are right there
(``agent.steps``, ``agent.machine``): copy the list, add your own steps, and
build a ``StateMachine`` of your own when you outgrow this.

This module composes the kernel with ``stepmachine.operations`` and
``stepmachine.stores``; the kernel itself never imports either (the top-level
``stepmachine.Agent`` is imported lazily, on first use).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, Generic, Literal, overload

import anyio

from ._capabilities import Step
from ._codec import Codec
from ._decision import RunReport
from ._effects import AppendMessage
from ._emitter import Emitter
from ._errors import ConfigurationError, EffectError, SessionExistsError
from ._inference import ModelInference
from ._machine import StateMachine
from ._messages import Message
from ._model import Model
from ._runtime import Runtime, uuid_ids
from ._session import D, NoData
from ._store import Store, submit
from ._tool_step import Tools
from ._tools import Tool, ToolLike
from .operations import Approval, HistoryGuard, InvalidCalls
from .providers import HTTPModel, resolve_model
from .providers._resolve import parse_model_string
from .stores import SQLiteStore

__all__ = ["DEFAULT_STORE", "Agent"]

DEFAULT_STORE = "stepmachine.sqlite3"
"""The SQLite file an :class:`Agent` keeps its sessions in unless told otherwise."""


class Agent(Generic[D]):
    """The standard agent: invalid calls, history guard, approval where asked, tools, inference.

    The steps, in order: :class:`~stepmachine.operations.InvalidCalls` first,
    so that nobody is asked to approve a call that could not run (a call
    naming an unknown tool, with invalid JSON or with arguments that fail the
    tool's schema is sent back to the model with what was wrong, at most twice
    a turn, then the run yields ``invalid_tool_call``; a call id the model
    repeats -- within one reply or from an earlier turn -- is given a fresh id
    and run, so a model that reuses ids cannot loop the agent);
    :class:`~stepmachine.operations.HistoryGuard`;
    :class:`~stepmachine.operations.Approval` when ``approve`` names a tool;
    :class:`~stepmachine.Tools` when there are tools; and
    :class:`~stepmachine.ModelInference`.

    Args:
        model: a model string (``"openai:gpt-4.1-mini"``, ``"anthropic:<model>"``,
            ``"gemini:<model>"``, ``"openai-compatible:<model>"``, ``"scripted"``;
            see :func:`stepmachine.providers.resolve_model`) or a
            :class:`~stepmachine.Model` object (e.g. a
            :class:`~stepmachine.testing.ScriptedModel` in tests). A string is
            resolved for each run and its HTTP client closed afterwards; an
            object is used as given and never closed by the agent.
        tools: the tools the model may call: built with :func:`~stepmachine.tool`,
            or typed functions (made tools as ``@tool`` would, as
            :class:`~stepmachine.Tools` does).
        approve: a tool or a collection of tools (names or the tools
            themselves) that must not run without a recorded approval of
            that exact call: the run yields
            ``awaiting_approval`` and an approval decided later -- from any
            process, with :func:`stepmachine.operations.approve` or ``deny`` --
            lets the next run continue. Approval cannot be bypassed.
        instructions: the system prompt.
        store: a path to the SQLite file (created when missing; default
            ``stepmachine.sqlite3`` in the current folder), or an open
            :class:`~stepmachine.Store` of any kind (used as given, not closed).
        codec: the application data codec when ``store`` is a path (default:
            no application data). A store object has its own codec: open it
            with yours instead (``await SQLiteStore.open(path, codec)``,
            ``MemoryStore(codec)``).
        stream: stream the model's reply (events reach ``emitter``); the
            stored result is the same either way.

    Attributes:
        steps: the step list, in order (a new list each time: change a copy).
        machine: the :class:`~stepmachine.StateMachine` running them.

    Raises:
        ConfigurationError: no model (``None``), an approval names a tool that
            is not among ``tools``, a model string names no provider, ``store``
            is neither a path nor a store, ``codec`` is given with a store
            object, or the step list is invalid (e.g. a tool name given twice).
    """

    @overload
    def __init__(
        self: Agent[NoData],
        model: str | Model,
        *,
        tools: Sequence[ToolLike | Callable[..., Any]] = (),
        approve: str | Tool | Collection[str | Tool] = (),
        instructions: str | None = None,
        store: str | os.PathLike[str] | Store = DEFAULT_STORE,
        codec: None = None,
        stream: bool = True,
    ) -> None: ...
    @overload
    def __init__(
        self: Agent[D],
        model: str | Model,
        *,
        tools: Sequence[ToolLike | Callable[..., Any]] = (),
        approve: str | Tool | Collection[str | Tool] = (),
        instructions: str | None = None,
        store: str | os.PathLike[str] | Store = DEFAULT_STORE,
        codec: Codec[D],
        stream: bool = True,
    ) -> None: ...
    def __init__(
        self,
        model: str | Model,
        *,
        tools: Sequence[ToolLike | Callable[..., Any]] = (),
        approve: str | Tool | Collection[str | Tool] = (),
        instructions: str | None = None,
        store: str | os.PathLike[str] | Store = DEFAULT_STORE,
        codec: Codec[D] | None = None,
        stream: bool = True,
    ) -> None:
        if isinstance(model, str):
            parse_model_string(model)  # a bad string fails here, not at the first run
        elif model is None or not callable(getattr(model, "request", None)):
            raise ConfigurationError(
                f"Agent needs a model, got {model!r}: pass a model string such as "
                "'openai:gpt-4.1-mini' (check the variable you read it from is set) or a Model "
                "object such as stepmachine.testing.ScriptedModel([...])"
            )
        _check_store(store, codec)
        self.model = model
        self.store = store
        self.codec = codec
        built: list[ToolLike] = [  # a typed function becomes a Tool, as in Tools([...])
            t if isinstance(t, Tool) or not callable(t) else Tool(t) for t in tools
        ]
        names = {t.name for t in built}
        if isinstance(approve, str | Tool):
            approve = [approve]
        guarded = {a if isinstance(a, str) else a.name for a in approve}
        unknown = sorted(guarded - names)
        if unknown:
            raise ConfigurationError(
                f"approve names {unknown!r}, which are not among the agent's tools "
                f"{sorted(names)!r}: pass the tool itself in tools=[...] or fix the name"
            )
        steps: list[Step[Any]] = [
            InvalidCalls(
                {"duplicate_id": "repair"}, tools=[t for t in built if isinstance(t, Tool)]
            ),
            HistoryGuard(),
        ]
        if guarded:
            steps.append(Approval(sorted(guarded)))
        if built:
            steps.append(Tools(built))
        steps.append(ModelInference(instructions=instructions, stream=stream))
        self.machine: StateMachine[D] = StateMachine(steps)

    @property
    def steps(self) -> list[Step[Any]]:
        """The step list, in the order the machine offers the session to them."""
        return list(self.machine.steps)

    def __repr__(self) -> str:
        model = self.model if isinstance(self.model, str) else self.model.name
        return f"Agent(model={model!r}, steps={[s.name for s in self.machine.steps]!r})"

    @asynccontextmanager
    async def runtime(self) -> AsyncIterator[Runtime]:
        """A :class:`~stepmachine.Runtime` with the agent's store and model, for one use.

        Opens the store when it is a path and resolves a model string; closes
        both on exit (a :class:`~stepmachine.Store` or model object given to the
        agent is left open). Use it to drive ``agent.machine`` yourself.
        """
        async with AsyncExitStack() as stack:
            store = self.store
            if not isinstance(store, str | os.PathLike):
                opened: Store = store
            else:
                opened = await stack.enter_async_context(await SQLiteStore.open(store, self.codec))
            model: Model
            if isinstance(self.model, str):
                model = resolve_model(self.model)
                if isinstance(model, HTTPModel):
                    stack.push_async_callback(model.aclose)
            else:
                model = self.model
            yield Runtime(store=opened, model=model)

    async def run(
        self,
        session_id: str,
        message: str | Message | None = None,
        *,
        emitter: Emitter | None = None,
    ) -> RunReport[D]:
        """Add ``message`` to the session (creating it when missing), then run it.

        With ``message=None`` nothing is added: the run continues the stored
        session where it left off -- after an approval was decided, after a
        crash, in another process. A ``str`` becomes a user message with a new
        id. Each call adds its message once: calling again with the same text
        asks again (a new turn), so to resume, pass no message.

        Returns:
            The :class:`~stepmachine.RunReport`: ``report.text`` is the answer
            (the last assistant message's text), ``report.reason.kind`` why the
            run returned (``done``, ``awaiting_approval``, ...), and
            ``report.session`` the stored session.

        Raises:
            SessionNotFoundError: ``message`` is ``None`` and there is no such session.
            InvalidSessionIdError: ``session_id`` is not a valid session id.
            ModelError: the model failed after its retries (what was done so far is stored).

        Cancellation: a cancelled run stops at the step in progress; what was
        applied is stored, and the next run continues from there.
        """
        async with self.runtime() as runtime:
            store = runtime.store
            assert store is not None  # runtime() always sets it
            if message is not None:
                await _add(store, session_id, message)
            return await self.machine.run_report(runtime, session_id, emitter)

    def run_sync(
        self,
        session_id: str,
        message: str | Message | None = None,
        *,
        backend: Literal["asyncio", "trio"] = "asyncio",
    ) -> RunReport[D]:
        """:meth:`run`, blocking: for scripts and notebooks (not from inside an event loop).

        Raises:
            RuntimeError: called from a running event loop; ``await agent.run(...)`` there.
        """
        _no_running_loop()
        return anyio.run(self._run_positional, session_id, message, backend=backend)

    async def _run_positional(self, session_id: str, message: str | Message | None) -> RunReport[D]:
        return await self.run(session_id, message)


def _check_store(store: object, codec: Codec[Any] | None) -> None:
    """Refuse a ``store`` that is neither a path nor a store, and a codec beside a store object."""
    if isinstance(store, str | os.PathLike):
        return
    if not all(callable(getattr(store, name, None)) for name in ("load", "apply", "create")):
        raise ConfigurationError(
            f"Agent(store=...) takes a path to a SQLite file or an open Store (SQLiteStore, "
            f"MemoryStore, FileStore, ...), got {store!r} of type {type(store).__name__}"
        )
    if codec is not None:
        raise ConfigurationError(
            f"Agent(store=<a store object>, codec=...): the store {type(store).__name__} encodes "
            "with the codec it was opened with, so the agent cannot use this codec: open the "
            "store with it (await SQLiteStore.open(path, codec), MemoryStore(codec)) and pass "
            "no codec to the Agent, or pass the store as a path"
        )


async def _add(store: Store, session_id: str, message: str | Message) -> None:
    """Append ``message`` to the session, creating the session when it is missing.

    Raises:
        EffectError: the session already holds a message with this id (a
            retried request): nothing is added, and the error says to run
            with no message to continue.
    """
    if isinstance(message, str):
        message = Message.user(message, id=uuid_ids())
    try:
        await store.create(session_id, conversation=[message])
    except SessionExistsError:
        try:
            await submit(store, session_id, [AppendMessage(message)])
        except EffectError as error:
            if (await store.load(session_id)).message(message.id) is None:
                raise
            raise EffectError(
                f"session {session_id!r} already holds message {message.id!r} (a retried "
                "request?): it was added once and is not added again; to continue the "
                f"session, run it with no message (agent.run({session_id!r}) or "
                "message=None)"
            ) from error


def _no_running_loop() -> None:
    """Raise a RuntimeError that says what to do when an event loop is running here."""
    trio = sys.modules.get("trio")
    in_trio = trio is not None and trio.lowlevel.in_trio_run()
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        if not in_trio:
            return
    raise RuntimeError(
        "Agent.run_sync() was called from inside a running event loop (a notebook, an"
        " async function): use 'await agent.run(...)' there instead"
    )
