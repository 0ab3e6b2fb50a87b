"""Characters that change what a reader sees are shown escaped in every inspector output.

One table (:data:`stepmachine.inspector._visible.SHOWN_ESCAPED`) says which:
bidirectional embeddings, overrides and isolates, zero-width characters and
marks, the byte-order mark, the line and paragraph separators, and C0/C1
controls other than newline and tab. Checked: the function itself
(hypothesis), the HTML export, the live view's pages and its event stream's
entries, the terminal (``show``, ``sessions list``), and the live page's
script (the same function generated as JavaScript, run by node).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import anyio
import httpx
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from stepmachine import AppendMessage, Message, ToolCallPart, submit
from stepmachine.inspector._cli import cli
from stepmachine.inspector._html import render_html
from stepmachine.inspector._live_page import live_script
from stepmachine.inspector._view import load_view
from stepmachine.inspector._visible import SHOWN_ESCAPED, shown_escaped, visible, visible_js
from stepmachine.inspector._web import create_app
from stepmachine.stores import MemoryStore, SQLiteStore

REQUIRED = (
    [chr(c) for c in range(0x202A, 0x202F)]
    + [chr(c) for c in range(0x2066, 0x206A)]
    + [chr(c) for c in range(0x200B, 0x2010)]
    + ["\u061c", "\ufeff", "\u2028", "\u2029"]
    + [chr(c) for c in range(0x20) if chr(c) not in "\n\t"]
    + [chr(c) for c in range(0x7F, 0xA0)]
)
"""Every character the issue names."""

PAY = "pay \u202e0001 EUR\u202c \u2066x\u2069 a\u200bb\u200e\u200f\ufeff\u061c\u200c\u200d"


def raw(text: str) -> list[str]:
    return sorted({f"U+{ord(c):04X}" for c in text if shown_escaped(c)})


def test_the_table_holds_every_required_character_and_keeps_newline_and_tab() -> None:
    assert [c for c in REQUIRED if not shown_escaped(c)] == []
    assert not shown_escaped("\n")
    assert not shown_escaped("\t")
    assert visible("a\u202eb\n\tc\x1b") == "a\\u202eb\n\tc\\x1b"


@given(st.text(alphabet=st.characters(codec=None, exclude_categories=["Cs"])))
def test_visible_leaves_none_raw_and_changes_nothing_else(text: str) -> None:
    shown = visible(text)
    assert raw(shown) == []
    if not raw(text):
        assert shown == text
    # Each escaped character became exactly its escape, in place.
    rebuilt = "".join(
        (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}") if shown_escaped(c) else c
        for c in text
    )
    assert shown == rebuilt


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's function")
@settings(max_examples=20, deadline=None)
@given(
    st.lists(st.text(alphabet=st.characters(codec=None, exclude_categories=["Cs"])), max_size=20)
)
def test_the_pages_javascript_function_is_the_same_function(texts: list[str]) -> None:
    samples = [*texts, PAY, "".join(REQUIRED), "".join(chr(low) for low, _ in SHOWN_ESCAPED)]
    program = (
        f"{visible_js()}\n"
        "const input = JSON.parse(require('fs').readFileSync(0, 'utf8'));\n"
        "process.stdout.write(JSON.stringify(input.map(visible)));\n"
    )
    done = subprocess.run(
        ["node", "-e", program],
        input=json.dumps(samples),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert json.loads(done.stdout) == [visible(s) for s in samples]


def test_the_live_script_writes_stream_text_through_visible() -> None:
    script = live_script("/sessions/s/events", 3)
    assert visible_js() in script
    # Every text the script takes from the stream goes in through visible().
    for taken in ("data.text", "data.name", "data.status", "data.message"):
        assert f"visible({taken})" in script, taken


async def _hostile_store() -> MemoryStore:
    store = MemoryStore()
    call = ToolCallPart.of("c1", "tool" + PAY, {"k": PAY})
    await store.create(
        "s",
        conversation=[
            Message.user(PAY, id="u1"),
            Message(id="a1", role="assistant", parts=(call,)),
        ],
    )
    await submit(store, "s", [AppendMessage(Message.user(PAY, id="u2"))], step=PAY)
    return store


async def test_the_html_export_shows_them_escaped() -> None:
    store = await _hostile_store()
    html = render_html(await load_view(store, "s"))
    assert raw(html) == []
    assert "pay \\u202e0001 EUR\\u202c" in html


async def test_the_live_pages_and_entries_show_them_escaped() -> None:
    store = await _hostile_store()
    app = create_app(store)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        index = await http.get("/")
        page = await http.get("/sessions/s")
    assert index.status_code == 200
    assert page.status_code == 200
    assert raw(index.text) == []
    assert raw(page.text) == []
    assert "pay \\u202e0001 EUR" in page.text


def test_the_terminal_shows_them_escaped(tmp_path: Path) -> None:
    db = tmp_path / "agent.sqlite3"

    async def write() -> None:
        async with await SQLiteStore.open(db) as store:
            await store.create("s", conversation=[Message.user(PAY, id="u1")])
            await submit(store, "s", [AppendMessage(Message.user(PAY, id="u2"))], step=PAY)

    anyio.run(write)
    for command in (["show", "s"], ["log", "s"], ["sessions", "list"]):
        result = CliRunner().invoke(cli, ["--store", f"sqlite:///{db}", *command])
        assert result.exit_code == 0, result.output
        assert raw(result.output) == [], command
    shown = CliRunner().invoke(cli, ["--store", f"sqlite:///{db}", "show", "s"]).output
    assert "\\u200b" in shown
    assert "\\ufeff" in shown
    assert "\\u061c" in shown
