"""User-facing text names a guarantee in words, and points only at files in the repository.

The package's modules (docstrings and error messages alike), the examples, the README, the
documentation under ``docs/`` and the CHANGELOG (rendered into the documentation site) are
what a user reads, with a clone of the repository at hand; none of them cites "invariant N",
and none sends the reader to a file the clone does not hold (a design document, a folder
beside the checkout, a path on the development machine).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from _media_damage import damage_same_size

from stepmachine import ConflictError, ImagePart, Message, StoredDataError
from stepmachine.stores import FileStore

ROOT = Path(__file__).resolve().parent.parent
NUMBERED = re.compile(r"\binvariants? ?\(?\d", re.IGNORECASE)
OUTSIDE = re.compile(
    r"\bDESIGN(?:\.md|\s*§)"  # the design document, by name or by section
    r"|(?<![\w.])(?:\.\./)+shared\b"  # a folder beside the checkout
    r"|\bshared/(?:DESIGN|conformance)\b"
    r"|/work/(?:main|shared|wt|notes)\b",  # paths of the development machine
    re.IGNORECASE,
)
SUFFIXES = {".py", ".js", ".html", ".css", ".md"}
FOLDERS = ("stepmachine", "operations", "stores", "inspector", "examples", "docs")
# stepmachine/operations and stepmachine/stores are symlinks to the top-level folders:
# each file is read once, by its real path.
USER_TEXT = sorted(
    {
        path.resolve()
        for folder in FOLDERS
        for path in (ROOT / folder).rglob("*")
        if path.suffix in SUFFIXES and "__pycache__" not in path.parts and path.is_file()
    }
    | {ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "CONTRIBUTING.md"}
)


def test_the_scan_sees_the_package_the_readme_and_the_docs() -> None:
    names = {path.relative_to(ROOT).as_posix() for path in USER_TEXT}
    assert {
        "stepmachine/_machine.py",
        "stepmachine/_codec.py",
        "operations/_approval.py",
        "stores/_sqlite.py",
        "README.md",
        "CHANGELOG.md",
        "docs/how-to/approval.md",
        "docs/how-to/providers.md",
    } <= names


def cited(path: Path, pattern: re.Pattern[str]) -> list[str]:
    return [
        f"{number}: {line.strip()}"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]


@pytest.mark.parametrize("path", USER_TEXT, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_guarantee_is_cited_by_number(path: Path) -> None:
    found = cited(path, NUMBERED)
    assert found == [], "name the guarantee in words (e.g. 'stored data is data'):\n" + "\n".join(
        found
    )


@pytest.mark.parametrize("path", USER_TEXT, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_file_outside_the_repository_is_cited(path: Path) -> None:
    found = cited(path, OUTSIDE)
    assert found == [], "say it here, or point at a file in the repository:\n" + "\n".join(found)


def test_the_pattern_finds_a_numbered_citation() -> None:
    assert NUMBERED.search("a record does not decode (invariant 8)")
    assert NUMBERED.search("see invariants 2 and 3")
    assert not NUMBERED.search("stored data is data: the record does not decode")


def test_the_pattern_finds_a_file_outside_the_repository() -> None:
    assert OUTSIDE.search("The design and its invariants: `../shared/DESIGN.md`.")
    assert OUTSIDE.search("each class documents the invariant (DESIGN §3) it protects")
    assert OUTSIDE.search("replays every recording in `../shared/conformance/cassettes/`")
    assert OUTSIDE.search("print(out.getvalue().replace('/work/main/', ''))")
    assert not OUTSIDE.search("the recordings in `tests/fixtures/conformance/`")
    assert not OUTSIDE.search("shared fixtures; a session-scoped server is shared/reused")
    assert not OUTSIDE.search("design: the cycle, in docs/concepts/index.md")


# -- the errors raised and the public docstrings -------------------------------------------


def _img_msg(data: bytes, mid: str = "u1") -> Message:
    return Message.user("look", id=mid, media=[ImagePart(media_type="image/png", data=data)])


_NUMBERED = re.compile(r"\binvariant \d+\b", re.IGNORECASE)


async def test_errors_name_guarantees_in_words_not_numbers(tmp_path: Path) -> None:
    shown: list[str] = [str(ConflictError("s", 1, 2))]
    data = os.urandom(2000)
    async with await FileStore.open(tmp_path / "files") as store:
        await store.create("s1", conversation=[_img_msg(data)])
    damage_same_size("file", tmp_path, data)
    async with await FileStore.open(tmp_path / "files") as store:
        with pytest.raises(StoredDataError) as caught:
            await store.load("s1")
    shown.append(str(caught.value))
    assert "stored data is data" in shown[1] or "damaged" in shown[1]
    numbered = [text[:120] for text in shown if _NUMBERED.search(text)]
    assert not numbered, numbered


def test_public_docstrings_name_guarantees_in_words() -> None:
    import stepmachine

    numbered = []
    for name in stepmachine.__all__:
        doc = getattr(getattr(stepmachine, name), "__doc__", None) or ""
        if _NUMBERED.search(doc) and not isinstance(getattr(stepmachine, name), str):
            numbered.append(name)
    assert not numbered, numbered
