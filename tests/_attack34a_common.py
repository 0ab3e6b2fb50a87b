"""Shared pieces of the attack34a tests: an order with several charges, a staged step.

``Order.keys`` holds the intents (task name -> idempotency key), ``Order.receipts`` the
records (task name -> receipt). A record is computed from the session as stored: it adds
its receipt to the stored receipts, and records nothing when its receipt is there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from stepmachine import (
    Effect,
    Operation,
    Outcome,
    Session,
    StepContext,
    UpdateData,
)


class Order(msgspec.Struct):
    keys: dict[str, str] = msgspec.field(default_factory=dict)
    receipts: dict[str, str] = msgspec.field(default_factory=dict)
    kept: dict[str, str] = msgspec.field(default_factory=dict)
    count: int = 0  # bumped by other writers


def receipt_record(name: str, receipt: str) -> Callable[[Session[Any]], Sequence[Effect]]:
    """The record of a charge: the receipt added to what is stored (nothing if it is)."""

    def record(stored: Session[Any]) -> Sequence[Effect]:
        if name in stored.data.receipts:
            return ()
        return [UpdateData.set(receipts={**stored.data.receipts, name: receipt})]

    return record


def keep_record(name: str, what: str) -> Callable[[Session[Any]], Sequence[Effect]]:
    def record(stored: Session[Any]) -> Sequence[Effect]:
        if name in stored.data.kept:
            return ()
        return [UpdateData.set(kept={**stored.data.kept, name: what})]

    return record


class StagedStep(Operation[Order]):
    """Applies once (no intent stored yet): returns what ``make(ctx)`` builds."""

    def __init__(self, make: Callable[[StepContext[Order]], Outcome]) -> None:
        self.make = make
        self.calls = 0

    @property
    def name(self) -> str:
        return "Charges"

    async def run(self, ctx: StepContext[Order]) -> Outcome:
        from stepmachine import Refuse, Yield

        self.calls += 1
        data = ctx.session.data
        if data.keys:
            missing = sorted(set(data.keys) - set(data.receipts) - set(data.kept))
            if missing:
                return Yield([], "outcome_unknown")
            return Refuse("charged")
        return self.make(ctx)
