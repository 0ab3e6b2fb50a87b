"""The ``stepmachine`` command line, through Click's test runner, on stores written through
the public API (tests/fixtures/inspector_agent.py: one session of every status)."""

from __future__ import annotations

import hashlib
import html
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import inspector_agent
import pytest
from click.testing import CliRunner, Result

from stepmachine import Message
from stepmachine.inspector import STATUSES
from stepmachine.inspector._cli import cli
from stepmachine.operations import pending_events, recorded_decision
from stepmachine.stores import FileStore, SQLiteStore

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.parametrize("backend", ["asyncio", "trio"])


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "agent.sqlite3"
    anyio.run(inspector_agent.record, path)
    return path


def run(db: Path | str, *args: str, backend: str = "asyncio", env: Any = None) -> Result:
    store = db if isinstance(db, str) else f"sqlite:///{db}"
    return CliRunner().invoke(
        cli, ["--store", store, "--backend", backend, *args], env=env, catch_exceptions=False
    )


def load(db: Path, session_id: str) -> Any:
    async def main() -> Any:
        async with await SQLiteStore.open(db) as store:
            return await store.load(session_id)

    return anyio.run(main)


def fingerprint_of(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` and the hash of its bytes (``-shm`` excluded: SQLite's
    shared-memory index, which readers map)."""
    files = {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.endswith("-shm")
    }
    # A reader of a WAL database makes an empty -wal file where there was none.
    empty = hashlib.sha256(b"").hexdigest()
    return {
        name: digest
        for name, digest in files.items()
        if not (name.endswith("-wal") and digest == empty)
    }


# -- sessions list ------------------------------------------------------------------------------


def test_sessions_list_reads_the_store_named_by_the_environment(db: Path, backend: str) -> None:
    result = CliRunner().invoke(
        cli,
        ["--backend", backend, "sessions", "list", "--json"],
        env={"STEPMACHINE_STORE": f"sqlite:///{db}"},
    )
    assert result.exit_code == 0, result.output
    rows = {row["id"]: row for row in map(json.loads, result.output.splitlines())}
    expected = {session: status for status, session in inspector_agent.SESSIONS.items()}
    assert {i: r["status"] for i, r in rows.items()} == expected
    assert rows["done"]["revision"] == load(db, "done").revision
    assert rows["idle"]["last_activity"] is None
    assert isinstance(rows["done"]["last_activity"], float)


def test_sessions_list_table_and_filters(db: Path, backend: str) -> None:
    table = run(db, "sessions", "list", backend=backend)
    assert table.exit_code == 0
    for status in STATUSES:
        assert status in table.output
    only = run(db, "sessions", "list", "--status", "awaiting approval", "--json", backend=backend)
    assert [json.loads(line)["id"] for line in only.output.splitlines()] == ["approval"]
    two = run(
        db, "sessions", "list", "--status", "done", "--status", "idle", "--json", backend=backend
    )
    assert sorted(json.loads(line)["id"] for line in two.output.splitlines()) == ["done", "idle"]
    matched = run(db, "sessions", "list", "--match", "b*", "--json", backend=backend)
    assert [json.loads(line)["id"] for line in matched.output.splitlines()] == ["budget"]
    limited = run(db, "sessions", "list", "--limit", "1", "--json", backend=backend)
    assert len(limited.output.splitlines()) == 1


# -- show, log ----------------------------------------------------------------------------------


def test_show_prints_messages_tool_calls_and_their_state(db: Path, backend: str) -> None:
    result = run(db, "show", "approval", backend=backend)
    assert result.exit_code == 0, result.output
    assert "pay Alice" in result.output
    assert "send_payment" in result.output
    assert '"amount_eur": 120' in result.output
    assert "[awaiting approval]" in result.output
    done = run(db, "show", "done", backend=backend).output
    assert "[answered]" in done
    assert "value of weather" in done  # the result, under its call
    assert "journal" not in done or "intent" in done


def test_show_json_is_the_view_and_at_goes_back_in_time(db: Path, backend: str) -> None:
    now = json.loads(run(db, "show", "done", "--json", backend=backend).output)
    assert now["format"] == "stepmachine.inspector.session/1"
    assert now["revision"] == load(db, "done").revision
    assert [m["id"] for m in now["messages"]] == [m.id for m in load(db, "done").conversation]
    assert len(now["batches"]) == now["revision"]
    then = json.loads(run(db, "show", "done", "--json", "--at", "1", backend=backend).output)
    assert then["revision"] == 1
    assert len(then["messages"]) == 2  # the user's message and the model's call
    assert [b["revision"] for b in then["batches"]] == [1]
    beyond = run(db, "show", "done", "--at", "99", backend=backend)
    assert beyond.exit_code == 1
    assert "99" in beyond.output


def test_show_marks_hidden_messages_and_model_view_leaves_them_out(db: Path, backend: str) -> None:
    async def hide() -> None:
        from stepmachine import SetVisibility, submit

        async with await SQLiteStore.open(db) as store:
            await submit(store, "done", [SetVisibility(("u1",), to_model=False)])

    anyio.run(hide)
    stored = run(db, "show", "done", backend=backend).output
    assert "[hidden from the model]" in stored
    assert "weather?" in stored
    model = run(db, "show", "done", "--model-view", backend=backend).output
    assert "weather?" not in model
    assert "[hidden from the model]" not in model


def test_log_is_one_line_per_batch_with_refusals(db: Path, backend: str) -> None:
    result = run(db, "log", "done", backend=backend)
    assert result.exit_code == 0
    lines = result.output.splitlines()
    revision = load(db, "done").revision
    assert len(lines) == revision
    assert [int(line.split()[0]) for line in lines] == list(range(1, revision + 1))
    assert "inference" in lines[0]
    assert "refused:" in lines[0]
    as_json = [
        json.loads(x) for x in run(db, "log", "done", "--json", backend=backend).output.splitlines()
    ]
    assert [b["revision"] for b in as_json] == list(range(1, revision + 1))
    assert as_json[0]["refused"]  # the steps that refused before inference applied
    after = run(db, "log", "done", "--after", "2", "--json", backend=backend).output.splitlines()
    assert [json.loads(x)["revision"] for x in after] == list(range(3, revision + 1))
    assert json.loads(after[0])["elapsed"] is not None  # timed against batch 2


def test_unknown_session_is_a_clear_error(db: Path, backend: str) -> None:
    for command in (
        ["show", "nope"],
        ["log", "nope"],
        ["fsck", "nope"],
        ["export", "nope", "--json", "x"],
    ):
        result = run(db, *command, backend=backend)
        assert result.exit_code == 1, command
        assert "no session with id 'nope'" in result.output
        assert "Traceback" not in result.output


# -- fsck ---------------------------------------------------------------------------------------


def test_fsck_exit_status_says_whether_problems_were_found(db: Path, backend: str) -> None:
    clean = run(db, "fsck", "done", backend=backend)
    assert clean.exit_code == 0
    assert "no problems found" in clean.output

    async def broken() -> None:
        from stepmachine import ToolResultPart

        async with await SQLiteStore.open(db) as store:
            orphan = Message.tool_result(ToolResultPart("nope", "stray result"), id="t9")
            await store.create("broken", conversation=[Message.user("hi", id="u1"), orphan])

    anyio.run(broken)
    found = run(db, "fsck", backend=backend)
    assert found.exit_code == 1
    assert "broken: orphan_result" in found.output
    assert "done:" not in found.output
    assert run(db, "fsck", "done", backend=backend).exit_code == 0


# -- decisions ----------------------------------------------------------------------------------


def _pending_call_id(db: Path) -> str:
    (call,) = load(db, "approval").history.open_calls()
    return call.call_id


def test_approve_records_the_decision_and_the_next_run_pays(db: Path, backend: str) -> None:
    call_id = _pending_call_id(db)
    result = run(
        db,
        "approve",
        "approval",
        call_id,
        "--by",
        "ops@example",
        "--why",
        "invoice ok",
        backend=backend,
    )
    assert result.exit_code == 0, result.output
    (call,) = load(db, "approval").history.open_calls()
    decision = recorded_decision(call)
    assert decision is not None
    assert (decision.outcome, decision.by, decision.reason) == (
        "approved",
        "ops@example",
        "invoice ok",
    )
    assert run(db, "sessions", "list", "--status", "awaiting approval", "--json").output == ""

    async def resume() -> None:
        async with await SQLiteStore.open(db) as store:
            await inspector_agent.agent().run(inspector_agent.runtime(store), "approval")

    inspector_agent.PAID.clear()
    anyio.run(resume)
    assert inspector_agent.PAID == [("Alice", 120)]


def test_approve_with_edited_arguments_validates_them_against_the_tool(
    db: Path, backend: str
) -> None:
    call_id = _pending_call_id(db)
    no_tool = run(
        db,
        "approve",
        "approval",
        call_id,
        "--by",
        "me",
        "--args",
        '{"to": "Alice", "amount_eur": 100}',
        backend=backend,
    )
    assert no_tool.exit_code == 2
    assert "--tool" in no_tool.output
    before = load(db, "approval").revision
    bad = run(
        db,
        "approve",
        "approval",
        call_id,
        "--by",
        "me",
        "--args",
        '{"to": "Alice", "amount_eur": "lots"}',
        "--tool",
        "inspector_agent:send_payment",
        backend=backend,
    )
    assert bad.exit_code == 1
    assert "do not validate" in bad.output
    not_json = run(
        db,
        "approve",
        "approval",
        call_id,
        "--by",
        "me",
        "--args",
        "{oops",
        "--tool",
        "inspector_agent:send_payment",
        backend=backend,
    )
    assert not_json.exit_code == 2
    assert load(db, "approval").revision == before  # nothing written by a refused decision
    good = run(
        db,
        "approve",
        "approval",
        call_id,
        "--by",
        "me",
        "--args",
        '{"to": "Alice", "amount_eur": 100}',
        "--tool",
        "inspector_agent:send_payment",
        backend=backend,
    )
    assert good.exit_code == 0, good.output
    (call,) = load(db, "approval").history.open_calls()
    decision = recorded_decision(call)
    assert decision is not None
    assert decision.edited


def test_deny_tells_the_model_and_the_call_never_runs(db: Path, backend: str) -> None:
    call_id = _pending_call_id(db)
    missing = run(db, "deny", "approval", call_id, "--by", "me", backend=backend)
    assert missing.exit_code == 2  # --why is required: it is what the model is told
    result = run(
        db, "deny", "approval", call_id, "--by", "me", "--why", "not this month", backend=backend
    )
    assert result.exit_code == 0, result.output

    async def resume() -> Any:
        async with await SQLiteStore.open(db) as store:
            await inspector_agent.agent().run(inspector_agent.runtime(store), "approval")
            return await store.load("approval")

    inspector_agent.PAID.clear()
    session = anyio.run(resume)
    assert inspector_agent.PAID == []
    assert any(
        "not this month" in m.text
        or any(getattr(p, "content", "").find("not this month") >= 0 for p in m.parts)
        for m in session.conversation
    )
    again = run(db, "approve", "approval", call_id, "--by", "me", backend=backend)
    assert again.exit_code == 1
    assert "not pending" in again.output


def test_a_decision_on_a_call_that_does_not_exist_writes_nothing(db: Path, backend: str) -> None:
    before = load(db, "approval").revision
    result = run(db, "approve", "approval", "no-such-call", "--by", "me", backend=backend)
    assert result.exit_code == 1
    assert "no-such-call" in result.output
    assert load(db, "approval").revision == before


def test_resolve_unknown_answers_the_call_without_running_it(db: Path, backend: str) -> None:
    result = run(
        db,
        "resolve-unknown",
        "unknown",
        "c1",
        "--by",
        "ops",
        "--no-rerun",
        "--note",
        "paid by hand",
        backend=backend,
    )
    assert result.exit_code == 0, result.output
    session = load(db, "unknown")
    assert session.history.open_calls() == []
    assert (
        json.loads(run(db, "sessions", "list", "--match", "unknown", "--json").output)["status"]
        == "idle"
    )
    again = run(db, "resolve-unknown", "unknown", "c1", "--by", "ops", "--rerun", backend=backend)
    assert again.exit_code == 1


def test_submit_event_is_stored_once(db: Path, backend: str) -> None:
    result = run(
        db,
        "submit-event",
        "event",
        "job_done",
        "--payload",
        '{"ok": true}',
        "--id",
        "e1",
        backend=backend,
    )
    assert result.exit_code == 0, result.output
    (event,) = pending_events(load(db, "event"))
    assert (event.id, event.kind, event.payload) == ("e1", "job_done", {"ok": True})
    revision = load(db, "event").revision
    again = run(db, "submit-event", "event", "job_done", "--id", "e1", backend=backend)
    assert again.exit_code == 0
    assert "already stored" in again.output
    assert load(db, "event").revision == revision


def test_fork_copies_the_session_at_a_revision(db: Path, backend: str) -> None:
    result = run(db, "fork", "done", "--at", "1", "--as", "done-again", backend=backend)
    assert result.exit_code == 0, result.output
    fork = load(db, "done-again")
    assert fork.revision == 1
    assert [m.id for m in fork.conversation] == [m.id for m in load(db, "done").conversation[:2]]
    default = run(db, "fork", "done", "--at", "0", backend=backend)
    assert default.exit_code == 0
    assert load(db, "done-fork-0").revision == 0
    taken = run(db, "fork", "done", "--at", "1", "--as", "done-again", backend=backend)
    assert taken.exit_code == 1
    hostile = run(db, "fork", "done", "--at", "1", "--as", "../../etc/passwd", backend=backend)
    assert hostile.exit_code == 1


def test_export_json_writes_the_view(db: Path, tmp_path: Path, backend: str) -> None:
    out = tmp_path / "view.json"
    result = run(db, "export", "done", "--json", str(out), backend=backend)
    assert result.exit_code == 0, result.output
    view = json.loads(out.read_text())
    assert view["id"] == "done"
    assert [m["id"] for m in view["messages"]] == [m.id for m in load(db, "done").conversation]
    assert run(db, "export", "done", backend=backend).exit_code == 2  # nothing to write


# -- never writes when reading; errors ------------------------------------------------------------


def test_read_commands_never_write(db: Path, tmp_path: Path, backend: str) -> None:
    before = fingerprint_of(db.parent)
    for command in (
        ["sessions", "list"],
        ["show", "done"],
        ["show", "approval", "--json"],
        ["log", "budget"],
        ["fsck"],
        ["export", "done", "--json", str(tmp_path.parent / f"{tmp_path.name}-out.json")],
    ):
        assert run(db, *command, backend=backend).exit_code == 0, command
    assert fingerprint_of(db.parent) == before
    missing = tmp_path / "missing" / "agent.sqlite3"
    result = run(f"sqlite:///{missing}", "sessions", "list", backend=backend)
    assert result.exit_code == 1
    assert "no SQLite store" in result.output
    assert not missing.parent.exists()
    folder = tmp_path / "no-folder"
    assert run(f"file:///{folder}", "sessions", "list", backend=backend).exit_code == 1
    assert not folder.exists()


def test_an_old_schema_is_not_migrated_by_a_read(tmp_path: Path, backend: str) -> None:
    old = tmp_path / "store-v3.db"
    old.write_bytes(
        (ROOT / "tests" / "fixtures" / "golden" / "sqlite" / "store-v3.db").read_bytes()
    )
    before = old.read_bytes()
    result = run(old, "sessions", "list", backend=backend)
    assert result.exit_code == 1
    assert "read-only open does not migrate" in result.output
    assert "--codec" not in result.output  # not a decoding problem
    assert old.read_bytes() == before


def test_a_newer_schema_is_a_clear_error(db: Path, backend: str) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (99, 0)")
    before = db.read_bytes()
    for command in (["sessions", "list"], ["approve", "approval", "x", "--by", "me"]):
        result = run(db, *command, backend=backend)
        assert result.exit_code == 1
        assert "99" in result.output
        assert "Traceback" not in result.output
    assert db.read_bytes() == before


def test_store_urls(db: Path, tmp_path: Path, backend: str) -> None:
    memory = run("memory:", "sessions", "list", backend=backend)
    assert memory.exit_code == 2
    assert "in-memory" in memory.output
    unknown = run("redis://x", "sessions", "list", backend=backend)
    assert unknown.exit_code == 2
    nothing = CliRunner().invoke(cli, ["sessions", "list"], env={"STEPMACHINE_STORE": ""})
    assert nothing.exit_code == 2
    assert "STEPMACHINE_STORE" in nothing.output
    not_ours = tmp_path / "other.sqlite3"
    with sqlite3.connect(not_ours) as conn:
        conn.execute("CREATE TABLE users (id INTEGER)")
    foreign = run(not_ours, "sessions", "list", backend=backend)
    assert foreign.exit_code == 1
    assert "not a stepmachine store" in foreign.output

    async def file_store() -> None:
        async with await FileStore.open(tmp_path / "files") as store:
            await store.create("f1", conversation=[Message.user("hello from files", id="u1")])

    anyio.run(file_store)
    files = run(f"file://{tmp_path / 'files'}", "show", "f1", backend=backend)
    assert files.exit_code == 0, files.output
    assert "hello from files" in files.output


def test_sessions_with_application_data_need_the_codec(db: Path, backend: str) -> None:
    async def custom() -> None:
        async with await SQLiteStore.open(db, inspector_agent.codec) as store:
            await store.create(
                "ticket",
                inspector_agent.Ticket(ticket="T-1"),
                conversation=[Message.user("about my ticket", id="u1")],
            )

    anyio.run(custom)
    plain = run(db, "show", "ticket", backend=backend)
    assert plain.exit_code == 1
    assert "--codec" in plain.output
    listed = run(db, "sessions", "list", "--json", backend=backend)
    assert listed.exit_code == 0
    rows = {json.loads(x)["id"]: json.loads(x) for x in listed.output.splitlines()}
    assert rows["ticket"]["status"] == "unreadable"
    assert rows["done"]["status"] == "done"  # the others are still listed
    assert run(db, "fsck", backend=backend).exit_code == 1
    with_codec = run(db, "--codec", "inspector_agent:codec", "show", "ticket", backend=backend)
    assert with_codec.exit_code == 0, with_codec.output
    assert "about my ticket" in with_codec.output
    bad = run(db, "--codec", "inspector_agent:send_payment", "show", "ticket", backend=backend)
    assert bad.exit_code == 2
    assert "not a stepmachine Codec" in bad.output


def test_stored_text_cannot_drive_the_terminal(db: Path, backend: str) -> None:
    async def hostile() -> None:
        async with await SQLiteStore.open(db) as store:
            text = "\x1b[2J\x1b]0;owned\x07 [bold red]markup[/bold red] \u202eevil"
            await store.create("hostile", conversation=[Message.user(text, id="u1")])

    anyio.run(hostile)
    for command in (["show", "hostile"], ["log", "hostile"], ["sessions", "list"]):
        output = run(db, *command, backend=backend).output
        assert "\x1b" not in output
        assert "\u202e" not in output
    shown = run(db, "show", "hostile", backend=backend).output
    assert "\\x1b[2J" in shown
    assert "[bold red]markup[/bold red]" in shown  # printed as text, not interpreted


def test_python_dash_m_stepmachine(db: Path, backend: str) -> None:
    env = {**os.environ, "STEPMACHINE_STORE": f"sqlite:///{db}", "PYTHONPATH": str(ROOT)}
    listed = subprocess.run(
        [sys.executable, "-m", "stepmachine", "--backend", backend, "sessions", "list"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        cwd=db.parent,
    )
    assert listed.returncode == 0, listed.stderr
    assert "awaiting approval" in listed.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "stepmachine", "show", "nope"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        cwd=db.parent,
    )
    assert missing.returncode == 1
    assert "no session with id 'nope'" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_postgres_store(postgres_dsn: str, backend: str) -> None:
    from stepmachine.stores import PostgresStore

    empty = run(postgres_dsn, "sessions", "list", backend=backend)
    assert empty.exit_code == 1
    assert "holds no stepmachine store" in empty.output  # a read creates no schema

    async def check_untouched() -> None:
        import psycopg

        async with await psycopg.AsyncConnection.connect(postgres_dsn) as conn:
            cursor = await conn.execute(
                "SELECT count(*) FROM information_schema.schemata WHERE schema_name = 'stepmachine'"
            )
            assert await cursor.fetchone() == (0,)

    anyio.run(check_untouched)

    async def write() -> None:
        store = await PostgresStore.open(postgres_dsn)
        try:
            await store.create("p1", conversation=[Message.user("hello from postgres", id="u1")])
        finally:
            await store.aclose()

    anyio.run(write)
    shown = run(postgres_dsn, "show", "p1", backend=backend)
    assert shown.exit_code == 0, shown.output
    assert "hello from postgres" in shown.output
    assert (
        run(postgres_dsn, "fork", "p1", "--at", "0", "--as", "p2", backend=backend).exit_code == 0
    )
    listed = run(postgres_dsn, "sessions", "list", "--json", backend=backend)
    assert [json.loads(x)["id"] for x in listed.output.splitlines()] == ["p1", "p2"]


def test_export_html_writes_the_timeline(db: Path, tmp_path: Path, backend: str) -> None:
    out = tmp_path / "out.html"
    result = run(db, "export", "approval", "--html", str(out), backend=backend)
    assert result.exit_code == 0, result.output
    page = out.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    session = load(db, "approval")
    for message in session.conversation:
        assert f'id="msg-{message.id}"' in page
        if message.text:
            assert html.escape(message.text) in page
    (call,) = session.history.open_calls()
    assert f'id="call-{call.call_id}"' in page
    assert "awaiting approval" in page
    assert "http://" not in page
    assert "https://" not in page
    # --at: the timeline as it was; the file is replaced whole
    result = run(db, "export", "approval", "--html", str(out), "--at", "1", backend=backend)
    assert result.exit_code == 0
    assert 'id="rev-2"' not in out.read_text(encoding="utf-8")
    assert 'id="rev-1"' in out.read_text(encoding="utf-8")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("out.html")] == ["out.html"]


def test_serve_errors_before_listening(db: Path, tmp_path: Path, backend: str) -> None:
    missing = run(f"sqlite:///{tmp_path / 'missing.sqlite3'}", "serve", backend=backend)
    assert missing.exit_code == 1
    assert "no SQLite store" in missing.output
    memory = CliRunner().invoke(cli, ["serve", "memory:"])
    assert memory.exit_code == 2


def test_serve_serves_the_store_until_interrupted(db: Path, tmp_path: Path, backend: str) -> None:
    if backend == "trio":
        pytest.skip("serve runs uvicorn on asyncio whatever --backend says")
    import socket

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as sink:
        server = subprocess.Popen(
            [sys.executable, "-m", "stepmachine", "serve", f"sqlite:///{db}", "--port", str(port)],
            stdout=sink,
            stderr=sink,
            env=env,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            assert server.poll() is None, log.read_text()
            try:
                listed = httpx.get(f"{url}/api/sessions", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        else:
            pytest.fail("the server never answered")
        assert sorted(row["id"] for row in listed.json()) == sorted(
            inspector_agent.SESSIONS.values()
        )
        page = httpx.get(f"{url}/sessions/approval", timeout=5)
        assert page.status_code == 200
        assert "pay Alice" in page.text
        assert httpx.get(f"{url}/sessions/nope", timeout=5).status_code == 404
    finally:
        server.send_signal(signal.SIGINT)
        code = server.wait(timeout=30)
    assert code == 0, log.read_text()
    assert "Traceback" not in log.read_text()
