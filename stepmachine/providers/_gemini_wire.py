"""Gemini's wire format: neutral messages to ``contents``, reply parts back to neutral parts.

Pure functions and one assembler, shared by the blocking reply, the
streamed reply and the JSON-array reply of ``:streamGenerateContent``
without ``alt=sse``: every reply is a sequence of ``GenerateContentResponse``
chunks (a blocking reply is one), so all three give the same response by
construction (same behaviour streaming or not).

Thought signatures. Gemini puts a ``thoughtSignature`` on the part it
belongs to: a ``functionCall``, an answer ``text`` (possibly a trailing
``{"text": "", "thoughtSignature": ...}``) or a thought. The neutral
:class:`~stepmachine.TextPart` and :class:`~stepmachine.ToolCallPart` have no
room for it, so a signature on such a part becomes a *carrier*: a
:class:`~stepmachine.ReasoningPart` with empty text and ``provider_data``
``{"gemini": "signature", "signature": <as sent>}`` placed immediately
before the part it came with (``"alone": True`` when that part was an empty
text, which is not kept). On the next request a carrier goes back on the
part that follows it, or alone as ``{"text": "", "thoughtSignature"}``.
Thought summaries (``thought: true``) become ``ReasoningPart(text,
{"gemini": "thought"})``, with ``"signature"`` when they carried one; they
are sent back only when signed (the API needs signatures, not summaries).
Reasoning from other providers is never sent.

Call ids. Gemini 2.x sends no ``functionCall.id``; an id is then made
from the reply's ``responseId`` and the call's position
(``gemini-call-<responseId>-<n>``). A reply without ``responseId`` (a proxy,
an older API version) gets ``gemini-call-<digest>``, a digest of the turn the
request continues (:func:`turn_of`: how many messages it sends and the id of
the last one), the call's position, name and arguments: the same call in two
turns of one conversation gets two ids (results pair with their call, and
the history stays valid for a provider that wants unique ids), while the same
request gives the same ids every time, streamed or not (replay, and the same
behaviour streaming or not). Such a synthesised id is never sent back: the API pairs
results with calls by order and name, so each ``functionResponse`` carries
the call's name (taken from the call when the result has none).
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from .._media import AudioPart, DocumentPart, ImagePart
from .._messages import Message, Part, ReasoningPart, TextPart, ToolCallPart, ToolResultPart
from .._model import ReasoningChunk, StreamChunk, TextChunk, ToolCallChunk, Usage
from ._media_wire import unsendable
from ._wire import count, expect_list, expect_object, expect_str

__all__ = [
    "SYNTHETIC_ID_PREFIX",
    "Assembler",
    "contents",
    "finish_reason",
    "same_signature",
    "turn_of",
    "usage",
]

SYNTHETIC_ID_PREFIX = "gemini-call-"
"""The start of a call id this adapter made up (never sent back to the API)."""

_BLOCKED = frozenset(
    {
        "SAFETY",
        "RECITATION",
        "BLOCKLIST",
        "PROHIBITED_CONTENT",
        "SPII",
        "IMAGE_SAFETY",
        "IMAGE_PROHIBITED_CONTENT",
        "IMAGE_RECITATION",
    }
)
_FINISH = {"STOP": "stop", "MAX_TOKENS": "length"}


# -- request -------------------------------------------------------------------------------


def contents(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The conversation as ``contents``: ``user`` and ``model`` turns of parts.

    ``system`` messages are left out (they go to ``systemInstruction``); tool
    messages become ``user`` turns of ``functionResponse`` parts (then the
    images and documents the results carry, as ``inlineData``/``fileData``),
    in the order of the calls they answer -- tools that ran in parallel may
    have finished in any order, and without call ids the API pairs results
    with calls by order and name; consecutive turns of one role are merged
    and empty turns dropped, as the API requires.
    """
    names: dict[str, str] = {}
    positions: dict[str, int] = {}
    turns: list[dict[str, Any]] = []
    ranks: list[list[tuple[int, int]]] = []  # per turn, per part: its place once sorted
    for message in messages:
        if message.role in ("system", "assistant"):
            for part in message.parts:
                if isinstance(part, ImagePart | DocumentPart | AudioPart):
                    raise unsendable(
                        "gemini",
                        part,
                        f"Gemini takes media in user turns, not in a {message.role} message",
                    )
        if message.role == "system":
            continue
        if message.role == "assistant":
            calls = [p.call_id for p in message.parts if isinstance(p, ToolCallPart)]
            positions = {call_id: n for n, call_id in enumerate(calls)}
            role, ranked = "model", [((0, 0), p) for p in _model_parts(message.parts, names)]
        elif message.role == "tool":
            role, ranked = "user", _result_parts(message.parts, names, positions)
        else:
            role = "user"
            ranked = [((2, 0), p) for part in message.parts if (p := _user_part(part))]
        if not ranked:
            continue
        if not (turns and turns[-1]["role"] == role):
            turns.append({"role": role, "parts": []})
            ranks.append([])
        turns[-1]["parts"].extend(p for _, p in ranked)
        ranks[-1].extend(rank for rank, _ in ranked)
    for turn, rank in zip(turns, ranks, strict=True):
        order = sorted(range(len(rank)), key=rank.__getitem__)  # stable
        turn["parts"] = [turn["parts"][i] for i in order]
    return turns


def _user_part(part: Part) -> dict[str, Any] | None:
    if isinstance(part, TextPart):
        return {"text": part.text} if part.text else None
    if isinstance(part, ImagePart | DocumentPart | AudioPart):
        return media_part(part)
    return None


_IMAGE_TYPES = frozenset(
    ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/heic", "image/heif")
)
"""The image types Gemini reads (its documentation); others are refused before the request."""


def media_part(part: ImagePart | DocumentPart | AudioPart) -> dict[str, Any]:
    """``inlineData`` (base64 of the bytes) or ``fileData`` (a URL) for a media part.

    Raises:
        ConfigurationError: an image of a type Gemini does not read.
    """
    if isinstance(part, ImagePart) and part.media_type and part.media_type not in _IMAGE_TYPES:
        raise unsendable("gemini", part, "Gemini reads PNG, JPEG, WebP, HEIC and HEIF images")
    if part.data is not None:
        data = base64.b64encode(part.data).decode("ascii")
        return {"inlineData": {"mimeType": part.media_type, "data": data}}
    file: dict[str, Any] = {"fileUri": part.url}
    if part.media_type:
        file["mimeType"] = part.media_type
    return {"fileData": file}


def _model_parts(parts: Sequence[Part], names: dict[str, str]) -> list[dict[str, Any]]:
    """An assistant message's parts, each signature back on the part it came with."""
    out: list[dict[str, Any]] = []
    pending: ReasoningPart | None = None
    for part in parts:
        if isinstance(part, ReasoningPart):
            if pending is not None:
                out.append(_alone(pending))
                pending = None
            data = part.provider_data
            if data.get("gemini") == "signature" and not isinstance(data.get("signature"), str):
                continue  # a carrier that lost its signature carries nothing to send back
            if data.get("gemini") == "signature":
                if data.get("alone"):
                    out.append(_alone(part))
                else:
                    pending = part
            elif data.get("gemini") == "thought" and data.get("signature"):
                out.append(
                    {"text": part.text, "thought": True, "thoughtSignature": data["signature"]}
                )
            continue  # unsigned summaries and other providers' reasoning are not sent
        wire: dict[str, Any] | None = None
        if isinstance(part, TextPart) and part.text:
            wire = {"text": part.text}
        elif isinstance(part, ToolCallPart):
            names[part.call_id] = part.name
            arguments = part.arguments if isinstance(part.arguments, dict) else {}
            call: dict[str, Any] = {"name": part.name, "args": arguments}
            if not part.call_id.startswith(SYNTHETIC_ID_PREFIX):
                call["id"] = part.call_id
            wire = {"functionCall": call}
        if wire is None:
            continue
        if pending is not None:
            wire["thoughtSignature"] = pending.provider_data["signature"]
            pending = None
        out.append(wire)
    if pending is not None:
        out.append(_alone(pending))
    return out


def _alone(carrier: ReasoningPart) -> dict[str, Any]:
    return {"text": "", "thoughtSignature": carrier.provider_data["signature"]}


def _result_parts(
    parts: Sequence[Part], names: dict[str, str], positions: dict[str, int]
) -> list[tuple[tuple[int, int], dict[str, Any]]]:
    """A tool message: one ``functionResponse`` per result, then the media it carries,
    each ranked by the position of the call it answers (unknown calls last)."""
    out: list[tuple[tuple[int, int], dict[str, Any]]] = []
    position = len(positions)
    for part in parts:
        if isinstance(part, ToolResultPart):
            position = positions.get(part.call_id, len(positions))
            key = "error" if part.is_error else "output"
            response: dict[str, Any] = {
                "name": part.name or names.get(part.call_id, ""),
                "response": {key: part.content},
            }
            if not part.call_id.startswith(SYNTHETIC_ID_PREFIX):
                response["id"] = part.call_id
            out.append(((0, position), {"functionResponse": response}))
        elif isinstance(part, ImagePart | DocumentPart | AudioPart):
            out.append(((1, position), media_part(part)))
    return out


def same_signature(a: str, b: str) -> bool:
    """Whether two ``thoughtSignature`` values are the same bytes (standard or url-safe base64)."""
    return _signature_bytes(a) == _signature_bytes(b)


def _signature_bytes(value: str) -> bytes | str:
    try:
        padded = value + "=" * (-len(value) % 4)
        return base64.b64decode(padded.replace("-", "+").replace("_", "/"), validate=True)
    except ValueError:
        return value


# -- reply ---------------------------------------------------------------------------------


@dataclass
class _Run:
    """Consecutive reply parts that make one neutral part (or a call)."""

    kind: str  # "thought", "text" or "call"
    texts: list[str] = field(default_factory=list)
    signature: str | None = None
    call: ToolCallPart | None = None


def turn_of(messages: Sequence[Message]) -> str:
    """What tells a request's turn from every other turn of its conversation: how many
    messages it sends and the id of the last one (message ids are unique in a session).
    The seed of synthesised call ids (see the module docs)."""
    return f"{len(messages)}\0{messages[-1].id if messages else ''}"


class Assembler:
    """Reads reply chunks in order; :meth:`parts` is the assembled response's parts.

    Text and thought parts that follow each other are joined (a stream cuts
    them anywhere), so a reply gives the same parts however it was chunked.
    Only the first candidate (``index`` 0) is read. The last ``usageMetadata``,
    ``modelVersion`` and the last ``finishReason`` win. ``turn`` (from
    :func:`turn_of`) seeds the ids of calls without ``id`` in a reply without
    ``responseId``; without it, they are a digest of the call alone.
    """

    def __init__(self, turn: str | None = None) -> None:
        self.turn = turn
        self.runs: list[_Run] = []
        self.calls = 0
        self.finish: str | None = None
        self.blocked: str | None = None
        self.usage: dict[str, Any] = {}
        self.model: str | None = None
        self.answered = False
        """Whether a chunk held a candidate or a prompt block (an empty reply is malformed)."""

    def feed(self, raw: Any) -> list[StreamChunk]:
        """Take one ``GenerateContentResponse``; return the deltas it adds."""
        chunk = expect_object(raw, "a reply chunk")
        if chunk.get("usageMetadata") is not None:
            self.usage = expect_object(chunk["usageMetadata"], "usageMetadata")
        if chunk.get("modelVersion") is not None:
            self.model = expect_str(chunk["modelVersion"], "modelVersion")
        feedback = expect_object(chunk.get("promptFeedback") or {}, "promptFeedback")
        if feedback.get("blockReason") is not None:
            self.blocked = expect_str(feedback["blockReason"], "blockReason")
            self.answered = True
        response_id = chunk.get("responseId")
        deltas: list[StreamChunk] = []
        for raw_candidate in expect_list(chunk.get("candidates") or [], "candidates"):
            candidate = expect_object(raw_candidate, "a candidate")
            if candidate.get("index", 0) != 0:
                continue
            self.answered = True
            if candidate.get("finishReason") is not None:
                self.finish = expect_str(candidate["finishReason"], "finishReason")
            content = expect_object(candidate.get("content") or {}, "content")
            for part in expect_list(content.get("parts") or [], "parts"):
                deltas.extend(self._part(expect_object(part, "a part"), response_id))
        return deltas

    def _part(self, part: dict[str, Any], response_id: Any) -> list[StreamChunk]:
        signature = part.get("thoughtSignature")
        if signature is not None:
            signature = expect_str(signature, "thoughtSignature")
        if "functionCall" in part:
            call = self._call(expect_object(part["functionCall"], "functionCall"), response_id)
            self.runs.append(_Run("call", signature=signature, call=call))
            index = self.calls
            self.calls += 1
            return [ToolCallChunk(index, call.call_id, call.name, call.raw_arguments)]
        if "text" not in part:
            if signature is not None:  # a signed part of a kind not kept: keep the signature
                self.runs.append(_Run("text", signature=signature))
            return []  # inline data, code execution, ... have no neutral form
        text = expect_str(part["text"], "text")
        kind = "thought" if part.get("thought") is True else "text"
        last = self.runs[-1] if self.runs else None
        if not text and signature is None:
            return []
        if (
            last is not None
            and last.kind == kind
            and not (last.signature is not None and signature is not None)
        ):
            last.texts.append(text)
            last.signature = last.signature or signature
        else:
            self.runs.append(_Run(kind, texts=[text], signature=signature))
        if not text:
            return []
        return [ReasoningChunk(text) if kind == "thought" else TextChunk(text)]

    def _call(self, call: dict[str, Any], response_id: Any) -> ToolCallPart:
        name = expect_str(call.get("name"), "functionCall.name")
        arguments = expect_object(call.get("args") or {}, "functionCall.args")
        raw = msgspec.json.encode(arguments).decode()
        call_id = call.get("id")
        if not call_id:
            if isinstance(response_id, str) and response_id:
                call_id = f"{SYNTHETIC_ID_PREFIX}{response_id}-{self.calls}"
            else:
                seed = f"{self.calls}\0{name}\0{raw}"
                if self.turn is not None:
                    seed = f"{self.turn}\0{seed}"
                digest = hashlib.sha256(seed.encode()).hexdigest()
                call_id = f"{SYNTHETIC_ID_PREFIX}{digest[:16]}"
        # Parsed again from the compact JSON: arguments nested deeper than the kernel
        # accepts are invalid (``arguments`` None), as from every adapter.
        return ToolCallPart.parse(expect_str(call_id, "functionCall.id"), name, raw)

    def parts(self) -> tuple[Part, ...]:
        """The response's parts (see the module docs for signatures)."""
        out: list[Part] = []
        for run in self.runs:
            if run.kind == "thought":
                data: dict[str, Any] = {"gemini": "thought"}
                if run.signature is not None:
                    data["signature"] = run.signature
                out.append(ReasoningPart("".join(run.texts), data))
                continue
            text = "".join(run.texts)
            if run.signature is not None:
                carrier: dict[str, Any] = {"gemini": "signature", "signature": run.signature}
                if run.kind == "text" and not text:
                    carrier["alone"] = True
                out.append(ReasoningPart("", carrier))
            if run.call is not None:
                out.append(run.call)
            elif text:
                out.append(TextPart(text))
        return tuple(out)

    def finish_reason(self) -> str | None:
        """The normalised finish reason (see :func:`finish_reason`)."""
        return finish_reason(self.finish, blocked=self.blocked, calls=self.calls)


def finish_reason(reason: str | None, *, blocked: str | None, calls: int) -> str | None:
    """``"tool_calls"`` for a reply with calls that stopped normally, ``"stop"``,
    ``"length"`` (``MAX_TOKENS``), ``"content_filter"`` for a safety block of the
    answer (``SAFETY``, ``RECITATION``, ``BLOCKLIST``, ``PROHIBITED_CONTENT``,
    ``SPII``, ``IMAGE_*``) or of the prompt (``promptFeedback.blockReason``);
    other reasons lower-cased (``"malformed_function_call"``)."""
    if blocked is not None and reason is None:
        return "content_filter"
    if reason is None:
        return None
    if reason in _BLOCKED:
        return "content_filter"
    if reason == "STOP" and calls:
        return "tool_calls"
    return _FINISH.get(reason, reason.lower())


def usage(raw: dict[str, Any]) -> Usage:
    """``promptTokenCount`` (cached tokens included, also ``cache_read_tokens``);
    output = ``candidatesTokenCount`` + ``thoughtsTokenCount`` (reasoning tokens)."""
    thoughts = count(raw.get("thoughtsTokenCount"))
    return Usage(
        input_tokens=count(raw.get("promptTokenCount")),
        output_tokens=count(raw.get("candidatesTokenCount")) + thoughts,
        cache_read_tokens=count(raw.get("cachedContentTokenCount")),
        reasoning_tokens=thoughts,
    )
