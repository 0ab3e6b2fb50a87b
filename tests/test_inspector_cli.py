"""The ``stepmachine`` command line, through Click's test runner, on stores written through
the public API (tests/fixtures/inspector_agent.py: one session of every status)."""

from __future__ import annotations

import hashlib
import html
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import anyio
import inspector_agent
import msgspec
import pytest
from click.testing import CliRunner, Result

from stepmachine import (
    AppendMessage,
    Message,
    ModelInference,
    ReasoningPart,
    StateMachine,
    StepmachineError,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    Tools,
    submit,
)
from stepmachine.inspector import STATUSES
from stepmachine.inspector._cli import cli
from stepmachine.operations import Budget, Limits, pending_events, recorded_decision
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
    with closing(sqlite3.connect(db)) as conn, conn:
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
    with closing(sqlite3.connect(not_ours)) as conn, conn:
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


HOSTILE = (
    "\x1b[2J\x1b]8;;http://evil\x07link\x1b]8;;\x07[bold]mk[/]\r\x08"
    "\u202eRTL\u2066\x9b31m\x85NEL\u2028LS\u2029PS\x7f"
)


RAW = ("\x1b", "\x07", "\r", "\x08", "\u202e", "\u2066", "\x9b", "\x85", "\u2028", "\u2029", "\x7f")


def run_cli(store: Path | str, *args: str, backend: str) -> Result:
    url = store if isinstance(store, str) else f"sqlite:///{store}"
    return CliRunner().invoke(cli, ["--store", url, "--backend", backend, *args])


def strict_json(text: str) -> Any:
    def refuse(token: str) -> Any:
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def _hostile_session(db: Path) -> None:
    async def main() -> None:
        async with await SQLiteStore.open(db) as store:
            call = ToolCallPart.of("c1", "tool" + HOSTILE, {"k": HOSTILE})
            await store.create(
                "hostile",
                conversation=[
                    Message.user(HOSTILE, id="u1"),
                    Message(
                        id="a1",
                        role="assistant",
                        parts=(ReasoningPart(HOSTILE), TextPart(HOSTILE), call),
                    ),
                    Message.tool_result(ToolResultPart("c1", HOSTILE, is_error=True), id="t1"),
                ],
            )
            await submit(store, "hostile", [AppendMessage(Message.user(HOSTILE, id="u2"))])

    anyio.run(main)


def test_json_output_never_carries_terminal_controls_and_splits_into_lines(
    db: Path, backend: str
) -> None:
    """Found: ``json.dumps(ensure_ascii=False)`` left C1 controls (``\\x9b`` is CSI), bidi
    overrides and U+2028/U+0085 raw in ``--json`` output; ``log --json`` lines then split
    apart under ``str.splitlines``. Fixed: ``_terminal.json_text`` escapes them."""
    _hostile_session(db)
    for command, one_document in (
        (["show", "hostile", "--json"], True),
        (["log", "hostile", "--json"], False),
        (["sessions", "list", "--json"], False),
    ):
        result = run_cli(db, *command, backend=backend)
        assert result.exit_code == 0, result.output
        assert [c for c in RAW if c in result.output] == [], command
        documents = [result.output] if one_document else result.output.splitlines()
        values = [strict_json(document) for document in documents]
        if command[0] == "show":
            (view,) = values
            assert view["messages"][0]["parts"][0]["text"] == HOSTILE  # escaped, not altered
        if command[0] == "log":
            assert [v["revision"] for v in values] == [1]


def test_json_output_is_strict_json_for_an_infinite_batch_timestamp(backend: str) -> None:
    """Found: a batch stored with an infinite timestamp (SQLite kept it; the durable stores
    now refuse one, but a database written before may hold it) came out as ``Infinity``,
    which is not JSON. Fixed: written as ``null``."""
    del backend  # the view and its JSON: no store, no event loop
    from stepmachine.extend import Batch
    from stepmachine.inspector import batch_view
    from stepmachine.inspector._terminal import json_text

    batch = Batch(
        "inf", 1, "application", 0, math.inf, (AppendMessage(Message.user("y", id="u1")),)
    )
    view = batch_view(batch, previous=0.0)
    decoded = strict_json(json_text(view))
    assert decoded["timestamp"] is None
    assert decoded["elapsed"] is None


def test_sqlite_store_refuses_a_non_finite_batch_timestamp(tmp_path: Path, backend: str) -> None:
    async def main() -> None:
        async with await SQLiteStore.open(tmp_path / "s.sqlite3") as store:
            await store.create("s", conversation=[Message.user("x", id="u0")])
            for value in (math.inf, math.nan):
                with pytest.raises(StepmachineError):
                    await submit(
                        store,
                        "s",
                        [AppendMessage(Message.user("y", id="u1"))],
                        clock=lambda value=value: value,  # type: ignore[misc]
                    )
            assert (await store.load("s")).revision == 0

    anyio.run(main, backend=backend)


# -- damaged file stores --------------------------------------------------------------------------


def _fingerprint(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): (p.read_bytes() if p.is_file() and not p.is_symlink() else b"")
        for p in sorted(folder.rglob("*"))
    }


def test_file_store_folder_with_junk_still_lists_the_good_sessions(
    tmp_path: Path, backend: str
) -> None:
    """Found: a ``*.log`` entry that is a directory or a symlink made ``sessions list``
    and ``fsck`` fail whole (an OSError), hiding every good session. Fixed: it is listed
    as unreadable and the others are still listed; nothing in the folder changes."""
    folder = tmp_path / "files"

    async def main() -> None:
        async with await FileStore.open(folder) as store:
            await store.create("good", conversation=[Message.user("hello", id="u1")])

    anyio.run(main)
    (folder / "junk.log").write_bytes(b"junk")
    (folder / "dir.log").mkdir()
    (folder / "link.log").symlink_to(tmp_path / "elsewhere.log")
    (folder / "notes.txt").write_text("not a session")
    before = _fingerprint(folder)
    listed = run_cli(f"file://{folder}", "sessions", "list", "--json", backend=backend)
    assert listed.exit_code == 0, listed.output
    rows = {row["id"]: row for row in map(json.loads, listed.output.splitlines())}
    assert rows["good"]["status"] == "idle"
    assert {rows[i]["status"] for i in ("junk", "dir", "link")} == {"unreadable"}
    checked = run_cli(f"file://{folder}", "fsck", backend=backend)
    assert checked.exit_code == 1
    assert "good:" not in checked.output
    assert "dir: unreadable" in checked.output
    assert "link: unreadable" in checked.output
    assert run_cli(f"file://{folder}", "show", "good", backend=backend).exit_code == 0
    assert _fingerprint(folder) == before


# -- decisions given odd input ---------------------------------------------------------------------


def _pending(db: Path) -> str:
    async def main() -> str:
        async with await SQLiteStore.open(db) as store:
            (call,) = (await store.load("approval")).history.open_calls()
            return call.call_id

    return anyio.run(main)


def _revision(db: Path, session_id: str) -> int:
    async def main() -> int:
        async with await SQLiteStore.open(db) as store:
            return (await store.load(session_id)).revision

    return anyio.run(main)


def test_edited_arguments_that_are_not_an_object_are_refused(db: Path, backend: str) -> None:
    """Found: ``--args null`` parsed to ``None``, which the API reads as "no edit": the call
    was approved with its original arguments, exit 0. Fixed: a usage error, nothing written."""
    call_id = _pending(db)
    before = _revision(db, "approval")
    for value in ("null", "[1]", '"Alice"', "3"):
        result = run_cli(
            db,
            "approve",
            "approval",
            call_id,
            "--by",
            "me",
            "--args",
            value,
            "--tool",
            "inspector_agent:send_payment",
            backend=backend,
        )
        assert result.exit_code == 2, (value, result.output)
        assert "JSON object" in result.output
    assert _revision(db, "approval") == before


def test_json_options_refuse_numbers_json_cannot_hold(db: Path, backend: str) -> None:
    """Found: ``--payload '{"x": NaN}'`` (and ``Infinity``, ``1e999``) was accepted and
    stored as ``null``. Fixed: not JSON, a usage error, nothing written."""
    before = _revision(db, "event")
    for payload in ('{"x": NaN}', '{"x": -Infinity}', '{"x": 1e999}'):
        result = run_cli(
            db, "submit-event", "event", "job_done", "--payload", payload, backend=backend
        )
        assert result.exit_code == 2, (payload, result.output)
    assert _revision(db, "event") == before
    ok = run_cli(
        db, "submit-event", "event", "job_done", "--payload", '{"x": 1.5e3}', backend=backend
    )
    assert ok.exit_code == 0, ok.output


def test_racing_approve_and_deny_from_two_processes_one_wins(db: Path, backend: str) -> None:
    """Holds: two processes deciding at once: exactly one decision is written; the other
    exits 1 naming the decision it lost to, with no traceback."""
    call_id = _pending(db)
    before = _revision(db, "approval")
    env = {
        **os.environ,
        "STEPMACHINE_STORE": f"sqlite:///{db}",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "fixtures")]),
    }
    base = [sys.executable, "-m", "stepmachine", "--backend", backend]
    processes = [
        subprocess.Popen(
            [*base, "approve", "approval", call_id, "--by", "A"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        ),
        subprocess.Popen(
            [*base, "deny", "approval", call_id, "--by", "B", "--why", "no"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        ),
    ]
    outcomes = []
    for process in processes:
        _, err = process.communicate(timeout=120)
        outcomes.append((process.returncode, err.decode()))
    assert sorted(code for code, _ in outcomes) == [0, 1]
    assert all("Traceback" not in err for _, err in outcomes)
    assert _revision(db, "approval") == before + 1


# -- status of sessions run by real machines ------------------------------------------------------


def test_budget_exhaustion_recorded_on_its_own_refusal_result_is_shown(
    tmp_path: Path, backend: str
) -> None:
    """Found: when the last message is the budget's own refused-call result, Budget merges
    its ``exhausted`` note into that result's record; ``show`` printed only the call id
    and never why the session stopped. Fixed: ``_records.records_in`` finds the nested
    record of the same tag. The status reads "budget exhausted" throughout, and a second
    run writes nothing new."""
    path = tmp_path / "budget.sqlite3"
    machine = StateMachine(
        [
            Budget(per_run=Limits(tool_calls=0), per_session=Limits(model_calls=1)),
            Tools([inspector_agent.lookup]),
            ModelInference(instructions="Help."),
        ]
    )

    async def main() -> list[int]:
        revisions = []
        async with await SQLiteStore.open(path) as store:
            await store.create("b", conversation=[Message.user("weather?", id="u1")])
            runtime = inspector_agent.runtime(store)
            for _ in range(3):
                await machine.run(runtime, "b")
                revisions.append((await store.load("b")).revision)
        return revisions

    revisions = anyio.run(main)
    assert revisions[1] == revisions[2]  # the exhaustion is recorded once
    listed = run_cli(path, "sessions", "list", "--json", backend=backend)
    assert json.loads(listed.output)["status"] == "budget exhausted"
    shown = run_cli(path, "show", "b", backend=backend)
    assert "model_calls budget per session exhausted (1 of 1)" in shown.output
    view = json.loads(run_cli(path, "show", "b", "--json", backend=backend).output)
    tags = [(r["key"], r["record"]) for r in view["messages"][-1]["records"]]
    assert (None, "stepmachine.budget.refusal") in tags
    assert ("exhausted", "stepmachine.budget.refusal") in tags


def test_event_payload_shaped_like_a_record_does_not_change_the_status(
    db: Path, backend: str
) -> None:
    """Holds: an event payload that looks like a budget refusal is data: the status of
    the session waiting for that event is not "budget exhausted"."""
    fake = json.dumps({"record": "stepmachine.budget.refusal", "refused": "x"})
    result = run_cli(db, "submit-event", "event", "other", "--payload", fake, backend=backend)
    assert result.exit_code == 0, result.output
    listed = run_cli(db, "sessions", "list", "--match", "event", "--json", backend=backend)
    assert json.loads(listed.output)["status"] != "budget exhausted"
    assert msgspec.json.decode(listed.output.encode())["id"] == "event"


_CHILD = """
import sys, time, anyio
from pathlib import Path
from stepmachine import Message, ModelInference, Runtime, StateMachine, Tools, counter_ids, tool
from stepmachine.stores import SQLiteStore
from stepmachine.testing import FunctionModel, call, reply

marker = Path(sys.argv[2])

@tool(thread=False, side_effects="non_idempotent")
async def pay(to: str) -> str:
    marker.write_text("started")
    await anyio.sleep(600)
    return "paid"

def model(request):
    return call(("pay", {"to": "Bob"})) if request.messages[-1].role == "user" else reply("ok")

async def main():
    async with await SQLiteStore.open(sys.argv[1]) as store:
        await store.create("k", conversation=[Message.user("pay Bob", id="u1")])
        machine = StateMachine([Tools([pay], on_unknown_outcome="yield"), ModelInference()])
        runtime = Runtime(store=store, model=FunctionModel(model), ids=counter_ids("m"))
        await machine.run(runtime, "k")

anyio.run(main)
"""


def test_a_real_crash_reads_outcome_unknown_until_an_operator_allows_a_rerun(
    tmp_path: Path, backend: str
) -> None:
    """Found: after ``resolve-unknown --rerun`` the session still read "outcome unknown"
    (and the call too), though the next run re-runs it. Fixed: a re-run allowed for the
    attempt reads "idle" (the call "open"). The crash is real: the agent process is
    killed (SIGKILL) inside a non-idempotent tool."""
    import signal
    import time

    from stepmachine import Runtime, tool
    from stepmachine.extend import counter_ids
    from stepmachine.testing import FunctionModel, call, reply

    path, marker = tmp_path / "k.sqlite3", tmp_path / "started"
    child = tmp_path / "child.py"
    child.write_text(_CHILD)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, str(child), str(path), str(marker)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert process.poll() is None, "the agent exited before its tool started"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait()

    def status() -> str:
        listed = run_cli(path, "sessions", "list", "--json", backend=backend)
        assert listed.exit_code == 0, listed.output
        return str(json.loads(listed.output)["status"])

    assert status() == "outcome unknown"
    paid: list[str] = []

    @tool(thread=False, side_effects="non_idempotent")
    def pay(to: str) -> str:
        paid.append(to)
        return "paid"

    def model(request: Any) -> Any:
        return call(("pay", {"to": "Bob"})) if request.messages[-1].role == "user" else reply("ok")

    async def resume() -> None:
        async with await SQLiteStore.open(path) as store:
            machine = StateMachine([Tools([pay], on_unknown_outcome="yield"), ModelInference()])
            runtime = Runtime(store=store, model=FunctionModel(model), ids=counter_ids("r"))
            await machine.run(runtime, "k")

    anyio.run(resume)
    assert paid == []  # never blindly re-run
    assert status() == "outcome unknown"
    view = json.loads(run_cli(path, "show", "k", "--json", backend=backend).output)
    (call_id,) = [
        p["call_id"] for m in view["messages"] for p in m["parts"] if p["type"] == "tool_call"
    ]
    decided = run_cli(
        path, "resolve-unknown", "k", call_id, "--by", "ops", "--rerun", backend=backend
    )
    assert decided.exit_code == 0, decided.output
    assert status() == "idle"
    shown = json.loads(run_cli(path, "show", "k", "--json", backend=backend).output)
    assert shown["messages"][1]["parts"][0]["state"] == "open"
    anyio.run(resume)
    assert paid == ["Bob"]
    assert status() == "done"


def test_codec_and_tool_specs_that_fail_are_one_line_errors(
    db: Path, tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found: ``--codec json:loads`` (a function that needs arguments) and a module that
    raises while it is imported ended in a traceback. Fixed: a usage error naming the spec
    and what was raised; nothing written."""
    (tmp_path / "broken_app.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.chdir(tmp_path)  # the cwd is on the import path, as for an application
    before = _revision(db, "approval")
    for args in (
        ["--codec", "json:loads", "sessions", "list"],
        ["--codec", "broken_app:codec", "show", "done"],
        ["approve", "approval", "x", "--by", "me", "--args", "{}", "--tool", "broken_app:t"],
    ):
        result = CliRunner().invoke(
            cli, ["--store", f"sqlite:///{db}", "--backend", backend, *args]
        )
        assert result.exit_code == 2, (args, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit), args
        assert "raised" in result.output
    assert _revision(db, "approval") == before


def _read_only_mount(folder: Path, command: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``command`` with ``folder`` bind-mounted read-only over itself (a private mount
    namespace: ``unshare -m``, which needs root or user namespaces)."""
    import shlex
    import shutil

    if shutil.which("unshare") is None:
        pytest.skip("no unshare here to make a read-only mount")
    script = (
        f"mount --bind {shlex.quote(str(folder))} {shlex.quote(str(folder))} && "
        f"mount -o remount,ro,bind {shlex.quote(str(folder))} || exit 77; " + shlex.join(command)
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode == 77 or "unshare failed" in done.stderr:
        pytest.skip(f"cannot make a read-only mount here: {done.stderr.strip()}")
    return done


def test_a_sqlite_store_on_read_only_media_reads(db: Path, tmp_path: Path, backend: str) -> None:
    """Found: a WAL database on a read-only mount (a backup, a read-only volume) could not
    be read: SQLite's ``mode=ro`` still creates the ``-shm`` file, and the failure was a raw
    ``sqlite3.OperationalError`` traceback; writes failed the same way. Fixed: with no
    ``-wal`` content to lose it is opened ``immutable``; otherwise, and for writes, one line,
    exit 1."""
    media = tmp_path / "media"
    media.mkdir()
    (media / "agent.sqlite3").write_bytes(db.read_bytes())  # the writer closed: no -wal
    url = f"sqlite:///{media / 'agent.sqlite3'}"
    base = [sys.executable, "-m", "stepmachine", "--store", url, "--backend", backend]
    listed = _read_only_mount(media, [*base, "sessions", "list", "--json"])
    assert listed.returncode == 0, listed.stderr
    assert len(listed.stdout.splitlines()) == len(inspector_agent.SESSIONS)
    write = _read_only_mount(media, [*base, "approve", "approval", "x", "--by", "me"])
    assert write.returncode == 1
    assert "Traceback" not in write.stderr
    (media / "agent.sqlite3-wal").write_bytes(b"not empty")
    unreadable = _read_only_mount(media, [*base, "show", "done"])
    assert unreadable.returncode == 1
    assert "Traceback" not in unreadable.stderr
    assert "-shm" in unreadable.stderr
    assert sorted(p.name for p in media.iterdir()) == ["agent.sqlite3", "agent.sqlite3-wal"]


# -- PostgreSQL -----------------------------------------------------------------------------------


def test_an_unreachable_postgres_server_is_one_line_at_once(backend: str) -> None:
    """Found: an unreachable server was a ``psycopg_pool.PoolTimeout`` traceback after the
    pool's 30 s. Fixed: one connection attempt first, libpq's reason on one error, exit 1,
    and a password in the URL is never repeated (invariant 12)."""
    pytest.importorskip("psycopg")
    for url in ("postgresql://ops:s3cr3t-pw@127.0.0.1:1/agent", "postgresql://ops:s3cr3t-pw@[::1"):
        result = run_cli(url, "sessions", "list", backend=backend)
        assert result.exit_code == 1, result.output
        assert "cannot connect to the PostgreSQL store" in result.output
        assert "s3cr3t-pw" not in result.output
        assert "Traceback" not in result.output


def test_postgres_read_commands_change_no_row(postgres_dsn: str, backend: str) -> None:
    """Holds: every read command on a PostgreSQL store leaves every row of every table of
    the store's schema as it was (leases included)."""
    import psycopg

    from stepmachine.stores import PostgresStore

    async def write() -> None:
        store = await PostgresStore.open(postgres_dsn)
        try:
            await store.create("p1", conversation=[Message.user("hello", id="u1")])
            await submit(store, "p1", [AppendMessage(Message.assistant("hi", id="a1"))])
        finally:
            await store.aclose()

    anyio.run(write)

    def dump() -> list[Any]:
        with psycopg.connect(postgres_dsn) as conn:
            tables = [
                row[0]
                for row in conn.execute(
                    "SELECT table_name FROM information_schema.tables "
                    "WHERE table_schema = 'stepmachine' ORDER BY table_name"
                )
            ]
            assert tables
            return [
                (table, sorted(map(repr, conn.execute(f'SELECT * FROM stepmachine."{table}"'))))
                for table in tables
            ]

    before = dump()
    for command in (
        ["sessions", "list"],
        ["show", "p1", "--json"],
        ["show", "p1", "--at", "0"],
        ["log", "p1"],
        ["fsck"],
        ["show", "nope"],
    ):
        result = run_cli(postgres_dsn, *command, backend=backend)
        assert result.exit_code == (1 if "nope" in command else 0), (command, result.output)
    assert dump() == before


_WRITER = """
import sys, anyio
from stepmachine import AppendMessage, Message, submit
from stepmachine.stores import FileStore, SQLiteStore

async def main(kind, path, ready):
    opened = SQLiteStore.open(path) if kind == "sqlite" else FileStore.open(path)
    async with await opened as store:
        await store.create("w", conversation=[Message.user("start", id="u0")])
        open(ready, "w").close()
        for i in range(100_000):
            await submit(store, "w", [AppendMessage(Message.user(f"msg {i}", id=f"m{i}"))])

anyio.run(main, *sys.argv[1:])
"""


@pytest.mark.parametrize("kind", ["sqlite", "file"])
def test_reads_while_another_process_writes(tmp_path: Path, kind: str, backend: str) -> None:
    """Holds: ``sessions list``, ``show --json`` and ``log --json`` on a session another
    process is appending to: every read succeeds and is consistent (the view's batches are
    exactly its revisions), and the reads take no lock that stops the writer."""
    import time

    path = tmp_path / ("w.sqlite3" if kind == "sqlite" else "files")
    url = f"sqlite:///{path}" if kind == "sqlite" else f"file://{path}"
    ready = tmp_path / "ready"
    writer = tmp_path / "writer.py"
    writer.write_text(_WRITER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, str(writer), kind, str(path), str(ready)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert process.poll() is None
            assert time.monotonic() < deadline
            time.sleep(0.05)
        seen = []
        for _ in range(4):
            for command in (["sessions", "list", "--json"], ["log", "w", "--json"]):
                result = run_cli(url, *command, backend=backend)
                assert result.exit_code == 0, (command, result.output)
            shown = run_cli(url, "show", "w", "--json", backend=backend)
            assert shown.exit_code == 0, shown.output
            view = json.loads(shown.output)
            assert [b["revision"] for b in view["batches"]] == list(range(1, view["revision"] + 1))
            assert len(view["messages"]) == view["revision"] + 1
            seen.append(view["revision"])
        assert process.poll() is None  # still writing: the reads never stopped it
        assert seen == sorted(seen)
    finally:
        process.kill()
        process.wait()


def test_a_decision_under_a_step_name_that_did_not_ask_is_refused(db: Path, backend: str) -> None:
    call_id = _pending(db)
    before = _revision(db, "approval")
    typo = run_cli(
        db, "approve", "approval", call_id, "--by", "me", "--name", "aproval", backend=backend
    )
    assert typo.exit_code == 1, typo.output
    assert _revision(db, "approval") == before


def _status(db: Path, session_id: str, backend: str) -> str:
    listed = run_cli(db, "sessions", "list", "--match", session_id, "--json", backend=backend)
    assert listed.exit_code == 0, listed.output
    return str(json.loads(listed.output)["status"])


def test_a_submitted_event_moves_the_status_on_before_the_next_run(db: Path, backend: str) -> None:
    """Found: after ``submit-event`` of the kind a session waits for, it still read
    "awaiting event" (and, once delivered would be next, a session could read "done" with an
    event undelivered). Fixed: an awaited event stored and not yet delivered reads "idle":
    the next run() has work; an event of another kind leaves it waiting."""
    assert _status(db, "event", backend) == "awaiting event"
    other = run_cli(db, "submit-event", "event", "unrelated", "--id", "x1", backend=backend)
    assert other.exit_code == 0, other.output
    assert _status(db, "event", backend) == "awaiting event"
    awaited = run_cli(db, "submit-event", "event", "job_done", "--id", "e1", backend=backend)
    assert awaited.exit_code == 0, awaited.output
    assert _status(db, "event", backend) == "idle"

    async def resume() -> None:
        async with await SQLiteStore.open(db) as store:
            await inspector_agent.agent().run(inspector_agent.runtime(store), "event")

    anyio.run(resume)
    assert _status(db, "event", backend) == "done"
    assert run_cli(db, "submit-event", "done", "later", backend=backend).exit_code == 0
    assert _status(db, "done", backend) == "idle"  # an undelivered event: not done


def test_damage_is_not_blamed_on_the_codec(tmp_path: Path, backend: str) -> None:
    """Found: every StoredDataError got the hint "reads with the application's codec:
    --codec", a malformed record header too. Fixed: only records that do not validate
    (what a codec decides) get it."""
    folder = tmp_path / "files"

    async def main() -> None:
        async with await FileStore.open(folder) as store:
            await store.create("good", conversation=[Message.user("hello", id="u1")])

    anyio.run(main)
    (folder / "junk.log").write_bytes(b"junk")
    damaged = run_cli(f"file://{folder}", "show", "junk", backend=backend)
    assert damaged.exit_code == 1
    assert "junk.log" in damaged.output
    assert "--codec" not in damaged.output


@pytest.mark.parametrize("by", ["", "   "])
def test_resolve_unknown_names_who_decided(db: Path, by: str, backend: str) -> None:
    before = _revision(db, "unknown")
    result = run_cli(
        db, "resolve-unknown", "unknown", "c1", "--by", by, "--no-rerun", backend=backend
    )
    assert result.exit_code == 1, result.output
    assert _revision(db, "unknown") == before


def test_deeply_nested_json_options_are_usage_errors(db: Path, backend: str) -> None:
    """Found: ``--payload`` / ``--args`` nested 50,000 deep ended in a RecursionError
    traceback. Fixed: a usage error; nothing written."""
    before = (_revision(db, "event"), _revision(db, "approval"))
    deep = "[" * 50_000 + "]" * 50_000
    event = run_cli(db, "submit-event", "event", "k", "--payload", deep, backend=backend)
    assert event.exit_code == 2, event.output
    assert "nested too deeply" in event.output
    approval = run_cli(
        db,
        "approve",
        "approval",
        _pending(db),
        "--by",
        "me",
        "--args",
        '{"to": ' + deep + "}",
        "--tool",
        "inspector_agent:send_payment",
        backend=backend,
    )
    assert approval.exit_code == 2, approval.output
    assert (_revision(db, "event"), _revision(db, "approval")) == before


def test_a_deeply_nested_stored_payload_reads_in_every_form(db: Path, backend: str) -> None:
    """Holds: an event payload nested 900 deep (as deep as the option takes) is shown,
    logged and exported as JSON (a recursive clean-up of the view would hit the recursion
    limit here)."""
    deep = "[" * 900 + "]" * 900
    stored = run_cli(db, "submit-event", "event", "k", "--payload", deep, backend=backend)
    assert stored.exit_code == 0, stored.output
    for command in (["show", "event", "--json"], ["log", "event", "--json"], ["show", "event"]):
        result = run_cli(db, *command, backend=backend)
        assert result.exit_code == 0, (command, result.output[-500:])


def test_an_empty_file_is_not_called_an_old_store(tmp_path: Path, backend: str) -> None:
    """Found: reading a zero-byte file (or an empty SQLite database) said "schema version 0
    ... open it for writing once to migrate it", advice that would turn any empty file into a
    store. Fixed: it holds no store; the file is left as it was."""
    empty = tmp_path / "empty.sqlite3"
    empty.write_bytes(b"")
    result = run_cli(empty, "sessions", "list", backend=backend)
    assert result.exit_code == 1
    assert "holds no stepmachine store" in result.output
    assert "migrate" not in result.output
    assert empty.read_bytes() == b""


# -- issue 22 ---------------------------------------------------------------------------------


def test_export_to_a_dash_writes_standard_output(
    db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """Found: ``export ID --html -`` wrote a file named ``-``. ``-`` is standard output."""
    monkeypatch.chdir(tmp_path)
    html = run_cli(db, "export", "done", "--html", "-", backend=backend)
    assert html.exit_code == 0, html.output
    assert html.output.startswith("<!DOCTYPE html>")
    assert "wrote" not in html.output
    as_json = run_cli(db, "export", "done", "--json", "-", backend=backend)
    assert as_json.exit_code == 0, as_json.output
    assert strict_json(as_json.output)["id"] == "done"
    assert not (tmp_path / "-").exists()
    both = run_cli(db, "export", "done", "--html", "-", "--json", "-", backend=backend)
    assert both.exit_code == 2
    assert "one of --html and --json" in both.output


def test_help_texts_show_no_markup_and_the_package_names_every_store_and_provider(
    backend: str,
) -> None:
    """Found: ``serve --help`` showed raw reST (````web````); the package docstring named
    neither PostgreSQL nor Gemini."""
    commands = [["--help"]]
    for name, command in cli.commands.items():
        subcommands = getattr(command, "commands", {})
        commands += [[name, sub, "--help"] for sub in subcommands] or [[name, "--help"]]
    assert ["serve", "--help"] in commands
    for command in commands:
        shown = CliRunner().invoke(cli, command)
        assert shown.exit_code == 0, shown.output
        assert "``" not in shown.output, command
    import stepmachine

    doc = stepmachine.__doc__ or ""
    for name in ("PostgresStore", "Gemini", "SQLiteStore", "FileStore", "Anthropic"):
        assert name in doc, name
