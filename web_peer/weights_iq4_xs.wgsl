// Weight format: GGUF IQ4_XS super-blocks of 256 weights (136 bytes): w = (d * (ls - 32)) * kv[q],
// q a 4-bit index into the 16 int8 levels kv of IQ4_NL, ls the 6-bit scale of each 32-weight
// sub-block: low nibble from scales_l, top 2 bits from scales_h (ggml's dequantize_row_iq4_xs).
// Scale plane: the block's first 8 bytes, 2 words: d (f16) | scales_h << 16, then scales_l[4]
// (sub-block s: nibble s of that word). Quant plane: qs[128], one 16-byte unit per sub-block,
// byte j holding weight j (low nibble) and weight j + 16 (high nibble), as Q4_0's blocks.
const QK: u32 = 256u;
const UNITS_PER_BLOCK: u32 = 8u;
const PAIRED: bool = true;

// The IQ4_NL levels -127 .. 113, four to a word: byte k of KV<i> is level 4i + k (two's complement).
const KV0: u32 = 0xBFAD9881u;
const KV1: u32 = 0xF6EADDCFu;
const KV2: u32 = 0x26190D01u;
const KV3: u32 = 0x71594535u;

// The levels of four 4-bit indices. No array: a dynamically indexed one cost the H200 20x.
fn iq4_levels(q: vec4<u32>) -> vec4<f32> {
    let word = select(select(vec4<u32>(KV0), vec4<u32>(KV1), q >= vec4<u32>(4u)),
                      select(vec4<u32>(KV2), vec4<u32>(KV3), q >= vec4<u32>(12u)), q >= vec4<u32>(8u));
    // level byte xor 0x80 is the level + 128, read unsigned (blocks.wgsl's ints_less)
    return ints_less(((word ^ vec4<u32>(0x80808080u)) >> ((q & vec4<u32>(3u)) * 8u)) & vec4<u32>(255u), 128.0);
}

fn iq4_word(q: u32, dl: f32) -> mat2x4<f32> {
    let b = vec4<u32>(q) >> vec4<u32>(0u, 8u, 16u, 24u);
    return mat2x4<f32>(dl * iq4_levels(b & vec4<u32>(15u)), dl * iq4_levels((b >> vec4<u32>(4u)) & vec4<u32>(15u)));
}

fn x_pair(v: u32, i: u32) -> vec2<u32> {
    return nibble_x_pair(v, i);
}

fn load_unit(m: u32, r: u32, v: u32, nb: u32) -> Unit {
    let b = r * nb + v / 8u;
    let s = v % 8u;
    let head = scale(m, 2u * b);
    let ls = ((scale(m, 2u * b + 1u) >> (4u * s)) & 15u) | (((head >> (16u + 2u * s)) & 3u) << 4u);
    let dl = f16_pair(head).x * f32(i32(ls) - 32);
    let q = quant(m, r * nb * 8u + v);
    return Unit(iq4_word(q.x, dl), iq4_word(q.y, dl), iq4_word(q.z, dl), iq4_word(q.w, dl));
}
