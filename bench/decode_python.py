"""CPU time of a decode token and how much of it is spent outside the compiled kernels.

    COLIBRI_SWARM_THREADS=1 python3 bench/decode_python.py MODEL.gguf [--profile]

Decodes 64 tokens after a 16-token prompt three times; prints the CPU ms per token of each run
(process time: steady on a loaded machine), then from a profile of the last run (profiler timer:
process CPU time) the kernels' CPU ms per token, the rest of the faster unprofiled run (the Python
between the kernels) and the Python calls per token. ``--profile``: the profile's top entries too."""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package, not bench/swarm.py
from swarm.compute import SamplingParams, generate, load_model  # noqa: E402

KERNELS = ("run_group", "matmul", "matmul_f32", "matmul_half", "attention")


def main() -> None:
    model = load_model(sys.argv[1])
    model.materialize()
    prompt = list(range(100, 116))
    list(generate(model, prompt[:8], SamplingParams(max_tokens=4)))
    fastest = float("inf")
    for profiled in (False, False, True):
        steps = generate(model, prompt, SamplingParams(max_tokens=65), cache=model.new_cache(128))
        next(steps)
        profile = cProfile.Profile(time.process_time) if profiled else None
        c0 = time.process_time()
        if profile:
            profile.enable()
        n = len(list(steps))
        if profile:
            profile.disable()
        cpu = (time.process_time() - c0) / n * 1e3
        print(f"ms/token cpu {cpu:.2f}" + (" (profiled)" if profile else ""))
        fastest = min(fastest, cpu)
        if profile:
            stats = pstats.Stats(profile)
            kernel = sum(v[2] for k, v in stats.stats.items()  # type: ignore[attr-defined]
                         if k[2] in KERNELS and ("qkernels" in k[0] or "rowkernels" in k[0])) / n * 1e3
            calls = sum(v[1] for v in stats.stats.values()) / n  # type: ignore[attr-defined]
            print(f"kernel ms/token {kernel:.2f}, rest {fastest - kernel:.2f}, python calls/token {calls:.0f}")
            if "--profile" in sys.argv:
                stats.sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
