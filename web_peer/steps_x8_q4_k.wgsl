// The int8-activation form of steps_q4_k.wgsl (after x8_q4_k.wgsl, which gives x8_scale_min,
// dot16 and the scale plane ws): a thread computes RT weight rows from one load of a step's
// quantized x (4 vec4 of int8, two (dx, s)), each row's step as x8_q4_k.wgsl's step().
// Bindings as gemv_x8.wgsl. Measured by bench/web_peer.py --steps-q4k; nothing else runs it.

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> xs: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read_write> y: array<f32>;

struct StepX {
    a0: vec4<u32>,
    a1: vec4<u32>,
    a2: vec4<u32>,
    a3: vec4<u32>,
    s0: vec2<f32>,
    s1: vec2<f32>,
}

fn step_x(t: u32, s: u32) -> StepX {
    let o = t * (p.k4 / 4u) + 4u * s;
    let so = t * (p.k4 / 8u) + 2u * s;
    return StepX(xq[o], xq[o + 1u], xq[o + 2u], xq[o + 3u], xs[so], xs[so + 1u]);
}

fn row_step(r: u32, nb: u32, s: u32, sx: StepX) -> vec2<f32> {
    let head = ws[r * nb + s / 4u];
    let j = s % 4u;
    let m0 = x8_scale_min(head, 2u * j);
    let m1 = x8_scale_min(head, 2u * j + 1u);
    let q0 = w[2u * (r * nb * 4u + s)];
    let q1 = w[2u * (r * nb * 4u + s) + 1u];
    let nib = vec4<u32>(0x0F0F0F0Fu);
    let i0 = dot16(q0 & nib, sx.a0) + dot16(q1 & nib, sx.a1);
    let i1 = dot16((q0 >> vec4<u32>(4u)) & nib, sx.a2) + dot16((q1 >> vec4<u32>(4u)) & nib, sx.a3);
    let dm = unpack2x16float(head.x);
    return vec2<f32>((dm.x * f32(m0.x)) * sx.s0.x * f32(i0) + (dm.x * f32(m1.x)) * sx.s1.x * f32(i1),
                     (dm.y * f32(m0.y)) * sx.s0.y + (dm.y * f32(m1.y)) * sx.s1.y);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let group = wid.x + wid.y * p.tile_x;
    if (group * ROWS * RT >= p.n_rows) {
        return;  // workgroup-uniform
    }
    let t = wid.z;
    let lane = lid % LANES;
    let r0 = (group * ROWS + lid / LANES) * RT;
    let nb = p.k4 * 4u / QK;
    let ns = nb * STEPS_PER_BLOCK;
    //ROWS_BODY
}
