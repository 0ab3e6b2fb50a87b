"""Whether the live view's extra (``web``: Starlette and uvicorn) is installed.

Importable without the extra, so a command line can say what to install
before it imports :mod:`._web`.
"""

from __future__ import annotations

import importlib.util

from stepmachine import ConfigurationError

__all__ = ["missing_web_extra", "require_web"]

_MODULES = ("starlette", "uvicorn")


def missing_web_extra(cause: BaseException | None = None) -> ConfigurationError:
    """The error saying the live view needs ``pip install 'stepmachine[web]'``."""
    detail = f" ({cause})" if cause is not None else ""
    return ConfigurationError(
        "the live view (stepmachine serve) needs Starlette and uvicorn: "
        f"install stepmachine[web] (pip install 'stepmachine[web]'){detail}"
    )


def require_web() -> None:
    """Return if the ``web`` extra is installed.

    Raises:
        ConfigurationError: Starlette or uvicorn is missing; the message says
            to install ``stepmachine[web]``.
    """
    missing = [name for name in _MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise missing_web_extra(ModuleNotFoundError(f"no module named {', '.join(missing)}"))
