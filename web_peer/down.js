// The down-projection kernel (down.wgsl): y[t, o] = h[t]·W_down[o].
// Numpy twin: web_peer/kernels.py `down`. Its pipelines (per weight format and TB) live in the GpuContext.
import { encodeParts } from "./gpu.js";

export class DownKernel {
  /** @param {import("./gpu.js").GpuContext} ctx */
  constructor(ctx) { this.ctx = ctx; }

  /**
   * Encode y = h @ W_down.T into Encoder `enc`. h: GPUBuffer [tRows, k4] vec4<f32>; down: GPU
   * matrix [H padded, 4*k4]; y: GPUBuffer [tRows, nOut] f32 (nOut = H padded).
   */
  encode(enc, fmt, { tRows, k4, nOut, h, down, y }) {
    return encodeParts(this.ctx, enc, "down", fmt, { tRows, k4, nOut, input: h, mats: [down], output: y });
  }
}
