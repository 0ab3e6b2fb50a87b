"""A stored session as plain data: what ``show --json``, the HTML timeline and the live view read.

:func:`session_view` turns a session and its audit log into JSON builtins
(dicts, lists, strings, numbers), in a documented shape (``FORMAT``), so the
three readers agree and a script can read ``show --json`` without importing
stepmachine:

``session_view`` ->
    ``{"format", "id", "revision", "status", "totals", "problems", "messages", "batches"}``

- ``messages``: the stored conversation at ``revision``, hidden messages
  included, each a :func:`message_view`: ``{"id", "role", "visible_to_model",
  "visible_to_user", "added_at", "parts", "notes", "records", "usage"}``.
  A tool call part also says what became of it: ``"state"`` (``"answered"``,
  ``"error"``, ``"awaiting approval"``, ``"outcome unknown"``, ``"open"``),
  its ``"journal"`` entry, its approval ``"decision"`` (who, why) and the id
  of the message holding its ``"result"``.
- ``batches``: the audit log up to ``revision``, each a :func:`batch_view`:
  ``{"revision", "step", "cycle", "timestamp", "elapsed", "refused",
  "trace", "effects", "summary"}``; ``elapsed`` is the seconds since the
  batch before (``None`` for the first), ``effects`` the effects as data
  with a one-line ``"summary"`` each.
- ``totals``: model calls and token counts from the replies' receipts.
- ``problems``: what :func:`~stepmachine.operations.fsck` finds, but pending
  calls (:func:`history_problems`).

An image, document or audio part is shown by what it is, never by its bytes
(no base64 in the JSON, the terminal or the HTML): :func:`media_view`
``{"type", "media_type", "size", "digest", "url", "detail", "title", "cache",
"estimated_tokens"}`` (``size`` and ``digest`` of the bytes, ``None`` for a
URL), and :func:`media_label` says it in one line.

Nothing here runs application code or decodes records into classes: notes
and records are shown as they are stored.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Final

import msgspec

from stepmachine import (
    Annotate,
    AppendMessage,
    AudioPart,
    DocumentPart,
    Effect,
    ImagePart,
    Message,
    ReasoningPart,
    ReplaceConversation,
    Session,
    SetVisibility,
    Store,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    UpdateData,
)
from stepmachine.extend import Batch, Part, media_tokens
from stepmachine.operations import Problem, fsck
from stepmachine.operations._history_guard import OPEN_CALL

from ._records import DECISION, JOURNAL, RECEIPT, REQUEST, describe, find, records_in
from ._status import outcome_unknown, session_status

__all__ = [
    "FORMAT",
    "History",
    "batch_view",
    "effect_summary",
    "finite",
    "head_view",
    "history_problems",
    "load_view",
    "media_label",
    "media_view",
    "message_view",
    "session_view",
]

FORMAT: Final = "stepmachine.inspector.session/1"

_SUMMARY_CUT: Final = 80


def finite(value: float | None) -> float | None:
    """``value``, or ``None`` when it is infinite or NaN (a batch timestamp a clock got wrong:
    SQLite keeps one; JSON cannot hold it)."""
    return value if value is not None and math.isfinite(value) else None


def _builtins(value: Any) -> Any:
    return msgspec.to_builtins(value, str_keys=True)


def _short(text: str, limit: int = _SUMMARY_CUT) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _call_state(call: ToolCallPart, result: ToolResultPart | None) -> str:
    if result is not None:
        return "error" if result.is_error else "answered"
    if find(call.notes, REQUEST) is not None and find(call.notes, DECISION) is None:
        return "awaiting approval"
    if outcome_unknown(find(call.notes, JOURNAL)):
        return "outcome unknown"
    return "open"


MEDIA_TYPES: Final = frozenset(("image", "document", "audio"))
"""The ``type`` of a media part's view."""


def media_view(part: ImagePart | DocumentPart | AudioPart) -> dict[str, Any]:
    """A media part as data: what it is, never its bytes (see the module docstring)."""
    tag = "image" if isinstance(part, ImagePart) else "document"
    if isinstance(part, AudioPart):
        tag = "audio"
    return {
        "type": tag,
        "media_type": part.media_type or None,
        "size": None if part.data is None else len(part.data),
        "digest": part.digest or None,
        "url": part.url,
        "detail": part.detail if isinstance(part, ImagePart) else None,
        "title": part.title if isinstance(part, DocumentPart) else None,
        "cache": part.cache,
        "estimated_tokens": media_tokens(part),
    }


def media_label(view: dict[str, Any]) -> str:
    """A media part's view in one line: ``image image/png, 12,345 bytes, sha256:0123abcd…``,
    or ``document 'report.pdf' https://... (url)``; its detail and cache hints after."""
    pieces = [str(view.get("type"))]
    if view.get("title"):
        pieces.append(repr(view["title"]))
    where = [str(view["media_type"])] if view.get("media_type") else []
    if isinstance(view.get("size"), int):
        where.append(f"{view['size']:,} bytes")
    digest = view.get("digest")
    if isinstance(digest, str) and digest:
        where.append(digest[:15] + "…")
    if view.get("url"):
        where.append(f"{view['url']} (url)")
    if view.get("detail"):
        where.append(f"detail {view['detail']}")
    if view.get("cache"):
        where.append("cache")
    return " ".join(pieces) + (" " + ", ".join(where) if where else "")


def _part_view(part: Any, results: dict[str, tuple[str, ToolResultPart]] | None) -> dict[str, Any]:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    if isinstance(part, ReasoningPart):
        return {"type": "reasoning", "text": part.text}
    if isinstance(part, ToolCallPart):
        found = None if results is None else results.get(part.call_id)
        view: dict[str, Any] = {
            "type": "tool_call",
            "call_id": part.call_id,
            "name": part.name,
            "arguments": _builtins(part.arguments),
            "raw_arguments": part.raw_arguments,
            "notes": _builtins(part.notes),
            "journal": find(part.notes, JOURNAL),
            "decision": find(part.notes, DECISION),
        }
        if results is not None:
            view["state"] = _call_state(part, None if found is None else found[1])
            view["result"] = None if found is None else found[0]
        return view
    if isinstance(part, ToolResultPart):
        return {
            "type": "tool_result",
            "call_id": part.call_id,
            "name": part.name,
            "content": part.content,
            "is_error": part.is_error,
        }
    if isinstance(part, ImagePart | DocumentPart | AudioPart):
        return media_view(part)
    value = _builtins(part)
    return value if isinstance(value, dict) else {"type": type(part).__name__, "value": value}


def message_view(
    message: Message,
    *,
    added_at: int | None = None,
    results: dict[str, tuple[str, ToolResultPart]] | None = None,
) -> dict[str, Any]:
    """``message`` as data (see the module docstring).

    ``results`` (call id -> (message id, result)) lets tool calls say what
    became of them; without it they carry no ``state``.
    """
    receipt = find(message.notes, RECEIPT)
    return {
        "id": message.id,
        "role": message.role,
        "visible_to_model": message.visible_to_model,
        "visible_to_user": message.visible_to_user,
        "added_at": added_at,
        "parts": [_part_view(part, results) for part in message.parts],
        "notes": _builtins(message.notes),
        "records": [
            {"namespace": namespace, "key": key, **record}
            for namespace, key, record in records_in(message.notes)
        ],
        "usage": None if receipt is None else receipt.get("usage"),
        "model": None if receipt is None else receipt.get("model"),
    }


def _message_summary(message: dict[str, Any]) -> str:
    pieces = []
    for part in message["parts"]:
        kind = part.get("type")
        if kind == "text":
            pieces.append(repr(_short(part["text"], 60)))
        elif kind == "tool_call":
            pieces.append(f"call {part['name']}({_short(part['raw_arguments'], 40)})")
        elif kind == "tool_result":
            error = " error" if part["is_error"] else ""
            pieces.append(f"result{error} {_short(part['content'], 40)!r}")
        elif kind == "reasoning":
            pieces.append("reasoning")
        elif kind in MEDIA_TYPES:
            pieces.append(media_label(part))
        else:
            pieces.append(str(kind))
    hidden = "" if message["visible_to_model"] else " (hidden)"
    return f"{message['role']}{hidden} " + "; ".join(pieces)


def effect_summary(effect: dict[str, Any]) -> str:
    """One line saying what the effect (as data) did."""
    kind = effect.get("type")
    if kind == "append_message":
        return "append " + _message_summary(effect["message"])
    if kind == "annotate":
        on = effect["message_id"] + (f" call {effect['call_id']}" if effect.get("call_id") else "")
        said = [describe(record) for record in _values_records(effect.get("values", {}))]
        return f"note {effect['namespace']} on {on}" + (f": {'; '.join(said)}" if said else "")
    if kind == "set_visibility":
        return (
            f"visibility of {len(effect.get('message_ids', []))} message(s): "
            f"to model {effect.get('to_model')}, to user {effect.get('to_user')}"
        )
    if kind == "replace_conversation":
        return f"replace the conversation ({len(effect.get('conversation', []))} messages)"
    if kind == "update_data":
        return f"update data {sorted(effect.get('changes', {}) or {})}"
    return f"{kind}"


def _values_records(values: Any) -> Iterable[dict[str, Any]]:
    if not isinstance(values, dict):
        return []
    return [record for _, _, record in records_in({"_": values})]


class History:
    """What the batches before the one being viewed did: when each message was added, and
    each message's role and parts as they are now (to tell the messages a replacement
    brings or rewrites from the ones it keeps; notes and visibility are shown on the stub
    or by the effects that changed them).

    Args:
        created: the conversation the session was created with (revision 0); without
            it, a message no batch appended counts as new where a replacement first
            shows it.
    """

    def __init__(self, created: Sequence[Message] = ()) -> None:
        self.added: dict[str, int] = {m.id: 0 for m in created}
        self.current: dict[str, tuple[str, tuple[Part, ...]]] = {
            m.id: (m.role, m.parts) for m in created
        }


def _replacement_view(
    effect: ReplaceConversation, history: History, revision: int
) -> dict[str, Any]:
    """The replaced conversation: new or changed messages in full, kept ones as a stub
    (id, role, visibility, ``added_at``, ``"kept": true``), so a view of a long session
    with many compactions does not grow with messages x compactions."""
    messages = []
    for message in effect.conversation:
        history.added.setdefault(message.id, revision)
        added_at = history.added[message.id]
        if history.current.get(message.id) == (message.role, message.parts):
            messages.append(
                {
                    "id": message.id,
                    "role": message.role,
                    "visible_to_model": message.visible_to_model,
                    "visible_to_user": message.visible_to_user,
                    "added_at": added_at,
                    "kept": True,
                }
            )
        else:
            messages.append(message_view(message, added_at=added_at))
    history.current = {m.id: (m.role, m.parts) for m in effect.conversation}
    return {"type": "replace_conversation", "conversation": messages}


def _effect_view(effect: Effect, history: History, revision: int) -> dict[str, Any]:
    if isinstance(effect, AppendMessage):
        history.added.setdefault(effect.message.id, revision)
        history.current[effect.message.id] = (effect.message.role, effect.message.parts)
        view: dict[str, Any] = {
            "type": "append_message",
            "message": message_view(effect.message, added_at=revision),
        }
    elif isinstance(effect, ReplaceConversation):
        view = _replacement_view(effect, history, revision)
    elif isinstance(effect, Annotate | SetVisibility | UpdateData):
        view = _builtins(effect)
    else:
        view = _builtins(effect)
        if not isinstance(view, dict):
            view = {"type": type(effect).__name__, "value": view}
    view["summary"] = effect_summary(view)
    return view


def batch_view(
    batch: Batch[Effect], *, previous: float | None = None, history: History | None = None
) -> dict[str, Any]:
    """``batch`` as data (see the module docstring); ``previous`` is the timestamp before it,
    ``history`` what the batches before it did (updated)."""
    history = History() if history is None else history
    effects = [_effect_view(effect, history, batch.revision) for effect in batch.effects]
    return {
        "revision": batch.revision,
        "step": batch.step,
        "cycle": batch.cycle,
        "timestamp": finite(batch.timestamp),
        "elapsed": finite(None if previous is None else round(batch.timestamp - previous, 6)),
        "refused": [{"step": r.step, "why": r.why} for r in batch.refused],
        "trace": batch.trace,
        "effects": effects,
        "summary": "; ".join(e["summary"] for e in effects) or "(no effects)",
    }


def _results(session: Session[Any]) -> dict[str, tuple[str, ToolResultPart]]:
    results: dict[str, tuple[str, ToolResultPart]] = {}
    for message in session.conversation:
        for part in message.parts:
            if isinstance(part, ToolResultPart):
                results.setdefault(part.call_id, (message.id, part))
    return results


def _totals(messages: Sequence[dict[str, Any]]) -> dict[str, int]:
    totals = {"model_replies": 0, "input_tokens": 0, "output_tokens": 0}
    for message in messages:
        usage = message["usage"]
        if isinstance(usage, dict):
            totals["model_replies"] += 1
            for key in ("input_tokens", "output_tokens"):
                value = usage.get(key, 0)
                totals[key] += value if isinstance(value, int) else 0
    return totals


def history_problems(session: Session[Any]) -> list[Problem]:
    """What :func:`~stepmachine.operations.fsck` finds, but pending calls (``open_call``):
    a call waiting for its tool or an approval is a state, not damage."""
    return [problem for problem in fsck(session) if problem.kind != OPEN_CALL]


def session_view(
    session: Session[Any],
    batches: Sequence[Batch[Effect]],
    *,
    created: Sequence[Message] | None = None,
) -> dict[str, Any]:
    """``session`` and its audit log (the batches up to its revision) as data.

    Batches after ``session.revision`` are left out, so a view of
    ``load_at(id, n)`` with the whole log shows the session as it was at ``n``.
    ``created`` is the conversation at revision 0 (``load_at(id, 0)``): with it,
    the messages the session was created with read ``added_at`` 0 where a
    replacement shows them, not as new there.
    """
    history = History(created or ())
    batch_views = []
    previous: float | None = None
    for batch in batches:
        if batch.revision > session.revision:
            break
        batch_views.append(batch_view(batch, previous=previous, history=history))
        previous = batch.timestamp
    results = _results(session)
    messages = [
        message_view(m, added_at=history.added.get(m.id, 0), results=results)
        for m in session.conversation
    ]
    return {
        "format": FORMAT,
        "id": session.id,
        "revision": session.revision,
        "status": session_status(session),
        "totals": _totals(messages),
        "problems": [_builtins(problem) for problem in history_problems(session)],
        "messages": messages,
        "batches": batch_views,
    }


def head_view(session: Session[Any], history: History, *, status: str) -> dict[str, Any]:
    """What the live page's header and conversation show of ``session``, without the batches.

    ``{"id", "revision", "status", "totals", "problems", "messages", "batch_count"}``,
    as in :func:`session_view` (``batch_count``: the batches up to the revision,
    one per revision); ``history`` has seen every batch up to the session's
    revision (the event stream's). ``status`` is given: the stream knows what
    is running.
    """
    results = _results(session)
    messages = [
        message_view(m, added_at=history.added.get(m.id, 0), results=results)
        for m in session.conversation
    ]
    return {
        "id": session.id,
        "revision": session.revision,
        "status": status,
        "totals": _totals(messages),
        "problems": [_builtins(problem) for problem in history_problems(session)],
        "messages": messages,
        "batch_count": session.revision,
    }


async def load_view(store: Store, session_id: str, at: int | None = None) -> dict[str, Any]:
    """The :func:`session_view` of ``session_id`` in ``store`` (as it was at ``at``).

    Raises:
        SessionNotFoundError: no such session.
        ValueError: ``at`` is beyond the session's revision.
        StoredDataError: a record does not decode with the store's codec.

    Cancellation: only reads; a cancelled call leaves nothing behind.
    """
    session = await (store.load(session_id) if at is None else store.load_at(session_id, at))
    batches = await store.batches(session_id)
    created = (await store.load_at(session_id, 0)).conversation
    return session_view(session, batches, created=created)
