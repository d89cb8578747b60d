// Helpers of the GGUF block preludes (weights_q4_0/q4_1/q8_0.wgsl); planes in web_peer/kernels.py.

// Half `b & 1` of an f16 pair: d of block b where two blocks share a scale word.
fn pair_half(word: u32, b: u32) -> vec2<f32> {
    let s = unpack2x16float(word);
    return vec2<f32>(select(s.x, s.y, (b & 1u) == 1u), 0.0);
}

// Quant word u of a 4-bit row: its low nibbles are weights 4i..4i+3 of block u / 4 (i = u % 4),
// its high nibbles weights 16+4i..16+4i+3: these x vec4 indices.
fn nibble_x_pair(u: u32) -> vec2<u32> {
    let lo = (u >> 2u) * 8u + (u & 3u);
    return vec2<u32>(lo, lo + 4u);
}

fn low_nibbles(q: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(q) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(15u));
}

fn high_nibbles(q: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(q) >> vec4<u32>(4u, 12u, 20u, 28u)) & vec4<u32>(15u));
}
