"""The conformance replay harness over every recorded cassette, and checks of the harness itself.

``tests/harness/conformance.py`` replays ``../shared/conformance/cassettes/<provider>/<file>``
through ``httpx.MockTransport`` and the matching adapter (see its docstring for every
check). Here:

* one test per cassette file, so a failure names the file;
* every file on disk is a cassette the harness runs (nothing silently skipped), and
  every provider folder has a spec;
* streaming/blocking parity (invariant 9) is part of each cassette's run:
  for streamed recordings, the chunks given to ``on_chunk`` agree with the assembled
  response (texts, reasoning, tool-call argument deltas per call == ``raw_arguments``)
  and the same SSE bytes cut into 1-7 byte pieces give an identical response; for
  blocking recordings, the JSON reply served to a streaming request (a server that
  ignores ``stream``) gives an identical response. The expected result itself is
  derived by each spec from the recording with its own small reader, for streamed and
  blocking recordings alike, so a streamed reply and a blocking one are both held to
  what the wire says;
* the loader reads all four storage formats (small hand-written cassettes);
* the harness reports what it should (a wrong expectation, an extra request, a
  request difference, chunks that disagree, a missing spec, an unreadable file), so a
  PASS means something;
* the command line prints one line per file and ``cassettes=<n> passed=<n>``;
* synthetic cassettes (``tests/fixtures/conformance``, written by
  ``tests/fixtures/make_conformance_cassettes.py``) cover real traffic shapes that no
  recording holds (tool-call deltas without ``index``, ``n`` > 1, a ``GET /models``
  first, ``[DONE]`` after a Responses stream, a ``developer`` item, ``strict`` absent,
  signed ``reasoning_details``, thinking tokens, a streamed refusal);
* the real recordings in ``../shared/conformance/next`` whose requests carry images or
  PDFs (``openai_chat``, ``openai_responses``, ``anthropic``) replay and pass too, and
  the specs' comparison sees a changed or dropped image; a part the neutral request
  cannot hold (a ``file_id``) still fails its file loudly, naming the part;
* for every adapter, any reply streamed in any pieces gives chunks that add up exactly
  to the assembled reply (text, and each call's raw arguments).
"""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import cassettes
import conformance
import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepmachine import DocumentPart, Message, ModelRequest, ModelResponse, ReasoningPart, TextPart
from stepmachine import ToolCallPart as Call
from stepmachine.extend import Conversation, TextChunk, ToolCallChunk
from stepmachine.providers import (
    AnthropicModel,
    HTTPModel,
    OpenAIChatModel,
    OpenAICompatibleModel,
    OpenAIResponsesModel,
)

HARNESS = Path(__file__).resolve().parent / "harness"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "conformance"
FOLDER = SHARED / "cassettes"


SPECS = conformance.load_specs()


def test_the_recordings_are_beside_the_repository() -> None:
    """The recordings live in ../shared beside every checkout, CI's included.

    Missing recordings fail here, loudly, instead of silently skipping the
    conformance tests.
    """
    assert FOLDER.is_dir(), f"the conformance recordings are missing: expected {FOLDER}"
    assert _files_on_disk(), f"no recordings under {FOLDER}"


def _files_on_disk() -> list[Path]:
    """Every regular file below the provider folders (whatever its name)."""
    if not FOLDER.is_dir():
        return []
    return sorted(p for p in FOLDER.rglob("*") if p.is_file())


FILES = _files_on_disk()


# -- every cassette -------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", FILES or [None], ids=[f"{p.parent.name}/{p.name}" for p in FILES] or ["none"]
)
async def test_cassette(path: Path | None) -> None:
    assert path is not None, f"no recordings under {FOLDER}"
    result = await conformance.run_file(path, SPECS)
    assert result.passed, result.line()
    assert result.interactions > 0
    assert result.calls > 0


# -- synthetic cassettes: real traffic shapes no recording holds (issue 8, item 12) ----------

SYNTHETIC = Path(__file__).resolve().parent / "fixtures" / "conformance"
SYNTHETIC_FILES = cassettes.cassette_files(SYNTHETIC)
NEXT = SHARED / "next"


@pytest.mark.parametrize(
    "path", SYNTHETIC_FILES, ids=[f"{p.parent.name}/{p.name}" for p in SYNTHETIC_FILES]
)
async def test_synthetic_cassette(path: Path) -> None:
    result = await conformance.run_file(path, SPECS)
    assert result.passed, result.line()
    assert result.calls > 0


def test_the_synthetic_cassettes_are_there() -> None:
    assert [f"{p.parent.name}/{p.name}" for p in SYNTHETIC_FILES] == [
        "anthropic/thinking_tokens_usage.yaml",
        "openai_chat/n2_choices_stream_and_reply.yaml",
        "openai_chat/starts_with_get_models.yaml",
        "openai_compatible/mistral_stream_tool_calls_without_index.yaml",
        "openai_compatible/openrouter_reasoning_details_round_trip.yaml",
        "openai_responses/developer_item_strict_absent.yaml",
        "openai_responses/openrouter_stream_ends_with_done.yaml",
        "openai_responses/refusal_stream.yaml",
    ]


def _expected(path: Path) -> list[Any]:
    """What the spec reads from each model call's recorded reply."""
    spec = SPECS.get(path.parent.name)
    out = []
    for interaction in cassettes.load_cassette(path):
        if not interaction.path.endswith(spec.path_suffix):
            continue
        _, streamed = spec.decode_request(interaction.request_body)
        body, headers = conformance._served_body(interaction)
        out.append(spec.expect(interaction.status, body, headers, streamed))
    return out


def test_the_specs_read_tool_call_deltas_without_index() -> None:
    [expected] = _expected(
        SYNTHETIC / "openai_compatible/mistral_stream_tool_calls_without_index.yaml"
    )
    assert [(c.name, c.arguments, c.call_id) for c in expected.tool_calls] == [
        ("get_weather", {"city": "Paris"}, "D4kpd8Yxs"),
        ("get_weather", {"city": "Lyon"}, "k2LmP0qRt"),
    ]
    assert expected.finish_reason == "tool_calls"


def test_the_specs_read_choice_zero_of_n_choices() -> None:
    streamed, blocking = _expected(SYNTHETIC / "openai_chat/n2_choices_stream_and_reply.yaml")
    assert (streamed.text, streamed.finish_reason) == ("Blue.", "stop")
    assert (blocking.text, blocking.finish_reason) == ("Red.", "stop")


async def test_the_harness_skips_interactions_that_are_not_model_calls() -> None:
    result = await conformance.run_file(
        SYNTHETIC / "openai_chat/starts_with_get_models.yaml", SPECS
    )
    assert result.passed, result.line()
    assert (result.interactions, result.calls, result.skipped) == (2, 1, 1)
    assert result.line().endswith("skipped=1 notes=1")
    assert "GET /v1/models is not a model call" in result.notes[0]


async def test_a_file_without_a_model_call_fails(tmp_path: Path) -> None:
    folder = tmp_path / "openai_chat"
    folder.mkdir()
    text = (SYNTHETIC / "openai_chat/starts_with_get_models.yaml").read_text()
    (folder / "only_models.yaml").write_text(text.split("- request:\n    method: POST")[0])
    result = await conformance.run_file(folder / "only_models.yaml", SPECS)
    assert not result.passed
    assert "no model call (POST .../chat/completions) recorded" in result.line()


# -- next/: the image and PDF recordings of the Chat, Responses and Anthropic adapters ------


MEDIA_FOLDERS = ("openai_chat", "openai_responses", "anthropic")
NEXT_MEDIA_FILES = sorted(
    p for p in cassettes.cassette_files(NEXT) if p.parent.name in MEDIA_FOLDERS
)


def _model_calls(path: Path) -> int:
    suffix = SPECS.get(path.parent.name).path_suffix
    return sum(
        i.method == "POST" and i.path.endswith(suffix) for i in cassettes.load_cassette(path)
    )


@pytest.mark.parametrize(
    "path",
    NEXT_MEDIA_FILES or [None],
    ids=[f"{p.parent.name}/{p.name}" for p in NEXT_MEDIA_FILES] or ["none"],
)
async def test_next_media_cassette(path: Path | None) -> None:
    """Requests that carry images and PDFs (by bytes and by URL) replay like the rest:
    decoded into media parts, sent again by the adapter, compared on the decoded bytes."""
    assert path is not None, f"no image/PDF recordings under {NEXT}"
    result = await conformance.run_file(path, SPECS)
    assert result.passed, result.line()
    assert result.calls == _model_calls(path) > 0


def test_the_next_folder_has_media_recordings_for_every_adapter() -> None:
    assert {p.parent.name for p in NEXT_MEDIA_FILES} == set(MEDIA_FOLDERS)
    assert len(NEXT_MEDIA_FILES) == 9


def _first_media(body: Any) -> tuple[Any, Any] | None:
    """The container and key of the first media value in a request body (an image or file
    URL, a data URL, or Anthropic's bare base64 ``source.data``)."""
    if isinstance(body, dict):
        for key, value in body.items():
            if key in ("url", "image_url", "file_data", "file_url") and isinstance(value, str):
                return body, key
            if key == "data" and body.get("type") == "base64":
                return body, key
            found = _first_media(value)
            if found is not None:
                return found
    if isinstance(body, list):
        for item in body:
            found = _first_media(item)
            if found is not None:
                return found
    return None


@pytest.mark.parametrize("path", NEXT_MEDIA_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
async def test_the_specs_see_a_changed_image_or_document(path: Path) -> None:
    """The comparison can fail: the adapter's body matches the recording, and the same
    body with one media value changed (other bytes, another URL) or dropped does not."""
    spec = SPECS.get(path.parent.name)
    recorded = next(
        i.request_body
        for i in cassettes.load_cassette(path)
        if i.method == "POST" and i.path.endswith(spec.path_suffix)
    )
    request, streamed = spec.decode_request(recorded)
    async with httpx.AsyncClient() as client:
        model = spec.make_model(client, str(recorded.get("model") or ""))
        sent = json.loads(msgspec.json.encode(model.build_body(request, stream=streamed)))
    assert spec.request_differences(sent, recorded) == []
    found = _first_media(sent)
    assert found is not None, "no media value in the body sent"
    container, key = found
    original = container[key]
    for other in (
        "https://example.invalid/other.png",
        "data:image/png;base64,iVBORw0KGgo=",
        "iVBORw0KGgo=",
    ):
        if other != original:
            container[key] = other
            assert spec.request_differences(sent, recorded), other
    del container[key]
    assert spec.request_differences(sent, recorded)


_UNSENDABLE = """\
interactions:
- request:
    body: '{"model": "gpt-4o", "messages": [{"role": "user", "content": [{"type": "text",
      "text": "Summarise"}, {"type": "file", "file": {"file_id": "file-abc123"}}]}]}'
    headers: {}
    method: POST
    uri: https://api.openai.com/v1/chat/completions
  response:
    body:
      string: '{"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
        "finish_reason": "stop"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}'
    headers:
      Content-Type:
      - application/json
    status:
      code: 200
      message: OK
version: 1
"""


async def test_a_request_part_the_adapter_cannot_send_fails_the_file(tmp_path: Path) -> None:
    """A part the neutral request cannot hold (a file uploaded earlier, named by its
    ``file_id``) is not dropped to replay the rest: the file fails, naming the part."""
    folder = tmp_path / "openai_chat"
    folder.mkdir()
    (folder / "file_id.yaml").write_text(_UNSENDABLE)
    result = await conformance.run_file(folder / "file_id.yaml", SPECS)
    assert not result.passed
    assert (
        "the request holds a part the adapter cannot send: a content part of type 'file'"
        in result.line()
    )
    assert result.calls == 0  # nothing was replayed


# -- the Gemini recordings in next/ (they join cassettes/ once multimodal input lands) --------

NEXT_GEMINI = [p for p in cassettes.cassette_files(NEXT) if p.parent.name == "gemini"]


def test_the_gemini_recordings_are_there() -> None:
    assert len(NEXT_GEMINI) == 12, f"expected the 12 Gemini recordings under {NEXT / 'gemini'}"


@pytest.mark.parametrize("path", NEXT_GEMINI, ids=lambda p: f"gemini/{p.name}")
async def test_gemini_cassette(path: Path) -> None:
    result = await conformance.run_file(path, SPECS)
    assert result.passed, result.line()
    assert result.calls > 0


async def test_the_cache_calls_around_gemini_model_calls_are_skipped() -> None:
    result = await conformance.run_file(
        NEXT / "gemini" / "test_google_model_cached_content.yaml", SPECS
    )
    assert result.passed, result.line()
    assert (result.interactions, result.calls, result.skipped) == (4, 2, 2)
    assert "POST /v1beta/cachedContents is not a model call" in result.notes[0]
    assert "DELETE /v1beta/cachedContents/" in result.notes[1]


async def test_the_harness_reports_a_gemini_url_that_shows_the_key() -> None:
    spec = SPECS.get("gemini")

    def leaky(client: httpx.AsyncClient, interaction: Any) -> Any:
        model = spec.model_for(client, interaction)
        url = model.url
        model.url = lambda *, stream: url(stream=stream) + ("&" if stream else "?") + "key=k"
        return model

    result = await conformance.run_file(
        NEXT / "gemini" / "test_google_model_stream.yaml", _with("gemini", model_for=leaky)
    )
    assert "request 0: the credential is in the URL" in result.line()


async def test_the_harness_reports_a_dropped_gemini_signature() -> None:
    spec = SPECS.get("gemini")

    def forgetful(client: httpx.AsyncClient, interaction: Any) -> Any:
        model = spec.model_for(client, interaction)
        build = model.build_body

        def build_body(request: Any, *, stream: bool) -> Any:
            body = build(request, stream=stream)
            for turn in body["contents"]:
                for part in turn["parts"]:
                    part.pop("thoughtSignature", None)
            return body

        model.build_body = build_body
        return model

    name = "chat_function_calling_gemini_gemini-2_5-flash_can_use_parallel_tool_calls.yml"
    result = await conformance.run_file(
        NEXT / "gemini" / name, _with("gemini", model_for=forgetful)
    )
    assert not result.passed
    assert "call 1: request 0: contents:" in result.line()


_GEMINI_ERRORS = {
    "bad_key": (
        400,
        {
            "code": 400,
            "message": "API key not valid. Please pass a valid API key.",
            "status": "INVALID_ARGUMENT",
            "details": [
                {
                    "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                    "reason": "API_KEY_INVALID",
                    "domain": "googleapis.com",
                }
            ],
        },
    ),
    "too_long": (
        400,
        {
            "code": 400,
            "message": "The input token count (1200000) exceeds the maximum number of tokens "
            "allowed (1048576).",
            "status": "INVALID_ARGUMENT",
        },
    ),
    "no_quota": (
        429,
        {
            "code": 429,
            "message": "You exceeded your current quota.",
            "status": "RESOURCE_EXHAUSTED",
            "details": [
                {
                    "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                    "violations": [{"quotaMetric": "m", "quotaValue": "0"}],
                }
            ],
        },
    ),
    "bad_request": (
        400,
        {"code": 400, "message": "Invalid JSON payload", "status": "INVALID_ARGUMENT"},
    ),
}


@pytest.mark.parametrize("name", list(_GEMINI_ERRORS))
async def test_the_gemini_spec_expects_the_adapters_documented_error_mapping(
    name: str, tmp_path: Path
) -> None:
    """A 400 is not always a BadRequestError: a bad key (API_KEY_INVALID) is an
    AuthenticationError, a too-long input a ContextLengthExceededError, a 429 naming a
    quota of 0 a QuotaExceededError, as the adapter documents."""
    status, error = _GEMINI_ERRORS[name]
    recorded = (NEXT / "gemini" / "ErrorResponse.yaml").read_text()
    body = json.dumps({"error": error}, indent=2)
    start = recorded.index('            {\n              "error"')
    end = recorded.index("        headers:", start)
    text = recorded[:start] + "".join(f"            {line}\n" for line in body.splitlines())
    text += recorded[end:]
    text = text.replace("status: 404 Not Found", f"status: {status} Error")
    text = text.replace("code: 404\n", f"code: {status}\n")
    assert text.count(f"code: {status}\n") == 1
    folder = tmp_path / "gemini"
    folder.mkdir()
    (folder / f"{name}.yaml").write_text(text)
    result = await conformance.run_file(folder / f"{name}.yaml", SPECS)
    assert result.passed, result.line()
    assert f"error {status}" in " ".join(result.notes)


@pytest.mark.parametrize("ttl", ["5m", "1h"])
async def test_the_anthropic_spec_carries_the_cache_ttl(ttl: str, tmp_path: Path) -> None:
    """A recorded ``cache_control`` with a ``ttl`` becomes the part's ``cache_ttl``, and
    the adapter sends it back as recorded."""
    name = "GenSyncMultiModal-Document-pdf-URL.yaml"
    recorded = (NEXT / "anthropic" / name).read_text()
    mark = '"cache_control":{"type":"ephemeral"}'
    assert recorded.count(mark) == 1
    folder = tmp_path / "anthropic"
    folder.mkdir()
    timed = mark.replace("}", f',"ttl":"{ttl}"}}')
    (folder / name).write_text(recorded.replace(mark, timed))
    result = await conformance.run_file(folder / name, SPECS)
    assert result.passed, result.line()
    spec = SPECS.get("anthropic")
    body = cassettes.load_cassette(folder / name)[0].request_body
    request, _ = spec.decode_request(body)
    [document] = [p for m in request.messages for p in m.parts if isinstance(p, DocumentPart)]
    assert (document.cache, document.cache_ttl) == (True, ttl)


def test_command_line_over_the_gemini_recordings(tmp_path: Path) -> None:
    (tmp_path / "gemini").symlink_to(NEXT / "gemini")
    done = subprocess.run(
        [sys.executable, str(HARNESS / "conformance.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "cassettes=12 passed=12", done.stdout + done.stderr


def test_command_line_over_the_whole_next_folder() -> None:
    """The issue's figure: every recording in next/ (Gemini, and the image and PDF ones)."""
    done = subprocess.run(
        [sys.executable, str(HARNESS / "conformance.py"), str(NEXT)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "cassettes=21 passed=21", done.stdout + done.stderr


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_command_line_over_the_synthetic_cassettes(backend: str) -> None:
    done = subprocess.run(
        [sys.executable, str(HARNESS / "conformance.py"), str(SYNTHETIC), "--backend", backend],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    count = len(SYNTHETIC_FILES)
    assert lines[-1] == f"cassettes={count} passed={count}", done.stdout + done.stderr
    assert done.returncode == 0


def test_every_file_is_a_cassette_the_harness_runs() -> None:
    run = cassettes.cassette_files(FOLDER)
    assert FILES, f"no recordings under {FOLDER}"
    assert [p.relative_to(FOLDER) for p in run] == [p.relative_to(FOLDER) for p in FILES]
    assert all(len(p.relative_to(FOLDER).parts) == 2 for p in FILES), (
        "laid out as <provider>/<file>"
    )


def test_every_provider_folder_has_a_spec() -> None:
    folders = sorted(p.name for p in FOLDER.iterdir() if p.is_dir())
    assert folders
    missing = [f for f in folders if SPECS.get(f) is None]
    assert not missing, f"no spec for {missing}; spec import errors: {SPECS.errors}"


def test_every_cassette_loads_and_every_json_body_parses() -> None:
    for path in FILES:
        interactions = cassettes.load_cassette(path)
        assert interactions, path
        for interaction in interactions:
            assert interaction.method == "POST", path
            assert isinstance(interaction.request_body, dict), path
            served = httpx.Response(
                interaction.status,
                headers=list(interaction.headers),
                content=interaction.response_body,
            )
            if not interaction.is_sse:
                served.json()  # gzip bodies come out decompressed


def test_command_line_over_the_whole_folder() -> None:
    done = subprocess.run(
        [sys.executable, str(HARNESS / "conformance.py")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == f"cassettes={len(FILES)} passed={len(FILES)}", done.stdout + done.stderr
    assert len(lines) == len(FILES) + 1
    assert all(line.startswith("PASS ") for line in lines[:-1])
    assert done.returncode == 0


def test_command_line_reports_failures_and_exits_1(tmp_path: Path) -> None:
    (tmp_path / "no_such_provider").mkdir()
    (tmp_path / "no_such_provider" / "x.yaml").write_text(_VCRPY)
    (tmp_path / "anthropic").mkdir()
    (tmp_path / "anthropic" / "broken.yaml").write_text("just: [a, mapping]\n")
    done = subprocess.run(
        [sys.executable, str(HARNESS / "conformance.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 1
    assert lines[-1] == "cassettes=2 passed=0"
    assert lines[0].startswith("FAIL anthropic/broken.yaml interactions=0 cannot load")
    assert lines[1].startswith("FAIL no_such_provider/x.yaml interactions=1 no spec")


def test_command_line_with_a_missing_folder(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(HARNESS / "conformance.py"), str(tmp_path / "absent")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert done.stdout.strip().splitlines()[-1] == "cassettes=0 passed=0"


# -- the loader: the four storage formats ----------------------------------------------

_VCRPY = """\
interactions:
- request:
    body: '{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    headers: {}
    method: POST
    uri: https://api.example.com/v1/chat/completions
  response:
    body:
      string: '{"ok": true}'
    headers:
      Content-Type:
      - application/json
      Content-Length:
      - '999'
      Transfer-Encoding:
      - chunked
      Set-Cookie: test_set_cookie
    status:
      code: 200
      message: OK
version: 1
"""


def test_vcrpy_with_scalar_headers_and_stale_lengths_dropped(tmp_path: Path) -> None:
    path = tmp_path / "a.yaml"
    path.write_text(_VCRPY)
    [one] = cassettes.load_cassette(path)
    assert one.method == "POST"
    assert one.path == "/v1/chat/completions"
    assert one.request_body == {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert one.status == 200
    assert one.response_body == b'{"ok": true}'
    assert dict(one.headers) == {
        "Content-Type": "application/json",
        "Set-Cookie": "test_set_cookie",
    }
    assert not one.is_sse


def test_vcrpy_gzip_binary_body_passes_through_with_its_encoding(tmp_path: Path) -> None:
    import base64

    packed = gzip.compress(b'{"id": "x"}')
    text = (
        "interactions:\n- request:\n    body: '{}'\n    method: POST\n    uri: http://h/v1/messages\n"
        "  response:\n    body:\n      string: !!binary |\n        "
        + base64.b64encode(packed).decode()
        + "\n    headers:\n      Content-Encoding:\n      - gzip\n"
        "    status:\n      code: 200\nversion: 1\n"
    )
    path = tmp_path / "g.yaml"
    path.write_text(text)
    [one] = cassettes.load_cassette(path)
    assert one.response_body == packed
    assert one.header("content-encoding") == "gzip"
    served = httpx.Response(one.status, headers=list(one.headers), content=one.response_body)
    assert served.json() == {"id": "x"}


def test_content_encoding_on_an_uncompressed_body_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        _VCRPY.replace(
            "      Set-Cookie:", "      content-encoding:\n      - gzip\n      Set-Cookie:"
        )
    )
    [one] = cassettes.load_cassette(path)
    assert one.header("content-encoding") is None


def test_pydantic_ai_parsed_bodies_are_serialised_again(tmp_path: Path) -> None:
    text = """\
interactions:
- request:
    method: POST
    parsed_body:
      model: m
      stream: false
    uri: https://api.anthropic.com/v1/messages?beta=true
  response:
    headers:
      content-type:
      - application/json
    parsed_body:
      content:
      - text: "caf\\xE9"
        type: text
    status:
      code: 200
      message: OK
- request:
    method: POST
    parsed_body: {model: m, stream: true}
    uri: https://api.anthropic.com/v1/messages?beta=true
  response:
    body:
      string: |+
        event: ping
        data: {"type": "ping"}

    headers:
      content-type:
      - text/event-stream
    status:
      code: 200
version: 1
"""
    path = tmp_path / "p.yaml"
    path.write_text(text)
    first, second = cassettes.load_cassette(path)
    assert first.request_body == {"model": "m", "stream": False}
    assert first.path == "/v1/messages"
    assert httpx.Response(200, content=first.response_body).json() == {
        "content": [{"text": "caf\u00e9", "type": "text"}]
    }
    assert second.is_sse
    assert second.response_body == b'event: ping\ndata: {"type": "ping"}\n\n'


def test_ruby_vcr_with_binary_tag(tmp_path: Path) -> None:
    import base64

    raw = '{"content":"15\u00b0C \U0001f324"}'.encode()
    text = f"""\
---
http_interactions:
- request:
    method: post
    uri: "<OLLAMA_API_BASE>/chat/completions"
    body:
      encoding: UTF-8
      string: '{{"model":"qwen3","messages":[]}}'
    headers:
      Content-Type:
      - application/json
  response:
    status:
      code: 200
      message: OK
    headers:
      Content-Type:
      - application/json
    body:
      encoding: ASCII-8BIT
      string: !binary |-
        {base64.b64encode(raw).decode()}
  recorded_at: Mon, 08 Jun 2026 18:45:45 GMT
recorded_with: VCR 6.4.0
"""
    path = tmp_path / "r.yml"
    path.write_text(text)
    [one] = cassettes.load_cassette(path)
    assert one.method == "POST"
    assert one.path.endswith("/chat/completions")
    assert one.request_body == {"model": "qwen3", "messages": []}
    assert one.response_body == raw


def test_go_vcr_v2(tmp_path: Path) -> None:
    text = """\
---
version: 2
interactions:
    - id: 0
      request:
        proto: HTTP/1.1
        body: |
            {"messages":[]}
        headers:
            Content-Type:
                - application/json
        url: http://127.0.0.1/chat/completions
        method: POST
      response:
        proto: HTTP/1.1
        content_length: 88
        body: '{"error":{"code":500,"message":"Context size exceeded.","type":"server_error"}}'
        headers:
            Content-Length:
                - "88"
            Content-Type:
                - application/json; charset=utf-8
        status: 500 Internal Server Error
        code: 500
        duration: 1m51.603s
"""
    path = tmp_path / "go.yaml"
    path.write_text(text)
    [one] = cassettes.load_cassette(path)
    assert one.url == "http://127.0.0.1/chat/completions"
    assert one.request_body == {"messages": []}
    assert one.status == 500
    assert dict(one.headers) == {"Content-Type": "application/json; charset=utf-8"}


def test_a_cassette_written_again_is_read_again(tmp_path: Path) -> None:
    """Cassettes are parsed once per process, but a file changed since is parsed anew."""
    path = tmp_path / "a.yaml"
    path.write_text(_VCRPY)
    [first] = cassettes.load_cassette(path)
    path.write_text(_VCRPY.replace('"hi"', '"hello again"'))
    [second] = cassettes.load_cassette(path)
    assert first.request_body["messages"][0]["content"] == "hi"
    assert second.request_body["messages"][0]["content"] == "hello again"


def test_not_a_cassette(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(cassettes.CassetteError):
        cassettes.load_cassette(path)
    path.write_text("a: !!python/object:os.system {}\n")
    with pytest.raises(cassettes.CassetteError):  # a SafeLoader: never constructs objects
        cassettes.load_cassette(path)


# -- the harness reports what it should ------------------------------------------------


def _anthropic(name: str) -> Path:
    spec = SPECS.get("anthropic")
    path = FOLDER / "anthropic" / name
    if spec is None or not path.is_file():
        pytest.skip("needs the anthropic spec and recordings")
    return path


def _with(folder: str, **changes: Any) -> Any:
    specs = conformance.Specs(dict(SPECS.by_folder), dict(SPECS.errors))
    specs.by_folder[folder] = dataclasses.replace(specs.by_folder[folder], **changes)
    return specs


async def test_harness_reports_a_wrong_expectation() -> None:
    path = _anthropic("test_anthropic_tools_legacy.yaml")
    spec = SPECS.get("anthropic")

    def expect(*args: Any) -> Any:
        return dataclasses.replace(spec.expect(*args), text="something else")

    result = await conformance.run_file(path, _with("anthropic", expect=expect))
    assert not result.passed
    assert "text" in result.line()


async def test_harness_reports_the_wrong_error_type() -> None:
    path = _anthropic(
        "chat_error_handling_with_anthropic_claude-haiku-4-5_raises_appropriate_auth_error.yml"
    )
    spec = SPECS.get("anthropic")
    from stepmachine.providers import PermissionDeniedError

    def expect(*args: Any) -> Any:
        return dataclasses.replace(spec.expect(*args), error=PermissionDeniedError)

    result = await conformance.run_file(path, _with("anthropic", expect=expect))
    assert "expected PermissionDeniedError, got AuthenticationError" in result.line()


async def test_harness_reports_a_request_difference() -> None:
    path = _anthropic("test_anthropic_tools_legacy.yaml")
    result = await conformance.run_file(
        path, _with("anthropic", request_differences=lambda sent, recorded: ["model: nope"])
    )
    assert "request 0: model: nope" in result.line()


async def test_harness_reports_an_extra_request() -> None:
    path = _anthropic("test_anthropic_tools_legacy.yaml")
    spec = SPECS.get("anthropic")

    def twice(client: httpx.AsyncClient, name: str) -> Any:
        model = spec.make_model(client, name)
        once = model.request

        async def request(request: Any, *, on_chunk: Any = None) -> ModelResponse:
            await once(request, on_chunk=on_chunk)
            return await once(request, on_chunk=on_chunk)

        model.request = request
        return model

    result = await conformance.run_file(path, _with("anthropic", make_model=twice))
    assert "request 2 was sent, but only 1 recorded" in result.line()


async def test_harness_reports_chunks_that_disagree_with_the_response() -> None:
    path = _anthropic("test_anthropic_message_streaming_legacy.yaml")
    spec = SPECS.get("anthropic")

    def noisy(client: httpx.AsyncClient, name: str) -> Any:
        model = spec.make_model(client, name)
        parse = model.parse_stream

        async def parse_stream(events: Any, emit: Any) -> ModelResponse:
            await emit(TextChunk("noise"))
            return await parse(events, emit)  # type: ignore[no-any-return]

        model.parse_stream = parse_stream
        return model

    result = await conformance.run_file(path, _with("anthropic", make_model=noisy))
    assert "parity: text chunks" in result.line()


async def test_harness_reports_a_missing_spec(tmp_path: Path) -> None:
    (tmp_path / "mystery").mkdir()
    (tmp_path / "mystery" / "a.yaml").write_text(_VCRPY)
    [result] = await conformance.run_folder(tmp_path, SPECS)
    assert result.line().startswith(
        "FAIL mystery/a.yaml interactions=1 no spec for provider folder"
    )


def test_chunk_problems() -> None:
    call = Call.parse("c1", "f", '{"a": 1}')
    response = ModelResponse(parts=(ReasoningPart("r"), TextPart("ab"), call))
    good = [
        TextChunk("a"),
        TextChunk("b"),
        ToolCallChunk(3, "c1", "f", '{"a"'),
        ToolCallChunk(3, "c1", None, ": 1}"),
    ]
    problems = conformance.chunk_problems(response, good)
    assert problems == ["reasoning chunks '' != reasoning parts 'r'"]
    reencoded = [*good[:2], ToolCallChunk(0, "c1", "f", '{"a":1}')]
    assert len(conformance.chunk_problems(response, reencoded)) == 1  # same JSON: accepted
    wrong = [*good[:2], ToolCallChunk(0, "c2", "g", '{"a": 2}')]
    assert len(conformance.chunk_problems(response, wrong)) == 4  # reasoning, args, name, id
    split = [*good[:2], ToolCallChunk(0, "c1", "f", "{}"), ToolCallChunk(1, "c1", "f", "{}")]
    assert "tool-call chunks for 2 index(es), 1 call(s)" in conformance.chunk_problems(
        response, split
    )


def test_split_randomly_keeps_every_byte() -> None:
    body = bytes(range(256)) * 3
    pieces = conformance.split_randomly(5)(body)
    assert b"".join(pieces) == body
    assert all(1 <= len(p) <= 7 for p in pieces)


# -- every adapter: the streamed chunks add up to the assembled reply (invariant 9) -----------
#
# Issue 8 item 8: an Anthropic call without arguments streamed only ``partial_json: ""``,
# so its chunks joined to "" while the part said "{}". Generalised: for every adapter and
# any reply (text, any number of calls, arguments empty or not, cut anywhere), the text
# chunks joined are the text, and each call's argument deltas joined are exactly its
# ``raw_arguments`` (the wire JSON is written compactly here, as the adapters re-encode it).

_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
_CALLS = st.lists(
    st.tuples(
        st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
        st.dictionaries(st.text(max_size=6), _JSON_VALUES, max_size=3),
    ),
    max_size=3,
)


def _pieces(text: str, cuts: list[int]) -> list[str]:
    """``text`` cut at the given offsets (each taken modulo its length)."""
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points) if b > a]


def _compact(value: Any) -> str:
    return msgspec.json.encode(value, enc_hook=Conversation.enc_hook).decode()


def _chat_stream(text: str, calls: list[tuple[str, str]], cuts: list[int]) -> bytes:
    def data(delta: dict[str, Any], finish: str | None = None) -> str:
        chunk = {"id": "c1", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return f"data: {json.dumps(chunk)}\n\n"

    out = [data({"role": "assistant", "content": ""})]
    out += [data({"content": p}) for p in _pieces(text, cuts)]
    for n, (name, raw) in enumerate(calls):
        head = {"index": n, "id": f"call_{n}", "type": "function"}
        out.append(data({"tool_calls": [{**head, "function": {"name": name, "arguments": ""}}]}))
        out += [
            data({"tool_calls": [{"index": n, "function": {"arguments": p}}]})
            for p in _pieces(raw, cuts)
        ]
    out.append(data({}, "tool_calls" if calls else "stop"))
    return ("".join(out) + "data: [DONE]\n\n").encode()


def _responses_stream(text: str, calls: list[tuple[str, str]], cuts: list[int]) -> bytes:
    events: list[dict[str, Any]] = []
    output: list[dict[str, Any]] = []
    if text:
        item = {"id": "m", "type": "message", "role": "assistant", "status": "completed"}
        events.append(
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": {**item, "content": []},
            }
        )
        events += [
            {
                "type": "response.output_text.delta",
                "output_index": 0,
                "content_index": 0,
                "delta": p,
            }
            for p in _pieces(text, cuts)
        ]
        item["content"] = [{"type": "output_text", "text": text, "annotations": []}]
        events.append({"type": "response.output_item.done", "output_index": 0, "item": item})
        output.append(item)
    for name, raw in calls:
        index = len(output)
        call = {
            "id": f"fc{index}",
            "type": "function_call",
            "call_id": f"call_{index}",
            "name": name,
        }
        events.append(
            {
                "type": "response.output_item.added",
                "output_index": index,
                "item": {**call, "arguments": ""},
            }
        )
        events += [
            {"type": "response.function_call_arguments.delta", "output_index": index, "delta": p}
            for p in _pieces(raw, cuts)
        ]
        call["arguments"] = raw
        events.append({"type": "response.output_item.done", "output_index": index, "item": call})
        output.append(call)
    final = {"id": "r", "status": "completed", "output": output, "error": None, "usage": {}}
    events.append({"type": "response.completed", "response": final})
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()


def _anthropic_stream(text: str, calls: list[tuple[str, str]], cuts: list[int]) -> bytes:
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {"model": "m", "content": [], "usage": {}}}
    ]
    blocks: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    if text:
        deltas = [{"type": "text_delta", "text": p} for p in _pieces(text, cuts)]
        blocks.append(({"type": "text", "text": ""}, deltas))
    for n, (name, raw) in enumerate(calls):
        start = {"type": "tool_use", "id": f"toolu_{n}", "name": name, "input": {}}
        # As the API does: an opening "" piece, and nothing else for a call without arguments.
        fragments = [""] + ([] if raw == "{}" else _pieces(raw, cuts))
        blocks.append((start, [{"type": "input_json_delta", "partial_json": f} for f in fragments]))
    for index, (start, deltas) in enumerate(blocks):
        events.append({"type": "content_block_start", "index": index, "content_block": start})
        events += [{"type": "content_block_delta", "index": index, "delta": d} for d in deltas]
        events.append({"type": "content_block_stop", "index": index})
    stop = "tool_use" if calls else "end_turn"
    events += [
        {"type": "message_delta", "delta": {"stop_reason": stop}, "usage": {}},
        {"type": "message_stop"},
    ]
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()


_ADAPTERS: dict[str, tuple[Callable[..., HTTPModel], Callable[..., bytes]]] = {
    "openai_chat": (OpenAIChatModel, _chat_stream),
    "openai_compatible": (OpenAICompatibleModel, _chat_stream),
    "openai_responses": (OpenAIResponsesModel, _responses_stream),
    "anthropic": (AnthropicModel, _anthropic_stream),
}


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("adapter", sorted(_ADAPTERS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.text(max_size=30),
    calls=_CALLS,
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=6),
)
def test_streamed_chunks_add_up_to_the_assembled_reply(
    adapter: str, backend: str, text: str, calls: list[tuple[str, Any]], cuts: list[int]
) -> None:
    factory, wire = _ADAPTERS[adapter]
    raws = [(name, _compact(arguments)) for name, arguments in calls]
    body = wire(text, raws, cuts)

    async def run() -> tuple[ModelResponse, list[Any]]:
        chunks: list[Any] = []

        async def sink(chunk: Any) -> None:
            chunks.append(chunk)

        def handler(request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            model = factory("m", api_key="k", base_url="https://llm.test/v1", client=client)
            request = ModelRequest(messages=(Message.user("hi", id="u1"),))
            return await model.request(request, on_chunk=sink), chunks

    response, chunks = anyio.run(run, backend=backend)
    texts = "".join(c.text for c in chunks if isinstance(c, TextChunk))
    assert texts == "".join(p.text for p in response.parts if isinstance(p, TextPart)) == text
    parts = [p for p in response.parts if isinstance(p, Call)]
    assert [(p.name, p.raw_arguments) for p in parts] == raws
    streamed: dict[int, list[ToolCallChunk]] = {}
    for chunk in chunks:
        if isinstance(chunk, ToolCallChunk):
            streamed.setdefault(chunk.index, []).append(chunk)
    assert sorted(streamed) == list(range(len(parts)))
    for index, part in enumerate(parts):
        pieces = streamed[index]
        assert "".join(c.arguments_delta for c in pieces) == part.raw_arguments
        assert {c.call_id for c in pieces} - {None} == {part.call_id}
        assert {c.name for c in pieces} - {None} == {part.name}
    assert not conformance.chunk_problems(response, chunks)
