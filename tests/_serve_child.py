"""A serve() worker for tests/test_serve_failures.py that is SIGKILLed during its backoff.

    python tests/_serve_child.py KIND PATH WHEN

KIND: ``file`` (FileStore at PATH) or ``sqlite`` (SQLiteStore at PATH). Its store's
first ``load`` raises OSError (a transient fault), so serve() parks/keeps the turn
for a long backoff (60 s); it prints ``backing-off`` once the retry is logged, then
waits to be killed. WHEN ``at-log``: it stops itself (SIGSTOP) right as
``serve_run_retried`` is logged, i.e. after the failed run gave its lease back and
before the turn is parked again -- the instant a SIGKILL then hits; ``later``: it
goes on (the turn is parked) until the parent kills it.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import anyio
import structlog

from stepmachine import ModelInference, Runtime, StateMachine, run_worker
from stepmachine import _transient as transient
from stepmachine.stores import FileStore, SQLiteStore
from stepmachine.testing import FunctionModel, reply

transient.BACKOFF_FIRST = 60.0
transient.BACKOFF_CAP = 120.0


def _printer(logger: Any, name: str, event: dict[str, Any]) -> Any:
    if event.get("event") == "serve_run_retried":
        sys.stdout.write("backing-off\n")
        sys.stdout.flush()
        if sys.argv[3] == "at-log":
            os.kill(os.getpid(), signal.SIGSTOP)
    raise structlog.DropEvent


structlog.configure(processors=[_printer])


def faulty(base: type) -> type:
    class Faulty(base):  # type: ignore[misc, valid-type]
        failed = False

        async def load(self, session_id: str) -> Any:
            if not Faulty.failed:
                Faulty.failed = True
                raise OSError(5, "injected: the disk did not answer")
            return await super().load(session_id)

    return Faulty


async def main(kind: str, path: str) -> None:
    cls = faulty(FileStore if kind == "file" else SQLiteStore)
    store = await cls.open(path)
    runtime = Runtime(store=store, model=FunctionModel(lambda r: reply("from the child")))
    await run_worker(StateMachine([ModelInference()]), runtime, poll=0.01, ttl=5)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2])
