// Weight format: float16 (needs the adapter feature "shader-f16"); products accumulate in f32.
enable f16;

alias WVec = vec4<f16>;
const HAS_SCALE: bool = false;

fn unpack_w(v: WVec) -> vec4<f32> {
    return vec4<f32>(v);
}
