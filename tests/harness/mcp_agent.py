"""An agent whose one tool comes from an MCP server, for the SIGKILL test.

    python tests/harness/mcp_agent.py --db PATH --ledger PATH --events PATH \\
        --tool record|mark|liar [--trust] --backend asyncio|trio [--no-delay]

Runs session ``s`` of the SQLite database ``--db`` (created on the first
run) with ``McpTools`` over the light stdio fixture server
(tests/fixtures/mcp_light_server.py: the tools of mcp_server.py without the
SDK, so that each start costs milliseconds, not the SDK's import). The model
(stateless, from the history) calls ``--tool`` once with ``delay=60``: the
server appends its ledger line, then sleeps, so the parent can SIGKILL this
process mid-call. ``record`` is not idempotent (no annotations); ``mark``
says ``idempotentHint``; ``liar`` says ``readOnlyHint`` falsely. ``--trust``
sets ``trust_annotations=True`` (else the default). ``--no-delay`` tells the
server not to sleep (the resumed run).

Prints one JSON line: the final text, and each tool result (content, is_error).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import anyio

from stepmachine import (
    Message,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    SessionNotFoundError,
    StateMachine,
)
from stepmachine.operations import McpStdio, McpTools
from stepmachine.stores import SQLiteStore
from stepmachine.testing import FunctionModel, call, reply

SERVER = Path(__file__).parent.parent / "fixtures" / "mcp_light_server.py"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", type=Path, required=True)
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--tool", choices=["record", "mark", "liar"], required=True)
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--no-delay", action="store_true")
    parser.add_argument("--trust", action="store_true")
    args = parser.parse_args()

    def model(request: ModelRequest) -> ModelResponse:
        last = request.messages[-1]
        if last.role == "user":
            return call((args.tool, {"note": "once", "delay": 60}))
        (result,) = last.tool_results
        return reply(f"error: {result.content}" if result.is_error else result.content)

    async def run() -> None:
        env = {"MCP_LEDGER": args.ledger, "MCP_EVENTS": args.events}
        if args.no_delay:
            env["MCP_NO_DELAY"] = "1"
        server = McpStdio(
            command=sys.executable,
            args=[str(SERVER)],
            env=env,
            name="fx",
            **({"trust_annotations": True} if args.trust else {}),  # else the default
        )
        machine = StateMachine([McpTools([server]), ModelInference()])
        async with await SQLiteStore.open(args.db) as store:
            try:
                await store.load("s")
            except SessionNotFoundError:
                await store.create("s", conversation=[Message.user("go", id="u1")])
            runtime = Runtime(store=store, model=FunctionModel(model))
            session = await machine.run(runtime, "s")
        results = [
            {"content": r.content, "is_error": r.is_error}
            for m in session.conversation
            for r in m.tool_results
        ]
        final = session.conversation[-1].text
        print(json.dumps({"final": final, "results": results}), flush=True)

    anyio.run(run, backend=args.backend)


if __name__ == "__main__":
    main()
