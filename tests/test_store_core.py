"""The durable stores' shared core (``stores/_core.py``) over a third, in-memory backend.

The backend here implements the byte-backend protocol (``stores/_backend.py``)
with dicts, as a PostgreSQL backend would with rows, in both record forms. The
properties: replaying from any snapshot ever written gives what replaying from
revision 0 gives; pruning keeps revision 0 and the newest snapshot only, and
never loses a revision ``session_at`` can reach; a corrupt record is a clear
``StoredDataError`` naming the session and the record, and nothing is
rewritten; each batch is applied once per ``apply``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepmachine import (
    Annotate,
    AppendMessage,
    Codec,
    ConflictError,
    Effect,
    Message,
    ReplaceConversation,
    Session,
    SessionExistsError,
    SessionNotFoundError,
    StoredDataError,
)
from stepmachine.extend import Batch, apply_batch
from stepmachine.stores._backend import (
    Base,
    BatchRecord,
    Cached,
    EffectRows,
    Marks,
    Moved,
    NewSnapshot,
    StoredBatch,
    Tail,
)
from stepmachine.stores._core import LogCore
from stepmachine.stores._replay import decode_base, replay
from stepmachine.stores._snapshot_policy import EveryN, SnapshotPolicy, Weighted
from stepmachine.testing.conformance import ConformanceData, Increment

Pos = tuple[int, int]  # (incarnation, revision)
FORMS: list[type[BatchRecord] | type[EffectRows]] = [BatchRecord, EffectRows]


@dataclass
class _Log:
    incarnation: int
    batches: list[StoredBatch] = field(default_factory=list)
    snapshots: dict[int, bytes] = field(default_factory=dict)
    marks: Marks = field(default_factory=Marks)


class MemoryBackend:
    """Every session's log and snapshots in dicts; ``written`` keeps every snapshot
    ever written (before pruning), to replay from each of them."""

    def __init__(self) -> None:
        self.logs: dict[str, _Log] = {}
        self.written: dict[str, dict[int, bytes]] = {}
        self.unused: list[tuple[int, str]] = []
        self.blobs: dict[str, bytes] = {}
        self._incarnations = 0

    def txn(self) -> MemoryTxn:
        return MemoryTxn(self)

    def next_incarnation(self) -> int:
        self._incarnations += 1
        return self._incarnations


class MemoryTxn:
    """The protocol over :class:`MemoryBackend` (one "transaction": no concurrency here)."""

    FORM: ClassVar[None] = None

    def __init__(self, backend: MemoryBackend) -> None:
        self.backend = backend

    def log(self, session_id: str) -> _Log:
        try:
            return self.backend.logs[session_id]
        except KeyError:
            raise SessionNotFoundError(session_id) from None

    def head(self, session_id: str) -> int | None:
        return len(self.log(session_id).batches)

    def tail(self, session_id: str, cached: Cached[Pos]) -> Tail[Pos] | Moved:
        log = self.log(session_id)
        incarnation, revision = cached.position
        if incarnation != log.incarnation:
            return Moved(rewritten=False)
        if revision > len(log.batches):
            return Moved(rewritten=True, remedy="start again")
        return self.records(session_id, revision, None, cached.position)

    def bases(self, session_id: str, upto: int | None) -> Iterator[Base[Pos]]:
        log = self.log(session_id)
        for revision in sorted(log.snapshots, reverse=True):
            if upto is None or revision <= upto:
                holder = f"snapshot {revision}" if revision else ""
                where = f"snapshot {revision} of {session_id!r}"
                record = log.snapshots[revision]
                yield Base(revision, record, where, (log.incarnation, revision), holder=holder)

    def records(
        self, session_id: str, after: int, upto: int | None, start: Pos | None
    ) -> Tail[Pos]:
        log = self.log(session_id)
        top = len(log.batches) if upto is None else upto
        return Tail(log.batches[after:top], (log.incarnation, top), log.marks, "the memory log")

    def append(
        self,
        session_id: str,
        at: Pos,
        batch: StoredBatch,
        marks: Marks,
        snapshot: NewSnapshot | None,
    ) -> Pos | None:
        log = self.log(session_id)
        if at != (log.incarnation, len(log.batches)):
            return None
        where = f"memory log of {session_id!r} revision {batch.revision}"
        log.batches.append(_moved(batch, where))
        log.marks = marks
        if snapshot is not None:
            self.backend.written[session_id][snapshot.revision] = snapshot.record
            log.snapshots = {0: log.snapshots[0], snapshot.revision: snapshot.record}
        return (log.incarnation, len(log.batches))

    def create(self, session_id: str, record: bytes) -> tuple[Pos, Marks]:
        if session_id in self.backend.logs:
            raise SessionExistsError(session_id)
        log = _Log(self.backend.next_incarnation(), snapshots={0: record})
        log.marks = Marks(0, len(record), 0)
        self.backend.logs[session_id] = log
        self.backend.written[session_id] = {0: record}
        return (log.incarnation, 0), log.marks

    def delete(self, session_id: str) -> None:
        self.log(session_id)
        del self.backend.logs[session_id]

    def unusable(self, session_id: str, base: Base[Pos], reason: str) -> None:
        self.backend.unused.append((base.revision, reason))

    media_label = "the memory backend's media"

    def blob(self, digest: str) -> bytes | None:
        return self.backend.blobs.get(digest)

    def put_blobs(self, blobs: Mapping[str, bytes]) -> None:
        self.backend.blobs.update(blobs)


def _moved(batch: StoredBatch, where: str) -> StoredBatch:
    """``batch`` as stored: named by where it now is."""
    if isinstance(batch, BatchRecord):
        return BatchRecord(batch.revision, where, batch.record)
    return EffectRows(
        batch.revision, where, batch.step, batch.cycle, batch.timestamp, batch.effects
    )


CODEC: Codec[Any] = Codec(ConformanceData, effects=[Increment])


class Counted(Effect, frozen=True, tag="test.core.counted"):
    """Counts how often it is applied (to check one apply per batch)."""

    applied: ClassVar[list[int]] = []

    def apply(self, session: Session[Any]) -> Session[Any]:
        Counted.applied.append(session.revision)
        return session


COUNTING: Codec[Any] = Codec(ConformanceData, effects=[Increment, Counted])


def _one(revision: int, effect: Effect) -> Batch[Effect]:
    """The batch producing ``revision`` with one effect."""
    return Batch("s", revision, "test", 0, 0.0, (effect,))


def _core(form: type[BatchRecord] | type[EffectRows], policy: SnapshotPolicy) -> LogCore[Pos]:
    return LogCore(CODEC, policy, form)


def _effect(op: tuple[str, int], index: int) -> Effect:
    kind, size = op
    if kind == "append":
        return AppendMessage(Message.user("x" * size, id=f"m-{index}"))
    if kind == "replace":
        return ReplaceConversation((Message.system(f"summary {index}", id=f"r-{index}"),))
    return Increment(size)


def _build(
    core: LogCore[Pos], backend: MemoryBackend, ops: list[tuple[str, int]]
) -> list[Session[Any]]:
    """Create "s" and apply one batch per op through the core; every revision's session."""
    session, record, blobs = core.new_session("s", None, [Message.user("hello", id="m0")])
    core.remember("s", core.create(backend.txn(), "s", session, record, blobs))
    history = [session]
    for index, op in enumerate(ops):
        batch = Batch("s", session.revision + 1, "test", index, 1.7e9, (_effect(op, index),))
        written = core.apply(backend.txn(), core.prepare(batch, "new batch"))
        core.remember("s", written)
        session = apply_batch(session, batch.effects)
        assert written.session == session
        history.append(session)
    return history


OPS = st.lists(
    st.one_of(
        st.integers(min_value=1, max_value=300).map(lambda n: ("append", n)),
        st.just(("replace", 0)),
        st.integers(min_value=-3, max_value=3).map(lambda n: ("increment", n)),
    ),
    min_size=1,
    max_size=40,
)
POLICIES = st.one_of(
    st.integers(min_value=1, max_value=6).map(EveryN),
    st.tuples(st.integers(1, 4), st.integers(2, 8)).map(lambda t: Weighted(t[0], max(t))),
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, policy=POLICIES, form=st.sampled_from(FORMS))
def test_replay_from_any_snapshot_is_replay_from_zero(
    ops: list[tuple[str, int]], policy: SnapshotPolicy, form: Any
) -> None:
    backend = MemoryBackend()
    core = _core(form, policy)
    history = _build(core, backend, ops)
    log = backend.logs["s"]
    for revision, record in backend.written["s"].items():
        base = Base(revision, record, f"snapshot {revision}", (log.incarnation, revision))
        reader = core.reader(backend.txn())
        start = decode_base(CODEC, "s", base, reader)
        assert start == history[revision]
        assert replay(CODEC, start, log.batches[revision:], reader) == history[-1]


@settings(max_examples=60, deadline=None)
@given(ops=OPS, policy=POLICIES, form=st.sampled_from(FORMS))
def test_pruning_never_loses_a_revision_session_at_reaches(
    ops: list[tuple[str, int]], policy: SnapshotPolicy, form: Any
) -> None:
    backend = MemoryBackend()
    history = _build(_core(form, policy), backend, ops)
    kept = sorted(backend.logs["s"].snapshots)
    newest = max(backend.written["s"])
    assert kept in ([0], [0, newest])  # revision 0 and the newest, nothing else
    replaced = [i + 1 for i, (kind, _) in enumerate(ops) if kind == "replace"]
    if replaced:
        assert newest >= replaced[-1]  # a ReplaceConversation is always followed by one
    fresh = _core(form, policy)  # a cold instance: nothing cached
    for expected in history:
        assert fresh.session_at(backend.txn(), "s", expected.revision) == expected
    assert fresh.current(backend.txn(), "s").session == history[-1]
    with pytest.raises(ValueError, match="revision"):
        fresh.session_at(backend.txn(), "s", len(history))


CORRUPTIONS: dict[str, bytes] = {
    "not-json": b"\xff not json",
    "unknown-tag": b'[{"type":"evil.module:Class"}]',
    "two-effects": CODEC.encode_effects((Increment(1), Increment(2))),
    "does-not-apply": CODEC.encode_effects((Annotate("no-such-message", "ns", {"k": 1}),)),
}
"""Damaged stored batches: an effects record (or garbage) in place of the real one."""


def _damaged(stored: StoredBatch, kind: str) -> StoredBatch:
    body = CORRUPTIONS[kind]
    if isinstance(stored, EffectRows):
        return EffectRows(
            stored.revision, stored.where, stored.step, stored.cycle, stored.timestamp, (body,)
        )
    if kind == "not-json":
        return BatchRecord(stored.revision, stored.where, body)
    batch = CODEC.decode_batch(stored.record)
    fields = {"session_id": batch.session_id, "revision": batch.revision, "step": batch.step}
    fields |= {"cycle": batch.cycle, "timestamp": batch.timestamp}
    record = msgspec.json.encode({**fields, "effects": msgspec.Raw(body)})
    return BatchRecord(stored.revision, stored.where, record)


@settings(max_examples=40, deadline=None)
@given(
    count=st.integers(min_value=1, max_value=12),
    at=st.floats(min_value=0, max_value=1),
    kind=st.sampled_from(["not-json", "unknown-tag", "two-effects", "does-not-apply"]),
    form=st.sampled_from(FORMS),
)
def test_a_corrupt_record_is_a_clear_error_and_nothing_is_rewritten(
    count: int, at: float, kind: str, form: Any
) -> None:
    if kind == "two-effects" and form is BatchRecord:
        kind = "unknown-tag"  # a batch record holds any number of effects
    backend = MemoryBackend()
    policy = EveryN(1000)  # no snapshot after revision 0: every load replays the log
    history = _build(_core(form, policy), backend, [("increment", 1)] * count)
    revision = 1 + min(int(at * count), count - 1)
    log = backend.logs["s"]
    log.batches[revision - 1] = _damaged(log.batches[revision - 1], kind)
    before = copy.deepcopy(backend.logs)

    fresh = _core(form, policy)
    with pytest.raises(StoredDataError) as info:
        fresh.current(backend.txn(), "s")
    message = str(info.value)
    assert "'s'" in message
    assert f"memory log of 's' revision {revision}" in message
    with pytest.raises(StoredDataError):
        fresh.session_at(backend.txn(), "s", revision)
    stale = _one(count + 1, Increment(1))
    with pytest.raises(StoredDataError):
        fresh.apply(backend.txn(), fresh.prepare(stale, "new"))
    assert fresh.session_at(backend.txn(), "s", revision - 1) == history[revision - 1]
    assert backend.logs == before  # nothing rewritten


@pytest.mark.parametrize("form", FORMS)
def test_each_batch_is_applied_once_per_apply(form: Any) -> None:
    backend = MemoryBackend()
    core: LogCore[Pos] = LogCore(COUNTING, EveryN(1000), form)
    session, record, blobs = core.new_session("s", None, ())
    core.remember("s", core.create(backend.txn(), "s", session, record, blobs))
    Counted.applied.clear()
    for revision in range(1, 6):
        batch = _one(revision, Counted())
        core.remember("s", core.apply(backend.txn(), core.prepare(batch, "new")))
        assert core.current(backend.txn(), "s").session.revision == revision
    assert Counted.applied == [0, 1, 2, 3, 4]  # once each, on the session it followed


@pytest.mark.parametrize("form", FORMS)
def test_compare_and_set(form: Any) -> None:
    backend = MemoryBackend()
    first, second = _core(form, EveryN(3)), _core(form, EveryN(3))
    history = _build(first, backend, [("increment", 1)] * 2)
    stale = _one(2, Increment(5))
    with pytest.raises(ConflictError) as info:
        second.apply(backend.txn(), second.prepare(stale, "new"))
    assert (info.value.expected, info.value.actual) == (1, 2)
    # A cache that another writer moved past: the append's compare-and-set misses,
    # the core reads what was appended and writes on top of it.
    second.remember("s", second.current(backend.txn(), "s"))
    moved = _one(3, Increment(10))
    first.remember("s", first.apply(backend.txn(), first.prepare(moved, "new")))
    ahead = _one(4, Increment(100))
    written = second.apply(backend.txn(), second.prepare(ahead, "new"))
    assert written.session.data.counter == history[-1].data.counter + 110
    assert len(backend.logs["s"].batches) == 4


@pytest.mark.parametrize("form", FORMS)
def test_a_log_that_lost_what_a_snapshot_saw_is_lost_data(form: Any) -> None:
    backend = MemoryBackend()
    _build(_core(form, EveryN(3)), backend, [("increment", 1)] * 4)
    log = backend.logs["s"]
    assert sorted(log.snapshots) == [0, 3]
    snapshot = log.snapshots.pop(3)
    log.batches[:] = log.batches[:2]  # the log lost revisions 3 and 4...
    log.snapshots[3] = snapshot  # ...that the snapshot at 3 saw
    # The snapshot is the newest base; it does not fit (it is past the log's end).
    before = copy.deepcopy(backend.logs)

    class Misfit(MemoryTxn):
        def bases(self, session_id: str, upto: int | None) -> Iterator[Base[Pos]]:
            end = len(self.log(session_id).batches)
            for base in super().bases(session_id, upto):
                fits = base.revision <= end
                yield base if fits else msgspec.structs.replace(base, problem="past the end")

    lost = r"snapshot 3 holds session 's' at revision 3.*ends at revision 2"
    with pytest.raises(StoredDataError, match=lost):
        _core(form, EveryN(3)).current(Misfit(backend), "s")
    assert backend.unused == []  # raised, not reported and carried on
    assert backend.logs == before
