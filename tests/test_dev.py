"""dev.py test: the pytest-xdist arguments it adds (or not) to what the user passed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

DEV = Path(__file__).resolve().parents[1] / "dev.py"


def load_dev() -> ModuleType:
    spec = importlib.util.spec_from_file_location("stepmachine_dev_script", DEV)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("rest", "environ"),
    [
        (["-n0"], {}),
        (["-n", "1"], {}),
        (["--numprocesses=1"], {}),
        (["-p", "no:xdist"], {}),
        (["-pno:xdist"], {}),  # pytest's own spelling of the same option
        ([], {"PYTEST_ADDOPTS": "-x -p no:xdist"}),  # xdist off where pytest reads options
        ([], {"PYTEST_ADDOPTS": "-n 2"}),
    ],
)
def test_the_users_own_choice_of_workers_is_left_alone(
    rest: list[str], environ: dict[str, str]
) -> None:
    assert load_dev()._parallel(rest, environ) == []


def test_workers_come_from_the_environment_or_the_cpus() -> None:
    dev = load_dev()
    assert dev._parallel(["-k", "mcp"], {"STEPMACHINE_TEST_WORKERS": "4"}) == ["-n", "4"]
    default = ["-n", str(dev._workers())]
    assert dev._parallel(["tests/test_x.py"], {}) == default
    assert dev._parallel([], {"STEPMACHINE_TEST_WORKERS": ""}) == default  # set but empty
    assert 2 <= dev._workers() <= 8


def test_the_test_environment_keeps_a_users_bytecode_prefix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    dev = load_dev()
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    env = dev._bytecode_cached()
    assert "PYTHONDONTWRITEBYTECODE" not in env
    assert env["PYTHONPYCACHEPREFIX"] == str(dev.VENV / "pycache")
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path))
    assert dev._bytecode_cached()["PYTHONPYCACHEPREFIX"] == str(tmp_path)
    assert sys.modules.get("stepmachine_dev_script") is None  # loaded, not registered
