"""A child for tests/test_attack34c_kills.py: staged work whose task raises, SIGKILLed
while the machine writes what it holds, then resumed by a fresh process.

    python _attack34c_kill_child.py KIND FOLDER MODE

KIND: ``sqlite`` or ``file`` (the store in FOLDER). Task ``a`` journals its side effect
in FOLDER/journal.txt and lands; task ``b`` raises. MODE:

* ``before_keep``: killed as the first held record (``b``'s keep) is about to be written;
* ``after_keep``: killed once ``b``'s keep is stored, before ``a``'s receipt is written;
* ``after_receipt``: killed once ``a``'s receipt is stored (before the error propagates);
* ``resume``: a plain ``run()``; prints ``finished <reason>``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
from _attack34c_common import SID, is_record_of, open_store, two_tasks

from stepmachine import Runtime
from stepmachine.stores import FileStore, SQLiteStore


def journal(folder: Path, line: str) -> None:
    with (folder / "journal.txt").open("a") as handle:
        handle.write(line + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


async def reopen(kind: str, folder: Path) -> Any:
    from _attack34a_common import Order

    from stepmachine import Codec

    if kind == "sqlite":
        return await SQLiteStore.open(folder / "db.sqlite3", codec=Codec(Order))
    return await FileStore.open(folder / "store", codec=Codec(Order))


async def main(kind: str, where: str, mode: str) -> None:
    folder = Path(where)
    fresh = not (folder / "created").exists()
    store = await open_store(kind, folder) if fresh else await reopen(kind, folder)
    (folder / "created").write_text("yes")
    landed = anyio.Event()
    done: list[str] = []

    async def hold_a() -> None:
        journal(folder, f"a {mode}")
        landed.set()
        await anyio.sleep_forever()

    async def b_run() -> None:
        await landed.wait()
        raise RuntimeError("bug in b")

    machine = two_tasks(done, a_landed=hold_a, b_run=b_run)
    inner = store.apply

    async def apply(batch: Any, **kw: Any) -> Any:
        if mode == "before_keep" and is_record_of(batch, "kept", "b"):
            kill()
        written = await inner(batch, **kw)
        if mode == "after_keep" and is_record_of(batch, "kept", "b"):
            kill()
        if mode == "after_receipt" and is_record_of(batch, "receipts", "a"):
            kill()
        return written

    store.apply = apply
    try:
        report = await machine.run_report(Runtime(store=store), SID)
        print(f"finished {report.reason.kind}", flush=True)  # noqa: T201 - to the parent
    finally:
        await store.aclose()


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:4])
