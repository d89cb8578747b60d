"""A GPU peer's GPU memory in the plan (docs/planner.md, "GPU memory"): a peer that announced
its ``gpu_memory`` gets no more stage layers than their weights and KV cache — the KV bytes the
plan counts for every stage, :func:`swarm.peer.plan.reserve_of` — fit in it, and no more range
weights than fit; one that announced none is limited by its host allowance alone. The oracle of
each count is the greedy fill written out here from the layer sizes."""

from __future__ import annotations

import pytest

from swarm.peer.coordinator import costmodel as cm
from swarm.peer.coordinator.costmodel import LayerCosts, PeerCost
from swarm.peer.coordinator.planner import PeerCapacity, build_plan
from swarm.peer.plan import ModelShape

MB = 2**20
N, WEIGHTS, KV, STEP = 8, 10 * MB, 6 * MB, 1 * MB  # layers; bytes of one layer's weights, its KV cache; a step


def costs() -> LayerCosts:
    return LayerCosts((2e6,) * N, (2e8,) * N, (2 * MB,) * N, (WEIGHTS - 2 * MB,) * N, 1e7, 1024,
                      kv_bytes=(KV,) * N, step_bytes=STEP)


def layers_held(gpu_memory: int | None) -> dict[str, int]:
    """Layers per peer of the stage layout the cost model builds: a fast GPU worker (8 GB host
    memory, ``gpu_memory``) and a slow coordinator that holds everything."""
    coord = PeerCost("c", 10**12, 1.0)
    gpu = PeerCost("g", 8 << 30, 100.0, 0.001, gpu_memory=gpu_memory)
    stages = cm.stage_layers(costs(), coord, [gpu])
    assert stages is not None
    assert all(planned <= room for planned, room in cm.stage_fit(costs(), coord, [gpu], stages).values())
    return {pid: hi - lo for pid, lo, hi in stages}


def test_a_gpu_that_holds_the_weights_but_not_their_kv_cache_gets_fewer_layers():
    gpu_memory = N * WEIGHTS + STEP + 5 * MB  # every layer's weights fit; with their KV cache, not
    want = (gpu_memory - STEP) // (WEIGHTS + KV)  # whole layers with their KV cache
    assert want < N
    assert layers_held(gpu_memory) == {"g": want, "c": N - want}


def test_a_gpu_that_holds_weights_and_kv_cache_gets_every_layer():
    assert layers_held(N * (WEIGHTS + KV) + STEP) == {"g": N}
    assert layers_held(None) == {"g": N}  # none announced: the host allowance (8 GB) alone


def test_a_gpu_too_small_for_one_layer_with_its_kv_cache_gets_no_stage():
    assert layers_held(WEIGHTS + STEP) == {"c": N}  # one layer's weights fit, not with its KV cache


def test_the_host_allowance_still_binds_a_gpu_peer_with_more_gpu_memory():
    room = cm.LayerCosts.worker_room(costs(), PeerCost("g", 40 * MB, 1.0, gpu_memory=1 << 40))
    assert room == 40 * MB - STEP


def test_a_gpu_peers_ranges_stay_within_its_gpu_memory():
    shape = ModelShape(hidden_size=64, n_experts=8, moe_intermediate_size=32, intermediate_size=0,
                       moe_layers=(0, 1, 2, 3), dense_layers=(), bytes_per_weight=4.0, step_bytes=STEP)
    gpu_memory = STEP + 10 * shape.expert_bytes  # 10 of the 32 experts
    coord, gpu = PeerCapacity("c", 10**9, 1.0), PeerCapacity("g", 10**9, 1000.0, gpu_memory=gpu_memory)
    plan = build_plan(shape, coord, [gpu], term=1, version=1)
    assert plan.bytes_of("g", shape) == 10 * shape.expert_bytes == shape.worker_weight_budget(10**9, gpu_memory)
    unbounded = build_plan(shape, coord, [PeerCapacity("g", 10**9, 1000.0)], term=1, version=1)
    assert plan.bytes_of("g", shape) < unbounded.bytes_of("g", shape)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from swarm.compute.model import load_model
    from tests.peer._swarm_models import build

    return load_model(build("qwen3_moe", tmp_path_factory.mktemp("gpu-plan")))


@pytest.mark.parametrize("kv_fits", [False, True])
def test_planning_counts_a_gpu_stage_peers_kv_cache_from_the_models_shape(moe, kv_fits):
    """Planning end to end on a model file, under ``stages``: the split by speed gives the fast
    GPU worker layers 1 .. n-1 (the coordinator keeps one); where its GPU holds those layers'
    weights but not their KV cache (the plan's own bytes, reserve_of), the split does not fit and
    the worker gets as many layers as its GPU holds (counted from layer 0, placed after the
    coordinator's). The cost report shows the figure used."""
    from swarm.peer.coordinator.planning import Planning
    from swarm.peer.weights.sizes import model_shape
    from tests.peer._swarm_models import COORD, W1

    planning = Planning(moe, model_shape(moe), COORD, "stages")
    c = planning._layer_costs()
    n, theirs = c.n_layers, range(1, c.n_layers)
    assert all(kv > 0 for kv in c.kv_bytes)
    need = sum(c.stage_bytes(i) for i in theirs) if kv_fits else sum(c.layer_bytes(i) for i in theirs) + c.kv_bytes[0] // 2
    gpu_memory = c.step_bytes + need

    def held(gpu: int | None) -> list[tuple[int, int]]:
        planning.new_plan(1, 1 << 40, 1.0, [PeerCapacity(W1, 1 << 40, 1e6, 0.001, gpu_memory=gpu)], {W1})
        lay = planning.stage_layout
        assert lay is not None
        return [(s.start, s.stop) for s in lay.stages if s.peer == W1]

    assert held(None) == [(1, n)]  # the host allowance alone: the split by speed
    mine = held(gpu_memory)
    (shown,) = [p for p in planning.cost_report["peers"] if p["peer_id"] == W1]
    assert shown["gpu_memory"] == gpu_memory
    if kv_fits:
        assert mine == [(1, n)]
        return
    room, want = gpu_memory - c.step_bytes, 0  # the greedy fill from layer 0, fastest first, counts its layers
    while want < n and sum(c.stage_bytes(i) for i in range(want + 1)) <= room:
        want += 1
    assert 1 <= want < n - 1 and len(mine) == 1 and mine[0][1] - mine[0][0] == want
    assert sum(c.stage_bytes(i) for i in range(*mine[0])) <= room  # placed after the coordinator's: still fits


# --- a GPU too small for the work: the peer computes it on its CPU (gpu_holds) -------------------


def test_a_gpu_peer_that_holds_a_few_layers_computes_more_on_its_cpu_where_that_prices_faster():
    """Priced both ways: its GPU holds 2 of the 8 layers (the slow coordinator keeps 6), its host
    memory all 8. A CPU of 50 GFLOP/s runs all 8 faster than what its GPU holds beside the
    coordinator: taken, each layer counted against host memory and priced at the CPU's speed. A
    CPU of 0.5 would not: the GPU way stays."""
    from swarm.peer.coordinator.planning import choose_ways

    coord = PeerCost("c", 10**12, 1.0)
    gpu = PeerCost("g", 8 << 30, 100.0, 0.001, gpu_memory=STEP + 2 * (WEIGHTS + KV))
    stages, report, (priced,), _ = choose_ways("auto", costs(), coord, [gpu], cpu_gflops={"g": 50.0})
    assert stages is not None and [(s.peer, s.start, s.stop) for s in stages] == [("g", 0, N)]
    assert priced.on_cpu and priced.gflops == 50.0 and cm.LayerCosts.worker_room(costs(), priced) == (8 << 30) - STEP
    (shown,) = [p for p in report["peers"] if p["peer_id"] == "g"]
    assert shown["on_cpu"] and shown["gflops"] == 50.0
    _, report, (priced,), _ = choose_ways("auto", costs(), coord, [gpu], cpu_gflops={"g": 0.5})
    assert priced == gpu and report["choice"] != "local"  # its GPU's share of the work, at its GPU's speed


@pytest.mark.parametrize("layout", ["stages", "auto"])
def test_a_gpu_peer_whose_gpu_holds_no_layer_runs_layers_on_its_cpu(moe, layout):
    """Planning end to end on a model file: the coordinator holds one layer, a fast GPU worker's
    GPU not one layer with its KV cache, its host memory the rest. Its GPU way places nothing and
    no layout fits (before: ranges, the coordinator streaming the model); its CPU way takes layers
    1 .. n-1 against host memory, priced at the coordinator's speed (its hello gives its GPU's
    only) until its answers time its CPU, and status names it as computing on its CPU."""
    from swarm.peer.coordinator.planning import Planning
    from swarm.peer.coordinator.tracker import Observations, PeerObservation
    from swarm.peer.weights.sizes import model_shape
    from tests.peer._swarm_models import COORD, W1

    planning = Planning(moe, model_shape(moe), COORD, layout)
    c = planning._layer_costs()
    n = c.n_layers
    own = moe.embed.nbytes + (0 if moe.head is moe.embed else moe.head.nbytes)
    budget = own + c.coordinator_reserve(1, kv_layers=range(0)) + c.stage_bytes(0)
    gpu_memory = c.step_bytes + min(c.stage_bytes(i) for i in range(n)) - 1
    host = c.step_bytes + sum(c.stage_bytes(i) for i in range(1, n))
    planning.new_plan(1, budget, 2.0, [PeerCapacity(W1, host, 1e6, 0.001, gpu_memory=gpu_memory)], {W1})
    lay = planning.stage_layout
    assert lay is not None and [(s.peer, s.start, s.stop) for s in lay.stages] == [(COORD, 0, 1), (W1, 1, n)]
    (shown,) = [p for p in planning.cost_report["peers"] if p["peer_id"] == W1]
    assert shown["on_cpu"] and shown["gflops"] == 2.0 and shown["gpu_memory"] == gpu_memory
    assert planning.on_cpu == {W1} and planning.status()["on_cpu"] == [W1]
    # the groups the API is placed by are priced the same way: its CPU's speed and kernel passes
    (worker,) = [p for p in planning.pricer()._peers.values() if p.peer_id == W1]
    assert worker.on_cpu and worker.gflops == 2.0
    # its stage answers then time its CPU (3 GFLOP/s): the next plan prices its CPU way at that
    seen = Observations({W1: PeerObservation(0.001, None, 1, 0, 0, 0, s_per_row_layer=planning._layer_flops() / 3e9)})
    planning.new_plan(1, budget, 2.0, [PeerCapacity(W1, host, 1e6, 0.001, gpu_memory=gpu_memory)], {W1}, stages=seen)
    (shown,) = [p for p in planning.cost_report["peers"] if p["peer_id"] == W1]
    assert shown["on_cpu"] and shown["gflops"] == pytest.approx(3.0) and planning.on_cpu == {W1}


def test_under_ranges_a_gpu_peer_whose_gpu_holds_no_expert_takes_ranges_on_its_cpu(moe):
    from swarm.peer.coordinator.planning import Planning
    from swarm.peer.weights.sizes import model_shape
    from tests.peer._swarm_models import COORD, W1

    shape = model_shape(moe)
    planning = Planning(moe, shape, COORD, "ranges")
    gpu_memory = shape.step_bytes + min(shape.expert_bytes, shape.column_bytes * shape.dense_block) - 1
    plan = planning.new_plan(1, 1 << 40, 1.0, [PeerCapacity(W1, 1 << 40, 1e6, 0.001, gpu_memory=gpu_memory)], {W1})
    assert plan.bytes_of(W1, shape) > shape.expert_bytes  # before: none (its GPU holds not one unit)
    assert planning.on_cpu == {W1} and planning.status()["on_cpu"] == [W1]
