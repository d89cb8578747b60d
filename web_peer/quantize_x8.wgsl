// Activations to int8 per 32 values (a candidate for the block GEMVs: gemv_x8.wgsl; ggml's Q8_1
// numerics, measured by bench/web_peer.py --int8-activations, not run by the page or the peers).
// Block b of 32 values of x (rows of x back to back, K a multiple of 32):
//   amax = max |x|, dx = amax / 127, q = clamp(round(x / dx), -127, 127) (0 where amax = 0),
//   s = dx * sum(q)  (the sum exact in i32, one rounding)
//   x   [n * 8]  vec4<f32>  the activations
//   xq  [n * 8]  u32        q, 4 a word (byte k of word i = value 4i + k, two's complement)
//   xs  [n]      vec2<f32>  (dx, s)
// One invocation per block; Params: (n blocks, tile_x) with tile_x * WG invocations a row of the grid.

struct QuantParams {
    n: u32,
    stride: u32,  // invocations per row of the dispatch grid (x workgroups * WG)
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> qp: QuantParams;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> xq: array<u32>;
@group(0) @binding(3) var<storage, read_write> xs: array<vec2<f32>>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let b = gid.x + gid.y * qp.stride;
    if (b >= qp.n) {
        return;
    }
    var amax = 0.0;
    for (var i = 0u; i < 8u; i++) {
        let v = abs(x[8u * b + i]);
        amax = max(amax, max(max(v.x, v.y), max(v.z, v.w)));
    }
    let dx = amax / 127.0;
    var total = 0i;
    for (var i = 0u; i < 8u; i++) {
        var q = vec4<i32>(0i);
        if (amax > 0.0) {
            q = clamp(vec4<i32>(round(x[8u * b + i] / dx)), vec4<i32>(-127i), vec4<i32>(127i));
        }
        total += (q.x + q.y) + (q.z + q.w);
        xq[8u * b + i] = pack4xI8(q);
    }
    xs[b] = vec2<f32>(dx, dx * f32(total));
}
