"""SQLiteStore tests of the effect-row layout: batches written as schema version 4 wrote them.

Since schema version 5 a batch row holds its effects in its ``body``; the rows
of a database written before (one ``effects`` row per effect under a batch row
of version 4 or older) stay as they were and are read as they are. The tests
that damage effect rows use the fixture :func:`effect_rows`, under which the
store writes each batch that way (a version-4 batch row and its effect rows,
the code of version 4 did exactly this), so they keep checking how those rows
are read; the batch-row layout has tests of its own.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

import pytest

from stepmachine.stores import _sqlite_rows

VERSION = 4
"""The row version the effect-row layout is written with (the last one that used it)."""


def insert_batch_as_version_4(
    conn: sqlite3.Connection,
    sid: int,
    revision: int,
    step: str,
    cycle: int,
    timestamp: float,
    bodies: Sequence[bytes],
    refused: str | None,
    trace: str | None,
) -> None:
    """:func:`._sqlite_rows.insert_batch` as schema version 4 had it: a batch row without
    ``body`` and one effect row per effect, each with its checksum."""
    header = (sid, revision, step, cycle, timestamp)
    batch, effects = _sqlite_rows.batch_row_values(*header, bodies, refused, trace, VERSION)
    conn.execute(_sqlite_rows._INSERT_BATCH, batch)
    conn.executemany(_sqlite_rows._INSERT_EFFECT, effects)


@pytest.fixture
def effect_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store writes every batch in the effect-row layout (see the module docstring)."""
    monkeypatch.setattr(_sqlite_rows, "insert_batch", insert_batch_as_version_4)
