"""No secret escapes on the error paths: a damaged typed record (an approval decision, a
budget's receipt) makes a step raise in the middle of ``machine.run()`` with the model client,
and so its API key, in the traceback's frames; the error that comes out shows the key nowhere
(message, chain, attributes, formatted traceback, structlog's frame locals, log records)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import structlog.testing
from test_provider_secrets import WIRES, _assert_hidden, _leaks

from stepmachine import Message, ModelInference, Runtime, StateMachine, ToolCallPart, Tools, tool
from stepmachine.operations import Approval, Budget, Limits
from stepmachine.providers import RetryPolicy
from stepmachine.stores import MemoryStore


@tool
def wipe() -> str:
    """Wipe."""
    return "wiped"


def _never(request: httpx.Request) -> httpx.Response:
    raise AssertionError("no model request is expected")


def _call(notes: dict[str, Any]) -> Message:
    call = ToolCallPart(call_id="c1", name="wipe", arguments={}, raw_arguments="{}", notes=notes)
    return Message(id="a1", role="assistant", parts=(call,))


CASES: dict[str, tuple[list[Message], Callable[[], list[Any]]]] = {
    "approval decision": (
        [Message.user("go", id="u0"), _call({"approval": {"decision": {"outcome": 3}}})],
        lambda: [Approval(["wipe"]), Tools([wipe]), ModelInference()],
    ),
    "budget receipt": (
        [
            Message.user("go", id="u0"),
            Message(
                id="a0",
                role="assistant",
                parts=(),
                notes={"inference": {"attempts": 1, "revision": 0, "usage": "damaged"}},
            ),
            Message.user("more", id="u1"),
        ],
        lambda: [Budget(per_session=Limits(model_calls=5, tool_calls=5)), ModelInference()],
    ),
}


@pytest.mark.anyio
@pytest.mark.parametrize("case", list(CASES))
async def test_a_damaged_record_in_a_run_shows_no_key(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    conversation, steps = CASES[case]
    store = MemoryStore()
    await store.create("s1", conversation=conversation)
    model = next(iter(WIRES.values())).make(_never, retry=RetryPolicy(max_attempts=1))
    machine = StateMachine(steps())
    with structlog.testing.capture_logs() as logs:
        try:
            await machine.run(Runtime(store=store, model=model), "s1")
        except Exception as exc:
            error: BaseException = exc
        else:
            pytest.fail("the damaged record was not noticed")
    _assert_hidden(error, case)
    assert not _leaks(caplog.text)
    assert not _leaks(repr(logs))
