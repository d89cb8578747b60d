"""Where a prefill's wall time goes, per thread count: the grouped block-kernel products against
everything else (attention, RoPE, norms, quantizing activation rows, Python between them).

    python3 bench/prefill_phases.py --model dense_Q4_K_M.gguf --threads 1,4,16 --numerics float32,int8
    python3 bench/prefill_phases.py --model moe_Q4_K_M.gguf --threads 1,4,16 --decode-tokens 32

Each (numerics, threads, spin) case runs in its own process: the model is loaded, warmed, and a
prompt of ``--prompt-tokens`` is prefilled ``--repeats`` times with no timer in place (the best,
``prefill_s_untimed``), then ``--repeats`` times again with timers wrapping the Python entry
points named in ``PHASES`` (wall seconds on the calling thread, summed over the run); the best
timed run is kept, and ``timers_s`` is what it took longer than the untimed one (the timers'
Python runs on the calling thread, between the kernels: it lands in the phases around them and
in ``rest``). ``products`` is the grouped products' wall time; ``rest`` is the prefill less
every phase, the part no phase names; ``groups_s`` splits the products by group (each product's
weight rows x columns, "+" between a group's products: which shapes scale). Prints JSON: the
machine, then one record per case with each phase's seconds and its share of the prefill. With
``--spin both`` each thread count ≥ 2 also runs with the spinning workers off and on
(``COLIBRI_SWARM_SPIN=0/1``). With ``--decode-tokens N`` the same for decode instead: the prompt
is prefilled untimed, then N greedy steps of one token each are timed (the phases summed over
them); ``decode_s`` is a step's mean, the phases per step. The decode path's products (its group
tables) count as ``products`` and in ``groups_s``, routing (``route_row``, or ``route`` on the
general path) as ``route``, and a MoE layer's step as ``moe_step`` without the two: its router
product, the activation, the weighted sum, Python. ``--former-attention`` runs every case with a
decode row's attention kept on the calling thread below twice the Python pool's threshold, the
rule before ``kernels.SPIN_ATTENTION_WORK`` (the reference of that A/B).
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
# --decode-tokens: the decode path's own steps (swarm/compute/decode.py), timed as phases too.
DECODE_PHASES = (
    ("swarm.compute.decode", "_MoE.__call__", "moe_step"),
    ("swarm.compute.decode", "_Dense.__call__", "dense_step"),
    ("swarm.compute.decode", "run_table", "products"),
    ("swarm.compute.rowkernels", "attention", "attention"),
    ("swarm.compute.kernels", "attention", "attention"),
    ("swarm.compute.rowkernels", "rms_norm", "rms_norm"),
    ("swarm.compute.rowkernels", "add_rms_norm", "rms_norm"),
    ("swarm.compute.rowkernels", "qk_rope_row", "rope"),
    ("swarm.compute.rowkernels", "route_row", "route"),
    ("swarm.compute.ffn", "route", "route"),
)
NESTED = ("products", "route")  # timed also inside another phase, which then counts without them


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("--numerics", default="float32", help="float32, int8 or both, comma-separated")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=0,
                    help="time this many decode steps after an untimed prefill, instead of the prefill")
    ap.add_argument("--spin", choices=("default", "both"), default="default",
                    help="both: every thread count ≥ 2 also with the spinning workers off and on")
    ap.add_argument("--tiles-per-thread", default="4",
                    help="a group's tiles a thread, comma-separated (4: the engine's own; 8 halves every "
                         "tile below the 1 MiB cap, the floor included): how finely the threads share a product")
    ap.add_argument("--former-attention", action="store_true",
                    help="the reference of an A/B: a decode row's attention kept on the calling thread below "
                         "twice the Python pool's threshold, as before SPIN_ATTENTION_WORK")
    ap.add_argument("--_case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._case:
        return _case(args)
    if not Path(args.model).is_file():
        ap.error(f"--model {args.model!r} is not a file")
    try:
        counts = [int(n) for n in args.threads.split(",")]
        tilings = [int(n) for n in args.tiles_per_thread.split(",")]
    except ValueError:
        ap.error("--threads and --tiles-per-thread take comma-separated integers")
    kinds = args.numerics.split(",")
    if any(n < 1 for n in counts + tilings) or any(k not in ("float32", "int8") for k in kinds):
        ap.error("--threads and --tiles-per-thread take counts ≥ 1, --numerics float32 and/or int8")
    print(json.dumps({"machine": _machine()}), flush=True)
    for kind, n, tiles in ((k, n, t) for k in kinds for n in counts for t in tilings):
        for spin in (("0", "1") if args.spin == "both" and n > 1 else ("",)):
            env = dict(os.environ, COLIBRI_SWARM_THREADS=str(n), COLIBRI_SWARM_NUMERICS=kind,
                       PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            if spin:
                env["COLIBRI_SWARM_SPIN"] = spin
            else:
                env.pop("COLIBRI_SWARM_SPIN", None)
            cmd = [sys.executable, __file__, "--model", args.model, "--prompt-tokens", str(args.prompt_tokens),
                   "--repeats", str(args.repeats), "--decode-tokens", str(args.decode_tokens),
                   *(["--former-attention"] if args.former_attention else []),
                   "--_case", f"{kind},{n},{spin or 'default'},{tiles}"]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                print(json.dumps({"numerics": kind, "threads": n, "spin": spin or "default",
                                  "tiles_per_thread": tiles, "error": done.stderr[-2000:]}), flush=True)
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

    kind, n, spin, tiles = args._case.split(",")
    from swarm.compute import SamplingParams, generate, load_model, numerics, quant, threads

    if int(tiles) != 4:  # quant._tile_bytes with `tiles` a thread where it gives 4, its floor scaled alike
        def tile_bytes(work: float, per: int = int(tiles)) -> float:
            return min(quant.MAX_TILE_BYTES, max(quant.GROUP_TILE_BYTES * 4 / per, work / (per * threads.threads())))
        quant._tile_bytes = tile_bytes

    numerics.set_numerics(kind)
    if args.former_attention:
        from swarm.compute import kernels

        kernels.SPIN_ATTENTION_WORK = 2 * kernels.MIN_ATTENTION_WORK
    model = load_model(args.model)
    if hasattr(model, "materialize"):
        model.materialize()
    ids = list(range(1000, 1000 + args.prompt_tokens))
    list(generate(model, ids[:8], SamplingParams(max_tokens=2)))  # compile or load, warm
    n_steps = args.decode_tokens or 1
    key = "decode_s" if args.decode_tokens else "prefill_s"

    def one_run(on_steps=None) -> tuple[float, float]:
        """(wall, CPU) seconds a step (decode) or of the prefill, of one run; ``on_steps`` called first."""
        steps = generate(model, ids, SamplingParams(max_tokens=args.decode_tokens + 1, stop_tokens=()),
                         cache=model.new_cache(len(ids) + args.decode_tokens + 2))
        if args.decode_tokens:
            next(steps)  # the prefill, untimed
        if on_steps is not None:
            on_steps()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n_steps):
            next(steps)
        return (time.perf_counter() - t0) / n_steps, (time.process_time() - c0) / n_steps

    # The same runs with no timer in place first: what the timers themselves cost is then the
    # difference (their Python runs on the calling thread, between the kernels it times).
    plain = min(one_run()[0] for _ in range(args.repeats))
    totals: dict[str, float] = {}
    stack: list[str] = []  # the phases running now, outermost first

    def timed(fn, phase):
        def wrapper(*a, **kw):
            if stack and phase not in NESTED:  # inside another timed call: counted there
                return fn(*a, **kw)
            stack.append(phase)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                stack.pop()
                totals[phase] = totals.get(phase, 0.0) + dt
                if stack:  # the outer phase counts without this one
                    totals[stack[-1]] = totals.get(stack[-1], 0.0) - dt
        return wrapper

    from swarm.compute import qkernels, quant

    by_group: dict[str, list[float]] = {}  # a group's products (rows x cols each) -> [calls, seconds]
    names: dict[bytes, str] = {}  # a table's (rows, cols) column bytes -> its group's name, made once

    def group_name(table) -> str:
        shapes = table[:, [qkernels.W_ROWS, qkernels.K]]
        name = names.get(sig := shapes.tobytes())
        if name is None:
            name = "+".join(f"{r}x{c}" for r, c in shapes.tolist())
            if len(name) > 60:  # many experts: their count and one's shape
                name = f"{len(table)}x{shapes[0, 0]}x{shapes[0, 1]}"
            names[sig] = name
        return name

    def group_timed(run):  # ``run`` (a run_table) timed per group shape; wrapped by the products' timer
        def wrapper(table, first, work):
            t0 = time.perf_counter()
            try:
                return run(table, first, work)
            finally:
                entry = by_group.setdefault(group_name(table), [0, 0.0])
                entry[0] += 1
                entry[1] += time.perf_counter() - t0
        return wrapper

    quant.run_table = group_timed(quant.run_table)
    if args.decode_tokens:  # the decode path's tables too (decode.py took run_table by name)
        from swarm.compute import decode

        decode.run_table = group_timed(decode.run_table)
    for module, attr, phase in PHASES + (DECODE_PHASES if args.decode_tokens else ()):
        owner = importlib.import_module(module)
        *path, name = attr.split(".")
        for part in path:  # a class's method: wrapped on the class
            owner = getattr(owner, part)
        setattr(owner, name, timed(getattr(owner, name), phase))

    group = qkernels.int8_group

    def quantizing(*a):  # inside ``products``: moved out of it below (where the group's first
        t0 = time.perf_counter()  # tiles quantize, only the table's making)
        try:
            return group(*a)
        finally:
            totals["quantize"] = totals.get("quantize", 0.0) + time.perf_counter() - t0
    qkernels.int8_group = quantizing
    best: dict | None = None
    for _ in range(args.repeats):
        def reset() -> None:
            totals.clear()
            by_group.clear()
        wall, cpu = one_run(reset)
        for k in totals:
            totals[k] /= n_steps
        if best is None or wall < best[key]:
            if "quantize" in totals:
                totals["products"] -= totals["quantize"]
            named = sum(totals.values())
            digits = 5 if args.decode_tokens else 4
            best = {key: round(wall, digits), "cpu_s": round(cpu, 4),
                    # the same without timers; the timers' own cost is in "rest" (and the phases around them)
                    f"{key}_untimed": round(plain, digits), "timers_s": round(wall - plain, digits),
                    "tok_s": round((1 if args.decode_tokens else len(ids)) / wall, 1),
                    "phases_s": {**{k: round(v, 4) for k, v in sorted(totals.items())}, "rest": round(wall - named, 4)},
                    "phases_share": {**{k: round(v / wall, 3) for k, v in sorted(totals.items())},
                                     "rest": round((wall - named) / wall, 3)},
                    "groups_s": {k: {"calls": round(c / n_steps, 2), "s": round(v / n_steps, 5)}  # a step's
                                 for k, (c, v) in sorted(by_group.items())}}
    print(json.dumps({"numerics": kind, "threads": int(n), "spin": spin, "tiles_per_thread": int(tiles),
                      **({"former_attention": True} if args.former_attention else {}),
                      "prompt_tokens": len(ids),
                      **({"decode_tokens": args.decode_tokens} if args.decode_tokens else {}), **(best or {})}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
