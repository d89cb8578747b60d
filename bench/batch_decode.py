"""Batched decode on one peer: a decode step of N sequences against a step of one; prints JSON.

    python3 bench/batch_decode.py [--model PATH] [--batches 1,2,4,8] [--threads 1] [--steps 3]

Each of N sequences first reads a 16-token prompt; then decode steps of one token for every
sequence run through ``Model.forward_batch`` (what the batch scheduler does each step), and the
best of 3 rounds of ``--steps`` steps is kept, in CPU time of the calling thread (with one thread;
wall time otherwise). ``tokens_per_s_vs_1`` is N sequences' tokens per second over one
sequence's: the gain of serving N streams at once (the target for 4 is ≥ 3).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # engine.py's _machine


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file or HF directory (default: the default model)")
    ap.add_argument("--batches", default="1,2,4,8", help="sequences per step, comma-separated")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="decode steps per round")
    args = ap.parse_args()

    import numpy as np

    from engine import _machine

    from swarm.compute import numerics, quant, threads
    from swarm.compute.default_model import default_model_path
    from swarm.compute.model import load_model

    threads.set_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    path = args.model or str(default_model_path())
    model = load_model(path)
    rng = np.random.default_rng(0)
    steps: dict[int, float] = {}
    for n in (int(b) for b in args.batches.split(",")):
        caches = [model.new_cache() for _ in range(n)]
        model.forward_batch([(rng.integers(100, 1000, 16).tolist(), c) for c in caches])
        parts = lambda: [([5], c) for c in caches]  # noqa: E731
        model.forward_batch(parts())  # warm: every weight this step reads is mapped in
        best = float("inf")
        for _ in range(3):
            t0 = clock()
            for _ in range(args.steps):
                model.forward_batch(parts())
            best = min(best, (clock() - t0) / args.steps)
        steps[n] = best
    one = steps[min(steps)] / min(steps)
    k = quant._kernels()
    print(json.dumps({
        "model": Path(path).name, "threads": args.threads, "clock": "thread CPU" if args.threads == 1 else "wall",
        "numerics": numerics.numerics(), "machine": _machine(),
        **{name: [list(t) for t in table] for name, table in (("tiles", k._TILES), ("k_tiles", k._K_TILES), ("d2_tiles", k._D2_TILES))},
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "step_ms": {n: round(1e3 * s, 2) for n, s in steps.items()},
        "step_vs_one": {n: round(s / steps[min(steps)], 2) for n, s in steps.items()},
        "tokens_per_s_vs_1": {n: round(n * one / s, 2) for n, s in steps.items()},
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
