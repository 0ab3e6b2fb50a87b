"""The durable stores' shared core: one log-and-snapshot engine over byte backends.

:class:`LogCore` owns everything the durable stores have in common:

- the **cache** of the last session per id and the backend position it stands
  at, so that a load reads only what was appended since, and an apply on top
  of it reads nothing but what the backend needs to prove its position current;
- **replay**: a base (a snapshot, or the revision-0 record) plus the batches
  after it, decoded through the codec and applied **once each**, in order
  (:mod:`._replay`);
- the **compare-and-set** check: a batch for revision ``n`` is written only
  onto the session at ``n - 1`` (``ConflictError`` otherwise), and the
  backend's ``append`` proves, in its own transaction, that the log still ends
  where the cached session does;
- the **snapshot policy** (:mod:`._snapshot_policy`): when a snapshot is due;
  the backend writes it with the batch and prunes the one it supersedes;
- **errors**: ``StoredDataError`` naming the session and the record's position
  for anything that does not decode or apply, and for a log that no longer
  reaches a revision a snapshot or the cache saw (acknowledged batches lost).
  Nothing is ever rewritten.

One apply per batch: ``apply`` encodes the batch once in the backend's record
form, decodes that back (O(batch), never the history: the session it returns
is exactly what a later load decodes), applies it once to the cached session
and returns the result, which the store keeps as its cache. Only when the
backend reports the log moved under the cache (another writer) is the batch
applied again, on the session read then.

Media bytes (images, documents, audio) are kept apart from the records, once
per digest (:mod:`._media_blobs`): :meth:`LogCore.prepare` takes them out of
the batch (refusing a part over ``max_media_bytes`` before anything is
written), :meth:`LogCore.apply` has the backend store them before the batch
record in the same transaction, and every decode puts them back, checked.

Backends implement the small protocol of :mod:`._backend` (read the tail
after a position, list bases, read records, append with compare-and-set,
create, delete); every method of the core runs inside one backend transaction
(or lock hold), in the backend's worker thread, except :meth:`LogCore.prepare`
and :meth:`LogCore.new_session`, which run before it, on the caller's thread.
How a PostgreSQL backend fits is in :mod:`._backend`'s docstring.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

import msgspec

from stepmachine import (
    Codec,
    ConflictError,
    Effect,
    InvalidFieldError,
    Message,
    ReplaceConversation,
    Session,
    SessionNotFoundError,
    StoredDataError,
)
from stepmachine.extend import Batch, apply_batch

from ._backend import (
    Base,
    BatchRecord,
    Cached,
    EffectRows,
    LogTxn,
    Marks,
    NewSnapshot,
    StoredBatch,
    Tail,
)
from ._media_blobs import DEFAULT_MAX_MEDIA_BYTES, Media, Reader
from ._replay import decode_base, decode_batch, encode_batch, lost, replay
from ._snapshot_policy import SnapshotPolicy

__all__ = ["LogCore", "Prepared"]

P = TypeVar("P")


class Prepared(msgspec.Struct, frozen=True):
    """A batch ready to append: encoded once, and decoded back.

    Attributes:
        stored: the record the backend writes.
        batch: the batch as a later load decodes it.
        replaces: it holds a ``ReplaceConversation`` (a snapshot follows).
        blobs: the media bytes the record refers to, by digest.
    """

    stored: StoredBatch
    batch: Batch[Effect]
    replaces: bool
    blobs: Mapping[str, bytes] = msgspec.field(default_factory=dict)


class LogCore(Generic[P]):
    """The cache, replay, compare-and-set, snapshot policy and errors of a durable store.

    Args:
        codec: the store's codec.
        policy: when a snapshot is written.
        form: the record form of the backend's batches.
        cache_size: how many sessions to keep (least recently used dropped
            first); None keeps every session read.
        max_media_bytes: the bytes one media part may hold.
    """

    def __init__(
        self,
        codec: Codec[Any],
        policy: SnapshotPolicy,
        form: type[BatchRecord] | type[EffectRows],
        *,
        cache_size: int | None = None,
        max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES,
    ) -> None:
        self.codec = codec
        self.media = Media(max_media_bytes)
        self.policy = policy
        self._form = form
        self._cache_size = cache_size
        self._cache: OrderedDict[str, Cached[P]] = OrderedDict()

    # -- the cache ---------------------------------------------------------------------

    def cached(self, session_id: str) -> Cached[P] | None:
        """The session's cache entry, if any (what this store last read or wrote)."""
        return self._cache.get(session_id)

    def remember(self, session_id: str, cached: Cached[P]) -> None:
        """Keep ``cached`` as the session's cache entry (after its transaction committed)."""
        self._cache[session_id] = cached
        self._cache.move_to_end(session_id)
        if self._cache_size is not None:
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def forget(self, session_id: str) -> None:
        """Drop the session's cache entry, if any."""
        self._cache.pop(session_id, None)

    def clear(self) -> None:
        """Drop every cache entry."""
        self._cache.clear()

    # -- before the transaction ----------------------------------------------------------

    def new_session(
        self, session_id: str, data: msgspec.Struct | None, conversation: Sequence[Message]
    ) -> tuple[Session[Any], bytes, dict[str, bytes]]:
        """A revision-0 session as a load will read it, its codec record, and the
        media bytes the record refers to (by digest).

        Raises:
            ConfigurationError: ``data`` is not the codec's data type.
            MediaTooLargeError: a media part is over ``max_media_bytes``.
        """
        session = self.codec.new_session(session_id, data, conversation)
        record, blobs = self.session_record(session, limit=True)
        stored = self.codec.decode_session(record, where=f"new session {session_id!r}")
        if blobs:
            where = f"new session {session_id!r}"
            stored = Reader(self.media, blobs.get, "its own media").session(stored, where)
        return stored, record, blobs

    def session_record(
        self, session: Session[Any], *, limit: bool = False
    ) -> tuple[bytes, dict[str, bytes]]:
        """The codec's record of ``session``, its media bytes replaced by references,
        and those bytes by digest (for the backend's ``put_blobs``, before the record).

        ``limit``: check the media against ``max_media_bytes`` (a new session);
        a snapshot or a fork restates media the store already took, unchecked.
        """
        out, blobs = self.media.session_out(session, limit=limit)
        return self.codec.encode_session(out), blobs

    def batch_record(self, batch: Batch[Effect]) -> tuple[bytes, dict[str, bytes]]:
        """The codec's batch record of ``batch`` (a :class:`BatchRecord`), its media
        bytes replaced by references, and those bytes by digest."""
        out, blobs = self.media.batch_out(batch)
        return self.codec.encode_batch(out), blobs

    def reader(self, txn: LogTxn[P]) -> Reader:
        """What puts media bytes back into records ``txn`` reads."""
        return Reader(self.media, txn.blob, txn.media_label)

    def prepare(self, batch: Batch[Effect], where: str) -> Prepared:
        """``batch`` encoded once in the backend's form and decoded back (O(batch)).

        Raises:
            ConfigurationError: an effect type is not registered in the codec.
            InvalidFieldError: the timestamp is not a finite number (JSON has
                no infinity or NaN; a store would keep what it cannot give back).
            MediaTooLargeError: a media part is over ``max_media_bytes``.
        """
        timestamp = batch.timestamp
        if (
            isinstance(timestamp, bool)
            or not isinstance(timestamp, int | float)
            or not (math.isfinite(timestamp))
        ):
            raise InvalidFieldError("Batch", "timestamp", "a finite number of seconds", timestamp)
        stored, decoded, blobs = encode_batch(self.codec, batch, self._form, where, self.media)
        replaces = any(isinstance(effect, ReplaceConversation) for effect in decoded.effects)
        return Prepared(stored, decoded, replaces, blobs)

    # -- inside the transaction ----------------------------------------------------------

    def create(
        self,
        txn: LogTxn[P],
        session_id: str,
        session: Session[Any],
        record: bytes,
        blobs: Mapping[str, bytes],
    ) -> Cached[P]:
        """Store a new log for ``session`` (revision 0), after the media bytes its
        ``record`` refers to; the cache entry to remember.

        Raises:
            SessionExistsError: the id is taken.
        """
        txn.put_blobs(blobs)
        position, marks = txn.create(session_id, record)
        return Cached(session, position, marks)

    def current(self, txn: LogTxn[P], session_id: str) -> Cached[P]:
        """The session at the end of its log, from the cache plus what was appended
        since (or a cold replay); cached.

        Raises:
            SessionNotFoundError: no such session.
            StoredDataError: a record is damaged, or the log no longer reaches a
                revision a snapshot or this cache saw; nothing is cached then.
        """
        cached = self._cache.get(session_id)
        claims: list[tuple[int, str, str]] = []
        try:
            if cached is not None:
                found = txn.tail(session_id, cached)
                if isinstance(found, Tail):
                    session = cached.session
                    if found.records:  # else nothing to read: no reader made
                        session = replay(self.codec, session, found.records, self.reader(txn))
                    fresh = Cached(session, found.position, found.marks)
                    self.remember(session_id, fresh)
                    return fresh
                if found.rewritten:
                    claims.append((cached.session.revision, "this store's cache", found.remedy))
            session, tail = self._replay_from_base(txn, session_id, None, claims)
        except SessionNotFoundError:
            self.forget(session_id)
            raise
        fresh = Cached(session, tail.position, tail.marks)
        self.remember(session_id, fresh)
        return fresh

    def apply(self, txn: LogTxn[P], prepared: Prepared) -> Cached[P]:
        """Append the prepared batch if the session is one revision behind it.

        Applies the batch once to the cached session (read first only when this
        store has not seen the session at ``revision - 1``) and has the backend
        append it with its compare-and-set; when that reports the log moved on,
        the session is read again and the check and the write repeated once.
        Returns the entry to remember once the transaction has committed.

        Raises:
            ConflictError: the session is at another revision; nothing is written.
            SessionNotFoundError: no such session.
            EffectError: an effect does not apply; nothing is written.
            StoredDataError: the stored log is damaged; nothing is written.
        """
        batch = prepared.batch
        session_id = batch.session_id
        expected = batch.revision - 1
        cached = self._cache.get(session_id)
        if cached is None or cached.session.revision != expected:
            cached = self._at(txn, session_id, expected)
        written = self._write(txn, cached, prepared)
        if written is None:
            cached = self._at(txn, session_id, expected)
            written = self._write(txn, cached, prepared)
            if written is None:
                raise StoredDataError(
                    f"the compare-and-set on session {session_id!r} failed on the log end it "
                    "had just read in the same transaction"
                )
        return written

    def session_at(self, txn: LogTxn[P], session_id: str, revision: int) -> Session[Any]:
        """The session as it was at ``revision``: the nearest base, then its log.

        Raises:
            ValueError: ``revision`` is negative or beyond the current one.
            SessionNotFoundError, StoredDataError: as :meth:`current`.
        """
        head, current = self._head(txn, session_id)
        _check_range(session_id, revision, head)
        if current is not None and revision == head:
            return current.session
        return self._replay_from_base(txn, session_id, revision, [])[0]

    def batches(self, txn: LogTxn[P], session_id: str, after: int) -> list[Batch[Effect]]:
        """The audit log: the batches with ``revision > after``, decoded, in order."""
        head, _ = self._head(txn, session_id)
        if after >= head:
            return []
        tail = txn.records(session_id, max(after, 0), head, None)
        reader = self.reader(txn)
        return [decode_batch(self.codec, session_id, stored, reader) for stored in tail.records]

    def history(
        self, txn: LogTxn[P], session_id: str, revision: int
    ) -> tuple[Session[Any], list[Batch[Effect]], Session[Any]]:
        """The revision-0 session, the batches up to ``revision`` and the session there
        (what a fork copies).

        Raises:
            ValueError: ``revision`` is negative or beyond the current one.
        """
        head, _ = self._head(txn, session_id)
        _check_range(session_id, revision, head)
        first, tail = self._replay_from_base(txn, session_id, 0, [])
        records = txn.records(session_id, 0, revision, tail.position).records
        reader = self.reader(txn)
        batches = [decode_batch(self.codec, session_id, stored, reader) for stored in records]
        return first, batches, replay(self.codec, first, records, reader)

    # -- the pieces ------------------------------------------------------------------

    def _head(self, txn: LogTxn[P], session_id: str) -> tuple[int, Cached[P] | None]:
        """The current revision: from the backend when it knows it without reading the
        log, else from :meth:`current` (which it returns too)."""
        known = txn.head(session_id)
        if known is not None:
            return known, None
        current = self.current(txn, session_id)
        return current.session.revision, current

    def _at(self, txn: LogTxn[P], session_id: str, expected: int) -> Cached[P]:
        """:meth:`current`, checked to be at ``expected`` (the compare-and-set)."""
        current = self.current(txn, session_id)
        if current.session.revision != expected:
            raise ConflictError(session_id, expected, current.session.revision)
        return current

    def _write(self, txn: LogTxn[P], cached: Cached[P], prepared: Prepared) -> Cached[P] | None:
        """Apply the batch to ``cached`` once and append it; None if the log moved on."""
        after = apply_batch(cached.session, prepared.batch.effects)
        marks = cached.marks
        size = prepared.stored.size
        snapshot = None
        blobs = prepared.blobs
        if self.policy.due(marks, after.revision, size, prepared.replaces):
            record, held = self.session_record(after)
            snapshot = NewSnapshot(after.revision, record)
            marks = Marks(after.revision, len(record), 0)
            blobs = {**held, **blobs} if held else blobs
        else:
            marks = Marks(marks.snapshot_revision, marks.snapshot_bytes, marks.pending_bytes + size)
        txn.put_blobs(blobs)
        position = txn.append(after.id, cached.position, prepared.stored, marks, snapshot)
        return None if position is None else Cached(after, position, marks)

    def _replay_from_base(
        self,
        txn: LogTxn[P],
        session_id: str,
        upto: int | None,
        claims: list[tuple[int, str, str]],
    ) -> tuple[Session[Any], Tail[P]]:
        """Replay from the best base that decodes to ``upto`` (None: the end).

        A base that is not used is reported to the backend, after the replay
        proved that the log reaches its revision; when the replay goes to the
        end and does not reach a revision a base or ``claims`` (the cache) saw,
        acknowledged batches were lost: StoredDataError, nothing reported.
        """
        unused: list[tuple[Base[P], str]] = []
        failure: StoredDataError | None = None
        reader = self.reader(txn)  # one per replay: a blob is read once
        start: tuple[Base[P], Session[Any]] | None = None
        for base in txn.bases(session_id, upto):
            problem = base.problem
            if problem is None:
                try:
                    start = base, decode_base(self.codec, session_id, base, reader)
                    break
                except StoredDataError as exc:
                    failure, problem = exc, str(exc)
            unused.append((base, problem))
        if start is None:
            raise failure or StoredDataError(
                f"stored data is data: session {session_id!r} has no usable "
                f"start: {'; '.join(problem for _, problem in unused)}"
            )
        base, session = start
        tail = txn.records(session_id, base.revision, upto, base.position)
        session = replay(self.codec, session, tail.records, reader)
        if upto is None:
            seen = [*[(b.revision, b.holder, b.remedy) for b, _ in unused if b.holder], *claims]
            for claimed, holder, remedy in seen:
                if claimed > session.revision:
                    raise StoredDataError(
                        lost(session_id, holder, claimed, session.revision, tail.end, remedy)
                    )
        for unused_base, problem in unused:
            txn.unusable(session_id, unused_base, problem)
        return session, tail


def _check_range(session_id: str, revision: int, head: int) -> None:
    """Raise ValueError unless ``0 <= revision <= head``."""
    if not 0 <= revision <= head:
        raise ValueError(f"session {session_id!r} has revisions 0..{head}, not {revision}")
