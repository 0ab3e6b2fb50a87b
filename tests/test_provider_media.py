"""Media parts on the wire: what each adapter sends for images, documents and audio.

Per adapter (Chat and OpenAI-compatible, Responses, Anthropic): the body built for
images by bytes and by URL, PDFs, the ``detail`` and ``cache`` hints, media inside
tool results, and the :class:`ConfigurationError` -- before any HTTP request -- for
each part an adapter cannot send. Hypothesis checks that any bytes survive the trip
(bytes -> base64 / data URL -> decoded back equal) and that the conformance specs,
written apart from the adapters, read every body an adapter builds back into the
same parts.
"""

from __future__ import annotations

import base64
import itertools
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import anyio
import httpx
import msgspec
import pytest
import spec_anthropic
import spec_openai_chat
import spec_openai_responses
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from stepmachine import (
    AudioPart,
    ConfigurationError,
    DocumentPart,
    ImagePart,
    InvalidFieldError,
    Message,
    ModelRequest,
    ReasoningPart,
    TextPart,
    ToolCallPart,
    ToolResultPart,
)
from stepmachine._messages import Part
from stepmachine.providers import (
    AnthropicModel,
    HTTPModel,
    OpenAIChatModel,
    OpenAICompatibleModel,
    OpenAIResponsesModel,
)
from stepmachine.providers._media_wire import from_data_url


def png_header(width: int, height: int) -> bytes:
    """A PNG signature and a valid IHDR chunk declaring ``width`` x ``height`` (no pixels)."""
    ihdr = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + ihdr + struct.pack(">I", zlib.crc32(ihdr))


_PNG64 = png_header(64, 64)
SHOT = ImagePart(media_type="image/png", data=_PNG64 + b"shot")
OTHER = ImagePart(media_type="image/png", data=_PNG64 + b"other")

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))
PDF = b"%PDF-1.7\n" + bytes(range(200, 256))
WAV = b"RIFF\x00\x00\x00\x00WAVEfmt "
URL = "https://example.com/cat.jpg"
PDF_URL = "https://example.com/paper.pdf"


# Bodies are built without a request: one client, never used to send, serves every model
# that only builds them (a model makes its own client otherwise, which is slow).
_UNUSED = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(599)))


def _chat(client: httpx.AsyncClient = _UNUSED) -> OpenAIChatModel:
    return OpenAIChatModel("gpt-4o", api_key="sk-test", client=client)


def _compatible(client: httpx.AsyncClient = _UNUSED) -> OpenAICompatibleModel:
    return OpenAICompatibleModel("llava", base_url="http://localhost:11434/v1", client=client)


def _responses(client: httpx.AsyncClient = _UNUSED) -> OpenAIResponsesModel:
    return OpenAIResponsesModel("gpt-4o", api_key="sk-test", client=client)


def _anthropic(client: httpx.AsyncClient = _UNUSED) -> AnthropicModel:
    return AnthropicModel("claude-sonnet-4-5", api_key="sk-ant-test", client=client)


def _user(*parts: Part) -> Message:
    return Message(id="m0", role="user", parts=parts)


def _body(model: HTTPModel, *messages: Message) -> dict[str, Any]:
    return model.build_body(ModelRequest(messages=messages), stream=False)


def _with_result(*media: ImagePart | DocumentPart, content: str = "a chart") -> tuple[Message, ...]:
    """A user turn, the call, and its result carrying ``media``."""
    return (
        Message.user("draw it", id="u1"),
        Message(id="a1", role="assistant", parts=(ToolCallPart.parse("c1", "draw", "{}"),)),
        Message.tool_result(ToolResultPart("c1", content), id="t1", media=media),
    )


# -- OpenAI Chat Completions (and OpenAI-compatible servers) --------------------------------


@pytest.mark.parametrize("make", [_chat, _compatible], ids=["chat", "compatible"])
def test_chat_sends_images_by_bytes_and_by_url_with_detail(make: Any) -> None:
    body = _body(
        make(),
        _user(
            TextPart("Compare"),
            ImagePart(media_type="image/png", data=PNG, detail="low"),
            ImagePart(url=URL),
        ),
    )
    assert body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                {
                    "type": "image_url",
                    "image_url": {
                        "url": "data:image/png;base64," + base64.b64encode(PNG).decode(),
                        "detail": "low",
                    },
                },
                {"type": "image_url", "image_url": {"url": URL}},
            ],
        }
    ]


def test_chat_keeps_the_order_of_the_parts_and_plain_text_as_a_string() -> None:
    body = _body(_chat(), _user(ImagePart(url=URL), TextPart("What is it?")))
    assert [p["type"] for p in body["messages"][0]["content"]] == ["image_url", "text"]
    assert _body(_chat(), Message.user("hi", id="u"))["messages"] == [
        {"role": "user", "content": "hi"}
    ]


def test_chat_sends_a_pdf_as_a_file_part_named_by_its_title() -> None:
    body = _body(
        _chat(),
        Message.user(
            "Summarise",
            id="u",
            media=[
                DocumentPart(media_type="application/pdf", data=PDF, title="paper.pdf"),
                DocumentPart(media_type="application/pdf", data=PDF, cache=True),
            ],
        ),
    )
    data = "data:application/pdf;base64," + base64.b64encode(PDF).decode()
    assert body["messages"][0]["content"][1:] == [
        {"type": "file", "file": {"file_data": data, "filename": "paper.pdf"}},
        {"type": "file", "file": {"file_data": data, "filename": "document.pdf"}},
    ]


def test_chat_sends_wav_and_mp3_bytes_as_input_audio() -> None:
    body = _body(
        _chat(),
        Message.user(
            "Transcribe",
            id="u",
            media=[
                AudioPart(media_type="audio/wav", data=WAV),
                AudioPart(media_type="audio/mpeg", data=b"ID3"),
            ],
        ),
    )
    assert body["messages"][0]["content"][1:] == [
        {
            "type": "input_audio",
            "input_audio": {"data": base64.b64encode(WAV).decode(), "format": "wav"},
        },
        {"type": "input_audio", "input_audio": {"data": "SUQz", "format": "mp3"}},
    ]


# -- Responses ---------------------------------------------------------------------------------


def test_responses_sends_input_image_and_input_file() -> None:
    body = _body(
        _responses(),
        _user(
            TextPart("Look"),
            ImagePart(media_type="image/jpeg", data=b"\xff\xd8\xff", detail="high"),
            ImagePart(url=URL),
            DocumentPart(media_type="application/pdf", data=PDF, title="paper.pdf"),
            DocumentPart(media_type="text/plain", data=b"notes"),
            DocumentPart(url=PDF_URL),
        ),
    )
    assert body["input"] == [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Look"},
                {
                    "type": "input_image",
                    "image_url": "data:image/jpeg;base64,/9j/",
                    "detail": "high",
                },
                {"type": "input_image", "image_url": URL, "detail": "auto"},
                {
                    "type": "input_file",
                    "filename": "paper.pdf",
                    "file_data": "data:application/pdf;base64," + base64.b64encode(PDF).decode(),
                },
                {
                    "type": "input_file",
                    "filename": "document.txt",
                    "file_data": "data:text/plain;base64,bm90ZXM=",
                },
                {"type": "input_file", "file_url": PDF_URL},
            ],
        }
    ]


def test_responses_puts_a_tool_results_media_in_its_output() -> None:
    image = ImagePart(media_type="image/png", data=PNG)
    body = _body(_responses(), *_with_result(image, DocumentPart(url=PDF_URL, title="p.pdf")))
    assert body["input"][2] == {
        "type": "function_call_output",
        "call_id": "c1",
        "output": [
            {"type": "input_text", "text": "a chart"},
            {
                "type": "input_image",
                "image_url": "data:image/png;base64," + base64.b64encode(PNG).decode(),
                "detail": "auto",
            },
            {"type": "input_file", "file_url": PDF_URL, "filename": "p.pdf"},
        ],
    }
    body = _body(_responses(), *_with_result(ImagePart(url=URL), content=""))
    assert body["input"][2]["output"] == [
        {"type": "input_image", "image_url": URL, "detail": "auto"}
    ]
    plain = _body(_responses(), *_with_result())
    assert plain["input"][2]["output"] == "a chart"


def test_responses_sends_back_encrypted_reasoning_without_an_id() -> None:
    model = _responses()
    carried = ReasoningPart("", {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"})
    lost = ReasoningPart("", {"type": "reasoning", "summary": []})
    turn = Message(id="a", role="assistant", parts=(carried, lost, TextPart("Hi")))
    body = _body(model, Message.user("hi", id="u"), turn)
    assert body["input"][1:] == [
        {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"},
        {"role": "assistant", "content": "Hi"},
    ]


# -- Anthropic ---------------------------------------------------------------------------------


def test_anthropic_sends_image_and_document_blocks_with_cache_control() -> None:
    body = _body(
        _anthropic(),
        _user(
            ImagePart(media_type="image/png", data=PNG, detail="high"),
            ImagePart(url=URL, cache=True),
            TextPart("Read these"),
            DocumentPart(media_type="application/pdf", data=PDF, title="Paper"),
            DocumentPart(url=PDF_URL, cache=True),
            DocumentPart(media_type="text/plain", data="café".encode()),
        ),
    )
    b64 = base64.b64encode
    assert body["messages"] == [
        {
            "role": "user",
            "content": [
                {
                    "type": "image",
                    "source": {
                        "type": "base64",
                        "media_type": "image/png",
                        "data": b64(PNG).decode(),
                    },
                },
                {
                    "type": "image",
                    "source": {"type": "url", "url": URL},
                    "cache_control": {"type": "ephemeral"},
                },
                {"type": "text", "text": "Read these"},
                {
                    "type": "document",
                    "source": {
                        "type": "base64",
                        "media_type": "application/pdf",
                        "data": b64(PDF).decode(),
                    },
                    "title": "Paper",
                },
                {
                    "type": "document",
                    "source": {"type": "url", "url": PDF_URL},
                    "cache_control": {"type": "ephemeral"},
                },
                {
                    "type": "document",
                    "source": {"type": "text", "media_type": "text/plain", "data": "café"},
                },
            ],
        }
    ]


def test_anthropic_puts_a_tool_results_media_inside_its_block() -> None:
    image = ImagePart(media_type="image/jpg", data=b"\xff\xd8\xff")
    body = _body(_anthropic(), *_with_result(image, DocumentPart(url=PDF_URL)))
    assert body["messages"][2] == {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "c1",
                "content": [
                    {"type": "text", "text": "a chart"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/jpeg", "data": "/9j/"},
                    },
                    {"type": "document", "source": {"type": "url", "url": PDF_URL}},
                ],
                "is_error": False,
            }
        ],
    }
    blank = _body(_anthropic(), *_with_result(ImagePart(url=URL), content=" "))
    assert blank["messages"][2]["content"][0]["content"] == [
        {"type": "image", "source": {"type": "url", "url": URL}}
    ]
    plain = _body(_anthropic(), *_with_result())
    assert plain["messages"][2]["content"][0]["content"] == "a chart"


# -- refused before any request ----------------------------------------------------------------


class _Recorder:
    """An httpx transport handler that records every request it is asked to send."""

    def __init__(self) -> None:
        self.sent: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        return httpx.Response(500)


def _system(*parts: Part) -> Message:
    return Message(id="s", role="system", parts=parts)


def _assistant(*parts: Part) -> Message:
    return Message(id="a", role="assistant", parts=parts)


_GIF = ImagePart(media_type="image/bmp", data=b"BM")
_REFUSED: list[tuple[Any, Sequence[Message], str]] = [
    (_chat, _with_result(ImagePart(url=URL)), "cannot send a ImagePart in a tool result"),
    (_compatible, _with_result(ImagePart(url=URL)), "cannot send a ImagePart in a tool result"),
    (_chat, [_user(DocumentPart(url=PDF_URL))], "not by URL"),
    (_chat, [_user(DocumentPart(media_type="text/plain", data=b"x"))], "PDF files only"),
    (_chat, [_user(AudioPart(url="https://a.test/x.wav"))], "WAV or MP3 bytes"),
    (_chat, [_user(AudioPart(media_type="audio/ogg", data=b"OggS"))], "WAV or MP3 bytes"),
    (_chat, [_user(_GIF)], "PNG, JPEG, GIF and WebP"),
    (_chat, [_system(TextPart("s"), ImagePart(url=URL))], "in user messages only"),
    (_chat, [_assistant(ImagePart(url=URL))], "in user messages only"),
    (_responses, [_user(AudioPart(media_type="audio/wav", data=WAV))], "cannot send a AudioPart"),
    (_responses, [_user(_GIF)], "PNG, JPEG, GIF and WebP"),
    (_responses, [_system(ImagePart(url=URL))], "user messages and tool results only"),
    (_responses, [_assistant(DocumentPart(url=PDF_URL))], "user messages and tool results only"),
    (_anthropic, [_user(AudioPart(media_type="audio/wav", data=WAV))], "cannot send a AudioPart"),
    (_anthropic, [_user(_GIF)], "PNG, JPEG, GIF and WebP"),
    (_anthropic, [_user(DocumentPart(media_type="application/msword", data=b"x"))], "PDF and"),
    (_anthropic, [_user(DocumentPart(media_type="text/plain", data=b"\xff"))], "UTF-8"),
    (_anthropic, [_system(TextPart("s"), DocumentPart(url=PDF_URL))], "user turns and tool"),
    (_anthropic, [_assistant(ImagePart(url=URL))], "user turns and tool"),
    (
        _anthropic,
        [_user(*[ImagePart(url=URL, cache=True)] * 5)],
        "5 media parts with the cache hint: the Messages API takes at most 4",
    ),
]


@pytest.mark.parametrize(
    ("make", "messages", "match"),
    _REFUSED,
    ids=[f"{m.__name__.strip('_')}-{i}" for i, (m, _, _) in enumerate(_REFUSED)],
)
async def test_a_part_an_adapter_cannot_send_is_refused_before_any_request(
    make: Any, messages: Sequence[Message], match: str
) -> None:
    recorder = _Recorder()
    async with httpx.AsyncClient(transport=httpx.MockTransport(recorder)) as client:
        model = make(client)
        with pytest.raises(ConfigurationError, match=match) as caught:
            await model.request(ModelRequest(messages=tuple(messages)))
        with pytest.raises(ConfigurationError, match=match):  # streaming: the same
            await model.request(ModelRequest(messages=tuple(messages)), on_chunk=_ignore)
    assert recorder.sent == []
    assert model.name in str(caught.value)  # says which adapter refused
    assert "b'" not in str(caught.value)  # never the bytes themselves


async def _ignore(chunk: object) -> None:
    return None


# -- invariants --------------------------------------------------------------------------------

_IMAGE_TYPES = st.sampled_from(["image/png", "image/jpeg", "image/gif", "image/webp"])


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=1, max_size=2048), media_type=_IMAGE_TYPES)
def test_any_bytes_survive_the_data_url_and_the_base64(data: bytes, media_type: str) -> None:
    image = ImagePart(media_type=media_type, data=data)
    chat = _body(_chat(), _user(image))["messages"][0]["content"][0]["image_url"]["url"]
    responses = _body(_responses(), _user(image))["input"][0]["content"][0]["image_url"]
    anthropic = _body(_anthropic(), _user(image))["messages"][0]["content"][0]["source"]
    assert from_data_url(chat) == from_data_url(responses) == (media_type, data)
    assert chat.startswith(f"data:{media_type};base64,")
    assert base64.b64decode(anthropic["data"], validate=True) == data
    pdf = DocumentPart(media_type="application/pdf", data=data)
    file = _body(_chat(), _user(pdf))["messages"][0]["content"][0]["file"]["file_data"]
    assert from_data_url(file) == ("application/pdf", data)


_TEXT = st.text(alphabet="abc xyz", min_size=1, max_size=8).filter(str.strip)
_BYTES = st.binary(min_size=1, max_size=64)


def _images(details: Sequence[Any], cache: bool) -> st.SearchStrategy[ImagePart]:
    return st.one_of(
        st.builds(
            ImagePart,
            media_type=_IMAGE_TYPES,
            data=_BYTES,
            detail=st.sampled_from(details),
            cache=st.just(False) if not cache else st.booleans(),
        ),
        st.builds(
            ImagePart,
            url=st.sampled_from([URL, "https://example.com/b.png"]),
            detail=st.sampled_from(details),
            cache=st.just(False) if not cache else st.booleans(),
        ),
    )


def _user_parts(media: st.SearchStrategy[Part]) -> st.SearchStrategy[tuple[Part, ...]]:
    """User message parts, at least one of them media, text never next to text."""
    one = st.one_of(media, media, _TEXT.map(TextPart))
    return (
        st.lists(one, min_size=1, max_size=5)
        .filter(
            lambda parts: (
                any(not isinstance(p, TextPart) for p in parts)
                and not any(
                    isinstance(a, TextPart) and isinstance(b, TextPart)
                    for a, b in itertools.pairwise(parts)
                )
            )
        )
        .map(tuple)
    )


_CHAT_MEDIA: st.SearchStrategy[Part] = st.one_of(
    _images([None, "auto", "low", "high"], cache=False),
    st.builds(DocumentPart, media_type=st.just("application/pdf"), data=_BYTES, title=_TEXT),
    st.builds(AudioPart, media_type=st.sampled_from(["audio/wav", "audio/mpeg"]), data=_BYTES),
)
_RESPONSES_MEDIA: st.SearchStrategy[Part] = st.one_of(
    _images(["auto", "low", "high"], cache=False),
    st.builds(
        DocumentPart,
        media_type=st.sampled_from(["application/pdf", "text/plain"]),
        data=_BYTES,
        title=_TEXT,
    ),
    st.builds(DocumentPart, url=st.just(PDF_URL)),
)
_ANTHROPIC_MEDIA: st.SearchStrategy[Part] = st.one_of(
    _images([None], cache=True),
    st.builds(
        DocumentPart,
        media_type=st.just("application/pdf"),
        data=_BYTES,
        title=st.none() | _TEXT,
        cache=st.booleans(),
    ),
    st.builds(
        DocumentPart,
        media_type=st.just("text/plain"),
        data=_TEXT.map(str.encode),
        cache=st.booleans(),
    ),
    st.builds(DocumentPart, url=st.just(PDF_URL), title=st.none() | _TEXT, cache=st.booleans()),
)


@pytest.mark.parametrize(
    ("make", "spec", "media"),
    [
        (_chat, spec_openai_chat, _CHAT_MEDIA),
        (_responses, spec_openai_responses, _RESPONSES_MEDIA),
        (_anthropic, spec_anthropic, _ANTHROPIC_MEDIA),
    ],
    ids=["chat", "responses", "anthropic"],
)
def test_the_specs_read_what_the_adapters_send_back_into_the_same_parts(
    make: Any, spec: Any, media: st.SearchStrategy[Part]
) -> None:
    """Written apart from the adapters, each spec decodes the adapter's body into the
    very parts it was built from: nothing dropped, reordered or re-typed."""

    @settings(max_examples=40, deadline=None)
    @given(parts=_user_parts(media))
    def check(parts: tuple[Part, ...]) -> None:
        assume(sum(getattr(p, "cache", False) for p in parts) <= 4)  # Anthropic's limit
        body = _body(make(), _user(*parts))
        request, _ = spec.decode_request(body)
        assert request.messages == (_user(*parts),)

    check()


def _chat_media(client: httpx.AsyncClient = _UNUSED) -> OpenAIChatModel:
    return OpenAIChatModel("gpt-4o", api_key="sk-review", client=client)


def _responses_media(client: httpx.AsyncClient = _UNUSED) -> OpenAIResponsesModel:
    return OpenAIResponsesModel("gpt-4o", api_key="sk-review", client=client)


def _anthropic_media(client: httpx.AsyncClient = _UNUSED) -> AnthropicModel:
    return AnthropicModel("claude-sonnet-4-5", api_key="sk-ant-review", client=client)


ADAPTERS = [_chat_media, _responses_media, _anthropic_media]


ADAPTER_IDS = ["chat", "responses", "anthropic"]


# -- what reaches the wire ---------------------------------------------------------------------


class _RecorderMedia:
    def __init__(self) -> None:
        self.sent: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        return httpx.Response(500, json={"error": {"message": "should not be reached"}})


async def _refused_before_any_request(make: Any, messages: Sequence[Message]) -> None:
    recorder = _RecorderMedia()
    async with httpx.AsyncClient(transport=httpx.MockTransport(recorder)) as client:
        model = make(client)
        with anyio.fail_after(10), pytest.raises(ConfigurationError):
            await model.request(ModelRequest(messages=tuple(messages)))
    assert recorder.sent == []


@pytest.mark.parametrize(
    ("make", "media_type"),
    [
        pytest.param(_chat_media, "image/png", id="chat-png"),
        pytest.param(_responses_media, "image/png", id="responses-png"),
        pytest.param(_anthropic_media, "image/png", id="anthropic-png"),
        pytest.param(_responses_media, "image/tiff", id="responses-tiff"),
        pytest.param(_chat_media, "image/tiff", id="chat-tiff"),
        pytest.param(_anthropic_media, "image/tiff", id="anthropic-tiff"),
    ],
)
async def test_an_empty_image_is_refused_before_any_request(make: Any, media_type: str) -> None:
    try:
        empty = ImagePart(media_type=media_type, data=b"")
    except InvalidFieldError:
        return  # refused where it is made: right too
    await _refused_before_any_request(make, [Message.user("look", id="u", media=[empty])])


def test_an_mcp_image_with_no_data_is_named_not_stored() -> None:
    from mcp.types import CallToolResult, ImageContent

    from stepmachine.operations._mcp_tool import result_output

    output = result_output(
        CallToolResult(content=[ImageContent(type="image", data="", mime_type="image/png")])
    )
    assert all(part.data for part in output.media)


@pytest.mark.parametrize("media_type", ["application/zip", "application/pdf; charset=binary"])
async def test_responses_refuses_a_document_type_it_cannot_name(media_type: str) -> None:
    document = DocumentPart(media_type=media_type, data=b"PK\x03\x04")
    await _refused_before_any_request(
        _responses_media, [Message.user("read", id="u", media=[document])]
    )


@pytest.mark.parametrize("make", ADAPTERS, ids=ADAPTER_IDS)
@pytest.mark.parametrize(
    "part",
    [
        ImagePart(media_type="image/png; charset=x", data=b"\x89PNG"),
        ImagePart(media_type="image/PNG", data=b"\x89PNG"),
        ImagePart(media_type="image/svg+xml", data=b"<svg/>"),
        AudioPart(media_type="audio/flac", data=b"fLaC"),
    ],
    ids=["params", "upper", "svg", "flac"],
)
async def test_an_image_type_with_parameters_or_odd_case_is_refused_before_any_request(
    make: Any, part: ImagePart | AudioPart
) -> None:
    await _refused_before_any_request(make, [Message.user("look", id="u", media=[part])])


def test_an_upper_case_kind_is_refused_where_the_part_is_made() -> None:
    with pytest.raises(InvalidFieldError, match="media_type"):
        ImagePart(media_type="IMAGE/PNG", data=b"x")


@pytest.mark.parametrize(
    "make", [_responses_media, _anthropic_media], ids=["responses", "anthropic"]
)
def test_several_results_in_one_tool_message_each_keep_their_own_media(make: Any) -> None:
    conversation = [
        Message.user("go", id="u"),
        Message(
            id="a",
            role="assistant",
            parts=(ToolCallPart.parse("c1", "t", "{}"), ToolCallPart.parse("c2", "t", "{}")),
        ),
        Message(
            id="t",
            role="tool",
            parts=(ToolResultPart("c1", "one"), SHOT, ToolResultPart("c2", ""), OTHER),
        ),
    ]
    body = _body(make(), *conversation)
    shot, other = (base64.b64encode(p.data or b"").decode() for p in (SHOT, OTHER))
    if make is _responses_media:
        outputs = {i["call_id"]: str(i["output"]) for i in body["input"] if "output" in i}
    else:
        blocks = body["messages"][-1]["content"]
        outputs = {b["tool_use_id"]: str(b["content"]) for b in blocks}
        assert [b["type"] for b in blocks] == ["tool_result", "tool_result"]
    assert shot in outputs["c1"]
    assert other not in outputs["c1"]
    assert other in outputs["c2"]
    assert shot not in outputs["c2"]


@settings(max_examples=150, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["result", "image", "document", "text"]), max_size=8),
    user_after=st.booleans(),
)
def test_every_media_part_of_a_tool_message_goes_out_exactly_once(
    kinds: list[str], user_after: bool
) -> None:
    calls: list[ToolCallPart] = []
    parts: list[Any] = []
    media: list[ImagePart | DocumentPart] = []
    for n, kind in enumerate(kinds):
        if kind == "result":
            calls.append(ToolCallPart.parse(f"c{n}", "t", "{}"))
            parts.append(ToolResultPart(f"c{n}", "" if n % 2 else f"r{n}"))
        elif kind == "text":
            parts.append(TextPart(f"t{n}"))
        else:
            data = f"{kind}-{n}-payload".encode()
            part = (
                ImagePart(media_type="image/png", data=data)
                if kind == "image"
                else DocumentPart(media_type="application/pdf", data=data)
            )
            parts.append(part)
            media.append(part)
    conversation = [Message.user("go", id="u")]
    if calls:
        conversation.append(Message(id="a", role="assistant", parts=tuple(calls)))
    conversation.append(Message(id="t", role="tool", parts=(*parts, TextPart("end"))))
    if user_after:
        later = ImagePart(media_type="image/gif", data=b"GIF89a-later")
        conversation.append(Message.user("next", id="u2", media=[later]))
    for make in (_responses_media, _anthropic_media):
        body = msgspec.json.encode(_body(make(), *conversation)).decode()
        for part in media:
            assert body.count(base64.b64encode(part.data or b"").decode()) == 1


@pytest.mark.parametrize("make", ADAPTERS, ids=ADAPTER_IDS)
async def test_media_in_an_assistant_or_system_message_is_refused_before_any_request(
    make: Any,
) -> None:
    system = Message(id="s", role="system", parts=(TextPart("be brief"), SHOT))
    await _refused_before_any_request(make, [system, Message.user("hi", id="u")])
    assistant = Message(id="a", role="assistant", parts=(TextPart("look"), SHOT))
    await _refused_before_any_request(make, [Message.user("hi", id="u"), assistant])


@settings(max_examples=40, deadline=None)
@given(data=st.binary(min_size=1, max_size=512))
def test_any_bytes_leave_every_adapter_in_standard_padded_base64(data: bytes) -> None:
    image = ImagePart(media_type="image/png", data=data)
    expected = base64.b64encode(data).decode()
    for make in (_chat_media, _responses_media, _anthropic_media):
        text = msgspec.json.encode(_body(make(), Message.user("x", id="u", media=[image])))
        assert expected.encode() in text
