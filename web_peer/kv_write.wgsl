// A stage's new keys and values into its KV cache on the GPU, both in one dispatch:
//   k_cache[g, start + t, i] = k_src[t * k_stride + k_offset + g * hd + i]
//   v_cache[g, start + t, i] = v_src[t * v_stride + v_offset + g * hd + i]
// for rows t < T, heads g < nkv, i < hd: the heads of T rows (keys after RoPE, values) written
// at their positions. Caches [nkv, C, hd] f32 (C their capacity). One invocation per element of
// each. Numpy twin: web_peer/kernels.py kv_write, once for the keys and once for the values.

struct KvParams {
    total: u32,     // T * nkv * hd
    tile_x: u32,    // invocations along x
    hd: u32,
    nkv: u32,
    cap: u32,       // C
    start: u32,
    k_stride: u32,  // elements per row of k_src
    k_offset: u32,  // where row t's first key head begins
    v_stride: u32,
    v_offset: u32,
    pad0: u32,
    pad1: u32,
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> p: KvParams;
@group(0) @binding(1) var<storage, read> k_src: array<f32>;
@group(0) @binding(2) var<storage, read_write> k_cache: array<f32>;
@group(0) @binding(3) var<storage, read> v_src: array<f32>;
@group(0) @binding(4) var<storage, read_write> v_cache: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let e = gid.x + gid.y * p.tile_x;
    if (e >= p.total) {
        return;
    }
    let row = p.nkv * p.hd;
    let t = e / row;
    let head = e % row;  // g * hd + i
    let at = ((head / p.hd) * p.cap + p.start + t) * p.hd + head % p.hd;
    k_cache[at] = k_src[t * p.k_stride + p.k_offset + head];
    v_cache[at] = v_src[t * p.v_stride + p.v_offset + head];
}
