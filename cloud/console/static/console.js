/* AISynergy console: a client of the hub's public REST API (/api/v1) and its SSE log streams, nothing else.
   The token lives in this tab's sessionStorage only and goes out as "Authorization: Bearer"; every element is built
   with the DOM (text, never HTML from the API), so nothing the API returns can run as script. */
"use strict";

const API = "/api/v1";
const KEY = "aisynergy.token";
const S = { token: sessionStorage.getItem(KEY), me: null, timers: [], aborts: [], route: "" };
const FINAL = new Set(["SUCCEEDED", "FAILED", "CANCELED", "TIMED_OUT", "ROLLED_BACK"]);

// --- DOM helpers -----------------------------------------------------------------------------------

function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "text") el.textContent = String(v);
    else if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k === "width") el.style.width = v; // through the CSSOM: the page's policy allows no inline style attribute
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const kid of kids.flat()) if (kid !== null && kid !== undefined && kid !== false) el.append(kid instanceof Node ? kid : String(kid));
  return el;
}
const $ = (sel, root) => (root || document).querySelector(sel);
const put = (el, ...kids) => el.replaceChildren(...kids.flat().filter((k) => k !== null && k !== undefined && k !== false));
const badge = (s) => h("span", { class: `state ${s || ""}`, text: s || "-" });
const when = (iso) => (iso ? new Date(iso).toLocaleString() : "-");
const json = (v) => JSON.stringify(v, null, 2);
const labelsText = (l) => Object.entries(l || {}).map(([k, v]) => `${k}=${v}`).join(", ") || "-";
const canWrite = () => S.me && S.me.role !== "viewer";
const isAdmin = () => S.me && S.me.role === "admin";
const bytes = (n) => (n >= 1 << 30 ? `${(n / (1 << 30)).toFixed(2)} GiB` : n >= 1 << 20 ? `${(n / (1 << 20)).toFixed(1)} MiB` : n >= 1024 ? `${(n / 1024).toFixed(1)} KiB` : `${n} B`);

function toast(text, bad) {
  const div = h("div", { class: bad ? "bad" : "", text });
  $("#toast").append(div);
  setTimeout(() => div.remove(), bad ? 9000 : 4000);
}

function table(columns, rows, empty) {
  const body = h("tbody");
  if (!rows.length) body.append(h("tr", {}, h("td", { colspan: columns.length, class: "muted", text: empty || "nothing yet" })));
  for (const row of rows) body.append(h("tr", {}, columns.map(([title, cell]) => h("td", { "data-label": title }, cell(row)))));
  return h("table", { class: "responsive" }, h("thead", {}, h("tr", {}, columns.map(([title]) => h("th", { scope: "col", text: title })))), body);
}

function field(name, labelText, input, hint) {
  input.id = input.id || `f-${name}`;
  input.name = name;
  return h("div", { class: "field", dataset: { field: name } }, h("label", { for: input.id, text: labelText }), input,
    hint ? h("span", { class: "hint", text: hint }) : null, h("span", { class: "error", id: `${input.id}-error`, role: "alert" }));
}

// Problem documents (RFC 9457) next to their fields: errors[].loc names the field (body.spec.<name>, body.<name>)
function showProblem(form, err) {
  form.querySelectorAll(".field .error").forEach((e) => (e.textContent = ""));
  const general = form.querySelector(".form-error");
  if (general) general.textContent = "";
  const problem = err.problem || {};
  for (const e of problem.errors || []) {
    // the deepest field of the form that the error's location ends with (a union's tag may sit in between)
    const loc = (e.loc || []).filter((p) => p !== "body").map(String);
    let target = null;
    for (let j = 0; j < loc.length && !target; j++) {
      for (let i = loc.length; i > j && !target; i--) target = form.querySelector(`.field[data-field="${CSS.escape(loc.slice(j, i).join("."))}"] .error`);
    }
    if (target && !target.textContent) target.textContent = e.msg || problem.detail;
  }
  if (general) general.textContent = `${problem.title || "Refused"}: ${problem.detail || err.message}`;
}

// --- the API -----------------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, problem) {
    super((problem && (problem.detail || problem.title)) || `HTTP ${status}`);
    this.status = status;
    this.problem = problem;
  }
}

const tags = new Map(); // GET path -> {etag, data}: polls send If-None-Match, a 304 costs the hub no body

async function call(method, path, body, extra) {
  const headers = { Authorization: `Bearer ${S.token}`, ...(extra && extra.headers) };
  let payload;
  if (body instanceof Blob || body instanceof ArrayBuffer) payload = body;
  else if (body !== undefined) { headers["Content-Type"] = "application/json"; payload = JSON.stringify(body); }
  const cached = method === "GET" ? tags.get(path) : undefined;
  if (cached) headers["If-None-Match"] = cached.etag;
  const r = await fetch(path.startsWith("/openapi") ? path : API + path, { method, headers, body: payload, signal: extra && extra.signal });
  if (r.status === 304 && cached) return { data: cached.data, changed: false };
  if (r.status === 401) { signOut("Your token was refused (expired or revoked): sign in again."); throw new ApiError(401, null); }
  const text = await r.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (e) { data = { detail: text.slice(0, 300) }; }
  if (!r.ok) throw new ApiError(r.status, data);
  if (method === "GET" && r.headers.get("etag")) tags.set(path, { etag: r.headers.get("etag"), data });
  return { data, changed: true };
}
const get = async (path) => (await call("GET", path)).data;
const send = async (method, path, body) => (await call(method, path, body)).data;

// act: a write; its refusal shown (toast, or next to the fields of a form)
async function act(what, fn, form) {
  try {
    const out = await fn();
    toast(`${what}: done`);
    return out;
  } catch (err) {
    if (err.status === 401) return undefined;
    if (form) showProblem(form, err);
    toast(`${what}: ${err.status || ""} ${err.message}`, true);
    return undefined;
  }
}

// --- routing and lifecycles ------------------------------------------------------------------------------

function every(ms, fn) {
  let stopped = false;
  const tick = async () => {
    if (stopped) return;
    try { await fn(); } catch (e) { if (e.status !== 401) console.warn(e); }
    if (!stopped) S.timers.push(setTimeout(tick, document.hidden ? ms * 4 : ms));
  };
  tick();
  S.timers.push({ stop: () => (stopped = true) });
}

function leave() {
  for (const t of S.timers) (t && t.stop ? t.stop() : clearTimeout(t));
  for (const a of S.aborts) a.abort();
  for (const c of S.charts || []) c.destroy();
  S.timers = []; S.aborts = []; S.charts = [];
}

const PAGES = [
  ["overview", "Overview"], ["nodes", "Nodes"], ["devices", "Devices"], ["artifacts", "Artefacts"], ["deployments", "Deployments"],
  ["tasks", "Tasks"], ["privacy", "Privacy"], ["tokens", "Tokens", "admin"],
];

function page(title, ...kids) {
  const main = $("#main");
  put(main, h("h1", { text: title }), ...kids);
  document.title = `${title} · AISynergy`;
}

async function route() {
  leave();
  if (!S.token) return signIn();
  if (!S.me) {
    try { S.me = await get("/tokens/self"); } catch (e) { return e.status === 401 ? undefined : signIn(`The hub could not be reached: ${e.message}`); }
  }
  $("#top").hidden = false;
  $("#who").textContent = `${S.me.name || S.me.id} (${S.me.role})`;
  const parts = (location.hash.replace(/^#\/?/, "") || "overview").split("/").map(decodeURIComponent);
  S.route = parts[0];
  put($("#nav"), ...PAGES.filter(([, , need]) => !need || isAdmin()).map(([id, name]) =>
    h("a", { href: `#/${id}`, "aria-current": id === parts[0] ? "page" : null, text: name })));
  const view = VIEWS[parts[0]] || VIEWS.overview;
  try { await view(...parts.slice(1)); } catch (e) { if (e.status !== 401) page("Error", h("p", { class: "error", text: e.message })); }
  $("#main").focus({ preventScroll: true });
}

function signIn(message) {
  leave();
  $("#top").hidden = true;
  const input = h("input", { type: "password", autocomplete: "off", required: true, id: "token" });
  const form = h("form", { class: "card signin", "aria-label": "Sign in" },
    h("h1", { text: "Sign in to AISynergy" }),
    h("p", { class: "muted", text: "An integrator token (aisynergy hub token create --role viewer|operator|admin). It stays in this tab only." }),
    field("token", "Integrator token", input),
    h("p", { class: "form-error error", role: "alert", text: message || "" }),
    h("button", { type: "submit", text: "Sign in" }));
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    S.token = input.value.trim();
    S.me = null;
    try {
      S.me = await get("/tokens/self");
      sessionStorage.setItem(KEY, S.token);
      if (!location.hash || location.hash === "#/signin") location.hash = "#/overview";
      else route();
    } catch (e) {
      $("#token-error").textContent = e.status === 401 ? "The hub does not know this token (or it was revoked)." : e.message;
    }
  });
  put($("#main"), form);
  input.focus();
}

function signOut(message) {
  sessionStorage.removeItem(KEY);
  S.token = null; S.me = null; tags.clear();
  signIn(message);
}

// --- charts (uPlot) ----------------------------------------------------------------------------------

function chart(container, title, xs, series, opts) {
  if (!window.uPlot) return;
  const width = Math.max(280, Math.min(container.clientWidth || 640, 900));
  const palette = ["#1f5fbf", "#d93025", "#137333", "#a15c00", "#7b1fa2", "#00838f"];
  const plot = new uPlot({
    title, width, height: 220,
    scales: { x: { time: !(opts && opts.rounds) } },
    axes: [{ label: opts && opts.rounds ? "round" : "" }, {}],
    series: [{ label: opts && opts.rounds ? "round" : "time" }, ...series.map((s, i) => ({ label: s.label, stroke: palette[i % palette.length], width: 2, spanGaps: true }))],
  }, [xs, ...series.map((s) => s.values)], container);
  (S.charts = S.charts || []).push(plot);
  return plot;
}

// --- SSE over fetch (EventSource cannot send a bearer token) --------------------------------------------

async function stream(path, onEvent, lastId) {
  const controller = new AbortController();
  S.aborts.push(controller);
  let last = lastId;
  for (let attempt = 0; attempt < 50 && !controller.signal.aborted; attempt++) {
    try {
      const headers = { Authorization: `Bearer ${S.token}`, Accept: "text/event-stream" };
      if (last !== undefined && last !== null) headers["Last-Event-ID"] = String(last);
      const r = await fetch(`${API}${path}`, { headers, signal: controller.signal });
      if (r.status === 401) return signOut("Your token was refused: sign in again.");
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      const reader = r.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          const ev = { event: "message", data: "" };
          for (const line of block.split("\n")) {
            if (line.startsWith(":")) continue;
            const [k, ...rest] = line.split(":");
            const v = rest.join(":").replace(/^ /, "");
            if (k === "event") ev.event = v; else if (k === "data") ev.data += v; else if (k === "id") { ev.id = v; last = v; }
          }
          if (ev.data) { let d; try { d = JSON.parse(ev.data); } catch (e) { d = ev.data; } if (onEvent(ev.event, d) === false) return; }
          if (ev.event === "end") return;
        }
      }
    } catch (e) {
      if (controller.signal.aborted) return;
    }
    await new Promise((ok) => setTimeout(ok, 2000));
  }
}

// --- pages -------------------------------------------------------------------------------------------

const VIEWS = {};

VIEWS.overview = async () => {
  const counts = h("div", { class: "grid" });
  const attention = h("div");
  page("Overview", h("div", { class: "card" }, counts), h("h2", { text: "Needs attention" }), attention);
  every(5000, async () => {
    const r = await call("GET", "/summary");
    if (r.changed) {
      put(counts, ...["nodes", "devices", "deployments", "tasks"].map((kind) =>
        h("div", { class: "count" }, h("b", { text: Object.values(r.data[kind]).reduce((a, b) => a + b, 0) }), kind,
          h("div", {}, ...Object.entries(r.data[kind]).sort().map(([s, n]) => h("span", {}, badge(s), ` ${n} `))))));
    }
    const lists = await Promise.all([
      get("/nodes?state=OFFLINE&limit=20"), get("/nodes?state=UNHEALTHY&limit=20"), get("/deployments?state=FAILED&limit=20"),
      get("/deployments?state=ROLLED_BACK&limit=20"), get("/tasks?state=FAILED&limit=20"),
    ]);
    const rows = [
      ...lists[0].items.concat(lists[1].items).map((n) => ["node", n.name, n.state, `#/nodes/${n.id}`]),
      ...lists[2].items.concat(lists[3].items).map((d) => ["deployment", d.name, d.state, `#/deployments/${d.id}`]),
      ...lists[4].items.map((t) => ["task", t.name || t.id, t.state, `#/tasks/${t.id}`]),
    ];
    put(attention, h("div", { class: "card" }, table([["what", (r) => r[0]], ["name", (r) => h("a", { href: r[3], text: r[1] })], ["state", (r) => badge(r[2])]], rows, "nothing needs attention")));
  });
};

function lister(kind, path, columns, filters, extra) {
  // a paged table refreshed every few seconds (ETag), with its filters in the URL's query
  const tableBox = h("div", { class: "card" });
  const pager = h("div", { class: "actions" });
  let cursor = null; const back = [];
  const form = h("form", { class: "filters", role: "search" }, ...filters.map(([name, label, input]) => field(name, label, input)),
    h("button", { type: "submit", class: "secondary", text: "Filter" }));
  form.addEventListener("submit", (ev) => { ev.preventDefault(); cursor = null; back.length = 0; refresh(true); });
  const query = () => {
    const q = new URLSearchParams({ limit: "50" });
    for (const [name, , input] of filters) if (input.value.trim()) q.set(name, input.value.trim());
    if (cursor) q.set("cursor", cursor);
    return `${path}?${q}`;
  };
  async function refresh(force) {
    const r = await call("GET", query());
    if (!r.changed && !force) return;
    put(tableBox, table(columns, r.data.items, `no ${kind}`));
    if (extra) extra(r.data.items);
    put(pager, 
      h("button", { type: "button", class: "secondary", disabled: !back.length, text: "Previous page", onclick: () => { cursor = back.pop() || null; refresh(true); } }),
      h("button", { type: "button", class: "secondary", disabled: !r.data.next_cursor, text: "Next page", onclick: () => { back.push(cursor); cursor = r.data.next_cursor; refresh(true); } }));
  }
  every(5000, () => refresh(false));
  return [form, tableBox, pager];
}

function cpuPercent(r) { return r && r.cpu && typeof r.cpu.utilisation === "number" ? Math.round(100 * r.cpu.utilisation) : null; }
function memPercent(r) { return r && r.memory && r.memory.total_bytes ? Math.round(100 * (1 - (r.memory.available_bytes || 0) / r.memory.total_bytes)) : null; }
function resourceLine(r) {
  r = r || {};
  const cpu = cpuPercent(r), mem = memPercent(r);
  return `cpu ${cpu === null ? "-" : cpu + "%"}${r.cpu && r.cpu.cores ? ` of ${r.cpu.cores}` : ""} · mem ${mem === null ? "-" : `${mem}% of ${bytes(r.memory.total_bytes)}`} · accelerators ${(r.accelerators || []).length}`;
}

async function fillStatus(kind, items) {
  // the live columns of a list: each visible row's status (heartbeat, resources), read once per refresh of the page
  for (const item of items) {
    const cell = document.getElementById(`status-${item.id}`);
    if (!cell) continue;
    try {
      const s = await get(`/${kind}/${item.id}/status`);
      put(cell, h("div", { text: `heartbeat ${when(s.last_heartbeat_at)}` }), h("div", { class: "muted", text: resourceLine(s.resources) }));
    } catch (e) { cell.textContent = "-"; }
  }
}

VIEWS.nodes = async (id) => {
  if (id) return nodeDetail(id);
  const selector = h("input", { placeholder: "zone=a,tier!=gpu" });
  const state = h("select", {}, h("option", { value: "", text: "any" }), ...["REGISTERED", "ONLINE", "OFFLINE", "UNHEALTHY"].map((s) => h("option", { value: s, text: s })));
  const cols = [["name", (n) => h("a", { href: `#/nodes/${n.id}`, text: n.name })], ["id", (n) => h("code", { text: n.id })], ["state", (n) => badge(n.state)],
    ["admin", (n) => badge(n.admin_state)], ["labels", (n) => labelsText(n.labels)], ["heartbeat / resources", (n) => h("div", { id: `status-${n.id}`, text: "…" })]];
  page("Nodes", ...lister("nodes", "/nodes", cols, [["selector", "Label selector", selector], ["state", "State", state]], (items) => fillStatus("nodes", items)),
    canWrite() ? registerForm("nodes") : null);
};

VIEWS.devices = async (id) => {
  if (id) return deviceDetail(id);
  const selector = h("input", { placeholder: "site=a" });
  const node = h("input", { placeholder: "n-…" });
  const cols = [["name", (d) => h("a", { href: `#/devices/${d.id}`, text: d.name })], ["id", (d) => h("code", { text: d.id })], ["state", (d) => badge(d.state)],
    ["edge", (d) => h("a", { href: `#/nodes/${d.node_id}`, text: d.node_id })], ["labels", (d) => labelsText(d.labels)], ["heartbeat / resources", (d) => h("div", { id: `status-${d.id}`, text: "…" })]];
  page("Devices", ...lister("devices", "/devices", cols, [["selector", "Label selector", selector], ["node_id", "Edge node", node]], (items) => fillStatus("devices", items)),
    canWrite() ? registerForm("devices") : null);
};

function parseLabels(text) {
  const labels = {};
  for (const part of text.split(",").map((p) => p.trim()).filter(Boolean)) {
    const [k, ...v] = part.split("=");
    labels[k.trim()] = v.join("=").trim();
  }
  return labels;
}

function registerForm(kind) {
  const name = h("input", { required: true });
  const labels = h("input", { placeholder: "zone=a, site=b" });
  const node = h("input", { placeholder: "n-…" });
  const out = h("div");
  const form = h("form", { class: "card", "aria-label": `Register ${kind === "nodes" ? "an edge node" : "a device"}` },
    h("h2", { text: kind === "nodes" ? "Register an edge node" : "Register a device" }),
    h("div", { class: "form-grid" }, field("name", "Name", name), field("labels", "Labels", labels, "key=value, comma separated"),
      kind === "devices" ? field("node_id", "Edge node id", node) : null),
    h("p", { class: "form-error error", role: "alert" }), h("button", { type: "submit", text: "Register" }), out);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const body = { name: name.value.trim(), labels: parseLabels(labels.value) };
    if (kind === "devices") Object.assign(body, { node_id: node.value.trim() });
    const made = await act("register", () => send("POST", `/${kind}`, body), form);
    if (made) put(out, h("p", {}, "Registered. Its one-time bootstrap token (shown once): "), h("pre", { text: json(made) }));
  });
  return form;
}

async function detailCommon(kind, id, head) {
  const status = h("div");
  const chartBox = h("div");
  const series = { t: [], cpu: [], mem: [] };
  let plot = null;
  every(5000, async () => {
    const r = await call("GET", `/${kind}/${id}/status`);
    const s = r.data;
    put(status, h("dl", { class: "kv" }, ...Object.entries({ state: s.state, connected: s.connected, health: s.health, "last heartbeat": when(s.last_heartbeat_at),
      "agent": s.agent_version, "uptime": s.uptime_s ? `${Math.round(s.uptime_s)} s` : "-" }).flatMap(([k, v]) => [h("dt", { text: k }), h("dd", { text: v === undefined || v === null ? "-" : String(v) })])),
    h("p", { text: resourceLine(s.resources) }), h("details", {}, h("summary", { text: "resources (as reported)" }), h("pre", { text: json(s.resources || {}) })));
    const res = s.resources || {};
    series.t.push(Date.now() / 1000);
    series.cpu.push(cpuPercent(res));
    series.mem.push(memPercent(res));
    if (series.t.length > 360) for (const k of Object.keys(series)) series[k].shift();
    if (!plot) plot = chart(chartBox, "Resources while this page is open (%)", series.t, [{ label: "cpu %", values: series.cpu }, { label: "memory %", values: series.mem }]);
    else plot.setData([series.t, series.cpu, series.mem]);
  });
  return [h("div", { class: "card" }, head, status), h("div", { class: "card" }, chartBox)];
}

function twinCard(kind, id) {
  const box = h("div", { class: "card" }, h("h2", { text: "Twin: desired and reported" }));
  const body = h("div");
  box.append(body);
  let version = null;
  every(5000, async () => {
    const r = await call("GET", `/${kind}/${id}/twin`);
    if (!r.changed) return;
    const t = r.data;
    version = t.desired_version;
    const editor = h("textarea", { "aria-label": "Desired document (JSON)", id: `twin-${id}` });
    editor.value = json(t.desired || {});
    const form = h("form", { "aria-label": "Desired document" }, field("desired", "Desired (JSON)", editor), h("p", { class: "form-error error", role: "alert" }),
      h("button", { type: "submit", text: "Save desired" }));
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      let desired;
      try { desired = JSON.parse(editor.value); } catch (e) { $(`#twin-${id}-error`).textContent = `not JSON: ${e.message}`; return; }
      await act("twin", () => send("PUT", `/${kind}/${id}/twin`, { desired, expected_version: version }), form);
    });
    const desired = canWrite() ? form : h("div", {}, h("h2", { text: "Desired" }), h("pre", { text: json(t.desired || {}) }));
    put(body, h("p", {}, t.in_sync ? badge("SUCCEEDED") : badge("PAUSED"), t.in_sync ? " in sync" : " differs from what was reported"),
      h("div", { class: "form-grid" }, desired, h("div", {}, h("h2", { text: "Reported" }), h("pre", { text: json(t.reported || {}) }),
        h("h2", { text: "Difference" }), h("pre", { class: "diff", text: json(t.diff || {}) }))));
  });
  return box;
}

function commandCard(kind, id) {
  const name = h("input", { required: true, placeholder: "ping" });
  const args = h("textarea", { placeholder: "{}" });
  const answer = h("pre");
  const form = h("form", { class: "card", "aria-label": "Send a command" }, h("h2", { text: "Commands" }),
    h("div", { class: "form-grid" }, field("name", "Command", name), field("args", "Arguments (JSON)", args)),
    h("p", { class: "form-error error", role: "alert" }), h("button", { type: "submit", text: "Send" }), h("h2", { text: "Answer" }), answer);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    let parsed = {};
    try { parsed = args.value.trim() ? JSON.parse(args.value) : {}; } catch (e) { form.querySelector('[data-field="args"] .error').textContent = `not JSON: ${e.message}`; return; }
    const out = await act("command", () => send("POST", `/${kind}/${id}/commands`, { name: name.value.trim(), args: parsed }), form);
    if (out) answer.textContent = json(out);
  });
  return form;
}

function eventsCard(kind, id) {
  const box = h("div", { class: "card" }, h("h2", { text: "Events" }));
  const list = h("div");
  box.append(list);
  every(10000, async () => {
    const r = await call("GET", `/${kind}/${id}/events?limit=50`);
    if (r.changed) put(list, table([["at", (e) => when(e.ts || e.received_at)], ["type", (e) => e.type], ["severity", (e) => e.severity || ""], ["message", (e) => e.message || ""],
      ["data", (e) => h("code", { text: JSON.stringify(e.data || {}).slice(0, 300) })]], r.data.items || r.data, "no events"));
  });
  return box;
}

async function nodeDetail(id) {
  const n = await get(`/nodes/${id}`);
  const actions = h("div", { class: "actions" });
  if (canWrite()) {
    actions.append(h("button", { type: "button", class: "secondary", text: n.admin_state === "LOCKED" ? "Unlock" : "Lock",
      onclick: async () => { await act(n.admin_state === "LOCKED" ? "unlock" : "lock", () => send("PUT", `/nodes/${id}/admin-state`, { admin_state: n.admin_state === "LOCKED" ? "UNLOCKED" : "LOCKED" })); route(); } }));
  }
  if (isAdmin()) {
    const out = h("pre");
    actions.append(h("button", { type: "button", class: "secondary", text: "New bootstrap token", onclick: async () => { const t = await act("bootstrap token", () => send("POST", `/nodes/${id}/bootstrap-token`, {})); if (t) out.textContent = json(t); } }),
      h("button", { type: "button", class: "danger", text: "Delete", onclick: async () => { if (confirm(`Delete node ${n.name}? Its certificate is revoked and its devices deleted.`) && await act("delete", () => send("DELETE", `/nodes/${id}`))) location.hash = "#/nodes"; } }), out);
  }
  const head = h("div", {}, h("dl", { class: "kv" }, ...Object.entries({ id: n.id, kind: n.kind, admin: n.admin_state, labels: labelsText(n.labels), created: when(n.created_at), certificate: `${n.certificate_serial || "-"} until ${when(n.certificate_not_after)}` })
    .flatMap(([k, v]) => [h("dt", { text: k }), h("dd", { text: v })])), actions);
  const history = h("div", { class: "card" }, h("h2", { text: "Lifecycle" }));
  const devices = h("div", { class: "card" }, h("h2", { text: "Devices behind it" }));
  page(`Node ${n.name}`, ...(await detailCommon("nodes", id, head)), history, devices, twinCard("nodes", id), canWrite() ? commandCard("nodes", id) : null, eventsCard("nodes", id));
  const hist = await get(`/nodes/${id}/history?limit=100`);
  history.append(table([["at", (t) => when(t.at)], ["from", (t) => badge(t.from_state)], ["to", (t) => badge(t.to_state)], ["reason", (t) => t.reason || ""]], hist.items || hist));
  const devs = await get(`/nodes/${id}/devices?limit=100`);
  devices.append(table([["name", (d) => h("a", { href: `#/devices/${d.id}`, text: d.name })], ["state", (d) => badge(d.state)], ["labels", (d) => labelsText(d.labels)]], devs.items || devs));
}

async function deviceDetail(id) {
  const d = await get(`/devices/${id}`);
  const actions = h("div", { class: "actions" });
  if (isAdmin()) {
    const out = h("pre");
    actions.append(h("button", { type: "button", class: "secondary", text: "New bootstrap token", onclick: async () => { const t = await act("bootstrap token", () => send("POST", `/devices/${id}/bootstrap-token`, {})); if (t) out.textContent = json(t); } }),
      h("button", { type: "button", class: "danger", text: "Delete", onclick: async () => { if (confirm(`Delete device ${d.name}?`) && await act("delete", () => send("DELETE", `/devices/${id}`))) location.hash = "#/devices"; } }), out);
  }
  const head = h("div", {}, h("dl", { class: "kv" }, ...Object.entries({ id: d.id, edge: d.node_id, model: d.model, labels: labelsText(d.labels), created: when(d.created_at) }).flatMap(([k, v]) => [h("dt", { text: k }), h("dd", { text: v || "-" })])), actions);
  const budgets = h("div", { class: "card" }, h("h2", { text: "Privacy budgets" }));
  page(`Device ${d.name}`, ...(await detailCommon("devices", id, head)), twinCard("devices", id), budgets, canWrite() ? commandCard("devices", id) : null, eventsCard("devices", id));
  budgets.append(budgetTable(await get(`/devices/${id}/privacy-budgets`)));
}

function budgetTable(rows) {
  const eps = (v) => (typeof v === "number" ? v.toFixed(3) : "-");
  return table([["device", (b) => h("a", { href: `#/devices/${b.device_id}`, text: b.device_id })], ["dataset", (b) => b.dataset], ["epsilon", (b) => eps(b.epsilon)], ["spent", (b) => eps(b.spent)],
    ["reserved", (b) => eps(b.reserved)], ["remaining", (b) => h("span", { class: b.remaining < 0.1 * b.epsilon ? "error" : "", text: eps(b.remaining) })], ["delta", (b) => String(b.delta)]], rows, "no budget set");
}

VIEWS.privacy = async () => {
  const box = h("div", { class: "card" });
  page("Privacy budgets", h("p", { class: "muted", text: "Each device's budgets for the datasets it keeps: what training spent, what running tasks reserved, what is left." }), box);
  every(10000, async () => {
    const devices = await get("/devices?limit=100");
    const all = (await Promise.all(devices.items.map((d) => get(`/devices/${d.id}/privacy-budgets`)))).flat();
    put(box, budgetTable(all));
  });
};

// artefacts: list, upload (chunked, with a progress bar), details, delete

async function sha256hex(buffer) {
  const digest = await crypto.subtle.digest("SHA-256", buffer);
  return Array.from(new Uint8Array(digest)).map((b) => b.toString(16).padStart(2, "0")).join("");
}

function uploadForm() {
  const file = h("input", { type: "file", required: true });
  const kind = h("select", {}, ...["model", "dataset", "algorithm", "application", "firmware"].map((k) => h("option", { value: k, text: k })));
  const name = h("input", { required: true, placeholder: "digits" });
  const version = h("input", { required: true, placeholder: "1.0.0" });
  const format = h("select", {}, ...["onnx", "tflite", "safetensors", "npy", "zip", "tar.gz", "whl", "bin", "firmware"].map((k) => h("option", { value: k, text: k })));
  const progress = h("progress", { max: 100, value: 0, "aria-label": "Upload progress" });
  const form = h("form", { class: "card", "aria-label": "Upload an artefact" }, h("h2", { text: "Upload an artefact" }),
    h("div", { class: "form-grid" }, field("file", "File", file), field("kind", "Kind", kind), field("name", "Name", name), field("version", "Version", version), field("format", "Format", format)),
    h("p", { class: "form-error error", role: "alert" }), h("button", { type: "submit", text: "Upload" }), progress);
  file.addEventListener("change", () => {
    const f = file.files[0];
    if (!f) return;
    const ext = f.name.split(".").pop().toLowerCase();
    if ([...format.options].some((o) => o.value === ext)) format.value = ext;
    if (!name.value) name.value = f.name.replace(/\.[^.]+$/, "").replace(/[^A-Za-z0-9_.-]/g, "-");
  });
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const f = file.files[0];
    const done = await act("upload", async () => {
      const buffer = await f.arrayBuffer();
      const session = await send("POST", "/artifacts/uploads", { kind: kind.value, name: name.value.trim(), version: version.value.trim(), format: format.value, size: f.size, sha256: await sha256hex(buffer) });
      for (let i = 0; i < session.chunk_count; i++) {
        const piece = buffer.slice(i * session.chunk_size, Math.min(f.size, (i + 1) * session.chunk_size));
        await call("PUT", `/artifacts/uploads/${session.id}/chunks/${i}`, piece, { headers: { "Content-Type": "application/octet-stream", "X-Chunk-SHA256": await sha256hex(piece) } });
        progress.value = Math.round((100 * (i + 1)) / session.chunk_count);
      }
      return send("POST", `/artifacts/uploads/${session.id}/commit`, {});
    }, form);
    if (done) { toast(`stored as ${done.id}`); location.hash = `#/artifacts/${done.id}`; }
  });
  return form;
}

VIEWS.artifacts = async (id) => {
  if (id) return artifactDetail(id);
  const kind = h("select", {}, h("option", { value: "", text: "any" }), ...["model", "dataset", "algorithm", "application", "firmware"].map((k) => h("option", { value: k, text: k })));
  const name = h("input", { placeholder: "digits" });
  const cols = [["name", (a) => h("a", { href: `#/artifacts/${a.id}`, text: a.name })], ["version", (a) => a.version], ["kind", (a) => a.kind], ["format", (a) => a.format],
    ["size", (a) => bytes(a.size)], ["id", (a) => h("code", { text: a.id })], ["created", (a) => when(a.created_at)]];
  page("Artefacts", ...lister("artefacts", "/artifacts", cols, [["kind", "Kind", kind], ["name", "Name", name]]), canWrite() ? uploadForm() : null);
};

async function artifactDetail(id) {
  const a = await get(`/artifacts/${id}`);
  const actions = h("div", { class: "actions" });
  if (canWrite()) actions.append(h("a", { href: `#/deployments/new/${a.id}`, text: "Deploy it" }));
  if (isAdmin() || canWrite()) {
    actions.append(h("button", { type: "button", class: "danger", text: "Delete", onclick: async () => { if (confirm(`Delete ${a.name} ${a.version}?`) && await act("delete", () => send("DELETE", `/artifacts/${id}`))) location.hash = "#/artifacts"; } }));
  }
  page(`Artefact ${a.name} ${a.version}`, h("div", { class: "card" }, h("dl", { class: "kv" }, ...Object.entries({ id: a.id, kind: a.kind, format: a.format, size: bytes(a.size), sha256: a.sha256, created: when(a.created_at) })
    .flatMap(([k, v]) => [h("dt", { text: k }), h("dd", {}, h("code", { text: v }))])), actions),
  h("div", { class: "card" }, h("h2", { text: "Signed manifest" }), h("pre", { text: json(a.signed_manifest) })));
}

// deployments: list, create (with a preview of who matches), live progress, actions

VIEWS.deployments = async (id, preset) => {
  if (id === "new") return deploymentForm(preset);
  if (id) return deploymentDetail(id);
  const state = h("select", {}, h("option", { value: "", text: "any" }), ...["PENDING", "RUNNING", "PAUSED", "SUCCEEDED", "FAILED", "CANCELED", "ROLLED_BACK"].map((s) => h("option", { value: s, text: s })));
  const cols = [["name", (d) => h("a", { href: `#/deployments/${d.id}`, text: d.name })], ["state", (d) => badge(d.state)], ["progress", (d) => progressBar(d)],
    ["artefact", (d) => d.artifact ? `${d.artifact.name} ${d.artifact.version}` : d.artifact_id], ["strategy", (d) => d.strategy.type], ["created", (d) => when(d.created_at)]];
  page("Deployments", canWrite() ? h("p", {}, h("a", { href: "#/deployments/new", text: "New deployment" })) : null, ...lister("deployments", "/deployments", cols, [["state", "State", state]]));
};

function progressBar(d) {
  const c = d.counts || {};
  const total = d.total || Object.values(c).reduce((a, b) => a + b, 0) || 1;
  const ok = c.ACTIVE || 0;
  const bad = (c.FAILED || 0) + (c.REJECTED || 0) + (c.TIMED_OUT || 0) + (c.ROLLBACK_FAILED || 0);
  const busy = (c.DOWNLOADING || 0) + (c.DOWNLOADED || 0) + (c.VERIFYING || 0) + (c.INSTALLING || 0);
  return h("div", { title: `${ok} of ${total} active` }, h("div", { class: "bar", role: "img", "aria-label": `${ok} of ${total} targets active` },
    h("span", { class: "ok", width: `${(100 * ok) / total}%` }), h("span", { class: "busy", width: `${(100 * busy) / total}%` }), h("span", { class: "bad", width: `${(100 * bad) / total}%` })),
  h("span", { class: "muted", text: `${ok}/${total} active${bad ? `, ${bad} failed` : ""}` }));
}

async function deploymentForm(preset) {
  const models = await get("/artifacts?limit=200");
  const artifact = h("select", { required: true }, ...models.items.map((a) => h("option", { value: a.id, selected: a.id === preset, text: `${a.name} ${a.version} (${a.kind}, ${a.format})` })));
  const name = h("input", { placeholder: "optional" });
  const kind = h("select", {}, h("option", { value: "device", text: "devices" }), h("option", { value: "node", text: "edge nodes" }));
  const selector = h("input", { placeholder: "stack=local" });
  const ids = h("input", { placeholder: "d-…, d-… (instead of a selector)" });
  const strategy = h("select", {}, ...["canary", "rolling", "all_at_once"].map((s) => h("option", { value: s, text: s })));
  const percent = h("input", { type: "number", min: 1, max: 100, value: 34 });
  const batch = h("input", { type: "number", min: 1, value: 1 });
  const maxFail = h("input", { type: "number", min: 0, max: 100, value: 0 });
  const preview = h("div", { class: "muted", "aria-live": "polite" });
  const form = h("form", { class: "card", "aria-label": "New deployment" },
    h("div", { class: "form-grid" }, field("artifact_id", "Artefact", artifact), field("name", "Name", name), field("target.kind", "Targets", kind),
      field("target.selector", "Label selector", selector), field("target.ids", "Or target ids", ids), field("strategy", "Strategy", strategy),
      field("strategy.percent", "Canary percent", percent, "canary: the first batch's share"), field("strategy.batch_size", "Batch size", batch, "rolling: targets per batch"),
      field("max_failure_percent", "Failures tolerated (%)", maxFail)),
    h("div", { class: "actions" }, h("button", { type: "button", class: "secondary", text: "Preview targets", onclick: () => showPreview() })), preview,
    h("p", { class: "form-error error", role: "alert" }), h("button", { type: "submit", text: "Deploy" }));
  async function showPreview() {
    if (ids.value.trim()) { preview.textContent = `${ids.value.split(",").filter((s) => s.trim()).length} targets named`; return; }
    const q = new URLSearchParams({ limit: "500" });
    if (selector.value.trim()) q.set("selector", selector.value.trim());
    try {
      const page = await get(`/${kind.value === "node" ? "nodes" : "devices"}?${q}`);
      put(preview, `${page.items.length}${page.next_cursor ? "+" : ""} match: `, ...page.items.slice(0, 20).map((t) => h("span", {}, badge(t.state), ` ${t.name} `)));
    } catch (e) { preview.textContent = e.message; }
  }
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const target = { kind: kind.value };
    if (ids.value.trim()) target.ids = ids.value.split(",").map((s) => s.trim()).filter(Boolean); else if (selector.value.trim()) target.selector = selector.value.trim();
    const strat = strategy.value === "canary" ? { type: "canary", percent: Number(percent.value) } : strategy.value === "rolling" ? { type: "rolling", batch_size: Number(batch.value) } : { type: "all_at_once" };
    const body = { artifact_id: artifact.value, target, strategy: strat, max_failure_percent: Number(maxFail.value) };
    if (name.value.trim()) body.name = name.value.trim();
    const made = await act("deployment", () => send("POST", "/deployments", body), form);
    if (made) location.hash = `#/deployments/${made.id}`;
  });
  page("New deployment", form);
}

async function deploymentDetail(id) {
  const head = h("div");
  const execs = h("div");
  const actions = h("div", { class: "actions" });
  page("Deployment", h("div", { class: "card" }, head, actions), h("div", { class: "card" }, h("h2", { text: "Targets" }), execs));
  let shownState = null;
  every(1500, async () => {
    const r = await call("GET", `/deployments/${id}`);
    if (!r.changed) return;
    const d = r.data;
    $("h1").textContent = `Deployment ${d.name}`;
    put(head, h("p", {}, h("span", { id: "deployment-state" }, badge(d.state)), ` batch ${d.current_batch} of ${d.batches} · ${d.strategy.type}`, d.reason ? ` · ${d.reason}` : ""),
      progressBar(d), h("p", { class: "muted", text: `artefact ${d.artifact ? `${d.artifact.name} ${d.artifact.version}` : d.artifact_id}; targets ${JSON.stringify(d.target)}` }));
    put(execs, table([["target", (e) => h("a", { href: `#/${e.target_kind === "node" ? "nodes" : "devices"}/${e.target_id}`, text: e.target_id })], ["batch", (e) => e.batch],
      ["state", (e) => badge(e.state)], ["detail", (e) => e.detail || ""], ["history", (e) => (e.history || []).map((t) => t.to_state).join(" → ")], ["updated", (e) => when(e.updated_at)]], d.executions || []));
    if (canWrite() && shownState !== d.state) {
      shownState = d.state;
      const button = (label, verb, cls) => h("button", { type: "button", class: cls || "secondary", text: label, onclick: () => act(label.toLowerCase(), () => send("POST", `/deployments/${id}/${verb}`, {})) });
      put(actions, ...(d.state === "RUNNING" || d.state === "PENDING" ? [button("Pause", "pause")] : []), ...(d.state === "PAUSED" ? [button("Resume", "resume")] : []),
        ...(!FINAL.has(d.state) ? [button("Cancel", "cancel", "danger")] : []), ...(d.state !== "ROLLED_BACK" ? [button("Roll back", "rollback", "danger")] : []));
    }
  });
}

// tasks: list, create from the type's JSON Schema, live state, workers, logs (SSE), metrics and rounds

VIEWS.tasks = async (id) => {
  if (id === "new") return taskForm();
  if (id) return taskDetail(id);
  const state = h("select", {}, h("option", { value: "", text: "any" }), ...["PENDING", "SCHEDULED", "RUNNING", "PAUSED", "SUCCEEDED", "FAILED", "CANCELED", "TIMED_OUT"].map((s) => h("option", { value: s, text: s })));
  const type = h("select", {}, h("option", { value: "", text: "any" }), ...["inference", "batch_inference", "split_inference", "incremental_training", "federated_training", "training"].map((s) => h("option", { value: s, text: s })));
  const cols = [["name", (t) => h("a", { href: `#/tasks/${t.id}`, text: t.name || t.id })], ["type", (t) => t.type], ["state", (t) => badge(t.state)],
    ["progress", (t) => t.progress && t.progress.items_total ? `${t.progress.items_done}/${t.progress.items_total}` : ""], ["created", (t) => when(t.created_at)]];
  page("Tasks", canWrite() ? h("p", {}, h("a", { href: "#/tasks/new", text: "New task" })) : null, ...lister("tasks", "/tasks", cols, [["state", "State", state], ["type", "Type", type]]));
};

let OPENAPI = null;
async function schemas() {
  if (!OPENAPI) OPENAPI = await (await fetch("/openapi.json")).json();
  return OPENAPI.components.schemas;
}
function deref(all, s) { return s && s.$ref ? all[s.$ref.split("/").pop()] : s; }

function inputFor(all, name, prop, required) {
  // one control per top-level property of the spec's JSON Schema: scalars as inputs, the rest as JSON
  let p = deref(all, prop) || {};
  const options = (p.anyOf || []).filter((x) => x.type !== "null");
  if (options.length === 1) p = { ...deref(all, options[0]), description: prop.description || p.description, default: prop.default };
  const bounds = [p.minimum !== undefined ? `≥ ${p.minimum}` : "", p.maximum !== undefined ? `≤ ${p.maximum}` : "", p.maxLength !== undefined ? `at most ${p.maxLength} characters` : ""].filter(Boolean).join(", ");
  const hint = [p.description, bounds, p.default !== undefined && p.default !== null ? `default ${JSON.stringify(p.default)}` : ""].filter(Boolean).join(" · ");
  let input;
  if (p.enum) input = h("select", {}, required ? null : h("option", { value: "", text: "(default)" }), ...p.enum.map((v) => h("option", { value: v, text: v })));
  else if (p.type === "boolean") input = h("select", {}, h("option", { value: "", text: "(default)" }), h("option", { value: "true", text: "true" }), h("option", { value: "false", text: "false" }));
  // bounds are shown, not enforced here: the hub judges, and its answer shows next to the field
  else if (p.type === "integer" || p.type === "number") input = h("input", { type: "number", step: "any" });
  else if (p.type === "string") input = h("input", {});
  else input = h("textarea", { placeholder: p.type === "array" ? "[]" : "{}" });
  input.dataset.required = required ? "yes" : "";
  input.dataset.kind = p.enum ? "enum" : p.type || "json";
  return field(`spec.${name}`, `${name}${required ? " *" : ""}`, input, hint);
}

function readSpec(form) {
  const spec = {};
  for (const wrap of form.querySelectorAll('.field[data-field^="spec."]')) {
    const name = wrap.dataset.field.slice(5);
    const input = wrap.querySelector("input, select, textarea");
    const v = input.value.trim();
    if (!v) continue;
    const kind = input.dataset.kind;
    if (kind === "integer" || kind === "number") spec[name] = Number(v);
    else if (kind === "boolean") spec[name] = v === "true";
    else if (kind === "string" || kind === "enum") spec[name] = v;
    else {
      try { spec[name] = JSON.parse(v); } catch (e) { throw Object.assign(new Error(`${name}: not JSON`), { field: `spec.${name}` }); }
    }
  }
  return spec;
}

async function taskForm() {
  const all = await schemas();
  const mapping = Object.keys(OPENAPI.paths[`${API}/tasks`].post.requestBody.content["application/json"].schema.discriminator.mapping);
  const type = h("select", {}, ...mapping.map((t) => h("option", { value: t, text: t })));
  const name = h("input", { placeholder: "optional" });
  const target = h("select", {}, h("option", { value: "device", text: "devices" }), h("option", { value: "node", text: "edge nodes" }));
  const selector = h("input", { placeholder: "stack=local" });
  const ids = h("input", { placeholder: "d-…, d-…" });
  const specBox = h("div", { class: "form-grid" });
  const form = h("form", { class: "card", "aria-label": "New task" },
    h("div", { class: "form-grid" }, field("type", "Type", type), field("name", "Name", name), field("placement.target", "Placement", target),
      field("placement.selector", "Label selector", selector), field("placement.ids", "Or target ids", ids)),
    h("h2", { text: "Spec" }), specBox, h("p", { class: "form-error error", role: "alert" }), h("button", { type: "submit", text: "Create" }));
  function renderSpec() {
    const create = all[OPENAPI.paths[`${API}/tasks`].post.requestBody.content["application/json"].schema.discriminator.mapping[type.value].split("/").pop()];
    const spec = deref(all, create.properties.spec);
    const required = new Set(spec.required || []);
    put(specBox, ...Object.entries(spec.properties || {}).sort(([a], [b]) => (required.has(b) - required.has(a))).map(([k, p]) => inputFor(all, k, p, required.has(k))));
  }
  type.addEventListener("change", renderSpec);
  renderSpec();
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    let spec;
    try { spec = readSpec(form); } catch (e) { showProblem(form, { problem: { detail: e.message, errors: [{ loc: ["body", ...e.field.split(".")], msg: e.message }] } }); return; }
    const placement = { target: target.value };
    if (ids.value.trim()) placement.ids = ids.value.split(",").map((s) => s.trim()).filter(Boolean); else if (selector.value.trim()) placement.selector = selector.value.trim();
    const body = { type: type.value, spec, placement };
    if (name.value.trim()) body.name = name.value.trim();
    const made = await act("task", () => send("POST", "/tasks", body), form);
    if (made) location.hash = `#/tasks/${made.id}`;
  });
  page("New task", form);
}

async function taskDetail(id) {
  const head = h("div");
  const actions = h("div", { class: "actions" });
  const workers = h("div");
  const logs = h("div", { class: "log", role: "log", "aria-live": "off", id: "task-log" });
  const charts = h("div");
  const rounds = h("div");
  const split = h("div");
  const outputs = h("div");
  page("Task", h("div", { class: "card" }, head, actions), h("div", { class: "card" }, h("h2", { text: "Workers" }), workers),
    h("div", { class: "card" }, h("h2", { text: "Log (live)" }), logs), h("div", { class: "card" }, h("h2", { text: "Metrics" }), charts),
    h("div", { class: "card", id: "rounds" }, rounds), h("div", { class: "card", id: "split" }, split), h("div", { class: "card" }, h("h2", { text: "Outputs" }), outputs));
  let task = null;
  const render = (t) => {
    task = t;
    $("h1").textContent = `Task ${t.name || t.id}`;
    const p = t.progress || {};
    put(head, h("p", {}, h("span", { id: "task-state" }, badge(t.state)), ` ${t.type}`, p.items_total ? ` · ${p.items_done}/${p.items_total} items` : "",
      p.chunks_total ? ` · ${p.chunks_done}/${p.chunks_total} chunks` : "", t.reason ? ` · ${t.reason}` : ""),
    p.items_total ? h("progress", { max: p.items_total, value: p.items_done || 0, "aria-label": "Items done", id: "task-progress" }) : null,
    h("details", {}, h("summary", { text: "spec" }), h("pre", { text: json(t.spec) })));
    if (canWrite()) {
      const verb = (label, v, cls) => h("button", { type: "button", class: cls || "secondary", text: label, onclick: () => act(label.toLowerCase(), () => send("POST", `/tasks/${id}/${v}`, {})) });
      put(actions, ...(t.state === "RUNNING" ? [verb("Pause", "pause")] : []), ...(t.state === "PAUSED" ? [verb("Resume", "resume")] : []),
        ...(FINAL.has(t.state) ? [verb("Retry", "retry")] : [verb("Cancel", "cancel", "danger")]));
    }
  };
  every(3000, async () => {
    const r = await call("GET", `/tasks/${id}`);
    if (r.changed) render(r.data);
    const w = await call("GET", `/tasks/${id}/workers`);
    if (w.changed) put(workers, table([["target", (x) => h("a", { href: `#/${x.target_kind === "node" ? "nodes" : "devices"}/${x.target_id}`, text: x.target_id })], ["role", (x) => x.role],
      ["state", (x) => badge(x.state)], ["items", (x) => x.items_done !== null && x.items_done !== undefined ? `${x.items_done}/${x.items_assigned ?? "-"}` : ""], ["detail", (x) => x.detail || ""], ["last report", (x) => when(x.last_report_at)]], w.data));
  });
  stream(`/tasks/${id}/logs`, (event, data) => {
    if (event === "log") {
      logs.append(h("div", { class: data.level || "" }, h("span", { class: "muted", text: `${new Date(data.ts).toLocaleTimeString()} ${data.target_id || "hub"} ` }), data.text));
      if (logs.children.length > 2000) logs.firstChild.remove();
      logs.scrollTop = logs.scrollHeight;
    } else if (event === "state" && data && task) {
      render({ ...task, ...data, progress: data.progress || task.progress });
    }
    return true;
  });
  every(5000, async () => {
    const m = await call("GET", `/tasks/${id}/metrics?series=true`);
    if (!m.changed) return;
    drawMetrics(charts, rounds, split, m.data);
    if (task && ["SUCCEEDED", "FAILED", "CANCELED", "TIMED_OUT"].includes(task.state)) {
      const o = await get(`/tasks/${id}/outputs`).catch(() => null);
      if (o) put(outputs, outputsView(o));
    }
  });
}

const ROUTES = ["split", "edge", "device", "fallbacks"];

function drawMetrics(box, roundsBox, splitBox, metrics) {
  for (const c of S.charts || []) c.destroy();
  S.charts = [];
  put(box, );
  put(roundsBox, );
  put(splitBox, );
  const series = metrics.series || [];
  // split inference: each head's samples count its requests by route since it started; the shares are per interval
  const heads = series.filter((s) => s.worker_id !== "hub" && s.values && s.values.cut_index !== undefined);
  splitBox.parentElement.hidden = !heads.length;
  if (heads.length) {
    const before = {};
    const xs = [], cut = [], shares = Object.fromEntries(ROUTES.map((k) => [k, []]));
    for (const s of heads) {
      const prev = before[s.worker_id] || {};
      const delta = Object.fromEntries(ROUTES.map((k) => [k, Math.max(0, (s.values[k] || 0) - (prev[k] || 0))]));
      const total = ROUTES.reduce((sum, k) => sum + delta[k], 0);
      before[s.worker_id] = s.values;
      xs.push(new Date(s.ts).getTime() / 1000);
      for (const k of ROUTES) shares[k].push(total ? (100 * delta[k]) / total : null);
      cut.push(s.values.estimate_ms !== undefined ? s.values.cut_index : null);  // planned: -1 is the whole model on the device
    }
    const routeBox = h("div", { id: "split-routes" });
    const cutBox = h("div", { id: "split-cut" });
    splitBox.append(h("h2", { text: "Split inference" }), h("p", { class: "muted", text: "Requests by route in each interval (%), and the cut each device chose: the index of its candidate cut, -1 for the whole model on the device (a gap: not calibrated yet)." }), routeBox, cutBox);
    chart(routeBox, "Route shares (%)", xs, ROUTES.map((k) => ({ label: k, values: shares[k] })));
    chart(cutBox, "Cut over time", xs, [{ label: "cut index", values: cut }]);
  }
  // the hub's per-round samples (federated training): accuracy and loss against the round
  const hub = series.filter((s) => s.worker_id === "hub" && s.values && s.values.round !== undefined);
  roundsBox.parentElement.hidden = !hub.length;
  if (hub.length) {
    roundsBox.append(h("h2", { text: "Rounds" }));
    const xs = hub.map((s) => s.values.round);
    const pick = (k) => hub.map((s) => (s.values[k] === undefined ? null : s.values[k]));
    const chartBox = h("div", { id: "round-chart" });
    roundsBox.append(chartBox, table([["round", (s) => s.values.round], ["contributors", (s) => s.values.contributors ?? s.values.participants ?? "-"],
      ["accuracy", (s) => (s.values.eval_accuracy ?? s.values.accuracy ?? "-").toString().slice(0, 6)], ["loss", (s) => (s.values.eval_loss ?? s.values.loss ?? "-").toString().slice(0, 6)],
      ["round s", (s) => (s.values.round_s ?? "-").toString().slice(0, 5)], ["bytes up", (s) => s.values.bytes_up !== undefined ? bytes(s.values.bytes_up) : "-"]], hub.slice(-30)));
    const keys = ["eval_accuracy", "accuracy", "eval_loss", "loss"].filter((k) => hub.some((s) => s.values[k] !== undefined));
    chart(chartBox, "Global model per round", xs, keys.map((k) => ({ label: k, values: pick(k) })), { rounds: true });
  }
  const others = series.filter((s) => s.worker_id !== "hub");
  const keys = [...new Set(others.flatMap((s) => Object.keys(s.values || {})))].filter((k) => !["round", "rounds"].includes(k)).slice(0, 4);
  if (others.length && keys.length) {
    const xs = others.map((s) => new Date(s.ts).getTime() / 1000);
    for (const k of keys) chart(box, k, xs, [{ label: k, values: others.map((s) => (s.values[k] === undefined ? null : s.values[k])) }]);
  } else box.append(h("p", { class: "muted", text: "no samples yet" }));
}

function outputsView(o) {
  const parts = [h("dl", { class: "kv" }, ...Object.entries({ complete: o.complete, items: `${o.items_done ?? "-"}/${o.items_total ?? "-"}`, "best round": o.best_round ?? "-" })
    .flatMap(([k, v]) => [h("dt", { text: k }), h("dd", { text: String(v) })]))];
  if ((o.artifacts || []).length) parts.push(h("h2", { text: "Published" }), h("ul", {}, ...o.artifacts.map((a) => h("li", {}, h("a", { href: `#/artifacts/${a}`, text: a }), canWrite() ? [" · ", h("a", { href: `#/deployments/new/${a}`, text: "deploy it" })] : null))));
  if ((o.deployments || []).length) parts.push(h("h2", { text: "Deployments it started" }), h("ul", {}, ...o.deployments.map((d) => h("li", {}, h("a", { href: `#/deployments/${d}`, text: d })))));
  if ((o.evaluation || []).length) {
    const models = [...new Set(o.evaluation.map((c) => c.model))];
    const rows = [...new Set(o.evaluation.map((c) => c.evaluator))];
    const cell = (r, m) => { const c = o.evaluation.find((x) => x.evaluator === r && x.model === m); return c ? String(c.metrics.accuracy ?? c.loss ?? "-").slice(0, 6) : "-"; };
    parts.push(h("h2", { text: "Cross-site evaluation (accuracy: rows score on their data)" }), table([["site's data", (r) => r], ...models.map((m) => [m, (r) => cell(r, m)])], rows));
  }
  if ((o.privacy || []).length) parts.push(h("h2", { text: "Privacy spent" }), h("pre", { text: json(o.privacy) }));
  return h("div", {}, ...parts);
}

// tokens (admin)

VIEWS.tokens = async () => {
  if (!isAdmin()) return page("Tokens", h("p", { text: "Tokens are managed by admins." }));
  const role = h("select", {}, ...["viewer", "operator", "admin"].map((r) => h("option", { value: r, text: r })));
  const name = h("input", { placeholder: "what it is for" });
  const secret = h("pre");
  const form = h("form", { class: "card", "aria-label": "New token" }, h("h2", { text: "New token" }), h("div", { class: "form-grid" }, field("role", "Role", role), field("name", "Name", name)),
    h("p", { class: "form-error error", role: "alert" }), h("button", { type: "submit", text: "Create" }), secret);
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const t = await act("token", () => send("POST", "/tokens", { role: role.value, name: name.value.trim() }), form);
    if (t) secret.textContent = `Its secret, shown this once: ${t.token}`;
  });
  const cols = [["id", (t) => h("code", { text: t.id })], ["role", (t) => t.role], ["name", (t) => t.name || "-"], ["created", (t) => when(t.created_at)],
    ["revoked", (t) => (t.revoked_at ? when(t.revoked_at) : h("button", { type: "button", class: "danger", text: "Revoke", onclick: () => confirm(`Revoke ${t.id}?`) && act("revoke", () => send("DELETE", `/tokens/${t.id}`)) }))]];
  page("Tokens", form, ...lister("tokens", "/tokens", cols, []));
};

// --- start ---------------------------------------------------------------------------------------------

window.addEventListener("hashchange", route);
document.addEventListener("DOMContentLoaded", () => {
  $("#signout").addEventListener("click", () => { signOut("Signed out."); location.hash = ""; });
  route();
});
