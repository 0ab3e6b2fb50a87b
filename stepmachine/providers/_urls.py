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
  is the key), the Basic header's value and the values of the query -- which
  the adapter removes from every error and its cause chain.

Every query value is a secret, whatever its name: a key hides under names no
pattern knows (Azure Functions' ``?code=``). A value under a name that says
credential (``key``, ``api-key``, ``token``, ``sig``, ``code``, ...) is one at any
length; any other value from :data:`MIN_SECRET` characters on -- a key worth
the name is longer, while shorter values (``api-version=2024-10``, ``alt=sse``,
a flag) are not keys, and removing them from every error would hide what
makes the error readable. Each secret value is registered in every spelling
it may take: decoded, as written in the base URL, percent-encoded (``quote``
and ``quote_plus``) and as httpx writes it in a request URL (an Azure SAS
``sig=AbC%2BdEf...`` is ``AbC+dEf...`` decoded).

A key in the query has to leave the process in the query (no header is
equivalent for every server), so httpx's own INFO line
(``HTTP Request: POST <url> ...``) would show it. :func:`hide_in_httpx_log`
adds, once, a filter to the ``httpx`` logger that shows each parameter of a
base URL's query as ``name=***`` in each record -- the parameter exactly as
httpx writes it, after ``?`` or ``&`` -- and replaces a registered query
secret by ``***`` wherever else it shows. Only records holding one are
touched (and nothing is configured until a model with a query in its base
URL is made); another client's request with the very same parameter is
shown the same way.
:func:`redact_url` is what a ``repr`` or an error shows of a URL.
"""

from __future__ import annotations

import base64
import logging
import re
import threading
from dataclasses import dataclass
from urllib.parse import quote, quote_plus, unquote_plus

import httpx

from .._errors import ConfigurationError

__all__ = ["MIN_SECRET", "BaseURL", "hide_in_httpx_log", "parse_base_url", "redact_url"]

_CREDENTIAL_PARAM = re.compile(
    r"auth|key|token|secret|password|passwd|signature|^sig$|credential|^code$", re.IGNORECASE
)
MIN_SECRET = 16
"""The length from which a query value under any name is a secret (see the module docs)."""


@dataclass(frozen=True, slots=True)
class BaseURL:
    """A base URL split into what is sent and what is secret (see the module docs)."""

    root: str
    query: tuple[tuple[str, str], ...]
    basic: str | None
    secrets: tuple[str, ...]
    query_secrets: tuple[str, ...] = ()
    """The query's secret values, in every spelling (also in :attr:`secrets`)."""

    def target(self, url: str) -> httpx.URL:
        """``url`` (the root plus an endpoint path) with the base URL's query added."""
        target = httpx.URL(url)
        return target.copy_merge_params(list(self.query)) if self.query else target

    def params(self) -> tuple[str, ...]:
        """Each ``name=value`` of the query as httpx writes it in a request URL."""
        return _written(self.query)


def _written(query: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    if not query:
        return ()
    written = httpx.URL("http://h/").copy_merge_params(list(query)).query.decode("ascii")
    return tuple(written.split("&"))


def _spellings(url: str, query: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    """The secret values of ``query`` (parsed from ``url``), in every spelling."""
    raw_query = url.partition("?")[2].partition("#")[0]
    raw: dict[str, set[str]] = {}  # decoded value -> its spellings in ``url``
    for piece in raw_query.split("&"):
        value = piece.partition("=")[2]
        raw.setdefault(unquote_plus(value), set()).add(value)
    found: set[str] = set()
    for name, value in query:
        if not value or (len(value) < MIN_SECRET and not _CREDENTIAL_PARAM.search(name)):
            continue
        found.update({value, quote(value), quote(value, safe=""), quote_plus(value)})
        found.update(raw.get(value, ()))
        found.update(written.partition("=")[2] for written in _written(((name, value),)))
    return tuple(sorted(s for s in found if s))


def redact_url(url: str) -> str:
    """``url`` for a repr or an error: scheme, host, port and path only.

    No user or password, no query (a query is shown as ``?...``), no fragment.
    A string that is not a URL with a scheme and a host (``user:KEY@host/v1``,
    ``https//user:KEY@host/v1``: the scheme forgotten or misspelt) cannot be
    split reliably, so it is redacted conservatively: everything before its
    last ``@`` is shown as ``***`` (only a leading scheme-like word, e.g.
    ``https//``, is kept, so the mistake stays visible), and the query and
    fragment are cut.
    """
    try:
        parsed = httpx.URL(url)
        well_formed = bool(parsed.scheme and parsed.host)
        shown = parsed.copy_with(userinfo=b"", query=None, fragment=None)
    except (httpx.InvalidURL, TypeError, ValueError):
        if not isinstance(url, str):
            return "<invalid URL>"
        well_formed = False
    if not well_formed:
        return _redact_unparsed(url)
    return str(shown) + ("?..." if parsed.query else "")


_SCHEME_LIKE = re.compile(r"[A-Za-z]{2,8}:?/{1,3}(?=[^/])")
"""A scheme, perhaps misspelt (``https//``, ``http:/``): letters, then slashes."""


def _redact_unparsed(url: str) -> str:
    """``url``, not a URL httpx can split, without anything that may be a credential."""
    text, question, _ = url.partition("#")[0].partition("?")
    prefix = ""
    if (scheme := _SCHEME_LIKE.match(text)) is not None:
        prefix, text = scheme.group(), text[scheme.end() :]
    if "@" in text:
        text = "***@" + text.rpartition("@")[2]
    return prefix + text + ("?..." if question else "")


def parse_base_url(url: str) -> BaseURL:
    """Split ``url`` (see the module docs).

    Raises:
        ConfigurationError: ``url`` is not a valid absolute http(s) URL; the
            message says what is wrong and shows it without its credentials
            (see :func:`redact_url`), also when the scheme is missing or misspelt.
    """
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError):
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        scheme = parsed.scheme if parsed is not None and "://" in url else ""
        problem = (
            f"its scheme is {scheme!r}"
            if scheme and scheme not in ("http", "https")
            else "it has no host"
            if scheme
            else "it does not start with 'http://' or 'https://'"
        )
        shown = redact_url(url)
        note = " (credentials and query hidden)" if shown != url else ""
        raise ConfigurationError(
            f"base_url must be an absolute http:// or https:// URL, got {shown!r}{note}: "
            f"{problem}; pass the API root, "
            "e.g. 'https://api.openai.com/v1' or 'http://localhost:8000/v1'"
        )
    secrets: list[str] = []
    basic = None
    user, password = parsed.username, parsed.password
    if user or password:
        token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        basic = f"Basic {token}"
        secrets.extend([token, password or user])
    query = tuple(parsed.params.multi_items())
    hidden = _spellings(url, query)
    secrets.extend(hidden)
    root = str(parsed.copy_with(userinfo=b"", query=None, fragment=None)).rstrip("/")
    return BaseURL(
        root=root,
        query=query,
        basic=basic,
        secrets=tuple(s for s in secrets if s),
        query_secrets=hidden,
    )


class _HideSecrets(logging.Filter):
    """Shows registered query parameters as ``name=***`` and registered secrets as
    ``***`` in the records of the logger it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()
        self.params: set[str] = set()
        self._pattern: re.Pattern[str] | None = None

    def update(self, secrets: tuple[str, ...], params: tuple[str, ...]) -> None:
        """Register more; call under the module's lock."""
        self.secrets.update(s for s in secrets if s)
        self.params.update(p for p in params if p)
        if self.params:
            pieces = "|".join(re.escape(p) for p in sorted(self.params, key=len, reverse=True))
            self._pattern = re.compile(rf"(?<=[?&])(?:{pieces})(?=[&#\s\"'>]|$)")

    def filter(self, record: logging.LogRecord) -> bool:
        pattern, secrets = self._pattern, self.secrets
        if pattern is None and not secrets:
            return True
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot format is left to logging
            return True
        shown = message
        if pattern is not None:
            shown = pattern.sub(lambda m: m.group().partition("=")[0] + "=***", shown)
        if any(secret in shown for secret in secrets):
            for secret in sorted(secrets, key=len, reverse=True):
                shown = shown.replace(secret, "***")
        if shown != message:
            record.msg, record.args = shown, None
        return True


_filter = _HideSecrets()
_lock = threading.Lock()


def hide_in_httpx_log(secrets: tuple[str, ...], params: tuple[str, ...] = ()) -> None:
    """Keep ``secrets`` and the values of ``params`` (``name=value`` as httpx writes
    them, see :meth:`BaseURL.params`) out of the records of the ``httpx`` logger,
    from now on: a parameter shows as ``name=***``, a secret as ``***``.

    The filter is added to that logger the first time; nothing else about
    logging is changed.
    """
    if not secrets and not params:
        return
    with _lock:
        logger = logging.getLogger("httpx")
        if _filter not in logger.filters:
            logger.addFilter(_filter)
        _filter.update(secrets, params)
