// The peer page: joins the swarm whose key is in the URL fragment and serves FFN work with WebGPU.
//
//   https://<host>:<port>/#<swarm key code>[?name=…]   (printed as a QR code by `colibri-swarm join`)
// Query options: name (shown to the swarm), format (f32 | f16 | q8: how F32/F16/BF16 slices are
// held on the GPU; Q4_0/Q4_1/Q8_0 slices stay in their blocks), budget (bytes of weights this
// page offers, counted as held), signal (a wss:// URL instead of this server's).
//
// Flow: key from the fragment → WebGPU adapter (none: "cannot serve") → identity → signaling
// (wrong key: "refused", told so) → offer a link to every Python peer, keep the one that answers
// (only the coordinator answers browsers) → channel auth + Hello → worker serves until the link
// drops, then offer again; "Stop" closes the link and the signaling session and stays out.
// window.colibri exposes the live objects for tests (events: each state entered, in order).
import { parseSwarmKey, deriveKey, AuthenticationError, KeyCodeError } from "./auth.js";
import { BLOCK_FORMATS, GpuContext, NoWebGPUError } from "./gpu.js";
import { FfnBlock } from "./ffn.js";
import { PeerLink } from "./peerlink.js";
import { SignalingClient, signalingUrl } from "./signaling.js";
import { loadIdentity } from "./storage.js";
import { BrowserWorker } from "./worker.js";
import { PROTOCOL_VERSION } from "./wire.js";
import * as ui from "./ui.js";

const RETRY_S = 2;
const PACE_WINDOW_MS = 10000;  // the swarm's tokens/s: requests answered in the last 10 s
const params = new URLSearchParams(location.search);
const app = { state: "starting", events: [], stopped: false };
globalThis.colibri = app;

/** Enter `state` (a new entry in app.events only when the state changes, not on every refresh). */
function set(state, detail = "") {
  if (app.state !== state) app.events.push(state);
  app.state = state;
  ui.setState(state, detail);
}

/** Tokens/s of the swarm as this page sees it: on its first layer, each dense request carries
 * every token's row and each expert request one step. Null before two requests in the window. */
function swarmPace(recent) {
  const now = performance.now();
  const rows = recent.filter((r) => now - r.t < PACE_WINDOW_MS);
  if (!rows.length) return null;
  const first = Math.min(...rows.map((r) => r.layer));
  const mine = rows.filter((r) => r.layer === first);
  if (mine.length < 2) return null;
  const span = (mine.at(-1).t - mine[0].t) / 1000;
  return span > 0 ? mine.slice(1).reduce((s, r) => s + r.tokens, 0) / span : null;
}

/** GFLOP/s of a small SwiGLU block on this GPU (placement weighs peers by it); ~50 ms. */
async function measureGflops(gpu) {
  const h = 256, f = 512, t = 4;
  const w = (n) => Float32Array.from({ length: n }, (_, i) => Math.sin(i) / 16);
  const block = new FfnBlock(gpu, { hidden: h, inter: f, fmt: "f32", wGate: w(f * h), wUp: w(f * h), wDown: w(h * f) });
  await block.run(w(t * h), t);
  const t0 = performance.now();
  for (let i = 0; i < 3; i++) await block.run(w(t * h), t);
  const s = (performance.now() - t0) / 3000;
  block.release();
  return (6 * t * h * f) / s / 1e9;
}

/** Bytes of weights this page offers: ?budget=, else a quarter of the device's memory. */
/**
 * The Hello's build.blas: "webgpu", the block kernels this page has, which the coordinator reads
 * (swarm/peer/weights/repack.py page_encodings) to ship those GGUF types as in the file, and the
 * notices it reads (swarm/peer/coordinator/standby.py: a Standby says why it gets no work).
 */
function kernelsBlas() {
  return `webgpu kernels:${BLOCK_FORMATS.join(",")} notices:standby,other_numerics`;
}

function memoryBudget() {
  if (params.has("budget")) return Math.max(0, Math.floor(Number(params.get("budget")) || 0));
  // navigator.deviceMemory is rounded and capped at 8 GiB by browsers; 4 GiB when unknown.
  return Math.floor(((navigator.deviceMemory ?? 4) * 2 ** 30) / 4);
}

let wakeLock = null;
async function keepAwake(on) {
  try {
    if (on && !wakeLock && navigator.wakeLock) {
      wakeLock = await navigator.wakeLock.request("screen");
      wakeLock.addEventListener("release", () => { wakeLock = null; });
    } else if (!on && wakeLock) {
      await wakeLock.release();
      wakeLock = null;
    }
  } catch { /* not allowed (hidden tab, no user gesture): the page still serves */ }
}
document.addEventListener("visibilitychange", () => { if (document.visibilityState === "visible" && app.state === "serving") keepAwake(true); });

const loadBatch = new Set();  // slice ids of the load in progress (finished ones included)
// Highest percentage shown for the load in progress: a slice announced after others have progressed
// adds to the total, and a progress bar that falls back reads as lost work.
let loadPeak = 0;

function render() {
  const w = app.worker;
  if (!w || app.stopped) return;
  // A slice loads until it is on the GPU (fetched, checked, decoded, uploaded) or has failed.
  const pending = (d) => !d.installed && !d.failed;
  for (const [id, d] of w.downloads) if (pending(d)) loadBatch.add(id);
  const batch = [...loadBatch].map((id) => w.downloads.get(id));
  const loading = batch.some(pending);
  if (!loading) {
    loadBatch.clear();
    loadPeak = 0;
  }
  if (app.link?.state === "open") {
    if (loading) {
      set("loading");
      const total = batch.reduce((s, d) => s + d.total, 0);
      const pct = total ? Math.floor((100 * batch.reduce((s, d) => s + d.done, 0)) / total) : 0;
      loadPeak = Math.max(loadPeak, pct);
      ui.setProgress(loadPeak);
    } else if (w.blocks.size) {  // weights on the GPU: requests for them are answered
      set("serving", `${(w.gpuBytes / 2 ** 20).toFixed(1)} MiB of weights on the GPU`);
      keepAwake(true);
    } else if (w.standby) {  // the newest plan gives this page no work, and the coordinator said why
      set("standby", w.standby.message);
      keepAwake(false);
    } else {  // no plan yet, or one from a coordinator that sends no Standby: not serving
      set("authenticated", !w.planVersion ? "" : w.assignments.length ? "waiting for this page's weights"
        : `plan v${w.planVersion} gives this phone no work`);
      keepAwake(false);
    }
  }
  ui.showShare(w.planAssignments, w.peerId, [...w.blocks.keys()]);
  const pace = swarmPace(w.recent);
  ui.setFacts({
    served: String(w.stats.served),
    ms: w.stats.served ? `${(w.stats.msTotal / w.stats.served).toFixed(1)} ms average, ${w.stats.lastMs.toFixed(1)} ms last` : "–",
    tps: pace === null ? "–" : `about ${pace.toFixed(1)} tokens/s`,
  });
  ui.showError(w.lastError ?? "");
}

/** Leave the swarm: close the link and the signaling session, release the wake lock, stay out. */
async function stop() {
  app.stopped = true;
  document.getElementById("stop").disabled = true;
  app.link?.close("the user stopped this peer");
  app.signaling?.close();
  await keepAwake(false);
  set("stopped", "Reload the page to join again.");
}
document.getElementById("stop").addEventListener("click", () => { stop().catch((e) => console.error(e)); });

async function main() {
  let swarmKey;
  try {
    swarmKey = await parseSwarmKey(location.hash);
  } catch (e) {
    set("refused", e.message);
    return;
  }
  let gpu;
  try {
    gpu = await GpuContext.create();
  } catch (e) {
    set("cannot-serve", e instanceof NoWebGPUError ? `${e.message}. Try a recent Chrome, Edge or Safari on this device.` : e.message);
    return;
  }
  const { peerId, certificate } = await loadIdentity();
  const authKey = await deriveKey(swarmKey, "channel-auth");
  const d = gpu.describe();
  ui.setFacts({ peer: `${params.get("name") ?? "browser"} · ${peerId.slice(0, 12)}…`, gpu: `${d.description || d.device || d.vendor || "WebGPU adapter"} (${d.formats.join(", ")})` });
  const format = params.get("format") ?? "f32";
  const worker = new BrowserWorker(gpu, { peerId, format, onchange: render });
  app.worker = worker;
  app.peerId = peerId;
  const hello = {
    peer_id: peerId, protocol_version: PROTOCOL_VERSION,
    build: { package: "web_peer", numpy: "", blas: kernelsBlas(), arch: d.description || d.architecture || "webgpu", kernel_dtype: gpu.formats.includes(format) ? format : "f32" },
    model_hash: null, memory_budget: memoryBudget(), ffn_gflops: await measureGflops(gpu), peer_kind: "browser",
    adapter_limits: d.limits, adapter_features: d.features, name: (params.get("name") ?? "browser").slice(0, 64),
    gpu_memory: 0,  // a page's GPU memory is its memory_budget (what its buffers may take)
  };

  setInterval(render, 1000);  // the swarm's pace decays when requests stop
  while (!app.stopped) {  // one signaling session per iteration
    set("connecting");
    let sig;
    try {
      sig = await SignalingClient.connect(params.get("signal") ?? signalingUrl(), swarmKey, peerId, hello.name);
    } catch (e) {
      if (app.stopped) return;
      if (e instanceof AuthenticationError || e instanceof KeyCodeError) { set("refused", e.message); return; }
      set("disconnected", e.message);
      await new Promise((r) => setTimeout(r, RETRY_S * 1000));
      continue;
    }
    app.signaling = sig;
    const attempts = new Map();  // remote peer id → PeerLink being tried
    const closed = new Promise((resolve) => { sig.onclose = (code, why) => resolve(why); });
    const tryPeers = () => {
      if (app.link?.state === "open") return;
      for (const p of sig.peers.values()) {
        if (p.kind !== "python" || attempts.has(p.peer)) continue;
        const link = new PeerLink({ signaling: sig, remotePeerId: p.peer, localPeerId: peerId, authKey, certificate, hello });
        attempts.set(p.peer, link);
        link.onopen = () => {
          for (const [other, l] of attempts) if (l !== link) { l.close("another peer answered"); attempts.delete(other); }
          app.link = link;
          worker.attach(link);
          set("authenticated");
          ui.setFacts({ coordinator: `${link.remoteHello.name} (${link.remotePeerId})` });
          render();
        };
        link.onclose = (reason) => {
          attempts.delete(p.peer);
          if (link.authError) { set("refused", link.authError.message); return; }
          if (app.stopped) return;
          if (app.link === link) {
            app.link = null;
            keepAwake(false);
            set("disconnected", reason);
          }
          setTimeout(tryPeers, RETRY_S * 1000);
        };
        link.offer().catch((e) => link.close(e.message));
      }
    };
    sig.onsignal = (from, data) => attempts.get(from)?.handleSignal(data).catch((e) => attempts.get(from)?.close(e.message));
    sig.onpresence = tryPeers;
    tryPeers();
    const why = await closed;
    for (const l of attempts.values()) l.close("signaling closed");
    if (app.stopped) return;
    if (app.state !== "refused") set("disconnected", why);
    await new Promise((r) => setTimeout(r, RETRY_S * 1000));
  }
}

main().catch((e) => { set("error", e.message); console.error(e); });
