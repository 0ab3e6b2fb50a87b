"""``resolve_model``: a model string such as ``"openai:gpt-4.1-mini"`` to an adapter.

The strings the front door (:class:`~stepmachine.Agent`) and the demo accept:

=============================  ================================  ==============================
string                         adapter                           configuration
=============================  ================================  ==============================
``openai:<model>``             :class:`OpenAIChatModel`          ``OPENAI_API_KEY``
``openai-responses:<model>``   :class:`OpenAIResponsesModel`     ``OPENAI_API_KEY``
``anthropic:<model>``          :class:`AnthropicModel`           ``ANTHROPIC_API_KEY``
``gemini:<model>``             :class:`GeminiModel`              ``GEMINI_API_KEY``
``openai-compatible:<model>``  :class:`OpenAICompatibleModel`    ``OPENAI_COMPATIBLE_BASE_URL``
``scripted``                   an offline stand-in               none
=============================  ================================  ==============================

Keys and base URLs come from the environment as each adapter documents; a
string names the provider and the model only, never a key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .._errors import ConfigurationError
from .._messages import Message, TextPart
from .._model import Model, ModelRequest, ModelResponse
from ._anthropic import AnthropicModel
from ._gemini import GeminiModel
from ._http import HTTPModel
from ._openai_chat import OpenAIChatModel, OpenAICompatibleModel
from ._openai_responses import OpenAIResponsesModel

__all__ = ["SCRIPTED_NAME", "model_strings", "resolve_model"]

SCRIPTED_NAME = "scripted (offline stand-in: no model was asked)"
"""The name the ``"scripted"`` model reports, so output made with it says so."""

_ADAPTERS: dict[str, Callable[[str], HTTPModel]] = {
    "openai": OpenAIChatModel,
    "openai-responses": OpenAIResponsesModel,
    "anthropic": AnthropicModel,
    "gemini": GeminiModel,
    "openai-compatible": OpenAICompatibleModel,
}


def model_strings() -> tuple[str, ...]:
    """The provider prefixes :func:`resolve_model` knows, and ``"scripted"``."""
    return (*_ADAPTERS, "scripted")


def resolve_model(text: str) -> Model:
    """The model a string names: ``"<provider>:<model>"``, or ``"scripted"``.

    An HTTP adapter is built but not contacted: a missing key is refused with a
    :class:`~stepmachine.ConfigurationError` before any request is sent (at
    once for ``openai``, at the first request for the others, as each adapter
    documents), a missing base URL for ``openai-compatible`` at once. The caller
    owns the adapter: close it with ``await model.aclose()`` when done
    (:class:`~stepmachine.Agent` does).

    ``"scripted"`` is an offline stand-in for demos and tests: it answers each
    question with one sentence that quotes it and says no model was asked, and
    never calls a tool. For a scripted conversation with tool calls, pass a
    :class:`~stepmachine.testing.ScriptedModel` instead of a string.

    Raises:
        ConfigurationError: the string names no known provider, or no model
            after the colon; the message lists the strings that work.
    """
    provider, name = parse_model_string(text)
    if provider == "scripted":
        return _scripted()
    return _ADAPTERS[provider](name)


def parse_model_string(text: str) -> tuple[str, str]:
    """``(provider, model)`` for a model string (``("scripted", "")`` for ``"scripted"``).

    Raises:
        ConfigurationError: as :func:`resolve_model`.
    """
    if text.strip() == "scripted":
        return "scripted", ""
    provider, colon, name = text.partition(":")
    provider = provider.strip().lower()
    if provider not in _ADAPTERS or not colon or not name.strip():
        known = ", ".join(f"'{p}:<model>'" for p in _ADAPTERS)
        raise ConfigurationError(
            f"unknown model string {text!r}: write '<provider>:<model>', one of {known}"
            " (e.g. 'openai:gpt-4.1-mini'), or 'scripted' for the offline stand-in;"
            " or pass a Model object"
        )
    return provider, name.strip()


def _scripted() -> Model:
    from ..testing import FunctionModel  # noqa: PLC0415 - the testing kit, only when asked for

    def answer(request: ModelRequest) -> ModelResponse:
        question = _last_user_text(request.messages)
        text = (
            f"(scripted reply: no model was asked) You said: {question}"
            if question
            else "(scripted reply: no model was asked)"
        )
        return ModelResponse(parts=(TextPart(text),), finish_reason="stop")

    return FunctionModel(answer, name=SCRIPTED_NAME)


def _last_user_text(messages: Sequence[Message]) -> str:
    """The text of the last user message (searched from the end: O(distance from it))."""
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].role == "user":
            return messages[index].text
    return ""
