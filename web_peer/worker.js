// The browser worker: holds the slices the coordinator assigns, serves ExpertRequest and
// DenseRequest with the WebGPU kernels. The Python twin is swarm/peer/worker/ffn.py.
//
// Theory of operation, on one open link to the coordinator:
// - PlanMessage: keep our assignments (layers, experts, dense ranges) for the UI and for term checks.
// - Standby: the coordinator's newest plan gives this page no work, and why: release every weight,
//   keep the reason for the UI until a plan gives work again.
// - WeightManifest (name = slice SHA-256, encoding = "slice/v1 " + meta JSON): take the blob from
//   Cache Storage if it is there (verified), else pull it: WeightChunkRequest runs, at most WINDOW
//   chunks in flight, each chunk checked against the manifest's SHA-256 (never the digest the chunk
//   carries), the whole blob against the slice id; then decode it and upload it to the GPU: GGUF
//   Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K tensors stay in their blocks (compact on the GPU), others go as float32 in `format`.
//   A manifest with `https` is fetched from the shipper's HTTPS slice server first (storage.js
//   fetchSliceHttps, same checks); if that fails the page says why in the console and pulls it here.
// - ExpertRequest / DenseRequest: run each expert / range as one FfnBlock; answer with the same
//   request id, term, plan version and layer. A request for weights we do not hold, a stale
//   term, or any kernel failure → an Error message, so the coordinator recomputes those rows:
//   never a wrong number.
import { FfnBlock, runBlocks } from "./ffn.js";
import { KernelError } from "./gpu.js";
import { decodeSlice, dequantize, SliceError } from "./slices.js";
import { fetchSliceHttps, getSlice, putSlice } from "./storage.js";
import { sha256, hex } from "./auth.js";

export const ENCODING_PREFIX = "slice/v1 ";
export const WINDOW = 8;  // chunks in flight

export class BrowserWorker {
  /**
   * @param {import("./gpu.js").GpuContext} gpu
   * @param {{peerId: string, format?: string, onchange?: Function}} opts  format: GPU weight
   *   format ("f32" keeps the shipped values exactly; "f16"/"q8" hold 2x/4x more)
   */
  constructor(gpu, { peerId, format = "f32", onchange = () => {} }) {
    Object.assign(this, { gpu, peerId, format, onchange });
    this.term = 0;
    this.planVersion = 0;
    this.assignments = [];
    this.planAssignments = [];
    this.standby = null;          // {reason, message} of the last Standby, until a plan gives work
    this.recent = [];             // {t: ms, layer, tokens} of answered requests (the swarm's pace)
    this.blocks = new Map();      // "layer/dense/start/stop" or "layer/expert/e" → FfnBlock
    this.downloads = new Map();   // slice id → {done, total, installed?, failed?} (bytes)
    this.stats = { served: 0, msTotal: 0, lastMs: 0, errors: 0, fetchedBytes: 0, cachedSlices: 0, httpsBytes: 0, channelFallbacks: 0 };
    this.lastError = null;
    this._pending = new Map();    // chunk request id → resolve
    this._nextId = 1;
  }

  /** Route the coordinator's messages on `link` to this worker. */
  attach(link) {
    this.link = link;
    link.on("PlanMessage", (m) => this.onPlan(m));
    link.on("Standby", (m) => this.onStandby(m));
    link.on("WeightManifest", (m, l) => this.onManifest(m, l).catch((e) => {
      const d = this.downloads.get(m.name);
      if (d) d.failed = true;  // no longer loading
      this._fail(`weights ${m.name.slice(0, 12)}: ${e.message}`);
    }));
    link.on("WeightChunk", (m) => this._pending.get(m.request_id)?.(m));
    link.on("ExpertRequest", (m, l) => this.serve(m, l));
    link.on("DenseRequest", (m, l) => this.serve(m, l));
  }

  _fail(message) {
    this.lastError = message;
    this.stats.errors += 1;
    this.onchange();
  }

  onPlan(plan) {
    if (plan.term < this.term) return;
    this.standby = null;
    this._usePlan(plan.term, plan.version, plan.assignments);
  }

  /** Plan `version` of `term` gives this page no work (a Standby): hold nothing, say why. */
  onStandby(m) {
    if (m.term < this.term || (m.term === this.term && m.version < this.planVersion)) return;  // older than the plan in hand
    this.standby = { reason: m.reason, message: m.message };
    this._usePlan(m.term, m.version, []);
  }

  _usePlan(term, version, assignments) {
    this.term = term;
    this.planVersion = version;
    this.planAssignments = assignments;  // every peer's: the page shows its share of the whole
    this.assignments = assignments.filter((a) => a.peer === this.peerId);
    // Weights the new plan no longer gives this peer leave the GPU (a later manifest brings back
    // what a later plan needs; the browser cache keeps the bytes).
    const keep = new Set(this.assignments.flatMap((a) => [
      ...a.dense.map(([s, e]) => `${a.layer}/dense/${s}/${e}`), ...a.experts.map((e) => `${a.layer}/expert/${e}`)]));
    for (const [key, block] of this.blocks) {
      if (!keep.has(key)) { block.release(); this.blocks.delete(key); }
    }
    this.reportHeld();
    this.onchange();
  }

  /** Tell the coordinator what the GPU holds now (WeightsHeld): shown as the memory this peer uses. */
  reportHeld() {
    this.link?.send({ kind: "WeightsHeld", plan_version: this.planVersion, weight_bytes: this.gpuBytes }).catch(() => {});
  }

  /** Bytes of weights held on the GPU. */
  get gpuBytes() {
    let s = 0;
    for (const b of this.blocks.values()) s += b.gpuBytes;
    return s;
  }

  async onManifest(m, link) {
    if (!m.encoding.startsWith(ENCODING_PREFIX)) throw new SliceError(`encoding must start with ${JSON.stringify(ENCODING_PREFIX)}`);
    const meta = JSON.parse(m.encoding.slice(ENCODING_PREFIX.length));
    const id = m.name;
    if (!/^[0-9a-f]{64}$/.test(id)) throw new SliceError("the slice name is not a SHA-256");
    let blob = await getSlice(id);
    if (blob) {
      this.stats.cachedSlices += 1;
    } else {
      blob = (m.https && await this._fetchHttps(m)) || await this._pull(m, link);
      await putSlice(id, blob);
    }
    this._install(decodeSlice(blob, meta, { keepBlocks: true }));
    this.downloads.set(id, { done: m.total_bytes, total: m.total_bytes, installed: true });
    this.reportHeld();
    this.onchange();
  }

  /** The slice from the shipper's HTTPS server, or null (said in the console) to pull it over the link. */
  async _fetchHttps(m) {
    const progress = { done: 0, total: m.total_bytes };
    this.downloads.set(m.name, progress);
    try {
      const blob = await fetchSliceHttps(m, { progress, onprogress: () => this.onchange() });
      this.stats.httpsBytes += m.total_bytes;
      return blob;
    } catch (e) {
      this.stats.channelFallbacks += 1;
      console.warn(`slice ${m.name.slice(0, 12)}: HTTPS fetch failed (${e.message}); fetching it over the data channel (slower)`);
      return null;
    }
  }

  async _pull(m, link) {
    const n = m.chunk_sha256.length;
    const blob = new Uint8Array(m.total_bytes);
    const progress = { done: 0, total: m.total_bytes };
    this.downloads.set(m.name, progress);
    let next = 0;
    const fetchOne = async () => {
      while (next < n) {
        const index = next++;
        for (let attempt = 0; ; attempt++) {
          const rid = this._nextId++;
          const got = new Promise((resolve) => this._pending.set(rid, resolve));
          await link.send({ kind: "WeightChunkRequest", request_id: rid, model_hash: m.model_hash, name: m.name, first: index, count: 1 });
          const chunk = await Promise.race([got, new Promise((r) => setTimeout(() => r(null), 30000))]);
          this._pending.delete(rid);
          const start = index * m.chunk_bytes, stop = Math.min(start + m.chunk_bytes, m.total_bytes);
          const bytes = chunk?.data.data;  // the u8 tensor
          const why = !chunk ? "no answer within 30 s"
            : chunk.offset !== start || bytes.length !== stop - start ? `bytes ${chunk.offset}+${bytes.length} instead of ${start}+${stop - start}`
              : hex(await sha256(bytes)) !== m.chunk_sha256[index] ? "SHA-256 mismatch" : null;
          if (why === null) {
            blob.set(bytes, start);
            progress.done += stop - start;
            this.stats.fetchedBytes += stop - start;
            this.onchange();
            break;
          }
          if (attempt >= 3) throw new SliceError(`chunk ${index} refused ${attempt + 1} times (last: ${why})`);
        }
      }
    };
    await Promise.all(Array.from({ length: Math.min(WINDOW, n) }, fetchOne));
    if (hex(await sha256(blob)) !== m.name) throw new SliceError("the whole slice does not match its SHA-256");
    return blob;
  }

  _install(s) {
    const { spec, hidden } = s;
    const fmt = this.gpu.formats.includes(this.format) ? this.format : "f32";
    // One swiglu kernel reads gate and up: blocks of two encodings go as float32 instead.
    if (s.gate.encoding !== s.up.encoding) {
      for (const t of [s.gate, s.up]) {
        if (t.bytes) { t.data = dequantize(t.bytes, t.encoding, t.shape.reduce((a, b) => a * b, 1)); delete t.bytes; }
      }
    }
    // Expert i of a stacked tensor: its float32 rows or its share of the blocks.
    const part = (t, i, n) => {
      if (!t.bytes) { const per = t.data.length / n; return t.data.subarray(i * per, (i + 1) * per); }
      const per = t.bytes.length / n;
      return { encoding: t.encoding, bytes: t.bytes.subarray(i * per, (i + 1) * per) };
    };
    if (spec.kind === "dense") {
      const r = spec.stop - spec.start;
      this.blocks.set(`${spec.layer}/dense/${spec.start}/${spec.stop}`, new FfnBlock(this.gpu, {
        hidden, inter: r, fmt, wGate: part(s.gate, 0, 1), wUp: part(s.up, 0, 1), wDown: part(s.down, 0, 1) }));
    } else {
      const [n, f] = s.gate.shape;
      for (let i = 0; i < n; i++) {
        this.blocks.set(`${spec.layer}/expert/${spec.start + i}`, new FfnBlock(this.gpu, {
          hidden, inter: f, fmt, wGate: part(s.gate, i, n), wUp: part(s.up, i, n), wDown: part(s.down, i, n) }));
      }
    }
  }

  /** Serve one request; always answers (the result or an Error). */
  async serve(m, link) {
    const t0 = performance.now();
    let answer;
    try {
      if (m.term < this.term) {
        answer = { kind: "Error", request_id: m.request_id, code: "stale_term", message: `term ${m.term} is older than ${this.term}` };
      } else {
        answer = m.kind === "DenseRequest" ? await this._dense(m) : await this._experts(m);
      }
    } catch (e) {
      const code = e instanceof KernelError && /GPU error|lost/.test(e.message) ? "internal" : "bad_request";
      answer = { kind: "Error", request_id: m.request_id, code, message: `browser peer: ${e.message}`.slice(0, 4000) };
      this._fail(e.message);
    }
    await link.send(answer);
    if (answer.kind !== "Error") {
      const ms = performance.now() - t0;
      this.stats.served += 1;
      this.stats.msTotal += ms;
      this.stats.lastMs = ms;
      // A dense request carries every token's row; an expert request one step of the loop.
      this.recent.push({ t: performance.now(), layer: m.layer, tokens: m.kind === "DenseRequest" ? m.x.shape[0] : 1 });
      if (this.recent.length > 512) this.recent.splice(0, 256);
    }
    this.onchange();
  }

  _rows(t) {
    if (t.dtype === "f32") return t.data;
    return new Float32Array(new Float16Array(t.data.buffer, t.data.byteOffset, t.data.length));
  }

  _block(key, what) {
    const b = this.blocks.get(key);
    if (!b) throw new KernelError(`this peer holds no weights for ${what}`);
    return b;
  }

  async _dense(m) {
    const [t, h] = m.x.shape;
    const x = this._rows(m.x);
    const partials = new Float32Array(m.ranges.length * t * h);
    const items = m.ranges.map(([a, b]) => {
      const block = this._block(`${m.layer}/dense/${a}/${b}`, `layer ${m.layer} dense range [${a}, ${b})`);
      if (block.hidden !== h) throw new KernelError(`rows have ${h} columns; layer ${m.layer} has ${block.hidden}`);
      return { block, x, tRows: t };
    });
    for (const [i, y] of (await runBlocks(this.gpu, items)).entries()) partials.set(y, i * t * h);
    return { kind: "DenseAnswer", request_id: m.request_id, term: m.term, plan_version: m.plan_version, layer: m.layer,
      ranges: m.ranges, partials: { dtype: "f32", shape: [m.ranges.length, t, h], data: partials } };
  }

  async _experts(m) {
    const [rows, h] = m.rows.shape;
    const x = this._rows(m.rows);
    const out = new Float32Array(rows * h);
    const items = [];
    let at = 0;
    for (const [i, e] of Array.from(m.expert_ids.data).entries()) {
      const n = m.row_counts.data[i];
      if (n === 0) continue;
      const block = this._block(`${m.layer}/expert/${e}`, `layer ${m.layer} expert ${e}`);
      if (block.hidden !== h) throw new KernelError(`rows have ${h} columns; layer ${m.layer} has ${block.hidden}`);
      items.push({ block, x: x.subarray(at * h, (at + n) * h), tRows: n, at });
      at += n;
    }
    for (const [i, y] of (await runBlocks(this.gpu, items)).entries()) out.set(y, items[i].at * h);
    return { kind: "ExpertAnswer", request_id: m.request_id, term: m.term, plan_version: m.plan_version, layer: m.layer,
      expert_ids: m.expert_ids, row_counts: m.row_counts, outputs: { dtype: "f32", shape: [rows, h], data: out } };
  }
}

