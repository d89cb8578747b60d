// The SwiGLU gate/up kernel (swiglu.wgsl): h[t, f] = silu(x[t]·W_gate[f]) * (x[t]·W_up[f]).
// Numpy twin: web_peer/kernels.py `swiglu`. Owns its pipelines (one per weight format).
import { encodeParts } from "./gpu.js";

export class SwigluKernel {
  /** @param {import("./gpu.js").GpuContext} ctx */
  constructor(ctx) { this.ctx = ctx; }

  /** Compile (once per device) the pipeline for weight format `fmt`. */
  prepare(fmt) { return this.ctx.pipeline("swiglu", fmt); }

  /**
   * Encode h = swiglu(x) into `enc`. x: GPUBuffer [tRows, k4] vec4<f32>; gate/up: GPU matrices
   * [F padded, 4*k4] with identical parts; h: GPUBuffer [tRows, nOut] f32 (nOut = F padded).
   */
  async encode(enc, fmt, { tRows, k4, nOut, x, gate, up, h }) {
    const pipe = await this.prepare(fmt);
    encodeParts(this.ctx, enc, pipe, { tRows, k4, nOut, input: x, mats: [gate, up], output: h });
  }
}
