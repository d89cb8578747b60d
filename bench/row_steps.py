"""The steps around a prefill's products, called alone: attention and RMSNorm at Qwen3-4B's shape
(32 query heads, 8 key/value heads of 128 dims, hidden 2560), per thread count; one JSON line each.

    python3 bench/row_steps.py --threads 1,2,16
    COLIBRI_SWARM_SPIN=1 python3 bench/row_steps.py --threads 2

Each step runs ``--calls`` times, in ten runs of a tenth taken in turn with the other steps'
runs (each run meets the caches it leaves itself, and the machine's moments fall on every step
alike), on random float32 inputs (contiguous, as the kernels take them once the caller has
copied a strided view); the median is printed in µs: attention of 64 queries at positions 0…
and 448…, RMSNorm of 64 rows of 2560, and of 64 × 40 heads of 128 with one weight per head
(Qwen3's stacked q/k norm). With spinning workers (``COLIBRI_SWARM_SPIN``, swarm/compute/spin.py)
attention and RMSNorm take their items there, else the Python pool. A decode row's attention
(one query at position 100, and at 2047) is timed twice: as the engine runs it, and kept whole
on the calling thread below twice the Python pool's threshold (``_whole``: what a decode row's
attention did before ``SPIN_ATTENTION_WORK``).
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
    kd, vd = (rng.standard_normal((NKV, 2048, HD), dtype=F32) for _ in range(2))
    q1 = q[:1]
    spin_work = kernels.SPIN_ATTENTION_WORK

    def whole(start: int) -> None:  # the former rule: shared from twice the Python pool's threshold
        kernels.SPIN_ATTENTION_WORK = 2 * kernels.MIN_ATTENTION_WORK
        try:
            kernels.attention(q1, kd, vd, start)
        finally:
            kernels.SPIN_ATTENTION_WORK = spin_work

    for start in (100, 2047):
        steps[f"attention_T1_at{start}"] = lambda start=start: kernels.attention(q1, kd, vd, start)
        steps[f"attention_T1_at{start}_whole"] = lambda start=start: whole(start)
    for n in (int(c) for c in args.threads.split(",")):
        threads.set_threads(n)
        medians = {}
        times: dict[str, list[float]] = {name: [] for name in steps}
        block = max(1, args.calls // 10)
        for _ in range(0, args.calls, block):  # runs of `block` calls of each step in turn: every step
            for name, step in steps.items():  # meets the caches it leaves itself, and the machine's moments alike
                step()
                for _ in range(block):
                    t0 = time.perf_counter()
                    step()
                    times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            medians[name] = round(sorted(ts)[len(ts) // 2] * 1e6, 1)
        print(json.dumps({"threads": n, "spinning_workers": spin.wanted(n), "median_us": medians}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
