// gemv_x8.wgsl's prelude for Q6_K weights (planes as weights_q6_k.wgsl: ql[128], qh[64] and the
// 16 int8 scales as 13 vec4 a block in the quant plane, d in the scale plane, two a word) on
// activation rows quantized per 256 values (ggml's Q8_K, the CPU's int8 rows). Step s of a row:
// c = s % 8 of block b = s / 8, n = c / 4, g = c % 4: weights 128n + 32g + l (l < 32), q =
// nibble g / 2 of ql[64n + 32 (g % 2) + l] | bits 2g of qh[32n + l] << 4 (0..63, an int8 as it
// is), scales sc_a = sc[8n + 2g] (l < 16), sc_b = sc[8n + 2g + 1]:
//   i_k = sum (q - 32) * q_x = sum q * q_x - 32 * sum q_x over the 16 values (exact in i32)
//   step = ((d * dx_b) * f32(sc_a * i_a + sc_b * i_b), 0)   (the integer exact, < 2^24)
// The CPU int8 kernel's sum (swarm/compute/qkernels.py), cut into other pieces, added in
// another order.
const QK: u32 = 256u;
const STEPS_PER_BLOCK: u32 = 8u;
@group(0) @binding(4) var<storage, read> ws: array<u32>;  // d of blocks 2i, 2i + 1 (f16)

// A step's activations (32 values: 2 vec4 of int8, the sum of each 16, the block's dx), loaded
// once for the RT rows a thread computes.
struct StepX {
    a0: vec4<u32>,
    a1: vec4<u32>,
    n0: i32,
    n1: i32,
    dx: f32,
}

fn step_x(t: u32, s: u32) -> StepX {
    let o = t * (p.k4 / 4u) + 2u * s;
    let a0 = xq[o];
    let a1 = xq[o + 1u];
    let ones = vec4<u32>(0x01010101u);
    return StepX(a0, a1, dot16(ones, a0), dot16(ones, a1), xd[t * (p.k4 / 64u) + s / 8u]);
}

// int8 byte k of a vec4 of 16 bytes.
fn x8_i8_at(v: vec4<u32>, k: u32) -> i32 {
    return (bitcast<i32>(v[k / 4u]) << (24u - 8u * (k % 4u))) >> 24u;
}

fn row_step(r: u32, nb: u32, s: u32, sx: StepX) -> vec2<f32> {
    let b = r * nb + s / 8u;
    let c = s % 8u;
    let n = c / 4u;
    let g = c % 4u;
    let base = b * 13u;
    let lo = base + 4u * n + 2u * (g % 2u);  // ql: 32 bytes
    let hi = base + 8u + 2u * n;             // qh: 32 bytes
    let sl = vec4<u32>(4u * (g / 2u));
    let sh = vec4<u32>(2u * g);
    let low = vec4<u32>(0x0F0F0F0Fu);
    let two = vec4<u32>(0x03030303u);
    let q0 = ((w[lo] >> sl) & low) | (((w[hi] >> sh) & two) << vec4<u32>(4u));
    let q1 = ((w[lo + 1u] >> sl) & low) | (((w[hi + 1u] >> sh) & two) << vec4<u32>(4u));
    let i0 = dot16(q0, sx.a0) - 32i * sx.n0;
    let i1 = dot16(q1, sx.a1) - 32i * sx.n1;
    let sc = w[base + 12u];
    let k = 8u * n + 2u * g;
    let d = f16_pair(ws[b >> 1u]);
    let cd = select(d.x, d.y, (b & 1u) == 1u) * sx.dx;  // the CPU's dx * d, one rounding
    return vec2<f32>(cd * f32(x8_i8_at(sc, k) * i0 + x8_i8_at(sc, k + 1u) * i1), 0.0);
}
