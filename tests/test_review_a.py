"""An outside review of kernel v2 (issue 9): each test is a defect found, then fixed.

Conversation, one apply per batch, step capabilities and ``gc=False`` structs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from stepmachine import (
    Codec,
    ConfigurationError,
    Message,
    ModelError,
    ModelInference,
    ModelRequest,
    ModelResponse,
    ModelSettings,
    Operation,
    Outcome,
    Refuse,
    ReplaceConversation,
    Runtime,
    Session,
    StateMachine,
    Step,
    StepContext,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    UpdateData,
    Usage,
)
from stepmachine._conversation import CHUNK
from stepmachine.extend import (
    Batch,
    ChunkSink,
    Conversation,
    InferenceReceipt,
    Ledger,
    Spent,
    apply_batch,
    counter_ids,
    note_value,
)
from stepmachine.operations import (
    Approval,
    Budget,
    Compaction,
    HistoryGuard,
    InvalidCalls,
    Limits,
    budget_usage,
)
from stepmachine.stores import MemoryStore
from stepmachine.testing import ScriptedModel, make_session, reply, run_step


def test_replace_conversation_takes_the_sessions_conversation_and_its_sum() -> None:
    """``session.conversation + (m,)`` was a tuple and is now a Conversation: both still work.

    Compaction-like user code builds ``ReplaceConversation(session.conversation + (summary,))``
    or ``ReplaceConversation(session.conversation)``; it raised ``InvalidFieldError``.
    """
    session = make_session("a", "b", "c")
    extra = Message.user("d", id="d")
    plus = session.conversation + (extra,)  # noqa: RUF005 - the operator under test
    for conversation in (session.conversation, plus):
        effect = ReplaceConversation(conversation)
        assert type(effect.conversation) is tuple
        assert effect.conversation == tuple(conversation)
        after = apply_batch(session, [effect])
        assert after.conversation == conversation
        codec = Codec()
        assert codec.decode_effects(codec.encode_effects((effect,)), where="t") == (effect,)


class _ReturnsTheSessionBefore:
    """A third-party handler that stores the batch but returns the session *before* it."""

    def __init__(self) -> None:
        self.inner = MemoryStore()

    async def load(self, session_id: str) -> Session[Any]:
        return await self.inner.load(session_id)

    async def apply(self, batch: Batch[Any]) -> Session[Any] | None:
        before = await self.inner.load(batch.session_id)
        await self.inner.apply(batch)
        return before


class _DeclaresAndReturnsTheSessionBefore(_ReturnsTheSessionBefore):
    applies_batches = True


@pytest.mark.parametrize(
    "handler_type", [_ReturnsTheSessionBefore, _DeclaresAndReturnsTheSessionBefore]
)
async def test_a_handler_returning_a_session_of_another_revision_is_an_error(
    handler_type: type[_ReturnsTheSessionBefore],
) -> None:
    """A machine given a stale session by ``apply`` reported revision 0 with no reply, silently.

    ``apply`` must return the session *after* the batch (or ``None``); one that
    does not is a broken handler, said at once instead of a run that decides
    from a session the store no longer holds (invariant 1).
    """
    handler = handler_type()
    await handler.inner.create("s", conversation=[Message.user("hi", id="u")])
    machine = StateMachine([ModelInference()])
    runtime = Runtime(
        loader=handler, handler=handler, model=ScriptedModel([reply("a")]), ids=counter_ids()
    )
    with pytest.raises(ConfigurationError, match="at revision 0 for the batch producing"):
        await machine.run(runtime, "s")


class _RetryingModel:
    """A model that fails ``failures`` attempts of every request, then answers.

    It honours ``request.max_attempts`` (default 10) like a provider adapter
    with retries, and counts every attempt it makes.
    """

    name = "retrying"

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.attempts = 0

    async def request(
        self, request: ModelRequest, *, on_chunk: ChunkSink | None = None
    ) -> ModelResponse:
        allowed = request.max_attempts or 10
        for attempt in range(1, allowed + 1):
            self.attempts += 1
            if attempt > self.failures:
                return ModelResponse(parts=(TextPart("answer"),), attempts=attempt)
        raise ModelError(f"failed {allowed} attempts")


class _MoreRetries(Operation[Any]):
    """A retry policy written as a request shaper: every request may take 5 attempts."""

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Refuse("policy only")

    def shape_request(self, ctx: StepContext[Any], request: ModelRequest) -> ModelRequest:
        return msgspec.structs.replace(request, max_attempts=5)


class _RebuildsTheRequest(Operation[Any]):
    """A shaper that builds a new request and forgets ``max_attempts`` (left to the model)."""

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Refuse("shaper only")

    def shape_request(self, ctx: StepContext[Any], request: ModelRequest) -> ModelRequest:
        return ModelRequest(
            messages=request.messages, tools=request.tools, prompt_parts=request.prompt_parts
        )


@pytest.mark.parametrize("shaper", [_MoreRetries, _RebuildsTheRequest])
async def test_a_shaper_after_the_budget_cannot_raise_the_attempts_it_allows(
    shaper: type[Operation[Any]],
) -> None:
    """Invariant 7: a budget of 2 model calls is 2 attempts, whatever shapes the request after it.

    ``Budget.shape_request`` caps ``max_attempts`` at the calls left, "whatever
    the order"; a later shaper that sets it higher (a retry policy) or drops it
    (rebuilds the request) let the model make 4 attempts.
    """
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u")])
    model = _RetryingModel(failures=3)
    machine = StateMachine([Budget(per_run=Limits(model_calls=2)), shaper(), ModelInference()])
    with pytest.raises(ModelError):
        await machine.run(Runtime(store=store, model=model, ids=counter_ids()), "s")
    assert model.attempts == 2


class _TokenModel:
    """A model whose answer is as long as it may be: ``max_tokens`` output tokens (100 if unset)."""

    name = "tokens"

    async def request(
        self, request: ModelRequest, *, on_chunk: ChunkSink | None = None
    ) -> ModelResponse:
        tokens = request.settings.max_tokens or 100
        return ModelResponse(parts=(TextPart("x"),), usage=Usage(output_tokens=tokens))


class _ResetsTheSettings(Operation[Any]):
    """A shaper that sets its own sampling settings (and so drops ``max_tokens``)."""

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Refuse("shaper only")

    def shape_request(self, ctx: StepContext[Any], request: ModelRequest) -> ModelRequest:
        return msgspec.structs.replace(request, settings=ModelSettings(temperature=0.0))


async def test_a_shaper_after_the_budget_cannot_undo_its_output_token_cap() -> None:
    """An output-token budget of 10 is "capped through max_tokens"; a later shaper undoes it.

    Budget's docs: token limits hold "whatever the order" of the steps, output
    tokens exactly, through ``settings.max_tokens``. A shaper after it that
    replaces the settings lets the call produce 100 output tokens.
    """
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u")])
    budget = Budget(per_run=Limits(output_tokens=10))
    machine = StateMachine([budget, _ResetsTheSettings(), ModelInference()])
    session = await machine.run(Runtime(store=store, model=_TokenModel(), ids=counter_ids()), "s")
    assert budget_usage(session, "per_run").output_tokens <= 10


class _LongAnswers(Operation[Any]):
    """A shaper that asks for long answers: raises ``max_tokens`` to 500."""

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Refuse("shaper only")

    def shape_request(self, ctx: StepContext[Any], request: ModelRequest) -> ModelRequest:
        settings = msgspec.structs.replace(request.settings, max_tokens=500)
        return msgspec.structs.replace(request, settings=settings)


async def test_a_shaper_may_raise_the_askers_max_tokens_but_not_a_budgets_cap() -> None:
    """The asker's own ``max_tokens`` is a default a shaper may raise; a shaper's cap is not."""
    for steps, expected in (
        ([_LongAnswers()], 500),  # raises the asker's 50
        ([Budget(per_run=Limits(output_tokens=10)), _LongAnswers()], 10),
        ([_LongAnswers(), Budget(per_run=Limits(output_tokens=10))], 10),
    ):
        store = MemoryStore()
        await store.create("s", conversation=[Message.user("hi", id="u")])
        inference = ModelInference(settings=ModelSettings(max_tokens=50))
        machine = StateMachine([*steps, inference])
        runtime = Runtime(store=store, model=_TokenModel(), ids=counter_ids())
        session = await machine.run(runtime, "s")
        assert budget_usage(session, "per_run").output_tokens == expected, steps


# -- invariant 10 for the built-in operations ---------------------------------------------


def _receipt(i: int) -> dict[str, Any]:
    """The notes of the ``i``-th reply (one tool call) as ModelInference records them: its
    ledger counts ``i + 1`` model calls and tool calls, the call made at revision ``i``."""
    spent = Spent(i + 1, 0, 0, i + 1)
    ledger = Ledger(spent, spent, revision=i, turn_start="u", tools=True)
    return {"inference": note_value(InferenceReceipt(attempts=1, revision=i, ledger=ledger))}


def _tool_session(turns: int, *, open_call: bool) -> Session[Any]:
    """``turns`` answered tool turns, each reply with its receipt and ledger; then an open
    call, or a new user message."""
    messages = [Message.user("go", id="u")]
    for i in range(turns):
        call = ToolCallPart.of(f"c{i}", "add", {"a": i})
        messages.append(Message(id=f"a{i}", role="assistant", parts=(call,), notes=_receipt(i)))
        if open_call and i == turns - 1:
            break
        messages.append(Message.tool_result(ToolResultPart.for_call(call, "ok"), id=f"r{i}"))
    if not open_call:
        messages.append(Message.user("more", id="u2"))
    return make_session(*messages)


class _Touches:
    """Counts the messages read through a Conversation (iteration, slices, as_tuple)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        iterate, backwards = Conversation.__iter__, Conversation.__reversed__
        as_tuple, get = Conversation.as_tuple, Conversation.__getitem__

        def counted_iter(conversation: Conversation) -> Iterator[Message]:
            for message in iterate(conversation):
                self.count += 1
                yield message

        def counted_reversed(conversation: Conversation) -> Iterator[Message]:
            for message in backwards(conversation):
                self.count += 1
                yield message

        def counted_as_tuple(conversation: Conversation) -> tuple[Message, ...]:
            self.count += len(conversation)
            return as_tuple(conversation)

        def counted_get(conversation: Conversation, index: Any) -> Any:
            got = get(conversation, index)
            self.count += len(got) if isinstance(index, slice) else 1
            return got

        monkeypatch.setattr(Conversation, "__iter__", counted_iter)
        monkeypatch.setattr(Conversation, "__reversed__", counted_reversed)
        monkeypatch.setattr(Conversation, "as_tuple", counted_as_tuple)
        monkeypatch.setattr(Conversation, "__getitem__", counted_get)


def _operation(kind: str) -> Step[Any]:
    if kind == "approval":
        return Approval(["pay"])
    if kind == "history_guard":
        return HistoryGuard()
    if kind == "invalid_calls":
        return InvalidCalls()
    if kind == "budget":
        # Per turn and per session (a run that began at revision 0, as run_step's does, is the
        # whole history: per run, a budget reads the run, see test_budget).
        limits = Limits(model_calls=10**6, tool_calls=10**6)
        return Budget(per_turn=limits, per_session=limits)
    return Compaction(threshold=10**9)


# The open call here is of a tool no step advertises: HistoryGuard and InvalidCalls repair it
# (a repair rebuilds what it changes, O(history), once); in a run with the tool served they
# refuse on the index. Budget reads its counts from the latest ledger (the replies carry them).
OPERATION_CASES = [
    ("approval", True),
    ("history_guard", True),
    ("invalid_calls", True),
    ("budget", True),
    ("budget", False),
    ("compaction", False),
    ("approval", False),
    ("history_guard", False),
    ("invalid_calls", False),
    ("compaction", True),
]


@pytest.mark.parametrize(("kind", "open_call"), OPERATION_CASES)
async def test_a_built_in_operation_reads_as_many_messages_at_turn_2000_as_at_turn_20(
    kind: str, open_call: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Invariant 10: a cycle's cost does not grow with the history, operations included.

    Counts the messages each operation's ``run`` and ``check_call`` read from
    the conversation (no timing): at turn 2,000 no more than at turn 20, plus
    a constant. Measured on this machine, a cycle with an open call costs
    Approval 106x, HistoryGuard 90x, InvalidCalls 57x, Budget 100x at turn
    2,000 what it costs at turn 20; a cycle ending on a user message costs
    Budget 100x and Compaction (below its threshold) 131x. Budget, with
    tool-call and model-call limits per turn and per session, now reads 15
    messages (open call) and 33 (user message) at either length.
    """
    touched: list[int] = []
    for turns in (20, 2000):
        session = _tool_session(turns, open_call=open_call)
        assert session.history.length == len(session.conversation)  # built once, as on load
        step = _operation(kind)
        counter = _Touches(monkeypatch)
        check = await run_step(step, session)
        last_call = next(m for m in reversed(session.conversation) if m.tool_calls).tool_calls[0]
        check.ctx.vet_call(last_call)
        touched.append(counter.count)
        monkeypatch.undo()
    assert touched[1] <= touched[0] + 2 * CHUNK, touched


class _Archive(msgspec.Struct, frozen=True):
    archive: tuple[Message, ...] = ()


def test_update_data_set_takes_the_sessions_conversation() -> None:
    """``UpdateData.set(archive=session.conversation)`` worked on the tuple; it raised TypeError.

    ``set`` takes "field values of any msgspec-supported type"; a conversation
    (archived before a compaction, say) is one since the session holds one.
    """
    session = make_session("a", "b", data=_Archive())
    effect = UpdateData.set(archive=session.conversation)
    after = apply_batch(session, [effect])
    assert after.data.archive == tuple(session.conversation)
    codec = Codec(_Archive)
    assert codec.decode_effects(codec.encode_effects((effect,)), where="t") == (effect,)
