"""The two storage protocols, and the full store interface the shipped stores keep.

A :class:`SessionLoader` loads sessions; an :class:`EffectHandler` persists
batches of effects. The machine needs only these two, so an application can
implement them against any storage. :class:`Store` adds the management API
the shipped stores (memory, file, SQLite) and the store conformance suite use:
create, list, delete, time travel and the audit log.

Contract of :meth:`EffectHandler.apply` (nothing is lost; no lost updates): it is a
compare-and-set on the revision. The batch says which revision it produces;
the store accepts it only when the session is exactly one revision behind,
and then persists all of its effects or none. Once ``apply`` returns, the
batch survives a crash of the process (for the durable stores).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import msgspec

from . import _tracing
from ._codec import Batch, Codec, Refusal
from ._effects import Effect, apply_batch
from ._emitter import EventSink, StepApplied
from ._errors import ConfigurationError
from ._messages import Message
from ._retry import retry_conflicts
from ._session import Session

if TYPE_CHECKING:
    from ._runtime import Runtime

__all__ = [
    "EffectHandler",
    "SessionLoader",
    "StepCommitter",
    "Store",
    "commit",
    "submit",
]

D = TypeVar("D", bound=msgspec.Struct)


class SessionLoader(Protocol):
    """Loads sessions."""

    async def load(self, session_id: str) -> Session[Any]:
        """The current session.

        Raises:
            SessionNotFoundError: no session has this id.
            StoredDataError: the stored records do not decode.
        """
        ...


class EffectHandler(Protocol):
    """Persists batches of effects, atomically, with compare-and-set.

    A handler may declare ``applies_batches = True`` (a class attribute; the
    shipped stores do). It promises that :meth:`apply` applies the batch to the
    stored session itself, raises :class:`~stepmachine.EffectError` before
    writing anything when an effect does not apply, and returns the session
    after the batch. Callers (the machine, :func:`submit`) then do not apply
    the batch a second time: one apply per batch. For any other handler the
    caller applies the batch first (so a batch that does not apply is never
    handed over) and uses its own result when ``apply`` returns ``None``.
    """

    async def apply(self, batch: Batch[Effect]) -> Session[Any] | None:
        """Persist ``batch`` if the session is at ``batch.revision - 1``.

        Returns:
            The session after the batch exactly as a later load will give it
            (decoded from what was stored), or ``None`` if the handler does not
            compute it; the machine then applies the effects itself. Returning
            the stored view keeps a long-lived machine and a fresh one reading
            the store on the same values even where encoding normalises data
            (tuples come back as lists from JSON).

        Raises:
            ConflictError: the session is at another revision; nothing is written.
            SessionNotFoundError: no session has this id.
            EffectError: an effect does not apply; nothing is written.

        Cancellation: either the whole batch is persisted or none of it.
        """
        ...


class Store(SessionLoader, EffectHandler, Protocol):
    """The management API of the shipped stores (and of the conformance suite)."""

    @property
    def codec(self) -> Codec[Any]:
        """The codec the store encodes with."""
        ...

    async def create(
        self,
        session_id: str,
        data: msgspec.Struct | None = None,
        conversation: Sequence[Message] = (),
    ) -> Session[Any]:
        """Create a revision-0 session.

        Raises:
            SessionExistsError: the id is taken.
        """
        ...

    async def list_sessions(self) -> list[str]:
        """The ids of all sessions, sorted."""
        ...

    async def delete(self, session_id: str) -> None:
        """Delete a session and its log.

        Raises:
            SessionNotFoundError: no session has this id.
        """
        ...

    async def load_at(self, session_id: str, revision: int) -> Session[Any]:
        """The session as it was at ``revision`` (time travel).

        Raises:
            SessionNotFoundError: no session has this id.
            ValueError: ``revision`` is negative or beyond the current one.
        """
        ...

    async def batches(self, session_id: str, after: int = 0) -> list[Batch[Effect]]:
        """The audit log: every applied batch with ``revision > after``, in order."""
        ...

    async def aclose(self) -> None:
        """Release resources. The store must not be used afterwards."""
        ...


async def submit(
    store: Store,
    session_id: str,
    effects: Sequence[Effect] | Callable[[Session[Any]], Sequence[Effect]],
    *,
    step: str = "application",
    clock: Callable[[], float] = time.time,
    max_attempts: int = 16,
) -> Session[Any]:
    """Apply ``effects`` from outside a machine (a user message, an event).

    Loads the session, applies the effects to it and persists them as one
    batch; on a conflict, reloads and tries again, up to ``max_attempts``.
    Pass a function of the session instead of a list to compute (and
    validate) the effects again from each freshly loaded session, so a
    decision is re-checked rather than written over a change it did not see.

    The batch is written as a machine's are (see :func:`commit`): stamped with
    ``clock()``, and, when called inside a traced run (a tool submitting to
    another session, say), with the current span's ``traceparent``.

    Returns:
        The session after the batch.

    Raises:
        ConflictError: still conflicting after ``max_attempts``.
        EffectError: the effects do not apply to the session.
    """
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")

    # An iterable that is not a sequence (a generator) is read once, here: read again by
    # the attempt after a conflict, it would give an empty batch (the effects lost).
    compute = effects if callable(effects) else partial(_fixed, tuple(effects))

    async def attempt(session: Session[Any]) -> Session[Any]:
        return await commit(store, clock, step, 0, (), None, session, compute(session))

    first = await store.load(session_id)
    return await retry_conflicts(first, attempt, store.load, attempts=max_attempts)


def _fixed(effects: tuple[Effect, ...], session: Session[Any]) -> Sequence[Effect]:
    return effects


async def commit(
    handler: EffectHandler,
    clock: Callable[[], float],
    step_name: str,
    cycle: int,
    refused: tuple[Refusal, ...],
    sink: EventSink | None,
    session: Session[D],
    effects: Sequence[Effect],
    status: Literal["committed", "continue", "yielded"] = "committed",
) -> Session[D]:
    """Persist ``effects`` as the batch after ``session`` through ``handler``; the session
    after it.

    Every batch is written here: each of a machine's (a cycle's ``Continue`` /
    ``Yield``, each batch of staged work, whose ``write`` is this function with
    the first six arguments bound, finalize's, the deprecated ``ctx.commit``'s;
    ``handler`` is the runtime's: a lease's fence in a leased run) and
    :func:`submit`'s. The batch is stamped with ``clock()``, and with the
    current span's ``traceparent`` inside a traced run; ``refused`` goes into
    it (the audit log's decision trace). With a ``sink``, the batch is
    announced (``StepApplied`` with ``status``) and the sink's events follow
    the new revision.

    Applies the batch exactly once: in the handler when it declares
    ``applies_batches`` (see :class:`EffectHandler`), else here, before the
    handler sees it (so a batch that does not apply is never handed over).
    The flag is read from the handler's class, so a wrapper forwarding
    attributes to a store does not inherit it by accident.

    Raises:
        ConflictError: the stored session moved on; nothing was written.
        EffectError: an effect does not apply; nothing was written.
        ConfigurationError: the handler returned a session that is not the one
            after the batch (another revision or id), or something that is not a
            session; the batch may be stored.
    """
    effects = tuple(effects)
    batch: Batch[Effect] = Batch(
        session_id=session.id,
        revision=session.revision + 1,
        step=step_name,
        cycle=cycle,
        timestamp=clock(),
        effects=effects,
        refused=refused,
        trace=_tracing.traceparent(),
    )
    if getattr(type(handler), "applies_batches", False) is True:  # declared by the class
        stored = await handler.apply(batch)
        after = apply_batch(session, effects) if stored is None else stored
    else:
        after = apply_batch(session, effects)
        stored = await handler.apply(batch)
        after = after if stored is None else stored
    if not isinstance(after, Session):
        raise ConfigurationError(
            f"the effect handler {type(handler).__name__} returned {type(after).__name__} "
            f"{after!r:.100} for the batch producing revision {batch.revision} of session "
            f"{batch.session_id!r}; apply returns the session after the batch, or None"
        )
    if after.revision != batch.revision or after.id != batch.session_id:
        raise ConfigurationError(
            f"the effect handler {type(handler).__name__} returned session {after.id!r} at "
            f"revision {after.revision} for the batch producing revision {batch.revision} of "
            f"session {batch.session_id!r}; apply returns the session after the batch, or None"
        )
    if sink is not None:
        await sink.emit(StepApplied(step_name, after.revision, status, len(effects)))
        sink.follow(after.revision)
    return after


class StepCommitter:
    """What the deprecated ``StepContext.commit`` calls: one batch now, under the step's name.

    ``refused`` is the list of the steps that refused before this one in the
    cycle (the cycle goes on appending to it); the batch records its first
    ``count``. Made for each step a cycle offers the session to: cheap, it
    builds nothing until it is called.
    """

    __slots__ = ("count", "cycle", "refused", "runtime", "sink", "step_name")

    def __init__(
        self,
        runtime: Runtime,
        step_name: str,
        cycle: int,
        sink: EventSink,
        refused: list[Refusal],
        count: int,
    ) -> None:
        self.runtime, self.step_name, self.cycle, self.sink = runtime, step_name, cycle, sink
        self.refused, self.count = refused, count

    async def __call__(self, current: Session[D], effects: Sequence[Effect]) -> Session[D]:
        """Write ``effects`` after ``current`` (see :func:`commit`), then emit ``StepApplied``."""
        refused = tuple(self.refused[: self.count])
        runtime, name, cycle = self.runtime, self.step_name, self.cycle
        handler, clock = runtime.effect_handler(), runtime.clock
        after = await commit(handler, clock, name, cycle, refused, None, current, effects)
        await self.sink.emit(StepApplied(self.step_name, after.revision, "committed", len(effects)))
        return after
