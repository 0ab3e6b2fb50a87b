"""Media in application data get the store's ``max_media_bytes`` too (issue 22).

Media in a data field are stored inline (base64) in every record that sets
them and in every snapshot, not by digest; the store refuses a part over its
limit there with ``MediaTooLargeError`` naming the field and the limit, before
anything is written, for ``UpdateData`` and for ``create(data=...)``, in every
store.
"""

from __future__ import annotations

import pickle
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from stepmachine import Codec, Effect, ImagePart, MediaTooLargeError, Session, UpdateData
from stepmachine.extend import Batch
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore

LIMIT = 1_000


class Album(msgspec.Struct, frozen=True):
    title: str = ""
    cover: ImagePart | None = None
    pages: tuple[ImagePart, ...] = ()


CODEC: Codec[Any] = Codec(Album)


def _image(size: int) -> ImagePart:
    return ImagePart(
        media_type="image/png", data=bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    )


def _batch(session: Session[Any], *effects: Effect) -> Batch[Effect]:
    return Batch(
        session_id=session.id,
        revision=session.revision + 1,
        step="test",
        cycle=0,
        timestamp=1.0,
        effects=effects,
    )


@pytest.fixture(params=["memory", "file", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    opened: Any
    if request.param == "memory":
        opened = MemoryStore(CODEC, max_media_bytes=LIMIT)
    elif request.param == "file":
        opened = await FileStore.open(tmp_path / "files", codec=CODEC, max_media_bytes=LIMIT)
    else:
        opened = await SQLiteStore.open(tmp_path / "db.sqlite3", codec=CODEC, max_media_bytes=LIMIT)
    try:
        yield opened
    finally:
        if hasattr(opened, "aclose"):
            await opened.aclose()


@pytest.mark.parametrize("size", [LIMIT + 1, LIMIT + 2, LIMIT + 3, 50 * LIMIT])
async def test_an_update_with_an_image_over_the_limit_is_refused_naming_the_field(
    store: Any, size: int
) -> None:
    with anyio.fail_after(20):
        session = await store.create("s", data=Album(title="a"))
        with pytest.raises(MediaTooLargeError) as caught:
            await store.apply(_batch(session, UpdateData.set(cover=_image(size))))
        loaded = await store.load("s")
    assert caught.value.field == "cover"
    assert caught.value.limit == LIMIT
    assert caught.value.size == size
    assert "'cover'" in str(caught.value)
    assert "max_media_bytes" in str(caught.value)
    assert loaded.revision == 0  # nothing written
    assert loaded.data == Album(title="a")
    assert pickle.loads(pickle.dumps(caught.value)).field == "cover"


async def test_an_image_at_the_limit_in_data_is_stored(store: Any) -> None:
    with anyio.fail_after(20):
        session = await store.create("s", data=Album())
        pages = (_image(10), _image(LIMIT))
        await store.apply(_batch(session, UpdateData.set(pages=pages, cover=_image(LIMIT - 1))))
        loaded = await store.load("s")
    assert loaded.data.pages == pages
    assert loaded.data.cover == _image(LIMIT - 1)


async def test_a_nested_image_over_the_limit_is_refused_at_create(store: Any) -> None:
    with anyio.fail_after(20):
        with pytest.raises(MediaTooLargeError) as caught:
            await store.create("s", data=Album(pages=(_image(1), _image(LIMIT + 1))))
        assert "s" not in await store.list_sessions()
    assert caught.value.field == "pages[1]"


async def test_an_update_built_with_the_part_itself_is_checked(store: Any) -> None:
    with anyio.fail_after(20):
        session = await store.create("s", data=Album())
        with pytest.raises(MediaTooLargeError):
            await store.apply(_batch(session, UpdateData(changes={"cover": _image(LIMIT + 1)})))
