// Causal grouped-query attention of T new query rows against a KV cache:
//   out[t, h] = sum_p softmax_p(q[t, h] . k[g, p]) v[g, p]   over positions p = 0 .. start + t,
// g = h / (nh / nkv) the key/value head of query head h (transformers' repeat_kv); q already
// multiplied by the attention scale. Softmax with the row's max subtracted, normalised after
// the weighted sum of values, as the engine's swarm.compute.kernels.attention.
//   q      [T, q_stride] f32  row t's first nh * hd elements the query heads
//   k, v   [nkv, C, hd] f32  the cache: positions 0 .. start + T - 1 filled (C its capacity)
//   scores [T, nh, C]   f32  scratch: one row's weights
//   out    [T, nh, hd]  f32
// One workgroup per (row t, query head h): its WG threads score a strided share of the
// positions, a tree finds the max, each thread exponentiates its share, a tree sums them; then
// each thread sums the weighted values of its strided share of the hd dimensions over the
// positions in order. Numpy twin: web_peer/kernels.py attention.

struct AttnParams {
    t_rows: u32,
    nh: u32,
    nkv: u32,
    hd: u32,
    cap: u32,    // C
    start: u32,     // position of row 0
    q_stride: u32,  // elements per row of q
    pad1: u32,
}

override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> p: AttnParams;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> kc: array<f32>;
@group(0) @binding(3) var<storage, read> vc: array<f32>;
@group(0) @binding(4) var<storage, read_write> scores: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

var<workgroup> red: array<f32, WG>;

// Every thread must call it (barriers); op 0: the max, 1: the sum, in a fixed tree order.
fn reduce(lid: u32, v: f32, op: u32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red[lid] = select(red[lid] + red[lid + s], max(red[lid], red[lid + s]), op == 0u);
        }
        workgroupBarrier();
    }
    let total = red[0];
    workgroupBarrier();
    return total;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wid.x;
    let t = wid.y;
    let n = p.start + t + 1u;                 // positions this row sees
    let g = h / (p.nh / p.nkv);
    let qb = t * p.q_stride + h * p.hd;
    let ob = (t * p.nh + h) * p.hd;
    let kb = g * p.cap * p.hd;
    let sb = (t * p.nh + h) * p.cap;
    var m = -3.4028235e38;
    for (var j = lid; j < n; j += WG) {
        var s = 0.0;
        for (var i = 0u; i < p.hd; i++) {
            s += q[qb + i] * kc[kb + j * p.hd + i];
        }
        scores[sb + j] = s;
        m = max(m, s);
    }
    m = reduce(lid, m, 0u);
    var l = 0.0;
    for (var j = lid; j < n; j += WG) {
        let e = exp(scores[sb + j] - m);
        scores[sb + j] = e;
        l += e;
    }
    l = reduce(lid, l, 1u);
    storageBarrier();  // every thread's weights in `scores` visible to the whole workgroup
    for (var i = lid; i < p.hd; i += WG) {
        var acc = 0.0;
        for (var j = 0u; j < n; j++) {
            acc += scores[sb + j] * vc[kb + j * p.hd + i];
        }
        out[ob + i] = acc / l;
    }
}
