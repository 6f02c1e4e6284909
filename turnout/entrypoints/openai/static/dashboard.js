// The dashboard: the op table from GET /ops, and charts fed by polling GET /metrics (Prometheus text,
// parsed here). Counters become rates between two scrapes; TTFT is the mean, and the p90 from the
// histogram buckets, of the requests whose first token came between two scrapes (null when none did).
// ?every=SECONDS sets the polling period (default 1).
"use strict";

const $ = (id) => document.getElementById(id);
const EVERY_S = Math.max(0.1, parseFloat(new URLSearchParams(location.search).get("every")) || 1);

// "name{a="x",b="y"} value" lines -> Map(name -> [{labels, value}]); comments and blanks skipped.
function parsePrometheus(text) {
  const out = new Map();
  const line = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
  const label = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
  for (const raw of text.split("\n")) {
    if (!raw || raw.startsWith("#")) continue;
    const m = line.exec(raw);
    if (!m) continue;
    const labels = {};
    for (const l of (m[2] || "").matchAll(label)) labels[l[1]] = l[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
    const value = m[3] === "+Inf" ? Infinity : m[3] === "-Inf" ? -Infinity : parseFloat(m[3]);
    if (!out.has(m[1])) out.set(m[1], []);
    out.get(m[1]).push({ labels, value });
  }
  return out;
}

function scalar(metrics, name) {
  const rows = metrics.get(name);
  return rows && rows.length ? rows[0].value : null;
}

// Cumulative buckets [[le, count], ...] sorted by le.
function buckets(metrics, name) {
  return (metrics.get(name + "_bucket") || []).map((r) => [r.labels.le === "+Inf" ? Infinity : parseFloat(r.labels.le), r.value])
    .sort((a, b) => a[0] - b[0]);
}

// The q-quantile of the observations between two bucket snapshots, interpolated inside its bucket.
function quantileOfDelta(now, before, q) {
  const delta = now.map(([le, c], i) => [le, c - (before[i] ? before[i][1] : 0)]);
  const total = delta.length ? delta[delta.length - 1][1] : 0;
  if (total <= 0) return null;
  const rank = q * total;
  let lo = 0, below = 0;
  for (const [le, c] of delta) {
    if (c >= rank) {
      if (!Number.isFinite(le)) return lo;  // past the last finite bound: report that bound
      return lo + ((le - lo) * (rank - below)) / Math.max(c - below, 1e-9);
    }
    lo = le; below = c;
  }
  return lo;
}

const charts = {
  throughput: new LineChart($("chart-throughput"), [{ label: "generated", color: "#1f6feb" }, { label: "prompt", color: "#8957e5" }],
    { unit: " tok/s" }),
  requests: new LineChart($("chart-requests"), [{ label: "running", color: "#2da44e" }, { label: "waiting", color: "#d29922" }]),
  kv: new LineChart($("chart-kv"), [{ label: "KV used", color: "#cf222e" }], { unit: " %", minMax: 100 }),
  ttft: new LineChart($("chart-ttft"), [{ label: "mean", color: "#0969da" }, { label: "p90", color: "#bf8700" }],
    { unit: " s", minMax: 0.1 }),
};

let previous = null;  // {t, gen, prompt, ttftSum, ttftCount, ttftBuckets}

async function scrape() {
  let text;
  try {
    const resp = await api("/metrics");
    if (!resp.ok) throw new Error(await errorText(resp));
    text = await resp.text();
  } catch (e) {
    $("scrape").textContent = "(/metrics: " + (e.message || e) + ")";
    return;
  }
  const m = parsePrometheus(text);
  const now = {
    t: performance.now() / 1000,
    gen: scalar(m, "turnout_generation_tokens_total"),
    prompt: scalar(m, "turnout_prompt_tokens_total"),
    ttftSum: scalar(m, "turnout_time_to_first_token_seconds_sum"),
    ttftCount: scalar(m, "turnout_time_to_first_token_seconds_count"),
    ttftBuckets: buckets(m, "turnout_time_to_first_token_seconds"),
  };
  $("scrape").textContent = `(every ${EVERY_S} s from /metrics)`;
  charts.requests.push([scalar(m, "turnout_num_requests_running"), scalar(m, "turnout_num_requests_waiting")]);
  const kv = scalar(m, "turnout_kv_cache_usage_perc");
  charts.kv.push([kv === null ? null : 100 * kv]);
  if (previous) {
    const dt = Math.max(now.t - previous.t, 1e-3);
    const rate = (a, b) => (a === null || b === null ? null : Math.max(0, a - b) / dt);
    charts.throughput.push([rate(now.gen, previous.gen), rate(now.prompt, previous.prompt)]);
    const n = now.ttftCount - previous.ttftCount;
    charts.ttft.push(n > 0 ? [(now.ttftSum - previous.ttftSum) / n, quantileOfDelta(now.ttftBuckets, previous.ttftBuckets, 0.9)]
      : [null, null]);
  }
  previous = now;
}

async function loadOps() {
  const status = $("ops-status"), body = $("ops").tBodies[0];
  const resp = await api("/ops").catch((e) => ({ ok: false, status: 0, statusText: String(e) }));
  if (!resp.ok) {
    status.textContent = resp.status === 401 ? "The op table needs the API key: enter it above."
      : "GET /ops: " + (resp.json ? await errorText(resp) : resp.statusText);
    status.className = "error";
    return;
  }
  const ops = await resp.json();
  if (ops.phase === "loading") {  // the engine resolves its table while the model loads
    status.textContent = "the model is loading…";
    setTimeout(loadOps, 2000);
    return;
  }
  status.textContent = ops.data.length ? "" : "this server reports no op table";
  status.className = "";
  $("platform").textContent = ops.platform ? `${ops.platform.name} (${ops.platform.description})` + (ops.policy ? `, policy ${ops.policy}` : "") : "";
  const rows = ops.data.map((r) => {
    const tr = document.createElement("tr");
    const fallbacks = r.candidates.filter((c) => c.impl !== r.chosen)
      .map((c) => `${c.impl}${c.available ? "" : " (unavailable)"}: ${c.reason}`);
    for (const [text, cls] of [[r.op, "op"], [r.chosen || "none", r.chosen ? "chosen" : "missing"],
                               [fallbacks.join("\n") || "-", "fallbacks"]]) {
      const td = document.createElement("td");
      td.textContent = text;
      td.className = cls;
      tr.append(td);
    }
    return tr;
  });
  body.replaceChildren(...rows);
}

bindKeyField($("key"), () => { previous = null; loadOps(); });
loadOps();
scrape();
setInterval(scrape, EVERY_S * 1000);
