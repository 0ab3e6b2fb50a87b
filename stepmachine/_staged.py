"""Staged work: an outcome the machine executes in stages, writing as it goes.

Most steps decide and return their effects (``Continue`` / ``Yield``): one
batch. A step whose work has a side effect outside the session -- running a
tool, calling a model, charging a card -- needs more: a durable record that it
is about to act (so a crash is never read as "nothing happened"), then the
work, then a record of each result the moment it exists (so a finished piece
is never done again). Such a step returns :class:`Staged`, and **the machine**
does the rest, in this order:

1. it writes ``intents`` as one batch (none when empty);
2. it runs the ``tasks`` (one after another, or up to ``max_concurrency`` at a
   time); before a task marked ``guarded`` starts, it confirms with the store
   that the run still holds the session (its lease), and raises
   :class:`~stepmachine.LeaseLostError` instead of starting it otherwise;
3. as each task returns, it writes that task's :data:`Record` as its own
   batch: the record is called with the session as stored then, so after a
   conflict (another writer moved the session on) it is computed again from
   what is stored, and a result someone else already recorded is not written
   twice;
4. when every task is recorded, ``then()`` (if given) says how the cycle ends:
   ``Continue`` or ``Yield`` with effects of their own (one more batch); it may
   raise instead (the error propagates; everything recorded stays).

The step itself writes nothing: it returns what to do, and can be tested by
calling its ``run`` (see :func:`~stepmachine.testing.run_step`, which executes
a ``Staged`` the same way, against a session value).

Cancellation. The machine holds every task result from the moment the task
returns: a result whose batch was not yet written when the run was cancelled
is written by finalize, exactly once (its record sees the stored session). A
task cancelled while running records its ``keep`` (what it already has:
streamed text), if it has one; anything else the step wants kept goes
through its ``finalize``. Calls left open are answered "interrupted" as
after any cancellation.

A result the store refuses (:class:`~stepmachine.EffectError`, e.g.
:class:`~stepmachine.MediaTooLargeError`: an image over the store's limit) is
offered to the task's ``refused``: a replacement record (an error result
naming the limit), or ``None`` to let the error propagate.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from ._effects import Effect
from ._errors import ConfigurationError
from ._outcomes import Continue, Yield
from ._session import Session

__all__ = ["Record", "Staged", "Task"]

Record: TypeAlias = Callable[[Session[Any]], Sequence[Effect]]
"""How a finished task is recorded: the effects, computed from the session as stored.

Called when the machine writes the task's batch, again after a conflict, and
by finalize after a cancellation; return no effects when there is nothing
left to record (another writer recorded it).
"""


@dataclass(frozen=True, slots=True)
class Task:
    """One piece of staged work.

    Attributes:
        name: what the task is, for logs and errors (a tool call's id).
        run: the work; returns how to record its result. An exception from
            it propagates (the step decides what is an error result: catch
            it and return a record of it).
        guarded: a start that must not happen twice (a ``non_idempotent``
            tool, a payment): the machine confirms with the store that the run
            still holds the session right before it starts the task.
        keep: what to record if the task is cancelled while it runs (what it
            already has); ``None``: nothing.
        refused: a replacement record when the store refuses the record's
            effects (:class:`~stepmachine.EffectError`), or ``None``.
    """

    name: str
    run: Callable[[], Awaitable[Record]]
    guarded: bool = False
    keep: Record | None = None
    refused: Callable[[Exception], Record | None] | None = None


@dataclass(frozen=True, slots=True)
class Staged:
    """Write ``intents``, run ``tasks`` and record each as it lands; then ``then()``.

    See the module docs for the order and for cancellation.

    Attributes:
        intents: effects written as one batch before any task starts.
        tasks: the work, in order.
        max_concurrency: tasks run at once (1: one after another, in order).
        then: how the cycle ends once every task is recorded (default
            ``Continue(())``); may raise.

    Raises:
        ConfigurationError: ``max_concurrency`` is not an int >= 1, or there is
            neither an intent nor a task (the session would not change).
    """

    intents: tuple[Effect, ...]
    tasks: tuple[Task, ...]
    max_concurrency: int
    then: Callable[[], Continue | Yield] | None

    def __init__(
        self,
        intents: Sequence[Effect] = (),
        tasks: Sequence[Task] = (),
        *,
        max_concurrency: int = 1,
        then: Callable[[], Continue | Yield] | None = None,
    ) -> None:
        if (
            isinstance(max_concurrency, bool)
            or not isinstance(max_concurrency, int)
            or max_concurrency < 1
        ):
            raise ConfigurationError(
                f"Staged: max_concurrency must be an int >= 1, got {max_concurrency!r}"
            )
        if not intents and not tasks:
            raise ConfigurationError(
                "Staged with no intents and no tasks changes nothing; return Refuse(why) "
                "when the step has nothing to do"
            )
        object.__setattr__(self, "intents", tuple(intents))
        object.__setattr__(self, "tasks", tuple(tasks))
        object.__setattr__(self, "max_concurrency", max_concurrency)
        object.__setattr__(self, "then", then)

    @property
    def effects(self) -> tuple[Effect, ...]:
        """The intents (what the outcome writes before any work; ``Continue.effects``'s peer)."""
        return self.intents
