"""Hello, world: an agent with one tool, on the embedded defaults.

    python3 dev.py demo            (or: python examples/hello_world.py [--db PATH])

Uses the SQLite store (a file under ./demo-data/ by default) and the scripted
model from the testing kit -- no network, no API key. The conversation is
printed as it is stored; run it again and a new session is added beside the
old ones in the same database.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Literal

import anyio

from stepmachine import (
    Message,
    ModelInference,
    Runtime,
    StateMachine,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    Tools,
    tool,
)
from stepmachine.stores import SQLiteStore
from stepmachine.testing import ScriptedModel, call, reply


@tool
def get_weather(city: str, unit: Literal["C", "F"] = "C") -> str:
    """Tell the current weather in a city."""
    return f"Sunny, 21 degrees {unit} in {city}"


def scripted_model() -> ScriptedModel:
    """The stand-in model: asks for the weather once, then answers."""
    return ScriptedModel(
        [
            call(("get_weather", {"city": "Paris"}), text="Let me check the weather."),
            reply("It is sunny in Paris, 21 °C. Enjoy your day!"),
        ],
        name="scripted (no provider configured)",
    )


async def main(db: Path) -> None:
    db.parent.mkdir(parents=True, exist_ok=True)
    model = scripted_model()
    print(f"model: {model.name}")
    print(f"store: SQLite at {db}")
    async with await SQLiteStore.open(db) as store:
        session_id = f"hello-{time.time_ns()}"
        await store.create(session_id, conversation=[Message.user("Weather in Paris?", id="u1")])
        machine = StateMachine([Tools([get_weather]), ModelInference(instructions="Be brief.")])
        report = await machine.run_report(Runtime(store=store, model=model), session_id)
        print(f"session {session_id}: {report.reason.kind} at revision {report.session.revision}\n")
        for message in report.session.conversation:
            print_message(message)


def print_message(message: Message) -> None:
    """Print one message, one line per part."""
    for part in message.parts:
        if isinstance(part, TextPart):
            print(f"{message.role:>9}: {part.text}")
        elif isinstance(part, ToolCallPart):
            print(f"{message.role:>9}: -> {part.name}({part.raw_arguments})")
        elif isinstance(part, ToolResultPart):
            print(f"{message.role:>9}: <- {part.content}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", type=Path, default=Path("demo-data") / "hello_world.sqlite3")
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    args = parser.parse_args()
    backend: Literal["asyncio", "trio"] = args.backend
    anyio.run(main, args.db, backend=backend)
