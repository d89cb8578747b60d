// Weight format: GGUF Q5_K super-blocks of 256 weights (176 bytes): w = (d * sc) * q - dmin * m,
// q unsigned 5-bit: a qs nibble and bit s of qh[l] for weight 32s + l (blocks_k.wgsl).
// Scale plane: the block's first 16 bytes (d, dmin, scales[12]), 4 words.
// Quant plane: qh[32] (2 vec4) then qs[128] (8 units), as in the file: 10 vec4 a block.
const QK: u32 = 256u;
const UNITS_PER_BLOCK: u32 = 8u;
const PAIRED: bool = true;

fn x_pair(v: u32, i: u32) -> vec2<u32> {
    return k_nibble_x_pair(v, i);
}

// Low nibbles of q with bit s of each byte of qh as their bit 4 (and the high nibbles, bit s + 1).
fn q5_word(q: u32, qh: u32, s: u32, dm: vec4<f32>) -> mat2x4<f32> {
    let lo = (q & 0x0F0F0F0Fu) | (((qh >> s) & 0x01010101u) << 4u);
    let hi = ((q >> 4u) & 0x0F0F0F0Fu) | (((qh >> (s + 1u)) & 0x01010101u) << 4u);
    return k_word(lo, hi, dm);
}

fn load_unit(m: u32, r: u32, v: u32, nb: u32) -> Unit {
    let u = v % 8u;
    let b = r * nb + v / 8u;
    let dm = k_head_scales(m, b, u / 2u);
    let q = quant(m, b * 10u + 2u + u);
    let qh = quant(m, b * 10u + u % 2u);  // qh bytes of l = 16 (u % 2) ..
    let s = 2u * (u / 2u);
    return Unit(q5_word(q.x, qh.x, s, dm), q5_word(q.y, qh.y, s, dm), q5_word(q.z, qh.z, s, dm), q5_word(q.w, qh.w, s, dm));
}
