"""Load recorded HTTP traffic (cassettes) of every storage format the recordings use.

Four YAML containers occur (``../shared/conformance/WIRE_FORMATS.md`` §0):

* **vcrpy** (Python): ``interactions: [{request: {method, uri, body}, response:
  {status: {code}, headers, body: {string}}}]`` plus ``version: 1``. Bodies are
  strings, or gzip bytes as YAML ``!!binary`` with ``Content-Encoding: gzip``.
* **pydantic-ai's vcrpy variant**: JSON bodies stored as a parsed mapping under
  ``request.parsed_body`` / ``response.parsed_body`` (re-serialised here);
  SSE replies stay in ``body.string``.
* **Ruby VCR** (ruby_llm): ``http_interactions:``; bodies as ``{encoding,
  string}``, non-ASCII ones tagged ``!binary`` (base64 of the raw bytes: a
  Ruby-only tag, for which a constructor is registered on a private
  ``yaml.SafeLoader`` subclass).
* **go-vcr v2** (maruel/genai): ``version: 2``; ``request.url/body``,
  ``response.body`` (a string) and ``response.code`` (an int).

Every interaction becomes an :class:`Interaction`: the method, the URL, the
request body parsed as JSON (``None`` when absent or not JSON), the status,
the response headers as ``(name, value)`` pairs (list values flattened, bare
scalars accepted, ``Content-Length`` / ``Transfer-Encoding`` dropped because
they are often stale), and the response body as bytes. Compressed bodies are
passed through *with* their ``Content-Encoding`` header, so that httpx
decompresses them as it would a real reply; a ``Content-Encoding`` header on a
body that is not actually compressed (a serializer that stored the decoded
body) is dropped instead.

Only ``yaml.SafeLoader`` is used: a cassette is data and never constructs
arbitrary objects.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

__all__ = [
    "CASSETTE_SUFFIXES",
    "CassetteError",
    "Interaction",
    "cassette_files",
    "load_cassette",
]

CASSETTE_SUFFIXES = (".yaml", ".yml")
_DROPPED_HEADERS = frozenset({"content-length", "transfer-encoding"})
_MAGIC = {"gzip": b"\x1f\x8b", "x-gzip": b"\x1f\x8b"}


class CassetteError(ValueError):
    """A file is not a cassette of any known format, or one of its records is malformed."""


@dataclass(frozen=True)
class Interaction:
    """One recorded request and its reply."""

    method: str
    url: str
    request_body: Any  # parsed JSON (usually a dict), or None when absent / not JSON
    status: int
    headers: tuple[tuple[str, str], ...]
    response_body: bytes
    raw_request_body: bytes = b""

    @property
    def path(self) -> str:
        """The URL's path (no query), tolerant of placeholder hosts like ``<OLLAMA_API_BASE>``."""
        return urlsplit(self.url).path if "://" in self.url else self.url.split("?", 1)[0]

    def header(self, name: str) -> str | None:
        """The first value of response header ``name`` (case-insensitive), if any."""
        lowered = name.lower()
        return next((v for k, v in self.headers if k.lower() == lowered), None)

    @property
    def is_sse(self) -> bool:
        """Whether the reply is a server-sent-event stream."""
        return "text/event-stream" in (self.header("content-type") or "")


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """SafeLoader plus Ruby's ``!binary`` tag (base64 of raw bytes).

    libyaml's ``CSafeLoader`` when PyYAML was built with it (its wheels are):
    the same safe constructors, parsed about ten times faster. Many test
    modules load the cassettes while pytest collects them.
    """


def _ruby_binary(loader: yaml.SafeLoader, node: yaml.Node) -> bytes:
    assert isinstance(node, yaml.ScalarNode)
    value = loader.construct_scalar(node)
    return base64.b64decode("".join(str(value).split()))


_Loader.add_constructor("!binary", _ruby_binary)


def cassette_files(folder: Path) -> list[Path]:
    """Every cassette under ``folder`` laid out as ``<provider>/<file>``, sorted."""
    return sorted(
        p
        for p in folder.glob("*/*")
        if p.is_file() and p.suffix in CASSETTE_SUFFIXES and not p.name.startswith(".")
    )


def load_cassette(path: Path) -> list[Interaction]:
    """The interactions of the cassette at ``path``, in recorded order.

    Parsed once per process for each content of the file (a file written again is
    parsed again); each call returns a deep copy, so a test that changes what it
    got changes nothing another test reads.

    Raises:
        CassetteError: the file is not a cassette of a known format.
    """
    path = Path(path)
    text = path.read_bytes()
    return copy.deepcopy(list(_load_cassette(path, text)))


@functools.cache
def _load_cassette(path: Path, text: bytes) -> tuple[Interaction, ...]:
    """Keyed by the file's bytes too: a file written again is parsed again."""
    return tuple(_parse_cassette(path, text))


def _parse_cassette(path: Path, text: bytes) -> list[Interaction]:
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise CassetteError(f"{path}: not YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise CassetteError(f"{path}: expected a mapping at the top, got {type(data).__name__}")
    try:
        if "http_interactions" in data:
            return [_ruby(item) for item in data["http_interactions"]]
        if "interactions" in data:
            if data.get("version") == 2 or any(
                isinstance(i, dict) and "url" in (i.get("request") or {})
                for i in data["interactions"]
            ):
                return [_go(item) for item in data["interactions"]]
            return [_vcrpy(item) for item in data["interactions"]]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CassetteError(f"{path}: malformed record: {type(exc).__name__}: {exc}") from exc
    raise CassetteError(f"{path}: no 'interactions' or 'http_interactions' key")


# -- the formats ------------------------------------------------------------------------


def _vcrpy(item: dict[str, Any]) -> Interaction:
    request, response = item["request"], item["response"]
    if "parsed_body" in request:
        raw_request = _json_bytes(request["parsed_body"])
    else:
        raw_request = _bytes(request.get("body"))
    if "parsed_body" in response:
        body = _json_bytes(response["parsed_body"])
    else:
        body = _bytes((response.get("body") or {}).get("string"))
    return _interaction(
        method=request["method"],
        url=request["uri"],
        raw_request=raw_request,
        status=response["status"]["code"],
        headers=response.get("headers"),
        body=body,
    )


def _ruby(item: dict[str, Any]) -> Interaction:
    request, response = item["request"], item["response"]
    return _interaction(
        method=request["method"],
        url=request["uri"],
        raw_request=_bytes((request.get("body") or {}).get("string")),
        status=response["status"]["code"],
        headers=response.get("headers"),
        body=_bytes((response.get("body") or {}).get("string")),
    )


def _go(item: dict[str, Any]) -> Interaction:
    request, response = item["request"], item["response"]
    status = response.get("code")
    if status is None:  # only the "200 OK" text
        status = str(response["status"]).split()[0]
    return _interaction(
        method=request["method"],
        url=request["url"],
        raw_request=_bytes(request.get("body")),
        status=status,
        headers=response.get("headers"),
        body=_bytes(response.get("body")),
    )


# -- shared pieces ----------------------------------------------------------------------


def _interaction(
    *, method: str, url: str, raw_request: bytes, status: Any, headers: Any, body: bytes
) -> Interaction:
    pairs = list(_header_pairs(headers))
    pairs = _check_encoding(pairs, body)
    return Interaction(
        method=str(method).upper(),
        url=str(url),
        request_body=_parse_json(raw_request),
        status=int(status),
        headers=tuple(pairs),
        response_body=body,
        raw_request_body=raw_request,
    )


def _bytes(value: Any) -> bytes:
    if value is None:
        return b""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    raise TypeError(f"a body must be a string or bytes, got {type(value).__name__}")


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8")


def _parse_json(raw: bytes) -> Any:
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _header_pairs(headers: Any) -> Iterator[tuple[str, str]]:
    if not headers:
        return
    if not isinstance(headers, dict):
        raise TypeError(f"headers must be a mapping, got {type(headers).__name__}")
    for name, value in headers.items():
        if str(name).lower() in _DROPPED_HEADERS:
            continue
        values = value if isinstance(value, list) else [value]
        for one in values:
            if one is None:
                continue
            yield str(name), one.decode("latin-1") if isinstance(one, bytes) else str(one)


def _check_encoding(pairs: list[tuple[str, str]], body: bytes) -> list[tuple[str, str]]:
    """Keep ``Content-Encoding`` only when the body really is compressed that way."""
    kept = []
    for name, value in pairs:
        if name.lower() == "content-encoding":
            magic = _MAGIC.get(value.strip().lower())
            if magic is not None and not body.startswith(magic):
                continue  # the serializer stored the decoded body: serve it as is
            if value.strip().lower() == "identity":
                continue
        kept.append((name, value))
    return kept


if __name__ == "__main__":  # a quick look: python tests/harness/cassettes.py FILE...
    import sys

    for arg in sys.argv[1:]:
        for n, i in enumerate(load_cassette(Path(arg))):
            print(n, i.method, i.url, i.status, len(i.response_body), i.is_sse)
