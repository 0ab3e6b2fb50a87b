"""``MemoryStore``: sessions and their effect logs, in this process's memory.

Behaves like the durable stores, short of surviving the process: batches are
kept encoded by the codec and the current session is rebuilt from the decoded
batch, so an effect that does not round-trip through the codec fails here too.
Encoding, decoding and replaying are the durable stores' (:mod:`._replay`):
each batch is encoded once, decoded back and applied once.
Media bytes are kept as the durable stores keep them: once per digest, apart
from the records (:mod:`._media_blobs`), with the same size limit.
Every method has one await before it reads or writes and none after: a
cancellation point (so cancellation never leaves a half-applied batch), and a
scheduling point at least every millisecond
(:func:`stepmachine._async.light_checkpoint`: a task that only calls the store
still lets the others run, without a pass of the event loop on every call).
Operations from concurrent tasks never interleave.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

from stepmachine import (
    Codec,
    ConflictError,
    Effect,
    LeaseLostError,
    Message,
    Session,
    SessionExistsError,
    SessionNotFoundError,
    StoreClosedError,
)
from stepmachine._async import light_checkpoint as _checkpoint
from stepmachine._lease import check_claim, mark_now
from stepmachine.extend import Batch, Lease, LeaseHolder, apply_batch

from ._backend import BatchRecord, StoredBatch
from ._ids import validate_session_id
from ._listing import ListedSession
from ._media_blobs import DEFAULT_MAX_MEDIA_BYTES, Media, Reader, named_digests, unreferenced
from ._memory_leases import MemoryLeases
from ._replay import decode_batch, encode_batch, replay

__all__ = ["MemoryStore"]


@dataclass(slots=True)
class _Entry:
    initial: bytes
    current: Session[Any]
    batches: list[StoredBatch] = field(default_factory=list)


def _records(entry: _Entry) -> Iterator[bytes | None]:
    """The stored records of one session: its initial record and its batches'
    (None for a batch stored otherwise: it keeps every blob)."""
    yield entry.initial
    for stored in entry.batches:
        yield stored.record if isinstance(stored, BatchRecord) else None


class MemoryStore:
    """An in-memory store. Not shared between processes; lost when the process ends.

    Args:
        codec: the application's codec (kernel effects and ``NoData`` by default).
        expiring_leases: leases lapse unless renewed (see ``leases_expire``).
        max_media_bytes: the bytes one image, document or audio part may hold
            (20 MiB by default); a larger one raises
            :class:`~stepmachine.MediaTooLargeError` and nothing is kept.
    """

    applies_batches: ClassVar[bool] = True
    """``apply`` applies each batch once and returns the session (see ``EffectHandler``)."""

    leases_expire: bool = False
    """Whether leases lapse unless renewed (see ``expiring_leases``); declared on the class."""

    def __init__(
        self,
        codec: Codec[Any] | None = None,
        *,
        expiring_leases: bool = False,
        max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES,
    ) -> None:
        self._codec: Codec[Any] = codec or Codec()
        self._media = Media(max_media_bytes)
        self._blobs: dict[str, bytes] = {}
        """The media bytes the records refer to, by digest (dropped by ``delete``
        once no record names them)."""
        self._sessions: dict[str, _Entry] = {}
        self._leases = MemoryLeases(expire=expiring_leases)
        self._closed = False
        self.leases_expire = expiring_leases
        """Whether leases lapse ``ttl`` seconds after the last claim or renewal.

        False by default: in one process a lease is held until it is released (a
        run releases it, shielded, however it ends), like the lock-file stores'
        leases, and a run needs no renewal task. ``expiring_leases=True`` makes
        them lapse on the monotonic clock, as PostgreSQL's do: for tests of
        takeover and fencing.
        """

    @property
    def codec(self) -> Codec[Any]:
        """The codec the store encodes with."""
        return self._codec

    def _entry(self, session_id: str) -> _Entry:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise SessionNotFoundError(session_id) from None

    async def create(
        self,
        session_id: str,
        data: msgspec.Struct | None = None,
        conversation: Sequence[Message] = (),
    ) -> Session[Any]:
        """Create a revision-0 session. Raises ``SessionExistsError`` if the id is taken."""
        await _checkpoint()
        validate_session_id(session_id)
        if session_id in self._sessions:
            raise SessionExistsError(session_id)
        session = self._codec.new_session(session_id, data, conversation)
        out, blobs = self._media.session_out(session)
        encoded = self._codec.encode_session(out)
        self._blobs.update(blobs)
        current = self._initial(session_id, encoded)
        self._sessions[session_id] = _Entry(initial=encoded, current=current)
        return self._sessions[session_id].current

    async def load(self, session_id: str) -> Session[Any]:
        """The current session. Raises ``SessionNotFoundError``."""
        await _checkpoint()
        return self._entry(session_id).current

    async def apply(self, batch: Batch[Effect], *, lease: Lease | None = None) -> Session[Any]:
        """Append ``batch`` if the session is at ``batch.revision - 1``; all or nothing.

        Returns the session after the batch, rebuilt from the stored copy. With
        ``lease``, only while it is the session's current, unexpired lease.

        Raises:
            LeaseLostError: ``lease`` is not current; nothing was written.
            ConflictError: the session is at another revision.
            SessionNotFoundError: no such session.
            EffectError: an effect does not apply.
            ConfigurationError: an effect type is not registered in the codec.
        """
        await _checkpoint()
        entry = self._entry(batch.session_id)
        if lease is not None:
            self._leases.check(_for(lease, batch.session_id))
        if entry.current.revision != batch.revision - 1:
            raise ConflictError(batch.session_id, batch.revision - 1, entry.current.revision)
        where = f"session {batch.session_id!r} revision {batch.revision}"
        stored, decoded, blobs = encode_batch(self._codec, batch, BatchRecord, where, self._media)
        after = apply_batch(entry.current, decoded.effects)
        self._blobs.update(blobs)
        entry.batches.append(stored)
        entry.current = after
        return after

    async def list_sessions(self) -> list[str]:
        """The ids of all sessions, sorted."""
        await _checkpoint()
        return sorted(self._sessions)

    async def scan_sessions(self) -> list[ListedSession]:
        """Every session, sorted by id, as :class:`ListedSession` entries (none is
        unreadable: a memory store holds decoded values)."""
        return [ListedSession(session_id) for session_id in await self.list_sessions()]

    async def delete(self, session_id: str) -> None:
        """Delete a session and its log, and the media bytes no other session's
        records name. Raises ``SessionNotFoundError``."""
        await _checkpoint()
        gone = self._entry(session_id)
        del self._sessions[session_id]
        self._leases.forget(session_id)
        if self._blobs and named_digests(_records(gone)):
            records = (record for entry in self._sessions.values() for record in _records(entry))
            for digest in unreferenced(set(self._blobs), records):
                del self._blobs[digest]

    async def load_at(self, session_id: str, revision: int) -> Session[Any]:
        """The session as it was at ``revision``, rebuilt from the stored log.

        Raises:
            SessionNotFoundError: no such session.
            ValueError: ``revision`` is negative or beyond the current one.
        """
        await _checkpoint()
        entry = self._entry(session_id)
        if not 0 <= revision <= entry.current.revision:
            raise ValueError(
                f"session {session_id!r} has revisions 0..{entry.current.revision}, not {revision}"
            )
        session = self._initial(session_id, entry.initial)
        return replay(self._codec, session, entry.batches[:revision], self._reader())

    async def batches(self, session_id: str, after: int = 0) -> list[Batch[Effect]]:
        """The audit log: every batch with ``revision > after``, in order."""
        await _checkpoint()
        entry = self._entry(session_id)
        after = max(after, 0)
        reader = self._reader()
        return [decode_batch(self._codec, session_id, s, reader) for s in entry.batches[after:]]

    def _reader(self) -> Reader:
        return Reader(self._media, self._blobs.get, "this MemoryStore's media")

    def _initial(self, session_id: str, record: bytes) -> Session[Any]:
        """The revision-0 session ``record`` holds, its media bytes put back."""
        where = f"session {session_id!r}"
        session = self._codec.decode_session(record, where=where)
        return self._reader().session(session, where)

    # -- leases (see stepmachine.Leases) --------------------------------------------

    async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | LeaseHolder:
        """Claim the session's lease for ``owner``, or say who holds it (``Leases.claim``)."""
        await _checkpoint()
        return self._claim_now(session_id, owner, ttl)

    def _claim_now(self, session_id: str, owner: str, ttl: float) -> Lease | LeaseHolder:
        self._refuse_if_closed()
        check_claim(owner, ttl)
        self._entry(session_id)
        return self._leases.claim(session_id, owner, ttl)

    async def claim_next(self, owner: str, ttl: float) -> Lease | None:
        """Claim a session with a pending run and no live lease (``Leases.claim_next``)."""
        await _checkpoint()
        self._refuse_if_closed()
        check_claim(owner, ttl)
        return self._leases.claim_next(sorted(self._sessions), owner, ttl)

    async def request_run(self, session_id: str) -> None:
        """Mark the session as having a pending run (``Leases.request_run``)."""
        await _checkpoint()
        self._refuse_if_closed()
        self._entry(session_id)
        self._leases.request_run(session_id)

    async def renew(self, lease: Lease) -> Lease:
        """Extend ``lease`` by its ttl; ``LeaseLostError`` when it is not current."""
        await _checkpoint()
        return self._renew_now(lease)

    def _renew_now(self, lease: Lease) -> Lease:
        self._refuse_if_closed()
        self._entry(lease.session_id)
        check_claim(lease.owner, lease.ttl)
        return self._leases.renew(lease)

    async def release(self, lease: Lease, *, unless_requested: bool = False) -> bool:
        """Let go of ``lease`` (``Leases.release``)."""
        await _checkpoint()
        return self._release_now(lease, unless_requested=unless_requested)

    def _release_now(self, lease: Lease, *, unless_requested: bool = False) -> bool:
        self._refuse_if_closed()
        return self._leases.release(lease, unless_requested=unless_requested)

    async def aclose(self) -> None:
        """Release every lease; lease calls raise ``StoreClosedError`` afterwards.

        The sessions stay readable and writable (nothing else is held).
        """
        self._closed = True
        self._leases = MemoryLeases(expire=self.leases_expire)

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise StoreClosedError("this MemoryStore was closed: its leases were released")


# A run's lease calls on this store take no time to complete: the kernel calls these
# synchronous forms directly (no checkpoint, no shielded scope; see ``_hold.now``), as
# long as the async method is this class's own (a subclass or a test that replaces
# ``claim``, ``renew`` or ``release`` is called as it is).
mark_now(MemoryStore.claim, "_claim_now")
mark_now(MemoryStore.renew, "_renew_now")
mark_now(MemoryStore.release, "_release_now")


def _for(lease: Lease, session_id: str) -> Lease:
    """``lease``, when it is a lease of ``session_id``; a lease of another session is lost."""
    if lease.session_id != session_id:
        raise LeaseLostError(
            session_id, lease.owner, lease.epoch, f"it is a lease of {lease.session_id!r}"
        )
    return lease
