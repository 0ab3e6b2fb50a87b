"""Media parts: images, documents and audio in messages and tool results."""

from __future__ import annotations

import base64
import hashlib
import random
import struct
import tracemalloc
import zlib
from typing import Any

import anyio
import httpx
import msgspec
import pytest
from _observability import Spans
from hypothesis import given
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
    tool,
)
from stepmachine._tools import media_line
from stepmachine.extend import counter_ids, media_digest
from stepmachine.operations import Compaction, HistoryGuard, render_transcript
from stepmachine.providers import AnthropicModel, HTTPModel, OpenAIChatModel
from stepmachine.stores import MemoryStore
from stepmachine.testing import ScriptedModel, call, make_session, reply, run_step

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


def png_header(width: int, height: int) -> bytes:
    """A PNG signature and a valid IHDR chunk declaring ``width`` x ``height`` (no pixels)."""
    ihdr = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + ihdr + struct.pack(">I", zlib.crc32(ihdr))


def _body(model: HTTPModel, *messages: Message) -> dict[str, Any]:
    return model.build_body(ModelRequest(messages=messages), stream=False)


_UNUSED = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(599)))


def _chat(client: httpx.AsyncClient = _UNUSED) -> OpenAIChatModel:
    return OpenAIChatModel("gpt-4o", api_key="sk-review", client=client)


def _anthropic(client: httpx.AsyncClient = _UNUSED) -> AnthropicModel:
    return AnthropicModel("claude-sonnet-4-5", api_key="sk-ant-review", client=client)


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

PNG_MEDIA = png_header(64, 64)
SHOT = ImagePart(media_type="image/png", data=PNG_MEDIA + b"shot")
OTHER = ImagePart(media_type="image/png", data=PNG_MEDIA + b"other")


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
