"""How stepmachine is built and installed.

The repository keeps ``operations/``, ``stores/`` and ``inspector/`` beside ``stepmachine/``;
relative symlinks put them inside the ``stepmachine`` namespace. These tests
build the sdist and the wheel with the build backend and look inside, and
install the checkout into a fresh virtual environment the way a user would
(``pip install -e .``) and type-check a user's file against it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("operations", "stores", "inspector")


def build(kind: str, source: Path, out: Path) -> Path:
    """Build a ``wheel`` or ``sdist`` of ``source`` with hatchling; its path."""
    done = subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "-t", kind, "-d", str(out)],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    (built,) = out.glob("*.whl" if kind == "wheel" else "*.tar.gz")
    return built


def expected_wheel_files() -> set[str]:
    """Every file of the package in the checkout, as the wheel should name it."""
    files = {
        f"stepmachine/{p.relative_to(ROOT / 'stepmachine').as_posix()}"
        for p in (ROOT / "stepmachine").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    for package in SUBPACKAGES:
        files |= {
            f"stepmachine/{package}/{p.relative_to(ROOT / package).as_posix()}"
            for p in (ROOT / package).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        }
    return files


def package_files(names: list[str]) -> set[str]:
    return {n for n in names if ".dist-info/" not in n}


def test_the_subpackages_are_relative_symlinks_into_the_namespace() -> None:
    for package in SUBPACKAGES:
        link = ROOT / "stepmachine" / package
        assert link.is_symlink(), f"{link} should be a symlink to ../{package}"
        assert os.readlink(link) == f"../{package}"
        assert link.resolve() == (ROOT / package).resolve()


def test_the_subpackages_import_from_the_repository_root() -> None:
    """``python -c "import stepmachine.operations"`` works where the checkout shadows installs."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import stepmachine.operations, stepmachine.stores\n"
                "print(stepmachine.operations.Approval.__module__)\n"
                "print(stepmachine.stores.SQLiteStore.__module__)"
            ),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["stepmachine.operations", "stepmachine.stores"]


def test_wheel_holds_everything_under_stepmachine_and_nothing_generic(tmp_path: Path) -> None:
    wheel = build("wheel", ROOT, tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = Parser().parsestr(
            archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        )
    top_level = {name.split("/", 1)[0] for name in names}
    assert top_level == {"stepmachine", wheel.name.split("-py3")[0] + ".dist-info"}
    assert not any(name.startswith(tuple(f"{p}/" for p in SUBPACKAGES)) for name in names)
    assert package_files(names) == expected_wheel_files()
    assert "stepmachine/py.typed" in names
    entry_points = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    )
    assert b"stepmachine = stepmachine.__main__:main" in entry_points  # the console script
    # The README is the package's long description.
    assert metadata["Description-Content-Type"] == "text/markdown"
    description = metadata.get_payload()
    assert isinstance(description, str)
    assert description.strip() == (ROOT / "README.md").read_text().strip()


def test_a_wheel_built_from_the_sdist_equals_the_wheel_built_from_the_checkout(
    tmp_path: Path,
) -> None:
    sdist = build("sdist", ROOT, tmp_path / "sdist")
    with tarfile.open(sdist) as archive:
        members = archive.getmembers()
        # Symlinks are stored resolved: a checkout on a system without them still builds.
        assert not any(m.issym() or m.islnk() for m in members)
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        archive.extractall(tmp_path / "unpacked", **safe)  # type: ignore[arg-type]
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    assert not (unpacked / "operations").exists()  # each module once, under its installed name
    from_sdist = build("wheel", unpacked, tmp_path / "from-sdist")
    from_checkout = build("wheel", ROOT, tmp_path / "from-checkout")
    with zipfile.ZipFile(from_sdist) as a, zipfile.ZipFile(from_checkout) as b:
        assert package_files(a.namelist()) == package_files(b.namelist())
        assert package_files(a.namelist()) == expected_wheel_files()


USER_FILE = '''\
"""A user's agent, outside the repository."""

import anyio

from stepmachine import Message, ModelInference, NoData, Runtime, Session, StateMachine, Tools, tool
from stepmachine.operations import Approval, PendingCall
from stepmachine.stores import SQLiteStore
from stepmachine.testing import ScriptedModel, reply


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def main() -> str:
    gate = Approval({"add"})
    async with await SQLiteStore.open("agent.sqlite3") as store:
        await store.create("s1", conversation=[Message.user("2 + 3?", id="u1")])
        machine = StateMachine([gate, Tools([add]), ModelInference()])
        session: Session[NoData] = await machine.run(
            Runtime(store=store, model=ScriptedModel([reply("5")])), "s1"
        )
        waiting: list[PendingCall] = gate.pending(session)
        return f"{session.conversation[-1].text} {len(waiting)}"


if __name__ == "__main__":
    print(anyio.run(main))
'''

# Each line is wrong only if mypy knows the real types: with stepmachine
# unresolved (every type Any) mypy reports none of them.
WRONG_FILE = """\
from stepmachine import Message
from stepmachine.operations import Approval
from stepmachine.stores import MemoryStore
from stepmachine.testing import ScriptedModel

a: int = Message.user("hi", id="u1")
b: int = Approval({"x"})
c: int = MemoryStore()
d: int = ScriptedModel([])
"""


@pytest.mark.slow
def test_mypy_strict_resolves_every_type_against_a_plain_editable_install(
    tmp_path: Path,
) -> None:
    """``pip install -e .`` in a new venv; mypy --strict on a user's file outside the repo."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--editable", str(ROOT)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert install.returncode == 0, install.stderr
    user = tmp_path / "user"
    user.mkdir()
    (user / "agent.py").write_text(USER_FILE)
    (user / "wrong.py").write_text(WRONG_FILE)

    def mypy(name: str) -> subprocess.CompletedProcess[str]:
        # mypy from the test environment, resolving imports in the new venv.
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "mypy",
                "--strict",
                "--no-incremental",
                "--python-executable",
                str(python),
                name,
            ],
            cwd=user,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )

    good = mypy("agent.py")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "Success: no issues found in 1 source file" in good.stdout
    wrong = mypy("wrong.py")
    assert wrong.returncode == 1
    for line, type_name in enumerate(["Message", "Approval", "MemoryStore", "ScriptedModel"], 6):
        assert (
            f"wrong.py:{line}: error: Incompatible types in assignment (expression has type "
            f'"{type_name}", variable has type "int")'
        ) in wrong.stdout, wrong.stdout
    # The installed package runs, from outside the repository.
    ran = subprocess.run(
        [str(python), "agent.py"],
        cwd=user,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["5", "0"]
