"""The model-call ledger: running totals of model calls and tokens, carried by receipts.

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
from ._records import _REGISTRY, TAG_FIELD
from ._session import Session

__all__ = [
    "FEEDBACK",
    "Ledger",
    "LedgerView",
    "Spent",
    "latest_ledger",
    "next_ledger",
    "starts_turn",
]

FEEDBACK: Final = "stepmachine.feedback"
"""Notes namespace marking a user message an operation appended to re-prompt the model.

Such messages do not start a new user turn (per-turn budgets, retry counts).
The value is ``{"by": <operation name>}``.
"""


class Spent(msgspec.Struct, frozen=True, array_like=True):
    """Model calls and tokens spent.

    Stored compactly, as ``[model_calls, input_tokens, output_tokens]`` (a
    field added later goes at the end, with a default).
    """

    model_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    def __add__(self, other: Spent) -> Spent:
        return Spent(
            self.model_calls + other.model_calls,
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
        )

    def __sub__(self, other: Spent) -> Spent:
        return Spent(
            self.model_calls - other.model_calls,
            self.input_tokens - other.input_tokens,
            self.output_tokens - other.output_tokens,
        )


class Ledger(msgspec.Struct, frozen=True):
    """Totals up to and including the call whose record carries it.

    Attributes:
        session: spent by the whole session.
        turn: spent since the turn began (the turn that started at message ``turn_start``).
        revision: the session revision the call was made at.
        turn_start: the id of the message that started the turn (``None``: before any).
        partial: model calls recorded before ledgers existed are not in it.
    """

    session: Spent
    turn: Spent
    revision: int
    turn_start: str | None = None
    partial: bool = False


class LedgerView(msgspec.Struct, frozen=True):
    """What :func:`latest_ledger` found.

    Attributes:
        ledger: the latest ledger, or ``None``.
        legacy: a model-call record without a ledger came first (count from the records).
        turn_start: the id of the latest turn start after the ledger's message
            (``None``: the ledger's turn is still the current one).
    """

    ledger: Ledger | None
    legacy: bool
    turn_start: str | None


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


def _ledger_of(message: Message) -> tuple[Ledger | None, bool]:
    """The newest ledger a record on ``message`` carries (the one with the most calls), and
    whether a model-call record without a ledger is there."""
    legacy = False
    found: Ledger | None = None
    for value in message.notes.values():
        if not isinstance(value, dict):
            continue
        stored = value.get("ledger")
        if stored is not None and not _carries_ledgers(value.get(TAG_FIELD)):
            # Not a record of a model call (an application's own note with a "ledger"
            # key, say): never the budget's running totals (exact budgets).
            stored = None
        if stored is not None:
            try:
                ledger = msgspec.convert(stored, Ledger)
            except msgspec.ValidationError:
                legacy = True  # a damaged ledger: count from the records instead
                continue
            if found is None or ledger.session.model_calls > found.session.model_calls:
                found = ledger
        elif isinstance(value.get("attempts"), int) or value.get("interrupted") is True:
            legacy = True
    if found is not None and found.partial:
        legacy = True
    return found, legacy


def latest_ledger(session: Session[Any], *, before_revision: int | None = None) -> LedgerView:
    """The latest ledger in ``session`` (hidden messages included), reading back from the end.

    With ``before_revision``, the latest of a call made before that revision
    (what a run that began there started from). O(messages after the ledger's
    message).
    """
    conversation = session.conversation
    turn_start: str | None = None
    for position in range(len(conversation) - 1, -1, -1):
        message = conversation[position]
        ledger, legacy = _ledger_of(message)
        if legacy:
            return LedgerView(ledger, legacy, turn_start)
        if ledger is not None and (before_revision is None or ledger.revision < before_revision):
            return LedgerView(ledger, legacy, turn_start)
        if turn_start is None and starts_turn(message):
            turn_start = message.id
    return LedgerView(None, False, turn_start)


def next_ledger(
    session: Session[Any],
    attempts: int,
    usage: Usage,
    *,
    on: Message | None = None,
) -> Ledger:
    """The ledger of a new model-call record: the latest one plus this call.

    Args:
        session: the session the call was made from.
        attempts: model calls made (first try plus retries).
        usage: the tokens they used.
        on: the message the record goes on when it is already in the
            session (an annotation); ``None`` for a new message.
    """
    mine = Spent(attempts, usage.input_tokens, usage.output_tokens)
    view = latest_ledger(session)
    previous = view.ledger
    turn_start = view.turn_start
    if on is not None and starts_turn(on) and turn_start is None:
        turn_start = on.id
    if previous is None:
        return Ledger(mine, mine, session.revision, turn_start, view.legacy)
    if turn_start is None or turn_start == previous.turn_start:
        turn, turn_start = previous.turn + mine, previous.turn_start
    else:
        turn = mine
    return Ledger(previous.session + mine, turn, session.revision, turn_start, view.legacy)
