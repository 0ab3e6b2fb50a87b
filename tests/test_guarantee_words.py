"""User-facing text names a guarantee in words, never by a number the user cannot look up.

The package's modules (docstrings and error messages alike), the examples and the README
are what a user reads; none of them cites "invariant N".
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NUMBERED = re.compile(r"\binvariants? ?\(?\d", re.IGNORECASE)
SUFFIXES = {".py", ".js", ".html", ".css"}
FOLDERS = ("stepmachine", "operations", "stores", "inspector", "examples")
# stepmachine/operations and stepmachine/stores are symlinks to the top-level folders:
# each file is read once, by its real path.
USER_TEXT = sorted(
    {
        path.resolve()
        for folder in FOLDERS
        for path in (ROOT / folder).rglob("*")
        if path.suffix in SUFFIXES and "__pycache__" not in path.parts and path.is_file()
    }
    | {ROOT / "README.md"}
)


def test_the_scan_sees_the_package() -> None:
    names = {path.name for path in USER_TEXT}
    assert {"_machine.py", "_codec.py", "_approval.py", "_sqlite.py", "README.md"} <= names


@pytest.mark.parametrize("path", USER_TEXT, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_guarantee_is_cited_by_number(path: Path) -> None:
    cited = [
        f"{number}: {line.strip()}"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if NUMBERED.search(line)
    ]
    assert cited == [], "name the guarantee in words (e.g. 'stored data is data'):\n" + "\n".join(
        cited
    )


def test_the_pattern_finds_a_numbered_citation() -> None:
    assert NUMBERED.search("a record does not decode (invariant 8)")
    assert NUMBERED.search("see invariants 2 and 3")
    assert not NUMBERED.search("stored data is data: the record does not decode")
