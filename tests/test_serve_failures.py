"""``serve()`` when a run raises: a transient error leaves the turn pending, any other
leaves a record (an ERROR event), never a silent drop.

The faults are real ones raised where the store would raise them (an ``OSError``
from ``load``, from ``claim_next``); the restarted PostgreSQL server is in
``test_postgres_restart.py``. The classification is ``stepmachine._transient``.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

from stepmachine import (
    CancelToken,
    ConfigurationError,
    ConflictError,
    LeaseLostError,
    Message,
    ModelInference,
    Runtime,
    StateMachine,
    StoreClosedError,
    StoredDataError,
    run_worker,
)
from stepmachine import _transient as transient
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore
from stepmachine.testing import FunctionModel, reply


class Faults:
    """How many times each store method should still raise ``OSError``."""

    def __init__(self) -> None:
        self.load = 0
        self.claim_next = 0
        self.raised: list[str] = []

    def take(self, name: str) -> None:
        left = getattr(self, name)
        if left:
            setattr(self, name, left - 1)
            self.raised.append(name)
            raise OSError(5, f"Input/output error (injected into {name})")


class FaultyMemory(MemoryStore):
    faults = Faults()

    async def load(self, session_id: str) -> Any:
        self.faults.take("load")
        return await super().load(session_id)

    async def claim_next(self, owner: str, ttl: float) -> Any:
        self.faults.take("claim_next")
        return await super().claim_next(owner, ttl)


class FaultySQLite(SQLiteStore):
    faults = Faults()

    async def load(self, session_id: str) -> Any:
        self.faults.take("load")
        return await super().load(session_id)

    async def claim_next(self, owner: str, ttl: float) -> Any:
        self.faults.take("claim_next")
        return await super().claim_next(owner, ttl)


@pytest.fixture(params=["memory", "memory-expiring", "sqlite"])
async def faulty(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A store whose methods raise when told to. A lease is held until released (memory,
    SQLite: a turn to retry is parked by its worker) or lapses (memory-expiring: the
    turn's lease is left to lapse, then any worker claims it)."""
    if request.param == "memory":
        store: Any = FaultyMemory()
    elif request.param == "memory-expiring":
        store = FaultyMemory(expiring_leases=True)
    else:
        store = await FaultySQLite.open(tmp_path / "db.sqlite3")
    store.faults = Faults()
    try:
        yield store
    finally:
        await store.aclose()


@pytest.fixture
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Short pauses (the bound and the doubling stay): the tests wait for retries."""
    monkeypatch.setattr(transient, "BACKOFF_FIRST", 0.01)
    monkeypatch.setattr(transient, "BACKOFF_CAP", 0.05)


def echo(request: Any) -> Any:
    return reply(f"re: {request.messages[-1].text}")


async def serve_until(store: Any, model: Any, done: Any, *, workers: int = 1) -> list[str]:
    """Run ``workers`` serve() loops until ``done(served)``; the ids of the runs reported."""
    stop = CancelToken()
    served: list[str] = []

    def seen(report: Any) -> None:
        served.append(report.session.id)
        if done(served):
            stop.cancel("done")

    runtime = Runtime(store=store, model=model)
    with anyio.fail_after(30):  # a guard against a hang, not a timing threshold
        async with anyio.create_task_group() as tg:
            for i in range(workers):
                tg.start_soon(
                    lambda i=i: run_worker(
                        StateMachine([ModelInference()]),
                        runtime,
                        stop=stop,
                        poll=0.01,
                        ttl=5,
                        owner_prefix=f"w{i}:",
                        on_report=seen,
                    )
                )
    return served


@pytest.mark.usefixtures("quick_backoff")
async def test_a_turn_whose_load_failed_once_is_run_again(faulty: Any) -> None:
    await faulty.create("s1", conversation=[Message.user("hello", id="u1")])
    await faulty.request_run("s1")
    faulty.faults.load = 1
    with structlog.testing.capture_logs() as logs:
        served = await serve_until(faulty, FunctionModel(echo), lambda served: "s1" in served)
    assert faulty.faults.raised == ["load"]
    assert served == ["s1"]
    session = await faulty.load("s1")
    assert session.conversation[-1].text == "re: hello"
    retried = [e for e in logs if e["event"] == "serve_run_retried"]
    assert [(e["session_id"], e["error_type"], e["attempt"]) for e in retried] == [
        ("s1", "OSError", 1)
    ]
    assert not [e for e in logs if e["event"] == "serve_run_failed"]
    assert await faulty.claim_next("probe", 5.0) is None  # nothing left pending or held


@pytest.mark.usefixtures("quick_backoff")
async def test_other_sessions_are_served_while_one_backs_off(faulty: Any) -> None:
    names = [f"s{i}" for i in range(4)]
    for name in names:
        await faulty.create(name, conversation=[Message.user(f"hi {name}", id="u1")])
        await faulty.request_run(name)
    faulty.faults.load = 3  # the first three runs fail, whichever sessions they are
    served = await serve_until(
        faulty, FunctionModel(echo), lambda served: set(served) == set(names), workers=2
    )
    assert sorted(served) == names
    for name in names:
        assert (await faulty.load(name)).conversation[-1].text == f"re: hi {name}"


@pytest.mark.usefixtures("quick_backoff")
async def test_a_claim_that_failed_is_tried_again(faulty: Any) -> None:
    await faulty.create("s1", conversation=[Message.user("hello", id="u1")])
    await faulty.request_run("s1")
    faulty.faults.claim_next = 2
    with structlog.testing.capture_logs() as logs:
        served = await serve_until(faulty, FunctionModel(echo), lambda served: "s1" in served)
    assert served == ["s1"]
    assert faulty.faults.raised == ["claim_next", "claim_next"]
    assert [e["attempt"] for e in logs if e["event"] == "serve_claim_failed"] == [1, 2]


async def wait_for_event(logs: list[dict[str, Any]], name: str, stop: CancelToken) -> None:
    while not any(e["event"] == name for e in logs):  # noqa: ASYNC110 - the logger fills it
        await anyio.sleep(0.01)
    stop.cancel("seen")


@pytest.mark.usefixtures("quick_backoff")
@pytest.mark.parametrize("fault", ["bug", "transient_forever"])
async def test_a_run_that_fails_for_good_leaves_an_error_record(faulty: Any, fault: str) -> None:
    await faulty.create("s1", conversation=[Message.user("hello", id="u1")])
    await faulty.request_run("s1")
    calls: list[int] = []

    def broken(request: Any) -> Any:
        calls.append(1)
        raise RuntimeError("a bug in the model adapter")

    if fault == "transient_forever":
        faulty.faults.load = 10_000
    model = FunctionModel(echo if fault == "transient_forever" else broken)
    stop = CancelToken()
    runtime = Runtime(store=faulty, model=model)
    with structlog.testing.capture_logs() as logs, anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_for_event, logs, "serve_run_failed", stop)
            await run_worker(StateMachine([ModelInference()]), runtime, stop=stop, poll=0.01, ttl=5)
    failed = [e for e in logs if e["event"] == "serve_run_failed"]
    assert len(failed) == 1
    assert failed[0]["log_level"] == "error"
    assert failed[0]["session_id"] == "s1"
    assert failed[0]["retried"] is False
    retried = [e for e in logs if e["event"] == "serve_run_retried"]
    if fault == "bug":
        assert failed[0]["attempts"] == 1
        assert not retried
        assert calls  # the model was called and raised
    else:
        assert failed[0]["error_type"] == "OSError"
        assert failed[0]["attempts"] == transient.MAX_ATTEMPTS
        assert [e["attempt"] for e in retried] == list(range(1, transient.MAX_ATTEMPTS))
    faulty.faults.load = 0
    assert await faulty.claim_next("probe", 5.0) is None  # not pending: failed, and said so


def test_transient_errors_are_the_store_faults() -> None:
    import psycopg

    for exc in (
        OSError("disk"),
        ConnectionResetError(),
        TimeoutError(),
        psycopg.OperationalError("server closed the connection"),
        psycopg.errors.AdminShutdown("terminating connection"),
        LeaseLostError("s1", "w", 3, "expired"),
        ConflictError("s1", 4, 5),
        ExceptionGroup("two", [OSError(), psycopg.OperationalError()]),
    ):
        assert transient.is_transient(exc), exc
    for exc in (
        StoredDataError("bad row"),
        ConfigurationError("no"),
        StoreClosedError("closed"),
        ValueError("a bug"),
        psycopg.errors.UniqueViolation("dup"),
        ExceptionGroup("mixed", [OSError(), ValueError()]),
        KeyboardInterrupt(),
        SystemExit(),
    ):
        assert not transient.is_transient(exc), exc


@given(st.integers(min_value=1, max_value=10_000), st.randoms(use_true_random=False))
def test_backoff_is_bounded_and_grows(attempt: int, rng: Any) -> None:
    delay = transient.backoff(attempt, rng=rng)
    assert transient.BACKOFF_FIRST / 2 <= delay <= transient.BACKOFF_CAP
    full = min(transient.BACKOFF_CAP, transient.BACKOFF_FIRST * 2 ** min(attempt - 1, 32))
    assert full / 2 <= delay <= full


def held_or_marked(store: Any, session_id: str) -> bool:
    """Whether the session's turn is kept right now: its lease held (or lapsing unreleased)
    or its pending-run mark set. Read synchronously, from inside a log call."""
    if isinstance(store, MemoryStore):
        slot = store._leases._slots.get(session_id)
        return slot is not None and (slot.owner is not None or slot.requested)
    name = base64.b32encode(session_id.encode()).decode().rstrip("=").lower()
    folder = Path(store._leases.folder)
    return (folder / "held" / name).exists() or (folder / "runs" / name).exists()


@pytest.mark.usefixtures("quick_backoff")
async def test_a_turn_being_retried_is_held_or_marked_at_every_record(faulty: Any) -> None:
    """At each retry record (where a worker may be killed) and after each run, the turn is
    kept: a worker killed at that instant leaves it to the next claimer."""
    await faulty.create("s1", conversation=[Message.user("hello", id="u1")])
    await faulty.request_run("s1")
    faulty.faults.load = 3
    kept: list[bool] = []

    def look(logger: Any, name: str, event: dict[str, Any]) -> Any:
        if event.get("event") in ("serve_run_retried", "serve_run_failed"):
            kept.append(held_or_marked(faulty, "s1"))
        return event

    structlog.configure(processors=[look, structlog.testing.LogCapture()])
    try:
        served = await serve_until(faulty, FunctionModel(echo), lambda served: "s1" in served)
    finally:
        structlog.reset_defaults()
    assert served == ["s1"]
    assert kept == [True, True, True]
    assert await faulty.claim_next("probe", 5.0) is None  # served, released, nothing left


def test_the_detail_of_an_error_is_cut_and_a_providers_message_is_content() -> None:
    from stepmachine.providers import BadRequestError

    long = RuntimeError("x" * (transient.DETAIL_LIMIT + 500))
    cut = transient.describe(long, content=False)
    assert cut.startswith("x" * transient.DETAIL_LIMIT)
    assert cut.endswith("(500 more characters)")
    provider = BadRequestError(
        "messages.0: PROMPT-of-Alice is too long", provider="openai", status=400, kind="bad"
    )
    assert "PROMPT" not in transient.describe(provider, content=False)
    assert "400" in transient.describe(provider, content=False)
    assert "PROMPT-of-Alice" in transient.describe(provider, content=True)

    def inner() -> None:
        raise ValueError("deep")

    try:
        inner()
    except ValueError as exc:
        where = transient.raised_at(exc)
    assert where.startswith(f"{__file__}:")
    assert " in inner <- " in where


# -- serve(): the record of a run that failed for good ----------------------------------


async def _serve_until_failed(store: Any, model: Any) -> list[dict[str, Any]]:
    stop = CancelToken()
    runtime = Runtime(store=store, model=model)

    async def watch(logs: list[dict[str, Any]]) -> None:
        while not any(e["event"] == "serve_run_failed" for e in logs):  # noqa: ASYNC110
            await anyio.sleep(0.01)
        stop.cancel("seen")

    with structlog.testing.capture_logs() as logs, anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch, logs)
            await run_worker(StateMachine([ModelInference()]), runtime, stop=stop, poll=0.01, ttl=5)
    return logs


async def test_the_error_record_of_a_failed_run_says_what_failed() -> None:
    store = MemoryStore()
    await store.create("s1", conversation=[Message.user("hello", id="u1")])
    await store.request_run("s1")

    def broken(request: Any) -> Any:
        raise RuntimeError("the adapter's config is missing field 'region'")

    logs = await _serve_until_failed(store, FunctionModel(broken))
    errors = [e for e in logs if e.get("log_level") in ("error", "critical")]
    assert errors
    assert any("region" in repr(e) for e in errors), errors


@pytest.mark.usefixtures("quick_backoff")
async def test_a_permanent_fault_that_looks_transient_gives_up_with_an_error(
    tmp_path: Path,
) -> None:
    """A FileStore session whose log is a directory (a permanent fault of the store):
    serve() gives up within the bounded number of tries with one ERROR record (no spin)."""
    folder = tmp_path / "store"
    async with await FileStore.open(folder) as store:
        await store.create("s1", conversation=[Message.user("hello", id="u1")])
        await store.request_run("s1")
    log = next(p for p in folder.iterdir() if p.suffix == ".log")
    log.unlink()
    log.mkdir()
    async with await FileStore.open(folder) as store:
        logs = await _serve_until_failed(store, FunctionModel(echo))
    failed = [e for e in logs if e["event"] == "serve_run_failed"]
    assert len(failed) == 1
    retried = [e for e in logs if e["event"] == "serve_run_retried"]
    assert len(retried) < transient.MAX_ATTEMPTS


# -- serve(): a worker SIGKILLed during its backoff ----------------------------------------


async def _open(kind: str, tmp_path: Path) -> Any:
    if kind == "file":
        return await FileStore.open(tmp_path / "files")
    return await SQLiteStore.open(tmp_path / "db.sqlite3")


SERVE_CHILD = Path(__file__).parent / "_serve_child.py"


@pytest.mark.parametrize("kind", ["file", "sqlite"])
async def test_a_worker_killed_during_its_backoff_leaves_the_turn_to_another(
    kind: str, tmp_path: Path
) -> None:
    """The child's run fails transiently, it parks the turn for 60 s and is SIGKILLed:
    a new worker serves the turn (not after the dead worker's backoff)."""
    await _killed_in_backoff(kind, tmp_path, "later")


@pytest.mark.parametrize("kind", ["file", "sqlite"])
async def test_a_worker_killed_as_it_logs_the_retry_leaves_the_turn_to_another(
    kind: str, tmp_path: Path
) -> None:
    await _killed_in_backoff(kind, tmp_path, "at-log")


async def _killed_in_backoff(kind: str, tmp_path: Path, when: str) -> None:
    path = tmp_path / ("files" if kind == "file" else "db.sqlite3")
    store = await _open(kind, tmp_path)
    await store.create("s1", conversation=[Message.user("hello", id="u1")])
    await store.request_run("s1")
    await store.aclose()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen(  # noqa: ASYNC220 - started once, read in a thread
        [sys.executable, str(SERVE_CHILD), kind, str(path), when],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        assert child.stdout is not None
        line = b""
        with anyio.fail_after(65):
            while b"backing-off" not in line and time.monotonic() < deadline:
                line = await anyio.to_thread.run_sync(child.stdout.readline)
                if not line and child.poll() is not None:
                    pytest.fail(f"child exited: {child.stderr.read().decode()[-2000:]}")
        if when == "later":
            await anyio.sleep(2)  # the turn is parked (held by the child) by now
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        for pipe in (child.stdout, child.stderr):
            if pipe is not None:
                pipe.close()
    served: list[str] = []
    stop = CancelToken()

    def seen(report: Any) -> None:
        served.append(report.session.id)
        stop.cancel("done")

    store = await _open(kind, tmp_path)
    try:
        runtime = Runtime(store=store, model=FunctionModel(echo))
        with structlog.testing.capture_logs() as logs, anyio.move_on_after(30):
            await run_worker(
                StateMachine([ModelInference()]),
                runtime,
                stop=stop,
                poll=0.05,
                ttl=5,
                on_report=seen,
            )
        assert served == ["s1"], logs[:5]
        assert (await store.load("s1")).conversation[-1].text == "re: hello"
    finally:
        await store.aclose()
