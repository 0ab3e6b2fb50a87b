// stepmachine session timeline: the search box, and the live view's hook.
// Reads only the page's own markup; builds no markup from stored data.
(function () {
  "use strict";
  var nav = document.getElementById("search");
  var box = document.getElementById("search-box");
  var count = document.getElementById("search-count");
  var timeline = document.getElementById("timeline");
  var texts = new WeakMap();

  function textOf(element) {
    var text = texts.get(element);
    if (text === undefined) {
      text = element.textContent.toLowerCase();
      texts.set(element, text);
    }
    return text;
  }

  function apply(selector, query) {
    var items = document.querySelectorAll(selector);
    var shown = 0;
    for (var i = 0; i < items.length; i++) {
      var match = query === "" || textOf(items[i]).indexOf(query) !== -1;
      items[i].hidden = !match;
      if (match) shown++;
    }
    return [shown, items.length];
  }

  function filter() {
    var query = box.value.trim().toLowerCase();
    var batches = apply("#timeline > section.batch", query);
    var messages = apply("#conversation > article.msg", query);
    count.textContent = query === "" ? "" :
      batches[0] + " of " + batches[1] + " entries, " +
      messages[0] + " of " + messages[1] + " messages match";
  }

  function append(fragment) {
    var holder = document.createElement("template");
    holder.innerHTML = fragment;
    var entries = holder.content.querySelectorAll("section.batch");
    for (var i = 0; i < entries.length; i++) {
      if (!document.getElementById(entries[i].id)) timeline.appendChild(entries[i]);
    }
    filter();
  }

  box.addEventListener("input", filter);
  box.addEventListener("keydown", function (event) {
    if (event.key === "Escape") { box.value = ""; filter(); }
  });
  nav.hidden = false;
  window.stepmachineTimeline = { append: append, filter: filter };
})();
