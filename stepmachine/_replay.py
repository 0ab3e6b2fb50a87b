"""``replay``: try a changed step list on a stored session's decisions, with no side effects.

:func:`replay` walks a session's audit log. For every cycle a machine decided,
it offers the session as it was just before that cycle to the *new* steps,
once, in a sandbox, and compares what they would write with what was
written. The :class:`ReplayReport` says, per cycle, whether the new pipeline
decides the same, and where it first does not. Nothing is written to the
store, no tool runs, and no model is called unless one is given.

Which batches are replayed. Those a machine cycle wrote: ``cycle >= 1`` and
a step other than ``stepmachine.finalize``. Batches written outside a machine
(cycle 0: ``submit``, ``approve``/``deny``, ``resolve_unknown_outcome``) are
history, not decisions: they are not replayed, and every later cycle starts
from the session they left. After a cancellation the interrupted step's
finalize batch joins its cycle, so that cycle usually differs; the
``stepmachine.finalize`` batch is not replayed.

How batches are grouped into cycles. A step that returns staged work (the
Tools step: its intents, then one batch per result; a model call under a
``Budget``: its reservation, then the reply) writes several batches in one
cycle. Consecutive machine batches with the same cycle number and step are
one cycle, replayed once from the session before the first of them. Batches
from outside a machine may land between them (a user message submitted while
a tool runs or the model answers: the step's next write conflicts, and its
record is computed again from the stored session). Such a batch does not end
the cycle when the machine batch after it

- records a model call whose request was built from the revision the cycle
  began at (an inference step's record says which: a reply's
  :class:`~stepmachine.InferenceReceipt`, or the
  :class:`~stepmachine.InferenceAttempts` of calls that left no reply); or
- only answers (a ``tool`` message) or annotates (a journal entry) tool calls
  that were open before it and that no batch from outside answered or
  annotated (an approval, a denial, an operator's decision) or replaced
  (``ReplaceConversation``): work on calls the step had taken up.

Otherwise the machine batch begins a new cycle: two runs whose first cycle is
the same step (a chat turn, ``submit``, the next turn) stay two; so does a
batch recording a model call whose request was built from another revision
than the one the cycle began at (a run cut by a crash after its reservation,
and the run that resumed it, asking the model again). A new
cycle's first batch recording a model call whose request was built from a
revision before the outside batches just before it began at that revision:
those batches landed inside it (without a reservation, a model call's record
is the cycle's first batch). The outside batches of a cycle are applied to
its sandbox where they landed: after as many of the step's batches as the
stored cycle wrote before them, right before the step's next write (which
then conflicts, as the stored one did). This too is a reading of the log: a
run that crashed inside such a cycle, and a new run whose first cycle is the
same step answering the same open calls (after a ``submit`` that does not
touch them), read as one cycle.

Cut cycles. A run killed inside a cycle leaves what it wrote (a reservation,
a tool's intent) and nothing more; the next run resumes from there. When the
new steps, replaying a cycle after which its run went no further, write the
same batches as the stored cycle and then ask for what it never recorded (a
model reply; a tool result recorded only later, by another run), the stored
run stopped there: the cycle is the same, and how it would have gone on is
not compared (whoever answers the model: the recorded replies, or a model
given to the replay). A new ``Continue`` where the stored run ended is the
same too when the next run's first step (after batches from outside, if any)
is the one the new steps apply next: a restart after a crash, or a fork taken
there, went on that way. Limit: a step that yields writing nothing leaves no
trace in the log, so a run it paused and the user ran again reads as such a
restart; removing that step is not seen there.

Runs. Cycle numbers restart at 1 with each ``run()``. A machine batch that
does not continue a cycle starts a new run when its cycle number is not above
that of the run's last cycle. A run's start revision
(``ctx.run_start_revision``, from which per-run budgets count) is the revision
just before its first stored batch. The log does not record runs, so this is
a reading of it: a run whose first cycles lost a compare-and-set race began a
little earlier; a run that wrote one cycle and yielded, run again at once with
the same step writing in its first cycle, reads as one cycle; and a step's own
``finalize`` batch after a cancellation (no built-in step writes one) reads as
a new run's cycle.

The sandbox. Each replayed cycle gets a fresh runtime whose loader and
effect handler are an in-memory copy of the session before the cycle (a step
that commits writes there, never to the store), and:

- ``clock``: the stored timestamp of the batch the cycle is about to write
  (so approval expiry is judged at the moment it was);
- ``ids``: the ids of the messages the stored cycle added, in order, then
  fresh ``replay-<revision>-<n>`` ids (the replay notes which it returned);
- ``tool_caller``: the stored result of the call (the first result recorded
  for its call id anywhere in the log), or, when none is stored, an error
  result saying so; that cycle then counts as a difference;
- ``model``: a model answering with the assistant reply the stored cycle
  appended (its parts; usage, model, finish reason and attempts from its
  :class:`~stepmachine.InferenceReceipt`), once. A reply the stored cycle
  dropped because a batch from outside moved the question on while the model
  answered (the user steered; only its calls were recorded) is answered as
  far as the log keeps it: no text, the calls and tokens its record counted.
  Asked where the stored cycle holds no reply, it raises and the cycle is a
  difference ("the new pipeline calls the model here"). Other model calls (a
  compaction's summary) have no recorded reply either. With ``model=``, that
  model answers every call (under every model name) instead;
- ``telemetry``: no spans (structured log events still go to the
  ``stepmachine`` logger); ``services``: as given.

Comparing (``_replay_compare``). A cycle is the same when the same step
applies and writes equal effects: the same number of batches, each with
equal effects, leaving out what the runtime rather than a decision makes:

- the part of an appended message's id the id source made: the whole id
  when the step used an id from ``ctx.new_id()`` as it is; only that part
  when the step put its own prefix or suffix around it (which is compared).
  An id the step chose itself (``Message.user(..., id="event:1")``) is its
  decision and is compared whole;
- a Tools journal entry's idempotency key when it is the key the runtime
  makes for the call (:func:`~stepmachine.idempotency_key`, from the session
  id): the new key must be the key of the call in the replayed session. A
  fork's copied batches carry the keys made for its source's id, and the
  fork does not record its source: so before the first batch of the log
  whose keys were made for this session's id, a stored key is left out
  whatever it is;
- clock readings a step records, which the log does not keep exactly.

Batches a step commits itself are compared in order, or else as a set:
concurrent tool calls finish, and commit, in any order. Everything else is
compared: ids of messages referred to (``Annotate``), tool results, notes,
the effects' order within a batch. Which steps refused before the deciding
one is reported (``stored_refused``, ``new_refused``) but does not decide
``same``: a reordered list that decides the same way behaves the same. A
cycle where no step applies, or where the deciding step writes nothing (a
yield without effects), has ``new_step=None``. A step that raises makes its
cycle a difference naming the exception; the replay goes on with the next
cycle.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from ._capabilities import Step
from ._codec import Batch, Refusal
from ._effects import Annotate, AppendMessage, Effect, ReplaceConversation, apply_batch
from ._errors import ConfigurationError, ContextLengthError
from ._finalize import FINALIZE_STEP
from ._inference import InferenceAttempts, InferenceReceipt
from ._ledger import Spent, latest_ledger
from ._machine import Decision, StateMachine
from ._messages import Message, ToolResultPart
from ._model import Model, ModelResponse, Usage
from ._records import TAG_FIELD, read_record
from ._replay_compare import RuntimeMade, first_change, journal_key, same_batches
from ._replay_sandbox import Sandbox
from ._runtime import Runtime
from ._session import Session
from ._staged import Staged
from ._steps import Continue, Yield
from ._store import Store
from ._tools import idempotency_key

_Recorded: TypeAlias = "ToolResultPart | Message"
"""A recorded result: the part, or (when it carries media) the tool message holding both."""

__all__ = ["ReplayCycle", "ReplayReport", "replay"]

_RECEIPT_TAG = InferenceReceipt.__struct_config__.tag
_ATTEMPTS_TAG = InferenceAttempts.__struct_config__.tag


@dataclass(frozen=True, slots=True)
class ReplayCycle:
    """One stored cycle, replayed against the new steps.

    Attributes:
        revision: the revision the stored cycle's first batch produced (the
            replay started from ``revision - 1``).
        cycle: the stored cycle number, within its run.
        run_start_revision: the start of the stored run (see the module docs).
        stored_step: the step that wrote the stored batches.
        new_step: the step of the new list that writes in this cycle;
            ``None`` when no step applies or the deciding step writes nothing.
        same: the new steps decide the same (see the module docs).
        difference: what differs, for a human; ``""`` when ``same``.
        stored: the effects of each stored batch of the cycle (one tuple per batch).
        new: the effects of each batch the new steps would write.
        stored_refused: the steps that refused before ``stored_step``.
        new_refused: the steps that refused before the new deciding step
            (empty when no step applied: ``StateMachine.step`` returns ``None`` then).
    """

    revision: int
    cycle: int
    run_start_revision: int
    stored_step: str
    new_step: str | None
    same: bool
    difference: str
    stored: tuple[tuple[Effect, ...], ...]
    new: tuple[tuple[Effect, ...], ...]
    stored_refused: tuple[Refusal, ...] = ()
    new_refused: tuple[Refusal, ...] = ()

    def __str__(self) -> str:
        where = f"revision {self.revision} (cycle {self.cycle})"
        if self.same:
            return f"{where}: same ({self.stored_step})"
        return f"{where}: {self.difference}"


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """What :func:`replay` found, one :class:`ReplayCycle` per replayed cycle, in log order."""

    session_id: str
    cycles: tuple[ReplayCycle, ...]

    @property
    def first_difference(self) -> ReplayCycle | None:
        """The first cycle the new steps decide differently, or ``None``."""
        return next((c for c in self.cycles if not c.same), None)

    @property
    def same(self) -> bool:
        """True when every replayed cycle is the same (also when there was none)."""
        return self.first_difference is None

    def __str__(self) -> str:
        lines = [f"replay of session {self.session_id!r}: {len(self.cycles)} cycle(s)"]
        lines.extend(f"  {c}" for c in self.cycles)
        return "\n".join(lines)


async def replay(
    store: Store,
    session_id: str,
    steps: Sequence[Step[Any]],
    *,
    model: Model | None = None,
    services: Mapping[str, Any] | None = None,
) -> ReplayReport:
    """Replay every machine cycle of a stored session against ``steps``; see the module docs.

    Args:
        store: where the session is stored; it needs ``load``, ``load_at``
            and ``batches`` (the shipped stores have them).
        session_id: the session.
        steps: the new step list (a fresh ``StateMachine(steps)`` decides).
        model: answers every model call instead of the recorded replies.
        services: ``Runtime.services`` for the steps.

    Returns:
        The report. The store is unchanged; no tool ran.

    Raises:
        SessionNotFoundError: no such session.
        ConfigurationError: the store lacks ``batches`` or ``load_at``, or the
            step list is invalid (no steps, repeated names).
        StoredDataError: a stored record does not decode.

    Cancellation: the replay stops; nothing was written anywhere but the sandbox.
    """
    for method in ("load", "load_at", "batches"):
        if not callable(getattr(store, method, None)):
            raise ConfigurationError(
                f"replay reads the audit log: {type(store).__name__} has no {method}(); "
                "use a store with load_at() and batches() (the shipped stores have them)"
            )
    machine: StateMachine[Any] = StateMachine(steps, max_cycles=None, lease=None)
    await store.load(session_id)  # SessionNotFoundError for an unknown id
    log: list[Batch[Effect]] = await store.batches(session_id)
    results = _recorded_results(log)
    replayed = [
        await _replay_cycle(machine, stored, results, model, services or {})
        for stored in await _stored_cycles(store, session_id, log)
    ]
    return ReplayReport(session_id, tuple(replayed))


# -- the stored cycles --------------------------------------------------------------


@dataclass(slots=True)
class _StoredCycle:
    """Consecutive batches of one machine cycle, the session before them, their run's start."""

    before: Session[Any]
    after: float  # the timestamp of the batch before the cycle
    run_start: int
    batches: list[Batch[Effect]] = field(default_factory=list)
    went_on: bool | None = None  # the run had another cycle; None: cancelled, not known
    # The run ended with this cycle: the step of the next run's first cycle (after
    # batches from outside, if any): where a restart after a crash went on.
    resumed_by: str | None = None
    # Batches from outside a machine that landed inside the cycle, each with how
    # many of the cycle's batches were written before it.
    landed: list[tuple[int, Batch[Effect]]] = field(default_factory=list)
    copied: bool = False  # its journal keys may be a fork source's (see _replay_compare)

    @property
    def decided(self) -> tuple[int, str]:
        """The cycle number and the step that decided it."""
        return self.batches[0].cycle, self.batches[0].step


async def _stored_cycles(
    store: Any, session_id: str, log: Sequence[Batch[Effect]]
) -> list[_StoredCycle]:
    """The log's machine cycles, grouped by the rules of the module docs.

    The session before each cycle is the stored session at the log's first
    revision, with the stored batches applied in order (what the stores do
    to load it): O(log) for the whole replay.
    """
    cycles: list[_StoredCycle] = []
    if not log:
        return cycles
    session: Session[Any] = await store.load_at(session_id, log[0].revision - 1)
    current: _StoredCycle | None = None  # the cycle the next batch may continue
    paused: Session[Any] = session  # the session after the current cycle's last batch
    last_cycle: int | None = None  # the number of the run's last cycle
    run_start = 0
    own_keys = math.inf  # the first revision with a journal key made for ``session_id``
    stamp = float("-inf")  # the timestamp of the batch before ``batch``
    # Batches from outside a machine since the last machine batch, each with the
    # session before it and the stamp of the batch before it.
    outside: list[tuple[Session[Any], float, Batch[Effect]]] = []
    for batch in log:
        if batch.revision != session.revision + 1:  # a gap in the log: load what it skipped
            session = await store.load_at(session_id, batch.revision - 1)
            outside = []  # what the gap held is not known
        before, session = session, apply_batch(session, batch.effects)
        previous, stamp = stamp, batch.timestamp
        if own_keys == math.inf and _makes_own_key(batch, session_id):
            own_keys = batch.revision
        if batch.step == FINALIZE_STEP:
            current, outside = None, []
            continue
        if batch.cycle < 1:  # from outside a machine: it may have landed inside a cycle
            outside.append((before, previous, batch))
            continue
        landed = [b for _, _, b in outside]
        decided = _decided_at(batch)  # None: the batch records no model call
        if (
            current is not None
            and (batch.cycle, batch.step) == current.decided
            and decided in (None, current.before.revision)
            and (not landed or decided is not None or _continues(batch, landed, paused))
        ):
            current.landed.extend((len(current.batches), b) for b in landed)
            current.batches.append(batch)
        else:
            start, stamp_before, inside = before, previous, []
            for index, (at, stamped, _) in enumerate(outside):
                if at.revision == decided:  # its request was built before these landed
                    start, stamp_before = at, stamped
                    inside = [(0, b) for b in landed[index:]]
                    break
            if last_cycle is None or batch.cycle <= last_cycle:
                run_start = start.revision
            current = _StoredCycle(start, stamp_before, run_start, [batch], landed=inside)
            cycles.append(current)
            last_cycle = batch.cycle
        outside, paused = [], session
    for cycle in cycles:
        cycle.copied = cycle.batches[0].revision < own_keys
    _mark_flow(cycles, log)
    return cycles


def _continues(
    batch: Batch[Effect], outside: Sequence[Batch[Effect]], paused: Session[Any]
) -> bool:
    """Whether ``batch``, after the batches from ``outside`` a machine, goes on with the cycle
    its step paused in at ``paused`` (see the module docs, "how batches are grouped").

    It does when every effect of it answers (a ``tool`` message) or annotates a
    tool call that was open at ``paused`` and that no batch from outside
    answered or annotated (an approval, a denial, an operator's decision) or
    could have (a ``ReplaceConversation``): work on calls the step had
    already taken up. O(the batches' effects).
    """
    calls: set[str] = set()
    for effect in batch.effects:
        if isinstance(effect, Annotate) and effect.call_id is not None:
            calls.add(effect.call_id)
        elif (
            isinstance(effect, AppendMessage)
            and effect.message.role == "tool"
            and effect.message.tool_results
        ):
            calls.update(result.call_id for result in effect.message.tool_results)
        else:
            return False
    if not calls:
        return False
    if not calls <= {call.call_id for call in paused.history.open_calls()}:
        return False
    for other in outside:
        for effect in other.effects:
            if isinstance(effect, ReplaceConversation):
                return False
            if isinstance(effect, Annotate) and effect.call_id in calls:
                return False
            if any(
                result.call_id in calls for m in _messages_in(effect) for result in m.tool_results
            ):
                return False
    return True


def _decided_at(batch: Batch[Effect]) -> int | None:
    """The revision the model request recorded in ``batch`` was built from, or ``None``.

    An inference step's record of a model call says which revision the request
    was built from: the session its cycle decided on. A reply's
    :class:`~stepmachine.InferenceReceipt` says it first (a batch with a reply
    may also put back the attempts note it found, which keeps its own
    revision); otherwise the :class:`~stepmachine.InferenceAttempts` of calls
    that left no reply, or reserved. O(the batch's effects).
    """
    attempts: int | None = None
    for effect in batch.effects:
        if isinstance(effect, AppendMessage) and effect.message.role == "assistant":
            for value in effect.message.notes.values():
                if isinstance(value, dict) and value.get(TAG_FIELD) == _RECEIPT_TAG:
                    revision = value.get("revision")
                    if isinstance(revision, int):
                        return revision
        elif attempts is None and isinstance(effect, Annotate):
            values = effect.values
            if isinstance(values, dict) and values.get(TAG_FIELD) == _ATTEMPTS_TAG:
                revision = values.get("revision")
                if isinstance(revision, int):
                    attempts = revision
    return attempts


def _makes_own_key(batch: Batch[Effect], session_id: str) -> bool:
    """Whether ``batch`` records a Tools journal key made for ``session_id``."""
    for effect in batch.effects:
        journal = journal_key(effect)
        if journal is not None:
            key, message_id, call_id = journal
            if key == idempotency_key(session_id, call_id, message_id):
                return True
    return False


def _mark_flow(cycles: list[_StoredCycle], log: Sequence[Batch[Effect]]) -> None:
    """Set each cycle's ``went_on``: whether its run had a next machine cycle.

    Batches from outside a machine in between are passed over (a user message
    may arrive while a run goes on). A finalize batch first means the run was
    cancelled there: not known. No later machine batch, or one that starts
    another run: the run ended with this cycle (it yielded, or no step applied,
    or the process died). Then ``resumed_by`` names the step of the next run's
    first cycle, if there is one: a run restarted after a crash goes on there.
    """
    position = {batch.revision: index for index, batch in enumerate(log)}
    starts = {id(c.batches[0]): c for c in cycles}
    for cycle in cycles:
        last = cycle.batches[-1]
        cycle.went_on = False
        for batch in log[position[last.revision] + 1 :]:
            if batch.step == FINALIZE_STEP:
                cycle.went_on = None
                break
            if batch.cycle < 1:
                continue  # from outside a machine
            following = starts.get(id(batch))
            cycle.went_on = (
                following is not None
                and following.run_start == cycle.run_start
                and batch.cycle == last.cycle + 1
            )
            if not cycle.went_on and following is not None:
                cycle.resumed_by = following.decided[1]
            break


def _recorded_results(log: Sequence[Batch[Effect]]) -> dict[str, list[tuple[int, _Recorded]]]:
    """Every result recorded in the log, per call id: ``(revision, result)``, oldest first;
    a result that carries images or documents as a ``tool`` message holding it and them."""
    results: dict[str, list[tuple[int, _Recorded]]] = {}
    for batch in log:
        for effect in batch.effects:
            for message in _messages_in(effect):
                for result in message.tool_results:
                    media = message.result_media(result.call_id)
                    recorded: _Recorded = result
                    if media:
                        recorded = Message.tool_result(result, id=message.id, media=media)
                    results.setdefault(result.call_id, []).append((batch.revision, recorded))
    return results


class _ResultsFrom(Mapping[str, "ToolResultPart | Message"]):
    """The results a cycle's calls are answered with: for each call id, the first result
    recorded at or after the cycle's first revision.

    A model may use a call id again later (after a compaction hid the first
    call): each call is answered with the result recorded after it, never
    with an earlier call's.
    """

    def __init__(self, recorded: dict[str, list[tuple[int, _Recorded]]], revision: int):
        self._recorded = recorded
        self._revision = revision

    def __getitem__(self, call_id: str) -> _Recorded:
        for revision, result in self._recorded.get(call_id, ()):
            if revision >= self._revision:
                return result
        raise KeyError(call_id)

    def __iter__(self) -> Iterator[str]:
        return (call_id for call_id in self._recorded if call_id in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _messages_in(effect: Effect) -> tuple[Message, ...]:
    if isinstance(effect, AppendMessage):
        return (effect.message,)
    if isinstance(effect, ReplaceConversation):
        return effect.conversation
    return ()


def _recorded_reply(stored: _StoredCycle) -> ModelResponse | ContextLengthError | None:
    """The model reply the stored cycle appended (an assistant message with a receipt),
    or the context-length error it recorded (an ``InferenceAttempts`` note marking one)."""
    for batch in stored.batches:
        for effect in batch.effects:
            if isinstance(effect, Annotate):
                failure = _recorded_overflow(stored, effect)
                if failure is not None:
                    return failure
                dropped = _recorded_dropped(stored, effect)
                if dropped is not None:
                    return dropped
                continue
            if not isinstance(effect, AppendMessage) or effect.message.role != "assistant":
                continue
            message = effect.message
            for namespace, value in message.notes.items():
                if isinstance(value, dict) and value.get(TAG_FIELD) == _RECEIPT_TAG:
                    where = f"session {batch.session_id!r}, revision {batch.revision}"
                    receipt = read_record(message.notes, namespace, InferenceReceipt, where=where)
                    assert receipt is not None  # the namespace holds a receipt
                    return ModelResponse(
                        parts=message.parts,
                        usage=receipt.usage,
                        finish_reason=receipt.finish_reason,
                        model=receipt.model,
                        attempts=receipt.attempts,
                    )
    return None


def _recorded_dropped(stored: _StoredCycle, effect: Annotate) -> ModelResponse | None:
    """The reply the stored cycle's model gave and its record dropped, as far as the log
    tells it, if ``effect`` records one.

    A reply that answers a question no longer the last (a batch from outside
    landed in the cycle while the model answered: the user steered) is not
    appended; only its calls are recorded (an ``InferenceAttempts`` note, none
    reserved). Its text is not stored, so the reply given back has none; its
    calls and tokens are what the note's ledger added (so the new step,
    recording the same, writes the same note; a step that would append the
    reply instead appends an empty one, and differs). ``None`` when no batch
    landed in the cycle (the note then records calls that failed).
    """
    notes = _attempts_notes(stored, effect) if stored.landed else None
    if notes is None:
        return None
    after, earlier = notes
    if after.reserved or after.context_length_exceeded or after.ledger is None:
        return None
    made = after.attempts - (earlier.attempts if earlier is not None else 0)
    if made <= 0:
        return None
    base = latest_ledger(stored.before).ledger
    spent = after.ledger.session - (base.session if base is not None else Spent())
    usage = Usage(input_tokens=spent.input_tokens, output_tokens=spent.output_tokens)
    return ModelResponse(parts=(), usage=usage, attempts=made)


def _recorded_overflow(stored: _StoredCycle, effect: Annotate) -> ContextLengthError | None:
    """The ``ContextLengthError`` an inference step recorded with ``effect``, if it is one.

    Its ``attempts`` are the calls that failure made: the note's count less
    what the message carried before the cycle.
    """
    notes = _attempts_notes(stored, effect)
    if notes is None:
        return None
    after, earlier = notes
    if not after.context_length_exceeded or after.reserved:
        return None  # not an overflow, or a reservation carrying an earlier one's mark
    made = after.attempts
    if earlier is not None:
        made = after.attempts - earlier.attempts
        if made <= 0:
            return None  # the mark as it was (put back after a reply): no new overflow
    error = ContextLengthError("replay: the stored cycle recorded a context-length error")
    error.attempts = max(1, made)  # type: ignore[attr-defined]
    return error


def _attempts_notes(
    stored: _StoredCycle, effect: Annotate
) -> tuple[InferenceAttempts, InferenceAttempts | None] | None:
    """The ``InferenceAttempts`` note ``effect`` writes, and the one its message carried
    before the cycle (``None``: none); ``None`` when ``effect`` writes no such note."""
    values = effect.values
    if not (isinstance(values, dict) and values.get(TAG_FIELD) == _ATTEMPTS_TAG):
        return None
    where = f"session {stored.before.id!r}, message {effect.message_id!r}"
    after = read_record(
        {effect.namespace: values}, effect.namespace, InferenceAttempts, where=where
    )
    if after is None:
        return None
    earlier = None
    position = stored.before.history.message_position(effect.message_id)
    if position is not None:
        notes = stored.before.conversation[position].notes
        earlier = read_record(notes, effect.namespace, InferenceAttempts, where=where)
    return after, earlier


def _added_ids(stored: _StoredCycle) -> list[str]:
    """Ids of the messages the stored cycle added, in order.

    O(the cycle's effects): whether a message was there before is asked of the
    session's history index, never by collecting every id of the history.
    """
    index = stored.before.history
    seen: set[str] = set()
    ids: list[str] = []
    for batch in stored.batches:
        for effect in batch.effects:
            for message in _messages_in(effect):
                mid = message.id
                if mid not in seen and index.message_position(mid) is None:
                    seen.add(mid)
                    ids.append(mid)
    return ids


# -- one cycle ------------------------------------------------------------------------


async def _replay_cycle(
    machine: StateMachine[Any],
    stored: _StoredCycle,
    results: dict[str, list[tuple[int, _Recorded]]],
    model: Model | None,
    services: Mapping[str, Any],
) -> ReplayCycle:
    first = stored.batches[0]
    recorded = _recorded_reply(stored)
    sandbox = Sandbox(
        stored.before,
        [b.timestamp for b in stored.batches],
        _added_ids(stored),
        _ResultsFrom(results, first.revision),
        None if model is not None else recorded,
        start=stored.after,
        landed=stored.landed,
        # A cycle its run did not go on from may have stopped inside (a crash).
        cut_after=len(stored.batches) if stored.went_on is False else None,
        answered=_answered(stored),
        replies=0 if recorded is None else 1,
    )
    runtime = sandbox.runtime(model, services)
    error = ""
    decision = None
    try:
        decision = await machine.step(
            runtime, stored.before, cycle=first.cycle, run_start_revision=stored.run_start
        )
    except ConfigurationError:
        raise  # the step list itself is wrong (two steps advertise one tool): say so once
    except Exception as exc:  # noqa: BLE001 - a failing step is this cycle's difference
        error = f"the new pipeline raises {type(exc).__name__}: {exc}"
    if decision is not None and isinstance(decision.outcome, Staged):
        # Staged work is carried out by the machine's own apply, into the sandbox:
        # the intents, each task's record, the ending, as batches of their own.
        try:
            _, result = await machine.apply(runtime, sandbox.session, decision, cycle=first.cycle)
        except ConfigurationError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failing step is this cycle's difference
            error = f"the new pipeline raises {type(exc).__name__}: {exc}"
            decision = None
        else:
            ending: Continue | Yield = (
                Continue(()) if result.reason is None else Yield((), result.reason)
            )
            decision = dataclasses.replace(decision, outcome=ending)
    new = [b.effects for b in sandbox.batches]
    if decision is not None and decision.outcome.effects:
        new.append(tuple(decision.outcome.effects))
    new_step: str | None = None
    if new:
        new_step = decision.step.name if decision is not None else sandbox.batches[0].step
    refused = decision.refusals if decision is not None else ()
    cut = _stopped_there(stored, new_step, new, sandbox)
    if cut:  # the stored run stopped there: the new steps wrote the same until then
        new = new[: len(stored.batches)]
        difference = ""
    elif sandbox.asked_model:
        had = first.step
        difference = f"the new pipeline calls the model here; the stored history has step {had!r}"
    elif error:
        difference = error
    elif decision is None:
        difference = f"no step applies (stored: {first.step!r})"
    elif new_step is None:
        assert not isinstance(decision.outcome, Staged)  # carried out above
        difference = _wrote_nothing(decision.step.name, decision.outcome, first.step)
    else:
        difference = _difference(stored, new_step, new, sandbox)
    if not difference and decision is not None and not cut:
        difference = await _flow(machine, runtime, sandbox, stored, decision)
    return ReplayCycle(
        revision=first.revision,
        cycle=first.cycle,
        run_start_revision=stored.run_start,
        stored_step=first.step,
        new_step=new_step,
        same=not difference,
        difference=difference,
        stored=tuple(b.effects for b in stored.batches),
        new=tuple(new),
        stored_refused=first.refused,
        new_refused=refused,
    )


async def _flow(
    machine: StateMachine[Any],
    runtime: Runtime,
    sandbox: Sandbox,
    stored: _StoredCycle,
    decision: Decision[Any],
) -> str:
    """Whether the new step goes on where the stored run went on; ``""`` when it does.

    A new ``Yield`` where the stored run had another cycle differs. A new
    ``Continue`` where the stored run ended differs only if the new pipeline
    would then act again (offered the session after this cycle once, in the
    sandbox): a run that continues into a cycle where no step applies, or
    where a step yields writing nothing, ends the same way.
    """
    name = decision.step.name
    outcome = decision.outcome
    if stored.went_on is None:
        return ""
    if isinstance(outcome, Yield):
        if stored.went_on:
            return f"step {name!r} yields {outcome.reason.kind} where the stored run went on"
        return ""
    if stored.went_on:
        return ""
    after = apply_batch(sandbox.session, outcome.effects)
    cycle = stored.batches[0].cycle + 1
    written = len(sandbox.batches)
    try:
        following = await machine.step(
            runtime, after, cycle=cycle, run_start_revision=stored.run_start
        )
    except Exception as exc:  # noqa: BLE001 - it would act: that is the difference
        what = "calls the model" if sandbox.asked_model else f"raises {type(exc).__name__}: {exc}"
        return f"step {name!r} continues where the stored run ended, and the new pipeline {what}"
    if following is None:
        return ""  # no step applies: the run ends here, as the stored one did
    if following.step.name == stored.resumed_by:
        return ""  # the next run went on there, from this very session (a restart)
    if (
        isinstance(following.outcome, Yield)
        and not following.outcome.effects
        and len(sandbox.batches) == written
    ):
        return ""  # it yields writing nothing (a budget spent): the run ends here too
    return (
        f"step {name!r} continues where the stored run ended, and step "
        f"{following.step.name!r} applies next"
    )


def _wrote_nothing(step: str, outcome: Continue | Yield, stored_step: str) -> str:
    if isinstance(outcome, Yield):
        reason = outcome.reason
        what = f"yields {reason.kind}" + (f" ({reason.message})" if reason.message else "")
    else:
        what = "continues without effects"
    return f"step {step!r} {what} and writes nothing (stored: {stored_step!r})"


def _answered(stored: _StoredCycle) -> frozenset[str]:
    """The call ids whose results the stored cycle recorded."""
    return frozenset(
        result.call_id
        for batch in stored.batches
        for effect in batch.effects
        for message in _messages_in(effect)
        for result in message.tool_results
    )


def _stopped_there(
    stored: _StoredCycle, new_step: str | None, new: Sequence[tuple[Effect, ...]], sandbox: Sandbox
) -> bool:
    """Whether the stored cycle's run stopped inside it (a crash, a kill) where the new
    steps, having written the same batches, asked for what it never recorded (see
    ``Sandbox.stopped_at``): then how the cycle would have gone on is not known."""
    if sandbox.stopped_at != len(stored.batches) or new_step != stored.batches[0].step:
        return False
    old = [b.effects for b in stored.batches]
    return same_batches(old, new[: len(old)], _made(stored, sandbox))


def _made(stored: _StoredCycle, sandbox: Sandbox) -> RuntimeMade:
    """What the runtime made in the stored cycle and in its replay (left out of comparing)."""
    return RuntimeMade(
        after=stored.after,
        until=stored.batches[-1].timestamp,
        returned=frozenset(sandbox.readings),
        ids=frozenset(sandbox.returned_ids),
        session_id=stored.before.id,
        copied=stored.copied,
    )


def _difference(
    stored: _StoredCycle, new_step: str, new: Sequence[tuple[Effect, ...]], sandbox: Sandbox
) -> str:
    """What differs between the stored batches and the new ones; ``""`` when nothing does."""
    stored_step = stored.batches[0].step
    old = [b.effects for b in stored.batches]
    made = _made(stored, sandbox)
    found: list[str] = []
    if new_step != stored_step:
        found.append(f"step {new_step!r} applies instead of {stored_step!r}")
    elif not same_batches(old, new, made):
        found.append(f"step {new_step!r} writes other effects")
    if found:
        found[0] += f": {first_change(old, new, made)}"
    if sandbox.unrecorded:
        calls = ", ".join(sorted(sandbox.unrecorded))
        found.append(f"no recorded result for tool call(s) {calls} (answered with an error)")
    return "; ".join(found)
