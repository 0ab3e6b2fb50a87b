"""When the durable stores write a snapshot, part of their shared core (:mod:`._core`).

A snapshot is the session at some revision, so that a load replays the log
from there instead of from revision 0. Writing one costs encoding the whole
session; not writing one makes cold loads replay more. Every policy writes
one after a batch holding a :class:`~stepmachine.ReplaceConversation` (what
came before no longer matters to the current session). Which snapshots a
backend keeps is fixed, whatever the policy: revision 0 (the session as
created, which rebuilds any earlier revision) and the newest (which bounds
what a load replays); each snapshot written prunes the one it supersedes, so
the bytes on disk grow with the log, not with the number of snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ._backend import Marks

__all__ = ["EveryN", "SnapshotPolicy", "Weighted"]


class SnapshotPolicy(Protocol):
    """Decides whether the batch producing ``revision`` ends with a snapshot."""

    def due(self, marks: Marks, revision: int, batch_bytes: int, replaces: bool) -> bool:
        """``marks``: the bookkeeping before the batch; ``batch_bytes``: its encoded
        effects; ``replaces``: it holds a ``ReplaceConversation``."""
        ...


@dataclass(frozen=True, slots=True)
class EveryN:
    """A snapshot at every revision that is a multiple of ``n``, and after a
    ``ReplaceConversation``: a cold load replays fewer than ``n`` batches.

    (:class:`~stepmachine.stores.FileStore`'s ``snapshot_every``.)
    """

    n: int

    def due(self, marks: Marks, revision: int, batch_bytes: int, replaces: bool) -> bool:
        """See :class:`SnapshotPolicy`."""
        return replaces or revision % self.n == 0


@dataclass(frozen=True, slots=True)
class Weighted:
    """A snapshot once writing it costs about what the effects since the last one did.

    Always after a ReplaceConversation. Otherwise only ``every`` or more
    revisions after the last snapshot, and then once the effect bytes since
    it reach half its size, or ``max_gap`` revisions have passed. Snapshots
    then take at most about twice the room of the effects they follow, and
    cost each apply, on average, twice its own encoding; rebuilding the
    current revision (or any after the newest snapshot) replays at most
    ``max_gap`` batches. Sizes are of the encoded session, before compression:
    the policy bounds the cost of writing snapshots, whatever they compress to.

    (:class:`~stepmachine.stores.SQLiteStore`'s policy.)
    """

    every: int
    max_gap: int

    def due(self, marks: Marks, revision: int, batch_bytes: int, replaces: bool) -> bool:
        """See :class:`SnapshotPolicy`."""
        if replaces:
            return True
        gap = revision - marks.snapshot_revision
        pending = marks.pending_bytes + batch_bytes
        heavy = 2 * pending >= marks.snapshot_bytes or gap >= self.max_gap
        return gap >= self.every and heavy
