"""The lease conformance suite: a store with leases (:class:`~stepmachine.Leases`) runs it.

::

    from stepmachine.testing.leases import LeaseConformance

    class TestMyStoreLeases(LeaseConformance):
        def make_store(self, codec, path):
            return MyStore(codec=codec, folder=path)

Like :class:`~stepmachine.testing.conformance.StoreConformance`, ``make_store``
gets a codec and an empty folder and returns a fresh store (or an awaitable of
one). What is checked, each in one process (a store's own tests add several
processes): one holder at a time, epochs that grow, fencing (a write with a
released or superseded lease is refused and writes nothing; an unleased write
is not fenced), renewal, release of a stale lease, a refused claim naming the
holder's owner and epoch (how a runner whose claim was cut short finds and
releases its own lease), the pending-run mark (``request_run``,
``release(unless_requested=True)``, ``claim_next``), claims racing each other,
and, for stores whose leases expire, takeover after expiry.

This module imports pytest; import it from tests only.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import anyio
import pytest

from stepmachine import (
    AppendMessage,
    Codec,
    Effect,
    LeaseLostError,
    Message,
    Session,
    SessionNotFoundError,
    Store,
)
from stepmachine.extend import Batch, Lease, LeaseHolder, Leases

__all__ = ["LeaseConformance"]

TTL = 30.0


def _batch(session: Session[Any], text: str) -> Batch[Effect]:
    return Batch(
        session_id=session.id,
        revision=session.revision + 1,
        step="test",
        cycle=session.revision + 1,
        timestamp=1_700_000_000.0 + session.revision,
        effects=(AppendMessage(Message.user(text, id=f"m{session.revision + 1}")),),
    )


class LeaseConformance:
    """Subclass and implement :meth:`make_store`; pytest collects the tests."""

    def make_store(self, codec: Codec[Any], path: Path) -> Store | Awaitable[Store]:
        """Return a fresh, empty store with leases, keeping files under ``path``."""
        raise NotImplementedError

    @pytest.fixture
    async def store(self, tmp_path: Path) -> AsyncIterator[Any]:
        """A fresh store; closed afterwards."""
        made = self.make_store(Codec(), tmp_path)
        store = await made if inspect.isawaitable(made) else made
        assert isinstance(store, Leases), f"{type(store).__name__} has no leases"
        try:
            yield store
        finally:
            await store.aclose()

    async def _claimed(self, store: Any, session_id: str, owner: str, ttl: float = TTL) -> Lease:
        got = await store.claim(session_id, owner, ttl)
        assert isinstance(got, Lease), f"{owner} could not claim {session_id}: {got!r}"
        assert (got.session_id, got.owner, got.ttl) == (session_id, owner, ttl)
        return got

    # -- one holder at a time ------------------------------------------------------

    async def test_second_claim_sees_the_holder(self, store: Any) -> None:
        await store.create("s")
        await self._claimed(store, "s", "a")
        busy = await store.claim("s", "b", TTL)
        assert isinstance(busy, LeaseHolder)
        assert busy.owner == "a"
        if store.leases_expire:
            assert busy.expires_in is not None
            assert 0 < busy.expires_in <= TTL
        again = await store.claim("s", "a", TTL)  # one owner string per run: no re-claim
        assert isinstance(again, LeaseHolder)

    async def test_a_refused_claim_names_the_holders_epoch(self, store: Any) -> None:
        """A runner whose claim was cut short finds its lease by owner and epoch, and
        lets go of it: the caller's guard against a lease taken for nobody."""
        await store.create("s")
        lease = await self._claimed(store, "s", "a")
        for owner in ("a", "b"):
            busy = await store.claim("s", owner, TTL)
            assert isinstance(busy, LeaseHolder)
            assert (busy.owner, busy.epoch) == ("a", lease.epoch)
        assert busy.epoch is not None
        rebuilt = Lease("s", busy.owner, busy.epoch, TTL)
        assert await store.release(rebuilt) is True
        await self._claimed(store, "s", "b")  # that was the lease: the session is free

    async def test_unknown_session(self, store: Any) -> None:
        with pytest.raises(SessionNotFoundError):
            await store.claim("missing", "a", TTL)
        with pytest.raises(SessionNotFoundError):
            await store.request_run("missing")

    @pytest.mark.parametrize(
        ("owner", "ttl"),
        [
            ("", TTL),
            ("a\x00b", TTL),
            ("x" * 1000, TTL),
            (None, TTL),
            ("a", 0),
            ("a", -1.0),
            ("a", float("nan")),
            ("a", float("inf")),
            ("a", True),
        ],
    )
    async def test_bad_claims_are_refused(self, store: Any, owner: Any, ttl: Any) -> None:
        await store.create("s")
        with pytest.raises(ValueError, match="lease"):
            await store.claim("s", owner, ttl)
        with pytest.raises(ValueError, match="lease"):
            await store.claim_next(owner, ttl)
        await self._claimed(store, "s", "a")  # nothing was taken

    async def test_sessions_are_leased_apart(self, store: Any) -> None:
        await store.create("s")
        await store.create("t")
        await self._claimed(store, "s", "a")
        await self._claimed(store, "t", "b")

    async def test_epochs_grow_with_every_claim(self, store: Any) -> None:
        await store.create("s")
        epochs = []
        for owner in ("a", "b", "c"):
            lease = await self._claimed(store, "s", owner)
            epochs.append(lease.epoch)
            assert await store.release(lease) is True
        assert epochs == sorted(set(epochs)), epochs

    async def test_racing_claims_give_one_lease(self, store: Any) -> None:
        await store.create("s")
        results: list[Lease | LeaseHolder] = []

        async def claim(owner: str) -> None:
            results.append(await store.claim("s", owner, TTL))

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(claim, f"o{i}")
        leases = [r for r in results if isinstance(r, Lease)]
        assert len(leases) == 1, results
        assert all(r.owner == leases[0].owner for r in results if isinstance(r, LeaseHolder))

    # -- fencing -------------------------------------------------------------------

    async def test_apply_with_the_current_lease(self, store: Any) -> None:
        session = await store.create("s")
        lease = await self._claimed(store, "s", "a")
        after = await store.apply(_batch(session, "hello"), lease=lease)
        assert after.revision == 1
        assert (await store.load("s")).revision == 1

    async def test_released_lease_cannot_write(self, store: Any) -> None:
        session = await store.create("s")
        lease = await self._claimed(store, "s", "a")
        assert await store.release(lease) is True
        with pytest.raises(LeaseLostError) as caught:
            await store.apply(_batch(session, "late"), lease=lease)
        assert (caught.value.session_id, caught.value.owner) == ("s", "a")
        assert (await store.load("s")).revision == 0
        assert await store.batches("s") == []

    async def test_superseded_lease_cannot_write(self, store: Any) -> None:
        session = await store.create("s")
        old = await self._claimed(store, "s", "a")
        await store.release(old)
        new = await self._claimed(store, "s", "b")
        with pytest.raises(LeaseLostError):
            await store.apply(_batch(session, "stale"), lease=old)
        assert (await store.load("s")).revision == 0
        after = await store.apply(_batch(session, "fresh"), lease=new)
        assert after.revision == 1

    async def test_lease_of_another_session_cannot_write(self, store: Any) -> None:
        session = await store.create("s")
        await store.create("t")
        other = await self._claimed(store, "t", "a")
        await self._claimed(store, "s", "a2")
        with pytest.raises(LeaseLostError):
            await store.apply(_batch(session, "wrong"), lease=other)
        assert (await store.load("s")).revision == 0

    async def test_unleased_writes_are_not_fenced(self, store: Any) -> None:
        session = await store.create("s")
        await self._claimed(store, "s", "a")
        after = await store.apply(_batch(session, "from outside"))
        assert after.revision == 1

    # -- renew and release ---------------------------------------------------------

    async def test_renew_keeps_the_epoch(self, store: Any) -> None:
        await store.create("s")
        lease = await self._claimed(store, "s", "a")
        renewed = await store.renew(lease)
        assert renewed == lease

    async def test_renew_a_released_lease_is_lost(self, store: Any) -> None:
        await store.create("s")
        lease = await self._claimed(store, "s", "a")
        await store.release(lease)
        with pytest.raises(LeaseLostError):
            await store.renew(lease)

    async def test_releasing_a_stale_lease_leaves_the_holder(self, store: Any) -> None:
        await store.create("s")
        old = await self._claimed(store, "s", "a")
        await store.release(old)
        await self._claimed(store, "s", "b")
        assert await store.release(old) is True
        busy = await store.claim("s", "c", TTL)
        assert isinstance(busy, LeaseHolder)
        assert busy.owner == "b"

    # -- the pending-run mark ------------------------------------------------------

    async def test_requested_run_keeps_the_holder(self, store: Any) -> None:
        await store.create("s")
        lease = await self._claimed(store, "s", "a")
        await store.request_run("s")
        assert await store.release(lease, unless_requested=True) is False
        busy = await store.claim("s", "b", TTL)
        assert isinstance(busy, LeaseHolder)
        assert busy.owner == "a"
        await store.apply(_batch(await store.load("s"), "still mine"), lease=lease)
        assert await store.release(lease, unless_requested=True) is True  # mark taken
        await self._claimed(store, "s", "b")

    async def test_plain_release_ignores_the_mark(self, store: Any) -> None:
        await store.create("s")
        lease = await self._claimed(store, "s", "a")
        await store.request_run("s")
        assert await store.release(lease) is True
        assert (await store.claim_next("w", TTL)) is not None  # the mark is still there

    async def test_claim_takes_the_mark(self, store: Any) -> None:
        await store.create("s")
        await store.request_run("s")
        lease = await self._claimed(store, "s", "a")
        assert await store.release(lease, unless_requested=True) is True
        assert await store.claim_next("w", TTL) is None

    async def test_claim_next(self, store: Any) -> None:
        for name in ("s", "t", "u"):
            await store.create(name)
        assert await store.claim_next("w", TTL) is None
        await store.request_run("t")
        await store.request_run("u")
        held = await self._claimed(store, "u", "a")  # claimed: u's mark is taken
        got = await store.claim_next("w", TTL)
        assert isinstance(got, Lease)
        assert (got.session_id, got.owner) == ("t", "w")
        assert await store.claim_next("w2", TTL) is None
        await store.request_run("u")  # held by a: not given to a worker
        assert await store.claim_next("w3", TTL) is None
        assert await store.release(held) is True
        got = await store.claim_next("w4", TTL)
        assert isinstance(got, Lease)
        assert got.session_id == "u"

    async def test_racing_workers_never_share_a_session(self, store: Any) -> None:
        names = [f"s{i}" for i in range(6)]
        for name in names:
            await store.create(name)
            await store.request_run(name)
        got: list[Lease] = []

        async def worker(owner: str) -> None:
            while (lease := await store.claim_next(owner, TTL)) is not None:
                got.append(lease)

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(worker, f"w{i}")
        assert sorted(lease.session_id for lease in got) == names

    # -- expiry (stores whose leases lapse) ------------------------------------------

    async def test_expired_lease_is_taken_over_and_fenced(self, store: Any) -> None:
        if not store.leases_expire:
            pytest.skip(f"{type(store).__name__}'s leases last as long as the process")
        session = await store.create("s")
        old = await self._claimed(store, "s", "a", ttl=0.3)
        await anyio.sleep(0.6)
        new = await self._claimed(store, "s", "b")
        assert new.epoch > old.epoch
        with pytest.raises(LeaseLostError):
            await store.apply(_batch(session, "paused writer"), lease=old)
        with pytest.raises(LeaseLostError):
            await store.renew(old)
        assert (await store.load("s")).revision == 0
        assert await store.release(old) is True
        busy = await store.claim("s", "c", TTL)
        assert isinstance(busy, LeaseHolder)
        assert busy.owner == "b"

    async def test_an_abandoned_lease_is_work_for_claim_next(self, store: Any) -> None:
        if not store.leases_expire:
            pytest.skip(f"{type(store).__name__}'s leases are abandoned only by a dead process")
        await store.create("s")
        await store.create("t")
        await self._claimed(store, "s", "a", ttl=0.3)  # never released: the run was cut short
        released = await self._claimed(store, "t", "b", ttl=0.3)
        await store.release(released)
        assert await store.claim_next("w", TTL) is None  # s's holder may still be alive
        await anyio.sleep(0.6)
        got = await store.claim_next("w", TTL)
        assert isinstance(got, Lease)
        assert got.session_id == "s"
        assert await store.claim_next("w2", TTL) is None

    async def test_renewal_keeps_an_expiring_lease(self, store: Any) -> None:
        if not store.leases_expire:
            pytest.skip(f"{type(store).__name__}'s leases last as long as the process")
        await store.create("s")
        lease = await self._claimed(store, "s", "a", ttl=0.6)
        for _ in range(4):
            await anyio.sleep(0.2)
            lease = await store.renew(lease)
        busy = await store.claim("s", "b", TTL)
        assert isinstance(busy, LeaseHolder)
        assert busy.owner == "a"
