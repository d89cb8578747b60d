// Weight format: IEEE float16. One WVec holds 4 consecutive weights of a row as two u32 words
// (the file's bytes, low half first), decoded by rows.wgsl's f16_pair: exact, subnormal weights
// included, on any adapter (no shader-f16 feature, which many phone GPUs lack, and no f16
// arithmetic that may flush). Products accumulate in f32.
alias WVec = vec2<u32>;
const HAS_SCALE: bool = false;

fn unpack_w(v: WVec) -> vec4<f32> {
    return vec4<f32>(f16_pair(v.x), f16_pair(v.y));
}
