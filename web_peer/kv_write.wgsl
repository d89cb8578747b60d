// A stage's new keys or values into its KV cache on the GPU:
//   cache[g, start + t, i] = src[t * stride + offset + g * hd + i]
// for rows t < T, heads g < nkv, i < hd: the heads of T rows (keys after RoPE, or values)
// written at their positions. cache [nkv, C, hd] f32 (C its capacity). One invocation per element.

struct KvParams {
    total: u32,   // T * nkv * hd
    tile_x: u32,  // invocations along x
    hd: u32,
    nkv: u32,
    cap: u32,     // C
    start: u32,
    stride: u32,  // elements per row of src
    offset: u32,  // where row t's first head begins
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> p: KvParams;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> cache: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let e = gid.x + gid.y * p.tile_x;
    if (e >= p.total) {
        return;
    }
    let row = p.nkv * p.hd;
    let t = e / row;
    let g = (e % row) / p.hd;
    let i = e % p.hd;
    cache[(g * p.cap + p.start + t) * p.hd + i] = src[t * p.stride + p.offset + g * p.hd + i];
}
