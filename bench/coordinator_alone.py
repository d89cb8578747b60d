"""The coordinator alone through the swarm's dispatch against the local engine, in one process.

    python3 bench/coordinator_alone.py MODEL [--steps 300]

A plan that leaves every layer to the coordinator (what ``auto`` picks when a split prices
slower, and what the coordinator's own stage is) runs ``RemoteFFN``; this decodes greedily
with it and with ``LocalFFN``, one step of each in turn (order alternating, so the machine's
changing speed hits both alike), and prints JSON: each one's median step (ms), the local over
dispatch ratio of their summed steps, and whether their tokens are equal. Nothing is sent:
the plan has no worker. Nothing here is imported by the product.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class _NoLinks:
    """A Dispatcher with no peers: the coordinator-only plan never sends."""

    def send(self, peer, msg):
        raise AssertionError(f"a coordinator-only plan sent a {type(msg).__name__}")

    def last_heard(self, peer):
        return None

    def peer_failed(self, peer, reason):
        raise AssertionError(f"a coordinator-only plan failed peer {peer}: {reason}")

    def peer_not_ready(self, peer, reason):
        raise AssertionError(f"a coordinator-only plan found peer {peer} not ready: {reason}")

    def lead_state(self, term):
        return True  # no election: this process coordinates


def main() -> None:
    from swarm.compute.ffn import LocalFFN
    from swarm.compute.model import load_model
    from swarm.peer.coordinator.dispatch import RemoteFFN
    from swarm.peer.coordinator.planner import PeerCapacity, build_plan
    from swarm.peer.weights.sizes import model_shape

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a model file or directory")
    ap.add_argument("--steps", type=int, default=300, help="decode steps of each (at least 4)")
    args = ap.parse_args()
    if args.steps < 4:
        raise SystemExit("--steps must be at least 4")
    model = load_model(args.model)
    model.materialize()
    plan = build_plan(model_shape(model), PeerCapacity("coordinator", 0, 1.0), [], term=1, version=1,
                      coordinator_budget=1 << 50)
    ffns = {"local": LocalFFN(model), "dispatch": RemoteFFN(model, plan, _NoLinks())}
    caches = {name: model.new_cache(args.steps + 2) for name in ffns}
    tokens = {name: [1] for name in ffns}
    steps: dict[str, list[float]] = {name: [] for name in ffns}
    for step in range(args.steps):
        for name in list(ffns) if step % 2 == 0 else list(ffns)[::-1]:
            t = time.perf_counter()
            logits = model.forward([tokens[name][-1]], caches[name], ffn=ffns[name], last_only=True)[0]
            steps[name].append(time.perf_counter() - t)
            tokens[name].append(int(np.argmax(logits)))
    kept = {name: s[2:] for name, s in steps.items()}  # the first steps open the weights
    print(json.dumps({
        "model": args.model, "steps": args.steps,
        "median_step_ms": {name: round(1e3 * statistics.median(s), 3) for name, s in kept.items()},
        "local_over_dispatch": round(sum(kept["local"]) / sum(kept["dispatch"]), 4),
        "same_tokens": tokens["local"] == tokens["dispatch"],
    }))


if __name__ == "__main__":
    main()
