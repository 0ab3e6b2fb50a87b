"""``FileStore`` -- placeholder, being written (issue 3)."""

from __future__ import annotations

__all__ = ["FileStore"]


class FileStore:
    """Not implemented yet."""
