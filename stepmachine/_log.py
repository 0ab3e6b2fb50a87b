"""Structured log events: every decision of a run as a structlog event with fields.

The library never configures logging. It logs through the standard-library
logger ``stepmachine`` with its fields intact, using structlog's standard-library
integration:

- when structlog is configured (``structlog.configure``, and inside
  ``structlog.testing.capture_logs()``), an event goes through the configured
  wrapper class and processors, then to the logger ``stepmachine``: a chain
  ending in ``structlog.stdlib.ProcessorFormatter.wrap_for_formatter`` keeps the
  fields for a ``ProcessorFormatter`` (JSON lines with ``JSONRenderer``);
- otherwise, an event whose level the logger ``stepmachine`` has enabled is
  handed to it with the event dict as the record's message (exactly what
  ``wrap_for_formatter`` produces), so a ``structlog.stdlib.ProcessorFormatter``
  on a handler renders it, and a plain ``logging.Formatter`` prints the dict.
  An event the logger has not enabled costs one level check.

Events (``event`` is the name; every one has ``session_id`` where a session is known):

===============  =========  ===============================================================
event            level      fields
===============  =========  ===============================================================
``cycle``        DEBUG      revision, cycle, step (applied, or None), refused (list of
                            ``{"step", "why"}``), outcome (continue / yielded / idle /
                            conflict / cancelled / ...), effects, duration_ms
``yield``        INFO       revision, kind, message (a ``tool_failed`` message quotes the
                            tool's error: only with content capture on), cycles
``conflict``     INFO       revision (read), step, cycle
``reload``       DEBUG      revision (now stored)
``finalize``     INFO       revision, interrupted (step or None), batches (written),
                            answered (calls answered "interrupted")
``model_call``   DEBUG      model, attempts, duration_ms, input_tokens, output_tokens,
                            finish_reason; on failure (WARNING) error_type
``model_retry``  INFO       model, attempt (the one that failed), delay_s, error_type,
                            status, retry_after
``tool_call``    DEBUG      tool, call_id, side_effects, duration_ms, outcome (ok / error /
                            timeout / aborted / invalid_arguments)
``journal``      WARNING    tool, call_id, decision (``outcome_unknown``: an intent without
                 / INFO     a result after a crash, not re-run; ``rerun``: run again, its
                            tool being idempotent or an operator allowed it), attempt,
                            side_effects
``lease_*``      WARNING    ``lease_renewal_failed``, ``lease_release_failed``,
                            ``lease_request_again_failed``: error_type, detail (a store error)
``serve_run_``   WARNING    ``serve_run_retried``: error_type, attempt, delay_s, detail (a
``retried``                 run of ``serve()`` raised a transient error: run again later);
                            ``serve_run_retry_deferred``: error_type, detail (the turn
                            could not be given back yet: tried again each round)
``serve_run_``   ERROR      ``serve_run_failed``: error_type, attempts, retried (False: a
``failed``                  run of ``serve()`` failed for good; the turn is not run again
                            until a run is requested), detail (the error's text, cut; a
                            provider's message only with content capture on), raised_at
                            (its innermost frames, ``file:line in function``: no locals)
``serve_claim_`` WARNING    ``serve_claim_failed``: error_type, attempt, delay_s, detail
``failed``                  (``claim_next`` raised a transient error: tried again)
``durable_step`` WARNING    ``durable_step_retried``: step, error_type, attempt, delay_s,
``_retried``                detail (a durable cycle raised a transient error: tried again)
``mcp_server``   INFO       an MCP server of ``McpTools``: server (its name), state (``up`` /
                 / WARNING  ``down``), problem (why it is down; WARNING); or fault (a
                            transport fault the SDK reported), listen (a list-change
                            subscription that ended). Header values, environment values
                            and URL credentials are redacted.
``mcp_catalog``  WARNING    problem: a tool of an MCP server left out of the list (an
                            empty name, a name given twice, a clash after a list change)
===============  =========  ===============================================================

No event carries an API key, a prompt, a reply, tool arguments or a tool
result, unless content capture is on (:class:`~stepmachine.Telemetry`): then
``model_call`` has ``reply`` and ``tool_call`` has ``arguments`` and ``result``.
Refusal reasons (``Refuse.why``) and yield messages are written by step
authors and are logged as they are.
"""

from __future__ import annotations

import logging
import sys
import traceback
from contextvars import ContextVar
from typing import Any, Final

import structlog

__all__ = ["LOGGER", "enabled", "event", "failure", "session"]

LOGGER: Final = "stepmachine"
"""The standard-library logger every event goes to."""

DEBUG: Final = logging.DEBUG
INFO: Final = logging.INFO
WARNING: Final = logging.WARNING
ERROR: Final = logging.ERROR

_stdlib: Final = logging.getLogger(LOGGER)
_stdlib.addHandler(logging.NullHandler())  # as the standard library advises libraries: no
# "last resort" output of WARNING events to stderr while the application configured nothing

_plain = structlog.wrap_logger(
    _stdlib,
    wrapper_class=structlog.stdlib.BoundLogger,
    processors=[
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
    ],
)
"""Used while structlog is not configured: the event dict becomes the record's message."""

_configured = structlog.wrap_logger(_stdlib, cache_logger_on_first_use=False)
"""Used once structlog is configured: its wrapper class and processors, read at each call."""


_session: ContextVar[str | None] = ContextVar("stepmachine_session", default=None)


class session:  # noqa: N801 - used like a function: ``with session(id):``
    """Within the block, events that name no session name ``session_id`` (a run's scope).

    A model's ``model_retry`` events, for instance, happen below the step and
    know no session; inside a run they carry the run's.
    """

    __slots__ = ("_session_id", "_token")

    def __init__(self, session_id: str) -> None:
        self._session_id = session_id

    def __enter__(self) -> None:
        self._token = _session.set(self._session_id)

    def __exit__(self, *exc_info: object) -> None:
        _session.reset(self._token)


def enabled(level: int) -> bool:
    """Whether an event at ``level`` would go anywhere (cheap: check before building fields)."""
    return structlog.is_configured() or _stdlib.isEnabledFor(level)


def event(level: int, name: str, **fields: Any) -> None:
    """Log event ``name`` at ``level`` with ``fields`` (see the module docs for the route)."""
    if "session_id" not in fields:
        current = _session.get()
        if current is not None:
            fields["session_id"] = current
    try:
        if structlog.is_configured():
            _configured.log(level, name, **fields)
        elif _stdlib.isEnabledFor(level):
            _plain.log(level, name, **fields)
    except Exception:  # noqa: BLE001 - see _report_broken_logging
        _report_broken_logging(name)


def failure(message: str, **fields: Any) -> None:
    """Log the exception being handled at ERROR, with ``fields``."""
    try:
        if structlog.is_configured():
            _configured.exception(message, **fields)
        elif _stdlib.isEnabledFor(logging.ERROR):
            _plain.exception(message, **fields)
    except Exception:  # noqa: BLE001 - see _report_broken_logging
        _report_broken_logging(message)


def _report_broken_logging(name: str) -> None:
    """A processor or handler raised while logging event ``name``: never the run's problem.

    Logging must not change what a run does (an exception here could land
    between a tool returning and its result being recorded). Like the standard
    library's ``Handler.handleError``, the failure is written to stderr (with
    its traceback when ``logging.raiseExceptions`` is on) and dropped.
    """
    stream = sys.stderr
    if not logging.raiseExceptions or stream is None:
        return
    try:
        stream.write(f"--- stepmachine: logging event {name!r} failed ---\n")
        traceback.print_exc(file=stream)
    except Exception:  # noqa: BLE001, S110 - stderr is gone (a broken pipe): nothing more to do
        pass
