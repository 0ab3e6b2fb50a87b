"""Attack 33b: asyncio-native cancellation of ``machine.run()`` on SQLiteStore, after the fix
that makes ``_async.run_in_thread`` wait for its worker thread before raising.

A gate (the store's ``boundary_hook``, or a wrapper around the lock-file leases'
``_claim``/``_release``, both in the worker thread) holds the run at one point while
the test fires ``asyncio.timeout`` (rescheduled to now), ``asyncio.wait_for``, two
``task.cancel()``s, or a timeout and then an outside cancel. Checked each time: the
exception is the one asyncio promises (``TimeoutError`` for a timeout alone, a
``CancelledError`` when an outside cancel came too), the store still answers, the
history is valid, no tool ran twice, the lease is free (a ``busy="fail"`` run gets it)
and that next run completes.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest

from stepmachine import (
    LeasePolicy,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    StateMachine,
    ToolContext,
    Tools,
    tool,
)
from stepmachine.extend import history_problems
from stepmachine.stores import SQLiteStore
from stepmachine.testing import FunctionModel, call, reply

pytestmark = pytest.mark.parametrize("anyio_backend", ["asyncio"])  # native cancellation

RAN: list[str] = []


@tool(side_effects="idempotent")
def lookup(ctx: ToolContext, q: str) -> str:
    """Look something up."""
    RAN.append(ctx.call_id)
    return f"found {q}"


def answer(request: ModelRequest) -> ModelResponse:
    if request.messages[-1].role == "user":
        return call(("lookup", {"q": "a"}), ("lookup", {"q": "b"}))
    return reply("done")


MACHINE = StateMachine([Tools([lookup]), ModelInference()])


class Gate:
    """Holds the ``nth`` hit (counted over every name passed) until ``go`` is set."""

    def __init__(self, nth: int) -> None:
        self.nth = nth
        self.seen = 0
        self.names: list[str] = []
        self.entered = threading.Event()
        self.go = threading.Event()

    def __call__(self, name: str) -> None:
        self.seen += 1
        self.names.append(name)
        if self.seen == self.nth:
            self.entered.set()
            self.go.wait(20)


def gate_leases(store: SQLiteStore, gate: Gate) -> None:
    """Send the leases' claim and release (worker thread, meta lock held) through ``gate``."""
    leases: Any = store._open_leases()  # the attack needs the moment
    for name in ("_claim", "_release"):
        original = getattr(leases, name)

        def gated(*args: Any, _original: Callable[..., Any] = original, _n: str = name) -> Any:
            gate(f"leases.{_n}")
            return _original(*args)

        setattr(leases, name, gated)


async def open_gated(path: Path, gate: Gate) -> SQLiteStore:
    store = await SQLiteStore.open(path, boundary_hook=gate)
    gate_leases(store, gate)
    return store


async def hits_of_a_whole_run(tmp_path: Path) -> list[str]:
    gate = Gate(nth=10**9)
    async with await open_gated(tmp_path / "count.sqlite3", gate) as store:
        await store.create("s", conversation=[Message.user("go", id="u1")])
        gate.names.clear()
        await MACHINE.run(Runtime(store=store, model=FunctionModel(answer)), "s")
    return gate.names


async def check_after(store: SQLiteStore) -> None:
    session = await store.load("s")
    assert history_problems(session) == []
    report = await MACHINE.run_report(
        Runtime(store=store, model=FunctionModel(answer)), "s", lease=LeasePolicy(busy="fail")
    )
    assert report.reason.kind in ("done", "idle")
    session = await store.load("s")
    assert session.conversation[-1].text == "done"
    assert history_problems(session) == []
    results = Counter(r.call_id for m in session.conversation for r in m.tool_results)
    assert all(count == 1 for count in results.values()), results
    ran = Counter(RAN)
    assert all(count == 1 for count in ran.values()), ran


Fire = Callable[["asyncio.Task[Any]", list[asyncio.Timeout]], None]


async def attack(tmp_path: Path, nth: int, how: str) -> tuple[str, BaseException | None]:
    """Run with the gate at hit ``nth``; fire ``how`` while it holds; return the name of the
    hit and what the run raised."""
    RAN.clear()
    gate = Gate(nth)
    store = await open_gated(tmp_path / f"{how}-{nth}.sqlite3", gate)
    try:
        await store.create("s", conversation=[Message.user("go", id="u1")])
        gate.seen = 0
        gate.names.clear()
        timeouts: list[asyncio.Timeout] = []
        runtime = Runtime(store=store, model=FunctionModel(answer))

        async def run() -> None:
            if how == "wait_for":
                await asyncio.wait_for(MACHINE.run(runtime, "s"), 0.5)
                return
            async with asyncio.timeout(1000) as timeout:
                timeouts.append(timeout)
                await MACHINE.run(runtime, "s")

        task = asyncio.ensure_future(run())
        entered = await anyio.to_thread.run_sync(gate.entered.wait, 20)
        assert entered
        loop = asyncio.get_running_loop()
        if how == "timeout":
            timeouts[0].reschedule(loop.time())
        elif how == "wait_for":
            await asyncio.sleep(0.7)  # its 0.5 s run out while the gate holds
        elif how == "twice":
            task.cancel()
            await asyncio.sleep(0.05)
            task.cancel()
        elif how == "timeout_then_cancel":
            timeouts[0].reschedule(loop.time())
            await asyncio.sleep(0.05)
            task.cancel()
        await asyncio.sleep(0.1)
        gate.go.set()
        error: BaseException | None = None
        try:
            await asyncio.wait_for(asyncio.shield(task), 30)
        except BaseException as raised:
            error = raised
        gate.nth = 10**9
        await check_after(store)
        return gate.names[nth - 1], error
    finally:
        gate.go.set()
        await store.aclose()


async def test_asyncio_timeout_at_every_store_and_lease_hit_raises_timeout_error(
    tmp_path: Path,
) -> None:
    hits = await hits_of_a_whole_run(tmp_path)
    assert "leases._claim" in hits
    assert "leases._release" in hits
    assert len(hits) < 40
    for nth in range(1, len(hits) + 1):
        name, error = await attack(tmp_path, nth, "timeout")
        assert isinstance(error, TimeoutError), (nth, name, repr(error))


async def test_two_native_cancels_at_every_hit_raise_cancelled_error(tmp_path: Path) -> None:
    hits = await hits_of_a_whole_run(tmp_path)
    for nth in range(1, len(hits) + 1):
        name, error = await attack(tmp_path, nth, "twice")
        assert isinstance(error, asyncio.CancelledError), (nth, name, repr(error))


async def test_a_timeout_then_an_outside_cancel_raises_cancelled_error(tmp_path: Path) -> None:
    hits = await hits_of_a_whole_run(tmp_path)
    for nth in range(1, len(hits) + 1):
        name, error = await attack(tmp_path, nth, "timeout_then_cancel")
        assert isinstance(error, asyncio.CancelledError), (nth, name, repr(error))


async def test_asyncio_wait_for_at_every_third_hit_raises_timeout_error(tmp_path: Path) -> None:
    hits = await hits_of_a_whole_run(tmp_path)
    for nth in range(1, len(hits) + 1, 3):
        name, error = await attack(tmp_path, nth, "wait_for")
        assert isinstance(error, TimeoutError), (nth, name, repr(error))
