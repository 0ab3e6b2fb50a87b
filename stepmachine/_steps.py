"""Steps, their outcomes, and what the machine hands them.

A step looks at the session in a :class:`StepContext` and returns exactly one
:data:`Outcome`:

* :class:`Refuse` -- not applicable now; the machine offers the next step;
* :class:`Continue` -- apply these effects, then start a new cycle from the top;
* :class:`Yield` -- apply these effects, then return control to the caller,
  with a :class:`YieldReason` the caller reads.

Every step has the shape of :class:`Operation`: a ``name``, the ``tools`` and
``prompt_parts`` it contributes to model requests (collected from every step
before every cycle, whether or not its ``run`` applies), ``run`` and
``finalize``. :class:`Inference` is the same shape for the step that calls a
model. Subclass either to inherit the defaults (no tools, no prompt parts,
nothing to finalize, the class name as ``name``).

A step must not keep decision state on itself between cycles (invariant 1);
what it needs during one cycle, such as partial output to hand to
``finalize``, goes into ``ctx.scratch``, which lives for that cycle only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Literal, Protocol, TypeAlias, TypeVar

import anyio
import msgspec

from ._effects import Effect
from ._emitter import EventData, EventSink
from ._errors import ConfigurationError
from ._messages import ToolCallPart
from ._model import ModelRequest, PromptPart, ToolDefinition
from ._runtime import Runtime
from ._session import Session

__all__ = [
    "CancelToken",
    "Continue",
    "Inference",
    "Operation",
    "Outcome",
    "Refuse",
    "StepContext",
    "StepResult",
    "Yield",
    "YieldReason",
]

D = TypeVar("D", bound=msgspec.Struct)


class YieldReason(msgspec.Struct, frozen=True):
    """Why a run returned control to the caller.

    ``kind`` is one of the constants below or an application's own string;
    ``message`` is for people; ``data`` carries details (for example the ids of
    the calls awaiting approval).
    """

    kind: str
    message: str = ""
    data: dict[str, Any] = msgspec.field(default_factory=dict)

    DONE: ClassVar[str] = "done"
    AWAITING_APPROVAL: ClassVar[str] = "awaiting_approval"
    AWAITING_EVENT: ClassVar[str] = "awaiting_event"
    BUDGET_EXHAUSTED: ClassVar[str] = "budget_exhausted"
    IDLE: ClassVar[str] = "idle"
    """No step applied: there is nothing to do until the session changes."""
    CANCELLED: ClassVar[str] = "cancelled"
    """The run was cancelled and finalized."""
    CALL_HELD: ClassVar[str] = "call_held"
    """No step applied and open tool calls are held back by a step's ``check_call``.

    ``message`` names the first objecting step, call id and tool; ``data["calls"]``
    lists every held call as ``{"call_id", "tool", "step", "objection"}`` (the
    first objecting step, in step order). Nothing runs the calls until the
    session changes (a decision recorded, an error result appended) and
    ``run()`` is called again.
    """
    CYCLE_LIMIT: ClassVar[str] = "cycle_limit"
    """The run reached the machine's ``max_cycles``; ``run()`` again continues.

    ``data`` holds ``{"max_cycles": n}``.
    """


@dataclass(frozen=True, slots=True)
class Refuse:
    """The step does not apply now."""

    why: str = ""


@dataclass(frozen=True, slots=True)
class Continue:
    """Apply ``effects``, then start the next cycle from the top of the list."""

    effects: tuple[Effect, ...]

    def __init__(self, effects: Sequence[Effect]) -> None:
        object.__setattr__(self, "effects", tuple(effects))


@dataclass(frozen=True, slots=True)
class Yield:
    """Apply ``effects`` (possibly none), then return control to the caller."""

    effects: tuple[Effect, ...]
    reason: YieldReason

    def __init__(self, effects: Sequence[Effect], reason: YieldReason | str) -> None:
        object.__setattr__(self, "effects", tuple(effects))
        object.__setattr__(
            self, "reason", YieldReason(reason) if isinstance(reason, str) else reason
        )


Outcome: TypeAlias = Refuse | Continue | Yield


@dataclass(frozen=True, slots=True)
class StepResult:
    """The report of one cycle.

    Attributes:
        step: the name of the step that applied.
        effects: the effects it returned (applied, unless ``status`` is
            ``"cancelled"`` and the step was interrupted before returning).
        status: ``"continue"``, ``"yielded"`` or ``"cancelled"``.
        revision: the session revision after the cycle.
        reason: the yield reason, for ``"yielded"`` and ``"cancelled"``.
    """

    step: str
    effects: tuple[Effect, ...]
    status: Literal["continue", "yielded", "cancelled"]
    revision: int
    reason: YieldReason | None = None


class CancelToken:
    """Asks a running machine to stop.

    ``cancel()`` cancels the running step (an anyio cancel scope); the machine
    then finalizes the session and returns with reason ``cancelled``. A token
    stays cancelled once fired. Call ``cancel()`` from the event loop's thread
    (from another thread, go through ``anyio.from_thread.run_sync``).
    """

    def __init__(self) -> None:
        self._cancelled = False
        self._scopes: set[anyio.CancelScope] = set()
        self._waiters: set[anyio.Event] = set()
        self.reason = ""

    @property
    def cancelled(self) -> bool:
        """True once :meth:`cancel` was called."""
        return self._cancelled

    def cancel(self, reason: str = "cancelled") -> None:
        """Fire the token: cancel every scope bound to it. Idempotent."""
        if self._cancelled:
            return
        self._cancelled = True
        self.reason = reason
        for scope in list(self._scopes):
            scope.cancel()
        for waiter in list(self._waiters):
            waiter.set()

    def bind(self, scope: anyio.CancelScope) -> None:
        """Cancel ``scope`` when the token fires (at once if it already has)."""
        if self._cancelled:
            scope.cancel()
        else:
            self._scopes.add(scope)

    def unbind(self, scope: anyio.CancelScope) -> None:
        """Stop tracking ``scope``."""
        self._scopes.discard(scope)

    async def wait(self) -> None:
        """Return once the token has fired."""
        if self._cancelled:
            return
        waiter = anyio.Event()
        self._waiters.add(waiter)
        try:
            await waiter.wait()
        finally:
            self._waiters.discard(waiter)


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
        scratch: per-cycle working space; the same dict is handed to
            ``finalize`` when this step is interrupted. Never persisted.
        steps: every step of the machine, in order (for ``check_call``).
        run_start_revision: the session revision when the current ``run()``
            began (per-run budgets count from it).
        committer: how :meth:`commit` persists; set by the machine or harness.
    """

    session: Session[D]
    runtime: Runtime
    events: EventSink
    cycle: int = 0
    tools: tuple[ToolDefinition, ...] = ()
    prompt_parts: tuple[PromptPart, ...] = ()
    scratch: dict[str, Any] = field(default_factory=dict)
    steps: tuple[Operation[D], ...] = ()
    run_start_revision: int = 0
    committer: Callable[[Session[D], Sequence[Effect]], Awaitable[Session[D]]] | None = None

    async def commit(self, effects: Sequence[Effect]) -> Session[D]:
        """Persist ``effects`` now, as their own batch, before the step returns.

        For journals: a step that must record something before it acts (an
        intent before running a tool, each result as soon as it exists) commits
        it here. The batch is a compare-and-set on ``ctx.session.revision`` and
        is recorded under this step's name and cycle; afterwards ``ctx.session``
        is the session it produced, and the effects the step finally returns
        apply on top of it.

        Returns:
            The new session (also stored in ``ctx.session``).

        Raises:
            ConflictError: another writer moved the session on; nothing was
                written, ``ctx.session`` is unchanged.
            ConfigurationError: the context belongs to no machine or harness.
        """
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


class Operation(Protocol[D]):
    """A policy step (run tools, ask for approval, compact, budget, ...).

    Subclass it to inherit the defaults below; implement :meth:`run`.
    """

    @property
    def name(self) -> str:
        """The step's name in results, logs and the audit log. Default: class name."""
        return type(self).__name__

    def tools(self, session: Session[D]) -> Sequence[ToolDefinition]:
        """Tool definitions this step contributes to model requests."""
        return ()

    def prompt_parts(self, session: Session[D]) -> Sequence[PromptPart]:
        """System prompt parts this step contributes to model requests."""
        return ()

    async def run(self, ctx: StepContext[D]) -> Outcome:
        """Look at ``ctx.session`` and decide: refuse, continue or yield.

        Cancellation: the machine may cancel this call at any await; then
        :meth:`finalize` is called with ``interrupted=True`` and the same ctx.
        """
        ...

    def shape_request(self, ctx: StepContext[D], request: ModelRequest) -> ModelRequest:
        """Adjust a model request before it is sent; default: unchanged.

        Inference steps pass every request through every step's
        ``shape_request``, in step order, then check invariant 4 on the result.
        For what ``tools`` and ``prompt_parts`` cannot say: a native output
        schema, the attempts left in a budget.
        """
        return request

    def check_call(self, ctx: StepContext[D], call: ToolCallPart) -> str | None:
        """Object to running ``call`` now: return the reason, or ``None``.

        ``ctx`` is the context of the step about to run the call (its
        ``session`` and ``runtime``, e.g. the clock for expiring approvals).

        Steps that run tools ask every step of the machine before running each
        call and hold back any call with an objection, whatever the order of
        the steps. This is how a policy (approval, budgets) guards tool
        execution without depending on being listed first. Default: ``None``.

        A held call stays open. The objecting step chooses what happens next:
        its ``run`` may yield with its own reason (``Approval`` yields
        ``awaiting_approval``) or answer the call with an error result (a
        budget does, so the model learns why); if no step applies, the run
        yields :attr:`YieldReason.CALL_HELD`, naming the objecting step, the
        call id and the tool -- never a silent ``idle``.
        """
        return None

    async def finalize(self, ctx: StepContext[D], *, interrupted: bool) -> Sequence[Effect]:
        """Effects that keep what was already done, after a cancellation.

        Called shielded. First for the step that was running, with
        ``interrupted=True`` and its cycle's ctx (the same ``scratch``) whose
        ``session`` is the session as stored now -- its own batch may have been
        committed just before the cancellation, so check before re-adding.
        Then for every other step, with ``interrupted=False`` and a fresh ctx.
        Default: nothing.
        """
        return ()


class Inference(Operation[D], Protocol[D]):
    """The step that calls a model.

    It applies when the conversation ends on something the model must answer
    (a user message, or tool results that close every open call), streams
    deltas to the emitter, and returns the assistant message as effects.
    """
