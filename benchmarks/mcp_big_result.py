"""Peak memory and time of one huge MCP tool result (issue 22, item 11).

    python benchmarks/mcp_big_result.py [MEGABYTES] [--backend asyncio|trio]

A real stdio server (tests/fixtures/mcp_server.py) answers ``big`` with a text
of MEGABYTES million characters (default 50); ``McpTools`` (default
``max_result_chars=100_000``) turns it into an error result. Prints the time
of the run and the growth of the agent's peak resident memory (``ru_maxrss``)
over its value before the call, in MB and as a multiple of the result's size.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import anyio

from stepmachine import Message, ModelInference, Runtime, StateMachine
from stepmachine.operations import McpStdio, McpTools
from stepmachine.stores import MemoryStore
from stepmachine.testing import ScriptedModel, call, reply

SERVER = Path(__file__).parent.parent / "tests" / "fixtures" / "mcp_server.py"


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def main(megabytes: int) -> None:
    chars = megabytes * 1_000_000
    server = McpStdio(command=sys.executable, args=[str(SERVER), "stdio"], name="fx")
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("go", id="u1")])
    model = ScriptedModel([call(("big", {"chars": chars})), reply("done")])
    machine = StateMachine([McpTools([server], timeout=600), ModelInference()])
    before = peak_mb()
    started = time.perf_counter()
    session = await machine.run(Runtime(store=store, model=model), "s")
    took = time.perf_counter() - started
    grown = peak_mb() - before
    (result,) = [r for m in session.conversation for r in m.tool_results]
    print(f"result: {result.content[:100]!r} (is_error={result.is_error})")
    print(
        f"{megabytes} MB result: {took:.1f} s, peak memory +{grown:.0f} MB "
        f"({grown / megabytes:.1f}x the result)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("megabytes", type=int, nargs="?", default=50)
    parser.add_argument("--backend", default="asyncio")
    args = parser.parse_args()
    anyio.run(main, args.megabytes, backend=args.backend)
