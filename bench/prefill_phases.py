"""Where a prefill's wall time goes, per thread count: the grouped block-kernel products against
everything else (attention, RoPE, norms, quantizing activation rows, Python between them).

    python3 bench/prefill_phases.py --model dense_Q4_K_M.gguf --threads 1,4,16 --numerics float32,int8

Each (numerics, threads, spin) case runs in its own process: the model is loaded, warmed, and a
prompt of ``--prompt-tokens`` is prefilled ``--repeats`` times; the best run is kept. Timers wrap
the Python entry points named in ``PHASES`` (wall seconds on the calling thread, summed over the
run). ``products`` is the grouped products' wall time; ``rest`` is the prefill less every phase,
the part no phase names; ``groups_s`` splits the products by group (each product's weight rows x
columns, "+" between a group's products: which shapes scale). Prints JSON: the machine, then one record per case with each phase's
seconds and its share of the prefill. With ``--spin both`` each thread count ≥ 2 also runs with the
spinning workers off and on (``COLIBRI_SWARM_SPIN=0/1``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if sys.path and Path(sys.path[0]).resolve() == REPO / "bench":
    sys.path[0] = str(REPO)  # bench/swarm.py would shadow the package

# (module, attribute, phase): the calls timed. A phase inside another's call (a group's quantizing
# inside the products) is taken off the outer one.
PHASES = (
    ("swarm.compute.quant", "run_table", "products"),
    ("swarm.compute.model", "attention", "attention"),
    ("swarm.compute.model", "apply_rope_swapped", "rope"),
    ("swarm.compute.model", "rms_norm", "rms_norm"),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--numerics", default="float32", help="float32, int8 or both, comma-separated")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--spin", choices=("default", "both"), default="default",
                    help="both: every thread count ≥ 2 also with the spinning workers off and on")
    ap.add_argument("--_case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._case:
        return _case(args)
    if not Path(args.model).is_file():
        ap.error(f"--model {args.model!r} is not a file")
    counts = [int(n) for n in args.threads.split(",")]
    kinds = args.numerics.split(",")
    if any(n < 1 for n in counts) or any(k not in ("float32", "int8") for k in kinds):
        ap.error("--threads takes counts ≥ 1, --numerics float32 and/or int8")
    print(json.dumps({"machine": _machine()}), flush=True)
    for kind in kinds:
        for n in counts:
            for spin in (("0", "1") if args.spin == "both" and n > 1 else ("",)):
                env = dict(os.environ, COLIBRI_SWARM_THREADS=str(n), COLIBRI_SWARM_NUMERICS=kind,
                           PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
                if spin:
                    env["COLIBRI_SWARM_SPIN"] = spin
                else:
                    env.pop("COLIBRI_SWARM_SPIN", None)
                cmd = [sys.executable, __file__, "--model", args.model, "--prompt-tokens", str(args.prompt_tokens),
                       "--repeats", str(args.repeats), "--_case", f"{kind},{n},{spin or 'default'}"]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    print(json.dumps({"numerics": kind, "threads": n, "spin": spin or "default",
                                      "error": done.stderr[-2000:]}), flush=True)
                    continue
                print(done.stdout.strip().splitlines()[-1], flush=True)
    return 0


def _machine() -> dict:
    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        keep = ("Model name", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "L2 cache", "L3 cache")
        info["lscpu"] = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in out.splitlines())
                         if k.strip() in keep}
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def _case(args: argparse.Namespace) -> int:
    import importlib

    kind, n, spin = args._case.split(",")
    from swarm.compute import SamplingParams, generate, load_model, numerics

    numerics.set_numerics(kind)
    model = load_model(args.model)
    if hasattr(model, "materialize"):
        model.materialize()
    ids = list(range(1000, 1000 + args.prompt_tokens))
    list(generate(model, ids[:8], SamplingParams(max_tokens=2)))  # compile or load, warm
    totals: dict[str, float] = {}
    depth = [0]

    def timed(fn, phase):
        def wrapper(*a, **kw):
            if depth[0]:  # inside another timed call: counted there
                return fn(*a, **kw)
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                totals[phase] = totals.get(phase, 0.0) + time.perf_counter() - t0
                depth[0] -= 1
        return wrapper

    for module, attr, phase in PHASES:
        mod = importlib.import_module(module)
        setattr(mod, attr, timed(getattr(mod, attr), phase))
    from swarm.compute import qkernels

    group = qkernels.int8_group

    def quantizing(*a):  # inside ``products``: moved out of it below (where the group's first
        t0 = time.perf_counter()  # tiles quantize, only the table's making)
        try:
            return group(*a)
        finally:
            totals["quantize"] = totals.get("quantize", 0.0) + time.perf_counter() - t0
    qkernels.int8_group = quantizing
    from swarm.compute import quant

    by_group: dict[str, list[float]] = {}  # a group's products (rows x cols each) -> [calls, seconds]
    run_table = quant.run_table

    def group_timed(table, first, work):  # the products' wall time per group shape
        key = "+".join(f"{r}x{c}" for r, c in zip(table[:, qkernels.W_ROWS], table[:, qkernels.K]))
        if len(key) > 60:  # many experts: their count and one's shape
            key = f"{len(table)}x{table[0, qkernels.W_ROWS]}x{table[0, qkernels.K]}"
        t0 = time.perf_counter()
        try:
            return run_table(table, first, work)
        finally:
            entry = by_group.setdefault(key, [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - t0
    quant.run_table = group_timed
    best: dict | None = None
    for _ in range(args.repeats):
        totals.clear()
        by_group.clear()
        steps = generate(model, ids, SamplingParams(max_tokens=1), cache=model.new_cache(len(ids) + 2))
        t0, c0 = time.perf_counter(), time.process_time()
        next(steps)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if best is None or wall < best["prefill_s"]:
            if "quantize" in totals:
                totals["products"] -= totals["quantize"]
            named = sum(totals.values())
            best = {"prefill_s": round(wall, 4), "cpu_s": round(cpu, 3),
                    "tok_s": round(len(ids) / wall, 1),
                    "phases_s": {**{k: round(v, 4) for k, v in sorted(totals.items())}, "rest": round(wall - named, 4)},
                    "phases_share": {**{k: round(v / wall, 3) for k, v in sorted(totals.items())},
                                     "rest": round((wall - named) / wall, 3)},
                    "groups_s": {k: {"calls": c, "s": round(v, 4)} for k, (c, v) in sorted(by_group.items())}}
    print(json.dumps({"numerics": kind, "threads": int(n), "spin": spin, "prompt_tokens": len(ids), **(best or {})}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
