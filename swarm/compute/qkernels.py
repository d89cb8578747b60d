"""Compiled (numba) block kernels for :mod:`swarm.compute.quant`; import through ``quant._kernels``.

Kinds: 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q5_0, 4 Q5_1 (blocks of 32 weights), 5 Q4_K, 6 Q5_K, 7 Q6_K
(super-blocks of 256), 8 MXFP4 (blocks of 32: an E8M0 scale byte, then 16 bytes of 4-bit E2M1
codes, low nibbles the first 16 weights) — block layouts as ggml defines them (``d``, ``m``,
``dmin`` are IEEE halves read through a 65536-entry table; MXFP4's scale and codes through
tables of ``gguf.quants.MXFP4``'s values). :func:`dequant` takes kinds 0–4 and 8.
The K-quant tiles take vector code (:data:`K_FORM`, :func:`_k_block`): each weight decoded
in registers to the float32 value of the portable form (on AVX-512, Q4_K by ``vpermps`` from a
16-entry table of its sub-block's ``fma(d·sc, q, -dmin·m)``; elsewhere by that fma itself, as
LLVM compiles it for the CPU: AVX2, NEON), then the same operations in the same order. Under the numerics ``int8``
(swarm/compute/numerics.py), Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K take 8-bit activation rows instead (the int8
section below: exact integer sums, then float32 in one fixed order). :func:`run_group` computes a group of
products tile by tile on every thread that runs it (swarm/compute/quant.py's ``matmul_many``).
Each kernel runs on one thread over a range of output rows and releases the GIL: the caller
spreads ranges over the process's compute threads (swarm/compute/threads.py), and other Python
threads — the event loop, a loopback peer — run meanwhile. Each
output element is computed by one fixed sequence of float32 operations (the tile template
below), so its bits do not depend on T, on which rows a call holds, or on the thread count.
"""

from __future__ import annotations

import os
import platform

import numpy as np
from llvmlite import binding, ir
from numba import carray, njit, types
from numba.core import cgutils, codegen, config
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array

F32 = np.float32


def _target_has(feature: str) -> bool:
    """Whether numba compiles the kernels for a CPU with ``feature`` (LLVM's name: "avx2",
    "avx512f"), read as numba reads it: NUMBA_CPU_FEATURES where set ("+avx2,+fma"); else none
    where NUMBA_CPU_NAME names another CPU (a portable cache); else the host's, less every AVX
    feature where numba leaves AVX off (NUMBA_ENABLE_AVX=0, or a CPU LLVM names nocona, sandybridge
    or ivybridge: VMs that misreport theirs)."""
    if config.CPU_FEATURES is not None:
        features = config.CPU_FEATURES
    elif config.CPU_NAME:
        return False
    else:
        features = codegen.get_host_cpu_features()  # "" where LLVM cannot tell
    return f"+{feature}" in features.split(",")


# Whether the kernels are compiled for a CPU with AVX-512F: the K-quant tiles use it.
AVX512 = _target_has("avx512f")
# The forms of the float32 K-quant tiles, the same bits: AVX-512 vector code; the same vector
# code without its one AVX-512 instruction, which LLVM compiles for the CPU at hand (AVX2, NEON);
# scalar loops.
K_FORMS = ("avx512", "vector", "portable")
K_FORM = "avx512" if AVX512 else "vector"

# Every IEEE half bit pattern's float32 value: how block scales are read.
_F16 = np.arange(65536, dtype=np.uint16).view(np.float16).astype(F32)
# MXFP4: every E8M0 scale byte's float32 value (half the power of two, as ggml's
# ``ggml_e8m0_to_fp32_half``: the codes below are doubled) and the 16 E2M1 codes, doubled.
_E8M0 = np.where(np.arange(256) < 2, np.uint32(0x00200000) << np.arange(256).astype(np.uint32),
                 (np.arange(256).astype(np.uint32) - np.uint32(1)) << np.uint32(23)).astype(np.uint32).view(F32)
_MXV = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], F32)


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
def _e2m1(c):
    """MXFP4's E2M1 code ``c`` (0..15, uint32) doubled, as float32 (``_MXV[c]``, exactly): the
    magnitudes 0 1 2 3 4 6 8 12 read as nibbles of one constant, the sign from bit 3 — shifts
    and a multiply that vectorise, where a table lookup does not."""
    mag = np.uint8((np.uint32(0xC8643210) >> ((c & np.uint32(7)) << np.uint32(2))) & np.uint32(15))
    return F32(mag) * (F32(1.0) - F32(np.uint8(c >> np.uint32(2)) & np.uint8(2)))


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
        # read, into L2 and the levels below (prefetcht1: lines fetched 8 KiB ahead would crowd
        # L1 out of the lines being read: in-cache Q8_0 ran ~10 % slower), data cache
        builder.call(fn, [builder.gep(builder.bitcast(data, i8p), [args[1]]), i32(0), i32(2), i32(1)])
        return context.get_dummy_value()
    return types.none(w, types.intp), codegen


@njit(inline="always")
def _prefetch_ahead(w, offset, end):
    if offset < end:
        _prefetch(w, offset)


# How far ahead of the rows being read the next bytes are prefetched: the hardware
# prefetcher alone leaves a GEMV over a matrix that is not in cache at ~1/3 of memory speed.
# 8 KiB, not 4: one core then reads Q8_0 from memory at ~33 GB/s rather than 19, the K-quants
# at their in-cache rate (bench/results/engine.md); 16 KiB gained a little more on one core,
# but reaches further into the next tile, which another thread may be reading.
_PREFETCH_BYTES = 8192


@intrinsic
def _fma(typingctx, a, b, c):
    """``a·b + c`` in float32 with one rounding (``llvm.fma``; a vector FMA once vectorised).
    Written out, not left to the compiler's contraction, so that every kernel variant performs
    exactly the same operations on each element."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, sig, args):
        f = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f, [f, f, f]), "llvm.fma.f32")
        return builder.call(fn, args)
    return sig, codegen


def _lane_sum(n: int, halves: bool = False):
    """An intrinsic: Σ of the ``n`` (a power of two) float32 lane sums in a :func:`_stack` array
    in one fixed pairwise order, written as vector halvings (n/2 + n/4 + … + 1 lanes) so that it
    stays a few vector instructions without letting the compiler reassociate. ``halves``: the
    array read as two vectors of n/2 lanes (the first halving), as the K-quant AVX-512 tiles
    write it, so that the compiler keeps the lanes in registers across the tile's loop."""
    @intrinsic
    def lane_sum(typingctx, lanes):
        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            f, i32 = ir.FloatType(), ir.IntType(32)
            k = n
            if halves:
                vp = ir.PointerType(ir.VectorType(f, n // 2))
                lo, hi = (builder.load(builder.bitcast(builder.gep(data, [i32(h * n // 2)]), vp), align=4) for h in range(2))
                v, k = builder.fadd(lo, hi), n // 2
            else:
                v = builder.load(builder.bitcast(data, ir.PointerType(ir.VectorType(f, n))), align=4)
            while k > 1:
                k //= 2
                lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, k), list(range(k))))
                hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, k), list(range(k, 2 * k))))
                v = builder.fadd(lo, hi)
            return builder.extract_element(v, i32(0))
        return types.float32(lanes), codegen
    return lane_sum


_sum16, _sum32, _sum32h = _lane_sum(16), _lane_sum(32), _lane_sum(32, halves=True)


@intrinsic
def _zero32(typingctx, lanes):
    """Zero the 32 float32 lane sums of a :func:`_stack` array, as two 16-lane vectors."""
    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        vp = ir.PointerType(ir.VectorType(ir.FloatType(), 16))
        for h in range(2):
            half = builder.bitcast(builder.gep(data, [ir.IntType(32)(16 * h)]), vp)
            builder.store(ir.Constant(vp.pointee, [0.0] * 16), half, align=4)
        return context.get_dummy_value()
    return types.none(lanes), codegen


_V8 = ir.VectorType(ir.FloatType(), 8)


def _fma8(builder):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8, [_V8] * 3), "llvm.fma.v8f32")


@intrinsic
def _vsum8(typingctx, a, ao, nb):
    """Σ_i a[ao + i] over i < 8·nb (float32 array, C order): element i added into lane i % 8,
    ascending i, the lanes then added in :func:`_lane_sum`'s order, as vector instructions."""
    sig = types.float32(a, ao, nb)

    def codegen(context, builder, sig, args):
        pa = builder.gep(context.make_array(sig.args[0])(context, builder, args[0]).data, [args[1]])
        vp, i32 = ir.PointerType(_V8), ir.IntType(32)
        acc = cgutils.alloca_once_value(builder, ir.Constant(_V8, [0.0] * 8))
        with cgutils.for_range(builder, args[2]) as loop:
            off = builder.mul(loop.index, ir.Constant(loop.index.type, 8))
            va = builder.load(builder.bitcast(builder.gep(pa, [off]), vp), align=4)
            builder.store(builder.fadd(builder.load(acc), va), acc)
        v, k = builder.load(acc), 8
        while k > 1:
            k //= 2
            lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, k), list(range(k))))
            hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, k), list(range(k, 2 * k))))
            v = builder.fadd(lo, hi)
        return builder.extract_element(v, i32(0))
    return sig, codegen


# The dot kernels are generated from one template per block type and tile shape. A tile is NR
# weight rows × TT activation rows: each block of the NR rows is decoded once and applied to
# the TT activation rows, each (weight row, activation row) pair keeping its lane sums in
# registers. Two forms, by block type:
# - scaled (Q8_0, Q4_0, Q5_0: w = d·q): 16 lanes; lane j of a block takes
#   p = fma(q[j+16], x[j+16], q[j]·x[j]) (q as float32, the offset of Q4_0/Q5_0 subtracted
#   exactly) and accumulates fma(d, p, lane): the scale is applied once per pair of weights.
# - affine (Q4_1, Q5_1: w = d·q + m): 32 lanes; each weight is decoded to fma(d, q, m) and
#   lane j accumulates fma(w, x, lane).
# Then the lanes are reduced in one fixed order. Every tile shape performs, per output element,
# that same sequence over the blocks in order, and there are no fast-math flags (the compiler
# may not reorder or fuse anything else): an output's bits do not depend on the tile it fell in
# — on T, on which rows a call holds, on the thread count.
#
# Per block type: bytes per block, form, the per-row scales at block offset ``o``, and the pair
# of values (positions j and j + 16) that a byte-loop step decodes, as source over ``{n}``.
_TYPES = {
    0: (34, "scaled", "d{n} = _half(w{n}, o, _F16)",
        "lo{n} = F32(np.int8(w{n}[o + 2 + j])); hi{n} = F32(np.int8(w{n}[o + 18 + j]))"),
    1: (18, "scaled", "d{n} = _half(w{n}, o, _F16)",
        "q{n} = w{n}[o + 2 + j]; lo{n} = _lo(q{n}) - F32(8.0); hi{n} = _hi(q{n}) - F32(8.0)"),
    2: (20, "affine", "d{n} = _half(w{n}, o, _F16); m{n} = _half(w{n}, o + 2, _F16)",
        "q{n} = w{n}[o + 4 + j]; lo{n} = _fma(d{n}, _lo(q{n}), m{n}); hi{n} = _fma(d{n}, _hi(q{n}), m{n})"),
    3: (22, "scaled", "d{n} = _half(w{n}, o, _F16); h{n} = _u32(w{n}, o + 2)",
        "a{n}, b{n} = _f5(w{n}[o + 6 + j], h{n}, j); lo{n} = a{n} - F32(16.0); hi{n} = b{n} - F32(16.0)"),
    4: (24, "affine", "d{n} = _half(w{n}, o, _F16); m{n} = _half(w{n}, o + 2, _F16); h{n} = _u32(w{n}, o + 4)",
        "a{n}, b{n} = _f5(w{n}[o + 8 + j], h{n}, j); lo{n} = _fma(d{n}, a{n}, m{n}); hi{n} = _fma(d{n}, b{n}, m{n})"),
    8: (17, "scaled", "d{n} = _E8M0[np.int64(w{n}[o])]",
        "q{n} = np.uint32(w{n}[o + 1 + j]); lo{n} = _e2m1(q{n} & np.uint32(15)); hi{n} = _e2m1(q{n} >> np.uint32(4))"),
}
# Tile shapes (NR weight rows × TT activation rows), chosen by measurement (AVX-512 machine):
# decode takes 4 rows a pass (x loads shared by 4 rows); several activation rows take 2 × 4,
# then 2 × 3 for a last 3 (one pass over the weights: as 2 + 1, a step of 3 sequences cost
# more than one of 4), else 2 × 2 and 2 × 1 for the last T % 4 (:func:`_rows_kernel`). A tile's
# shape changes no operation on an element: the same bits in any table.
_TILES = ((4, 1), (2, 4), (2, 2), (2, 1))
# The float32 K-quant tiles keep 8 sums of 32 lanes in a 2 × 4 tile: where the CPU has no
# AVX-512 (AVX2's 16 registers of 256 bits; NEON's 32 of 128 hold as much) they spill, and one
# weight row a tile was 0.5-0.95x the time at T = 4-64 on a Zen 3 core; decode's 4 × 1 keeps 4
# such sums, and 1 × 1 took 0.63-0.80x its time for Q4_K there, 0.83-0.96x for Q6_K
# (bench/tile_tables.py, two runs each).
_K_TILES_NO_AVX512 = ((1, 1), (1, 4), (1, 2), (1, 1))
_K_TILES = _TILES if AVX512 else _K_TILES_NO_AVX512
# Without AVX-512 the float32-weight kernels (F32, F16, BF16) and the float32 blocks of 32 with
# 4- and 5-bit values (Q4_0, Q4_1, Q5_0, Q5_1) decode 2 rows a pass: 2 × 1 took 0.57-0.67x the
# 4 × 1's time for F16 on that core, 0.77-0.89x for Q4_1 and Q5_1, and never lost for Q4_0 and
# Q5_0 (0.86-0.99x); Q8_0 (1.04-1.05x) and MXFP4 (not timed) keep 4 × 1.
_D2_TILES_NO_AVX512 = ((2, 1), *_TILES[1:])
_D2_TILES = _TILES if AVX512 else _D2_TILES_NO_AVX512
_D2_KINDS = (1, 2, 3, 4)  # Q4_0, Q4_1, Q5_0, Q5_1: the blocks of 32 that take _D2_TILES


def _tile_source(kind: int, nr: int, tt: int) -> str:
    size, form, scales, pair = _TYPES[kind]
    rows, acts = range(nr), range(tt)
    lines = [f"def tile(w, r0, hi, x, t0, out, ahead, end):"]
    lines += [f"    w{n} = w[min(r0 + {n}, hi - 1)]" for n in rows]  # a short tile repeats its last row
    lines += [f"    x{t} = x[t0 + {t}]" for t in acts]
    lanes = 16 if form == "scaled" else 32
    lines += [f"    s{n}_{t} = carray(_stack({lanes}), {lanes})" for n in rows for t in acts]
    lines += [f"    for j in range({lanes}):"] + [f"        s{n}_{t}[j] = F32(0.0)" for n in rows for t in acts]
    lines += ["    for b in range(x0.shape[0] // 32):", f"        o = b * {size}"]
    # a step reads nr·size bytes: one prefetch per 64-byte line of them, or some lines are missed
    lines += [f"        _prefetch_ahead(w, ahead + {nr} * o + {p}, end)" for p in range(0, nr * size, 64)]
    lines += ["        " + scales.format(n=n) for n in rows]
    lines += ["        for j in range(16):"]
    lines += [f"            xl{t} = x{t}[b * 32 + j]; xh{t} = x{t}[b * 32 + 16 + j]" for t in acts]
    for n in rows:
        lines.append("            " + pair.format(n=n))
        for t in acts:
            if form == "scaled":
                lines.append(f"            s{n}_{t}[j] = _fma(d{n}, _fma(hi{n}, xh{t}, lo{n} * xl{t}), s{n}_{t}[j])")
            else:
                lines.append(f"            s{n}_{t}[j] = _fma(lo{n}, xl{t}, s{n}_{t}[j])")
                lines.append(f"            s{n}_{t}[16 + j] = _fma(hi{n}, xh{t}, s{n}_{t}[16 + j])")
    for n in rows:
        lines.append(f"    if r0 + {n} < hi:")
        lines += [f"        out[t0 + {t}, r0 + {n}] = _sum{lanes}(s{n}_{t})" for t in acts]
    return "\n".join(lines)


def _compile_tile(kind: int, nr: int, tt: int, kform: str = ""):
    scope = dict(np=np, F32=F32, carray=carray, min=min, _stack=_stack, _half=_half, _u32=_u32,
                 _f5=_f5, _lo=_lo, _hi=_hi, _F16=_F16, _fma=_fma, _sum16=_sum16, _sum32=_sum32,
                 _sum32h=_sum32h, _zero32=_zero32,
                 _prefetch_ahead=_prefetch_ahead, _k4_scales=_k4_scales, _k6_scales=_k6_scales,
                 _k5=_k5, _k6=_k6, _E8M0=_E8M0, _e2m1=_e2m1,
                 **{f"_k_scales{k}": f for k, (f, _) in _k_blocks.items()},
                 **{f"_k_block{k}": f for k, (_, f) in _k_blocks.items()},
                 **{f"_k_vblock{k}": f for k, f in _k_vector_blocks.items()})
    source = _k_tile_source(kind, nr, tt, kform or K_FORM) if kind in _K_TYPES else _tile_source(kind, nr, tt)
    exec(compile(source, f"<{__name__} tile {kind} {nr}x{tt}>", "exec"), scope)
    return njit(nogil=True, inline="always")(scope["tile"])  # a call per tile cost ~8 % at T = 16


# K-quants (super-blocks of 256 weights: ``gguf.quants``' Q4_K, Q5_K, Q6_K, after ggml's
# ``block_q4_K`` etc.): the "decoded" form. Per super-block and weight row, the sub-block scales
# (and, Q4_K/Q5_K, minimums) are decoded once to float32 — Q4_K/Q5_K: s = d·sc, n = -(dmin·m);
# Q6_K: s = d·sc — and each weight to float32, w = fma(s, q, n) (Q4_K/Q5_K) or s·(q - 32)
# (Q6_K), which is then applied to the tile's activation rows: lane j (of 32) accumulates
# fma(w, x, lane) for the super-block's positions ≡ j (mod 32) in a fixed order (Q4_K/Q5_K: per
# 64-weight chunk, j then j + 32; Q6_K: per 128-weight half, j, j + 32, j + 64, j + 96),
# super-blocks in order; the lanes are reduced as above. Per output element the same operations
# whatever the tile.
#
# Per kind: bytes per super-block, the scale decoding, and the loop over one super-block (source
# over ``{n}`` weight rows and ``{t}`` activation rows; ``o`` the super-block's byte offset,
# ``xo`` its first column).
_K_TYPES = {
    5: (144, "_k4_scales(w{n}, o, sc{n}, mn{n})", "q4"),
    6: (176, "_k4_scales(w{n}, o, sc{n}, mn{n})", "q5"),
    7: (210, "_k6_scales(w{n}, o, sc{n})", "q6"),
}


@njit(inline="always")
def _k4_scales(w, o, sc, mn):
    """Q4_K/Q5_K super-block at byte ``o``: the 8 sub-block scales ``d·sc_j`` into ``sc`` and the
    negated minimums ``-(dmin·m_j)`` into ``mn`` (6-bit sc, m packed in 12 bytes as ggml does)."""
    d = _half(w, o, _F16)
    dmin = _half(w, o + 2, _F16)
    for j in range(4):
        a = np.int32(w[o + 4 + j])
        b = np.int32(w[o + 8 + j])
        c = np.int32(w[o + 12 + j])
        sc[j] = d * F32(a & 63)
        mn[j] = -(dmin * F32(b & 63))
        sc[j + 4] = d * F32((c & 15) | ((a >> 6) << 4))
        mn[j + 4] = -(dmin * F32((c >> 4) | ((b >> 6) << 4)))


@njit(inline="always")
def _k6_scales(w, o, sc):
    """Q6_K super-block at byte ``o``: the 16 sub-block scales ``d·sc_k`` (int8 sc) into ``sc``."""
    d = _half(w, o + 208, _F16)
    for k in range(16):
        sc[k] = d * F32(np.int8(w[o + 192 + k]))


@njit(inline="always")
def _k5(q, h):
    """Q5_K: the two 5-bit values of nibble byte ``q`` with high bits ``h & 1`` (low nibble) and
    ``h & 2`` (high nibble), as float32 through uint8 (byte-wide vector lanes)."""
    u1 = np.uint8(1)
    a = np.uint8(q & np.uint8(15)) | np.uint8(np.uint8(h & u1) << np.uint8(4))
    b = np.uint8(q >> np.uint8(4)) | np.uint8(np.uint8(np.uint8(h >> u1) & u1) << np.uint8(4))
    return F32(np.uint8(a)), F32(np.uint8(b))


@njit(inline="always")
def _k6(ql, qh, shift):
    """Q6_K: the 6-bit value of nibble ``ql`` (already 0..15) and bits ``shift, shift+1`` of
    ``qh``, minus 32, as float32 (exact)."""
    v = np.uint8(ql) | np.uint8(np.uint8(np.uint8(qh >> np.uint8(shift)) & np.uint8(3)) << np.uint8(4))
    return F32(np.uint8(v)) - F32(32.0)


# The K-quant tiles in vector code (AVX-512's, or any CPU's: K_FORM): the same float32 values and
# operations, per output element and in the same order, as the portable form above. A tile
# first unpacks the sub-block scales of up to _GROUP super-blocks of its rows into a small
# stack buffer (:func:`_k_scales`), then runs their weights (:func:`_k_block`): each weight
# decoded 16 at a time in registers and applied to every activation row of the tile. Reading
# the scales back from memory lets each be broadcast by the load itself (``{1to16}``), where
# broadcasting a register's lane costs two shuffles, and shuffles are what the decode spends.
_I32, _I64 = ir.IntType(32), ir.IntType(64)
_V16, _I16 = ir.VectorType(ir.FloatType(), 16), ir.VectorType(_I32, 16)
_V8F, _I8V = ir.VectorType(ir.FloatType(), 8), ir.VectorType(_I32, 8)
_BYTES16 = ir.VectorType(ir.IntType(8), 16)
_GROUP = 8  # super-blocks whose scales a tile unpacks ahead of their weights


def _splat(builder, v, ty=_V16, n=16):
    e = builder.insert_element(ir.Constant(ty, ir.Undefined), v, _I32(0))
    return builder.shuffle_vector(e, e, ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _concat(builder, lo, hi):
    """Vectors ``lo`` and ``hi`` (one type) as one of twice their lanes, ``lo``'s first."""
    n = 2 * lo.type.count
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, n), list(range(n))))


def _load(builder, p, off, ty, align):
    return builder.load(builder.bitcast(builder.gep(p, [off]), ir.PointerType(ty)), align=align)


def _k_scales(form: str, ints: bool = False):
    """An intrinsic ``scales(buf, k, w, o, f16)``: the sub-block scales of the K-quant ``form``
    ("q4" Q4_K, "q5" Q5_K, "q6" Q6_K) super-block at byte ``o`` of weight row ``w`` (uint8),
    as float32 into ``buf[16k : 16k + 16]`` (float32): Q4_K, Q5_K ``d·sc_j`` for j < 8, then
    ``-(dmin·m_j)`` (6-bit sc, m packed in 12 bytes as ggml does); Q6_K ``d·sc_j`` for j < 16
    (int8 sc). ``d``, ``dmin`` are read through ``f16``, every half's float32 value.

    ``ints``: ``scales(isc, fsc, w, o, f16)`` for the int8 products (Q4_K, Q6_K): the sub-block
    scales as integers into ``isc`` (int32: Q4_K 8, Q6_K 16), d into ``fsc[0]`` and Q4_K's
    ``-(dmin·m_j)`` into ``fsc[8:16]``."""
    @intrinsic
    def scales(typingctx, buf, k, w, o, f16):
        sig = types.none(buf, k, w, o, f16)

        def codegen(context, builder, sig, args):
            def data(i):
                return context.make_array(sig.args[i])(context, builder, args[i]).data
            pb = data(1) if ints else builder.gep(data(0), [builder.mul(args[1], _I64(16))])
            pw, table = builder.gep(data(2), [args[3]]), data(4)

            def half(off):
                bits = _load(builder, pw, _I64(off), ir.IntType(16), 1)
                return builder.load(builder.gep(table, [builder.zext(bits, _I64)]))
            if ints:
                builder.store(half(208 if form == "q6" else 0), pb)
            if form == "q6" and ints:
                sc = builder.sext(_load(builder, pw, _I64(192), _BYTES16, 1), _I16)
                builder.store(sc, builder.bitcast(data(0), ir.PointerType(_I16)), align=4)
                return context.get_dummy_value()
            if form == "q6":
                raw = _load(builder, pw, _I64(192), _BYTES16, 1)
                sc = builder.fmul(_splat(builder, half(208)), builder.sitofp(builder.sext(raw, _I16), _V16))
                builder.store(sc, builder.bitcast(pb, ir.PointerType(_V16)), align=4)
                return context.get_dummy_value()

            def c8(v):
                return ir.Constant(_I8V, [v] * 8)
            head = _load(builder, pw, _I64(0), _BYTES16, 1)

            def pick(first):  # bytes first .. first + 3, twice, as 32-bit lanes
                lanes = ir.Constant(_I8V, list(range(first, first + 4)) * 2)
                return builder.zext(builder.shuffle_vector(head, head, lanes), _I8V)
            a, b, c = pick(4), pick(8), pick(12)
            sc_lo = builder.and_(a, c8(63))
            sc_hi = builder.or_(builder.and_(c, c8(15)), builder.shl(builder.lshr(a, c8(6)), c8(4)))
            mn_lo = builder.and_(b, c8(63))
            mn_hi = builder.or_(builder.lshr(c, c8(4)), builder.shl(builder.lshr(b, c8(6)), c8(4)))
            halves = ir.Constant(_I8V, [0, 1, 2, 3, 12, 13, 14, 15])  # j < 4 from *_lo, j ≥ 4 from *_hi
            d, dmin = _splat(builder, half(0), _V8F, 8), _splat(builder, half(2), _V8F, 8)
            sc_int = builder.shuffle_vector(sc_lo, sc_hi, halves)
            sc = builder.fmul(d, builder.sitofp(sc_int, _V8F))
            mn = builder.fneg(builder.fmul(dmin, builder.sitofp(builder.shuffle_vector(mn_lo, mn_hi, halves), _V8F)))
            if ints:
                builder.store(sc_int, builder.bitcast(data(0), ir.PointerType(_I8V)), align=4)
                builder.store(mn, builder.bitcast(builder.gep(pb, [_I64(8)]), ir.PointerType(_V8F)), align=4)
                return context.get_dummy_value()
            for i, v in enumerate((sc, mn)):
                builder.store(v, builder.bitcast(builder.gep(pb, [_I64(8 * i)]), ir.PointerType(_V8F)), align=4)
            return context.get_dummy_value()
        return sig, codegen
    return scales


def _tuple_data(context, builder, ty, value):
    """The data pointers of the arrays in the tuple ``value`` of numba type ``ty``."""
    return [context.make_array(t)(context, builder, v).data
            for t, v in zip(ty.types, cgutils.unpack_tuple(builder, value, len(ty.types)))]


def _k_block(form: str, permute: bool = True):
    """An intrinsic ``block(s, w, scales, k, o, x, xo)``: one super-block (byte ``o``, columns
    ``xo:xo + 256``) of the K-quant ``form`` for a tile of NR weight rows ``w`` (a tuple of
    uint8 rows) by TT activation rows ``x`` (a tuple of float32 rows), into the NR·TT 32-lane
    float32 sums ``s`` (a tuple, row-major: weight row, then activation row). ``scales``: per
    weight row a buffer that :func:`_k_scales` filled, this super-block's at slot ``k``. Per
    lane the operations and order of the portable tile:

    - Q4_K: each weight ``fma(d·sc, q, -(dmin·m))`` read by ``vpermps`` from a 16-entry table of
      its sub-block's values (one fused multiply-add per possible q, so the same bits); with
      ``permute`` False (any CPU but AVX-512's) computed as Q5_K's, the same value;
    - Q5_K: the same value ``fma(d·sc, q, -(dmin·m))``, q converted from 32-bit integers;
    - Q6_K: each weight ``(d·sc)·(q - 32)``, q - 32 converted from 32-bit integers (exact).
    """
    @intrinsic
    def block(typingctx, s, w, scales, k, o, x, xo):
        nr, tt = len(w.types), len(x.types)
        if len(s.types) != nr * tt or len(scales.types) != nr:
            return None
        sig = types.none(s, w, scales, k, o, x, xo)

        def codegen(context, builder, sig, args):
            def datas(i):
                return _tuple_data(context, builder, sig.args[i], args[i])
            o, xo = args[4], args[6]
            pw = [builder.gep(p, [o]) for p in datas(1)]
            px = [builder.gep(p, [xo]) for p in datas(5)]
            pscale = [builder.gep(p, [builder.mul(args[3], _I64(16))]) for p in datas(2)]
            ps = datas(0)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16, [_V16] * 3),
                                                 "llvm.fma.v16f32")

            def scale(n, j):  # weight row n's scale j, in all 16 lanes
                return _splat(builder, builder.load(builder.gep(pscale[n], [_I64(j)])))

            def ints(v):
                return ir.Constant(_I16, [v] * 16)

            def load_x(t, c):  # x[t][xo + c : xo + c + 16]
                return _load(builder, px[t], _I64(c), _V16, 4)

            def load_bytes(n, c):  # w[n][o + c : o + c + 16], zero-extended to 32 bits
                return builder.zext(_load(builder, pw[n], _I64(c), _BYTES16, 1), _I16)

            # lane sums: acc[n][t][h] holds lanes 16h .. 16h + 15 of s[n·tt + t]
            vp = ir.PointerType(_V16)
            sums = [[[builder.bitcast(builder.gep(ps[n * tt + t], [_I64(16 * h)]), vp) for h in range(2)]
                     for t in range(tt)] for n in range(nr)]
            acc = [[[builder.load(p, align=4) for p in row] for row in rows] for rows in sums]

            def apply(n, h, wv, xs):  # lanes 16h.. of every activation row of weight row n
                for t in range(tt):
                    acc[n][t][h] = builder.call(fma, [wv, xs[t], acc[n][t][h]])

            if form == "q6":
                _q6_block(builder, nr, tt, scale, load_x, lambda n, c, ty: _load(builder, pw[n], _I64(c), ty, 1), apply)
            else:
                _q45_block(builder, form, nr, tt, fma, scale, ints, load_x, load_bytes, apply, permute)
            for n in range(nr):
                for t in range(tt):
                    for h in range(2):
                        builder.store(acc[n][t][h], sums[n][t][h], align=4)
            return context.get_dummy_value()
        return sig, codegen
    return block


def _q45_block(builder, form, nr, tt, fma, scale, ints, load_x, load_bytes, apply, permute):
    """Q4_K / Q5_K codegen for :func:`_k_block`: per 64-weight chunk i, lane l takes
    ``fma(w_lo, x[64i + l], ·)`` then ``fma(w_hi, x[64i + 32 + l], ·)``. (Emitted low
    nibbles first, then high, for few live registers; each lane's order is the same.)"""
    perm = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16, [_V16, _I16]),
                                          "llvm.x86.avx512.permvar.sf.512") if permute and form == "q4" else None
    iota = ir.Constant(_V16, [float(k) for k in range(16)])
    first = 16 if form == "q4" else 48  # the nibbles
    # Q5_K: the high bits of lanes 16h.. in bytes o + 16 + 16h (bit j: sub-block j's weights)
    high = [[load_bytes(n, 16 + 16 * h) for h in range(2)] for n in range(nr)] if form == "q5" else None
    for i in range(4):
        q = [[load_bytes(n, first + 32 * i + 16 * h) for h in range(2)] for n in range(nr)]
        for part in range(2):  # low nibbles (sub-block 2i), then high (2i + 1)
            j = 2 * i + part
            # Q4_K: per row, sub-block j's table: fma(d·sc, q, -(dmin·m)) for q < 16
            tables = [builder.call(fma, [scale(n, j), iota, scale(n, 8 + j)]) for n in range(nr)] if form == "q4" and permute else None
            for h in range(2):
                xs = [load_x(t, 64 * i + 32 * part + 16 * h) for t in range(tt)]
                for n in range(nr):
                    nib = builder.lshr(q[n][h], ints(4)) if part else q[n][h]
                    if form == "q4" and permute:  # vpermps reads the low 4 bits of each index
                        wv = builder.call(perm, [tables[n], nib])
                    elif form == "q4":
                        wv = builder.call(fma, [scale(n, j), builder.sitofp(builder.and_(nib, ints(15)), _V16), scale(n, 8 + j)])
                    else:  # fma(d·sc, q, -(dmin·m)) on q converted from 32-bit integers (exact)
                        hb = builder.and_(builder.lshr(high[n][h], ints(j)), ints(1))
                        q5 = builder.or_(builder.and_(nib, ints(15)), builder.shl(hb, ints(4)))
                        wv = builder.call(fma, [scale(n, j), builder.sitofp(q5, _V16), scale(n, 8 + j)])
                    apply(n, h, wv, xs)


_BYTES64 = ir.VectorType(ir.IntType(8), 64)


def _q6_block(builder, nr, tt, scale, load_x, load_raw, apply):
    """Q6_K codegen for :func:`_k_block`: per 128-weight half h, lane j = 16p + l takes the
    positions j, j + 32, j + 64, j + 96 in that order. The 6-bit values minus 32 are first made
    for the whole super-block in byte lanes (both halves at once: 64 bytes a vector), each
    position's ``q - 32`` the int8 it is, then widened 16 at a time: the same 32-bit integers,
    so the same products, with a quarter of the integer work of widening first."""
    def b8(v):
        return ir.Constant(_BYTES64, [v] * 64)
    half = [list(range(32)) + list(range(64, 96)), list(range(32, 64)) + list(range(96, 128))]
    values = []  # per weight row: q - 32 of positions 32k + j (bytes 32h + j: half h), k = 0..3
    for n in range(nr):
        lo, hi, qh = (load_raw(n, c, _BYTES64) for c in (0, 64, 128))
        u, v = (builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 64), m)) for m in half)
        high = (builder.and_(builder.shl(qh, b8(4)), b8(48)), builder.and_(builder.shl(qh, b8(2)), b8(48)),
                builder.and_(qh, b8(48)), builder.and_(builder.lshr(qh, b8(2)), b8(48)))
        nibs = (builder.and_(u, b8(15)), builder.and_(v, b8(15)), builder.lshr(u, b8(4)), builder.lshr(v, b8(4)))
        values.append([builder.sub(builder.or_(a, b), b8(32)) for a, b in zip(nibs, high)])
    for h in range(2):
        for p in range(2):
            picks = ir.Constant(ir.VectorType(_I32, 16), list(range(32 * h + 16 * p, 32 * h + 16 * p + 16)))
            for k in range(4):
                xs = [load_x(t, 128 * h + 16 * p + 32 * k) for t in range(tt)]
                for n in range(nr):
                    q = builder.sext(builder.shuffle_vector(values[n][k], values[n][k], picks), _I16)
                    wv = builder.fmul(scale(n, 8 * h + p + 2 * k), builder.sitofp(q, _V16))
                    apply(n, p, wv, xs)


_k_blocks = {kind: (_k_scales(form), _k_block(form)) for kind, form in ((5, "q4"), (6, "q5"), (7, "q6"))}
# The vector form's blocks: no AVX-512 instruction (Q4_K's weights by fma, not a vpermps table).
_k_vector_blocks = {5: _k_block("q4", permute=False), 6: _k_blocks[6][1], 7: _k_blocks[7][1]}
# The int8 products' scale decoding: Q4_K's and Q6_K's sub-block scales as integers.
_i8_scales5, _i8_scales6, _i8_scales7 = _k_scales("q4", ints=True), _k_scales("q5", ints=True), _k_scales("q6", ints=True)


def _k_tile_source(kind: int, nr: int, tt: int, kform: str) -> str:
    size, scales, form = _K_TYPES[kind]
    rows, acts = range(nr), range(tt)
    lines = ["def tile(w, r0, hi, x, t0, out, ahead, end):"]
    lines += [f"    w{n} = w[min(r0 + {n}, hi - 1)]" for n in rows]
    lines += [f"    x{t} = x[t0 + {t}]" for t in acts]
    lines += [f"    s{n}_{t} = carray(_stack(32), 32)" for n in rows for t in acts]
    if kform != "portable":  # the same operations in vector code: AVX-512's, or any CPU's
        lines += [f"    _zero32(s{n}_{t})" for n in rows for t in acts]
        lines += [f"    sc{n} = carray(_stack({16 * _GROUP}), {16 * _GROUP})" for n in rows]
        lines += ["    nb = x0.shape[0] // 256", f"    for b0 in range(0, nb, {_GROUP}):",
                  f"        for b in range(b0, min(nb, b0 + {_GROUP})):"]
        lines += [f"            _k_scales{kind}(sc{n}, b - b0, w{n}, b * {size}, _F16)" for n in rows]
        lines += [f"        for b in range(b0, min(nb, b0 + {_GROUP})):", f"            o = b * {size}",
                  "            xo = b * 256"]
        lines += [f"            _prefetch_ahead(w, ahead + {nr} * o + {p}, end)" for p in range(0, nr * size, 64)]
        args = [", ".join(f"s{n}_{t}" for n in rows for t in acts), ", ".join(f"w{n}" for n in rows),
                ", ".join(f"sc{n}" for n in rows), ", ".join(f"x{t}" for t in acts)]
        block = "_k_block" if kform == "avx512" else "_k_vblock"
        lines += [f"            {block}{kind}(({args[0]},), ({args[1]},), ({args[2]},), b - b0, o, ({args[3]},), xo)"]
        for n in rows:
            lines.append(f"    if r0 + {n} < hi:")
            lines += [f"        out[t0 + {t}, r0 + {n}] = _sum32h(s{n}_{t})" for t in acts]
        return "\n".join(lines)
    lines += ["    for j in range(32):"] + [f"        s{n}_{t}[j] = F32(0.0)" for n in rows for t in acts]
    lines += [f"    sc{n} = carray(_stack(16), 16)" for n in rows]
    lines += [f"    mn{n} = carray(_stack(16), 16)" for n in rows] if form != "q6" else []
    lines += ["    for b in range(x0.shape[0] // 256):", f"        o = b * {size}", "        xo = b * 256"]
    lines += [f"        _prefetch_ahead(w, ahead + {nr} * o + {p}, end)" for p in range(0, nr * size, 64)]
    lines += ["        " + scales.format(n=n) for n in rows]
    body = []
    if form in ("q4", "q5"):
        body += ["for i in range(4):"]
        body += [f"    a{n} = sc{n}[2 * i]; an{n} = mn{n}[2 * i]; c{n} = sc{n}[2 * i + 1]; cn{n} = mn{n}[2 * i + 1]"
                 for n in rows]
        if form == "q5":
            body += ["    sh = np.uint8(2 * i)"]
        body += ["    for l in range(32):"]
        body += [f"        xl{t} = x{t}[xo + 64 * i + l]; xh{t} = x{t}[xo + 64 * i + 32 + l]" for t in acts]
        for n in rows:
            if form == "q4":
                body.append(f"        q{n} = w{n}[o + 16 + 32 * i + l]; ql{n} = _lo(q{n}); qh{n} = _hi(q{n})")
            else:
                body.append(f"        ql{n}, qh{n} = _k5(w{n}[o + 48 + 32 * i + l], np.uint8(w{n}[o + 16 + l] >> sh))")
            body.append(f"        lo{n} = _fma(a{n}, ql{n}, an{n}); hi{n} = _fma(c{n}, qh{n}, cn{n})")
            for t in acts:
                body.append(f"        s{n}_{t}[l] = _fma(lo{n}, xl{t}, s{n}_{t}[l])")
                body.append(f"        s{n}_{t}[l] = _fma(hi{n}, xh{t}, s{n}_{t}[l])")
    else:  # Q6_K: half h of 128 weights; lane j = 16p + l takes positions j, j+32, j+64, j+96
        body += ["for h in range(2):", "    for p in range(2):"]
        body += [f"        e0{n} = sc{n}[8 * h + p]; e1{n} = sc{n}[8 * h + p + 2]; "
                 f"e2{n} = sc{n}[8 * h + p + 4]; e3{n} = sc{n}[8 * h + p + 6]" for n in rows]
        body += ["        for l in range(16):", "            j = 16 * p + l", "            c = xo + 128 * h + j"]
        body += [f"            xa{t} = x{t}[c]; xb{t} = x{t}[c + 32]; xc{t} = x{t}[c + 64]; xd{t} = x{t}[c + 96]"
                 for t in acts]
        for n in rows:
            body.append(f"            u{n} = w{n}[o + 64 * h + j]; v{n} = w{n}[o + 64 * h + 32 + j]; "
                        f"g{n} = w{n}[o + 128 + 32 * h + j]")
            body.append(f"            wa{n} = e0{n} * _k6(u{n} & np.uint8(15), g{n}, 0); "
                        f"wb{n} = e1{n} * _k6(v{n} & np.uint8(15), g{n}, 2)")
            body.append(f"            wc{n} = e2{n} * _k6(u{n} >> np.uint8(4), g{n}, 4); "
                        f"wd{n} = e3{n} * _k6(v{n} >> np.uint8(4), g{n}, 6)")
            for t in acts:
                for wv, xv in (("wa", "xa"), ("wb", "xb"), ("wc", "xc"), ("wd", "xd")):
                    body.append(f"            s{n}_{t}[j] = _fma({wv}{n}, {xv}{t}, s{n}_{t}[j])")
    lines += ["        " + line for line in body]
    for n in rows:
        lines.append(f"    if r0 + {n} < hi:")
        lines += [f"        out[t0 + {t}, r0 + {n}] = _sum32(s{n}_{t})" for t in acts]
    return "\n".join(lines)


def _rows_kernel(kind: int, kform: str = "", table=None):
    """Rows ``lo:hi`` of ``out`` for block type ``kind``, tiled as ``table`` says (default
    :data:`_TILES`; the K-quants :data:`_K_TILES`; Q4_0, Q4_1, Q5_0, Q5_1 :data:`_D2_TILES`)
    (``kform``, :data:`K_FORMS`, default
    :data:`K_FORM`: the K-quant tiles' form, the same bits)."""
    kform = kform or K_FORM
    if kform not in K_FORMS or (kform == "avx512" and not AVX512):
        raise ValueError(f"K-quant form must be one of {K_FORMS} ('avx512' where the CPU has AVX-512), got {kform!r}")
    table = table or (_K_TILES if kind in _K_TYPES else _D2_TILES if kind in _D2_KINDS else _TILES)
    return _tiled_rows([_compile_tile(kind, nr, tt, kform) for nr, tt in (*table, (table[1][0], 3))], table)


def _tiled_rows(tiles, table):
    """The rows kernel ``rows(w, x, out, lo, hi)`` over the compiled ``tiles`` of the tile
    ``table``'s shapes (:data:`_TILES`), then a last 3 activation rows' tile."""
    (n1, _), (n4, _), _, _ = table
    one, four, two, single, three = tiles  # three: a last 3 activation rows in one tile

    @njit(nogil=True)
    def rows(w, x, out, lo, hi):
        T = x.shape[0]
        stride = w.strides[0]
        end = w.shape[0] * stride
        if T == 1:
            for r0 in range(lo, hi, n1):
                one(w, r0, hi, x, 0, out, r0 * stride + _PREFETCH_BYTES, end)
            return
        for r0 in range(lo, hi, n4):
            ahead = r0 * stride + _PREFETCH_BYTES
            t0 = 0
            while t0 + 4 <= T:
                four(w, r0, hi, x, t0, out, ahead, end)
                t0 += 4
            if T - t0 == 3:
                three(w, r0, hi, x, t0, out, ahead, end)
                continue
            if t0 + 2 <= T:
                two(w, r0, hi, x, t0, out, ahead, end)
                t0 += 2
            if t0 < T:
                single(w, r0, hi, x, t0, out, ahead, end)
    return rows


_ROWS = tuple(_rows_kernel(kind) for kind in sorted({**_TYPES, **_K_TYPES}))
_rows0, _rows1, _rows2, _rows3, _rows4, _rows5, _rows6, _rows7, _rows8 = _ROWS


@njit(nogil=True)
def _rows(kind, w, x, out, lo, hi):
    if kind == 0:
        _rows0(w, x, out, lo, hi)
    elif kind == 1:
        _rows1(w, x, out, lo, hi)
    elif kind == 2:
        _rows2(w, x, out, lo, hi)
    elif kind == 3:
        _rows3(w, x, out, lo, hi)
    elif kind == 4:
        _rows4(w, x, out, lo, hi)
    elif kind == 5:
        _rows5(w, x, out, lo, hi)
    elif kind == 6:
        _rows6(w, x, out, lo, hi)
    elif kind == 7:
        _rows7(w, x, out, lo, hi)
    else:
        _rows8(w, x, out, lo, hi)


@njit(cache=True, nogil=True)
def matmul(kind, w, x, out, lo, hi):
    """out[t, r] = Σ_k W[r, k] x[t, k] for rows ``lo ≤ r < hi`` of uint8 ``w`` [R, row_bytes],
    float32 ``x`` [T, K], ``out`` float32 [T, R] (written in place). One thread; the caller
    spreads ranges of rows over threads (swarm/compute/threads.py), the same bits."""
    _rows(kind, w, x, out, lo, hi)


# ---- 8-bit activations (the numerics ``int8``: swarm/compute/numerics.py) ---------------------
# llama.cpp's numerics, opt-in: each activation row is quantized to int8 with one float32 scale
# per block of values, and a block-quantized weight row is multiplied by it in integers, exactly,
# then scaled in float32. Activation blocks (after ggml's ``block_q8_K`` and ``block_q8_0``):
# per 256 values for the K-quants (Q4_K, Q5_K, Q6_K), per 32 for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; in each, with amax = max |x|,
# d = amax / 127 and q = rint(x · (127 / amax)) (0 where amax is 0), |x - d·q| ≤ d/2 (plus
# float32 rounding). A quantized row is one uint8 row of :func:`int8_row_bytes` bytes: the K
# int8 values in order, then the float32 scales, then (types with minimums) the float32 ``d·Σq``
# of each 32 values, 64-byte aligned rows.
#
# Per output element (weight row, activation row), one fixed sequence: 16 float32 lanes, lane l
# of a super-block (blocks of 32: of a pair of blocks) takes the 16 values 64k + 4l + i (k < 4,
# i < 4; blocks of 32: 4l + i of the 64), whose products are summed exactly in int32:
# - Q4_K, Q5_K (ggml's ``vec_dot_q4_K_q8_K``, ``…q5_K…``): I_l = Σ_k sc_j · Σ_i q·q8, j the
#   sub-block of 32;
#   lane += (dx·d)·I_l by fused multiply-add, and 8 more lanes take the minimums,
#   fma(-(dmin·m_j), dx·Σq8_j, ·); the result is Σ16 + Σ8, each in :func:`_lane_sum`'s order;
# - Q6_K (``vec_dot_q6_K_q8_K``): I_l = Σ_k sc_s · Σ_i (q6 - 32)·q8, s the sub-block of 16;
#   lane += (dx·d)·I_l;
# - Q8_0, Q4_0, Q5_0 (``vec_dot_q8_0_q8_0``, ``vec_dot_q4_0_q8_0``, ``vec_dot_q5_0_q8_0``):
#   c_l = Σ_i q·q8 over the lane's 4 values (Q4_0's q less 8, Q5_0's less 16); lane +=
#   (dw·dx)·c_l, the scales of the lane's block; rows of K % 64 ≠ 0 keep the float32 kernel;
# - Q4_1, Q5_1 (``vec_dot_q4_1_q8_1``, ``…q5_1…``): the same with q as stored, and lanes 0, 1 of
#   8 more take the two blocks' minimums, fma(m, dx·Σq8, ·); the result is Σ16 + Σ8.
# Every |I_l| < 2²⁴, so its float32 conversion is exact. Four forms, the same bits: AVX-512
# (:func:`_i8_block`: blocks of 32 by VNNI ``vpdpbusd``, unsigned bytes times signed ones,
# Q8_0's signed q as (q + 128) times x less 128·Σx, Q4_0's q - 8 as q times x less 8·Σx, Q5_0's
# likewise with 16; Q4_K, Q5_K, Q6_K by ``vpmaddubsw`` and ``vpmaddwd``, Q6_K's q - 32
# as q times x less 32·x; all exact), the same products by AVX2's 256-bit ``vpmaddubsw`` and
# ``vpmaddwd`` (``vpdpbusd`` as the two of them: :func:`_avx2_products`), in plain vector
# arithmetic for any other CPU (NEON), and portable integer loops (:func:`_i8_port`).
INT8_OFFSET = 16  # the kind of a weight type's int8 product: its kind + INT8_OFFSET
INT8_KINDS = (0, 1, 2, 3, 4, 5, 6, 7)  # Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (blocks of 32), Q4_K, Q5_K, Q6_K
# Bytes of a block of 32 (the kinds quantizing activations per 32) or a super-block of 256.
_I8_SIZE = {0: 34, 1: 18, 2: 20, 3: 22, 4: 24, 5: 144, 6: 176, 7: 210}
# Whether the VNNI form is compiled; whether the AVX2 form is (x86 CPUs without VNNI: AMD before
# Zen 4, Intel Xeons before Cascade Lake, Intel's client chips but Ice Lake, Tiger Lake and Rocket Lake).
VNNI = AVX512 and _target_has("avx512vnni") and _target_has("avx512bw")
AVX2 = _target_has("avx2")
# The forms of the int8 tiles, the same bits: AVX-512 VNNI instructions; AVX2's 256-bit byte and
# word products; the same products in plain vector arithmetic, which LLVM compiles for the CPU at
# hand (NEON on ARM); scalar integer loops.
I8_FORMS = ("vnni", "avx2", "vector", "portable")
I8_FORMS_HERE = tuple(f for f in I8_FORMS if (f != "vnni" or VNNI) and (f != "avx2" or AVX2))  # what compiles here
# What this process runs: the fastest form here, or ``COLIBRI_SWARM_INT8_FORM`` (to measure one
# form against another in the engine; the numba cache is kept apart per value: quant.py).
I8_FORM = os.environ.get("COLIBRI_SWARM_INT8_FORM", "") or ("vnni" if VNNI else "avx2" if AVX2 else "vector")
if I8_FORM not in I8_FORMS_HERE:
    raise ValueError(f"COLIBRI_SWARM_INT8_FORM={I8_FORM!r}: this CPU runs the int8 forms {', '.join(I8_FORMS_HERE)}; "
                     "name one of them or leave it unset")


@njit(inline="always")
def _per32(kind):
    """Whether weight kind ``kind``'s activations are quantized per 32 values (else per 256)."""
    return kind < 5


@njit(inline="always")
def _minimums(kind):
    """Whether weight kind ``kind`` has minimums (w = d·q + m: Q4_1, Q5_1, Q4_K, Q5_K): its
    activation rows carry d·Σq per 32 values."""
    return kind == 2 or kind == 4 or kind == 5 or kind == 6


@njit(inline="always")
def int8_row_bytes(kind, K):
    """Bytes of one quantized activation row of K values for weight kind ``kind``."""
    n = K + 4 * (K // (32 if _per32(kind) else 256)) + (4 * (K // 32) if _minimums(kind) else 0)
    return (n + 63) // 64 * 64


@intrinsic
def _quantize_block(typingctx, x, lo, q, n):
    """Values ``x[lo:lo + n]`` (float32; ``n`` a constant multiple of 16) to int8 in
    ``q[lo:lo + n]`` (the row's uint8 bytes), in vector code: amax = max |x| (exact in any
    order), iscale = 127 / amax (0 where amax is 0), q = rint(x·iscale) within ±127; returns
    amax. Each value's operations are the rule's, so the bits of any correct form."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    count = n.literal_value // 16
    sig = types.float32(x, lo, q, n)

    def codegen(context, builder, sig, args):
        px = builder.gep(context.make_array(sig.args[0])(context, builder, args[0]).data, [args[1]])
        pq = builder.gep(context.make_array(sig.args[2])(context, builder, args[2]).data, [args[1]])

        def fn(name, ty, nargs):
            return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty] * nargs), name)
        fabs, maxnum = fn("llvm.fabs.v16f32", _V16, 1), fn("llvm.maxnum.v16f32", _V16, 2)
        minnum, rint = fn("llvm.minnum.v16f32", _V16, 2), fn("llvm.rint.v16f32", _V16, 1)
        vs = [_load(builder, px, _I64(16 * i), _V16, 4) for i in range(count)]
        m = builder.call(fabs, [vs[0]])
        for v in vs[1:]:
            m = builder.call(maxnum, [m, builder.call(fabs, [v])])
        f32 = ir.FloatType()
        while m.type.count > 1:  # halves, as _lane_sum; max is exact in any order
            h = m.type.count // 2
            lo_, hi_ = (builder.shuffle_vector(m, m, ir.Constant(ir.VectorType(_I32, h), list(range(a, a + h))))
                        for a in (0, h))
            m = builder.call(fn(f"llvm.maxnum.v{h}f32", ir.VectorType(f32, h), 2), [lo_, hi_])
        amax = builder.extract_element(m, _I32(0))
        iscale = builder.select(builder.fcmp_ordered(">", amax, ir.Constant(f32, 0.0)),
                                builder.fdiv(ir.Constant(f32, 127.0), amax), ir.Constant(f32, 0.0))
        scale = _splat(builder, iscale)
        top, bottom = ir.Constant(_V16, [127.0] * 16), ir.Constant(_V16, [-127.0] * 16)
        for i, v in enumerate(vs):
            r = builder.call(minnum, [builder.call(maxnum, [builder.call(rint, [builder.fmul(v, scale)]), bottom]), top])
            b = builder.trunc(builder.fptosi(r, _I16), _BYTES16)
            builder.store(b, builder.bitcast(builder.gep(pq, [_I64(16 * i)]), ir.PointerType(_BYTES16)), align=1)
        return amax
    return sig, codegen


@njit(nogil=True)
def _quantize_rows(kind, x, xq):
    """Float32 ``x`` [T, K] → quantized rows ``xq`` uint8 [T, int8_row_bytes(kind, K)]."""
    T, K = x.shape
    block = 32 if _per32(kind) else 256
    for t in range(T):
        row, q = x[t], xq[t]
        d = q[K:].view(np.float32)
        if block == 32:
            for b in range(K // 32):
                d[b] = _quantize_block(row, b * 32, q, 32) / F32(127.0)
        else:
            for b in range(K // 256):
                d[b] = _quantize_block(row, b * 256, q, 256) / F32(127.0)
        if _minimums(kind):
            sums = d[K // block:]
            for j in range(K // 32):
                s = np.int32(0)
                for i in range(32):
                    s += np.int32(np.int8(q[32 * j + i]))
                sums[j] = d[j * 32 // block] * F32(s)


@intrinsic
def _istack(typingctx, n):
    """``n`` (a constant) int32 on the stack (as :func:`_stack`)."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    size = n.literal_value

    def codegen(context, builder, sig, args):
        return cgutils.alloca_once(builder, ir.IntType(32), size=ir.Constant(ir.IntType(64), size))
    return types.CPointer(types.int32)(n), codegen


_sum8 = _lane_sum(8)


@njit(inline="always")
def _i8_scales32(w, o, size, fsc):
    """Blocks of 32 (``size`` bytes) at bytes ``o`` and ``o + size``: their scales d into
    ``fsc[0:2]``, and (Q4_1, Q5_1) their minimums m into ``fsc[8:10]``."""
    fsc[0] = _half(w, o, _F16)
    fsc[1] = _half(w, o + size, _F16)
    if size == 20 or size == 24:
        fsc[8] = _half(w, o + 2, _F16)
        fsc[9] = _half(w, o + size + 2, _F16)


@njit(inline="always")
def _q32_value(kind, w, o, p):
    """The block of 32 at byte ``o`` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): the integer of position
    ``p`` (0..31), Q4_0's and Q5_0's offset (8, 16) subtracted."""
    if kind == 0:
        return np.int32(np.int8(w[o + 2 + p]))
    first = 2 if kind == 1 else 4 if kind == 2 else 6 if kind == 3 else 8
    q = w[o + first + p % 16]
    nib = np.int32(q >> np.uint8(4)) if p >= 16 else np.int32(q & np.uint8(15))
    if kind == 1:
        return nib - 8
    if kind == 2:
        return nib
    v = nib | (np.int32((_u32(w, o + first - 4) >> np.uint32(p)) & np.uint32(1)) << 4)
    return v - 16 if kind == 3 else v


@njit(inline="always")
def _q4k_value(w, o, p):
    """Q4_K super-block at byte ``o``: the 4-bit value of position ``p`` (0..255)."""
    q = w[o + 16 + 32 * (p // 64) + p % 32]
    return np.int32(q >> np.uint8(4)) if p % 64 >= 32 else np.int32(q & np.uint8(15))


@njit(inline="always")
def _q5k_value(w, o, p):
    """Q5_K super-block at byte ``o``: the 5-bit value of position ``p`` (0..255): the nibble as
    Q4_K's (from byte 48), bit 2·(p // 64) (+1 for the high nibbles) of byte 16 + p % 32 above it."""
    k, l = p // 64, p % 32
    q = w[o + 48 + 32 * k + l]
    hi = p % 64 >= 32
    nib = np.int32(q >> np.uint8(4)) if hi else np.int32(q & np.uint8(15))
    return nib | (((np.int32(w[o + 16 + l]) >> (2 * k + (1 if hi else 0))) & 1) << 4)


@njit(inline="always")
def _q6k_value(w, o, p):
    """Q6_K super-block at byte ``o``: the 6-bit value of position ``p`` (0..255), less 32."""
    h, r = p // 128, p % 128
    ql = w[o + 64 * h + r % 64]
    nib = np.int32(ql >> np.uint8(4)) if r >= 64 else np.int32(ql & np.uint8(15))
    hb = (np.int32(w[o + 128 + 32 * h + r % 32]) >> (2 * (r // 32))) & 3
    return (nib | (hb << 4)) - 32


@njit(nogil=True)
def _i8_port(kind, s, m, w, isc, fsc, xq, b, K):
    """The portable form: super-block ``b`` (blocks of 32: blocks 2b, 2b + 1) of weight row ``w``
    into one pair's lanes ``s`` (16) and ``m`` (8, Q4_K and Q5_K) — the operations of the module's rule."""
    per32 = _per32(kind)
    xo = 64 * b if per32 else 256 * b
    size = (34 if kind == 0 else 18 if kind == 1 else 20 if kind == 2 else 22 if kind == 3 else 24) if per32 else 0
    for l in range(16):
        acc = np.int32(0)
        for k in range(1 if per32 else 4):
            c = np.int32(0)
            for i in range(4):
                p = 64 * k + 4 * l + i
                x8 = np.int32(np.int8(xq[xo + p]))
                if kind == 5:
                    c += _q4k_value(w, 144 * b, p) * x8
                elif kind == 6:
                    c += _q5k_value(w, 176 * b, p) * x8
                elif kind == 7:
                    c += _q6k_value(w, 210 * b, p) * x8
                else:
                    c += _q32_value(kind, w, size * (2 * b + p // 32), p % 32) * x8
            if kind == 5 or kind == 6:
                c *= isc[2 * k + l // 8]
            elif kind == 7:
                c *= isc[4 * k + l // 4]
            acc += c
        d = xq[K:].view(np.float32)
        if per32:
            scale = fsc[l // 8] * d[2 * b + l // 8]
        else:
            scale = d[b] * fsc[0]
        s[l] = _fma(scale, F32(acc), s[l])
    if per32 and _minimums(kind):  # lanes 0, 1: the two blocks' m·(dx·Σq8)
        bx = xq[K + 4 * (K // 32):].view(np.float32)
        for j in range(2):
            m[j] = _fma(fsc[8 + j], bx[2 * b + j], m[j])
    elif kind == 5 or kind == 6:
        bx = xq[K + 4 * (K // 256):].view(np.float32)
        for j in range(8):
            m[j] = _fma(fsc[8 + j], bx[8 * b + j], m[j])


_I8x64, _I8x32 = ir.VectorType(ir.IntType(8), 64), ir.VectorType(ir.IntType(8), 32)


def _i8_block(kind: int, form: str = "vnni"):
    """An intrinsic ``block(s, m, w, isc, fsc, x, b, K)``: the vector form of :func:`_i8_port`
    for a tile: super-block ``b`` of NR weight rows ``w`` (a tuple of uint8 rows, their scales
    decoded into the tuples ``isc`` int32 and ``fsc`` float32) by TT quantized activation rows
    ``x`` (a tuple of uint8 rows), into the NR·TT pairs' lanes ``s`` (tuple of 16 float32,
    row-major: weight row, then activation row) and ``m`` (8 float32, Q4_K). Q8_0: ``vpdpbusd``
    (VNNI), 4 byte products into each int32 lane. Q4_K, Q5_K, Q6_K: ``vpmaddubsw`` (pairs of byte
    products into int16, at most 2·63·127 less 2·32·127: no saturation) then ``vpmaddwd`` by the
    pairs' sub-block scale (pairs of those into int32): the same 4 products per lane times the
    scale they share, so the same integers, with the scales applied in the multiply-add.
    ``form`` "avx2": those three instructions as AVX2's (:func:`_avx2_products`); "vector": as
    plain vector arithmetic (bytes widened to int32, multiplied, added in their groups of 4 or
    2), which LLVM compiles for any CPU (NEON): the same integers, so the same bits (the inputs
    never saturate ``vpmaddubsw``: at most 2·63·127)."""
    products = {"vnni": _native_products, "vector": _vector_products,
                "avx2": lambda builder: _avx2_products(builder, kind == 0)}[form]

    @intrinsic
    def block(typingctx, s, m, w, isc, fsc, x, b, K):
        nr, tt = len(w.types), len(x.types)
        sig = types.none(s, m, w, isc, fsc, x, b, K)

        def codegen(context, builder, sig, args):
            def datas(i):
                return _tuple_data(context, builder, sig.args[i], args[i])
            b, K = args[6], args[7]
            ps, pm, pw, pi, pf, px = (datas(i) for i in range(6))
            dot, pairs, quads = products(builder)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16, [_V16] * 3), "llvm.fma.v16f32")
            fma8 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8F, [_V8F] * 3), "llvm.fma.v8f32")
            fma2 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V2F, [_V2F] * 3), "llvm.fma.v2f32")

            def b8(v, ty=_I8x64):
                return ir.Constant(ty, [v] * ty.count)

            def concat(lo, hi):
                return _concat(builder, lo, hi)

            def as32(v):
                return builder.bitcast(v, _I16)
            per32, bs = kind < 5, _I8_SIZE[kind]
            offset = {0: 128, 1: 8, 3: 16}.get(kind, 0)  # blocks of 32: unsigned byte = q + offset
            o = builder.mul(b, _I64(2 * bs if per32 else bs))
            # per weight row: the 4 vectors of 64 unsigned bytes, and the 4 int16 pair scales
            wq, wsc = [], []

            def pair_scales(isc, first):  # int16 lane j: the scale of int32 lane j // 2
                return builder.shuffle_vector(isc, isc, ir.Constant(ir.VectorType(_I32, 32), [first(j // 2) for j in range(32)]))
            for n in range(nr):
                base = builder.gep(pw[n], [o])
                isc = builder.trunc(builder.load(builder.bitcast(pi[n], ir.PointerType(_I16)), align=4),
                                    ir.VectorType(ir.IntType(16), 16))
                if kind in (5, 6):  # Q5_K: the fifth bits of chunk k, bits 2k and 2k + 1 of 32 bytes
                    high = _load(builder, base, _I64(16), _I8x32, 1) if kind == 6 else None
                    for k in range(4):
                        raw = _load(builder, base, _I64((16 if kind == 5 else 48) + 32 * k), _I8x32, 1)
                        lo, hi = builder.and_(raw, b8(15, _I8x32)), builder.lshr(raw, b8(4, _I8x32))
                        if kind == 6:
                            lo, hi = (builder.or_(v, builder.shl(builder.and_(builder.lshr(high, b8(2 * k + j, _I8x32)),
                                                                              b8(1, _I8x32)), b8(4, _I8x32)))
                                      for j, v in enumerate((lo, hi)))
                        wq.append(concat(lo, hi))
                        wsc.append(pair_scales(isc, lambda m, k=k: 2 * k + m // 8))
                elif kind == 7:
                    for k in range(4):
                        h, part = divmod(k, 2)
                        ql = _load(builder, base, _I64(64 * h), _I8x64, 1)
                        nib = builder.lshr(ql, b8(4)) if part else builder.and_(ql, b8(15))
                        qh = _load(builder, base, _I64(128 + 32 * h), _I8x32, 1)
                        hb = concat(builder.lshr(qh, b8(4 * part, _I8x32)), builder.lshr(qh, b8(4 * part + 2, _I8x32)))
                        wq.append(builder.or_(nib, builder.shl(builder.and_(hb, b8(3)), b8(4))))
                        wsc.append(pair_scales(isc, lambda m, k=k: 4 * k + m // 4))
                elif kind == 0:  # q + 128 as unsigned bytes
                    lo, hi = (_load(builder, base, _I64(2 + bs * h), _I8x32, 1) for h in range(2))
                    wq.append(builder.xor(concat(lo, hi), b8(-128)))
                else:  # Q4_0, Q4_1, Q5_0, Q5_1: the nibbles (and Q5_x's fifth bits), two blocks
                    blocks, first = [], {1: 2, 2: 4, 3: 6, 4: 8}[kind]
                    for h in range(2):
                        raw = _load(builder, base, _I64(bs * h + first), _BYTES16, 1)
                        v = concat(builder.and_(raw, b8(15, _BYTES16)), builder.lshr(raw, b8(4, _BYTES16)))
                        if kind in (3, 4):  # bit i of the 32-bit qh: byte i // 8, bit i % 8
                            qh = _load(builder, base, _I64(bs * h + first - 4), ir.VectorType(ir.IntType(8), 4), 1)
                            spread = builder.shuffle_vector(qh, qh, ir.Constant(ir.VectorType(_I32, 32), [i // 8 for i in range(32)]))
                            bit = builder.and_(spread, ir.Constant(_I8x32, [1 << (i % 8) for i in range(32)]))
                            v = builder.or_(v, builder.select(builder.icmp_unsigned("!=", bit, b8(0, _I8x32)),
                                                              b8(16, _I8x32), b8(0, _I8x32)))
                        blocks.append(v)
                    wq.append(concat(*blocks))
            nk = 1 if per32 else 4
            zero = ir.Constant(_I16, [0] * 16)
            vp = ir.PointerType(_V16)
            fp = ir.PointerType(ir.FloatType())
            for t in range(tt):
                xbase = builder.gep(px[t], [builder.mul(b, _I64(64 * nk))])
                xs = [_load(builder, xbase, _I64(64 * k), _I8x64, 1) for k in range(nk)]
                dx = builder.bitcast(builder.gep(px[t], [K]), fp)
                if kind == 7:  # 32·(x + x') per int16 pair: q - 32 times x
                    corr = [pairs(b8(32), v) for v in xs]
                elif per32:  # -offset·Σx per lane: q times x
                    corr = [builder.sub(zero, dot(zero, as32(b8(offset - 256 if offset > 127 else offset)),
                                                  as32(xs[0]))) if offset else zero]
                    d2 = builder.load(builder.bitcast(builder.gep(dx, [builder.mul(b, _I64(2))]), ir.PointerType(_V2F)), align=4)
                    dxv = builder.shuffle_vector(d2, d2, ir.Constant(_I16, [0] * 8 + [1] * 8))
                if not per32:
                    dxs = builder.load(builder.gep(dx, [b]))
                if per32 and kind in (2, 4):  # the two blocks' dx·Σq8
                    nb = builder.sdiv(K, _I64(32))
                    bx2 = builder.load(builder.bitcast(builder.gep(dx, [builder.add(nb, builder.mul(b, _I64(2)))]),
                                                      ir.PointerType(_V2F)), align=4)
                if kind in (5, 6):
                    nsb = builder.sdiv(K, _I64(256))
                    bx = builder.gep(dx, [builder.add(nsb, builder.mul(b, _I64(8)))])
                    bxv = builder.load(builder.bitcast(bx, ir.PointerType(_V8F)), align=4)
                for n in range(nr):
                    acc_p = builder.bitcast(ps[n * tt + t], vp)
                    if per32:
                        c = dot(corr[0], as32(wq[n]), as32(xs[0]))
                        f2 = builder.load(builder.bitcast(pf[n], ir.PointerType(_V2F)), align=4)
                        scale = builder.fmul(builder.shuffle_vector(f2, f2, ir.Constant(_I16, [0] * 8 + [1] * 8)), dxv)
                    else:
                        c = None
                        for k in range(4):
                            p = pairs(wq[4 * n + k], xs[k])
                            p = builder.sub(p, corr[k]) if kind == 7 else p
                            v = quads(p, wsc[4 * n + k])
                            c = v if c is None else builder.add(c, v)
                        scale = _splat(builder, builder.fmul(dxs, builder.load(pf[n])))
                    builder.store(builder.call(fma, [scale, builder.sitofp(c, _V16), builder.load(acc_p, align=4)]),
                                  acc_p, align=4)
                    if per32 and kind in (2, 4):  # lanes 0, 1 of m: fma(m, dx·Σq8, ·) per block
                        mn_p = builder.bitcast(pm[n * tt + t], ir.PointerType(_V2F))
                        mw = builder.load(builder.bitcast(builder.gep(pf[n], [_I64(8)]), ir.PointerType(_V2F)), align=4)
                        builder.store(builder.call(fma2, [mw, bx2, builder.load(mn_p, align=4)]), mn_p, align=4)
                    if kind in (5, 6):
                        mn_p = builder.bitcast(pm[n * tt + t], ir.PointerType(_V8F))
                        mw = builder.load(builder.bitcast(builder.gep(pf[n], [_I64(8)]), ir.PointerType(_V8F)), align=4)
                        builder.store(builder.call(fma8, [mw, bxv, builder.load(mn_p, align=4)]), mn_p, align=4)
            return context.get_dummy_value()
        return sig, codegen
    return block


_V2F, _W32 = ir.VectorType(ir.FloatType(), 2), ir.VectorType(ir.IntType(16), 32)


def _native_products(builder):
    """(dot, pairs, quads) of :func:`_i8_block` as AVX-512 instructions: ``vpdpbusd`` (acc + the
    sums of 4 unsigned-by-signed byte products, <16 x i32>), ``vpmaddubsw`` (sums of 2 such
    products, <32 x i16>), ``vpmaddwd`` (sums of 2 int16 products, <16 x i32>)."""
    def call(name, ty):
        f = cgutils.get_or_insert_function(builder.module, ty, name)
        return lambda *args: builder.call(f, list(args))
    return (call("llvm.x86.avx512.vpdpbusd.512", ir.FunctionType(_I16, [_I16] * 3)),
            call("llvm.x86.avx512.pmaddubs.w.512", ir.FunctionType(_W32, [_I8x64] * 2)),
            call("llvm.x86.avx512.pmaddw.d.512", ir.FunctionType(_I16, [_W32] * 2)))


def _vector_products(builder):
    """The same (dot, pairs, quads) as :func:`_native_products`, in plain vector arithmetic: the
    lanes widened to int32, multiplied, and each group of 4 (dot) or 2 (pairs, quads) adjacent
    products added (exact: no sum leaves int32; ``pairs`` truncates to int16, where its inputs'
    sums lie)."""
    def grouped(v, n, size):  # the sums of ``size`` adjacent lanes of v, n groups
        picks = [builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), [size * i + j for i in range(n)]))
                 for j in range(size)]
        out = picks[0]
        for p in picks[1:]:
            out = builder.add(out, p)
        return out

    def products(a, b, a_signed, b_signed, lanes):
        ty = ir.VectorType(_I32, lanes)
        wa = (builder.sext if a_signed else builder.zext)(a, ty)
        return builder.mul(wa, (builder.sext if b_signed else builder.zext)(b, ty))

    def dot(acc, a, b):
        p = products(builder.bitcast(a, _I8x64), builder.bitcast(b, _I8x64), False, True, 64)
        return builder.add(acc, grouped(p, 16, 4))

    def pairs(a, b):
        return builder.trunc(grouped(products(a, b, False, True, 64), 32, 2), _W32)

    def quads(p, sc):
        return grouped(products(p, sc, True, True, 32), 16, 2)
    return dot, pairs, quads


def _avx2_products(builder, wide: bool):
    """The same (dot, pairs, quads) as :func:`_native_products` by AVX2's 256-bit instructions,
    each on the two halves of its 512-bit operands: ``vpmaddubsw`` (sums of 2 unsigned-by-signed
    byte products into int16, saturated) and ``vpmaddwd`` (sums of 2 int16 products into int32).
    ``dot`` (``vpdpbusd``) is ``vpmaddubsw`` then ``vpmaddwd`` by 1, exact while the unsigned
    bytes are at most 129 (activations lie within ±127: 2·129·127 < 2¹⁵); ``wide`` (Q8_0's
    q + 128, up to 255): the bytes' high and low nibbles apart, the high sums times 16."""
    def call(name, ret, arg):
        f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [arg] * 2), name)
        return lambda a, b: builder.call(f, [a, b])
    maddubs = call("llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(ir.IntType(16), 16), _I8x32)
    maddwd = call("llvm.x86.avx2.pmadd.wd", ir.VectorType(_I32, 8), ir.VectorType(ir.IntType(16), 16))

    def halves(v):
        h = v.type.count // 2
        return [builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h), list(range(a, a + h)))) for a in (0, h)]

    def pairs(a, b):
        return _concat(builder, *(maddubs(x, y) for x, y in zip(halves(a), halves(b))))

    def quads(p, sc):
        return _concat(builder, *(maddwd(x, y) for x, y in zip(halves(p), halves(sc))))

    def dot(acc, a, b):
        a, b = builder.bitcast(a, _I8x64), builder.bitcast(b, _I8x64)
        if not wide:
            return builder.add(acc, quads(pairs(a, b), ir.Constant(_W32, [1] * 32)))
        low = quads(pairs(builder.and_(a, ir.Constant(_I8x64, [15] * 64)), b), ir.Constant(_W32, [1] * 32))
        high = quads(pairs(builder.lshr(a, ir.Constant(_I8x64, [4] * 64)), b), ir.Constant(_W32, [16] * 32))
        return builder.add(acc, builder.add(low, high))
    return dot, pairs, quads


# The block intrinsics of each vector form (compiled only where a tile of that form is).
_I8_BLOCKS = {form: {kind: _i8_block(kind, form) for kind in INT8_KINDS} for form in I8_FORMS[:-1]}


def _i8_tile_source(kind: int, nr: int, tt: int, form: str) -> str:
    per32 = kind < 5  # blocks of 32: a step takes two (64 activation values)
    size = 2 * _I8_SIZE[kind] if per32 else _I8_SIZE[kind]
    rows, acts, pairs = range(nr), range(tt), [(n, t) for n in range(nr) for t in range(tt)]
    lines = ["def tile(w, r0, hi, x, t0, out, ahead, end):"]
    lines += [f"    w{n} = w[min(r0 + {n}, hi - 1)]" for n in rows]
    lines += [f"    x{t} = x[t0 + {t}]" for t in acts]
    lines += [f"    s{n}_{t} = carray(_stack(16), 16)" for n, t in pairs]
    lines += [f"    m{n}_{t} = carray(_stack(8), 8)" for n, t in pairs]
    lines += ["    for j in range(16):"] + [f"        s{n}_{t}[j] = F32(0.0)" for n, t in pairs]
    lines += ["    for j in range(8):"] + [f"        m{n}_{t}[j] = F32(0.0)" for n, t in pairs]
    lines += [f"    i{n} = carray(_istack(16), 16)" for n in rows]
    lines += [f"    f{n} = carray(_stack(16), 16)" for n in rows]
    lines += [f"    K = w0.shape[0] // {size} * {64 if per32 else 256}"]
    lines += [f"    for b in range(w0.shape[0] // {size}):", f"        o = b * {size}"]
    lines += [f"        _prefetch_ahead(w, ahead + {nr} * o + {p}, end)" for p in range(0, nr * size, 64)]
    lines += [f"        _i8_scales32(w{n}, o, {_I8_SIZE[kind]}, f{n})" if per32 else
              f"        _i8_scales{kind}(i{n}, f{n}, w{n}, o, _F16)" for n in rows]
    if form != "portable":
        tup = lambda names: "(" + ", ".join(names) + ",)"  # noqa: E731
        block = f"_i8_{form}_block{kind}"
        lines += [f"        {block}({tup(f's{n}_{t}' for n, t in pairs)}, {tup(f'm{n}_{t}' for n, t in pairs)}, "
                  f"{tup(f'w{n}' for n in rows)}, {tup(f'i{n}' for n in rows)}, {tup(f'f{n}' for n in rows)}, "
                  f"{tup(f'x{t}' for t in acts)}, b, K)"]
    else:
        lines += [f"        _i8_port({kind}, s{n}_{t}, m{n}_{t}, w{n}, i{n}, f{n}, x{t}, b, K)" for n, t in pairs]
    for n in rows:
        lines.append(f"    if r0 + {n} < hi:")
        total = "_sum16(s{n}_{t}) + _sum8(m{n}_{t})" if kind in (2, 4, 5, 6) else "_sum16(s{n}_{t})"
        lines += [f"        out[t0 + {t}, r0 + {n}] = " + total.format(n=n, t=t) for t in acts]
    return "\n".join(lines)


def _compile_i8_tile(kind: int, nr: int, tt: int, form: str):
    scope = dict(np=np, F32=F32, carray=carray, min=min, _stack=_stack, _istack=_istack, _sum16=_sum16,
                 _sum8=_sum8, _prefetch_ahead=_prefetch_ahead, _i8_port=_i8_port, _F16=_F16,
                 _i8_scales32=_i8_scales32, _i8_scales5=_i8_scales5, _i8_scales6=_i8_scales6,
                 _i8_scales7=_i8_scales7,
                 **{f"_i8_{form}_block{k}": f for form, blocks in _I8_BLOCKS.items() for k, f in blocks.items()})
    exec(compile(_i8_tile_source(kind, nr, tt, form), f"<{__name__} int8 tile {kind} {nr}x{tt} {form}>", "exec"), scope)
    return njit(nogil=True, inline="always")(scope["tile"])


def _i8_rows_kernel(kind: int, form: str = "", table=None):
    """Rows ``lo:hi`` of ``out`` for weight kind ``kind`` times quantized activation rows
    (:func:`_quantize_rows`), tiled as ``table`` says (default :data:`_TILES`), in ``form`` (:data:`I8_FORMS`; default
    :data:`I8_FORM`): the same bits in every form."""
    form = form or I8_FORM
    if form not in I8_FORMS:
        raise ValueError(f"int8 form must be one of {I8_FORMS}, got {form!r}")
    if (form == "vnni" and not VNNI) or (form == "avx2" and not AVX2):  # would not compile (or run) here
        raise ValueError(f"the int8 form {form!r} needs a CPU with {'AVX-512 VNNI and BW' if form == 'vnni' else 'AVX2'}; "
                         f"this one takes {I8_FORM!r}")
    table = table or _TILES
    return _tiled_rows([_compile_i8_tile(kind, nr, tt, form) for nr, tt in (*table, (table[1][0], 3))], table)


_I8_ROWS = tuple(_i8_rows_kernel(kind) for kind in INT8_KINDS)
_i8_rows0, _i8_rows1, _i8_rows2, _i8_rows3, _i8_rows4, _i8_rows5, _i8_rows6, _i8_rows7 = _I8_ROWS


@njit(nogil=True)
def _rows_i8(kind, w, xq, out, lo, hi):
    if kind == 0:
        _i8_rows0(w, xq, out, lo, hi)
    elif kind == 1:
        _i8_rows1(w, xq, out, lo, hi)
    elif kind == 2:
        _i8_rows2(w, xq, out, lo, hi)
    elif kind == 3:
        _i8_rows3(w, xq, out, lo, hi)
    elif kind == 4:
        _i8_rows4(w, xq, out, lo, hi)
    elif kind == 5:
        _i8_rows5(w, xq, out, lo, hi)
    elif kind == 6:
        _i8_rows6(w, xq, out, lo, hi)
    else:
        _i8_rows7(w, xq, out, lo, hi)


# ---- a group of products, tile by tile, on however many threads run it ----------------------
# Theory of operation. A group is described by a table: one row per product ``out = x @ W.T``
# (its kind, the addresses and shapes of ``W``, ``x`` and ``out``, and how many weight rows a
# *tile* of it holds). The group's tiles are numbered across the products in order; each thread
# that runs :func:`run_group` on the table takes the next tile number from a shared counter (an
# atomic add), computes that tile with the block kernels (:func:`_rows`; float32 weights:
# ``_rows_f32``, one thread over a range of output rows), and takes the next, until none is left. So a thread
# costs the pool one Python call per group, not one per tile, and tiles small enough to keep 16
# threads evenly busy cost ~0.1 µs each to hand out. A tile's result does not depend on which
# thread computed it: each output element keeps its one sequence of float32 operations.
#
# The addresses come from arrays the caller keeps alive for the call; the caller checks every
# shape (:meth:`QMatrix._operands`) before the table is written, since the compiled side trusts it.
# It lives in this file because numba's cache of a function is checked against its own source
# file only: a kernel changed here must invalidate the group's compiled copy of it too.

# Columns of a group table (int64 [n, NCOLS]).
KIND, W, W_ROWS, W_ROW_BYTES, X, T, K, OUT, TILE_ROWS, FIRST_TILE = range(10)
NCOLS = 10


def _view(dtype, readonly: bool):
    """An intrinsic: the C-order 2-D array of ``dtype`` at address ``addr`` with ``rows × cols``
    elements, owning nothing (as ``numba.carray``), read-only or not: the types ``matmul``
    passes the block kernels, so ``run_group`` links their compiled code rather than compiling
    it again."""
    aryty = types.Array(dtype, 2, "C", readonly=readonly)

    @intrinsic
    def view(typingctx, addr, rows, cols):
        sig = aryty(types.int64, types.int64, types.int64)

        def codegen(context, builder, sig, args):
            addr, rows, cols = args
            ary = context.make_array(aryty)(context, builder)
            itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(dtype)))
            data = builder.inttoptr(addr, context.get_data_type(dtype).as_pointer())
            populate_array(ary, data=data, shape=[rows, cols], strides=[builder.mul(cols, itemsize), itemsize],
                           itemsize=itemsize, meminfo=None)
            return ary._getvalue()
        return sig, codegen
    return view


_weights = _view(types.uint8, True)
_bytes = _view(types.uint8, False)
_floats = _view(types.float32, False)
_float_weights = _view(types.float32, True)  # a read-only F32 QMatrix's data, as matmul_f32 takes it

# The group kind of a float32 weight matrix (a router; a float32 model's products): matmul_f32's
# rows, so a router's small product is shared by the threads a group reaches (the spinning
# workers) rather than run on one thread or handed to the Python pool.
FLOAT32 = 15


@intrinsic
def _take(typingctx, counter):
    """``counter[0] += 1`` atomically (int64 array); returns the value before."""
    sig = types.int64(counter)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return builder.atomic_rmw("add", data, ir.Constant(ir.IntType(64), 1), "monotonic")
    return sig, codegen


@intrinsic
def _finished(typingctx, counter):
    """``counter[1] += 1`` atomically, releasing this thread's writes before it (int64 array):
    a quantizing tile of :func:`run_group_i8` is done."""
    sig = types.none(counter)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        builder.atomic_rmw("add", builder.gep(data, [ir.Constant(ir.IntType(64), 1)]),
                           ir.Constant(ir.IntType(64), 1), "release")
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _finished_count(typingctx, counter):
    """``counter[1]``, acquiring the writes released with it (int64 array)."""
    sig = types.int64(counter)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return builder.load_atomic(builder.gep(data, [ir.Constant(ir.IntType(64), 1)]), "acquire", 8)
    return sig, codegen


_ARCH = platform.machine().lower()


@intrinsic
def _pause(typingctx):
    """The CPU's spin-wait hint (x86 ``pause``, Arm ``yield``, as LLVM intrinsics): a waiting
    core gives way to its sibling thread and draws less power; nothing elsewhere."""
    sig = types.none()

    def codegen(context, builder, sig, args):
        module = builder.module
        if _ARCH in ("x86_64", "amd64"):
            name = "llvm.x86.sse2.pause"
            fn = module.globals.get(name) or ir.Function(module, ir.FunctionType(ir.VoidType(), []), name)
            builder.call(fn, [])
        elif _ARCH in ("arm64", "aarch64"):
            name = "llvm.aarch64.hint"
            fn = module.globals.get(name) or ir.Function(module, ir.FunctionType(ir.VoidType(), [ir.IntType(32)]), name)
            builder.call(fn, [ir.Constant(ir.IntType(32), 1)])  # 1: YIELD
        return context.get_dummy_value()
    return sig, codegen


_YIELD = "sched_yield" if os.name == "posix" else ""  # libc's, found by the JIT's linker


@intrinsic
def _yield(typingctx):
    """Give this thread's core to another runnable thread (POSIX ``sched_yield``; nothing
    elsewhere): a caller waiting for a worker that was preempted inside a group lets it run."""
    sig = types.none()

    def codegen(context, builder, sig, args):
        if _YIELD:
            module = builder.module
            fn = module.globals.get(_YIELD) or ir.Function(module, ir.FunctionType(ir.IntType(32), []), _YIELD)
            builder.call(fn, [])
        return context.get_dummy_value()
    return sig, codegen


@njit(nogil=True, inline="always")
def _tile(table, i, t):
    """Tile ``t`` of the group ``table``'s product ``i``: its rows and operands."""
    rows, step = table[i, W_ROWS], table[i, TILE_ROWS]
    lo = (t - table[i, FIRST_TILE]) * step
    return lo, min(rows, lo + step)


@njit(nogil=True)
def _float_tile(table, i, t):
    lo, hi = _tile(table, i, t)
    rows = table[i, W_ROWS]
    x = _floats(table[i, X], table[i, T], table[i, K])
    out = _floats(table[i, OUT], table[i, T], rows)
    if table[i, KIND] == FLOAT32:
        _rows_f32(_float_weights(table[i, W], rows, table[i, K]), x, out, 0, lo, hi)
    else:
        _rows(table[i, KIND], _weights(table[i, W], rows, table[i, W_ROW_BYTES]), x, out, lo, hi)


@njit(cache=True, nogil=True)
def run_group(table, counter, tiles):  # pragma: no cover - compiled
    """Compute tiles of the group ``table`` (int64 [n, NCOLS]) until ``counter`` (int64 [2],
    shared by every thread running this call) passes ``tiles``, the group's tile count. Returns
    the tiles this thread computed. Releases the GIL. Float32 activations only: the int8
    numerics' groups run :func:`run_group_i8`, so a float32 process never compiles its tiles."""
    done = 0
    i = 0
    while True:
        t = _take(counter)
        if t >= tiles:
            return done
        while i + 1 < table.shape[0] and table[i + 1, FIRST_TILE] <= t:  # a thread's t only grows
            i += 1
        _float_tile(table, i, t)
        done += 1


# Products of the int8 numerics (:func:`int8_group`): a group's table starts with rows that
# quantize activation rows (kind QUANTIZE + the weight kind whose rule they follow; X the float32
# rows, OUT their quantized bytes, W_ROWS the activation rows, cut into tiles as products are), so
# every thread that joins quantizes a share; no thread starts a product tile before every
# quantizing tile is done (counter[1] counts them).
QUANTIZE = 2 * INT8_OFFSET


@njit(cache=True, nogil=True)
def run_group_i8(table, counter, tiles):  # pragma: no cover - compiled
    """:func:`run_group` for a group of the int8 numerics (:func:`int8_group`): its quantizing
    tiles, then its products (an int8 kind's on the quantized rows, any other kind's on float32
    rows). ``counter`` int64 [2], zero: the next tile, and the quantizing tiles done. The table's
    tiles are numbered from 0 (as every table builder numbers them), so its first product's
    ``FIRST_TILE`` is the quantizing tiles' count."""
    done = 0
    i = 0
    ready = table.shape[0] == 0 or table[0, KIND] < QUANTIZE
    while True:
        t = _take(counter)
        if t >= tiles:
            return done
        while i + 1 < table.shape[0] and table[i + 1, FIRST_TILE] <= t:
            i += 1
        kind = table[i, KIND]
        if kind >= QUANTIZE:
            lo, hi = _tile(table, i, t)
            kind -= QUANTIZE
            x = _floats(table[i, X], table[i, T], table[i, K])
            xq = _bytes(table[i, OUT], table[i, T], int8_row_bytes(kind, table[i, K]))
            _quantize_rows(kind, x[lo:hi], xq[lo:hi])
            _finished(counter)
        else:
            if not ready:  # the quantizing tiles are the first ``table[i0, FIRST_TILE]``
                i0 = 0
                while table[i0, KIND] >= QUANTIZE:
                    i0 += 1
                waited = 0
                while _finished_count(counter) < table[i0, FIRST_TILE]:
                    waited += 1
                    if waited < 1000:  # ~25 µs: a quantizing tile finishing
                        _pause()
                    else:  # longer: its thread was likely preempted; let it have a core
                        _yield()
                ready = True
            if kind >= INT8_OFFSET:
                lo, hi = _tile(table, i, t)
                kind -= INT8_OFFSET
                rows = table[i, W_ROWS]
                w = _weights(table[i, W], rows, table[i, W_ROW_BYTES])
                xq = _weights(table[i, X], table[i, T], int8_row_bytes(kind, table[i, K]))
                _rows_i8(kind, w, xq, _floats(table[i, OUT], table[i, T], rows), lo, hi)
            else:
                _float_tile(table, i, t)
        done += 1


def _no_half_conversion() -> bool:
    """Whether the kernels are compiled for an x86 CPU without F16C (NUMBA_CPU_NAME=generic, or
    a CPU before 2012): LLVM then lowers a half → float conversion to a call of compiler-rt's
    ``__extendhfsf2``, which numba's JIT cannot link (the process aborts)."""
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686") and not _target_has("f16c")


def _half_bits_to_float(builder, h16):
    """IEEE half bits (i16) → float32 by integer operations, exactly (float32 holds every half):
    the exponent rebiased in place; infinities and NaNs keep an all-ones exponent; zeros and
    subnormals as ``2^-14 · (1 + m/1024) − 2^-14 = m · 2^-24``, one exact subtraction."""
    i32, f32 = ir.IntType(32), ir.FloatType()
    h = builder.zext(h16, i32)
    o = builder.shl(builder.and_(h, i32(0x7FFF)), i32(13))  # exponent and mantissa in float32's places
    e = builder.and_(o, i32(0x0F800000))
    o = builder.add(o, i32(112 << 23))  # bias 15 → 127
    special = builder.add(o, i32(112 << 23))  # exponent 31 → 255
    tiny = builder.bitcast(builder.fsub(builder.bitcast(builder.add(o, i32(1 << 23)), f32),
                                        ir.Constant(f32, 2.0 ** -14)), i32)
    o = builder.select(builder.icmp_unsigned("==", e, i32(0x0F800000)), special,
                       builder.select(builder.icmp_unsigned("==", e, i32(0)), tiny, o))
    sign = builder.shl(builder.and_(h, i32(0x8000)), i32(16))
    return builder.bitcast(builder.or_(o, sign), f32)


@intrinsic
def _h2f_by_bits(typingctx, u):
    """:func:`_h2f` by integer operations (any CPU; what it is where F16C is missing)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, sig, args):
        return _half_bits_to_float(builder, args[0])
    return sig, codegen


@intrinsic
def _h2f(typingctx, u):
    """IEEE half bits (uint16) → float32, exactly (a vector conversion once vectorised; integer
    operations where the CPU has none, :func:`_no_half_conversion`)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, sig, args):
        if _NO_HALF_CONVERSION:
            return _half_bits_to_float(builder, args[0])
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return sig, codegen


_NO_HALF_CONVERSION = _no_half_conversion()


@intrinsic
def _bf2f(typingctx, u):
    """bfloat16 bits (uint16) → float32, exactly (the bits shifted into the top half)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        return builder.bitcast(builder.shl(builder.zext(args[0], i32), i32(16)), ir.FloatType())
    return sig, codegen


# Float32 weights (F32 matrices; F16/BF16 converted element by element as they are read, exact;
# every other encoding after its rows are decoded to float32 in tiles): the same tiles, 32 lanes
# per (weight row, activation row) pair. Element k goes to lane k % 32 by fused multiply-add, in
# ascending k; the lanes are reduced as above. Same bits whatever the tile, T, the rows beside
# it, or the thread count — and for F16/BF16 the bits of their decoded float32 tiles.
def _f32_tile_source(nr: int, tt: int, convert: str = "") -> str:
    rows, acts = range(nr), range(tt)
    lines = ["def tile(w, r0, hi, x, t0, out, c0):"]
    lines += [f"    w{n} = w[min(r0 + {n}, hi - 1)]" for n in rows]
    lines += [f"    x{t} = x[t0 + {t}]" for t in acts]
    lines += [f"    s{n}_{t} = carray(_stack(32), 32)" for n in rows for t in acts]
    lines += ["    for j in range(32):"] + [f"        s{n}_{t}[j] = F32(0.0)" for n in rows for t in acts]
    lines += ["    K = x0.shape[0]", "    nb = K // 32"]
    body = []
    body += [f"xv{t} = x{t}[o + j]" for t in acts]
    body += [f"wv{n} = {convert}(w{n}[o + j])" for n in rows]
    body += [f"s{n}_{t}[j] = _fma(wv{n}, xv{t}, s{n}_{t}[j])" for n in rows for t in acts]
    lines += ["    for b in range(nb):", "        o = b * 32", "        for j in range(32):"]
    lines += ["            " + line for line in body]
    lines += ["    o = nb * 32", "    for j in range(K - o):"]  # the tail: lanes 0 .. K % 32 - 1
    lines += ["        " + line for line in body]
    for n in rows:
        lines.append(f"    if r0 + {n} < hi:")
        lines += [f"        out[t0 + {t}, c0 + r0 + {n}] = _sum32(s{n}_{t})" for t in acts]
    return "\n".join(lines)


def _f32_rows_kernel(convert: str = "", table=None):
    """Rows of ``out`` for float32-weight kernels (``convert``: "" F32, "_h2f" F16, "_bf2f" BF16),
    tiled as ``table`` says (default :data:`_D2_TILES`)."""
    table = table or _D2_TILES
    scope = dict(np=np, F32=F32, carray=carray, min=min, _stack=_stack, _fma=_fma, _sum32=_sum32,
                 _h2f=_h2f, _bf2f=_bf2f)
    tiles = []
    for nr, tt in table:
        exec(compile(_f32_tile_source(nr, tt, convert), f"<{__name__} f32 tile {nr}x{tt} {convert}>", "exec"), scope)
        tiles.append(njit(nogil=True, inline="always")(scope["tile"]))
    (n1, _), (n4, _), _, _ = table
    one, four, two, single = tiles

    @njit(nogil=True)
    def rows(w, x, out, c0, lo, hi):
        T = x.shape[0]
        if T == 1:
            for r0 in range(lo, hi, n1):
                one(w, r0, hi, x, 0, out, c0)
            return
        for r0 in range(lo, hi, n4):
            t0 = 0
            while t0 + 4 <= T:
                four(w, r0, hi, x, t0, out, c0)
                t0 += 4
            if t0 + 2 <= T:
                two(w, r0, hi, x, t0, out, c0)
                t0 += 2
            if t0 < T:
                single(w, r0, hi, x, t0, out, c0)
    return rows


_rows_f32 = _f32_rows_kernel()


@njit(cache=True, nogil=True)
def matmul_f32(w, x, out, c0, lo, hi):
    """out[t, c0 + r] = Σ_k W[r, k] x[t, k] for rows ``lo ≤ r < hi`` of float32 ``w`` [R, K]
    (rows C-contiguous), float32 ``x`` [T, K], ``out`` float32 [T, ≥ c0 + R] (written in
    place). One thread."""
    _rows_f32(w, x, out, c0, lo, hi)


_rows_f16, _rows_bf16 = _f32_rows_kernel("_h2f"), _f32_rows_kernel("_bf2f")


@njit(nogil=True)
def _rows_half(kind, w, x, out, lo, hi):
    if kind == 0:
        _rows_f16(w, x, out, 0, lo, hi)
    else:
        _rows_bf16(w, x, out, 0, lo, hi)


@njit(cache=True, nogil=True)
def matmul_half(kind, w, x, out, lo, hi):
    """out[t, r] = Σ_k W[r, k] x[t, k] for rows ``lo ≤ r < hi`` of 16-bit weights ``w`` uint16
    [R, K] (kind 0: IEEE half, 1: bfloat16), float32 ``x`` [T, K], ``out`` float32 [T, R].
    One thread."""
    _rows_half(kind, w, x, out, lo, hi)


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
    elif kind == 8:
        for b in range(nb):
            o = b * 17
            d = _E8M0[np.int64(row[o])]
            for j in range(16):
                q = row[o + 1 + j]
                dst[b * 32 + j] = d * _MXV[np.int64(q & np.uint8(15))]
                dst[b * 32 + 16 + j] = d * _MXV[np.int64(q >> np.uint8(4))]
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


@njit(cache=True)
def int8_kind(kind, K):
    """Whether weight kind ``kind`` with rows of ``K`` values has an int8 product (blocks of 32
    two at a time, super-blocks of 256 one)."""
    return kind in INT8_KINDS and K % (64 if kind < 5 else 256) == 0


@njit(cache=True, nogil=True)
def quantize(kind, x, xq):
    """Quantize float32 ``x`` [T, K] for weight kind ``kind`` into ``xq`` uint8
    [T, int8_row_bytes(kind, K)] (the rows of :func:`matmul_int8` and the int8 groups)."""
    _quantize_rows(kind, x, xq)


@njit(cache=True, nogil=True)
def matmul_int8(kind, w, xq, out, lo, hi):
    """out[t, r] for rows ``lo ≤ r < hi`` of uint8 ``w`` [R, row_bytes] (a kind of INT8_KINDS) times
    the quantized rows ``xq`` (read-only uint8, :func:`quantize`), ``out`` float32 [T, R]. One
    thread; the same bits as the int8 groups."""
    _rows_i8(kind, w, xq, out, lo, hi)


@njit(cache=True, nogil=True)
def int8_group(table, parts):  # pragma: no cover - compiled
    """The group ``table`` (of :func:`run_group`) as a group of :func:`run_group_i8`: each
    product that has an int8 kernel turned into one (its kind + INT8_OFFSET, its x the address
    of its quantized rows), after a quantizing row for each distinct (x, T, K, quantized format:
    block size and minimums' sums) whose
    rows go into the returned buffer, cut into about ``parts`` tiles. The buffer must stay alive
    while the table runs. Returns (table, buffer, the quantizing tiles' count), the group's
    tiles being its own plus those."""
    n = table.shape[0]
    offs = np.full(n, -1, np.int64)
    first = np.zeros(n, np.bool_)  # the first product of its quantized rows
    total = 0
    nq = 0
    for i in range(n):
        kind, k = table[i, KIND], table[i, K]
        if not int8_kind(kind, k):
            continue
        for j in range(i):
            if (offs[j] >= 0 and table[j, X] == table[i, X] and table[j, T] == table[i, T]
                    and table[j, K] == k and _per32(table[j, KIND]) == _per32(kind)
                    and _minimums(table[j, KIND]) == _minimums(kind)):
                offs[i] = offs[j]
                break
        if offs[i] < 0:
            offs[i], first[i] = total, True
            total += table[i, T] * int8_row_bytes(kind, k)
            nq += 1
    buf = np.empty(total + 64, np.uint8)
    base = buf.ctypes.data + (64 - buf.ctypes.data % 64) % 64
    new = np.empty((nq + n, NCOLS), np.int64)
    q = 0
    tile = 0
    for i in range(n):
        if first[i]:
            kind, rows = table[i, KIND], table[i, T]
            step = max(1, -(-rows // max(1, parts)))
            new[q] = (QUANTIZE + kind, 0, rows, 0, table[i, X], rows, table[i, K], base + offs[i], step, tile)
            tile += -(-rows // step)
            q += 1
    for i in range(n):
        new[nq + i] = table[i]
        new[nq + i, FIRST_TILE] = table[i, FIRST_TILE] + tile
        if offs[i] >= 0:
            new[nq + i, KIND] = table[i, KIND] + INT8_OFFSET
            new[nq + i, X] = base + offs[i]
    return new, buf, tile

