"""The docs: every Python block runs and type-checks, the site builds, every name is in it.

Every fenced ``python`` block of every page under ``docs/`` runs as written: the
blocks of one page run in order, each as a script in a subprocess, all in one
empty temporary folder of the page's own (so a later block sees the files an
earlier one wrote), without any provider key in the environment (blocks use
scripted models: no network). One test item per page, so pages run in parallel.

Marker lines, each an HTML comment on a line of its own right above a fence
(several may be stacked; blank lines between them and the fence are allowed;
any other comment there is an error, so a misspelt marker cannot be ignored):

``<!-- file: NAME.py -->``
    The block is saved as ``NAME.py`` in the page's folder, where later blocks
    of the page import it (``from refunds import ...``) or run it. It is also
    run, like every block, as ``python NAME.py`` (so ``__name__`` is
    ``"__main__"``): a module meant to be imported keeps its script part under
    ``if __name__ == "__main__":``, and that part's output is checked too.
``<!-- continues the previous block -->``
    The block runs with the code of the page's previous block (and of the
    blocks that one continues) in front of it. A block that the next block
    continues is not run on its own: the chain runs once, as its last block, so
    nothing runs twice in the page's folder (a ``file:`` block is still saved
    when the chain starts).
``<!-- requires: langgraph langchain_core -->``
    The block runs, and is type-checked, only when each of those modules can be
    imported; otherwise it is skipped, and the page's test reports the skip
    naming the missing modules (after running the page's other blocks). A block
    that continues a skipped block, or imports a ``file:`` block that was
    skipped, is skipped too.
``<!-- needs: postgres -->``
    The block gets ``DATABASE_URL``: a new, empty database on the test
    session's PostgreSQL server (``postgres_server`` in ``tests/conftest.py``);
    skipped, with the reason, when no server can be started here. A page with
    such a block is marked ``postgres``.

Output: a ``print(...)  # text`` line states what it prints. When every
``print`` line of the block that runs carries one, the block must print exactly
those lines, in order (``...`` matches anything); a block with a ``print`` line
that states nothing has its output unchecked. A block's exit status must be 0.

Types: every block is checked with ``mypy --strict``, one mypy run per page
(its ``file:`` blocks under their names, every other block that runs as
``block_L<line>.py``), with a mypy cache shared by the page runs of one test
worker. Blocks whose ``requires:`` modules are missing are left out of the run;
no ``--ignore-missing-imports``: the peers a page may import (LangGraph,
pydantic-ai, the OpenAI Agents SDK) ship their types, and an untyped import is
an error a reader's type checker would report too. mypy resolves ``stepmachine``
through the installed package (an editable install of this checkout).

Also here: ``mkdocs build --strict`` into a temporary folder, failing on any
warning; every name in the ``__all__`` of every public package appears as a
``::: package.name`` block in ``docs/reference/``; every page is in the nav;
every Python block is fenced as the runner sees it (a line ```` ```python ```` at
the start of a line: not ``py``, not indented, no title); no page cites a
guarantee by number or a file outside the repository.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import os
import pkgutil
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _public_names import is_private, private_uses
from _stated_output import expected_output, output_problem

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
MARKER = re.compile(r"^<!--\s*(?P<body>.*?)\s*-->$")
FILE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\.py$")
CONTINUES = "continues the previous block"
NEEDS = frozenset({"postgres"})
PROVIDER_VARIABLES = (
    "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY",
    "OPENAI_COMPATIBLE_BASE_URL",
    "OPENAI_COMPATIBLE_API_KEY",
    "GEMINI_API_KEY",
    "GOOGLE_API_KEY",
    "STEPMACHINE_MODEL",
)
# The public packages, each documented on its page of docs/reference/.
PUBLIC_ROOT = "stepmachine"


@dataclass(frozen=True)
class Block:
    """One ``python`` block of a page, with what its markers say.

    ``code`` is what runs: the block's own code with the code of the blocks it
    continues in front. ``requires`` and ``needs`` include those of the blocks
    it continues. ``continued`` says the next block continues this one.
    """

    line: int
    own: str
    code: str
    file: str | None = None
    requires: tuple[str, ...] = ()
    needs: frozenset[str] = frozenset()
    continues: bool = False
    continued: bool = False

    @property
    def script(self) -> str:
        """The file it runs as in the page's folder."""
        return self.file or f"block_L{self.line}.py"


def markers_above(text: str, start: int, line: int) -> list[str]:
    """The marker comments on the lines right above offset ``start`` (blank lines skipped)."""
    found: list[str] = []
    for above in reversed(text[:start].split("\n")[:-1]):
        stripped = above.strip()
        if not stripped:
            continue
        match = MARKER.match(stripped)
        if match is None:
            break
        found.append(match.group("body"))
    if any(body.startswith("--8<--") for body in found):
        raise ValueError(f"line {line}: a snippet comment above a python block")
    return found[::-1]


def python_blocks(text: str) -> list[Block]:
    """The ``python`` blocks of a page's ``text``, in order, with their markers applied.

    Raises:
        ValueError: an unknown marker, a bad file name, or a first block that continues nothing.
    """
    blocks: list[Block] = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        own = match.group(1)
        file: str | None = None
        requires: list[str] = []
        needs: set[str] = set()
        continues = False
        for body in markers_above(text, match.start(), line):
            key, _, value = body.partition(":")
            value = value.strip()
            if body == CONTINUES:
                continues = True
            elif key == "file" and FILE_NAME.match(value):
                file = value
            elif key == "requires" and value:
                requires += [m for m in re.split(r"[\s,]+", value) if m]
            elif key == "needs" and value in NEEDS:
                needs.add(value)
            else:
                raise ValueError(
                    f"line {line}: unknown marker <!-- {body} --> above a python block "
                    f"(known: '{CONTINUES}', 'file: NAME.py', 'requires: MODULE ...', "
                    f"'needs: {'|'.join(sorted(NEEDS))}')"
                )
        code = own
        if continues:
            if not blocks:
                raise ValueError(f"line {line}: the first block continues nothing")
            previous = blocks[-1]
            blocks[-1] = Block(**{**previous.__dict__, "continued": True})
            code = previous.code + own
            requires = [*previous.requires, *requires]
            needs |= previous.needs
        blocks.append(
            Block(
                line=line,
                own=own,
                code=code,
                file=file,
                requires=tuple(dict.fromkeys(requires)),
                needs=frozenset(needs),
                continues=continues,
            )
        )
    return blocks


def missing_modules(names: tuple[str, ...]) -> list[str]:
    """The modules among ``names`` that cannot be imported here."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def imported_modules(code: str) -> set[str]:
    """The top-level names of the modules ``code`` imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def skip_reasons(blocks: list[Block]) -> dict[int, str]:
    """Why a block is not run or type-checked here (missing modules), by its line."""
    reasons: dict[int, str] = {}
    skipped_files: set[str] = set()
    for index, block in enumerate(blocks):
        missing = missing_modules(block.requires)
        stems = imported_modules(block.code) & skipped_files
        if missing:
            reasons[block.line] = f"needs {', '.join(missing)} (not installed)"
        elif block.continues and blocks[index - 1].line in reasons:
            reasons[block.line] = f"continues the skipped block at line {blocks[index - 1].line}"
        elif stems:
            reasons[block.line] = f"imports the skipped {', '.join(sorted(stems))}"
        if block.line in reasons and block.file:
            skipped_files.add(block.file.removesuffix(".py"))
    return reasons


def page_blocks() -> dict[str, list[Block]]:
    """Every page under docs/ with python blocks: its path in docs/ -> its blocks."""
    pages = {}
    for path in sorted(DOCS.rglob("*.md")):
        blocks = python_blocks(path.read_text(encoding="utf-8"))
        if blocks:
            pages[path.relative_to(DOCS).as_posix()] = blocks
    return pages


PAGES = page_blocks()


def page_param(page: str) -> object:
    needs_postgres = any("postgres" in block.needs for block in PAGES[page])
    return pytest.param(page, id=page, marks=[pytest.mark.postgres] if needs_postgres else [])


def clean_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in PROVIDER_VARIABLES}


@dataclass
class PageRun:
    """The state of one page's run: its folder and the PostgreSQL server, asked for once."""

    folder: Path
    request: pytest.FixtureRequest
    server: str | None = None
    no_server: str | None = None
    skipped: list[str] = field(default_factory=list)

    def postgres_server(self) -> str | None:
        if self.server is None and self.no_server is None:
            try:
                self.server = self.request.getfixturevalue("postgres_server")
            except pytest.skip.Exception as exc:
                self.no_server = str(exc) or "no PostgreSQL server"
        return self.server

    @contextlib.contextmanager
    def environment(self, block: Block) -> Iterator[dict[str, str] | None]:
        """The block's environment: a new database when it needs PostgreSQL; None to skip it."""
        env = clean_environment()
        if "postgres" not in block.needs:
            yield env
            return
        server = self.postgres_server()
        if server is None:
            yield None
            return
        import _postgres

        with _postgres.fresh_database(server, prefix="stepmachine_docs") as dsn:
            yield {**env, "DATABASE_URL": dsn}


def run_script(name: str, folder: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, name],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )


@pytest.mark.parametrize("page", [page_param(page) for page in PAGES])
def test_page_blocks_run_as_written(
    page: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    blocks = PAGES[page]
    reasons = skip_reasons(blocks)
    run = PageRun(tmp_path, request)
    ran = 0
    for block in blocks:
        where = f"docs/{page}, the block at line {block.line}"
        if block.line in reasons:
            run.skipped.append(f"line {block.line}: {reasons[block.line]}")
            continue
        assert private_uses(block.own) == [], f"{where} uses private names"
        if block.file:
            (tmp_path / block.file).write_text(block.code, encoding="utf-8")
        if block.continued:
            continue  # runs once, with the block that continues it
        with run.environment(block) as env:
            if env is None:
                run.skipped.append(f"line {block.line}: {run.no_server}")
                continue
            (tmp_path / block.script).write_text(block.code, encoding="utf-8")
            done = run_script(block.script, tmp_path, env)
        ran += 1
        assert done.returncode == 0, (
            f"{where} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}"
        )
        expected = expected_output(block.code)
        if expected is not None:
            problem = output_problem(done.stdout, expected)
            assert problem is None, f"{where}: {problem}; it printed:\n{done.stdout}"
    if run.skipped:
        pytest.skip(f"docs/{page}: ran {ran} blocks; skipped " + "; ".join(run.skipped))


@pytest.mark.slow
@pytest.mark.parametrize("page", list(PAGES))
def test_page_blocks_type_check_under_mypy_strict(
    page: str, tmp_path: Path, mypy_cache: Path
) -> None:
    """What a page shows is what a reader's type checker accepts."""
    blocks = PAGES[page]
    reasons = skip_reasons(blocks)
    files = []
    for block in blocks:
        if block.line in reasons or (block.continued and not block.file):
            continue
        (tmp_path / block.script).write_text(block.code, encoding="utf-8")
        files.append(block.script)
    if not files:
        pytest.skip(f"docs/{page}: every block needs modules missing here")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(mypy_cache), *files],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = [
        re.sub(r"^block_L(\d+)\.py", r"the block at line \1", line)
        for line in (done.stdout + done.stderr).splitlines()
    ]
    assert done.returncode == 0, f"docs/{page}:\n" + "\n".join(lines)


def test_the_docs_have_their_pages_and_blocks() -> None:
    assert (DOCS / "index.md").exists()
    assert any(page.startswith("how-to/") for page in PAGES)
    assert sum(len(blocks) for blocks in PAGES.values()) >= 50


def test_every_python_fence_is_one_the_runner_sees() -> None:
    """A Python block fenced another way (```py, indented, with a title) would never run."""
    hidden = [
        f"docs/{path.relative_to(DOCS).as_posix()}:{number}: {line.strip()}"
        for path in sorted(DOCS.rglob("*.md"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.match(r"^\s*(```|~~~)\s*\{?\.?py(thon)?3?\b", line) and line != "```python"
    ]
    assert hidden == [], "fence Python blocks as a line of its own: ```python"


OUTSIDE = re.compile(r"\binvariants? ?\(?\d|DESIGN\.md|/work/|\bshared/conformance", re.IGNORECASE)


def test_the_docs_cite_no_guarantee_by_number_and_no_file_outside_the_repository() -> None:
    """A reader has the docs and a clone: guarantees are named in words, files are in the clone."""
    cited = [
        f"docs/{path.relative_to(DOCS).as_posix()}:{number}: {line.strip()}"
        for path in sorted(DOCS.rglob("*.md"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert cited == []
    assert OUTSIDE.search("see invariant 7")
    assert OUTSIDE.search("as DESIGN.md says")


def test_the_home_page_quickstart_is_the_agent_in_ten_lines() -> None:
    quickstart = PAGES["index.md"][0]
    assert len(quickstart.code.strip().splitlines()) <= 10
    assert "from stepmachine import Agent" in quickstart.code
    assert expected_output(quickstart.code) is not None  # its output is checked when it runs


# --- The site builds -----------------------------------------------------------------------------


def nav_pages(nav: object) -> list[str]:
    """Every page path in a mkdocs ``nav`` value."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    return []


def mkdocs_config() -> dict[str, object]:
    import yaml

    config: dict[str, object] = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    return config


def test_every_page_is_in_the_nav() -> None:
    in_nav = set(nav_pages(mkdocs_config()["nav"]))
    pages = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    assert pages - in_nav == set(), "pages no reader can reach: add them to nav in mkdocs.yml"
    assert in_nav - pages == set(), "nav entries with no page"


def test_the_site_builds_strictly_offline(tmp_path: Path) -> None:
    """``mkdocs build --strict``: no warning (a broken link or reference, a docstring)."""
    env = {**clean_environment(), "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )
    output = done.stdout + done.stderr
    warnings = [line for line in output.splitlines() if re.match(r"^(WARNING|ERROR)\b", line)]
    assert done.returncode == 0, output
    assert warnings == []
    home = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert "fonts.googleapis.com" not in home  # no web fonts: the site reads offline
    reference = (tmp_path / "site" / "reference" / "stepmachine" / "index.html").read_text(
        encoding="utf-8"
    )
    assert 'id="stepmachine.StateMachine"' in reference
    # The docstrings' Sphinx roles are links (docs/_ext/sphinx_roles.py), not literal text.
    assert ":class:" not in reference
    assert ":func:" not in reference
    assert 'href="#stepmachine.StateMachine"' in reference
    changelog = (tmp_path / "site" / "changelog" / "index.html").read_text(encoding="utf-8")
    assert "Unreleased" in changelog  # CHANGELOG.md, included


# --- Every public name is documented ------------------------------------------------------------


def public_packages() -> list[str]:
    """``stepmachine`` and every module under it with no private part in its dotted name."""
    found = [PUBLIC_ROOT]
    queue = [PUBLIC_ROOT]
    while queue:
        package = importlib.import_module(queue.pop())
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            last = info.name.rsplit(".", 1)[-1]
            if is_private(last) or last.startswith("__"):
                continue
            found.append(info.name)
            if info.ispkg:
                queue.append(info.name)
    return sorted(found)


def documented_identifiers() -> set[str]:
    """The identifiers of the ``::: identifier`` blocks in docs/reference/."""
    found: set[str] = set()
    for path in (DOCS / "reference").glob("*.md"):
        found.update(re.findall(r"^::: ([\w.]+)\s*$", path.read_text(encoding="utf-8"), re.M))
    return found


def test_the_public_packages_are_the_ones_the_reference_covers() -> None:
    assert public_packages() == [
        "stepmachine",
        "stepmachine.durable",
        "stepmachine.extend",
        "stepmachine.inspector",
        "stepmachine.operations",
        "stepmachine.providers",
        "stepmachine.stores",
        "stepmachine.testing",
        "stepmachine.testing.conformance",
        "stepmachine.testing.leases",
    ]


@pytest.mark.parametrize("package", public_packages())
def test_every_public_name_is_in_the_api_reference(package: str) -> None:
    documented = documented_identifiers()
    names = importlib.import_module(package).__all__
    assert names
    assert package in documented  # the package's own docstring
    missing = [name for name in names if f"{package}.{name}" not in documented]
    assert missing == [], f"add '::: {package}.NAME' to a page of docs/reference/"


def test_the_reference_documents_only_names_that_exist() -> None:
    stale = []
    for identifier in sorted(documented_identifiers()):
        module, _, name = identifier.rpartition(".")
        if identifier in public_packages():
            continue
        if name not in importlib.import_module(module).__all__:
            stale.append(identifier)
    assert stale == []


def test_the_reference_index_lists_every_page() -> None:
    index = (DOCS / "reference" / "index.md").read_text(encoding="utf-8")
    pages = sorted(p.name for p in (DOCS / "reference").glob("*.md") if p.name != "index.md")
    assert [page for page in pages if f"]({page})" not in index] == []


# --- The block runner itself ---------------------------------------------------------------------


def test_markers_apply_to_the_block_below() -> None:
    text = (
        "<!-- file: tools.py -->\n```python\nx = 1\n```\n\n"
        "<!-- continues the previous block -->\n<!-- needs: postgres -->\n\n"
        "```python\nprint(x)  # 1\n```\n\n"
        "<!-- requires: langgraph, not_a_module_here -->\n```python\nprint(2)  # 2\n```\n"
        "<!-- continues the previous block -->\n```python\nprint(3)\n```\n"
        "```python\nimport tools\n```\n"
    )
    first, second, third, fourth, fifth = python_blocks(text)
    assert (first.file, first.continued, first.line) == ("tools.py", True, 2)
    assert (second.code, second.continues, second.needs) == (
        "x = 1\nprint(x)  # 1\n",
        True,
        frozenset({"postgres"}),
    )
    assert second.script == "block_L9.py"
    assert third.requires == ("langgraph", "not_a_module_here")
    assert fourth.requires == third.requires  # a continuation needs what it continues
    assert expected_output(second.code) == ["1"]
    assert expected_output(fourth.code) is None  # print(3) states nothing
    reasons = skip_reasons([first, second, third, fourth, fifth])
    assert reasons[third.line].startswith("needs ")
    assert "not_a_module_here" in reasons[third.line]
    assert reasons[fourth.line] == reasons[third.line]
    assert fifth.line not in reasons
    assert (
        skip_reasons(
            [
                Block(1, "", "", file="a.py", requires=("not_a_module_here",)),
                Block(5, "import a\n", "import a\n"),
            ]
        )[5]
        == "imports the skipped a"
    )


def test_unknown_markers_and_a_first_continuation_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown marker"):
        python_blocks("<!-- file: my file.py -->\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="unknown marker"):
        python_blocks("<!-- continue the previous block -->\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="continues nothing"):
        python_blocks("<!-- continues the previous block -->\n```python\nx = 1\n```\n")
    # A comment separated from the fence by text is not a marker.
    assert python_blocks("<!-- anything -->\nText.\n```python\nx = 1\n```\n")[0].file is None


def test_stated_output_is_matched_line_by_line() -> None:
    assert output_problem("a 1\nb\n", ["a ...", "b"]) is None
    assert output_problem("a 1\n", ["a ...", "b"]) == "printed 1 lines, the block states 2"
    assert "does not match" in (output_problem("a\nc\n", ["a", "b"]) or "")
