"""Tools from an MCP server: an agent whose tools come from a local server over stdio.

    pip install 'stepmachine[mcp]'
    python examples/mcp.py [--db PATH] [--backend asyncio|trio]

The example starts its own MCP server (this file, run as ``python
examples/mcp.py serve``, written with the official SDK's ``MCPServer``): a
notebook with ``add_note`` (a side effect, so not idempotent), and the
read-only ``list_notes`` and ``count_words``. ``McpTools`` lists those tools
when the run starts, advertises them to the model, and runs the model's calls
through the same journal as local tools: an intent is stored before
``add_note`` runs, so a crash never makes it run twice. The side-effect class
of each tool comes from its MCP annotations (printed at the start).

With no provider configured the model is the testing kit's scripted model --
no network, no API key -- and the example says so; set ``OPENAI_API_KEY``,
``ANTHROPIC_API_KEY`` or ``OPENAI_COMPATIBLE_BASE_URL`` (and optionally
``STEPMACHINE_MODEL``) to let a real model choose the calls. The session is
stored in SQLite (``demo-data/mcp.sqlite3`` by default); the notebook is a
text file beside it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Literal

import anyio
from hello_world import choose_model, print_message  # the example beside this one

from stepmachine import Message, ModelInference, Runtime, StateMachine
from stepmachine.operations import McpStdio, McpTools
from stepmachine.providers import HTTPModel
from stepmachine.stores import SQLiteStore
from stepmachine.testing import ScriptedModel, call, reply

HERE = Path(__file__).resolve()

# This file is named mcp.py, and Python puts the folder of the script it runs first
# on sys.path, where this file would shadow the MCP SDK's package `mcp` (imported
# only when the tools connect, or by serve()). Drop the folder now that hello_world
# is imported from it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE.parent]


def serve(notebook: Path) -> None:
    """The MCP server: three tools over stdio (run as ``python examples/mcp.py serve``)."""
    from mcp.server.mcpserver import MCPServer  # noqa: PLC0415 - only the server needs it
    from mcp.types import ToolAnnotations  # noqa: PLC0415

    server = MCPServer("notebook", log_level="WARNING")

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False))
    def add_note(text: str) -> str:
        """Add a note to the notebook."""
        with notebook.open("a", encoding="utf-8") as f:
            f.write(text.replace("\n", " ") + "\n")
        return f"noted ({len(text)} characters)"

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def list_notes() -> list[str]:
        """Every note in the notebook, oldest first."""
        return notebook.read_text(encoding="utf-8").splitlines() if notebook.exists() else []

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def count_words(text: str) -> int:
        """How many words a text has."""
        return len(text.split())

    server.run("stdio")


def scripted_model() -> ScriptedModel:
    """The stand-in model: counts, notes, lists, then answers."""
    text = "MCP tools run through the stepmachine journal"
    return ScriptedModel(
        [
            call(("count_words", {"text": text}), text="Counting first."),
            call(("add_note", {"text": f"{text} (7 words)"})),
            call(("list_notes", {})),
            reply("Noted: the sentence has 7 words; the notebook lists it."),
        ],
        name="scripted (no provider configured)",
    )


async def main(db: Path) -> None:
    db.parent.mkdir(parents=True, exist_ok=True)
    notebook = db.with_suffix(".notes.txt")
    model = choose_model(fallback=scripted_model)
    print(f"model: {model.name}")
    print(f"store: SQLite at {db}")
    server = McpStdio(
        command=sys.executable,
        args=[str(HERE), "serve", str(notebook)],
        name="notebook",
        trust_annotations=True,  # our own server: its readOnlyHint etc. set the classes
    )
    try:
        async with await SQLiteStore.open(db) as store, McpTools([server]) as mcp_tools:
            print(f"MCP server: {mcp_tools.status()}")
            for name, side_effects in mcp_tools.listed().items():
                print(f"  tool {name}: {side_effects}")
            session_id = f"mcp-{time.time_ns()}"
            request = "Count the words of 'MCP tools run through the stepmachine journal', "
            request += "note the sentence with its count, then list the notes."
            await store.create(session_id, conversation=[Message.user(request, id="u1")])
            machine = StateMachine([mcp_tools, ModelInference(instructions="Use the tools.")])
            report = await machine.run_report(Runtime(store=store, model=model), session_id)
            revision = report.session.revision
            print(f"session {session_id}: {report.reason.kind} at revision {revision}\n")
            for message in report.session.conversation:
                print_message(message)
            print(f"\nnotebook: {notebook}")
    finally:
        if isinstance(model, HTTPModel):
            await model.aclose()


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(Path(sys.argv[2]))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", type=Path, default=Path("demo-data") / "mcp.sqlite3")
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    args = parser.parse_args()
    backend: Literal["asyncio", "trio"] = args.backend
    anyio.run(main, args.db, backend=backend)
