// Weight format: GGUF Q4_0 blocks of 32 weights, w = d * (q - 8), d f16, q unsigned 4-bit.
// Quant plane: 16 bytes per block, one unit (byte j = weight j | weight j + 16 << 4, as in the
// file). Scale plane: one f16 d per block, two per u32.
const QK: u32 = 32u;
const UNITS_PER_BLOCK: u32 = 1u;
const PAIRED: bool = true;

fn scale_word(b: u32) -> u32 {
    return b >> 1u;
}

// (d, m) of block b from its scale word.
fn block_scale(word: u32, b: u32) -> vec2<f32> {
    return pair_half(word, b);
}

fn x_pair(v: u32, i: u32) -> vec2<u32> {
    return nibble_x_pair(v, i);
}

// The 8 weights of a quant word, as gguf dequantizes them.
fn dequant_word(q: u32, dm: vec2<f32>) -> mat2x4<f32> {
    return mat2x4<f32>(dm.x * low_nibbles(q, 8.0), dm.x * high_nibbles(q, 8.0));
}
