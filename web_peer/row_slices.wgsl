// The block kernels' work split (swiglu_blocks, down_blocks): a workgroup computes ROWS weight
// rows, each by a slice of LANES adjacent threads (slice lid / LANES, lane lid % LANES) that stride
// over the row's 16-byte quant units, adjacent lanes reading adjacent units. Workgroup id
// x + y * tile_x = group of ROWS rows (the host's dispatch grid counts groups, not rows). A GPU
// takes several rows per workgroup and a short reduction per row; a CPU adapter one row of WG lanes.

override LANES: u32 = 8u;       // threads per weight row: a power of two dividing WG
override ROWS: u32 = WG / LANES;  // weight rows per workgroup

// slice_sum(lid, v): the sum of v over lid's slice, for lane 0 at least; sum_shared.wgsl or
// sum_subgroup.wgsl (the host picks). Every thread of the workgroup calls it (uniform control flow).
