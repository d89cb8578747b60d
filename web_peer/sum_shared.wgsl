// slice_sum through workgroup memory: every adapter (lavapipe, SwiftShader, GPUs without subgroups).

var<workgroup> slice_red: array<vec2<f32>, WG>;

// The sum of v over the LANES threads of lid's slice, for every thread of the slice. A tree in
// a fixed order: lane 0 gets the same bits as sum_subgroup.wgsl's butterfly. Every thread of the
// workgroup must call it (uniform control flow: it has barriers).
fn slice_sum(lid: u32, v: vec2<f32>) -> vec2<f32> {
    slice_red[lid] = v;
    workgroupBarrier();
    let lane = lid % LANES;
    for (var s = LANES / 2u; s > 0u; s >>= 1u) {
        if (lane < s) {
            slice_red[lid] += slice_red[lid + s];
        }
        workgroupBarrier();
    }
    let total = slice_red[lid - lane];
    workgroupBarrier();
    return total;
}
