// slice_sum through subgroup shuffles (the page prepends `enable subgroups;`; a host picks this file
// only when the adapter's smallest subgroup holds a slice: LANES <= its minimum subgroup size).
// A butterfly over lanes xor LANES / 2, ..., 2, 1: lane 0 adds the same partials in the same order
// as sum_shared.wgsl's tree, so both paths give lane 0 (the one that writes) the same bits on
// every adapter. Slices are aligned runs of local_invocation_index inside one subgroup (how GPUs
// lay 1-D workgroups into subgroups). No barriers.
fn slice_sum(lid: u32, v: vec2<f32>) -> vec2<f32> {
    var s = v;
    for (var o = LANES / 2u; o > 0u; o >>= 1u) {  // o: the same on every lane (subgroup-uniform)
        s += subgroupShuffleXor(s, o);
    }
    return s;
}
