"""What a step is, what it sees, what else it may do, and how the machine asks the steps that do.

(One module because these refer to each other: a step's hooks take a
:class:`StepContext`, and the context answers cross-step questions through
the machine's :class:`Capabilities`.)

A step is a ``name`` and ``run`` (:class:`Step`); nothing more is required::

    class Greeter:
        name = "greeter"

        async def run(self, ctx: StepContext[NoData]) -> Outcome:
            ...

Everything else is an optional capability, one small protocol each. A step
opts in by having the method (or, for :class:`AnswersUnknownTools`, the
attribute set to ``True``); the machine sorts its steps by capability once,
when it is built (:class:`Capabilities`), and each cycle asks only the steps
that have one:

* :class:`ContributesTools` -- ``tools(session)``: tool definitions for model
  requests;
* :class:`ContributesPromptParts` -- ``prompt_parts(session)``: system prompt
  parts;
* :class:`ShapesRequests` -- ``shape_request(ctx, request)``: adjust a model
  request before it is sent;
* :class:`VetsCalls` -- ``check_call(ctx, call)``: object to running a tool
  call now;
* :class:`Finalizes` -- ``finalize(ctx, interrupted=...)``: keep what was done
  after a cancellation;
* :class:`AnswersUnknownTools` -- ``answers_unknown_tools = True``: the step
  answers a tool call naming a tool no step advertises (``Tools`` does, with an
  "unknown tool" error result);
* :class:`OpensForRun` -- ``open_for_run(runtime)``: an async context manager
  ``run()`` holds open around its cycles (``McpTools`` connects to its
  servers in it).

Tools and prompt parts are collected from the steps that contribute them
before each cycle, whether or not their own ``run`` applies. Steps never
reference each other: a step that needs the others' say asks its context --
:meth:`StepContext.shape_request`, :meth:`StepContext.vet_call`,
:attr:`StepContext.answers_unknown_tools` -- and the machine asks every step
with the capability, in step order.

:class:`~stepmachine.Operation` and :class:`~stepmachine.Inference` are base
classes with every hook as a no-op default. Those defaults are marked
(:func:`no_op_default`) and do not count as a capability, so a subclass that
overrides only ``run`` costs nothing in the hooks it does not override.
"""

from __future__ import annotations

import sys
import sysconfig
import warnings
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Final, Generic, Protocol, TypeVar, cast

import msgspec

from ._effects import Effect
from ._emitter import EventData, EventSink
from ._errors import ConfigurationError
from ._messages import ToolCallPart
from ._model import ChunkSink, Model, ModelRequest, ModelResponse, PromptPart, ToolDefinition
from ._model_call import ModelCall
from ._outcomes import Outcome
from ._runtime import Runtime
from ._session import Session

__all__ = [
    "AnswersUnknownTools",
    "Capabilities",
    "ContributesPromptParts",
    "ContributesTools",
    "Finalizes",
    "Objection",
    "OpensForRun",
    "ShapesRequests",
    "Step",
    "StepContext",
    "VetsCalls",
    "cycle_context",
    "no_op_default",
    "step_name",
    "tool_name_clash",
]

D = TypeVar("D", bound=msgspec.Struct)
F = TypeVar("F", bound=Callable[..., Any])

_NO_OP = "__stepmachine_no_op__"


def no_op_default(method: F) -> F:
    """Mark a base class's hook as a no-op default: having it is not the capability."""
    setattr(method, _NO_OP, True)
    return method


class Step(Protocol[D]):
    """What every step is: a name and ``run``."""

    @property
    def name(self) -> str:
        """The step's name in results, logs and the audit log; unique in a machine."""
        ...

    async def run(self, ctx: StepContext[D]) -> Outcome:
        """Look at ``ctx.session`` and decide: refuse, continue or yield.

        Cancellation: the machine may cancel this call at any await; then the
        step's ``finalize`` (if it has one) is called with ``interrupted=True``
        and the same ctx.
        """
        ...


class ContributesTools(Protocol[D]):
    """A step that offers tool definitions to every model request."""

    def tools(self, session: Session[D]) -> Sequence[ToolDefinition]:
        """Tool definitions this step contributes to model requests.

        Collected before every cycle, whether or not this step's ``run``
        applies. Two steps advertising one tool name is a
        :class:`~stepmachine.ConfigurationError`, raised before any model call.
        """
        ...


class ContributesPromptParts(Protocol[D]):
    """A step that adds to the system prompt of every model request."""

    def prompt_parts(self, session: Session[D]) -> Sequence[PromptPart]:
        """System prompt parts this step contributes, collected before every cycle."""
        ...


class ShapesRequests(Protocol[D]):
    """A step that adjusts model requests before they are sent."""

    def shape_request(self, ctx: StepContext[D], request: ModelRequest) -> ModelRequest:
        """Return ``request`` adjusted (or unchanged).

        Called, in step order, for every request a step sends through
        :meth:`StepContext.shape_request`: the conversation's next turn
        (``request.purpose == "turn"``) and side requests such as a
        summariser's. For what ``tools`` and ``prompt_parts`` cannot say: a
        native output schema, the attempts left in a budget. In a side request
        only the settings, ``max_attempts`` and prompt parts are taken from
        the result (see :attr:`ModelRequest.purpose`). ``max_attempts`` can
        only be lowered: a value above the one received (or ``None`` after a
        value) is replaced by the one received. ``settings.max_tokens`` can
        only be lowered once a shaper has set or lowered it.
        """
        ...


class VetsCalls(Protocol[D]):
    """A step that may hold tool calls back (approval, budgets)."""

    def check_call(self, ctx: StepContext[D], call: ToolCallPart) -> str | None:
        """Object to running ``call`` now: return the reason, or ``None``.

        ``ctx`` is the context of the step about to run the call (its
        ``session`` and ``runtime``, e.g. the clock for expiring approvals).
        A step that runs tools asks :meth:`StepContext.vet_call` before each
        call, which asks every vetting step, whatever the order of the steps;
        a call with an objection is held back: not run, left open. The
        objecting step chooses what happens next: its ``run`` may yield with
        its own reason (``Approval`` yields ``awaiting_approval``) or answer
        the call with an error result (a budget does, so the model learns
        why); if no step applies, the run yields
        :attr:`~stepmachine.YieldReason.CALL_HELD`, naming the objecting
        step, the call id and the tool -- never a silent ``idle``.
        """
        ...


class Finalizes(Protocol[D]):
    """A step with something to keep after a cancellation."""

    async def finalize(self, ctx: StepContext[D], *, interrupted: bool) -> Sequence[Effect]:
        """Effects that keep what was already done, after a cancellation.

        Called shielded. First for the step that was running, with
        ``interrupted=True`` and its cycle's ctx (the same ``scratch``) whose
        ``session`` is the session as stored now -- its own batch may have been
        committed just before the cancellation, so check before re-adding.
        Then for every other finalizing step, with ``interrupted=False`` and a
        fresh ctx.
        """
        ...


class AnswersUnknownTools(Protocol):
    """A step that answers tool calls naming a tool no step advertises.

    Set ``answers_unknown_tools = True`` on the step (``Tools`` does: it answers
    such a call with an "unknown tool" error result). Steps that repair history
    (``HistoryGuard``) leave those calls to it; without such a step they
    answer them themselves.
    """

    @property
    def answers_unknown_tools(self) -> bool:
        """``True``: this step answers calls of tools nobody advertises."""
        ...


class OpensForRun(Protocol):
    """A step that holds something open (connections, processes) while a run goes on."""

    def open_for_run(self, runtime: Runtime) -> AbstractAsyncContextManager[None]:
        """What ``run()`` enters before its first cycle and exits when it returns.

        :meth:`~stepmachine.StateMachine.run` enters the context of every step
        that has one, in step order, before it loads the session, and exits
        them in reverse order when it returns, raises or is cancelled (each
        round of a leased run opens them again). Callers that drive ``step``
        themselves enter :meth:`~stepmachine.StateMachine.opened`. Entering may
        raise (a :class:`~stepmachine.ConfigurationError` stops the run before
        any model call); a step whose resources are already open (shared by
        the application) enters a no-op. Exiting must not raise.
        """
        ...


@dataclass(frozen=True, slots=True)
class Objection:
    """Why a tool call may not run now, and which step says so.

    Attributes:
        step: the name of the objecting step (the first one, in step order).
        reason: its reason, for people and for the ``call_held`` yield.
    """

    step: str
    reason: str


def _has_hook(step: object, name: str) -> bool:
    """Whether ``step`` has the hook ``name`` as more than a marked no-op default."""
    hook = getattr(step, name, None)
    if hook is None or not callable(hook):
        return False
    return not getattr(hook, _NO_OP, False)


class Capabilities(Generic[D]):
    """A machine's steps, sorted once by capability; asks the steps that have one.

    Built by :class:`~stepmachine.StateMachine` when it is constructed, and
    shared by every context it builds. Each tuple keeps step order; nothing
    changes after construction (a capability is read once, when sorting).

    Attributes:
        steps: every step, in order.
        tool_steps: the steps that contribute tools.
        prompt_steps: the steps that contribute prompt parts.
        shapers: the steps that shape requests.
        vetters: the steps that vet tool calls.
        finalizers: the steps that finalize.
        openers: the steps that hold something open while a run goes on.
        answers_unknown_tools: some step answers calls of unadvertised tools.
    """

    __slots__ = (
        "answers_unknown_tools",
        "finalizers",
        "openers",
        "prompt_steps",
        "shapers",
        "steps",
        "tool_steps",
        "vetters",
    )

    def __init__(self, steps: Sequence[Step[D]]) -> None:
        self.steps: tuple[Step[D], ...] = tuple(steps)
        self.tool_steps = cast("tuple[ContributesTools[D], ...]", self._having("tools"))
        self.prompt_steps = cast(
            "tuple[ContributesPromptParts[D], ...]", self._having("prompt_parts")
        )
        self.shapers = cast("tuple[ShapesRequests[D], ...]", self._having("shape_request"))
        self.vetters = cast("tuple[VetsCalls[D], ...]", self._having("check_call"))
        self.finalizers = cast("tuple[Finalizes[D], ...]", self._having("finalize"))
        self.openers = cast("tuple[OpensForRun, ...]", self._having("open_for_run"))
        self.answers_unknown_tools = any(
            getattr(step, "answers_unknown_tools", False) is True for step in self.steps
        )

    def _having(self, hook: str) -> tuple[object, ...]:
        return tuple(step for step in self.steps if _has_hook(step, hook))

    def collect(
        self, session: Session[D]
    ) -> tuple[tuple[ToolDefinition, ...], tuple[PromptPart, ...]]:
        """Tool definitions and prompt parts from the steps that contribute them, in step order.

        A step whose tools can change while it runs (``McpTools``: a server's
        list changed) may give way on a clash: its ``yields_tool(name, other)``
        returns ``True`` and its definition is left out, the other step's kept
        (the yielding step logs it and no longer runs calls of that name).

        Raises:
            ConfigurationError: two steps (or one step twice) advertise a tool
                name, and neither gives way.
        """
        tools: list[ToolDefinition] = []
        owner: dict[str, tuple[int, object]] = {}  # name -> (index in tools, step)
        for step in self.tool_steps:
            for definition in step.tools(session):
                name = definition.name
                if name in owner:
                    index, holder = owner[name]
                    if _yields(step, name, holder):
                        continue
                    if holder is not step and _yields(holder, name, step):
                        tools[index] = definition
                        owner[name] = (index, step)
                        continue
                    raise ConfigurationError(
                        tool_name_clash(name, step_name(holder), step_name(step))
                    )
                owner[name] = (len(tools), step)
                tools.append(definition)
        parts: list[PromptPart] = []
        for contributor in self.prompt_steps:
            parts.extend(contributor.prompt_parts(session))
        return tuple(tools), tuple(parts)

    def shape(self, ctx: StepContext[D], request: ModelRequest) -> ModelRequest:
        """``request`` passed through every shaping step, in step order.

        ``max_attempts`` only goes down along the way: once a step has set it,
        a later one that raises it or leaves it ``None`` gets the lower value
        (so a budget's cap holds whatever the order of the steps, exact budgets).
        ``settings.max_tokens`` likewise, from the first shaper that sets or
        lowers it (the asker's own value may be raised by a shaper; a value a
        shaper lowered, such as a budget's output-token cap, may not).
        For a side request (``purpose`` other than ``"turn"``) the content stays
        the asker's: the messages, tools and output schema of ``request`` are
        kept whatever a shaper returned; settings, ``max_attempts`` and prompt
        parts are the shapers'.
        """
        shaped = request
        token_cap: int | None = None  # the lowest max_tokens a shaper set or lowered
        for step in self.shapers:
            cap = shaped.max_attempts
            tokens_before = shaped.settings.max_tokens
            shaped = step.shape_request(ctx, shaped)
            if cap is not None and (shaped.max_attempts is None or shaped.max_attempts > cap):
                # A cap only goes down: a later shaper (a retry policy, one that
                # builds a new request) cannot undo a budget's (exact budgets).
                shaped = msgspec.structs.replace(shaped, max_attempts=cap)
            tokens = shaped.settings.max_tokens
            if token_cap is not None and (tokens is None or tokens > token_cap):
                settings = msgspec.structs.replace(shaped.settings, max_tokens=token_cap)
                shaped = msgspec.structs.replace(shaped, settings=settings)
            elif tokens is not None and (tokens_before is None or tokens < tokens_before):
                token_cap = tokens  # this shaper set or lowered it: later ones cannot undo that
        if request.purpose == ModelRequest.TURN or shaped is request:
            return shaped
        return msgspec.structs.replace(
            shaped,
            messages=request.messages,
            tools=request.tools,
            output_schema=request.output_schema,
            output_name=request.output_name,
            purpose=request.purpose,
        )

    def vet(self, ctx: StepContext[D], call: ToolCallPart) -> Objection | None:
        """The first objection to running ``call`` now, in step order; ``None`` if none."""
        for step in self.vetters:
            reason = step.check_call(ctx, call)
            if reason is not None:
                return Objection(step_name(step), reason)
        return None

    def finalizes(self, step: object) -> bool:
        """Whether ``step`` is one of the finalizing steps."""
        return any(step is finalizer for finalizer in self.finalizers)


def _yields(step: object, tool: str, other: object) -> bool:
    """Whether ``step`` leaves its tool ``tool`` to ``other`` (its ``yields_tool`` hook)."""
    hook = getattr(step, "yields_tool", None)
    return callable(hook) and hook(tool, step_name(other)) is True


def tool_name_clash(tool: str, first: str, second: str) -> str:
    """The message of the :class:`ConfigurationError` for ``tool`` advertised by two steps."""
    by = f"by both {first!r} and {second!r}" if first != second else f"twice by {first!r}"
    return (
        f"tool name {tool!r} is advertised {by}; a model names a tool by its name, so each "
        "name must be advertised once: give one of the tools another name "
        "(@tool(name='...') or tool(name='...')(fn); an MCP server's tools: "
        "McpStdio(..., prefix='...') or McpHttp(..., prefix='...')), or offer it from one"
        " step only"
    )


def step_name(step: object) -> str:
    """The name of a step held by its capability (every step has a ``name``)."""
    return str(getattr(step, "name", type(step).__name__))


_NO_STEPS: Capabilities[Any] = Capabilities(())


@dataclass(slots=True)
class StepContext(Generic[D]):
    """What a step sees for one cycle.

    Attributes:
        session: the session as loaded for this cycle.
        runtime: the application's IO dependencies.
        events: the event sink, stamped for this session.
        cycle: the cycle number within the run, from 1 (0 outside a run).
        tools: the tool definitions collected from every step this cycle.
        prompt_parts: the prompt parts collected from every step this cycle.
        scratch: deprecated (reading it gives a ``DeprecationWarning``), unused
            by every built-in step: per-cycle working space, handed to
            ``finalize`` when this step is interrupted. Staged work keeps what a
            task has in the task itself (its ``keep``), and the machine holds
            every finished result.
        steps: deprecated (reading it gives a ``DeprecationWarning``), unused
            by every built-in step: every step of the machine, in order. Ask
            the context instead (:meth:`shape_request`, :meth:`vet_call`,
            :attr:`answers_unknown_tools`). A context built by hand with
            ``steps`` and no ``capabilities`` asks those steps (passing it
            does not warn).
        run_start_revision: the session revision when the current ``run()``
            began (per-run budgets count from it).
        committer: how the deprecated :meth:`commit` persists; set by the
            machine or harness.
        capabilities: the machine's steps sorted by capability, which answer
            :meth:`shape_request`, :meth:`vet_call` and
            :attr:`answers_unknown_tools`; set by the machine or harness.
    """

    session: Session[D]
    runtime: Runtime
    events: EventSink
    cycle: int = 0
    tools: tuple[ToolDefinition, ...] = ()
    prompt_parts: tuple[PromptPart, ...] = ()
    scratch: dict[str, Any] = field(default_factory=dict)
    steps: tuple[Step[D], ...] = ()
    run_start_revision: int = 0
    committer: Callable[[Session[D], Sequence[Effect]], Awaitable[Session[D]]] | None = None
    capabilities: Capabilities[D] = _NO_STEPS

    def __init__(
        self,
        session: Session[D],
        runtime: Runtime,
        events: EventSink,
        cycle: int = 0,
        tools: tuple[ToolDefinition, ...] = (),
        prompt_parts: tuple[PromptPart, ...] = (),
        scratch: dict[str, Any] | None = None,
        steps: tuple[Step[D], ...] = (),
        run_start_revision: int = 0,
        committer: Callable[[Session[D], Sequence[Effect]], Awaitable[Session[D]]] | None = None,
        capabilities: Capabilities[D] = _NO_STEPS,
    ) -> None:
        # Written by hand (the dataclass keeps it) so that the deprecated fields cost
        # nothing when not given: their slots are filled on first read.
        self.session = session
        self.runtime = runtime
        self.events = events
        self.cycle = cycle
        self.tools = tools
        self.prompt_parts = prompt_parts
        self.run_start_revision = run_start_revision
        self.committer = committer
        if scratch is not None:
            _SCRATCH_SLOT.__set__(self, scratch)
        if steps:
            _STEPS_SLOT.__set__(self, steps)
            if capabilities is _NO_STEPS:
                capabilities = Capabilities(steps)  # built by hand with ``steps``
        self.capabilities = capabilities

    def shape_request(self, request: ModelRequest) -> ModelRequest:
        """``request`` as it will be sent: passed through every step's ``shape_request``.

        In step order, each step given the previous one's result (see
        :class:`~stepmachine.ShapesRequests`). For a side request
        (``request.purpose`` other than ``"turn"``) the messages, tools and
        output schema stay as given. Whoever sends the request checks
        the "valid history" guarantee on the result if its messages changed.

        Raises:
            Exception: whatever a shaper raises (a budget with no model call
                left raises ``BudgetExhaustedError``); send nothing then.
        """
        return self.capabilities.shape(self, request)

    def vet_call(self, call: ToolCallPart) -> Objection | None:
        """The first objection of a step to running ``call`` now; ``None``: it may run.

        Asks every step's ``check_call`` in step order, with this context,
        whatever the position of the asking step. A step that runs tools asks
        before each call and leaves a call with an objection open.
        """
        return self.capabilities.vet(self, call)

    @property
    def answers_unknown_tools(self) -> bool:
        """Whether some step answers tool calls naming a tool no step advertises (``Tools``)."""
        return self.capabilities.answers_unknown_tools

    async def commit(self, effects: Sequence[Effect]) -> Session[D]:
        """Deprecated: return :class:`~stepmachine.Staged` instead (the machine writes).

        Persists ``effects`` now, as their own batch, before the step returns
        (it still works, with a ``DeprecationWarning``, for steps written for
        earlier releases). A step that must record something before it acts
        (an intent before running a tool, each result as soon as it exists)
        returns ``Staged(intents, tasks)``: the machine writes the intents, runs
        the tasks and writes each result as it lands, holds every finished
        result across a cancellation, and confirms the lease before a guarded
        start -- none of which a step committing by itself gets. The batch is
        a compare-and-set on ``ctx.session.revision`` and is recorded under
        this step's name and cycle; afterwards ``ctx.session`` is the session
        it produced, and the effects the step finally returns apply on top of it.

        Returns:
            The new session (also stored in ``ctx.session``).

        Raises:
            ConflictError: another writer moved the session on; nothing was
                written, ``ctx.session`` is unchanged.
            ConfigurationError: the context belongs to no machine or harness.
        """
        warnings.warn(
            "StepContext.commit is deprecated: return Staged(intents, tasks) and let the "
            "machine write (see stepmachine.Staged); it will be removed in a later release",
            DeprecationWarning,
            stacklevel=2,
        )
        if self.committer is None:
            raise ConfigurationError("this StepContext cannot commit: it belongs to no machine")
        if not effects:
            return self.session
        self.session = await self.committer(self.session, effects)
        self.events.follow(self.session.revision)
        return self.session

    def new_id(self) -> str:
        """A new message id from the runtime's id source."""
        return self.runtime.ids()

    async def emit(self, data: EventData) -> None:
        """Send a display event for this session."""
        await self.events.emit(data)

    async def request_model(
        self, model: Model, request: ModelRequest, *, on_chunk: ChunkSink | None = None
    ) -> ModelResponse:
        """``model.request(request, on_chunk=...)``, observed: every step that calls a model
        calls it through here.

        In a traced run the call is a ``chat`` span (OpenTelemetry GenAI
        attributes; retries as span events), and it is logged as a
        ``model_call`` event (see the README, "Seeing inside a run"); the request and the
        reply appear in them only with content capture on.

        ``Runtime.model_override``, when set, answers instead of ``model``.

        Raises and cancels exactly as ``model.request`` does.
        """
        override = self.runtime.model_override
        if override is not None:
            model = override
        with ModelCall(self.session.id, self.runtime.telemetry, model, request) as observed:
            response = await model.request(request, on_chunk=on_chunk)
            observed.replied(response)
        return response


_LIBRARY_DIRS: Final = tuple(
    {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
)
"""Where the standard library and installed packages live (their reads do not warn)."""


def _deprecated_field(name: str, slot: Any, default: Callable[[], object], advice: str) -> property:
    """A property over the slot ``slot`` of :class:`StepContext` that warns when read.

    Reads by the package itself (the dataclass's generated ``__repr__`` and
    ``__eq__``, ``dataclasses.replace``) and by installed libraries and the
    standard library (a traceback renderer showing locals, a pretty-printer
    walking the dataclass's fields) do not warn: only the application's own
    code that uses the field does.
    """

    def read(self: StepContext[Any]) -> Any:
        frame = sys._getframe(1)
        caller = str(frame.f_globals.get("__name__", ""))
        if not (
            caller == "stepmachine"
            or caller.startswith("stepmachine.")
            or frame.f_code.co_filename.startswith(_LIBRARY_DIRS)
        ):
            warnings.warn(
                f"StepContext.{name} is deprecated and unused by every built-in step: "
                f"{advice}; it will be removed in a later release",
                DeprecationWarning,
                stacklevel=2,
            )
        try:
            return slot.__get__(self)
        except AttributeError:  # not given when built: the default, kept from now on
            value = default()
            slot.__set__(self, value)
            return value

    return property(read, slot.__set__, doc=f"Deprecated (reading it warns): {advice}.")


_SCRATCH_SLOT: Any = StepContext.__dict__["scratch"]
_STEPS_SLOT: Any = StepContext.__dict__["steps"]
setattr(  # noqa: B010 - replaces the slot's descriptor after the dataclass is built
    StepContext,
    "scratch",
    _deprecated_field(
        "scratch",
        _SCRATCH_SLOT,
        dict,
        "keep what a task has in the task itself (Staged, Task(keep=...)) and what must "
        "last in the session (effects)",
    ),
)
setattr(  # noqa: B010
    StepContext,
    "steps",
    _deprecated_field(
        "steps",
        _STEPS_SLOT,
        tuple,
        "ask the context instead (ctx.shape_request, ctx.vet_call, ctx.answers_unknown_tools)",
    ),
)


def cycle_context(
    capabilities: Capabilities[D],
    runtime: Runtime,
    session: Session[D],
    sink: EventSink,
    cycle: int,
    run_start_revision: int,
    collected: tuple[tuple[ToolDefinition, ...], tuple[PromptPart, ...]] | None = None,
) -> StepContext[D]:
    """A fresh ctx for ``session``, whose cross-step questions ``capabilities`` answers.

    ``collected`` is ``capabilities.collect(session)``, if known.
    """
    tools, parts = capabilities.collect(session) if collected is None else collected
    return StepContext(
        session=session,
        runtime=runtime,
        events=sink,
        cycle=cycle,
        tools=tools,
        prompt_parts=parts,
        run_start_revision=run_start_revision,
        capabilities=capabilities,
    )
