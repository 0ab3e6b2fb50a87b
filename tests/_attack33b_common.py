"""Attack 33b: helpers shared by the test modules (the model server, child processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


class ModelServer:
    """The child process of ``_attack33b_model_server.py``, and its control endpoints."""

    def __init__(self, process: subprocess.Popen[bytes], port: int) -> None:
        self.process = process
        self.port = port

    def _post(self, what: str, value: Any) -> None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/control/{what}",
            data=json.dumps(value).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            answer.read()

    def script(self, actions: list[dict[str, Any]]) -> None:
        self._post("script", actions)

    def default(self, action: dict[str, Any]) -> None:
        self._post("default", action)

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.port}/control/stats", timeout=10
        ) as answer:
            stats: dict[str, Any] = json.loads(answer.read())
        return stats

    @property
    def requests(self) -> int:
        return int(self.stats()["requests"])


@contextmanager
def model_server(tmp: Path) -> Iterator[ModelServer]:
    port_file = tmp / "port"
    process = subprocess.Popen(
        [sys.executable, str(HERE / "_attack33b_model_server.py"), str(port_file)]
    )
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists():
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("the model server did not start")
            time.sleep(0.02)
        yield ModelServer(process, int(port_file.read_text()))
    finally:
        process.kill()
        process.wait()


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(HERE) + os.pathsep + env.get("PYTHONPATH", "")
    return env


CHILDREN: list[subprocess.Popen[str]] = []


def reap_children() -> None:
    """Kill every child a test started and left running (a failed test)."""
    while CHILDREN:
        child = CHILDREN.pop()
        if child.poll() is None:
            child.kill()
        child.communicate()


def start_child(script: str, *args: str) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, str(HERE / script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    CHILDREN.append(child)
    return child


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.02)


def kill(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)


def finish(process: subprocess.Popen[str], timeout: float = 60.0) -> dict[str, Any]:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def finish_text(process: subprocess.Popen[str], timeout: float = 60.0) -> str:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err
    return out


class Clock:
    """A clock one second later at each reading (``start`` + 1 first): batches stamped apart."""

    def __init__(self, start: float = 1_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 1.0
        return self.now
