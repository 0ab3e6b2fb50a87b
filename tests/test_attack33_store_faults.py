"""Attack 33: a store that fails once, with an ``OSError``, at each of its calls in turn.

One turn: the model asks for two non-idempotent ``charge`` calls and one idempotent
``lookup``, run concurrently (``max_concurrency=3``), then answers. A proxy in front
of a real store raises ``OSError`` at its k-th call, for every k of a clean run's
calls: either instead of the call (``before``: nothing reached the store) or after it
(``after``: the store did it, its reply was lost). Then the session is run again on the
healthy store (``busy="fail"``: a lease left held by the faulty run would show as
busy) until it ends. Checked: no charge took effect twice, every call has exactly one
result, the turn ends on the model's answer, the history is valid; and with the fault
``before`` the store (nothing stored that the run did not know of), a charge that took
effect is answered by its real result, never "outcome unknown". (A claim's lost reply
is left out: documented, see the test.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
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
from stepmachine._lease import Lease
from stepmachine.extend import OUTCOME_UNKNOWN, history_problems
from stepmachine.stores import MemoryStore, SQLiteStore
from stepmachine.testing import FunctionModel, call, reply


class Faulty:
    """Forwards to ``inner``; the ``fail_at``-th async call (0-based) raises ``OSError``,
    before or after it reached ``inner``. ``calls`` names every async call."""

    leases_expire: bool = False

    def __init__(self, inner: Any, fail_at: int = -1, when: str = "before") -> None:
        self.inner = inner
        self.leases_expire = inner.leases_expire
        self.fail_at = fail_at
        self.when = when
        self.calls: list[str] = []

    async def apply(self, batch: Any, *, lease: Lease | None = None) -> Any:
        return await self.__getattr__("apply")(batch, lease=lease)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if not callable(value) or name.startswith("_"):
            return value

        async def forwarded(*args: Any, **kwargs: Any) -> Any:
            index = len(self.calls)
            self.calls.append(name)
            if index == self.fail_at and self.when == "before":
                raise OSError(f"injected before {name} (call {index})")
            result = await value(*args, **kwargs)
            if index == self.fail_at:
                raise OSError(f"injected after {name} (call {index})")
            return result

        return forwarded


def answer(request: ModelRequest) -> ModelResponse:
    if request.messages[-1].role == "user":
        return call(("charge", {"n": 1}), ("charge", {"n": 2}), ("lookup", {}))
    return reply("all done")


def make_tools(effects: list[str]) -> Tools:
    async def charge(n: int, ctx: ToolContext) -> str:
        """Charge the card (not idempotent)."""
        await anyio.sleep(0.001 * n)
        effects.append(f"charge {ctx.idempotency_key}")
        return f"charged {n}"

    async def lookup(ctx: ToolContext) -> str:
        """Look it up (idempotent)."""
        effects.append(f"lookup {ctx.idempotency_key}")
        return "found"

    return Tools(
        [
            tool(side_effects="non_idempotent", thread=False)(charge),
            tool(side_effects="idempotent", thread=False)(lookup),
        ],
        max_concurrency=3,
    )


async def open_inner(kind: str, tmp_path: Path, n: int) -> Any:
    if kind == "sqlite":
        return await SQLiteStore.open(tmp_path / f"db{n}.sqlite3")
    return MemoryStore()


async def scenario(
    kind: str, tmp_path: Path, n: int, fail_at: int, when: str
) -> tuple[Faulty, tuple[Message, ...], list[str], str]:
    inner = await open_inner(kind, tmp_path, n)
    try:
        await inner.create("s", conversation=[Message.user("pay both", id="u1")])
        effects: list[str] = []
        machine = StateMachine([make_tools(effects), ModelInference()])
        store = Faulty(inner, fail_at, when)
        runtime = Runtime(store=store, model=FunctionModel(answer))
        first = "returned"
        try:
            with anyio.fail_after(30):
                await machine.run(runtime, "s")
        except OSError as exc:
            first = f"raised {exc}"
        store.fail_at = -1
        for _ in range(3):
            session = await inner.load("s")
            if session.conversation[-1].text == "all done":
                break
            with anyio.fail_after(30):
                await machine.run(runtime, "s", lease=LeasePolicy(busy="fail"))
        session = await inner.load("s")
        return store, tuple(session.conversation), effects, first
    finally:
        await inner.aclose()


def check(conversation: tuple[Message, ...], effects: list[str], when: str, first: str) -> None:
    counted = Counter(effects)
    charges = [e for e in effects if e.startswith("charge")]
    assert all(counted[e] == 1 for e in charges), (first, counted)
    assert not history_problems(conversation), (first, history_problems(conversation))
    calls = [p for m in conversation for p in m.tool_calls]
    results = [r for m in conversation for r in m.tool_results]
    assert len(calls) == 3, (first, calls)
    assert sorted(r.call_id for r in results) == sorted(c.call_id for c in calls), first
    assert conversation[-1].text == "all done", (first, conversation[-1])
    if when == "before":
        unknown = [r for r in results if OUTCOME_UNKNOWN in str(r.content)]
        assert not unknown, (first, unknown)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
@pytest.mark.parametrize("when", ["before", "after"])
async def test_one_os_error_at_each_store_call_loses_and_repeats_nothing(
    kind: str, when: str, tmp_path: Path
) -> None:
    clean, conversation, effects, first = await scenario(kind, tmp_path, 0, -1, when)
    check(conversation, effects, "before", first)
    total = len(clean.calls)
    assert total >= 8, clean.calls  # claim, load, batches, renewals, release
    failures: list[str] = []
    for k in range(total):
        if when == "after" and clean.calls[k] == "claim":
            # Documented (``_hold.claim_once``): an Exception from the claim propagates as
            # is; a claim that took effect anyway lapses with its ttl (PostgreSQL). These
            # in-process stores cannot lose a claim's reply, and never lapse.
            continue
        try:
            _, conversation, effects, first = await scenario(kind, tmp_path, k + 1, k, when)
            check(conversation, effects, when, first)
        except Exception as exc:  # every fault point is reported
            failures.append(f"fault at call {k} ({clean.calls[k]}): {exc!r}"[:600])
    assert not failures, "\n".join(failures)


_: Callable[..., Any] = scenario
