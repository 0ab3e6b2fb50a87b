"""The stores' worker threads on asyncio: a small pool that hands a call to a waiting
thread and its outcome back to the calling event loop, and nothing else.

Why not anyio's worker threads: on asyncio, ``anyio.to_thread.run_sync`` takes a
slot of its capacity limiter (one extra pass of the event loop), opens a cancel
scope, and hands the call over through a ``queue.Queue`` (a condition variable).
Here the call goes through a ``queue.SimpleQueue`` (one lock in C) and comes back
with one ``loop.call_soon_threadsafe``. Measured on a 2-CPU virtual machine, a
hop running nothing took about 100 µs here against about 140 µs there (most of
either is the operating system waking a thread on the other CPU). A durable
store makes several hops per agent step (the lease's claim and release, one per
batch), so that difference adds up.

Only the stores' own functions run here (:func:`stepmachine._async.run_in_thread`),
never an application's: a tool's thread stays anyio's, so that
``anyio.from_thread`` works in a tool without an event-loop token. Code the
stores call back in this thread (a test's ``boundary_hook``) is not in an anyio
worker thread: to reach the event loop it passes ``anyio.from_thread``'s
``token=`` (taken with ``anyio.lowlevel.current_token()`` beforehand).

One pool serves the process (:data:`POOL`); its threads serve every event loop,
so a process that runs many loops one after another (``asyncio.run`` per
request, ``Agent.run_sync``) reuses the same warm threads. Its limit is per loop,
as anyio's is: calls blocked on one loop (40 writes waiting for another
process's lock) never keep another loop's calls from running. The pool's
invariants, each kept under its one lock:

* a call is run at most once, by one thread, in a copy of the caller's context
  variables (as anyio's workers do); every call handed over is run, unless its
  caller dropped it first (:func:`stepmachine._async.run_in_thread`);
* a thread is either running a call, or idle on its own queue and listed in
  ``idle`` (a ``submit`` that takes it from the list puts a call on its queue);
* at most :data:`MAX_PER_LOOP` calls of one loop run at once; a call made while
  its loop has that many running waits in that loop's backlog (``submit`` says
  so) and is taken by the next of its loop's threads to finish, before it goes
  idle; a loop is known to the pool only while calls of it run or wait (the
  pool keeps no loop alive); a thread that cannot be started (no memory, a
  thread limit) is not counted, and its ``submit`` raises;
* an idle thread holds nothing of the calls it ran (not their arguments, nor
  their outcome or context), and leaves after :data:`IDLE_SECONDS` without a
  call, so an idle process holds no threads;
* after ``os.fork()`` the child starts with an empty pool (the parent's threads
  do not exist there).

The outcome of a call is handed back with ``call_soon_threadsafe`` to the loop
that made it; a loop closed meanwhile drops it (nobody awaits it). The threads
are daemons: an interpreter exiting does not wait for an idle one (a call in
flight has a caller awaiting it, so a run ends only once its calls have).
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["IDLE_SECONDS", "MAX_PER_LOOP", "POOL", "Pool"]

MAX_PER_LOOP = 40
"""At most this many calls of one event loop run at once (anyio's default thread limit,
which is per loop too, for the same reason)."""

IDLE_SECONDS = 10.0
"""A thread that had no call for this long leaves (as anyio's do)."""

Call = tuple[
    asyncio.AbstractEventLoop,
    "asyncio.Future[Any]",
    contextvars.Context,
    Callable[..., Any],
    tuple[Any, ...],
]
"""One call: the loop to answer, its future, the caller's context, the function, its args."""


@dataclass(slots=True)
class _Loop:
    """What one event loop has in the pool: its calls running, and those waiting."""

    running: int = 0
    backlog: deque[Call] = field(default_factory=deque)


class Pool:
    """Worker threads for :func:`stepmachine._async.run_in_thread` (see the module docs)."""

    def __init__(
        self, max_per_loop: int = MAX_PER_LOOP, idle_seconds: float = IDLE_SECONDS
    ) -> None:
        self._max = max_per_loop
        self._idle_seconds = idle_seconds
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []  # last in, first out: the warmest thread goes first
        self._loops: dict[asyncio.AbstractEventLoop, _Loop] = {}  # with calls running or waiting
        self._threads = 0

    def submit(self, call: Call) -> bool:
        """Have ``call`` run in a worker thread: an idle one or a new one (True), or, when
        its loop has ``max_per_loop`` calls running, the next of them to finish (False:
        it waits in its loop's backlog).

        Raises:
            RuntimeError: a new thread was needed and could not be started; the call
                will not run.

        An interrupt (``KeyboardInterrupt``) raised in the middle of the hand-off
        leaves nothing counted for a call no thread has.
        """
        loop = call[0]
        new = False
        with self._lock:
            here = self._loops.get(loop)
            if here is None:
                here = self._loops[loop] = _Loop()
            if here.running >= self._max:
                here.backlog.append(call)
                return False
            here.running += 1
            handed = False
            try:
                if self._idle:
                    worker = self._idle.pop()
                else:
                    worker = _Worker(self)
                    self._threads += 1
                    new = True
                worker.calls.put(call)
                handed = True
            finally:
                if not handed:  # interrupted first (a KeyboardInterrupt): nothing was handed
                    if new:
                        self._threads -= 1  # never started
                    self._ended(loop)  # its slot is free again
        if new:
            try:
                worker.start()
            except BaseException:
                with self._lock:
                    self._threads -= 1  # it never ran: its slot is free again
                    self._ended(loop)
                raise
        return True

    def reset(self) -> None:
        """Forget every thread and call (in a child after ``os.fork()``, where none of the
        parent's threads exists)."""
        self._lock = threading.Lock()
        self._idle = []
        self._loops = {}
        self._threads = 0

    def _ended(self, loop: asyncio.AbstractEventLoop) -> None:
        """One call of ``loop`` ended (under the lock); the loop is forgotten once it has
        none running."""
        here = self._loops[loop]
        here.running -= 1
        if here.running == 0 and not here.backlog:
            del self._loops[loop]

    # -- in a worker thread ------------------------------------------------------------

    def _after(self, worker: _Worker, loop: asyncio.AbstractEventLoop) -> Call | None:
        """``worker`` just ran a call of ``loop``: the next call waiting for that loop (its
        slot handed on), else None, and the worker is listed idle (before the caller
        hears of the outcome, so that a call made at once finds this warm thread rather
        than starting another)."""
        with self._lock:
            here = self._loops[loop]
            if here.backlog:
                return here.backlog.popleft()
            self._ended(loop)
            self._idle.append(worker)
            return None

    def _wait(self, worker: _Worker) -> Call | None:
        """The idle worker's next call; None when it had none for ``idle_seconds`` and
        leaves."""
        try:
            return worker.calls.get(timeout=self._idle_seconds)
        except queue.Empty:
            pass
        with self._lock:
            if worker in self._idle:  # nobody took it meanwhile: it leaves
                self._idle.remove(worker)
                self._threads -= 1
                return None
        # A submit took it off the list and puts its call now, unless that submit was
        # interrupted in between (a KeyboardInterrupt): then nobody waits for a call.
        try:
            return worker.calls.get(timeout=self._idle_seconds)
        except queue.Empty:
            with self._lock:
                self._threads -= 1
            return None


class _Worker(threading.Thread):
    """One thread of a pool: runs calls from its own queue until it leaves."""

    def __init__(self, pool: Pool) -> None:
        super().__init__(name="stepmachine store worker", daemon=True)
        self.pool = pool
        self.calls: queue.SimpleQueue[Call] = queue.SimpleQueue()

    def run(self) -> None:
        pool = self.pool
        call: Call | None = self.calls.get()
        while call is not None:
            loop = call[0]
            done = _run(call)
            call = pool._after(self, loop)
            del loop
            done()
            del done  # the outcome is handed back: nothing of the call stays here
            if call is None:
                call = pool._wait(self)


def _run(call: Call) -> Callable[[], None]:
    """Run one call; what hands its outcome to its loop."""
    loop, future, context, function, args = call
    del call
    result: Any = None
    error: BaseException | None = None
    try:
        result = context.run(function, *args)
    except BaseException as exc:  # noqa: BLE001 - handed to the caller, whatever it is
        error = exc
    del context, function, args

    def done() -> None:
        try:
            loop.call_soon_threadsafe(_settle, future, result, error)
        except RuntimeError:  # the loop is closed: nobody awaits the call any more
            if not loop.is_closed():
                raise

    return done


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """In the loop: the call's outcome, unless its caller stopped waiting (cancelled)."""
    if future.done():
        return
    if error is None:
        future.set_result(result)
    elif isinstance(error, StopIteration):  # a future refuses it (it would end a coroutine)
        wrapped = RuntimeError("the function run in a worker thread raised StopIteration")
        wrapped.__cause__ = error
        future.set_exception(wrapped)
    else:
        future.set_exception(error)


POOL = Pool()
"""The process's pool (every store, every event loop)."""

if hasattr(os, "register_at_fork"):  # pragma: no branch - POSIX
    os.register_at_fork(after_in_child=POOL.reset)
