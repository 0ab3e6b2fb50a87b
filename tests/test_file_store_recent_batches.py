"""``FileStore.batches(id, after)`` before a snapshot reads back from it, not from revision 0.

A snapshot later than ``after`` (the 16 batches a traced run reads to link to
the previous run, right after every snapshot) used to make the store parse
the whole log. It now finds the record of revision ``after + 1`` reading back
from the snapshot's end; these tests check it returns what a store without
snapshots returns, for every ``after``, with records of mixed sizes (short
ones, long compressed ones), and that it reads about as many bytes at 400
batches as at 40.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from stepmachine import AppendMessage, Codec, Message, NoData, submit
from stepmachine.stores import FileStore, _file_txn


def _text(n: int) -> str:
    if n % 7 == 3:
        return " ".join(f"word{i}" for i in range(400))  # long: a compressed record
    return f"m{n}" * (1 + n % 5)


async def _grown(folder: Path, batches: int, snapshot_every: int) -> FileStore:
    store = await FileStore.open(
        folder, Codec(NoData), fsync="never", snapshot_every=snapshot_every
    )
    await store.create("s", conversation=[])
    for n in range(batches):
        await submit(store, "s", [AppendMessage(Message.user(_text(n), id=f"u{n}"))])
    return store


async def test_batches_after_any_revision_equal_a_log_without_snapshots(tmp_path: Path) -> None:
    snapshots = await _grown(tmp_path / "snap", 37, snapshot_every=10)
    plain = await _grown(tmp_path / "plain", 37, snapshot_every=10**6)
    try:
        assert (tmp_path / "snap" / "s.snap").exists()
        for after in range(38):
            got = await snapshots.batches("s", after)
            expected = await plain.batches("s", after)
            assert [b.revision for b in got] == list(range(after + 1, 38))
            assert msgspec.json.encode([b.effects for b in got]) == msgspec.json.encode(
                [b.effects for b in expected]
            )
    finally:
        await snapshots.aclose()
        await plain.aclose()


async def test_the_last_batches_before_a_snapshot_cost_no_more_in_a_longer_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read: list[int] = []
    original = _file_txn.read_range  # type: ignore[attr-defined]

    def counted(fd: int, start: int, end: int) -> bytes:
        data: bytes = original(fd, start, end)
        read.append(len(data))
        return data

    costs = {}
    for batches in (40, 400):
        store = await _grown(tmp_path / f"s{batches}", batches, snapshot_every=20)
        try:
            monkeypatch.setattr(_file_txn, "read_range", counted)
            read.clear()
            recent = await store.batches("s", batches - 16)  # a snapshot at the head
            costs[batches] = sum(read)
            monkeypatch.setattr(_file_txn, "read_range", original)
            assert [b.revision for b in recent] == list(range(batches - 15, batches + 1))
        finally:
            await store.aclose()
    assert costs[400] <= 2 * costs[40], costs
