"""Do a model's layers run slower when two processes take turns, as two stages on one machine do?

    python3 bench/alternate.py MODEL [--split 5] [--steps 60]

Prints JSON, milliseconds per layer of one decode row (medians over ``--steps`` positions):

- ``local``: every layer in this process, one step after the other (the reference, run first
  and again last);
- ``alternating``: layers ``0..split`` here and ``split..L`` in a second process, handing the
  row over a pipe each step — two stages without a network, event loop or peer around them;
- ``own_then_idle``: layers ``0..split`` here, then 6 ms asleep each step (a core left idle
  while the other stage computes).

If ``alternating`` matches ``local``, a slower layer under the swarm's stages comes from the
peers' surroundings (threads, the event loop, set-up), not from two processes sharing the
machine's caches. Nothing here is imported by the product.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from multiprocessing import Pipe, Process
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _load(path: str):
    from swarm.compute.model import load_model

    model = load_model(path)
    model.materialize()
    return model


def _steps(model, lo: int, hi: int, n: int, between=None) -> list[float]:
    """Seconds per step of one row through layers lo..hi at positions 0..n-1."""
    x = np.random.default_rng(0).standard_normal((1, model.config.hidden_size)).astype(np.float32)
    cache, out = model.new_cache(n + 1), []
    for pos in range(n):
        t = time.perf_counter()
        y = model.layers(x, cache, pos, lo, hi, None)
        out.append(time.perf_counter() - t)
        cache.length = pos + 1
        if between:
            between(y, pos)
    return out


def _other_stage(conn, path: str, lo: int, hi: int) -> None:
    model = _load(path)
    cache, times = model.new_cache(1024), []
    while (msg := conn.recv()) is not None:
        x, pos = msg
        t = time.perf_counter()
        y = model.layers(x, cache, pos, lo, hi, None)
        times.append(time.perf_counter() - t)
        cache.length = pos + 1
        conn.send(y)
    conn.send(times)


def _ms_per_layer(seconds: list[float], layers: int) -> float:
    return round(1e3 * statistics.median(seconds[1:]) / layers, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a model file or directory")
    ap.add_argument("--split", type=int, default=None, help="first layer of the second stage (default: half)")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    model = _load(args.model)
    n_layers = model.config.n_layers
    split = n_layers // 2 if args.split is None else args.split
    if not 0 < split < n_layers:
        raise SystemExit(f"--split must be within 1..{n_layers - 1}, got {split}")
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2")
    result = {"model": args.model, "layers": n_layers, "split": split, "steps": args.steps,
              "local_ms_per_layer": _ms_per_layer(_steps(model, 0, n_layers, args.steps), n_layers)}

    ours, theirs = Pipe()
    other = Process(target=_other_stage, args=(theirs, args.model, split, n_layers))
    other.start()

    def hand_over(y, pos):
        ours.send((y, pos))
        ours.recv()

    here = _steps(model, 0, split, args.steps, hand_over)
    ours.send(None)
    there = ours.recv()
    other.join()
    result["alternating_ms_per_layer"] = {"here": _ms_per_layer(here, split),
                                          "other_process": _ms_per_layer(there, n_layers - split)}
    result["own_then_idle_ms_per_layer"] = _ms_per_layer(
        _steps(model, 0, split, args.steps, lambda y, pos: time.sleep(0.006)), split)
    result["local_again_ms_per_layer"] = _ms_per_layer(_steps(model, 0, n_layers, args.steps), n_layers)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
