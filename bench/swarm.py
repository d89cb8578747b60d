"""Swarm against one machine: decode/prefill tok/s, wire bytes per token, per-layer round trip,
recovery from a killed worker. Prints one JSON object.

For each model (SmolLM2-135M with dense ranges; a random-weight OLMoE-shaped MoE written here
as a safetensors checkpoint, scaled to fit this machine) one run measures, in order:

1. the local engine (``LocalFFN``): prefill of a ``--prompt-tokens`` prompt, then greedy decode
   of ``--tokens`` tokens (tok/s), and the FFN's seconds per layer during decode;
2. the swarm with 2 peers (the coordinator and one worker), then with 3: the same numbers,
   plus bytes on the wire per decoded token (both directions, all links, framing included),
   the FFN's seconds per layer (the round trip: request out, worker compute, answer back,
   combine) and the links' heartbeat RTT, and whether the greedy tokens equal the local ones;
3. layouts, with 2 peers: per-layer ranges, layer stages (the layers split between the two
   peers) and the planner's own choice (``auto``: the cost model's pick), run in turn for
   ``--rounds`` rounds, each generation taking turns of 8 decode steps with one of the local
   engine (order alternating) so that the machine's changing speed hits a layout and local
   alike, with nothing added to the link and with ``--delays`` ms added before every message the
   coordinator sends (a bench-only link option standing in for Wi-Fi; there is no netem here):
   median decode and prefill tok/s, each round's ratio to that round's local run, the decode
   CPU seconds of both processes against local's, greedy tokens against local, the cost
   model's estimates and inputs (``--layouts-only``: this phase alone);
4. recovery: a worker process is killed with SIGKILL at decode step 10; the longest stall
   between two tokens after it (compared with the median step) and the time until the
   coordinator's plan no longer names the dead worker.

Every peer is its own process (as on separate machines), all inside one network namespace
``csd-bench-…`` whose loopback carries an extra /32 (aioice skips 127.0.0.1), connected by the
real stack: aiohttp signaling, authenticated aiortc data channels, election, plan. Root is
needed for the namespace. Bytes are counted in the coordinator by wrapping each link's
``channel.send`` and reassembler (a benchmark-only spy).

    sudo python3 bench/swarm.py [--models smollm2,olmoe] [--tokens 32] [--prompt-tokens 128] [--delays 0,2,5]
    sudo python3 bench/swarm.py --trace-stages [--delays 0]   # where a 2-stage round trip's time goes

``--trace-stages`` runs only two stages (coordinator and one worker, layers split in half) and
reports, per added delay, the median microseconds between consecutive hand-offs of a decode
step's stage request on both sides (bench/stage_trace.py) and each process's CPU seconds per
token; ``COLIBRI_BENCH_INLINE_MAX_S=0`` puts every stage step on the worker's compute thread
(the path before short steps ran on its event loop), for comparison.

``COLIBRI_BENCH_THREADS`` (default 1) sets the BLAS threads of every peer process;
``--loop`` the event loop every peer process runs on, as ``join --loop`` does (default auto:
uvloop where installed); a comma-separated list (``--loop uvloop,asyncio``) measures each model
under each loop in turn, reported as ``MODEL@LOOP``.

Numbers depend on the machine and on what else runs on it; this one has 2 cores for all
peers together, so the workers and the coordinator compete for CPU. ``--pin`` stands in for
separate machines: the coordinator process (and the local runs in it) on the first CPU, each
worker on the next (round robin), so no process migrates or shares a core's caches.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# BLAS threads per peer process (set before numpy loads; inherited by the worker processes).
# Several peers share this machine's cores: threaded BLAS would oversubscribe them, and its
# spinning threads turn small decode matmuls into waits. The local baseline uses the same count.
BLAS_THREADS = os.environ.setdefault("COLIBRI_BENCH_THREADS", "1")
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = BLAS_THREADS

import numpy as np  # noqa: E402

from swarm.cli.join import EVENT_LOOPS, freeze_heap, pick_loop, run_on_loop  # noqa: E402
from swarm.compute.ffn import LayerBackend  # noqa: E402


ADDRESS = "10.215.0.1"
# This benchmark's peers share one small machine with everything else running on it; a starved
# event loop delays heartbeats and answers. So that a busy CPU is not taken for a dead peer, the
# benchmark (only) waits longer before an election and, while it measures speed, before
# recomputing a late answer. The recovery phase runs with the product's own deadline.
BENCH_ELECTION_TIMEOUT_S = 5.0
BENCH_DEADLINE_MIN_S = 5.0
PRODUCT_DEADLINE_MIN_S: list[float] = []  # filled at start: the coordinator's own floor
PLAN_WAIT_S = 300.0  # a worker process loads its model and measures its FFN speed first
PIN_ENV = "COLIBRI_BENCH_PIN"  # the CPUs peer processes pin themselves to (--pin)
LOOP_ENV = "COLIBRI_BENCH_LOOP"  # the event loop (join --loop's names) the driver hands its peer processes


def _bench_timeouts() -> float:
    """Lengthen the timeouts (see above); returns the product's request deadline floor (s)."""
    from swarm.peer.coordinator import tracker as coordinator
    from swarm.peer.election import core as election

    election.ELECTION_TIMEOUT_S = BENCH_ELECTION_TIMEOUT_S
    product_deadline = coordinator.DEADLINE_MIN_S
    coordinator.DEADLINE_MIN_S = BENCH_DEADLINE_MIN_S
    return product_deadline
LINK_OPTIONS = {"heartbeat_s": 0.5, "dead_after_s": 3.0}
KILL_AT_STEP = 10
OLMOE_SCALED = dict(  # OLMoE-1B-7B's structure (64 experts, top-8, Q/K norm) at a CPU-friendly size
    vocab_size=8192, hidden_size=512, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=8, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
    max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


# ---------------------------------------------------------------------------- models


def olmoe_checkpoint(seed: int = 0) -> Path:
    """Write (once, into the user cache) a random-weight OLMoE-shaped checkpoint with transformers."""
    from swarm.paths import cache_dir

    tag = hashlib.sha256(json.dumps(OLMOE_SCALED, sort_keys=True).encode()).hexdigest()[:12]
    out = cache_dir() / "bench" / f"olmoe-scaled-{tag}"
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**OLMOE_SCALED))
    with torch.no_grad():  # routers scaled up so top-k choices are decisive, as in the test fixtures
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(20.0)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def model_path(name: str) -> Path:
    if Path(name).exists():  # a model file or directory, e.g. the 1 GB MoE of bench/engine.py --make-moe
        return Path(name).resolve()
    if name == "smollm2":
        from swarm.compute.default_model import default_model_path

        return default_model_path()
    if name == "olmoe":
        return olmoe_checkpoint()
    raise SystemExit(f"unknown model {name!r}: use smollm2, olmoe or the path of a model file")


# ---------------------------------------------------------------------------- measuring


class TimedFFN:
    """Wraps an FFN backend; sums seconds per call while ``on`` (decode steps only; under stages,
    only the coordinator's own layers)."""

    def __init__(self, inner):
        self.inner, self.on, self.calls, self.seconds = inner, False, 0, 0.0
        if isinstance(inner, LayerBackend):  # a stage dispatch runs whole layers: forward must see it
            self.run_layers = inner.run_layers
            self.run_layers_batch = inner.run_layers_batch

    def ffn(self, layer, x):
        t0 = time.perf_counter()
        y = self.inner.ffn(layer, x)
        if self.on:
            self.calls += 1
            self.seconds += time.perf_counter() - t0
        return y


def run_generation(model, ffn, prompt: list[int], n_decode: int, on_step=None, cpu_pids=()) -> dict:
    """Greedy: prefill ``prompt`` as one batch, then ``n_decode`` single-token steps; with
    ``cpu_pids``, also the CPU seconds each of those processes spent during the decode steps."""
    timed = TimedFFN(ffn)
    cache = model.new_cache(len(prompt) + n_decode + 1)
    t0 = time.perf_counter()
    logits = model.forward(prompt, cache, ffn=timed, last_only=True)[0]
    prefill_s = time.perf_counter() - t0
    tokens, steps = [int(np.argmax(logits))], []
    timed.on = True
    cpu0 = [_cpu_s(pid) for pid in cpu_pids]
    for step in range(n_decode):
        if on_step:
            on_step(step)
        t = time.perf_counter()
        logits = model.forward([tokens[-1]], cache, ffn=timed, last_only=True)[0]
        steps.append(time.perf_counter() - t)
        tokens.append(int(np.argmax(logits)))
    cpu = [_cpu_s(pid) - c for pid, c in zip(cpu_pids, cpu0)]
    return {
        "decode_cpu_s": cpu,
        "prefill_tok_s": round(len(prompt) / prefill_s, 2),
        "decode_tok_s": round(n_decode / sum(steps), 2),
        "ffn_ms_per_layer": round(1e3 * timed.seconds / max(timed.calls, 1), 3),
        "tokens": tokens,
        "step_s": steps,
    }


PAIR_BLOCK = 8  # decode steps a backend runs in a row in run_paired


def run_paired(model, ffns: dict[str, object], prompt: list[int], n_decode: int, cpu_pids=(),
               block: int = PAIR_BLOCK) -> dict[str, dict]:
    """``run_generation`` for several FFN backends in lockstep: each prefills ``prompt``, then
    they take turns decoding ``block`` steps each (their order turning each time), so a change
    in the machine's speed — on a shared machine it swings by a third within seconds — hits them
    alike and their ratio keeps only what differs. The first step of each turn is left out of
    ``decode_tok_s`` (it is kept in ``step_s``): it runs on caches the other backend's steps
    evicted, which a backend running alone does not — a local step right after another
    process's stage step measured 1–3 % slower than one after a local step
    (``bench/alternate.py``, ``local_after_other_stage``).
    Returns run_generation's fields per backend; ``decode_cpu_s`` counts each one's own steps."""
    if block < 2 or n_decode < 2:
        raise ValueError("block and n_decode must be at least 2: a turn's first step is left out")
    names = list(ffns)
    timed = {n: TimedFFN(f) for n, f in ffns.items()}
    caches = {n: model.new_cache(len(prompt) + n_decode + 1) for n in names}
    out = {n: {"tokens": [], "step_s": [], "decode_cpu_s": [0.0] * len(cpu_pids)} for n in names}
    kept: dict[str, list[float]] = {n: [] for n in names}
    for n in names:
        t0 = time.perf_counter()
        logits = model.forward(prompt, caches[n], ffn=timed[n], last_only=True)[0]
        out[n]["prefill_tok_s"] = round(len(prompt) / (time.perf_counter() - t0), 2)
        out[n]["tokens"].append(int(np.argmax(logits)))
        timed[n].on = True
    for turn, first in enumerate(range(0, n_decode, block)):
        k = turn % len(names)
        for n in names[k:] + names[:k]:
            cpu0 = [_cpu_s(pid) for pid in cpu_pids]
            for step in range(first, min(first + block, n_decode)):
                t = time.perf_counter()
                logits = model.forward([out[n]["tokens"][-1]], caches[n], ffn=timed[n], last_only=True)[0]
                dt = time.perf_counter() - t
                out[n]["step_s"].append(dt)
                if step > first:
                    kept[n].append(dt)
                out[n]["tokens"].append(int(np.argmax(logits)))
            out[n]["decode_cpu_s"] = [c + _cpu_s(pid) - c0 for c, pid, c0 in zip(out[n]["decode_cpu_s"], cpu_pids, cpu0)]
    for n in names:
        out[n]["decode_tok_s"] = round(len(kept[n]) / sum(kept[n]), 2)
        out[n]["ffn_ms_per_layer"] = round(1e3 * timed[n].seconds / max(timed[n].calls, 1), 3)
    return out


class WireCounter:
    """Counts bytes through every link of a node since :meth:`reset` (outbound fragments, inbound frames and fragments)."""

    def __init__(self, node):
        self.node, self._sent, self._wrapped, self._received_before = node, 0, set(), {}

    def wrap_all(self):
        for link in self.node.links.values():
            if id(link) in self._wrapped:
                continue
            self._wrapped.add(id(link))
            send = link.channel.send

            def counting_send(data, send=send):
                self._sent += len(data)
                return send(data)

            link.channel.send = counting_send

    @property
    def sent(self) -> int:
        return self._sent

    @property
    def received(self) -> int:
        return sum(link.bytes_received - self._received_before.get(id(link), 0) for link in self.node.links.values())

    def reset(self):
        self.wrap_all()
        self._sent = 0
        self._received_before = {id(link): link.bytes_received for link in self.node.links.values()}


# ---------------------------------------------------------------------------- peers


def _spawn_worker(path: Path, signal_url: str, key_code: str, name: str, tmp: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, "--_worker", str(path), "--signal", signal_url, "--key", key_code, "--name", name],
        env={**os.environ, "COLIBRI_SWARM_CONFIG_DIR": str(tmp / name)}, stdout=subprocess.DEVNULL,
        stderr=open(tmp / f"{name}.log", "w"),
    )


async def _worker_main(path: str, signal_url: str, key_code: str, name: str) -> None:
    from swarm.compute.model import load_model
    from swarm.keys.identity import Identity
    from swarm.peer.node import Node
    from swarm.peer.roles import SwarmRoles
    from swarm.keys.swarmkey import SwarmKey

    if os.environ.get("COLIBRI_BENCH_INLINE_MAX_S"):  # 0: every stage step on the compute thread (as before)
        from swarm.peer.worker import stages

        stages.INLINE_MAX_S = float(os.environ["COLIBRI_BENCH_INLINE_MAX_S"])
    trace = os.environ.get("COLIBRI_STAGE_TRACE")
    if trace:
        import stage_trace

        stage_trace.install("worker")
    model = load_model(path)
    ident = Identity.generate()
    node = Node(swarm_key=SwarmKey.from_code(key_code), certificate=ident.rtc_certificate(), peer_id=ident.peer_id,
                name=name, signal_url=signal_url, ffn_gflops=1.0, memory_budget=4 << 30,
                model_hash=model.content_hash(), status_path=Path(tempfile.mkdtemp()) / "status.json",
                link_options=LINK_OPTIONS)
    await node.start(timeout=30)
    await freeze_heap()  # as join does
    roles = SwarmRoles(node, model, serve_api=False, startup_quiet_s=1.0)
    await roles.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await roles.stop()
    await node.stop()
    if trace:
        stage_trace.dump(trace)


def _progress(what: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


async def _until(predicate, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


LAYOUT_ORDER = ("local", "ranges", "stages", "auto")


async def _layouts(roles, model, prompt: list[int], n_decode: int, local_tokens: list[int],
                   delays_ms: list[float], rounds: int, worker_pid: int) -> dict:
    """Ranges, stages and the planner's choice with 2 peers against the local engine, at each
    added per-message delay: ``rounds`` rounds, each running the three in turn, each generation
    paired turn by turn with a local one (:func:`run_paired`), so a change in the machine's
    speed hits a layout and its local reference alike; per layout the median tok/s, each round's
    ratio to its paired local run, and the decode CPU seconds of both processes against local's."""
    from swarm.compute.ffn import LocalFFN

    out = {}
    pids = (os.getpid(), worker_pid)
    for delay_ms in delays_ms:
        for link in roles.node.links.values():
            link.added_delay_s = delay_ms / 1e3
        await asyncio.sleep(6 * LINK_OPTIONS["heartbeat_s"] + 1.0)  # the RTT median takes the delay in
        row = {"link_rtt_ms": [round(1e3 * link.rtt_s, 3) for link in roles.node.links.values() if link.rtt_s]}
        runs: dict[str, list[dict]] = {layout: [] for layout in LAYOUT_ORDER}
        locals_: dict[str, list[dict]] = {layout: [] for layout in LAYOUT_ORDER}  # each one's paired local run
        for r in range(rounds):
            for layout in LAYOUT_ORDER[1:]:
                await _switch_layout(roles, model, prompt, layout)
                _progress(f"{delay_ms} ms added, round {r + 1}/{rounds}, {layout} paired with local")
                paired = await asyncio.to_thread(
                    run_paired, model, {"local": LocalFFN(model), layout: roles.coordinator.engine_ffn},
                    prompt, n_decode, pids)
                for name, run in paired.items():
                    cpu = run["decode_cpu_s"][0] + (run["decode_cpu_s"][1] if name != "local" else 0.0)
                    entry = {"decode_tok_s": run["decode_tok_s"], "prefill_tok_s": run["prefill_tok_s"],
                             # the typical step, which a few slow ones (a GC pass, a stalled neighbour) do not move
                             "decode_step_ms_median": round(1e3 * statistics.median(run["step_s"]), 3),
                             "decode_step_ms_max": round(1e3 * max(run["step_s"]), 3),
                             "cpu_ms_per_token": round(1e3 * cpu / n_decode, 2),
                             "greedy_tokens_equal_local": run["tokens"] == local_tokens,
                             "load_avg_1m": round(os.getloadavg()[0], 2)}
                    if name == "local":
                        runs["local"].append(entry)
                        locals_[layout].append(entry)
                        continue
                    cost = (roles.node.placement or {}).get("cost") or {}
                    st = roles.coordinator.stages
                    entry.update({
                        "stages": (roles.node.placement or {}).get("stages"),
                        "fallbacks": bool(st is not None and (st.failed or st.misses)) or bool(roles.coordinator.ffn.failed)})
                    if layout == "auto":
                        entry["choice"] = cost.get("choice")
                        entry["estimates_ms"] = {
                            e["layout"]: {"decode": round(1e3 * e["decode_s"], 2), "prefill": round(1e3 * e["prefill_s"], 1),
                                          "fits": e["fits"]} for e in cost.get("estimates", ()) if e["decode_s"] is not None}
                        entry["peers"] = cost.get("peers")
                    runs[layout].append(entry)
        for layout in LAYOUT_ORDER:
            per = runs[layout]
            loc = locals_[layout] if layout != "local" else per
            summary = {
                "decode_tok_s_median": statistics.median(e["decode_tok_s"] for e in per),
                "prefill_tok_s_median": statistics.median(e["prefill_tok_s"] for e in per),
                "decode_vs_local_per_round": [round(e["decode_tok_s"] / l["decode_tok_s"], 3) for e, l in zip(per, loc)],
                "prefill_vs_local_per_round": [round(e["prefill_tok_s"] / l["prefill_tok_s"], 3) for e, l in zip(per, loc)],
                # local's CPU over both processes' CPU per decoded token: what an idle machine's
                # decode ratio would be for layouts that run one stage after the other, less the waits
                "local_cpu_over_cpu_per_round": [round(l["cpu_ms_per_token"] / e["cpu_ms_per_token"], 3)
                                                 for e, l in zip(per, loc)],
                "greedy_tokens_equal_local": all(e["greedy_tokens_equal_local"] for e in per),
                "rounds": per,
            }
            for k in ("decode_vs_local", "prefill_vs_local", "local_cpu_over_cpu"):
                summary[f"{k}_median"] = statistics.median(summary[f"{k}_per_round"])
            row[layout] = summary
        row["auto_vs_ranges_decode"] = round(row["auto"]["decode_tok_s_median"] / row["ranges"]["decode_tok_s_median"], 2)
        row["auto_choices"] = [e.get("choice") for e in runs["auto"]]
        out[f"{delay_ms:g}_ms_added"] = row
        _progress(json.dumps({f"{delay_ms:g}_ms_added": {k: v for k, v in row.items() if k not in LAYOUT_ORDER}
                              | {layout: row[layout]["decode_vs_local_per_round"] for layout in LAYOUT_ORDER}}))
    for link in roles.node.links.values():
        link.added_delay_s = 0.0
    await asyncio.sleep(6 * LINK_OPTIONS["heartbeat_s"] + 1.0)
    await _switch_layout(roles, model, prompt, "ranges")
    return out


async def _switch_layout(roles, model, prompt: list[int], layout: str) -> None:
    """Re-plan with ``layout`` and run two steps, so the plan is in force and the caches warm
    (again, after the worker is back in the plans, if it missed those steps: a big model's
    layers open slowly the first time)."""
    from swarm.peer.coordinator.role import READMIT_S

    for _ in range(3):
        version = roles.coordinator.ffn.plan.version
        roles.coordinator.set_layout(layout)
        await _until(lambda: roles.coordinator.ffn is not None and (roles.coordinator.ffn.pending_plan or roles.coordinator.ffn.plan).version > version
                     and not roles.coordinator.replan_pending, 60, f"a plan with layout {layout}")
        await asyncio.to_thread(run_generation, model, roles.coordinator.engine_ffn, prompt[:8], 2)
        st = roles.coordinator.stages
        if not roles.coordinator.ffn.failed and not (st is not None and st.failed):
            return
        _progress(f"the worker missed the warm-up under {layout}; again once it is back in the plans")
        await asyncio.sleep(READMIT_S + 2.0)


async def _start_coordinator(model, tmp: Path, layout: str):
    """Signaling server, node and roles of the coordinator (ffn_gflops 1.01: it wins the election
    against workers that claim 1.0); returns (swarm key, server, node, roles)."""
    from swarm.keys.identity import Identity
    from swarm.keys.swarmkey import SwarmKey
    from swarm.peer.node import Node
    from swarm.peer.roles import SwarmRoles
    from swarm.signaling.server import SignalingServer

    key, ident = SwarmKey(os.urandom(32)), Identity.generate()
    server = SignalingServer(key.secret, ident.peer_id, config_dir=tmp)
    await server.start(ADDRESS, 0)
    node = Node(swarm_key=key, certificate=ident.rtc_certificate(), peer_id=ident.peer_id, name="coordinator",
                signal_url=server.url(ADDRESS), ffn_gflops=1.01, memory_budget=4 << 30, model_hash=model.content_hash(),
                status_path=tmp / "status.json", link_options=LINK_OPTIONS)
    await node.start(timeout=30)
    await freeze_heap()  # as join does
    roles = SwarmRoles(node, model, serve_api=False, startup_quiet_s=1.0, layout=layout)
    await roles.start()
    return key, server, node, roles


async def _coordinator_main(path: str, n_prompt: int, n_decode: int, max_peers: int,
                            delays_ms: list[float], rounds: int = 3, layouts_only: bool = False) -> dict:
    from swarm.compute.ffn import LocalFFN
    from swarm.compute.model import load_model

    model = load_model(path)
    model.materialize()
    cfg = model.config
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, cfg.vocab_size, n_prompt)]
    result: dict = {
        "model": {"path": str(path), "family": cfg.family, "layers": cfg.n_layers, "hidden": cfg.hidden_size,
                  "experts": cfg.n_experts, "top_k": cfg.top_k,
                  "ffn": cfg.moe_intermediate_size if cfg.n_experts else cfg.intermediate_size},
        "prompt_tokens": n_prompt, "decode_tokens": n_decode,
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),  # other work on this machine skews every figure
    }
    _progress(f"local engine: {path}")
    local = await asyncio.to_thread(run_generation, model, LocalFFN(model), prompt, n_decode)
    local_tokens = local.pop("tokens")
    local.pop("step_s")
    result["local"] = local

    tmp = Path(tempfile.mkdtemp(prefix="csd-bench-"))
    key, server, node, roles = await _start_coordinator(model, tmp, "ranges")
    workers: list[subprocess.Popen] = []
    counter = WireCounter(node)
    try:
        for n_peers in range(2, max_peers + 1):
            workers.append(_spawn_worker(Path(path), server.url(ADDRESS), key.code, f"w{n_peers - 1}", tmp))

            def planned(n=n_peers - 1):  # the coordinator switches to a new plan at its next step
                ffn = roles.coordinator.ffn
                return ffn is not None and not ffn.failed and len((ffn.pending_plan or ffn.plan).workers()) == n

            for _ in range(4):  # a big model's first answers can miss while the worker opens its slices
                _progress(f"waiting for a plan over {n_peers - 1} worker(s)")
                await _until(planned, PLAN_WAIT_S, f"a plan over {n_peers - 1} worker(s)")
                _progress("warm-up")
                ffn = roles.coordinator.ffn
                await asyncio.to_thread(run_generation, model, ffn, prompt[:8], 2)  # plan applied; slices decoded
                if len(ffn.plan.workers()) == n_peers - 1 and not ffn.failed:
                    break
            if len(ffn.plan.workers()) != n_peers - 1:
                raise RuntimeError(f"plan has {len(ffn.plan.workers())} workers after warm-up, expected {n_peers - 1}")
            if not layouts_only:  # the layouts phase needs only the plan over the worker
                _progress(f"swarm of {n_peers}: prefill + decode")
                counter.reset()
                run = await asyncio.to_thread(run_generation, model, ffn, prompt, n_decode)
                wire_bytes = counter.sent + counter.received  # prefill + decode; split below
                counter.reset()
                run_decode = await asyncio.to_thread(run_generation, model, ffn, prompt[:1], n_decode)
                tokens = run.pop("tokens")
                run.pop("step_s")
                run_decode.pop("tokens")
                run_decode.pop("step_s")
                rtts = [link.rtt_s for link in node.links.values() if link.rtt_s]
                plan = ffn.plan
                if roles.coordinator.ffn is not ffn or ffn.failed:
                    run["invalid"] = (f"during the measurement {len(ffn.failed)} worker(s) were marked down "
                                      f"or this peer stopped coordinating; the figures mix remote and local work")
                run.update({
                    "decode_vs_local": round(run["decode_tok_s"] / local["decode_tok_s"], 3),
                    "prefill_vs_local": round(run["prefill_tok_s"] / local["prefill_tok_s"], 3),
                    "wire_bytes_per_decode_token": round((counter.sent + counter.received) / n_decode),
                    "wire_bytes_prefill_and_decode": wire_bytes,
                    "link_rtt_ms_median": round(1e3 * statistics.median(rtts), 3) if rtts else None,
                    "round_trip_ms_per_layer_over_local": round(run["ffn_ms_per_layer"] - local["ffn_ms_per_layer"], 3),
                    "greedy_tokens_equal_local": tokens == local_tokens,
                    "plan": {"version": plan.version, "workers": len(plan.workers()),
                             "coordinator_share": _coordinator_share(plan)},
                })
                result[f"swarm_{n_peers}_peers"] = run
            if n_peers == 2 and delays_ms:
                result["layouts_2_peers"] = await _layouts(roles, model, prompt, n_decode, local_tokens,
                                                           delays_ms, rounds, workers[0].pid)
                if layouts_only:
                    return result

        # Recovery: kill the last worker at decode step KILL_AT_STEP.
        victim = workers[-1]
        killed_at: list[float] = []

        def on_step(step):
            if step == KILL_AT_STEP:
                victim.send_signal(signal.SIGKILL)
                killed_at.append(time.monotonic())

        _progress("recovery from a killed worker")
        from swarm.peer.coordinator import tracker as coordinator

        coordinator.DEADLINE_MIN_S = PRODUCT_DEADLINE_MIN_S[0]
        await _until(lambda: roles.coordinator.ffn is not None and len(roles.coordinator.ffn.plan.workers()) >= 1, 60, "a coordinator with workers")
        n_workers_before = len(roles.coordinator.ffn.plan.workers())
        ffn = roles.coordinator.ffn
        # Watch, while the generation runs, for the plan that drops the dead worker.
        async def replanned_at() -> float:
            await _until(lambda: roles.coordinator.ffn is not None and bool(killed_at)
                         and len((roles.coordinator.ffn.pending_plan or roles.coordinator.ffn.plan).workers()) < n_workers_before,
                         180, "a plan without the killed worker")
            return time.monotonic()

        watcher = asyncio.ensure_future(replanned_at())
        run = await asyncio.to_thread(run_generation, model, ffn, prompt[:16], max(n_decode, KILL_AT_STEP + 10), on_step)
        steps = run["step_s"]
        before = statistics.median(steps[:KILL_AT_STEP])
        stall = max(steps[KILL_AT_STEP:])
        replanned = await watcher
        result["recovery"] = {
            "request_deadline_floor_s": PRODUCT_DEADLINE_MIN_S[0],
            "killed_at_step": KILL_AT_STEP,
            "median_step_ms_before": round(1e3 * before, 2),
            "longest_step_ms_after_kill": round(1e3 * stall, 2),
            "stall_ms": round(1e3 * (stall - before), 2),
            "plan_without_worker_s_after_kill": round(replanned - killed_at[0], 3),
            "greedy_tokens_equal_local": run["tokens"] == (await asyncio.to_thread(
                run_generation, model, LocalFFN(model), prompt[:16], len(steps)))["tokens"],
        }
    finally:
        for w in workers:
            if w.poll() is None:
                w.terminate()
        for w in workers:
            try:
                w.wait(10)
            except subprocess.TimeoutExpired:
                w.kill()
        await roles.stop()
        await node.stop()
        await server.stop()
    return result


async def _trace_main(path: str, n_prompt: int, n_decode: int, delays_ms: list[float]) -> dict:
    """Two stages (coordinator and one worker, the layers split in half): where a stage round
    trip's time goes, from stamps at each hand-off on both sides (bench/stage_trace.py), and the
    CPU seconds of both processes per decoded token, at each added delay."""
    import stage_trace

    from swarm.compute.ffn import LocalFFN
    from swarm.compute.model import load_model

    stage_trace.install("coordinator")
    model = load_model(path)
    model.materialize()
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, model.config.vocab_size, n_prompt)]
    cpu0 = _cpu_s(os.getpid())
    local = await asyncio.to_thread(run_generation, model, LocalFFN(model), prompt, n_decode)
    local_cpu = (_cpu_s(os.getpid()) - cpu0) / (n_decode + 1)  # the prefill counted as one step, as below
    result = {"load_avg_1m_at_start": round(os.getloadavg()[0], 2),
              "local_decode_tok_s": local["decode_tok_s"], "local_cpu_s_per_token": round(local_cpu, 4)}
    tmp = Path(tempfile.mkdtemp(prefix="csd-trace-"))
    key, server, node, roles = await _start_coordinator(model, tmp, "stages")
    worker_trace = tmp / "w1.trace.json"
    os.environ["COLIBRI_STAGE_TRACE"] = str(worker_trace)
    worker = _spawn_worker(Path(path), server.url(ADDRESS), key.code, "w1", tmp)
    del os.environ["COLIBRI_STAGE_TRACE"]
    try:
        await _until(lambda: roles.coordinator.stages is not None and len(roles.coordinator.stages.layout.workers()) == 1, 90,
                     "a stage plan over one worker")
        await asyncio.to_thread(run_generation, model, roles.coordinator.engine_ffn, prompt[:8], 2)
        windows = []
        for delay_ms in delays_ms:
            for link in node.links.values():
                link.added_delay_s = delay_ms / 1e3
            await asyncio.sleep(6 * LINK_OPTIONS["heartbeat_s"] + 1.0)
            seen = {"stages": [["coordinator" if s.peer == node.peer_id else "worker", s.start, s.stop]
                               for s in roles.coordinator.stages.layout.stages],
                    "link_rtt_ms": [round(1e3 * link.rtt_s, 3) for link in node.links.values() if link.rtt_s]}
            cpu0 = _cpu_s(os.getpid()), _cpu_s(worker.pid)
            t0 = time.perf_counter_ns()
            run = await asyncio.to_thread(run_generation, model, roles.coordinator.engine_ffn, prompt, n_decode)
            t1 = time.perf_counter_ns()
            cpu1 = _cpu_s(os.getpid()), _cpu_s(worker.pid)
            windows.append((delay_ms, t0, t1, run, [b - a for a, b in zip(cpu0, cpu1)], seen))
    finally:
        worker.terminate()
        worker.wait(30)
        await roles.stop()
        await node.stop()
        await server.stop()
    ours = tmp / "coordinator.trace.json"
    stage_trace.dump(ours)
    for delay_ms, t0, t1, run, cpu, seen in windows:
        # decode steps only: prefill's request is the first of the window
        bd = stage_trace.breakdown([ours, worker_trace], since_ns=t0, until_ns=t1, skip_first=True)
        result[f"{delay_ms:g}_ms_added"] = {
            "decode_tok_s": run["decode_tok_s"], "decode_vs_local": round(run["decode_tok_s"] / local["decode_tok_s"], 3),
            **seen, "cpu_s_per_token": {"coordinator": round(cpu[0] / (n_decode + 1), 4),
                                        "worker": round(cpu[1] / (n_decode + 1), 4)},
            # stages run one after the other: local CPU over both processes' CPU is the decode
            # ratio an idle machine would give, less the network's waits
            "local_cpu_over_stages_cpu": round(local_cpu * (n_decode + 1) / sum(cpu), 3),
            "load_avg_1m": round(os.getloadavg()[0], 2), "breakdown_us": bd}
    return result


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _coordinator_share(plan) -> float:
    own = total = 0
    for spans in (*plan.experts.values(), *plan.dense.values()):
        for s in spans:
            total += s.stop - s.start
            own += (s.stop - s.start) if s.peer == plan.coordinator else 0
    return round(own / total, 3) if total else 1.0


# ---------------------------------------------------------------------------- driver


def _in_netns(argv: list[str], timeout_s: float) -> dict:
    if os.geteuid() != 0:
        raise SystemExit("bench/swarm.py needs root (it creates a network namespace)")
    name = f"csd-bench-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "-n", name, "addr", "add", f"{ADDRESS}/32", "dev", "lo"], check=True)
        proc = subprocess.run(["ip", "netns", "exec", name, sys.executable, __file__, *argv],
                              capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}",
                    "stderr_tail": proc.stderr[-2000:]}
        return json.loads(proc.stdout)
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,olmoe")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps per measurement")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-peers", type=int, default=3)
    parser.add_argument("--delays", default="0,2,5",
                        help="ms added before each message the coordinator sends, for the layouts phase ('' skips it)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of the layouts phase, each running local, ranges, stages and auto in turn")
    parser.add_argument("--layouts-only", action="store_true",
                        help="only the layouts phase (2 peers): no 2/3-peer ranges figures, no recovery")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per model")
    parser.add_argument("--loop", default="auto",
                        help="the peers' event loop: auto (uvloop where installed), uvloop or asyncio; a "
                             "comma-separated list measures each in turn")
    parser.add_argument("--pin", action="store_true",
                        help="pin the coordinator to the first CPU and each worker to another, as on separate machines")
    parser.add_argument("--_coordinator", metavar="PATH", help=argparse.SUPPRESS)
    parser.add_argument("--_worker", metavar="PATH", help=argparse.SUPPRESS)
    parser.add_argument("--trace-stages", action="store_true",
                        help="only trace a 2-stage decode: where a stage round trip's time goes (per hand-off, "
                             "both sides) and CPU seconds per token, at each --delays")
    parser.add_argument("--_trace", metavar="PATH", help=argparse.SUPPRESS)
    parser.add_argument("--signal", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pin:
        if len(os.sched_getaffinity(0)) < 2:
            parser.error("--pin needs two CPUs")
        os.environ[PIN_ENV] = ",".join(map(str, sorted(os.sched_getaffinity(0))))  # inherited by every peer process
    if os.environ.get("BENCH_LOG") or args._worker:  # a worker's log goes to <tmp>/<name>.log
        import logging

        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.name or 'main'} %(name)s: %(message)s")
        logging.getLogger("aioice").setLevel(logging.WARNING)
    loops = [name.strip() for name in args.loop.split(",") if name.strip()]
    bad = [name for name in loops if name not in EVENT_LOOPS]
    if bad or not loops:
        parser.error(f"--loop: {','.join(bad) or 'nothing'} is not one of {', '.join(EVENT_LOOPS)}")
    if args._trace or args._worker or args._coordinator:  # a peer process: on the loop its driver chose
        asyncio.run = functools.partial(run_on_loop, asked=os.environ.get(LOOP_ENV, "auto"))
        if os.environ.get(PIN_ENV):
            cpus = [int(c) for c in os.environ[PIN_ENV].split(",")]  # the driver's: a child inherits one
            index = int(args.name[1:]) if args._worker else 0  # workers are w1, w2, ...
            os.sched_setaffinity(0, {cpus[0] if index == 0 else cpus[1 + (index - 1) % (len(cpus) - 1)]})
    if args._trace:
        PRODUCT_DEADLINE_MIN_S.append(_bench_timeouts())
        delays = [float(d) for d in args.delays.split(",") if d.strip()]
        print(json.dumps(asyncio.run(_trace_main(args._trace, args.prompt_tokens, args.tokens, delays))))
        return
    if args._worker or args._coordinator:
        PRODUCT_DEADLINE_MIN_S.append(_bench_timeouts())
    if args._worker:
        asyncio.run(_worker_main(args._worker, args.signal, args.key, args.name))
        return
    if args._coordinator:
        delays = [float(d) for d in args.delays.split(",") if d.strip()]
        out = asyncio.run(_coordinator_main(args._coordinator, args.prompt_tokens, args.tokens, args.max_peers, delays,
                                            args.rounds, args.layouts_only))
        print(json.dumps(out))
        return
    results = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
                    "arch": platform.machine(), "blas_threads_per_process": int(BLAS_THREADS),
                    "load_avg_1m_at_start": round(os.getloadavg()[0], 2)},
        "models": {},
    }
    results["machine"]["event_loops"] = {name: pick_loop(name) for name in loops}
    for name in args.models.split(","):
        path = model_path(name)
        for loop in loops:
            os.environ[LOOP_ENV] = loop  # inherited by every peer process of this measurement
            label = Path(name).name if len(loops) == 1 else f"{Path(name).name}@{loop}"
            t0 = time.monotonic()
            mode = "--_trace" if args.trace_stages else "--_coordinator"
            results["models"][label] = _in_netns(
                [mode, str(path), "--tokens", str(args.tokens), "--prompt-tokens", str(args.prompt_tokens),
                 "--max-peers", str(2 if args.layouts_only else args.max_peers), "--delays", args.delays,
                 "--rounds", str(args.rounds), *(["--layouts-only"] if args.layouts_only else [])], args.timeout)
            results["models"][label]["bench_wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
