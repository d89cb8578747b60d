// Weight format: GGUF Q8_0 blocks of 32 weights, w = d * q, d f16, q int8.
// Quant plane: 8 u32 per block, word i = weights 4i..4i+3 (little-endian bytes).
// Scale plane: one f16 d per block, two per u32.
const QW: u32 = 8u;  // quant words per block

fn scale_word(b: u32) -> u32 {
    return b >> 1u;
}

fn block_scale(word: u32, b: u32) -> vec2<f32> {
    return pair_half(word, b);
}

// Word u of a row multiplies x vec4 u itself; there is no second (PAIRED is false).
fn x_pair(u: u32) -> vec2<u32> {
    return vec2<u32>(u, u);
}

const PAIRED: bool = false;
fn dequant_word(q: u32, dm: vec2<f32>) -> mat2x4<f32> {
    let s = bitcast<i32>(q);  // arithmetic right shifts of i32 sign-extend each byte
    let w = vec4<f32>(f32((s << 24u) >> 24u), f32((s << 16u) >> 24u), f32((s << 8u) >> 24u), f32(s >> 24u));
    return mat2x4<f32>(dm.x * w, vec4<f32>(0.0));
}
