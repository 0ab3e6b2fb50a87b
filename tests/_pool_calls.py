"""Helpers for the tests of the stores' worker-thread pool (``stepmachine._threads``)."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any

from stepmachine._threads import Pool


async def call_in(pool: Pool, function: Any, *args: Any) -> Any:
    """``function(*args)`` through ``pool`` from this asyncio task (as run_in_thread does)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    pool.submit((loop, future, contextvars.copy_context(), function, args))
    return await future


def workers_of(pool: Pool) -> list[threading.Thread]:
    """The live threads of ``pool``."""
    return [t for t in threading.enumerate() if getattr(t, "pool", None) is pool]
