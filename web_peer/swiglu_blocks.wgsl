// SwiGLU gate/up on GGUF blocks: h[t, row0 + r] = silu(x[t] . w_gate[r]) * (x[t] . w_up[r]),
// weights dequantized here, sums in f32. The same math, bindings and work split as swiglu.wgsl;
// the weights are a block prelude's two planes (weights_<fmt>.wgsl, web_peer/kernels.py):
//   x      [T, K4]        vec4<f32>  activations, K4 = K / 4 (K a multiple of the block's QK)
//   w_gate [R, NV]        vec4<u32>  quant plane of one part (R rows) of W_gate [F, K], NV units a row
//   w_up   [R, NV]        vec4<u32>  the same rows of W_up
//   s_gate, s_up          u32        scale planes (the prelude's load_unit reads them)
//   h      [T, F]         f32        output; this dispatch writes columns row0 .. row0 + R
// One workgroup per ROWS weight rows and block of TB rows of x; each row's LANES threads stride
// over its 16-byte quant units (adjacent lanes read adjacent units), then slice_sum
// (row_slices.wgsl; sum_shared.wgsl or sum_subgroup.wgsl).

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> w_gate: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> w_up: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> s_gate: array<u32>;
@group(0) @binding(5) var<storage, read> s_up: array<u32>;
@group(0) @binding(6) var<storage, read_write> h: array<f32>;

fn quant(m: u32, i: u32) -> vec4<u32> {
    if (m == 0u) {
        return w_gate[i];
    }
    return w_up[i];
}

fn scale(m: u32, i: u32) -> u32 {
    if (m == 0u) {
        return s_gate[i];
    }
    return s_up[i];
}

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = wid.x + wid.y * p.tile_x;
    if (group * ROWS >= p.n_rows) {
        return;  // workgroup-uniform: depends on the workgroup id only
    }
    let t0 = wid.z * TB;
    let lane = lid % LANES;
    let r = group * ROWS + lid / LANES;
    let nb = p.k4 * 4u / QK;  // blocks per row
    // Quant units of row r; none past the part (those threads still join slice_sum's barriers).
    let nv = select(0u, nb * UNITS_PER_BLOCK, r < p.n_rows);
    var acc_g: array<f32, TB>;
    var acc_u: array<f32, TB>;
    for (var v = lane; v < nv; v += LANES) {
        // Dequantized once per unit, used for every row of x; one accumulator update per row.
        let wg = load_unit(0u, r, v, nb);
        let wu = load_unit(1u, r, v, nb);
        for (var t = 0u; t < TB; t++) {
            let tt = t0 + t;
            if (tt < p.t_rows) {
                let gu = unit_dot2(wg, wu, tt * p.k4, v);
                acc_g[t] += gu.x;
                acc_u[t] += gu.y;
            }
        }
    }
    for (var t = 0u; t < TB; t++) {
        let tt = t0 + t;
        if (tt >= p.t_rows) {
            break;  // uniform: depends on the workgroup id and params only
        }
        let gu = slice_sum(lid, vec2<f32>(acc_g[t], acc_u[t]));
        if (lane == 0u && r < p.n_rows) {
            h[tt * p.n_out + p.row0 + r] = silu(gu.x) * gu.y;
        }
    }
}
