"""Candidate kernels for ``x @ W.T`` on GGUF blocks, side by side; prints JSON.

    python3 bench/kernels.py [--threads 2] [--repeats 20] [--clock wall|cpu] [--types Q8_0,Q4_K,…]
                             [--ts 1,16,64,128] [--shapes 4096x1024,1536x576]

Per matrix shape (default 4096x1024 and SmolLM2's 1536x576), block type (default Q8_0, Q4_0,
Q4_1; any type gguf reads: the K-quants, F16, BF16, …) and T (default 1: decode; 16: about what
one expert of a MoE prefill gets, or a batch of decode rows; ``SMALL_T``, the most rows of one
kernel call; 128: prefill, two calls), each candidate's best-of-``--repeats`` time, the weight bytes it
reads per second (encoded size / time; for the float32 baseline, its 4-byte weights),
GFLOP/s (2·T·rows·cols / time), at T > 1 ``step_vs_T1`` (the time against the same
candidate's at T = 1: what a step of T decoding sequences costs against one), and the largest
error relative to max |y| of a float64 product with ``gguf.quants``' dequantization. Candidates:

- ``numpy_f32``: float32 weights (today's engine before compact weights), BLAS;
- ``numpy_tiles``: ``gguf.quants.dequantize`` of the whole matrix, then BLAS (the fallback);
- ``colibri``: :class:`swarm.compute.quant.QMatrix` — numba block kernels at every T (calls
  of at most ``SMALL_T`` rows; a row's result depends only on the row);
- ``colibri_tiles``: for the types with a compiled kernel of their own (K-quants, the IQ types,
  F16/BF16), the path they took before it: rows decoded to float32 (by
  ``gguf.quants.dequantize``), then the compiled float32 kernel;
- ``colibri_int8`` (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): the same under the numerics ``int8`` (activation rows
  quantized to 8 bits, integer dot products: swarm/compute/numerics.py);
- ``colibri_cold`` (T = 1): the same over 128 MiB of copies of the matrix, cycled, so the
  weights come from memory as in a model's decode (the other figures are for a matrix in cache);
- ``onnxruntime``: ``com.microsoft::MatMulNBits`` (Q4_0 and Q8_0 repacked to its layout; Q4_1
  would need float zero points), when ``onnxruntime`` and ``onnx`` are importable.

``--attention`` measures causal GQA attention instead (SmolLM2's 9 query / 3 key-value heads
of 64): a 64-row prefill chunk at 448 cached positions and a decode row at 511, the compiled
kernel (``kernels.attention``) against the numpy/BLAS form it replaced (one batched matmul per
key/value head and an additive mask; a row's bits depend on the row count there).

Thread limits are set (environment, before numpy/numba/onnxruntime load) to ``--threads``.
Also reported: each library's import cost in RSS (a fresh interpreter each) and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_COLD_BYTES = 128 << 20  # more than any L3 cache here


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time each call by the wall clock or by this process's CPU time (steadier "
                         "with one thread on a shared machine: time spent descheduled is not counted)")
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_1", help="comma-separated ggml type names")
    ap.add_argument("--ts", default="", help="comma-separated T values (default 1,16,SMALL_T,128)")
    ap.add_argument("--shapes", default="4096x1024,1536x576", help="comma-separated ROWSxCOLS")
    ap.add_argument("--attention", action="store_true", help="measure attention, not matrix products")
    args = ap.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    # COLIBRI_SWARM_THREADS: the engine's own count, which otherwise follows the cores this
    # process may use (a "--threads 1" run on 16 cores ran the engine's kernels on 16).
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS",
                "COLIBRI_SWARM_THREADS"):
        os.environ[var] = str(args.threads)
    sys.path.insert(0, str(REPO))
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as QT

    from swarm.compute.quant import _LOWBIT, SMALL_T, QMatrix, prepare_kernels

    prepare_kernels()
    if args.attention:
        print(json.dumps({"threads": args.threads, "clock": args.clock, "cpus": os.cpu_count(),
                          "load_avg": os.getloadavg(), "results": _attention(clock, args.repeats)}, indent=1))
        return 0
    ort = _onnxruntime(args.threads)
    rows = []
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for R, K in shapes:
        rng = np.random.default_rng(R)
        w32 = rng.normal(size=(R, K)).astype(np.float32)
        for qtype in (QT[name] for name in args.types.split(",")):
            q = _encode(w32, qtype, rng)
            w64 = gguf.quants.dequantize(q, qtype).astype(np.float64)
            wf = w64.astype(np.float32)
            m = QMatrix(q, qtype, K)
            tiles = None
            if m._kind >= 0 and qtype.name.endswith("_K"):
                k_tiles = QMatrix(q, qtype, K)
                k_tiles._kind = k_tiles._group = -1  # the decoded-tile path these types took before their kernels
                tiles = k_tiles.matmul
            elif qtype in (QT.F16, QT.BF16):  # before their kernels: decoded to float32, then that kernel
                tiles = lambda x: QMatrix.from_float(m.dequantize()).matmul(x)  # noqa: E731
            elif m._kind < 0 and qtype in _LOWBIT:  # before theirs: gguf's numpy decoding, then that kernel
                tiles = lambda x: QMatrix.from_float(gguf.quants.dequantize(q, qtype)).matmul(x)  # noqa: E731
            session = ort(q, qtype, R, K) if ort else None
            # the same matrix in enough copies to overflow the caches: decode reads a model from memory
            cold = [QMatrix(q.copy(), qtype, K) for _ in range(-(-_COLD_BYTES // q.nbytes))]
            ts = [int(v) for v in args.ts.split(",")] if args.ts else sorted({1, 16, SMALL_T, 128})
            for T in ts:
                x = _aligned(rng.normal(size=(T, K)).astype(np.float32))
                want = x.astype(np.float64) @ w64.T
                cands = {
                    "numpy_f32": (lambda: x @ wf.T, wf.nbytes),
                    "numpy_tiles": (lambda: x @ gguf.quants.dequantize(q, qtype).T, q.nbytes),
                    "colibri": (lambda: m.matmul(x), q.nbytes),
                }
                if tiles is not None:
                    cands["colibri_tiles"] = (lambda: tiles(x), q.nbytes)
                if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1):
                    cands["colibri_int8"] = (lambda: _int8(m, x), q.nbytes)
                if T == 1:
                    cands["colibri_cold"] = (lambda: [c.matmul(x) for c in cold], q.nbytes * len(cold))
                if session is not None:
                    cands["onnxruntime"] = (lambda: session.run(None, {"x": x})[0], q.nbytes)
                for name, (fn, nbytes) in cands.items():
                    y = fn()
                    per = len(y) if isinstance(y, list) else 1  # matrices per call (ms: per matrix)
                    y = y[-1] if isinstance(y, list) else y
                    # decode and batched decode (T ≤ 8) are the cheap calls: every repeat
                    best = min(_timed(fn, clock) for _ in range(args.repeats if T <= 8 else max(3, args.repeats // 4)))
                    rows.append({
                        "shape": [R, K], "type": qtype.name, "T": T, "kernel": name,
                        "ms": round(best / per * 1e3, 3), "GB_per_s": round(nbytes / best / 1e9, 2),
                        "GFLOP_per_s": round(2 * T * R * K * per / best / 1e9, 1),
                        "max_rel_error": float(f"{np.abs(y - want).max() / np.abs(want).max():.2e}"),
                    })
    one_row = {(tuple(r["shape"]), r["type"], r["kernel"]): r["ms"] for r in rows if r["T"] == 1}
    for r in rows:  # what a step of T rows costs against a step of one (batched decode)
        base = one_row.get((tuple(r["shape"]), r["type"], r["kernel"]))
        if r["T"] > 1 and base:
            r["step_vs_T1"] = round(r["ms"] / base, 2)
    print(json.dumps({
        "threads": args.threads, "clock": args.clock, "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
        "import_rss_mib": {lib: _import_rss(lib) for lib in ("numpy", "numba", "onnxruntime")},
        "results": rows,
    }, indent=1))
    return 0


def _attention(clock, repeats: int) -> list[dict]:
    import numpy as np

    from swarm.compute.kernels import attention

    f32 = np.float32

    def blas(q, k, v, start):  # the numpy/BLAS attention the compiled kernel replaced
        T, nh, hd = q.shape
        nkv, S = k.shape[0], start + T
        g = nh // nkv
        mask = np.where(np.arange(S)[None, :] > start + np.arange(T)[:, None], f32(-np.inf), f32(0))
        scores = np.matmul(q.transpose(1, 0, 2).reshape(nkv, g * T, hd), k[:, :S].transpose(0, 2, 1))
        scores += np.tile(mask, (g, 1))
        scores -= np.maximum.reduce(scores, axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        denom = np.add.reduce(scores, axis=-1, keepdims=True)
        out = np.matmul(scores, v[:, :S])
        out /= denom
        return out.reshape(nh, T, hd).transpose(1, 0, 2).reshape(T, nh * hd)

    rng = np.random.default_rng(0)
    nh, nkv, hd, rows = 9, 3, 64, []
    for name, T, start in (("prefill chunk", 64, 448), ("decode", 1, 511)):
        q = (rng.normal(size=(T, nh, hd)) / 8).astype(f32)
        k = rng.normal(size=(nkv, start + T, hd)).astype(f32)
        v = rng.normal(size=(nkv, start + T, hd)).astype(f32)
        want = blas(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), start)
        for kernel, fn in (("colibri", attention), ("numpy_blas", blas)):
            y = fn(q, k, v, start)
            best = min(_timed(lambda: fn(q, k, v, start), clock) for _ in range(repeats))
            rows.append({"case": name, "T": T, "start": start, "kernel": kernel, "ms": round(best * 1e3, 4),
                         "max_abs_error": float(f"{np.abs(y - want).max():.2e}")})
    return rows


def _aligned(a):
    """A copy of ``a`` whose data starts on a 64-byte boundary (a cache line; numpy gives 16 or 32),
    so that every 16-float load of a row is one line: at T ≥ 4 the K-quant kernels ran ~15 %
    slower on activations 16 bytes off, which made their timings depend on where numpy put them."""
    import numpy as np

    raw = np.empty(a.nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _int8(m, x):
    """``m.matmul(x)`` under the numerics int8 (8-bit activation rows), float32 again after."""
    from swarm.compute import numerics

    numerics.set_numerics("int8")
    try:
        return m.matmul(x)
    finally:
        numerics.set_numerics("float32")


def _encode(w32, qtype, rng):
    """uint8 blocks of ``qtype`` for float32 ``w32`` [R, K]: gguf's quantizer where it has one;
    else (K-quants, IQ types) random blocks whose float16 scales are set to 2^-6 (d) and 2^-8
    (dmin), so every weight is finite — speed does not depend on the values."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as QT

    try:
        return np.ascontiguousarray(gguf.quants.quantize(w32, qtype)).view(np.uint8)
    except (NotImplementedError, gguf.quants.QuantError):
        pass
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(w32.shape[0], w32.shape[1] // block, size), dtype=np.uint8)
    halves = {QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,),
              **{q: (0,) for q in (QT.IQ4_NL, QT.IQ4_XS, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S,
                                   QT.IQ1_S)}}
    if qtype == QT.IQ1_M:  # its scale's bits are the top nibbles of 4 words: sign and exponent kept small
        raw[:, :, 55] &= 0x3F
    elif qtype not in halves:
        raise SystemExit(f"bench/kernels.py: no encoder for {qtype.name}")
    for off, value in zip(halves.get(qtype, ()), (2.0 ** -6, 2.0 ** -8)):
        raw[:, :, off:off + 2] = np.array([value], np.float16).view(np.uint8)
    return raw.reshape(w32.shape[0], -1)


def _timed(fn, clock) -> float:
    t = clock()
    fn()
    return clock() - t


def _import_rss(module: str) -> float | None:
    """RSS (MiB) of a fresh interpreter after ``import numpy, <module>``, minus numpy alone
    (VmRSS: a child's ru_maxrss starts from its parent's at fork)."""
    rss = "int(dict(l.split(':', 1) for l in open('/proc/self/status'))['VmRSS'].split()[0])"
    code = f"import numpy; a = {rss}; import {module}; print(a, {rss})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        return None
    a, b = (int(v) for v in out.stdout.split())
    return round((b - a) / 1024, 1)


def _onnxruntime(threads: int):
    """A builder of one-node MatMulNBits sessions for Q4_0/Q8_0 blocks, or None when unavailable."""
    try:
        import numpy as np
        import onnx
        import onnxruntime as ort
        from gguf import GGMLQuantizationType as QT
        from onnx import TensorProto, helper
    except ImportError:
        return None

    def build(q, qtype, R, K):
        if qtype not in (QT.Q4_0, QT.Q8_0):
            return None
        nb = K // 32
        blocks = q.reshape(R, nb, -1)
        scales = blocks[:, :, :2].copy().view(np.float16).astype(np.float32).reshape(-1)
        if qtype == QT.Q8_0:  # int8 q -> unsigned q + 128 with the default zero point 128
            packed = (blocks[:, :, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
            bits = 8
        else:  # GGUF: byte j holds weights j (low) and j+16 (high); ORT: weights 2i (low), 2i+1 (high)
            qs = blocks[:, :, 2:]
            vals = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [R, nb, 32] in weight order
            packed = (vals[..., 0::2] | (vals[..., 1::2] << 4)).astype(np.uint8)
            bits = 4
        node = helper.make_node("MatMulNBits", ["x", "B", "scales"], ["y"], domain="com.microsoft",
                                K=K, N=R, bits=bits, block_size=32)
        graph = helper.make_graph(
            [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", K])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", R])],
            initializer=[helper.make_tensor("B", TensorProto.UINT8, packed.shape, packed.tobytes(), raw=True),
                         helper.make_tensor("scales", TensorProto.FLOAT, scales.shape, scales.tobytes(), raw=True)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid("com.microsoft", 1)])
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])

    _ = onnx
    return build


if __name__ == "__main__":
    sys.exit(main())
