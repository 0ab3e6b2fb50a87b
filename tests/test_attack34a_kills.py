"""Attack 34a: a third-party staged step (three guarded charges) in a real process,
SIGKILLed at a bad moment, then run again by a fresh process on the same store; and two
processes running the same session at once (the default lease).

The child is ``tests/_attack34a_kill_child.py``; its journal ``effects.txt`` says which
task started and which charge took effect, in which process. Checked: no charge took
effect twice, a stored receipt is the one of a charge that took effect (with the key of
the stored intent), the fresh process starts no task and sees the intents without a
receipt (``outcome_unknown`` naming exactly those), and two processes never both start
a guarded task.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest
from _attack34a_common import Order

from stepmachine import Codec
from stepmachine.stores import FileStore, SQLiteStore

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "_attack34a_kill_child.py"
SID = "order"


def where_of(kind: str, tmp_path: Path) -> str:
    return str(tmp_path / ("db.sqlite3" if kind == "sqlite" else "store"))


def spawn(
    kind: str, where: str, mode: str, folder: Path, concurrency: int = 1, backend: str = "asyncio"
) -> subprocess.Popen[bytes]:
    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tests}", "ATTACK34A_DIR": str(folder)}
    command = [sys.executable, str(CHILD), kind, where, mode, str(concurrency), backend]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(child: subprocess.Popen[bytes], timeout: float = 90.0) -> tuple[int, str]:
    out, err = child.communicate(timeout=timeout)
    return child.returncode, out.decode() + err.decode()


async def open_store(kind: str, where: str) -> Any:
    if kind == "sqlite":
        return await SQLiteStore.open(where, codec=Codec(Order))
    return await FileStore.open(where, codec=Codec(Order))


async def create(kind: str, where: str) -> None:
    store = await open_store(kind, where)
    try:
        await store.create(SID, data=Order())
    finally:
        await store.aclose()


async def stored(kind: str, where: str) -> tuple[Order, list[str]]:
    """The stored data, and every receipt name added batch by batch (a name twice:
    written twice)."""
    store = await open_store(kind, where)
    try:
        session = await store.load(SID)
        added: list[str] = []
        seen: set[str] = set()
        for batch in await store.batches(SID):
            for effect in batch.effects:
                changes = getattr(effect, "changes", {})
                if "receipts" in changes:
                    names = set(changes["receipts"])
                    added.extend(sorted(names - seen))
                    seen = names
        return session.data, added
    finally:
        await store.aclose()


def journal(folder: Path) -> list[list[str]]:
    path = folder / "effects.txt"
    if not path.exists():
        return []
    return [line.split() for line in path.read_text().splitlines()]


def check_invariants(data: Order, added: list[str], lines: list[list[str]]) -> set[str]:
    """The invariants; returns the names whose charge took effect."""
    charges = Counter(name for kind, name, _, _ in lines if kind == "charge")
    assert all(n == 1 for n in charges.values()), f"a charge took effect twice: {lines}"
    for kind, name, key, _ in lines:  # every start and charge is of the stored intent's key
        assert data.keys.get(name) == key, (kind, name, key, data.keys)
    for name, receipt in data.receipts.items():
        assert name in charges, f"receipt {name} without its charge"
        assert receipt == f"receipt-{data.keys[name]}"
    assert len(added) == len(set(added)), f"a receipt written twice: {added}"
    return set(charges)


CASES = [
    ("after_intents", 1),
    ("in_task", 1),
    ("after_return", 1),
    ("between_records", 1),
    ("after_intents", 3),
    ("in_task", 3),
    ("after_return", 3),
]
# what is recorded when the child dies, one after another (the kill is deterministic)
RECORDED_SEQUENTIAL = {
    "after_intents": set(),
    "in_task": {"a"},
    "after_return": {"a"},
    "between_records": {"a"},
}
CHARGED_SEQUENTIAL = {
    "after_intents": set(),
    "in_task": {"a"},
    "after_return": {"a", "b"},
    "between_records": {"a"},
}


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("kind", ["sqlite", "file"])
@pytest.mark.parametrize(("mode", "concurrency"), CASES)
def test_killed_staged_step_is_never_charged_twice(
    kind: str, mode: str, concurrency: int, backend: str, tmp_path: Path
) -> None:
    where = where_of(kind, tmp_path)
    anyio.run(create, kind, where)
    code, output = finish(spawn(kind, where, mode, tmp_path, concurrency, backend))
    assert code == -signal.SIGKILL, output[-3000:]
    first = journal(tmp_path)
    data, added = anyio.run(stored, kind, where)
    assert sorted(data.keys) == ["a", "b", "c"], "the intents are stored before any task"
    charged = check_invariants(data, added, first)
    recorded = set(data.receipts)
    if concurrency == 1:
        assert recorded == RECORDED_SEQUENTIAL[mode]
        assert charged == CHARGED_SEQUENTIAL[mode]
    # a fresh process, twice: it starts nothing and names the intents without a receipt
    for _ in range(2):
        code, output = finish(spawn(kind, where, "none", tmp_path, concurrency, backend))
        assert code == 0, output[-3000:]
        missing = ",".join(sorted({"a", "b", "c"} - recorded))
        assert f"reason outcome_unknown {missing}\n" in output, output[-3000:]
    assert journal(tmp_path) == first, "the fresh process started or charged something"
    after, added_after = anyio.run(stored, kind, where)
    assert after == data
    assert added_after == added


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("kind", ["sqlite", "file"])
@pytest.mark.parametrize("concurrency", [1, 3])
def test_two_processes_at_once_start_each_charge_once(
    kind: str, concurrency: int, backend: str, tmp_path: Path
) -> None:
    where = where_of(kind, tmp_path)
    anyio.run(create, kind, where)
    children = [spawn(kind, where, "slow", tmp_path, concurrency, backend) for _ in range(2)]
    deadline = time.monotonic() + 60
    while not journal(tmp_path):  # one of them holds the lease and started a task
        assert time.monotonic() < deadline, "no child started a task"
        assert all(c.poll() is None for c in children), [finish(c) for c in children]
        time.sleep(0.05)
    time.sleep(1.0)  # let the other reach its claim (it waits: the default lease)
    (tmp_path / "go").touch()
    results = [finish(child) for child in children]
    assert all(code == 0 for code, _ in results), results
    reasons = sorted(
        next(line for line in out.splitlines() if line.startswith("reason")) for _, out in results
    )
    assert reasons == ["reason done", "reason idle"], results
    lines = journal(tmp_path)
    assert len({pid for *_, pid in lines}) == 1, f"two processes started tasks: {lines}"
    data, added = anyio.run(stored, kind, where)
    assert check_invariants(data, added, lines) == {"a", "b", "c"}
    assert sorted(data.receipts) == ["a", "b", "c"]
    assert Counter(kind for kind, *_ in lines) == {"start": 3, "charge": 3}


@pytest.mark.parametrize("kind", ["sqlite", "file"])
@pytest.mark.parametrize("concurrency", [1, 3])
def test_killed_at_random_instants_never_charges_twice(
    kind: str, concurrency: int, tmp_path: Path
) -> None:
    """Fresh sessions, each child killed at a random instant of its run (or not), then
    resumed: the invariants hold and the resumed run names exactly the intents without
    a receipt (or yields ``done`` when the killed child finished)."""
    rng = random.Random(3410 + concurrency + (kind == "file"))
    kills = 0
    for attempt in range(8):
        folder = tmp_path / f"try{attempt}"
        folder.mkdir()
        where = where_of(kind, folder)
        anyio.run(create, kind, where)
        child = spawn(kind, where, "jitter", folder, concurrency)
        deadline = time.monotonic() + 60
        while not journal(folder) and child.poll() is None:  # the first task started
            assert time.monotonic() < deadline, "the child never started a task"
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.25 if concurrency == 1 else 0.12))  # within the tasks' work
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
            kills += 1
        code, output = finish(child)
        first = journal(folder)
        data, added = anyio.run(stored, kind, where)
        check_invariants(data, added, first)
        code, output = finish(spawn(kind, where, "none", folder, concurrency))
        assert code == 0, output[-3000:]
        missing = sorted(set(data.keys) - set(data.receipts))
        if not data.keys:  # killed before the intents: the resumed run charges
            assert "reason done\n" in output, output[-3000:]
            continue
        expected = f"outcome_unknown {','.join(missing)}" if missing else "idle"
        assert f"reason {expected}\n" in output, output[-3000:]
        assert journal(folder) == first, "the resumed run started or charged something"
    assert kills >= 2, "too few kills landed: the timing no longer attacks anything"


@pytest.mark.parametrize("kind", ["sqlite", "file"])
def test_holder_killed_while_another_process_waits(kind: str, tmp_path: Path) -> None:
    """Process A holds the lease and is SIGKILLed inside task ``b``; process B, waiting
    for the lease meanwhile (the default ``busy="wait"``), takes over: it starts nothing
    and names ``b`` and ``c`` as outcome unknown."""
    where = where_of(kind, tmp_path)
    anyio.run(create, kind, where)
    holder = spawn(kind, where, "kill_on_go", tmp_path)
    deadline = time.monotonic() + 60
    while not any(line[:2] == ["start", "b"] for line in journal(tmp_path)):
        assert time.monotonic() < deadline, "the holder never started b"
        assert holder.poll() is None, finish(holder)
        time.sleep(0.05)
    waiter = spawn(kind, where, "none", tmp_path)
    time.sleep(1.0)  # let the waiter reach its claim (nothing to observe from outside)
    assert waiter.poll() is None, finish(waiter)  # it waits: the lease is held
    (tmp_path / "go").touch()
    code, output = finish(holder)
    assert code == -signal.SIGKILL, output[-3000:]
    code, output = finish(waiter)
    assert code == 0, output[-3000:]
    assert "reason outcome_unknown b,c\n" in output, output[-3000:]
    lines = journal(tmp_path)
    assert len({pid for *_, pid in lines}) == 1, f"the waiter started a task: {lines}"
    assert [line[:2] for line in lines] == [["start", "a"], ["charge", "a"], ["start", "b"]]
    data, added = anyio.run(stored, kind, where)
    check_invariants(data, added, lines)
    assert data.receipts == {"a": f"receipt-{data.keys['a']}"}
