"""Token estimates for images, documents and audio (what compaction counts).

:func:`media_tokens` is what :func:`~stepmachine.message_tokens` adds for a
media part. It reads only what is cheap: an image's size from its header
(PNG, JPEG, GIF, WebP), a PDF's page count by one pass over at most its first
:data:`_PDF_SCAN_BYTES`, a WAV file's duration from its header; never decodes
pixels or audio. The work per part is bounded whatever its bytes: a JPEG's
segments are walked for at most :data:`_JPEG_MAX_STEPS` markers and a WAV's
chunks for at most :data:`_WAV_MAX_CHUNKS` (a forged file of endless fill
bytes, standalone markers or empty chunks stops there and counts as an image
of unknown size, or by its length), and the PDF scan is a regular expression
over a bounded window. So the session index, which computes the estimate when
a message is appended and again when it is rebuilt (a load, a replaced
conversation), never spends more than a few milliseconds on one part.

**Images.** The providers publish three formulas, each after their own
downscaling:

* Anthropic: ``width * height / 750``, after fitting the long edge in
  1,568 px and the area in 1.15 megapixels (at most about 1,600 tokens);
* OpenAI (``detail="high"`` or ``"auto"``): fit in 2,048 x 2,048, then the
  short side in 768 px; 85 plus 170 per 512 px tile (at most 1,445);
  ``detail="low"``: 85;
* Gemini: 258 for an image of at most 384 x 384; a larger one is cut into
  768 x 768 tiles of 258 each.

The estimate is **the largest of the three** for the image's size, and never
more than :data:`IMAGE_MAX_TOKENS` (64 Gemini tiles, 16,512, a 6,144 x 6,144
image: the header's declared size is not trusted beyond that, so a forged
33-byte header cannot make one image count billions): a message
may go to any provider (the application can switch models, and a fallback
model can take over a session), and compaction must start before the
largest of them overflows, so over-counting is the safe error. ``detail``
only lowers OpenAI's term (the others ignore it). An image whose size the
header does not give (another format, a truncated file, a URL) counts
:data:`IMAGE_UNKNOWN_TOKENS` (1,600: Anthropic's ceiling, above OpenAI's and
above Gemini's for any image of up to six tiles).

**Documents.** A PDF counts :data:`PDF_PAGE_TOKENS` (3,000) per page: Anthropic
counts 1,500 to 3,000 text tokens per page (and sends each page as an image
too), Gemini 258 per page; OpenAI extracts the text and an image of each page.
Pages are counted as ``/Type /Page`` objects in the first
:data:`_PDF_SCAN_BYTES` (8 MiB; a longer file counts them in proportion to its
length); a PDF whose page objects are
compressed (object streams) counts by its largest ``/Count``, else one page
per 50,000 bytes (at least one). The count is never more than
:data:`PDF_MAX_PAGES` (1,000: Gemini's limit per document, the highest), nor
more than one page per 8 bytes of the file (a declared ``/Count`` is not
trusted beyond what the bytes can hold). A text document counts like text: a quarter
of its bytes. A document by URL counts :data:`DOCUMENT_UNKNOWN_TOKENS`.

**Audio.** :data:`AUDIO_SECOND_TOKENS` (32, Gemini's published rate, the
highest) per second: the duration from a WAV header, else from the size at
4,000 bytes a second (32 kbit/s, a low speech bitrate, so a longer estimate
than most files need); a WAV header's byte rate is not trusted below 1,000
bytes a second (a forged rate cannot stretch a second of audio to hours).
Audio by URL counts a minute.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Final

from ._media import AudioPart, DocumentPart, ImagePart

__all__ = [
    "AUDIO_SECOND_TOKENS",
    "DOCUMENT_UNKNOWN_TOKENS",
    "IMAGE_UNKNOWN_TOKENS",
    "PDF_PAGE_TOKENS",
    "image_size",
    "image_tokens",
    "media_tokens",
    "pdf_pages",
    "wav_seconds",
]

IMAGE_UNKNOWN_TOKENS: Final = 1_600
IMAGE_MAX_TOKENS: Final = 64 * 258
PDF_MAX_PAGES: Final = 1_000
_PDF_MIN_BYTES_PER_PAGE: Final = 8
_AUDIO_MIN_BYTES_PER_SECOND: Final = 1_000
"""An image whose size is unknown (a URL, a format or header not understood)."""
PDF_PAGE_TOKENS: Final = 3_000
"""One PDF page."""
DOCUMENT_UNKNOWN_TOKENS: Final = 5 * PDF_PAGE_TOKENS
"""A document by URL (its length is unknown): five PDF pages."""
AUDIO_SECOND_TOKENS: Final = 32
"""One second of audio."""
_AUDIO_BYTES_PER_SECOND: Final = 4_000
_AUDIO_UNKNOWN_SECONDS: Final = 60
_PDF_BYTES_PER_PAGE: Final = 50_000
_MAX_AREA: Final = Fraction(1_150_000)

_JPEG_MAX_STEPS: Final = 1_024
"""JPEG markers walked before the frame at most (real files have a few dozen)."""
_WAV_MAX_CHUNKS: Final = 1_024
"""WAV chunks walked before ``data`` at most (real files have a handful)."""
_PDF_SCAN_BYTES: Final = 8 * 1024 * 1024
"""The bytes of a PDF searched for page objects (the rest counts by its size)."""

_PAGE = re.compile(rb"/Type\s*/Page(?![A-Za-z])")
_COUNT = re.compile(rb"/Count\s+(\d{1,9})")


# -- sizes from headers ---------------------------------------------------------------


def _png_size(data: bytes) -> tuple[int, int] | None:
    if data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) >= 24 and data[12:16] == b"IHDR":
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    return None


def _gif_size(data: bytes) -> tuple[int, int] | None:
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return int.from_bytes(data[6:8], "little"), int.from_bytes(data[8:10], "little")
    return None


_SOF: Final = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # start-of-frame markers


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """Walk the JPEG segments to the first start-of-frame, at most
    :data:`_JPEG_MAX_STEPS` markers (fill bytes included); None past them."""
    if not data.startswith(b"\xff\xd8"):
        return None
    at = 2
    end = len(data)
    for _ in range(_JPEG_MAX_STEPS):
        if at + 4 > end:
            return None
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # standalone markers: no length
            at += 2
            continue
        length = int.from_bytes(data[at + 2 : at + 4], "big")
        if marker in _SOF:
            if at + 9 > len(data):
                return None
            height = int.from_bytes(data[at + 5 : at + 7], "big")
            width = int.from_bytes(data[at + 7 : at + 9], "big")
            return width, height
        if length < 2:
            return None
        at += 2 + length
    return None  # endless markers: a forged or broken file, of unknown size


def _webp_size(data: bytes) -> tuple[int, int] | None:
    if len(data) < 30 or data[:4] != b"RIFF" or data[8:12] != b"WEBP":
        return None
    chunk = data[12:16]
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        width = int.from_bytes(data[26:28], "little") & 0x3FFF
        height = int.from_bytes(data[28:30], "little") & 0x3FFF
        return width, height
    if chunk == b"VP8L" and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    return None


def image_size(data: bytes) -> tuple[int, int] | None:
    """``(width, height)`` in pixels from a PNG, JPEG, GIF or WebP header, or ``None``.

    Reads the header only (a JPEG: its segment headers up to the frame);
    ``None`` for another format, a truncated header or a zero dimension.
    """
    for reader in (_png_size, _jpeg_size, _gif_size, _webp_size):
        size = reader(data)
        if size is not None:
            return size if size[0] > 0 and size[1] > 0 else None
    return None


# -- the providers' formulas --------------------------------------------------------------


def _anthropic(width: int, height: int) -> int:
    long_side, short_side = max(width, height), min(width, height)
    # the area after fitting the long edge in 1,568 px and the area in 1.15 MP (exact: no
    # float rounding, so an image scaled up never counts less)
    area = min(Fraction(width * height), Fraction(1568 * 1568 * short_side, long_side), _MAX_AREA)
    return math.ceil(area / 750)


def _openai(width: int, height: int, *, low: bool) -> int:
    if low:
        return 85
    long_side, short_side = max(width, height), min(width, height)
    # fit in 2048 x 2048, then the short side in 768 (downscaling only): one exact scale
    scale = min(Fraction(1), Fraction(2048, long_side), Fraction(768, short_side))
    return 85 + 170 * math.ceil(long_side * scale / 512) * math.ceil(short_side * scale / 512)


def _gemini(width: int, height: int) -> int:
    if width <= 384 and height <= 384:
        return 258
    return 258 * -(-width // 768) * -(-height // 768)


def image_tokens(width: int, height: int, detail: str | None = None) -> int:
    """The estimate for a ``width`` x ``height`` image: the largest of the three formulas.

    See the module docstring; ``detail="low"`` lowers OpenAI's term to 85.
    """
    if width <= 0 or height <= 0:
        return IMAGE_UNKNOWN_TOKENS
    # Each side bounded first (what no provider takes costs no more), then the total.
    width, height = min(width, 65_536), min(height, 65_536)
    largest = max(
        _anthropic(width, height),
        _openai(width, height, low=detail == "low"),
        _gemini(width, height),
    )
    return min(largest, IMAGE_MAX_TOKENS)


# -- documents and audio ---------------------------------------------------------------------


def pdf_pages(data: bytes) -> int:
    """A cheap page count of a PDF, at least 1, at most :data:`PDF_MAX_PAGES` (module docs).

    Searches at most the first :data:`_PDF_SCAN_BYTES`; the page objects found
    there count for the whole file in proportion to its length (rounded up).
    """
    bound = max(1, min(PDF_MAX_PAGES, len(data) // _PDF_MIN_BYTES_PER_PAGE))
    window = memoryview(data)[:_PDF_SCAN_BYTES]
    pages = 0
    for _ in _PAGE.finditer(window):  # counted, not collected: no list of every match
        pages += 1
        if pages >= bound:
            return bound
    if pages:
        return min(bound, -(-pages * len(data) // len(window)))
    counts = [int(match) for match in _COUNT.findall(window)]
    if counts and max(counts) > 0:
        return min(max(counts), bound)
    return min(bound, max(1, math.ceil(len(data) / _PDF_BYTES_PER_PAGE)))


def wav_seconds(data: bytes) -> float | None:
    """A WAV file's duration from its header (``fmt`` byte rate, ``data`` size), or ``None``."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    byte_rate = 0
    at = 12
    for _ in range(_WAV_MAX_CHUNKS):
        if at + 8 > len(data):
            return None
        chunk, size = data[at : at + 4], int.from_bytes(data[at + 4 : at + 8], "little")
        if chunk == b"fmt " and at + 20 <= len(data):  # format, channels, rate, byte rate
            byte_rate = int.from_bytes(data[at + 16 : at + 20], "little")
        elif chunk == b"data":
            if byte_rate <= 0:
                return None
            size = min(size, len(data) - at - 8)  # a streamed WAV may say 0xFFFFFFFF
            return size / max(byte_rate, _AUDIO_MIN_BYTES_PER_SECOND)
        at += 8 + size + (size & 1)
    return None


def media_tokens(part: ImagePart | DocumentPart | AudioPart) -> int:
    """The token estimate of one media part (module docstring): always positive."""
    data = part.data
    if isinstance(part, ImagePart):
        size = None if data is None else image_size(data)
        return IMAGE_UNKNOWN_TOKENS if size is None else image_tokens(*size, detail=part.detail)
    if isinstance(part, DocumentPart):
        if data is None:
            return DOCUMENT_UNKNOWN_TOKENS
        if part.media_type == "application/pdf" or data.startswith(b"%PDF-"):
            return PDF_PAGE_TOKENS * pdf_pages(data)
        return 1 + (len(data) + 3) // 4
    if data is None:
        seconds: float = _AUDIO_UNKNOWN_SECONDS
    else:
        wav = wav_seconds(data)
        seconds = len(data) / _AUDIO_BYTES_PER_SECOND if wav is None else wav
    return max(1, math.ceil(seconds * AUDIO_SECOND_TOKENS))
