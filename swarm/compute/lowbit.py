"""Compiled (numba) kernels for the low-bit GGUF types of 2- and 3-bit files — Q2_K, Q3_K,
IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M — and the row decoders
(embedding lookups, unaligned column cuts) of those and of Q4_K, Q5_K, Q6_K. Import through
``quant._lowbit``, which loads one type's kernel (from numba's cache, or compiling it: seconds)
the first time a matrix of that type is used.

**Decoders.** Per type one ``_dec_*(w, o, d, do)``: the block (super-block of 256, or IQ4_NL's
32) at byte ``o`` of weight row ``w`` (uint8) into float32 ``d[do:do + block]``, by the float32
operations ``gguf.quants`` dequantizes with, in its order (``d·sc·q − dmin·m`` as two roundings,
``(d·(0.5 + s))·0.25``, …): the values are gguf's, bit for bit. Grids and sign tables are read
from ``gguf.quants`` (``IQ2_XXS.ksigns``, each class's ``grid``, ``IQ4_NL.kvalues``).

**Products.** A few weight rows decoded whole, then qkernels' float32 tiles over every
activation row; for Q2_K, Q3_K and IQ4_NL at T ≤ 16-32 (the scalar form's 4: decode steps of
several sequences), a tile of weight rows by up to 4 activation rows (1 × 4 without AVX-512,
2 × 4 with it; at T = 1 1 × 1 and 4 × 1), whose blocks are decoded in vector registers once
and applied to the tile's activation rows as they are decoded
(:data:`FORMS`: Q2_K by a shift and a 4-entry table per 8 weights where the CPU has AVX2, else 16
weights at a time in lane order; the decoders' loops into a stack buffer where a type has no vector
block). Either way element k of a row goes into
lane k % 32 by fused multiply-add, k ascending, the lanes reduced in
:func:`qkernels._lane_sum`'s order: the operations of the float32 kernel (``qkernels.matmul_f32``)
on gguf's decoded matrix, so an output's bits are that kernel's — the decoded-tile path these
types took before — whatever T, the rows beside it or the thread count.

One cached entry point per type (``q2_k(op, w, x, out, lo, hi)`` …): op 0 multiplies (out
[T, R] columns lo:hi = x [T, K] @ W[lo:hi].T), op 1 decodes rows lo:hi of ``w`` into out
[hi - lo, K] (``x`` unused). A type's kernels compile only when a matrix of that type is used.
They compile in qkernels' helpers and float32 tiles, and numba checks a cached function against
its own source file only: a change to qkernels.py reaches these kernels once this file changes
too (or numba's cache is cleared) — the bit-equality tests with the float32 kernel tell.
"""

from __future__ import annotations

import gguf.quants as gq
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from llvmlite import ir
from numba import carray, njit, types  # noqa: F401 (carray: used by the generated tile source)
from numba.core import cgutils
from numba.extending import intrinsic

from swarm.compute.qkernels import AVX512, _F16, _PREFETCH_BYTES, _TILES, _half, _rows_f32, _u32
from swarm.compute.qkernels import _fma, _prefetch_ahead, _stack, _sum32, _zero32  # noqa: F401 (the tile source's)
from swarm.compute.qkernels import _BYTES16, _I8V, _I16, _I32, _I64, _V8F, _V16, _load, _splat, _target_has, _tuple_data

F32 = np.float32
# Weight rows decoded at a time before the float32 tiles run (float32 [rows, K]: 32 KiB per 1024
# columns).
_DECODED_ROWS = 8
# Types whose decode is fast enough to interleave with a decode step's dot products:
# even as 32-wide loops that vectorise, 1.2–1.4x faster there than decoding rows first (and they
# have vector blocks, below); the grid types and IQ4_XS, whose decoders gather, are 2–3x faster
# decoding rows first (bench/results/kernels.md).
_FUSED = (QT.Q2_K, QT.Q3_K, QT.IQ4_NL)
# Activation rows up to which these types take the decode tile (each block decoded once for a
# tile's activation rows) rather than decoding the weight rows whole once (then the float32
# tiles): on a Zen 3 core, [4096, 2560], two runs, the vector forms' 1 × 4 tile took 0.17-0.33x
# the decoders' path's time at T = 1, 0.50-0.57x at 8, 0.66-0.88x at 16, at 32 0.76-0.87x
# (Q2_K), 0.91-0.97x (IQ4_NL) and 0.91-1.02x (Q3_K), at 64 0.93-1.19x; the scalar form's 2 × 4
# (limit below) 0.89x (Q3_K) and 0.75x (IQ4_NL) at 4, 1.32x and 1.03x at 8
# (bench/results/engine.md).
_FUSED_ROWS = {QT.Q2_K: 32, QT.Q3_K: 16, QT.IQ4_NL: 32}
_SCALAR_FUSED_ROWS = 4
# Their decode tile's forms, the same bits: the vector blocks below (words, lanes), or the
# decoders' loops (scalar).
FORMS = ("words", "lanes", "scalar")
# Its shapes, weight rows × activation rows, for a step of one row and of several: for the vector
# forms without AVX-512 1 × 1 and 1 × 4, whose 16 vector registers hold one weight row's 32 lane
# sums for each activation row (on a Zen 3 core a step of 4 rows took 0.40-0.57x the time of
# 1 × 1 once a row; 1 × 3 and 1 × 2 were slower from T = 4, and 4 × 1 took 1.05-1.5x 1 × 1's time
# at T = 1); with AVX-512's 32, 4 × 1 and 2 × 4 (on a Xeon 2 × 4 took 0.37-0.80x 4 × 1's time at
# T = 2-8; 1.03-1.13x at T = 1, where 1 × 4 ran as 1 × 1 and took 1.06-1.17x). The scalar form
# (IQ4_NL where x86 has no pshufb, other CPUs) decodes into a stack buffer first and takes 2 × 1
# and 2 × 4: on the Zen 3 core 0.96-1.00x the time of its 4 × 1 at T = 1, 0.31-0.34x at T = 4
# (1 × 1 took 1.8-1.9x at T = 1) (bench/results/engine.md).
_DECODE_TILES = ((4, 1), (2, 4)) if AVX512 else ((1, 1), (1, 4))
_SCALAR_DECODE_TILES = ((2, 1), (2, 4))
_MAX_ACTS = 4  # activation rows a decode tile may take (its tiles of fewer are compiled beside it)


def _grid(cls) -> np.ndarray:
    """``cls``'s grid (float32 [entries, 4 or 8]) as gguf-py unpacks it."""
    cls.init_grid()
    return np.ascontiguousarray(cls.grid.reshape(cls.grid_shape), dtype=F32)


_KSIGNS = np.frombuffer(gq.IQ2_XXS.ksigns, np.uint8)  # 7 sign bits → 8 (odd parity)
# ±1.0 per bit of a sign byte (gguf multiplies by these): [256, 8], and of the 128 ksigns [128, 8].
_SIGN8 = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, F32(-1), F32(1)).astype(F32)
_KSIGN8 = np.ascontiguousarray(_SIGN8[_KSIGNS])
_KVALUES = np.array(gq.IQ4_NL.kvalues, F32)
_IQ2XXS, _IQ2XS, _IQ2S = _grid(gq.IQ2_XXS), _grid(gq.IQ2_XS), _grid(gq.IQ2_S)
_IQ3XXS, _IQ3S, _IQ1 = _grid(gq.IQ3_XXS), _grid(gq.IQ3_S), _grid(gq.IQ1_S)
_DELTA = F32(gq.IQ1_S.delta)
assert gq.IQ1_M.grid_hex == gq.IQ1_S.grid_hex and gq.IQ1_M.delta == gq.IQ1_S.delta


@njit(inline="always")
def _u16(w, o):
    return np.uint32(w[o]) | (np.uint32(w[o + 1]) << np.uint32(8))


# ---- decoders, one per type: block at byte o of row w → d[do:do + block] -----------------------
@njit(inline="always")
def _dec_q2_k(w, o, d, do):
    dd = _half(w, o + 80, _F16)
    dmin = _half(w, o + 82, _F16)
    for c in range(8):  # 32 positions 128h + 32s + l: 2 bits at shift 2s of byte 32h + l
        h, s = c // 4, c % 4
        sa, sb = w[o + 2 * c], w[o + 2 * c + 1]  # sub-blocks 2c, 2c + 1 of 16
        dla, mla = dd * F32(sa & np.uint8(15)), dmin * F32(sa >> np.uint8(4))
        dlb, mlb = dd * F32(sb & np.uint8(15)), dmin * F32(sb >> np.uint8(4))
        sh = np.uint8(2 * s)
        for l in range(32):
            q = F32(np.uint8(np.uint8(w[o + 16 + 32 * h + l] >> sh) & np.uint8(3)))
            d[do + 32 * c + l] = (dla if l < 16 else dlb) * q - (mla if l < 16 else mlb)


@njit(inline="always")
def _q3_scale(w, o, k):
    """Q3_K's 6-bit scale of sub-block ``k`` (of 16): 4 low bits, then 2 high ones, as gguf packs them."""
    lo = (np.int32(w[o + 96 + k % 8]) >> (4 * (k // 8))) & 15
    return lo | (((np.int32(w[o + 104 + k % 4]) >> (2 * (k // 4))) & 3) << 4)


@njit(inline="always")
def _dec_q3_k(w, o, d, do):
    dd = _half(w, o + 108, _F16)
    for c in range(8):  # 32 positions 128h + 32s + l: 2 bits of byte 32h + l, hmask bit c of byte l
        h, s = c // 4, c % 4
        dla, dlb = dd * F32(_q3_scale(w, o, 2 * c) - 32), dd * F32(_q3_scale(w, o, 2 * c + 1) - 32)
        sh, hc = np.uint8(2 * s), np.uint8(c)
        for l in range(32):
            q = F32(np.uint8(np.uint8(w[o + 32 + 32 * h + l] >> sh) & np.uint8(3)))
            m = np.uint8(np.uint8(w[o + l] >> hc) & np.uint8(1))
            d[do + 32 * c + l] = (dla if l < 16 else dlb) * (q - F32(np.uint8(4) - np.uint8(m << np.uint8(2))))


@njit(inline="always")
def _k4_scale_min(w, o, j):
    """Q4_K/Q5_K's 6-bit scale and minimum of sub-block ``j`` (gguf's ``get_scale_min``)."""
    if j < 4:
        return np.int32(w[o + 4 + j]) & 63, np.int32(w[o + 8 + j]) & 63
    c = np.int32(w[o + 8 + j])
    return (c & 15) | ((np.int32(w[o + j]) >> 2) & 48), (c >> 4) | ((np.int32(w[o + 4 + j]) >> 2) & 48)


@njit(nogil=True)
def _dec_q4_k(w, o, d, do):
    dd = _half(w, o, _F16)
    dmin = _half(w, o + 2, _F16)
    for k in range(8):  # positions 64i + 32s + l, k = 2i + s
        sc, m = _k4_scale_min(w, o, k)
        dl = dd * F32(sc)
        ml = dmin * F32(m)
        i, s = k // 2, k % 2
        for l in range(32):
            q = (w[o + 16 + 32 * i + l] >> np.uint8(4 * s)) & np.uint8(15)
            d[do + 32 * k + l] = dl * F32(q) - ml


@njit(nogil=True)
def _dec_q5_k(w, o, d, do):
    dd = _half(w, o, _F16)
    dmin = _half(w, o + 2, _F16)
    for k in range(8):
        sc, m = _k4_scale_min(w, o, k)
        dl = dd * F32(sc)
        ml = dmin * F32(m)
        i, s = k // 2, k % 2
        for l in range(32):
            q = (np.int32(w[o + 48 + 32 * i + l]) >> (4 * s)) & 15
            q |= ((np.int32(w[o + 16 + l]) >> k) & 1) << 4
            d[do + 32 * k + l] = dl * F32(q) - ml


@njit(nogil=True)
def _dec_q6_k(w, o, d, do):
    dd = _half(w, o + 208, _F16)
    for k in range(16):  # positions 128h + 32s + l (l < 32), k = p // 16
        dl = dd * F32(np.int8(w[o + 192 + k]))
        h, s, l0 = k // 8, (k % 8) // 2, 16 * (k % 2)
        for l in range(l0, l0 + 16):
            ql = (np.int32(w[o + 64 * h + 32 * (s % 2) + l]) >> (4 * (s // 2))) & 15
            qh = (np.int32(w[o + 128 + 32 * h + l]) >> (2 * s)) & 3
            d[do + 128 * h + 32 * s + l] = dl * F32((ql | (qh << 4)) - 32)


@njit(inline="always")
def _dec_iq4_nl(w, o, d, do):
    dd = _half(w, o, _F16)
    for l in range(16):
        q = w[o + 2 + l]
        d[do + l] = dd * _KVALUES[np.int64(q & np.uint8(15))]
        d[do + 16 + l] = dd * _KVALUES[np.int64(q >> np.uint8(4))]


@njit(inline="always")
def _dec_iq4_xs(w, o, d, do):
    dd = _half(w, o, _F16)
    sh = _u16(w, o + 2)
    for k in range(8):
        lo = (np.int32(w[o + 4 + k // 2]) >> (4 * (k % 2))) & 15
        hi = np.int32(sh >> np.uint32(2 * k)) & 3
        dl = dd * F32((lo | (hi << 4)) - 32)
        for l in range(16):
            q = w[o + 8 + 16 * k + l]
            d[do + 32 * k + l] = dl * _KVALUES[np.int64(q & np.uint8(15))]
            d[do + 32 * k + 16 + l] = dl * _KVALUES[np.int64(q >> np.uint8(4))]


@njit(inline="always")
def _dec_iq2_xxs(w, o, d, do):
    dd = _half(w, o, _F16)
    for ib in range(8):  # 32 weights: 4 grid bytes, then 4 × 7 sign bits and a 4-bit scale
        aux = _u32(w, o + 6 + 8 * ib)
        db = dd * (F32(0.5) + F32(aux >> np.uint32(28))) * F32(0.25)
        for g in range(4):
            row = np.int64(w[o + 2 + 8 * ib + g])
            signs = np.int64((aux >> np.uint32(7 * g)) & np.uint32(127))
            for e in range(8):
                d[do + 32 * ib + 8 * g + e] = db * _IQ2XXS[row, e] * _KSIGN8[signs, e]


@njit(inline="always")
def _dec_iq2_xs(w, o, d, do):
    dd = _half(w, o, _F16)
    for i in range(16):  # 16 weights: two 9-bit grid indices with 7 sign bits each
        s = (np.int32(w[o + 66 + i // 2]) >> (4 * (i % 2))) & 15
        db = dd * (F32(0.5) + F32(s)) * F32(0.25)
        for half in range(2):
            u = _u16(w, o + 2 + 2 * (2 * i + half))
            row = np.int64(u & np.uint32(511))
            signs = np.int64(u >> np.uint32(9))
            for e in range(8):
                d[do + 16 * i + 8 * half + e] = db * _IQ2XS[row, e] * _KSIGN8[signs, e]


@njit(inline="always")
def _dec_iq2_s(w, o, d, do):
    dd = _half(w, o, _F16)
    for i in range(16):
        s = (np.int32(w[o + 74 + i // 2]) >> (4 * (i % 2))) & 15
        db = dd * (F32(0.5) + F32(s)) * F32(0.25)
        for half in range(2):
            e8 = 2 * i + half  # group of 8: 8 grid-index bits, 2 more in qh, a sign byte
            row = np.int64(w[o + 2 + e8]) | (((np.int64(w[o + 66 + e8 // 4]) >> (2 * (e8 % 4))) & 3) << 8)
            signs = np.int64(w[o + 34 + e8])
            for e in range(8):
                d[do + 8 * e8 + e] = db * _IQ2S[row, e] * _SIGN8[signs, e]


@njit(inline="always")
def _dec_iq3_xxs(w, o, d, do):
    dd = _half(w, o, _F16)
    for ib in range(8):
        aux = _u32(w, o + 66 + 4 * ib)
        db = dd * (F32(0.5) + F32(aux >> np.uint32(28))) * F32(0.5)
        for g in range(4):
            signs = np.int64((aux >> np.uint32(7 * g)) & np.uint32(127))
            ra, rb = np.int64(w[o + 2 + 8 * ib + 2 * g]), np.int64(w[o + 3 + 8 * ib + 2 * g])  # 4 weights each
            for e in range(4):
                d[do + 32 * ib + 8 * g + e] = db * _IQ3XXS[ra, e] * _KSIGN8[signs, e]
                d[do + 32 * ib + 8 * g + 4 + e] = db * _IQ3XXS[rb, e] * _KSIGN8[signs, 4 + e]


@njit(inline="always")
def _dec_iq3_s(w, o, d, do):
    dd = _half(w, o, _F16)
    for ib in range(8):
        s = (np.int32(w[o + 106 + ib // 2]) >> (4 * (ib % 2))) & 15
        db = dd * F32(1 + 2 * s)
        for g in range(4):
            signs = np.int64(w[o + 74 + 4 * ib + g])
            qa = 8 * ib + 2 * g  # grid indices qa, qa + 1 (4 weights each): a byte and a bit of qh
            hb = np.int64(w[o + 66 + ib])
            ra = np.int64(w[o + 2 + qa]) | (((hb >> (2 * g)) & 1) << 8)
            rb = np.int64(w[o + 3 + qa]) | (((hb >> (2 * g + 1)) & 1) << 8)
            for e in range(4):
                d[do + 32 * ib + 8 * g + e] = db * _IQ3S[ra, e] * _SIGN8[signs, e]
                d[do + 32 * ib + 8 * g + 4 + e] = db * _IQ3S[rb, e] * _SIGN8[signs, 4 + e]


@njit(inline="always")
def _dec_iq1_s(w, o, d, do):
    dd = _half(w, o, _F16)
    for ib in range(8):
        h = np.int64(_u16(w, o + 34 + 2 * ib))
        dl = dd * F32(2 * ((h >> 12) & 7) + 1)
        delta = -_DELTA if h & 0x8000 else _DELTA
        for g in range(4):
            row = np.int64(w[o + 2 + 4 * ib + g]) | (((h >> (3 * g)) & 7) << 8)
            for e in range(8):
                d[do + 32 * ib + 8 * g + e] = dl * (_IQ1[row, e] + delta)


@njit(inline="always")
def _dec_iq1_m(w, o, d, do):
    s0, s1 = np.int64(_u16(w, o + 48)), np.int64(_u16(w, o + 50))
    s2, s3 = np.int64(_u16(w, o + 52)), np.int64(_u16(w, o + 54))
    bits = ((s0 & 0xF000) >> 12) | ((s1 & 0xF000) >> 8) | ((s2 & 0xF000) >> 4) | (s3 & 0xF000)
    dd = _F16[bits]  # the half scale is spread over the top nibbles of the four scale words
    for g in range(32):  # groups of 8: a grid byte, a nibble of qh (3 index bits, the delta's sign)
        k = g // 2  # sub-block of 16: 3-bit scale k % 4 of scale word k // 4
        sc = (np.int64(_u16(w, o + 48 + 2 * (k // 4))) >> (3 * (k % 4))) & 7
        dl = dd * F32(2 * sc + 1)
        nib = (np.int64(w[o + 32 + g // 2]) >> (4 * (g % 2))) & 15
        row = np.int64(w[o + g]) | ((nib & 7) << 8)
        delta = -_DELTA if nib & 8 else _DELTA
        for e in range(8):
            d[do + 8 * g + e] = dl * (_IQ1[row, e] + delta)


# ---- the decode tile's blocks in vector code (a row at a time) ---------------------------------------
# Per block and weight row the sub-block scales are made 16 at a time and the weights 16 or 8 at
# a time in registers, by gguf's float32 operations as the decoders above perform them, then
# applied as the scalar tile applies them: weight k of the block into lane k % 32 by fused
# multiply-add, k ascending (the same bits). Two forms:
# - lanes: 16 weights in lane order, bytes widened to 32-bit lanes; on any CPU (LLVM compiles
#   the vectors for it), but IQ4_NL's 16-value lookup only where x86 has ``pshufb``;
# - words (Q2_K, where the CPU has AVX2): a vector's 8 lanes take the 32-bit words of a run of
#   32 packed bytes, lane i bytes 4i .. 4i + 3, so that one shift brings weight 4i + j of the run
#   into the low bits of lane i, and ``vpermilps`` reads its value from a table of the 4 values
#   of its sub-block. The lane sums are held in that order (sums[8j + i]: lane 4i + j), against
#   the activations in that order (:func:`_by_words`), and put back in lane order to be reduced.
class _Block:
    """What a vector block's code is written over: weight row n's bytes and halves, the
    activations, and per row the 32 lane sums as vectors of ``width`` lanes."""

    def __init__(self, context, builder, sig, args, width: int):
        self.b, self.vt = builder, ir.VectorType(ir.FloatType(), width)
        self.pw = [builder.gep(p, [args[2]]) for p in _tuple_data(context, builder, sig.args[1], args[1])]
        self.px = [builder.gep(p, [args[4]]) for p in _tuple_data(context, builder, sig.args[3], args[3])]
        self.table = context.make_array(sig.args[5])(context, builder, args[5]).data
        vp = ir.PointerType(self.vt)
        self.sums = [[builder.bitcast(builder.gep(p, [_I64(width * k)]), vp) for k in range(32 // width)]
                     for p in _tuple_data(context, builder, sig.args[0], args[0])]  # weight row n, then act. row t
        self.acc = [[builder.load(p, align=4) for p in row] for row in self.sums]
        self.fma = self.fn(f"llvm.fma.v{width}f32", self.vt, self.vt, self.vt, self.vt)

    def fn(self, name, ret, *params):
        return cgutils.get_or_insert_function(self.b.module, ir.FunctionType(ret, params), name)

    def row(self, n, off, ty):
        return _load(self.b, self.pw[n], _I64(off), ty, 1)

    def half(self, n, off):
        bits = self.row(n, off, ir.IntType(16))
        return self.b.load(self.b.gep(self.table, [self.b.zext(bits, _I64)]))

    def x(self, off):
        """Each activation row's ``width`` values at ``off`` (a list, one vector a row)."""
        return [_load(self.b, p, _I64(off), self.vt, 4) for p in self.px]

    def apply(self, n, k, wv, xv):
        """Weights ``wv`` of row n into lane group k of that row's sums with each activation row's ``xv``."""
        tt = len(self.px)
        for t, x in enumerate(xv):
            acc = self.acc[n * tt + t]
            acc[k] = self.b.call(self.fma, [wv, x, acc[k]])

    def store(self):
        for ptrs, accs in zip(self.sums, self.acc):
            for p, v in zip(ptrs, accs):
                self.b.store(v, p, align=4)


def _vblock(emit, width: int):
    """An intrinsic ``block(s, w, o, x, xo, f16)``: the block at byte ``o`` of each weight row of
    the tuple ``w`` (uint8 rows), decoded once, applied to each activation row of the tuple ``x``
    (float32 rows, columns ``xo:xo + block``) into that pair's 32 float32 lane sums (the tuple
    ``s`` of :func:`qkernels._stack` arrays, weight row-major), halves read through ``f16``
    (every half's float32 value); ``emit(e, rows)`` writes it over a :class:`_Block`."""
    @intrinsic
    def block(typingctx, s, w, o, x, xo, f16):
        if len(s.types) != len(w.types) * len(x.types):
            return None
        sig = types.none(s, w, o, x, xo, f16)

        def codegen(context, builder, sig, args):
            e = _Block(context, builder, sig, args, width)
            emit(e, len(e.pw))
            e.store()
            return context.get_dummy_value()
        return sig, codegen
    return block


def _bytes(v):
    return ir.Constant(_BYTES16, [v] * 16)


def _ints(vs):
    return ir.Constant(_I16, vs if isinstance(vs, list) else [vs] * 16)


def _q2_scales(e, n):
    """Q2_K row n's 16 sub-block ``d·(sc & 15)`` and ``dmin·(sc >> 4)`` (float32 [16] vectors)."""
    b, sc = e.b, e.row(n, 0, _BYTES16)
    d, dmin = _splat(b, e.half(n, 80)), _splat(b, e.half(n, 82))
    return (b.fmul(d, b.sitofp(b.zext(b.and_(sc, _bytes(15)), _I16), _V16)),
            b.fmul(dmin, b.sitofp(b.zext(b.lshr(sc, _bytes(4)), _I16), _V16)))


def _vq2_k(e, nr):
    """Q2_K, lanes: weight ``(d·(sc & 15))·q − dmin·(sc >> 4)`` of its sub-block (two roundings)."""
    b = e.b
    scales = [_q2_scales(e, n) for n in range(nr)]
    qs = [[e.row(n, 16 + 16 * i, _BYTES16) for i in range(4)] for n in range(nr)]  # bytes 32h + 16g
    for c in range(8):  # positions 32c + 16g + l: 2 bits at shift 2s of byte 32h + 16g + l
        h, s = divmod(c, 4)
        for g in range(2):
            xv = e.x(32 * c + 16 * g)
            for n, (dl, ml) in enumerate(scales):
                q = b.sitofp(b.zext(b.and_(b.lshr(qs[n][2 * h + g], _bytes(2 * s)), _bytes(3)), _I16), _V16)
                k = _I32(2 * c + g)
                wv = b.fsub(b.fmul(_splat(b, b.extract_element(dl, k)), q), _splat(b, b.extract_element(ml, k)))
                e.apply(n, g, wv, xv)


def _wq2_k(e, nr):
    """Q2_K, words: each run's table ``(d·(sc & 15))·q − dmin·(sc >> 4)`` for q < 4, sub-block
    2c in lanes 0-3 and 2c + 1 in lanes 4-7 (``vpermilps`` reads each 128-bit half's own 4)."""
    b = e.b
    perm = e.fn("llvm.x86.avx.vpermilvar.ps.256", _V8F, _V8F, _I8V)
    iota = ir.Constant(_V8F, [0.0, 1.0, 2.0, 3.0] * 2)
    pairs = [ir.Constant(_I8V, [2 * c] * 4 + [2 * c + 1] * 4) for c in range(8)]
    for n in range(nr):
        dl, ml = _q2_scales(e, n)
        tables = [b.fsub(b.fmul(b.shuffle_vector(dl, dl, p), iota), b.shuffle_vector(ml, ml, p)) for p in pairs]
        qw = [e.row(n, 16 + 32 * h, _I8V) for h in range(2)]
        for c in range(8):  # 2 bits at shift 2s of byte 32h + l, l = 4i + j
            h, s = divmod(c, 4)
            for j in range(4):
                idx = b.lshr(qw[h], ir.Constant(_I8V, [8 * j + 2 * s] * 8))
                e.apply(n, j, b.call(perm, [tables[c], idx]), e.x(32 * c + 8 * j))


def _vq3_k(e, nr):
    """Q3_K, lanes: weight ``(d·(sc − 32))·q`` of its sub-block, q the 2 bits less 4 where the
    hmask bit is clear."""
    b, i8 = e.b, ir.IntType(8)
    dl, qs, hm = [], [], []
    for n in range(nr):
        lo8 = e.row(n, 96, ir.VectorType(i8, 8))  # not 16 bytes: the block ends at 110
        hi4 = e.row(n, 104, ir.VectorType(i8, 4))
        lo = b.zext(b.shuffle_vector(lo8, lo8, _ints(list(range(8)) * 2)), _I16)
        hi = b.zext(b.shuffle_vector(hi4, hi4, _ints(list(range(4)) * 4)), _I16)
        lo = b.and_(b.lshr(lo, _ints([0] * 8 + [4] * 8)), _ints(15))
        hi = b.shl(b.and_(b.lshr(hi, _ints([0] * 4 + [2] * 4 + [4] * 4 + [6] * 4)), _ints(3)), _ints(4))
        dl.append(b.fmul(_splat(b, e.half(n, 108)), b.sitofp(b.sub(b.or_(lo, hi), _ints(32)), _V16)))
        qs.append([e.row(n, 32 + 16 * i, _BYTES16) for i in range(4)])
        hm.append([e.row(n, 16 * g, _BYTES16) for g in range(2)])
    for c in range(8):  # positions 32c + 16g + l: 2 bits of byte 32h + 16g + l, hmask bit c of byte 16g + l
        h, s = divmod(c, 4)
        for g in range(2):
            xv = e.x(32 * c + 16 * g)
            for n in range(nr):
                q = b.and_(b.lshr(qs[n][2 * h + g], _bytes(2 * s)), _bytes(3))
                m = b.shl(b.and_(b.lshr(hm[n][g], _bytes(c)), _bytes(1)), _bytes(2))
                q = b.sitofp(b.sext(b.sub(b.or_(q, m), _bytes(4)), _I16), _V16)
                e.apply(n, g, b.fmul(_splat(b, b.extract_element(dl[n], _I32(2 * c + g))), q), xv)


def _viq4_nl(e, nr):
    """IQ4_NL, lanes: weight ``d·kvalues[q]``, the 16 values looked up as bytes (``pshufb``)."""
    b = e.b
    shuf = e.fn("llvm.x86.ssse3.pshuf.b.128", _BYTES16, _BYTES16, _BYTES16)
    kv = ir.Constant(_BYTES16, [v & 255 for v in gq.IQ4_NL.kvalues])
    xs = [e.x(16 * g) for g in range(2)]
    for n in range(nr):
        d, qs = _splat(b, e.half(n, 0)), e.row(n, 2, _BYTES16)
        for g, q in enumerate((b.and_(qs, _bytes(15)), b.lshr(qs, _bytes(4)))):
            e.apply(n, g, b.fmul(d, b.sitofp(b.sext(b.call(shuf, [kv, q]), _I16), _V16)), xs[g])


# Per form, the types that have it (module comment above), and the blocks.
_FORM_TYPES = {"words": (QT.Q2_K,) if _target_has("avx2") else (),
               "lanes": (QT.Q2_K, QT.Q3_K, *((QT.IQ4_NL,) if _target_has("ssse3") else ()))}
_vblocks = {("words", QT.Q2_K): _vblock(_wq2_k, 8), ("lanes", QT.Q2_K): _vblock(_vq2_k, 16),
            ("lanes", QT.Q3_K): _vblock(_vq3_k, 16), ("lanes", QT.IQ4_NL): _vblock(_viq4_nl, 16)}


def _form(qtype: QT) -> str:
    """The decode-tile form ``qtype`` takes here: words, else lanes, else scalar."""
    return next((f for f in FORMS[:2] if qtype in _FORM_TYPES[f]), "scalar")


# type → its decoder's name; block sizes from gguf.
DECODERS = {QT.Q2_K: "_dec_q2_k", QT.Q3_K: "_dec_q3_k", QT.Q4_K: "_dec_q4_k", QT.Q5_K: "_dec_q5_k",
            QT.Q6_K: "_dec_q6_k", QT.IQ4_NL: "_dec_iq4_nl", QT.IQ4_XS: "_dec_iq4_xs", QT.IQ2_XXS: "_dec_iq2_xxs",
            QT.IQ2_XS: "_dec_iq2_xs", QT.IQ2_S: "_dec_iq2_s", QT.IQ3_XXS: "_dec_iq3_xxs", QT.IQ3_S: "_dec_iq3_s",
            QT.IQ1_S: "_dec_iq1_s", QT.IQ1_M: "_dec_iq1_m"}
# Types whose products these kernels compute (Q4_K, Q5_K, Q6_K have block kernels of their own).
PRODUCTS = tuple(q for q in DECODERS if q not in (QT.Q4_K, QT.Q5_K, QT.Q6_K))


def _tile_source(qtype: QT, nr: int, tt: int) -> str:
    block, size = GGML_QUANT_SIZES[qtype]
    rows, acts = range(nr), range(tt)
    lines = [f"def tile_{qtype.name}_{nr}x{tt}(w, r0, hi, x, t0, out, ahead, end):"]
    lines += [f"    w{n} = w[min(r0 + {n}, hi - 1)]" for n in rows]  # a short tile repeats its last row
    lines += [f"    x{t} = x[t0 + {t}]" for t in acts]
    lines += [f"    s{n}_{t} = carray(_stack(32), 32)" for n in rows for t in acts]
    lines += [f"    d{n} = carray(_stack({block}), {block})" for n in rows]
    lines += ["    for j in range(32):"] + [f"        s{n}_{t}[j] = F32(0.0)" for n in rows for t in acts]
    lines += [f"    for b in range(x0.shape[0] // {block}):", f"        o = b * {size}", f"        xo = b * {block}"]
    lines += [f"        _prefetch_ahead(w, ahead + {nr} * o + {p}, end)" for p in range(0, nr * size, 64)]
    lines += [f"        {DECODERS[qtype]}(w{n}, o, d{n}, 0)" for n in rows]
    lines += [f"        for c in range({block // 32}):", "            for j in range(32):"]
    lines += [f"                xv{t} = x{t}[xo + 32 * c + j]" for t in acts]
    lines += [f"                wv{n} = d{n}[32 * c + j]" for n in rows]
    lines += [f"                s{n}_{t}[j] = _fma(wv{n}, xv{t}, s{n}_{t}[j])" for n in rows for t in acts]
    for n in rows:
        lines.append(f"    if r0 + {n} < hi:")
        lines += [f"        out[t0 + {t}, r0 + {n}] = _sum32(s{n}_{t})" for t in acts]
    return "\n".join(lines)


def _vtile_source(qtype: QT, nr: int, form: str, tt: int = 1) -> str:
    """The decode tile (``nr`` weight rows × ``tt`` activation rows) over a vector block of
    ``form`` (``_block``, each block decoded once for the ``tt`` rows; words: ``x`` in word order)."""
    block, size = GGML_QUANT_SIZES[qtype]
    rows, acts = range(nr), range(tt)
    pairs = [(n, t) for n in rows for t in acts]
    sums, ws = "".join(f"s{n}_{t}, " for n, t in pairs), "".join(f"w{n}, " for n in rows)
    xs = "".join(f"x{t}, " for t in acts)
    lines = [f"def tile_{qtype.name}_{nr}x{tt}(w, r0, hi, x, t0, out, ahead, end):"]
    lines += [f"    w{n} = w[min(r0 + {n}, hi - 1)]" for n in rows]
    lines += [f"    x{t} = x[t0 + {t}]" for t in acts] + ["    r = carray(_stack(32), 32)"]
    lines += [f"    s{n}_{t} = carray(_stack(32), 32)" for n, t in pairs]
    lines += [f"    _zero32(s{n}_{t})" for n, t in pairs]
    lines += [f"    for b in range(x0.shape[0] // {block}):", f"        o = b * {size}"]
    lines += [f"        _prefetch_ahead(w, ahead + {nr} * o + {p}, end)" for p in range(0, nr * size, 64)]
    lines += [f"        _block(({sums}), ({ws}), o, ({xs}), b * {block}, _F16)"]
    for n, t in pairs:
        if form == "words":  # the sums back in lane order
            lines += ["    for j in range(4):", "        for i in range(8):",
                      f"            r[4 * i + j] = s{n}_{t}[8 * j + i]"]
        lines += [f"    if r0 + {n} < hi:",
                  f"        out[t0 + {t}, r0 + {n}] = _sum32({'r' if form == 'words' else f's{n}_{t}'})"]
    return "\n".join(lines)


@njit(nogil=True)
def _by_words(x):
    """float32 x [T, K] (K a multiple of 32) in word order: x[t, 32c + 4i + j] at x[t, 32c + 8j + i]."""
    xw = np.empty_like(x)
    for t in range(x.shape[0]):
        for c in range(x.shape[1] // 32):
            for j in range(4):
                for i in range(8):
                    xw[t, 32 * c + 8 * j + i] = x[t, 32 * c + 4 * i + j]
    return xw


def _rows_kernel(qtype: QT, tile: tuple[int, int] | None = None, form: str = "", fused_rows: int = -1):
    """Columns lo:hi of out [T, R] = x @ W[lo:hi].T for ``qtype``: runs of ``_DECODED_ROWS``
    weight rows decoded whole, then qkernels' float32 tiles over every activation row (each
    weight decoded once per call); for the types of :data:`_FUSED`, at T ≤ :data:`_FUSED_ROWS`'s
    (the scalar form :data:`_SCALAR_FUSED_ROWS`; ``fused_rows``: another limit, for benchmarks),
    tiles of :data:`_DECODE_TILES` (weight rows, activation rows: at T = 1, and above; the scalar
    form :data:`_SCALAR_DECODE_TILES`) applying each block as it is decoded to the tile's
    activation rows, T split into ⌈T / tt⌉ runs as even as can be (5 rows: 3 + 2), each run a tile
    of its rows (``tile``: one other shape, activation rows 1 .. :data:`_MAX_ACTS`, its weight
    rows by one at T = 1, bench/tile_tables.py's), in ``form`` (:data:`FORMS`; default
    :func:`_form`'s). All apply each weight with the float32 kernel's operations in its order:
    the same bits."""
    if tile is not None and (len(tile) != 2 or tile[0] < 1 or not 1 <= tile[1] <= _MAX_ACTS):
        raise ValueError(f"a low-bit decode tile is (weight rows ≥ 1, activation rows 1-{_MAX_ACTS}), got {tile!r}")
    if form and (form not in FORMS or (form != "scalar" and qtype not in _FORM_TYPES[form])):
        raise ValueError(f"{qtype.name} has no decode tile of form {form!r} here (of {FORMS})")
    block, size = GGML_QUANT_SIZES[qtype]
    decode = globals()[DECODERS[qtype]]

    def decoded(w, x, out, lo, hi):
        K = x.shape[1]
        buf = np.empty((_DECODED_ROWS, K), F32)
        for r0 in range(lo, hi, _DECODED_ROWS):
            n = min(hi - r0, _DECODED_ROWS)
            for r in range(n):
                for b in range(K // block):
                    decode(w[r0 + r], b * size, buf[r], b * block)
            _rows_f32(buf, x, out, r0, 0, n)

    if qtype not in _FUSED:
        return _named(decoded, f"matmul_rows_{qtype.name}")
    whole = _named(decoded, f"matmul_decoded_{qtype.name}")
    form = form or _form(qtype)
    (nr1, _), (nr, tt) = (tile, tile) if tile else _SCALAR_DECODE_TILES if form == "scalar" else _DECODE_TILES
    scope = {**globals(), "min": min, "_block": _vblocks.get((form, qtype))}

    def compiled(rows: int, acts: int):
        source = _tile_source(qtype, rows, acts) if form == "scalar" else _vtile_source(qtype, rows, form, acts)
        exec(compile(source, f"<{__name__} {qtype.name} tile {rows}x{acts} {form}>", "exec"), scope)
        return njit(nogil=True, inline="always")(scope[f"tile_{qtype.name}_{rows}x{acts}"])

    tiles = [compiled(nr, k) for k in range(1, tt + 1)]  # tt activation rows, and fewer for a last run
    one, two, three, four = (tiles[min(k, tt) - 1] for k in range(1, 5))
    single = tiles[0] if nr1 == nr else compiled(nr1, 1)  # a step of one row
    most = fused_rows if fused_rows >= 0 else _SCALAR_FUSED_ROWS if form == "scalar" else _FUSED_ROWS[qtype]

    def rows(w, x, out, lo, hi):
        T = x.shape[0]
        if T > most:
            whole(w, x, out, lo, hi)
            return
        stride = w.strides[0]
        end = w.shape[0] * stride
        xs = _by_words(x) if form == "words" else x
        if T == 1:
            for r0 in range(lo, hi, nr1):
                single(w, r0, hi, xs, 0, out, r0 * stride + _PREFETCH_BYTES, end)
            return
        runs = (T + tt - 1) // tt  # tiles a weight tile takes, their rows as even as can be (5: 3 + 2)
        for r0 in range(lo, hi, nr):  # the tile's weight rows stay in cache for every activation row
            ahead = r0 * stride + _PREFETCH_BYTES
            t = 0
            for i in range(runs):
                left = T // runs + (1 if i < T % runs else 0)
                if left >= 4:
                    four(w, r0, hi, xs, t, out, ahead, end)
                elif left == 3:
                    three(w, r0, hi, xs, t, out, ahead, end)
                elif left == 2:
                    two(w, r0, hi, xs, t, out, ahead, end)
                else:
                    one(w, r0, hi, xs, t, out, ahead, end)
                t += left
    return _named(rows, f"matmul_rows_{qtype.name}")


def _named(fn, name: str):
    """``fn`` compiled under a name of its own: numba names a compiled function by module and
    qualified name (plus a per-process counter), so two types' kernels compiled in different
    processes and loaded from the cache into one would otherwise link to one another's code."""
    fn.__name__ = fn.__qualname__ = name
    return njit(nogil=True)(fn)


def _decode_kernel(qtype: QT):
    """Rows lo:hi of uint8 w [R, row_bytes] decoded into float32 out [hi - lo, K]."""
    block, size = GGML_QUANT_SIZES[qtype]
    decode = globals()[DECODERS[qtype]]

    def rows(w, out, lo, hi):
        for r in range(lo, hi):
            for b in range(out.shape[1] // block):
                decode(w[r], b * size, out[r - lo], b * block)
    return _named(rows, f"decode_rows_{qtype.name}")


_mm = {q: _rows_kernel(q) for q in PRODUCTS}
_dq = {q: _decode_kernel(q) for q in DECODERS}
(_mm_q2_k, _mm_q3_k, _mm_iq4_nl, _mm_iq4_xs, _mm_iq2_xxs, _mm_iq2_xs, _mm_iq2_s, _mm_iq3_xxs, _mm_iq3_s,
 _mm_iq1_s, _mm_iq1_m) = (_mm[q] for q in PRODUCTS)
(_dq_q2_k, _dq_q3_k, _dq_q4_k, _dq_q5_k, _dq_q6_k, _dq_iq4_nl, _dq_iq4_xs, _dq_iq2_xxs, _dq_iq2_xs, _dq_iq2_s,
 _dq_iq3_xxs, _dq_iq3_s, _dq_iq1_s, _dq_iq1_m) = (_dq[q] for q in DECODERS)


# One cached entry point per type (numba caches functions of a source file, not closures):
# op 0 multiplies, op 1 decodes (module docstring). One signature each: w read-only uint8
# [R, row_bytes], x and out writable float32 [·, ·] C-contiguous.
@njit(cache=True, nogil=True)
def q2_k(op, w, x, out, lo, hi):
    _mm_q2_k(w, x, out, lo, hi) if op == 0 else _dq_q2_k(w, out, lo, hi)


@njit(cache=True, nogil=True)
def q3_k(op, w, x, out, lo, hi):
    _mm_q3_k(w, x, out, lo, hi) if op == 0 else _dq_q3_k(w, out, lo, hi)


@njit(cache=True, nogil=True)
def q4_k(op, w, x, out, lo, hi):
    if op != 1:
        raise ValueError("Q4_K products are qkernels.matmul's")
    _dq_q4_k(w, out, lo, hi)


@njit(cache=True, nogil=True)
def q5_k(op, w, x, out, lo, hi):
    if op != 1:
        raise ValueError("Q5_K products are qkernels.matmul's")
    _dq_q5_k(w, out, lo, hi)


@njit(cache=True, nogil=True)
def q6_k(op, w, x, out, lo, hi):
    if op != 1:
        raise ValueError("Q6_K products are qkernels.matmul's")
    _dq_q6_k(w, out, lo, hi)


@njit(cache=True, nogil=True)
def iq4_nl(op, w, x, out, lo, hi):
    _mm_iq4_nl(w, x, out, lo, hi) if op == 0 else _dq_iq4_nl(w, out, lo, hi)


@njit(cache=True, nogil=True)
def iq4_xs(op, w, x, out, lo, hi):
    _mm_iq4_xs(w, x, out, lo, hi) if op == 0 else _dq_iq4_xs(w, out, lo, hi)


@njit(cache=True, nogil=True)
def iq2_xxs(op, w, x, out, lo, hi):
    _mm_iq2_xxs(w, x, out, lo, hi) if op == 0 else _dq_iq2_xxs(w, out, lo, hi)


@njit(cache=True, nogil=True)
def iq2_xs(op, w, x, out, lo, hi):
    _mm_iq2_xs(w, x, out, lo, hi) if op == 0 else _dq_iq2_xs(w, out, lo, hi)


@njit(cache=True, nogil=True)
def iq2_s(op, w, x, out, lo, hi):
    _mm_iq2_s(w, x, out, lo, hi) if op == 0 else _dq_iq2_s(w, out, lo, hi)


@njit(cache=True, nogil=True)
def iq3_xxs(op, w, x, out, lo, hi):
    _mm_iq3_xxs(w, x, out, lo, hi) if op == 0 else _dq_iq3_xxs(w, out, lo, hi)


@njit(cache=True, nogil=True)
def iq3_s(op, w, x, out, lo, hi):
    _mm_iq3_s(w, x, out, lo, hi) if op == 0 else _dq_iq3_s(w, out, lo, hi)


@njit(cache=True, nogil=True)
def iq1_s(op, w, x, out, lo, hi):
    _mm_iq1_s(w, x, out, lo, hi) if op == 0 else _dq_iq1_s(w, out, lo, hi)


@njit(cache=True, nogil=True)
def iq1_m(op, w, x, out, lo, hi):
    _mm_iq1_m(w, x, out, lo, hi) if op == 0 else _dq_iq1_m(w, out, lo, hi)


def kernel(qtype: QT):
    """The entry point of ``qtype`` (a key of :data:`DECODERS`); KeyError for any other."""
    return globals()[DECODERS[qtype].removeprefix("_dec_")]
