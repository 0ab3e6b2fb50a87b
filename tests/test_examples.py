"""The README's example and the runnable examples work as documented."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
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
