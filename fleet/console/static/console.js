// The console's pages, live: a server-sent event "changed" re-fetches the page's live part
// (server-rendered, escaped) and the charts' data; "health" shows a stale broker or a database
// that refuses writes. No inline script (the Content-Security-Policy forbids it).
"use strict";
(function () {
  const live = document.getElementById("live");
  const health = document.getElementById("health");
  const conn = document.getElementById("conn");
  let fetching = false, again = false, range = "hour";
  const charts = {};

  function ages() {
    const now = Date.now() / 1000;
    for (const el of document.querySelectorAll(".age[data-ts]")) {
      const ts = parseFloat(el.dataset.ts);
      if (!ts) continue;
      const s = Math.max(0, now - ts);
      el.textContent = s < 120 ? s.toFixed(0) + " s" : s < 7200 ? (s / 60).toFixed(0) + " min" : (s / 3600).toFixed(1) + " h";
    }
  }

  async function refresh() {
    if (fetching) { again = true; return; }
    fetching = true;
    try {
      if (live) {
        const r = await fetch("/fragment" + location.pathname + location.search, {credentials: "same-origin"});
        if (r.ok) live.innerHTML = await r.text();
      }
      await loadCharts();
      ages();
      document.body.dataset.refreshed = String(Date.now());
    } catch (e) { /* the next event tries again */ }
    fetching = false;
    if (again) { again = false; refresh(); }
  }

  async function loadCharts() {
    const box = document.getElementById("charts");
    if (!box || typeof uPlot === "undefined") return;
    const r = await fetch(box.dataset.series + "?range=" + range, {credentials: "same-origin"});
    if (!r.ok) return;
    const data = await r.json();
    for (const c of data.charts) {
      const cols = [data.series.t].concat(c.keys.map(k => data.series[k]));
      let ch = charts[c.title];
      if (!ch) {
        const div = document.createElement("div");
        div.className = "chart";
        div.dataset.title = c.title;
        box.appendChild(div);
        const palette = ["#1a56a0", "#b00020", "#186a2e", "#a06000", "#6a1a8a", "#444"];
        ch = charts[c.title] = new uPlot({
          title: c.title, width: 420, height: 200,
          series: [{}].concat(c.keys.map((k, i) => ({label: data.labels[k], stroke: palette[i % palette.length], spanGaps: true}))),
          axes: [{}, {size: 64}],
        }, cols, div);
      } else {
        ch.setData(cols);
      }
      ch.root.dataset.points = String(data.series.t.length);
    }
  }

  for (const a of document.querySelectorAll("#charts-range a")) {
    a.addEventListener("click", ev => {
      ev.preventDefault();
      range = a.dataset.range;
      for (const b of document.querySelectorAll("#charts-range a")) b.classList.toggle("here", b === a);
      loadCharts();
    });
  }

  function clock(ts) { return new Date(ts * 1000).toLocaleString(); }

  const es = new EventSource("/events");
  es.addEventListener("changed", refresh);
  es.addEventListener("health", ev => {
    const h = JSON.parse(ev.data);
    const parts = [];
    if (h.stale_since) parts.push("Broker connection lost: the data is stale since " + clock(h.stale_since) + ".");
    if (h.db_error) parts.push(h.db_error);
    health.textContent = parts.join(" ");
    health.className = parts.length ? "warn" : "hidden";
  });
  // close it when leaving: an open stream holds one of the browser's few connections to the host
  window.addEventListener("pagehide", () => es.close());
  es.onopen = () => { conn.textContent = "live"; };
  es.onerror = () => { conn.textContent = "console unreachable: retrying"; };
  setInterval(ages, 1000);
  loadCharts();
})();
