"""``stepmachine.stores`` imports where ``fcntl`` does not exist (Windows).

SQLiteStore and MemoryStore work there; FileStore, which needs POSIX file
locks, refuses when opened or constructed, with an error naming the platform,
never at import. Simulated in a child process by making ``import fcntl`` fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

CHILD = textwrap.dedent(
    """
    import json
    import sys

    sys.modules["fcntl"] = None  # `import fcntl` raises ImportError, as on Windows
    import os

    for posix_only in ("O_CLOEXEC", "O_NOFOLLOW", "fchmod"):  # absent on Windows too
        delattr(os, posix_only)

    import anyio

    from stepmachine import ConfigurationError
    from stepmachine.stores import MemoryStore, SQLiteStore


    async def main() -> dict[str, object]:
        memory = MemoryStore()
        await memory.create("m")
        async with await SQLiteStore.open(sys.argv[1] + "/db.sqlite3") as sqlite:
            await sqlite.create("s")
            sqlite_ids = await sqlite.list_sessions()
        from stepmachine.stores import FileStore  # importing is fine; using is not

        errors = {}
        for name, attempt in {
            "open": lambda: FileStore.open(sys.argv[1] + "/files"),
            "construct": lambda: FileStore(
                sys.argv[1], None, fsync="always", snapshot_every=1, lock_timeout=1.0,
                boundary_hook=None,
            ),
        }.items():
            try:
                made = attempt()
                if hasattr(made, "__await__"):
                    await made
            except ConfigurationError as exc:
                errors[name] = str(exc)
        return {
            "memory": await memory.list_sessions(),
            "sqlite": sqlite_ids,
            "errors": errors,
            "platform": sys.platform,
            "fcntl_loaded": sys.modules["fcntl"] is not None,
        }


    print(json.dumps(anyio.run(main)))
    """
)


def test_stores_import_and_work_without_fcntl(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["fcntl_loaded"] is False
    assert report["memory"] == ["m"]
    assert report["sqlite"] == ["s"]
    assert set(report["errors"]) == {"open", "construct"}
    for message in report["errors"].values():
        assert "fcntl.flock" in message
        assert f"sys.platform={report['platform']!r}" in message
        assert "SQLiteStore" in message
    assert not (tmp_path / "files").exists()  # refused before creating anything
