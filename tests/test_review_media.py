"""An outside review of the multimodal half of issue 14 (media parts, adapters, estimates).

Each test states the right behaviour. Where the library does not keep it, the test is
marked ``xfail(strict=True, reason="DEFECT: ...")``: the suite stays green, and the
mark comes off (strict makes the test fail loudly) once the defect is fixed. Tests
without the mark are what held up under attack.

Sections: the token estimator under hostile headers; data: URLs and bytes where they
must never appear; media dropped or moved (tools, HistoryGuard, compaction, tool
callers); what reaches the wire; stored data; stores.
"""

from __future__ import annotations

import base64
import random
import struct
import tempfile
import tracemalloc
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest
from _observability import Spans
from hypothesis import given, settings
from hypothesis import strategies as st

from stepmachine import (
    AppendMessage,
    AudioPart,
    Codec,
    ConfigurationError,
    DocumentPart,
    ImagePart,
    InvalidFieldError,
    Message,
    ModelInference,
    ModelRequest,
    Runtime,
    StateMachine,
    StepContractError,
    StoredDataError,
    TextPart,
    ToolCallPart,
    ToolContext,
    ToolOutput,
    ToolResultPart,
    Tools,
    submit,
    tool,
)
from stepmachine._media_tokens import PDF_PAGE_TOKENS, image_size, pdf_pages
from stepmachine._tools import media_line
from stepmachine.extend import counter_ids, media_tokens, message_tokens
from stepmachine.operations import Compaction, HistoryGuard, render_transcript
from stepmachine.providers import (
    AnthropicModel,
    HTTPModel,
    OpenAIChatModel,
    OpenAIResponsesModel,
)
from stepmachine.stores import FileStore, MemoryStore, SQLiteStore
from stepmachine.testing import ScriptedModel, call, make_session, reply, run_step

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


def _body(model: HTTPModel, *messages: Message) -> dict[str, Any]:
    return model.build_body(ModelRequest(messages=messages), stream=False)


_UNUSED = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(599)))


def _chat(client: httpx.AsyncClient = _UNUSED) -> OpenAIChatModel:
    return OpenAIChatModel("gpt-4o", api_key="sk-review", client=client)


def _responses(client: httpx.AsyncClient = _UNUSED) -> OpenAIResponsesModel:
    return OpenAIResponsesModel("gpt-4o", api_key="sk-review", client=client)


def _anthropic(client: httpx.AsyncClient = _UNUSED) -> AnthropicModel:
    return AnthropicModel("claude-sonnet-4-5", api_key="sk-ant-review", client=client)


ADAPTERS = [_chat, _responses, _anthropic]
ADAPTER_IDS = ["chat", "responses", "anthropic"]


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


# -- data: URLs and bytes where they must never appear -----------------------------------------

_PAYLOAD = bytes(random.Random(14).getrandbits(8) for _ in range(30_000))
_B64 = base64.b64encode(_PAYLOAD).decode()
DATA_URL_IMAGE = ImagePart(url="data:image/png;base64," + _B64)
DATA_URL_PDF = DocumentPart(url="data:application/pdf;base64," + _B64)


def test_a_data_url_is_never_dumped_into_reprs_result_text_or_errors() -> None:
    assert _B64[:200] not in repr(DATA_URL_IMAGE)
    assert _B64[:200] not in media_line(DATA_URL_IMAGE)
    assert _B64[:200] not in ToolOutput(media=[DATA_URL_IMAGE]).content
    # A data: URL is taken as the bytes it holds (so Chat, which takes no document URL,
    # sends the PDF as bytes).
    assert DATA_URL_PDF.url is None
    assert DATA_URL_PDF.data
    _body(_chat(), Message.user("read", id="u", media=[DATA_URL_PDF]))


def test_the_inspector_never_shows_the_base64_of_a_data_url() -> None:
    from inspector._view import media_label, media_view, message_view

    view = media_view(DATA_URL_IMAGE)
    assert _B64[:200] not in media_label(view)
    message = Message.user("look", id="u", media=[DATA_URL_IMAGE])
    assert _B64[:200] not in msgspec.json.encode(message_view(message)).decode()


def test_anthropic_never_sends_a_data_url_as_a_url_source() -> None:
    try:
        body = _body(_anthropic(), Message.user("look", id="u", media=[DATA_URL_IMAGE]))
    except ConfigurationError:
        return
    source = body["messages"][0]["content"][1]["source"]
    assert source["type"] == "base64", source["type"]
    assert source["data"] == _B64


def test_refusing_a_bytearray_does_not_repr_it_whole() -> None:
    data = bytearray(10_000_000)
    tracemalloc.start()
    try:
        with pytest.raises(InvalidFieldError, match="data") as caught:
            ImagePart(media_type="image/png", data=data)  # type: ignore[arg-type]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "\\x00\\x00\\x00" not in str(caught.value)
    assert peak < len(data) // 2, f"{peak:,} bytes allocated to refuse {len(data):,}"


async def test_content_capture_describes_media_instead_of_dumping_their_bytes() -> None:
    image = ImagePart(media_type="image/png", data=png_header(64, 64) + _PAYLOAD[:2_000])
    spans = Spans()
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("look", id="u1", media=[image])])
    runtime = Runtime(
        store=store,
        model=ScriptedModel([reply("a cat")]),
        ids=counter_ids(),
        telemetry=spans.telemetry(capture_content=True),
    )
    with anyio.fail_after(10):
        await StateMachine([ModelInference()]).run(runtime, "s")
    captured = [
        str(value)
        for span in spans.finished
        for key, value in (span.attributes or {}).items()
        if key == "gen_ai.input.messages"
    ]
    assert captured, "capture on: the chat span holds the input messages"
    encoded = base64.b64encode(image.data or b"").decode()
    assert all(encoded[:64] not in text for text in captured)


# -- media dropped, moved or turned into text ---------------------------------------------------

PNG = png_header(64, 64)
SHOT = ImagePart(media_type="image/png", data=PNG + b"shot")
OTHER = ImagePart(media_type="image/png", data=PNG + b"other")


@tool
def screenshots() -> list[ImagePart]:  # what a Runtime.tool_caller answers for below
    """Two screenshots."""
    return [SHOT, OTHER]


VOICE = AudioPart(media_type="audio/wav", data=b"RIFF" + bytes(range(256)) * 4)


@pytest.mark.parametrize(
    ("returned", "media"),
    [([SHOT, OTHER], (SHOT, OTHER)), (VOICE, ()), ({"chart": SHOT}, (SHOT,))],
    ids=["list", "audio", "dict"],
)
async def test_media_a_tool_returns_never_becomes_base64_text(
    returned: object, media: tuple[ImagePart, ...]
) -> None:
    @tool(name="draw")
    def draw() -> Any:
        """Return what the test gives."""
        return returned

    store = MemoryStore()
    await store.create("s", conversation=[Message.user("look", id="u1")])
    model = ScriptedModel([call(("draw", {})), reply("seen")])
    with anyio.fail_after(10):
        session = await StateMachine([Tools([draw]), ModelInference()]).run(
            Runtime(store=store, model=model, ids=counter_ids()), "s"
        )
    (message,) = [m for m in session.conversation if m.role == "tool"]
    (result,) = message.tool_results
    for part in (SHOT, VOICE):
        assert base64.b64encode(part.data or b"").decode()[:40] not in result.content
    assert result.is_error or message.result_media(result.call_id) == media


@pytest.mark.parametrize("mime_type", ["image/svg+xml", "image/bmp"])
def test_an_mcp_image_no_adapter_can_send_is_named_not_stored(mime_type: str) -> None:
    from mcp.types import CallToolResult, ImageContent

    from stepmachine.operations._mcp_tool import result_output

    block = ImageContent(
        type="image", data=base64.b64encode(b"<svg/>").decode(), mime_type=mime_type
    )
    output = result_output(CallToolResult(content=[block]))
    assert output.media == ()
    assert mime_type in output.content


@pytest.mark.parametrize(
    "extra",
    [
        (TextPart("caption"), SHOT),
        (AudioPart(media_type="audio/wav", data=b"RIFF-voice"),),
    ],
    ids=["image-after-text", "audio"],
)
async def test_a_tool_callers_tool_message_is_kept_whole_or_refused(
    extra: tuple[Any, ...],
) -> None:
    async def caller(part: ToolCallPart, context: ToolContext) -> Message:
        result = ToolResultPart.for_call(part, "done")
        return Message(id="x", role="tool", parts=(result, *extra))

    store = MemoryStore()
    await store.create("s", conversation=[Message.user("look", id="u1")])
    model = ScriptedModel([call(("screenshots", {})), reply("seen")])
    runtime = Runtime(store=store, model=model, ids=counter_ids(), tool_caller=caller)
    machine = StateMachine([Tools([screenshots]), ModelInference()])
    refused: StepContractError | None = None
    try:
        with anyio.fail_after(10):
            session = await machine.run(runtime, "s")
    except StepContractError as exc:  # refusing the answer is right too
        refused = exc
    if refused is not None:
        assert "tool_caller" in str(refused)
        return
    (message,) = [m for m in session.conversation if m.role == "tool"]
    assert message.parts[1:] == extra


def _tool_turn(*parts: Any) -> list[Message]:
    return [
        Message.user("go", id="u"),
        Message(id="a", role="assistant", parts=(ToolCallPart.parse("c1", "t", "{}"),)),
        Message(id="t", role="tool", parts=parts),
    ]


@pytest.mark.parametrize("bad_first", [False, True], ids=["bad-last", "bad-first"])
async def test_history_guard_drops_a_bad_results_media_with_it(bad_first: bool) -> None:
    good = (ToolResultPart("c1", "ok"), SHOT)
    bad = (ToolResultPart("zz", "orphan"), OTHER)
    parts = (*bad, *good) if bad_first else (*good, *bad)
    with anyio.fail_after(10):
        check = await run_step(HistoryGuard(), make_session(*_tool_turn(*parts)))
    assert check.continued
    visible = [m for m in check.session.conversation if m.visible_to_model and m.role == "tool"]
    (copy,) = visible
    assert copy.result_media("c1") == (SHOT,)
    assert OTHER not in copy.parts  # the orphan's image went with it (hidden, kept in history)


def test_the_compaction_transcript_names_the_media_it_summarises() -> None:
    invoice = DocumentPart(media_type="application/pdf", data=b"%PDF-1.4", title="invoice.pdf")
    transcript = render_transcript([Message.user("", id="u", media=[SHOT, invoice])])
    assert "image/png" in transcript
    assert "invoice.pdf" in transcript


async def test_compaction_keeps_every_media_part_of_the_messages_it_hides() -> None:
    # ReplaceConversation keeps the originals (hidden, with their media) in the same order.
    messages = [
        Message.user("first", id="u1", media=[SHOT]),
        Message.assistant("an image", id="a1"),
        Message.user("second", id="u2", media=[OTHER]),
    ]
    with anyio.fail_after(10):
        check = await run_step(
            Compaction(threshold=1, keep_turns=1),
            make_session(*messages),
            model=ScriptedModel([reply("s")]),
        )
    assert check.continued, check.outcome
    kept = {m.id: m for m in check.session.conversation}
    assert kept["u1"].parts == messages[0].parts
    assert not kept["u1"].visible_to_model
    assert kept["u2"].parts == messages[2].parts
    assert kept["u2"].visible_to_model


# -- what reaches the wire ---------------------------------------------------------------------


class _Recorder:
    def __init__(self) -> None:
        self.sent: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        return httpx.Response(500, json={"error": {"message": "should not be reached"}})


async def _refused_before_any_request(make: Any, messages: Sequence[Message]) -> None:
    recorder = _Recorder()
    async with httpx.AsyncClient(transport=httpx.MockTransport(recorder)) as client:
        model = make(client)
        with anyio.fail_after(10), pytest.raises(ConfigurationError):
            await model.request(ModelRequest(messages=tuple(messages)))
    assert recorder.sent == []


@pytest.mark.parametrize(
    ("make", "media_type"),
    [
        pytest.param(_chat, "image/png", id="chat-png"),
        pytest.param(_responses, "image/png", id="responses-png"),
        pytest.param(_anthropic, "image/png", id="anthropic-png"),
        pytest.param(_responses, "image/tiff", id="responses-tiff"),
        pytest.param(_chat, "image/tiff", id="chat-tiff"),
        pytest.param(_anthropic, "image/tiff", id="anthropic-tiff"),
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
    await _refused_before_any_request(_responses, [Message.user("read", id="u", media=[document])])


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


@pytest.mark.parametrize("make", [_responses, _anthropic], ids=["responses", "anthropic"])
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
    if make is _responses:
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
    for make in (_responses, _anthropic):
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
    for make in (_chat, _responses, _anthropic):
        text = msgspec.json.encode(_body(make(), Message.user("x", id="u", media=[image])))
        assert expected.encode() in text


# -- stored data is data (invariant 8) ---------------------------------------------------------


_GOOD = Codec().encode_message(
    Message.user("x", id="u", media=[ImagePart(media_type="image/png", data=b"abc")])
)


@pytest.mark.parametrize(
    ("old", "new", "says"),
    [
        (b'"type":"image"', b'"type":"video"', "type"),
        (b'"YWJj"', b'"!!!"', "base64"),
        (b'"YWJj"', b'"YW-j"', "base64"),  # url-safe alphabet: not what is stored
        (b'"YWJj"', b"null", "url"),
        (b'"image/png"', b'"text/plain"', "media_type"),
        (b'"image/png"', b"42", "media_type"),
        (b'"detail":null', b'"detail":"ultra"', "detail"),
        (b'"url":null', b'"url":"https://x"', "url"),
    ],
    ids=["tag", "base64", "urlsafe", "no-source", "kind", "type", "detail", "two-sources"],
)
def test_a_malformed_stored_media_part_is_a_clear_stored_data_error(
    old: bytes, new: bytes, says: str
) -> None:
    bad = _GOOD.replace(old, new)
    assert bad != _GOOD
    with pytest.raises(StoredDataError, match="session 's' position 3") as caught:
        Codec().decode_message(bad, where="session 's' position 3")
    assert says in str(caught.value)
    assert "abc" not in str(caught.value).replace("YWJj", "")


def test_an_unknown_part_tag_is_not_explained_with_the_effect_tags() -> None:
    bad = _GOOD.replace(b'"type":"image"', b'"type":"video"')
    with pytest.raises(StoredDataError) as caught:
        Codec().decode_message(bad, where="session 's' position 3")
    assert "effect tags" not in str(caught.value)
    assert "'video'" in str(caught.value)
    assert "part tags: ['audio', 'document', 'image'," in str(caught.value)


def test_an_unknown_effect_tag_is_still_explained_with_the_effect_tags() -> None:
    codec = Codec()
    good = codec.encode_effects([AppendMessage(Message.user("hi", id="u1"))])
    bad = good.replace(b'"append_message"', b'"append_video"')
    assert bad != good
    with pytest.raises(StoredDataError) as caught:
        codec.decode_effects(bad, where="session 's' position 3")
    assert "registered effect tags: ['annotate', 'append_message'" in str(caught.value)
    assert "part tags" not in str(caught.value)


# -- stores: fork and load_at keep media -------------------------------------------------------


@pytest.mark.parametrize("kind", ["sqlite", "file"])
async def test_fork_and_load_at_keep_media_byte_for_byte(kind: str) -> None:
    document = DocumentPart(media_type="application/pdf", data=b"%PDF-1.4\x00\xff" * 50)
    first = Message.user("look", id="u1", media=[SHOT, document])
    with tempfile.TemporaryDirectory() as folder:
        store: Any
        if kind == "sqlite":
            store = await SQLiteStore.open(Path(folder) / "db.sqlite3")
        else:
            store = await FileStore.open(Path(folder) / "files")
        try:
            with anyio.fail_after(20):
                await store.create("a", conversation=[first])
                await submit(store, "a", [AppendMessage(Message.assistant("seen", id="a1"))])
                await store.fork("a", 1, "b")
                forked = await store.load("b")
                earlier = await store.load_at("a", 0)
        finally:
            await store.aclose()
    assert forked.conversation[0] == first
    assert earlier.conversation[0] == first
    assert message_tokens(forked.conversation[0]) == message_tokens(first)
