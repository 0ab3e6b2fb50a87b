"""The write path of staged work and of ``submit``, attacked from outside.

Two changes are under attack: a task's record is written under
``_retry.retry_while_moving`` (recomputed from the stored session after each
conflict, for as long as the stored revision moves on; only
``MAX_STALLED_CONFLICTS`` conflicts in a row without movement raise), and every
batch, ``submit``'s included, goes through ``_store.commit``. The attacks:
faults between writes (a store that writes and then raises, a lost reply, a
conflict on the Nth attempt, a reload that raises or is cancelled), records
that must not be written twice (a charge, a non-idempotent tool), concurrent
writers (tasks of one ``Staged``, other processes on one SQLite file),
cancellation at every store call of the retry loop (a ``CancelToken`` and an
outside cancel scope), ``Task.refused`` replacements with conflicts, handlers
that return ``None`` or a wrong session, ``submit`` with hostile inputs, and a
store that keeps refusing. Every test checks the stored history stays valid.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import pytest

from stepmachine import (
    Annotate,
    AppendMessage,
    CancelToken,
    Codec,
    ConfigurationError,
    ConflictError,
    Effect,
    EffectError,
    ImagePart,
    LeaseLostError,
    Message,
    ModelInference,
    Operation,
    Refuse,
    ReplaceConversation,
    Runtime,
    Session,
    Staged,
    StateMachine,
    Task,
    ToolOutput,
    Tools,
    UpdateData,
    Yield,
    _retry,
    submit,
    tool,
)
from stepmachine._emitter import ToolFinished
from stepmachine._ledger import latest_ledger
from stepmachine._outcomes import constant_record
from stepmachine._retry import MAX_STALLED_CONFLICTS, MAX_STORE_FAULTS
from stepmachine.extend import Lease, YieldReason, history_problems
from stepmachine.operations import Budget, Compaction, Limits
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore
from stepmachine.testing import FunctionModel, call, reply

HERE = Path(__file__).resolve().parent
KINDS = ["memory", "sqlite", "file"]


async def open_kind(
    kind: str, folder: Path, codec: Codec[Any] | None = None, dsn: str | None = None
) -> Any:
    """A fresh store of ``kind`` kept in ``folder`` (memory: nothing on disk; postgres:
    the database ``dsn``)."""
    if kind == "postgres":
        from stepmachine.stores import PostgresStore

        assert dsn is not None
        return await PostgresStore.open(dsn, codec)
    if kind == "sqlite":
        return await SQLiteStore.open(folder / "db.sqlite3", codec)
    if kind == "file":
        return await FileStore.open(folder / "files", codec)
    return MemoryStore(codec)


@pytest.fixture(params=KINDS)
async def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Faulty:
    """A store that forwards everything to ``inner``; ``before(batch)`` / ``after(batch,
    stored)`` run around each ``apply`` (either may raise, ``before`` to refuse before
    anything is written, ``after`` once the batch is stored: a lost reply)."""

    applies_batches = True  # it forwards to a store that applies the batch itself
    leases_expire = False

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.leases_expire = inner.leases_expire
        self.before: Callable[[Any], Awaitable[None]] | None = None
        self.after: Callable[[Any, Any], Awaitable[Any]] | None = None
        self.on_load: Callable[[str], Awaitable[None]] | None = None
        self.applied: list[Any] = []  # every batch the inner store took, in order

    async def apply(self, batch: Any, *, lease: Lease | None = None) -> Any:
        if self.before is not None:
            await self.before(batch)
        stored = await self.inner.apply(batch, lease=lease)
        self.applied.append(batch)
        if self.after is not None:
            returned = await self.after(batch, stored)
            if returned is not None:
                return returned
        return stored

    async def load(self, session_id: str) -> Any:
        if self.on_load is not None:
            await self.on_load(session_id)
        return await self.inner.load(session_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def messages_with(session: Session[Any], text: str) -> int:
    return sum(1 for m in session.conversation if m.text == text)


async def assert_valid(store: Any, session_id: str) -> Session[Any]:
    """The stored session: its history valid, its audit log replaying to it."""
    session: Session[Any] = await store.load(session_id)
    assert history_problems(session.conversation) == []
    batches = await store.batches(session_id)
    assert [b.revision for b in batches] == list(range(1, session.revision + 1))
    return session


# -- submit with hostile inputs -------------------------------------------------------------


async def test_submit_reads_a_generator_once_so_a_conflict_does_not_empty_the_batch(
    kind: str, tmp_path: Path
) -> None:
    """Fixed: ``submit`` read a non-sequence iterable again on the attempt after a
    conflict, so a generator gave an empty batch there: the effects were silently lost
    (the call returned a session without them)."""
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s")
        store = Faulty(inner)
        refused = [0]

        async def lose_once(batch: Any) -> None:
            if batch.step == "mine" and not refused[0]:
                refused[0] += 1
                await submit(inner, "s", [AppendMessage(Message.user("other", id="o"))])
                raise ConflictError("s", batch.revision - 1, batch.revision)

        store.before = lose_once
        effects = (AppendMessage(Message.user(f"g{i}", id=f"g{i}")) for i in range(2))
        after = await submit(store, "s", effects, step="mine")  # type: ignore[arg-type]
        assert refused == [1]
        assert [m.id for m in after.conversation] == ["o", "g0", "g1"]
        session = await assert_valid(inner, "s")
        assert [m.id for m in session.conversation] == ["o", "g0", "g1"]
        assert [len(b.effects) for b in await inner.batches("s")] == [1, 2]
    finally:
        await inner.aclose()


@pytest.mark.parametrize("step", [3, b"step", None, 1.5])
async def test_a_batch_whose_step_is_not_a_name_is_refused_and_the_session_stays_readable(
    kind: str, tmp_path: Path, step: object
) -> None:
    """Fixed: ``submit(step=3)`` (or bytes) on a SQLiteStore stored the batch, and every
    later ``load`` of the session raised ``StoredDataError`` (the row did not match its
    checksum): one bad argument made a session unreadable for good."""
    store = await open_kind(kind, tmp_path)
    try:
        await store.create("s", conversation=[Message.user("hi", id="u1")])
        with pytest.raises(Exception) as raised:  # noqa: PT011 - the type differs per store
            await submit(store, "s", [AppendMessage(Message.user("x", id="x"))], step=step)  # type: ignore[arg-type]
        assert "step" in str(raised.value)
        if kind != "memory":
            await store.aclose()
            store = await open_kind(kind, tmp_path)  # what a fresh process reads
        session = await assert_valid(store, "s")
        assert session.revision == 0
        assert [m.id for m in session.conversation] == ["u1"]
        after = await submit(store, "s", [AppendMessage(Message.user("y", id="y"))])
        assert after.revision == 1
    finally:
        await store.aclose()


@pytest.mark.parametrize(
    "effects",
    [["not an effect"], None, lambda s: None, lambda s: 1 / 0, [UpdateData.set(x=1), object()]],
    ids=["str", "none", "callable-none", "callable-raises", "mixed"],
)
async def test_submit_with_hostile_effects_raises_and_writes_nothing(
    kind: str, tmp_path: Path, effects: Any
) -> None:
    store = await open_kind(kind, tmp_path)
    try:
        await store.create("s", conversation=[Message.user("hi", id="u1")])
        with pytest.raises(Exception):  # noqa: B017, PT011 - any error; the point: nothing stored
            await submit(store, "s", effects)
        session = await assert_valid(store, "s")
        assert session.revision == 0
        assert await store.batches("s") == []
    finally:
        await store.aclose()


@pytest.mark.parametrize(
    "clock",
    [lambda: float("nan"), lambda: float("inf"), lambda: "now", lambda: None],
    ids=["nan", "inf", "str", "none"],
)
async def test_submit_with_a_hostile_clock_raises_and_writes_nothing(
    kind: str, tmp_path: Path, clock: Callable[[], Any]
) -> None:
    store = await open_kind(kind, tmp_path)
    try:
        await store.create("s", conversation=[Message.user("hi", id="u1")])
        with pytest.raises(Exception):  # noqa: B017, PT011 - any error; the point: nothing stored
            await submit(store, "s", [AppendMessage(Message.user("x", id="x"))], clock=clock)
        if kind != "memory":
            await store.aclose()
            store = await open_kind(kind, tmp_path)
        session = await assert_valid(store, "s")
        assert session.revision == 0
    finally:
        await store.aclose()


@pytest.mark.parametrize("session_id", ["../escape", "", "nope", "a/b"])
async def test_submit_to_a_hostile_or_missing_session_id_writes_nothing(
    kind: str, tmp_path: Path, session_id: str
) -> None:
    store = await open_kind(kind, tmp_path)
    try:
        await store.create("s", conversation=[Message.user("hi", id="u1")])
        with pytest.raises(Exception):  # noqa: B017, PT011 - not found, or an invalid id
            await submit(store, session_id, [AppendMessage(Message.user("x", id="x"))])
        assert await store.list_sessions() == ["s"]
        assert (await assert_valid(store, "s")).revision == 0
    finally:
        await store.aclose()
    assert not (tmp_path / "escape").exists()


# -- a record computed before a conflict must not overwrite what the other writer wrote -------


def _long_conversation() -> list[Message]:
    conversation = []
    for i in range(6):
        conversation.append(Message.user(f"question {i} " + "words " * 30, id=f"u{i}"))
        conversation.append(Message.assistant(f"answer {i} " + "more " * 30, id=f"a{i}"))
    conversation.append(Message.user("the last question", id="ulast"))
    return conversation


@pytest.mark.parametrize("budget", [False, True], ids=["no-budget", "budget"])
async def test_a_message_submitted_while_the_summariser_runs_survives_compaction(
    kind: str, tmp_path: Path, budget: bool
) -> None:
    """Fixed: compaction's record was a constant ``ReplaceConversation`` built from the
    conversation the summariser was asked about; when a user message was submitted
    meanwhile, the record's write conflicted, was retried from the stored session, and
    wrote that replacement over it: the acknowledged message was gone (a lost update)."""
    store = await open_kind(kind, tmp_path)
    try:
        await store.create("s", conversation=_long_conversation())
        steered = [0]

        async def summarise(request: Any) -> Any:
            if not steered[0]:  # the user steers while the summariser runs
                steered[0] += 1
                steer = Message.user("STEER: use metric units", id="steer")
                await submit(store, "s", [AppendMessage(steer)])
            return reply("a summary")

        asked: list[Any] = []

        def agent(request: Any) -> Any:
            asked.append(request)
            return reply("final")

        summariser = FunctionModel(summarise, name="summariser")
        runtime = Runtime(
            store=store,
            model=FunctionModel(agent, name="agent"),
            models={"summariser": summariser},
        )
        compaction = Compaction(threshold=100, keep_turns=1, model="summariser")
        steps: list[Any] = [compaction, ModelInference()]
        if budget:  # the summariser's call is reserved first: an intent batch before it
            steps.insert(0, Budget(per_session=Limits(model_calls=10)))
        report = await StateMachine(steps).run_report(runtime, "s")
        assert report.reason.kind == "done"
        session = await assert_valid(store, "s")
        steer = session.message("steer")
        assert steer is not None, [m.id for m in session.conversation]
        assert steer.visible_to_model
        assert any(m.id == "steer" for m in asked[-1].messages)  # the model saw it
        assert summariser.calls == 2  # the stale summary was not written; asked again
        assert messages_with(session, "final") == 1
        ledger = latest_ledger(session).ledger
        assert ledger is not None
        assert ledger.session.model_calls == 3  # both summariser calls and the agent's
    finally:
        await store.aclose()


@pytest.mark.parametrize("budget", [False, True], ids=["no-budget", "budget"])
async def test_a_summary_stored_whose_write_reply_is_lost_is_not_counted_again(
    kind: str, tmp_path: Path, budget: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The summary's batch is stored and the connection fails before the reply: the
    fault is waited out, and the record computed again finds its summary stored: nothing
    more is written for it and the summariser's call is counted once."""
    monkeypatch.setattr(_retry, "backoff", lambda attempt: 0.0)
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s", conversation=_long_conversation())
        store = Faulty(inner)

        async def lose_reply(batch: Any, stored: Any) -> None:
            replaced = any(isinstance(e, ReplaceConversation) for e in batch.effects)
            if replaced and store.after is not None:
                store.after = None
                raise ConnectionResetError("the reply was lost")

        store.after = lose_reply
        summariser = FunctionModel(lambda request: reply("a summary"), name="summariser")
        runtime = Runtime(
            store=store,
            model=FunctionModel(lambda request: reply("final"), name="agent"),
            models={"summariser": summariser},
        )
        steps: list[Any] = [
            Compaction(threshold=100, keep_turns=1, model="summariser"),
            ModelInference(),
        ]
        if budget:
            steps.insert(0, Budget(per_session=Limits(model_calls=10)))
        report = await StateMachine(steps).run_report(runtime, "s")
        assert report.reason.kind == "done"
        assert store.after is None  # the reply was lost
        assert summariser.calls == 1
        session = await assert_valid(inner, "s")
        assert messages_with(session, "final") == 1
        batches = await inner.batches("s")
        replaced_at = [
            b.revision
            for b in batches
            if any(isinstance(e, ReplaceConversation) for e in b.effects)
        ]
        assert len(replaced_at) == 1
        after = [b.step for b in batches if b.revision > replaced_at[0]]
        assert "compaction" not in after, after  # no second record of the same call
        ledger = latest_ledger(session).ledger
        assert ledger is not None
        assert ledger.session.model_calls == 2  # the summariser's call and the agent's
    finally:
        await inner.aclose()


# -- a charge under fire: the intent, the charges, one receipt each ---------------------------


def texts(session: Session[Any]) -> list[str]:
    return [m.text or "" for m in session.conversation]


class Charges(Operation[Any]):
    """Charges each of ``keys`` once, as ``examples/charge_card.py`` does: the intent
    (a message ``intent``), then one guarded task per key whose record is the message
    ``receipt KEY`` unless the stored session holds it already. ``charged`` lists every
    charge made (the side effect: a charge made always has its record held, there is
    no checkpoint between the two). ``replacement`` (a key): the store refusing that
    key's receipt is answered with the constant record ``too large KEY``."""

    name = "charges"

    def __init__(
        self,
        keys: Sequence[str] = ("a",),
        *,
        concurrency: int = 1,
        gate: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.keys, self.concurrency, self.gate = tuple(keys), concurrency, gate
        self.charged: list[str] = []

    async def run(self, ctx: Any) -> Any:
        seen = texts(ctx.session)
        if "intent" in seen:
            if all(f"receipt {k}" in seen or f"too large {k}" in seen for k in self.keys):
                return Refuse("charged")
            return Yield([], "outcome_unknown")
        intent = [AppendMessage(Message.user("intent", id=ctx.new_id()))]
        tasks = [self.task(ctx, key) for key in self.keys]
        return Staged(
            intent, tasks, max_concurrency=self.concurrency, then=lambda: Yield([], "done")
        )

    def task(self, ctx: Any, key: str) -> Task:
        async def charge() -> Any:
            if self.gate is not None:
                await self.gate(key)
            self.charged.append(key)
            return self.record(ctx, f"receipt {key}")

        def refused(exc: Exception) -> Any:
            return constant_record(AppendMessage(Message.user(f"too large {key}", id=ctx.new_id())))

        return Task(f"charge {key}", charge, guarded=True, refused=refused)

    @staticmethod
    def record(ctx: Any, text: str) -> Any:
        def record(stored: Session[Any]) -> Sequence[Effect]:
            if text in texts(stored):
                return ()
            return [AppendMessage(Message.user(text, id=ctx.new_id()))]

        return record


def is_receipt(batch: Any) -> str | None:
    """The key of the receipt ``batch`` writes, if it writes one."""
    for effect in batch.effects:
        if isinstance(effect, AppendMessage):
            text = effect.message.text or ""
            if text.startswith(("receipt ", "too large ")):
                return text.split(" ")[-1]
    return None


async def assert_charged_once(store: Any, step: Charges, *, all_keys: bool = True) -> None:
    """Every charge made has exactly one receipt, stored in exactly one batch; no key
    was charged twice; with ``all_keys``, every key was charged."""
    session = await assert_valid(store, "s")
    assert len(step.charged) == len(set(step.charged)), step.charged
    if all_keys:
        assert sorted(step.charged) == sorted(step.keys)
    found = texts(session)
    for key in step.charged:
        answers = found.count(f"receipt {key}") + found.count(f"too large {key}")
        assert answers == 1, (key, found)
    written = [is_receipt(b) for b in await store.batches("s")]
    receipts = [key for key in written if key is not None]
    assert sorted(receipts) == sorted(step.charged), (receipts, step.charged)
    assert found.count("intent") == (1 if step.charged else found.count("intent")) <= 1


async def other_writer(store: Any, label: str) -> None:
    """Another writer's batch on session ``s`` (a message submitted)."""
    await submit(store, "s", [AppendMessage(Message.user(f"other {label}", id=label))])


@pytest.mark.parametrize("losses", [1, 5, MAX_STALLED_CONFLICTS + 1, 40])
@pytest.mark.parametrize("concurrency", [1, 3])
async def test_a_receipt_that_loses_the_race_n_times_is_written_once(
    kind: str, tmp_path: Path, losses: int, concurrency: int
) -> None:
    """Another writer moves the session on right before each of the first ``losses``
    receipt writes (a real conflict in the store): every receipt is still written,
    once, and nothing is charged twice."""
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s")
        store = Faulty(inner)
        moved = itertools.count()

        async def lose(batch: Any) -> None:
            if is_receipt(batch) is not None:
                n = next(moved)
                if n < losses:
                    await other_writer(inner, f"x{n}")

        store.before = lose
        step = Charges(["a", "b", "c"], concurrency=concurrency)
        report = await StateMachine([step], max_conflicts=0).run_report(Runtime(store=store), "s")
        assert report.reason.kind == "done"
        await assert_charged_once(inner, step)
        session = await inner.load("s")
        assert sum(t.startswith("other ") for t in texts(session)) == losses
    finally:
        await inner.aclose()


@pytest.mark.parametrize("stalled", [MAX_STALLED_CONFLICTS, MAX_STALLED_CONFLICTS + 1])
async def test_a_store_that_refuses_a_receipt_without_moving_on_ends_in_a_conflict(
    kind: str, tmp_path: Path, stalled: int
) -> None:
    """A store that raises ``ConflictError`` with nothing written and nothing moved on:
    up to ``MAX_STALLED_CONFLICTS`` in a row are retried and the receipt is written;
    one more raises ``ConflictError`` (no livelock). Either way no batch is lost and
    nothing is charged twice, also when the run is started again."""
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s")
        store = Faulty(inner)
        refusals = [0]

        async def refuse(batch: Any) -> None:
            if is_receipt(batch) is not None and refusals[0] < stalled:
                refusals[0] += 1
                raise ConflictError("s", batch.revision - 1, batch.revision - 1)

        store.before = refuse
        step = Charges(["a"])
        machine = StateMachine([step], max_conflicts=0)
        if stalled <= MAX_STALLED_CONFLICTS:
            report = await machine.run_report(Runtime(store=store), "s")
            assert report.reason.kind == "done"
            await assert_charged_once(inner, step)
        else:
            with pytest.raises(ConflictError):
                await machine.run_report(Runtime(store=store), "s")
            assert refusals[0] == stalled
            session = await assert_valid(inner, "s")
            assert texts(session) == ["intent"]  # the intent stays; the receipt is gone
            again = await machine.run_report(Runtime(store=store), "s")
            assert again.reason.kind == "outcome_unknown"  # never charged again
        assert step.charged == ["a"]
    finally:
        await inner.aclose()


async def test_stalled_conflicts_between_moves_are_counted_in_a_row_only(
    kind: str, tmp_path: Path
) -> None:
    """``MAX_STALLED_CONFLICTS`` unexplained conflicts, one explained, as many again:
    the count starts again after the explained one, so the receipt is written."""
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s")
        store = Faulty(inner)
        attempts = itertools.count()

        async def pattern(batch: Any) -> None:
            if is_receipt(batch) is None:
                return
            n = next(attempts)
            if n == MAX_STALLED_CONFLICTS:
                await other_writer(inner, "x")  # a real conflict: the session moves on
            elif n < 2 * MAX_STALLED_CONFLICTS + 1:
                raise ConflictError("s", batch.revision - 1, batch.revision - 1)

        store.before = pattern
        step = Charges(["a"])
        report = await StateMachine([step], max_conflicts=0).run_report(Runtime(store=store), "s")
        assert report.reason.kind == "done"
        assert next(attempts) == 2 * MAX_STALLED_CONFLICTS + 2
        await assert_charged_once(inner, step)
    finally:
        await inner.aclose()


# -- faults between writes ------------------------------------------------------------------


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_a_receipt_stored_whose_reply_is_lost_as_a_conflict_is_not_written_again(
    kind: str, tmp_path: Path, concurrency: int
) -> None:
    """The store writes the receipt, then its reply is lost and the caller sees a
    conflict (a wrapper that retried the write, say): the reload shows the session moved
    on (by the receipt itself), the record is computed again from it and writes nothing."""
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s")
        store = Faulty(inner)
        lost: list[str] = []

        async def lose_reply(batch: Any, stored: Any) -> None:
            key = is_receipt(batch)
            if key is not None and key not in lost:
                lost.append(key)
                raise ConflictError("s", batch.revision - 1, batch.revision)

        store.after = lose_reply
        step = Charges(["a", "b", "c"], concurrency=concurrency)
        report = await StateMachine([step], max_conflicts=0).run_report(Runtime(store=store), "s")
        assert report.reason.kind == "done"
        assert sorted(lost) == ["a", "b", "c"]
        await assert_charged_once(inner, step)
    finally:
        await inner.aclose()


async def test_a_receipt_stored_whose_reply_is_lost_as_an_os_error_stays_once(
    kind: str, tmp_path: Path
) -> None:
    """The store writes the receipt and the connection fails before the reply: the
    fault is waited out, the receipt computed again from the stored session is found
    there, and the run ends with the receipt stored once."""
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s")
        store = Faulty(inner)

        async def lose_reply(batch: Any, stored: Any) -> None:
            if is_receipt(batch) is not None and store.after is not None:
                store.after = None
                raise ConnectionResetError("the reply was lost")

        store.after = lose_reply
        step = Charges(["a"])
        report = await StateMachine([step]).run_report(Runtime(store=store), "s")
        assert report.reason.kind == "done"
        assert store.after is None  # the fault happened
        again = await StateMachine([step]).run_report(Runtime(store=store), "s")
        assert again.reason.kind == "idle"  # charged and recorded: nothing to do
        await assert_charged_once(inner, step)
    finally:
        await inner.aclose()


@pytest.mark.parametrize("where", ["write", "reload"])
async def test_a_few_store_faults_while_a_receipt_is_written_are_waited_out(
    kind: str, tmp_path: Path, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receipt's write, or the reload after its conflict, fails with a store fault
    up to MAX_STORE_FAULTS times: each is waited out and the receipt is written once."""
    monkeypatch.setattr(_retry, "backoff", lambda attempt: 0.0)
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s")
        store = Faulty(inner)
        faults = [0]

        async def fail_write(batch: Any) -> None:
            if is_receipt(batch) is not None and faults[0] < MAX_STORE_FAULTS:
                faults[0] += 1
                raise ConnectionResetError("the store is gone for a moment")

        conflicted = [False]

        async def lose_once(batch: Any) -> None:
            if is_receipt(batch) is not None and not conflicted[0]:
                conflicted[0] = True
                await other_writer(inner, "x")

        async def fail_reload(session_id: str) -> None:
            if conflicted[0] and faults[0] < MAX_STORE_FAULTS:
                faults[0] += 1
                raise ConnectionResetError("the store is gone for a moment")

        if where == "write":
            store.before = fail_write
        else:
            store.before, store.on_load = lose_once, fail_reload
        step = Charges(["a"])
        report = await StateMachine([step]).run_report(Runtime(store=store), "s")
        assert report.reason.kind == "done"
        assert faults[0] == MAX_STORE_FAULTS
        await assert_charged_once(inner, step)
    finally:
        await inner.aclose()


async def test_store_faults_past_the_limit_propagate_and_never_lead_to_a_second_charge(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store keeps failing past MAX_STORE_FAULTS while the receipt is written: the
    run raises the fault; the receipt it held is not written (nothing can be), and the
    run started again reads the intent without a receipt as an outcome it cannot know:
    the card is never charged a second time."""
    waits: list[int] = []

    def no_wait(attempt: int) -> float:
        waits.append(attempt)
        return 0.0

    monkeypatch.setattr(_retry, "backoff", no_wait)
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s")
        store = Faulty(inner)
        faults = [0]

        async def fail_write(batch: Any) -> None:
            if is_receipt(batch) is not None:
                faults[0] += 1
                raise ConnectionResetError("the store is gone")

        store.before = fail_write
        step = Charges(["a"])
        with pytest.raises(ConnectionResetError):
            await StateMachine([step]).run_report(Runtime(store=store), "s")
        assert faults[0] == MAX_STORE_FAULTS + 1
        assert waits == list(range(1, MAX_STORE_FAULTS + 1))  # a backoff before each retry
        store.before = None
        again = await StateMachine([step]).run_report(Runtime(store=store), "s")
        assert again.reason.kind == "outcome_unknown"
        assert step.charged == ["a"]
        session = await assert_valid(inner, "s")
        assert "receipt a" not in texts(session)
    finally:
        await inner.aclose()


async def test_a_lost_lease_while_a_receipt_is_written_is_not_waited_out() -> None:
    """Only the store's own faults are waited out: a lost lease stops the write at once."""
    inner = MemoryStore()
    await inner.create("s")
    store = Faulty(inner)
    tries = [0]

    async def lost(batch: Any) -> None:
        if is_receipt(batch) is not None:
            tries[0] += 1
            raise LeaseLostError("s", "someone", 1, "taken over")

    store.before = lost
    step = Charges(["a"])
    with pytest.raises(LeaseLostError):
        await StateMachine([step]).run_report(Runtime(store=store), "s")
    assert tries == [1]
    assert step.charged == ["a"]


@pytest.mark.parametrize("how", ["token", "scope"])
@pytest.mark.parametrize("concurrency", [1, 3])
async def test_a_reload_cancelled_mid_retry_leaves_the_receipt_to_finalize(
    kind: str, tmp_path: Path, how: str, concurrency: int
) -> None:
    """Cancelled (the machine's token, or a cancel scope from outside) while the
    retry loop reloads after a conflict: finalize writes every receipt the machine
    held, once each."""
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s")
        store = Faulty(inner)
        token = CancelToken()
        scope = anyio.CancelScope()
        state = {"conflicted": False, "cancelled": False}

        async def lose(batch: Any) -> None:
            if is_receipt(batch) is not None and not state["conflicted"]:
                state["conflicted"] = True
                await other_writer(inner, "x")

        async def cancel_reload(session_id: str) -> None:
            if state["conflicted"] and not state["cancelled"]:
                state["cancelled"] = True
                if how == "token":
                    token.cancel("stop")
                else:
                    scope.cancel()
                await anyio.lowlevel.checkpoint()

        store.before, store.on_load = lose, cancel_reload
        step = Charges(["a", "b", "c"], concurrency=concurrency)
        machine = StateMachine([step], cancel=token if how == "token" else None)
        reports = []
        with scope:
            reports.append(await machine.run_report(Runtime(store=store), "s"))
        assert state["cancelled"]
        if how == "token":
            assert reports[0].reason.kind == YieldReason.CANCELLED
        else:
            assert scope.cancelled_caught
            assert not reports
        await assert_charged_once(inner, step, all_keys=False)
        assert step.charged  # at least the one whose write was cut
    finally:
        await inner.aclose()


class Sweep(Faulty):
    """A :class:`Faulty` store that runs ``fire()`` at its ``at``-th apply or load (from
    0), before the call reaches the store or, with ``after``, once the store answered:
    then a checkpoint, where a cancellation lands. The first receipt write of each key
    loses the race to another writer (so the retry loop runs)."""

    def __init__(self, inner: Any, at: int, after: bool, fire: Callable[[], None]) -> None:
        super().__init__(inner)
        self.at, self.at_after, self.fire, self.count, self.fired = at, after, fire, 0, False
        self.lost: set[str] = set()

    async def tick(self) -> None:
        if self.count == self.at:
            self.fired = True
            self.fire()
            await anyio.lowlevel.checkpoint()
        self.count += 1

    async def apply(self, batch: Any, *, lease: Lease | None = None) -> Any:
        key = is_receipt(batch)
        if key is not None and key not in self.lost:
            self.lost.add(key)
            await other_writer(self.inner, f"x-{key}")
        if not self.at_after:
            await self.tick()
        stored = await self.inner.apply(batch, lease=lease)
        if self.at_after:
            await self.tick()
        return stored

    async def load(self, session_id: str) -> Any:
        if not self.at_after:
            await self.tick()
        loaded = await self.inner.load(session_id)
        if self.at_after:
            await self.tick()
        return loaded


@pytest.mark.parametrize("after", [False, True], ids=["before-call", "after-call"])
@pytest.mark.parametrize("how", ["token", "scope"])
@pytest.mark.parametrize("concurrency", [1, 3])
@pytest.mark.parametrize("store_kind", ["memory", "sqlite"])
async def test_a_cancel_at_every_store_call_of_the_record_loop_charges_and_records_once(
    tmp_path: Path, after: bool, how: str, concurrency: int, store_kind: str
) -> None:
    """A cancellation at the k-th store call of a run, for every k until the run
    finishes first (before the call, or after the store answered: the batch stored,
    its reply not yet seen), with a conflict on each receipt's first write: nothing is
    charged twice, every charge made has exactly one receipt, the history stays valid,
    and the session is free for the next run, which finishes the work."""
    k = 0
    while True:
        assert k < 200, "the run never finished before the canceller"
        (tmp_path / str(k)).mkdir()
        inner = await open_kind(store_kind, tmp_path / str(k))
        await inner.create("s")
        token = CancelToken()
        scope = anyio.CancelScope()

        def fire(token: CancelToken = token, scope: anyio.CancelScope = scope) -> None:
            if how == "token":
                token.cancel("stop")
            else:
                scope.cancel()

        store = Sweep(inner, k, after, fire)
        step = Charges(["a", "b", "c"], concurrency=concurrency)
        machine = StateMachine([step], cancel=token if how == "token" else None)
        reports = []
        with scope:
            reports.append(await machine.run_report(Runtime(store=store), "s"))
        await assert_charged_once(inner, step, all_keys=False)
        if not store.fired:
            assert reports[0].reason.kind == "done"
            await assert_charged_once(inner, step)
            await inner.aclose()
            break
        # The next run (no more cancels) charges what is left or knows it cannot tell.
        rerun = await StateMachine([step]).run_report(Runtime(store=inner), "s")
        assert rerun.reason.kind in ("done", "idle", "outcome_unknown"), (k, rerun.reason)
        await assert_charged_once(inner, step, all_keys=rerun.reason.kind != "outcome_unknown")
        await inner.aclose()
        k += 1
    assert k > 5  # the sweep went through the retry loop


# -- Task.refused replacements with conflicts -------------------------------------------------


class RunawayError(Exception):
    """What a test's store raises to stop a loop that would not stop by itself."""


@pytest.mark.parametrize("losses", [0, 3, MAX_STALLED_CONFLICTS + 2])
async def test_a_replacement_record_that_loses_the_race_is_what_is_written_once(
    kind: str, tmp_path: Path, losses: int
) -> None:
    """The store refuses key a's receipt (``EffectError``, nothing written); the task's
    ``refused`` gives a replacement, whose writes then lose the race ``losses`` times:
    the replacement is written once, the refused receipt never."""
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s")
        store = Faulty(inner)
        moved = itertools.count()

        async def refuse_then_lose(batch: Any) -> None:
            text = next(iter(t for t in map(_text, batch.effects) if t), "")
            if text == "receipt a":
                raise EffectError("the receipt is too large for this store")
            if text == "too large a":
                n = next(moved)
                if n < losses:
                    await other_writer(inner, f"x{n}")

        store.before = refuse_then_lose
        step = Charges(["a", "b"])
        report = await StateMachine([step], max_conflicts=0).run_report(Runtime(store=store), "s")
        assert report.reason.kind == "done"
        await assert_charged_once(inner, step)
        found = texts(await inner.load("s"))
        assert found.count("too large a") == 1
        assert "receipt a" not in found
        assert found.count("receipt b") == 1
    finally:
        await inner.aclose()


def _text(effect: Any) -> str:
    return (effect.message.text or "") if isinstance(effect, AppendMessage) else ""


@pytest.mark.parametrize("how", ["token", "scope"])
async def test_a_written_replacement_is_not_left_held_for_finalize_to_write_again(
    kind: str, tmp_path: Path, how: str
) -> None:
    """Two tasks at once: key a's receipt is refused and its (constant) replacement is
    written after a conflict; then, while key b has not started its charge, the run is
    cancelled. Finalize writes what the machine still holds: not a's replacement again."""
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s")
        store = Faulty(inner)
        token = CancelToken()
        scope = anyio.CancelScope()
        replaced = anyio.Event()
        lost = [False]

        async def refuse_then_lose(batch: Any) -> None:
            text = next(iter(t for t in map(_text, batch.effects) if t), "")
            if text == "receipt a":
                raise EffectError("the receipt is too large for this store")
            if text == "too large a" and not lost[0]:
                lost[0] = True
                await other_writer(inner, "x")

        async def after(batch: Any, stored: Any) -> None:
            if any(_text(e) == "too large a" for e in batch.effects):
                replaced.set()

        async def gate(key: str) -> None:
            if key == "b":
                await replaced.wait()
                await anyio.lowlevel.checkpoint()  # a's record is through (dropped) by now
                token.cancel("stop") if how == "token" else scope.cancel()
                await anyio.sleep_forever()

        store.before, store.after = refuse_then_lose, after
        step = Charges(["a", "b"], concurrency=2, gate=gate)
        machine = StateMachine([step], cancel=token if how == "token" else None)
        with scope:
            await machine.run_report(Runtime(store=store), "s")
        assert lost[0]
        assert step.charged == ["a"]
        await assert_charged_once(inner, step, all_keys=False)
        assert texts(await inner.load("s")).count("too large a") == 1
    finally:
        await inner.aclose()


async def test_a_refused_replacement_that_is_refused_again_does_not_loop_forever(
    kind: str, tmp_path: Path
) -> None:
    """The store refuses the receipt and every replacement ``refused`` gives: the run
    ends with the store's error, after a bounded number of attempts (no livelock)."""
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s")
        store = Faulty(inner)
        refusals = [0]

        async def refuse_all(batch: Any) -> None:
            if is_receipt(batch) is not None:
                refusals[0] += 1
                if refusals[0] > 50:
                    raise RunawayError("the refusals never stop")
                raise EffectError("this store takes no receipts")

        store.before = refuse_all
        step = Charges(["a"])
        with pytest.raises(EffectError):
            await StateMachine([step]).run_report(Runtime(store=store), "s")
        assert refusals[0] <= 2
        assert step.charged == ["a"]
    finally:
        await inner.aclose()


# -- handlers that return None, or another session ------------------------------------------


class Handler:
    """An effect handler of an application's own (no ``applies_batches``: the machine
    applies each batch itself first), over ``inner``; ``answer(batch, stored)`` is what
    its ``apply`` returns (the stored session by default)."""

    def __init__(self, inner: Any, answer: Callable[[Any, Any], Any] | None = None) -> None:
        self.inner, self.answer, self.batches = inner, answer, 0

    async def apply(self, batch: Any) -> Any:
        stored = await self.inner.apply(batch)
        self.batches += 1
        return stored if self.answer is None else self.answer(batch, stored)


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_a_handler_that_returns_none_records_each_charge_once_through_conflicts(
    kind: str, tmp_path: Path, concurrency: int
) -> None:
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s")
        faulty = Faulty(inner)
        moved = itertools.count()

        async def lose(batch: Any) -> None:
            if is_receipt(batch) is not None and next(moved) < 4:
                await other_writer(inner, f"x{next(moved)}")

        faulty.before = lose
        handler = Handler(faulty, lambda batch, stored: None)
        step = Charges(["a", "b", "c"], concurrency=concurrency)
        runtime = Runtime(loader=inner, handler=handler)
        report = await StateMachine([step], max_conflicts=0).run_report(runtime, "s")
        assert report.reason.kind == "done"
        assert report.session == await inner.load("s")
        await assert_charged_once(inner, step)
    finally:
        await inner.aclose()


@pytest.mark.parametrize(
    "wrong",
    [
        lambda batch, stored: msgspec.structs.replace(stored, revision=stored.revision - 1),
        lambda batch, stored: msgspec.structs.replace(stored, id="another"),
        lambda batch, stored: {"revision": stored.revision, "id": stored.id},
        lambda batch, stored: True,
    ],
    ids=["the-session-before", "another-id", "a-dict", "true"],
)
async def test_a_handler_that_returns_a_wrong_session_for_a_receipt_is_a_configuration_error(
    kind: str, tmp_path: Path, wrong: Callable[[Any, Any], Any]
) -> None:
    """The handler stores the receipt and returns something that is not the session
    after it: ``ConfigurationError`` naming the handler (the receipt stays stored, the
    card is never charged again)."""
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s")

        def answer(batch: Any, stored: Any) -> Any:
            return wrong(batch, stored) if is_receipt(batch) is not None else stored

        step = Charges(["a"])
        runtime = Runtime(loader=inner, handler=Handler(inner, answer))
        with pytest.raises(ConfigurationError, match="Handler"):
            await StateMachine([step]).run_report(runtime, "s")
        again = await StateMachine([step]).run_report(Runtime(store=inner), "s")
        assert again.reason.kind == "idle"
        await assert_charged_once(inner, step)
    finally:
        await inner.aclose()


async def test_submit_through_a_handler_that_returns_another_session_is_a_configuration_error(
    kind: str, tmp_path: Path
) -> None:
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s")

        class Lying(Faulty):
            async def apply(self, batch: Any, *, lease: Lease | None = None) -> Any:
                stored = await self.inner.apply(batch, lease=lease)
                return msgspec.structs.replace(stored, revision=0)

        with pytest.raises(ConfigurationError, match="Lying"):
            await submit(Lying(inner), "s", [AppendMessage(Message.user("x", id="x"))])
        session = await assert_valid(inner, "s")
        assert [m.id for m in session.conversation] == ["x"]  # it was stored, once
    finally:
        await inner.aclose()


# -- concurrent writers in one process ------------------------------------------------------


async def busy_writer(store: Any, done: anyio.Event, wrote: list[int], target: str) -> None:
    """Another writer: annotates message ``target`` over and over (each a batch, and
    each a checkpoint) until ``done`` is set, at most 60 times (a writer that never
    pauses can starve a compare-and-set writer for ever: that is not under test)."""
    n = 0
    while not done.is_set() and n < 60:
        n += 1
        await submit(store, "s", [Annotate(target, "other", {"n": n})], max_attempts=1000)
        wrote.append(n)
        await anyio.lowlevel.checkpoint()


@pytest.mark.parametrize("concurrency", [2, 8])
async def test_charges_at_once_with_another_writer_busy_are_each_recorded_once(
    kind: str, tmp_path: Path, concurrency: int
) -> None:
    """Eight charges, up to ``concurrency`` at once, while another writer keeps moving
    the session on: every charge is recorded exactly once and no writer's batch is lost."""
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s", conversation=[Message.user("hi", id="u1")])

        async def gate(key: str) -> None:
            for _ in range(ord(key[-1]) % 5):  # the charges land in another order
                await anyio.lowlevel.checkpoint()

        step = Charges([f"k{i}" for i in range(8)], concurrency=concurrency, gate=gate)
        done = anyio.Event()
        wrote: list[int] = []
        reports = []

        async def run() -> None:
            machine = StateMachine([step], max_conflicts=1000)
            reports.append(await machine.run_report(Runtime(store=inner), "s"))
            done.set()

        async with anyio.create_task_group() as group:
            group.start_soon(busy_writer, inner, done, wrote, "u1")
            group.start_soon(run)
        assert reports[0].reason.kind == "done"
        await assert_charged_once(inner, step)
        session = await inner.load("s")
        assert session.conversation[0].notes["other"] == {"n": wrote[-1]}
        annotations = [
            b for b in await inner.batches("s") if any(isinstance(e, Annotate) for e in b.effects)
        ]
        assert len(annotations) == len(wrote)  # every batch the other writer got back is kept
    finally:
        await inner.aclose()


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_non_idempotent_tools_with_another_writer_busy_run_and_answer_once(
    kind: str, tmp_path: Path, concurrency: int
) -> None:
    """The ``Tools`` step, non-idempotent tools, another writer moving the session on
    all along: each call ran once and has exactly one result, in one batch."""
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s", conversation=[Message.user("go", id="u1")])
        ran: list[int] = []

        @tool(side_effects="non_idempotent")
        async def pay(x: int) -> str:
            """Pay ``x``."""
            await anyio.lowlevel.checkpoint()
            ran.append(x)
            return f"paid {x}"

        def answer(request: Any) -> Any:
            if request.messages[-1].role == "user":
                return call(*[("pay", {"x": x}) for x in range(5)])
            return reply("done")

        machine = StateMachine(
            [Tools([pay], max_concurrency=concurrency), ModelInference()], max_conflicts=1000
        )
        runtime = Runtime(store=inner, model=FunctionModel(answer))
        done = anyio.Event()
        wrote: list[int] = []
        reports = []

        async def run() -> None:
            reports.append(await machine.run_report(runtime, "s"))
            done.set()

        async with anyio.create_task_group() as group:
            group.start_soon(busy_writer, inner, done, wrote, "u1")
            group.start_soon(run)
        assert reports[0].reason.kind == "done"
        assert sorted(ran) == list(range(5))
        session = await assert_valid(inner, "s")
        results = [r.content for m in session.conversation for r in m.tool_results]
        assert sorted(results) == [f"paid {x}" for x in range(5)], results
        written = [
            r.call_id
            for b in await inner.batches("s")
            for e in b.effects
            if isinstance(e, AppendMessage)
            for r in e.message.tool_results
        ]
        assert len(written) == len(set(written)) == 5
    finally:
        await inner.aclose()


# -- processes on one SQLite file -----------------------------------------------------------


@pytest.mark.parametrize("store_kind", ["sqlite", "file"])
async def test_runners_and_writers_in_processes_on_one_store_charge_each_key_once(
    tmp_path: Path, anyio_backend_name: str, store_kind: str
) -> None:
    """Three processes run the charging machine on one session without a lease (they
    race on the intent) while two more keep writing to it: each key is charged once,
    by one process, and has exactly one receipt, in one batch; every other writer's
    batch is kept; the history is valid."""
    log = tmp_path / "charges.log"
    db = tmp_path / ("db.sqlite3" if store_kind == "sqlite" else "files")
    store = await open_kind(store_kind, tmp_path)
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    await store.aclose()
    child = str(HERE / "_record_race_child.py")
    roles = [("charge", "r0"), ("write", "w0"), ("charge", "r1"), ("write", "w1"), ("charge", "r2")]
    outputs: dict[str, dict[str, Any]] = {}

    async def one(mode: str, name: str) -> None:
        command = [sys.executable, child, str(db), str(log), mode, name, anyio_backend_name]
        command.append(store_kind)
        done = await anyio.run_process(command, check=True)
        outputs[name] = json.loads(done.stdout.decode().strip().splitlines()[-1])

    async with anyio.create_task_group() as group:
        for mode, name in roles:
            group.start_soon(one, mode, name)
    charges = [line.split() for line in log.read_text().splitlines()]
    keys = [key for _, key, _pid in charges]
    assert sorted(keys) == [f"k{i}" for i in range(6)], charges  # each key charged once
    assert len({pid for _, _, pid in charges}) == 1  # by the one runner that wrote the intent
    reasons = sorted(outputs[name]["reason"] for _, name in roles if name.startswith("r"))
    assert reasons.count("done") == 1, reasons
    assert set(reasons) <= {"done", "outcome_unknown", "idle"}, reasons
    store = await open_kind(store_kind, tmp_path)
    try:
        session = await assert_valid(store, "s")
        found = texts(session)
        assert found.count("intent") == 1
        for key in keys:
            assert found.count(f"receipt {key}") == 1, found
        written = [is_receipt(b) for b in await store.batches("s")]
        assert sorted(k for k in written if k is not None) == sorted(keys)
        notes = session.conversation[0].notes
        assert notes["w0"] == {"n": 39}
        assert notes["w1"] == {"n": 39}
        annotations = [
            b for b in await store.batches("s") if any(isinstance(e, Annotate) for e in b.effects)
        ]
        assert len(annotations) == 80  # no writer's batch lost
    finally:
        await store.aclose()


# -- a model reply whose write loses its reply ----------------------------------------------


@pytest.mark.parametrize("lost", ["conflict", "os_error", "cancel"])
async def test_a_model_reply_stored_whose_write_reply_is_lost_is_recorded_once(
    kind: str, tmp_path: Path, lost: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store writes the model's reply, then the writer sees a conflict, a store
    fault (waited out), or is cancelled right there (finalize writes what it held): the
    reply is in the history once, nothing more is written for it (fixed: after a conflict
    or a fault it took the stored reply for someone else's answer and wrote a "spent"
    note too, counting the call twice), the model was asked once, and the running totals
    count one call."""
    monkeypatch.setattr(_retry, "backoff", lambda attempt: 0.0)
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s", conversation=[Message.user("hi", id="u1")])
        store = Faulty(inner)
        token = CancelToken()

        async def lose_reply(batch: Any, stored: Any) -> None:
            if batch.step == "inference" and any(
                isinstance(e, AppendMessage) and e.message.role == "assistant"
                for e in batch.effects
            ):
                store.after = None
                if lost == "conflict":
                    raise ConflictError("s", batch.revision - 1, batch.revision)
                if lost == "os_error":
                    raise ConnectionResetError("the reply was lost")
                token.cancel("stop")
                await anyio.lowlevel.checkpoint()

        store.after = lose_reply
        model = FunctionModel(lambda request: reply("hello"))
        machine = StateMachine([ModelInference()], cancel=token)
        report = await machine.run_report(Runtime(store=store, model=model), "s")
        assert store.after is None  # the reply was lost
        assert report.reason.kind in ("done", "idle", YieldReason.CANCELLED)
        session = await assert_valid(inner, "s")
        assert [m.role for m in session.conversation] == ["user", "assistant"]
        assert [b.step for b in await inner.batches("s")] == ["inference"]  # nothing more
        assert model.calls == 1
        ledger = latest_ledger(session).ledger
        assert ledger is not None
        assert ledger.session.model_calls == 1
        again = await StateMachine([ModelInference()]).run_report(Runtime(store=inner), "s")
        assert again.reason.kind == "idle"
    finally:
        await inner.aclose()


# -- submit inside and outside a traced run -------------------------------------------------


async def test_submit_inside_a_traced_run_stamps_the_runs_trace_and_outside_none() -> None:
    from _observability import Spans

    spans = Spans()
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])

    class Submits(Operation[Any]):
        name = "submits"

        async def run(self, ctx: Any) -> Any:
            if ctx.session.message("from-step") is not None:
                return Refuse("done")
            note = Message.user("inside", id="from-step")
            await submit(store, "s", [AppendMessage(note)], step="inside")
            return Yield([], "done")

    await submit(store, "s", [Annotate("u1", "app", {"n": 1})], step="outside")
    runtime = Runtime(store=store, telemetry=spans.telemetry())
    await StateMachine([Submits()]).run_report(runtime, "s")
    await submit(store, "s", [Annotate("u1", "app", {"n": 2})], step="after")
    traces = {b.step: b.trace for b in await store.batches("s")}
    assert traces["outside"] is None
    assert traces["after"] is None
    inside = traces["inside"]
    assert inside is not None
    (agent,) = spans.named("invoke_agent")
    assert inside.split("-")[1] == format(agent.context.trace_id, "032x")


# -- a held record the store refuses in finalize ---------------------------------------------


@pytest.mark.parametrize("how", ["token", "scope"])
async def test_a_too_large_tool_result_held_when_cancelled_is_answered_by_its_replacement(
    how: str,
) -> None:
    """Fixed: the run was cancelled right after a tool returned an image over the store's
    limit (the machine held its result); finalize wrote the held result, the store
    refused it, and finalize stopped there: the call was left without any result (the
    history invalid), and with the machine's token ``run`` raised the store's error
    instead of reporting ``cancelled``. Now the task's ``refused`` answers it (an error
    result naming the limit), as it does outside a cancellation."""
    store = MemoryStore(max_media_bytes=10_000)
    await store.create("s", conversation=[Message.user("draw", id="u1")])
    token = CancelToken()
    scope = anyio.CancelScope()
    drawn: list[int] = []

    @tool(side_effects="non_idempotent")
    async def draw(size: int) -> ToolOutput:
        """Draw."""
        drawn.append(size)
        return ToolOutput("drawn", (ImagePart(media_type="image/png", data=b"\0" * size),))

    def answer(request: Any) -> Any:
        if request.messages[-1].role == "user":
            return call(("draw", {"size": 50_000}))
        return reply("done")

    class CancelOnFinished:
        async def emit(self, event: Any) -> None:
            if isinstance(event.data, ToolFinished):
                token.cancel("stop") if how == "token" else scope.cancel()
                await anyio.lowlevel.checkpoint()

    machine = StateMachine(
        [Tools([draw]), ModelInference()], cancel=token if how == "token" else None
    )
    runtime = Runtime(store=store, model=FunctionModel(answer))
    reports = []
    with scope:
        reports.append(await machine.run_report(runtime, "s", emitter=CancelOnFinished()))
    if how == "token":
        assert reports[0].reason.kind == YieldReason.CANCELLED
    else:
        assert scope.cancelled_caught
    session = await assert_valid(store, "s")
    (result,) = [r for m in session.conversation for r in m.tool_results]
    assert result.is_error
    assert "10,000" in str(result.content), result.content  # the limit, not "interrupted"
    assert drawn == [50_000]


@pytest.mark.parametrize("replaced", [True, False])
async def test_a_held_receipt_the_store_refuses_in_finalize_does_not_stop_finalize(
    kind: str, tmp_path: Path, replaced: bool
) -> None:
    """Cancelled right after the charge (the receipt held), the store refuses the
    receipt when finalize writes it: the task's replacement is written once (with one),
    or the receipt is left out and logged (without); either way the run reports
    ``cancelled`` and the other steps' finalize still runs."""
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s")
        store = Faulty(inner)
        token = CancelToken()

        async def refuse(batch: Any) -> None:
            if any(_text(e) == "receipt a" for e in batch.effects):
                raise EffectError("this store takes no receipts")

        async def gate(key: str) -> None:
            token.cancel("stop")  # lands at the first checkpoint after the charge

        class Marks(Operation[Any]):
            name = "marks"

            async def run(self, ctx: Any) -> Any:
                return Refuse()

            async def finalize(self, ctx: Any, *, interrupted: bool) -> Any:
                return [AppendMessage(Message.user("finalized", id=ctx.new_id()))]

        class Bare(Charges):
            def task(self, ctx: Any, key: str) -> Task:
                made = super().task(ctx, key)
                return made if replaced else dataclasses.replace(made, refused=None)

        store.before = refuse
        step = Bare(["a"], gate=gate)

        async def landed() -> None:
            await anyio.lowlevel.checkpoint()

        original = step.task

        def with_checkpoint(ctx: Any, key: str) -> Task:
            return dataclasses.replace(original(ctx, key), landed=landed)

        step.task = with_checkpoint  # type: ignore[method-assign]
        machine = StateMachine([step, Marks()], cancel=token)
        report = await machine.run_report(Runtime(store=store), "s")
        assert report.reason.kind == YieldReason.CANCELLED
        assert step.charged == ["a"]
        session = await assert_valid(inner, "s")
        found = texts(session)
        assert found.count("too large a") == (1 if replaced else 0)
        assert "receipt a" not in found
        assert found.count("finalized") == 1
    finally:
        await inner.aclose()


# -- PostgreSQL -------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["losses", "lost-reply", "cancelled-reload"])
async def test_on_postgres_receipts_survive_losses_lost_replies_and_a_cancelled_reload(
    postgres_dsn: str, tmp_path: Path, fault: str
) -> None:
    """The record loop's faults on PostgreSQL: receipts that lose the race 20 times,
    receipts whose reply is lost as a conflict, a reload cancelled mid-retry; each
    charge recorded once."""
    pytest.importorskip("psycopg", reason="psycopg is not installed (the postgres extra)")
    inner = await open_kind("postgres", tmp_path, dsn=postgres_dsn)
    try:
        await inner.create("s")
        store = Faulty(inner)
        token = CancelToken()
        moved: list[int] = []
        lost: set[str] = set()
        cancelled: list[bool] = []

        async def before(batch: Any) -> None:
            limit = 20 if fault == "losses" else 1
            if is_receipt(batch) and fault != "lost-reply" and len(moved) < limit:
                moved.append(1)
                await other_writer(inner, f"x{len(moved)}")

        async def after(batch: Any, stored: Any) -> None:
            key = is_receipt(batch)
            if fault == "lost-reply" and key is not None and key not in lost:
                lost.add(key)
                raise ConflictError("s", batch.revision - 1, batch.revision)

        async def on_load(session_id: str) -> None:
            if fault == "cancelled-reload" and moved and not cancelled:
                cancelled.append(True)
                token.cancel("stop")
                await anyio.lowlevel.checkpoint()

        store.before, store.after, store.on_load = before, after, on_load
        step = Charges(["a", "b", "c"], concurrency=3)
        machine = StateMachine([step], cancel=token, max_conflicts=0)
        report = await machine.run_report(Runtime(store=store), "s")
        expected = YieldReason.CANCELLED if fault == "cancelled-reload" else "done"
        assert report.reason.kind == expected
        await assert_charged_once(inner, step, all_keys=fault != "cancelled-reload")
    finally:
        await inner.aclose()


async def test_a_receipt_the_store_keeps_refusing_is_a_conflict_error_with_default_settings(
    kind: str, tmp_path: Path
) -> None:
    """Fixed: with the machine's default ``max_conflicts``, the record's
    ``ConflictError`` (the store refused it ``MAX_STALLED_CONFLICTS + 1`` times without
    moving on) reached the driver as if the cycle's first write had lost the race: it
    decided the cycle again, dropped the receipt it held without a word, and the run
    returned normally (``outcome_unknown``). The intents were written, so the run now
    raises the ``ConflictError``; started again, it still never charges twice."""
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s")
        store = Faulty(inner)
        refusals = [0]

        async def refuse(batch: Any) -> None:
            if is_receipt(batch) is not None:
                refusals[0] += 1
                raise ConflictError("s", batch.revision - 1, batch.revision - 1)

        store.before = refuse
        step = Charges(["a", "b"])
        machine = StateMachine([step])
        assert machine.max_conflicts > 0
        with pytest.raises(ConflictError):
            await machine.run_report(Runtime(store=store), "s")
        assert refusals[0] == MAX_STALLED_CONFLICTS + 1  # the first key's; then it stopped
        assert texts(await assert_valid(inner, "s")) == ["intent"]
        store.before = None
        again = await machine.run_report(Runtime(store=store), "s")
        assert again.reason.kind == "outcome_unknown"
        assert step.charged == ["a"]  # b never started; nothing charged twice
    finally:
        await inner.aclose()


@pytest.mark.parametrize("losses", [1, 3])
async def test_then_raising_with_a_last_receipt_that_loses_the_race_raises_once_written(
    kind: str, tmp_path: Path, losses: int
) -> None:
    """``then()`` raises; the last receipt loses the race ``losses`` times (``then`` is
    asked again each time): the receipt is written once, then its error propagates,
    and a run started again charges nothing."""
    inner = await open_kind(kind, tmp_path)
    try:
        await inner.create("s")
        store = Faulty(inner)
        moved = itertools.count()
        asked: list[int] = []

        async def lose(batch: Any) -> None:
            if is_receipt(batch) == "b" and (n := next(moved)) < losses:
                await other_writer(inner, f"x{n}")

        class Raising(Charges):
            async def run(self, ctx: Any) -> Any:
                outcome = await super().run(ctx)
                if not isinstance(outcome, Staged):
                    return outcome

                def then() -> Any:
                    asked.append(1)
                    raise LookupError("the ending failed")

                return dataclasses.replace(outcome, then=then)

        store.before = lose
        step = Raising(["a", "b"])
        with pytest.raises(LookupError):
            await StateMachine([step]).run_report(Runtime(store=store), "s")
        assert len(asked) == losses + 1
        await assert_charged_once(inner, step)
        again = await StateMachine([step]).run_report(Runtime(store=inner), "s")
        assert again.reason.kind == "idle"
        assert step.charged == ["a", "b"]
    finally:
        await inner.aclose()
