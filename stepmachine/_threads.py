"""The stores' worker threads on asyncio: a small pool that hands a call to a waiting
thread and its outcome back to the event loop, and nothing else.

Why not anyio's worker threads: on asyncio, ``anyio.to_thread.run_sync`` takes a
slot of its capacity limiter (one extra pass of the event loop), opens a cancel
scope, and hands the call over through a ``queue.Queue`` (a condition variable);
measured on a 2-CPU virtual machine, one hop cost about 170 µs there, against
about 40 µs here, where the call goes through a ``queue.SimpleQueue`` (one lock
in C) and comes back with one ``loop.call_soon_threadsafe``. A durable store
makes several hops per agent step (claim, loads, one per batch, release), so
that difference is most of what a step costs on SQLite beyond SQLite's own work.

Only the stores' own functions run here (:func:`stepmachine._async.run_in_thread`),
never an application's: a tool's thread stays anyio's, so that
``anyio.from_thread`` works in a tool without an event-loop token. Code the
stores call back in this thread (a test's ``boundary_hook``) is not in an anyio
worker thread: to reach the event loop it passes ``anyio.from_thread``'s
``token=`` (taken with ``anyio.lowlevel.current_token()`` beforehand).

The pool's invariants, each kept under its one lock:

* a call is run exactly once, by one thread, in a copy of the caller's context
  variables (as anyio's workers do);
* a thread is either running a call, or idle on its own queue and listed in
  ``idle`` (a ``submit`` that takes it from the list puts a call on its queue);
* at most :data:`MAX_THREADS` threads exist; a call made while all are busy
  waits in ``backlog`` and is taken by the next thread to finish, before it
  goes idle;
* a thread idle for :data:`IDLE_SECONDS` leaves (unless a call was just handed
  to it), so an idle process holds no threads;
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
from typing import Any

__all__ = ["IDLE_SECONDS", "MAX_THREADS", "POOL", "Pool"]

MAX_THREADS = 40
"""At most this many threads (anyio's default thread limit, for the same reason)."""

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


class Pool:
    """Worker threads for :func:`stepmachine._async.run_in_thread` (see the module docs)."""

    def __init__(self, max_threads: int = MAX_THREADS, idle_seconds: float = IDLE_SECONDS) -> None:
        self._max = max_threads
        self._idle_seconds = idle_seconds
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []  # last in, first out: the warmest thread goes first
        self._backlog: deque[Call] = deque()
        self._threads = 0

    def submit(self, call: Call) -> None:
        """Have ``call`` run in a worker thread: an idle one, a new one, or the next free."""
        worker: _Worker | None = None
        new = False
        with self._lock:
            if self._idle:
                worker = self._idle.pop()
            elif self._threads < self._max:
                self._threads += 1
                worker = _Worker(self)
                new = True
            else:
                self._backlog.append(call)
        if worker is None:
            return
        worker.calls.put(call)
        if new:
            worker.start()

    def reset(self) -> None:
        """Forget every thread (in a child after ``os.fork()``, where none of them exists)."""
        self._lock = threading.Lock()
        self._idle = []
        self._backlog = deque()
        self._threads = 0

    # -- in a worker thread ------------------------------------------------------------

    def _next(self, worker: _Worker, done: Callable[[], None]) -> Call | None:
        """The worker's next call, once ``done()`` handed the last one's outcome back:
        from the backlog, else waited for while listed idle; ``None`` when it was idle
        too long and leaves.

        The worker is listed idle before the outcome goes back, so the caller's next
        call (often made at once) finds this warm thread rather than starting another.
        """
        with self._lock:
            call = self._backlog.popleft() if self._backlog else None
            if call is None:
                self._idle.append(worker)
        done()
        del done  # nothing of a finished call is kept while idle
        if call is not None:
            return call
        try:
            return worker.calls.get(timeout=self._idle_seconds)
        except queue.Empty:
            pass
        with self._lock:
            if worker in self._idle:  # nobody took it meanwhile: it leaves
                self._idle.remove(worker)
                self._threads -= 1
                return None
        return worker.calls.get()  # a submit took it off the list: its call is coming


class _Worker(threading.Thread):
    """One thread of the pool: runs calls from its own queue until it leaves."""

    def __init__(self, pool: Pool) -> None:
        super().__init__(name="stepmachine store worker", daemon=True)
        self.pool = pool
        self.calls: queue.SimpleQueue[Call] = queue.SimpleQueue()

    def run(self) -> None:
        call: Call | None = self.calls.get()
        while call is not None:
            call = self.pool._next(self, _run(call))


def _run(call: Call) -> Callable[[], None]:
    """Run one call; what hands its outcome to its loop."""
    loop, future, context, function, args = call
    result: Any = None
    error: BaseException | None = None
    try:
        result = context.run(function, *args)
    except BaseException as exc:  # noqa: BLE001 - handed to the caller, whatever it is
        error = exc

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
"""The process's pool (every store shares it)."""

if hasattr(os, "register_at_fork"):  # pragma: no branch - POSIX
    os.register_at_fork(after_in_child=POOL.reset)
