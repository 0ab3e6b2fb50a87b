"""Attack 34c: hand-driven ``step``/``apply``/``finalize`` racing a real ``run()`` in
another process, session after session (SQLiteStore and FileStore).

A child runs ``run()`` on each session while this process drives the same session by
hand as fast as it can, with ``finalize()`` tried whenever ``apply()`` finds the
session busy. Promised: the hand-driven path raises only ``SessionBusyError`` or
``ConflictError`` beside the runner; no tool side effect is done twice, no real result
is dropped (every side effect has its result stored, never "interrupted" or "outcome
unknown" for a call that ran), no call is answered twice, and no model answer is
dropped (the turn takes its three model requests, whoever sends them).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from _attack34b_agent import Agent
from test_attack34b_paths import open_store

from stepmachine import AppendMessage, ConflictError, Message, SessionBusyError, submit

HERE = Path(__file__).resolve().parent
ROUNDS = 50


def where_of(kind: str, tmp: Path) -> Path:
    return tmp / "db.sqlite3" if kind == "sqlite" else tmp / "store"


def results_by_call(conversation: Any) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for message in conversation:
        for result in message.tool_results:
            found.setdefault(result.call_id, []).append(str(result.content))
    return found


async def drive_by_hand(agent: Agent, store: Any, sid: str, done: Path) -> dict[str, int]:
    """Step/apply (and finalize when busy) until the child is done and nothing applies."""
    machine = agent.machine()
    runtime = agent.runtime(store, fixed_ids=False)
    seen = {"applied": 0, "busy": 0, "conflict": 0, "finalized": 0}
    cycle = 0
    with anyio.fail_after(120):
        while True:
            cycle += 1
            session = await runtime.session_loader().load(sid)
            try:
                decision = await machine.step(runtime, session, cycle=cycle)
                if decision is None:
                    if await anyio.Path(done).exists():
                        return seen
                    await anyio.sleep(0.002)
                    continue
                await machine.apply(runtime, session, decision, cycle=cycle)
                seen["applied"] += 1
            except SessionBusyError:
                seen["busy"] += 1
                try:
                    await machine.finalize(runtime, sid)
                    seen["finalized"] += 1
                except SessionBusyError:
                    seen["busy"] += 1
            except ConflictError:
                seen["conflict"] += 1
            await anyio.sleep(random.uniform(0, 0.004))


@pytest.mark.parametrize("kind", ["sqlite", "file"])
def test_hand_driven_racing_a_real_run(kind: str, tmp_path: Path) -> None:
    rounds = ROUNDS if kind == "sqlite" else ROUNDS // 2
    where = where_of(kind, tmp_path)

    async def prepare() -> None:
        store = await open_store(kind, tmp_path)
        await store.aclose()

    anyio.run(prepare)
    child = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "_attack34c_runner_child.py"),
            kind,
            str(where),
            str(tmp_path),
            str(rounds),
        ],
        env={**os.environ, "PYTHONPATH": f"{HERE.parent}:{HERE}"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    totals = {"applied": 0, "busy": 0, "conflict": 0, "finalized": 0}
    problems: list[str] = []

    async def main() -> None:
        store = await open_store(kind, tmp_path)
        try:
            for i in range(rounds):
                sid = f"s-{i}"
                await store.create(sid)
                await submit(store, sid, [AppendMessage(Message.user("invoice", id="u1"))])
                (tmp_path / str(i)).mkdir()
                (tmp_path / f"go-{i}").write_text("go")
                await anyio.sleep(random.uniform(0, 0.01))
                agent = Agent(tmp_path / str(i), approval=False)
                seen = await drive_by_hand(agent, store, sid, tmp_path / f"done-{i}")
                for key, value in seen.items():
                    totals[key] += value
                problems.extend(await check_round(store, tmp_path, i))
        finally:
            await store.aclose()

    try:
        anyio.run(main)
    finally:
        child.kill()
        _out, err = child.communicate(timeout=60)
    assert not problems, (problems, totals, err[-2000:])
    assert totals["busy"] > 0, f"the race never met the runner: {totals}"
    print(f"{kind}: {rounds} rounds, {totals}")  # noqa: T201 - how the race went


async def check_round(store: Any, tmp: Path, i: int) -> list[str]:
    sid = f"s-{i}"
    outcome = (tmp / f"done-{i}").read_text()
    problems = [] if not outcome.startswith("error") else [f"{sid}: the run raised {outcome}"]
    session = await store.load(sid)
    effects_file = tmp / str(i) / "effects.txt"
    lines = effects_file.read_text().splitlines() if effects_file.exists() else []
    requests_file = tmp / str(i) / "requests.txt"
    requests = requests_file.read_text().splitlines() if requests_file.exists() else []
    if len(requests) != 3:  # lookup, charge, the reply: an answer dropped costs one more
        problems.append(f"{sid}: {len(requests)} model requests for a 3-request turn")
    if len(lines) != len(set(lines)):
        problems.append(f"{sid}: a side effect done twice: {lines}")
    results = results_by_call(session.conversation)
    for call, texts in results.items():
        if len(texts) != 1:
            problems.append(f"{sid}: call {call} answered {len(texts)} times: {texts}")
    calls = {p.call_id: p.name for m in session.conversation for p in m.tool_calls}
    real = [t for texts in results.values() for t in texts if t.startswith(("charged", "found"))]
    if len(real) != len(lines):
        problems.append(f"{sid}: {len(lines)} side effects, {len(real)} real results: {results}")
    if set(calls) != set(results):
        problems.append(f"{sid}: calls without a result: {set(calls) - set(results)}")
    last = session.conversation[-1] if len(session.conversation) else None
    if last is None or not (last.text or "").startswith("done:"):
        problems.append(f"{sid}: the turn did not finish: {last}")
    return problems
