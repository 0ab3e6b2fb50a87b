"""Which async library runs here, told cheaply, and a checkpoint that uses it.

anyio answers "which library?" through sniffio on every call it dispatches;
a hot path that only needs to know "plain asyncio, or anything else?" asks
:func:`asyncio_here`, and :func:`checkpoint` is ``anyio.lowlevel.checkpoint()``
without that lookup on asyncio.
"""

from __future__ import annotations

import asyncio

import anyio.lowlevel

__all__ = ["asyncio_here", "checkpoint"]


try:
    import sniffio as _sniffio
except ImportError:  # pragma: no cover - anyio runs without it
    _sniffio = None  # type: ignore[assignment]


def asyncio_here() -> bool:
    """Whether anyio runs on asyncio here, as anyio itself would tell.

    anyio asks sniffio, which answers its thread-local name or its context
    variable when set (trio sets one, so do anyio's worker threads), else
    ``"asyncio"`` when an asyncio task runs. This says True only in that last
    case, cheaply; anything else (trio, a name set explicitly, no event loop)
    is left to anyio's own calls.
    """
    if _sniffio is not None and (
        _sniffio.thread_local.name is not None
        or _sniffio.current_async_library_cvar.get() is not None
    ):
        return False
    try:
        return asyncio.current_task() is not None
    except RuntimeError:  # no event loop running here
        return False


async def checkpoint() -> None:
    """``anyio.lowlevel.checkpoint()``: on asyncio, ``asyncio.sleep(0)`` as anyio's
    asyncio backend does, without anyio asking sniffio which library runs; anywhere
    else anyio's own (see :func:`asyncio_here`)."""
    if asyncio_here():
        await asyncio.sleep(0)
    else:
        await anyio.lowlevel.checkpoint()
