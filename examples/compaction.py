"""Compaction in a long tool loop: 30 tool rounds under a small context budget.

    python examples/compaction.py [--db PATH] [--rounds N] [--threshold TOKENS]

The agent reads 30 sensors one call at a time and reports the sum of the
readings. Its context budget (``--threshold``, in estimated tokens) holds only
a few rounds, so ``Compaction`` summarises the older rounds in the middle of
the loop: the summary carries the running total forward, and the final answer
is still right. Everything is stored in SQLite; the models are
``FunctionModel`` stand-ins (no network): the agent decides each turn from the
history it is shown, the summariser condenses a transcript.

Step order: ``Tools`` answers the open calls of a round, ``HistoryGuard``
keeps the history valid, ``Compaction`` shortens it when needed, and only then
does ``ModelInference`` ask the model.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
from typing import Literal

import anyio

from stepmachine import (
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    StateMachine,
    Tools,
    tool,
)
from stepmachine.operations import Compaction, HistoryGuard
from stepmachine.stores import SQLiteStore
from stepmachine.testing import FunctionModel, call, reply

TOTAL = re.compile(r"running total: (\d+) after sensor (\d+)")
READING = re.compile(r"sensor (\d+) reads (\d+)")


@tool
def read_sensor(sensor: int) -> str:
    """Read one sensor."""
    return f"sensor {sensor} reads {sensor * 7 % 11}"


def progress(text: str) -> tuple[int, int]:
    """(total, last sensor) from summaries and readings in ``text``."""
    total, last = 0, 0
    for match in TOTAL.finditer(text):
        total, last = int(match[1]), int(match[2])
    for match in READING.finditer(text):
        if int(match[1]) > last:
            total, last = total + int(match[2]), int(match[1])
    return total, last


def agent(rounds: int) -> FunctionModel:
    """Calls ``read_sensor`` for the next sensor until all are read, then answers."""

    def answer(request: ModelRequest) -> ModelResponse:
        seen = "\n".join(
            m.text if m.role != "tool" else " ".join(r.content for r in m.tool_results)
            for m in request.messages
        )
        total, last = progress(seen)
        if last < rounds:
            return call(("read_sensor", {"sensor": last + 1}))
        return reply(f"All {rounds} sensors read; the readings sum to {total}.")

    return FunctionModel(answer, name="agent")


def summariser() -> FunctionModel:
    """Condenses a transcript into the running total so far."""

    def summarise(request: ModelRequest) -> ModelResponse:
        total, last = progress(request.messages[-1].text)
        return reply(
            "The user wants the sum of the sensor readings, read one at a time. "
            f"running total: {total} after sensor {last}"
        )

    return FunctionModel(summarise, name="summariser")


async def main(db: Path, rounds: int, threshold: int) -> None:
    db.parent.mkdir(parents=True, exist_ok=True)
    async with await SQLiteStore.open(db) as store:
        session_id = f"compaction-{time.time_ns()}"
        question = f"Read sensors 1 to {rounds} one at a time and tell me the sum."
        await store.create(session_id, conversation=[Message.user(question, id="u1")])
        machine = StateMachine(
            [
                Tools([read_sensor]),
                HistoryGuard(),
                Compaction(threshold=threshold, keep_rounds=2, model="summariser"),
                ModelInference(instructions="Read the sensors one by one."),
            ]
        )
        runtime = Runtime(store=store, model=agent(rounds), models={"summariser": summariser()})
        report = await machine.run_report(runtime, session_id)
        print(f"store: SQLite at {db}, session {session_id}")
        compactions = 0
        for message in report.session.conversation:
            receipt = message.notes.get("compaction", {})
            if receipt.get("kind") == "summary":
                compactions += 1
                print(
                    f"compaction {compactions}: summarised {len(receipt['summarised'])} messages, "
                    f"{receipt['tokens_before']} -> {receipt['tokens_after']} estimated tokens "
                    f"(model {receipt['model']}, at revision {receipt['revision']})"
                )
        visible = sum(1 for m in report.session.conversation if m.visible_to_model)
        print(
            f"messages stored: {len(report.session.conversation)}, visible to the model: {visible}"
        )
        print(f"{report.reason.kind}: {report.session.conversation[-1].text}")
        print(f"compactions={compactions}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", type=Path, default=Path("demo-data") / "compaction.sqlite3")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threshold", type=int, default=150)
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    args = parser.parse_args()
    backend: Literal["asyncio", "trio"] = args.backend
    anyio.run(main, args.db, args.rounds, args.threshold, backend=backend)
