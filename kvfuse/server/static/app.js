// The kvfuse page: sign in with an API key, ask a knowledge base (streamed), read citations and
// conflicts, and, with an admin key, edit documents and read usage. Plain DOM, no framework; every
// piece of server text goes in through textContent.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { key: sessionStorage.getItem("kvfuse-key") || "", me: null, messages: [] };

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "on") for (const [ev, fn] of Object.entries(v)) e.addEventListener(ev, fn);
    else e.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c);
  return e;
}

class ApiError extends Error {
  constructor(status, message, retryAfter) {
    super(message);
    this.status = status;
    this.retryAfter = retryAfter;
  }
}

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (state.key) headers.Authorization = `Bearer ${state.key}`;
  if (options.body) headers["Content-Type"] = "application/json";
  const r = await fetch(path, { ...options, headers });
  if (!r.ok) {
    let message = `${r.status} ${r.statusText}`;
    try { message = (await r.json()).error.message || message; } catch (_) { /* not JSON */ }
    throw new ApiError(r.status, message, r.headers.get("Retry-After"));
  }
  return r;
}

function showError(e) {
  const box = $("error");
  let text = e.message || String(e);
  if (e.status === 401) text = `The server refused this key (401): ${text} Check the key and sign in again.`;
  else if (e.status === 429) text = `The server is busy (429). Try again in ${e.retryAfter || "a few"} seconds.`;
  else if (e.status === 403) text = `Not allowed (403): ${text}`;
  else if (e.status) text = `Error ${e.status}: ${text}`;
  box.textContent = text;
  box.hidden = false;
}

function clearError() { $("error").hidden = true; }

// -- sign in -------------------------------------------------------------------------------------------

async function signIn(key) {
  state.key = key;
  try {
    state.me = await (await api("/v1/me")).json();
  } catch (e) {
    state.key = "";
    sessionStorage.removeItem("kvfuse-key");
    showError(e);
    return;
  }
  sessionStorage.setItem("kvfuse-key", key);
  clearError();
  $("signin").hidden = true;
  $("app").hidden = false;
  $("signout").hidden = false;
  $("who").textContent = `${state.me.tenant ? "tenant " + state.me.tenant : "no tenant"}${state.me.admin ? " (admin)" : ""}`
    + ` · model ${state.me.model}`;
  const kbs = Object.keys(state.me.kbs);
  $("kb").replaceChildren(...kbs.map((k) => el("option", { value: k }, k)));
  fillGroups();
  // one tab alone is no choice: only an admin, who also has Documents and Usage, sees the tabs
  $("tabs").hidden = !state.me.admin;
  showTab("ask");
  if (!kbs.length) showError(new Error("This key may read no knowledge base."));
}

function fillGroups() {
  const groups = (state.me && state.me.kbs[$("kb").value]) || [];
  $("group").replaceChildren(...groups.map((g) => el("option", { value: g }, g)));
  newConversation();
}

function signOut() {
  sessionStorage.removeItem("kvfuse-key");
  state.key = "";
  state.me = null;
  $("app").hidden = true;
  $("signin").hidden = false;
  $("signout").hidden = true;
  $("who").textContent = "";
}

// -- asking --------------------------------------------------------------------------------------------

function newConversation() {
  state.messages = [];
  $("conversation").replaceChildren();
}

async function ask(question) {
  clearError();
  const turn = el("div", { class: "turn" }, el("div", { class: "q" }, question));
  const answer = el("div", { class: "answer" });
  const meta = el("div", { class: "meta" }, "waiting for the first token…");
  turn.append(answer, meta);
  $("conversation").append(turn);
  $("ask").disabled = true;
  // the knowledge base's own layout, as `kvfuse ask` asks: the conversation so far, then the question;
  // the earlier turns follow the cached prefix, so they are read from the cache too
  const prompt = state.messages.map(([q, a]) => `Question: ${q}\nAnswer: ${a}\n`).join("")
    + `Question: ${question.split(/\s+/).join(" ")}\nAnswer:`;
  const sent = performance.now();
  let text = "", final = null;
  const slow = setTimeout(() => {  // a cold knowledge base is built before its first answer
    if (!text) meta.textContent = "waiting for the first token… (a knowledge base that is not cached yet is built "
      + "first: that can take a minute)";
  }, 2000);
  try {
    const r = await api("/v1/completions", {
      method: "POST",
      body: JSON.stringify({ prompt, kb: $("kb").value, stream: true, max_tokens: 48, temperature: 0, stop: ["\n"],
                             kvfuse: { group: $("group").value, quote: true, question } }),
    });
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const line = buffer.slice(0, cut).trim();
        buffer = buffer.slice(cut + 2);
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const event = JSON.parse(line.slice(6));
        if (event.error) throw new ApiError(500, event.error.message);
        const delta = event.choices && event.choices[0] ? event.choices[0].text : "";
        if (delta) {
          if (!text.trim() && delta.trim()) turn.dataset.firstCharMs = (performance.now() - sent).toFixed(1);
          text += delta;
          answer.textContent = text.trim();
        }
        if (event.kvfuse) final = event.kvfuse;
      }
    }
  } catch (e) {
    clearTimeout(slow);
    meta.textContent = "";
    showError(e);
    $("ask").disabled = false;
    return;
  }
  clearTimeout(slow);
  $("ask").disabled = false;
  state.messages = [...state.messages, [question.split(/\s+/).join(" "), text.trim()]];
  if (!final) return;
  turn.dataset.ttftS = final.ttft_s;
  turn.dataset.clientTtftS = final.client_ttft_s;
  renderChecks(turn, final);
  const cost = final.cost_units ? ` · cost ${Math.round(final.cost_units.total)} units` : "";
  meta.textContent = `TTFT ${(final.ttft_s * 1000).toFixed(0)} ms (as you waited ${(final.client_ttft_s * 1000).toFixed(0)} ms)`
    + ` · cached ${(final.cached_token_share * 100).toFixed(1)}% of the prompt${cost}`;
  turn.append(meta);
}

const STATES = {
  verified: ["ok", "verified quote"],
  not_found: ["bad", "quote not found in the sources"],
  no_usable_quote: ["bad", "no usable quote"],
  retrieved: ["warn", "found by search, not quoted by the model"],
};

function renderChecks(turn, k) {
  renderDispute(turn, k.conflicts || []);
  for (const c of k.citations || []) {
    // green only for a verified quote that supports the answer; one that exists but does not is plain
    const [kind, label] = c.state === "verified" && !c.supports ? ["plain", "quote found in the sources"]
      : STATES[c.state] || ["warn", c.state];
    const verdict = c.doc_id ? (c.supports ? el("span", { class: "badge ok" }, "supports the answer")
      : el("span", { class: "badge warn" }, "does not support the answer"))
      : null;
    const quote = c.doc_id && c.start !== null
      ? el("a", { on: { click: () => openDoc(c.doc_id, c.start, c.end, "") } }, `“${c.quote}”`) : `“${c.quote}”`;
    turn.append(el("div", { class: "cite" }, el("span", { class: `badge ${kind}` }, label), verdict,
                   c.doc_id ? `${c.doc_id}: ` : "", quote));
  }
  for (const x of k.conflicts || []) {
    turn.append(el("div", { class: "conflict" }, el("span", { class: "badge bad" }, "conflict"),
      `${x.doc_id} states ${x.found}, not ${x.stated}: `,
      el("a", { on: { click: () => openDoc(x.doc_id, x.start, x.end, "other") } }, `“${x.quote}”`)));
  }
}

// A conflict disputes the answer itself: it is marked, and the knowledge base's value stands beside it.
function renderDispute(turn, conflicts) {
  if (!conflicts.length) return;
  const answer = turn.querySelector(".answer");
  answer.classList.add("disputed");
  turn.classList.add("disputed");
  const says = conflicts.map((x, i) => [i ? "; " : "", `${x.found_text || x.found} (`,
    el("a", { on: { click: () => openDoc(x.doc_id, x.start, x.end, "other") } }, x.doc_id), `), not ${x.stated}`]);
  answer.after(el("div", { class: "dispute", role: "note" }, "The knowledge base says ", ...says.flat(),
                  ". Check the source before you answer."));
}

async function openDoc(id, start, end, cls) {
  try {
    const d = await (await api(`/v1/kb/${encodeURIComponent($("kb").value)}/documents/${encodeURIComponent(id)}`)).json();
    $("viewer-title").textContent = `${d.title} [${d.id}]`;
    const mark = el("mark", { class: cls }, d.text.slice(start, end));
    const text = $("viewer-text");
    text.replaceChildren(d.text.slice(0, start), mark, d.text.slice(end));
    $("viewer").hidden = false;
    // scroll the text alone (scrollIntoView would scroll the viewer's header away too)
    text.scrollTop = Math.max(0, mark.offsetTop - text.offsetTop - text.clientHeight / 2);
  } catch (e) { showError(e); }
}

// -- documents (admin) -----------------------------------------------------------------------------------

async function loadDocs() {
  try {
    const info = await (await api(`/v1/kb/${encodeURIComponent($("kb").value)}`)).json();
    $("doc-list").tBodies[0].replaceChildren(...info.documents.map((d) => el("tr",
      { class: "doc", "data-id": d.id, on: { click: () => editDoc(d.id) } },
      el("td", {}, d.title), el("td", {}, String(d.stability)), el("td", {}, d.groups.join(", ")))));
    renderUsage(info);
  } catch (e) { showError(e); }
}

async function editDoc(id) {
  const d = await (await api(`/v1/kb/${encodeURIComponent($("kb").value)}/documents/${encodeURIComponent(id)}`)).json();
  $("doc-form").hidden = false;
  $("doc-form").dataset.id = d.id;
  $("doc-form-title").textContent = d.id;
  $("doc-title").value = d.title;
  $("doc-stability").value = d.stability;
  $("doc-groups").value = d.groups.join(", ");
  $("doc-text").value = d.text;
  $("rebuild").textContent = "";
}

async function rebuild(request, what) {
  clearError();
  const started = performance.now();
  const status = $("rebuild");
  const tick = () => { status.textContent = `${what}: rebuilding the cached prefix… ${((performance.now() - started) / 1000).toFixed(1)} s`; };
  tick();
  const timer = setInterval(tick, 200);
  try {
    const out = await (await request()).json();
    clearInterval(timer);  // before the outcome is written: a late tick would overwrite it
    const built = out.builds.map((b) => `${b.group}: ${b.tokens_recomputed} tokens recomputed in ${b.build_s.toFixed(2)} s`);
    status.textContent = `${what}: done. ` + (built.length ? `Rebuilt ${built.join("; ")}.`
      : "Nothing cached had to be recomputed (no prefix of these groups has been read yet, or the change "
        + "falls after the last cached block); the next question builds what it needs.")
      + (out.rebuilds_queued ? ` ${out.rebuilds_queued} more rebuilding in the background.` : "");
    status.dataset.done = "1";
    await loadDocs();
  } catch (e) {
    status.textContent = "";
    showError(e);
  } finally {
    clearInterval(timer);
  }
}

function saveDoc(ev) {
  ev.preventDefault();
  const id = $("doc-form").dataset.id;
  const body = { id, title: $("doc-title").value, text: $("doc-text").value,
                 stability: Number($("doc-stability").value),
                 groups: $("doc-groups").value.split(",").map((g) => g.trim()).filter(Boolean) };
  $("rebuild").dataset.done = "";
  rebuild(() => api(`/v1/kb/${encodeURIComponent($("kb").value)}/documents`, { method: "POST", body: JSON.stringify(body) }),
          `Saved ${id}`);
}

function deleteDoc() {
  const id = $("doc-form").dataset.id;
  if (!confirm(`Delete ${id}?`)) return;
  $("rebuild").dataset.done = "";
  rebuild(() => api(`/v1/kb/${encodeURIComponent($("kb").value)}/documents/${encodeURIComponent(id)}`, { method: "DELETE" }),
          `Deleted ${id}`);
  $("doc-form").hidden = true;
}

// -- usage (admin) --------------------------------------------------------------------------------------

function chart(history) {
  const w = 420, h = 120, ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "chart");
  svg.setAttribute("width", w);
  svg.setAttribute("height", h);
  if (history.length) {
    const t0 = history[0][0], t1 = history[history.length - 1][0] || t0 + 1;
    const pts = history.map(([t, s]) => `${(10 + (w - 20) * (t1 > t0 ? (t - t0) / (t1 - t0) : 1)).toFixed(1)},`
      + `${(h - 10 - (h - 20) * s).toFixed(1)}`);
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", pts.join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", "#1f5fa8");
    line.setAttribute("stroke-width", "2");
    svg.append(line);
    for (const p of pts) {  // each question, so one question still shows
      const [x, y] = p.split(",");
      const dot = document.createElementNS(ns, "circle");
      dot.setAttribute("cx", x);
      dot.setAttribute("cy", y);
      dot.setAttribute("r", "3");
      dot.setAttribute("fill", "#1f5fa8");
      svg.append(dot);
    }
  }
  const label = document.createElementNS(ns, "text");
  label.setAttribute("x", 12);
  label.setAttribute("y", 16);
  label.setAttribute("font-size", 11);
  label.textContent = "cached-token share over time (0–100%)";
  svg.append(label);
  return svg;
}

function renderUsage(info) {
  const groups = Object.entries(info.usage || {});
  if (!groups.length) {
    $("usage").replaceChildren(el("p", { class: "muted" }, "No questions yet."));
    return;
  }
  $("usage").replaceChildren(...groups.map(([g, u]) => el("div", { class: "group-usage", "data-group": g },
    el("h3", {}, `Group ${g}`),
    el("p", {}, `${u.requests} questions · cached-token share ${(100 * u.cached_tokens / Math.max(1, u.prompt_tokens)).toFixed(1)}%`),
    el("p", {}, `Cost: ${Math.round(u.cost_units || 0)} units, against ${Math.round(u.no_cache_units)} without a cache `
      + `and ${Math.round(u.rag_units)} with RAG`),
    chart(u.history || []))));
}

// -- wiring -------------------------------------------------------------------------------------------

function showTab(name) {
  for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t.dataset.tab === name);
  for (const b of document.querySelectorAll(".tab-body")) b.hidden = b.id !== `tab-${name}`;
  if (name !== "ask") loadDocs();
}

$("signin-form").addEventListener("submit", (ev) => { ev.preventDefault(); signIn($("key").value.trim()); });
$("signout").addEventListener("click", signOut);
$("kb").addEventListener("change", fillGroups);
$("group").addEventListener("change", newConversation);
for (const t of document.querySelectorAll(".tab")) t.addEventListener("click", () => showTab(t.dataset.tab));
$("ask-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const q = $("question").value.trim();
  if (!q) return;
  $("question").value = "";
  ask(q);
});
$("new-conversation").addEventListener("click", newConversation);
$("viewer-close").addEventListener("click", () => { $("viewer").hidden = true; });
$("doc-form").addEventListener("submit", saveDoc);
$("doc-delete").addEventListener("click", deleteDoc);
if (state.key) signIn(state.key);
