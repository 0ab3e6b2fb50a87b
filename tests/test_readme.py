"""Every Python block of the README runs as written, and the README stays a short front page.

Each fenced ``python`` block is a script of its own: it is written to a file
in an empty temporary folder and run there in a subprocess. A block that
continues the previous one says so with the marker line
``<!-- continues the previous block -->`` right above its fence; it then runs
with the earlier block's code in front of it. A ``print(...)  # text`` line
states the output: when every ``print`` line of a block carries one, the
block must print exactly those lines, in order (``...`` matches anything).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from _public_names import private_uses
from _stated_output import expected_output, output_problem

from stepmachine import Session
from stepmachine.stores import SQLiteStore

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
MAX_README_LINES = 200
MAX_QUICKSTART_LINES = 10
CONTINUES = "<!-- continues the previous block -->"
FENCE = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
PROVIDER_VARIABLES = (
    "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY",
    "OPENAI_COMPATIBLE_BASE_URL",
    "GEMINI_API_KEY",
    "GOOGLE_API_KEY",
)


@dataclass(frozen=True)
class Block:
    """One runnable block: the README line its fence is on, and its code."""

    line: int
    code: str


def python_blocks(text: str) -> list[Block]:
    """The ``python`` blocks of ``text``, each joined to the ones it continues."""
    blocks: list[Block] = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        code = match.group(1)
        if before == CONTINUES:
            if not blocks:
                raise ValueError(f"README line {line}: the first block continues nothing")
            code = blocks[-1].code + code
        blocks.append(Block(line, code))
    return blocks


def run_block(code: str, folder: Path) -> subprocess.CompletedProcess[str]:
    script = folder / "readme_block.py"
    script.write_text(code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in PROVIDER_VARIABLES}
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


BLOCKS = python_blocks(README)


def page_blocks(page: str) -> list[Block]:
    """The python blocks of a page under ``docs/``, joined as in the README."""
    return python_blocks((ROOT / "docs" / page).read_text(encoding="utf-8"))


def test_the_readme_has_its_blocks() -> None:
    assert len(BLOCKS) >= 1
    assert "Agent(" in BLOCKS[0].code  # the quickstart uses the front door


def test_the_readme_is_a_front_page_of_at_most_200_lines() -> None:
    lines = README.splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines: move detail to docs/"


def test_the_readme_links_into_the_docs_and_to_every_how_to_guide() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    for page in (
        "docs/index.md",
        "docs/tutorial/index.md",
        "docs/concepts/index.md",
        "docs/reference/index.md",
        "docs/coming-from.md",
        "docs/how-to/providers.md",
    ):
        assert page in local, page
    how_to = {link for link in local if link.startswith("docs/how-to/")}
    # Every how-to guide on disk is linked; every how-to link names a page on disk.
    assert how_to == {f"docs/how-to/{p.name}" for p in (ROOT / "docs" / "how-to").glob("*.md")}


def test_the_why_lines_quote_measured_figures() -> None:
    why = README.split("## Why", 1)[1].split("\n## ", 1)[0]
    bullets = [b for b in why.split("\n- ") if b.strip().startswith("**")]
    assert len(bullets) in {3, 4}
    for bullet in bullets:
        assert re.search(r"\d", bullet), bullet  # each claim carries a figure
        source = r"`python [^`]+`|\d[\d,]* (?:times|calls)"  # the command or count behind it
        assert re.search(source, bullet), bullet


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"line{b.line}")
def test_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    done = run_block(block.code, tmp_path)
    assert done.returncode == 0, f"README block at line {block.line}:\n{done.stderr}"
    expected = expected_output(block.code)
    if expected is not None:
        problem = output_problem(done.stdout, expected)
        assert problem is None, f"README block at line {block.line}: {problem}:\n{done.stdout}"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"line{b.line}")
def test_block_imports_only_public_modules_and_names(block: Block) -> None:
    assert private_uses(block.code) == []


@pytest.mark.slow
def test_blocks_type_check_under_mypy_strict(tmp_path: Path, mypy_cache: Path) -> None:
    """What the README shows is what a user's type checker accepts."""
    files = []
    for block in BLOCKS:
        path = tmp_path / f"readme_line{block.line}.py"
        path.write_text(block.code, encoding="utf-8")
        files.append(path.name)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(mypy_cache), *files],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_quickstart_is_short_and_runs_offline_twice_continuing_the_session(tmp_path: Path) -> None:
    quickstart = BLOCKS[0].code
    assert len(quickstart.strip().splitlines()) <= MAX_QUICKSTART_LINES
    first = run_block(quickstart, tmp_path)
    assert first.returncode == 0, first.stderr
    database = tmp_path / "stepmachine.sqlite3"  # the Agent's embedded default store
    assert database.exists()
    second = run_block(quickstart, tmp_path)
    assert second.returncode == 0, second.stderr
    # The same answer, and the stored session continued: the first turn (question, tool call,
    # result, answer) is still there, and the second run added its own four messages to it.
    assert first.stdout.split() == ["2", "+", "3", "=", "5", "4"]
    assert second.stdout.split() == ["2", "+", "3", "=", "5", "8"]
    stored = anyio.run(load_read_only, database, "s1")
    assert [m.role for m in stored.conversation] == ["user", "assistant", "tool", "assistant"] * 2


async def load_read_only(database: Path, session_id: str) -> Session[Any]:
    async with await SQLiteStore.open(database, read_only=True) as store:
        assert await store.list_sessions() == [session_id]
        return await store.load(session_id)


def test_approving_from_another_process_is_shown_in_the_approval_guide() -> None:
    (block, *_) = [b for b in page_blocks("how-to/approval.md") if ".pending(" in b.code]
    assert "await approve(" in block.code
    assert "await deny(" in block.code
    assert "awaiting_approval" in (ROOT / "docs" / "how-to" / "approval.md").read_text()


def test_the_documented_step_list_builds_a_machine_in_the_documented_order() -> None:
    (block,) = [b for b in page_blocks("how-to/agents.md") if "steps = [" in b.code]
    namespace: dict[str, object] = {}
    exec(block.code, namespace)
    machine = namespace["machine"]
    names = [step.name for step in machine.steps]  # type: ignore[attr-defined]
    assert names[-1] == "inference"
    assert names.index("approval") < names.index("tools")


def test_readme_opens_with_what_it_is_then_install_then_the_example() -> None:
    lines = README.splitlines()
    assert lines[0] == "# stepmachine"
    assert lines[2].startswith("**Build LLM agents")

    def first(text: str) -> int:
        return next(i for i, line in enumerate(lines) if text in line)

    install = first("pip install")
    example = first("```python")
    assert install < example
    assert first("git+") < example  # from a git URL
    assert first("pip install -e") < example  # from a checkout
    # The two commands stay on the first screen, before the example.
    assert first("python3 dev.py demo") < min(example, 30)
    assert first("python3 dev.py test") < min(example, 30)
    # Contributor commands come after the example.
    for command in ("python3 dev.py lint", "python3 dev.py bench", "dev.py test -k"):
        assert first(command) > example
    assert first("## Development") > example


def test_the_extras_the_readme_names_exist() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = set(pyproject["project"]["optional-dependencies"])
    named = set(re.findall(r"stepmachine\[(\w+)\]", README))
    assert named
    assert named <= extras


def test_readme_commands_are_the_ones_dev_py_provides() -> None:
    assert "python3 dev.py demo" in README
    assert "python3 dev.py test" in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 dev.py test" in ci


def test_the_package_names_its_homes_and_ci_builds_it_as_a_release_would() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert set(project["urls"]) >= {"Documentation", "Changelog", "Source"}
    assert all(url.startswith("https://") for url in project["urls"].values())
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    steps = [line.split("#")[0].strip() for line in ci if line.startswith("python3 dev.py")]
    assert steps.index("python3 dev.py test") < steps.index("python3 dev.py package")
    assert steps.index("python3 dev.py package") < steps.index("python3 dev.py lint")
    dev = (ROOT / "dev.py").read_text()
    assert '"build", "--no-isolation"' in dev
    assert '"twine", "check", "--strict"' in dev


def test_the_changelog_has_released_and_unreleased_sections() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    versions = re.findall(r"^## \[(.+?)\](?: - (\d{4}-\d{2}-\d{2}))?$", changelog, re.MULTILINE)
    assert versions[0] == ("Unreleased", "")
    released = versions[1:]
    assert released, "earlier waves are released versions with dates"
    assert all(date for _, date in released)
    assert [date for _, date in released] == sorted((date for _, date in released), reverse=True)
    numbers = [tuple(int(n) for n in version.split(".")) for version, _ in released]
    assert numbers == sorted(numbers, reverse=True)
    package = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert tuple(int(n) for n in package.split(".")[:3]) > numbers[0]  # the next one is unreleased


def test_blocks_continue_only_when_marked() -> None:
    text = (
        "```python\nx = 1\n```\n\n"
        f"{CONTINUES}\n```python\nprint(x)  # 1\n```\n\n"
        "```python\nprint(2)  # 2\n```\n"
    )
    blocks = python_blocks(text)
    assert [b.code for b in blocks] == ["x = 1\n", "x = 1\nprint(x)  # 1\n", "print(2)  # 2\n"]
    assert [b.line for b in blocks] == [1, 6, 10]
    assert expected_output(blocks[1].code) == ["1"]
    with pytest.raises(ValueError, match="continues nothing"):
        python_blocks(f"{CONTINUES}\n```python\nx = 1\n```\n")
