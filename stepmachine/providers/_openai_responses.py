"""OpenAI Responses API -- being written."""

from __future__ import annotations

from ._http import HTTPModel

__all__ = ["OpenAIResponsesModel"]


class OpenAIResponsesModel(HTTPModel):
    """Placeholder."""
