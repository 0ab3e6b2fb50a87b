"""HTML for the pieces of a session view: messages, their parts, records and notes.

Every function takes view data (:mod:`._view`'s JSON builtins) and returns an
HTML fragment. All stored text is hostile: every value that comes from the
session goes through :func:`esc` (``html.escape`` with quotes, and the
characters :mod:`._visible` names shown escaped), in text and
in attribute values alike; nothing from the session is ever placed in a
``<script>``, a ``style`` or a URL other than a ``#fragment``. Long contents
are collapsed in ``<details>`` (the full text stays in the document: it is
readable without JavaScript).
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

from ._records import BUDGET, DECISION, JOURNAL, MARK, RECEIPT, REQUEST, SUMMARY, records_in
from ._view import MEDIA_TYPES, media_label
from ._visible import visible

__all__ = [
    "LONG_CHARS",
    "esc",
    "iso_time",
    "loose_notes",
    "message_html",
    "message_line",
    "pretty_json",
    "record_html",
]

LONG_CHARS: Final = 800
"""Text longer than this (or than ``LONG_LINES`` lines) is collapsed."""
LONG_LINES: Final = 16
EXCERPT: Final = 120
SHORT_JSON: Final = 72
ROLES: Final = frozenset({"user", "assistant", "tool", "system"})

_SKIP: Final = frozenset({RECEIPT})
_SKIPPED_FIELDS: Final = frozenset({"record", "namespace", "key", "ledger"})


def esc(value: object) -> str:
    """``value`` as HTML text, safe in element content and in quoted attribute values.

    Characters that would change what a reader sees unseen (bidirectional
    controls, zero-width characters, controls: :mod:`._visible`) are shown
    escaped, ``\\u202e``.
    """
    return html.escape(visible(value), quote=True)


def pretty_json(value: Any) -> str:
    """``value`` as JSON (not escaped): on one line when short, else indented."""
    try:
        short = json.dumps(value, ensure_ascii=False, default=str)
        if len(short) <= SHORT_JSON:
            return short
        return json.dumps(value, indent=2, ensure_ascii=False, default=str)
    except (ValueError, RecursionError):
        return repr(value)


def iso_time(timestamp: object) -> str:
    """A timestamp in seconds as UTC ISO 8601 with milliseconds, or ``""``."""
    if not isinstance(timestamp, int | float) or isinstance(timestamp, bool):
        return ""
    try:
        moment = datetime.fromtimestamp(timestamp, tz=UTC)
    except (OverflowError, OSError, ValueError):
        return ""
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _excerpt(text: str, limit: int = EXCERPT) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _is_long(text: str) -> bool:
    return len(text) > LONG_CHARS or text.count("\n") >= LONG_LINES


def block(text: str, css: str, *, pre: bool = False) -> str:
    """``text`` in a ``<div>`` (or ``<pre>``) of class ``css``, collapsed when long."""
    tag = "pre" if pre else "div"
    body = f'<{tag} class="{css}">{esc(text)}</{tag}>'
    if not _is_long(text):
        return body
    return (
        f'<details class="long"><summary><span class="excerpt">{esc(_excerpt(text))}</span> '
        f'<span class="meta">({len(text):,} chars)</span></summary>{body}</details>'
    )


def _link(prefix: str, ident: object, label: object | None = None) -> str:
    text = ident if label is None else label
    return f'<a class="ref" href="#{prefix}-{esc(ident)}">{esc(text)}</a>'


def message_line(message: Mapping[str, Any]) -> str:
    """A message in one line: a link to it in the conversation, its role and an excerpt."""
    pieces = []
    for part in message.get("parts", []):
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind == "text":
            pieces.append(_excerpt(str(part.get("text", "")), 80))
        elif kind == "tool_call":
            pieces.append(f"call {part.get('name')}")
        elif kind == "tool_result":
            pieces.append(f"result {_excerpt(str(part.get('content', '')), 60)}")
        elif kind in MEDIA_TYPES:
            pieces.append(media_label(part))
        else:
            pieces.append(str(kind))
    hidden = "" if message.get("visible_to_model", True) else " hidden"
    return (
        f'<li class="line{hidden}">{_link("msg", message.get("id"))} '
        f'<span class="role">{esc(message.get("role"))}</span> {esc("; ".join(pieces))}</li>'
    )


# -- records ----------------------------------------------------------------------------------


def _fields(record: Mapping[str, Any], names: Iterable[str]) -> str:
    items = []
    for name in names:
        value = record.get(name)
        if value in (None, "", False):
            continue
        shown: object = iso_time(value) if name.endswith("_at") or name == "at" else ""
        if not shown:
            shown = value if isinstance(value, str | int | float) else pretty_json(value)
        items.append(f'<span class="field"><span class="k">{esc(name)}</span> {esc(shown)}</span>')
    return " ".join(items)


def _ledger(record: Mapping[str, Any]) -> str:
    ledger = record.get("ledger")
    totals = ledger.get("session") if isinstance(ledger, dict) else None
    if not (isinstance(totals, list) and len(totals) == 3):
        return ""
    calls, tokens_in, tokens_out = totals
    return (
        f'<span class="field"><span class="k">model calls so far</span> {esc(calls)} '
        f"({esc(tokens_in)} in / {esc(tokens_out)} out tokens)</span>"
    )


def _line(css: str, label: str, body: str, where: str, after: str = "") -> str:
    origin = f' <span class="meta">{esc(where)}</span>' if where else ""
    return (
        f'<div class="record {css}"><span class="tag">{esc(label)}</span> {body}{origin}'
        f"{after}</div>"
    )


_JOURNAL_FIELDS: Final = (
    "side_effects",
    "idempotency_key",
    "attempt",
    "at",
    "rerun_approved",
    "rerun_attempt",
    "decided_by",
    "decision_note",
)
_DECISION_FIELDS: Final = (
    "reason",
    "message",
    "tool",
    "decided_at",
    "expires_at",
    "always",
    "edited",
)


Lookup = Mapping[Any, Mapping[str, Any]]
"""Message views by id, to show the messages a compaction summarised as lines."""


def _summarised(ids: Sequence[Any], lookup: Lookup | None) -> str:
    if lookup is None:
        return '<div class="ids">' + " ".join(_link("msg", ident) for ident in ids) + "</div>"
    lines = "".join(
        message_line(lookup[ident]) if ident in lookup else f"<li>{_link('msg', ident)}</li>"
        for ident in ids
    )
    return (
        f'<details class="summarised"><summary>what it summarised and hid ({len(ids)})'
        f"</summary><ul>{lines}</ul></details>"
    )


def record_html(record: Mapping[str, Any], where: str = "", lookup: Lookup | None = None) -> str:
    """One tagged record (an operation's note) as a readable line; ``where``: its namespace.

    A compaction summary lists the messages it summarised: as lines with an
    excerpt when ``lookup`` has them, else as links.
    """
    tag = str(record.get("record"))
    if tag == DECISION:
        outcome = str(record.get("outcome"))
        css = "decision approved" if outcome == "approved" else "decision denied"
        by = f'by <b class="by">{esc(record.get("by"))}</b> '
        return _line(css, outcome, by + _fields(record, _DECISION_FIELDS), where)
    if tag == REQUEST:
        body = _fields(record, ("fingerprint", "requested_at"))
        return _line("request", "approval requested", body, where)
    if tag == JOURNAL:
        label = "journal intent" if record.get("intent") else "journal entry"
        return _line("journal", label, _fields(record, _JOURNAL_FIELDS), where)
    if tag == SUMMARY:
        summarised = record.get("summarised")
        ids = summarised if isinstance(summarised, list) else []
        fields = ("tokens_before", "tokens_after", "trigger", "cut", "model", "summarised_into")
        body = f"summarised {len(ids)} message(s) {_fields(record, fields)}"
        return _line("compaction", "compaction summary", body, where, _summarised(ids, lookup))
    if tag == MARK:
        into = record.get("summarised_into")
        what = f"hidden, summarised into {_link('msg', into)} " if into else ""
        body = what + _fields(record, ("stuck", "attempts")) + _ledger(record)
        return _line("compaction", "compaction mark", body, where)
    if tag == BUDGET:
        return _line("budget", "budget refusal", _fields(record, ("refused",)), where)
    names = [name for name in record if name not in _SKIPPED_FIELDS]
    return _line("other", tag, _fields(record, names), where)


def loose_notes(notes: Mapping[str, Any]) -> dict[str, Any]:
    """The notes that are not tagged records (shown as JSON)."""
    loose: dict[str, Any] = {}
    for namespace, value in notes.items():
        if not isinstance(value, dict):
            loose[namespace] = value
        elif not isinstance(value.get("record"), str):
            rest = {
                key: inner
                for key, inner in value.items()
                if not (isinstance(inner, dict) and isinstance(inner.get("record"), str))
            }
            if rest:
                loose[namespace] = rest
    return loose


def notes_html(
    notes: Any, *, skip: frozenset[str] = frozenset(), lookup: Lookup | None = None
) -> str:
    """The records and the other notes of a message or a call."""
    if not isinstance(notes, dict) or not notes:
        return ""
    out = [
        record_html(record, f"{namespace}/{key}" if key else namespace, lookup)
        for namespace, key, record in records_in(notes)
        if record.get("record") not in skip
    ]
    loose = loose_notes(notes)
    if loose:
        out.append(
            '<div class="record loose"><span class="tag">notes</span>'
            + block(pretty_json(loose), "json", pre=True)
            + "</div>"
        )
    return "".join(out)


# -- parts and messages -----------------------------------------------------------------------


def _arguments(part: Mapping[str, Any]) -> str:
    arguments = part.get("arguments")
    raw = str(part.get("raw_arguments", ""))
    if arguments is None and raw.strip():
        return '<div class="invalid">arguments are not valid JSON; as sent:</div>' + block(
            raw, "args", pre=True
        )
    return block(pretty_json(arguments), "args", pre=True)


def _call(part: Mapping[str, Any], in_conversation: bool) -> str:
    call_id = part.get("call_id")
    state = part.get("state")
    head = [
        f'<span class="kw">call</span> <code class="tool">{esc(part.get("name"))}</code>',
        f'<span class="cid">{esc(call_id)}</span>',
    ]
    if state is not None:
        head.append(f'<span class="state">{esc(state)}</span>')
    if part.get("result"):
        head.append("→ " + _link("msg", part.get("result"), "result"))
    ident = f' id="call-{esc(call_id)}"' if in_conversation else ""
    css = "call" if state is None else f"call state-{esc(str(state).replace(' ', '-'))}"
    return (
        f'<div class="{css}"{ident}><div class="head">{" ".join(head)}</div>'
        f"{_arguments(part)}{notes_html(part.get('notes'))}</div>"
    )


def _result(part: Mapping[str, Any], in_conversation: bool) -> str:
    error = bool(part.get("is_error"))
    call_id = part.get("call_id")
    if in_conversation:
        target = _link("call", call_id)
    else:
        target = f'<span class="cid">{esc(call_id)}</span>'
    badge = ' <span class="state">error</span>' if error else ""
    return (
        f'<div class="result{" error" if error else ""}"><div class="head">'
        f'<span class="kw">result</span> of <code class="tool">{esc(part.get("name"))}</code> '
        f"{target}{badge}</div>{block(str(part.get('content', '')), 'content', pre=True)}</div>"
    )


def part_html(part: Any, *, in_conversation: bool = False) -> str:
    """One part of a message."""
    if not isinstance(part, dict):
        return block(pretty_json(part), "json", pre=True)
    kind = part.get("type")
    if kind == "text":
        return block(str(part.get("text", "")), "text")
    if kind == "reasoning":
        text = str(part.get("text", ""))
        return (
            f'<details class="reasoning"><summary>reasoning <span class="meta">'
            f'({len(text):,} chars)</span></summary><div class="text">{esc(text)}</div></details>'
        )
    if kind == "tool_call":
        return _call(part, in_conversation)
    if kind == "tool_result":
        return _result(part, in_conversation)
    if kind in MEDIA_TYPES:
        # Metadata only: the page's policy loads no image (default-src 'none', no img-src),
        # and the view the page is made from holds no bytes.
        tokens = part.get("estimated_tokens")
        about = f" (~{tokens:,} tokens)" if isinstance(tokens, int) else ""
        return (
            f'<div class="part-other media"><span class="kw">{esc(kind)}</span> '
            f'<span class="meta">{esc(media_label(part))}{esc(about)}</span></div>'
        )
    return (
        f'<div class="part-other"><span class="kw">{esc(kind)}</span>'
        f"{block(pretty_json(part), 'json', pre=True)}</div>"
    )


def _usage(message: Mapping[str, Any]) -> str:
    usage = message.get("usage")
    model = message.get("model")
    if not isinstance(usage, dict) and not model:
        return ""
    bits = [f"model {model}"] if model else []
    if isinstance(usage, dict):
        tokens = (usage.get("input_tokens", 0), usage.get("output_tokens", 0))
        bits.append(f"{tokens[0]} in / {tokens[1]} out tokens")
        bits.extend(
            f"{key.removesuffix('_tokens').replace('_', ' ')} {usage[key]}"
            for key in ("reasoning_tokens", "cache_read_tokens", "cache_write_tokens")
            if usage.get(key)
        )
    for record in message.get("records", []):
        if isinstance(record, dict) and record.get("record") == RECEIPT:
            if record.get("finish_reason"):
                bits.append(f"finish {record['finish_reason']}")
            attempts = record.get("attempts")
            if isinstance(attempts, int) and attempts > 1:
                bits.append(f"{attempts} attempts")
    return f'<span class="usage">{esc(" · ".join(bits))}</span>'


def message_html(
    message: Mapping[str, Any], *, in_conversation: bool = False, lookup: Lookup | None = None
) -> str:
    """A whole message: role, id, visibility, usage, parts, records and notes.

    ``lookup`` (message views by id) lets a compaction summary list what it
    summarised with excerpts.

    In the conversation (``in_conversation``) it carries ``id="msg-<id>"``, its
    calls ``id="call-<call id>"``, and links to the batch that added it.
    """
    role = str(message.get("role"))
    css = ["msg", f"role-{role if role in ROLES else 'other'}"]
    badges = []
    if not message.get("visible_to_model", True):
        css.append("hidden")
        badges.append('<span class="badge">hidden from the model</span>')
    if not message.get("visible_to_user", True):
        badges.append('<span class="badge">hidden from users</span>')
    ident = message.get("id")
    head = [f'<span class="role">{esc(role)}</span>']
    if in_conversation:
        added = message.get("added_at")
        head.append(f'<span class="mid">{esc(ident)}</span>')
        if isinstance(added, int) and added > 0:
            head.append(f'<span class="meta">added at</span> {_link("rev", added, f"#{added}")}')
    else:
        head.append(_link("msg", ident))
    head.extend(badges)
    head.append(_usage(message))
    attribute = f' id="msg-{esc(ident)}"' if in_conversation else ""
    parts = "".join(
        part_html(part, in_conversation=in_conversation) for part in message.get("parts", [])
    )
    return (
        f'<article class="{" ".join(css)}"{attribute}><div class="head">{" ".join(head)}</div>'
        f"{parts}{notes_html(message.get('notes'), skip=_SKIP, lookup=lookup)}</article>"
    )
