"""Whether the live view's extra (``web``: Starlette and uvicorn) is installed.

Importable without the extra, so a command line can say what to install
before it imports :mod:`._web` (:func:`require_web`); importing :mod:`._web`
without the extra raises ``ImportError`` with the same message.
"""

from __future__ import annotations

import importlib.util

from stepmachine import ConfigurationError

__all__ = ["require_web", "web_extra_message"]

_MODULES = ("starlette", "uvicorn")


def web_extra_message(cause: BaseException) -> str:
    """What to say when the live view's extra is missing: install ``stepmachine[web]``."""
    return (
        "the live view (stepmachine serve) needs Starlette and uvicorn: "
        f"install stepmachine[web] (pip install 'stepmachine[web]') ({cause})"
    )


def require_web() -> None:
    """Return if the ``web`` extra is installed.

    Raises:
        ConfigurationError: Starlette or uvicorn is missing; the message says
            to install ``stepmachine[web]``.
    """
    missing = [name for name in _MODULES if importlib.util.find_spec(name) is None]
    if missing:
        cause = ModuleNotFoundError(f"no module named {', '.join(missing)}")
        raise ConfigurationError(web_extra_message(cause))
