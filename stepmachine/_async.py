"""Which async library runs here, told cheaply; a checkpoint that uses it; a thread
hop that is never left while its function runs.

anyio answers "which library?" through sniffio on every call it dispatches;
a hot path that only needs to know "plain asyncio, or anything else?" asks
:func:`asyncio_here`, and :func:`checkpoint` is ``anyio.lowlevel.checkpoint()``
without that lookup on asyncio.

:func:`interrupt_once` is what a task that ran a task group raises when a
child's ``KeyboardInterrupt`` came out of the group: on asyncio, never the same
interrupt twice.

:func:`run_in_thread` is the stores' hop to a worker thread (on asyncio, one of
:mod:`._threads`): a caller never
goes on (releasing a lock, a connection) while its function still runs there,
even when asyncio's native ``task.cancel()`` interrupts the wait, which no
anyio shield stops.

:func:`light_checkpoint` is the in-memory store's checkpoint: a cancellation
point on every call, a scheduling point every millisecond at least.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio.lowlevel
import anyio.to_thread

from ._threads import MAX_PER_LOOP, POOL

__all__ = [
    "asyncio_here",
    "checkpoint",
    "interrupt_once",
    "light_checkpoint",
    "run_in_thread",
]

T = TypeVar("T")


try:
    import sniffio as _sniffio
except ImportError:  # pragma: no cover - anyio runs without it
    _sniffio = None  # type: ignore[assignment]


def asyncio_here() -> bool:
    """Whether anyio runs on asyncio here, as anyio itself would tell.

    anyio asks sniffio, which answers its thread-local name or its context
    variable when set (trio sets one, so do anyio's worker threads), else
    ``"asyncio"`` when an asyncio task runs. This says True only in that last
    case, cheaply; anything else (trio, a name set explicitly, no event loop)
    is left to anyio's own calls.
    """
    if _sniffio is not None and (
        _sniffio.thread_local.name is not None
        or _sniffio.current_async_library_cvar.get() is not None
    ):
        return False
    try:
        return asyncio.current_task() is not None
    except RuntimeError:  # no event loop running here
        return False


def interrupt_once(error: BaseException) -> BaseException:
    """What to raise for ``error``, a ``KeyboardInterrupt`` or ``SystemExit`` (or any
    other error) that a child task raised in a task group this task ran: ``error``,
    or a cancellation instead of an interrupt asyncio delivered already.

    On asyncio, a ``KeyboardInterrupt`` or ``SystemExit`` raised in a task-group
    child leaves the event loop at once (asyncio lets it out of ``run_forever``).
    ``asyncio.run`` (or ``anyio.run``) then cancels every task left, this one too,
    and runs the loop until they end. The same interrupt raised again from this
    task would leave the loop a second time, in the middle of that clean-up, and
    stop it there: what waits for the main task's end would never hear of it
    (anyio's worker threads are told to stop then), and the interpreter would wait
    for them at exit for ever. So while this task is being cancelled, the
    cancellation propagates instead (the interrupt is its ``__cause__``; whoever
    finalizes on a cancellation does so), and the caller gets the interrupt once,
    from ``asyncio.run`` (or ``anyio.run``). Anywhere else (trio, where the
    interrupt did not leave the loop; a task not being cancelled) it is ``error``.
    """
    if not isinstance(error, KeyboardInterrupt | SystemExit):
        return error
    try:  # not asyncio_here(): under anyio.run, sniffio names asyncio explicitly
        task = asyncio.current_task()
    except RuntimeError:  # no asyncio loop runs here (trio)
        return error
    if task is None or not task.cancelling():
        return error
    cancelled = asyncio.CancelledError(f"cancelled after {type(error).__name__} left the loop")
    cancelled.__cause__ = error
    return cancelled


async def checkpoint() -> None:
    """``anyio.lowlevel.checkpoint()``: on asyncio, ``asyncio.sleep(0)`` as anyio's
    asyncio backend does, without anyio asking sniffio which library runs; anywhere
    else anyio's own (see :func:`asyncio_here`)."""
    if asyncio_here():
        await asyncio.sleep(0)
    else:
        await anyio.lowlevel.checkpoint()


SCHEDULE_EVERY = 0.001
"""Seconds: how often :func:`light_checkpoint` lets other tasks run, at least."""

_last_scheduled = threading.local()  # .at: when this thread's light checkpoint last yielded


async def light_checkpoint() -> None:
    """A cancellation point every time, and a scheduling point (:func:`checkpoint`) when
    this thread's last light checkpoint that was one is :data:`SCHEDULE_EVERY` seconds
    old or more.

    For in-memory work that never blocks (the ``MemoryStore``): a cancellation lands
    before anything is done, as at any checkpoint, and a task that does nothing but
    such work still lets the other tasks of its loop run at least every millisecond,
    without paying a pass of the event loop on every call (a few microseconds each on a
    small virtual machine, more with many tasks in the loop; seven per in-memory agent
    step before).
    """
    now = time.monotonic()
    if now - getattr(_last_scheduled, "at", -SCHEDULE_EVERY) >= SCHEDULE_EVERY:
        _last_scheduled.at = now
        await checkpoint()
    else:
        await anyio.lowlevel.checkpoint_if_cancelled()


async def run_in_thread(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` in a worker thread, never left while ``function`` runs.

    On asyncio the thread is one of the stores' own (:mod:`._threads`, at most 40
    calls per event loop at once; its hop costs less than anyio's); elsewhere (trio) it is
    ``anyio.to_thread.run_sync``'s, under a limiter of the stores' own (40 at once, see
    :func:`_store_threads`). Either way ``function`` sees the caller's context variables.

    Cancellation, as anyio's hop: a cancellation before ``function`` is handed
    to a thread, or while it waits for a free one (40 calls of its loop
    running), raises with nothing done (or, when a thread took it in that very
    moment, once it ended: what it did stays done). Once a thread has it,
    anyio's own cancel scopes (trio's, asyncio's through anyio) wait for it:
    its outcome (return or exception) is handed back and the cancellation
    lands at the caller's next checkpoint.

    asyncio's native ``task.cancel()`` is not stopped by anyio's shield: it
    interrupts the wait at once. Then this waits for ``function`` to end
    (further native cancels while it waits are taken as the same one) and
    raises the ``CancelledError``: what ``function`` did stays done (for a
    store: a transaction that committed stays committed, as after a lost
    reply) and its result is dropped. So a caller holding a lock or a
    connection around the hop never lets it go while the thread still uses it.
    A cancel that lands before ``function`` starts (native, or anyio's while it
    waits for a thread) keeps it from starting.
    """
    if _running_library() != "asyncio":
        return await anyio.to_thread.run_sync(function, *args, limiter=_store_threads())
    await anyio.lowlevel.checkpoint_if_cancelled()  # cancelled already: nothing done
    loop = asyncio.get_running_loop()
    hop = _Hop(loop)
    future: asyncio.Future[T] = loop.create_future()
    call = (loop, future, _worker_context(), hop.run, (function, args))
    try:
        if POOL.submit(call):  # a thread has it: as anyio's hop, shielded
            with anyio.CancelScope(shield=True):
                result = await future
        else:  # waiting for a free thread: any cancellation drops it
            result = await future
    except asyncio.CancelledError:
        await hop.ended()  # not started: it never will; running: wait for its end
        raise
    return result


_STORE_THREADS: anyio.lowlevel.RunVar[anyio.CapacityLimiter] = anyio.lowlevel.RunVar(
    "stepmachine_store_threads"
)


def _store_threads() -> anyio.CapacityLimiter:
    """The stores' thread limiter of this event loop where they use anyio's threads (trio):
    40 at once, as on asyncio, and not anyio's default limiter, whose tokens the
    plain-function tools borrow (trio keeps the token of a tool left running until its
    thread ends: 40 such tools must not keep a store from writing what a cancelled run
    leaves)."""
    try:
        return _STORE_THREADS.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(MAX_PER_LOOP)
        _STORE_THREADS.set(limiter)
        return limiter


def _worker_context() -> contextvars.Context:
    """A copy of the caller's context variables for a worker thread, with sniffio's
    "which async library" variable cleared, as anyio's worker threads have it: code
    there runs in no async library, and may run an event loop of its own."""
    context = contextvars.copy_context()
    if _sniffio is not None:
        context.run(_sniffio.current_async_library_cvar.set, None)
    return context


def _running_library() -> str:
    """The async library running here, as anyio would name it (sniffio's answer)."""
    if _sniffio is None:  # pragma: no cover - anyio runs without it
        return "asyncio" if asyncio_here() else ""
    return _sniffio.current_async_library()


_WAITING, _RUNNING, _ENDED, _DROPPED = range(4)


class _Hop:
    """One :func:`run_in_thread` call on asyncio: where its function is (``state``,
    changed under ``lock`` by either side), and the future a cancelled caller waits on."""

    __slots__ = ("lock", "loop", "state", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.lock = threading.Lock()
        self.loop = loop
        self.state = _WAITING
        self.waiter: asyncio.Future[None] | None = None

    def run(self, function: Callable[..., T], args: tuple[Any, ...]) -> T:
        """In the worker thread: run ``function`` unless its caller was cancelled first."""
        with self.lock:
            if self.state == _DROPPED:
                raise asyncio.CancelledError  # nobody awaits it: never seen
            self.state = _RUNNING
        try:
            return function(*args)
        finally:
            with self.lock:
                self.state = _ENDED
                waiter = self.waiter
            if waiter is not None:
                self.loop.call_soon_threadsafe(_wake, waiter)

    async def ended(self) -> None:
        """In the cancelled caller: return once ``function`` ended or can no longer start."""
        with self.lock:
            if self.state == _WAITING:
                self.state = _DROPPED
            if self.state != _RUNNING:
                return
            waiter = self.waiter = self.loop.create_future()
        while not waiter.done():
            try:
                await asyncio.shield(waiter)
            except asyncio.CancelledError:
                continue  # cancelled again: the function still runs; the first cancel is raised


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
