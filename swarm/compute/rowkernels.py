"""Compiled (numba) element-wise steps of the forward pass; import through
``kernels._row_kernels`` (after the block kernels, so numba starts as they start it).

A decode token runs each step dozens of times on a few hundred to a few thousand floats
(the SwiGLU activation 72 times on 512 units in the 64-expert test MoE), where numpy's cost per
call (~1 µs) outweighs the arithmetic: one compiled pass replaces several numpy passes. Each
element gets one fixed float32 operation sequence whatever the row count, so batched rows keep
the bits of solo rows; no fast-math, so the compiler fuses no multiply-add. numpy's error
model: a division by zero gives inf or nan as in numpy, and without Python's zero check the
element loops vectorise.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from swarm.compute.qkernels import _dot8, _fma, _vsum8, _weighted_rows8

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
    R, D = x.shape
    Rw = w.shape[0]
    one = F32(1.0)
    n8 = D - D % 8
    acc = np.empty(8)  # 8 independent float64 sums (lane i % 8): no chain of dependent adds
    for r in range(R):
        acc[:] = 0.0
        for i in range(0, n8, 8):
            for j in range(8):
                v = np.float64(x[r, i + j])
                acc[j] += v * v
        for i in range(n8, D):
            v = np.float64(x[r, i])
            acc[0] += v * v
        total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
        inv = one / np.sqrt(F32(total / D) + eps)
        wr = w[r % Rw]
        for i in range(D):
            out[r, i] = wr[i] * (x[r, i] * inv)


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


@njit(cache=True, nogil=True, error_model="numpy")
def attention(q, k, v, start, out, scores, acc):  # pragma: no cover - compiled
    """Causal grouped-query attention, one query row at a time: for q [T, nh, hd] (scaled),
    k, v [nkv, C, hd] (positions ``0 .. start+T-1`` filled), all C-contiguous, query t
    (position start + t) of head h attends to positions ``0 .. start+t`` of key/value head
    ``h // (nh / nkv)``; result into out [T, nh*hd]; scratch ``scores`` float32 [≥ start+T],
    ``acc`` float32 [hd]. Float32, in one fixed order whatever T: q·k by :func:`_dot8` (eight
    lanes, fused multiply-add), the elements past the last multiple of 8 added after it in
    order; the softmax subtracts the row's max, takes :func:`_expf` and sums by
    :func:`_vsum8` (position s into lane s % 8), the positions past the last multiple of 8
    added after it in order; Σ p_s v_s by one fused multiply-add per element and position, s
    ascending from 0 (:func:`_weighted_rows8`), divided by the sum last."""
    T, nh, hd = q.shape
    nkv, C = k.shape[0], k.shape[1]
    g = nh // nkv
    nb = hd // 8
    n8 = nb * 8
    qf, kf, vf = q.reshape(-1), k.reshape(-1), v.reshape(-1)
    for t in range(T):
        n = start + t + 1
        n8s = n - n % 8
        for h in range(nh):
            qo = (t * nh + h) * hd
            kv0 = (h // g) * C * hd
            top = -np.inf
            for s in range(n):
                ko = kv0 + s * hd
                sc = _dot8(qf, qo, kf, ko, nb)
                for c in range(n8, hd):
                    sc = _fma(qf[qo + c], kf[ko + c], sc)
                scores[s] = sc
                if sc > top:
                    top = sc
            m = F32(top)
            for s in range(n):
                scores[s] = _expf(scores[s] - m)
            denom = _vsum8(scores, 0, n8s // 8)
            for s in range(n8s, n):
                denom += scores[s]
            _weighted_rows8(acc, 0, vf, kv0, hd, scores, n, nb)
            for c in range(n8, hd):
                a = F32(0.0)
                for s in range(n):
                    a = _fma(scores[s], vf[kv0 + s * hd + c], a)
                acc[c] = a
            o = out[t]
            for i in range(hd):
                o[h * hd + i] = acc[i] / denom
