"""Helpers shared by the observability tests (not a test module).

- :class:`Spans`: an OpenTelemetry SDK ``TracerProvider`` of its own with an
  ``InMemorySpanExporter`` (never the global provider), and ways to read the
  finished spans as a tree;
- :func:`json_lines`: a standard-library handler on the logger ``stepmachine``
  that formats each record with structlog's ``ProcessorFormatter`` and
  ``JSONRenderer``, as an application would;
- :func:`events`: the captured events named ``name``.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from stepmachine import Telemetry

LOGGER = "stepmachine"


@dataclass
class Spans:
    """A tracer provider of the test's own, exporting to memory."""

    exporter: InMemorySpanExporter = field(default_factory=InMemorySpanExporter)
    provider: TracerProvider = field(default_factory=TracerProvider)

    def __post_init__(self) -> None:
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def telemetry(self, *, capture_content: bool = False) -> Telemetry:
        return Telemetry(capture_content=capture_content, tracer_provider=self.provider)

    @property
    def finished(self) -> tuple[ReadableSpan, ...]:
        return tuple(self.exporter.get_finished_spans())

    def named(self, prefix: str) -> list[ReadableSpan]:
        """The finished spans whose name starts with ``prefix``, in end order."""
        return [s for s in self.finished if s.name.startswith(prefix)]

    def parent(self, span: ReadableSpan) -> ReadableSpan | None:
        """The finished span that is ``span``'s parent (``None`` for a root)."""
        if span.parent is None:
            return None
        for candidate in self.finished:
            if candidate.context.span_id == span.parent.span_id:
                return candidate
        raise AssertionError(f"the parent of {span.name!r} was not exported")

    def tree(self) -> list[str]:
        """Every finished span as ``"  " * depth + name``, children in start order."""
        spans = sorted(self.finished, key=lambda s: s.start_time or 0)
        lines: list[str] = []

        def walk(parent_id: int | None, depth: int) -> None:
            for span in spans:
                own_parent = span.parent.span_id if span.parent is not None else None
                if own_parent == parent_id:
                    lines.append("  " * depth + span.name)
                    walk(span.context.span_id, depth + 1)

        walk(None, 0)
        return lines


def events(captured: Sequence[Mapping[str, Any]], name: str) -> list[Mapping[str, Any]]:
    """The captured events named ``name``, in order."""
    return [e for e in captured if e.get("event") == name]


@contextlib.contextmanager
def json_lines(level: int = logging.DEBUG) -> Iterator[list[dict[str, Any]]]:
    """Within the block, every record of the logger ``stepmachine`` is rendered as a JSON line.

    Yields a list that holds the parsed lines once the block has ended. structlog is reset to
    its defaults first (unconfigured: the library's own standard-library
    route) and again afterwards; the logger's level and handlers are restored.
    """
    structlog.reset_defaults()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(processor=structlog.processors.JSONRenderer())
    )
    target = logging.getLogger(LOGGER)
    old_level = target.level
    target.addHandler(handler)
    target.setLevel(level)
    parsed: list[dict[str, Any]] = []
    try:
        yield parsed
    finally:
        target.removeHandler(handler)
        target.setLevel(old_level)
        structlog.reset_defaults()
        parsed.extend(json.loads(line) for line in stream.getvalue().splitlines() if line)
