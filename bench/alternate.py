"""Do a model's layers run slower when two processes take turns, as two stages on one machine do?

    python3 bench/alternate.py MODEL [--split 5] [--steps 30] [--cycles 12]

Prints JSON, milliseconds per layer of one decode row (per mode, the median over cycles of
each cycle's median step; min and max in brackets):

- ``local``: every layer in this process, one step after the other (the reference);
- ``alternating``: layers ``0..split`` here and ``split..L`` in a second process, handing the
  row over a pipe each step — two stages without a network, event loop or peer around them —
  with the processes free to run on any CPU (``alternating``), held on two CPUs
  (``alternating_two_cpus``) or on one (``alternating_one_cpu``); only this process's layers
  are timed;
- ``local_after_other_stage``: as ``local``, each step followed (untimed) by the second
  process's layers of the ``alternating`` mode — what a local step paired with a stage step
  meets (bench/swarm.py's run_paired).

Every cycle runs each mode once, in turn, so a change in the machine's speed (on a shared
machine it swings by a third within seconds) hits every mode alike; one mode measured in a
block a minute apart from another says little. Nothing here is imported by the product.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from multiprocessing import Pipe, Process
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("local", "alternating", "alternating_two_cpus", "alternating_one_cpu", "local_after_other_stage")


def _load(path: str):
    from swarm.compute.model import load_model

    model = load_model(path)
    model.materialize()
    return model


def _other_stage(conn, path: str, lo: int, hi: int, cpus: set[int]) -> None:
    """The second process: layers lo..hi of each row it is handed, on ``cpus``."""
    os.sched_setaffinity(0, cpus)
    model = _load(path)
    cache = None
    while (msg := conn.recv()) is not None:
        if msg == "new":
            cache = model.new_cache(1024)
            continue
        x, pos = msg
        y = model.layers(x, cache, pos, lo, hi, None)
        cache.length = pos + 1
        conn.send(y)


def _cycle_step_ms(model, split: int, steps: int, conn, whole: bool = False) -> float:
    """Median ms per layer of this process's layers over ``steps`` positions: 0..split, or all
    of them when ``conn`` is None or ``whole``; each row is then handed to the other process."""
    n_layers = model.config.n_layers
    hi = n_layers if conn is None or whole else split
    x = np.random.default_rng(0).standard_normal((1, model.config.hidden_size)).astype(np.float32)
    cache, times = model.new_cache(steps + 1), []
    if conn is not None:
        conn.send("new")
    for pos in range(steps):
        t = time.perf_counter()
        y = model.layers(x, cache, pos, 0, hi, None)
        times.append(time.perf_counter() - t)
        cache.length = pos + 1
        if conn is not None:
            conn.send((y, pos))
            conn.recv()
    return 1e3 * statistics.median(times[2:]) / hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a model file or directory")
    ap.add_argument("--split", type=int, default=None, help="first layer of the second stage (default: half)")
    ap.add_argument("--steps", type=int, default=30, help="decode positions per mode and cycle")
    ap.add_argument("--cycles", type=int, default=12)
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("needs two CPUs")
    model = _load(args.model)
    n_layers = model.config.n_layers
    split = n_layers // 2 if args.split is None else args.split
    if not 0 < split < n_layers:
        raise SystemExit(f"--split must be within 1..{n_layers - 1}, got {split}")
    if args.steps < 4 or args.cycles < 1:
        raise SystemExit("--steps must be at least 4 and --cycles at least 1")
    # the other process of each alternating mode, and where this one runs meanwhile
    placement = {"alternating": (set(cpus), set(cpus)), "alternating_two_cpus": ({cpus[0]}, {cpus[1]}),
                 "alternating_one_cpu": ({cpus[0]}, {cpus[0]})}
    others, procs = {}, []
    for mode, (_, theirs) in placement.items():
        ours, their_end = Pipe()
        proc = Process(target=_other_stage, args=(their_end, args.model, split, n_layers, theirs))
        proc.start()
        others[mode], procs = ours, procs + [proc]
    ms: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.cycles):
        for mode in MODES:
            os.sched_setaffinity(0, placement[mode][0] if mode in placement else set(cpus))
            other = others["alternating"] if mode == "local_after_other_stage" else others.get(mode)
            ms[mode].append(_cycle_step_ms(model, split, args.steps, other, whole=mode.startswith("local")))
    for conn in others.values():
        conn.send(None)
    for proc in procs:
        proc.join()
    local = statistics.median(ms["local"])
    print(json.dumps({
        "model": args.model, "layers": n_layers, "split": split, "steps": args.steps, "cycles": args.cycles,
        "ms_per_layer": {m: [round(statistics.median(v), 3), round(min(v), 3), round(max(v), 3)] for m, v in ms.items()},
        "vs_local": {m: round(statistics.median(v) / local, 3) for m, v in ms.items() if m != "local"},
    }, indent=1))


if __name__ == "__main__":
    main()
