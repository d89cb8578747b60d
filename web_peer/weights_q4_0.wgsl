// Weight format: GGUF Q4_0 blocks of 32 weights, w = d * (q - 8), d f16, q unsigned 4-bit.
// Quant plane: 4 u32 per block (byte j = weight j | weight j + 16 << 4, as in the file).
// Scale plane: one f16 d per block, two per u32.
const QW: u32 = 4u;  // quant words per block

fn scale_word(b: u32) -> u32 {
    return b >> 1u;
}

// (d, m) of block b from its scale word.
fn block_scale(word: u32, b: u32) -> vec2<f32> {
    return pair_half(word, b);
}

// x vec4 indices (within a row) that quant word u of a row multiplies.
fn x_pair(u: u32) -> vec2<u32> {
    return nibble_x_pair(u);
}

// The 8 weights of quant word q (column 0 multiplies x vec4 x_pair(u).x, column 1 .y), as gguf.
const PAIRED: bool = true;
fn dequant_word(q: u32, dm: vec2<f32>) -> mat2x4<f32> {
    return mat2x4<f32>(dm.x * (low_nibbles(q) - 8.0), dm.x * (high_nibbles(q) - 8.0));
}
