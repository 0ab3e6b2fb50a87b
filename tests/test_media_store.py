"""Media bytes in the stores: kept once, by digest, apart from the records.

The design is in ``stores/_media_blobs.py``.

Every store (memory, file, SQLite, PostgreSQL): a round trip across a reopen
(a cold load reads the blobs back), the bytes not inside the records, the same
bytes in two messages, two sessions and a fork stored once, load_at / fork /
compaction keep them, a part over ``max_media_bytes`` refused with nothing
written, a missing or damaged blob a ``StoredDataError`` naming the session and
position, a reader that does not know the reference tag refusing it, arbitrary
bytes round-tripping (hypothesis), a cycle without media reading and writing
no blob, and a process SIGKILLed between the blob write and the batch write.
The shared round trips are also in the store conformance suite
(``stepmachine.testing.conformance``).
"""

from __future__ import annotations

import base64
import os
import random
import sqlite3
import struct
import subprocess
import sys
import tempfile
import textwrap
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepmachine import (
    AppendMessage,
    AudioPart,
    ConfigurationError,
    DocumentPart,
    Effect,
    ImagePart,
    MediaRef,
    MediaTooLargeError,
    Message,
    NoData,
    ReplaceConversation,
    Session,
    StoredDataError,
    TextPart,
    submit,
)
from stepmachine.extend import Batch, apply_batch, media_digest, message_tokens
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore
from stepmachine.stores._file_backend import FileBackend
from stepmachine.stores._media_blobs import Media, Reader


def png_header(width: int, height: int) -> bytes:
    """A PNG signature and a valid IHDR chunk declaring ``width`` x ``height`` (no pixels)."""
    ihdr = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + ihdr + struct.pack(">I", zlib.crc32(ihdr))


_PNG64 = png_header(64, 64)
SHOT = ImagePart(media_type="image/png", data=_PNG64 + b"shot")
OTHER = ImagePart(media_type="image/png", data=_PNG64 + b"other")

ROOT = Path(__file__).resolve().parent.parent
IMAGE = random.Random(14).randbytes(64 * 1024)
"""Random bytes (the same in a child process): they do not compress, so inline
base64 would show in the sizes."""

KINDS = ["memory", "file", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
DURABLE = ["file", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def image(data: bytes = IMAGE) -> ImagePart:
    return ImagePart(media_type="image/png", data=data)


def user(index: int, *media: ImagePart | DocumentPart | AudioPart) -> Message:
    return Message.user(f"look {index}", id=f"m{index}", media=list(media))


def batch_for(session: Session[Any], *effects: Effect) -> Batch[Effect]:
    return Batch(
        session_id=session.id,
        revision=session.revision + 1,
        step="test",
        cycle=0,
        timestamp=1.0,
        effects=effects,
    )


async def apply(store: Any, session: Session[Any], *effects: Effect) -> Session[Any]:
    returned: Session[Any] = await store.apply(batch_for(session, *effects))
    assert returned == apply_batch(session, effects)
    return returned


@dataclass
class Place:
    """Where one kind of store keeps its data; opens instances on it and looks inside."""

    kind: str
    path: Path
    dsn: str = ""
    memory: MemoryStore | None = None
    opened: list[Any] = field(default_factory=list)

    async def open(self, **options: Any) -> Any:
        """A store on this place (the same instance for memory: it cannot be reopened)."""
        store: Any
        if self.kind == "memory":
            if self.memory is None or options:
                self.memory = MemoryStore(**options)
            return self.memory
        if self.kind == "file":
            store = await FileStore.open(self.path / "files", **options)
        elif self.kind == "sqlite":
            store = await SQLiteStore.open(self.path / "db.sqlite3", **options)
        else:
            from stepmachine.stores import PostgresStore

            store = await PostgresStore.open(self.dsn, **options)
        self.opened.append(store)
        return store

    def blobs(self) -> dict[str, int]:
        """The stored blobs: digest to size."""
        if self.kind == "memory":
            assert self.memory is not None
            return {d: len(b) for d, b in self.memory._blobs.items()}
        if self.kind == "file":
            folder = self.path / "files" / ".media"
            if not folder.exists():
                return {}
            return {
                "sha256:" + p.name: p.stat().st_size
                for p in folder.iterdir()
                if not p.name.startswith(".")
            }
        rows = self.sql("SELECT digest, length(body) FROM {media}")
        return {str(d): int(n) for d, n in rows}

    def record_bytes(self) -> int:
        """The bytes of every stored record (logs, snapshots, effect rows)."""
        if self.kind == "file":
            return sum(p.stat().st_size for p in (self.path / "files").iterdir() if p.is_file())
        if self.kind == "sqlite":
            query = (
                "SELECT (SELECT coalesce(sum(length(body)), 0) FROM effects)"
                " + (SELECT coalesce(sum(length(body)), 0) FROM batches)"
                " + (SELECT coalesce(sum(length(body)), 0) FROM snapshots)"
            )
        else:
            query = (
                "SELECT (SELECT coalesce(sum(length(body)), 0) FROM stepmachine.effects)"
                " + (SELECT coalesce(sum(length(body)), 0) FROM stepmachine.snapshots)"
            )
        return int(self.sql(query)[0][0])

    def damage(self, digest: str, body: bytes | None) -> None:
        """Replace a blob's bytes with ``body``, or remove it (None)."""
        if self.kind == "memory":
            assert self.memory is not None
            blobs = self.memory._blobs
            if body is None:
                del blobs[digest]
            else:
                blobs[digest] = body
        elif self.kind == "file":
            path = self.path / "files" / ".media" / digest.removeprefix("sha256:")
            if body is None:
                path.unlink()
            else:
                path.write_bytes(body)
        elif body is None:
            self.sql("DELETE FROM {media} WHERE digest = %s", (digest,))
        else:
            self.sql("UPDATE {media} SET body = %s WHERE digest = %s", (body, digest))

    def sql(self, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        if self.kind == "sqlite":
            statement = statement.replace("%s", "?").format(media="media")
            with closing(sqlite3.connect(self.path / "db.sqlite3")) as conn, conn:
                try:
                    return list(conn.execute(statement, params).fetchall())
                except sqlite3.OperationalError as exc:
                    if "no such table" in str(exc):
                        return []
                    raise
        import psycopg

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            cursor = conn.execute(statement.format(media="stepmachine.media"), params)
            return list(cursor.fetchall()) if cursor.description else []

    async def aclose(self) -> None:
        for store in self.opened:
            await store.aclose()
        self.opened.clear()


@pytest.fixture
async def place(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Place]:
    kind: str = request.param
    dsn = request.getfixturevalue("postgres_dsn") if kind == "postgres" else ""
    made = Place(kind, tmp_path, dsn)
    try:
        yield made
    finally:
        await made.aclose()


# -- round trips ------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("place", KINDS, indirect=True)
async def test_round_trip_across_a_reopen_and_bytes_kept_apart(place: Place) -> None:
    store = await place.open()
    pdf = DocumentPart(media_type="application/pdf", data=b"%PDF" + IMAGE[:999], title="t")
    session = await store.create("s", conversation=[user(0, image(), pdf)])
    session = await apply(store, session, AppendMessage(user(1, image(IMAGE[:500]))))
    session = await apply(store, session, AppendMessage(Message.user("no media", id="m2")))
    long = Message.user("y" * 20_000, id="m3", media=[image()])  # a record stored compressed
    session = await apply(store, session, AppendMessage(long))
    fresh = await place.open()
    assert await fresh.load("s") == session
    assert (await fresh.load_at("s", 0)).conversation[0].parts[1] == image()
    assert [b.revision for b in await fresh.batches("s")] == [1, 2, 3]
    assert (await fresh.load_at("s", 3)).conversation[-1] == long
    assert (await fresh.batches("s"))[0].effects[0] == AppendMessage(user(1, image(IMAGE[:500])))
    assert place.blobs() == {
        media_digest(IMAGE): len(IMAGE),
        pdf.digest: len(pdf.data or b""),
        media_digest(IMAGE[:500]): 500,
    }
    if place.kind != "memory":
        # Inline, the image alone would be 87 kB of base64 (random bytes do not compress).
        assert place.record_bytes() < 24_000


@pytest.mark.anyio
@pytest.mark.parametrize("place", KINDS, indirect=True)
async def test_the_same_bytes_are_stored_once(place: Place) -> None:
    store = await place.open()
    a = await store.create("a", conversation=[user(0, image())])
    a = await apply(store, a, AppendMessage(user(1, image())), AppendMessage(user(2, image())))
    b = await store.create("b", conversation=[user(0, image(), image())])
    if place.kind != "memory":
        forked = await store.fork("a", 1, "c")
        assert forked == msgspec.structs.replace(a, id="c")
        fresh = await place.open()
        assert await fresh.load("c") == forked
        assert await fresh.load_at("c", 0) == msgspec.structs.replace(
            await fresh.load_at("a", 0), id="c"
        )
    assert await store.load("b") == b
    assert place.blobs() == {media_digest(IMAGE): len(IMAGE)}


@pytest.mark.anyio
@pytest.mark.parametrize("place", DURABLE, indirect=True)
async def test_fork_and_compaction_keep_the_bytes(place: Place) -> None:
    store = await place.open()
    session = await store.create("s", conversation=[user(0, image())])
    session = await apply(store, session, AppendMessage(user(1, image(IMAGE[:10]))))
    kept = session.conversation[1]
    summary = Message.user("summary", id="sum")
    session = await apply(store, session, ReplaceConversation((summary, kept)))
    for index in range(2, 6):
        session = await apply(store, session, AppendMessage(user(index)))
    forked = await store.fork("s", 3, "f")
    fresh = await place.open()
    assert await fresh.load("s") == session
    assert (await fresh.load("f")).conversation[:2] == (summary, kept)
    assert (await fresh.load_at("f", 1)).conversation[1] == kept
    assert (await fresh.load_at("s", 1)).conversation[0].parts[1] == image()
    assert forked == await fresh.load_at("f", 3)


# -- the limit ----------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("place", KINDS, indirect=True)
async def test_a_part_over_the_limit_writes_nothing(place: Place) -> None:
    store = await place.open(max_media_bytes=1000)
    with pytest.raises(MediaTooLargeError, match=r"'m0' in session 's'.*1,001 bytes.*1,000"):
        await store.create("s", conversation=[user(0, image(IMAGE[:1001]))])
    assert await store.list_sessions() == []
    session = await store.create("s", conversation=[user(0, image(IMAGE[:1000]))])
    with pytest.raises(MediaTooLargeError) as caught:
        await store.apply(batch_for(session, AppendMessage(user(1, image(IMAGE[1:1002])))))
    assert (caught.value.size, caught.value.limit, caught.value.message_id) == (1001, 1000, "m1")
    assert await store.load("s") == session
    assert await store.batches("s") == []
    assert place.blobs() == {media_digest(IMAGE[:1000]): 1000}


@pytest.mark.anyio
@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
async def test_the_limit_is_checked(bad: Any, tmp_path: Path) -> None:
    with pytest.raises((TypeError, ValueError), match="max_media_bytes"):
        MemoryStore(max_media_bytes=bad)
    with pytest.raises((TypeError, ValueError), match="max_media_bytes"):
        await SQLiteStore.open(tmp_path / "db", max_media_bytes=bad)
    with pytest.raises((TypeError, ValueError), match="max_media_bytes"):
        await FileStore.open(tmp_path / "f", max_media_bytes=bad)


def test_the_default_limit_is_20_mib() -> None:
    assert Media().max_bytes == 20 * 1024 * 1024


# -- damage -----------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("place", KINDS, indirect=True)
@pytest.mark.parametrize("how", ["missing", "damaged", "truncated"])
async def test_a_bad_blob_is_stored_data_error_naming_session_and_position(
    place: Place, how: str
) -> None:
    store = await place.open()
    session = await store.create("s", conversation=[user(0)])
    await apply(store, session, AppendMessage(user(1, image())))
    digest = media_digest(IMAGE)
    body = {"missing": None, "damaged": b"x" + IMAGE[1:], "truncated": IMAGE[:-1]}[how]
    place.damage(digest, body)
    fresh = await place.open()
    said = "holds no blob" if how == "missing" else "is damaged"
    for read in (lambda: fresh.load_at("s", 1), lambda: fresh.batches("s")):
        with pytest.raises(StoredDataError, match=said) as caught:
            await read()
        text = str(caught.value)
        assert "'s'" in text
        assert "revision 1" in text
        assert digest in text
        assert "message 'm1'" in text
    if place.kind != "memory":  # the memory store's load returns the session it holds
        with pytest.raises(StoredDataError, match=said):
            await fresh.load("s")


def test_a_malformed_reference_is_refused_before_any_read() -> None:
    """A reference whose digest is not ``sha256:<hex>`` (it could name any file), or
    that holds a field its kind does not have, fails before the backend is asked."""
    reader = Reader(Media(), lambda digest: pytest.fail(f"read {digest}"), "test")
    session = Session(id="s", revision=0, conversation=(), data=NoData())
    bad = MediaRef(kind="image", digest="sha256:../../etc/passwd", size=3, media_type="image/png")
    odd = MediaRef(
        kind="audio", digest=media_digest(b"abc"), size=3, media_type="audio/wav", detail="low"
    )
    for ref in (bad, odd):
        message = Message(id="m", role="user", parts=(ref,))
        with pytest.raises(StoredDataError, match=r"message 'm' in here.*not a valid reference"):
            reader.batch(batch_for(session, AppendMessage(message)), "here")


# -- schema: a reader without the feature refuses -----------------------------------


def test_a_reader_that_does_not_know_the_reference_refuses_it(tmp_path: Path) -> None:
    """A database with media, read by code whose parts union lacks ``media_ref``
    (as before this feature): ``StoredDataError`` naming the tag, never a message
    without its image."""

    async def write() -> None:
        async with await SQLiteStore.open(tmp_path / "db.sqlite3") as store:
            session = await store.create("s", conversation=[user(0)])
            await apply(store, session, AppendMessage(user(1, image())))

    anyio.run(write)
    child = textwrap.dedent(
        """
        import sys
        import anyio
        import stepmachine._messages as messages
        # the parts a reader knew before (the package resolved the annotation on import)
        messages.Message.__annotations__["parts"] = tuple[messages.Part, ...]
        from stepmachine import StoredDataError
        from stepmachine.stores import SQLiteStore

        async def main():
            async with await SQLiteStore.open(sys.argv[1]) as store:
                try:
                    await store.load("s")
                except StoredDataError as exc:
                    print("refused:", exc)
                else:
                    print("read it")

        anyio.run(main)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", child, str(tmp_path / "db.sqlite3")],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.startswith("refused:"), done.stdout + done.stderr
    assert "'media_ref'" in done.stdout
    assert "session 's' revision 1" in done.stdout


def test_a_media_ref_is_never_sent_or_stored_from_outside() -> None:
    ref = MediaRef(kind="image", digest=media_digest(b"x"), size=1, media_type="image/png")
    message = Message(id="m", role="user", parts=(TextPart("hi"), ref))
    from stepmachine._media import check_media

    with pytest.raises(ConfigurationError, match=r"MediaRef is how a store records media"):
        check_media([message], accepts=(ImagePart,), in_results=(), who="test")
    store = MemoryStore()

    async def main() -> None:
        session = await store.create("s")
        with pytest.raises(ConfigurationError, match="give the ImagePart"):
            await store.apply(batch_for(session, AppendMessage(message)))
        assert await store.batches("s") == []

    anyio.run(main)


def test_every_field_of_a_media_part_is_in_its_reference() -> None:
    """A field added to a media part must be kept by the reference too (or it would be lost)."""
    ref_fields = set(MediaRef.__struct_fields__)
    for kind in (ImagePart, DocumentPart, AudioPart):
        assert set(kind.__struct_fields__) - {"data", "url"} <= ref_fields, kind


# -- arbitrary bytes ----------------------------------------------------------------

PARTS: list[Callable[[bytes], ImagePart | DocumentPart | AudioPart]] = [
    lambda data: ImagePart(media_type="image/webp", data=data, detail="low"),
    lambda data: DocumentPart(media_type="text/plain", data=data, title="é"),
    lambda data: AudioPart(media_type="audio/mpeg", data=data, cache=True),
]


@settings(max_examples=40, deadline=None)
@given(
    blobs=st.lists(st.binary(min_size=1, max_size=3000), min_size=1, max_size=4),
    kinds=st.lists(st.integers(0, 2), min_size=4, max_size=4),
)
def test_arbitrary_bytes_round_trip(
    tmp_path_factory: Any, blobs: list[bytes], kinds: list[int]
) -> None:
    parts = [PARTS[kind](data) for kind, data in zip(kinds, blobs, strict=False)]
    folder = tmp_path_factory.mktemp("media")

    async def main() -> None:
        for store in (
            MemoryStore(),
            await SQLiteStore.open(folder / "db"),
            await FileStore.open(folder / "files", fsync="never"),
        ):
            session = await store.create("s", conversation=[user(0, *parts[:1])])
            session = await apply(store, session, AppendMessage(user(1, *parts)))
            assert (await store.load_at("s", 0)).conversation[0].parts[1:] == tuple(parts[:1])
            assert (await store.load("s")).conversation[1].parts[1:] == tuple(parts)
            assert await store.load_at("s", 1) == session
            await store.aclose()
        async with await SQLiteStore.open(folder / "db") as again:
            assert (await again.load("s")).conversation[1].parts[1:] == tuple(parts)

    anyio.run(main)


def test_a_reference_carries_every_field_back() -> None:
    media = Media()
    for make in PARTS:
        part = make(b"\x00\x01")
        session = Session(id="s", revision=0, conversation=(user(0, part),), data=NoData())
        out, blobs = media.session_out(session)
        (ref,) = out.conversation[0].parts[1:]
        assert isinstance(ref, MediaRef)
        assert blobs == {part.digest: b"\x00\x01"}
        back = Reader(media, blobs.get, "test").session(out, "here")
        assert back.conversation[0].parts[1] == part


# -- cost: a cycle without media reads and writes no blob -------------------------


@pytest.mark.anyio
async def test_cycles_without_media_touch_no_blob(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[str] = []
    original = FileBackend.blob

    def counted(self: FileBackend, digest: str) -> bytes | None:
        reads.append(digest)
        return original(self, digest)

    monkeypatch.setattr(FileBackend, "blob", counted)
    written: list[str] = []
    store = await FileStore.open(tmp_path, snapshot_every=3, boundary_hook=written.append)
    async with store:
        session = await store.create("s", conversation=[user(0, image())])
        session = await apply(store, session, AppendMessage(user(1, image(b"other"))))
        assert written.count("media.written") == 2  # the create's blob, then the batch's
        reads.clear()
        for index in range(2, 20):  # six snapshots, each holding both images
            session = await apply(store, session, AppendMessage(user(index)))
            assert await store.load("s") == session
        assert reads == []
        assert written.count("media.written") == 2
        assert written.count("snapshot.replaced") == 6


# -- a SIGKILL between the blob and the batch -------------------------------------

_CHILD = """
import os, signal, sys
import anyio
sys.path.insert(0, {tests!r})
from test_media_store import IMAGE, AppendMessage, batch_for, user, image
from stepmachine.stores import FileStore, SQLiteStore

kind, where, point = sys.argv[1:4]

def hook(name):
    if name == point:
        os.kill(os.getpid(), signal.SIGKILL)

async def main():
    if kind == "file":
        store = await FileStore.open(where, boundary_hook=hook)
    else:
        store = await SQLiteStore.open(where, boundary_hook=hook)
    session = await store.create("s", conversation=[user(0)])
    print("created", flush=True)
    await store.apply(batch_for(session, AppendMessage(user(1, image()))))
    print("applied", flush=True)

anyio.run(main)
"""


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("kind", "point"),
    [("file", "media.written"), ("file", "media.synced"), ("sqlite", "apply.inserted")],
)
async def test_sigkill_between_the_blob_and_the_batch(
    tmp_path: Path, kind: str, point: str
) -> None:
    where = tmp_path / ("files" if kind == "file" else "db.sqlite3")
    child = _CHILD.format(tests=str(ROOT / "tests"))
    with anyio.fail_after(60):
        done = await anyio.run_process(
            [sys.executable, "-c", child, kind, str(where), point],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=False,
        )
    assert done.returncode == -9, done.stderr.decode()
    assert done.stdout == b"created\n"
    store: Any = await FileStore.open(where) if kind == "file" else await SQLiteStore.open(where)
    async with store:
        session = await store.load("s")
        assert session.revision == 0  # the batch was never acknowledged, nor stored
        assert await store.batches("s") == []
        if kind == "file":  # the blob is there, referred to by nothing: harmless
            assert [p.name for p in (where / ".media").iterdir()] == [media_digest(IMAGE)[7:]]
        after = await apply(store, session, AppendMessage(user(1, image())))
    async with (
        await FileStore.open(where) if kind == "file" else await SQLiteStore.open(where)
    ) as again:
        assert await again.load("s") == after
    if kind == "file":
        assert len(list((where / ".media").iterdir())) == 1


def test_base64_of_the_image_is_in_no_record(tmp_path: Path) -> None:
    """The SQLite store's rows hold no base64 of the image (compressed or not)."""

    async def main() -> None:
        async with await SQLiteStore.open(tmp_path / "db") as store:
            session = await store.create("s", conversation=[user(0, image(b"A" * 3000))])
            await apply(store, session, AppendMessage(user(1, image(b"A" * 3000))))

    anyio.run(main)
    text = base64.b64encode(b"A" * 3000)[:40]
    with closing(sqlite3.connect(tmp_path / "db")) as conn, conn:
        bodies = [row[0] for row in conn.execute("SELECT body FROM effects")]
        bodies += [row[0] for row in conn.execute("SELECT body FROM batches")]
        bodies += [row[0] for row in conn.execute("SELECT body FROM snapshots")]
    import zlib

    plain = [zlib.decompress(b) if b[:1] == b"\x78" else b for b in bodies]
    assert all(text not in b for b in plain)
    assert sum(b"media_ref" in b for b in plain) == 2


# -- media in the stores -------------------------------------------------------------------------

IMAGE_GEMINI_MEDIA = bytes(range(256)) * 64
DIGEST = media_digest(IMAGE_GEMINI_MEDIA)


def _image(data: bytes = IMAGE_GEMINI_MEDIA) -> ImagePart:
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


STORES = ["memory", "file", "sqlite"]


@pytest.fixture
async def opener(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    kind: str = request.param
    opened: list[Any] = []
    memory: list[MemoryStore] = []

    async def open_store(**options: Any) -> Any:
        store: Any
        if kind == "memory":
            if not memory or options:
                memory[:] = [MemoryStore(**options)]
            return memory[0]
        if kind == "file":
            store = await FileStore.open(tmp_path / "files", **options)
        else:
            store = await SQLiteStore.open(tmp_path / "db.sqlite3", **options)
        opened.append(store)
        return store

    open_store.kind = kind  # type: ignore[attr-defined]
    open_store.path = tmp_path  # type: ignore[attr-defined]
    try:
        yield open_store
    finally:
        for store in opened:
            await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("opener", STORES, indirect=True)
async def test_max_media_bytes_is_inclusive_at_the_boundary(opener: Any) -> None:
    store = await opener(max_media_bytes=len(IMAGE_GEMINI_MEDIA))
    with anyio.fail_after(20):
        session = await store.create("s", conversation=[_user(0)])
        session = await store.apply(_batch(session, AppendMessage(_user(1, _image()))))
        with pytest.raises(MediaTooLargeError):
            await store.apply(
                _batch(session, AppendMessage(_user(2, _image(IMAGE_GEMINI_MEDIA + b"!"))))
            )
        loaded = await store.load("s")
    assert loaded.revision == 1
    assert loaded.conversation[-1].parts[-1] == _image()


@pytest.mark.anyio
@pytest.mark.parametrize("opener", STORES, indirect=True)
async def test_many_identical_images_in_one_batch_are_one_blob(opener: Any) -> None:
    store = await opener()
    copies = [_image(bytes(IMAGE_GEMINI_MEDIA)) for _ in range(50)]  # equal bytes, distinct objects
    with anyio.fail_after(20):
        session = await store.create("s", conversation=[_user(0)])
        await store.apply(_batch(session, AppendMessage(_user(1, *copies))))
        fresh = await opener()
        loaded = await fresh.load("s")
    assert [p for p in loaded.conversation[-1].parts if isinstance(p, ImagePart)] == copies
    if opener.kind == "file":
        names = [n for n in os.listdir(opener.path / "files" / ".media") if not n.startswith(".")]
        assert names == [DIGEST.removeprefix("sha256:")]


@pytest.mark.anyio
@pytest.mark.parametrize("opener", ["file", "sqlite"], indirect=True)  # memory: no fork
async def test_fork_then_delete_the_original_keeps_the_forks_media(opener: Any) -> None:
    store = await opener()
    with anyio.fail_after(20):
        session = await store.create("s", conversation=[_user(0, _image())])
        await store.apply(_batch(session, AppendMessage(_user(1, _image()))))
        await store.fork("s", 1, "f")
        await store.delete("s")
        fresh = await opener()
        loaded = await fresh.load("f")
        earlier = await fresh.load_at("f", 0)
    assert [p for m in loaded.conversation for p in m.parts if isinstance(p, ImagePart)] == [
        _image(),
        _image(),
    ]
    assert earlier.conversation[0].parts[-1] == _image()


@pytest.mark.anyio
@pytest.mark.parametrize("opener", STORES, indirect=True)
async def test_a_media_ref_given_from_outside_is_refused_at_create(opener: Any) -> None:
    store = await opener()
    other = await store.create("victim", conversation=[_user(0, _image())])
    del other
    forged = MediaRef(
        kind="image", digest=DIGEST, size=len(IMAGE_GEMINI_MEDIA), media_type="image/png"
    )
    message = Message(id="m0", role="user", parts=(TextPart("x"), forged))  # type: ignore[arg-type]
    with anyio.fail_after(20), pytest.raises(ConfigurationError):
        await store.create("thief", conversation=[message])


async def _file_store_with_one_image(path: Path) -> FileStore:
    store = await FileStore.open(path)
    session = await store.create("s", conversation=[_user(0)])
    await store.apply(_batch(session, AppendMessage(_user(1, _image()))))
    return store


@pytest.mark.anyio
async def test_a_symlinked_blob_is_a_stored_data_error(tmp_path: Path) -> None:
    folder = tmp_path / "files"
    with anyio.fail_after(20):
        store = await _file_store_with_one_image(folder)
        await store.aclose()
        blob = folder / ".media" / DIGEST.removeprefix("sha256:")
        (tmp_path / "elsewhere").write_bytes(
            IMAGE_GEMINI_MEDIA
        )  # even the right bytes: not followed
        blob.unlink()
        blob.symlink_to(tmp_path / "elsewhere")
        fresh = await FileStore.open(folder)
        try:
            with pytest.raises(StoredDataError):
                await fresh.load_at("s", 1)
        finally:
            await fresh.aclose()


@pytest.mark.anyio
async def test_a_directory_in_place_of_a_blob_is_a_stored_data_error(tmp_path: Path) -> None:
    folder = tmp_path / "files"
    with anyio.fail_after(20):
        store = await _file_store_with_one_image(folder)
        await store.aclose()
        blob = folder / ".media" / DIGEST.removeprefix("sha256:")
        blob.unlink()
        blob.mkdir()
        fresh = await FileStore.open(folder)
        try:
            with pytest.raises(StoredDataError):
                await fresh.load_at("s", 1)
        finally:
            await fresh.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("opener", ["file", "sqlite"], indirect=True)
async def test_a_damaged_blob_is_not_reused_by_the_next_write_of_the_same_bytes(
    opener: Any,
) -> None:
    """Blobs are written only when absent: a damaged one (outside corruption) would
    make every later record of the same bytes unreadable too."""
    store = await opener()
    with anyio.fail_after(20):
        session = await store.create("s", conversation=[_user(0)])
        await store.apply(_batch(session, AppendMessage(_user(1, _image()))))
        if opener.kind == "file":
            (opener.path / "files" / ".media" / DIGEST.removeprefix("sha256:")).write_bytes(
                IMAGE_GEMINI_MEDIA[:10]
            )
        else:
            import sqlite3

            with closing(sqlite3.connect(opener.path / "db.sqlite3")) as conn, conn:
                conn.execute(
                    "UPDATE media SET body = ? WHERE digest = ?", (IMAGE_GEMINI_MEDIA[:10], DIGEST)
                )
        fresh = await opener()
        other = await fresh.create("t", conversation=[_user(0)])
        await fresh.apply(_batch(other, AppendMessage(_user(1, _image()))))
        again = await opener()
        loaded = await again.load_at("t", 1)
    assert loaded.conversation[-1].parts[-1] == _image()


@pytest.mark.anyio
async def test_a_leftover_temporary_blob_file_is_harmless(tmp_path: Path) -> None:
    folder = tmp_path / "files"
    with anyio.fail_after(20):
        store = await _file_store_with_one_image(folder)
        await store.aclose()
        (folder / ".media" / ".deadbeefdeadbeef.tmp").write_bytes(
            IMAGE_GEMINI_MEDIA[:100]
        )  # a crash
        (folder / ".media" / "not-a-digest").write_bytes(b"junk")
        fresh = await FileStore.open(folder)
        try:
            loaded = await fresh.load("s")
            session = await fresh.apply(_batch(loaded, AppendMessage(_user(2, _image()))))
        finally:
            await fresh.aclose()
    assert session.conversation[-1].parts[-1] == _image()


_WRITER = """
import anyio, sys
from stepmachine import AppendMessage, Batch, ImagePart, Message
from stepmachine.stores import FileStore

IMAGE = bytes(range(256)) * 64

async def main(folder, name):
    store = await FileStore.open(folder)
    try:
        for n in range(20):
            sid = f"{name}-{n}"
            image = ImagePart(media_type="image/png", data=IMAGE)
            await store.create(sid, conversation=[Message.user("x", id="m0", media=[image])])
    finally:
        await store.aclose()

anyio.run(main, sys.argv[1], sys.argv[2])
"""


@pytest.mark.anyio
async def test_two_processes_writing_the_same_image_at_once(tmp_path: Path) -> None:
    folder = tmp_path / "files"
    await (await FileStore.open(folder)).aclose()  # make the folder
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with anyio.fail_after(120):

        async def write(name: str) -> None:
            await anyio.run_process([sys.executable, str(script), str(folder), name], env=env)

        async with anyio.create_task_group() as group:
            for name in ("a", "b"):
                group.start_soon(write, name)
        store = await FileStore.open(folder)
        try:
            for name in ("a", "b"):
                for n in range(20):
                    loaded = await store.load(f"{name}-{n}")
                    assert loaded.conversation[0].parts[-1] == _image()
        finally:
            await store.aclose()
    names = os.listdir(folder / ".media")
    assert names == [DIGEST.removeprefix("sha256:")]  # no temporary file left behind


@pytest.mark.anyio
@pytest.mark.parametrize("opener", STORES, indirect=True)
async def test_compaction_style_replace_keeps_media_and_load_at_sees_both(opener: Any) -> None:
    from stepmachine import ReplaceConversation

    store = await opener()
    with anyio.fail_after(20):
        session = await store.create("s", conversation=[_user(0, _image())])
        session = await store.apply(_batch(session, AppendMessage(_user(1, _image(b"other")))))
        summary = Message.user("summary", id="sum", media=[_image()])
        await store.apply(_batch(session, ReplaceConversation((summary,))))
        fresh = await opener()
        before = await fresh.load_at("s", 1)
        after = await fresh.load("s")
    assert before.conversation[1].parts[-1] == _image(b"other")
    assert after.conversation == (summary,)


@pytest.mark.anyio
@pytest.mark.parametrize("opener", ["file", "sqlite"], indirect=True)
async def test_snapshots_keep_media_across_a_cold_load(opener: Any) -> None:
    options = {"snapshot_every": 2} if opener.kind == "file" else {}  # SQLite: by weight
    store = await opener(**options)
    with anyio.fail_after(20):
        session = await store.create("s", conversation=[_user(0, _image())])
        for n in range(1, 6):
            session = await store.apply(_batch(session, AppendMessage(_user(n, _image()))))
        fresh = await opener(**options)
        loaded = await fresh.load("s")
        middle = await fresh.load_at("s", 3)
    assert loaded == session
    assert len(middle.conversation) == 4
    assert all(m.parts[-1] == _image() for m in loaded.conversation)


@pytest.mark.anyio
@pytest.mark.parametrize("opener", ["file", "sqlite"], indirect=True)
async def test_a_lower_limit_after_a_reopen_does_not_block_a_text_only_batch(
    opener: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``max_media_bytes`` refuses new parts over it; a snapshot of media stored before
    (under a higher limit) is not a new part and must not make a later batch fail."""
    from stepmachine.stores import _sqlite_rows

    monkeypatch.setattr(_sqlite_rows, "SNAPSHOT_EVERY", 1)  # a snapshot at each batch
    monkeypatch.setattr(_sqlite_rows, "SNAPSHOT_MAX_GAP", 1)
    options = {"snapshot_every": 1} if opener.kind == "file" else {}  # SQLite: by weight
    store = await opener(**options)
    with anyio.fail_after(30):
        session = await store.create("s", conversation=[_user(0, _image())])
        session = await store.apply(_batch(session, AppendMessage(_user(1))))
        smaller = await opener(max_media_bytes=100, **options)
        after = await smaller.load("s")
        assert after == session
        for n in range(2, 5):
            after = await smaller.apply(_batch(after, AppendMessage(_user(n))))
        again = await opener()
        assert await again.load("s") == after


@pytest.mark.anyio
@pytest.mark.parametrize("opener", STORES, indirect=True)
async def test_a_forged_reference_in_a_replaced_conversation_is_refused(opener: Any) -> None:
    store = await opener()
    with anyio.fail_after(20):
        await store.create("victim", conversation=[_user(0, _image())])
        thief = await store.create("thief", conversation=[_user(0)])
        forged = MediaRef(
            kind="image", digest=DIGEST, size=len(IMAGE_GEMINI_MEDIA), media_type="image/png"
        )
        message = Message(id="m1", role="user", parts=(TextPart("x"), forged))  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError):
            await store.apply(_batch(thief, ReplaceConversation((message,))))
        with pytest.raises(ConfigurationError):
            await store.apply(_batch(thief, AppendMessage(message)))
        assert (await store.load("thief")).revision == 0


@pytest.mark.anyio
@pytest.mark.parametrize("opener", STORES, indirect=True)
async def test_the_same_bytes_under_two_media_types_keep_each_their_own(opener: Any) -> None:
    store = await opener()
    png = ImagePart(media_type="image/png", data=IMAGE_GEMINI_MEDIA)
    jpeg = ImagePart(media_type="image/jpeg", data=IMAGE_GEMINI_MEDIA, detail="low")
    with anyio.fail_after(20):
        session = await store.create("s", conversation=[_user(0)])
        await store.apply(_batch(session, AppendMessage(_user(1, png, jpeg))))
        fresh = await opener()
        loaded = await fresh.load_at("s", 1)
    assert loaded.conversation[-1].parts[-2:] == (png, jpeg)


_SQLITE_WRITER = _WRITER.replace("FileStore", "SQLiteStore")


@pytest.mark.anyio
async def test_two_processes_writing_the_same_image_at_once_into_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"
    await (await SQLiteStore.open(path)).aclose()
    script = tmp_path / "writer.py"
    script.write_text(_SQLITE_WRITER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with anyio.fail_after(120):

        async def write(name: str) -> None:
            await anyio.run_process([sys.executable, str(script), str(path), name], env=env)

        async with anyio.create_task_group() as group:
            for name in ("a", "b"):
                group.start_soon(write, name)
        store = await SQLiteStore.open(path)
        try:
            for name in ("a", "b"):
                for n in range(20):
                    loaded = await store.load(f"{name}-{n}")
                    assert loaded.conversation[0].parts[-1] == _image()
        finally:
            await store.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("body", ["a text value", 42, 1.5], ids=["text", "integer", "real"])
async def test_a_media_row_of_the_wrong_sqlite_type_is_a_stored_data_error(
    tmp_path: Path, body: Any
) -> None:
    import sqlite3

    path = tmp_path / "db.sqlite3"
    with anyio.fail_after(20):
        store = await SQLiteStore.open(path)
        session = await store.create("s", conversation=[_user(0)])
        await store.apply(_batch(session, AppendMessage(_user(1, _image()))))
        await store.aclose()
        with closing(sqlite3.connect(path)) as conn, conn:
            conn.execute("UPDATE media SET body = ? WHERE digest = ?", (body, DIGEST))
        fresh = await SQLiteStore.open(path)
        try:
            with pytest.raises(StoredDataError):
                await fresh.load_at("s", 1)
        finally:
            await fresh.aclose()


# -- stores: fork and load_at keep media -------------------------------------------------------


@pytest.mark.parametrize("kind", ["sqlite", "file"])
async def test_fork_and_load_at_keep_media_byte_for_byte(kind: str) -> None:
    document = DocumentPart(media_type="application/pdf", data=b"%PDF-1.4\x00\xff" * 50)
    first = Message.user("look", id="u1", media=[SHOT, document])
    with tempfile.TemporaryDirectory() as folder:
        store: Any
        if kind == "sqlite":
            store = await SQLiteStore.open(Path(folder) / "db.sqlite3")
        else:
            store = await FileStore.open(Path(folder) / "files")
        try:
            with anyio.fail_after(20):
                await store.create("a", conversation=[first])
                await submit(store, "a", [AppendMessage(Message.assistant("seen", id="a1"))])
                await store.fork("a", 1, "b")
                forked = await store.load("b")
                earlier = await store.load_at("a", 0)
        finally:
            await store.aclose()
    assert forked.conversation[0] == first
    assert earlier.conversation[0] == first
    assert message_tokens(forked.conversation[0]) == message_tokens(first)
