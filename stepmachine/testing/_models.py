"""Fake models: scripted turns, or a function deciding each turn.

Both stream a response by cutting it into chunks (with a checkpoint between
chunks, so cancellation can land mid-stream) and return the same assembled
response whether or not a chunk sink is given (same behaviour streaming or not).
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import anyio.lowlevel
import msgspec

from stepmachine import (
    ModelRequest,
    ModelResponse,
    ReasoningPart,
    TextPart,
    ToolCallPart,
    UnexpectedModelCallError,
    Usage,
)
from stepmachine._async import checkpoint
from stepmachine._model_call import attempt_started
from stepmachine.extend import ChunkSink, Part, ReasoningChunk, TextChunk, ToolCallChunk

__all__ = ["FunctionModel", "ScriptedModel", "call", "reply", "stream_response"]


def reply(text: str, *, reasoning: str | None = None, usage: Usage | None = None) -> ModelResponse:
    """A response holding ``text`` (after optional ``reasoning``)."""
    parts: list[Any] = []
    if reasoning is not None:
        parts.append(ReasoningPart(text=reasoning))
    parts.append(TextPart(text))
    return ModelResponse(
        parts=tuple(parts),
        usage=usage or Usage(input_tokens=10, output_tokens=5),
        finish_reason="stop",
    )


def call(*calls: tuple[str, dict[str, Any]] | ToolCallPart, text: str = "") -> ModelResponse:
    """A response asking for tool calls: ``call(("add", {"a": 1, "b": 2}))``.

    Calls given as ``(name, arguments)`` get ids from the scripted model
    (``call-<turn>-<index>``; see :class:`ScriptedModel`). Pass a :class:`ToolCallPart`
    for full control, for example invalid JSON via ``ToolCallPart.parse(id, name, raw)``.
    """
    parts: list[Any] = [TextPart(text)] if text else []
    for item in calls:
        if isinstance(item, ToolCallPart):
            parts.append(item)
        else:
            name, arguments = item
            parts.append(ToolCallPart.of("", name, arguments))
    return ModelResponse(
        parts=tuple(parts),
        usage=Usage(input_tokens=10, output_tokens=5),
        finish_reason="tool_calls",
    )


_KEY_TAIL = 8
"""How many of the last message ids :func:`_history_key` digests."""


def _history_key(request: ModelRequest) -> str:
    """A short digest of the request's history: the same history, the same key.

    Digests the number of messages and the ids of the first and of the last
    ``_KEY_TAIL`` messages: O(1) per request, like the model call it stands
    for costs the machine nothing per message, and still different for any two
    requests of one growing session (the count differs) or after a compaction
    (new ids). Message ids are unique within a session.
    """
    messages = request.messages
    ids = [str(len(messages))]
    if messages:
        ids.append(messages[0].id)
        ids.extend(m.id for m in messages[-_KEY_TAIL:])
    return hashlib.sha256("\x00".join(ids).encode()).hexdigest()[:10]


def _holds_calls(request: ModelRequest) -> bool:
    """Whether the request's history holds any tool call (checked once per model: O(n))."""
    return any(part.tool_calls for part in request.messages)


def _number_calls(response: ModelResponse, turn: Callable[[], int | str]) -> ModelResponse:
    """``response`` with an id (``call-<turn>-<index>``) given to each tool call that has
    none; ``turn()`` is asked only when one has none."""
    if not any(isinstance(p, ToolCallPart) and not p.call_id for p in response.parts):
        return response
    key = turn()
    parts: list[Part] = []
    index = 0
    changed = False
    for part in response.parts:
        if isinstance(part, ToolCallPart):
            if not part.call_id:
                parts.append(msgspec.structs.replace(part, call_id=f"call-{key}-{index}"))
                changed = True
                index += 1
                continue
            index += 1
        parts.append(part)
    return msgspec.structs.replace(response, parts=tuple(parts)) if changed else response


async def stream_response(
    response: ModelResponse, on_chunk: ChunkSink, chunk_size: int = 8
) -> None:
    """Hand ``response`` to ``on_chunk`` as chunks, with a checkpoint before each."""
    tool_index = 0
    for part in response.parts:
        if isinstance(part, TextPart | ReasoningPart):
            text = part.text
            for start in range(0, max(len(text), 1), chunk_size):
                await anyio.lowlevel.checkpoint()
                piece = text[start : start + chunk_size]
                if isinstance(part, TextPart):
                    await on_chunk(TextChunk(piece))
                else:
                    await on_chunk(ReasoningChunk(piece))
        elif isinstance(part, ToolCallPart):
            raw = part.raw_arguments
            await anyio.lowlevel.checkpoint()
            await on_chunk(ToolCallChunk(tool_index, part.call_id, part.name, raw[:chunk_size]))
            for start in range(chunk_size, len(raw), chunk_size):
                await anyio.lowlevel.checkpoint()
                await on_chunk(
                    ToolCallChunk(tool_index, arguments_delta=raw[start : start + chunk_size])
                )
            tool_index += 1
    await anyio.lowlevel.checkpoint()


Turn = ModelResponse | str | Callable[[ModelRequest], ModelResponse]


class ScriptedModel:
    """A model that answers with scripted turns, in order.

    A turn is a :class:`ModelResponse`, a ``str`` (a plain text reply), or a
    function of the request returning a response. Calling the model after the
    last turn raises :class:`UnexpectedModelCallError`, naming the call and
    the last message; :attr:`unused` lists turns never reached, and
    :meth:`assert_all_used` fails loudly when there are any.

    Tool calls without ids get ``call-<turn>-<index>`` (``turn`` counts this
    model's requests from 0). When the model's first request already holds
    tool calls -- the script continues a stored session, e.g. in a new process
    -- they get ``call-<key>-<index>`` instead, ``key`` a digest of the history
    (as :class:`FunctionModel` does), so a script started afresh never repeats
    an id the session holds (call ids are unique: valid history).

    Attributes:
        requests: every request received, in order.
    """

    reports_attempts = True  # each attempt sent is reported (exact budgets)

    def __init__(
        self, turns: Iterable[Turn], *, name: str = "scripted", chunk_size: int = 8
    ) -> None:
        self._turns: list[Turn] = list(turns)
        self._name = name
        self._chunk_size = chunk_size
        self.requests: list[ModelRequest] = []
        self._continues = False  # the first request held tool calls: ids from the history

    @property
    def name(self) -> str:
        """``"scripted"`` unless named otherwise."""
        return self._name

    @property
    def unused(self) -> list[Turn]:
        """The turns not yet used."""
        return self._turns[len(self.requests) :]

    def assert_all_used(self) -> None:
        """Raise ``AssertionError`` listing the turns never reached."""
        if self.unused:
            raise AssertionError(
                f"{self._name}: {len(self.unused)} scripted turn(s) never used: {self.unused!r}"
            )

    async def request(
        self, request: ModelRequest, *, on_chunk: ChunkSink | None = None
    ) -> ModelResponse:
        """Answer with the next turn; stream it to ``on_chunk`` when given.

        Raises:
            UnexpectedModelCallError: no turn is left.
        """
        await checkpoint()
        attempt_started()
        turn_number = len(self.requests)
        if turn_number >= len(self._turns):
            last = request.messages[-1] if request.messages else None
            raise UnexpectedModelCallError(
                f"{self._name}: unexpected model call #{turn_number + 1}; the script has "
                f"{len(self._turns)} turn(s). Last message: {last!r}"
            )
        self.requests.append(request)
        turn = self._turns[turn_number]
        if isinstance(turn, str):
            response = reply(turn)
        elif isinstance(turn, ModelResponse):
            response = turn
        else:
            response = turn(request)
        if turn_number == 0:
            self._continues = _holds_calls(request)
        continues = self._continues
        response = _number_calls(
            response, lambda: _history_key(request) if continues else turn_number
        )
        if on_chunk is not None:
            await stream_response(response, on_chunk, self._chunk_size)
        return response


class FunctionModel:
    """A model whose every answer is computed by ``fn(request)`` (sync or async).

    Stateless unless ``fn`` keeps state: the natural choice for tests where a
    fresh process or a fresh machine must get the same answer for the same
    history. Tool calls without ids get ``call-<key>-<index>`` where ``key`` is
    a digest of the request's length and its first and last message ids
    (O(1) per request): the same history gives the same ids, and the
    histories of one session (which grow, or shrink by a compaction that
    brings new ids) different ones.
    """

    reports_attempts = True  # each attempt sent is reported (exact budgets)

    def __init__(
        self,
        fn: Callable[[ModelRequest], ModelResponse | Awaitable[ModelResponse]],
        *,
        name: str = "function",
        chunk_size: int = 8,
    ) -> None:
        self._fn = fn
        self._name = name
        self._chunk_size = chunk_size
        self.calls = 0

    @property
    def name(self) -> str:
        """``"function"`` unless named otherwise."""
        return self._name

    async def request(
        self, request: ModelRequest, *, on_chunk: ChunkSink | None = None
    ) -> ModelResponse:
        """Answer with ``fn(request)``; stream it to ``on_chunk`` when given."""
        await checkpoint()
        attempt_started()
        self.calls += 1
        result = self._fn(request)
        response = await result if inspect.isawaitable(result) else result
        response = _number_calls(response, lambda: _history_key(request))
        if on_chunk is not None:
            await stream_response(response, on_chunk, self._chunk_size)
        return response
