"""Attack 33: cancelling a run while several concurrent tools run.

One turn: the model asks for ``charge`` 1 (returns at once), ``charge`` 2 (returns after
a short while) and ``lookup`` (idempotent, at once), run concurrently (native cancels
on a FileStore, anyio's on SQLite); then it answers. The run is cancelled after ``k``
event-loop iterations, for every ``k`` up to past the end of the run:

* natively (asyncio): ``task.cancel()`` once, and twice (a second cancel while the first
  one's finalize runs, as a second Ctrl-C, or a ``wait_for`` timeout inside a cancelled
  task, would do);
* through anyio (both backends): a cancel scope.

Checked: no charge took effect twice; a charge that took effect is answered with its
real result when its record could be written (a single cancel: finalize writes a held
result), and never with a real result when it did not take effect; every call has
one result; the lease is free afterwards (a ``busy="fail"`` run gets it); and the next
run finishes the turn.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
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
from stepmachine.extend import INTERRUPTED, OUTCOME_UNKNOWN, history_problems, idempotency_key
from stepmachine.stores import FileStore, SQLiteStore
from stepmachine.testing import FunctionModel, call, reply


def answer(request: ModelRequest) -> ModelResponse:
    if request.messages[-1].role == "user":
        return call(("charge", {"n": 1}), ("charge", {"n": 2}), ("lookup", {}))
    return reply("all done")


class Effects:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def tools(self) -> Tools:
        async def charge(n: int, ctx: ToolContext) -> str:
            """Charge the card (not idempotent)."""
            if n == 2:
                await anyio.sleep(0.01)
            self.lines.append(ctx.idempotency_key)  # took effect: no checkpoint after it
            return f"charged {n}"

        async def lookup() -> str:
            """Look it up (idempotent)."""
            return "found"

        return Tools(
            [
                tool(side_effects="non_idempotent", thread=False)(charge),
                tool(side_effects="idempotent", thread=False)(lookup),
            ],
            max_concurrency=3,
        )


def outcomes(conversation: tuple[Message, ...], done: list[str]) -> list[str]:
    results = {r.call_id: str(r.content) for m in conversation for r in m.tool_results}
    seen = []
    for message in conversation:
        for part in message.tool_calls:
            if part.name != "charge":
                continue
            text = results.get(part.call_id)
            ran = idempotency_key("s", part.call_id, message.id) in done
            if text is None:
                state = "open"
            elif text.startswith("charged"):
                state = "real"
            elif OUTCOME_UNKNOWN in text:
                state = "unknown"
            elif INTERRUPTED in text:
                state = "interrupted"
            else:
                state = "other"
            seen.append(f"{state}/{'ran' if ran else 'not-run'}")
    return seen


async def after_the_cut(
    store: Any, machine: StateMachine[Any], effects: Effects, strict: bool, what: str
) -> None:
    """The checks after a cancelled run (see the module docs)."""
    session = await store.load("s")
    conversation = tuple(session.conversation)
    cut = outcomes(conversation, effects.lines)
    assert not any(o.startswith("real/not-run") for o in cut), (what, cut)
    if strict:  # a finished charge's result is held; finalize writes it
        assert not any(o in ("interrupted/ran", "unknown/ran") for o in cut), (what, cut)
    runtime = Runtime(store=store, model=FunctionModel(answer))
    with anyio.fail_after(20):
        await machine.run(runtime, "s", lease=LeasePolicy(busy="fail"))
    session = await store.load("s")
    conversation = tuple(session.conversation)
    assert conversation[-1].text == "all done", (what, conversation[-1])
    assert not history_problems(conversation), what
    assert all(n == 1 for n in Counter(effects.lines).values()), (what, effects.lines)
    calls = [p.call_id for m in conversation for p in m.tool_calls]
    answered = [r.call_id for m in conversation for r in m.tool_results]
    assert sorted(calls) == sorted(answered), what
    final = outcomes(conversation, effects.lines)
    assert not any(o.startswith("real/not-run") for o in final), (what, final)


async def fresh(tmp_path: Path, k: int, tag: str, kind: str = "sqlite") -> Any:
    # Under native cancels both stores once let go of a connection or a log's descriptor
    # while their worker thread still wrote (tests/test_attack33_native_cancel.py); on
    # FileStore this sweep failed about half of its runs under load.
    if kind == "file":
        store: Any = await FileStore.open(tmp_path / f"{tag}{k}")
    else:
        store = await SQLiteStore.open(tmp_path / f"{tag}{k}.sqlite3")
    await store.create("s", conversation=[Message.user("pay", id="u1")])
    return store


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("kind", ["file", "sqlite"])
@pytest.mark.parametrize("cancels", [1, 2])
async def test_native_task_cancel_at_every_iteration(
    tmp_path: Path, cancels: int, kind: str
) -> None:
    finished_at = None
    failures: list[str] = []
    for k in range(0, 20000, 41):
        store = await fresh(tmp_path, k, "n", kind)
        try:
            effects = Effects()
            machine = StateMachine([effects.tools(), ModelInference()])
            runtime = Runtime(store=store, model=FunctionModel(answer))
            task = asyncio.ensure_future(machine.run(runtime, "s"))
            for _ in range(k):
                await asyncio.sleep(0)
                if task.done():
                    break
            if task.done():
                finished_at = k
                task.result()
                break
            task.cancel()
            if cancels == 2:
                for _ in range(2):
                    await asyncio.sleep(0)
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            try:
                await after_the_cut(store, machine, effects, cancels == 1, f"k={k}")
            except (AssertionError, Exception) as exc:
                failures.append(f"k={k}: {exc!r}"[:500])
        finally:
            await store.aclose()
    assert finished_at is not None  # the sweep reached past the end of the run
    assert not failures, "\n".join(failures)


async def test_anyio_cancel_scope_at_every_iteration(tmp_path: Path) -> None:
    finished = False
    failures: list[str] = []
    for k in range(0, 20000, 41):
        store = await fresh(tmp_path, k, "a")
        try:
            effects = Effects()
            machine = StateMachine([effects.tools(), ModelInference()])
            runtime = Runtime(store=store, model=FunctionModel(answer))
            done = False
            with anyio.CancelScope() as scope:

                async def cut(k: int = k) -> None:
                    for _ in range(k):
                        await anyio.lowlevel.checkpoint()
                    scope.cancel()

                async with anyio.create_task_group() as group:
                    group.start_soon(cut)
                    await machine.run(runtime, "s")
                    done = True
                    group.cancel_scope.cancel()
            if done:
                finished = True
                break
            try:
                await after_the_cut(store, machine, effects, True, f"k={k}")
            except Exception as exc:
                failures.append(f"k={k}: {exc!r}"[:500])
        finally:
            await store.aclose()
    assert finished
    assert not failures, "\n".join(failures)
