"""Durable turns on DBOS Transact: a worker that dies mid-turn is resumed by another.

Needs the ``dbos`` extra (``pip install 'stepmachine[dbos]'``) and runs on
**asyncio only** (see *Trio* below). A worker process::

    async def serve(slot: int) -> None:
        store = await PostgresStore.open(dsn)
        DBOS(config=dbos_config("support-bot", dsn, executor_id=f"worker-{slot}"))
        durable = DurableMachine(machine, Runtime(store=store, model=model))
        await durable.launch()  # recovers this slot's turns, serves the queue
        await asyncio.Event().wait()

    asyncio.run(serve(3))

and, in a worker or anywhere else that launched DBOS, a turn::

    await submit(store, session_id, [AppendMessage(Message.user(text, id=message_id))])
    report = await durable.result(await durable.enqueue_turn(session_id))

(a process that does not serve turns enqueues with ``dbos.DBOSClient``, see
:meth:`DurableMachine.enqueue_options`).

What a durable turn is. :class:`DurableMachine` registers one DBOS workflow per
machine (named ``<name>.turn``) that runs one *turn* of a session: a loop of
DBOS steps, each step exactly **one machine cycle**, run by the machine's driver
as ``run()`` runs each of its cycles (decided, applied, finalized if cancelled):

1. step ``stepmachine.turn_start`` loads the session and records its revision
   (the turn's ``run_start_revision``, so per-run budgets count from the turn's
   start even when the turn is resumed elsewhere);
2. step ``stepmachine.cycle`` (one per cycle, numbered 1, 2, ... as
   ``cycle=n``) loads the stored session, asks the steps, applies the winner's
   batch and returns a :class:`CycleSummary` (revision, status, step, reason).
   A :class:`~stepmachine.ConflictError` (a user message or an approval
   submitted meanwhile) reloads and redoes the cycle, at most the machine's
   ``max_conflicts`` times;
3. the turn ends when a cycle yields (``status="yielded"``), when the
   machine's :class:`~stepmachine.CancelToken` has fired (``"yielded"``, reason
   ``cancelled``, after finalize, as ``run()`` returns), when no step applies
   (``"idle"``), or after ``max_cycles`` cycles (reason ``cycle_limit``); the
   workflow returns a :class:`TurnReport`.

DBOS records each step's output in its system tables when the step returns.
After a crash, DBOS runs the workflow again from the top: steps that were
recorded return their recorded output without running; the first one that was
not recorded (the cycle that was running when the process died) runs again.
That re-run *decides from the stored session*, which is the whole state
(state is the session): if the dead worker committed the cycle's batch before dying, the
re-run sees it and decides the next thing to do; if not, it decides the same
thing again. Tool calls are protected by stepmachine's own journal, not by
DBOS: a call whose result is stored is never run again; an open call of an
``idempotent`` (or ``pure``) tool is run again with the same idempotency key;
an open call of a ``non_idempotent`` tool that had its intent recorded is
answered "outcome unknown" (or held, per ``Tools(on_unknown_outcome=...)``).
So the session's effects stay in the stepmachine store (a
:class:`~stepmachine.stores.PostgresStore` in the same database is the intended
deployment; any store works) and DBOS only records *which cycles finished*.
A re-run cycle whose crashed attempt had already committed a yield usually
finds nothing to do, so that turn ends ``idle`` rather than with the yield's
reason; the yield's effects are in the store either way.

One turn per session across the cluster. Turns go through a DBOS queue
(default name ``<name>.turns``) with ``partition_concurrency=1``, partitioned
by session id: DBOS starts a turn of a session only while no other turn of that
session is PENDING anywhere, so a turn enqueued for a busy session waits. A
worker that dies leaves its turn PENDING, which keeps the session's partition
closed until the turn is recovered (below) -- never two runners on a session.

Recovery of a dead worker's turn. Every worker process has an *executor id*
(``dbos_config(executor_id=...)`` or the ``DBOS__VMID`` environment variable;
DBOS's default is ``"local"``). A dequeued turn is PENDING under its worker's
executor id. ``DBOS.launch()`` (called by :meth:`DurableMachine.launch`)
recovers the PENDING workflows of *its own* executor id: it puts them back on
their queue (ENQUEUED, same partition), where any worker picks them up. So the
recipe without DBOS Conductor is: give each worker slot a stable executor id
(``worker-3``), and when a worker dies, start its replacement with the same id;
the replacement's launch hands the dead worker's turns back to the queue, and
whichever worker dequeues a turn resumes it from its last recorded cycle.
Two live processes must never share an executor id: the second one's launch
would hand the first one's running turns to another worker. DBOS recovers and
dequeues only the workflows of its own application version (hashed from the
registered workflows' source unless ``dbos_config(application_version=...)``
pins it), so a replacement must run the same version. (DBOS Conductor, the
hosted control plane, instead detects dead executors and recovers their
workflows on live ones.)

Leases. The DBOS queue's partition keeps one *turn* per session across the
cluster, held as long as the turn is PENDING in DBOS, across crashes, without
a clock. It does not *fence*: if the turns of an executor that is still alive
are recovered (its id reused by a second live process, or an operator's
recovery of a worker that was only slow), two runners could advance the
session at once. So each cycle also holds the store's lease (one runner per session)
when the store has leases (the shipped stores do) and the machine a lease
policy: the cycle claims it (waiting while another runner, a ``run()`` caller
included, holds it), writes every batch fenced by it, renews it while a tool
runs, and releases it when the step ends. A stale runner's write is refused
(:class:`~stepmachine.LeaseLostError`; the cycle is tried again, waiting for
the lease, and decides from what the other runner stored),
and a waiting one sees the first one's results instead of reading its
in-flight calls as crashed. ``StateMachine(lease=None)`` turns this off. A turn
a ``run(..., lease=LeasePolicy(busy="queue"))`` queued while a cycle held the
lease is run by the durable turn: the cycle's release takes the pending-run
mark and the turn goes on for another cycle (on its last allowed cycle, the
mark is set again for the next claimer: a ``stepmachine.serve`` worker, or the
next durable turn enqueued for the session).
Writes that are not a runner's (``submit()``: user messages, approvals) are
compare-and-set only, and a cycle that loses such a race reloads.

Transient store errors. A cycle (or the turn's start) that raises a
transient error (the store unreachable or restarted: ``OSError``,
``psycopg.OperationalError`` such as ``AdminShutdown``; a lost lease;
conflicts past ``max_conflicts``) is tried again inside its DBOS step after a
backoff (0.1-0.2 s, doubling to at most 5 s, jittered), up to 8 attempts
in a row, each logged (``durable_step_retried``). Only then, or on any other
error, does the step raise: DBOS records the error and the turn ends ``ERROR``
(the visible record; :meth:`DurableMachine.result` raises
:class:`DurableTurnError`). So a database restart costs a turn a pause, not
the turn. A retry decides from the stored session, as a recovery does.

Serialization: msgspec, never pickle. DBOS pickles workflow inputs, outputs,
step outputs and errors unless its config names another serializer.
:func:`dbos_config` puts :class:`MsgspecSerializer` there (msgspec JSON;
errors become a small JSON record and come back as
:class:`DurableTurnError`), and :meth:`DurableMachine.launch` refuses a DBOS
whose serializer is another. What crosses DBOS is only builtins: the session id
(a string), and :class:`CycleSummary` / :class:`TurnReport` as plain
dictionaries. A submitter outside the workers (``dbos.DBOSClient``) must pass
``serializer=MsgspecSerializer()`` too. One limit is DBOS's: a row whose
``serialization`` column says ``py_pickle`` is still unpickled by DBOS when it
is read; rows this module writes never say so, and the system database must be
as trusted as the store's database.

Trio. DBOS Transact is asyncio-only: it runs async workflows on an asyncio
event loop (the one that called ``DBOS.launch()``) and waits with
``asyncio.to_thread``; under trio it fails with "no running event loop". Every
entry point here raises :class:`~stepmachine.ConfigurationError` saying so when
called under any other event loop. (The machine, its steps and the stores
still run on both; only the durable worker needs asyncio.)

Not mapped: the machine's ``CancelToken`` (cancel a durable turn with
``DBOS.cancel_workflow``: it stops at the next cycle boundary) and live events
(a turn runs in whichever worker dequeued it; clients follow the store). A
cycle cancelled in its task (the worker's loop shutting down) is finalized as
``run()`` does: what the step had is kept, open calls are answered
"interrupted".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import anyio
import msgspec

from . import _log, _transient
from ._cycle import Driver
from ._emitter import EventSink, NullEmitter
from ._errors import ConfigurationError
from ._hold import claim, hold, leasing_store, release, renew_interval, request_again
from ._lease import new_owner
from ._machine import DEFAULT_MAX_CYCLES, StateMachine
from ._outcomes import StepResult
from ._runtime import Runtime
from ._session import Session
from ._steps import YieldReason

try:
    from dbos import (
        DBOS,
        EnqueueOptions,
        Queue,
        SetEnqueueOptions,
        SetWorkflowID,
        WorkflowHandleAsync,
    )
except ImportError as exc:  # pragma: no cover - the extra is installed in the test environment
    raise ImportError(
        f"stepmachine.durable needs DBOS Transact: pip install 'stepmachine[dbos]' ({exc})"
    ) from exc

from ._durable_codec import (
    SERIALIZER_NAME,
    CycleSummary,
    DurableTurnError,
    MsgspecSerializer,
    TurnReport,
    check_serializer,
    dbos_config,
)
from ._public import publish as _publish

__all__ = [
    "CYCLE_STEP",
    "SERIALIZER_NAME",
    "TURN_START_STEP",
    "CycleSummary",
    "DurableMachine",
    "DurableTurnError",
    "MsgspecSerializer",
    "TurnReport",
    "dbos_config",
]

CYCLE_STEP = "stepmachine.cycle"
"""The DBOS step name of one machine cycle (stable: recorded steps are matched by it)."""

TURN_START_STEP = "stepmachine.turn_start"
"""The DBOS step name that records the revision a turn started at."""

RuntimeSource = Runtime | Callable[[], Runtime]

T = TypeVar("T")


def _check_polling_interval(value: object) -> None:
    """Seconds between two polls: a finite number > 0 (DBOS sleeps it out, so an
    infinite one would never poll again)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 < value <= sys.float_info.max
    ):
        raise ConfigurationError(f"polling_interval must be a finite number > 0, got {value!r}")


class DurableMachine:
    """Runs a machine's turns as DBOS workflows; see the module docs.

    Constructing it registers the turn workflow (``<name>.turn``) with DBOS,
    so build it before ``DBOS.launch()``, in every worker and submitter, with
    the same ``name``. One per ``name`` per process: a second one replaces the
    first's registration.

    Args:
        machine: the machine whose cycles the turns run (its steps,
            ``max_conflicts`` and ``finalize_timeout`` are used).
        runtime: the Runtime the cycles run with, or a function returning one
            (called once per cycle step, so a worker may build it lazily).
        name: names the workflow (``<name>.turn``) and the default queue.
        queue_name: the DBOS queue of turns (default ``<name>.turns``).
        max_cycles: cycles one turn runs at most (default: the machine's
            ``max_cycles``, or :data:`~stepmachine.DEFAULT_MAX_CYCLES` if it
            has none); then the turn ends with reason ``cycle_limit``.
        polling_interval: seconds between a worker's polls of the queue.
        max_recovery_attempts: times DBOS starts one turn before it gives up
            on it (each crash and recovery counts one).

    Raises:
        ConfigurationError: ``max_cycles`` is not > 0, or ``polling_interval``
            is not a finite number > 0.
    """

    def __init__(
        self,
        machine: StateMachine[Any],
        runtime: RuntimeSource,
        *,
        name: str = "stepmachine",
        queue_name: str | None = None,
        max_cycles: int | None = None,
        polling_interval: float = 1.0,
        max_recovery_attempts: int = 100,
    ) -> None:
        self.machine = machine
        self._runtime = runtime
        self.name = name
        self.queue_name = queue_name or f"{name}.turns"
        self.workflow_name = f"{name}.turn"
        limit = max_cycles if max_cycles is not None else machine.max_cycles
        limit = DEFAULT_MAX_CYCLES if limit is None else limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigurationError(f"max_cycles must be a positive integer, got {max_cycles!r}")
        self.max_cycles: int = limit
        _check_polling_interval(polling_interval)
        self.polling_interval = polling_interval
        self._queue: Queue | None = None

        async def turn(session_id: str) -> dict[str, Any]:
            return await self._turn(session_id)

        self._workflow = DBOS.workflow(
            name=self.workflow_name, max_recovery_attempts=max_recovery_attempts
        )(turn)

    # -- worker and submitter entry points ------------------------------------------

    async def launch(self) -> None:
        """Launch DBOS in this process and register the turn queue; this process then serves it.

        Call it from the asyncio event loop the turns should run on (DBOS runs
        async workflows on the loop that called ``DBOS.launch()``), after
        ``DBOS(config=dbos_config(...))``. Launching recovers the PENDING turns
        of this process's executor id (see the module docs). The queue is
        registered (or updated) with ``partition_concurrency=1``. Launching an
        already launched DBOS only registers the queue.

        Raises:
            ConfigurationError: not on asyncio; DBOS was not constructed; its
                serializer is not a :class:`MsgspecSerializer`.
        """
        _require_asyncio("DurableMachine.launch")
        check_serializer()
        DBOS.launch()  # blocks the loop while DBOS connects and migrates its tables
        self._queue = await DBOS.register_queue_async(
            self.queue_name, partition_concurrency=1, polling_interval_sec=self.polling_interval
        )

    async def enqueue_turn(self, session_id: str, *, turn_id: str | None = None) -> str:
        """Queue a turn of ``session_id``; return its workflow id.

        The turn starts when a worker dequeues it and no other turn of the
        session is running. ``turn_id`` makes the call idempotent: enqueueing
        an id that exists returns it without queueing another turn.

        Raises:
            ConfigurationError: not on asyncio, or :meth:`launch` was not called
                in this process (a submitter that is not a worker uses
                ``dbos.DBOSClient`` with :meth:`enqueue_options`).
        """
        _require_asyncio("DurableMachine.enqueue_turn")
        if self._queue is None:
            raise ConfigurationError(
                "enqueue_turn needs DurableMachine.launch() in this process; from outside "
                "the workers use dbos.DBOSClient(..., serializer=MsgspecSerializer())"
                ".enqueue_async(durable.enqueue_options(session_id), session_id)"
            )
        with contextlib.ExitStack() as stack:
            stack.enter_context(SetEnqueueOptions(queue_partition_key=session_id))
            if turn_id is not None:
                stack.enter_context(SetWorkflowID(turn_id))
            handle = await self._queue.enqueue_async(self._workflow, session_id)
        return handle.workflow_id

    def enqueue_options(self, session_id: str, *, turn_id: str | None = None) -> EnqueueOptions:
        """Options for ``DBOSClient.enqueue_async(options, session_id)``: a turn of the session."""
        options = EnqueueOptions(
            workflow_name=self.workflow_name,
            queue_name=self.queue_name,
            queue_partition_key=session_id,
        )
        if turn_id is not None:
            options["workflow_id"] = turn_id
        return options

    async def result(self, workflow_id: str, *, polling_interval: float = 1.0) -> TurnReport:
        """Wait for the turn ``workflow_id`` to end; return its report (DBOS launched here).

        Args:
            workflow_id: the turn's id, as :meth:`enqueue_turn` returned it.
            polling_interval: seconds between two reads of the turn's status
                (DBOS's default, 1 s; a turn that ends in between is seen at the
                next read).

        Raises:
            ConfigurationError: not on asyncio, or ``polling_interval`` is not a
                finite number > 0.
            DurableTurnError: the turn failed (a step raised); the error DBOS recorded.
        """
        _require_asyncio("DurableMachine.result")
        _check_polling_interval(polling_interval)
        handle: WorkflowHandleAsync[Any] = await DBOS.retrieve_workflow_async(workflow_id)
        return TurnReport.from_output(
            await handle.get_result(polling_interval_sec=polling_interval)
        )

    # -- the workflow and its steps ---------------------------------------------------

    async def _turn(self, session_id: str) -> dict[str, Any]:
        """The registered workflow: one turn; see the module docs. Deterministic given its steps."""
        start = await DBOS.run_step_async({"name": TURN_START_STEP}, self._start, session_id)
        cycles: list[CycleSummary] = []
        reason = YieldReason.CYCLE_LIMIT
        for number in range(1, self.max_cycles + 1):
            recorded = await DBOS.run_step_async(
                {"name": CYCLE_STEP}, self._cycle, session_id, number, start
            )
            summary = msgspec.convert(recorded, CycleSummary)
            cycles.append(summary)
            if summary.status != "continue":
                reason = summary.reason
                break
        revision = cycles[-1].revision if cycles else start
        report = TurnReport(
            session_id=session_id,
            start_revision=start,
            revision=revision,
            reason=reason,
            cycles=tuple(cycles),
        )
        return msgspec.to_builtins(report)  # type: ignore[no-any-return]  # a dict

    def runtime(self) -> Runtime:
        """The Runtime for a cycle: the one given, or what the given function returns."""
        return self._runtime if isinstance(self._runtime, Runtime) else self._runtime()

    async def _start(self, session_id: str) -> int:
        """Step ``stepmachine.turn_start``: the stored revision at the turn's start."""
        return await _retrying(session_id, TURN_START_STEP, lambda: self._start_once(session_id))

    async def _start_once(self, session_id: str) -> int:
        session: Session[Any] = await self.runtime().session_loader().load(session_id)
        return session.revision

    async def _cycle(self, session_id: str, number: int, start: int) -> dict[str, Any]:
        """Step ``stepmachine.cycle``: :meth:`_cycle_once`, tried again on transient errors."""
        return await _retrying(
            session_id, CYCLE_STEP, lambda: self._cycle_once(session_id, number, start)
        )

    async def _cycle_once(self, session_id: str, number: int, start: int) -> dict[str, Any]:
        """One cycle from the stored session, as a summary dict.

        When the store has leases (and the machine a lease policy), the cycle
        holds the session's lease, waiting for it as ``LeasePolicy(busy="wait")``
        does, and writes fenced by it; it releases the lease when the step ends.
        A turn requested while it held the lease (``run(busy="queue")``, or
        ``request_run``) is not left to others: the release takes the
        pending-run mark and the cycle reports ``"continue"``, so the turn runs
        another cycle, which decides from the stored session (it answers what
        was queued); on the turn's last allowed cycle the mark is set again for
        the next claimer instead. A cycle that raises releases plainly (a mark
        stays set).

        Raises:
            LeaseLostError: the lease was lost during the cycle (another runner
                took the session over); nothing of this cycle after the loss
                was stored.
            ConflictError: more than the machine's ``max_conflicts`` conflicts.
            Exception: whatever a step raises (DBOS records it; the turn fails).
        """
        runtime = self.runtime()
        policy = self.machine.lease
        leases = None if policy is None else leasing_store(runtime)
        if policy is None or leases is None:
            return await self._cycle_in(runtime, session_id, number, start)
        waiting = dataclasses.replace(policy, busy="wait")  # a cycle never fails or queues
        lease = await claim(leases, session_id, new_owner(), waiting)
        assert lease is not None
        try:
            summary = await hold(
                leases,
                lease,
                lambda fence: self._cycle_in(
                    dataclasses.replace(runtime, handler=fence), session_id, number, start
                ),
                renew_every=renew_interval(lease),
            )
        except BaseException:
            await release(leases, lease, unless_requested=False)  # a requested turn stays marked
            raise
        if await release(leases, lease, unless_requested=True):
            return summary
        # A turn was requested while this cycle held the session (a run(busy="queue")
        # was told the holder runs it): the mark is taken, so this turn runs it.
        try:
            if number < self.max_cycles:
                summary = {**summary, "status": "continue", "reason": ""}  # one more cycle
            else:  # this turn has no cycle left: the next claimer runs it
                await request_again(leases, lease)
        finally:
            await release(leases, lease, unless_requested=False)
        return summary

    async def _cycle_in(
        self, runtime: Runtime, session_id: str, number: int, start: int
    ) -> dict[str, Any]:
        session: Session[Any] = await runtime.session_loader().load(session_id)
        summary = await self._one_cycle(runtime, session, number, start)
        return msgspec.to_builtins(summary)  # type: ignore[no-any-return]  # a dict

    async def _one_cycle(
        self, runtime: Runtime, session: Session[Any], number: int, start: int
    ) -> CycleSummary:
        """Cycle ``number`` from ``session``, by the machine's driver (as ``run()`` runs each
        cycle): decided, applied, and finalized if it is cancelled; after a conflict, decided
        again from the session the driver reloaded (its ``max_conflicts``, as in ``run()``)."""
        sink = EventSink(NullEmitter(), session.id, session.revision)
        driver = Driver(self.machine, runtime, sink, start_revision=start, finalize_on_reload=False)
        while True:
            driver.cycles = number - 1  # a cycle tried again keeps its number
            conflicts = driver.conflicts
            after, report = await driver.cycle(session)
            if driver.conflicts == conflicts:
                break
            session = after
        if not driver.results:  # no step applied
            reason = "" if report is None else report.reason.kind
            return CycleSummary(
                cycle=number,
                revision=after.revision,
                status="idle",
                reason=reason,
                conflicts=driver.conflicts,
            )
        return _summary(number, after, driver.results[-1], driver.conflicts)


async def _retrying(session_id: str, step: str, attempt: Callable[[], Awaitable[T]]) -> T:
    """``await attempt()``, again after a backoff while it raises a transient error.

    Transient (``stepmachine._transient``): the store unreachable or restarted
    (``OSError``, ``psycopg.OperationalError``), a lost lease, conflicts past
    ``max_conflicts``. Each retry is logged (``durable_step_retried``, WARNING)
    and waits ``_transient.backoff(n)`` (at most 5 s); the
    ``_transient.MAX_ATTEMPTS``-th failure in a row, or any other error, is
    raised: DBOS records it and the turn ends ``ERROR``. Trying again is what a
    recovery does: the attempt decides from the stored session.
    """
    failures = 0
    while True:
        try:
            return await attempt()
        except Exception as exc:
            failures += 1
            if not _transient.is_transient(exc) or failures >= _transient.MAX_ATTEMPTS:
                raise
            delay = _transient.backoff(failures)
            _log.event(
                _log.WARNING,
                "durable_step_retried",
                session_id=session_id,
                step=step,
                error_type=type(exc).__name__,
                attempt=failures,
                delay_s=round(delay, 3),
                detail=str(exc),
            )
            await anyio.sleep(delay)


def _summary(number: int, after: Session[Any], result: StepResult, conflicts: int) -> CycleSummary:
    """The cycle's summary: ``"yielded"`` ends the turn, as a yield or the machine's
    token firing (``reason`` ``"cancelled"``: finalized, as ``run()`` returns) do."""
    ended = result.status in ("yielded", "cancelled")
    status: Literal["continue", "yielded"] = "yielded" if ended else "continue"
    reason = result.reason.kind if result.reason is not None else ""
    return CycleSummary(
        cycle=number,
        revision=after.revision,
        status=status,
        step=result.step,
        reason=reason,
        conflicts=conflicts,
    )


def _require_asyncio(where: str) -> None:
    """Raise :class:`ConfigurationError` unless running on asyncio (DBOS needs it)."""
    library: str | None = None
    try:
        import sniffio  # noqa: PLC0415 - trio brings it; without it only asyncio can be running
    except ImportError:  # pragma: no cover - installed with trio, and by most asyncio stacks
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop()
            library = "asyncio"
    else:
        with contextlib.suppress(sniffio.AsyncLibraryNotFoundError):
            library = sniffio.current_async_library()
    if library != "asyncio":
        raise ConfigurationError(
            f"{where} needs asyncio, not {library or 'no event loop'}: DBOS Transact runs "
            "workflows on an asyncio event loop and waits with asyncio.to_thread (under trio "
            "it fails with 'no running event loop'); run durable workers with asyncio.run() "
            "or anyio.run(..., backend='asyncio')"
        )


_publish(__name__, globals())
