"""Damage a stored media blob in place, keeping its size (the media tests' fault)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from stepmachine.extend import media_digest


def damage_same_size(kind: str, tmp_path: Path, data: bytes) -> None:
    """Flip the first byte of the blob of ``data`` in the ``file`` or ``sqlite`` store
    that the media tests keep under ``tmp_path``."""
    digest = media_digest(data)
    bad = bytes([data[0] ^ 0xFF]) + data[1:]
    if kind == "file":
        blob = tmp_path / "files" / ".media" / digest.removeprefix("sha256:")
        blob.write_bytes(bad)
    else:
        db = sqlite3.connect(tmp_path / "db.sqlite3")
        with db:
            changed = db.execute("UPDATE media SET body = ? WHERE digest = ?", (bad, digest))
            assert changed.rowcount == 1
        db.close()
