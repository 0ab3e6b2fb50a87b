"""No configured secret of an MCP server reaches a model through its catalog (issue 22).

A server's tool name, description and every string of its input schema (keys
included) have the server's configured secrets replaced by ``[redacted]``
when the catalog is built; a schema nested past ``MAX_SCHEMA_DEPTH`` is not
walked without end: the tool is left out and logged. Documents a result
carries have their titles (an embedded resource's URI) redacted too. The
end-to-end cases with a real subprocess server (tests/_mcp_secret_server.py) are
in tests/test_mcp.py.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("mcp")

from mcp.types import Tool

from stepmachine import DocumentPart, ImagePart, ToolOutput
from stepmachine.operations import McpStdio, McpTools
from stepmachine.operations._mcp_tool import (
    MAX_SCHEMA_DEPTH,
    redacted,
    redacted_schema,
)

SECRET = "s3cret-value-0042"
SERVER = McpStdio(name="srv", command=sys.executable, args=["-c", "pass"], env={"K": SECRET})
PLAIN = McpStdio(name="srv", command=sys.executable, args=["-c", "pass"])

_words = st.sampled_from(["a", "type", "description", SECRET, f"key {SECRET} end", "x"])
_strings = st.one_of(_words, st.text(max_size=8))
_json: Any = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), _strings),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(_strings, inner, max_size=4)
    ),
    max_leaves=30,
)


def _replaced(value: Any) -> Any:
    """``value`` with the secret replaced in every string (the expected result)."""
    if isinstance(value, str):
        return value.replace(SECRET, "[redacted]")
    if isinstance(value, list):
        return [_replaced(v) for v in value]
    if isinstance(value, dict):
        return {_replaced(k): _replaced(v) for k, v in value.items()}
    return value


@given(_json)
def test_every_string_of_a_schema_is_redacted_and_nothing_else_changes(schema: Any) -> None:
    out = redacted_schema(schema, SERVER)
    assert SECRET not in json.dumps(out)
    assert out == _replaced(schema)


@given(_json)
def test_a_server_without_secrets_keeps_its_schema(schema: Any) -> None:
    assert redacted_schema(schema, PLAIN) is schema


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", "description": SECRET}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"p": schema}}
    return schema


def _catalog(*tools: Tool) -> Any:
    link = SimpleNamespace(server=SERVER, listing=tools)
    return McpTools([SERVER])._build_catalog([link], (1,), strict=False)  # type: ignore[list-item]


def test_the_catalog_redacts_name_description_and_schema() -> None:
    tool = Tool(
        name=f"t-{SECRET}",
        description=f"uses key {SECRET}",
        inputSchema={
            "type": "object",
            "properties": {SECRET: {"type": "string", "enum": [SECRET, "b"]}},
        },
    )
    catalog = _catalog(tool)
    [definition] = catalog.definitions
    shown = json.dumps([definition.name, definition.description, definition.parameters])
    assert SECRET not in shown
    assert definition.description == "uses key [redacted]"
    assert definition.parameters["properties"]["[redacted]"]["enum"] == ["[redacted]", "b"]
    [held] = catalog.tools.values()
    assert held.remote_name == tool.name  # the call still goes by the server's name


def test_a_schema_nested_past_the_bound_is_left_out_and_logged() -> None:
    deep = Tool(name="deep", description="d", inputSchema=_nested(MAX_SCHEMA_DEPTH))
    fine = Tool(name="fine", description="f", inputSchema=_nested(10))
    with structlog.testing.capture_logs() as logs:
        catalog = _catalog(deep, fine)
    assert [d.name for d in catalog.definitions] == ["fine"]
    [warned] = [e for e in logs if e.get("event") == "mcp_catalog"]
    assert "'deep'" in warned["problem"]
    assert str(MAX_SCHEMA_DEPTH) in warned["problem"]
    assert SECRET not in json.dumps(logs, default=str)


def test_a_document_title_is_redacted_and_the_rest_kept() -> None:
    pdf = DocumentPart(media_type="application/pdf", data=b"%PDF-1.4", title=f"u?k={SECRET}")
    text = DocumentPart(media_type="text/plain", data=SECRET.encode(), title="notes")
    image = ImagePart(media_type="image/png", data=b"\x89PNG")
    out = redacted(ToolOutput("", (pdf, text, image)), SERVER)
    got_pdf, got_text, got_image = out.media
    assert isinstance(got_pdf, DocumentPart)
    assert isinstance(got_text, DocumentPart)
    assert got_pdf.title == "u?k=[redacted]"
    assert got_pdf.data == pdf.data
    assert got_text.data == b"[redacted]"
    assert got_text.title == "notes"
    assert got_image is image
