// gemv_x8.wgsl's prelude for Q8_0 weights (planes as weights_q8_0.wgsl: 32 int8 a block in the
// quant plane, its f16 d in the scale plane, two a word) on activation rows quantized per 32
// values (ggml's Q8_0, the CPU's int8 rows). Step s of a row: block s, activation block s:
// step = ((d * dx_s) * f32(i), 0), i = sum q_w * q_x (exact in i32) straight on the file's int8 bytes.
const QK: u32 = 32u;
const STEPS_PER_BLOCK: u32 = 1u;
@group(0) @binding(4) var<storage, read> ws: array<u32>;  // d of blocks 2i, 2i + 1 (f16)

// A step's activations (block s: 2 vec4 of int8, its dx), loaded once for the RT rows.
struct StepX {
    a0: vec4<u32>,
    a1: vec4<u32>,
    dx: f32,
}

fn step_x(t: u32, s: u32) -> StepX {
    let o = t * (p.k4 / 4u) + 2u * s;
    return StepX(xq[o], xq[o + 1u], xd[t * (p.k4 / 8u) + s]);
}

fn row_step(r: u32, nb: u32, s: u32, sx: StepX) -> vec2<f32> {
    let b = r * nb + s;
    let d = f16_pair(ws[b >> 1u]);
    let i = dot16(w[2u * b], sx.a0) + dot16(w[2u * b + 1u], sx.a1);
    let c = select(d.x, d.y, (b & 1u) == 1u) * sx.dx;  // the CPU's dw * dx, one rounding
    return vec2<f32>(c * f32(i), 0.0);
}
