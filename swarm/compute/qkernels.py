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
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

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


@njit(inline="always")
def _f5(q, qh, j):
    """:func:`_q5` as float32, through uint8 so that the compiler keeps byte-wide vector lanes
    (numba widens integer arithmetic to 64 bits, which vectorises 8 lanes at a time, not 16+)."""
    u1 = np.uint8(1)
    q0 = np.uint8(q & np.uint8(15)) | (np.uint8(np.uint8(qh >> np.uint32(j)) & u1) << np.uint8(4))
    q1 = np.uint8(q >> np.uint8(4)) | (np.uint8(np.uint8(qh >> np.uint32(j + 16)) & u1) << np.uint8(4))
    return F32(np.uint8(q0)), F32(np.uint8(q1))


@njit(inline="always")
def _lo(q):
    return F32(np.uint8(q & np.uint8(15)))


@njit(inline="always")
def _hi(q):
    return F32(np.uint8(q >> np.uint8(4)))


@intrinsic
def _stack(typingctx, n):
    """``n`` (a constant) float32 on the stack, not the heap: the compiler keeps them in vector
    registers. Wrap with ``carray(_stack(n), n)``."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    size = n.literal_value

    def codegen(context, builder, sig, args):
        return cgutils.alloca_once(builder, ir.FloatType(), size=ir.Constant(ir.IntType(64), size))
    return types.CPointer(types.float32)(n), codegen


@intrinsic
def _prefetch(typingctx, w, offset):
    """Hint the cache to load the byte ``offset`` bytes past ``w``'s first (never faults)."""
    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        i8p = ir.PointerType(ir.IntType(8))
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p] + [ir.IntType(32)] * 3), "llvm.prefetch.p0")
        i32 = ir.IntType(32)
        # read, keep in all cache levels, data cache
        builder.call(fn, [builder.gep(builder.bitcast(data, i8p), [args[1]]), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()
    return types.none(w, types.intp), codegen


@njit(inline="always")
def _prefetch_ahead(w, offset, end):
    if offset < end:
        _prefetch(w, offset)


# How far ahead of the pair of rows being read the next bytes are prefetched: the hardware
# prefetcher alone leaves a GEMV over a matrix that is not in cache at ~1/3 of memory speed.
_PREFETCH_BYTES = 4096


@njit(fastmath=_DOT_MATH, inline="always")
def _nibbles(wa, wb, q, x, b, la, lb, da, ma, db, mb):
    """Lane sums += (d·nibble + m)·x over block ``b`` of two Q4 rows whose 16 bytes start at ``q``."""
    for j in range(16):
        qa = wa[q + j]
        qb = wb[q + j]
        x0 = x[b * 32 + j]
        x1 = x[b * 32 + 16 + j]
        la[j] += (da * _lo(qa) + ma) * x0
        la[16 + j] += (da * _hi(qa) + ma) * x1
        lb[j] += (db * _lo(qb) + mb) * x0
        lb[16 + j] += (db * _hi(qb) + mb) * x1


@njit(fastmath=_DOT_MATH, inline="always")
def _fives(wa, wb, h, x, b, la, lb, da, ma, db, mb):
    """:func:`_nibbles` for Q5 rows: 4 bytes of fifth bits at ``h``, then the 16 nibble bytes."""
    qha = _u32(wa, h)
    qhb = _u32(wb, h)
    for j in range(16):
        a0, a1 = _f5(wa[h + 4 + j], qha, j)
        b0, b1 = _f5(wb[h + 4 + j], qhb, j)
        x0 = x[b * 32 + j]
        x1 = x[b * 32 + 16 + j]
        la[j] += (da * a0 + ma) * x0
        la[16 + j] += (da * a1 + ma) * x1
        lb[j] += (db * b0 + mb) * x0
        lb[16 + j] += (db * b1 + mb) * x1


@njit(fastmath=_DOT_MATH, inline="always")
def _dot_rows(kind, w, ra, rb, x, la, lb):
    """Σ_k W[r, k] x[k] for the two encoded rows ``ra``, ``rb`` of uint8 ``w`` [R, row_bytes] and
    float32 ``x`` [cols].

    Each weight is decoded to float32 (``d·q + m``) and multiplied into one of 32 lane sums per
    row (one per position in a block), summed once at the end: vector-wide, no per-block
    reduction. Two rows per pass share the loads of ``x`` and keep two independent chains in
    flight; a row computed alone is passed as both (same code, same bits). ``la``, ``lb``:
    float32 [32] scratch (from :func:`_stack`)."""
    nb = x.shape[0] // 32
    wa = w[ra]
    wb = w[rb]
    for j in range(32):
        la[j] = 0.0
        lb[j] = 0.0
    ahead = ra * w.strides[0] + _PREFETCH_BYTES  # the pair's bytes are read 2 blocks at a time
    end = w.shape[0] * w.strides[0]
    if kind == 0:
        for b in range(nb):
            o = b * 34
            _prefetch_ahead(w, ahead + 2 * o, end)
            da = _half(wa, o, _F16)
            db = _half(wb, o, _F16)
            for j in range(32):
                xv = x[b * 32 + j]
                la[j] += da * F32(np.int8(wa[o + 2 + j])) * xv
                lb[j] += db * F32(np.int8(wb[o + 2 + j])) * xv
    elif kind == 1:  # d·(q − 8) = d·q + (−8d)
        for b in range(nb):
            o = b * 18
            _prefetch_ahead(w, ahead + 2 * o, end)
            da = _half(wa, o, _F16)
            db = _half(wb, o, _F16)
            _nibbles(wa, wb, o + 2, x, b, la, lb, da, F32(-8.0) * da, db, F32(-8.0) * db)
    elif kind == 2:
        for b in range(nb):
            o = b * 20
            _prefetch_ahead(w, ahead + 2 * o, end)
            _nibbles(wa, wb, o + 4, x, b, la, lb, _half(wa, o, _F16), _half(wa, o + 2, _F16),
                     _half(wb, o, _F16), _half(wb, o + 2, _F16))
    elif kind == 3:  # d·(q − 16) = d·q + (−16d)
        for b in range(nb):
            o = b * 22
            _prefetch_ahead(w, ahead + 2 * o, end)
            da = _half(wa, o, _F16)
            db = _half(wb, o, _F16)
            _fives(wa, wb, o + 2, x, b, la, lb, da, F32(-16.0) * da, db, F32(-16.0) * db)
    else:
        for b in range(nb):
            o = b * 24
            _prefetch_ahead(w, ahead + 2 * o, end)
            _fives(wa, wb, o + 4, x, b, la, lb, _half(wa, o, _F16), _half(wa, o + 2, _F16),
                   _half(wb, o, _F16), _half(wb, o + 2, _F16))
    sa = F32(0.0)
    sb = F32(0.0)
    for j in range(32):
        sa += la[j]
        sb += lb[j]
    return sa, sb


_CHUNK = 64  # rows per parallel work item; even, so pairs never straddle


@njit(fastmath=_DOT_MATH, inline="always")
def _matmul_chunk(kind, w, x, out, c, la, lb):
    hi = min(w.shape[0], (c + 1) * _CHUNK)
    for r in range(c * _CHUNK, hi, 2):
        r2 = r + 1 if r + 1 < hi else r
        for t in range(x.shape[0]):
            out[t, r], out[t, r2] = _dot_rows(kind, w, r, r2, x[t], la, lb)


@njit(cache=True, nogil=True, fastmath=_DOT_MATH)
def matmul(kind, w, x, out):
    """out[t, r] = Σ_k W[r, k] x[t, k] for uint8 ``w`` [R, row_bytes], float32 ``x`` [T, K],
    ``out`` float32 [T, R] (written in place). One thread."""
    la = carray(_stack(32), 32)
    lb = carray(_stack(32), 32)
    for c in range((w.shape[0] + _CHUNK - 1) // _CHUNK):
        _matmul_chunk(kind, w, x, out, c, la, lb)


@njit(parallel=True, cache=True, fastmath=_DOT_MATH)
def matmul_parallel(kind, w, x, out):
    """:func:`matmul` with chunks of rows spread over numba's threads (same bits)."""
    for c in prange((w.shape[0] + _CHUNK - 1) // _CHUNK):
        la = carray(_stack(32), 32)
        lb = carray(_stack(32), 32)
        _matmul_chunk(kind, w, x, out, c, la, lb)


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
