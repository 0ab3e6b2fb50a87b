"""A child process that reads a store once and prints what it got as one JSON line.

The tests of non-regular files (a FIFO in place of a log) run readers here, in a
subprocess the test can kill: a reader that blocks in ``open()`` fails its test with
a timeout instead of stalling the whole suite.

Usage: ``python _store_reader_child.py load|web STORE_URL SESSION BACKEND``

- ``load``: ``FileStore.load(SESSION)`` (the store URL is ``file://FOLDER``); prints
  ``{"revision": n}`` or ``{"error": type name, "message": text}``.
- ``web``: ``GET /`` and ``GET /api/sessions`` of the inspector's web app over the
  store; prints ``{"status": [page, api], "page": html, "api": json}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import anyio
import httpx

from stepmachine import StepmachineError
from stepmachine.inspector._open import open_store
from stepmachine.inspector._web import create_app
from stepmachine.stores import FileStore


async def _load(url: str, session_id: str) -> dict[str, Any]:
    async with await FileStore.open(url.removeprefix("file://")) as store:
        try:
            session = await store.load(session_id)
        except StepmachineError as exc:
            return {"error": type(exc).__name__, "message": str(exc)}
        return {"revision": session.revision}


async def _web(url: str) -> dict[str, Any]:
    async with await open_store(url) as store:
        app = create_app(store)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            page = await http.get("/")
            api = await http.get("/api/sessions")
    return {
        "status": [page.status_code, api.status_code],
        "page": page.text,
        "api": api.json() if api.status_code == 200 else api.text,
    }


def main() -> None:
    mode, url, session_id, backend = sys.argv[1:5]

    async def run() -> dict[str, Any]:
        return await (_load(url, session_id) if mode == "load" else _web(url))

    sys.stdout.write(json.dumps(anyio.run(run, backend=backend)) + "\n")


if __name__ == "__main__":
    main()
