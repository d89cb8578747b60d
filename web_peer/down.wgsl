// Down projection: y[t, row0 + r] = h[t] . w_down[r] for every row t of h and every weight row
// r of one weight part (W_down [H, F] stored row-major, i.e. one row per output feature).
//
// Shapes (K4 = F / 4, F padded to a multiple of 4 with zeros):
//   h      [T, K4]  vec4<f32>       SwiGLU activations
//   w_down [R, K4]  WVec            one part (R rows) of W_down; format from the prelude
//   s_down [R]      f32             per-row scales (read only when HAS_SCALE)
//   y      [T, H]   f32             output; this dispatch writes columns row0 .. row0 + R
// Same work split as swiglu.wgsl: one workgroup per weight row and block of TB rows of h
// (the host prepends a weight prelude and rows.wgsl). With ACCUMULATE the dispatch adds its sum to
// what y holds (y[i] = sum + y[i], each element read and written by one thread): a residual
// stream updated in place, bit for bit the add of a separate pass (one f32 add either way).

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> hin: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> w_down: array<WVec>;
@group(0) @binding(3) var<storage, read> s_down: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

override ACCUMULATE: bool = false;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wid.x + wid.y * p.tile_x;
    if (r >= p.n_rows) {
        return;  // workgroup-uniform
    }
    let t0 = wid.z * TB;
    let base = r * p.k4;
    var acc: array<f32, TB>;
    // Four independent weight loads per step (see swiglu.wgsl), then the tail.
    var k = lid;
    for (; k + 3u * WG < p.k4; k += 4u * WG) {
        let w0 = unpack_w(w_down[base + k]);
        let w1 = unpack_w(w_down[base + k + WG]);
        let w2 = unpack_w(w_down[base + k + 2u * WG]);
        let w3 = unpack_w(w_down[base + k + 3u * WG]);
        for (var t = 0u; t < TB; t++) {
            let tt = t0 + t;
            if (tt < p.t_rows) {
                let hi = tt * p.k4 + k;
                acc[t] += (dot(hin[hi], w0) + dot(hin[hi + WG], w1))
                        + (dot(hin[hi + 2u * WG], w2) + dot(hin[hi + 3u * WG], w3));
            }
        }
    }
    for (; k < p.k4; k += WG) {
        let w = unpack_w(w_down[base + k]);
        for (var t = 0u; t < TB; t++) {
            let tt = t0 + t;
            if (tt < p.t_rows) {
                acc[t] += dot(hin[tt * p.k4 + k], w);
            }
        }
    }
    var sd = 1.0;
    if (HAS_SCALE) {
        sd = s_down[r];
    }
    for (var t = 0u; t < TB; t++) {
        let tt = t0 + t;
        if (tt >= p.t_rows) {
            break;  // uniform
        }
        let total = workgroup_sum(lid, vec2<f32>(acc[t], 0.0));
        if (lid == 0u) {
            let i = tt * p.n_out + p.row0 + r;
            if (ACCUMULATE) {
                y[i] = total.x * sd + y[i];
            } else {
                y[i] = total.x * sd;
            }
        }
    }
}
