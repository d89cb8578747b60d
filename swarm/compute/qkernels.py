"""Compiled (numba) block kernels for :mod:`swarm.compute.quant`; import through ``quant._kernels``.

Kinds: 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q5_0, 4 Q5_1 — block layouts as ggml defines them (32
weights per block; ``d`` and ``m`` are IEEE halves read through a 65536-entry table).
Each kernel has a one-thread form and a ``*_parallel`` form over numba's thread pool (compiled
only where more than one thread is asked for: the pool costs ~60 MiB of RSS). Within a row the
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
def _dot_row(kind, w, x, lanes):
    """Σ_k W[k] x[k] for one encoded row ``w`` (uint8) and float32 ``x`` [cols].

    Each weight is decoded to its float32 value and multiplied into one of 32 lane sums (one
    per position in a block), summed once at the end: vector-wide, no per-block reduction."""
    nb = x.shape[0] // 32
    lanes[:] = 0.0
    if kind == 0:
        for b in range(nb):
            o = b * 34
            d = _half(w, o, _F16)
            for j in range(32):
                lanes[j] += d * F32(np.int8(w[o + 2 + j])) * x[b * 32 + j]
    elif kind == 1:
        for b in range(nb):
            o = b * 18
            d = _half(w, o, _F16)
            for j in range(16):
                q = w[o + 2 + j]
                lanes[j] += d * F32(np.int32(q & 15) - 8) * x[b * 32 + j]
                lanes[16 + j] += d * F32(np.int32(q >> 4) - 8) * x[b * 32 + 16 + j]
    elif kind == 2:
        for b in range(nb):
            o = b * 20
            d = _half(w, o, _F16)
            m = _half(w, o + 2, _F16)
            for j in range(16):
                q = w[o + 4 + j]
                lanes[j] += (d * F32(q & 15) + m) * x[b * 32 + j]
                lanes[16 + j] += (d * F32(q >> 4) + m) * x[b * 32 + 16 + j]
    else:
        off = 6 if kind == 3 else 8
        bias = 16 if kind == 3 else 0
        for b in range(nb):
            o = b * (22 if kind == 3 else 24)
            d = _half(w, o, _F16)
            m = F32(0.0) if kind == 3 else _half(w, o + 2, _F16)
            qh = _u32(w, o + off - 4)
            for j in range(16):
                q0, q1 = _q5(w[o + off + j], qh, j)
                lanes[j] += (d * F32(q0 - bias) + m) * x[b * 32 + j]
                lanes[16 + j] += (d * F32(q1 - bias) + m) * x[b * 32 + 16 + j]
    return lanes.sum()


_CHUNK = 64  # rows per parallel work item (one lane buffer each)


@njit(fastmath=_DOT_MATH, inline="always")
def _matmul_chunk(kind, w, x, out, c, lanes):
    for r in range(c * _CHUNK, min(w.shape[0], (c + 1) * _CHUNK)):
        for t in range(x.shape[0]):
            out[t, r] = _dot_row(kind, w[r], x[t], lanes)


@njit(cache=True, fastmath=_DOT_MATH)
def matmul(kind, w, x, out):
    """out[t, r] = Σ_k W[r, k] x[t, k] for uint8 ``w`` [R, row_bytes], float32 ``x`` [T, K],
    ``out`` float32 [T, R] (written in place). One thread."""
    lanes = np.empty(32, F32)
    for c in range((w.shape[0] + _CHUNK - 1) // _CHUNK):
        _matmul_chunk(kind, w, x, out, c, lanes)


@njit(parallel=True, cache=True, fastmath=_DOT_MATH)
def matmul_parallel(kind, w, x, out):
    """:func:`matmul` with chunks of rows spread over numba's threads (same bits)."""
    for c in prange((w.shape[0] + _CHUNK - 1) // _CHUNK):
        lanes = np.empty(32, F32)
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


@njit(cache=True)
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
