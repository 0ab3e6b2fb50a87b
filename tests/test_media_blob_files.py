"""Media blobs on disk and in tables under outside damage (issue 22).

A FIFO in place of a FileStore blob never blocks a read or a write (a
subprocess with a timeout, so a regression fails instead of hanging the suite);
a ``.media`` folder that is a symbolic link is refused for reads and writes; a
damaged blob (wrong size, or the right size and wrong bytes) is rewritten by the
next write of the same bytes, in the file and SQLite stores.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
from contextlib import closing
from pathlib import Path
from typing import Any

import anyio
import pytest

from stepmachine import AppendMessage, Effect, ImagePart, Message, Session, StoredDataError
from stepmachine.extend import Batch, media_digest
from stepmachine.stores import FileStore, SQLiteStore
from stepmachine.stores._media_blobs import VERIFIED

ROOT = Path(__file__).resolve().parent.parent
IMAGE = bytes(range(256)) * 64
DIGEST = media_digest(IMAGE)
HEX = DIGEST.removeprefix("sha256:")


def _image(data: bytes = IMAGE) -> ImagePart:
    return ImagePart(media_type="image/png", data=data)


def _user(index: int, *media: ImagePart) -> Message:
    return Message.user(f"look {index}", id=f"m{index}", media=list(media))


def _batch(session: Session[Any], *effects: Effect) -> Batch[Effect]:
    return Batch(
        session_id=session.id,
        revision=session.revision + 1,
        step="test",
        cycle=0,
        timestamp=1.0,
        effects=effects,
    )


async def _one_image(folder: Path, session_id: str = "s") -> None:
    store = await FileStore.open(folder)
    try:
        session = await store.create(session_id, conversation=[_user(0)])
        await store.apply(_batch(session, AppendMessage(_user(1, _image()))))
    finally:
        await store.aclose()


# -- a FIFO in place of a blob ------------------------------------------------------------------

_FIFO_CHILD = textwrap.dedent(
    """
    import sys, anyio
    from stepmachine import AppendMessage, Batch, ImagePart, Message, StoredDataError
    from stepmachine.stores import FileStore

    IMAGE = bytes(range(256)) * 64

    async def main(folder, what):
        store = await FileStore.open(folder)
        try:
            if what == "write":
                session = await store.create("t", conversation=[Message.user("x", id="m0")])
                image = ImagePart(media_type="image/png", data=IMAGE)
                batch = Batch(session_id="t", revision=1, step="test", cycle=0, timestamp=1.0,
                              effects=(AppendMessage(Message.user("y", id="m1", media=[image])),))
                await store.apply(batch)
                print("WROTE")
                return
            try:
                if what == "load":
                    await store.load("s")
                else:
                    await store.load_at("s", 1)
            except StoredDataError as exc:
                print("REFUSED", exc)
        finally:
            await store.aclose()

    anyio.run(main, sys.argv[1], sys.argv[2])
    """
)


def _child(folder: Path, what: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(  # a regression blocks in open(): the timeout kills the child
        [sys.executable, "-c", _FIFO_CHILD, str(folder), what],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


@pytest.mark.parametrize("what", ["load", "load_at"])
def test_a_fifo_in_place_of_a_blob_is_refused_without_blocking(tmp_path: Path, what: str) -> None:
    folder = tmp_path / "files"
    anyio.run(_one_image, folder)
    (folder / "s.snap").unlink(missing_ok=True)  # a cold load reads the blobs
    blob = folder / ".media" / HEX
    blob.unlink()
    os.mkfifo(blob)
    out = _child(folder, what)
    assert out.startswith("REFUSED"), out
    assert "FIFO" in out
    assert HEX in out


def test_a_write_of_the_same_bytes_replaces_a_fifo_in_place_of_a_blob(tmp_path: Path) -> None:
    folder = tmp_path / "files"
    anyio.run(_one_image, folder)
    blob = folder / ".media" / HEX
    blob.unlink()
    os.mkfifo(blob)
    assert _child(folder, "write").strip() == "WROTE"
    assert blob.is_file()
    assert blob.read_bytes() == IMAGE
    assert "REFUSED" not in _child(folder, "load_at")


# -- a .media folder that is a symbolic link ----------------------------------------------------


@pytest.mark.anyio
async def test_a_symlinked_media_folder_is_refused_for_reads(tmp_path: Path) -> None:
    folder = tmp_path / "files"
    outside = tmp_path / "outside"
    with anyio.fail_after(20):
        await _one_image(folder)
        (folder / ".media").rename(outside)
        (folder / ".media").symlink_to(outside)
        store = await FileStore.open(folder)
        try:
            with pytest.raises(StoredDataError, match="symbolic link") as caught:
                await store.load_at("s", 1)
        finally:
            await store.aclose()
    assert ".media" in str(caught.value)


@pytest.mark.anyio
async def test_a_symlinked_media_folder_is_refused_for_writes(tmp_path: Path) -> None:
    folder = tmp_path / "files"
    outside = tmp_path / "outside"
    outside.mkdir()
    with anyio.fail_after(20):
        store = await FileStore.open(folder)
        try:
            (folder / ".media").symlink_to(outside)
            session = await store.create("s", conversation=[_user(0)])
            with pytest.raises(StoredDataError, match="symbolic link"):
                await store.apply(_batch(session, AppendMessage(_user(1, _image()))))
            assert (await store.load("s")).revision == 0  # nothing written
        finally:
            await store.aclose()
    assert list(outside.iterdir()) == []


# -- a damaged blob is repaired by the next write of the same bytes ------------------------------


def _damage(kind: str, path: Path, body: bytes) -> None:
    if kind == "file":
        (path / "files" / ".media" / HEX).write_bytes(body)
    else:
        with closing(sqlite3.connect(path / "db.sqlite3")) as conn, conn:
            conn.execute("UPDATE media SET body = ? WHERE digest = ?", (body, DIGEST))


async def _open(kind: str, path: Path) -> Any:
    if kind == "file":
        return await FileStore.open(path / "files")
    return await SQLiteStore.open(path / "db.sqlite3")


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["file", "sqlite"])
@pytest.mark.parametrize("damage", ["shorter", "same size"])
async def test_a_damaged_blob_is_rewritten_by_a_write_of_the_same_bytes(
    tmp_path: Path, kind: str, damage: str
) -> None:
    body = IMAGE[:10] if damage == "shorter" else bytes(len(IMAGE))
    with anyio.fail_after(20):
        store = await _open(kind, tmp_path)
        session = await store.create("s", conversation=[_user(0)])
        await store.apply(_batch(session, AppendMessage(_user(1, _image()))))
        await store.aclose()
        _damage(kind, tmp_path, body)
        VERIFIED._seen.clear()  # a new process: nothing verified yet
        store = await _open(kind, tmp_path)
        other = await store.create("t", conversation=[_user(0)])
        await store.apply(_batch(other, AppendMessage(_user(1, _image(bytes(IMAGE))))))
        await store.aclose()
        again = await _open(kind, tmp_path)
        try:
            first = await again.load_at("s", 1)  # the damaged blob was repaired for both
            second = await again.load_at("t", 1)
        finally:
            await again.aclose()
    assert first.conversation[-1].parts[-1] == _image()
    assert second.conversation[-1].parts[-1] == _image()
