"""A candidate kernel beside the engine's: Q4_K weights times 8-bit activations with AVX-512 VNNI
integer dot products (the numerics llama.cpp uses: each activation row quantized per 256 values
to int8 with one float32 scale, as its Q8_K), against the engine's float32 Q4_K kernel on the
same blocks; prints one JSON document.

    python3 bench/int8_activations.py [--shape 9728x2560] [--ts 1,4] [--repeats 20]

Why: on one or two cores the engine's float32 kernels are bound by their instructions, not by
memory (bench/results/engine.md: a Q4_K row's weight decoded to float32 and multiplied by one
fused multiply-add per weight), where ``vpdpbusd`` multiplies and adds 64 byte pairs in one
instruction. This measures how much that gains before any decision to change what the engine
computes; nothing in the product uses it.

Per super-block of 256 weights and activation row t: the integer sum over its 8 sub-blocks of
sc_j · Σ q·x8 (exact in int32), then two float32 operations in a fixed order,
acc = fma(d·dx, isum, acc); acc = fma(-(dmin·dx), Σ m_j·bsum_j, acc): the bits of a row do not
depend on T, the tile or the thread count, as the engine's kernels. Reported: milliseconds, GB/s of
weights, the relative error of each kernel against float64 of the file's weights and the float
activations, and the share of the engine's kernel time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

_I8x64 = ir.VectorType(ir.IntType(8), 64)
_I32x16 = ir.VectorType(ir.IntType(32), 16)


def _ptr(builder, base, off, ty):
    return builder.bitcast(builder.gep(base, [off]), ir.PointerType(ty))


_F32x16 = ir.VectorType(ir.FloatType(), 16)
_F32x8 = ir.VectorType(ir.FloatType(), 8)


@intrinsic
def _sb_dots(typingctx, W, r0, nr, o, xq, xo, sc, dx, bsf, b, acc, mins):
    """For one Q4_K super-block (byte ``o`` of rows ``r0 .. r0 + nr - 1`` of ``W``, ``nr`` a
    constant; ``sc``: float32 [nr, 16], per row its ``d·sc_j`` then ``-(dmin·m_j)`` as the
    engine's scale decoding gives them) and every row t of ``xq`` (int8 [T, K], each
    super-block's 256 values laid out lo0|hi0|lo1|hi1, from ``xo``): per 64 weights ``vpdpbusd``
    of the nibbles (unsigned) by the activations (signed), exact int32 lanes of 4 products,
    converted and multiplied by the lanes' sub-block scale into a super-block sum s (float32
    [16] lanes, a fixed order), then ``acc[t, n] = fma(dx[t, b], s, acc[t, n])`` and
    ``mins[t, n] = fma(-(dmin·m), bsf[t, 8b:8b+8], mins[t, n])`` (float32 lanes; bsf: the
    sub-block sums of the quantized row times its scale). The activations are loaded once for
    the ``nr`` weight rows."""
    if not isinstance(nr, types.IntegerLiteral):
        return None
    NR = nr.literal_value
    sig = types.none(W, r0, nr, o, xq, xo, sc, dx, bsf, b, acc, mins)

    def codegen(context, builder, sig, args):
        def arr(i):
            return context.make_array(sig.args[i])(context, builder, args[i])
        wa, xa, sa, da, ba, aa, ma = (arr(i) for i in (0, 4, 6, 7, 8, 10, 11))
        i64 = ir.IntType(64)
        c = lambda v: ir.Constant(i64, v)  # noqa: E731
        rb = cgutils.unpack_tuple(builder, wa.strides, 2)[0]  # bytes a weight row
        T, K = cgutils.unpack_tuple(builder, xa.shape, 2)
        nsb = cgutils.unpack_tuple(builder, da.shape, 2)[1]
        dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32x16, [_I32x16] * 3),
                                             "llvm.x86.avx512.vpdpbusd.512")
        fma16 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32x16, [_F32x16] * 3), "llvm.fma.v16f32")
        fma8 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32x8, [_F32x8] * 3), "llvm.fma.v8f32")
        low, four = ir.Constant(_I8x64, [15] * 64), ir.Constant(_I8x64, [4] * 64)
        masks = [[0] * 8 + [2] * 8, [1] * 8 + [3] * 8, [4] * 8 + [6] * 8, [5] * 8 + [7] * 8]
        parts, scales, mns = [], [], []
        for n in range(NR):
            base = builder.add(builder.mul(builder.add(args[1], c(n)), rb), args[3])
            q0 = builder.load(_ptr(builder, wa.data, base, _I8x64), align=1)
            q1 = builder.load(_ptr(builder, wa.data, builder.add(base, c(64)), _I8x64), align=1)
            parts.append([builder.and_(q0, low), builder.lshr(q0, four), builder.and_(q1, low), builder.lshr(q1, four)])
            s8 = builder.load(_ptr(builder, sa.data, c(16 * n), _F32x8), align=4)
            mns.append(builder.load(_ptr(builder, sa.data, c(16 * n + 8), _F32x8), align=4))
            scales.append([builder.shuffle_vector(s8, s8, ir.Constant(_I32x16, m)) for m in masks])
        zero_i, zero_f = ir.Constant(_I32x16, [0] * 16), ir.Constant(_F32x16, [0.0] * 16)
        with cgutils.for_range(builder, T) as loop:
            t = loop.index
            row = builder.add(builder.mul(t, K), args[5])
            xs = [builder.bitcast(builder.load(_ptr(builder, xa.data, builder.add(row, c(64 * k)), _I8x64), align=1), _I32x16)
                  for k in range(4)]
            dxv = builder.load(builder.gep(da.data, [builder.add(builder.mul(t, nsb), args[9])]))
            e = builder.insert_element(ir.Constant(_F32x16, ir.Undefined), dxv, ir.Constant(ir.IntType(32), 0))
            dxs = builder.shuffle_vector(e, e, ir.Constant(_I32x16, [0] * 16))
            bo = builder.add(builder.mul(t, builder.mul(nsb, c(8))), builder.mul(args[9], c(8)))
            bv = builder.load(_ptr(builder, ba.data, bo, _F32x8), align=4)
            for n in range(NR):
                s = zero_f
                for k in range(4):
                    d = builder.call(dot, [zero_i, builder.bitcast(parts[n][k], _I32x16), xs[k]])
                    s = builder.call(fma16, [scales[n][k], builder.sitofp(d, _F32x16), s])
                at = builder.add(builder.mul(t, c(NR)), c(n))
                pa = _ptr(builder, aa.data, builder.mul(at, c(16)), _F32x16)
                builder.store(builder.call(fma16, [dxs, s, builder.load(pa, align=4)]), pa, align=4)
                pm = _ptr(builder, ma.data, builder.mul(at, c(8)), _F32x8)
                builder.store(builder.call(fma8, [mns[n], bv, builder.load(pm, align=4)]), pm, align=4)
        return context.get_dummy_value()
    return sig, codegen


def _kernel():
    from swarm.compute.qkernels import _F16, _k_blocks

    scales = _k_blocks[5][0]  # the engine's Q4_K scale decoding (AVX-512): d·sc_j, then -(dmin·m_j)

    @njit(nogil=True)
    def q4k_x8(W, xq, dx, bsf, y):  # pragma: no cover - compiled
        """y [T, R] float32 = W (Q4_K rows, uint8 [R, nsb·144], R a multiple of 4) times the
        quantized rows, 4 weight rows a pass."""
        T = xq.shape[0]
        nsb = W.shape[1] // 144
        sc = np.empty((4, 16), np.float32)
        acc = np.empty((T, 4, 16), np.float32)
        mins = np.empty((T, 4, 8), np.float32)
        for r0 in range(0, W.shape[0], 4):
            acc[:] = 0.0
            mins[:] = 0.0
            for b in range(nsb):
                for n in range(4):
                    scales(sc[n], 0, W[r0 + n], b * 144, _F16)
                _sb_dots(W, r0, 4, b * 144 + 16, xq, b * 256, sc, dx, bsf, b, acc, mins)
            for t in range(T):
                for n in range(4):
                    total = np.float32(0.0)
                    for j in range(16):
                        total += acc[t, n, j]
                    for j in range(8):
                        total += mins[t, n, j]
                    y[t, r0 + n] = total
    return q4k_x8


def quantize_rows(x: np.ndarray):
    """Activation rows x [T, K] float32 → (int8 [T, K] in the kernel's order, scales float32
    [T, K/256], sub-block sums times the scale float32 [T, K/32]): per 256 values d = max|x| / 127,
    q = round(x / d)."""
    T, K = x.shape
    blocks = x.reshape(T, K // 256, 256)
    amax = np.abs(blocks).max(axis=2)
    d = (amax / 127).astype(np.float32)
    q = np.rint(blocks / np.where(d == 0, 1, d)[..., None]).clip(-127, 127).astype(np.int8)
    bsums = q.reshape(T, K // 32, 32).sum(axis=2, dtype=np.int32)
    bsf = (bsums.reshape(T, K // 256, 8) * d[..., None]).astype(np.float32).reshape(T, K // 32)
    # each super-block as lo0|hi0|lo1|hi1: weights 0..31 + 64..95, 32..63 + 96..127, then +128
    sub = q.reshape(T, K // 256, 8, 32)
    order = sub[:, :, [0, 2, 1, 3, 4, 6, 5, 7]].reshape(T, K)
    return np.ascontiguousarray(order), d, bsf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="9728x2560", help="ROWSxCOLS of the weight matrix (COLS a multiple of 256)")
    ap.add_argument("--ts", default="1,4", help="activation rows, comma-separated")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    from llvmlite import binding

    features = binding.get_host_cpu_features()
    if not (features.get("avx512vnni", False) and features.get("avx512bw", False)):
        raise SystemExit("bench/int8_activations.py: this CPU lacks AVX-512 VNNI (vpdpbusd), which the candidate uses")
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import dequantize

    from bench.kernels import _encode
    from swarm.compute import threads
    from swarm.compute.quant import QMatrix

    threads.set_threads(1)
    R, K = map(int, args.shape.split("x"))
    rng = np.random.default_rng(0)
    w32 = rng.standard_normal((R, K), dtype=np.float32) * 0.05
    raw = _encode(w32, QT.Q4_K, rng)  # random blocks, finite scales (gguf-py has no Q4_K quantizer)
    wd = dequantize(raw, QT.Q4_K).astype(np.float64)
    qm = QMatrix(raw, QT.Q4_K, K)
    out = {"bench": "int8_activations", "shape": [R, K], "weight_bytes": raw.nbytes, "threads": 1,
           "cpu": os.uname().machine, "loadavg": os.getloadavg(), "results": []}
    for T in map(int, args.ts.split(",")):
        x = rng.standard_normal((T, K), dtype=np.float32)
        ref = x.astype(np.float64) @ wd.T
        xq, dx, bs = quantize_rows(x)
        y = np.empty((T, R), np.float32)
        kernel = _kernel()
        kernel(raw, xq, dx, bs, y)
        f32 = qm.matmul(x)

        def best(fn):
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return min(times)
        t_int = best(lambda: kernel(raw, xq, dx, bs, y))
        t_q = best(lambda: quantize_rows(x))
        t_f = best(lambda: qm.matmul(x))
        scale = np.abs(ref).max()
        out["results"].append({
            "T": T, "float32_ms": round(t_f * 1e3, 3), "int8_ms": round(t_int * 1e3, 3),
            "quantize_rows_ms (numpy, once per row for all its products)": round(t_q * 1e3, 3),
            "float32_GB_s": round(raw.nbytes / t_f / 1e9, 1), "int8_GB_s": round(raw.nbytes / t_int / 1e9, 1),
            "int8_over_float32_time": round(t_int / t_f, 3),
            "float32_rel_error": float(np.abs(f32 - ref).max() / scale),
            "int8_rel_error": float(np.abs(y - ref).max() / scale)})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
