"""The lease table of :class:`~stepmachine.stores.MemoryStore`: one process, expiry optional.

Each session has at most one :class:`_Slot`: the current lease (owner, epoch,
expiry on the monotonic clock) and the pending-run mark. The epoch of a
session only grows (a released slot keeps it). Every method is synchronous
and called by the store between two of its own checkpoints, so operations
from concurrent tasks never interleave.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from stepmachine import LeaseLostError
from stepmachine.extend import Lease, LeaseHolder

__all__ = ["MemoryLeases"]


@dataclass(slots=True)
class _Slot:
    epoch: int = 0
    owner: str | None = None
    expires_at: float = 0.0
    requested: bool = False
    since: int = 0  # when the mark was set (a counter): claim_next serves the oldest first


class MemoryLeases:
    """Leases of sessions in this process (see :class:`~stepmachine.Leases`)."""

    def __init__(self, *, expire: bool, clock: Callable[[], float] = time.monotonic) -> None:
        self._expire = expire
        self._clock = clock
        self._slots: dict[str, _Slot] = {}
        self._requests = 0

    def _live(self, slot: _Slot) -> bool:
        if slot.owner is None:
            return False
        return not self._expire or slot.expires_at > self._clock()

    def claim(self, session_id: str, owner: str, ttl: float) -> Lease | LeaseHolder:
        slot = self._slots.setdefault(session_id, _Slot())
        if self._live(slot):
            assert slot.owner is not None
            left = max(0.0, slot.expires_at - self._clock()) if self._expire else None
            return LeaseHolder(slot.owner, left, slot.epoch)
        slot.epoch += 1
        slot.owner = owner
        slot.expires_at = self._clock() + ttl
        slot.requested = False
        return Lease(session_id, owner, slot.epoch, ttl)

    def claim_next(self, candidates: Iterable[str], owner: str, ttl: float) -> Lease | None:
        waiting = []
        for session_id in candidates:
            slot = self._slots.get(session_id)
            if slot is not None and _pending(slot) and not self._live(slot):
                waiting.append((slot.since, session_id))
        if not waiting:
            return None
        claimed = self.claim(min(waiting)[1], owner, ttl)
        assert isinstance(claimed, Lease)
        return claimed

    def request_run(self, session_id: str) -> None:
        slot = self._slots.setdefault(session_id, _Slot())
        if not slot.requested:
            self._requests += 1
            slot.requested = True
            slot.since = self._requests

    def check(self, lease: Lease) -> None:
        """Raise :class:`LeaseLostError` unless ``lease`` is current and live."""
        slot = self._slots.get(lease.session_id)
        if slot is None or slot.owner != lease.owner or slot.epoch != lease.epoch:
            raise LeaseLostError(lease.session_id, lease.owner, lease.epoch, "taken or released")
        if not self._live(slot):
            raise LeaseLostError(lease.session_id, lease.owner, lease.epoch, "expired")

    def renew(self, lease: Lease) -> Lease:
        self.check(lease)
        self._slots[lease.session_id].expires_at = self._clock() + lease.ttl
        return lease

    def release(self, lease: Lease, *, unless_requested: bool) -> bool:
        slot = self._slots.get(lease.session_id)
        if slot is None or slot.owner != lease.owner or slot.epoch != lease.epoch:
            return True
        if unless_requested and slot.requested and self._live(slot):
            slot.requested = False
            return False
        slot.owner = None
        slot.expires_at = 0.0
        return True

    def forget(self, session_id: str) -> None:
        """The session was deleted: its slot goes (a new session of that id starts over)."""
        self._slots.pop(session_id, None)


def _pending(slot: _Slot) -> bool:
    """A run was requested, or a holder never let go (its run was cut short)."""
    return slot.requested or slot.owner is not None
