// The WebGPU context of the browser peer: adapter, device, limits, WGSL sources, error handling.
//
// Theory of operation. One GpuContext per page. The device is made lazily and replaced after it is
// lost or after any GPU error: every request runs inside error scopes (validation, out-of-memory,
// internal), and an error turns the request into a KernelError and drops the device, so the next
// request gets a fresh one (weights are then uploaded again by their owner). No WebGPU at all →
// NoWebGPUError, which the page shows as "cannot serve". Mirrors web_peer/wgpu_host.py.

/** A kernel could not give an answer (bad input, limits, GPU error, lost device). */
export class KernelError extends Error {
  constructor(message) { super(message); this.name = "KernelError"; }
}

/** This browser has no usable WebGPU adapter: the page cannot serve. */
export class NoWebGPUError extends Error {
  constructor(message) { super(message); this.name = "NoWebGPUError"; }
}

// GGUF block formats: the file's blocks (32 weights; 256 for the K-quants), dequantized in the
// kernel (web_peer/kernels.py).
export const BLOCK_FORMATS = ["q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_xs"];
const K_FORMATS = ["q4_k", "q5_k", "q6_k", "iq4_xs"];
export const FORMATS = ["f32", "f16", "q8", ...BLOCK_FORMATS];
export const TB = 8;  // activation rows per workgroup: `const TB` in rows.wgsl
export const DECODE_TB = 1;  // TB of the kernels a one-row (decode) dispatch runs: no loop over absent rows
const tbLine = (tb) => `const TB: u32 = ${tb}u;`;  // how rows.wgsl declares TB (source() sets it)
export const MAX_WORKGROUPS_PER_DIM = 65535;
const GPU_LANES = 32;  // block kernels' threads per weight row on GPUs (wgpu_host.py GPU_LANES)

const moduleBase = new URL(".", import.meta.url);

export class GpuContext {
  /**
   * @param {GPUAdapter} adapter
   * @param {{maxBinding?: number, workgroupSize?: number, lanes?: number, subgroups?: boolean}} opts
   *   maxBinding caps storage bindings (bytes) below the adapter's limit; workgroupSize is the WG
   *   override (power of two); lanes the block kernels' threads per weight row (LANES of
   *   row_slices.wgsl: 32 on GPUs, the workgroup on CPU adapters); subgroups reduces a row through
   *   subgroup shuffles (default: when the adapter has "subgroups" and its smallest subgroup holds
   *   `lanes` threads), as wgpu_host.py.
   */
  constructor(adapter, opts = {}) {
    this.adapter = adapter;
    const lim = adapter.limits;
    this.adapterBinding = Math.min(lim.maxStorageBufferBindingSize, lim.maxBufferSize);
    this.maxBinding = Math.min(opts.maxBinding ?? this.adapterBinding, this.adapterBinding);
    const wg = opts.workgroupSize ?? defaultWorkgroupSize(adapter);
    if ((wg & (wg - 1)) !== 0 || wg <= 0 || wg > lim.maxComputeInvocationsPerWorkgroup || wg > lim.maxComputeWorkgroupSizeX) {
      throw new KernelError(`workgroup size ${wg} must be a power of two ≤ ${lim.maxComputeInvocationsPerWorkgroup}`);
    }
    this.workgroupSize = wg;
    this.lanes = opts.lanes ?? (cpuLanes(adapter) ? wg : Math.min(GPU_LANES, wg));
    if ((this.lanes & (this.lanes - 1)) !== 0 || this.lanes <= 0 || this.lanes > wg) {
      throw new KernelError(`lanes ${this.lanes} must be a power of two ≤ the workgroup size ${wg}`);
    }
    const hasSubgroups = adapter.features.has("subgroups");
    this.subgroupMinSize = adapter.info?.subgroupMinSize ?? 0;
    if (opts.subgroups && !hasSubgroups) {
      throw new KernelError("this adapter lacks the feature 'subgroups'; leave subgroups unset");
    }
    this.subgroups = opts.subgroups ?? (hasSubgroups && this.lanes <= this.subgroupMinSize);
    // f16 on any adapter (decoded from u32 words, no shader-f16), where the browser can pack it:
    // Float16Array (Chrome 135+, Firefox 129+, Safari 18.2+); else the page asks f32 (main.js)
    this.formats = FORMATS.filter((f) => f !== "f16" || typeof globalThis.Float16Array === "function");
    this.device = null;
    this.generation = 0;      // bumped whenever the device is dropped; weights remember theirs
    this.largestBinding = 0;  // the largest buffer ever bound, for limit tests
    this.lostReason = null;
    this._pipelines = new Map();
    this._sources = new Map();
    this._queue = Promise.resolve();  // guarded() runs one GPU request at a time
  }

  /** Request an adapter; NoWebGPUError when the browser has none. */
  static async create(opts = {}) {
    if (!globalThis.navigator?.gpu) {
      throw new NoWebGPUError("this browser has no WebGPU (navigator.gpu is missing; it needs HTTPS and a WebGPU-capable browser)");
    }
    const adapter = await navigator.gpu.requestAdapter({ powerPreference: "high-performance" });
    if (!adapter) throw new NoWebGPUError("WebGPU is present but no GPU adapter is available");
    return new GpuContext(adapter, opts);
  }

  /** Adapter description, limits and features for the hello message. */
  describe() {
    const i = this.adapter.info ?? {};
    const l = this.adapter.limits;
    return {
      vendor: i.vendor ?? "", architecture: i.architecture ?? "", device: i.device ?? "", description: i.description ?? "",
      features: [...this.adapter.features].sort(),
      limits: {
        maxStorageBufferBindingSize: l.maxStorageBufferBindingSize, maxBufferSize: l.maxBufferSize,
        maxComputeInvocationsPerWorkgroup: l.maxComputeInvocationsPerWorkgroup,
        maxComputeWorkgroupStorageSize: l.maxComputeWorkgroupStorageSize,
      },
      formats: this.formats,
      workgroupSize: this.workgroupSize, lanes: this.lanes, subgroups: this.subgroups,
    };
  }

  async getDevice() {
    if (this.device) return this.device;
    const required = this.subgroups ? ["subgroups"] : [];
    let dev;
    try {
      dev = await this.adapter.requestDevice({
        requiredFeatures: required,
        requiredLimits: {
          maxStorageBufferBindingSize: this.adapter.limits.maxStorageBufferBindingSize,
          maxBufferSize: this.adapter.limits.maxBufferSize,
          maxComputeInvocationsPerWorkgroup: this.adapter.limits.maxComputeInvocationsPerWorkgroup,
          maxComputeWorkgroupSizeX: this.adapter.limits.maxComputeWorkgroupSizeX,
        },
      });
    } catch (e) {
      // An adapter is single-use after a device was made from it once it is lost: ask for a new one.
      const adapter = await navigator.gpu.requestAdapter({ powerPreference: "high-performance" });
      if (!adapter) throw new KernelError(`cannot make a GPU device: ${e.message}`);
      this.adapter = adapter;
      dev = await adapter.requestDevice({ requiredFeatures: required });
    }
    dev.lost.then((info) => {
      if (this.device === dev) this.dropDevice(`device lost (${info.reason}): ${info.message}`);
    });
    this.device = dev;
    return dev;
  }

  /** Forget the device (after a GPU error or loss); the next request makes a fresh one. */
  dropDevice(reason) {
    this.lostReason = reason;
    this.device = null;
    this.generation += 1;
    this._pipelines.clear();
  }

  /**
   * The WGSL of `kernel` for weight format `fmt`: weights_<fmt>.wgsl (and blocks.wgsl, then
   * blocks_32.wgsl or blocks_k.wgsl for block formats), rows.wgsl, for block formats
   * row_slices.wgsl and sum_subgroup.wgsl (after `enable subgroups;`) or sum_shared.wgsl, then
   * <kernel>.wgsl (<kernel>_blocks.wgsl): kernels.py wgsl_files. `tb` activation rows a workgroup
   * (rows.wgsl's TB: TB, or DECODE_TB for a dispatch of one row; set in the text, as kernels.py
   * wgsl_source, since a function's array size must be a constant). Each row's bits are the same
   * whatever `tb`.
   */
  async source(kernel, fmt, tb = TB) {
    const key = `${kernel}/${fmt}/${tb}`;
    if (!this._sources.has(key)) {
      if (tb !== TB) {
        const code = await this.source(kernel, fmt);
        if (!code.includes(tbLine(TB))) throw new KernelError(`rows.wgsl does not declare \`${tbLine(TB)}\`; gpu.js TB must match it`);
        this._sources.set(key, code.replace(tbLine(TB), tbLine(tb)));
        return this._sources.get(key);
      }
      const get = async (name) => {
        const r = await fetch(new URL(name, moduleBase));
        if (!r.ok) throw new KernelError(`cannot load ${name}: HTTP ${r.status}`);
        return r.text();
      };
      const blocks = BLOCK_FORMATS.includes(fmt);
      const names = blocks
        ? [`weights_${fmt}.wgsl`, "blocks.wgsl", K_FORMATS.includes(fmt) ? "blocks_k.wgsl" : "blocks_32.wgsl", "rows.wgsl",
          "row_slices.wgsl", this.subgroups ? "sum_subgroup.wgsl" : "sum_shared.wgsl", `${kernel}_blocks.wgsl`]
        : [`weights_${fmt}.wgsl`, "rows.wgsl", `${kernel}.wgsl`];
      const enable = blocks && this.subgroups ? ["enable subgroups;"] : [];
      this._sources.set(key, [...enable, ...(await Promise.all(names.map(get)))].join("\n"));
    }
    return this._sources.get(key);
  }

  /**
   * The compute pipeline of `kernel` for `fmt` with `tb` activation rows a workgroup on the
   * current device (cached until it is dropped).
   */
  async pipeline(kernel, fmt, tb = TB) {
    if (!this.formats.includes(fmt)) {
      throw new KernelError(`unknown weight format ${fmt}; expected one of ${this.formats.join(", ")}`);
    }
    const key = `${kernel}/${fmt}/${tb}`;
    if (!this._pipelines.has(key)) {
      const dev = await this.getDevice();
      const module = dev.createShaderModule({ code: await this.source(kernel, fmt, tb) });
      const pipe = await dev.createComputePipelineAsync({
        layout: "auto",
        compute: { module, entryPoint: "main", constants: this.constants(fmt) },
      });
      this._pipelines.set(key, pipe);
    }
    return this._pipelines.get(key);
  }

  /** The pipeline constants of a row kernel of `fmt`: WG, and LANES for the block formats. */
  constants(fmt) {
    return BLOCK_FORMATS.includes(fmt) ? { WG: this.workgroupSize, LANES: this.lanes } : { WG: this.workgroupSize };
  }

  /** Weight rows one workgroup of a row kernel of `fmt` computes (row_slices.wgsl ROWS; 1 for float formats). */
  rowsPerGroup(fmt) {
    return BLOCK_FORMATS.includes(fmt) ? this.workgroupSize / this.lanes : 1;
  }

  /** An Encoder on the current device. */
  encoder() {
    return new Encoder(this.device.createCommandEncoder());
  }

  /** A buffer holding `data` (ArrayBufferView or byte count), usage STORAGE|COPY_DST plus `usage`. */
  buffer(data, usage = GPUBufferUsage.STORAGE) {
    const bytes = typeof data === "number" ? data : data.byteLength;
    const size = Math.max(16, Math.ceil(bytes / 4) * 4);
    this.largestBinding = Math.max(this.largestBinding, size);
    const buf = this.device.createBuffer({ size, usage: usage | GPUBufferUsage.COPY_DST });
    if (typeof data !== "number" && bytes > 0) {
      const u8 = new Uint8Array(data.buffer, data.byteOffset, bytes);
      if (bytes % 4 === 0) this.device.queue.writeBuffer(buf, 0, u8);
      else { const p = new Uint8Array(Math.ceil(bytes / 4) * 4); p.set(u8); this.device.queue.writeBuffer(buf, 0, p); }
    }
    return buf;
  }

  /**
   * Run `fn(device)` inside validation / out-of-memory / internal error scopes. Any GPU error or a
   * device lost meanwhile → KernelError and a dropped device; never a result from a failed device.
   */
  guarded(what, fn) {
    // Error scopes are a per-device stack: requests must not interleave, so they queue here.
    const run = () => this._guarded(what, fn);
    const result = this._queue.then(run, run);
    this._queue = result.catch(() => {});
    return result;
  }

  async _guarded(what, fn) {
    const dev = await this.getDevice();
    const gen = this.generation;
    dev.pushErrorScope("internal");
    dev.pushErrorScope("out-of-memory");
    dev.pushErrorScope("validation");
    let result, thrown;
    try { result = await fn(dev); } catch (e) { thrown = e; }
    const errors = [];
    for (let i = 0; i < 3; i++) {
      try { const e = await dev.popErrorScope(); if (e) errors.push(e.message); } catch (e) { errors.push(String(e.message ?? e)); }
    }
    if (errors.length || gen !== this.generation || (thrown && !(thrown instanceof KernelError))) {
      const why = errors[0] ?? (gen !== this.generation ? this.lostReason : thrown?.message) ?? "unknown GPU failure";
      if (this.device === dev) this.dropDevice(`GPU error during ${what}: ${why}`);
      throw new KernelError(`GPU error during ${what}; the device was reset: ${why}`);
    }
    if (thrown) throw thrown;
    return result;
  }
}

/**
 * The WG override for an adapter: 64 on GPUs. CPU-emulated adapters pay dearly for each barrier
 * of the tree reduction, so there it is one SIMD row: 4 on SwiftShader (4 lanes; measured 7x
 * faster than 64 at T = 1 and 50x at T = 7 for a 576x256 SwiGLU block) and 8 on llvmpipe /
 * lavapipe (8 lanes of AVX2); bench/web_peer.py measures it.
 */
export function defaultWorkgroupSize(adapter) {
  return cpuLanes(adapter) || 64;
}

/** The SIMD width of a CPU-emulated adapter (8 llvmpipe / lavapipe, 4 SwiftShader), 0 for a GPU. */
function cpuLanes(adapter) {
  const i = adapter.info ?? {};
  const text = `${i.vendor ?? ""} ${i.architecture ?? ""} ${i.device ?? ""} ${i.description ?? ""}`;
  if (/llvmpipe|lavapipe/i.test(text)) return 8;
  return adapter.isFallbackAdapter || i.isFallbackAdapter || /swiftshader/i.test(text) ? 4 : 0;
}

/**
 * Workgroup counts [x, y, z] for one weight part: x*y ≥ nRows / rowsPerGroup groups of weight rows
 * (a workgroup each), z = blocks of TB rows (kernels.py dispatch_grid).
 */
export function dispatchGrid(nRows, tRows, rowsPerGroup = 1) {
  const groups = Math.ceil(nRows / rowsPerGroup);
  const tileX = Math.min(groups, MAX_WORKGROUPS_PER_DIM);
  return [tileX, Math.ceil(groups / tileX), Math.ceil(tRows / TB)];
}

/**
 * A command encoder whose dispatches share one compute pass, until a copy or finish() ends it
 * (wgpu_host.py Encoder). WebGPU runs a pass's dispatches in order, each seeing the writes of
 * those before (each is its own usage scope), so this changes no result; a pass per dispatch
 * costs the browser and the driver time of their own per pass.
 */
export class Encoder {
  /** @param {GPUCommandEncoder} enc */
  constructor(enc) {
    this.enc = enc;
    this._pass = null;
  }

  /** The open compute pass (begun if there is none). */
  computePass() {
    if (this._pass === null) this._pass = this.enc.beginComputePass();
    return this._pass;
  }

  /** One dispatch of `pipe` with bind group 0 `bind` over workgroups `grid` [x, y, z]. */
  dispatch(pipe, bind, grid) {
    const pass = this.computePass();
    pass.setPipeline(pipe);
    pass.setBindGroup(0, bind);
    pass.dispatchWorkgroups(...grid);
  }

  endPass() {
    if (this._pass !== null) {
      this._pass.end();
      this._pass = null;
    }
  }

  /** copyBufferToBuffer (byte offsets), after the dispatches encoded so far. */
  copy(src, srcAt, dst, dstAt, nbytes) {
    this.endPass();
    this.enc.copyBufferToBuffer(src, srcAt, dst, dstAt, nbytes);
  }

  /** The command buffer of everything encoded. */
  finish() {
    this.endPass();
    return this.enc.finish();
  }
}

/**
 * Encode into Encoder `enc` one dispatch per weight part of row kernel `kernel` for `fmt`, with
 * the kernels built for one row when tRows is 1 (swiglu.wgsl / down.wgsl share the Params struct
 * and binding order: params, input, weights..., scales..., output).
 */
export async function encodeParts(ctx, enc, kernel, fmt, { tRows, k4, nOut, input, mats, output }) {
  const pipe = await ctx.pipeline(kernel, fmt, tRows === 1 ? DECODE_TB : TB);
  const rowsPerGroup = ctx.rowsPerGroup(fmt);
  mats[0].packed.parts.forEach(([r0, r1], i) => {
    const grid = dispatchGrid(r1 - r0, tRows, rowsPerGroup);
    const params = ctx.buffer(new Uint32Array([tRows, k4, r1 - r0, r0, nOut, grid[0]]), GPUBufferUsage.UNIFORM);
    const res = [params, input, ...mats.map((m) => m.buffers[i]), ...mats.map((m) => m.scales[i]), output];
    const bind = ctx.device.createBindGroup({
      layout: pipe.getBindGroupLayout(0),
      entries: res.map((buffer, binding) => ({ binding, resource: { buffer } })),
    });
    enc.dispatch(pipe, bind, grid);
  });
}
