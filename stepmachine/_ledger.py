"""The model-call ledger: running totals of model calls, tokens and tool calls, carried by receipts.

A budget (exact budgets) needs what a session, the current run and the current
turn have spent. Adding up every receipt of the history would cost O(history)
per cycle (constant cost per step), so every record of a model call -- an
:class:`~stepmachine.InferenceReceipt`, failed attempts
(:class:`~stepmachine.InferenceAttempts`), an interrupted reply, a summariser
call -- carries a :class:`Ledger`: the totals *including that call*, for the
session and for the turn it was made in.

The writer of such a record asks :func:`next_ledger`, which reads back from
the end of the conversation to the latest ledger (only the messages since the
previous model call) and adds the new call; a reader asks :func:`latest_ledger`,
the same walk. Both are O(messages since the previous model call).

A turn starts at a user message visible to the model and to the user that is
not marked :data:`FEEDBACK` (:func:`starts_turn`). A run is not recorded: what
a run spent depends on where the caller's ``run()`` began, which is not part of
the session (a fresh machine per cycle records the same ledgers, state is the session).
It is the latest ledger minus the latest one made before the run's first
revision (``latest_ledger(session, before_revision=...)``), O(messages of the
run).

A record on a message that already holds one (the attempts of a failed call, or
a summariser's calls, on the last message the model saw) replaces it, ledger
included: a ledger an earlier run left there would be gone when a run looks for
where it started. So every ledger also says what the totals were before its
revision (:attr:`Ledger.before`: the session totals of the latest ledger made
at an earlier revision, then of the one before that), and a per-run read takes
those when the ledger itself was made in the run. Two are kept (constant size;
the read stays a read back over the run): a run finds where it started when a
ledger made at one of the first two revisions at which it recorded model calls
is still on the session -- a reply's or a summary's, a record put back once the
call was accounted for -- e.g. a context overflow recorded on the last message,
then a summary or the answer. A run whose records at its first three such
revisions were all replaced finds no totals from before it and counts every call
of the session (a per-run budget then refuses early, never late).

Tool calls: a reply's receipt counts the tool calls it asks for. A step that
makes calls stop counting (a budget refusing them, a step hiding a reply whose
calls never ran, a copy that replaces a reply) writes a
:class:`LedgerCorrection` with it: the latest ledger corrected, on a message at
or after the latest ledger, so readers still read back to the latest ledger
only. A correction of calls made before a run began is added back for that run
(:func:`run_ledgers`, which reads the run anyway). Ledgers written before they
counted tool calls say ``tools=False`` (their ``[calls, in, out]`` totals read
``tool_calls=0``), as do those after an assistant message with tool calls and
no ledger (one an application appended): readers count tool calls from the
records then.

Sessions written before ledgers existed hold model-call records without one:
:func:`latest_ledger` then says so (``legacy=True``), and the ledgers written
after such records are marked ``partial`` (they count only what came after):
readers count from the records themselves, as they always did (O(history)
for such sessions only). A ledger that does not convert is treated the same
way: the records it summarises are still there to count.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from ._messages import Message
from ._model import Usage
from ._records import _REGISTRY, TAG_FIELD, Record
from ._session import Session

__all__ = [
    "FEEDBACK",
    "LEDGER",
    "Ledger",
    "LedgerCorrection",
    "LedgerView",
    "Spent",
    "corrected_ledger",
    "latest_ledger",
    "ledger_on",
    "next_ledger",
    "run_ledgers",
    "standing_ledger",
    "starts_turn",
]

FEEDBACK: Final = "stepmachine.feedback"
"""Notes namespace marking a user message an operation appended to re-prompt the model.

Such messages do not start a new user turn (per-turn budgets, retry counts).
The value is ``{"by": <operation name>}``.
"""


class Spent(msgspec.Struct, frozen=True, array_like=True):
    """Model calls, tokens and tool calls spent.

    Stored compactly, as ``[model_calls, input_tokens, output_tokens,
    tool_calls]`` (a field added later goes at the end, with a default: a
    ledger stored as ``[calls, in, out]`` reads ``tool_calls=0``, and its
    :class:`Ledger` says ``tools=False``).
    """

    model_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    tool_calls: int = 0

    def __add__(self, other: Spent) -> Spent:
        return Spent(
            self.model_calls + other.model_calls,
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
            self.tool_calls + other.tool_calls,
        )

    def __sub__(self, other: Spent) -> Spent:
        return Spent(
            self.model_calls - other.model_calls,
            self.input_tokens - other.input_tokens,
            self.output_tokens - other.output_tokens,
            self.tool_calls - other.tool_calls,
        )


_BEFORE_KEPT: Final = 2
"""How many totals from before a ledger's revision it keeps (:attr:`Ledger.before`)."""

_BEFORE_WIDTH: Final = 5
"""``[revision, model_calls, input_tokens, output_tokens, tool_calls]``."""


class Ledger(msgspec.Struct, frozen=True):
    """Totals up to and including the call whose record carries it.

    Attributes:
        session: spent by the whole session.
        turn: spent since the turn began (the turn that started at message ``turn_start``).
        revision: the session revision the call was made at.
        turn_start: the id of the message that started the turn (``None``: before any).
        partial: model calls recorded before ledgers existed are not in it.
        tools: ``tool_calls`` counts the tool calls (see the module docs);
            ``False`` in ledgers written before they did, or after an
            assistant message with tool calls but no ledger (then readers
            count the tool calls from the records).
        refused_by: the budget steps whose refused calls this ledger no
            longer counts (a budget of another name counts from the records).
        before: the session totals as they stood before ``revision``, as
            ``[revision, model_calls, input_tokens, output_tokens, tool_calls]``:
            those of the latest ledger made at an earlier revision, then of the
            latest one before that, newest first (at most two; empty in the
            first ledger, and in ledgers written before they were kept). A run
            that began after them starts from them even when the ledgers
            themselves were replaced since (see the module docs).
    """

    session: Spent
    turn: Spent
    revision: int
    turn_start: str | None = None
    partial: bool = False
    tools: bool = False
    refused_by: list[str] = msgspec.field(default_factory=list)
    before: list[list[int]] = msgspec.field(default_factory=list)


class LedgerView(msgspec.Struct, frozen=True):
    """What :func:`latest_ledger` found.

    Attributes:
        ledger: the latest ledger, or ``None``.
        legacy: a model-call record without a ledger came first (count from the records).
        turn_start: the id of the latest turn start after the ledger's message
            (``None``: the ledger's turn is still the current one).
        tools: the tool calls are counted exactly: the ledger counts them
            (``Ledger.tools``) and no assistant message with tool calls but
            without a ledger came after it (with no ledger: none at all).
        added_back: for :func:`run_ledgers` only: tool calls made before the
            run whose corrections were written after ``ledger`` (see there).
    """

    ledger: Ledger | None
    legacy: bool
    turn_start: str | None
    tools: bool = True
    added_back: int = 0


LEDGER: Final = "stepmachine.ledger"
"""Notes namespace of a :class:`LedgerCorrection`."""


class LedgerCorrection(Record, frozen=True, tag="stepmachine.ledger.correction"):
    """Tool calls that stop counting, written by the step that makes them stop.

    Under :data:`LEDGER` on a message at or after the latest ledger (a message
    the step appends, or the conversation's last one). ``ledger`` is the
    latest ledger with the correction made (readers take it as the latest;
    its ``revision`` is the latest model call's), so reading stays a read back
    to the latest ledger.

    Attributes:
        ledger: the corrected totals.
        removed: ``[revision, count]`` pairs: ``count`` tool calls of a model
            call made at ``revision`` stop counting (negative: start counting);
            a run that began after ``revision`` adds them back.
    """

    ledger: Ledger
    removed: list[list[int]] = msgspec.field(default_factory=list)


def starts_turn(message: Message) -> bool:
    """Whether ``message`` starts a user turn (see the module docs)."""
    return (
        message.role == "user"
        and message.visible_to_model
        and message.visible_to_user
        and FEEDBACK not in message.notes
    )


def _carries_ledgers(tag: object) -> bool:
    """Whether ``tag`` names a registered record type with a ``ledger`` field."""
    if not isinstance(tag, str):
        return False
    kind = _REGISTRY.get(tag)
    return kind is not None and "ledger" in kind.__struct_fields__


_CORRECTION_TAG: Final = "stepmachine.ledger.correction"


def _order(ledger: Ledger, correction: bool) -> tuple[int, int, bool]:
    """Which of two ledgers on one message is newer: more model calls; of equal calls,
    fewer tool calls (a correction only takes calls away), then a correction."""
    return (ledger.session.model_calls, -ledger.session.tool_calls, correction)


def _ledger_of(message: Message) -> tuple[Ledger | None, bool]:
    """The newest ledger a record on ``message`` carries (:func:`_order`), and
    whether a model-call record without a ledger is there."""
    ledgers, legacy = _ledgers_of(message)
    return _newest(ledgers, legacy)


def _newest(ledgers: list[tuple[Ledger, bool]], legacy: bool) -> tuple[Ledger | None, bool]:
    """:func:`_ledger_of` from what :func:`_ledgers_of` found."""
    found: Ledger | None = None
    newest: tuple[int, int, bool] | None = None
    for ledger, correction in ledgers:
        order = _order(ledger, correction)
        if newest is None or order > newest:
            found, newest = ledger, order
    if found is not None and found.partial:
        legacy = True
    return found, legacy


def _ledgers_of(message: Message) -> tuple[list[tuple[Ledger, bool]], bool]:
    """Every ledger the records on ``message`` carry (with whether it is a correction's),
    and whether a model-call record without a ledger, or with a damaged one, is there."""
    legacy = False
    ledgers: list[tuple[Ledger, bool]] = []
    for value in message.notes.values():
        if not isinstance(value, dict):
            continue
        stored = value.get("ledger")
        tag = value.get(TAG_FIELD)
        if stored is not None and not _carries_ledgers(tag):
            # Not a record of a model call (an application's own note with a "ledger"
            # key, say): never the budget's running totals (exact budgets).
            stored = None
        if stored is not None:
            try:
                ledger = msgspec.convert(stored, Ledger)
            except msgspec.ValidationError:
                legacy = True  # a damaged ledger: count from the records instead
                continue
            ledgers.append((ledger, tag == _CORRECTION_TAG))
        elif isinstance(value.get("attempts"), int) or value.get("interrupted") is True:
            legacy = True
    return ledgers, legacy


def _run_base(ledgers: list[tuple[Ledger, bool]], run_start: int) -> Ledger | None:
    """The totals a run that began at ``run_start`` started from, as ``ledgers`` (those on
    one message) tell them: the newest made before it, or the totals one made in the run
    keeps from before it (:attr:`Ledger.before`); ``None`` when none tells.

    A ledger's ``before`` are the latest totals before its revision, each the latest
    before the previous one's: the first made before ``run_start`` is the latest made
    before it. Taken from there, the totals read as a ledger of that revision with
    the session totals only (``turn`` empty)."""
    found: Ledger | None = None
    newest: tuple[int, int, bool] | None = None
    for ledger, correction in ledgers:
        candidate: Ledger | None = ledger if ledger.revision < run_start else None
        if candidate is None:
            kept = next((b for b in _kept(ledger) if b[0] < run_start), None)
            if kept is not None:
                candidate = Ledger(Spent(*kept[1:]), Spent(), kept[0], tools=ledger.tools)
        if candidate is None:
            continue
        order = _order(candidate, correction and candidate is ledger)
        if newest is None or order > newest:
            found, newest = candidate, order
    return found


def ledger_on(message: Message) -> Ledger | None:
    """The newest ledger a record on ``message`` carries (``None``: none)."""
    return _ledger_of(message)[0]


def _added_back(message: Message, run_start: int) -> int:
    """The tool calls of model calls made before ``run_start`` that corrections on
    ``message`` took away (a run that began at ``run_start`` never counted them).

    A correction of a ledger made before ``run_start`` is none of the run's: what the
    run started from has its calls taken away already."""
    value = message.notes.get(LEDGER)
    if not isinstance(value, dict) or value.get(TAG_FIELD) != _CORRECTION_TAG:
        return 0
    try:
        correction = msgspec.convert(value, LedgerCorrection)
    except msgspec.ValidationError:
        return 0  # its ledger is damaged too: the reader counts from the records
    if correction.ledger.revision < run_start:
        return 0
    return sum(pair[1] for pair in correction.removed if len(pair) == 2 and pair[0] < run_start)


def _uncounted_calls(message: Message, ledger: Ledger | None) -> bool:
    """An assistant message with tool calls and no ledger of its own: no ledger counts them."""
    return ledger is None and message.role == "assistant" and bool(message.tool_calls)


def _walk(session: Session[Any], before_revision: int | None) -> LedgerView:
    conversation = session.conversation
    turn_start: str | None = None
    tools = True
    added_back = 0
    for position in range(len(conversation) - 1, -1, -1):
        message = conversation[position]
        ledgers, legacy = _ledgers_of(message)
        ledger, legacy = _newest(ledgers, legacy)
        if legacy:
            return LedgerView(ledger, legacy, turn_start, False, added_back)
        if before_revision is None:
            if ledger is not None:
                return LedgerView(ledger, legacy, turn_start, tools and ledger.tools, added_back)
        elif ledger is not None:
            base = _run_base(ledgers, before_revision)
            if base is not None:
                added_back += _added_back(message, before_revision)
                return LedgerView(base, legacy, turn_start, tools and base.tools, added_back)
        if _uncounted_calls(message, ledger):
            tools = False
        if before_revision is not None:
            added_back += _added_back(message, before_revision)
        if turn_start is None and starts_turn(message):
            turn_start = message.id
    return LedgerView(None, False, turn_start, tools, added_back)


def latest_ledger(session: Session[Any], *, before_revision: int | None = None) -> LedgerView:
    """The latest ledger in ``session`` (hidden messages included), reading back from the end.

    With ``before_revision``, the latest of a call made before that revision
    (what a run that began there started from); when the run's own ledgers
    replaced it on its message, the totals a later ledger kept of it
    (:attr:`Ledger.before`), as a ledger with ``session`` and ``revision``
    only. O(messages after the ledger's message).
    """
    view = _walk(session, before_revision)
    return view if before_revision is None else msgspec.structs.replace(view, added_back=0)


def run_ledgers(session: Session[Any], run_start: int) -> LedgerView:
    """What a run that began at revision ``run_start`` started from: the latest ledger of
    a call made before it, and in ``added_back`` the tool calls of calls made before the
    run that corrections written since took away (the latest ledger no longer counts
    them, and the run never did). O(messages of the run)."""
    return _walk(session, run_start)


def next_ledger(
    session: Session[Any],
    attempts: int,
    usage: Usage,
    *,
    on: Message | None = None,
    tool_calls: int = 0,
) -> Ledger:
    """The ledger of a new model-call record: the latest one plus this call.

    Args:
        session: the session the call was made from.
        attempts: model calls made (first try plus retries).
        usage: the tokens they used.
        on: the message the record goes on when it is already in the
            session (an annotation); ``None`` for a new message.
        tool_calls: the tool calls the reply asks for (0: no reply).
    """
    mine = Spent(attempts, usage.input_tokens, usage.output_tokens, tool_calls)
    view = latest_ledger(session)
    previous = view.ledger
    turn_start = view.turn_start
    if on is not None and starts_turn(on) and turn_start is None:
        turn_start = on.id
    if previous is None:
        return Ledger(mine, mine, session.revision, turn_start, view.legacy, view.tools)
    if turn_start is None or turn_start == previous.turn_start:
        turn, turn_start = previous.turn + mine, previous.turn_start
    else:
        turn = mine
    return Ledger(
        previous.session + mine,
        turn,
        session.revision,
        turn_start,
        view.legacy,
        view.tools,
        previous.refused_by,
        _before(previous, session.revision),
    )


def _before(previous: Ledger, revision: int) -> list[list[int]]:
    """:attr:`Ledger.before` of a ledger made at ``revision`` after ``previous``."""
    spent = previous.session
    latest = [
        previous.revision,
        spent.model_calls,
        spent.input_tokens,
        spent.output_tokens,
        spent.tool_calls,
    ]
    kept = [latest, *_kept(previous)]
    return [b for b in kept if b[0] < revision][:_BEFORE_KEPT]


def _kept(ledger: Ledger) -> list[list[int]]:
    """:attr:`Ledger.before` of ``ledger``; none when an entry is not five numbers (stored
    data is data: the run's start is then looked for further back, as before they were kept)."""
    before = ledger.before
    return before if all(len(b) == _BEFORE_WIDTH for b in before) else []


def standing_ledger(session: Session[Any], *, on: Message | None = None) -> Ledger:
    """The totals as they stand, for a record that adds no call (``on`` as in
    :func:`next_ledger`): what a call's record goes back to once the calls it
    reserved are accounted for elsewhere, or were never sent.

    Its ``revision`` is the latest ledger's (``-1`` when there is none), not the
    session's: it records no call of the current run, so a per-run count
    (:func:`latest_ledger` with ``before_revision``) still finds what came before.
    """
    previous = latest_ledger(session).ledger
    standing = next_ledger(session, 0, Usage(), on=on)
    if previous is None:
        return msgspec.structs.replace(standing, revision=-1)
    # the latest ledger again (with its turn as it now stands): what it kept from before, too
    return msgspec.structs.replace(standing, revision=previous.revision, before=previous.before)


def corrected_ledger(
    view: LedgerView,
    session_change: int,
    turn_change: int,
    removed: list[list[int]],
    *,
    refused_by: str | None = None,
    always: bool = False,
) -> LedgerCorrection | None:
    """The correction of the latest ledger (``view``) by ``session_change`` tool calls in
    the session and ``turn_change`` in the current turn (negative: calls that stop
    counting); ``None`` when there is no ledger to correct or (unless ``always``)
    nothing changes.

    ``refused_by`` names the budget step that refused the calls.
    """
    ledger = view.ledger
    if ledger is None or not (always or session_change or turn_change):
        return None
    turn, turn_start = ledger.turn, ledger.turn_start
    if view.turn_start is not None and view.turn_start != ledger.turn_start:
        turn, turn_start = Spent(), view.turn_start  # a turn began since the latest call
    by = ledger.refused_by
    if refused_by is not None and refused_by not in by:
        by = [*by, refused_by]
    corrected = msgspec.structs.replace(
        ledger,
        session=ledger.session + Spent(tool_calls=session_change),
        turn=turn + Spent(tool_calls=turn_change),
        turn_start=turn_start,
        partial=ledger.partial or view.legacy,
        tools=view.tools,
        refused_by=by,
    )
    return LedgerCorrection(ledger=corrected, removed=removed)
