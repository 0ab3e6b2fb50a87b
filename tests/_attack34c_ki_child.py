"""A child for tests/test_attack34c_errorpath.py: KeyboardInterrupt in a concurrent task
under ``asyncio.run`` (asyncio lets it out of the event loop at once).

    python _attack34c_ki_child.py FOLDER

Task ``a`` lands and waits; task ``b`` raises ``KeyboardInterrupt``. The store is
FOLDER/db.sqlite3; ``a``'s side effect is journalled in FOLDER/journal.txt.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import anyio
from _attack34c_common import SID, open_store, two_tasks

from stepmachine import Runtime


async def main(folder: Path) -> None:
    store = await open_store("sqlite", folder)
    journal: list[str] = []
    landed = anyio.Event()

    async def hold_a() -> None:
        (folder / "journal.txt").write_text("a\n")
        landed.set()
        await anyio.sleep_forever()

    async def b_run() -> None:
        await landed.wait()
        raise KeyboardInterrupt

    machine = two_tasks(journal, a_landed=hold_a, b_run=b_run)
    try:
        await machine.run(Runtime(store=store), SID)
    finally:
        await store.aclose()


if __name__ == "__main__":
    try:
        asyncio.run(main(Path(sys.argv[1])))
    except KeyboardInterrupt:
        print("KeyboardInterrupt", file=sys.stderr, flush=True)  # noqa: T201
        # An ordinary exit, which waits for every non-daemon thread: it hung here when
        # the run raised the interrupt a second time during asyncio.run's clean-up,
        # which then never told anyio's worker thread (the store's) to stop.
        sys.exit(130)
