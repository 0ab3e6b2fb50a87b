"""The session page's live script: follow the event stream, append the new entries.

Inline (no network, no CDN), passed to ``render_page(view, live_script=...)``,
which runs it after the page's own script. It opens ``EventSource(events?after=REV&seq=N)``
at the revision the page was rendered at, appends each ``batch`` event's
``html`` (rendered and escaped by the server's ``render_batch``) to
``#timeline`` (through the page's ``window.stepmachineTimeline.append``
when there is one) unless an element ``#rev-N`` is already there, writes the
``status`` into ``#session-status`` and the revision into
``#session-revision``, puts each ``head`` event's header and conversation
(rendered and escaped by the server's ``render_head``) in place of
``#session`` and ``#conversation`` (so the counters and the conversation
follow the timeline), and shows ``live`` events' text in a ``<pre>`` (as
text) until the next batch. A badge ``#live-indicator`` says ``live``,
``reconnecting`` or ``closed``. Anything but the server's entry HTML goes in
with ``textContent``, through ``visible()`` (:func:`~._visible.visible_js`:
bidirectional controls, zero-width characters and controls shown escaped, as
the server's HTML shows them).

Reconnects: the browser's ``EventSource`` reconnects by itself and sends
``Last-Event-ID``; if it gives up (the server answered with an error), the
script opens a new one after a growing delay (1 s to 30 s), from the last
position it saw. ``window.stepmachineLive.reconnect()`` does that at once.
"""

from __future__ import annotations

import json
from typing import Final

from ._visible import visible_js

__all__ = ["live_script"]

_SCRIPT: Final = """
(function (config) {
  "use strict";
  var timeline = document.getElementById("timeline");
  var position = {revision: config.revision, seq: 0};
  var source = null, timer = null, delay = 1000;
  __VISIBLE__

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
    // data.html is the server's render_batch output, escaped there.
    if (window.stepmachineTimeline) { window.stepmachineTimeline.append(data.html); return; }
    var template = document.createElement("template");
    template.innerHTML = data.html;
    timeline.appendChild(template.content);
  }
  function replace(id, markup) {
    // markup is the server's render_head output, escaped there.
    var element = document.getElementById(id);
    var template = document.createElement("template");
    template.innerHTML = markup;
    var fresh = template.content.firstElementChild;
    if (element && fresh && fresh.id === id) { element.replaceWith(fresh); }
  }
  function onHead(data) {
    if (data.revision < position.revision) { return; }  // an older stream's
    replace("session", data.header);
    replace("conversation", data.conversation);
    if (window.stepmachineTimeline) { window.stepmachineTimeline.filter(); }
  }
  function onStatus(data) {
    setText("session-status", visible(data.status));
  }
  function onLive(data) {
    position = {revision: data.revision, seq: data.seq + 1};
    var text = "";
    if (data.kind === "text_delta" || data.kind === "reasoning_delta") {
      text = visible(data.text);
    }
    else if (data.kind === "tool_started") { text = "\\n[" + visible(data.name) + " running]\\n"; }
    else if (data.kind === "tool_finished") {
      text = "\\n[" + visible(data.name) + (data.is_error ? " failed" : " finished") + "]\\n";
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
    source.addEventListener("head", handler(onHead));
    source.addEventListener("live", handler(onLive));
    source.addEventListener("reset", function () {
      // The session is not the one this page shows (recreated, restored): start over.
      source.close();
      show("reloading");
      window.location.reload();
    });
    source.addEventListener("failure", handler(function (data) {
      // The store could not be read: reconnecting would read the same records again.
      source.close();
      show("stopped");
      deltas.hidden = false;
      deltas.textContent = "The store could not be read: " + visible(data.message);
    }));
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
})(__CONFIG__);
"""


def live_script(events_url: str, revision: int) -> str:
    """The script for a page rendered at ``revision``, following ``events_url``.

    The settings go in as JSON whose ``<``, ``>`` and ``&`` are escaped, so the
    script never holds ``</`` (it could not end its element).
    """
    config = json.dumps({"events": events_url, "revision": revision}, separators=(",", ":"))
    for character, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026")):
        config = config.replace(character, escape)
    return _SCRIPT.replace("__VISIBLE__", visible_js()).replace("__CONFIG__", config)
