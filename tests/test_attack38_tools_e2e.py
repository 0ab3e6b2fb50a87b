"""Attack 38: sync tools in whole runs (``StateMachine([Tools([...]), ModelInference()])``
on a real SQLite store, a scripted model), on both backends: timeouts, a run cancelled
while a sync tool runs (anyio's cancel scope, asyncio's ``task.cancel()``), and many
concurrent runs on one loop with more sync tools than anyio's 40 thread tokens.

What must hold: every call is answered once and never run twice (a resumed session does
not run it again), the history stays valid, each answer is the tool's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from stepmachine import Message, ModelInference, Runtime, StateMachine, Tools, tool
from stepmachine.extend import history_problems
from stepmachine.stores import SQLiteStore
from stepmachine.testing import FunctionModel, ScriptedModel, call, reply

asyncio_only = pytest.mark.parametrize("anyio_backend", ["asyncio"])


def results_of(session: Any) -> list[tuple[str, str]]:
    return [
        (part.call_id, str(part.content))
        for message in session.conversation
        for part in message.parts
        if type(part).__name__ == "ToolResultPart"
    ]


def calls_of(session: Any) -> list[str]:
    return [
        part.call_id
        for message in session.conversation
        for part in message.parts
        if type(part).__name__ == "ToolCallPart"
    ]


async def test_a_sync_tool_past_its_timeout_is_answered_once_and_never_rerun(
    tmp_path: Path,
) -> None:
    runs: Counter[str] = Counter()
    release = threading.Event()
    ended = threading.Event()

    @tool(timeout=0.2)
    def stuck(label: str) -> str:
        """Hangs past its timeout."""
        runs[label] += 1
        release.wait(20)
        ended.set()
        return f"late {label}"

    @tool
    def quick(label: str) -> str:
        """Answers at once."""
        runs[label] += 1
        return f"quick {label}"

    store = await SQLiteStore.open(tmp_path / "db.sqlite3")
    try:
        await store.create("s", conversation=[Message.user("go", id="u1")])
        machine = StateMachine([Tools([stuck, quick]), ModelInference()])
        model = ScriptedModel(
            [call(("stuck", {"label": "a"}), ("quick", {"label": "b"})), reply("done")]
        )
        with anyio.fail_after(30):  # a bound on a hang
            session = await machine.run(Runtime(store=store, model=model), "s")
        answers = dict(results_of(session))
        assert len(answers) == 2
        stuck_answer, quick_answer = (answers[call_id] for call_id in calls_of(session))
        assert "timed out" in stuck_answer
        assert quick_answer == "quick b"
        assert history_problems(session) == []
        release.set()
        await anyio.to_thread.run_sync(ended.wait, 20)
        # Resumed: nothing to run again, the late result never written.
        again = await machine.run(
            Runtime(store=store, model=FunctionModel(lambda request: reply("x"))), "s"
        )
        assert dict(results_of(again)) == answers
        assert runs == Counter({"a": 1, "b": 1})
    finally:
        release.set()
        await store.aclose()


async def test_a_run_cancelled_while_a_sync_tool_runs_answers_it_once(tmp_path: Path) -> None:
    """The run's cancel scope is cancelled while its sync tool blocks (past
    ``THREAD_GRACE``, so the call is answered "interrupted" on the cancellation path);
    the tool then ends. The session resumes to its end with that one answer, the tool
    run once."""
    await cancelled_while_running(tmp_path, "scope")


@asyncio_only
async def test_a_run_natively_cancelled_while_a_sync_tool_runs_answers_it_once(
    tmp_path: Path,
) -> None:
    """The same with asyncio's ``task.cancel()``."""
    await cancelled_while_running(tmp_path, "native")


async def cancelled_while_running(tmp_path: Path, how: str) -> None:
    runs: Counter[str] = Counter()
    entered, release, ended = threading.Event(), threading.Event(), threading.Event()

    @tool
    def charge(amount: int) -> str:
        """Charge."""
        runs["charge"] += 1
        entered.set()
        release.wait(20)
        ended.set()
        return f"charged {amount}"

    store = await SQLiteStore.open(tmp_path / "db.sqlite3")
    try:
        await store.create("s", conversation=[Message.user("pay", id="u1")])
        machine = StateMachine([Tools([charge]), ModelInference()])
        model = ScriptedModel([call(("charge", {"amount": 3})), reply("paid")])
        runtime = Runtime(store=store, model=model)
        with anyio.fail_after(30):  # a bound on a hang
            if how == "scope":
                with anyio.CancelScope() as scope:
                    async with anyio.create_task_group() as group:

                        async def cancel_once_entered() -> None:
                            await anyio.to_thread.run_sync(entered.wait, 20)
                            scope.cancel()

                        group.start_soon(cancel_once_entered)
                        await machine.run(runtime, "s")
            else:
                task = asyncio.ensure_future(machine.run(runtime, "s"))
                await anyio.to_thread.run_sync(entered.wait, 20)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):  # or it returns
                    await task
        release.set()
        await anyio.to_thread.run_sync(ended.wait, 20)
        session = await store.load("s")
        assert history_problems(session) == []
        (answer,) = results_of(session)
        assert answer[1].startswith("interrupted"), answer
        resumed = await machine.run(
            Runtime(store=store, model=FunctionModel(lambda request: reply("resumed"))), "s"
        )
        assert results_of(resumed) == [answer]
        assert history_problems(resumed) == []
        assert runs == Counter({"charge": 1})
    finally:
        release.set()
        await store.aclose()


async def test_many_concurrent_runs_with_more_sync_tools_than_thread_tokens(
    tmp_path: Path,
) -> None:
    """Six runs on one loop, each asking for 12 concurrent sync tools (72 > 40 tokens),
    all on one SQLite file: every call answered with its own result, each run once, at
    most 40 at a time (anyio's default limiter), and no token left borrowed."""
    lock = threading.Lock()
    running = [0]
    most = [0]
    runs: Counter[str] = Counter()
    gate = threading.Event()

    @tool
    def work(session: str, index: int) -> str:
        """Some blocking work."""
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            runs[f"{session}/{index}"] += 1
            if running[0] >= 40:
                gate.set()  # the limit is reached: let everyone through
        gate.wait(5)  # holds threads so that the limit is met, not a timing bound
        with lock:
            running[0] -= 1
        return f"{session}:{index}"

    store = await SQLiteStore.open(tmp_path / "db.sqlite3")
    limiter = anyio.to_thread.current_default_thread_limiter()
    try:
        machine = StateMachine([Tools([work], max_concurrency=12), ModelInference()])
        sessions = [f"s{n}" for n in range(6)]
        for session_id in sessions:
            await store.create(session_id, conversation=[Message.user("go", id="u1")])
        finished: dict[str, Any] = {}

        async def one(session_id: str) -> None:
            model = ScriptedModel(
                [
                    call(*[("work", {"session": session_id, "index": i}) for i in range(12)]),
                    reply("done"),
                ]
            )
            finished[session_id] = await machine.run(Runtime(store=store, model=model), session_id)

        with anyio.fail_after(60):  # a bound on a hang
            async with anyio.create_task_group() as group:
                for session_id in sessions:
                    group.start_soon(one, session_id)
        for session_id, session in finished.items():
            assert history_problems(session) == []
            answers = [content for _, content in results_of(session)]
            assert sorted(answers) == sorted(f"{session_id}:{i}" for i in range(12))
        assert len(runs) == 72
        assert set(runs.values()) == {1}
        assert most[0] <= limiter.total_tokens
        assert limiter.borrowed_tokens == 0
    finally:
        gate.set()
        await store.aclose()


@asyncio_only  # trio: see the next test
async def test_a_run_cancelled_while_a_sync_tool_waits_for_a_thread_token(
    tmp_path: Path,
) -> None:
    """anyio's default thread limiter set to 1 on this loop: of two concurrent sync
    tools, one blocks in its thread and the other waits for the token. The run is
    cancelled: the waiting one never runs (not then, not after the resume), the blocked
    one runs once; both calls are answered once and the history stays valid."""
    limiter = anyio.to_thread.current_default_thread_limiter()
    old = limiter.total_tokens
    limiter.total_tokens = 1
    runs: Counter[str] = Counter()
    entered, release, ended = threading.Event(), threading.Event(), threading.Event()

    @tool
    def charge(label: str) -> str:
        """Charge."""
        runs[label] += 1
        if not entered.is_set():
            entered.set()
            release.wait(20)
            ended.set()
        return f"charged {label}"

    store = await SQLiteStore.open(tmp_path / "db.sqlite3")
    try:
        await store.create("s", conversation=[Message.user("pay", id="u1")])
        machine = StateMachine([Tools([charge]), ModelInference()])
        model = ScriptedModel(
            [call(("charge", {"label": "a"}), ("charge", {"label": "b"})), reply("paid")]
        )
        with anyio.fail_after(30):  # a bound on a hang
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as group:

                    async def cancel_once_entered() -> None:
                        # Polled: a thread of anyio's would need the only token.
                        while not entered.is_set() or not limiter.statistics().tasks_waiting:  # noqa: ASYNC110
                            await anyio.sleep(0.01)  # until one runs and the other waits
                        scope.cancel()

                    group.start_soon(cancel_once_entered)
                    await machine.run(Runtime(store=store, model=model), "s")
            limiter.total_tokens = old
            release.set()
            await anyio.to_thread.run_sync(ended.wait, 20)
            session = await store.load("s")
            assert history_problems(session) == []
            answers = results_of(session)
            assert len(answers) == 2
            assert all(content.startswith("interrupted") for _, content in answers), answers
            resumed = await machine.run(
                Runtime(store=store, model=FunctionModel(lambda request: reply("x"))), "s"
            )
            assert results_of(resumed) == answers
        assert sum(runs.values()) == 1
    finally:
        limiter.total_tokens = old
        release.set()
        await store.aclose()


async def test_a_run_cancelled_with_every_thread_token_held_by_hung_sync_tools_finalizes(
    tmp_path: Path,
) -> None:
    """40 concurrent sync tools (anyio's default thread limit) hang in their threads; the
    run is cancelled. Finalize must still answer every call "interrupted" in the SQLite
    store (``finalize_timeout`` 3 s, a bound, the tools hang for longer): on asyncio the
    stores have their own threads; on trio the store waits for a token the abandoned
    tools keep until they end."""
    limiter = anyio.to_thread.current_default_thread_limiter()
    assert limiter.total_tokens == 40
    release = threading.Event()
    lock = threading.Lock()
    entered = [0]

    @tool
    def hang(index: int) -> str:
        """Hang."""
        with lock:
            entered[0] += 1
        release.wait(30)
        return f"late {index}"

    store = await SQLiteStore.open(tmp_path / "db.sqlite3")
    try:
        await store.create("s", conversation=[Message.user("go", id="u1")])
        machine = StateMachine(
            [Tools([hang], max_concurrency=40), ModelInference()], finalize_timeout=3
        )
        model = ScriptedModel([call(*[("hang", {"index": i}) for i in range(40)]), reply("x")])
        with anyio.fail_after(30):  # a bound on a hang
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as group:

                    async def cancel_once_all_hang() -> None:
                        while entered[0] < 40:  # noqa: ASYNC110 - polled: no token is free
                            await anyio.sleep(0.01)
                        scope.cancel()

                    group.start_soon(cancel_once_all_hang)
                    await machine.run(Runtime(store=store, model=model), "s")
            session = await store.load("s")
        release.set()
        assert history_problems(session) == []
        answers = results_of(session)
        assert len(answers) == 40
        assert all(content.startswith("interrupted") for _, content in answers)
    finally:
        release.set()
        await store.aclose()


class GatedCharge:
    """A sync ``charge`` tool that runs until released (``entered`` once it started), and a
    model that calls it first and answers after (``asked``: each request's length)."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.asked: list[int] = []

        @tool
        def charge() -> str:
            """Charge."""
            self.entered.set()
            self.release.wait(20)
            return "charged"

        self.charge = charge

    def model(self, request: Any) -> Any:
        self.asked.append(len(request.messages))
        return call(("charge", {})) if len(self.asked) == 1 else reply("the run went on")


@asyncio_only
async def test_a_native_cancel_while_a_sync_tool_runs_stops_the_run_even_if_the_tool_ends_soon(
    tmp_path: Path,
) -> None:
    """``task.cancel()`` (what ``asyncio.run`` does on Ctrl-C, what ``asyncio.wait_for``
    does) lands while a sync tool runs; the tool ends a moment later, within
    ``THREAD_GRACE``. The call keeps its real result, but the run must end cancelled: the
    model is not asked again."""
    gated = GatedCharge()

    store = await SQLiteStore.open(tmp_path / "db.sqlite3")
    try:
        await store.create("s", conversation=[Message.user("pay", id="u1")])
        machine = StateMachine([Tools([gated.charge]), ModelInference()])
        task = asyncio.ensure_future(
            machine.run(Runtime(store=store, model=FunctionModel(gated.model)), "s")
        )
        with anyio.fail_after(30):  # a bound on a hang
            await anyio.to_thread.run_sync(gated.entered.wait, 20)
            task.cancel()  # the tool still runs: it cannot end before release
            gated.release.set()  # it ends now, well within THREAD_GRACE
            outcome = (await asyncio.gather(task, return_exceptions=True))[0]
        session = await store.load("s")
        assert history_problems(session) == []
        assert [content for _, content in results_of(session)] == ["charged"]
        assert len(gated.asked) == 1, "the model was asked again after the run was cancelled"
        assert isinstance(outcome, asyncio.CancelledError), outcome
    finally:
        gated.release.set()
        await store.aclose()


@asyncio_only
async def test_asyncio_timeout_around_a_run_whose_sync_tool_ends_within_the_grace(
    tmp_path: Path,
) -> None:
    """``asyncio.timeout`` fires while a sync tool runs; the tool ends within
    ``THREAD_GRACE``. The caller gets ``TimeoutError`` (the cancellation taken in for the
    tool's result is asked for again, the task's cancel count left as it was: otherwise
    the timeout would read as a cancellation from elsewhere), the result is kept once,
    and the model is not asked again."""
    gated = GatedCharge()

    async def expire_once_entered(deadline: asyncio.Timeout) -> None:
        await anyio.to_thread.run_sync(gated.entered.wait, 20)
        deadline.reschedule(asyncio.get_running_loop().time())  # fires while the tool runs
        await asyncio.sleep(0.1)
        gated.release.set()  # the tool ends now, within THREAD_GRACE

    store = await SQLiteStore.open(tmp_path / "db.sqlite3")
    try:
        await store.create("s", conversation=[Message.user("pay", id="u1")])
        machine = StateMachine([Tools([gated.charge]), ModelInference()])
        expiring: list[asyncio.Task[None]] = []

        async def run_under_a_timeout() -> None:
            async with asyncio.timeout(None) as deadline:
                expiring.append(asyncio.ensure_future(expire_once_entered(deadline)))
                await machine.run(Runtime(store=store, model=FunctionModel(gated.model)), "s")

        with pytest.raises(TimeoutError):
            await run_under_a_timeout()
        await expiring[0]
        current = asyncio.current_task()
        assert current is not None
        assert current.cancelling() == 0
        session = await store.load("s")
        assert history_problems(session) == []
        assert [content for _, content in results_of(session)] == ["charged"]
        assert gated.asked == [1]
    finally:
        gated.release.set()
        await store.aclose()
