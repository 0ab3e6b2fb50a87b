"""Attack 33: asyncio's native ``task.cancel()`` while a SQLiteStore call runs in its worker thread.

SQLiteStore's docs (class docstring, "Cancellation"): once a method's transaction
runs in the worker thread "it is not interrupted: the method returns (or raises)
exactly as it would have, and the cancellation is delivered at the caller's next
checkpoint". ``_run`` relies on ``anyio.to_thread.run_sync`` waiting for the thread;
that holds for anyio cancel scopes, but a native ``task.cancel()`` on asyncio
interrupts the ``await`` while the thread still runs the transaction. ``_run``'s
``async with self._lock`` is then left, so the next call runs on the same connection,
in another worker thread, while the first transaction is still open.

Found by a sweep of native cancels of a run with concurrent tools
(``tests/test_attack33_cancel.py``'s set-up): after some cancels the calls were left
open (finalize's writes failed) and the next ``load`` raised
``sqlite3.OperationalError: cannot start a transaction within a transaction``.
The tests here make the moment deterministic with the store's ``boundary_hook``
(``apply.begin``: inside the transaction, in the worker thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from stepmachine import (
    AppendMessage,
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    StateMachine,
    ToolContext,
    Tools,
    submit,
    tool,
)
from stepmachine.extend import INTERRUPTED
from stepmachine.stores import FileStore, SQLiteStore
from stepmachine.testing import FunctionModel, call, reply

pytestmark = pytest.mark.parametrize("anyio_backend", ["asyncio"])  # native cancellation


class Gate:
    """A boundary hook that holds the ``nth`` ``apply.begin`` (inside the transaction, in
    the worker thread) until ``go`` is set."""

    def __init__(self, nth: int, boundary: str = "apply.begin") -> None:
        self.nth = nth
        self.boundary = boundary
        self.seen = 0
        self.entered = threading.Event()
        self.go = threading.Event()

    def __call__(self, name: str) -> None:
        if name != self.boundary:
            return
        self.seen += 1
        if self.seen == self.nth:
            self.entered.set()
            self.go.wait(10)


async def open_gated(kind: str, tmp_path: Path, gate: Gate) -> SQLiteStore | FileStore:
    """A store whose worker thread ``gate`` holds inside the write of a batch (SQLite: in
    the transaction; FileStore: the record written to the log, its lock held)."""
    if kind == "sqlite":
        return await SQLiteStore.open(tmp_path / "db.sqlite3", boundary_hook=gate)
    gate.boundary = "apply.written"
    return await FileStore.open(tmp_path / "files", boundary_hook=gate)


stores = pytest.mark.parametrize("kind", ["sqlite", "file"])


@stores
async def test_a_natively_cancelled_apply_is_not_interrupted_in_its_worker_thread(
    tmp_path: Path, kind: str
) -> None:
    gate = Gate(nth=1)
    store = await open_gated(kind, tmp_path, gate)
    try:
        await store.create("s")
        task = asyncio.ensure_future(
            submit(store, "s", [AppendMessage(Message.user("hi", id="u1"))])
        )
        await anyio.to_thread.run_sync(gate.entered.wait, 10)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=0.5)
        still_running = not done  # the documented behaviour: it waits for the thread
        gate.go.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert still_running, "the apply returned (cancelled) while its transaction ran on"
    finally:
        gate.go.set()
        await store.aclose()


@stores
async def test_the_next_call_after_a_natively_cancelled_apply_works(
    tmp_path: Path, kind: str
) -> None:
    gate = Gate(nth=1)
    store = await open_gated(kind, tmp_path, gate)
    try:
        await store.create("s")
        task = asyncio.ensure_future(
            submit(store, "s", [AppendMessage(Message.user("hi", id="u1"))])
        )
        await anyio.to_thread.run_sync(gate.entered.wait, 10)
        task.cancel()
        await asyncio.wait([task], timeout=0.5)
        outcome: Any = None
        try:
            with anyio.fail_after(2):
                outcome = await store.load("s")  # waits for the store's lock, then reads
        except sqlite3.OperationalError as exc:
            outcome = exc
        except TimeoutError:
            outcome = "waited"  # the lock still held: as documented, the load waits
        finally:
            gate.go.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert not isinstance(outcome, sqlite3.OperationalError), outcome
        session = await store.load("s")
        assert [m.id for m in session.conversation] == ["u1"]  # the batch committed whole
    finally:
        gate.go.set()
        await store.aclose()


def answer(request: ModelRequest) -> ModelResponse:
    if request.messages[-1].role == "user":
        return call(("charge", {"n": 1}), ("charge", {"n": 2}))
    return reply("all done")


@stores
async def test_a_native_cancel_during_a_tools_record_still_finalizes(
    tmp_path: Path, kind: str
) -> None:
    # applies: 1 the model's reply, 2 the intents, 3 charge 1's record (held there)
    gate = Gate(nth=3)
    store = await open_gated(kind, tmp_path, gate)
    ran: list[int] = []

    async def charge(n: int, ctx: ToolContext) -> str:
        """Charge the card (not idempotent)."""
        ran.append(n)
        return f"charged {n}"

    try:
        await store.create("s", conversation=[Message.user("pay", id="u1")])
        tools = Tools(
            [tool(side_effects="non_idempotent", thread=False)(charge)], max_concurrency=1
        )
        machine = StateMachine([tools, ModelInference()])
        runtime = Runtime(store=store, model=FunctionModel(answer))
        task = asyncio.ensure_future(machine.run(runtime, "s"))
        await anyio.to_thread.run_sync(gate.entered.wait, 10)
        task.cancel()
        await asyncio.sleep(0.3)  # finalize runs meanwhile (the gate still holds the record)
        gate.go.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert ran == [1]
        session = await store.load("s")
        results = [str(r.content) for m in session.conversation for r in m.tool_results]
        # charge 1 took effect and is recorded; charge 2 never started: "interrupted"
        assert len(results) == 2, results
        assert results[0] == "charged 1"
        assert INTERRUPTED in results[1], results
        # what another instance reads from the same files is what this one returned
        other = await (
            SQLiteStore.open(tmp_path / "db.sqlite3")
            if kind == "sqlite"
            else FileStore.open(tmp_path / "files")
        )
        try:
            assert (await other.load("s")).conversation == session.conversation
        finally:
            await other.aclose()
    finally:
        gate.go.set()
        await store.aclose()
