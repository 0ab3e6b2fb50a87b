"""The session page's live script: follow the event stream, append the new entries.

Inline (no network, no CDN). It opens ``EventSource(events?after=REV&seq=N)``
at the revision the page was rendered at, appends each ``batch`` event's
``html`` (rendered and escaped by the server's ``render_batch``) to
``#timeline`` unless an element ``#rev-N`` is already there, writes the
``status`` into ``#session-status`` and the revision into
``#session-revision``, and shows ``live`` events' text in a ``<pre>`` (as
text) until the next batch. A badge ``#live-indicator`` says ``live``,
``reconnecting`` or ``closed``. Anything but the server's entry HTML goes in
with ``textContent``.

Reconnects: the browser's ``EventSource`` reconnects by itself and sends
``Last-Event-ID``; if it gives up (the server answered with an error), the
script opens a new one after a growing delay (1 s to 30 s), from the last
position it saw. ``window.stepmachineLive.reconnect()`` does that at once.
"""

from __future__ import annotations

import json
from typing import Any, Final

__all__ = ["LIVE_SCRIPT", "script_tag"]

CONFIG_ID: Final = "stepmachine-live"

LIVE_SCRIPT: Final = """
(function () {
  "use strict";
  var config = JSON.parse(document.getElementById("stepmachine-live").textContent);
  var timeline = document.getElementById("timeline");
  var position = {revision: config.revision, seq: 0};
  var source = null, timer = null, delay = 1000;

  var badge = document.createElement("div");
  badge.id = "live-indicator";
  badge.setAttribute("role", "status");
  badge.style.cssText = "position:fixed;top:.5rem;right:.5rem;padding:.1rem .6rem;" +
    "border-radius:1rem;font:12px system-ui,sans-serif;background:#eee;color:#333";
  document.body.appendChild(badge);
  var deltas = document.createElement("pre");
  deltas.id = "live-deltas";
  deltas.hidden = true;
  timeline.parentNode.insertBefore(deltas, timeline.nextSibling);

  function show(state) {
    badge.textContent = state;
    badge.setAttribute("data-state", state);
  }
  function setText(id, text) {
    var element = document.getElementById(id);
    if (element) { element.textContent = text; }
  }
  function onBatch(data) {
    position = {revision: data.revision, seq: 0};
    deltas.textContent = "";
    deltas.hidden = true;
    setText("session-revision", String(data.revision));
    if (document.getElementById("rev-" + data.revision)) { return; }
    var template = document.createElement("template");
    template.innerHTML = data.html;  // the server's render_batch output, escaped there
    timeline.appendChild(template.content);
  }
  function onStatus(data) {
    setText("session-status", String(data.status));
  }
  function onLive(data) {
    position = {revision: data.revision, seq: data.seq + 1};
    var text = "";
    if (data.kind === "text_delta" || data.kind === "reasoning_delta") { text = data.text; }
    else if (data.kind === "tool_started") { text = "\\n[" + data.name + " running]\\n"; }
    else if (data.kind === "tool_finished") {
      text = "\\n[" + data.name + (data.is_error ? " failed" : " finished") + "]\\n";
    }
    if (text) {
      deltas.hidden = false;
      deltas.textContent += text;
    }
  }
  function handler(callback) {
    return function (event) { callback(JSON.parse(event.data)); };
  }
  function connect() {
    timer = null;
    var url = config.events + "?after=" + position.revision + "&seq=" + position.seq;
    source = new EventSource(url);
    source.onopen = function () { delay = 1000; show("live"); };
    source.onerror = function () {
      if (source.readyState !== EventSource.CLOSED) { show("reconnecting"); return; }
      show("closed");
      if (timer === null) {
        timer = setTimeout(connect, delay);
        delay = Math.min(delay * 2, 30000);
      }
    };
    source.addEventListener("batch", handler(onBatch));
    source.addEventListener("status", handler(onStatus));
    source.addEventListener("live", handler(onLive));
  }
  function reconnect() {
    if (source) { source.close(); }
    if (timer !== null) { clearTimeout(timer); }
    show("reconnecting");
    connect();
  }
  window.stepmachineLive = {
    reconnect: reconnect,
    position: function () { return {revision: position.revision, seq: position.seq}; }
  };
  show("connecting");
  connect();
})();
"""


def script_tag(script: str, config: dict[str, Any]) -> str:
    """``script`` as an inline ``<script>``, after its ``config`` as a JSON data block.

    The JSON is escaped so that nothing in it can close the block (``<``,
    ``>`` and ``&`` become ``\\u`` escapes).
    """
    data = (
        json.dumps(config, separators=(",", ":"))
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
    )
    return (
        f'<script type="application/json" id="{CONFIG_ID}">{data}</script><script>{script}</script>'
    )
