// The residual stream, or a bias on every row: x[e] += y[e % m] for every element e < n (f32;
// m = n adds two arrays of one shape, m = a row's length adds the vector y to each row of x).
// One invocation per element. Numpy twin: web_peer/kernels.py add.

struct AddParams {
    n: u32,
    tile_x: u32,
    m: u32,
    pad0: u32,
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> p: AddParams;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let e = gid.x + gid.y * p.tile_x;
    if (e < p.n) {
        x[e] += y[e % p.m];
    }
}
