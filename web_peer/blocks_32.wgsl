// load_unit of the 32-weight block formats (weights_q4_0/q4_1/q8_0.wgsl): each prelude gives
// scale_word(b) (the scale-plane word of block b), block_scale (its d, m) and dequant_word.

fn load_unit(m: u32, r: u32, v: u32, nb: u32) -> Unit {
    let b = r * nb + v / UNITS_PER_BLOCK;
    let dm = block_scale(scale(m, scale_word(b)), b);
    let q = quant(m, r * nb * UNITS_PER_BLOCK + v);
    return Unit(dequant_word(q.x, dm), dequant_word(q.y, dm), dequant_word(q.z, dm), dequant_word(q.w, dm));
}
