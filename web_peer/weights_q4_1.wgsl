// Weight format: GGUF Q4_1 blocks of 32 weights, w = d * q + m, d and m f16, q unsigned 4-bit.
// Quant plane: as Q4_0. Scale plane: one u32 per block, d low half, m high half (the file's order).
const QW: u32 = 4u;  // quant words per block

fn scale_word(b: u32) -> u32 {
    return b;
}

fn block_scale(word: u32, b: u32) -> vec2<f32> {
    return unpack2x16float(word);
}

fn x_pair(u: u32) -> vec2<u32> {
    return nibble_x_pair(u);
}

// sum_i (d q_i + m) x_i = d (q . x) + m (sum x)
fn word_dot(q: u32, dm: vec2<f32>, xa: vec4<f32>, xb: vec4<f32>) -> f32 {
    return dm.x * (dot(low_nibbles(q), xa) + dot(high_nibbles(q), xb)) + dm.y * dot(xa + xb, vec4<f32>(1.0));
}
