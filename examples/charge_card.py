"""A custom step with staged work: charge a card at most once, whatever happens.

    python examples/charge_card.py

A step never writes: it returns what to do. Charging a card needs more than
one batch of effects, so the step returns :class:`~stepmachine.Staged` work and
the machine carries it out:

1. it writes the **intent** (``charge_started`` with the idempotency key), so
   that a crash after the charge is never read as "nothing happened";
2. it confirms the run still holds the session's lease (the task is
   ``guarded``), then runs the **task**: the call to the payment provider;
3. it writes the task's **record** (the receipt) the moment the call returns
   -- or, if the run is cancelled right then, finalize writes it: the machine
   held it from the instant it existed.

On the next cycle the step sees ``charge_started`` without a receipt only if
the process died between the intent and the receipt; it then does not charge
again but asks the provider what happened to that idempotency key (here it
yields ``outcome_unknown`` for an operator). The demo runs the happy path,
then shows the crash path on a session whose intent is stored without a receipt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import anyio.lowlevel
import msgspec

from stepmachine import (
    Codec,
    Continue,
    Effect,
    Operation,
    Outcome,
    Refuse,
    Runtime,
    Session,
    Staged,
    StateMachine,
    StepContext,
    Task,
    UpdateData,
    Yield,
)
from stepmachine.extend import Recorder, YieldReason
from stepmachine.stores import MemoryStore


class Order(msgspec.Struct):
    """The application's data: one order to charge."""

    amount_cents: int = 0
    charge_key: str = ""  # the intent: set before the provider is called
    receipt: str = ""  # the record: set once the provider answered


class PaymentProvider:
    """A stand-in for a payment API that deduplicates on an idempotency key."""

    def __init__(self) -> None:
        self.charges: dict[str, int] = {}

    async def charge(self, amount_cents: int, idempotency_key: str) -> str:
        await anyio.lowlevel.checkpoint()  # a network call
        self.charges.setdefault(idempotency_key, amount_cents)
        return f"receipt-{idempotency_key[:8]}"


class ChargeOrder(Operation[Order]):
    """Charges the order once: intent, then the call, then the receipt."""

    def __init__(self, provider: PaymentProvider) -> None:
        self.provider = provider

    async def run(self, ctx: StepContext[Order]) -> Outcome:
        order = ctx.session.data
        if order.receipt or order.amount_cents <= 0:
            return Refuse("nothing to charge")
        if order.charge_key:  # the intent is stored and no receipt: a crash in between
            return Yield(
                [],
                YieldReason(
                    "outcome_unknown",
                    f"a charge with key {order.charge_key!r} may have happened; ask the "
                    "provider before charging again",
                ),
            )
        key = ctx.new_id()  # from the runtime's id source: replay knows it is not the step's
        intent: Sequence[Effect] = [UpdateData.set(charge_key=key)]

        async def charge() -> Recorder:
            receipt = await self.provider.charge(order.amount_cents, key)

            def record(session: Session[Any]) -> Sequence[Effect]:
                if session.data.receipt:  # recorded already (a retry after a conflict)
                    return ()
                return [UpdateData.set(receipt=receipt)]

            return record

        def ending() -> Continue | Yield:
            return Yield([], YieldReason(YieldReason.DONE, "charged"))

        return Staged(intent, [Task("charge the card", charge, guarded=True)], then=ending)


async def main() -> None:
    provider = PaymentProvider()
    store = MemoryStore(Codec(Order))
    machine: StateMachine[Order] = StateMachine([ChargeOrder(provider)])
    runtime = Runtime(store=store)

    await store.create("order-1", data=Order(amount_cents=4200))
    report = await machine.run_report(runtime, "order-1")
    order = report.session.data
    print(f"order-1: {report.reason.kind}, receipt {order.receipt!r}")
    print(f"  batches: {[b.step for b in await store.batches('order-1')]}")
    print(f"  the provider charged {len(provider.charges)} time(s)")
    again = await machine.run_report(runtime, "order-1")
    print(f"  run again: {again.reason.kind} (nothing to charge), charges: {len(provider.charges)}")

    # The process died after the intent and before the receipt: the intent is stored.
    await store.create("order-2", data=Order(amount_cents=990, charge_key="k-from-a-crash"))
    crashed = await machine.run_report(runtime, "order-2")
    print(f"order-2: {crashed.reason.kind}: {crashed.reason.message}")
    print(f"  the provider charged order-2 {provider.charges.get('k-from-a-crash', 0)} cents")


if __name__ == "__main__":
    anyio.run(main)
