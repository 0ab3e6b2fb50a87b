"""Fixtures shared by the test modules."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from stepmachine import Store
from stepmachine.stores import MemoryStore, SQLiteStore


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
