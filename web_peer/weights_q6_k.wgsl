// Weight format: GGUF Q6_K super-blocks of 256 weights (210 bytes): w = (d * sc) * (q - 32),
// q unsigned 6-bit (a ql nibble, 2 bits of qh), sc int8 per 16 weights, d f16 (ggml's
// dequantize_row_q6_K). Weight 128n + 32g + l (n < 2, g < 4, l < 32): nibble g / 2 of
// ql[64n + 32 (g % 2) + l], bits 2g of qh[32n + l], scale 8n + 2g + l / 16.
// Quant plane: ql[128] (8 units), qh[64] (4 vec4), scales[16] (1 vec4), as in the file: 13 vec4.
// Scale plane: d, two blocks per word (the file keeps it last; moved so the rest is aligned).
// Unit c of a block (16 bytes of ql, n = c / 4, h = (c / 2) % 2): low nibbles are g = h, high
// g = h + 2, for l = 16 (c % 2) .. + 15.
const QK: u32 = 256u;
const UNITS_PER_BLOCK: u32 = 8u;
const PAIRED: bool = true;

fn x_pair(v: u32, i: u32) -> vec2<u32> {
    let c = v % 8u;
    let lo = (v / 8u) * 64u + (c / 4u) * 32u + ((c / 2u) % 2u) * 8u + (c % 2u) * 4u + i;
    return vec2<u32>(lo, lo + 16u);
}

// int8 byte k of a vec4 of 16 bytes.
fn i8_at(w: vec4<u32>, k: u32) -> f32 {
    return f32((bitcast<i32>(w[k / 4u]) << (24u - 8u * (k % 4u))) >> 24u);
}

fn q6_word(q: u32, qh: u32, s: u32, dm: vec2<f32>) -> mat2x4<f32> {
    let lo = (q & 0x0F0F0F0Fu) | (((qh >> s) & 0x03030303u) << 4u);
    let hi = ((q >> 4u) & 0x0F0F0F0Fu) | (((qh >> (s + 4u)) & 0x03030303u) << 4u);
    return mat2x4<f32>(dm.x * bytes_u8(lo, 32.0), dm.y * bytes_u8(hi, 32.0));
}

fn load_unit(m: u32, r: u32, v: u32, nb: u32) -> Unit {
    let c = v % 8u;
    let b = r * nb + v / 8u;
    let n = c / 4u;
    let h = (c / 2u) % 2u;
    let d = pair_half(scale(m, b >> 1u), b).x;
    let sc = quant(m, b * 13u + 12u);
    let k = 8u * n + 2u * h + c % 2u;  // scale of the low nibbles; the high ones' is k + 4
    let dm = vec2<f32>(d * i8_at(sc, k), d * i8_at(sc, k + 4u));
    let q = quant(m, b * 13u + c);
    let qh = quant(m, b * 13u + 8u + 2u * n + c % 2u);
    let s = 2u * h;
    return Unit(q6_word(q.x, qh.x, s, dm), q6_word(q.y, qh.y, s, dm), q6_word(q.z, qh.z, s, dm), q6_word(q.w, qh.w, s, dm));
}
