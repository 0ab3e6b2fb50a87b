"""``run()`` holds the session's lease: wait, fail, queue, fencing, renewal, ``serve``.

The stores' side of leases is the lease conformance suite (tests/test_leases_*.py);
here the machine's: two runners on one session never mark a finished tool
"outcome unknown", a busy session follows the caller's policy, a lost lease
stops the run and nothing it computes afterwards is stored.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from stepmachine import (
    AppendMessage,
    CancelToken,
    ConfigurationError,
    LeaseLostError,
    LeasePolicy,
    Message,
    ModelInference,
    Runtime,
    SessionBusyError,
    StateMachine,
    Tools,
    run_worker,
    submit,
    tool,
)
from stepmachine.extend import OUTCOME_UNKNOWN, Lease, LeaseHolder, YieldReason, history_problems
from stepmachine.stores import MemoryStore
from stepmachine.testing import FunctionModel, ScriptedModel, call, reply


class Slow:
    """A non-idempotent ``charge`` tool that waits for a gate; counts what it did."""

    def __init__(self) -> None:
        self.started = anyio.Event()
        self.go = anyio.Event()
        self.charges: list[int] = []

    def tool(self) -> Any:
        async def charge(amount: int) -> str:
            """Charge the card."""
            self.started.set()
            await self.go.wait()
            self.charges.append(amount)
            return f"charged {amount}"

        return tool(charge)


def results_text(session: Any) -> list[str]:
    return [
        part.content if isinstance(part.content, str) else repr(part.content)
        for message in session.conversation
        for part in message.parts
        if type(part).__name__ == "ToolResultPart"
    ]


def machine_for(slow: Slow, **kwargs: Any) -> StateMachine[Any]:
    return StateMachine([Tools([slow.tool()]), ModelInference()], **kwargs)


async def two_runners(lease: LeasePolicy | None) -> tuple[Slow, Any]:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("pay 5", id="u1")])
    slow = Slow()
    model = ScriptedModel([call(("charge", {"amount": 5})), reply("paid")])
    runtime = Runtime(store=store, model=model)
    machine = machine_for(slow, lease=lease)
    async with anyio.create_task_group() as tg:
        tg.start_soon(machine.run, runtime, "s")
        await slow.started.wait()
        second = anyio.Event()

        async def run_second() -> None:
            await machine.run(runtime, "s")
            second.set()

        tg.start_soon(run_second)
        with anyio.move_on_after(0.3):
            await second.wait()  # without a lease the second run answers at once
        slow.go.set()
    return slow, await store.load("s")


async def test_a_second_runner_waits_and_never_calls_a_running_tool_unknown() -> None:
    slow, session = await two_runners(LeasePolicy())
    assert slow.charges == [5]
    assert results_text(session) == ["charged 5"]
    assert OUTCOME_UNKNOWN not in " ".join(results_text(session))
    assert history_problems(session.conversation) == []


async def test_without_a_lease_the_second_runner_reads_the_call_as_crashed() -> None:
    """The defect leases fix, shown: this is what ``lease=None`` still does."""
    slow, session = await two_runners(None)
    assert slow.charges == [5]  # the tool did run
    assert any(OUTCOME_UNKNOWN in text for text in results_text(session))


async def hold_session(store: MemoryStore) -> Lease:
    held = await store.claim("s", "someone-else", 30.0)
    assert isinstance(held, Lease)
    return held


async def test_busy_fail_raises_and_writes_nothing() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    await hold_session(store)
    machine = StateMachine([ModelInference()], lease=LeasePolicy(busy="fail"))
    with pytest.raises(SessionBusyError) as caught:
        await machine.run(Runtime(store=store, model=ScriptedModel([reply("x")])), "s")
    assert caught.value.holder == "someone-else"
    assert (await store.load("s")).revision == 0


async def test_busy_wait_gives_up_after_wait_timeout() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    await hold_session(store)
    machine = StateMachine([ModelInference()], lease=LeasePolicy(wait_timeout=0.2, poll=0.05))
    with pytest.raises(SessionBusyError):
        await machine.run(Runtime(store=store, model=ScriptedModel([reply("x")])), "s")
    assert (await store.load("s")).revision == 0


async def test_busy_wait_runs_once_the_holder_lets_go() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    held = await hold_session(store)
    machine = StateMachine([ModelInference()], lease=LeasePolicy(poll=0.05))
    runtime = Runtime(store=store, model=ScriptedModel([reply("hello")]))
    async with anyio.create_task_group() as tg:
        tg.start_soon(machine.run, runtime, "s")
        await anyio.sleep(0.1)
        assert (await store.load("s")).revision == 0  # still waiting
        await store.release(held)
    session = await store.load("s")
    assert session.conversation[-1].text == "hello"


async def test_busy_queue_returns_and_the_holder_runs_the_turn() -> None:
    """A turn queued just before the holder lets go is run by the holder."""
    queued: list[Any] = []

    class Racy(MemoryStore):
        """Another runner queues a turn in the window before the holder's release."""

        async def release(self, lease: Lease, *, unless_requested: bool = False) -> bool:
            if not queued:
                await submit(self, "s", [AppendMessage(Message.user("thanks", id="u2"))])
                queued.append(await machine.run_report(runtime, "s"))
            return await super().release(lease, unless_requested=unless_requested)

    store = Racy()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    runtime = Runtime(store=store, model=ScriptedModel([reply("hello"), reply("welcome")]))
    machine = StateMachine([ModelInference()], lease=LeasePolicy(busy="queue"))
    report = await machine.run_report(runtime, "s")
    assert queued[0].reason.kind == YieldReason.QUEUED
    assert queued[0].results == ()
    session = await store.load("s")
    assert [m.text for m in session.conversation] == ["hi", "hello", "thanks", "welcome"]
    assert [r.step for r in report.results] == ["inference", "inference"]
    assert await store.claim_next("w", 30.0) is None  # the queued turn was taken


async def test_a_queued_turn_survives_a_holder_that_dies() -> None:
    store = MemoryStore(expiring_leases=True)
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    held = await store.claim("s", "doomed", 0.2)
    assert isinstance(held, Lease)
    machine = StateMachine([ModelInference()], lease=LeasePolicy(busy="queue"))
    runtime = Runtime(store=store, model=ScriptedModel([reply("hello")]))
    assert (await machine.run_report(runtime, "s")).reason.kind == YieldReason.QUEUED
    await anyio.sleep(0.4)  # the holder never releases: its lease lapses
    lease = await store.claim_next("worker", 30.0)
    assert isinstance(lease, Lease)
    session = await machine.run(runtime, "s", lease=lease)
    assert session.conversation[-1].text == "hello"


async def test_a_lost_lease_stops_the_run_and_nothing_later_is_stored() -> None:
    """A holder that cannot renew (paused, partitioned) loses the session to another."""

    class NoRenew(MemoryStore):
        async def renew(self, lease: Lease) -> Lease:
            return lease  # pretend: the renewal never reaches the store

    store = NoRenew(expiring_leases=True)
    await store.create("s", conversation=[Message.user("pay 5", id="u1")])
    slow = Slow()
    model = ScriptedModel([call(("charge", {"amount": 5})), reply("paid")])
    machine = machine_for(slow, lease=LeasePolicy(ttl=0.3))
    runtime = Runtime(store=store, model=model)
    lost: list[LeaseLostError] = []
    async with anyio.create_task_group() as tg:

        async def first() -> None:
            try:
                await machine.run(runtime, "s")
            except LeaseLostError as exc:
                lost.append(exc)

        tg.start_soon(first)
        await slow.started.wait()
        await anyio.sleep(0.5)  # the lease lapsed
        taken = await store.claim("s", "newcomer", 30.0)
        assert isinstance(taken, Lease)
        before = (await store.load("s")).revision
        slow.go.set()  # the tool finishes; its result write is fenced off
    assert len(lost) == 1
    assert slow.charges == [5]
    after = await store.load("s")
    assert after.revision == before
    assert "charged 5" not in results_text(after)


async def test_a_lease_lost_while_renewing_cancels_the_run() -> None:
    class Revoked(MemoryStore):
        async def renew(self, lease: Lease) -> Lease:
            raise LeaseLostError(lease.session_id, lease.owner, lease.epoch, "revoked")

    store = Revoked(expiring_leases=True)
    await store.create("s", conversation=[Message.user("pay 5", id="u1")])
    slow = Slow()
    model = ScriptedModel([call(("charge", {"amount": 5})), reply("paid")])
    machine = machine_for(slow, lease=LeasePolicy(ttl=0.15))
    with pytest.raises(LeaseLostError), anyio.fail_after(5):
        await machine.run(Runtime(store=store, model=model), "s")
    assert slow.charges == []  # cancelled while waiting for the gate
    busy = await store.claim("s", "next", 30.0)
    assert isinstance(busy, Lease)  # the run released what it held


async def test_the_run_releases_its_lease_on_return_and_on_error() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    machine = StateMachine([ModelInference()])
    await machine.run(Runtime(store=store, model=ScriptedModel([reply("a")])), "s")
    assert isinstance(await store.claim("s", "probe", 30.0), Lease)

    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])

    def broken(request: Any) -> Any:
        raise RuntimeError("model down")

    with pytest.raises(RuntimeError, match="model down"):
        await machine.run(Runtime(store=store, model=FunctionModel(broken)), "s")
    assert isinstance(await store.claim("s", "probe", 30.0), Lease)


async def test_lease_none_runs_without_claiming() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    await hold_session(store)
    machine = StateMachine([ModelInference()], lease=None)
    session = await machine.run(Runtime(store=store, model=ScriptedModel([reply("a")])), "s")
    assert session.revision == 1


async def test_a_claimed_lease_is_run_and_released() -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    await store.request_run("s")
    lease = await store.claim_next("worker", 30.0)
    assert isinstance(lease, Lease)
    machine = StateMachine([ModelInference()])
    session = await machine.run(
        Runtime(store=store, model=ScriptedModel([reply("a")])), "s", lease=lease
    )
    assert session.revision == 1
    assert isinstance(await store.claim("s", "probe", 30.0), Lease)
    with pytest.raises(ConfigurationError, match="lease of session"):
        await machine.run(Runtime(store=store), "other", lease=lease)


def test_lease_policy_is_checked() -> None:
    with pytest.raises(ConfigurationError, match="busy"):
        LeasePolicy(busy="later")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="ttl"):
        LeasePolicy(ttl=0)
    with pytest.raises(ConfigurationError, match="wait_timeout"):
        LeasePolicy(wait_timeout=-1)
    with pytest.raises(ConfigurationError, match="lease"):
        StateMachine([ModelInference()], lease="wait")  # type: ignore[arg-type]


async def test_serve_runs_requested_sessions_until_stopped() -> None:
    store = MemoryStore()
    names = [f"s{i}" for i in range(5)]
    for name in names:
        await store.create(name, conversation=[Message.user(f"hi {name}", id="u1")])
        await store.request_run(name)

    def answer(request: Any) -> Any:
        return reply(f"re: {request.messages[-1].text}")

    machine = StateMachine([ModelInference()])
    runtime = Runtime(store=store, model=FunctionModel(answer))
    stop = CancelToken()
    served: list[str] = []

    def seen(report: Any) -> None:
        served.append(report.session.id)
        if len(served) == len(names):
            stop.cancel("all served")

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(
                    lambda i=i: run_worker(
                        machine,
                        runtime,
                        stop=stop,
                        poll=0.02,
                        on_report=seen,
                        owner_prefix=f"w{i}:",
                    )
                )
    assert sorted(served) == names
    for name in names:
        session = await store.load(name)
        assert session.conversation[-1].text == f"re: hi {name}"
        holder = await store.claim(name, "probe", 30.0)
        assert not isinstance(holder, LeaseHolder)


async def test_serve_needs_a_store_with_leases() -> None:
    class Plain:
        async def load(self, session_id: str) -> Any: ...
        async def apply(self, batch: Any) -> Any: ...

    with pytest.raises(ConfigurationError, match="leases"):
        await run_worker(StateMachine([ModelInference()]), Runtime(store=Plain()))  # type: ignore[arg-type]


async def test_a_wrapper_forwarding_attributes_runs_without_a_lease() -> None:
    """Leases are read from the store's class: a forwarding wrapper's apply takes no lease."""

    class Forwarding:
        def __init__(self, inner: MemoryStore) -> None:
            self.inner = inner

        async def apply(self, batch: Any) -> Any:  # no lease keyword
            return await self.inner.apply(batch)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    inner = MemoryStore()
    await inner.create("s", conversation=[Message.user("hi", id="u1")])
    store: Any = Forwarding(inner)
    assert store.leases_expire is False  # forwarded, but not declared by the class
    session = await StateMachine([ModelInference()]).run(
        Runtime(store=store, model=ScriptedModel([reply("a")])), "s"
    )
    assert session.revision == 1
