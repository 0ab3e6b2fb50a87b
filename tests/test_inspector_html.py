"""The HTML timeline (stepmachine.inspector.render_html): complete, self-contained, inert.

Sessions are recorded through the public API (tests/_html_sessions.py) into
SQLite, read back, turned into a view and rendered; the document is parsed
with the standard library (tests/_html_dom.py) and checked against the
session's own data: every message, call, result, approval, refusal and
compaction is there, and nothing stored becomes markup.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import importlib.resources
import re
from typing import Any

import pytest
from _html_dom import Node, parse
from _html_sessions import HOSTILE, XSS, demo_view, record_hostile, run_in_thread
from hypothesis import given, settings
from hypothesis import strategies as st

from stepmachine import (
    AppendMessage,
    Effect,
    Message,
    Session,
    SetVisibility,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    UpdateData,
)
from stepmachine.extend import Batch, Refusal
from stepmachine.inspector import (
    render_batch,
    render_html,
    render_page,
    session_view,
)
from stepmachine.inspector._visible import visible
from stepmachine.testing import make_session

BACKENDS = ["asyncio", "trio"]


@pytest.fixture(scope="module", params=BACKENDS)
def demo(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """The demo session's view, recorded on each backend."""
    path = tmp_path_factory.mktemp("demo") / "db.sqlite3"
    return run_in_thread(demo_view, path, backend=request.param)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("hostile") / "db.sqlite3"
    view: dict[str, Any] = run_in_thread(record_hostile, path)
    return view


def _parts(view: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [p for m in view["messages"] for p in m["parts"] if p["type"] == kind]


def _leaves(value: Any) -> list[str]:
    """The scalar values inside JSON arguments, as they print."""
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, list):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value] if isinstance(value, str) else [str(value)]


# -- everything is there ----------------------------------------------------------------------


def test_every_message_call_and_result_is_in_the_timeline_and_the_conversation(
    demo: dict[str, Any],
) -> None:
    root = parse(render_html(demo))
    timeline = root.by_id("timeline").text()
    conversation = root.by_id("conversation").text()
    texts = [p["text"] for p in _parts(demo, "text") + _parts(demo, "reasoning")]
    calls = _parts(demo, "tool_call")
    results = _parts(demo, "tool_result")
    assert texts
    assert calls
    assert results
    for text in texts:
        assert text in conversation
    for call in calls:
        for where in (timeline, conversation):
            assert call["name"] in where
            assert call["call_id"] in where
            for leaf in _leaves(call["arguments"]):
                assert leaf in where
    for result in results:
        assert result["content"] in timeline
        assert result["content"] in conversation
    # Messages appended by batches (all but the first user message and the summary)
    # show in the timeline too.
    appended = [
        e["message"] for b in demo["batches"] for e in b["effects"] if e["type"] == "append_message"
    ]
    for message in appended:
        for part in message["parts"]:
            if part["type"] in ("text", "reasoning"):
                assert part["text"] in timeline


def test_the_timeline_has_one_entry_per_batch_built_by_render_batch(demo: dict[str, Any]) -> None:
    document = render_html(demo)
    root = parse(document)
    sections = root.by_id("timeline").find_all("section", "batch")
    revisions = [b["revision"] for b in demo["batches"]]
    assert [s.attrs["id"] for s in sections] == [f"rev-{r}" for r in revisions]
    assert [s.attrs["data-revision"] for s in sections] == [str(r) for r in revisions]
    for batch in demo["batches"]:
        assert render_batch(batch) in document
    for section, batch in zip(sections, demo["batches"], strict=True):
        text = section.text()
        assert batch["step"] in text
        assert f"cycle {batch['cycle']}" in text


def test_the_header_says_id_revision_status_and_totals(demo: dict[str, Any]) -> None:
    header = parse(render_html(demo)).by_id("session")
    assert header.by_id("session-id").text() == demo["id"]
    assert header.by_id("session-revision").text() == str(demo["revision"])
    assert header.by_id("session-status").text() == demo["status"] == "done"
    text = header.text()
    totals = demo["totals"]
    assert totals["model_replies"] == 6
    assert str(totals["model_replies"]) in text
    assert f"{totals['input_tokens']} in / {totals['output_tokens']} out" in text
    assert "problems" in text


def test_refusals_are_listed_with_why(demo: dict[str, Any]) -> None:
    root = parse(render_html(demo))
    refused_batches = [b for b in demo["batches"] if b["refused"]]
    assert refused_batches
    for batch in refused_batches:
        text = root.by_id(f"rev-{batch['revision']}").text()
        for refusal in batch["refused"]:
            assert refusal["step"] in text
            assert refusal["why"] in text


def test_the_approval_says_who_and_why_in_the_timeline_and_on_the_call(
    demo: dict[str, Any],
) -> None:
    root = parse(render_html(demo))
    (decided,) = [c for c in _parts(demo, "tool_call") if c["decision"]]
    decision = decided["decision"]
    assert (decision["by"], decision["reason"]) == ("carol", "invoice INV-7 checked")
    (batch,) = [b for b in demo["batches"] if "approved by carol" in b["summary"]]
    for node in (root.by_id(f"rev-{batch['revision']}"), root.by_id(f"call-{decided['call_id']}")):
        (line,) = node.find_all(css="decision")
        assert "approved" in line.classes
        assert line.find_all("b")[0].text() == "carol"
        assert "invoice INV-7 checked" in line.text()
    request_batches = [b for b in demo["batches"] if "approval requested" in b["summary"]]
    assert len(request_batches) == 1
    assert "approval requested" in root.by_id(f"rev-{request_batches[0]['revision']}").text()


def test_journal_intents_show_side_effects_key_and_attempt(demo: dict[str, Any]) -> None:
    root = parse(render_html(demo))
    journaled = [c for c in _parts(demo, "tool_call") if c["journal"]]
    assert journaled
    for call in journaled:
        text = root.by_id(f"call-{call['call_id']}").text()
        journal = call["journal"]
        assert journal["side_effects"] in text
        assert journal["idempotency_key"] in text
        assert f"attempt {journal['attempt']}" in text


def test_calls_say_their_state_and_link_to_their_result(demo: dict[str, Any]) -> None:
    root = parse(render_html(demo))
    states = set()
    for call in _parts(demo, "tool_call"):
        node = root.by_id(f"call-{call['call_id']}")
        assert node.find_all(css="state")[0].text() == call["state"]
        states.add(call["state"])
        links = [a.attrs["href"] for a in node.find_all("a")]
        assert f"#msg-{call['result']}" in links
        root.by_id(f"msg-{call['result']}")  # the target exists
    assert states == {"answered", "error"}
    errors = root.by_id("conversation").find_all(css="error")
    assert any("result" in node.classes for node in errors)


def test_hidden_messages_are_marked(demo: dict[str, Any]) -> None:
    root = parse(render_html(demo))
    hidden = [m for m in demo["messages"] if not m["visible_to_model"]]
    assert len(hidden) >= 4
    for message in demo["messages"]:
        node = root.by_id(f"msg-{message['id']}")
        marked = "hidden" in node.classes
        assert marked == (not message["visible_to_model"])
        assert ("hidden from the model" in node.text()) == marked


def test_a_compaction_shows_its_summary_and_what_it_hid(demo: dict[str, Any]) -> None:
    root = parse(render_html(demo))
    (batch,) = [b for b in demo["batches"] if b["step"] == "compaction"]
    (replaced,) = [e for e in batch["effects"] if e["type"] == "replace_conversation"]
    summaries = [
        r
        for m in replaced["conversation"]
        for r in m.get("records", [])  # kept messages are stubs
        if r["record"] == "stepmachine.compaction.summary"
    ]
    (summary,) = summaries
    entry = root.by_id(f"rev-{batch['revision']}")
    assert "compaction summary" in entry.text()
    links = {a.attrs["href"] for a in entry.find_all("a")}
    for ident in summary["summarised"]:
        assert f"#msg-{ident}" in links
    assert f"{summary['tokens_before']}" in entry.text()


def test_long_text_is_collapsed_but_whole() -> None:
    long_text = "word " * 2000
    session = make_session(long_text, session_id="long")
    root = parse(render_html(session_view(session, [])))
    (message,) = root.by_id("conversation").find_all("article")
    (details,) = message.find_all("details", "long")
    assert long_text in details.text()


# -- self-contained and inert -----------------------------------------------------------------

URL_ATTRIBUTES = ("src", "href", "action", "formaction", "poster", "data", "srcset", "background")


def _assert_inert(document: str) -> Node:
    root = parse(document)
    elements = list(root.iter())
    tags = {node.tag for node in elements}
    assert not tags & {"img", "iframe", "object", "embed", "link", "base", "form", "svg", "math"}
    scripts = root.find_all("script")
    assert len(scripts) == 1
    assert scripts[0].text(skip=frozenset()) == _asset("timeline.js")
    styles = root.find_all("style")
    assert len(styles) == 1
    assert styles[0].text(skip=frozenset()) == _asset("timeline.css")
    for node in elements:
        for name, value in node.attrs.items():
            assert not name.startswith("on"), (node.tag, name, value)
            assert name != "style", (node.tag, value)
            if name in URL_ATTRIBUTES:
                assert (value or "").startswith("#"), (node.tag, name, value)
    return root


def _asset(name: str) -> str:
    files = importlib.resources.files("stepmachine.inspector") / "_assets" / name
    return files.read_text("utf-8")


def test_the_page_fetches_nothing(demo: dict[str, Any]) -> None:
    document = render_html(demo)
    root = _assert_inert(document)
    (csp,) = [m for m in root.find_all("meta") if m.attrs.get("http-equiv")]
    policy = csp.attrs["content"] or ""
    assert "default-src 'none'" in policy
    assert "connect-src" not in policy
    assert "unsafe" not in policy
    script = root.find_all("script")[0].text(skip=frozenset())
    style = root.find_all("style")[0].text(skip=frozenset())
    for source in (script, style):
        digest = base64.b64encode(hashlib.sha256(source.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in policy
    for name in ("timeline.css", "timeline.js"):
        asset = _asset(name)
        assert not re.search(r"https?:|//[a-z]|url\(|@import", asset, re.IGNORECASE), name


def test_hostile_stored_text_stays_text(hostile: dict[str, Any]) -> None:
    document = render_html(hostile)
    root = _assert_inert(document)
    text = root.text()
    for attack in XSS:
        assert attack in text
    body = document[document.index("<body>") : document.rindex("<script>")]
    for attack in ("<script", "<img", "</script", "<style", "<!--"):
        assert attack not in body
    # the hostile step (its name and its refusal) and the hostile call name are there
    assert "step " + HOSTILE in text
    (why,) = {r["why"] for b in hostile["batches"] for r in b["refused"] if "because" in r["why"]}
    assert why.startswith("because " + XSS[0])  # stored cut to MAX_WHY characters
    assert why in text
    assert "nope" + HOSTILE in text


def _poison(value: Any) -> Any:
    """Every string in a view replaced by an injection attempt (keys and types kept)."""
    if isinstance(value, dict):
        return {key: _poison(inner) for key, inner in value.items()}
    if isinstance(value, list):
        return [_poison(inner) for inner in value]
    if isinstance(value, str):
        return value + HOSTILE
    return value


def test_a_view_whose_every_string_is_hostile_renders_inert(demo: dict[str, Any]) -> None:
    poisoned = _poison(copy.deepcopy(demo))
    root = _assert_inert(render_html(poisoned))
    assert root.by_id("session-id").text() == demo["id"] + HOSTILE
    assert root.by_id("session-status").text() == demo["status"] + HOSTILE


def _one_message_session(text: str) -> tuple[Any, list[Batch[Any]]]:
    """Every string the page shows is ``text``: ids, names, contents, the step, the refusal."""
    call = ToolCallPart.of("c" + text, text, {"value": text, text: [text]})
    messages = [
        Message.user(text, id="u" + text),
        Message(role="assistant", parts=(TextPart(text), call), id="a" + text),
        Message(role="tool", parts=(ToolResultPart("c" + text, text, name=text),), id="t" + text),
    ]
    session = make_session(*messages, session_id=text, revision=2)
    batches: list[Batch[Any]] = [
        Batch(text, 1, text, 1, 1.0, (AppendMessage(messages[1]),), (Refusal(text, text),)),
        Batch(text, 2, "tools", 2, 2.0, (AppendMessage(messages[2]),)),
    ]
    return session, batches


def _shape(node: Node) -> list[tuple[str, tuple[str, ...]]]:
    return [(n.tag, tuple(sorted(n.attrs))) for n in node.iter()]


MARKUP = ['"', "'", "<", ">", "&", "=", " ", "/", "\n", "<script>", "-->", "&amp;", "x onclick=y"]
TEXTS = st.lists(st.one_of(st.text(max_size=8), st.sampled_from(MARKUP)), min_size=1, max_size=12)


@settings(max_examples=80, deadline=None)
@given(TEXTS.map("".join).filter(bool))
def test_no_text_breaks_out(text: str) -> None:
    session, batches = _one_message_session(text)
    root = parse(render_html(session_view(session, batches)))
    # the text as shown: the characters _visible names escaped (\r as \x0d), the rest as is
    shown = visible(text)
    assert shown in root.by_id("conversation").text()
    assert shown in root.by_id("rev-1").text()
    # the same elements and attributes as for a harmless text of the same lines
    plain = "".join(c if c == "\n" else "a" for c in shown)
    session, batches = _one_message_session(plain)
    assert _shape(root) == _shape(parse(render_html(session_view(session, batches))))


# -- the live view's hooks --------------------------------------------------------------------


def test_render_page_adds_the_live_script_and_allows_connecting_home(
    demo: dict[str, Any],
) -> None:
    document = render_page(demo, live_script="window.live = 1;")
    root = parse(document)
    scripts = [s.text(skip=frozenset()) for s in root.find_all("script")]
    assert scripts == [_asset("timeline.js"), "window.live = 1;"]
    (csp,) = [m for m in root.find_all("meta") if m.attrs.get("http-equiv")]
    assert "connect-src 'self'" in (csp.attrs["content"] or "")
    assert render_page(demo) == render_html(demo)
    with pytest.raises(ValueError, match="must not contain"):
        render_page(demo, live_script="x = '</script>';")


def test_a_long_session_grows_linearly(demo: dict[str, Any]) -> None:
    def scaled(copies: int) -> dict[str, Any]:
        view = dict(demo)
        view["batches"] = [
            {**batch, "revision": n * 100 + batch["revision"]}
            for n in range(copies)
            for batch in demo["batches"]
        ]
        return view

    small = len(render_html(scaled(10)))
    large = len(render_html(scaled(120)))
    per_batch = (large - small) / (110 * len(demo["batches"]))
    assert per_batch < 3000, per_batch


# -- the other effects ------------------------------------------------------------------------


class Shipped(Effect, frozen=True, tag="test.html.shipped"):
    """An application's effect: the timeline shows it generically."""

    parcel: str
    weight: int

    def apply(self, session: Session[Any]) -> Session[Any]:
        return session


def test_visibility_data_and_application_effects_are_shown() -> None:
    session = make_session("hello", "<b>again</b>", session_id="fx", revision=3)
    batches: list[Batch[Any]] = [
        Batch("fx", 1, "app", 0, 1.0, (SetVisibility(("u0", "u1"), to_model=False),)),
        Batch("fx", 2, "app", 0, 2.5, (UpdateData({"cwd": "/tmp/<x>", "n": 2}),)),
        Batch("fx", 3, "app", 0, 2.5, (Shipped("<img src=x>", 3),)),
    ]
    root = _assert_inert(render_html(session_view(session, batches)))
    visibility = root.by_id("rev-1")
    assert "hidden from the model" in visibility.text()
    assert {a.attrs["href"] for a in visibility.find_all("a", "ref")} == {"#msg-u0", "#msg-u1"}
    data = root.by_id("rev-2").text()
    assert '"cwd": "/tmp/<x>"' in data
    assert "+1,500.0 ms" not in data
    assert "+1.500 s" in data
    shipped = root.by_id("rev-3").text()
    assert "test.html.shipped" in shipped
    assert '"parcel": "<img src=x>"' in shipped
    assert '"weight": 3' in shipped
    assert "+0.0 ms" in shipped


def test_a_lone_surrogate_does_not_stop_the_export() -> None:
    session = make_session(Message.user("bad \ud800 text", id="u0"), session_id="s")
    document = render_html(session_view(session, []))
    document.encode("utf-8")  # what writing the file needs
    assert "bad ? text" in parse(document).by_id("msg-u0").text()
