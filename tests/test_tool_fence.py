"""A tool batch under a lease: no tool starts once the lease is gone, and errors come out bare.

- The fence is checked right before each non-idempotent tool starts (a store
  read: ``renew``), so a worker that lost its lease between committing the
  intent and starting the tool does not start it (at most once where it
  matters): ``run()`` raises ``LeaseLostError``. A few store faults of that
  check are waited out (``MAX_STORE_FAULTS``), then it is asked again. Unit
  tests take the lease away in process; one test pauses a real worker process
  (SIGSTOP) on PostgreSQL.
- Errors of parallel tool calls (a lost lease, a store error, a contract error)
  leave ``run()`` as the error itself, never as an ``ExceptionGroup``; which one
  wins is documented on ``Tools`` and checked here with hypothesis.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream
from hypothesis import given
from hypothesis import strategies as st

from stepmachine import (
    CancelToken,
    ConflictError,
    LeaseLostError,
    LeasePolicy,
    Message,
    ModelInference,
    Runtime,
    StateMachine,
    StepApplied,
    StoreClosedError,
    ToolResultPart,
    Tools,
    run_worker,
    tool,
)
from stepmachine import _transient as transient
from stepmachine._retry import MAX_STORE_FAULTS
from stepmachine.extend import OUTCOME_UNKNOWN, Lease, new_owner
from stepmachine.stores import MemoryStore
from stepmachine.testing import FunctionModel, call, reply

CHILD = Path(__file__).with_name("_tool_fence_child.py")
ROOT = Path(__file__).resolve().parents[1]


def model(*calls: dict[str, Any]) -> FunctionModel:
    def answer(request: Any) -> Any:
        if request.messages[-1].role == "user":
            return call(*(("charge", arguments) for arguments in calls))
        return reply("paid")

    return FunctionModel(answer)


class TakeOverAt:
    """An emitter that, at the first event ``when`` accepts, hands the session to another
    owner: the run's lease is released behind its back and claimed by ``second:``."""

    def __init__(self, store: MemoryStore, lease: Lease, when: Any) -> None:
        self.store, self.lease, self.when = store, lease, when
        self.taken: Lease | None = None

    async def emit(self, event: Any) -> None:
        if self.taken is None and self.when(event.data):
            await self.store.release(self.lease)
            got = await self.store.claim(self.lease.session_id, new_owner("second:"), 30.0)
            assert isinstance(got, Lease)
            self.taken = got


def after_intent(event: Any) -> bool:
    return isinstance(event, StepApplied) and event.status == "committed"


async def leased_session(store: MemoryStore) -> Lease:
    await store.create("s", conversation=[Message.user("pay", id="u1")])
    lease = await store.claim("s", new_owner("first:"), 30.0)
    assert isinstance(lease, Lease)
    return lease


@pytest.mark.parametrize("amounts", [[1], [1, 2]], ids=["one call", "parallel calls"])
async def test_no_non_idempotent_tool_starts_after_the_lease_was_lost(amounts: list[int]) -> None:
    """The lease goes between the intent commit and the tool start: nothing starts."""
    store = MemoryStore()
    lease = await leased_session(store)
    charged: list[int] = []

    def charge(amount: int) -> str:
        """Charge the card (non-idempotent)."""
        charged.append(amount)
        return "charged"

    machine = StateMachine([Tools([tool(charge)]), ModelInference()])
    runtime = Runtime(store=store, model=model(*({"amount": a} for a in amounts)))
    emitter = TakeOverAt(store, lease, after_intent)
    with pytest.raises(LeaseLostError) as raised:
        await machine.run(runtime, "s", emitter, lease=lease)
    assert charged == []
    assert type(raised.value) is LeaseLostError
    assert "was not started" in str(raised.value)
    stored = await store.load("s")
    assert [m.role for m in stored.conversation] == ["user", "assistant"]  # no result written


# -- a renew that fails right before the tool; one of parallel fence checks losing -------------


@pytest.fixture
def quick_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transient, "BACKOFF_FIRST", 0.01)
    monkeypatch.setattr(transient, "BACKOFF_CAP", 0.05)


class FlakyRenew(MemoryStore):
    """A memory store whose ``renew`` raises what ``self.fail`` gives, while it gives one."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail: list[BaseException | None] = []
        self.renews = 0

    async def renew(self, lease: Lease) -> Lease:
        self.renews += 1
        if self.fail:
            error = self.fail.pop(0)
            if error is not None:
                raise error
        return await super().renew(lease)


def _charge_model(n: int) -> FunctionModel:
    def answer(request: Any) -> Any:
        if request.messages[-1].role == "user":
            return call(*(("charge", {"amount": a}) for a in range(1, n + 1)))
        return reply("paid")

    return FunctionModel(answer)


@pytest.mark.usefixtures("quick_backoff")
@pytest.mark.parametrize("faults", [1, MAX_STORE_FAULTS, MAX_STORE_FAULTS + 1])
@pytest.mark.parametrize("expiring", [False, True], ids=["held", "expiring"])
async def test_a_renew_that_fails_transiently_right_before_the_tool(
    expiring: bool, faults: int
) -> None:
    """The confirm round trip raises OSError. Up to ``MAX_STORE_FAULTS`` of them are
    waited out and the lease asked again: the tool runs once, its real result recorded.
    One more: the tool is not started, serve() runs the turn again, and the call ends
    with exactly one result (outcome unknown: an intent without a result), the tool
    never run, the turn finished."""
    store = FlakyRenew(expiring_leases=expiring)
    await store.create("s", conversation=[Message.user("pay", id="u1")])
    await store.request_run("s")
    charged: list[int] = []

    def charge(amount: int) -> str:
        """Charge the card (non-idempotent)."""
        charged.append(amount)
        return "charged"

    store.fail = [OSError(5, "injected: the store did not answer the renew") for _ in range(faults)]
    stop = CancelToken()
    reports: list[Any] = []

    def seen(report: Any) -> None:
        reports.append(report)
        stop.cancel("done")

    runtime = Runtime(store=store, model=_charge_model(1))
    machine = StateMachine([Tools([tool(charge)]), ModelInference()])
    with structlog.testing.capture_logs() as logs, anyio.fail_after(30):
        await run_worker(machine, runtime, stop=stop, poll=0.01, ttl=5, on_report=seen)
    assert store.fail == []  # every fault was met
    session = await store.load("s")
    results = [p for m in session.conversation for p in m.parts if isinstance(p, ToolResultPart)]
    assert len(results) == 1
    assert session.conversation[-1].text == "paid"
    retried = [e["error_type"] for e in logs if e["event"] == "serve_run_retried"]
    if faults <= MAX_STORE_FAULTS:
        assert charged == [1]
        assert (results[0].content, results[0].is_error) == ("charged", False)
        assert retried == []
    else:
        assert charged == [], "the tool started although its lease was not confirmed"
        assert results[0].is_error
        assert retried == ["OSError"]


async def test_parallel_calls_where_one_fence_check_finds_the_lease_lost() -> None:
    """Two non-idempotent calls; the second's confirm finds the lease gone: run() raises
    one LeaseLostError (no group), the second tool never starts, the first at most once."""
    store = FlakyRenew()
    await store.create("s", conversation=[Message.user("pay", id="u1")])
    lease = await store.claim("s", new_owner("first:"), 30.0)
    assert isinstance(lease, Lease)
    charged: list[int] = []

    async def charge(amount: int) -> str:
        """Charge the card (non-idempotent)."""
        charged.append(amount)
        await anyio.sleep(0.05)
        return "charged"

    store.fail = [None, LeaseLostError("s", lease.owner, lease.epoch, "taken over (injected)")]
    machine = StateMachine([Tools([tool(charge)]), ModelInference()])
    runtime = Runtime(store=store, model=_charge_model(2))
    with anyio.fail_after(30), pytest.raises(LeaseLostError) as raised:
        await machine.run(runtime, "s", lease=lease)
    assert type(raised.value) is LeaseLostError
    assert len(charged) <= 1
    assert 2 not in charged or 1 not in charged


# -- no ExceptionGroup out of run() -------------------------------------------------------------


class FailingResults:
    """An effect handler that stores the first ``good`` batches, then raises ``error()``."""

    def __init__(self, store: MemoryStore, good: int, error: Any) -> None:
        self.store, self.good, self.error = store, good, error
        self.applies_batches = True

    async def apply(self, batch: Any) -> Any:
        if self.good <= 0:
            raise self.error()
        self.good -= 1
        return await self.store.apply(batch)


async def test_a_store_error_of_parallel_calls_leaves_run_as_itself() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("pay", id="u1")])

    def charge(amount: int) -> str:
        """Look up (pure)."""
        return "ok"

    machine = StateMachine([Tools([tool(side_effects="pure")(charge)]), ModelInference()])
    # Batch 1: the model's call; then every result write fails.
    handler = FailingResults(store, 1, lambda: StoreClosedError("the store was closed"))
    runtime = Runtime(
        store=store, handler=handler, model=model({"amount": 1}, {"amount": 2}, {"amount": 3})
    )
    with pytest.raises(StoreClosedError) as raised:
        await machine.run(runtime, "s")
    assert type(raised.value) is StoreClosedError
    # How many siblings failed too (rather than being cancelled) depends on the
    # backend's scheduling; each one that did is named in a note (see one_error).
    notes = getattr(raised.value, "__notes__", [])
    assert all("also raised StoreClosedError" in note for note in notes)


async def test_a_lost_lease_of_parallel_calls_leaves_run_as_itself() -> None:
    """Pure parallel calls run, then their result writes are refused: one LeaseLostError."""
    store = MemoryStore()
    lease = await leased_session(store)

    def charge(amount: int) -> str:
        """Look up (pure)."""
        return "ok"

    def started(event: Any) -> bool:
        return type(event).__name__ == "ToolStarted"

    machine = StateMachine([Tools([tool(side_effects="pure")(charge)]), ModelInference()])
    runtime = Runtime(store=store, model=model({"amount": 1}, {"amount": 2}))
    with pytest.raises(LeaseLostError) as raised:
        await machine.run(runtime, "s", TakeOverAt(store, lease, started), lease=lease)
    assert type(raised.value) is LeaseLostError


# -- which leaf wins -----------------------------------------------------------------------------


def leaf_errors() -> st.SearchStrategy[BaseException]:
    return st.sampled_from(
        [
            lambda: ConflictError("s", 1, 2),
            lambda: LeaseLostError("s", "o", 1, "taken"),
            lambda: StoreClosedError("closed"),
            lambda: ValueError("bad"),
            KeyboardInterrupt,
            asyncio.CancelledError,
        ]
    ).map(lambda make: make())


def groups() -> st.SearchStrategy[BaseExceptionGroup[BaseException]]:
    children = st.recursive(
        leaf_errors(),
        lambda inner: st.lists(inner, min_size=1, max_size=3).map(
            lambda items: BaseExceptionGroup("tasks", items)
        ),
        max_leaves=6,
    )
    return st.lists(children, min_size=1, max_size=4).map(
        lambda items: BaseExceptionGroup("unhandled errors in a TaskGroup", items)
    )


def leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for child in exc.exceptions for leaf in leaves(child)]
    return [exc]


@given(groups())
def test_one_error_is_a_leaf_chosen_by_the_documented_order(
    group: BaseExceptionGroup[BaseException],
) -> None:
    """Ctrl-C / SystemExit first, then the first error that is not a conflict, then a
    conflict, then a cancellation; the other leaves but cancellations are named in its
    notes."""
    from stepmachine._tool_step import one_error

    found = leaves(group)
    chosen = one_error(group)
    assert not isinstance(chosen, BaseExceptionGroup)
    assert any(chosen is leaf for leaf in found)
    interrupts = [e for e in found if isinstance(e, KeyboardInterrupt)]
    cancels = [e for e in found if isinstance(e, asyncio.CancelledError)]
    conflicts = [e for e in found if isinstance(e, ConflictError)]
    others = [e for e in found if isinstance(e, Exception) and e not in conflicts]
    expected = (interrupts or others or conflicts or cancels)[0]
    assert chosen is expected
    named = len(found) - len(cancels) - (0 if chosen in cancels else 1)
    assert len(getattr(chosen, "__notes__", [])) == named


# -- a real worker paused between the intent and the tool (PostgreSQL) -----------------------


async def read_line(stream: BufferedByteReceiveStream) -> dict[str, Any]:
    line: dict[str, Any] = json.loads(await stream.receive_until(b"\n", 1 << 16))
    return line


async def lease_free(store: Any) -> bool:
    got = await store.claim("s", new_owner("probe:"), 30.0)
    if isinstance(got, Lease):
        await store.release(got)
        return True
    return False


async def test_a_worker_paused_after_the_intent_never_starts_the_tool(
    postgres_dsn: str, anyio_backend: str
) -> None:
    """Worker A commits the intent and is stopped (SIGSTOP) past its lease's ttl; worker B
    takes over and answers the call "outcome unknown"; A, continued, must not run the tool."""
    pytest.importorskip("psycopg", reason="psycopg is not installed (the postgres extra)")
    from stepmachine.stores import PostgresStore

    async with await PostgresStore.open(postgres_dsn) as store:
        await store.create("s", conversation=[Message.user("pay", id="u1")])
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        process = await anyio.open_process(
            [sys.executable, str(CHILD), postgres_dsn, anyio_backend], env=env
        )
        out = BufferedByteReceiveStream(process.stdout)  # type: ignore[arg-type]
        charged_here: list[int] = []

        def charge(amount: int) -> str:
            """Charge the card (non-idempotent)."""
            charged_here.append(amount)
            return "charged here"

        try:
            with anyio.fail_after(60):  # a hang guard only
                assert await read_line(out) == {"intent": True}
                process.send_signal(signal.SIGSTOP)
                while not await lease_free(store):  # noqa: ASYNC110 - polls the store
                    await anyio.sleep(0.05)
                second = StateMachine(
                    [Tools([tool(charge)]), ModelInference()], lease=LeasePolicy(busy="fail")
                )
                taken_over = await second.run(Runtime(store=store, model=model()), "s")
                results = [r for m in taken_over.conversation for r in m.tool_results]
                assert [r.content for r in results] == [OUTCOME_UNKNOWN]
                assert process.stdin is not None
                await process.stdin.send(b"go\n")
                process.send_signal(signal.SIGCONT)
                lines = []
                while not lines or "ended" not in lines[-1]:
                    lines.append(await read_line(out))
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
            await process.aclose()
        assert {"charged": True} not in lines  # the stale worker never started the tool
        assert lines[-1] == {"ended": "LeaseLostError"}
        assert charged_here == []  # nor did the new holder (outcome unknown)
        final = await store.load("s")
        assert final.revision == taken_over.revision  # the stale worker wrote nothing
