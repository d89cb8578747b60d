// Helpers of the GGUF block preludes (weights_<fmt>.wgsl); planes in web_peer/kernels.py.
// A kernel reads the quant plane in 16-byte units (vec4<u32>, 4 words): unit v of a row belongs
// to block v / UNITS_PER_BLOCK of the row (a block holds QK weights). Each prelude says which x
// vec4 word i of unit v multiplies (x_pair) and dequantizes unit v (load_unit: column 0 of a
// word multiplies x_pair.x, column 1 x_pair.y when PAIRED). No arrays: a dynamically indexed
// one cost the H200 20x. The kernel bodies name their input binding `x` (unit_dot2 reads it) and
// give the preludes their planes as quant(m, i) (vec4 i of matrix m's quant plane) and
// scale(m, i) (word i of its scale plane); m = 0 is W_gate or W_down, 1 is W_up.

// Half `b & 1` of an f16 pair: d of block b where two blocks share a scale word.
fn pair_half(word: u32, b: u32) -> vec2<f32> {
    let s = f16_pair(word);
    return vec2<f32>(select(s.x, s.y, (b & 1u) == 1u), 0.0);
}

// Word i of a 4-bit block holds weights 4i..4i+3 in its low nibbles, 16+4i..16+4i+3 in its high.
fn nibble_x_pair(v: u32, i: u32) -> vec2<u32> {
    return vec2<u32>(v * 8u + i, v * 8u + 4u + i);
}

// Integers u (each below 2^23) less `bias`, as f32, exactly: 2^23 + u is the float whose
// mantissa is u, so an OR and one exact subtraction replace the int-to-float conversion, which
// GPUs run at a fraction of their FMA rate (NVIDIA: 16 a clock per SM against 128).
fn ints_less(u: vec4<u32>, bias: f32) -> vec4<f32> {
    return bitcast<vec4<f32>>(u | vec4<u32>(0x4B000000u)) - vec4<f32>(8388608.0 + bias);
}

// The low (high) nibbles of a word's 4 bytes, less `bias`.
fn low_nibbles(q: u32, bias: f32) -> vec4<f32> {
    return ints_less((vec4<u32>(q) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(15u), bias);
}

fn high_nibbles(q: u32, bias: f32) -> vec4<f32> {
    return ints_less((vec4<u32>(q) >> vec4<u32>(4u, 12u, 20u, 28u)) & vec4<u32>(15u), bias);
}

// The 32 (Q4) or 16 (Q8) weights of one 16-byte unit, dequantized once per unit.
struct Unit {
    w0: mat2x4<f32>,
    w1: mat2x4<f32>,
    w2: mat2x4<f32>,
    w3: mat2x4<f32>,
}

// The 4 bytes of a word as unsigned values, less `bias`.
fn bytes_u8(q: u32, bias: f32) -> vec4<f32> {
    return ints_less((vec4<u32>(q) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(255u), bias);
}

// (a . x, b . x) over unit v of a row, for the input row starting at vec4 xr of `x` (the kernel's
// input binding). Loads each x vec4 once for both units; a kernel with one matrix passes it twice.
fn unit_dot2(a: Unit, b: Unit, xr: u32, v: u32) -> vec2<f32> {
    let o0 = x_pair(v, 0u);
    let o1 = x_pair(v, 1u);
    let o2 = x_pair(v, 2u);
    let o3 = x_pair(v, 3u);
    let xa = mat4x4<f32>(x[xr + o0.x], x[xr + o1.x], x[xr + o2.x], x[xr + o3.x]);
    var s = vec2<f32>((dot(a.w0[0], xa[0]) + dot(a.w1[0], xa[1])) + (dot(a.w2[0], xa[2]) + dot(a.w3[0], xa[3])),
                      (dot(b.w0[0], xa[0]) + dot(b.w1[0], xa[1])) + (dot(b.w2[0], xa[2]) + dot(b.w3[0], xa[3])));
    if (PAIRED) {
        let xb = mat4x4<f32>(x[xr + o0.y], x[xr + o1.y], x[xr + o2.y], x[xr + o3.y]);
        s += vec2<f32>((dot(a.w0[1], xb[0]) + dot(a.w1[1], xb[1])) + (dot(a.w2[1], xb[2]) + dot(a.w3[1], xb[3])),
                       (dot(b.w0[1], xb[0]) + dot(b.w1[1], xb[1])) + (dot(b.w2[1], xb[2]) + dot(b.w3[1], xb[3])));
    }
    return s;
}
