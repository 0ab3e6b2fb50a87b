"""The byte-backend protocol of the durable stores: what a backend moves, and nothing more.

The durable stores (:class:`~stepmachine.stores.FileStore`,
:class:`~stepmachine.stores.SQLiteStore`, and PostgreSQL next) share one core,
:class:`._core.LogCore`: the cache of the last session per id, the snapshot
policy, replay, the compare-and-set check and the errors that name a session
and a position. A backend only moves bytes: it stores each session as a log
(a revision-0 session record, then one record per applied batch) plus
snapshots (a session record at some revision), and answers the core's few
questions about them, inside one transaction (SQLite, PostgreSQL) or one lock
hold (files). It never decodes a record with the codec and never applies an
effect; it checks its own framing (checksums, schema versions, missing rows)
and raises :class:`~stepmachine.StoredDataError` naming the file or table and
the position when that fails, and it never rewrites what it read.

The protocol (:class:`LogTxn`), each method synchronous, run by the core in the
backend's worker thread inside the backend's transaction:

- ``head(session_id) -> int | None``: the current revision, if known without
  reading the log (SQLite: the session row; files: None).
- ``tail(session_id, cached) -> Tail | Moved``: the records after the cached
  position, or :class:`Moved` when the position is not in this log any more.
- ``bases(session_id, upto) -> Iterator[Base]``: where a replay may start, at or
  before ``upto``, best first (a snapshot, then the revision-0 record).
- ``records(session_id, after, upto, start) -> Tail``: the batches with
  ``after < revision <= upto`` (``upto`` None: to the end of the log).
- ``append(session_id, at, batch, marks, snapshot) -> position | None``: the
  compare-and-set write: append ``batch`` (and the snapshot, if any, pruning the
  ones it supersedes) only if the log still ends at ``at``; None, with nothing
  written, when it does not.
- ``create(session_id, record) -> (position, marks)``, ``delete(session_id)``.
- ``unusable(session_id, base, reason)``: report a base that was not used.
- ``blob(digest) -> bytes | None`` and ``put_blobs(blobs)``: the media bytes
  records refer to, kept once by digest (:mod:`._media_blobs`). ``put_blobs``
  writes those it does not hold yet, durably before any record written after
  it in the same transaction (lock hold) becomes visible; ``media_label``
  names where they are kept, for errors.

The records exchanged are frozen msgspec Structs (cheap to build: several
are made per apply). A *position* (the type parameter ``P``) is the
backend's own token for "the log up to here": the store's cache keeps one
beside each session, and a
backend proves with it that nothing moved (SQLite: the session row's never
reused ``sid`` and its revision; files: the log's nonce, the offset and
digest of the last record read).

Batches travel as one of two record forms, chosen by the backend (the store
passes it to the core; the backends here name it ``FORM``):
:class:`BatchRecord` (one codec batch record: the file log) or
:class:`EffectRows` (step, cycle, timestamp, refusals and trace apart, then one
codec effects record per effect: SQLite, and PostgreSQL).

How PostgreSQL fits (issue 10): psycopg's sync API in an anyio worker thread,
one ``BEGIN ... COMMIT`` per hop, the connection taken from its pool; the txn
object wraps that connection. ``tail`` is one ``SELECT`` of the session row
(revision, sid, snapshot marks) and, when the cached revision is behind, one
``SELECT`` of the effect rows after it; ``append`` is ``UPDATE sessions SET
revision = ... WHERE sid = %s AND revision = %s`` (its row count is the
compare-and-set; with leases, ``AND lease_owner = %s AND lease_epoch = %s``
joins the condition, the txn object holding the runner's lease, so a stale
holder's append writes nothing; it then raises the backend's typed lease error
rather than returning None, which means only "the log moved on") followed by one
``executemany`` of the rows and, when the core asks, the snapshot ``INSERT``
and the ``DELETE`` of the one it supersedes; ``bases`` is the newest snapshot
``<= upto`` (``ORDER BY revision DESC LIMIT 1``). Nothing in the core knows
which database it talks to.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import msgspec

from stepmachine import Session

__all__ = [
    "Base",
    "BatchRecord",
    "Cached",
    "EffectRows",
    "LogTxn",
    "Marks",
    "Moved",
    "NewSnapshot",
    "StoredBatch",
    "Tail",
]

P = TypeVar("P")


class Marks(NamedTuple):
    """What the snapshot policy weighs, kept with a log's head.

    Attributes:
        snapshot_revision: the revision of the newest snapshot.
        snapshot_bytes: its encoded size (before compression).
        pending_bytes: the encoded effect bytes written since it.
    """

    snapshot_revision: int = 0
    snapshot_bytes: int = 0
    pending_bytes: int = 0


class BatchRecord(msgspec.Struct, frozen=True):
    """A stored batch as one codec batch record (``Codec.encode_batch``).

    Attributes:
        revision: the revision the batch produced, as the backend's framing says.
        where: how an error names its position (``"<file> at byte 123"``).
        record: the codec's batch record.
    """

    revision: int
    where: str
    record: bytes

    @property
    def size(self) -> int:
        """The encoded bytes of the batch."""
        return len(self.record)


class EffectRows(msgspec.Struct, frozen=True):
    """A stored batch as a header and one codec effects record per effect.

    Attributes:
        revision: the revision the batch produced.
        where: how an error names its position (``"<db>: session 's' revision 3"``);
            an effect is named ``f"{where} effect {index}"``.
        step, cycle, timestamp: the batch's header.
        effects: one codec effects record (``Codec.encode_effects``) per effect,
            each holding exactly one effect.
        refused: the batch's ``refused`` as compact JSON text
            (``[["step","why"],...]``), None when it is empty; decoded by the
            core (:func:`._replay.decode_batch`), never by the backend.
        trace: the batch's ``trace`` (a W3C ``traceparent``), or None.
    """

    revision: int
    where: str
    step: str
    cycle: int
    timestamp: float
    effects: tuple[bytes, ...]
    refused: str | None = None
    trace: str | None = None

    @property
    def size(self) -> int:
        """The encoded bytes of the batch's effects."""
        return sum(map(len, self.effects))


StoredBatch = BatchRecord | EffectRows
"""A stored batch in either record form."""


class Cached(msgspec.Struct, Generic[P], frozen=True):
    """The store's cache entry: ``session`` is the log up to ``position``.

    Attributes:
        session: the session at the log's end when it was read or written.
        position: the backend's token for that end of the log.
        marks: the snapshot bookkeeping at that point.
    """

    session: Session[Any]
    position: P
    marks: Marks


class Base(msgspec.Struct, Generic[P], frozen=True):
    """Where a replay may start: the codec's session ``record`` at ``revision``.

    Attributes:
        revision: the revision it holds (by the backend's framing).
        record: the codec's session record (decompressed).
        where: how an error names it.
        position: the log position just past ``revision``.
        problem: why the backend will not have it used (it does not fit this
            log), or None. A base with a problem is never decoded; either way,
            a base that is not used still proves that the log once reached
            ``revision`` (see ``holder``).
        holder: how the lost-data error names it (``"the snapshot /x/s.snap"``);
            empty for the revision-0 record, which proves nothing.
        remedy: what accepts such a loss (``"delete /x/s.snap and ..."``).
    """

    revision: int
    record: bytes
    where: str
    position: P
    problem: str | None = None
    holder: str = ""
    remedy: str = ""


class Tail(msgspec.Struct, Generic[P], frozen=True):
    """Records read from a log, and where they end.

    Attributes:
        records: the batches, in revision order.
        position: the log position just past the last of them (or the start,
            when there are none).
        marks: the snapshot bookkeeping stored with the log's head.
        end: how an error names the log (``"/x/s.log"``).
    """

    records: Sequence[StoredBatch]
    position: P
    marks: Marks
    end: str


class Moved(msgspec.Struct, frozen=True):
    """``tail``: the cached position is not in this log.

    Attributes:
        rewritten: the same log (not a deleted and re-created session) was cut
            back and rewritten, so the revisions the cache holds must still be
            reached, or acknowledged batches were lost.
        remedy: what accepts such a loss (``"open a new FileStore"``).
    """

    rewritten: bool
    remedy: str = ""


class NewSnapshot(msgspec.Struct, frozen=True):
    """A snapshot to write with a batch: the codec's session record at ``revision``."""

    revision: int
    record: bytes


class LogTxn(Protocol[P]):
    """One transaction (or lock hold) of a byte backend; see the module docstring.

    Every method is synchronous and runs in the backend's worker thread.
    ``SessionNotFoundError`` is raised by any method given an id the backend
    does not hold; ``StoredDataError`` by any that finds its framing damaged.
    """

    def head(self, session_id: str) -> int | None:
        """The session's current revision when the backend knows it without reading
        its log (a session row), else None: the core then reads the tail."""
        ...

    def tail(self, session_id: str, cached: Cached[P]) -> Tail[P] | Moved:
        """The records after ``cached.position``, up to the end of the log; or
        :class:`Moved` when that position is not in this log (a re-created
        session, a log cut back)."""
        ...

    def bases(self, session_id: str, upto: int | None) -> Iterator[Base[P]]:
        """The places a replay to ``upto`` (None: the end) may start from, best
        first; the last one needs no other (the revision-0 record)."""
        ...

    def records(self, session_id: str, after: int, upto: int | None, start: P | None) -> Tail[P]:
        """The batches with ``after < revision <= upto`` (``upto`` None: to the
        end). ``start``, when given, is the position of revision ``after``."""
        ...

    def append(
        self,
        session_id: str,
        at: P,
        batch: StoredBatch,
        marks: Marks,
        snapshot: NewSnapshot | None,
    ) -> P | None:
        """Compare-and-set: write ``batch`` (with ``marks``, and ``snapshot`` when
        given, dropping every snapshot but revision 0's and the new one) if the
        log still ends at ``at``; return the new position. None, with nothing
        written, when the log has moved on (or the session is gone): the core
        then reads the log again and retries once. A refusal that rereading
        cannot cure (a lease fenced off) is an exception of the backend's own."""
        ...

    def create(self, session_id: str, record: bytes) -> tuple[P, Marks]:
        """A new log holding the revision-0 session ``record``.

        Raises ``SessionExistsError`` if the id is taken.
        """
        ...

    def delete(self, session_id: str) -> None:
        """Delete the session's log and snapshots."""
        ...

    def unusable(self, session_id: str, base: Base[P], reason: str) -> None:
        """Report that ``base`` was not used, and why (the log was replayed instead)."""
        ...

    @property
    def media_label(self) -> str:
        """Where the media blobs are kept, as an error names it (``"/x/.media"``)."""
        ...

    def blob(self, digest: str) -> bytes | None:
        """The media bytes stored under ``digest`` (a checked ``sha256:<hex>``), or None.

        Not checked against the digest here: the core does that.
        """
        ...

    def put_blobs(self, blobs: Mapping[str, bytes]) -> None:
        """Store each of ``blobs`` (digest to bytes) that is not stored yet, so that
        it is durable no later than any record this transaction writes after it."""
        ...
