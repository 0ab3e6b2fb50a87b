"""OpenAI Chat Completions and OpenAI-compatible servers -- being written."""

from __future__ import annotations

from ._http import HTTPModel

__all__ = ["OpenAIChatModel", "OpenAICompatibleModel"]


class OpenAIChatModel(HTTPModel):
    """Placeholder."""


class OpenAICompatibleModel(OpenAIChatModel):
    """Placeholder."""
