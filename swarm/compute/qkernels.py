"""Compiled (numba) block kernels for :mod:`swarm.compute.quant`; import through ``quant._kernels``.

Kinds: 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q5_0, 4 Q5_1 — block layouts as ggml defines them (32
weights per block; ``d`` and ``m`` are IEEE halves read through a 65536-entry table).
Each kernel has a one-thread form, which releases the GIL (other Python threads — the event
loop, a loopback peer — run meanwhile), and a ``*_parallel`` form over numba's thread pool
(compiled only where more than one thread is asked for: the pool costs ~60 MiB of RSS). Within a row the
order of additions is fixed, so every row's result is the same whatever the thread count.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

F32 = np.float32
# The dot kernels may reassociate float32 sums (vectorised) and fuse multiply-adds; the
# order the compiler picks is fixed for a given build, so results are reproducible.
_DOT_MATH = {"reassoc", "contract", "nsz", "arcp"}


# Every IEEE half bit pattern's float32 value: how block scales are read.
_F16 = np.arange(65536, dtype=np.uint16).view(np.float16).astype(F32)


@njit(inline="always")
def _half(w, o, f16):
    return f16[np.int64(w[o]) | (np.int64(w[o + 1]) << 8)]


@njit(inline="always")
def _u32(w, o):
    return (np.uint32(w[o]) | (np.uint32(w[o + 1]) << np.uint32(8))
            | (np.uint32(w[o + 2]) << np.uint32(16)) | (np.uint32(w[o + 3]) << np.uint32(24)))


@njit(inline="always")
def _q5(q, qh, j):
    """The two 5-bit values of Q5_0/Q5_1 byte ``q`` (low nibble: weight j, high: j + 16)."""
    q0 = np.int32(q & 15) | (np.int32((qh >> np.uint32(j)) & np.uint32(1)) << 4)
    q1 = np.int32(q >> 4) | (np.int32((qh >> np.uint32(j + 16)) & np.uint32(1)) << 4)
    return q0, q1


@njit(fastmath=_DOT_MATH, inline="always")
def _dot_rows(kind, wa, wb, x, lanes):
    """Σ_k W[k] x[k] for two encoded rows ``wa``, ``wb`` (uint8) and float32 ``x`` [cols].

    Each weight is decoded to its float32 value and multiplied into one of 32 lane sums per row
    (one per position in a block), summed once at the end: vector-wide, no per-block reduction.
    Two rows per pass share the loads of ``x`` and keep two independent chains in flight; a row
    computed alone is passed as both (same code, same bits). ``lanes``: float32 [2, 32] scratch."""
    nb = x.shape[0] // 32
    lanes[:] = 0.0
    la = lanes[0]
    lb = lanes[1]
    if kind == 0:
        for b in range(nb):
            o = b * 34
            da = _half(wa, o, _F16)
            db = _half(wb, o, _F16)
            for j in range(32):
                xv = x[b * 32 + j]
                la[j] += da * F32(np.int8(wa[o + 2 + j])) * xv
                lb[j] += db * F32(np.int8(wb[o + 2 + j])) * xv
    elif kind == 1:
        for b in range(nb):
            o = b * 18
            da = _half(wa, o, _F16)
            db = _half(wb, o, _F16)
            for j in range(16):
                qa = wa[o + 2 + j]
                qb = wb[o + 2 + j]
                x0 = x[b * 32 + j]
                x1 = x[b * 32 + 16 + j]
                la[j] += da * F32(np.int32(qa & 15) - 8) * x0
                la[16 + j] += da * F32(np.int32(qa >> 4) - 8) * x1
                lb[j] += db * F32(np.int32(qb & 15) - 8) * x0
                lb[16 + j] += db * F32(np.int32(qb >> 4) - 8) * x1
    elif kind == 2:
        for b in range(nb):
            o = b * 20
            da = _half(wa, o, _F16)
            ma = _half(wa, o + 2, _F16)
            db = _half(wb, o, _F16)
            mb = _half(wb, o + 2, _F16)
            for j in range(16):
                qa = wa[o + 4 + j]
                qb = wb[o + 4 + j]
                x0 = x[b * 32 + j]
                x1 = x[b * 32 + 16 + j]
                la[j] += (da * F32(qa & 15) + ma) * x0
                la[16 + j] += (da * F32(qa >> 4) + ma) * x1
                lb[j] += (db * F32(qb & 15) + mb) * x0
                lb[16 + j] += (db * F32(qb >> 4) + mb) * x1
    else:
        off = 6 if kind == 3 else 8
        bias = 16 if kind == 3 else 0
        for b in range(nb):
            o = b * (22 if kind == 3 else 24)
            da = _half(wa, o, _F16)
            db = _half(wb, o, _F16)
            ma = F32(0.0) if kind == 3 else _half(wa, o + 2, _F16)
            mb = F32(0.0) if kind == 3 else _half(wb, o + 2, _F16)
            qha = _u32(wa, o + off - 4)
            qhb = _u32(wb, o + off - 4)
            for j in range(16):
                a0, a1 = _q5(wa[o + off + j], qha, j)
                b0, b1 = _q5(wb[o + off + j], qhb, j)
                x0 = x[b * 32 + j]
                x1 = x[b * 32 + 16 + j]
                la[j] += (da * F32(a0 - bias) + ma) * x0
                la[16 + j] += (da * F32(a1 - bias) + ma) * x1
                lb[j] += (db * F32(b0 - bias) + mb) * x0
                lb[16 + j] += (db * F32(b1 - bias) + mb) * x1
    return la.sum(), lb.sum()


_CHUNK = 64  # rows per parallel work item (one lane buffer each); even, so pairs never straddle


@njit(fastmath=_DOT_MATH, inline="always")
def _matmul_chunk(kind, w, x, out, c, lanes):
    hi = min(w.shape[0], (c + 1) * _CHUNK)
    for r in range(c * _CHUNK, hi, 2):
        r2 = r + 1 if r + 1 < hi else r
        for t in range(x.shape[0]):
            out[t, r], out[t, r2] = _dot_rows(kind, w[r], w[r2], x[t], lanes)


@njit(cache=True, nogil=True, fastmath=_DOT_MATH)
def matmul(kind, w, x, out):
    """out[t, r] = Σ_k W[r, k] x[t, k] for uint8 ``w`` [R, row_bytes], float32 ``x`` [T, K],
    ``out`` float32 [T, R] (written in place). One thread."""
    lanes = np.empty((2, 32), F32)
    for c in range((w.shape[0] + _CHUNK - 1) // _CHUNK):
        _matmul_chunk(kind, w, x, out, c, lanes)


@njit(parallel=True, cache=True, fastmath=_DOT_MATH)
def matmul_parallel(kind, w, x, out):
    """:func:`matmul` with chunks of rows spread over numba's threads (same bits)."""
    for c in prange((w.shape[0] + _CHUNK - 1) // _CHUNK):
        lanes = np.empty((2, 32), F32)
        _matmul_chunk(kind, w, x, out, c, lanes)


@njit(inline="always")
def _dequant_row(kind, row, dst):
    nb = dst.shape[0] // 32
    if kind == 0:
        for b in range(nb):
            o = b * 34
            d = _half(row, o, _F16)
            for j in range(32):
                dst[b * 32 + j] = d * F32(np.int8(row[o + 2 + j]))
    elif kind == 1:
        for b in range(nb):
            o = b * 18
            d = _half(row, o, _F16)
            for j in range(16):
                q = row[o + 2 + j]
                dst[b * 32 + j] = d * F32(np.int32(q & 15) - 8)
                dst[b * 32 + 16 + j] = d * F32(np.int32(q >> 4) - 8)
    elif kind == 2:
        for b in range(nb):
            o = b * 20
            d = _half(row, o, _F16)
            m = _half(row, o + 2, _F16)
            for j in range(16):
                q = row[o + 4 + j]
                dst[b * 32 + j] = d * F32(q & 15) + m
                dst[b * 32 + 16 + j] = d * F32(q >> 4) + m
    else:
        off = 6 if kind == 3 else 8
        for b in range(nb):
            o = b * (22 if kind == 3 else 24)
            d = _half(row, o, _F16)
            m = F32(0.0) if kind == 3 else _half(row, o + 2, _F16)
            qh = _u32(row, o + off - 4)
            for j in range(16):
                q0, q1 = _q5(row[o + off + j], qh, j)
                if kind == 3:
                    dst[b * 32 + j] = d * F32(q0 - 16)
                    dst[b * 32 + 16 + j] = d * F32(q1 - 16)
                else:
                    dst[b * 32 + j] = d * F32(q0) + m
                    dst[b * 32 + 16 + j] = d * F32(q1) + m


@njit(cache=True, nogil=True)
def dequant(kind, w, out):
    """Decode uint8 ``w`` [R, row_bytes] into float32 ``out`` [R, K] with the same float32
    operations as ``gguf.quants.dequantize`` (so the values are identical). One thread."""
    for r in range(w.shape[0]):
        _dequant_row(kind, w[r], out[r])


@njit(parallel=True, cache=True)
def dequant_parallel(kind, w, out):
    """:func:`dequant` with chunks of rows spread over numba's threads."""
    for c in prange((w.shape[0] + _CHUNK - 1) // _CHUNK):
        for r in range(c * _CHUNK, min(w.shape[0], (c + 1) * _CHUNK)):
            _dequant_row(kind, w[r], out[r])
