"""The on-disk record format of :class:`~stepmachine.stores.FileStore`, and its file helpers.

Every record is one line::

    <schema> <tag> <revision> <length> <crc32> <payload>\\n

``schema`` is the record schema version (decimal, :data:`SCHEMA_VERSION` today),
``tag`` one letter naming the kind of record, ``revision`` the session revision
the record belongs to, ``length`` the number of payload bytes, ``crc32`` eight
lowercase hex digits of the CRC-32 of everything before it on the line
followed by the payload. The payload is JSON written by the
:class:`~stepmachine.Codec` (or by a fixed Struct of this module), so it never
holds a raw newline. Tags:

- ``H`` (head): the first record of a log; names the session and a random
  ``nonce`` identifying this incarnation of the log (a deleted and re-created
  session gets a new one, so caches and snapshots of the old one are ignored).
- ``C`` (create): the revision-0 session.
- ``B`` (batch): one applied :class:`~stepmachine.Batch`.
- ``S`` (snapshot): the only record of a snapshot file: the session at a
  revision, and the log offset just past that revision's record.

Parsing fails closed (invariant 8): a malformed header, a length that does not
end on the line's newline, a checksum mismatch, an unknown tag or a schema
version newer than this code raises :class:`~stepmachine.StoredDataError`
naming the file and byte offset. The one exception is a *torn tail*: bytes
after the last newline of a log that do not form a complete record (a write
that never finished, so its batch was never acknowledged). :func:`parse_records`
returns it separately instead of raising.
"""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from stepmachine import (
    Batch,
    Codec,
    Effect,
    EffectError,
    Session,
    StoredDataError,
    apply_batch,
)

__all__ = [
    "SCHEMA_VERSION",
    "TAG_BATCH",
    "TAG_CREATE",
    "TAG_HEAD",
    "TAG_SNAPSHOT",
    "LogHead",
    "Record",
    "Snapshot",
    "SnapshotBody",
    "Torn",
    "create_file",
    "decode_batch",
    "decode_struct",
    "encode_record",
    "fold",
    "fsync_dir",
    "parse_one",
    "parse_records",
    "read_head",
    "read_range",
    "read_snapshot",
    "write_all",
]

SCHEMA_VERSION = 1
"""The record schema this code writes, and the newest it reads."""

TAG_HEAD = b"H"
TAG_CREATE = b"C"
TAG_BATCH = b"B"
TAG_SNAPSHOT = b"S"
_TAGS = frozenset({TAG_HEAD, TAG_CREATE, TAG_BATCH, TAG_SNAPSHOT})

_HEAD_READ = 4096  # the head record is at most ~300 bytes
_HEADER = re.compile(rb"(\d{1,9}) ([A-Za-z]) (\d{1,19}) (\d{1,19}) ([0-9a-f]{8}) ")
_NEWLINE = 0x0A
_READ_CHUNK = 1 << 24

S = TypeVar("S", bound=msgspec.Struct)


class LogHead(msgspec.Struct, frozen=True):
    """Payload of the ``H`` record."""

    session_id: str
    nonce: str


class SnapshotBody(msgspec.Struct, frozen=True):
    """Payload of the ``S`` record; ``session`` is encoded by the codec."""

    session_id: str
    nonce: str
    offset: int
    session: msgspec.Raw


@dataclass(frozen=True, slots=True)
class Record:
    """One parsed, checksum-verified record.

    Attributes:
        offset: file offset of its first byte.
        end: file offset just past its newline.
        tag: its tag letter.
        revision: the revision in its header.
        payload: its payload bytes.
    """

    offset: int
    end: int
    tag: bytes
    revision: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A snapshot file's content.

    Attributes:
        revision: the revision it holds.
        offset: the log offset just past that revision's record.
        session: the session (None when not decoded, or when stale).
        stale: it belongs to an earlier incarnation of the session's log.
    """

    revision: int
    offset: int
    session: Session[Any] | None
    stale: bool = False


@dataclass(frozen=True, slots=True)
class Torn:
    """An incomplete final record: ``length`` bytes at file offset ``offset``."""

    offset: int
    length: int


def encode_record(
    tag: bytes, revision: int, payload: bytes, *, version: int = SCHEMA_VERSION
) -> bytes:
    """One record line (``version`` is a parameter only so tests can forge future records)."""
    head = b"%d %s %d %d " % (version, tag, revision, len(payload))
    crc = zlib.crc32(payload, zlib.crc32(head))
    return b"%s%08x %s\n" % (head, crc, payload)


def parse_records(buf: bytes, base: int, path: str) -> tuple[list[Record], Torn | None]:
    """Parse ``buf``, which was read at file offset ``base`` of ``path``.

    Returns:
        The complete records, in order, and the torn tail if ``buf`` ends in
        one (bytes after the last newline that are not a complete record).

    Raises:
        StoredDataError: any other damage, naming ``path`` and the byte offset
            of the record it is in.
    """
    records: list[Record] = []
    view = memoryview(buf)
    size = len(buf)
    pos = 0
    while pos < size:
        newline = buf.find(b"\n", pos)
        match = _HEADER.match(buf, pos)
        where = f"{path} at byte {base + pos}"
        if match is None:
            if newline == -1:
                return records, Torn(base + pos, size - pos)
            raise StoredDataError(
                f"invariant 8 (stored data is data): malformed record header in {where}: "
                f"{bytes(view[pos : min(pos + 48, newline)])!r}"
            )
        version = int(match[1])
        if version > SCHEMA_VERSION:
            raise StoredDataError(
                f"invariant 8 (stored data is data): record in {where} has schema version "
                f"{version}; this version of stepmachine reads up to {SCHEMA_VERSION} "
                "(was it written by a newer stepmachine?)"
            )
        if version < 1:
            raise StoredDataError(
                f"invariant 8 (stored data is data): record in {where} has schema version {version}"
            )
        length = int(match[4])
        end = match.end() + length  # where the record's newline must be
        if end >= size and newline == -1:
            return records, Torn(base + pos, size - pos)
        if end >= size or newline != end:
            raise StoredDataError(
                f"invariant 8 (stored data is data): record in {where} declares {length} payload "
                "bytes, which do not end at the end of its line"
            )
        crc = zlib.crc32(view[match.end() : end], zlib.crc32(view[pos : match.start(5)]))
        if crc != int(match[5], 16):
            raise StoredDataError(
                f"invariant 8 (stored data is data): checksum mismatch in the record in {where} "
                f"(stored {match[5].decode()}, computed {crc:08x})"
            )
        tag = match[2]
        if tag not in _TAGS:
            raise StoredDataError(
                f"invariant 8 (stored data is data): unknown record tag {tag.decode()!r} in "
                f"{where} (known tags: H, C, B, S)"
            )
        records.append(
            Record(base + pos, base + end + 1, tag, int(match[3]), buf[match.end() : end])
        )
        pos = end + 1
    return records, None


def parse_one(buf: bytes, base: int, path: str, tag: bytes) -> Record:
    """The first record of ``buf``, which must be complete and tagged ``tag``.

    Raises:
        StoredDataError: it is missing, torn, damaged or of another tag.
    """
    newline = buf.find(b"\n")
    records, _ = parse_records(buf[: newline + 1] if newline >= 0 else b"", base, path)
    if not records or records[0].tag != tag:
        found = records[0].tag.decode() if records else "no complete record"
        raise StoredDataError(
            f"invariant 8 (stored data is data): expected a {tag.decode()!r} record at byte "
            f"{base} of {path}, found {found}"
        )
    return records[0]


def decode_struct(decoder: msgspec.json.Decoder[S], record: Record, where: str) -> S:
    """Decode a fixed-Struct payload; :class:`StoredDataError` naming ``where`` otherwise."""
    try:
        return decoder.decode(record.payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise StoredDataError(
            f"invariant 8 (stored data is data): {record.tag.decode()!r} record in {where} "
            f"does not decode: {exc}"
        ) from exc


def read_range(fd: int, start: int, stop: int) -> bytes:
    """The bytes of ``fd`` in ``[start, stop)`` (fewer if the file is shorter)."""
    chunks: list[bytes] = []
    pos = start
    while pos < stop:
        chunk = os.pread(fd, min(stop - pos, _READ_CHUNK), pos)
        if not chunk:
            break
        chunks.append(chunk)
        pos += len(chunk)
    return b"".join(chunks)


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` at the file position (``os.write`` may write less)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def create_file(path: str, *, exclusive: bool) -> int:
    """Open ``path`` for writing, created owner-only (0o600) whatever the umask.

    With ``exclusive`` it must not exist (``FileExistsError``); otherwise it is
    truncated. Symbolic links are never followed.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    flags |= os.O_EXCL if exclusive else os.O_TRUNC
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def fsync_dir(path: str) -> None:
    """fsync the directory ``path``, so created, renamed and removed names are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- replaying a log ------------------------------------------------------------------

_head_decoder = msgspec.json.Decoder(LogHead)
_snapshot_decoder = msgspec.json.Decoder(SnapshotBody)


def read_head(fd: int, session_id: str, path: str) -> tuple[str, int]:
    """The log's nonce and the offset just past its head record.

    Raises:
        StoredDataError: no valid head record, or it names another session.
    """
    record = parse_one(os.pread(fd, _HEAD_READ, 0), 0, path, TAG_HEAD)
    head = decode_struct(_head_decoder, record, f"{path} at byte 0")
    if head.session_id != session_id:
        raise StoredDataError(
            f"invariant 8 (stored data is data): {path} is the log of session "
            f"{head.session_id!r}, not {session_id!r}"
        )
    return head.nonce, record.end


def read_snapshot(
    codec: Codec[Any], path: str, session_id: str, nonce: str, size: int, *, decode: bool
) -> Snapshot | None:
    """The snapshot file at ``path`` for the log ``nonce`` of ``size`` bytes; None if missing.

    A snapshot of another incarnation (another nonce) comes back ``stale``.

    Raises:
        StoredDataError: the file is damaged or does not fit the log.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        data = read_range(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    record = parse_one(data, 0, path, TAG_SNAPSHOT)
    where = f"{path} at byte 0"
    body = decode_struct(_snapshot_decoder, record, where)
    if body.nonce != nonce or body.session_id != session_id:
        return Snapshot(record.revision, body.offset, None, stale=True)
    if body.offset > size:
        raise StoredDataError(
            f"invariant 8 (stored data is data): snapshot {path} points at log offset "
            f"{body.offset}, past the end of the log ({size} bytes)"
        )
    if not decode:
        return Snapshot(record.revision, body.offset, None)
    session = codec.decode_session(bytes(body.session), where=where)
    if session.revision != record.revision or session.id != session_id:
        raise StoredDataError(
            f"invariant 8 (stored data is data): snapshot {path} holds session "
            f"{session.id!r} at revision {session.revision}, but its header says "
            f"{session_id!r} at revision {record.revision}"
        )
    return Snapshot(record.revision, body.offset, session)


def decode_batch(codec: Codec[Any], record: Record, session_id: str, path: str) -> Batch[Effect]:
    """The batch of a ``B`` record, checked against the record's session and revision."""
    where = f"{path} at byte {record.offset}"
    batch = codec.decode_batch(
        record.payload, where=f"{where} (session {session_id!r}, revision {record.revision})"
    )
    if batch.session_id != session_id or batch.revision != record.revision:
        raise StoredDataError(
            f"invariant 8 (stored data is data): the batch in {where} is for session "
            f"{batch.session_id!r} revision {batch.revision}, expected {session_id!r} "
            f"revision {record.revision}"
        )
    return batch


def fold(
    codec: Codec[Any], record: Record, session: Session[Any] | None, session_id: str, path: str
) -> Session[Any]:
    """The session after ``record``: the create record when ``session`` is None, else
    the batch for ``session.revision + 1``.

    Raises:
        StoredDataError: the record is not the expected one, does not decode, or
            (a batch) does not apply.
    """
    where = f"{path} at byte {record.offset}"
    if session is None:
        if record.tag != TAG_CREATE or record.revision != 0:
            raise StoredDataError(
                f"invariant 8 (stored data is data): expected the create record in {where}, "
                f"found a {record.tag.decode()!r} record for revision {record.revision}"
            )
        created: Session[Any] = codec.decode_session(
            record.payload, where=f"{where} (session {session_id!r}, revision 0)"
        )
        if created.id != session_id or created.revision != 0:
            raise StoredDataError(
                f"invariant 8 (stored data is data): the create record in {where} holds "
                f"session {created.id!r} at revision {created.revision}"
            )
        return created
    if record.tag != TAG_BATCH or record.revision != session.revision + 1:
        raise StoredDataError(
            f"invariant 8 (stored data is data): expected the batch for revision "
            f"{session.revision + 1} in {where}, found a {record.tag.decode()!r} record for "
            f"revision {record.revision}"
        )
    batch = decode_batch(codec, record, session_id, path)
    try:
        return apply_batch(session, batch.effects)
    except EffectError as exc:
        raise StoredDataError(
            f"invariant 8 (stored data is data): the batch in {where} (session "
            f"{session_id!r}, revision {record.revision}) does not apply: {exc}"
        ) from exc
