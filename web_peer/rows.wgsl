// Shared by the four row kernels (swiglu, down, swiglu_blocks, down_blocks): their parameters,
// sizes and the float kernels' reduction. In swiglu and down one workgroup computes one weight row
// for up to TB rows of the input: its WG threads each sum a strided share of the row, then
// workgroup_sum adds them (the block kernels split a workgroup into rows: row_slices.wgsl).

struct Params {
    t_rows: u32,   // T, input rows
    k4: u32,       // K / 4, input row length in vec4
    n_rows: u32,   // R, weight rows in this part
    row0: u32,     // first output column of this part
    n_out: u32,    // row stride of the output
    tile_x: u32,   // workgroups along x
}

override WG: u32 = 64u;  // threads per workgroup; a power of two within the adapter's limits
const TB: u32 = 8u;      // input rows per workgroup (weights read once per TB rows)

var<workgroup> red: array<vec2<f32>, WG>;

// The two f16 of a word (low half first) as f32, exactly, subnormals included; every GGUF block
// scale is read through it. An f16 subnormal m·2⁻²⁴ is a normal f32, which unpack2x16float may
// give as 0 (WGSL lets an implementation flush subnormals), and llama.cpp's Q6_K d (about
// max |w| / 4096) is subnormal in most blocks of a real file. Normal f16 (and ±0, inf, NaN) go
// through unpack2x16float, which is exact for them.
fn f16_pair(w: u32) -> vec2<f32> {
    let halves = vec2<u32>(w & 0xFFFFu, w >> 16u);
    let tiny = vec2<f32>(halves & vec2<u32>(0x3FFu)) * 5.9604644775390625e-8;  // m · 2⁻²⁴
    let signed = select(tiny, -tiny, (halves & vec2<u32>(0x8000u)) != vec2<u32>(0u));
    return select(unpack2x16float(w), signed, (halves & vec2<u32>(0x7C00u)) == vec2<u32>(0u));
}

// The sum of v over the workgroup's threads (a tree, in a fixed order). Every thread must call
// it (uniform control flow: it has barriers); every thread gets the sum.
fn workgroup_sum(lid: u32, v: vec2<f32>) -> vec2<f32> {
    red[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
    let total = red[0];
    workgroupBarrier();
    return total;
}
