"""The ``Tools`` operation: runs tool calls through a journal (at most once where it matters).

:class:`Tools` advertises its tools and, when the conversation holds tool calls
without results that are its own, runs them. Every call goes through a journal
kept in the session itself, as notes on the call (namespace ``"journal"``):

1. **Intent first, where a re-run would matter.** Before any tool of the
   batch starts, one batch of effects is committed recording, per call of a
   ``non_idempotent`` tool, its fingerprint, its idempotency key and its
   tool's side-effect class. Calls of ``pure`` and ``idempotent`` tools get no
   intent: running them again is harmless by declaration, so they need no
   durable record before they run. A tool step whose calls are all pure or
   idempotent therefore costs two batches (the model's call, then the
   result); one with a non-idempotent call costs three (the call, the
   intents, then the result).
2. **Each result as soon as it exists.** A result is committed as its own batch
   the moment its call finishes, so a finished sibling in a parallel batch is
   never re-run after a crash or a cancellation.
3. **The batch is sealed** when every call has a result; inference only ever
   sees sealed batches (it refuses while any call is open).

After a crash, an open call of a ``pure`` or ``idempotent`` tool is simply run
again (with the same idempotency key); its one result is committed as usual.
An open call with an intent (a ``non_idempotent`` tool that had started) is
never re-run, unless an operator allowed that one attempt to be repeated.
Instead, depending on ``on_unknown_outcome``: ``"error"`` (default) answers it
with an "outcome unknown" error result, so the model and the reader of the
history know it may or may not have happened; ``"yield"`` holds it back and
yields with reason ``outcome_unknown`` until an operator decides with
:func:`resolve_unknown_outcome`.

A result is committed as a ``tool`` message: the result, then the images and
documents the tool returned (an ``ImagePart``, a ``DocumentPart`` or a
:class:`~stepmachine.ToolOutput`), in that one batch, so a crash never keeps a
result without its media; ``finalize`` keeps them too. An error result
(an exception, a timeout, "not executed", "interrupted") carries none.

Everything that can go wrong with one call becomes an error result the model
can read, never a crash of the run: unknown tool names, invalid JSON,
arguments that fail validation, a tool that raises, a tool that times out. A
tool that raises :class:`~stepmachine.ToolAbortError` fails closed: calls not yet
started are answered "not executed" and the run yields with reason
``tool_failed``.

Calls some step objects to (``ctx.vet_call``, which asks every step's
``check_call``: approval, budgets) are held back -- not run, left open --
whatever the order of the steps; so are calls whose id the model used twice.
A call naming a tool no step advertises is answered "unknown tool"
(``Tools.answers_unknown_tools`` is ``True``).

One runner per session at a time: a second machine running the same session
while the first has tools in flight reads their intents as left by a crash
(and runs their pure and idempotent calls again: harmless, and only one
result per call is ever committed).
Applications that run several workers serialise runs per session (a queue or
a lease); the store's compare-and-set keeps the data right either way.

Under a lease (``run()`` holds the session's lease when the store has them),
the lease is confirmed with the store right before each non-idempotent tool
starts: a runner paused between the intent's commit and the tool's start,
past its lease's ttl, finds that another runner took the session over (and
may have answered the call "outcome unknown"), starts nothing, and ``run()``
raises :class:`~stepmachine.LeaseLostError`. A pure or idempotent tool is
checked against what the run already knows, at no cost. See
``stepmachine._hold.confirm_lease`` for the check and what it costs.

Errors of concurrent calls (a lost lease, a store's error) leave the step as
one error, never an ``ExceptionGroup`` (see :func:`one_error`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Literal, NamedTuple

import anyio
import msgspec

from . import _json, _log, _tracing
from ._effects import Annotate, AppendMessage, Effect
from ._emitter import ToolFinished, ToolStarted
from ._errors import (
    ConfigurationError,
    MediaTooLargeError,
    StepContractError,
    ToolAbortError,
    ToolArgumentsError,
    ToolError,
)
from ._history import open_tool_calls
from ._media import DocumentPart, ImagePart
from ._messages import Message, ToolCallPart, ToolResultPart
from ._model import ToolDefinition
from ._records import Record, note_value, read_record
from ._runtime import ToolCaller, uuid_ids
from ._session import Session
from ._staged import Recorder, Staged, Task, one_error
from ._steps import Continue, Operation, Outcome, Refuse, StepContext, Yield, YieldReason
from ._store import Store, submit
from ._tools import (
    ABANDONED,
    EDITED_ARGUMENTS,
    THREAD_GRACE,
    Tool,
    ToolContext,
    ToolLike,
    ToolOutput,
    check_timeout,
    effective_arguments,
    fingerprint,
    idempotency_key,
)

__all__ = [
    "JOURNAL",
    "NOT_EXECUTED",
    "OUTCOME_UNKNOWN",
    "JournalEntry",
    "Tools",
    "journal_entry",
    "one_error",
    "resolve_unknown_outcome",
]

JOURNAL = "journal"
"""Notes namespace of the tool journal on each tool call."""

OUTCOME_UNKNOWN = (
    "outcome unknown: the process stopped after this call was started and before its result "
    "was recorded; the tool is not idempotent, so it was not run again. It may or may not "
    "have taken effect."
)
NOT_EXECUTED = "not executed: another call of the same batch failed closed ({reason})"


class _Answer(NamedTuple):
    """A result and the images and documents it carries (stored after it in its message)."""

    result: ToolResultPart
    media: tuple[ImagePart | DocumentPart, ...] = ()

    def message(self, message_id: str) -> Message:
        return Message.tool_result(self.result, id=message_id, media=self.media)


class JournalEntry(Record, frozen=True, tag="stepmachine.journal"):
    """The journal of one tool call: notes namespace :data:`JOURNAL` on the call.

    Written whole (each writer replaces the entry it read), so the fields of
    the intent and of an operator's decision stay together.

    Attributes:
        intent: an intent was committed before the call of a ``non_idempotent``
            tool started.
        fingerprint: the fingerprint of the call as it was about to run.
        idempotency_key: the key the tool was given.
        side_effects: the tool's side-effect class.
        attempt: how many times an intent was recorded (1 for the first run).
        at: the runtime clock when the latest intent was recorded.
        rerun_approved: an operator allowed attempt ``rerun_attempt`` to be
            run again (:func:`resolve_unknown_outcome`).
        rerun_attempt: the attempt the operator's decision is about.
        decided_by: who decided.
        decision_note: what they said.
    """

    intent: bool = False
    fingerprint: str = ""
    idempotency_key: str = ""
    side_effects: str = ""
    attempt: int = 0
    at: float = 0.0
    rerun_approved: bool = False
    rerun_attempt: int | None = None
    decided_by: str = ""
    decision_note: str = ""


def journal_entry(call: ToolCallPart, *, where: str = "a tool call") -> JournalEntry | None:
    """The journal entry recorded on ``call``, or ``None``.

    Raises:
        StoredDataError: the stored entry does not convert (names ``where``).
    """
    return read_record(call.notes, JOURNAL, JournalEntry, where=f"{where} (call {call.call_id!r})")


def _journal(call: ToolCallPart, session_id: str) -> JournalEntry | None:
    """:func:`journal_entry` of a call of session ``session_id`` (no text is built for
    a call without an entry, the usual case)."""
    if call.notes.get(JOURNAL) is None:
        return None
    return journal_entry(call, where=f"session {session_id!r}")


class _CallLocations(dict[str, str]):
    """Call id -> id of the (latest) message holding a call with that id.

    Filled on demand from the session's history index (O(1) per call id), so
    reading the locations of a few calls never scans the conversation.
    Iterating it sees only the ids looked up so far.
    """

    __slots__ = ("_session",)

    def __init__(self, session: Session[Any]) -> None:
        super().__init__()
        self._session = session

    def __missing__(self, call_id: str) -> str:
        position = self._session.history.call_position(call_id)
        if position is None:
            raise KeyError(call_id)
        message_id = self._session.conversation[position].id
        self[call_id] = message_id
        return message_id

    def get(self, call_id: str, default: Any = None) -> Any:
        try:
            return self[call_id]
        except KeyError:
            return default

    def __contains__(self, call_id: object) -> bool:
        return isinstance(call_id, str) and self.get(call_id) is not None


def _call_locations(session: Session[Any]) -> dict[str, str]:
    """Map call id -> id of the (latest) message holding a call with that id.

    Lazy: each id is looked up in the session's history index when first read.
    """
    return _CallLocations(session)


def _repeated_call_ids(session: Session[Any]) -> set[str]:
    """Call ids that occur more than once among the calls visible to the model. O(1)."""
    return set(session.history.repeated)


class Tools(Operation[Any]):
    """Advertises tools and answers every open call that is its own, through the journal.

    An open call is "its own" when it names one of its tools, or names a tool
    no step advertises (then the answer is an "unknown tool" error). Calls for
    tools of another ``Tools`` step are left to that step. Calls run
    concurrently, at most ``max_concurrency`` at a time (with 1, one after
    another in call order, so results are committed in a fixed order); each tool's
    ``timeout`` (or ``timeout`` here) bounds it. The outcome is ``Continue``
    (all intents and results were committed as the work happened), or
    ``Yield`` with ``tool_failed`` / ``outcome_unknown``.

    Commits: a call of a ``non_idempotent`` tool gets a durable intent before
    any tool of the step starts (one batch for all such calls), so it is never
    run twice after a crash (at most once where it matters). A ``pure`` or ``idempotent`` tool
    needs no intent -- re-running it is harmless by declaration -- so a step
    running only such calls commits just its results: two batches per tool
    step counting the model's call, three when a non-idempotent call is among
    them. Each result is its own batch, committed as soon as it exists. One
    call (or ``max_concurrency=1``) runs directly, without a task group,
    limiter or lock.

    Args:
        tools: ``Tool`` objects or typed functions.
        name: the step name.
        max_concurrency: calls run at once.
        timeout: default seconds per call for tools without their own.
        on_unknown_outcome: ``"error"`` or ``"yield"``, see the module docs.
        max_result_chars: a result whose text is longer than this (100,000
            characters by default, about 25,000 tokens) is answered with an
            error result naming its length and this bound, and is not stored:
            one huge result (a whole log, a table dump) would otherwise be sent
            with every later request of the session, past the model's context
            window. Ask for less in the tool (a page, a narrower query), or
            raise the bound.

    Raises:
        ConfigurationError: a tool name given twice, ``max_concurrency`` not
            an int >= 1, ``timeout`` not ``None`` or a number > 0, an
            unknown ``on_unknown_outcome``, or ``max_result_chars`` not an int
            >= 1.

    Cancellation: results already committed stay; a result that exists but
    whose commit had not returned (the cancellation landed while the tool's
    ``ToolFinished`` event was emitted, or while the result was committed) is
    kept by ``finalize``, exactly once; the machine answers only the calls
    that have no result as interrupted. A sync tool in a worker thread cannot
    be stopped: the cancelled run waits at most a second (``THREAD_GRACE``)
    for it to end, keeping its real result if it does; otherwise the call is
    answered interrupted and the thread runs on to its end, what it returns
    dropped (the call is never run again, but a non-idempotent tool's side
    effect may still happen). A sync tool's ``timeout`` bounds it the same
    way: the call is answered "timed out" while its thread runs on.
    """

    answers_unknown_tools: ClassVar[bool] = True
    """It answers calls naming a tool no step advertises ("unknown tool")."""

    def __init__(
        self,
        tools: Iterable[Tool | Any],
        *,
        name: str = "tools",
        max_concurrency: int = 8,
        timeout: float | None = None,
        on_unknown_outcome: Literal["error", "yield"] = "error",
        max_result_chars: int = 100_000,
    ) -> None:
        self._name = name
        self._tools: dict[str, Tool] = {}
        for item in tools:
            built = item if isinstance(item, Tool) else Tool(item)
            if built.name in self._tools:
                raise ConfigurationError(
                    f"tool name {built.name!r} is given twice to {name!r}; a model names a tool "
                    "by its name, so give each tool its own (tool(name=...)(fn))"
                )
            self._tools[built.name] = built
        self._definitions = tuple(t.definition for t in self._tools.values())
        if (
            isinstance(max_concurrency, bool)
            or not isinstance(max_concurrency, int)
            or max_concurrency < 1
        ):
            raise ConfigurationError(
                f"{name!r}: max_concurrency must be an int >= 1, got {max_concurrency!r}"
            )
        self._max_concurrency = max_concurrency
        self._timeout = check_timeout(repr(name), timeout)
        if on_unknown_outcome not in ("error", "yield"):
            raise ConfigurationError(
                f"on_unknown_outcome must be 'error' or 'yield', got {on_unknown_outcome!r}"
            )
        self._on_unknown = on_unknown_outcome
        if (
            isinstance(max_result_chars, bool)
            or not isinstance(max_result_chars, int)
            or max_result_chars < 1
        ):
            raise ConfigurationError(
                f"{name!r}: max_result_chars must be an int >= 1 (characters of a tool "
                f"result's text), got {max_result_chars!r}"
            )
        self.max_result_chars = max_result_chars

    @property
    def name(self) -> str:
        return self._name

    def tools(self, session: Session[Any]) -> Sequence[ToolDefinition]:
        return self._definitions

    # -- one cycle ----------------------------------------------------------------

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        """Staged work for the open calls that are its own (see the module docs).

        Calls answered without running anything (an unknown tool, invalid
        arguments, an outcome a crash left unknown) and the intents of the
        non-idempotent calls to run are the intents batch; each call to run
        is a task (``guarded`` when its tool is ``non_idempotent``), recorded
        as it finishes; the ending is ``Yield`` with ``tool_failed`` (a
        :class:`~stepmachine.ToolAbortError`) or ``outcome_unknown`` (calls held
        for an operator), else ``Continue``.
        """
        # The cheap check first: most cycles have no open call at all.
        open_calls = open_tool_calls(ctx.session)
        if not open_calls:
            return Refuse("no open tool calls")
        own = self._own_tools(ctx)
        advertised: set[str] | None = None
        candidates: list[ToolCallPart] = []
        for c in open_calls:
            if c.name not in own:
                if advertised is None:
                    advertised = {d.name for d in ctx.tools}
                if c.name in advertised:
                    continue  # another step's tool
            candidates.append(c)
        if not candidates:
            return Refuse("no open tool calls for these tools")
        # A call id the model used twice is ambiguous (which call would a result
        # answer?): such calls are never run; HistoryGuard or InvalidCalls repair them.
        repeated = _repeated_call_ids(ctx.session)
        calls = [c for c in candidates if c.call_id not in repeated and ctx.vet_call(c) is None]
        if not calls:
            return Refuse("no open tool calls for these tools that may run now")

        intents: list[Effect] = []  # results decided without running anything, then intents
        unknown: list[ToolCallPart] = []  # crashed non-idempotent calls awaiting an operator
        to_run: list[ToolCallPart] = []
        journals: dict[str, JournalEntry | None] = {}
        for call in calls:
            journal = _journal(call, ctx.session.id)
            journals[call.call_id] = journal
            impl = own.get(call.name)
            if impl is None or effective_arguments(call) is None:
                answer = _Answer(self._precheck_error(ctx, call, own))
                intents.append(AppendMessage(answer.message(ctx.new_id())))
            elif journal is not None and journal.intent and not self._may_rerun(impl, journal):
                _log_journal(ctx, call, journal, "outcome_unknown")
                if self._on_unknown == "yield":
                    unknown.append(call)
                else:
                    answer = _Answer(_error(call, OUTCOME_UNKNOWN))
                    intents.append(AppendMessage(answer.message(ctx.new_id())))
            else:
                if journal is not None and journal.intent:
                    _log_journal(ctx, call, journal, "rerun")
                to_run.append(call)

        abort: list[str] = []  # the first ToolAbortError's reason, once one failed closed

        def ending() -> Continue | Yield:
            if abort:
                return Yield([], YieldReason("tool_failed", abort[0]))
            if unknown:
                return Yield(
                    [],
                    YieldReason(
                        "outcome_unknown",
                        "tool calls may or may not have run before a crash; decide with "
                        "resolve_unknown_outcome()",
                        {"calls": [c.call_id for c in unknown]},
                    ),
                )
            return Continue(())

        if not to_run:
            done = ending()
            if isinstance(done, Yield):
                return Yield(intents, done.reason)
            return Continue(intents)
        where = _call_locations(ctx.session)  # call id -> message id, read once
        intents.extend(self._intents(ctx, to_run, where, own, journals))
        tasks = [
            self._task(ctx, call, own[call.name], where[call.call_id], abort) for call in to_run
        ]
        return Staged(intents, tasks, max_concurrency=self._max_concurrency, then=ending)

    def _task(
        self,
        ctx: StepContext[Any],
        call: ToolCallPart,
        impl: ToolLike,
        message_id: str,
        abort: list[str],
    ) -> Task:
        """The task that runs ``call`` (or answers it "not executed" after an abort)."""

        finished: list[ToolFinished] = []

        async def run_call() -> Recorder:
            if abort:
                return _record(ctx, _Answer(_error(call, NOT_EXECUTED.format(reason=abort[0]))))
            answer, aborted = await self._run_call(ctx, call, impl, message_id)
            if aborted is not None:
                abort.append(aborted)
            is_error = answer.result.is_error
            finished.append(ToolFinished(call_id=call.call_id, name=call.name, is_error=is_error))
            return _record(ctx, answer)  # no await between the tool's return and the machine

        async def landed() -> None:
            for event in finished:  # the machine holds the result: an interrupt here loses nothing
                await ctx.emit(event)

        def refused(exc: Exception) -> Recorder | None:
            if not isinstance(exc, MediaTooLargeError):
                return None
            return _record(ctx, _too_large(exc, call))

        return Task(
            name=f"tool {call.name!r} (call {call.call_id!r})",
            run=run_call,
            landed=landed,
            guarded=impl.side_effects == "non_idempotent",
            refused=refused,
        )

    # -- the journal ---------------------------------------------------------------

    def _own_tools(self, ctx: StepContext[Any]) -> Mapping[str, ToolLike]:
        """The tools this step runs in this cycle, by name (read once per ``run``).

        A fixed set here; a subclass whose tools come from elsewhere (MCP
        servers) returns the set it advertised for this cycle.
        """
        return self._tools

    @staticmethod
    def _may_rerun(impl: ToolLike, journal: JournalEntry) -> bool:
        # The class recorded with the intent decides (state is the session): a tool
        # that was non-idempotent when it started is not re-run because it (or the
        # server it lives on) now says otherwise. Entries without one (none are
        # written today) fall back to the tool's class now.
        recorded = journal.side_effects or impl.side_effects
        if recorded in ("pure", "idempotent"):
            return True
        # An operator's decision covers the attempt it was made about, not later crashes.
        return journal.rerun_approved and journal.rerun_attempt == journal.attempt

    def _precheck_error(
        self, ctx: StepContext[Any], call: ToolCallPart, own: Mapping[str, ToolLike]
    ) -> ToolResultPart:
        if call.name not in own:
            known = ", ".join(sorted(d.name for d in ctx.tools)) or "none"
            return _error(call, f"unknown tool {call.name!r}; available tools: {known}")
        try:
            _json.decode(call.raw_arguments)  # bounded: deep JSON is invalid, not a crash
        except msgspec.DecodeError:
            return _error(
                call, f"the arguments for {call.name!r} are not valid JSON: {call.raw_arguments!r}"
            )
        return _error(
            call,
            f"the arguments for {call.name!r} must be a JSON object, got {call.raw_arguments!r}",
        )

    def _intents(
        self,
        ctx: StepContext[Any],
        calls: Sequence[ToolCallPart],
        where: dict[str, str],
        own: Mapping[str, ToolLike],
        journals: Mapping[str, JournalEntry | None] | None = None,
    ) -> list[Effect]:
        """The intents of the calls whose tool is ``non_idempotent``.

        Calls of pure and idempotent tools get none (re-running them is
        harmless), so when every call is one of those there are none.
        ``journals``: the entries already read from the calls, by call id.
        """
        effects: list[Effect] = []
        for call in calls:
            impl = own[call.name]
            if impl.side_effects != "non_idempotent":
                continue
            if journals is not None and call.call_id in journals:
                journal = journals[call.call_id] or JournalEntry()
            else:
                journal = _journal(call, ctx.session.id) or JournalEntry()
            entry = msgspec.structs.replace(
                journal,
                intent=True,
                fingerprint=fingerprint(call.name, effective_arguments(call)),
                idempotency_key=idempotency_key(ctx.session.id, call.call_id, where[call.call_id]),
                side_effects=impl.side_effects,
                attempt=journal.attempt + 1,
                at=ctx.runtime.clock(),
            )
            effects.append(
                Annotate(where[call.call_id], JOURNAL, note_value(entry), call_id=call.call_id)
            )
        return effects

    async def _run_call(
        self, ctx: StepContext[Any], call: ToolCallPart, impl: ToolLike, message_id: str
    ) -> tuple[_Answer, str | None]:
        """Run one call. Returns its result (and media), and the abort reason if it failed
        closed.

        Emits ``ToolStarted``; the caller emits ``ToolFinished``. The machine
        confirmed the run's lease right before (see ``_hold.confirm_lease``).

        Cancellation: an async tool is cancelled at its next await (then no
        result exists); a sync tool in a worker thread is given up to
        ``THREAD_GRACE`` seconds to end: if it does, its result is returned,
        the cancellation firing at the caller's next checkpoint; if not, the
        cancellation propagates and the thread runs on, unheard (see
        ``_call_tool``).
        """
        await ctx.emit(ToolStarted(call_id=call.call_id, name=call.name))
        context = ToolContext(
            runtime=ctx.runtime,
            session_id=ctx.session.id,
            call_id=call.call_id,
            idempotency_key=idempotency_key(ctx.session.id, call.call_id, message_id),
        )
        telemetry = ctx.runtime.telemetry
        started = time.perf_counter()
        traced = _tracing.NO_SPAN
        if _tracing.active():
            attributes = {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": call.name,
                "gen_ai.tool.call.id": call.call_id,
                "gen_ai.tool.type": "function",
                "stepmachine.tool.side_effects": impl.side_effects,
            }
            traced = _tracing.span(telemetry, f"execute_tool {call.name}", attributes)
        with traced as span:
            if span is not None and telemetry.captures_content:
                span.set_attribute("gen_ai.tool.call.arguments", _arguments_text(call))
            caller = ctx.runtime.tool_caller
            try:
                if caller is not None:
                    aborted = None
                    result, outcome, error_type = await self._ask_caller(
                        caller, impl, call, context
                    )
                else:
                    result, aborted, outcome, error_type = await self._call_tool(
                        impl, call, context
                    )
            except BaseException as exc:  # cancelled (or Ctrl-C): no result exists
                _log_tool_call(ctx, call, impl, started, _tracing.error_type(exc), None)
                raise
            if span is not None:
                span.set_attribute("stepmachine.tool.outcome", outcome)
                if error_type is not None:
                    _tracing.mark_type(span, error_type)
                if telemetry.captures_content:
                    span.set_attribute("gen_ai.tool.call.result", result.result.content)
        _log_tool_call(ctx, call, impl, started, outcome, result.result)
        # No await between the tool returning and the caller recording the result:
        # a cancellation pending by now must not lose it (the caller emits ToolFinished).
        return result, aborted

    async def _ask_caller(
        self, caller: ToolCaller, impl: ToolLike, call: ToolCallPart, context: ToolContext
    ) -> tuple[_Answer, str, str | None]:
        """``Runtime.tool_caller``'s answer: the result (and media), the outcome name, the
        error type.

        Bounded and contained like a tool: the tool's ``timeout`` (or the
        step's) bounds it, and an exception from it becomes an error result
        (outcome ``error``), so an intent always gets its result.

        Raises:
            StepContractError: it answered something other than a
                ``ToolResultPart`` or a ``tool`` message for this call (a bug in
                the caller).
        """
        timeout = impl.timeout if impl.timeout is not None else self._timeout
        try:
            with _bounded(timeout):
                result = await caller(call, context)
        except TimeoutError:
            message = f"tool {call.name!r} timed out after {timeout} s; its outcome is unknown"
            return _Answer(_error(call, message)), "timeout", "TimeoutError"
        except ToolError as exc:
            return _Answer(_error(call, _text(exc))), "error", type(exc).__name__
        except Exception as exc:  # noqa: BLE001 - as a tool's error: an error result
            message = f"tool {call.name!r} failed: {type(exc).__name__}: {_text(exc)}"
            return _Answer(_error(call, message)), "error", type(exc).__name__
        return _recorded(result, call), "recorded", None

    async def _call_tool(
        self, impl: ToolLike, call: ToolCallPart, context: ToolContext
    ) -> tuple[_Answer, str | None, str, str | None]:
        """Run the tool: its result (with the images and documents of a
        :class:`~stepmachine.ToolOutput`), the abort reason if it failed closed, the
        outcome name, and the error's type name (``None`` when it succeeded).

        Outcomes: ``ok``, ``invalid_arguments``, ``timeout``, ``aborted``, ``error``
        (a :class:`ToolError`'s message is the result as it is; any other
        exception is named in it, by its ``str()``, else its ``repr()``, else
        its type alone; a result longer than ``max_result_chars`` is an error
        result saying so). An error result carries no media.

        A sync :class:`~stepmachine.Tool` runs in a worker thread, which cannot
        be stopped: after its timeout the call is answered "timed out" and the
        thread runs on to its end, what it returns dropped. When the run is
        cancelled meanwhile, the thread is given up to ``THREAD_GRACE``
        seconds (shielded) to end: then its real result is returned (the
        machine holds it and writes it once); otherwise the cancellation
        propagates and the call is answered "interrupted". Either way the call
        is answered once and never run again (at most once); a non-idempotent
        tool's side effect may still happen after that answer.
        """
        timeout = impl.timeout if impl.timeout is not None else self._timeout
        abandoned: list[Any] = []  # a sync tool's worker thread the call stopped waiting for
        reset = ABANDONED.set(abandoned)
        try:
            with _bounded(timeout):
                content = await impl.call(effective_arguments(call), context)
        except TimeoutError:
            message = f"tool {call.name!r} timed out after {timeout} s; its outcome is unknown"
            if abandoned:  # a thread cannot be stopped: it runs on, what it returns is dropped
                message += " (it still runs in its worker thread; what it returns is dropped)"
            return _Answer(_error(call, message)), None, "timeout", "TimeoutError"
        except anyio.get_cancelled_exc_class():
            if not abandoned:
                raise
            # The run was cancelled while a sync tool ran in its thread: give it a moment
            # (shielded, bounded) so a tool finishing as the cancellation lands keeps its
            # real result; a thread still running then is abandoned and its call answered
            # "interrupted" (it runs on; what it returns is dropped).
            thread = abandoned[0]
            with anyio.move_on_after(THREAD_GRACE, shield=True):
                await anyio.to_thread.run_sync(
                    thread.done.wait, THREAD_GRACE, abandon_on_cancel=True
                )
            if not thread.done.is_set():
                raise
            if thread.error is not None and not isinstance(thread.error, Exception):
                # It ended with an interrupt of its own (SystemExit, KeyboardInterrupt) while
                # the run is being cancelled: the cancellation goes on and the call is answered
                # "interrupted". Raised here, it would be a second interrupt, which on asyncio
                # leaves the event loop in the middle of its clean-up (see interrupt_once).
                _log.event(
                    _log.WARNING,
                    "tool_thread_interrupted",
                    tool=call.name,
                    call_id=call.call_id,
                    error_type=type(thread.error).__name__,
                )
                raise
            _cancel_again_if_native()  # the result is kept; the run still ends cancelled
            try:  # the result exists: returned, so the machine holds it (and writes it once)
                content = thread.outcome()
            except Exception as exc:  # noqa: BLE001 - a tool error becomes an error result
                return _failed(call, exc)
        except Exception as exc:  # noqa: BLE001 - a tool error becomes an error result
            return _failed(call, exc)
        finally:
            ABANDONED.reset(reset)
        text = content.content if isinstance(content, ToolOutput) else content
        if isinstance(text, str) and len(text) > self.max_result_chars:
            message = (
                f"tool {call.name!r} returned {len(text):,} characters, more than the "
                f"{self.max_result_chars:,} allowed (max_result_chars); the result was not "
                "stored. Ask the tool for less (one page, a narrower query)"
            )
            return _Answer(_error(call, message)), None, "error", "ToolError"
        return _succeeded(call, content)


def _cancel_again_if_native() -> None:
    """Ask again for the cancellation just taken in, when it was asyncio's native one.

    ``_call_tool`` takes a cancellation in to keep a sync tool's real result (the
    thread ended within ``THREAD_GRACE``). An anyio cancel scope delivers its
    cancellation again at the next checkpoint; asyncio's native ``task.cancel()``
    (Ctrl-C under ``asyncio.run``, ``asyncio.wait_for``, ``asyncio.timeout``) is
    delivered once, so taken in it would be lost and the run would go on. It is
    requested again here (the task's cancel count unchanged: one taken back, one
    made), to land at the next await that waits, after the result is held.
    """
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no asyncio loop runs here (trio): only scopes cancel
        return
    if task is None or not task.cancelling():
        return
    if anyio.current_effective_deadline() == -math.inf:
        return  # a cancelled anyio scope: it delivers again by itself
    task.uncancel()
    task.cancel()


def _bounded(timeout: float | None) -> contextlib.AbstractContextManager[object]:
    """``anyio.fail_after(timeout)``; nothing at all for ``None`` (no deadline: a cancel
    scope nobody cancels changes nothing, and costs a scope per call)."""
    return contextlib.nullcontext() if timeout is None else anyio.fail_after(timeout)


def _succeeded(
    call: ToolCallPart, content: str | ToolOutput
) -> tuple[_Answer, str | None, str, str | None]:
    """``_call_tool``'s answer for a tool that returned ``content``."""
    if isinstance(content, ToolOutput):
        result = ToolResultPart.for_call(call, content.content)
        return _Answer(result, tuple(content.media)), None, "ok", None
    return _Answer(ToolResultPart.for_call(call, content)), None, "ok", None


def _failed(call: ToolCallPart, exc: Exception) -> tuple[_Answer, str | None, str, str | None]:
    """``_call_tool``'s answer for a tool that raised ``exc`` (see ``_call_tool``)."""
    if isinstance(exc, ToolArgumentsError):
        return _Answer(_error(call, _text(exc))), None, "invalid_arguments", type(exc).__name__
    if isinstance(exc, ToolError):
        return _Answer(_error(call, _text(exc))), None, "error", type(exc).__name__
    if isinstance(exc, ToolAbortError):
        aborted = f"{call.name}: {_text(exc)}"
        result = _error(call, f"tool {call.name!r} failed and stopped the run: {_text(exc)}")
        return _Answer(result), aborted, "aborted", type(exc).__name__
    result = _error(call, f"tool {call.name!r} failed: {type(exc).__name__}: {_text(exc)}")
    return _Answer(result), None, "error", type(exc).__name__


def _text(exc: BaseException) -> str:
    """``str(exc)``; if that raises (a broken ``__str__``), ``repr(exc)``; if that raises
    too, a line saying so: a tool's exception always becomes an error result, never a
    crash of the run."""
    for show in (str, repr):
        try:
            return show(exc)
        except Exception:  # noqa: BLE001, S112 - an exception that cannot print itself
            continue
    return f"(its {type(exc).__name__} could not be printed: str() and repr() raised)"


def _arguments_text(call: ToolCallPart) -> str:
    """The arguments the tool runs with, as JSON text (edited ones when an approval edited them)."""
    if EDITED_ARGUMENTS in call.notes:
        return msgspec.json.encode(effective_arguments(call)).decode()
    return call.raw_arguments


def _recorded(answer: object, call: ToolCallPart) -> _Answer:
    """A tool caller's answer to ``call``: a ``ToolResultPart``, or a ``tool`` message
    holding one result and the images and documents after it.

    Raises:
        StepContractError: ``answer`` is neither, or answers another call.
    """
    result: object = answer
    media: tuple[ImagePart | DocumentPart, ...] = ()
    if isinstance(answer, Message) and answer.role == "tool" and len(answer.tool_results) == 1:
        result = answer.tool_results[0]
        media = answer.result_media(call.call_id)
        if answer.parts != (result, *media):  # text after the result, audio, ...: not dropped
            raise StepContractError(
                f"Runtime.tool_caller answered call {call.call_id!r} ({call.name}) with a tool "
                "message holding more than its result and the images and documents after it "
                f"({[type(p).__name__ for p in answer.parts]}); nothing of it was recorded. "
                "Return the ToolResultPart, or Message.tool_result(result, media=...)"
            )
    if not isinstance(result, ToolResultPart) or result.call_id != call.call_id:
        got = (
            f"a result for call {result.call_id!r}"
            if isinstance(result, ToolResultPart)
            else repr(answer)[:200]
        )
        raise StepContractError(
            f"Runtime.tool_caller must return a ToolResultPart (or a tool message holding one) "
            f"answering call {call.call_id!r} ({call.name}); it returned {got}"
        )
    return _Answer(result, media)


def _log_tool_call(
    ctx: StepContext[Any],
    call: ToolCallPart,
    impl: ToolLike,
    started: float,
    outcome: str,
    result: ToolResultPart | None,
) -> None:
    """The ``tool_call`` event (DEBUG); arguments and result only with content capture on."""
    if not _log.enabled(_log.DEBUG):
        return
    fields: dict[str, Any] = {
        "session_id": ctx.session.id,
        "tool": call.name,
        "call_id": call.call_id,
        "side_effects": impl.side_effects,
        "duration_ms": round((time.perf_counter() - started) * 1000, 3),
        "outcome": outcome,
    }
    if ctx.runtime.telemetry.captures_content:
        fields["arguments"] = _arguments_text(call)
        if result is not None:
            fields["result"] = result.content
    _log.event(_log.DEBUG, "tool_call", **fields)


def _log_journal(
    ctx: StepContext[Any], call: ToolCallPart, journal: JournalEntry, decision: str
) -> None:
    """A ``journal`` event: a call with an intent and no result, found after a crash.

    ``outcome_unknown`` (WARNING): it is not run again; ``rerun`` (INFO): it
    runs again (its tool is pure or idempotent, or an operator allowed it).
    """
    _log.event(
        _log.WARNING if decision == "outcome_unknown" else _log.INFO,
        "journal",
        session_id=ctx.session.id,
        tool=call.name,
        call_id=call.call_id,
        decision=decision,
        attempt=journal.attempt,
        side_effects=journal.side_effects,
    )


def _error(call: ToolCallPart, content: str) -> ToolResultPart:
    return ToolResultPart.for_call(call, content, is_error=True)


def _too_large(exc: MediaTooLargeError, call: ToolCallPart) -> _Answer:
    """The error result that stands for a result whose media the store refused."""
    content = (
        f"tool {call.name!r} returned an image or document of {exc.size:,} bytes; "
        f"this store takes at most {exc.limit:,} bytes per part (max_media_bytes), so "
        "the result was not stored"
    )
    return _Answer(_error(call, content))


def _record(ctx: StepContext[Any], answer: _Answer) -> Recorder:
    """How the machine records ``answer``: its ``tool`` message, while its call is open.

    Computed from the session as stored when it is written (again after a
    conflict, and by finalize after a cancellation), so a call another writer
    answered meanwhile is not answered twice.
    """
    call_id = answer.result.call_id

    def record(session: Session[Any]) -> Sequence[Effect]:
        if all(c.call_id != call_id for c in open_tool_calls(session)):
            return ()
        return (AppendMessage(answer.message(ctx.new_id())),)

    return record


async def resolve_unknown_outcome(
    store: Store,
    session_id: str,
    call_id: str,
    *,
    rerun: bool,
    by: str,
    note: str = "",
    ids: Callable[[], str] = uuid_ids,
) -> Session[Any]:
    """An operator's decision on a call whose outcome a crash left unknown.

    With ``rerun=True`` the journal may run the call again on the next
    ``run()``; with ``rerun=False`` the call is answered now with an error
    result saying the operator chose not to re-run it. Either way the decision
    (who, note) is recorded on the call.

    Raises:
        ConfigurationError: ``by`` is empty; the call does not exist, already
            has a result, or has no recorded intent. Nothing was written.
    """
    if not isinstance(by, str) or not by.strip():
        raise ConfigurationError(
            f"a decision on an unknown outcome records who made it: got by={by!r}; pass "
            "by='<the operator>'; nothing was written"
        )
    session = await store.load(session_id)
    where = _call_locations(session)
    open_calls = {c.call_id: c for c in open_tool_calls(session)}
    call = open_calls.get(call_id)
    journal = None if call is None else journal_entry(call, where=f"session {session_id!r}")
    if call is None or journal is None or not journal.intent:
        if call is None:
            seen = (
                "it has a result already"
                if session.history.call_position(call_id) is not None
                else "no call has this id"
            )
        else:
            seen = "it has no recorded intent (its tool never started, or is not non-idempotent)"
        waiting = [
            c.call_id
            for c in open_calls.values()
            if (entry := journal_entry(c, where=f"session {session_id!r}")) and entry.intent
        ]
        raise ConfigurationError(
            f"session {session_id!r} has no open call {call_id!r} with a recorded intent: "
            f"{seen}. Only a call a crash left open after its intent has an unknown outcome "
            f"to decide; such calls in this session now: {waiting!r}. Nothing was written"
        )
    decided = msgspec.structs.replace(
        journal,
        rerun_approved=rerun,
        rerun_attempt=journal.attempt,
        decided_by=by,
        decision_note=note,
    )
    effects: list[Effect] = [
        Annotate(where[call_id], JOURNAL, note_value(decided), call_id=call_id)
    ]
    if not rerun:
        content = f"{OUTCOME_UNKNOWN} {by} decided not to run it again. {note}".strip()
        effects.append(AppendMessage(Message.tool_result(_error(call, content), id=ids())))
    return await submit(store, session_id, effects, step="journal.operator")
