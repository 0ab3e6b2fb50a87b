"""Recorded sessions for the HTML timeline's tests, written through the public API.

:func:`record_demo` runs an agent with every kind of entry the timeline
shows: a reasoning reply, a tool call that needs approval (yield, then an
approval with who and why, then a resumed run), a tool that fails (an error
result), a compaction (a summary, hidden messages) and a final answer.
:func:`record_hostile` runs one whose texts, tool name, arguments, step name
and refusal reason are all HTML/JS injection attempts.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio

from stepmachine import (
    Message,
    ModelInference,
    ModelResponse,
    Operation,
    ReasoningPart,
    Refuse,
    Runtime,
    StateMachine,
    StepContext,
    TextPart,
    ToolCallPart,
    Tools,
    Usage,
    tool,
)
from stepmachine.inspector._view import load_view
from stepmachine.operations import Approval, Compaction, HistoryGuard, approve
from stepmachine.stores import SQLiteStore
from stepmachine.testing import ScriptedModel, call, reply

XSS = (
    "<script>alert(1)</script>",
    '"><img src=x onerror=alert(1)>',
    "</script><script>alert(2)</script>",
    "' onmouseover='alert(3)",
    "<!-- --><style>body{display:none}</style>",
    "https://evil.example/x.png //evil.example/y",
)
"""Injection attempts; each must come out as text, never as markup."""

HOSTILE = " ".join(XSS)

T = TypeVar("T")


def run_in_thread(fn: Callable[..., Awaitable[T]], *args: Any, backend: str = "asyncio") -> T:
    """``anyio.run(fn, *args)`` in a thread of its own.

    Module-scoped fixtures are sync; while a browser test module runs,
    Playwright's event loop is the main thread's running loop and a plain
    ``anyio.run`` there fails.
    """
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: anyio.run(fn, *args, backend=backend)).result()


async def demo_view(path: Path) -> dict[str, Any]:
    """The view of :func:`record_demo`'s session."""
    store, session_id = await record_demo(path)
    async with store:
        return await load_view(store, session_id)


@tool(thread=False)
def send_payment(to: str, amount_eur: int) -> str:
    """Send money to someone (needs approval)."""
    return f"paid {amount_eur} EUR to {to}"


@tool(side_effects="idempotent")
def read_sensor(sensor: int) -> str:
    """Read one sensor."""
    return f"sensor {sensor} reads {sensor * 7 % 11}"


@tool
def lookup_invoice(number: str) -> str:
    """Look an invoice up (always fails here)."""
    raise ValueError(f"no invoice numbered {number}")


def _agent_turns() -> list[Any]:
    return [
        ModelResponse(
            parts=(
                ReasoningPart(text="The invoice is 120 EUR; paying needs approval."),
                TextPart("I'll pay Alice."),
                ToolCallPart.of("", "send_payment", {"to": "Alice", "amount_eur": 120}),
            ),
            usage=Usage(input_tokens=31, output_tokens=12),
            finish_reason="tool_calls",
            model="stand-in-large",
        ),
        call(("lookup_invoice", {"number": "INV-7"}), text="Checking the invoice record."),
        call(("read_sensor", {"sensor": 1})),
        call(("read_sensor", {"sensor": 2})),
        call(("read_sensor", {"sensor": 3})),
        reply("Paid Alice 120 EUR; the sensors read 7, 3 and 10."),
    ]


def _summariser() -> ScriptedModel:
    return ScriptedModel(
        [f"Summary {n}: Alice was paid; sensors are being read." for n in range(5)],
        name="summariser",
    )


async def record_demo(path: Path, session_id: str = "demo") -> tuple[SQLiteStore, str]:
    """A finished session in a new SQLite store at ``path`` (left open; close it)."""
    store = await SQLiteStore.open(path)
    await store.create(
        session_id,
        conversation=[Message.user("Pay Alice's invoice, then read sensors 1 to 3.", id="u1")],
    )
    machine = StateMachine(
        [
            Approval(["send_payment"]),
            Tools([send_payment, read_sensor, lookup_invoice]),
            HistoryGuard(),
            Compaction(threshold=120, keep_rounds=1, model="summariser"),
            ModelInference(instructions="Pay invoices, read sensors."),
        ]
    )
    runtime = Runtime(
        store=store,
        model=ScriptedModel(_agent_turns(), name="agent"),
        models={"summariser": _summariser()},
    )
    first = await machine.run_report(runtime, session_id)
    assert first.reason.kind == "awaiting_approval", first.reason
    (pending,) = first.reason.data["calls"]
    await approve(store, session_id, pending["call_id"], by="carol", reason="invoice INV-7 checked")
    await machine.run_report(runtime, session_id)
    return store, session_id


class Hostile(Operation[Any]):
    """A step whose name and refusal reason are injection attempts."""

    @property
    def name(self) -> str:
        return "step " + HOSTILE

    async def run(self, ctx: StepContext[Any]) -> Refuse:
        return Refuse("because " + HOSTILE)


def _hostile_tool() -> Any:
    def hostile(value: str) -> str:
        return "result " + value

    return tool(name="tool_" + "".join(c for c in HOSTILE if c.isalnum() or c == "_")[:40])(hostile)


async def record_hostile(path: Path, session_id: str = "hostile") -> Any:
    """A finished hostile session, as a view."""
    async with await SQLiteStore.open(path) as store:
        await store.create(session_id, conversation=[Message.user(HOSTILE, id="u<b>1</b>")])
        hostile_tool = _hostile_tool()
        turns: list[Any] = [
            ModelResponse(
                parts=(
                    ReasoningPart(text="think " + HOSTILE),
                    TextPart("text " + HOSTILE),
                    ToolCallPart.of("c<i>1</i>", hostile_tool.name, {"value": HOSTILE}),
                    ToolCallPart.parse("c2", "nope" + HOSTILE, HOSTILE),
                ),
                usage=Usage(input_tokens=1, output_tokens=1),
                model=HOSTILE,
            ),
            reply("answer " + HOSTILE),
        ]
        machine = StateMachine(
            [
                Hostile(),
                Tools([hostile_tool]),
                HistoryGuard(),
                ModelInference(instructions=HOSTILE),
            ]
        )
        runtime = Runtime(store=store, model=ScriptedModel(turns, name=HOSTILE))
        await machine.run_report(runtime, session_id)
        return await load_view(store, session_id)
