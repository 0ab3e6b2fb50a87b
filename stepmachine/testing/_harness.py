"""Run ONE step against a session value: no store, no machine loop.

:func:`run_step` builds the context the machine would build (tool
definitions and prompt parts collected from the step and any ``others``,
whose hooks answer ``ctx.shape_request`` and ``ctx.vet_call``), runs the
step once, and returns a :class:`StepCheck`: the outcome, the
effects, the session those effects produce, and the events emitted. A step
that returns :class:`~stepmachine.Staged` work has it carried out as the
machine does (the machine's own code: intents, each task, each record, the
ending), writing to the session value instead of a store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from stepmachine import (
    Continue,
    Effect,
    Event,
    Message,
    Model,
    NoData,
    Outcome,
    RecordingEmitter,
    Refuse,
    Runtime,
    Session,
    StateMachine,
    Step,
    StepContext,
    Yield,
)
from stepmachine._capabilities import cycle_context
from stepmachine._emitter import EventSink
from stepmachine._staged import Staged, Task, execute
from stepmachine._step_contract import check_outcome, check_pending
from stepmachine.extend import Conversation, apply_batch, counter_ids

__all__ = ["StepCheck", "make_session", "run_step"]


def make_session(
    *messages: Message | str,
    data: Any = None,
    session_id: str = "test-session",
    revision: int = 0,
) -> Session[Any]:
    """A session value; a ``str`` becomes a user message with id ``u<n>``."""
    conversation = tuple(
        Message.user(m, id=f"u{i}") if isinstance(m, str) else m for i, m in enumerate(messages)
    )
    return Session(
        id=session_id,
        revision=revision,
        conversation=Conversation(conversation),
        data=NoData() if data is None else data,
    )


@dataclass(frozen=True, slots=True)
class StepCheck:
    """What one step did.

    Attributes:
        outcome: the step's ``Refuse``, ``Continue`` or ``Yield``; for staged
            work, how it ended (``then()``'s outcome, ``Continue(())`` by default).
        effects: the effects of that outcome (empty for ``Refuse``).
        session: the session after everything the step wrote.
        events: the events it emitted.
        ctx: the context it ran with (pass to ``finalize`` in tests).
        before: the session the step was given.
        commits: the batches written before ``effects``: a ``Staged``
            outcome's intents and each task's record, in order (and batches of a
            step still using the deprecated ``ctx.commit``).
        staged: the ``Staged`` outcome the step returned, if it did.
    """

    outcome: Outcome
    effects: tuple[Effect, ...]
    session: Session[Any]
    events: tuple[Event, ...]
    ctx: StepContext[Any]
    before: Session[Any]
    commits: tuple[tuple[Effect, ...], ...] = ()
    staged: Staged | None = None

    @property
    def refused(self) -> bool:
        """True when the step refused."""
        return isinstance(self.outcome, Refuse)

    @property
    def yielded(self) -> bool:
        """True when the step yielded."""
        return isinstance(self.outcome, Yield)

    @property
    def continued(self) -> bool:
        """True when the step continued."""
        return isinstance(self.outcome, Continue)

    @property
    def new_messages(self) -> tuple[Message, ...]:
        """The messages the effects appended."""
        return self.session.conversation[len(self.before.conversation) :]


async def run_step(
    step: Step[Any],
    session: Session[Any],
    *,
    runtime: Runtime | None = None,
    model: Model | None = None,
    others: Sequence[Step[Any]] = (),
    run_start_revision: int | None = None,
) -> StepCheck:
    """Run ``step`` once against ``session``, as the machine would, and report.

    Args:
        step: the step under test: any :class:`~stepmachine.Step` (a ``name``
            and ``run``), with or without optional capabilities.
        session: the session value it sees.
        runtime: IO dependencies; by default one with deterministic ids
            (``id1``, ``id2``, ...) and ``model`` if given.
        model: shortcut for ``Runtime(model=model)``.
        others: the other steps of the machine, whose tools, prompt parts,
            request shaping and ``check_call`` objections count too, in the
            order ``[step, *others]`` (duplicate tool names raise as in the
            machine).
        run_start_revision: the revision the run began at, as for
            :meth:`StateMachine.step` (per-run budgets count from it); by
            default ``session.revision``: the first cycle of a new run.

    Staged work runs as the machine runs it; each batch it writes is applied
    to the session value and listed in ``StepCheck.commits``.

    Raises whatever the step raises, ``StepContractError`` if its ``run`` is
    not async (calling it returns nothing to await) or it returns something
    other than an outcome (``None`` included, as the machine does), and
    ``EffectError`` if its effects do not apply to ``session``.
    """
    if runtime is None:
        runtime = Runtime(model=model, ids=counter_ids("id"))
    machine = StateMachine([step, *others])
    recorder = RecordingEmitter()
    commits: list[tuple[Effect, ...]] = []

    sink = EventSink(recorder, session.id, session.revision)

    async def commit(current: Session[Any], effects: Sequence[Effect]) -> Session[Any]:
        after = apply_batch(current, effects)  # a batch that does not apply is not listed
        commits.append(tuple(effects))
        sink.follow(after.revision)
        return after

    start = session.revision if run_start_revision is None else run_start_revision
    ctx = cycle_context(machine.capabilities, runtime, session, sink, 1, start)
    ctx.committer = commit  # the deprecated ctx.commit
    returned = check_outcome(step.name, await check_pending(step.name, step.run(ctx)))
    current = ctx.session
    staged = returned if isinstance(returned, Staged) else None
    if staged is not None:

        async def reload(session_id: str) -> Session[Any]:
            return current  # a session value: nobody else writes to it

        async def confirm(task: Task) -> None:
            return None  # no lease to confirm

        async def write(
            current: Session[Any], effects: Sequence[Effect], status: str
        ) -> Session[Any]:
            return await commit(current, effects)

        current, _, ending = await execute(staged, current, write, reload, confirm, [])
        outcome: Outcome = ending
    else:
        outcome = returned
    effects: tuple[Effect, ...] = () if isinstance(outcome, Refuse) else outcome.effects
    after = apply_batch(current, effects) if effects else current
    return StepCheck(
        outcome, effects, after, tuple(recorder.events), ctx, session, tuple(commits), staged
    )
