// Weight format: float32. One WVec holds 4 consecutive weights of a row.
alias WVec = vec4<f32>;
const HAS_SCALE: bool = false;

fn unpack_w(v: WVec) -> vec4<f32> {
    return v;
}
