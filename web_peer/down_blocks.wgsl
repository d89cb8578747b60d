// Down projection on GGUF blocks: y[t, row0 + r] = h[t] . w_down[r], weights dequantized here,
// sums in f32. Bindings and work split as down.wgsl; planes as in swiglu_blocks.wgsl:
//   x      [T, K4]        vec4<f32>  SwiGLU activations h, K4 = F / 4 (F a multiple of QK)
//   w_down [R, NV]        vec4<u32>  quant plane of one part (R rows) of W_down [H, F]
//   s_down                u32        its scale plane
//   y      [T, H]         f32        output; this dispatch writes columns row0 .. row0 + R
// ACCUMULATE (pipeline constant, default off): y[i] = sum + y[i], as down.wgsl.

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;  // h, named x for blocks.wgsl
@group(0) @binding(2) var<storage, read> w_down: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> s_down: array<u32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

override ACCUMULATE: bool = false;

fn quant(m: u32, i: u32) -> vec4<u32> {
    return w_down[i];
}

fn scale(m: u32, i: u32) -> u32 {
    return s_down[i];
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
    var acc: array<f32, TB>;
    for (var v = lane; v < nv; v += LANES) {
        let w = load_unit(0u, r, v, nb);
        for (var t = 0u; t < TB; t++) {
            let tt = t0 + t;
            if (tt < p.t_rows) {
                acc[t] += unit_dot2(w, w, tt * p.k4, v).x;
            }
        }
    }
    for (var t = 0u; t < TB; t++) {
        let tt = t0 + t;
        if (tt >= p.t_rows) {
            break;  // uniform
        }
        let total = slice_sum(lid, vec2<f32>(acc[t], 0.0));
        if (lane == 0u && r < p.n_rows) {
            let i = tt * p.n_out + p.row0 + r;
            if (ACCUMULATE) {
                y[i] = total.x + y[i];
            } else {
                y[i] = total.x;
            }
        }
    }
}
