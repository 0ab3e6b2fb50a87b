"""FileStore snapshots are bound to the exact log content they cover.

A snapshot (and an instance's cache) records the offset and digest of the last
log record it includes. A log cut back and rewritten since (a restored backup,
a power loss under ``fsync="never"``) no longer holds that record: the snapshot
is ignored and reported, and the log is the truth. A snapshot at a revision the
log no longer reaches proves acknowledged batches were lost: that raises
``StoredDataError``. A torn final record that was never acknowledged stays a
silent (reported, counted) recovery. Snapshots written before the binding
existed (the golden fixture) are unbound: never used in place of the log.
"""

from __future__ import annotations

import base64
import json
import logging
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any

import make_golden_file
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import AppendMessage, Codec, Effect, Message, Session, StoredDataError
from stepmachine.extend import Batch, apply_batch
from stepmachine.stores import FileStore
from stepmachine.stores._file_log import (
    TAG_BATCH,
    TAG_SNAPSHOT,
    Record,
    encode_record,
    parse_one,
    parse_records,
)
from stepmachine.testing.conformance import ConformanceData, Increment

CODEC: Codec[Any] = Codec(ConformanceData, effects=[Increment])
GOLDEN = Path(__file__).parent / "fixtures" / "golden"
LOGGER = "stepmachine.stores.file"


# -- helpers --------------------------------------------------------------------------


def _batch(session: Session[Any], text: str) -> Batch[Effect]:
    revision = session.revision + 1
    return Batch(
        session_id=session.id,
        revision=revision,
        step="test",
        cycle=revision,
        timestamp=1_700_000_000.0 + revision,
        effects=(AppendMessage(Message.user(text, id=f"m-{revision}")), Increment()),
    )


async def _write(store: FileStore, session: Session[Any], texts: list[str]) -> list[Session[Any]]:
    """Apply one batch per text on top of ``session``; the sessions after each."""
    after = []
    for text in texts:
        batch = _batch(session, text)
        await store.apply(batch)
        session = apply_batch(session, batch.effects)
        after.append(session)
    return after


def _records(log: Path) -> list[Record]:
    records, _ = parse_records(log.read_bytes(), 0, str(log))
    return records


def _end_of(log: Path, revision: int) -> int:
    """The log offset just past the record of ``revision`` (0: the create record)."""
    return next(r.end for r in _records(log) if r.revision == revision and r.tag != b"H")


def _texts(session: Session[Any]) -> list[str]:
    return [message.parts[0].text for message in session.conversation]  # type: ignore[union-attr]


async def _rewrite(
    folder: Path, cut: int, history: list[Session[Any]], texts: list[str], *, torn: int = 0
) -> list[Session[Any]]:
    """Cut ``s.log`` back to revision ``cut`` (plus ``torn`` bytes of the next record)
    and append ``texts`` as new revisions, with the snapshot out of the way (as a
    restored backup of the log would be written to); then put the snapshot back.

    Returns the new history (revisions 0..cut, then the new ones).
    """
    log, snap = folder / "s.log", folder / "s.snap"
    saved = snap.read_bytes() if snap.exists() else None
    snap.unlink(missing_ok=True)
    data = log.read_bytes()
    log.write_bytes(data[: _end_of(log, cut) + torn])
    writer = await FileStore.open(folder, CODEC, fsync="never", snapshot_every=10_000)
    new = history[: cut + 1] + await _write(writer, history[cut], texts)
    await writer.aclose()
    assert not snap.exists()
    if saved is not None:
        snap.write_bytes(saved)
    return new


async def _assert_reads(folder: Path, history: list[Session[Any]]) -> None:
    """A fresh store reads exactly ``history`` through load, load_at and batches."""
    store = await FileStore.open(folder, CODEC)
    last = history[-1]
    assert await store.load("s") == last
    for expected in history:
        assert await store.load_at("s", expected.revision) == expected
    batches = await store.batches("s")
    assert [b.revision for b in batches] == list(range(1, last.revision + 1))
    session = history[0]
    for batch in batches:
        session = apply_batch(session, batch.effects)
    assert session == last
    fresh = await FileStore.open(folder, CODEC)  # load_at and batches on a cold instance too
    assert await fresh.load_at("s", last.revision) == last
    assert await fresh.batches("s", after=max(last.revision - 2, 0)) == batches[-2:]


def _snapshot_payload(snap: Path) -> dict[str, Any]:
    """The snapshot's payload, its session decompressed into ``session`` (issue 9)."""
    record = parse_one(snap.read_bytes(), 0, str(snap), TAG_SNAPSHOT)
    payload: dict[str, Any] = json.loads(record.payload)
    if payload.get("compressed"):
        payload["session"] = json.loads(zlib.decompress(base64.b64decode(payload["compressed"])))
    return payload


# -- the reported scenario: a snapshot outliving its log ------------------------------


async def test_snapshot_of_a_rewritten_log_with_equal_record_sizes_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "store"
    store = await FileStore.open(folder, CODEC, snapshot_every=10)
    created = await store.create("s")
    history = [created, *await _write(store, created, [f"old {i:02d}" for i in range(1, 11)])]
    assert _snapshot_payload(folder / "s.snap")["session"]["revision"] == 10
    log = folder / "s.log"
    old_ends = [_end_of(log, revision) for revision in range(6, 11)]

    new = await _rewrite(folder, 5, history, [f"new {i:02d}" for i in range(6, 13)])
    # Same record sizes: the snapshot's offset is the end of the NEW revision 10,
    # and the record after it is revision 11, as the snapshot expects.
    assert [_end_of(log, revision) for revision in range(6, 11)] == old_ends
    assert _texts(new[12])[-1] == "new 12"

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        fresh = await FileStore.open(folder, CODEC)
        loaded = await fresh.load("s")
        assert loaded == new[12]
        assert _texts(loaded)[5:10] == [f"new {i:02d}" for i in range(6, 11)]
        assert await (await FileStore.open(folder, CODEC)).load_at("s", 12) == new[12]
        assert await (await FileStore.open(folder, CODEC)).load_at("s", 10) == new[10]
    assert "damaged_snapshot_ignored" in caplog.text
    assert "cut back and rewritten" in caplog.text
    batches = await (await FileStore.open(folder, CODEC)).batches("s")
    replayed = new[0]
    for batch in batches:
        replayed = apply_batch(replayed, batch.effects)
    assert _texts(replayed)[5:] == [f"new {i:02d}" for i in range(6, 13)]
    await _assert_reads(folder, new)

    # The instance that wrote the old revisions notices too (its cache is bound
    # to the old record 10, which the log no longer holds), and says so.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert await store.load("s") == new[12]
        assert await store.load_at("s", 8) == new[8]
    assert "log_rewritten" in caplog.text

    # The next snapshot written is bound to the new log and used.
    writer = await FileStore.open(folder, CODEC, snapshot_every=13)
    newer = await _write(writer, new[12], ["new 13"])
    assert _snapshot_payload(folder / "s.snap")["session"]["revision"] == 13
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        await _assert_reads(folder, [*new, *newer])
    assert "snapshot" not in caplog.text


async def test_snapshot_beyond_a_truncated_log_is_lost_data(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "store"
    store = await FileStore.open(folder, CODEC, fsync="never", snapshot_every=50)
    created = await store.create("s")
    history = [created, *await _write(store, created, [f"t {i}" for i in range(1, 161)])]
    assert _snapshot_payload(folder / "s.snap")["session"]["revision"] == 150
    log, snap = folder / "s.log", folder / "s.snap"
    log.write_bytes(log.read_bytes()[: _end_of(log, 6)])
    truncated = log.read_bytes()

    fresh = await FileStore.open(folder, CODEC)
    calls = {
        "load": lambda: fresh.load("s"),
        "load_at": lambda: fresh.load_at("s", 3),
        "batches": lambda: fresh.batches("s"),
        "fork": lambda: fresh.fork("s", 2, "copy"),
        "apply": lambda: fresh.apply(_batch(history[6], "after the loss")),
    }
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for name, call in calls.items():
            with pytest.raises(StoredDataError) as info:
                await call()
            message = str(info.value)
            assert "revision 150" in message, name
            assert "ends at revision 6" in message, name
            assert "7..150" in message, name
            assert str(snap) in message, name
            assert str(log) in message, name
    assert "ignored" not in caplog.text  # raised, not warned about and carried on
    assert log.read_bytes() == truncated  # nothing written
    assert sorted(p.name for p in folder.iterdir()) == ["s.log", "s.snap"]

    # Deleting the snapshot accepts the loss, as the message says.
    snap.unlink()
    accepted = await FileStore.open(folder, CODEC)
    assert await accepted.load("s") == history[6]
    # ... but the instance whose cache is at revision 160 still refuses the log.
    with pytest.raises(StoredDataError, match="cache holds session 's' at revision 160") as info:
        await store.load("s")
    assert "ends at revision 6" in str(info.value)
    assert "open a new FileStore" in str(info.value)


async def test_snapshot_beyond_a_torn_tail_is_lost_data(tmp_path: Path) -> None:
    # The torn record 7 was acknowledged: the snapshot at 8 proves it.
    folder = tmp_path / "store"
    store = await FileStore.open(folder, CODEC, fsync="never", snapshot_every=4)
    created = await store.create("s")
    await _write(store, created, [f"t {i}" for i in range(1, 9)])
    log = folder / "s.log"
    log.write_bytes(log.read_bytes()[: _end_of(log, 6) + 30])
    with pytest.raises(StoredDataError, match="ends at revision 6"):
        await (await FileStore.open(folder, CODEC)).load("s")


async def test_unacknowledged_torn_tail_behind_a_snapshot_is_a_silent_recovery(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "store"
    store = await FileStore.open(folder, CODEC, snapshot_every=4)
    created = await store.create("s")
    history = [created, *await _write(store, created, [f"t {i}" for i in range(1, 5)])]
    log = folder / "s.log"
    clean = log.read_bytes()
    torn = encode_record(TAG_BATCH, 5, b'{"never":"acknowledged"}')[:20]
    log.write_bytes(clean + torn)
    fresh = await FileStore.open(folder, CODEC)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert await fresh.load("s") == history[4]
    assert fresh.torn_tails == 1
    assert "torn_tail_ignored" in caplog.text
    assert "snapshot" not in caplog.text  # the snapshot at 4 fits and is used
    after = await _write(fresh, history[4], ["t 5"])
    assert log.read_bytes().startswith(clean)
    assert await (await FileStore.open(folder, CODEC)).load("s") == after[-1]


# -- the snapshot format: old (unbound) snapshots ------------------------------------------


def test_golden_snapshots_are_unbound() -> None:
    """The committed fixture predates the binding: it is what unbound snapshots look like."""
    for name in ("chat.snap", "ledger.snap"):
        assert "last_record" not in _snapshot_payload(GOLDEN / "file" / name)


def test_older_code_reads_a_bound_snapshot() -> None:
    """The binding is an added, defaulted field: a decoder without it still reads."""

    class OldSnapshotBody(msgspec.Struct, frozen=True):  # the format before the binding
        session_id: str
        nonce: str
        offset: int
        session: msgspec.Raw

    from stepmachine.stores._file_log import LastRecord, SnapshotBody

    body = SnapshotBody("s", "n", 10, msgspec.Raw(b"{}"), LastRecord(3, "ab" * 16))
    old = msgspec.json.decode(msgspec.json.encode(body), type=OldSnapshotBody)
    assert (old.session_id, old.offset, bytes(old.session)) == ("s", 10, b"{}")


async def test_unbound_snapshot_is_never_used_in_place_of_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # An old-format snapshot whose session disagrees with the log (well
    # checksummed): the log is replayed and wins; an info record says why.
    expected = json.loads((GOLDEN / "file_expected.json").read_text())
    codec = make_golden_file.CODEC
    folder = tmp_path / "golden"
    shutil.copytree(GOLDEN / "file", folder)
    snap = folder / "chat.snap"
    body = _snapshot_payload(snap)
    body["session"]["data"]["budget"] = 999.0
    snap.write_bytes(
        encode_record(
            TAG_SNAPSHOT, body["session"]["revision"], json.dumps(body, ensure_ascii=False).encode()
        )
    )
    revisions = [codec.decode_session(json.dumps(s).encode()) for s in expected["sessions"]["chat"]]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        store = await FileStore.open(folder, codec)
        assert await store.load("chat") == revisions[-1]
        cold = await FileStore.open(folder, codec)
        for revision, session in enumerate(revisions):
            assert await cold.load_at("chat", revision) == session
    assert "unbound_snapshot_ignored" in caplog.text
    assert "damaged_snapshot_ignored" not in caplog.text
    # The next snapshot written is bound.
    writer = await FileStore.open(folder, codec, snapshot_every=1)
    await writer.apply(
        Batch(
            session_id="chat",
            revision=len(revisions),
            step="test",
            cycle=1,
            timestamp=1.0,
            effects=(AppendMessage(Message.user("again", id="m-again")),),
        )
    )
    assert "last_record" in _snapshot_payload(snap)


async def test_unbound_snapshot_beyond_a_truncated_log_is_lost_data(tmp_path: Path) -> None:
    folder = tmp_path / "golden"
    shutil.copytree(GOLDEN / "file", folder)
    log = folder / "chat.log"
    assert _snapshot_payload(folder / "chat.snap")["session"]["revision"] == 8
    log.write_bytes(log.read_bytes()[: _end_of(log, 3)])
    store = await FileStore.open(folder, make_golden_file.CODEC)
    with pytest.raises(StoredDataError, match=r"revision 8, but its log .* ends at revision 3"):
        await store.load("chat")


# -- property: any cut, any rewrite ----------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=24),
    snapshot_every=st.integers(min_value=1, max_value=8),
    cut_at=st.floats(min_value=0, max_value=1),
    torn=st.integers(min_value=0, max_value=60),
    rewrite=st.lists(st.integers(min_value=1, max_value=40), max_size=24),
)
async def test_any_cut_and_rewrite_reads_the_log_or_reports_the_loss(
    lengths: list[int], snapshot_every: int, cut_at: float, torn: int, rewrite: list[int]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "store"
        store = await FileStore.open(folder, CODEC, fsync="never", snapshot_every=snapshot_every)
        created = await store.create("s")
        history = [created, *await _write(store, created, ["a" * n for n in lengths])]
        written = len(lengths)
        snapshot = written - written % snapshot_every  # 0: no snapshot file
        assert (folder / "s.snap").exists() == (snapshot > 0)
        cut = min(int(cut_at * written), written - 1) if written else 0
        record = _end_of(folder / "s.log", cut + 1) - _end_of(folder / "s.log", cut)
        torn = min(torn, record - 1)  # never the whole next record
        # Every rewritten record differs from the original ("b"s, not "a"s): the
        # binding is the last record a snapshot covers, so a rewrite reproducing
        # that record byte for byte is out of its reach (documented).
        new = await _rewrite(folder, cut, history, ["b" * n for n in rewrite], torn=torn)
        final = new[-1].revision
        if snapshot > final:
            with pytest.raises(StoredDataError, match=f"revision {snapshot}, but its log"):
                await (await FileStore.open(folder, CODEC)).load("s")
            with pytest.raises(StoredDataError, match=f"ends at revision {final}"):
                await (await FileStore.open(folder, CODEC)).batches("s")
        else:
            await _assert_reads(folder, new)
