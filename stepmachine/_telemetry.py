"""``Telemetry``: what a run may tell logs and traces, carried by the :class:`~stepmachine.Runtime`.

A run reports itself two ways, both off until the application turns them on:
structured log events (``stepmachine._log``, logger ``stepmachine``) and
OpenTelemetry spans (``stepmachine._tracing``, extra ``otel``). Neither ever
carries an API key (no secret escapes). Prompts, model replies, tool arguments and
tool results appear in them only when content capture is on: the
``capture_content`` setting here, or, when it is left ``None``, the standard
environment variable ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true``
that OpenTelemetry's GenAI instrumentations read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["CAPTURE_ENV", "Telemetry"]

CAPTURE_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
"""The environment variable that turns content capture on when ``capture_content`` is ``None``."""

_TRUE = frozenset({"1", "true", "yes", "on"})


@dataclass(frozen=True, slots=True)
class Telemetry:
    """How a run reports itself to logs and traces.

    Attributes:
        capture_content: put message text, tool arguments and tool results
            into events and spans (``False`` by default: only names, ids,
            counts, timings and error types). ``None`` reads
            :data:`CAPTURE_ENV` at each use.
        tracer_provider: the OpenTelemetry ``TracerProvider`` spans go to;
            ``None`` uses the global one (``opentelemetry.trace.set_tracer_provider``).
            No provider configured (or the extra ``otel`` not installed): no
            spans, at the cost of one check per run.
    """

    capture_content: bool | None = False
    tracer_provider: Any | None = None

    @property
    def captures_content(self) -> bool:
        """Whether content goes into events and spans now."""
        if self.capture_content is None:
            return os.environ.get(CAPTURE_ENV, "").strip().lower() in _TRUE
        return self.capture_content is True
