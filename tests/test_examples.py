"""The README's example and the runnable examples work as documented."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


PROVIDER_VARIABLES = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "OPENAI_COMPATIBLE_BASE_URL")


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


def test_readme_first_screen_example_runs_and_is_short(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    first = python_blocks(readme)[0]
    assert len(first.strip().splitlines()) <= 20
    script = tmp_path / "example.py"
    script.write_text(first)
    done = run([str(script)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2 + 3 = 5"
    assert (tmp_path / "agent.sqlite3").exists()  # the embedded default store was used


def test_readme_commands_are_the_ones_dev_py_provides() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "python3 dev.py demo" in readme
    assert "python3 dev.py test" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 dev.py test" in ci


def test_hello_world_prints_the_conversation(tmp_path: Path) -> None:
    done = run([str(ROOT / "examples" / "hello_world.py"), "--db", str(tmp_path / "db")], tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "model: scripted (no provider configured)" in out
    assert "store: SQLite" in out
    assert "-> get_weather(" in out
    assert "<- Sunny, 21 degrees C in Paris" in out
    assert out.rstrip().endswith("It is sunny in Paris, 21 °C. Enjoy your day!")
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


def test_readme_step_list_builds_a_machine() -> None:
    readme = (ROOT / "README.md").read_text()
    (block,) = [b for b in python_blocks(readme) if "steps = [" in b]
    from stepmachine import StateMachine, tool

    @tool
    def send_payment(to: str, amount: int) -> str:
        """Pay someone."""
        return "paid"

    @tool
    def lookup(query: str) -> str:
        """Look something up."""
        return "found"

    namespace: dict[str, object] = {"send_payment": send_payment, "lookup": lookup}
    exec(block, namespace)
    machine = StateMachine(namespace["steps"])  # type: ignore[arg-type]
    names = [step.name for step in machine.steps]
    assert names[-1] == "inference"
    assert names.index("approval") < names.index("tools")


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
