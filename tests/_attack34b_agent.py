"""Attack 34b: the scripted agent every run path is compared on, and a hand-driven loop.

The model asks (per user message) for ``lookup`` (idempotent) and ``charge``
(non-idempotent, needs approval), then answers with the results. Side effects and
model requests are counted in files when ``ATTACK34B_DIR`` (or ``folder``) is given.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from stepmachine import (
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    Session,
    StateMachine,
    ToolContext,
    Tools,
    tool,
)
from stepmachine.extend import counter_ids
from stepmachine.operations import Approval, Budget, Limits
from stepmachine.testing import FunctionModel, call, reply


def journal(folder: Path | None, name: str, line: str) -> None:
    if folder is None:
        return
    with (folder / name).open("a") as handle:
        handle.write(line + "\n")
        handle.flush()
        os.fsync(handle.fileno())


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class Agent:
    """The tools and the model, with hooks a test (or a child) sets."""

    def __init__(self, folder: Path | None = None, *, approval: bool = True) -> None:
        self.folder = folder
        self.approval = approval
        self.requests = 0
        self.effects: list[str] = []
        self.on_charge_start: Any = None  # async hook, before the side effect
        self.on_charge_done: Any = None  # async hook, after the side effect, before returning
        self.on_model: Any = None  # sync hook, on each request (after it is counted)
        self.tool_calls_per_turn = 1

    async def charge(self, amount: int, ctx: ToolContext) -> str:
        """Charge the card (not idempotent)."""
        if self.on_charge_start is not None:
            await self.on_charge_start()
        self.effects.append(f"charge {ctx.idempotency_key}")
        journal(self.folder, "effects.txt", f"charge {ctx.idempotency_key}")
        if self.on_charge_done is not None:
            await self.on_charge_done()
        return f"charged {amount}"

    async def lookup(self, query: str, ctx: ToolContext) -> str:
        """Look something up (idempotent)."""
        self.effects.append(f"lookup {ctx.idempotency_key}")
        journal(self.folder, "effects.txt", f"lookup {ctx.idempotency_key}")
        return f"found {query}"

    def answer(self, request: ModelRequest) -> ModelResponse:
        self.requests += 1
        journal(self.folder, "requests.txt", f"request {self.requests}")
        if self.on_model is not None:
            self.on_model()
        last = request.messages[-1]
        if last.role == "user":
            return call(("lookup", {"query": last.text}))
        results = [r for m in request.messages for r in m.tool_results]
        names = [p.name for m in request.messages for p in m.tool_calls]
        if names.count("charge") < self.tool_calls_per_turn:
            return call(("charge", {"amount": len(results)}))
        return reply("done: " + ", ".join(str(r.content) for r in results))

    def machine(self, *, budget: int | None = None, lease: Any = ...) -> StateMachine[Any]:
        tools = Tools(
            [
                tool(side_effects="non_idempotent", thread=False)(self.charge),
                tool(side_effects="idempotent", thread=False)(self.lookup),
            ]
        )
        steps: list[Any] = []
        if budget is not None:
            steps.append(Budget(per_run=Limits(model_calls=budget)))
        if self.approval:
            steps.append(Approval({"charge"}))
        steps += [tools, ModelInference()]
        if lease is ...:
            return StateMachine(steps)
        return StateMachine(steps, lease=lease)

    def runtime(self, store: Any, *, fixed_ids: bool = True) -> Runtime:
        if not fixed_ids:  # a resumed process must not hand out the dead one's ids again
            return Runtime(store=store, model=FunctionModel(self.answer))
        return Runtime(
            store=store, model=FunctionModel(self.answer), clock=Clock(), ids=counter_ids("m")
        )


async def by_hand(
    machine: StateMachine[Any], runtime: Runtime, session_id: str
) -> tuple[Session[Any], str, list[str]]:
    """A run driven with ``step``/``apply`` as the docs say: the final session, the
    reason (``idle`` when no step applied) and the steps that applied."""
    session: Session[Any] = await runtime.session_loader().load(session_id)
    start = session.revision
    cycle = 0
    steps: list[str] = []
    async with machine.opened(runtime):
        while True:
            cycle += 1
            decision = await machine.step(runtime, session, cycle=cycle, run_start_revision=start)
            if decision is None:
                return session, "idle", steps
            session, result = await machine.apply(runtime, session, decision, cycle=cycle)
            steps.append(result.step)
            if result.reason is not None:
                return session, result.reason.kind, steps
