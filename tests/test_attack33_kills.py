"""Attack 33: concurrent tools (``max_concurrency > 1``) of one model turn, SIGKILLed.

A real child process (``tests/_attack33_tools_child.py``) runs two user turns, each a
model reply asking for three non-idempotent ``charge`` calls and one idempotent
``lookup``, run concurrently. It is killed at a bad moment (after the intents batch;
with one charge recorded, one taken effect and unrecorded, one started; after every
charge took effect and before the last record; or at random instants chosen by the
parent), then resumed by fresh children until one finishes. Checked on the stored
session and the side-effect journal: no charge took effect twice (per idempotency key),
every call has exactly one result, a recorded result is the real one, a charge killed
after it took effect is answered "outcome unknown", the history is valid, and both
turns ended on the model's answer.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest

from stepmachine import Message
from stepmachine.extend import OUTCOME_UNKNOWN, history_problems
from stepmachine.stores import FileStore, SQLiteStore

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "_attack33_tools_child.py"


def where_of(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if kind == "sqlite":
        return str(tmp_path / "agent.sqlite3")
    if kind == "file":
        return str(tmp_path / "store")
    pytest.importorskip("psycopg", reason="psycopg is not installed (the postgres extra)")
    return str(request.getfixturevalue("postgres_dsn"))


def spawn(kind: str, where: str, mode: str, folder: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ATTACK33_DIR": str(folder)}
    return subprocess.Popen(
        [sys.executable, str(CHILD), kind, where, mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def finish(child: subprocess.Popen[bytes], timeout: float = 90.0) -> tuple[int, str]:
    out, err = child.communicate(timeout=timeout)
    return child.returncode, out.decode() + err.decode()


async def create(kind: str, where: str) -> None:
    if kind == "sqlite":
        store: Any = await SQLiteStore.open(where)
    elif kind == "file":
        store = await FileStore.open(where)
    else:
        from stepmachine.stores import PostgresStore

        store = await PostgresStore.open(where)
    try:
        await store.create("s")
    finally:
        await store.aclose()


async def load(kind: str, where: str) -> tuple[Message, ...]:
    if kind == "sqlite":
        store: Any = await SQLiteStore.open(where)
    elif kind == "file":
        store = await FileStore.open(where)
    else:
        from stepmachine.stores import PostgresStore

        store = await PostgresStore.open(where)
    try:
        session = await store.load("s")
        return tuple(session.conversation)
    finally:
        await store.aclose()


def resume_until_finished(kind: str, where: str, folder: Path) -> None:
    for _ in range(4):
        code, output = finish(spawn(kind, where, "none", folder))
        if code == 0 and "finished" in output:
            return
    raise AssertionError(f"the resumed child never finished: {code} {output[-3000:]}")


def check(conversation: tuple[Message, ...], effects: list[str]) -> dict[str, Any]:
    """The invariants; returns what the tests look at further."""
    counted = Counter(effects)
    charges = [line for line in effects if line.startswith("charge ")]
    assert all(counted[line] == 1 for line in charges), f"a charge took effect twice: {counted}"
    assert not history_problems(conversation)
    calls: dict[str, Any] = {}
    results: dict[str, list[Any]] = {}
    for message in conversation:
        for part in message.tool_calls:
            assert part.call_id not in calls, f"call id {part.call_id} repeats"
            calls[part.call_id] = part
        for result in message.tool_results:
            results.setdefault(result.call_id, []).append(result)
    assert set(results) == set(calls), "a call without a result, or a result without a call"
    assert all(len(r) == 1 for r in results.values()), f"a call answered twice: {results}"
    assert len(calls) == 8, f"two turns of four calls each, got {len(calls)}"
    assert conversation[-1].role == "assistant"
    assert conversation[-1].text == "all done"
    assert sum(m.text == "all done" for m in conversation) == 2
    return {"calls": calls, "results": {k: v[0] for k, v in results.items()}}


def key_of(session_id: str, message_id: str, call_id: str) -> str:
    from stepmachine.extend import idempotency_key

    return str(idempotency_key(session_id, call_id, message_id))


def charge_outcomes(conversation: tuple[Message, ...], effects: list[str]) -> list[str]:
    """For every charge call, in order: ``real`` (its result says charged), ``unknown`` (an
    outcome-unknown error), combined with whether its key is in the journal."""
    done = {line.split(" ", 1)[1] for line in effects if line.startswith("charge ")}
    results = {r.call_id: r for m in conversation for r in m.tool_results}
    outcomes = []
    for message in conversation:
        for part in message.tool_calls:
            if part.name != "charge":
                continue
            result = results[part.call_id]
            text = result.content if isinstance(result.content, str) else str(result.content)
            state = (
                "real"
                if text.startswith("charged")
                else ("unknown" if OUTCOME_UNKNOWN in text else f"other:{text[:60]}")
            )
            ran = key_of("s", message.id, part.call_id) in done
            outcomes.append(f"{state}/{'ran' if ran else 'not-run'}")
    return outcomes


STORES = ["sqlite", "file", "postgres"]


@pytest.mark.parametrize("kind", STORES)
@pytest.mark.parametrize("mode", ["after_intents", "mid", "after_all"])
def test_concurrent_charges_killed_at_a_bad_moment_take_effect_at_most_once(
    kind: str, mode: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    where = where_of(kind, tmp_path, request)
    anyio.run(create, kind, where)
    code, output = finish(spawn(kind, where, mode, tmp_path))
    assert code == -signal.SIGKILL, output[-3000:]
    resume_until_finished(kind, where, tmp_path)
    effects = (tmp_path / "effects.txt").read_text().splitlines()
    conversation = anyio.run(load, kind, where)
    check(conversation, effects)
    outcomes = charge_outcomes(conversation, effects)
    # every charge either took effect and is answered by its real result or "outcome
    # unknown", or never took effect; a real result is never given to one that did not run
    assert all(o in ("real/ran", "unknown/ran", "unknown/not-run") for o in outcomes), outcomes
    first, second = outcomes[:3], outcomes[3:]
    assert second == ["real/ran"] * 3, outcomes  # the turn after the crash ran normally
    if mode == "after_intents":
        assert first == ["unknown/not-run"] * 3
    elif mode == "mid":
        assert first == ["real/ran", "unknown/ran", "unknown/not-run"]
    else:  # every charge took effect (the three return together, before any record)
        assert all(o.endswith("/ran") for o in first), first


@pytest.mark.parametrize("kind", STORES)
def test_concurrent_charges_killed_at_random_instants_take_effect_at_most_once(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    where = where_of(kind, tmp_path, request)
    anyio.run(create, kind, where)
    rng = random.Random(3300 + STORES.index(kind))
    kills = 0
    finished = False
    for _ in range(12):
        child = spawn(kind, where, "random", tmp_path)
        time.sleep(rng.uniform(0.25, 0.95))  # interpreter start-up is most of it
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
            kills += 1
        code, output = finish(child)
        if code == 0:
            assert "finished" in output
            finished = True
            break
        assert code == -signal.SIGKILL, output[-3000:]
    if not finished:
        resume_until_finished(kind, where, tmp_path)
    effects = (
        (tmp_path / "effects.txt").read_text().splitlines()
        if (tmp_path / "effects.txt").exists()
        else []
    )
    conversation = anyio.run(load, kind, where)
    check(conversation, effects)
    outcomes = charge_outcomes(conversation, effects)
    assert all(o in ("real/ran", "unknown/ran", "unknown/not-run") for o in outcomes), outcomes
    assert kills >= 1
