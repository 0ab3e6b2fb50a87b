"""Steps are a name and ``run``; everything else is a capability the machine asks for them.

* a user's step with only ``name`` and ``run`` (no base class) runs in a
  machine and in the step harness;
* the machine sorts its steps by capability once; steps without one are never
  asked (the hook defaults of ``Operation`` are no capability);
* hooks are asked in step order: tools and prompt parts, request shapers, call
  vetters (the first objection wins), whatever the position of the asking step;
* a vetting step listed after the tools step still holds calls back;
* ``HistoryGuard`` leaves a call of an unknown tool to any step that answers
  such calls, not only to a ``Tools`` instance;
* side requests (``purpose`` other than ``"turn"``) keep their content.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepmachine import (
    AppendMessage,
    CancelToken,
    Continue,
    Effect,
    Message,
    ModelInference,
    ModelRequest,
    ModelSettings,
    NoData,
    Operation,
    Outcome,
    PromptPart,
    Refuse,
    Runtime,
    StateMachine,
    Step,
    StepContext,
    ToolCallPart,
    ToolDefinition,
    ToolResultPart,
    Tools,
    Yield,
    tool,
)
from stepmachine._emitter import EventSink
from stepmachine.extend import (
    Capabilities,
    NullEmitter,
    Objection,
    YieldReason,
    counter_ids,
    open_tool_calls,
)
from stepmachine.operations import HistoryGuard
from stepmachine.stores import MemoryStore
from stepmachine.testing import ScriptedModel, call, make_session, reply, run_step

ran: list[str] = []


@tool
def charge(amount: int) -> str:
    """Charge an amount."""
    ran.append(f"charge {amount}")
    return f"charged {amount}"


class Echo:
    """A user's step: only ``name`` and ``run``, no base class."""

    name = "echo"

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        last = ctx.session.conversation[-1]
        if last.role != "user":
            return Refuse("nothing to echo")
        answer = Message.assistant(f"echo: {last.text}", id=ctx.new_id())
        return Yield([AppendMessage(answer)], YieldReason(YieldReason.DONE))


class Holder:
    """A plain vetting step (no base class): holds every ``charge`` call."""

    name = "holder"

    def check_call(self, ctx: StepContext[Any], call: ToolCallPart) -> str | None:
        return "charges need a human" if call.name == "charge" else None

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Refuse("only vets")


class Runner:
    """A tool-running step that is not ``Tools``: answers every open call itself."""

    def __init__(self, *, answers_unknown_tools: bool) -> None:
        self.name = "runner"
        self.answers_unknown_tools = answers_unknown_tools

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        calls = open_tool_calls(ctx.session)
        if not calls:
            return Refuse("no open calls")
        results = [
            AppendMessage(
                Message.tool_result(
                    ToolResultPart.for_call(c, f"ran {c.name}", is_error=False), id=ctx.new_id()
                )
            )
            for c in calls
        ]
        return Continue(results)


def asking(*calls: ToolCallPart) -> Message:
    return Message(id="a1", role="assistant", parts=calls)


# -- a step is a name and run ------------------------------------------------------------------


def test_a_plain_step_satisfies_step_and_has_no_capability() -> None:
    echo: Step[Any] = Echo()  # mypy checks the structural match
    capabilities = Capabilities([echo])
    assert capabilities.steps == (echo,)
    assert capabilities.tool_steps == ()
    assert capabilities.prompt_steps == ()
    assert capabilities.shapers == ()
    assert capabilities.vetters == ()
    assert capabilities.finalizers == ()
    assert capabilities.answers_unknown_tools is False


async def test_a_plain_step_runs_in_a_machine() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    machine = StateMachine([Echo()])
    report = await machine.run_report(Runtime(store=store, ids=counter_ids()), "s")
    assert report.reason.kind == YieldReason.DONE
    assert report.session.conversation[-1].text == "echo: hi"
    assert [r.step for r in report.results] == ["echo"]


async def test_a_plain_step_runs_in_the_harness() -> None:
    check = await run_step(Echo(), make_session("hi"))
    assert check.yielded
    assert [m.text for m in check.new_messages] == ["echo: hi"]
    refused = await run_step(Echo(), make_session("hi", Message.assistant("done", id="a1")))
    assert refused.refused


async def test_a_plain_step_interrupted_by_a_cancellation_is_finalized_without_a_finalize() -> None:
    class Waiter:
        name = "waiter"

        async def run(self, ctx: StepContext[Any]) -> Outcome:
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    token = CancelToken()
    machine = StateMachine([Waiter()], cancel=token)
    async with anyio.create_task_group() as group:
        group.start_soon(lambda: machine.run_report(Runtime(store=store), "s"))
        await anyio.wait_all_tasks_blocked()
        token.cancel()
    assert (await store.load("s")).conversation[-1].text == "hi"


# -- sorting by capability ------------------------------------------------------------------


class Bare(Operation[Any]):
    """Overrides only ``run``: the defaults of ``Operation`` are no capability."""

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Refuse()


def test_operation_defaults_are_no_capability_and_overrides_are() -> None:
    bare, holder, tools = Bare(), Holder(), Tools([charge])
    inference = ModelInference(instructions="be brief")
    capabilities = Capabilities([bare, holder, tools, inference])
    assert capabilities.tool_steps == (tools,)
    assert capabilities.prompt_steps == (inference,)
    assert capabilities.vetters == (holder,)
    assert capabilities.shapers == ()
    assert capabilities.finalizers == ()  # Tools, ModelInference: the machine holds their results
    assert capabilities.answers_unknown_tools is True
    assert StateMachine([bare, holder, tools, inference]).capabilities.vetters == (holder,)


def test_answers_unknown_tools_must_be_true() -> None:
    assert Capabilities([Runner(answers_unknown_tools=False)]).answers_unknown_tools is False
    assert Capabilities([Runner(answers_unknown_tools=True)]).answers_unknown_tools is True


HOOKS = ("tools", "prompt_parts", "shape_request", "check_call", "finalize")


def made_step(index: int, hooks: frozenset[str], objects: bool) -> Any:
    """A plain step named ``s<index>`` with exactly ``hooks``; it objects if ``objects``."""
    name = f"s{index}"
    members: dict[str, Any] = {"name": name}

    async def run(self: Any, ctx: StepContext[Any]) -> Outcome:
        return Refuse()

    members["run"] = run
    if "tools" in hooks:
        members["tools"] = lambda self, session: (ToolDefinition(f"t{index}", "", {}),)
    if "prompt_parts" in hooks:
        members["prompt_parts"] = lambda self, session: (PromptPart(name, name),)
    if "shape_request" in hooks:
        members["shape_request"] = lambda self, ctx, request: msgspec.structs.replace(
            request, prompt_parts=(*request.prompt_parts, PromptPart(name, "shaped"))
        )
    if "check_call" in hooks:
        members["check_call"] = lambda self, ctx, call: f"{name} objects" if objects else None
    if "finalize" in hooks:

        async def finalize(self: Any, ctx: StepContext[Any], *, interrupted: bool) -> Any:
            return ()

        members["finalize"] = finalize
    return type(f"Step{index}", (), members)()


def context_for(capabilities: Capabilities[Any]) -> StepContext[Any]:
    session = make_session("q", asking(ToolCallPart.of("c1", "anything", {})))
    return StepContext(
        session=session,
        runtime=Runtime(),
        events=EventSink(NullEmitter(), session.id, 0),
        capabilities=capabilities,
    )


@given(
    st.lists(
        st.tuples(st.frozensets(st.sampled_from(HOOKS)), st.booleans()), min_size=1, max_size=8
    )
)
def test_each_capability_is_asked_of_exactly_its_steps_in_step_order(
    specs: list[tuple[frozenset[str], bool]],
) -> None:
    steps = [made_step(i, hooks, objects) for i, (hooks, objects) in enumerate(specs)]
    capabilities = Capabilities(steps)

    def having(hook: str) -> list[str]:
        return [s.name for s, (hooks, _) in zip(steps, specs, strict=True) if hook in hooks]

    assert [s.name for s in capabilities.tool_steps] == having("tools")  # type: ignore[attr-defined]
    assert [s.name for s in capabilities.finalizers] == having("finalize")  # type: ignore[attr-defined]
    tools, parts = capabilities.collect(make_session())
    assert [d.name for d in tools] == [f"t{n[1:]}" for n in having("tools")]
    assert [p.source for p in parts] == having("prompt_parts")
    ctx = context_for(capabilities)
    shaped = ctx.shape_request(ModelRequest(messages=()))
    assert [p.source for p in shaped.prompt_parts] == having("shape_request")
    objectors = [
        s.name
        for s, (hooks, objects) in zip(steps, specs, strict=True)
        if "check_call" in hooks and objects
    ]
    objection = ctx.vet_call(ctx.session.conversation[-1].tool_calls[0])
    if objectors:
        assert objection == Objection(objectors[0], f"{objectors[0]} objects")
    else:
        assert objection is None


def test_two_steps_advertising_one_tool_name_is_a_configuration_error() -> None:
    from stepmachine import ConfigurationError

    with pytest.raises(ConfigurationError, match="'charge' is advertised by both"):
        StateMachine([Tools([charge]), Tools([charge], name="again")]).collect(make_session())


def test_a_context_built_by_hand_with_steps_still_asks_them() -> None:
    """``steps`` is deprecated, but a hand-built ctx with it must not skip a vetting step."""
    session = make_session("q", asking(ToolCallPart.of("c1", "charge", {"amount": 1})))
    ctx: StepContext[Any] = StepContext(
        session=session,
        runtime=Runtime(),
        events=EventSink(NullEmitter(), session.id, 0),
        steps=(Holder(), Tools([charge])),
    )
    assert ctx.vet_call(session.conversation[-1].tool_calls[0]) == Objection(
        "holder", "charges need a human"
    )
    assert ctx.answers_unknown_tools is True


# -- vetting, whatever the order ------------------------------------------------------------


@pytest.mark.parametrize("holder_first", [True, False], ids=["before-tools", "after-tools"])
async def test_a_vetting_step_holds_calls_whatever_its_position(holder_first: bool) -> None:
    ran.clear()
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("pay", id="u1")])
    steps: list[Step[Any]] = [Tools([charge]), ModelInference()]
    steps.insert(0 if holder_first else 1, Holder())
    model = ScriptedModel([call(("charge", {"amount": 3}))])
    report = await StateMachine(steps).run_report(
        Runtime(store=store, model=model, ids=counter_ids()), "s"
    )
    assert ran == []
    assert report.reason.kind == YieldReason.CALL_HELD
    assert report.reason.data["calls"][0]["step"] == "holder"
    assert report.reason.data["calls"][0]["objection"] == "charges need a human"
    assert len(open_tool_calls(report.session)) == 1


async def test_the_harness_asks_the_other_steps_vetting() -> None:
    ran.clear()
    session = make_session("q", asking(ToolCallPart.of("c1", "charge", {"amount": 1})))
    check = await run_step(Tools([charge]), session, others=[Holder()])
    assert check.refused
    assert ran == []


# -- HistoryGuard asks whether some step answers unknown tools -------------------------------


def pending_unknown_call() -> Any:
    return make_session(
        "q",
        asking(ToolCallPart.of("c1", "nobody_offers_this", {})),
        Message.user("still there?", id="u2"),
    )


async def test_history_guard_leaves_an_unknown_tool_call_to_a_step_that_answers_it() -> None:
    runner = Runner(answers_unknown_tools=True)
    check = await run_step(HistoryGuard(), pending_unknown_call(), others=[runner])
    assert check.refused
    answered = await run_step(runner, check.session)
    (result,) = [r for m in answered.new_messages for r in m.tool_results]
    assert result.content == "ran nobody_offers_this"


async def test_history_guard_answers_an_unknown_tool_call_when_no_step_would() -> None:
    for others in ([Runner(answers_unknown_tools=False)], []):
        check = await run_step(HistoryGuard(), pending_unknown_call(), others=others)
        assert check.continued
        (result,) = [r for m in check.session.visible_to_model for r in m.tool_results]
        assert result.is_error


async def test_history_guard_in_a_machine_with_another_tool_runner() -> None:
    store = MemoryStore()
    await store.create("s", conversation=list(pending_unknown_call().conversation))
    model = ScriptedModel([reply("ok")])
    machine = StateMachine(
        [HistoryGuard(), Runner(answers_unknown_tools=True), ModelInference(stream=False)]
    )
    report = await machine.run_report(Runtime(store=store, model=model, ids=counter_ids()), "s")
    assert [r.step for r in report.results] == ["runner", "inference"]
    results = [r for m in report.session.conversation for r in m.tool_results]
    assert [r.content for r in results] == ["ran nobody_offers_this"]


# -- side requests ----------------------------------------------------------------------------


class Turner(Operation[Any]):
    """A shaper unaware of purposes: imposes content, settings, attempts and a prompt part."""

    name = "turner"

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Refuse()

    def shape_request(self, ctx: StepContext[Any], request: ModelRequest) -> ModelRequest:
        return msgspec.structs.replace(
            request,
            messages=(),
            tools=(ToolDefinition("final", "", {}),),
            output_schema={"type": "object"},
            output_name="final",
            settings=ModelSettings(max_tokens=7),
            max_attempts=2,
            prompt_parts=(*request.prompt_parts, PromptPart("turner", "shaped")),
        )


@pytest.mark.parametrize("purpose", [ModelRequest.TURN, "summary"])
def test_a_side_request_keeps_its_content_and_takes_limits(purpose: str) -> None:
    ctx = context_for(Capabilities([Turner()]))
    own = (Message.user("summarise", id="r1"),)
    shaped = ctx.shape_request(ModelRequest(messages=own, purpose=purpose))
    assert (shaped.settings.max_tokens, shaped.max_attempts) == (7, 2)
    assert [p.source for p in shaped.prompt_parts] == ["turner"]
    assert shaped.purpose == purpose
    if purpose == ModelRequest.TURN:
        assert (shaped.messages, shaped.output_name) == ((), "final")
        assert shaped.output_schema == {"type": "object"}
    else:
        assert (shaped.messages, shaped.tools, shaped.output_schema) == (own, (), None)
        assert shaped.output_name == "output"


def test_no_shaper_leaves_the_request_as_it_is() -> None:
    request = ModelRequest(messages=(), purpose="summary")
    assert context_for(Capabilities([Echo()])).shape_request(request) is request


# -- finalize asks only the steps that finalize -----------------------------------------------


async def test_finalize_asks_only_finalizing_steps() -> None:
    asked: list[str] = []

    class Keeper:
        name = "keeper"

        async def run(self, ctx: StepContext[Any]) -> Outcome:
            return Refuse()

        async def finalize(self, ctx: StepContext[Any], *, interrupted: bool) -> Sequence[Effect]:
            asked.append(f"keeper {interrupted}")
            return ()

    store = MemoryStore()
    await store.create("s", data=NoData(), conversation=[Message.user("hi", id="u1")])
    steps: list[Step[Any]] = [Echo(), Keeper()]  # mypy joins two plain classes to object
    machine = StateMachine(steps)
    await machine.finalize(Runtime(store=store, ids=counter_ids()), "s")
    assert asked == ["keeper False"]
