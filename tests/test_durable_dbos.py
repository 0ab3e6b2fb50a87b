"""Durable turns on DBOS (stepmachine.durable): serializer, configuration, trio refusal, real runs.

DBOS Transact is asyncio-only, so the tests that launch DBOS run on asyncio alone
(``anyio_backend`` pinned to ``"asyncio"``, each saying so); under trio the entry
points must refuse, which ``test_entry_points_refuse_trio`` checks. The crash tests
run ``tests/harness/dbos_crash.py`` (worker processes on a real PostgreSQL, SIGKILLed
mid-turn) and are synchronous: the harness runs its own event loops.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import dbos_crash  # tests/harness, on sys.path
import msgspec
import pytest
import structlog
from dbos import DBOS, DBOSConfig
from dbos._serialization import DefaultSerializer
from hypothesis import given
from hypothesis import strategies as st

from stepmachine import (
    AppendMessage,
    ConfigurationError,
    ConflictError,
    Effect,
    Message,
    ModelError,
    ModelInference,
    ModelRequest,
    ModelResponse,
    Runtime,
    Session,
    StateMachine,
    ToolContext,
    Tools,
    submit,
    tool,
)
from stepmachine._durable_codec import _sqlite_system_database_problem
from stepmachine.durable import (
    CYCLE_STEP,
    SERIALIZER_NAME,
    TURN_START_STEP,
    CycleSummary,
    DurableMachine,
    DurableTurnError,
    MsgspecSerializer,
    TurnReport,
    dbos_config,
)
from stepmachine.extend import Batch, history_problems
from stepmachine.stores import MemoryStore, PostgresStore
from stepmachine.testing import FunctionModel, call, reply

# -- the serializer -------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
    max_leaves=20,
)


@given(json_values)
def test_serializer_round_trips_json_values(value: Any) -> None:
    serializer = MsgspecSerializer()
    text = serializer.serialize(value)
    assert json.loads(text) == value  # plain JSON text, readable by anyone
    assert serializer.deserialize(text) == value


def test_serializer_writes_structs_and_tuples_as_json_builtins() -> None:
    serializer = MsgspecSerializer()
    summary = CycleSummary(cycle=1, revision=3, status="yielded", step="inference", reason="done")
    text = serializer.serialize({"args": ("s1",), "kwargs": {}, "summary": summary})
    assert serializer.deserialize(text) == {
        "args": ["s1"],
        "kwargs": {},
        "summary": msgspec.to_builtins(summary),
    }
    assert msgspec.convert(serializer.deserialize(text)["summary"], CycleSummary) == summary
    assert serializer.name() == SERIALIZER_NAME


def test_serializer_keeps_only_an_errors_type_and_message() -> None:
    serializer = MsgspecSerializer()
    error = serializer.deserialize(serializer.serialize(ModelError("the model said no")))
    assert isinstance(error, DurableTurnError)
    assert (error.error_type, error.message) == ("ModelError", "the model said no")
    again = serializer.deserialize(serializer.serialize(error))  # a recorded error re-recorded
    assert (again.error_type, again.message) == ("ModelError", "the model said no")


def test_serializer_refuses_what_msgspec_cannot_encode() -> None:
    with pytest.raises(TypeError, match="MsgspecSerializer"):
        MsgspecSerializer().serialize({"x": object()})


def test_serializer_never_unpickles() -> None:
    """A pickle DBOS's default serializer wrote is not JSON: reading it fails, nothing runs."""
    pickled = DefaultSerializer().serialize({"args": ("s1",), "kwargs": {}})
    with pytest.raises(msgspec.DecodeError):
        MsgspecSerializer().deserialize(pickled)


def test_dbos_config_puts_the_msgspec_serializer_in() -> None:
    config = dbos_config("app", "postgresql://u@h/db", executor_id="worker-1", log_level="ERROR")
    assert isinstance(config["serializer"], MsgspecSerializer)
    assert config["executor_id"] == "worker-1"
    assert config["log_level"] == "ERROR"
    assert "application_version" not in config
    with pytest.raises(ConfigurationError, match="msgspec"):
        dbos_config("app", "postgresql://u@h/db", serializer=DefaultSerializer())


def test_a_postgresql_system_database_is_never_checked_as_sqlite(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dbos._migration

    monkeypatch.setattr(dbos._migration, "get_sqlite_timestamp_expr", lambda: "(NULL)")
    assert _sqlite_system_database_problem("postgresql://u@h/db") is None
    assert _sqlite_system_database_problem("sqlite:///sys.sqlite3") is not None


def test_an_sqlite_system_database_dbos_cannot_fill_is_refused_clearly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the SQLite at hand cannot evaluate DBOS's timestamp default, ``dbos_config``
    says so (and what to use instead) rather than leaving DBOS's launch to fail on a
    NOT NULL constraint; an expression it can evaluate passes."""
    import dbos._migration

    monkeypatch.setattr(dbos._migration, "get_sqlite_timestamp_expr", lambda: "(NULL)")
    with pytest.raises(ConfigurationError) as refused:
        dbos_config("app", "sqlite:///sys.sqlite3")
    message = str(refused.value)
    assert "sqlite:///sys.sqlite3" in message
    assert f"SQLite {sqlite3.sqlite_version}" in message
    assert "PostgreSQL system database" in message
    monkeypatch.setattr(
        dbos._migration, "get_sqlite_timestamp_expr", lambda: "(strftime('%s','now') * 1000)"
    )
    assert dbos_config("app", "sqlite:///sys.sqlite3")["system_database_url"] == (
        "sqlite:///sys.sqlite3"
    )


def test_the_sqlite_check_agrees_with_a_dbos_launch(tmp_path: Path) -> None:
    """With DBOS's own timestamp default on this Python and this SQLite: refused exactly
    where DBOS itself cannot launch on an SQLite system database. (On Python 3.11 DBOS
    launches; on 3.12 and later it does only with SQLite 3.42 or later.)"""
    url = f"sqlite:///{tmp_path}/sys.sqlite3"
    problem = _sqlite_system_database_problem(url)
    DBOS.destroy(destroy_registry=True)
    config: DBOSConfig = {"name": "probe", "system_database_url": url, "log_level": "ERROR"}
    DBOS(config=config)
    try:
        if problem is None:
            DBOS.launch()
        else:
            with pytest.raises(Exception, match="NOT NULL constraint failed"):
                DBOS.launch()
    finally:
        DBOS.destroy(destroy_registry=True)


def test_turn_report_reads_a_workflow_output() -> None:
    report = TurnReport(session_id="s", start_revision=1, revision=4, reason="done")
    assert TurnReport.from_output(msgspec.to_builtins(report)) == report
    assert TurnReport.from_output(report) is report
    with pytest.raises(msgspec.ValidationError):
        TurnReport.from_output({"session_id": "s"})


# -- configuration and the event loop -------------------------------------------------------


def echo_machine() -> StateMachine[Any]:
    return StateMachine([ModelInference()])


@pytest.fixture
def fresh_dbos() -> Iterator[None]:
    """No DBOS instance or registrations before the test, and none left after it."""
    DBOS.destroy(destroy_registry=True)
    yield
    DBOS.destroy(destroy_registry=True)


def test_durable_machine_checks_its_options(fresh_dbos: None) -> None:
    runtime = Runtime(store=MemoryStore())
    with pytest.raises(ConfigurationError, match="max_cycles"):
        DurableMachine(echo_machine(), runtime, max_cycles=0)
    for bad in (0, -1.0, float("nan"), float("inf"), 10**400, True, "1"):
        with pytest.raises(ConfigurationError, match="polling_interval"):
            DurableMachine(echo_machine(), runtime, polling_interval=bad)  # type: ignore[arg-type]
    durable = DurableMachine(echo_machine(), runtime, name="app")
    assert (durable.workflow_name, durable.queue_name) == ("app.turn", "app.turns")
    assert durable.max_cycles == echo_machine().max_cycles
    options = durable.enqueue_options("s1", turn_id="t1")
    assert options["queue_partition_key"] == "s1"
    assert (options["workflow_name"], options["workflow_id"]) == ("app.turn", "t1")


def test_entry_points_refuse_trio(fresh_dbos: None) -> None:
    """DBOS needs an asyncio loop; under trio each entry point says so before touching DBOS."""
    durable = DurableMachine(echo_machine(), Runtime(store=MemoryStore()))

    async def attempt() -> list[str]:
        messages = []
        for entry in (durable.launch(), durable.enqueue_turn("s1"), durable.result("w1")):
            with pytest.raises(ConfigurationError) as caught:
                await entry
            messages.append(str(caught.value))
        return messages

    for message in anyio.run(attempt, backend="trio"):
        assert "needs asyncio, not trio" in message
        assert "no running event loop" in message


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # DBOS is asyncio-only
async def test_launch_refuses_a_pickling_dbos_and_a_missing_one(fresh_dbos: None) -> None:
    """Asyncio only: under trio launch() refuses earlier (test_entry_points_refuse_trio)."""
    durable = DurableMachine(echo_machine(), Runtime(store=MemoryStore()))
    with pytest.raises(ConfigurationError, match="needs DBOS"):
        await durable.launch()
    DBOS(config=DBOSConfig(name="pickles", system_database_url="postgresql://u@h/db"))
    with pytest.raises(ConfigurationError, match="pickles"):
        await durable.launch()
    with pytest.raises(ConfigurationError, match="launch"):
        await durable.enqueue_turn("s1")
    with pytest.raises(ConfigurationError, match="finite number > 0, got 0"):
        await durable.result("w1", polling_interval=0)
    # A turn's status is read, then read again after polling_interval: an infinite one
    # (DBOS sleeps it out) would never see the turn end.
    for bad in (float("inf"), float("nan"), 10**400, True, "1"):
        with pytest.raises(ConfigurationError, match="polling_interval"):
            await durable.result("w1", polling_interval=bad)  # type: ignore[arg-type]


# -- real turns in this process (asyncio only) -------------------------------------------------


@tool(side_effects="idempotent", thread=False)
async def add(a: int, b: int, ctx: ToolContext) -> str:
    """Add two numbers."""
    return str(a + b)


ACTIVE: Counter[str] = Counter()  # turns of each session inside ``hold`` now
MOST: Counter[str] = Counter()  # the most ever at once


@tool(side_effects="idempotent", thread=False)
async def hold(ctx: ToolContext) -> str:
    """Stay busy a moment (long enough for a second turn of the session to overlap)."""
    ACTIVE[ctx.session_id] += 1
    MOST[ctx.session_id] = max(MOST[ctx.session_id], ACTIVE[ctx.session_id])
    try:
        await anyio.sleep(0.1)
    finally:
        ACTIVE[ctx.session_id] -= 1
    return "held"


def adder(request: ModelRequest) -> ModelResponse:
    """Per user message: call ``add`` (or ``hold``) once, then answer with the tool's result."""
    last = request.messages[-1]
    if last.role == "user":
        if last.text == "fail":
            raise ModelError("the model is down")
        if last.text == "hold":
            return call(("hold", {}))
        return call(("add", {"a": 2, "b": 3}))
    return reply(f"the sum is {last.tool_results[0].content}")


class ConflictOnce:
    """An effect handler whose first apply loses the race (as if a user wrote meanwhile),
    and a loader whose next ``fail_loads`` loads raise ``OSError`` (a store read that failed)."""

    applies_batches = True

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        self.conflicted = False
        self.fail_loads = 0
        self.failed_loads = 0

    async def load(self, session_id: str) -> Session[Any]:
        if self.fail_loads:
            self.fail_loads -= 1
            self.failed_loads += 1
            raise OSError(5, "Input/output error (injected)")
        return await self.store.load(session_id)

    async def apply(self, batch: Batch[Effect]) -> Session[Any] | None:
        if not self.conflicted:
            self.conflicted = True
            raise ConflictError(batch.session_id, batch.revision - 1, batch.revision)  # injected
        return await self.store.apply(batch)


POLL = 0.05  # seconds between reads of a turn's status (DBOS's default is 1 s)


@pytest.fixture
async def launched(
    postgres_dsn: str, fresh_dbos: None
) -> AsyncIterator[tuple[DurableMachine, PostgresStore, ConflictOnce]]:
    store = await PostgresStore.open(postgres_dsn)
    handler = ConflictOnce(store)
    runtime = Runtime(loader=handler, handler=handler, model=FunctionModel(adder))
    machine = StateMachine([Tools([add, hold]), ModelInference()])
    DBOS(config=dbos_config("durable-test", postgres_dsn, log_level="ERROR"))
    durable = DurableMachine(machine, lambda: runtime, name="test", polling_interval=0.05)
    await durable.launch()
    try:
        yield durable, store, handler
    finally:
        DBOS.destroy(destroy_registry=True)
        await store.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # DBOS is asyncio-only
async def test_a_turn_runs_as_one_dbos_step_per_cycle(
    launched: tuple[DurableMachine, PostgresStore, ConflictOnce],
) -> None:
    """Asyncio only (DBOS). DBOS's record of the turn and the store agree, step by step."""
    durable, store, handler = launched
    await store.create("s1")
    start = await submit(store, "s1", [AppendMessage(Message.user("add 2 and 3", id="u1"))])
    with structlog.testing.capture_logs() as events:
        workflow_id = await durable.enqueue_turn("s1", turn_id="s1-turn-1")
        assert workflow_id == "s1-turn-1"
        assert await durable.enqueue_turn("s1", turn_id="s1-turn-1") == workflow_id  # idempotent
        report = await durable.result(workflow_id, polling_interval=POLL)
    # Each durable cycle is a `cycle` event, with the steps that refused before it and why.
    # The injected conflict hit the model reply's record: the machine wrote it again on the
    # reloaded session (the model was not asked again), so no cycle was redone.
    cycles = [e for e in events if e["event"] == "cycle" and e["session_id"] == "s1"]
    assert [(e["step"], e["outcome"]) for e in cycles] == [
        ("inference", "continue"),
        ("tools", "continue"),
        ("inference", "yielded"),
    ]
    assert cycles[0]["refused"] == [{"step": "tools", "why": "no open tool calls"}]

    session = await store.load("s1")
    assert session.conversation[-1].text == "the sum is 5"
    assert history_problems(session.conversation) == []
    assert (report.session_id, report.start_revision) == ("s1", start.revision)
    assert (report.revision, report.reason) == (session.revision, "done")
    assert [(c.status, c.step) for c in report.cycles] == [
        ("continue", "inference"),
        ("continue", "tools"),
        ("yielded", "inference"),
    ]
    assert report.cycles[0].conflicts == 0  # the record was written again, the cycle not redone
    assert handler.conflicted
    batches = {b.revision: b for b in await store.batches("s1")}
    for cycle in report.cycles:
        assert batches[cycle.revision].step == cycle.step

    steps = await DBOS.list_workflow_steps_async(workflow_id)
    assert [s["function_name"] for s in steps] == [TURN_START_STEP] + [CYCLE_STEP] * 3
    assert steps[0]["output"] == start.revision
    assert [msgspec.convert(s["output"], CycleSummary) for s in steps[1:]] == list(report.cycles)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # DBOS is asyncio-only
async def test_an_idle_session_ends_its_turn_at_once(
    launched: tuple[DurableMachine, PostgresStore, ConflictOnce],
) -> None:
    """Asyncio only (DBOS). No step applies: one idle cycle, nothing written."""
    durable, store, _ = launched
    await store.create("quiet")
    report = await durable.result(await durable.enqueue_turn("quiet"), polling_interval=POLL)
    assert report.reason == "idle"
    assert [(c.status, c.revision) for c in report.cycles] == [("idle", 0)]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # DBOS is asyncio-only
async def test_a_failing_step_fails_the_turn_with_the_recorded_error(
    launched: tuple[DurableMachine, PostgresStore, ConflictOnce],
) -> None:
    """Asyncio only (DBOS). The model's error is recorded by DBOS (as msgspec JSON) and raised."""
    durable, store, _ = launched
    await store.create("s2")
    await submit(store, "s2", [AppendMessage(Message.user("fail", id="u1"))])
    with pytest.raises(DurableTurnError) as caught:
        await durable.result(await durable.enqueue_turn("s2"), polling_interval=POLL)
    assert caught.value.error_type == "ModelError"
    assert "the model is down" in caught.value.message


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # DBOS is asyncio-only
@pytest.mark.parametrize("failures", [1, 3])
async def test_a_transient_store_error_in_a_cycle_is_tried_again(
    launched: tuple[DurableMachine, PostgresStore, ConflictOnce], failures: int
) -> None:
    """Asyncio only (DBOS). Loads that fail with OSError (as a restarted database's do) are
    retried within the step, after a backoff: the turn ends done, not ERROR."""
    durable, store, handler = launched
    await store.create("s5")
    await submit(store, "s5", [AppendMessage(Message.user("add 2 and 3", id="u1"))])
    handler.fail_loads = failures
    with structlog.testing.capture_logs() as events:
        report = await durable.result(await durable.enqueue_turn("s5"), polling_interval=POLL)
    assert handler.failed_loads == failures
    assert report.reason == "done"
    assert (await store.load("s5")).conversation[-1].text == "the sum is 5"
    retried = [e for e in events if e["event"] == "durable_step_retried"]
    assert [(e["session_id"], e["error_type"], e["attempt"]) for e in retried] == [
        ("s5", "OSError", n) for n in range(1, failures + 1)
    ]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # DBOS is asyncio-only
async def test_a_store_error_that_lasts_fails_the_turn_after_the_bound(
    launched: tuple[DurableMachine, PostgresStore, ConflictOnce],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Asyncio only (DBOS). Transient errors past MAX_ATTEMPTS fail the turn, recorded."""
    from stepmachine import _transient

    monkeypatch.setattr(_transient, "BACKOFF_FIRST", 0.01)
    monkeypatch.setattr(_transient, "BACKOFF_CAP", 0.02)
    durable, store, handler = launched
    await store.create("s6")
    await submit(store, "s6", [AppendMessage(Message.user("add 2 and 3", id="u1"))])
    handler.fail_loads = 10_000
    with pytest.raises(DurableTurnError) as caught:
        await durable.result(await durable.enqueue_turn("s6"), polling_interval=POLL)
    assert caught.value.error_type == "OSError"
    assert handler.failed_loads == _transient.MAX_ATTEMPTS


# -- worker processes SIGKILLed mid-turn (tests/harness/dbos_crash.py) ---------------------------


@pytest.mark.slow
def test_durable_turns_ride_out_restarts_of_the_database() -> None:
    """The harness restarts its own server (-m fast, then -m immediate) while turns run and
    workers are killed: every turn ends SUCCESS, none is dropped, nothing is repeated."""
    from _postgres import ENV_VAR, unavailable_reason

    OWN_SERVER_ENV = {k: v for k, v in os.environ.items() if k != ENV_VAR}  # noqa: N806
    if unavailable_reason(OWN_SERVER_ENV) is not None:  # its own server, whatever the variable
        pytest.skip(f"no PostgreSQL server: {unavailable_reason(OWN_SERVER_ENV)}")
    counts = dbos_crash.run_dbos(workers=2, sessions=3, turns=2, kills=4, seed=11, restart_db=True)
    assert counts.restarts == 2, counts.problems
    assert counts.problems == []
    assert (counts.lost, counts.duplicate_side_effects, counts.dropped_turns) == (0, 0, 0)
    assert counts.invalid == 0
    assert counts.ok
    assert counts.line().startswith("workers=2 sessions=3 kills=")
    assert " dropped_turns=0 " in counts.line()


@pytest.mark.slow
def test_workers_killed_mid_turn_fifty_times_lose_and_repeat_nothing(postgres_server: str) -> None:
    """50 SIGKILLs of workers with a turn running; replacements recover the turns.

    Each session's history stays valid, no acknowledged batch is lost, no tool runs
    after its result was stored, the non-idempotent ``send`` never runs twice (a kill
    between its intent and its result is reported "outcome unknown", and only then),
    and DBOS's turn reports agree with the store.
    """
    counts = dbos_crash.run_dbos(
        workers=3,
        sessions=4,
        turns=2,
        kills=50,
        agent=dbos_crash.Agent(non_idempotent=True),
        dsn=postgres_server,
    )
    assert counts.problems == []
    assert counts.kills >= 50
    assert (counts.lost, counts.duplicate_side_effects, counts.invalid) == (0, 0, 0)
    assert counts.turns >= 8
    assert counts.line().startswith("workers=3 sessions=4 kills=")


def test_a_crash_after_a_non_idempotent_side_effect_is_reported_unknown(
    postgres_server: str,
) -> None:
    """The worker dies right after ``send`` acted: the resumed turn does not send again."""
    agent = dbos_crash.Agent(non_idempotent=True, self_kill="send")
    counts = dbos_crash.run_dbos(
        workers=2, sessions=1, turns=1, kills=0, agent=agent, dsn=postgres_server
    )
    assert counts.problems == []
    assert (counts.kills, counts.outcome_unknown, counts.duplicate_side_effects) == (1, 1, 0)


def test_an_idempotent_call_cut_by_a_crash_runs_again_and_applies_once(
    postgres_server: str,
) -> None:
    agent = dbos_crash.Agent(self_kill="work")
    counts = dbos_crash.run_dbos(
        workers=2, sessions=1, turns=1, kills=0, agent=agent, dsn=postgres_server
    )
    assert counts.problems == []
    assert counts.kills == 1
    assert counts.reruns >= 1  # visible in the raw runs, deduplicated by the key
    assert (counts.outcome_unknown, counts.duplicate_side_effects) == (0, 0)


def test_the_harness_reports_a_tool_that_ran_twice(postgres_server: str) -> None:
    """A non-idempotent tool mislabelled idempotent is run again after the crash: caught."""
    agent = dbos_crash.Agent(non_idempotent=True, self_kill="send", mislabel=True)
    counts = dbos_crash.run_dbos(
        workers=2, sessions=1, turns=1, kills=0, agent=agent, dsn=postgres_server
    )
    assert counts.duplicate_side_effects == 1
    assert any("send ran 2 times" in problem for problem in counts.problems)
    assert not counts.ok


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # DBOS is asyncio-only
async def test_two_turns_of_one_session_run_one_after_the_other(
    launched: tuple[DurableMachine, PostgresStore, ConflictOnce],
) -> None:
    """Asyncio only (DBOS). The queue's partition is the session: the second turn waits.

    Both turns are enqueued at once on a worker with room for both; the later one
    starts from the revision the earlier one ended at, finds nothing to do, and
    the two were never inside ``hold`` together.
    """
    durable, store, _ = launched
    await store.create("busy")
    await submit(store, "busy", [AppendMessage(Message.user("hold", id="u1"))])
    first, second = [await durable.enqueue_turn("busy") for _ in range(2)]
    reports = sorted(
        [await durable.result(t, polling_interval=POLL) for t in (first, second)],
        key=lambda r: r.start_revision,
    )
    assert reports[1].start_revision == reports[0].revision
    assert [c.status for c in reports[0].cycles] == ["continue", "continue", "yielded"]
    assert [(c.status, c.reason) for c in reports[1].cycles] == [("idle", "idle")]
    assert MOST["busy"] == 1
    assert (await store.load("busy")).conversation[-1].text == "the sum is held"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # DBOS is asyncio-only
async def test_a_turn_ends_at_max_cycles_and_a_missing_session_fails(
    launched: tuple[DurableMachine, PostgresStore, ConflictOnce],
) -> None:
    """Asyncio only (DBOS). A second machine launched in the same process gets its own queue."""
    durable, store, _ = launched
    limited = DurableMachine(
        durable.machine, durable.runtime, name="limited", max_cycles=1, polling_interval=0.05
    )
    await limited.launch()  # DBOS is launched already: only the queue is registered
    await store.create("long")
    await submit(store, "long", [AppendMessage(Message.user("add 2 and 3", id="u1"))])
    report = await limited.result(await limited.enqueue_turn("long"), polling_interval=POLL)
    assert (report.reason, len(report.cycles)) == ("cycle_limit", 1)
    assert report.revision == (await store.load("long")).revision  # the model's call, stored
    # the next turn goes on
    again = await limited.result(await limited.enqueue_turn("long"), polling_interval=POLL)
    assert again.start_revision == report.revision
    assert [c.step for c in again.cycles] == ["tools"]

    with pytest.raises(DurableTurnError) as caught:
        await durable.result(await durable.enqueue_turn("no-such-session"), polling_interval=POLL)
    assert caught.value.error_type == "SessionNotFoundError"
