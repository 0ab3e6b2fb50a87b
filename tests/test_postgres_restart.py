"""A PostgresStore and ``serve()`` across a real restart of their PostgreSQL server.

The server is a throwaway one of this module's own (``_postgres.throwaway_server``:
the session's shared server is never restarted), restarted with
``pg_ctl restart -m fast`` (clients get ``AdminShutdown``) and ``-m immediate``
(the server's processes quit at once, as in a crash). Every pooled connection
dies either way.

- The pool checks a connection when it hands it out: after a restart, the first
  call succeeds instead of the pool handing out its dead connections one by one.
- ``serve()``: a turn whose run failed on the restart is run again (it stays
  pending), not dropped.
"""

from __future__ import annotations

from collections.abc import Iterator

import _postgres
import anyio
import pytest

from stepmachine import (
    AppendMessage,
    CancelToken,
    Message,
    ModelInference,
    Runtime,
    StateMachine,
    run_worker,
    submit,
)
from stepmachine.stores import PostgresStore
from stepmachine.testing import ScriptedModel, reply

pytestmark = pytest.mark.postgres

MODES = ["fast", "immediate"]


@pytest.fixture(scope="module")
def server(restartable_postgres: _postgres.Server) -> _postgres.Server:
    """A throwaway server of this module's own (it is restarted)."""
    return restartable_postgres


@pytest.fixture
def dsn(server: _postgres.Server) -> Iterator[str]:
    with _postgres.fresh_database(server.dsn, prefix="stepmachine_restart") as made:
        yield made


@pytest.mark.parametrize("mode", MODES)
async def test_every_pooled_connection_is_checked_after_a_restart(
    server: _postgres.Server, dsn: str, mode: str
) -> None:
    store = await PostgresStore.open(dsn, min_size=4, max_size=4)
    try:
        await store.create("s1")
        async with anyio.create_task_group() as tg:  # every pooled connection is used once
            for _ in range(8):
                tg.start_soon(store.load, "s1")
        await anyio.to_thread.run_sync(_postgres.restart, server, mode)
        for _ in range(8):  # one after the other: each takes a connection from the pool
            session = await store.load("s1")
            assert session.id == "s1"
    finally:
        await store.aclose()


@pytest.mark.parametrize("mode", MODES)
async def test_serve_runs_a_turn_whose_run_failed_on_a_restart(
    server: _postgres.Server, dsn: str, mode: str
) -> None:
    armed = anyio.Event()
    restarted = anyio.Event()

    class RestartingStore(PostgresStore):
        """The first run's first load fails on a connection the restart ended."""

        async def load(self, session_id: str):  # type: ignore[no-untyped-def]
            if armed.is_set() and not restarted.is_set():
                restarted.set()
                await anyio.to_thread.run_sync(self._query_across_a_restart)
            return await super().load(session_id)

        def _query_across_a_restart(self) -> None:
            assert self._pool is not None
            with self._pool.connection() as conn:
                _postgres.restart(server, mode)
                conn.execute("SELECT 1")  # raises: the server ended this connection

    store = await RestartingStore.open(dsn, min_size=1, max_size=2)
    try:
        await store.create("s1")
        await submit(store, "s1", [AppendMessage(Message.user("hello", id="u1"))])
        await store.request_run("s1")
        runtime = Runtime(store=store, model=ScriptedModel([reply("hi")]))
        stop = CancelToken()
        armed.set()
        served: list[str] = []

        def on_report(report: object) -> None:
            served.append("run")
            stop.cancel("served")

        with anyio.fail_after(60):  # a guard against a hang, not a timing threshold
            await run_worker(
                StateMachine([ModelInference()]),
                runtime,
                stop=stop,
                ttl=2,
                poll=0.05,
                on_report=on_report,
            )
        session = await store.load("s1")
        assert restarted.is_set()
        assert [m.role for m in session.conversation] == ["user", "assistant"]
        assert served == ["run"]
    finally:
        await store.aclose()
