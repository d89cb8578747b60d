// Weight format: GGUF Q4_K super-blocks of 256 weights (144 bytes): w = (d * sc) * q - dmin * m,
// q unsigned 4-bit, sc and m 6-bit per 32-weight sub-block (blocks_k.wgsl).
// Scale plane: the block's first 16 bytes (d, dmin, scales[12]), 4 words.
// Quant plane: qs[128], 8 units of 16 bytes, as in the file.
const QK: u32 = 256u;
const UNITS_PER_BLOCK: u32 = 8u;
const PAIRED: bool = true;

fn x_pair(v: u32, i: u32) -> vec2<u32> {
    return k_nibble_x_pair(v, i);
}

fn load_unit(m: u32, r: u32, v: u32, nb: u32) -> Unit {
    let u = v % 8u;
    let dm = k_head_scales(m, r * nb + v / 8u, u / 2u);
    let q = quant(m, r * nb * 8u + v);
    let lo = q & vec4<u32>(0x0F0F0F0Fu);
    let hi = (q >> vec4<u32>(4u)) & vec4<u32>(0x0F0F0F0Fu);
    return Unit(k_word(lo.x, hi.x, dm), k_word(lo.y, hi.y, dm), k_word(lo.z, hi.z, dm), k_word(lo.w, hi.w, dm));
}
