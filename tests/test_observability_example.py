"""examples/observability.py works as documented (issue 11's "must show").

It runs the approval agent on SQLite, resumes it in a second process, and
prints the span tree of both processes and every structured event as a JSON
line. Checked here: the two runs, the shape of each process's span tree, the
events (valid JSON with their fields, no content with capture off), public
names only, and, once the stores and the link lookup allow it, the resumed
run's link to the first run's last traced span.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _public_names import private_uses

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "observability.py"
PROVIDER_VARIABLES = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "OPENAI_COMPATIBLE_BASE_URL")


def run_example(*args: str) -> subprocess.CompletedProcess[str]:
    """The example with no provider configured (the stand-in model)."""
    env = {k: v for k, v in os.environ.items() if k not in PROVIDER_VARIABLES}
    env.pop("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", None)
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


def section(out: str, title: str, until: str | None) -> list[str]:
    """The lines after the line ``title`` up to the line ``until`` (or the end)."""
    lines = out.splitlines()
    start = lines.index(title) + 1
    end = lines.index(until, start) if until is not None else len(lines)
    return [line for line in lines[start:end] if line]


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def output(request: pytest.FixtureRequest) -> str:
    done = run_example("--backend", request.param)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_it_yields_for_approval_then_finishes_in_a_second_process(output: str) -> None:
    assert "model: stand-in" in output
    assert "process 1: run yielded awaiting_approval" in output
    assert re.search(r"process 1: approved send_payment \(\S+\) by operator", output)
    assert "process 2: run returned done" in output
    assert "final answer: Done: paid 120 EUR to Alice." in output


def tree_names(output: str) -> dict[str, list[str]]:
    """Per process heading, the indented span names (attributes and links left out)."""
    trees: dict[str, list[str]] = {}
    current = ""
    for line in section(output, "spans:", "events (JSON lines, logger 'stepmachine'):"):
        if line.startswith(" process "):
            current = line.split(",")[0].strip()
            trees[current] = []
        elif "->" not in line:
            trees[current].append(line.split("  [")[0].rstrip())
    return trees


def test_it_prints_the_span_tree_of_both_processes(output: str) -> None:
    assert tree_names(output) == {
        "process 1": [
            "  invoke_agent stepmachine",
            "    cycle inference",
            "      chat stand-in",
            "    cycle approval",
        ],
        "process 2": [
            "  invoke_agent stepmachine",
            "    cycle tools",
            "      execute_tool send_payment",
            "    cycle inference",
            "      chat stand-in",
        ],
    }
    assert "invoke_agent stepmachine  [yield=awaiting_approval]" in output
    assert "invoke_agent stepmachine  [yield=done]" in output
    assert re.search(r"execute_tool send_payment  \[call=\S+ outcome=ok\]", output)
    traces = re.findall(r"^ process \d, trace ([0-9a-f]{32}):$", output, re.MULTILINE)
    assert len(traces) == 2


def events_of(output: str) -> dict[str, list[dict[str, Any]]]:
    lines = section(output, "events (JSON lines, logger 'stepmachine'):", None)
    per: dict[str, list[dict[str, Any]]] = {}
    current = ""
    for line in lines:
        if line.startswith(" process "):
            current = line.strip()
            per[current] = []
        else:
            per[current].append(json.loads(line))
    return per


def test_it_prints_the_events_of_both_processes_as_json_lines(output: str) -> None:
    per = events_of(output)
    assert [e["event"] for e in per["process 1"]] == ["model_call", "cycle", "cycle", "yield"]
    assert [e["event"] for e in per["process 2"]] == [
        "tool_call",
        "cycle",
        "model_call",
        "cycle",
        "yield",
    ]
    for event in per["process 1"] + per["process 2"]:
        assert event["logger"] == "stepmachine"
        assert event["level"] in {"debug", "info"}
        assert event["session_id"] == "invoice-42"
    assert per["process 1"][-1]["kind"] == "awaiting_approval"
    assert per["process 1"][1]["refused"][0]["step"] == "approval"
    assert per["process 2"][0]["tool"] == "send_payment"
    assert per["process 2"][-1]["kind"] == "done"


def test_no_content_is_in_the_events_or_spans(output: str) -> None:
    # The prompt, the tool's arguments and result, the replies: printed by the
    # example itself above the spans, never inside the spans or the events.
    reported = output[output.index("spans:") :]
    for text in ("Please pay", "Alice", "Paying Alice", "Done:"):
        assert text not in reported
    # The amount as a value of its own (span and trace ids are hex and may hold "120").
    assert re.search(r"(?<![0-9a-f])120(?![0-9a-f])", reported) is None


def test_the_resumed_run_links_to_the_span_that_wrote_the_first_runs_last_batch(
    output: str,
) -> None:
    match = re.search(r"-> linked to span ([0-9a-f]{16}) \((.+)\)", output)
    assert match is not None, output
    assert match[2] == "cycle approval in process 1"


def test_the_example_uses_only_public_names() -> None:
    assert private_uses(EXAMPLE.read_text(encoding="utf-8")) == []
