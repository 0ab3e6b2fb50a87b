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
  ``show --json``, the HTML timeline and the live view read); images,
  documents and audio as metadata (:func:`media_view`, :func:`media_label`),
  never their bytes;
- :func:`render_html`: the self-contained HTML timeline of a view;
  :func:`render_page` (the same page with the live view's script) and
  :func:`render_batch` (one timeline entry) for the live view;
- :func:`create_app` / :func:`serve` (extra ``web``, imported on first use):
  the live view, a Starlette application over an open store and the server
  ``stepmachine serve`` runs; :class:`LiveHub` (a :class:`LiveSource`) streams
  an in-process run's display events to it.
"""

from typing import TYPE_CHECKING, Any

from stepmachine._public import publish as _publish

from ._html import render_batch, render_html, render_page
from ._live import LiveHub
from ._open import StoreNotFoundError, UsageError, inspection_codec, load_codec, open_store
from ._sse import LiveSource
from ._status import STATUSES, session_status
from ._view import (
    FORMAT,
    History,
    batch_view,
    load_view,
    media_label,
    media_view,
    message_view,
    session_view,
)

if TYPE_CHECKING:  # imported on first use (see __getattr__); seen by type checkers and the docs
    from ._web import create_app as create_app
    from ._web import serve as serve

__all__ = [
    "FORMAT",
    "STATUSES",
    "History",
    "LiveHub",
    "LiveSource",
    "StoreNotFoundError",
    "UsageError",
    "batch_view",
    "create_app",
    "inspection_codec",
    "load_codec",
    "load_view",
    "media_label",
    "media_view",
    "message_view",
    "open_store",
    "render_batch",
    "render_html",
    "render_page",
    "serve",
    "session_status",
    "session_view",
]


def __getattr__(name: str) -> Any:
    """``create_app`` and ``serve``, imported on first use: they need the extra ``web``.

    Raises:
        ImportError: Starlette or uvicorn is missing (the message says to install
            ``stepmachine[web]``).
    """
    if name in ("create_app", "serve"):
        from . import _web  # noqa: PLC0415 - the extra is optional

        value = getattr(_web, name)
        value.__module__ = __name__  # its public home, as _publish does for the others
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_publish(__name__, globals())
