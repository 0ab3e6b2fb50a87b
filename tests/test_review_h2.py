"""Outside review of the "Hardening 2" fixes: attempts to break them with real faults.

Each test states the right behaviour. A test that passes records what held; a
strict xfail records a defect (its reason says what happens and what should).
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from stepmachine import (
    ImagePart,
    Message,
    ModelInference,
    Refuse,
    Runtime,
    StateMachine,
    StepContractError,
    ToolOutput,
    ToolResultPart,
    Tools,
    tool,
)
from stepmachine.stores import MemoryStore
from stepmachine.testing import FunctionModel, ScriptedModel, call, reply

# -- a step's contract: a careless run() -----------------------------------------------


async def test_a_sync_run_is_a_step_contract_error_naming_the_step() -> None:
    class Careless:
        name = "careless"

        def run(self, ctx: Any) -> Any:
            return Refuse("not now")

    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    with anyio.fail_after(10), pytest.raises(StepContractError) as caught:
        await StateMachine([Careless(), ModelInference()]).run(
            Runtime(store=store, model=ScriptedModel([reply("x")])), "s"
        )
    assert "careless" in str(caught.value)
    assert "async" in str(caught.value)


# -- an oversized tool image in a parallel batch ---------------------------------------


async def test_one_oversized_image_in_a_parallel_batch_spares_the_others() -> None:
    """Two pure calls in one batch, one returns an image past max_media_bytes: that one
    is an error result naming size and limit, the other keeps its image, the turn ends."""
    store = MemoryStore(max_media_bytes=10_000)
    await store.create("s", conversation=[Message.user("draw", id="u1")])

    async def draw(size: int) -> ToolOutput:
        """Draw (pure)."""
        data = b"\x89PNG\r\n\x1a\n" + b"\0" * size
        return ToolOutput("drawn", (ImagePart(media_type="image/png", data=data),))

    def answer(request: Any) -> Any:
        if request.messages[-1].role == "user":
            return call(("draw", {"size": 100}), ("draw", {"size": 50_000}))
        return reply("done")

    machine = StateMachine([Tools([tool(side_effects="pure")(draw)]), ModelInference()])
    with anyio.fail_after(30):
        session = await machine.run(Runtime(store=store, model=FunctionModel(answer)), "s")
    results = [p for m in session.conversation for p in m.parts if isinstance(p, ToolResultPart)]
    assert len(results) == 2
    big = [r for r in results if r.is_error]
    assert len(big) == 1
    assert "10,000" in str(big[0].content) or "10000" in str(big[0].content)
    images = [p for m in session.conversation for p in m.parts if isinstance(p, ImagePart)]
    assert len(images) == 1
    assert session.conversation[-1].text == "done"
