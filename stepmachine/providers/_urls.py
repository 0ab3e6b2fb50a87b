"""Base URLs that carry credentials: what is sent, and what is shown.

A gateway or proxy is often given as a URL with a key in it:
``http://user:KEY@host/v1`` (userinfo) or ``https://host/v1?api-key=KEY``
(a query). :func:`parse_base_url` splits such a URL once, when the adapter is
made, into what every request needs:

* the *root* -- scheme, host, port and path, without userinfo, query or
  fragment: the adapter's ``base_url``, to which it appends its endpoint path;
* the userinfo as an HTTP Basic ``Authorization`` header -- what httpx itself
  would send for a URL with userinfo (it replaces a bearer key in the same
  header, as it did before), but sent as a header, so that the URL httpx logs
  and puts in its errors has no userinfo;
* the query, put back on every request *after* the endpoint path (a query in
  the base URL used to end up in front of it);
* the secrets among them -- the password (or a user without a password: that
  is the key), the Basic header's value and the values of query parameters
  whose name says credential (``key``, ``api-key``, ``token``, ``sig``, ...) --
  which the adapter removes from every error and its cause chain.

A key in the query has to leave the process in the query (no header is
equivalent for every server), so httpx's own INFO line
(``HTTP Request: POST <url> ...``) would show it. :func:`hide_in_httpx_log`
adds, once, a filter to the ``httpx`` logger that replaces such a registered
value by ``***`` in each record -- only records holding one are touched (and
nothing is configured until a model with a key in its query is made).
:func:`redact_url` is what a ``repr`` or an error shows of a URL.
"""

from __future__ import annotations

import base64
import logging
import re
import threading
from dataclasses import dataclass

import httpx

from .._errors import ConfigurationError

__all__ = ["BaseURL", "hide_in_httpx_log", "parse_base_url", "redact_url"]

_CREDENTIAL_PARAM = re.compile(
    r"auth|key|token|secret|password|passwd|signature|^sig$|credential", re.IGNORECASE
)


@dataclass(frozen=True, slots=True)
class BaseURL:
    """A base URL split into what is sent and what is secret (see the module docs)."""

    root: str
    query: tuple[tuple[str, str], ...]
    basic: str | None
    secrets: tuple[str, ...]

    def target(self, url: str) -> httpx.URL:
        """``url`` (the root plus an endpoint path) with the base URL's query added."""
        target = httpx.URL(url)
        return target.copy_merge_params(list(self.query)) if self.query else target


def redact_url(url: str) -> str:
    """``url`` for a repr or an error: scheme, host, port and path only.

    No user or password, no query (a query is shown as ``?...``), no fragment.
    """
    try:
        parsed = httpx.URL(url)
        shown = parsed.copy_with(userinfo=b"", query=None, fragment=None)
    except (httpx.InvalidURL, TypeError, ValueError):
        return "<invalid URL>"
    return str(shown) + ("?..." if parsed.query else "")


def parse_base_url(url: str) -> BaseURL:
    """Split ``url`` (see the module docs).

    Raises:
        ConfigurationError: ``url`` is not a valid absolute http(s) URL; the
            message shows it without its credentials.
    """
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError):
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigurationError(
            f"base_url must be an absolute http:// or https:// URL, got {redact_url(url)!r}: "
            "pass the API root, e.g. 'https://api.openai.com/v1'"
        )
    secrets: list[str] = []
    basic = None
    user, password = parsed.username, parsed.password
    if user or password:
        token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        basic = f"Basic {token}"
        secrets.extend([token, password or user])
    query = tuple(parsed.params.multi_items())
    secrets.extend(value for name, value in query if _CREDENTIAL_PARAM.search(name) and value)
    root = str(parsed.copy_with(userinfo=b"", query=None, fragment=None)).rstrip("/")
    return BaseURL(root=root, query=query, basic=basic, secrets=tuple(s for s in secrets if s))


class _HideSecrets(logging.Filter):
    """Replaces registered secrets by ``***`` in the records of the logger it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = self.secrets
        if not secrets:
            return True
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot format is left to logging
            return True
        if any(secret in message for secret in secrets):
            for secret in sorted(secrets, key=len, reverse=True):
                message = message.replace(secret, "***")
            record.msg, record.args = message, None
        return True


_filter = _HideSecrets()
_lock = threading.Lock()


def hide_in_httpx_log(secrets: tuple[str, ...]) -> None:
    """Keep ``secrets`` out of the records of the ``httpx`` logger, from now on.

    The filter is added to that logger the first time; nothing else about
    logging is changed.
    """
    if not secrets:
        return
    with _lock:
        logger = logging.getLogger("httpx")
        if _filter not in logger.filters:
            logger.addFilter(_filter)
        _filter.secrets.update(secrets)
