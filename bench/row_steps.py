"""The steps around a prefill's products, called alone: attention and RMSNorm at Qwen3-4B's shape
(32 query heads, 8 key/value heads of 128 dims, hidden 2560), per thread count; one JSON line each.

    python3 bench/row_steps.py --threads 1,2,16
    COLIBRI_SWARM_SPIN=1 python3 bench/row_steps.py --threads 2

Each call runs ``--calls`` times back to back on random float32 inputs (contiguous, as the kernels
take them once the caller has copied a strided view); the median is printed in µs: attention of
64 queries at positions 0… and 448…, RMSNorm of 64 rows of 2560, and of 64 × 40 heads of 128
with one weight per head (Qwen3's stacked q/k norm). With spinning workers (``COLIBRI_SWARM_SPIN``,
swarm/compute/spin.py) attention and RMSNorm take their items there, else the Python pool.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if sys.path and Path(sys.path[0]).resolve() == REPO / "bench":
    sys.path[0] = str(REPO)  # bench/swarm.py would shadow the package

F32 = np.float32
T, NH, NKV, HD, H = 64, 32, 8, 128, 2560


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    from swarm.compute import kernels, spin, threads

    kernels.prepare_row_kernels()
    rng = np.random.default_rng(0)
    q = rng.standard_normal((T, NH, HD), dtype=F32) * F32(HD ** -0.5)
    k, v = (rng.standard_normal((NKV, 512, HD), dtype=F32) for _ in range(2))
    x, w = rng.standard_normal((T, H), dtype=F32), rng.standard_normal(H, dtype=F32)
    heads, head_w = rng.standard_normal((T, NH + NKV, HD), dtype=F32), rng.standard_normal((NH + NKV, HD), dtype=F32)
    steps = {"attention_T64_at0": lambda: kernels.attention(q, k, v, 0),
             "attention_T64_at448": lambda: kernels.attention(q, k, v, 448),
             "rms_norm_64x2560": lambda: kernels.rms_norm(x, w, 1e-6),
             "rms_norm_heads_64x40x128": lambda: kernels.rms_norm(heads, head_w, 1e-6)}
    for n in (int(c) for c in args.threads.split(",")):
        threads.set_threads(n)
        medians = {}
        for name, step in steps.items():
            step()
            times = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            medians[name] = round(sorted(times)[len(times) // 2] * 1e6, 1)
        print(json.dumps({"threads": n, "spinning_workers": spin.wanted(n), "median_us": medians}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
