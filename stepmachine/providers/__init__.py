"""Provider adapters over httpx: real models behind the kernel's ``Model`` protocol.

Each adapter maps the provider-neutral :class:`~stepmachine.ModelRequest` to
the provider's wire format and the reply back to kernel message parts (text,
tool calls with parsed arguments and the raw string, reasoning with its
opaque round-trip data, usage, finish reason), blocking or streaming with the
same result, with typed errors and replay-safe retries (see
:class:`HTTPModel` and :class:`RetryPolicy`).

Configuration comes from arguments, with environment variables as defaults:

=========================  ==========================  ===============================
adapter                    key                         base URL
=========================  ==========================  ===============================
``OpenAIChatModel``        ``OPENAI_API_KEY``          ``OPENAI_BASE_URL``
``OpenAIResponsesModel``   ``OPENAI_API_KEY``          ``OPENAI_BASE_URL``
``AnthropicModel``         ``ANTHROPIC_API_KEY``       ``ANTHROPIC_BASE_URL``
``OpenAICompatibleModel``  ``OPENAI_COMPATIBLE_API_KEY``  ``OPENAI_COMPATIBLE_BASE_URL``
``GeminiModel``            ``GEMINI_API_KEY`` or       ``GEMINI_BASE_URL``
                           ``GOOGLE_API_KEY``
=========================  ==========================  ===============================
"""

from stepmachine._public import publish as _publish

from ._anthropic import AnthropicModel
from ._errors import (
    AuthenticationError,
    BadRequestError,
    ContextLengthExceededError,
    MalformedResponseError,
    NotFoundError,
    OverloadedError,
    PermissionDeniedError,
    ProviderConnectionError,
    ProviderError,
    QuotaExceededError,
    RateLimitError,
    RedactedCauseError,
    ServerError,
)
from ._gemini import GeminiModel
from ._http import DEFAULT_TIMEOUT, HTTPModel, RetryPolicy, Secret, SSEEvent
from ._openai_chat import OpenAIChatModel, OpenAICompatibleModel
from ._openai_responses import OpenAIResponsesModel
from ._resolve import resolve_model

__all__ = [
    "DEFAULT_TIMEOUT",
    "AnthropicModel",
    "AuthenticationError",
    "BadRequestError",
    "ContextLengthExceededError",
    "GeminiModel",
    "HTTPModel",
    "MalformedResponseError",
    "NotFoundError",
    "OpenAIChatModel",
    "OpenAICompatibleModel",
    "OpenAIResponsesModel",
    "OverloadedError",
    "PermissionDeniedError",
    "ProviderConnectionError",
    "ProviderError",
    "QuotaExceededError",
    "RateLimitError",
    "RedactedCauseError",
    "RetryPolicy",
    "SSEEvent",
    "Secret",
    "ServerError",
    "resolve_model",
]

_publish(__name__, globals())
