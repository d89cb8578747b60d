// Weight format: GGUF Q4_1 blocks of 32 weights, w = d * q + m, d and m f16, q unsigned 4-bit.
// Quant plane: as Q4_0. Scale plane: one u32 per block, d low half, m high half (the file's order).
const QK: u32 = 32u;
const UNITS_PER_BLOCK: u32 = 1u;
const PAIRED: bool = true;

fn scale_word(b: u32) -> u32 {
    return b;
}

fn block_scale(word: u32, b: u32) -> vec2<f32> {
    return f16_pair(word);
}

fn x_pair(v: u32, i: u32) -> vec2<u32> {
    return nibble_x_pair(v, i);
}

fn dequant_word(q: u32, dm: vec2<f32>) -> mat2x4<f32> {
    return mat2x4<f32>(dm.x * low_nibbles(q, 0.0) + dm.y, dm.x * high_nibbles(q, 0.0) + dm.y);
}
