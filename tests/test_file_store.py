"""FileStore: the conformance suite, plus what only a file store can get wrong.

Damage tests edit the log bytes directly, using the record format module to
find record offsets and to forge well-checksummed records.
"""

from __future__ import annotations

import base64
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import make_golden_file
import msgspec
import pytest

from stepmachine import (
    Agent,
    Annotate,
    AppendMessage,
    Codec,
    ConfigurationError,
    ConflictError,
    Effect,
    EffectError,
    InvalidSessionIdError,
    Message,
    ReplaceConversation,
    Session,
    SessionExistsError,
    SessionNotFoundError,
    SetVisibility,
    StoreClosedError,
    StoredDataError,
    UpdateData,
)
from stepmachine.extend import Batch, apply_batch
from stepmachine.stores import FileStore
from stepmachine.stores._file_log import (
    SCHEMA_VERSION,
    TAG_BATCH,
    TAG_SNAPSHOT,
    Record,
    encode_record,
    parse_one,
    parse_records,
)
from stepmachine.testing.conformance import (
    ConformanceData,
    Increment,
    StoreConformance,
    Unregistered,
)

CODEC: Codec[Any] = Codec(ConformanceData, effects=[Increment])
FIXTURES = Path(__file__).parent / "fixtures"


class TestFileStore(StoreConformance):
    def make_store(self, codec: Codec[Any], path: Path) -> Any:
        return FileStore.open(path / "store", codec)


# -- helpers --------------------------------------------------------------------


def _message(index: int) -> Message:
    return Message.user(f"message {index}", id=f"msg-{index}")


def _batch(session: Session[Any], *effects: Effect) -> Batch[Effect]:
    return Batch(
        session_id=session.id,
        revision=session.revision + 1,
        step="test",
        cycle=1,
        timestamp=1_700_000_000.0 + session.revision,
        effects=effects,
    )


async def _advance(store: FileStore, session: Session[Any], *effects: Effect) -> Session[Any]:
    await store.apply(_batch(session, *effects))
    return apply_batch(session, effects)


async def _open(folder: Path, **options: Any) -> FileStore:
    return await FileStore.open(folder, CODEC, **options)


async def _history(store: FileStore, session_id: str, batches: int) -> list[Session[Any]]:
    """Create ``session_id`` and apply ``batches`` batches; every revision's session."""
    session = await store.create(session_id)
    history = [session]
    for index in range(1, batches + 1):
        session = await _advance(store, session, AppendMessage(_message(index)), Increment())
        history.append(session)
    return history


def _records(path: Path) -> list[Record]:
    records, torn = parse_records(path.read_bytes(), 0, str(path))
    assert torn is None
    return records


def _batch_record(path: Path, revision: int) -> Record:
    return next(r for r in _records(path) if r.tag == TAG_BATCH and r.revision == revision)


def _splice(path: Path, record: Record, replacement: bytes) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: record.offset] + replacement + data[record.end :])


def _snapshot_revision(folder: Path, session_id: str) -> int | None:
    path = folder / f"{session_id}.snap"
    if not path.exists():
        return None
    return parse_one(path.read_bytes(), 0, str(path), TAG_SNAPSHOT).revision


# -- torn tails and damage --------------------------------------------------------


@pytest.mark.parametrize("cut", ["header", "payload", "newline"])
async def test_torn_tail_is_ignored_reported_and_cut_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, cut: str
) -> None:
    folder = tmp_path / "store"
    store = await _open(folder)
    history = await _history(store, "s", 3)
    await store.aclose()
    log = folder / "s.log"
    full = log.read_bytes()
    last = _records(log)[-1]
    keep = {"header": 5, "payload": (last.end - last.offset) // 2, "newline": -1}[cut]
    log.write_bytes(full[: last.end - 1] if keep == -1 else full[: last.offset + keep])

    fresh = await _open(folder)
    with caplog.at_level(logging.WARNING, logger="stepmachine.stores.file"):
        assert await fresh.load("s") == history[2]
    assert fresh.torn_tails == 1
    assert "torn_tail_ignored" in caplog.text
    assert f"offset={last.offset}" in caplog.text
    assert await fresh.load("s") == history[2]
    assert fresh.torn_tails == 1  # the same tail is reported once
    assert await fresh.load_at("s", 1) == history[1]
    assert [b.revision for b in await fresh.batches("s")] == [1, 2]

    again = await _advance(fresh, history[2], AppendMessage(_message(99)))
    data = log.read_bytes()
    assert data[: last.offset] == full[: last.offset]
    records = _records(log)  # no torn tail any more
    assert [r.revision for r in records if r.tag == TAG_BATCH] == [1, 2, 3]
    assert data.endswith(b"\n")
    reopened = await _open(folder)
    assert await reopened.load("s") == again
    assert reopened.torn_tails == 0


async def test_torn_tail_is_cut_by_an_apply_on_a_fresh_store(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    store = await _open(folder)
    history = await _history(store, "s", 2)
    log = folder / "s.log"
    clean = log.read_bytes()
    with log.open("ab") as file:
        file.write(b"1 B 3 120 0000")
    fresh = await _open(folder)
    after = await _advance(fresh, history[2], Increment(5))
    assert fresh.torn_tails == 1
    assert log.read_bytes().startswith(clean)
    assert len(_records(log)) == len(parse_records(clean, 0, "x")[0]) + 1
    assert await (await _open(folder)).load("s") == after


async def _assert_damage_refused(folder: Path, message_parts: list[str]) -> None:
    """A fresh store refuses the damaged log everywhere, and changes no byte."""
    log = folder / "s.log"
    before = log.read_bytes()
    store = await _open(folder)
    for call in (
        store.load("s"),
        store.load_at("s", 0),
        store.batches("s"),
        store.fork("s", 0, "copy"),
    ):
        with pytest.raises(StoredDataError) as info:
            await call
        for part in message_parts:
            assert part in str(info.value)
    ghost = Session(id="s", revision=3, conversation=(), data=ConformanceData())
    with pytest.raises(StoredDataError):
        await store.apply(_batch(ghost, Increment()))
    assert log.read_bytes() == before
    assert sorted(os.listdir(folder)) == ["s.log"]


async def test_flipped_byte_names_file_and_offset(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    await _history(await _open(folder), "s", 3)
    log = folder / "s.log"
    record = _batch_record(log, 2)
    data = bytearray(log.read_bytes())
    position = data.index(b"message 2", record.offset)
    data[position] ^= 0x01  # "m" -> "l": still valid JSON, only the checksum catches it
    log.write_bytes(bytes(data))
    await _assert_damage_refused(folder, [str(log), f"byte {record.offset}", "checksum"])


async def test_garbage_line_in_the_middle(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    await _history(await _open(folder), "s", 3)
    log = folder / "s.log"
    record = _batch_record(log, 2)
    _splice(log, record, b"this is not a record\n" + log.read_bytes()[record.offset : record.end])
    await _assert_damage_refused(folder, [str(log), f"byte {record.offset}", "malformed"])


async def test_complete_garbage_line_at_the_end_is_not_a_torn_tail(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    await _history(await _open(folder), "s", 2)
    log = folder / "s.log"
    size = log.stat().st_size
    with log.open("ab") as file:
        file.write(b"garbage that ends in a newline\n")
    await _assert_damage_refused(folder, [str(log), f"byte {size}"])


async def test_length_that_misses_the_newline(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    await _history(await _open(folder), "s", 3)
    log = folder / "s.log"
    record = _batch_record(log, 3)  # the final record: complete, so not torn
    line = log.read_bytes()[record.offset : record.end]
    head, rest = line.split(b" ", 3)[:3], line.split(b" ", 3)[3]
    length, tail = rest.split(b" ", 1)
    _splice(log, record, b" ".join([*head, str(int(length) + 7).encode(), tail]))
    await _assert_damage_refused(folder, [str(log), f"byte {record.offset}", "declares"])


async def test_unknown_record_tag(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    await _history(await _open(folder), "s", 3)
    log = folder / "s.log"
    record = _batch_record(log, 2)
    _splice(log, record, encode_record(b"X", 2, record.payload))
    await _assert_damage_refused(folder, [str(log), f"byte {record.offset}", "unknown record tag"])


async def test_unknown_effect_tag(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    await _history(await _open(folder), "s", 3)
    log = folder / "s.log"
    record = _batch_record(log, 2)
    payload = record.payload.replace(b'"conformance.increment"', b'"evil.os_system"')
    assert payload != record.payload
    _splice(log, record, encode_record(TAG_BATCH, 2, payload))
    await _assert_damage_refused(folder, [str(log), f"byte {record.offset}", "evil.os_system"])


@pytest.mark.parametrize("revision", [2, 3])
async def test_future_schema_version_is_refused(tmp_path: Path, revision: int) -> None:
    folder = tmp_path / "store"
    await _history(await _open(folder), "s", 3)
    log = folder / "s.log"
    record = _batch_record(log, revision)  # 3 is the last record
    newer = SCHEMA_VERSION + 1  # 3: version 2 (compressed payloads) is read since issue 9
    _splice(log, record, encode_record(TAG_BATCH, revision, record.payload, version=newer))
    await _assert_damage_refused(folder, [str(log), f"byte {record.offset}", "schema version 3"])


def _forge_snapshot(folder: Path, *, revision: int | None = None, offset: int) -> None:
    """Rewrite s.snap, well-checksummed, with another log offset (and revision)."""
    snap = folder / "s.snap"
    record = parse_one(snap.read_bytes(), 0, str(snap), TAG_SNAPSHOT)
    body = json.loads(record.payload)
    # Written back uncompressed (still read, as snapshots written before issue 9).
    body["session"] = json.loads(zlib.decompress(base64.b64decode(body.pop("compressed"))))
    body["offset"] = offset
    if revision is not None:
        body["session"]["revision"] = revision
    payload = json.dumps(body, separators=(",", ":")).encode()
    snap.write_bytes(encode_record(TAG_SNAPSHOT, body["session"]["revision"], payload))


async def _assert_snapshot_ignored(
    folder: Path, history: list[Session[Any]], caplog: pytest.LogCaptureFixture
) -> None:
    """A fresh store reads the intact log whole, warns, and leaves the snapshot alone."""
    snap = folder / "s.snap"
    damaged = snap.read_bytes()
    last = len(history) - 1
    for call in ("load", "load_at", "batches"):
        caplog.clear()
        store = await _open(folder)
        with caplog.at_level(logging.WARNING, logger="stepmachine.stores.file"):
            if call == "load":
                assert await store.load("s") == history[last]
            elif call == "load_at":
                assert await store.load_at("s", 1) == history[1]
                assert await store.load_at("s", last - 1) == history[last - 1]
            else:
                batches = await store.batches("s", after=last - 1)
                assert [batch.revision for batch in batches] == [last]
                assert [b.revision for b in await store.batches("s")] == list(range(1, last + 1))
        assert "damaged_snapshot_ignored" in caplog.text
        assert str(snap) in caplog.text
        assert snap.read_bytes() == damaged  # reads never write


@pytest.mark.parametrize("damage", ["bit_flip", "truncated", "not_a_record", "empty"])
async def test_damaged_snapshot_is_ignored_and_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    folder = tmp_path / "store"
    history = await _history(await _open(folder, snapshot_every=2), "s", 3)
    snap = folder / "s.snap"
    data = bytearray(snap.read_bytes())
    if damage == "bit_flip":
        data[data.index(b'"compressed":"') + 20] ^= 0x01  # inside the compressed session
    elif damage == "truncated":
        del data[len(data) // 2 :]
    elif damage == "not_a_record":
        data[:] = b"this is not a snapshot\n"
    else:
        data.clear()
    snap.write_bytes(bytes(data))
    await _assert_snapshot_ignored(folder, history, caplog)
    # The next snapshot written replaces it.
    store = await _open(folder, snapshot_every=2)
    after = await _advance(store, history[3], Increment())
    assert _snapshot_revision(folder, "s") == 4
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stepmachine.stores.file"):
        assert await (await _open(folder)).load("s") == after
    assert "snapshot" not in caplog.text


@pytest.mark.parametrize("where", ["past_the_end", "inside_the_head", "at_an_earlier_record"])
async def test_snapshot_that_does_not_fit_the_log_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    folder = tmp_path / "store"
    history = await _history(await _open(folder, snapshot_every=2), "s", 3)
    log = folder / "s.log"
    size = log.stat().st_size
    offset = {
        "past_the_end": size + 100,
        "inside_the_head": 5,
        "at_an_earlier_record": _batch_record(log, 1).end,  # says revision 2, is just past 1
    }[where]
    _forge_snapshot(folder, offset=offset)
    await _assert_snapshot_ignored(folder, history, caplog)


async def test_snapshot_ahead_of_its_offset_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Revision 1 at the offset just past revision 2: the next record is 3, not 2.
    folder = tmp_path / "store"
    history = await _history(await _open(folder, snapshot_every=2), "s", 3)
    _forge_snapshot(folder, revision=1, offset=_batch_record(folder / "s.log", 2).end)
    await _assert_snapshot_ignored(folder, history, caplog)


async def test_damaged_log_still_refused_beside_a_damaged_snapshot(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    await _history(await _open(folder, snapshot_every=2), "s", 3)
    snap = folder / "s.snap"
    snap.write_bytes(b"garbage\n")
    log = folder / "s.log"
    record = _batch_record(log, 3)  # after the snapshot's revision
    data = bytearray(log.read_bytes())
    data[data.index(b"message 3", record.offset)] ^= 0x01
    log.write_bytes(bytes(data))
    store = await _open(folder)
    calls = (lambda: store.load("s"), lambda: store.load_at("s", 1), lambda: store.batches("s"))
    for call in calls:
        with pytest.raises(StoredDataError, match=f"byte {record.offset}") as info:
            await call()
        assert str(log) in str(info.value)
        assert "checksum" in str(info.value)


async def test_damaged_log_after_a_good_snapshot_names_the_log(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    await _history(await _open(folder, snapshot_every=2), "s", 3)
    log = folder / "s.log"
    record = _batch_record(log, 3)
    data = bytearray(log.read_bytes())
    data[data.index(b"message 3", record.offset)] ^= 0x01
    log.write_bytes(bytes(data))
    with pytest.raises(StoredDataError, match=f"byte {record.offset}") as info:
        await (await _open(folder)).load("s")
    assert str(log) in str(info.value)


async def test_stale_snapshot_of_a_deleted_session_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "store"
    store = await _open(folder, snapshot_every=2)
    await _history(store, "s", 2)
    old_snapshot = (folder / "s.snap").read_bytes()
    await store.delete("s")
    created = await store.create("s")
    (folder / "s.snap").write_bytes(old_snapshot)
    with caplog.at_level(logging.WARNING, logger="stepmachine.stores.file"):
        assert await (await _open(folder)).load("s") == created
    assert "stale_snapshot_ignored" in caplog.text


# -- writes that must write nothing ----------------------------------------------


async def test_refused_batches_leave_the_file_unchanged(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    store = await _open(folder)
    history = await _history(store, "s", 2)
    log = folder / "s.log"
    before = log.read_bytes()
    with pytest.raises(EffectError):
        await store.apply(_batch(history[2], Increment(), Annotate("nope", "ns", {"k": 1})))
    with pytest.raises(ConfigurationError):
        await store.apply(_batch(history[2], Unregistered()))
    with pytest.raises(ConflictError):
        await store.apply(_batch(history[1], Increment()))
    assert log.read_bytes() == before
    assert await (await _open(folder)).load("s") == history[2]


# -- ids and permissions ------------------------------------------------------------

HOSTILE_IDS = [
    "../x",
    "../../etc/passwd",
    "/tmp/absolute",
    "a/b",
    "a\\b",
    "a\x00b",
    "x" * 129,
    "CON",
    "nul.txt",
    "",
    ".",
    "..",
    ".hidden",
    "-x",
    "a b",
]


async def test_hostile_session_ids_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    store = await _open(folder)
    await store.create("ok")
    template = await store.load("ok")
    assert (await store.create("x" * 128)).id == "x" * 128
    await store.delete("x" * 128)
    for session_id in HOSTILE_IDS:
        ghost = msgspec.structs.replace(template, id=session_id)
        for call in (
            store.create(session_id),
            store.load(session_id),
            store.load_at(session_id, 0),
            store.batches(session_id),
            store.delete(session_id),
            store.apply(_batch(ghost, Increment())),
            store.fork("ok", 0, session_id),
            store.fork(session_id, 0, "ok2"),
        ):
            with pytest.raises(InvalidSessionIdError):
                await call
    assert sorted(os.listdir(folder)) == ["ok.log"]
    assert sorted(os.listdir(tmp_path)) == ["store"]


async def test_list_sessions_ignores_foreign_files(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    store = await _open(folder)
    await store.create("real")
    for name in ("notes.txt", ".hidden.log", "bad name.log", "CON.log"):
        (folder / name).write_text("x")
    assert await store.list_sessions() == ["real"]


async def test_owner_only_permissions_whatever_the_umask(tmp_path: Path) -> None:
    folder = tmp_path / "deep" / "store"
    old = os.umask(0)
    try:
        store = await _open(folder, snapshot_every=1)
        await _history(store, "s", 1)
    finally:
        os.umask(old)
    assert folder.stat().st_mode & 0o777 == 0o700
    names = sorted(os.listdir(folder))
    assert names == ["s.log", "s.snap"]
    for name in names:
        assert (folder / name).stat().st_mode & 0o777 == 0o600


# -- snapshots and the cache -------------------------------------------------------


async def test_snapshots_every_n_and_on_replace_conversation(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    store = await _open(folder, snapshot_every=3)
    session = await store.create("s")
    history, sent, snapshots = [session], [], []
    for revision in range(1, 8):
        effects: tuple[Effect, ...] = (AppendMessage(_message(revision)), Increment())
        if revision == 5:
            effects = (ReplaceConversation((_message(50),)), Increment())
        batch = _batch(session, *effects)
        await store.apply(batch)
        session = apply_batch(session, effects)
        history.append(session)
        sent.append(batch)
        snapshots.append(_snapshot_revision(folder, "s"))
    assert snapshots == [None, None, 3, 3, 5, 6, 6]

    fresh = await _open(folder)
    assert await fresh.load("s") == history[7]
    for expected in history:
        assert await fresh.load_at("s", expected.revision) == expected
        assert await store.load_at("s", expected.revision) == expected
    for after in range(8):
        assert await fresh.batches("s", after=after) == sent[after:]

    # A cold load starts from the snapshot: damage before it is not even read.
    record = _batch_record(folder / "s.log", 2)
    data = bytearray((folder / "s.log").read_bytes())
    data[data.index(b"message 2", record.offset)] ^= 0x01
    (folder / "s.log").write_bytes(bytes(data))
    cold = await _open(folder)
    assert await cold.load("s") == history[7]
    assert await cold.load_at("s", 6) == history[6]
    with pytest.raises(StoredDataError, match=f"byte {record.offset}"):
        await cold.load_at("s", 2)


async def test_reload_reads_only_new_bytes(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    store = await _open(folder)
    history = await _history(store, "s", 3)
    assert await store.load("s") == history[3]
    # Damage history the instance has already read: it never reads it again.
    log = folder / "s.log"
    record = _batch_record(log, 1)
    data = bytearray(log.read_bytes())
    data[data.index(b"message 1", record.offset)] ^= 0x01
    log.write_bytes(bytes(data))
    assert await store.load("s") == history[3]
    after = await _advance(store, history[3], Increment())
    assert await store.load("s") == after
    with pytest.raises(StoredDataError):  # a cold instance does read it
        await (await _open(folder)).load("s")


class _CountingCodec(Codec[ConformanceData]):
    def __init__(self) -> None:
        super().__init__(ConformanceData, effects=[Increment])
        self.sessions_encoded = 0

    def encode_session(self, session: Session[ConformanceData]) -> bytes:
        self.sessions_encoded += 1
        return super().encode_session(session)


async def test_apply_never_reencodes_the_history(tmp_path: Path) -> None:
    codec = _CountingCodec()
    store = await FileStore.open(tmp_path / "store", codec, snapshot_every=1000)
    await _history(store, "s", 40)
    assert codec.sessions_encoded == 1  # the create record only
    await store.apply(_batch(await store.load("s"), ReplaceConversation(())))
    assert codec.sessions_encoded == 2  # the snapshot after ReplaceConversation


# -- several writers ----------------------------------------------------------------


async def test_second_instance_conflicts_and_sees_writes(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    first, second = await _open(folder), await _open(folder)
    created = await first.create("s")
    seen = await second.load("s")
    assert seen == created
    one = await _advance(first, created, Increment())
    with pytest.raises(ConflictError) as info:
        await second.apply(_batch(seen, Increment(100)))
    assert (info.value.session_id, info.value.expected, info.value.actual) == ("s", 0, 1)
    assert await second.load("s") == one
    two = await _advance(second, one, AppendMessage(_message(2)))
    assert await first.load("s") == two
    assert await first.list_sessions() == ["s"]
    with pytest.raises(SessionExistsError):
        await second.create("s")


async def test_cache_of_a_deleted_and_recreated_session_is_dropped(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    first, second = await _open(folder), await _open(folder)
    await _history(first, "s", 2)
    await second.delete("s")
    with pytest.raises(SessionNotFoundError):
        await first.load("s")
    await _history(first, "s", 2)  # first caches this incarnation
    await second.delete("s")
    replacement = await second.create("s", ConformanceData(label="new"))
    replacement = await _advance(second, replacement, *[Increment(i) for i in range(30)])
    assert await first.load("s") == replacement


def test_processes_lose_no_update(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    script = textwrap.dedent(
        """
        import os, sys, time, anyio
        from stepmachine import Batch, ConflictError, Codec
        from stepmachine.stores import FileStore
        from stepmachine.testing.conformance import ConformanceData, Increment

        async def main(folder, name, count):
            store = await FileStore.open(folder, Codec(ConformanceData, effects=[Increment]))
            open(os.path.join(folder, "..", "ready-" + name), "w").close()
            while not os.path.exists(os.path.join(folder, "..", "go")):
                time.sleep(0.001)  # a start barrier, so that the writers overlap
            done = 0
            while done < count:
                session = await store.load("shared")
                batch = Batch(session_id="shared", revision=session.revision + 1, step=name,
                              cycle=0, timestamp=0.0, effects=(Increment(),))
                try:
                    await store.apply(batch)
                except ConflictError:
                    continue
                done += 1

        anyio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]), backend=sys.argv[4])
        """
    )

    async def setup() -> None:
        await (await _open(folder)).create("shared")

    anyio.run(setup)
    backends = ("asyncio", "trio", "asyncio", "trio")
    workers = [
        # cwd outside the repository: there the source folder would shadow the installed
        # stepmachine.stores mapping.
        subprocess.Popen(
            [sys.executable, "-c", script, str(folder), str(n), "25", backend], cwd=tmp_path
        )
        for n, backend in enumerate(backends)
    ]
    try:
        while len(list(tmp_path.glob("ready-*"))) < len(workers):
            assert all(worker.poll() is None for worker in workers)
            time.sleep(0.005)
        (tmp_path / "go").touch()
        assert [worker.wait(timeout=120) for worker in workers] == [0] * len(workers)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()

    async def check() -> tuple[Session[Any], list[Batch[Effect]]]:
        store = await _open(folder)
        return await store.load("shared"), await store.batches("shared")

    final, batches = anyio.run(check)
    assert final.revision == 25 * len(workers)
    assert final.data.counter == 25 * len(workers)
    assert sorted({b.step for b in batches}) == [str(n) for n in range(len(workers))]


# -- locks, cancellation, boundaries --------------------------------------------------


async def test_lock_timeout_and_cancelled_wait_write_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    store = await _open(folder, lock_timeout=0.05)
    created = await store.create("s")
    log = folder / "s.log"
    before = log.read_bytes()
    holder = os.open(log, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)  # another process is writing
        with pytest.raises(TimeoutError):
            await store.apply(_batch(created, Increment()))
        with pytest.raises(TimeoutError):
            await store.load("s")

        patient = await _open(folder, lock_timeout=600)
        finished = []

        async def writer() -> None:
            await patient.apply(_batch(created, Increment()))
            finished.append(True)

        async with anyio.create_task_group() as tg:
            tg.start_soon(writer)
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
        assert finished == []
    finally:
        os.close(holder)
    assert log.read_bytes() == before
    await _advance(patient, created, Increment())  # nothing left holding the lock
    assert (await store.load("s")).revision == 1


def _open_fds_on(path: Path) -> int:
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}") == str(path)
        except OSError:
            continue
    return count


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
async def test_reader_waiting_for_the_lock_sees_a_delete(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    store = await _open(folder)
    await store.create("s")
    log = folder / "s.log"
    holder = os.open(log, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another process, about to delete the session
    outcome: list[str] = []

    async def reader() -> None:
        try:
            await store.load("s")
        except SessionNotFoundError:
            outcome.append("gone")
        else:
            outcome.append("found")

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        while _open_fds_on(log) < 2:  # noqa: ASYNC110 - polls the OS, not a task
            await anyio.sleep(0.001)  # until the reader holds the file open, waiting
        os.unlink(log)
        os.close(holder)
    assert outcome == ["gone"]


async def test_apply_cancelled_in_the_worker_thread_writes_whole(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    scope = anyio.CancelScope()
    token = anyio.lowlevel.current_token()  # the store's thread is not anyio's (on asyncio)

    def hook(name: str) -> None:
        if name == "apply.written":
            anyio.from_thread.run_sync(scope.cancel, token=token)

    store = await _open(folder, boundary_hook=hook)
    created = await store.create("s")
    returned = []
    with scope:
        await store.apply(_batch(created, Increment(3)))
        returned.append(True)
        await anyio.lowlevel.checkpoint()  # the cancellation lands at the next checkpoint
        returned.append(False)
    assert scope.cancelled_caught
    assert returned == [True]
    loaded = await (await _open(folder)).load("s")
    assert (loaded.revision, loaded.data.counter) == (1, 3)


async def test_boundary_hook_points(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    log = folder / "s.log"
    seen: list[tuple[str, int, int | None]] = []

    def hook(name: str) -> None:
        seen.append(
            (name, log.stat().st_size if log.exists() else -1, _snapshot_revision(folder, "s"))
        )

    store = await _open(folder, boundary_hook=hook, snapshot_every=2)
    session = await store.create("s")
    size0 = log.stat().st_size
    assert seen == [("create.synced", size0, None)]
    seen.clear()
    session = await _advance(store, session, Increment())
    size1 = log.stat().st_size
    assert seen == [
        ("apply.locked", size0, None),
        ("apply.written", size1, None),
        ("apply.synced", size1, None),
    ]
    seen.clear()
    session = await _advance(store, session, Increment())
    size2 = log.stat().st_size
    assert seen == [
        ("apply.locked", size1, None),
        ("apply.written", size2, None),
        ("apply.synced", size2, None),
        ("snapshot.written", size2, None),
        ("snapshot.replaced", size2, 2),
    ]
    # media.* are passed only by a batch with new media (tests/test_media_store.py).
    others = {"create.synced", "media.written", "media.synced"}
    assert set(FileStore.BOUNDARIES) == {name for name, _, _ in seen} | others
    seen.clear()
    with pytest.raises(ConflictError):
        await store.apply(_batch(msgspec.structs.replace(session, revision=0), Increment()))
    assert seen == [("apply.locked", size2, 2)]


async def test_failing_hook_before_writing_leaves_the_lock_free(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    crash = {"at": "apply.locked"}

    def hook(name: str) -> None:
        if name == crash["at"]:
            raise RuntimeError(f"crash at {name}")

    store = await _open(folder, boundary_hook=hook)
    created = await store.create("s")
    before = (folder / "s.log").read_bytes()
    with pytest.raises(RuntimeError, match=r"apply\.locked"):
        await store.apply(_batch(created, Increment()))
    assert (folder / "s.log").read_bytes() == before
    crash["at"] = ""
    other = await _open(folder, lock_timeout=0)
    assert (await _advance(other, created, Increment())).revision == 1


@pytest.mark.parametrize("policy", ["always", "never"])
async def test_fsync_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    calls: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        calls.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    folder = tmp_path / "store"
    store = await _open(folder, fsync=policy, snapshot_every=2)
    created = await store.create("s")
    assert len(calls) == (3 if policy == "always" else 0)  # new folder, temp log, folder again
    calls.clear()
    one = await _advance(store, created, Increment())
    assert len(calls) == (1 if policy == "always" else 0)  # the log
    calls.clear()
    two = await _advance(store, one, Increment())
    assert len(calls) == (3 if policy == "always" else 0)  # the log, the snapshot, the folder
    assert await (await _open(folder)).load("s") == two


async def test_invalid_options(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fsync"):
        await FileStore.open(tmp_path / "a", fsync="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="snapshot_every"):
        await FileStore.open(tmp_path / "a", snapshot_every=0)
    with pytest.raises(TypeError, match="snapshot_every"):
        await FileStore.open(tmp_path / "a", snapshot_every="3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lock_timeout"):
        await FileStore.open(tmp_path / "a", lock_timeout=-1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        await FileStore.open(tmp_path / "file")
    assert sorted(os.listdir(tmp_path)) == ["file"]


# -- fork, reopen -----------------------------------------------------------------------


async def test_fork(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    store = await _open(folder)
    source = await store.create("src", conversation=[_message(0)])
    history, sent = [source], []
    for effects in (
        (AppendMessage(_message(1)), Increment()),
        (Annotate("msg-1", "ns", {"k": 1}), UpdateData.set(label="two")),
        (SetVisibility(("msg-0",), to_model=False),),
        (Increment(10),),
    ):
        batch = _batch(history[-1], *effects)
        await store.apply(batch)
        sent.append(batch)
        history.append(apply_batch(history[-1], effects))

    forked = await store.fork("src", 2, "dst")
    assert forked == msgspec.structs.replace(history[2], id="dst")
    assert await store.load("dst") == forked
    assert await store.load("src") == history[4]
    assert _snapshot_revision(folder, "dst") == 2
    fresh = await _open(folder)
    for revision in range(3):
        assert await fresh.load_at("dst", revision) == msgspec.structs.replace(
            history[revision], id="dst"
        )
    assert await fresh.batches("dst") == [
        msgspec.structs.replace(b, session_id="dst") for b in sent[:2]
    ]
    moved_on = await _advance(fresh, forked, Increment(100))
    assert await store.load("dst") == moved_on
    assert await store.load("src") == history[4]
    assert await store.fork("src", 0, "zero") == msgspec.structs.replace(source, id="zero")

    with pytest.raises(SessionExistsError):
        await store.fork("src", 1, "dst")
    with pytest.raises(ValueError, match="revision"):
        await store.fork("src", 5, "other")
    with pytest.raises(SessionNotFoundError):
        await store.fork("missing", 0, "other")
    assert await store.list_sessions() == ["dst", "src", "zero"]


async def test_data_survives_close_and_reopen(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    async with await _open(folder, snapshot_every=4) as store:
        history = await _history(store, "a", 6)
        await store.create("b", ConformanceData(label="b"))
        sent = await store.batches("a")
    with pytest.raises(StoreClosedError):
        await store.load("a")
    async with await _open(folder) as reopened:
        assert await reopened.list_sessions() == ["a", "b"]
        assert await reopened.load("a") == history[6]
        assert await reopened.batches("a") == sent
        for expected in history:
            assert await reopened.load_at("a", expected.revision) == expected
        assert (await reopened.load("b")).data.label == "b"


# -- golden fixture -----------------------------------------------------------------------


async def test_golden_store_still_reads_exactly(tmp_path: Path) -> None:
    golden = make_golden_file
    expected = json.loads((FIXTURES / "golden" / "file_expected.json").read_text())
    copy = tmp_path / "golden"
    shutil.copytree(FIXTURES / "golden" / "file", copy)
    store = await FileStore.open(copy, golden.CODEC)
    assert await store.list_sessions() == sorted(expected["sessions"])
    assert any(name.endswith(".snap") for name in os.listdir(copy))
    codec = golden.CODEC
    for session_id, revisions in expected["sessions"].items():
        sessions = [codec.decode_session(json.dumps(s).encode()) for s in revisions]
        assert await store.load(session_id) == sessions[-1]
        for revision, session in enumerate(sessions):
            assert await store.load_at(session_id, revision) == session
        batches = [
            codec.decode_batch(json.dumps(b).encode()) for b in expected["batches"][session_id]
        ]
        assert await store.batches(session_id) == batches
        assert [b.revision for b in batches] == list(range(1, len(sessions)))
    assert store.torn_tails == 0


# -- issue 9: snapshots stored compressed ------------------------------------------------


class _BatchCountingCodec(Codec[ConformanceData]):
    def __init__(self) -> None:
        super().__init__(ConformanceData, effects=[Increment])
        self.batches = 0

    def decode_batch(self, buf: bytes, *, where: str = "batch record") -> Any:
        self.batches += 1
        return super().decode_batch(buf, where=where)


async def test_snapshot_is_stored_compressed(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    store = await _open(folder, snapshot_every=4)
    history = await _history(store, "s", 4)
    snap = folder / "s.snap"
    body = json.loads(parse_one(snap.read_bytes(), 0, str(snap), TAG_SNAPSHOT).payload)
    assert body["session"] is None
    record = zlib.decompress(base64.b64decode(body["compressed"]))
    assert CODEC.decode_session(record) == history[-1]
    counting = _BatchCountingCodec()
    assert await (await FileStore.open(folder, counting)).load("s") == history[-1]
    assert counting.batches == 0  # the snapshot, not the log


async def test_uncompressed_snapshot_is_still_used(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    history = await _history(await _open(folder, snapshot_every=4), "s", 5)
    _forge_snapshot(folder, offset=_batch_record(folder / "s.log", 4).end)  # as it was
    body = json.loads(
        parse_one((folder / "s.snap").read_bytes(), 0, "s.snap", TAG_SNAPSHOT).payload
    )
    assert "compressed" not in body
    assert body["session"]["revision"] == 4
    counting = _BatchCountingCodec()
    assert await (await FileStore.open(folder, counting)).load("s") == history[-1]
    assert counting.batches == 1  # the snapshot, then revision 5 only


async def test_compressed_snapshot_that_does_not_decompress_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "store"
    history = await _history(await _open(folder, snapshot_every=2), "s", 3)
    snap = folder / "s.snap"
    record = parse_one(snap.read_bytes(), 0, str(snap), TAG_SNAPSHOT)
    body = json.loads(record.payload)
    body["compressed"] = base64.b64encode(b"\x78 not zlib").decode()
    payload = json.dumps(body, separators=(",", ":")).encode()
    snap.write_bytes(encode_record(TAG_SNAPSHOT, record.revision, payload))
    await _assert_snapshot_ignored(folder, history, caplog)
    assert "does not decompress" in caplog.text


# -- issue 9: long create and batch records stored compressed ------------------------------


async def test_long_records_are_stored_compressed_and_short_ones_as_they_are(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "store"
    store = await _open(folder)
    text = "a long message that repeats itself, " * 20
    created = await store.create("s", conversation=[Message.user(text, id="first")])
    one = await _advance(store, created, AppendMessage(Message.user(text, id="long")))
    two = await _advance(store, one, Increment())
    log = folder / "s.log"
    lines = log.read_bytes().splitlines()
    versions = [line.split(b" ", 2)[:2] for line in lines]
    assert versions == [[b"1", b"H"], [b"2", b"C"], [b"2", b"B"], [b"1", b"B"]]
    packed = lines[2].split(b" ", 5)[5]
    assert len(packed) < len(text)
    record = _batch_record(log, 1)  # parsed: the payload is the codec's JSON again
    assert CODEC.decode_batch(record.payload).effects == (AppendMessage(one.conversation[-1]),)
    fresh = await _open(folder)
    assert await fresh.load("s") == two
    assert await fresh.load_at("s", 1) == one
    assert [b.revision for b in await fresh.batches("s")] == [1, 2]
    forked = await fresh.fork("s", 2, "f")
    assert await (await _open(folder)).load("f") == forked


async def test_a_compressed_record_that_does_not_decompress_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    store = await _open(folder)
    created = await store.create("s")
    long = Message.user("a long message that repeats itself, " * 20, id="long")
    await _advance(store, created, AppendMessage(long), Increment())
    log = folder / "s.log"
    record = _batch_record(log, 1)
    _splice(log, record, encode_record(TAG_BATCH, 1, b"bm90IHpsaWI=", version=2))
    await _assert_damage_refused(folder, [str(log), f"byte {record.offset}", "decompress"])


# -- at the edges, as a user meets them ----------------------------------------


async def test_a_damaged_file_store_record_names_the_session_and_revision(
    tmp_path: Path,
) -> None:
    store = await FileStore.open(tmp_path / "fs")
    async with store:
        agent = Agent("scripted", store=store)
        for question in ("one", "two", "three"):
            await agent.run("s1", question)
    log = tmp_path / "fs" / "s1.log"
    data = bytearray(log.read_bytes())
    data[len(data) // 2] ^= 0x20
    log.write_bytes(bytes(data))
    before = log.read_bytes()
    store = await FileStore.open(tmp_path / "fs")
    async with store:
        with pytest.raises(StoredDataError) as caught:
            await store.load("s1")
    assert log.read_bytes() == before  # nothing rewritten (this part holds)
    assert "'s1'" in str(caught.value)
    assert "revision" in str(caught.value)
