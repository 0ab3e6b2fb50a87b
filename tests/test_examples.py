"""The runnable examples work as documented and use only public names."""

from __future__ import annotations

import keyword
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import _postgres
import pytest
from _public_names import is_private, private_uses
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


PROVIDER_VARIABLES = (
    "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY",
    "OPENAI_COMPATIBLE_BASE_URL",
    "GEMINI_API_KEY",
    "GOOGLE_API_KEY",
    "STEPMACHINE_POSTGRES",  # examples/workers.py's database: each test says which it uses
)


def run(
    args: list[str], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a script with no provider configured (unless ``env`` adds one)."""
    clean = {k: v for k, v in os.environ.items() if k not in PROVIDER_VARIABLES}
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**clean, **(env or {})},
    )


def test_hello_world_prints_the_conversation(tmp_path: Path) -> None:
    done = run([str(ROOT / "examples" / "hello_world.py"), "--db", str(tmp_path / "db")], tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "model: scripted (no provider configured)" in out
    assert "store: SQLite" in out
    assert "-> get_weather(" in out
    assert "<- Sunny, 21 degrees C in Paris" in out
    conversation, hint = out.split("\ninspect it: ", 1)
    assert conversation.rstrip().endswith("It is sunny in Paris, 21 °C. Enjoy your day!")
    # The command it prints to inspect the session works as printed, from the
    # same directory, with no virtual environment on PATH (the interpreter it
    # names is the one that ran the demo).
    command = shlex.split(hint.splitlines()[0])
    assert command[1:3] == ["-m", "stepmachine"], command
    shown = subprocess.run(
        command,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PATH": "/usr/bin:/bin"},
    )
    assert shown.returncode == 0, shown.stderr
    assert "Weather in Paris?" in shown.stdout
    assert "[answered]" in shown.stdout
    # Running it again adds a second session to the same database.
    again = run([str(ROOT / "examples" / "hello_world.py"), "--db", str(tmp_path / "db")], tmp_path)
    assert again.returncode == 0, again.stderr
    assert "done at revision" in again.stdout


def test_hello_world_runs_on_trio(tmp_path: Path) -> None:
    done = run(
        [
            str(ROOT / "examples" / "hello_world.py"),
            "--db",
            str(tmp_path / "db"),
            "--backend",
            "trio",
        ],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "Enjoy your day!" in done.stdout


def test_hello_world_uses_a_configured_provider(tmp_path: Path) -> None:
    # An OpenAI-compatible server that is not there: the demo must pick the real
    # adapter (and say so), then fail with a typed connection error, not run scripted.
    env = {"OPENAI_COMPATIBLE_BASE_URL": "http://127.0.0.1:9/v1", "STEPMACHINE_MODEL": "tiny"}
    done = run(
        [str(ROOT / "examples" / "hello_world.py"), "--db", str(tmp_path / "db")], tmp_path, env
    )
    assert "model: openai_compatible:tiny" in done.stdout
    assert "scripted" not in done.stdout
    assert done.returncode != 0
    assert "ProviderConnectionError" in done.stderr


def test_there_are_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {
        "hello_world.py",
        "approval.py",
        "compaction.py",
        "workers.py",
        "inspector.py",
        "mcp.py",
        "vision.py",
    }


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_vision_example_sends_an_image_and_a_pdf(tmp_path: Path, backend: str) -> None:
    db = tmp_path / "demo-data" / "vision.sqlite3"
    command = [str(ROOT / "examples" / "vision.py"), "--db", str(db), "--backend", backend]
    done = run(command, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "model: scripted (no provider configured)" in out
    assert "image and PDF stored intact: True" in out
    assert "     user: [ImagePart image/png, " in out
    assert "     user: [DocumentPart application/pdf, " in out
    assert '-> lookup_invoice({"number":"INV-42"})' in out
    assert "<- paid on 2026-11-20" in out


def test_vision_example_uses_a_configured_gemini_key(tmp_path: Path) -> None:
    # A Gemini server that is not there: the example must pick the real adapter, which
    # takes images and PDFs (no ConfigurationError), and fail to connect.
    env = {"GEMINI_API_KEY": "test-key", "GEMINI_BASE_URL": "http://127.0.0.1:9/v1beta"}
    done = run([str(ROOT / "examples" / "vision.py"), "--db", str(tmp_path / "db")], tmp_path, env)
    assert "model: gemini:gemini-2.5-flash" in done.stdout
    assert done.returncode != 0
    assert "ProviderConnectionError" in done.stderr
    assert "ConfigurationError" not in done.stderr
    assert "test-key" not in done.stdout + done.stderr


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_mcp_example_runs_an_agent_on_its_own_stdio_server(tmp_path: Path, backend: str) -> None:
    db = tmp_path / "demo-data" / "mcp.sqlite3"
    command = [str(ROOT / "examples" / "mcp.py"), "--db", str(db), "--backend", backend]
    done = run(command, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "model: scripted (no provider configured)" in out
    assert "MCP server: {'notebook': 'up'}" in out
    assert "tool add_note: non_idempotent" in out  # from its annotations
    assert "tool count_words: pure" in out
    assert "     tool: <- 7\n" in out  # count_words ran on the server
    notes = db.with_suffix(".notes.txt").read_text().splitlines()
    assert notes == ["MCP tools run through the stepmachine journal (7 words)"]
    assert f"     tool: <- {notes[0]}" in out  # list_notes read what add_note wrote
    assert ": done at revision" in out


def test_inspector_runs_the_command_on_the_demos_database(tmp_path: Path) -> None:
    db = tmp_path / "demo-data" / "hello_world.sqlite3"
    done = run([str(ROOT / "examples" / "inspector.py"), "--db", str(db)], tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    out = done.stdout
    for command in ("sessions list", "show hello-", "log hello-", "fsck", "approve pay-"):
        assert f"$ stepmachine {command}" in out
    assert "awaiting approval" in out  # listed before the approval
    assert "approved by you: invoice checked" in out  # the audit log after it
    assert "final answer: Done: paid 120 EUR to Alice." in out
    (html,) = db.parent.glob("pay-*.html")
    page = html.read_text(encoding="utf-8")
    assert "paid 120 EUR to Alice" in page
    assert "invoice checked" in page


def check_workers_output(out: str) -> None:
    """What examples/workers.py must show: a kill, a takeover, every session done, no duplicate."""
    assert "model: scripted (no provider configured)" in out
    killed = re.search(r"\[main\] SIGKILL (w\d+) \(pid \d+\) in the middle of (\S+)'s", out)
    assert killed is not None, out
    victim, session_id = killed.groups()
    after = out[killed.end() :]
    # Another worker runs the killed worker's session afterwards.
    others = re.findall(rf"\[(w\d+)\] {re.escape(session_id)}: running", after)
    assert others, out
    assert victim not in others
    # ... and runs the interrupted call again, which the idempotency key deduplicates.
    assert re.search(rf"{re.escape(session_id)}: .* had taken effect already", after), out
    assert "every session is done:" in out
    effects = re.search(r"side effects: (\d+) rows for (\d+) idempotency keys", out)
    assert effects is not None, out
    assert effects[1] == effects[2]


@pytest.mark.slow
def test_workers_example_runs_as_written(tmp_path: Path) -> None:
    # As written: no DSN, so the example starts (and removes) a PostgreSQL server of its own.
    without = {k: v for k, v in os.environ.items() if k != _postgres.ENV_VAR}
    reason = _postgres.unavailable_reason(without)
    if reason is not None:
        pytest.skip(f"no PostgreSQL server can be started here: {reason}")
    pytest.importorskip("psycopg", reason="the postgres extra is not installed")
    done = run([str(ROOT / "examples" / "workers.py")], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[main] started a throwaway PostgreSQL server" in done.stdout
    check_workers_output(done.stdout)


@pytest.mark.slow
def test_workers_example_on_trio_with_a_given_database(postgres_dsn: str, tmp_path: Path) -> None:
    command = [str(ROOT / "examples" / "workers.py"), "--backend", "trio", "--workers", "2"]
    done = run([*command, "--dsn", postgres_dsn], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "throwaway" not in done.stdout
    check_workers_output(done.stdout)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_import_only_public_modules_and_names(example: Path) -> None:
    assert private_uses(example.read_text(encoding="utf-8")) == []


def test_private_uses_reports_each_form() -> None:
    source = (
        "import stepmachine\n"
        "import stepmachine.operations._approval\n"
        "from stepmachine.operations._compaction import Compaction\n"
        "from stepmachine import _errors, __version__\n"
        "from stepmachine.operations import Approval, HistoryGuard\n"
        "x = stepmachine._machine.StateMachine\n"
        "y = Approval._private\n"
        "z = stepmachine.operations.Approval\n"
    )
    assert private_uses(source) == [
        "line 2: import stepmachine.operations._approval",
        "line 3: from stepmachine.operations._compaction import ...",
        "line 4: from stepmachine import _errors",
        "line 6: stepmachine._machine",
        "line 7: Approval._private",
    ]


COMPONENT = st.from_regex(r"_{0,2}[a-z][a-z0-9]{0,6}(__)?", fullmatch=True).filter(
    lambda name: not keyword.iskeyword(name)  # `import if` is a SyntaxError, not a name
)


@given(
    path=st.lists(COMPONENT, min_size=1, max_size=4),
    names=st.lists(COMPONENT, min_size=1, max_size=3),
    form=st.sampled_from(["import", "import_as", "from"]),
)
def test_an_import_is_reported_exactly_when_a_component_is_private(
    path: list[str], names: list[str], form: str
) -> None:
    module = ".".join(path)
    if form == "import":
        source, parts = f"import {module}\n", path
    elif form == "import_as":
        source, parts = f"import {module} as alias\n", path
    else:
        source, parts = f"from {module} import {', '.join(names)}\n", [*path, *names]
    assert bool(private_uses(source)) == any(is_private(p) for p in parts)
