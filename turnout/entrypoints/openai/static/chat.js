// The chat playground: streams /v1/chat/completions (fetch + a small SSE reader), keeps the
// conversation in memory, and aborts the request on Stop (the server aborts the generation when the
// connection closes). Model text is inserted with textContent only, never parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const turns = [];  // {role, content} of the turns so far (the system prompt is added per request)
let controller = null;  // AbortController of the request in flight

function setStatus(text, kind = "") {
  const s = $("status");
  s.textContent = text;
  s.className = kind;
}

function setBusy(busy) {
  document.body.dataset.state = busy ? "streaming" : "idle";
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  div.append(who, body);
  $("log").append(div);
  div.scrollIntoView({ block: "end" });
  return body;
}

async function loadModels() {
  const select = $("model");
  select.replaceChildren();
  const resp = await api("/v1/models").catch((e) => ({ ok: false, status: 0, statusText: String(e) }));
  if (!resp.ok) {
    setStatus(resp.status === 401 ? "This server needs an API key: enter it above."
      : "Could not list the models: " + (resp.json ? await errorText(resp) : resp.statusText), "error");
    return;
  }
  for (const m of (await resp.json()).data) {
    const opt = document.createElement("option");
    opt.value = opt.textContent = m.id;
    select.append(opt);
  }
  setStatus("");
}

// The sampling fields of the request; an empty field is left out (the server's default applies).
function samplingFields() {
  const out = {};
  for (const [id, parse] of [["temperature", parseFloat], ["top_p", parseFloat], ["max_tokens", (v) => parseInt(v, 10)],
                             ["seed", (v) => parseInt(v, 10)]]) {
    const raw = $(id).value.trim();
    if (raw !== "") out[id] = parse(raw);
  }
  return out;
}

// Yield the JSON payload of each "data:" event of an SSE body until "[DONE]".
async function* sseEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.search(/\r?\n\r?\n/)) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

async function send(text) {
  const system = $("system").value.trim();
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...turns, { role: "user", content: text }];
  const model = $("model").value || undefined;
  addMessage("user", text);
  const out = addMessage("assistant", "");
  out.parentElement.classList.add("pending");
  controller = new AbortController();
  setBusy(true);
  setStatus("waiting for the first token…");
  const t0 = performance.now();
  let answer = "", reasoning = "", tokens = 0, firstAt = null, finish = null;
  try {
    const resp = await api("/v1/chat/completions", {
      method: "POST", signal: controller.signal,
      body: JSON.stringify({ model, messages, stream: true, stream_options: { include_usage: true }, ...samplingFields() }),
    });
    if (!resp.ok) throw new Error(await errorText(resp));
    for await (const ev of sseEvents(resp.body)) {
      if (ev.error) throw new Error(ev.error.message || "the server reported an error");
      if (ev.usage) tokens = ev.usage.completion_tokens;
      for (const c of ev.choices || []) {
        const d = c.delta || {};
        if (d.reasoning_content) reasoning += d.reasoning_content;
        if (d.content) answer += d.content;
        if ((d.content || d.reasoning_content) && firstAt === null) firstAt = performance.now();
        if (c.finish_reason) finish = c.finish_reason;
      }
      out.textContent = (reasoning ? "[thinking] " + reasoning + "\n\n" : "") + answer;
      if (firstAt !== null) setStatus("streaming…");
    }
    const secs = (performance.now() - t0) / 1000;
    const ttft = firstAt === null ? "-" : ((firstAt - t0) / 1000).toFixed(2) + " s";
    setStatus(`done (${finish || "?"}): ${tokens} tokens in ${secs.toFixed(2)} s, first token after ${ttft}`, "ok");
  } catch (e) {
    if (e.name === "AbortError") setStatus("stopped", "warn");
    else setStatus(String(e.message || e), "error");
  } finally {
    out.parentElement.classList.remove("pending");
    if (answer) turns.push({ role: "user", content: text }, { role: "assistant", content: answer });
    controller = null;
    setBusy(false);
  }
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => {
  turns.length = 0;
  $("log").replaceChildren();
  setStatus("");
});
bindKeyField($("key"), loadModels);
loadModels();
