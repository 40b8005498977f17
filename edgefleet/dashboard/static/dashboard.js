// EdgeFleet dashboard. Device ids, reasons and any other value in fleet.json or
// metrics.jsonl are device input: they reach the page only as text (textContent, text
// nodes, uPlot's own labels), never as markup.
"use strict";

const COLORS = ["#2f6fde", "#e0662f", "#2a9d5b", "#9b4fd0", "#c9a400", "#d0487a", "#1fa3b5", "#7a5c3e"];
const KNOWN = ["device", "node", "online", "battery", "participations", "last_trained", "last_seen", "declines", "unreachable", "rejections"];
const LABELS = { device: "device", node: "node", online: "online", battery: "battery", participations: "participations", last_trained: "last trained", last_seen: "last seen", declines: "declines", unreachable: "unreachable", rejections: "last rejections (round: reason)" };
const MAX_TEXT = 200;
const MAX_PINNED = 6;
// The fleet table shows one page of rows: at 1,000 devices and 16 columns, building and laying
// out every cell on each refresh took most of the page's first render.
const PAGE_SIZES = [100, 500, 0]; // 0: all

const state = { fleet: {}, rows: [], summary: {}, batteries: null, sort: { key: "device", dir: 1 }, pinned: new Set(), batterySeen: new Map(), charts: {}, filter: "", page: 0, pageSize: 100 };

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function num(v) { return typeof v === "number" && Number.isFinite(v) ? v : null; }

function short(v) {
  const s = String(v);
  return s.length > MAX_TEXT ? s.slice(0, MAX_TEXT) + "…" : s;
}

function fmt(v, digits) {
  if (v === null || v === undefined) return "";
  if (typeof v === "boolean") return v ? "yes" : "no";
  if (typeof v === "number") {
    if (!Number.isFinite(v)) return "";
    return Number.isInteger(v) ? String(v) : v.toFixed(digits === undefined ? 3 : digits);
  }
  if (Array.isArray(v)) return short(v.map((x) => (typeof x === "object" ? JSON.stringify(x) : String(x))).join(", "));
  if (typeof v === "object") return short(JSON.stringify(v));
  return short(v);
}

function naturalCompare(a, b) {
  return String(a).localeCompare(String(b), undefined, { numeric: true });
}

async function getJSON(path) {
  const r = await fetch(path, { credentials: "same-origin", cache: "no-store" });
  if (!r.ok) throw new Error(path + ": HTTP " + r.status);
  return r.json();
}

// --- data ---------------------------------------------------------------------------------

function flatDevice(d) {
  // One level of nesting flattened (telemetry.cpu_temp -> telemetry.cpu_temp), as /metrics does.
  const out = {};
  for (const [k, v] of Object.entries(d)) {
    if (v && typeof v === "object" && !Array.isArray(v) && k !== "rejections") {
      for (const [k2, v2] of Object.entries(v)) out[k + "." + k2] = v2;
    } else out[k] = v;
  }
  return out;
}

function extraColumns(devices) {
  const keys = new Set();
  for (const d of devices) for (const k of Object.keys(d)) if (!KNOWN.includes(k)) keys.add(k);
  return [...keys].sort().slice(0, 40);
}

function noteBatteries(fleet) {
  const round = num(fleet.round);
  if (round === null || !Array.isArray(fleet.devices)) return;
  const levels = {};
  for (const d of fleet.devices) { const b = num(d.battery); if (b !== null) levels[String(d.device)] = b; }
  state.batterySeen.set(round, levels);
}

function batteryHistory() {
  // batteries.jsonl, as /api/batteries summarizes it; for a run folder without one (written
  // before it existed): the fleet.json snapshots this page has seen since it was opened.
  const b = state.batteries;
  if (b && Array.isArray(b.rounds) && b.rounds.length) {
    return { source: "from batteries.jsonl (" + b.rounds.length + " rounds)", rounds: b.rounds, mean: b.mean, min: b.min, max: b.max, device: (d) => (b.devices && b.devices[d]) || [] };
  }
  const points = [...state.batterySeen.entries()].sort((a, b) => a[0] - b[0]);
  const stat = (f) => points.map((p) => { const v = Object.values(p[1]).map(num).filter((x) => x !== null); return v.length ? f(v) : null; });
  return {
    source: "from the fleet.json snapshots this page has seen since it opened (" + points.length + "); this run folder has no batteries.jsonl",
    rounds: points.map((p) => p[0]),
    mean: stat((v) => v.reduce((a, b) => a + b, 0) / v.length), min: stat((v) => Math.min(...v)), max: stat((v) => Math.max(...v)),
    device: (d) => points.map((p) => num(p[1][d])),
  };
}

function batteriesPath() {
  const q = [...state.pinned].sort(naturalCompare).map((d) => "device=" + encodeURIComponent(d)).join("&");
  return "api/batteries" + (q ? "?" + q : "");
}

async function loadBatteries() {
  try { state.batteries = await getJSON(batteriesPath()); } catch (err) { state.batteries = null; }
}

// --- charts ---------------------------------------------------------------------------------

// Reading an element's width makes the browser lay out the page as it stands: read the four
// charts' widths once, before anything is drawn, not once per chart after the tables are built.
function chartWidths() {
  const widths = {};
  for (const id of ["chart-accuracy", "chart-loss", "chart-stopping", "chart-battery", "chart-async"]) {
    if (!state.charts[id]) widths[id] = Math.max(300, document.getElementById(id).clientWidth || 500);
  }
  return widths;
}

function chart(id, series, data, opts, widths) {
  const box = document.getElementById(id);
  const width = widths[id] || 500;
  const shape = series.map((s) => s.label).join("|");
  const old = state.charts[id];
  if (old && old.shape === shape) { old.plot.setData(data); return; }
  if (old) old.plot.destroy();
  box.textContent = "";
  const plot = new uPlot({
    width, height: 220,
    scales: { x: { time: false } },
    legend: { live: false },
    axes: [{ label: "round", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000] }, { label: (opts && opts.yLabel) || "" }],
    series: [{ label: "round" }].concat(series.map((s, i) => Object.assign({ stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true, points: { show: data[0].length < 60 } }, s))),
  }, data, box);
  state.charts[id] = { plot, shape };
}

function columnSeries(rows, defs) {
  const xs = rows.map((r) => r.round);
  const data = [xs], series = [];
  for (const [label, get, extra] of defs) {
    const ys = rows.map((r) => num(get(r)));
    if (ys.some((y) => y !== null)) { series.push(Object.assign({ label }, extra || {})); data.push(ys); }
  }
  return { data, series };
}

function federatedKeys(rows, word) {
  const keys = new Set();
  for (const r of rows) if (r.federated && typeof r.federated === "object") for (const k of Object.keys(r.federated)) if (k.includes(word)) keys.add(k);
  return [...keys].sort().slice(0, 4);
}

function lastPoint(data, si) {
  for (let i = data[0].length - 1; i >= 0; i--) if (data[si][i] !== null && data[si][i] !== undefined) return [data[0][i], data[si][i]];
  return null;
}

function caption(id, series, data) {
  const box = document.getElementById(id);
  box.textContent = "";
  series.forEach((s, i) => {
    const p = lastPoint(data, i + 1);
    if (!p) return;
    const span = el("span", s.label + " " + fmt(p[1], 4) + " (round " + p[0] + ")  ");
    span.dataset.series = s.label; span.dataset.round = p[0]; span.dataset.value = p[1];
    box.appendChild(span);
  });
}

function drawCharts() {
  const rows = state.rows.filter((r) => num(r.round) !== null);
  // An asynchronous run's rows (one a version) carry staleness and in_flight: its panel is
  // shown before the widths are read, so that it is drawn at its own width.
  const asynchronous = rows.some((r) => num(r.staleness_max) !== null || num(r.in_flight) !== null);
  document.getElementById("async-figure").hidden = !asynchronous;
  const widths = chartWidths();
  const fed = (k) => (r) => (r.federated ? r.federated[k] : null);
  let acc = columnSeries(rows, [["test_accuracy", (r) => r.test_accuracy], ["test_balanced_accuracy", (r) => r.test_balanced_accuracy], ["session_accuracy", (r) => r.session_accuracy]].concat(federatedKeys(rows, "acc").map((k) => ["federated " + k, fed(k)])));
  chart("chart-accuracy", acc.series, acc.data, { yLabel: "accuracy" }, widths);
  caption("accuracy-last", acc.series, acc.data);
  let loss = columnSeries(rows, [["test_loss", (r) => r.test_loss], ["train_loss", (r) => r.train_loss]].concat(federatedKeys(rows, "loss").map((k) => ["federated " + k, fed(k)])));
  chart("chart-loss", loss.series, loss.data, { yLabel: "loss" }, widths);
  caption("loss-last", loss.series, loss.data);

  const tau = num(state.fleet.stopping_tau);
  const stop = columnSeries(rows, [["task_vector_growth", (r) => r.task_vector_growth], ["tau", () => tau, { dash: [6, 4] }]]);
  chart("chart-stopping", stop.series, stop.data, { yLabel: "relative growth" }, widths);
  const growth = num(state.fleet.task_vector_growth);
  const box = document.getElementById("stopping-last");
  box.textContent = stop.series.length ? "last growth " + fmt(growth !== null ? growth : (lastPoint(stop.data, 1) || [0, null])[1], 5) + (tau !== null ? ", tau " + fmt(tau, 5) : "") : "(stopping.mode off: no signal)";

  if (asynchronous) {
    const as = columnSeries(rows, [["staleness_median", (r) => r.staleness_median], ["staleness_max", (r) => r.staleness_max, { dash: [4, 4] }], ["in_flight", (r) => r.in_flight]]);
    chart("chart-async", as.series, as.data, { yLabel: "versions / devices" }, widths);
    caption("async-last", as.series, as.data);
  }

  const hist = batteryHistory();
  document.getElementById("battery-source").textContent = hist.source;
  const bSeries = [{ label: "mean" }, { label: "min", dash: [4, 4] }, { label: "max", dash: [4, 4] }];
  const bData = [hist.rounds, hist.mean.map(num), hist.min.map(num), hist.max.map(num)];
  for (const d of [...state.pinned].sort(naturalCompare)) {
    bSeries.push({ label: "device " + short(d) });
    bData.push(hist.device(d).map(num));
  }
  chart("chart-battery", bSeries, bData, { yLabel: "battery" }, widths);
}

// --- tables ---------------------------------------------------------------------------------

function drawFleet() {
  const devices = (state.fleet.devices || []).map(flatDevice);
  const cols = KNOWN.concat(extraColumns(devices));
  const head = document.querySelector("#fleet thead tr");
  head.textContent = "";
  for (const c of cols) {
    const th = el("th", LABELS[c] || c.replace(/_/g, " "));
    th.dataset.col = c;
    if (state.sort.key === c) th.className = state.sort.dir > 0 ? "sorted-asc" : "sorted-desc";
    head.appendChild(th);
  }
  const f = state.filter.toLowerCase();
  const shown = devices.filter((d) => !f || String(d.device).toLowerCase().includes(f));
  const { key, dir } = state.sort;
  shown.sort((a, b) => {
    const x = a[key], y = b[key];
    if (x === y) return naturalCompare(a.device, b.device);
    if (x === null || x === undefined) return 1;
    if (y === null || y === undefined) return -1;
    if (typeof x === "number" && typeof y === "number") return dir * (x - y);
    if (typeof x === "boolean" && typeof y === "boolean") return dir * (Number(x) - Number(y));
    return dir * naturalCompare(fmt(x), fmt(y));
  });
  const size = state.pageSize || Math.max(1, shown.length);
  const pages = Math.max(1, Math.ceil(shown.length / size));
  state.page = Math.min(Math.max(0, state.page), pages - 1);
  const first = state.page * size;
  const body = document.createDocumentFragment();
  for (const d of shown.slice(first, first + size)) {
    const tr = el("tr");
    const id = String(d.device);
    tr.dataset.device = id;
    if (state.pinned.has(id)) tr.className = "pinned";
    for (const c of cols) {
      const v = d[c];
      const td = el("td");
      td.dataset.col = c;
      if (c === "online") { td.textContent = v === true ? "online" : v === false ? "offline" : ""; td.className = v ? "on" : "off"; }
      else if (c === "rejections") {
        for (const r of Array.isArray(v) ? v : []) td.appendChild(el("span", (r && r.round !== undefined ? r.round + ": " : "") + short(r && r.reason !== undefined ? r.reason : r), "reason"));
      } else {
        td.textContent = c === "battery" && num(v) !== null ? v.toFixed(2) : fmt(v, 3);
        if (typeof v === "number") td.className = "num";
      }
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
  const tbody = document.querySelector("#fleet tbody");
  tbody.textContent = "";
  tbody.appendChild(body);
  const online = devices.filter((d) => d.online === true).length;
  document.getElementById("fleet-count").textContent = devices.length + " devices, " + online + " online" + (shown.length !== devices.length ? ", " + shown.length + " shown" : "");
  const last = Math.min(shown.length, first + size);
  document.getElementById("page-info").textContent = shown.length ? "rows " + (first + 1) + "–" + last + " of " + shown.length : "no rows";
  document.getElementById("page-prev").disabled = state.page === 0;
  document.getElementById("page-next").disabled = state.page >= pages - 1;
}

// One listener for each part of the table, not one per row: the rows are rebuilt on every
// refresh, and a listener per row was that many closures to make and collect each time.
function fleetControls() {
  document.querySelector("#fleet thead").addEventListener("click", (e) => {
    const th = e.target.closest("th");
    if (!th || th.dataset.col === undefined) return;
    const c = th.dataset.col;
    state.sort = { key: c, dir: state.sort.key === c ? -state.sort.dir : 1 };
    state.page = 0;
    drawFleet();
  });
  document.querySelector("#fleet tbody").addEventListener("click", (e) => {
    const tr = e.target.closest("tr");
    if (!tr || tr.dataset.device === undefined) return;
    const id = tr.dataset.device;
    if (state.pinned.has(id)) state.pinned.delete(id);
    else if (state.pinned.size < MAX_PINNED) state.pinned.add(id);
    drawFleet();
    loadBatteries().then(drawCharts);
  });
  document.getElementById("filter").addEventListener("input", (e) => { state.filter = e.target.value; state.page = 0; drawFleet(); });
  const sizes = document.getElementById("page-size");
  for (const n of PAGE_SIZES) {
    const o = el("option", n ? String(n) : "all");
    o.value = String(n);
    sizes.appendChild(o);
  }
  sizes.value = String(state.pageSize);
  sizes.addEventListener("change", () => { state.pageSize = Number(sizes.value); state.page = 0; drawFleet(); });
  document.getElementById("page-prev").addEventListener("click", () => { state.page--; drawFleet(); });
  document.getElementById("page-next").addEventListener("click", () => { state.page++; drawFleet(); });
}

function drawReasons() {
  const byReason = new Map();
  for (const r of state.rows) for (const x of Array.isArray(r.rejected) ? r.rejected : []) {
    const reason = short(x && x.reason !== undefined ? x.reason : x);
    const e = byReason.get(reason) || { n: 0, devices: new Set(), last: null };
    e.n++; if (x && x.device !== undefined) e.devices.add(String(x.device)); e.last = r.round;
    byReason.set(reason, e);
  }
  const tbody = document.querySelector("#reasons tbody");
  tbody.textContent = "";
  const list = [...byReason.entries()].sort((a, b) => b[1].n - a[1].n);
  const top = list.length ? list[0][1].n : 1;
  for (const [reason, e] of list.slice(0, 100)) {
    const tr = el("tr");
    const cell = el("td"); cell.appendChild(el("span", reason, "reason")); tr.appendChild(cell);
    const n = el("td", null, "num"); const bar = el("span", null, "bar"); bar.style.width = Math.max(2, 80 * e.n / top) + "px"; n.appendChild(bar); n.appendChild(document.createTextNode(String(e.n))); tr.appendChild(n);
    tr.appendChild(el("td", short([...e.devices].sort(naturalCompare).join(", "))));
    tr.appendChild(el("td", e.last, "num"));
    tbody.appendChild(tr);
  }
  const declined = state.rows.reduce((a, r) => a + (Array.isArray(r.declined) ? r.declined.length : 0), 0);
  const unreachable = state.rows.reduce((a, r) => a + (Array.isArray(r.unreachable) ? r.unreachable.length : 0), 0);
  document.getElementById("reasons-empty").textContent = (list.length ? "" : "No reply was rejected. ") + declined + " train messages declined, " + unreachable + " to unreachable devices.";
}

function drawSessions() {
  const sessions = new Map();
  for (const r of state.rows) {
    const s = r.session === undefined || r.session === null ? 1 : r.session;
    const e = sessions.get(s) || { rows: 0, first: r.round, last: r.round, aux: 0, best: null, weights: null };
    e.rows++; e.last = r.round; if (r.phase === "aux") e.aux++;
    const a = num(r.session_accuracy); if (a !== null && (e.best === null || a > e.best)) e.best = a;
    if (r.warmstart_weights && (Array.isArray(r.warmstart_weights) ? r.warmstart_weights.length : Object.keys(r.warmstart_weights).length)) e.weights = r.warmstart_weights;
    sessions.set(s, e);
  }
  const timeline = document.getElementById("timeline");
  const tbody = document.querySelector("#sessions tbody");
  timeline.textContent = ""; tbody.textContent = "";
  const total = state.rows.length || 1;
  let i = 0;
  for (const [s, e] of sessions) {
    const block = el("div", "session " + fmt(s), e.aux === e.rows ? "aux" : "");
    block.style.width = (100 * e.rows / total) + "%";
    block.style.background = COLORS[i++ % COLORS.length];
    block.title = "session " + fmt(s) + ": rounds " + e.first + "–" + e.last;
    timeline.appendChild(block);
    const tr = el("tr");
    let weights = "";
    if (e.weights && !Array.isArray(e.weights)) weights = Object.entries(e.weights).map(([k, v]) => short(k) + ": " + fmt(v, 3)).join(", ");
    else if (e.weights) weights = fmt(e.weights);
    for (const v of ["" + fmt(s), e.rows + (e.aux ? " (" + e.aux + " aux)" : ""), e.first, e.last, fmt(e.best, 3), weights]) tr.appendChild(el("td", v));
    tbody.appendChild(tr);
  }
  document.getElementById("sessions-empty").textContent = sessions.size > 1 ? "" : "One session (sessions.schedule none, or the first session still running).";
}

function drawSummary() {
  const f = state.fleet, rows = state.rows, last = rows.length ? rows[rows.length - 1] : {};
  const s = state.summary.summary || {};
  const accepted = rows.reduce((a, r) => a + (Array.isArray(r.participants) ? r.participants.length : 0), 0);
  const rejected = rows.reduce((a, r) => a + (Array.isArray(r.rejected) ? r.rejected.length : 0), 0);
  const up = rows.reduce((a, r) => a + (num(r.bytes_up) || 0), 0), down = rows.reduce((a, r) => a + (num(r.bytes_down) || 0), 0);
  const cards = [
    ["round", f.round !== undefined ? f.round : last.round],
    ["session", f.session !== undefined ? f.session : last.session],
    ["phase", f.phase],
    ["test accuracy", fmt(num(f.test_accuracy) !== null ? f.test_accuracy : last.test_accuracy, 4)],
    ["accepted replies", accepted],
    ["rejected replies", rejected],
    ["MB up / down", (up / 1e6).toFixed(1) + " / " + (down / 1e6).toFixed(1)],
    ["selected this round", Array.isArray(f.selected) ? f.selected.length : ""],
    ["in flight", num(last.in_flight) !== null ? last.in_flight : ""],
  ];
  const box = document.getElementById("summary");
  box.textContent = "";
  for (const [label, value] of cards) {
    if (value === undefined || value === null || value === "") continue;
    const c = el("div", null, "card"); c.dataset.card = label;
    c.appendChild(el("b", fmt(value))); c.appendChild(el("span", label));
    box.appendChild(c);
  }
  document.getElementById("run-name").textContent = state.summary.run || "";
  const when = num(f.written_at);
  let text = rows.length ? rows.length + " rounds in metrics.jsonl" : "waiting for the first round";
  if (s.stop_reason !== undefined || s.rounds_run !== undefined) text += "; finished" + (s.stop_reason ? ": " + short(s.stop_reason) : "") + (num(s.final_accuracy) !== null ? ", final accuracy " + fmt(s.final_accuracy, 4) : "");
  else if (when !== null) text += "; fleet.json written " + new Date(when * 1000).toLocaleTimeString();
  document.getElementById("run-state").textContent = text;
  document.body.dataset.round = f.round !== undefined ? f.round : "";
  document.body.dataset.rows = rows.length;
}

// --- refresh ---------------------------------------------------------------------------------

let refreshing = null, again = false;
async function refresh() {
  if (refreshing) { again = true; return refreshing; }
  refreshing = (async () => {
    try {
      const [fleet, rows, summary, batteries] = await Promise.all([getJSON("api/fleet"), getJSON("api/rounds"), getJSON("api/summary"), getJSON(batteriesPath()).catch(() => null)]);
      state.fleet = fleet; state.rows = Array.isArray(rows) ? rows : []; state.summary = summary; state.batteries = batteries;
      noteBatteries(fleet);
      // The charts first: they read the layout (their widths) before the tables change it.
      drawSummary(); drawCharts(); drawFleet(); drawReasons(); drawSessions();
      document.getElementById("footer").textContent = "updated " + new Date().toLocaleTimeString() + " (refreshes by itself when a round lands)";
      document.body.dataset.ready = "1";
    } catch (err) {
      document.getElementById("run-state").textContent = "could not read the run: " + err.message;
    } finally {
      refreshing = null;
      if (again) { again = false; refresh(); }
    }
  })();
  return refreshing;
}

function listen() {
  if (!window.EventSource) { setInterval(refresh, 5000); return; }
  const events = new EventSource("events");
  events.addEventListener("change", () => refresh());
  // EventSource reconnects by itself; poll meanwhile, slowly, in case it cannot.
  let poll = null;
  events.onerror = () => { if (!poll) poll = setInterval(refresh, 10000); };
  events.onopen = () => { if (poll) { clearInterval(poll); poll = null; } };
}

fleetControls();
let resizeTimer = null;
window.addEventListener("resize", () => { clearTimeout(resizeTimer); resizeTimer = setTimeout(() => { for (const k of Object.keys(state.charts)) { state.charts[k].plot.destroy(); delete state.charts[k]; } drawCharts(); }, 200); });
refresh().then(listen);
