// SwiGLU feed-forward on the GPU: an expert over its routed rows, or a dense MLP over an
// intermediate range (W_gate[r], W_up[r], W_down[:, r]); both are swiglu.wgsl then down.wgsl.
//
// Weight layout (the same rules as web_peer/kernels.py, whose packing it must equal byte for
// byte): row-major [rows, K] with K zero-padded to a multiple of 4; formats f32, f16 (any
// adapter: read as u32 words) and q8 (int8 per row + one f32 scale per row: scale = max|row| / 127,
// q = round-half-even(w / scale)), packed here from float32; and the GGUF block formats q4_0,
// q4_1, q8_0, q4_k, q5_k, q6_k, iq4_xs, kept in the file's blocks, split once into a quant plane and a
// scale plane (no bytes added; kernels.py says why). Each matrix is cut into parts of whole rows so no binding
// exceeds the context's maxBinding. Activations are cut into blocks of rows under the same limit.
import { KernelError, BLOCK_FORMATS } from "./gpu.js";
import { SwigluKernel } from "./swiglu.js";
import { DownKernel } from "./down.js";

const BYTES = { f32: 4, f16: 2, q8: 1 };
// block format → [weights per block, bytes per block in the file, [a, b): the block's bytes that
// go to the scale plane] (kernels.py _SCALE_BYTES); the other bytes, in order, are the quant plane.
const BLOCKS = {
  q4_0: [32, 18, 0, 2], q4_1: [32, 20, 0, 4], q8_0: [32, 34, 0, 2],
  q4_k: [256, 144, 0, 16], q5_k: [256, 176, 0, 16], q6_k: [256, 210, 208, 210], iq4_xs: [256, 136, 0, 8],
};

export const pad4 = (n) => Math.ceil(n / 4) * 4;

function checkFormat(fmt) {
  if (!(fmt in BYTES)) throw new KernelError(`unknown weight format ${fmt}; expected one of f32, f16, q8`);
}

/** Cut `rows` rows of `rowBytes` bytes into [first, end) parts of at most `maxBinding` bytes. */
export function splitRows(rows, rowBytes, maxBinding) {
  if (rowBytes > maxBinding) {
    throw new KernelError(`one weight row is ${rowBytes} bytes, above this adapter's maxStorageBufferBindingSize of ${maxBinding} bytes; this peer cannot serve it`);
  }
  const per = Math.max(1, Math.min(Math.floor(maxBinding / rowBytes), 65535 * 65535));
  const parts = [];
  for (let r = 0; r < rows; r += per) parts.push([r, Math.min(r + per, rows)]);
  return parts;
}

function roundHalfEven(v) {
  const r = Math.round(v);
  return (Math.abs(v % 1) === 0.5 && r % 2 !== 0) ? r - 1 : r;
}

/**
 * Pack float32 w [n, k] (Float32Array, row-major) as `fmt`, zero-padded to [rows, pad4(k)].
 * Returns {fmt, rows, cols, data: Uint8Array, scale: Float32Array|null, parts}.
 */
export function packMatrix(w, n, k, fmt, maxBinding, rows = n) {
  checkFormat(fmt);
  if (!(w instanceof Float32Array) || w.length !== n * k) {
    throw new KernelError(`weights must be a Float32Array of ${n}x${k}, got ${w?.constructor?.name} of ${w?.length}`);
  }
  const cols = pad4(k);
  let data, scale = null;
  if (fmt === "f32" || fmt === "f16") {
    const out = fmt === "f32" ? new Float32Array(rows * cols) : new Float16Array(rows * cols);
    for (let i = 0; i < n; i++) out.set(w.subarray(i * k, (i + 1) * k), i * cols);
    data = new Uint8Array(out.buffer);
  } else {
    const q = new Int8Array(rows * cols);
    scale = new Float32Array(rows).fill(1);
    for (let i = 0; i < n; i++) {
      const row = w.subarray(i * k, (i + 1) * k);
      let amax = 0;
      for (const v of row) amax = Math.max(amax, Math.abs(v));
      const s = amax > 0 ? Math.fround(amax / 127) : 1;
      scale[i] = s;
      for (let j = 0; j < k; j++) q[i * cols + j] = Math.max(-127, Math.min(127, roundHalfEven(Math.fround(row[j] / s))));
    }
    data = new Uint8Array(q.buffer);
  }
  return { fmt, rows, cols, data, scale, rowBytes: cols * BYTES[fmt], scaleRowBytes: scale ? 4 : 0,
    parts: splitRows(rows, cols * BYTES[fmt], maxBinding) };
}

/** The kernel format of a GGUF type name ("Q4_1" → "q4_1"), or null when the kernels cannot read its blocks. */
export function blockFormat(encoding) {
  const fmt = String(encoding).toLowerCase();
  return BLOCK_FORMATS.includes(fmt) ? fmt : null;
}

/**
 * Repack GGUF blocks (Uint8Array of n rows of k / QK blocks, as in the file) into the kernels'
 * two planes, zero rows up to `rows`. Returns {fmt, rows, cols: k, data (quant plane),
 * scale (scale plane, bytes), rowBytes, scaleRowBytes, parts}; same bytes as kernels.py's.
 */
export function packBlocks(bytes, n, k, fmt, maxBinding, rows = n) {
  const [qk, size, a, z] = BLOCKS[fmt] ?? [];
  if (!size) throw new KernelError(`unknown block format ${fmt}; expected one of ${BLOCK_FORMATS.join(", ")}`);
  if (k % qk) throw new KernelError(`${fmt} needs rows of a multiple of ${qk} weights, got ${k}`);
  const nb = k / qk, sb = z - a, qb = size - sb;
  if (!(bytes instanceof Uint8Array) || bytes.length !== n * nb * size) {
    throw new KernelError(`${fmt} weights of ${n}x${k} must be a Uint8Array of ${n * nb * size} bytes, got ${bytes?.constructor?.name} of ${bytes?.length}`);
  }
  const data = new Uint8Array(rows * nb * qb);
  const scale = new Uint8Array(rows * nb * sb);
  for (let b = 0, at = 0; b < n * nb; b++, at += size) {
    scale.set(bytes.subarray(at + a, at + z), b * sb);
    data.set(bytes.subarray(at, at + a), b * qb);
    data.set(bytes.subarray(at + z, at + size), b * qb + a);
  }
  return { fmt, rows, cols: k, data, scale, rowBytes: nb * qb, scaleRowBytes: nb * sb, parts: splitRows(rows, nb * qb, maxBinding) };
}

/** Pack one weight argument of FfnBlock: a Float32Array as `fmt`, or GGUF blocks {encoding, bytes} as they are. */
function packWeights(w, n, k, fmt, maxBinding, rows = n) {
  if (w instanceof Float32Array) return packMatrix(w, n, k, fmt, maxBinding, rows);
  const bf = blockFormat(w?.encoding);
  if (!bf) throw new KernelError(`weights must be a Float32Array or GGUF blocks of ${BLOCK_FORMATS.join(", ")}, got ${w?.encoding ?? w?.constructor?.name}`);
  return packBlocks(w.bytes, n, k, bf, maxBinding, rows);
}

/** Transpose-free column slice W[:, a:b] of a row-major [n, k] Float32Array → [n, b - a]. */
export function sliceColumns(w, n, k, a, b) {
  const out = new Float32Array(n * (b - a));
  for (let i = 0; i < n; i++) out.set(w.subarray(i * k + a, i * k + b), i * (b - a));
  return out;
}

/** One SwiGLU block resident on one device: upload once, run many requests. */
export class FfnBlock {
  /**
   * @param {import("./gpu.js").GpuContext} ctx
   * @param {{hidden: number, inter: number, fmt?: string, wGate, wUp, wDown}} w
   *   wGate, wUp [inter, hidden]; wDown [hidden, inter]; row-major. Each is a Float32Array
   *   (packed as `fmt`, default f32) or GGUF blocks {encoding: "Q4_0"|"Q4_1"|"Q8_0"|"Q4_K"|"Q5_K"|"Q6_K", bytes:
   *   Uint8Array} kept as they are (wGate and wUp in one encoding).
   */
  constructor(ctx, { hidden, inter, fmt = "f32", wGate, wUp, wDown }) {
    checkFormat(fmt);
    this.ctx = ctx;
    this.hidden = hidden;
    this.inter = inter;
    const fp = pad4(inter);
    this.packed = {
      gate: packWeights(wGate, inter, hidden, fmt, ctx.maxBinding, fp),
      up: packWeights(wUp, inter, hidden, fmt, ctx.maxBinding, fp),
      down: packWeights(wDown, hidden, inter, fmt, ctx.maxBinding),
    };
    if (this.packed.gate.fmt !== this.packed.up.fmt) {
      throw new KernelError(`gate and up must share a format, got ${this.packed.gate.fmt} and ${this.packed.up.fmt}`);
    }
    this.fmt = this.packed.gate.fmt;        // swiglu kernel
    this.downFmt = this.packed.down.fmt;    // down kernel
    this.swiglu = new SwigluKernel(ctx);
    this.down = new DownKernel(ctx);
    this.generation = -1;  // device generation the GPU copies belong to
    this.gpu = null;
  }

  /** Bytes of weights this block keeps on the GPU (compact: both planes of block formats). */
  get gpuBytes() {
    return Object.values(this.packed).reduce((s, m) => s + m.data.byteLength + (m.scale ? m.scale.byteLength : 0), 0);
  }

  _upload() {
    const ctx = this.ctx;
    const up = (m) => ({
      packed: m,
      buffers: m.parts.map(([r0, r1]) => ctx.buffer(m.data.subarray(r0 * m.rowBytes, r1 * m.rowBytes))),
      scales: m.parts.map(([r0, r1]) => ctx.buffer(m.scale
        ? new Uint8Array(m.scale.buffer, m.scale.byteOffset + r0 * m.scaleRowBytes, (r1 - r0) * m.scaleRowBytes)
        : new Float32Array([1]))),
    });
    this.gpu = { gate: up(this.packed.gate), up: up(this.packed.up), down: up(this.packed.down) };
    this.generation = this.ctx.generation;
  }

  /**
   * y = down(swiglu(x)): x [tRows, hidden] Float32Array → Promise<Float32Array [tRows, hidden]>.
   * Weights are (re)uploaded when the device is fresh. Rejects with KernelError on bad input,
   * any GPU error or a lost device; never resolves with NaN or infinity.
   */
  async run(x, tRows) {
    this._check(x, tRows);
    const block = this.rowsPerBinding();
    const y = new Float32Array(tRows * this.hidden);
    for (let t0 = 0; t0 < tRows; t0 += block) {
      const n = Math.min(block, tRows - t0);
      const [yp] = await runEncoded(this.ctx, [{ block: this, x: x.subarray(t0 * this.hidden, (t0 + n) * this.hidden), tRows: n }]);
      y.set(unpad(yp, n, this.hidden), t0 * this.hidden);
    }
    return finite(y);
  }

  /** Activation rows one binding holds (the widest of a row of x, h and y). */
  rowsPerBinding() {
    return Math.max(1, Math.floor(this.ctx.maxBinding / (Math.max(pad4(this.hidden), pad4(this.inter)) * 4)));
  }

  _check(x, tRows) {
    if (!(x instanceof Float32Array) || x.length !== tRows * this.hidden) {
      throw new KernelError(`x must be a Float32Array of ${tRows}x${this.hidden}, got ${x?.constructor?.name} of ${x?.length}`);
    }
    for (const v of x) if (!Number.isFinite(v)) throw new KernelError("x holds NaN or infinity; refusing to compute");
  }

  /** Encode both kernels over rows x (within one binding) into `enc`; the buffers made, y's last. */
  async _encode(enc, x, tRows) {
    const ctx = this.ctx;
    if (this.generation !== ctx.generation || !this.gpu) this._upload();
    const hp = pad4(this.hidden), fp = pad4(this.inter);
    const xp = new Float32Array(tRows * hp);
    for (let t = 0; t < tRows; t++) xp.set(x.subarray(t * this.hidden, (t + 1) * this.hidden), t * hp);
    const xb = ctx.buffer(xp);
    const hb = ctx.buffer(tRows * fp * 4);
    const yb = ctx.buffer(tRows * hp * 4, GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC);
    await this.swiglu.encode(enc, this.fmt, { tRows, k4: hp / 4, nOut: fp, x: xb, gate: this.gpu.gate, up: this.gpu.up, h: hb });
    await this.down.encode(enc, this.downFmt, { tRows, k4: fp / 4, nOut: hp, h: hb, down: this.gpu.down, y: yb });
    return [xb, hb, yb];
  }

  /** Free the GPU copies (the packed host copies stay for a later upload). */
  release() {
    if (!this.gpu) return;
    for (const m of Object.values(this.gpu)) for (const b of [...m.buffers, ...m.scales]) b.destroy();
    this.gpu = null;
  }
}

/** Rows [tRows, pad4(h)] → Float32Array [tRows, h]. */
function unpad(yp, tRows, h) {
  const hp = pad4(h), y = new Float32Array(tRows * h);
  for (let t = 0; t < tRows; t++) y.set(yp.subarray(t * hp, t * hp + h), t * h);
  return y;
}

function finite(y) {
  for (const v of y) if (!Number.isFinite(v)) throw new KernelError("the GPU returned NaN or infinity; refusing to pass it on");
  return y;
}

/**
 * Items [{block, x, tRows}] (rows within one binding each) in one guarded submission — one
 * compute pass, every output copied into one mappable buffer — and one read-back: each its
 * Float32Array [tRows, pad4(hidden)]. One error scope and one map a request, not a block: each
 * is a round trip to the GPU process.
 */
async function runEncoded(ctx, items) {
  return ctx.guarded("an FFN request", async (dev) => {
    const made = [], outs = [];
    try {  // every buffer made here is destroyed, whatever fails
      const enc = ctx.encoder();
      let total = 0;
      for (const { block, x, tRows } of items) {
        const bufs = await block._encode(enc, x, tRows);
        made.push(...bufs);
        outs.push([bufs[2], total, tRows * pad4(block.hidden)]);
        total += tRows * pad4(block.hidden);
      }
      const rb = dev.createBuffer({ size: Math.max(16, total * 4), usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
      made.push(rb);
      for (const [yb, at, n] of outs) enc.copy(yb, 0, rb, at * 4, n * 4);
      dev.queue.submit([enc.finish()]);
      await rb.mapAsync(GPUMapMode.READ);
      const all = new Float32Array(rb.getMappedRange().slice(0));
      rb.unmap();
      return outs.map(([, at, n]) => all.subarray(at, at + n));
    } finally {
      for (const b of made) b.destroy();
    }
  });
}

/**
 * Several blocks' y = down(swiglu(x)) — a request's experts, or its dense ranges — in one
 * submission and one read-back where each item's rows fit one binding (else block by block):
 * items [{block: FfnBlock, x: Float32Array [tRows, hidden], tRows}] → Promise<Float32Array[]>
 * ([tRows, hidden] each). The same bits as FfnBlock.run of each. Rejects as FfnBlock.run.
 */
export async function runBlocks(ctx, items) {
  for (const { block, x, tRows } of items) block._check(x, tRows);
  if (items.some(({ block, tRows }) => tRows > block.rowsPerBinding())) {
    const ys = [];
    for (const { block, x, tRows } of items) ys.push(await block.run(x, tRows));
    return ys;
  }
  const got = items.length ? await runEncoded(ctx, items) : [];
  return got.map((yp, i) => finite(unpad(yp, items[i].tRows, items[i].block.hidden)));
}
