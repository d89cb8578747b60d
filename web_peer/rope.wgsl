// Rotary position embedding (Su et al. 2021, RoFormer; transformers' rotate_half layout) on the
// stacked query and key heads of T rows, with the tables the engine builds:
//   y[t, h, i] = x[t, h, i] * cos[t, h, i] + x[t, h, i ^ half] * ssin[t, h, i]
// where i ^ half is the other half's element (i + half or i - half) and ssin is sin with its
// first half negated (rotate_half(x) * sin == swap_halves(x) * ssin); the attention scale may
// be folded into the query heads' tables.
//   x              [T, stride] f32, its row's first n * hd elements the heads (a stage's Q|K|V rows)
//   cos, ssin, y   [T, n, hd]  f32 (n heads, hd even). One invocation per element.
// Numpy twin: web_peer/kernels.py rope.

struct RopeParams {
    total: u32,   // T * n * hd
    tile_x: u32,  // invocations along x (WG each workgroup)
    hd: u32,
    row: u32,     // n * hd
    stride: u32,  // elements per row of x
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> p: RopeParams;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> cosine: array<f32>;
@group(0) @binding(3) var<storage, read> ssin: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let e = gid.x + gid.y * p.tile_x;
    if (e >= p.total) {
        return;
    }
    let half = p.hd / 2u;
    let i = e % p.hd;
    let xe = (e / p.row) * p.stride + e % p.row;
    let other = select(xe + half, xe - half, i >= half);
    y[e] = x[xe] * cosine[e] + x[other] * ssin[e];
}
