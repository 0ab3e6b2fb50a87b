"""What every adapter needs to put media parts on the wire: base64, data URLs, refusals.

The part types an adapter takes are its ``media`` / ``result_media`` class
attributes (checked by :func:`~stepmachine._media.check_media` before any
request). A part of an accepted type can still be one the provider cannot
take in that form -- a document by URL where only bytes are accepted, an
image media type the provider does not read, media in an assistant turn --
and the adapter's ``build_body`` raises :func:`unsendable` for it. Both run
before any HTTP request; nothing is ever dropped.
"""

from __future__ import annotations

import base64
import re
from typing import Final

from .._errors import ConfigurationError
from .._media import AudioPart, DocumentPart, ImagePart

__all__ = [
    "IMAGE_TYPES",
    "OPENAI_FILE_TYPES",
    "PDF",
    "b64",
    "data_url",
    "default_filename",
    "describe",
    "from_data_url",
    "image_type",
    "openai_file_type",
    "unsendable",
]

PDF: Final = "application/pdf"

_EXTENSIONS: Final = {
    "application/pdf": ".pdf",
    "application/json": ".json",
    "application/xml": ".xml",
    "application/rtf": ".rtf",
    "application/msword": ".doc",
    "application/vnd.openxmlformats-officedocument.wordprocessingml.document": ".docx",
    "application/vnd.oasis.opendocument.text": ".odt",
    "application/vnd.ms-powerpoint": ".ppt",
    "application/vnd.openxmlformats-officedocument.presentationml.presentation": ".pptx",
    "application/vnd.ms-excel": ".xls",
    "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet": ".xlsx",
    "text/plain": ".txt",
    "text/markdown": ".md",
    "text/csv": ".csv",
    "text/tab-separated-values": ".tsv",
    "text/html": ".html",
    "text/xml": ".xml",
    "text/rtf": ".rtf",
}

OPENAI_FILE_TYPES: Final = frozenset(t for t in _EXTENSIONS if not t.startswith("text/"))
"""The document types besides ``text/*`` that the Responses API documents for
``input_file``: PDF, JSON and XML, Word, RTF, OpenDocument text, PowerPoint, Excel."""

_TEXT_TYPE = re.compile(r"^text/[a-z0-9][a-z0-9.+-]*$")


def openai_file_type(media_type: str) -> bool:
    """Whether the Responses API reads a document of ``media_type`` (bare, no
    parameters): one of :data:`OPENAI_FILE_TYPES` or any ``text/<subtype>`` (text,
    markup and code files)."""
    return media_type in OPENAI_FILE_TYPES or _TEXT_TYPE.match(media_type) is not None


def default_filename(media_type: str) -> str:
    """The file name sent for a document without a ``title``: ``document`` plus the
    extension of its type (``document.pdf``, ``document.docx``; ``.txt`` for another
    ``text/*`` type), which is what OpenAI reads the type from."""
    extension = _EXTENSIONS.get(media_type)
    if extension is None and _TEXT_TYPE.match(media_type):
        extension = ".txt"
    return "document" + (extension or "")


IMAGE_TYPES: Final = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})
"""The image media types OpenAI and Anthropic both document (``image/jpg`` is read as JPEG)."""


def b64(data: bytes) -> str:
    """``data`` in standard base64 (``+`` and ``/``, padded), as every API here takes it."""
    return base64.b64encode(data).decode("ascii")


def data_url(media_type: str, data: bytes) -> str:
    """``data:<media_type>;base64,<data>`` (RFC 2397), the form OpenAI takes inline bytes in."""
    return f"data:{media_type};base64,{b64(data)}"


def from_data_url(url: str) -> tuple[str, bytes] | None:
    """``(media_type, bytes)`` of a base64 ``data:`` URL, or ``None`` for any other URL.

    Raises:
        ValueError: a ``data:`` URL that is not base64 or whose base64 is broken.
    """
    if not url.startswith("data:"):
        return None
    head, comma, payload = url[len("data:") :].partition(",")
    media_type, _, encoding = head.partition(";")
    if not comma or encoding != "base64":
        raise ValueError(f"not a base64 data URL: {url[:40]!r}")
    return media_type, base64.b64decode(payload, validate=True)


def describe(part: ImagePart | DocumentPart | AudioPart) -> str:
    """A short description of ``part`` for an error message (never its bytes)."""
    kind = type(part).__name__
    if part.data is not None:
        return f"{kind}({len(part.data):,} bytes {part.media_type})"
    return f"{kind}(url={part.url!r})"


def image_type(part: ImagePart) -> str:
    """The image's media type as the APIs spell it (``image/jpg`` -> ``image/jpeg``)."""
    return "image/jpeg" if part.media_type == "image/jpg" else part.media_type


def unsendable(
    who: str, part: ImagePart | DocumentPart | AudioPart, why: str
) -> ConfigurationError:
    """The error for a part ``who`` cannot send in this form: names the part and the reason."""
    return ConfigurationError(f"{who} cannot send {describe(part)}: {why}")
