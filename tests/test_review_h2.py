"""Outside review of the "Hardening 2" fixes: attempts to break them with real faults.

Each test states the right behaviour. A test that passes records what held; a
strict xfail records a defect (its reason says what happens and what should).
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from stepmachine import (
    ConflictError,
    ImagePart,
    Message,
    ModelInference,
    Refuse,
    Runtime,
    StateMachine,
    StepContractError,
    StoredDataError,
    ToolOutput,
    ToolResultPart,
    Tools,
    tool,
)
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore
from stepmachine.testing import FunctionModel, ScriptedModel, call, reply


def _img_msg(data: bytes, mid: str = "u1") -> Message:
    return Message.user("look", id=mid, media=[ImagePart(media_type="image/png", data=data)])


def _damage_same_size(kind: str, tmp_path: Path, data: bytes) -> None:
    from stepmachine.extend import media_digest

    digest = media_digest(data)
    bad = bytes([data[0] ^ 0xFF]) + data[1:]
    if kind == "file":
        blob = tmp_path / "files" / ".media" / digest.removeprefix("sha256:")
        blob.write_bytes(bad)
    else:
        db = sqlite3.connect(tmp_path / "db.sqlite3")
        with db:
            changed = db.execute("UPDATE media SET body = ? WHERE digest = ?", (bad, digest))
            assert changed.rowcount == 1
        db.close()


# -- error text names guarantees in words, never by number --------------------------------


_NUMBERED = re.compile(r"\binvariant \d+\b", re.IGNORECASE)


async def test_errors_name_guarantees_in_words_not_numbers(tmp_path: Path) -> None:
    shown: list[str] = [str(ConflictError("s", 1, 2))]
    data = os.urandom(2000)
    async with await FileStore.open(tmp_path / "files") as store:
        await store.create("s1", conversation=[_img_msg(data)])
    _damage_same_size("file", tmp_path, data)
    async with await FileStore.open(tmp_path / "files") as store:
        with pytest.raises(StoredDataError) as caught:
            await store.load("s1")
    shown.append(str(caught.value))
    assert "stored data is data" in shown[1] or "damaged" in shown[1]
    numbered = [text[:120] for text in shown if _NUMBERED.search(text)]
    assert not numbered, numbered


def test_public_docstrings_name_guarantees_in_words() -> None:
    import stepmachine

    numbered = []
    for name in stepmachine.__all__:
        doc = getattr(getattr(stepmachine, name), "__doc__", None) or ""
        if _NUMBERED.search(doc) and not isinstance(getattr(stepmachine, name), str):
            numbered.append(name)
    assert not numbered, numbered


# -- SQLite: a FIFO beside the database (-wal, -journal, -shm) -----------------------------


def _cli_child(*args: str, timeout: float = 20) -> subprocess.CompletedProcess[str] | None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        return subprocess.run(
            [sys.executable, "-m", "stepmachine", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None


@pytest.mark.parametrize(
    "suffix",
    [
        "-wal",
        "-shm",
        "-journal",
    ],
)
def test_a_fifo_beside_the_sqlite_database_never_blocks_the_cli(
    tmp_path: Path, suffix: str
) -> None:
    """Someone left a FIFO where SQLite keeps its WAL, shared memory or journal: the
    read commands end (with an error or a listing), they never hang."""
    path = tmp_path / "agent.sqlite3"

    async def make() -> None:
        store = await SQLiteStore.open(path)
        await store.create("s1", conversation=[Message.user("hi", id="u1")])
        await store.aclose()

    anyio.run(make)
    side = Path(str(path) + suffix)
    side.unlink(missing_ok=True)
    os.mkfifo(side)
    for command in (("sessions", "list"), ("show", "s1")):
        done = _cli_child("--store", f"sqlite:///{path}", *command)
        assert done is not None, f"{command} hung on a FIFO at {side.name} (killed after 20 s)"
        assert "Traceback" not in done.stderr, done.stderr[-1500:]


# -- a step's contract: a careless run() -----------------------------------------------


async def test_a_sync_run_is_a_step_contract_error_naming_the_step() -> None:
    class Careless:
        name = "careless"

        def run(self, ctx: Any) -> Any:
            return Refuse("not now")

    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    with anyio.fail_after(10), pytest.raises(StepContractError) as caught:
        await StateMachine([Careless(), ModelInference()]).run(
            Runtime(store=store, model=ScriptedModel([reply("x")])), "s"
        )
    assert "careless" in str(caught.value)
    assert "async" in str(caught.value)


# -- an oversized tool image in a parallel batch ---------------------------------------


async def test_one_oversized_image_in_a_parallel_batch_spares_the_others() -> None:
    """Two pure calls in one batch, one returns an image past max_media_bytes: that one
    is an error result naming size and limit, the other keeps its image, the turn ends."""
    store = MemoryStore(max_media_bytes=10_000)
    await store.create("s", conversation=[Message.user("draw", id="u1")])

    async def draw(size: int) -> ToolOutput:
        """Draw (pure)."""
        data = b"\x89PNG\r\n\x1a\n" + b"\0" * size
        return ToolOutput("drawn", (ImagePart(media_type="image/png", data=data),))

    def answer(request: Any) -> Any:
        if request.messages[-1].role == "user":
            return call(("draw", {"size": 100}), ("draw", {"size": 50_000}))
        return reply("done")

    machine = StateMachine([Tools([tool(side_effects="pure")(draw)]), ModelInference()])
    with anyio.fail_after(30):
        session = await machine.run(Runtime(store=store, model=FunctionModel(answer)), "s")
    results = [p for m in session.conversation for p in m.parts if isinstance(p, ToolResultPart)]
    assert len(results) == 2
    big = [r for r in results if r.is_error]
    assert len(big) == 1
    assert "10,000" in str(big[0].content) or "10000" in str(big[0].content)
    images = [p for m in session.conversation for p in m.parts if isinstance(p, ImagePart)]
    assert len(images) == 1
    assert session.conversation[-1].text == "done"
