"""Fixtures shared by the test modules.

PostgreSQL: ``postgres_dsn`` gives each test an empty database of its own on one
server per test session (``postgres_server``: ``$STEPMACHINE_TEST_POSTGRES``, or a
throwaway server that ``tests/harness/_postgres.py`` starts and removes). A test
that uses either fixture is marked ``postgres`` (deselect with ``-m 'not postgres'``)
and is skipped, with the reason, only when no server can be started here or
psycopg (the ``postgres`` extra) is missing; a server that fails to start is an error.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import _postgres
import pytest
import structlog

from stepmachine import Store
from stepmachine.stores import MemoryStore, SQLiteStore

POSTGRES_FIXTURES = frozenset({"postgres_server", "postgres_dsn", "restartable_postgres"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``postgres`` every test that uses a PostgreSQL fixture."""
    for item in items:
        if POSTGRES_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.postgres)


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    """An empty store with the default codec: MemoryStore, then SQLiteStore."""
    made: Store = (
        MemoryStore()
        if request.param == "memory"
        else await SQLiteStore.open(tmp_path / "db.sqlite3")
    )
    try:
        yield made
    finally:
        await made.aclose()


@pytest.fixture(scope="session")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One mypy cache per test worker for the docs' and the README's type checks: the
    package is analysed once, then each page's run checks only its own blocks."""
    return tmp_path_factory.mktemp("mypy_cache")


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """DSN of a PostgreSQL server for the whole test session (database ``postgres``).

    Skips (once; every later request gets the same skip) when psycopg is missing or
    :func:`_postgres.unavailable_reason` says no server can be started here.
    """
    try:
        import psycopg  # noqa: F401 - only to know it is there
    except ImportError:
        pytest.skip("psycopg is not installed: pip install 'stepmachine[postgres]'")
    with contextlib.ExitStack() as stack:
        try:
            dsn = stack.enter_context(_postgres.postgres_server())
        except _postgres.PostgresUnavailable as exc:
            pytest.skip(f"no PostgreSQL server: {exc}")
        yield dsn


@pytest.fixture(scope="module")
def restartable_postgres() -> Iterator[_postgres.Server]:
    """A throwaway PostgreSQL server of the test module's own, for tests that restart it
    (the session's shared ``postgres_server`` is never restarted). Skips as
    ``postgres_server`` does."""
    pytest.importorskip("psycopg")
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(_postgres.throwaway_server())
        except _postgres.PostgresUnavailable as exc:
            pytest.skip(f"no PostgreSQL server: {exc}")
        yield server


@pytest.fixture
def store_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A harness ``--store`` kind, given as an indirect parameter.

    For ``postgres`` (mark that parameter ``postgres``), the session's server is
    exported in ``STEPMACHINE_TEST_POSTGRES``, so the harness and its child
    processes use it instead of starting their own.
    """
    kind: str = request.param
    if kind == "postgres":
        monkeypatch.setenv(_postgres.ENV_VAR, request.getfixturevalue("postgres_server"))
    return kind


@pytest.fixture
def postgres_dsn(postgres_server: str) -> Iterator[str]:
    """DSN of a new, empty database for this test only; dropped afterwards."""
    with _postgres.fresh_database(postgres_server) as dsn:
        yield dsn


@pytest.fixture(autouse=True)
def _structlog_unconfigured() -> Iterator[None]:
    """Each test starts with structlog unconfigured, as a library user's process does.

    ``structlog.testing.capture_logs()`` restores the processors it replaced but
    leaves structlog marked configured, which changes the route of stepmachine's
    events (see ``stepmachine._log``) for every later test.
    """
    yield
    structlog.reset_defaults()
