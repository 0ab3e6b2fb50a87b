"""Token estimates of media parts: sizes from headers, the providers' formulas, documents, audio."""

from __future__ import annotations

import io
import struct
import tracemalloc
import zlib
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepmachine import AppendMessage, AudioPart, DocumentPart, ImagePart, Message, NoData, Session
from stepmachine._media_tokens import (
    AUDIO_SECOND_TOKENS,
    DOCUMENT_UNKNOWN_TOKENS,
    IMAGE_UNKNOWN_TOKENS,
    PDF_PAGE_TOKENS,
    image_size,
    image_tokens,
    pdf_pages,
    wav_seconds,
)
from stepmachine.extend import Conversation, media_tokens, message_tokens
from stepmachine.operations import Compaction, estimate_tokens
from stepmachine.testing import ScriptedModel, make_session, reply, run_step


def png(width: int, height: int) -> bytes:
    """A PNG header and IHDR chunk (what the size reader needs), with a valid CRC."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return (
        b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk))
    )


def jpeg(width: int, height: int) -> bytes:
    """SOI, an APP0 segment, a DQT-like segment, then a baseline SOF0 frame header."""
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    other = b"\xff\xdb" + struct.pack(">H", 4) + b"\x00\x00"
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"
    return b"\xff\xd8" + app0 + other + sof + b"\xff\xd9"


def gif(width: int, height: int) -> bytes:
    return b"GIF89a" + struct.pack("<HH", width, height) + b"\x00\x00\x00;"


def webp_lossless(width: int, height: int) -> bytes:
    bits = (width - 1) | ((height - 1) << 14)
    body = b"VP8L" + struct.pack("<I", 5) + b"\x2f" + struct.pack("<I", bits) + b"\x00" * 8
    return b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WEBP" + body


def webp_extended(width: int, height: int) -> bytes:
    body = (
        b"VP8X"
        + struct.pack("<I", 10)
        + b"\x00\x00\x00\x00"
        + (width - 1).to_bytes(3, "little")
        + (height - 1).to_bytes(3, "little")
    )
    return b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WEBP" + body


def wav(seconds: int, rate: int = 16_000) -> bytes:
    data = b"\x00\x00" * rate * seconds
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", len(data))
    return b"RIFF" + struct.pack("<I", len(body) + len(data)) + body + data


def pdf(pages: int) -> bytes:
    objects = b"".join(
        b"%d 0 obj << /Type /Page /Parent 2 0 R >> endobj\n" % (3 + i) for i in range(pages)
    )
    return (
        b"%PDF-1.4\n2 0 obj << /Type /Pages /Count "
        + str(pages).encode()
        + b" >> endobj\n"
        + objects
    )


SIZES = st.tuples(st.integers(1, 20_000), st.integers(1, 20_000))


# -- sizes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [png, jpeg, gif, webp_lossless, webp_extended])
@given(size=st.tuples(st.integers(1, 16_000), st.integers(1, 16_000)))
def test_the_size_is_read_from_every_header(make: object, size: tuple[int, int]) -> None:
    assert callable(make)
    assert image_size(make(*size)) == size


def test_headers_it_cannot_read_give_no_size() -> None:
    assert image_size(b"") is None
    assert image_size(b"not an image at all") is None
    assert image_size(png(10, 10)[:20]) is None  # truncated
    assert image_size(png(0, 10)) is None
    assert image_size(b"\xff\xd8\xff\xe0\x00") is None  # a JPEG cut inside a segment header
    assert image_size(b"\xff\xd8\x00\x00\x00\x00\x00") is None  # not a marker where one must be


def test_sizes_agree_with_a_real_encoder() -> None:
    image_module = pytest.importorskip("PIL.Image")
    for fmt, options in [
        ("PNG", {}),
        ("JPEG", {}),
        ("GIF", {}),
        ("WEBP", {}),
        ("WEBP", {"lossless": True}),
    ]:
        for size in [(1, 1), (37, 1201), (1920, 1080)]:
            out = io.BytesIO()
            image_module.new("RGB", size, (200, 10, 10)).save(out, fmt, **options)
            assert image_size(out.getvalue()) == size, (fmt, options, size)


# -- the formulas ----------------------------------------------------------------------------------


def test_the_estimate_is_the_largest_published_formula() -> None:
    # small: Gemini's 258 and OpenAI's 85 + 170 dominate Anthropic's 14
    assert image_tokens(100, 100) == 258
    # 1024 x 1024: Anthropic 1024*1024/750 = 1399; OpenAI 768 x 768 -> 4 tiles = 765; Gemini 4 x 258
    assert image_tokens(1024, 1024) == 1399
    # 768 x 2048: OpenAI 2 x 4 tiles = 1445; Anthropic 588 x 1568 -> 1230; Gemini 3 tiles = 774
    assert image_tokens(768, 2048) == 1445
    # 4000 x 3000: Gemini cuts 6 x 4 tiles = 6192
    assert image_tokens(4000, 3000) == 6192
    # detail="low" lowers OpenAI's term only
    assert image_tokens(768, 2048, detail="low") == 1230
    assert image_tokens(100, 100, detail="low") == 258


def test_an_image_counts_by_its_size_never_by_its_bytes() -> None:
    big = png(1024, 1024) + b"\x00" * 2_000_000  # megabytes of pixels: still 1399
    assert media_tokens(ImagePart(media_type="image/png", data=big)) == 1399
    assert (
        message_tokens(
            Message.user("", id="u", media=[ImagePart(media_type="image/png", data=big)])
        )
        == 4 + 1399
    )


def test_an_image_of_unknown_size_counts_the_flat_figure() -> None:
    assert media_tokens(ImagePart(url="https://example.com/a.png")) == IMAGE_UNKNOWN_TOKENS
    assert media_tokens(ImagePart(media_type="image/bmp", data=b"BM....")) == IMAGE_UNKNOWN_TOKENS
    # the flat figure covers OpenAI's and Anthropic's largest
    assert max(image_tokens(768, 2048), image_tokens(1568, 733)) <= IMAGE_UNKNOWN_TOKENS


@given(size=SIZES, detail=st.sampled_from([None, "auto", "low", "high"]))
def test_an_image_never_counts_less_than_gemini_minimum(
    size: tuple[int, int], detail: str | None
) -> None:
    assert image_tokens(*size, detail=detail) >= 258


@given(size=SIZES, factor=st.integers(1, 8), detail=st.sampled_from([None, "low"]))
def test_a_larger_image_of_the_same_shape_never_counts_less(
    size: tuple[int, int], factor: int, detail: str | None
) -> None:
    width, height = size
    assert image_tokens(width * factor, height * factor, detail=detail) >= image_tokens(
        width, height, detail=detail
    )


@given(size=SIZES)
def test_low_detail_never_counts_more(size: tuple[int, int]) -> None:
    assert image_tokens(*size, detail="low") <= image_tokens(*size, detail="high")


@given(st.binary(min_size=1, max_size=400))
def test_any_bytes_give_a_positive_estimate(data: bytes) -> None:
    for part in (
        ImagePart(media_type="image/png", data=data),
        DocumentPart(media_type="application/pdf", data=data),
        DocumentPart(media_type="text/plain", data=data),
        AudioPart(media_type="audio/wav", data=data),
    ):
        assert media_tokens(part) > 0


# -- documents and audio ------------------------------------------------------------


def test_a_pdf_counts_per_page() -> None:
    assert pdf_pages(pdf(3)) == 3
    assert (
        media_tokens(DocumentPart(media_type="application/pdf", data=pdf(3))) == 3 * PDF_PAGE_TOKENS
    )
    compressed = (
        b"%PDF-1.7\n2 0 obj << /Type /Pages /Kids [3 0 R] /Count 7 >> endobj\n"  # pages in streams
    )
    assert pdf_pages(compressed) == 7
    assert pdf_pages(b"%PDF-1.7\n" + b"\x00" * 120_000) == 3  # one a 50,000 bytes
    assert pdf_pages(b"%PDF-1.7\n") == 1
    assert media_tokens(DocumentPart(url="https://example.com/a.pdf")) == DOCUMENT_UNKNOWN_TOKENS


def test_a_text_document_counts_like_text() -> None:
    assert media_tokens(DocumentPart(media_type="text/plain", data=b"x" * 400)) == 101


def test_audio_counts_by_duration() -> None:
    assert wav_seconds(wav(3)) == 3.0
    assert media_tokens(AudioPart(media_type="audio/wav", data=wav(3))) == 3 * AUDIO_SECOND_TOKENS
    assert wav_seconds(b"RIFF\x00\x00\x00\x00WAVE") is None
    mp3 = b"\xff\xfb" + b"\x00" * 39_998  # 40,000 bytes at 4,000 a second: 10 s
    assert media_tokens(AudioPart(media_type="audio/mpeg", data=mp3)) == 10 * AUDIO_SECOND_TOKENS
    assert media_tokens(AudioPart(url="https://example.com/a.mp3")) == 60 * AUDIO_SECOND_TOKENS


# -- in the session -----------------------------------------------------------------


def test_the_session_index_counts_media_once_when_appended() -> None:
    image = ImagePart(media_type="image/png", data=png(1024, 1024))
    messages = (
        Message.user(
            "look", id="u1", media=[image, DocumentPart(media_type="application/pdf", data=pdf(2))]
        ),
    )
    expected = 4 + 1 + 1399 + 2 * PDF_PAGE_TOKENS
    empty: Session[NoData] = Session(id="s", revision=0, conversation=Conversation(), data=NoData())
    appended = AppendMessage(messages[0]).apply(empty)  # the index extended, O(the message)
    assert appended.history.estimated_tokens == estimate_tokens(messages) == expected
    loaded = Session(
        id="s", revision=1, conversation=Conversation(messages), data=NoData()
    )  # rebuilt on load
    assert loaded.history.estimated_tokens == expected


# -- bounded work per part, whatever the bytes (issue 22) ---------------------------------------


class _Counting(bytes):
    """Bytes that count how often the reader indexes or slices them."""

    reads = 0

    def __getitem__(self, key: object) -> object:
        type(self).reads += 1
        return super().__getitem__(key)  # type: ignore[index]


_FILLERS = [b"\xff", b"\xff\xd0", b"\xff\xe0\x00\x02", b"\xff\x01"]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(_FILLERS), min_size=1, max_size=4), st.integers(2_000, 60_000))
def test_a_jpeg_of_endless_markers_is_walked_a_bounded_number_of_steps(
    pattern: list[bytes], repeat: int
) -> None:
    _Counting.reads = 0
    data = _Counting(b"\xff\xd8" + b"".join(pattern) * repeat + jpeg(640, 480)[2:])
    image_size(data)  # past the bound: unknown; before it: the frame's size
    assert _Counting.reads < 8_000, f"{_Counting.reads:,} reads for {len(data):,} bytes"


def test_a_real_jpeg_after_a_few_markers_still_gives_its_size() -> None:
    assert image_size(b"\xff\xd8" + b"\xff\xd0" * 20 + jpeg(640, 480)[2:]) == (640, 480)


def test_a_wav_of_endless_empty_chunks_is_walked_a_bounded_number_of_steps() -> None:
    _Counting.reads = 0
    data = _Counting(b"RIFF\0\0\0\0WAVE" + b"junk\0\0\0\0" * 200_000)
    assert wav_seconds(data) is None
    assert _Counting.reads < 10_000, f"{_Counting.reads:,} reads for {len(data):,} bytes"
    assert media_tokens(AudioPart(media_type="audio/wav", data=bytes(data))) > 0


def test_a_long_pdf_counts_the_pages_of_its_first_window_in_proportion() -> None:
    from stepmachine._media_tokens import _PDF_SCAN_BYTES

    page = b"1 0 obj << /Type /Page >> endobj\n" + b"x" * (1024 * 1024 - 34) + b"\n"
    data = b"%PDF-1.7\n" + page * 16  # 16 pages over 16 MiB: 8 in the window
    assert len(data) > _PDF_SCAN_BYTES
    assert pdf_pages(data) >= 16
    assert pdf_pages(pdf(3)) == 3


# A million tokens: more than any provider's context window, and more than any of them
# charges for one image, one short audio clip or a PDF of a few bytes.
ABSURD = 1_000_000


def png_header(width: int, height: int) -> bytes:
    """A PNG signature and a valid IHDR chunk declaring ``width`` x ``height`` (no pixels)."""
    ihdr = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + ihdr + struct.pack(">I", zlib.crc32(ihdr))


def wav_header(byte_rate: int, data_size: int) -> bytes:
    fmt = struct.pack("<HHIIHH", 1, 1, 8_000, byte_rate, 1, 8)
    body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", data_size)
    return b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + body


# -- the token estimator under hostile headers ------------------------------------------------


@pytest.mark.parametrize(
    "size", [(2**31 - 1, 2**31 - 1), (2**32 - 1, 1), (16_777_216, 16_777_216)], ids=str
)
def test_a_header_declaring_absurd_dimensions_gets_a_bounded_estimate(
    size: tuple[int, int],
) -> None:
    data = png_header(*size)
    assert media_tokens(ImagePart(media_type="image/png", data=data)) <= ABSURD


async def test_a_tiny_image_with_a_forged_header_does_not_block_compaction() -> None:
    forged = ImagePart(media_type="image/png", data=png_header(2**31 - 1, 2**31 - 1))
    session = make_session(Message.user("what is this?", id="u0", media=[forged]))
    with anyio.fail_after(10):
        check = await run_step(
            Compaction(threshold=100_000), session, model=ScriptedModel([reply("summary")])
        )
    assert check.refused, check.outcome  # a 33-byte image is far within 100,000 tokens


def test_a_tiny_pdf_with_an_absurd_page_count_gets_a_bounded_estimate() -> None:
    data = b"%PDF-1.4\n<< /Count 999999999 >>"
    estimate = media_tokens(DocumentPart(media_type="application/pdf", data=data))
    assert estimate <= PDF_PAGE_TOKENS * len(data)  # not even one page per byte


def test_a_wav_with_a_forged_byte_rate_gets_a_bounded_estimate() -> None:
    data = wav_header(byte_rate=1, data_size=0xFFFFFFFF) + bytes(1_000_000)
    assert media_tokens(AudioPart(media_type="audio/wav", data=data)) <= len(data)


def test_counting_the_pages_of_a_pdf_does_not_copy_every_match() -> None:
    data = b"%PDF-1.4\n" + b"/Type/Page " * 500_000  # 5.5 MB
    tracemalloc.start()
    try:
        pages = pdf_pages(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert pages >= 1
    assert peak < len(data), f"{peak:,} bytes allocated to count the pages of {len(data):,}"


class _CountingBytes(bytes):
    """Bytes that count how often the reader indexes or slices them."""

    reads = 0

    def __getitem__(self, key: Any) -> Any:
        type(self).reads += 1
        return super().__getitem__(key)


@pytest.mark.parametrize("filler", [b"\xff", b"\xff\xd0", b"\xff\xe0\x00\x02"], ids=repr)
def test_a_jpeg_of_endless_segments_is_not_walked_byte_by_byte(filler: bytes) -> None:
    _CountingBytes.reads = 0
    data = _CountingBytes(b"\xff\xd8" + filler * (200_000 // len(filler)))
    assert image_size(data) is None
    assert _CountingBytes.reads < 10_000, f"{_CountingBytes.reads:,} reads for {len(data):,} bytes"


_HEADERS = [
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
    b"\xff\xd8",
    b"\xff\xd8\xff\xc0",
    b"GIF89a",
    b"RIFF\x00\x00\x00\x00WEBPVP8 ",
    b"RIFF\x00\x00\x00\x00WEBPVP8L",
    b"RIFF\x00\x00\x00\x00WEBPVP8X",
    b"RIFF\x00\x00\x00\x00WAVEfmt ",
    b"%PDF-1.7\n/Count ",
]


@settings(max_examples=300, deadline=None)
@given(header=st.sampled_from(_HEADERS), tail=st.binary(max_size=64))
def test_truncated_and_mangled_headers_give_a_positive_estimate_never_a_crash(
    header: bytes, tail: bytes
) -> None:
    data = header + tail
    for part in (
        ImagePart(media_type="image/png", data=data),
        DocumentPart(media_type="application/pdf", data=data),
        AudioPart(media_type="audio/wav", data=data),
    ):
        estimate = media_tokens(part)
        assert type(estimate) is int
        assert estimate > 0


def test_truncated_headers_of_every_format_fall_back_to_the_unknown_figure() -> None:
    full = png_header(800, 600)
    for cut in range(len(full)):
        assert image_size(full[:cut]) in (None, (800, 600))
    assert image_size(b"\xff\xd8\xff\xc0\x00\x11\x08") is None  # SOF cut before its size
    assert image_size(b"RIFF\x00\x00\x00\x00WEBP") is None
