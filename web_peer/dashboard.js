// The dashboard: the swarm as its coordinator sees it, and a chat box. Served by the coordinator's
// API server at /dashboard/, opened as https://HOST:PORT/dashboard/#<swarm key code>.
//
// The key stays in the fragment (never sent); the page derives the API's bearer token from it
// (HKDF-SHA256, label "api-token", hex — SwarmKey.api_token in Python) and uses it for
//   GET  /dashboard/state          the status document (peers, plan, events, measurements) + generations
//                                  + shares: each peer's share as the coordinator computed it, drawn as is
//   POST /v1/chat/completions      the chat, streamed (Server-Sent Events), with the CLI's parameters
// The state is polled every POLL_MS. window.colibriDashboard exposes the last state for tests.
import { deriveKey, hex, parseSwarmKey } from "./auth.js";
import { drawShare } from "./share.js";

const POLL_MS = 1000;
const EVENTS_SHOWN = 30;
const $ = (id) => document.getElementById(id);
const app = { state: null, token: null, messages: [] };
globalThis.colibriDashboard = app;

/** The API's bearer token for a 32-byte swarm key: 64 hex digits. */
export async function apiToken(swarmKey) {
  return hex(await deriveKey(swarmKey, "api-token"));
}

/** "Mac", "Linux" or "phone" (any browser peer) for a peer of the status document. */
export function peerKind(peer, doc) {
  if (peer.kind === "browser") return "phone";
  if (peer.peer_id === doc.peer_id) return doc.system === "Darwin" ? "Mac" : doc.system || "Linux";
  return peer.arch === "arm64" ? "Mac" : "Linux";  // macOS reports arm64, Linux aarch64 / x86_64
}

const mib = (bytes) => (bytes === null || bytes === undefined ? "–" : `${(bytes / 2 ** 20).toFixed(bytes < 2 ** 20 ? 2 : 0)} MiB`);

const LABELS = [...document.querySelectorAll("#peers thead th")].map((th) => th.textContent);

function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  td.dataset.label = LABELS[tr.children.length] ?? "";  // shown on a phone, where the header is not
  if (cls) td.className = cls;
  tr.append(td);
  return td;
}

// The plan's workers as the coordinator counts them (shares.workers: a span of a layer or a stage;
// under stages the plan's own `peers` name the coordinator alone).
function role(peerId, doc, plan) {
  if (peerId === doc.peer_id) return doc.role;
  if (plan?.coordinator === peerId) return "coordinator";
  return doc.shares?.workers?.includes(peerId) ? "worker" : "no work";
}

function renderPeers(doc) {
  const plan = doc.placement ?? null;
  const shares = doc.shares?.peers ?? {};
  const observed = doc.observed?.peers ?? {};
  const me = { peer_id: doc.peer_id, name: doc.name, kind: "python", rtt_ms: null, memory_budget: doc.memory_budget, ffn_gflops: doc.ffn_gflops };
  const body = $("peers").tBodies[0];
  body.replaceChildren();
  // In the plan's layer order (the coordinator's shares.order): a stage's or a range's layer, then the peer.
  const order = doc.shares?.order ?? [];
  const rank = (p) => (order.includes(p.peer_id) ? order.indexOf(p.peer_id) : order.length);
  for (const p of [me, ...(doc.peers ?? [])].sort((a, b) => rank(a) - rank(b))) {
    const tr = document.createElement("tr");
    tr.dataset.peer = p.peer_id;
    const name = cell(tr, "", "name");
    name.append(p.name || "?", Object.assign(document.createElement("small"), { textContent: p.peer_id }));
    cell(tr, peerKind(p, doc));
    cell(tr, role(p.peer_id, doc, plan), "role");
    cell(tr, p.peer_id === doc.peer_id ? "this peer" : p.rtt_ms === null || p.rtt_ms === undefined ? (p.linked ? "–" : "no link") : `${p.rtt_ms.toFixed(1)} ms`);
    const o = observed[p.peer_id];
    // Used: what the peer says it allocated (a browser: its GPU buffers), else the plan's count.
    cell(tr, `${mib(p.memory_budget)} / ${mib(p.weight_bytes ?? o?.weight_bytes)}`);
    const speed = [p.ffn_gflops ? `${p.ffn_gflops.toFixed(1)} GFLOP/s measured` : null,
      o?.ms_per_row ? `${o.ms_per_row.toFixed(3)} ms/row observed` : null, o?.failed ? "marked down" : null].filter(Boolean);
    cell(tr, speed.join(", ") || "–");
    const share = cell(tr, "", "share");
    const s = shares[p.peer_id];
    const pct = 100 * (s?.fraction ?? 0);
    const top = Object.assign(document.createElement("div"), { className: "share-pct", textContent: plan && s ? `${pct.toFixed(pct && pct < 10 ? 1 : 0)} %` : "–" });
    const picture = Object.assign(document.createElement("div"), { className: "share-picture-box" });
    drawShare(picture, (s?.layers ?? []).map(([layer, fraction]) => ({ layer, fraction })), { height: 24 });
    // A page the plan gives no work: why it stands by, in the coordinator's words.
    const standby = plan?.standby?.[p.peer_id]?.message;
    const words = Object.assign(document.createElement("div"), { className: "share-words",
      textContent: standby ? `standing by — ${standby}` : s?.layers.length ? s.words : "" });
    share.append(top, picture, words);
    body.append(tr);
  }
}

function renderPlan(doc) {
  const plan = doc.placement;
  $("plan-version").textContent = plan ? `v${plan.version} · term ${plan.term}` : "";
  if (!plan) { $("plan-summary").textContent = "no plan yet"; $("plan-json").textContent = ""; $("plan-shortfall").textContent = ""; $("plan-why").textContent = ""; return; }
  const kind = { dense: "dense MLP rows", stage: "whole-layer stages" };
  const what = Object.entries(doc.shares?.kinds ?? {})
    .map(([k, n]) => `${n} layer${n === 1 ? "" : "s"} of ${kind[k] ?? k}`).join(", ");
  // Fields other than the per-layer spans (e.g. stages), as they are: the page does not need to know them.
  const perLayer = (v) => v && typeof v === "object" && !Array.isArray(v) && Object.keys(v).every((l) => /^\d+$/.test(l));
  // The swarm cannot hold the model: what is missing and the speed to expect, in the coordinator's words.
  $("plan-shortfall").textContent = plan.shortfall?.message ? `memory: ${plan.shortfall.message}` : "";
  // Why the cost model chose this layout (e.g. stages for throughput with several users), in one line.
  const cost = plan.cost, n = cost?.sequences ?? 1;
  $("plan-why").textContent = cost ? `${cost.choice ?? plan.layout ?? ""} for ${n} sequence${n === 1 ? "" : "s"}${cost.why ? `: ${cost.why}` : ""}` : "";
  const other = Object.entries(plan).filter(([k, v]) => !["version", "term", "coordinator", "peers", "shortfall", "cost", "standby"].includes(k) && !perLayer(v))
    .map(([k, v]) => `${k} ${typeof v === "object" ? JSON.stringify(v) : v}`);
  const working = 1 + (doc.shares?.workers?.length ?? 0);  // the coordinator and its workers
  const rest = other.length ? ` · ${other.join(" · ")}` : "";
  $("plan-summary").textContent = `${working} peer${working === 1 ? "" : "s"} over ${what || "no layers"}${rest}`;
  $("plan-json").textContent = JSON.stringify(plan, null, 1);
}

function renderSpeed(doc) {
  const gens = doc.generations ?? [];
  const last = gens.at(-1);
  $("tps").textContent = last?.tokens_per_s ? last.tokens_per_s.toFixed(1) : "–";
  $("generations").replaceChildren(...gens.slice(-8).reverse().map((g) => Object.assign(document.createElement("li"), {
    textContent: `${new Date(g.t * 1000).toLocaleTimeString()} · ${g.completion_tokens} tokens in ${g.seconds.toFixed(2)} s · ${g.tokens_per_s?.toFixed(1) ?? "–"} tokens/s (prompt ${g.prompt_tokens})`,
  })));
}

function renderEvents(doc) {
  const events = (doc.events ?? []).slice(-EVENTS_SHOWN).reverse();
  $("events").replaceChildren(...events.map((e) => {
    const li = document.createElement("li");
    li.dataset.what = e.what;
    li.dataset.peer = e.peer_id;
    li.textContent = `${new Date(e.t * 1000).toLocaleTimeString()} ${e.what} ${e.name || ""} ${e.peer_id ? `(${e.peer_id.slice(0, 12)}…)` : ""} ${e.detail || ""}`.replace(/\s+/g, " ").trim();
    return li;
  }));
}

function render(doc) {
  app.state = doc;
  const plan = doc.placement;
  const coord = plan?.coordinator === doc.peer_id ? doc.name : plan?.coordinator ?? "–";
  $("summary").textContent = `swarm ${doc.swarm_id} · ${1 + (doc.peers?.length ?? 0)} peers · coordinated by ${coord}`;
  renderPeers(doc);
  renderPlan(doc);
  renderSpeed(doc);
  renderEvents(doc);
}

async function api(path, init = {}) {
  const response = await fetch(path, { ...init, headers: { ...init.headers, Authorization: `Bearer ${app.token}` } });
  if (!response.ok) {
    let why = `${response.status} ${response.statusText}`, error = null;
    try { error = (await response.json()).error ?? null; why = error?.message ?? why; } catch { /* not JSON */ }
    throw Object.assign(new Error(why), { error });
  }
  return response;
}

/** Where to go when this server stepped down and names the swarm's coordinator now (same scheme:
 *  the key in the fragment goes nowhere but to a page served the same way); null otherwise. */
export function followUrl(error, here) {
  const url = error?.code === "coordinator_changed" ? error.coordinator_url : null;
  if (typeof url !== "string") return null;
  let next;
  try { next = new URL("/dashboard/", url); } catch { return null; }
  if (next.protocol !== here.protocol || next.origin === here.origin) return null;
  return next.href + here.hash;
}

async function poll() {
  try {
    render(await (await api("/dashboard/state")).json());
    $("error").textContent = "";
  } catch (e) {
    const next = followUrl(e.error, window.location);
    if (next) {
      $("error").textContent = `the coordinator changed: following it to ${new URL(next).host}`;
      window.location.assign(next);
      return;
    }
    $("error").textContent = `cannot read the swarm's state: ${e.message}`;
  }
  setTimeout(poll, POLL_MS);
}

// ---- chat -------------------------------------------------------------------------------------

function bubble(roleName, text) {
  const div = Object.assign(document.createElement("div"), { className: `msg ${roleName}`, textContent: text });
  $("transcript").append(div);
  return div;
}

/** The request body: the conversation so far and the CLI's parameters (greedy by default). */
function chatBody() {
  const num = (id) => ($(id).value === "" ? null : Number($(id).value));
  const system = $("system").value.trim();
  const body = {
    messages: [...(system ? [{ role: "system", content: system }] : []), ...app.messages],
    stream: true, max_tokens: num("max_tokens"), temperature: num("temperature"), top_p: num("top_p"), top_k: num("top_k"),
  };
  if (num("seed") !== null) body.seed = num("seed");
  return body;
}

/** Stream one reply into `out`; returns its text. Throws with the API's error message. */
async function streamReply(body, out) {
  const response = await api("/v1/chat/completions", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "", text = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return text;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {  // one Server-Sent Event per blank line
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (!data || data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const piece = chunk.choices?.[0]?.delta?.content;
      if (piece) { text += piece; out.textContent = text; }
    }
  }
}

async function send(ev) {
  ev.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt) return;
  $("send").disabled = true;
  app.messages.push({ role: "user", content: prompt });
  bubble("user", prompt);
  $("prompt").value = "";
  const out = bubble("assistant", "");
  out.classList.add("streaming");
  try {
    const text = await streamReply(chatBody(), out);
    app.messages.push({ role: "assistant", content: text });
  } catch (e) {
    app.messages.pop();
    out.classList.add("failed");
    out.textContent = `(no reply: ${e.message})`;
  } finally {
    out.classList.remove("streaming");
    $("send").disabled = false;
  }
}

async function main() {
  if (!globalThis.crypto?.subtle) {  // WebCrypto exists only in secure contexts: HTTPS or localhost
    $("summary").textContent = "Needs HTTPS";
    $("error").textContent = "This page derives the API token with WebCrypto, which browsers offer only over HTTPS " +
      "(or on localhost): open the https:// dashboard link that `colibri-swarm join` prints on the coordinator.";
    return;
  }
  let key;
  try {
    key = await parseSwarmKey(location.hash);
  } catch (e) {
    $("summary").textContent = "No swarm key";
    $("error").textContent = `${e.message} (open the dashboard link that \`colibri-swarm join\` prints on the coordinator)`;
    return;
  }
  app.token = await apiToken(key);
  $("chat").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("chat").requestSubmit(); } });
  $("reset").addEventListener("click", () => { app.messages = []; $("transcript").replaceChildren(); });
  api("/v1/models").then((r) => r.json()).then((m) => { $("model").textContent = m.data?.[0]?.id ?? ""; }).catch(() => {});
  poll();
}

if ($("peers")) main().catch((e) => { $("error").textContent = e.message; console.error(e); });
