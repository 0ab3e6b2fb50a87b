"""The provider-neutral model protocol.

A :class:`Model` takes a :class:`ModelRequest` and returns a
:class:`ModelResponse`. Streaming is not a second code path: when the caller
passes ``on_chunk``, the model also hands each :data:`StreamChunk` to it as it
arrives, and still returns the same assembled response. That is how "same
behaviour streaming or not" holds by construction: effects are built from
the returned response only, chunks only feed the emitter.

Provider adapters (OpenAI, Anthropic, ...) implement :class:`Model`; the
testing kit ships scripted and function-driven models.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, Protocol, TypeAlias

import msgspec

from ._conversation import Conversation
from ._messages import Message, Part

__all__ = [
    "ChunkSink",
    "Model",
    "ModelRequest",
    "ModelResponse",
    "ModelSettings",
    "PromptPart",
    "ReasoningChunk",
    "StreamChunk",
    "TextChunk",
    "ToolCallChunk",
    "ToolDefinition",
    "Usage",
]


class ToolDefinition(msgspec.Struct, frozen=True):
    """A tool as advertised to the model.

    Attributes:
        name: unique across all steps of a machine.
        description: what the model is told the tool does.
        parameters: JSON schema of the arguments object.
    """

    name: str
    description: str
    parameters: dict[str, Any]


class PromptPart(msgspec.Struct, frozen=True):
    """A piece of system prompt contributed by a step.

    Attributes:
        source: the name of the step that contributed it.
        text: the text; parts are joined in step order.
    """

    source: str
    text: str


class ModelSettings(msgspec.Struct, frozen=True):
    """Sampling settings; ``None`` leaves the provider's default."""

    max_tokens: int | None = None
    temperature: float | None = None
    extra: dict[str, Any] = msgspec.field(default_factory=dict)


class ModelRequest(msgspec.Struct, frozen=True):
    """What a model is asked.

    Attributes:
        messages: the messages visible to the model, oldest first, as a tuple
            (a list or the session's :class:`~stepmachine.Conversation` is
            copied into one), so a request is a plain value that
            ``msgspec.json.encode(request)`` encodes without hooks. The copy is
            a tuple of pointers, O(history) per model call like the request the
            adapter then sends. The history is provider-valid (valid history)
            when built by ``ModelInference``.
        tools: the tool definitions collected from every step.
        prompt_parts: system prompt parts collected from every step.
        settings: sampling settings.
        output_schema: when set, ask the provider's native structured-output
            mode for a JSON value matching this schema (``output_name`` names it).
        max_attempts: the most attempts (first try plus retries) the model may
            make for this request; ``None`` leaves it to the model. Set by
            budgets, so that a budget of N calls means N, retries included.
        purpose: what the request is for. :attr:`TURN` (the default) is the
            conversation's next reply; anything else names a side request
            (``Compaction``'s summariser sends ``"summary"``). Request shapers
            (``shape_request``) see both; in a side request the machine keeps
            the asker's messages, tools and output schema, so only settings,
            ``max_attempts`` and prompt parts can be shaped (a native output
            schema is the shape of the final answer, not of a summary). Model
            adapters ignore it.
    """

    TURN: ClassVar[str] = "turn"
    """The purpose of the conversation's own requests."""

    messages: Sequence[Message]  # a tuple once built (see __post_init__)
    tools: tuple[ToolDefinition, ...] = ()
    prompt_parts: tuple[PromptPart, ...] = ()
    settings: ModelSettings = msgspec.field(default_factory=ModelSettings)
    output_schema: dict[str, Any] | None = None
    output_name: str = "output"
    max_attempts: int | None = None
    purpose: str = "turn"

    def __post_init__(self) -> None:
        messages = self.messages
        if type(messages) is not tuple:
            # A list, a conversation or another sequence becomes a tuple: the request
            # holds no value its sender may still change, and it encodes with plain
            # msgspec (a tuple of pointers: the copy is a small part of a model call,
            # which sends every one of these messages anyway).
            copied = messages.as_tuple() if isinstance(messages, Conversation) else tuple(messages)
            msgspec.structs.force_setattr(self, "messages", copied)

    @property
    def system_prompt(self) -> str:
        """The prompt parts joined by blank lines."""
        return "\n\n".join(p.text for p in self.prompt_parts if p.text)


class Usage(msgspec.Struct, frozen=True):
    """Token counts reported by the provider (0 when unknown)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    reasoning_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            cache_read_tokens=self.cache_read_tokens + other.cache_read_tokens,
            cache_write_tokens=self.cache_write_tokens + other.cache_write_tokens,
            reasoning_tokens=self.reasoning_tokens + other.reasoning_tokens,
        )


class ModelResponse(msgspec.Struct, frozen=True):
    """What a model answered: the parts of one assistant message.

    Attributes:
        parts: text, reasoning and tool-call parts, in order.
        usage: token counts.
        finish_reason: the provider's stop reason, normalised where known
            (``"stop"``, ``"tool_calls"``, ``"length"``, ...).
        model: the model name the provider reported.
        attempts: how many attempts the model made (1 plus retries); budgets
            count every attempt.
    """

    parts: tuple[Part, ...]
    usage: Usage = msgspec.field(default_factory=Usage)
    finish_reason: str | None = None
    model: str | None = None
    attempts: int = 1


class TextChunk(msgspec.Struct, frozen=True, tag_field="type", tag="text"):
    """A delta of assistant text."""

    text: str


class ReasoningChunk(msgspec.Struct, frozen=True, tag_field="type", tag="reasoning"):
    """A delta of reasoning text."""

    text: str


class ToolCallChunk(msgspec.Struct, frozen=True, tag_field="type", tag="tool_call"):
    """A delta of one tool call; ``index`` orders calls within the response."""

    index: int
    call_id: str | None = None
    name: str | None = None
    arguments_delta: str = ""


StreamChunk: TypeAlias = TextChunk | ReasoningChunk | ToolCallChunk
ChunkSink: TypeAlias = Callable[[StreamChunk], Awaitable[None]]


class Model(Protocol):
    """Anything that answers a :class:`ModelRequest`.

    Implementations must return the same response whether or not ``on_chunk``
    is given (same behaviour streaming or not); chunks are for display only.
    """

    @property
    def name(self) -> str:
        """A name for logs and notes, such as ``"openai:gpt-4.1"``."""
        ...

    async def request(
        self, request: ModelRequest, *, on_chunk: ChunkSink | None = None
    ) -> ModelResponse:
        """Answer ``request``.

        Raises:
            ModelError: the provider failed (adapters raise typed subclasses).

        On cancellation the call is abandoned; chunks already handed to
        ``on_chunk`` stay delivered.
        """
        ...
