// The SwiGLU gate/up kernel (swiglu.wgsl): h[t, f] = silu(x[t]·W_gate[f]) * (x[t]·W_up[f]).
// Numpy twin: web_peer/kernels.py `swiglu`. Its pipelines (per weight format and TB) live in the GpuContext.
import { encodeParts } from "./gpu.js";

export class SwigluKernel {
  /** @param {import("./gpu.js").GpuContext} ctx */
  constructor(ctx) { this.ctx = ctx; }

  /**
   * Encode h = swiglu(x) into Encoder `enc`. x: GPUBuffer [tRows, k4] vec4<f32>; gate/up: GPU
   * matrices [F padded, 4*k4] with identical parts; h: GPUBuffer [tRows, nOut] f32 (nOut = F padded).
   */
  encode(enc, fmt, { tRows, k4, nOut, x, gate, up, h }) {
    return encodeParts(this.ctx, enc, "swiglu", fmt, { tRows, k4, nOut, input: x, mats: [gate, up], output: h });
  }
}
