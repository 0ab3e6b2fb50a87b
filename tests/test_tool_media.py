"""Tools whose results carry images and documents: ``ToolOutput``, the journal, finalize, replay."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.lowlevel
import pytest

from stepmachine import (
    CancelToken,
    DocumentPart,
    ImagePart,
    InvalidFieldError,
    Message,
    ModelInference,
    Runtime,
    Session,
    StateMachine,
    Store,
    ToolContext,
    ToolError,
    ToolOutput,
    ToolResultPart,
    Tools,
    replay,
    tool,
)
from stepmachine.extend import Batch, YieldReason, counter_ids, history_problems
from stepmachine.stores import MemoryStore, SQLiteStore
from stepmachine.testing import FunctionModel, ScriptedModel, call, reply

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR" + (64).to_bytes(4, "big") * 2 + b"\x08\x02"
PDF = b"%PDF-1.4\n1 0 obj << /Type /Page >> endobj\n"
SCREENSHOT = ImagePart(media_type="image/png", data=PNG)
REPORT = DocumentPart(media_type="application/pdf", data=PDF, title="report.pdf")


@tool
def screenshot() -> ImagePart:
    """Take a screenshot."""
    return SCREENSHOT


@tool
def chart(title: str) -> ToolOutput:
    """Draw a chart and write its report."""
    return ToolOutput(f"chart: {title}", [SCREENSHOT, REPORT])


@tool
def broken() -> ImagePart:
    """Fail after drawing."""
    raise ToolError("the renderer crashed")


StoreKind = Literal["memory", "sqlite"]


@asynccontextmanager
async def open_store(kind: StoreKind) -> AsyncIterator[Store]:
    with tempfile.TemporaryDirectory() as folder:
        store: Store
        if kind == "memory":
            store = MemoryStore()
        else:
            store = await SQLiteStore.open(Path(folder) / "db.sqlite3")
        try:
            yield store
        finally:
            await store.aclose()


def tool_messages(session: Session[Any]) -> list[Message]:
    return [m for m in session.conversation if m.role == "tool"]


async def run_calls(store: Store, *calls: tuple[str, dict[str, Any]]) -> Session[Any]:
    await store.create("s", conversation=[Message.user("look", id="u1")])
    machine = StateMachine([Tools([screenshot, chart, broken]), ModelInference()])
    model = ScriptedModel([call(*calls), reply("seen")])
    return await machine.run(Runtime(store=store, model=model, ids=counter_ids()), "s")


# -- what a tool returns ----------------------------------------------------------------


def test_tool_output_holds_text_and_images_or_documents() -> None:
    output = ToolOutput("two", [SCREENSHOT, REPORT])
    assert output.media == (SCREENSHOT, REPORT)  # a list becomes a tuple
    assert output.content == "two"
    assert ToolOutput().content == ""
    with pytest.raises(InvalidFieldError, match="media"):
        ToolOutput("x", [b"raw bytes"])  # type: ignore[list-item]
    with pytest.raises(InvalidFieldError, match="media"):
        ToolOutput("x", [__import__("stepmachine").AudioPart(media_type="audio/wav", data=b"RIFF")])
    with pytest.raises(InvalidFieldError, match="text"):
        ToolOutput(None)  # type: ignore[arg-type]


def test_an_output_without_text_says_what_follows() -> None:
    assert ToolOutput(media=[SCREENSHOT]).content == f"[image follows: image/png, {len(PNG)} bytes]"
    by_url = ImagePart(url="https://example.com/a.png")
    both = ToolOutput(media=[by_url, REPORT]).content.splitlines()
    assert both == [
        "[image follows: https://example.com/a.png]",
        f"[document follows: 'report.pdf', application/pdf, {len(PDF)} bytes]",
    ]


async def test_tool_call_returns_a_tool_output_for_an_image() -> None:
    context = ToolContext(runtime=Runtime(), session_id="s", call_id="c", idempotency_key="k")
    assert await screenshot.call({}, context) == ToolOutput(media=(SCREENSHOT,))
    assert await chart.call({"title": "q"}, context) == ToolOutput("chart: q", (SCREENSHOT, REPORT))


# -- through the Tools step -----------------------------------------------------------------


@pytest.mark.parametrize("store_kind", ["memory", "sqlite"])
async def test_an_image_a_tool_returns_ends_in_its_stored_tool_message(
    store_kind: StoreKind,
) -> None:
    async with open_store(store_kind) as store:
        session = await run_calls(store, ("screenshot", {}), ("chart", {"title": "sales"}))
        stored = await store.load("s")
    assert stored.conversation == session.conversation
    by_tool = {m.tool_results[0].name: m for m in tool_messages(stored)}  # in any order
    shot, drawn = by_tool["screenshot"], by_tool["chart"]
    (result,) = shot.tool_results
    assert result.content == f"[image follows: image/png, {len(PNG)} bytes]"
    assert not result.is_error
    assert shot.parts == (result, SCREENSHOT)
    assert shot.result_media(result.call_id) == (SCREENSHOT,)
    (result,) = drawn.tool_results
    assert result.content == "chart: sales"
    assert drawn.result_media(result.call_id) == (SCREENSHOT, REPORT)
    assert history_problems(stored.conversation) == []
    assert stored.conversation[-1].text == "seen"


async def test_an_error_result_carries_no_media() -> None:
    session = await run_calls(MemoryStore(), ("broken", {}), ("screenshot", {"unexpected": 1}))
    by_tool = {m.tool_results[0].name: m for m in tool_messages(session)}
    failed, invalid = by_tool["broken"], by_tool["screenshot"]
    assert failed.parts == (
        ToolResultPart(
            failed.tool_results[0].call_id, "the renderer crashed", is_error=True, name="broken"
        ),
    )
    assert len(invalid.parts) == 1
    assert invalid.tool_results[0].is_error


async def test_a_slow_tool_that_times_out_carries_no_media() -> None:
    release = anyio.Event()

    @tool(timeout=0.01)
    async def slow() -> ImagePart:
        """Never finishes in time."""
        await release.wait()
        return SCREENSHOT

    store = MemoryStore()
    await store.create("s", conversation=[Message.user("look", id="u1")])
    machine = StateMachine([Tools([slow]), ModelInference()])
    model = ScriptedModel([call(("slow", {})), reply("ok")])
    session = await machine.run(Runtime(store=store, model=model), "s")
    (message,) = tool_messages(session)
    assert len(message.parts) == 1
    assert "timed out" in message.tool_results[0].content


class CancelBeforeResultCommit:
    """Fires a cancellation when the tool step is about to write a result: nothing is
    written, so ``finalize`` must record the result (with its media)."""

    def __init__(self, store: Store, cancel: Callable[[], None]) -> None:
        self.store = store
        self.cancel = cancel
        self.fired = False

    async def load(self, session_id: str) -> Session[Any]:
        return await self.store.load(session_id)

    async def apply(self, batch: Batch[Any]) -> Session[Any] | None:
        is_result = batch.step == "tools" and any(
            getattr(getattr(e, "message", None), "tool_results", ()) for e in batch.effects
        )
        if is_result and not self.fired:
            self.fired = True
            self.cancel()
            await anyio.lowlevel.checkpoint()
        return await self.store.apply(batch)


@pytest.mark.parametrize("how", ["token", "outside"])
async def test_a_cancelled_result_commit_keeps_its_media(how: str) -> None:
    token = CancelToken()
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("look", id="u1")])
    machine = StateMachine(
        [Tools([chart]), ModelInference()], cancel=token if how == "token" else None
    )
    model = ScriptedModel([call(("chart", {"title": "q"})), reply("seen")])
    with anyio.CancelScope() as scope:
        wrapper = CancelBeforeResultCommit(
            store, (lambda: token.cancel("stop")) if how == "token" else scope.cancel
        )
        runtime = Runtime(loader=wrapper, handler=wrapper, model=model, ids=counter_ids())
        report = await machine.run_report(runtime, "s")
        assert report.reason.kind == YieldReason.CANCELLED
    assert wrapper.fired
    stored = await store.load("s")
    (message,) = tool_messages(stored)
    (result,) = message.tool_results
    assert (result.content, result.is_error) == ("chart: q", False)  # the real result, not
    assert message.result_media(result.call_id) == (SCREENSHOT, REPORT)  # "interrupted"


async def test_replay_answers_a_call_with_its_recorded_media() -> None:
    store = MemoryStore()
    await run_calls(store, ("screenshot", {}), ("chart", {"title": "sales"}))
    ran: list[str] = []

    @tool(name="screenshot")
    def other_screenshot() -> str:
        """Would answer differently, but never runs in a replay."""
        ran.append("screenshot")
        return "no image"

    report = await replay(store, "s", [Tools([other_screenshot, chart, broken]), ModelInference()])
    assert report.same, str(report)
    assert ran == []


async def test_a_tool_caller_may_answer_with_a_tool_message() -> None:
    async def caller(call_part: Any, context: ToolContext) -> Message:
        result = ToolResultPart.for_call(call_part, "from the caller")
        return Message.tool_result(result, id="ignored", media=[REPORT])

    store = MemoryStore()
    await store.create("s", conversation=[Message.user("look", id="u1")])
    machine = StateMachine([Tools([screenshot]), ModelInference()])
    model = ScriptedModel([call(("screenshot", {})), reply("ok")])
    runtime = Runtime(store=store, model=model, ids=counter_ids(), tool_caller=caller)
    session = await machine.run(runtime, "s")
    (message,) = tool_messages(session)
    assert message.id != "ignored"
    assert message.result_media(message.tool_results[0].call_id) == (REPORT,)


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
