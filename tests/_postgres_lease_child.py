"""A child process for tests/test_leases_postgres_processes.py: one lease holder or worker.

Usage: ``python tests/_postgres_lease_child.py ROLE DSN BACKEND [ARGS]``, where
BACKEND is ``asyncio`` or ``trio``. Every line it prints is one JSON object;
where it waits for the parent, it reads a line from stdin.

Roles:

- ``paused SESSION TTL``: claim SESSION with TTL, keep renewing it every TTL/4
  in the background, say ``{"claimed": epoch}``, and wait for a line (the
  parent pauses this process with SIGSTOP meanwhile, takes the session over and
  writes, then sends the line and SIGCONT). Then, with the old lease: apply the
  batch built from the session as read at the claim (its revision is stale
  too), apply a batch on the session as it is now (its revision is right),
  renew; print what each raised, and sleep until killed.
- ``holder SESSION TTL``: claim SESSION with TTL, say ``{"claimed": epoch,
  "owner": owner}`` and sleep until killed (never renewing, never releasing).
- ``worker NAME``: say ``{"ready": true}``, wait for a line (all workers start
  together), then until ``claim_next`` answers ``None``: claim a session, apply
  one batch with the lease on the session as loaded, release; print
  ``{"got": [session, epoch]}`` per session, then ``{"done": count}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import anyio
import anyio.to_thread
import psycopg

from stepmachine import AppendMessage, Effect, LeaseLostError, Message, Session
from stepmachine.extend import Batch, Lease, new_owner
from stepmachine.stores import PostgresStore


def say(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


async def wait_for_parent() -> None:
    await anyio.to_thread.run_sync(sys.stdin.readline)


def batch_for(session: Session[Any], text: str) -> Batch[Effect]:
    revision = session.revision + 1
    message = Message.user(text, id=f"{text}-{revision}")
    return Batch(
        session_id=session.id,
        revision=revision,
        step="child",
        cycle=revision,
        timestamp=1_700_000_000.0 + revision,
        effects=(AppendMessage(message),),
    )


async def claimed(store: PostgresStore, session_id: str, owner: str, ttl: float) -> Lease:
    got = await store.claim(session_id, owner, ttl)
    if not isinstance(got, Lease):
        raise SystemExit(f"{owner} could not claim {session_id}: {got!r}")
    return got


async def outcome(attempt: Any) -> str:
    """The name of what ``await attempt`` raised, or ``"ok"``."""
    try:
        await attempt
    except Exception as exc:  # the parent checks its name
        return type(exc).__name__
    return "ok"


async def paused(store: PostgresStore, session_id: str, ttl: float) -> None:
    lease = await claimed(store, session_id, new_owner("paused:"), ttl)
    before = await store.load(session_id)

    async def renew_until_lost() -> None:
        while True:
            await anyio.sleep(ttl / 4)
            try:
                await store.renew(lease)
            except (LeaseLostError, psycopg.Error):
                # Lost; or paused mid-renewal long enough that the server ended
                # the connection (idle_in_transaction_timeout): lost as well.
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(renew_until_lost)
        say(claimed=lease.epoch)
        await wait_for_parent()  # SIGSTOPped in here, past the ttl, then SIGCONTed
        stale = await outcome(store.apply(batch_for(before, "paused-stale"), lease=lease))
        now = await store.load(session_id)
        fresh = await outcome(store.apply(batch_for(now, "paused-fresh"), lease=lease))
        renewed = await outcome(store.renew(lease))
        tg.cancel_scope.cancel()
    say(stale=stale, fresh=fresh, renew=renewed, seen=now.revision)
    await anyio.sleep_forever()


async def holder(store: PostgresStore, session_id: str, ttl: float) -> None:
    owner = new_owner("holder:")
    lease = await claimed(store, session_id, owner, ttl)
    say(claimed=lease.epoch, owner=owner)
    await anyio.sleep_forever()


async def worker(store: PostgresStore, name: str) -> None:
    say(ready=True)
    await wait_for_parent()
    count = 0
    while (lease := await store.claim_next(new_owner(f"{name}:"), 30.0)) is not None:
        session = await store.load(lease.session_id)
        await store.apply(batch_for(session, name), lease=lease)
        await store.release(lease)
        say(got=[lease.session_id, lease.epoch])
        count += 1
    say(done=count)


async def main(role: str, dsn: str, args: list[str]) -> None:
    # A short idle limit: paused in the middle of a renewal, this process keeps
    # the session row locked only that long (the parent's claim waits for it).
    async with await PostgresStore.open(dsn, idle_in_transaction_timeout=1.0) as store:
        if role == "paused":
            await paused(store, args[0], float(args[1]))
        elif role == "holder":
            await holder(store, args[0], float(args[1]))
        elif role == "worker":
            await worker(store, args[0])
        else:
            raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[4:], backend=sys.argv[3])
