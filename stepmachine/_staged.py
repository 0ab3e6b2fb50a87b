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
3. as each task returns, it writes that task's :data:`Recorder` as its own
   batch: the record is called with the session as stored then, so after a
   conflict (another writer moved the session on) it is computed again from
   what is stored, and a result someone else already recorded is not written
   twice; it is retried for as long as other writers keep moving the session
   on (a result that exists is never dropped for losing the race);
4. once every task has returned, ``then()`` (if given) says how the cycle
   ends: ``Continue`` or ``Yield`` with effects of their own (one more batch);
   it may raise instead (the error propagates once the last record is
   written; everything recorded stays). It is asked right after the last
   record is computed and before it is written (again when that record is
   computed again after a conflict; the last answer counts), so that batch
   can say how the cycle ended, and a record can tell ``then()`` what it
   found in the stored session.

Each batch written is announced (``StepApplied``) with a status: the
cycle's own (``continue`` / ``yielded``) on its last batch, ``committed`` on
every batch after which more of the cycle may follow.

The step itself writes nothing: it returns what to do, and can be tested by
calling its ``run`` (see :func:`~stepmachine.testing.run_step`, which executes
a ``Staged`` the same way, against a session value).

Cancellation. The machine holds every task result from the moment the task
returns: a result whose batch was not yet written when the run was cancelled
is written by finalize, exactly once (its record sees the stored session). A
task cancelled before it returns (while it runs, or before it started)
records its ``keep`` (what it already has: streamed
text; or what gives back a reservation), if it has one; anything else the step wants kept goes
through its ``finalize``. Calls left open are answered "interrupted" as
after any cancellation. A held record the store refuses there is offered to
its task's ``refused`` as below; without a replacement (or when the store
refuses that too) it is logged and left out, and finalize goes on (its call
is answered "interrupted").

A result the store refuses (:class:`~stepmachine.EffectError`: an effect
that does not apply, or :class:`~stepmachine.MediaTooLargeError`: an image
over the store's limit; nothing of that batch was written) is offered to the
task's ``refused``: a replacement record (an error result naming the limit),
or ``None`` to let the error propagate. It is offered once per task: when the
store refuses the replacement too, that error propagates.

An error. When a task raises (its ``run``, its ``landed``, or its record when
computed), or the store refuses a record for good (above), the error
propagates -- after the machine writes what it holds, as after a
cancellation: the records of tasks that returned and the ``keep`` of every
task that did not (cancelled because a sibling failed, not started, or the
one that raised), each its own batch from the session as stored then
(:func:`write_held`). The record that raised or was refused is not written
again. Not after the store's own faults (its writes were waited out already:
a store that keeps failing is not tried again), a lost lease or a conflict
the machine could not get past (nothing more may be written), nor when the
intents were not written (nothing of the cycle was); the next run reads what
is stored. A write that fails there is named in a note on the error, which
still propagates.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, TypeAlias

import anyio

from . import _log
from ._async import interrupt_once
from ._effects import Effect
from ._errors import (
    ConflictError,
    EffectError,
    LeaseLostError,
    MediaTooLargeError,
    StepContractError,
)
from ._outcomes import Continue, Recorder, Staged, Task, Yield
from ._retry import retry_while_moving
from ._session import Session

__all__ = [
    "RecordConflictError",
    "Recorder",
    "Refusable",
    "Staged",
    "Status",
    "Task",
    "Writer",
    "execute",
    "one_error",
    "write_held",
]

Status: TypeAlias = Literal["committed", "continue", "yielded"]
"""What a batch of staged work says of the cycle: more may follow, or how it ended."""

Writer: TypeAlias = Callable[[Session[Any], Sequence[Effect], Status], Awaitable[Session[Any]]]
"""The machine's write of one batch of the deciding step (compare-and-set on the session),
with the status its announcement carries."""


async def execute(
    staged: Staged,
    session: Session[Any],
    write: Writer,
    reload: Callable[[str], Awaitable[Session[Any]]],
    confirm: Callable[[Task], Awaitable[None]],
    held: list[Recorder],
    keep_for: float = 10.0,
) -> tuple[Session[Any], tuple[Effect, ...], Continue | Yield]:
    """Carry ``staged`` out from ``session`` (see the module docs); the session after it,
    every effect written, and how the cycle ends (its effects not yet written).

    ``confirm(task)`` raises unless the task may start (the lease, see the
    machine); ``held`` is the machine's: every record that exists and is not
    yet written (a landed result, a running task's ``keep``), for finalize to
    write after a cancellation. ``keep_for``: the seconds the writes of what
    it holds may take after a task's error, shielded from cancellation (the
    machine's ``finalize_timeout``), so that the error, not a cancellation
    arriving meanwhile, is what propagates.

    Raises:
        ConflictError: the intents lost the race (nothing of the cycle was
            written: the machine decides again), or the store kept refusing a
            record's write without the session moving on (a broken store).
        LeaseLostError: the run's lease is gone; no task started after that.
        Exception: whatever a task, ``then`` or the store raises; one error,
            never an ``ExceptionGroup`` (see :func:`one_error`).
    """
    run = _Execution(staged, session, write, reload, confirm, held, keep_for)
    # Every task's keep is held from the start: a cancellation before a task starts
    # (while the intents are written, or while it waits its turn) writes what it says
    # too (a reservation given back; a keep sees the stored session, so it can tell).
    held.extend(task.keep for task in staged.tasks if task.keep is not None)
    if staged.intents:
        run.current = await write(run.current, staged.intents, "committed")
        run.written.extend(staged.intents)
    try:
        await run.tasks()
    except Exception as exc:
        if run.refused_work:  # not a store fault, a lost lease or a conflict: see the docs
            await run.keep_held(exc)
        raise
    if not run.ending and not run.ended:
        run.end()  # no task (or none left a record to write)
    if run.ended:
        raise run.ended[0]
    return run.current, tuple(run.written), run.ending[0]


@dataclass(slots=True)
class _Execution:
    """The state of one :func:`execute`: the session as last written (``current``), what
    was written, the tasks still to record, and ``then()``'s answer (an object rather
    than closures: a run waiting in a task holds one object, not a cell per variable)."""

    staged: Staged
    current: Session[Any]
    write: Writer
    reload: Callable[[str], Awaitable[Session[Any]]]
    confirm: Callable[[Task], Awaitable[None]]
    held: list[Recorder]
    keep_for: float  # seconds the held writes may take after an error (shielded)
    written: list[Effect] = field(default_factory=list)
    ending: list[Continue | Yield] = field(default_factory=list)  # then()'s answer, once asked
    ended: list[BaseException] = field(default_factory=list)  # or what it raised
    unrecorded: int = 0  # tasks whose record is not written yet
    lock: anyio.Lock | None = None  # tasks run concurrently: one record written at a time
    refused_work: bool = False  # a task raised, or a record raised or was refused
    stopping: bool = False  # a task's run ended in an error: no waiting task starts

    def __post_init__(self) -> None:
        tasks = self.staged.tasks
        self.unrecorded = len(tasks)
        if self.staged.max_concurrency > 1 and len(tasks) > 1:
            self.lock = anyio.Lock()

    async def tasks(self) -> None:
        """Run every task, one after another or ``max_concurrency`` at a time, each
        recorded as it lands; one error, never a group (see :func:`one_error`)."""
        staged = self.staged
        if self.lock is None:
            for task in staged.tasks:
                await self.one(task)
            return
        limiter = anyio.CapacityLimiter(staged.max_concurrency)

        async def limited(task: Task) -> None:
            async with limiter:
                if self.stopping:  # a sibling failed while this one waited its turn
                    return  # never started: its keep is held, written as the others are
                try:
                    await self.one(task)
                except BaseException:
                    self.stopping = True  # set before the slot is given to a waiting task
                    raise

        failure: BaseException | None = None
        try:
            async with anyio.create_task_group() as group:
                for task in staged.tasks:
                    group.start_soon(limited, task)
        except BaseExceptionGroup as errors:
            failure = one_error(errors)  # raised outside the handler: its context its own
        if failure is not None:
            raise interrupt_once(failure)

    async def keep_held(self, error: Exception) -> None:
        """A task's error is on its way out: write what the machine holds first (see the
        module docs); a write that fails is named in a note on ``error``."""

        async def write(current: Session[Any], effects: Sequence[Effect]) -> Session[Any]:
            return await self.write(current, effects, "committed")

        with anyio.move_on_after(self.keep_for, shield=True) as bounded:
            try:
                self.current = await write_held(self.held, self.current, write, self.reload)
            except Exception as exc:  # noqa: BLE001 - the task's error is the one raised
                error.add_note(
                    f"the records held for the other tasks could not all be written: "
                    f"{type(exc).__name__}: {exc}"
                )
        if bounded.cancelled_caught:
            error.add_note(
                f"the records held for the other tasks were not all written within "
                f"{self.keep_for} s (finalize_timeout)"
            )

    def end(self) -> Status:
        """Ask ``then()``; the status of the cycle's last batch if it is this one."""
        self.ending.clear()
        self.ended.clear()
        then = self.staged.then
        try:
            self.ending.append(Continue(()) if then is None else _checked(then()))
        except Exception as exc:  # noqa: BLE001 - any error of then(): raised after the record
            self.ended.append(exc)  # raised once the record is written
            return "committed"
        done = self.ending[0]
        if done.effects:
            return "committed"  # the ending is a batch of its own
        return "yielded" if isinstance(done, Yield) else "continue"

    async def one(self, task: Task) -> None:
        """Run ``task`` (once the lease is confirmed), hold its record, then write it."""
        await self.confirm(task)
        try:
            entry = await task.run()
        except Exception:
            self.refused_work = True
            raise
        if task.refused is not None:  # held with it: finalize offers it a refusal too
            entry = Refusable(entry, task.refused)
        # The result exists: held before any checkpoint, so a cancellation from
        # here on leaves it to finalize, which writes it exactly once.
        if task.keep is not None:
            _swap(self.held, task.keep, entry)
        else:
            self.held.append(entry)
        if task.landed is not None:
            try:
                await task.landed()
            except Exception:
                self.refused_work = True
                raise
        record = _Record(self, entry, task)
        try:
            if self.lock is None:  # one task at a time: no lock, one call fewer on the write path
                self.unrecorded -= 1
                self.current = await retry_while_moving(self.current, record.attempt, self.reload)
            else:
                async with self.lock:  # counted under the lock: the last writer asks then()
                    self.unrecorded -= 1
                    self.current = await retry_while_moving(
                        self.current, record.attempt, self.reload
                    )
        except ConflictError as exc:
            raise RecordConflictError.of(exc) from exc
        _drop(self.held, record.entry)


@dataclass(slots=True)
class _Record:
    """One task's record being written: ``entry`` is the recorder, replaced when the store
    refuses what it wrote (see ``Task.refused``)."""

    run: _Execution
    entry: Recorder
    task: Task
    replaced: bool = False  # ``entry`` is the task's replacement: a refusal of it propagates

    async def attempt(self, current: Session[Any]) -> Session[Any]:
        """Write the record's effects computed from ``current`` (none: nothing written).

        ``retry_while_moving`` calls this again after a conflict, from the session
        as stored then, for as long as other writers move it on.
        """
        run = self.run
        while True:
            try:
                effects = record_effects(self.entry, current, self.task.name)
            except Exception:
                _drop(run.held, self.entry)  # it would raise again: not written after the error
                run.refused_work = True
                raise
            status: Status = run.end() if run.unrecorded == 0 else "committed"
            if not effects:
                return current
            try:
                after = await run.write(current, effects, status)
            except (EffectError, MediaTooLargeError) as exc:
                refused = self.task.refused
                # Offered once: a replacement the store refuses too is not offered
                # again (a ``refused`` that always answers would loop for ever).
                replacement = None if refused is None or self.replaced else refused(exc)
                if replacement is None:
                    _drop(run.held, self.entry)  # refused for good: not written again
                    run.refused_work = True
                    raise
                _swap(run.held, self.entry, replacement)
                self.entry, self.replaced = replacement, True
                continue
            run.written.extend(effects)
            return after


class RecordConflictError(ConflictError):
    """The store kept refusing a task's record without the session moving on (a broken
    store: see :func:`~stepmachine._retry.retry_while_moving`).

    Unlike any other conflict of a cycle, the cycle wrote batches already (its
    intents), so the machine does not decide it again (that would drop the record
    it holds without a word): the run raises it.
    """

    @classmethod
    def of(cls, exc: ConflictError) -> RecordConflictError:
        if isinstance(exc, RecordConflictError):
            return exc
        session_id = getattr(exc, "session_id", "")
        made = cls(session_id, getattr(exc, "expected", -1), getattr(exc, "actual", -1))
        made.add_note(
            "the store refused a task's record again and again without the session moving "
            "on (no other batch since): the result is not recorded; the cycle's intents are"
        )
        return made


@dataclass(frozen=True, slots=True, eq=False)
class Refusable:
    """A task's record held with the task's ``refused``: what finalize writes after a
    cancellation is offered to it too when the store refuses it (see ``Task.refused``)."""

    record: Recorder
    refused: Callable[[Exception], Recorder | None]

    def __call__(self, session: Session[Any]) -> Sequence[Effect]:
        return self.record(session)


def record_effects(record: Recorder, session: Session[Any], task: str | None) -> tuple[Effect, ...]:
    """The effects ``record`` computes from ``session``.

    Raises:
        StepContractError: one is not an :class:`~stepmachine.Effect` (naming
            ``task`` when known); nothing of it is written.
        Exception: whatever the record raises.
    """
    effects = tuple(record(session))
    for effect in effects:
        if not isinstance(effect, Effect):
            whose = "a held record" if task is None else f"the record of task {task!r}"
            raise StepContractError(
                f"{whose} returned {effect!r:.100} (of type {type(effect).__name__}), which is "
                "not an effect; a task's record returns Effect values (AppendMessage(message), "
                "UpdateData(...), ...); it is not written"
            )
    return effects


def _checked(done: object) -> Continue | Yield:
    """What ``then()`` returned, if it says how the cycle ends.

    Raises:
        StepContractError: it returned something else (``None``: a forgotten ``return``).
    """
    if not isinstance(done, Continue | Yield):
        raise StepContractError(
            f"Staged(then=...) returned {type(done).__name__} {done!r:.100}; then() says how "
            "the cycle ends: return Continue(effects) or Yield(effects, reason)"
        )
    return done


async def write_held(
    held: list[Recorder],
    session: Session[Any],
    write: Callable[[Session[Any], Sequence[Effect]], Awaitable[Session[Any]]],
    reload: Callable[[str], Awaitable[Session[Any]]],
    step: str | None = None,
) -> Session[Any]:
    """Write each record in ``held``, in order, each its own batch; the session after them.

    Each is computed from the session as stored then (its batch may have been
    written already: then it records nothing) and retried for as long as other
    writers move the session on (a record of work done is never dropped for
    losing the race). One the store refuses (``EffectError``,
    ``MediaTooLargeError``) is offered to its task's ``refused`` once (a
    :class:`Refusable`); without a replacement, or when the store refuses that
    too, it is logged (with ``step``) and left out. Each record leaves ``held``
    once handled, so after a cancellation meanwhile ``held`` is what is still
    to write.

    Raises:
        Exception: a record that raises, or the store's other errors; the
            records not yet handled stay in ``held``.
    """

    async def attempt(record: Recorder, current: Session[Any]) -> Session[Any]:
        effects = record_effects(record, current, None)
        return current if not effects else await write(current, effects)

    while held:
        record = held[0]
        try:
            session = await retry_while_moving(session, partial(attempt, record), reload)
        except (EffectError, MediaTooLargeError) as exc:
            refused = record.refused if isinstance(record, Refusable) else None
            replacement = None if refused is None else refused(exc)
            if replacement is None:
                _left_out(session.id, step)
            else:
                try:  # the task's replacement (an error result naming the limit), offered once
                    session = await retry_while_moving(
                        session, partial(attempt, replacement), reload
                    )
                except (EffectError, MediaTooLargeError):
                    _left_out(session.id, step)
        _drop(held, record)
    return session


def _left_out(session_id: str, step: str | None) -> None:
    """Log the store's refusal of a held record being handled: it is left out (its
    call, if any, is answered "interrupted" by finalize, or decided again)."""
    _log.failure(
        "the store refused a record the machine held; it is left out",
        session_id=session_id,
        step=step,
    )


def _swap(held: list[Recorder], old: Recorder, new: Recorder) -> None:
    for index, entry in enumerate(held):
        if entry is old:
            held[index] = new
            return
    held.append(new)


def _drop(held: list[Recorder], entry: Recorder) -> None:
    for index, candidate in enumerate(held):
        if candidate is entry:
            del held[index]
            return


def one_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one exception failed concurrent tasks raise instead of ``group``.

    Never a group: ``run()`` raises the documented error itself. Of the leaves
    of ``group`` (nested groups flattened, in order), the first of:

    1. a ``BaseException`` that is not an ``Exception`` nor a cancellation
       (``KeyboardInterrupt``, ``SystemExit``: the run must stop as asked);
    2. any ``Exception`` but :class:`ConflictError` (a lost lease, a store's
       error, a contract error: what stops the run);
    3. :class:`ConflictError` (the machine reloads and re-steps; it loses to an
       error that would stop the run anyway);
    4. a cancellation (a group holding only those).

    Every other leaf but a cancellation is named, by type and message, in a
    note on the one returned (``__notes__``), so nothing is hidden.
    """
    leaves = list(_leaves(group))
    chosen = min(leaves, key=_rank)  # min is stable: the first of the best rank
    for leaf in leaves:
        if leaf is not chosen and _rank(leaf) < _CANCELLATION:
            text = str(leaf)
            text = text if len(text) <= 300 else text[:300] + "..."
            chosen.add_note(f"a concurrent tool call also raised {type(leaf).__name__}: {text}")
    return chosen


def _leaves(exc: BaseException) -> Iterable[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


_CANCELLATION = 3


def _rank(exc: BaseException) -> int:
    """Where ``exc`` stands in :func:`one_error`'s order (lower wins).

    Cancellations are told by class, without asking the running backend, so
    this works outside an event loop too (asyncio's ``CancelledError``, trio's
    ``Cancelled`` once trio is imported).
    """
    if isinstance(exc, ConflictError):
        return 2
    if isinstance(exc, Exception):
        return 1
    trio = sys.modules.get("trio")
    if isinstance(exc, asyncio.CancelledError) or (
        trio is not None and isinstance(exc, trio.Cancelled)
    ):
        return _CANCELLATION
    return 0


def lease_lost(task: Task, lost: LeaseLostError) -> LeaseLostError:
    """The error for a task not started because the run's lease is gone (saying how
    ``lost`` found it gone, when it says)."""
    cause = f"{lost.why}; " if getattr(lost, "why", "") else ""
    return LeaseLostError(
        lost.session_id,
        lost.owner,
        lost.epoch,
        f"{cause}found right before task {task.name!r} would start, so it was not started "
        "(at most once where it matters: another runner holds the session)",
    )
