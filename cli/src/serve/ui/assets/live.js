// Keel dashboard live updates: every element with data-live="URL" is re-fetched and its
// content replaced, at most once per POLL_MS, only while the tab is visible. After an
// error (a lapsed sign-in included) the wait doubles up to MAX_MS; a page stops polling
// after MAX_POLLS refreshes (about an hour) and says so. Open <details> stay open across
// refreshes.
(function () {
  "use strict";
  var POLL_MS = 5000, MAX_MS = 60000, MAX_POLLS = 720;
  var regions = document.querySelectorAll("[data-live]");
  if (!regions.length) return;
  var status = document.getElementById("live-status");
  var wait = POLL_MS, polls = 0;
  function say(text) { if (status) status.textContent = text; }
  function refresh(el) {
    var open = {};
    el.querySelectorAll("details[open][data-key]").forEach(function (d) { open[d.dataset.key] = true; });
    return fetch(el.dataset.live, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (r) {
        // An expired or revoked sign-in sends the fragment to the login form: say so
        // rather than show the form inside the panel.
        if (r.redirected || (r.url && new URL(r.url).pathname === "/ui/login")) {
          throw new Error("signed out; reload the page");
        }
        if (!r.ok) throw new Error("HTTP " + r.status);
        return r.text();
      })
      .then(function (html) {
        el.innerHTML = html;
        el.querySelectorAll("details[data-key]").forEach(function (d) { if (open[d.dataset.key]) d.open = true; });
      });
  }
  function tick() {
    if (polls >= MAX_POLLS) { say("Live updates stopped after an hour; reload the page to resume."); return; }
    if (document.hidden) { setTimeout(tick, POLL_MS); return; }
    polls += 1;
    Promise.all(Array.prototype.map.call(regions, refresh))
      .then(function () { wait = POLL_MS; say("Live: updated " + new Date().toLocaleTimeString()); })
      .catch(function (e) { wait = Math.min(wait * 2, MAX_MS); say("Live update failed (" + e.message + "); retrying in " + wait / 1000 + " s"); })
      .then(function () { setTimeout(tick, wait); });
  }
  setTimeout(tick, POLL_MS);
})();
// Forms that destroy or change many things ask first.
document.addEventListener("submit", function (e) {
  var q = e.target.getAttribute("data-confirm");
  if (q && !window.confirm(q)) e.preventDefault();
});
