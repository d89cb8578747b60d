// A decode GEMV candidate on Q4_K blocks with float32 activations, in steps of two sub-blocks
// (as gemv_x8.wgsl reads them) instead of dequantized 16-byte units: per step the integer sums'
// float twins i_2j = sum q * x and i_2j+1 over the step's 64 weights (one FMA a weight on the
// nibble as a float), the sub-blocks' sums of x, then
//   step = ((d * sc_2j) * i_2j + (d * sc_2j+1) * i_2j+1, (dmin * m_2j) * sx_2j + (dmin * m_2j+1) * sx_2j+1)
// added to a vec2 per row, y = sums - mins once a row after slice_sum. A thread computes RT
// weight rows (the host writes RT into the source): the step's x is loaded once for them all.
// Measured by bench/web_peer.py --steps-q4k; the page and the peers do not run it. Planes as
// weights_q4_k.wgsl; then rows.wgsl (Params, WG), row_slices.wgsl (LANES) and its reduction:
//   x   [T, K / 4]  vec4<f32>  activations (T = 1: workgroup z = t)
//   w   [R, NV]     vec4<u32>  quant plane of one part (R rows)
//   ws  [R, nb]     vec4<u32>  its scale plane, a block's head a vec4
//   y   [T, n_out]  f32        output; this dispatch writes columns row0 .. row0 + R
const QK: u32 = 256u;
const STEPS_PER_BLOCK: u32 = 4u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> ws: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

fn ints(u: vec4<u32>) -> vec4<f32> {
    return bitcast<vec4<f32>>(u | vec4<u32>(0x4B000000u)) - vec4<f32>(8388608.0);
}

fn lo4(q: u32) -> vec4<f32> {
    return ints((vec4<u32>(q) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(15u));
}

fn hi4(q: u32) -> vec4<f32> {
    return ints((vec4<u32>(q) >> vec4<u32>(4u, 12u, 20u, 28u)) & vec4<u32>(15u));
}

// (d * sc, dmin * m) of sub-blocks 2j (xy) and 2j + 1 (zw) from a block's head.
fn step_scales(head: vec4<u32>, j: u32) -> vec4<f32> {
    let lo = j < 2u;
    let sc = select((head.w & 0x0F0F0F0Fu) | ((head.y >> 2u) & 0x30303030u), head.y & 0x3F3F3F3Fu, lo);
    let mn = select(((head.w >> 4u) & 0x0F0F0F0Fu) | ((head.z >> 2u) & 0x30303030u), head.z & 0x3F3F3F3Fu, lo);
    let sh = 16u * (j % 2u);
    let d = unpack2x16float(head.x);
    let s = ints(vec4<u32>(sc >> sh, mn >> sh, sc >> (sh + 8u), mn >> (sh + 8u)) & vec4<u32>(63u));
    return vec4<f32>(d.x * s.x, d.y * s.y, d.x * s.z, d.y * s.w);
}

struct StepX {
    a: mat4x4<f32>,  // x of the low nibbles of the step's first 16 bytes
    b: mat4x4<f32>,  // ... of its second 16 bytes
    c: mat4x4<f32>,  // x of the high nibbles of the first 16 bytes
    e: mat4x4<f32>,  // ... of the second
    sx: vec2<f32>,   // sums of x over sub-blocks 2j and 2j + 1
}

fn step_x(t: u32, s: u32) -> StepX {
    let o = t * p.k4 + 16u * s;
    var sx: StepX;
    sx.a = mat4x4<f32>(x[o], x[o + 1u], x[o + 2u], x[o + 3u]);
    sx.b = mat4x4<f32>(x[o + 4u], x[o + 5u], x[o + 6u], x[o + 7u]);
    sx.c = mat4x4<f32>(x[o + 8u], x[o + 9u], x[o + 10u], x[o + 11u]);
    sx.e = mat4x4<f32>(x[o + 12u], x[o + 13u], x[o + 14u], x[o + 15u]);
    let one = vec4<f32>(1.0);
    let l = (sx.a[0] + sx.a[1]) + (sx.a[2] + sx.a[3]) + ((sx.b[0] + sx.b[1]) + (sx.b[2] + sx.b[3]));
    let h = (sx.c[0] + sx.c[1]) + (sx.c[2] + sx.c[3]) + ((sx.e[0] + sx.e[1]) + (sx.e[2] + sx.e[3]));
    sx.sx = vec2<f32>(dot(l, one), dot(h, one));
    return sx;
}

// (scaled sums, min terms) of step s of row r (nb blocks a row) on the step's x.
fn row_step(r: u32, nb: u32, s: u32, sx: StepX) -> vec2<f32> {
    let dm = step_scales(ws[r * nb + s / 4u], s % 4u);
    let q0 = w[2u * (r * nb * 4u + s)];
    let q1 = w[2u * (r * nb * 4u + s) + 1u];
    let i0 = ((dot(lo4(q0.x), sx.a[0]) + dot(lo4(q0.y), sx.a[1])) + (dot(lo4(q0.z), sx.a[2]) + dot(lo4(q0.w), sx.a[3])))
           + ((dot(lo4(q1.x), sx.b[0]) + dot(lo4(q1.y), sx.b[1])) + (dot(lo4(q1.z), sx.b[2]) + dot(lo4(q1.w), sx.b[3])));
    let i1 = ((dot(hi4(q0.x), sx.c[0]) + dot(hi4(q0.y), sx.c[1])) + (dot(hi4(q0.z), sx.c[2]) + dot(hi4(q0.w), sx.c[3])))
           + ((dot(hi4(q1.x), sx.e[0]) + dot(hi4(q1.y), sx.e[1])) + (dot(hi4(q1.z), sx.e[2]) + dot(hi4(q1.w), sx.e[3])));
    return vec2<f32>(dm.x * i0 + dm.z * i1, dm.y * sx.sx.x + dm.w * sx.sx.y);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = wid.x + wid.y * p.tile_x;
    if (group * ROWS * RT >= p.n_rows) {
        return;  // workgroup-uniform
    }
    let t = wid.z;
    let lane = lid % LANES;
    let r0 = (group * ROWS + lid / LANES) * RT;
    let nb = p.k4 * 4u / QK;
    let ns = nb * STEPS_PER_BLOCK;
    //ROWS_BODY
}
