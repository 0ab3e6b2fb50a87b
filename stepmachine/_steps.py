"""The base classes for steps, and the token that cancels a run.

A step is a ``name`` and ``run`` (:class:`~stepmachine.Step`); tools, prompt
parts, request shaping, call vetting and finalize are optional capabilities,
each a small protocol (``_capabilities``). :class:`Operation` and
:class:`Inference` are base classes with every hook as a no-op default and the
class name as ``name``: subclass one and override what the step does. What a
step returns (:data:`Outcome`) is in ``_outcomes``; both are re-exported here.

A step must not keep decision state on itself between cycles (state is the
session). A step never writes: it returns its effects (``Continue``,
``Yield``), or, when it must record something before it acts, staged work
(:class:`~stepmachine.Staged`) that the machine carries out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

import anyio
import msgspec

from ._capabilities import (
    ContributesPromptParts,
    ContributesTools,
    Finalizes,
    ShapesRequests,
    Step,
    StepContext,
    VetsCalls,
    no_op_default,
)
from ._effects import Effect
from ._messages import ToolCallPart
from ._model import ModelRequest, PromptPart, ToolDefinition
from ._outcomes import Continue, Outcome, Refuse, StepResult, Yield, YieldReason
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


class Operation(
    Step[D],
    ContributesTools[D],
    ContributesPromptParts[D],
    ShapesRequests[D],
    VetsCalls[D],
    Finalizes[D],
    Protocol[D],
):
    """A base class for policy steps (run tools, ask for approval, compact, budget, ...).

    Subclass it and implement :meth:`run`; override the hooks the step needs.
    The defaults below do nothing and are no capability: the machine does not
    call a hook a step left at its default.
    """

    @property
    def name(self) -> str:
        """The step's name in results, logs and the audit log. Default: class name."""
        return type(self).__name__

    @no_op_default
    def tools(self, session: Session[D]) -> Sequence[ToolDefinition]:
        """Tool definitions this step contributes to model requests; default: none."""
        return ()

    @no_op_default
    def prompt_parts(self, session: Session[D]) -> Sequence[PromptPart]:
        """System prompt parts this step contributes to model requests; default: none."""
        return ()

    async def run(self, ctx: StepContext[D]) -> Outcome:
        """Look at ``ctx.session`` and decide: refuse, continue or yield.

        Cancellation: the machine may cancel this call at any await; then
        :meth:`finalize` is called with ``interrupted=True`` and the same ctx.
        """
        ...

    @no_op_default
    def shape_request(self, ctx: StepContext[D], request: ModelRequest) -> ModelRequest:
        """Adjust a model request before it is sent; default: unchanged.

        See :class:`~stepmachine.ShapesRequests`.
        """
        return request

    @no_op_default
    def check_call(self, ctx: StepContext[D], call: ToolCallPart) -> str | None:
        """Object to running ``call`` now: return the reason; default: ``None``.

        See :class:`~stepmachine.VetsCalls`.
        """
        return None

    @no_op_default
    async def finalize(self, ctx: StepContext[D], *, interrupted: bool) -> Sequence[Effect]:
        """Effects that keep what was already done, after a cancellation; default: none.

        See :class:`~stepmachine.Finalizes`.
        """
        return ()


class Inference(Operation[D], Protocol[D]):
    """A base class for the step that calls a model.

    It applies when the conversation ends on something the model must answer
    (a user message, or tool results that close every open call), streams
    deltas to the emitter, and returns the assistant message as effects.
    """
