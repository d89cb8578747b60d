// gemv_x8.wgsl's prelude for Q4_K weights (planes as weights_q4_k.wgsl: the 16-byte head of each
// super-block in the scale plane, qs in the quant plane) on activation rows quantized per 256
// values (ggml's Q8_K, the CPU's int8 rows): dx per super-block, and dx * sum(q) per 32 values
// (xm). Step s of a row: sub-blocks 2j and 2j + 1 (j = s % 4) of block b = s / 4, i.e. its units
// 2j and 2j + 1 (32 bytes of qs: the low nibbles are sub-block 2j's 32 weights, the high ones
// 2j + 1's):
//   i_k = sum q_w * q_x (exact in i32; nibbles 0..15 read as int8 are themselves)
//   step = ((d * dx_b) * f32(sc_2j * i_2j + sc_2j+1 * i_2j+1),       (the integer exact, < 2^24)
//           (dmin * m_2j) * xm_2s + (dmin * m_2j+1) * xm_2s+1)
// (the scaled sums and the min terms apart, subtracted once a row: gemv_x8.wgsl): the CPU int8
// kernel's sum (swarm/compute/qkernels.py), cut into other pieces, added in another order.
const QK: u32 = 256u;
const STEPS_PER_BLOCK: u32 = 4u;
@group(0) @binding(4) var<storage, read> ws: array<vec4<u32>>;  // a block's head (d, dmin, scales): one load
@group(0) @binding(6) var<storage, read> xm: array<f32>;        // [T, K / 32] dx * sum(q) per 32 values

// 6-bit (sc, m) of sub-block sb from the head words (ggml's get_scale_min_k4, as blocks_k.wgsl).
fn x8_scale_min(head: vec4<u32>, sb: u32) -> vec2<u32> {
    let lo = sb < 4u;
    let sc = select((head.w & 0x0F0F0F0Fu) | ((head.y >> 2u) & 0x30303030u), head.y & 0x3F3F3F3Fu, lo);
    let mn = select(((head.w >> 4u) & 0x0F0F0F0Fu) | ((head.z >> 2u) & 0x30303030u), head.z & 0x3F3F3F3Fu, lo);
    let sh = 8u * (sb % 4u);
    return vec2<u32>((sc >> sh) & 63u, (mn >> sh) & 63u);
}

// A step's activations (sub-blocks 2j and 2j + 1: 4 vec4 of int8, the block's dx, the two
// sub-blocks' dx * sum(q)), loaded once for the RT rows a thread computes.
struct StepX {
    a0: vec4<u32>,
    a1: vec4<u32>,
    a2: vec4<u32>,
    a3: vec4<u32>,
    dx: f32,
    m0: f32,
    m1: f32,
}

// Step s of input row t (rows of K / 16 vec4 in xq, K / 256 scales in xd, K / 32 sums in xm).
fn step_x(t: u32, s: u32) -> StepX {
    let o = t * (p.k4 / 4u) + 4u * s;
    let mo = t * (p.k4 / 8u) + 2u * s;
    return StepX(xq[o], xq[o + 1u], xq[o + 2u], xq[o + 3u], xd[t * (p.k4 / 64u) + s / 4u], xm[mo], xm[mo + 1u]);
}

// Step s of weight row r (nb blocks a row) on the step's activations.
fn row_step(r: u32, nb: u32, s: u32, sx: StepX) -> vec2<f32> {
    let head = ws[r * nb + s / 4u];
    let j = s % 4u;
    let m0 = x8_scale_min(head, 2u * j);
    let m1 = x8_scale_min(head, 2u * j + 1u);
    let q0 = w[2u * (r * nb * 4u + s)];
    let q1 = w[2u * (r * nb * 4u + s) + 1u];
    let nib = vec4<u32>(0x0F0F0F0Fu);
    let i0 = dot16(q0 & nib, sx.a0) + dot16(q1 & nib, sx.a1);
    let i1 = dot16((q0 >> vec4<u32>(4u)) & nib, sx.a2) + dot16((q1 >> vec4<u32>(4u)) & nib, sx.a3);
    let dm = f16_pair(head.x);
    let c = dm.x * sx.dx;  // the CPU's dx * d, one rounding
    return vec2<f32>(c * f32(i32(m0.x) * i0 + i32(m1.x) * i1),
                     (dm.y * f32(m0.y)) * sx.m0 + (dm.y * f32(m1.y)) * sx.m1);
}
