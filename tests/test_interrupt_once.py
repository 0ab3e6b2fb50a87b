"""An interrupt a child task raised is delivered once (``stepmachine._async.interrupt_once``).

On asyncio a ``KeyboardInterrupt`` raised in a task-group child leaves the event loop at
once; ``asyncio.run`` then cancels what is left and runs the loop until it ends. A run
that raised the same interrupt again from its own task, while being cancelled so, stopped
that clean-up half way: anyio's worker threads were never told to stop, and the process
hung at exit. These are the unit tests of the rule, on both backends; real processes
(concurrent tools, the lease's renewal task, asyncio.run and anyio.run, trio, a real
SIGINT) are in ``test_attack35_interrupts`` and ``test_attack34c_errorpath``.
"""

from __future__ import annotations

import asyncio

import pytest

from stepmachine._async import interrupt_once


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def on_asyncio(anyio_backend: str) -> bool:
    """Whether this test runs on asyncio (checked against what asyncio itself says: under
    anyio's runner, sniffio names the library explicitly)."""
    try:
        running = asyncio.current_task() is not None
    except RuntimeError:  # no asyncio loop here
        running = False
    assert running == (anyio_backend == "asyncio"), anyio_backend
    return running


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
async def test_an_interrupt_is_a_cancellation_while_the_task_is_cancelled_on_asyncio(
    kind: type[BaseException], anyio_backend: str
) -> None:
    """On asyncio, in a task being cancelled: a cancellation, the interrupt its cause.
    Under trio (where the interrupt never left the loop): the interrupt itself."""
    interrupt = kind()
    if not on_asyncio(anyio_backend):
        assert interrupt_once(interrupt) is interrupt
        return
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    try:
        got = interrupt_once(interrupt)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.sleep(0)  # the cancellation asked for above, taken here
    finally:
        task.uncancel()
    assert isinstance(got, asyncio.CancelledError)
    assert got.__cause__ is interrupt


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
async def test_an_interrupt_is_itself_in_a_task_not_being_cancelled(
    kind: type[BaseException],
) -> None:
    interrupt = kind()
    assert interrupt_once(interrupt) is interrupt


async def test_any_other_error_is_itself_even_while_cancelled(anyio_backend: str) -> None:
    error = RuntimeError("a tool's bug")
    if on_asyncio(anyio_backend):
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        try:
            assert interrupt_once(error) is error
            with pytest.raises(asyncio.CancelledError):
                await asyncio.sleep(0)
        finally:
            task.uncancel()
    else:
        assert interrupt_once(error) is error
