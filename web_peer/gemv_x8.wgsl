// A GEMV on GGUF blocks times int8 activations: integer dot products of packed bytes
// (dot4I8Packed, 4 multiply-adds an instruction) instead of one f32 FMA a dequantized weight.
// The activation rows are the CPU's (swarm/compute/qkernels.py, the int8 numerics: per 256 values
// for the K-quants, per 32 for Q8_0), so the integer sums are the CPU kernel's and the answer
// differs from it only by the float32 sums' order (web_peer/int8_activations.py cpu_bound).
// Prelude x8_<fmt>.wgsl gives STEPS_PER_BLOCK, step_x() and row_step(); then rows.wgsl (Params, WG),
// row_slices.wgsl (LANES, ROWS) and its reduction, as the block kernels (down_blocks.wgsl):
//   xq  [T, K / 16]  vec4<u32>  int8 activations, 16 a vec4 (byte k of word i = value 4i + k)
//   xd  [T, K / QK]  f32        dx per activation block (256 values; Q8_0: 32)
//   w   [R, NV]      vec4<u32>  quant plane of one part (R rows), as the block kernels read it
//   ws                         its scale plane (declared by the prelude: array<u32> or array<vec4<u32>>)
//   y   [T, n_out]   f32        output; this dispatch writes columns row0 .. row0 + R
// (x8_q4_k.wgsl declares a seventh binding, the minimums' dx * sum(q) per 32 values.)
// A slice of LANES threads computes RT adjacent weight rows (the host writes RT and the body, one
// accumulator a row: no arrays): its lanes stride over the steps (a step: STEPS_PER_BLOCK a block,
// adjacent lanes adjacent steps), each loading a step's activations once (step_x) and adding
// row_step() (the scaled integer sums, the min terms) of each row to that row's vec2 in order;
// slice_sum adds the lanes in a fixed tree; y = sums - mins, once a row (as llama.cpp's sum_d
// and sum_m). RT changes which thread computes a row, never its order (the same bits at any RT
// where the compiler treats each count alike: checked on lavapipe and an H100).
// T rows of x: workgroup z = t.

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> xd: array<f32>;
@group(0) @binding(3) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read_write> y: array<f32>;

// The sum over the 4 words of q times the 4 words of a of their byte products (int8; the
// preludes' nibbles and 6-bit values, 0..63, read as int8 are themselves): exact in i32.
fn dot16(q: vec4<u32>, a: vec4<u32>) -> i32 {
    return (dot4I8Packed(q.x, a.x) + dot4I8Packed(q.y, a.y)) + (dot4I8Packed(q.z, a.z) + dot4I8Packed(q.w, a.w));
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = wid.x + wid.y * p.tile_x;
    if (group * ROWS * RT >= p.n_rows) {
        return;  // workgroup-uniform: depends on the workgroup id only
    }
    let t = wid.z;
    let lane = lid % LANES;
    let r0 = (group * ROWS + lid / LANES) * RT;  // the slice's first row; rows past the part add nothing
    let nb = p.k4 * 4u / QK;  // blocks per row
    let ns = nb * STEPS_PER_BLOCK;
    //ROWS_BODY
}
