// Weight format: int8 per row with one f32 scale per row (w = q * scale[row]).
// One u32 holds 4 consecutive int8 of a row, little-endian (element 4j+i in byte i).
// The scale factors out of the dot product, so the kernel multiplies once per row after the sum.
alias WVec = u32;
const HAS_SCALE: bool = true;

fn unpack_w(v: WVec) -> vec4<f32> {
    // Arithmetic right shifts of i32 sign-extend each byte.
    let s = bitcast<i32>(v);
    return vec4<f32>(f32((s << 24u) >> 24u), f32((s << 16u) >> 24u),
                     f32((s << 8u) >> 24u), f32(s >> 24u));
}
