#!/usr/bin/env python3
"""Set up and run stepmachine with nothing but Python 3.11+.

    python3 dev.py demo     run examples/hello_world.py
    python3 dev.py test     run the test suite (extra arguments go to pytest)
    python3 dev.py lint     ruff check and mypy --strict
    python3 dev.py package  build the sdist and the wheel, and twine check them
    python3 dev.py bench    run the benchmarks

Each command makes (or reuses) the virtual environment ``.venv`` beside this
file and installs what it needs into it: the package itself (a plain editable install:
a static path to this checkout, which mypy, IDEs and the REPL follow) and the
extras the command uses. The install is redone only when pyproject.toml or the
extras change; new modules need no reinstall.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import venv
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / ("python.exe" if os.name == "nt" else "python")


def _stamp(extras: str) -> str:
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes())
    digest.update(extras.encode())
    return digest.hexdigest()


def ensure_env(extras: str) -> None:
    """Create .venv if needed and install the package with ``extras``."""
    if not PYTHON.exists():
        print(f"creating virtual environment {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    stamp_file = VENV / ".stepmachine-stamp"
    stamp = _stamp(extras)
    if stamp_file.exists() and stamp_file.read_text() == stamp:
        return
    target = f".[{extras}]" if extras else "."
    stale = ROOT / "stepmachine.egg-info"  # left by the setuptools build of earlier versions
    if stale.is_dir():
        shutil.rmtree(stale)
    print(f"installing {target} into {VENV}", flush=True)
    subprocess.run(
        [
            str(PYTHON),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--editable",
            target,
        ],
        cwd=ROOT,
        check=True,
    )
    stamp_file.write_text(stamp)


def run(*command: str, env: dict[str, str] | None = None) -> int:
    """Run a command from the venv's bin folder, from the repository root."""
    argv = [str(BIN / command[0]), *command[1:]]
    return subprocess.run(argv, cwd=ROOT, env=env, check=False).returncode


def _workers() -> int:
    """Test workers: one more than the CPUs, at most 8.

    Much of the suite waits on other processes (crash harnesses, servers, a
    PostgreSQL restart), so one worker more than the CPUs keeps them busy: on a
    2-core machine the suite ran in 598 s with 3 workers against 694 s with 2.
    Each worker starts its own PostgreSQL server for the tests that need one.
    """
    return min((os.cpu_count() or 1) + 1, 8)


def _parallel(rest: list[str], environ: Mapping[str, str]) -> list[str]:
    """The pytest-xdist arguments ``dev.py test`` adds: ``-n`` workers, unless told otherwise.

    ``-n``/``--numprocesses`` of your own, or xdist turned off (``-p no:xdist``,
    ``-pno:xdist``), in the arguments or in ``PYTEST_ADDOPTS``, adds nothing (``-n``
    with xdist off is an error). Else ``STEPMACHINE_TEST_WORKERS`` workers, if set,
    or :func:`_workers`.
    """
    given = [*rest, *environ.get("PYTEST_ADDOPTS", "").split()]
    if any(
        a.startswith(("-n", "--numprocesses")) or a in ("no:xdist", "-pno:xdist") for a in given
    ):
        return []
    return ["-n", environ.get("STEPMACHINE_TEST_WORKERS") or str(_workers())]


def _bytecode_cached() -> dict[str, str]:
    """The environment for the tests: Python's bytecode cache on, kept inside ``.venv``.

    The suite starts hundreds of Python processes (crash harnesses, workers, MCP
    servers, every documentation block); without cached bytecode each one compiles
    the package again, about 1.5 s of CPU apiece. ``PYTHONDONTWRITEBYTECODE`` (set
    in many containers to keep ``__pycache__`` folders out of the source tree) is
    therefore dropped for the test run, and the bytecode goes to
    ``.venv/pycache`` (``PYTHONPYCACHEPREFIX``) rather than beside the sources (a
    test that starts Python with an environment of its own may still write
    ``__pycache__`` folders, which git ignores). A ``PYTHONPYCACHEPREFIX`` of your
    own is kept.
    """
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("PYTHONPYCACHEPREFIX", str(VENV / "pycache"))
    return env


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"demo", "test", "lint", "package", "bench"}:
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        ensure_env("cli")  # the demo ends by showing how to inspect its database
        return run("python", "examples/hello_world.py", *rest)
    if command == "test":
        ensure_env("test,lint")  # as lint and package: CI installs once for all three
        parallel = _parallel(rest, os.environ)
        return run("pytest", *parallel, *rest, env=_bytecode_cached())
    if command == "lint":
        ensure_env("test,lint")
        code = run(
            "ruff",
            "check",
            "stepmachine",
            "operations",
            "stores",
            "inspector",
            "tests",
            "examples",
            "benchmarks",
            "dev.py",
        )
        return code or run("mypy", "--strict")
    if command == "package":
        # As a release would be: the sdist and the wheel, then twine's check of their metadata
        # (the README as the long description). The build backend, hatchling, comes from the
        # test extra (--no-isolation: nothing is fetched); the files go to a temporary folder.
        ensure_env("test,lint")
        with tempfile.TemporaryDirectory(prefix="stepmachine-dist-") as out:
            code = run("python", "-m", "build", "--no-isolation", "--outdir", out, *rest)
            dist = sorted(str(p) for p in Path(out).iterdir())
            return code or run("twine", "check", "--strict", *dist)
    ensure_env("test,bench")
    code = 0
    for bench in sorted((ROOT / "benchmarks").glob("*.py")):
        if bench.name == "report.py":  # rewrites benchmarks/README.md: run it by hand
            continue
        print(f"== {bench.name}", flush=True)
        code = code or run("python", str(bench.relative_to(ROOT)), *rest)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
