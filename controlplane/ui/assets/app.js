// kvrelay's operator console: the control plane's fleet, cache, decisions, planner and
// rollout, live. Everything comes from the control plane's JSON endpoints on this origin.
"use strict";

const $ = (sel) => document.querySelector(sel);
const tokenKey = "kvrelay-token";
const themeKey = "kvrelay-theme";
const series = { running: [], waiting: [], hit: [], ttft: [] };
const seriesLen = 120;
const seriesAt = []; // when each sample of the fleet charts came (ms)
let lastDecision = 0;
let selectedDecision = 0;
const decisions = [];
const maxDecisionRows = 100;

// --- token and theme -----------------------------------------------------------------

function token() { return sessionStorage.getItem(tokenKey) || ""; }

function headers(extra) {
  const h = Object.assign({ Accept: "application/json" }, extra || {});
  if (token()) h.Authorization = "Bearer " + token();
  return h;
}

function applyTheme(t) {
  document.documentElement.dataset.theme = t;
}

function initTheme() {
  let t = localStorage.getItem(themeKey);
  if (!t) t = window.matchMedia && window.matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light";
  applyTheme(t);
  $("#theme").addEventListener("click", () => {
    const next = document.documentElement.dataset.theme === "dark" ? "light" : "dark";
    localStorage.setItem(themeKey, next);
    applyTheme(next);
  });
}

// --- small helpers -------------------------------------------------------------------

function num(v) { return typeof v === "string" ? Number(v) : (v || 0); }
function fmt(v, digits) { return Number.isFinite(v) ? v.toFixed(digits === undefined ? 1 : digits) : "–"; }
function pct(v) { return Number.isFinite(v) ? (100 * v).toFixed(1) + " %" : "–"; }
function ms(v) { return v > 0 ? fmt(v, v < 10 ? 1 : 0) + " ms" : "–"; }

function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
  return td;
}

function push(arr, v) {
  arr.push(v);
  if (arr.length > seriesLen) arr.shift();
}

// chart draws up to two series as polylines in an SVG with a 0..max scale and its max as
// a label.
function chart(svg, lines) {
  const w = 300, h = 90, pad = 4;
  let hi = 0;
  for (const l of lines) for (const v of l) if (Number.isFinite(v)) hi = Math.max(hi, v);
  if (hi <= 0) hi = 1;
  svg.textContent = "";
  lines.forEach((l, i) => {
    if (l.length === 0) return;
    const step = (w - 2 * pad) / Math.max(seriesLen - 1, 1);
    const x0 = w - pad - (l.length - 1) * step;
    const pts = l.map((v, j) => {
      const y = h - pad - (Number.isFinite(v) ? v : 0) / hi * (h - 2 * pad);
      return (x0 + j * step).toFixed(1) + "," + y.toFixed(1);
    }).join(" ");
    const pl = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    pl.setAttribute("points", pts);
    pl.setAttribute("class", "s" + i);
    svg.appendChild(pl);
  });
  svg.dataset.max = String(hi);
  svg.dataset.last = lines.length && lines[0].length ? String(lines[0][lines[0].length - 1]) : "";
  const t = document.createElementNS("http://www.w3.org/2000/svg", "text");
  t.setAttribute("x", "4");
  t.setAttribute("y", "11");
  t.textContent = "max " + fmt(hi, hi < 10 ? 2 : 0);
  svg.appendChild(t);
}

async function getJSON(path) {
  const r = await fetch(path, { headers: headers() });
  if (!r.ok) {
    const e = new Error(path + ": " + r.status);
    e.status = r.status;
    throw e;
  }
  return r.json();
}

function setStatus(state, text) {
  const s = $("#status");
  s.dataset.state = state;
  s.textContent = text;
}

// --- fleet ---------------------------------------------------------------------------

function renderFleet(f) {
  $("#leader").textContent = f.leader ? "leader " + f.leader : "";
  const tb = $("#workers tbody");
  tb.textContent = "";
  let running = 0, waiting = 0, hitNum = 0, hitDen = 0;
  const ttfts = [];
  for (const w of f.workers || []) {
    const sp = w.spec || {}, st = w.status || {}, fi = w.figures || {};
    const tr = document.createElement("tr");
    tr.dataset.worker = sp.id;
    const state = st.draining ? "draining" : (st.healthy ? "up" : "down");
    tr.dataset.state = state;
    cell(tr, sp.id);
    cell(tr, sp.model || "any");
    cell(tr, sp.role || "both");
    cell(tr, sp.engine || "");
    cell(tr, state, state === "up" ? "state-ok" : state === "draining" ? "state-draining" : "state-down");
    cell(tr, String(num(st.running)), "num");
    cell(tr, String(num(st.waiting)), "num");
    cell(tr, pct(num(st.kv_usage)), "num");
    const b = st.blocks || {};
    cell(tr, num(b.gpu) + " / " + num(b.cpu) + " / " + num(b.disk) + " / " + num(b.shared), "num");
    cell(tr, fi.samples ? pct(fi.hit_rate) : "–", "num");
    cell(tr, ms(fi.ttft_p50_ms), "num");
    cell(tr, ms(fi.itl_p50_ms), "num");
    tb.appendChild(tr);
    running += num(st.running);
    waiting += num(st.waiting);
    if (fi.samples) {
      hitNum += fi.hit_rate * fi.samples;
      hitDen += fi.samples;
      if (fi.ttft_p50_ms > 0) ttfts.push(fi.ttft_p50_ms);
    }
  }
  const pb = $("#proxies tbody");
  pb.textContent = "";
  for (const p of f.proxies || []) {
    const tr = document.createElement("tr");
    tr.dataset.proxy = p.node_id;
    cell(tr, p.node_id);
    cell(tr, String(num(p.streams)), "num");
    cell(tr, (p.policy_versions || []).join(", ") || "–");
    cell(tr, p.report_age_s === undefined ? "–" : p.report_age_s + " s ago", "num");
    cell(tr, p.last_nack ? p.last_nack.reason : "–");
    pb.appendChild(tr);
  }
  const tenantBody = $("#tenants tbody");
  tenantBody.textContent = "";
  for (const t of f.tenants || []) {
    const tr = document.createElement("tr");
    tr.dataset.tenant = t.name;
    cell(tr, t.name);
    cell(tr, String(num(t.proxies)), "num");
    cell(tr, num(t.requests_per_second).toFixed(1), "num");
    cell(tr, num(t.prompt_tokens_per_second).toFixed(0), "num");
    cell(tr, num(t.output_tokens_per_second).toFixed(0), "num");
    cell(tr, String(num(t.admitted)), "num");
    cell(tr, String(num(t.refused)), "num");
    tenantBody.appendChild(tr);
  }
  push(seriesAt, Date.now());
  push(series.running, running);
  push(series.waiting, waiting);
  push(series.hit, hitDen ? hitNum / hitDen : NaN);
  ttfts.sort((a, b) => a - b);
  push(series.ttft, ttfts.length ? ttfts[Math.floor(ttfts.length / 2)] : NaN);
  chart($("#chart-load"), [series.running, series.waiting]);
  chart($("#chart-hit"), [series.hit]);
  chart($("#chart-ttft"), [series.ttft]);
  renderWindow();
  renderIndex(f.index || {});
  renderRollout(f.rollout);
  if (num(f.decisions) > lastDecision) loadDecisions();
}

// renderWindow says how long the fleet charts really cover: their samples are the fleet
// updates this page received since it opened, at most seriesLen of them, not a fixed span.
function renderWindow() {
  const n = seriesAt.length;
  const span = n > 1 ? (seriesAt[n - 1] - seriesAt[0]) / 1000 : 0;
  const text = span >= 120 ? fmt(span / 60, 1) + " min" : fmt(span, 0) + " s";
  const w = $("#charts-window");
  w.dataset.seconds = String(Math.round(span));
  w.textContent = "Charts: the last " + text + " (" + n + " fleet updates received since this page opened, " + seriesLen +
    " at most; Grafana keeps the history).";
}

function renderIndex(ix) {
  const ws = ix.workers || [];
  $("#index-summary").textContent = num(ix.total_blocks) + " distinct blocks indexed, " +
    fmt(num(ix.ingest_rate), 0) + " block events/s, journal epoch " + ix.journal_epoch + " at " + ix.journal_offset;
  const bars = $("#index-bars");
  bars.textContent = "";
  let most = 1;
  for (const w of ws) {
    const b = w.blocks || {};
    most = Math.max(most, num(b.gpu) + num(b.cpu) + num(b.disk) + num(b.shared));
  }
  for (const w of ws) {
    const b = w.blocks || {};
    const row = document.createElement("div");
    row.className = "bar";
    row.dataset.worker = w.id;
    const name = document.createElement("span");
    name.textContent = w.id;
    const track = document.createElement("span");
    track.className = "track";
    for (const [tier, v] of [["gpu", num(b.gpu)], ["host", num(b.cpu)], ["disk", num(b.disk)], ["shared", num(b.shared)]]) {
      const seg = document.createElement("span");
      seg.className = tier;
      seg.style.width = (100 * v / most) + "%";
      seg.title = tier + " " + v;
      track.appendChild(seg);
    }
    const label = document.createElement("span");
    label.textContent = num(b.gpu) + " / " + num(b.cpu) + " / " + num(b.disk) + " / " + num(b.shared);
    row.append(name, track, label);
    bars.appendChild(row);
  }
}

async function loadPrefixes() {
  try {
    const r = await getJSON("/v1/prefixes?n=10");
    const tb = $("#prefixes tbody");
    tb.textContent = "";
    for (const p of r.prefixes) {
      const tr = document.createElement("tr");
      cell(tr, p.prefix.slice(0, 12));
      cell(tr, p.model);
      cell(tr, String(p.blocks), "num");
      cell(tr, fmt(p.hits), "num");
      cell(tr, Object.entries(p.workers).sort((a, b) => b[1] - a[1]).map(([w, n]) => w + " ×" + n).join(", "));
      tb.appendChild(tr);
    }
  } catch (e) { /* shown by the event stream's status */ }
}

// --- decisions -----------------------------------------------------------------------

let loadingDecisions = false;

async function loadDecisions() {
  if (loadingDecisions) return; // the next fleet event asks again
  loadingDecisions = true;
  try {
    const r = await getJSON("/v1/decisions?n=100&since=" + lastDecision);
    const have = new Set(decisions.map((d) => d.id));
    for (const d of r.decisions.reverse()) if (!have.has(d.id)) decisions.unshift(d);
    lastDecision = Math.max(lastDecision, num(r.last));
    decisions.length = Math.min(decisions.length, maxDecisionRows);
    renderDecisions();
  } catch (e) { /* shown by the event stream's status */ }
  finally { loadingDecisions = false; }
}

function renderDecisions() {
  const tb = $("#decision-list tbody");
  tb.textContent = "";
  for (const d of decisions) {
    const tr = document.createElement("tr");
    tr.className = "selectable" + (d.id === selectedDecision ? " selected" : "");
    tr.dataset.decision = d.id;
    cell(tr, String(d.id));
    cell(tr, new Date(d.time).toLocaleTimeString());
    cell(tr, d.model);
    cell(tr, d.prompt_tokens + " tok", "num");
    cell(tr, d.worker);
    cell(tr, d.mode);
    cell(tr, fmt(d.overlap_blocks, 0) + " blk", "num");
    cell(tr, fmt(d.regret_blocks, 0), "num");
    cell(tr, ms(d.ttft_ms), "num");
    cell(tr, d.status ? String(d.status) : "–", "num");
    tr.addEventListener("click", () => showDecision(d.id));
    tb.appendChild(tr);
  }
}

async function showDecision(id) {
  selectedDecision = id;
  renderDecisions();
  let d;
  try { d = await getJSON("/v1/decisions/" + id); } catch (e) { return; }
  $("#decision-detail").hidden = false;
  $("#detail-id").textContent = String(d.id);
  $("#detail-summary").textContent = "Proxy " + d.proxy + " sent this " + d.model + " request (" + d.prompt_tokens +
    " prompt tokens, priority " + d.priority + ") to " + d.worker + " by " + d.mode + " under policy version " +
    d.policy_version + ": it cached " + fmt(d.overlap_blocks, 0) + " of the prompt's blocks, the best candidate " +
    fmt(d.achievable_blocks, 0) + " (regret " + fmt(d.regret_blocks, 0) + "). The answer: status " + (d.status || "–") +
    ", TTFT " + ms(d.ttft_ms) + ", ITL " + ms(d.itl_ms) + ", " + d.cached_tokens + " tokens cached.";
  const tb = $("#detail-candidates tbody");
  tb.textContent = "";
  for (const c of d.candidates) {
    const tr = document.createElement("tr");
    if (c.worker === d.worker) tr.className = "selected";
    cell(tr, c.worker + (c.worker === d.worker ? " (picked)" : ""));
    cell(tr, fmt(c.cached_blocks, 0), "num");
    cell(tr, String(c.requests), "num");
    cell(tr, ms(c.ttft_ms), "num");
    cell(tr, ms(c.queue_ms), "num");
    cell(tr, ms(c.prefill_ms), "num");
    tb.appendChild(tr);
  }
}

// --- planner -------------------------------------------------------------------------

const plannerRate = [], plannerPred = [];

async function loadPlanner() {
  let st;
  try { st = await getJSON("/v1/planner/decisions?limit=120"); } catch (e) {
    $("#planner-summary").textContent = e.status === 404 ? "No planner runs in this control plane." : "Planner unavailable.";
    return;
  }
  // Per pool: the replicas running now, and the target of the planner's latest decision.
  const target = {};
  for (const d of st.decisions || []) target[d.pool] = d.to;
  const pools = Object.entries(st.replicas || {}).map(([p, n]) => p + " " + n + (target[p] !== undefined ? " (target " + target[p] + ")" : "")).join(", ");
  $("#planner-summary").textContent = "Targets TTFT " + st.ttft_target_ms + " ms, ITL " + st.itl_target_ms +
    " ms; every " + st.interval + (st.dry_run ? " (dry run)" : "") + "; replicas now: " + (pools || "–") + ".";
  plannerRate.length = 0;
  plannerPred.length = 0;
  const replicas = [];
  const seen = new Set();
  for (const d of st.decisions || []) {
    if (seen.has(d.seq)) continue;
    seen.add(d.seq);
    plannerRate.push(d.inputs.request_rate);
    plannerPred.push(d.inputs.predicted_rate);
    replicas.push(d.to);
  }
  chart($("#chart-planner"), [plannerRate.slice(-seriesLen), plannerPred.slice(-seriesLen)]);
  chart($("#chart-replicas"), [replicas.slice(-seriesLen)]);
  const tb = $("#planner-decisions tbody");
  tb.textContent = "";
  for (const d of (st.decisions || []).filter((d) => d.from !== d.to).slice(-20).reverse()) {
    const tr = document.createElement("tr");
    tr.dataset.pool = d.pool;
    cell(tr, new Date(d.at).toLocaleTimeString());
    cell(tr, d.pool);
    cell(tr, d.from + " → " + d.to, "num");
    cell(tr, d.reason);
    tb.appendChild(tr);
  }
}

// --- rollout -------------------------------------------------------------------------

function renderRollout(r) {
  if (!r || !r.id || r.id === "0") {
    $("#rollout-summary").textContent = "No rollout has run.";
    $("#rollout-steps tbody").textContent = "";
    return;
  }
  $("#rollout-summary").textContent = "Rollout " + r.id + ": " + r.state + (r.state === "shadow" ? "" : ", step " + r.step +
    " at " + pct(r.share)) + "; stable version " + r.stable_version + ", candidate " + r.candidate_version +
    (r.candidate ? " (" + r.candidate.policy + ")" : "") + (r.reason ? "; " + r.reason : "") + ".";
  $("#rollout").dataset.state = r.state;
  const tb = $("#rollout-steps tbody");
  tb.textContent = "";
  const rows = (r.steps || []).slice();
  if (r.current) rows.push(Object.assign({ current: true }, r.current));
  for (const s of rows) {
    const tr = document.createElement("tr");
    cell(tr, s.step === -1 ? "shadow" : String(s.step));
    cell(tr, pct(s.share), "num");
    cell(tr, s.current ? "running" : s.verdict);
    cell(tr, num(s.stable_requests) + " / " + ms(1000 * s.stable_ttft_p90) + " / " + pct(s.stable_hit_rate), "num");
    cell(tr, num(s.candidate_requests) + " / " + ms(1000 * s.candidate_ttft_p90) + " / " + pct(s.candidate_hit_rate), "num");
    cell(tr, s.current && s.suspect ? "running on: " + s.suspect : (s.reason || ""));
    tb.appendChild(tr);
  }
}

async function rolloutAction(action) {
  const msg = $("#rollout-message");
  if (!token()) {
    msg.dataset.kind = "error";
    msg.textContent = "An API token is needed to " + action + " the rollout.";
    return;
  }
  const ask = {
    promote: "Promote the candidate now? It becomes the stable policy for every request, whatever the running step's figures say.",
    abort: "Abort the rollout? Every request routes with the stable policy again, and the rollout cannot be resumed.",
  }[action];
  if (ask && !window.confirm(ask)) {
    msg.dataset.kind = "info";
    msg.textContent = "Not " + (action === "abort" ? "aborted" : "promoted") + ".";
    return;
  }
  const r = await fetch("/v1/rollout/" + action, { method: "POST", headers: headers({ "Content-Type": "application/json" }), body: "{}" });
  let body = {};
  try { body = await r.json(); } catch (e) { /* empty */ }
  if (r.ok) {
    msg.dataset.kind = "ok";
    msg.textContent = "Rollout " + (body.state || action) + ".";
    renderRollout(body);
  } else {
    msg.dataset.kind = "error";
    msg.textContent = (body.error && body.error.message) || ("refused: " + r.status);
  }
}

// --- the event stream ----------------------------------------------------------------

async function follow() {
  for (;;) {
    try {
      const r = await fetch("/v1/events", { headers: headers({ Accept: "text/event-stream" }) });
      if (!r.ok) {
        setStatus("error", r.status === 401 || r.status === 403 ? "token needed" : "error " + r.status);
        await sleep(2000);
        continue;
      }
      setStatus("live", "live");
      const reader = r.body.getReader();
      const dec = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += dec.decode(value, { stream: true });
        let i;
        while ((i = buf.indexOf("\n\n")) >= 0) {
          const ev = buf.slice(0, i);
          buf = buf.slice(i + 2);
          const data = ev.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
          if (data) renderFleet(JSON.parse(data));
        }
      }
      setStatus("connecting", "reconnecting…");
    } catch (e) {
      setStatus("error", "disconnected");
    }
    await sleep(1000);
  }
}

function sleep(ms) { return new Promise((r) => setTimeout(r, ms)); }

window.addEventListener("DOMContentLoaded", () => {
  initTheme();
  $("#token").value = token();
  $("#token-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(tokenKey, $("#token").value.trim());
    loadDecisions();
    loadPrefixes();
    loadPlanner();
  });
  for (const b of document.querySelectorAll("#rollout button[data-action]")) {
    b.addEventListener("click", () => rolloutAction(b.dataset.action));
  }
  follow();
  loadPlanner();
  loadPrefixes();
  setInterval(loadPrefixes, 5000);
  setInterval(loadPlanner, 2000);
});
