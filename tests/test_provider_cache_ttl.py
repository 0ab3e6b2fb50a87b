"""The cache hint's time to live: ``cache_ttl`` on image, document and audio parts.

* Anthropic marks ``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}``
  (no ``ttl`` when the hint has none: the API's default, five minutes); a one-hour
  breakpoint after a five-minute one is refused before any request (the API wants
  longer lives first);
* the other adapters have no per-part cache field: they send the same body with or
  without a TTL;
* a TTL is one of ``"5m"`` and ``"1h"``, and only with ``cache=True``: anything else is
  an :class:`InvalidFieldError` that names what is accepted;
* stored data evolves: a part stored before the field existed reads with
  ``cache_ttl=None``, and a TTL survives a durable store (bytes kept apart as a
  ``MediaRef``) and a load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stepmachine import (
    ConfigurationError,
    DocumentPart,
    ImagePart,
    InvalidFieldError,
    Message,
    ModelRequest,
)
from stepmachine._codec import Codec
from stepmachine.providers import (
    AnthropicModel,
    GeminiModel,
    OpenAIChatModel,
    OpenAIResponsesModel,
)
from stepmachine.stores import FileStore, SQLiteStore

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16
PDF = b"%PDF-1.4 cached"


def _anthropic() -> AnthropicModel:
    return AnthropicModel("claude-sonnet-4-5", api_key="sk-ant-test")


def _request(*parts: Any) -> ModelRequest:
    return ModelRequest(messages=(Message.user("look", id="u1", media=list(parts)),))


def _marks(body: dict[str, Any]) -> list[Any]:
    return [
        block.get("cache_control")
        for message in body["messages"]
        for block in message["content"]
        if block["type"] in ("image", "document")
    ]


@pytest.mark.parametrize("ttl", ["5m", "1h"])
def test_anthropic_sends_the_ttl_of_the_cache_hint(ttl: str) -> None:
    image = ImagePart(media_type="image/png", data=PNG, cache=True, cache_ttl=ttl)
    body = _anthropic().build_body(_request(image), stream=False)
    assert _marks(body) == [{"type": "ephemeral", "ttl": ttl}]


def test_anthropic_sends_no_ttl_for_a_hint_without_one() -> None:
    image = ImagePart(media_type="image/png", data=PNG, cache=True)
    document = DocumentPart(media_type="application/pdf", data=PDF)
    body = _anthropic().build_body(_request(image, document), stream=False)
    assert _marks(body) == [{"type": "ephemeral"}, None]


@pytest.mark.parametrize("first", ["5m", None])
def test_anthropic_refuses_a_longer_ttl_after_a_shorter_one(first: str | None) -> None:
    early = ImagePart(media_type="image/png", data=PNG, cache=True, cache_ttl=first)
    late = DocumentPart(media_type="application/pdf", data=PDF, cache=True, cache_ttl="1h")
    with pytest.raises(ConfigurationError, match=r"1h.*before"):
        _anthropic().build_body(_request(early, late), stream=False)
    # longest first is what the API takes
    body = _anthropic().build_body(_request(late, early), stream=False)
    assert [m["ttl"] if m and "ttl" in m else None for m in _marks(body)] == ["1h", first]


def _others() -> list[Any]:
    return [
        OpenAIChatModel("gpt-4o", api_key="sk-test"),
        OpenAIResponsesModel("gpt-4o", api_key="sk-test"),
        GeminiModel("gemini-2.5-flash", api_key="AIza-test"),
    ]


@pytest.mark.parametrize("model", _others(), ids=["chat", "responses", "gemini"])
def test_the_other_adapters_send_the_same_body_with_or_without_a_ttl(model: Any) -> None:
    plain = ImagePart(media_type="image/png", data=PNG, cache=True)
    timed = ImagePart(media_type="image/png", data=PNG, cache=True, cache_ttl="1h")
    assert model.build_body(_request(timed), stream=False) == model.build_body(
        _request(plain), stream=False
    )


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"cache": True, "cache_ttl": "2h"}, "'5m' or '1h'"),
        ({"cache": True, "cache_ttl": 300}, "'5m' or '1h'"),
        ({"cache_ttl": "1h"}, "cache=True"),
    ],
    ids=["unknown", "seconds", "without-cache"],
)
def test_a_ttl_that_cannot_be_sent_is_refused_where_the_part_is_made(
    fields: dict[str, Any], says: str
) -> None:
    for make in (
        lambda: ImagePart(media_type="image/png", data=PNG, **fields),
        lambda: DocumentPart(media_type="application/pdf", data=PDF, **fields),
    ):
        with pytest.raises(InvalidFieldError, match="cache_ttl") as caught:
            make()
        assert says in str(caught.value)


def test_a_part_stored_before_the_ttl_existed_reads_without_one() -> None:
    codec = Codec()
    encoded = codec.encode_message(
        Message.user(
            "x", id="u", media=[ImagePart(media_type="image/png", data=b"abc", cache=True)]
        )
    )
    record = json.loads(encoded)
    for part in record["parts"]:
        part.pop("cache_ttl", None)
    assert "cache_ttl" not in json.dumps(record)
    message = codec.decode_message(json.dumps(record).encode(), where="old record")
    [image] = [p for p in message.parts if isinstance(p, ImagePart)]
    assert image.cache is True
    assert image.cache_ttl is None


@pytest.mark.parametrize("kind", ["sqlite", "file"])
async def test_a_ttl_survives_a_durable_store(kind: str, tmp_path: Path) -> None:
    image = ImagePart(media_type="image/png", data=PNG, cache=True, cache_ttl="1h")
    document = DocumentPart(media_type="application/pdf", data=PDF, cache=True, cache_ttl="5m")
    store: Any
    if kind == "sqlite":
        store = await SQLiteStore.open(tmp_path / "db.sqlite3")
    else:
        store = await FileStore.open(tmp_path / "files")
    try:
        await store.create("s", conversation=[Message.user("x", id="u", media=[image, document])])
        loaded = await store.load("s")
    finally:
        await store.aclose()
    parts = [p for p in loaded.conversation[0].parts if isinstance(p, ImagePart | DocumentPart)]
    assert [(p.cache, p.cache_ttl) for p in parts] == [(True, "1h"), (True, "5m")]
    assert parts == [image, document]
