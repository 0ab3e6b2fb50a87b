"""A step whose ``run`` is not async is a contract error naming it (issue 22).

The machine and the one-step harness check what calling ``run(ctx)`` returned
before awaiting it: a plain ``def run`` (or one written with ``yield``) is a
``StepContractError`` naming the step and saying to make ``run`` an
``async def``, not a ``TypeError`` from inside the ``await``; nothing is
written for the cycle.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Generator, Iterator
from typing import Any

import anyio
import pytest

from stepmachine import (
    Continue,
    Message,
    ModelInference,
    Refuse,
    Runtime,
    StateMachine,
    StepContractError,
)
from stepmachine.stores import MemoryStore
from stepmachine.testing import ScriptedModel, make_session, reply, run_step


class PlainRefuse:
    name = "plain_refuse"

    def run(self, ctx: Any) -> Any:
        return Refuse("not now")


class PlainContinue:
    name = "plain_continue"

    def run(self, ctx: Any) -> Any:
        return Continue(())


class Generating:
    name = "generating"

    def __init__(self) -> None:
        self.made: list[Generator[Any, None, None]] = []

    def run(self, ctx: Any) -> Iterator[Any]:
        made = self._gen()
        self.made.append(made)
        return made

    def _gen(self) -> Generator[Any, None, None]:
        yield Refuse("never")


class AsyncOnPurpose:
    """A plain def returning a coroutine: awaitable, so it is a working step."""

    name = "async_on_purpose"

    def run(self, ctx: Any) -> Any:
        return self._run(ctx)

    async def _run(self, ctx: Any) -> Any:
        return Refuse("not mine")


@pytest.mark.parametrize("step", [PlainRefuse, PlainContinue], ids=["refuse", "continue"])
async def test_the_machine_names_a_plain_def_run_and_writes_nothing(step: Any) -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    model = ScriptedModel([reply("x")])
    instance = step()
    with anyio.fail_after(10), pytest.raises(StepContractError) as caught:
        await StateMachine([instance, ModelInference()]).run(Runtime(store=store, model=model), "s")
    text = str(caught.value)
    assert repr(instance.name) in text
    assert "async def" in text
    assert type(instance.run(None)).__name__ in text
    after = await store.load("s")
    assert after.revision == 0
    assert model.requests == []


async def test_a_generator_run_is_closed_and_named() -> None:
    step = Generating()
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    with anyio.fail_after(10), pytest.raises(StepContractError, match=r"generating.*async def"):
        await StateMachine([step, ModelInference()]).run(
            Runtime(store=store, model=ScriptedModel([reply("x")])), "s"
        )
    [made] = step.made
    assert inspect.getgeneratorstate(made) == inspect.GEN_CLOSED


async def test_a_plain_def_returning_a_coroutine_still_works() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no coroutine left unawaited
        with anyio.fail_after(10):
            session = await StateMachine([AsyncOnPurpose(), ModelInference()]).run(
                Runtime(store=store, model=ScriptedModel([reply("done")])), "s"
            )
    assert session.conversation[-1].text == "done"


async def test_run_step_names_a_plain_def_run() -> None:
    with pytest.raises(StepContractError) as caught:
        await run_step(PlainRefuse(), make_session())
    assert "'plain_refuse'" in str(caught.value)
    assert "async def" in str(caught.value)


# -- a careless run() in a machine with other steps -----------------------------------


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
