"""Compressing and inflating stored records, with a bound on what a record may inflate to.

Both durable stores compress long records with zlib (SQLite effect rows and
snapshots, FileStore version-2 records and snapshots). Reading one back must
not trust the stored bytes (stored data is data): a small record that inflates to
gigabytes (a decompression bomb, or damage that still passes a checksum
written over it) must fail with a clear error, not exhaust memory, and bytes
after the end of the zlib stream must not be silently ignored.

* :func:`inflate` inflates at most :data:`MAX_INFLATED` bytes and raises
  ``zlib.error`` (which the stores already turn into a
  :class:`~stepmachine.StoredDataError` naming the record) for a stream that
  inflates to more, that does not end, or that is followed by other bytes.
* :func:`compressed` is the write side: it compresses only records of at most
  :data:`MAX_INFLATED` bytes, so nothing a store wrote can fail that bound
  (a larger record is stored as it is, which every reader accepts).
"""

from __future__ import annotations

import zlib
from typing import Final

__all__ = ["MAX_INFLATED", "compressed", "inflate"]

MAX_INFLATED: Final = 256 * 1024 * 1024
"""The most bytes one stored record may inflate to (256 MiB)."""

_LEVEL: Final = 1
"""zlib's fastest level: records are compressed on the apply path."""


def compressed(record: bytes) -> bytes | None:
    """``record`` compressed with zlib, or ``None`` when it is longer than :data:`MAX_INFLATED`."""
    if len(record) > MAX_INFLATED:
        return None
    return zlib.compress(record, _LEVEL)


def inflate(data: bytes) -> bytes:
    """The bytes the zlib stream ``data`` holds, at most :data:`MAX_INFLATED` of them.

    Raises:
        zlib.error: the stream is damaged, inflates to more than
            :data:`MAX_INFLATED` bytes, does not end, or is followed by other bytes.
    """
    inflater = zlib.decompressobj()
    out = inflater.decompress(data, MAX_INFLATED + 1)
    if len(out) > MAX_INFLATED or inflater.unconsumed_tail:
        raise zlib.error(f"it inflates to more than {MAX_INFLATED} bytes, the most a record may")
    if not inflater.eof:
        raise zlib.error("the compressed stream is incomplete")
    if inflater.unused_data:
        raise zlib.error(
            f"{len(inflater.unused_data)} bytes follow the end of the compressed stream"
        )
    return out
