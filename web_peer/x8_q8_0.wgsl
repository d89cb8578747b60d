// gemv_x8.wgsl's prelude for Q8_0 weights (planes as weights_q8_0.wgsl: 32 int8 a block in the
// quant plane, its f16 d in the scale plane, two a word). Step s of a row: block s, activation
// block s: step = ((d * dx) * i, 0), i = sum q_w * q_x (exact in i32) straight on the file's int8 bytes.
const QK: u32 = 32u;
const STEPS_PER_BLOCK: u32 = 1u;
@group(0) @binding(4) var<storage, read> ws: array<u32>;  // d of blocks 2i, 2i + 1 (f16)

fn dot16(q: vec4<u32>, a: vec4<u32>) -> i32 {
    return (dot4I8Packed(q.x, a.x) + dot4I8Packed(q.y, a.y)) + (dot4I8Packed(q.z, a.z) + dot4I8Packed(q.w, a.w));
}

fn step(r: u32, nb: u32, xr: u32, sr: u32, s: u32) -> vec2<f32> {
    let b = r * nb + s;
    let d = unpack2x16float(ws[b >> 1u]);
    let i = dot16(w[2u * b], xq[xr + 2u * s]) + dot16(w[2u * b + 1u], xq[xr + 2u * s + 1u]);
    return vec2<f32>((select(d.x, d.y, (b & 1u) == 1u) * xs[sr + s].x) * f32(i), 0.0);
}
