"""The machine loop: the one module that owns transitions.

A cycle:

1. collect tool definitions and prompt parts from the steps that contribute
   them (a tool name advertised twice raises :class:`ConfigurationError`,
   before any model call);
2. offer the steps, in order, the session; the first that does not refuse wins;
3. apply its effects as one batch: a compare-and-set on the revision it read;
4. ``Continue`` starts the next cycle from the top; ``Yield``, or no step
   applying, returns to the caller.

When no step applies the run returns ``idle``, unless open tool calls are held
back by a step's ``check_call``: then it returns ``call_held``, naming the
objecting step, the call and the tool, so a held call is never silent.

A run applies at most ``max_cycles`` cycles (default
:data:`DEFAULT_MAX_CYCLES`), then returns ``cycle_limit``; calling ``run()``
again continues with a fresh count. This bounds a model that keeps calling
tools when no ``Budget`` is configured; ``max_cycles=None`` removes the cap.

State is the session: the machine keeps nothing between cycles
that affects a decision. After a successful apply the next cycle starts from
the session the effect handler returns (the stored view, decoded from what it
wrote), or, for a handler that returns ``None``, from the batch applied
locally -- the same value: the compare-and-set proved that nobody wrote in
between, and applying effects is pure. On a conflict the machine reloads and re-steps (at most
``max_conflicts`` times per run) and never overwrites.

Steps that hold something open while a run goes on (``open_for_run``, e.g.
``McpTools``' server connections) are opened by ``run()`` before its first
cycle and closed when it returns; callers driving ``step`` enter
:meth:`StateMachine.opened` themselves.

The loop is ``_cycle.Driver``: ``run()`` is ``Driver.run`` (the lease, the
rounds, and each cycle: ``decide`` then ``apply``, in ``_cycle``);
cancellation and finalize are ``_finalize``, the lease's side of a run is
``_hold``.

Cancellation. When the machine's :class:`CancelToken` fires, the running step
is cancelled; then :meth:`StateMachine.finalize` runs shielded: the
interrupted step, then every other step, may return effects that keep what
was already received, and every tool call still without a result is answered
with an "interrupted" error result. A tool call whose tool ran to completion
keeps its real result, whatever instant the cancellation landed at (while its
"tool finished" event was emitted, or its result committed): "interrupted"
only ever answers a call that has no result. The run then returns with reason
``cancelled``. When the caller cancels ``run()`` from outside, the same
finalize runs shielded for at most ``finalize_timeout`` seconds, and the
cancellation propagates. So it does for ``KeyboardInterrupt`` and ``SystemExit``
raised inside the run (Ctrl-C under trio lands at any checkpoint, for example
just after a tool returned), which then propagate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from types import EllipsisType
from typing import Any, Generic, TypeVar

import anyio
import msgspec

from ._capabilities import Capabilities, Step, tool_name_clash
from ._conversation import Conversation
from ._cycle import Driver, apply, decide
from ._decision import Decision, Interrupted, RunReport
from ._emitter import Emitter, EventSink, NullEmitter
from ._errors import ConfigurationError, ConflictError
from ._finalize import (
    FINALIZE_STEP,
    INTERRUPTED,
    finalize,
    keep_interrupted,
    keep_records,
    shielded,
    stops_the_run,
)
from ._hold import Turns, claim, leasing_store
from ._lease import Lease, LeasePolicy, new_owner
from ._model import PromptPart, ToolDefinition
from ._runtime import Runtime
from ._session import NoData, Session
from ._staged import Staged
from ._step_contract import shown
from ._steps import CancelToken, StepResult, YieldReason
from ._tool_step import Tools
from ._tools import Tool

__all__ = [
    "DEFAULT_MAX_CYCLES",
    "FINALIZE_STEP",
    "INTERRUPTED",
    "Decision",
    "RunReport",
    "StateMachine",
]

D = TypeVar("D", bound=msgspec.Struct)

DEFAULT_MAX_CYCLES = 100
"""Cycles one ``run()`` applies at most before it yields ``cycle_limit``.

A model turn with tool calls takes two cycles (inference, then tools), plus one
for each policy step that acts (approval, compaction, a repair). 100 cycles is
some 40-50 model calls in one run: far more than an interactive turn needs, and
a bound on a model that never stops calling tools when no ``Budget`` is
configured (without one, such a run spins as fast as the model answers). A run
that hits it loses nothing: ``run()`` again continues from the stored session.
"""


class StateMachine(Generic[D]):
    """Loops over an ordered list of steps; see the module docs for the cycle.

    Args:
        steps: the steps, in priority order. Names must be unique. A step is
            a ``name`` and ``run``; the machine sorts the steps by their
            optional capabilities here, once (see :class:`Step`), and asks
            only the steps that have one.
        cancel: a token that stops the run (then it is finalized).
        max_conflicts: conflicts tolerated per run before ``ConflictError``
            propagates.
        finalize_timeout: seconds finalize may take after an outside
            cancellation of ``run()``.
        max_cycles: cycles one ``run()`` applies at most before it returns
            with reason ``cycle_limit`` (see :data:`DEFAULT_MAX_CYCLES`);
            ``None`` for no cap. A later ``run()`` continues with a fresh count.
        lease: how ``run()`` claims the session's lease when the runtime's
            store has leases (:class:`~stepmachine.Leases`; the shipped stores
            do): a :class:`LeasePolicy` (default: wait for a busy session), or
            ``None`` to run without a lease. See :meth:`run_report`.

    Raises:
        ConfigurationError: no steps, an item is not a step (a class instead
            of an instance, a tool outside ``Tools``, anything without a
            ``name`` and a ``run``), two steps share a name, two steps
            advertise one tool name (checked here for the tool steps whose
            tools are fixed, such as ``Tools``; tools that depend on the
            session, such as ``McpTools``', are checked each cycle, before any
            model call),
            ``lease`` is not a ``LeasePolicy`` or ``None``,
            ``max_cycles`` is not ``None`` or a positive integer,
            ``max_conflicts`` is not an int >= 0, or ``finalize_timeout`` is
            not a number > 0.
    """

    def __init__(
        self,
        steps: Sequence[Step[D]],
        *,
        cancel: CancelToken | None = None,
        max_conflicts: int = 16,
        finalize_timeout: float = 10.0,
        max_cycles: int | None = DEFAULT_MAX_CYCLES,
        lease: LeasePolicy | None = LeasePolicy(),  # noqa: B008 - frozen, shared safely
    ) -> None:
        self.steps: tuple[Step[D], ...] = tuple(steps)
        if not self.steps:
            raise ConfigurationError(
                f"a StateMachine needs at least one step, got {steps!r}; pass the steps in "
                "priority order, e.g. StateMachine([Tools([...]), ModelInference()])"
            )
        for position, item in enumerate(self.steps):
            _check_step(position, item)
        names = [s.name for s in self.steps]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigurationError(
                f"step names must be unique (results, logs and the audit log name steps); "
                f"repeated: {duplicates!r}; give each its own (e.g. Tools(..., name='...'))"
            )
        _check_fixed_tool_names(self.steps)
        self.capabilities = Capabilities(self.steps)
        self.cancel = cancel
        if (
            isinstance(max_conflicts, bool)
            or not isinstance(max_conflicts, int)
            or max_conflicts < 0
        ):
            raise ConfigurationError(f"max_conflicts must be an int >= 0, got {max_conflicts!r}")
        self.max_conflicts = max_conflicts
        if (
            isinstance(finalize_timeout, bool)
            or not isinstance(finalize_timeout, int | float)
            or not finalize_timeout > 0
        ):
            # With 0 finalize would be cancelled before it began, and a result that
            # exists at the cancellation would never be recorded.
            raise ConfigurationError(
                f"finalize_timeout must be a number of seconds > 0, got {finalize_timeout!r}"
            )
        self.finalize_timeout = finalize_timeout
        if max_cycles is not None and (
            isinstance(max_cycles, bool) or not isinstance(max_cycles, int) or max_cycles < 1
        ):
            raise ConfigurationError(
                f"max_cycles must be None or a positive integer, got {max_cycles!r}"
            )
        self.max_cycles = max_cycles
        if lease is not None and not isinstance(lease, LeasePolicy):
            raise ConfigurationError(f"lease must be a LeasePolicy or None, got {lease!r}")
        self.lease = lease

    # -- the loop -------------------------------------------------------------------

    async def run(
        self,
        runtime: Runtime,
        session_id: str,
        emitter: Emitter | None = None,
        *,
        lease: LeasePolicy | Lease | EllipsisType | None = ...,
    ) -> Session[D]:
        """Run cycles until a step yields or none applies; return the session.

        Equivalent to ``(await run_report(...)).session``. Calling ``run`` again
        later continues where the stored session left off. The run also returns
        after ``max_cycles`` applied cycles (reason ``cycle_limit``), and with
        reason ``call_held`` when no step applies while a step's ``check_call``
        holds open tool calls back.

        Raises:
            SessionNotFoundError: no such session.
            ConfigurationError: duplicate tool names, missing model or store.
            StepContractError: a step returned something ``run`` may not return.
            ConflictError: more than ``max_conflicts`` conflicts in this run.
            Exception: whatever a step raises; effects applied before stay.

        Cancellation: see the module docs. From outside, finalize runs
        shielded for at most ``finalize_timeout`` seconds, then the
        cancellation propagates.

        Leases: see :meth:`run_report`.
        """
        return (await Driver(self, runtime).run(session_id, emitter, lease)).session

    async def run_report(
        self,
        runtime: Runtime,
        session_id: str,
        emitter: Emitter | None = None,
        *,
        lease: LeasePolicy | Lease | EllipsisType | None = ...,
    ) -> RunReport[D]:
        """Like :meth:`run`, and also say why the run returned and what each cycle did.

        Leases (see :class:`~stepmachine.Leases`). When the runtime's store has leases
        (and the runtime names no separate effect handler), the run holds the
        session's lease from before its first cycle until it returns: it
        claims it under ``lease`` (default: the machine's policy), renews it
        every ``ttl / 3`` in the background, writes every batch fenced by it,
        and releases it, shielded, when it returns. Before releasing, it takes
        the session's pending-run mark, if a ``run()`` queued a turn or
        ``store.request_run`` was called meanwhile, and runs again; the report
        then covers every round. ``lease`` may also be a :class:`Lease` the
        caller claimed (``store.claim_next`` in a worker loop, see
        :func:`~stepmachine.serve`): the run holds, renews and releases it the
        same way. ``lease=None`` runs without one; ``...`` (the default) uses
        the machine's policy.

        A run that queued its turn (``LeasePolicy(busy="queue")`` while another
        runner held the session) returns at once with reason ``queued`` and the
        stored session, having written nothing.

        Raises:
            SessionBusyError: the session is held and the policy is ``fail``,
                or ``wait`` and its ``wait_timeout`` passed; nothing was written.
            LeaseLostError: the lease was lost while the run held it (it
                expired and another runner claimed the session, or it could
                not be renewed before it lapsed); no write of this run after
                the loss was stored, and no non-idempotent tool was started
                after it (the lease is confirmed with the store right before
                each one starts). The batches before it stay.
            ConfigurationError: ``lease`` is not a ``LeasePolicy``, a ``Lease``
                of this session or ``None``, or a ``Lease`` was given for a
                store without leases.
        """
        return await Driver(self, runtime).run(session_id, emitter, lease)

    @asynccontextmanager
    async def opened(self, runtime: Runtime) -> AsyncIterator[None]:
        """Hold open what the steps hold open during a run (their ``open_for_run``).

        ``run()`` does this itself; enter it when driving :meth:`step` by hand
        (``async with machine.opened(runtime): ...``). The steps' contexts are
        entered in step order and exited in reverse order, also when the body
        raises or is cancelled; an exception from the body propagates as it is.
        Nesting is harmless: a step already open in this context (or shared by
        the application) opens nothing more.

        Raises:
            Exception: whatever a step's ``open_for_run`` raises on entering
                (those entered before it are closed first).
        """
        async with AsyncExitStack() as stack:
            for step in self.capabilities.openers:
                await stack.enter_async_context(step.open_for_run(runtime))
            yield

    # -- driving cycles by hand -------------------------------------------------------

    def collect(
        self, session: Session[D]
    ) -> tuple[tuple[ToolDefinition, ...], tuple[PromptPart, ...]]:
        """Tool definitions and prompt parts from the steps that contribute them, in step order.

        Raises:
            ConfigurationError: two steps (or one step twice) advertise a tool name.
        """
        return self.capabilities.collect(session)

    async def step(
        self,
        runtime: Runtime,
        session: Session[D],
        emitter: Emitter | None = None,
        *,
        cycle: int = 0,
        run_start_revision: int | None = None,
    ) -> Decision[D] | None:
        """Offer ``session`` to the steps in order; return the first that applies.

        Nothing is persisted: pass the decision to :meth:`apply`. Returns ``None``
        when every step refuses. ``run_start_revision`` is the revision at which
        the caller's "run" began (default: ``session.revision``); callers that
        drive cycles themselves pass the revision they started at on every
        call, or per-run budgets start afresh each cycle.

        Raises:
            ConfigurationError: duplicate tool names (before any step runs).
            StepContractError: a step returned something other than an outcome.
            Exception: whatever a step raises.

        Cancellation: the running step is interrupted. Before the cancellation
        propagates, what it already has is kept: its ``finalize(interrupted=True)``
        effects (tool results that exist, partial text) are committed, shielded,
        for at most ``finalize_timeout`` seconds. The caller then calls
        :meth:`finalize` to answer the calls still open. The machine's
        :class:`CancelToken` firing (before or while a step runs) does the same,
        then returns ``None``: check ``machine.cancel.cancelled`` and call
        :meth:`finalize`.
        """
        sink = EventSink(emitter or NullEmitter(), session.id, session.revision)
        start = session.revision if run_start_revision is None else run_start_revision

        async def keep(interrupted: Interrupted[D]) -> None:
            async def work() -> None:
                current: Session[D] = await runtime.session_loader().load(session.id)
                await keep_interrupted(runtime, current, interrupted, cycle, self.max_conflicts)

            await shielded(self.finalize_timeout, session.id, work)

        decided = await decide(
            self.capabilities, runtime, session, sink, cycle, start, self.cancel, keep
        )
        if isinstance(decided, Interrupted):  # the machine's token fired
            await keep(decided)
        return decided if isinstance(decided, Decision) else None

    async def apply(
        self, runtime: Runtime, session: Session[D], decision: Decision[D], *, cycle: int = 0
    ) -> tuple[Session[D], StepResult]:
        """Write what a decision says, from ``session``: the machine's one write path.

        ``Continue`` / ``Yield``: their effects as one batch, a compare-and-set
        on ``session.revision``. ``Staged``: its intents, then each task's
        record as the task finishes, then its ending (see
        :class:`~stepmachine.Staged`); if this is cancelled, pass the decision
        to :meth:`finalize` (``interrupted=decision``): it writes the records
        the machine held for it.

        Like :meth:`run`, it holds the session's lease while it writes (when
        the machine has a lease policy and the store leases; claimed with
        ``busy="fail"``, released when it returns): a session another runner
        holds is not written by hand. Staged work starts only from the stored
        session: ``session`` must be its current revision (one load), so a
        decision another writer overtook calls no model and runs no tool.

        Returns:
            The new session and the cycle's :class:`StepResult` (its
            ``effects``: every effect written in the cycle). A ``Yield``
            with no effects writes nothing and returns ``session`` unchanged.

        Raises:
            ConflictError: the first batch lost the race, or (staged work) the
                stored session has moved on from ``session``, or ``session`` is
                further on than the one the decision was made on; nothing was
                written. :meth:`step` again from the stored session.
            ConfigurationError: ``session`` is another session than the one
                the decision was made on.
            SessionBusyError: another runner holds the session's lease.
            StepContractError: ``Continue`` with no effects.
            LeaseLostError: the lease was lost while it wrote (staged work).
            EffectError: an effect does not apply; nothing of that batch was written.

        Cancellation (or ``KeyboardInterrupt``): the records of staged work
        that exist and were not yet written are written, shielded, for at most
        ``finalize_timeout`` seconds, before it propagates; then call
        :meth:`finalize` to answer the calls still open. The machine's
        :class:`CancelToken` firing during staged work does the same, then
        returns the session as stored and a result with status ``"cancelled"``
        (reason ``cancelled``); call :meth:`finalize` then too.
        """
        decided_from = decision.ctx.session
        if session.id != decided_from.id:
            raise ConfigurationError(
                f"apply() got session {session.id!r} for a decision made on session "
                f"{decided_from.id!r}; apply a decision to the session step() decided it on"
            )
        if session.revision > decided_from.revision:  # overtaken: decided on an older one
            raise ConflictError(session.id, decided_from.revision, session.revision)
        async with self._holding(runtime, session.id) as held:
            if isinstance(decision.outcome, Staged):
                await _check_current(held, decided_from)  # before any task starts
            try:
                keep_for = self.finalize_timeout
                applied = await apply(held, session, decision, cycle, self.cancel, keep_for)
            except BaseException as exc:
                if stops_the_run(exc):
                    await self._keep_held(held, session.id, decision, cycle)
                raise
            if applied is not None:
                return applied
            await self._keep_held(held, session.id, decision, cycle)  # the token fired
            current: Session[D] = await held.session_loader().load(session.id)
        why = self.cancel.reason if self.cancel is not None else ""
        reason = YieldReason(YieldReason.CANCELLED, why)
        return current, StepResult(decision.step.name, (), "cancelled", current.revision, reason)

    @asynccontextmanager
    async def _holding(self, runtime: Runtime, session_id: str) -> AsyncIterator[Runtime]:
        """``runtime`` writing under the session's lease while the body runs (a hand-driven
        :meth:`apply` or :meth:`finalize`), claimed with the machine's policy but
        ``busy="fail"``, renewed, and released after; ``runtime`` as it is when the machine
        has no lease policy or the store no leases (as :meth:`run` decides). A turn another
        ``run(busy="queue")`` requested meanwhile is not run here (a hand-driven call runs
        one cycle): its mark stays set, for the next runner (a worker, the next ``run()``).

        Raises:
            SessionBusyError: another runner holds the session.
        """
        policy = self.lease
        leases = None if policy is None else leasing_store(runtime)
        if policy is None or leases is None:
            yield runtime
            return
        lease = await claim(
            leases, session_id, new_owner(), dataclasses.replace(policy, busy="fail")
        )
        assert lease is not None  # busy="fail" raises instead of queueing
        async with Turns(leases, lease).held(runtime) as fenced:
            yield fenced

    async def _keep_held(
        self, runtime: Runtime, session_id: str, decision: Decision[D], cycle: int
    ) -> None:
        """Write the records the machine held for ``decision``'s staged work (shielded, at
        most ``finalize_timeout`` seconds); a later :meth:`finalize` does not write them again."""
        if not decision.held:
            return
        held = Interrupted(decision.step, decision.ctx, tuple(decision.held))
        decision.held.clear()

        async def work() -> None:
            current: Session[D] = await runtime.session_loader().load(session_id)
            await keep_records(runtime, current, held, cycle, self.max_conflicts)

        await shielded(self.finalize_timeout, session_id, work)

    async def finalize(
        self,
        runtime: Runtime,
        session_id: str,
        emitter: Emitter | None = None,
        *,
        interrupted: Decision[D] | None = None,
    ) -> Session[D]:
        """Make a cancelled session whole again; callers driving ``step``/``apply`` call it.

        Runs shielded. ``interrupted`` is the decision whose :meth:`apply` was
        cancelled, if any: its step's ``finalize(interrupted=True)``, with the
        decision's ctx, keeps what it had received. (A cancelled :meth:`step`
        has kept that already; pass nothing then.) Then every other step's
        ``finalize(interrupted=False)``; then every tool call still without a
        result is answered with an ``interrupted`` error result (step name
        ``stepmachine.finalize``). Each of these is its own batch, retried on
        conflict. It holds the session's lease while it writes, as :meth:`apply`
        does: it never answers "interrupted" a call another runner is still
        running.

        Returns:
            The session afterwards.

        Raises:
            SessionBusyError: another runner holds the session's lease.
        """
        sink = EventSink(emitter or NullEmitter(), session_id, 0)
        step = (
            None
            if interrupted is None
            else Interrupted(interrupted.step, interrupted.ctx, tuple(interrupted.held))
        )
        with anyio.CancelScope(shield=True):
            async with self._holding(runtime, session_id) as held:
                return await finalize(
                    self.capabilities,
                    held,
                    session_id,
                    sink,
                    step,
                    cycle=0,
                    run_start_revision=0,
                    max_conflicts=self.max_conflicts,
                )
        raise AssertionError("unreachable: a shielded scope is never cancelled")  # pragma: no cover


def _check_step(position: int, item: object) -> None:
    """Raise :class:`ConfigurationError` when ``item`` (at ``position``) is no step.

    A step is an instance with a ``name`` and a ``run`` method; the usual
    mistakes (a step class, a tool, a plain function) get their own fix.
    """
    if isinstance(item, type):
        raise ConfigurationError(
            f"StateMachine: step {position} is the class {item.__name__}, not a step; pass "
            f"an instance: {item.__name__}() (with its arguments, if it takes any)"
        )
    if isinstance(item, Tool):
        raise ConfigurationError(
            f"StateMachine: step {position} is the tool {item.name!r}, not a step; put tools "
            f"in a Tools step: StateMachine([Tools([{item.name}, ...]), ModelInference()])"
        )
    run = getattr(item, "run", None)
    if callable(run) and isinstance(getattr(item, "name", None), str):
        return
    if callable(item) and not callable(run):
        raise ConfigurationError(
            f"StateMachine: step {position} is {shown(item)}, a function, not a step; "
            "to offer it to the model make it a tool (@tool) and put it in "
            "Tools([...]); to make a step, subclass Operation and implement "
            "`async def run(self, ctx)`"
        )
    raise ConfigurationError(
        f"StateMachine: step {position} is {shown(item)} (of type {type(item).__name__}), not a "
        "step; a step has a `name` (a str) and an `async def run(self, ctx)`: subclass "
        "Operation (or Inference) and implement run"
    )


_BLANK: Session[Any] = Session(id="", revision=0, conversation=Conversation(), data=NoData())
"""What the fixed tools of a ``Tools`` step are read from (they do not depend on it)."""


def _check_fixed_tool_names(steps: Sequence[object]) -> None:
    """Raise :class:`ConfigurationError` when two steps with fixed tools share a tool name.

    A step's tools are fixed when it is a ``Tools`` that does not override
    ``tools`` (``McpTools`` does: its servers' lists are only known once open,
    and may change; every tool name is checked again each cycle).
    """
    owner: dict[str, str] = {}
    for step in steps:
        if not isinstance(step, Tools) or type(step).tools is not Tools.tools:
            continue
        for definition in step.tools(_BLANK):
            holder = owner.setdefault(definition.name, step.name)
            if holder != step.name:
                raise ConfigurationError(tool_name_clash(definition.name, holder, step.name))


async def _check_current(runtime: Runtime, session: Session[Any]) -> None:
    """Raise :class:`ConflictError` unless ``session`` is the stored session's revision.

    A hand-driven :meth:`StateMachine.apply` of staged work checks this before any
    task starts: a decision made from a session another writer has moved on since
    would otherwise call the model, or run a tool, for a question that is no longer
    the last (``run()`` decides from the session it has just loaded or written).
    """
    stored: Session[Any] = await runtime.session_loader().load(session.id)
    if stored.revision != session.revision:
        raise ConflictError(session.id, session.revision, stored.revision)
