// Live figures: an element with an id and data-live-refresh="SECONDS" is fetched again from the
// page's own URL every SECONDS. Where it marks parts (data-live-part, each with an id), only
// those are swapped in and the rest (a reader's focus, a selection, a copy button) stays; an
// element with no parts is swapped whole. Without JavaScript the page is the same, as of its
// last load.
(function () {
  "use strict";
  document.querySelectorAll("[data-live-refresh][id]").forEach(function (section) {
    var id = section.id;
    var seconds = Math.max(parseInt(section.dataset.liveRefresh, 10) || 5, 2);
    setInterval(function () {
      fetch(window.location.href, {headers: {"X-Requested-With": "refresh"}, credentials: "same-origin"})
        .then(function (response) { return response.ok ? response.text() : null; })
        .then(function (html) {
          if (!html) { return; }
          var fresh = new DOMParser().parseFromString(html, "text/html").getElementById(id);
          var current = document.getElementById(id);
          if (!fresh || !current) { return; }
          var parts = current.querySelectorAll("[data-live-part][id]");
          if (!parts.length) { current.replaceWith(fresh); return; }
          parts.forEach(function (part) {
            var next = fresh.querySelector("#" + CSS.escape(part.id));
            if (next) { part.replaceWith(next); }
          });
        })
        .catch(function () { /* the next tick tries again */ });
    }, seconds * 1000);
  });
}());
