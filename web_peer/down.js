// The down-projection kernel (down.wgsl): y[t, o] = h[t]·W_down[o].
// Numpy twin: web_peer/kernels.py `down`. Owns its pipelines (one per weight format).
import { encodeParts } from "./gpu.js";

export class DownKernel {
  /** @param {import("./gpu.js").GpuContext} ctx */
  constructor(ctx) { this.ctx = ctx; }

  prepare(fmt) { return this.ctx.pipeline("down", fmt); }

  /**
   * Encode y = h @ W_down.T into `enc`. h: GPUBuffer [tRows, k4] vec4<f32>; down: GPU matrix
   * [H padded, 4*k4]; y: GPUBuffer [tRows, nOut] f32 (nOut = H padded).
   */
  async encode(enc, fmt, { tRows, k4, nOut, h, down, y }) {
    const pipe = await this.prepare(fmt);
    encodeParts(this.ctx, enc, pipe, { tRows, k4, nOut, input: h, mats: [down], output: y });
  }
}
