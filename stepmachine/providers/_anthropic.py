"""Anthropic Messages API -- being written."""

from __future__ import annotations

from ._http import HTTPModel

__all__ = ["AnthropicModel"]


class AnthropicModel(HTTPModel):
    """Placeholder."""
