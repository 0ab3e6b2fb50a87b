"""Runtime lookups and id sources; step outcomes; CancelToken."""

from __future__ import annotations

import re
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import pytest
from structlog.testing import capture_logs

from stepmachine import (
    AppendMessage,
    CancelToken,
    ConfigurationError,
    Continue,
    Effect,
    Message,
    ModelInference,
    Operation,
    Outcome,
    Refuse,
    Runtime,
    Session,
    StateMachine,
    StepContext,
    StepContractError,
    ToolCallPart,
    ToolResultPart,
    Tools,
    Yield,
    tool,
)
from stepmachine.extend import YieldReason, counter_ids, uuid_ids
from stepmachine.stores import MemoryStore
from stepmachine.testing import ScriptedModel, call, reply

# -- Runtime ----------------------------------------------------------------------------------


def test_get_model_without_a_model_names_what_is_missing() -> None:
    with pytest.raises(ConfigurationError, match=r"no model.*Runtime\(model=") as excinfo:
        Runtime().get_model()
    assert "model" in str(excinfo.value)


def test_get_model_unknown_name_lists_the_known_ones() -> None:
    runtime = Runtime(models={"b": ScriptedModel([]), "a": ScriptedModel([])})
    with pytest.raises(ConfigurationError) as excinfo:
        runtime.get_model("missing")
    assert "'missing'" in str(excinfo.value)
    assert "['a', 'b']" in str(excinfo.value)
    # a default model does not stand in for a named one
    with pytest.raises(ConfigurationError, match="'x'"):
        Runtime(model=ScriptedModel([])).get_model("x")


def test_get_model_returns_default_and_named() -> None:
    default, named = ScriptedModel([]), ScriptedModel([])
    runtime = Runtime(model=default, models={"n": named})
    assert runtime.get_model() is default
    assert runtime.get_model(None) is default
    assert runtime.get_model("n") is named


def test_session_loader_and_effect_handler_missing() -> None:
    with pytest.raises(ConfigurationError, match="loader"):
        Runtime().session_loader()
    with pytest.raises(ConfigurationError, match="effect handler"):
        Runtime().effect_handler()
    # a loader alone is no handler, and the other way round
    store = MemoryStore()
    with pytest.raises(ConfigurationError, match="effect handler"):
        Runtime(loader=store).effect_handler()
    with pytest.raises(ConfigurationError, match="loader"):
        Runtime(handler=store).session_loader()


def test_store_serves_as_both_and_overrides_win() -> None:
    store, loader, handler = MemoryStore(), MemoryStore(), MemoryStore()
    assert Runtime(store=store).session_loader() is store
    assert Runtime(store=store).effect_handler() is store
    runtime = Runtime(store=store, loader=loader, handler=handler)
    assert runtime.session_loader() is loader
    assert runtime.effect_handler() is handler


class EmptyLoader:
    """A loader that happens to be falsy (it has a length, and it is empty)."""

    def __len__(self) -> int:
        return 0

    async def load(self, session_id: str) -> Session[Any]:
        raise NotImplementedError


def test_a_falsy_loader_is_still_used() -> None:
    loader = EmptyLoader()
    assert Runtime(loader=loader).session_loader() is loader  # type: ignore[arg-type]


def test_runtime_defaults() -> None:
    runtime = Runtime()
    assert isinstance(runtime.clock(), float)
    assert runtime.services == {}
    assert runtime.models == {}
    assert runtime.http is None


def test_counter_ids() -> None:
    ids = counter_ids()
    assert [ids() for _ in range(3)] == ["m1", "m2", "m3"]
    other = counter_ids("x-")
    assert [other(), other()] == ["x-1", "x-2"]
    assert ids() == "m4"  # each source keeps its own count


def test_uuid_ids_are_hex_and_unique() -> None:
    made = {uuid_ids() for _ in range(200)}
    assert len(made) == 200
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in made)


def test_uuid_ids_are_version_4_uuids() -> None:
    """The same shape ``uuid.uuid4().hex`` gives: version 4, the RFC 4122 variant."""
    import uuid

    for made in (uuid_ids() for _ in range(200)):
        parsed = uuid.UUID(made)
        assert parsed.version == 4
        assert parsed.variant == uuid.RFC_4122
        assert parsed.hex == made


def test_the_deprecated_context_fields_warn_only_when_code_reads_them() -> None:
    import dataclasses

    from stepmachine._emitter import EventSink
    from stepmachine.extend import NullEmitter
    from stepmachine.testing import make_session

    step = ModelInference()
    ctx: StepContext[Any] = StepContext(
        session=make_session(),
        runtime=Runtime(),
        events=EventSink(NullEmitter(), "s", 0),
        scratch={"kept": 1},
        steps=(step,),
    )
    copy = dataclasses.replace(ctx, cycle=2)  # the machine's own copies do not warn
    assert "kept" in repr(copy)
    assert copy != ctx
    with pytest.warns(DeprecationWarning, match="StepContext.scratch is deprecated") as caught:
        assert copy.scratch == {"kept": 1}
    with pytest.warns(DeprecationWarning, match="StepContext.steps is deprecated"):
        assert copy.steps == (step,)
    assert caught[0].filename == __file__  # the warning points at the reader


def test_step_context_new_id_uses_the_runtime() -> None:
    from stepmachine._emitter import EventSink
    from stepmachine.extend import NullEmitter
    from stepmachine.testing import make_session

    ctx: StepContext[Any] = StepContext(
        session=make_session(),
        runtime=Runtime(ids=counter_ids("q")),
        events=EventSink(NullEmitter(), "s", 0),
    )
    assert [ctx.new_id(), ctx.new_id()] == ["q1", "q2"]
    assert ctx.cycle == 0
    with pytest.warns(DeprecationWarning, match="StepContext.scratch is deprecated"):
        assert ctx.scratch == {}
    assert (ctx.tools, ctx.prompt_parts) == ((), ())


# -- outcomes ---------------------------------------------------------------------------------


def effect(n: int) -> Effect:
    return AppendMessage(Message.user(str(n), id=f"m{n}"))


def test_yield_accepts_a_str_reason() -> None:
    outcome = Yield([], "awaiting_approval")
    assert outcome.reason == YieldReason("awaiting_approval")
    assert outcome.reason.kind == YieldReason.AWAITING_APPROVAL
    assert outcome.reason.message == ""
    assert outcome.reason.data == {}
    reason = YieldReason("custom", "for people", {"ids": ["c1"]})
    assert Yield([], reason).reason is reason


def test_continue_and_yield_copy_effects_to_tuples() -> None:
    effects = [effect(1), effect(2)]
    cont = Continue(effects)
    yld = Yield(effects, "done")
    effects.append(effect(3))
    assert cont.effects == (effect(1), effect(2))
    assert yld.effects == (effect(1), effect(2))
    assert isinstance(cont.effects, tuple)
    assert isinstance(yld.effects, tuple)
    assert Continue(e for e in [effect(4)]).effects == (effect(4),)  # type: ignore[arg-type]


def test_outcomes_are_frozen() -> None:
    from dataclasses import FrozenInstanceError

    with pytest.raises(FrozenInstanceError):
        Continue([]).effects = ()  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        Refuse("x").why = "y"  # type: ignore[misc]
    assert Refuse().why == ""


def test_yield_reason_constants() -> None:
    assert (
        YieldReason.DONE,
        YieldReason.AWAITING_APPROVAL,
        YieldReason.AWAITING_EVENT,
        YieldReason.BUDGET_EXHAUSTED,
        YieldReason.IDLE,
        YieldReason.CANCELLED,
        YieldReason.CALL_HELD,
        YieldReason.CYCLE_LIMIT,
    ) == (
        "done",
        "awaiting_approval",
        "awaiting_event",
        "budget_exhausted",
        "idle",
        "cancelled",
        "call_held",
        "cycle_limit",
    )


# -- CancelToken --------------------------------------------------------------------------------


async def test_cancel_token_cancels_a_bound_scope() -> None:
    token = CancelToken()
    reached: list[str] = []
    with anyio.CancelScope() as scope:
        token.bind(scope)
        assert not scope.cancel_called
        token.cancel("stop now")
        assert scope.cancel_called
        await anyio.sleep_forever()
        reached.append("after")  # pragma: no cover
    assert reached == []
    assert scope.cancelled_caught
    assert token.cancelled
    assert token.reason == "stop now"


async def test_cancel_is_idempotent_and_keeps_the_first_reason() -> None:
    token = CancelToken()
    assert not token.cancelled
    token.cancel("first")
    token.cancel("second")
    assert token.cancelled
    assert token.reason == "first"


async def test_bind_after_cancel_cancels_at_once() -> None:
    token = CancelToken()
    token.cancel()
    with anyio.CancelScope() as scope:
        token.bind(scope)
        assert scope.cancel_called
        await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert token.reason == "cancelled"


async def test_unbound_scope_is_not_cancelled() -> None:
    token = CancelToken()
    with anyio.CancelScope() as scope:
        token.bind(scope)
        token.unbind(scope)
        token.cancel()
        await anyio.lowlevel.checkpoint()
    assert not scope.cancel_called
    token.unbind(scope)  # unbinding twice is harmless


async def test_cancel_cancels_every_bound_scope() -> None:
    token = CancelToken()
    scopes = [anyio.CancelScope() for _ in range(3)]
    for scope in scopes:
        token.bind(scope)
    token.cancel()
    assert all(scope.cancel_called for scope in scopes)


async def test_wait_returns_once_cancelled() -> None:
    token = CancelToken()
    order: list[str] = []

    async def waiter(name: str) -> None:
        await token.wait()
        order.append(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, "a")
        tg.start_soon(waiter, "b")
        await anyio.wait_all_tasks_blocked()
        assert order == []
        token.cancel()
    assert sorted(order) == ["a", "b"]
    assert token._waiters == set()  # waiters clean up after themselves
    # already cancelled: wait returns at once
    await token.wait()


async def test_wait_is_cancellable_and_cleans_up() -> None:
    token = CancelToken()
    with anyio.CancelScope() as scope:
        scope.cancel()
        await token.wait()
    assert scope.cancelled_caught
    assert token._waiters == set()
    assert not token.cancelled


# -- Runtime.tool_caller (untested elsewhere) ----------------------------------------------------


@tool
def must_not_run(a: int, b: int) -> int:
    """A tool the caller stands in for."""
    raise AssertionError("the tool ran although a tool_caller answers its calls")


async def run_with_caller(caller: Any) -> tuple[Any, list[Any]]:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    model = ScriptedModel([call(("must_not_run", {"a": 2, "b": 3})), reply("5")])
    runtime = Runtime(store=store, model=model, tool_caller=caller)
    machine = StateMachine([Tools([must_not_run]), ModelInference()], max_cycles=10)
    with capture_logs() as captured:
        report = await machine.run_report(runtime, "s")
    return report, captured


async def test_a_tool_caller_answers_the_call_and_is_reported() -> None:
    async def caller(part: ToolCallPart, context: Any) -> ToolResultPart:
        return ToolResultPart.for_call(part, "5")

    report, captured = await run_with_caller(caller)
    assert report.reason.kind == "done"
    assert report.session.conversation[2].tool_results[0].content == "5"
    assert [e["outcome"] for e in captured if e["event"] == "tool_call"] == ["recorded"]


async def test_a_tool_callers_result_for_another_call_is_an_error_not_a_phantom_crash() -> None:
    async def caller(part: ToolCallPart, context: Any) -> ToolResultPart:
        return ToolResultPart.for_call(msgspec.structs.replace(part, call_id="other"), "5")

    from stepmachine import StepContractError

    with capture_logs() as captured, pytest.raises(StepContractError, match="other"):
        await run_with_caller(caller)
    assert not [e for e in captured if e["event"] == "journal"]


async def test_a_tool_caller_returning_text_is_a_clear_error() -> None:
    async def caller(part: ToolCallPart, context: Any) -> Any:
        return "5"

    from stepmachine import StepContractError

    with pytest.raises(StepContractError, match="ToolResultPart"):
        await run_with_caller(caller)


# -- at the edges, as a user meets them ----------------------------------------


class _ContinuesWithAString(Operation[Any]):
    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Continue(["not an effect"])  # type: ignore[list-item]


class _YieldsANumber(Operation[Any]):
    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Yield([], 42)  # type: ignore[arg-type]


async def test_a_step_continuing_with_a_non_effect_gets_a_clear_error() -> None:
    store = MemoryStore()
    await store.create("s1", conversation=[Message.user("hi", id="u1")])
    with pytest.raises(StepContractError, match=r"_ContinuesWithAString.*not an effect"):
        await StateMachine([_ContinuesWithAString()]).run(Runtime(store=store), "s1")
    assert (await store.load("s1")).revision == 0


async def test_a_step_yielding_a_reason_that_is_not_a_string_gets_a_clear_error() -> None:
    store = MemoryStore()
    await store.create("s1", conversation=[Message.user("hi", id="u1")])
    with pytest.raises(StepContractError, match=r"_YieldsANumber.*42"):
        await StateMachine([_YieldsANumber()]).run(Runtime(store=store), "s1")


class _ReadsDeprecatedContext(Operation[Any]):
    async def run(self, ctx: StepContext[Any]) -> Outcome:
        ctx.scratch["seen"] = len(ctx.steps)
        return Yield([], "read")


async def test_the_deprecated_context_fields_warn_when_read() -> None:
    store = MemoryStore()
    await store.create("s1", conversation=[Message.user("hi", id="u1")])
    with pytest.warns(DeprecationWarning, match="scratch|steps") as caught:
        report = await StateMachine([_ReadsDeprecatedContext()]).run_report(
            Runtime(store=store), "s1"
        )
    assert report.reason.kind == "read"  # still works
    messages = " ".join(str(warning.message) for warning in caught)
    assert "scratch" in messages
    assert "steps" in messages
