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
