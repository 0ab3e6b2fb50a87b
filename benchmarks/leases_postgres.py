"""What leases cost on PostgreSQL: claim + release against one apply, and fenced applies.

Usage::

    python benchmarks/leases_postgres.py             # $STEPMACHINE_TEST_POSTGRES or a new server
    python benchmarks/leases_postgres.py --quick    # a few rounds only (checks that it runs)
    python benchmarks/leases_postgres.py --fsync-off # a new server without fsync

With ``STEPMACHINE_TEST_POSTGRES`` unset, a throwaway server is started with
PostgreSQL's durable defaults (``fsync`` on), as ``benchmarks/store.py`` does; a
fresh database is created on it and dropped afterwards.

In each round, in this order, each timed alone (one store call, one worker
thread hop, one transaction):

- ``claim + release`` of a session nobody holds (two calls; a run pays this once);
- one ``apply`` of a one-message batch without a lease (``submit()``'s write);
- one ``apply`` of the same batch with a lease (a runner's write: the lease's
  owner, epoch and expiry join the compare-and-set ``UPDATE``).

The two applying sessions grow alike, so both see the same snapshots. The
figures are medians in microseconds; the last line is
``claim_release_us=<f> apply_us=<f> apply_leased_us=<f> leased_over_unleased=<f>
claim_release_over_apply=<f>``. Measured, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "harness"))
sys.path.insert(0, str(ROOT))

import _postgres  # noqa: E402 - tests/harness, put on sys.path above

from stepmachine import AppendMessage, Effect, Message, Session  # noqa: E402
from stepmachine.extend import Batch, Lease  # noqa: E402
from stepmachine.stores import PostgresStore  # noqa: E402


def one_message(session: Session[Any], index: int) -> Batch[Effect]:
    revision = session.revision + 1
    text = f"message {index}: " + "x" * 200
    return Batch(
        session_id=session.id,
        revision=revision,
        step="bench",
        cycle=revision,
        timestamp=1_700_000_000.0 + revision,
        effects=(AppendMessage(Message.user(text, id=f"m{revision}")),),
    )


async def timed(call: Awaitable[Any]) -> tuple[float, Any]:
    """``await call``, and the microseconds it took."""
    start = time.perf_counter()
    result = await call
    return (time.perf_counter() - start) * 1e6, result


async def claim_release(store: PostgresStore, session_id: str, owner: str) -> None:
    got = await store.claim(session_id, owner, 30.0)
    assert isinstance(got, Lease), got
    await store.release(got)


async def measure(dsn: str, rounds: int) -> dict[str, list[float]]:
    figures: dict[str, list[float]] = {"claim_release": [], "apply": [], "apply_leased": []}
    async with await PostgresStore.open(dsn) as store:
        await store.create("claimed")
        plain = await store.create("plain")
        fenced = await store.create("fenced")
        lease = await store.claim("fenced", "bench-runner", 300.0)
        assert isinstance(lease, Lease), lease
        for index in range(rounds):
            elapsed, _ = await timed(claim_release(store, "claimed", f"bench-{index}"))
            figures["claim_release"].append(elapsed)
            elapsed, plain = await timed(store.apply(one_message(plain, index)))
            figures["apply"].append(elapsed)
            elapsed, fenced = await timed(store.apply(one_message(fenced, index), lease=lease))
            figures["apply_leased"].append(elapsed)
        await store.release(lease)
    return figures


def report(figures: dict[str, list[float]]) -> None:
    medians = {name: statistics.median(values[5:] or values) for name, values in figures.items()}
    for name, values in figures.items():
        quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
        low, high = quartiles[0], quartiles[2]
        print(
            f"{name}: median {medians[name]:.0f} us, quartiles {low:.0f}..{high:.0f} us "
            f"over {len(values)} rounds"
        )
    print(
        f"claim_release_us={medians['claim_release']:.1f} apply_us={medians['apply']:.1f} "
        f"apply_leased_us={medians['apply_leased']:.1f} "
        f"leased_over_unleased={medians['apply_leased'] / medians['apply']:.3f} "
        f"claim_release_over_apply={medians['claim_release'] / medians['apply']:.3f}"
    )


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="20 rounds")
    parser.add_argument(
        "--fsync-off",
        action="store_true",
        help="a throwaway server with fsync off: the round trips and CPU without the disk",
    )
    args = parser.parse_args(argv)
    rounds = 20 if args.quick else args.rounds
    with (
        _postgres.postgres_server(durable=not args.fsync_off) as server,
        _postgres.fresh_database(server, prefix="stepmachine_bench") as dsn,
    ):
        figures = anyio.run(measure, dsn, rounds)
    report(figures)


if __name__ == "__main__":
    main(sys.argv[1:])
