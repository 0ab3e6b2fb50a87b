"""The contract between the conformance harness and each provider's spec.

One spec module per provider folder of recordings (``spec_openai_chat.py``,
``spec_openai_responses.py``, ``spec_anthropic.py``, ``spec_gemini.py``; ``openai_compatible``
uses a second spec object in ``spec_openai_chat.py``). Each defines
``SPECS: dict[str, ProviderSpec]`` keyed by folder name. The harness
(``conformance.py``) loads every cassette, serves its interactions through
``httpx.MockTransport``, and for each interaction:

1. ``decode_request(recorded_body)`` gives the provider-neutral request the
   recording shows (and whether it streamed); it raises :class:`UnsupportedPartError`
   for a part the neutral request cannot hold, never dropping it;
2. the adapter from ``make_model(client, model_name)`` sends it;
3. ``request_differences(sent, recorded)`` lists differences on the fields
   that matter (compared as parsed JSON; empty list = match);
4. ``expect(status, body, headers, streamed)`` derives, from the recorded
   response alone, what the adapter must return (or raise);
5. the harness compares the adapter's result with that expectation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from stepmachine import ModelRequest
from stepmachine.providers import HTTPModel, ProviderError


class UnsupportedPartError(ValueError):
    """A recorded request holds a part the neutral request cannot hold (a file named by an
    upload id, a server-side block, ...); images, documents and audio are media parts.

    ``decode_request`` raises it instead of dropping the part: the harness then fails
    the file loudly, naming the part, since replaying the rest would test a request
    the recording never made.
    """


@dataclass(frozen=True)
class ExpectedCall:
    """A tool call the response must contain."""

    name: str
    arguments: Any  # parsed JSON
    call_id: str | None = None  # None: any id


@dataclass(frozen=True)
class Expected:
    """What the adapter must make of one recorded response."""

    text: str = ""
    tool_calls: tuple[ExpectedCall, ...] = ()
    reasoning: bool | None = None  # True: some reasoning part; None: don't check
    input_tokens: int | None = None
    output_tokens: int | None = None
    reasoning_tokens: int | None = None  # None: not reported, don't check
    finish_reason: str | None = None  # normalised; None: don't check
    error: type[ProviderError] | None = None  # the typed error to raise instead
    notes: tuple[str, ...] = field(default_factory=tuple)  # what the spec chose to skip, and why


@dataclass(frozen=True)
class ProviderSpec:
    """How to drive one provider's adapter from its recordings."""

    folder: str
    # e.g. "/chat/completions" (or several: Gemini's ":generateContent" and
    # ":streamGenerateContent"): a model call's path ends with it; interactions to other
    # paths (``GET /models`` before the first call, ...) are not model calls and are skipped
    path_suffix: str | tuple[str, ...]
    make_model: Callable[[httpx.AsyncClient, str], HTTPModel]
    decode_request: Callable[[dict[str, Any]], tuple[ModelRequest, bool]]
    request_differences: Callable[[dict[str, Any], dict[str, Any]], list[str]]
    expect: Callable[[int, bytes, httpx.Headers, bool], Expected]
    # Optional, for providers that put the model and the streaming switch in the URL rather
    # than the body (Gemini: ``.../models/<m>:streamGenerateContent?alt=sse``):
    # the adapter for a recorded call, from its first interaction (model, Vertex project...);
    # None: ``make_model(client, body["model"])``
    model_for: Callable[[httpx.AsyncClient, Any], HTTPModel] | None = None
    # whether a recorded call streamed, from its URL; None: as ``decode_request`` says
    streamed_in_url: Callable[[str], bool] | None = None
    # problems with the request the adapter sent (URL, headers) against the recorded
    # interaction; None: only the body is compared
    check_request: Callable[[httpx.Request, Any], list[str]] | None = None
