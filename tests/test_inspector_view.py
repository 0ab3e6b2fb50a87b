"""The session as data (``stepmachine.inspector.session_view``): when messages came, and
what a replacement of the conversation brought."""

from __future__ import annotations

from typing import Any

import pytest
from _html_sessions import demo_view, run_in_thread


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_in_thread(demo_view, tmp_path_factory.mktemp("view") / "demo.sqlite3")


def test_messages_say_the_revision_that_added_them(demo: dict[str, Any]) -> None:
    first_seen: dict[str, int] = {"u1": 0}  # the message the demo session was created with
    replacements = 0
    for batch in demo["batches"]:
        for effect in batch["effects"]:
            if effect["type"] == "append_message":
                first_seen.setdefault(effect["message"]["id"], batch["revision"])
            elif effect["type"] == "replace_conversation":
                replacements += 1
                for message in effect["conversation"]:
                    first_seen.setdefault(message["id"], batch["revision"])
    assert replacements  # the demo compacts: u1 is in every replacement, and stays 0
    assert {m["id"]: m["added_at"] for m in demo["messages"]} == {
        m["id"]: first_seen[m["id"]] for m in demo["messages"]
    }
    assert any(m["added_at"] == 0 for m in demo["messages"])


def test_a_replacement_shows_new_messages_whole_and_kept_ones_as_stubs(
    demo: dict[str, Any],
) -> None:
    known: set[str] = {m["id"] for m in demo["messages"] if m["added_at"] == 0}
    checked = 0
    for batch in demo["batches"]:
        for effect in batch["effects"]:
            if effect["type"] == "append_message":
                known.add(effect["message"]["id"])
            elif effect["type"] == "replace_conversation":
                for message in effect["conversation"]:
                    if message.get("kept"):
                        assert message["id"] in known
                        assert "parts" not in message
                        assert message["added_at"] < batch["revision"]
                    else:
                        assert "parts" in message
                    checked += 1
                    known.add(message["id"])
    assert checked
    kept = [
        m
        for b in demo["batches"]
        for e in b["effects"]
        if e["type"] == "replace_conversation"
        for m in e["conversation"]
        if m.get("kept")
    ]
    assert kept  # a compaction keeps most messages: they are not repeated whole
