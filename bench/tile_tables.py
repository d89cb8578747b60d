"""Tile tables against each other (``qkernels._TILES``, ``_K_TILES``, ``_D2_TILES``) on this CPU, one
thread: every kernel family the tables drive, every table compiled in this process and timed
interleaved; prints JSON lines.

    taskset -c 0 python3 bench/tile_tables.py [--t 1,4,8,64] [--reps 9] [--tables 2xN,1xN] [--types Q4_1,Q4_K] [--numerics float32]

Tables: ``2xN`` (4 × 1 for one activation row, then 2 × 4, 2 × 2, 2 × 1 and 2 × 3: AVX-512's),
``1xN`` (4 × 1, then 1 × 4, 1 × 2, 1 × 1, 1 × 3), ``2x1+1xN``, ``1x1+1xN`` (``1xN`` with 2 or
1 weight rows a tile for one activation row: decode's tile) and ``2x1+2xN``. Without AVX-512 the
float32 K-quants take ``1x1+1xN`` (``qkernels._K_TILES_NO_AVX512``), and the float32-weight kernels and
float32 Q4_0, Q4_1, Q5_0 and Q5_1 ``2x1+2xN`` (``_D2_TILES_NO_AVX512``). Kernels, on random weights
of [4096, 2560] (blocks of 32, K-quants) and [1024, 2560] (F16): float32 activations through the
``--types`` (default Q4_1, Q8_0, Q4_K, Q6_K blocks and F16) and 8-bit activations (the numerics
int8) through the same blocks. Each line: best ms of ``--reps`` calls per table, each table's ratio to the
first, and whether every table's output has the first one's bits (they must: a tile's shape changes no
operation on an element). The first line names the CPU, the forms and the table this CPU takes.
``--types Q2_K,Q3_K,IQ4_NL --t 1,2,4,8 --numerics float32 --tables 1x1,1x4,decoded`` times the
low-bit types' own decode tile (``swarm/compute/lowbit.py``) at every T: tables ``NxM``, N weight rows
(1, 2, 4) by M activation rows (1 to 4; at T = 1 every table runs N × 1), in this CPU's form or
``--form``'s, and ``decoded``, the decoders' path (the kernel's above ``lowbit._FUSED_ROWS``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gguf import GGMLQuantizationType as QT  # noqa: E402

from swarm.compute import lowbit, quant  # noqa: E402
from tests.compute.test_quant_kernels import encoded  # noqa: E402

k = quant._kernels()
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import _machine  # noqa: E402
from kernels import _encode  # noqa: E402

# the product's three tables by their names here (qkernels: _TILES, _K_TILES_NO_AVX512, _D2_TILES_NO_AVX512), and two others
TABLES = {"2xN": k._TILES, "1xN": ((4, 1), (1, 4), (1, 2), (1, 1)),
          "2x1+1xN": ((2, 1), (1, 4), (1, 2), (1, 1)), "1x1+1xN": k._K_TILES_NO_AVX512,
          "2x1+2xN": k._D2_TILES_NO_AVX512}
# the low-bit decode tile's own shapes (weight rows x activation rows) at every T, and "decoded": the
# decoders' path (every weight row decoded whole, then the float32 tiles); --types Q2_K,Q3_K,IQ4_NL only
LOWBIT_TABLES = {f"{nr}x{tt}": ((nr, tt),) for nr in (1, 2, 4) for tt in range(1, lowbit._MAX_ACTS + 1)}
LOWBIT_TABLES["decoded"] = ()
# qkernels' kind numbers (float32 and int8 alike); F16 runs the float32-weight kernel, float32 only
KINDS = {QT.Q8_0: 0, QT.Q4_0: 1, QT.Q4_1: 2, QT.Q5_0: 3, QT.Q5_1: 4, QT.Q4_K: 5, QT.Q5_K: 6, QT.Q6_K: 7}
# the low-bit types whose decode steps (T ≤ lowbit._FUSED_ROWS) run a tile of their own
# (swarm/compute/lowbit.py): float32 only; a table's first shape is that tile's
LOWBIT = lowbit._FUSED


def kernels(name: str, qt, rows: int, cols: int, tables: dict, form: str = ""):
    """({table: rows kernel}, prepare(T) → call(fn, out)) for one kernel family over ``tables``
    (a low-bit type's in ``form``: lowbit.FORMS, "" its default here)."""
    if qt == QT.F16:
        w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float16).view(np.uint16)
    elif qt in LOWBIT:  # random blocks with finite scales (IQ4_NL: a random row's 80 scales are rarely all finite)
        rng = np.random.default_rng(1)
        w = _encode(rng.standard_normal((rows, cols), dtype=np.float32), qt, rng)
    else:
        w = encoded(qt, rows, cols, 1).copy()
    w.flags.writeable = False
    if qt == QT.F16:
        fns = {t: k._f32_rows_kernel("_h2f", tab) for t, tab in tables.items()}
    elif qt in LOWBIT:
        fns = {t: lowbit._rows_kernel(qt, tab[0], form, fused_rows=1 << 30) if tab
               else lowbit._rows_kernel(qt, None, form, fused_rows=0) for t, tab in tables.items()}
    elif name == "float32":
        kind = KINDS[qt]
        fns = {t: k._rows_kernel(kind, "", tab) for t, tab in tables.items()}
    else:
        kind = KINDS[qt]
        fns = {t: k._i8_rows_kernel(kind, "", tab) for t, tab in tables.items()}

    def prepare(T: int):
        x = np.random.default_rng(T).standard_normal((T, cols)).astype(np.float32)
        if qt == QT.F16:
            return lambda fn, out: fn(w, x, out, 0, 0, rows)
        if name == "float32" or qt in LOWBIT:
            return lambda fn, out: fn(w, x, out, 0, rows)
        xq = np.zeros((T, k.int8_row_bytes(kind, cols)), np.uint8)
        k.quantize(kind, x, xq)
        return lambda fn, out: fn(w, xq, out, 0, rows)
    return fns, prepare


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--t", default="1,4,8,64", help="activation rows, comma-separated")
    ap.add_argument("--reps", type=int, default=9, help="calls timed per table and T (best kept)")
    ap.add_argument("--tables", default="2xN,1xN", help="tile tables to time, comma-separated, the first the "
                    f"reference ({', '.join(TABLES)}; low-bit types: {', '.join(LOWBIT_TABLES)})")
    ap.add_argument("--form", default="", help=f"low-bit types: the decode tile's form ({', '.join(lowbit.FORMS)}; "
                    "default: this CPU's)")
    ap.add_argument("--types", default="Q4_1,Q8_0,Q4_K,Q6_K,F16",
                    help=f"weight types, comma-separated ({', '.join(q.name for q in KINDS)}; "
                         f"F16, {', '.join(q.name for q in LOWBIT)}: float32 only)")
    ap.add_argument("--numerics", default="float32,int8", help="float32, int8 or both")
    args = ap.parse_args()
    try:
        qts = [QT[n] for n in args.types.split(",")]
    except KeyError as e:
        ap.error(f"--types: unknown weight type {e}")
    if any(q not in KINDS and q != QT.F16 and q not in LOWBIT for q in qts) or not set(args.numerics.split(",")) <= {"float32", "int8"}:
        ap.error(f"--types: of {', '.join(q.name for q in (*KINDS, *LOWBIT))} and F16; --numerics: float32, int8")
    try:
        ts = [int(t) for t in args.t.split(",")]
    except ValueError:
        ap.error(f"--t: activation rows as integers, comma-separated, got {args.t!r}")
    if any(t < 1 for t in ts):
        ap.error(f"--t: each at least 1, got {args.t!r}")
    low = [q.name for q in qts if q in LOWBIT]
    names = args.tables.split(",")
    known = LOWBIT_TABLES if low else TABLES
    if low and (len(low) < len(qts) or args.numerics != "float32"):
        ap.error(f"--types {','.join(low)}: their own tiles run under float32 only, without other types "
                 "(--numerics float32)")
    if args.reps < 1:
        ap.error(f"--reps: at least 1, got {args.reps}")
    if args.form and (not low or any(args.form != "scalar" and qt not in lowbit._FORM_TYPES.get(args.form, ())
                                     for qt in qts)):
        ap.error(f"--form {args.form!r}: for low-bit types that have it here ({', '.join(lowbit.FORMS)}; "
                 f"this CPU's: { {f: [q.name for q in t] for f, t in lowbit._FORM_TYPES.items()} })")
    if any(n not in known for n in names) or len(names) < 2:
        ap.error(f"--tables: two or more of {', '.join(known)}, got {args.tables!r}")
    tables = {n: known[n] for n in names}
    print(json.dumps({"machine": _machine(), "k_form": k.K_FORM, "i8_form": k.I8_FORM, "tiles_here": k._TILES, "k_tiles_here": k._K_TILES,
                      "d2_tiles_here": k._D2_TILES}))
    cases = [(name, qt) for name in args.numerics.split(",") for qt in qts if not (name == "int8" and (qt == QT.F16 or qt in LOWBIT))]
    for name, qt in cases:
        rows = 1024 if qt == QT.F16 else 4096
        fns, prepare = kernels(name, qt, rows, 2560, tables, args.form)
        for T in ts:
            call = prepare(T)
            outs = {t: np.full((T, rows), np.nan, np.float32) for t in fns}
            best = {t: float("inf") for t in fns}
            for t, fn in fns.items():
                call(fn, outs[t])  # compiles
            for _ in range(args.reps):
                for t, fn in fns.items():
                    t0 = time.perf_counter()
                    call(fn, outs[t])
                    best[t] = min(best[t], time.perf_counter() - t0)
            ref = names[0]
            print(json.dumps({"numerics": name, "type": qt.name, "T": T, **{f"{t}_ms": round(best[t] * 1e3, 3) for t in fns},
                              **{f"ratio_{t}_{ref}": round(best[t] / best[ref], 3) for t in names[1:]},
                              "same_bits": all(bool((outs[t].view(np.uint32) == outs[ref].view(np.uint32)).all()) for t in names[1:])}),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
