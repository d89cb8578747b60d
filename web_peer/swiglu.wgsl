// SwiGLU gate/up: h[t, row0 + r] = silu(x[t] . w_gate[r]) * (x[t] . w_up[r])
// for every row t of x and every weight row r of one weight part.
//
// Shapes (K4 = K / 4, K padded to a multiple of 4 with zeros):
//   x      [T, K4]  vec4<f32>       activations, row-major
//   w_gate [R, K4]  WVec            one part (R rows) of W_gate [F, K]; format from the prelude
//   w_up   [R, K4]  WVec            the same rows of W_up
//   s_gate [R]      f32             per-row scales (read only when HAS_SCALE)
//   s_up   [R]      f32
//   h      [T, F]   f32             output; this dispatch writes columns row0 .. row0 + R
// One workgroup computes one weight row for up to TB rows of x: WG threads stride over K4,
// then a tree reduction in workgroup memory. Workgroup id: x + y * tile_x = weight row,
// z = block of TB activation rows. The host prepends a weight prelude (weights_*.wgsl) and
// rows.wgsl (Params, WG, TB, workgroup_sum).

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> w_gate: array<WVec>;
@group(0) @binding(3) var<storage, read> w_up: array<WVec>;
@group(0) @binding(4) var<storage, read> s_gate: array<f32>;
@group(0) @binding(5) var<storage, read> s_up: array<f32>;
@group(0) @binding(6) var<storage, read_write> h: array<f32>;

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wid.x + wid.y * p.tile_x;
    if (r >= p.n_rows) {
        return;  // workgroup-uniform: r depends on the workgroup id only
    }
    let t0 = wid.z * TB;
    let base = r * p.k4;
    var acc_g: array<f32, TB>;
    var acc_u: array<f32, TB>;
    // Four independent weight loads per step keep more memory requests in flight (decode is
    // bandwidth-bound); the tail loop takes what is left.
    var k = lid;
    for (; k + 3u * WG < p.k4; k += 4u * WG) {
        let g0 = unpack_w(w_gate[base + k]);
        let g1 = unpack_w(w_gate[base + k + WG]);
        let g2 = unpack_w(w_gate[base + k + 2u * WG]);
        let g3 = unpack_w(w_gate[base + k + 3u * WG]);
        let u0 = unpack_w(w_up[base + k]);
        let u1 = unpack_w(w_up[base + k + WG]);
        let u2 = unpack_w(w_up[base + k + 2u * WG]);
        let u3 = unpack_w(w_up[base + k + 3u * WG]);
        for (var t = 0u; t < TB; t++) {
            let tt = t0 + t;
            if (tt < p.t_rows) {
                let xi = tt * p.k4 + k;
                let x0 = x[xi];
                let x1 = x[xi + WG];
                let x2 = x[xi + 2u * WG];
                let x3 = x[xi + 3u * WG];
                acc_g[t] += (dot(x0, g0) + dot(x1, g1)) + (dot(x2, g2) + dot(x3, g3));
                acc_u[t] += (dot(x0, u0) + dot(x1, u1)) + (dot(x2, u2) + dot(x3, u3));
            }
        }
    }
    for (; k < p.k4; k += WG) {
        let g = unpack_w(w_gate[base + k]);
        let u = unpack_w(w_up[base + k]);
        for (var t = 0u; t < TB; t++) {
            let tt = t0 + t;
            if (tt < p.t_rows) {
                let xv = x[tt * p.k4 + k];
                acc_g[t] += dot(xv, g);
                acc_u[t] += dot(xv, u);
            }
        }
    }
    var sg = 1.0;
    var su = 1.0;
    if (HAS_SCALE) {
        sg = s_gate[r];
        su = s_up[r];
    }
    for (var t = 0u; t < TB; t++) {
        let tt = t0 + t;
        if (tt >= p.t_rows) {
            break;  // uniform: depends on the workgroup id and params only
        }
        let gu = workgroup_sum(lid, vec2<f32>(acc_g[t], acc_u[t]));
        if (lid == 0u) {
            h[tt * p.n_out + p.row0 + r] = silu(gu.x * sg) * (gu.y * su);
        }
    }
}
