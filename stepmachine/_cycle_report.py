"""What the cycle reports besides its writes: the ``cycle`` and ``yield`` log events,
the cycle span's attributes, why a run in which no step applied yields, and the
link from a traced run's span to the run it continues (:func:`link_to_previous`).

:func:`log_cycle` ends every cycle (logger ``stepmachine``, at DEBUG; the
cycle's span, when the run is traced); :func:`log_yield` is the ``yield``
event (at INFO) of a run that returns; :func:`idle_reason` is the reason a
run yields with when every step refused (``idle``, or ``call_held`` when a
step holds open tool calls back). Each does nothing it need not when logging
is off and the run is not traced. The cycle itself is ``stepmachine._cycle``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec

from . import _log, _tracing
from ._capabilities import Capabilities
from ._codec import Refusal
from ._history import open_tool_calls
from ._runtime import Runtime
from ._session import Session
from ._steps import StepContext, YieldReason

__all__ = ["idle_reason", "link_to_previous", "log_cycle", "log_yield"]

D = TypeVar("D", bound=msgspec.Struct)


def log_cycle(
    session: Session[Any],
    cycle: int,
    step: str | None,
    refusals: Sequence[Refusal],
    outcome: str,
    started: float | None = None,
    span: Any = None,
    effects: int = 0,
) -> None:
    """Report one cycle: the ``cycle`` event (logger ``stepmachine``) and its span's attributes.

    ``session`` is the session after the cycle; ``started`` its
    ``time.perf_counter()`` at the start; ``span`` the cycle's span (``None``
    when the run is not traced).
    """
    if span is not None:
        span.update_name(f"cycle {step}" if step else "cycle")
        _tracing.set_attributes(
            span,
            {
                "stepmachine.step": step,
                "stepmachine.refused": [r.step for r in refusals],
                "stepmachine.outcome": outcome,
                "stepmachine.revision": session.revision,
                "stepmachine.effects": effects,
            },
        )
    if _log.enabled(_log.DEBUG):
        duration = None if started is None else round((time.perf_counter() - started) * 1000, 3)
        _log.event(
            _log.DEBUG,
            "cycle",
            session_id=session.id,
            revision=session.revision,
            cycle=cycle,
            step=step,
            refused=[{"step": r.step, "why": r.why} for r in refusals],
            outcome=outcome,
            effects=effects,
            duration_ms=duration,
        )


def log_yield(session: Session[Any], reason: YieldReason, runtime: Runtime, cycles: int) -> None:
    """The ``yield`` event (INFO) of a run returning from ``session`` for ``reason``.

    A ``tool_failed`` message (the tool's error text: tool content) is logged
    only with content capture on, else a placeholder.
    """
    if _log.enabled(_log.INFO):
        _log.event(
            _log.INFO,
            "yield",
            session_id=session.id,
            revision=session.revision,
            kind=reason.kind,
            message=_loggable_message(reason, runtime),
            cycles=cycles,
        )


_CONTENT_KINDS = frozenset({"tool_failed"})
"""Yield kinds whose message quotes a tool's error (``ToolAbortError``'s text: tool content)."""


def _loggable_message(reason: YieldReason, runtime: Runtime) -> str:
    """``reason.message`` for the ``yield`` event; a ``tool_failed`` message (the tool's
    error text) only with content capture on, else a placeholder."""
    if reason.kind in _CONTENT_KINDS and not runtime.telemetry.captures_content:
        return "(the tool's error; content capture is off)"
    return reason.message


def idle_reason(capabilities: Capabilities[D], ctx: StepContext[D]) -> YieldReason:
    """Why no step applied: ``call_held`` if some step holds open calls back, else ``idle``."""
    held: list[dict[str, str]] = []
    for call in open_tool_calls(ctx.session):
        objection = capabilities.vet(ctx, call)
        if objection is not None:
            held.append(
                {
                    "call_id": call.call_id,
                    "tool": call.name,
                    "step": objection.step,
                    "objection": objection.reason,
                }
            )
    if not held:
        return YieldReason(YieldReason.IDLE, "no step applies")
    first = held[0]
    more = f" (and {len(held) - 1} more held call(s))" if len(held) > 1 else ""
    return YieldReason(
        YieldReason.CALL_HELD,
        f"step {first['step']!r} holds back tool call {first['call_id']!r} "
        f"({first['tool']}): {first['objection']}{more}; no step applies until the "
        "session changes",
        {"calls": held},
    )


LINK_WINDOW = 16
"""Batches a traced run reads back to find the span it continues (see ``link_to_previous``)."""


async def link_to_previous(runtime: Runtime, session: Session[Any], span: Any) -> None:
    """Link ``span`` to the span that wrote the newest traced batch among the session's last
    :data:`LINK_WINDOW`, if any.

    The newest batch is often written outside any run (``approve()``,
    ``submit()``: a user message, an operator's decision), so the run that
    yielded is looked for a few batches back. Reads them through the loader's
    ``batches`` (the shipped stores have it); a loader without it, or a failing
    read, gives no link (logged). Only traced runs pay for this.
    """
    batches = getattr(runtime.session_loader(), "batches", None)
    if session.revision < 1 or batches is None:
        return
    try:
        recent = await batches(session.id, max(0, session.revision - LINK_WINDOW))
        for batch in reversed(recent):
            link = _tracing.link_to(getattr(batch, "trace", None))
            if link is not None:
                span.add_link(link.context, link.attributes)
                return
    except Exception:  # noqa: BLE001 - a link is worth less than the run
        message = "could not read the last batches to link the run's span"
        _log.failure(message, session_id=session.id)
