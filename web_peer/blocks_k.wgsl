// Helpers of the K-quant preludes (weights_q4_k/q5_k/q6_k.wgsl): super-blocks of QK = 256
// weights in 8 units of 32 (ggml's block_q4_K, block_q5_K, block_q6_K; gguf-py's dequantize).
//
// Q4_K and Q5_K share a 16-byte head, the scale plane's 4 words per block: word 0 holds d and
// dmin (f16), words 1-3 the 12 bytes of 6-bit sub-block scales sc and mins m (ggml's
// get_scale_min_k4): sub-block s < 4 takes sc = byte s of word 1 & 63, m = byte s of word 2 & 63;
// s >= 4 takes its low 4 bits from byte s - 4 of word 3 (sc low nibble, m high) and its top 2
// from the top bits of byte s - 4 of words 1 (sc) and 2 (m). w = (d * sc) * q - dmin * m.
// Their quant units: 16 bytes of qs, unit u of a block holding weights 64j + l (low nibbles) and
// 64j + 32 + l (high nibbles) for l in 16 (u % 2) .. + 15, j = u / 2: sub-blocks 2j and 2j + 1.

// (sc, m) of sub-block s from the head words.
fn k_scale_min(head: vec4<u32>, s: u32) -> vec2<f32> {
    let lo = s < 4u;
    let sc = select((head.w & 0x0F0F0F0Fu) | ((head.y >> 2u) & 0x30303030u), head.y & 0x3F3F3F3Fu, lo);
    let mn = select(((head.w >> 4u) & 0x0F0F0F0Fu) | ((head.z >> 2u) & 0x30303030u), head.z & 0x3F3F3F3Fu, lo);
    let sh = 8u * (s % 4u);
    return vec2<f32>(f32((sc >> sh) & 63u), f32((mn >> sh) & 63u));
}

// (d * sc, dmin * m) of sub-blocks 2j (xy) and 2j + 1 (zw) of block b of matrix m.
fn k_head_scales(m: u32, b: u32, j: u32) -> vec4<f32> {
    let head = vec4<u32>(scale(m, 4u * b), scale(m, 4u * b + 1u), scale(m, 4u * b + 2u), scale(m, 4u * b + 3u));
    let d = f16_pair(head.x);
    let a = k_scale_min(head, 2u * j);
    let c = k_scale_min(head, 2u * j + 1u);
    return vec4<f32>(d.x * a.x, d.y * a.y, d.x * c.x, d.y * c.y);
}

// x vec4 words of word i of unit v (Q4_K, Q5_K): weights 64j + 16 (u % 2) + 4i .. + 3 and 32 on.
fn k_nibble_x_pair(v: u32, i: u32) -> vec2<u32> {
    let u = v % 8u;
    let lo = (v / 8u) * 64u + (u / 2u) * 16u + (u % 2u) * 4u + i;
    return vec2<u32>(lo, lo + 8u);
}

// A word of 5-bit (Q5_K) or 4-bit (Q4_K: no high bits) weights, (d * sc) * q - dmin * m.
fn k_word(lo: u32, hi: u32, dm: vec4<f32>) -> mat2x4<f32> {
    return mat2x4<f32>(dm.x * bytes_u8(lo, 0.0) - dm.y, dm.z * bytes_u8(hi, 0.0) - dm.w);
}
