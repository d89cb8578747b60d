"""Where the int8 K-quant tile's time goes, one thread: the machine's form of a kind's rows kernel
beside variants with one part of its work taken out or its tile shape changed; prints JSON lines.

    taskset -c 0 python3 bench/int8_tile_parts.py [--kind 5] [--t 64,8,4] [--reps 15]

Every variant is compiled in this process (seconds each) and timed interleaved with the others
(their best and median of ``--reps`` calls over a [9728, 2560] product of random blocks: Qwen3-4B's
MLP shape, rows 512 at a time as a group's tiles take them), so that a busy machine slows all of
them alike. Variants (kinds 5, 6 Q4_K, Q5_K; 7 Q6_K takes the first three):

* ``base``: the kernel as it is;
* ``other_tiles``: the same kernel with tiles of 1 weight row by 4, 2 and 1 activation rows where
  ``qkernels._TILES`` takes 2 (else 2 where it takes 1): the same bits, a tile's shape changes no
  operation on an element;
* ``no_float``: each super-block's int32 lane sums folded into the sums by xor instead of the
  float32 ``fma`` by their scale (wrong results: what that ``fma`` and its conversion cost);
* ``no_mins``: Q4_K's and Q5_K's minimums left out (wrong results: what they cost);
* ``no_scale_shuffle``: constant sub-block scales where each is spread over its int16 lanes
  (wrong results: what spreading them costs).

The wrong-result variants are measurements of a part's share only; ``bits_as_base`` says which
variant computes the kernel's bits.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from swarm.compute import quant  # noqa: E402

k = quant._kernels()
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import _machine  # noqa: E402

# (text of qkernels._i8_block, its replacement) per variant; a text not found fails loudly.
_FMA = ("builder.store(builder.call(fma, [scale, builder.sitofp(c, _V16), builder.load(acc_p, align=4)]),\n"
        "                                  acc_p, align=4)")
_PATCHES = {
    "no_float": [(_FMA, "builder.store(builder.bitcast(builder.xor(builder.bitcast(builder.load(acc_p, align=4), _I16), c),"
                        " _V16), acc_p, align=4)")],
    "no_mins": [("builder.store(builder.call(fma8, [mw, bxv, builder.load(mn_p, align=4)]), mn_p, align=4)", "pass")],
    "no_scale_shuffle": [("wsc.append(pair_scales(isc, lambda m, k=k: 2 * k + m // 8))",
                          "wsc.append(ir.Constant(_W32, [3 + k] * 32))")],
}


def rows_kernel(kind: int, variant: str):
    """``variant``'s rows kernel of ``kind`` in this machine's form (module state restored after)."""
    blocks, table = dict(k._I8_BLOCKS[k.I8_FORM]), None
    try:
        if variant == "other_tiles":
            nr = 1 if k._TILES[1][0] == 2 else 2
            table = (k._TILES[0], (nr, 4), (nr, 2), (nr, 1))
        elif variant != "base":
            source = textwrap.dedent(inspect.getsource(k._i8_block))
            for old, new in _PATCHES[variant]:
                if old not in source:
                    raise SystemExit(f"{variant}: qkernels._i8_block no longer has the text this variant replaces")
                source = source.replace(old, new)
            scope = dict(vars(k))
            exec(compile(source, f"<{variant}>", "exec"), scope)
            k._I8_BLOCKS[k.I8_FORM][kind] = scope["_i8_block"](kind, k.I8_FORM)
        return k._i8_rows_kernel(kind, k.I8_FORM, table)
    finally:
        k._I8_BLOCKS[k.I8_FORM].update(blocks)


def weights(kind: int, rows: int, cols: int) -> np.ndarray:
    """Random super-blocks with finite scales (d, dmin 0.01)."""
    size = k._I8_SIZE[kind]
    w = np.random.default_rng(0).integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    half = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    for at in ((208,) if kind == 7 else (0, 2)):
        w[:, :, at:at + 2] = half
    w = w.reshape(rows, -1)
    w.flags.writeable = False
    return w


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kind", type=int, default=5, choices=(5, 6, 7), help="qkernels' int8 kind: 5 Q4_K, 6 Q5_K, 7 Q6_K")
    ap.add_argument("--t", default="64,8,4", help="activation rows, comma-separated")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    if k.I8_FORM not in k._I8_BLOCKS:
        raise SystemExit(f"the int8 form here is {k.I8_FORM!r}, whose tiles have no block intrinsic to take apart")
    variants = ["base", "other_tiles", "no_float", "no_scale_shuffle"] + (["no_mins"] if args.kind != 7 else [])
    if args.kind == 7:
        variants.remove("no_scale_shuffle")  # Q6_K spreads its scales by another shuffle
    rows, cols, chunk = 9728, 2560, 512
    print(json.dumps({"machine": _machine(), "form": k.I8_FORM, "kind": args.kind,
                      "tiles": k._TILES, "shape": [rows, cols]}))
    w = weights(args.kind, rows, cols)
    fns = {}
    for v in variants:
        t = time.perf_counter()
        fns[v] = rows_kernel(args.kind, v)
        fns[v](w, np.zeros((1, k.int8_row_bytes(args.kind, cols)), np.uint8), np.zeros((1, rows), np.float32), 0, 4)
        print(json.dumps({"variant": v, "compile_s": round(time.perf_counter() - t, 1)}), file=sys.stderr)
    for T in map(int, args.t.split(",")):
        x = np.random.default_rng(T).standard_normal((T, cols)).astype(np.float32)
        xq = np.zeros((T, k.int8_row_bytes(args.kind, cols)), np.uint8)
        k.quantize(args.kind, x, xq)
        outs = {v: np.zeros((T, rows), np.float32) for v in variants}
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.reps):
            for v in variants:
                t = time.perf_counter()
                for lo in range(0, rows, chunk):
                    fns[v](w, xq, outs[v], lo, min(rows, lo + chunk))
                times[v].append(time.perf_counter() - t)
        for v in variants:
            ts = sorted(times[v])
            print(json.dumps({"T": T, "variant": v, "best_ms": round(ts[0] * 1e3, 2),
                              "median_ms": round(ts[len(ts) // 2] * 1e3, 2),
                              "gop_s": round(2 * T * rows * cols / ts[0] / 1e9, 1),
                              "vs_base": round(ts[0] / sorted(times["base"])[0], 3),
                              "bits_as_base": bool((outs[v].view(np.uint32) == outs["base"].view(np.uint32)).all())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
