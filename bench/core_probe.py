"""One core's speed alone against the same with other cores busy: prints one JSON line.

    taskset -c 0 python3 bench/core_probe.py clock|float32|int8
    for c in $(seq 0 15); do taskset -c $c python3 bench/core_probe.py int8 & done; wait
    taskset -c 0-3 python3 bench/core_probe.py int8 4    # 4 threads of one process

``clock``: a dependent chain of 2·10⁸ float64 multiplies and adds (seconds; its latency fixes the
cycles a step, so the time follows the core's clock). ``float32`` / ``int8``: the engine's Q4_K
product of 9728×2560 random blocks (Qwen3-4B's MLP shape) at T = 64 activation rows on one
thread under that numerics (swarm/compute/numerics.py), the best of ``$REPS`` (15) runs in ms.
Run one process, then one per core at once: a kernel whose time grows when every core runs it,
while the clock's does not, is held back by something the cores share (power, caches, memory),
not by its thread hand-off.

With a thread count after the numerics, the same product runs in this one process on that many
threads, once per tile size (``$TILES``, comma-separated KiB of work a tile; "each": a thread's
share of the work a tile, about one range of rows a thread): a product that scales worse on N
threads of one process than N processes do is held back by how its threads share the work (tile
size, their streams), not by the cores.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == REPO / "bench":
    sys.path[0] = str(REPO)  # bench/swarm.py would shadow the package


def _clock_chain(n: int) -> float:
    from numba import njit

    @njit
    def chain(n):
        x = 1.0
        for _ in range(n):
            x = x * 1.0000001 + 1e-9
        return x
    chain(1000)
    t = time.perf_counter()
    chain(n)
    return time.perf_counter() - t


def main() -> int:
    what = sys.argv[1] if len(sys.argv) in (2, 3) else ""
    given = sys.argv[2] if len(sys.argv) == 3 else "1"
    n_threads = int(given) if given.isdigit() else 0
    if what not in ("clock", "float32", "int8") or n_threads < 1 or (len(sys.argv) == 3 and what == "clock"):
        print("usage: core_probe.py clock|float32|int8 [THREADS]", file=sys.stderr)
        return 2
    out: dict = {"what": what, "cpus": sorted(os.sched_getaffinity(0))}
    if what == "clock":
        out["clock_s"] = round(_clock_chain(200_000_000), 4)
    else:
        from gguf import GGMLQuantizationType as QT

        from swarm.compute import numerics, threads
        from swarm.compute.quant import QMatrix

        from swarm.compute import quant

        numerics.set_numerics(what)
        threads.set_threads(n_threads)
        rows, cols = 9728, 2560
        blocks = np.random.default_rng(0).integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
        scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        blocks[:, :, 0:2] = scale  # d and dmin: finite
        blocks[:, :, 2:4] = scale
        m = QMatrix(blocks.reshape(rows, -1), QT.Q4_K, cols)
        x = np.random.default_rng(1).standard_normal((64, cols)).astype(np.float32)
        def best_ms() -> float:
            m.matmul(x)
            best = float("inf")
            for _ in range(int(os.environ.get("REPS", "15"))):
                t = time.perf_counter()
                m.matmul(x)
                best = min(best, time.perf_counter() - t)
            return best * 1e3
        if n_threads == 1:
            ms = best_ms()
            out["matmul_T64_ms"] = round(ms, 3)
            out["gflops"] = round(2 * 64 * rows * cols / ms / 1e6, 1)
        else:
            work = rows * m.data.shape[1] * (3 + 64) / 4  # as quant.group_table weighs a tile
            out["threads"], out["spin"], out["by_tile_kib"] = n_threads, os.environ.get("COLIBRI_SWARM_SPIN", ""), {}
            for size in os.environ.get("TILES", "48,256,1024,4096,each").split(","):
                tile = work / n_threads + 1 if size == "each" else int(size) * 1024
                quant._tile_bytes = lambda work, tile=tile: tile  # noqa: E731 - the group's tiles only
                out["by_tile_kib"][size] = round(best_ms(), 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
