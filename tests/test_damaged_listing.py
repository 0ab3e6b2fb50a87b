"""One damaged session never hides the others: listings name it unreadable.

A ``sessions`` row that no longer matches its checksum (SQLite, PostgreSQL), or a
damaged log (the file store), is listed as unreadable with the reason by the
stores' ``scan_sessions()``, by ``stepmachine sessions list`` (text and ``--json``),
by ``fsck`` over all sessions (which reports it and exits 1), and by the web view's
list; the other sessions are listed as before. ``list_sessions()`` stays strict
(a damaged row's id cannot be trusted), and nothing is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from click.testing import CliRunner, Result
from hypothesis import given, settings
from hypothesis import strategies as st

from stepmachine import Message, StoredDataError
from stepmachine.inspector._cli import cli
from stepmachine.inspector._open import open_store
from stepmachine.stores import FileStore, ListedSession, PostgresStore, SQLiteStore

KINDS = ["sqlite", "file", pytest.param("postgres", marks=pytest.mark.postgres)]


async def _make(kind: str, where: Any) -> str:
    """Create ``good`` and ``bad`` in a ``kind`` store at ``where``, then damage ``bad``;
    the store's URL."""
    conversation = [Message.user("hello", id="u1")]
    if kind == "sqlite":
        path = where / "agent.sqlite3"
        async with await SQLiteStore.open(path) as store:
            for session_id in ("good", "bad"):
                await store.create(session_id, conversation=conversation)
        with contextlib.closing(sqlite3.connect(path)) as raw, raw:
            raw.execute("UPDATE sessions SET revision = 7 WHERE session_id = 'bad'")
        return f"sqlite:///{path}"
    if kind == "file":
        folder = where / "store"
        async with await FileStore.open(folder) as store:
            for session_id in ("good", "bad"):
                await store.create(session_id, conversation=conversation)
        log = folder / "bad.log"
        data = bytearray(log.read_bytes())
        data[-3] ^= 0x01  # a payload byte of the last record: its checksum no longer matches
        log.write_bytes(bytes(data))
        return f"file://{folder}"
    import psycopg  # the postgres extra (the fixture skips without it)

    async with await PostgresStore.open(where) as store:
        for session_id in ("good", "bad"):
            await store.create(session_id, conversation=conversation)
    with psycopg.connect(where, autocommit=True) as conn:
        conn.execute("UPDATE stepmachine.sessions SET revision = 7 WHERE session_id = 'bad'")
    return str(where)


def _where(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue("postgres_dsn") if kind == "postgres" else tmp_path


def _fingerprint(url: str, tmp_path: Path) -> Any:
    if url.startswith("postgresql"):
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            return conn.execute("SELECT * FROM stepmachine.sessions ORDER BY sid").fetchall()
    return {
        str(p.relative_to(tmp_path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(tmp_path.rglob("*"))
        if p.is_file() and not p.name.endswith(("-shm", "-wal"))
    }


@pytest.mark.parametrize("kind", KINDS)
async def test_scan_sessions_marks_the_damaged_session(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = await _make(kind, _where(kind, tmp_path, request))
    async with await open_store(url) as store:
        listed = await store.scan_sessions()
        assert [entry.id for entry in listed] == ["bad", "good"]
        good = listed[1]
        assert good == ListedSession("good")
        if kind == "file":  # the listing reads no log: loading finds the damage
            assert listed[0] == ListedSession("bad")
        else:
            assert listed[0].unreadable is not None
            assert "checksum" in listed[0].unreadable
            assert "'bad'" in listed[0].unreadable
            with pytest.raises(StoredDataError, match="checksum"):
                await store.list_sessions()  # strict: a damaged row's id is not handed out
        with pytest.raises(StoredDataError):
            await store.load("bad")
        assert (await store.load("good")).revision == 0


def _cli(url: str, backend: str, *args: str) -> Result:
    return CliRunner().invoke(cli, ["--store", url, "--backend", backend, *args])


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_cli_lists_the_damaged_session_as_unreadable(
    kind: str, backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = anyio.run(_make, kind, _where(kind, tmp_path, request))
    before = _fingerprint(url, tmp_path)
    listed = _cli(url, backend, "sessions", "list", "--json")
    assert listed.exit_code == 0, listed.output
    rows = {row["id"]: row for row in map(json.loads, listed.stdout.splitlines())}
    assert set(rows) == {"good", "bad"}
    assert rows["good"]["status"] == "idle"
    assert rows["bad"]["status"] == "unreadable"
    assert "checksum" in rows["bad"]["error"]
    text = _cli(url, backend, "sessions", "list")
    assert text.exit_code == 0, text.output
    assert "good" in text.stdout
    assert "unreadable" in text.stdout
    assert "bad: " in text.stderr
    assert "checksum" in text.stderr
    checked = _cli(url, backend, "fsck")
    assert checked.exit_code == 1, checked.output
    assert "bad: unreadable" in checked.stdout
    assert "checksum" in checked.stdout
    assert "good:" not in checked.stdout
    assert "checked 2 session(s)" in checked.stderr
    assert _cli(url, backend, "fsck", "good").exit_code == 0
    assert _fingerprint(url, tmp_path) == before


@pytest.mark.parametrize("kind", KINDS)
async def test_the_web_list_shows_the_damaged_session(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    pytest.importorskip("starlette")
    from stepmachine.inspector._web import create_app  # the web extra

    url = await _make(kind, _where(kind, tmp_path, request))
    async with await open_store(url) as store:
        transport = httpx.ASGITransport(app=create_app(store))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            page = await http.get("/")
            api = await http.get("/api/sessions")
    assert page.status_code == 200, page.text[:500]
    assert api.status_code == 200, api.text[:500]
    rows = {row["id"]: row for row in api.json()}
    assert rows["good"]["status"] == "idle"
    assert rows["bad"]["status"] is None
    assert "checksum" in rows["bad"]["error"]
    assert "unreadable" in page.text
    assert ">good<" in page.text


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(max_examples=25, deadline=None)
@given(damaged=st.lists(st.booleans(), min_size=1, max_size=6))
def test_scan_lists_every_session_and_marks_exactly_the_damaged(
    backend: str, damaged: list[bool]
) -> None:
    """Whichever rows are damaged, every session is listed once, and exactly the damaged
    ones are unreadable."""
    ids = [f"s{index}" for index in range(len(damaged))]

    async def main(path: Path) -> list[ListedSession]:
        async with await SQLiteStore.open(path) as store:
            for session_id in ids:
                await store.create(session_id)
        with contextlib.closing(sqlite3.connect(path)) as raw, raw:
            for session_id, bad in zip(ids, damaged, strict=True):
                if bad:
                    raw.execute(
                        "UPDATE sessions SET revision = revision + 1 WHERE session_id = ?",
                        (session_id,),
                    )
        async with await SQLiteStore.open(path, read_only=True) as reader:
            return await reader.scan_sessions()

    with tempfile.TemporaryDirectory() as folder:
        listed = anyio.run(main, Path(folder) / "agent.sqlite3", backend=backend)
    assert [entry.id for entry in listed] == sorted(ids)
    unreadable = {entry.id for entry in listed if entry.unreadable is not None}
    assert unreadable == {i for i, bad in zip(ids, damaged, strict=True) if bad}
