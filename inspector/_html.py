"""The session timeline as one self-contained HTML document (``export --html``, the live view).

Three functions, all reading :func:`~stepmachine.inspector.session_view` data:

- :func:`render_html` ``(view) -> str``: the whole document, written by
  ``stepmachine export SESSION --html FILE``;
- :func:`render_page` ``(view, *, live_script="") -> str``: the same document
  with an extra inline script, for the live view (``stepmachine serve``);
- :func:`render_batch` ``(batch) -> str``: one timeline entry (a
  :func:`~stepmachine.inspector.batch_view`), the fragment the live view
  appends as batches arrive.

The document: a header (session id, revision, status, model replies, tokens,
the problems ``fsck`` finds), the timeline (``<div id="timeline">``, one
``<section class="batch" id="rev-N" data-revision="N">`` per batch: step,
cycle, UTC time, time since the batch before, the steps that refused first
and why, then what its effects did), and the stored conversation at the
view's revision (``<section id="conversation">``; a message is
``<article id="msg-ID">``, a tool call ``id="call-ID"``, with its state and a
link to its result; hidden messages are marked ``class="msg hidden"``).

Self-contained and safe to open: no external URL of any kind (inline style
and script only, and a Content-Security-Policy that allows nothing else:
``default-src 'none'``, the page's own style and script allowed by their
hashes, so injected markup would not run even if it got in); every stored
value escaped (text, tool names, arguments, notes, step names, ids, refusal
reasons); nothing from the session inside a ``<script>``. Images, documents
and audio are shown as metadata (kind, media type, size, digest, URL, hints;
:func:`~stepmachine.inspector.media_label`), never as pixels or bytes: the
view holds no bytes, and the policy has no ``img-src``, so no thumbnail
(an inline ``data:`` image would be the whole image, not a thumbnail, with no
image library to shrink it, and would grow the page by its size). All text is in the
markup: without JavaScript the page reads the same (collapsed parts open
with a click, ``<details>``); only the search box needs JavaScript, and stays
hidden without it.

Size and time: about 1-2 KB per batch (refusals and long texts collapsed,
each note rendered once, a compaction lists only what it summarised); a
2,300-batch session with 224 compactions renders in about 0.3 s to 5 MB.

For the live view, the page's script exposes ``window.stepmachineTimeline``:
``append(html)`` adds a :func:`render_batch` fragment to ``#timeline``
(ignored when an entry with that revision is already there, so a replay after
a reconnect is harmless) and re-applies the search; ``filter()`` re-applies
the search. The header's ``#session-revision`` and ``#session-status`` hold
the revision and the status as text; each fact's ``<dd>`` is ``#fact-LABEL``
(``#fact-model-replies``, ``#fact-tokens``, ``#fact-batches``,
``#fact-messages``). The live view replaces ``#session``
(the header: revision, status, model replies, tokens, batches, messages,
problems) and ``#conversation`` with :func:`render_head`'s markup as the
session advances.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.resources
from collections.abc import Mapping, Sequence
from typing import Any, Final

from ._html_parts import (
    block,
    esc,
    iso_time,
    message_html,
    message_line,
    notes_html,
    pretty_json,
)

__all__ = [
    "content_security_policy",
    "page_policy",
    "render_batch",
    "render_head",
    "render_html",
    "render_page",
]

MAX_NEW: Final = 20
"""A replaced conversation shows this many new or rewritten messages in full, the others as lines.

New: ``added_at`` is the batch's revision (or unknown). Without the ``added``
map threaded through :func:`~stepmachine.inspector.batch_view`, every
message of a replacement counts as new.
"""


def _sha256(source: str) -> str:
    digest = hashlib.sha256(source.encode("utf-8")).digest()
    return f"'sha256-{base64.b64encode(digest).decode('ascii')}'"


def content_security_policy(*scripts: str) -> str:
    """The page's Content-Security-Policy: only the page's own style and ``scripts``.

    Nothing is fetched (``default-src 'none'``); the inline style and scripts
    are allowed by their SHA-256 hashes, so markup that slipped into the page
    (an inline script, an ``onerror`` attribute) would not run. With more
    than the page's own script (the live view's), ``connect-src 'self'``
    lets it open server-sent events to the serving origin.
    """
    allowed = " ".join(_sha256(script) for script in scripts)
    policy = (
        f"default-src 'none'; style-src {_sha256(_asset('timeline.css'))}; "
        f"script-src {allowed}; base-uri 'none'; form-action 'none'"
    )
    return policy + "; connect-src 'self'" if len(scripts) > 1 else policy


def page_policy(live_script: str = "") -> str:
    """The Content-Security-Policy of ``render_page(view, live_script=live_script)``.

    The same text as the page's ``<meta>`` policy, for a server to send as a header.
    """
    return content_security_policy(_asset("timeline.js"), *([live_script] if live_script else []))


@functools.cache
def _asset(name: str) -> str:
    return (importlib.resources.files(__package__) / "_assets" / name).read_text("utf-8")


def _clean(document: str) -> str:
    # Lone surrogates cannot be written as UTF-8; they become "?".
    try:
        document.encode("utf-8")
    except UnicodeEncodeError:
        return document.encode("utf-8", "replace").decode("utf-8")
    return document


# -- effects ----------------------------------------------------------------------------------


def _note(effect: Mapping[str, Any]) -> str:
    message_id = effect.get("message_id")
    call_id = effect.get("call_id")
    target = f'message <a class="ref" href="#msg-{esc(message_id)}">{esc(message_id)}</a>'
    if call_id:
        target += f' call <a class="ref" href="#call-{esc(call_id)}">{esc(call_id)}</a>'
    namespace = effect.get("namespace")
    values = effect.get("values")
    body = notes_html({str(namespace): values}) if isinstance(values, dict) else ""
    if not body:
        body = block(pretty_json(values), "json", pre=True)
    return (
        f'<div class="effect note"><div class="head"><span class="kw">note</span> '
        f'<span class="ns">{esc(namespace)}</span> on {target}</div>{body}</div>'
    )


def _visibility(effect: Mapping[str, Any]) -> str:
    ids = effect.get("message_ids") or []
    changes = []
    for key, label in (("to_model", "the model"), ("to_user", "users")):
        value = effect.get(key)
        if value is not None:
            changes.append(f"{'shown to' if value else 'hidden from'} {label}")
    links = " ".join(f'<a class="ref" href="#msg-{esc(i)}">{esc(i)}</a>' for i in ids)
    return (
        f'<div class="effect visibility"><div class="head"><span class="kw">visibility</span> '
        f"{esc(', '.join(changes) or 'unchanged')}: {len(ids)} message(s)</div>"
        f'<div class="ids">{links}</div></div>'
    )


def _replacement(effect: Mapping[str, Any], revision: object) -> str:
    conversation = [m for m in effect.get("conversation") or [] if isinstance(m, dict)]
    by_id = {m.get("id"): m for m in conversation}
    # Kept messages are stubs ("kept": true); the others are new or rewritten (an
    # earlier message whose role or parts changed): both are shown whole.
    shown = [m for m in conversation if not m.get("kept")]
    new = [m for m in shown if m.get("added_at") in (revision, None)]
    rewritten = len(shown) - len(new)
    hidden = sum(1 for m in conversation if not m.get("visible_to_model", True))
    head = (
        f'<div class="effect replace"><div class="head"><span class="kw">conversation replaced'
        f"</span> {len(conversation)} message(s): {len(conversation) - hidden} visible to the "
        f"model, {hidden} hidden; {len(new)} new, {rewritten} rewritten</div>"
    )
    out = [head]
    for message in shown[:MAX_NEW]:
        if message.get("added_at") not in (revision, None):
            out.append('<div class="meta rewritten">rewritten:</div>')
        out.append(message_html(message, lookup=by_id))
    if len(shown) > MAX_NEW:
        lines = "".join(message_line(m) for m in shown[MAX_NEW:])
        out.append(
            f"<details><summary>{len(shown) - MAX_NEW} more new or rewritten message(s)"
            f"</summary><ul>{lines}</ul></details>"
        )
    out.append("</div>")
    return "".join(out)


def _effect(effect: Any, revision: object) -> str:
    if not isinstance(effect, dict):
        return block(pretty_json(effect), "json", pre=True)
    kind = effect.get("type")
    if kind == "append_message" and isinstance(effect.get("message"), dict):
        return f'<div class="effect append">{message_html(effect["message"])}</div>'
    if kind == "annotate":
        return _note(effect)
    if kind == "set_visibility":
        return _visibility(effect)
    if kind == "replace_conversation":
        return _replacement(effect, revision)
    if kind == "update_data":
        return (
            '<div class="effect data"><div class="head"><span class="kw">data</span> updated'
            f"</div>{block(pretty_json(effect.get('changes')), 'json', pre=True)}</div>"
        )
    rest = {key: value for key, value in effect.items() if key not in ("type", "summary")}
    return (
        f'<div class="effect other"><div class="head"><span class="kw">{esc(kind)}</span> '
        f"{esc(effect.get('summary', ''))}</div>{block(pretty_json(rest), 'json', pre=True)}</div>"
    )


# -- the timeline -----------------------------------------------------------------------------


def _refusals(refused: Sequence[Any]) -> str:
    items = [r for r in refused if isinstance(r, dict)]
    if not items:
        return ""
    names = ", ".join(str(r.get("step")) for r in items)
    rows = "".join(
        f'<li><span class="step">{esc(r.get("step"))}</span>: {esc(r.get("why") or "")}</li>'
        for r in items
    )
    return (
        f'<details class="refused"><summary>refused first: {esc(names)}</summary>'
        f"<ul>{rows}</ul></details>"
    )


def _seconds(elapsed: object) -> str:
    if not isinstance(elapsed, int | float) or isinstance(elapsed, bool):
        return ""
    text = f"+{elapsed * 1000:.1f} ms" if elapsed < 1 else f"+{elapsed:,.3f} s"
    return f'<span class="elapsed">{esc(text)}</span>'


def render_batch(batch: Mapping[str, Any]) -> str:
    """One batch (a :func:`~stepmachine.inspector.batch_view`) as a timeline entry.

    Returns ``<section class="batch" id="rev-N" data-revision="N">...</section>``:
    revision, step, cycle, time, elapsed, the refusals before it, its effects.
    Every stored value is escaped.
    """
    revision = batch.get("revision")
    rev = esc(revision)
    when = iso_time(batch.get("timestamp"))
    effects = batch.get("effects") or []
    body = "".join(_effect(effect, revision) for effect in effects)
    if not body:
        body = '<div class="meta">(no effects)</div>'
    trace = batch.get("trace")
    trace_html = f'<span class="meta">trace {esc(trace)}</span>' if trace else ""
    return _clean(
        f'<section class="batch" id="rev-{rev}" data-revision="{rev}">'
        f'<div class="batch-head"><a class="rev" href="#rev-{rev}">#{rev}</a> '
        f'<span class="step">{esc(batch.get("step"))}</span> '
        f'<span class="cycle">cycle {esc(batch.get("cycle"))}</span> '
        f"<time>{esc(when)}</time> {_seconds(batch.get('elapsed'))} "
        f"{trace_html}</div>{_refusals(batch.get('refused') or [])}"
        f'<div class="effects">{body}</div></section>'
    )


# -- the page ---------------------------------------------------------------------------------


def _problem(problem: Any) -> str:
    if not isinstance(problem, dict):
        return f"<li>{esc(problem)}</li>"
    message_id = problem.get("message_id")
    call = f" call {esc(problem.get('call_id'))}" if problem.get("call_id") else ""
    return (
        f'<li><span class="tag">{esc(problem.get("kind"))}</span> '
        f'<a class="ref" href="#msg-{esc(message_id)}">{esc(message_id)}</a>{call}: '
        f"{esc(problem.get('detail'))}</li>"
    )


def _header(view: Mapping[str, Any]) -> str:
    totals = view.get("totals") or {}
    problems = list(view.get("problems") or [])
    rows = [
        ("revision", f'<span id="session-revision">{esc(view.get("revision"))}</span>'),
        ("status", f'<span id="session-status">{esc(view.get("status"))}</span>'),
        ("model replies", esc(totals.get("model_replies", 0))),
        (
            "tokens",
            f"{esc(totals.get('input_tokens', 0))} in / {esc(totals.get('output_tokens', 0))} out",
        ),
        ("batches", esc(view.get("batch_count", len(view.get("batches") or [])))),
        ("messages", esc(len(view.get("messages") or []))),
        ("problems", esc(len(problems)) if problems else "none"),
    ]
    facts = "".join(
        f'<div><dt>{label}</dt><dd id="fact-{label.replace(" ", "-")}">{value}</dd></div>'
        for label, value in rows
    )
    problem_list = ""
    if problems:
        items = "".join(_problem(p) for p in problems)
        problem_list = f'<ul class="problems">{items}</ul>'
    return (
        f'<header id="session"><h1>session <span id="session-id">{esc(view.get("id"))}</span>'
        f'</h1><dl class="facts">{facts}</dl>{problem_list}</header>'
    )


def _conversation(view: Mapping[str, Any]) -> str:
    messages = [m for m in view.get("messages") or [] if isinstance(m, dict)]
    hidden = sum(1 for m in messages if not m.get("visible_to_model", True))
    by_id = {m.get("id"): m for m in messages}
    body = "".join(message_html(m, in_conversation=True, lookup=by_id) for m in messages)
    return (
        f'<section id="conversation"><h2>Conversation <span class="meta">at revision '
        f"{esc(view.get('revision'))}: {len(messages)} message(s), {hidden} hidden from the "
        f"model</span></h2>{body}</section>"
    )


def render_head(view: Mapping[str, Any]) -> dict[str, str]:
    """The page's header and conversation for ``view`` (a :func:`~._view.head_view`).

    ``{"header": "<header id=session>...", "conversation": "<section
    id=conversation>..."}``, the same markup :func:`render_page` writes, for
    the live page to put in place of its own as the session advances. Every
    stored value is escaped.
    """
    return {"header": _clean(_header(view)), "conversation": _clean(_conversation(view))}


def render_page(view: Mapping[str, Any], *, live_script: str = "") -> str:
    """The whole HTML document for ``view``, plus ``live_script`` (inline JavaScript).

    ``live_script`` is trusted code (the live view's), run after the page's
    own script; the Content-Security-Policy allows it by its hash and, when
    it is given, ``connect-src 'self'`` (server-sent events from the serving
    origin). See :func:`content_security_policy`.

    Raises:
        ValueError: ``live_script`` contains ``</`` (it would end the script element).
    """
    if "</" in live_script:
        raise ValueError("live_script must not contain '</' (it would close the <script>)")
    scripts = [_asset("timeline.js"), *([live_script] if live_script else [])]
    csp = page_policy(live_script)
    timeline = "".join(render_batch(b) for b in view.get("batches") or [] if isinstance(b, dict))
    document = (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{esc(csp)}">'
        '<meta name="referrer" content="no-referrer">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta name="color-scheme" content="light dark">'
        f"<title>stepmachine session {esc(view.get('id'))}</title>"
        f"<style>{_asset('timeline.css')}</style></head><body>"
        f"{_header(view)}"
        '<nav id="search" hidden><input type="search" id="search-box" '
        'placeholder="Search the timeline and the conversation" aria-label="Search" '
        'autocomplete="off"> <span id="search-count"></span></nav>'
        f'<main><h2>Timeline</h2><div id="timeline">{timeline}</div>{_conversation(view)}</main>'
        f"{''.join(f'<script>{script}</script>' for script in scripts)}</body></html>\n"
    )
    return _clean(document)


def render_html(view: Mapping[str, Any]) -> str:
    """The self-contained HTML timeline of ``view`` (what ``export --html`` writes).

    ``view`` is :func:`~stepmachine.inspector.session_view`'s result. Pure: no
    IO; a 2,000-batch session renders in well under a second.
    """
    return render_page(view)
