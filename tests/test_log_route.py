"""Logging never changes what a run does: a processor that raises is reported and dropped."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from stepmachine import Message, ModelInference, Runtime, StateMachine, Tools, tool
from stepmachine.stores import MemoryStore
from stepmachine.testing import ScriptedModel, call, reply


@pytest.fixture
def broken_structlog() -> Iterator[list[str]]:
    """structlog configured with a processor that raises on every event (and records it)."""
    seen: list[str] = []

    def explode(_logger: Any, _method: str, event_dict: Any) -> Any:
        seen.append(event_dict["event"])
        raise RuntimeError("a broken log processor")

    structlog.configure(processors=[explode])
    try:
        yield seen
    finally:
        structlog.reset_defaults()


async def test_a_raising_log_processor_changes_nothing_in_a_tool_loop(
    broken_structlog: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[int] = []

    @tool
    def add(a: int, b: int) -> int:
        """Add."""
        ran.append(a + b)
        return a + b

    store = MemoryStore()
    await store.create("s", conversation=[Message.user("2 + 3?", id="u1")])
    model = ScriptedModel([call(("add", {"a": 2, "b": 3})), reply("5")])
    machine = StateMachine([Tools([add]), ModelInference()])
    report = await machine.run_report(Runtime(store=store, model=model), "s")
    assert report.reason.kind == "done"
    assert ran == [5]
    assert [m.role for m in report.session.conversation] == [
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    assert report.session.conversation[2].tool_results[0].content == "5"
    # Every event was attempted (so the processor really ran) and each failure went to stderr.
    assert {"model_call", "tool_call", "cycle", "yield"} <= set(broken_structlog)
    err = capsys.readouterr().err
    assert "stepmachine: logging event 'tool_call' failed" in err
