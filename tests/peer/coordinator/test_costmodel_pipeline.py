"""The planner's price of pipelined stages: one scheduler per stage, a token of every sequence
costing the longer of one scheduler's pass and the busiest peer's work; with one sequence nothing
changes; ``auto`` splits a model the coordinator holds into stages only when several sequences
run and the pipeline serves them ``REMOTE_MARGIN`` faster, and says why. A MoE layer's call reads
only the routed experts its rows chose."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from swarm.peer.coordinator import costmodel as cm
from swarm.peer.coordinator.costmodel import LayerCosts, PeerCost
from swarm.peer.coordinator.planning import choose_stages

MB = 2**20


def layers(n=24, ffn_flops=2e7, ffn_bytes=4 * MB) -> LayerCosts:
    return LayerCosts((2e6,) * n, (ffn_flops,) * n, (MB,) * n, (ffn_bytes,) * n, 1e7, 1024)


def pair(rtt_s=0.002, gflops=10.0):
    return PeerCost("c", 10**12, gflops), [PeerCost("w1", 10**12, gflops, rtt_s)]


def test_one_sequence_and_one_stage_are_not_split():
    costs = layers()
    coord, workers = pair()
    assert cm.pipeline_groups(1, 2) == 1 and cm.pipeline_groups(8, 1) == 1
    # schedulers stepping at once are groups in flight already: a step is cut only to fill the rest
    assert cm.pipeline_groups(8, 2, schedulers=2) == 1 and cm.pipeline_groups(8, 3, schedulers=3) == 1
    assert cm.pipeline_groups(8, 3, schedulers=2) == 2 and cm.pipeline_groups(8, 2) == 2
    # the coordinator alone: one call of every layer, the head per row
    alone = cm.serving_step_s(costs, coord, workers, (("c", 0, 24),), 8)
    assert alone == pytest.approx(cm._stage_call_s(costs, coord, 0, 24, 8, False) + 8 * 1e7 / 1e10)
    # a step of one sequence over two stages: the stages in turn
    two = (("c", 0, 12), ("w1", 12, 24))
    one = cm.serving_step_s(costs, coord, workers, two, 1)
    assert one == pytest.approx(sum(cm._stage_call_s(costs, coord if p == "c" else workers[0], lo, hi, 1, p != "c")
                                    for p, lo, hi in two) + 1e7 / 1e10)


def test_schedulers_per_stage_take_the_longer_of_one_pass_and_the_busiest_peers_work():
    costs = layers()
    coord, workers = pair()
    two = (("c", 0, 12), ("w1", 12, 24))
    calls = [cm._stage_call_s(costs, coord, 0, 12, 4, False), cm._stage_call_s(costs, workers[0], 12, 24, 4, True)]
    head = 4 * 1e7 / 1e10  # the head for one scheduler's 4 rows
    pipelined = cm.serving_step_s(costs, coord, workers, two, 8)  # two schedulers of 4 sequences
    assert pipelined == pytest.approx(max(sum(calls) + head, 2 * (calls[0] + head), 2 * calls[1]))
    # a slow worker: its two calls set the pace, not one scheduler's pass
    slow = [cm.PeerCost("w1", 10**12, 2.0, 0.002)]
    slow_call = cm._stage_call_s(costs, slow[0], 12, 24, 4, True)
    assert cm.serving_step_s(costs, coord, slow, two, 8) == pytest.approx(2 * slow_call)
    in_turn = cm.serving_step_s(costs, coord, workers, two, 8, groups=1)
    assert in_turn == pytest.approx(cm._stage_call_s(costs, coord, 0, 12, 8, False)
                                    + cm._stage_call_s(costs, workers[0], 12, 24, 8, True) + 8 * 1e7 / 1e10)
    assert pipelined < in_turn  # two peers at once


def test_auto_keeps_the_coordinator_alone_for_one_sequence_and_splits_for_several():
    costs = layers()
    coord, workers = pair()
    best, _ = cm.choose(costs, coord, workers)
    assert best.layout == "local"  # one user: a split only adds a message
    best, estimates = cm.choose(costs, coord, workers, sequences=8)
    assert best.layout == "stages" and best.stages == (("c", 0, 12), ("w1", 12, 24))
    alone = next(e for e in estimates if e.layout == "local")
    assert best.serving_tok_s >= alone.serving_tok_s / (1 - cm.REMOTE_MARGIN)
    assert "8 sequences pipelined over 2 stages (groups of 4 + 4)" in best.note
    stages, report = choose_stages("auto", costs, coord, workers, sequences=8)
    assert [s.peer for s in stages] == ["c", "w1"] and report["sequences"] == 8 and "pipelined" in report["why"]
    stages, report = choose_stages("auto", costs, coord, workers)
    assert [s.peer for s in stages] == ["c"] and "why" not in report


def test_weights_that_dominate_a_step_keep_the_coordinator_alone():
    """Decode on a CPU reads every weight once per pass of ``ROW_TILE`` rows: when that is most of
    a step (few FLOPs per byte), splitting 4 sequences (one pass alone) into groups pays it once
    more per group and gains too little. At 8 sequences one machine takes two passes over all the
    weights, two stage peers two each over half of them: the stages pay."""
    costs = layers(ffn_flops=2e6, ffn_bytes=200 * MB)
    coord, workers = pair()
    best, estimates = cm.choose(costs, coord, workers, sequences=cm.ROW_TILE)
    assert best.layout == "local" and best.serving_tok_s is not None
    staged = [e for e in estimates if e.layout == "stages" and e.serving_tok_s is not None]
    assert staged and staged[-1].serving_tok_s < best.serving_tok_s / (1 - cm.REMOTE_MARGIN)
    best, _ = cm.choose(costs, coord, workers, sequences=2 * cm.ROW_TILE)
    assert best.layout == "stages"


def test_a_slow_link_keeps_the_coordinator_alone():
    """A step of 8 here computes for 0.44 s alone: a 50 ms link still pays (the schedulers overlap
    it), one of 200 ms no longer does (the worker's calls with their messages outlast it)."""
    costs = layers(ffn_flops=2e7)
    coord, workers = pair(rtt_s=0.05)
    assert cm.choose(costs, coord, workers, sequences=8)[0].layout == "stages"
    coord, workers = pair(rtt_s=0.2)
    assert cm.choose(costs, coord, workers, sequences=8)[0].layout == "local"


def test_the_throughput_split_leaves_the_coordinator_room_for_the_head():
    """Pipelined, the busiest peer sets the pace; the coordinator also runs the head for every
    row, so it takes that many fewer layers (SmolLM2's shape: 30 layers, the head a fifth)."""
    costs = LayerCosts((2e6,) * 30, (5e6,) * 30, (MB,) * 30, (MB,) * 30, 5.6e7, 1024)
    coord, workers = pair()
    split = cm.throughput_split(costs, coord, workers)
    assert split == (("c", 0, 11), ("w1", 11, 30))
    work = [(hi - lo) * 7e6 + (costs.head_flops if p == "c" else 0) for p, lo, hi in split]
    assert abs(work[0] - work[1]) <= 7e6  # within a layer of each other
    # a worker twice as fast takes twice the coordinator's work, head included
    fast = [PeerCost("w1", 10**12, 20.0, 0.002)]
    (_, lo, hi), _ = cm.throughput_split(costs, coord, fast)
    assert hi - lo == 5 and abs(2 * (5 * 7e6 + 5.6e7) - 25 * 7e6) <= 2 * 7e6
    # a head heavier than the coordinator's share leaves it one layer, never none
    heavy = LayerCosts((2e6,) * 30, (5e6,) * 30, (MB,) * 30, (MB,) * 30, 5e8, 1024)
    assert cm.throughput_split(heavy, coord, workers)[0] == ("c", 0, 1)


def moe_layers(n=12, experts=64, top_k=8, expert_bytes=MB, attn_bytes=MB) -> LayerCosts:
    """``n`` MoE layers of ``experts`` routed experts of ``expert_bytes`` each, ``top_k`` a row."""
    return LayerCosts((2e6,) * n, (2e7,) * n, (attn_bytes,) * n, (experts * expert_bytes,) * n, 1e7, 1024,
                      expert_bytes=(experts * expert_bytes,) * n, n_experts=(experts,) * n, top_k=(top_k,) * n)


@pytest.mark.parametrize("experts,top_k,rows", [(64, 8, 1), (64, 8, 4), (64, 8, 16), (8, 2, 3), (128, 4, 10)])
def test_distinct_experts_matches_rows_routed_at_random(experts, top_k, rows):
    """Each of ``rows`` rows picks ``top_k`` experts without replacement, uniformly: the mean count
    of distinct experts over 20000 such calls is the formula's within 1 %."""
    rng = np.random.default_rng(1234)
    trials = 20000
    picks = np.argpartition(rng.random((trials, rows, experts)), top_k - 1, axis=-1)[..., :top_k]
    hit = np.zeros((trials, experts), dtype=bool)
    hit[np.arange(trials)[:, None], picks.reshape(trials, -1)] = True
    assert cm.distinct_experts(experts, top_k, rows) == pytest.approx(hit.sum(axis=1).mean(), rel=0.01)


def test_distinct_experts_of_64_top_8():
    assert [cm.distinct_experts(64, 8, n) for n in (1, 4, 8, 16)] == pytest.approx([8.0, 26.5, 42.0, 56.4], abs=0.05)
    assert cm.distinct_experts(64, 8, 0) == 0.0 and cm.distinct_experts(0, 0, 8) == 0.0


def test_a_moe_call_reads_the_experts_its_rows_choose():
    """One row reads top_k of E experts' bytes besides attention; many rows read them all."""
    costs = moe_layers(n=2)
    coord = PeerCost("c", 10**12, 10.0)
    flops = 2 * (2e6 + 2e7) / 1e10  # both layers, one row, at 10 GFLOP/s
    experts = 64 * MB
    assert costs.read_bytes(0, 1) == pytest.approx(MB + experts * 8 / 64)
    assert cm._stage_call_s(costs, coord, 0, 2, 1, False) == pytest.approx(
        2 * (MB + experts * 8 / 64) / cm.WEIGHT_BYTES_PER_S + flops)
    assert costs.read_bytes(0, 500) == pytest.approx(MB + experts, rel=1e-9)
    # 500 rows: attention in 125 passes of 4 rows, each expert in 16 (the 62.5 rows it gets)
    assert costs.pass_bytes(0, 500, cm.ROW_TILE) == pytest.approx(125 * MB + 16 * experts, rel=1e-9)
    assert cm._stage_call_s(costs, coord, 0, 2, 500, False) == pytest.approx(
        2 * (125 * MB + 16 * experts) / cm.WEIGHT_BYTES_PER_S + 500 * flops)
    # a GPU reads them once whatever the rows
    gpu = PeerCost("g", 10**12, 10.0, gpu_memory=10**12)
    assert cm._stage_call_s(costs, gpu, 0, 2, 500, False) == pytest.approx(
        2 * (MB + experts) / cm.WEIGHT_BYTES_PER_S + 500 * flops)


def test_groups_of_a_moe_step_read_more_experts_than_one_step():
    """Eight sequences on the coordinator alone: two groups of 4 read 2 · E(1 - (1 - k/E)^4)
    experts a layer, one group of 8 E(1 - (1 - k/E)^8); the attention weights twice either way (a
    pass of 4 rows each), the FLOPs and the head the same."""
    n, E, k = 12, 64, 8
    costs = moe_layers(n=n, experts=E, top_k=k)
    coord = PeerCost("c", 10**12, 10.0)
    alone = (("c", 0, n),)
    one = cm.serving_step_s(costs, coord, [], alone, 8, groups=1)
    two = cm.serving_step_s(costs, coord, [], alone, 8, groups=2)
    missed = 1 - k / E  # the chance one row leaves a given expert alone
    read = lambda rows: MB * math.ceil(rows / cm.ROW_TILE) + E * MB * (1 - missed**rows)  # noqa: E731  a layer's bytes for a call of `rows`
    extra = n * (2 * read(4) - read(8)) / cm.WEIGHT_BYTES_PER_S
    assert two - one == pytest.approx(extra)
    assert two > one
    # less than a whole extra pass of the experts: one group of 8 leaves a third of them unread
    assert extra < n * (MB + E * MB) / cm.WEIGHT_BYTES_PER_S


def test_a_dense_call_reads_its_weights_once_a_pass_of_row_tile_rows():
    """A dense layer's call on a CPU reads every weight once per pass of ``ROW_TILE`` rows (its
    kernels' tile), on a GPU once whatever its rows."""
    costs = layers()
    coord, workers = pair()
    gpu = PeerCost("w1", 10**12, 10.0, 0.002, gpu_memory=10**12)
    for rows, passes in ((1, 1), (2, 1), (4, 1), (5, 2), (8, 2), (9, 3)):
        rest = (rows * 24 * (2e6 + 2e7) / 1e10
                + 0.002 + cm.MESSAGE_OVERHEAD_S + 2 * rows * 1024 * 4 / cm.LINK_BYTES_PER_S)
        assert cm._stage_call_s(costs, workers[0], 0, 24, rows, True) == pytest.approx(
            passes * 24 * (MB + 4 * MB) / cm.WEIGHT_BYTES_PER_S + rest)
        assert cm._stage_call_s(costs, gpu, 0, 24, rows, True) == pytest.approx(
            24 * (MB + 4 * MB) / cm.WEIGHT_BYTES_PER_S + rest)
    step = 2 * 24 * (MB + 4 * MB) / cm.WEIGHT_BYTES_PER_S + 8 * (24 * (2e6 + 2e7) + 1e7) / 1e10
    assert cm.serving_step_s(costs, coord, workers, (("c", 0, 24),), 8) == pytest.approx(step)


def test_layer_costs_of_a_moe_file_name_its_routed_experts(tmp_path):
    from swarm.compute.model import load_model
    from swarm.peer.weights.sizes import layer_nbytes
    from tests.peer._swarm_models import build

    model = load_model(build("qwen3_moe", tmp_path))
    c, costs = model.config, LayerCosts.from_model(model)
    _, ffn = layer_nbytes(model)
    assert c.moe_layers
    for i in range(c.n_layers):
        moe = c.is_moe_layer(i)
        assert costs.expert_bytes[i] == (ffn[i] if moe else 0)
        assert (costs.n_experts[i], costs.top_k[i]) == ((c.n_experts, c.top_k) if moe else (0, 0))
    i = c.moe_layers[0]
    assert costs.read_bytes(i, 1) == pytest.approx(costs.attn_bytes[i] + ffn[i] * c.top_k / c.n_experts)


def test_weights_that_dominate_a_moe_step_still_split():
    """The shape that keeps a dense model alone at 4 sequences (2·10⁶ FLOPs, 200 MiB a layer)
    splits as 64 experts top 8: alone, one step of 4 reads 26.5 experts in each of 24 layers
    (636); split 12/12, each peer reads 2 · 15 in each of its 12 (360) and computes half the
    FLOPs."""
    dense = layers(ffn_flops=2e6, ffn_bytes=200 * MB)
    moe = LayerCosts(dense.attn_flops, dense.ffn_flops, dense.attn_bytes, dense.ffn_bytes, 1e7, 1024,
                     expert_bytes=dense.ffn_bytes, n_experts=(64,) * 24, top_k=(8,) * 24)
    coord, workers = pair()
    assert cm.choose(dense, coord, workers, sequences=4)[0].layout == "local"
    assert cm.choose(moe, coord, workers, sequences=4)[0].layout == "stages"


def test_row_tile_is_the_cpu_kernels_largest_tile_of_activation_rows():
    """The price's kernel pass is the kernels' own: every table's largest count of activation
    rows (a step of 5 rows is two passes over the weights)."""
    from swarm.compute import qkernels

    tables = (qkernels._TILES, qkernels._K_TILES, qkernels._D2_TILES,
              qkernels._K_TILES_NO_AVX512, qkernels._D2_TILES_NO_AVX512)
    assert {max(t for _, t in table) for table in tables} == {cm.ROW_TILE}


def three_cpu_stages(workers=None):
    """24 dense layers whose weights are most of a decode call, over the coordinator and two
    workers of the same speed (CPU unless ``workers`` says otherwise)."""
    costs = LayerCosts((2e6,) * 24, (2e7,) * 24, (MB,) * 24, (40 * MB,) * 24, 1e7, 1024)
    coord = PeerCost("c", 10**12, 10.0)
    workers = workers or [PeerCost("w1", 10**12, 10.0, 0.002), PeerCost("w2", 10**12, 10.0, 0.002)]
    return cm.GroupPricer(costs, coord, workers, (("c", 0, 8), ("w1", 8, 16), ("w2", 16, 24)))


def test_groups_are_cut_on_the_kernels_row_tile():
    """16 sequences over three CPU stages: four groups of 4 (one kernel pass each) take less a
    round than 6 + 5 + 5 (two passes each) or five groups; over two stages 8 + 8 (four passes a
    peer either way, fewer messages) but 12 go as three groups of 4; 8 over three stages keep one
    group per stage; one sequence is one group; a tie goes to fewer groups."""
    three = three_cpu_stages()
    assert three.best_groups(16) == [4, 4, 4, 4]
    four, by_stage = three.round_s([4, 4, 4, 4]), three.round_s([6, 5, 5])
    assert four < by_stage and four < three.round_s([4, 3, 3, 3, 3])
    # each peer's work: 4 calls of one pass against 3 of two
    assert by_stage == pytest.approx(sum(three.calls(6)) + 1e7 * 6 / 1e10)  # the group of 6 goes round slowest
    assert three.best_groups(8) == [3, 3, 2] and three.best_groups(1) == [1] and three.best_groups(0) == []
    costs, coord = three.costs, three.coord
    worker, stages = [PeerCost("w1", 10**12, 10.0, 0.002)], (("c", 0, 12), ("w1", 12, 24))
    two = cm.GroupPricer(costs, coord, worker, stages)
    assert two.best_groups(16) == [8, 8] and two.best_groups(12) == [4, 4, 4] and two.best_groups(9) == [3, 3, 3]
    assert cm.serving_step_s(costs, coord, worker, stages, 12) == pytest.approx(two.round_s([4, 4, 4]))
    # whole tiles: 50 sequences as 13 passes, not the 14 of 17 + 17 + 16
    assert cm.tiled_groups(50, 3) == [20, 16, 14] and cm.tiled_groups(16, 3) == [8, 4, 4]
    assert cm.tiled_groups(5, 2) == [4, 1] and sum(cm.tiled_groups(50, 4)) == 50
    assert two.best_groups(50) == [20, 16, 14] and three.best_groups(50) == [16, 12, 12, 10]  # evenly: 14 passes
    assert cm.tiled_groups(5, 3) == [4, 1] and cm.tiled_groups(0, 3) == []  # fewer tiles than groups
    assert two.row_tile() == three.row_tile() == cm.ROW_TILE
    # a round is the slowest group's own pass when that outlasts the busiest peer's work
    slow_head = cm.GroupPricer(dataclasses.replace(costs, head_flops=5e9), coord, worker, stages)
    assert slow_head.round_s([8, 8]) == pytest.approx(max(sum(slow_head.calls(8)) + 8 * 5e9 / 1e10,
                                                          2 * (slow_head.calls(8)[0] + 8 * 5e9 / 1e10)))
