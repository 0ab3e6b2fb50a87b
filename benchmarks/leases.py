"""What a lease costs on the file-lock stores (SQLiteStore, FileStore), next to one apply.

For each store, on one session, interleaved round-robin so that the figures
share the machine's noise: the median microseconds of

* ``claim`` + ``release`` of the session (what ``run()`` adds once per run);
* ``renew`` (an in-memory check on these stores);
* ``apply`` of a one-message batch, without a lease and with one (fencing).

The last line is ``store=<name> claim_release_us=<f> renew_us=<f> apply_us=<f>
apply_leased_us=<f> claim_release_over_apply=<f>`` for the last store
(SQLite by default). Machines are shared and noisy: compare the ratio, not
absolute figures.

Run:  python benchmarks/leases.py [--quick] [--backend trio] [--stores sqlite,file]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from stepmachine import AppendMessage, Effect, Message, Session
from stepmachine.extend import Batch, Lease
from stepmachine.stores import FileStore, SQLiteStore


def _batch(session: Session[Any]) -> Batch[Effect]:
    revision = session.revision + 1
    return Batch(
        session_id=session.id,
        revision=revision,
        step="bench",
        cycle=revision,
        timestamp=1_700_000_000.0 + revision,
        effects=(AppendMessage(Message.user("x" * 200, id=f"m{revision}")),),
    )


async def _open(kind: str, folder: Path) -> Any:
    if kind == "sqlite":
        return await SQLiteStore.open(folder / "db.sqlite3")
    return await FileStore.open(folder / "files")


async def measure(kind: str, rounds: int) -> dict[str, float]:
    """Median microseconds of each operation over ``rounds`` interleaved rounds."""
    samples: dict[str, list[float]] = {"claim_release": [], "renew": [], "apply": []}
    samples["apply_leased"] = []
    with tempfile.TemporaryDirectory() as folder:
        store = await _open(kind, Path(folder))
        try:
            session = await store.create("s")
            for i in range(rounds):
                start = time.perf_counter()
                lease = await store.claim("s", f"o{i}", 30.0)
                assert isinstance(lease, Lease)
                await store.release(lease)
                samples["claim_release"].append(time.perf_counter() - start)

                start = time.perf_counter()
                session = await store.apply(_batch(session))
                samples["apply"].append(time.perf_counter() - start)

                lease = await store.claim("s", f"p{i}", 30.0)
                assert isinstance(lease, Lease)
                start = time.perf_counter()
                await store.renew(lease)
                samples["renew"].append(time.perf_counter() - start)
                start = time.perf_counter()
                session = await store.apply(_batch(session), lease=lease)
                samples["apply_leased"].append(time.perf_counter() - start)
                await store.release(lease)
        finally:
            await store.aclose()
    return {name: statistics.median(values) * 1e6 for name, values in samples.items()}


async def main(stores: list[str], rounds: int) -> None:
    line = ""
    for kind in stores:
        us = await measure(kind, rounds)
        ratio = us["claim_release"] / us["apply"]
        print(
            f"{kind:7} claim+release {us['claim_release']:8.1f} us   renew {us['renew']:6.1f} us"
            f"   apply {us['apply']:8.1f} us   apply with lease {us['apply_leased']:8.1f} us"
            f"   claim+release / apply {ratio:5.2f}"
        )
        line = (
            f"store={kind} claim_release_us={us['claim_release']:.1f} renew_us={us['renew']:.1f}"
            f" apply_us={us['apply']:.1f} apply_leased_us={us['apply_leased']:.1f}"
            f" claim_release_over_apply={ratio:.2f}"
        )
    print(line)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="a short run (under a second)")
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--stores", default="file,sqlite", help="comma-separated: sqlite,file")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (2000; quick 50)")
    args = parser.parse_args()
    rounds = args.rounds or (50 if args.quick else 2_000)
    anyio.run(main, args.stores.split(","), rounds, backend=args.backend)
