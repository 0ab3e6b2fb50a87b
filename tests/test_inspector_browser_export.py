"""The exported HTML timeline in a real headless chromium (issue 12's must-show).

A session recorded through the public API (messages, reasoning, tool calls,
an approval, a failing tool, a compaction) is exported to a file and opened
from disk. Checked against the session's own data: every message and tool
call shows, ``<details>`` open on click, the search box hides what does not
match and shows everything again when cleared, the page requests nothing
but itself, and with JavaScript off every text is still there.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

import anyio
import pytest
from _html_sessions import XSS, record_demo, record_hostile
from browser import browser, page  # noqa: F401 - fixtures

from stepmachine.inspector import render_batch, render_html, session_view


def _record(path: Path) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        store, session_id = await record_demo(path)
        async with store:
            return session_view(await store.load(session_id), await store.batches(session_id))

    return anyio.run(main)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """(file URI of the exported page, the session's view)."""
    folder = tmp_path_factory.mktemp("export")
    # Its own thread: the browser fixture's event loop may be current in this one.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        view = pool.submit(_record, folder / "agent.sqlite3").result()
    out = folder / "session.html"
    out.write_text(render_html(view), encoding="utf-8")
    return out.as_uri(), view


def _parts(view: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [p for m in view["messages"] for p in m["parts"] if p["type"] == kind]


def _open(tab: Any, uri: str) -> tuple[list[str], list[str]]:
    """Go to ``uri``; returns the live lists of requested URLs and page errors."""
    requests: list[str] = []
    errors: list[str] = []
    tab.on("request", lambda request: requests.append(request.url))
    tab.on("pageerror", lambda error: errors.append(str(error)))
    tab.goto(uri)
    return requests, errors


def test_the_export_shows_every_message_and_tool_call_and_fetches_nothing(
    page: Any,  # noqa: F811 - the fixture
    exported: tuple[str, dict[str, Any]],
) -> None:
    uri, view = exported
    requests, errors = _open(page, uri)
    shown = page.inner_text("body")
    texts = [p["text"] for p in _parts(view, "text")]
    calls = _parts(view, "tool_call")
    results = _parts(view, "tool_result")
    assert len(texts) >= 5
    assert len(calls) >= 4
    for text in texts:
        assert text in shown
    for call in calls:
        assert call["name"] in shown
        assert call["call_id"] in shown
    for result in results:
        assert result["content"] in shown
    decision = next(c["decision"] for c in calls if c["decision"])
    assert f"by {decision['by']}" in shown
    assert decision["reason"] in shown
    timeline = page.inner_text("#timeline")
    for call in calls:
        assert call["name"] in timeline
    assert page.locator("#timeline > section.batch").count() == len(view["batches"])
    assert requests == [uri]
    assert errors == []


def test_collapsed_parts_open_on_click(
    page: Any,  # noqa: F811 - the fixture
    exported: tuple[str, dict[str, Any]],
) -> None:
    uri, view = exported
    _open(page, uri)
    (reasoning,) = _parts(view, "reasoning")
    details = page.locator("#conversation details.reasoning").first
    assert details.evaluate("element => element.open") is False
    assert reasoning["text"] not in details.inner_text()
    details.locator("summary").click()
    assert details.evaluate("element => element.open") is True
    assert reasoning["text"] in details.inner_text()
    refused = page.locator("#timeline details.refused").first
    why = view["batches"][0]["refused"][0]["why"]
    assert why not in refused.inner_text()
    refused.locator("summary").click()
    assert why in refused.inner_text()


def _entries(tab: Any) -> dict[str, tuple[bool, str]]:
    """Per timeline entry id: (shown, its text in lower case)."""
    rows = tab.locator("#timeline > section.batch").evaluate_all(
        "sections => sections.map(s => [s.id, s.getClientRects().length > 0,"
        " s.textContent.toLowerCase()])"
    )
    return {ident: (shown, text) for ident, shown, text in rows}


def test_the_search_box_filters_the_timeline(
    page: Any,  # noqa: F811 - the fixture
    exported: tuple[str, dict[str, Any]],
) -> None:
    uri, view = exported
    _open(page, uri)
    name = next(c["name"] for c in _parts(view, "tool_call") if c["state"] == "error")
    about_it = {
        f"rev-{b['revision']}"
        for b in view["batches"]
        for e in b["effects"]
        if e["type"] == "append_message"
        for p in e["message"]["parts"]
        if p.get("name") == name
    }
    assert about_it
    assert page.locator("#search-box").is_visible()
    assert all(shown for shown, _ in _entries(page).values())

    page.fill("#search-box", name.upper())
    entries = _entries(page)
    visible = {ident for ident, (shown, _) in entries.items() if shown}
    assert about_it <= visible
    assert visible == {ident for ident, (_, text) in entries.items() if name in text}
    assert len(visible) < len(entries)
    assert f"{len(visible)} of {len(entries)} entries" in page.inner_text("#search-count")
    messages = page.locator("#conversation > article.msg")
    assert 0 < sum(1 for m in messages.all() if m.is_visible()) < messages.count()

    page.fill("#search-box", "")
    assert all(shown for shown, _ in _entries(page).values())
    assert all(m.is_visible() for m in messages.all())
    assert page.inner_text("#search-count") == ""


def test_without_javascript_every_text_is_still_there(
    browser: Any,  # noqa: F811 - the fixture
    exported: tuple[str, dict[str, Any]],
) -> None:
    uri, view = exported
    context = browser.new_context(java_script_enabled=False)
    try:
        static = context.new_page()
        static.set_default_timeout(15_000)
        requests, _ = _open(static, uri)
        assert not static.locator("#search").is_visible()
        content = static.locator("body").evaluate("body => body.textContent")
        shown = static.inner_text("body")
        for part in _parts(view, "text") + _parts(view, "reasoning"):
            assert part["text"] in content
        for part in _parts(view, "text"):
            assert part["text"] in shown
        for call in _parts(view, "tool_call"):
            assert call["name"] in shown
        reasoning = static.locator("#conversation details.reasoning").first
        reasoning.locator("summary").click()
        (part,) = _parts(view, "reasoning")
        assert part["text"] in reasoning.inner_text()
        assert requests == [uri]
    finally:
        context.close()


def test_a_hostile_session_runs_no_script_and_fetches_nothing(
    page: Any,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        view = pool.submit(anyio.run, record_hostile, tmp_path / "hostile.sqlite3").result()
    out = tmp_path / "hostile.html"
    out.write_text(render_html(view), encoding="utf-8")
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    requests, errors = _open(page, out.as_uri())
    page.locator("details").evaluate_all("all => all.forEach(d => { d.open = true; })")
    shown = page.inner_text("body")
    for attack in XSS:
        assert attack in shown
    assert page.locator("img, iframe, object, embed").count() == 0
    assert page.locator("script").count() == 1
    assert dialogs == []
    assert errors == []
    assert requests == [out.as_uri()]


def test_the_live_view_hook_appends_entries_once(
    page: Any,  # noqa: F811 - the fixture
    exported: tuple[str, dict[str, Any]],
) -> None:
    uri, view = exported
    _open(page, uri)
    last = view["batches"][-1]
    extra = {**last, "revision": last["revision"] + 1, "step": "appended_live"}
    fragment = render_batch(extra)
    append = "html => window.stepmachineTimeline.append(html)"
    page.evaluate(append, fragment)
    page.evaluate(append, fragment)  # a replay after a reconnect adds nothing
    page.evaluate(append, render_batch(last))
    ids = page.locator("#timeline > section.batch").evaluate_all("all => all.map(s => s.id)")
    assert ids == [f"rev-{b['revision']}" for b in view["batches"]] + [f"rev-{extra['revision']}"]
    page.fill("#search-box", "appended_live")
    assert [i for i, (shown, _) in _entries(page).items() if shown] == [ids[-1]]
    page.evaluate(append, render_batch({**extra, "revision": extra["revision"] + 1}))
    shown_now = [i for i, (shown, _) in _entries(page).items() if shown]
    assert shown_now == [ids[-1], f"rev-{extra['revision'] + 1}"]


def test_markup_that_slipped_in_would_not_run(
    page: Any,  # noqa: F811 - the fixture
    exported: tuple[str, dict[str, Any]],
    tmp_path: Path,
) -> None:
    """Defence in depth: the page's policy allows only its own script, by hash."""
    _, view = exported
    injected = (
        "<script>window.pwned = 1; alert(1)</script>"
        '<img src="pixel.png" onerror="window.pwned = 2; alert(2)">'
        '<div onclick="alert(3)" id="bait">bait</div>'
    )
    out = tmp_path / "injected.html"
    out.write_text(render_html(view).replace("<main>", "<main>" + injected, 1), encoding="utf-8")
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    blocked: list[tuple[str, str]] = []
    page.on("requestfailed", lambda request: blocked.append((request.url, request.failure)))
    loaded: list[str] = []
    page.on("response", lambda response: loaded.append(response.url))
    requests, _ = _open(page, out.as_uri())
    page.click("#bait")
    assert page.evaluate("() => window.pwned") is None
    assert dialogs == []
    assert loaded == [out.as_uri()]
    # chromium reports the image's request, then blocks it for the policy
    assert requests == [out.as_uri(), (tmp_path / "pixel.png").as_uri()]
    assert blocked == [((tmp_path / "pixel.png").as_uri(), "csp")]
    assert page.locator("#search-box").is_visible()  # the page's own script ran
