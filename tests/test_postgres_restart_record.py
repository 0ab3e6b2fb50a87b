"""A task's record written across a real restart of its PostgreSQL server.

When a ``Tools`` step runs a tool (or ``ModelInference`` calls a model), the
machine writes the intents, runs the work, then writes the work's record
through ``retry_while_moving``, which waits out a few store faults and computes
the record again from the reloaded session each time. Here the faults are real:
a throwaway server of this module's own (``_postgres.throwaway_server``) is
restarted with ``pg_ctl restart -m fast`` and ``-m immediate``:

- by the work itself (the tool's body, the model's request): the record is then
  written on connections the restart ended, which the pool's check replaces;
- inside the record's own write (:class:`ArmedStore`): at ``apply.begin`` (the
  transaction's statements then fail: nothing was written), at
  ``apply.committed`` (the batch is stored, and the next statement on the
  connection fails: the write's reply is lost), or ``restarting`` (the restart
  runs on in another thread while the write is retried: the pool waits for the
  server). The write's store fault is counted, and each test asserts it was
  seen, so the restart did land in the write;
- inside the lease's confirmation right before a non-idempotent tool starts
  (:class:`ConfirmRestartingStore`), after its intents are stored.

Each time the session holds exactly one result for the call (or one reply),
with the real content, and nothing more is written for it; the tool ran (the
model was asked) exactly once; a later ``machine.run()`` runs nothing again.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import _postgres
import anyio
import pytest

from stepmachine import (
    Message,
    ModelInference,
    Runtime,
    Session,
    StateMachine,
    Tool,
    Tools,
    tool,
)
from stepmachine._retry import MAX_STORE_FAULTS
from stepmachine.extend import Batch, history_problems, open_tool_calls
from stepmachine.stores import PostgresStore
from stepmachine.testing import ScriptedModel, call, reply

pytestmark = pytest.mark.postgres

MODES = ["fast", "immediate"]
Where = Literal["apply.begin", "apply.committed", "restarting"]
WHERES: list[Where] = ["apply.begin", "apply.committed", "restarting"]


@pytest.fixture(scope="module")
def server(restartable_postgres: _postgres.Server) -> _postgres.Server:
    """A throwaway server of this module's own (it is restarted)."""
    return restartable_postgres


@pytest.fixture
def dsn(server: _postgres.Server) -> Iterator[str]:
    with _postgres.fresh_database(server.dsn, prefix="stepmachine_restart_record") as made:
        yield made


@dataclass
class Restarts:
    """Restarts of one server, each timed (seconds)."""

    server: _postgres.Server
    mode: str
    took: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    threads: list[threading.Thread] = field(default_factory=list)

    def now(self) -> None:
        """Restart the server (blocking: call it in a worker thread)."""
        began = time.monotonic()
        _postgres.restart(self.server, self.mode)
        with self.lock:
            self.took.append(time.monotonic() - began)

    def start(self) -> None:
        """Start a restart in a thread of its own (:meth:`join` waits for it)."""
        thread = threading.Thread(target=self.now, name="pg-restart", daemon=True)
        self.threads.append(thread)
        thread.start()

    def join(self) -> None:
        """Wait for the restarts started with :meth:`start`."""
        for thread in self.threads:
            thread.join()


class ArmedStore(PostgresStore):
    """A PostgresStore whose next write, once armed, meets a real restart.

    ``armed`` names the boundary of :meth:`apply` where the server is restarted,
    inside the write's own connection: ``apply.begin`` (before any statement:
    the transaction fails, nothing is written), ``apply.committed`` (after
    ``COMMIT``: a statement on the ended connection fails, so the caller loses
    the reply of a write that is stored), or ``restarting`` (at ``apply.begin``
    a restart starts in another thread and the transaction goes on until the
    server ends it: the write is waited out while the server is still down or
    recovering). It fires once. ``faults`` lists the store faults :meth:`apply`
    and :meth:`load` raised (``"<step or load>: <error type>"``).
    """

    restarts: Restarts
    armed: Where | None
    faults: list[str]
    _local: threading.local

    @classmethod
    async def open_armed(cls, dsn: str, restarts: Restarts) -> ArmedStore:
        box: list[ArmedStore] = []

        def hook(name: str) -> None:
            box[0].boundary(name)

        store = await cls.open(dsn, boundary_hook=hook)
        assert isinstance(store, ArmedStore)
        store.restarts, store.armed, store.faults = restarts, None, []
        store._local = threading.local()
        box.append(store)
        return store

    async def _run(self, function: Callable[[Any], Any]) -> Any:
        def tracked(connection: Any) -> Any:
            self._local.connection = connection  # the worker thread's connection, for boundary()
            return function(connection)

        return await super()._run(tracked)

    def boundary(self, name: str) -> None:
        """At ``name`` (in the worker thread, in the write's connection): restart if armed."""
        if name != ("apply.begin" if self.armed == "restarting" else self.armed):
            return
        armed, self.armed = self.armed, None
        if armed == "restarting":
            self.restarts.start()
            while True:  # raises once the shutdown ends this connection
                self._local.connection.execute("SELECT pg_sleep(0.01)")
        self.restarts.now()
        if name == "apply.committed":  # the batch is stored; the write's reply is lost
            self._local.connection.execute("SELECT 1")  # raises: the restart ended it

    async def apply(self, batch: Batch[Any], *, lease: Any = None) -> Session[Any]:
        try:
            return await super().apply(batch, lease=lease)
        except Exception as exc:
            if _store_fault(exc):
                self.faults.append(f"{batch.step}: {type(exc).__name__}")
            raise

    async def load(self, session_id: str) -> Session[Any]:
        try:
            return await super().load(session_id)
        except Exception as exc:
            if _store_fault(exc):
                self.faults.append(f"load: {type(exc).__name__}")
            raise


def _store_fault(exc: BaseException) -> bool:
    import psycopg

    return isinstance(exc, psycopg.OperationalError | OSError)


@contextlib.asynccontextmanager
async def armed_store(dsn: str, restarts: Restarts) -> AsyncIterator[ArmedStore]:
    store = await ArmedStore.open_armed(dsn, restarts)
    try:
        await store.create("s", conversation=[Message.user("go", id="u1")])
        yield store
    finally:
        restarts.join()
        await store.aclose()


def assert_faults_waited_out(faults: list[str], step: str, where: Where) -> None:
    """The record's first write failed on the restart; every fault was waited out."""
    assert faults, "the restart did not land in the record's write"
    assert faults[0].startswith(f"{step}: ")
    if where == "restarting":  # the server may still be down: the pool waits for it
        assert len(faults) <= MAX_STORE_FAULTS
    else:  # the server is up again when the fault is raised: one fault
        assert len(faults) == 1, faults


def results_of(session: Session[Any]) -> dict[str, list[tuple[str, bool]]]:
    """Every tool result of the session, by call id: ``(content, is_error)``."""
    assert history_problems(session.conversation) == []
    assert open_tool_calls(session.conversation) == []
    results: dict[str, list[tuple[str, bool]]] = {}
    for message in session.conversation:
        for result in message.tool_results:
            results.setdefault(result.call_id, []).append((result.content, result.is_error))
    return results


def only_call_id(session: Session[Any]) -> str:
    (call_id,) = [c.call_id for m in session.conversation for c in m.tool_calls]
    return call_id


def texts(session: Session[Any], role: str) -> list[str]:
    return [m.text for m in session.conversation if m.role == role]


def restarting_tool(kind: str, side_effects: str, ran: list[int], work: Callable[[], None]) -> Tool:
    """A ``charge`` tool that does ``work`` (in a worker thread), counts its run, returns."""
    if kind == "sync":

        def charge(amount: int) -> str:
            """Charge (in a worker thread)."""
            work()
            ran.append(amount)
            return f"charged {amount}"

        return tool(charge, side_effects=side_effects)  # type: ignore[arg-type]

    async def charge_async(amount: int) -> str:
        """Charge."""
        await anyio.to_thread.run_sync(work)
        ran.append(amount)
        return f"charged {amount}"

    return tool(charge_async, name="charge", side_effects=side_effects)  # type: ignore[arg-type]


async def run_and_check_tool(store: ArmedStore, charge: Tool, ran: list[int]) -> Session[Any]:
    """Run the call-then-reply script; check one real result and one run, twice over."""
    machine = StateMachine([Tools([charge]), ModelInference(stream=False)])
    model = ScriptedModel([call(("charge", {"amount": 7})), reply("paid")])
    runtime = Runtime(store=store, model=model)
    with anyio.fail_after(120):  # a guard against a hang, not a timing threshold
        session = await machine.run(runtime, "s")
    assert ran == [7]
    assert results_of(session) == {only_call_id(session): [("charged 7", False)]}
    assert texts(session, "assistant")[-1] == "paid"
    assert session == await store.load("s")
    model.assert_all_used()
    # Run again (a fresh machine and runtime): nothing is run or asked again (the
    # script is spent: another model call would raise).
    again = StateMachine([Tools([charge]), ModelInference(stream=False)])
    with anyio.fail_after(120):
        rerun = await again.run(Runtime(store=store, model=ScriptedModel([])), "s")
    assert ran == [7]
    assert rerun.revision == session.revision
    return session


@pytest.mark.parametrize("side_effects", ["non_idempotent", "idempotent"])
@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("mode", MODES)
async def test_a_tool_that_restarts_the_server_is_recorded_once(
    server: _postgres.Server, dsn: str, mode: str, kind: str, side_effects: str
) -> None:
    restarts = Restarts(server, mode)
    ran: list[int] = []
    async with armed_store(dsn, restarts) as store:
        charge = restarting_tool(kind, side_effects, ran, restarts.now)
        await run_and_check_tool(store, charge, ran)
    assert len(restarts.took) == 1


@pytest.mark.parametrize("where", WHERES)
@pytest.mark.parametrize("side_effects", ["non_idempotent", "idempotent"])
@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("mode", MODES)
async def test_a_tool_result_whose_write_meets_a_restart_is_recorded_once(
    server: _postgres.Server, dsn: str, mode: str, kind: str, side_effects: str, where: Where
) -> None:
    restarts = Restarts(server, mode)
    ran: list[int] = []
    async with armed_store(dsn, restarts) as store:

        def arm() -> None:
            store.armed = where  # the tool's record is the store's next write

        charge = restarting_tool(kind, side_effects, ran, arm)
        await run_and_check_tool(store, charge, ran)
        restarts.join()
        assert len(restarts.took) == 1
        # The record's first write failed on the restart, and was waited out.
        assert_faults_waited_out(store.faults, "tools", where)
        # The call, the intents (a non-idempotent tool's), the record (stored once), the reply.
        intents = ["tools"] if side_effects == "non_idempotent" else []
        steps = [b.step for b in await store.batches("s")]
        assert steps == ["inference", *intents, "tools", "inference"]


class ConfirmRestartingStore(ArmedStore):
    """An :class:`ArmedStore` whose next lease renewal, once ``renew_armed``, meets a real
    restart: the confirmation right before a non-idempotent tool starts (the run's
    background renewal comes every ``ttl / 3``, 10 s by default, after this run ends)."""

    renew_armed = False

    async def renew(self, lease: Any) -> Any:
        if self.renew_armed:
            self.renew_armed = False
            try:
                await anyio.to_thread.run_sync(self._query_across_a_restart)
            except Exception as exc:
                if _store_fault(exc):
                    self.faults.append(f"renew: {type(exc).__name__}")
                raise
        return await super().renew(lease)

    def _query_across_a_restart(self) -> None:
        assert self._pool is not None
        with self._pool.connection() as conn:
            self.restarts.now()
            conn.execute("SELECT 1")  # raises: the server ended this connection


class ArmingModel(ScriptedModel):
    """A scripted model whose first request, once answered, runs ``arm``."""

    def __init__(self, turns: list[Any], arm: Callable[[], None]) -> None:
        super().__init__(turns)
        self.arm = arm

    async def request(self, request: Any, *, on_chunk: Any = None) -> Any:
        response = await super().request(request, on_chunk=on_chunk)
        if len(self.requests) == 1:
            self.arm()
        return response


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("mode", MODES)
async def test_a_non_idempotent_tool_whose_lease_confirmation_meets_a_restart_runs_once(
    server: _postgres.Server, dsn: str, mode: str, kind: str
) -> None:
    """The intents are stored, then the lease's confirmation fails on the restart: it is
    waited out and asked again, and the tool runs once. (The fault ended the run, and the
    next run answered the call ``outcome unknown`` without running it, though it had
    never started.)"""
    restarts = Restarts(server, mode)
    store = await ConfirmRestartingStore.open_armed(dsn, restarts)
    assert isinstance(store, ConfirmRestartingStore)
    try:
        await store.create("s", conversation=[Message.user("go", id="u1")])
        ran: list[int] = []
        charge = restarting_tool(kind, "non_idempotent", ran, lambda: None)
        machine = StateMachine([Tools([charge]), ModelInference(stream=False)])

        def arm() -> None:
            store.renew_armed = True

        model = ArmingModel([call(("charge", {"amount": 7})), reply("paid")], arm)
        with anyio.fail_after(120):  # a guard against a hang, not a timing threshold
            session = await machine.run(Runtime(store=store, model=model), "s")
        (fault,) = store.faults  # the confirmation failed on the restart, then was asked again
        assert fault.startswith("renew: ")
        assert len(restarts.took) == 1
        assert ran == [7]
        assert results_of(session) == {only_call_id(session): [("charged 7", False)]}
        with anyio.fail_after(120):
            rerun = await machine.run(Runtime(store=store, model=ScriptedModel([])), "s")
        assert ran == [7]
        assert rerun.revision == session.revision
    finally:
        await store.aclose()


class RestartingModel(ScriptedModel):
    """A scripted model whose first request runs ``work`` (in a worker thread) first."""

    def __init__(self, work: Callable[[], None]) -> None:
        super().__init__([reply("hello")])
        self.work = work

    async def request(self, request: Any, *, on_chunk: Any = None) -> Any:
        if not self.requests:
            await anyio.to_thread.run_sync(self.work)
        return await super().request(request, on_chunk=on_chunk)


async def run_and_check_reply(store: ArmedStore, model: RestartingModel) -> None:
    machine = StateMachine([ModelInference(stream=False)])
    with anyio.fail_after(120):  # a guard against a hang, not a timing threshold
        session = await machine.run(Runtime(store=store, model=model), "s")
    assert len(model.requests) == 1
    assert texts(session, "assistant") == ["hello"]
    assert session == await store.load("s")
    with anyio.fail_after(120):
        rerun = await machine.run(Runtime(store=store, model=ScriptedModel([])), "s")
    assert rerun.revision == session.revision
    assert texts(rerun, "assistant") == ["hello"]


@pytest.mark.parametrize("mode", MODES)
async def test_a_model_that_restarts_the_server_has_its_reply_kept(
    server: _postgres.Server, dsn: str, mode: str
) -> None:
    restarts = Restarts(server, mode)
    async with armed_store(dsn, restarts) as store:
        await run_and_check_reply(store, RestartingModel(restarts.now))
    assert len(restarts.took) == 1


@pytest.mark.parametrize("where", WHERES)
@pytest.mark.parametrize("mode", MODES)
async def test_a_model_reply_whose_write_meets_a_restart_is_kept(
    server: _postgres.Server, dsn: str, mode: str, where: Where
) -> None:
    restarts = Restarts(server, mode)
    async with armed_store(dsn, restarts) as store:

        def arm() -> None:
            store.armed = where  # the reply's record is the store's next write

        await run_and_check_reply(store, RestartingModel(arm))
        restarts.join()
        assert len(restarts.took) == 1
        assert_faults_waited_out(store.faults, "inference", where)
        batches = await store.batches("s")
        steps = [(b.step, [type(e).__name__ for e in b.effects]) for b in batches]
        assert steps == [("inference", ["AppendMessage"])]  # stored once, nothing more
