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
from numba import carray, njit

from swarm.compute.qkernels import _axpy8, _dot8, _fma, _lane_sum, _stack

F32 = np.float32
_sum8 = _lane_sum(8)


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


@njit(cache=True, nogil=True, error_model="numpy")
def attention(q, k, v, start, out, scores):  # pragma: no cover - compiled
    """Causal grouped-query attention, one query row at a time: for q [T, nh, hd] (scaled),
    k, v [nkv, C, hd] (positions ``0 .. start+T-1`` filled), all C-contiguous, query t
    (position start + t) of head h attends to positions ``0 .. start+t`` of key/value head
    ``h // (nh / nkv)``; result into out [T, nh*hd]; ``scores`` float32 [≥ start+T] scratch.
    Float32, in one fixed order whatever T: q·k by :func:`_dot8` (eight lanes, fused
    multiply-add), the elements past the last multiple of 8 added after it in order; the
    softmax subtracts the row's max and sums the exponentials in eight lanes (position s into
    lane s % 8, the tail into lane 0; numba's expf, the C library's); Σ p_s v_s by one fused
    multiply-add per element and position, s ascending, divided by the sum last."""
    T, nh, hd = q.shape
    nkv, C = k.shape[0], k.shape[1]
    g = nh // nkv
    nb = hd // 8
    n8 = nb * 8
    qf, kf, vf = q.reshape(-1), k.reshape(-1), v.reshape(-1)
    acc = np.empty(hd, F32)
    lane = carray(_stack(8), 8)
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
            for i in range(8):
                lane[i] = F32(0.0)
            for s0 in range(0, n8s, 8):
                for i in range(8):
                    e = np.exp(scores[s0 + i] - m)
                    scores[s0 + i] = e
                    lane[i] += e
            for s in range(n8s, n):
                e = np.exp(scores[s] - m)
                scores[s] = e
                lane[0] += e
            denom = _sum8(lane)
            for i in range(hd):
                acc[i] = F32(0.0)
            for s in range(n):
                vo = kv0 + s * hd
                p = scores[s]
                _axpy8(acc, 0, vf, vo, nb, p)
                for c in range(n8, hd):
                    acc[c] = _fma(p, vf[vo + c], acc[c])
            o = out[t]
            for i in range(hd):
                o[h * hd + i] = acc[i] / denom
