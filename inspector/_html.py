"""STAND-IN for the HTML timeline (h-html writes the real ``inspector/_html.py``).

Only what the live view's tests need, to h-html's contract: ``render_page(view,
*, live_script="")`` returns a page whose entries sit in ``id="timeline"``, with
``live_script`` (JavaScript, no ``</``) in a ``<script>`` at the end;
``render_batch(batch_view)`` returns one ``<section class="batch" id="rev-N"
data-revision="N">``. Everything from the view is escaped. Deleted when the real
module is merged.
"""

from __future__ import annotations

from html import escape
from typing import Any

__all__ = ["render_batch", "render_html", "render_page"]


def render_batch(batch: dict[str, Any]) -> str:
    """One audit-log entry as an HTML ``<section>``."""
    revision = int(batch["revision"])
    return (
        f'<section class="batch" id="rev-{revision}" data-revision="{revision}">'
        f"<h3>#{revision} {escape(str(batch['step']))}</h3>"
        f"<p>{escape(str(batch['summary']))}</p></section>"
    )


def render_html(view: dict[str, Any]) -> str:
    """The session's timeline as one HTML document."""
    return render_page(view)


def render_page(view: dict[str, Any], *, live_script: str = "") -> str:
    """:func:`render_html` plus ``live_script``."""
    if "</" in live_script:
        raise ValueError("live_script must not contain '</'")
    entries = "".join(render_batch(batch) for batch in view["batches"])
    return (
        '<!doctype html><html><head><meta charset="utf-8">'
        f"<title>{escape(str(view['id']))}</title></head><body>"
        f"<h1>{escape(str(view['id']))}</h1>"
        f'<p>revision <span id="session-revision">{int(view["revision"])}</span>, '
        f'status <span id="session-status">{escape(str(view["status"]))}</span></p>'
        f'<div id="timeline">{entries}</div>'
        f"<script>{live_script}</script></body></html>"
    )
