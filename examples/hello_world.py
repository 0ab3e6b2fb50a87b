"""Hello, world: an agent with one tool, on the embedded defaults.

    python3 dev.py demo            (or: python examples/hello_world.py [--db PATH])

Uses the SQLite store (a file under ./demo-data/ by default). With no provider
configured it uses the scripted model from the testing kit -- no network, no
API key -- and says so; set ``OPENAI_API_KEY``, ``ANTHROPIC_API_KEY``,
``GEMINI_API_KEY`` or ``OPENAI_COMPATIBLE_BASE_URL`` (and optionally
``STEPMACHINE_MODEL``) to talk to a real model. The conversation is printed as
it is stored; run it again and a new session is added beside the old ones in
the same database.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import anyio

from stepmachine import (
    DocumentPart,
    ImagePart,
    Message,
    Model,
    ModelInference,
    Runtime,
    StateMachine,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    Tools,
    tool,
)
from stepmachine.providers import (
    AnthropicModel,
    GeminiModel,
    HTTPModel,
    OpenAIChatModel,
    OpenAICompatibleModel,
    OpenAIResponsesModel,
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


def choose_model(fallback: Callable[[], Model] = scripted_model) -> Model:
    """A real provider when one is configured in the environment, else ``fallback()``
    (this example's scripted model; the other examples pass their own).

    ``OPENAI_API_KEY`` -> OpenAI Chat Completions (the Responses API with
    ``STEPMACHINE_OPENAI_API=responses``); ``ANTHROPIC_API_KEY`` ->
    Anthropic; ``GEMINI_API_KEY`` (or ``GOOGLE_API_KEY``) -> Gemini;
    ``OPENAI_COMPATIBLE_BASE_URL`` -> an OpenAI-compatible server
    (Ollama, vLLM, llama.cpp, ...). ``STEPMACHINE_MODEL`` names the model.
    """
    chosen = os.environ.get("STEPMACHINE_MODEL")
    if os.environ.get("OPENAI_API_KEY"):
        if os.environ.get("STEPMACHINE_OPENAI_API") == "responses":
            return OpenAIResponsesModel(chosen or "gpt-4.1-mini")
        return OpenAIChatModel(chosen or "gpt-4.1-mini")
    if os.environ.get("ANTHROPIC_API_KEY"):
        return AnthropicModel(chosen or "claude-haiku-4-5")
    if os.environ.get("GEMINI_API_KEY") or os.environ.get("GOOGLE_API_KEY"):
        return GeminiModel(chosen or "gemini-2.5-flash")
    if os.environ.get("OPENAI_COMPATIBLE_BASE_URL"):
        return OpenAICompatibleModel(chosen or "qwen3")
    return fallback()


async def main(db: Path) -> None:
    db.parent.mkdir(parents=True, exist_ok=True)
    model = choose_model()
    print(f"model: {model.name}")
    print(f"store: SQLite at {db}")
    try:
        async with await SQLiteStore.open(db) as store:
            session_id = f"hello-{time.time_ns()}"
            user = Message.user("Weather in Paris?", id="u1")
            await store.create(session_id, conversation=[user])
            machine = StateMachine([Tools([get_weather]), ModelInference(instructions="Be brief.")])
            report = await machine.run_report(Runtime(store=store, model=model), session_id)
            revision = report.session.revision
            print(f"session {session_id}: {report.reason.kind} at revision {revision}\n")
            for message in report.session.conversation:
                print_message(message)
            print(
                f"\ninspect it: {python_command()} -m stepmachine "
                f"--store {shlex.quote(f'sqlite:///{db}')} show {session_id}"
                "\n(or run examples/inspector.py; the command needs the extra cli, which"
                " dev.py demo installs)"
            )
    finally:
        if isinstance(model, HTTPModel):
            await model.aclose()


def python_command() -> str:
    """The interpreter running this demo, as a command that works from the current directory.

    ``sys.executable`` (a virtual environment's ``python``, which has
    stepmachine's dependencies; a bare ``python`` may not), relative when it
    is under the current directory (``.venv/bin/python``), else absolute;
    quoted for a POSIX shell.
    """
    executable = Path(sys.executable)
    try:
        shown = str(executable.relative_to(Path.cwd()))
    except ValueError:
        shown = str(executable)
    return shlex.quote(shown)


def print_message(message: Message) -> None:
    """Print one message, one line per part (media by kind and size, never their bytes)."""
    for part in message.parts:
        if isinstance(part, TextPart):
            print(f"{message.role:>9}: {part.text}")
        elif isinstance(part, ToolCallPart):
            print(f"{message.role:>9}: -> {part.name}({part.raw_arguments})")
        elif isinstance(part, ToolResultPart):
            print(f"{message.role:>9}: <- {part.content}")
        elif isinstance(part, ImagePart | DocumentPart):
            size = f"{len(part.data):,} bytes" if part.data is not None else part.url
            print(f"{message.role:>9}: [{type(part).__name__} {part.media_type}, {size}]")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", type=Path, default=Path("demo-data") / "hello_world.sqlite3")
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    args = parser.parse_args()
    backend: Literal["asyncio", "trio"] = args.backend
    anyio.run(main, args.db, backend=backend)
