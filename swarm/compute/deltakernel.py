"""The Gated DeltaNet recurrence compiled (numba); import through
:func:`swarm.compute.deltanet.gated_delta_rule` (after the block kernels, which set numba's cache
directory).

numpy runs a position of a 32-head, 128 × 128 state as a dozen passes over 2 MiB arrays
(~2–6 ms); one compiled pass per head keeps the head's state in cache. Each position of each
head is one fixed sequence of float32 operations (sums in ascending index order, no fast-math,
so no fused multiply-add), whatever the number of positions or sequences, so a prefill chunk,
a decode step and a batch give the same bits.
"""

from __future__ import annotations

import numpy as np
from numba import njit

F32 = np.float32


@njit(cache=True, nogil=True, error_model="numpy")
def delta_rule(q, k, v, decay, beta, ssm, out):  # pragma: no cover - compiled
    """For t in 0..T-1 and each head h, in place on ``ssm`` [nv, dk, dv]:
    ``S *= decay[t, h]``; ``delta = beta[t, h] * (v[t, h] - Sᵀ k[t, h])``; ``S += k ⊗ delta``;
    ``out[t, h] = Sᵀ q[t, h]``. q, k [T, nv, dk], v and out [T, nv, dv], decay and beta [T, nv];
    float32, C-contiguous."""
    T, nv, dk = q.shape
    dv = v.shape[2]
    predicted = np.empty(dv, F32)
    delta = np.empty(dv, F32)
    o = np.empty(dv, F32)
    for t in range(T):
        for h in range(nv):
            s = ssm[h]
            g = decay[t, h]
            b = beta[t, h]
            predicted[:] = F32(0.0)
            for i in range(dk):
                ki = k[t, h, i]
                for j in range(dv):
                    s[i, j] = s[i, j] * g
                    predicted[j] += s[i, j] * ki
            for j in range(dv):
                delta[j] = (v[t, h, j] - predicted[j]) * b
            o[:] = F32(0.0)
            for i in range(dk):
                ki = k[t, h, i]
                qi = q[t, h, i]
                for j in range(dv):
                    s[i, j] = s[i, j] + ki * delta[j]
                    o[j] += s[i, j] * qi
            for j in range(dv):
                out[t, h, j] = o[j]
