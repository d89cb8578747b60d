"""Compiled (numba) element-wise steps of the forward pass; import through
``kernels._row_kernels`` (after the block kernels, so numba starts as they start it).

A decode token runs each step dozens of times on a few hundred to a few thousand floats
(the SwiGLU activation 72 times on 512 units in the 64-expert test MoE), where numpy's cost per
call (~1 µs) outweighs the arithmetic: one compiled pass replaces several numpy passes. Each
element gets one fixed float32 operation sequence whatever the row count, so batched rows keep
the bits of solo rows; no fast-math, so the compiler fuses no multiply-add. numpy's error
model: a division by zero gives inf or nan as in numpy, and without Python's zero check the
element loops vectorise. ``add_rms_norm``, ``qk_rope_row``, ``shift_max`` and ``route_row`` are
the steps of one decode row (swarm/compute/decode.py), each the float32 operations of the numpy
steps it replaces, in their order.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from swarm.compute.qkernels import _V8, _floats, _fma, _fma8, _take, _vsum8

F32 = np.float32


@njit(cache=True, nogil=True, error_model="numpy")
def silu_mul(g, u, e):  # pragma: no cover - compiled
    """``g <- g / (1 + e) * u`` in place, with ``e = exp(-g)`` computed by numpy (its vectorised
    exp); g, u, e float32 [n, F] C-contiguous. The operations numpy would do, in one pass."""
    gf = g.reshape(-1)
    uf = u.reshape(-1)
    ef = e.reshape(-1)
    one = F32(1.0)
    for i in range(gf.size):
        gf[i] = gf[i] / (one + ef[i]) * uf[i]


@njit(cache=True, nogil=True, error_model="numpy")
def rms_norm(x, w, eps, out):  # pragma: no cover - compiled
    """``out[r] = w[r % Rw] * (x[r] * (1 / sqrt(mean(x[r]²) + eps)))`` for x, out float32 [R, D],
    w float32 [Rw, D]. The sum of squares is accumulated in float64: element i into lane i % 8
    (the tail into lane 0), the lanes added pairwise; the same order whatever R."""
    _rms_rows(x, w, eps, out, 0, x.shape[0], np.empty(8))


@njit(cache=True, nogil=True, error_model="numpy")
def add_rms_norm(x, y, w, eps, out):  # pragma: no cover - compiled
    """``x += y`` (float32, element by element), then :func:`rms_norm` of the new x into out: the
    residual update and the next norm of a decode row in one call. x, y, out float32 [R, D], w
    float32 [Rw, D]."""
    R, D = x.shape
    for r in range(R):
        for i in range(D):
            x[r, i] += y[r, i]
    _rms_rows(x, w, eps, out, 0, R, np.empty(8))


@njit(inline="always", error_model="numpy")
def _rms_rows(x, w, eps, out, lo, hi, acc):  # pragma: no cover - compiled
    """Rows ``lo:hi`` of :func:`rms_norm`; ``acc`` float64 [8] scratch (:func:`_inv_rms`)."""
    D = x.shape[1]
    Rw = w.shape[0]
    for r in range(lo, hi):
        inv = _inv_rms(x, r, eps, acc)
        wr = w[r % Rw]
        for i in range(D):
            out[r, i] = wr[i] * (x[r, i] * inv)


@njit(inline="always", error_model="numpy")
def _inv_rms(x, r, eps, acc):  # pragma: no cover - compiled
    """``1 / sqrt(mean(x[r]²) + eps)`` (float32) of row r of x float32 [R, D]: the squares summed
    in float64 lanes ``acc`` [8] (element i into lane i % 8, the tail into lane 0, the lanes added
    pairwise), the mean rounded once to float32."""
    D = x.shape[1]
    n8 = D - D % 8
    acc[:] = 0.0
    for i in range(0, n8, 8):
        for j in range(8):
            v = np.float64(x[r, i + j])
            acc[j] += v * v
    for i in range(n8, D):
        v = np.float64(x[r, i])
        acc[0] += v * v
    total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
    return F32(1.0) / np.sqrt(F32(total / D) + eps)


@njit(cache=True, nogil=True, error_model="numpy")
def qk_rope_row(qkv, bias, norm, eps, cos, ssin, q, k, v, pos):  # pragma: no cover - compiled
    """One decode row's attention inputs, the float32 operations of ``Model._attention`` at T = 1.

    qkv float32 [nh + 2 nkv, hd]: the query, key and value projections, one head a row (``bias``
    [same] is added in place first unless it has no rows). Each query and key head is normed as
    :func:`rms_norm` does with its row of ``norm`` [nh + nkv, hd] (no norm when it has no rows),
    then rotated: ``x·cos + swap_halves(x)·ssin`` with the tables cos, ssin [nh + nkv, hd] (the
    attention scale folded into the query rows). The rotated queries go to q [nh, hd], the keys
    to ``k[:, pos]`` and the values to ``v[:, pos]`` (k, v [nkv, C, hd])."""
    n, hd = qkv.shape
    nh, nkv = q.shape[0], k.shape[0]
    half = hd // 2
    if bias.shape[0]:
        for r in range(n):
            for i in range(hd):
                qkv[r, i] += bias[r, i]
    acc = np.empty(8)
    x = np.empty(hd, F32)
    for r in range(nh + nkv):
        if norm.shape[0]:
            inv = _inv_rms(qkv, r, eps, acc)
            for i in range(hd):
                x[i] = norm[r, i] * (qkv[r, i] * inv)
        else:
            for i in range(hd):
                x[i] = qkv[r, i]
        dst = q[r] if r < nh else k[r - nh, pos]
        for i in range(half):
            dst[i] = x[i] * cos[r, i] + x[half + i] * ssin[r, i]
        for i in range(half, hd):
            dst[i] = x[i] * cos[r, i] + x[i - half] * ssin[r, i]
    for h in range(nkv):
        for i in range(hd):
            v[h, pos, i] = qkv[nh + nkv + h, i]


@njit(cache=True, nogil=True, error_model="numpy")
def rope_rows(x, cos, ssin, out):  # pragma: no cover - compiled
    """``out = x·cos + swap_halves(x)·ssin`` for x, out float32 [R, n, hd] (hd even, any strides) and the
    tables cos, ssin float32 [R, m, hd], m = n or 1 (one row for every head): numpy's
    ``x * cos`` then ``+= swapped * ssin`` (``kernels.apply_rope_swapped``), each element's two
    products rounded and then added, as :func:`qk_rope_row` rotates a decode row."""
    R, n, hd = x.shape
    half = hd // 2
    one = cos.shape[1] == 1
    for t in range(R):
        for h in range(n):
            c, s = (cos[t, 0], ssin[t, 0]) if one else (cos[t, h], ssin[t, h])
            xr, dst = x[t, h], out[t, h]
            for i in range(half):
                dst[i] = xr[i] * c[i] + xr[half + i] * s[i]
            for i in range(half, hd):
                dst[i] = xr[i] * c[i] + xr[i - half] * s[i]


@njit(cache=True, nogil=True, error_model="numpy")
def shift_max(x):  # pragma: no cover - compiled
    """``x -= max(x)`` in place, x float32 [n]: numpy's ``x - np.maximum.reduce(x)`` (a NaN makes
    the maximum NaN, as numpy's maximum propagates it)."""
    m = x[0]
    for i in range(1, x.shape[0]):
        if x[i] > m or np.isnan(x[i]):
            m = x[i]
            if np.isnan(m):
                break
    for i in range(x.shape[0]):
        x[i] = x[i] - m


@njit(inline="always", error_model="numpy")
def pairwise_sum(a, lo, n):  # pragma: no cover - compiled
    """``a[lo:lo+n]`` (float32) summed in numpy's order for a contiguous float32 ``np.add.reduce``:
    below 8 elements one by one from -0.0; up to 128, eight running sums (element i into sum
    i % 8) added pairwise, then the tail one by one; beyond, the two halves (the first a multiple
    of 8) summed so and added — numpy's recursion, walked with a stack here (numba does not
    cache recursive functions)."""
    los = np.empty(64, np.int64)
    ns = np.empty(64, np.int64)
    joins = np.zeros(64, np.bool_)
    sums = np.empty(64, F32)
    los[0], ns[0], top, done = lo, n, 1, 0
    while top > 0:
        top -= 1
        lo, n = los[top], ns[top]
        if joins[top]:  # both halves summed: left + right
            joins[top] = False
            done -= 1
            sums[done - 1] = sums[done - 1] + sums[done]
        elif n > 128:
            n2 = n // 2
            n2 -= n2 % 8
            joins[top] = True
            los[top + 1], ns[top + 1] = lo + n2, n - n2  # the right half, summed second
            los[top + 2], ns[top + 2] = lo, n2
            top += 3
        else:
            sums[done] = _block_sum(a, lo, n)
            done += 1
    return sums[0]


@njit(inline="always", error_model="numpy")
def _block_sum(a, lo, n):  # pragma: no cover - compiled
    """numpy's pairwise sum of at most 128 float32 elements ``a[lo:lo+n]``."""
    if n < 8:
        res = F32(-0.0)
        for i in range(n):
            res += a[lo + i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    while i < n - n % 8:
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@njit(cache=True, nogil=True, error_model="numpy")
def route_row(s, softmax, k, norm, scale, experts, weights):  # pragma: no cover - compiled
    """Top-k routing of one row, the float32 operations of ``ffn.route`` at T = 1.

    s float32 [E]: with ``softmax``, ``exp(logits - max)`` (numpy's exp), turned into the softmax
    in place (divided by its sum in numpy's order); else the scores themselves. The k best (ties
    to the lower index, NaN last: ``argsort(-s, kind="stable")``) and their scores go to row 0 of
    ``experts`` int64 [2, k] and ``weights`` float32 [2, k], best first; with ``norm`` the weights
    are divided by their sum (numpy's order), then multiplied by ``scale`` (float32) unless it is
    1. Row 1 holds the same experts ascending, with their weights."""
    E = s.shape[0]
    if softmax:
        total = pairwise_sum(s, 0, E)
        for e in range(E):
            s[e] = s[e] / total
    taken = np.zeros(E, np.bool_)
    for j in range(k):
        b = -1
        for e in range(E):
            if not taken[e] and (b < 0 or s[e] > s[b] or (np.isnan(s[b]) and not np.isnan(s[e]))):
                b = e
        taken[b] = True
        experts[0, j] = b
        weights[0, j] = s[b]
    if norm:
        total = pairwise_sum(weights[0], 0, k)
        for j in range(k):
            weights[0, j] = weights[0, j] / total
    if scale != F32(1.0):
        for j in range(k):
            weights[0, j] = weights[0, j] * scale
    i = 0
    for e in range(E):
        if taken[e]:
            for j in range(k):
                if experts[0, j] == e:
                    weights[1, i] = weights[0, j]
            experts[1, i] = e
            i += 1


def _halving_sum(builder, v, n):
    """The lanes of float32 vector ``v`` (``n`` of them) added in :func:`_lane_sum`'s order."""
    i32 = ir.IntType(32)
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, n), list(range(n))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, n), list(range(n, 2 * n))))
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, i32(0))


def _halving_sums4(builder, vs):
    """:func:`_halving_sum` of up to four 8-lane vectors at once, as one vector [sum(vs[0]),
    sum(vs[1]), …]: the same additions of the same lanes (each lane pair added as one row's
    halving adds it), computed for the rows side by side in three vector additions."""
    i32 = ir.IntType(32)
    vs = list(vs) + [ir.Constant(_V8, [0.0] * 8)] * (4 - len(vs))

    def shuffled(a, b, lanes):
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, len(lanes)), lanes))

    ab = builder.fadd(shuffled(vs[0], vs[1], [0, 1, 2, 3, 8, 9, 10, 11]), shuffled(vs[0], vs[1], [4, 5, 6, 7, 12, 13, 14, 15]))
    cd = builder.fadd(shuffled(vs[2], vs[3], [0, 1, 2, 3, 8, 9, 10, 11]), shuffled(vs[2], vs[3], [4, 5, 6, 7, 12, 13, 14, 15]))
    x = builder.fadd(shuffled(ab, cd, [0, 1, 8, 9, 4, 5, 12, 13]), shuffled(ab, cd, [2, 3, 10, 11, 6, 7, 14, 15]))
    return builder.fadd(shuffled(x, x, [0, 4, 2, 6]), shuffled(x, x, [1, 5, 3, 7]))


def _dot8_rows(m: int):
    """An intrinsic: dot products of ``m`` (a constant) rows of ``a`` with each row of ``b`` in
    a range, sharing each load of ``b``: ``out[ooff[r] + s] = Σ_i a[aoff[r] + i]·b[bo +
    s·bstride + i]`` (i < 8·nb) for r < m and s0 ≤ s < s1 (float32 arrays, C order; aoff, ooff
    int64 arrays). Each sum: element i by fused multiply-add into lane i % 8, ascending i, the
    8 lanes added in :func:`_halving_sum`'s order — the same operations whatever m, so the
    same bits as a row taken alone."""
    @intrinsic
    def dot_rows(typingctx, a, aoff, b, bo, bstride, s0, s1, nb, out, ooff):
        sig = types.none(a, aoff, b, bo, bstride, s0, s1, nb, out, ooff)

        def codegen(context, builder, sig, args):
            def data(i):
                return context.make_array(sig.args[i])(context, builder, args[i]).data
            pa, pao, pb, po, poo = data(0), data(1), data(2), data(8), data(9)
            bo, bstride, s0, s1, nb = args[3], args[4], args[5], args[6], args[7]
            fma, vp, i64, i32 = _fma8(builder), ir.PointerType(_V8), ir.IntType(64), ir.IntType(32)
            rows = [builder.gep(pa, [builder.load(builder.gep(pao, [i64(r)]))]) for r in range(m)]
            outs = [builder.gep(po, [builder.load(builder.gep(poo, [i64(r)]))]) for r in range(m)]
            accs = [cgutils.alloca_once(builder, _V8) for _ in range(m)]
            with cgutils.for_range(builder, builder.sub(s1, s0)) as loop:
                s = builder.add(s0, loop.index)
                brow = builder.gep(pb, [builder.add(bo, builder.mul(s, bstride))])
                for acc in accs:
                    builder.store(ir.Constant(_V8, [0.0] * 8), acc)
                with cgutils.for_range(builder, nb) as inner:
                    off = builder.mul(inner.index, i64(8))
                    vb = builder.load(builder.bitcast(builder.gep(brow, [off]), vp), align=4)
                    for row, acc in zip(rows, accs):
                        va = builder.load(builder.bitcast(builder.gep(row, [off]), vp), align=4)
                        builder.store(builder.call(fma, [va, vb, builder.load(acc)]), acc)
                if m == 1:
                    builder.store(_halving_sum(builder, builder.load(accs[0]), 8), builder.gep(outs[0], [s]))
                else:
                    sums = _halving_sums4(builder, [builder.load(acc) for acc in accs])
                    for r, dst in enumerate(outs):
                        builder.store(builder.extract_element(sums, i32(r)), builder.gep(dst, [s]))
            return context.get_dummy_value()
        return sig, codegen
    return dot_rows


def _weighted_rows8_m(m: int):
    """An intrinsic: weighted sums of the rows of ``v`` for ``m`` (a constant) rows of weights
    over a range of positions, sharing each load of ``v``: ``acc[aoff[r] + i] (+)= Σ_{s0 ≤ s < s1}
    p[poff[r] + s]·v[vo + s·vstride + i]`` for i < 8·nb, one fused multiply-add per element and
    position, s ascending, starting from 0 (``init`` false) or from the values in ``acc``
    (``init`` true: a range continued, the same operations as one range)."""
    group = 4 if m <= 2 else 2  # 8-element blocks whose sums stay in registers, per row

    @intrinsic
    def weighted(typingctx, acc, aoff, v, vo, vstride, p, poff, s0, s1, nb, init):
        sig = types.none(acc, aoff, v, vo, vstride, p, poff, s0, s1, nb, init)

        def codegen(context, builder, sig, args):
            def data(i):
                return context.make_array(sig.args[i])(context, builder, args[i]).data
            pacc, paoff, pv, pp, ppoff = data(0), data(1), data(2), data(5), data(6)
            vo, stride, s0, s1, nb, init = args[3], args[4], args[7], args[8], args[9], args[10]
            fma, vp, i64, i32 = _fma8(builder), ir.PointerType(_V8), ir.IntType(64), ir.IntType(32)
            splat = ir.Constant(ir.VectorType(i32, 8), [0] * 8)
            dsts = [builder.gep(pacc, [builder.load(builder.gep(paoff, [i64(r)]))]) for r in range(m)]
            ps = [builder.gep(pp, [builder.load(builder.gep(ppoff, [i64(r)]))]) for r in range(m)]
            regs = [[cgutils.alloca_once(builder, _V8) for _ in range(group)] for _ in range(m)]
            zero = ir.Constant(_V8, [0.0] * 8)
            start = builder.icmp_unsigned("!=", init, ir.Constant(init.type, 0))
            pv0 = builder.gep(pv, [vo])

            def blocks(first, count):
                for dst, row in zip(dsts, regs):
                    for j, reg in enumerate(row[:count]):
                        off = builder.mul(builder.add(first, i64(j)), i64(8))
                        old = builder.load(builder.bitcast(builder.gep(dst, [off]), vp), align=4)
                        builder.store(builder.select(start, old, zero), reg)
                with cgutils.for_range(builder, builder.sub(s1, s0)) as loop:
                    s = builder.add(s0, loop.index)
                    vrow = builder.gep(pv0, [builder.mul(s, stride)])
                    vv = [builder.load(builder.bitcast(builder.gep(vrow, [builder.mul(builder.add(first, i64(j)), i64(8))]), vp), align=4)
                          for j in range(count)]
                    for p_r, row in zip(ps, regs):
                        w = builder.insert_element(ir.Constant(_V8, ir.Undefined), builder.load(builder.gep(p_r, [s])), i32(0))
                        w = builder.shuffle_vector(w, w, splat)
                        for j, reg in enumerate(row[:count]):
                            builder.store(builder.call(fma, [w, vv[j], builder.load(reg)]), reg)
                for dst, row in zip(dsts, regs):
                    for j, reg in enumerate(row[:count]):
                        off = builder.mul(builder.add(first, i64(j)), i64(8))
                        builder.store(builder.load(reg), builder.bitcast(builder.gep(dst, [off]), vp), align=4)

            groups = builder.udiv(nb, i64(group))
            with cgutils.for_range(builder, groups) as g:
                blocks(builder.mul(g.index, i64(group)), group)
            with cgutils.for_range(builder, builder.sub(nb, builder.mul(groups, i64(group)))) as r:
                blocks(builder.add(builder.mul(groups, i64(group)), r.index), 1)
            return context.get_dummy_value()
        return sig, codegen
    return weighted


_dot_rows1, _dot_rows2, _dot_rows3, _dot_rows4 = (_dot8_rows(m) for m in (1, 2, 3, 4))
_wrows1, _wrows2, _wrows3, _wrows4 = (_weighted_rows8_m(m) for m in (1, 2, 3, 4))


@njit(inline="always", error_model="numpy")
def _expf(x):  # pragma: no cover - compiled
    """e^x in float32 by Cephes' expf: x = n·ln 2 + r (ln 2 in two parts), e^r by a polynomial,
    times 2^n through the exponent bits; x clamped to the normal float32 range. Within ~1e-7
    relative of exp (numpy's float32 exp: ~2e-7). Straight-line float32 arithmetic, so a loop
    over it vectorises (the C library's expf is one call per element)."""
    x = min(max(x, F32(-87.33654)), F32(88.72283))
    n = np.floor(x * F32(1.44269504088896341) + F32(0.5))
    r = x - n * F32(0.693359375)
    r = r - n * F32(-2.12194440e-4)
    p = F32(1.9875691500e-4)
    p = p * r + F32(1.3981999507e-3)
    p = p * r + F32(8.3334519073e-3)
    p = p * r + F32(4.1665795894e-2)
    p = p * r + F32(1.6666665459e-1)
    p = p * r + F32(5.0000001201e-1)
    y = p * (r * r) + r + F32(1.0)
    return y * np.int32((np.int32(n) + np.int32(127)) << np.int32(23)).view(np.float32)


@intrinsic
def _expf_shifted8(typingctx, a, ao, nb, mx):
    """``a[ao + i] = _expf(a[ao + i] - mx)`` for i < 8·nb (float32 array, C order) as vector
    instructions: each element takes :func:`_expf`'s operations in its order (no fused
    multiply-add: the IR says multiply, then add), so an element's bits are the scalar form's."""
    sig = types.none(a, ao, nb, mx)

    def codegen(context, builder, sig, args):
        pa = builder.gep(context.make_array(sig.args[0])(context, builder, args[0]).data, [args[1]])
        f, i32 = ir.FloatType(), ir.IntType(32)
        v8i = ir.VectorType(i32, 8)
        vp = ir.PointerType(_V8)

        def splat(value):
            return ir.Constant(_V8, [float(np.float32(value))] * 8)

        floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8, [_V8]), "llvm.floor.v8f32")
        m = builder.insert_element(ir.Constant(_V8, ir.Undefined), args[3], i32(0))
        m = builder.shuffle_vector(m, m, ir.Constant(v8i, [0] * 8))
        lo, hi = splat(-87.33654), splat(88.72283)
        with cgutils.for_range(builder, args[2]) as loop:
            ptr = builder.bitcast(builder.gep(pa, [builder.mul(loop.index, ir.Constant(loop.index.type, 8))]), vp)
            x = builder.fsub(builder.load(ptr, align=4), m)
            x = builder.select(builder.fcmp_ordered(">", x, lo), x, lo)  # max(x, lo), then min(·, hi)
            x = builder.select(builder.fcmp_ordered("<", x, hi), x, hi)
            n = builder.call(floor, [builder.fadd(builder.fmul(x, splat(1.44269504088896341)), splat(0.5))])
            r = builder.fsub(x, builder.fmul(n, splat(0.693359375)))
            r = builder.fsub(r, builder.fmul(n, splat(-2.12194440e-4)))
            p = splat(1.9875691500e-4)
            for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
                p = builder.fadd(builder.fmul(p, r), splat(c))
            y = builder.fadd(builder.fadd(builder.fmul(p, builder.fmul(r, r)), r), splat(1.0))
            e = builder.shl(builder.add(builder.fptosi(n, v8i), ir.Constant(v8i, [127] * 8)), ir.Constant(v8i, [23] * 8))
            builder.store(builder.fmul(y, builder.bitcast(e, _V8)), ptr, align=4)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _max8(typingctx, a, ao, nb):
    """max(a[ao + i]) over i < 8·nb (float32 array, C order; -inf when nb is 0; NaN ignored, as
    a running ``if x > top`` ignores it), eight lanes at a time."""
    sig = types.float32(a, ao, nb)

    def codegen(context, builder, sig, args):
        pa = builder.gep(context.make_array(sig.args[0])(context, builder, args[0]).data, [args[1]])
        i32 = ir.IntType(32)
        acc = cgutils.alloca_once_value(builder, ir.Constant(_V8, [float("-inf")] * 8))
        with cgutils.for_range(builder, args[2]) as loop:
            x = builder.load(builder.bitcast(builder.gep(pa, [builder.mul(loop.index, ir.Constant(loop.index.type, 8))]),
                                             ir.PointerType(_V8)), align=4)
            top = builder.load(acc)
            builder.store(builder.select(builder.fcmp_ordered(">", x, top), x, top), acc)
        v, k = builder.load(acc), 8
        while k > 1:
            k //= 2
            lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, k), list(range(k))))
            hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, k), list(range(k, 2 * k))))
            v = builder.select(builder.fcmp_ordered(">", hi, lo), hi, lo)
        return builder.extract_element(v, i32(0))
    return sig, codegen


# Query rows blocked together in attention: rows sharing a key/value head (a GQA group's
# heads, consecutive positions) are computed M at a time, each load of a key or value row feeding
# M of them.
M = 4


@njit(inline="always")
def _dots(m, qf, qoff, kf, ko, hd, s0, s1, nb, sf, soff):
    if m == 4:
        _dot_rows4(qf, qoff, kf, ko, hd, s0, s1, nb, sf, soff)
    elif m == 3:
        _dot_rows3(qf, qoff, kf, ko, hd, s0, s1, nb, sf, soff)
    elif m == 2:
        _dot_rows2(qf, qoff, kf, ko, hd, s0, s1, nb, sf, soff)
    else:
        _dot_rows1(qf, qoff, kf, ko, hd, s0, s1, nb, sf, soff)


@njit(inline="always")
def _weighted(m, af, aoff, vf, vo, hd, sf, soff, s0, s1, nb, init):
    if m == 4:
        _wrows4(af, aoff, vf, vo, hd, sf, soff, s0, s1, nb, init)
    elif m == 3:
        _wrows3(af, aoff, vf, vo, hd, sf, soff, s0, s1, nb, init)
    elif m == 2:
        _wrows2(af, aoff, vf, vo, hd, sf, soff, s0, s1, nb, init)
    else:
        _wrows1(af, aoff, vf, vo, hd, sf, soff, s0, s1, nb, init)


@njit(cache=True, nogil=True, error_model="numpy")
def attention(q, k, v, start, out, scores, acc, i0, i1):  # pragma: no cover - compiled
    """Causal grouped-query attention: for q [T, nh, hd] (scaled), k, v [nkv, C, hd] (positions
    ``0 .. start+T-1`` filled), all C-contiguous, query t (position start + t) of head h attends
    to positions ``0 .. start+t`` of key/value head ``h // (nh / nkv)``; result into out
    [T, nh*hd]; scratch ``scores`` float32 [M, ≥ start+T], ``acc`` float32 [M, hd]. Computes
    work items ``i0 ≤ i < i1`` of ``nkv · ceil(T·g / M)`` (g = nh / nkv): item i is key/value
    head ``i // ceil(T·g / M)``'s block ``i % ceil(T·g / M)`` of M query rows — disjoint parts
    of ``out``, so ranges of items run on several threads at once (each with its own scratch).

    Per query row, float32 in one fixed order whatever T: q·k by :func:`_dot8_rows` (eight
    lanes, fused multiply-add, reduced pairwise), the elements past the last multiple of 8
    added after it in order; the softmax subtracts the row's max, takes :func:`_expf` and sums
    by :func:`_vsum8` (position s into lane s % 8), the positions past the last multiple of 8
    added after it in order; Σ p_s v_s by one fused multiply-add per element and position, s
    ascending from 0 (:func:`_weighted_rows8_m`), divided by the sum last.

    Rows are taken M at a time per key/value head (ordered by position, then head): the
    positions all of them see are computed jointly, sharing key and value loads, the rest of
    each row's positions alone, continuing the same sums — so the operations per row, and its
    bits, are those of the row computed alone."""
    T, nh, hd = q.shape
    nkv, C = k.shape[0], k.shape[1]
    g = nh // nkv
    nb = hd // 8
    n8 = nb * 8
    qf, kf, vf = q.reshape(-1), k.reshape(-1), v.reshape(-1)
    sw = scores.shape[1]
    sf, af = scores.reshape(-1), acc.reshape(-1)
    qoff = np.empty(M, np.int64)
    soff = np.empty(M, np.int64)
    aoff = np.empty(M, np.int64)
    ns = np.empty(M, np.int64)
    denom = np.empty(M, np.float32)
    for r in range(M):
        soff[r] = r * sw
        aoff[r] = r * hd
    nblk = (T * g + M - 1) // M
    for item in range(i0, i1):  # (key/value head, block of M rows), in that order
        kvh = item // nblk
        r0 = (item % nblk) * M
        kv0 = kvh * C * hd
        m = min(M, T * g - r0)
        for r in range(m):
            t = (r0 + r) // g
            h = kvh * g + (r0 + r) % g
            qoff[r] = (t * nh + h) * hd
            ns[r] = start + t + 1
        shared = ns[0]  # positions every row of the block sees (rows ordered by position)
        _dots(m, qf, qoff, kf, kv0, hd, 0, shared, nb, sf, soff)
        for r in range(m):
            n = ns[r]
            if n > shared:
                _dot_rows1(qf, qoff[r:r + 1], kf, kv0, hd, shared, n, nb, sf, soff[r:r + 1])
            so = soff[r]
            if n8 < hd:
                for s in range(n):
                    sc = sf[so + s]
                    for c in range(n8, hd):
                        sc = _fma(qf[qoff[r] + c], kf[kv0 + s * hd + c], sc)
                    sf[so + s] = sc
            n8s = n - n % 8
            mx = _max8(sf, so, n8s // 8)
            for s in range(n8s, n):
                if sf[so + s] > mx:
                    mx = sf[so + s]
            _expf_shifted8(sf, so, n8s // 8, mx)
            for s in range(n8s, n):
                sf[so + s] = _expf(sf[so + s] - mx)
            d = _vsum8(sf, so, n8s // 8)
            for s in range(n8s, n):
                d += sf[so + s]
            denom[r] = d
        _weighted(m, af, aoff, vf, kv0, hd, sf, soff, 0, shared, nb, False)
        for r in range(m):
            n = ns[r]
            if n > shared:
                _wrows1(af, aoff[r:r + 1], vf, kv0, hd, sf, soff[r:r + 1], shared, n, nb, True)
            for c in range(n8, hd):
                a = F32(0.0)
                for s in range(n):
                    a = _fma(sf[soff[r] + s], vf[kv0 + s * hd + c], a)
                af[aoff[r] + c] = a
            t = (r0 + r) // g
            h = kvh * g + (r0 + r) % g
            for i in range(hd):
                out[t, h * hd + i] = af[aoff[r] + i] / denom[r]


# Row work: one call of :func:`attention` or :func:`rms_norm` cut into items that every thread
# running :func:`row_work` takes from one atomic counter (the spinning workers' other runner,
# swarm/compute/spin.py). Its table is int64 [n]: field OP names the step, the others its
# operands' addresses (float32, C-contiguous, alive through the call) and sizes.
OP = 0
ATTENTION, RMS_NORM = 1, 2  # OP's values
# ATTENTION: q [T, nh, hd], k and v [nkv, C, hd], out [T, nh*hd], queries at positions start…;
# its items are attention's (key/value head, block of M query rows)
A_Q, A_T, A_NH, A_HD, A_K, A_V, A_NKV, A_C, A_START, A_OUT = range(1, 11)
# RMS_NORM: x and out [R, D], weight [Rw, D] (row r takes weight row r % Rw), eps (float32's
# bits); item i is rows i·per … i·per + per - 1
N_X, N_R, N_D, N_W, N_RW, N_OUT, N_EPS, N_PER = range(1, 9)
ROW_WORK_FIELDS = 11


@njit(cache=True, nogil=True, error_model="numpy")
def row_work(table, counter, items):  # pragma: no cover - compiled
    """Compute items of the row work ``table`` (int64 [ROW_WORK_FIELDS], above) until
    ``counter`` (int64 [2], zero, shared by every thread running this call) passes ``items``, the
    call's item count. Returns the items this thread computed. An item is computed by the
    kernel the one-thread call runs (attention's items one at a time, rows by :func:`rms_norm`'s
    loop), so every output element keeps its one order of float32 operations. Releases the GIL."""
    done = 0
    if table[OP] == ATTENTION:
        T, nh, hd, nkv, C, start = table[A_T], table[A_NH], table[A_HD], table[A_NKV], table[A_C], table[A_START]
        q = _floats(table[A_Q], T, nh * hd).reshape((T, nh, hd))
        k = _floats(table[A_K], nkv, C * hd).reshape((nkv, C, hd))
        v = _floats(table[A_V], nkv, C * hd).reshape((nkv, C, hd))
        out = _floats(table[A_OUT], T, nh * hd)
        scores = np.empty((M, start + T), F32)  # this thread's scratch, for all its items
        acc = np.empty((M, hd), F32)
        while True:
            i = _take(counter)
            if i >= items:
                return done
            attention(q, k, v, start, out, scores, acc, i, i + 1)
            done += 1
    R, D, per = table[N_R], table[N_D], table[N_PER]
    x = _floats(table[N_X], R, D)
    w = _floats(table[N_W], table[N_RW], D)
    out = _floats(table[N_OUT], R, D)
    eps = np.int32(table[N_EPS]).view(np.float32)
    lanes = np.empty(8)
    while True:
        i = _take(counter)
        if i >= items:
            return done
        _rms_rows(x, w, eps, out, i * per, min(R, i * per + per), lanes)
        done += 1


@njit(cache=True, nogil=True, error_model="numpy")
def weighted_sum(out, ys, weights):  # pragma: no cover - compiled
    """``out += ys[j] * weights[j]`` for j = 0, 1, … in turn: out float32 [H], ys float32 [n, H],
    weights float32 [n]; each product rounded to float32, then added (no fused multiply-add):
    numpy's ``np.multiply`` then ``+=`` per row, in one pass (a decode step's MoE combine)."""
    for j in range(ys.shape[0]):
        wj = weights[j]
        for i in range(out.shape[0]):
            out[i] += ys[j, i] * wj
