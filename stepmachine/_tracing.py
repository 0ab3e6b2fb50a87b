"""OpenTelemetry spans for a run, following the GenAI semantic conventions (extra ``otel``).

Spans (only when the extra is installed and a tracer provider is configured:
:class:`~stepmachine.Telemetry`'s, or the global one; otherwise every function
here returns at once and nothing is allocated per cycle):

- ``invoke_agent`` for each run (each round of a leased run), kind INTERNAL:
  ``gen_ai.operation.name=invoke_agent``, ``gen_ai.agent.name=stepmachine``,
  ``gen_ai.conversation.id`` (the session id), ``stepmachine.revision.start``,
  ``stepmachine.revision.end``, ``stepmachine.yield.kind``, ``stepmachine.cycles``.
  When the session's last stored batch was written under a trace (the batch's
  ``trace``), the span links to that span: a run resumed in another process
  (after an approval, a crash) is connected to the run that yielded.
- ``cycle {step}`` for each machine cycle, a child of the run:
  ``stepmachine.cycle``, ``stepmachine.step`` (the step that applied),
  ``stepmachine.refused`` (the steps that refused, in order), ``stepmachine.outcome``,
  ``stepmachine.revision``.
- ``chat {model}`` for each model call (retries included), kind CLIENT, a child
  of its cycle: ``gen_ai.operation.name=chat``, ``gen_ai.provider.name``,
  ``gen_ai.request.model``, ``gen_ai.response.model``,
  ``gen_ai.usage.input_tokens`` / ``output_tokens``, ``gen_ai.response.finish_reasons``;
  each retry is a span event ``gen_ai.retry`` (attempt, delay, error type).
- ``execute_tool {tool}`` for each tool call, kind INTERNAL: ``gen_ai.operation.name=execute_tool``,
  ``gen_ai.tool.name``, ``gen_ai.tool.call.id``, ``gen_ai.tool.type=function``,
  ``stepmachine.tool.side_effects``, ``stepmachine.tool.outcome``.

An exception leaving a span sets its status to ERROR with ``error.type`` (the
exception's class name; a cancellation is ``cancelled``); its message is
recorded only with content capture on. Content (``gen_ai.input.messages``,
``gen_ai.output.messages``, ``gen_ai.tool.call.arguments``,
``gen_ai.tool.call.result``) is set only with content capture on.

Context travels in ``contextvars``, which anyio copies into every task it
starts and every worker thread it runs (asyncio and trio alike): a tool run in
a task group is a child of its cycle.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import re
import weakref
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final

import anyio

from ._errors import ConfigurationError
from ._telemetry import Telemetry

try:
    from opentelemetry import trace as _trace
except ImportError:  # pragma: no cover - exercised by a test that hides the package
    _trace = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

__all__ = [
    "active",
    "add_event",
    "available",
    "link_to",
    "mark_error",
    "mark_type",
    "run_span",
    "set_attributes",
    "span",
    "traceparent",
    "tracer",
]

AGENT_NAME: Final = "stepmachine"
_TRACEPARENT: Final = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
NO_SPAN: Final[contextlib.AbstractContextManager[Any]] = contextlib.nullcontext(None)
"""What :func:`span` returns outside a traced run (reusable)."""
_tracers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_run_tracer: ContextVar[Any] = ContextVar("stepmachine_run_tracer", default=None)
"""The tracer of the traced run the caller is in (``None``: not in one)."""


def available() -> bool:
    """Whether the OpenTelemetry API is importable."""
    return _trace is not None


def tracer(telemetry: Telemetry) -> Tracer | None:
    """The tracer spans go to, or ``None`` when tracing is off (no API, no provider)."""
    if _trace is None:
        return None
    provider = telemetry.tracer_provider
    if provider is None:
        provider = _trace.get_tracer_provider()
        if isinstance(provider, _trace.ProxyTracerProvider | _trace.NoOpTracerProvider):
            return None  # nothing configured: the API would make non-recording spans
    try:
        made = _tracers.get(provider)
    except TypeError:  # cannot be weakly referenced: not cached
        made = None
    if made is None:
        get_tracer = getattr(provider, "get_tracer", None)
        if not callable(get_tracer):
            raise ConfigurationError(
                "Telemetry.tracer_provider must be an OpenTelemetry TracerProvider (it has "
                f"get_tracer), got {type(provider).__name__}"
            )
        made = get_tracer("stepmachine", _version())
        with contextlib.suppress(TypeError):
            _tracers[provider] = made
    return made  # type: ignore[no-any-return]


def _version() -> str:
    try:
        return importlib.metadata.version("stepmachine")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a checkout
        return "0"


def run_span(
    telemetry: Telemetry, name: str, attributes: Mapping[str, Any]
) -> contextlib.AbstractContextManager[Span | None]:
    """A run's span (``invoke_agent``), made current for the ``with`` block; ``None`` when off.

    Inside the block, :func:`span` makes child spans with the same tracer;
    outside any traced run it makes none. So the one check whether tracing is
    configured (which reads an environment variable in the OpenTelemetry API)
    is made once per run, not per cycle.
    """
    made = tracer(telemetry)
    if made is None:
        # A run of an untraced runtime inside a traced run (an agent called by a
        # tool): not traced at all, rather than half (cycles with no run span).
        return NO_SPAN if _run_tracer.get() is None else _untraced()
    return _current(made, telemetry, name, attributes, False)


@contextlib.contextmanager
def _untraced() -> Iterator[None]:
    token = _run_tracer.set(None)
    try:
        yield None
    finally:
        _run_tracer.reset(token)


def span(
    telemetry: Telemetry,
    name: str,
    attributes: Mapping[str, Any],
    *,
    client: bool = False,
) -> contextlib.AbstractContextManager[Span | None]:
    """A span inside a traced run, made current for the ``with`` block; ``None`` outside one.

    An exception leaving the block marks the span (see the module docs) and
    propagates; the span ends either way.
    """
    made = _run_tracer.get()
    if made is None:
        return NO_SPAN
    return _current(made, telemetry, name, attributes, client)


def active() -> bool:
    """Whether the caller is inside a traced run (cheap: one context variable)."""
    return _run_tracer.get() is not None


@contextlib.contextmanager
def _current(
    made: Tracer,
    telemetry: Telemetry,
    name: str,
    attributes: Mapping[str, Any],
    client: bool,
) -> Iterator[Span]:
    assert _trace is not None
    kind = _trace.SpanKind.CLIENT if client else _trace.SpanKind.INTERNAL
    started = made.start_span(name, kind=kind, attributes=dict(attributes))
    token = _run_tracer.set(made)
    try:
        with _trace.use_span(
            started, end_on_exit=True, record_exception=False, set_status_on_exception=False
        ):
            try:
                yield started
            except BaseException as exc:
                mark_error(started, exc, telemetry)
                raise
    finally:
        _run_tracer.reset(token)


def mark_error(target: Span, exc: BaseException, telemetry: Telemetry) -> None:
    """Set ``error.type`` and an ERROR status on ``target`` (the message only with capture on)."""
    mark_type(target, error_type(exc))
    if telemetry.captures_content:
        target.record_exception(exc)


def mark_type(target: Span, kind: str) -> None:
    """Set ``error.type`` to ``kind`` and an ERROR status described by ``kind`` on ``target``."""
    assert _trace is not None
    target.set_attribute("error.type", kind)
    target.set_status(_trace.Status(_trace.StatusCode.ERROR, kind))


def error_type(exc: BaseException) -> str:
    """The ``error.type`` of ``exc``: its class name; ``cancelled`` for a cancellation."""
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        return "cancelled"
    return type(exc).__name__


def set_attributes(target: Span | None, attributes: Mapping[str, Any]) -> None:
    """Set ``attributes`` (``None`` values skipped) on ``target`` unless it is ``None``."""
    if target is None:
        return
    for key, value in attributes.items():
        if value is not None:
            target.set_attribute(key, value)


def add_event(name: str, attributes: Mapping[str, Any]) -> None:
    """Add a span event to the current span in a traced run (``None`` values skipped)."""
    if _trace is None or _run_tracer.get() is None:
        return
    current = _trace.get_current_span()
    if current.is_recording():
        current.add_event(name, {k: v for k, v in attributes.items() if v is not None})


def traceparent() -> str | None:
    """The W3C ``traceparent`` of the current span in a traced run, else ``None``."""
    if _trace is None or _run_tracer.get() is None:
        return None
    context = _trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def link_to(value: str | None) -> Any | None:
    """A span ``Link`` to the span a stored ``traceparent`` names; ``None`` if it is not one.

    Stored data is data: anything but a well-formed version-00 traceparent
    with non-zero ids gives ``None``, never an error.
    """
    if _trace is None or not isinstance(value, str) or _TRACEPARENT.fullmatch(value) is None:
        return None
    _, trace_hex, span_hex, flags_hex = value.split("-")
    trace_id, span_id, flags = int(trace_hex, 16), int(span_hex, 16), int(flags_hex, 16)
    if trace_id == 0 or span_id == 0:
        return None
    context = _trace.SpanContext(
        trace_id, span_id, is_remote=True, trace_flags=_trace.TraceFlags(flags)
    )
    return _trace.Link(context, {"stepmachine.link": "resumed"})
