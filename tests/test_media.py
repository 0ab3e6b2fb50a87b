"""Media parts: images, documents and audio in messages and tool results."""

from __future__ import annotations

import hashlib

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepmachine import (
    AudioPart,
    Codec,
    ConfigurationError,
    DocumentPart,
    ImagePart,
    InvalidFieldError,
    Message,
    ModelRequest,
    ToolResultPart,
)
from stepmachine.extend import media_digest
from stepmachine.providers import OpenAIChatModel

CODEC = Codec()
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256))


def test_a_part_holds_exactly_one_source() -> None:
    with pytest.raises(InvalidFieldError, match="exactly one"):
        ImagePart(media_type="image/png")
    with pytest.raises(InvalidFieldError, match="exactly one"):
        ImagePart(media_type="image/png", data=PNG, url="https://example.com/a.png")
    with pytest.raises(InvalidFieldError, match="media type with data"):
        ImagePart(data=PNG)
    with pytest.raises(InvalidFieldError, match="not a blank"):
        DocumentPart(url="  ")


def test_media_types_match_the_kind_of_part() -> None:
    with pytest.raises(InvalidFieldError, match=r"'image/\.\.\.'"):
        ImagePart(media_type="application/pdf", data=b"%PDF")
    with pytest.raises(InvalidFieldError, match=r"'application/\.\.\.' or 'text/\.\.\.'"):
        DocumentPart(media_type="image/png", data=PNG)
    with pytest.raises(InvalidFieldError, match=r"'audio/\.\.\.'"):
        AudioPart(media_type="video/mp4", data=b"x")
    with pytest.raises(InvalidFieldError, match="detail"):
        ImagePart(url="https://example.com/a.png", detail="ultra")  # type: ignore[arg-type]
    with pytest.raises(InvalidFieldError, match="data"):
        ImagePart(media_type="image/png", data="iVBOR")  # type: ignore[arg-type]
    assert DocumentPart(media_type="text/plain", data=b"hi").media_type == "text/plain"


def test_the_repr_never_prints_the_bytes() -> None:
    part = ImagePart(media_type="image/png", data=PNG * 1000)
    assert repr(part) == f"ImagePart({len(PNG) * 1000:,} bytes image/png)"
    assert "url='https://x.test/a.pdf'" in repr(DocumentPart(url="https://x.test/a.pdf"))


def test_the_digest_names_the_bytes() -> None:
    part = ImagePart(media_type="image/png", data=PNG)
    assert part.digest == "sha256:" + hashlib.sha256(PNG).hexdigest() == media_digest(PNG)
    assert ImagePart(url="https://example.com/a.png").digest == ""


def test_a_user_message_holds_text_then_media() -> None:
    image = ImagePart(media_type="image/png", data=PNG, detail="low")
    pdf = DocumentPart(media_type="application/pdf", data=b"%PDF-1.7", title="invoice.pdf")
    message = Message.user("What is this?", id="u1", media=[image, pdf])
    assert message.parts[1:] == (image, pdf)
    assert message.text == "What is this?"
    with pytest.raises(InvalidFieldError, match="media"):
        Message.user("x", id="u2", media=["not a part"])  # type: ignore[list-item]


def test_a_tool_message_carries_images_and_documents_after_its_result() -> None:
    image = ImagePart(media_type="image/png", data=PNG)
    pdf = DocumentPart(url="https://example.com/a.pdf")
    result = ToolResultPart(call_id="c1", content="a chart")
    message = Message.tool_result(result, id="t1", media=[image, pdf])
    assert message.parts == (result, image, pdf)
    assert message.tool_results == (result,)
    assert message.result_media("c1") == (image, pdf)
    assert message.result_media("other") == ()
    assert Message.tool_result(result, id="t2").result_media("c1") == ()
    with pytest.raises(InvalidFieldError, match="media"):
        Message.tool_result(result, id="t3", media=[AudioPart(url="https://a.test/x")])  # type: ignore[list-item]


@given(
    data=st.binary(min_size=1, max_size=4096),
    kind=st.sampled_from(["image", "document", "audio"]),
    cache=st.booleans(),
)
def test_media_round_trips_through_the_codec(data: bytes, kind: str, cache: bool) -> None:
    part: ImagePart | DocumentPart | AudioPart
    if kind == "image":
        part = ImagePart(media_type="image/webp", data=data, detail="high", cache=cache)
    elif kind == "document":
        part = DocumentPart(media_type="application/pdf", data=data, title="t", cache=cache)
    else:
        part = AudioPart(media_type="audio/wav", data=data, cache=cache)
    message = Message.user("look", id="u1", media=[part])
    decoded = CODEC.decode_message(CODEC.encode_message(message))
    assert decoded == message
    assert decoded.parts[1].data == data  # type: ignore[union-attr]
    if not isinstance(part, AudioPart):
        result = ToolResultPart(call_id="c", content="r")
        tool = Message.tool_result(result, id="t1", media=[part])
        assert CODEC.decode_message(CODEC.encode_message(tool)) == tool


def test_a_url_part_round_trips() -> None:
    message = Message.user("look", id="u1", media=[ImagePart(url="gs://bucket/a.png")])
    assert CODEC.decode_message(CODEC.encode_message(message)) == message


async def test_an_adapter_refuses_media_it_cannot_send_before_any_request() -> None:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(500)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    model = OpenAIChatModel("m", api_key="sk-test", client=client)
    model.media = frozenset()  # as an adapter that takes no media
    audio = AudioPart(media_type="audio/wav", data=b"RIFF")
    request = ModelRequest(messages=(Message.user("hear", id="u1", media=[audio]),))
    with pytest.raises(ConfigurationError, match="cannot send a AudioPart in a user message"):
        await model.request(request)
    assert sent == []
    await client.aclose()
