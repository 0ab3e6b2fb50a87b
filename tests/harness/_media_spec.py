"""Reading media out of recorded requests, for the spec modules (written apart from the adapters).

Recorded requests carry images and documents as base64 (bare, as Anthropic
takes it, or inside a ``data:<media type>;base64,...`` URL, as OpenAI takes
it) or as a remote URL. The specs decode them into the neutral parts -- bytes
for base64, ``url`` for a remote URL -- and compare sent and recorded bodies
on the decoded bytes (:func:`media_key`), so that two base64 spellings of the
same bytes are the same request.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from _spec import UnsupportedPartError

from stepmachine import DocumentPart, ImagePart

__all__ = [
    "base64_key",
    "decode_base64",
    "document_from_url",
    "image_from_url",
    "media_key",
    "split_data_url",
]


def decode_base64(text: str) -> bytes:
    """Standard or url-safe base64, padded or not.

    Raises:
        UnsupportedPartError: the text is not base64 (the recording holds a
            placeholder the neutral request cannot turn into bytes).
    """
    cleaned = "".join(text.split())
    cleaned += "=" * (-len(cleaned) % 4)
    try:
        return base64.b64decode(cleaned.replace("-", "+").replace("_", "/"), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise UnsupportedPartError(f"base64 data that does not decode: {text[:40]!r}") from exc


def split_data_url(url: str) -> tuple[str, bytes] | None:
    """``(media type, bytes)`` of a base64 ``data:`` URL; ``None`` for any other URL."""
    if not url.startswith("data:"):
        return None
    head, _, payload = url[len("data:") :].partition(",")
    media_type, _, encoding = head.partition(";")
    if encoding != "base64":
        raise UnsupportedPartError(f"a data URL that is not base64: {url[:40]!r}")
    return media_type, decode_base64(payload)


def image_from_url(url: str, detail: Any = None) -> ImagePart:
    """An image given as a URL on the wire: bytes for a data URL, else the URL."""
    inline = split_data_url(url)
    if inline is None:
        return ImagePart(url=url, detail=detail)
    return ImagePart(media_type=inline[0], data=inline[1], detail=detail)


def document_from_url(url: str, title: Any = None) -> DocumentPart:
    """A document given as a URL on the wire: bytes for a data URL, else the URL."""
    inline = split_data_url(url)
    if inline is None:
        return DocumentPart(url=url, title=title)
    return DocumentPart(media_type=inline[0], data=inline[1], title=title)


def media_key(value: Any) -> Any:
    """A comparable form of a media URL: ``("bytes", media type, bytes)`` for a base64
    data URL, the value itself otherwise (a remote URL, or a broken data URL, which then
    equals only itself)."""
    try:
        inline = split_data_url(value) if isinstance(value, str) else None
    except UnsupportedPartError:
        return value
    return value if inline is None else ("bytes", *inline)


def base64_key(value: Any) -> Any:
    """A comparable form of bare base64: its bytes, or the value itself when it does not
    decode (then it equals only itself)."""
    try:
        return ("bytes", decode_base64(value)) if isinstance(value, str) else value
    except UnsupportedPartError:
        return value
