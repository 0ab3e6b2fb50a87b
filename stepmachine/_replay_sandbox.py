"""The sandbox of one replayed cycle: a runtime that writes, runs and calls nothing outside.

:func:`~stepmachine.replay` offers each stored cycle's session to the new
steps with :meth:`Sandbox.runtime`. The :class:`Sandbox` is that runtime's
loader and effect handler (an in-memory copy of the session, so a step that
commits writes there), its clock, its id source, its tool caller and, unless
the caller gave a model, its model. It records what happened that the
comparison must know: the batches committed, the clock readings, the calls
answered without a recorded result, and a model call it had no reply for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

from ._codec import Batch
from ._effects import Effect, apply_batch
from ._errors import ConflictError, ModelError, SessionNotFoundError
from ._messages import Message, ToolCallPart, ToolResultPart
from ._model import ChunkSink, Model, ModelRequest, ModelResponse
from ._runtime import Runtime
from ._session import Session
from ._telemetry import Telemetry
from ._tools import ToolContext

try:
    from opentelemetry.trace import NoOpTracerProvider as _NoSpans
except ImportError:  # pragma: no cover - without OpenTelemetry there are no spans anyway
    _NoSpans = None  # type: ignore[assignment,misc]

__all__ = ["NoRecordedReplyError", "Sandbox"]

_QUIET = Telemetry() if _NoSpans is None else Telemetry(tracer_provider=_NoSpans())
"""A replay is not a run to trace: its telemetry makes no spans."""


class NoRecordedReplyError(ModelError):
    """The replay's model was asked where the stored cycle holds no (further) model reply."""


class Sandbox:
    """Loader, effect handler, clock, id source, tool caller and model of one replayed cycle.

    Args:
        session: the session before the stored cycle.
        timestamps: the stored cycle's batch timestamps; the clock returns the
            one of the batch about to be written (the last one after that), once
            the cycle wrote a batch.
        start: the stamp of the batch before the cycle (``-inf``: none): the
            clock's reading before the cycle wrote anything.
        ids: the ids of the messages the stored cycle added, in order; the
            id source returns them, then ``replay-<revision>-<n>``.
        results: call id -> the stored result the tool caller answers with.
        reply: the model reply the stored cycle holds, answered once (or the failure
            it recorded, raised once).
        landed: batches from outside a machine that landed inside the stored
            cycle, each with how many of the cycle's batches were written
            before it. Such a batch is applied to the copy when the step
            commits again after that many batches (so the commit conflicts, as
            the stored one did, and the step reloads the session holding it).
        cut_after: the stored cycle's batch count when its run had no next cycle
            (it may have stopped inside the cycle: a crash); ``None`` otherwise.
        answered: the call ids whose results the stored cycle itself recorded.
        replies: the model replies (or recorded failures) the stored cycle holds
            (0 or 1): a model asked more often than that, once every stored
            batch is written, asks for what the stored run never recorded
            (``stopped_at``), whoever answers (the sandbox, or a given model).

    Attributes:
        batches: the batches committed to the sandbox, in order.
        readings: every value the clock returned.
        returned_ids: every id the id source returned.
        unrecorded: the calls (``'id' (tool)``) answered "no recorded result".
        asked_model: the model was asked for a reply it did not have.
        stopped_at: with ``cut_after``: the batches written when the new steps
            first asked, with every stored batch written, for what the stored
            cycle never recorded (a model reply; a result recorded only later,
            by another run): where the stored run may have stopped.
    """

    applies_batches: ClassVar[bool] = True

    def __init__(
        self,
        session: Session[Any],
        timestamps: list[float],
        ids: Iterable[str],
        results: Mapping[str, ToolResultPart | Message],
        reply: ModelResponse | BaseException | None,
        start: float = float("-inf"),
        landed: Sequence[tuple[int, Batch[Effect]]] = (),
        cut_after: int | None = None,
        answered: frozenset[str] = frozenset(),
        replies: int = 0,
    ) -> None:
        self.session = session
        self.batches: list[Batch[Effect]] = []
        self.readings: set[float] = set()
        self.returned_ids: set[str] = set()
        self._landed = list(landed)
        self.unrecorded: list[str] = []
        self.asked_model = False
        self._timestamps = timestamps
        self._start = start if math.isfinite(start) else None
        self._ids: Iterator[str] = iter(ids)
        self._fresh = 0
        self._results = results
        self._reply = reply
        self._cut_after = cut_after
        self._answered = answered
        self._replies = replies
        self._asked = 0
        self.stopped_at: int | None = None

    def asking_model(self) -> None:
        """The new steps ask a model (the sandbox, or a given one): count it (see ``replies``)."""
        self._asked += 1
        if self._asked > self._replies:
            self._beyond()

    def _beyond(self) -> None:
        """The new steps ask for what the stored cycle never recorded: note where, if its
        run may have stopped there (see ``stopped_at``)."""
        written = len(self.batches)
        if self.stopped_at is None and self._cut_after is not None and written >= self._cut_after:
            self.stopped_at = written

    def runtime(self, model: Model | None, services: Mapping[str, Any]) -> Runtime:
        """The runtime the new steps get: ``model`` (or the sandbox) answers under every name."""
        answering: Model = self if model is None else _Given(model, self)
        return Runtime(
            loader=self,
            handler=self,
            model=answering,
            models=_EveryName(answering),
            clock=self.clock,
            ids=self.new_id,
            services=services,
            telemetry=_QUIET,
            tool_caller=self.call_tool,
            model_override=answering,  # a step's own model (a judge) is answered here too
        )

    # -- loader and effect handler ----------------------------------------------------

    async def load(self, session_id: str) -> Session[Any]:
        if session_id != self.session.id:
            raise SessionNotFoundError(session_id)
        return self.session

    async def apply(self, batch: Batch[Effect]) -> Session[Any]:
        """Apply ``batch`` to the copy (compare-and-set on its revision) and record it.

        The batches from outside that landed before it in the stored cycle are
        applied first (see ``landed``); a batch read before them conflicts.
        """
        if batch.session_id != self.session.id:
            raise SessionNotFoundError(batch.session_id)
        while self._landed and self._landed[0][0] <= len(self.batches):
            _, outside = self._landed.pop(0)
            self.session = apply_batch(self.session, outside.effects)
        if batch.revision != self.session.revision + 1:
            raise ConflictError(batch.session_id, batch.revision - 1, self.session.revision)
        self.session = apply_batch(self.session, batch.effects)
        self.batches.append(batch)
        return self.session

    # -- clock, ids, tools, model -----------------------------------------------------

    def clock(self) -> float:
        """Before the cycle wrote anything: when the stored cycle began (the stamp of the
        batch before it), so a decision taken then (an approval's expiry) is taken at the
        same moment; afterwards, the stamp of the batch about to be written."""
        if not self.batches and self._start is not None:
            reading = self._start
        else:
            reading = self._timestamps[min(len(self.batches), len(self._timestamps) - 1)]
        self.readings.add(reading)
        return reading

    def new_id(self) -> str:
        """The next id the stored cycle added, then ``replay-<revision>-<n>``; recorded."""
        made = next(self._ids, None)
        if made is None:
            self._fresh += 1
            made = f"replay-{self.session.revision}-{self._fresh}"
        self.returned_ids.add(made)
        return made

    async def call_tool(self, call: ToolCallPart, context: ToolContext) -> ToolResultPart | Message:
        """The stored result of ``call`` (the tool message holding it when it carries
        images or documents), or an error result saying there is none."""
        if call.call_id not in self._answered:
            self._beyond()
        result = self._results.get(call.call_id)
        if result is not None:
            return result
        self.unrecorded.append(f"{call.call_id!r} ({call.name})")
        return ToolResultPart.for_call(
            call, f"replay: tool call {call.call_id!r} has no recorded result", is_error=True
        )

    @property
    def name(self) -> str:
        return "replay"

    async def request(
        self, request: ModelRequest, *, on_chunk: ChunkSink | None = None
    ) -> ModelResponse:
        """The stored reply, once; no chunks (streaming only adds events).

        Raises:
            NoRecordedReplyError: there is no (further) stored reply.
        """
        self.asking_model()
        reply, self._reply = self._reply, None
        if isinstance(reply, BaseException):
            raise reply  # the failure the stored cycle recorded (a context-length error)
        if reply is None:
            self.asked_model = True
            raise NoRecordedReplyError("replay: the stored cycle holds no (further) model reply")
        allowed = request.max_attempts
        if allowed is not None and reply.attempts > allowed:
            # A budget allows fewer model calls than the stored reply took (exact budgets).
            raise NoRecordedReplyError(
                f"replay: the stored reply took {reply.attempts} model calls; the new "
                f"pipeline's request allows {allowed}"
            )
        return reply


class _Given:
    """A model given to the replay (``model=``), its calls counted by the sandbox (see
    ``Sandbox.asking_model``); everything else is the model's own."""

    def __init__(self, model: Model, sandbox: Sandbox) -> None:
        self._model = model
        self._sandbox = sandbox

    @property
    def name(self) -> str:
        return self._model.name

    async def request(
        self, request: ModelRequest, *, on_chunk: ChunkSink | None = None
    ) -> ModelResponse:
        self._sandbox.asking_model()
        return await self._model.request(request, on_chunk=on_chunk)

    def __getattr__(self, name: str) -> Any:  # max_attempts, reports_attempts, ...
        return getattr(self._model, name)


class _EveryName(Mapping[str, Model]):
    """``Runtime.models`` in a replay: the one answering model under every name."""

    def __init__(self, model: Model) -> None:
        self._model = model

    def __getitem__(self, name: str) -> Model:
        return self._model

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0
