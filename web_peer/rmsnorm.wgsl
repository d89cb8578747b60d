// RMSNorm (LlamaRMSNorm; Zhang and Sennrich 2019): y[t, i] = w[t % Rw, i] * (x[t, i] * (1 / sqrt(mean(x[t]²) + eps))).
//   x [T, D] f32, w [Rw, D] f32 (one weight row, or one per head for Qwen3's norm of each head),
//   y [T, D] f32.
// One workgroup per row: its WG threads sum a strided share of the squares, a tree adds the
// shares in a fixed order, then each thread scales its share of the row. Numpy twin:
// web_peer/kernels.py rms_norm.

struct NormParams {
    t_rows: u32,  // T
    d: u32,       // D
    eps: f32,
    tile_x: u32,  // workgroups along x (rows past 65535 go along y)
    w_rows: u32,  // Rw
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

override WG: u32 = 64u;  // threads per workgroup; a power of two within the adapter's limits

@group(0) @binding(0) var<uniform> p: NormParams;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

var<workgroup> red: array<f32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x + wid.y * p.tile_x;
    if (t >= p.t_rows) {
        return;  // workgroup-uniform
    }
    let base = t * p.d;
    var s = 0.0;
    for (var i = lid; i < p.d; i += WG) {
        let v = x[base + i];
        s += v * v;
    }
    red[lid] = s;
    workgroupBarrier();
    for (var k = WG / 2u; k > 0u; k >>= 1u) {
        if (lid < k) {
            red[lid] += red[lid + k];
        }
        workgroupBarrier();
    }
    let inv = 1.0 / sqrt(red[0] / f32(p.d) + p.eps);
    for (var i = lid; i < p.d; i += WG) {
        y[base + i] = w[(t % p.w_rows) * p.d + i] * (x[base + i] * inv);
    }
}
