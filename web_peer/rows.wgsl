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
