"""A child process for tests/test_lease_files_not_regular.py: one FileStore lease operation.

    python tests/_lease_child.py OP FOLDER SESSION BACKEND

OP: ``claim`` (claim SESSION), ``claim_next``, ``request_run`` (of SESSION).
Prints one JSON line: ``{"ok": repr}`` or ``{"error": type, "message": text}``.
Run under a timeout by the parent: a hang there is the defect.
"""

from __future__ import annotations

import json
import sys

import anyio

from stepmachine.stores import FileStore


async def main(op: str, folder: str, session_id: str) -> dict[str, str]:
    async with await FileStore.open(folder) as store:
        try:
            if op == "claim":
                got = await store.claim(session_id, "child", 5.0)
            elif op == "claim_next":
                got = await store.claim_next("child", 5.0)
            else:
                got = await store.request_run(session_id)
        except Exception as exc:
            return {"error": type(exc).__name__, "message": str(exc)}
        return {"ok": repr(got)}


if __name__ == "__main__":
    op, folder, sid, backend = sys.argv[1:5]
    sys.stdout.write(json.dumps(anyio.run(main, op, folder, sid, backend=backend)) + "\n")
