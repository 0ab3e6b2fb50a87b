"""Media parts in the inspector: metadata in the JSON view, terminal and HTML, never bytes."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

from _html_dom import parse
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from stepmachine import (
    AppendMessage,
    AudioPart,
    DocumentPart,
    ImagePart,
    Message,
    ReplaceConversation,
    ToolCallPart,
    ToolResultPart,
)
from stepmachine.extend import Batch, media_digest
from stepmachine.inspector import (
    media_label,
    render_batch,
    render_html,
    render_page,
    session_view,
)
from stepmachine.inspector._terminal import print_log, print_show
from stepmachine.testing import make_session

# Bytes whose base64 (and hex) is easy to look for, and that no label could contain.
SECRET_PIXELS = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
PDF = b"%PDF-1.4\n1 0 obj << /Type /Page >> endobj\n" + bytes(range(200))
WAV = b"RIFF\x00\x00\x00\x00WAVE" + bytes(range(100))


def marks(data: bytes) -> list[str]:
    """Ways the bytes could leak into text: base64 (standard and url-safe), hex, repr."""
    return [
        base64.b64encode(data).decode()[:40],
        base64.urlsafe_b64encode(data).decode()[:40],
        data.hex()[:40],
        repr(data)[2:42],
    ]


def media_session() -> tuple[Any, list[Batch[Any]]]:
    image = ImagePart(media_type="image/png", data=SECRET_PIXELS, detail="low", cache=True)
    document = DocumentPart(media_type="application/pdf", data=PDF, title="invoice.pdf")
    linked = ImagePart(url="https://example.com/chart.png")
    audio = AudioPart(media_type="audio/wav", data=WAV)
    call = ToolCallPart.of("c1", "screenshot", {})
    messages = [
        Message.user("what is on these?", id="u1", media=[image, document, linked, audio]),
        Message.assistant([call], id="a1"),
        Message.tool_result(
            ToolResultPart.for_call(call, "[image follows: image/png]"), id="t1", media=[image]
        ),
    ]
    session = make_session(*messages, session_id="media", revision=4)
    batches: list[Batch[Any]] = [
        Batch("media", 1, "app", 0, 1.0, (AppendMessage(messages[0]),)),
        Batch("media", 2, "inference", 0, 2.0, (AppendMessage(messages[1]),)),
        Batch("media", 3, "tools", 0, 3.0, (AppendMessage(messages[2]),)),
        Batch("media", 4, "compaction", 0, 4.0, (ReplaceConversation(tuple(messages[1:])),)),
    ]
    return session, batches


def test_the_json_view_holds_metadata_and_no_bytes() -> None:
    session, batches = media_session()
    view = session_view(session, batches)
    text = json.dumps(view)
    for data in (SECRET_PIXELS, PDF, WAV):
        for mark in marks(data):
            assert mark not in text
    image, document, linked, audio = view["messages"][0]["parts"][1:]
    assert image == {
        "type": "image",
        "media_type": "image/png",
        "size": len(SECRET_PIXELS),
        "digest": media_digest(SECRET_PIXELS),
        "url": None,
        "detail": "low",
        "title": None,
        "cache": True,
        "estimated_tokens": image["estimated_tokens"],
    }
    assert image["estimated_tokens"] > 0
    assert (document["type"], document["title"], document["size"]) == (
        "document",
        "invoice.pdf",
        len(PDF),
    )
    assert (linked["url"], linked["size"], linked["digest"]) == (
        "https://example.com/chart.png",
        None,
        None,
    )
    assert (audio["type"], audio["media_type"]) == ("audio", "audio/wav")
    # the tool message: the result, then its image
    assert [p["type"] for p in view["messages"][2]["parts"]] == ["tool_result", "image"]
    summaries = [b["summary"] for b in view["batches"]]
    assert "image image/png, 1,032 bytes, sha256:" in summaries[0]
    assert "document 'invoice.pdf' application/pdf" in summaries[0]
    assert "https://example.com/chart.png (url)" in summaries[0]


def test_a_label_says_kind_type_size_digest_url_and_hints() -> None:
    view = {
        "type": "image",
        "media_type": "image/png",
        "size": 2048,
        "digest": "sha256:" + "ab" * 32,
        "url": None,
        "detail": "high",
        "cache": True,
    }
    assert media_label(view) == "image image/png, 2,048 bytes, sha256:abababab…, detail high, cache"
    assert media_label({"type": "document", "title": "a.pdf", "url": "https://x/a.pdf"}) == (
        "document 'a.pdf' https://x/a.pdf (url)"
    )


def test_the_html_shows_metadata_loads_no_image_and_holds_no_bytes() -> None:
    session, batches = media_session()
    view = session_view(session, batches)
    pages = [render_html(view), render_page(view, live_script="/* live */")]
    pages.extend(render_batch(batch) for batch in view["batches"])
    for page in pages:
        for data in (SECRET_PIXELS, PDF, WAV):
            for mark in marks(data):
                assert mark not in page
        assert "data:" not in page
    root = parse(pages[0])
    assert not root.find_all("img")  # no thumbnail: the page's policy loads no image
    (csp,) = [m for m in root.find_all("meta") if m.attrs.get("http-equiv")]
    policy = csp.attrs["content"] or ""
    assert "default-src 'none'" in policy
    assert "img-src" not in policy
    shown = root.by_id("msg-u1").text()
    assert "image image/png, 1,032 bytes, sha256:" in shown
    assert "detail low" in shown
    assert "document 'invoice.pdf' application/pdf" in shown
    assert "audio audio/wav" in shown
    assert "tokens)" in shown
    assert "image image/png" in root.by_id("msg-t1").text()


def test_the_terminal_shows_metadata_and_no_bytes() -> None:
    session, batches = media_session()
    view = session_view(session, batches)
    out = io.StringIO()
    console = Console(file=out, width=200, color_system=None)
    print_show(console, view, notes=True)
    print_log(console, view["batches"])
    printed = out.getvalue()
    for data in (SECRET_PIXELS, PDF, WAV):
        for mark in marks(data):
            assert mark not in printed
    assert "[image image/png, 1,032 bytes, sha256:" in printed
    assert "[document 'invoice.pdf' application/pdf" in printed


@given(st.binary(min_size=12, max_size=2_000))
def test_no_bytes_of_any_image_reach_the_view_or_the_page(data: bytes) -> None:
    image = ImagePart(media_type="image/png", data=data)
    message = Message.user("look", id="u1", media=[image])
    session = make_session(message, session_id="h", revision=1)
    view = session_view(session, [Batch("h", 1, "app", 0, 1.0, (AppendMessage(message),))])
    text, page = json.dumps(view), render_html(view)
    encoded = base64.b64encode(data).decode()[:16]
    assert encoded not in text
    assert encoded not in page
