"""The on-disk record format of :class:`~stepmachine.stores.FileStore`, and its file helpers.

Every record is one line::

    <schema> <tag> <revision> <length> <crc32> <payload>\\n

``schema`` is the record schema version (decimal, 1 or 2),
``tag`` one letter naming the kind of record, ``revision`` the session revision
the record belongs to, ``length`` the number of payload bytes, ``crc32`` eight
lowercase hex digits of the CRC-32 of everything before it on the line
followed by the payload. The payload of a version-1 record is JSON written by
the :class:`~stepmachine.Codec` (or by a fixed Struct of this module), so it
never holds a raw newline. A version-2 record (since issue 9) holds that JSON
compressed with zlib, in standard base64 (no newline either): create and batch
records of at least 256 bytes are written so when that makes them smaller
(natural text about halves), shorter ones stay version 1, so a log holding only
those is still read by code from before. Older code refuses a version-2
record (a newer schema version) without writing anything. Tags:

- ``H`` (head): the first record of a log; names the session and a random
  ``nonce`` identifying this incarnation of the log (a deleted and re-created
  session gets a new one, so caches and snapshots of the old one are ignored).
- ``C`` (create): the revision-0 session.
- ``B`` (batch): one applied :class:`~stepmachine.Batch`.
- ``S`` (snapshot): the only record of a snapshot file: the session at a
  revision, the log offset just past that revision's record, and
  ``last_record``: the offset and BLAKE2b digest of that record's bytes,
  binding the snapshot to the exact log content it covers (see
  :func:`snapshot_misfit`). Snapshots written before that field was added
  have no ``last_record``;
  they are *unbound* and never used in place of the log (older code reading a
  newer snapshot ignores the field, so the format stays at schema version 1).
  Since issue 9 the session is stored compressed (zlib, in the defaulted field
  ``compressed``, base64 in the JSON) and ``session`` is ``null``; a snapshot
  with ``compressed`` empty holds its session in ``session``, as before. Older
  code finds no session in a compressed snapshot and ignores it as damaged (it
  is only a cache: the log is replayed).

Parsing fails closed (stored data is data): a malformed header, a length that does not
end on the line's newline, a checksum mismatch, an unknown tag or a schema
version newer than this code raises :class:`~stepmachine.StoredDataError`
naming the file and byte offset. The one exception is a *torn tail*: bytes
after the last newline of a log that do not form a complete record (a write
that never finished, so its batch was never acknowledged). :func:`parse_records`
returns it separately instead of raising.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import zlib
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from stepmachine import StoredDataError

from ._inflate import compressed, inflate
from ._regular import open_regular

__all__ = [
    "PACK_FROM",
    "SCHEMA_VERSION",
    "TAG_BATCH",
    "TAG_CREATE",
    "TAG_HEAD",
    "TAG_SNAPSHOT",
    "LastRecord",
    "LogHead",
    "Record",
    "Snapshot",
    "SnapshotBody",
    "Torn",
    "create_file",
    "decode_struct",
    "digest_of",
    "encode_packed",
    "encode_record",
    "fsync_dir",
    "parse_one",
    "parse_records",
    "read_head",
    "read_range",
    "read_snapshot",
    "snapshot_misfit",
    "snapshot_payload",
    "write_all",
]

SCHEMA_VERSION = 2
"""The newest record schema this code writes and reads (2: a compressed payload)."""

PACK_FROM = 256
"""Create and batch payloads of at least this many bytes are compressed (when that pays)."""

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


class LastRecord(msgspec.Struct, frozen=True):
    """The last log record a snapshot (or a cache) covers.

    Attributes:
        offset: the file offset of the record's first byte (it ends at the
            snapshot's ``offset``).
        digest: :func:`digest_of` the record's bytes, newline included.
    """

    offset: int
    digest: str


class SnapshotBody(msgspec.Struct, frozen=True):
    """Payload of the ``S`` record; ``session`` is encoded by the codec.

    ``last_record`` is None in snapshots written before it existed (unbound).
    ``compressed``, when not empty, is the codec's session record compressed
    with zlib, and ``session`` is then ``null`` (see :func:`snapshot_payload`).
    """

    session_id: str
    nonce: str
    offset: int
    session: msgspec.Raw
    last_record: LastRecord | None = None
    compressed: bytes = b""


"""Snapshots and packed records are compressed fast: they are written on the apply path."""

_NULL = msgspec.Raw(b"null")


def snapshot_payload(
    session_id: str, nonce: str, offset: int, record: bytes, last: LastRecord
) -> bytes:
    """The payload of an ``S`` record holding the codec's session ``record``, compressed
    (as it is when it is longer than a record may inflate to, :data:`MAX_INFLATED`)."""
    packed = compressed(record)
    if packed is None:
        body = SnapshotBody(session_id, nonce, offset, msgspec.Raw(record), last)
    else:
        body = SnapshotBody(session_id, nonce, offset, _NULL, last, packed)
    return msgspec.json.encode(body)


@dataclass(frozen=True, slots=True)
class Record:
    """One parsed, checksum-verified record.

    Attributes:
        offset: file offset of its first byte.
        end: file offset just past its newline.
        tag: its tag letter.
        revision: the revision in its header.
        payload: its payload bytes (of a version-2 record: decompressed).
    """

    offset: int
    end: int
    tag: bytes
    revision: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A snapshot file's content, checksum-verified but not yet checked against the log.

    Attributes:
        path: the snapshot file.
        revision: the revision it holds (from its checksummed header).
        offset: the log offset just past that revision's record.
        last_record: the record it is bound to; None for an unbound (older) snapshot.
        session: the codec-encoded session at ``revision``.
        stale: it belongs to an earlier incarnation of the session's log.
    """

    path: str
    revision: int
    offset: int
    last_record: LastRecord | None
    session: bytes
    stale: bool = False


@dataclass(frozen=True, slots=True)
class Torn:
    """An incomplete final record: ``length`` bytes at file offset ``offset``."""

    offset: int
    length: int


def encode_record(tag: bytes, revision: int, payload: bytes, *, version: int = 1) -> bytes:
    """One record line holding ``payload`` as it is (``version`` is a parameter only so
    tests can forge other records; :func:`encode_packed` writes version 2)."""
    head = b"%d %s %d %d " % (version, tag, revision, len(payload))
    crc = zlib.crc32(payload, zlib.crc32(head))
    return b"%s%08x %s\n" % (head, crc, payload)


def encode_packed(tag: bytes, revision: int, payload: bytes) -> bytes:
    """One record line for ``payload``: version 2 (compressed, base64) when it is at
    least :data:`PACK_FROM` bytes and that makes it smaller, else version 1 as it is."""
    if len(payload) >= PACK_FROM and (deflated := compressed(payload)) is not None:
        packed = base64.b64encode(deflated)
        if len(packed) < len(payload):
            return encode_record(tag, revision, packed, version=2)
    return encode_record(tag, revision, payload)


def _unpacked(packed: bytes, where: str) -> bytes:
    """The payload of a version-2 record: base64, then zlib; StoredDataError otherwise."""
    try:
        return inflate(base64.b64decode(packed, validate=True))
    except (binascii.Error, zlib.error) as exc:
        raise StoredDataError(
            f"stored data is data: the compressed payload of the record in "
            f"{where} does not decompress: {exc}"
        ) from None


def _damaged_at(path: str, offset: int, session: str | None, claimed: bytes | None) -> str:
    """Where a damaged record is: the file and byte, then (when known) the session and
    the revision its header names (``claimed``; the header itself may be what is damaged)."""
    where = f"{path} at byte {offset}"
    if session is None:
        return where
    if claimed is None:
        return f"{where} (session {session!r}, a record whose header names no revision)"
    return f"{where} (session {session!r}, revision {int(claimed)} according to its header)"


def parse_records(
    buf: bytes, base: int, path: str, *, session: str | None = None
) -> tuple[list[Record], Torn | None]:
    """Parse ``buf``, which was read at file offset ``base`` of ``path``.

    Args:
        buf: the bytes read.
        base: the file offset ``buf`` was read at.
        path: the file, named in errors.
        session: the session the file is the log of, named in errors (with
            the revision the damaged record's header names) when given.

    Returns:
        The complete records, in order, and the torn tail if ``buf`` ends in
        one (bytes after the last newline that are not a complete record).

    Raises:
        StoredDataError: any other damage, naming ``path`` and the byte offset
            of the record it is in (and ``session`` and the revision, when
            ``session`` is given).
    """
    records: list[Record] = []
    view = memoryview(buf)
    size = len(buf)
    pos = 0
    remedy = "" if session is None else f"; nothing was rewritten: restore {path} from a backup"
    while pos < size:
        newline = buf.find(b"\n", pos)
        match = _HEADER.match(buf, pos)
        where = _damaged_at(path, base + pos, session, None if match is None else match[3])
        if match is None:
            if newline == -1:
                return records, Torn(base + pos, size - pos)
            raise StoredDataError(
                f"stored data is data: malformed record header in {where}: "
                f"{bytes(view[pos : min(pos + 48, newline)])!r}{remedy}"
            )
        version = int(match[1])
        if version > SCHEMA_VERSION:
            raise StoredDataError(
                f"stored data is data: record in {where} has schema version "
                f"{version}; this version of stepmachine reads up to {SCHEMA_VERSION} "
                "(was it written by a newer stepmachine?)"
            )
        if version < 1:
            raise StoredDataError(
                f"stored data is data: record in {where} has schema version {version}"
            )
        length = int(match[4])
        end = match.end() + length  # where the record's newline must be
        if end >= size and newline == -1:
            return records, Torn(base + pos, size - pos)
        if end >= size or newline != end:
            raise StoredDataError(
                f"stored data is data: record in {where} declares {length} payload "
                f"bytes, which do not end at the end of its line{remedy}"
            )
        crc = zlib.crc32(view[match.end() : end], zlib.crc32(view[pos : match.start(5)]))
        if crc != int(match[5], 16):
            raise StoredDataError(
                f"stored data is data: checksum mismatch in the record in {where} "
                f"(stored {match[5].decode()}, computed {crc:08x}){remedy}"
            )
        tag = match[2]
        if tag not in _TAGS:
            raise StoredDataError(
                f"stored data is data: unknown record tag {tag.decode()!r} in "
                f"{where} (known tags: H, C, B, S)"
            )
        payload = buf[match.end() : end]
        if version == 2:
            payload = _unpacked(payload, where)
        records.append(Record(base + pos, base + end + 1, tag, int(match[3]), payload))
        pos = end + 1
    return records, None


def parse_one(
    buf: bytes, base: int, path: str, tag: bytes, *, session: str | None = None
) -> Record:
    """The first record of ``buf``, which must be complete and tagged ``tag``.

    Raises:
        StoredDataError: it is missing, torn, damaged or of another tag
            (naming ``session`` when given, as :func:`parse_records` does).
    """
    newline = buf.find(b"\n")
    records, _ = parse_records(
        buf[: newline + 1] if newline >= 0 else b"", base, path, session=session
    )
    if not records or records[0].tag != tag:
        found = records[0].tag.decode() if records else "no complete record"
        raise StoredDataError(
            f"stored data is data: expected a {tag.decode()!r} record at byte "
            f"{base} of {path}, found {found}"
        )
    return records[0]


def decode_struct(decoder: msgspec.json.Decoder[S], record: Record, where: str) -> S:
    """Decode a fixed-Struct payload; :class:`StoredDataError` naming ``where`` otherwise."""
    try:
        return decoder.decode(record.payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise StoredDataError(
            f"stored data is data: {record.tag.decode()!r} record in {where} does not decode: {exc}"
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


# -- reading a log and its snapshot -----------------------------------------------------

_head_decoder = msgspec.json.Decoder(LogHead)
_snapshot_decoder = msgspec.json.Decoder(SnapshotBody)


def read_head(fd: int, session_id: str, path: str) -> tuple[str, int]:
    """The log's nonce and the offset just past its head record.

    Raises:
        StoredDataError: no valid head record, or it names another session.
    """
    record = parse_one(os.pread(fd, _HEAD_READ, 0), 0, path, TAG_HEAD, session=session_id)
    head = decode_struct(_head_decoder, record, f"{path} at byte 0")
    if head.session_id != session_id:
        raise StoredDataError(
            f"stored data is data: {path} is the log of session "
            f"{head.session_id!r}, not {session_id!r}"
        )
    return head.nonce, record.end


def read_snapshot(path: str, session_id: str, nonce: str) -> Snapshot | None:
    """The snapshot file at ``path`` for the log ``nonce`` of ``session_id``; None if missing.

    Only the file itself is checked (checksum, format): whether it fits the log
    is :func:`snapshot_misfit`'s question, and its session is decoded by the
    stores' core (:mod:`._replay`). A snapshot of another incarnation (another
    nonce or session id) comes back ``stale``.

    Raises:
        StoredDataError: the file is damaged, or is not a regular file (a FIFO
            is refused without blocking; see :func:`._regular.open_regular`).
        OSError: it cannot be read.
    """
    try:
        fd = open_regular(path, os.O_RDONLY, f"the snapshot of session {session_id!r}")
    except FileNotFoundError:
        return None
    try:
        data = read_range(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    record = parse_one(data, 0, path, TAG_SNAPSHOT)
    body = decode_struct(_snapshot_decoder, record, f"{path} at byte 0")
    stale = body.nonce != nonce or body.session_id != session_id
    session = bytes(body.session)
    if body.compressed:
        try:
            session = inflate(body.compressed)
        except zlib.error as exc:
            raise StoredDataError(
                f"stored data is data: the snapshot {path} at byte 0 holds a "
                f"compressed session that does not decompress: {exc}"
            ) from None
    return Snapshot(path, record.revision, body.offset, body.last_record, session, stale)


def snapshot_misfit(fd: int, snapshot: Snapshot, head_end: int, size: int, log: str) -> str | None:
    """Why ``snapshot`` does not cover exactly the log ``fd`` (``size`` bytes, records
    from ``head_end``, path ``log``); None when it does.

    It does when the bytes just before ``snapshot.offset`` are one complete
    record, for ``snapshot.revision``, whose digest is the one the snapshot was
    bound to when it was written. A log cut back and rewritten since (a
    restored backup, a power loss under ``fsync="never"``) has another record
    there. The check reads that one record, not the whole prefix: a rewrite
    that reproduced this record byte for byte (same revision, step, cycle,
    timestamp and effects) is not detected. An unbound snapshot (no
    ``last_record``) never fits.
    """
    last = snapshot.last_record
    if last is None:
        return "the snapshot is unbound (written by an earlier version); the log is replayed"
    where = f"log offset {snapshot.offset} (revision {snapshot.revision})"
    if snapshot.offset > size:
        return f"the snapshot covers the log up to {where}, past its end ({size} bytes)"
    if not head_end <= last.offset < snapshot.offset:
        return (
            f"the snapshot's last record at offset {last.offset} is not a record before {where} "
            f"(records start at byte {head_end})"
        )
    data = read_range(fd, last.offset, snapshot.offset)
    try:
        records, torn = parse_records(data, last.offset, log)
    except StoredDataError as exc:
        return f"the log bytes before {where} are not the record the snapshot covers: {exc}"
    expected_tag = TAG_BATCH if snapshot.revision > 0 else TAG_CREATE
    if (
        torn is not None
        or len(records) != 1
        or records[0].tag != expected_tag
        or records[0].revision != snapshot.revision
    ):
        return f"the log bytes before {where} are not the record of revision {snapshot.revision}"
    digest = digest_of(data)
    if digest != last.digest:
        return (
            f"the log record before {where} is not the one the snapshot covers (digest {digest}, "
            f"the snapshot was bound to {last.digest}): the log was cut back and rewritten"
        )
    return None


def digest_of(record: bytes) -> str:
    """The hex BLAKE2b-128 digest of a record's bytes (how snapshots and caches bind to it)."""
    return hashlib.blake2b(record, digest_size=16).hexdigest()
