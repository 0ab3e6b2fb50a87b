"""``SQLiteStore`` -- placeholder, being written (issue 3)."""

from __future__ import annotations

__all__ = ["SQLiteStore"]


class SQLiteStore:
    """Not implemented yet."""
