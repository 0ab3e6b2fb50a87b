"""Media bytes in the stores: kept once, by digest, apart from the records.

The design, and why (issue 14). A message may hold images, documents and
audio as bytes (:class:`~stepmachine.ImagePart` ...). Stored inside the JSON
records they would be base64 text (a third larger), copied into every
snapshot, and kept again for each message, fork or session that repeats them.
So the stores keep them apart:

- **Writing.** Before a batch (or a revision-0 session, or a snapshot) is
  encoded, every media part with ``data`` in a message is replaced by a
  :class:`~stepmachine.MediaRef`: its other fields, the ``sha256`` digest and
  the size of its bytes (:meth:`Media.batch_out`, :meth:`Media.session_out`).
  The bytes go to the backend's content-addressed blobs
  (``LogTxn.put_blobs``), **in the same transaction as the record that refers
  to them, before it** (SQLite, PostgreSQL: a ``media`` table; files: one file
  per digest, fsynced before the log record is appended; memory: a dict). A
  record therefore never refers to a blob that is not durable (nothing is lost);
  a crash between the two leaves at most a blob nothing refers to, which is
  harmless and is used again by the next write of the same bytes.
- **Once.** Blobs are keyed by digest and written only when absent: the same
  bytes in two messages, two sessions or a fork are one blob. A snapshot
  writes no bytes for media its earlier batches stored (the backend checks
  which digests it holds first); digests already computed are remembered per
  bytes object (:class:`_Digests`), so a snapshot does not hash them again.
- **Reading.** After a record is decoded, every ``MediaRef`` is replaced by
  the part again, its bytes read from the backend and checked against the
  digest and size (:meth:`Reader.batch`, :meth:`Reader.session`). A missing,
  damaged or malformed blob is a :class:`~stepmachine.StoredDataError` naming
  the session, the record's position and the digest (stored data is data); never an
  empty image. Finding the references is a type check per message part of
  what was decoded (records without media cost that, and nothing else).
- **Where.** Only messages the codec stores as messages are walked: a
  session's conversation and the fields of an effect declared as ``Message``
  or ``tuple[Message, ...]`` (``AppendMessage``, ``ReplaceConversation``, an
  application effect's such fields). Media anywhere else (in application data,
  in a field typed ``Any``) stays inside the record as msgspec encodes it
  (base64): still correct, only not shared.
- **Limit.** A part larger than the store's ``max_media_bytes`` (20 MiB by
  default) raises :class:`~stepmachine.MediaTooLargeError` before anything
  is written.
- **Media in application data** (an ``ImagePart`` in a data field, set by
  ``UpdateData`` or given to ``create``) are not moved to the blobs: the data
  is encoded whole by the codec, in every record that sets it and in every
  snapshot, and making the codec walk application data on every write would
  put a second encoding path under every store for a rare use. They get the
  same limit instead, checked before anything is written
  (:func:`check_data_media`): a part over ``max_media_bytes`` is a
  ``MediaTooLargeError`` naming the field and the limit, and telling to keep
  large media in messages. The walk costs one type check per effect for a
  batch without ``UpdateData``, and a pass over the changed values (JSON
  values: a media part there is its tagged object, its bytes base64) for one
  with it.
- **Schema.** The reference is a new tagged part (``"media_ref"``): a reader
  that does not know it refuses the record with ``StoredDataError`` naming it,
  never reads a message without its media.
- **Deleting.** A blob lives while a record names it. ``delete`` removes the
  session's records and then, in the same transaction (the file store: right
  after, under a lock writers share; see ``_file_media``), every blob that no
  record of any remaining session names (:func:`unreferenced`): shared blobs
  are counted by the records themselves (a fork's copied records, a snapshot,
  another session holding the same bytes keep them), with no counter that
  could drift from the records. A record is searched for the text
  ``sha256:<hex>``: a digest that appears anywhere in a record (in a message's
  text, in application data) keeps its blob, so the error is always keeping a
  blob, never losing one; a record that cannot be read keeps every blob. The
  sweep runs only when the deleted session named a blob, and then also
  removes blobs left by deletes of earlier versions; it reads every other
  record once (the cost of a delete of a session with media is the store's
  size, not the session's).
- **Cost.** Only the batch's own media are hashed, written and read on the
  cycle's path (constant cost per step); a snapshot asks the backend which of its
  digests it holds (no bytes move); load_at, fork and a cold load read the
  blobs of the messages they return, once per digest per read.
- **Only stores write references.** A ``MediaRef`` given in a batch or a
  conversation is refused (``ConfigurationError``), so every reference in a
  record names bytes this store was given and wrote before it.

Why references in the records rather than bytes in new record columns: the
records stay what every backend already checks, replays, copies (a fork
copies rows and log records unchanged, and the blobs they refer to are
shared) and compresses; the only thing a backend adds is a content-addressed
table or folder with three operations (``blob``, ``put_blobs``,
``media_label``), and everything else is in this module, once for all stores.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import msgspec

from stepmachine import (
    AppendMessage,
    AudioPart,
    DocumentPart,
    Effect,
    ImagePart,
    MediaRef,
    MediaTooLargeError,
    Message,
    Session,
    StoredDataError,
    UpdateData,
)
from stepmachine._codec import _message_fields
from stepmachine.extend import Batch, media_digest

__all__ = [
    "DEFAULT_MAX_MEDIA_BYTES",
    "VERIFIED",
    "BlobRead",
    "Media",
    "Reader",
    "batch_refers",
    "blobs_to_write",
    "check_data_media",
    "check_digest",
    "check_max_media_bytes",
    "named_digests",
    "unreferenced",
]

DEFAULT_MAX_MEDIA_BYTES: Final = 20 * 1024 * 1024
"""The bytes one media part may hold in a store, by default (20 MiB)."""

BlobRead = Callable[[str], "bytes | None"]
"""A backend's read of one blob by digest: its bytes, or None when it holds none."""

_MEMO_BYTES: Final = 64 * 1024 * 1024
"""The bytes :class:`_Digests` may keep alive (most are held by cached sessions anyway)."""

_TAG: Final = b'"media_ref"'
_ANY_DIGEST: Final = re.compile(rb"sha256:[0-9a-f]{64}")
_DIGEST: Final = re.compile(r"sha256:[0-9a-f]{64}\Z")
_KINDS: Final[dict[str, type[ImagePart | DocumentPart | AudioPart]]] = {
    "image": ImagePart,
    "document": DocumentPart,
    "audio": AudioPart,
}
_MEDIA: Final = frozenset(_KINDS.values())
_WATCHED: Final = frozenset((*_KINDS.values(), MediaRef))
_OWN: Final = {
    kind: frozenset(cls.__struct_fields__) - {"data", "url"} for kind, cls in _KINDS.items()
}
_REF_FIELDS: Final = ("media_type", "detail", "title", "cache", "cache_ttl")
_DEFAULTS: Final = {"detail": None, "title": None, "cache": False, "cache_ttl": None}


def _refers(messages: Any) -> bool:
    """Whether a message of ``messages`` holds a ``MediaRef``."""
    for message in messages:
        if type(message) is Message:
            parts: tuple[Any, ...] = message.parts  # Any: a stored record's parts may be refs
            for part in parts:
                if type(part) is MediaRef:
                    return True
    return False


def batch_refers(batch: Batch[Effect]) -> bool:
    """Whether a decoded batch holds a ``MediaRef`` in its effects' message fields
    (what :meth:`Reader.batch` resolves); a few type checks per message part."""
    for effect in batch.effects:
        kind = type(effect)
        if kind is AppendMessage:  # the usual effect, checked without a call
            for part in effect.message.parts:  # type: ignore[attr-defined]
                if type(part) is MediaRef:
                    return True
            continue
        for name in _message_fields(kind):
            value = getattr(effect, name)
            if _refers((value,) if type(value) is Message else value):
                return True
    return False


_PART_TAGS: Final = frozenset(_KINDS)


def _data_media(value: Any, path: str) -> tuple[str, int] | None:
    """The largest media part in ``value`` (application data: a Struct, or its
    JSON form), as (where, its bytes), or None; iterative (no recursion limit)."""
    largest: tuple[str, int] | None = None
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        kind = type(item)
        if kind in _MEDIA:
            size = 0 if item.data is None else len(item.data)
        elif kind is dict:
            tag = item.get("type")
            data = item.get("data")
            if type(tag) is str and tag in _PART_TAGS and type(data) is str:
                size = len(data) * 3 // 4 - data.endswith("=") - data.endswith("==")
            else:
                stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in item.items())
                continue
        elif kind is list or kind is tuple:
            stack.extend((v, f"{where}[{n}]") for n, v in enumerate(item))
            continue
        elif isinstance(item, msgspec.Struct):
            stack.extend(
                (getattr(item, name), f"{where}.{name}" if where else name)
                for name in item.__struct_fields__
            )
            continue
        else:
            continue
        if largest is None or size > largest[1]:
            largest = (where, size)
    return largest


def check_data_media(session_id: str, value: Any, limit: int, path: str = "") -> None:
    """Refuse a media part in application data ``value`` over ``limit`` bytes
    (see the module docstring: such media are stored inline, so they get the limit).

    Raises:
        MediaTooLargeError: naming the field (``path`` and below) and the limit.
    """
    found = _data_media(value, path)
    if found is not None and found[1] > limit:
        raise MediaTooLargeError(session_id, "", found[1], limit, field=found[0] or "data")


def check_digest(digest: str) -> bool:
    """Whether ``digest`` is ``sha256:`` and 64 lowercase hex digits (safe as a file name)."""
    return type(digest) is str and _DIGEST.match(digest) is not None


def check_max_media_bytes(value: object) -> int:
    """``value`` if it is an int >= 1. Raises TypeError or ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"max_media_bytes must be an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"max_media_bytes must be >= 1, got {value}")
    return value


class _Digests:
    """The digests of bytes objects already hashed, by identity, least recently used
    dropped first once they hold more than ``budget`` bytes (thread-safe).

    Each entry keeps its bytes object alive, so its ``id`` is not reused while
    it is remembered.
    """

    def __init__(self, budget: int) -> None:
        self._budget = budget
        self._held = 0
        self._seen: OrderedDict[int, tuple[bytes, str]] = OrderedDict()
        self._lock = threading.Lock()

    def of(self, data: bytes) -> str:
        """The digest of ``data``, hashed only if this object was not seen."""
        with self._lock:
            found = self._seen.get(id(data))
            if found is not None and found[0] is data:
                self._seen.move_to_end(id(data))
                return found[1]
        digest = media_digest(data)
        self.note(data, digest)
        return digest

    def note(self, data: bytes, digest: str) -> None:
        """Remember that ``data`` (already checked) has ``digest``."""
        with self._lock:
            if id(data) in self._seen:
                return
            self._seen[id(data)] = (data, digest)
            self._held += len(data)
            while self._held > self._budget and len(self._seen) > 1:
                _, (dropped, _) = self._seen.popitem(last=False)
                self._held -= len(dropped)


class _Verified:
    """The blobs this process wrote, or read back and found sound, by (where, digest)
    (thread-safe; forgotten whole past :data:`_VERIFIED_MAX` entries).

    Why once per process: a write of bytes a backend already holds checks the
    stored size every time (cheap), but hashing the stored bytes again on
    every write would read every image back on every batch that repeats it.
    Damage of the same size that appears after a blob was verified here is
    still found by every read (each body read is hashed); a read that finds a
    blob missing or damaged forgets it here, so the next write of its bytes, by
    this process or another, checks it again and rewrites it.
    """

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def holds(self, where: str, digest: str) -> bool:
        """Whether the blob ``digest`` of ``where`` was verified by this process."""
        return (where, digest) in self._seen

    def add(self, where: str, digest: str) -> None:
        """Remember that the blob ``digest`` of ``where`` is sound."""
        with self._lock:
            if len(self._seen) >= _VERIFIED_MAX:
                self._seen.clear()
            self._seen.add((where, digest))

    def discard(self, where: str, digest: str) -> None:
        """Forget ``digest`` of ``where`` (its blob was removed, or found damaged)."""
        with self._lock:
            self._seen.discard((where, digest))


_VERIFIED_MAX: Final = 100_000
VERIFIED: Final = _Verified()
"""The process-wide record of verified blobs (see :class:`_Verified`)."""


class Media:
    """One store's media handling: the size limit, and the digests it knows.

    Args:
        max_bytes: the bytes one part may hold (:data:`DEFAULT_MAX_MEDIA_BYTES`).
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_MEDIA_BYTES) -> None:
        self.max_bytes = check_max_media_bytes(max_bytes)
        self.digests = _Digests(_MEMO_BYTES)

    # -- writing -------------------------------------------------------------------

    def batch_out(self, batch: Batch[Effect]) -> tuple[Batch[Effect], dict[str, bytes]]:
        """``batch`` with its media bytes replaced by references, and the bytes by digest.

        Returns ``batch`` itself (and no bytes) when it holds no media bytes.

        Raises:
            MediaTooLargeError: a part is over the limit (nothing is written).
            ConfigurationError: a message holds a ``MediaRef`` (only stores write them).
        """
        blobs: dict[str, bytes] = {}
        for effect in batch.effects:
            if type(effect) is UpdateData:
                check_data_media(batch.session_id, effect.changes, self.max_bytes)
        if not any(map(_holds_media, batch.effects)):  # the usual batch: nothing built
            return batch, blobs
        effects: list[Effect] = []
        changed = False
        for effect in batch.effects:
            replaced = self._effect_out(effect, batch.session_id, blobs, self.max_bytes)
            changed = changed or replaced is not effect
            effects.append(replaced)
        if not changed:
            return batch, blobs
        return msgspec.structs.replace(batch, effects=tuple(effects)), blobs

    def session_out(
        self, session: Session[Any], *, limit: bool = True
    ) -> tuple[Session[Any], dict[str, bytes]]:
        """``session`` with its conversation's media bytes replaced by references, and
        the bytes by digest (``session`` itself when it holds none).

        ``limit=False`` for a session whose media the store already took (a
        snapshot, a fork): they are not checked against ``max_bytes`` again, so
        reopening a store with a lower limit never stops a session that holds
        larger media from advancing (the limit is for media coming in).

        Raises:
            MediaTooLargeError, ConfigurationError: as :meth:`batch_out`.
        """
        blobs: dict[str, bytes] = {}
        if limit:
            check_data_media(session.id, session.data, self.max_bytes)
        messages = session.conversation
        out = self._messages_out(messages, session.id, blobs, self.max_bytes if limit else None)
        if out is messages:
            return session, blobs
        return _with_conversation(session, out), blobs

    def _effect_out(
        self, effect: Effect, session_id: str, blobs: dict[str, bytes], limit: int | None
    ) -> Effect:
        changes: dict[str, Any] = {}
        for name in _message_fields(type(effect)):
            value = getattr(effect, name)
            if type(value) is Message:
                out: Any = self._message_out(value, session_id, blobs, limit)
            elif type(value) is tuple:
                out = self._messages_out(value, session_id, blobs, limit)
            else:
                continue
            if out is not value:
                changes[name] = out
        return msgspec.structs.replace(effect, **changes) if changes else effect

    def _messages_out(
        self, messages: Any, session_id: str, blobs: dict[str, bytes], limit: int | None
    ) -> Any:
        out = [self._message_out(m, session_id, blobs, limit) for m in messages]
        if all(new is old for new, old in zip(out, messages, strict=True)):
            return messages
        return tuple(out)

    def _message_out(
        self, message: Any, session_id: str, blobs: dict[str, bytes], limit: int | None
    ) -> Any:
        if type(message) is not Message:
            return message  # not a message: the codec stores it as it is
        parts: tuple[Any, ...] = message.parts  # Any: a stored record's parts may be refs
        for part in parts:
            kind = type(part)
            if kind in _MEDIA or kind is MediaRef:
                break
        else:
            return message
        out = tuple(self._part_out(part, message.id, session_id, blobs, limit) for part in parts)
        return msgspec.structs.replace(message, parts=out)

    def _part_out(
        self,
        part: Any,
        message_id: str,
        session_id: str,
        blobs: dict[str, bytes],
        limit: int | None,
    ) -> Any:
        if type(part) is MediaRef:
            from stepmachine import ConfigurationError  # noqa: PLC0415 - error path only

            raise ConfigurationError(
                f"message {message_id!r} of session {session_id!r} holds {part!r}: a MediaRef "
                "is how a store records media; give the ImagePart, DocumentPart or AudioPart"
            )
        if type(part) not in _MEDIA or part.data is None:
            return part
        data: bytes = part.data
        if limit is not None and len(data) > limit:
            raise MediaTooLargeError(session_id, message_id, len(data), limit)
        digest = self.digests.of(data)
        blobs[digest] = data
        kind = part.__struct_config__.tag
        fields = {name: getattr(part, name) for name in _REF_FIELDS if name in _OWN[kind]}
        return MediaRef(kind=kind, digest=digest, size=len(data), **fields)


def _holds_media(effect: Effect) -> bool:
    """Whether a message in ``effect``'s message fields holds a media part or a reference."""
    kind = type(effect)
    if kind is AppendMessage:  # the usual effect, checked without a call (on every apply)
        for part in effect.message.parts:  # type: ignore[attr-defined]  # noqa: SIM110 - no generator (hot path)
            if type(part) in _WATCHED:
                return True
        return False
    for name in _message_fields(kind):
        value = getattr(effect, name)
        for message in (value,) if type(value) is Message else value:
            if type(message) is Message:
                for part in message.parts:
                    if type(part) in _WATCHED:
                        return True
    return False


class Reader:
    """Puts the bytes back into what a backend read (see the module docstring).

    Made for every read (cheap: it reads nothing until a reference is met);
    a blob is read once per reader.

    Args:
        media: the store's :class:`Media`.
        read: the backend's read of one blob (:data:`BlobRead`).
        label: how an error names the backend's blobs (``"the media table of x.db"``).
    """

    __slots__ = ("_label", "_loaded", "_media", "_read")

    def __init__(self, media: Media, read: BlobRead, label: str) -> None:
        self._media = media
        self._read = read
        self._label = label
        self._loaded: dict[str, bytes] | None = None

    def batch(self, batch: Batch[Effect], where: str) -> Batch[Effect]:
        """``batch`` with its references resolved (``batch`` itself when it has none).

        Raises:
            StoredDataError: a blob is missing, damaged or named wrongly; the
                message names ``where`` (the session and position) and the digest.
        """
        if not batch_refers(batch):
            return batch
        effects = tuple(self._effect_in(effect, where) for effect in batch.effects)
        return msgspec.structs.replace(batch, effects=effects)

    def session(self, session: Session[Any], where: str) -> Session[Any]:
        """``session`` with its references resolved (``session`` itself when it has none).

        Raises:
            StoredDataError: as :meth:`batch`.
        """
        messages = session.conversation
        if not _refers(messages):
            return session
        out = self._messages_in(messages, where)
        return session if out is messages else _with_conversation(session, out)

    def _effect_in(self, effect: Effect, where: str) -> Effect:
        changes: dict[str, Any] = {}
        for name in _message_fields(type(effect)):
            value = getattr(effect, name)
            if type(value) is Message:
                out: Any = self._message_in(value, where)
            elif type(value) is tuple:
                out = self._messages_in(value, where)
            else:
                continue
            if out is not value:
                changes[name] = out
        return msgspec.structs.replace(effect, **changes) if changes else effect

    def _messages_in(self, messages: Any, where: str) -> Any:
        out = [self._message_in(m, where) for m in messages]
        if all(new is old for new, old in zip(out, messages, strict=True)):
            return messages
        return tuple(out)

    def _message_in(self, message: Any, where: str) -> Any:
        if type(message) is not Message:
            return message
        stored: tuple[Any, ...] = message.parts  # Any: a stored record's parts may be refs
        if not any(type(p) is MediaRef for p in stored):
            return message
        parts = tuple(
            self._part_in(part, message.id, where) if type(part) is MediaRef else part
            for part in stored
        )
        return msgspec.structs.replace(message, parts=parts)

    def _part_in(self, ref: MediaRef, message_id: str, where: str) -> Any:
        said = f"message {message_id!r} in {where} refers to {ref!r}"
        cls = _KINDS[ref.kind]  # the decoder checked the literal
        own = _OWN[ref.kind]
        stray = [n for n in _REF_FIELDS if n not in own and getattr(ref, n) != _DEFAULTS[n]]
        if stray or not check_digest(ref.digest) or ref.size < 0:
            raise _fail(f"{said}, which is not a valid reference (digest {ref.digest!r})")
        if self._loaded is None:
            self._loaded = {}
        data = self._loaded.get(ref.digest)
        if data is None:
            data = self._read(ref.digest)
            if data is None:
                VERIFIED.discard(self._label, ref.digest)
                raise _fail(f"{said}, but {self._label} holds no blob {ref.digest}")
            if len(data) != ref.size or media_digest(data) != ref.digest:
                VERIFIED.discard(self._label, ref.digest)  # the next write rewrites it
                raise _fail(
                    f"{said}, but the blob {ref.digest} in {self._label} is damaged: it holds "
                    f"{len(data):,} bytes whose digest is {media_digest(data)}"
                )
            self._media.digests.note(data, ref.digest)
            VERIFIED.add(self._label, ref.digest)
            self._loaded[ref.digest] = data
        fields = {name: getattr(ref, name) for name in _REF_FIELDS if name in own}
        try:
            return cls(data=data, **fields)
        except (TypeError, ValueError) as exc:
            raise _fail(f"{said}, which does not make a valid {cls.__name__}: {exc}") from exc


def _fail(problem: str) -> StoredDataError:
    return StoredDataError(f"stored data is data: {problem}; nothing was changed")


def _with_conversation(session: Session[Any], messages: Any) -> Session[Any]:
    """``session`` holding ``messages`` instead (its indexes rebuilt)."""
    return Session(
        id=session.id, revision=session.revision, conversation=messages, data=session.data
    )


def blobs_to_write(
    blobs: Mapping[str, bytes],
    sizes: Callable[[list[str]], Mapping[str, int]],
    read: BlobRead,
    label: str,
) -> dict[str, bytes]:
    """The blobs of ``blobs`` a backend must write: those it does not hold, and
    those it holds damaged (so a write of the same bytes repairs them).

    ``sizes`` is the backend's look-up of the stored size of each digest it
    holds; ``read`` its read of one blob. A held blob of another size is
    damaged; one of the right size is hashed once per process per digest
    (:data:`VERIFIED`), so the usual write reads nothing back.
    """
    if not blobs:
        return {}
    held = sizes(sorted(blobs))
    out: dict[str, bytes] = {}
    for digest, data in blobs.items():
        size = held.get(digest)
        if size != len(data):
            out[digest] = data
        elif not VERIFIED.holds(label, digest):
            stored = read(digest)
            if stored is None or media_digest(stored) != digest:
                out[digest] = data
            else:
                VERIFIED.add(label, digest)
    return out


def named_digests(records: Iterable[bytes | None]) -> set[str] | None:
    """Every ``sha256:<hex>`` the ``records`` (codec records, uncompressed) name,
    or None when one of them is None (could not be read)."""
    found: set[str] = set()
    for record in records:
        if record is None:
            return None
        found.update(match.decode() for match in _ANY_DIGEST.findall(record))
    return found


def unreferenced(candidates: set[str], records: Iterable[bytes | None]) -> set[str]:
    """The digests of ``candidates`` that none of ``records`` names (see the module
    docstring: *Deleting*); none when a record is None (could not be read).

    Stops reading ``records`` once every candidate is named.
    """
    left = set(candidates)
    for record in records:
        if not left:
            break
        if record is None:
            return set()
        for match in _ANY_DIGEST.findall(record):
            left.discard(match.decode())
    return left
