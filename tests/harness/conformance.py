"""Replay recorded provider traffic through the adapters and check what they make of it.

Usage::

    python tests/harness/conformance.py [FOLDER]

``FOLDER`` (default: ``../shared/conformance/cassettes`` beside the checkout)
holds cassettes laid out as ``<provider>/<file>.yaml``. The provider folder
name picks the spec (``SPECS`` of the ``spec_*.py`` modules beside this file;
the contract is ``_spec.py``). Nothing here knows any particular file: what to
send and what to expect is derived from each recording, through its spec.

For every cassette (:func:`run_file`):

1. the interactions are loaded (:mod:`cassettes`, all four storage formats);
2. interactions that are not model calls (another method or a path that does
   not end with the spec's ``path_suffix``, e.g. a client's ``GET /models``
   before its first call) are skipped, each with a note, and counted in
   ``skipped=``; a file with no model call fails. A recorded request holding a
   part the adapter cannot send (a file named by an upload id: ``decode_request``
   raises ``UnsupportedPartError``) fails the file, naming the part: nothing is
   dropped silently. The model calls are grouped into *logical calls*: an
   interaction whose request body repeats the previous one after a retryable
   error (the spec expects an error whose class is ``retryable``) is a retry
   of the same call;
3. per call, ``spec.decode_request`` gives the neutral request and whether the
   recording streamed (for a provider that says so in the URL, as Gemini's
   ``:streamGenerateContent``, ``spec.streamed_in_url``); the adapter comes from
   ``spec.make_model(client, body["model"])``, or ``spec.model_for(client,
   interaction)`` for a provider whose URL names the model (Gemini, Vertex AI);
   a call whose recording ends in a retryable error gets
   ``request.max_attempts`` = the number of recorded attempts (the client that
   recorded it gave up there); the adapter from ``spec.make_model`` sends it
   through an ``httpx.MockTransport`` that serves the recorded replies in
   order, matching method and path suffix, with a no-op ``sleep`` injected so
   backoff costs nothing;
4. checks: exactly one request per recorded interaction (retries included);
   every sent body matches the recorded one (``spec.request_differences``), and
   the URL and headers pass ``spec.check_request`` when the spec has one;
   the result matches ``spec.expect`` (text, tool calls with parsed
   arguments, reasoning, input/output/reasoning tokens, finish reason, attempts -- or
   the exact typed error class, its status and attempts);
5. parity (invariant 9) for every successful call:

   * streamed recordings: the chunks handed to ``on_chunk`` agree with the
     assembled response (TextChunk texts concatenated == the text parts,
     ReasoningChunk texts == the reasoning parts, ToolCallChunk argument deltas
     per index == the call's ``raw_arguments``, or the same JSON value when the
     adapter re-encodes arguments it received as an object; names and ids on
     chunks == the call's), and replaying the same SSE bytes cut into small
     random pieces gives an identical response;
   * blocking recordings: asking for a stream from a server that ignores it
     (the recorded JSON reply served to a streaming request) gives an
     identical response, and its chunks agree with it as above.

Prints one line per file, ``PASS|FAIL <provider>/<file> interactions=<n>
<details>`` (``--verbose`` adds the notes in which each spec says what it
skipped), and last ``cassettes=<n> passed=<n>``; exits 1 unless every cassette
passed (or when the folder is missing or empty). ``--backend trio`` runs it on
trio.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import random
import sys
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import httpx
import msgspec

from stepmachine import ModelRequest, ModelResponse, ReasoningPart, TextPart, ToolCallPart
from stepmachine.extend import ReasoningChunk, StreamChunk, TextChunk, ToolCallChunk
from stepmachine.providers import ProviderError

HERE = Path(__file__).resolve().parent
DEFAULT_FOLDER = Path(__file__).resolve().parents[3] / "shared/conformance/cassettes"
CALL_TIMEOUT = 60.0  # seconds per logical call: a hung adapter fails, it never stalls the run

if str(HERE) not in sys.path:  # the spec modules import their siblings (``_spec``) by name
    sys.path.insert(0, str(HERE))

import cassettes  # noqa: E402 - needs the line above when this module is imported, not run
from _spec import UnsupportedPartError  # noqa: E402 - the same

Interaction = cassettes.Interaction

__all__ = ["DEFAULT_FOLDER", "Result", "Specs", "load_specs", "main", "run_file", "run_folder"]


# -- specs ------------------------------------------------------------------------------


@dataclass
class Specs:
    """The provider specs found beside this file, and the modules that failed to import."""

    by_folder: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def get(self, folder: str) -> Any:
        """The spec for a provider folder, or ``None``."""
        return self.by_folder.get(folder)


def load_specs(where: Path = HERE) -> Specs:
    """Import every ``spec_*.py`` in ``where`` and merge their ``SPECS``; never raises."""
    specs = Specs()
    for path in sorted(where.glob("spec_*.py")):
        try:
            module = importlib.import_module(path.stem) if where == HERE else _load_path(path)
            found = module.SPECS
        except Exception as exc:
            specs.errors[path.stem] = _one_line(exc)
            continue
        for folder, spec in found.items():
            specs.by_folder[folder] = spec
    return specs


def _load_path(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- results ----------------------------------------------------------------------------


@dataclass
class Result:
    """The outcome of one cassette."""

    provider: str
    name: str
    interactions: int = 0
    calls: int = 0
    streamed: int = 0
    retries: int = 0
    skipped: int = 0  # interactions that are not model calls
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when every check of every interaction passed."""
        return not self.failures

    @property
    def file(self) -> str:
        """``<provider>/<file>``."""
        return f"{self.provider}/{self.name}"

    def line(self) -> str:
        """The one-line report."""
        head = f"{'PASS' if self.passed else 'FAIL'} {self.file} interactions={self.interactions}"
        if self.failures:
            return f"{head} " + " | ".join(self.failures)
        tail = f"calls={self.calls} streamed={self.streamed} retries={self.retries}"
        if self.skipped:
            tail += f" skipped={self.skipped}"
        if self.notes:
            tail += f" notes={len(self.notes)}"
        return f"{head} {tail}"


# -- running ----------------------------------------------------------------------------


async def run_folder(folder: Path, specs: Specs | None = None) -> list[Result]:
    """Run every cassette under ``folder`` (``<provider>/<file>``), in sorted order."""
    specs = specs or load_specs()
    return [await run_file(path, specs) for path in cassettes.cassette_files(folder)]


async def run_file(path: Path, specs: Specs | None = None, *, parity: bool = True) -> Result:
    """Run one cassette; every problem becomes a failure in the result, nothing raises."""
    specs = specs or load_specs()
    provider = path.parent.name
    result = Result(provider=provider, name=path.name)
    try:
        interactions = cassettes.load_cassette(path)
    except Exception as exc:
        result.failures.append(f"cannot load: {_one_line(exc)}")
        return result
    result.interactions = len(interactions)
    spec = specs.get(provider)
    if spec is None:
        errors = "; ".join(f"{k}: {v}" for k, v in specs.errors.items())
        result.failures.append(
            f"no spec for provider folder {provider!r}"
            + (f" (spec modules that failed to import: {errors})" if errors else "")
        )
        return result
    if not interactions:
        result.failures.append("no interactions recorded")
        return result
    calls: list[tuple[int, Any]] = []
    for index, interaction in enumerate(interactions):
        if interaction.method == "POST" and interaction.path.endswith(spec.path_suffix):
            calls.append((index, interaction))
        else:
            result.skipped += 1
            result.notes.append(
                f"interaction {index}: {interaction.method} {interaction.path} is not a model "
                f"call (path suffix {spec.path_suffix!r}): skipped"
            )
    if not calls:
        result.failures.append(f"no model call (POST ...{spec.path_suffix}) recorded")
        return result
    for index, interaction in calls:
        if isinstance(interaction.request_body, dict):
            try:
                spec.decode_request(interaction.request_body)
            except UnsupportedPartError as exc:
                result.failures.append(
                    f"interaction {index}: the request holds a part the adapter cannot send: {exc}"
                )
    if result.failures:
        return result
    try:
        groups = _logical_calls(calls, spec)
    except Exception as exc:
        result.failures.append(f"spec.expect failed: {_one_line(exc)}")
        return result
    for number, group in enumerate(groups):
        where = f"call {number}" + (
            f" (interactions {group[0][0]}..{group[-1][0]})" if len(group) > 1 else ""
        )
        try:
            with anyio.fail_after(CALL_TIMEOUT):
                problems, streamed = await _check_call(
                    spec, [i for _, i in group], result.notes, parity=parity
                )
        except Exception as exc:
            problems, streamed = [f"harness error: {_traceback_tail(exc)}"], False
        result.calls += 1
        result.streamed += streamed
        result.retries += len(group) - 1
        result.failures.extend(f"{where}: {p}" for p in problems)
    return result


def _logical_calls(
    interactions: Sequence[tuple[int, Any]], spec: Any
) -> list[list[tuple[int, Any]]]:
    """Group (index, interaction) pairs: a repeat of the same body after a retryable error
    is a retry."""
    groups: list[list[tuple[int, Any]]] = []
    for index, interaction in interactions:
        if groups:
            _, previous = groups[-1][-1]
            if (
                previous.request_body is not None
                and interaction.request_body == previous.request_body
                and _retryable(spec, previous)
            ):
                groups[-1].append((index, interaction))
                continue
        groups.append([(index, interaction)])
    return groups


def decode_call(spec: Any, interaction: Any) -> tuple[ModelRequest, bool]:
    """The neutral request of a recorded call and whether it streamed: from the body, or
    from the URL for specs that say so (``streamed_in_url``)."""
    request, streamed = spec.decode_request(interaction.request_body)
    if getattr(spec, "streamed_in_url", None) is not None:
        streamed = spec.streamed_in_url(interaction.url)
    return request, streamed


def _retryable(spec: Any, interaction: Any) -> bool:
    if interaction.status < 400:
        return False
    _, streamed = decode_call(spec, interaction)
    body, headers = _served_body(interaction)
    error = spec.expect(interaction.status, body, headers, streamed).error
    return error is not None and bool(error.retryable)


def _served_body(interaction: Any) -> tuple[bytes, httpx.Headers]:
    """The reply as a client sees it: decompressed, without ``Content-Encoding``."""
    reply = httpx.Response(
        interaction.status, headers=list(interaction.headers), content=interaction.response_body
    )
    headers = httpx.Headers(
        [(k, v) for k, v in interaction.headers if k.lower() != "content-encoding"]
    )
    return reply.content, headers


class _Replay:
    """The MockTransport handler: serves one logical call's recorded replies in order."""

    def __init__(
        self,
        spec: Any,
        group: Sequence[Any],
        chunker: Callable[[bytes], list[bytes]] | None = None,
    ) -> None:
        self.spec = spec
        self.group = group
        self.chunker = chunker
        self.sent: list[Any] = []
        self.problems: list[str] = []
        self.count = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        index = self.count
        self.count += 1
        if index >= len(self.group):
            self.problems.append(
                f"request {index + 1} was sent, but only {len(self.group)} recorded"
            )
            return httpx.Response(
                418, json={"error": {"message": "conformance harness: nothing more recorded"}}
            )
        recorded = self.group[index]
        if request.method != recorded.method:
            self.problems.append(
                f"request {index}: method {request.method} != recorded {recorded.method}"
            )
        if not request.url.path.endswith(self.spec.path_suffix):
            self.problems.append(
                f"request {index}: path {request.url.path!r} does not end with "
                f"{self.spec.path_suffix!r}"
            )
        check = getattr(self.spec, "check_request", None)
        if check is not None:
            self.problems.extend(f"request {index}: {p}" for p in check(request, recorded))
        try:
            self.sent.append(json.loads(request.content))
        except ValueError:
            self.problems.append(f"request {index}: the body sent is not JSON")
            self.sent.append(None)
        headers = list(recorded.headers)
        if self.chunker is None:
            return httpx.Response(recorded.status, headers=headers, content=recorded.response_body)
        return httpx.Response(
            recorded.status, headers=headers, stream=_Pieces(self.chunker(recorded.response_body))
        )


class _Pieces(httpx.AsyncByteStream):
    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            yield piece


@dataclass
class _Outcome:
    response: ModelResponse | None
    error: BaseException | None
    chunks: list[StreamChunk]
    replay: _Replay
    sleeps: list[float]


async def _drive(
    spec: Any,
    group: Sequence[Any],
    request: ModelRequest,
    *,
    stream: bool,
    chunker: Callable[[bytes], list[bytes]] | None = None,
) -> _Outcome:
    replay = _Replay(spec, group, chunker)
    chunks: list[StreamChunk] = []
    sleeps: list[float] = []

    async def collect(chunk: StreamChunk) -> None:
        chunks.append(chunk)

    async def no_sleep(seconds: float) -> None:
        sleeps.append(seconds)

    model_name = str((group[0].request_body or {}).get("model") or "")
    async with httpx.AsyncClient(transport=httpx.MockTransport(replay)) as client:
        if getattr(spec, "model_for", None) is not None:
            model = spec.model_for(client, group[0])
        else:
            model = spec.make_model(client, model_name)
        model._sleep = no_sleep
        if len(group) > 1 and model.retry.max_attempts < len(group):
            # The recording shows the client retrying: the adapter must be allowed to as well
            # (``request.max_attempts`` still caps it at the recorded number).
            model.retry = dataclasses.replace(model.retry, max_attempts=len(group))
        response: ModelResponse | None = None
        error: BaseException | None = None
        try:
            response = await model.request(request, on_chunk=collect if stream else None)
        except Exception as exc:
            error = exc
    return _Outcome(response, error, chunks, replay, sleeps)


async def _check_call(
    spec: Any, group: Sequence[Any], notes: list[str], *, parity: bool
) -> tuple[list[str], bool]:
    """Problems of one logical call (empty: it passed), and whether it streamed."""
    problems: list[str] = []
    first, last = group[0], group[-1]
    problems.extend(
        f"recorded path {i.path!r} does not end with {spec.path_suffix!r}"
        for i in group
        if not i.path.endswith(spec.path_suffix)
    )
    if not isinstance(first.request_body, dict):
        return [*problems, "the recorded request body is not a JSON object"], False
    request, streamed = decode_call(spec, first)
    if last.is_sse and not streamed:
        problems.append(
            "the recording streamed (text/event-stream) but decode_request says stream=False"
        )
    body, headers = _served_body(last)
    expected = spec.expect(last.status, body, headers, streamed)
    notes.extend(expected.notes)
    if expected.error is not None and expected.error.retryable:
        # The recording client gave up after these attempts: give the adapter the same budget.
        request = msgspec.structs.replace(request, max_attempts=len(group))

    outcome = await _drive(spec, group, request, stream=streamed)
    problems.extend(outcome.replay.problems)
    if outcome.replay.count < len(group):
        problems.append(f"sent {outcome.replay.count} request(s) for {len(group)} recorded")
    for index, (sent, recorded) in enumerate(zip(outcome.replay.sent, group, strict=False)):
        if sent is None:
            continue
        problems.extend(
            f"request {index}: {difference}"
            for difference in spec.request_differences(sent, recorded.request_body)
        )
        if index and sent != outcome.replay.sent[0]:
            problems.append(
                f"request {index}: a retry sent a different body than the first attempt"
            )
    problems.extend(_compare(expected, outcome, attempts=len(group), status=last.status))
    if parity and outcome.response is not None and not problems:
        problems.extend(await _parity(spec, group, request, streamed, outcome))
    return problems, streamed


def _compare(expected: Any, outcome: _Outcome, *, attempts: int, status: int) -> list[str]:
    problems: list[str] = []
    if expected.error is not None:
        error = outcome.error
        if error is None:
            return [f"expected {expected.error.__name__}, got a response"]
        if type(error) is not expected.error:
            got = f"{type(error).__name__}: {_one_line(error)}"
            return [f"expected {expected.error.__name__}, got {got}"]
        assert isinstance(error, ProviderError)
        if error.attempts != attempts:
            problems.append(f"error.attempts={error.attempts}, expected {attempts}")
        if status >= 400 and error.status != status:
            problems.append(f"error.status={error.status}, recorded {status}")
        return problems
    if outcome.error is not None:
        return [f"expected a response, got {_traceback_tail(outcome.error)}"]
    response = outcome.response
    assert response is not None
    text = "".join(p.text for p in response.parts if isinstance(p, TextPart))
    if text != expected.text:
        problems.append(f"text {_short(text)} != expected {_short(expected.text)}")
    calls = [p for p in response.parts if isinstance(p, ToolCallPart)]
    if len(calls) != len(expected.tool_calls):
        problems.append(
            f"{len(calls)} tool call(s) {[c.name for c in calls]}, expected "
            f"{len(expected.tool_calls)} {[c.name for c in expected.tool_calls]}"
        )
    else:
        for n, (call, want) in enumerate(zip(calls, expected.tool_calls, strict=True)):
            if call.name != want.name:
                problems.append(f"tool call {n}: name {call.name!r} != {want.name!r}")
            if call.arguments != want.arguments:
                problems.append(
                    f"tool call {n}: arguments {_short(call.arguments)} != {_short(want.arguments)}"
                )
            if want.call_id is not None and call.call_id != want.call_id:
                problems.append(f"tool call {n}: id {call.call_id!r} != {want.call_id!r}")
    has_reasoning = any(isinstance(p, ReasoningPart) for p in response.parts)
    if expected.reasoning is not None and has_reasoning != expected.reasoning:
        problems.append(f"reasoning present={has_reasoning}, expected {expected.reasoning}")
    if expected.input_tokens is not None and response.usage.input_tokens != expected.input_tokens:
        problems.append(f"input_tokens {response.usage.input_tokens} != {expected.input_tokens}")
    if (
        expected.output_tokens is not None
        and response.usage.output_tokens != expected.output_tokens
    ):
        problems.append(f"output_tokens {response.usage.output_tokens} != {expected.output_tokens}")
    if (
        expected.reasoning_tokens is not None
        and response.usage.reasoning_tokens != expected.reasoning_tokens
    ):
        problems.append(
            f"reasoning_tokens {response.usage.reasoning_tokens} != {expected.reasoning_tokens}"
        )
    if expected.finish_reason is not None and response.finish_reason != expected.finish_reason:
        problems.append(f"finish_reason {response.finish_reason!r} != {expected.finish_reason!r}")
    if response.attempts != attempts:
        problems.append(f"response.attempts={response.attempts}, expected {attempts}")
    return problems


# -- parity (invariant 9) ---------------------------------------------------------------


def chunk_problems(response: ModelResponse, chunks: Sequence[StreamChunk]) -> list[str]:
    """Disagreements between the chunks handed to ``on_chunk`` and the assembled response.

    * TextChunk texts concatenated == the text parts concatenated;
    * ReasoningChunk texts concatenated == the reasoning parts' texts concatenated;
    * ToolCallChunks grouped by ``index`` (in index order) line up one to one with
      the tool-call parts: the argument deltas concatenated equal the call's
      ``raw_arguments`` -- or parse to the same JSON value, for adapters that
      re-encode arguments the provider sends as an object (Anthropic) so that
      streamed and blocking replies keep the same raw string -- and every name
      and call id given on a chunk is the call's.
    """
    problems: list[str] = []
    text = "".join(c.text for c in chunks if isinstance(c, TextChunk))
    want_text = "".join(p.text for p in response.parts if isinstance(p, TextPart))
    if text != want_text:
        problems.append(f"text chunks {_short(text)} != text parts {_short(want_text)}")
    reasoning = "".join(c.text for c in chunks if isinstance(c, ReasoningChunk))
    want_reasoning = "".join(p.text for p in response.parts if isinstance(p, ReasoningPart))
    if reasoning != want_reasoning:
        problems.append(
            f"reasoning chunks {_short(reasoning)} != reasoning parts {_short(want_reasoning)}"
        )
    by_index: dict[int, list[ToolCallChunk]] = {}
    for chunk in chunks:
        if isinstance(chunk, ToolCallChunk):
            by_index.setdefault(chunk.index, []).append(chunk)
    calls = [p for p in response.parts if isinstance(p, ToolCallPart)]
    if len(by_index) != len(calls):
        problems.append(f"tool-call chunks for {len(by_index)} index(es), {len(calls)} call(s)")
        return problems
    for (index, pieces), call in zip(sorted(by_index.items()), calls, strict=True):
        raw = "".join(c.arguments_delta for c in pieces)
        if raw != call.raw_arguments and not _same_json(raw, call.raw_arguments):
            problems.append(
                f"tool-call chunks {index}: arguments {_short(raw)} "
                f"!= raw {_short(call.raw_arguments)}"
            )
        names = {c.name for c in pieces if c.name is not None}
        if names - {call.name}:
            problems.append(f"tool-call chunks {index}: names {sorted(names)} != {call.name!r}")
        ids = {c.call_id for c in pieces if c.call_id is not None}
        if ids - {call.call_id}:
            problems.append(f"tool-call chunks {index}: ids {sorted(ids)} != {call.call_id!r}")
    return problems


def split_randomly(seed: int, most: int = 7) -> Callable[[bytes], list[bytes]]:
    """A chunker cutting a body into pieces of 1..``most`` bytes (cuts inside UTF-8 and lines)."""

    def cut(body: bytes) -> list[bytes]:
        rng = random.Random(seed)
        pieces, at = [], 0
        while at < len(body):
            step = rng.randint(1, most)
            pieces.append(body[at : at + step])
            at += step
        return pieces

    return cut


async def _parity(
    spec: Any, group: Sequence[Any], request: ModelRequest, streamed: bool, outcome: _Outcome
) -> list[str]:
    response = outcome.response
    assert response is not None
    if streamed:
        problems = [f"parity: {p}" for p in chunk_problems(response, outcome.chunks)]
        again = await _drive(spec, group, request, stream=True, chunker=split_randomly(len(group)))
        if again.error is not None:
            problems.append(
                f"parity: the stream cut into small pieces failed: {_one_line(again.error)}"
            )
        elif again.response != response:
            problems.append(
                f"parity: the stream cut into small pieces gave a different response: "
                f"{_short(again.response)} != {_short(response)}"
            )
        return problems
    if group[-1].status >= 400 or group[-1].is_sse:
        return []
    # A server that ignores ``stream``: the JSON reply served to a streaming request.
    again = await _drive(spec, group, request, stream=True)
    if again.error is not None:
        return [f"parity: a streaming request answered with JSON failed: {_one_line(again.error)}"]
    problems = []
    if again.response != response:
        problems.append(
            f"parity: a streaming request answered with JSON gave {_short(again.response)} "
            f"!= blocking {_short(response)}"
        )
    problems.extend(
        f"parity (JSON served to a stream): {p}" for p in chunk_problems(response, again.chunks)
    )
    return problems


# -- helpers ----------------------------------------------------------------------------


def _same_json(a: str, b: str) -> bool:
    try:
        return bool(json.loads(a) == json.loads(b))
    except ValueError:
        return False


def _short(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else repr(value)
    text = repr(text) if isinstance(value, str) else text
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:400]


def _traceback_tail(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return _one_line(exc) + where


# -- the command line -------------------------------------------------------------------


async def _amain(folder: Path, echo: Callable[[str], object], verbose: bool) -> list[Result]:
    specs = load_specs()
    results = []
    for path in cassettes.cassette_files(folder):
        result = await run_file(path, specs)
        echo(result.line())
        if verbose:
            for note in result.notes:
                echo(f"    note: {note}")
        results.append(result)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Run the harness over a folder; 0 when every cassette passed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else "")
    parser.add_argument(
        "folder",
        nargs="?",
        type=Path,
        default=DEFAULT_FOLDER,
        help="cassettes laid out as <provider>/<file> (default: %(default)s)",
    )
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument(
        "--verbose", action="store_true", help="also print what each spec chose to skip (notes)"
    )
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        print(f"no such folder: {args.folder}", file=sys.stderr)
        print("cassettes=0 passed=0")
        return 1
    results = anyio.run(_amain, args.folder, print, args.verbose, backend=args.backend)
    passed = sum(r.passed for r in results)
    print(f"cassettes={len(results)} passed={passed}")
    return 0 if results and passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
