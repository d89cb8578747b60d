// Weight format: GGUF Q8_0 blocks of 32 weights, w = d * q, d f16, q int8.
// Quant plane: 32 bytes per block, two units of 16 int8 (little-endian bytes).
// Scale plane: one f16 d per block, two per u32.
const QK: u32 = 32u;
const UNITS_PER_BLOCK: u32 = 2u;
const PAIRED: bool = false;  // a word is 4 weights: column 1 of dequant_word is unused

fn scale_word(b: u32) -> u32 {
    return b >> 1u;
}

fn block_scale(word: u32, b: u32) -> vec2<f32> {
    return pair_half(word, b);
}

fn x_pair(v: u32, i: u32) -> vec2<u32> {
    return vec2<u32>(v * 4u + i, v * 4u + i);
}

fn dequant_word(q: u32, dm: vec2<f32>) -> mat2x4<f32> {
    // int8 b is (b xor 0x80) - 128 read unsigned: no sign extension, no int-to-float conversion.
    return mat2x4<f32>(dm.x * bytes_u8(q ^ 0x80808080u, 128.0), vec4<f32>(0.0));
}
