"""The inspector: look at stored sessions, decide on them, and watch them run.

Installed as ``stepmachine.inspector``; the command line is ``stepmachine``
(or ``python -m stepmachine``, extra ``cli``), the live view
``stepmachine serve`` (extra ``web``). See ``stepmachine --help``.

The pieces, usable from Python too:

- :func:`open_store`: a shipped store named by URL (``sqlite:///agent.sqlite3``,
  ``file:///folder``, ``postgresql://...``), opened read-only unless asked to write;
- :func:`session_status`: what a stored session waits for (done, awaiting
  approval, awaiting event, budget exhausted, outcome unknown, idle);
- :func:`session_view`: a session and its audit log as JSON builtins (what
  ``show --json``, the HTML timeline and the live view read);
- :func:`render_html`: the self-contained HTML timeline of a view;
  :func:`render_page` (the same page with the live view's script) and
  :func:`render_batch` (one timeline entry) for the live view.
"""

from ._html import render_batch, render_html, render_page
from ._open import StoreNotFoundError, UsageError, inspection_codec, load_codec, open_store
from ._status import STATUSES, session_status
from ._view import FORMAT, batch_view, message_view, session_view

__all__ = [
    "FORMAT",
    "STATUSES",
    "StoreNotFoundError",
    "UsageError",
    "batch_view",
    "inspection_codec",
    "load_codec",
    "message_view",
    "open_store",
    "render_batch",
    "render_html",
    "render_page",
    "session_status",
    "session_view",
]
