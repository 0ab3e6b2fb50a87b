"""Records to sessions: encoding a batch once, decoding what a backend read, replaying it.

Part of the durable stores' core (:mod:`._core`). Decoding goes through the
codec only (stored data never names a class to import); every
failure is a :class:`~stepmachine.StoredDataError` naming the session and the
record's position (the backend's ``where``), and nothing is rewritten.

Replay applies each batch exactly once, in revision order, and checks that the
revisions follow each other.

Media bytes never enter a record: :func:`encode_batch` replaces them by
references (:mod:`._media_blobs`) and returns the bytes for the backend to
keep by digest; decoding puts them back through a :class:`._media_blobs.Reader`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import msgspec

from stepmachine import Codec, ConfigurationError, Effect, EffectError, Session, StoredDataError
from stepmachine.extend import Batch, Refusal, apply_batch

from ._backend import Base, BatchRecord, EffectRows, StoredBatch
from ._media_blobs import Media, Reader

__all__ = [
    "decode_base",
    "decode_batch",
    "decode_refused",
    "encode_batch",
    "encode_refused",
    "lost",
    "replay",
]

_REFUSED_ENCODER: Final = msgspec.json.Encoder()
_REFUSED_DECODER: Final = msgspec.json.Decoder(tuple[tuple[str, str], ...])
"""Exactly ``[[step, why], ...]``: a pair of strings each, nothing more (an
array-like Struct would skip extra elements)."""


def _fail(problem: str) -> StoredDataError:
    return StoredDataError(f"stored data is data: {problem}")


def encode_refused(refused: tuple[Refusal, ...]) -> str | None:
    """A batch's ``refused`` as the SQL backends store it: compact JSON text
    ``[["step","why"],...]`` (the codec's form of :class:`~stepmachine.Refusal`),
    None when there are none."""
    if not refused:
        return None
    return _REFUSED_ENCODER.encode(refused).decode("utf-8")


def decode_refused(text: str, where: str) -> tuple[Refusal, ...]:
    """The refusals :func:`encode_refused` wrote, read strictly.

    Raises:
        StoredDataError: ``text`` is not a non-empty JSON array of
            ``[step, why]`` string pairs (an empty one is stored as NULL);
            the message names ``where`` (the session and revision).
    """
    try:
        pairs = _REFUSED_DECODER.decode(text)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _fail(f"{where}: the refused column is not a list of [step, why]: {exc}") from None
    if not pairs:
        raise _fail(f"{where}: the refused column holds an empty list (none is stored as NULL)")
    return tuple(Refusal(step, why) for step, why in pairs)


def encode_batch(
    codec: Codec[Any],
    batch: Batch[Effect],
    form: type[BatchRecord] | type[EffectRows],
    where: str,
    media: Media,
) -> tuple[StoredBatch, Batch[Effect], dict[str, bytes]]:
    """``batch`` encoded once in the backend's record ``form``, decoded back, and the
    media bytes it refers to, by digest (to be stored before the record).

    The decoded batch is what a later load reads, so the session a store
    returns from ``apply`` equals the one it will load. O(batch): only this
    batch is encoded and decoded, never the history.

    Raises:
        MediaTooLargeError: a media part is over the store's limit.
        ConfigurationError: an effect type is not registered in the codec, or
            ``refused`` / ``trace`` / ``step`` / ``cycle`` are not what a batch holds (nothing is
            written: a store must never acknowledge what it cannot read back).
        StoredDataError: the codec cannot read back what it wrote.
    """
    _check_trail(batch)
    batch, blobs = media.batch_out(batch)
    stored: StoredBatch
    if form is BatchRecord:
        stored = BatchRecord(batch.revision, where, codec.encode_batch(batch))
    else:
        stored = EffectRows(
            batch.revision,
            where,
            batch.step,
            batch.cycle,
            float(batch.timestamp),
            tuple(codec.encode_effects((effect,)) for effect in batch.effects),
            encode_refused(batch.refused),
            batch.trace,
        )
    # Without bytes taken out, the record refers to none (MediaRef given is refused).
    reader = Reader(media, blobs.get, "the batch's own media") if blobs else None
    return stored, decode_batch(codec, batch.session_id, stored, reader), blobs


def _check_trail(batch: Batch[Effect]) -> None:
    """Raise :class:`ConfigurationError` unless ``batch.refused`` is a tuple of
    :class:`~stepmachine.Refusal` of strings, ``batch.trace`` a str or None,
    ``batch.step`` a str and ``batch.cycle`` an int.

    The step and cycle are checked here rather than left to the codec: SQLite
    keeps them in columns of their own and would store an int or bytes step
    that no later load reads back (the session unreadable for good)."""
    refused, trace = batch.refused, batch.trace
    if type(batch.step) is not str:
        raise ConfigurationError(
            f"batch {batch.revision} of session {batch.session_id!r}: step must be a str "
            f"(the name of the step that wrote it), got {type(batch.step).__name__}"
        )
    if type(batch.cycle) is not int:
        raise ConfigurationError(
            f"batch {batch.revision} of session {batch.session_id!r}: cycle must be an int, "
            f"got {type(batch.cycle).__name__}"
        )
    if trace is not None and type(trace) is not str:
        raise ConfigurationError(
            f"batch {batch.revision} of session {batch.session_id!r}: trace must be a str "
            f"(a W3C traceparent) or None, got {type(trace).__name__}"
        )
    if type(refused) is not tuple or not all(
        type(r) is Refusal and type(r.step) is str and type(r.why) is str for r in refused
    ):
        raise ConfigurationError(
            f"batch {batch.revision} of session {batch.session_id!r}: refused must be a tuple "
            f"of Refusal(step: str, why: str), got {refused!r:.200}"
        )


def decode_batch(
    codec: Codec[Any], session_id: str, stored: StoredBatch, media: Reader | None
) -> Batch[Effect]:
    """The batch a stored record holds, checked against the session and revision it
    was stored under, its media bytes read back through ``media`` (None: the
    caller knows the record refers to none).

    Raises:
        StoredDataError: it does not decode, an effects record does not hold
            exactly one effect, its refusals are malformed, it names another
            session or revision, or a media blob it refers to is missing or damaged.
    """
    where = f"{stored.where} (session {session_id!r}, revision {stored.revision})"
    if isinstance(stored, BatchRecord):
        batch = codec.decode_batch(stored.record, where=where)
        if batch.session_id != session_id or batch.revision != stored.revision:
            raise _fail(
                f"the batch in {stored.where} is for session {batch.session_id!r} revision "
                f"{batch.revision}, expected {session_id!r} revision {stored.revision}"
            )
        return batch if media is None else media.batch(batch, where)
    effects: list[Effect] = []
    for index, record in enumerate(stored.effects):
        at = f"{stored.where} effect {index}"
        decoded = codec.decode_effects(record, where=at)
        if len(decoded) != 1:
            raise _fail(f"{at}: the record holds {len(decoded)} effects, not 1")
        effects.append(decoded[0])
    refused = () if stored.refused is None else decode_refused(stored.refused, stored.where)
    batch = Batch(
        session_id=session_id,
        revision=stored.revision,
        step=stored.step,
        cycle=stored.cycle,
        timestamp=stored.timestamp,
        effects=tuple(effects),
        refused=refused,
        trace=stored.trace,
    )
    return batch if media is None else media.batch(batch, stored.where)


def decode_base(codec: Codec[Any], session_id: str, base: Base[Any], media: Reader) -> Session[Any]:
    """The session a base (a snapshot, the revision-0 record) holds, checked against it,
    its media bytes read back through ``media``.

    Raises:
        StoredDataError: it does not decode, holds another session or revision,
            or a media blob it refers to is missing or damaged.
    """
    where = f"{base.where} (session {session_id!r}, revision {base.revision})"
    session: Session[Any] = codec.decode_session(base.record, where=where)
    if session.id != session_id or session.revision != base.revision:
        raise _fail(
            f"{base.where} holds session {session.id!r} at revision {session.revision}, "
            f"but its header says {session_id!r} at revision {base.revision}"
        )
    return media.session(session, where)


def replay(
    codec: Codec[Any], session: Session[Any], records: Sequence[StoredBatch], media: Reader
) -> Session[Any]:
    """``session`` with every batch of ``records`` applied once, in order.

    Raises:
        StoredDataError: a record is not the next revision, does not decode, or
            no longer applies; it names the session and the record's position.
    """
    for stored in records:
        if stored.revision != session.revision + 1:
            raise _fail(
                f"expected the batch for revision {session.revision + 1} of session "
                f"{session.id!r} in {stored.where}, found revision {stored.revision}"
            )
        batch = decode_batch(codec, session.id, stored, media)
        try:
            session = apply_batch(session, batch.effects)
        except EffectError as exc:
            raise _fail(
                f"the batch in {stored.where} (session {session.id!r}, revision "
                f"{stored.revision}) does not apply: {exc}"
            ) from exc
    return session


def lost(session_id: str, holder: str, claimed: int, reached: int, end: str, remedy: str) -> str:
    """The message of a lost-data error (nothing is lost): ``holder`` saw ``claimed``,
    the log, replayed whole, ends at ``reached`` (``end`` says where)."""
    return (
        f"nothing is lost: {holder} holds session {session_id!r} at revision "
        f"{claimed}, but its log {end} ends at revision {reached}: acknowledged batches "
        f"{reached + 1}..{claimed} are missing (a truncated or restored log, or a power loss "
        "before it reached the disk). Nothing was changed; to accept the loss and carry on "
        f"from the log, {remedy}"
    )
