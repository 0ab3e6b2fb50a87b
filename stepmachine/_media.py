"""Images, documents and audio in messages: by URL, or by bytes with a media type.

Three part types join the message parts' tagged union (field ``"type"``):
:class:`ImagePart` (``"image"``), :class:`DocumentPart` (``"document"``, a PDF
or a text file) and :class:`AudioPart` (``"audio"``). Each holds exactly one
source:

* ``data`` -- the bytes themselves, with their ``media_type``
  (``"image/png"``, ``"application/pdf"``, ``"audio/wav"``); or
* ``url`` -- where the provider fetches them (``https://...``; a provider may
  also take its own schemes, such as Gemini's ``gs://``), ``media_type``
  optional.

Optional hints: ``detail`` on an image (``"auto"``, ``"low"``, ``"high"``:
OpenAI's resolution setting; other providers ignore it) and ``cache`` on any
(Anthropic's ``cache_control``; other providers ignore it), with
``cache_ttl`` for how long the cached prefix lives: ``"5m"`` or ``"1h"``, or
``None`` for the provider's default (Anthropic: five minutes; OpenAI and
Gemini have no per-part cache field and ignore both). ``cache_ttl`` came
later, as a defaulted field: a part stored before it reads with ``None``. A user message
may hold them; a tool result may carry images and documents: they follow the
result in its ``tool`` message (:meth:`~stepmachine.Message.tool_result`
with ``media=``). Older readers, which do not know these tags, refuse such a
message (a clear :class:`~stepmachine.StoredDataError`) instead of dropping
the media. Which provider takes which part
is the adapter's to say: a part it cannot send is a
:class:`~stepmachine.ConfigurationError` before any request, never dropped.

Bytes are a ``bytes`` value in memory; how a store keeps them is the store's
(see the stores). ``digest`` names the bytes (``sha256:<hex>``), so the same
image sent twice can be kept once.

How the durable stores keep bytes: a stored record never holds them. Each
media part with ``data`` is written as a :class:`MediaRef` (tag
``"media_ref"``): the part's other fields, its kind, and the digest and size
of its bytes, which the store keeps once, by digest, beside the records
(``stepmachine.stores``); loading puts the bytes back, checked against the
digest. A ``MediaRef`` exists only inside stored records: a session a store
returns never holds one, and an adapter refuses one before any request
(:func:`check_media`). A reader that does not know the tag refuses the record
(:class:`~stepmachine.StoredDataError`) instead of losing the media.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias

import msgspec

from ._checks import check_bool, check_str, fail

if TYPE_CHECKING:
    from ._messages import Message

__all__ = [
    "AudioPart",
    "DocumentPart",
    "ImagePart",
    "MediaPart",
    "MediaRef",
    "check_media",
    "media_digest",
]

Detail: TypeAlias = Literal["auto", "low", "high"]
_DETAILS: Final = (None, "auto", "low", "high")
CacheTTL: TypeAlias = Literal["5m", "1h"]
"""How long a cached prompt prefix lives (Anthropic's ``cache_control.ttl``)."""
_TTLS: Final = (None, "5m", "1h")


def media_digest(data: bytes) -> str:
    """The content address of ``data``: ``"sha256:<64 hex digits>"``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _take_data_url(part: ImagePart | DocumentPart | AudioPart, owner: str) -> None:
    """A ``data:`` URL given as ``url=`` becomes the bytes it holds (``data=``).

    So it is stored once by digest, estimated, shown by size, and sent as
    bytes (a provider fetches no ``data:`` URL); its media type fills an
    empty ``media_type``. A malformed one is refused.
    """
    url = part.url
    if not (type(url) is str and url[:5].lower() == "data:"):
        return
    header, comma, payload = url[5:].partition(",")
    fields = header.split(";")
    if not comma or fields[-1].strip().lower() != "base64":
        fail(owner, "url", "a base64 data: URL (data:<type>;base64,<bytes>)", "data:...")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        fail(owner, "url", "a data: URL whose payload is valid base64", "data:...")
    msgspec.structs.force_setattr(part, "url", None)
    msgspec.structs.force_setattr(part, "data", data)
    if not part.media_type:
        msgspec.structs.force_setattr(part, "media_type", fields[0].strip().lower())


def _check_cache(owner: str, cache: Any, ttl: Any) -> None:
    """``ttl`` None, or ``"5m"`` / ``"1h"`` with ``cache=True`` (``cache`` checked before)."""
    if ttl is not None and (type(ttl) is not str or ttl not in _TTLS):
        fail(owner, "cache_ttl", "None, '5m' or '1h'", ttl)
    if ttl is not None and not cache:
        fail(owner, "cache_ttl", "None unless cache=True (set cache=True with it)", ttl)


def _check_source(
    owner: str, media_type: Any, data: Any, url: Any, cache: Any, prefixes: tuple[str, ...]
) -> None:
    """Exactly one source; ``media_type`` required with bytes; the kind of media it names."""
    check_str(owner, "media_type", media_type)
    check_bool(owner, "cache", cache)
    if data is not None and not isinstance(data, bytes):
        fail(owner, "data", "bytes or None", data)
    if data is not None and not data:
        fail(owner, "data", "at least one byte (or url=)", data)
    if url is not None:
        check_str(owner, "url", url)
    if data is None and url is None:
        fail(owner, "data", "bytes, or a url= instead (exactly one of the two)", data)
    if data is not None and url is not None:
        fail(owner, "url", "None when data= is given (exactly one of the two)", url)
    if url is not None and not url.strip():
        fail(owner, "url", "a URL, not a blank str", url)
    if data is not None and not media_type:
        fail(owner, "media_type", "a media type with data= (e.g. 'image/png')", media_type)
    if media_type and not media_type.startswith(prefixes):
        kinds = " or ".join(repr(p + "...") for p in prefixes)
        fail(owner, "media_type", kinds, media_type)


def _short(part: ImagePart | DocumentPart | AudioPart) -> str:
    if part.data is not None:
        return f"{len(part.data):,} bytes {part.media_type}"
    return f"url={part.url!r}" + (f" {part.media_type}" if part.media_type else "")


class ImagePart(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="image"):
    """An image: bytes with their media type, or a URL.

    Attributes:
        media_type: ``"image/png"``, ``"image/jpeg"``, ``"image/gif"``,
            ``"image/webp"``...; required with ``data``.
        data: the image's bytes, or ``None`` for a URL.
        url: where the provider fetches it, or ``None`` for bytes.
        detail: OpenAI's resolution hint (``"auto"``, ``"low"``, ``"high"``).
        cache: ask the provider to cache the prompt up to here (Anthropic).
        cache_ttl: how long that cache lives, ``"5m"`` or ``"1h"`` (with
            ``cache=True``); ``None``: the provider's default.

    Raises:
        InvalidFieldError: not exactly one of ``data`` and ``url``, ``data``
            without a ``media_type``, a ``media_type`` that is not ``image/...``,
            an unknown ``detail`` or ``cache_ttl``, or a field of the wrong type.
    """

    media_type: str = ""
    data: bytes | None = None
    url: str | None = None
    detail: Detail | None = None
    cache: bool = False
    cache_ttl: CacheTTL | None = None

    def __post_init__(self) -> None:
        _take_data_url(self, "ImagePart")
        _check_source("ImagePart", self.media_type, self.data, self.url, self.cache, ("image/",))
        _check_cache("ImagePart", self.cache, self.cache_ttl)
        if self.detail not in _DETAILS:
            fail("ImagePart", "detail", "None, 'auto', 'low' or 'high'", self.detail)

    def __repr__(self) -> str:
        return f"ImagePart({_short(self)})"

    @property
    def digest(self) -> str:
        """``sha256:<hex>`` of the bytes, or ``""`` for a URL."""
        return "" if self.data is None else media_digest(self.data)


class DocumentPart(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="document"):
    """A document: a PDF (``application/pdf``) or a text file (``text/...``).

    Attributes:
        media_type: ``"application/pdf"`` or ``"text/plain"``...; required with ``data``.
        data: the document's bytes, or ``None`` for a URL.
        url: where the provider fetches it, or ``None`` for bytes.
        title: a file name or title some providers show the model.
        cache: ask the provider to cache the prompt up to here (Anthropic).
        cache_ttl: as :class:`ImagePart`.

    Raises:
        InvalidFieldError: as :class:`ImagePart`, for ``application/...`` and
            ``text/...`` media types.
    """

    media_type: str = ""
    data: bytes | None = None
    url: str | None = None
    title: str | None = None
    cache: bool = False
    cache_ttl: CacheTTL | None = None

    def __post_init__(self) -> None:
        _take_data_url(self, "DocumentPart")
        _check_source(
            "DocumentPart",
            self.media_type,
            self.data,
            self.url,
            self.cache,
            ("application/", "text/"),
        )
        _check_cache("DocumentPart", self.cache, self.cache_ttl)
        if self.title is not None:
            check_str("DocumentPart", "title", self.title)

    def __repr__(self) -> str:
        return f"DocumentPart({_short(self)})"

    @property
    def digest(self) -> str:
        """``sha256:<hex>`` of the bytes, or ``""`` for a URL."""
        return "" if self.data is None else media_digest(self.data)


class AudioPart(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="audio"):
    """Audio input (``audio/wav``, ``audio/mpeg``...), for providers that take it.

    Attributes:
        media_type: required with ``data``.
        data: the audio's bytes, or ``None`` for a URL.
        url: where the provider fetches it, or ``None`` for bytes.
        cache: ask the provider to cache the prompt up to here.
        cache_ttl: as :class:`ImagePart`.

    Raises:
        InvalidFieldError: as :class:`ImagePart`, for ``audio/...`` media types.
    """

    media_type: str = ""
    data: bytes | None = None
    url: str | None = None
    cache: bool = False
    cache_ttl: CacheTTL | None = None

    def __post_init__(self) -> None:
        _take_data_url(self, "AudioPart")
        _check_source("AudioPart", self.media_type, self.data, self.url, self.cache, ("audio/",))
        _check_cache("AudioPart", self.cache, self.cache_ttl)

    def __repr__(self) -> str:
        return f"AudioPart({_short(self)})"

    @property
    def digest(self) -> str:
        """``sha256:<hex>`` of the bytes, or ``""`` for a URL."""
        return "" if self.data is None else media_digest(self.data)


MediaPart: TypeAlias = ImagePart | DocumentPart | AudioPart
"""Any media part."""

MEDIA_PARTS: Final = (ImagePart, DocumentPart, AudioPart)

MediaKind: TypeAlias = Literal["image", "document", "audio"]


class MediaRef(msgspec.Struct, frozen=True, gc=False, tag_field="type", tag="media_ref"):
    """How a durable store records a media part whose bytes it keeps apart (by digest).

    Only stored records hold it: a store writes one in place of an
    :class:`ImagePart`, :class:`DocumentPart` or :class:`AudioPart` with
    ``data``, and replaces it by that part again (its bytes read back and
    checked against ``digest`` and ``size``) when it loads the record. It holds
    every field of the three part types except ``data`` and ``url``; the
    fields a kind does not have stay at their defaults.

    Attributes:
        kind: the tag of the part it stands for (``"image"``, ``"document"``, ``"audio"``).
        digest: ``sha256:<hex>`` of the bytes (:func:`media_digest`).
        size: how many bytes.
        media_type, detail, title, cache, cache_ttl: the part's own fields.
    """

    kind: MediaKind
    digest: str
    size: int
    media_type: str
    detail: Detail | None = None
    title: str | None = None
    cache: bool = False
    cache_ttl: CacheTTL | None = None

    def __repr__(self) -> str:
        return f"MediaRef({self.kind} {self.size:,} bytes {self.media_type} {self.digest[:19]})"


def check_media(
    messages: Iterable[Message],
    *,
    accepts: frozenset[type] | tuple[type, ...],
    in_results: frozenset[type] | tuple[type, ...],
    who: str,
) -> None:
    """Refuse, before any request, a media part ``who`` cannot send (never drop it).

    ``accepts``: the media part types ``who`` takes in a user message;
    ``in_results``: those it takes in a ``tool`` message (after a result).

    Raises:
        ConfigurationError: a message holds a media part of another type,
            naming the message, the part and ``who``.
    """
    from ._errors import ConfigurationError  # noqa: PLC0415 - _errors imports nothing from here

    for message in messages:
        allowed = in_results if message.role == "tool" else accepts
        for part in message.parts:
            if isinstance(part, MediaRef):
                raise ConfigurationError(
                    f"{who} cannot send {part!r} (message {message.id!r}): a MediaRef is how a "
                    "store records media, not media; load the session through its store, "
                    "which puts the bytes back"
                )
            if isinstance(part, ImagePart | DocumentPart | AudioPart) and type(part) not in allowed:
                where = "a tool result" if message.role == "tool" else f"a {message.role} message"
                raise ConfigurationError(
                    f"{who} cannot send a {type(part).__name__} in {where} ({_short(part)}, "
                    f"message {message.id!r}); remove it, or use a provider that takes it"
                )
