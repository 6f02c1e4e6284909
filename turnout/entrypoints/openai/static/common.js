// Shared by the playground and the dashboard: the API key field and keyed requests to this server.
// The key lives in localStorage (this origin only) so both pages and reloads use it; it is sent as
// "Authorization: Bearer <key>", which is what the server checks on /v1/* and /ops.
"use strict";

const KEY_STORAGE = "turnout.apiKey";

function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

// Wire an <input> to the stored key; onChange runs after the key changes (to refetch what needs it).
function bindKeyField(input, onChange) {
  input.value = apiKey();
  input.addEventListener("change", () => {
    const v = input.value.trim();
    if (v) localStorage.setItem(KEY_STORAGE, v); else localStorage.removeItem(KEY_STORAGE);
    if (onChange) onChange();
  });
}

// fetch() with the key and, for a body, the JSON Content-Type the server requires of a POST.
function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const key = apiKey();
  if (key) headers.set("Authorization", "Bearer " + key);
  if (options.body !== undefined) headers.set("Content-Type", "application/json");
  return fetch(path, { ...options, headers });
}

// The message of an OpenAI-shaped error response ({"error": {"message", ...}}), else the status line.
async function errorText(resp) {
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) return `${resp.status}: ${body.error.message}`;
  } catch (_) { /* not JSON */ }
  return `${resp.status} ${resp.statusText}`;
}
