// Down projection on GGUF blocks: y[t, row0 + r] = h[t] . w_down[r], weights dequantized here,
// sums in f32. Bindings and work split as down.wgsl; planes as in swiglu_blocks.wgsl:
//   h      [T, K4]        vec4<f32>  SwiGLU activations, K4 = F / 4 (F a multiple of 32)
//   w_down [R, F/32 * QW] u32        quant plane of one part (R rows) of W_down [H, F]
//   s_down                u32        its scale plane
//   y      [T, H]         f32        output; this dispatch writes columns row0 .. row0 + R

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> hin: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> w_down: array<u32>;
@group(0) @binding(3) var<storage, read> s_down: array<u32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wid.x + wid.y * p.tile_x;
    if (r >= p.n_rows) {
        return;  // workgroup-uniform
    }
    let t0 = wid.z * TB;
    let nb = p.k4 / 8u;
    let nw = nb * QW;
    var acc: array<f32, TB>;
    for (var u = lid; u < nw; u += WG) {
        let b = r * nb + u / QW;
        let w = dequant_word(w_down[r * nw + u], block_scale(s_down[scale_word(b)], b));
        let xo = x_pair(u);
        for (var t = 0u; t < TB; t++) {
            let tt = t0 + t;
            if (tt < p.t_rows) {
                acc[t] += dot(w[0], hin[tt * p.k4 + xo.x]);
                if (PAIRED) {
                    acc[t] += dot(w[1], hin[tt * p.k4 + xo.y]);
                }
            }
        }
    }
    for (var t = 0u; t < TB; t++) {
        let tt = t0 + t;
        if (tt >= p.t_rows) {
            break;  // uniform
        }
        let total = workgroup_sum(lid, vec2<f32>(acc[t], 0.0));
        if (lid == 0u) {
            y[tt * p.n_out + p.row0 + r] = total.x;
        }
    }
}
