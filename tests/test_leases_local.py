"""SQLiteStore's and FileStore's leases (file locks): the conformance suite, then
what only several processes show: a SIGKILLed holder's lease comes free, racing
``claim_next`` never gives a session twice, and a ``request_run`` from another
process while the holder runs is never lost."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import (
    AppendMessage,
    Codec,
    Effect,
    LeaseLostError,
    Message,
    Session,
    StoreClosedError,
    StoredDataError,
)
from stepmachine.extend import Batch, Lease, LeaseHolder, Leases
from stepmachine.stores import FileStore, SQLiteStore
from stepmachine.testing.leases import LeaseConformance

KINDS = ["sqlite", "file"]


async def _open(kind: str, path: Path, codec: Codec[Any] | None = None) -> Any:
    if kind == "sqlite":
        return await SQLiteStore.open(path / "db.sqlite3", codec)
    return await FileStore.open(path / "files", codec, fsync="never")


class TestSQLiteStoreLeases(LeaseConformance):
    async def make_store(self, codec: Codec[Any], path: Path) -> SQLiteStore:
        store: SQLiteStore = await _open("sqlite", path, codec)
        return store


class TestFileStoreLeases(LeaseConformance):
    async def make_store(self, codec: Codec[Any], path: Path) -> FileStore:
        store: FileStore = await _open("file", path, codec)
        return store


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def store(kind: str, tmp_path: Path) -> AsyncIterator[Any]:
    made = await _open(kind, tmp_path)
    try:
        yield made
    finally:
        await made.aclose()


def _batch(session: Session[Any], text: str) -> Batch[Effect]:
    return Batch(
        session_id=session.id,
        revision=session.revision + 1,
        step="test",
        cycle=session.revision + 1,
        timestamp=1_700_000_000.0,
        effects=(AppendMessage(Message.user(text, id=f"m{session.revision + 1}")),),
    )


# -- one process, several store instances ---------------------------------------------


async def test_two_instances_exclude_each_other(kind: str, tmp_path: Path) -> None:
    first, second = await _open(kind, tmp_path), await _open(kind, tmp_path)
    try:
        session = await first.create("s")
        lease = await first.claim("s", "a", 30.0)
        assert isinstance(lease, Lease)
        assert await second.claim("s", "b", 30.0) == LeaseHolder("a", None, lease.epoch)
        # fencing is per instance: the lease is not held by `second`
        with pytest.raises(LeaseLostError):
            await second.apply(_batch(session, "x"), lease=lease)
        assert await second.release(lease) is True  # not its lease: nothing done
        assert isinstance(await second.claim("s", "b", 30.0), LeaseHolder)
        await first.release(lease)
        taken = await second.claim("s", "b", 30.0)
        assert isinstance(taken, Lease)
        assert taken.epoch == lease.epoch + 1
    finally:
        await first.aclose()
        await second.aclose()


async def test_aclose_releases_and_refuses(kind: str, tmp_path: Path) -> None:
    first, second = await _open(kind, tmp_path), await _open(kind, tmp_path)
    try:
        await first.create("s")
        lease = await first.claim("s", "a", 30.0)
        assert isinstance(lease, Lease)
        await first.aclose()
        for call in (
            first.claim("s", "a", 30.0),
            first.claim_next("a", 30.0),
            first.request_run("s"),
            first.renew(lease),
            first.release(lease),
        ):
            with pytest.raises(StoreClosedError):
                await call
        assert isinstance(await second.claim("s", "b", 30.0), Lease)
    finally:
        await first.aclose()
        await second.aclose()


async def test_epochs_continue_across_instances_and_delete(kind: str, tmp_path: Path) -> None:
    epochs = []
    for _ in range(2):
        store = await _open(kind, tmp_path)
        try:
            if "s" not in await store.list_sessions():
                await store.create("s")
            lease = await store.claim("s", "a", 30.0)
            assert isinstance(lease, Lease)
            epochs.append(lease.epoch)
            await store.request_run("s")
            await store.release(lease)
            await store.delete("s")  # the mark goes with the session
            assert await store.claim_next("w", 30.0) is None
            await store.create("s")
            again = await store.claim("s", "b", 30.0)
            assert isinstance(again, Lease)
            epochs.append(again.epoch)
        finally:
            await store.aclose()
    assert epochs == sorted(set(epochs)), epochs


async def test_a_stale_mark_of_a_deleted_session_is_skipped(store: Any) -> None:
    await store.create("s")
    await store.create("t")
    await store.request_run("s")
    await store.request_run("t")
    leases = store._leases  # a mark left behind (a crash between delete and its unmark)
    await store.delete("s")
    await leases._meta(lambda: leases._mark("s"))
    got = await store.claim_next("w", 30.0)
    assert isinstance(got, Lease)
    assert got.session_id == "t"
    assert await store.claim_next("w2", 30.0) is None


async def test_hostile_but_valid_ids(store: Any) -> None:
    ids = ["a" * 128, "A", "a", "CON_", "x.lock", "_", "9-9.9"]
    for session_id in ids:
        await store.create(session_id)
        await store.request_run(session_id)
    got = []
    while (lease := await store.claim_next("w", 30.0)) is not None:
        got.append(lease.session_id)
    assert sorted(got) == sorted(ids)  # each once (the longest-waiting first)
    assert sorted(await store.list_sessions()) == sorted(ids)  # lease files are not sessions


def test_stores_have_leases() -> None:
    assert SQLiteStore.leases_expire is False
    assert FileStore.leases_expire is False
    for cls in (SQLiteStore, FileStore):
        assert all(hasattr(cls, name) for name in ("claim", "claim_next", "request_run"))


async def test_isinstance_leases(store: Any) -> None:
    assert isinstance(store, Leases)


# -- against a model: two store instances on the same files --------------------------------


@dataclass
class _Slot:
    epoch: int = 0
    holder: Lease | None = None
    requested: bool = False


@dataclass
class _Model:
    """What the leases of two instances on one folder must do, as plain data."""

    slots: dict[str, _Slot] = field(default_factory=lambda: {"s": _Slot(), "t": _Slot()})
    owners: int = 0

    def claim(self, session_id: str, ttl: float) -> Lease | LeaseHolder:
        slot = self.slots[session_id]
        if slot.holder is not None:
            return LeaseHolder(slot.holder.owner, None, slot.holder.epoch)
        self.owners += 1
        slot.epoch += 1
        slot.holder = Lease(session_id, f"o{self.owners}", slot.epoch, ttl)
        slot.requested = False
        return slot.holder

    def waiting(self) -> list[str]:
        """The sessions ``claim_next`` may give out: marked and not held."""
        return [s for s, slot in sorted(self.slots.items()) if slot.requested and not slot.holder]

    def release(self, lease: Lease, unless_requested: bool) -> bool:
        slot = self.slots[lease.session_id]
        if slot.holder != lease:
            return True
        if unless_requested and slot.requested:
            slot.requested = False
            return False
        slot.holder = None
        return True


OPS = st.lists(
    st.tuples(
        st.sampled_from(["claim", "claim_next", "request", "release", "release_unless", "apply"]),
        st.integers(0, 1),  # which instance
        st.sampled_from(["s", "t"]),
        st.integers(0, 5),  # which lease, of those given so far
    ),
    max_size=25,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, kind=st.sampled_from(KINDS))
async def test_two_instances_behave_like_the_model(
    ops: list[tuple[str, int, str, int]], kind: str
) -> None:
    model = _Model()
    leases: list[tuple[int, Lease]] = []  # (instance that claimed it, lease)
    with tempfile.TemporaryDirectory() as folder:
        stores = [await _open(kind, Path(folder)), await _open(kind, Path(folder))]
        try:
            await stores[0].create("s")
            await stores[0].create("t")
            for op, which, session_id, pick in ops:
                store = stores[which]
                got: Lease | LeaseHolder | None = None
                if op == "claim":
                    got = await store.claim(session_id, f"o{model.owners + 1}", 30.0)
                    assert got == model.claim(session_id, 30.0)
                elif op == "claim_next":
                    got = await store.claim_next(f"o{model.owners + 1}", 30.0)
                    # Which waiting session comes first depends on the marks' file times
                    # (longest-waiting first), which the model does not know: any will do.
                    waiting = model.waiting()
                    if got is None:
                        assert waiting == []
                    else:
                        assert got.session_id in waiting
                        assert got == model.claim(got.session_id, 30.0)
                elif op == "request":
                    await store.request_run(session_id)
                    model.slots[session_id].requested = True
                elif leases:
                    claimer, lease = leases[pick % len(leases)]
                    mine = stores[claimer]  # the instance that holds it, if anyone does
                    if op == "apply":
                        current = model.slots[session_id].holder == lease
                        session = await mine.load(session_id)
                        if current and lease.session_id == session_id:
                            await mine.apply(_batch(session, "w"), lease=lease)
                        else:
                            with pytest.raises(LeaseLostError):
                                await mine.apply(_batch(session, "w"), lease=lease)
                    else:
                        unless = op == "release_unless"
                        expected = model.release(lease, unless)
                        assert await mine.release(lease, unless_requested=unless) == expected
                if isinstance(got, Lease):
                    leases.append((which, got))
        finally:
            for store in stores:
                await store.aclose()


# -- several processes ------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys

    import anyio

    from stepmachine import Lease
    from stepmachine.stores import FileStore, SQLiteStore


    async def drain(store, owner, ids):
        while (lease := await store.claim_next(owner, 30.0)) is not None:
            ids.append(lease.session_id)
            assert await store.release(lease) is True


    async def main():
        kind, folder = sys.argv[1], sys.argv[2]
        if kind == "sqlite":
            store = await SQLiteStore.open(folder + "/db.sqlite3")
        else:
            store = await FileStore.open(folder + "/files", fsync="never")
        print("ready", flush=True)
        held = {}
        for line in sys.stdin:
            command, *args = line.split()
            if command == "claim":
                got = await store.claim(args[0], args[1], 30.0)
                kept = isinstance(got, Lease)
                reply = f"lease {got.epoch}" if kept else f"holder {got.owner}"
                if kept:
                    held[args[0]] = got
            elif command == "release":
                reply = f"released {await store.release(held.pop(args[0]))}"
            elif command == "request":
                await store.request_run(args[0])
                reply = "requested"
            elif command == "drain":
                ids = []
                async with anyio.create_task_group() as tg:
                    for i in range(3):
                        tg.start_soon(drain, store, f"{args[0]}-{i}", ids)
                reply = "got " + ",".join(ids)
            print(reply, flush=True)
        await store.aclose()


    anyio.run(main)
    """
)


class Child:
    """A child process with its own store on the same files, driven line by line."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        # cwd outside the repository: the source folder would shadow the stores mapping
        self.process = subprocess.Popen(
            [sys.executable, "-c", CHILD, kind, str(tmp_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )

    async def reply(self) -> str:
        assert self.process.stdout is not None
        with anyio.fail_after(60):  # a guard against a hang, not a measurement
            line = await anyio.to_thread.run_sync(
                self.process.stdout.readline, abandon_on_cancel=True
            )
        assert line, f"the child exited with {self.process.wait()}"
        return line.strip()

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    async def ask(self, line: str) -> str:
        self.send(line)
        return await self.reply()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def children(kind: str, tmp_path: Path) -> Any:
    started: list[Child] = []

    async def start() -> Child:
        child = Child(kind, tmp_path)
        started.append(child)
        assert await child.reply() == "ready"
        return child

    yield start
    for child in started:
        child.stop()


async def test_a_sigkilled_holder_frees_the_session(store: Any, children: Any) -> None:
    session = await store.create("s")
    child = await children()
    answer = await child.ask("claim s child")
    assert answer.startswith("lease "), answer
    child_epoch = int(answer.split()[1])
    assert await child.ask("request s") == "requested"  # left behind by the holder's death
    assert await store.claim("s", "parent", 30.0) == LeaseHolder("child", None, child_epoch)
    assert await store.claim_next("worker", 30.0) is None

    child.process.send_signal(signal.SIGKILL)
    assert child.process.wait() == -signal.SIGKILL

    lease = await store.claim_next("worker", 30.0)  # the mark survived the holder
    assert isinstance(lease, Lease)
    assert (lease.session_id, lease.owner) == ("s", "worker")
    assert lease.epoch > child_epoch
    assert (await store.apply(_batch(session, "taken over"), lease=lease)).revision == 1


async def test_a_holder_that_died_leaves_work_for_claim_next(store: Any, children: Any) -> None:
    """No mark was set: the unreleased claim alone says the run was cut short."""
    await store.create("s")
    await store.create("t")
    child = await children()
    assert (await child.ask("claim s child")).startswith("lease ")
    assert (await child.ask("claim t child2")).startswith("lease ")
    assert await child.ask("release t") == "released True"
    assert await store.claim_next("worker", 30.0) is None  # s is held by a live process

    child.process.send_signal(signal.SIGKILL)
    assert child.process.wait() == -signal.SIGKILL

    lease = await store.claim_next("worker", 30.0)
    assert isinstance(lease, Lease)
    assert lease.session_id == "s"  # not t: its lease was released
    assert await store.release(lease) is True
    assert await store.claim_next("worker", 30.0) is None  # released: no longer abandoned


async def test_racing_processes_never_share_a_session(store: Any, children: Any) -> None:
    names = [f"s{i:02}" for i in range(40)]
    for name in names:
        await store.create(name)
        await store.request_run(name)
    first, second = await children(), await children()
    first.send("drain one")
    second.send("drain two")
    got: list[str] = []
    for child in (first, second):
        answer = await child.reply()
        # "got" alone: the other process drained every session first (its reply is stripped)
        assert answer == "got" or answer.startswith("got "), answer
        got += [name for name in answer[len("got") :].strip().split(",") if name]
    assert sorted(got) == names  # every session once: none lost, none twice
    assert await store.claim_next("late", 30.0) is None


async def test_a_request_from_another_process_is_not_lost(store: Any, children: Any) -> None:
    await store.create("s")
    child = await children()
    # The request lands while the holder runs: its release keeps the lease.
    lease = await store.claim("s", "holder", 30.0)
    assert isinstance(lease, Lease)
    assert await child.ask("request s") == "requested"
    assert await store.release(lease, unless_requested=True) is False
    assert await child.ask("claim s other") == "holder holder"
    assert await store.release(lease, unless_requested=True) is True
    assert await store.claim_next("w", 30.0) is None

    # The request races the holder's releases: it is taken by one of them or
    # left for the next claimer, exactly once, never dropped.
    for round_ in range(15):
        lease = await store.claim("s", f"holder{round_}", 30.0)
        assert isinstance(lease, Lease)
        child.send("request s")
        kept = 0
        while not await store.release(lease, unless_requested=True):
            kept += 1
        assert await child.reply() == "requested"
        left = await store.claim_next(f"w{round_}", 30.0)
        assert kept + (left is not None) == 1, (round_, kept, left)
        if left is not None:
            assert await store.release(left) is True


# -- edges -------------------------------------------------------------------------------


async def test_an_overlong_owner_is_refused(store: Any) -> None:
    await store.create("s")
    with pytest.raises(ValueError, match="lease owner is a string"):
        await store.claim("s", "o" * 5000, 30.0)
    with pytest.raises(ValueError, match="lease owner is a string"):
        await store.claim_next("o" * 5000, 30.0)
    long_owner = "é" * 256  # the longest owner, in two-byte characters: fits the record
    lease = await store.claim("s", long_owner, 30.0)
    assert isinstance(lease, Lease)
    assert await store.claim("s", "b", 30.0) == LeaseHolder(long_owner, None, lease.epoch)


async def test_a_damaged_record_is_reported_not_reset(kind: str, tmp_path: Path) -> None:
    store = await _open(kind, tmp_path)
    try:
        await store.create("s")
        lease = await store.claim("s", "a", 30.0)
        assert isinstance(lease, Lease)
        await store.release(lease)
        (lock,) = (Path(store._leases.folder) / "sessions").iterdir()
        lock.write_bytes(b"\x00\x00garbage\n")
        with pytest.raises(StoredDataError, match="lease record"):
            await store.claim("s", "b", 30.0)
        lock.unlink()  # what the message says to do: epochs restart at 1
        again = await store.claim("s", "b", 30.0)
        assert isinstance(again, Lease)
        assert again.epoch == 1
    finally:
        await store.aclose()


async def test_a_shorter_record_overwrites_a_longer_one(store: Any) -> None:
    await store.create("s")
    first = await store.claim("s", "a-rather-long-owner-string", 30.0)
    assert isinstance(first, Lease)
    await store.release(first)
    second = await store.claim("s", "b", 30.0)
    assert isinstance(second, Lease)
    assert second.epoch == first.epoch + 1
    assert await store.claim("s", "c", 30.0) == LeaseHolder("b", None, second.epoch)


async def test_where_the_lease_files_are(kind: str, tmp_path: Path) -> None:
    store = await _open(kind, tmp_path)
    try:
        await store.create("s")
        expected = (
            tmp_path / "db.sqlite3-leases" if kind == "sqlite" else tmp_path / "files" / ".leases"
        )
        assert not expected.exists()  # made at the first lease operation only
        await store.request_run("s")
        assert Path(store._leases.folder) == expected
        assert sorted(p.name for p in expected.iterdir()) == [
            "held",
            "meta.lock",
            "runs",
            "sessions",
        ]
        assert expected.stat().st_mode & 0o777 == 0o700
    finally:
        await store.aclose()


NO_FCNTL = textwrap.dedent(
    """
    import sys

    sys.modules["fcntl"] = None  # `import fcntl` raises ImportError, as on Windows
    import anyio

    from stepmachine import ConfigurationError
    from stepmachine.stores import SQLiteStore


    async def main():
        async with await SQLiteStore.open(sys.argv[1] + "/db.sqlite3") as store:
            session = await store.create("s")
            for call in (
                lambda: store.claim("s", "a", 30.0),
                lambda: store.claim_next("a", 30.0),
                lambda: store.request_run("s"),
            ):
                try:
                    await call()
                except ConfigurationError as exc:
                    print("refused:", exc)
            print("sessions:", await store.list_sessions())


    anyio.run(main)
    """
)


def test_sqlite_without_fcntl_refuses_leases_and_works(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", NO_FCNTL, str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
        timeout=120,  # a guard against a hang
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len([line for line in lines if line.startswith("refused:")]) == 3, lines
    assert "fcntl.flock" in lines[0]
    assert lines[-1] == "sessions: ['s']"


async def test_a_release_waits_for_the_fenced_write_in_flight(tmp_path: Path) -> None:
    """FileStore runs applies and releases in separate worker threads: the release of
    a lease whose write is under way finishes after the write, and nothing written
    after it passes the fence."""
    token = anyio.lowlevel.current_token()
    seen: dict[str, object] = {}
    lease_box: list[Lease] = []

    def hook(name: str) -> None:
        if name != "apply.locked" or "release" in seen:
            return

        def release() -> None:
            seen["released"] = anyio.from_thread.run(store.release, lease_box[0], token=token)

        releaser = threading.Thread(target=release)
        seen["release"] = releaser
        releaser.start()
        releaser.join(0.2)  # it cannot end while this write holds the lease's guard
        seen["alive_during_write"] = releaser.is_alive()

    store = await FileStore.open(tmp_path / "files", fsync="never", boundary_hook=hook)
    try:
        session = await store.create("s")
        lease = await store.claim("s", "a", 30.0)
        assert isinstance(lease, Lease)
        lease_box.append(lease)
        session = await store.apply(_batch(session, "in flight"), lease=lease)
        assert session.revision == 1
        releaser = seen["release"]
        assert isinstance(releaser, threading.Thread)
        await anyio.to_thread.run_sync(releaser.join)
        assert seen["alive_during_write"] is True
        assert seen["released"] is True
        with pytest.raises(LeaseLostError):
            await store.apply(_batch(session, "after the release"), lease=lease)
    finally:
        await store.aclose()


def test_the_lease_benchmark_runs(tmp_path: Path) -> None:
    """``benchmarks/leases.py --quick`` ends with its summary line (values measured,
    never asserted)."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "leases.py"
    done = subprocess.run(
        [sys.executable, str(script), "--quick"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,  # a guard against a hang
    )
    assert done.returncode == 0, done.stderr
    names = ["claim_release_us", "renew_us", "apply_us", "apply_leased_us"]
    pattern = "store=sqlite " + " ".join(rf"{name}=\d+\.\d" for name in names)
    assert re.fullmatch(
        pattern + r" claim_release_over_apply=\d+\.\d\d", done.stdout.splitlines()[-1]
    )
